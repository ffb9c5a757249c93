"""Every name that builds or wraps an edit (``jaxlens.intervention``).

The verbs, the backward verbs, the trained interventions (``das``,
``boundless_das``, ``low_rank_das``, ``loreft``, ``direft``, with ``orthogonal``, a rotation
parameter's matrix, and ``boundary_mask``, Boundless DAS's mask; ``jaxlens.train``
initialises and trains their parameters), ``keep_grad``, ``compose``, ``hook``,
``gate``, ``at_positions``, ``at_steps``, the selections (``units``, ``subspace`` and the
``subspace_*`` edits), populations, and the edit types. ``jaxlens`` re-exports all of them, so
``jl.scale`` and ``jl.intervention.scale`` are the same function.
"""

from jaxlens._src.backward import backward_hook as backward_hook
from jaxlens._src.backward import grad_clip as grad_clip
from jaxlens._src.backward import grad_scale as grad_scale
from jaxlens._src.backward import grad_zero as grad_zero
from jaxlens._src.edit import Edit as Edit
from jaxlens._src.edit import FireContext as FireContext
from jaxlens._src.edit import InterventionDecision as InterventionDecision
from jaxlens._src.edit import Population as Population
from jaxlens._src.selections import Selection as Selection
from jaxlens._src.selections import orthonormal as orthonormal
from jaxlens._src.selections import set_affine_coordinates as set_affine_coordinates
from jaxlens._src.selections import subspace as subspace
from jaxlens._src.selections import subspace_patch as subspace_patch
from jaxlens._src.selections import subspace_scale as subspace_scale
from jaxlens._src.selections import subspace_set as subspace_set
from jaxlens._src.selections import subspace_zero as subspace_zero
from jaxlens._src.selections import units as units
from jaxlens._src.tracing import InterventionOptions as InterventionOptions
from jaxlens._src.trained import boundless_das as boundless_das
from jaxlens._src.trained import das as das
from jaxlens._src.trained import direft as direft
from jaxlens._src.trained import loreft as loreft
from jaxlens._src.trained import boundary_mask as boundary_mask
from jaxlens._src.trained import low_rank_das as low_rank_das
from jaxlens._src.trained import orthogonal as orthogonal
from jaxlens._src.verbs import add as add
from jaxlens._src.verbs import add_noise as add_noise
from jaxlens._src.verbs import at_positions as at_positions
from jaxlens._src.verbs import at_steps as at_steps
from jaxlens._src.verbs import clamp as clamp
from jaxlens._src.verbs import compose as compose
from jaxlens._src.verbs import gate as gate
from jaxlens._src.verbs import hook as hook
from jaxlens._src.verbs import keep_grad as keep_grad
from jaxlens._src.verbs import mean_ablate as mean_ablate
from jaxlens._src.verbs import patch_from as patch_from
from jaxlens._src.verbs import permute_batch as permute_batch
from jaxlens._src.verbs import population as population
from jaxlens._src.verbs import project_onto as project_onto
from jaxlens._src.verbs import project_out as project_out
from jaxlens._src.verbs import replace_with as replace_with
from jaxlens._src.verbs import resample_rows_from as resample_rows_from
from jaxlens._src.verbs import scale as scale
from jaxlens._src.verbs import scramble_elements as scramble_elements
from jaxlens._src.verbs import set_direction_mean as set_direction_mean
from jaxlens._src.verbs import splice_module as splice_module
from jaxlens._src.verbs import steer as steer
from jaxlens._src.verbs import swap_with as swap_with
from jaxlens._src.verbs import zero_ablate as zero_ablate

__all__ = [
  "Edit",
  "FireContext",
  "InterventionDecision",
  "InterventionOptions",
  "Population",
  "Selection",
  "add",
  "add_noise",
  "at_positions",
  "at_steps",
  "backward_hook",
  "boundary_mask",
  "boundless_das",
  "clamp",
  "compose",
  "das",
  "direft",
  "gate",
  "grad_clip",
  "grad_scale",
  "grad_zero",
  "hook",
  "keep_grad",
  "loreft",
  "low_rank_das",
  "mean_ablate",
  "orthogonal",
  "orthonormal",
  "patch_from",
  "permute_batch",
  "population",
  "project_onto",
  "project_out",
  "replace_with",
  "resample_rows_from",
  "scale",
  "scramble_elements",
  "set_affine_coordinates",
  "set_direction_mean",
  "splice_module",
  "steer",
  "subspace",
  "subspace_patch",
  "subspace_scale",
  "subspace_set",
  "subspace_zero",
  "swap_with",
  "units",
  "zero_ablate",
]
