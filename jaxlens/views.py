"""Views of traces, specs, edits and selectors for people: treescope in notebooks, HTML files.

`treescope <https://treescope.readthedocs.io>`_ (installed with flax) renders
Python objects as foldable trees in notebooks. This module teaches it jaxlens's
objects:

* a :class:`~jaxlens.Trace`: the site tree (module paths nested as in the model),
  each site with its module type and its value (treescope shows shape, dtype and a
  summary: mean, spread, range, zeros), the output, the spec that ran with where
  each edit fired, and which sites a replay recomputed (the downstream cone of the
  edited sites) or a differentiable replay re-leafed (its frontier);
* a :class:`~jaxlens.Spec`: its rules, each edit coloured by what it does to the
  gradient (green: keeps it, red: cuts it) and marked when ``keep_grad`` is checked;
* an edit (``jl.scale(0.5)``), a selector (``jl.module("block_*")``).

Colours: green sites were written by an edit that keeps the gradient, red ones by
an edit that cuts it, blue ones were recomputed downstream of an edit, grey ones
were not saved.

Usage::

  from jaxlens import views
  views.show(trace)                 # in a notebook (treescope.show)
  views.to_html(trace, "trace.html")  # a file to open in a browser

``views.register()`` (called when this module is imported) makes
``treescope.show(trace)`` and treescope's notebook integration
(``treescope.basic_interactive_setup()``) use these views. treescope is imported
when this module is first used, never by ``import jaxlens``.
"""

from __future__ import annotations

import dataclasses
import html
from pathlib import Path
from typing import Any

from jaxlens import core as jl
from jaxlens.core import Site as _Site
from jaxlens.core import Spec as _Spec
from jaxlens.core import Trace as _Trace
from jaxlens.internal import hits, require
from jaxlens.intervention import Edit
from jaxlens.intervention import Edit as _Edit

__all__ = ["register", "render", "show", "to_html", "view"]

KEEP = "#c9efc9"  # written by an edit that keeps the gradient
CUT = "#f6c5bd"  # written by an edit that cuts it
DOWNSTREAM = "#d3e2f7"  # recomputed downstream of an edit (by a replay)
FRONTIER = "#f3e3b5"  # re-leafed by a differentiable replay
NOT_SAVED = "#eeeeee"

_LEGEND = (
  ("keeps the gradient", KEEP),
  ("cuts the gradient", CUT),
  ("downstream of an edit (computed with it live, or recomputed by a replay)", DOWNSTREAM),
  ("replay frontier (re-leafed)", FRONTIER),
  ("not saved", NOT_SAVED),
)


def _treescope():
  return require("treescope", feature="jaxlens.views", extra="plot")


# --------------------------------------------------------------------------
# What a trace says about its sites.


def _rules(trace) -> tuple:
  spec = getattr(trace, "spec", None)
  return tuple(getattr(spec, "rules", ()))


def _hits(selector, info) -> bool:
  return bool(hits(selector, info))


def _fired(rules, infos) -> list[list[str]]:
  """For each rule, the labels of the sites it selects in this run."""
  return [[i.label for i in infos if _hits(selector, i)] for selector, _ in rules]


def _keeps(edit) -> bool:
  return bool(getattr(edit, "keeps", True))


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


# --------------------------------------------------------------------------
# View objects: plain data that treescope renders.


@dataclasses.dataclass
class SiteView:
  """One site: its value (or ``None`` when not saved) and what happened to it."""

  label: str
  kind: str
  module_type: str
  value: Any
  edits: tuple = ()
  # "keep", "cut", "downstream" (recomputed by a replay), "live downstream" (computed with a
  # live edit in place), "frontier", "not saved" or ""
  state: str = ""
  input: Any = None  # the call's (args, kwargs), when the trace saved inputs


@dataclasses.dataclass
class ModuleView:
  """A module of the site tree: its output site, its submodules and the op sites it ran."""

  name: str
  module_type: str
  out: SiteView | None
  children: dict
  ops: list


@dataclasses.dataclass
class RuleView:
  selector: Any
  edit: Any
  fired_at: tuple | None  # None: not known (a spec on its own)


@dataclasses.dataclass
class SpecView:
  rules: tuple
  staged: tuple = ()


@dataclasses.dataclass
class EditView:
  edit: Any


@dataclasses.dataclass
class SelectorView:
  selector: Any
  matches: tuple | None = None


@dataclasses.dataclass
class TraceView:
  """A trace as the page shows it."""

  output: Any
  sites: ModuleView
  spec: SpecView
  frontier: dict
  stale: bool
  counts: dict


def _site_state(label, edited, downstream, frontier, saved, live=frozenset()) -> str:
  if label in edited:
    return "keep" if all(_keeps(e) for e in edited[label]) else "cut"
  if label in frontier:
    return "frontier"
  if label in downstream:
    return "downstream"
  if label in live:
    return "live downstream"
  return "" if saved else "not saved"


def _trace_view(trace) -> TraceView:
  infos = list(trace.sites)
  rules = _rules(trace)
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


def view(obj, *, trace=None) -> Any:
  """The view object of a jaxlens object (a Trace, Spec, edit or selector); else ``obj``.

  Args:
    obj: what to view.
    trace: for a selector or a spec, a trace whose sites they are matched against:
      the view then says which sites each selects (``# matches ...``, ``# fired at ...``).
  """

  register()

  if isinstance(obj, (TraceView, SpecView, EditView, SelectorView, ModuleView, SiteView)):
    return obj
  infos = list(trace.sites) if trace is not None else None
  if isinstance(obj, jl.Trace):
    return _trace_view(obj)
  if isinstance(obj, jl.Spec):
    fired = _fired(obj.rules, infos) if infos is not None else [None] * len(obj.rules)
    return SpecView(
      tuple(RuleView(s, e, None if f is None else tuple(f)) for (s, e), f in zip(obj.rules, fired))
    )
  if isinstance(obj, Edit):
    return EditView(obj)
  if isinstance(obj, jl.Site):
    return SelectorView(obj, None if infos is None else tuple(_fired([(obj, None)], infos)[0]))
  return obj


# --------------------------------------------------------------------------
# Rendering (treescope's intermediate representation).


def _comment(text: str):
  rp = _treescope().rendering_parts
  return rp.comment_color(rp.text(text))


def _node(
  prefix,
  items,
  path,
  subtree_renderer,
  *,
  color=None,
  comment=None,
  suffix=")",
  expand: bool = False,
):
  """A foldable ``prefix(name=value, ...)suffix  # comment`` node (``expand``: start open)."""
  rp = _treescope().rendering_parts
  children = []
  for n, (name, value) in enumerate(items):
    last = n == len(items) - 1
    comma = (
      rp.fold_condition(expanded=rp.text(","))
      if last
      else rp.siblings(",", rp.fold_condition(collapsed=rp.text(" ")))
    )
    child_path = None if path is None or name is None else f"{path}.{name}"
    rendered = (
      value
      if isinstance(value, rp.RenderableAndLineAnnotations)
      else subtree_renderer(value, path=child_path)
    )
    label = f"{name}=" if name is not None else ""
    children.append(
      rp.build_full_line_with_annotations(rp.siblings_with_annotations(label, rendered), comma)
    )
  node = rp.build_foldable_tree_node_from_children(
    prefix=rp.text(prefix) if isinstance(prefix, str) else prefix,
    children=children,
    suffix=rp.text(suffix),
    path=path,
    background_color=color,
    expand_state=rp.ExpandState.EXPANDED if expand else rp.ExpandState.WEAKLY_EXPANDED,
  )
  if comment:
    return rp.RenderableAndLineAnnotations(
      node.renderable, rp.siblings(node.annotations, _comment(f"  # {comment}"))
    )
  return node


def _one_line(text: str, path, *, color=None, comment=None):
  rp = _treescope().rendering_parts
  part = rp.text(text)
  if color is not None:
    part = rp.custom_style(part, css_style=f"background-color: {color}; border-radius: 3px;")
  line = rp.siblings_with_annotations(
    part, extra_annotations=[_comment(f"  # {comment}")] if comment else []
  )
  return rp.build_one_line_tree_node(line, path)


_STATE_COLOR = {
  "keep": KEEP,
  "cut": CUT,
  "downstream": DOWNSTREAM,
  "live downstream": DOWNSTREAM,
  "frontier": FRONTIER,
  "not saved": NOT_SAVED,
}
_STATE_TEXT = {
  "keep": "edited, keeps the gradient",
  "cut": "edited, cuts the gradient",
  "downstream": "recomputed downstream of an edit by a replay",
  "live downstream": "downstream of a live edit",
  "frontier": "replay frontier (re-leafed)",
  "not saved": "not saved",
}


def _edit_text(edit) -> str:
  return repr(edit)


def _styled(part, color):
  rp = _treescope().rendering_parts
  if color is None:
    return part
  return rp.custom_style(
    part, css_style=f"background-color: {color}; border-radius: 3px; padding: 0 2px;"
  )


def _render_site(sv: SiteView, path, subtree_renderer, *, name: str | None = None):
  """``name: <value>  # type; what happened``, coloured by what happened."""
  rp = _treescope().rendering_parts
  notes = [sv.module_type] if sv.module_type else []
  if sv.state:
    notes.append(_STATE_TEXT[sv.state])
  if sv.edits:
    notes.append("by " + ", ".join(_edit_text(e) for e in sv.edits))
  color = _STATE_COLOR.get(sv.state)
  head = _styled(rp.text(f"{name or sv.label}: "), color)
  if sv.value is None:
    body = rp.RenderableAndLineAnnotations(rp.text("(not saved)"), rp.empty_part())
  elif sv.input is not None:
    args, kwargs = sv.input
    body = _node(
      "(", [("input", args if not kwargs else sv.input), ("out", sv.value)], path, subtree_renderer
    )
  else:
    body = subtree_renderer(sv.value, path=path)
  return rp.RenderableAndLineAnnotations(
    rp.siblings(head, body.renderable),
    rp.siblings(
      body.annotations, _comment("  # " + "; ".join(notes)) if notes else rp.empty_part()
    ),
  )


def _render_module(mv: ModuleView, path, subtree_renderer, prefix: str = ""):
  label = f"{prefix}/{mv.name}" if prefix else mv.name
  items = []
  if mv.out is not None and (mv.out.value is not None or mv.out.state in ("keep", "cut")):
    items.append((None, _render_site(mv.out, None, subtree_renderer, name="out")))
  hidden = []  # submodules with nothing saved or edited anywhere below: one line for all
  for child in mv.children.values():
    if _shows(child):
      items.append((None, _render_module(child, None, subtree_renderer, label)))
    else:
      hidden.append(child.name)
  for op in mv.ops:
    if op.value is not None or op.state in ("keep", "cut"):
      items.append((None, _render_site(op, None, subtree_renderer)))
    else:
      hidden.append(op.label)
  if hidden:
    names = ", ".join(hidden[:6]) + (", ..." if len(hidden) > 6 else "")
    items.append((None, _one_line(f"({len(hidden)} not saved: {names})", None, color=NOT_SAVED)))
  color = (
    _STATE_COLOR.get(mv.out.state)
    if mv.out is not None and mv.out.state in ("keep", "cut")
    else None
  )
  title = _styled(
    _treescope().rendering_parts.text(f"{label or 'model'}: {mv.module_type or 'module'} {{"), color
  )
  # Open the model and every module that holds an edited site, so the edits show.
  return _node(
    title, items, path, subtree_renderer, suffix="}", expand=not prefix or _holds_edit(mv)
  )


def _shows(mv: ModuleView) -> bool:
  """Whether a module has a saved or edited site anywhere below it."""
  sites = ([mv.out] if mv.out is not None else []) + list(mv.ops)
  return any(s.value is not None or s.state in ("keep", "cut") for s in sites) or any(
    _shows(c) for c in mv.children.values()
  )


def _holds_edit(mv: ModuleView) -> bool:
  sites = ([mv.out] if mv.out is not None else []) + list(mv.ops)
  return any(s.state in ("keep", "cut") for s in sites) or any(
    _holds_edit(c) for c in mv.children.values()
  )


def _render_edit(edit, path, subtree_renderer):
  keeps = _keeps(edit)
  params = getattr(edit, "params", None)
  items = []
  if isinstance(params, dict):
    for k, v in params.items():
      if k == "edits":
        v = tuple(EditView(e) for e in v)
      elif k == "edit":
        v = EditView(v)
      elif getattr(v, "shape", None) == () and hasattr(v, "item"):
        v = v.item()  # a scalar (an array once it has been through jit): show the number
      items.append((k, v))
  for k, v in getattr(edit, "static", ()):
    if v is not None:
      items.append((k, v))
  mark = "jl.keep_grad(" if getattr(edit, "keep_grad", False) else ""
  comment = ("keeps the gradient" if keeps else "cuts the gradient") + (
    "; keep_grad: checked when it fires" if mark else ""
  )
  prefix = f"{mark}jl.{getattr(edit, 'name', type(edit).__name__)}("
  return _node(
    prefix,
    items,
    path,
    subtree_renderer,
    color=KEEP if keeps else CUT,
    comment=comment,
    suffix="))" if mark else ")",
  )


def _render_rule(rule: RuleView, path, subtree_renderer):
  where = None
  if rule.fired_at is not None:
    where = ("fired at " + ", ".join(rule.fired_at)) if rule.fired_at else "fired nowhere"
  return _node(
    "jl.when(",
    [(None, SelectorView(rule.selector)), (None, EditView(rule.edit))],
    path,
    subtree_renderer,
    comment=where,
  )


def _render_spec(sv: SpecView, path, subtree_renderer):
  items = [(None, _render_rule(r, None, subtree_renderer)) for r in sv.rules]
  items += [(None, _render_rule(r, None, subtree_renderer)) for r in sv.staged]
  comment = f"{len(sv.rules)} rules" + (
    f", {len(sv.staged)} staged (run() executes them)" if sv.staged else ""
  )
  return _node("jl.Spec(", items, path, subtree_renderer, comment=comment, expand=True)


def _render_trace(tv: TraceView, path, subtree_renderer):
  c = tv.counts
  summary = (
    f"{c['saved']} of {c['sites']} sites saved; {c['edited']} edited, "
    f"{c['downstream']} recomputed downstream"
    + (f", {c['live downstream']} downstream of a live edit" if c.get("live downstream") else "")
    + (f", {c['frontier']} frontier values" if c["frontier"] else "")
    + ("; stale: staged edits not run" if tv.stale else "")
  )
  # The output is the model's own site (``out`` at the top of the site tree).
  items = [
    ("sites", _render_module(tv.sites, None, subtree_renderer)),
    ("spec", _render_spec(tv.spec, None, subtree_renderer)),
  ]
  if tv.frontier:
    items.append(("frontier", tv.frontier))
  return _node("jl.Trace(", items, path, subtree_renderer, comment=summary, expand=True)


def _handler(node, path, subtree_renderer):
  """treescope's handler for jaxlens objects and their views."""

  if isinstance(node, (jl.Trace, jl.Spec, Edit, jl.Site)):
    node = view(node)
  if isinstance(node, TraceView):
    return _render_trace(node, path, subtree_renderer)
  if isinstance(node, SpecView):
    return _render_spec(node, path, subtree_renderer)
  if isinstance(node, EditView):
    return _render_edit(node.edit, path, subtree_renderer)
  if isinstance(node, SelectorView):
    comment = None if node.matches is None else "matches " + ", ".join(node.matches)
    return _one_line(repr(node.selector), path, comment=comment)
  if isinstance(node, ModuleView):
    return _render_module(node, path, subtree_renderer)
  if isinstance(node, SiteView):
    return _render_site(node, path, subtree_renderer)
  return NotImplemented


def render(obj, path, subtree_renderer):
  """The treescope rendering of a jaxlens object (what its ``__treescope_repr__`` returns)."""
  register()
  return _handler(obj, path, subtree_renderer)


_registered = False


def register() -> None:
  """Makes treescope render jaxlens objects with these views (idempotent)."""
  global _registered
  if _registered:
    return

  registry = _treescope().type_registries.TREESCOPE_HANDLER_REGISTRY
  for cls in (
    jl.Trace,
    jl.Spec,
    Edit,
    jl.Site,
    TraceView,
    SpecView,
    EditView,
    SelectorView,
    ModuleView,
    SiteView,
  ):
    registry[cls] = _handler
  _registered = True


def show(obj, *, trace=None) -> None:
  """Displays ``obj`` with treescope (in a notebook: a foldable tree); ``trace`` as for :func:`view`."""
  register()
  _treescope().show(view(obj, trace=trace))


register()


_PAGE = """<!doctype html>
<html lang="en">
<head><meta charset="utf-8"><title>{title}</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 1.5em; }}
.legend span {{ display: inline-block; padding: 0.1em 0.5em; margin-right: 0.6em;
               border-radius: 3px; font-size: 0.9em; }}
</style></head>
<body>
<h1>{title}</h1>
<p class="legend">{legend}</p>
<div id="jaxlens-view">
{body}
</div>
</body>
</html>
"""


def to_html(obj, path=None, *, title: str | None = None, trace=None) -> str:
  """A standalone HTML page of ``obj``'s view (treescope's foldable tree and a legend).

  Args:
    obj: a Trace, Spec, edit, selector (or anything treescope renders).
    path: when given, the page is also written there.
    title: the page title (default: the object's type).
    trace: for a selector or a spec, the trace to match them against (see :func:`view`).

  Returns:
    The page's HTML. It needs JavaScript (treescope's renderer) and no network.
  """
  register()
  treescope = _treescope()
  with treescope.active_autovisualizer.set_scoped(None):
    body = treescope.render_to_html(view(obj, trace=trace), roundtrip_mode=False, compressed=False)
  title = title or f"jaxlens {type(obj).__name__}"
  legend = "".join(f'<span style="background:{c}">{html.escape(t)}</span>' for t, c in _LEGEND)
  page = _PAGE.format(title=html.escape(title), legend=legend, body=body)
  if path is not None:
    Path(path).write_text(page, encoding="utf-8")
  return page


def _treescope_repr(self, path, subtree_renderer):
  """treescope's notebook view of this object (:func:`render`)."""
  return render(self, path, subtree_renderer)


def _to_html(self, path=None, **kwargs) -> str:
  """A standalone HTML page of this object's view (:func:`jaxlens.views.to_html`)."""
  return to_html(self, path, **kwargs)


# The views attach themselves to the core's types: the core (jaxlens/_src) does not import
# this tool (tests/test_layers.py); ``import jaxlens`` imports this module.
for _cls in (_Trace, _Spec, _Edit, _Site):
  _cls.__treescope_repr__ = _treescope_repr  # type: ignore[union-attr]  # attached from here
_to_html.__name__ = "to_html"
_Trace.to_html = _to_html  # type: ignore[attr-defined]
_Spec.to_html = _to_html  # type: ignore[attr-defined]
