"""jaxlens's own frames left out of the tracebacks users see, as JAX and Flax do.

JAX filters the traceback of an exception that leaves one of its API boundaries
(``jax.jit``, ``jax.grad``, ...): it drops the frames of the files registered as
exclusions and keeps the user's. jaxlens registers its package here (the library
machinery, not ``jaxlens.models``, whose layers are model code like Flax's
``nn.Dense``, nor the command-line entry points), and wraps its public entry points
in :func:`api_boundary`, so an error raised by an eager ``jl.trace(...)`` is
filtered too, not only one raised under ``jax.jit``.

The filtering follows ``jax.config.jax_traceback_filtering`` (environment variable
``JAX_TRACEBACK_FILTERING``): ``"off"`` shows every frame. The names used are JAX's
private ``jax._src.traceback_util``; a JAX without them leaves tracebacks whole
instead of failing.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, TypeVar

try:
  from jax._src import traceback_util as _traceback_util

  _boundary = _traceback_util.api_boundary
  _register = _traceback_util.register_exclusion
except (ImportError, AttributeError):  # a JAX without them: no filtering
  _boundary = _register = None

try:
  # The frame JAX names as "the user's" in an equation's source info (error messages
  # about traced values, printed jaxprs) skips the same files.
  from jax.extend.source_info_util import register_exclusion as _register_source_info
except (ImportError, AttributeError):
  _register_source_info = None

F = TypeVar("F", bound=Callable)

PACKAGE = Path(__file__).resolve().parent.parent
# Model code and commands keep their frames.
_SHOWN = ("models", "__main__.py", "demo.py", "__pycache__")


def excluded_paths() -> list[str]:
  """The files and folders of jaxlens whose frames are left out of tracebacks."""
  return sorted(
    str(p) for p in PACKAGE.iterdir() if p.name not in _SHOWN and (p.is_dir() or p.suffix == ".py")
  )


def _register_package() -> None:
  for path in excluded_paths():
    if _register is not None:
      _register(path)
    if _register_source_info is not None:
      _register_source_info(path)


_register_package()


def api_boundary(fun: F) -> F:
  """Marks ``fun`` as a public entry point: an exception leaving it has jaxlens's (and
  JAX's) frames removed from its traceback, with a note saying how to see them."""
  if _boundary is None:
    return fun
  return _boundary(fun)
