"""Compact weights (jaxlens.models.compact): int8 rows and GGUF blocks dequantised inside the
product give what the float model given the same dequantised weights by hand gives."""

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxlens as jl
from jaxlens.models import Llama, LlamaConfig, compact
from jaxlens.models.loading import LoadError, _unpermute, load_gguf

from _checkpoints import llama_checkpoint

CFG = LlamaConfig(
  vocab_size=96, d_model=64, n_layers=1, n_heads=4, n_kv_heads=2, d_mlp=96, tie_embeddings=True
)
TOKENS = jnp.asarray([[3, 1, 4, 1, 5, 9, 2, 6]])


def _raw_blocks(kind, rows, cols, seed=0):
  """Random GGUF bytes of ``kind`` for a ``(rows, cols)`` matrix, with finite float16 scales."""
  rng = np.random.default_rng(seed)
  n = cols // 32
  if kind == "Q8_0":
    scale = rng.uniform(0.001, 0.1, (rows, n, 1)).astype(np.float16).view(np.uint8)
    values = rng.integers(-128, 128, (rows, n, 32)).astype(np.int8).view(np.uint8)
    return np.concatenate([scale, values], -1).reshape(rows, -1)
  scale = rng.uniform(0.001, 0.1, (rows, n, 1)).astype(np.float16).view(np.uint8)
  low = rng.uniform(-1, 1, (rows, n, 1)).astype(np.float16).view(np.uint8)
  packed = rng.integers(0, 256, (rows, n, 16)).astype(np.uint8)
  return np.concatenate([scale, low, packed], -1).reshape(rows, -1)


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_1"])
def test_gguf_blocks_dequantise_to_what_gguf_gives(kind):
  raw = _raw_blocks(kind, 6, 64)
  m = compact.blocks_from_gguf(raw, kind, (6, 64))
  expected = gguf.quants.dequantize(raw, getattr(gguf.GGMLQuantizationType, kind))
  np.testing.assert_array_equal(np.asarray(m.matrix()), expected.reshape(6, 64))
  np.testing.assert_array_equal(np.asarray(m.rows(jnp.asarray([4, 1]))), expected[[4, 1]])


def test_other_gguf_types_and_unknown_weights_are_refused():
  with pytest.raises(jl.InvalidArgumentError, match="Q5_0 .* not kept compact"):
    compact.blocks_from_gguf(np.zeros((2, 44), np.uint8), "Q5_0", (2, 64))
  with pytest.raises(jl.InvalidArgumentError, match="not a compact form"):
    compact.compact_params({}, "gguf")
  with pytest.raises(LoadError, match="unknown weights='int4'"):
    load_gguf("no-such-file.gguf", weights="int4")


def test_unpermute_rows_matches_the_loader_on_matrices():
  w = np.arange(8 * 3, dtype=np.float32).reshape(8, 3)
  np.testing.assert_array_equal(compact._unpermute_rows(w, 2), _unpermute(w, 2))


@pytest.fixture(scope="module")
def tiny():
  model = Llama(CFG)
  variables = jax.jit(model.init)(jax.random.key(0), TOKENS)
  return model, variables


def _compare(model, compact_vars, atol):
  """The compact model and the float model holding its dequantised weights: same output, same
  site values, and the same edit has the same effect."""
  by_hand = {"params": compact.dequantize(compact_vars["params"])}
  site = jl.module("blocks_0/resid_mid")
  steer = jl.when(site, jl.steer(jnp.ones(CFG.d_model), 0.5))
  run = jax.jit(
    lambda v: (jl.trace(model, v, TOKENS, save=site).values, steer.bind(model)(v, TOKENS))
  )
  (saved_c, out_c), (saved_f, out_f) = run(compact_vars), run(by_hand)
  assert list(saved_c) == list(saved_f) == ["blocks_0/resid_mid"]
  np.testing.assert_allclose(
    saved_c["blocks_0/resid_mid"], saved_f["blocks_0/resid_mid"], atol=atol
  )
  np.testing.assert_allclose(out_c, out_f, atol=atol)


def test_int8_model_equals_its_weights_dequantised_by_hand(tiny, monkeypatch):
  model, variables = tiny
  # Chunks of 16 rows: the tied unembedding (96 rows) runs the chunked product, with a tail.
  monkeypatch.setattr(compact, "_CHUNK", 16 * CFG.d_model + 1)
  q = {"params": compact.compact_params(variables["params"], "int8")}
  kernel = q["params"]["blocks_0"]["mlp"]["up_proj"]["kernel"]
  assert isinstance(kernel, compact.Int8Rows) and kernel.values.dtype == jnp.int8
  assert kernel.shape == (CFG.d_mlp, CFG.d_model)  # (out, in)
  assert isinstance(q["params"]["embed"]["embedding"], compact.Int8Rows)
  assert q["params"]["ln_final"]["weight"].dtype == jnp.float32
  w = variables["params"]["blocks_0"]["mlp"]["up_proj"]["kernel"]
  deq = compact.dequantize(q["params"])["blocks_0"]["mlp"]["up_proj"]["kernel"]
  # Rounding to the nearest of 255 levels per output channel.
  assert np.abs(deq - w).max() <= np.abs(w).max(axis=0).max() / 254 + 1e-7
  _compare(model, q, atol=2e-5)


def test_gguf_blocks_model_equals_its_weights_dequantised_by_hand(tiny):
  model, variables = tiny
  params = jax.tree.map(lambda x: x, variables["params"])
  params["embed"]["embedding"] = compact.blocks_from_gguf(
    _raw_blocks("Q8_0", CFG.vocab_size, CFG.d_model), "Q8_0", (CFG.vocab_size, CFG.d_model)
  )
  params["blocks_0"]["attn"]["q_proj"]["kernel"] = compact.blocks_from_gguf(
    _raw_blocks("Q4_1", CFG.d_model, CFG.d_model, 1), "Q4_1", (CFG.d_model, CFG.d_model)
  )
  _compare(model, {"params": params}, atol=1e-4)


def test_bfloat16_weights_run_in_the_float32_model(tiny):
  model, variables = tiny
  b = compact.compact_params(variables["params"], "bfloat16")
  assert b["blocks_0"]["attn"]["q_proj"]["kernel"].dtype == jnp.bfloat16
  apply = jax.jit(model.apply)
  out = apply({"params": b}, TOKENS)
  assert out.dtype == jnp.float32
  ref = apply({"params": jax.tree.map(lambda a: a.astype(jnp.float32), b)}, TOKENS)
  np.testing.assert_allclose(out, ref, atol=1e-5)


def _tiny_checkpoint(path):
  """A two-layer Llama checkpoint as transformers writes it (kernels ``(out, in)``), random."""
  rng = np.random.default_rng(0)
  return llama_checkpoint(
    path,
    vocab=32,
    width=16,
    mlp=24,
    heads=4,
    kv_heads=2,
    draw=lambda shape: rng.standard_normal(shape) * 0.3,
    rms_norm_eps=1e-6,
  )


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
  return _tiny_checkpoint(tmp_path_factory.mktemp("rows"))


def test_rows_layout_computes_what_columns_compute(checkpoint):
  """``load_hf(layout="rows")`` keeps every kernel as the checkpoint's ``(out, in)`` rows; the
  model's logits under an edit, generated tokens and weight gradients are the columns model's
  (float64: to rounding)."""
  from jaxlens.models import load_hf

  path = checkpoint
  cols, rows = load_hf(path, jnp.float64), load_hf(path, jnp.float64, layout="rows")
  kernel = rows.variables["params"]["blocks_1"]["mlp"]["down_proj"]["kernel"]
  assert isinstance(kernel, compact.Rows) and kernel.shape == (16, 24)  # (out, in)
  np.testing.assert_array_equal(
    kernel.values.T, cols.variables["params"]["blocks_1"]["mlp"]["down_proj"]["kernel"]
  )
  assert not isinstance(rows.variables["params"]["embed"]["embedding"], compact.Rows)
  model, tokens = cols.model, jnp.asarray([[3, 1, 4, 1, 5, 9]])
  site = jl.module("blocks_0/resid_mid")
  steer = jl.when(site, jl.steer(jnp.ones(16, jnp.float64), 0.5))

  @jax.jit
  def run(v):
    def loss(v):
      logits = steer.bind(model)(v, tokens)
      return jax.nn.logsumexp(logits[0, -1]), logits

    return jax.grad(loss, has_aux=True)(v)

  (g_c, out_c), (g_r, out_r) = run(cols.variables), run(rows.variables)
  np.testing.assert_allclose(out_r, out_c, rtol=1e-12, atol=1e-12)
  g_rows = g_r["params"]["blocks_0"]["attn"]["q_proj"]["kernel"]
  assert isinstance(g_rows, compact.Rows)
  np.testing.assert_allclose(
    g_rows.values.T, g_c["params"]["blocks_0"]["attn"]["q_proj"]["kernel"], rtol=1e-10, atol=1e-12
  )
  gen_c = jl.generate(model, cols.variables, tokens, 3).tokens
  np.testing.assert_array_equal(jl.generate(model, rows.variables, tokens, 3).tokens, gen_c)
  # rows_params converts a loaded model's columns; dequantize turns rows back into columns
  for converted in (
    compact.rows_params(cols.variables["params"]),
    compact.compact_params(cols.variables["params"], "rows"),  # load_gguf's weights="rows"
  ):
    assert jax.tree.all(jax.tree.map(np.array_equal, converted, rows.variables["params"]))
  back = compact.dequantize(rows.variables["params"], jnp.float64)
  assert jax.tree.all(jax.tree.map(np.array_equal, back, cols.variables["params"]))
  with pytest.raises(LoadError, match="unknown layout='cols'") as e:
    load_hf(path, layout="cols")
  assert e.value.code == "invalid_argument"


def test_bfloat16_rows_run_in_the_float32_model(checkpoint):
  """bfloat16 rows in a float32 model go through the chunked widening product (times_wide over
  the rows) and give the bfloat16 columns model's values."""
  from jaxlens.models import load_hf

  lm = load_hf(checkpoint, jnp.float32)
  b = compact.compact_params(lm.variables["params"], "bfloat16")
  r = compact.rows_params(b)
  kernel = r["blocks_0"]["mlp"]["up_proj"]["kernel"]
  assert isinstance(kernel, compact.Rows) and kernel.values.dtype == jnp.bfloat16
  apply, tokens = jax.jit(lm.model.apply), jnp.asarray([[3, 1, 4, 1, 5]])
  np.testing.assert_allclose(apply({"params": r}, tokens), apply({"params": b}, tokens), atol=1e-5)
