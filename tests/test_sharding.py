"""jaxlens under jax.sharding, on the 8 simulated CPU devices of tests/conftest.py.

A float64 residual MLP runs on a ``(data=4, model=2)`` mesh with the batch split over
``data`` and every Dense kernel split on its output axis over ``model`` (tensor
parallelism), in both of jax's mesh modes (``Auto``: XLA propagates shardings;
``Explicit``: shardings are part of the types). Traces, live edits, replay and
patch_from give the values they give on one device, edit arrays may carry their own
shardings, and what a jitted door returns keeps the batch split. The built-in GPT is
checked the same way on an Auto mesh (its token embedding is a gather that explicit
mode refuses in flax itself, with or without jaxlens).
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxlens as jl
from jaxlens import models

BATCH, SEQ, WIDTH, HIDDEN = 8, 4, 8, 16
SITE = jl.module("block_0")
ATOL = 1e-12


class Block(nn.Module):
  """``x + down(tanh(up(x)))``: the sites ``block_i``, ``block_i/up``, ``block_i/down``."""

  @nn.compact
  def __call__(self, x):
    h = nn.Dense(HIDDEN, param_dtype=jnp.float64, name="up")(x)
    return x + nn.Dense(WIDTH, param_dtype=jnp.float64, name="down")(jnp.tanh(h))


class Net(nn.Module):
  @nn.compact
  def __call__(self, x):
    for i in range(2):
      x = Block(name=f"block_{i}")(x)
    return nn.Dense(4, param_dtype=jnp.float64, name="head")(x)


def _param_spec(path, leaf):
  """Dense kernels split on their output axis, biases alike, everything else replicated."""
  name = path[-1].key
  if name == "kernel" and leaf.shape[-1] % 2 == 0:
    return P(None, "model")
  if name == "bias" and leaf.shape[0] % 2 == 0:
    return P("model")
  return P()


def shard_variables(variables, mesh):
  return jax.tree_util.tree_map_with_path(
    lambda path, a: jax.device_put(a, NamedSharding(mesh, _param_spec(path, a))), variables
  )


def put(a, mesh, *spec):
  return jax.device_put(a, NamedSharding(mesh, P(*spec)))


def batch_split(a) -> bool:
  """Whether ``a``'s leading (batch) axis is split four ways, over the data axis."""
  return a.sharding.shard_shape(a.shape)[0] == a.shape[0] // 4


def assert_close(a, b, atol=ATOL):
  np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=atol)


@pytest.fixture(scope="module", params=["auto", "explicit"])
def net(request):
  """(mesh, model, variables, x, sharded variables, sharded x) on one mesh mode."""
  kind = {"auto": AxisType.Auto, "explicit": AxisType.Explicit}[request.param]
  mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(kind, kind))
  model = Net()
  x = jax.random.normal(jax.random.key(0), (BATCH, SEQ, WIDTH), jnp.float64)
  variables = jax.jit(model.init)(jax.random.key(1), x)
  return mesh, model, variables, x, shard_variables(variables, mesh), put(x, mesh, "data")


def test_inputs_are_split_as_intended(net):
  mesh, _, _, _, sv, sx = net
  assert len(mesh.devices.flat) == 8
  kernel = sv["params"]["block_0"]["up"]["kernel"]
  assert kernel.sharding.shard_shape(kernel.shape) == (WIDTH, HIDDEN // 2)
  assert batch_split(sx)


def test_trace_matches_one_device(net):
  _, model, v, x, sv, sx = net
  capture = jax.jit(lambda v, x: jl.trace(model, v, x))
  one, split = capture(v, x), capture(sv, sx)
  eager = jl.trace(model, sv, sx)
  assert split.labels == one.labels == eager.labels
  for t in (split, eager):
    assert_close(t.output, one.output)
    assert batch_split(t.output)
    for label in one.labels:
      assert_close(t[label].out, one[label].out)
      assert batch_split(t[label].out), label


def _edits(mesh):
  """name -> (edit on one device, the same edit with arrays placed on the mesh)."""
  rng = np.random.default_rng(0)
  direction = rng.normal(size=WIDTH)
  donor = rng.normal(size=(BATCH, SEQ, WIDTH))
  basis = np.linalg.qr(rng.normal(size=(WIDTH, 2)))[0]
  mask = rng.random((BATCH, SEQ, WIDTH)) < 0.5
  positions = np.array([1, 3], np.int32)
  one = dict(
    direction=jnp.asarray(direction),
    donor=jnp.asarray(donor),
    basis=jnp.asarray(basis),
    mask=jnp.asarray(mask),
    positions=jnp.asarray(positions),
  )
  split = dict(
    direction=put(one["direction"], mesh, "model"),
    donor=put(one["donor"], mesh, "data", None, "model"),
    basis=put(one["basis"], mesh, "model", None),
    mask=put(one["mask"], mesh, "data"),
    positions=put(one["positions"], mesh),
  )

  def build(a):
    return {
      "steer": jl.when(SITE, jl.steer(a["direction"], 2.0, feature_axis=-1)),
      "at_positions_patch": jl.when(
        SITE, jl.at_positions(a["positions"], jl.patch_from(a["donor"]))
      ),
      "subspace_zero": jl.when(jl.subspace(SITE, a["basis"]), jl.scale(0.0)),
      "units_scale": jl.when(jl.units(SITE, a["mask"]), jl.scale(3.0)),
      "replace_with": jl.when(SITE, jl.replace_with(a["donor"])),
    }

  b1, b8 = build(one), build(split)
  return {name: (b1[name], b8[name]) for name in b1}


@pytest.fixture(scope="module")
def plain_grad(net):
  """The unedited model's gradient of ``sum(out ** 2)`` on the mesh."""
  _, model, _, _, sv, sx = net
  return jax.jit(jax.grad(lambda v, x: jnp.sum(model.apply(v, x) ** 2)))(sv, sx)


EDIT_NAMES = ["steer", "at_positions_patch", "subspace_zero", "units_scale", "replace_with"]


@pytest.mark.parametrize("name", EDIT_NAMES)
def test_live_edits_match_one_device(net, plain_grad, name, request):
  mesh, model, v, x, sv, sx = net
  spec1, spec8 = _edits(mesh)[name]

  def loss(v, x, spec):
    out = spec.bind(model)(v, x)
    return jnp.sum(out**2), out

  run = jax.jit(jax.grad(loss, has_aux=True))
  (g1, out1), (g8, out8) = run(v, x, spec1), run(sv, sx, spec8)
  assert_close(out8, out1)
  assert batch_split(out8)
  assert not np.allclose(out1, model.apply(v, x))  # the edit is live
  jax.tree.map(assert_close, g8, g1)
  # The edit does not move the parameter gradients: they are split as the unedited
  # model's are (under Auto, XLA picks that split; under Explicit, the parameters' types).
  # A gradient a cutting verb makes identically zero is a constant XLA may place anywhere.
  for g, p in zip(jax.tree.leaves(g8), jax.tree.leaves(plain_grad)):
    if np.any(np.asarray(g)):
      assert g.sharding.shard_shape(g.shape) == p.sharding.shard_shape(p.shape)


def test_replay_matches_one_device(net):
  _, model, v, x, sv, sx = net
  capture = jax.jit(lambda v, x: jl.trace(model, v, x))
  replay = jax.jit(lambda t: t.fork().do(SITE, jl.scale(0.5)))
  one, split = replay(capture(v, x)), replay(capture(sv, sx))
  live = jl.when(SITE, jl.scale(0.5)).bind(model)(v, x)
  assert_close(one.output, live)
  assert_close(split.output, one.output)
  assert batch_split(split.output)
  for label in ("block_0", "block_1", "block_1/up", "head"):
    assert_close(split[label].out, one[label].out)
    assert batch_split(split[label].out), label


def test_patch_from_a_donor_trace_matches_one_device(net):
  mesh, model, v, x, sv, sx = net
  capture = jax.jit(lambda v, x: jl.trace(model, v, x))
  patched = jax.jit(
    lambda v, x, donor: jl.trace(
      model, v, x, intervene=jl.when(jl.module("block_1"), jl.patch_from(donor))
    )
  )
  one = patched(v, x, capture(v, 2.0 * x))
  donor8 = capture(sv, put(2.0 * x, mesh, "data"))
  split = patched(sv, sx, donor8)
  assert_close(split.output, one.output)
  assert_close(split["block_1"].out, donor8["block_1"].out)
  for label in ("block_1", "head"):
    assert batch_split(split[label].out), label
  assert batch_split(split.output)


@pytest.mark.parametrize("spec", [(), (None, None, "model")], ids=["replicated", "model"])
def test_donor_arrays_with_another_sharding_give_the_same_values(net, spec):
  mesh, model, v, x, sv, sx = net
  donor = jnp.linspace(-1.0, 1.0, BATCH * SEQ * WIDTH).reshape(BATCH, SEQ, WIDTH)
  run = jax.jit(
    lambda v, x, d: jl.trace(model, v, x, intervene=jl.when(SITE, jl.patch_from(d)), save=SITE)
  )
  one, split = run(v, x, donor), run(sv, sx, put(donor, mesh, *spec))
  assert_close(split["block_0"].out, donor)
  assert_close(split.output, one.output)


@pytest.mark.parametrize("jitted", [False, True], ids=["eager", "jit"])
def test_a_replicated_donor_is_placed_like_the_site(net, jitted):
  mesh, model, v, x, sv, sx = net
  if jitted and mesh.axis_types[0] == AxisType.Auto:
    pytest.skip("under an Auto mesh XLA places values inside jit; no sharding to match yet")
  donor = put(jnp.zeros((BATCH, SEQ, WIDTH)), mesh)

  def run(v, x, d):
    return jl.trace(model, v, x, intervene=jl.when(SITE, jl.replace_with(d)), save=SITE)

  t = (jax.jit(run) if jitted else run)(sv, sx, donor)
  assert batch_split(t["block_0"].out)
  assert batch_split(t.output)


def test_gpt_under_data_and_tensor_parallelism():
  mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
  model, v, tokens = models.init_gpt(
    jax.random.key(0),
    "small",
    batch=BATCH,
    n_layers=1,
    d_model=32,
    n_heads=4,
    max_len=8,
    dtype=jnp.float32,
  )
  sv, st = shard_variables(v, mesh), put(tokens, mesh, "data")
  capture = jax.jit(lambda v, x: jl.trace(model, v, x))
  replay = jax.jit(lambda t: t.fork().do(jl.module("block_0"), jl.scale(0.5)).output)
  patch = jax.jit(
    lambda v, x, d: jl.when(jl.module("block_0/mlp"), jl.patch_from(d)).bind(model)(v, x)
  )
  t1, t8 = capture(v, tokens), capture(sv, st)
  donor1, donor8 = capture(v, tokens[::-1]), capture(sv, put(tokens[::-1], mesh, "data"))
  pairs = [
    (t8.output, t1.output),
    (replay(t8), replay(t1)),
    (patch(sv, st, donor8), patch(v, tokens, donor1)),
  ]
  for split, one in pairs:
    assert_close(split, one, atol=1e-5)
    assert batch_split(split)
  for label in t1.labels:
    assert_close(t8[label].out, t1[label].out, atol=1e-5)
  for label in ("embed", "block_0/attn/query", "block_0", "head"):
    assert batch_split(t8[label].out), label
