"""Floor 2: the views of traces, specs and selectors (plain data that ``render`` draws).

A trace's view is its site tree (module paths nested as in the model), each site with its
module type, its value and what happened to it: written by an edit (which keeps or cuts the
gradient), recomputed by a replay (the downstream cone of the edited sites), downstream of a
live edit, re-leafed (a differentiable replay's frontier) or not saved; with the output and
the spec that ran (where each rule fired). A spec's or a selector's view, given a trace's
sites, says which sites each rule or the selector selects.
"""

from __future__ import annotations

from jaxlens._src.render import (
  ModuleView,
  RuleView,
  SelectorView,
  SiteView,
  SpecView,
  TraceView,
  keeps,
)
from jaxlens._src.sites import hits

__all__ = ["selector_view", "spec_view", "trace_view"]


def _fired(rules, infos) -> list[list[str]]:
  """For each rule, the labels of the sites it selects in this run."""
  return [[i.label for i in infos if hits(selector, i)] for selector, _ in rules]


def _downstream(trace, starts: set[str]) -> set[str]:
  """The labels of the sites downstream of ``starts``: what a replay of them recomputes."""
  program = getattr(trace, "_program", None)
  nodes = getattr(program, "nodes", None)
  if not starts or nodes is None:
    return set()
  tainted: set = set()
  out: set[str] = set()
  for node in nodes:
    infos = [i for i in getattr(node, "infos", ()) if i is not None]
    sub = getattr(node, "sub", None)
    if sub is not None:
      infos += list(sub.infos)
    is_start = any(i.label in starts for i in infos)
    if is_start or any(not isinstance(a, tuple) and a in tainted for a in node.ins):
      tainted.update(node.outs)
      out.update(i.label for i in infos)
  return out - starts


def _site_state(label, edited, downstream, frontier, saved, live=frozenset()) -> str:
  if label in edited:
    return "keep" if all(keeps(e) for e in edited[label]) else "cut"
  if label in frontier:
    return "frontier"
  if label in downstream:
    return "downstream"
  if label in live:
    return "live downstream"
  return "" if saved else "not saved"


def trace_view(trace) -> TraceView:
  infos = list(trace.sites)
  rules = tuple(trace.spec.rules)
  fired = _fired(rules, infos)
  edited: dict[str, list] = {}
  replayed: set[str] = set()  # sites edited by a rule that a replay applied
  first_replayed = getattr(trace, "_replayed_from", None)
  for i, ((_, edit), labels) in enumerate(zip(rules, fired)):
    for lbl in labels:
      edited.setdefault(lbl, []).append(edit)
      if first_replayed is not None and i >= first_replayed:
        replayed.add(lbl)
  # A replay recomputes the cone of what it edits; the rest of an edit's downstream sites
  # were computed with it live, in the capture (nothing was recomputed for them).
  downstream = _downstream(trace, replayed)
  live = _downstream(trace, set(edited)) - downstream
  frontier = dict(getattr(trace, "frontier", {}) or {})
  values = dict(trace.values)
  inputs = dict(getattr(trace, "inputs", None) or {})
  saved_infos = {k: i for k, i in trace.infos.items() if i is not None}

  def site(info, value, saved=True):
    lbl = info.label
    return SiteView(
      lbl,
      info.kind,
      info.module_type if info.kind == "module" else info.func,
      value,
      tuple(edited.get(lbl, ())),
      _site_state(lbl, edited, downstream, frontier, saved, live),
      inputs.get(lbl),
    )

  root = ModuleView("", "", None, {}, [])

  def node_at(path: str) -> ModuleView:
    node = root
    for part in [p for p in path.split("/") if p]:
      node = node.children.setdefault(part, ModuleView(part, "", None, {}, []))
    return node

  seen = set()
  # Module sites in the order they ran (saved or not), then the saved op sites.
  for info in infos:
    if info.kind != "module" or info.layer is not None or info.label in seen:
      continue
    seen.add(info.label)
    node = node_at(info.path)
    node.module_type = node.module_type or info.module_type
    sv = site(info, values.get(info.label), saved=info.label in values)
    if node.out is None and info.method == "__call__" and info.call == 1:
      node.out = sv
    else:
      node.ops.append(sv)
  for lbl, info in saved_infos.items():
    if lbl in seen:
      continue
    seen.add(lbl)
    node_at(info.path).ops.append(site(info, values[lbl]))
  output = trace.output
  if root.out is None and "output" not in seen:
    state = "downstream" if replayed else "live downstream" if edited else ""
    root.out = SiteView("output", "module", "output", output, state=state)
  root.module_type = root.module_type or "model"
  staged = tuple(getattr(getattr(trace, "_staged", None), "rules", ()))
  spec = SpecView(
    tuple(RuleView(s, e, tuple(f)) for (s, e), f in zip(rules, fired)),
    tuple(RuleView(s, e, None) for s, e in staged),
  )
  counts = {
    "saved": len(values),
    "sites": len(infos),
    "edited": len(edited),
    "downstream": len(downstream & set(values)),
    "live downstream": len(live & set(values)),
    "frontier": len(frontier),
  }
  return TraceView(output, root, spec, frontier, bool(getattr(trace, "stale", False)), counts)


def spec_view(spec, infos=None) -> SpecView:
  """A spec's view; with ``infos`` (a trace's sites), where each rule fires among them."""
  fired = _fired(spec.rules, infos) if infos is not None else [None] * len(spec.rules)
  return SpecView(
    tuple(RuleView(s, e, None if f is None else tuple(f)) for (s, e), f in zip(spec.rules, fired))
  )


def selector_view(selector, infos=None) -> SelectorView:
  """A selector's view; with ``infos`` (a trace's sites), the sites it selects among them."""
  return SelectorView(
    selector, None if infos is None else tuple(_fired([(selector, None)], infos)[0])
  )
