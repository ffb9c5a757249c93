"""Floor 9: ``jl.trace`` and the trace doors: replay (``fork().do``), rerun, set_only + run.

A :class:`Trace` holds the captured program (static), the call's flat inputs and
constants, the spec that ran live, the saved site values and the output. It is a
pytree, so it can leave ``jax.jit`` and serve as a donor. ``do`` never mutates a
trace: it returns a new one.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from jaxlens._src import interpret, model_calls, program, runtime
from jaxlens._src.doors import Spec, as_spec, rule
from jaxlens._src.edit import Donor
from jaxlens._src.errors import InvalidArgumentError, ShapeError, SiteError, warn_once
from jaxlens._src.sites import (
  OUTPUT_LABEL,
  SiteInfo,
  as_selector,
  matched_layers,
  module_sites,
  unmatched_error,
)
from jaxlens._src.sites import hits as site_hits
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


@dataclasses.dataclass(frozen=True)
class _Static:
  """The static part of a trace (pytree aux data)."""

  labels: tuple
  infos: tuple
  program: Any = None
  save: Any = None
  frontier_labels: tuple = ()
  replay_starts: tuple | None = None
  replay_layers: tuple = ()  # (label, first layer) of replay starts inside layer stacks
  stale: bool = False
  keep_inputs: bool = True
  module: Any = None
  call: Any = None  # (method, apply_kwargs items, model kwargs items)
  input_labels: tuple = ()
  save_inputs: bool = False
  replayed_from: int | None = None


@jax.tree_util.register_pytree_node_class
class Trace(Donor):
  """The result of ``jl.trace``: the model output and the saved site values.

  Index it by label (``trace["layers_0"]``, ``trace["tanh_1"]``) or by a selector
  that matches one saved site; ``trace[trace.output_layers[0]].out`` is the
  output (also ``trace.output``). ``trace.labels`` lists the saved sites in the
  order they ran; ``trace.sites`` every site of the captured program.
  """

  def __init__(
    self,
    output,
    values: dict,
    infos: dict,
    *,
    program=None,
    args=(),
    consts=(),
    spec: Spec | None = None,
    staged: Spec | None = None,
    save=None,
    frontier: dict | None = None,
    replay_starts=None,
    stale=False,
    module=None,
    call=None,
    replay_layers=(),
    keep_inputs=True,
    inputs=None,
    save_inputs=False,
    replayed_from=None,
  ):
    self.output = output
    self.inputs = dict(inputs or {})  # label -> (args, kwargs) of the saved module calls
    self._save_inputs = save_inputs
    self.values = dict(values)
    self.infos = dict(infos)
    self._program = program
    self._args = tuple(args)
    self._consts = tuple(consts)
    self._spec = spec if spec is not None else Spec(())
    self._staged = staged if staged is not None else Spec(())
    self._save = save
    self.frontier = dict(frontier or {})
    self._replay_starts = replay_starts
    self._replay_layers = tuple(replay_layers)
    self._keep_inputs = keep_inputs
    self.stale = stale
    self._module = module
    self._call = call
    # The index of the first rule of the spec applied by a replay (the ones before it ran
    # live, in the capture), or None when none was: views say what was recomputed.
    self._replayed_from = replayed_from

  # -- pytree -------------------------------------------------------------

  def tree_flatten(self):
    labels = tuple(self.values)
    flabels = tuple(self.frontier)
    ilabels = tuple(self.inputs)
    children = (
      self.output,
      tuple(self.values[k] for k in labels),
      self._args,
      self._consts,
      self._spec,
      self._staged,
      tuple(self.frontier[k] for k in flabels),
      tuple(self.inputs[k] for k in ilabels),
    )
    aux = _Static(
      labels,
      tuple(self.infos.get(k) for k in labels),
      _Ident(self._program),
      self._save,
      flabels,
      self._replay_starts,
      self._replay_layers,
      self.stale,
      self._keep_inputs,
      _Ident(self._module),
      self._call,
      ilabels,
      self._save_inputs,
      self._replayed_from,
    )
    return children, aux

  @classmethod
  def tree_unflatten(cls, aux: "_Static", children):
    output, vals, args, consts, spec, staged, fvals, ivals = children
    return cls(
      output,
      dict(zip(aux.labels, vals)),
      dict(zip(aux.labels, aux.infos)),
      program=aux.program.obj,
      args=args,
      consts=consts,
      spec=spec,
      staged=staged,
      save=aux.save,
      frontier=dict(zip(aux.frontier_labels, fvals)),
      replay_starts=aux.replay_starts,
      replay_layers=aux.replay_layers,
      stale=aux.stale,
      keep_inputs=aux.keep_inputs,
      module=aux.module.obj,
      call=aux.call,
      inputs=dict(zip(aux.input_labels, ivals)),
      save_inputs=aux.save_inputs,
      replayed_from=aux.replayed_from,
    )

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
    if label in self.values:
      value, info = self.values[label], self.infos.get(label)
      if layer is not None and info is not None and info.layers is not None:
        return jax.lax.dynamic_index_in_dim(value, layer, keepdims=False)
      return value
    if static_layer is not None and f"{label}[{static_layer}]" in self.values:
      return self.values[f"{label}[{static_layer}]"]
    raise SiteError(
      f"{verb}: the donor trace saved no value at {label!r} (it saved {list(self.values)})",
      code="donor_site_missing",
      site=label,
      fix=f"capture the donor with save=jl.label({label!r}) or the default save=None",
    )

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

  # -- doors --------------------------------------------------------------

  @api_boundary
  def fork(self) -> "Trace":
    """A copy to edit; ``do`` never changes the trace it is called on."""
    return self._with()

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
      return self._with(staged=self._staged + new, stale=True)
    if engine == "rerun":
      return self._rerun(self._staged + new, model, inputs)
    return self._replay(self._staged + new, differentiable=opts.differentiable)

  @api_boundary
  def run(self, model=None, inputs=None) -> "Trace":
    """Executes the edits staged with ``engine="set_only"`` (replay, or rerun with a model)."""
    if not self._staged.rules:
      return self
    if model is not None or inputs is not None:
      return self._rerun(self._staged, model, inputs)
    return self._replay(self._staged, differentiable=False)

  @api_boundary
  def replay(self, frontier: dict) -> Any:
    """The output of a differentiable replay recomputed from new frontier values.

    ``jax.grad(lambda f: metric(r.replay(f)))(r.frontier)`` is the gradient of a
    metric with respect to the values entering the replayed computation
    (attribution patching).
    """
    if self._replay_starts is None:
      raise InvalidArgumentError(
        "replay(frontier) needs a trace from a differentiable replay",
        code="not_a_replay",
        fix="trace.do(site, edit, intervention=InterventionOptions(differentiable=True))",
      )
    prog = self._need_program("replay")
    if not isinstance(frontier, dict):
      raise InvalidArgumentError(
        f"replay(frontier) takes a dict of label -> value, got {type(frontier).__name__}",
        code="invalid_argument",
        fix="r.replay(r.frontier)",
      )
    for label, value in frontier.items():
      if label not in self.frontier:
        raise SiteError(
          f"replay(frontier): {label!r} is not a frontier value of this replay",
          code="unknown_site",
          site=label,
          candidates=list(self.frontier),
          fix=f"one of: {', '.join(self.frontier)}",
        )
      want = self.frontier[label]
      if jnp.shape(value) != jnp.shape(want) or jnp.result_type(value) != jnp.result_type(want):
        raise ShapeError(
          f"replay(frontier): {label!r} has shape {jnp.shape(value)} and dtype "
          f"{jnp.result_type(value)}, the frontier value {jnp.shape(want)} and "
          f"{jnp.result_type(want)}",
          code="shape_mismatch",
          site=label,
          fix=f"pass a value like r.frontier[{label!r}]",
          expected=str(jnp.shape(want)),
          received=str(jnp.shape(value)),
        )
    # Start sites that began from their saved value did so through the frontier (this
    # trace's saved value there is the edited one): they start from it again.
    reused = tuple(lbl for lbl in self._replay_starts if lbl in self.frontier)
    ev = interpret.evaluate(
      prog,
      self._args,
      self._consts,
      self._spec.rules,
      None,
      known=self.values,
      start_labels=self._replay_starts,
      frontier_values={**{lbl: self.frontier[lbl] for lbl in reused}, **frontier},
      releaf_layers=dict(self._replay_layers) or None,
      reuse_labels=reused,
    )
    return interpret.program_output(prog, ev, self.output)

  # -- implementation -----------------------------------------------------

  def _with(self, **changes) -> "Trace":
    fields = dict(
      program=self._program,
      args=self._args,
      consts=self._consts,
      spec=self._spec,
      staged=self._staged,
      save=self._save,
      frontier=self.frontier,
      replay_starts=self._replay_starts,
      replay_layers=self._replay_layers,
      stale=self.stale,
      keep_inputs=self._keep_inputs,
      module=self._module,
      call=self._call,
      inputs=self.inputs,
      save_inputs=self._save_inputs,
      replayed_from=self._replayed_from,
    )
    output = changes.pop("output", self.output)
    values = changes.pop("values", self.values)
    infos = changes.pop("infos", self.infos)
    fields.update(changes)
    return Trace(output, values, infos, **fields)

  def _need_program(self, what, *, inputs=True):
    if self._program is None:
      raise InvalidArgumentError(
        f"{what} needs a trace captured by jl.trace",
        code="not_a_capture",
        fix="t = jl.trace(model, variables, x)",
      )
    if inputs and not self._keep_inputs:
      raise InvalidArgumentError(
        f"{what} needs the call's variables and inputs, and this trace was captured with "
        "keep_inputs=False",
        code="trace_without_inputs",
        fix="jl.trace(model, variables, x) (keep_inputs=True, the default), or rerun with "
        "trace.fork().do(site, edit, model=model.bind(variables), inputs=x)",
      )
    if inputs and self._keep_inputs:
      self._check_not_batched(what)
    return self._program

  def _check_not_batched(self, what):
    """Refuses a trace whose arrays carry axes its program does not have.

    A Trace returned from ``jax.vmap`` holds every value with the batch axis in front,
    but its captured program is the per-example one: replaying it would feed batched
    values to per-example operations.
    """
    shapes = getattr(self._program, "in_shapes", None)
    if shapes is None:
      return
    for arg, shape in zip(self._args, shapes):
      got = jnp.shape(arg)
      if got != tuple(shape):
        raise InvalidArgumentError(
          f"{what}: this trace holds values of shape {got} where its captured program has "
          f"{tuple(shape)}: it was returned from jax.vmap (or another batching transform), "
          "which adds a batch axis to every value but not to the program",
          code="batched_trace",
          expected=tuple(shape),
          received=got,
          fix="replay per example under the same transform: "
          "jax.vmap(lambda t: t.fork().do(site, edit).output)(trace)",
        )

  def _replay(self, new: Spec, *, differentiable: bool) -> "Trace":
    prog = self._need_program("replay")
    starts = []
    first_layers: dict[str, int] = {}
    for selector, _edit in new.rules:
      program.check_selectable(prog, selector, "do()")
      hits = [i.label for i in prog.infos if site_hits(selector, i)]
      if not hits:
        raise unmatched_error(selector, prog.infos, "do()")
      starts.extend(hits)
      for info in prog.infos:
        layers = matched_layers(selector, info)
        if layers:
          first_layers[info.label] = min(layers + [first_layers.get(info.label, layers[0])])
    rules = self._spec.rules + new.rules
    spec = Spec(rules)
    # A start site whose saved value no earlier rule edited is read, not recomputed:
    # the replay is the downstream cone of the edit, from that value.
    by_label = {i.label: i for i in prog.infos}
    reuse = tuple(
      lbl
      for lbl in dict.fromkeys(starts)
      if lbl in self.values
      and lbl in by_label
      and not any(site_hits(sel, by_label[lbl]) for sel, _ in self._spec.rules)
    )
    asks = runtime.asks_keep_grad(new.rules)
    if asks:
      if differentiable:
        warn_once(
          "keep_grad under differentiable replay: the edit stays connected inside the "
          "replayed computation, but parameters upstream of the replay frontier get no "
          "gradient; the live door jl.when(site, keep_grad(edit)).bind(model)(x) reaches them",
          code="keep_grad_replay_frontier",
        )
      found = interpret.probe_sites(
        prog,
        self._args,
        self._consts,
        rules,
        known=self.values,
        start_labels=tuple(starts),
        releaf=differentiable,
        reuse_labels=reuse,
      )
      if not differentiable:
        # (Re-leafed frontier values are fresh inputs of a differentiable replay: a
        # site computed from them has a graph inside the replayed computation.)
        runtime.raise_no_graph(*found)
    ev = interpret.evaluate(
      prog,
      self._args,
      self._consts,
      rules,
      self._save,
      known=self.values,
      start_labels=tuple(starts),
      releaf=differentiable,
      grad_disabled=runtime.grad_disabled(),
      releaf_layers=first_layers if differentiable else None,
      reuse_labels=reuse,
    )
    values = dict(self.values)
    values.update(ev.saved)
    inputs = dict(self.inputs)
    inputs.update(ev.saved_inputs)
    return self._with(
      inputs=inputs,
      output=interpret.program_output(prog, ev, self.output),
      values=values,
      spec=spec,
      staged=Spec(()),
      stale=False,
      frontier=ev.frontier if differentiable else {},
      replay_starts=tuple(starts) if differentiable else None,
      replay_layers=tuple(sorted(first_layers.items())) if differentiable else (),
      replayed_from=len(self._spec.rules) if self._replayed_from is None else self._replayed_from,
    )

  def _rerun(self, new: Spec, model, inputs) -> "Trace":
    prog = self._need_program("rerun", inputs=False)
    if self._keep_inputs:
      variables, old_inputs = jax.tree.unflatten(prog.in_tree, self._args)
    else:
      variables = old_inputs = None
    saved_used = inputs is None
    if model is None:
      module = self._module
      saved_used = True
    else:
      module, bound = model_calls.split(model)
      variables = variables if bound is None else bound
      saved_used = saved_used or bound is None
    if saved_used and self._keep_inputs:
      self._check_not_batched("rerun")
    if inputs is None:
      inputs = old_inputs
    if variables is None or inputs is None:
      self._need_program("rerun without a bound model= and inputs=")
    elif not isinstance(inputs, tuple):
      inputs = (inputs,)
    method, apply_kwargs, kwargs = self._call
    return _capture(
      module,
      variables,
      inputs,
      dict(kwargs),
      self._spec + new,
      self._save,
      save_given=False,
      method=method,
      apply_kwargs=dict(apply_kwargs),
      keep_inputs=self._keep_inputs,
      save_inputs=self._save_inputs,
    )


@dataclasses.dataclass(frozen=True, eq=False)
class _Ident:
  """Identity-compared holder for static objects (programs, modules)."""

  obj: Any

  def __eq__(self, other):
    return isinstance(other, _Ident) and other.obj is self.obj

  def __hash__(self):
    return id(self.obj)


def _capture(
  call,
  variables,
  inputs,
  kwargs,
  spec: Spec,
  save,
  *,
  save_given,
  method,
  apply_kwargs,
  keep_inputs=True,
  save_inputs=False,
) -> Trace:
  run = interpret.capture(
    call,
    variables,
    inputs,
    kwargs,
    spec.rules,
    save,
    save_given=save_given,
    method=method,
    apply_kwargs=apply_kwargs,
    save_inputs=save_inputs,
  )
  ev, args, consts = run.evaluation, run.args, run.consts
  kw = (method, tuple(sorted(apply_kwargs.items())), tuple(sorted(kwargs.items())))
  if not keep_inputs:
    args, consts = (), ()
  return Trace(
    run.output,
    ev.saved,
    ev.saved_infos,
    program=run.program,
    args=args,
    consts=consts,
    spec=spec,
    save=save,
    module=call,
    call=kw,
    keep_inputs=keep_inputs,
    inputs=ev.saved_inputs,
    save_inputs=save_inputs,
  )


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
  module, variables = model_calls.split(model)
  if isinstance(method, str) and not callable(getattr(model, method, None)):
    raise InvalidArgumentError(
      f"{type(model).__name__} has no method {method!r}",
      code="invalid_argument",
      fix="method=None (the module's __call__)",
    )
  if variables is None:
    if not args:
      raise InvalidArgumentError(
        "an unbound module needs its variables as the first argument",
        code="missing_variables",
        fix="jl.trace(model, variables, x)",
      )
    variables, args = args[0], args[1:]
    model_calls.check_variables(
      variables, model, "jl.trace(model, variables, x), or jl.trace(model.bind(variables), x)"
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
  return _capture(
    module,
    variables,
    tuple(args),
    model_kwargs,
    as_spec(intervene),
    selector,
    save_given=save_given,
    method=method,
    apply_kwargs=apply_kwargs,
    keep_inputs=keep_inputs,
    save_inputs=save_inputs,
  )
