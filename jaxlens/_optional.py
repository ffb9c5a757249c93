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

  def __init__(self, package: str, feature: str, extra: str):
    fix = f"pip install 'jaxlens[{extra}]' (or pip install {package})"
    self.fields = {"code": "missing_dependency", "package": package, "fix": fix}
    super().__init__(
      f"[missing_dependency] {feature} needs {package}, which is not installed\n  Fix: {fix}"
    )

  @property
  def code(self) -> str:
    return self.fields["code"]


def require(module: str, *, feature: str, extra: str, package: str | None = None) -> Any:
  """Imports ``module`` or raises :class:`MissingDependencyError`."""
  try:
    return importlib.import_module(module)
  except ImportError as error:
    raise MissingDependencyError(package or module.split(".")[0], feature, extra) from error
