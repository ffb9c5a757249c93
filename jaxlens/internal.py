"""Semi-public helpers for jaxlens's own tools and privileged downstream code.

As ``equinox.internal``: these are the core pieces that the tools of this package
(``jaxlens.sweep``, ``jaxlens.generation``, ``jaxlens.store``, ``jaxlens.attribution``,
``jaxlens.sae``, ``jaxlens.train``, ...) and torch_bridge build on, beyond the public names of
:mod:`jaxlens.core` and :mod:`jaxlens.intervention`. They are documented and stable within a
release, but not part of the user API. A tool imports them from here, never from
``jaxlens._src`` (``tests/test_layers.py`` checks this for every module).
"""

from jaxlens._src.checkpoints import Checkpoints as Checkpoints
from jaxlens._src.doors import as_spec as as_spec
from jaxlens._src.edit import Donor as Donor
from jaxlens._src.edit import split_over_processes as split_over_processes
from jaxlens._src.edit import takes_hook_keyword as takes_hook_keyword
from jaxlens._src.errors import reset_warnings as reset_warnings
from jaxlens._src.optional import require as require
from jaxlens._src.sites import SiteInfo as SiteInfo
from jaxlens._src.sites import as_selector as as_selector
from jaxlens._src.sites import hits as hits
from jaxlens._src.sites import unmatched_error as unmatched_error
from jaxlens._src.tracebacks import api_boundary as api_boundary
from jaxlens._src.tracing import _capture as capture
from jaxlens._src.trained import boundary_mask as boundary_mask
from jaxlens._src.trained import orthogonal as orthogonal

__all__ = [
  "Checkpoints",
  "Donor",
  "SiteInfo",
  "api_boundary",
  "as_selector",
  "as_spec",
  "boundary_mask",
  "capture",
  "hits",
  "orthogonal",
  "require",
  "reset_warnings",
  "split_over_processes",
  "takes_hook_keyword",
  "unmatched_error",
]
