"""Trained interventions: DAS, Boundless DAS, low-rank DAS, LoReFT and DiReFT, and their loops.

A *method* (``DAS(dim)``, ``BoundlessDAS()``, ``LowRankDAS(rank)``, ``LoReFT(rank)``,
``DiReFT(rank)``) initialises its parameters (a dict of arrays) and builds the edit
that applies them (``jl.das``, ``jl.boundless_das``, ``jl.low_rank_das``, ``jl.loreft``,
``jl.direft``), an ordinary edit: it composes with every door, ``jl.at_positions``,
``jl.units``, ``layer=``, saved specs and :func:`jaxlens.generate`.
:func:`train_iit` (interchange intervention training) and :func:`train_reft`
(representation fine-tuning on (prompt, answer) pairs) train the parameters with optax;
``cache_prefix=True`` runs the frozen model up to the site once per dataset
(:func:`site_values`) instead of once per step; :func:`iia` measures interchange
intervention accuracy; ``jl.orthogonal(params["rotation"])``
is a learned rotation's matrix. See docs/trained_interventions.md.

>>> import jax, jaxlens as jl
>>> from jaxlens import train as jt
>>> params = jt.DAS(dim=2).init(jax.random.key(0), 8)
>>> sorted(params["rotation"])
['base', 'raw']
"""

from jaxlens.train._loops import TrainResult as TrainResult
from jaxlens.train._loops import answer_batch as answer_batch
from jaxlens.train._loops import iia as iia
from jaxlens.train._loops import intervened_output as intervened_output
from jaxlens.train._loops import last_position as last_position
from jaxlens.train._loops import train_iit as train_iit
from jaxlens.train._loops import train_reft as train_reft
from jaxlens.train._cache import site_values as site_values
from jaxlens.train._methods import DAS as DAS
from jaxlens.train._methods import BoundlessDAS as BoundlessDAS
from jaxlens.train._methods import DiReFT as DiReFT
from jaxlens.train._methods import LoReFT as LoReFT
from jaxlens.train._methods import LowRankDAS as LowRankDAS
from jaxlens.train._methods import frozen_leaves as frozen_leaves
from jaxlens.train._methods import init_rotation as init_rotation
from jaxlens.train._edits import subspace_mask as subspace_mask
from jaxlens.train._variants import ConsReFT as ConsReFT
from jaxlens.train._variants import LoBiReFT as LoBiReFT
from jaxlens.train._variants import NoReFT as NoReFT
from jaxlens.train._variants import PCAInterchange as PCAInterchange
from jaxlens.train._variants import SAEInterchange as SAEInterchange
from jaxlens.train._variants import SigmoidMask as SigmoidMask
from jaxlens.train._variants import SigmoidMaskDAS as SigmoidMaskDAS
from jaxlens.train._variants import pca_basis as pca_basis
from jaxlens.train._causal import CausalModel as CausalModel
from jaxlens.train._sites import At as At
from jaxlens.train._sites import example_positions as example_positions
from jaxlens.train._sites import iia_multi as iia_multi
from jaxlens.train._sites import multi_output as multi_output
from jaxlens.train._sites import reft_batch as reft_batch
from jaxlens.train._sites import reft_positions as reft_positions
from jaxlens.train._sites import train_multi as train_multi

__all__ = [
  "At",
  "DAS",
  "BoundlessDAS",
  "CausalModel",
  "ConsReFT",
  "DiReFT",
  "LoBiReFT",
  "LoReFT",
  "LowRankDAS",
  "NoReFT",
  "PCAInterchange",
  "SAEInterchange",
  "SigmoidMask",
  "SigmoidMaskDAS",
  "TrainResult",
  "answer_batch",
  "example_positions",
  "frozen_leaves",
  "iia",
  "iia_multi",
  "init_rotation",
  "intervened_output",
  "last_position",
  "multi_output",
  "pca_basis",
  "reft_batch",
  "reft_positions",
  "site_values",
  "subspace_mask",
  "train_iit",
  "train_multi",
  "train_reft",
]
