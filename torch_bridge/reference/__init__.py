"""The torch reference of every verb and door of the gradient contract (plain forward hooks).

The torch reference of the gradient contract: every verb and door, in plain torch.

The reference is what jaxlens is checked against. It is deliberately small and
literal: edits run in ``module.register_forward_hook`` hooks that return the edited
output, and the replay doors re-run the torch modules downstream of the site from
the saved site value (for an ``nn.Sequential`` root, the matrix model). It follows
the specification (``docs/gradient_contract.md``) where the published torchlens
departs from it:

* cutting verbs (``zero_ablate``, ``replace_with``, ``swap_with``, ``patch_from``,
  ``resample_rows_from``, ``mean_ablate(source=)``, ``scramble_elements(source=)``)
  ``.detach()`` what they write, even when the donor carries a graph; keeping verbs
  compute from the site value and keep its graph;
* ``keep_grad(edit)`` checks at fire time: ``grad_disabled`` under ``torch.no_grad()``
  (``torch.is_grad_enabled()`` is False), ``site_has_no_graph`` when the site value
  does not require grad, and ``edit_detached_from_graph`` when the written value
  does not require grad while the site value did;
* differentiable replay re-leafs the frontier (``detach().requires_grad_()``) and
  ``keep_grad`` there warns ``keep_grad_replay_frontier`` once per session;
* random draws come from ``jax.random`` exactly as jaxlens draws them
  (``jax.random.normal(jax.random.key(seed), shape, dtype)``,
  ``jax.random.permutation``, ``jax.random.randint``), so both frameworks write the
  same numbers. A float64 site draws with 64-bit JAX types (as jaxlens, which needs
  ``jax_enable_x64`` for a float64 site); other sites draw under the current JAX
  configuration.

Sites are torch module names as in ``model.named_modules()`` (``"0"``, ``"blocks.1.mlp"``).

Example:
  >>> import torch
  >>> from torch_bridge import reference as ref
  >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
  >>> out = ref.when("0", ref.scale(0.5)).bind(model)(torch.ones(1, 4))
  >>> tuple(out.shape)
  (1, 2)

Files pair with jaxlens's: ``_edit`` (edit.py), ``_verbs`` (verbs.py), ``_selections``
(selections.py), ``_doors`` (doors.py + interceptor.py), ``_trace`` (tracing.py).
"""

from jaxlens import InterventionDecision as InterventionDecision
from jaxlens import InterventionOptions as InterventionOptions
from torch_bridge.reference._doors import Spec as Spec
from torch_bridge.reference._doors import reset_warnings as reset_warnings
from torch_bridge.reference._doors import when as when
from torch_bridge.reference._edit import Donor as Donor
from torch_bridge.reference._edit import Edit as Edit
from torch_bridge.reference._edit import Population as Population
from torch_bridge.reference._edit import SiteContext as SiteContext
from torch_bridge.reference._edit import fire as fire
from torch_bridge.reference._edit import population as population
from torch_bridge.reference._selections import VERBS as VERBS
from torch_bridge.reference._selections import Selection as Selection
from torch_bridge.reference._selections import set_affine_coordinates as set_affine_coordinates
from torch_bridge.reference._selections import subspace as subspace
from torch_bridge.reference._selections import subspace_patch as subspace_patch
from torch_bridge.reference._selections import subspace_scale as subspace_scale
from torch_bridge.reference._selections import subspace_set as subspace_set
from torch_bridge.reference._selections import subspace_zero as subspace_zero
from torch_bridge.reference._selections import units as units
from torch_bridge.reference._trace import Trace as Trace
from torch_bridge.reference._trace import trace as trace
from torch_bridge.reference._verbs import add as add
from torch_bridge.reference._verbs import add_noise as add_noise
from torch_bridge.reference._verbs import as_edit as as_edit
from torch_bridge.reference._verbs import at_positions as at_positions
from torch_bridge.reference._verbs import clamp as clamp
from torch_bridge.reference._verbs import compose as compose
from torch_bridge.reference._verbs import hook as hook
from torch_bridge.reference._verbs import keep_grad as keep_grad
from torch_bridge.reference._verbs import mean_ablate as mean_ablate
from torch_bridge.reference._verbs import patch_from as patch_from
from torch_bridge.reference._verbs import permute_batch as permute_batch
from torch_bridge.reference._verbs import project_onto as project_onto
from torch_bridge.reference._verbs import project_out as project_out
from torch_bridge.reference._verbs import replace_with as replace_with
from torch_bridge.reference._verbs import resample_rows_from as resample_rows_from
from torch_bridge.reference._verbs import scale as scale
from torch_bridge.reference._verbs import scramble_elements as scramble_elements
from torch_bridge.reference._verbs import set_direction_mean as set_direction_mean
from torch_bridge.reference._verbs import splice_module as splice_module
from torch_bridge.reference._verbs import steer as steer
from torch_bridge.reference._verbs import swap_with as swap_with
from torch_bridge.reference._verbs import zero_ablate as zero_ablate

__all__ = [
  "add",
  "add_noise",
  "as_edit",
  "at_positions",
  "clamp",
  "compose",
  "Donor",
  "Edit",
  "fire",
  "hook",
  "InterventionDecision",
  "InterventionOptions",
  "keep_grad",
  "mean_ablate",
  "patch_from",
  "permute_batch",
  "population",
  "Population",
  "project_onto",
  "project_out",
  "replace_with",
  "resample_rows_from",
  "reset_warnings",
  "scale",
  "scramble_elements",
  "Selection",
  "set_affine_coordinates",
  "set_direction_mean",
  "SiteContext",
  "Spec",
  "splice_module",
  "steer",
  "subspace",
  "subspace_patch",
  "subspace_scale",
  "subspace_set",
  "subspace_zero",
  "swap_with",
  "Trace",
  "trace",
  "units",
  "VERBS",
  "when",
  "zero_ablate",
]
