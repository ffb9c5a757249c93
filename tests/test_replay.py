"""Replay, rerun, set_only + run and differentiable replay."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxlens as jl
from jaxlens import intervention as ji
from jaxlens._src import errors
from models_for_tests import MLP, init

X = jnp.linspace(-1.0, 1.0, 12).reshape(3, 4)
X2 = jnp.cos(jnp.arange(12.0)).reshape(3, 4)
SITE = jl.module("block_0/mlp")
LATER = jl.module("block_1/mlp")
DIFF = jl.InterventionOptions(differentiable=True)
SET_ONLY = jl.InterventionOptions(engine="set_only")


@pytest.fixture(scope="module")
def mlp():
  model = MLP()
  return model, init(model, X)


EDITS = [
  jl.scale(0.5),
  jl.zero_ablate(),
  jl.steer(jnp.arange(4.0), 2.0),
  ji.permute_batch(seed=3),
  jl.add_noise(0.2, seed=1),
  lambda y: y**2,
  jl.replace_with(jnp.ones((3, 4))),
]


@pytest.mark.parametrize("edit", EDITS, ids=lambda e: getattr(e, "name", "hook"))
def test_replay_rerun_and_set_only_equal_live(mlp, edit):
  model, v = mlp
  live = jl.trace(model, v, X, intervene=jl.when(SITE, edit))
  t = jl.trace(model, v, X)
  for got in (
    t.fork().do(SITE, edit),
    t.fork().do(SITE, edit, model=model.bind(v), inputs=X),
    t.fork().do(SITE, edit, intervention=SET_ONLY).run(),
    t.fork().do(SITE, edit, intervention=SET_ONLY).run(model.bind(v), X),
  ):
    np.testing.assert_allclose(got.output, live.output, atol=1e-12)
    for label in live.labels:
      np.testing.assert_allclose(got[label].out, live[label].out, atol=1e-12)


def test_replay_does_not_call_the_model(mlp, monkeypatch):
  model, v = mlp
  t = jl.trace(model, v, X)

  def refuse(*a, **k):
    raise AssertionError("replay called Module.apply")

  monkeypatch.setattr(nn.Module, "apply", refuse)
  t.fork().do(SITE, jl.scale(2.0))


def test_replay_evaluates_only_the_downstream_cone(mlp):
  from jaxlens._src import interpret as capture

  model, v = mlp
  t = jl.trace(model, v, X)
  prog = t._program
  nodes, _, _ = capture._replay_plan(prog, ["block_1/mlp"], t.values)
  modules = {prog.nodes[k].module for k in nodes}
  assert not any(m.startswith("block_0") for m in modules)
  # Every evaluated node that computes on the data runs at or after the edited site;
  # the others only re-derive parameter values (dtype casts, bias reshapes).
  site_k = next(k for k, n in enumerate(prog.nodes) if n.infos[0].label == "block_1/mlp")
  data_nodes = [k for k in nodes if set(prog.nodes[k].outs) & prog.data_ids]
  assert data_nodes and min(data_nodes) == site_k
  skipped = [k for k in range(site_k) if set(prog.nodes[k].outs) & prog.data_ids]
  assert len(skipped) > 10


def test_several_edits_and_an_edit_downstream_of_another(mlp):
  model, v = mlp
  a, b = jl.when(SITE, jl.scale(0.5)), jl.when(LATER, jl.add(1.0))
  live = jl.trace(model, v, X, intervene=a + b)
  t = jl.trace(model, v, X)
  np.testing.assert_allclose(t.do(a + b).output, live.output, atol=1e-12)
  np.testing.assert_allclose(
    t.do(SITE, jl.scale(0.5)).do(LATER, jl.add(1.0)).output, live.output, atol=1e-12
  )
  # Downstream first, then upstream: the downstream edit is re-applied in the cone.
  np.testing.assert_allclose(
    t.do(LATER, jl.add(1.0)).do(SITE, jl.scale(0.5)).output, live.output, atol=1e-12
  )
  # The same site twice stacks.
  twice = t.do(SITE, jl.scale(0.5)).do(SITE, jl.scale(0.5))
  np.testing.assert_allclose(twice["block_0/mlp"].out, 0.25 * t["block_0/mlp"].out, atol=1e-12)


def test_fork_and_do_leave_the_original_unchanged(mlp):
  model, v = mlp
  t = jl.trace(model, v, X)
  before = {k: np.asarray(val) for k, val in t.values.items()}
  out = np.asarray(t.output)
  t.fork().do(SITE, jl.zero_ablate())
  t.do(SITE, jl.zero_ablate())
  t.do(SITE, jl.zero_ablate(), intervention=SET_ONLY)
  assert np.array_equal(t.output, out) and not t.stale
  for k, val in before.items():
    assert np.array_equal(t.values[k], val)


def test_live_edits_persist_through_replay(mlp):
  model, v = mlp
  spec = jl.when(LATER, jl.scale(3.0))
  t = jl.trace(model, v, X, intervene=spec)
  live = jl.trace(model, v, X, intervene=spec + jl.when(SITE, jl.scale(0.5)))
  np.testing.assert_allclose(t.do(SITE, jl.scale(0.5)).output, live.output, atol=1e-12)


def test_gradient_through_replay_equals_live(mlp):
  model, v = mlp
  replayed = lambda v: jl.trace(model, v, X).fork().do(SITE, jl.scale(0.5)).output.sum()
  live = lambda v: jl.when(SITE, jl.scale(0.5)).bind(model)(v, X).sum()
  for a, b in zip(jax.tree.leaves(jax.grad(replayed)(v)), jax.tree.leaves(jax.grad(live)(v))):
    np.testing.assert_allclose(a, b, atol=1e-12)
  jitted = jax.jit(jax.grad(replayed))(v)
  for a, b in zip(jax.tree.leaves(jitted), jax.tree.leaves(jax.grad(live)(v))):
    np.testing.assert_allclose(a, b, atol=1e-12)


def test_rerun_on_new_inputs(mlp):
  model, v = mlp
  t = jl.trace(model, v, X, intervene=jl.when(LATER, jl.scale(3.0)))
  got = t.do(SITE, jl.zero_ablate(), inputs=X2)
  want = jl.trace(
    model, v, X2, intervene=jl.when(LATER, jl.scale(3.0)) + jl.when(SITE, jl.zero_ablate())
  )
  np.testing.assert_allclose(got.output, want.output, atol=1e-12)
  # An unbound model reruns with the trace's own variables.
  np.testing.assert_allclose(
    t.do(SITE, jl.zero_ablate(), model=model, inputs=X2).output, want.output, atol=1e-12
  )


@pytest.mark.parametrize(
  "edit",
  [jl.scale(2.0), lambda y: y + 1.0, jnp.full((3, 4), 0.5)],
  ids=["verb", "callable", "array"],
)
def test_set_only_stages_then_run_executes(mlp, edit):
  model, v = mlp
  t = jl.trace(model, v, X)
  staged = t.do(SITE, edit, intervention=SET_ONLY)
  assert staged.stale
  assert np.array_equal(staged.output, t.output)
  ran = staged.run()
  assert not ran.stale
  live = jl.trace(model, v, X, intervene=jl.when(SITE, edit))
  np.testing.assert_allclose(ran.output, live.output, atol=1e-12)
  # Several staged edits run together.
  two = staged.do(LATER, jl.scale(0.0), intervention=SET_ONLY).run()
  np.testing.assert_allclose(two["block_1/mlp"].out, 0.0, atol=0)


def test_null_patch_leaves_the_output_unchanged_on_every_door(mlp, tmp_path):
  model, v = mlp
  clean = jl.trace(model, v, X)
  patch = jl.patch_from(clean)
  spec = jl.when(SITE, patch)
  outs = {
    "live_trace": jl.trace(model, v, X, intervene=spec).output,
    "live_bind": spec.bind(model)(v, X),
    "replay": clean.fork().do(SITE, patch).output,
    "rerun": clean.fork().do(SITE, patch, model=model.bind(v), inputs=X).output,
    "set_only_run": clean.fork().do(SITE, patch, intervention=SET_ONLY).run().output,
    "spec_bind": jl.load_spec(spec.save(tmp_path / "s")).bind(model)(v, X),
    "differentiable_replay": clean.fork().do(SITE, patch, intervention=DIFF).output,
  }
  for door, out in outs.items():
    assert np.array_equal(out, clean.output), door


def test_differentiable_replay_frontier_gradient_matches_finite_differences(mlp):
  model, v = mlp
  t = jl.trace(model, v, X)
  r = t.fork().do(LATER, jl.scale(0.5), intervention=DIFF)
  assert r.frontier, "a differentiable replay exposes its frontier"
  np.testing.assert_allclose(r.replay(r.frontier), r.output, atol=1e-12)
  metric = lambda f: (r.replay(f) ** 2).sum()
  grads = jax.grad(metric)(r.frontier)
  eps = 1e-6
  for label, value in r.frontier.items():
    flat = np.asarray(value).ravel()
    for idx in range(0, flat.size, 5):
      bump = np.zeros_like(flat)
      bump[idx] = eps
      up = dict(r.frontier, **{label: value + bump.reshape(value.shape)})
      down = dict(r.frontier, **{label: value - bump.reshape(value.shape)})
      fd = (metric(up) - metric(down)) / (2 * eps)
      np.testing.assert_allclose(np.asarray(grads[label]).ravel()[idx], fd, rtol=1e-6, atol=1e-8)


def test_differentiable_replay_cuts_upstream_but_not_downstream(mlp):
  model, v = mlp
  f = lambda v: jl.trace(model, v, X).do(LATER, jl.scale(0.5), intervention=DIFF).output.sum()
  g = jax.grad(f)(v)["params"]
  assert all(np.all(leaf == 0) for leaf in jax.tree.leaves(g["block_0"]))
  # block_1/mlp/fc runs inside the edited site: upstream of the frontier too.
  assert all(np.all(leaf == 0) for leaf in jax.tree.leaves(g["block_1"]))
  assert np.any(g["head"]["kernel"] != 0)
  assert np.any(g["shared"]["kernel"] != 0)
  dep = jl.depends_on(f, v)["params"]
  assert not any(jax.tree.leaves(dep["block_0"])) and all(jax.tree.leaves(dep["head"]))


def test_keep_grad_under_differentiable_replay_warns_once_per_session(mlp):
  model, v = mlp
  t = jl.trace(model, v, X)
  errors.reset_warnings()
  with pytest.warns(jl.JaxlensWarning, match=r"\[keep_grad_replay_frontier\].*live door"):
    t.do(SITE, ji.keep_grad(jl.scale(0.5)), intervention=DIFF)
  import warnings

  with warnings.catch_warnings(record=True) as again:
    warnings.simplefilter("always")
    t.do(SITE, ji.keep_grad(jl.scale(0.5)), intervention=DIFF)
  assert not [w for w in again if isinstance(w.message, jl.JaxlensWarning)]
  with pytest.raises(jl.GradientContractError, match="edit_detached_from_graph"):
    t.do(SITE, ji.keep_grad(jl.zero_ablate()), intervention=DIFF)


def test_replay_errors(mlp):
  model, v = mlp
  t = jl.trace(model, v, X)
  with pytest.raises(jl.SiteError, match=r"\[unknown_site\].*do\(\)"):
    t.do(jl.module("block_9"), jl.scale(2.0))
  with pytest.raises(jl.InvalidArgumentError, match=r"\[not_a_replay\]"):
    t.replay({})
  with pytest.raises(jl.GradientContractError, match="edit_detached_from_graph"):
    t.do(SITE, ji.keep_grad(jl.zero_ablate()))


def test_replay_from_every_module_site_equals_live(mlp):
  model, v = mlp
  t = jl.trace(model, v, X)
  for label in t.labels:
    live = jl.trace(model, v, X, intervene=jl.when(jl.label(label), jl.scale(0.5)))
    np.testing.assert_allclose(
      t.do(jl.label(label), jl.scale(0.5)).output, live.output, atol=1e-12, err_msg=label
    )


def test_keep_inputs_false_drops_the_inputs_and_refuses_replay(mlp):
  model, v = mlp
  full = jax.jit(lambda v, x: jl.trace(model, v, x))(v, X)
  lean = jax.jit(lambda v, x: jl.trace(model, v, x, keep_inputs=False))(v, X)
  np.testing.assert_allclose(lean.output, full.output, atol=0)
  assert lean.labels == full.labels
  for lbl in full.labels:
    np.testing.assert_allclose(lean[lbl].out, full[lbl].out, atol=0)
  # Returned from jit, the lean trace holds no copy of the variables and inputs.
  n_inputs = len(jax.tree.leaves((v, X)))
  assert len(jax.tree.leaves(full)) - len(jax.tree.leaves(lean)) >= n_inputs
  lowered = {
    k: jax.jit(f).lower(v, X).compile().memory_analysis()
    for k, f in (
      ("full", lambda v, x: jl.trace(model, v, x)),
      ("lean", lambda v, x: jl.trace(model, v, x, keep_inputs=False)),
    )
  }
  input_bytes = sum(a.nbytes for a in jax.tree.leaves((v, X)))
  assert lowered["full"].output_size_in_bytes - lowered["lean"].output_size_in_bytes >= input_bytes
  # Replay and differentiable replay need the inputs; a rerun with a bound model and
  # inputs does not.
  with pytest.raises(jl.InvalidArgumentError, match=r"\[trace_without_inputs\]"):
    lean.fork().do(SITE, jl.scale(0.5))
  with pytest.raises(jl.InvalidArgumentError, match=r"\[trace_without_inputs\]"):
    lean.fork().do(SITE, jl.scale(0.5), intervention=DIFF)
  with pytest.raises(jl.InvalidArgumentError, match=r"\[trace_without_inputs\]"):
    lean.fork().do(SITE, jl.scale(0.5), model=model.bind(v))
  rerun = lean.fork().do(SITE, jl.scale(0.5), model=model.bind(v), inputs=X)
  live = jl.trace(model, v, X, intervene=jl.when(SITE, jl.scale(0.5)))
  np.testing.assert_allclose(rerun.output, live.output, atol=1e-12)
  # A lean trace is still a donor.
  patched = jl.trace(model, v, X2, intervene=jl.when(SITE, jl.patch_from(lean)))
  ref = jl.trace(model, v, X2, intervene=jl.when(SITE, jl.patch_from(full)))
  np.testing.assert_allclose(patched.output, ref.output, atol=0)
  with pytest.raises(jl.InvalidArgumentError, match=r"\[invalid_argument\]"):
    jl.trace(model, v, X, keep_inputs="no")


def test_the_trace_is_a_record_whose_data_fields_are_its_leaves(mlp):
  import dataclasses

  model, v = mlp
  t = jl.trace(model, v, X).fork().do(SITE, jl.scale(0.5), intervention=SET_ONLY)
  assert dataclasses.is_dataclass(t)
  leaves, tree = jax.tree.flatten(t)
  # Static fields are aux data: labels keep the order the sites ran, staged edits stay staged.
  back = jax.tree.unflatten(tree, [leaf + 0 for leaf in leaves])
  assert back.labels == t.labels and list(back.infos) == list(t.infos)
  assert back.stale and back.run().output.shape == t.output.shape
  assert len(leaves) == len(jax.tree.leaves((t.output, t.values, t._args, t._staged)))
