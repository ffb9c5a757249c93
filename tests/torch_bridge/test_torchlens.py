"""The published torchlens 2.36.1 against the torch reference, cell by cell.

Every cell of the matrix that torchlens can spell (spellings from
torchlens-2.36.1-api.md) is measured on the specification's model: the outcome
(``reaches``: ``model[0].weight.grad`` is set by ``output.sum().backward()``; ``cut``: it
is not; ``raises:<ExceptionClass>``), the output and the gradient. Where torchlens
follows the specification they must equal the torch reference's (which equals
jaxlens's, tests/test_parity.py) to 1e-12. Where it departs, the cell is listed in
DEPARTURES with the reason, and the test fails if a listed cell stops departing, so
the list stays a measured list.

torchlens has no keep_grad, so only the "without keep_grad" column is compared; its
absence is itself a listed departure (test_keep_grad_is_missing).
"""

from __future__ import annotations

import fnmatch
import functools
import warnings

import numpy as np
import pytest
import torch
import torchlens as tl
from torchlens import intervention as ti
from torchlens.options import CaptureOptions, InterventionOptions, ReplayOptions

from jaxlens import contract as matrix
from torch_bridge import _matrix

# The matrix cells are cached per process: the files reading them share one xdist worker.
pytestmark = pytest.mark.xdist_group("matrix")

SITE = tl.module("0")
LABEL = "linear_1_1"  # the recorded label of the first Linear's output (selections need it)
TOL = 1e-12


# --------------------------------------------------------------------------
# One captured trace per model, reused by every replay cell: the graph of its saved
# values is kept (retain_graph) and the weight gradients are reset before each cell.


class _Fixture:
  def __init__(self):
    self.model, self.x, self.x_donor = _matrix.torch_model()
    with warnings.catch_warnings():
      warnings.simplefilter("ignore")
      self.captured = tl.trace(self.model, self.x, capture=CaptureOptions(intervention_ready=True))
      self.donor_trace = tl.trace(
        self.model, self.x_donor, capture=CaptureOptions(intervention_ready=True)
      )
    self.donor = self.donor_trace[LABEL].out  # carries its graph (CloneBackward0)
    self.population = torch.cat([self.donor, self.donor.flip(0) * 0.5])
    const = _matrix._constants()
    self.direction, self.delta = const["direction"], const["delta"]
    self.basis, self.units = const["basis"], const["units"]


@functools.lru_cache(maxsize=1)
def fixture() -> _Fixture:
  return _Fixture()


def _tanh_module():
  return torch.nn.Tanh()


def _square(out, *, hook=None):
  return out * out


def _reference(values):
  return ti.reference(values, origin="matrix population")


# Row name -> builder(fixture, detached) -> torchlens edit (None: no spelling exists).
TL_ROWS = {
  "scale": lambda f, d: tl.scale(0.5),
  "clamp": lambda f, d: tl.clamp(min=-0.3, max=0.4),
  "add_noise": lambda f, d: tl.noise(0.1, seed=0),
  "steer": lambda f, d: tl.steer(f.direction, 2.0, feature_axis=-1),
  "add": lambda f, d: tl.add(f.delta),
  "project_onto": lambda f, d: tl.project_onto(f.direction, feature_axis=-1),
  "project_out": lambda f, d: tl.project_off(f.direction, feature_axis=-1),
  "mean_ablate(dim=)": lambda f, d: ti.mean_fill(over=0),
  "scramble_elements(seed=)": lambda f, d: ti.scramble_elements(seed=0),
  "splice_module": lambda f, d: tl.splice_module(_tanh_module()),
  "permute_batch": lambda f, d: ti.permute_batch(seed=1, axis=0),
  "set_direction_mean": lambda f, d: ti.set_direction_mean(
    f.direction, _reference(d(f.population)), feature_axis=-1
  ),
  "compose": lambda f, d: ti.compose(tl.scale(0.0), tl.add(f.delta)),
  "hook callable": lambda f, d: _square,
  "zero_ablate": lambda f, d: tl.zero_ablate(),
  "replace_with": lambda f, d: tl.replace_with(d(f.donor)),
  "swap_with": lambda f, d: tl.swap_with(d(f.donor)),
  "patch_from": lambda f, d: tl.patch_from(f.donor_trace),
  "resample_rows_from": lambda f, d: ti.resample_rows_from(
    _reference(d(f.population)), seed=0, axis=0
  ),
  "mean_ablate(source=)": lambda f, d: tl.mean_ablate(d(f.population)),
  "scramble_elements(source=)": lambda f, d: ti.scramble_elements(d(f.donor), seed=0),
  "set_affine_coordinates": None,
  "subspace_* (subspace_patch)": None,
}


def _out(trace):
  return trace[trace.output_layers[0]].out


def _door_bind(f, site, edit):
  return tl.when(site, edit).bind(f.model)(f.x)


def _door_trace(f, site, edit):
  return _out(tl.trace(f.model, f.x, intervene=tl.when(site, edit)))


def _door_replay(f, site, edit):
  return _out(f.captured.fork().do(site, edit))


def _door_rerun(f, site, edit):
  return _out(f.captured.fork().do(site, edit, model=f.model, x=f.x))


def _door_set_only(f, site, edit):
  fork = f.captured.fork()
  fork.do(site, edit, intervention=InterventionOptions(engine="set_only"))
  return _out(fork.run(f.model, f.x))


def _door_differentiable(f, site, edit):
  fork = f.captured.fork()
  fork.attach_hooks(site, edit)
  return _out(fork.push(replay=ReplayOptions(differentiable=True)))


TL_BASE_DOORS = {
  "live_bind": _door_bind,
  "live_trace": _door_trace,
  "replay": _door_replay,
  "rerun": _door_rerun,
  "set_only_run": _door_set_only,
  "spec_bind": _door_bind,
  "differentiable_replay": _door_differentiable,
}


def _site(f, door):
  kind, _, _ = door.rpartition(":")
  if kind == "units":
    return tl.units(LABEL, [(r, c) for r in range(3) for c in f.units])
  if kind == "subspace":
    # (k, d) in torchlens; the reference's basis is (d, k).
    return tl.subspace(LABEL, f.basis.T.contiguous(), origin="matrix basis")
  return SITE


# --------------------------------------------------------------------------
# Measuring.


def measure(door: str, row: str) -> _matrix.TorchCell:
  """One torchlens cell (without keep_grad)."""
  f = fixture()
  build = TL_ROWS[row]
  if build is None:
    return _matrix.TorchCell("missing")
  base = door.rpartition(":")[2]
  # A spec built outside the measured run holds detached arrays (matrix.CONCRETE_EDIT).
  detach = (lambda t: t.detach()) if door in matrix.CONCRETE_EDIT else (lambda t: t)
  for p in f.model.parameters():
    p.grad = None
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    try:
      out = TL_BASE_DOORS[base](f, _site(f, door), build(f, detach))
    except Exception as error:  # noqa: BLE001 (any refusal is a measured outcome)
      return _matrix.TorchCell(f"raises:{type(error).__name__}", message=str(error)[:300])
    if out.requires_grad:
      out.sum().backward(retain_graph=True)
  grad = f.model[0].weight.grad
  return _matrix.TorchCell(
    "cut" if grad is None else "reaches",
    out.detach().numpy().copy(),
    None if grad is None else grad.numpy().copy(),
  )


def differs(tcell: _matrix.TorchCell, rcell: _matrix.TorchCell) -> str:
  """How a torchlens cell differs from the reference cell ('' when it does not)."""
  if tcell.outcome != rcell.outcome:
    return f"outcome {tcell.outcome} (reference {rcell.outcome})"
  if tcell.outcome.startswith("raises:"):
    return ""
  diff = float(np.max(np.abs(tcell.output - rcell.output)))
  if not diff <= TOL:
    return f"output differs by {diff:.3g}"
  if tcell.outcome == "reaches":
    gdiff = float(np.max(np.abs(tcell.weight_grad - rcell.weight_grad)))
    if not gdiff <= TOL:
      return f"gradient differs by {gdiff:.3g}"
  return ""


# --------------------------------------------------------------------------
# Where torchlens 2.36.1 departs from the specification, as measured. Each entry:
# (reason, door patterns, row patterns); a cell is listed when some entry matches it.

_SELECTION_ELSEWHERE = [
  f"{k}:{b}"
  for k in ("units", "subspace")
  for b in ("live_bind", "spec_bind", "rerun", "set_only_run", "differentiable_replay")
]
_ATTACHED_DONORS = [
  "replace_with",
  "swap_with",
  "mean_ablate(source=)",
  "scramble_elements(source=)",
]

DEPARTURES = [
  (
    "no spelling: torchlens has no set_affine_coordinates and no subspace_* edits",
    ["*"],
    ["set_affine_coordinates", "subspace_* (subspace_patch)"],
  ),
  (
    "set_only + run calls value(out): every built-in verb fails at run() with TypeError "
    "(only one-argument callables work)",
    ["set_only_run"],
    [r for r in TL_ROWS if r != "hook callable"],
  ),
  (
    "selections work only under replay: tl.when refuses them (ArgumentTypeError), rerun and "
    "set_only + run refuse them (LiveModeLabelError), attach_hooks + push refuses them "
    "(SiteResolutionError)",
    _SELECTION_ELSEWHERE,
    ["*"],
  ),
  (
    "tl.subspace selects the basis's support set instead of projecting onto it: a dense basis "
    "selects the whole feature axis, so every verb edits the whole site (no complement keeps "
    "the graph) and the projections are not refused",
    ["subspace:replay"],
    ["*"],
  ),
  (
    "seeded draws come from torch generators (permute_batch's even differs by door), not "
    "jax.random, so the values differ",
    ["*"],
    [
      "add_noise",
      "scramble_elements(seed=)",
      "permute_batch",
      "resample_rows_from",
      "scramble_elements(source=)",
    ],
  ),
  (
    "donors that carry a graph are not detached: the gradient reaches the weights through "
    "the donor (reaches instead of cut; under units the selected elements pass gradient)",
    ["live_bind", "live_trace", "replay", "rerun", "units:replay"],
    _ATTACHED_DONORS,
  ),
  (
    "differentiable replay deep-copies the hook's donor and fails on a non-leaf tensor "
    "(RuntimeError)",
    ["differentiable_replay"],
    _ATTACHED_DONORS,
  ),
  (
    "mean_ablate(source=) writes the source's global scalar mean, not its mean over the "
    "examples (axis 0)",
    ["*"],
    ["mean_ablate(source=)"],
  ),
  (
    "set_direction_mean computes the unit direction and its coefficient in float32 "
    "(outputs off by about 2e-8 in float64)",
    ["*"],
    ["set_direction_mean"],
  ),
  (
    "splice_module's default input=\"in\" feeds the module's call inputs on live doors: "
    "HookValueError under bind, and the model input (so cut) under trace and rerun",
    ["live_bind", "spec_bind", "live_trace", "rerun"],
    ["splice_module"],
  ),
]

TL_DOORS = tuple(TL_BASE_DOORS) + tuple(
  f"{k}:{b}"
  for k in ("units", "subspace")
  for b in ("live_bind", "replay", "rerun", "set_only_run", "spec_bind", "differentiable_replay")
)


def departures(door: str, row: str) -> list[str]:
  """The listed reasons why torchlens departs from the specification on this cell."""
  hit = lambda name, patterns: any(fnmatch.fnmatchcase(name, p) for p in patterns)
  return [reason for reason, doors, rows in DEPARTURES if hit(door, doors) and hit(row, rows)]


def test_tables_cover_the_matrix():
  assert set(TL_ROWS) == {r.name for r in matrix.ROWS}
  assert set(TL_DOORS) == set(matrix.DOORS)


@pytest.mark.parametrize("door", TL_DOORS)
def test_torchlens_cells(door):
  problems = []
  # The reference's cells as measured once per process (test_parity and the docs block read
  # the same table).
  reference = _matrix.door_table(door)
  for row in TL_ROWS:
    tcell = measure(door, row)
    rcell = reference[(door, row)].torch[0]
    how = differs(tcell, rcell) if tcell.outcome != "missing" else "no spelling"
    listed = departures(door, row)
    if listed and not how:
      problems.append(f"{row}: listed as departing ({listed[0]}) but now matches the reference")
    elif how and not listed:
      problems.append(f"{row}: departs unlisted: {how} {tcell.message[:200]}")
  assert not problems, "\n".join(problems)


def test_torchlens_follows_where_expected():
  """A guard against a list that excuses everything: the cells that follow, counted."""
  following = [(d, r) for d in TL_DOORS for r in TL_ROWS if not departures(d, r)]
  assert len(following) == 83


def test_keep_grad_is_missing():
  """No keep_grad: the with-keep_grad column has no torchlens spelling (a departure)."""
  assert not hasattr(tl, "keep_grad") and not hasattr(ti, "keep_grad")


def test_spellings_that_depart():
  """The specification's spellings of two doors are refused by torchlens 2.36.1."""
  f = fixture()
  with pytest.raises(TypeError, match="differentiable"):
    InterventionOptions(differentiable=True)
  with pytest.raises(TypeError, match="inputs"):
    f.captured.fork().do(SITE, tl.scale(0.5), model=f.model, inputs=f.x)
  with pytest.raises(TypeError, match="dim"):
    tl.mean_ablate(dim=0)
