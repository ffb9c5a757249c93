"""The error every converter raises."""

from __future__ import annotations

from typing import Any

__all__ = ["ConversionError"]


class ConversionError(ValueError):
  """A torch model (or part of one) that cannot be converted faithfully.

  Attributes:
    fields: Structured details. Always has ``"code"`` and ``"module"`` (the torch module
      name as in ``named_modules()``, ``""`` for the root). The hand-written fast path adds
      ``"type"`` (and ``"attribute"``, ``"value"``, ``"supported"``); the export path adds
      ``"fix"`` and, for ``unsupported_op``, ``"ops"``: one ``{"op", "node", "module"}`` dict
      per node whose ATen operator has no JAX entry. ``docs/errors.md`` lists every code.
  """

  def __init__(self, message: str, **fields: Any) -> None:
    super().__init__(message)
    self.fields: dict[str, Any] = fields

  @property
  def code(self) -> str:
    return self.fields.get("code", "")
