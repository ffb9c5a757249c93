"""The verbs in torch, random draws as jaxlens draws them, ``as_edit`` and ``keep_grad``
(pairs with ``jaxlens/_src/verbs.py``).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import torch

from jaxlens import InterventionDecision, InvalidArgumentError
from jaxlens.contract import takes_hook_keyword
from torch_bridge.reference._edit import (
  Donor,
  Edit,
  Population,
  _along,
  _broadcast,
  _donor,
  _fail_shape,
  _resolve_axis,
  _source,
  _tensor,
  _unit,
  fire,
)

# Random draws, taken from jax.random exactly as jaxlens takes them.


def _draw(seed, ctx, verb, x: torch.Tensor, make: Callable[[Any], Any]) -> np.ndarray:
  """``make(key)`` evaluated with jaxlens's key and JAX's 64-bit mode for a float64 site."""
  if seed is None:
    raise InvalidArgumentError(
      f"{verb} draws random numbers and needs an explicit seed",
      code="seed_required",
      site=ctx.label,
      verb=verb,
      fix=f"ref.{verb}(..., seed=0)",
    )

  def run():
    key = jax.random.key(jnp.asarray(seed, jnp.uint32))
    return np.array(make(key))  # a writable copy, which torch can wrap

  if x.dtype == torch.float64:
    # jaxlens can only hold a float64 site with jax_enable_x64 on; draw as it does.
    with jax.enable_x64(True):
      return run()
  return run()


def _jax_dtype(dtype: torch.dtype):
  return {
    torch.float64: jnp.float64,
    torch.float32: jnp.float32,
    torch.float16: jnp.float16,
    torch.bfloat16: jnp.bfloat16,
  }[dtype]


def _normal(seed, x, ctx, verb) -> torch.Tensor:
  shape, dtype = tuple(x.shape), _jax_dtype(x.dtype)
  draw = _draw(seed, ctx, verb, x, lambda key: jax.random.normal(key, shape, dtype))
  if x.dtype == torch.bfloat16:
    return torch.as_tensor(draw.astype(np.float32), device=x.device).to(torch.bfloat16)
  return torch.as_tensor(draw, device=x.device)


def _permutation(seed, n, x, ctx, verb) -> torch.Tensor:
  draw = _draw(seed, ctx, verb, x, lambda key: jax.random.permutation(key, n))
  return torch.as_tensor(draw.astype(np.int64), device=x.device)


def _randint(seed, n, high, x, ctx, verb) -> torch.Tensor:
  draw = _draw(seed, ctx, verb, x, lambda key: jax.random.randint(key, (n,), 0, high))
  return torch.as_tensor(draw.astype(np.int64), device=x.device)


# --------------------------------------------------------------------------
# Keeping verbs: they compute from the site value.


def scale(factor) -> Edit:
  """``x * factor``."""
  return Edit("scale", lambda x, ctx: x * _tensor(factor, x))


def clamp(*, min=None, max=None) -> Edit:  # noqa: A002 (the specification's spelling)
  """``torch.clamp(x, min, max)``."""
  if min is None and max is None:
    raise InvalidArgumentError(
      "clamp needs min= or max=", code="invalid_argument", fix="ref.clamp(min=-1.0, max=1.0)"
    )

  def fn(x, ctx):
    lo = None if min is None else _tensor(min, x)
    hi = None if max is None else _tensor(max, x)
    return torch.clamp(x, lo, hi)

  return Edit("clamp", fn)


def add_noise(std, *, seed=None) -> Edit:
  """``x + std * jax.random.normal(jax.random.key(seed), x.shape, x.dtype)``."""
  return Edit("add_noise", lambda x, ctx: x + _tensor(std, x) * _normal(seed, x, ctx, "add_noise"))


def steer(direction, magnitude=1.0, *, feature_axis=None) -> Edit:
  """``x + magnitude * direction`` along the feature axis (not normalised)."""

  def fn(x, ctx):
    axis = _resolve_axis(x, direction, feature_axis, ctx, "steer")
    return x + _tensor(magnitude, x) * _along(_tensor(direction, x), axis, x.ndim)

  return Edit("steer", fn)


def add(delta) -> Edit:
  """``x + delta`` (broadcast); a delta that requires grad gets a gradient too."""

  def fn(x, ctx):
    d = _tensor(delta, x)
    return x + _broadcast(d, x, ctx, "add", "delta")

  return Edit("add", fn)


def project_onto(direction, *, feature_axis=None) -> Edit:
  """``<x, u> u`` with ``u`` the unit direction."""

  def fn(x, ctx):
    u, axis = _unit(direction, x, ctx, "project_onto", feature_axis)
    return (x * u).sum(dim=axis, keepdim=True) * u

  return Edit("project_onto", fn)


def project_out(direction, *, feature_axis=None) -> Edit:
  """``x - <x, u> u``."""

  def fn(x, ctx):
    u, axis = _unit(direction, x, ctx, "project_out", feature_axis)
    return x - (x * u).sum(dim=axis, keepdim=True) * u

  return Edit("project_out", fn)


def _dims(dim, ndim):
  if dim is None:
    return tuple(range(ndim))
  return tuple(dim) if isinstance(dim, (tuple, list)) else (dim,)


def mean_ablate(*, dim=None, source=None) -> Edit:
  """Writes a mean: of ``x`` over ``dim`` (keeps), or of a source over ``dim`` (default 0, cuts)."""

  def fn(x, ctx):
    if source is None:
      return x.mean(dim=_dims(dim, x.ndim), keepdim=True).expand(x.shape).clone()
    src = _source(source, ctx, "mean_ablate")
    mean = src.mean(dim=(0,) if dim is None else _dims(dim, src.ndim), keepdim=True)
    return _donor(mean, x, ctx, "mean_ablate", "source mean", broadcast=True)

  return Edit("mean_ablate", fn, keeps=source is None)


def scramble_elements(*, seed=None, source=None) -> Edit:
  """Permutes elements by ``jax.random.permutation(key(seed), x.numel())``."""

  def fn(x, ctx):
    perm = _permutation(seed, x.numel(), x, ctx, "scramble_elements")
    if source is None:
      return x.reshape(-1)[perm].reshape(x.shape)
    src = _source(source, ctx, "scramble_elements")
    if src.numel() != x.numel():
      _fail_shape(
        f"source has {src.numel()} elements, the site {x.numel()}",
        ctx,
        "scramble_elements",
        fix=f"a source of shape {tuple(x.shape)}",
      )
    src = _donor(src.reshape(x.shape), x, ctx, "scramble_elements", "source")
    return src.reshape(-1)[perm].reshape(x.shape)

  return Edit("scramble_elements", fn, keeps=source is None)


def splice_module(module: Callable[[torch.Tensor], torch.Tensor]) -> Edit:
  """``module(x)``: the site value is fed to ``module`` (a torch module or function)."""
  if not callable(module):
    raise InvalidArgumentError(
      f"splice_module needs a callable, got {type(module).__name__}",
      code="invalid_argument",
      fix="ref.splice_module(torch.tanh)",
    )
  return Edit("splice_module", lambda x, ctx: module(x))


def permute_batch(*, seed=None, axis=0) -> Edit:
  """Permutes rows along ``axis`` by ``jax.random.permutation(key(seed), n)``."""

  def fn(x, ctx):
    return x.index_select(axis, _permutation(seed, x.shape[axis], x, ctx, "permute_batch"))

  return Edit("permute_batch", fn)


def set_direction_mean(direction, source, *, feature_axis=None) -> Edit:
  """``x - <x,u> u + m u`` with ``m`` the mean of ``<s,u>`` over the (detached) source."""

  def fn(x, ctx):
    u, axis = _unit(direction, x, ctx, "set_direction_mean", feature_axis)
    scalar = isinstance(source, (int, float)) or (
      hasattr(source, "ndim") and not isinstance(source, (Population, Donor)) and source.ndim == 0
    )
    if scalar:
      mean_coef = _tensor(source, x).detach()
    else:
      values = _source(source, ctx, "set_direction_mean").to(x.dtype)
      if values.ndim != x.ndim or values.shape[axis] != x.shape[axis]:
        _fail_shape(
          f"source of shape {tuple(values.shape)} does not share the site's feature "
          f"axis {axis} (site shape {tuple(x.shape)})",
          ctx,
          "set_direction_mean",
          fix="a population of site values",
        )
      mean_coef = (values * u).sum(dim=axis).mean()
    coef = (x * u).sum(dim=axis, keepdim=True)
    return x - coef * u + mean_coef.detach() * u

  return Edit("set_direction_mean", fn)


def compose(*edits) -> Edit:
  """Applies edits left to right; keeps the graph when every one keeps it."""
  if not edits:
    raise InvalidArgumentError(
      "compose needs at least one edit",
      code="invalid_argument",
      fix="ref.compose(ref.scale(0.0), ref.add(value))",
    )
  parts = tuple(as_edit(e) for e in edits)

  def fn(x, ctx):
    for part in parts:
      x = fire(part, x, ctx)
    return x

  return Edit("compose", fn, keeps=all(p.keeps for p in parts), parts=parts)


def hook(fn: Callable) -> Edit:
  """Wraps ``fn(x)`` or ``fn(x, *, hook)`` (``hook`` is the :class:`SiteContext`)."""
  if isinstance(fn, Edit):
    return fn
  if not callable(fn):
    raise InvalidArgumentError(
      f"a hook must be callable, got {type(fn).__name__}",
      code="invalid_argument",
      fix='ref.when("0", lambda x: 2 * x)',
    )
  takes_hook = takes_hook_keyword(fn)
  return Edit("hook", (lambda x, ctx: fn(x, hook=ctx)) if takes_hook else (lambda x, ctx: fn(x)))


def at_positions(positions, edit, *, axis=1) -> Edit:
  """Writes ``edit``'s result at ``positions`` along ``axis`` only; elsewhere ``x``."""
  inner = as_edit(edit)

  def fn(x, ctx):
    ax = axis + x.ndim if axis < 0 else axis
    if not 0 <= ax < x.ndim:
      _fail_shape(
        f"axis={axis} is out of range for a site of shape {tuple(x.shape)}",
        ctx,
        "at_positions",
        fix="ref.at_positions(positions, edit, axis=1)",
      )
    pos = torch.as_tensor(np.array(positions), device=x.device)
    if pos.is_floating_point() or pos.dtype == torch.bool:
      _fail_shape(
        f"positions must be integers, got dtype {pos.dtype}",
        ctx,
        "at_positions",
        code="dtype_mismatch",
        fix="ref.at_positions([0, 3], edit)",
      )
    n = x.shape[ax]
    if pos.numel() and (int(pos.max()) >= n or int(pos.min()) < -n):
      raise InvalidArgumentError(
        f"at_positions: positions {pos.tolist()} out of range for axis {ax} of size {n}",
        code="index_out_of_range",
        site=ctx.label,
        fix=f"positions in [0, {n})",
      )
    line = torch.zeros(n, dtype=torch.bool, device=x.device)
    line[pos % n] = True
    return torch.where(_along(line, ax, x.ndim), fire(inner, x, ctx), x)

  return Edit("at_positions", fn, keeps=inner.keeps, parts=(inner,))


# --------------------------------------------------------------------------
# Cutting verbs: they write a value computed elsewhere, detached.


def zero_ablate() -> Edit:
  """``torch.zeros_like(x)`` (no graph)."""
  return Edit("zero_ablate", lambda x, ctx: torch.zeros_like(x), keeps=False)


def replace_with(value) -> Edit:
  """``value`` broadcast to the site's shape, detached."""
  return Edit(
    "replace_with",
    lambda x, ctx: _donor(value, x, ctx, "replace_with", "value", broadcast=True),
    keeps=False,
  )


def swap_with(other) -> Edit:
  """Another value of the site's shape, detached: a tensor, a donor trace, or a module name
  that ran earlier in the same call."""

  def fn(x, ctx):
    if isinstance(other, str):
      if other not in ctx.site_values:
        raise InvalidArgumentError(
          f"swap_with({other!r}) needs a module that already ran before {ctx.label!r}",
          code="swap_source_unavailable",
          site=ctx.label,
          candidates=list(ctx.site_values),
          fix="swap with a module computed earlier in the same call, or pass a tensor",
        )
      value = ctx.site_values[other]
    else:
      value = _source(other, ctx, "swap_with")
    return _donor(value, x, ctx, "swap_with", "other")

  return Edit("swap_with", fn, keeps=False)


def patch_from(source) -> Edit:
  """The donor's value at the same site (a :class:`Trace` of another run, or a tensor),
  detached by design."""
  return Edit(
    "patch_from",
    lambda x, ctx: _donor(_source(source, ctx, "patch_from"), x, ctx, "patch_from", "donor"),
    keeps=False,
  )


def resample_rows_from(source, *, seed=None, axis=0) -> Edit:
  """Row ``i`` is row ``jax.random.randint(key(seed), (n,), 0, N)[i]`` of the source, detached."""

  def fn(x, ctx):
    src = _source(source, ctx, "resample_rows_from").movedim(axis, 0)
    want = tuple(s for i, s in enumerate(x.shape) if i != axis % x.ndim)
    if src.ndim != x.ndim or tuple(src.shape[1:]) != want:
      _fail_shape(
        f"source rows of shape {tuple(src.shape[1:])} do not match the site's rows {want}",
        ctx,
        "resample_rows_from",
        fix="a population of site values",
      )
    idx = _randint(seed, x.shape[axis], src.shape[0], x, ctx, "resample_rows_from")
    return _donor(src[idx].movedim(0, axis), x, ctx, "resample_rows_from", "source")

  return Edit("resample_rows_from", fn, keeps=False)


# --------------------------------------------------------------------------

# --------------------------------------------------------------------------
# What a door accepts as an edit, and keep_grad.


def keep_grad(edit) -> Edit:
  """Returns the same edit with the fire-time keep_grad check (see the module docstring)."""
  return dataclasses.replace(as_edit(edit), keep_grad=True)


def as_edit(obj) -> Edit:
  """Normalises what a door accepts: a verb, a decision, a callable or a tensor."""
  if isinstance(obj, Edit):
    return obj
  if isinstance(obj, InterventionDecision):
    edit = as_edit(obj.action)
    return dataclasses.replace(edit, keep_grad=edit.keep_grad or obj.keep_grad)
  if isinstance(obj, (torch.Tensor, np.ndarray, jax.Array, int, float)):
    return replace_with(obj)
  if callable(obj):
    return hook(obj)
  raise InvalidArgumentError(
    f"expected an edit (a reference verb, a callable or a tensor), got {type(obj).__name__}",
    code="invalid_edit",
    fix='ref.when("0", ref.scale(0.5))',
  )
