"""Edit, SiteContext, fire, the keep_grad check, argument helpers and sources
(pairs with ``jaxlens/_src/edit.py``).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import numpy as np
import torch

from jaxlens import GradientContractError, InterventionDecision, InvalidArgumentError, ShapeError

# --------------------------------------------------------------------------
# Edits and the context they fire in.


@dataclasses.dataclass(frozen=True)
class SiteContext:
  """What an edit may know of the site it edits (passed as ``hook=`` to callables).

  Attributes:
    label: the torch module name of the site (``"0"``).
    site_values: the (edited) outputs of the modules that already ran in this call.
  """

  label: str
  site_values: dict = dataclasses.field(default_factory=dict)

  @classmethod
  def standalone(cls) -> "SiteContext":
    return cls(label="<standalone>")


@dataclasses.dataclass(frozen=True)
class Edit:
  """One edit of a torch site value.

  Attributes:
    name: the verb's name, as in jaxlens (``"scale"``).
    fn: ``fn(x, ctx) -> new value`` (or an :class:`InterventionDecision` from a hook).
    keeps: whether the verb keeps the graph through what it writes.
    keep_grad: whether :func:`fire` checks that it does.
    parts: the inner edits of a combinator (``compose``, ``at_positions``, selections).
    data: arguments another edit reads (``set_affine_coordinates``'s ``W`` and ``b``).
  """

  name: str
  fn: Callable[[torch.Tensor, SiteContext], Any]
  keeps: bool = True
  keep_grad: bool = False
  parts: tuple = ()
  data: dict = dataclasses.field(default_factory=dict, compare=False)

  def __call__(self, x: torch.Tensor, ctx: SiteContext | None = None) -> torch.Tensor:
    """Applies the edit to a tensor outside any door."""
    return fire(self, x, ctx if ctx is not None else SiteContext.standalone())

  def __repr__(self) -> str:
    text = f"ref.{self.name}(...)"
    return f"keep_grad({text})" if self.keep_grad else text


def _asks_keep_grad(edit: Edit) -> bool:
  return edit.keep_grad or any(_asks_keep_grad(p) for p in edit.parts)


def _names(edit: Edit):
  yield edit.name
  for part in edit.parts:
    yield from _names(part)


def _check_preconditions(x: torch.Tensor, ctx: SiteContext) -> None:
  if not torch.is_grad_enabled():
    raise GradientContractError(
      "keep_grad with gradients disabled (torch.no_grad()): nothing written carries a graph",
      code="grad_disabled",
      site=ctx.label,
      fix="call the door outside torch.no_grad()",
    )
  if not (x.is_floating_point() or x.is_complex()):
    raise GradientContractError(
      f"keep_grad on a site of dtype {x.dtype}: an integer or boolean value has no gradient",
      code="site_not_float",
      site=ctx.label,
      fix="drop keep_grad for this site",
    )
  if not x.requires_grad:
    raise GradientContractError(
      "keep_grad: the site value does not require grad, so there is no graph to keep",
      code="site_has_no_graph",
      site=ctx.label,
      fix="drop keep_grad here, or edit a site downstream of parameters that require grad",
    )


_KEEPING_SPELLINGS = {
  "zero_ablate": "keep_grad(ref.scale(0.0))",
  "replace_with": "keep_grad(ref.compose(ref.scale(0.0), ref.add(value)))",
}
_DEFAULT_SPELLING = "keep_grad(ref.compose(ref.scale(0.0), ref.add(value)))"


def fire(edit: Edit, x: torch.Tensor, ctx: SiteContext) -> torch.Tensor:
  """Applies ``edit`` to the site value ``x``, with the result and keep_grad checks."""
  if not isinstance(x, torch.Tensor):
    raise InvalidArgumentError(
      f"the site value is a {type(x).__name__}, not a tensor; edits apply to tensor sites",
      code="site_not_array",
      site=ctx.label,
      fix="select a module whose forward returns one tensor",
    )
  if edit.keep_grad:
    _check_preconditions(x, ctx)
  y = edit.fn(x, ctx)
  asked = False
  if isinstance(y, InterventionDecision):
    y, asked = y.action, y.keep_grad
    if asked:
      _check_preconditions(x, ctx)
  _check_result(edit, x, y, ctx)
  if (edit.keep_grad or asked) and x.requires_grad and not y.requires_grad:
    raise GradientContractError(
      f"keep_grad: {edit!r} writes values that carry no autograd graph while the site value "
      "had one, so no gradient reaches the parameters upstream of it",
      code="edit_detached_from_graph",
      site=ctx.label,
      fix=_KEEPING_SPELLINGS.get(edit.name, _DEFAULT_SPELLING),
      verb=edit.name,
    )
  return y


def _check_result(edit: Edit, x: torch.Tensor, y: Any, ctx: SiteContext) -> None:
  prefix = "hook_" if edit.name == "hook" else ""
  if not isinstance(y, torch.Tensor):
    raise ShapeError(
      f"{edit!r} returned a {type(y).__name__}, not a tensor",
      code=prefix + "shape_mismatch",
      site=ctx.label,
      fix=f"return a tensor of shape {tuple(x.shape)}",
    )
  if y.shape != x.shape:
    raise ShapeError(
      f"{edit!r} returned shape {tuple(y.shape)} for a site of shape {tuple(x.shape)}",
      code=prefix + "shape_mismatch",
      site=ctx.label,
      fix=f"return a tensor of shape {tuple(x.shape)}",
      expected=str(tuple(x.shape)),
      received=str(tuple(y.shape)),
    )
  if y.dtype != x.dtype:
    raise ShapeError(
      f"{edit!r} returned dtype {y.dtype} for a site of dtype {x.dtype}",
      code=prefix + "dtype_mismatch",
      site=ctx.label,
      fix=f"return a tensor of dtype {x.dtype}",
    )


# --------------------------------------------------------------------------
# Argument helpers.


def _tensor(value, like: torch.Tensor) -> torch.Tensor:
  """``value`` as a tensor on ``like``'s device and dtype (a tensor keeps its graph)."""
  if isinstance(value, torch.Tensor):
    return value.to(device=like.device, dtype=like.dtype)
  return torch.as_tensor(np.array(value), device=like.device).to(like.dtype)


def _fail_shape(msg, ctx, verb, fix, code="shape_mismatch", **fields):
  raise ShapeError(f"{verb}: {msg}", code=code, site=ctx.label, fix=fix, verb=verb, **fields)


def _broadcast(value: torch.Tensor, x: torch.Tensor, ctx, verb, name) -> torch.Tensor:
  try:
    ok = torch.broadcast_shapes(value.shape, x.shape) == x.shape
  except RuntimeError:
    ok = False
  if not ok:
    _fail_shape(
      f"{name} has shape {tuple(value.shape)}, expected shape {tuple(x.shape)} (or one "
      "that broadcasts to it)",
      ctx,
      verb,
      fix=f"pass a {name} of shape {tuple(x.shape)}",
      expected=str(tuple(x.shape)),
      received=str(tuple(value.shape)),
    )
  return value.expand(x.shape)


def _donor(value, x, ctx, verb, name, *, broadcast=False) -> torch.Tensor:
  """A value written verbatim into the site, detached: same dtype, shape equal (or broadcast)."""
  weak = isinstance(value, (int, float, bool))
  t = value if isinstance(value, torch.Tensor) else torch.as_tensor(np.array(value))
  if not weak and t.dtype != x.dtype:
    _fail_shape(
      f"{name} has dtype {t.dtype} but the site value is {x.dtype}",
      ctx,
      verb,
      code="dtype_mismatch",
      fix=f"{name}.to({x.dtype})",
    )
  t = t.detach().to(device=x.device, dtype=x.dtype)
  if broadcast:
    return _broadcast(t, x, ctx, verb, name).clone()
  if t.shape != x.shape:
    _fail_shape(
      f"{name} has shape {tuple(t.shape)}, expected shape {tuple(x.shape)}",
      ctx,
      verb,
      fix=f"pass a {name} of shape {tuple(x.shape)}",
      expected=str(tuple(x.shape)),
      received=str(tuple(t.shape)),
    )
  return t.clone()


def _resolve_axis(x, direction, feature_axis, ctx, verb) -> int:
  """The axis of ``x`` a 1-D direction lies along (the same rule as jaxlens)."""
  d = direction if isinstance(direction, torch.Tensor) else np.asarray(direction)
  if d.ndim != 1:
    _fail_shape(
      f"direction must be 1-D, got shape {tuple(d.shape)}",
      ctx,
      verb,
      fix="pass a 1-D direction (use ref.add(delta) for a full-shape delta)",
    )
  n = d.shape[0]
  if feature_axis is not None:
    axis = feature_axis + x.ndim if feature_axis < 0 else feature_axis
    if not 0 <= axis < x.ndim or x.shape[axis] != n:
      _fail_shape(
        f"feature_axis={feature_axis} does not have size {n} in site shape {tuple(x.shape)}",
        ctx,
        verb,
        fix=f"a feature_axis whose size is {n}",
      )
    return axis
  axes = [a for a in range(x.ndim) if x.shape[a] == n]
  if not axes:
    _fail_shape(
      f"direction of length {n} matches no axis of site shape {tuple(x.shape)}",
      ctx,
      verb,
      fix="pass a direction whose length is the site's feature size",
    )
  if len(axes) > 1:
    raise InvalidArgumentError(
      f"{verb}: a direction of length {n} fits axes {axes} of site shape {tuple(x.shape)}; "
      "which is the feature axis is ambiguous",
      code="feature_axis_ambiguous",
      site=ctx.label,
      verb=verb,
      candidates=axes,
      fix=f"ref.{verb}(direction, ..., feature_axis={axes[-1] - x.ndim})",
    )
  return axes[0]


def _along(vec: torch.Tensor, axis: int, ndim: int) -> torch.Tensor:
  shape = [1] * ndim
  shape[axis] = vec.shape[0]
  return vec.reshape(shape)


def _unit(direction, x, ctx, verb, feature_axis):
  axis = _resolve_axis(x, direction, feature_axis, ctx, verb)
  d = _tensor(direction, x)
  return _along(d / torch.linalg.norm(d), axis, x.ndim), axis


# --------------------------------------------------------------------------
# --------------------------------------------------------------------------
# Sources: tensors, populations and donor traces.


class Donor:
  """A run whose saved values a verb reads (:class:`Trace`; ``jaxlens.Donor`` in torch)."""

  def value_for_donor(self, label: str, verb: str) -> torch.Tensor:
    raise NotImplementedError

  def __getitem__(self, site):
    raise NotImplementedError


class Population:
  """Reference activations of one site, stacked along axis 0 (as ``jl.Population``)."""

  def __init__(self, values: torch.Tensor):
    self.values = values

  def __repr__(self) -> str:
    return f"Population(shape={tuple(self.values.shape)})"


def population(*sources, site: str | None = None) -> Population:
  """Concatenates tensors (or traces' values at ``site``) along axis 0."""
  parts = []
  for s in sources:
    if isinstance(s, Donor):
      if site is None:
        raise InvalidArgumentError(
          "population of traces needs site=",
          code="invalid_source",
          fix='ref.population(trace, site="0")',
        )
      parts.append(s[site].out)
    else:
      parts.append(s if isinstance(s, torch.Tensor) else torch.as_tensor(np.array(s)))
  if not parts:
    raise InvalidArgumentError(
      "population needs at least one source",
      code="invalid_source",
      fix="ref.population(trace_a, trace_b, site=...)",
    )
  return Population(torch.cat(parts, dim=0))


def _source(source, ctx, verb) -> torch.Tensor:
  """The tensor behind a source, detached: a donor's graph is never followed."""
  if isinstance(source, Donor):
    return source.value_for_donor(ctx.label, verb).detach()
  if isinstance(source, Population):
    return source.values.detach()
  if isinstance(source, torch.Tensor):
    return source.detach()
  if isinstance(source, (np.ndarray, jax.Array, float, int)):
    return torch.as_tensor(np.array(source))
  raise InvalidArgumentError(
    f"{verb}: a source must be a tensor, a ref.Population or a ref.Trace, got "
    f"{type(source).__name__}",
    code="invalid_source",
    site=ctx.label,
    verb=verb,
    fix=f"ref.{verb}(source=ref.population(trace, site=...))",
  )


# --------------------------------------------------------------------------
