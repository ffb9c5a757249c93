"""Every dtype decision of the converters, in one place: torch dtype -> JAX dtype, the
``dtype=`` argument, what float64 needs, and the dtypes JAX lacks."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import torch

from torch_bridge.convert._errors import ConversionError

__all__ = ["JAX_LACKS", "dtype_argument", "jax_dtype", "runtime_dtype", "target_dtype"]

# torch dtypes with no JAX counterpart.
JAX_LACKS = {torch.complex32, torch.quint8, torch.qint8, torch.qint32, torch.quint4x2}

_X64_FIX = 'enable it with jax.config.update("jax_enable_x64", True) or pass dtype=jnp.float32'


def jax_dtype(dtype: Any) -> np.dtype:
  """A numpy/jax dtype from a torch dtype or anything ``jnp.dtype`` takes (TypeError if none)."""
  if isinstance(dtype, torch.dtype):
    dtype = str(dtype).removeprefix("torch.")
  return jnp.dtype(dtype)


def runtime_dtype(dtype: torch.dtype):
  """The JAX dtype a torch value of ``dtype`` takes in a converted program: the same, except
  64-bit ones without ``jax_enable_x64`` (int64 -> int32, float64 -> float32)."""
  name = str(dtype).removeprefix("torch.")
  if name == "int64" and not jax.config.read("jax_enable_x64"):
    return jnp.int32
  if name == "float64" and not jax.config.read("jax_enable_x64"):
    return jnp.float32
  return jnp.dtype(name)


def dtype_argument(dtype: Any, *, type_name: str | None = None) -> np.dtype | None:
  """A converter's ``dtype=`` argument as a floating JAX dtype (None: keep torch's), or
  ``unsupported_dtype``."""
  if dtype is None:
    return None
  try:
    target = jax_dtype(dtype)
  except TypeError:
    target = None
  if target is None or not jnp.issubdtype(target, jnp.floating):
    where = "" if type_name is None else f"cannot convert torch module <root> ({type_name}): "
    raise ConversionError(
      f"{where}dtype={dtype!r} is not supported; supported: None (keep torch's) or a "
      "floating dtype such as jnp.float32",
      code="unsupported_dtype",
      module="",
      attribute="dtype",
      value=dtype,
      fix="dtype=jnp.float32",
      **({} if type_name is None else {"type": type_name}),
    )
  return target


def target_dtype(module: torch.nn.Module, dtype: Any) -> np.dtype | None:
  """The fast path's parameter dtype: the ``dtype`` argument checked, and float64 (asked for
  or kept from torch) refused without ``jax_enable_x64``."""
  name = type(module).__name__
  dtype = dtype_argument(dtype, type_name=name)
  wanted = {dtype} if dtype is not None else {jax_dtype(p.dtype) for p in module.parameters()}
  if any(d.itemsize == 8 for d in wanted) and not jax.config.read("jax_enable_x64"):
    raise ConversionError(
      f"cannot convert torch module <root> ({name}): 64-bit parameters need jax_enable_x64",
      code="unsupported_dtype",
      module="",
      type=name,
      fix=_X64_FIX,
    )
  return dtype
