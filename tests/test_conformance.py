"""One conformance battery every verb passes, driven by a table.

jit equals eager, vmap equals a loop, the site's dtype and shape are kept in
float32 and float64, and a second jitted call with new edit values does not
retrace.
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxlens as jl
from jaxlens import intervention as ji
from jaxlens import contract as matrix

SITE = jl.module("layers_0")


def _square(x):
  return x * x


# name -> build(case, v): two value variants (v = 0, 1) of one edit structure.
BATTERY = {
  "scale": lambda c, v: jl.scale(0.5 + v),
  "clamp": lambda c, v: jl.clamp(min=-0.3 - v, max=0.4 + v),
  "add_noise": lambda c, v: jl.add_noise(0.1 + v, seed=v),
  "steer": lambda c, v: jl.steer(c.direction * (1 + v), 2.0 + v),
  "add": lambda c, v: jl.add(c.delta + v),
  "project_onto": lambda c, v: jl.project_onto(c.direction + v),
  "project_out": lambda c, v: jl.project_out(c.direction + v),
  "mean_ablate(dim=)": lambda c, v: jl.mean_ablate(dim=0),
  "scramble_elements(seed=)": lambda c, v: ji.scramble_elements(seed=v),
  "splice_module": lambda c, v: jl.splice_module(jnp.tanh),
  "permute_batch": lambda c, v: ji.permute_batch(seed=v),
  "set_direction_mean": lambda c, v: ji.set_direction_mean(c.direction, c.population),
  "compose": lambda c, v: ji.compose(jl.scale(0.0), jl.add(c.delta * (1 + v))),
  "hook callable": lambda c, v: _square,
  "zero_ablate": lambda c, v: jl.zero_ablate(),
  "replace_with": lambda c, v: jl.replace_with(c.donor + v),
  "swap_with": lambda c, v: jl.swap_with(c.donor * (1 + v)),
  "patch_from": lambda c, v: jl.patch_from(c.donor_trace),
  "resample_rows_from": lambda c, v: ji.resample_rows_from(c.population, seed=v),
  "mean_ablate(source=)": lambda c, v: jl.mean_ablate(source=c.population),
  "scramble_elements(source=)": lambda c, v: ji.scramble_elements(seed=v, source=c.donor),
  "set_affine_coordinates": lambda c, v: jl.subspace(SITE, c.basis).wrap(
    ji.set_affine_coordinates(c.W * (1 + v), c.b)
  ),
  "subspace_* (subspace_patch)": lambda c, v: ji.subspace_patch(c.basis * (1 + v), c.donor_trace),
  # Not matrix rows, but verbs all the same.
  "at_positions": lambda c, v: jl.at_positions(jnp.asarray([v, 2]), jl.scale(3.0)),
  "units": lambda c, v: jl.units(SITE, jnp.asarray([v, 3])).wrap(jl.zero_ablate()),
  "subspace": lambda c, v: jl.subspace(SITE, c.basis, origin=c.donor.mean(0) * (1 + v)).wrap(
    jl.patch_from(c.donor_trace)
  ),
}


def test_battery_covers_every_matrix_row():
  assert set(BATTERY) >= {r.name for r in matrix.ROWS}


def _setup(spec_model, dtype):
  model, variables, x, x_donor, _ = spec_model
  cast = lambda t: jax.tree.map(lambda a: a.astype(dtype), t)
  variables, x, x_donor = cast(variables), cast(x), cast(x_donor)
  case = matrix.make_case(model, variables, x, x_donor)
  case.direction = case.direction.astype(dtype)
  case.delta = case.delta.astype(dtype)
  case.basis, case.W, case.b = (a.astype(dtype) for a in (case.basis, case.W, case.b))
  return model, variables, x, x_donor, case


def _run(model, variables, x, edit):
  return jl.when(SITE, edit).bind(model)(variables, x)


@pytest.mark.parametrize("name", list(BATTERY))
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float64])
def test_jit_vmap_dtype_shape(spec_model, name, dtype):
  model, variables, x, x_donor, case = _setup(spec_model, dtype)
  edit = (
    jl.intervention.hook(BATTERY[name](case, 0))
    if name == "hook callable"
    else BATTERY[name](case, 0)
  )
  eager = _run(model, variables, x, edit)
  jitted = jax.jit(lambda v, xi, e: _run(model, v, xi, e))(variables, x, edit)
  tol = 1e-12 if dtype == jnp.float64 else 1e-6
  np.testing.assert_allclose(eager, jitted, atol=tol, rtol=0)

  xs = jnp.stack([x, x[::-1] * 2.0])
  batched = jax.vmap(lambda xi: _run(model, variables, xi, edit))(xs)
  looped = jnp.stack([_run(model, variables, xi, edit) for xi in xs])
  np.testing.assert_allclose(batched, looped, atol=tol, rtol=0)

  clean = jl.trace(model, variables, x, save=SITE)
  edited = jl.trace(model, variables, x, intervene=jl.when(SITE, edit), save=SITE)
  assert edited["layers_0"].out.shape == clean["layers_0"].out.shape
  assert edited["layers_0"].out.dtype == clean["layers_0"].out.dtype == dtype
  assert eager.dtype == dtype


@pytest.mark.parametrize("name", list(BATTERY))
def test_new_edit_values_do_not_recompile(spec_model, name):
  model, variables, x, x_donor, case = _setup(spec_model, jnp.float64)
  chex.clear_trace_counter()

  @jax.jit
  @chex.assert_max_traces(n=1)
  def f(variables, x, spec):
    return spec.bind(model)(variables, x)

  outs = [f(variables, x, jl.when(SITE, BATTERY[name](case, v))) for v in (0, 1)]
  for v, out in zip((0, 1), outs):
    np.testing.assert_allclose(
      out, _run(model, variables, x, BATTERY[name](case, v)), atol=1e-12, rtol=0
    )


@pytest.mark.parametrize(
  "name",
  [
    "add_noise",
    "scramble_elements(seed=)",
    "permute_batch",
    "resample_rows_from",
    "scramble_elements(source=)",
  ],
)
def test_seeded_draws_are_the_same_with_and_without_jit(spec_model, name):
  model, variables, x, x_donor, case = _setup(spec_model, jnp.float64)
  # The draw itself, bit for bit: noise on zeros, permutations of distinct values.
  base = jnp.zeros((3, 4)) if name == "add_noise" else jnp.arange(12.0).reshape(3, 4)
  edit = jl.add_noise(1.0, seed=1) if name == "add_noise" else BATTERY[name](case, 1)
  eager = edit(base)
  jitted = jax.jit(lambda e, b: e(b))(edit, base)
  assert np.array_equal(eager, jitted)
  other = (jl.add_noise(1.0, seed=0) if name == "add_noise" else BATTERY[name](case, 0))(base)
  assert not np.array_equal(eager, other)
  # And through a door, jit against eager.
  site_value = lambda e: (
    jl.trace(model, variables, x, intervene=jl.when(SITE, e), save=SITE)["layers_0"].out
  )
  np.testing.assert_allclose(site_value(edit), jax.jit(site_value)(edit), atol=1e-15, rtol=0)
