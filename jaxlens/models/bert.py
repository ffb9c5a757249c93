"""BERT in ``flax.linen``: a post-LayerNorm encoder with token-type embeddings and a pooler,
plus the mean-pooled sentence embedding of sentence-transformers models (all-MiniLM-L6-v2).

Sites (the convention of ``docs/models.md``; post-LN changes where the norms sit): ``embed``,
``pos_embed``, ``type_embed``, ``ln_embed``; per block ``blocks_{i}/``: ``resid_pre``,
``attn/q``, ``attn/k``, ``attn/v``, ``attn/scores``, ``attn/pattern``, ``attn/z``,
``attn_out``, ``ln_1`` and ``resid_mid`` (both the norm of ``resid_pre + attn_out``),
``mlp/pre``, ``mlp/post``, ``mlp_out``, ``ln_2`` and ``resid_post`` (both the norm of
``resid_mid + mlp_out``); ``pooler`` (``Bert.pool`` only).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.linen as nn
import jax.numpy as jnp

from jaxlens.models import _hf
from jaxlens.models.blocks import MLP
from jaxlens.core import InvalidArgumentError, named
from jaxlens.models.compact import Dense, Embed
from jaxlens.models._layers import (
  FlaxLayerNorm,
  LayerSites,
  attend,
  attention_mask,
  check_ids,
  check_length,
  check_mask,
  layer_norm_options,
  lookup_ids,
  real_tokens,
)

__all__ = ["Bert", "BertAttention", "BertBlock", "BertConfig", "mean_pool"]

_INIT = nn.initializers.normal(stddev=0.02)


@dataclasses.dataclass(frozen=True)
class BertConfig:
  """A BERT architecture (defaults: all-MiniLM-L6-v2).

  Attributes:
    vocab_size, d_model, n_layers, n_heads, d_mlp: the sizes.
    max_len: the number of learned positions; ``type_vocab_size`` the token types.
    norm_eps: the LayerNorm epsilon.
    activation: ``"gelu"`` (exact, BERT's) or ``"gelu_new"`` (tanh approximation).
    dtype: computation and parameter dtype.
  """

  vocab_size: int = 30522
  d_model: int = 384
  n_layers: int = 6
  n_heads: int = 12
  d_mlp: int = 1536
  max_len: int = 512
  type_vocab_size: int = 2
  norm_eps: float = 1e-12
  activation: str = "gelu"
  dtype: Any = jnp.float32


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


class BertAttention(nn.Module):
  """Bidirectional multi-head self-attention (no output norm: the block applies it)."""

  config: BertConfig

  @nn.compact
  def __call__(self, x, key_mask=None):
    cfg = self.config
    batch, seq, _ = x.shape
    hd = cfg.d_model // cfg.n_heads

    def heads(name):
      return named(
        _dense(cfg, cfg.d_model, f"{name}_proj")(x).reshape(batch, seq, cfg.n_heads, hd), name
      )

    positions = jnp.arange(seq)
    mask = attention_mask(positions, positions, causal=False, key_mask=key_mask)
    z = attend(heads("q"), heads("k"), heads("v"), mask, dtype=cfg.dtype)
    return _dense(cfg, cfg.d_model, "o_proj")(z.reshape(batch, seq, cfg.d_model))


class BertBlock(nn.Module):
  """Post-LN: ``ln_1(x + attn(x))``, then ``ln_2(h + mlp(h))``."""

  config: BertConfig

  @nn.compact
  def __call__(self, x, key_mask=None):
    cfg = self.config
    x = named(x, "resid_pre")
    a = named(BertAttention(cfg, name="attn")(x, key_mask), "attn_out")
    h = named(_norm(cfg, "ln_1")(x + a), "resid_mid")
    mlp = MLP(cfg.d_mlp, cfg.d_model, cfg.activation, cfg.dtype, names=("up", "down"), name="mlp")
    m = named(mlp(h), "mlp_out")
    return named(_norm(cfg, "ln_2")(h + m), "resid_post")


class Bert(LayerSites, nn.Module):
  """A BERT encoder.

  Methods (pass ``method=`` to ``apply`` or to a jaxlens door):
    ``__call__(tokens, *, attention_mask=None, token_types=None)``: the last hidden states
      ``(batch, seq, d_model)``. The mask and the token types are keyword-only: both are
      int ``(batch, seq)`` arrays, and Hugging Face's ``BertModel`` takes them in the other
      order (``input_ids, attention_mask, token_type_ids``), so a positional one is refused
      (``invalid_argument``) rather than read as the other.
    ``pool(tokens, *, attention_mask=None, token_types=None)``: the pooler output
      ``tanh(dense(h[:, 0]))``, ``(batch, d_model)``.
    ``sentence_embedding(tokens, attention_mask=None)``: the L2-normalised mean of the
      hidden states over real tokens (sentence-transformers' mean pooling + Normalize).
  """

  config: BertConfig

  def setup(self):
    cfg = self.config
    emb = {"dtype": cfg.dtype, "param_dtype": cfg.dtype, "embedding_init": _INIT}
    self.embed = Embed(cfg.vocab_size, cfg.d_model, **emb)
    self.pos_embed = Embed(cfg.max_len, cfg.d_model, **emb)
    self.type_embed = Embed(cfg.type_vocab_size, cfg.d_model, **emb)
    self.ln_embed = _norm(cfg, None)
    self.blocks = [BertBlock(cfg) for _ in range(cfg.n_layers)]
    self.pooler = _dense(cfg, cfg.d_model, None)

  def __call__(self, tokens, *positional, attention_mask=None, token_types=None):
    cfg = self.config
    _refuse_positional(positional, "__call__")
    check_ids(tokens, cfg.vocab_size, "tokens", "embed")
    seq = tokens.shape[1]
    check_length(seq, cfg.max_len, "pos_embed")
    check_mask(attention_mask, tokens)
    if token_types is None:
      token_types = jnp.zeros_like(tokens)
    check_ids(token_types, cfg.type_vocab_size, "token_types", "type_embed")
    x = (
      self.embed(lookup_ids(tokens))
      + self.pos_embed(jnp.arange(seq))[None]
      + self.type_embed(lookup_ids(token_types))
    )
    x = self.ln_embed(x)
    for block in self.blocks:
      x = block(x, attention_mask)
    return x

  def pool(self, tokens, *positional, attention_mask=None, token_types=None):
    _refuse_positional(positional, "pool")
    hidden = self(tokens, attention_mask=attention_mask, token_types=token_types)
    return jnp.tanh(self.pooler(hidden[:, 0]))

  def sentence_embedding(self, tokens, attention_mask=None):
    pooled = mean_pool(self(tokens, attention_mask=attention_mask), attention_mask)
    return pooled / jnp.maximum(jnp.linalg.norm(pooled, axis=-1, keepdims=True), 1e-12)


def _refuse_positional(positional, method):
  if positional:
    raise InvalidArgumentError(
      f"Bert.{method} takes attention_mask= and token_types= by keyword only (got "
      f"{len(positional)} more positional argument(s)): both are int (batch, seq) arrays, so a "
      "positional one could be read as the other (Hugging Face's BertModel takes the mask "
      "second, earlier versions of this model the token types)",
      code="invalid_argument",
      site="embed",
      fix="model.apply(variables, tokens, attention_mask=mask, token_types=types)",
    )


def mean_pool(hidden, attention_mask=None):
  """The mean of ``hidden`` (``(batch, seq, d)``) over the positions where the mask is nonzero."""
  if attention_mask is None:
    return hidden.mean(axis=1)
  m = real_tokens(attention_mask).astype(hidden.dtype)[..., None]
  return (hidden * m).sum(axis=1) / jnp.maximum(m.sum(axis=1), 1e-9)


# ------------------------------------------------------------------- Hugging Face checkpoints

MODEL_TYPES = ("bert",)


def from_hf(config: _hf.HFConfig, dtype) -> BertConfig:
  """The :class:`BertConfig` of a Hugging Face ``config.json``."""
  config.require(
    "position_embedding_type", ("absolute",), "(relative positions) is not implemented"
  )
  config.require("add_cross_attention", (False,), "(a BERT decoder) is refused")
  # The masked-LM head's tying; the encoder and pooler have no unembedding.
  config.seen("gradient_checkpointing", "tie_word_embeddings")
  return BertConfig(
    vocab_size=config["vocab_size"],
    d_model=config["hidden_size"],
    n_layers=config["num_hidden_layers"],
    n_heads=config["num_attention_heads"],
    d_mlp=config["intermediate_size"],
    max_len=config["max_position_embeddings"],
    type_vocab_size=config.get("type_vocab_size", 2),
    norm_eps=config.get("layer_norm_eps", 1e-12),
    activation=_hf.activation_field(config, "hidden_act", default="gelu"),
    dtype=dtype,
  )


def hf_weights(cfg: BertConfig, pooler: bool = True):
  """``(param path, tensor name, transform)`` for each parameter in a Hugging Face checkpoint
  (a checkpoint without a pooler loads with a zero one)."""
  linear, norm = _hf.linear, _hf.layer_norm

  e = "bert.embeddings."
  yield ("embed", "embedding"), e + "word_embeddings.weight", _hf.ident
  yield ("pos_embed", "embedding"), e + "position_embeddings.weight", _hf.ident
  yield ("type_embed", "embedding"), e + "token_type_embeddings.weight", _hf.ident
  yield from norm(("ln_embed",), e + "LayerNorm")
  for i in range(cfg.n_layers):
    b, h = f"blocks_{i}", f"bert.encoder.layer.{i}."
    for p, hf in (("q", "query"), ("k", "key"), ("v", "value")):
      yield from linear((b, "attn", f"{p}_proj"), h + f"attention.self.{hf}")
    yield from linear((b, "attn", "o_proj"), h + "attention.output.dense")
    yield from norm((b, "ln_1"), h + "attention.output.LayerNorm")
    yield from linear((b, "mlp", "up"), h + "intermediate.dense")
    yield from linear((b, "mlp", "down"), h + "output.dense")
    yield from norm((b, "ln_2"), h + "output.LayerNorm")
  if pooler:
    yield from linear(("pooler",), "bert.pooler.dense")
