"""The error every converter raises."""

from __future__ import annotations

from jaxlens import JaxlensError

__all__ = ["ConversionError"]


class ConversionError(JaxlensError, ValueError):
  """A torch model (or part of one) that cannot be converted faithfully.

  Attributes:
    fields: Structured details. Always has ``"code"`` and ``"module"`` (the torch module
      name as in ``named_modules()``, ``""`` for the root). The hand-written fast path adds
      ``"type"`` (and ``"attribute"``, ``"value"``, ``"supported"``); the export path adds
      ``"fix"`` and, for ``unsupported_op``, ``"ops"``: one ``{"op", "node", "module"}`` dict
      per node whose ATen operator has no JAX entry. ``docs/errors.md`` lists every code.
  """
