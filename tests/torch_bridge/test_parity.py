"""jaxlens against the torch reference: every door x row x keep_grad cell, and saved specs.

The matrix is measured once per door on both frameworks (``torch_bridge._matrix``
caches it per process, so tests/test_docs.py and the ``python -m jaxlens`` test reuse
it). A cell agrees when the outcomes and the warning codes are equal, outputs differ
by at most 1e-12 (float64) and, for reaching cells, the torch ``weight.grad`` equals
the transposed jax kernel gradient to 1e-12.
"""

from __future__ import annotations

import warnings

import jax.numpy as jnp
import numpy as np
import pytest
import torch

import jaxlens as jl
import torch_bridge
import torch_bridge.convert
from jaxlens import contract as matrix
from jaxlens._src import selections
from torch_bridge import _matrix
from torch_bridge import reference as ref

# The matrix cells are cached per process: the files reading them share one xdist worker.
pytestmark = pytest.mark.xdist_group("matrix")

ROWS = {r.name: r for r in matrix.ROWS}


# -- the table ----------------------------------------------------------------


def test_torch_side_has_every_row_and_door():
  assert set(_matrix.TORCH_ROWS) == set(ROWS)
  assert set(_matrix.TORCH_DOORS) == set(matrix.DOORS)


def test_a_missing_row_or_door_fails_loudly(monkeypatch):
  monkeypatch.delitem(_matrix.TORCH_ROWS, "scale")
  with pytest.raises(_matrix.ReferenceMissingError, match=r"\[reference_missing\].*'scale'"):
    _matrix.run_torch_cell("live_bind", "scale", False)
  monkeypatch.delitem(_matrix.TORCH_DOORS, "replay")
  with pytest.raises(_matrix.ReferenceMissingError, match=r"\[reference_missing\].*'replay'"):
    _matrix.run_torch_cell("replay", "clamp", False)


def test_the_models_and_inputs_are_the_same(spec_model):
  _, variables, x, x_donor, source = spec_model
  assert source == "torch.manual_seed(0)"
  tmodel, tx, tx_donor = _matrix.torch_model()
  for i, layer in enumerate(tmodel):
    params = variables["params"][f"layers_{i}"]
    assert np.array_equal(layer.weight.detach().numpy().T, params["kernel"])
    assert np.array_equal(layer.bias.detach().numpy(), params["bias"])
  assert np.array_equal(tx.numpy(), x) and np.array_equal(tx_donor.numpy(), x_donor)
  _, _, site_map = torch_bridge.from_torch(tmodel)
  assert site_map[_matrix.SITE] == matrix.SITE


def test_the_case_constants_are_the_same(spec_model):
  model, variables, x, x_donor, _ = spec_model
  jcase = matrix.make_case(model, variables, x, x_donor)
  tcase = _matrix.make_case(*_matrix.torch_model())
  for name in ("direction", "delta", "basis", "W", "b", "units"):
    assert np.array_equal(np.asarray(getattr(jcase, name)), np.asarray(getattr(tcase, name))), name
  np.testing.assert_allclose(
    np.asarray(jcase.donor), tcase.donor.detach().numpy(), rtol=0, atol=1e-12
  )
  assert tcase.donor.requires_grad  # the torch donor carries a graph, as jaxlens's does


@pytest.mark.parametrize("door", list(matrix.DOORS))
def test_every_cell_agrees(door):
  table = _matrix.door_table(door)
  assert [name for _, name in table] == list(ROWS)
  problems = [
    f"{name}: {'; '.join(p.disagreements())}" for (_, name), p in table.items() if not p.agrees
  ]
  problems += [
    f"{name}: jaxlens {[c.outcome for c in p.jax]}, torch "
    f"{[c.outcome for c in p.torch]}, specification {p.expected}"
    for (_, name), p in table.items()
    if not p.matches_spec
  ]
  assert not problems, "\n".join(problems)
  # keep_grad under differentiable replay warns on both frameworks; nothing else warns.
  for (_, _name), p in table.items():
    for keep, cells in ((False, (p.jax[0], p.torch[0])), (True, (p.jax[1], p.torch[1]))):
      warns = (
        keep
        and door.endswith("differentiable_replay")
        and not cells[0].outcome.startswith("raises:")
      )
      assert all(c.warnings == (("keep_grad_replay_frontier",) if warns else ()) for c in cells)


# -- the reference itself: keep_grad codes, doors, draws ------------------------


def _model():
  model, x, x_donor = _matrix.torch_model()
  return model, x


def test_keep_grad_codes():
  model, x = _model()
  with pytest.raises(jl.GradientContractError, match=r"\[edit_detached_from_graph\]") as info:
    ref.when("0", ref.keep_grad(ref.zero_ablate())).bind(model)(x)
  assert info.value.fields["site"] == "0"
  assert info.value.fields["fix"] == "keep_grad(ref.scale(0.0))"
  with torch.no_grad(), pytest.raises(jl.GradientContractError, match=r"\[grad_disabled\]"):
    ref.when("0", ref.keep_grad(ref.scale(0.0))).bind(model)(x)
  model.requires_grad_(False)
  with pytest.raises(jl.GradientContractError, match=r"\[site_has_no_graph\]"):
    ref.when("0", ref.keep_grad(ref.scale(2.0))).bind(model)(x)
  model.requires_grad_(True)
  # The graph-keeping spelling of a zero: zeros written, a zero gradient that reaches.
  out = ref.when("0", ref.keep_grad(ref.scale(0.0))).bind(model)(x)
  out.sum().backward()
  assert model[0].weight.grad is not None and bool((model[0].weight.grad == 0).all())


def test_a_hook_decision_runs_the_check():
  model, x = _model()
  decide = lambda y: jl.InterventionDecision(torch.zeros_like(y), keep_grad=True)
  with pytest.raises(jl.GradientContractError, match=r"\[edit_detached_from_graph\]"):
    ref.when("0", decide).bind(model)(x)
  keep = lambda y: jl.InterventionDecision(2 * y, keep_grad=True)
  assert ref.when("0", keep).bind(model)(x).requires_grad


def test_cutting_verbs_detach_a_donor_with_a_graph():
  model, x = _model()
  donor = ref.trace(model, x * 2)["0"].out
  assert donor.requires_grad
  out = ref.when("0", ref.replace_with(donor)).bind(model)(x)
  out.sum().backward()
  assert model[0].weight.grad is None


def test_differentiable_replay_releafs_the_frontier():
  model, x = _model()
  opts = ref.InterventionOptions(differentiable=True)
  ref.reset_warnings()
  with pytest.warns(jl.JaxlensWarning, match=r"keep_grad_replay_frontier"):
    r = ref.trace(model, x).fork().do("0", ref.keep_grad(ref.scale(2.0)), intervention=opts)
  r.output.sum().backward()
  assert model[0].weight.grad is None
  frontier = r.frontier["0"]
  assert frontier.is_leaf and frontier.grad is not None  # attribution patching


def test_replay_reruns_only_downstream_modules():
  model, x = _model()
  calls = []
  model[0].register_forward_hook(lambda m, a, o: calls.append("0"))
  t = ref.trace(model, x)
  calls.clear()
  r = t.fork().do("1", ref.scale(3.0))
  assert calls == []
  assert torch.allclose(r.output, 3 * t.output, rtol=0, atol=1e-12)
  assert t.output is not r.output and t["1"].out is t.output  # do() returns a new trace


def test_replay_refuses_what_it_cannot_replay():
  model, x = _model()
  with pytest.raises(jl.InvalidArgumentError, match=r"\[replay_unsupported\]"):
    ref.trace(torch.nn.Sequential(model), x).fork().do("0.1", ref.scale(2.0))
  with pytest.raises(jl.SiteError, match=r"\[unknown_site\]"):
    ref.when("nope", ref.scale(2.0)).bind(model)(x)


def test_swap_with_a_module_that_ran_earlier():
  model, x = _model()
  net = torch.nn.Sequential(model[0], torch.nn.Identity())
  out = ref.when("1", ref.swap_with("0")).bind(net)(x)
  assert torch.equal(out, model[0](x).detach())
  with pytest.raises(jl.InvalidArgumentError, match=r"\[swap_source_unavailable\]"):
    ref.when("0", ref.swap_with("1")).bind(net)(x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_random_draws_are_jaxlens_draws(dtype):
  x = torch.linspace(-1, 1, 24, dtype=dtype).reshape(4, 6)
  jx = jnp.asarray(x.numpy())
  pop = jnp.asarray(np.arange(30, dtype=x.numpy().dtype).reshape(5, 6))
  pairs = [
    (ref.add_noise(0.3, seed=7), jl.add_noise(0.3, seed=7)),
    (ref.scramble_elements(seed=3), jl.intervention.scramble_elements(seed=3)),
    (ref.permute_batch(seed=2), jl.intervention.permute_batch(seed=2)),
    (
      ref.resample_rows_from(ref.Population(torch.from_numpy(np.array(pop))), seed=5),
      jl.intervention.resample_rows_from(jl.Population(pop), seed=5),
    ),
  ]
  for tedit, jedit in pairs:
    assert np.array_equal(tedit(x).numpy(), np.asarray(jedit(jx))), tedit


def test_units_at_positions_and_subspace_match_jaxlens():
  x = torch.linspace(-1, 1, 24, dtype=torch.float64).reshape(2, 3, 4)
  jx = jnp.asarray(x.numpy())
  basis = np.asarray(matrix.matrix_basis())
  cases = [
    (ref.at_positions([0, 2], ref.scale(3.0)), jl.at_positions(jnp.array([0, 2]), jl.scale(3.0))),
    (
      ref.Selection(None, "units", {"indices": [1, 3]}).wrap(ref.zero_ablate()),
      selections.Selection(
        None, "units", {"indices": np.array([1, 3])}, (("feature_axis", -1),)
      ).wrap(jl.zero_ablate()),
    ),
    (
      ref.subspace_scale(torch.from_numpy(basis.copy()), 0.5),
      selections.subspace_scale(jnp.asarray(basis), 0.5),
    ),
    (
      ref.subspace_set(basis, np.array([1.0, -2.0])),
      selections.subspace_set(jnp.asarray(basis), jnp.array([1.0, -2.0])),
    ),
  ]
  for tedit, jedit in cases:
    diff = np.max(np.abs(tedit(x).numpy() - np.asarray(jedit(jx))))
    assert diff <= 1e-12, (tedit, diff)
  with pytest.raises(jl.InvalidArgumentError, match=r"\[affine_source_needs_subspace\]"):
    ref.set_affine_coordinates(np.zeros((2, 4)), np.zeros(2))(x)
  with pytest.raises(jl.InvalidArgumentError, match=r"\[subspace_edit_unsupported\]"):
    ref.Selection(None, "subspace", {"basis": basis, "origin": None}).wrap(
      ref.project_out(np.ones(4))
    )(x)


# -- saved specs: saved by jaxlens, loaded by torch_bridge ------------------------

PORTABLE = [r for r in matrix.ROWS if r.name not in ("hook callable", "splice_module")]


@pytest.fixture(scope="module")
def converted(spec_model):
  model, variables, x, x_donor, _ = spec_model
  tmodel, tx, _ = _matrix.torch_model()
  fmodel, fvariables, site_map = torch_bridge.from_torch(tmodel)
  case = matrix.make_case(model, variables, x, x_donor)
  return tmodel, tx, fmodel, fvariables, site_map, case


@pytest.mark.parametrize("kind", ["", "units", "subspace"])
def test_saved_specs_give_the_same_outputs_on_torch(converted, kind, tmp_path):
  tmodel, tx, fmodel, fvariables, site_map, case = converted
  site = jl.module(matrix.SITE)
  problems = []
  for i, row in enumerate(PORTABLE):
    edit = row.build(case)
    if kind == "units":
      spec = jl.when(selections.units(site, case.units), edit)
    elif kind == "subspace":
      spec = jl.when(selections.subspace(site, case.basis, origin=case.population), edit)
    else:
      spec = jl.when(site, edit)
    path = spec.save(tmp_path / f"spec{i}")
    try:
      want = np.asarray(jl.load_spec(path).bind(fmodel)(fvariables, jnp.asarray(tx.numpy())))
    except jl.InvalidArgumentError as error:
      want = error.code
    try:
      got = torch_bridge.load_spec(path, site_map).bind(tmodel)(tx).detach().numpy()
    except jl.InvalidArgumentError as error:
      got = error.code
    if isinstance(want, str) or isinstance(got, str):
      if want != got:
        problems.append(f"{row.name}: jaxlens {want!r}, torch {got!r}")
    elif not np.max(np.abs(want - got)) <= 1e-12:
      problems.append(f"{row.name}: outputs differ by {np.max(np.abs(want - got)):.3g}")
  assert not problems, "\n".join(problems)


def test_a_loaded_spec_gives_forward_hooks_and_keeps_keep_grad(converted, tmp_path):
  tmodel, tx, fmodel, fvariables, site_map, case = converted
  spec = jl.when(jl.module("layers_0"), jl.intervention.keep_grad(jl.zero_ablate())) + jl.when(
    jl.module("layers_1"), jl.scale(2.0)
  )
  hooks = torch_bridge.load_spec(spec.save(tmp_path / "s"), site_map).hooks()
  assert sorted(hooks) == ["0", "1"]
  handle = tmodel.get_submodule("0").register_forward_hook(hooks["0"])
  try:
    with pytest.raises(jl.GradientContractError, match=r"\[edit_detached_from_graph\]"):
      tmodel(tx)
  finally:
    handle.remove()


def test_a_spec_for_a_converted_transformer(tmp_path):
  torch.manual_seed(0)
  tmodel = torch_bridge.convert.TinyGPT(11, 8, 2, 2, 6).double().eval()
  idx = torch.randint(0, 11, (2, 5))
  fmodel, fvariables, site_map = torch_bridge.from_torch(tmodel)
  direction = jnp.linspace(-1.0, 1.0, 8, dtype=jnp.float64)
  spec = jl.when(jl.module("blocks_0/mlp"), jl.steer(direction, 3.0, feature_axis=-1)) + jl.when(
    jl.module("blocks_1/ln1"), jl.at_positions(jnp.array([1, 3]), jl.scale(0.0))
  )
  path = spec.save(tmp_path / "s")
  want = np.asarray(jl.load_spec(path).bind(fmodel)(fvariables, jnp.asarray(idx.numpy())))
  got = torch_bridge.load_spec(path, site_map).bind(tmodel)(idx).detach().numpy()
  np.testing.assert_allclose(want, got, rtol=0, atol=1e-10)


def test_load_spec_refusals(converted, tmp_path):
  _, _, _, _, site_map, _ = converted
  spec = jl.when(jl.func("dot_general"), jl.scale(2.0))
  with pytest.raises(torch_bridge.TorchSpecError, match=r"\[selector_not_portable_to_torch\]"):
    torch_bridge.load_spec(spec.save(tmp_path / "a"), site_map)
  spec = jl.when(jl.module("layers_7"), jl.scale(2.0))
  with pytest.raises(jl.SiteError, match=r"\[unknown_site\]"):
    torch_bridge.load_spec(spec.save(tmp_path / "b"), site_map)
  with pytest.raises(jl.SpecFormatError, match=r"\[spec_not_found\]"):
    torch_bridge.load_spec(tmp_path / "missing", site_map)
  with pytest.raises(torch_bridge.TorchSpecError, match=r"\[site_map_ambiguous\]"):
    torch_bridge.load_spec(tmp_path / "b", {"0": "layers_0", "a.0": "layers_0"})


def test_no_warnings_leak():
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    model, x = _model()
    ref.trace(model, x).fork().do("0", ref.add_noise(0.1, seed=0))
