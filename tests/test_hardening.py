"""Issue 13: no silent wrong result, no raw internal error (one regression test per item)."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _jaxprs import equations

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


def test_an_unbound_module_called_without_variables_names_the_fix(setup, tmp_path):
  model, variables, x = setup
  spec = jl.when(SITE, jl.scale(2.0))
  loaded = jl.load_spec(spec.save(tmp_path / "s"))
  calls = {
    "trace": lambda: jl.trace(model, x),
    "bind": lambda: spec.bind(model)(x),
    "loaded bind": lambda: loaded.bind(model)(x),
    "check_spec": lambda: jl.check_spec(spec, model, x),
  }
  for name, call in calls.items():
    with pytest.raises(jl.InvalidArgumentError) as info:
      call()
    assert info.value.code == "missing_variables", name
    assert "variables" in info.value.fields["fix"], name
  # The spellings the fix names work.
  np.testing.assert_array_equal(spec.bind(model)(variables, x), spec.bind(model.bind(variables))(x))
  assert jl.trace(model.bind(variables), x).output.shape == (3, 2)


def test_replay_of_a_trace_returned_from_vmap_is_a_typed_error_and_the_fix_works(setup):
  model, variables, x = setup
  xs = jnp.stack([x, 2 * x, -x])
  t = jax.vmap(lambda xi: jl.trace(model, variables, xi))(xs)
  edit = jl.scale(2.0)
  attempts = {
    "replay": lambda: t.fork().do(SITE, edit),
    "differentiable": lambda: t.fork().do(
      SITE, edit, intervention=jl.InterventionOptions(differentiable=True)
    ),
    "set_only": lambda: (
      t.fork().do(SITE, edit, intervention=jl.InterventionOptions(engine="set_only")).run()
    ),
    "rerun": lambda: t.fork().do(SITE, edit, model=model),
  }
  for name, attempt in attempts.items():
    with pytest.raises(jl.InvalidArgumentError) as info:
      attempt()
    assert info.value.code == "batched_trace", name
  fixed = jax.vmap(lambda one: one.fork().do(SITE, edit).output)(t)
  want = jnp.stack([_bind(model, variables, xi, edit) for xi in xs])
  np.testing.assert_allclose(fixed, want, rtol=1e-12, atol=1e-12)


def _bind(model, variables, x, edit):
  return jl.when(SITE, edit).bind(model)(variables, x)


def _primitives(jaxpr):
  return [eqn.primitive.name for eqn in equations(jaxpr)]


def _replay_scale(t, opts):
  return t.fork().do(SITE, jl.scale(2.0), intervention=opts).output


def test_replay_at_a_leaf_module_reads_its_saved_value(setup):
  """The replay is the downstream cone: layers_0's own matmul and kernel are not in it."""
  model, variables, x = setup
  t = jl.trace(model, variables, x)
  for opts in (None, jl.InterventionOptions(differentiable=True)):
    replay = functools.partial(_replay_scale, opts=opts)
    prims = _primitives(jax.make_jaxpr(replay)(t).jaxpr)
    assert prims.count("dot_general") == 1, prims  # layers_1's only
    np.testing.assert_allclose(replay(t), _run(setup, SITE, jl.scale(2.0)), rtol=1e-12)
  # Nothing of the replay depends on layers_0's parameters or on the input.
  dep = jl.depends_on(lambda args: replay(dataclasses.replace(t, _args=args)).sum(), t._args)
  kernel0 = [
    i for i, leaf in enumerate(t._args) if leaf is variables["params"]["layers_0"]["kernel"]
  ]
  assert kernel0 and not any(dep[i] for i in kernel0)
  assert not dep[-1]  # x
  # Differentiable replay: the site's own value is the frontier, and gradients through it.
  r = t.fork().do(SITE, jl.scale(2.0), intervention=jl.InterventionOptions(differentiable=True))
  assert set(r.frontier) == {"layers_0"}
  np.testing.assert_allclose(r.replay(r.frontier), r.output, rtol=1e-12)
  g = jax.grad(lambda f: r.replay(f).sum())(r.frontier)["layers_0"]
  kernel1 = variables["params"]["layers_1"]["kernel"]
  np.testing.assert_allclose(g, np.broadcast_to(2.0 * kernel1.sum(1), g.shape), rtol=1e-12)


def test_replay_after_an_edit_at_the_same_site_recomputes_it(setup):
  """A saved value an earlier rule edited is not the site's own: the edits stack."""
  model, variables, x = setup
  t = jl.trace(model, variables, x, intervene=jl.when(SITE, jl.scale(3.0)))
  np.testing.assert_allclose(
    t.fork().do(SITE, jl.scale(2.0)).output, _run(setup, SITE, jl.scale(6.0)), rtol=1e-12
  )
  twice = jl.trace(model, variables, x).do(SITE, jl.scale(2.0)).do(SITE, jl.add(1.0))
  want = jl.when(SITE, jl.compose(jl.scale(2.0), jl.add(1.0))).bind(model)(variables, x)
  np.testing.assert_allclose(twice.output, want, rtol=1e-12)
