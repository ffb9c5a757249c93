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
import numpy as np

from jaxlens.core import named
from jaxlens.models import _hf
from jaxlens.models._layers import (
  decoder_inputs,
  LayerNorm,
  LayerSites,
  lookup_ids,
  run_block_after,
  unembed_after,
)
from jaxlens.models.blocks import MLP, Attention, dense, residual_block
from jaxlens.models.compact import Embed
from jaxlens.models.rope import Rope

__all__ = ["GPTNeoX", "GPTNeoXBlock", "GPTNeoXConfig"]

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
    activation: the MLP's activation, a Hugging Face ``hidden_act`` (``"gelu"``: exact).
    attention_bias: biases on the attention projections (Pythia: True).
    tie_embeddings: whether the unembedding is the embedding's transpose (Pythia: no).
    max_len: the context length: a longer input is refused with ``index_out_of_range``.
    dtype: computation and parameter dtype.
    rope_scaling: the rotary scaling (:class:`~jaxlens.models.rope.Rope`; its base and
      fraction are ``rope_base`` and ``rotary_pct``), or None.
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
  rope_scaling: Rope | None = None

  @property
  def d_head(self) -> int:
    return self.d_model // self.n_heads

  @property
  def mlp_width(self) -> int:
    return self.d_mlp or 4 * self.d_model

  @property
  def rotary_dims(self) -> int:
    return int(self.d_head * self.rotary_pct)

  @property
  def rope(self) -> Rope:
    """The blocks' rotary embedding (``rope_scaling`` with this base and fraction)."""
    rope = self.rope_scaling or Rope()
    return dataclasses.replace(rope, base=self.rope_base, fraction=self.rotary_pct)


def _dense(cfg, n, name, bias=True):
  return dense(n, cfg.dtype, name, bias)


def _norm(cfg, name):
  return LayerNorm(cfg.norm_eps, cfg.dtype, name=name)


class GPTNeoXBlock(nn.Module):
  """Parallel: ``resid_post = x + attn(ln_1(x)) + mlp(ln_2(x))``; sequential (GPT-J-free
  NeoX configs): ``resid_mid = x + attn(ln_1(x))``, ``resid_post = resid_mid +
  mlp(ln_2(resid_mid))``. ``mask``, when given, replaces the causal and padding mask."""

  config: GPTNeoXConfig

  @nn.compact
  def __call__(
    self, x, positions, key_mask=None, decode: bool = False, cache_index=None, mask=None
  ):
    cfg = self.config
    attn = Attention(
      cfg.n_heads,
      cfg.n_heads,
      cfg.d_head,
      cfg.d_model,
      cfg.dtype,
      rope=cfg.rope,
      qkv_bias=cfg.attention_bias,
      o_bias=cfg.attention_bias,
      o_name="dense",
      name="attn",
    )
    mlp = MLP(
      cfg.mlp_width,
      cfg.d_model,
      cfg.activation,
      cfg.dtype,
      names=("dense_h_to_4h", "dense_4h_to_h"),
      name="mlp",
    )
    return residual_block(
      x,
      lambda h: attn(h, positions, key_mask, decode, cache_index, mask),
      mlp,
      lambda name: _norm(cfg, name),
      parallel=cfg.parallel_residual,
    )


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


# ------------------------------------------------------------------- Hugging Face checkpoints

MODEL_TYPES = ("gpt_neox",)


def from_hf(config: _hf.HFConfig, dtype) -> GPTNeoXConfig:
  """The :class:`GPTNeoXConfig` of a Hugging Face ``config.json``."""
  rope = config.config.get("rope_parameters") or {}
  config.seen("rotary_pct", "rotary_emb_base")
  pct = rope.get("partial_rotary_factor", config.config.get("rotary_pct", 1.0))
  base, scaling = _hf.rope_from_hf(config, default_base=config.get("rotary_emb_base", 10000.0))
  if scaling is not None and scaling.kind == "default":
    scaling = None  # only partial: rotary_pct says it
  return GPTNeoXConfig(
    vocab_size=config["vocab_size"],
    d_model=config["hidden_size"],
    n_layers=config["num_hidden_layers"],
    n_heads=config["num_attention_heads"],
    d_mlp=config.get("intermediate_size"),
    rotary_pct=float(pct),
    rope_base=base,
    rope_scaling=scaling,
    norm_eps=config.get("layer_norm_eps", 1e-5),
    parallel_residual=bool(config.get("use_parallel_residual", True)),
    activation=_hf.activation_field(config, "hidden_act", default="gelu"),
    attention_bias=bool(config.get("attention_bias", True)),
    tie_embeddings=bool(config.get("tie_word_embeddings", False)),
    max_len=config.get("max_position_embeddings", 2048),
    dtype=dtype,
  )


def _qkv(k, heads):
  """The ``k``-th of q, k, v from GPT-NeoX's fused projection, whose output rows are per head
  ``[q | k | v]``; a weight ``(3 d, d_in)`` gives a kernel ``(d_in, d)``, a bias ``(d,)``."""

  def take(w):
    w = np.asarray(w)
    if w.shape[0] % (3 * heads):  # (params_from_hf reports it as tensor_shape)
      raise ValueError(f"{w.shape[0]} rows do not split into q, k, v of {heads} heads")
    rows = w.reshape(heads, 3, -1, *w.shape[1:])[:, k]
    rows = rows.reshape(-1, *w.shape[1:])
    return rows.T if rows.ndim == 2 else rows

  return take


def hf_weights(cfg: GPTNeoXConfig):
  """``(param path, tensor name, transform)`` for each parameter in a Hugging Face checkpoint."""
  t, ident, linear, norm = _hf.t, _hf.ident, _hf.linear, _hf.layer_norm
  yield ("embed", "embedding"), "gpt_neox.embed_in.weight", ident
  for i in range(cfg.n_layers):
    b, h = f"blocks_{i}", f"gpt_neox.layers.{i}."
    yield from norm((b, "ln_1"), h + "input_layernorm")
    yield from norm((b, "ln_2"), h + "post_attention_layernorm")
    fused = h + "attention.query_key_value"
    for k, p in enumerate("qkv"):
      yield (b, "attn", f"{p}_proj", "kernel"), fused + ".weight", _qkv(k, cfg.n_heads)
      if cfg.attention_bias:
        yield (b, "attn", f"{p}_proj", "bias"), fused + ".bias", _qkv(k, cfg.n_heads)
    yield from linear((b, "attn", "dense"), h + "attention.dense", cfg.attention_bias)
    yield from linear((b, "mlp", "dense_h_to_4h"), h + "mlp.dense_h_to_4h")
    yield from linear((b, "mlp", "dense_4h_to_h"), h + "mlp.dense_4h_to_h")
  yield from norm(("ln_final",), "gpt_neox.final_layer_norm")
  if not cfg.tie_embeddings:
    yield ("lm_head", "kernel"), "lm_head.weight", t
