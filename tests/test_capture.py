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
