"""Backward verbs: edits that leave the forward value alone and change its gradient.

Each verb here is an :class:`~jaxlens._src.edit.Edit` whose written value is the
site value itself, bit for bit, while the cotangent flowing back through the site
is transformed on its way upstream:

* ``grad_scale(factor)``: the cotangent times ``factor``;
* ``grad_zero()``: a zero cotangent (nothing upstream of the site learns from
  what is downstream of it);
* ``grad_clip(limit)`` / ``grad_clip(min=, max=)``: each element of the cotangent
  clipped to ``[-limit, limit]`` (or ``[min, max]``);
* ``backward_hook(fn)``: ``fn(cotangent)`` replaces the cotangent.

They are built on :func:`jax.custom_vjp`: the forward pass is the identity and the
custom backward rule applies the transform. Their array arguments (factors,
bounds) are pytree leaves of the edit, so a new value of the same shape passed
into a jitted function does not recompile.

The gradient contract reads them as *keeping* verbs (``keeps=True``) because the
contract is about the forward write: the value they write is the site value, and
structurally it depends on it (the derivative's jaxpr carries the site's tangent
through a ``custom_lin`` equation). So ``jl.depends_on`` reports ``True`` through
every backward verb, ``keep_grad(...)`` accepts every one of them, and
``keep_grad(jl.grad_zero())`` delivers an all-zero gradient, exactly as
``keep_grad(jl.scale(0.0))`` does. If you need the dependence itself to
disappear, write a cutting verb (``jl.zero_ablate()``,
``jl.replace_with(jax.lax.stop_gradient(x))``) instead.

Limits: JAX cannot push forward-mode derivatives through a ``custom_vjp``, so
``jax.jvp``, ``jax.jacfwd`` and ``jax.hessian`` of a function with a backward
verb in it raise JAX's own ``TypeError``; ``jax.grad``, ``jax.vjp``,
``jax.jacrev``, ``jax.linearize`` (for its structure) and ``grad`` of ``grad``
work.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp

from jaxlens._src.edit import ByIdentity, Edit, FireContext, register, takes_hook_keyword
from jaxlens._src.errors import InvalidArgumentError, ShapeError
from jaxlens._src.tracebacks import api_boundary

__all__ = ["grad_scale", "grad_zero", "grad_clip", "backward_hook"]


# --------------------------------------------------------------------------
# The one custom_vjp every backward verb goes through.


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _identity(rule, x, params):
  """Returns ``x``; its backward pass returns ``rule(cotangent, params)``.

  ``rule`` is static (a hashable callable); ``params`` are traced leaves that the
  rule reads. They receive a zero cotangent: the forward value does not depend
  on them, so that is their true derivative.
  """
  del rule, params
  return x


def _identity_fwd(rule, x, params):
  # The residuals are the params alone: the backward rules never need x.
  del rule
  return x, params


def _identity_bwd(rule, params, g):
  zeros = jax.tree.map(jnp.zeros_like, params)
  return rule(g, params), zeros


_identity.defvjp(_identity_fwd, _identity_bwd)


def _site_check(x, ctx: FireContext, verb: str):
  """Refuses a site whose value has no gradient to transform (an integer one)."""
  if not jnp.issubdtype(x.dtype, jnp.inexact):
    raise InvalidArgumentError(
      f"{verb}: the site value has dtype {x.dtype}; an integer or boolean value has no "
      "gradient to transform",
      code="site_not_float",
      site=ctx.label,
      verb=verb,
      fix="apply backward verbs at a float site (a module output such as a Dense or a block)",
    )


def _as_param(value, x, ctx, verb, name):
  """A numeric argument cast to the site's dtype (so its zero cotangent matches it)."""
  arr = jnp.asarray(value)
  if not (jnp.issubdtype(arr.dtype, jnp.inexact) or jnp.issubdtype(arr.dtype, jnp.integer)):
    raise ShapeError(
      f"{verb}: {name} must be a number, got dtype {arr.dtype}",
      code="dtype_mismatch",
      site=ctx.label,
      verb=verb,
      fix=f"pass {name} as a float, e.g. jnp.asarray({name}, jnp.{x.dtype})",
    )
  try:
    ok = jnp.broadcast_shapes(arr.shape, x.shape) == x.shape
  except ValueError:
    ok = False
  if not ok:
    raise ShapeError(
      f"{verb}: {name} of shape {arr.shape} does not broadcast to the site's shape {x.shape}",
      code="shape_mismatch",
      site=ctx.label,
      verb=verb,
      fix=f"a scalar {name}, or one that broadcasts to {x.shape}",
      expected=str(x.shape),
      received=str(arr.shape),
    )
  return arr.astype(x.dtype)


def _make(name, params, **static):
  return Edit(name, params, tuple(sorted(static.items())), keeps=True)


def _concrete(value) -> bool:
  return value is not None and not isinstance(value, jax.core.Tracer)


# --------------------------------------------------------------------------
# grad_scale and grad_zero.


def _scale_rule(g, params):
  return g * params["factor"]


def _grad_scale(x, p, s, ctx):
  _site_check(x, ctx, "grad_scale")
  factor = _as_param(p["factor"], x, ctx, "grad_scale", "factor")
  return _identity(_scale_rule, x, {"factor": factor})


@api_boundary
def grad_scale(factor) -> Edit:
  """Leaves the site value as it is and multiplies its gradient by ``factor``.

  The forward value is unchanged; on the way back, the cotangent ``g`` at the site
  becomes ``factor * g``. A negative factor reverses the gradient (a gradient
  reversal layer, as in domain-adversarial training).

  Args:
    factor: a scalar, or an array that broadcasts to the site's shape. It is a
      pytree leaf of the edit: a new value under ``jit`` does not recompile.

  Returns:
    A keeping :class:`Edit`.

  Example:
    >>> import jax, jax.numpy as jnp, jaxlens as jl
    >>> edit = jl.grad_scale(3.0)
    >>> jax.grad(lambda x: edit(x).sum())(jnp.ones(2)).tolist()
    [3.0, 3.0]
  """
  return _make("grad_scale", {"factor": factor})


register("grad_scale", _grad_scale, grad_scale)


def _zero_rule(g, params):
  del params
  return jnp.zeros_like(g)


def _grad_zero(x, p, s, ctx):
  _site_check(x, ctx, "grad_zero")
  return _identity(_zero_rule, x, {})


@api_boundary
def grad_zero() -> Edit:
  """Leaves the site value as it is and sends back a zero gradient.

  Unlike ``jax.lax.stop_gradient`` (and the cutting verbs built on it), the
  written value still structurally depends on the site value: ``jl.depends_on``
  reports ``True`` and ``keep_grad(jl.grad_zero())`` is accepted, while every
  parameter upstream of the site gets an exact-zero gradient through it, the
  same outcome as ``keep_grad(jl.scale(0.0))`` but without changing the forward
  value.

  Example:
    >>> import jax, jax.numpy as jnp, jaxlens as jl
    >>> jax.grad(lambda x: (jl.grad_zero()(x) * x).sum())(jnp.ones(2)).tolist()
    [1.0, 1.0]
  """
  return _make("grad_zero", {})


register("grad_zero", _grad_zero, grad_zero)


# --------------------------------------------------------------------------
# grad_clip.


def _clip_rule(g, params):
  return jnp.clip(g, params["min"], params["max"])


def _grad_clip(x, p, s, ctx):
  _site_check(x, ctx, "grad_clip")
  if p["limit"] is not None:
    hi = _as_param(p["limit"], x, ctx, "grad_clip", "limit")
    lo = -hi
  else:
    lo = None if p["min"] is None else _as_param(p["min"], x, ctx, "grad_clip", "min")
    hi = None if p["max"] is None else _as_param(p["max"], x, ctx, "grad_clip", "max")
  return _identity(_clip_rule, x, {"min": lo, "max": hi})


@api_boundary
def grad_clip(limit=None, *, min=None, max=None) -> Edit:  # noqa: A002 (as jl.clamp)
  """Leaves the site value as it is and clips each element of its gradient.

  The semantics are elementwise: every element of the cotangent ``g`` at the
  site is clipped independently, to ``[-limit, limit]`` with ``limit``, or to
  ``[min, max]`` (either may be omitted) otherwise. This is not clipping by
  norm: a norm depends on which axes it reduces over, which would make the
  result differ between a batched call and a ``jax.vmap`` over examples;
  elementwise clipping gives the same answer under both.

  Args:
    limit: a non-negative bound on each element's magnitude.
    min: the lowest value an element of the gradient may take.
    max: the highest value an element of the gradient may take.

  Returns:
    A keeping :class:`Edit` whose bounds are pytree leaves.

  Raises:
    InvalidArgumentError: ``invalid_argument`` when neither or both of
      ``limit`` and ``min``/``max`` are given, or (for concrete values) when
      ``limit`` is negative or ``min > max``.

  Example:
    >>> import jax, jax.numpy as jnp, jaxlens as jl
    >>> edit = jl.grad_clip(0.5)
    >>> g = jax.grad(lambda x: (edit(x) * jnp.array([2.0, -0.25])).sum())(jnp.ones(2))
    >>> g.tolist()
    [0.5, -0.25]
  """
  if limit is None and min is None and max is None:
    raise InvalidArgumentError(
      "grad_clip needs a limit, or min= and/or max=",
      code="invalid_argument",
      fix="jl.grad_clip(1.0)",
    )
  if limit is not None and (min is not None or max is not None):
    raise InvalidArgumentError(
      "grad_clip takes either a symmetric limit or min=/max=, not both",
      code="invalid_argument",
      fix="jl.grad_clip(1.0) or jl.grad_clip(min=-1.0, max=2.0)",
    )
  if _concrete(limit) and bool(jnp.any(jnp.asarray(limit) < 0)):
    raise InvalidArgumentError(
      f"grad_clip: limit must be non-negative, got {limit!r}",
      code="invalid_argument",
      fix="jl.grad_clip(abs(limit))",
    )
  if _concrete(min) and _concrete(max) and bool(jnp.any(jnp.asarray(min) > jnp.asarray(max))):
    raise InvalidArgumentError(
      f"grad_clip: min={min!r} is above max={max!r}",
      code="invalid_argument",
      fix="jl.grad_clip(min=lo, max=hi) with lo <= hi",
    )
  return _make("grad_clip", {"limit": limit, "min": min, "max": max})


register("grad_clip", _grad_clip, grad_clip)


# --------------------------------------------------------------------------
# backward_hook.


class _HookRule:
  """The backward rule of one ``backward_hook`` firing: calls fn and checks its result.

  Hashable by the user's function and the site, as ``custom_vjp`` needs for its
  static argument.
  """

  __slots__ = ("fn", "takes_hook", "ctx", "shape", "dtype")

  def __init__(self, fn, takes_hook, ctx, shape, dtype):
    self.fn, self.takes_hook, self.ctx = fn, takes_hook, ctx
    self.shape, self.dtype = shape, dtype

  def __eq__(self, other):
    return (
      isinstance(other, _HookRule)
      and other.fn is self.fn
      and other.ctx is self.ctx
      and other.shape == self.shape
      and other.dtype == self.dtype
    )

  def __hash__(self):
    return hash((id(self.fn), id(self.ctx), self.shape, str(self.dtype)))

  def __call__(self, g, params):
    del params
    new = self.fn(g, hook=self.ctx) if self.takes_hook else self.fn(g)
    label = self.ctx.label
    if not hasattr(new, "shape") or not hasattr(new, "dtype"):
      raise ShapeError(
        f"backward_hook: the hook returned a {type(new).__name__}, not an array",
        code="backward_hook_shape_mismatch",
        site=label,
        fix=f"return an array of shape {self.shape} and dtype {self.dtype}",
      )
    if tuple(new.shape) != self.shape:
      raise ShapeError(
        f"backward_hook: the hook returned a cotangent of shape {tuple(new.shape)} for a site "
        f"of shape {self.shape}",
        code="backward_hook_shape_mismatch",
        site=label,
        fix=f"return an array of shape {self.shape}",
        expected=str(self.shape),
        received=str(tuple(new.shape)),
      )
    if new.dtype != self.dtype:
      raise ShapeError(
        f"backward_hook: the hook returned a cotangent of dtype {new.dtype} for a site of "
        f"dtype {self.dtype}",
        code="backward_hook_dtype_mismatch",
        site=label,
        fix=f"return new.astype(jnp.{self.dtype})",
        expected=str(self.dtype),
        received=str(new.dtype),
      )
    return new


def _backward_hook(x, p, s, ctx):
  _site_check(x, ctx, "backward_hook")
  fn = s["fn"].obj
  rule = _HookRule(fn, takes_hook_keyword(fn), ctx, tuple(x.shape), x.dtype)
  return _identity(rule, x, {})


@api_boundary
def backward_hook(fn: Callable[..., Any]) -> Edit:
  """Leaves the site value as it is and replaces its gradient by ``fn(cotangent)``.

  ``fn`` receives the cotangent at the site (an array of the site's shape and
  dtype, a tracer when the backward pass is traced) and returns the new one,
  which must have the same shape and dtype. A function that takes a ``hook``
  keyword receives the site's :class:`FireContext` (``hook.label``) too.

  The result is checked when the backward pass is traced (when ``jax.grad`` or
  ``jax.vjp`` runs, or a jitted gradient is compiled), not in a forward-only
  call: a hook that only records its argument should not be run when nothing
  asks for a gradient.

  Args:
    fn: ``fn(g) -> new_g`` or ``fn(g, *, hook) -> new_g``.

  Returns:
    A keeping :class:`Edit`; ``fn`` is static (by identity), so passing the same
    function again does not recompile.

  Raises:
    InvalidArgumentError: ``invalid_argument`` if ``fn`` is not callable; at
      backward time, :class:`ShapeError` ``backward_hook_shape_mismatch`` or
      ``backward_hook_dtype_mismatch`` for a result of the wrong shape or dtype.

  Example:
    >>> import jax, jax.numpy as jnp, jaxlens as jl
    >>> edit = jl.backward_hook(lambda g: g ** 2)
    >>> jax.grad(lambda x: (edit(x) * 3.0).sum())(jnp.ones(2)).tolist()
    [9.0, 9.0]
  """
  if isinstance(fn, Edit) or not callable(fn):
    raise InvalidArgumentError(
      f"backward_hook needs a function of the cotangent, got {type(fn).__name__}",
      code="invalid_argument",
      fix="jl.backward_hook(lambda g: 0.5 * g)",
    )
  return _make("backward_hook", {}, fn=ByIdentity(fn))


register("backward_hook", _backward_hook, backward_hook, user_code=True)
