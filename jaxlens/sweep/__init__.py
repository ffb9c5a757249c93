"""Activation-patching sweeps, each grid one compiled call (``jaxlens.sweep``).

:func:`patching_sweep` patches any model's sites at every position (``mesh=`` spreads its
cells over devices and processes); :func:`cone_sweep` does the same for a causal decoder's
residual stream recomputing only each cell's causal cone; :func:`layer_sites` spells a layer
stack's site names. The edit they gate rules with is :func:`jaxlens.gate`.
"""

from jaxlens.sweep._cone import cone_sweep as cone_sweep
from jaxlens.sweep._patching import layer_sites as layer_sites
from jaxlens.sweep._patching import patching_sweep as patching_sweep

__all__ = ["cone_sweep", "layer_sites", "patching_sweep"]
