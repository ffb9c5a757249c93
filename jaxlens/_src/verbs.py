"""Verbs: edits of a site value, each a small immutable pytree of pure functions.

An :class:`Edit` is what a verb factory (``jl.scale(2.0)``, ``jl.patch_from(t)``)
returns. Its array arguments (factors, directions, donors, seeds) are pytree
leaves, so an edit can be passed into ``jax.jit`` as an argument and a new value
of the same shape does not recompile. Its implementation is a module-level
function of ``(x, params, static, ctx)``.

Keeping verbs compute from the site value and keep its gradient; cutting verbs
write a value computed elsewhere, through ``jax.lax.stop_gradient``, even when the
donor itself depends on the parameters being differentiated.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxlens._src import dependence
from jaxlens._src.errors import (GradientContractError, InvalidArgumentError,
                                 ShapeError)

_sg = jax.lax.stop_gradient


class _ByIdentity:
  """Wraps an object for a pytree's static data: equal only to itself."""

  __slots__ = ("obj",)

  def __init__(self, obj):
    self.obj = obj

  def __eq__(self, other):
    return isinstance(other, _ByIdentity) and other.obj is self.obj

  def __hash__(self):
    return id(self.obj)

  def __repr__(self):
    return getattr(self.obj, "__name__", type(self.obj).__name__)


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True)
class Edit:
  """One edit of a site value.

  Attributes:
    name: the verb's name (``"scale"``).
    impl: ``impl(x, params, static, ctx) -> new value``.
    params: a pytree of the verb's array arguments (leaves traced under jit).
    static: a tuple of ``(key, value)`` hashable options.
    keeps: whether the verb keeps the gradient through what it writes.
    keep_grad: whether the door checks, when it fires, that it does.
  """

  name: str
  impl: Callable[..., Any]
  params: Any
  static: tuple = ()
  keeps: bool = True
  keep_grad: bool = False

  def tree_flatten(self):
    return (self.params,), (self.name, self.impl, self.static, self.keeps, self.keep_grad)

  @classmethod
  def tree_unflatten(cls, aux, children):
    name, impl, static, keeps, keep_grad = aux
    return cls(name, impl, children[0], static, keeps, keep_grad)

  @property
  def options(self) -> dict:
    return dict(self.static)

  def __call__(self, x, ctx=None):
    """Applies the edit to an array outside any door (for tests and composition)."""
    return fire(self, x, ctx if ctx is not None else FireContext.standalone())

  def __repr__(self) -> str:
    opts = ", ".join(f"{k}={v!r}" for k, v in self.static if v is not None)
    text = f"jl.{self.name}({opts})"
    return f"keep_grad({text})" if self.keep_grad else text

  def __treescope_repr__(self, path, subtree_renderer):
    from jaxlens import views  # treescope's notebook view
    return views.render(self, path, subtree_renderer)


@dataclasses.dataclass
class FireContext:
  """What a verb may know of the site it edits, passed as ``hook=`` to callables.

  Attributes:
    label: the site label (``"layers_0"``).
    path: the module path.
    module_type: the module class name.
    site_values: the values of the sites that already ran in this call, by label.
    grad_disabled: whether a ``jaxlens.no_grad()`` scope is active.
  """

  label: str
  path: str = ""
  module_type: str = ""
  site_values: dict = dataclasses.field(default_factory=dict)
  grad_disabled: bool = False
  checks: bool = True
  asked_keep_grad: bool = False
  # Inside a scan body: the iteration index (a traced int) and, when the edit
  # selects a single layer, that layer (a Python int).
  layer: Any = None
  static_layer: int | None = None

  @classmethod
  def standalone(cls) -> "FireContext":
    return cls(label="<standalone>")


# --------------------------------------------------------------------------
# Argument checks shared by the verbs.


def _fail_shape(msg, ctx, verb, fix=None, code="shape_mismatch", **fields):
  raise ShapeError(f"{verb}: {msg}", code=code, site=ctx.label, fix=fix, verb=verb, **fields)


def _param(value, x, ctx, verb, name):
  """An array argument used as a parameter of a function of x, cast to x's dtype."""
  arr = jnp.asarray(value)
  if jnp.issubdtype(x.dtype, jnp.inexact):
    if not jnp.issubdtype(arr.dtype, jnp.inexact) and not jnp.issubdtype(arr.dtype, jnp.integer):
      _fail_shape(f"{name} must be a float array, got dtype {arr.dtype}", ctx, verb,
                  code="dtype_mismatch", fix=f"pass {name} as jnp.asarray({name}, {x.dtype})")
    return arr.astype(x.dtype)
  if not jnp.issubdtype(arr.dtype, x.dtype) and not isinstance(value, (int, bool)):
    _fail_shape(f"{name} has dtype {arr.dtype} but the site is {x.dtype}", ctx, verb,
                code="dtype_mismatch", fix=f"pass {name} with dtype {x.dtype}")
  return arr.astype(x.dtype)


def place_like(y, x):
  """Places ``y`` with the sharding of the site value ``x``.

  Concrete arrays are moved with ``device_put``; inside ``jit`` on an explicit mesh the
  value is resharded to the site's type. Elsewhere (no mesh, or an Auto mesh under jit,
  where XLA chooses) ``y`` is returned as it is.
  """
  if not isinstance(x, jax.core.Tracer):
    sharding = getattr(x, "sharding", None)
    if sharding is not None and not isinstance(y, jax.core.Tracer) and \
        getattr(y, "sharding", None) != sharding:
      return jax.device_put(y, sharding)
    return y
  sharding = getattr(jax.typeof(x), "sharding", None)
  mesh = getattr(sharding, "mesh", None)
  explicit = mesh is not None and any(
      t == jax.sharding.AxisType.Explicit for t in getattr(mesh, "axis_types", ()))
  if explicit and getattr(jax.typeof(y), "sharding", None) != sharding:
    return jax.sharding.reshard(y, sharding)
  return y


def _donor(value, x, ctx, verb, name, *, broadcast=False):
  """A value written verbatim into the site: same dtype, shape equal (or broadcast)."""
  weak = isinstance(value, (int, float, bool))
  arr = jnp.asarray(value)
  if not weak and arr.dtype != x.dtype:
    _fail_shape(f"{name} has dtype {arr.dtype} but the site value is {x.dtype}", ctx, verb,
                code="dtype_mismatch", fix=f"{name}.astype(jnp.{x.dtype})",
                expected=str(x.dtype), received=str(arr.dtype))
  if broadcast:
    try:
      ok = jnp.broadcast_shapes(arr.shape, x.shape) == x.shape
    except ValueError:
      ok = False
  else:
    ok = arr.shape == x.shape
  if not ok:
    want = f"shape {x.shape}" + (" (or one that broadcasts to it)" if broadcast else "")
    _fail_shape(f"{name} has shape {arr.shape}, expected {want}", ctx, verb,
                fix=f"pass a {name} of shape {x.shape}", expected=str(x.shape),
                received=str(arr.shape))
  return place_like(jnp.broadcast_to(arr.astype(x.dtype), x.shape), x)


def _resolve_axis(x, direction, feature_axis, ctx, verb):
  """The feature axis of x along which a 1-D direction lies."""
  d = jnp.asarray(direction)
  if d.ndim != 1:
    _fail_shape(f"direction must be 1-D, got shape {d.shape}", ctx, verb,
                fix="pass a 1-D direction (use jl.add(delta) for a full-shape delta)")
  n = d.shape[0]
  if feature_axis is not None:
    axis = feature_axis + x.ndim if feature_axis < 0 else feature_axis
    if not 0 <= axis < x.ndim or x.shape[axis] != n:
      _fail_shape(f"feature_axis={feature_axis} does not have size {n} in site shape {x.shape}",
                  ctx, verb, fix=f"a feature_axis whose size is {n}")
    return axis
  axes = [a for a in range(x.ndim) if x.shape[a] == n]
  if not axes:
    _fail_shape(f"direction of length {n} matches no axis of site shape {x.shape}", ctx, verb,
                fix="pass a direction whose length is the site's feature size")
  if len(axes) > 1:
    raise InvalidArgumentError(
        f"{verb}: a direction of length {n} fits axes {axes} of site shape {x.shape}; "
        "which is the feature axis is ambiguous",
        code="feature_axis_ambiguous", site=ctx.label, verb=verb, candidates=axes,
        fix=f"jl.{verb}(direction, ..., feature_axis={axes[-1] - x.ndim})")
  return axes[0]


def _along(vec, axis, ndim):
  shape = [1] * ndim
  shape[axis] = vec.shape[0]
  return vec.reshape(shape)


def _key(seed, ctx, verb):
  if seed is None:
    raise InvalidArgumentError(
        f"{verb} draws random numbers and needs an explicit seed", code="seed_required",
        site=ctx.label, verb=verb, fix=f"jl.{verb}(..., seed=0)")
  return jax.random.key(jnp.asarray(seed, jnp.uint32))


def source_values(source, ctx, verb):
  """The array behind a source: an array, a Population or a donor Trace."""
  from jaxlens._src.tracing import Trace  # a Trace is a source; tracing imports verbs.
  if isinstance(source, Trace):
    return source.value_for_donor(ctx.label, verb, layer=ctx.layer,
                                  static_layer=ctx.static_layer)
  if isinstance(source, Population):
    return source.values
  if isinstance(source, (jax.Array, np.ndarray, float, int)):
    return jnp.asarray(source)
  raise InvalidArgumentError(
      f"{verb}: a source must be an array, a jl.Population or a jl.Trace, got "
      f"{type(source).__name__}", code="invalid_source", site=ctx.label, verb=verb,
      fix=f"jl.{verb}(source=jl.population(trace, site))")


@jax.tree_util.register_pytree_node_class
class Population:
  """Reference activations of one site, gathered over other inputs.

  ``values`` stacks examples along axis 0 (for a site of shape ``(B, ...)``, traces
  over k batches give ``(k*B, ...)``). Build one with :func:`population`.
  """

  def __init__(self, values):
    self.values = values

  def tree_flatten(self):
    return (self.values,), None

  @classmethod
  def tree_unflatten(cls, aux, children):
    return cls(children[0])

  def __repr__(self):
    return f"Population(shape={jnp.shape(self.values)})"


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
  from jaxlens._src.tracing import Trace
  parts = []
  for s in sources:
    if isinstance(s, Trace):
      if site is None:
        raise InvalidArgumentError("population of traces needs site=", code="invalid_source",
                                   fix='jl.population(trace, site=jl.module("layers_0"))')
      parts.append(s[site].out)
    else:
      parts.append(jnp.asarray(s))
  if not parts:
    raise InvalidArgumentError("population needs at least one source", code="invalid_source",
                               fix="jl.population(trace_a, trace_b, site=...)")
  return Population(jnp.concatenate(parts, axis=0))


# --------------------------------------------------------------------------
# Keeping verbs.


def _make(name, impl, params, keeps=True, **static):
  return Edit(name, impl, params, tuple(sorted(static.items())), keeps)


def _scale(x, p, s, ctx):
  return x * _param(p["factor"], x, ctx, "scale", "factor")


def scale(factor) -> Edit:
  """Multiplies the site value by ``factor`` (keeps the gradient).

  ``keep_grad(jl.scale(0.0))`` writes zeros with a zero gradient: the graph-keeping
  spelling of a zero ablation.
  """
  return _make("scale", _scale, {"factor": factor})


def _clamp(x, p, s, ctx):
  lo = None if p["min"] is None else _param(p["min"], x, ctx, "clamp", "min")
  hi = None if p["max"] is None else _param(p["max"], x, ctx, "clamp", "max")
  return jnp.clip(x, lo, hi)


def clamp(*, min=None, max=None) -> Edit:  # noqa: A002 (the specification's spelling)
  """Clips the site value to ``[min, max]`` (keeps the gradient inside the range)."""
  if min is None and max is None:
    raise InvalidArgumentError("clamp needs min= or max=", code="invalid_argument",
                               fix="jl.clamp(min=-1.0, max=1.0)")
  return _make("clamp", _clamp, {"min": min, "max": max})


def _add_noise(x, p, s, ctx):
  key = _key(p["seed"], ctx, "add_noise")
  noise = jax.random.normal(key, x.shape, x.dtype)
  return x + _param(p["std"], x, ctx, "add_noise", "std") * noise


def add_noise(std, *, seed=None) -> Edit:
  """Adds Gaussian noise ``std * normal(key(seed), x.shape)`` (keeps the gradient).

  The draw is ``jax.random.normal(jax.random.key(seed), x.shape, x.dtype)``: the
  same on every door and with or without ``jit``.
  """
  return _make("add_noise", _add_noise, {"std": std, "seed": seed})


def _steer(x, p, s, ctx):
  axis = _resolve_axis(x, p["direction"], s["feature_axis"], ctx, "steer")
  d = _along(_param(p["direction"], x, ctx, "steer", "direction"), axis, x.ndim)
  return x + _param(p["magnitude"], x, ctx, "steer", "magnitude") * d


def steer(direction, magnitude=1.0, *, feature_axis=None) -> Edit:
  """Adds ``magnitude * direction`` along the feature axis (keeps the gradient).

  Args:
    direction: a 1-D array; it is not normalised.
    magnitude: a scalar.
    feature_axis: the axis of the site value the direction lies along; needed
      only when several axes have the direction's length.
  """
  return _make("steer", _steer, {"direction": direction, "magnitude": magnitude},
               feature_axis=feature_axis)


def _add(x, p, s, ctx):
  delta = _param(p["delta"], x, ctx, "add", "delta")
  try:
    ok = jnp.broadcast_shapes(delta.shape, x.shape) == x.shape
  except ValueError:
    ok = False
  if not ok:
    _fail_shape(f"delta of shape {delta.shape} does not broadcast to site shape {x.shape}",
                ctx, "add", fix=f"a delta of shape {x.shape}")
  return x + delta


def add(delta) -> Edit:
  """Adds ``delta`` (broadcast to the site's shape); the gradient reaches both."""
  return _make("add", _add, {"delta": delta})


def _unit(p, x, ctx, verb, feature_axis):
  axis = _resolve_axis(x, p["direction"], feature_axis, ctx, verb)
  d = _param(p["direction"], x, ctx, verb, "direction")
  return _along(d / jnp.linalg.norm(d), axis, x.ndim), axis


def _project_onto(x, p, s, ctx):
  u, axis = _unit(p, x, ctx, "project_onto", s["feature_axis"])
  return jnp.sum(x * u, axis=axis, keepdims=True) * u


def project_onto(direction, *, feature_axis=None) -> Edit:
  """Keeps only the component along ``direction`` (keeps the gradient)."""
  return _make("project_onto", _project_onto, {"direction": direction},
               feature_axis=feature_axis)


def _project_out(x, p, s, ctx):
  u, axis = _unit(p, x, ctx, "project_out", s["feature_axis"])
  return x - jnp.sum(x * u, axis=axis, keepdims=True) * u


def project_out(direction, *, feature_axis=None) -> Edit:
  """Removes the component along ``direction`` (keeps the gradient)."""
  return _make("project_out", _project_out, {"direction": direction},
               feature_axis=feature_axis)


def _axes(dim):
  return dim if dim is None or isinstance(dim, tuple) else (dim,)


def _mean_ablate(x, p, s, ctx):
  dim = s["dim"]
  if p["source"] is None:
    return jnp.broadcast_to(jnp.mean(x, axis=_axes(dim), keepdims=True), x.shape)
  src = _sg(source_values(p["source"], ctx, "mean_ablate"))
  axes = (0,) if dim is None else _axes(dim)
  mean = jnp.mean(src, axis=axes, keepdims=True)
  return _donor(mean, x, ctx, "mean_ablate", "source mean", broadcast=True)


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
  return Edit("mean_ablate", _mean_ablate, {"source": source},
              (("dim", dim),), keeps=source is None)


def _scramble(x, p, s, ctx):
  key = _key(p["seed"], ctx, "scramble_elements")
  perm = jax.random.permutation(key, x.size)
  if p["source"] is None:
    return x.reshape(-1)[perm].reshape(x.shape)
  src = _sg(source_values(p["source"], ctx, "scramble_elements"))
  if src.size != x.size:
    _fail_shape(f"source has {src.size} elements, the site {x.size}", ctx, "scramble_elements",
                fix=f"a source of shape {x.shape}")
  src = _donor(src.reshape(x.shape), x, ctx, "scramble_elements", "source")
  return src.reshape(-1)[perm].reshape(x.shape)


def scramble_elements(*, seed=None, source=None) -> Edit:
  """Permutes elements with ``jax.random.permutation(key(seed), x.size)``.

  Without ``source`` it permutes the site value's own elements (keeps); with a
  ``source`` of the site's size it writes the source's elements (cuts).
  """
  return Edit("scramble_elements", _scramble, {"seed": seed, "source": source}, (),
              keeps=source is None)


def _splice(x, p, s, ctx):
  module = s["module"].obj
  if p["variables"] is not None:
    return module.apply(p["variables"], x)
  return module(x)


def splice_module(module, variables=None) -> Edit:
  """Replaces the site value by ``module(x)`` (keeps the gradient through x).

  Args:
    module: a callable of the site value, a bound Flax module, or an unbound one
      with ``variables``.
    variables: the unbound module's variables (a pytree leaf: trainable).
  """
  if not callable(module) and variables is None:
    raise InvalidArgumentError(f"splice_module needs a callable, got {type(module).__name__}",
                               code="invalid_argument", fix="jl.splice_module(jnp.tanh)")
  return _make("splice_module", _splice, {"variables": variables},
               module=_ByIdentity(module))


def _permute_batch(x, p, s, ctx):
  key = _key(p["seed"], ctx, "permute_batch")
  axis = s["axis"]
  return jnp.take(x, jax.random.permutation(key, x.shape[axis]), axis=axis)


def permute_batch(*, seed=None, axis=0) -> Edit:
  """Permutes rows along ``axis`` with ``jax.random.permutation(key(seed), n)``."""
  return _make("permute_batch", _permute_batch, {"seed": seed}, axis=axis)


def _set_direction_mean(x, p, s, ctx):
  u, axis = _unit(p, x, ctx, "set_direction_mean", s["feature_axis"])
  src = p["source"]
  if isinstance(src, (int, float)) or (hasattr(src, "ndim") and jnp.ndim(src) == 0):
    mean_coef = _param(src, x, ctx, "set_direction_mean", "source")
  else:
    values = _sg(source_values(src, ctx, "set_direction_mean")).astype(x.dtype)
    if values.ndim != x.ndim or values.shape[axis] != x.shape[axis]:
      _fail_shape(f"source of shape {values.shape} does not share the site's feature axis "
                  f"{axis} (site shape {x.shape})", ctx, "set_direction_mean",
                  fix="a population of site values")
    mean_coef = jnp.mean(jnp.sum(values * u, axis=axis))
  coef = jnp.sum(x * u, axis=axis, keepdims=True)
  return x - coef * u + _sg(mean_coef) * u


def set_direction_mean(direction, source, *, feature_axis=None) -> Edit:
  """Sets the coordinate along ``direction`` to its mean over ``source``.

  Writes ``x - <x,u>u + m u`` where ``u`` is the unit direction and ``m`` the mean of
  ``<s,u>`` over the source (an array, a Population, or the scalar mean itself).
  The gradient flows through the orthogonal part (keeps).
  """
  return _make("set_direction_mean", _set_direction_mean,
               {"direction": direction, "source": source}, feature_axis=feature_axis)


def _compose(x, p, s, ctx):
  for edit in p["edits"]:
    x = fire(edit, x, ctx)
  return x


def compose(*edits) -> Edit:
  """Applies edits left to right; keeps the gradient when every one keeps it."""
  if not edits:
    raise InvalidArgumentError("compose needs at least one edit", code="invalid_argument",
                               fix="jl.intervention.compose(jl.scale(0.0), jl.add(value))")
  parts = tuple(as_edit(e) for e in edits)
  return Edit("compose", _compose, {"edits": parts}, (), keeps=all(e.keeps for e in parts))


def _hook(x, p, s, ctx):
  fn = s["fn"].obj
  if s["takes_hook"]:
    return fn(x, hook=ctx)
  return fn(x)


def takes_hook_keyword(fn: Callable) -> bool:
  """Whether ``fn`` accepts a ``hook=`` keyword (by name or through ``**kwargs``)."""
  try:
    params = inspect.signature(fn).parameters
  except (TypeError, ValueError):
    return False
  return "hook" in params or any(q.kind is inspect.Parameter.VAR_KEYWORD for q in params.values())


def hook(fn: Callable) -> Edit:
  """Wraps a callable ``fn(x)`` or ``fn(x, *, hook)`` as an edit.

  It keeps the gradient when it computes from its input. It may return an
  :class:`InterventionDecision` to ask for the keep_grad check.
  """
  if isinstance(fn, Edit):
    return fn
  if not callable(fn):
    raise InvalidArgumentError(f"a hook must be callable, got {type(fn).__name__}",
                               code="invalid_argument", fix="jl.when(site, lambda x: 2 * x)")
  takes_hook = takes_hook_keyword(fn)
  return _make("hook", _hook, {}, fn=_ByIdentity(fn), takes_hook=takes_hook)


def _at_positions(x, p, s, ctx):
  axis = s["axis"]
  axis = axis + x.ndim if axis < 0 else axis
  if not 0 <= axis < x.ndim:
    _fail_shape(f"axis={s['axis']} is out of range for a site of shape {x.shape}", ctx,
                "at_positions", fix="at_positions(positions, edit, axis=1)")
  host = None if isinstance(p["positions"], jax.core.Tracer) else np.asarray(p["positions"])
  positions = jnp.asarray(p["positions"])
  if not jnp.issubdtype(positions.dtype, jnp.integer):
    _fail_shape(f"positions must be integers, got dtype {positions.dtype}", ctx, "at_positions",
                code="dtype_mismatch", fix="at_positions(jnp.array([0, 3]), edit)")
  n = x.shape[axis]
  if host is not None and host.size and (host.max() >= n or host.min() < -n):
    raise InvalidArgumentError(
        f"at_positions: positions {host.tolist()} out of range for axis {axis} of size {n}",
        code="index_out_of_range", site=ctx.label, fix=f"positions in [0, {n})")
  mask = jnp.zeros((n,), bool).at[positions % n].set(True)
  shape = [1] * x.ndim
  shape[axis] = n
  edited = fire(p["edit"], x, ctx)
  return jnp.where(mask.reshape(shape), edited, x)


def at_positions(positions, edit, *, axis=1) -> Edit:
  """Applies ``edit`` at the given sequence positions only.

  The edit sees the whole site value; its result is written at ``positions``
  along ``axis`` (default 1, the sequence axis of a ``(batch, seq, features)``
  site) and the other positions keep the site value, with its gradient. It keeps
  the gradient through the edited positions when the inner verb does.
  ``positions`` is a leaf: ``jax.vmap`` over positions sweeps them in one call.
  """
  inner = as_edit(edit)
  return Edit("at_positions", _at_positions, {"positions": positions, "edit": inner},
              (("axis", axis),), keeps=inner.keeps)


# --------------------------------------------------------------------------
# Cutting verbs.


def _zero_ablate(x, p, s, ctx):
  return jnp.zeros_like(x)


def zero_ablate() -> Edit:
  """Writes zeros (cuts: the zeros do not depend on the site value)."""
  return _make("zero_ablate", _zero_ablate, {}, keeps=False)


def _replace_with(x, p, s, ctx):
  return _sg(_donor(p["value"], x, ctx, "replace_with", "value", broadcast=True))


def replace_with(value) -> Edit:
  """Writes ``value`` (broadcast to the site's shape), detached (cuts)."""
  return _make("replace_with", _replace_with, {"value": value}, keeps=False)


def _swap_with(x, p, s, ctx):
  other = s["site"]
  if other is not None:
    from jaxlens._src.sites import as_selector
    selector = as_selector(other)
    hits = [lbl for lbl, info_val in ctx.site_values.items() if selector.matches(info_val[0])]
    if len(hits) != 1:
      raise InvalidArgumentError(
          f"swap_with({other!r}) needs exactly one site that already ran before "
          f"{ctx.label!r}; found {hits or 'none'}", code="swap_source_unavailable",
          site=ctx.label, fix="swap with a site computed earlier in the same call, or pass an array",
          candidates=list(ctx.site_values))
    value = ctx.site_values[hits[0]][1]
  else:
    value = source_values(p["value"], ctx, "swap_with")
  return _sg(_donor(value, x, ctx, "swap_with", "other"))


def swap_with(other) -> Edit:
  """Writes another value of the site's shape, detached (cuts).

  Args:
    other: an array, a donor Trace, or a site (a selector or a label) that ran
      earlier in the same call, whose value is taken.
  """
  from jaxlens._src.sites import Site
  if isinstance(other, (Site, str)):
    return Edit("swap_with", _swap_with, {"value": None}, (("site", other),), keeps=False)
  return Edit("swap_with", _swap_with, {"value": other}, (("site", None),), keeps=False)


def _patch_from(x, p, s, ctx):
  return _sg(_donor(_sg(source_values(p["source"], ctx, "patch_from")), x, ctx, "patch_from",
                    "donor"))


def patch_from(source) -> Edit:
  """Writes the donor's value at the same site, detached by design (cuts).

  Args:
    source: a Trace of another run (its saved value at this site is taken) or an
      array of the site's shape.
  """
  return _make("patch_from", _patch_from, {"source": source}, keeps=False)


def _resample_rows(x, p, s, ctx):
  axis = s["axis"]
  src = _sg(source_values(p["source"], ctx, "resample_rows_from"))
  src = jnp.moveaxis(src, axis, 0)
  want = tuple(np.delete(np.array(x.shape), axis))
  if src.ndim != x.ndim or tuple(src.shape[1:]) != want:
    _fail_shape(f"source rows of shape {tuple(src.shape[1:])} do not match the site's rows "
                f"{want}", ctx, "resample_rows_from", fix="a population of site values")
  key = _key(p["seed"], ctx, "resample_rows_from")
  idx = jax.random.randint(key, (x.shape[axis],), 0, src.shape[0])
  rows = jnp.moveaxis(src[idx], 0, axis)
  return _sg(_donor(rows, x, ctx, "resample_rows_from", "source"))


def resample_rows_from(source, *, seed=None, axis=0) -> Edit:
  """Writes rows drawn from ``source`` along ``axis``, detached (cuts).

  Row ``i`` of the site is row ``jax.random.randint(key(seed), (n,), 0, N)[i]`` of
  the source (a Population or an array with N rows).
  """
  return _make("resample_rows_from", _resample_rows, {"source": source, "seed": seed},
               keeps=False, axis=axis)


# --------------------------------------------------------------------------
# keep_grad, decisions, options, and firing.


_KEEPING_SPELLINGS = {
    "zero_ablate": "keep_grad(jl.scale(0.0))",
    "replace_with": "keep_grad(jl.intervention.compose(jl.scale(0.0), jl.add(value)))",
    "patch_from": ("jl.when(jl.subspace(site, basis, origin=...), jl.patch_from(source)) keeps "
                   "the complement; or keep_grad(jl.intervention.compose(jl.scale(0.0), "
                   "jl.add(donor)))"),
}
_DEFAULT_SPELLING = "keep_grad(jl.intervention.compose(jl.scale(0.0), jl.add(value)))"


@dataclasses.dataclass(frozen=True)
class InterventionDecision:
  """An edit (or, returned by a hook, a value) with the keep_grad choice.

  ``InterventionDecision(edit, keep_grad=True)`` runs the same fire-time check as
  ``keep_grad(edit)``; ``keep_grad=False`` (the default) checks nothing.
  """

  action: Any = None
  keep_grad: bool = False


@dataclasses.dataclass(frozen=True)
class InterventionOptions:
  """How ``Trace.do`` runs an edit.

  Attributes:
    engine: ``"auto"`` (replay without ``model=``, rerun with it), ``"replay"``,
      ``"rerun"`` or ``"set_only"`` (stage; ``Trace.run`` executes).
    differentiable: replay with the frontier re-leafed (gradients stop there).
  """

  engine: str = "auto"
  differentiable: bool = False

  def __post_init__(self):
    if self.engine not in ("auto", "replay", "rerun", "set_only"):
      raise InvalidArgumentError(f"unknown engine {self.engine!r}", code="invalid_argument",
                                 fix='InterventionOptions(engine="set_only")')


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
      code="invalid_edit", fix="jl.when(site, jl.scale(0.5))")


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


def _unwrap(result):
  if isinstance(result, InterventionDecision):
    return result.action, result.keep_grad
  return result, False


def _is_array(x) -> bool:
  return isinstance(x, (jax.Array, np.ndarray)) or hasattr(x, "aval")


def fire(edit: Edit, x, ctx: FireContext):
  """Applies ``edit`` to the site value ``x``, with the result and keep_grad checks."""
  if not _is_array(x):
    raise InvalidArgumentError(
        f"the site value is a {type(x).__name__}, not an array; edits apply to array sites",
        code="site_not_array", site=ctx.label,
        fix="select a submodule whose call returns one array")
  if edit.keep_grad and ctx.checks:
    check_keep_grad_preconditions(x, ctx)
  y, asked = _unwrap(edit.impl(x, edit.params, edit.options, ctx))
  y = _check_result(edit, x, y, ctx)
  ctx.asked_keep_grad |= asked
  if ctx.checks and (edit.keep_grad or asked):
    if asked:
      check_keep_grad_preconditions(x, ctx)
    if not writes_from_input(edit, x, ctx):
      spelling = _KEEPING_SPELLINGS.get(edit.name, _DEFAULT_SPELLING)
      raise GradientContractError(
          f"keep_grad: {edit!r} writes values that do not depend on the site value, so no "
          "gradient reaches the parameters upstream of it", code="edit_detached_from_graph",
          site=ctx.label, fix=spelling, verb=edit.name)
  return y


def check_keep_grad_preconditions(x, ctx):
  if ctx.grad_disabled:
    raise GradientContractError(
        "keep_grad inside a jaxlens.no_grad() scope: doors stop every gradient there",
        code="grad_disabled", site=ctx.label, fix="call the door outside jaxlens.no_grad()")
  if not jnp.issubdtype(x.dtype, jnp.inexact):
    raise GradientContractError(
        f"keep_grad on a site of dtype {x.dtype}: an integer or boolean value has no gradient",
        code="site_not_float", site=ctx.label, fix="drop keep_grad for this site")


def _check_result(edit, x, y, ctx):
  if not _is_array(y):
    raise ShapeError(f"{edit!r} returned a {type(y).__name__}, not an array",
                     code="hook_shape_mismatch" if edit.name == "hook" else "shape_mismatch",
                     site=ctx.label, fix=f"return an array of shape {x.shape}")
  if jnp.shape(y) != x.shape:
    code = "hook_shape_mismatch" if edit.name == "hook" else "shape_mismatch"
    raise ShapeError(f"{edit!r} returned shape {jnp.shape(y)} for a site of shape {x.shape}",
                     code=code, site=ctx.label, fix=f"return an array of shape {x.shape}",
                     expected=str(x.shape), received=str(jnp.shape(y)))
  if y.dtype != x.dtype:
    code = "hook_dtype_mismatch" if edit.name == "hook" else "dtype_mismatch"
    raise ShapeError(f"{edit!r} returned dtype {y.dtype} for a site of dtype {x.dtype}",
                     code=code, site=ctx.label, fix=f"return an array of dtype {x.dtype}",
                     expected=str(x.dtype), received=str(y.dtype))
  return y


def writes_from_input(edit: Edit, x, ctx) -> bool:
  """Whether the value ``edit`` writes depends differentiably on the site value."""
  quiet = dataclasses.replace(edit, keep_grad=False)

  def written(x_):
    return _unwrap(quiet.impl(x_, quiet.params, quiet.options, ctx))[0]

  table, _ = dependence.outputs_depend_on_inputs(written, x)
  return any(row[0] for row in table)
