"""Floor 3: the forward verbs, ``gate``, and the wrappers ``as_edit``, ``keep_grad``,
``compose``, ``hook``.

Each verb is a forward function ``forward(x, params, options, ctx)`` and a factory
that records its arguments in an :class:`~jaxlens._src.edit.Edit`, registered together
(``edit.register``) right below the factory. The recorded arguments are the
factory's own, by name: array ones in ``params`` (pytree leaves), the others in
``static``. Everything else (repr, saving, loading, the torch reference) is generic.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxlens._src.edit import (
  ByIdentity,
  Donor,
  Edit,
  InterventionDecision,
  Population,
  _sg,
  along,
  as_param,
  check_broadcast,
  donor_value,
  fail_shape,
  fire,
  key_from_seed,
  register,
  resolve_axis,
  source_values,
  takes_hook_keyword,
)
from jaxlens._src.errors import InvalidArgumentError, ShapeError
from jaxlens._src.sites import Site, as_selector
from jaxlens._src.tracebacks import api_boundary


def _make(name, params, keeps=True, **static):
  return Edit(name, params, tuple(sorted(static.items())), keeps)


def poison(bad, y):
  """The error value of a traced argument that names no place: NaN where it is bad.

  An out-of-range traced index or a degenerate traced basis cannot raise (its value
  is not known when the edit is traced), and it must never edit another place; so
  a float site gets NaN wherever the edit would have written, which no metric can
  mistake for a result. (Concrete arguments raise a typed error instead.)
  """
  if jnp.issubdtype(y.dtype, jnp.inexact):
    return jnp.where(bad, jnp.asarray(jnp.nan, y.dtype), y)
  return y


@api_boundary
def population(*sources, site=None) -> Population:
  """Gathers reference activations into a :class:`Population`.

  Args:
    *sources: arrays of site values, or traces (with ``site``) whose saved value at
      that site is taken; all are concatenated along axis 0.
    site: the site to read from traces (a selector or label).

  Example:
    >>> import jax.numpy as jnp, jaxlens as jl
    >>> jl.population(jnp.ones((2, 4)), jnp.zeros((3, 4)))
    Population(shape=(5, 4))
  """
  parts = []
  for s in sources:
    if isinstance(s, Donor):
      if site is None:
        raise InvalidArgumentError(
          "population of traces needs site=",
          code="invalid_source",
          fix='jl.population(trace, site=jl.module("layers_0"))',
        )
      parts.append(s.site_value(site))
    else:
      parts.append(jnp.asarray(s))
  if not parts:
    raise InvalidArgumentError(
      "population needs at least one source",
      code="invalid_source",
      fix="jl.population(trace_a, trace_b, site=...)",
    )
  return Population(jnp.concatenate(parts, axis=0))


# --------------------------------------------------------------------------
# Keeping verbs.


def _scale(x, p, s, ctx):
  return x * check_broadcast(
    as_param(p["factor"], x, ctx, "scale", "factor"), x, ctx, "scale", "factor"
  )


@api_boundary
def scale(factor) -> Edit:
  """Multiplies the site value by ``factor`` (keeps the gradient).

  ``keep_grad(jl.scale(0.0))`` writes zeros with a zero gradient: the graph-keeping
  spelling of a zero ablation.

  Example:
    >>> import jaxlens as jl
    >>> jl.scale(0.5)
    jl.scale(0.5)
  """
  if isinstance(factor, (str, bytes)):
    raise ShapeError(
      f"scale: factor must be a number or a numeric array, got {factor!r:.60}",
      code="dtype_mismatch",
      fix="jl.scale(2.0)",
    )
  return _make("scale", {"factor": factor})


register("scale", _scale, scale)


def _clamp(x, p, s, ctx):
  lo = None if p["min"] is None else as_param(p["min"], x, ctx, "clamp", "min")
  hi = None if p["max"] is None else as_param(p["max"], x, ctx, "clamp", "max")
  return jnp.clip(x, lo, hi)


@api_boundary
def clamp(*, min=None, max=None) -> Edit:  # noqa: A002 (the specification's spelling)
  """Clips the site value to ``[min, max]`` (keeps the gradient inside the range)."""
  if min is None and max is None:
    raise InvalidArgumentError(
      "clamp needs min= or max=", code="invalid_argument", fix="jl.clamp(min=-1.0, max=1.0)"
    )
  return _make("clamp", {"min": min, "max": max})


register("clamp", _clamp, clamp)


def _add_noise(x, p, s, ctx):
  if not jnp.issubdtype(x.dtype, jnp.inexact):
    fail_shape(
      f"Gaussian noise on a site of dtype {x.dtype}",
      ctx,
      "add_noise",
      code="site_not_float",
      fix="add noise at a float site",
    )
  key = key_from_seed(p["seed"], ctx, "add_noise")
  noise = jax.random.normal(key, x.shape, x.dtype)
  return x + as_param(p["std"], x, ctx, "add_noise", "std") * noise


@api_boundary
def add_noise(std, *, seed=None) -> Edit:
  """Adds Gaussian noise ``std * normal(key(seed), x.shape)`` (keeps the gradient).

  The draw is ``jax.random.normal(jax.random.key(seed), x.shape, x.dtype)``: the
  same on every door and with or without ``jit``.
  """
  return _make("add_noise", {"std": std, "seed": seed})


register("add_noise", _add_noise, add_noise)


def _steer(x, p, s, ctx):
  axis = resolve_axis(x, p["direction"], s["feature_axis"], ctx, "steer")
  d = along(as_param(p["direction"], x, ctx, "steer", "direction"), axis, x.ndim)
  magnitude = as_param(p["magnitude"], x, ctx, "steer", "magnitude")
  if magnitude.ndim:
    fail_shape(
      f"magnitude must be a scalar, got shape {magnitude.shape}",
      ctx,
      "steer",
      fix="jl.steer(direction, 2.0)",
    )
  return x + magnitude * d


@api_boundary
def steer(direction, magnitude=1.0, *, feature_axis=None) -> Edit:
  """Adds ``magnitude * direction`` along the feature axis (keeps the gradient).

  Args:
    direction: a 1-D array; it is not normalised.
    magnitude: a scalar.
    feature_axis: the axis of the site value the direction lies along; needed
      only when several axes have the direction's length.
  """
  return _make("steer", {"direction": direction, "magnitude": magnitude}, feature_axis=feature_axis)


register("steer", _steer, steer)


def _add(x, p, s, ctx):
  delta = as_param(p["delta"], x, ctx, "add", "delta")
  try:
    ok = jnp.broadcast_shapes(delta.shape, x.shape) == x.shape
  except ValueError:
    ok = False
  if not ok:
    fail_shape(
      f"delta of shape {delta.shape} does not broadcast to site shape {x.shape}",
      ctx,
      "add",
      fix=f"a delta of shape {x.shape}",
    )
  return x + delta


@api_boundary
def add(delta) -> Edit:
  """Adds ``delta`` (broadcast to the site's shape); the gradient reaches both."""
  return _make("add", {"delta": delta})


register("add", _add, add)


def _unit(p, x, ctx, verb, feature_axis):
  axis = resolve_axis(x, p["direction"], feature_axis, ctx, verb)
  d = as_param(p["direction"], x, ctx, verb, "direction")
  norm = jnp.linalg.norm(d)
  if not isinstance(p["direction"], jax.core.Tracer) and not np.any(np.asarray(p["direction"])):
    raise InvalidArgumentError(
      f"{verb}: the direction is zero, so it spans no line",
      code="direction_zero",
      site=ctx.label,
      verb=verb,
      fix=f"jl.{verb}(a nonzero direction)",
    )
  # A traced zero direction gives NaN (0/0): the error value, never a silent result.
  return along(d / norm, axis, x.ndim), axis


def _project_onto(x, p, s, ctx):
  u, axis = _unit(p, x, ctx, "project_onto", s["feature_axis"])
  return jnp.sum(x * u, axis=axis, keepdims=True) * u


@api_boundary
def project_onto(direction, *, feature_axis=None) -> Edit:
  """Keeps only the component along ``direction`` (keeps the gradient)."""
  return _make("project_onto", {"direction": direction}, feature_axis=feature_axis)


register("project_onto", _project_onto, project_onto, under_subspace="refused")


def _project_out(x, p, s, ctx):
  u, axis = _unit(p, x, ctx, "project_out", s["feature_axis"])
  return x - jnp.sum(x * u, axis=axis, keepdims=True) * u


@api_boundary
def project_out(direction, *, feature_axis=None) -> Edit:
  """Removes the component along ``direction`` (keeps the gradient)."""
  return _make("project_out", {"direction": direction}, feature_axis=feature_axis)


register("project_out", _project_out, project_out, under_subspace="refused")


def _axes(dim, ndim, ctx, verb):
  axes = dim if dim is None or isinstance(dim, tuple) else (dim,)
  for a in axes or ():
    if isinstance(a, bool) or not isinstance(a, (int, np.integer)) or not -ndim <= a < ndim:
      fail_shape(
        f"dim={dim!r} is out of range for a value of {ndim} axes",
        ctx,
        verb,
        code="invalid_argument",
        fix=f"jl.{verb}(dim=0)",
      )
  return axes


def _mean_ablate(x, p, s, ctx):
  dim = s["dim"]
  if p["source"] is None:
    return jnp.broadcast_to(
      jnp.mean(x, axis=_axes(dim, x.ndim, ctx, "mean_ablate"), keepdims=True), x.shape
    )
  src = _sg(source_values(p["source"], ctx, "mean_ablate"))
  axes = (0,) if dim is None else _axes(dim, src.ndim, ctx, "mean_ablate")
  mean = jnp.mean(src, axis=axes, keepdims=True)
  return donor_value(mean, x, ctx, "mean_ablate", "source mean", broadcast=True)


@api_boundary
def mean_ablate(*, dim=None, source=None) -> Edit:
  """Writes a mean.

  Without ``source``: the mean of the site value over ``dim`` (all axes when
  ``None``), broadcast back; the gradient flows through the mean (keeps).
  With ``source`` (an array or a :class:`Population`): the mean of the source
  over ``dim`` (default axis 0, the examples), broadcast to the site; detached
  (cuts).
  """
  if isinstance(dim, list):
    dim = tuple(dim)
  return Edit("mean_ablate", {"source": source}, (("dim", dim),), keeps=source is None)


register("mean_ablate", _mean_ablate, mean_ablate, source_arg="source")


def _scramble(x, p, s, ctx):
  key = key_from_seed(p["seed"], ctx, "scramble_elements")
  perm = jax.random.permutation(key, x.size)
  if p["source"] is None:
    return x.reshape(-1)[perm].reshape(x.shape)
  src = _sg(source_values(p["source"], ctx, "scramble_elements"))
  if src.size != x.size:
    fail_shape(
      f"source has {src.size} elements, the site {x.size}",
      ctx,
      "scramble_elements",
      fix=f"a source of shape {x.shape}",
    )
  src = donor_value(src.reshape(x.shape), x, ctx, "scramble_elements", "source")
  return src.reshape(-1)[perm].reshape(x.shape)


@api_boundary
def scramble_elements(*, seed=None, source=None) -> Edit:
  """Permutes elements with ``jax.random.permutation(key(seed), x.size)``.

  Without ``source`` it permutes the site value's own elements (keeps); with a
  ``source`` of the site's size it writes the source's elements (cuts).
  """
  return Edit("scramble_elements", {"seed": seed, "source": source}, (), keeps=source is None)


register("scramble_elements", _scramble, scramble_elements, source_arg="source")


def _splice(x, p, s, ctx):
  module = s["module"].obj
  if p["variables"] is not None:
    return module.apply(p["variables"], x)
  return module(x)


@api_boundary
def splice_module(module, variables=None) -> Edit:
  """Replaces the site value by ``module(x)`` (keeps the gradient through x).

  Args:
    module: a callable of the site value, a bound Flax module, or an unbound one
      with ``variables``.
    variables: the unbound module's variables (a pytree leaf: trainable).
  """
  if not callable(module) and variables is None:
    raise InvalidArgumentError(
      f"splice_module needs a callable, got {type(module).__name__}",
      code="invalid_argument",
      fix="jl.splice_module(jnp.tanh)",
    )
  return _make("splice_module", {"variables": variables}, module=ByIdentity(module))


register("splice_module", _splice, splice_module)


def _permute_batch(x, p, s, ctx):
  key = key_from_seed(p["seed"], ctx, "permute_batch")
  axis = s["axis"]
  if isinstance(axis, bool) or not isinstance(axis, int) or not -x.ndim <= axis < x.ndim:
    fail_shape(
      f"axis={axis!r} is out of range for a site of shape {x.shape}",
      ctx,
      "permute_batch",
      code="invalid_argument",
      fix="jl.intervention.permute_batch(seed=0, axis=0)",
    )
  return jnp.take(x, jax.random.permutation(key, x.shape[axis]), axis=axis)


@api_boundary
def permute_batch(*, seed=None, axis=0) -> Edit:
  """Permutes rows along ``axis`` with ``jax.random.permutation(key(seed), n)``."""
  return _make("permute_batch", {"seed": seed}, axis=axis)


register("permute_batch", _permute_batch, permute_batch, row_axis="axis")


def _set_direction_mean(x, p, s, ctx):
  u, axis = _unit(p, x, ctx, "set_direction_mean", s["feature_axis"])
  src = p["source"]
  if isinstance(src, (int, float)) or (hasattr(src, "ndim") and jnp.ndim(src) == 0):
    mean_coef = as_param(src, x, ctx, "set_direction_mean", "source")
  else:
    values = _sg(source_values(src, ctx, "set_direction_mean")).astype(x.dtype)
    if values.ndim != x.ndim or values.shape[axis] != x.shape[axis]:
      fail_shape(
        f"source of shape {values.shape} does not share the site's feature axis "
        f"{axis} (site shape {x.shape})",
        ctx,
        "set_direction_mean",
        fix="a population of site values",
      )
    mean_coef = jnp.mean(jnp.sum(values * u, axis=axis))
  coef = jnp.sum(x * u, axis=axis, keepdims=True)
  return x - coef * u + _sg(mean_coef) * u


@api_boundary
def set_direction_mean(direction, source, *, feature_axis=None) -> Edit:
  """Sets the coordinate along ``direction`` to its mean over ``source``.

  Writes ``x - <x,u>u + m u`` where ``u`` is the unit direction and ``m`` the mean of
  ``<s,u>`` over the source (an array, a Population, or the scalar mean itself).
  The gradient flows through the orthogonal part (keeps).
  """
  return _make(
    "set_direction_mean", {"direction": direction, "source": source}, feature_axis=feature_axis
  )


register("set_direction_mean", _set_direction_mean, set_direction_mean)


def _compose(x, p, s, ctx):
  for edit in p["edits"]:
    x = fire(edit, x, ctx)
  return x


@api_boundary
def compose(*edits) -> Edit:
  """Applies edits left to right; keeps the gradient when every one keeps it."""
  if not edits:
    raise InvalidArgumentError(
      "compose needs at least one edit",
      code="invalid_argument",
      fix="jl.intervention.compose(jl.scale(0.0), jl.add(value))",
    )
  parts = tuple(as_edit(e) for e in edits)
  return Edit("compose", {"edits": parts}, (), keeps=all(e.keeps for e in parts))


register("compose", _compose, compose)


def _hook(x, p, s, ctx):
  fn = s["fn"].obj
  if takes_hook_keyword(fn):
    return fn(x, hook=ctx)
  return fn(x)


@api_boundary
def hook(fn: Callable) -> Edit:
  """Wraps a callable ``fn(x)`` or ``fn(x, *, hook)`` as an edit.

  It keeps the gradient when it computes from its input. It may return an
  :class:`InterventionDecision` to ask for the keep_grad check.
  """
  if isinstance(fn, Edit):
    return fn
  if not callable(fn):
    raise InvalidArgumentError(
      f"a hook must be callable, got {type(fn).__name__}",
      code="invalid_argument",
      fix="jl.when(site, lambda x: 2 * x)",
    )
  return _make("hook", {}, fn=ByIdentity(fn))


register("hook", _hook, hook, user_code=True)


def _at_positions(x, p, s, ctx):
  axis = s["axis"]
  axis = axis + x.ndim if axis < 0 else axis
  if not 0 <= axis < x.ndim:
    fail_shape(
      f"axis={s['axis']} is out of range for a site of shape {x.shape}",
      ctx,
      "at_positions",
      fix="at_positions(positions, edit, axis=1)",
    )
  traced = isinstance(p["positions"], jax.core.Tracer)
  host = None if traced else np.asarray(p["positions"])
  positions = jnp.asarray(p["positions"])
  if not jnp.issubdtype(positions.dtype, jnp.integer):
    fail_shape(
      f"positions must be integers, got dtype {positions.dtype}",
      ctx,
      "at_positions",
      code="dtype_mismatch",
      fix="at_positions(jnp.array([0, 3]), edit)",
    )
  n = x.shape[axis]
  if host is not None and host.size and (host.max() >= n or host.min() < -n):
    raise InvalidArgumentError(
      f"at_positions: positions {host.tolist()} out of range for axis {axis} of size {n}",
      code="index_out_of_range",
      site=ctx.label,
      fix=f"positions in [0, {n})",
    )
  flat = positions.reshape(-1)
  flat = jnp.where(flat < 0, flat + n, flat)
  # A comparison, not an index: a position outside [0, n) matches no place.
  mask = jnp.any(jnp.arange(n, dtype=flat.dtype)[:, None] == flat[None, :], axis=1)
  shape = [1] * x.ndim
  shape[axis] = n
  edited = fire(p["edit"], x, ctx)
  out = jnp.where(mask.reshape(shape), edited, x)
  if traced:
    out = poison(jnp.any((flat < 0) | (flat >= n)), out)
  return out


@api_boundary
def at_positions(positions, edit, *, axis=1) -> Edit:
  """Applies ``edit`` at the given sequence positions only.

  The edit sees the whole site value; its result is written at ``positions``
  along ``axis`` (default 1, the sequence axis of a ``(batch, seq, features)``
  site) and the other positions keep the site value, with its gradient. It keeps
  the gradient through the edited positions when the inner verb does.
  ``positions`` is a leaf: ``jax.vmap`` over positions sweeps them in one call.
  A concrete position out of range raises ``index_out_of_range``; a traced one
  (whose value is not known when the edit is traced) makes the site NaN.
  """
  inner = as_edit(edit)
  if isinstance(positions, (list, tuple)):
    # One array leaf, not a list of int leaves: passed to jit as an argument, a list would
    # become scalar tracers that no check can stack.
    try:
      positions = np.asarray(positions)
    except ValueError:
      pass  # ragged: refused where the edit fires, with the site named
  return Edit(
    "at_positions", {"positions": positions, "edit": inner}, (("axis", axis),), keeps=inner.keeps
  )


register("at_positions", _at_positions, at_positions)


def _gate(x, p, s, ctx):
  # The inner edit runs on every firing (its shape checks apply either way); its
  # value is written only where the flag is on.
  if jnp.ndim(p["flag"]) != 0:
    # (Under jax.vmap over a batch of flags each firing sees one: a scalar.)
    fail_shape(
      f"the flag must be a boolean scalar, got shape {jnp.shape(p['flag'])}",
      ctx,
      "gate",
      fix="jl.gate(True, edit); for a batch of flags, jax.vmap over them",
    )
  edited = fire(p["edit"], x, ctx)
  return jnp.where(p["flag"], edited, x)


@api_boundary
def gate(flag, edit) -> Edit:
  """Applies ``edit`` when the boolean scalar ``flag`` is true, else leaves the site alone.

  ``flag`` is a leaf: under ``jax.vmap`` a batch of flags selects, per batch
  element, which rules of a spec are live. The edit keeps the gradient when the
  inner one does.
  """
  inner = as_edit(edit)
  return Edit("gate", {"flag": flag, "edit": inner}, (), keeps=inner.keeps)


register("gate", _gate, gate)


def _at_steps(x, p, s, ctx):
  if ctx.step is None:
    raise InvalidArgumentError(
      "at_steps selects calls of a generation; this site was reached outside jl.generate",
      code="outside_generation",
      site=ctx.label,
      fix="use the spec in jl.generate(..., intervene=spec), or drop at_steps",
    )
  edited = fire(p["edit"], x, ctx)
  return jnp.where(jnp.isin(ctx.step, p["steps"]), edited, x)


@api_boundary
def at_steps(steps, edit) -> Edit:
  """Applies ``edit`` only in the forward calls of :func:`jaxlens.generate` that produce the
  chosen new tokens.

  Call 0 is the prefill (its last position chooses new token 0); call ``t >= 1`` is the
  decode step that feeds new token ``t - 1`` and chooses token ``t``. In the other calls the
  site keeps its value. The call index reaches the edit as ``FireContext.step`` (a door
  called with ``spec.bind(model, step=t)`` sets it; ``jl.generate`` does). ``steps`` is a
  leaf (an int array): changing it does not recompile. The edit keeps the gradient when the
  inner one does.

  Args:
    steps: an int or a sequence of ints, the call indices.
    edit: the edit to apply in those calls.
  """
  steps = np.atleast_1d(np.asarray(steps))
  if steps.ndim != 1 or not np.issubdtype(steps.dtype, np.integer):
    raise InvalidArgumentError(
      f"at_steps takes integer call indices, got {steps!r}",
      code="invalid_argument",
      fix="jl.at_steps([0, 3], edit)",
    )
  inner = as_edit(edit)
  return Edit(
    "at_steps", {"steps": jnp.asarray(steps, jnp.int32), "edit": inner}, (), keeps=inner.keeps
  )


register("at_steps", _at_steps, at_steps)


# --------------------------------------------------------------------------
# Cutting verbs.


def _zero_ablate(x, p, s, ctx):
  return jnp.zeros_like(x)


@api_boundary
def zero_ablate() -> Edit:
  """Writes zeros (cuts: the zeros do not depend on the site value)."""
  return _make("zero_ablate", {}, keeps=False)


register("zero_ablate", _zero_ablate, zero_ablate, keeping_spelling="keep_grad(jl.scale(0.0))")


def _replace_with(x, p, s, ctx):
  return _sg(donor_value(p["value"], x, ctx, "replace_with", "value", broadcast=True))


@api_boundary
def replace_with(value) -> Edit:
  """Writes ``value`` (broadcast to the site's shape), detached (cuts)."""
  return _make("replace_with", {"value": value}, keeps=False)


register(
  "replace_with",
  _replace_with,
  replace_with,
  under_subspace="source",
  keeping_spelling="keep_grad(jl.intervention.compose(jl.scale(0.0), jl.add(value)))",
)


def _swap_with(x, p, s, ctx):
  other = s.get("other")
  if other is not None:
    selector = as_selector(other)
    hits = [lbl for lbl, info_val in ctx.site_values.items() if selector.matches(info_val[0])]
    if len(hits) != 1:
      raise InvalidArgumentError(
        f"swap_with({other!r}) needs exactly one site that already ran before "
        f"{ctx.label!r}; found {hits or 'none'}",
        code="swap_source_unavailable",
        site=ctx.label,
        fix="swap with a site computed earlier in the same call, or pass an array",
        candidates=list(ctx.site_values),
      )
    value = ctx.site_values[hits[0]][1]
  else:
    value = source_values(p["other"], ctx, "swap_with")
  return _sg(donor_value(value, x, ctx, "swap_with", "other"))


@api_boundary
def swap_with(other) -> Edit:
  """Writes another value of the site's shape, detached (cuts).

  Args:
    other: an array, a donor Trace, or a site (a selector or a label) that ran
      earlier in the same call, whose value is taken.
  """
  if isinstance(other, (Site, str)):
    return Edit("swap_with", {}, (("other", as_selector(other)),), keeps=False)
  return Edit("swap_with", {"other": other}, (), keeps=False)


register("swap_with", _swap_with, swap_with, under_subspace="source")


def _patch_from(x, p, s, ctx):
  return _sg(
    donor_value(_sg(source_values(p["source"], ctx, "patch_from")), x, ctx, "patch_from", "donor")
  )


@api_boundary
def patch_from(source) -> Edit:
  """Writes the donor's value at the same site, detached by design (cuts).

  Args:
    source: a Trace of another run (its saved value at this site is taken) or an
      array of the site's shape.
  """
  return _make("patch_from", {"source": source}, keeps=False)


register(
  "patch_from",
  _patch_from,
  patch_from,
  under_subspace="source",
  keeping_spelling=(
    "jl.when(jl.subspace(site, basis, origin=...), jl.patch_from(source)) keeps "
    "the complement; or keep_grad(jl.intervention.compose(jl.scale(0.0), "
    "jl.add(donor)))"
  ),
)


def _resample_rows(x, p, s, ctx):
  axis = s["axis"]
  if isinstance(axis, bool) or not isinstance(axis, int) or not -x.ndim <= axis < x.ndim:
    fail_shape(
      f"axis={axis!r} is out of range for a site of shape {x.shape}",
      ctx,
      "resample_rows_from",
      code="invalid_argument",
      fix="jl.intervention.resample_rows_from(source, seed=0, axis=0)",
    )
  src = _sg(source_values(p["source"], ctx, "resample_rows_from"))
  src = jnp.moveaxis(src, axis, 0)
  want = tuple(np.delete(np.array(x.shape), axis))
  if src.ndim != x.ndim or tuple(src.shape[1:]) != want:
    fail_shape(
      f"source rows of shape {tuple(src.shape[1:])} do not match the site's rows {want}",
      ctx,
      "resample_rows_from",
      fix="a population of site values",
    )
  key = key_from_seed(p["seed"], ctx, "resample_rows_from")
  idx = jax.random.randint(key, (x.shape[axis],), 0, src.shape[0])
  rows = jnp.moveaxis(src[idx], 0, axis)
  return _sg(donor_value(rows, x, ctx, "resample_rows_from", "source"))


@api_boundary
def resample_rows_from(source, *, seed=None, axis=0) -> Edit:
  """Writes rows drawn from ``source`` along ``axis``, detached (cuts).

  Row ``i`` of the site is row ``jax.random.randint(key(seed), (n,), 0, N)[i]`` of
  the source (a Population or an array with N rows).
  """
  return _make("resample_rows_from", {"source": source, "seed": seed}, keeps=False, axis=axis)


register("resample_rows_from", _resample_rows, resample_rows_from, under_subspace="source")


# --------------------------------------------------------------------------
# What a door accepts as an edit, and keep_grad.


def as_edit(obj) -> Edit:
  """Normalises what a door accepts as an edit: a verb, a decision, a callable, an array."""
  if isinstance(obj, Edit):
    return obj
  if isinstance(obj, InterventionDecision):
    edit = as_edit(obj.action)
    return dataclasses.replace(edit, keep_grad=edit.keep_grad or obj.keep_grad)
  if isinstance(obj, (jax.Array, np.ndarray, int, float)):
    return replace_with(obj)
  if callable(obj):
    return hook(obj)
  raise InvalidArgumentError(
    f"expected an edit (a jl verb, a callable or an array), got {type(obj).__name__}",
    code="invalid_edit",
    fix="jl.when(site, jl.scale(0.5))",
  )


@api_boundary
def keep_grad(edit) -> Edit:
  """Returns the same edit with a fire-time check that it keeps the gradient.

  When the edit fires, jaxlens checks structurally (on the jaxpr of its
  forward-mode derivative) that the value it writes depends differentiably on
  the site value, and raises :class:`GradientContractError` with code
  ``edit_detached_from_graph`` if not, ``site_has_no_graph`` if the site value
  does not depend on the door's float inputs, and ``grad_disabled`` inside a
  ``jaxlens.no_grad()`` scope.
  """
  return dataclasses.replace(as_edit(edit), keep_grad=True)
