"""Direct logit attribution: the final logit (or a logit difference) at one position split
over the components that write to the residual stream, through the final norm with its scale
frozen at its value on the prompt."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxlens import core as jl
from jaxlens.lens._logit import layer_count
from jaxlens.lens._readout import LensError, _stats_dtype, out_projection, readout

__all__ = ["Attribution", "direct_logit_attribution"]


@functools.partial(
  jax.tree_util.register_dataclass,
  data_fields=["parts", "logit"],
  meta_fields=["labels", "layer", "component", "head"],
)
@dataclasses.dataclass(frozen=True)
class Attribution:
  """A direct logit attribution: ``parts.sum(-1) == logit``. A pytree (``parts`` and
  ``logit`` are its leaves), so ``jax.jit`` can return it.

  Attributes:
    parts: ``(batch, n_parts)``, each component's share of the logit.
    labels: one label per part: ``"embed"``, ``"L3H2"`` (layer 3's head 2), ``"L3 attn bias"``,
      ``"L3 mlp"``, ``"bias"`` (the final norm's and the unembedding's biases).
    layer: per part, its block (-1 for the embeddings, ``n_layers`` for the final biases).
    component: per part ``"embed"``, ``"head"``, ``"attn_bias"``, ``"mlp"`` or ``"bias"``.
    head: per part, the head of a ``"head"`` part, else -1.
    logit: ``(batch,)``, the logit (or logit difference) before any final soft-cap.
  """

  parts: Any
  labels: tuple[str, ...]
  layer: tuple[int, ...]
  component: tuple[str, ...]
  head: tuple[int, ...]
  logit: Any

  def by_layer(self):
    """``(batch, n_layers + 2)``: the embeddings, each block (its heads, attention bias and
    MLP summed), and the final biases."""
    groups = np.asarray(self.layer) + 1
    onehot = np.eye(int(groups.max()) + 1)[groups]
    return self.parts @ jnp.asarray(onehot, self.parts.dtype)

  def heads(self):
    """``(batch, n_layers, n_heads)``: each head's part."""
    sel = np.flatnonzero(np.asarray(self.component) == "head")
    layers, heads = np.asarray(self.layer)[sel], np.asarray(self.head)[sel]
    out = jnp.zeros((self.parts.shape[0], layers.max() + 1, heads.max() + 1), self.parts.dtype)
    return out.at[:, layers, heads].set(self.parts[:, sel])


def _target_ids(target, batch: int, vocab: int, name: str):
  ids = jnp.asarray(target)
  if not jnp.issubdtype(ids.dtype, jnp.integer) or ids.ndim > 1:
    raise LensError(
      f"{name} must be an int token id or an int array of one per batch row, got "
      f"{ids.dtype} of shape {ids.shape}",
      code="invalid_argument",
      received=repr(target),
      fix=f"{name}=token_id (or jnp.asarray([id_row0, id_row1]))",
    )
  if not isinstance(ids, jax.core.Tracer):
    a = np.asarray(ids)
    bad = (a < 0) | (a >= vocab)
    if bad.any():
      raise LensError(
        f"{name}: token id {int(a[bad].flat[0])} is outside the vocabulary [0, {vocab})",
        code="index_out_of_range",
        expected=f"[0, {vocab})",
        received=int(a[bad].flat[0]),
        fix="a token id of the model's tokenizer",
      )
  return jnp.broadcast_to(ids, (batch,))


def direct_logit_attribution(
  model, variables, tokens, target, *, minus=None, position: int = -1, attention_mask=None
) -> Attribution:
  """The logit of ``target`` (minus that of ``minus``) at ``position``, split over components.

  The residual stream leaving the last block is the sum of the embeddings, every block's
  attention output and every MLP's output. The attention output is split by head: head ``h``
  writes ``z_h @ W_O[h]`` (its slice of ``attn/z`` times its rows of the output projection),
  plus the projection's bias (``"attn bias"``); Gemma's norm after the attention is applied with
  its scale frozen too. Through the final norm with its scale frozen at its value on this
  prompt (the attribution convention, unlike the logit lens, which recomputes it), the logit is
  linear in these parts, so they sum to it exactly, the final norm's bias and the
  unembedding's bias being one more part (``"bias"``). A final soft-cap (Gemma 2) is not
  linear: the parts sum to the logit before it.

  Args:
    model: a decoder of :mod:`jaxlens.models`.
    variables: its variables.
    tokens: int ``(batch, seq)``.
    target: the token id whose logit is split (an int, or one per batch row).
    minus: optional token id(s): split ``logit[target] - logit[minus]`` instead.
    position: the position read (default the last).
    attention_mask: optional padding mask.

  Returns:
    An :class:`Attribution`.

  Raises:
    LensError: ``index_out_of_range`` (a token id outside the vocabulary, a position outside
      the sequence), ``invalid_argument``, ``lens_unsupported_model``.
  """
  ro = readout(model, variables)
  n = layer_count(model)
  tokens = jnp.asarray(tokens)
  batch, seq = tokens.shape[:2]
  if not isinstance(position, (int, np.integer)) or not -seq <= position < seq:
    raise LensError(
      f"position {position!r} is outside the sequence of {seq} tokens",
      code="index_out_of_range",
      expected=f"an int in [{-seq}, {seq})",
      received=repr(position),
      fix="position=-1 (the last token)",
    )
  tgt = _target_ids(target, batch, ro.vocab, "target")
  other = None if minus is None else _target_ids(minus, batch, ro.vocab, "minus")
  final = model.block_site(n - 1, "resid_post")
  names = ("attn/z", "attn_out", "mlp_out")
  sites = [model.block_site(0, "resid_pre"), final]
  sites += [model.block_site(i, s) for i in range(n) for s in names]
  kwargs = {} if attention_mask is None else {"attention_mask": attention_mask}
  t = jl.trace(
    model, variables, tokens, save=[jl.label(s) for s in sites], keep_inputs=False, **kwargs
  )

  def at(site):
    return t[site].out[:, position]

  sdt = _stats_dtype(ro.dtype)
  x = at(final)
  u = ro.rows(tgt).astype(sdt)
  if other is not None:
    u = u - ro.rows(other).astype(sdt)
  # logit = u . norm(x) + biases; with the scale frozen, norm(c) is linear in c and
  # u . (gain * C(c) * s) = c . (s * C(gain * u)) (centring C is self-adjoint).
  gu = u * ro.gain.astype(sdt)
  if ro.center:
    gu = gu - jnp.mean(gu, axis=-1, keepdims=True)
  w = ro.scale(x) * gu  # (batch, d)

  def dot(c):  # c: (batch, ..., d)
    return jnp.einsum("b...d,bd->b...", c.astype(sdt), w)

  parts, labels, layer, comp, head = [dot(at(sites[0]))[:, None]], ["embed"], [-1], ["embed"], [-1]
  for i in range(n):
    wo, bo, post_gain, eps = out_projection(model, variables, i)
    z = at(model.block_site(i, "attn/z"))  # (batch, heads, head_dim)
    y = jnp.einsum("bhe,hed->bhd", z, wo.astype(z.dtype))  # each head's write
    if post_gain is not None:  # a norm after the attention (Gemma), its scale frozen
      total = jnp.sum(y, axis=1).astype(sdt)
      s = jax.lax.rsqrt(jnp.mean(total * total, axis=-1, keepdims=True) + eps)
      y = y.astype(sdt) * (s[:, None] * post_gain.astype(sdt))
    heads = y.shape[1]
    parts.append(dot(y))
    labels += [f"L{i}H{h}" for h in range(heads)]
    layer += [i] * heads
    comp += ["head"] * heads
    head += list(range(heads))
    if bo is not None:
      parts.append(dot(jnp.broadcast_to(bo, x.shape))[:, None])
      labels.append(f"L{i} attn bias")
      layer.append(i)
      comp.append("attn_bias")
      head.append(-1)
    parts.append(dot(at(model.block_site(i, "mlp_out")))[:, None])
    labels.append(f"L{i} mlp")
    layer.append(i)
    comp.append("mlp")
    head.append(-1)
  bias = jnp.zeros((batch,), sdt)
  if ro.bias is not None:
    bias = bias + u @ ro.bias.astype(sdt)
  if ro.head_bias is not None:
    hb = ro.head_bias.astype(sdt)
    bias = bias + hb[tgt] - (0 if other is None else hb[other])
  parts.append(bias[:, None])
  labels.append("bias")
  layer.append(n)
  comp.append("bias")
  head.append(-1)
  normed = ro.norm(x).astype(sdt)
  logit = jnp.sum(u * normed, axis=-1)
  if ro.head_bias is not None:
    hb = ro.head_bias.astype(sdt)
    logit = logit + hb[tgt] - (0 if other is None else hb[other])
  return Attribution(
    parts=jnp.concatenate(parts, axis=1),
    labels=tuple(labels),
    layer=tuple(layer),
    component=tuple(comp),
    head=tuple(head),
    logit=logit,
  )
