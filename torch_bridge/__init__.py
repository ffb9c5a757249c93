"""torch_bridge: the torch side of jaxlens (model conversion, a torch reference, parity).

Importing it imports torch; ``import jaxlens`` never does.
"""

from torch_bridge._convert import ConversionError as ConversionError
from torch_bridge._convert import from_torch as from_torch
from torch_bridge._convert import to_jax as to_jax
from torch_bridge._convert import to_torch as to_torch

__all__ = ["ConversionError", "from_torch", "to_jax", "to_torch"]
