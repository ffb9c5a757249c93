"""The Llama family (Llama 2/3.x, SmolLM2, Mistral, Qwen2, Qwen3, Phi-3, OLMo 2, and with a
mixture of experts Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE) in ``flax.linen``, composed of the
shared blocks of :mod:`jaxlens.models.blocks`.

Pre-RMSNorm decoder blocks, rotary position embeddings (the "rotate half" convention of
Hugging Face checkpoints, with every scaling of :mod:`jaxlens.models.rope`: Llama 3.1's
``llama3``, ``linear``, ``dynamic``, ``yarn``, Phi-3's ``longrope``), a gated MLP (SwiGLU,
or the config's activation) and grouped-query attention; as config options, Qwen2's q/k/v
biases (``qkv_bias``), Qwen3's per-head RMSNorm of the queries and keys (``qk_norm``: sites
``attn/q_norm``, ``attn/k_norm``; OLMo 2's over the whole projection), OLMo 2's norms after
the sub-blocks (``norm_placement="post"``), a mixture of experts as the MLP
(``moe``, :mod:`jaxlens.models.moe`) and sliding-window attention (``sliding_window``, with
``layer_types`` for models that mix local and global layers; a local layer's KV cache is a
ring of the window's length). Sites, the same in every family of ``jaxlens.models`` (see
``docs/models.md``):

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
import numpy as np

from jaxlens.core import named
from jaxlens.models import _hf
from jaxlens.models.blocks import Attention, GatedMLP, residual_block
from jaxlens.models.compact import Dense, Embed
from jaxlens.models.moe import MoE, MoEConfig, hf_moe_weights
from jaxlens.models.rope import Rope, rotary
from jaxlens.models.scan import ScanForm, scan_blocks, uniform_window
from jaxlens.models._layers import (
  decoder_inputs,
  LayerSites,
  RMSNorm,
  lookup_ids,
  run_block_after,
  unembed_after,
  window_mask,
)

__all__ = ["Llama", "LlamaBlock", "LlamaConfig", "rotary"]

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
    rope_scaling: the rotary scaling or partial rotation (:class:`~jaxlens.models.rope.Rope`;
      its ``base`` is ``rope_base``), or None for the plain rotation.
    activation: the MLP gate's activation (a Hugging Face ``hidden_act``: ``"silu"``, ...).
    mlp_bias: biases on the MLP projections.
    qk_norm_scope: ``"head"`` (each head's queries and keys, Qwen3) or ``"proj"`` (the whole
      projection before the heads are split, OLMo 2).
    norm_placement: ``"pre"`` (an RMSNorm before each sub-block) or ``"post"`` (after each,
      OLMo 2: ``ln_1_post``, ``ln_2_post``).
    moe: a :class:`jaxlens.models.moe.MoEConfig`: the MLP is a mixture of experts.
    fused_projections: the Hugging Face checkpoint stores q/k/v as one ``qkv_proj`` and the
      gate and up projections as one ``gate_up_proj`` (Phi-3); the model is the same.
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
  rope_scaling: Rope | None = None
  activation: str = "silu"
  mlp_bias: bool = False
  qk_norm_scope: str = "head"
  norm_placement: str = "pre"
  moe: MoEConfig | None = None
  fused_projections: bool = False

  @property
  def d_head(self) -> int:
    return self.head_dim or self.d_model // self.n_heads

  @property
  def rope(self) -> Rope:
    """The blocks' rotary embedding."""
    if self.rope_scaling is None:
      return Rope(base=self.rope_base)
    return dataclasses.replace(self.rope_scaling, base=self.rope_base)

  def window(self, layer: int) -> int | None:
    """The sliding window of block ``layer``, or None for a full-attention block."""
    if self.sliding_window is None:
      return None
    if self.layer_types is not None and self.layer_types[layer] != "sliding_attention":
      return None
    return self.sliding_window


class LlamaBlock(nn.Module):
  """``resid_mid = x + attn(ln_1(x))``; ``resid_post = resid_mid + mlp(ln_2(resid_mid))``
  (OLMo 2, ``norm_placement="post"``: ``x + ln_1_post(attn(x))`` and likewise the MLP).

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
    attn = Attention(
      cfg.n_heads,
      cfg.n_kv_heads,
      cfg.d_head,
      cfg.d_model,
      cfg.dtype,
      rope=cfg.rope,
      window=self.window,
      qkv_bias=cfg.qkv_bias,
      o_bias=cfg.o_bias,
      qk_norm=(cfg.qk_norm_scope if cfg.qk_norm else None),
      norm_eps=cfg.norm_eps,
      name="attn",
    )
    if cfg.moe is not None:
      mlp: nn.Module = MoE(cfg, name="mlp")
    else:
      mlp = GatedMLP(cfg.d_mlp, cfg.d_model, cfg.activation, cfg.dtype, cfg.mlp_bias, name="mlp")
    return residual_block(
      x,
      lambda h: attn(h, positions, key_mask, decode, cache_index, mask),
      mlp,
      lambda name: RMSNorm(cfg.norm_eps, cfg.dtype, name=name),
      placement=cfg.norm_placement,
    )


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


# ------------------------------------------------------------------- Hugging Face checkpoints

# The Hugging Face model types of the dense models of this family.
DENSE_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "olmo2")


def _layer_types(config: _hf.HFConfig) -> tuple[str, ...]:
  """Qwen2/3's per-layer attention kinds: ``layer_types``, or (older ``config.json`` files)
  sliding from layer ``max_window_layers`` on."""
  config.seen("layer_types", "max_window_layers")
  if config.config.get("layer_types"):
    return tuple(config.config["layer_types"])
  n = config["num_hidden_layers"]
  first = config.config.get("max_window_layers", n)
  return tuple("sliding_attention" if i >= first else "full_attention" for i in range(n))


def from_hf(config: _hf.HFConfig, dtype) -> LlamaConfig:
  """The :class:`LlamaConfig` of a Hugging Face ``config.json`` of a ``MODEL_TYPES`` model."""
  if config.model_type in MOE_MODEL_TYPES:
    return _moe_from_hf(config, dtype)
  return _dense_from_hf(config, dtype)


def _dense_from_hf(config: _hf.HFConfig, dtype, **options) -> LlamaConfig:
  """:func:`from_hf` of a dense model; ``options`` override fields (the mixtures of experts
  pass ``moe`` and their own defaults)."""
  kind = config.model_type
  heads = config["num_attention_heads"]
  window, layer_types = None, None
  if kind in ("mistral", "phi3"):
    window = config.get("sliding_window")
  elif kind in ("qwen2", "qwen3"):
    config.seen("sliding_window", "use_sliding_window", "max_window_layers", "layer_types")
    if config.config.get("use_sliding_window"):
      window, layer_types = config.get("sliding_window"), _layer_types(config)
      if all(t == "full_attention" for t in layer_types):
        window, layer_types = None, None
  if layer_types is None and config.config.get("layer_types"):
    if any(t != "full_attention" for t in _layer_types(config)):
      raise config.refuse(
        "layer_types", "names layer types this family does not run", "full_attention only"
      )
  bias = bool(config.get("attention_bias", False))
  base, scaling = _hf.rope_from_hf(config)
  fields = dict(
    vocab_size=config["vocab_size"],
    d_model=config["hidden_size"],
    n_layers=config["num_hidden_layers"],
    n_heads=heads,
    n_kv_heads=config.get("num_key_value_heads") or heads,
    d_mlp=config["intermediate_size"],
    head_dim=config.get("head_dim"),
    rope_base=base,
    rope_scaling=scaling,
    norm_eps=config.get("rms_norm_eps", 1e-6 if kind == "olmo2" else 1e-5),
    tie_embeddings=bool(config.get("tie_word_embeddings", False)),
    max_len=config.get("max_position_embeddings", 2048),
    dtype=dtype,
    qkv_bias=bias or kind == "qwen2",
    o_bias=bias and kind != "qwen2",
    qk_norm=kind in ("qwen3", "olmo2"),
    qk_norm_scope="proj" if kind == "olmo2" else "head",
    norm_placement="post" if kind == "olmo2" else "pre",
    sliding_window=window,
    layer_types=layer_types,
    activation=_hf.activation_field(config, "hidden_act", default="silu"),
    mlp_bias=bool(config.get("mlp_bias", False)),
  )
  if scaling is not None and scaling.kind == "dynamic":
    # Dynamic scaling extends the context past the pretraining one by its factor.
    fields["max_len"] = int(fields["max_len"] * scaling.factor)
  if kind == "phi3":
    config.seen("original_max_position_embeddings")
    fields["fused_projections"] = True
  fields.update(options)
  return LlamaConfig(**fields)


# The Hugging Face model types of the mixtures of experts: Llama-family blocks whose MLP is a
# MoE (jaxlens.models.moe).
MOE_MODEL_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe")

# transformers 5.23's defaults of the fields read here, per model type (a config.json without
# the field means the class default).
_MOE_DEFAULTS = {
  "mixtral": {"num_experts_per_tok": 2, "num_experts": 8},
  "qwen2_moe": {
    "num_experts_per_tok": 4,
    "num_experts": 60,
    "moe_intermediate_size": 1408,
    "shared_expert_intermediate_size": 5632,
    "rms_norm_eps": 1e-6,
  },
  "qwen3_moe": {
    "num_experts_per_tok": 8,
    "num_experts": 128,
    "moe_intermediate_size": 768,
    "rms_norm_eps": 1e-6,
  },
  "olmoe": {"num_experts_per_tok": 8, "num_experts": 64},
}


def _moe_from_hf(config: _hf.HFConfig, dtype) -> LlamaConfig:
  """The :class:`LlamaConfig` (with ``moe``) of a Hugging Face ``config.json`` of a
  ``MOE_MODEL_TYPES`` model.

  Mixtral: every MLP a MoE renormalising its top-k, rotary base 1e6 by default, an optional
  sliding window on every layer. Qwen2-MoE: q/k/v biases (``qkv_bias``), a shared expert with
  a sigmoid gate. Qwen3-MoE: per-head QK-norm. OLMoE: QK-norm over the whole projection.

  Raises:
    LoadError: ``config_unsupported`` for dense layers among the sparse ones
      (``mlp_only_layers``, ``decoder_sparse_step`` > 1), Qwen-MoE's sliding windows, OLMoE's
      ``clip_qkv``.
  """
  kind = config.model_type
  defaults = _MOE_DEFAULTS[kind]

  def get(key):
    return config.get(key, defaults.get(key))

  # transformers aliases the two names (attribute_map): Mixtral's is num_local_experts, the
  # others' num_experts, and Qwen3-MoE's to_dict writes num_local_experts.
  counts = {k: config.get(k) for k in ("num_experts", "num_local_experts")}
  counts = {k: v for k, v in counts.items() if v is not None}
  if len(set(counts.values())) > 1:
    raise config.refuse("num_experts", f"differs from num_local_experts ({counts})", "one count")
  n_experts = next(iter(counts.values()), defaults.get("num_experts", 8))
  options: dict[str, Any] = {}
  if kind == "mixtral":
    norm_topk, d_expert = True, config["intermediate_size"]
    base, scaling = _hf.rope_from_hf(config, default_base=1e6)
    options.update(
      rope_base=base, rope_scaling=scaling, sliding_window=config.get("sliding_window")
    )
  else:
    norm_topk = bool(config.get("norm_topk_prob", False))
    d_expert = get("moe_intermediate_size") if kind != "olmoe" else config["intermediate_size"]
  d_shared = None
  if kind == "qwen2_moe":
    d_shared = get("shared_expert_intermediate_size") or None
    options["qkv_bias"] = bool(config.get("qkv_bias", True))
  if kind in ("qwen2_moe", "qwen3_moe"):
    config.require("use_sliding_window", (False,), "(Qwen-MoE's sliding windows) is refused")
    config.require("mlp_only_layers", ([],), "(dense layers among the experts) is refused")
    config.require("decoder_sparse_step", (1,), "(dense layers among the experts) is refused")
    config.seen("sliding_window", "max_window_layers")
    options.update(norm_eps=get("rms_norm_eps"), qk_norm=kind == "qwen3_moe")
  if kind == "olmoe":
    config.require("clip_qkv", (), "(clipping q, k and v) is not implemented")
    options.update(qk_norm=True, qk_norm_scope="proj")
  activation = _hf.activation_field(config, "hidden_act", default="silu")
  experts = MoEConfig(
    n_experts=n_experts,
    top_k=get("num_experts_per_tok"),
    d_expert=d_expert,
    norm_topk_prob=norm_topk,
    d_shared=d_shared,
    shared_gate=d_shared is not None,
    activation=activation,
  )
  return _dense_from_hf(config, dtype, moe=experts, **options)


MODEL_TYPES = DENSE_MODEL_TYPES + MOE_MODEL_TYPES


def _phi3_split(sizes: tuple[int, ...], k: int):
  """Part ``k`` of Phi-3's fused projection (``qkv_proj``: q, k, v rows; ``gate_up_proj``:
  gate, up rows) as a flax kernel."""
  bounds = [sum(sizes[:i]) for i in range(len(sizes) + 1)]
  return lambda w: np.asarray(w)[bounds[k] : bounds[k + 1]].T


def hf_weights(cfg: LlamaConfig):
  """``(param path, tensor name, transform)`` for each parameter of ``cfg`` in a Hugging Face
  checkpoint (Phi-3's fused projections when ``cfg.fused_projections``)."""
  t, ident = _hf.t, _hf.ident
  yield ("embed", "embedding"), "model.embed_tokens.weight", ident
  for i in range(cfg.n_layers):
    b, h = f"blocks_{i}", f"model.layers.{i}."
    norms = {"ln_1": "input_layernorm", "ln_2": "post_attention_layernorm"}
    if cfg.norm_placement == "post":
      norms = {"ln_1_post": "post_attention_layernorm", "ln_2_post": "post_feedforward_layernorm"}
    for ours, theirs in norms.items():
      yield (b, ours, "weight"), h + f"{theirs}.weight", ident
    if cfg.fused_projections:
      sizes = (cfg.n_heads * cfg.d_head, cfg.n_kv_heads * cfg.d_head, cfg.n_kv_heads * cfg.d_head)
      for k, p in enumerate("qkv"):
        yield (
          (b, "attn", f"{p}_proj", "kernel"),
          h + "self_attn.qkv_proj.weight",
          _phi3_split(sizes, k),
        )
      yield (b, "attn", "o_proj", "kernel"), h + "self_attn.o_proj.weight", t
    else:
      for p in "qkvo":
        yield (b, "attn", f"{p}_proj", "kernel"), h + f"self_attn.{p}_proj.weight", t
        if (cfg.qkv_bias and p != "o") or (cfg.o_bias and p == "o"):
          yield (b, "attn", f"{p}_proj", "bias"), h + f"self_attn.{p}_proj.bias", ident
    if cfg.qk_norm:
      for p in "qk":
        yield (b, "attn", f"{p}_norm", "weight"), h + f"self_attn.{p}_norm.weight", ident
    if cfg.moe is not None:
      yield from hf_moe_weights(cfg, (b, "mlp"), h)
    elif cfg.fused_projections:
      sizes = (cfg.d_mlp, cfg.d_mlp)
      for k, p in enumerate(("gate", "up")):
        yield (
          (b, "mlp", f"{p}_proj", "kernel"),
          h + "mlp.gate_up_proj.weight",
          _phi3_split(sizes, k),
        )
      yield (b, "mlp", "down_proj", "kernel"), h + "mlp.down_proj.weight", t
    else:
      for p in ("gate", "up", "down"):
        yield (b, "mlp", f"{p}_proj", "kernel"), h + f"mlp.{p}_proj.weight", t
        if cfg.mlp_bias:
          yield (b, "mlp", f"{p}_proj", "bias"), h + f"mlp.{p}_proj.bias", ident
  yield ("ln_final", "weight"), "model.norm.weight", ident
  if not cfg.tie_embeddings:
    yield ("lm_head", "kernel"), "lm_head.weight", t
