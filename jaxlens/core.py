"""The core's public names (``jaxlens.core``): sites, doors, traces, saved specs, errors.

The root, :mod:`jaxlens`, re-exports every name here together with
:mod:`jaxlens.intervention` (every edit builder). jaxlens's own tools (``jaxlens.sweep``,
``jaxlens.generation``, ``jaxlens.store``, ...) import their core names from here and their
edit builders from :mod:`jaxlens.intervention`, never from the root, so the package's import
graph points one way: root -> tools -> core / intervention -> ``jaxlens._src``.
"""

from jaxlens._src.checkpoints import CheckpointError as CheckpointError
from jaxlens._src.compile_cache import compilation_cache_dir as compilation_cache_dir
from jaxlens._src.compile_cache import set_compilation_cache as set_compilation_cache
from jaxlens._src.dependence import depends_on as depends_on
from jaxlens._src.doors import Spec as Spec
from jaxlens._src.doors import SpecReport as SpecReport
from jaxlens._src.doors import check_spec as check_spec
from jaxlens._src.doors import load_spec as load_spec
from jaxlens._src.doors import save_spec as save_spec
from jaxlens._src.doors import when as when
from jaxlens._src.edit import Donor as Donor
from jaxlens._src.errors import GradientContractError as GradientContractError
from jaxlens._src.errors import InvalidArgumentError as InvalidArgumentError
from jaxlens._src.errors import JaxlensError as JaxlensError
from jaxlens._src.errors import JaxlensWarning as JaxlensWarning
from jaxlens._src.errors import ShapeError as ShapeError
from jaxlens._src.errors import SiteError as SiteError
from jaxlens._src.errors import SpecFormatError as SpecFormatError
from jaxlens._src.gradients import SiteGrad as SiteGrad
from jaxlens._src.gradients import SiteGrads as SiteGrads
from jaxlens._src.named import Named as Named
from jaxlens._src.named import NamedNNX as NamedNNX
from jaxlens._src.named import named as named
from jaxlens._src.optional import MissingDependencyError as MissingDependencyError
from jaxlens._src.program import clear_caches as clear_caches
from jaxlens._src.runtime import no_grad as no_grad
from jaxlens._src.sites import Site as Site
from jaxlens._src.sites import all_sites as all_sites
from jaxlens._src.sites import func as func
from jaxlens._src.sites import in_module as in_module
from jaxlens._src.sites import label as label
from jaxlens._src.sites import module as module
from jaxlens._src.sites import module_sites as module_sites
from jaxlens._src.tracing import SiteValue as SiteValue
from jaxlens._src.tracing import Trace as Trace
from jaxlens._src.tracing import trace as trace

__all__ = [
  "CheckpointError",
  "Donor",
  "GradientContractError",
  "InvalidArgumentError",
  "JaxlensError",
  "JaxlensWarning",
  "MissingDependencyError",
  "Named",
  "NamedNNX",
  "ShapeError",
  "Site",
  "SiteError",
  "SiteGrad",
  "SiteGrads",
  "SiteValue",
  "Spec",
  "SpecFormatError",
  "SpecReport",
  "Trace",
  "all_sites",
  "check_spec",
  "clear_caches",
  "compilation_cache_dir",
  "depends_on",
  "func",
  "in_module",
  "label",
  "load_spec",
  "module",
  "module_sites",
  "named",
  "no_grad",
  "save_spec",
  "set_compilation_cache",
  "trace",
  "when",
]

# JAX's persistent compilation cache in a per-user directory, unless the environment or JAX's
# config already chose (jaxlens._src.compile_cache).
from jaxlens._src.compile_cache import _configure_at_import  # noqa: E402

_configure_at_import()
del _configure_at_import
