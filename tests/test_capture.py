"""Op-level capture: labels, attribution, selectors, save=, control flow."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxlens as jl
from models_for_tests import MLP, init

X = jnp.linspace(-1.0, 1.0, 12).reshape(3, 4)


@pytest.fixture(scope="module")
def mlp():
  model = MLP()
  return model, init(model, X)


def test_every_op_is_a_labelled_site_attributed_to_its_module(mlp):
  model, v = mlp
  t = jl.trace(model, v, X, save=jl.all_sites())
  by_label = {i.label: i for i in t.sites}
  assert by_label["tanh_1"].path == "block_0/mlp"
  assert by_label["dot_general_1"].path == "block_0/mlp/fc"
  assert by_label["dot_general_3"].path == "shared"
  assert by_label["tanh_3"].path == ""  # the jnp.tanh between the shared calls
  assert by_label["block_0/mlp"].kind == "module"
  assert [i.label for i in t.sites if i.func == "dot_general"] == [
    f"dot_general_{k}" for k in range(1, 6)
  ]
  # Saved op values are the values the ops computed.
  np.testing.assert_allclose(t["tanh_1"].out, jnp.tanh(X), atol=0)
  fc = v["params"]["block_0"]["mlp"]["fc"]
  np.testing.assert_allclose(t["dot_general_1"].out, jnp.tanh(X) @ fc["kernel"], atol=1e-12)


def test_op_selectors_combine_with_module_ones(mlp):
  model, v = mlp
  t = jl.trace(model, v, X, save=jl.func("tanh"))
  assert t.labels == ("tanh_1", "tanh_2", "tanh_3")
  t = jl.trace(model, v, X, save=jl.func("tanh") & jl.in_module("block_1"))
  assert t.labels == ("tanh_2",)
  t = jl.trace(model, v, X, save=jl.label("add_2") | jl.module("head"))
  assert t.labels == ("add_2", "head")
  t = jl.trace(model, v, X, save=jl.in_module("block_0/mlp") & jl.func("dot_*"))
  assert t.labels == ("dot_general_1",)


def test_edit_at_an_op_site_on_every_live_door(mlp):
  model, v = mlp
  sel = jl.func("tanh") & jl.in_module("block_1")
  spec = jl.when(sel, jl.zero_ablate())
  t = jl.trace(model, v, X, intervene=spec)
  bias = v["params"]["block_1"]["mlp"]["fc"]["bias"]
  np.testing.assert_allclose(t["block_1/mlp"].out, jnp.broadcast_to(bias, (3, 4)), atol=0)
  np.testing.assert_allclose(spec.bind(model)(v, X), t.output, atol=0)
  np.testing.assert_allclose(jax.jit(spec.bind(model))(v, X), t.output, atol=1e-12)


def test_save_keeps_only_what_it_selects(mlp):
  model, v = mlp
  t = jl.trace(model, v, X, save=jl.module("block_1/mlp"))
  assert t.labels == ("block_1/mlp",)
  assert len(t.values) == 1
  default = jl.trace(model, v, X)
  assert all(i.kind == "module" for i in default.infos.values())
  assert "tanh_1" not in default.labels and "block_0/mlp" in default.labels


def test_unknown_op_site_lists_close_ones(mlp):
  model, v = mlp
  with pytest.raises(jl.SiteError, match=r"\[unknown_site\].*no op 'tanhh'") as info:
    jl.trace(model, v, X, intervene=jl.when(jl.func("tanhh"), jl.scale(2.0)))
  assert "tanh" in info.value.fields["candidates"]


class _Cell(nn.Module):
  @nn.compact
  def __call__(self, c, _):
    return nn.Dense(4, name="dense", param_dtype=jnp.float64)(c), None


class ScanModel(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = nn.Dense(4, name="pre", param_dtype=jnp.float64)(x)
    x, _ = nn.scan(_Cell, variable_axes={"params": 0}, split_rngs={"params": True}, length=2)(
      name="cells"
    )(x, None)
    x, _ = jax.lax.scan(lambda c, _: (jnp.tanh(c), None), x, None, length=3)
    x = nn.cond(
      x.sum() > 0,
      lambda m, y: m(y) * 2.0,
      lambda m, y: -m(y),
      nn.Dense(4, name="gate", param_dtype=jnp.float64),
      x,
    )
    return nn.Dense(2, name="post", param_dtype=jnp.float64)(x)


def test_control_flow_runs_as_op_sites_or_refuses_with_a_typed_error():
  model = ScanModel()
  v = model.init(jax.random.key(0), X)
  t = jl.trace(model, v, X, save=jl.all_sites())
  funcs = [i.func for i in t.sites if i.kind == "op"]
  assert funcs.count("scan") == 2 and funcs.count("cond") == 1
  np.testing.assert_allclose(t.output, model.apply(v, X), atol=1e-12)
  # The scan op site and the modules around it can be edited...
  edited = jl.trace(model, v, X, intervene=jl.when(jl.label("scan_2"), jl.scale(0.0)))
  post = v["params"]["post"]
  np.testing.assert_allclose(edited.output, jnp.broadcast_to(post["bias"], (3, 2)), atol=1e-12)
  jl.trace(model, v, X, intervene=jl.when(jl.module("pre"), jl.scale(2.0)))
  # ... and so can a module in a scanned layer stack (tests/test_scan.py), but a module
  # inside a cond cannot, and saying so is an error.
  jl.trace(model, v, X, intervene=jl.when(jl.module("cells/dense", layer=1), jl.scale(2.0)))
  with pytest.raises(jl.InvalidArgumentError, match=r"\[unsupported_control_flow\].*cond"):
    jl.trace(model, v, X, intervene=jl.when(jl.module("gate"), jl.scale(2.0)))
  with pytest.raises(jl.InvalidArgumentError, match=r"\[unsupported_control_flow\]"):
    jl.trace(model, v, X, save=jl.module("gate"))


def test_trace_under_grad_jit_vmap_matches_apply(mlp):
  model, v = mlp
  f = lambda v, x: jl.trace(model, v, x, save=jl.func("tanh")).output.sum()
  g = lambda v, x: model.apply(v, x).sum()
  for a, b in zip(jax.tree.leaves(jax.jit(jax.grad(f))(v, X)), jax.tree.leaves(jax.grad(g)(v, X))):
    np.testing.assert_allclose(a, b, atol=1e-12)
  xs = jnp.stack([X, -X])
  np.testing.assert_allclose(
    jax.vmap(f, (None, 0))(v, xs), jax.vmap(g, (None, 0))(v, xs), atol=1e-12
  )


class _RematBlock(nn.Module):
  @nn.compact
  def __call__(self, x):
    return x + nn.Dense(4, name="fc", param_dtype=jnp.float64)(jnp.tanh(x))


class RematModel(nn.Module):
  @nn.compact
  def __call__(self, x):
    for i in range(2):
      x = nn.remat(_RematBlock)(name=f"block_{i}")(x)
    x = jax.checkpoint(lambda y: jnp.sin(y) * 2.0)(x)
    return nn.Dense(1, name="head", param_dtype=jnp.float64)(x)


def test_edits_under_remat_on_every_door():
  model = RematModel()
  v = model.init(jax.random.key(0), X)
  spec = jl.when(jl.module("block_1/fc"), jl.scale(0.0))
  t = jl.trace(model, v, X, intervene=spec)
  assert t.labels == ("block_0/fc", "block_0", "block_1/fc", "block_1", "head")
  assert "sin_1" in {i.label for i in t.sites}
  np.testing.assert_allclose(spec.bind(model)(v, X), t.output, atol=1e-12)
  np.testing.assert_allclose(
    jl.trace(model, v, X).do(jl.module("block_1/fc"), jl.scale(0.0)).output, t.output, atol=1e-12
  )
  g_live = jax.grad(lambda v: spec.bind(model)(v, X).sum())(v)
  g_trace = jax.grad(lambda v: jl.trace(model, v, X, intervene=spec).output.sum())(v)
  for a, b in zip(jax.tree.leaves(g_live), jax.tree.leaves(g_trace)):
    np.testing.assert_allclose(a, b, atol=1e-12)
  assert np.all(g_live["params"]["block_1"]["fc"]["kernel"] == 0)


class _Runs:
  """A field compared by identity: where a module's Python runs record themselves."""

  def __init__(self):
    self.shapes = []

  def __len__(self):
    return len(self.shapes)


class _Counted(nn.Module):
  """Counts how often its Python runs (a capture runs it once)."""

  features: int
  calls: _Runs
  sizes: tuple = (1, 2)  # a sequence field (linen makes lists tuples)

  @nn.compact
  def __call__(self, x, scale=1.0, *, shift=None):
    self.calls.shapes.append(x.shape)
    # Inputs of any float dtype: the cast is part of the program, so a dtype is a new one.
    y = nn.Dense(self.features, param_dtype=jnp.float64)(x.astype(jnp.float64)) * scale
    return y if shift is None else y + shift


def test_a_models_program_is_captured_once_per_input_shape_and_static_argument():
  calls = _Runs()
  model = _Counted(3, calls)
  v = model.init(jax.random.key(0), X)
  jl.clear_caches()

  def runs(*args, **kwargs):
    """How often the model's Python ran for one trace, and the trace."""
    before = len(calls)
    t = jl.trace(*args, **kwargs)
    return len(calls) - before, t

  assert runs(model, v, X)[0] == 1
  n, again = runs(model, v, X + 1.0, save="Dense_0")
  assert n == 0
  dense = v["params"]["Dense_0"]
  np.testing.assert_allclose(again["Dense_0"].out, (X + 1.0) @ dense["kernel"] + dense["bias"])
  # New variables of the same shapes reuse it; their values are used.
  v2 = jax.tree.map(lambda a: a * 2.0, v)
  n, t = runs(model, v2, X)
  assert n == 0
  np.testing.assert_allclose(t.output, model.apply(v2, X), atol=1e-12)
  # Another input shape, static keyword or dtype is captured again, once.
  assert runs(model, v, X[:2])[0] == 1
  assert [runs(model, v, X, scale=2.0)[0] for _ in range(2)] == [1, 0]
  np.testing.assert_allclose(runs(model, v, X, scale=2.0)[1].output, model.apply(v, X, 2.0))
  assert runs(model, v, X.astype(jnp.float32))[0] == 1
  # An equal module (same class and fields) shares it; another configuration does not.
  assert runs(_Counted(3, calls, sizes=(1, 2)), v, X)[0] == 0
  other = _Counted(2, calls)
  assert runs(other, other.init(jax.random.key(1), X), X)[0] == 1
  jl.clear_caches()
  assert runs(model, v, X)[0] == 1


def test_an_array_argument_is_never_baked_into_a_reused_program():
  calls = _Runs()
  model = _Counted(3, calls)
  v = model.init(jax.random.key(0), X)
  for shift in (jnp.zeros(3), jnp.ones(3)):
    out = jl.trace(model, v, X, shift=shift).output
    np.testing.assert_allclose(out, model.apply(v, X, shift=shift), atol=1e-12)
  # Under jit the inputs are tracers; the program is still reused and right.
  step = jax.jit(lambda v, x: jl.trace(model, v, x).output)
  np.testing.assert_allclose(step(v, X), model.apply(v, X), atol=1e-12)
  np.testing.assert_allclose(step(v, X * 3.0), model.apply(v, X * 3.0), atol=1e-12)


def test_a_program_built_under_another_interceptor_is_not_reused():
  calls = _Runs()
  model = _Counted(3, calls)
  v = model.init(jax.random.key(0), X)
  jl.clear_caches()

  def double_dense(next_fun, args, kwargs, context):
    out = next_fun(*args, **kwargs)
    return out * 2.0 if isinstance(context.module, nn.Dense) else out

  with nn.intercept_methods(double_dense):
    inside = jl.trace(model, v, X).output
  outside = jl.trace(model, v, X).output
  np.testing.assert_allclose(inside, 2.0 * outside, atol=1e-12)
  np.testing.assert_allclose(outside, model.apply(v, X), atol=1e-12)


def test_an_nnx_models_program_follows_its_static_attributes():
  from flax import nnx

  class Gated(nnx.Module):
    def __init__(self, rngs):
      self.dense = nnx.Linear(4, 3, dtype=jnp.float64, param_dtype=jnp.float64, rngs=rngs)
      self.negate = False
      self.runs = 0

    def __call__(self, x):
      y = self.dense(x)
      return -y if self.negate else y

  model = Gated(nnx.Rngs(0))
  jl.clear_caches()
  plain = jl.trace(model, X).output
  model.negate = True  # a static attribute: part of the graph definition, so a new program
  np.testing.assert_allclose(jl.trace(model, X).output, -plain, atol=1e-12)
