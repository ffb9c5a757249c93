"""The live doors under jit, grad, vmap and their compositions; sites, specs, traces."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxlens as jl
from jaxlens.intervention import InterventionDecision, keep_grad
from models_for_tests import MLP, init

SITE = jl.module("layers_0")
D = jnp.asarray([1.0, -2.0, 0.5, 3.0])


def _hand_steer(model, variables, x, path=("layers_0",), magnitude=2.0):
  def icpt(next_fun, args, kwargs, context):
    out = next_fun(*args, **kwargs)
    return out + magnitude * D if context.module.path == path else out

  with nn.intercept_methods(icpt):
    return model.apply(variables, x)


def test_bound_and_unbound_bind_agree(spec_model):
  model, variables, x, _, _ = spec_model
  spec = jl.when(SITE, jl.steer(D, 2.0))
  bound = spec.bind(model.bind(variables))(x)
  unbound = spec.bind(model)(variables, x)
  hand = _hand_steer(model, variables, x)
  assert np.array_equal(bound, unbound)
  np.testing.assert_allclose(bound, hand, atol=1e-12, rtol=0)
  t = jl.trace(model.bind(variables), x, intervene=spec)
  assert np.array_equal(t.output, bound)
  assert np.array_equal(t[t.output_layers[0]].out, bound)


def test_trace_is_a_pytree_that_leaves_jit(spec_model):
  model, variables, x, _, _ = spec_model
  t = jax.jit(lambda v, xi: jl.trace(model, v, xi, intervene=jl.when(SITE, jl.scale(3.0))))(
    variables, x
  )
  assert isinstance(t, jl.Trace)
  assert t.labels == ("layers_0", "layers_1")
  np.testing.assert_allclose(
    t["layers_0"].out,
    3.0 * model.apply(variables, x, method=lambda m, y: m.layers[0](y)),
    atol=1e-12,
  )
  leaves = jax.tree.leaves(t)
  # output, two saved sites, the call's five input leaves and the edit's factor.
  assert len(leaves) == 1 + 2 + 5 + 1
  same = jax.tree.map(lambda a: a * 1, t)
  assert same.labels == t.labels and np.array_equal(same.output, t.output)


def _loss_fns(model, x):
  spec = jl.when(SITE, jl.steer(D, 2.0))
  ours = lambda v: spec.bind(model)(v, x).sum()
  hand = lambda v: _hand_steer(model, v, x).sum()
  return ours, hand


@pytest.mark.parametrize("transform", ["grad", "jit(grad)", "grad(jit)", "jit(grad(jit))"])
def test_grad_compositions(spec_model, transform):
  model, variables, x, _, _ = spec_model
  ours, hand = _loss_fns(model, x)
  wrap = {
    "grad": lambda f: jax.grad(f),
    "jit(grad)": lambda f: jax.jit(jax.grad(f)),
    "grad(jit)": lambda f: jax.grad(jax.jit(f)),
    "jit(grad(jit))": lambda f: jax.jit(jax.grad(jax.jit(f))),
  }[transform]
  got, want = wrap(ours)(variables), jax.grad(hand)(variables)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(a, b, atol=1e-12, rtol=0)


@pytest.mark.parametrize("order", ["vmap(grad)", "grad(vmap)", "jit(vmap(grad))", "vmap(jit)"])
def test_vmap_compositions(spec_model, order):
  model, variables, x, _, _ = spec_model
  xs = jnp.stack([x, 2 * x, -x])
  spec = jl.when(SITE, jl.steer(D, 2.0))
  ours = lambda v, xi: spec.bind(model)(v, xi).sum()
  hand = lambda v, xi: _hand_steer(model, v, xi).sum()
  if order == "vmap(grad)":
    got = jax.vmap(jax.grad(ours), (None, 0))(variables, xs)
    want = jax.vmap(jax.grad(hand), (None, 0))(variables, xs)
  elif order == "grad(vmap)":
    got = jax.grad(lambda v: jax.vmap(ours, (None, 0))(v, xs).sum())(variables)
    want = jax.grad(lambda v: jax.vmap(hand, (None, 0))(v, xs).sum())(variables)
  elif order == "jit(vmap(grad))":
    got = jax.jit(jax.vmap(jax.grad(ours), (None, 0)))(variables, xs)
    want = jax.vmap(jax.grad(hand), (None, 0))(variables, xs)
  else:
    got = jax.vmap(jax.jit(ours), (None, 0))(variables, xs)
    want = jax.vmap(hand, (None, 0))(variables, xs)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(a, b, atol=1e-12, rtol=0)


def test_vmap_over_edit_values(spec_model):
  model, variables, x, _, _ = spec_model
  mags = jnp.asarray([0.0, 1.0, 2.0])
  got = jax.vmap(lambda m: jl.when(SITE, jl.steer(D, m)).bind(model)(variables, x))(mags)
  for i, m in enumerate(mags):
    np.testing.assert_allclose(got[i], _hand_steer(model, variables, x, magnitude=m), atol=1e-12)


@pytest.mark.parametrize("transform", ["eager", "grad", "jit(grad)", "grad(jit)", "vmap"])
def test_keep_grad_answers_the_same_under_every_transform(spec_model, transform):
  model, variables, x, _, _ = spec_model

  def run(edit):
    f = lambda v, xi: jl.when(SITE, keep_grad(edit)).bind(model)(v, xi).sum()
    if transform == "eager":
      return f(variables, x)
    if transform == "grad":
      return jax.grad(f)(variables, x)
    if transform == "jit(grad)":
      return jax.jit(jax.grad(f))(variables, x)
    if transform == "grad(jit)":
      return jax.grad(jax.jit(f))(variables, x)
    return jax.vmap(f, (None, 0))(variables, jnp.stack([x, x]))

  run(jl.scale(0.0))
  with pytest.raises(jl.GradientContractError, match="edit_detached_from_graph"):
    run(jl.zero_ablate())


def test_keep_grad_scale_zero_gives_zero_gradient_not_none(spec_model):
  model, variables, x, _, _ = spec_model
  f = lambda v: jl.when(SITE, keep_grad(jl.scale(0.0))).bind(model)(v, x).sum()
  g = jax.grad(f)(variables)
  assert np.all(g["params"]["layers_0"]["kernel"] == 0)
  assert jl.depends_on(f, variables)["params"]["layers_0"]["kernel"]


def test_intervention_decision_runs_the_same_check(spec_model):
  model, variables, x, _, _ = spec_model
  with pytest.raises(jl.GradientContractError, match="edit_detached_from_graph"):
    jl.trace(
      model,
      variables,
      x,
      intervene=jl.when(SITE, InterventionDecision(jl.zero_ablate(), keep_grad=True)),
    )
  jl.trace(model, variables, x, intervene=jl.when(SITE, InterventionDecision(jl.zero_ablate())))
  # A hook can ask for the check on the value it returns.
  with pytest.raises(jl.GradientContractError, match="edit_detached_from_graph"):
    jl.trace(
      model,
      variables,
      x,
      intervene=jl.when(SITE, lambda y: InterventionDecision(jnp.zeros_like(y), keep_grad=True)),
    )
  t = jl.trace(
    model,
    variables,
    x,
    intervene=jl.when(SITE, lambda y: InterventionDecision(2 * y, keep_grad=True)),
  )
  np.testing.assert_allclose(t["layers_0"].out, 2 * jl.trace(model, variables, x)["layers_0"].out)


def test_hook_gets_the_site_context(spec_model):
  model, variables, x, _, _ = spec_model
  seen = []

  def hook_fn(y, *, hook):
    seen.append((hook.label, hook.module_type))
    return y

  jl.trace(model, variables, x, intervene=jl.when(jl.module("layers_*"), hook_fn))
  assert seen == [("layers_0", "Dense"), ("layers_1", "Dense")]


def test_nested_paths_combined_selectors_and_repeated_calls():
  model = MLP()
  x = jnp.linspace(-1, 1, 12).reshape(3, 4)
  v = init(model, x)
  t = jl.trace(model, v, x)
  assert t.labels == (
    "block_0/mlp/fc",
    "block_0/mlp",
    "block_0",
    "block_1/mlp/fc",
    "block_1/mlp",
    "block_1",
    "shared",
    "shared:2",
    "head",
  )
  # Only the second call of the shared module.
  t2 = jl.trace(model, v, x, intervene=jl.when(jl.module("shared", call=2), jl.zero_ablate()))
  assert np.array_equal(t2["shared"].out, t["shared"].out)
  assert np.all(t2["shared:2"].out == 0)
  # Both calls.
  t3 = jl.trace(model, v, x, intervene=jl.when(jl.module("shared"), jl.zero_ablate()))
  assert np.all(t3["shared"].out == 0) and np.all(t3["shared:2"].out == 0)
  # | selects both blocks' mlp; & narrows a glob.
  sel = jl.module("block_0/mlp") | jl.module("block_1/mlp")
  t4 = jl.trace(model, v, x, intervene=jl.when(sel, jl.zero_ablate()))
  assert np.all(t4["block_0/mlp"].out == 0) and np.all(t4["block_1/mlp"].out == 0)
  np.testing.assert_allclose(t4["block_1"].out, t4["block_0"].out, atol=0)
  sel2 = jl.module("block_*/mlp") & jl.module("block_1/mlp")
  t5 = jl.trace(model, v, x, intervene=jl.when(sel2, jl.zero_ablate()))
  assert not np.all(t5["block_0/mlp"].out == 0) and np.all(t5["block_1/mlp"].out == 0)


def test_specs_combine_and_apply_in_order(spec_model):
  model, variables, x, _, _ = spec_model
  clean = jl.trace(model, variables, x)["layers_0"].out
  a = jl.when(SITE, jl.scale(2.0)) + jl.when(SITE, jl.add(1.0))
  b = [jl.when(SITE, jl.add(1.0)), jl.when(SITE, jl.scale(2.0))]
  np.testing.assert_allclose(
    jl.trace(model, variables, x, intervene=a)["layers_0"].out, 2 * clean + 1, atol=1e-12
  )
  np.testing.assert_allclose(
    jl.trace(model, variables, x, intervene=b)["layers_0"].out, 2 * (clean + 1), atol=1e-12
  )


def test_save_selects_what_is_kept(spec_model):
  model, variables, x, _, _ = spec_model
  assert jl.trace(model, variables, x, save=False).labels == ()
  assert jl.trace(model, variables, x, save=jl.module("layers_1")).labels == ("layers_1",)
  assert jl.trace(model, variables, x, save=["layers_0", "layers_1"]).labels == (
    "layers_0",
    "layers_1",
  )


def test_swap_with_an_earlier_site():
  model = MLP()
  x = jnp.linspace(-1, 1, 12).reshape(3, 4)
  v = init(model, x)
  t = jl.trace(
    model, v, x, intervene=jl.when(jl.module("block_1/mlp"), jl.swap_with(jl.module("block_0/mlp")))
  )
  assert np.array_equal(t["block_1/mlp"].out, t["block_0/mlp"].out)


def test_depends_on_audits_parameters(spec_model):
  model, variables, x, _, _ = spec_model
  f = lambda v: jl.when(SITE, jl.zero_ablate()).bind(model)(v, x).sum()
  dep = jl.depends_on(f, variables)
  assert dep["params"]["layers_0"] == {"bias": False, "kernel": False}
  assert dep["params"]["layers_1"] == {"bias": True, "kernel": True}
  assert jl.depends_on(lambda a, b: a * 0.0 + jnp.sin(b), 1.0, 2.0, argnums=1) is True
  # Control flow: cond is analysed branch by branch.
  g = lambda p: jax.lax.cond(True, lambda q: q["a"] * 2, lambda q: q["a"] * 3, p)
  assert jl.depends_on(g, {"a": 1.0, "b": 2.0}) == {"a": True, "b": False}


class _TupleLayer(nn.Module):
  """A layer written like a Hugging Face decoder layer: it returns a tuple."""

  @nn.compact
  def __call__(self, x):
    h = nn.Dense(4, param_dtype=jnp.float64)(x)
    return h, jnp.tanh(h)


class _TupleModel(nn.Module):
  @nn.compact
  def __call__(self, x):
    h, aux = _TupleLayer(name="layer")(x)
    return nn.Dense(2, param_dtype=jnp.float64)(h + aux)


def test_one_element_of_a_tuple_output_on_every_door():
  model, x = _TupleModel(), jnp.linspace(-1.0, 1.0, 8).reshape(2, 4)
  v = model.init(jax.random.key(0), x)
  site = jl.module("layer", output=0)
  edit = jl.scale(0.0)
  h = jl.trace(model, v, x)["layer#0"].out
  head = v["params"]["Dense_0"]
  want = jnp.tanh(h) @ head["kernel"] + head["bias"]  # the first element zeroed, the second kept
  outs = {
    "bind": jl.when(site, edit).bind(model)(v, x),
    "trace": jl.trace(model, v, x, intervene=jl.when(site, edit)).output,
    "replay": jl.trace(model, v, x).fork().do(site, edit).output,
    "rerun": jl.trace(model, v, x).fork().do(site, edit, model=model.bind(v), inputs=x).output,
    "op-site bind": (jl.when(site, edit) + jl.when(jl.func("tanh"), jl.scale(1.0))).bind(model)(
      v, x
    ),
  }
  for door, out in outs.items():
    np.testing.assert_allclose(out, want, atol=1e-12, err_msg=door)
  assert jl.trace(model, v, x, save=site).labels == ("layer#0",)


def test_save_of_a_tuple_module_names_what_ran():
  """Issue 11: save= on a module returning a tuple names it and the spelling that works."""
  model, x = _TupleModel(), jnp.ones((2, 4))
  v = model.init(jax.random.key(0), x)
  with pytest.raises(jl.SiteError, match="returned a tuple") as info:
    jl.trace(model, v, x, save=jl.module("layer"))
  assert info.value.fields["fix"] == "jl.module('layer', output=0)"
  with pytest.raises(jl.InvalidArgumentError, match=r"\[site_not_array\]") as info:
    jl.trace(model, v, x, intervene=jl.when(jl.module("layer"), jl.scale(2.0)))
  assert "output=0" in info.value.fields["fix"]
  with pytest.raises(jl.SiteError, match="select one element") as info:
    jl.trace(model, v, x, save=jl.module("layer", output=5))
  assert info.value.fields["candidates"] == ["layer#0", "layer#1"]
