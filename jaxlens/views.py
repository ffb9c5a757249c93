"""Views of traces, specs, edits and selectors for people: treescope in notebooks, HTML files.

`treescope <https://treescope.readthedocs.io>`_ (installed with flax) renders
Python objects as foldable trees in notebooks. This module gives the views of jaxlens's
objects (the objects draw the same views themselves, ``__treescope_repr__``):

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

The classes define the views themselves (``__treescope_repr__``, and ``to_html`` on
``Trace`` and ``Spec``), so ``treescope.show(trace)`` and treescope's notebook integration
(``treescope.basic_interactive_setup()``) use them with nothing to register. treescope is
imported when a view is first drawn, never by ``import jaxlens``.
"""

from __future__ import annotations

import html as _html
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from jaxlens.core import ShapeError, Site, Spec, Trace

# The view objects and colours, for code that inspects a view (``view(trace).sites``).
from jaxlens.internal import CUT as CUT
from jaxlens.internal import DOWNSTREAM as DOWNSTREAM
from jaxlens.internal import FRONTIER as FRONTIER
from jaxlens.internal import KEEP as KEEP
from jaxlens.internal import NOT_SAVED as NOT_SAVED
from jaxlens.internal import EditView as EditView
from jaxlens.internal import ModuleView as ModuleView
from jaxlens.internal import RuleView as RuleView
from jaxlens.internal import SelectorView as SelectorView
from jaxlens.internal import SiteView as SiteView
from jaxlens.internal import SpecView as SpecView
from jaxlens.internal import TraceView as TraceView
from jaxlens.internal import html_page, selector_view, spec_view, trace_view, treescope_repr
from jaxlens.internal import show as _show
from jaxlens.intervention import Edit

__all__ = ["lens_html", "render", "show", "to_html", "view"]


def view(obj, *, trace=None) -> Any:
  """The view object of a jaxlens object (a Trace, Spec, edit or selector); else ``obj``.

  Args:
    obj: what to view.
    trace: for a selector or a spec, a trace whose sites they are matched against:
      the view then says which sites each selects (``# matches ...``, ``# fired at ...``).
  """
  infos = list(trace.sites) if trace is not None else None
  if isinstance(obj, Trace):
    return trace_view(obj)
  if isinstance(obj, Spec):
    return spec_view(obj, infos)
  if isinstance(obj, Edit):
    return EditView(obj)
  if isinstance(obj, Site):
    return selector_view(obj, infos)
  return obj


def render(obj, path, subtree_renderer):
  """The treescope rendering of a jaxlens object (what its ``__treescope_repr__`` returns)."""
  return treescope_repr(view(obj), path, subtree_renderer)


def show(obj, *, trace=None) -> None:
  """Displays ``obj`` with treescope (in a notebook: a foldable tree); ``trace`` as for :func:`view`."""
  _show(view(obj, trace=trace))


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
  return html_page(view(obj, trace=trace), title or f"jaxlens {type(obj).__name__}", path)


def lens_html(
  ids,
  probs,
  path=None,
  *,
  vocab: Sequence[str] | Callable[[int], str] | None = None,
  row_labels: Sequence[str] | None = None,
  col_labels: Sequence[str] | None = None,
  title: str = "lens",
) -> str:
  """A lens's top tokens per layer and position as a self-contained HTML page (a table, no
  script): each cell shows the top token and its probability, shaded by the probability, with
  the other top-k tokens in its tooltip.

  Args:
    ids: ``(layers, positions, k)`` top token ids (``jaxlens.lens.logit_lens_topk(...).ids[:,
      0]`` for batch row 0) or ``(layers, positions)``.
    probs: their probabilities, the same shape.
    path: write the page there too.
    vocab: token strings indexed by id, or a function of an id (a tokenizer's ``decode``).
    row_labels: a label per layer (default ``0 .. layers - 1``).
    col_labels: a label per position (the input tokens).
    title: the page title.

  Returns:
    The page.
  """
  ids, probs = np.asarray(ids), np.asarray(probs, dtype=np.float64)
  if ids.ndim == 2:
    ids, probs = ids[..., None], probs[..., None]
  if ids.ndim != 3 or ids.shape != probs.shape:
    raise ShapeError(
      f"ids and probs must be (layers, positions[, k]), got {ids.shape} and {probs.shape}",
      code="shape_mismatch",
      expected="(layers, positions, k), the same shape",
      received=f"{ids.shape}, {probs.shape}",
      fix="one batch row: top.ids[:, 0], top.probs[:, 0]",
    )
  layers, positions, _ = ids.shape
  if callable(vocab):
    decode = vocab
  else:
    decode = (lambda i: str(i)) if vocab is None else (lambda i: str(vocab[i]))
  rows = list(row_labels) if row_labels is not None else [str(i) for i in range(layers)]
  cols = list(col_labels) if col_labels is not None else [str(i) for i in range(positions)]
  esc = _html.escape
  head = "".join(f"<th>{esc(str(c))}</th>" for c in cols)
  body = []
  for i in range(layers):
    cells = []
    for j in range(positions):
      p = float(probs[i, j, 0])
      tip = "; ".join(f"{decode(int(t))!r} {q:.3f}" for t, q in zip(ids[i, j], probs[i, j]))
      shade = f"rgba(33, 102, 172, {p:.3f})"
      colour = "white" if p > 0.5 else "black"
      cells.append(
        f'<td title="{esc(tip)}" style="background:{shade};color:{colour}" data-p="{p:.6f}">'
        f"{esc(repr(decode(int(ids[i, j, 0]))))}<br><small>{p:.2f}</small></td>"
      )
    body.append(f"<tr><th>{esc(str(rows[i]))}</th>{''.join(cells)}</tr>")
  page = (
    f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{esc(title)}</title>"
    "<style>table{border-collapse:collapse;font-family:monospace}"
    "td,th{border:1px solid #ccc;padding:2px 4px;text-align:center}</style></head><body>"
    f"<h3>{esc(title)}</h3><table><tr><th>layer</th>{head}</tr>{''.join(body)}</table>"
    "</body></html>"
  )
  if path is not None:
    Path(path).write_text(page, encoding="utf-8")
  return page
