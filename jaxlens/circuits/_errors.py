"""The error of :mod:`jaxlens.circuits`."""

from __future__ import annotations

from jaxlens.core import InvalidArgumentError

__all__ = ["CircuitError"]


class CircuitError(InvalidArgumentError):
  """An attribution graph refuses its input: a model it cannot freeze, transcoders that do not
  fit the model, a prompt or target out of range, a graph file that is damaged
  (``docs/errors.md``)."""
