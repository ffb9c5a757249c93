"""Gradients at sites from one backward pass, and attribution patching.

``jl.site_grads(model, variables, x, metric=..., sites=...)`` returns the value of a
scalar ``metric`` of the model output, and the gradient of that metric with respect
to each chosen site's value, from one ``jax.value_and_grad`` call. It is what
``.grad`` on a saved site is in torchlens (``save_gradients=True``) and nnsight
(``module.output.grad``): ``grads["block_0"].grad``, next to ``grads["block_0"].out``.

How: each site gets a zero additive edit, ``jl.add(delta)`` with ``delta = 0``, live
in the forward pass; the output is unchanged, and the gradient with respect to
``delta`` is the gradient with respect to the site's value. The function is pure
and traceable, so it runs under ``jax.jit`` (and ``vmap``).

``jl.attribution_patching(model, variables, clean, corrupt, metric, sites=...)``
is the linear approximation of an activation-patching sweep (Nanda, "Attribution
patching", 2023): cell ``[i, j]`` is ``sum(grad * (clean - corrupt))`` over the
value of ``sites[i]`` at position ``positions[j]``, with the gradient taken on the
corrupt run. It has the layout of :func:`jaxlens.sweep.patching_sweep` and
approximates ``patching_sweep(...) - metric(corrupt output)`` with one forward on
``clean`` and one forward and backward on ``corrupt``, whatever the number of
sites and positions; it is exact where the metric is linear in the site value.

Example:
  >>> import jax, jax.numpy as jnp, flax.linen as nn, jaxlens as jl
  >>> model = nn.Sequential([nn.Dense(3), nn.Dense(2)])
  >>> x = jnp.ones((1, 4), jnp.float32)
  >>> variables = model.init(jax.random.key(0), x)
  >>> g = jl.site_grads(model, variables, x, metric=lambda y: y.sum(), sites=["layers_0"])
  >>> g["layers_0"].grad.shape
  (1, 3)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax.numpy as jnp

from jaxlens import core as jl
from jaxlens.core import ShapeError
from jaxlens.core import SiteGrads
from jaxlens.internal import api_boundary, grads_at_sites

__all__ = ["attribution_patching", "site_grads"]


@api_boundary
def site_grads(
  model,
  variables,
  *inputs,
  metric: Callable[[Any], Any],
  sites: Sequence[Any] | Any,
  intervene=None,
  method=None,
  **apply_kwargs,
) -> SiteGrads:
  """The gradient of ``metric(model output)`` at each site, from one backward pass.

  Args:
    model: an unbound linen module.
    variables: its variables.
    *inputs: the model's inputs.
    metric: a function of the model output returning a scalar.
    sites: module paths (``"block_0"``, globs allowed) or selectors
      (``jl.label("tanh_1")`` for an op site); every site they select gets a gradient.
    intervene: edits live during the forward (a spec from ``jl.when``, or a list):
      the gradients are those of the edited model.
    method: the module method to call.
    **apply_kwargs: passed on to :func:`jaxlens.trace`.

  Returns:
    A :class:`SiteGrads`: ``.value``, ``.grad[label]``, ``.out[label]``, and
    ``g[label].grad`` / ``g[label].out``. ``trace.grad(metric, sites=...)`` is the
    same on a trace's model, inputs and edits.

  Raises:
    InvalidArgumentError: ``invalid_argument`` (no sites), ``site_not_float``,
      ``unsupported_site`` (a whole layer stack); :class:`SiteError`
      ``unknown_site`` (a selector that matches nothing); :class:`ShapeError`
      ``metric_not_scalar``.
  """

  def run_trace(spec, save):
    return jl.trace(
      model,
      variables,
      *inputs,
      intervene=spec,
      save=save,
      keep_inputs=False,
      method=method,
      **apply_kwargs,
    )

  return grads_at_sites(run_trace, metric, sites, intervene)


@api_boundary
def attribution_patching(
  model,
  variables,
  clean,
  corrupt,
  metric: Callable[[Any], Any],
  *,
  sites: Sequence[str],
  positions: Sequence[int] | None = None,
  method=None,
  **apply_kwargs,
):
  """Attribution patching: ``grad · (clean - corrupt)`` per site and position.

  Args:
    model: an unbound linen module whose sites return ``(batch, seq, ...)`` values.
    variables: its variables.
    clean: the input whose values would be patched in, ``(batch, seq, ...)``.
    corrupt: the input that is run, of the same shape.
    metric: a scalar function of the model output (as for ``patching_sweep``).
    sites: the module paths, one site each, in order.
    positions: the sequence positions (axis 1 of each site value; default all).
    method, **apply_kwargs: as for :func:`site_grads`.

  Returns:
    A float array ``(len(sites), len(positions))``: the first-order estimate of
    ``patching_sweep(model, variables, clean, corrupt, metric, sites=sites)``
    minus ``metric`` on the corrupt run.
  """

  if jnp.shape(clean) != jnp.shape(corrupt):
    raise ShapeError(
      f"attribution_patching: clean has shape {jnp.shape(clean)} but corrupt "
      f"has {jnp.shape(corrupt)}",
      code="shape_mismatch",
      expected=str(jnp.shape(clean)),
      received=str(jnp.shape(corrupt)),
      fix="pad or crop the two inputs to one shape",
    )
  sites = tuple(sites)
  selectors = [jl.label(s) for s in sites]
  g = site_grads(
    model, variables, corrupt, metric=metric, sites=selectors, method=method, **apply_kwargs
  )
  donor = jl.trace(
    model, variables, clean, save=selectors, keep_inputs=False, method=method, **apply_kwargs
  )
  rows = []
  for s in sites:
    grad, base, patched = g.grad[s], g.out[s], donor.values[s]
    if grad.ndim < 2:
      raise ShapeError(
        f"attribution_patching: site {s!r} has shape {grad.shape}, not (batch, seq, ...)",
        code="shape_mismatch",
        site=s,
        fix="choose sites whose values have a sequence axis 1",
      )
    contrib = grad * (patched - base)
    per_position = contrib.sum(axis=tuple(a for a in range(contrib.ndim) if a != 1))
    rows.append(
      per_position if positions is None else per_position[jnp.asarray(list(positions), jnp.int32)]
    )
  return jnp.stack(rows)
