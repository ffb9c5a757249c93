"""The torch reference of the gradient contract: every verb and door, in plain torch.

The reference is what jaxlens is checked against. It is deliberately small and
literal: edits run in ``module.register_forward_hook`` hooks that return the edited
output, and the replay doors re-run the torch modules downstream of the site from
the saved site value (for an ``nn.Sequential`` root, the matrix model). It follows
the specification (``docs/gradient_contract.md``) where the published torchlens
departs from it:

* cutting verbs (``zero_ablate``, ``replace_with``, ``swap_with``, ``patch_from``,
  ``resample_rows_from``, ``mean_ablate(source=)``, ``scramble_elements(source=)``)
  ``.detach()`` what they write, even when the donor carries a graph; keeping verbs
  compute from the site value and keep its graph;
* ``keep_grad(edit)`` checks at fire time: ``grad_disabled`` under ``torch.no_grad()``
  (``torch.is_grad_enabled()`` is False), ``site_has_no_graph`` when the site value
  does not require grad, and ``edit_detached_from_graph`` when the written value
  does not require grad while the site value did;
* differentiable replay re-leafs the frontier (``detach().requires_grad_()``) and
  ``keep_grad`` there warns ``keep_grad_replay_frontier`` once per session;
* random draws come from ``jax.random`` exactly as jaxlens draws them
  (``jax.random.normal(jax.random.key(seed), shape, dtype)``,
  ``jax.random.permutation``, ``jax.random.randint``), so both frameworks write the
  same numbers. A float64 site draws with 64-bit JAX types (as jaxlens, which needs
  ``jax_enable_x64`` for a float64 site); other sites draw under the current JAX
  configuration.

Sites are torch module names as in ``model.named_modules()`` (``"0"``, ``"blocks.1.mlp"``).

Example:
  >>> import torch
  >>> from torch_bridge import reference as ref
  >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
  >>> out = ref.when("0", ref.scale(0.5)).bind(model)(torch.ones(1, 4))
  >>> tuple(out.shape)
  (1, 2)
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import torch

from jaxlens._src.errors import (GradientContractError, InvalidArgumentError, JaxlensWarning,
                                 ShapeError, SiteError)
from jaxlens._src.tracing import SiteValue
from jaxlens._src.verbs import InterventionDecision, InterventionOptions, takes_hook_keyword

__all__ = [
    "Edit", "InterventionDecision", "InterventionOptions", "Population", "Selection", "SiteContext",
    "Spec", "Trace", "add", "add_noise", "as_edit", "at_positions", "clamp", "compose", "fire",
    "hook", "keep_grad", "mean_ablate", "patch_from", "permute_batch", "population",
    "project_onto", "project_out", "replace_with", "reset_warnings", "resample_rows_from",
    "scale", "scramble_elements", "set_affine_coordinates", "set_direction_mean",
    "splice_module", "steer", "subspace", "subspace_patch", "subspace_scale", "subspace_set",
    "subspace_zero", "swap_with", "trace", "units", "when", "zero_ablate",
]


# --------------------------------------------------------------------------
# Edits and the context they fire in.


@dataclasses.dataclass(frozen=True)
class SiteContext:
  """What an edit may know of the site it edits (passed as ``hook=`` to callables).

  Attributes:
    label: the torch module name of the site (``"0"``).
    site_values: the (edited) outputs of the modules that already ran in this call.
  """

  label: str
  site_values: dict = dataclasses.field(default_factory=dict)

  @classmethod
  def standalone(cls) -> "SiteContext":
    return cls(label="<standalone>")


@dataclasses.dataclass(frozen=True)
class Edit:
  """One edit of a torch site value.

  Attributes:
    name: the verb's name, as in jaxlens (``"scale"``).
    fn: ``fn(x, ctx) -> new value`` (or an :class:`InterventionDecision` from a hook).
    keeps: whether the verb keeps the graph through what it writes.
    keep_grad: whether :func:`fire` checks that it does.
    parts: the inner edits of a combinator (``compose``, ``at_positions``, selections).
    data: arguments another edit reads (``set_affine_coordinates``'s ``W`` and ``b``).
  """

  name: str
  fn: Callable[[torch.Tensor, SiteContext], Any]
  keeps: bool = True
  keep_grad: bool = False
  parts: tuple = ()
  data: dict = dataclasses.field(default_factory=dict, compare=False)

  def __call__(self, x: torch.Tensor, ctx: SiteContext | None = None) -> torch.Tensor:
    """Applies the edit to a tensor outside any door."""
    return fire(self, x, ctx if ctx is not None else SiteContext.standalone())

  def __repr__(self) -> str:
    text = f"ref.{self.name}(...)"
    return f"keep_grad({text})" if self.keep_grad else text


def _asks_keep_grad(edit: Edit) -> bool:
  return edit.keep_grad or any(_asks_keep_grad(p) for p in edit.parts)


def _names(edit: Edit):
  yield edit.name
  for part in edit.parts:
    yield from _names(part)


def _check_preconditions(x: torch.Tensor, ctx: SiteContext) -> None:
  if not torch.is_grad_enabled():
    raise GradientContractError(
        "keep_grad with gradients disabled (torch.no_grad()): nothing written carries a graph",
        code="grad_disabled", site=ctx.label, fix="call the door outside torch.no_grad()")
  if not (x.is_floating_point() or x.is_complex()):
    raise GradientContractError(
        f"keep_grad on a site of dtype {x.dtype}: an integer or boolean value has no gradient",
        code="site_not_float", site=ctx.label, fix="drop keep_grad for this site")
  if not x.requires_grad:
    raise GradientContractError(
        "keep_grad: the site value does not require grad, so there is no graph to keep",
        code="site_has_no_graph", site=ctx.label,
        fix="drop keep_grad here, or edit a site downstream of parameters that require grad")


_KEEPING_SPELLINGS = {
    "zero_ablate": "keep_grad(ref.scale(0.0))",
    "replace_with": "keep_grad(ref.compose(ref.scale(0.0), ref.add(value)))",
}
_DEFAULT_SPELLING = "keep_grad(ref.compose(ref.scale(0.0), ref.add(value)))"


def fire(edit: Edit, x: torch.Tensor, ctx: SiteContext) -> torch.Tensor:
  """Applies ``edit`` to the site value ``x``, with the result and keep_grad checks."""
  if not isinstance(x, torch.Tensor):
    raise InvalidArgumentError(
        f"the site value is a {type(x).__name__}, not a tensor; edits apply to tensor sites",
        code="site_not_array", site=ctx.label,
        fix="select a module whose forward returns one tensor")
  if edit.keep_grad:
    _check_preconditions(x, ctx)
  y = edit.fn(x, ctx)
  asked = False
  if isinstance(y, InterventionDecision):
    y, asked = y.action, y.keep_grad
    if asked:
      _check_preconditions(x, ctx)
  _check_result(edit, x, y, ctx)
  if (edit.keep_grad or asked) and x.requires_grad and not y.requires_grad:
    raise GradientContractError(
        f"keep_grad: {edit!r} writes values that carry no autograd graph while the site value "
        "had one, so no gradient reaches the parameters upstream of it",
        code="edit_detached_from_graph", site=ctx.label,
        fix=_KEEPING_SPELLINGS.get(edit.name, _DEFAULT_SPELLING), verb=edit.name)
  return y


def _check_result(edit: Edit, x: torch.Tensor, y: Any, ctx: SiteContext) -> None:
  prefix = "hook_" if edit.name == "hook" else ""
  if not isinstance(y, torch.Tensor):
    raise ShapeError(f"{edit!r} returned a {type(y).__name__}, not a tensor",
                     code=prefix + "shape_mismatch", site=ctx.label,
                     fix=f"return a tensor of shape {tuple(x.shape)}")
  if y.shape != x.shape:
    raise ShapeError(f"{edit!r} returned shape {tuple(y.shape)} for a site of shape "
                     f"{tuple(x.shape)}", code=prefix + "shape_mismatch", site=ctx.label,
                     fix=f"return a tensor of shape {tuple(x.shape)}",
                     expected=str(tuple(x.shape)), received=str(tuple(y.shape)))
  if y.dtype != x.dtype:
    raise ShapeError(f"{edit!r} returned dtype {y.dtype} for a site of dtype {x.dtype}",
                     code=prefix + "dtype_mismatch", site=ctx.label,
                     fix=f"return a tensor of dtype {x.dtype}")


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
      code="invalid_edit", fix='ref.when("0", ref.scale(0.5))')


# --------------------------------------------------------------------------
# Argument helpers.


def _tensor(value, like: torch.Tensor) -> torch.Tensor:
  """``value`` as a tensor on ``like``'s device and dtype (a tensor keeps its graph)."""
  if isinstance(value, torch.Tensor):
    return value.to(device=like.device, dtype=like.dtype)
  return torch.as_tensor(np.array(value), device=like.device).to(like.dtype)


def _fail_shape(msg, ctx, verb, fix, code="shape_mismatch", **fields):
  raise ShapeError(f"{verb}: {msg}", code=code, site=ctx.label, fix=fix, verb=verb, **fields)


def _broadcast(value: torch.Tensor, x: torch.Tensor, ctx, verb, name) -> torch.Tensor:
  try:
    ok = torch.broadcast_shapes(value.shape, x.shape) == x.shape
  except RuntimeError:
    ok = False
  if not ok:
    _fail_shape(f"{name} has shape {tuple(value.shape)}, expected shape {tuple(x.shape)} (or one "
                "that broadcasts to it)", ctx, verb, fix=f"pass a {name} of shape "
                f"{tuple(x.shape)}", expected=str(tuple(x.shape)), received=str(tuple(value.shape)))
  return value.expand(x.shape)


def _donor(value, x, ctx, verb, name, *, broadcast=False) -> torch.Tensor:
  """A value written verbatim into the site, detached: same dtype, shape equal (or broadcast)."""
  weak = isinstance(value, (int, float, bool))
  t = value if isinstance(value, torch.Tensor) else torch.as_tensor(np.array(value))
  if not weak and t.dtype != x.dtype:
    _fail_shape(f"{name} has dtype {t.dtype} but the site value is {x.dtype}", ctx, verb,
                code="dtype_mismatch", fix=f"{name}.to({x.dtype})")
  t = t.detach().to(device=x.device, dtype=x.dtype)
  if broadcast:
    return _broadcast(t, x, ctx, verb, name).clone()
  if t.shape != x.shape:
    _fail_shape(f"{name} has shape {tuple(t.shape)}, expected shape {tuple(x.shape)}", ctx, verb,
                fix=f"pass a {name} of shape {tuple(x.shape)}", expected=str(tuple(x.shape)),
                received=str(tuple(t.shape)))
  return t.clone()


def _resolve_axis(x, direction, feature_axis, ctx, verb) -> int:
  """The axis of ``x`` a 1-D direction lies along (the same rule as jaxlens)."""
  d = direction if isinstance(direction, torch.Tensor) else np.asarray(direction)
  if d.ndim != 1:
    _fail_shape(f"direction must be 1-D, got shape {tuple(d.shape)}", ctx, verb,
                fix="pass a 1-D direction (use ref.add(delta) for a full-shape delta)")
  n = d.shape[0]
  if feature_axis is not None:
    axis = feature_axis + x.ndim if feature_axis < 0 else feature_axis
    if not 0 <= axis < x.ndim or x.shape[axis] != n:
      _fail_shape(f"feature_axis={feature_axis} does not have size {n} in site shape "
                  f"{tuple(x.shape)}", ctx, verb, fix=f"a feature_axis whose size is {n}")
    return axis
  axes = [a for a in range(x.ndim) if x.shape[a] == n]
  if not axes:
    _fail_shape(f"direction of length {n} matches no axis of site shape {tuple(x.shape)}", ctx,
                verb, fix="pass a direction whose length is the site's feature size")
  if len(axes) > 1:
    raise InvalidArgumentError(
        f"{verb}: a direction of length {n} fits axes {axes} of site shape {tuple(x.shape)}; "
        "which is the feature axis is ambiguous", code="feature_axis_ambiguous",
        site=ctx.label, verb=verb, candidates=axes,
        fix=f"ref.{verb}(direction, ..., feature_axis={axes[-1] - x.ndim})")
  return axes[0]


def _along(vec: torch.Tensor, axis: int, ndim: int) -> torch.Tensor:
  shape = [1] * ndim
  shape[axis] = vec.shape[0]
  return vec.reshape(shape)


def _unit(direction, x, ctx, verb, feature_axis):
  axis = _resolve_axis(x, direction, feature_axis, ctx, verb)
  d = _tensor(direction, x)
  return _along(d / torch.linalg.norm(d), axis, x.ndim), axis


# --------------------------------------------------------------------------
# Random draws, taken from jax.random exactly as jaxlens takes them.


def _draw(seed, ctx, verb, x: torch.Tensor, make: Callable[[Any], Any]) -> np.ndarray:
  """``make(key)`` evaluated with jaxlens's key and JAX's 64-bit mode for a float64 site."""
  if seed is None:
    raise InvalidArgumentError(f"{verb} draws random numbers and needs an explicit seed",
                               code="seed_required", site=ctx.label, verb=verb,
                               fix=f"ref.{verb}(..., seed=0)")

  def run():
    key = jax.random.key(jnp.asarray(seed, jnp.uint32))
    return np.array(make(key))  # a writable copy, which torch can wrap

  if x.dtype == torch.float64:
    # jaxlens can only hold a float64 site with jax_enable_x64 on; draw as it does.
    with jax.enable_x64(True):
      return run()
  return run()


def _jax_dtype(dtype: torch.dtype):
  return {torch.float64: jnp.float64, torch.float32: jnp.float32, torch.float16: jnp.float16,
          torch.bfloat16: jnp.bfloat16}[dtype]


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
# Sources: tensors, populations and donor traces.


class Population:
  """Reference activations of one site, stacked along axis 0 (as ``jl.Population``)."""

  def __init__(self, values: torch.Tensor):
    self.values = values

  def __repr__(self) -> str:
    return f"Population(shape={tuple(self.values.shape)})"


def population(*sources, site: str | None = None) -> Population:
  """Concatenates tensors (or traces' values at ``site``) along axis 0."""
  parts = []
  for s in sources:
    if isinstance(s, Trace):
      if site is None:
        raise InvalidArgumentError("population of traces needs site=", code="invalid_source",
                                   fix='ref.population(trace, site="0")')
      parts.append(s[site].out)
    else:
      parts.append(s if isinstance(s, torch.Tensor) else torch.as_tensor(np.array(s)))
  if not parts:
    raise InvalidArgumentError("population needs at least one source", code="invalid_source",
                               fix="ref.population(trace_a, trace_b, site=...)")
  return Population(torch.cat(parts, dim=0))


def _source(source, ctx, verb) -> torch.Tensor:
  """The tensor behind a source, detached: a donor's graph is never followed."""
  if isinstance(source, Trace):
    return source.value_for_donor(ctx.label, verb).detach()
  if isinstance(source, Population):
    return source.values.detach()
  if isinstance(source, torch.Tensor):
    return source.detach()
  if isinstance(source, (np.ndarray, jax.Array, float, int)):
    return torch.as_tensor(np.array(source))
  raise InvalidArgumentError(
      f"{verb}: a source must be a tensor, a ref.Population or a ref.Trace, got "
      f"{type(source).__name__}", code="invalid_source", site=ctx.label, verb=verb,
      fix=f"ref.{verb}(source=ref.population(trace, site=...))")


# --------------------------------------------------------------------------
# Keeping verbs: they compute from the site value.


def scale(factor) -> Edit:
  """``x * factor``."""
  return Edit("scale", lambda x, ctx: x * _tensor(factor, x))


def clamp(*, min=None, max=None) -> Edit:  # noqa: A002 (the specification's spelling)
  """``torch.clamp(x, min, max)``."""
  if min is None and max is None:
    raise InvalidArgumentError("clamp needs min= or max=", code="invalid_argument",
                               fix="ref.clamp(min=-1.0, max=1.0)")

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
      _fail_shape(f"source has {src.numel()} elements, the site {x.numel()}", ctx,
                  "scramble_elements", fix=f"a source of shape {tuple(x.shape)}")
    src = _donor(src.reshape(x.shape), x, ctx, "scramble_elements", "source")
    return src.reshape(-1)[perm].reshape(x.shape)

  return Edit("scramble_elements", fn, keeps=source is None)


def splice_module(module: Callable[[torch.Tensor], torch.Tensor]) -> Edit:
  """``module(x)``: the site value is fed to ``module`` (a torch module or function)."""
  if not callable(module):
    raise InvalidArgumentError(f"splice_module needs a callable, got {type(module).__name__}",
                               code="invalid_argument", fix="ref.splice_module(torch.tanh)")
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
        hasattr(source, "ndim") and not isinstance(source, (Population, Trace)) and
        source.ndim == 0)
    if scalar:
      mean_coef = _tensor(source, x).detach()
    else:
      values = _source(source, ctx, "set_direction_mean").to(x.dtype)
      if values.ndim != x.ndim or values.shape[axis] != x.shape[axis]:
        _fail_shape(f"source of shape {tuple(values.shape)} does not share the site's feature "
                    f"axis {axis} (site shape {tuple(x.shape)})", ctx, "set_direction_mean",
                    fix="a population of site values")
      mean_coef = (values * u).sum(dim=axis).mean()
    coef = (x * u).sum(dim=axis, keepdim=True)
    return x - coef * u + mean_coef.detach() * u

  return Edit("set_direction_mean", fn)


def compose(*edits) -> Edit:
  """Applies edits left to right; keeps the graph when every one keeps it."""
  if not edits:
    raise InvalidArgumentError("compose needs at least one edit", code="invalid_argument",
                               fix="ref.compose(ref.scale(0.0), ref.add(value))")
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
    raise InvalidArgumentError(f"a hook must be callable, got {type(fn).__name__}",
                               code="invalid_argument", fix='ref.when("0", lambda x: 2 * x)')
  takes_hook = takes_hook_keyword(fn)
  return Edit("hook", (lambda x, ctx: fn(x, hook=ctx)) if takes_hook else (lambda x, ctx: fn(x)))


def at_positions(positions, edit, *, axis=1) -> Edit:
  """Writes ``edit``'s result at ``positions`` along ``axis`` only; elsewhere ``x``."""
  inner = as_edit(edit)

  def fn(x, ctx):
    ax = axis + x.ndim if axis < 0 else axis
    if not 0 <= ax < x.ndim:
      _fail_shape(f"axis={axis} is out of range for a site of shape {tuple(x.shape)}", ctx,
                  "at_positions", fix="ref.at_positions(positions, edit, axis=1)")
    pos = torch.as_tensor(np.array(positions), device=x.device)
    if pos.is_floating_point() or pos.dtype == torch.bool:
      _fail_shape(f"positions must be integers, got dtype {pos.dtype}", ctx, "at_positions",
                  code="dtype_mismatch", fix="ref.at_positions([0, 3], edit)")
    n = x.shape[ax]
    if pos.numel() and (int(pos.max()) >= n or int(pos.min()) < -n):
      raise InvalidArgumentError(
          f"at_positions: positions {pos.tolist()} out of range for axis {ax} of size {n}",
          code="index_out_of_range", site=ctx.label, fix=f"positions in [0, {n})")
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
  return Edit("replace_with",
              lambda x, ctx: _donor(value, x, ctx, "replace_with", "value", broadcast=True),
              keeps=False)


def swap_with(other) -> Edit:
  """Another value of the site's shape, detached: a tensor, a donor trace, or a module name
  that ran earlier in the same call."""

  def fn(x, ctx):
    if isinstance(other, str):
      if other not in ctx.site_values:
        raise InvalidArgumentError(
            f"swap_with({other!r}) needs a module that already ran before {ctx.label!r}",
            code="swap_source_unavailable", site=ctx.label, candidates=list(ctx.site_values),
            fix="swap with a module computed earlier in the same call, or pass a tensor")
      value = ctx.site_values[other]
    else:
      value = _source(other, ctx, "swap_with")
    return _donor(value, x, ctx, "swap_with", "other")

  return Edit("swap_with", fn, keeps=False)


def patch_from(source) -> Edit:
  """The donor's value at the same site (a :class:`Trace` of another run, or a tensor),
  detached by design."""
  return Edit("patch_from",
              lambda x, ctx: _donor(_source(source, ctx, "patch_from"), x, ctx, "patch_from",
                                    "donor"), keeps=False)


def resample_rows_from(source, *, seed=None, axis=0) -> Edit:
  """Row ``i`` is row ``jax.random.randint(key(seed), (n,), 0, N)[i]`` of the source, detached."""

  def fn(x, ctx):
    src = _source(source, ctx, "resample_rows_from").movedim(axis, 0)
    want = tuple(s for i, s in enumerate(x.shape) if i != axis % x.ndim)
    if src.ndim != x.ndim or tuple(src.shape[1:]) != want:
      _fail_shape(f"source rows of shape {tuple(src.shape[1:])} do not match the site's rows "
                  f"{want}", ctx, "resample_rows_from", fix="a population of site values")
    idx = _randint(seed, x.shape[axis], src.shape[0], x, ctx, "resample_rows_from")
    return _donor(src[idx].movedim(0, axis), x, ctx, "resample_rows_from", "source")

  return Edit("resample_rows_from", fn, keeps=False)


# --------------------------------------------------------------------------
# Selections: units and subspace (projection semantics), as in jaxlens.


_SOURCE_VERBS = ("replace_with", "swap_with", "patch_from", "resample_rows_from")


@dataclasses.dataclass(frozen=True)
class Selection:
  """A site plus what to select in it; :func:`when` and ``Trace.do`` accept it as a site."""

  site: str | None
  kind: str
  data: dict
  feature_axis: int = -1

  def wrap(self, edit) -> Edit:
    """The edit restricted to the selection; keep_grad asks about the whole written value."""
    inner = as_edit(edit)
    keep, inner = inner.keep_grad, dataclasses.replace(inner, keep_grad=False)
    if self.kind == "units":
      fn = lambda x, ctx: _units(x, ctx, self.data["indices"], self.feature_axis, inner)
    else:
      fn = lambda x, ctx: _subspace(x, ctx, self.data, self.feature_axis, inner)
    return Edit(self.kind, fn, keeps=True, keep_grad=keep, parts=(inner,))


def units(site: str, indices, *, feature_axis: int = -1) -> Selection:
  """Selects elements: a boolean mask, 1-D feature indices, or ``(n, ndim)`` element indices."""
  return Selection(site, "units", {"indices": indices}, feature_axis)


def _units(x, ctx, indices, feature_axis, inner):
  fail = lambda msg, code="shape_mismatch": _fail_shape(msg, ctx, "units", code=code,
                                                        fix='ref.units("0", [0, 2])')
  idx = indices if isinstance(indices, torch.Tensor) else torch.as_tensor(np.array(indices))
  idx = idx.to(x.device)
  if idx.dtype == torch.bool:
    try:
      mask = idx.expand(x.shape)
    except RuntimeError:
      fail(f"a mask of shape {tuple(idx.shape)} does not broadcast to the site's shape "
           f"{tuple(x.shape)}")
  elif not idx.is_floating_point():
    if idx.ndim == 1:
      axis = feature_axis + x.ndim if feature_axis < 0 else feature_axis
      n = x.shape[axis]
      if idx.numel() and (int(idx.max()) >= n or int(idx.min()) < -n):
        fail(f"feature indices {idx.tolist()} out of range for axis {axis} of size {n}",
             "index_out_of_range")
      line = torch.zeros(n, dtype=torch.bool, device=x.device)
      line[idx] = True
      mask = _along(line, axis, x.ndim).expand(x.shape)
    elif idx.ndim == 2 and idx.shape[1] == x.ndim:
      hi = torch.as_tensor(x.shape, device=x.device)
      if idx.numel() and (bool((idx >= hi).any()) or bool((idx < -hi).any())):
        fail(f"element indices out of range for the site's shape {tuple(x.shape)}",
             "index_out_of_range")
      mask = torch.zeros(x.shape, dtype=torch.bool, device=x.device)
      mask[tuple(idx.T)] = True
    else:
      fail(f"integer indices of shape {tuple(idx.shape)}: expected (n,) feature indices or "
           f"(n, {x.ndim}) element indices")
  else:
    fail(f"indices of dtype {idx.dtype}: expected a boolean mask or integer indices",
         "dtype_mismatch")
  if not bool(mask.any()):
    raise InvalidArgumentError("units: the selection is empty", code="empty_selection",
                               site=ctx.label, fix="select at least one element")
  if "permute_batch" in tuple(_names(inner)):
    if not bool((mask == mask.narrow(0, 0, 1)).all()):
      raise InvalidArgumentError(
          f"units: {inner!r} moves whole rows, so it needs the same selection in every row",
          code="mask_not_row_equivariant", site=ctx.label,
          fix="select feature indices (a 1-D integer array) instead of a per-row mask")
  return torch.where(mask, fire(inner, x, ctx), x)


def subspace(site: str, basis, origin=None, *, feature_axis: int = -1) -> Selection:
  """Selects ``span(basis)`` along the feature axis: ``x = o + B c + r``; verbs act on ``c``."""
  return Selection(site, "subspace", {"basis": basis, "origin": origin}, feature_axis)


def _is_source(edit: Edit) -> bool:
  return edit.name in _SOURCE_VERBS or (edit.name in ("mean_ablate", "scramble_elements")
                                        and not edit.keeps)


def _subspace(x, ctx, data, feature_axis, inner):
  for name in _names(inner):
    if name in ("project_onto", "project_out"):
      raise InvalidArgumentError(
          f"{name} under ref.subspace: a projection of a projection is not a subspace edit",
          code="subspace_edit_unsupported", site=ctx.label,
          fix=f"apply ref.{name} to the whole site, or use subspace_zero/subspace_set")
  axis = feature_axis + x.ndim if feature_axis < 0 else feature_axis
  B = _tensor(data["basis"], x)
  if B.ndim != 2 or not 0 <= axis < x.ndim or B.shape[0] != x.shape[axis]:
    _fail_shape(f"basis of shape {tuple(B.shape)} does not fit feature axis {axis} of site shape "
                f"{tuple(x.shape)}", ctx, "subspace", fix="a (d, k) basis")
  if B.shape[1] == 0:
    raise InvalidArgumentError("subspace: the basis has no columns", code="empty_selection",
                               site=ctx.label, fix="a basis with at least one column")
  gram = B.T @ B
  s = torch.linalg.svdvals(gram.detach())
  if s.min() <= s.max() * 1e3 * torch.finfo(gram.dtype).eps:
    raise InvalidArgumentError(
        "subspace: the basis columns are linearly dependent", code="basis_rank_deficient",
        site=ctx.label, fix="pass linearly independent columns (e.g. an orthonormal basis)")
  inv = torch.linalg.inv(gram)
  coords = lambda z: (z @ B) @ inv.T
  d = B.shape[0]
  xm = x.movedim(axis, -1)
  origin = data["origin"]
  if origin is None:
    o = torch.zeros(d, dtype=x.dtype, device=x.device)
  elif isinstance(origin, Population):
    v = origin.values.detach()
    o = v.reshape(-1, v.shape[-1]).mean(0).to(x.dtype)
  else:
    o = _tensor(origin, x)
    if not (o.ndim == 1 and o.shape[0] == d):
      o = o.expand(x.shape).movedim(axis, -1)
  c = coords(xm - o)
  back = lambda v: v.movedim(-1, axis)
  if inner.name == "set_affine_coordinates":
    W, b = (_tensor(inner.data[k], x) for k in ("W", "b"))
    c_new = xm @ W.T + b
  elif _is_source(inner):
    c_new = coords(fire(inner, x, ctx).movedim(axis, -1) - o)
  else:
    c_new = coords(fire(inner, back(c @ B.T), ctx).movedim(axis, -1))
  return x + back((c_new - c) @ B.T)


def set_affine_coordinates(W, b) -> Edit:
  """Under :func:`subspace`, writes coordinates ``c := W x + b``; refused at every other door."""

  def fn(x, ctx):
    raise InvalidArgumentError(
        "set_affine_coordinates writes subspace coordinates; it needs a ref.subspace selection",
        code="affine_source_needs_subspace", site=ctx.label,
        fix='ref.when(ref.subspace("0", basis), ref.set_affine_coordinates(W, b))')

  return Edit("set_affine_coordinates", fn, data={"W": W, "b": b})


def _sub_edit(basis, origin, feature_axis, inner) -> Edit:
  return Selection(None, "subspace", {"basis": basis, "origin": origin}, feature_axis).wrap(inner)


def subspace_zero(basis, origin=None, *, feature_axis=-1) -> Edit:
  """Sets the subspace coordinates to zero."""
  return _sub_edit(basis, origin, feature_axis, zero_ablate())


def subspace_scale(basis, factor, origin=None, *, feature_axis=-1) -> Edit:
  """Multiplies the subspace coordinates by ``factor``."""
  return _sub_edit(basis, origin, feature_axis, scale(factor))


def subspace_set(basis, coords, origin=None, *, feature_axis=-1) -> Edit:
  """Sets the subspace coordinates to ``coords`` (shape ``(k,)``)."""
  B = np.asarray(basis.detach() if isinstance(basis, torch.Tensor) else basis)
  return _sub_edit(basis, origin, feature_axis,
                   set_affine_coordinates(np.zeros((B.shape[1], B.shape[0]), B.dtype), coords))


def subspace_patch(basis, source, origin=None, *, feature_axis=-1) -> Edit:
  """Writes the donor's subspace component, keeping the complement."""
  return _sub_edit(basis, origin, feature_axis, patch_from(source))


# --------------------------------------------------------------------------
# Specs and the live doors: plain forward hooks.


_warned: set[str] = set()


def _warn_once(message: str, *, code: str) -> None:
  if code not in _warned:
    _warned.add(code)
    warnings.warn(JaxlensWarning(message, code=code), stacklevel=4)


def reset_warnings() -> None:
  """Forgets which once-per-session warnings the reference issued (for tests)."""
  _warned.clear()


def _as_rule(site, edit) -> tuple[str, Edit]:
  if isinstance(site, Selection):
    return site.site, site.wrap(edit)
  if not isinstance(site, str):
    raise InvalidArgumentError(
        f"a torch site is a module name (as in model.named_modules()), got {type(site).__name__}",
        code="invalid_site", fix='ref.when("0", edit)')
  return site, as_edit(edit)


@dataclasses.dataclass(frozen=True)
class Spec:
  """An ordered tuple of ``(module name, edit)`` rules; ``+`` concatenates."""

  rules: tuple = ()

  def __add__(self, other: "Spec") -> "Spec":
    return Spec(self.rules + other.rules)

  def hooks(self) -> dict[str, Callable]:
    """One forward hook per site, ``hook(module, args, output) -> edited output``, to pass to
    ``model.get_submodule(name).register_forward_hook`` yourself."""
    out = {}
    for name in dict.fromkeys(n for n, _ in self.rules):
      edits = [e for n, e in self.rules if n == name]

      def fn(module, args, output, edits=edits, name=name):
        ctx = SiteContext(name)
        for edit in edits:
          output = fire(edit, output, ctx)
        return output

      out[name] = fn
    return out

  def bind(self, model: torch.nn.Module) -> Callable[..., Any]:
    """``model``'s forward with the edits live in forward hooks."""
    return lambda *inputs, **kwargs: _run(model, inputs, kwargs, self)[0]


def when(site, edit) -> Spec:
  """A spec applying ``edit`` at module ``site`` (a name, or a :func:`units`/:func:`subspace`)."""
  return Spec((_as_rule(site, edit),))


class _Recorder:
  """Forward hooks on every module: apply the matching edits, record the edited outputs."""

  def __init__(self, model: torch.nn.Module, rules, *, skip_root=False):
    self.rules = rules
    self.fired = [0] * len(rules)
    self.values: dict[str, torch.Tensor] = {}
    names = dict(model.named_modules())
    for site, _ in rules:
      if site not in names:
        raise SiteError(f"no module named {site!r} in this model", code="unknown_site",
                        site=site, candidates=[n for n in names if n][:10],
                        fix=f"one of {[n for n in names if n][:5]}")
    self.handles = [m.register_forward_hook(self._hook(n)) for n, m in names.items()
                    if not (skip_root and n == "")]

  def _hook(self, name):
    def fn(module, args, output):
      ctx = SiteContext(name, self.values)
      for i, (site, edit) in enumerate(self.rules):
        if site == name:
          self.fired[i] += 1
          output = fire(edit, output, ctx)
      if name:
        self.values[name] = output
      return output
    return fn

  def close(self):
    for h in self.handles:
      h.remove()

  def check(self):
    for (site, _), count in zip(self.rules, self.fired):
      if count == 0:
        raise SiteError(f"module {site!r} did not run in this call", code="unknown_site",
                        site=site, fix="edit a module that the forward calls")


def _run(model, inputs, kwargs, spec: Spec):
  rec = _Recorder(model, spec.rules)
  try:
    out = model(*inputs, **kwargs)
  finally:
    rec.close()
  rec.check()
  return out, rec.values


# --------------------------------------------------------------------------
# Trace and the capture doors: replay, rerun, set_only + run, differentiable replay.


class Trace:
  """A torch run with every module's output saved (with its graph).

  ``trace["0"].out`` is module ``"0"``'s output, ``trace.output`` the model's.
  """

  def __init__(self, output, values, model, inputs, spec=None, staged=None, frontier=None,
               stale=False):
    self.output = output
    self.values = dict(values)
    self.model = model
    self.inputs = tuple(inputs)
    self.spec = spec if spec is not None else Spec()
    self.staged = staged if staged is not None else Spec()
    self.frontier = dict(frontier or {})
    self.stale = stale

  def __getitem__(self, name: str) -> SiteValue:
    if name not in self.values:
      raise SiteError(f"this trace saved no module {name!r}", code="unknown_site", site=name,
                      candidates=list(self.values)[:10], fix=f"one of {list(self.values)[:5]}")
    return SiteValue(name, self.values[name])

  def value_for_donor(self, label: str, verb: str) -> torch.Tensor:
    if label in self.values:
      return self.values[label]
    raise SiteError(f"{verb}: the donor trace saved no value at {label!r}",
                    code="donor_site_missing", site=label, fix="capture the donor with ref.trace")

  def fork(self) -> "Trace":
    """A copy to edit (``do`` never changes the trace it is called on)."""
    return Trace(self.output, self.values, self.model, self.inputs, self.spec, self.staged,
                 self.frontier, self.stale)

  def do(self, site, edit=None, *, model=None, inputs=None,
         intervention: InterventionOptions | None = None) -> "Trace":
    """Applies an edit and returns the new trace (replay, rerun or set_only, as in jaxlens)."""
    opts = intervention or InterventionOptions()
    new = site if isinstance(site, Spec) and edit is None else Spec((_as_rule(site, edit),))
    engine = opts.engine
    if engine == "auto":
      engine = "rerun" if model is not None or inputs is not None else "replay"
    if engine == "set_only":
      return Trace(self.output, self.values, self.model, self.inputs, self.spec,
                   self.staged + new, stale=True)
    if engine == "rerun":
      return self._rerun(self.staged + new, model, inputs)
    return self._replay(self.staged + new, differentiable=opts.differentiable)

  def run(self, model=None, inputs=None) -> "Trace":
    """Executes the staged edits (replay, or rerun with ``model``/``inputs``)."""
    if not self.staged.rules:
      return self
    if model is not None or inputs is not None:
      return self._rerun(self.staged, model, inputs)
    return self._replay(self.staged, differentiable=False)

  def _rerun(self, new: Spec, model, inputs) -> "Trace":
    model = self.model if model is None else model
    if inputs is None:
      inputs = self.inputs
    elif not isinstance(inputs, tuple):
      inputs = (inputs,)
    return trace(model, *inputs, intervene=self.spec + new)

  def _replay(self, new: Spec, *, differentiable: bool) -> "Trace":
    """Re-runs the children downstream of the earliest edited child from its saved value."""
    model = self.model
    children = [n for n, _ in model.named_children()] if isinstance(
        model, torch.nn.Sequential) else []
    sites = [s for s, _ in new.rules]
    if not children or any(s not in children for s in sites):
      raise InvalidArgumentError(
          "the torch reference replays edits at the children of an nn.Sequential root only",
          code="replay_unsupported", site=", ".join(sites),
          fix="rerun instead: trace.fork().do(site, edit, model=model, inputs=x)")
    k = min(children.index(s) for s in sites)
    start = children[k]
    value = self.values[start]
    frontier = {}
    if differentiable:
      if any(_asks_keep_grad(e) for _, e in new.rules):
        _warn_once(
            "keep_grad under differentiable replay: the edit stays connected inside the "
            "replayed computation, but parameters upstream of the replay frontier get no "
            "gradient; the live door ref.when(site, keep_grad(edit)).bind(model)(x) reaches them",
            code="keep_grad_replay_frontier")
      value = value.detach().requires_grad_()
      frontier[start] = value
    upstream = children[:k + 1]
    values = {n: v for n, v in self.values.items() if _inside(n, upstream)}
    ctx = SiteContext(start, values)
    for site, edit in new.rules:
      if site == start:
        value = fire(edit, value, ctx)
    values[start] = value
    # Downstream children run with the hooks of every rule (the trace's own and the new).
    downstream = Spec(tuple(r for r in self.spec.rules + new.rules
                            if not _inside(r[0], upstream)))
    rec = _Recorder(model, downstream.rules, skip_root=True)
    rec.values.update(values)
    try:
      for name in children[k + 1:]:
        value = model.get_submodule(name)(value)
    finally:
      rec.close()
    rec.check()
    values = rec.values
    return Trace(value, values, model, self.inputs, self.spec + new, frontier=frontier)


def _inside(name: str, children) -> bool:
  """Whether module ``name`` is one of ``children`` or nested in one of them."""
  return any(name == c or name.startswith(c + ".") for c in children)


def trace(model: torch.nn.Module, *inputs, intervene: Spec | None = None, **kwargs) -> Trace:
  """Runs ``model`` with the edits of ``intervene`` live and saves every module's output."""
  spec = intervene if intervene is not None else Spec()
  out, values = _run(model, inputs, kwargs, spec)
  return Trace(out, values, model, inputs, spec)
