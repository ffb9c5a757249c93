"""Floor 6: the live door: the model runs with an interceptor at every module call.

At each module method call the interceptor records the site value, applies the
rules whose selectors match (``runtime.fire_rules``), and returns the edited value
to the model (through ``model_calls``: ``flax.linen.intercept_methods`` for linen,
an equivalent interception of ``__call__`` for NNX).

What cannot be intercepted: code that is not a Flax module method call (a plain
``jnp`` function between modules is part of the enclosing module's site), and
modules inside lifted transforms that hide their calls from the interceptor.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxlens._src import dependence, runtime
from jaxlens._src.edit import FireContext
from jaxlens._src.sites import SiteInfo, unmatched_error


class LiveRun:
  """The mutable state of one live door call, alive while the model is traced."""

  def __init__(self, rules, save, grad_disabled: bool, probe: bool = False, step=None):
    self.rules = rules
    self.firing = runtime.Firing(len(rules), probe)
    self.save = save
    self.seen: list[SiteInfo] = []
    self.calls: dict[tuple, int] = {}
    self.values: dict[str, tuple[SiteInfo, Any]] = {}
    self.saved: dict[str, Any] = {}
    self.infos: dict[str, SiteInfo] = {}
    self.grad_disabled = grad_disabled
    self.step = step

  def interceptor(self, next_fun, args, kwargs, context):
    out = next_fun(*args, **kwargs)
    path = "/".join(context.path)
    key = (path, context.method_name)
    self.calls[key] = self.calls.get(key, 0) + 1
    info = SiteInfo(path, context.method_name, self.calls[key], context.module_type)
    self.seen.append(info)
    ctx = FireContext(
      info.label,
      path,
      info.module_type,
      site_values=self.values,
      grad_disabled=self.grad_disabled,
      step=self.step,
    )
    elements = runtime.output_elements(out)
    if elements:
      # A tuple/list/dict output: each array element is a site of its own (output=k).
      new = {}
      for k, value in elements:
        one = dataclasses.replace(info, output=k)
        self.seen.append(one)
        ctx_k = dataclasses.replace(ctx, label=one.label)
        edited = runtime.fire_rules(self.rules, one, value, ctx_k, self.firing)
        if edited is not value:
          new[k] = edited
        self._record(one, edited)
      out = runtime.replace_elements(out, new)
    out = runtime.fire_rules(self.rules, info, out, ctx, self.firing)
    self._record(info, out)
    return out

  def _record(self, info, value):
    self.values[info.label] = (info, value)
    if self.save is not None and self.save.matches(info):
      self.saved[info.label] = value
      self.infos[info.label] = info

  def check(self, save_given: bool):
    for (selector, _), count in zip(self.rules, self.firing.fired):
      if count == 0:
        raise unmatched_error(selector, self.seen, "intervene=")
    if save_given and not self.saved:
      raise unmatched_error(self.save, self.seen, "save=")


def _probe_site_graphs(call, variables, inputs, kwargs, rules, method, apply_kwargs, step):
  """Raises site_has_no_graph where a keep_grad site value depends on no float input.

  It traces the model abstractly once with the edits applied, returning the site
  values of the keep_grad rules, and reads off the jaxpr of their derivative
  whether they depend on any float leaf of the variables or inputs.
  """
  labels: list[str] = []
  dtypes: list = []

  def probe_fn(variables, inputs):
    run = LiveRun(rules, None, False, probe=True, step=step)
    call.run(variables, inputs, kwargs, run.interceptor, method, apply_kwargs)
    recorded = run.firing.recorded
    labels[:] = [lbl for lbl, _ in recorded]
    dtypes[:] = [v.dtype for _, v in recorded]
    return [v for _, v in recorded]

  table, _ = dependence.outputs_depend_on_inputs(probe_fn, variables, inputs)
  runtime.raise_no_graph(labels, table, dtypes)


def run_live(
  call,
  variables,
  inputs,
  kwargs,
  rules,
  *,
  save=None,
  method=None,
  apply_kwargs=None,
  save_given=False,
  step=None,
):
  """Runs ``call`` (from ``model_calls.split``) with ``rules`` live: ``(output, LiveRun)``."""
  apply_kwargs = dict(apply_kwargs or {})
  disabled = runtime.grad_disabled()
  if disabled:
    variables, inputs = runtime.stop(variables), runtime.stop(inputs)
  probed = False
  if not disabled and runtime.asks_keep_grad(rules):
    _probe_site_graphs(call, variables, inputs, kwargs, rules, method, apply_kwargs, step)
    probed = True
  run = LiveRun(rules, save, disabled, step=step)
  out = call.run(variables, inputs, kwargs, run.interceptor, method, apply_kwargs)
  run.check(save_given)
  if run.firing.hook_asked and not probed:
    # A hook asked for keep_grad through an InterventionDecision: check its site now.
    _probe_site_graphs(call, variables, inputs, kwargs, rules, method, apply_kwargs, step)
  return out, run
