"""Moving arrays between torch and JAX (their dtypes: :mod:`torch_bridge.convert._dtypes`)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import torch

__all__ = ["to_jax", "to_torch"]


def to_jax(t: torch.Tensor) -> jax.Array:
  """Moves a torch tensor to a jax array, without a copy where possible.

  Uses DLPack (zero-copy: the result aliases the tensor's memory, so do
  not modify the tensor in place afterwards). Tensors that require grad
  are detached first, non-contiguous ones (or with conj/neg bits) are made
  contiguous (a copy); if DLPack still fails (e.g. unsupported device or
  dtype) the data is copied through numpy to jax's default device.
  As with any jax input, 64-bit data becomes 32-bit unless
  ``jax_enable_x64`` is on.

  Args:
    t: The tensor.

  Returns:
    A jax array with the tensor's shape and values.
  """
  if not isinstance(t, torch.Tensor):
    raise TypeError(f"to_jax expects a torch.Tensor, got {type(t).__name__}")
  t = t.detach().resolve_conj().resolve_neg()
  if not t.is_contiguous():
    t = t.contiguous()
  try:
    return jax.dlpack.from_dlpack(t)
  except (BufferError, RuntimeError, TypeError, ValueError):
    t = t.cpu()
    if t.dtype == torch.bfloat16:
      return jnp.asarray(t.float().numpy(), dtype=jnp.bfloat16)
    return jnp.asarray(t.numpy())


def to_torch(a: Any) -> torch.Tensor:
  """Moves a jax (or numpy) array to a torch tensor, without a copy where possible.

  jax arrays go through DLPack (zero-copy: the tensor aliases jax's
  immutable buffer, so never modify it in place; clone it first if you
  need to). Arrays DLPack can't export (e.g. sharded over several devices)
  are copied through numpy. numpy arrays are wrapped with
  ``torch.from_numpy`` when contiguous and writable, else copied.

  Args:
    a: A ``jax.Array``, numpy array or anything ``np.asarray`` takes.
      A torch tensor is returned unchanged.

  Returns:
    A torch tensor with the array's shape and values.
  """
  if isinstance(a, torch.Tensor):
    return a
  if isinstance(a, jax.Array):
    try:
      return torch.from_dlpack(a)
    except (BufferError, RuntimeError, TypeError, ValueError):
      pass
  host = np.asarray(a)
  if host.dtype == jnp.bfloat16:
    return torch.from_numpy(host.astype(np.float32)).to(torch.bfloat16)
  if not (host.flags.c_contiguous and host.flags.writeable):
    host = np.array(host, order="C", copy=True)
  return torch.from_numpy(host)
