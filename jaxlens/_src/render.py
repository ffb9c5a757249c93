"""Floor 0: drawing the views of traces, specs, edits and selectors (treescope, HTML pages).

A view is plain data (:class:`TraceView`, :class:`SpecView`, :class:`EditView`,
:class:`SelectorView`, and the :class:`ModuleView` / :class:`SiteView` of a trace's site
tree); ``jaxlens._src.viewing`` builds them. This module draws them in treescope's
intermediate representation (:func:`treescope_repr`, each view's ``__treescope_repr__``) and
as a standalone HTML page (:func:`html_page`). The classes jaxlens shows define their own
``__treescope_repr__`` and ``to_html`` with these (as flax and penzai define the hook on the
class). treescope, a dependency of flax, is imported when a view is first drawn, never by
``import jaxlens``.

Colours: green sites were written by an edit that keeps the gradient, red ones by an edit
that cuts it, blue ones were recomputed downstream of an edit, grey ones were not saved.
"""

from __future__ import annotations

import dataclasses
import html
import importlib
from pathlib import Path
from typing import Any

KEEP = "#c9efc9"  # written by an edit that keeps the gradient
CUT = "#f6c5bd"  # written by an edit that cuts it
DOWNSTREAM = "#d3e2f7"  # recomputed downstream of an edit (by a replay)
FRONTIER = "#f3e3b5"  # re-leafed by a differentiable replay
NOT_SAVED = "#eeeeee"

LEGEND = (
  ("keeps the gradient", KEEP),
  ("cuts the gradient", CUT),
  ("downstream of an edit (computed with it live, or recomputed by a replay)", DOWNSTREAM),
  ("replay frontier (re-leafed)", FRONTIER),
  ("not saved", NOT_SAVED),
)


def _treescope():
  return importlib.import_module("treescope")


def keeps(edit) -> bool:
  """Whether an edit keeps the gradient (a view colours it green, else red)."""
  return bool(getattr(edit, "keeps", True))


# --------------------------------------------------------------------------
# View objects: plain data that treescope renders.


class _View:
  """A view treescope draws with :func:`treescope_repr` (the hook flax and penzai also define
  on the class)."""

  def __treescope_repr__(self, path, subtree_renderer):
    return treescope_repr(self, path, subtree_renderer)


@dataclasses.dataclass
class SiteView(_View):
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
class ModuleView(_View):
  """A module of the site tree: its output site, its submodules and the op sites it ran."""

  name: str
  module_type: str
  out: SiteView | None
  children: dict
  ops: list


@dataclasses.dataclass
class RuleView(_View):
  selector: Any
  edit: Any
  fired_at: tuple | None  # None: not known (a spec on its own)


@dataclasses.dataclass
class SpecView(_View):
  rules: tuple
  staged: tuple = ()


@dataclasses.dataclass
class EditView(_View):
  edit: Any


@dataclasses.dataclass
class SelectorView(_View):
  selector: Any
  matches: tuple | None = None


@dataclasses.dataclass
class TraceView(_View):
  """A trace as the page shows it."""

  output: Any
  sites: ModuleView
  spec: SpecView
  frontier: dict
  stale: bool
  counts: dict


# --------------------------------------------------------------------------
# Drawing (treescope's intermediate representation).


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
  kept = keeps(edit)
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
  comment = ("keeps the gradient" if kept else "cuts the gradient") + (
    "; keep_grad: checked when it fires" if mark else ""
  )
  prefix = f"{mark}jl.{getattr(edit, 'name', type(edit).__name__)}("
  return _node(
    prefix,
    items,
    path,
    subtree_renderer,
    color=KEEP if kept else CUT,
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


def treescope_repr(view, path, subtree_renderer):
  """treescope's rendering of a view (what the views' and the viewed classes'
  ``__treescope_repr__`` return)."""
  if isinstance(view, TraceView):
    return _render_trace(view, path, subtree_renderer)
  if isinstance(view, SpecView):
    return _render_spec(view, path, subtree_renderer)
  if isinstance(view, EditView):
    return _render_edit(view.edit, path, subtree_renderer)
  if isinstance(view, SelectorView):
    comment = None if view.matches is None else "matches " + ", ".join(view.matches)
    return _one_line(repr(view.selector), path, comment=comment)
  if isinstance(view, ModuleView):
    return _render_module(view, path, subtree_renderer)
  if isinstance(view, SiteView):
    return _render_site(view, path, subtree_renderer)
  return NotImplemented


def show(view) -> None:
  """Displays a view with treescope (in a notebook: a foldable tree)."""
  _treescope().show(view)


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


def html_page(view, title: str, path=None) -> str:
  """A standalone HTML page of a view (treescope's foldable tree and a legend), also written
  to ``path`` when given. It needs JavaScript (treescope's renderer) and no network."""
  treescope = _treescope()
  with treescope.active_autovisualizer.set_scoped(None):
    body = treescope.render_to_html(view, roundtrip_mode=False, compressed=False)
  legend = "".join(f'<span style="background:{c}">{html.escape(t)}</span>' for t, c in LEGEND)
  page = _PAGE.format(title=html.escape(title), legend=legend, body=body)
  if path is not None:
    Path(path).write_text(page, encoding="utf-8")
  return page
