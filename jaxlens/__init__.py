"""jaxlens: read and edit a Flax model's intermediate values with a gradient contract.

>>> import jaxlens as jl
>>> spec = jl.when(jl.module("layers_0"), jl.zero_ablate())
"""

from jaxlens import intervention as intervention
from jaxlens import store as store
from jaxlens.attribution import SiteGrads as SiteGrads
from jaxlens.attribution import attribution_patching as attribution_patching
from jaxlens.attribution import site_grads as site_grads
from jaxlens import sweep as sweep
from jaxlens import generation as generation
from jaxlens.generation import at_steps as at_steps
from jaxlens.generation import generate as generate
from jaxlens._src.backward import backward_hook as backward_hook
from jaxlens._src.backward import grad_clip as grad_clip
from jaxlens._src.backward import grad_scale as grad_scale
from jaxlens._src.backward import grad_zero as grad_zero
from jaxlens._src.dependence import depends_on as depends_on
from jaxlens._src.doors import Spec as Spec
from jaxlens._src.doors import no_grad as no_grad
from jaxlens._src.doors import when as when
from jaxlens._src.named import Named as Named
from jaxlens._src.named import NamedNNX as NamedNNX
from jaxlens._src.named import named as named
from jaxlens._src.tracing import SiteValue as SiteValue
from jaxlens._src.tracing import Trace as Trace
from jaxlens._src.tracing import trace as trace
from jaxlens._src.portable import SpecFormatError as SpecFormatError
from jaxlens._src.portable import SpecReport as SpecReport
from jaxlens._src.portable import check_spec as check_spec
from jaxlens._src.portable import load_spec as load_spec
from jaxlens._src.portable import save_spec as save_spec
from jaxlens._src.errors import GradientContractError as GradientContractError
from jaxlens._src.errors import InvalidArgumentError as InvalidArgumentError
from jaxlens._src.errors import JaxlensError as JaxlensError
from jaxlens._src.errors import JaxlensWarning as JaxlensWarning
from jaxlens._src.errors import ShapeError as ShapeError
from jaxlens._src.errors import SiteError as SiteError
from jaxlens._src.sites import Site as Site
from jaxlens._src.sites import all_sites as all_sites
from jaxlens._src.sites import func as func
from jaxlens._src.sites import in_module as in_module
from jaxlens._src.sites import label as label
from jaxlens._src.sites import module as module
from jaxlens._src.sites import module_sites as module_sites
from jaxlens._src.verbs import InterventionDecision as InterventionDecision
from jaxlens._src.verbs import InterventionOptions as InterventionOptions
from jaxlens._src.verbs import Population as Population
from jaxlens._src.selections import orthonormal as orthonormal
from jaxlens._src.selections import set_affine_coordinates as set_affine_coordinates
from jaxlens._src.selections import subspace_patch as subspace_patch
from jaxlens._src.selections import subspace_scale as subspace_scale
from jaxlens._src.selections import subspace_set as subspace_set
from jaxlens._src.selections import subspace_zero as subspace_zero
from jaxlens._src.selections import Selection as Selection
from jaxlens._src.selections import subspace as subspace
from jaxlens._src.selections import units as units
from jaxlens._src.verbs import add as add
from jaxlens._src.verbs import add_noise as add_noise
from jaxlens._src.verbs import at_positions as at_positions
from jaxlens._src.verbs import clamp as clamp
from jaxlens._src.verbs import mean_ablate as mean_ablate
from jaxlens._src.verbs import patch_from as patch_from
from jaxlens._src.verbs import population as population
from jaxlens._src.verbs import project_onto as project_onto
from jaxlens._src.verbs import project_out as project_out
from jaxlens._src.verbs import replace_with as replace_with
from jaxlens._src.verbs import scale as scale
from jaxlens._src.verbs import splice_module as splice_module
from jaxlens._src.verbs import steer as steer
from jaxlens._src.verbs import swap_with as swap_with
from jaxlens._src.verbs import zero_ablate as zero_ablate

__version__ = "0.1.0"

__all__ = [
    "orthonormal", "set_affine_coordinates", "subspace_patch", "subspace_scale", "subspace_set", "subspace_zero", "Selection", "subspace", "units",
    "GradientContractError", "InterventionDecision", "InterventionOptions", "InvalidArgumentError",
    "JaxlensError", "JaxlensWarning", "Population", "ShapeError", "Site", "SiteError",
    "SiteValue", "Spec", "SpecFormatError", "SpecReport", "Trace", "check_spec", "load_spec",
    "save_spec", "add", "add_noise", "at_positions", "all_sites", "clamp", "depends_on",
    "func", "in_module", "intervention", "label", "mean_ablate", "module", "module_sites", "no_grad", "patch_from", "population",
    "project_onto", "project_out", "replace_with", "scale", "splice_module", "steer",
    "swap_with", "trace", "when", "zero_ablate",
    "backward_hook", "grad_clip", "grad_scale", "grad_zero", "sweep",
    "Named", "NamedNNX", "named",
    "SiteGrads", "attribution_patching", "site_grads", "store",
    "generation", "generate", "at_steps",
]
