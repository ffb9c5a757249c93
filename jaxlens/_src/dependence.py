"""Structural dependence: does an output depend differentiably on an input?

JAX keeps no autograd graph on arrays, so "this value carries a graph" is answered
on the jaxpr of the forward-mode derivative: an output depends on an input leaf
when the output's tangent is reachable from that leaf's tangent through the
equations of ``jax.jvp``. A ``stop_gradient``, a constant or a value computed from
other data gives a symbolically-zero tangent and therefore no dependence, while
``x * 0.0`` still depends on ``x`` (its tangent is ``t * 0.0``), as in torch.

The analysis is abstract (it traces on shapes and dtypes only), so it gives the
same answer eagerly and under ``jit``, ``grad``, ``vmap`` and their compositions in
any order.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
from jax.extend import core as jcore

from jaxlens._src.tracebacks import api_boundary

__all__ = ["depends_on", "outputs_depend_on_inputs"]


def _is_float(leaf: Any) -> bool:
  dtype = getattr(leaf, "dtype", None)
  if dtype is None:
    return isinstance(leaf, float)
  return jnp.issubdtype(dtype, jnp.inexact)


def _abstract(leaf: Any) -> jax.ShapeDtypeStruct:
  leaf = jnp.asarray(leaf) if not hasattr(leaf, "dtype") else leaf
  return jax.ShapeDtypeStruct(jnp.shape(leaf), leaf.dtype)


def _sub_jaxpr(eqn) -> jcore.Jaxpr | None:
  """The single inner jaxpr of a call-like equation whose inputs map one to one."""
  for key in ("jaxpr", "call_jaxpr", "fun_jaxpr"):
    inner = eqn.params.get(key)
    if inner is None:
      continue
    inner = getattr(inner, "jaxpr", inner)
    if isinstance(inner, jcore.Jaxpr) and len(inner.invars) == len(eqn.invars):
      return inner
  return None


def _propagate(jaxpr: jcore.Jaxpr, in_masks: Sequence[int]) -> list[int]:
  """Bitmask propagation: for each outvar, the set of input indices it depends on."""
  env: dict[Any, int] = {}

  def read(var) -> int:
    if isinstance(var, jcore.Literal):
      return 0
    return env.get(var, 0)

  for var, mask in zip(jaxpr.invars, in_masks):
    env[var] = mask
  for eqn in jaxpr.eqns:
    masks = [read(v) for v in eqn.invars]
    inner = _sub_jaxpr(eqn)
    if inner is not None and len(inner.outvars) == len(eqn.outvars):
      outs = _propagate(inner, masks)
    elif eqn.primitive.name == "cond":
      # The first operand is the branch index; each output depends on what it
      # depends on in any branch.
      outs = [0] * len(eqn.outvars)
      for branch in eqn.params["branches"]:
        branch_outs = _propagate(branch.jaxpr, masks[1:])
        outs = [a | b for a, b in zip(outs, branch_outs)]
      outs = [o | masks[0] for o in outs]
    else:
      # Conservative for everything else (scan, while, custom rules): every
      # output depends on every input of the equation.
      union = 0
      for m in masks:
        union |= m
      outs = [union] * len(eqn.outvars)
    for var, mask in zip(eqn.outvars, outs):
      if not isinstance(var, jcore.DropVar):
        env[var] = mask
  return [read(v) for v in jaxpr.outvars]


def outputs_depend_on_inputs(fun: Callable[..., Any], *args: Any) -> tuple[list[list[bool]], Any]:
  """For each output leaf of ``fun(*args)``, which float input leaves it depends on.

  Args:
    fun: a function of pytrees of arrays.
    *args: its arguments (concrete arrays, tracers or ``ShapeDtypeStruct``).

  Returns:
    ``(table, out_tree)`` where ``table[i][j]`` says whether output leaf ``i``
    depends differentiably on input leaf ``j`` (leaves of ``args`` flattened in
    order; non-float leaves never count), and ``out_tree`` the output treedef.
  """
  leaves, in_tree = jax.tree.flatten(args)
  float_idx = [i for i, leaf in enumerate(leaves) if _is_float(leaf)]
  out_tree_box = []

  def tangent_fun(float_primals, float_tangents):
    def primal_fun(*fl):
      full = list(leaves)
      for i, v in zip(float_idx, fl):
        full[i] = v
      out = fun(*jax.tree.unflatten(in_tree, full))
      out_leaves, out_tree = jax.tree.flatten(out)
      out_tree_box.append(out_tree)
      # (Arrays and tracers pass as they are: a no-op conversion still costs a jnp call.)
      return [o if isinstance(o, jax.Array) else jnp.asarray(o) for o in out_leaves]

    _, tangents_out = jax.jvp(primal_fun, tuple(float_primals), tuple(float_tangents))
    return tangents_out

  abstract = [_abstract(leaves[i]) for i in float_idx]
  closed = jax.make_jaxpr(tangent_fun)(abstract, abstract)
  n = len(float_idx)
  # invars: primals first, then tangents; only tangents carry dependence bits.
  in_masks = [0] * n + [1 << k for k in range(n)]
  # Closed-over constants (other leaves, outer tracers) carry no tangent.
  jaxpr = closed.jaxpr
  out_masks = _propagate(jaxpr, in_masks)
  table = []
  for mask in out_masks:
    row = [False] * len(leaves)
    for k, i in enumerate(float_idx):
      row[i] = bool(mask >> k & 1)
    table.append(row)
  return table, out_tree_box[-1]


@api_boundary
def depends_on(fun: Callable[..., Any], *args: Any, argnums: int = 0) -> Any:
  """Says, per leaf of ``args[argnums]``, whether ``fun``'s output depends on it.

  Use it to audit a training step: a parameter whose leaf reads ``False`` gets a
  structurally-zero gradient, whatever its numeric value.

  Args:
    fun: a function of ``*args`` returning a pytree of arrays.
    *args: its arguments.
    argnums: which argument to report on.

  Returns:
    A pytree shaped like ``args[argnums]`` whose leaves are ``True`` where any
    output leaf depends differentiably on that leaf.

  Example:
    >>> import jax, jax.numpy as jnp, jaxlens as jl
    >>> f = lambda p, x: p["a"] * x + jax.lax.stop_gradient(p["b"])
    >>> jl.depends_on(f, {"a": 1.0, "b": 2.0}, 3.0)
    {'a': True, 'b': False}
  """
  table, _ = outputs_depend_on_inputs(fun, *args)
  leaves, _ = jax.tree.flatten(args)
  offsets = []
  start = 0
  for arg in args:
    count = len(jax.tree.leaves(arg))
    offsets.append((start, start + count))
    start += count
  lo, hi = offsets[argnums]
  flags = [any(row[j] for row in table) for j in range(lo, hi)]
  return jax.tree.unflatten(jax.tree.structure(args[argnums]), flags)
