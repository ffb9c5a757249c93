"""The zoo's shared blocks: one attention, the MLP variants and the residual block, each naming
the canonical sites, so that a family is a short file that composes them.

* :class:`Attention`: grouped-query self-attention with its options: rotary embeddings
  (:mod:`jaxlens.models.rope`, with every scaling), a sliding window (its KV cache a ring),
  QK-norm per head (Qwen3, Gemma 3) or over the whole projection (OLMo 2), biases, a custom
  score scale and soft-cap (Gemma), the output projection's name. Sites: ``q``, ``k``, ``v``,
  ``scores``, ``pattern``, ``z``.
* :class:`GatedMLP` (``down_proj(act(gate_proj(x)) * up_proj(x))``: SwiGLU, GeGLU) and
  :class:`MLP` (``out(act(in(x)))``: GPT-2, GPT-NeoX). Sites: ``pre`` (the gate, or the input
  projection, before the activation) and ``post`` (what the output projection reads).
* :func:`residual_block`: the residual stream around them: ``resid_pre``, ``attn_out``,
  ``resid_mid``, ``mlp_out``, ``resid_post``, with the norms before the sub-blocks (``"pre"``:
  Llama, GPT-2), before and after (``"sandwich"``: Gemma 2/3), or only after (``"post"``:
  OLMo 2), and GPT-NeoX's parallel residual.
* :func:`activation`: Hugging Face's activation names.

Example:
  >>> import jax, jax.numpy as jnp
  >>> from jaxlens.models.blocks import GatedMLP
  >>> mlp = GatedMLP(d_mlp=8, d_model=4, activation="silu")
  >>> x = jnp.ones((1, 2, 4))
  >>> mlp.apply(mlp.init(jax.random.key(0), x), x).shape
  (1, 2, 4)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxlens.core import InvalidArgumentError, named
from jaxlens.models._layers import RMSNorm, cached_attention
from jaxlens.models.compact import Dense
from jaxlens.models.rope import Rope, rotary

__all__ = ["Attention", "GatedMLP", "MLP", "activation", "residual_block"]

INIT = nn.initializers.normal(stddev=0.02)

_ACTIVATIONS: dict[str, Callable] = {
  "silu": nn.silu,
  "swish": nn.silu,
  "gelu": lambda x: nn.gelu(x, approximate=False),
  "gelu_python": lambda x: nn.gelu(x, approximate=False),
  "gelu_new": lambda x: nn.gelu(x, approximate=True),
  "gelu_pytorch_tanh": lambda x: nn.gelu(x, approximate=True),
  "gelu_fast": lambda x: nn.gelu(x, approximate=True),
  "quick_gelu": lambda x: x * jax.nn.sigmoid(1.702 * x),
  "relu": nn.relu,
}


def activation(name: str) -> Callable:
  """The function of a Hugging Face activation name (``hidden_act``).

  Raises:
    InvalidArgumentError: ``invalid_argument`` for a name jaxlens does not implement.
  """
  if name not in _ACTIVATIONS:
    raise InvalidArgumentError(
      f"unknown activation {name!r}",
      code="invalid_argument",
      received=name,
      expected=sorted(_ACTIVATIONS),
      fix=f"one of {sorted(_ACTIVATIONS)}",
    )
  return _ACTIVATIONS[name]


def dense(n: int, dtype, name: str | None, bias: bool = False) -> Dense:
  """The zoo's linear layer in ``dtype`` (parameters and computation)."""
  return Dense(n, use_bias=bias, dtype=dtype, param_dtype=dtype, kernel_init=INIT, name=name)


class Attention(nn.Module):
  """Grouped-query causal self-attention with its KV cache.

  Called as ``(x, positions, key_mask=None, decode=False, cache_index=None, mask=None)``;
  ``mask``, when given, replaces the causal and padding mask (the causal-cone sweep's).
  Parameters: ``q_proj``, ``k_proj``, ``v_proj``, ``{o_name}`` (and ``q_norm``, ``k_norm``).

  Attributes:
    n_heads, n_kv_heads, d_head, d_model: the sizes (``n_heads`` a multiple of ``n_kv_heads``).
    dtype: parameters and computation.
    rope: the rotary embedding, or None (GPT-2's learned positions).
    window: the sliding window, or None.
    qkv_bias, o_bias: biases of the input and output projections.
    o_name: the output projection's parameter name (``o_proj``, ``dense``, ``c_proj``).
    qk_norm: ``"head"`` (each head's queries and keys), ``"proj"`` (the whole projection,
      OLMo 2), or None; ``norm`` is the norm's module class (``(eps, dtype)``), ``norm_eps``
      its epsilon.
    scale: the scores' factor (default ``1 / sqrt(d_head)``); ``softcap``: Gemma 2's.
  """

  n_heads: int
  n_kv_heads: int
  d_head: int
  d_model: int
  dtype: Any = jnp.float32
  rope: Rope | None = None
  window: int | None = None
  qkv_bias: bool = False
  o_bias: bool = False
  o_name: str = "o_proj"
  qk_norm: str | None = None
  norm: Any = RMSNorm
  norm_eps: float = 1e-6
  scale: float | None = None
  softcap: float | None = None

  @nn.compact
  def __call__(
    self, x, positions, key_mask=None, decode: bool = False, cache_index=None, mask=None
  ):
    batch, seq, _ = x.shape

    def proj(n, name):
      return dense(n * self.d_head, self.dtype, name, self.qkv_bias)(x)

    def heads(y, n):
      return y.reshape(batch, seq, n, self.d_head)

    q, k = proj(self.n_heads, "q_proj"), proj(self.n_kv_heads, "k_proj")
    if self.qk_norm == "proj":
      q = self.norm(self.norm_eps, self.dtype, name="q_norm")(q)
      k = self.norm(self.norm_eps, self.dtype, name="k_norm")(k)
    q, k = heads(q, self.n_heads), heads(k, self.n_kv_heads)
    if self.qk_norm == "head":
      q = self.norm(self.norm_eps, self.dtype, name="q_norm")(q)
      k = self.norm(self.norm_eps, self.dtype, name="k_norm")(k)
    if self.rope is not None:
      q, k = rotary(q, positions, self.rope), rotary(k, positions, self.rope)
    q, k = named(q, "q"), named(k, "k")
    v = named(heads(proj(self.n_kv_heads, "v_proj"), self.n_kv_heads), "v")
    z = cached_attention(
      self,
      q,
      k,
      v,
      positions,
      key_mask=key_mask,
      decode=decode,
      cache_index=cache_index,
      mask=mask,
      window=self.window,
      dtype=self.dtype,
      scale=self.scale,
      softcap=self.softcap,
    )
    out = dense(self.d_model, self.dtype, self.o_name, self.o_bias)
    return out(z.reshape(batch, seq, self.n_heads * self.d_head))


class GatedMLP(nn.Module):
  """``down_proj(act(gate_proj(x)) * up_proj(x))`` (SwiGLU with ``"silu"``, GeGLU with a
  GELU); sites ``pre`` (the gate before its activation) and ``post``."""

  d_mlp: int
  d_model: int
  activation: str = "silu"
  dtype: Any = jnp.float32
  bias: bool = False

  @nn.compact
  def __call__(self, x):
    gate = named(dense(self.d_mlp, self.dtype, "gate_proj", self.bias)(x), "pre")
    up = dense(self.d_mlp, self.dtype, "up_proj", self.bias)(x)
    post = named(activation(self.activation)(gate) * up, "post")
    return dense(self.d_model, self.dtype, "down_proj", self.bias)(post)


class MLP(nn.Module):
  """``{names[1]}(act({names[0]}(x)))``; sites ``pre`` and ``post``."""

  d_mlp: int
  d_model: int
  activation: str = "gelu"
  dtype: Any = jnp.float32
  bias: bool = True
  names: tuple[str, str] = ("c_fc", "c_proj")

  @nn.compact
  def __call__(self, x):
    pre = named(dense(self.d_mlp, self.dtype, self.names[0], self.bias)(x), "pre")
    post = named(activation(self.activation)(pre), "post")
    return dense(self.d_model, self.dtype, self.names[1], self.bias)(post)


def residual_block(
  x,
  attn: Callable,
  mlp: Callable,
  norm: Callable[[str], Callable],
  *,
  placement: str = "pre",
  parallel: bool = False,
):
  """The residual stream of a decoder block, called inside the block's ``nn.compact`` call.

  Args:
    x: the block's input (site ``resid_pre``).
    attn, mlp: the sub-blocks, ``h -> out`` (modules named ``attn`` and ``mlp``).
    norm: ``name -> norm module``; the norms are ``ln_1``/``ln_2`` before the sub-blocks and
      ``ln_1_post``/``ln_2_post`` after them.
    placement: ``"pre"`` (norms before), ``"sandwich"`` (before and after), ``"post"`` (after
      only).
    parallel: the MLP reads the block's input instead of ``resid_mid`` (GPT-NeoX).

  Returns:
    ``resid_post = resid_mid + mlp_out`` with ``resid_mid = resid_pre + attn_out``;
    ``attn_out`` and ``mlp_out`` are what each sub-block adds, after its post-norm.
  """

  def sub(fn, h, n):
    if placement != "post":
      h = norm(f"ln_{n}")(h)
    out = fn(h)
    return out if placement == "pre" else norm(f"ln_{n}_post")(out)

  x = named(x, "resid_pre")
  mid = named(x + named(sub(attn, x, 1), "attn_out"), "resid_mid")
  m = named(sub(mlp, x if parallel else mid, 2), "mlp_out")
  return named(mid + m, "resid_post")
