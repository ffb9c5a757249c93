"""Training through edits: optax loops whose loss falls with an edit live in the model.

(a) the parameters upstream of a keeping edit train through it; (b) a steering
vector trains with the model frozen; (c) a model trains with an ablation in the
loop, and the ablated branch gets an exactly-zero gradient. ``keep_grad`` refuses
a cutting edit in such a loop, and a jitted step that takes the spec as an
argument does not recompile when the edit's values change.
"""

import functools

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxlens as jl
from jaxlens.intervention import keep_grad

F64 = jnp.float64


class Hidden(nn.Module):
  @nn.compact
  def __call__(self, h):
    return jnp.tanh(nn.Dense(16, param_dtype=F64, name="fc")(h))


class Net(nn.Module):
  """in -> hidden -> (+ branch) -> out; every stage its own site."""

  @nn.compact
  def __call__(self, x):
    h = jnp.tanh(nn.Dense(16, param_dtype=F64, name="in")(x))
    h = Hidden(name="hidden")(h)
    h = h + Hidden(name="branch")(h)
    return nn.Dense(1, param_dtype=F64, name="out")(h)


def _data(n=64):
  x = jax.random.normal(jax.random.key(1), (n, 4), F64)
  y = jnp.sin(x @ jnp.asarray([1.0, -2.0, 0.5, 1.5], F64))[:, None]
  return x, y


@functools.cache
def _init():
  """One model, its variables (initialised by one jitted program) and data for every test."""
  model = Net()
  x, y = _data()
  return model, jax.jit(model.init)(jax.random.key(0), x), x, y


def _train(loss, params, steps, lr=1e-2):
  """Runs ``steps`` of adam on ``loss(params)``; returns (params, first loss, last loss)."""
  opt = optax.adam(lr)

  @jax.jit
  def step(p, state):
    value, grads = jax.value_and_grad(loss)(p)
    # optax.adam's bias correction raises a float to its int32 step count, which strict
    # dtype promotion (tests/conftest.py) refuses: only the optimiser runs under standard.
    with jax.numpy_dtype_promotion("standard"):
      updates, state = opt.update(grads, state, p)
    return optax.apply_updates(p, updates), state, value

  state = opt.init(params)
  losses = []
  for _ in range(steps + 1):  # the last step's value is the loss of the trained parameters
    trained = params
    params, state, value = step(params, state)
    losses.append(float(value))
  return trained, losses[0], losses[-1]


def _mse(out, y):
  return jnp.mean((out - y) ** 2)


DIRECTION = jnp.linspace(-1.0, 1.0, 16, dtype=F64)


@pytest.mark.parametrize(
  "edit",
  [jl.steer(DIRECTION, 0.5), keep_grad(jl.steer(DIRECTION, 0.5))],
  ids=["steer", "keep_grad(steer)"],
)
def test_a_parameters_upstream_of_a_keeping_edit_train(edit):
  model, variables, x, y = _init()
  f = jl.when(jl.module("hidden"), edit).bind(model)
  loss = lambda v: _mse(f(v, x), y)
  # Every parameter, including the ones upstream of the edit, gets a gradient.
  deps = jl.depends_on(loss, variables)
  assert all(jax.tree.leaves(deps))
  g_in = jax.jit(jax.grad(loss))(variables)["params"]["in"]["kernel"]
  assert float(jnp.abs(g_in).max()) > 0.0
  trained, first, last = _train(loss, variables, 150)
  assert last < 0.3 * first
  moved = trained["params"]["in"]["kernel"] - variables["params"]["in"]["kernel"]
  assert float(jnp.abs(moved).max()) > 1e-2


@pytest.mark.parametrize("verb", ["steer", "add"])
def test_b_a_steering_vector_trains_with_the_model_frozen(verb):
  model, variables, x, _ = _init()
  # The target is the model's own output shifted by 2: reachable by steering alone.
  target = jax.jit(model.apply)(variables, x) + 2.0
  site = jl.module("branch")

  def loss(vec):
    edit = jl.steer(vec, 1.0) if verb == "steer" else jl.add(vec)
    return _mse(jl.when(site, edit).bind(model)(variables, x), target)

  vec0 = jnp.zeros((16,), F64)
  vec, first, last = _train(loss, vec0, 200, lr=5e-2)
  assert last < 1e-3 * first
  # After the branch, out is linear in what is added: out_kernel . vec must be 2.
  w = variables["params"]["out"]["kernel"][:, 0]
  np.testing.assert_allclose(float(w @ vec), 2.0, atol=1e-2)


def test_c_a_model_trains_with_an_ablation_in_the_loop():
  model, variables, x, y = _init()
  f = jl.when(jl.module("branch"), jl.zero_ablate()).bind(model)
  loss = lambda v: _mse(f(v, x), y)
  deps = jl.depends_on(loss, variables)["params"]
  assert not any(jax.tree.leaves(deps["branch"]))  # cut: structurally no dependence
  assert all(jax.tree.leaves(deps["in"])) and all(jax.tree.leaves(deps["hidden"]))
  grads = jax.jit(jax.grad(loss))(variables)["params"]
  assert all(float(jnp.abs(g).max()) == 0.0 for g in jax.tree.leaves(grads["branch"]))
  trained, first, last = _train(loss, variables, 150)
  assert last < 0.3 * first
  # Adam with an all-zero gradient leaves the ablated branch exactly where it was.
  chex.assert_trees_all_equal(trained["params"]["branch"], variables["params"]["branch"])


def test_keep_grad_refuses_a_cutting_edit_in_the_train_step():
  model, variables, x, y = _init()
  f = jl.when(jl.module("hidden"), keep_grad(jl.zero_ablate())).bind(model)
  opt = optax.adam(1e-2)

  @jax.jit
  def step(p, state):
    grads = jax.grad(lambda v: _mse(f(v, x), y))(p)
    # optax.adam's bias correction raises a float to its int32 step count, which strict
    # dtype promotion (tests/conftest.py) refuses: only the optimiser runs under standard.
    with jax.numpy_dtype_promotion("standard"):
      updates, state = opt.update(grads, state, p)
    return optax.apply_updates(p, updates), state

  with pytest.raises(jl.GradientContractError, match="edit_detached_from_graph") as info:
    step(variables, opt.init(variables))
  assert info.value.fields["code"] == "edit_detached_from_graph"
  assert info.value.fields["site"] == "hidden"
  assert "scale(0.0)" in info.value.fields["fix"]


def test_changing_edit_values_does_not_recompile_the_train_step():
  model, variables, x, y = _init()
  opt = optax.adam(1e-2)

  @jax.jit
  @chex.assert_max_traces(n=1)
  def step(p, state, spec, x_, y_):
    value, grads = jax.value_and_grad(lambda v: _mse(spec.bind(model)(v, x_), y_))(p)
    # optax.adam's bias correction raises a float to its int32 step count, which strict
    # dtype promotion (tests/conftest.py) refuses: only the optimiser runs under standard.
    with jax.numpy_dtype_promotion("standard"):
      updates, state = opt.update(grads, state, p)
    return optax.apply_updates(p, updates), state, value

  def spec_for(t):
    # A steering direction and magnitude, and a donor array, all new at every step.
    direction = jnp.roll(DIRECTION, t)
    magnitude = jnp.asarray(0.1 * t, F64)
    donor = jnp.full((x.shape[0], 16), 0.01 * t, F64)
    return jl.when(jl.module("hidden"), jl.steer(direction, magnitude)) + jl.when(
      jl.module("branch"), jl.patch_from(donor)
    )

  params, state = variables, opt.init(variables)
  for t in range(8):
    params, state, _ = step(params, state, spec_for(t), x, y)
  # The values are read, not baked in: the same state with other values gives another loss.
  _, _, a = step(params, state, spec_for(1), x, y)
  _, _, b = step(params, state, spec_for(5), x, y)
  assert abs(float(a) - float(b)) > 1e-6
  # The trace counter is live: a spec of another structure (another verb) retraces.
  other = jl.when(jl.module("hidden"), jl.scale(jnp.asarray(0.5, F64))) + jl.when(
    jl.module("branch"), jl.patch_from(jnp.zeros((x.shape[0], 16), F64))
  )
  with pytest.raises(AssertionError, match="traced"):
    step(params, state, other, x, y)
