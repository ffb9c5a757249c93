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

from typing import Any

from jaxlens.core import Site, Spec, Trace

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

__all__ = ["render", "show", "to_html", "view"]


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
