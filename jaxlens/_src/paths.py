"""The path argument of a loader, checked before any file is touched."""

from __future__ import annotations

import functools
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from jaxlens._src.errors import InvalidArgumentError

Loader = TypeVar("Loader", bound=Callable[..., Any])


def is_path(value: Any) -> bool:
  """Whether ``value`` names a file: a non-empty ``str`` or an ``os.PathLike``."""
  return isinstance(value, os.PathLike) or (isinstance(value, str) and bool(value))


def path_argument(
  error: type[InvalidArgumentError] = InvalidArgumentError, chunks: bool = False
) -> Callable[[Loader], Loader]:
  """Decorates a loader whose first argument is a path: anything else (``None``, a number, an
  empty string) is ``error`` with code ``invalid_argument`` instead of the ``TypeError`` that
  ``open`` or ``Path`` would raise deep inside. ``chunks``: a list or tuple of paths is also a
  path (``load_gguf``'s chunked files)."""

  def wrap(loader: Loader) -> Loader:
    @functools.wraps(loader)
    def checked(path, *args, **kwargs):
      ok = is_path(path) or (
        chunks and isinstance(path, (list, tuple)) and all(is_path(p) for p in path)
      )
      if not ok:
        raise error(
          f"{loader.__name__}: path must be a str or os.PathLike naming a file or directory, "
          f"got {type(path).__name__} {path!r:.60}",
          code="invalid_argument",
          expected="str or os.PathLike" + (" (or a list of them)" if chunks else ""),
          received=type(path).__name__,
          fix=f'{loader.__name__}("path/to/it", ...)',
        )
      return loader(path, *args, **kwargs)

    return checked  # type: ignore[return-value]

  return wrap


def write_directory(root: Path, files: dict[str, bytes]) -> Path:
  """Writes ``files`` (relative path -> bytes) as the directory ``root``, whole or not at all:
  into a temporary sibling renamed over ``root`` (an existing one is moved aside first and
  removed once the new one is in place), so no partial directory is ever left. OS errors
  propagate; the caller says what it refused to replace and wraps them in its own error."""
  root.parent.mkdir(parents=True, exist_ok=True)
  tmp = Path(tempfile.mkdtemp(prefix=f".{root.name}.", dir=root.parent))
  try:
    for name, data in files.items():
      (tmp / name).parent.mkdir(parents=True, exist_ok=True)
      (tmp / name).write_bytes(data)
    if root.exists():
      # A name of its own (an empty directory, which rename replaces): a fixed one, left by a
      # crash between the two renames, made every later write fail (ENOTEMPTY).
      old = Path(tempfile.mkdtemp(prefix=f".{root.name}.old.", dir=root.parent))
      os.replace(root, old)
      os.replace(tmp, root)
      shutil.rmtree(old)
    else:
      os.replace(tmp, root)
  finally:
    if tmp.exists():
      shutil.rmtree(tmp)
  return root
