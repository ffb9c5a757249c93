"""jaxlens: read and edit a Flax model's intermediate values with a gradient contract.

What is at the root, by one rule: the core's public names (:mod:`jaxlens.core`: sites, doors,
traces, saved specs, errors), every edit builder (:mod:`jaxlens.intervention`, the same
objects), and each tool named once as a submodule (``jl.sweep``, ``jl.generation``,
``jl.store``, ``jl.views``, ``jl.attribution``, ``jl.protocol``), with the one entry point of a
tool that users call most as a root name too (``jl.generate``; ``jl.site_grads``,
``jl.attribution_patching``). Each name has one home. Tools import the core and intervention, never
this module, so imports point one way: root -> tools -> core -> ``jaxlens._src``.
``jaxlens.contract`` (the contract matrix as data) and ``jaxlens.internal`` (the helpers tools
build on) are semi-public, for privileged code such as torch_bridge. Please don't use
``jaxlens._src``: it is not part of the public API.

>>> import jaxlens as jl
>>> spec = jl.when(jl.module("layers_0"), jl.zero_ablate())
"""

import types as _types

from jaxlens import core as core
from jaxlens import intervention as intervention
from jaxlens.core import *  # noqa: F403 (the core's public names; tests/test_api.py checks)
from jaxlens.core import __all__ as _core_all
from jaxlens.intervention import *  # noqa: F403 (every edit builder; tests/test_api.py checks)
from jaxlens.intervention import __all__ as _intervention_all

# The tools, each named once (they import jaxlens.core / .intervention / .internal).
from jaxlens import attribution as attribution
from jaxlens import generation as generation
from jaxlens import protocol as protocol
from jaxlens import store as store
from jaxlens import sweep as sweep
from jaxlens import views as views
from jaxlens.attribution import attribution_patching as attribution_patching
from jaxlens.attribution import site_grads as site_grads
from jaxlens.generation import generate as generate

__version__ = "0.1.0"

_TOOLS = ("attribution", "generation", "protocol", "store", "sweep", "views")
_ENTRY_POINTS = ("attribution_patching", "generate", "site_grads")
__all__ = sorted({*_core_all, *_intervention_all, "core", "intervention", *_TOOLS, *_ENTRY_POINTS})


def _set_public_module():
  """Public objects defined in ``jaxlens._src`` show ``jaxlens`` as their module (as jax's
  ``set_module``), so reprs, docs and tracebacks name the spelling users write."""
  for name in __all__:
    obj = globals()[name]
    if isinstance(obj, (type, _types.FunctionType)) and obj.__module__.startswith("jaxlens._src"):
      obj.__module__ = "jaxlens"


_set_public_module()
del _set_public_module
