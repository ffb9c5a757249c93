"""Property-based tests (hypothesis): verbs x doors x selections x dtypes x shapes.

Invariants (issue 13, item 4):

* the null edit (``scale(1)``, ``add(0)``, ``steer(d, 0)``, a patch from the same input...)
  is bit-identical to the plain forward on every door, under every selection;
* what a selection does not select is bit-identical to the plain run and keeps its gradient;
* ``jax.jit`` equals eager, and an argument passed traced (the edit as a jit argument)
  equals the same argument given concretely;
* every generated input, hostile ones included, gives either a typed jaxlens error whose
  code docs/errors.md lists, or a result of the site's shape and dtype; never a raw
  exception from JAX, numpy or Flax. A traced argument that the eager door refuses as
  naming no place makes the output NaN (the documented error value), never another edit.

Kept fast: tiny models cached per (dtype, shape), one door per example, derandomized.
"""

import functools
import pathlib
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import jaxlens as jl
from jaxlens import contract

# One xdist worker runs the file, so its models and compiled functions are shared.
pytestmark = pytest.mark.xdist_group("properties")


@pytest.fixture(autouse=True, scope="module")
def _optimised_xla():
  """XLA's optimising passes on (tests/conftest.py turns them off for speed): the
  bit-identity and jit-versus-eager properties must hold for the programs users run."""
  jax.config.update("jax_disable_most_optimizations", False)
  yield
  jax.config.update("jax_disable_most_optimizations", True)


SITE = "layers_0"
DTYPES = {
  "float16": jnp.float16,
  "bfloat16": jnp.bfloat16,
  "float32": jnp.float32,
  "float64": jnp.float64,
}
# The last axis is the feature axis; no other axis has its length (steer needs no feature_axis).
SHAPES = [(2, 4), (2, 3, 4)]
DOORS = (
  "live_bind",
  "live_trace",
  "replay",
  "rerun",
  "set_only_run",
  "spec_bind",
  "differentiable_replay",
)
# jit versus eager: a fused program may round differently from op-by-op execution.
TOL = {"float16": 2e-2, "bfloat16": 6e-2, "float32": 1e-5, "float64": 1e-12}
DOCUMENTED = set(
  re.findall(r"`([a-z0-9_]+)`", (pathlib.Path(__file__).parents[1] / "docs/errors.md").read_text())
)
# Eager refusals whose traced form cannot raise and writes NaN instead (docs/guide.md).
POISONED = {"index_out_of_range", "basis_rank_deficient", "direction_zero"}


# -- models, cached per (dtype, shape) -------------------------------------------------


class World:
  """A tiny two-layer model of one dtype and input shape, with its plain run."""

  def __init__(self, dtype_name, shape):
    dtype = DTYPES[dtype_name]
    self.dtype_name, self.dtype, self.shape, self.d = dtype_name, dtype, shape, shape[-1]
    self.model = nn.Sequential(
      [
        nn.Dense(self.d, dtype=dtype, param_dtype=dtype),
        nn.Dense(2, dtype=dtype, param_dtype=dtype),
      ]
    )
    n = int(np.prod(shape))
    self.x = (jnp.sin(jnp.arange(n, dtype=jnp.float32) * 1.7) * 2).reshape(shape).astype(dtype)
    # Deterministic weights built directly (model.init compiles a random draw per shape).
    dense = lambda i, o, seed: {
      "kernel": jnp.asarray(
        np.cos(np.arange(i * o) * 0.9 + seed).reshape(i, o) / np.sqrt(i), dtype
      ),
      "bias": jnp.asarray(np.sin(np.arange(o) + seed) * 0.1, dtype),
    }
    self.variables = {
      "params": {"layers_0": dense(self.d, self.d, 0), "layers_1": dense(self.d, 2, 1)}
    }
    self.plain = self.model.apply(self.variables, self.x)
    self.plain_trace = jl.trace(self.model, self.variables, self.x)
    self.site = self.plain_trace[SITE].out
    self.donor_trace = jl.trace(self.model, self.variables, 2 * self.x)
    self.jitted = {}

  def run(self, door, edit):
    return contract.DOORS[door][1](self.model, self.variables, self.x, edit)

  def run_jit(self, door, edit):
    """The door under jit with the edit's numeric leaves passed as (traced) arguments."""
    leaves, treedef = jax.tree.flatten(edit)
    traced = [_numeric(leaf) for leaf in leaves]
    args = [leaf for leaf, t in zip(leaves, traced) if t]
    fixed = tuple((i, leaf) for i, (leaf, t) in enumerate(zip(leaves, traced)) if not t)

    def f(variables, x, args):
      it = iter(args)
      const = dict(fixed)
      rebuilt = [const[i] if i in const else next(it) for i in range(len(leaves))]
      edit_ = jax.tree.unflatten(treedef, rebuilt)
      return contract.DOORS[door][1](self.model, variables, x, edit_)

    if fixed:
      return jax.jit(f)(self.variables, self.x, args)
    # One compiled function per door and edit structure: examples of the same structure
    # (and argument shapes) share its compilation.
    jitted = self.jitted.setdefault((door, treedef), jax.jit(f))
    return jitted(self.variables, self.x, args)

  def run_jit_closed(self, door, edit):
    """The door under jit with the edit closed over (its arguments concrete)."""
    return jax.jit(lambda v, x: contract.DOORS[door][1](self.model, v, x, edit))(
      self.variables, self.x
    )


def _numeric(leaf):
  return isinstance(leaf, (np.ndarray, jax.Array, int, float, complex, np.generic)) and not (
    isinstance(leaf, bool)
  )


@functools.lru_cache(maxsize=None)
def world(dtype_name, shape):
  return World(dtype_name, shape)


def _f64(a):
  return np.asarray(jnp.asarray(a).astype(jnp.float64))


def _assert_bits(a, b):
  a, b = jnp.asarray(a), jnp.asarray(b)
  assert a.shape == b.shape and a.dtype == b.dtype, (a.shape, a.dtype, b.shape, b.dtype)
  np.testing.assert_array_equal(_f64(a), _f64(b))


def _assert_close(a, b, dtype_name):
  a, b = jnp.asarray(a), jnp.asarray(b)
  assert a.shape == b.shape and a.dtype == b.dtype
  tol = TOL[dtype_name]
  np.testing.assert_allclose(_f64(a), _f64(b), rtol=tol, atol=tol)


# -- selections ---------------------------------------------------------------------


@st.composite
def selections(draw, w, kinds=("whole", "units", "subspace", "at_positions")):
  """(kind, wrap(edit) -> edit, unselected mask of the site or None)."""
  kind = draw(st.sampled_from(kinds))
  d, shape = w.d, w.site.shape
  if kind == "whole":
    return kind, (lambda e: e), None
  if kind in ("units", "subspace"):
    # One or two elements: every new selection size compiles new eager ops.
    chosen = draw(st.lists(st.integers(0, d - 1), min_size=1, max_size=2, unique=True))
    unselected = np.broadcast_to(~np.isin(np.arange(d), chosen), shape)
    if kind == "units":
      idx = np.asarray(chosen)
      return kind, (lambda e: jl.units(jl.module(SITE), idx).wrap(e)), unselected
    # A basis with support on the chosen features only, rotated within them.
    k = draw(st.integers(1, len(chosen)))
    angle = draw(st.floats(-3.0, 3.0))
    raw = np.zeros((d, k))
    for j in range(k):
      raw[chosen[j], j] = 1.0
      raw[chosen[(j + 1) % len(chosen)], j] += np.sin(angle) if len(chosen) > k else 0.0
    basis = np.array(jl.orthonormal(jnp.asarray(raw)))
    basis[np.abs(raw) == 0] = 0.0  # exact zeros where there is no support
    return kind, (lambda e: jl.subspace(jl.module(SITE), basis).wrap(e)), unselected
  axis = 1 if len(shape) == 3 else 0
  n = shape[axis]
  positions = np.asarray(
    draw(st.lists(st.integers(0, n - 1), min_size=1, max_size=n - 1, unique=True))
  )
  line = ~np.isin(np.arange(n), positions)
  view = [1] * len(shape)
  view[axis] = n
  unselected = np.broadcast_to(line.reshape(view), shape)
  return kind, (lambda e: jl.at_positions(positions, e, axis=axis)), unselected


# -- edits --------------------------------------------------------------------------


def null_edits(w):
  d, dt = w.d, w.dtype
  return st.sampled_from(
    [
      lambda: jl.scale(1.0),
      lambda: jl.add(jnp.zeros((d,), dt)),
      lambda: jl.steer(jnp.ones((d,), dt), 0.0),
      lambda: jl.clamp(min=-jnp.inf, max=jnp.inf),
      lambda: jl.compose(jl.scale(1.0), jl.add(jnp.zeros((d,), dt))),
      lambda: jl.patch_from(w.plain_trace),
      lambda: jl.replace_with(w.site),
    ]
  )


def active_edits(w, *, under_subspace=False):
  """Edits that change the site, with drawn arguments."""
  d, dt, shape = w.d, w.dtype, w.site.shape
  floats = st.floats(-2.0, 2.0, allow_nan=False, width=16)
  vec = st.lists(floats, min_size=d, max_size=d).map(lambda v: jnp.asarray(v, dt))
  seeds = st.integers(0, 2**32 - 1)
  options = [
    floats.map(jl.scale),
    st.just(jl.zero_ablate()),
    st.builds(lambda s, seed: jl.add_noise(abs(s) + 0.1, seed=seed), floats, seeds),
    st.builds(jl.steer, vec, floats),
    st.builds(lambda v: jl.add(v), vec),
    st.just(jl.clamp(min=-0.25, max=0.5)),
    st.just(jl.mean_ablate(dim=0)),
    seeds.map(lambda seed: jl.scramble_elements(seed=seed)),
    seeds.map(lambda seed: jl.permute_batch(seed=seed)),
    st.just(jl.patch_from(w.donor_trace)),
    st.just(jl.replace_with(jnp.full(shape, 0.5, dt))),
  ]
  if not under_subspace:
    nonzero = vec.filter(lambda v: bool(jnp.any(v != 0)))
    options.append(nonzero.map(jl.project_out))
  return st.one_of(options)


worlds = st.builds(world, st.sampled_from(tuple(DTYPES)), st.sampled_from(SHAPES))


# -- invariants -----------------------------------------------------------------------


@settings(max_examples=40)
@given(data=st.data(), w=worlds, door=st.sampled_from(DOORS))
def test_the_null_edit_is_bit_identical_on_every_door(data, w, door):
  kind, wrap, _ = data.draw(selections(w))
  edit = wrap(data.draw(null_edits(w))())
  _assert_bits(w.run(door, edit), w.plain)


def _site_after(w, edit, x):
  t = jl.trace(w.model, w.variables, x, intervene=jl.when(jl.module(SITE), edit), save=SITE)
  return t[SITE].out


@settings(max_examples=12)
@given(data=st.data(), w=worlds)
def test_unselected_elements_are_bit_identical_and_keep_their_gradient(data, w):
  kind, wrap, unselected = data.draw(selections(w, ("units", "subspace", "at_positions")))
  edit = wrap(data.draw(active_edits(w, under_subspace=kind == "subspace")))
  plain_site = lambda x: jl.trace(w.model, w.variables, x, save=SITE)[SITE].out
  edited = _site_after(w, edit, w.x)
  _assert_bits(jnp.where(unselected, edited, 0), jnp.where(unselected, w.site, 0))
  weights = jnp.asarray(unselected * (1.0 + np.arange(unselected.size).reshape(unselected.shape)))
  weights = weights.astype(w.dtype)
  loss = lambda f: lambda x: (f(x) * weights).astype(jnp.float32).sum()
  g_edit = jax.grad(loss(lambda x: _site_after(w, edit, x)))(w.x)
  g_plain = jax.grad(loss(plain_site))(w.x)
  _assert_bits(g_edit, g_plain)


@settings(max_examples=25)
@given(data=st.data(), w=worlds, door=st.sampled_from(DOORS))
def test_a_traced_argument_equals_the_same_argument_given_eagerly(data, w, door):
  kind, wrap, _ = data.draw(selections(w))
  inner = data.draw(st.one_of(null_edits(w).map(lambda f: f()), active_edits(w)))
  if kind == "subspace" and inner.name == "project_out":
    inner = jl.scale(0.5)
  edit = wrap(inner)
  eager = w.run(door, edit)
  _assert_close(w.run_jit(door, edit), eager, w.dtype_name)


@settings(max_examples=8)
@given(data=st.data(), w=worlds, door=st.sampled_from(DOORS))
def test_jit_equals_eager(data, w, door):
  kind, wrap, _ = data.draw(selections(w))
  edit = wrap(data.draw(active_edits(w, under_subspace=kind == "subspace")))
  _assert_close(w.run_jit_closed(door, edit), w.run(door, edit), w.dtype_name)


# -- hostile inputs -------------------------------------------------------------------


@st.composite
def hostile_edits(draw, w):
  """An edit with (mostly) bad arguments, as a careless or hostile user writes it."""
  d, dt, shape = w.d, w.dtype, w.site.shape
  bad_len = draw(st.sampled_from([1, d - 1, d + 1, 2 * d]))
  odd_vec = st.sampled_from(
    [
      jnp.zeros((d,), dt),
      jnp.full((d,), jnp.nan, dt),
      jnp.ones((bad_len,), dt),
      jnp.ones((d,), jnp.int32),
      np.ones((d,)) * 1j,
      jnp.ones((d, 2), dt),
      jnp.ones((), dt),
    ]
  )
  bad_index = st.sampled_from([d, d + 3, -d - 1, 10**6, -1])
  seed = st.sampled_from([-1, 2**32, 2**40, 0, 7])
  axis = st.sampled_from([5, -5, 3, 0, 1])
  inner = st.sampled_from(
    [jl.scale(2.0), jl.zero_ablate(), jl.add_noise(0.1, seed=1), jl.mean_ablate(dim=0)]
  )
  choice = draw(
    st.sampled_from(
      [
        "units_index",
        "units_2d",
        "units_float",
        "units_mask",
        "positions",
        "positions_float",
        "positions_axis",
        "basis",
        "origin",
        "direction",
        "factor",
        "delta",
        "seed",
        "dim",
        "permute_axis",
        "replace",
        "no_seed",
      ]
    )
  )
  site = jl.module(SITE)
  if choice == "units_index":
    idx = np.asarray([0, draw(bad_index)])
    return jl.units(site, idx).wrap(draw(inner))
  if choice == "units_2d":
    rows = draw(st.integers(1, 3))
    cols = draw(st.sampled_from([len(shape) - 1, len(shape), len(shape) + 1]))
    big = draw(st.sampled_from([0, 1, 7]))
    return jl.units(site, np.full((rows, cols), big)).wrap(draw(inner))
  if choice == "units_float":
    return jl.units(site, np.asarray([0.5, 1.0])).wrap(draw(inner))
  if choice == "units_mask":
    mshape = draw(st.sampled_from([shape, shape[:-1] + (d + 1,), (d,), (1, d), (7,)]))
    return jl.units(site, np.ones(mshape, bool)).wrap(draw(inner))
  if choice == "positions":
    n = shape[1 if len(shape) == 3 else 0]
    pos = np.asarray([draw(st.sampled_from([n, -n - 1, n + 5, 0]))])
    return jl.at_positions(pos, draw(inner), axis=1 if len(shape) == 3 else 0)
  if choice == "positions_float":
    return jl.at_positions(np.asarray([0.0]), draw(inner), axis=0)
  if choice == "positions_axis":
    return jl.at_positions(np.asarray([0]), draw(inner), axis=draw(axis))
  if choice == "basis":
    basis = draw(
      st.sampled_from(
        [
          np.zeros((d, 1)),
          np.ones((d, 2)),
          np.full((d, 1), np.nan),
          np.eye(d + 1)[:, :2],
          np.eye(d)[:, :0],
          np.ones((d,)),
          np.eye(d)[:, :2].astype(np.int32),
        ]
      )
    )
    return jl.subspace(site, basis).wrap(draw(inner))
  if choice == "origin":
    origin = draw(st.sampled_from([np.ones((d + 1,)), np.ones((7, 7)), np.full((d,), np.nan)]))
    return jl.subspace(site, np.eye(d)[:, :1], origin=origin).wrap(draw(inner))
  if choice == "direction":
    verb = draw(
      st.sampled_from(
        [
          jl.steer,
          jl.project_out,
          jl.project_onto,
          lambda v: jl.set_direction_mean(v, jl.population(w.site)),
        ]
      )
    )
    return verb(draw(odd_vec))
  if choice == "factor":
    return jl.scale(draw(st.sampled_from([jnp.ones((d + 1,)), jnp.ones((7, 3)), jnp.nan, 1j])))
  if choice == "delta":
    return jl.add(draw(odd_vec))
  if choice == "seed":
    return _seeded(draw, seed)
  if choice == "dim":
    return jl.mean_ablate(dim=draw(axis))
  if choice == "permute_axis":
    return jl.permute_batch(seed=0, axis=draw(axis))
  if choice == "replace":
    value = draw(
      st.sampled_from(
        [
          jnp.ones(shape[:-1] + (d + 1,), dt),
          jnp.ones(shape, jnp.int32),
          jnp.ones(shape, jnp.float32 if dt != jnp.float32 else jnp.float64),
          jnp.ones((7,), dt),
        ]
      )
    )
    return draw(st.sampled_from([jl.replace_with, jl.swap_with]))(value)
  return draw(
    st.sampled_from([jl.add_noise(0.1), jl.scramble_elements(), jl.resample_rows_from(w.site)])
  )


def _seeded(draw, seed):
  s = draw(seed)
  kind = draw(st.sampled_from(["noise", "scramble", "permute", "resample"]))
  if kind == "noise":
    return jl.add_noise(0.1, seed=s)
  if kind == "scramble":
    return jl.scramble_elements(seed=s)
  if kind == "permute":
    return jl.permute_batch(seed=s)
  return jl.resample_rows_from(jnp.ones((4, 4)), seed=s)


def _outcome(run, w):
  """("ok", output) or ("raises", code); a raw exception propagates (the test fails)."""
  try:
    out = run()
  except jl.JaxlensError as error:
    code = getattr(error, "code", None) or error.fields.get("code")
    assert code in DOCUMENTED, f"undocumented code {code!r}: {error}"
    return "raises", code
  out = jnp.asarray(out)
  assert out.shape == w.plain.shape and out.dtype == w.plain.dtype
  return "ok", out


@settings(max_examples=75)
@given(data=st.data(), w=worlds, door=st.sampled_from(DOORS), traced=st.booleans())
def test_every_input_gives_a_typed_error_or_a_result(data, w, door, traced):
  edit = data.draw(hostile_edits(w))
  eager = _outcome(lambda: w.run(door, edit), w)
  if not traced:
    return
  kind, out = _outcome(lambda: w.run_jit(door, edit), w)
  if eager[0] == "raises" and eager[1] in POISONED and kind == "ok":
    # The traced argument could not raise: the edit's error value shows, never another edit.
    assert np.isnan(_f64(out)).any(), f"{edit!r}: traced, it gave a finite result"


@pytest.mark.parametrize("dtype_name", tuple(DTYPES))
def test_world_models_run_in_their_dtype(dtype_name):
  """The property tests' models compute in the dtype they claim (else they test nothing)."""
  w = world(dtype_name, SHAPES[1])
  assert w.plain.dtype == DTYPES[dtype_name] and w.site.dtype == DTYPES[dtype_name]


# -- regressions of what the properties found ------------------------------------------


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_a_subspace_null_edit_is_bit_identical_in_half_precision(dtype):
  x = (jnp.sin(jnp.arange(30.0)) * 2).reshape(3, 2, 5).astype(dtype)
  raw = np.zeros((5, 1))
  raw[[0, 1], 0] = [1.0, 0.3]
  basis = jl.orthonormal(jnp.asarray(raw))
  _assert_bits(jl.subspace_scale(basis, 1.0)(x), x)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float8_e4m3fn])
def test_a_spec_holding_an_ml_dtypes_array_round_trips(tmp_path, dtype):
  value = jnp.asarray([0.5, -1.0, 2.0, 0.25], dtype)
  spec = jl.when(jl.module(SITE), jl.add(value))
  loaded = jl.load_spec(spec.save(tmp_path / "s"))
  assert repr(loaded) == repr(spec)
  got = loaded.rules[0][1].arguments["delta"]
  assert got.dtype == value.dtype
  _assert_bits(got, value)


def test_a_non_finite_basis_is_a_typed_error():
  x = jnp.ones((2, 4))
  with pytest.raises(jl.InvalidArgumentError) as info:
    jl.subspace_scale(np.full((4, 1), np.nan), 2.0)(x)
  assert info.value.code == "basis_not_finite"
