"""Edits at a chosen layer of an nn.scan / nnx.scan layer stack, without unrolling it.

The reference is the same model unrolled (three named blocks holding the slices of
the stacked parameters) with the same edit at the same block: every matrix row on
every door gives the same output and the same gradient of every parameter.
"""

import functools

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxlens as jl
from jaxlens import intervention as ji
from jaxlens import contract as matrix

L, LAYER = 3, 1


class Block(nn.Module):
  @nn.compact
  def __call__(self, x, _):
    h = jnp.tanh(nn.Dense(4, name="up", param_dtype=jnp.float64)(x))
    return x + nn.Dense(4, name="down", param_dtype=jnp.float64)(h), None


class Scanned(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = nn.Dense(4, name="inp", param_dtype=jnp.float64)(x)
    stack = nn.scan(Block, variable_axes={"params": 0}, split_rngs={"params": True}, length=L)
    x, _ = stack(name="blocks")(x, None)
    return nn.Dense(2, name="head", param_dtype=jnp.float64)(x)


class Unrolled(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = nn.Dense(4, name="inp", param_dtype=jnp.float64)(x)
    for k in range(L):
      x, _ = Block(name=f"blocks_{k}")(x, None)
    return nn.Dense(2, name="head", param_dtype=jnp.float64)(x)


def unroll(variables):
  p = dict(variables["params"])
  stacked = p.pop("blocks")
  for k in range(L):
    p[f"blocks_{k}"] = jax.tree.map(lambda a, k=k: a[k], stacked)
  return {"params": p}


def restack(grads):
  p = dict(grads["params"])
  p["blocks"] = jax.tree.map(lambda *a: jnp.stack(a), *[p.pop(f"blocks_{k}") for k in range(L)])
  return {"params": p}


X = jax.random.normal(jax.random.key(1), (3, 4), jnp.float64)
X_DONOR = jax.random.normal(jax.random.key(2), (3, 4), jnp.float64)


@pytest.fixture(scope="module")
def models():
  model = Scanned()
  v = model.init(jax.random.key(0), X)
  return model, v, Unrolled(), unroll(v)


def _case(model, v, site):
  return matrix.case_from(lambda: jl.trace(model, v, X_DONOR), site, X)


def _fork(model, v):
  return jl.trace(model, v, X).fork()


SCAN_SITE = jl.module("blocks/up", layer=LAYER)
FLAT_SITE = jl.module(f"blocks_{LAYER}/up")


def _value_and_grad(fn):
  return jax.value_and_grad(lambda v: (lambda o: (o.sum(), o))(fn(v)), has_aux=True)


def _outcome(fn, v):
  try:
    out, grads = jax.jit(_value_and_grad(fn))(v)
  except jl.InvalidArgumentError as error:
    return error.code, None, None
  return "ran", out[1], grads


def _outcomes(scanned, v, unrolled, fv):
  """Both models' ``(code, output, gradient)``, from one jitted program (one compile per
  cell instead of an eager scan, which compiles its body at every call; both models go
  through the same transformation, so they stay comparable). When either refuses, each
  runs alone, so that each gives its own code."""
  try:
    (out_s, g_s), (out_u, g_u) = jax.jit(
      lambda v, fv: (_value_and_grad(scanned)(v), _value_and_grad(unrolled)(fv))
    )(v, fv)
  except jl.InvalidArgumentError:
    return _outcome(scanned, v), _outcome(unrolled, fv)
  return ("ran", out_s[1], g_s), ("ran", out_u[1], g_u)


def _spec(pairs, units):
  spec = None
  for site, edit in pairs:
    if units:
      edit = jl.units(site, np.asarray([1, 3])).wrap(edit)
    rule = jl.when(site, edit)
    spec = rule if spec is None else spec + rule
  return spec


# The doors, each given a spec of one or several (site, edit) pairs.
SPEC_DOORS = {
  "live_bind": lambda m, v, spec: spec.bind(m)(v, X),
  "live_trace": lambda m, v, spec: jl.trace(m, v, X, intervene=spec).output,
  "replay": lambda m, v, spec: _fork(m, v).do(spec).output,
  "rerun": lambda m, v, spec: _fork(m, v).do(spec, model=m.bind(v), inputs=X).output,
  "differentiable_replay": lambda m, v, spec: (
    _fork(m, v).do(spec, intervention=jl.InterventionOptions(differentiable=True)).output
  ),
  "units:live_bind": lambda m, v, spec: spec.bind(m)(v, X),
}
# One (site, edit) on a door: a one-rule spec.
DOORS = {
  door: lambda m, v, s, e, door=door: SPEC_DOORS[door](
    m, v, _spec([(s, e)], door.startswith("units:"))
  )
  for door in SPEC_DOORS
}
# A covering design: the rows in groups of L, the k-th row of a group edits layer k, so one
# compiled program (and its unrolled twin) checks L rows on a door. Every row runs on every
# door (tests/test_coverage.py), at one of the layers.
CHUNKS = [tuple(matrix.ROWS[i : i + L]) for i in range(0, len(matrix.ROWS), L)]


def _compare(models, door, rows, layers):
  model, v, flat, fv = models
  run, units = SPEC_DOORS[door], door.startswith("units:")
  scan_sites = [jl.module("blocks/up", layer=k) for k in layers]
  flat_sites = [jl.module(f"blocks_{k}/up") for k in layers]

  def scanned(v):
    pairs = [(s, r.build(_case(model, v, s))) for s, r in zip(scan_sites, rows)]
    return run(model, v, _spec(pairs, units))

  def unrolled(v):
    pairs = [(s, r.build(_case(flat, v, s))) for s, r in zip(flat_sites, rows)]
    return run(flat, v, _spec(pairs, units))

  (code_s, out_s, g_s), (code_u, out_u, g_u) = _outcomes(scanned, v, unrolled, fv)
  assert code_s == code_u, (rows, layers)
  if code_s != "ran":
    return code_s
  np.testing.assert_allclose(out_s, out_u, atol=1e-12, rtol=0)
  for a, b in zip(jax.tree.leaves(g_s), jax.tree.leaves(restack(g_u))):
    np.testing.assert_allclose(a, b, atol=1e-12, rtol=0)
  # Every layer gets the gradient of the unrolled model at its own, and a cutting verb
  # cuts the edited layer's "up" kernel exactly like the unrolled one.
  up = g_s["params"]["blocks"]["up"]["kernel"]
  for k in layers:
    assert (np.abs(up[k]).max() == 0) == (
      np.abs(g_u["params"][f"blocks_{k}"]["up"]["kernel"]).max() == 0
    ), k
  return code_s


@pytest.mark.parametrize("door", list(DOORS))
@pytest.mark.parametrize("rows", CHUNKS, ids=lambda rows: "+".join(r.name for r in rows))
def test_every_row_at_a_scanned_layer_matches_the_unrolled_model(models, door, rows):
  if _compare(models, door, rows, range(len(rows))) == "ran":
    return
  # A row of the group refuses on this door: each row alone, at the middle layer, must
  # refuse with the same code as the unrolled model or run and agree.
  for row in rows:
    _compare(models, door, (row,), (LAYER,))


def test_stack_is_not_unrolled_and_values_are_saved_stacked(models):
  model, v, flat, fv = models
  f = jax.jit(jl.when(SCAN_SITE, jl.zero_ablate()).bind(model))
  jaxpr = str(jax.make_jaxpr(f)(v, X))
  plain = str(jax.make_jaxpr(model.apply)(v, X))
  assert jaxpr.count("scan[") == 1
  assert jaxpr.count("dot_general") == plain.count("dot_general") == 4
  t = jl.trace(model, v, X)
  tf = jl.trace(flat, fv, X)
  assert t["blocks/up"].out.shape == (L, 3, 4)
  for k in range(L):
    np.testing.assert_allclose(t["blocks/up"].out[k], tf[f"blocks_{k}/up"].out, atol=1e-12)
    one = t[jl.module("blocks/down", layer=k)]
    assert one.label == f"blocks/down[{k}]"
    np.testing.assert_allclose(one.out, tf[f"blocks_{k}/down"].out, atol=1e-12)
  # Saving one layer keeps that layer only, under its own label.
  s = jl.trace(model, v, X, save=jl.module("blocks/down", layer=2))
  assert s.labels == ("blocks/down[2]",)
  np.testing.assert_allclose(s["blocks/down[2]"].out, tf["blocks_2/down"].out, atol=1e-12)
  assert [i.label for i in t.sites if i.kind == "module"] == [
    "inp",
    "blocks/up",
    "blocks/down",
    "blocks#0",
    "head",
  ]
  # Each layer returns a tuple, so its first element is a site of its own, saved stacked.
  for k in range(L):
    np.testing.assert_allclose(t["blocks#0"].out[k], tf[f"blocks_{k}#0"].out, atol=1e-12)


def test_layer_selection_spellings_and_errors(models):
  model, v, flat, fv = models
  by_label = jl.trace(model, v, X, intervene=jl.when(jl.label("blocks/up[1]"), jl.scale(0.0)))
  by_module = jl.trace(model, v, X, intervene=jl.when(SCAN_SITE, jl.scale(0.0)))
  np.testing.assert_allclose(by_label.output, by_module.output, atol=0)
  # No layer: every layer; a glob of two layers: both.
  every = jl.trace(model, v, X, intervene=jl.when(jl.module("blocks/up"), jl.scale(0.0)))
  flat_every = jl.trace(flat, fv, X, intervene=jl.when(jl.module("blocks_*/up"), jl.scale(0.0)))
  np.testing.assert_allclose(every.output, flat_every.output, atol=1e-12)
  two = jl.module("blocks/up", layer=0) | jl.module("blocks/up", layer=2)
  flat_two = jl.module("blocks_0/up") | jl.module("blocks_2/up")
  np.testing.assert_allclose(
    jl.when(two, jl.steer(jnp.ones(4), 1.5)).bind(model)(v, X),
    jl.when(flat_two, jl.steer(jnp.ones(4), 1.5)).bind(flat)(fv, X),
    atol=1e-12,
  )
  with pytest.raises(jl.SiteError, match=r"\[unknown_site\].*layer 7 is out of range.*3 layers"):
    jl.trace(model, v, X, intervene=jl.when(jl.module("blocks/up", layer=7), jl.zero_ablate()))
  with pytest.raises(jl.InvalidArgumentError, match=r"(?s)\[invalid_site\].*layer=0"):
    jl.module("blocks/up", layer=-1)
  # The scanned Block itself returns (carry, None): not an array site.
  with pytest.raises(jl.InvalidArgumentError, match=r"\[site_not_array\]"):
    jl.trace(model, v, X, intervene=jl.when(jl.module("blocks", layer=1), jl.zero_ablate()))


def test_keep_grad_at_a_scanned_layer(models):
  model, v, _, _ = models
  f = jl.when(SCAN_SITE, ji.keep_grad(jl.zero_ablate())).bind(model)
  with pytest.raises(jl.GradientContractError, match=r"\[edit_detached_from_graph\]"):
    f(v, X)
  g = jax.grad(lambda v: jl.when(SCAN_SITE, ji.keep_grad(jl.scale(0.5))).bind(model)(v, X).sum())
  assert np.abs(g(v)["params"]["inp"]["kernel"]).max() > 0


def test_vmap_over_edit_values_and_no_recompile(models):
  model, v, flat, fv = models

  @jax.jit
  @chex.assert_max_traces(n=1)
  def run(alpha, direction):
    return jl.when(SCAN_SITE, jl.steer(direction, alpha)).bind(model)(v, X)

  alphas = jnp.linspace(0.0, 2.0, 5)
  d = jnp.asarray([1.0, 0.0, -1.0, 0.5])
  batched = jax.vmap(run, (0, None))(alphas, d)
  for k, a in enumerate(alphas):
    ref = jl.when(FLAT_SITE, jl.steer(d, a)).bind(flat)(fv, X)
    np.testing.assert_allclose(batched[k], ref, atol=1e-12)
  chex.clear_trace_counter()
  run(1.0, d)
  run(2.0, -d)  # new values, same compiled call


def test_reverse_scan_layer_index_is_the_parameter_index():
  class Rev(nn.Module):
    @nn.compact
    def __call__(self, x):
      stack = nn.scan(
        Block, variable_axes={"params": 0}, split_rngs={"params": True}, length=L, reverse=True
      )
      return stack(name="blocks")(x, None)[0]

  model = Rev()
  v = model.init(jax.random.key(0), X)
  p = v["params"]["blocks"]

  def manual(edit_layer):
    x = X
    for k in reversed(range(L)):
      pk = jax.tree.map(lambda a, k=k: a[k], p)
      h = jnp.tanh(x @ pk["up"]["kernel"] + pk["up"]["bias"])
      if k == edit_layer:
        h = jnp.tanh(jnp.zeros_like(x))
      x = x + h @ pk["down"]["kernel"] + pk["down"]["bias"]
    return x

  for k in range(L):
    out = jl.when(jl.module("blocks/up", layer=k), jl.zero_ablate()).bind(model)(v, X)
    np.testing.assert_allclose(out, manual(k), atol=1e-12)


class NnxBlock(nnx.Module):
  def __init__(self, rngs):
    self.up = nnx.Linear(4, 4, rngs=rngs, param_dtype=jnp.float64)
    self.down = nnx.Linear(4, 4, rngs=rngs, param_dtype=jnp.float64)

  def __call__(self, x):
    return x + self.down(jnp.tanh(self.up(x)))


class NnxScanned(nnx.Module):
  def __init__(self, rngs):
    self.inp = nnx.Linear(4, 4, rngs=rngs, param_dtype=jnp.float64)

    @nnx.split_rngs(splits=L)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def make(rngs):
      return NnxBlock(rngs)

    self.blocks = make(rngs)
    self.head = nnx.Linear(4, 2, rngs=rngs, param_dtype=jnp.float64)

  def __call__(self, x):
    @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
    def step(x, block):
      return block(x)

    return self.head(step(self.inp(x), self.blocks))


def _linen_from_nnx(m):
  lin = lambda mod: {"kernel": mod.kernel.value, "bias": mod.bias.value}
  p = {"inp": lin(m.inp), "head": lin(m.head)}
  for k in range(L):
    p[f"blocks_{k}"] = {
      name: jax.tree.map(lambda a, k=k: a[k], lin(getattr(m.blocks, name)))
      for name in ("up", "down")
    }
  return {"params": p}


@functools.cache
def _nnx_model():
  """The nnx model split, its parameters as the unrolled linen model's, and the shape of its
  ``blocks/up`` site in a trace (saved stacked), for the module."""
  m = NnxScanned(nnx.Rngs(0))
  graphdef, state = nnx.split(m)
  stacked = jl.trace(m, X)["blocks/up"].out.shape
  return graphdef, state, _linen_from_nnx(m), stacked


NNX_DOORS = {
  "live_bind": lambda m, s, e: jl.when(s, e).bind(m)(X),
  "live_trace": lambda m, s, e: jl.trace(m, X, intervene=jl.when(s, e)).output,
  "replay": lambda m, s, e: jl.trace(m, X).fork().do(s, e).output,
}


@pytest.mark.parametrize("door", list(NNX_DOORS))
@pytest.mark.parametrize("verb", ["zero_ablate", "steer", "patch_from", "scale"])
def test_nnx_scan_layer_edit_matches_the_unrolled_linen_model(door, verb):
  graphdef, state, fv, stacked = _nnx_model()
  flat = Unrolled()

  def edit(model, *v):
    if verb == "zero_ablate":
      return jl.zero_ablate()
    if verb == "steer":
      return jl.steer(jnp.asarray([1.0, -1.0, 0.0, 2.0]), 0.5)
    if verb == "scale":
      return jl.scale(0.25)
    return jl.patch_from(jl.trace(model, *v, X_DONOR))

  def nnx_out(state):
    mm = nnx.merge(graphdef, state)
    return NNX_DOORS[door](mm, jl.module("blocks/down", layer=2), edit(mm))

  def flat_out(v):
    return DOORS[door](flat, v, jl.module("blocks_2/down"), edit(flat, v))

  def value_and_grad(fn, x):
    return jax.value_and_grad(lambda x: (lambda o: (o.sum(), o))(fn(x)), has_aux=True)(x)

  # Both models, their outputs and gradients, in one jitted program (an eager scan compiles
  # its body at every call).
  ((_, out), g), ((_, ref), g_ref) = jax.jit(
    lambda state, fv: (value_and_grad(nnx_out, state), value_and_grad(flat_out, fv))
  )(state, fv)
  np.testing.assert_allclose(out, ref, atol=1e-12, rtol=0)
  np.testing.assert_allclose(g["inp"]["kernel"].value, g_ref["params"]["inp"]["kernel"], atol=1e-12)
  for k in range(L):
    np.testing.assert_allclose(
      g["blocks"]["up"]["kernel"].value[k],
      g_ref["params"][f"blocks_{k}"]["up"]["kernel"],
      atol=1e-12,
    )
  assert stacked == (L, 3, 4)


def test_every_layer_on_the_interceptor_door(models):
  # Without layer=, bind runs the Flax interceptor inside the scan body: every layer.
  model, v, flat, fv = models
  e = jl.steer(jnp.ones(4), 2.0)
  got = jl.when(jl.module("blocks/up"), e).bind(model)(v, X)
  want = jl.when(jl.module("blocks_*/up"), e).bind(flat)(fv, X)
  np.testing.assert_allclose(got, want, atol=1e-12, rtol=0)
  m = NnxScanned(nnx.Rngs(0))
  np.testing.assert_allclose(
    jl.when(jl.module("blocks/up"), jl.scale(0.0)).bind(m)(X),
    jl.trace(m, X, intervene=jl.when(jl.module("blocks/up"), jl.scale(0.0))).output,
    atol=1e-12,
    rtol=0,
  )


def test_a_saved_spec_keeps_the_layer_and_the_call(models, tmp_path):
  """Regression: jl.module("blocks/up", layer=k) came back from save/load as every layer."""
  model, v, _, _ = models
  spec = jl.when(SCAN_SITE, jl.scale(0.0)) + jl.when(jl.module("blocks/up", call=1), jl.scale(1.0))
  loaded = jl.load_spec(spec.save(tmp_path / "s"))
  assert loaded.rules[0][0] == SCAN_SITE and loaded.rules[1][0].call == 1
  np.testing.assert_array_equal(loaded.bind(model)(v, X), spec.bind(model)(v, X))
  every_layer = jl.when(jl.module("blocks/up"), jl.scale(0.0)).bind(model)(v, X)
  assert not np.allclose(loaded.bind(model)(v, X), every_layer)
