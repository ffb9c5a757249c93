"""Tiny random decoders of every zoo family for the lens tests (float64; every parameter,
norm gains and biases included, perturbed so that no term of a decomposition is zero)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

import jaxlens.models as jm

F64 = jnp.float64
VOCAB = 50


def configs():
  return {
    "llama": jm.Llama(
      jm.LlamaConfig(
        vocab_size=VOCAB,
        d_model=16,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        d_mlp=24,
        qkv_bias=True,
        o_bias=True,
        max_len=64,
        dtype=F64,
      )
    ),
    "llama_tied": jm.Llama(
      jm.LlamaConfig(
        vocab_size=VOCAB,
        d_model=16,
        n_layers=2,
        n_heads=2,
        n_kv_heads=2,
        d_mlp=24,
        tie_embeddings=True,
        max_len=64,
        dtype=F64,
      )
    ),
    "gpt2": jm.GPT2(
      jm.GPT2Config(vocab_size=VOCAB, d_model=16, n_layers=2, n_heads=2, max_len=64, dtype=F64)
    ),
    "gpt_neox": jm.GPTNeoX(
      jm.GPTNeoXConfig(vocab_size=VOCAB, d_model=16, n_layers=2, n_heads=2, max_len=64, dtype=F64)
    ),
    "gemma2": jm.Gemma3(
      jm.Gemma3Config(
        vocab_size=VOCAB,
        d_model=16,
        n_layers=2,
        n_heads=2,
        n_kv_heads=1,
        head_dim=8,
        d_mlp=24,
        query_pre_attn_scalar=8.0,
        sliding_window=4,
        sliding_window_pattern=2,
        qk_norm=False,
        attn_softcap=50.0,
        final_softcap=30.0,
        max_len=64,
        dtype=F64,
      )
    ),
    "gemma3": jm.Gemma3(
      jm.Gemma3Config(
        vocab_size=VOCAB,
        d_model=16,
        n_layers=2,
        n_heads=2,
        n_kv_heads=1,
        head_dim=8,
        d_mlp=24,
        query_pre_attn_scalar=8.0,
        sliding_window=4,
        sliding_window_pattern=2,
        max_len=64,
        dtype=F64,
      )
    ),
  }


FAMILIES = tuple(configs())


def build(name, seed: int = 0):
  """``(model, variables)`` of the family ``name``: random parameters (norm gains about 1, every
  bias nonzero), made from the shapes alone (no eager forward of ``model.init``)."""
  model = configs()[name]
  shapes = jax.eval_shape(model.init, jax.random.key(seed), jnp.zeros((1, 4), jnp.int32))
  paths, tree = jax.tree_util.tree_flatten_with_path(shapes)
  keys = jax.random.split(jax.random.key(seed + 1), len(paths))

  def leaf(path, x, key):
    noise = 0.3 * jax.random.normal(key, x.shape, x.dtype)
    norm_gain = path[-1].key in ("weight", "scale") and not isinstance(model, jm.Gemma3)
    return noise + (1.0 if norm_gain else 0.0)

  leaves = [leaf(p, x, k) for (p, x), k in zip(paths, keys)]
  return model, jax.tree_util.tree_unflatten(tree, leaves)
