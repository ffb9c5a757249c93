"""Issue 13: no silent wrong result, no raw internal error (one regression test per item)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxlens as jl

SITE = jl.module("layers_0")


@pytest.fixture(scope="module")
def setup(spec_model):
  model, variables, x, x_donor, _ = spec_model
  return model, variables, x


def _run(setup, site, edit):
  model, variables, x = setup
  return jl.when(site, edit).bind(model)(variables, x)


def test_traced_out_of_range_position_edits_no_other_place(setup):
  model, variables, x = setup
  f = jax.jit(
    lambda p: jl.when(SITE, jl.at_positions(p, jl.zero_ablate(), axis=1)).bind(model)(variables, x)
  )
  assert np.all(np.isnan(f(jnp.array([7]))))  # 7 % 4 == 3 would have edited position 3
  np.testing.assert_array_equal(
    f(jnp.array([3])), _run(setup, SITE, jl.at_positions(np.array([3]), jl.zero_ablate(), axis=1))
  )


def test_traced_out_of_range_unit_index_is_visible(setup):
  model, variables, x = setup
  f = jax.jit(lambda i: jl.when(jl.units(SITE, i), jl.zero_ablate()).bind(model)(variables, x))
  assert np.all(np.isnan(f(jnp.array([9]))))
  np.testing.assert_array_equal(
    f(jnp.array([1])), _run(setup, jl.units(SITE, np.array([1])), jl.zero_ablate())
  )


def test_traced_rank_deficient_basis_is_visible(setup):
  model, variables, x = setup
  basis = jnp.asarray([[1.0, 2.0], [0.0, 0.0], [0.0, 0.0], [0.0, 0.0]])
  f = jax.jit(lambda b: jl.when(jl.subspace(SITE, b), jl.zero_ablate()).bind(model)(variables, x))
  assert np.all(np.isnan(f(basis)))
  with pytest.raises(jl.InvalidArgumentError, match="basis_rank_deficient"):
    _run(setup, jl.subspace(SITE, basis), jl.zero_ablate())


def test_zero_direction_is_refused(setup):
  for verb in (jl.project_out, jl.project_onto):
    with pytest.raises(jl.InvalidArgumentError, match=r"\[direction_zero\]"):
      _run(setup, SITE, verb(jnp.zeros(4)))


def test_nan_outside_the_subspace_does_not_spread(setup):
  model, variables, x = setup
  basis = jnp.asarray([[1.0], [0.0], [0.0], [0.0]])
  donor = jnp.full((3, 4), jnp.nan).at[:, 0].set(2.0)
  out = jl.trace(
    model,
    variables,
    x,
    intervene=jl.when(jl.subspace(SITE, basis), jl.patch_from(donor)),
    save=SITE,
  )
  site = out["layers_0"].out
  assert not np.any(np.isnan(site))
  np.testing.assert_array_equal(site[:, 0], np.full(3, 2.0))
  clean = jl.trace(model, variables, x, save=SITE)["layers_0"].out
  np.testing.assert_array_equal(site[:, 1:], clean[:, 1:])


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16])
def test_subspace_edit_on_a_half_precision_site(dtype):
  x = jnp.linspace(-1.0, 1.0, 12).reshape(3, 4).astype(dtype)
  basis = jnp.eye(4)[:, :2]
  out = jl.subspace_zero(basis)(x)
  assert out.dtype == dtype
  np.testing.assert_array_equal(
    np.asarray(out[:, 2:], np.float32), np.asarray(x[:, 2:], np.float32)
  )
  np.testing.assert_array_equal(np.asarray(out[:, :2], np.float32), np.zeros((3, 2)))


def test_replay_frontier_of_the_wrong_shape_is_refused(setup):
  model, variables, x = setup
  r = (
    jl.trace(model, variables, x)
    .fork()
    .do(SITE, jl.scale(2.0), intervention=jl.InterventionOptions(differentiable=True))
  )
  bad = {k: jnp.zeros((1,) + v.shape) for k, v in r.frontier.items()}
  with pytest.raises(jl.ShapeError, match=r"\[shape_mismatch\]"):
    r.replay(bad)
  with pytest.raises(jl.InvalidArgumentError, match=r"\[unknown_site\]"):
    r.replay({"nope": jnp.zeros(3)})


@pytest.mark.parametrize(
  "make, code",
  [
    (lambda: jl.scale(jnp.ones(7)), "shape_mismatch"),
    (lambda: jl.steer(jnp.ones(4), jnp.ones(3)), "shape_mismatch"),
    (lambda: jl.mean_ablate(dim=5), "invalid_argument"),
    (lambda: jl.permute_batch(seed=0, axis=5), "invalid_argument"),
    (lambda: jl.add_noise(0.1, seed=-1), "invalid_seed"),
    (lambda: jl.steer(jnp.ones(4, jnp.complex128) * 1j), "dtype_mismatch"),
  ],
  ids=["scale", "steer", "mean_ablate", "permute_batch", "seed", "complex"],
)
def test_bad_arguments_are_typed_errors(setup, make, code):
  with pytest.raises(jl.InvalidArgumentError) as info:
    _run(setup, SITE, make())
  assert info.value.code == code


def test_add_noise_on_an_integer_site_is_a_typed_error():
  with pytest.raises(jl.InvalidArgumentError, match=r"\[site_not_float\]"):
    jl.add_noise(0.1, seed=0)(jnp.arange(4))


def test_save_of_an_empty_list_and_an_unknown_method(setup):
  model, variables, x = setup
  with pytest.raises(jl.InvalidArgumentError, match=r"\[invalid_argument\]"):
    jl.trace(model, variables, x, save=[])
  with pytest.raises(jl.InvalidArgumentError, match=r"\[invalid_argument\]"):
    jl.trace(model, variables, x, method="nope")


def test_a_printed_label_works_as_a_module_path():
  assert jl.module("a/b:2") == jl.module("a/b", call=2)
  assert jl.module("layers_[01]").path == "layers_[01]"  # a glob, not a layer
  assert jl.module("layer#0") == jl.module("layer", output=0)


def test_repr_of_a_trace_whose_model_returns_a_pytree():
  import flax.linen as nn

  class Two(nn.Module):
    @nn.compact
    def __call__(self, x):
      h = nn.Dense(2, param_dtype=jnp.float64)(x)
      return {"a": h, "b": (h, h)}

  x = jnp.ones((1, 3))
  model = Two()
  t = jl.trace(model, model.init(jax.random.key(0), x), x)
  assert "'a': (1, 2)" in repr(t)
