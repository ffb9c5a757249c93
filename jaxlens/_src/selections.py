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

import contextlib
import dataclasses
import weakref

import jax
import jax.numpy as jnp
import numpy as np

from jaxlens._src import verbs
from jaxlens._src.edit import (
  Edit,
  Population,
  fire,
  place_like,
  register,
  show_arguments,
  split_over_processes,
  verb_named,
)
from jaxlens._src.errors import InvalidArgumentError, ShapeError
from jaxlens._src.sites import Site, as_selector
from jaxlens._src.tracebacks import api_boundary


def _host(a):
  """A numpy copy of a concrete argument (for checks on its values), else None.

  None also for an array split over processes: its values cannot be read here, so the
  checks are skipped as for a tracer (and the edit is the same computation).
  """
  if isinstance(a, jax.core.Tracer):
    return None
  if split_over_processes(a):
    return None
  return np.asarray(a)


@dataclasses.dataclass(frozen=True)
class Selection:
  """A site plus what to select in it; ``jl.when`` and ``do`` accept it as a site."""

  site: Site
  kind: str
  data: dict
  options: tuple

  def wrap(self, edit) -> Edit:
    inner = verbs.as_edit(edit)
    # keep_grad asks about the value the selection writes as a whole (the
    # unselected part keeps the graph), so the check moves to the wrapper.
    keep = inner.keep_grad
    inner = dataclasses.replace(inner, keep_grad=False)
    wrapped = _WRAPPERS[self.kind](inner, **self.data, **dict(self.options))
    return dataclasses.replace(wrapped, keep_grad=keep)

  def __repr__(self) -> str:
    args = show_selection(self.kind, {**self.data, **dict(self.options)})
    return f"jl.{self.kind}({self.site!r}{', ' + args if args else ''})"


def show_selection(kind: str, arguments: dict) -> str:
  """The arguments of a selection (everything but its site and edit), as in its repr."""
  return show_arguments(verb_named(kind), {k: v for k, v in arguments.items() if k != "edit"})


# -- units --------------------------------------------------------------------


@api_boundary
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
  return Selection(
    as_selector(site), "units", {"indices": indices}, (("feature_axis", feature_axis),)
  )


def units_edit(edit, indices, *, feature_axis: int = -1) -> Edit:
  """The edit ``jl.units(site, indices).wrap(edit)`` returns (what a saved spec records)."""
  if isinstance(indices, (list, tuple)):
    indices = np.asarray(indices)
  return Edit(
    "units",
    {"indices": indices, "edit": verbs.as_edit(edit)},
    (("feature_axis", feature_axis),),
    keeps=True,
  )


def _mask(x, indices, feature_axis, ctx):
  host = _host(indices)
  # Concrete indices (the usual case) make the mask in numpy: the same boolean values,
  # without a chain of small eager JAX programs (each traced again under jax.grad) at
  # every fire. Traced indices build it with jnp, and poison the edit when out of range.
  xp = np if host is not None else jnp
  idx = host if host is not None else jnp.asarray(indices)
  bad = None
  fail = lambda msg, code="shape_mismatch": (_ for _ in ()).throw(
    ShapeError(f"units: {msg}", code=code, site=ctx.label, fix="jl.units(site, jnp.array([0, 2]))")
  )
  if idx.dtype == jnp.bool_:
    try:
      mask = xp.broadcast_to(idx, x.shape)
    except ValueError:
      fail(f"a mask of shape {idx.shape} does not broadcast to the site's shape {x.shape}")
  elif jnp.issubdtype(idx.dtype, jnp.integer):
    if idx.ndim == 1:
      axis = feature_axis + x.ndim if feature_axis < 0 else feature_axis
      n = x.shape[axis]
      if host is not None and host.size and (host.max() >= n or host.min() < -n):
        fail(
          f"feature indices {idx.tolist()} out of range for axis {axis} of size {n}",
          "index_out_of_range",
        )
      norm = xp.where(idx < 0, idx + n, idx)
      # A comparison, not a scatter: an index outside [0, n) selects nothing, and a
      # traced one makes the edit's error value (NaN) visible instead.
      line = xp.any(xp.arange(n, dtype=norm.dtype)[:, None] == norm[None, :], axis=1)
      if host is None:
        bad = jnp.any((norm < 0) | (norm >= n))
      shape = [1] * x.ndim
      shape[axis] = n
      mask = xp.broadcast_to(line.reshape(shape), x.shape)
    elif idx.ndim == 2 and idx.shape[1] == x.ndim:
      if host is not None and host.size:
        hi = np.asarray(x.shape)
        if np.any(host >= hi) or np.any(host < -hi):
          fail(f"element indices out of range for the site's shape {x.shape}", "index_out_of_range")
      hi = xp.asarray(x.shape)
      norm = xp.where(idx < 0, idx + hi, idx)
      if host is not None:
        mask = np.zeros(x.shape, bool)  # every index is in range (checked above)
        mask[tuple(norm.T)] = True
      else:
        mask = jnp.zeros(x.shape, bool).at[tuple(norm.T)].set(True, mode="drop")
      if host is None:
        bad = jnp.any((norm < 0) | (norm >= hi))
    else:
      fail(
        f"integer indices of shape {idx.shape}: expected (n,) feature indices or "
        f"(n, {x.ndim}) element indices"
      )
  else:
    fail(
      f"indices of dtype {jnp.asarray(indices).dtype}: expected a boolean mask or integer indices",
      "dtype_mismatch",
    )
  empty = host is not None and (not host.any() if host.dtype == bool else host.size == 0)
  if empty:
    raise InvalidArgumentError(
      "units: the selection is empty",
      code="empty_selection",
      site=ctx.label,
      fix="select at least one element",
    )
  return jnp.asarray(mask), bad


def _units(x, p, s, ctx):
  inner = p["edit"]
  mask, bad = _mask(x, p["indices"], s["feature_axis"], ctx)
  host = _host(p["indices"])
  movers = [e for e in inner.walk() if e.verb.row_axis is not None]
  if movers and host is not None and host.dtype == bool:
    axis = movers[0].options[movers[0].verb.row_axis]
    full = np.broadcast_to(host, x.shape)
    if not np.all(full == np.take(full, [0], axis=axis)):
      raise InvalidArgumentError(
        f"units: {inner!r} moves whole rows, so it needs the same selection in every row",
        code="mask_not_row_equivariant",
        site=ctx.label,
        fix="select feature indices (a 1-D integer array) instead of a per-row mask",
      )
  out = jnp.where(place_like(mask, x), fire(inner, x, ctx), x)
  return out if bad is None else verbs.poison(bad, out)


register("units", _units, units_edit, wraps=True)


# -- subspace -----------------------------------------------------------------


@api_boundary
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
  return Selection(
    as_selector(site),
    "subspace",
    {"basis": basis, "origin": origin},
    (("feature_axis", feature_axis),),
  )


def _origin(origin, x, axis, d, ctx):
  """The origin in the feature-last layout: a (d,) vector or an array of x's moved shape."""
  if origin is None:
    return jnp.zeros((d,), x.dtype)
  if isinstance(origin, Population):
    v = jnp.asarray(origin.values)
    return _cast(jax.lax.stop_gradient(v.reshape(-1, v.shape[-1]).mean(0)), x.dtype)
  o = jnp.asarray(origin).astype(x.dtype)
  if o.ndim == 1 and o.shape[0] == d:
    return o
  try:
    return jnp.moveaxis(jnp.broadcast_to(o, x.shape), axis, -1)
  except ValueError:
    raise ShapeError(
      f"subspace: origin of shape {o.shape} fits neither ({d},) nor the site's shape {x.shape}",
      code="shape_mismatch",
      site=ctx.label,
      fix=f"an origin of shape ({d},)",
    ) from None


def _replicated(a):
  """``a`` replicated over its mesh when it is split (the basis is small, the site is not).

  Contracting a split basis with a site split another way is a sharding conflict that
  an explicit mesh refuses; a replicated basis contracts with any split of the site.
  """
  if isinstance(a, jax.core.Tracer):
    sharding = getattr(jax.typeof(a), "sharding", None)
    mesh = getattr(sharding, "mesh", None)
    if (
      mesh is None
      or not getattr(mesh, "axis_names", ())
      or not any(t == jax.sharding.AxisType.Explicit for t in getattr(mesh, "axis_types", ()))
    ):
      return a
    if all(p is None for p in sharding.spec):
      return a
    return jax.sharding.reshard(a, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))
  sharding = getattr(a, "sharding", None)
  if isinstance(sharding, jax.sharding.NamedSharding) and not sharding.is_fully_replicated:
    return jax.device_put(
      a, jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec())
    )
  return a


def _coords_fn(B, host, ctx):
  """The coordinates map ``z -> (BᵀB)⁻¹ Bᵀ z`` and, for a traced basis, whether it is bad."""
  gram = B.T @ B
  bad = None
  if host is not None:
    if not np.all(np.isfinite(host)):
      raise InvalidArgumentError(
        "subspace: the basis holds NaN or infinite values",
        code="basis_not_finite",
        site=ctx.label,
        fix="pass a finite basis (e.g. jl.orthonormal(raw) of a finite raw)",
      )
    sv = np.linalg.svd(host.astype(np.float64), compute_uv=False)
    if sv.min() <= sv.max() * 1e-10:
      raise InvalidArgumentError(
        "subspace: the basis columns are linearly dependent",
        code="basis_rank_deficient",
        site=ctx.label,
        fix="pass linearly independent columns (e.g. an orthonormal basis)",
      )
  else:
    sv = jnp.linalg.svd(B, compute_uv=False)
    bad = sv.min() <= sv.max() * jnp.finfo(B.dtype).eps * max(B.shape) * 10
  inv_t = jnp.linalg.inv(gram).T
  # Features where the basis has no support never enter the coordinates, even as NaN
  # (0 * NaN would spread a donor's NaN there to the whole subspace). Where a concrete
  # basis supports every feature, the mask would select ``z`` itself: it is left out.
  support = jnp.any(B != 0, axis=1)
  if not isinstance(support, jax.core.Tracer) and bool(np.all(np.asarray(support))):
    return (lambda z: (z @ B) @ inv_t), bad
  return (lambda z: (jnp.where(support, z, 0) @ B) @ inv_t), bad


# Concrete bases met recently: (id(basis), work dtype) -> (weak reference to the basis, its
# parts). A basis is usually one jax.Array used for many fires (each call of a door, each
# decoding step); its checks, Gram inverse and support are computed at its first fire only.
# The weak reference tells a live basis from a new one that reuses a dead one's id.
_BASIS_PARTS: dict = {}
_BASIS_PARTS_SIZE = 32


def _basis_parts(basis, work, ctx):
  """``(B, Bᵀ, coordinates map, bad)``: the basis in the work dtype (replicated over its
  mesh), its transpose, ``_coords_fn``'s map, and for a traced basis whether it is bad."""
  cacheable = (
    isinstance(basis, jax.Array)
    and not isinstance(basis, jax.core.Tracer)
    and not split_over_processes(basis)
  )
  key = (id(basis), jnp.dtype(work))
  hit = _BASIS_PARTS.get(key) if cacheable else None
  if hit is not None and hit[0]() is basis:
    return hit[1]
  # A cached basis's parts are computed eagerly even inside a trace (jit, grad), so the
  # cache never holds a tracer; they are functions of the concrete basis alone.
  with jax.ensure_compile_time_eval() if cacheable else contextlib.nullcontext():
    B = _replicated(jnp.asarray(basis).astype(work))
    coords, bad = _coords_fn(B, _host(basis), ctx)
    parts = (B, B.T, coords, bad)
  if cacheable:
    if len(_BASIS_PARTS) >= _BASIS_PARTS_SIZE:
      _BASIS_PARTS.pop(next(iter(_BASIS_PARTS)))
    _BASIS_PARTS[key] = (weakref.ref(basis), parts)
  return parts


def _cast(v, dtype):
  """``v.astype(dtype)``, or ``v`` itself where that cast would change nothing (the same
  dtype, not weakly typed): each eager cast is a program re-traced under ``jax.grad``."""
  if v.dtype == dtype and not getattr(jax.typeof(v), "weak_type", False):
    return v
  return v.astype(dtype)


def _move(v, source, destination):
  """``jnp.moveaxis``, or ``v`` itself where the axis does not move (the usual last axis)."""
  if source % v.ndim == destination % v.ndim:
    return v
  return jnp.moveaxis(v, source, destination)


def _subspace(x, p, s, ctx):
  inner = p["edit"]
  for e in inner.walk():
    if e.verb.under_subspace == "refused":
      raise InvalidArgumentError(
        f"{e.name} under jl.subspace: a projection of a projection is not a subspace edit",
        code="subspace_edit_unsupported",
        site=ctx.label,
        fix=f"apply jl.{e.name} to the whole site, or use subspace_zero/subspace_set",
      )
  axis = s["feature_axis"]
  axis = axis + x.ndim if axis < 0 else axis
  B = jnp.asarray(p["basis"])
  if B.ndim != 2 or not 0 <= axis < x.ndim or B.shape[0] != x.shape[axis]:
    raise ShapeError(
      f"subspace: basis of shape {B.shape} does not fit feature axis {axis} of size "
      f"{x.shape[axis] if 0 <= axis < x.ndim else '?'} (site shape {x.shape})",
      code="shape_mismatch",
      site=ctx.label,
      fix=f"a ({x.shape[axis] if 0 <= axis < x.ndim else 'd'}, k) basis",
    )
  if B.shape[1] == 0:
    raise InvalidArgumentError(
      "subspace: the basis has no columns",
      code="empty_selection",
      site=ctx.label,
      fix="a basis with at least one column",
    )
  if not jnp.issubdtype(x.dtype, jnp.inexact):
    raise InvalidArgumentError(
      f"subspace: the site value has dtype {x.dtype}; a subspace needs a float site",
      code="site_not_float",
      site=ctx.label,
      fix="select a float site",
    )
  # The coordinate solve runs in at least float32 (half precision has no inverse);
  # the result is cast back, exactly, where the basis has no support.
  # (Spelled without jnp.promote_types, which strict dtype promotion refuses across widths.)
  work = x.dtype if jnp.dtype(x.dtype).itemsize >= 4 else jnp.dtype(jnp.float32)
  B, B_t, coords, bad = _basis_parts(p["basis"], work, ctx)
  d = B.shape[0]
  xw = _cast(x, work)
  xm = _move(xw, axis, -1)
  o = _origin(p["origin"], xw, axis, d, ctx)
  c = coords(xm - o)
  back = lambda v: _move(v, -1, axis)
  mode = inner.verb.under_subspace
  if mode == "affine":
    W = jnp.asarray(inner.params["W"]).astype(work)
    b = jnp.asarray(inner.params["b"]).astype(work)
    if W.shape != (B.shape[1], d) or b.shape[-1:] != (B.shape[1],):
      raise ShapeError(
        f"set_affine_coordinates: W {W.shape} / b {b.shape} do not map the "
        f"site's {d} features to the basis's {B.shape[1]} coordinates",
        code="shape_mismatch",
        site=ctx.label,
        fix=f"W of shape ({B.shape[1]}, {d}) and b of shape ({B.shape[1]},)",
      )
    c_new = xm @ W.T + b
  elif inner.verb.writes_source(inner):
    y = _move(_cast(fire(inner, x, ctx), work), axis, -1)
    c_new = coords(y - o)
  else:
    comp = _cast(back(c @ B_t), x.dtype)
    y = _move(_cast(fire(inner, comp, ctx), work), axis, -1)
    # The change is measured against the coordinates of the component the verb saw
    # (rounded to the site dtype), so a verb that leaves it alone changes nothing, bit
    # for bit, also in half precision.
    c = coords(_move(_cast(comp, work), axis, -1))
    c_new = coords(y)
  out = _cast(xw + back((c_new - c) @ B_t), x.dtype)
  return out if bad is None else verbs.poison(bad, out)


def subspace_edit(edit, basis, origin=None, *, feature_axis: int = -1) -> Edit:
  """The edit ``jl.subspace(site, basis, origin).wrap(edit)`` returns (what a spec records)."""
  return Edit(
    "subspace",
    {"basis": basis, "origin": origin, "edit": verbs.as_edit(edit)},
    (("feature_axis", feature_axis),),
    keeps=True,
  )


register("subspace", _subspace, subspace_edit, wraps=True)
_WRAPPERS = {"units": units_edit, "subspace": subspace_edit}


# -- verbs that only make sense under a subspace --------------------------------


def _set_affine(x, p, s, ctx):
  raise InvalidArgumentError(
    "set_affine_coordinates writes subspace coordinates; it needs a jl.subspace selection",
    code="affine_source_needs_subspace",
    site=ctx.label,
    fix="jl.when(jl.subspace(site, basis), jl.intervention.set_affine_coordinates(W, b))",
  )


@api_boundary
def set_affine_coordinates(W, b) -> Edit:
  """Under ``jl.subspace``, writes coordinates ``c := W x + b`` (keeps the gradient).

  ``W`` is ``(k, d)`` and ``b`` is ``(k,)``; ``x`` is the site value. With an
  orthonormal basis ``R`` and origin zero this is the LoReFT intervention
  ``x + Rᵀ... `` written ``x + B (W x + b - Bᵀx)``. Every other door refuses it
  with ``affine_source_needs_subspace``.
  """
  return Edit("set_affine_coordinates", {"W": W, "b": b}, (), keeps=True)


register("set_affine_coordinates", _set_affine, set_affine_coordinates, under_subspace="affine")


@api_boundary
def subspace_zero(basis, origin=None, *, feature_axis=-1) -> Edit:
  """Sets the subspace coordinates to zero (the value's component becomes the origin's)."""
  return subspace_edit(verbs.zero_ablate(), basis, origin, feature_axis=feature_axis)


@api_boundary
def subspace_scale(basis, factor, origin=None, *, feature_axis=-1) -> Edit:
  """Multiplies the subspace coordinates by ``factor``."""
  return subspace_edit(verbs.scale(factor), basis, origin, feature_axis=feature_axis)


@api_boundary
def subspace_set(basis, coords, origin=None, *, feature_axis=-1) -> Edit:
  """Sets the subspace coordinates to ``coords`` (shape ``(k,)``, broadcast over rows)."""
  B = jnp.asarray(basis)
  W = jnp.zeros((B.shape[1], B.shape[0]), B.dtype)
  return subspace_edit(set_affine_coordinates(W, coords), basis, origin, feature_axis=feature_axis)


@api_boundary
def subspace_patch(basis, source, origin=None, *, feature_axis=-1) -> Edit:
  """Writes the donor's subspace component (its coordinates), keeping the complement."""
  return subspace_edit(verbs.patch_from(source), basis, origin, feature_axis=feature_axis)


@api_boundary
def orthonormal(raw) -> jax.Array:
  """An orthonormal ``(d, k)`` basis from an unconstrained ``(d, k)`` parameter.

  Uses the QR decomposition with the signs fixed so the map is smooth; train
  ``raw`` with optax and the basis stays orthonormal at every step.
  """
  q, r = jnp.linalg.qr(raw)
  return q * jnp.sign(jnp.diagonal(r))[None, :]
