"""Tests of the built-in demo models (jaxlens.models) and the live-edit benchmark."""

import importlib.util
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxlens as jl
from jaxlens import models

TINY = dict(n_layers=2, d_model=32, n_heads=4, max_len=8, dtype=jnp.float32)
BENCH = Path(__file__).resolve().parent.parent / "benchmarks" / "bench_live_edit.py"


@pytest.fixture(scope="module")
def tiny():
  model, variables, tokens = models.init_gpt(jax.random.key(0), "small", batch=2, **TINY)
  return model, variables, tokens


def test_gpt_config_sizes():
  small, medium = models.gpt_config("small"), models.gpt_config("medium")
  assert (small["n_layers"], small["d_model"], small["max_len"]) == (4, 256, 64)
  assert (medium["n_layers"], medium["d_model"], medium["max_len"]) == (8, 512, 128)
  small["n_layers"] = 99  # a copy: the next call is unaffected
  assert models.gpt_config("small")["n_layers"] == 4
  with pytest.raises(ValueError, match="unknown GPT size"):
    models.gpt_config("huge")


def test_small_gpt_shapes_abstractly():
  model = models.GPT(**models.gpt_config("small"))
  tokens = jax.ShapeDtypeStruct((8, 64), jnp.int32)
  variables = jax.eval_shape(model.init, jax.random.key(0), tokens)
  params = variables["params"]
  assert sorted(params) == sorted(
    ["embed", "pos_embed", "ln_f", "head"] + [f"block_{i}" for i in range(4)]
  )
  assert params["block_0"]["mlp"]["fc"]["kernel"].shape == (256, 1024)
  assert params["block_3"]["attn"]["query"]["kernel"].shape == (256, 256)
  assert all(leaf.dtype == jnp.float32 for leaf in jax.tree.leaves(params))
  logits = jax.eval_shape(model.apply, variables, tokens)
  assert (logits.shape, logits.dtype) == ((8, 64, 128), jnp.float32)


def test_init_gpt_is_deterministic(tiny):
  model, variables, tokens = tiny
  assert tokens.shape == (2, 8) and tokens.dtype == jnp.int32
  assert int(tokens.min()) >= 0 and int(tokens.max()) < model.vocab_size
  _, variables2, tokens2 = models.init_gpt(jax.random.key(0), "small", batch=2, **TINY)
  np.testing.assert_array_equal(tokens, tokens2)
  for a, b in zip(jax.tree.leaves(variables), jax.tree.leaves(variables2)):
    np.testing.assert_array_equal(a, b)


def test_logits_shape_and_causality(tiny):
  model, variables, tokens = tiny
  apply = jax.jit(model.apply)
  logits = apply(variables, tokens)
  assert logits.shape == (2, 8, model.vocab_size) and logits.dtype == jnp.float32
  assert bool(jnp.all(jnp.isfinite(logits)))
  changed = tokens.at[:, 5].set((tokens[:, 5] + 1) % model.vocab_size)
  logits2 = apply(variables, changed)
  np.testing.assert_array_equal(logits[:, :5], logits2[:, :5])  # earlier positions unchanged
  assert not np.allclose(logits[:, 5:], logits2[:, 5:])


def test_too_long_sequence_raises(tiny):
  model, variables, _ = tiny
  with pytest.raises(ValueError, match="max_len"):
    jax.eval_shape(model.apply, variables, jax.ShapeDtypeStruct((1, 9), jnp.int32))


def test_named_sites_exist(tiny):
  model, variables, tokens = tiny
  t = jax.eval_shape(lambda v, x: jl.trace(model, v, x, save=None), variables, tokens)
  labels = set(t.labels)
  for label in (
    "embed",
    "pos_embed",
    "block_0",
    "block_0/ln_1",
    "block_0/attn",
    "block_0/attn/query",
    "block_0/attn/key",
    "block_0/attn/value",
    "block_0/attn/out",
    "block_0/ln_2",
    "block_1/mlp",
    "block_1/mlp/fc",
    "block_1/mlp/proj",
    "ln_f",
    "head",
  ):
    assert label in labels, label
  assert t["block_1/mlp"].out.shape == (2, 8, 32)
  assert t["block_0/attn/query"].out.shape == (2, 8, 32)
  assert t["head"].out.shape == (2, 8, model.vocab_size)


def _load_bench():
  spec = importlib.util.spec_from_file_location("bench_live_edit", BENCH)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def test_bench_live_edit_main_tiny(tmp_path):
  bench = _load_bench()
  out = tmp_path / "live_edit.json"
  result = bench.main(
    [
      "--layers",
      "2",
      "--d-model",
      "32",
      "--seq",
      "8",
      "--batch",
      "2",
      "--repeats",
      "2",
      "--warmup",
      "1",
      "--compile-repeats",
      "0",
      "--no-warmup-compile",
      "--out",
      str(out),
    ]
  )
  for key in (
    "config",
    "env",
    "runtime_s",
    "runtime_ratio",
    "compile_s",
    "compile_ratio_first_call",
    "check",
    "programs",
  ):
    assert key in result, key
  assert result["config"]["site"] == "block_0"
  assert len(result["runtime_s"]["jaxlens_all"]) == len(result["runtime_s"]["hand_all"]) == 2
  check = result["check"]
  np.testing.assert_allclose(check["loss_jaxlens"], check["loss_hand"], rtol=1e-5)
  assert check["grad_max_abs_diff"] < 1e-5
  assert check["loss_jaxlens"] != check["loss_unedited"]  # the edit is live
  assert out.exists()
