"""Patchscopes (Ghandeharioun et al., 2024): a source prompt's residual stream at (layer,
position) written into a target prompt's position at a target layer, and the target run read
out, over every source layer x target layer in one compiled program."""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxlens import core as jl
from jaxlens import generation
from jaxlens import intervention as ji
from jaxlens.lens._logit import check_layers, lens_sites, residuals
from jaxlens.lens._readout import LensError
from jaxlens.protocol import Decoder, Scannable

__all__ = ["PatchscopeGeneration", "patchscope", "patchscope_generate"]


def _check_position(position, seq: int, what: str) -> int:
  if not isinstance(position, (int, np.integer)) or not -seq <= position < seq:
    raise LensError(
      f"{what} {position!r} is outside the sequence of {seq} tokens",
      code="index_out_of_range",
      expected=f"an int in [{-seq}, {seq})",
      received=repr(position),
      fix=f"{what}=-1 (the last token)",
    )
  return int(position) % seq


def _sources(model, variables, source, position, layers, attention_mask):
  source = jnp.asarray(source)
  position = _check_position(position, source.shape[1], "source_position")
  res = residuals(model, variables, source, layers=layers, attention_mask=attention_mask)
  return res[:, :, position]  # (n_src, batch, d)


def _patch_rules(model, target_layers, target_position, row_layer, vectors):
  """One rule per target layer's site: the rows whose ``row_layer`` is that layer get
  ``vectors`` (rows, d) at ``target_position``; the others keep their value."""
  sites = lens_sites(model)

  def rule(j):
    def write(x):
      on = (row_layer == j)[:, None]
      v = vectors.astype(x.dtype)
      return x.at[:, target_position].set(jnp.where(on, v, x[:, target_position]))

    return jl.when(jl.label(sites[j]), ji.hook(write))

  return [rule(j) for j in dict.fromkeys(target_layers)]


def patchscope(
  model,
  variables,
  source,
  target,
  *,
  source_position: int = -1,
  target_position: int = -1,
  source_layers=None,
  target_layers=None,
  read=None,
  read_position: int | None = None,
  attention_mask=None,
):
  """Patchscope grid: every source layer's residual at ``source_position`` written into the
  target prompt at ``target_position`` at every target layer, in one compiled program (the
  grid is a ``jax.vmap`` over a patch, not a loop of forwards).

  Layers are the lens's (:func:`jaxlens.lens.lens_sites`): layer ``i < n_layers`` is the
  residual stream entering block ``i``; layer ``n_layers`` the last block's output.

  Args:
    model: a decoder of :mod:`jaxlens.models`.
    variables: its variables.
    source: int ``(batch, seq)`` the source prompt(s).
    target: int ``(batch or 1, seq_t)`` the target prompt (e.g. an identity prompt
      ``"cat -> cat; 1135 -> 1135; hello -> hello; ? ->"``).
    source_position, target_position: the positions read and written.
    source_layers, target_layers: lens layers (None: all ``n_layers + 1``).
    read: a function of the patched run's logits at ``read_position`` ``(batch, vocab)``
      returning what is kept per cell (default: those logits). Only that position is
      unembedded: the model's final norm and unembedding run on its residual stream alone.
    read_position: the target position read (default ``target_position``).
    attention_mask: the source's padding mask (the target is not padded).

  Returns:
    ``read``'s value for each cell, stacked ``(len(source_layers), len(target_layers), ...)``.

  Raises:
    LensError: ``index_out_of_range`` (a layer or position).

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from jaxlens import lens
    >>> from jaxlens.models import Llama, LlamaConfig
    >>> model = Llama(LlamaConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4,
    ...                           n_kv_heads=2, d_mlp=48))
    >>> tokens = jnp.arange(6)[None]
    >>> variables = model.init(jax.random.key(0), tokens)
    >>> lens.patchscope(model, variables, tokens, tokens[:, :4]).shape
    (3, 3, 1, 64)
  """
  src_layers = check_layers(model, source_layers, what="source_layers")
  tgt_layers = check_layers(model, target_layers, what="target_layers")
  target = jnp.asarray(target)
  tpos = _check_position(target_position, target.shape[1], "target_position")
  vectors = _sources(model, variables, source, source_position, src_layers, attention_mask)
  batch = vectors.shape[1]
  target = jnp.broadcast_to(target, (batch, target.shape[1]))
  rpos = (
    tpos
    if read_position is None
    else _check_position(read_position, target.shape[1], "read_position")
  )
  read = _identity if read is None else read
  layer_ids = jnp.asarray(tgt_layers, jnp.int32)
  if isinstance(model, Decoder) and rpos >= tpos:
    return _grid_from_layer(
      model, variables, target, vectors, layer_ids, tgt_layers=tgt_layers, tpos=tpos, rpos=rpos,
      read=read,
    )  # fmt: skip
  return _grid(
    model,
    variables,
    target,
    vectors,
    layer_ids,
    tgt_layers=tgt_layers,
    tpos=tpos,
    rpos=rpos,
    read=read,
  )


def _identity(logits):
  return logits


def _target_run(model, variables, target, loop: bool):
  """The target's run, once: its residual stream entering each block and leaving the last
  ``(L + 1, batch, seq, d)``, and each block's keys and values ``(L, batch, seq, ...)``
  (``loop``: ``model`` is a scanned form, whose sites stack the layers)."""
  n = len(model.layer_sites())
  names = ("resid_pre", "attn/k", "attn/v")
  if loop:
    stacked = {k: jl.module(model.stack_site(k)) for k in names}
    final = jl.module(model.stack_site("resid_post"), layer=n - 1)
    t = jl.trace(model, variables, target, keep_inputs=False, save=[*stacked.values(), final])
    read = {k: t[sel].out for k, sel in stacked.items()}
    last = t[final].out
  else:
    at = model.block_site
    save = [jl.module(at(j, k)) for j in range(n) for k in names]
    t = jl.trace(
      model,
      variables,
      target,
      keep_inputs=False,
      save=[*save, jl.module(at(n - 1, "resid_post"))],
    )
    read = {k: jnp.stack([t[at(j, k)].out for j in range(n)]) for k in names}
    last = t[at(n - 1, "resid_post")].out
  stream = jnp.concatenate([read["resid_pre"], last[None]])
  return stream, read["attn/k"], read["attn/v"]


@functools.partial(jax.jit, static_argnames=("model", "tgt_layers", "tpos", "rpos", "read"))
def _grid_from_layer(model, variables, target, vectors, layer_ids, *, tgt_layers, tpos, rpos, read):
  """The grid of a causal decoder without rerunning what the patch cannot change: the target
  runs once; a patch at lens layer ``j`` and position ``p`` changes nothing before block ``j``
  nor before position ``p``, so each cell runs only blocks ``j .. L-1`` on positions ``p ..``,
  attending to the target run's keys and values before ``p``. The target layers are a
  ``lax.map`` (each row's block loop starts at its own layer; the scanned form's blocks are one
  ``fori_loop`` whose start is data), the source vectors of a row a ``vmap``."""
  n_layers = len(model.layer_sites())
  form = model.scanned(variables) if isinstance(model, Scannable) else None
  loop = form is not None
  if loop:
    model, variables = form
  stream, keys, values = _target_run(model, variables, target, loop)
  seq = target.shape[1]
  positions = jnp.arange(tpos, seq, dtype=jnp.int32)[None]
  mask = (jnp.arange(seq, dtype=jnp.int32)[None, :] <= positions[0][:, None])[
    None, None
  ]  # (1, 1, n, seq)

  def block(j, x):
    return model.run_block(
      variables,
      j,
      x,
      positions,
      past_keys=keys[j][:, :tpos],
      past_values=values[j][:, :tpos],
      mask=mask,
    )

  def run_from(start, x):
    if loop:
      return jax.lax.fori_loop(start, n_layers, block, x)
    for j in range(n_layers):
      x = jax.lax.cond(j >= start, lambda x, j=j: block(j, x), lambda x: x, x)
    return x

  def row(j):
    x0 = stream[j][:, tpos:]

    def cell(vector):  # (batch, d)
      x = x0.at[:, 0].set(vector.astype(x0.dtype))
      x = run_from(j, x)[:, rpos - tpos : rpos - tpos + 1]
      return read(model.unembed(variables, x)[:, 0])

    return jax.vmap(cell)(vectors)

  del tgt_layers  # part of the cache key only
  return jnp.swapaxes(jax.lax.map(row, layer_ids), 0, 1)


@functools.partial(jax.jit, static_argnames=("model", "tgt_layers", "tpos", "rpos", "read"))
def _grid(model, variables, target, vectors, layer_ids, *, tgt_layers, tpos, rpos, read):
  """The grid as one program (cached by the model, layers, positions and ``read``)."""
  final = jl.label(lens_sites(model)[-1])

  def cell(vector, layer):  # vector (batch, d), layer: the target layer (traced)
    row_layer = jnp.broadcast_to(layer, vector.shape[:1])
    spec = _patch_rules(model, tgt_layers, tpos, row_layer, vector)
    t = jl.trace(model, variables, target, intervene=spec, save=final, keep_inputs=False)
    # Only the read position is unembedded (the model's own logits are left unused).
    resid = t[lens_sites(model)[-1]].out[:, rpos : rpos + 1]
    return read(model.unembed(variables, resid)[:, 0])

  over_targets = jax.vmap(cell, in_axes=(None, 0))
  return jax.vmap(over_targets, in_axes=(0, None))(vectors, layer_ids)


class PatchscopeGeneration(NamedTuple):
  """What :func:`patchscope_generate` returns.

  Attributes:
    tokens: ``(len(source_layers), len(target_layers), batch, max_new_tokens)`` the new tokens.
    generation: the underlying :class:`jaxlens.generation.Generation` (its rows are the cells,
      source layer major).
  """

  tokens: Any
  generation: Any


def patchscope_generate(
  model,
  variables,
  source,
  target,
  max_new_tokens: int = 8,
  *,
  source_position: int = -1,
  target_position: int = -1,
  source_layers=None,
  target_layers=None,
  attention_mask=None,
) -> PatchscopeGeneration:
  """Generation-based patchscope: the target prompt continued by :func:`jaxlens.generate`
  with the patch written in the prefill call; the patched position's keys and values stay in
  the KV cache, so every new token sees the patch (it is held at its position). Every cell of
  the source layers x target layers grid is one row of one generation.

  Args:
    model, variables, source, target, source_position, target_position, source_layers,
      target_layers, attention_mask: as :func:`patchscope`.
    max_new_tokens: how many tokens to generate (greedy).

  Returns:
    A :class:`PatchscopeGeneration`.
  """
  src_layers = check_layers(model, source_layers, what="source_layers")
  tgt_layers = check_layers(model, target_layers, what="target_layers")
  target = jnp.asarray(target)
  tpos = _check_position(target_position, target.shape[1], "target_position")
  vectors = _sources(model, variables, source, source_position, src_layers, attention_mask)
  n_src, batch, d = vectors.shape
  n_tgt = len(tgt_layers)
  # Rows: source layer major, then target layer, then the batch.
  rows = jnp.broadcast_to(vectors[:, None], (n_src, n_tgt, batch, d)).reshape(-1, d)
  row_layer = jnp.broadcast_to(
    jnp.asarray(tgt_layers, jnp.int32)[None, :, None], (n_src, n_tgt, batch)
  ).reshape(-1)
  prompt = jnp.broadcast_to(target, (batch, target.shape[1]))
  prompt = jnp.broadcast_to(prompt[None], (n_src * n_tgt, *prompt.shape)).reshape(
    -1, target.shape[1]
  )
  spec = _patch_rules(model, tgt_layers, tpos, row_layer, rows)
  gen = generation.generate(model, variables, prompt, max_new_tokens, prefill=spec)
  return PatchscopeGeneration(gen.tokens.reshape(n_src, n_tgt, batch, -1), gen)
