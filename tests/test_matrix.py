"""The contract matrix, door by door and cell by cell, against hand-written edits."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxlens import contract as matrix

# The matrix cells are cached per process: the files reading them share one xdist worker.
pytestmark = pytest.mark.xdist_group("matrix")

SITE = matrix.SITE
_sg = jax.lax.stop_gradient
DIRECTION = jnp.asarray([1.0, -2.0, 0.5, 3.0])
DELTA = jnp.linspace(-1.0, 1.0, 12).reshape(3, 4)


def _unit():
  return DIRECTION / jnp.linalg.norm(DIRECTION)


def _perm(seed, n):
  return jax.random.permutation(jax.random.key(seed), n)


# The same edits written by hand in plain JAX, independent of jaxlens. `d` is the
# donor's value at the site (it carries a graph: hand cutting edits detach it).
HAND = {
  "scale": lambda x, d, pop: x * 0.5,
  "clamp": lambda x, d, pop: jnp.clip(x, -0.3, 0.4),
  "add_noise": lambda x, d, pop: x + 0.1 * jax.random.normal(jax.random.key(0), x.shape, x.dtype),
  "steer": lambda x, d, pop: x + 2.0 * DIRECTION[None, :],
  "add": lambda x, d, pop: x + DELTA,
  "project_onto": lambda x, d, pop: (x @ _unit())[:, None] * _unit()[None, :],
  "project_out": lambda x, d, pop: x - (x @ _unit())[:, None] * _unit()[None, :],
  "mean_ablate(dim=)": lambda x, d, pop: jnp.broadcast_to(x.mean(0, keepdims=True), x.shape),
  "scramble_elements(seed=)": lambda x, d, pop: x.reshape(-1)[_perm(0, 12)].reshape(3, 4),
  "splice_module": lambda x, d, pop: jnp.tanh(x),
  "permute_batch": lambda x, d, pop: x[_perm(1, 3)],
  "set_direction_mean": lambda x, d, pop: (
    x - (x @ _unit())[:, None] * _unit() + jnp.mean(_sg(pop) @ _unit()) * _unit()
  ),
  "compose": lambda x, d, pop: x * 0.0 + DELTA,
  "hook callable": lambda x, d, pop: x * x,
  "zero_ablate": lambda x, d, pop: jnp.zeros_like(x),
  "replace_with": lambda x, d, pop: _sg(d),
  "swap_with": lambda x, d, pop: _sg(d),
  "patch_from": lambda x, d, pop: _sg(d),
  "resample_rows_from": lambda x, d, pop: _sg(pop)[
    jax.random.randint(jax.random.key(0), (3,), 0, 6)
  ],
  "mean_ablate(source=)": lambda x, d, pop: jnp.broadcast_to(_sg(pop).mean(0), x.shape),
  "scramble_elements(source=)": lambda x, d, pop: _sg(d).reshape(-1)[_perm(0, 12)].reshape(3, 4),
}


_RAW = np.asarray([[1.0, 0.5], [-2.0, 1.0], [0.5, 3.0], [1.0, -1.0]])
_Q, _R = np.linalg.qr(_RAW)
BASIS = jnp.asarray(_Q * np.sign(np.diag(_R)))  # orthonormal, 4 x 2
W = jnp.asarray([[0.5, -1.0, 0.0, 2.0], [1.0, 0.0, -0.5, 0.0]])
B_AFF = jnp.asarray([0.1, -0.2])
SOURCE_ROWS = {
  "replace_with",
  "swap_with",
  "patch_from",
  "resample_rows_from",
  "mean_ablate(source=)",
  "scramble_elements(source=)",
}


def _hand_subspace_patch(x, d, pop):
  o = _sg(pop).mean(0)
  c, c_new = (x - o) @ BASIS, (_sg(d) - o) @ BASIS
  return x + (c_new - c) @ BASIS.T


HAND["subspace_* (subspace_patch)"] = _hand_subspace_patch


def _hand_edit(name, kind, x, d, pop):
  """The row's edit on the site value x, under no selection, units or a subspace."""
  if kind == "units":
    cols = jnp.asarray([False, True, False, True])[None, :]
    return jnp.where(cols, HAND[name](x, d, pop), x)
  if kind == "subspace":
    o = _sg(pop).mean(0)
    c = (x - o) @ BASIS
    if name == "set_affine_coordinates":
      c_new = x @ W.T + B_AFF
    elif name in SOURCE_ROWS:
      c_new = (HAND[name](x, d, pop) - o) @ BASIS
    else:
      c_new = HAND[name](c @ BASIS.T, d, pop) @ BASIS
    return x + (c_new - c) @ BASIS.T
  return HAND[name](x, d, pop)


def _hand_output(model, variables, x, x_donor, name, kind=""):
  """The edit applied by a hand-written interceptor in a plain Flax forward."""
  captured = {}

  def capture(next_fun, args, kwargs, context):
    out = next_fun(*args, **kwargs)
    if context.module.path == (SITE,):
      captured["d"] = out
    return out

  with nn.intercept_methods(capture):
    model.apply(variables, x_donor)
  d = captured["d"]
  pop = jnp.concatenate([d, d[::-1] * 0.5])

  def edit(next_fun, args, kwargs, context):
    out = next_fun(*args, **kwargs)
    if context.module.path == (SITE,):
      return _hand_edit(name, kind, out, d, pop)
    return out

  with nn.intercept_methods(edit):
    return model.apply(variables, x)


_HAND_CACHE = {}


def _hand_reference(spec_model, name, kind):
  """The hand-written edit's output and site-kernel gradient; it depends on the row and
  the selection kind, not on the door, so the doors of one row share it."""
  key = (id(spec_model), name, kind)
  if key not in _HAND_CACHE:
    model, variables, x, x_donor, _ = spec_model

    def total(v):
      out = _hand_output(model, v, x, x_donor, name, kind)
      return out.sum(), out

    # One forward for both: the output is the differentiated run's own.
    (_, out), grad = jax.value_and_grad(total, has_aux=True)(variables)
    _HAND_CACHE[key] = (out, grad["params"][SITE]["kernel"])
  return _HAND_CACHE[key]


def test_hand_table_covers_every_row():
  assert set(HAND) | {"set_affine_coordinates"} == {r.name for r in matrix.ROWS}
  np.testing.assert_allclose(BASIS, matrix.matrix_basis(), atol=1e-15)


@pytest.mark.parametrize("door", list(matrix.DOORS))
@pytest.mark.parametrize("row", matrix.ROWS, ids=lambda r: r.name)
def test_cell(spec_model, matrix_weights, door, row):
  model, variables, x, x_donor, _ = spec_model
  want = matrix.expected(door, row)
  cells = [matrix.measured(door, row.name, keep, matrix_weights) for keep in (False, True)]
  assert (cells[0].outcome, cells[1].outcome) == want, [c.message for c in cells]

  if all(c.outcome.startswith("raises:") for c in cells):
    return
  kind, _, base = door.rpartition(":")
  hand_out, hand_kernel = _hand_reference(spec_model, row.name, kind)
  for keep, cell in zip((False, True), cells):
    if cell.outcome.startswith("raises:"):
      continue
    np.testing.assert_allclose(cell.output, hand_out, rtol=0, atol=1e-12)
    if cell.outcome == "reaches":
      np.testing.assert_allclose(cell.kernel_grad, hand_kernel, rtol=0, atol=1e-12)
    else:
      assert np.all(cell.kernel_grad == 0)
      if base != "differentiable_replay":
        assert np.all(hand_kernel == 0)
    # keep_grad under differentiable replay warns; nothing else does.
    want_warning = keep and base == "differentiable_replay"
    assert cell.warnings == (("keep_grad_replay_frontier",) if want_warning else ())


def test_edits_change_the_output(spec_model, matrix_weights):
  """Guards the table above against edits that silently do nothing."""
  model, variables, x, _, _ = spec_model
  clean = model.apply(variables, x)
  for row in matrix.ROWS:
    door = "subspace:live_bind" if row.name in matrix.SUBSPACE_ONLY else "live_trace"
    cell = matrix.measured(door, row.name, False, matrix_weights)
    assert np.max(np.abs(cell.output - clean)) > 1e-6, row.name


def test_matrix_formats_with_full_agreement(matrix_weights):
  table = {
    (d, r.name): tuple(matrix.measured(d, r.name, k, matrix_weights) for k in (False, True))
    for d in ("live_bind", "replay")
    for r in matrix.ROWS
    if r.name in ("scale", "zero_ablate", "set_affine_coordinates")
  }
  text = matrix.format_matrix(table)
  assert f"{len(table)} of {len(table)} rows agree" in text
  assert "raises:edit_detached_from_graph" in text


def test_a_case_first_built_under_jit_caches_no_tracer(spec_model):
  # The donor-independent edit arguments are made once per process; a first call from
  # inside a jit trace (as the scanned-stack tests make) must not leave tracers in the cache.
  model, variables, x, x_donor, _ = spec_model
  matrix._constants.cache_clear()

  @jax.jit
  def first(v):
    return matrix.make_case(model, v, x, x_donor).delta.sum()

  first(variables)
  cached = matrix.case_constants()
  assert all(not isinstance(a, jax.core.Tracer) for a in jax.tree.leaves(cached))
  np.testing.assert_allclose(cached["basis"].T @ cached["basis"], np.eye(2), atol=1e-12)
  # A case built afterwards, outside any trace, uses the cached arrays.
  assert matrix.make_case(model, variables, x, x_donor).delta is cached["delta"]
