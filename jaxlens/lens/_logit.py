"""The logit lens: each layer's residual stream read through the model's real final norm and
unembedding (recomputed on that residual, not the final position's cached scale), and its
top-k tokens computed one vocabulary chunk at a time."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxlens import core as jl
from jaxlens.lens._readout import LensError, readout, unsupported

__all__ = [
  "TopTokens",
  "check_layers",
  "layer_count",
  "lens_sites",
  "logit_lens",
  "logit_lens_topk",
  "residuals",
]


def layer_count(model) -> int:
  """The model's number of blocks (``len(model.layer_sites())``).

  Raises:
    LensError: ``lens_unsupported_model`` for a model that is not a decoder of the zoo (the
      lenses read its configuration, its ``resid_pre``/``resid_post`` sites and its final norm
      and unembedding).
  """
  if not hasattr(model, "layer_sites") or not hasattr(model, "block_site"):
    raise unsupported(model, "layer sites (jaxlens.protocol.LayeredModel)")
  if getattr(model, "config", None) is None or not hasattr(model, "unembed"):
    raise unsupported(model, "final norm and unembedding")
  return len(model.layer_sites())


def lens_sites(model) -> tuple[str, ...]:
  """The residual stream a lens reads at each of its ``n_layers + 1`` layers: layer ``i <
  n_layers`` is the stream entering block ``i`` (``blocks_{i}/resid_pre``; layer 0 the
  embeddings), layer ``n_layers`` the stream leaving the last block (``resid_post``), whose
  lens is the model's own logits."""
  n = layer_count(model)
  return (*model.layer_sites(), model.block_site(n - 1, "resid_post"))


def check_layers(model, layers, *, what: str = "layers") -> tuple[int, ...]:
  """``layers`` (None: all ``n_layers + 1``; negative ints count from the end) as a tuple of
  ints in ``[0, n_layers]``; refuses others with ``index_out_of_range``."""
  n = layer_count(model) + 1
  if layers is None:
    return tuple(range(n))
  seq = [layers] if isinstance(layers, (int, np.integer)) else list(layers)
  out = []
  for layer in seq:
    if not isinstance(layer, (int, np.integer)) or isinstance(layer, bool):
      raise LensError(
        f"{what} must be ints, got {type(layer).__name__}",
        code="invalid_argument",
        received=repr(layer),
        fix=f"{what}=[0, 3, {n - 1}]",
      )
    if not -n <= layer < n:
      raise LensError(
        f"{what}: layer {layer} is outside the lens's {n} layers (0 = the embeddings, "
        f"{n - 1} = the last block's output)",
        code="index_out_of_range",
        expected=f"[{-n}, {n})",
        received=int(layer),
        fix=f"a layer in 0 .. {n - 1}",
      )
    out.append(int(layer) % n)
  return tuple(out)


def residuals(model, variables, tokens, *, layers=None, attention_mask=None):
  """The residual stream at each lens layer, ``(len(layers), batch, seq, d_model)``.

  Args:
    model: a decoder of :mod:`jaxlens.models` (a :class:`jaxlens.protocol.Decoder`).
    variables: its variables.
    tokens: int ``(batch, seq)``.
    layers: lens layers (:func:`lens_sites`); None for all ``n_layers + 1``.
    attention_mask: optional ``(batch, seq)`` padding mask.
  """
  layers = check_layers(model, layers)
  sites = lens_sites(model)
  chosen = [sites[i] for i in layers]
  kwargs = {} if attention_mask is None else {"attention_mask": attention_mask}
  t = jl.trace(
    model,
    variables,
    tokens,
    save=[jl.label(s) for s in dict.fromkeys(chosen)],
    keep_inputs=False,
    **kwargs,
  )
  return jnp.stack([t[s].out for s in chosen])


def logit_lens(model, variables, tokens, *, layers=None, attention_mask=None):
  """The logit lens: each layer's residual stream through the model's own final norm and
  unembedding (:meth:`jaxlens.protocol.Decoder.unembed`, with the family's arithmetic: Gemma's
  ``1 + weight`` norm and soft-cap, tied embeddings). The norm is recomputed on each layer's
  residual. The last layer's lens is the model's logits.

  Args:
    model: a decoder of :mod:`jaxlens.models`.
    variables: its variables.
    tokens: int ``(batch, seq)``.
    layers: lens layers (None: all ``n_layers + 1``; see :func:`lens_sites`).
    attention_mask: optional padding mask.

  Returns:
    Logits ``(len(layers), batch, seq, vocab)``. For a large vocabulary, prefer
    :func:`logit_lens_topk`, which never holds this array.

  Raises:
    LensError: ``index_out_of_range`` (a layer), ``lens_unsupported_model``.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from jaxlens import lens
    >>> from jaxlens.models import llama
    >>> model = llama.Llama(llama.LlamaConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4,
    ...                                       n_kv_heads=2, d_mlp=48))
    >>> tokens = jnp.arange(6)[None]
    >>> variables = model.init(jax.random.key(0), tokens)
    >>> lens.logit_lens(model, variables, tokens).shape
    (3, 1, 6, 64)
  """
  res = residuals(model, variables, tokens, layers=layers, attention_mask=attention_mask)
  n, b = res.shape[:2]
  out = model.unembed(variables, res.reshape(n * b, *res.shape[2:]))
  return out.reshape(n, b, *out.shape[1:])


class TopTokens(NamedTuple):
  """The lens's top tokens at each layer and position.

  Attributes:
    ids: int32 ``(layers, batch, seq, k)``, most probable first.
    logits: their logits.
    probs: their probabilities (softmax over the whole vocabulary).
    log_norm: ``(layers, batch, seq)``, the log-sum-exp of each row's logits.
  """

  ids: Any
  logits: Any
  probs: Any
  log_norm: Any


def topk_chunked(ro, normed, k: int, chunk: int) -> TopTokens:
  """Top-k and log-sum-exp of the logits of normed residuals ``(..., d)`` over the whole
  vocabulary, one ``chunk`` of it at a time (a scan over full chunks, then the rest): the
  largest intermediate is ``(..., chunk)``."""
  vocab = ro.vocab
  lead = normed.shape[:-1]
  ldt = jnp.result_type(ro.chunk_logits(normed[..., :1, :], 0, 1))

  def merge(carry, logits, start):
    vals, ids, m, s = carry
    cids = jnp.broadcast_to(start + jnp.arange(logits.shape[-1], dtype=jnp.int32), logits.shape)
    both = jnp.concatenate([vals, logits], axis=-1)
    both_ids = jnp.concatenate([ids, cids], axis=-1)
    vals, pick = jax.lax.top_k(both, k)
    ids = jnp.take_along_axis(both_ids, pick, axis=-1)
    new_m = jnp.maximum(m, jnp.max(logits, axis=-1))
    s = s * jnp.exp(m - new_m) + jnp.sum(jnp.exp(logits - new_m[..., None]), axis=-1)
    return vals, ids, new_m, s

  init = (
    jnp.full((*lead, k), -jnp.inf, ldt),
    jnp.zeros((*lead, k), jnp.int32),
    jnp.full(lead, -jnp.inf, ldt),
    jnp.zeros(lead, ldt),
  )
  full = vocab // chunk

  def step(carry, i):
    start = i * chunk
    return merge(carry, ro.chunk_logits(normed, start, chunk), start), None

  carry, _ = jax.lax.scan(step, init, jnp.arange(full, dtype=jnp.int32))
  if vocab % chunk:
    start = full * chunk
    carry = merge(carry, ro.chunk_logits(normed, start, vocab - start), start)
  vals, ids, m, s = carry
  log_norm = m + jnp.log(s)
  return TopTokens(ids, vals, jnp.exp(vals - log_norm[..., None]), log_norm)


def logit_lens_topk(
  model, variables, tokens, k: int = 5, *, layers=None, chunk: int = 8192, attention_mask=None
) -> TopTokens:
  """The logit lens's ``k`` most probable tokens at every layer and position, computed over the
  vocabulary one ``chunk`` of it at a time: no ``(layers, positions, vocab)`` array is made
  (the largest is ``(layers, batch, seq, chunk)``), so Gemma's 262k vocabulary fits.

  The final norm is recomputed on each layer's residual, with the model's arithmetic (the
  same logits as :func:`logit_lens`).

  Args:
    model, variables, tokens, layers, attention_mask: as :func:`logit_lens`.
    k: how many tokens.
    chunk: vocabulary entries per step.

  Returns:
    A :class:`TopTokens` of ``(len(layers), batch, seq, k)`` arrays.

  Raises:
    LensError: ``index_out_of_range`` (a layer), ``invalid_argument`` (``k`` or ``chunk``
      not a positive int, ``k`` above the vocabulary), ``lens_unsupported_model``.
  """
  ro = readout(model, variables)
  for name, value, top in (("k", k, ro.vocab), ("chunk", chunk, None)):
    if not isinstance(value, (int, np.integer)) or value < 1 or (top and value > top):
      raise LensError(
        f"{name} must be a positive int{f' at most the vocabulary ({top})' if top else ''}, "
        f"got {value!r}",
        code="invalid_argument",
        received=repr(value),
        fix=f"{name}=5" if name == "k" else "chunk=8192",
      )
  chunk = min(int(chunk), ro.vocab)
  res = residuals(model, variables, tokens, layers=layers, attention_mask=attention_mask)
  return topk_chunked(ro, ro.norm(res), int(k), chunk)
