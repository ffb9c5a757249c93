"""Activation-patching sweeps: a batch of edits under vmap equals a loop of single patches."""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxlens as jl
from jaxlens.models import GPT

VOCAB, SEQ, CORRUPTED = 11, 6, 2
F64 = jnp.float64


@pytest.fixture(scope="module")
def gpt():
  """A tiny float64 GPT and a clean/corrupt pair that differs at position CORRUPTED."""
  # Inputs from numpy and one jitted init: on a CPU every eager jax op compiles on first use.
  rng = np.random.default_rng(0)
  clean_np = rng.integers(0, VOCAB, (3, SEQ)).astype(np.int32)
  corrupt_np = clean_np.copy()
  corrupt_np[:, CORRUPTED] = (corrupt_np[:, CORRUPTED] + 1) % VOCAB
  clean, corrupt = jnp.asarray(clean_np), jnp.asarray(corrupt_np)
  model = GPT(vocab_size=VOCAB, d_model=16, n_heads=2, n_layers=2, max_len=SEQ, dtype=F64)
  return model, _numpy_init(model, clean, seed=0), clean, corrupt


def _numpy_init(model, example, seed):
  """Variables of ``model`` drawn with numpy: normal(0, 0.3) weights, zero biases, unit scales.

  Only the shapes come from ``model.init`` (through ``jax.eval_shape``), which keeps XLA
  from compiling the initialisers: on a loaded CPU that compile takes seconds.
  """
  rng = np.random.default_rng(seed)
  shapes = jax.eval_shape(model.init, jax.random.key(0), example)

  def draw(path, leaf):
    name = jax.tree_util.keystr(path[-1:])
    if "bias" in name:
      return jnp.zeros(leaf.shape, F64)
    if "scale" in name:
      return jnp.ones(leaf.shape, F64)
    return jnp.asarray(rng.normal(0.0, 0.3, leaf.shape), F64)

  return jax.tree_util.tree_map_with_path(draw, shapes)


class _Block(nn.Module):
  """A float64 causal-attention block: x + attn(x), then x + mlp(x)."""

  @nn.compact
  def __call__(self, x):
    d = x.shape[-1]
    q, k, v = (nn.Dense(d, param_dtype=F64, name=n)(x) for n in ("query", "key", "value"))
    scores = jnp.einsum("bqd,bkd->bqk", q, k) / jnp.sqrt(d)
    causal = jnp.tril(jnp.ones((x.shape[1], x.shape[1]), bool))
    weights = jax.nn.softmax(jnp.where(causal, scores, -jnp.inf), axis=-1)
    x = x + nn.Dense(d, param_dtype=F64, name="attn")(weights @ v)
    return x + nn.Dense(d, param_dtype=F64, name="mlp")(jnp.tanh(x))


class _SeqModel(nn.Module):
  """embed, block_0, block_1, head: a tiny sequence model computed wholly in float64."""

  n_layers: int = 2

  @nn.compact
  def __call__(self, tokens):
    x = nn.Embed(VOCAB, 8, param_dtype=F64, name="embed")(tokens)
    x = x + self.param("pos", nn.initializers.normal(1.0), (SEQ, 8), F64)
    for i in range(self.n_layers):
      x = _Block(name=f"block_{i}")(x)
    return nn.Dense(VOCAB, param_dtype=F64, name="head")(x)


@pytest.fixture(scope="module")
def seq_model(gpt):
  _, _, clean, corrupt = gpt
  model = _SeqModel()
  return model, _numpy_init(model, clean, seed=3), clean, corrupt


def logit_diff(out):
  """The mean difference of two logits at the last position: a scalar metric."""
  return (out[:, -1, 0] - out[:, -1, 1]).mean()


def _loop(model, variables, clean, corrupt, sites, positions):
  """The reference: one jl.at_positions(jl.patch_from(...)) call per (site, position).

  Each single patch is jitted (once per site; the position is an argument), as a user's
  loop would be; eager op-by-op dispatch would only make the test slower.
  """

  @functools.partial(jax.jit, static_argnums=0)
  def single(site, position):
    donor = jl.trace(model, variables, clean)
    edit = jl.at_positions(position[None], jl.patch_from(donor))
    return logit_diff(jl.when(jl.module(site), edit).bind(model)(variables, corrupt))

  grid = np.zeros((len(sites), len(positions)))
  for i, site in enumerate(sites):
    for j, p in enumerate(positions):
      grid[i, j] = single(site, jnp.asarray(p, jnp.int32))
  return grid


def test_the_sweep_equals_a_loop_of_single_patches(seq_model):
  model, variables, clean, corrupt = seq_model
  sites = ("embed", "block_0/attn", "block_0", "block_1")
  grid = jl.sweep.patching_sweep(model, variables, clean, corrupt, logit_diff, sites=sites)
  want = _loop(model, variables, clean, corrupt, sites, range(SEQ))
  assert grid.shape == (4, SEQ) and grid.dtype == jnp.float64
  np.testing.assert_allclose(grid, want, atol=1e-10, rtol=0)
  # The loop is not trivial: the patches do change the metric.
  assert np.ptp(want) > 1e-3


def test_the_sweep_equals_the_loop_on_the_gpt(gpt):
  """The same on jaxlens.models.GPT, to float32 precision.

  The GPT runs its softmax in float32 even in a float64 model, and XLA's batched
  float32 kernels round differently from the unbatched ones (a plain
  ``jax.jit(jax.vmap(model.apply))`` over 24 copies of one input differs from
  ``model.apply`` by about 1e-9), so this comparison is to 1e-7, not 1e-10.
  """
  model, variables, clean, corrupt = gpt
  sites, positions = ("block_0/attn", "block_1"), (CORRUPTED, SEQ - 1)
  grid = jl.sweep.patching_sweep(
    model, variables, clean, corrupt, logit_diff, sites=sites, positions=positions
  )
  want = _loop(model, variables, clean, corrupt, sites, positions)
  np.testing.assert_allclose(grid, want, atol=1e-7, rtol=0)
  assert np.ptp(want) > 1e-4


def test_what_patching_must_give(seq_model):
  """Cells whose value follows from causality alone, without training."""
  model, variables, clean, corrupt = seq_model
  grid = np.asarray(
    jl.sweep.patching_sweep(
      model, variables, clean, corrupt, logit_diff, sites=("embed", "block_0", "block_1")
    )
  )
  metric = jax.jit(lambda v, x: logit_diff(model.apply(v, x)))  # one program for both runs
  m_clean, m_corrupt = float(metric(variables, clean)), float(metric(variables, corrupt))
  assert abs(m_clean - m_corrupt) > 1e-4
  # Before the corrupted position the two runs agree: patching there changes nothing.
  np.testing.assert_allclose(grid[:, :CORRUPTED], m_corrupt, atol=1e-12)
  # Patching the embedding at the corrupted position turns the corrupt run into the clean one,
  # and patching the last block at the last position gives the clean logits there.
  np.testing.assert_allclose(grid[0, CORRUPTED], m_clean, atol=1e-12)
  np.testing.assert_allclose(grid[-1, -1], m_clean, atol=1e-12)


def test_defaults_chunks_and_no_recompile(seq_model):
  model, variables, clean, corrupt = seq_model
  full = jl.sweep.patching_sweep(model, variables, clean, corrupt, logit_diff)
  assert full.shape == (model.n_layers, SEQ)  # default sites: block_0 .. block_{L-1}
  chunked = jl.sweep.patching_sweep(model, variables, clean, corrupt, logit_diff, batch_size=5)
  np.testing.assert_allclose(chunked, full, atol=1e-12, rtol=0)
  subset = jl.sweep.patching_sweep(model, variables, clean, corrupt, logit_diff, positions=(5, 2))
  np.testing.assert_allclose(subset, full[:, [5, 2]], atol=1e-12, rtol=0)
  # New inputs of the same shape reuse the compiled sweep.
  from jaxlens.sweep import _patching as sweep  # the compiled sweep's cache

  before = sweep._sweep._cache_size()
  other = (corrupt + 3) % VOCAB
  again = jl.sweep.patching_sweep(model, variables, clean, other, logit_diff)
  assert sweep._sweep._cache_size() == before
  assert not np.allclose(again, full)


def test_gate_is_exactly_the_identity_or_the_edit():
  x = jnp.linspace(-1.0, 1.0, 12, dtype=jnp.float64).reshape(1, 3, 4)
  donor = jnp.full_like(x, 7.0)
  on = jl.gate(jnp.asarray(True), jl.patch_from(donor))
  off = jl.gate(jnp.asarray(False), jl.patch_from(donor))
  np.testing.assert_array_equal(on(x), donor)
  np.testing.assert_array_equal(off(x), x)
  both = jax.vmap(lambda f: jl.gate(f, jl.patch_from(donor))(x))(jnp.asarray([True, False]))
  np.testing.assert_array_equal(both[0], donor)
  np.testing.assert_array_equal(both[1], x)
  assert not on.keeps and jl.gate(True, jl.scale(2.0)).keeps


@pytest.mark.parametrize(
  "kwargs, error, code, match",
  [
    (dict(sites=()), jl.InvalidArgumentError, "invalid_argument", "at least one site"),
    (
      dict(positions=(0, SEQ)),
      jl.InvalidArgumentError,
      "index_out_of_range",
      r"positions \[6\] are out of range",
    ),
    (dict(corrupt_shape=(3, SEQ - 1)), jl.ShapeError, "shape_mismatch", "same positions"),
    (dict(clean_1d=True), jl.ShapeError, "shape_mismatch", r"must be \(batch, seq"),
    (
      dict(metric=lambda out: out[:, -1, 0]),
      jl.ShapeError,
      "metric_not_scalar",
      r"metric returned shape \(3,\)",
    ),
    (
      dict(model="no_layers"),
      jl.InvalidArgumentError,
      "invalid_argument",
      "has neither layer_sites",
    ),
  ],
)
def test_errors(gpt, kwargs, error, code, match):
  model, variables, clean, corrupt = gpt
  if kwargs.pop("model", None):
    import flax.linen as nn

    model = nn.Sequential([nn.Dense(2)])
  if "corrupt_shape" in kwargs:
    corrupt = corrupt[:, : kwargs.pop("corrupt_shape")[1]]
  if kwargs.pop("clean_1d", False):
    clean, corrupt = clean[0], corrupt[0]
  metric = kwargs.pop("metric", logit_diff)
  with pytest.raises(error, match=match) as info:
    jl.sweep.patching_sweep(model, variables, clean, corrupt, metric, **kwargs)
  assert info.value.fields["code"] == code
