"""The edits behind the methods of ``jaxlens.train`` that have no verb of their own.

Each builds a :func:`jaxlens.hook` edit over the method's parameters: an ordinary edit for
the doors, :func:`jaxlens.at_positions` and the training loops (built inside the traced
loss, its parameters are traced leaves of the closure, so gradients reach them), though
not one a saved spec can hold. The formulas are pyvene's (``RotatedSpaceIntervention``
with ``subspaces``, ``SigmoidMaskIntervention``, ``SigmoidMaskRotatedSpaceIntervention``,
``PCARotatedSpaceIntervention``, ``JumpReLUAutoencoderIntervention``) and pyreft's
(``NoreftIntervention``, ``ConsreftIntervention``, ``LobireftIntervention``,
``DireftIntervention``), written in the same order of operations.

A source is read at the edited site as :func:`jaxlens.patch_from` reads it (a donor
:class:`jaxlens.Trace` of the source run, or an array of the site's shape) and detached.
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxlens import intervention as ji
from jaxlens.core import InvalidArgumentError


def _work(x, *arrays):
  """The computing dtype: the first float parameter's (as pyvene casts to its weight)."""
  for a in arrays:
    if a is not None and jnp.issubdtype(jnp.asarray(a).dtype, jnp.inexact):
      return jnp.asarray(a).dtype
  return x.dtype


def _source(source, x, ctx, work):
  return jax.lax.stop_gradient(ji.patch_from(source)(x, ctx)).astype(work)


def _per_example(mask, x):
  """A ``(k,)`` mask as it is; a ``(B, k)`` one shaped to broadcast over ``x``'s middle axes."""
  mask = jnp.asarray(mask)
  if mask.ndim == 2 and x.ndim > 2:
    mask = mask.reshape(mask.shape[:1] + (1,) * (x.ndim - 2) + mask.shape[1:])
  return mask


def _check_mask(mask, x, k, ctx, what):
  mask = jnp.asarray(mask)
  ok = mask.ndim == 1 and mask.shape == (k,)
  ok = ok or (mask.ndim == 2 and mask.shape[1] == k and x.ndim >= 2 and mask.shape[0] == x.shape[0])
  if not ok:
    raise InvalidArgumentError(
      f"{what}: a subspace mask of shape {mask.shape} does not fit {k} coordinates of a site "
      f"of shape {x.shape}",
      code="shape_mismatch",
      site=ctx.label,
      expected=f"({k},) or (batch={x.shape[0]}, {k})",
      received=str(mask.shape),
      fix="jaxlens.train.subspace_mask(subspaces, k, partition) for the batch's examples",
    )


def subspace_mask(subspaces, k: int, partition: Sequence | None = None, dtype=np.float32):
  """pyvene's ``subspaces`` (and ``subspace_partition``) as a ``(batch, k)`` 0/1 mask.

  Example ``i`` interchanges the coordinates ``subspaces[i]`` (a list of indices in
  ``[0, k)``); with ``partition`` (a list of variables, each a ``(start, end)`` range or a
  list of indices, as pyvene's ``subspace_partition``) ``subspaces[i]`` lists variables and
  the example interchanges the coordinates of each. Several variables can so share one
  rotation, and each example picks the ones it intervenes on.

  Args:
    subspaces: one list of indices per example (a ragged list is fine).
    k: the number of coordinates (the rotation's columns, the features, the latents).
    partition: the variables' coordinates, or None (the indices are coordinates).
    dtype: the mask's dtype.

  Returns:
    a ``(len(subspaces), k)`` array, 1 where the example interchanges.

  Example:
    >>> from jaxlens import train as jt
    >>> jt.subspace_mask([[0], [1], [0, 1]], 5, partition=[(0, 2), (2, 4)]).astype(int).tolist()
    [[1, 1, 0, 0, 0], [0, 0, 1, 1, 0], [1, 1, 1, 1, 0]]
  """
  if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1:
    raise InvalidArgumentError(
      f"subspace_mask: k must be a positive int, got {k!r}",
      code="invalid_argument",
      fix="subspace_mask(subspaces, k=16)",
    )
  groups = None
  if partition is not None:
    groups = []
    for part in partition:
      part = list(part)
      if (
        len(part) == 2 and all(isinstance(v, (int, np.integer)) for v in part) and part[0] < part[1]
      ):
        part = list(range(part[0], part[1]))  # a (start, end) range, as pyvene expands it
      groups.append([int(v) for v in part])
  mask = np.zeros((len(subspaces), k), dtype)
  for i, row in enumerate(subspaces):
    for j in np.atleast_1d(np.asarray(row, dtype=np.int64)).tolist():
      if groups is not None and not 0 <= j < len(groups):
        raise InvalidArgumentError(
          f"subspace_mask: example {i} names variable {j} of a partition of {len(groups)}",
          code="index_out_of_range",
          expected=f"variables in [0, {len(groups)})",
          received=str(j),
          fix="indices of the partition's variables",
        )
      cols = groups[j] if groups is not None else [j]
      bad = [c for c in cols if not 0 <= c < k]
      if bad:
        raise InvalidArgumentError(
          f"subspace_mask: example {i} names coordinates {bad} outside [0, {k})",
          code="index_out_of_range",
          expected=f"coordinates in [0, {k})",
          received=str(bad),
          fix=f"coordinates (and partition ranges) within the {k} coordinates",
        )
      mask[i, cols] = 1
  return mask


# --------------------------------------------------------------------------
# Interchange under a mask, in a rotated basis, the site's own, a PCA basis or an SAE's.


def rotated_interchange(rotation, source, mask):
  """Interchange the rotated coordinates where the mask ``m`` is 1.

  ``R`` is the ``(d, k)`` matrix of ``rotation``. Square: ``(xR + m ⊙ (sR - xR)) Rᵀ``
  (pyvene's ``RotatedSpaceIntervention`` with ``subspaces``: ``(xR)[idx] = (sR)[idx]``,
  then ``Rᵀ``); tall: ``x + (m ⊙ (sR - xR)) Rᵀ`` (``LowRankRotatedSpaceIntervention``'s
  ``x + (sR - xR)[idx] R[:, idx]ᵀ``).
  ``m`` is ``(k,)`` or one row per example (:func:`subspace_mask`).
  """

  def fn(x, *, hook):
    work = _work(x, rotation["raw"])
    r = ji.orthogonal(rotation).astype(work)
    _check_mask(mask, x, r.shape[1], hook, "rotated_interchange")
    xw = x.astype(work)
    m = _per_example(mask, x).astype(work)
    rb, rs = xw @ r, _source(source, x, hook, work) @ r
    if r.shape[0] == r.shape[1]:  # as pyvene: rotate, interchange, rotate back
      return ((rb + m * (rs - rb)) @ r.T).astype(x.dtype)
    return (xw + (m * (rs - rb)) @ r.T).astype(x.dtype)

  return ji.hook(fn)


def sigmoid_mask_interchange(mask_logits, source, temperature, rotation=None):
  """``(1 - m) b + m s`` with ``m = σ(mask / T)``: pyvene's sigmoid masks.

  Without ``rotation`` the mask is per feature of the site (``SigmoidMaskIntervention``);
  with it, ``b``, ``s`` are the rotated ``xR``, ``sR`` and the result is rotated back by
  ``Rᵀ`` (``SigmoidMaskRotatedSpaceIntervention``).
  """

  def fn(x, *, hook):
    work = _work(x, mask_logits)
    m = jax.nn.sigmoid(
      mask_logits.astype(work) / jax.lax.stop_gradient(jnp.asarray(temperature, work))
    )
    s = _source(source, x, hook, work)
    xw = x.astype(work)
    if rotation is None:
      return ((1.0 - m) * xw + m * s).astype(x.dtype)
    r = ji.orthogonal(rotation).astype(work)
    return ((((1.0 - m) * (xw @ r)) + m * (s @ r)) @ r.T).astype(x.dtype)

  return ji.hook(fn)


def pca_interchange(basis, source, mask):
  """pyvene's ``PCARotatedSpaceIntervention``: in the standardised PCA basis.

  With ``z = ((x - mean) / std) Cᵀ`` (``C`` the ``(k, d)`` components), writes
  ``((z_x + m ⊙ (z_s - z_x)) C) std + mean``. As in pyvene, with ``k < d`` the part of
  the site outside the components' span is dropped, not kept.
  """

  def fn(x, *, hook):
    # A fixed basis: no gradient reaches it (a loop refuses to "train" it).
    c, mean, std = (jax.lax.stop_gradient(basis[k]) for k in ("components", "mean", "std"))
    work = _work(x, c)
    _check_mask(mask, x, c.shape[0], hook, "pca_interchange")
    zb = ((x.astype(work) - mean) / std) @ c.T
    zs = ((_source(source, x, hook, work) - mean) / std) @ c.T
    z = zb + _per_example(mask, x).astype(work) * (zs - zb)
    return ((z @ c) * std + mean).astype(x.dtype)

  return ji.hook(fn)


def sae_interchange(sae, source, mask, *, keep_error: bool):
  """Interchange a dictionary's features: ``decode(f_x + m ⊙ (f_s - f_x))``.

  ``f = sae.encode(.)`` (a :class:`jaxlens.sae.SAE`); pyvene's
  ``JumpReLUAutoencoderIntervention`` writes this reconstruction. With ``keep_error`` the
  site's reconstruction error ``x - decode(f_x)`` is added back, so only the features'
  part of the site changes (an identity when ``m`` is 0).
  """

  def fn(x, *, hook):
    d = jax.lax.stop_gradient(sae)  # the dictionary is fixed
    work = jnp.asarray(d.W_enc).dtype
    _check_mask(mask, x, d.W_enc.shape[1], hook, "sae_interchange")
    xw = x.astype(work)
    fb = d.encode(xw)
    fs = d.encode(_source(source, x, hook, work))
    out = d.decode(fb + _per_example(mask, x).astype(work) * (fs - fb), xw)
    if keep_error:
      out = out + (xw - d.decode(fb, xw))
    return out.astype(x.dtype)

  return ji.hook(fn)


# --------------------------------------------------------------------------
# pyreft's variants (sourceless).


def noreft(params):
  """NoReFT: ``h + (W h + b - (P h + c)) P``, ``P`` an unconstrained ``(k, d)`` projection
  (pyreft's ``proj_layer``; ``c`` its bias, when it has one)."""

  def fn(x):
    work = _work(x, params["W"])
    xw = x.astype(work)
    p = params["P"].astype(work)
    proj = xw @ p.T + (params["c"].astype(work) if "c" in params else 0.0)
    learned = xw @ params["W"].astype(work).T + params["b"].astype(work)
    return (xw + (learned - proj) @ p).astype(x.dtype)

  return ji.hook(fn)


def consreft(params):
  """ConsReFT: ``h + (b - h R) Rᵀ``: the subspace's coordinates set to a learned constant."""

  def fn(x):
    work = _work(x, params["rotation"]["raw"])
    r = ji.orthogonal(params["rotation"]).astype(work)
    xw = x.astype(work)
    return (xw + (params["b"].astype(work) - xw @ r) @ r.T).astype(x.dtype)

  return ji.hook(fn)


def lobireft(params):
  """LoBiReFT: ``h + b Rᵀ``: a learned bias in a learned orthonormal subspace."""

  def fn(x):
    work = _work(x, params["rotation"]["raw"])
    r = ji.orthogonal(params["rotation"]).astype(work)
    return (x.astype(work) + params["b"].astype(work) @ r.T).astype(x.dtype)

  return ji.hook(fn)


def direft_orthogonal(params):
  """pyreft's DiReFT: ``h + (W h + b) Rᵀ``, ``R`` with orthonormal columns."""

  def fn(x):
    work = _work(x, params["W1"])
    r = ji.orthogonal(params["rotation"]).astype(work)
    xw = x.astype(work)
    return (xw + (xw @ params["W1"].astype(work).T + params["b"].astype(work)) @ r.T).astype(
      x.dtype
    )

  return ji.hook(fn)
