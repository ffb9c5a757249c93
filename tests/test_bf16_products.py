"""bfloat16 weights multiplied a chunk at a time (jaxlens.models.compact.times_wide): the product
XLA computes for the whole matrix, without a float32 copy of the whole matrix."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxlens as jl
from jaxlens.models import Llama, LlamaConfig, compact

K = 24


@pytest.fixture
def small_chunks(monkeypatch):
  """Chunks of 16 columns for a 24-wide contraction (the smallest chunk the product takes), for
  few rows and many."""
  monkeypatch.setattr(compact, "WIDEN_BYTES", 4 * K * 16)
  monkeypatch.setattr(compact, "WIDEN_BYTES_FEW", 4 * K * 16)


def _plain(x, matrix, contract, dtype):
  """What the layers computed before: both operands in ``dtype``, one ``dot_general``."""
  return jax.lax.dot_general(
    x.astype(dtype), matrix.astype(dtype), (((x.ndim - 1,), (contract,)), ((), ()))
  )


@pytest.mark.parametrize("contract", [0, 1])
@pytest.mark.parametrize("n", [10, 40])  # one chunk; two chunks and a tail of 8
@pytest.mark.parametrize(
  "x_dtype, dtype",
  [(jnp.bfloat16, jnp.bfloat16), (jnp.float32, jnp.bfloat16), (jnp.float32, jnp.float32)],
)
def test_chunked_product_equals_the_plain_product(small_chunks, contract, n, x_dtype, dtype):
  rng = np.random.default_rng(n + contract)
  # Small integers: every float32 partial sum is exact, so any summation order gives the same
  # float32 value and the two products must agree bit for bit (a chunk misplaced, a tail lost or
  # a rounding to another dtype shows).
  x = jnp.asarray(rng.integers(-4, 5, (2, 3, K)), x_dtype)
  shape = (K, n) if contract == 0 else (n, K)
  m = jnp.asarray(rng.integers(-4, 5, shape), jnp.bfloat16)
  got = jax.jit(compact.times_wide, static_argnums=(2, 3))(x, m, contract, dtype)
  want = jax.jit(_plain, static_argnums=(2, 3))(x, m, contract, dtype)
  assert got.dtype == want.dtype == jnp.dtype(dtype)
  np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
  # Random values: float32 products that differ only in XLA's summation order for each shape
  # (as XLA's own product of one row differs between batch sizes).
  x = jnp.asarray(rng.standard_normal((2, 3, K)), x_dtype)
  m = jnp.asarray(rng.standard_normal(shape), jnp.bfloat16)
  got = jax.jit(compact.times_wide, static_argnums=(2, 3))(x, m, contract, dtype)
  want = jax.jit(_plain, static_argnums=(2, 3))(x, m, contract, dtype)
  tol = 1e-5 if dtype == jnp.float32 else 2**-7
  np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=tol)


@pytest.mark.parametrize("rows", [1, 8, 9])  # a decoding step's few rows, and more
@pytest.mark.parametrize("contract", [0, 1])
def test_chunked_product_against_float64(monkeypatch, rows, contract):
  """Chunks of 16 (few rows) and 32 columns (many) of a 24-deep matrix of 72 columns (a tail
  of 8 or 24): the float32 product of the bfloat16 values, within float32's bound for a sum of
  K products, ``|y - y64| <= K * 2**-24 * sum_k |x_k w_k|``, of the float64 product."""
  monkeypatch.setattr(compact, "WIDEN_BYTES_FEW", 4 * K * 16)
  monkeypatch.setattr(compact, "WIDEN_BYTES", 4 * K * 32)
  assert compact._chunk_columns(K, rows) == (16 if rows <= compact.FEW_ROWS else 32)
  rng = np.random.default_rng(rows)
  x = jnp.asarray(rng.standard_normal((rows, K)), jnp.float32)
  shape = (K, 72) if contract == 0 else (72, K)
  m = jnp.asarray(rng.standard_normal(shape), jnp.bfloat16)
  got = jax.jit(compact.times_wide, static_argnums=(2, 3))(x, m, contract, jnp.float32)
  x64, m64 = np.asarray(x, np.float64), np.asarray(m, np.float64)
  w64 = m64 if contract == 0 else m64.T
  bound = K * 2.0**-24 * (np.abs(x64) @ np.abs(w64))
  assert got.dtype == jnp.float32 and got.shape == (rows, 72)
  assert np.all(np.abs(np.asarray(got, np.float64) - x64 @ w64) <= bound)


def _loop_temp_bytes(n, k=64):
  """The temporary bytes of a jitted loop that applies a bfloat16 ``Dense`` three times."""
  layer = compact.Dense(n, use_bias=False, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)
  v = {"params": {"kernel": jnp.ones((k, n), jnp.bfloat16)}}

  def loop(v, x):
    return jax.lax.fori_loop(0, 3, lambda i, h: layer.apply(v, h)[:, :k], x)

  compiled = jax.jit(loop).lower(v, jnp.ones((1, k), jnp.bfloat16)).compile()
  return compiled.memory_analysis().temp_size_in_bytes


def test_no_float32_copy_of_the_whole_matrix_in_a_loop(monkeypatch):
  monkeypatch.setattr(compact, "WIDEN_BYTES_FEW", 4 * 64 * 64)  # the loop's one row
  monkeypatch.setattr(compact, "WIDEN_BYTES", 4 * 64 * 1024)  # would widen it whole
  whole = 64 * 1024 * 4  # the float32 copy of the (64, 1024) kernel
  assert _loop_temp_bytes(1024) < whole / 4
  # The plain product: XLA widens the whole kernel once, ahead of the loop.
  monkeypatch.setattr(compact, "widens", lambda matrix, dtype: False)
  assert _loop_temp_bytes(1024) > whole


CFG = LlamaConfig(
  vocab_size=80,
  d_model=K,
  n_layers=1,
  n_heads=4,
  n_kv_heads=2,
  d_mlp=40,
  tie_embeddings=True,
  dtype=jnp.bfloat16,
)
TOKENS = jnp.asarray([[3, 1, 4, 1, 5, 9]], jnp.int32)


def _random_variables(model):
  """Random bfloat16 parameters in the model's shapes (without compiling its initializer)."""
  shapes = jax.eval_shape(model.init, jax.random.key(0), TOKENS)
  leaves, tree = jax.tree.flatten(shapes)
  rng = np.random.default_rng(0)
  values = [
    (1.0 if len(s.shape) == 1 else 0.0) + 0.3 * rng.standard_normal(s.shape) for s in leaves
  ]
  return jax.tree.unflatten(tree, [jnp.asarray(v, s.dtype) for v, s in zip(values, leaves)])


def test_bfloat16_model_generates_as_the_plain_products_compute(small_chunks, monkeypatch):
  """A bfloat16 Llama whose projections, MLP and tied unembedding are chunked: jl.generate (its
  products inside the decoding loop) chooses the tokens, and gives the logits, that one forward
  of the same model with every product left to XLA gives on the generated sequence."""
  model = Llama(CFG)
  variables = _random_variables(model)
  assert variables["params"]["blocks_0"]["mlp"]["up_proj"]["kernel"].dtype == jnp.bfloat16
  out = jl.generate(model, variables, TOKENS, 3)
  monkeypatch.setattr(compact, "widens", lambda matrix, dtype: False)
  sequence = jnp.concatenate([TOKENS, out.tokens[:, :2]], axis=1)
  plain = jax.jit(model.apply)(variables, sequence)[:, TOKENS.shape[1] - 1 :]
  assert out.logits.dtype == plain.dtype == jnp.bfloat16
  np.testing.assert_allclose(
    np.asarray(out.logits, np.float32), np.asarray(plain, np.float32), atol=0.05
  )
  np.testing.assert_array_equal(out.tokens, jnp.argmax(plain, axis=-1))


def test_gradient_and_vmap_of_the_chunked_product(small_chunks):
  rng = np.random.default_rng(1)
  x = jnp.asarray(rng.standard_normal((3, K)), jnp.float32)
  m = jnp.asarray(rng.standard_normal((K, 40)), jnp.bfloat16)

  def loss(product):
    return lambda x, m: (product(x, m, 0, jnp.float32) ** 2).sum()

  got = jax.grad(loss(compact.times_wide), argnums=(0, 1))(x, m)
  want = jax.grad(loss(_plain), argnums=(0, 1))(x, m)
  for a, b in zip(got, want):
    assert a.dtype == b.dtype
    np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=1e-2)
  rows = jax.vmap(lambda r: compact.times_wide(r, m, 0, jnp.float32))(x)
  np.testing.assert_allclose(rows, _plain(x, m, 0, jnp.float32), rtol=1e-5)
