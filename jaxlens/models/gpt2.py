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
import numpy as np

from jaxlens.core import named
from jaxlens.models import _hf
from jaxlens.models.blocks import MLP, Attention, residual_block
from jaxlens.models.compact import Dense, Embed
from jaxlens.models.scan import ScanForm, scan_blocks
from jaxlens.models._layers import (
  decoder_inputs,
  FlaxLayerNorm,
  LayerSites,
  check_ids,
  lookup_ids,
  layer_norm_options,
  run_block_after,
  unembed_after,
)

__all__ = ["GPT2", "GPT2Block", "GPT2Config"]

_INIT = nn.initializers.normal(stddev=0.02)


@dataclasses.dataclass(frozen=True)
class GPT2Config:
  """A GPT-2 architecture (defaults: the 124M model).

  Attributes:
    vocab_size, d_model, n_layers, n_heads: the sizes; ``d_mlp`` defaults to ``4 * d_model``.
    max_len: the number of learned positions.
    norm_eps: the LayerNorm epsilon.
    activation: the MLP's activation, a Hugging Face name (``"gelu_new"``: the tanh
      approximation, GPT-2's; ``"gelu"``: exact).
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


def _norm(cfg, name):
  return FlaxLayerNorm(
    cfg.norm_eps,
    dtype=cfg.dtype,
    param_dtype=cfg.dtype,
    name=name,
    **layer_norm_options(cfg.dtype),
  )


class GPT2Block(nn.Module):
  """``resid_mid = x + attn(ln_1(x))``; ``resid_post = resid_mid + mlp(ln_2(resid_mid))``.

  ``mask``, when given, is the boolean attention mask (broadcastable to ``(batch, heads, q,
  k)``) used instead of the causal and padding one; the causal-cone sweep passes it.
  """

  config: GPT2Config

  @nn.compact
  def __call__(
    self, x, positions, key_mask=None, decode: bool = False, cache_index=None, mask=None
  ):
    cfg = self.config
    d_head = cfg.d_model // cfg.n_heads
    attn = Attention(
      cfg.n_heads,
      cfg.n_heads,
      d_head,
      cfg.d_model,
      cfg.dtype,
      qkv_bias=True,
      o_bias=True,
      o_name="c_proj",
      name="attn",
    )
    mlp = MLP(cfg.mlp_width, cfg.d_model, cfg.activation, cfg.dtype, name="mlp")
    return residual_block(
      x,
      lambda h: attn(h, positions, key_mask, decode, cache_index, mask),
      mlp,
      lambda name: _norm(cfg, name),
    )


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


# ------------------------------------------------------------------- Hugging Face checkpoints

MODEL_TYPES = ("gpt2",)


def from_hf(config: _hf.HFConfig, dtype) -> GPT2Config:
  """The :class:`GPT2Config` of a Hugging Face ``config.json``."""
  config.require("add_cross_attention", (False,), "(an encoder-decoder GPT-2) is refused")
  config.require("scale_attn_weights", (True,), "(unscaled attention) is not implemented")
  config.require(
    "scale_attn_by_inverse_layer_idx", (False,), "(scores scaled per layer) is not implemented"
  )
  # Upcasting the scores to float32 changes nothing in a float32 or float64 model, and the
  # zoo's softmax already runs in at least float32.
  config.seen("reorder_and_upcast_attn", "n_ctx")
  # The sequence-classification head's fields, not the language model's.
  config.seen(
    "summary_type",
    "summary_use_proj",
    "summary_activation",
    "summary_proj_to_labels",
    "summary_first_dropout",
  )
  return GPT2Config(
    vocab_size=config["vocab_size"],
    d_model=config["n_embd"],
    n_layers=config["n_layer"],
    n_heads=config["n_head"],
    d_mlp=config.get("n_inner"),
    max_len=config["n_positions"],
    norm_eps=config.get("layer_norm_epsilon", 1e-5),
    activation=_hf.activation_field(config, "activation_function", default="gelu_new"),
    tie_embeddings=bool(config.get("tie_word_embeddings", True)),
    dtype=dtype,
  )


def _split3(k):
  return lambda w: np.split(np.asarray(w), 3, axis=-1)[k]


def hf_weights(cfg: GPT2Config):
  """``(param path, tensor name, transform)`` for each parameter in a Hugging Face checkpoint
  (GPT-2's ``Conv1D`` weights are stored ``(in, out)``, as flax's kernels)."""
  ident = _hf.ident
  yield ("embed", "embedding"), "transformer.wte.weight", ident
  yield ("pos_embed", "embedding"), "transformer.wpe.weight", ident
  for i in range(cfg.n_layers):
    b, h = f"blocks_{i}", f"transformer.h.{i}."
    for ln in ("ln_1", "ln_2"):
      yield (b, ln, "scale"), h + f"{ln}.weight", ident
      yield (b, ln, "bias"), h + f"{ln}.bias", ident
    for k, p in enumerate("qkv"):
      yield (b, "attn", f"{p}_proj", "kernel"), h + "attn.c_attn.weight", _split3(k)
      yield (b, "attn", f"{p}_proj", "bias"), h + "attn.c_attn.bias", _split3(k)
    for mod in ("attn.c_proj", "mlp.c_fc", "mlp.c_proj"):
      for leaf, hf in (("kernel", "weight"), ("bias", "bias")):
        yield (b, *mod.split("."), leaf), h + f"{mod}.{hf}", ident
  yield ("ln_final", "scale"), "transformer.ln_f.weight", ident
  yield ("ln_final", "bias"), "transformer.ln_f.bias", ident
  if not cfg.tie_embeddings:
    yield ("lm_head", "kernel"), "lm_head.weight", _hf.t
