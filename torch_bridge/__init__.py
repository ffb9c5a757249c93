"""torch_bridge: the torch side of jaxlens (model conversion, a torch reference, parity).

* :func:`from_torch` converts a torch model to Flax with a site map;
* :mod:`torch_bridge.reference` is the torch reference of every verb and door of the
  gradient contract, in plain forward hooks;
* :func:`load_spec` loads a spec saved by jaxlens as torch hooks for the torch model;
* :func:`from_pyvene` copies a trained pyvene intervention's parameters for jaxlens.train;
* ``python -m torch_bridge.matrix`` measures the contract matrix on both frameworks.

Importing it imports torch; ``import jaxlens`` never does.
"""

from torch_bridge import reference as reference
from torch_bridge.convert import ConversionError as ConversionError
from torch_bridge.convert import from_torch as from_torch
from torch_bridge.convert import to_jax as to_jax
from torch_bridge.convert import to_torch as to_torch
from torch_bridge._portable import TorchSpecError as TorchSpecError
from torch_bridge._portable import load_spec as load_spec
from torch_bridge._pyvene import from_pyvene as from_pyvene

__all__ = [
  "ConversionError",
  "TorchSpecError",
  "from_pyvene",
  "from_torch",
  "load_spec",
  "reference",
  "to_jax",
  "to_torch",
]
