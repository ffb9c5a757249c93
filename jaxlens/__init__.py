"""jaxlens: read and edit a Flax model's intermediate values with a gradient contract.

Everything that builds or wraps an edit is in :mod:`jaxlens.intervention` and, the
same objects, here at the root; the root adds sites, doors, traces, saved specs and
errors. ``jaxlens.contract`` (the contract matrix as data) is semi-public, for
privileged downstream code such as torch_bridge. Please don't use ``jaxlens._src``:
it is not part of the public API.

>>> import jaxlens as jl
>>> spec = jl.when(jl.module("layers_0"), jl.zero_ablate())
"""

import types as _types

from jaxlens import intervention as intervention
from jaxlens._src.dependence import depends_on as depends_on
from jaxlens._src.doors import Spec as Spec
from jaxlens._src.doors import SpecReport as SpecReport
from jaxlens._src.doors import check_spec as check_spec
from jaxlens._src.doors import load_spec as load_spec
from jaxlens._src.doors import save_spec as save_spec
from jaxlens._src.doors import when as when
from jaxlens._src.errors import GradientContractError as GradientContractError
from jaxlens._src.errors import InvalidArgumentError as InvalidArgumentError
from jaxlens._src.errors import JaxlensError as JaxlensError
from jaxlens._src.errors import JaxlensWarning as JaxlensWarning
from jaxlens._src.errors import ShapeError as ShapeError
from jaxlens._src.errors import SiteError as SiteError
from jaxlens._src.errors import SpecFormatError as SpecFormatError
from jaxlens._src.named import Named as Named
from jaxlens._src.named import NamedNNX as NamedNNX
from jaxlens._src.named import named as named
from jaxlens._src.runtime import no_grad as no_grad
from jaxlens._src.sites import Site as Site
from jaxlens._src.sites import all_sites as all_sites
from jaxlens._src.program import clear_caches as clear_caches
from jaxlens._src.compile_cache import compilation_cache_dir as compilation_cache_dir
from jaxlens._src.compile_cache import set_compilation_cache as set_compilation_cache
from jaxlens._src.sites import func as func
from jaxlens._src.sites import in_module as in_module
from jaxlens._src.sites import label as label
from jaxlens._src.sites import module as module
from jaxlens._src.sites import module_sites as module_sites
from jaxlens._src.tracing import SiteValue as SiteValue
from jaxlens._src.tracing import Trace as Trace
from jaxlens._src.tracing import trace as trace
from jaxlens.intervention import *  # noqa: F403 (every edit builder; tests/test_api.py checks)
from jaxlens.intervention import __all__ as _intervention_all

# The tools, built on the names above (they import them from here).
from jaxlens import protocol as protocol
from jaxlens import sweep as sweep
from jaxlens import generation as generation
from jaxlens.generation import generate as generate
from jaxlens import store as store
from jaxlens import views as views  # attaches the notebook views to Trace, Spec, Edit, Site
from jaxlens.attribution import SiteGrads as SiteGrads
from jaxlens.attribution import attribution_patching as attribution_patching
from jaxlens.attribution import site_grads as site_grads

__version__ = "0.1.0"

__all__ = sorted(
  {
    *_intervention_all,
    "GradientContractError",
    "InvalidArgumentError",
    "JaxlensError",
    "JaxlensWarning",
    "ShapeError",
    "Site",
    "SiteError",
    "SiteValue",
    "Spec",
    "SpecFormatError",
    "SpecReport",
    "Trace",
    "all_sites",
    "check_spec",
    "clear_caches",
    "depends_on",
    "func",
    "in_module",
    "intervention",
    "label",
    "load_spec",
    "module",
    "module_sites",
    "no_grad",
    "save_spec",
    "sweep",
    "trace",
    "when",
    "Named",
    "NamedNNX",
    "named",
    "SiteGrads",
    "attribution_patching",
    "site_grads",
    "store",
    "generation",
    "generate",
    "compilation_cache_dir",
    "set_compilation_cache",
    "protocol",
  }
)


def _set_public_module():
  """Public objects defined in ``jaxlens._src`` show ``jaxlens`` as their module (as jax's
  ``set_module``), so reprs, docs and tracebacks name the spelling users write."""
  for name in __all__:
    obj = globals()[name]
    if isinstance(obj, (type, _types.FunctionType)) and obj.__module__.startswith("jaxlens._src"):
      obj.__module__ = "jaxlens"


_set_public_module()
del _set_public_module

# JAX's persistent compilation cache in a per-user directory, unless the environment or JAX's
# config already chose (jaxlens._src.compile_cache).
from jaxlens._src.compile_cache import _configure_at_import  # noqa: E402

_configure_at_import()
del _configure_at_import
