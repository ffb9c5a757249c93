"""Backward verbs: the forward value is untouched and the gradient is transformed.

Each verb is checked on the specification's float64 model with the edit at
``layers_0``, against the gradient computed by hand from the cotangent at that
site; then under jit, vmap and grad in both orders, for no recompilation when its
values change, for what ``jl.depends_on`` and ``keep_grad`` report, and for every
typed error it raises.
"""

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxlens as jl
from jaxlens.intervention import keep_grad

SITE = jl.module("layers_0")
# A weight per output element, so that the cotangent at the site varies by row.
W_OUT = jnp.asarray([[1.0, -2.0], [0.5, 3.0], [-1.5, 0.25]], jnp.float64)


def _halve_negatives(g):
  return jnp.where(g < 0, 0.5 * g, g)


# name -> (edit, the cotangent transform it should apply, written by hand).
CASES = {
  "grad_scale": (jl.grad_scale(2.5), lambda g: 2.5 * g),
  "grad_scale(-1)": (jl.grad_scale(-1.0), lambda g: -g),
  "grad_zero": (jl.grad_zero(), jnp.zeros_like),
  "grad_clip(limit)": (jl.grad_clip(0.6), lambda g: jnp.clip(g, -0.6, 0.6)),
  "grad_clip(min,max)": (jl.grad_clip(min=-0.2, max=0.9), lambda g: jnp.clip(g, -0.2, 0.9)),
  "grad_clip(max)": (jl.grad_clip(max=0.1), lambda g: jnp.minimum(g, 0.1)),
  "backward_hook": (jl.backward_hook(_halve_negatives), _halve_negatives),
}


def _loss(model, spec, x):
  return lambda v: (spec.bind(model)(v, x) * W_OUT).sum()


def _hand_grads(model, variables, x, transform):
  """The gradient of the loss, with the cotangent at layers_0 transformed by hand."""
  k0, k1 = variables["params"]["layers_0"]["kernel"], variables["params"]["layers_1"]["kernel"]
  b0 = variables["params"]["layers_0"]["bias"]
  h = x @ k0 + b0
  g_h = transform(W_OUT @ k1.T)  # the cotangent at the site, then the verb's transform
  return {
    "layers_0": {"kernel": x.T @ g_h, "bias": g_h.sum(0)},
    "layers_1": {"kernel": h.T @ W_OUT, "bias": W_OUT.sum(0)},
  }


@pytest.mark.parametrize("name", list(CASES))
def test_forward_value_is_unchanged(spec_model, name):
  model, variables, x, _, _ = spec_model
  edit, _ = CASES[name]
  out = jl.when(SITE, edit).bind(model)(variables, x)
  assert np.array_equal(out, model.apply(variables, x))
  t = jl.trace(model, variables, x, intervene=jl.when(SITE, edit))
  assert np.array_equal(
    t["layers_0"].out, model.apply(variables, x, method=lambda m, y: m.layers[0](y))
  )


@pytest.mark.parametrize("name", list(CASES))
def test_gradient_equals_the_hand_transformed_cotangent(spec_model, name):
  model, variables, x, _, _ = spec_model
  edit, transform = CASES[name]
  grads = jax.grad(_loss(model, jl.when(SITE, edit), x))(variables)["params"]
  want = _hand_grads(model, variables, x, transform)
  chex.assert_trees_all_close(grads, want, atol=1e-12, rtol=0)
  # The clip cases must actually clip: the hand transform changes the plain gradient.
  plain = _hand_grads(model, variables, x, lambda g: g)
  assert not np.allclose(want["layers_0"]["kernel"], plain["layers_0"]["kernel"])


@pytest.mark.parametrize("name", ["grad_scale", "grad_clip(limit)", "backward_hook"])
def test_jit_and_grad_in_either_order_agree(spec_model, name):
  model, variables, x, _, _ = spec_model
  loss = _loss(model, jl.when(SITE, CASES[name][0]), x)
  eager = jax.grad(loss)(variables)
  chex.assert_trees_all_close(jax.jit(jax.grad(loss))(variables), eager, atol=1e-12, rtol=0)
  chex.assert_trees_all_close(jax.grad(jax.jit(loss))(variables), eager, atol=1e-12, rtol=0)
  # The trace door gives the same gradient as the bind door.
  traced = jax.grad(
    lambda v: (jl.trace(model, v, x, intervene=jl.when(SITE, CASES[name][0])).output * W_OUT).sum()
  )(variables)
  chex.assert_trees_all_close(traced, eager, atol=1e-12, rtol=0)


def test_replay_applies_the_backward_rule(spec_model):
  """fork().do(site, verb) on a trace captured inside the differentiated function."""
  model, variables, x, _, _ = spec_model

  def replayed(v):
    t = jl.trace(model, v, x)
    return (t.fork().do(SITE, jl.grad_clip(0.6)).output * W_OUT).sum()

  want = _hand_grads(model, variables, x, lambda g: jnp.clip(g, -0.6, 0.6))
  chex.assert_trees_all_close(jax.grad(replayed)(variables)["params"], want, atol=1e-12, rtol=0)


@pytest.mark.parametrize("name", ["grad_scale", "grad_clip(min,max)", "backward_hook"])
def test_vmap_of_per_example_gradients_equals_a_loop(spec_model, name):
  model, variables, x, _, _ = spec_model
  edit, transform = CASES[name]
  f = jl.when(SITE, edit).bind(model)

  def per_example(v, xi, wi):
    return (f(v, xi[None]) * wi).sum()

  # jitted: one program for the batch and one for every example (not eager ops)
  batched = jax.jit(jax.vmap(jax.grad(per_example), in_axes=(None, 0, 0)))(variables, x, W_OUT)
  grad_one = jax.jit(jax.grad(per_example))
  for i in range(x.shape[0]):
    one = grad_one(variables, x[i], W_OUT[i])
    chex.assert_trees_all_close(jax.tree.map(lambda a, i=i: a[i], batched), one, atol=1e-12, rtol=0)
    # ... and each per-example gradient is the hand-transformed one.
    k1 = variables["params"]["layers_1"]["kernel"]
    g_h = transform(W_OUT[i][None] @ k1.T)
    np.testing.assert_allclose(
      one["params"]["layers_0"]["kernel"], x[i][:, None] @ g_h, atol=1e-12, rtol=0
    )


def test_new_values_do_not_recompile(spec_model):
  model, variables, x, _, _ = spec_model

  @jax.jit
  @chex.assert_max_traces(n=1)
  def scaled(v, edit):
    return jax.grad(lambda v_: (jl.when(SITE, edit).bind(model)(v_, x) * W_OUT).sum())(v)

  @jax.jit
  @chex.assert_max_traces(n=1)
  def clipped(v, edit):
    return jax.grad(lambda v_: (jl.when(SITE, edit).bind(model)(v_, x) * W_OUT).sum())(v)

  kernels = []
  for factor in (2.0, -1.0, 0.25):
    g = scaled(variables, jl.grad_scale(jnp.asarray(factor, jnp.float64)))
    kernels.append(g["params"]["layers_0"]["kernel"])
  np.testing.assert_allclose(kernels[1], -0.5 * kernels[0], atol=1e-12)
  np.testing.assert_allclose(kernels[2], 0.125 * kernels[0], atol=1e-12)
  a = clipped(variables, jl.grad_clip(jnp.asarray(0.1, jnp.float64)))
  b = clipped(variables, jl.grad_clip(jnp.asarray(10.0, jnp.float64)))
  assert not np.allclose(a["params"]["layers_0"]["kernel"], b["params"]["layers_0"]["kernel"])


def test_the_factor_receives_a_zero_gradient(spec_model):
  model, variables, x, _, _ = spec_model

  def loss(factor):
    return (jl.when(SITE, jl.grad_scale(factor)).bind(model)(variables, x) * W_OUT).sum()

  assert float(jax.grad(loss)(jnp.asarray(3.0, jnp.float64))) == 0.0


@pytest.mark.parametrize("name", list(CASES))
def test_depends_on_and_keep_grad_read_them_as_keeping(spec_model, name):
  model, variables, x, _, _ = spec_model
  edit, transform = CASES[name]
  assert edit.keeps
  deps = jl.depends_on(jl.when(SITE, edit).bind(model), variables, x)
  assert deps["params"]["layers_0"]["kernel"]  # structural, even for grad_zero
  # keep_grad accepts every backward verb; the gradient is still the transformed one.
  grads = jax.grad(_loss(model, jl.when(SITE, keep_grad(edit)), x))(variables)["params"]
  want = _hand_grads(model, variables, x, transform)
  chex.assert_trees_all_close(grads, want, atol=1e-12, rtol=0)


def test_grad_zero_differs_from_a_cut(spec_model):
  """grad_zero keeps the structural dependence that stop_gradient removes."""
  model, variables, x, _, _ = spec_model
  zero = jl.depends_on(jl.when(SITE, jl.grad_zero()).bind(model), variables, x)
  cut = jl.depends_on(jl.when(SITE, jl.zero_ablate()).bind(model), variables, x)
  assert zero["params"]["layers_0"]["kernel"] and not cut["params"]["layers_0"]["kernel"]
  with pytest.raises(jl.GradientContractError, match="edit_detached_from_graph"):
    jl.when(SITE, keep_grad(jl.zero_ablate())).bind(model)(variables, x)


def test_at_positions_zeroes_the_gradient_only_there():
  # inputs and the expected gradient from numpy, the edit's forward and backward in one
  # jitted program (not eager ops)
  x = np.arange(24.0).reshape(2, 3, 4)
  w = np.linspace(-1.0, 1.0, 24).reshape(2, 3, 4)
  edit = jl.at_positions(np.asarray([1]), jl.grad_zero())
  out, g = jax.jit(lambda x_: (edit(x_), jax.grad(lambda y: (edit(y) * w).sum())(x_)))(x)
  want = w.copy()
  want[:, 1] = 0.0
  np.testing.assert_array_equal(g, want)
  np.testing.assert_array_equal(out, x)


def test_backward_hook_sees_the_site_and_the_cotangent(spec_model):
  model, variables, x, _, _ = spec_model
  seen = {}

  def record(g, *, hook):
    seen["label"], seen["shape"] = hook.label, g.shape
    return 2.0 * g

  grads = jax.grad(_loss(model, jl.when(SITE, jl.backward_hook(record)), x))(variables)
  assert seen == {"label": "layers_0", "shape": (3, 4)}
  want = _hand_grads(model, variables, x, lambda g: 2.0 * g)
  chex.assert_trees_all_close(grads["params"], want, atol=1e-12, rtol=0)


def test_gradient_reversal_trains_upstream_away(spec_model):
  """A negative grad_scale turns a descent step upstream of the site into an ascent step."""
  model, variables, x, _, _ = spec_model
  plain = jax.grad(_loss(model, jl.when(SITE, jl.scale(1.0)), x))(variables)
  reversed_ = jax.grad(_loss(model, jl.when(SITE, jl.grad_scale(-1.0)), x))(variables)
  chex.assert_trees_all_close(
    reversed_["params"]["layers_0"],
    jax.tree.map(jnp.negative, plain["params"]["layers_0"]),
    atol=1e-12,
  )
  chex.assert_trees_all_close(
    reversed_["params"]["layers_1"], plain["params"]["layers_1"], atol=1e-12
  )


def test_forward_mode_is_refused_by_jax():
  """A documented limit: JAX has no jvp through a custom_vjp."""
  with pytest.raises(TypeError, match="forward-mode"):
    jax.jvp(jl.grad_scale(2.0), (jnp.ones(3),), (jnp.ones(3),))


# --------------------------------------------------------------------------
# Typed errors.


@pytest.mark.parametrize(
  "build, match",
  [
    (lambda: jl.grad_clip(), "needs a limit"),
    (lambda: jl.grad_clip(1.0, min=-1.0), "not both"),
    (lambda: jl.grad_clip(-1.0), "non-negative"),
    (lambda: jl.grad_clip(min=1.0, max=0.5), "above max"),
    (lambda: jl.backward_hook(3), "function of the cotangent"),
    (lambda: jl.backward_hook(jl.scale(2.0)), "function of the cotangent"),
  ],
)
def test_factory_errors(build, match):
  with pytest.raises(jl.InvalidArgumentError, match=match) as info:
    build()
  assert info.value.fields["code"] == "invalid_argument"


@pytest.mark.parametrize(
  "fn, code, match",
  [
    (lambda g: g[:1], "backward_hook_shape_mismatch", r"shape \(1, 4\) for a site"),
    (lambda g: g.astype(jnp.float32), "backward_hook_dtype_mismatch", "dtype float32"),
    (lambda g: 1.0, "backward_hook_shape_mismatch", "returned a float, not an array"),
  ],
)
def test_backward_hook_result_is_checked(spec_model, fn, code, match):
  model, variables, x, _, _ = spec_model
  loss = _loss(model, jl.when(SITE, jl.backward_hook(fn)), x)
  loss(variables)  # a forward-only call does not run the hook
  with pytest.raises(jl.ShapeError, match=match) as info:
    jax.grad(loss)(variables)
  assert info.value.fields["code"] == code
  assert info.value.fields["site"] == "layers_0"


@pytest.mark.parametrize(
  "edit, code, match",
  [
    (jl.grad_scale(jnp.ones(5)), "shape_mismatch", r"factor of shape \(5,\) does not broadcast"),
    (jl.grad_scale(jnp.asarray([True])), "dtype_mismatch", "factor must be a number"),
    (jl.grad_clip(jnp.ones((2, 2))), "shape_mismatch", "limit of shape"),
  ],
)
def test_argument_errors_at_fire_time(spec_model, edit, code, match):
  model, variables, x, _, _ = spec_model
  with pytest.raises(jl.ShapeError, match=match) as info:
    jl.when(SITE, edit).bind(model)(variables, x)
  assert info.value.fields["code"] == code


class _IntSite(nn.Module):
  @nn.compact
  def __call__(self, x):
    idx = _ArgMax(name="argmax")(x)
    return nn.Dense(2, name="head", param_dtype=jnp.float64)(x + idx[:, None].astype(x.dtype))


class _ArgMax(nn.Module):
  def __call__(self, x):
    return jnp.argmax(x, axis=-1)


@pytest.mark.parametrize(
  "edit", [jl.grad_scale(2.0), jl.grad_zero(), jl.grad_clip(1.0), jl.backward_hook(lambda g: g)]
)
def test_an_integer_site_is_refused(edit):
  model = _IntSite()
  x = jnp.ones((2, 3), jnp.float64)
  variables = model.init(jax.random.key(0), x)
  with pytest.raises(jl.InvalidArgumentError, match="no gradient to transform") as info:
    jl.when(jl.module("argmax"), edit).bind(model)(variables, x)
  assert info.value.fields["code"] == "site_not_float"
