"""The torch reference of every verb and door of the gradient contract (plain forward hooks).

See :mod:`torch_bridge._reference` for what it implements and where it follows the
specification instead of the published torchlens.
"""

from torch_bridge._reference import Edit as Edit
from torch_bridge._reference import InterventionDecision as InterventionDecision
from torch_bridge._reference import InterventionOptions as InterventionOptions
from torch_bridge._reference import Population as Population
from torch_bridge._reference import Selection as Selection
from torch_bridge._reference import SiteContext as SiteContext
from torch_bridge._reference import Spec as Spec
from torch_bridge._reference import Trace as Trace
from torch_bridge._reference import add as add
from torch_bridge._reference import add_noise as add_noise
from torch_bridge._reference import as_edit as as_edit
from torch_bridge._reference import at_positions as at_positions
from torch_bridge._reference import clamp as clamp
from torch_bridge._reference import compose as compose
from torch_bridge._reference import fire as fire
from torch_bridge._reference import hook as hook
from torch_bridge._reference import keep_grad as keep_grad
from torch_bridge._reference import mean_ablate as mean_ablate
from torch_bridge._reference import patch_from as patch_from
from torch_bridge._reference import permute_batch as permute_batch
from torch_bridge._reference import population as population
from torch_bridge._reference import project_onto as project_onto
from torch_bridge._reference import project_out as project_out
from torch_bridge._reference import replace_with as replace_with
from torch_bridge._reference import reset_warnings as reset_warnings
from torch_bridge._reference import resample_rows_from as resample_rows_from
from torch_bridge._reference import scale as scale
from torch_bridge._reference import scramble_elements as scramble_elements
from torch_bridge._reference import set_affine_coordinates as set_affine_coordinates
from torch_bridge._reference import set_direction_mean as set_direction_mean
from torch_bridge._reference import splice_module as splice_module
from torch_bridge._reference import steer as steer
from torch_bridge._reference import subspace as subspace
from torch_bridge._reference import subspace_patch as subspace_patch
from torch_bridge._reference import subspace_scale as subspace_scale
from torch_bridge._reference import subspace_set as subspace_set
from torch_bridge._reference import subspace_zero as subspace_zero
from torch_bridge._reference import swap_with as swap_with
from torch_bridge._reference import trace as trace
from torch_bridge._reference import units as units
from torch_bridge._reference import when as when
from torch_bridge._reference import zero_ablate as zero_ablate

from torch_bridge._reference import __all__ as __all__
