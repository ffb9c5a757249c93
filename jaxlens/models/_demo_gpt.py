"""Built-in demo models: a small GPT-style decoder written in ``flax.linen``.

Every piece of the model is its own linen submodule, so that each has a site that
jaxlens can read and edit by its Flax path:

* ``embed`` (token embedding), ``pos_embed`` (learned position embedding);
* ``block_0`` .. ``block_{L-1}``, each a :class:`Block` with ``ln_1``, ``attn``
  (with ``attn/query``, ``attn/key``, ``attn/value``, ``attn/out``), ``ln_2`` and
  ``mlp`` (with ``mlp/fc`` and ``mlp/proj``);
* ``ln_f`` and the ``head`` that gives the logits.

Example:
  >>> import jax, jaxlens as jl
  >>> from jaxlens.models import init_gpt
  >>> model, variables, tokens = init_gpt(0, n_layers=2, d_model=32, max_len=8, batch=2)
  >>> t = jl.trace(model, variables, tokens, save=jl.module("block_1/mlp"))
  >>> t["block_1/mlp"].out.shape
  (2, 8, 32)
"""

from __future__ import annotations

import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxlens.models._layers import FlaxLayerNorm, layer_norm_options
from jaxlens.models.compact import Dense, Embed

__all__ = ["GPT", "MLP", "Block", "CausalSelfAttention", "gpt_config", "init_gpt"]

_CONFIGS = {
  "small": dict(vocab_size=128, d_model=256, n_heads=4, n_layers=4, max_len=64, mlp_ratio=4),
  "medium": dict(vocab_size=128, d_model=512, n_heads=8, n_layers=8, max_len=128, mlp_ratio=4),
}

_INIT = nn.initializers.normal(stddev=0.02)


def _layer_norm(dtype, name: str) -> FlaxLayerNorm:
  """A LayerNorm computing in ``dtype``. Its parameters are float32, as the other layers', or
  ``dtype`` where that is wider: flax multiplies the normalised value by the scale without a
  cast, a float64 x float32 mix that strict dtype promotion refuses."""
  param_dtype = dtype if jnp.dtype(dtype).itemsize > 4 else jnp.float32
  return FlaxLayerNorm(dtype=dtype, param_dtype=param_dtype, name=name, **layer_norm_options(dtype))


class CausalSelfAttention(nn.Module):
  """Multi-head causal self-attention with explicit q/k/v/out projections.

  Attributes:
    d_model: the model width (a multiple of ``n_heads``).
    n_heads: the number of heads.
    dtype: the computation dtype; the softmax always runs in float32.
  """

  d_model: int
  n_heads: int
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x):
    """Attends each position to itself and the positions before it.

    Args:
      x: ``(batch, seq, d_model)``.

    Returns:
      ``(batch, seq, d_model)``.
    """
    if self.d_model % self.n_heads:
      raise ValueError(f"d_model={self.d_model} is not a multiple of n_heads={self.n_heads}")
    batch, seq, _ = x.shape
    head_dim = self.d_model // self.n_heads

    def dense(name):
      return Dense(
        self.d_model, dtype=self.dtype, param_dtype=jnp.float32, kernel_init=_INIT, name=name
      )

    def heads(y):  # (batch, seq, d_model) -> (batch, heads, seq, head_dim)
      return y.reshape(batch, seq, self.n_heads, head_dim).transpose(0, 2, 1, 3)

    q = heads(dense("query")(x))
    k = heads(dense("key")(x))
    v = heads(dense("value")(x))
    scores = jnp.einsum("bhqd,bhkd->bhqk", q, k).astype(jnp.float32)
    scores = scores * jnp.float32(1.0 / head_dim**0.5)
    causal = jnp.tril(jnp.ones((seq, seq), dtype=bool))
    scores = jnp.where(causal, scores, jnp.finfo(jnp.float32).min)
    weights = jax.nn.softmax(scores, axis=-1).astype(self.dtype)
    y = jnp.einsum("bhqk,bhkd->bhqd", weights, v)
    y = y.transpose(0, 2, 1, 3).reshape(batch, seq, self.d_model)
    return dense("out")(y)


class MLP(nn.Module):
  """The feed-forward block: ``proj(gelu(fc(x)))``.

  Attributes:
    d_model: the model width.
    mlp_ratio: the hidden width is ``mlp_ratio * d_model``.
    dtype: the computation dtype.
  """

  d_model: int
  mlp_ratio: int = 4
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x):
    h = Dense(
      self.mlp_ratio * self.d_model,
      dtype=self.dtype,
      param_dtype=jnp.float32,
      kernel_init=_INIT,
      name="fc",
    )(x)
    h = nn.gelu(h)
    return Dense(
      self.d_model, dtype=self.dtype, param_dtype=jnp.float32, kernel_init=_INIT, name="proj"
    )(h)


class Block(nn.Module):
  """A pre-LayerNorm transformer block: ``x + attn(ln_1(x))``, then ``x + mlp(ln_2(x))``.

  Attributes:
    d_model: the model width.
    n_heads: the number of attention heads.
    mlp_ratio: the MLP's hidden width over ``d_model``.
    dtype: the computation dtype.
  """

  d_model: int
  n_heads: int
  mlp_ratio: int = 4
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x):
    h = _layer_norm(self.dtype, "ln_1")(x)
    x = x + CausalSelfAttention(self.d_model, self.n_heads, self.dtype, name="attn")(h)
    h = _layer_norm(self.dtype, "ln_2")(x)
    return x + MLP(self.d_model, self.mlp_ratio, self.dtype, name="mlp")(h)


class GPT(nn.Module):
  """A GPT-style decoder-only transformer.

  Attributes:
    vocab_size: the number of token ids.
    d_model: the model width.
    n_heads: the number of attention heads per block.
    n_layers: the number of blocks, named ``block_0`` .. ``block_{n_layers-1}``.
    max_len: the longest sequence (the size of the position embedding).
    mlp_ratio: the MLP's hidden width over ``d_model``.
    dtype: the computation dtype (parameters are float32).
  """

  vocab_size: int = 128
  d_model: int = 256
  n_heads: int = 4
  n_layers: int = 4
  max_len: int = 64
  mlp_ratio: int = 4
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, tokens):
    """The next-token logits.

    Args:
      tokens: int token ids of shape ``(batch, seq)`` with ``seq <= max_len``.

    Returns:
      float logits of shape ``(batch, seq, vocab_size)``.
    """
    _, seq = tokens.shape
    if seq > self.max_len:
      raise ValueError(f"sequence length {seq} is longer than max_len={self.max_len}")
    x = Embed(
      self.vocab_size,
      self.d_model,
      dtype=self.dtype,
      param_dtype=jnp.float32,
      embedding_init=_INIT,
      name="embed",
    )(tokens)
    positions = jnp.arange(seq, dtype=jnp.int32)[None, :]
    x = x + Embed(
      self.max_len,
      self.d_model,
      dtype=self.dtype,
      param_dtype=jnp.float32,
      embedding_init=_INIT,
      name="pos_embed",
    )(positions)
    for i in range(self.n_layers):
      x = Block(self.d_model, self.n_heads, self.mlp_ratio, self.dtype, name=f"block_{i}")(x)
    x = _layer_norm(self.dtype, "ln_f")(x)
    return Dense(
      self.vocab_size, dtype=self.dtype, param_dtype=jnp.float32, kernel_init=_INIT, name="head"
    )(x)

  @nn.nowrap
  def layer_sites(self) -> tuple[str, ...]:
    """``block_0`` .. ``block_{n_layers-1}``: each block's output
    (:class:`jaxlens.protocol.LayeredModel`)."""
    return tuple(f"block_{i}" for i in range(self.n_layers))

  @nn.nowrap
  def block_site(self, layer: int, name: str) -> str:
    """``f"block_{layer}/{name}"`` (``ln_1``, ``attn``, ``ln_2``, ``mlp``)."""
    return f"block_{layer}/{name}"


def gpt_config(size: str = "small") -> dict:
  """The :class:`GPT` keyword arguments of a named size.

  Args:
    size: ``"small"`` (4 layers, d_model 256, 4 heads, seq 64) or ``"medium"``
      (8 layers, d_model 512, 8 heads, seq 128).

  Returns:
    A new dict of ``GPT(**kwargs)`` arguments (``max_len`` is the sequence length).
  """
  if size not in _CONFIGS:
    raise ValueError(f"unknown GPT size {size!r}; expected one of {sorted(_CONFIGS)}")
  return dict(_CONFIGS[size])


def init_gpt(key=0, size: str = "small", batch: int = 8, **overrides):
  """A GPT, its initialised variables and a batch of random tokens, deterministically.

  Args:
    key: a ``jax.random`` key or an int seed.
    size: a size name for :func:`gpt_config`.
    batch: the number of token sequences.
    **overrides: ``GPT`` arguments that replace the size's (``n_layers=2``,
      ``d_model=32``, ``max_len=8``, ``dtype=jnp.bfloat16``).

  Returns:
    ``(model, variables, tokens)`` with int32 ``tokens`` of shape ``(batch, max_len)``.
  """
  config = gpt_config(size)
  config.update(overrides)
  model = GPT(**config)
  if isinstance(key, int):
    key = jax.random.key(key)
  k_params, k_tokens = jax.random.split(key)
  tokens = jax.random.randint(
    k_tokens, (batch, model.max_len), 0, model.vocab_size, dtype=jnp.int32
  )
  variables = _jit_init(model, k_params, tokens)
  return model, variables, tokens


@functools.partial(jax.jit, static_argnums=0)
def _jit_init(model, key, tokens):
  # One compile per model configuration (modules hash by their fields), not one per op.
  return model.init(key, tokens)
