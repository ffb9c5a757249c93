"""Activation-patching sweeps over sites x positions in one compiled call (``jaxlens.sweep``)."""

from jaxlens._src.sweep import layer_sites as layer_sites
from jaxlens._src.sweep import patching_sweep as patching_sweep
from jaxlens._src.verbs import gate as gate
from jaxlens.cone_sweep import cone_sweep as cone_sweep

__all__ = ["gate", "layer_sites", "patching_sweep", "cone_sweep"]
