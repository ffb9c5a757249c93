"""Typed errors and warnings of jaxlens.

Every error jaxlens and torch_bridge raise is a :class:`JaxlensError`, built by its one
constructor; bad input is an :class:`InvalidArgumentError` (a ``ValueError``) or one of its
subclasses. Each carries ``.fields``, a dict with at least ``"code"`` (a stable
machine-readable reason), and where it applies ``"site"`` (the site label or selector
involved) and ``"fix"`` (a spelling that works). A new subpackage's error class subclasses
one of these with a docstring only.
"""

from __future__ import annotations

import warnings
from typing import Any


class JaxlensError(Exception):
  """Base class of every jaxlens and torch_bridge error: the one constructor.

  The message reads ``[code] message (site: ...)`` with, when there is one, a second line
  ``Fix: ...``. Every other error class is a subclass with a docstring only, so each error
  has the same fields and the same message shape (``docs/errors.md`` lists the classes and
  codes; ``tests/test_errors.py`` checks both).

  Args:
    message: what went wrong, naming the argument, what was received and what was expected.
    code: a stable machine-readable reason (``docs/errors.md`` lists every code).
    site: the site label, selector or tensor involved, if any.
    fix: a spelling that works, if there is one.
    **fields: further details (``expected``, ``received``, ``candidates``, ``path`` ...).

  Attributes:
    fields: a dict with ``"code"`` and, where given, ``"site"`` (as a string), ``"fix"`` and
      the further details.
  """

  def __init__(
    self, message: str, *, code: str, site: Any = None, fix: str | None = None, **fields: Any
  ):
    self.fields = {"code": code, **fields}
    if site is not None:
      self.fields["site"] = str(site)
    if fix is not None:
      self.fields["fix"] = fix
    text = f"[{code}] {message}"
    if site is not None:
      text += f" (site: {site})"
    if fix is not None:
      text += f"\n  Fix: {fix}"
    super().__init__(text)

  @property
  def code(self) -> str:
    """The stable reason, ``fields["code"]``."""
    return self.fields["code"]


class InvalidArgumentError(JaxlensError, ValueError):
  """An argument or a site value that jaxlens refuses.

  Attributes:
    fields: a dict with ``"code"`` and, where known, ``"site"``, ``"fix"``,
      ``"expected"``, ``"received"`` and ``"candidates"``.
  """


class SiteError(InvalidArgumentError):
  """A site selector names nothing, or several values where one is needed."""


class ShapeError(InvalidArgumentError):
  """An array argument or an edited value has the wrong shape or dtype."""


class GradientContractError(InvalidArgumentError):
  """``keep_grad`` found that the gradient cannot flow as asked."""


class SpecFormatError(InvalidArgumentError):
  """A saved spec that is missing, truncated, altered or not portable."""


class JaxlensWarning(UserWarning):
  """Base class of jaxlens warnings; ``.fields["code"]`` as for errors."""

  def __init__(self, message: str, *, code: str, **fields: Any):
    self.fields = {"code": code, **fields}
    super().__init__(f"[{code}] {message}")


_warned_once: set[str] = set()


def warn_once(message: str, *, code: str, **fields: Any) -> None:
  """Issues a :class:`JaxlensWarning` the first time ``code`` is seen in this process."""
  if code in _warned_once:
    return
  _warned_once.add(code)
  warnings.warn(JaxlensWarning(message, code=code, **fields), stacklevel=3)


def reset_warnings() -> None:
  """Forgets which once-per-session warnings were issued (for tests)."""
  _warned_once.clear()
