"""The Flax modules the fast path produces: torch's conventions kept at each module's boundary
(channels-first convolutions, torch's LayerNorm and attention formulas).

Matrix products and convolutions run at ``jax.lax.Precision.HIGHEST`` so that float32 results
match torch's CPU results on accelerators too (no TF32).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import linen as nn
from flax.linen.dtypes import promote_dtype

__all__ = [
  "FlaxActivation",
  "FlaxCausalSelfAttention",
  "FlaxConv",
  "FlaxGPTBlock",
  "FlaxIdentity",
  "FlaxLayerNorm",
  "FlaxTinyGPT",
]

# Precision for every matmul/convolution of the converted modules: exact
# float32 products (torch's CPU behaviour) rather than TF32/bf16 passes.
_PRECISION = jax.lax.Precision.HIGHEST


# --------------------------------------------------------------------------
# Flax modules produced by the converters.
# --------------------------------------------------------------------------

# Elementwise functions, written to match torch's formulas.
_ACTIVATIONS: dict[str, Callable[[jax.Array], jax.Array]] = {
  "relu": jax.nn.relu,
  "gelu": lambda x: jax.nn.gelu(x, approximate=False),  # erf form
  "gelu_tanh": lambda x: jax.nn.gelu(x, approximate=True),  # tanh form
  "tanh": jnp.tanh,
  "sigmoid": jax.nn.sigmoid,
  "silu": jax.nn.silu,
}


class FlaxActivation(nn.Module):
  """A parameterless elementwise activation (a module, so it is a site).

  Attributes:
    kind: Key of ``_ACTIVATIONS``: ``"relu"``, ``"gelu"`` (exact erf),
      ``"gelu_tanh"``, ``"tanh"``, ``"sigmoid"`` or ``"silu"``.
  """

  kind: str

  def __call__(self, x: jax.Array) -> jax.Array:
    return _ACTIVATIONS[self.kind](x)


class FlaxIdentity(nn.Module):
  """Returns its input (``nn.Identity``, eval-mode ``nn.Dropout``)."""

  def __call__(self, x: Any) -> Any:
    return x


class FlaxLayerNorm(nn.Module):
  """torch-style LayerNorm over the trailing ``normalized_shape`` dims.

  Uses the biased variance of the centred input (as torch does), so
  results match torch to rounding.

  Attributes:
    normalized_shape: Trailing dims to normalise; also the shape of
      ``scale`` and ``bias``.
    eps: Added to the variance before the square root.
    use_scale: Whether a ``scale`` parameter exists (torch ``weight``).
    use_bias: Whether a ``bias`` parameter exists.
    param_dtype: dtype used when initialising parameters.
  """

  normalized_shape: tuple[int, ...]
  eps: float = 1e-5
  use_scale: bool = True
  use_bias: bool = True
  param_dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    n = len(self.normalized_shape)
    if tuple(x.shape[x.ndim - n :]) != tuple(self.normalized_shape):
      raise ValueError(
        f"FlaxLayerNorm expects trailing dims {self.normalized_shape}, got input shape {x.shape}"
      )
    axes = tuple(range(x.ndim - n, x.ndim))
    mean = jnp.mean(x, axis=axes, keepdims=True)
    centered = x - mean
    var = jnp.mean(jnp.square(centered), axis=axes, keepdims=True)
    y = centered * jax.lax.rsqrt(var + self.eps)
    if self.use_scale:
      y = y * self.param("scale", nn.initializers.ones, self.normalized_shape, self.param_dtype)
    if self.use_bias:
      y = y + self.param("bias", nn.initializers.zeros, self.normalized_shape, self.param_dtype)
    return y


# Spatial dimension letters for lax dimension numbers, by spatial rank.
_SPATIAL = {1: "H", 2: "HW", 3: "DHW"}


class FlaxConv(nn.Module):
  """Channels-first N-d convolution with torch semantics.

  Input ``(N, C, *spatial)`` or unbatched ``(C, *spatial)``, output in the
  same layout. Cross-correlation, like torch (and ``lax``).

  Attributes:
    features: Output channels.
    kernel_size: Spatial kernel extent per dim.
    strides: Stride per spatial dim.
    padding: ``(low, high)`` zero padding per spatial dim.
    dilation: Kernel dilation per spatial dim.
    groups: torch ``groups`` (lax ``feature_group_count``).
    use_bias: Whether a ``bias`` parameter exists.
    param_dtype: dtype used when initialising parameters.
  """

  features: int
  kernel_size: tuple[int, ...]
  strides: tuple[int, ...]
  padding: tuple[tuple[int, int], ...]
  dilation: tuple[int, ...]
  groups: int = 1
  use_bias: bool = True
  param_dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    n_spatial = len(self.kernel_size)
    unbatched = x.ndim == n_spatial + 1
    if unbatched:
      x = x[None]
    if x.ndim != n_spatial + 2:
      raise ValueError(
        f"FlaxConv expects (N, C, *{n_spatial} spatial) or unbatched input, got shape {x.shape}"
      )
    kernel = self.param(
      "kernel",
      nn.initializers.lecun_normal(),
      (*self.kernel_size, x.shape[1] // self.groups, self.features),
      self.param_dtype,
    )
    bias = (
      self.param("bias", nn.initializers.zeros, (self.features,), self.param_dtype)
      if self.use_bias
      else None
    )
    x, kernel, bias = promote_dtype(x, kernel, bias)
    sp = _SPATIAL[n_spatial]
    # Keep activations channels-first (torch layout); kernel is Flax's.
    dims = jax.lax.conv_dimension_numbers(x.shape, kernel.shape, ("NC" + sp, sp + "IO", "NC" + sp))
    y = jax.lax.conv_general_dilated(
      x,
      kernel,
      window_strides=self.strides,
      padding=self.padding,
      rhs_dilation=self.dilation,
      dimension_numbers=dims,
      feature_group_count=self.groups,
      precision=_PRECISION,
    )
    if bias is not None:
      y = y + bias.reshape((-1,) + (1,) * n_spatial)
    return y[0] if unbatched else y


class FlaxCausalSelfAttention(nn.Module):
  """Multi-head causal self-attention (torch ``MultiheadAttention`` math).

  ``softmax(q k^T / sqrt(head_dim) + causal mask) v``, heads concatenated,
  then ``out_proj``. torch's packed ``in_proj`` is split into the three
  projections so that queries, keys and values are separate sites.

  Attributes:
    num_heads: Number of heads; the model width must be divisible by it.
    q_proj: Query projection (Dense).
    k_proj: Key projection (Dense).
    v_proj: Value projection (Dense).
    out_proj: Output projection (Dense); torch's ``attn.out_proj``.
  """

  num_heads: int
  q_proj: nn.Module
  k_proj: nn.Module
  v_proj: nn.Module
  out_proj: nn.Module

  def __call__(self, x: jax.Array) -> jax.Array:
    """Attends over ``x`` of shape ``(..., seq, width)`` causally."""
    *lead, seq, width = x.shape
    head_dim = width // self.num_heads

    def split(h: jax.Array) -> jax.Array:
      return h.reshape(*lead, seq, self.num_heads, head_dim)

    q, k, v = split(self.q_proj(x)), split(self.k_proj(x)), split(self.v_proj(x))
    logits = jnp.einsum("...qhd,...khd->...hqk", q, k, precision=_PRECISION)
    logits = logits / math.sqrt(head_dim)
    causal = jnp.tril(jnp.ones((seq, seq), dtype=bool))
    weights = jax.nn.softmax(jnp.where(causal, logits, -jnp.inf), axis=-1)
    mixed = jnp.einsum("...hqk,...khd->...qhd", weights, v, precision=_PRECISION)
    return self.out_proj(mixed.reshape(*lead, seq, width))


class FlaxGPTBlock(nn.Module):
  """Flax counterpart of :class:`GPTBlock` (same residual structure)."""

  ln1: nn.Module
  attn: nn.Module
  ln2: nn.Module
  mlp: nn.Module

  def __call__(self, x: jax.Array) -> jax.Array:
    x = x + self.attn(self.ln1(x))
    return x + self.mlp(self.ln2(x))


class FlaxTinyGPT(nn.Module):
  """Flax counterpart of :class:`TinyGPT`; blocks are ``blocks_0``, ...

  Attributes:
    tok_emb: Token embedding.
    pos_emb: Position embedding, called on ``arange(seq)``.
    blocks: The transformer blocks, applied in order.
    ln_f: Final LayerNorm.
    head: Output projection to logits.
    max_len: Longest accepted sequence (torch would index out of range).
  """

  tok_emb: nn.Module
  pos_emb: nn.Module
  blocks: Sequence[nn.Module]
  ln_f: nn.Module
  head: nn.Module
  max_len: int

  def __call__(self, idx: jax.Array) -> jax.Array:
    """Maps integer token ids ``(..., seq)`` to logits ``(..., seq, vocab)``."""
    seq = idx.shape[-1]
    if seq > self.max_len:
      raise ValueError(f"sequence length {seq} exceeds max_len {self.max_len}")
    x = self.tok_emb(idx) + self.pos_emb(jnp.arange(seq))
    for block in self.blocks:
      x = block(x)
    return self.head(self.ln_f(x))
