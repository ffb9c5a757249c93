"""Spec, ``when`` and the live door: plain forward hooks (pairs with
``jaxlens/_src/doors.py`` and ``interceptor.py``).
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any, Callable

import torch

from jaxlens import InvalidArgumentError, JaxlensWarning, SiteError
from torch_bridge.reference._edit import Edit, SiteContext, fire
from torch_bridge.reference._selections import Selection
from torch_bridge.reference._verbs import as_edit

# --------------------------------------------------------------------------
# Specs and the live doors: plain forward hooks.


_warned: set[str] = set()


def _warn_once(message: str, *, code: str) -> None:
  if code not in _warned:
    _warned.add(code)
    warnings.warn(JaxlensWarning(message, code=code), stacklevel=4)


def reset_warnings() -> None:
  """Forgets which once-per-session warnings the reference issued (for tests)."""
  _warned.clear()


def _as_rule(site, edit) -> tuple[str, Edit]:
  if isinstance(site, Selection):
    return site.site, site.wrap(edit)
  if not isinstance(site, str):
    raise InvalidArgumentError(
      f"a torch site is a module name (as in model.named_modules()), got {type(site).__name__}",
      code="invalid_site",
      fix='ref.when("0", edit)',
    )
  return site, as_edit(edit)


@dataclasses.dataclass(frozen=True)
class Spec:
  """An ordered tuple of ``(module name, edit)`` rules; ``+`` concatenates."""

  rules: tuple = ()

  def __add__(self, other: "Spec") -> "Spec":
    return Spec(self.rules + other.rules)

  def hooks(self) -> dict[str, Callable]:
    """One forward hook per site, ``hook(module, args, output) -> edited output``, to pass to
    ``model.get_submodule(name).register_forward_hook`` yourself."""
    out = {}
    for name in dict.fromkeys(n for n, _ in self.rules):
      edits = [e for n, e in self.rules if n == name]

      def fn(module, args, output, edits=edits, name=name):
        ctx = SiteContext(name)
        for edit in edits:
          output = fire(edit, output, ctx)
        return output

      out[name] = fn
    return out

  def bind(self, model: torch.nn.Module) -> Callable[..., Any]:
    """``model``'s forward with the edits live in forward hooks."""
    return lambda *inputs, **kwargs: _run(model, inputs, kwargs, self)[0]


def when(site, edit) -> Spec:
  """A spec applying ``edit`` at module ``site`` (a name, or a :func:`units`/:func:`subspace`)."""
  return Spec((_as_rule(site, edit),))


class _Recorder:
  """Forward hooks on every module: apply the matching edits, record the edited outputs."""

  def __init__(self, model: torch.nn.Module, rules, *, skip_root=False):
    self.rules = rules
    self.fired = [0] * len(rules)
    self.values: dict[str, torch.Tensor] = {}
    names = dict(model.named_modules())
    for site, _ in rules:
      if site not in names:
        raise SiteError(
          f"no module named {site!r} in this model",
          code="unknown_site",
          site=site,
          candidates=[n for n in names if n][:10],
          fix=f"one of {[n for n in names if n][:5]}",
        )
    self.handles = [
      m.register_forward_hook(self._hook(n))
      for n, m in names.items()
      if not (skip_root and n == "")
    ]

  def _hook(self, name):
    def fn(module, args, output):
      ctx = SiteContext(name, self.values)
      for i, (site, edit) in enumerate(self.rules):
        if site == name:
          self.fired[i] += 1
          output = fire(edit, output, ctx)
      if name:
        self.values[name] = output
      return output

    return fn

  def close(self):
    for h in self.handles:
      h.remove()

  def check(self):
    for (site, _), count in zip(self.rules, self.fired):
      if count == 0:
        raise SiteError(
          f"module {site!r} did not run in this call",
          code="unknown_site",
          site=site,
          fix="edit a module that the forward calls",
        )


def _run(model, inputs, kwargs, spec: Spec):
  rec = _Recorder(model, spec.rules)
  try:
    out = model(*inputs, **kwargs)
  finally:
    rec.close()
  rec.check()
  return out, rec.values


# --------------------------------------------------------------------------
