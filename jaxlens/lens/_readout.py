"""The final norm and unembedding of a zoo decoder as data (:class:`Readout`), for the lenses
that need more than :meth:`jaxlens.protocol.Decoder.unembed`: the norm with its scale frozen
(direct logit attribution), the unembedding's rows one vocabulary chunk at a time (top-k
without a ``(layers, positions, vocab)`` array), and each block's output projection per head.

The logit lens itself calls the model's own ``unembed``; the tests check that a
:class:`Readout` computes the same logits on every family.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from jaxlens.core import InvalidArgumentError
import jaxlens.models as jm

__all__ = ["LensError", "Readout", "readout"]


class LensError(InvalidArgumentError):
  """A lens refuses its input: a model it cannot read, a layer or token out of range, a lens
  file that does not match the model, training data with NaN (``docs/errors.md``)."""


def _stats_dtype(dtype) -> Any:
  # The zoo's norms compute their statistics in at least float32.
  return jnp.dtype(dtype) if jnp.dtype(dtype).itemsize >= 4 else jnp.dtype(jnp.float32)


def _softcap(x, cap):
  return x if cap is None else cap * jnp.tanh(x / cap)


@dataclasses.dataclass(frozen=True)
class Readout:
  """A decoder's final norm and unembedding.

  Attributes:
    center: whether the norm subtracts the mean (LayerNorm) or not (RMSNorm).
    gain: the norm's effective per-feature gain (Gemma's ``1 + weight``).
    bias: the norm's bias, or None.
    eps: the norm's epsilon.
    table: the unembedding as stored: rows ``(vocab, d_model)`` (a tied embedding or a compact
      matrix) or a kernel ``(d_model, vocab)``.
    is_kernel: whether ``table`` is a ``(d_model, vocab)`` kernel.
    head_bias: the unembedding's bias ``(vocab,)``, or None.
    softcap: the final logit soft-cap (Gemma 2), or None.
    vocab: the vocabulary size.
    dtype: the model's computation dtype.
    gemma: Gemma's norm (``gain`` is ``1 + weight``, applied in the statistics dtype).
  """

  center: bool
  gain: Any
  bias: Any
  eps: float
  table: Any
  is_kernel: bool
  head_bias: Any
  softcap: float | None
  vocab: int
  dtype: Any
  gemma: bool = False

  def scale(self, x):
    """The norm's per-position scale ``1 / sqrt(var + eps)`` of ``x`` (``(..., d)``), shape
    ``(..., 1)``, in the statistics dtype."""
    h = x.astype(_stats_dtype(self.dtype))
    if self.center:
      h = h - jnp.mean(h, axis=-1, keepdims=True)
    return jax.lax.rsqrt(jnp.mean(h * h, axis=-1, keepdims=True) + self.eps)

  def norm(self, x, scale=None):
    """The final norm of ``x``; with ``scale`` given, the norm with that scale frozen (affine
    in ``x``)."""
    sdt = _stats_dtype(self.dtype)
    h = x.astype(sdt)
    if self.center:
      h = h - jnp.mean(h, axis=-1, keepdims=True)
    h = h * (self.scale(x) if scale is None else scale)
    if self.center:  # flax's and the zoo's LayerNorm: the affine part in the statistics dtype
      out = h * self.gain.astype(sdt)
      return (out if self.bias is None else out + self.bias.astype(sdt)).astype(self.dtype)
    if self.gemma:
      return (h * self.gain.astype(sdt)).astype(self.dtype)
    return self.gain * h.astype(self.dtype)

  def rows(self, index) -> Any:
    """The unembedding rows of the token ids ``index`` (any shape), ``(*index.shape, d)``."""
    index = jnp.asarray(index)
    if jm.compact.is_compact(self.table):
      return self.table.rows(index, self.dtype)
    if self.is_kernel:
      return jnp.moveaxis(jnp.take(self.table, index, axis=1), 0, -1)
    return jnp.take(self.table, index, axis=0)

  def chunk_rows(self, start, size: int) -> Any:
    """``size`` consecutive unembedding rows from ``start`` (a traced int is fine)."""
    if jm.compact.is_compact(self.table):
      return self.table.rows(start + jnp.arange(size), self.dtype)
    if self.is_kernel:
      return jax.lax.dynamic_slice_in_dim(self.table, start, size, axis=1).T
    return jax.lax.dynamic_slice_in_dim(self.table, start, size, axis=0)

  def chunk_logits(self, normed, start, size: int):
    """The logits of tokens ``start .. start + size - 1`` of normed residuals ``(..., d)``."""
    w = self.chunk_rows(start, size)
    y = jnp.einsum("...d,vd->...v", normed, w.astype(normed.dtype))
    if self.head_bias is not None:
      y = y + jax.lax.dynamic_slice_in_dim(self.head_bias, start, size).astype(y.dtype)
    return _softcap(y, self.softcap)

  def logits(self, x):
    """All the logits of residuals ``x`` (``(..., d)``): the model's ``unembed``."""
    return self.chunk_logits(self.norm(x), 0, self.vocab)


def _is_gemma(model) -> bool:
  return isinstance(model, jm.Gemma3)


def _params(model, variables):
  if not isinstance(variables, dict) or "params" not in variables:
    raise LensError(
      "variables must be the model's variables, a dict with a 'params' collection",
      code="invalid_argument",
      received=type(variables).__name__,
      fix="the variables of model.init / a loader's lm.variables",
    )
  return variables["params"]


def unsupported(model, what: str) -> LensError:
  return LensError(
    f"{type(model).__name__} has no {what} a lens can read",
    code="lens_unsupported_model",
    received=type(model).__name__,
    fix="a decoder of jaxlens.models (Llama family, GPT-2, GPT-NeoX, Gemma 3/2)",
  )


def readout(model, variables) -> Readout:
  """The :class:`Readout` of a zoo decoder (``ln_final`` and ``lm_head`` or the tied
  ``embed``).

  Raises:
    LensError: ``lens_unsupported_model`` for a model without them.
  """
  params = _params(model, variables)
  cfg = getattr(model, "config", None)
  ln = params.get("ln_final") if hasattr(params, "get") else None
  if cfg is None or ln is None or not hasattr(model, "unembed"):
    raise unsupported(model, "final norm and unembedding")
  gemma = _is_gemma(model)
  if "scale" in ln:
    center, gain, bias = True, ln["scale"], ln.get("bias")
  elif "weight" in ln:
    center, bias = False, None
    gain = ln["weight"]
  else:
    raise unsupported(model, "final norm")
  if getattr(cfg, "tie_embeddings", False):
    table, is_kernel, head_bias = params["embed"]["embedding"], False, None
  elif "lm_head" in params:
    head = params["lm_head"]
    table = head["kernel"]
    is_kernel, head_bias = not jm.compact.is_compact(table), head.get("bias")
  else:
    raise unsupported(model, "unembedding")
  if gemma:
    gain = 1.0 + gain.astype(_stats_dtype(cfg.dtype))
  return Readout(
    center=center,
    gain=gain,
    bias=bias,
    eps=float(cfg.norm_eps),
    table=table,
    is_kernel=is_kernel,
    head_bias=head_bias,
    softcap=getattr(cfg, "final_softcap", None),
    vocab=int(cfg.vocab_size),
    dtype=jnp.dtype(cfg.dtype),
    gemma=gemma,
  )


def block_params(model, variables, layer: int):
  """Block ``layer``'s parameters (the scanned form's slice of the stacked ones)."""
  if hasattr(model, "block_params"):
    return model.block_params(variables, layer)
  return _params(model, variables)[f"blocks_{layer}"]


_OUT_PROJ = ("o_proj", "c_proj", "dense")  # Llama/Gemma, GPT-2, GPT-NeoX


def out_projection(model, variables, layer: int):
  """Block ``layer``'s attention output projection per head and what follows it:
  ``(w (heads, head_dim, d_model), bias or None, post_gain or None, post_eps)``; ``post_gain``
  is the effective gain of a norm applied to the attention output (Gemma's ``ln_1_post``)."""
  p = block_params(model, variables, layer)
  attn = p.get("attn", {})
  name = next((n for n in _OUT_PROJ if n in attn), None)
  if name is None:
    raise unsupported(model, "attention output projection")
  proj = jm.compact.dequantize(attn[name], jnp.dtype(model.config.dtype))
  kernel = proj["kernel"]
  heads = model.config.n_heads
  w = kernel.reshape(heads, kernel.shape[0] // heads, kernel.shape[1])
  post = p.get("ln_1_post")
  post_gain = None
  if post is not None:
    post_gain = 1.0 + post["weight"].astype(_stats_dtype(model.config.dtype))
  return w, proj.get("bias"), post_gain, float(model.config.norm_eps)
