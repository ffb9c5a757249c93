"""Semi-public helpers for jaxlens's own tools and privileged downstream code.

As ``equinox.internal``: these are the core pieces that the tools of this package
(``jaxlens.sweep``, ``jaxlens.generation``, ``jaxlens.store``, ``jaxlens.attribution``,
``jaxlens.sae``, ``jaxlens.train``, ...) and torch_bridge build on, beyond the public names of
:mod:`jaxlens.core` and :mod:`jaxlens.intervention`. They are documented and stable within a
release, but not part of the user API. A tool imports them from here, never from
``jaxlens._src`` (``tests/test_layers.py`` checks this for every module).
"""

from jaxlens._src.checkpoints import Checkpoints as Checkpoints
from jaxlens._src.checkpoints import check_every as check_every
from jaxlens._src.checkpoints import signature as signature
from jaxlens._src.doors import as_spec as as_spec
from jaxlens._src.edit import ByIdentity as ByIdentity
from jaxlens._src.edit import auto_axes as auto_axes
from jaxlens._src.edit import split_over_processes as split_over_processes
from jaxlens._src.edit import takes_hook_keyword as takes_hook_keyword
from jaxlens._src.errors import reset_warnings as reset_warnings
from jaxlens._src.gradients import grads_at_sites as grads_at_sites
from jaxlens._src.jsonfile import loads as json_loads
from jaxlens._src.optional import require as require
from jaxlens._src.paths import path_argument as path_argument
from jaxlens._src.paths import write_directory as write_directory
from jaxlens._src.render import CUT as CUT
from jaxlens._src.render import DOWNSTREAM as DOWNSTREAM
from jaxlens._src.render import FRONTIER as FRONTIER
from jaxlens._src.render import KEEP as KEEP
from jaxlens._src.render import NOT_SAVED as NOT_SAVED
from jaxlens._src.render import EditView as EditView
from jaxlens._src.render import ModuleView as ModuleView
from jaxlens._src.render import RuleView as RuleView
from jaxlens._src.render import SelectorView as SelectorView
from jaxlens._src.render import SiteView as SiteView
from jaxlens._src.render import SpecView as SpecView
from jaxlens._src.render import TraceView as TraceView
from jaxlens._src.render import html_page as html_page
from jaxlens._src.render import show as show
from jaxlens._src.render import treescope_repr as treescope_repr
from jaxlens._src.sites import SiteInfo as SiteInfo
from jaxlens._src.sites import as_selector as as_selector
from jaxlens._src.sites import hits as hits
from jaxlens._src.sites import unmatched_error as unmatched_error
from jaxlens._src.tracebacks import api_boundary as api_boundary
from jaxlens._src.tracing import capture as capture
from jaxlens._src.viewing import selector_view as selector_view
from jaxlens._src.viewing import spec_view as spec_view
from jaxlens._src.viewing import trace_view as trace_view

__all__ = [
  "ByIdentity",
  "CUT",
  "Checkpoints",
  "DOWNSTREAM",
  "EditView",
  "FRONTIER",
  "KEEP",
  "ModuleView",
  "NOT_SAVED",
  "RuleView",
  "SelectorView",
  "SiteInfo",
  "SiteView",
  "SpecView",
  "TraceView",
  "api_boundary",
  "as_selector",
  "as_spec",
  "capture",
  "check_every",
  "grads_at_sites",
  "hits",
  "html_page",
  "json_loads",
  "path_argument",
  "write_directory",
  "require",
  "reset_warnings",
  "selector_view",
  "show",
  "signature",
  "spec_view",
  "split_over_processes",
  "takes_hook_keyword",
  "trace_view",
  "treescope_repr",
  "unmatched_error",
]
