"""GPT-NeoX (Pythia) in ``flax.linen``: pre-LayerNorm blocks whose attention and MLP read the
same residual stream (the parallel residual), rotary embeddings on a fraction of each head
(partial rotary), a GELU MLP and an untied unembedding.

Hugging Face's fused ``query_key_value`` projection (each head's q, k and v side by side) is
split into ``q_proj``, ``k_proj``, ``v_proj`` so that each is a site. Sites as in every family
of ``jaxlens.models`` (``docs/models.md``): ``embed``; per block ``blocks_{i}/``: ``resid_pre``,
``ln_1``, ``attn/q``, ``attn/k`` (after the rotation), ``attn/v``, ``attn/scores``,
``attn/pattern``, ``attn/z``, ``attn_out``, ``resid_mid``, ``ln_2``, ``mlp/pre``, ``mlp/post``,
``mlp_out``, ``resid_post``; ``ln_final``, ``logits``.

With the parallel residual (``parallel_residual=True``, Pythia's), ``ln_2`` normalises
``resid_pre``, not ``resid_mid``; ``resid_mid`` is ``resid_pre + attn_out`` and
``resid_post = resid_mid + mlp_out``, so an edit of ``resid_mid`` reaches ``resid_post`` but
not the MLP (TransformerLens has no ``resid_mid`` for such models).

Example:
  >>> import jax, jax.numpy as jnp, jaxlens as jl
  >>> from jaxlens.models import gpt_neox
  >>> cfg = gpt_neox.GPTNeoXConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4)
  >>> model = gpt_neox.GPTNeoX(cfg)
  >>> tokens = jnp.arange(6)[None]
  >>> variables = model.init(jax.random.key(0), tokens)
  >>> t = jl.trace(model, variables, tokens, save=jl.module("blocks_1/attn/q"))
  >>> t["blocks_1/attn/q"].out.shape
  (1, 6, 4, 8)
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.linen as nn
import jax.numpy as jnp

from jaxlens.core import named
from jaxlens.models._layers import (
  decoder_inputs,
  LayerNorm,
  LayerSites,
  cached_attention,
  lookup_ids,
  run_block_after,
  unembed_after,
)
from jaxlens.models.compact import Dense, Embed
from jaxlens.models.llama import rotary

__all__ = ["GPTNeoX", "GPTNeoXAttention", "GPTNeoXBlock", "GPTNeoXConfig", "GPTNeoXMLP"]

_INIT = nn.initializers.normal(stddev=0.02)


@dataclasses.dataclass(frozen=True)
class GPTNeoXConfig:
  """A GPT-NeoX architecture (defaults: Pythia-70M's shape).

  Attributes:
    vocab_size, d_model, n_layers, n_heads: the sizes; ``d_mlp`` defaults to ``4 * d_model``.
    rotary_pct: the fraction of each head's features that are rotated (Pythia: 0.25).
    rope_base: the rotary base.
    norm_eps: the LayerNorm epsilon.
    parallel_residual: attention and MLP both read the block's input (Pythia: True).
    activation: ``"gelu"`` (exact) or ``"gelu_new"`` / ``"gelu_pytorch_tanh"`` (tanh).
    attention_bias: biases on the attention projections (Pythia: True).
    tie_embeddings: whether the unembedding is the embedding's transpose (Pythia: no).
    max_len: the context length: a longer input is refused with ``index_out_of_range``.
    dtype: computation and parameter dtype.
  """

  vocab_size: int = 50304
  d_model: int = 512
  n_layers: int = 6
  n_heads: int = 8
  d_mlp: int | None = None
  rotary_pct: float = 0.25
  rope_base: float = 10000.0
  norm_eps: float = 1e-5
  parallel_residual: bool = True
  activation: str = "gelu"
  attention_bias: bool = True
  tie_embeddings: bool = False
  max_len: int = 2048
  dtype: Any = jnp.float32

  @property
  def d_head(self) -> int:
    return self.d_model // self.n_heads

  @property
  def mlp_width(self) -> int:
    return self.d_mlp or 4 * self.d_model

  @property
  def rotary_dims(self) -> int:
    return int(self.d_head * self.rotary_pct)


def _dense(cfg, n, name, bias=True):
  return Dense(
    n, use_bias=bias, dtype=cfg.dtype, param_dtype=cfg.dtype, kernel_init=_INIT, name=name
  )


def _norm(cfg, name):
  return LayerNorm(cfg.norm_eps, cfg.dtype, name=name)


class GPTNeoXAttention(nn.Module):
  """Causal multi-head self-attention with partial rotary embeddings.

  ``mask``, when given, replaces the causal and padding mask (the causal-cone sweep's).
  """

  config: GPTNeoXConfig

  @nn.compact
  def __call__(
    self, x, positions, key_mask=None, decode: bool = False, cache_index=None, mask=None
  ):
    cfg = self.config
    batch, seq, _ = x.shape

    def heads(name):
      y = _dense(cfg, cfg.d_model, f"{name}_proj", cfg.attention_bias)(x)
      return y.reshape(batch, seq, cfg.n_heads, cfg.d_head)

    q = named(rotary(heads("q"), positions, cfg.rope_base, cfg.rotary_dims), "q")
    k = named(rotary(heads("k"), positions, cfg.rope_base, cfg.rotary_dims), "k")
    v = named(heads("v"), "v")
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
      window=None,
      dtype=cfg.dtype,
    )
    return _dense(cfg, cfg.d_model, "dense", cfg.attention_bias)(
      z.reshape(batch, seq, cfg.n_heads * cfg.d_head)
    )


class GPTNeoXMLP(nn.Module):
  """``dense_4h_to_h(gelu(dense_h_to_4h(x)))``."""

  config: GPTNeoXConfig

  @nn.compact
  def __call__(self, x):
    cfg = self.config
    pre = named(_dense(cfg, cfg.mlp_width, "dense_h_to_4h")(x), "pre")
    post = named(nn.gelu(pre, approximate=cfg.activation != "gelu"), "post")
    return _dense(cfg, cfg.d_model, "dense_4h_to_h")(post)


class GPTNeoXBlock(nn.Module):
  """Parallel: ``resid_post = x + attn(ln_1(x)) + mlp(ln_2(x))``; sequential (GPT-J-free
  NeoX configs): ``resid_mid = x + attn(ln_1(x))``, ``resid_post = resid_mid +
  mlp(ln_2(resid_mid))``."""

  config: GPTNeoXConfig

  @nn.compact
  def __call__(
    self, x, positions, key_mask=None, decode: bool = False, cache_index=None, mask=None
  ):
    cfg = self.config
    x = named(x, "resid_pre")
    a = GPTNeoXAttention(cfg, name="attn")(
      _norm(cfg, "ln_1")(x), positions, key_mask, decode, cache_index, mask
    )
    mid = named(x + named(a, "attn_out"), "resid_mid")
    m = named(
      GPTNeoXMLP(cfg, name="mlp")(_norm(cfg, "ln_2")(x if cfg.parallel_residual else mid)),
      "mlp_out",
    )
    return named(mid + m, "resid_post")


class GPTNeoX(LayerSites, nn.Module):
  """GPT-NeoX / Pythia. Call: ``(tokens, attention_mask=None, positions=None, decode=False)
  -> logits``; the arguments are those of :class:`jaxlens.models.llama.Llama`."""

  config: GPTNeoXConfig

  @nn.compact
  def __call__(self, tokens, attention_mask=None, positions=None, decode: bool = False):
    cfg = self.config
    positions, cache_index = decoder_inputs(self, tokens, attention_mask, positions, decode)
    embed = Embed(
      cfg.vocab_size,
      cfg.d_model,
      dtype=cfg.dtype,
      param_dtype=cfg.dtype,
      embedding_init=_INIT,
      name="embed",
    )
    x = embed(lookup_ids(tokens))
    for i in range(cfg.n_layers):
      x = GPTNeoXBlock(cfg, name=f"blocks_{i}")(x, positions, attention_mask, decode, cache_index)
    x = _norm(cfg, "ln_final")(x)
    if cfg.tie_embeddings:
      logits = embed.attend(x)
    else:
      logits = _dense(cfg, cfg.vocab_size, "lm_head", bias=False)(x)
    return named(logits, "logits")

  @nn.nowrap
  def max_positions(self) -> int:
    """``config.max_len``, the context length the model's call accepts."""
    return self.config.max_len

  @nn.nowrap
  def run_block(self, variables, layer, x, positions, *, past_keys, past_values, mask):
    """:meth:`jaxlens.protocol.Decoder.run_block`."""
    params = variables["params"][f"blocks_{layer}"]
    block = GPTNeoXBlock(self.config)
    return run_block_after(block, params, x, positions, past_keys, past_values, mask)

  @nn.nowrap
  def unembed(self, variables, x):
    """:meth:`jaxlens.protocol.Decoder.unembed`."""
    norm = LayerNorm(self.config.norm_eps, self.config.dtype)
    return unembed_after(norm, self.config, variables["params"], x)
