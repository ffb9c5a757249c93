"""GPT-2 in ``flax.linen``: learned positions, pre-LayerNorm blocks, GELU (tanh) MLP.

Parameter names follow the Hugging Face checkpoint's modules where they exist (the fused
``c_attn`` is split into ``q_proj``, ``k_proj``, ``v_proj`` so that each projection is its
own site). Sites as in every family of ``jaxlens.models`` (``docs/models.md``): ``embed``,
``pos_embed``; per block ``blocks_{i}/``: ``resid_pre``, ``ln_1``, ``attn/q``, ``attn/k``,
``attn/v``, ``attn/scores``, ``attn/pattern``, ``attn/z``, ``attn_out``, ``resid_mid``,
``ln_2``, ``mlp/pre``, ``mlp/post``, ``mlp_out``, ``resid_post``; ``ln_final``, ``logits``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.linen as nn
import jax.numpy as jnp

from jaxlens.core import named
from jaxlens.models.compact import Dense, Embed
from jaxlens.models.scan import ScanForm, scan_blocks
from jaxlens.models._layers import (
  decoder_inputs,
  FlaxLayerNorm,
  LayerSites,
  attend,
  attention_mask,
  cached_keys_values,
  check_ids,
  lookup_ids,
  layer_norm_options,
  run_block_after,
  unembed_after,
)

__all__ = ["GPT2", "GPT2MLP", "GPT2Attention", "GPT2Block", "GPT2Config"]

_INIT = nn.initializers.normal(stddev=0.02)


@dataclasses.dataclass(frozen=True)
class GPT2Config:
  """A GPT-2 architecture (defaults: the 124M model).

  Attributes:
    vocab_size, d_model, n_layers, n_heads: the sizes; ``d_mlp`` defaults to ``4 * d_model``.
    max_len: the number of learned positions.
    norm_eps: the LayerNorm epsilon.
    activation: ``"gelu_new"`` (tanh approximation, GPT-2's) or ``"gelu"`` (exact).
    tie_embeddings: whether the unembedding is the token embedding's transpose (GPT-2: yes).
    dtype: computation and parameter dtype.
    scan_layers: the blocks as one ``nn.scan`` over stacked parameters (``jaxlens.models.scan``).
  """

  vocab_size: int = 50257
  d_model: int = 768
  n_layers: int = 12
  n_heads: int = 12
  d_mlp: int | None = None
  max_len: int = 1024
  norm_eps: float = 1e-5
  activation: str = "gelu_new"
  tie_embeddings: bool = True
  dtype: Any = jnp.float32
  scan_layers: bool = False

  @property
  def mlp_width(self) -> int:
    return self.d_mlp or 4 * self.d_model


def _dense(cfg, n, name):
  return Dense(n, dtype=cfg.dtype, param_dtype=cfg.dtype, kernel_init=_INIT, name=name)


def _norm(cfg, name):
  return FlaxLayerNorm(
    cfg.norm_eps,
    dtype=cfg.dtype,
    param_dtype=cfg.dtype,
    name=name,
    **layer_norm_options(cfg.dtype),
  )


class GPT2Attention(nn.Module):
  """Causal multi-head self-attention.

  ``mask``, when given, is the boolean attention mask (broadcastable to ``(batch, heads, q,
  k)``) used instead of the causal and padding one; the causal-cone sweep passes it.
  """

  config: GPT2Config

  @nn.compact
  def __call__(
    self, x, positions, key_mask=None, decode: bool = False, cache_index=None, mask=None
  ):
    cfg = self.config
    batch, seq, _ = x.shape
    hd = cfg.d_model // cfg.n_heads

    def heads(name):
      return named(
        _dense(cfg, cfg.d_model, f"{name}_proj")(x).reshape(batch, seq, cfg.n_heads, hd), name
      )

    q, k, v = heads("q"), heads("k"), heads("v")
    q_positions = k_positions = positions
    if decode:
      k, v, initialised = cached_keys_values(self, k, v, cache_index)
      if initialised:
        # Causality in the cache is by slot (a query at slot cache_index + i sees the slots up
        # to its own); positions, which left padding shifts per row, only embed or rotate.
        q_positions = cache_index + jnp.arange(seq, dtype=cache_index.dtype)
        k_positions = jnp.arange(k.shape[1], dtype=cache_index.dtype)
    if mask is None:
      mask = attention_mask(q_positions, k_positions, causal=True, key_mask=key_mask)
    z = attend(q, k, v, mask, dtype=cfg.dtype)
    return _dense(cfg, cfg.d_model, "c_proj")(z.reshape(batch, seq, cfg.d_model))


class GPT2MLP(nn.Module):
  """``c_proj(gelu(c_fc(x)))``."""

  config: GPT2Config

  @nn.compact
  def __call__(self, x):
    cfg = self.config
    pre = named(_dense(cfg, cfg.mlp_width, "c_fc")(x), "pre")
    post = named(nn.gelu(pre, approximate=cfg.activation == "gelu_new"), "post")
    return _dense(cfg, cfg.d_model, "c_proj")(post)


class GPT2Block(nn.Module):
  """``resid_mid = x + attn(ln_1(x))``; ``resid_post = resid_mid + mlp(ln_2(resid_mid))``."""

  config: GPT2Config

  @nn.compact
  def __call__(
    self, x, positions, key_mask=None, decode: bool = False, cache_index=None, mask=None
  ):
    cfg = self.config
    x = named(x, "resid_pre")
    a = GPT2Attention(cfg, name="attn")(
      _norm(cfg, "ln_1")(x), positions, key_mask, decode, cache_index, mask
    )
    x = named(x + named(a, "attn_out"), "resid_mid")
    m = named(GPT2MLP(cfg, name="mlp")(_norm(cfg, "ln_2")(x)), "mlp_out")
    return named(x + m, "resid_post")


class GPT2(ScanForm, LayerSites, nn.Module):
  """GPT-2. Call: ``(tokens, attention_mask=None, positions=None, decode=False) -> logits``;
  the arguments are those of :class:`jaxlens.models.llama.Llama` (concrete positions must be
  in ``[0, max_len)``, traced ones outside give NaN). A :class:`jaxlens.protocol.Decoder`."""

  config: GPT2Config

  @nn.compact
  def __call__(self, tokens, attention_mask=None, positions=None, decode: bool = False):
    cfg = self.config
    given = positions
    positions, cache_index = decoder_inputs(self, tokens, attention_mask, positions, decode)
    if given is not None:
      check_ids(given, cfg.max_len, "positions", "pos_embed")
    embed = Embed(
      cfg.vocab_size,
      cfg.d_model,
      dtype=cfg.dtype,
      param_dtype=cfg.dtype,
      embedding_init=_INIT,
      name="embed",
    )
    x = embed(lookup_ids(tokens)) + Embed(
      cfg.max_len,
      cfg.d_model,
      dtype=cfg.dtype,
      param_dtype=cfg.dtype,
      embedding_init=_INIT,
      name="pos_embed",
    )(jnp.atleast_2d(lookup_ids(positions)))
    if cfg.scan_layers:
      block = GPT2Block(cfg, name="blocks")
      x = scan_blocks(block, cfg.n_layers, x, positions, attention_mask, decode, cache_index)
    for i in range(0 if cfg.scan_layers else cfg.n_layers):
      x = GPT2Block(cfg, name=f"blocks_{i}")(x, positions, attention_mask, decode, cache_index)
    x = _norm(cfg, "ln_final")(x)
    if cfg.tie_embeddings:
      logits = embed.attend(x)
    else:
      logits = Dense(
        cfg.vocab_size,
        use_bias=False,
        dtype=cfg.dtype,
        param_dtype=cfg.dtype,
        kernel_init=_INIT,
        name="lm_head",
      )(x)
    return named(logits, "logits")

  @nn.nowrap
  def max_positions(self) -> int:
    """``config.max_len``, the number of learned positions."""
    return self.config.max_len

  @nn.nowrap
  def run_block(self, variables, layer, x, positions, *, past_keys, past_values, mask):
    """:meth:`jaxlens.protocol.Decoder.run_block`."""
    block = GPT2Block(self.config)
    params = self.block_params(variables, layer)
    return run_block_after(block, params, x, positions, past_keys, past_values, mask)

  @nn.nowrap
  def unembed(self, variables, x):
    """:meth:`jaxlens.protocol.Decoder.unembed`."""
    return unembed_after(_norm(self.config, None), self.config, variables["params"], x)
