"""Floor 10: the engines behind a trace's doors: replay, rerun, set_only, frontier replay.

Each engine takes a trace record (``jaxlens._src.tracing.Trace``, a dataclass) and returns
a new one (``dataclasses.replace``) or its output; none changes the record it is given.

* :func:`replay` (``trace.fork().do(site, edit)``): evaluates the downstream cone of the
  edited sites from the saved values, without calling the model;
* :func:`rerun` (``do(..., model=, inputs=)``): calls the model again with every edit live;
* :func:`stage` (``engine="set_only"``): records the edit for ``run``;
* :func:`from_frontier` (``trace.replay(frontier)``): a differentiable replay's output
  recomputed from new frontier values;
* :func:`grad` (``trace.grad(metric, sites=...)``): gradients at sites, the model rerun.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from jaxlens._src import gradients, interpret, model_calls, program, runtime
from jaxlens._src.doors import Spec, as_spec
from jaxlens._src.errors import InvalidArgumentError, ShapeError, SiteError, warn_once
from jaxlens._src.sites import as_selector, matched_layers, unmatched_error
from jaxlens._src.sites import hits as site_hits

# ``trace`` below is a jaxlens._src.tracing.Trace (a floor up: not imported).


def record_of_capture(
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
) -> dict:
  """Captures a model call (``interpret.capture``) and returns the fields of its trace."""
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
  if not keep_inputs:
    args, consts = (), ()
  return dict(
    output=run.output,
    values=ev.saved,
    infos=ev.saved_infos,
    _program=run.program,
    _args=args,
    _consts=consts,
    _spec=spec,
    _save=save,
    _module=call,
    _call=(method, tuple(sorted(apply_kwargs.items())), tuple(sorted(kwargs.items()))),
    _keep_inputs=keep_inputs,
    inputs=ev.saved_inputs,
    _save_inputs=save_inputs,
  )


def need_program(trace, what: str, *, inputs: bool = True):
  """The trace's captured program; refuses a trace that cannot be replayed (``what`` says
  which door asked)."""
  if trace._program is None:
    raise InvalidArgumentError(
      f"{what} needs a trace captured by jl.trace",
      code="not_a_capture",
      fix="t = jl.trace(model, variables, x)",
    )
  if inputs and not trace._keep_inputs:
    raise InvalidArgumentError(
      f"{what} needs the call's variables and inputs, and this trace was captured with "
      "keep_inputs=False",
      code="trace_without_inputs",
      fix="jl.trace(model, variables, x) (keep_inputs=True, the default), or rerun with "
      "trace.fork().do(site, edit, model=model.bind(variables), inputs=x)",
    )
  if inputs and trace._keep_inputs:
    _check_not_batched(trace, what)
  return trace._program


def _check_not_batched(trace, what):
  """Refuses a trace whose arrays carry axes its program does not have.

  A Trace returned from ``jax.vmap`` holds every value with the batch axis in front,
  but its captured program is the per-example one: replaying it would feed batched
  values to per-example operations.
  """
  shapes = getattr(trace._program, "in_shapes", None)
  if shapes is None:
    return
  for arg, shape in zip(trace._args, shapes):
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


def stage(trace, new: Spec):
  """``engine="set_only"``: the edit is recorded, and ``run`` executes it."""
  return dataclasses.replace(trace, _staged=trace._staged + new, stale=True)


def replay(trace, new: Spec, *, differentiable: bool):
  """Replays ``new`` on the trace: only the downstream cone of its sites is recomputed."""
  prog = need_program(trace, "replay")
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
  rules = trace._spec.rules + new.rules
  # A start site whose saved value no earlier rule edited is read, not recomputed:
  # the replay is the downstream cone of the edit, from that value.
  by_label = {i.label: i for i in prog.infos}
  reuse = tuple(
    lbl
    for lbl in dict.fromkeys(starts)
    if lbl in trace.values
    and lbl in by_label
    and not any(site_hits(sel, by_label[lbl]) for sel, _ in trace._spec.rules)
  )
  cone = interpret.Replay(tuple(starts), trace.values, releaf=differentiable, reuse=reuse)
  if runtime.asks_keep_grad(new.rules):
    if differentiable:
      warn_once(
        "keep_grad under differentiable replay: the edit stays connected inside the "
        "replayed computation, but parameters upstream of the replay frontier get no "
        "gradient; the live door jl.when(site, keep_grad(edit)).bind(model)(x) reaches them",
        code="keep_grad_replay_frontier",
      )
    found = interpret.probe_sites(
      prog, trace._args, trace._consts, interpret.Plan(rules, replay=cone)
    )
    if not differentiable:
      # (Re-leafed frontier values are fresh inputs of a differentiable replay: a
      # site computed from them has a graph inside the replayed computation.)
      runtime.raise_no_graph(*found)
  plan = interpret.Plan(
    rules,
    trace._save,
    grad_disabled=runtime.grad_disabled(),
    releaf_layers=first_layers if differentiable else None,
    replay=cone,
  )
  ev = interpret.evaluate(prog, trace._args, trace._consts, plan)
  return dataclasses.replace(
    trace,
    inputs={**trace.inputs, **ev.saved_inputs},
    output=interpret.program_output(prog, ev, trace.output),
    values={**trace.values, **ev.saved},
    infos={**trace.infos, **ev.saved_infos},
    _spec=Spec(rules),
    _staged=Spec(()),
    stale=False,
    frontier=ev.frontier if differentiable else {},
    _replay_starts=tuple(starts) if differentiable else None,
    _replay_layers=tuple(sorted(first_layers.items())) if differentiable else (),
    _replayed_from=len(trace._spec.rules) if trace._replayed_from is None else trace._replayed_from,
  )


def rerun(trace, new: Spec, model, inputs):
  """Calls the model again (``model``, or the trace's) with the trace's edits and ``new``."""
  prog = need_program(trace, "rerun", inputs=False)
  if trace._keep_inputs:
    variables, old_inputs = jax.tree.unflatten(prog.in_tree, trace._args)
  else:
    variables = old_inputs = None
  saved_used = inputs is None
  if model is None:
    module = trace._module
    saved_used = True
  else:
    module, bound = model_calls.split(model)
    variables = variables if bound is None else bound
    saved_used = saved_used or bound is None
  if saved_used and trace._keep_inputs:
    _check_not_batched(trace, "rerun")
  if inputs is None:
    inputs = old_inputs
  if variables is None or inputs is None:
    need_program(trace, "rerun without a bound model= and inputs=")
  elif not isinstance(inputs, tuple):
    inputs = (inputs,)
  method, apply_kwargs, kwargs = trace._call
  return type(trace)(
    **record_of_capture(
      module,
      variables,
      inputs,
      dict(kwargs),
      trace._spec + new,
      trace._save,
      save_given=False,
      method=method,
      apply_kwargs=dict(apply_kwargs),
      keep_inputs=trace._keep_inputs,
      save_inputs=trace._save_inputs,
    )
  )


def from_frontier(trace, frontier: dict) -> Any:
  """The output of a differentiable replay recomputed from new frontier values."""
  if trace._replay_starts is None:
    raise InvalidArgumentError(
      "replay(frontier) needs a trace from a differentiable replay",
      code="not_a_replay",
      fix="trace.do(site, edit, intervention=InterventionOptions(differentiable=True))",
    )
  prog = need_program(trace, "replay")
  if not isinstance(frontier, dict):
    raise InvalidArgumentError(
      f"replay(frontier) takes a dict of label -> value, got {type(frontier).__name__}",
      code="invalid_argument",
      fix="r.replay(r.frontier)",
    )
  for label, value in frontier.items():
    if label not in trace.frontier:
      raise SiteError(
        f"replay(frontier): {label!r} is not a frontier value of this replay",
        code="unknown_site",
        site=label,
        candidates=list(trace.frontier),
        fix=f"one of: {', '.join(trace.frontier)}",
      )
    want = trace.frontier[label]
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
  reused = tuple(lbl for lbl in trace._replay_starts if lbl in trace.frontier)
  cone = interpret.Replay(
    trace._replay_starts,
    trace.values,
    frontier_values={**{lbl: trace.frontier[lbl] for lbl in reused}, **frontier},
    reuse=reused,
  )
  plan = interpret.Plan(
    trace._spec.rules, None, releaf_layers=dict(trace._replay_layers) or None, replay=cone
  )
  ev = interpret.evaluate(prog, trace._args, trace._consts, plan)
  return interpret.program_output(prog, ev, trace.output)


def grad(trace, metric, sites) -> gradients.SiteGrads:
  """``gradients.grads_at_sites`` on the trace's model call, its edits live."""
  prog = need_program(trace, "grad")
  variables, inputs = jax.tree.unflatten(prog.in_tree, trace._args)
  method, apply_kwargs, kwargs = trace._call

  def run_trace(specs, save):
    selector = None
    for s in save:
      one = as_selector(s)
      selector = one if selector is None else selector | one
    return type(trace)(
      **record_of_capture(
        trace._module,
        variables,
        inputs,
        dict(kwargs),
        as_spec(specs),
        selector,
        save_given=True,
        method=method,
        apply_kwargs=dict(apply_kwargs),
        keep_inputs=False,
      )
    )

  return gradients.grads_at_sites(
    run_trace, metric, sites, list(trace._spec.rules and [trace._spec])
  )
