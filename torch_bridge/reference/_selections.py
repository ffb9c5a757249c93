"""Selections: ``units`` and ``subspace`` (projection semantics), and the verb table a
saved jaxlens spec is rebuilt through (pairs with ``jaxlens/_src/selections.py``).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from jaxlens import InvalidArgumentError
from torch_bridge.reference import _trained
from torch_bridge.reference._edit import (
  Edit,
  Population,
  _along,
  _fail_shape,
  _names,
  _tensor,
  fire,
)
from torch_bridge.reference._verbs import (
  add,
  add_noise,
  as_edit,
  at_positions,
  clamp,
  compose,
  mean_ablate,
  patch_from,
  permute_batch,
  project_onto,
  project_out,
  replace_with,
  resample_rows_from,
  scale,
  scramble_elements,
  set_direction_mean,
  steer,
  swap_with,
  zero_ablate,
)

# --------------------------------------------------------------------------
# Selections: units and subspace (projection semantics), as in jaxlens.


_SOURCE_VERBS = ("replace_with", "swap_with", "patch_from", "resample_rows_from")


@dataclasses.dataclass(frozen=True)
class Selection:
  """A site plus what to select in it; :func:`when` and ``Trace.do`` accept it as a site."""

  site: str | None
  kind: str
  data: dict
  feature_axis: int = -1

  def wrap(self, edit) -> Edit:
    """The edit restricted to the selection; keep_grad asks about the whole written value."""
    inner = as_edit(edit)
    keep, inner = inner.keep_grad, dataclasses.replace(inner, keep_grad=False)
    if self.kind == "units":
      fn = lambda x, ctx: _units(x, ctx, self.data["indices"], self.feature_axis, inner)
    else:
      fn = lambda x, ctx: _subspace(x, ctx, self.data, self.feature_axis, inner)
    return Edit(self.kind, fn, keeps=True, keep_grad=keep, parts=(inner,))


def units(site: str, indices, *, feature_axis: int = -1) -> Selection:
  """Selects elements: a boolean mask, 1-D feature indices, or ``(n, ndim)`` element indices."""
  return Selection(site, "units", {"indices": indices}, feature_axis)


def _units(x, ctx, indices, feature_axis, inner):
  fail = lambda msg, code="shape_mismatch": _fail_shape(
    msg, ctx, "units", code=code, fix='ref.units("0", [0, 2])'
  )
  idx = indices if isinstance(indices, torch.Tensor) else torch.as_tensor(np.array(indices))
  idx = idx.to(x.device)
  if idx.dtype == torch.bool:
    try:
      mask = idx.expand(x.shape)
    except RuntimeError:
      fail(
        f"a mask of shape {tuple(idx.shape)} does not broadcast to the site's shape "
        f"{tuple(x.shape)}"
      )
  elif not idx.is_floating_point():
    if idx.ndim == 1:
      axis = feature_axis + x.ndim if feature_axis < 0 else feature_axis
      n = x.shape[axis]
      if idx.numel() and (int(idx.max()) >= n or int(idx.min()) < -n):
        fail(
          f"feature indices {idx.tolist()} out of range for axis {axis} of size {n}",
          "index_out_of_range",
        )
      line = torch.zeros(n, dtype=torch.bool, device=x.device)
      line[idx] = True
      mask = _along(line, axis, x.ndim).expand(x.shape)
    elif idx.ndim == 2 and idx.shape[1] == x.ndim:
      hi = torch.as_tensor(x.shape, device=x.device)
      if idx.numel() and (bool((idx >= hi).any()) or bool((idx < -hi).any())):
        fail(
          f"element indices out of range for the site's shape {tuple(x.shape)}",
          "index_out_of_range",
        )
      mask = torch.zeros(x.shape, dtype=torch.bool, device=x.device)
      mask[tuple(idx.T)] = True
    else:
      fail(
        f"integer indices of shape {tuple(idx.shape)}: expected (n,) feature indices or "
        f"(n, {x.ndim}) element indices"
      )
  else:
    fail(
      f"indices of dtype {idx.dtype}: expected a boolean mask or integer indices", "dtype_mismatch"
    )
  if not bool(mask.any()):
    raise InvalidArgumentError(
      "units: the selection is empty",
      code="empty_selection",
      site=ctx.label,
      fix="select at least one element",
    )
  if "permute_batch" in tuple(_names(inner)):
    if not bool((mask == mask.narrow(0, 0, 1)).all()):
      raise InvalidArgumentError(
        f"units: {inner!r} moves whole rows, so it needs the same selection in every row",
        code="mask_not_row_equivariant",
        site=ctx.label,
        fix="select feature indices (a 1-D integer array) instead of a per-row mask",
      )
  return torch.where(mask, fire(inner, x, ctx), x)


def subspace(site: str, basis, origin=None, *, feature_axis: int = -1) -> Selection:
  """Selects ``span(basis)`` along the feature axis: ``x = o + B c + r``; verbs act on ``c``."""
  return Selection(site, "subspace", {"basis": basis, "origin": origin}, feature_axis)


def _is_source(edit: Edit) -> bool:
  return edit.name in _SOURCE_VERBS or (
    edit.name in ("mean_ablate", "scramble_elements") and not edit.keeps
  )


def _subspace(x, ctx, data, feature_axis, inner):
  for name in _names(inner):
    if name in ("project_onto", "project_out"):
      raise InvalidArgumentError(
        f"{name} under ref.subspace: a projection of a projection is not a subspace edit",
        code="subspace_edit_unsupported",
        site=ctx.label,
        fix=f"apply ref.{name} to the whole site, or use subspace_zero/subspace_set",
      )
  axis = feature_axis + x.ndim if feature_axis < 0 else feature_axis
  B = _tensor(data["basis"], x)
  if B.ndim != 2 or not 0 <= axis < x.ndim or B.shape[0] != x.shape[axis]:
    _fail_shape(
      f"basis of shape {tuple(B.shape)} does not fit feature axis {axis} of site shape "
      f"{tuple(x.shape)}",
      ctx,
      "subspace",
      fix="a (d, k) basis",
    )
  if B.shape[1] == 0:
    raise InvalidArgumentError(
      "subspace: the basis has no columns",
      code="empty_selection",
      site=ctx.label,
      fix="a basis with at least one column",
    )
  gram = B.T @ B
  s = torch.linalg.svdvals(gram.detach())
  if s.min() <= s.max() * 1e3 * torch.finfo(gram.dtype).eps:
    raise InvalidArgumentError(
      "subspace: the basis columns are linearly dependent",
      code="basis_rank_deficient",
      site=ctx.label,
      fix="pass linearly independent columns (e.g. an orthonormal basis)",
    )
  inv = torch.linalg.inv(gram)
  coords = lambda z: (z @ B) @ inv.T
  d = B.shape[0]
  xm = x.movedim(axis, -1)
  origin = data["origin"]
  if origin is None:
    o = torch.zeros(d, dtype=x.dtype, device=x.device)
  elif isinstance(origin, Population):
    v = origin.values.detach()
    o = v.reshape(-1, v.shape[-1]).mean(0).to(x.dtype)
  else:
    o = _tensor(origin, x)
    if not (o.ndim == 1 and o.shape[0] == d):
      o = o.expand(x.shape).movedim(axis, -1)
  c = coords(xm - o)
  back = lambda v: v.movedim(-1, axis)
  if inner.name == "set_affine_coordinates":
    W, b = (_tensor(inner.data[k], x) for k in ("W", "b"))
    c_new = xm @ W.T + b
  elif _is_source(inner):
    c_new = coords(fire(inner, x, ctx).movedim(axis, -1) - o)
  else:
    c_new = coords(fire(inner, back(c @ B.T), ctx).movedim(axis, -1))
  return x + back((c_new - c) @ B.T)


def set_affine_coordinates(W, b) -> Edit:
  """Under :func:`subspace`, writes coordinates ``c := W x + b``; refused at every other door."""

  def fn(x, ctx):
    raise InvalidArgumentError(
      "set_affine_coordinates writes subspace coordinates; it needs a ref.subspace selection",
      code="affine_source_needs_subspace",
      site=ctx.label,
      fix='ref.when(ref.subspace("0", basis), ref.set_affine_coordinates(W, b))',
    )

  return Edit("set_affine_coordinates", fn, data={"W": W, "b": b})


def _sub_edit(basis, origin, feature_axis, inner) -> Edit:
  return Selection(None, "subspace", {"basis": basis, "origin": origin}, feature_axis).wrap(inner)


def subspace_zero(basis, origin=None, *, feature_axis=-1) -> Edit:
  """Sets the subspace coordinates to zero."""
  return _sub_edit(basis, origin, feature_axis, zero_ablate())


def subspace_scale(basis, factor, origin=None, *, feature_axis=-1) -> Edit:
  """Multiplies the subspace coordinates by ``factor``."""
  return _sub_edit(basis, origin, feature_axis, scale(factor))


def subspace_set(basis, coords, origin=None, *, feature_axis=-1) -> Edit:
  """Sets the subspace coordinates to ``coords`` (shape ``(k,)``)."""
  B = np.asarray(basis.detach() if isinstance(basis, torch.Tensor) else basis)
  return _sub_edit(
    basis,
    origin,
    feature_axis,
    set_affine_coordinates(np.zeros((B.shape[1], B.shape[0]), B.dtype), coords),
  )


def subspace_patch(basis, source, origin=None, *, feature_axis=-1) -> Edit:
  """Writes the donor's subspace component, keeping the complement."""
  return _sub_edit(basis, origin, feature_axis, patch_from(source))


# --------------------------------------------------------------------------
def _units_edit(edit, indices, *, feature_axis: int = -1) -> Edit:
  """``units(site, indices).wrap(edit)`` without a site (what a saved jaxlens spec records)."""
  return Selection(None, "units", {"indices": indices}, feature_axis).wrap(edit)


def _subspace_edit(edit, basis, origin=None, *, feature_axis: int = -1) -> Edit:
  """``subspace(site, basis, origin).wrap(edit)`` without a site (as saved by jaxlens)."""
  return Selection(None, "subspace", {"basis": basis, "origin": origin}, feature_axis).wrap(edit)


# Verb name (as jaxlens records it in an edit) -> the reference factory taking the same
# arguments. torch_bridge.load_spec rebuilds a saved edit through this table alone.
VERBS = {
  "scale": scale,
  "clamp": clamp,
  "add_noise": add_noise,
  "steer": steer,
  "add": add,
  "project_onto": project_onto,
  "project_out": project_out,
  "mean_ablate": mean_ablate,
  "scramble_elements": scramble_elements,
  "permute_batch": permute_batch,
  "set_direction_mean": set_direction_mean,
  "compose": compose,
  "at_positions": at_positions,
  "zero_ablate": zero_ablate,
  "replace_with": replace_with,
  "swap_with": swap_with,
  "patch_from": patch_from,
  "resample_rows_from": resample_rows_from,
  "set_affine_coordinates": set_affine_coordinates,
  "units": _units_edit,
  "subspace": _subspace_edit,
  "das": _trained.das,
  "boundless_das": _trained.boundless_das,
  "low_rank_das": _trained.low_rank_das,
  "loreft": _trained.loreft,
  "direft": _trained.direft,
}
