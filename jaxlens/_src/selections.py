"""Selection doors: edit some elements (``jl.units``) or a subspace (``jl.subspace``).

A selection wraps an edit so that it writes only what is selected; the rest of
the site value passes through untouched and keeps its gradient. Because the
selection becomes part of the edit (its indices and bases are pytree leaves), it
works on every door: ``jl.when(jl.units(site, idx), edit)``, replay, rerun,
set_only + run, saved specs and differentiable replay, and ``jax.vmap`` can sweep
over indices and bases.

Subspace semantics (projection, not a set of coordinates). With basis ``B``
(``d x k``, columns spanning the subspace along the feature axis) and origin
``o``, the site value is ``x = o + B c + r``, where ``c`` are the coordinates
(``c = (BᵀB)⁻¹ Bᵀ (x - o)``, which is ``Bᵀ(x - o)`` for an orthonormal basis) and
``r`` lies in the orthogonal complement of ``span(B)``. A basis that is not
orthonormal still gets the orthogonal projection onto its span, with coordinates
in that basis; a rank-deficient one is refused (``basis_rank_deficient``).

* Verbs that compute from the site value act on the subspace component ``B c``,
  expressed in the site's own space (so their arguments keep the site's shape):
  ``c' = coords(E(B c))``.
* Verbs that write a value from elsewhere (``patch_from``, ``replace_with``,
  ``swap_with``, ``resample_rows_from``, ``mean_ablate(source=)``,
  ``scramble_elements(source=)``) write that value's component:
  ``c' = coords(E(x) - o)``.
* ``set_affine_coordinates(W, b)`` writes ``c' = W x + b``.
* ``project_onto`` / ``project_out`` are refused (``subspace_edit_unsupported``).

The result is ``x + B (c' - c)``: ``r`` is never recomputed, so the value is
bit-for-bit ``x`` wherever ``B`` has no support, and when the coordinates are
unchanged.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxlens._src import verbs
from jaxlens._src.errors import InvalidArgumentError, ShapeError
from jaxlens._src.sites import Site, as_selector
from jaxlens._src.verbs import Edit, Population, as_edit, fire

_SOURCE_VERBS = ("replace_with", "swap_with", "patch_from", "resample_rows_from")
_ROW_COHERENT = ("permute_batch",)


def _is_source(edit: Edit) -> bool:
  if edit.name in _SOURCE_VERBS:
    return True
  if edit.name in ("mean_ablate", "scramble_elements"):
    return edit.params.get("source") is not None
  return False


def _names(edit: Edit):
  yield edit.name
  if edit.name == "compose":
    for e in edit.params["edits"]:
      yield from _names(e)
  if edit.name in ("at_positions", "units", "subspace"):
    yield from _names(edit.params["edit"])


def _concrete(a) -> bool:
  return not isinstance(a, jax.core.Tracer)


def _host(a):
  """A numpy copy of a concrete argument (for checks on its values), else None."""
  return None if isinstance(a, jax.core.Tracer) else np.asarray(a)


@dataclasses.dataclass(frozen=True)
class Selection:
  """A site plus what to select in it; ``jl.when`` and ``do`` accept it as a site."""

  site: Site
  kind: str
  data: dict
  options: tuple

  def wrap(self, edit) -> Edit:
    inner = as_edit(edit)
    # keep_grad asks about the value the selection writes as a whole (the
    # unselected part keeps the graph), so the check moves to the wrapper.
    keep = inner.keep_grad
    inner = dataclasses.replace(inner, keep_grad=False)
    if self.kind == "units":
      return Edit("units", _units, {**self.data, "edit": inner}, self.options, keeps=True,
                  keep_grad=keep)
    return Edit("subspace", _subspace, {**self.data, "edit": inner}, self.options,
                keeps=True, keep_grad=keep)

  def __repr__(self) -> str:
    return f"jl.{self.kind}({self.site!r}, ...)"


# -- units --------------------------------------------------------------------


def units(site, indices, *, feature_axis: int = -1) -> Selection:
  """Selects elements of a site; an edit then writes only those.

  Args:
    site: a selector or label.
    indices: a boolean mask broadcastable to the site's shape (masks may differ
      between rows); a 1-D integer array of feature indices along
      ``feature_axis`` (the same in every row); or an ``(n, ndim)`` integer array
      (or list of tuples) of element indices.
    feature_axis: the axis 1-D feature indices refer to.

  Example:
    >>> import jax.numpy as jnp, jaxlens as jl
    >>> jl.units("layers_0", jnp.array([0, 2]))
    jl.units(jl.label('layers_0'), ...)
  """
  if isinstance(indices, (list, tuple)):
    indices = np.asarray(indices)
  return Selection(as_selector(site), "units", {"indices": indices},
                   (("feature_axis", feature_axis),))


def _mask(x, indices, feature_axis, ctx):
  host = _host(indices)
  idx = jnp.asarray(indices)
  fail = lambda msg, code="shape_mismatch": (_ for _ in ()).throw(ShapeError(
      f"units: {msg}", code=code, site=ctx.label, fix="jl.units(site, jnp.array([0, 2]))"))
  if idx.dtype == jnp.bool_:
    try:
      mask = jnp.broadcast_to(idx, x.shape)
    except ValueError:
      fail(f"a mask of shape {idx.shape} does not broadcast to the site's shape {x.shape}")
  elif jnp.issubdtype(idx.dtype, jnp.integer):
    if idx.ndim == 1:
      axis = feature_axis + x.ndim if feature_axis < 0 else feature_axis
      n = x.shape[axis]
      if host is not None and host.size and (host.max() >= n or host.min() < -n):
        fail(f"feature indices {idx.tolist()} out of range for axis {axis} of size {n}",
             "index_out_of_range")
      line = jnp.zeros((n,), bool).at[idx].set(True)
      shape = [1] * x.ndim
      shape[axis] = n
      mask = jnp.broadcast_to(line.reshape(shape), x.shape)
    elif idx.ndim == 2 and idx.shape[1] == x.ndim:
      if host is not None and host.size:
        hi = np.asarray(x.shape)
        if np.any(host >= hi) or np.any(host < -hi):
          fail(f"element indices out of range for the site's shape {x.shape}",
               "index_out_of_range")
      mask = jnp.zeros(x.shape, bool).at[tuple(idx.T)].set(True)
    else:
      fail(f"integer indices of shape {idx.shape}: expected (n,) feature indices or "
           f"(n, {x.ndim}) element indices")
  else:
    fail(f"indices of dtype {idx.dtype}: expected a boolean mask or integer indices",
         "dtype_mismatch")
  empty = host is not None and (not host.any() if host.dtype == bool else host.size == 0)
  if empty:
    raise InvalidArgumentError("units: the selection is empty", code="empty_selection",
                               site=ctx.label, fix="select at least one element")
  return mask


def _units(x, p, s, ctx):
  inner = p["edit"]
  mask = _mask(x, p["indices"], s["feature_axis"], ctx)
  host = _host(p["indices"])
  if any(n in _ROW_COHERENT for n in _names(inner)) and host is not None and \
      host.dtype == bool:
    axis = inner.options.get("axis", 0) if inner.name == "permute_batch" else 0
    full = np.broadcast_to(host, x.shape)
    if not np.all(full == np.take(full, [0], axis=axis)):
      raise InvalidArgumentError(
          f"units: {inner!r} moves whole rows, so it needs the same selection in every row",
          code="mask_not_row_equivariant", site=ctx.label,
          fix="select feature indices (a 1-D integer array) instead of a per-row mask")
  return jnp.where(verbs.place_like(mask, x), fire(inner, x, ctx), x)


# -- subspace -----------------------------------------------------------------


def subspace(site, basis, origin=None, *, feature_axis: int = -1) -> Selection:
  """Selects a linear subspace of a site's feature axis (projection semantics).

  Args:
    site: a selector or label.
    basis: a ``(d, k)`` array whose columns span the subspace (``d`` the feature
      size); orthonormal columns give ``c = Bᵀ(x - o)``.
    origin: ``None`` (zero), an array broadcastable to the site, or a
      :class:`Population` (its mean over every axis but the last).
    feature_axis: the site axis the basis acts on.

  See the module docstring for what each verb does under a subspace.
  """
  return Selection(as_selector(site), "subspace", {"basis": basis, "origin": origin},
                   (("feature_axis", feature_axis),))


def _origin(origin, x, axis, d, ctx):
  """The origin in the feature-last layout: a (d,) vector or an array of x's moved shape."""
  if origin is None:
    return jnp.zeros((d,), x.dtype)
  if isinstance(origin, Population):
    v = jnp.asarray(origin.values)
    return jax.lax.stop_gradient(v.reshape(-1, v.shape[-1]).mean(0)).astype(x.dtype)
  o = jnp.asarray(origin).astype(x.dtype)
  if o.ndim == 1 and o.shape[0] == d:
    return o
  try:
    return jnp.moveaxis(jnp.broadcast_to(o, x.shape), axis, -1)
  except ValueError:
    raise ShapeError(f"subspace: origin of shape {o.shape} fits neither ({d},) nor the site's "
                     f"shape {x.shape}", code="shape_mismatch", site=ctx.label,
                     fix=f"an origin of shape ({d},)") from None


def _replicated(a):
  """``a`` replicated over its mesh when it is split (the basis is small, the site is not).

  Contracting a split basis with a site split another way is a sharding conflict that
  an explicit mesh refuses; a replicated basis contracts with any split of the site.
  """
  if isinstance(a, jax.core.Tracer):
    sharding = getattr(jax.typeof(a), "sharding", None)
    mesh = getattr(sharding, "mesh", None)
    if mesh is None or not getattr(mesh, "axis_names", ()) or not any(
        t == jax.sharding.AxisType.Explicit for t in getattr(mesh, "axis_types", ())):
      return a
    if all(p is None for p in sharding.spec):
      return a
    return jax.sharding.reshard(a, jax.sharding.NamedSharding(mesh,
                                                              jax.sharding.PartitionSpec()))
  sharding = getattr(a, "sharding", None)
  if isinstance(sharding, jax.sharding.NamedSharding) and not sharding.is_fully_replicated:
    return jax.device_put(a, jax.sharding.NamedSharding(sharding.mesh,
                                                        jax.sharding.PartitionSpec()))
  return a


def _coords_fn(B, host, ctx):
  gram = B.T @ B
  if host is not None:
    s = np.linalg.svd(host.astype(np.float64), compute_uv=False)
    if s.min() <= s.max() * 1e-10:
      raise InvalidArgumentError(
          "subspace: the basis columns are linearly dependent", code="basis_rank_deficient",
          site=ctx.label, fix="pass linearly independent columns (e.g. an orthonormal basis)")
  inv = jnp.linalg.inv(gram)
  return lambda z: (z @ B) @ inv.T


def _subspace(x, p, s, ctx):
  inner = p["edit"]
  for name in _names(inner):
    if name in ("project_onto", "project_out"):
      raise InvalidArgumentError(
          f"{name} under jl.subspace: a projection of a projection is not a subspace edit",
          code="subspace_edit_unsupported", site=ctx.label,
          fix=f"apply jl.{name} to the whole site, or use subspace_zero/subspace_set")
  axis = s["feature_axis"]
  axis = axis + x.ndim if axis < 0 else axis
  B = jnp.asarray(p["basis"])
  if B.ndim != 2 or not 0 <= axis < x.ndim or B.shape[0] != x.shape[axis]:
    raise ShapeError(
        f"subspace: basis of shape {B.shape} does not fit feature axis {axis} of size "
        f"{x.shape[axis] if 0 <= axis < x.ndim else '?'} (site shape {x.shape})",
        code="shape_mismatch", site=ctx.label, fix=f"a ({x.shape[axis]}, k) basis")
  if B.shape[1] == 0:
    raise InvalidArgumentError("subspace: the basis has no columns", code="empty_selection",
                               site=ctx.label, fix="a basis with at least one column")
  B = _replicated(B.astype(x.dtype))
  d = B.shape[0]
  coords = _coords_fn(B, _host(p["basis"]), ctx)
  xm = jnp.moveaxis(x, axis, -1)
  o = _origin(p["origin"], x, axis, d, ctx)
  c = coords(xm - o)
  back = lambda v: jnp.moveaxis(v, -1, axis)
  if inner.name == "set_affine_coordinates":
    W = jnp.asarray(inner.params["W"]).astype(x.dtype)
    b = jnp.asarray(inner.params["b"]).astype(x.dtype)
    if W.shape != (B.shape[1], d) or b.shape[-1:] != (B.shape[1],):
      raise ShapeError(f"set_affine_coordinates: W {W.shape} / b {b.shape} do not map the "
                       f"site's {d} features to the basis's {B.shape[1]} coordinates",
                       code="shape_mismatch", site=ctx.label,
                       fix=f"W of shape ({B.shape[1]}, {d}) and b of shape ({B.shape[1]},)")
    c_new = xm @ W.T + b
  elif _is_source(inner):
    y = jnp.moveaxis(fire(inner, x, ctx), axis, -1)
    c_new = coords(y - o)
  else:
    comp = back(c @ B.T)
    y = jnp.moveaxis(fire(inner, comp, ctx), axis, -1)
    c_new = coords(y)
  return x + back((c_new - c) @ B.T)


# -- verbs that only make sense under a subspace --------------------------------


def _set_affine(x, p, s, ctx):
  raise InvalidArgumentError(
      "set_affine_coordinates writes subspace coordinates; it needs a jl.subspace selection",
      code="affine_source_needs_subspace", site=ctx.label,
      fix="jl.when(jl.subspace(site, basis), jl.intervention.set_affine_coordinates(W, b))")


def set_affine_coordinates(W, b) -> Edit:
  """Under ``jl.subspace``, writes coordinates ``c := W x + b`` (keeps the gradient).

  ``W`` is ``(k, d)`` and ``b`` is ``(k,)``; ``x`` is the site value. With an
  orthonormal basis ``R`` and origin zero this is the LoReFT intervention
  ``x + Rᵀ... `` written ``x + B (W x + b - Bᵀx)``. Every other door refuses it
  with ``affine_source_needs_subspace``.
  """
  return Edit("set_affine_coordinates", _set_affine, {"W": W, "b": b}, (), keeps=True)


def _sub_edit(name, basis, origin, feature_axis, inner):
  sel = Selection(None, "subspace", {"basis": basis, "origin": origin},
                  (("feature_axis", feature_axis),))
  edit = sel.wrap(inner)
  return dataclasses.replace(edit, name="subspace", static=edit.static)


def subspace_zero(basis, origin=None, *, feature_axis=-1) -> Edit:
  """Sets the subspace coordinates to zero (the value's component becomes the origin's)."""
  return _sub_edit("subspace_zero", basis, origin, feature_axis, verbs.zero_ablate())


def subspace_scale(basis, factor, origin=None, *, feature_axis=-1) -> Edit:
  """Multiplies the subspace coordinates by ``factor``."""
  return _sub_edit("subspace_scale", basis, origin, feature_axis, verbs.scale(factor))


def subspace_set(basis, coords, origin=None, *, feature_axis=-1) -> Edit:
  """Sets the subspace coordinates to ``coords`` (shape ``(k,)``, broadcast over rows)."""
  B = jnp.asarray(basis)
  W = jnp.zeros((B.shape[1], B.shape[0]), B.dtype)
  return _sub_edit("subspace_set", basis, origin, feature_axis,
                   set_affine_coordinates(W, coords))


def subspace_patch(basis, source, origin=None, *, feature_axis=-1) -> Edit:
  """Writes the donor's subspace component (its coordinates), keeping the complement."""
  return _sub_edit("subspace_patch", basis, origin, feature_axis, verbs.patch_from(source))


def orthonormal(raw) -> jax.Array:
  """An orthonormal ``(d, k)`` basis from an unconstrained ``(d, k)`` parameter.

  Uses the QR decomposition with the signs fixed so the map is smooth; train
  ``raw`` with optax and the basis stays orthonormal at every step.
  """
  q, r = jnp.linalg.qr(raw)
  return q * jnp.sign(jnp.diagonal(r))[None, :]
