"""The contract matrix on both frameworks: jaxlens and the torch reference, side by side.

The rows and doors are jaxlens's (``jaxlens.contract.ROWS`` and ``DOORS``, with the
specification's outcome ``expected()``). This module holds their torch side, keyed by
the same names:

* ``TORCH_ROWS``: row name -> ``builder(TorchCase) -> reference edit``;
* ``TORCH_DOORS``: door name -> ``(spelling, runner(model, x, edit, case) -> output)``.

A row or door that jaxlens has and the torch side lacks is not skipped: measuring it
raises :class:`ReferenceMissingError` (and a test asserts the key sets are equal).

Each torch cell is measured on the specification's model, ``torch.manual_seed(0)``,
``nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))`` in float64, ``x = torch.randn(3, 4)``,
then ``x_donor = torch.randn(3, 4)`` (the draws :func:`spec_model` gives jaxlens's cells),
with the edit at module ``"0"`` (``layers_0`` in Flax, by ``from_torch``'s site map).
``reaches`` means ``output.sum().backward()`` leaves ``model[0].weight.grad`` not None
(``scale(0.0)``-style edits reach with an all-zero gradient); ``cut`` that it stays None.
"""

from __future__ import annotations

import dataclasses
import functools
import re
import warnings
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import torch

from jaxlens import contract as matrix
from jaxlens import InvalidArgumentError, JaxlensWarning
from torch_bridge import reference as ref

SITE = "0"  # the torch module name of matrix.SITE ("layers_0")
TOL = 1e-12  # float64: outputs and gradients agree to this, element by element


class ReferenceMissingError(InvalidArgumentError):
  """A matrix row or door that jaxlens measures and the torch reference does not define."""


# --------------------------------------------------------------------------
# The model and the cell inputs, mirroring jaxlens.contract.spec_model / make_case.


def spec_model():
  """``jaxlens.contract.spec_model`` with the specification's torch draws.

  The weights are torch's ``nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))`` after
  ``torch.manual_seed(0)``, then ``x = torch.randn(3, 4)`` and ``x_donor =
  torch.randn(3, 4)``, all in float64: the same numbers the torch cells use.

  Returns:
    ``(model, variables, x, x_donor, source)`` for ``jaxlens.contract.measured``.
  """
  model = matrix.spec_model()[0]
  tmodel, x, x_donor = torch_model()
  params = {}
  for i, layer in enumerate(tmodel):
    params[f"layers_{i}"] = {
      "kernel": jnp.asarray(layer.weight.detach().numpy().T),
      "bias": jnp.asarray(layer.bias.detach().numpy()),
    }
  to64 = lambda t: jnp.asarray(t.numpy())
  return model, {"params": params}, to64(x), to64(x_donor), "torch.manual_seed(0)"


def torch_model() -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor]:
  """A fresh copy of the matrix model and its inputs: ``(model, x, x_donor)``, float64."""
  torch.manual_seed(0)
  model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)).eval()
  x = torch.randn(3, 4)
  x_donor = torch.randn(3, 4)
  return model.double(), x.double(), x_donor.double()


@dataclasses.dataclass
class TorchCase:
  """The torch inputs of one cell (``matrix.Case`` in torch)."""

  x: torch.Tensor
  donor_trace: ref.Trace
  donor: torch.Tensor
  population: ref.Population
  direction: torch.Tensor
  delta: torch.Tensor
  basis: torch.Tensor
  units: np.ndarray
  W: torch.Tensor
  b: torch.Tensor


@functools.lru_cache(maxsize=1)
def _constants() -> dict[str, Any]:
  """jaxlens's case constants (``jaxlens.contract.case_constants``), as float64 tensors."""
  with jax.enable_x64(True):
    constants = matrix.case_constants()
  return {
    k: v if isinstance(v, np.ndarray) else torch.from_numpy(np.array(v))
    for k, v in constants.items()
  }


def make_case(model, x, x_donor) -> TorchCase:
  """The donor trace is a live torch run: its values carry a graph to the weights."""
  donor_trace = ref.trace(model, x_donor)
  donor = donor_trace[SITE].out
  constants = {
    k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in _constants().items()
  }
  return TorchCase(
    x=x,
    donor_trace=donor_trace,
    donor=donor,
    population=ref.population(donor, donor.flip(0) * 0.5),
    **constants,
  )


def _square(x):
  return x * x


# --------------------------------------------------------------------------
# Rows and doors, keyed by jaxlens's names.


TORCH_ROWS: dict[str, Callable[[TorchCase], ref.Edit]] = {
  "scale": lambda c: ref.scale(0.5),
  "clamp": lambda c: ref.clamp(min=-0.3, max=0.4),
  "add_noise": lambda c: ref.add_noise(0.1, seed=0),
  "steer": lambda c: ref.steer(c.direction, 2.0),
  "add": lambda c: ref.add(c.delta),
  "project_onto": lambda c: ref.project_onto(c.direction),
  "project_out": lambda c: ref.project_out(c.direction),
  "mean_ablate(dim=)": lambda c: ref.mean_ablate(dim=0),
  "scramble_elements(seed=)": lambda c: ref.scramble_elements(seed=0),
  "splice_module": lambda c: ref.splice_module(torch.tanh),
  "permute_batch": lambda c: ref.permute_batch(seed=1),
  "set_direction_mean": lambda c: ref.set_direction_mean(c.direction, c.population),
  "compose": lambda c: ref.compose(ref.scale(0.0), ref.add(c.delta)),
  "hook callable": lambda c: ref.hook(_square),
  "zero_ablate": lambda c: ref.zero_ablate(),
  "replace_with": lambda c: ref.replace_with(c.donor),
  "swap_with": lambda c: ref.swap_with(c.donor),
  "patch_from": lambda c: ref.patch_from(c.donor_trace),
  "resample_rows_from": lambda c: ref.resample_rows_from(c.population, seed=0),
  "mean_ablate(source=)": lambda c: ref.mean_ablate(source=c.population),
  "scramble_elements(source=)": lambda c: ref.scramble_elements(seed=0, source=c.donor),
  "set_affine_coordinates": lambda c: ref.set_affine_coordinates(c.W, c.b),
  "subspace_* (subspace_patch)": lambda c: ref.subspace_patch(
    c.basis, c.donor_trace, origin=c.population
  ),
}


def _door_bind(model, x, edit, case):
  return ref.when(SITE, edit).bind(model)(x)


def _door_trace(model, x, edit, case):
  return ref.trace(model, x, intervene=ref.when(SITE, edit)).output


def _door_replay(model, x, edit, case):
  # Captured inside the measured run: the saved values carry the graph to the weights.
  return ref.trace(model, x).fork().do(SITE, edit).output


def _door_rerun(model, x, edit, case):
  return ref.trace(model, x).fork().do(SITE, edit, model=model, inputs=x).output


def _door_set_only(model, x, edit, case):
  staged = (
    ref.trace(model, x)
    .fork()
    .do(SITE, edit, intervention=ref.InterventionOptions(engine="set_only"))
  )
  return staged.run().output


def _door_spec_bind(model, x, edit, case):
  # The edit was built from detached arrays (matrix.CONCRETE_EDIT): what a saved spec holds.
  return ref.when(SITE, edit).bind(model)(x)


def _door_differentiable(model, x, edit, case):
  opts = ref.InterventionOptions(differentiable=True)
  return ref.trace(model, x).fork().do(SITE, edit, intervention=opts).output


def _selected(base: Callable, kind: str) -> Callable:
  """A selection door: the base door's edit wrapped by ref.units / ref.subspace."""

  def runner(model, x, edit, case):
    if kind == "units":
      selection = ref.units(SITE, case.units)
    else:
      selection = ref.subspace(SITE, case.basis, origin=case.population)
    return base(model, x, selection.wrap(edit), case)

  return runner


# door name -> (torch spelling, runner(model, x, edit, case) -> output)
TORCH_DOORS: dict[str, tuple[str, Callable]] = {
  "live_bind": ('ref.when("0", edit).bind(model)(x)', _door_bind),
  "live_trace": ('ref.trace(model, x, intervene=ref.when("0", edit)).output', _door_trace),
  "replay": ('ref.trace(model, x).fork().do("0", edit)', _door_replay),
  "rerun": ('ref.trace(model, x).fork().do("0", edit, model=model, inputs=x)', _door_rerun),
  "set_only_run": (
    'do("0", edit, intervention=InterventionOptions(engine="set_only")).run()',
    _door_set_only,
  ),
  "spec_bind": (
    'ref.when("0", edit).bind(model)(x) (the edit holds detached arrays)',
    _door_spec_bind,
  ),
  "differentiable_replay": (
    'do("0", edit, intervention=InterventionOptions(differentiable=True))',
    _door_differentiable,
  ),
}
for _kind in ("units", "subspace"):
  for _base in (
    "live_bind",
    "replay",
    "rerun",
    "set_only_run",
    "spec_bind",
    "differentiable_replay",
  ):
    _spelling, _run = TORCH_DOORS[_base]
    TORCH_DOORS[f"{_kind}:{_base}"] = (
      f'{_spelling} with ref.{_kind}("0", ...)',
      _selected(_run, _kind),
    )


# --------------------------------------------------------------------------
# Measuring cells.


@dataclasses.dataclass
class TorchCell:
  """One measured torch cell.

  Attributes:
    outcome: ``"reaches"``, ``"cut"`` or ``"raises:<code>"``.
    output: the model output (numpy), or None when the cell raised.
    weight_grad: ``model[0].weight.grad`` (numpy, torch's ``(out, in)`` layout), or None.
    message: the error message of a raising cell.
    warnings: the sorted warning codes the cell issued.
  """

  outcome: str
  output: Any = None
  weight_grad: Any = None
  message: str = ""
  warnings: tuple = ()


def _lookup(table: dict, name: str, what: str):
  if name not in table:
    raise ReferenceMissingError(
      f"the torch reference has no {what} {name!r}: jaxlens's matrix measures it, so the "
      "torch side must too",
      code="reference_missing",
      site=name,
      fix=f"add {name!r} to torch_bridge._matrix.TORCH_{what.upper()}S",
    )
  return table[name]


def run_torch_cell(door: str, row: str, keep: bool) -> TorchCell:
  """Measures one torch cell by running the door on a fresh model."""
  build = _lookup(TORCH_ROWS, row, "row")
  runner = _lookup(TORCH_DOORS, door, "door")[1]
  model, x, x_donor = torch_model()
  ref.reset_warnings()
  with warnings.catch_warnings(record=True) as caught, torch.enable_grad():
    warnings.simplefilter("always", JaxlensWarning)
    try:
      if door in matrix.CONCRETE_EDIT:
        with torch.no_grad():
          case = make_case(model, x, x_donor)
      else:
        case = make_case(model, x, x_donor)
      edit = build(case)
      if keep:
        edit = ref.keep_grad(edit)
      out = runner(model, x, edit, case)
    except InvalidArgumentError as error:
      return TorchCell(f"raises:{error.code}", message=str(error))
    if out.requires_grad:
      out.sum().backward()
  codes = tuple(
    sorted({w.message.fields["code"] for w in caught if isinstance(w.message, JaxlensWarning)})
  )
  grad = model[0].weight.grad
  return TorchCell(
    "cut" if grad is None else "reaches",
    out.detach().numpy().copy(),
    None if grad is None else grad.numpy().copy(),
    warnings=codes,
  )


# --------------------------------------------------------------------------
# Both frameworks, compared.


@dataclasses.dataclass
class Pair:
  """One matrix row measured on both frameworks (cells without and with keep_grad)."""

  door: str
  row: matrix.Row
  jax: tuple
  torch: tuple

  @property
  def expected(self) -> tuple[str, str]:
    return matrix.expected(self.door, self.row)

  def disagreements(self) -> list[str]:
    """Why jaxlens and the torch reference differ on this row (empty when they agree)."""
    out = []
    for keep, j, t in zip(("without", "with"), self.jax, self.torch):
      where = f"{keep} keep_grad"
      if j.outcome != t.outcome:
        out.append(f"{where}: jaxlens {j.outcome}, torch {t.outcome}")
        continue
      if j.warnings != t.warnings:
        out.append(f"{where}: warnings jaxlens {j.warnings}, torch {t.warnings}")
      if j.outcome.startswith("raises:"):
        continue
      diff = float(np.max(np.abs(np.asarray(j.output) - t.output)))
      if not diff <= TOL:
        out.append(f"{where}: outputs differ by {diff:.3g}")
      kernel = np.asarray(j.kernel_grad)
      if j.outcome == "reaches":
        gdiff = float(np.max(np.abs(kernel.T - t.weight_grad)))
        if not gdiff <= TOL:
          out.append(f"{where}: gradients differ by {gdiff:.3g}")
      elif np.any(kernel != 0) or t.weight_grad is not None:
        out.append(f"{where}: a cut cell with a gradient")
    return out

  @property
  def agrees(self) -> bool:
    return not self.disagreements()

  @property
  def matches_spec(self) -> bool:
    want = self.expected
    return all((j.outcome, t.outcome) == (w, w) for j, t, w in zip(self.jax, self.torch, want))


def run_both(
  doors: tuple[str, ...] | None = None, rows: tuple[str, ...] | None = None
) -> dict[tuple[str, str], Pair]:
  """Measures the matrix on both frameworks: ``{(door, row name): Pair}``."""
  table = {}
  for door in doors or tuple(matrix.DOORS):
    for row in matrix.ROWS:
      if rows is not None and row.name not in rows:
        continue
      jcells = tuple(matrix.measured(door, row.name, keep, spec_model) for keep in (False, True))
      tcells = tuple(run_torch_cell(door, row.name, keep) for keep in (False, True))
      table[(door, row.name)] = Pair(door, row, jcells, tcells)
  return table


@functools.lru_cache(maxsize=None)
def door_table(door: str) -> dict[tuple[str, str], Pair]:
  """One door's rows on both frameworks, measured once per process (tests share it)."""
  return run_both((door,))


def full_table() -> dict[tuple[str, str], Pair]:
  """The whole matrix on both frameworks, in jaxlens's door order (cached per door)."""
  table = {}
  for door in matrix.DOORS:
    table.update(door_table(door))
  return table


def _shown(cell) -> str:
  warned = f" (warns {', '.join(cell.warnings)})" if cell.warnings else ""
  return f"{cell.outcome}{warned}"


def summary(table: dict[tuple[str, str], Pair]) -> tuple[int, int, int]:
  """``(rows where the frameworks agree, rows matching the specification, rows)``."""
  pairs = list(table.values())
  return sum(p.agrees for p in pairs), sum(p.matches_spec for p in pairs), len(pairs)


def format_both(table: dict[tuple[str, str], Pair]) -> str:
  """The measured matrix as Markdown: door spellings, then one row per door and verb."""
  doors = list(dict.fromkeys(d for d, _ in table))
  lines = ["| door | jaxlens | torch reference |", "|---|---|---|"]
  for door in doors:
    lines.append(f"| {door} | `{matrix.DOORS[door][0]}` | `{TORCH_DOORS[door][0]}` |")
  lines += [
    "",
    "| door | verb | jaxlens | jaxlens, keep_grad | torch reference | "
    "torch reference, keep_grad | agree |",
    "|---|---|---|---|---|---|---|",
  ]
  for (door, name), p in table.items():
    problems = p.disagreements()
    if not p.matches_spec:
      problems.append("specification: " + " / ".join(p.expected))
    agree = "yes" if not problems else "NO: " + "; ".join(problems)
    lines.append(
      f"| {door} | {name} | {_shown(p.jax[0])} | {_shown(p.jax[1])} | "
      f"{_shown(p.torch[0])} | {_shown(p.torch[1])} | {agree} |"
    )
  agree, spec, total = summary(table)
  lines += [
    "",
    f"{agree} of {total} rows agree between jaxlens and the torch reference "
    f"(outcomes, warnings, and outputs and reaching gradients within {TOL:g}); "
    f"{spec} of {total} match the specification.",
  ]
  return "\n".join(lines)


# --------------------------------------------------------------------------
# The generated block of docs/gradient_contract.md.


BEGIN, END = "<!-- matrix:begin -->", "<!-- matrix:end -->"
_BLOCK = re.compile(re.escape(BEGIN) + r"\n(.*?)" + re.escape(END), re.S)


def render_block(table: dict[tuple[str, str], Pair]) -> str:
  """The text between the markers: a note on how it was made, then the table."""
  return (
    "<!-- Generated by `python -m torch_bridge.matrix --write docs/gradient_contract.md`"
    " from a run of both frameworks; do not edit by hand. -->\n\n" + format_both(table) + "\n"
  )


def committed_block(path) -> str:
  """The generated block as committed in ``path``."""
  text = Path(path).read_text()
  found = _BLOCK.search(text)
  if found is None:
    raise InvalidArgumentError(
      f"{path} has no {BEGIN} ... {END} block",
      code="no_matrix_block",
      site=str(path),
      fix="add the two markers on their own lines",
    )
  return found.group(1)


def write_block(path, block: str) -> bool:
  """Replaces the generated block in ``path``; returns whether the file changed."""
  committed = committed_block(path)
  if committed == block:
    return False
  text = Path(path).read_text()
  Path(path).write_text(_BLOCK.sub(lambda m: f"{BEGIN}\n{block}{END}", text, count=1))
  return True
