"""Trained interventions as verbs: DAS, Boundless DAS, low-rank DAS, LoReFT, DiReFT.

Each verb takes its trained parameters as one pytree (``params``, a dict of arrays), so
an edit built from them is an ordinary :class:`~jaxlens._src.edit.Edit`: its arrays are
leaves (a new value does not recompile, ``jax.grad`` reaches them through every door),
and a spec holding it saves and loads as data. ``jaxlens.train`` initialises the
parameters and trains them; this module only computes.

The orthogonal matrices are parametrised as ``torch.nn.utils.parametrizations.orthogonal``
does with its defaults, which is what pyvene and pyreft use (see :func:`orthogonal`), so
parameters move between the two libraries unchanged and gradients agree.

The feature axis is the last axis of the site value (as in pyvene).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxlens._src.edit import Edit, _sg, donor_value, fail_shape, register, source_values
from jaxlens._src.errors import InvalidArgumentError
from jaxlens._src.expm import expm
from jaxlens._src.tracebacks import api_boundary

# --------------------------------------------------------------------------
# The orthogonal parametrisation.


def _householder(raw):
  """torch's Householder map of a tall ``(n, k)`` matrix: ``H_1 ... H_k I[:, :k]``.

  The reflector ``v_i`` is column ``i`` of ``tril(raw, -1)`` with a 1 on the diagonal and
  ``tau_i = 2 / |v_i|²``, so each ``H_i = I - tau_i v_i v_iᵀ`` is an exact reflection. The
  diagonal of ``raw`` only gives the columns' signs and gets no gradient. torch reads it
  through ``.int()``, which truncates: equal to ``sign`` on the ``±1`` it is initialised
  to, but a diagonal moved off ``±1`` (by weight decay, say) truncates to 0 and zeroes a
  column; ``sign`` keeps the matrix orthogonal whatever the diagonal holds.
  """
  n, k = raw.shape
  a = jnp.tril(raw, -1)
  tau = 2.0 / (1.0 + jnp.sum(a * a, axis=0))
  eye = jnp.eye(n, k, dtype=raw.dtype)
  v = a + eye

  def apply(q, vt):
    vi, ti = vt
    return q - ti * jnp.outer(vi, vi @ q), None

  q, _ = jax.lax.scan(apply, eye, (v.T, tau), reverse=True)
  return q * _sg(jnp.sign(jnp.diagonal(raw)))[None, :]


def orthogonal(rotation) -> jax.Array:
  """The orthogonal ``(n, k)`` matrix of a rotation parameter ``{"raw", "base"}``.

  ``raw`` is the unconstrained ``(n, k)`` parameter (``k <= n``) and ``base`` a fixed
  ``(n, n)`` orthogonal matrix (no gradient reaches it). As torch's
  ``parametrizations.orthogonal`` with its defaults (``use_trivialization=True``):

  * square (``k == n``): ``base @ expm(A)`` with ``A = tril(raw) - tril(raw)ᵀ``, which is
    skew-symmetric, so ``expm(A)`` is orthogonal for every ``raw`` and ``raw = 0`` gives
    ``base`` (the "dynamic trivialization": the optimiser moves in a flat space around
    the point ``base``);
  * tall (``k < n``): ``base @ householder(raw)``, a product of ``k`` reflections.

  The columns are orthonormal to rounding at every step of any optimiser, no
  re-orthonormalisation or projection step is needed, and the map is smooth in ``raw``.
  """
  raw = rotation["raw"]
  base = _sg(jnp.asarray(rotation["base"]))
  n, k = raw.shape
  if k == n:
    t = jnp.tril(raw)
    q = expm(t - t.T)  # JAX's Padé expm's values, at a third of its cost
  else:
    q = _householder(raw)
  return base.astype(q.dtype) @ q


def _check_rotation(rotation, x, ctx, verb, k=None):
  raw = rotation.get("raw") if isinstance(rotation, dict) else None
  base = rotation.get("base") if isinstance(rotation, dict) else None
  if raw is None or base is None:
    raise InvalidArgumentError(
      f"{verb}: the rotation must be a dict {{'raw', 'base'}}",
      code="invalid_argument",
      site=ctx.label,
      verb=verb,
      fix="params from jaxlens.train (e.g. jaxlens.train.DAS(dim=2).init(key, d))",
    )
  d = x.shape[-1]
  n, kk = jnp.shape(raw)
  if k is not None and n == d and kk != k and jnp.shape(base) == (d, d):
    fail_shape(
      f"a rotation of {kk} columns in {d} features: {verb} rotates the whole space, and a "
      f"({d}, {kk}) one would project the other {d - kk} coordinates out of the site",
      ctx,
      verb,
      fix=f"a full ({d}, {d}) rotation (jaxlens.train.DAS(dim).init(key, {d})), or "
      "low_rank_das for a low-rank one",
    )
  if n != d or jnp.shape(base) != (d, d) or kk > n or (k is not None and kk != k):
    fail_shape(
      f"rotation raw {jnp.shape(raw)} / base {jnp.shape(base)} does not fit the site's "
      f"{d} features (site shape {x.shape})",
      ctx,
      verb,
      fix=f"initialise the parameters for d={d}",
    )


def _work(x, params):
  """The computing dtype: the parameters' (as pyvene casts the site value to its weight)."""
  leaves = [leaf for leaf in jax.tree.leaves(params) if jnp.issubdtype(leaf.dtype, jnp.inexact)]
  return leaves[0].dtype if leaves else x.dtype


def _float_site(x, ctx, verb):
  if not jnp.issubdtype(x.dtype, jnp.inexact):
    fail_shape(
      f"a trained intervention needs a float site, got dtype {x.dtype}",
      ctx,
      verb,
      code="site_not_float",
      fix="select a float site (a residual stream, an MLP output)",
    )


def _source(p, x, ctx, verb):
  src = _sg(source_values(p["source"], ctx, verb))
  return donor_value(src.astype(x.dtype), x, ctx, verb, "source")


# --------------------------------------------------------------------------
# DAS: interchange in the first `dim` coordinates of a learned rotation.


def _das(x, p, s, ctx):
  _float_site(x, ctx, "das")
  rot = p["params"]["rotation"]
  _check_rotation(rot, x, ctx, "das", k=x.shape[-1])
  work = _work(x, p["params"])
  r = orthogonal(rot).astype(work)
  dim = s["dim"]
  if not 0 < dim <= r.shape[1]:
    fail_shape(f"dim={dim} is outside [1, {r.shape[1]}]", ctx, "das", code="invalid_argument")
  rb = x.astype(work) @ r
  rs = _source(p, x, ctx, "das").astype(work) @ r
  mixed = jnp.concatenate([rs[..., :dim], rb[..., dim:]], axis=-1)
  return (mixed @ r.T).astype(x.dtype)


@api_boundary
def das(params, source, *, dim: int) -> Edit:
  """Distributed alignment search: interchange in a learned rotated subspace.

  With ``R`` the ``(d, d)`` orthogonal matrix of ``params["rotation"]``, writes
  ``(concat(sR[:, :dim], xR[:, dim:])) Rᵀ``: the first ``dim`` rotated coordinates come
  from the source (the same site in another run), the rest stay the site's. pyvene's
  ``RotatedSpaceIntervention`` with ``interchange_dim=dim``. The source is detached; the
  gradient reaches the rotation and, through the kept coordinates, the site value.

  Args:
    params: ``{"rotation": {"raw", "base"}}`` (``jaxlens.train.DAS(dim).init``).
    source: a donor Trace of the source run, or an array of the site's shape.
    dim: the number of interchanged coordinates.
  """
  return Edit("das", {"params": params, "source": source}, (("dim", dim),), keeps=True)


register("das", _das, das, under_subspace="refused")


# --------------------------------------------------------------------------
# Boundless DAS: a learned soft boundary instead of a fixed `dim`.


def boundary_mask(boundary, temperature, d, dtype):
  """pyvene's sigmoid boundary mask over the ``d`` rotated coordinates.

  ``mask_i = σ(i / T) σ((b d - i) / T)`` with ``b = clip(boundary, 1e-3, 1)``: close to
  1 for coordinates below ``b d`` and 0 above, sharper as the temperature ``T`` falls.
  """
  b = jnp.clip(jnp.asarray(boundary, dtype).reshape(-1)[0], 1e-3, 1.0) * d
  t = _sg(jnp.asarray(temperature, dtype))
  i = jnp.arange(d, dtype=dtype)
  return jax.nn.sigmoid(i / t) * jax.nn.sigmoid((b - i) / t)


def _boundless(x, p, s, ctx):
  _float_site(x, ctx, "boundless_das")
  rot = p["params"]["rotation"]
  _check_rotation(rot, x, ctx, "boundless_das", k=x.shape[-1])
  work = _work(x, p["params"])
  r = orthogonal(rot).astype(work)
  mask = boundary_mask(p["params"]["boundary"], p["temperature"], r.shape[0], work)
  rb = x.astype(work) @ r
  rs = _source(p, x, ctx, "boundless_das").astype(work) @ r
  return (((1.0 - mask) * rb + mask * rs) @ r.T).astype(x.dtype)


def _check_temperature(temperature, verb):
  """A concrete temperature must be a finite number > 0 (at 0 the mask's sigmoid is NaN, and
  a negative one inverts the mask); a traced one (a schedule's) is the caller's to keep > 0."""
  if isinstance(temperature, jax.core.Tracer):
    return
  try:
    t = np.asarray(temperature, dtype=float)
  except (TypeError, ValueError):
    t = None
  if t is None or t.size != 1 or not np.isfinite(t).all() or not (t > 0).all():
    raise InvalidArgumentError(
      f"{verb}: temperature must be a finite number > 0, got {temperature!r}",
      code="invalid_argument",
      verb=verb,
      expected="temperature > 0",
      received=repr(temperature),
      fix=f"jl.{verb}(params, source, temperature=0.1)",
    )


@api_boundary
def boundless_das(params, source, temperature) -> Edit:
  """Boundless DAS: interchange the rotated coordinates under a learned soft boundary.

  Writes ``((1 - m) xR + m sR) Rᵀ`` with ``m = boundary_mask(params["boundary"],
  temperature)``: pyvene's ``BoundlessRotatedSpaceIntervention``. The temperature is
  an argument, not a parameter: it follows a schedule (a leaf, so changing it does
  not recompile) and no gradient reaches it.

  Args:
    params: ``{"rotation": {"raw", "base"}, "boundary": (1,)}``
      (``jaxlens.train.BoundlessDAS().init``).
    source: a donor Trace of the source run, or an array of the site's shape.
    temperature: the boundary's temperature (a scalar).
  """
  _check_temperature(temperature, "boundless_das")
  return Edit(
    "boundless_das",
    {"params": params, "source": source, "temperature": temperature},
    (),
    keeps=True,
  )


register("boundless_das", _boundless, boundless_das, under_subspace="refused")


# --------------------------------------------------------------------------
# Low-rank DAS: interchange in the span of k learned orthonormal columns.


def _low_rank_das(x, p, s, ctx):
  _float_site(x, ctx, "low_rank_das")
  rot = p["params"]["rotation"]
  _check_rotation(rot, x, ctx, "low_rank_das")
  work = _work(x, p["params"])
  r = orthogonal(rot).astype(work)
  xw = x.astype(work)
  diff = _source(p, x, ctx, "low_rank_das").astype(work) @ r - xw @ r
  return (xw + diff @ r.T).astype(x.dtype)


@api_boundary
def low_rank_das(params, source) -> Edit:
  """Low-rank DAS: ``x + (sR - xR) Rᵀ`` with ``R`` a learned ``(d, k)`` orthonormal matrix.

  pyvene's ``LowRankRotatedSpaceIntervention``: the source's component in ``span(R)``
  replaces the site's; the orthogonal complement is kept, with its gradient.

  Args:
    params: ``{"rotation": {"raw" (d, k), "base" (d, d)}}``
      (``jaxlens.train.LowRankDAS(rank).init``).
    source: a donor Trace of the source run, or an array of the site's shape.
  """
  return Edit("low_rank_das", {"params": params, "source": source}, (), keeps=True)


register("low_rank_das", _low_rank_das, low_rank_das, under_subspace="refused")


# --------------------------------------------------------------------------
# Representation fine-tuning.


def _affine(p, x, ctx, verb, k):
  w = jnp.asarray(p["W"])
  b = jnp.asarray(p["b"])
  if w.shape != (k, x.shape[-1]) or b.shape != (k,):
    fail_shape(
      f"W {w.shape} / b {b.shape} do not map the site's {x.shape[-1]} features to {k} coordinates",
      ctx,
      verb,
      fix=f"W of shape ({k}, {x.shape[-1]}) and b of shape ({k},)",
    )
  return w, b


def _loreft(x, p, s, ctx):
  _float_site(x, ctx, "loreft")
  params = p["params"]
  rot = params["rotation"]
  _check_rotation(rot, x, ctx, "loreft")
  work = _work(x, params)
  r = orthogonal(rot).astype(work)
  w, b = _affine(params, x, ctx, "loreft", r.shape[1])
  xw = x.astype(work)
  return (xw + (xw @ w.astype(work).T + b.astype(work) - xw @ r) @ r.T).astype(x.dtype)


@api_boundary
def loreft(params) -> Edit:
  """LoReFT: ``h + Rᵀ(W h + b - R h)``, with ``R`` of orthonormal rows.

  Here ``R`` is stored as its ``(d, k)`` transpose (pyreft's ``rotate_layer.weight``), so
  the value written is ``x + (x Wᵀ + b - x R) Rᵀ``: the site's coordinates in the
  ``k``-dimensional subspace are replaced by a learned affine function of the site.
  Keeps the gradient.

  Args:
    params: ``{"rotation": {"raw" (d, k), "base" (d, d)}, "W": (k, d), "b": (k,)}``
      (``jaxlens.train.LoReFT(rank).init``).
  """
  return Edit("loreft", {"params": params}, (), keeps=True)


register("loreft", _loreft, loreft, under_subspace="refused")


def _direft(x, p, s, ctx):
  _float_site(x, ctx, "direft")
  params = p["params"]
  w2 = jnp.asarray(params["W2"])
  k = w2.shape[0]
  w1, b = _affine({"W": params["W1"], "b": params["b"]}, x, ctx, "direft", k)
  if w2.shape != (k, x.shape[-1]):
    fail_shape(
      f"W2 {w2.shape} does not map {k} coordinates back to the site's {x.shape[-1]} features",
      ctx,
      "direft",
      fix=f"W2 of shape ({k}, {x.shape[-1]})",
    )
  work = _work(x, params)
  xw = x.astype(work)
  return (xw + (xw @ w1.astype(work).T + b.astype(work)) @ w2.astype(work)).astype(x.dtype)


@api_boundary
def direft(params) -> Edit:
  """DiReFT: ``h + W2ᵀ(W1 h + b)``, a low-rank edit without the orthogonality constraint.

  As the ReFT paper defines it (no orthogonality, no subtraction of the projection);
  pyreft's ``DireftIntervention`` keeps an orthogonal ``W2``, which this does not.

  Args:
    params: ``{"W1": (k, d), "b": (k,), "W2": (k, d)}`` (``jaxlens.train.DiReFT(rank).init``).
  """
  return Edit("direft", {"params": params}, (), keeps=True)


register("direft", _direft, direft, under_subspace="refused")
