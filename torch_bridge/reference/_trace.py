"""Trace and the capture doors: replay, rerun, set_only + run, differentiable replay
(pairs with ``jaxlens/_src/tracing.py``, the record, and ``replay.py``, its engines).
"""

from __future__ import annotations

import torch

from jaxlens import InterventionOptions, InvalidArgumentError, SiteError, SiteValue
from torch_bridge.reference._doors import Spec, _as_rule, _Recorder, _run, _warn_once
from torch_bridge.reference._edit import Donor, SiteContext, _asks_keep_grad, fire

# --------------------------------------------------------------------------
# Trace and the capture doors: replay, rerun, set_only + run, differentiable replay.


class Trace(Donor):
  """A torch run with every module's output saved (with its graph).

  ``trace["0"].out`` is module ``"0"``'s output, ``trace.output`` the model's.
  """

  def __init__(
    self, output, values, model, inputs, spec=None, staged=None, frontier=None, stale=False
  ):
    self.output = output
    self.values = dict(values)
    self.model = model
    self.inputs = tuple(inputs)
    self.spec = spec if spec is not None else Spec()
    self.staged = staged if staged is not None else Spec()
    self.frontier = dict(frontier or {})
    self.stale = stale

  def __getitem__(self, name: str) -> SiteValue:
    if name not in self.values:
      raise SiteError(
        f"this trace saved no module {name!r}",
        code="unknown_site",
        site=name,
        candidates=list(self.values)[:10],
        fix=f"one of {list(self.values)[:5]}",
      )
    return SiteValue(name, self.values[name])

  def value_for_donor(self, label: str, verb: str) -> torch.Tensor:
    if label in self.values:
      return self.values[label]
    raise SiteError(
      f"{verb}: the donor trace saved no value at {label!r}",
      code="donor_site_missing",
      site=label,
      fix="capture the donor with ref.trace",
    )

  def fork(self) -> "Trace":
    """A copy to edit (``do`` never changes the trace it is called on)."""
    return Trace(
      self.output,
      self.values,
      self.model,
      self.inputs,
      self.spec,
      self.staged,
      self.frontier,
      self.stale,
    )

  def do(
    self,
    site,
    edit=None,
    *,
    model=None,
    inputs=None,
    intervention: InterventionOptions | None = None,
  ) -> "Trace":
    """Applies an edit and returns the new trace (replay, rerun or set_only, as in jaxlens)."""
    opts = intervention or InterventionOptions()
    new = site if isinstance(site, Spec) and edit is None else Spec((_as_rule(site, edit),))
    engine = opts.engine
    if engine == "auto":
      engine = "rerun" if model is not None or inputs is not None else "replay"
    if engine == "set_only":
      return Trace(
        self.output, self.values, self.model, self.inputs, self.spec, self.staged + new, stale=True
      )
    if engine == "rerun":
      return self._rerun(self.staged + new, model, inputs)
    return self._replay(self.staged + new, differentiable=opts.differentiable)

  def run(self, model=None, inputs=None) -> "Trace":
    """Executes the staged edits (replay, or rerun with ``model``/``inputs``)."""
    if not self.staged.rules:
      return self
    if model is not None or inputs is not None:
      return self._rerun(self.staged, model, inputs)
    return self._replay(self.staged, differentiable=False)

  def _rerun(self, new: Spec, model, inputs) -> "Trace":
    model = self.model if model is None else model
    if inputs is None:
      inputs = self.inputs
    elif not isinstance(inputs, tuple):
      inputs = (inputs,)
    return trace(model, *inputs, intervene=self.spec + new)

  def _replay(self, new: Spec, *, differentiable: bool) -> "Trace":
    """Re-runs the children downstream of the earliest edited child from its saved value."""
    model = self.model
    children = (
      [n for n, _ in model.named_children()] if isinstance(model, torch.nn.Sequential) else []
    )
    sites = [s for s, _ in new.rules]
    if not children or any(s not in children for s in sites):
      raise InvalidArgumentError(
        "the torch reference replays edits at the children of an nn.Sequential root only",
        code="replay_unsupported",
        site=", ".join(sites),
        fix="rerun instead: trace.fork().do(site, edit, model=model, inputs=x)",
      )
    k = min(children.index(s) for s in sites)
    start = children[k]
    value = self.values[start]
    frontier = {}
    if differentiable:
      if any(_asks_keep_grad(e) for _, e in new.rules):
        _warn_once(
          "keep_grad under differentiable replay: the edit stays connected inside the "
          "replayed computation, but parameters upstream of the replay frontier get no "
          "gradient; the live door ref.when(site, keep_grad(edit)).bind(model)(x) reaches them",
          code="keep_grad_replay_frontier",
        )
      value = value.detach().requires_grad_()
      frontier[start] = value
    upstream = children[: k + 1]
    values = {n: v for n, v in self.values.items() if _inside(n, upstream)}
    ctx = SiteContext(start, values)
    for site, edit in new.rules:
      if site == start:
        value = fire(edit, value, ctx)
    values[start] = value
    # Downstream children run with the hooks of every rule (the trace's own and the new).
    downstream = Spec(tuple(r for r in self.spec.rules + new.rules if not _inside(r[0], upstream)))
    rec = _Recorder(model, downstream.rules, skip_root=True)
    rec.values.update(values)
    try:
      for name in children[k + 1 :]:
        value = model.get_submodule(name)(value)
    finally:
      rec.close()
    rec.check()
    values = rec.values
    return Trace(value, values, model, self.inputs, self.spec + new, frontier=frontier)


def _inside(name: str, children) -> bool:
  """Whether module ``name`` is one of ``children`` or nested in one of them."""
  return any(name == c or name.startswith(c + ".") for c in children)


def trace(model: torch.nn.Module, *inputs, intervene: Spec | None = None, **kwargs) -> Trace:
  """Runs ``model`` with the edits of ``intervene`` live and saves every module's output."""
  spec = intervene if intervene is not None else Spec()
  out, values = _run(model, inputs, kwargs, spec)
  return Trace(out, values, model, inputs, spec)
