"""Floor 11: the :class:`Trace` record and ``jl.trace``, the door that makes one.

A :class:`Trace` is a record: the captured program and how it was called (static), the
call's flat inputs and constants, the spec that ran, the saved site values and the output
(pytree leaves). It can leave ``jax.jit`` and serve as a donor. Its doors (``fork().do``,
``run``, ``replay``) are the engines of :mod:`jaxlens._src.replay`; ``do`` never mutates a
trace: it returns a new one.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from jaxlens._src import model_calls, render, viewing
from jaxlens._src import replay as engines
from jaxlens._src.doors import Spec, as_spec, rule
from jaxlens._src.edit import Donor, read_donor
from jaxlens._src.errors import InvalidArgumentError, SiteError
from jaxlens._src.gradients import SiteGrads
from jaxlens._src.sites import (
  OUTPUT_LABEL,
  SiteInfo,
  as_selector,
  matched_layers,
  module_sites,
  unmatched_error,
)
from jaxlens._src.tracebacks import api_boundary

__all__ = ["Trace", "SiteValue", "trace", "InterventionOptions"]


@dataclasses.dataclass(frozen=True)
class InterventionOptions:
  """How ``Trace.do`` runs an edit.

  Attributes:
    engine: ``"auto"`` (replay without ``model=``, rerun with it), ``"replay"``,
      ``"rerun"`` or ``"set_only"`` (stage; ``Trace.run`` executes).
    differentiable: replay with the frontier re-leafed (gradients stop there).
  """

  engine: str = "auto"
  differentiable: bool = False

  def __post_init__(self):
    if self.engine not in ("auto", "replay", "rerun", "set_only"):
      raise InvalidArgumentError(
        f"unknown engine {self.engine!r}",
        code="invalid_argument",
        fix='InterventionOptions(engine="set_only")',
      )


@dataclasses.dataclass(frozen=True)
class SiteValue:
  """One saved site: ``.out`` is its value, ``.label`` its label, and ``.input`` the
  ``(args, kwargs)`` its module was called with (traces captured with ``save_inputs=True``;
  else ``None``)."""

  label: str
  out: Any
  info: SiteInfo | None = None
  input: Any = None


def _static(default=None):
  """A field of the record's static part (pytree aux data), not a leaf."""
  return dataclasses.field(default=default, metadata={"static": True})


def _mapping(*, static=False):
  """A label -> value field, kept in insertion order (the order the sites ran)."""
  return dataclasses.field(default_factory=dict, metadata={"static": static})


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True, eq=False, repr=False)
class Trace(Donor):
  """The result of ``jl.trace``: the model output and the saved site values.

  Index it by label (``trace["layers_0"]``, ``trace["tanh_1"]``) or by a selector
  that matches one saved site; ``trace[trace.output_layers[0]].out`` is the
  output (also ``trace.output``). ``trace.labels`` lists the saved sites in the
  order they ran; ``trace.sites`` every site of the captured program.

  Attributes:
    output: the model output.
    values: label -> saved site value.
    infos: label -> the saved site's :class:`SiteInfo`.
    frontier: a differentiable replay's values entering the recomputed cone.
    inputs: label -> ``(args, kwargs)`` of the saved module calls (``save_inputs=True``).
    stale: edits are staged (``engine="set_only"``) and not yet run.
  """

  output: Any
  values: dict = _mapping()
  infos: dict = _mapping(static=True)
  _program: Any = _static()  # the captured program (compared by identity)
  _args: tuple = ()  # the call's flat inputs (variables, then inputs)
  _consts: tuple = ()  # the program's constants
  _spec: Spec = Spec(())  # the edits the values reflect
  _staged: Spec = Spec(())  # edits staged by engine="set_only"
  _save: Any = _static()  # the selector of the saved sites
  frontier: dict = _mapping()
  _replay_starts: tuple | None = _static()  # a differentiable replay's start sites
  _replay_layers: tuple = _static(())  # (label, first layer) of starts inside layer stacks
  stale: bool = _static(False)
  _keep_inputs: bool = _static(True)
  _module: Any = _static()  # the model call (model_calls.LinenCall / NnxCall)
  _call: Any = _static()  # (method, apply_kwargs items, model kwargs items)
  inputs: dict = _mapping()
  _save_inputs: bool = _static(False)
  # The index of the first rule of the spec applied by a replay (the ones before it ran
  # live, in the capture), or None when none was: views say what was recomputed.
  _replayed_from: int | None = _static()

  def __post_init__(self):
    for name in ("values", "infos", "frontier", "inputs"):
      object.__setattr__(self, name, dict(getattr(self, name) or {}))
    object.__setattr__(self, "_args", tuple(self._args))
    object.__setattr__(self, "_consts", tuple(self._consts))

  # -- pytree: the static fields are the aux data, the others the leaves --------

  def tree_flatten(self):
    children, aux = [], []
    for name, static, mapping in _FIELDS:
      value = getattr(self, name)
      if static:
        aux.append(tuple(value.items()) if mapping else value)
      elif mapping:  # keys in the aux data, in order (a dict pytree sorts its keys)
        aux.append(tuple(value))
        children.append(tuple(value.values()))
      else:
        children.append(value)
    return tuple(children), tuple(aux)

  @classmethod
  def tree_unflatten(cls, aux, children):
    fields, leaves, statics = {}, iter(children), iter(aux)
    for name, static, mapping in _FIELDS:
      if static:
        value = next(statics)
        fields[name] = dict(value) if mapping else value
      elif mapping:
        fields[name] = dict(zip(next(statics), next(leaves)))
      else:
        fields[name] = next(leaves)
    return cls(**fields)

  # -- reading ------------------------------------------------------------

  @property
  def output_layers(self) -> tuple[str, ...]:
    return (OUTPUT_LABEL,)

  @property
  def labels(self) -> tuple[str, ...]:
    """The saved site labels, in the order the sites ran."""
    return tuple(self.values)

  @property
  def sites(self) -> tuple[SiteInfo, ...]:
    """Every site of the captured program (module outputs and ops), in order."""
    if self._program is None:
      return tuple(i for i in self.infos.values() if i is not None)
    return tuple(self._program.infos)

  @property
  def spec(self) -> Spec:
    """The edits this trace's values reflect (live, replayed and rerun)."""
    return self._spec

  def __contains__(self, key) -> bool:
    try:
      self[key]
    except SiteError:
      return False
    return True

  @api_boundary
  def __getitem__(self, key) -> SiteValue:
    if isinstance(key, str) and key in self.values:
      return SiteValue(key, self.values[key], self.infos.get(key), self.inputs.get(key))
    if isinstance(key, str) and key == OUTPUT_LABEL:
      return SiteValue(OUTPUT_LABEL, self.output)
    selector = as_selector(key)
    hits = [lbl for lbl, info in self.infos.items() if info is not None and selector.matches(info)]
    if not hits:
      # One layer of a saved layer stack: its slice.
      for lbl, info in self.infos.items():
        layers = None if info is None else matched_layers(selector, info)
        if layers and len(layers) == 1:
          return SiteValue(
            info.at_layer(layers[0]).label, self.values[lbl][layers[0]], info.at_layer(layers[0])
          )
    if not hits:
      raise unmatched_error(selector, list(self.sites), "this trace saved no such site")
    if len(hits) > 1:
      raise SiteError(
        f"{selector!r} matches {len(hits)} saved sites: {hits}",
        code="ambiguous_site",
        site=repr(selector),
        candidates=hits,
        fix=f"index by one label, e.g. trace[{hits[0]!r}]",
      )
    return SiteValue(hits[0], self.values[hits[0]], self.infos[hits[0]], self.inputs.get(hits[0]))

  def value_for_donor(self, label: str, verb: str, *, layer=None, static_layer=None):
    """The value this trace saved at ``label``, for a verb that reads it as a donor.

    Inside a scan body (``layer`` is the traced iteration index) the donor is the
    donor stack's slice at that layer, or the single layer the donor saved.
    """
    stacked = {lbl for lbl, info in self.infos.items() if info is not None and info.layers}
    return read_donor(self.values, stacked, label, verb, layer=layer, static_layer=static_layer)

  def donor_values(self) -> dict:
    return dict(self.values)

  def donor_infos(self) -> dict:
    return dict(self.infos)

  def site_value(self, site):
    return self[site].out

  def __repr__(self) -> str:
    shape = lambda v: tuple(jnp.shape(v))
    shapes = {k: shape(v) for k, v in self.values.items()}
    stale = ", stale" if self.stale else ""
    # The output may be any pytree (a dict, a tuple of arrays): its leaves' shapes.
    return f"Trace(output={jax.tree.map(shape, self.output)}, sites={shapes}{stale})"

  # -- views ----------------------------------------------------------------

  def __treescope_repr__(self, path, subtree_renderer):
    """treescope's view: the site tree, the output, the spec and where each edit fired."""
    return render.treescope_repr(viewing.trace_view(self), path, subtree_renderer)

  def to_html(self, path=None, *, title: str | None = None) -> str:
    """A standalone HTML page of this trace's view (:func:`jaxlens.views.to_html`)."""
    return render.html_page(viewing.trace_view(self), title or "jaxlens Trace", path)

  # -- doors (the engines are jaxlens._src.replay's) ----------------------------

  @api_boundary
  def fork(self) -> "Trace":
    """A copy to edit; ``do`` never changes the trace it is called on."""
    return dataclasses.replace(self)

  @api_boundary
  def do(
    self,
    site,
    edit=None,
    *,
    model=None,
    inputs=None,
    intervention: InterventionOptions | None = None,
  ) -> "Trace":
    """Applies an edit at ``site`` and returns the new trace.

    Args:
      site: a selector or label (or a spec from ``jl.when``, with ``edit`` omitted).
      edit: a verb, ``keep_grad(verb)``, a callable or an array.
      model, inputs: rerun: re-execute ``model`` (bound, or unbound with this
        trace's variables) on ``inputs`` (default: this trace's inputs) with every
        edit of this trace plus the new one live.
      intervention: ``InterventionOptions``: ``engine="set_only"`` stages the edit
        (``run`` executes it); ``differentiable=True`` replays with the frontier
        re-leafed.

    Without ``model`` the edit is replayed: only the downstream cone of ``site``
    is recomputed, from the saved values, without calling the model.
    """
    opts = intervention or InterventionOptions()
    new = as_spec(site) if edit is None else Spec((rule(site, edit),))
    engine = opts.engine
    if engine == "auto":
      engine = "rerun" if model is not None or inputs is not None else "replay"
    if engine == "set_only":
      return engines.stage(self, new)
    if engine == "rerun":
      return engines.rerun(self, self._staged + new, model, inputs)
    return engines.replay(self, self._staged + new, differentiable=opts.differentiable)

  @api_boundary
  def run(self, model=None, inputs=None) -> "Trace":
    """Executes the edits staged with ``engine="set_only"`` (replay, or rerun with a model)."""
    if not self._staged.rules:
      return self
    if model is not None or inputs is not None:
      return engines.rerun(self, self._staged, model, inputs)
    return engines.replay(self, self._staged, differentiable=False)

  @api_boundary
  def replay(self, frontier: dict) -> Any:
    """The output of a differentiable replay recomputed from new frontier values.

    ``jax.grad(lambda f: metric(r.replay(f)))(r.frontier)`` is the gradient of a
    metric with respect to the values entering the replayed computation
    (attribution patching).
    """
    return engines.from_frontier(self, frontier)

  @api_boundary
  def grad(self, metric, *, sites) -> SiteGrads:
    """The gradient of ``metric(output)`` at each of ``sites``, from one backward pass.

    The model is rerun from this trace's variables and inputs with this trace's edits
    live; see :func:`jaxlens.site_grads` (this is its ``trace.grad`` spelling, as
    ``.grad`` in nnsight and torchlens).
    """
    return engines.grad(self, metric, sites)


_FIELDS = tuple(
  (f.name, f.metadata.get("static", False), f.default_factory is dict)
  for f in dataclasses.fields(Trace)
)


def capture(call, variables, inputs, kwargs, spec: Spec, save, **options) -> Trace:
  """The trace of one model call (``call`` from ``model_calls.split``), for the tools that
  call a model already split from its variables; ``options`` as for
  :func:`jaxlens._src.replay.record_of_capture`."""
  return Trace(**engines.record_of_capture(call, variables, inputs, kwargs, spec, save, **options))


@api_boundary
def trace(
  model,
  *args,
  intervene=None,
  save=None,
  method=None,
  keep_inputs: bool = True,
  save_inputs: bool = False,
  **apply_kwargs,
) -> Trace:
  """Runs ``model`` with edits live and returns a :class:`Trace`.

  Spellings:
    ``jl.trace(model.bind(variables), x, ...)`` for a bound module, and
    ``jl.trace(model, variables, x, ...)`` for an unbound one.

  Args:
    model: a linen module, bound or unbound (then the first argument is its variables).
    *args: the variables (unbound model only), then the model's positional inputs.
    intervene: a spec from ``jl.when`` (or a list of them).
    save: which sites to keep: ``None`` (every module output), a selector
      (``jl.func("tanh")``, ``jl.all_sites()`` for every op too), a list of
      selectors, or ``False`` for none. A trace that saves one site holds about
      the memory of a plain forward.
    method: the module method to call.
    keep_inputs: whether the Trace holds the call's variables and inputs, which
      replay (``fork().do``) and a rerun without ``model=``/``inputs=`` need.
      ``False`` gives a Trace of the output and saved values only: returned from
      ``jax.jit`` it costs no copies of the variables (jit copies every input it
      returns), and replay raises ``trace_without_inputs``.
    save_inputs: also keep, for each saved module site, the ``(args, kwargs)`` its
      module was called with (``trace[site].input``, as torchlens and nnsight's
      ``.input``); replay and rerun keep them up to date.
    **apply_kwargs: ``rngs=``/``mutable=`` for ``Module.apply``; other keywords go
      to the model call.

  Returns:
    A Trace whose values are functions of the variables and inputs: differentiate
    through it with ``jax.grad``, return it from ``jax.jit``, replay edits on it
    with ``trace.fork().do(site, edit)``.
  """
  if isinstance(method, str) and not callable(getattr(model, method, None)):
    raise InvalidArgumentError(
      f"{type(model).__name__} has no method {method!r}",
      code="invalid_argument",
      fix="method=None (the module's __call__)",
    )
  module, variables, args = model_calls.resolve(
    model, args, "jl.trace(model, variables, x), or jl.trace(model.bind(variables), x)"
  )
  save_given = save is not None and save is not False
  if save is None:
    selector = module_sites()
  elif save is False:
    selector = None
  elif isinstance(save, (list, tuple)):
    if not save:
      raise InvalidArgumentError(
        "save=[] selects no site",
        code="invalid_argument",
        fix="save=False (keep no site) or save=None (every module)",
      )
    selector = None
    for s in save:
      selector = as_selector(s) if selector is None else selector | as_selector(s)
  else:
    selector = as_selector(save)
  model_kwargs = {
    k: apply_kwargs.pop(k) for k in list(apply_kwargs) if k not in ("rngs", "mutable")
  }
  if not isinstance(keep_inputs, bool):
    raise InvalidArgumentError(
      f"keep_inputs must be True or False, got {keep_inputs!r}",
      code="invalid_argument",
      fix="jl.trace(..., keep_inputs=False)",
    )
  if not isinstance(save_inputs, bool):
    raise InvalidArgumentError(
      f"save_inputs must be True or False, got {save_inputs!r}",
      code="invalid_argument",
      fix="jl.trace(..., save_inputs=True)",
    )
  return Trace(
    **engines.record_of_capture(
      module,
      variables,
      args,
      model_kwargs,
      as_spec(intervene),
      selector,
      save_given=save_given,
      method=method,
      apply_kwargs=apply_kwargs,
      keep_inputs=keep_inputs,
      save_inputs=save_inputs,
    )
  )
