"""JAX's persistent compilation cache, on by default in a user cache directory.

XLA compiles every new program; a jitted forward of a 30-layer model takes seconds, and a new
process compiles again. JAX can keep compiled programs on disk
(``jax_compilation_cache_dir``); ``import jaxlens`` turns that on in a per-user directory
unless something already chose:

* ``JAXLENS_COMPILATION_CACHE=0`` (or ``off``, ``false``, ``no``) leaves JAX's cache off;
* ``JAXLENS_COMPILATION_CACHE=/some/dir`` uses that directory;
* a directory set already, through ``JAX_COMPILATION_CACHE_DIR`` or
  ``jax.config.update("jax_compilation_cache_dir", ...)``, is kept as it is;
* otherwise ``$XDG_CACHE_HOME/jaxlens/xla`` (``~/.cache/jaxlens/xla``; on macOS
  ``~/Library/Caches/jaxlens/xla``, on Windows ``%LOCALAPPDATA%\\jaxlens\\xla``).

At run time :func:`set_compilation_cache` switches it (a directory, the default one, or off)
and :func:`compilation_cache_dir` says which directory is in use. JAX's own thresholds apply:
a program is written only when it took at least ``jax_persistent_cache_min_compile_time_secs``
(1 s by default) to compile, and the directory grows without bound unless
``jax_compilation_cache_max_size`` is set (which needs the ``filelock`` package).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from pathlib import Path

import jax

from jaxlens._src.errors import InvalidArgumentError

__all__ = ["compilation_cache_dir", "default_cache_dir", "set_compilation_cache"]

ENV = "JAXLENS_COMPILATION_CACHE"
_OFF = {"0", "off", "false", "no"}


def default_cache_dir(environ: Mapping[str, str] | None = None, platform: str | None = None):
  """The per-user directory jaxlens keeps compiled programs in (see the module docstring)."""
  environ = os.environ if environ is None else environ
  platform = sys.platform if platform is None else platform
  home = Path(environ.get("HOME") or Path.home())
  if platform == "darwin":
    base = home / "Library" / "Caches"
  elif platform.startswith("win"):
    base = Path(environ.get("LOCALAPPDATA") or home / "AppData" / "Local")
  else:
    base = Path(environ.get("XDG_CACHE_HOME") or home / ".cache")
  return base / "jaxlens" / "xla"


def import_time_choice(environ: Mapping[str, str], configured: str | None) -> str | None:
  """The directory ``import jaxlens`` turns the cache on in, or None to leave JAX as it is.

  Args:
    environ: the environment (``os.environ``).
    configured: the ``jax_compilation_cache_dir`` JAX has already (None if unset).
  """
  switch = environ.get(ENV)
  if switch is not None and switch.strip().lower() in _OFF | {""}:
    return None
  if configured or environ.get("JAX_COMPILATION_CACHE_DIR"):
    return None
  if switch is not None:
    return str(Path(switch).expanduser())
  return str(default_cache_dir(environ))


def _reset():
  from jax.experimental.compilation_cache import compilation_cache

  compilation_cache.reset_cache()


def _configure_at_import() -> None:
  chosen = import_time_choice(os.environ, jax.config.jax_compilation_cache_dir)
  if chosen is not None:
    jax.config.update("jax_compilation_cache_dir", chosen)
    _reset()


def compilation_cache_dir() -> str | None:
  """The directory JAX's persistent compilation cache writes to, or None when it is off."""
  if not jax.config.jax_enable_compilation_cache:
    return None
  return jax.config.jax_compilation_cache_dir or None


def set_compilation_cache(path: str | os.PathLike | bool = True) -> str | None:
  """Turns JAX's persistent compilation cache on in a directory, or off.

  Args:
    path: a directory; True for jaxlens's per-user default (:func:`default_cache_dir`); False
      to turn the cache off (compiled programs then live in this process only).

  Returns:
    The directory now in use, or None when off.

  Example:
    >>> import jaxlens as jl
    >>> before = jl.compilation_cache_dir()
    >>> jl.set_compilation_cache(False) is None
    True
    >>> _ = jl.set_compilation_cache(before or False)
  """
  if path is False or path is None:
    jax.config.update("jax_compilation_cache_dir", None)
    _reset()
    return None
  if path is True:
    path = default_cache_dir()
  if not isinstance(path, (str, os.PathLike)) or not str(path):
    raise InvalidArgumentError(
      f"set_compilation_cache takes a directory, True or False, got {path!r}",
      code="invalid_argument",
      fix='jl.set_compilation_cache("~/.cache/jaxlens/xla"), or True, or False',
    )
  chosen = str(Path(path).expanduser())
  jax.config.update("jax_enable_compilation_cache", True)
  jax.config.update("jax_compilation_cache_dir", chosen)
  _reset()
  return chosen
