"""Floor 9: gradients at sites from one backward pass (``jl.site_grads``, ``trace.grad``).

Each site gets a zero additive edit, ``add(delta)`` with ``delta = 0``, live in the forward
pass; the output is unchanged, and the gradient with respect to ``delta`` is the gradient with
respect to the site's value. :func:`grads_at_sites` does it over any function that runs the
model with a spec and returns a trace (``jaxlens.attribution.site_grads`` calls ``jl.trace``;
``Trace.grad`` reruns the trace's own call).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from jaxlens._src.doors import when
from jaxlens._src.errors import InvalidArgumentError, ShapeError, SiteError
from jaxlens._src.sites import Site, label, module
from jaxlens._src.verbs import add

__all__ = ["SiteGrad", "SiteGrads", "grads_at_sites"]


@dataclasses.dataclass(frozen=True)
class SiteGrad:
  """One site: ``.out`` its value, ``.grad`` the metric's gradient with respect to it."""

  label: str
  out: Any
  grad: Any


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SiteGrads:
  """What :func:`site_grads` returns (a pytree: it can leave ``jax.jit``).

  Attributes:
    value: the metric's value.
    grad: ``{label: d metric / d site value}``.
    out: ``{label: site value}``.
  """

  value: Any
  grad: dict
  out: dict

  @property
  def labels(self) -> tuple[str, ...]:
    return tuple(self.grad)

  def __getitem__(self, label: str) -> SiteGrad:
    if label not in self.grad:
      raise SiteError(
        f"no gradient was taken at {label!r}; sites: {list(self.grad)}",
        code="unknown_site",
        site=label,
        candidates=list(self.grad),
        fix=f"jl.site_grads(..., sites=[{label!r}, ...])",
      )
    return SiteGrad(label, self.out[label], self.grad[label])


def _selectors(sites) -> list:

  if sites is None:
    raise InvalidArgumentError(
      "site_grads needs the sites to differentiate at",
      code="invalid_argument",
      fix='sites=["block_0", "block_1"]',
    )
  if isinstance(sites, (str, Site)):
    sites = [sites]
  out = []
  for s in sites:
    out.append(module(s) if isinstance(s, str) else s)
  if not out:
    raise InvalidArgumentError(
      "site_grads needs at least one site", code="invalid_argument", fix='sites=["block_0"]'
    )
  return out


def _resolve(run_trace, selectors):
  """``{label: ShapeDtypeStruct}`` of the sites ``selectors`` pick (abstract evaluation)."""
  # Abstract evaluation: shapes, dtypes and the site infos, no computation.
  t_abstract = jax.eval_shape(lambda: run_trace([], selectors))
  values = t_abstract.values
  layered = []
  for label_, info in t_abstract.infos.items():
    if info is not None and info.layers is not None and info.layer is None:
      layered.append(label_)
  if layered:
    raise InvalidArgumentError(
      f"site_grads: {layered} are layer stacks (nn.scan / nnx.scan); take the gradient at "
      "one layer",
      code="unsupported_site",
      site=layered[0],
      fix=f'sites=[module("{layered[0]}", layer=0), ...]',
    )
  for label_, shape in values.items():
    if not jnp.issubdtype(shape.dtype, jnp.inexact):
      raise InvalidArgumentError(
        f"site_grads: {label_!r} has dtype {shape.dtype}; a gradient needs a float site",
        code="site_not_float",
        site=label_,
        fix="choose a float site (a module's output)",
      )
  return dict(values)


def grads_at_sites(run_trace, metric, sites, intervene=None) -> SiteGrads:
  """:func:`site_grads` over ``run_trace(spec list, save selectors) -> Trace``, a model call."""

  selectors = _selectors(sites)
  edits = (
    []
    if intervene is None
    else (list(intervene) if isinstance(intervene, (list, tuple)) else [intervene])
  )
  shapes = _resolve(lambda spec, save: run_trace(edits + spec, save), selectors)

  def run(deltas):
    spec = edits + [when(label(k), add(d)) for k, d in deltas.items()]
    t = run_trace(spec, [label(k) for k in deltas])
    value = jnp.asarray(metric(t.output))
    if value.shape != ():
      raise ShapeError(
        f"site_grads: metric returned shape {value.shape}, expected a scalar",
        code="metric_not_scalar",
        fix="reduce the metric: .mean() or .sum()",
      )
    return value, {k: t.values[k] for k in deltas}

  zeros = {k: jnp.zeros(s.shape, s.dtype) for k, s in shapes.items()}
  (value, outs), grads = jax.value_and_grad(run, has_aux=True)(zeros)
  return SiteGrads(value, grads, outs)
