"""Optional dependencies, imported when a feature first needs them.

``import jaxlens`` imports none of them: matplotlib (plots), tqdm (progress bars)
and treescope (notebook views) load on the first call that uses them, and a
missing one raises :class:`MissingDependencyError` naming the extra to install.
"""

from __future__ import annotations

import importlib
from typing import Any

from jaxlens._src.errors import JaxlensError


class MissingDependencyError(JaxlensError, ImportError):
  """An optional package that a jaxlens feature needs is not installed.

  Attributes:
    fields: ``{"code": "missing_dependency", "package": ..., "fix": ...}``.
  """


def require(module: str, *, feature: str, extra: str, package: str | None = None) -> Any:
  """Imports ``module`` or raises :class:`MissingDependencyError`."""
  try:
    return importlib.import_module(module)
  except ImportError as error:
    package = package or module.split(".")[0]
    raise MissingDependencyError(
      f"{feature} needs {package}, which is not installed",
      code="missing_dependency",
      fix=f"pip install 'jaxlens[{extra}]' (or pip install {package})",
      package=package,
    ) from error
