"""The zoo's layers read a stored parameter directly.

``flax.linen.Module.param`` on a model that already has its parameters (every call after
``init``) returns the stored value, but first checks its shape by tracing the initializer under
``jax.eval_shape``: for a normal initializer, its random-number program, once per parameter per
call. On a 30-layer model that is about 270 initializer traces for every trace of a forward,
about 40% of the time to trace SmolLM2's forward (0.50 s against 0.28 s). The layers here
check the same shape against the shape they ask for, without the initializer.
"""

from __future__ import annotations

import flax.errors
import flax.linen as nn
import numpy as np
from flax.core import meta


class StoredParams(nn.Module):
  """Mixin for a layer whose ``self.param(name, init, shape, ...)`` calls give the shape first,
  a tuple or list of ints (flax's ``Dense``, ``Embed`` and ``LayerNorm``, the zoo's own
  layers). A stored parameter is read and its shape compared with ``shape`` (flax's
  ``ScopeParamShapeError`` on a mismatch, as ``Module.param`` raises); at ``init``, or for a
  call that gives no shape, ``Module.param`` runs as it is. A stored value without a shape is
  returned as it is.
  """

  @nn.nowrap  # not a module method of its own: no site, no interception
  def param(self, name, init_fn, *init_args, unbox=True, **init_kwargs):
    shape = init_args[0] if init_args else None
    if (
      self.is_initializing()
      or not isinstance(shape, (tuple, list))
      or not all(isinstance(n, (int, np.integer)) for n in shape)
      or not self.has_variable("params", name)
    ):
      return super().param(name, init_fn, *init_args, unbox=unbox, **init_kwargs)
    value = self.get_variable("params", name)
    if unbox:
      value = meta.unbox(value)
    if hasattr(value, "shape") and np.shape(value) != tuple(shape):
      raise flax.errors.ScopeParamShapeError(
        name, self.scope.path_text, np.shape(value), tuple(shape)
      )
    return value
