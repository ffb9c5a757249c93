"""The Llama family (Llama 2/3, SmolLM2, Mistral, Qwen2, Qwen3) in ``flax.linen``.

Pre-RMSNorm decoder blocks, rotary position embeddings with a configurable base (the
"rotate half" convention of Hugging Face checkpoints), a SwiGLU MLP and grouped-query
attention; as config options, Qwen2's q/k/v biases (``qkv_bias``), Qwen3's per-head RMSNorm
of the queries and keys (``qk_norm``: sites ``attn/q_norm``, ``attn/k_norm``) and sliding-window
attention (``sliding_window``, with ``layer_types`` for models that mix local and global
layers; a local layer's KV cache is a ring of the window's length). Sites, the same in every family of ``jaxlens.models`` (see ``docs/models.md``):

* ``embed``; per block ``blocks_{i}/``: ``resid_pre``, ``ln_1``, ``attn/q``, ``attn/k``,
  ``attn/v`` (after the rotation for q and k; ``(batch, seq, heads, head_dim)``, k and v
  with the key-value heads), ``attn/scores``, ``attn/pattern`` (``(batch, heads, q, k)``),
  ``attn/z``, ``attn_out``, ``resid_mid``, ``ln_2``, ``mlp/pre`` (the gate before its
  activation), ``mlp/post`` (``silu(gate) * up``), ``mlp_out``, ``resid_post``;
* ``ln_final`` and ``logits``.

Example:
  >>> import jax, jax.numpy as jnp, jaxlens as jl
  >>> from jaxlens.models import llama
  >>> cfg = llama.LlamaConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
  ...                         d_mlp=48)
  >>> model = llama.Llama(cfg)
  >>> tokens = jnp.arange(6)[None]
  >>> variables = model.init(jax.random.key(0), tokens)
  >>> t = jl.trace(model, variables, tokens, save=jl.module("blocks_1/attn/pattern"))
  >>> t["blocks_1/attn/pattern"].out.shape
  (1, 4, 6, 6)
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.linen as nn
import jax.numpy as jnp

from jaxlens.core import named
from jaxlens.models.compact import Dense, Embed
from jaxlens.models.scan import ScanForm, scan_blocks, uniform_window
from jaxlens.models._layers import (
  decoder_inputs,
  LayerSites,
  RMSNorm,
  cached_attention,
  lookup_ids,
  run_block_after,
  softmax_dtype,
  unembed_after,
  window_mask,
)

__all__ = ["Llama", "LlamaAttention", "LlamaBlock", "LlamaConfig", "LlamaMLP", "rotary"]

_INIT = nn.initializers.normal(stddev=0.02)


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
  """A Llama-family architecture.

  Attributes:
    vocab_size, d_model, n_layers, n_heads, d_mlp: the sizes.
    n_kv_heads: key-value heads (grouped-query attention); ``n_heads`` for plain attention.
    head_dim: per-head width; ``d_model // n_heads`` when None.
    rope_base: the rotary base (Llama 2: 1e4, SmolLM2-135M: 1e5, Llama 3: 5e5).
    norm_eps: the RMSNorm epsilon.
    tie_embeddings: whether the unembedding is the token embedding's transpose.
    max_len: the context length: a longer input (or a KV cache longer than it) is refused
      with ``index_out_of_range``.
    dtype: computation and parameter dtype (float32, bfloat16 or float64).
    qkv_bias: biases on the q, k and v projections (Qwen2); ``o_bias`` on the output one.
    qk_norm: an RMSNorm over each head's queries and keys before the rotation (Qwen3).
    sliding_window: a query sees only itself and the ``sliding_window - 1`` tokens before it
      (Mistral), in the layers ``layer_types`` marks ``"sliding_attention"`` (every layer
      when ``layer_types`` is None).
    scan_layers: the blocks as one ``nn.scan`` over stacked parameters (``params["blocks"]``,
      sites ``jl.module("blocks/...", layer=k)``; ``jaxlens.models.scan``), compiled once
      whatever the depth.
    layer_types: per layer ``"full_attention"`` or ``"sliding_attention"`` (Qwen2/3's
      ``max_window_layers``), or None.
  """

  vocab_size: int = 32000
  d_model: int = 4096
  n_layers: int = 32
  n_heads: int = 32
  n_kv_heads: int = 32
  d_mlp: int = 11008
  head_dim: int | None = None
  rope_base: float = 10000.0
  norm_eps: float = 1e-5
  tie_embeddings: bool = False
  max_len: int = 2048
  dtype: Any = jnp.float32
  qkv_bias: bool = False
  o_bias: bool = False
  qk_norm: bool = False
  sliding_window: int | None = None
  layer_types: tuple[str, ...] | None = None
  scan_layers: bool = False

  @property
  def d_head(self) -> int:
    return self.head_dim or self.d_model // self.n_heads

  def window(self, layer: int) -> int | None:
    """The sliding window of block ``layer``, or None for a full-attention block."""
    if self.sliding_window is None:
      return None
    if self.layer_types is not None and self.layer_types[layer] != "sliding_attention":
      return None
    return self.sliding_window


def rotary(x, positions, base: float, dims: int | None = None):
  """Rotates ``x`` (``(batch, seq, heads, head_dim)``) by its positions (``(seq,)`` or
  ``(batch, seq)``), "rotate half" style. The angles are computed in at least float32
  (float64 for a float64 model). ``dims``: rotate only the first ``dims`` features of each
  head (GPT-NeoX's partial rotary); the rest pass through.
  """
  if dims is not None and dims < x.shape[-1]:
    return jnp.concatenate([rotary(x[..., :dims], positions, base), x[..., dims:]], axis=-1)
  dim = x.shape[-1]
  adt = softmax_dtype(x.dtype)
  inv_freq = 1.0 / (base ** (jnp.arange(0, dim, 2, dtype=adt) / dim))
  angles = jnp.atleast_2d(positions).astype(adt)[..., None] * inv_freq  # (b, seq, dim/2)
  angles = jnp.concatenate([angles, angles], axis=-1)[:, :, None, :]  # (b, seq, 1, dim)
  cos, sin = jnp.cos(angles).astype(x.dtype), jnp.sin(angles).astype(x.dtype)
  x1, x2 = x[..., : dim // 2], x[..., dim // 2 :]
  return x * cos + jnp.concatenate([-x2, x1], axis=-1) * sin


class LlamaAttention(nn.Module):
  """Grouped-query self-attention with rotary embeddings; ``q_proj .. o_proj`` as in HF.

  ``mask``, when given, is the boolean attention mask (broadcastable to ``(batch, heads, q,
  k)``) used instead of the causal and padding one; the causal-cone sweep passes it.
  """

  config: LlamaConfig
  window: int | None = None  # this layer's sliding window

  @nn.compact
  def __call__(
    self, x, positions, key_mask=None, decode: bool = False, cache_index=None, mask=None
  ):
    cfg = self.config
    batch, seq, _ = x.shape

    def proj(n, name):
      y = Dense(
        n * cfg.d_head,
        use_bias=cfg.qkv_bias,
        dtype=cfg.dtype,
        param_dtype=cfg.dtype,
        kernel_init=_INIT,
        name=name,
      )(x)
      return y.reshape(batch, seq, n, cfg.d_head)

    q, k = proj(cfg.n_heads, "q_proj"), proj(cfg.n_kv_heads, "k_proj")
    if cfg.qk_norm:
      q = RMSNorm(cfg.norm_eps, cfg.dtype, name="q_norm")(q)
      k = RMSNorm(cfg.norm_eps, cfg.dtype, name="k_norm")(k)
    q = named(rotary(q, positions, cfg.rope_base), "q")
    k = named(rotary(k, positions, cfg.rope_base), "k")
    v = named(proj(cfg.n_kv_heads, "v_proj"), "v")
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
      dtype=cfg.dtype,
    )
    return Dense(
      cfg.d_model,
      use_bias=cfg.o_bias,
      dtype=cfg.dtype,
      param_dtype=cfg.dtype,
      kernel_init=_INIT,
      name="o_proj",
    )(z.reshape(batch, seq, cfg.n_heads * cfg.d_head))


class LlamaMLP(nn.Module):
  """SwiGLU: ``down_proj(silu(gate_proj(x)) * up_proj(x))``."""

  config: LlamaConfig

  @nn.compact
  def __call__(self, x):
    cfg = self.config

    def dense(n, name):
      return Dense(
        n, use_bias=False, dtype=cfg.dtype, param_dtype=cfg.dtype, kernel_init=_INIT, name=name
      )

    gate = named(dense(cfg.d_mlp, "gate_proj")(x), "pre")
    post = named(nn.silu(gate) * dense(cfg.d_mlp, "up_proj")(x), "post")
    return dense(cfg.d_model, "down_proj")(post)


class LlamaBlock(nn.Module):
  """``resid_mid = x + attn(ln_1(x))``; ``resid_post = resid_mid + mlp(ln_2(resid_mid))``."""

  config: LlamaConfig
  window: int | None = None  # this layer's sliding window

  @nn.compact
  def __call__(
    self, x, positions, key_mask=None, decode: bool = False, cache_index=None, mask=None
  ):
    cfg = self.config
    x = named(x, "resid_pre")
    h = RMSNorm(cfg.norm_eps, cfg.dtype, name="ln_1")(x)
    a = named(
      LlamaAttention(cfg, self.window, name="attn")(
        h, positions, key_mask, decode, cache_index, mask
      ),
      "attn_out",
    )
    x = named(x + a, "resid_mid")
    h = RMSNorm(cfg.norm_eps, cfg.dtype, name="ln_2")(x)
    m = named(LlamaMLP(cfg, name="mlp")(h), "mlp_out")
    return named(x + m, "resid_post")


class Llama(ScanForm, LayerSites, nn.Module):
  """A Llama-family causal language model (a :class:`jaxlens.protocol.Decoder`).

  Call: ``model.apply(variables, tokens, attention_mask=None, positions=None, decode=False)``
  gives logits ``(batch, seq, vocab_size)`` (Hugging Face's order: ``input_ids,
  attention_mask, position_ids``).

  Args of the call:
    tokens: int ``(batch, seq)``, ids in ``[0, vocab_size)`` and at most ``max_len`` of them;
      concrete ids outside raise ``index_out_of_range``, traced ones make their positions'
      embeddings (and so logits) NaN instead of reading another row.
    attention_mask: optional ``(batch, seq)`` padding mask (nonzero for real tokens; with
      ``decode=True``, ``(batch, cache_len)`` over the cache).
    positions: optional int ``(seq,)`` or ``(batch, seq)`` positions (default ``0 .. seq-1``,
      or the cache index onwards when decoding); per-row positions serve left padding.
    decode: use and update the KV cache in the ``cache`` collection (``mutable=["cache"]``);
      see ``docs/models.md``.
  """

  config: LlamaConfig

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
    if cfg.scan_layers:
      x = scan_blocks(
        LlamaBlock(cfg, uniform_window(cfg), name="blocks"),
        cfg.n_layers,
        x,
        positions,
        attention_mask,
        decode,
        cache_index,
      )
    for i in range(0 if cfg.scan_layers else cfg.n_layers):
      x = LlamaBlock(cfg, cfg.window(i), name=f"blocks_{i}")(
        x, positions, attention_mask, decode, cache_index
      )
    x = RMSNorm(cfg.norm_eps, cfg.dtype, name="ln_final")(x)
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
    """``config.max_len``, the context length the model's call accepts."""
    return self.config.max_len

  @nn.nowrap
  def run_block(self, variables, layer, x, positions, *, past_keys, past_values, mask):
    """:meth:`jaxlens.protocol.Decoder.run_block`."""
    # The block reads the whole past (window=None) and the mask keeps a local layer's window.
    block = LlamaBlock(self.config)
    params = self.block_params(variables, layer)
    mask = window_mask(mask, positions, past_keys.shape[1], self.block_window(layer))
    return run_block_after(block, params, x, positions, past_keys, past_values, mask)

  @nn.nowrap
  def unembed(self, variables, x):
    """:meth:`jaxlens.protocol.Decoder.unembed`."""
    norm = RMSNorm(self.config.norm_eps, self.config.dtype)
    return unembed_after(norm, self.config, variables["params"], x)
