"""The matrix exponential of a rotation's generator: Taylor, scaled and squared.

:func:`expm` is ``jax.scipy.linalg.expm`` for the small generators a trained rotation has
(``tril(raw) - tril(raw)ᵀ`` near ``raw = -I``), at a fraction of its cost forward and
backward. ``A`` is scaled by ``2^-s`` to a norm of at most ``0.5`` (the smaller of its 1-norm
and Frobenius norm, both bounds of the spectral norm), the Taylor polynomial of degree 8
(float32 and narrower) or 15 (float64) is evaluated by the Paterson-Stockmeyer scheme (4 or 6
matrix products), and the result is squared ``s`` times. The truncation error is below
``0.5^9 / 9! = 5e-9`` (float32) or ``0.5^16 / 16! = 7e-19`` (float64) relative to the
scaled exponential, so the result equals the Padé one to rounding. JAX's Padé ``expm`` pays
for a linear solve (an LU factorisation, serial on a CPU) and differentiates through it; the
polynomial is only products, whose reverse-mode derivative is two products each.

The squarings run as a scan of ``max_squarings`` steps of which the first ``s`` square (a
``lax.cond``), so the function is reverse-differentiable with a data-dependent ``s``. Past
``max_squarings`` (a norm above ``0.5 * 2^20``) the result is NaN, as JAX's is past its limit.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

__all__ = ["expm"]

_THETA = 0.5  # the largest norm the polynomial is evaluated at


def _products(a, b):
  return jnp.matmul(a, b, precision=jax.lax.Precision.HIGHEST)


def _taylor(x, degree: int, block: int):
  """``sum_{j <= degree} x^j / j!`` by Paterson-Stockmeyer with blocks of ``block`` powers
  (``degree + 1`` a multiple of ``block``)."""
  n = x.shape[-1]
  powers = [jnp.eye(n, dtype=x.dtype), x]
  for _ in range(block - 1):
    powers.append(_products(powers[-1], x))
  top = powers.pop()  # x^block: the Horner variable
  coef = [1.0 / math.factorial(j) for j in range(degree + 1)]
  blocks = [
    sum(coef[i * block + j] * powers[j] for j in range(block)) for i in range((degree + 1) // block)
  ]
  out = blocks[-1]
  for b in reversed(blocks[:-1]):
    out = b + _products(top, out)
  return out


def expm(a, *, max_squarings: int = 20):
  """``exp(a)`` of a square matrix ``a`` (see the module docstring)."""
  if a.dtype == jnp.float64:
    degree, block = 15, 4
  else:
    degree, block = 8, 3
  norm = jnp.minimum(jnp.max(jnp.sum(jnp.abs(a), axis=0)), jnp.sqrt(jnp.sum(a * a)))
  norm = jax.lax.stop_gradient(norm)
  s = jnp.maximum(jnp.ceil(jnp.log2(norm / _THETA)), 0.0)
  s = jnp.where(jnp.isfinite(s), s, 0.0).astype(jnp.int32)
  x = a * jnp.exp2(-s.astype(a.dtype))
  r = _taylor(x, degree, block)

  def square(i, r):
    return jax.lax.cond(i < s, lambda r: _products(r, r), lambda r: r, r)

  r, _ = jax.lax.scan(
    lambda r, i: (square(i, r), None), r, jnp.arange(max_squarings, dtype=jnp.int32)
  )
  return jnp.where(s > max_squarings, jnp.full_like(r, jnp.nan), r)
