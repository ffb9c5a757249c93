"""The gradient contract matrix as data, and the runner that measures it (``jaxlens.contract``).

This module is semi-public: documented and kept stable for privileged downstream
code (``torch_bridge`` measures the same rows and doors on its torch reference),
written against jaxlens's public names only, and free of torch.

One row per verb, one column block per door, two columns (without and with
``keep_grad``). Each cell is measured on the specification's float64 model,
``Sequential([Dense(4), Dense(2)])``, with the edit at ``layers_0``:

* ``reaches``: the output depends structurally on the first layer's kernel
  (checked on the jaxpr) and ``jax.grad`` of ``output.sum()`` gives it a gradient;
* ``cut``: no structural dependence and an exactly-zero gradient;
* ``raises:<code>``: a typed refusal.

Donors are computed inside the differentiated function from the same variables,
so they carry a graph and a cutting verb has to detach them to read ``cut``.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import tempfile
import warnings
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

import jaxlens as jl
from jaxlens import intervention as ji
from jaxlens.internal import reset_warnings as _reset_warnings
from jaxlens.internal import takes_hook_keyword as _takes_hook_keyword

__all__ = [
  "SITE",
  "Case",
  "Row",
  "ROWS",
  "SUBSPACE_ONLY",
  "NOT_UNDER_SUBSPACE",
  "DOORS",
  "CONCRETE_EDIT",
  "Cell",
  "expected",
  "spec_model",
  "case_from",
  "make_case",
  "matrix_basis",
  "case_constants",
  "run_cell",
  "measured",
  "run_matrix",
  "format_matrix",
  "takes_hook_keyword",
  "reset_warnings",
]


def takes_hook_keyword(fn: Callable) -> bool:
  """Whether ``fn`` accepts a ``hook=`` keyword (how jaxlens decides to pass the site context).

  The torch reference decides the same way, through this function.
  """
  return _takes_hook_keyword(fn)


def reset_warnings() -> None:
  """Forgets which once-per-session warnings jaxlens issued (each matrix cell shows its own)."""
  _reset_warnings()


SITE = "layers_0"


@dataclasses.dataclass
class Case:
  """The inputs of one cell, built inside the differentiated function.

  The donor's fields (``donor_trace``, the donor's value ``donor`` at the site, and the
  ``population`` of that value and its reversed half) are made on first read, from
  ``donor_source``, a trace or a function returning one: a row that reads no donor does
  not run the donor's forward (whose graph would be dead code in the cell's gradient).
  """

  x: Any
  donor_source: Any
  site: str
  direction: Any
  delta: Any
  basis: Any = None
  units: Any = None
  W: Any = None
  b: Any = None

  @functools.cached_property
  def donor_trace(self):
    source = self.donor_source
    return source() if callable(source) else source

  @functools.cached_property
  def donor(self):
    return self.donor_trace[self.site].out

  @functools.cached_property
  def population(self):
    return jl.population(self.donor, self.donor[::-1] * 0.5)


@dataclasses.dataclass(frozen=True)
class Row:
  """A matrix row: a verb, how to build it from a Case, and whether it keeps."""

  name: str
  build: Callable[[Case], ji.Edit]
  keeps: bool


ROWS: tuple[Row, ...] = (
  Row("scale", lambda c: jl.scale(0.5), True),
  Row("clamp", lambda c: jl.clamp(min=-0.3, max=0.4), True),
  Row("add_noise", lambda c: jl.add_noise(0.1, seed=0), True),
  Row("steer", lambda c: jl.steer(c.direction, 2.0), True),
  Row("add", lambda c: jl.add(c.delta), True),
  Row("project_onto", lambda c: jl.project_onto(c.direction), True),
  Row("project_out", lambda c: jl.project_out(c.direction), True),
  Row("mean_ablate(dim=)", lambda c: jl.mean_ablate(dim=0), True),
  Row("scramble_elements(seed=)", lambda c: jl.scramble_elements(seed=0), True),
  Row("splice_module", lambda c: jl.splice_module(jnp.tanh), True),
  Row("permute_batch", lambda c: jl.permute_batch(seed=1), True),
  Row("set_direction_mean", lambda c: jl.set_direction_mean(c.direction, c.population), True),
  Row("compose", lambda c: jl.compose(jl.scale(0.0), jl.add(c.delta)), True),
  Row("hook callable", lambda c: jl.hook(_square), True),
  Row("zero_ablate", lambda c: jl.zero_ablate(), False),
  Row("replace_with", lambda c: jl.replace_with(c.donor), False),
  Row("swap_with", lambda c: jl.swap_with(c.donor), False),
  Row("patch_from", lambda c: jl.patch_from(c.donor_trace), False),
  Row("resample_rows_from", lambda c: jl.resample_rows_from(c.population, seed=0), False),
  Row("mean_ablate(source=)", lambda c: jl.mean_ablate(source=c.population), False),
  Row("scramble_elements(source=)", lambda c: jl.scramble_elements(seed=0, source=c.donor), False),
  Row("set_affine_coordinates", lambda c: jl.set_affine_coordinates(c.W, c.b), True),
  Row(
    "subspace_* (subspace_patch)",
    lambda c: jl.subspace_patch(c.basis, c.donor_trace, origin=c.population),
    True,
  ),
)

# Rows that write subspace coordinates: refused outside a jl.subspace selection.
SUBSPACE_ONLY = {"set_affine_coordinates"}
# Rows refused under a jl.subspace selection.
NOT_UNDER_SUBSPACE = {"project_onto", "project_out"}


def _square(x):
  return x * x


def _door_bind(model, variables, x, edit):
  return jl.when(jl.module(SITE), edit).bind(model.bind(variables))(x)


def _door_trace(model, variables, x, edit):
  t = jl.trace(model.bind(variables), x, intervene=jl.when(jl.module(SITE), edit))
  return t[t.output_layers[0]].out


def _captured(model, variables, x):
  # Captured inside the differentiated function: saved values are functions of v.
  return jl.trace(model.bind(variables), x)


def _door_replay(model, variables, x, edit):
  return _captured(model, variables, x).fork().do(jl.module(SITE), edit).output


def _door_rerun(model, variables, x, edit):
  t = _captured(model, variables, x)
  return t.fork().do(jl.module(SITE), edit, model=model.bind(variables), inputs=x).output


def _door_set_only(model, variables, x, edit):
  t = _captured(model, variables, x).fork()
  staged = t.do(jl.module(SITE), edit, intervention=jl.InterventionOptions(engine="set_only"))
  return staged.run().output


def _door_differentiable(model, variables, x, edit):
  t = _captured(model, variables, x).fork()
  opts = jl.InterventionOptions(differentiable=True)
  return t.do(jl.module(SITE), edit, intervention=opts).output


# The spec door's round trip writes its throwaway directory to memory-backed storage where
# the system has one: the same save and load, without waiting on a disk's fsync (a few to
# tens of milliseconds a cell on a busy disk).
_SCRATCH = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None


def _door_spec_bind(model, variables, x, edit):
  spec = jl.when(jl.module(SITE), edit)
  try:
    with tempfile.TemporaryDirectory(dir=_SCRATCH) as tmp:
      spec = jl.load_spec(spec.save(f"{tmp}/spec"))
  except jl.SpecFormatError as error:
    # Hooks and splice_module hold Python callables: they bind in memory only.
    if error.code != "spec_not_portable":
      raise
  return spec.bind(model.bind(variables))(x)


def _selection(kind, case):
  if kind == "units":
    return jl.units(jl.module(SITE), case.units)
  return jl.subspace(jl.module(SITE), case.basis, origin=case.population)


def _selected(base, kind):
  """A selection door: the base door's edit wrapped by jl.units / jl.subspace."""

  def runner(model, variables, x, edit, case):
    return base(model, variables, x, _selection(kind, case).wrap(edit))

  runner.takes_case = True
  return runner


# Doors whose edit is built outside the differentiated function (a saved spec holds
# concrete arrays, so its donors carry no graph).
CONCRETE_EDIT = {"spec_bind"}

# door name -> (spelling shown in the table, runner(model, variables, x, edit) -> output)
DOORS: dict[str, tuple[str, Callable]] = {
  "live_bind": ("jl.when(site, edit).bind(model)(variables, x)", _door_bind),
  "live_trace": ("jl.trace(model, variables, x, intervene=...)", _door_trace),
  "replay": ("trace.fork().do(site, edit)", _door_replay),
  "rerun": ("trace.fork().do(site, edit, model=, inputs=)", _door_rerun),
  "set_only_run": ('do(..., InterventionOptions(engine="set_only")) + run()', _door_set_only),
  "spec_bind": ("jl.load_spec(spec.save(dir)).bind(model)(variables, x)", _door_spec_bind),
  "differentiable_replay": (
    "do(..., InterventionOptions(differentiable=True))",
    _door_differentiable,
  ),
}
# Selection doors: every base door but live_trace (the same program path as replay)
# under jl.units (features 1 and 3 of every row) and jl.subspace (a 2-D orthonormal
# basis, origin the population mean).
_BASES = ("live_bind", "replay", "rerun", "set_only_run", "spec_bind", "differentiable_replay")
for _kind in ("units", "subspace"):
  for _base in _BASES:
    _spelling, _run = DOORS[_base]
    DOORS[f"{_kind}:{_base}"] = (f"{_spelling} with jl.{_kind}(site, ...)", _selected(_run, _kind))
CONCRETE_EDIT |= {f"{k}:spec_bind" for k in ("units", "subspace")}


def expected(door: str, row: Row) -> tuple[str, str]:
  """The specification's outcome of a cell: (without keep_grad, with keep_grad)."""
  kind, _, base = door.rpartition(":")
  if row.name in SUBSPACE_ONLY and kind != "subspace":
    return ("raises:affine_source_needs_subspace",) * 2
  if row.name in NOT_UNDER_SUBSPACE and kind == "subspace":
    return ("raises:subspace_edit_unsupported",) * 2
  # A selection writes only what it selects: the rest keeps the graph, so every verb
  # keeps it (and passes keep_grad) through the unselected elements or the complement.
  keeps = row.keeps or bool(kind)
  if base == "differentiable_replay":
    # The frontier is re-leafed: nothing reaches upstream, whatever the verb.
    return ("cut", "cut") if keeps else ("cut", "raises:edit_detached_from_graph")
  # Every other door keeps whatever the verb keeps.
  if keeps:
    return ("reaches", "reaches")
  return ("cut", "raises:edit_detached_from_graph")


def spec_model():
  """The matrix model and its float64 inputs, from a fixed ``jax.random`` draw.

  ``torch_bridge.matrix.spec_model()`` gives the same model with the
  specification's torch draws (``torch.manual_seed(0)``); the outcomes are the
  same for both, and :func:`measured` takes either.

  Returns:
    ``(model, variables, x, x_donor, source)``.
  """
  if not jax.config.jax_enable_x64:
    raise jl.InvalidArgumentError(
      "the matrix runs in float64",
      code="x64_required",
      fix='jax.config.update("jax_enable_x64", True)',
    )
  model = nn.Sequential(
    [nn.Dense(4, param_dtype=jnp.float64), nn.Dense(2, param_dtype=jnp.float64)]
  )
  k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
  x = jax.random.normal(k1, (3, 4), jnp.float64)
  x_donor = jax.random.normal(k2, (3, 4), jnp.float64)
  variables = jax.tree.map(lambda a: a.astype(jnp.float64), model.init(k3, x))
  return model, variables, x, x_donor, "jax.random.key(0)"


def make_case(model, variables, x, x_donor) -> Case:
  """The case of the specification's model: its donor is the trace of ``x_donor`` under
  ``variables``, run when a row first reads it."""
  return case_from(lambda: jl.trace(model.bind(variables), x_donor), SITE, x)


def case_from(donor_trace, site, x=None) -> Case:
  """The matrix's edit arguments, with the donor read at ``site`` of ``donor_trace`` (a
  trace, or a function returning one, called on the first read of a donor field; the
  scanned-stack and NNX tests build their cases from their own models)."""
  return Case(x=x, donor_source=donor_trace, site=site, **case_constants())


def case_constants() -> dict:
  """The edit arguments of every case that do not depend on the donor (``direction``,
  ``delta``, ``basis``, ``units``, ``W``, ``b``), made once per process.

  torch_bridge's torch cases convert these same arrays, so both frameworks edit with
  bit-identical arguments.
  """
  return dict(_constants(bool(jax.config.read("jax_enable_x64"))))


@functools.lru_cache(maxsize=None)
def _constants(x64: bool) -> dict:
  """The edit arguments that do not depend on the donor, made once per process (and per
  ``jax_enable_x64`` setting, which decides what float64 means). They are computed eagerly
  even when the first call comes from inside a ``jax.jit`` trace, so the cache never holds
  a tracer."""
  with jax.ensure_compile_time_eval():
    return dict(
      direction=jnp.asarray([1.0, -2.0, 0.5, 3.0], jnp.float64),
      delta=jnp.linspace(-1.0, 1.0, 12, dtype=jnp.float64).reshape(3, 4),
      basis=matrix_basis(),
      units=np.asarray([1, 3]),
      W=jnp.asarray([[0.5, -1.0, 0.0, 2.0], [1.0, 0.0, -0.5, 0.0]], jnp.float64),
      b=jnp.asarray([0.1, -0.2], jnp.float64),
    )


def matrix_basis():
  """The matrix's subspace basis: orthonormal, 4 x 2, spanning no coordinate axis."""
  raw = jnp.asarray([[1.0, 0.5], [-2.0, 1.0], [0.5, 3.0], [1.0, -1.0]], jnp.float64)
  return jl.orthonormal(raw)


@dataclasses.dataclass
class Cell:
  outcome: str
  output: Any = None
  kernel_grad: Any = None
  message: str = ""
  warnings: tuple = ()


def run_cell(
  door: str, row: Row, keep: bool, model=None, variables=None, x=None, x_donor=None
) -> Cell:
  """Measures one cell by running the door."""
  if model is None:
    model, variables, x, x_donor, _ = spec_model()
  runner = DOORS[door][1]

  concrete_case = None
  if door in CONCRETE_EDIT:
    # Made outside the differentiated function, so its donor carries no graph.
    concrete_case = make_case(model, variables, x, x_donor)
    _ = concrete_case.population  # the donor's forward runs here, outside the gradient

  def out_fn(kernel):
    # A function of the site's kernel alone (the one leaf a cell reports on): the
    # other parameters are constants, so their derivatives are never formed.
    params = dict(variables["params"])
    params[SITE] = {**params[SITE], "kernel": kernel}
    v = {**variables, "params": params}
    case = concrete_case if concrete_case is not None else make_case(model, v, x, x_donor)
    edit = row.build(case)
    if keep:
      edit = jl.keep_grad(edit)
    if getattr(runner, "takes_case", False):
      return runner(model, v, x, edit, case)
    return runner(model, v, x, edit)

  # Once-per-session warnings are reset so that every cell shows its own.
  reset_warnings()
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always", jl.JaxlensWarning)
    try:
      kernel = variables["params"][SITE]["kernel"]
      # What jax.value_and_grad does, spelled out to keep the pullback: its jaxpr (the
      # transposed linearisation of this one run of the door) is the structure the
      # analysis reads, so the door never runs a second time for it.
      total, pullback, out = jax.vjp(
        lambda k: (lambda o: (o.sum(), o))(out_fn(k)), kernel, has_aux=True
      )
      seed = jnp.ones_like(total)
      (kernel_grad,) = pullback(seed)
      # A nonzero gradient proves the dependence; the structural analysis decides the
      # cells whose gradient is zero: cut (no path from the output's cotangent to the
      # kernel's), or reaching with a zero value (a keep_grad'd zero_ablate).
      nonzero = bool(np.any(np.asarray(kernel_grad) != 0))
      reaches = nonzero or jl.depends_on(pullback, seed)
    except jl.InvalidArgumentError as error:
      return Cell(f"raises:{error.code}", message=str(error))
  codes = tuple(
    sorted({w.message.fields["code"] for w in caught if isinstance(w.message, jl.JaxlensWarning)})
  )
  return Cell("reaches" if reaches else "cut", out, kernel_grad, warnings=codes)


@functools.lru_cache(maxsize=None)
def measured(door: str, row_name: str, keep: bool, weights: Callable | None = None) -> Cell:
  """One cell on the specification's model, measured once per process.

  ``weights`` is a function returning what :func:`spec_model` returns (default
  :func:`spec_model`; torch_bridge passes its torch draws). The matrix tests, the
  torch parity tests and ``python -m jaxlens`` share the cache.
  """
  model, variables, x, x_donor, _ = _cached(weights or spec_model)
  row = next(r for r in ROWS if r.name == row_name)
  return run_cell(door, row, keep, model, variables, x, x_donor)


@functools.lru_cache(maxsize=None)
def _cached(weights: Callable):
  return weights()


def run_matrix(doors_: tuple[str, ...] | None = None, weights: Callable | None = None) -> dict:
  """Measures every cell: ``{(door, row name): (Cell without, Cell with keep_grad)}``."""
  table = {}
  for door in doors_ or tuple(DOORS):
    for row in ROWS:
      table[(door, row.name)] = tuple(
        measured(door, row.name, keep, weights) for keep in (False, True)
      )
  return table


def format_matrix(table: dict) -> str:
  """The measured matrix as a Markdown table, with agreement against the specification."""
  rows_by_name = {r.name: r for r in ROWS}
  lines = [
    "| door | verb | without keep_grad | with keep_grad | spec agrees |",
    "|---|---|---|---|---|",
  ]
  warned = lambda c: c.outcome + (" (warns " + ", ".join(c.warnings) + ")" if c.warnings else "")
  agree = 0
  for (door, name), (a, b) in table.items():
    want = expected(door, rows_by_name[name])
    ok = (a.outcome, b.outcome) == want
    agree += ok
    lines.append(
      f"| `{DOORS[door][0]}` | {name} | {warned(a)} | {warned(b)} | "
      f"{'yes' if ok else 'NO: spec ' + ' / '.join(want)} |"
    )
  lines.append("")
  lines.append(f"{agree} of {len(table)} rows agree with the specification.")
  return "\n".join(lines)
