"""A module imported on first use, for test files whose optional comparison library (SAELens,
pyvene) takes seconds to import: every xdist worker collects every file, but only the worker
that runs the file should pay for the import."""

import importlib
import importlib.util


class LazyModule:
  """Stands for module ``name``; its first attribute read imports it."""

  def __init__(self, name: str):
    self._name = name

  def __getattr__(self, attr):
    # Private and special names are not the module's API: pytest's collection probes every
    # module-level object for some (``_mock_name``, ``__test__``), which must not import it.
    if attr.startswith("_"):
      raise AttributeError(attr)
    return getattr(importlib.import_module(self._name), attr)


def missing(*names: str) -> list[str]:
  """Which of the top-level packages ``names`` are not installed."""
  return [n for n in names if importlib.util.find_spec(n) is None]
