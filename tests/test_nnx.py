"""Flax NNX models: sites, live doors, jl.trace and replay, the matrix rows, nnx.jit."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxlens as jl
from jaxlens import intervention as ji
from jaxlens import contract as matrix

# The matrix cells are cached per process: the files reading them share one xdist worker.
pytestmark = pytest.mark.xdist_group("matrix")

SITE = jl.module("layers/0")


def _nnx_spec_model(spec_model):
  """The matrix model as nnx.Sequential, with the linen variables' weights."""
  _, variables, x, x_donor, _ = spec_model
  m = nnx.Sequential(
    nnx.Linear(4, 4, rngs=nnx.Rngs(0), param_dtype=jnp.float64),
    nnx.Linear(4, 2, rngs=nnx.Rngs(0), param_dtype=jnp.float64),
  )
  for i in range(2):
    p = variables["params"][f"layers_{i}"]
    m.layers[i].kernel.value = p["kernel"]
    m.layers[i].bias.value = p["bias"]
  return m, x, x_donor


def _case(m, x_donor):
  return matrix.case_from(lambda: jl.trace(m, x_donor), "layers/0")


NNX_DOORS = {
  "live_bind": lambda m, x, e: jl.when(SITE, e).bind(m)(x),
  "live_trace": lambda m, x, e: jl.trace(m, x, intervene=jl.when(SITE, e)).output,
  "replay": lambda m, x, e: jl.trace(m, x).fork().do(SITE, e).output,
  "rerun": lambda m, x, e: jl.trace(m, x).fork().do(SITE, e, model=m, inputs=x).output,
}


@pytest.mark.parametrize("door", list(NNX_DOORS))
@pytest.mark.parametrize(
  "row", [r for r in matrix.ROWS if r.name not in matrix.SUBSPACE_ONLY], ids=lambda r: r.name
)
def test_nnx_matrix_rows_match_linen(spec_model, matrix_weights, door, row):
  m, x, x_donor = _nnx_spec_model(spec_model)
  graphdef, state = nnx.split(m)
  # The linen cell, measured once per session (tests/test_matrix.py reads the same one).
  linen = matrix.measured(door, row.name, False, matrix_weights)

  def out_fn(state, keep=False):
    mm = nnx.merge(graphdef, state)
    edit = row.build(_case(mm, x_donor))
    return NNX_DOORS[door](mm, x, ji.keep_grad(edit) if keep else edit)

  (_, out), grad = jax.value_and_grad(lambda s: (lambda o: (o.sum(), o))(out_fn(s)), has_aux=True)(
    state
  )
  np.testing.assert_allclose(out, linen.output, atol=1e-12, rtol=0)
  kernel = grad["layers"][0]["kernel"].value
  np.testing.assert_allclose(kernel, linen.kernel_grad, atol=1e-12, rtol=0)
  reaches = jl.depends_on(lambda s: out_fn(s).sum(), state)["layers"][0]["kernel"].value
  assert ("reaches" if reaches else "cut") == linen.outcome
  if row.keeps:
    out_fn(state, keep=True)
  else:
    with pytest.raises(jl.GradientContractError, match="edit_detached_from_graph"):
      out_fn(state, keep=True)


class Block(nnx.Module):
  def __init__(self, rngs):
    self.fc = nnx.Linear(4, 4, rngs=rngs)

  def __call__(self, x):
    return x + self.fc(jnp.tanh(x))


class Net(nnx.Module):
  def __init__(self, rngs):
    self.inp = nnx.Linear(4, 4, rngs=rngs)
    self.blocks = nnx.List([Block(rngs) for _ in range(2)])
    self.out = nnx.Linear(4, 1, rngs=rngs)

  def __call__(self, x):
    x = self.inp(x)
    for block in self.blocks:
      x = block(x)
    return self.out(x)


X = jnp.linspace(-1.0, 1.0, 12, dtype=jnp.float32).reshape(3, 4)


def test_nnx_sites_and_op_sites():
  net = Net(nnx.Rngs(0))
  t = jl.trace(net, X, save=jl.all_sites())
  assert [lbl for lbl in t.labels if "/" in lbl or lbl in ("inp", "out")] == [
    "inp",
    "blocks/0/fc",
    "blocks/0",
    "blocks/1/fc",
    "blocks/1",
    "out",
  ]
  assert {i.path for i in t.sites if i.func == "tanh"} == {"blocks/0", "blocks/1"}
  np.testing.assert_allclose(t.output, net(X), atol=0)
  with pytest.raises(jl.SiteError, match="blocks/1"):
    jl.trace(net, X, intervene=jl.when(jl.module("blocks/2"), jl.scale(2.0)))


def test_nnx_jit_and_jax_jit():
  net = Net(nnx.Rngs(0))
  spec = jl.when(jl.module("blocks/1"), jl.steer(jnp.ones(4, jnp.float32), 2.0))
  eager = spec.bind(net)(X)
  np.testing.assert_allclose(nnx.jit(lambda m, x: spec.bind(m)(x))(net, X), eager, atol=1e-6)
  graphdef, state = nnx.split(net)
  f = jax.jit(lambda s, x: spec.bind(nnx.merge(graphdef, s))(x))
  np.testing.assert_allclose(f(state, X), eager, atol=1e-6)
  t = nnx.jit(lambda m, x: jl.trace(m, x, intervene=spec))(net, X)
  np.testing.assert_allclose(t.output, eager, atol=1e-6)
  # The intercepted classes are restored afterwards.
  assert not hasattr(nnx.Linear.__call__, "__jaxlens_wrapped__")


def test_nnx_training_through_a_keeping_edit():
  net = Net(nnx.Rngs(0))
  target = jnp.sum(X, axis=1, keepdims=True)
  spec = jl.when(jl.module("blocks/0"), ji.keep_grad(jl.scale(0.5)))
  optimizer = nnx.Optimizer(net, optax.adam(0.05), wrt=nnx.Param)

  @nnx.jit
  def step(net, optimizer):
    loss, grads = nnx.value_and_grad(lambda m: jnp.mean((spec.bind(m)(X) - target) ** 2))(net)
    # optax.adam's bias correction raises a float to its int32 step count, which strict
    # dtype promotion (tests/conftest.py) refuses: only the optimiser runs under standard.
    with jax.numpy_dtype_promotion("standard"):
      optimizer.update(net, grads)
    return loss

  first = step(net, optimizer)
  for _ in range(60):
    last = step(net, optimizer)
  assert last < 0.2 * first
