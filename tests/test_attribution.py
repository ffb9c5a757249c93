"""Gradients at sites (jl.site_grads) and attribution patching against exact patching."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxlens as jl


class Linear(nn.Module):
  """Dense layers and no nonlinearity: a linear metric is linear in every site value."""

  @nn.compact
  def __call__(self, x):
    h = nn.Dense(6, name="layers_0", param_dtype=jnp.float64)(x)
    h = nn.Dense(6, name="layers_1", param_dtype=jnp.float64)(h) + h
    return nn.Dense(3, name="layers_2", param_dtype=jnp.float64)(h)


class Tanh(nn.Module):
  @nn.compact
  def __call__(self, x):
    h = nn.Dense(5, name="layers_0", param_dtype=jnp.float64)(x)
    return nn.Dense(2, name="layers_1", param_dtype=jnp.float64)(jnp.tanh(h))


def metric(out):
  return (out[:, -1, 0] - 0.5 * out[:, -1, 2]).mean()


def normal(seed, shape):
  return jnp.asarray(np.random.default_rng(seed).standard_normal(shape))


@pytest.fixture(scope="module")
def linear():
  model = Linear()
  clean, corrupt = normal(1, (2, 4, 5)), normal(2, (2, 4, 5))
  return model, jax.jit(model.init)(jax.random.key(0), clean), clean, corrupt


def test_site_grads_is_the_gradient_at_the_site_value():
  model = Tanh()
  x = normal(3, (3, 4))
  v = jax.jit(model.init)(jax.random.key(0), x)
  g = jl.site_grads(model, v, x, metric=lambda y: (y**2).sum(), sites=["layers_0"])
  h = jl.trace(model, v, x)["layers_0"].out
  # The rest of the model as a function of the site value, by hand.
  rest = lambda h: (
    nn.Dense(2, param_dtype=jnp.float64).apply({"params": v["params"]["layers_1"]}, jnp.tanh(h))
    ** 2
  ).sum()
  np.testing.assert_allclose(g["layers_0"].grad, jax.grad(rest)(h), rtol=1e-12)
  np.testing.assert_allclose(g["layers_0"].out, h)
  np.testing.assert_allclose(g.value, (model.apply(v, x) ** 2).sum())
  # Jitted: the same numbers, and a pytree out of jit.
  gj = jax.jit(
    lambda v, x: jl.site_grads(model, v, x, metric=lambda y: (y**2).sum(), sites=["layers_0"])
  )(v, x)
  np.testing.assert_allclose(gj.grad["layers_0"], g.grad["layers_0"], rtol=1e-12)


def test_site_grads_takes_op_sites_and_globs(linear):
  model, v, clean, _ = linear
  g = jl.site_grads(model, v, clean, metric=metric, sites=["layers_*", jl.label("add_4")])
  assert set(g.labels) == {"layers_0", "layers_1", "layers_2", "add_4"}
  # layers_2 is the output layer: the metric's gradient with respect to it is fixed.
  want = np.zeros((2, 4, 3))
  want[:, -1, 0], want[:, -1, 2] = 0.5, -0.25
  np.testing.assert_allclose(g["layers_2"].grad, want)


def test_attribution_patching_is_exact_on_a_linear_model(linear):
  model, v, clean, corrupt = linear
  sites = ("layers_0", "layers_1", "layers_2")
  approx = jl.attribution_patching(model, v, clean, corrupt, metric, sites=sites)
  exact = jl.sweep.patching_sweep(model, v, clean, corrupt, metric, sites=sites)
  base = metric(model.apply(v, corrupt))
  assert approx.shape == (3, 4)
  np.testing.assert_allclose(approx, exact - base, atol=1e-12)
  assert np.abs(approx).max() > 1e-3  # not all zeros
  some = jl.attribution_patching(model, v, clean, corrupt, metric, sites=sites, positions=[3, 1])
  np.testing.assert_allclose(some, approx[:, [3, 1]])


def test_attribution_patching_approximates_a_nonlinear_model():
  model = Tanh()
  clean = normal(1, (2, 3, 4))
  corrupt = clean + 1e-3 * normal(2, (2, 3, 4))
  v = jax.jit(model.init)(jax.random.key(0), clean)
  m = lambda out: out[:, -1, 0].mean()
  approx = jl.attribution_patching(model, v, clean, corrupt, m, sites=["layers_0"])
  exact = jl.sweep.patching_sweep(model, v, clean, corrupt, m, sites=["layers_0"]) - m(
    model.apply(v, corrupt)
  )
  np.testing.assert_allclose(approx, exact, rtol=1e-2, atol=1e-9)


def test_site_grads_refuses_what_it_cannot_differentiate(linear):
  model, v, clean, corrupt = linear
  with pytest.raises(jl.SiteError, match="unknown_site"):
    jl.site_grads(model, v, clean, metric=metric, sites=["nope"])
  with pytest.raises(jl.InvalidArgumentError, match="needs the sites"):
    jl.site_grads(model, v, clean, metric=metric, sites=None)
  with pytest.raises(jl.ShapeError, match="metric_not_scalar"):
    jl.site_grads(model, v, clean, metric=lambda y: y, sites=["layers_0"])
  g = jl.site_grads(model, v, clean, metric=metric, sites="layers_0")
  with pytest.raises(jl.SiteError, match="no gradient was taken at 'layers_1'"):
    g["layers_1"]
  with pytest.raises(jl.ShapeError, match="shape_mismatch"):
    jl.attribution_patching(model, v, clean, corrupt[:, :2], metric, sites=["layers_0"])


def test_trace_grad_is_site_grads_under_the_trace_edits(linear):
  model, v, clean, _ = linear
  live = jl.when(jl.module("layers_1"), jl.scale(0.5))
  t = jl.trace(model, v, clean, intervene=live)
  g = t.grad(metric, sites=["layers_0"])
  want = jl.site_grads(model, v, clean, metric=metric, sites=["layers_0"], intervene=live)
  plain = jl.site_grads(model, v, clean, metric=metric, sites=["layers_0"])
  np.testing.assert_allclose(g["layers_0"].grad, want["layers_0"].grad, rtol=1e-12)
  assert not np.allclose(g["layers_0"].grad, plain["layers_0"].grad)  # the edit is live
  lean = jl.trace(model, v, clean, keep_inputs=False)
  with pytest.raises(jl.InvalidArgumentError, match="trace_without_inputs"):
    lean.grad(metric, sites=["layers_0"])


def test_site_inputs_are_the_call_arguments(linear):
  model, v, clean, _ = linear
  t = jl.trace(model, v, clean, save_inputs=True)
  np.testing.assert_array_equal(t["layers_0"].input[0][0], clean)
  np.testing.assert_allclose(t["layers_1"].input[0][0], t["layers_0"].out)
  np.testing.assert_allclose(t["layers_2"].input[0][0], t["layers_1"].out + t["layers_0"].out)
  assert t["layers_2"].input[1] == {}
  # Without save_inputs the program and its op labels are unchanged.
  plain = jl.trace(model, v, clean, save=jl.all_sites())
  marked = jl.trace(model, v, clean, save=jl.all_sites(), save_inputs=True)
  assert plain.labels == marked.labels and jl.trace(model, v, clean)["layers_0"].input is None
  # Under jit, and after a replay that changes what layers_2 receives.
  tj = jax.jit(lambda v, x: jl.trace(model, v, x, save_inputs=True))(v, clean)
  np.testing.assert_allclose(tj["layers_1"].input[0][0], t["layers_1"].input[0][0])
  r = t.fork().do(jl.module("layers_1"), jl.zero_ablate())
  np.testing.assert_allclose(r["layers_2"].input[0][0], t["layers_0"].out)
  np.testing.assert_allclose(r["layers_1"].input[0][0], t["layers_0"].out)
