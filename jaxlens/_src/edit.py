"""Floor 2: the edit type, firing, the keep_grad check, donors and the verb registry.

An :class:`Edit` is what a verb factory (``jl.scale(2.0)``, ``jl.patch_from(t)``)
returns: the verb's name and the factory's arguments, split into ``params`` (a
pytree of array arguments, traced under ``jit``: a new value of the same shape does
not recompile) and ``static`` (hashable options). Every verb is a :class:`Verb`
registered where it is defined (``verbs.py``, ``backward.py``, ``selections.py``):
its forward function, whether it keeps the gradient, and how it behaves under a
subspace selection. Saving, loading, repr, keep_grad and the torch reference mapping
read the registry and the recorded arguments; none of them names a verb.

Keeping verbs compute from the site value and keep its gradient; cutting verbs
write a value computed elsewhere, through ``jax.lax.stop_gradient``, even when the
donor itself depends on the parameters being differentiated.
"""

from __future__ import annotations

import abc
import dataclasses
import functools
import inspect
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxlens._src import dependence, render
from jaxlens._src.errors import GradientContractError, InvalidArgumentError, ShapeError, SiteError
from jaxlens._src.tracebacks import api_boundary

_sg = jax.lax.stop_gradient


class ByIdentity:
  """Wraps an object for a pytree's static data: equal only to itself."""

  __slots__ = ("obj",)

  def __init__(self, obj):
    self.obj = obj

  def __eq__(self, other):
    return isinstance(other, ByIdentity) and other.obj is self.obj

  def __hash__(self):
    return id(self.obj)

  def __repr__(self):
    return getattr(self.obj, "__name__", type(self.obj).__name__)


# --------------------------------------------------------------------------
# The verb registry.


@dataclasses.dataclass(frozen=True)
class Verb:
  """What jaxlens knows of one verb, registered next to its definition.

  Attributes:
    name: the verb's name (``"scale"``), also the name of its factory in
      ``jaxlens.intervention`` and in the torch reference.
    forward: ``forward(x, params, options, ctx) -> new value``.
    factory: the function that builds the edit from the arguments an Edit records
      (``params`` and ``static`` together); loading a saved spec calls it.
    under_subspace: how a ``jl.subspace`` selection reads the verb: ``"component"``
      (it computes from the subspace component), ``"source"`` (it writes a value
      from elsewhere, whose component is written), ``"affine"`` (it writes
      coordinates) or ``"refused"``.
    source_arg: for a verb that writes from elsewhere only when an argument is
      given (``mean_ablate(source=)``), that argument's name.
    row_axis: the option naming the axis along which the verb moves whole rows
      (``permute_batch``'s ``"axis"``), or None.
    user_code: the verb runs a user's function (its result errors are ``hook_*``).
    keeping_spelling: the keep_grad fix offered when the verb cuts.
    wraps: a selection wrapper (``units``/``subspace``): shown with its site in a spec.
  """

  name: str
  forward: Callable[..., Any]
  factory: Callable[..., Any]
  under_subspace: str = "component"
  source_arg: str | None = None
  row_axis: str | None = None
  user_code: bool = False
  keeping_spelling: str | None = None
  wraps: bool = False

  @functools.cached_property
  def signature(self) -> inspect.Signature:
    return inspect.signature(self.factory)

  def writes_source(self, edit: "Edit") -> bool:
    """Whether the edit writes a value from elsewhere (its component is taken)."""
    if self.under_subspace == "source":
      return True
    return self.source_arg is not None and edit.arguments.get(self.source_arg) is not None

  def build(self, arguments: dict) -> "Edit":
    """Calls the factory with recorded arguments (a loaded spec's, or a rebuilt edit's)."""
    args, kwargs = [], {}
    for name, p in self.signature.parameters.items():
      if name not in arguments:
        continue
      if p.kind is inspect.Parameter.VAR_POSITIONAL:
        args.extend(arguments[name])
      elif p.kind is inspect.Parameter.POSITIONAL_ONLY:
        args.append(arguments[name])
      else:
        kwargs[name] = arguments[name]
    unknown = set(arguments) - set(self.signature.parameters)
    if unknown:
      raise InvalidArgumentError(
        f"{self.name} takes no arguments {sorted(unknown)}",
        code="invalid_argument",
        verb=self.name,
        fix=f"jl.{self.name}{self.signature}",
      )
    return self.factory(*args, **kwargs)


REGISTRY: dict[str, Verb] = {}


def register(name: str, forward: Callable, factory: Callable, **attributes) -> Verb:
  """Registers a verb (called once, where the verb is defined)."""
  verb = Verb(name, forward, factory, **attributes)
  REGISTRY[name] = verb
  return verb


def verb_named(name: str) -> Verb:
  if name not in REGISTRY:
    raise InvalidArgumentError(
      f"no verb named {name!r}",
      code="unknown_verb",
      candidates=sorted(REGISTRY),
      fix=f"one of: {', '.join(sorted(REGISTRY))}",
    )
  return REGISTRY[name]


# --------------------------------------------------------------------------
# The edit.


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True)
class Edit:
  """One edit of a site value: a verb and the arguments its factory was called with.

  Attributes:
    name: the verb's name (``"scale"``).
    params: a dict of the verb's array arguments (leaves traced under jit).
    static: a tuple of ``(argument, value)`` hashable options.
    keeps: whether the verb keeps the gradient through what it writes.
    keep_grad: whether the door checks, when it fires, that it does.
  """

  name: str
  params: Any
  static: tuple = ()
  keeps: bool = True
  keep_grad: bool = False

  def tree_flatten(self):
    return (self.params,), (self.name, self.static, self.keeps, self.keep_grad)

  @classmethod
  def tree_unflatten(cls, aux, children):
    name, static, keeps, keep_grad = aux
    return cls(name, children[0], static, keeps, keep_grad)

  @property
  def verb(self) -> Verb:
    return verb_named(self.name)

  @property
  def options(self) -> dict:
    return dict(self.static)

  @property
  def arguments(self) -> dict:
    """The factory's arguments: the array ones and the static ones, by name."""
    return {**(self.params or {}), **dict(self.static)}

  def __treescope_repr__(self, path, subtree_renderer):
    """treescope's view: the verb, its arguments, and whether it keeps the gradient."""
    return render.treescope_repr(render.EditView(self), path, subtree_renderer)

  def children(self) -> tuple["Edit", ...]:
    """The edits nested in this one (``compose``, ``at_positions``, selections, ``gate``)."""
    leaves = jax.tree.leaves(self.params, is_leaf=lambda v: isinstance(v, Edit))
    return tuple(v for v in leaves if isinstance(v, Edit))

  def walk(self):
    """This edit and every edit nested in it, depth first."""
    yield self
    for child in self.children():
      yield from child.walk()

  def asks_keep_grad(self) -> bool:
    """Whether this edit or one nested in it carries ``keep_grad``.

    A hook may still ask at fire time by returning ``InterventionDecision(keep_grad=True)``.
    """
    return any(e.keep_grad for e in self.walk())

  @api_boundary
  def __call__(self, x, ctx=None):
    """Applies the edit to an array outside any door (for tests and composition)."""
    return fire(self, x, ctx if ctx is not None else FireContext.standalone())

  def __repr__(self) -> str:
    verb = self.verb
    if verb.wraps:
      # A selection's edit: its site lives in the rule (a spec shows it there).
      rest = {k: v for k, v in self.arguments.items() if k != "edit"}
      text = f"jl.{self.name}(..., {show_arguments(verb, rest)}).wrap({self.params['edit']!r})"
    else:
      text = f"jl.{self.name}({show_arguments(verb, self.arguments)})"
    return f"jl.keep_grad({text})" if self.keep_grad else text


def show_value(v) -> str:
  """A readable, where possible re-typable, form of an argument value."""
  if isinstance(v, jax.core.Tracer):
    return f"<traced {v.aval.str_short()}>"
  if split_over_processes(v):
    # Its shards live on other processes too: only its type can be shown here.
    return f"<{v.dtype}{list(v.shape)} array over processes>"
  if isinstance(v, (jax.Array, np.ndarray, np.generic)):
    a = np.asarray(v)
    if a.ndim == 0:
      return repr(a.item())
    if a.size <= 16:
      return f"jnp.array({a.tolist()!r}, dtype=jnp.{a.dtype})"
    return f"<{a.dtype}{list(a.shape)} array>"
  if isinstance(v, Donor):
    return f"<donor: {', '.join(v.donor_values())}>"
  if isinstance(v, tuple):
    return "(" + ", ".join(show_value(x) for x in v) + ("," if len(v) == 1 else "") + ")"
  if isinstance(v, list):
    return "[" + ", ".join(show_value(x) for x in v) + "]"
  return repr(v)


def show_arguments(verb: Verb, arguments: dict) -> str:
  """Arguments in the factory's order: required ones by position, the rest by keyword
  where they differ from the default."""
  parts = []
  for name, p in verb.signature.parameters.items():
    if name not in arguments:
      continue
    value = arguments[name]
    if p.kind is inspect.Parameter.VAR_POSITIONAL:
      parts.extend(show_value(v) for v in value)
    elif p.default is inspect.Parameter.empty and p.kind is not inspect.Parameter.KEYWORD_ONLY:
      parts.append(show_value(value))
    elif (
      p.default is inspect.Parameter.empty
      or value is not p.default
      and not (_plain(value) and _plain(p.default) and value == p.default)
    ):
      parts.append(f"{name}={show_value(value)}")
  return ", ".join(parts)


def _plain(v) -> bool:
  return v is None or isinstance(v, (bool, int, float, str, tuple))


@dataclasses.dataclass
class FireContext:
  """What a verb may know of the site it edits, passed as ``hook=`` to callables.

  Attributes:
    label: the site label (``"layers_0"``).
    path: the module path.
    module_type: the module class name.
    site_values: the values of the sites that already ran in this call, by label.
    grad_disabled: whether a ``jaxlens.no_grad()`` scope is active.
    step: the decoding step of this call (``spec.bind(model, step=t)``; ``jl.generate``
      passes its call index), or None outside a generation. ``jl.at_steps`` reads it.
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
  step: Any = None

  @classmethod
  def standalone(cls) -> "FireContext":
    return cls(label="<standalone>")


@dataclasses.dataclass(frozen=True)
class InterventionDecision:
  """An edit (or, returned by a hook, a value) with the keep_grad choice.

  ``InterventionDecision(edit, keep_grad=True)`` runs the same fire-time check as
  ``keep_grad(edit)``; ``keep_grad=False`` (the default) checks nothing.
  """

  action: Any = None
  keep_grad: bool = False


# --------------------------------------------------------------------------
# Donors: where the cutting verbs read values from elsewhere.


class Donor(abc.ABC):
  """A run whose saved site values a verb may read (``jl.patch_from(trace)``).

  :class:`jaxlens.Trace` implements it; so does :class:`SavedDonor`, the form a
  saved spec keeps of a donor trace. Verbs read donors only through this protocol.
  """

  @abc.abstractmethod
  def value_for_donor(self, label: str, verb: str, *, layer=None, static_layer=None):
    """The value saved at ``label`` (inside a scan body: at ``layer``)."""

  @abc.abstractmethod
  def donor_values(self) -> dict:
    """Every saved value, by label (what a saved spec stores)."""

  def donor_infos(self) -> dict:
    """The site info of each saved value, by label (None where unknown)."""
    return {}

  @abc.abstractmethod
  def site_value(self, site):
    """The value of one saved site, for ``jl.population(donor, site=...)``."""


def read_donor(values: dict, stacked, label: str, verb: str, *, layer=None, static_layer=None):
  """The value a donor saved at ``label``: the one lookup every :class:`Donor` uses.

  Args:
    values: the donor's saved values, by label.
    stacked: the labels whose value stacks a scan body's layers along axis 0.
    label, verb: the site read and the verb reading it (for the error).
    layer: inside a scan body, the traced iteration index: a stacked value is read at it.
    static_layer: the layer of a site inside a layer stack, where the donor saved that
      one layer (``"label[k]"``) rather than the stack.
  """
  if label in values:
    value = values[label]
    if layer is not None and label in stacked:
      return jax.lax.dynamic_index_in_dim(value, layer, keepdims=False)
    return value
  if static_layer is not None and f"{label}[{static_layer}]" in values:
    return values[f"{label}[{static_layer}]"]
  raise SiteError(
    f"{verb}: the donor saved no value at {label!r} (it saved {list(values)})",
    code="donor_site_missing",
    site=label,
    fix=f"capture the donor with save=jl.label({label!r}) or the default save=None",
  )


class SavedDonor(Donor):
  """A donor's saved values alone (what a loaded spec holds for ``patch_from(trace)``).

  ``layers`` gives, for a value saved from a scan body, the number of layers stacked
  along its axis 0 (read one layer at a time inside the scan).
  """

  def __init__(self, values: dict, layers: dict | None = None):
    self.values = dict(values)
    self.layers = dict(layers or {})

  def value_for_donor(self, label, verb, *, layer=None, static_layer=None):
    stacked = {lbl for lbl, n in self.layers.items() if n is not None}
    return read_donor(self.values, stacked, label, verb, layer=layer, static_layer=static_layer)

  def donor_values(self):
    return dict(self.values)

  def site_value(self, site):
    label = getattr(site, "label", site)
    if label not in self.values:
      raise SiteError(
        f"the donor saved no value at {site!r}",
        code="unknown_site",
        site=str(site),
        candidates=list(self.values),
        fix=f"one of: {', '.join(self.values)}",
      )
    return self.values[label]

  def __repr__(self):
    shapes = {k: tuple(jnp.shape(v)) for k, v in self.values.items()}
    return f"SavedDonor({shapes})"


@jax.tree_util.register_pytree_node_class
class Population:
  """Reference activations of one site, gathered over other inputs.

  ``values`` stacks examples along axis 0 (for a site of shape ``(B, ...)``, traces
  over k batches give ``(k*B, ...)``). Build one with :func:`jaxlens.population`.
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


def source_values(source, ctx, verb):
  """The array behind a source: an array, a Population or a Donor (a trace)."""
  if isinstance(source, Donor):
    return source.value_for_donor(ctx.label, verb, layer=ctx.layer, static_layer=ctx.static_layer)
  if isinstance(source, Population):
    return source.values
  if isinstance(source, (jax.Array, np.ndarray, float, int)):
    return jnp.asarray(source)
  raise InvalidArgumentError(
    f"{verb}: a source must be an array, a jl.Population or a jl.Trace, got "
    f"{type(source).__name__}",
    code="invalid_source",
    site=ctx.label,
    verb=verb,
    fix=f"jl.{verb}(source=jl.population(trace, site))",
  )


# --------------------------------------------------------------------------
# Argument checks shared by the verbs.


def fail_shape(msg, ctx, verb, fix=None, code="shape_mismatch", **fields):
  raise ShapeError(f"{verb}: {msg}", code=code, site=ctx.label, fix=fix, verb=verb, **fields)


def as_param(value, x, ctx, verb, name):
  """An array argument used as a parameter of a function of x, cast to x's dtype."""
  try:
    if isinstance(value, (str, bytes)):
      raise TypeError(f"a {type(value).__name__}")
    arr = jnp.asarray(value)
  except TypeError:
    fail_shape(
      f"{name} must be a number or a numeric array, got {value!r:.60}",
      ctx,
      verb,
      code="dtype_mismatch",
      fix=f"pass {name} as a number, e.g. {verb}(2.0)",
    )
  if jnp.issubdtype(arr.dtype, jnp.complexfloating) and not jnp.issubdtype(
    x.dtype, jnp.complexfloating
  ):
    fail_shape(
      f"{name} is complex ({arr.dtype}) but the site is {x.dtype}; the imaginary part "
      "would be dropped",
      ctx,
      verb,
      code="dtype_mismatch",
      fix=f"pass the real part: jnp.real({name})",
    )
  if jnp.issubdtype(x.dtype, jnp.inexact):
    if not jnp.issubdtype(arr.dtype, jnp.inexact) and not jnp.issubdtype(arr.dtype, jnp.integer):
      fail_shape(
        f"{name} must be a float array, got dtype {arr.dtype}",
        ctx,
        verb,
        code="dtype_mismatch",
        fix=f"pass {name} as jnp.asarray({name}, {x.dtype})",
      )
    return arr.astype(x.dtype)
  if not jnp.issubdtype(arr.dtype, x.dtype) and not isinstance(value, (int, bool)):
    fail_shape(
      f"{name} has dtype {arr.dtype} but the site is {x.dtype}",
      ctx,
      verb,
      code="dtype_mismatch",
      fix=f"pass {name} with dtype {x.dtype}",
    )
  return arr.astype(x.dtype)


def check_broadcast(arr, x, ctx, verb, name):
  """Refuses an argument that does not broadcast to the site's shape."""
  try:
    ok = jnp.broadcast_shapes(jnp.shape(arr), x.shape) == x.shape
  except ValueError:
    ok = False
  if not ok:
    fail_shape(
      f"{name} of shape {jnp.shape(arr)} does not broadcast to the site's shape {x.shape}",
      ctx,
      verb,
      fix=f"a scalar {name}, or one that broadcasts to {x.shape}",
      expected=str(x.shape),
      received=str(jnp.shape(arr)),
    )
  return arr


def place_like(y, x):
  """Places ``y`` with the sharding of the site value ``x``.

  Concrete arrays are moved with ``device_put``; inside ``jit`` on an explicit mesh the
  value is resharded to the site's type. Elsewhere (no mesh, or an Auto mesh under jit,
  where XLA chooses) ``y`` is returned as it is.
  """
  if not isinstance(x, jax.core.Tracer):
    sharding = getattr(x, "sharding", None)
    if (
      sharding is not None
      and not isinstance(y, jax.core.Tracer)
      and getattr(y, "sharding", None) != sharding
    ):
      return jax.device_put(y, sharding)
    return y
  sharding = getattr(jax.typeof(x), "sharding", None)
  mesh = getattr(sharding, "mesh", None)
  explicit = mesh is not None and any(
    t == jax.sharding.AxisType.Explicit for t in getattr(mesh, "axis_types", ())
  )
  if explicit and getattr(jax.typeof(y), "sharding", None) != sharding:
    return jax.sharding.reshard(y, sharding)
  return y


def auto_axes(mesh):
  """``mesh`` with every axis Auto (None stays None): a tool that places a batch on a user's
  mesh and lets XLA partition its step from the batch's sharding uses this. Under an Explicit
  mesh (``jax.make_mesh``'s default) an array's sharding is part of its type, and operations
  such as an embedding lookup (a gather of a replicated table by sharded token ids) or
  ``top_k`` have no sharding rule: a raw ``ShardingTypeError``."""
  if mesh is None:
    return None
  auto = (jax.sharding.AxisType.Auto,) * len(mesh.axis_names)
  if tuple(getattr(mesh, "axis_types", ())) == auto:
    return mesh
  return jax.sharding.Mesh(mesh.devices, mesh.axis_names, axis_types=auto)


def donor_value(value, x, ctx, verb, name, *, broadcast=False):
  """A value written verbatim into the site: same dtype, shape equal (or broadcast)."""
  weak = isinstance(value, (int, float, bool))
  arr = jnp.asarray(value)
  if not weak and arr.dtype != x.dtype:
    fail_shape(
      f"{name} has dtype {arr.dtype} but the site value is {x.dtype}",
      ctx,
      verb,
      code="dtype_mismatch",
      fix=f"{name}.astype(jnp.{x.dtype})",
      expected=str(x.dtype),
      received=str(arr.dtype),
    )
  if broadcast:
    try:
      ok = jnp.broadcast_shapes(arr.shape, x.shape) == x.shape
    except ValueError:
      ok = False
  else:
    ok = arr.shape == x.shape
  if not ok:
    want = f"shape {x.shape}" + (" (or one that broadcasts to it)" if broadcast else "")
    fail_shape(
      f"{name} has shape {arr.shape}, expected {want}",
      ctx,
      verb,
      fix=f"pass a {name} of shape {x.shape}",
      expected=str(x.shape),
      received=str(arr.shape),
    )
  return place_like(jnp.broadcast_to(arr.astype(x.dtype), x.shape), x)


def resolve_axis(x, direction, feature_axis, ctx, verb):
  """The feature axis of x along which a 1-D direction lies."""
  d = jnp.asarray(direction)
  if d.ndim != 1:
    fail_shape(
      f"direction must be 1-D, got shape {d.shape}",
      ctx,
      verb,
      fix="pass a 1-D direction (use jl.add(delta) for a full-shape delta)",
    )
  n = d.shape[0]
  if feature_axis is not None:
    axis = feature_axis + x.ndim if feature_axis < 0 else feature_axis
    if not 0 <= axis < x.ndim or x.shape[axis] != n:
      fail_shape(
        f"feature_axis={feature_axis} does not have size {n} in site shape {x.shape}",
        ctx,
        verb,
        fix=f"a feature_axis whose size is {n}",
      )
    return axis
  axes = [a for a in range(x.ndim) if x.shape[a] == n]
  if not axes:
    fail_shape(
      f"direction of length {n} matches no axis of site shape {x.shape}",
      ctx,
      verb,
      fix="pass a direction whose length is the site's feature size",
    )
  if len(axes) > 1:
    raise InvalidArgumentError(
      f"{verb}: a direction of length {n} fits axes {axes} of site shape {x.shape}; "
      "which is the feature axis is ambiguous",
      code="feature_axis_ambiguous",
      site=ctx.label,
      verb=verb,
      candidates=axes,
      fix=f"jl.{verb}(direction, ..., feature_axis={axes[-1] - x.ndim})",
    )
  return axes[0]


def along(vec, axis, ndim):
  shape = [1] * ndim
  shape[axis] = vec.shape[0]
  return vec.reshape(shape)


def key_from_seed(seed, ctx, verb):
  if seed is None:
    raise InvalidArgumentError(
      f"{verb} draws random numbers and needs an explicit seed",
      code="seed_required",
      site=ctx.label,
      verb=verb,
      fix=f"jl.{verb}(..., seed=0)",
    )
  if not isinstance(seed, jax.core.Tracer):
    s = np.asarray(seed)
    if not np.issubdtype(s.dtype, np.integer) or s.ndim != 0 or s < 0 or s >= 2**32:
      raise InvalidArgumentError(
        f"{verb}: seed must be an integer in [0, 2**32), got {seed!r}",
        code="invalid_seed",
        site=ctx.label,
        verb=verb,
        fix=f"jl.{verb}(..., seed=0)",
      )
  return jax.random.key(jnp.asarray(seed, jnp.uint32))


def takes_hook_keyword(fn: Callable) -> bool:
  """Whether ``fn`` accepts a ``hook=`` keyword (by name or through ``**kwargs``)."""
  try:
    params = inspect.signature(fn).parameters
  except (TypeError, ValueError):
    return False
  return "hook" in params or any(q.kind is inspect.Parameter.VAR_KEYWORD for q in params.values())


# --------------------------------------------------------------------------
# Firing, and the keep_grad check.


_DEFAULT_SPELLING = "keep_grad(jl.intervention.compose(jl.scale(0.0), jl.add(value)))"


def _unwrap(result):
  if isinstance(result, InterventionDecision):
    return result.action, result.keep_grad
  return result, False


def is_array(x) -> bool:
  return isinstance(x, (jax.Array, np.ndarray)) or hasattr(x, "aval")


def split_over_processes(x) -> bool:
  """Whether ``x`` is an array with shards on other processes (this one cannot read it)."""
  return isinstance(x, jax.Array) and not x.is_fully_addressable


def fire(edit: Edit, x, ctx: FireContext):
  """Applies ``edit`` to the site value ``x``, with the result and keep_grad checks."""
  if not is_array(x):
    raise InvalidArgumentError(
      f"the site value is a {type(x).__name__}, not an array; edits apply to array sites",
      code="site_not_array",
      site=ctx.label,
      fix="select a submodule whose call returns one array",
    )
  verb = edit.verb
  if edit.keep_grad and ctx.checks:
    check_keep_grad_preconditions(x, ctx)
  y, asked = _unwrap(verb.forward(x, edit.params, edit.options, ctx))
  y = _check_result(edit, x, y, ctx)
  ctx.asked_keep_grad |= asked
  if ctx.checks and (edit.keep_grad or asked):
    if asked:
      check_keep_grad_preconditions(x, ctx)
    if not writes_from_input(edit, x, ctx):
      raise GradientContractError(
        f"keep_grad: {edit!r} writes values that do not depend on the site value, so no "
        "gradient reaches the parameters upstream of it",
        code="edit_detached_from_graph",
        site=ctx.label,
        fix=verb.keeping_spelling or _DEFAULT_SPELLING,
        verb=edit.name,
      )
  return y


def check_keep_grad_preconditions(x, ctx):
  if ctx.grad_disabled:
    raise GradientContractError(
      "keep_grad inside a jaxlens.no_grad() scope: doors stop every gradient there",
      code="grad_disabled",
      site=ctx.label,
      fix="call the door outside jaxlens.no_grad()",
    )
  if not jnp.issubdtype(x.dtype, jnp.inexact):
    raise GradientContractError(
      f"keep_grad on a site of dtype {x.dtype}: an integer or boolean value has no gradient",
      code="site_not_float",
      site=ctx.label,
      fix="drop keep_grad for this site",
    )


def _check_result(edit, x, y, ctx):
  prefix = "hook_" if edit.verb.user_code else ""
  if not is_array(y):
    raise ShapeError(
      f"{edit!r} returned a {type(y).__name__}, not an array",
      code=f"{prefix}shape_mismatch",
      site=ctx.label,
      fix=f"return an array of shape {x.shape}",
    )
  if jnp.shape(y) != x.shape:
    raise ShapeError(
      f"{edit!r} returned shape {jnp.shape(y)} for a site of shape {x.shape}",
      code=f"{prefix}shape_mismatch",
      site=ctx.label,
      fix=f"return an array of shape {x.shape}",
      expected=str(x.shape),
      received=str(jnp.shape(y)),
    )
  if y.dtype != x.dtype:
    raise ShapeError(
      f"{edit!r} returned dtype {y.dtype} for a site of dtype {x.dtype}",
      code=f"{prefix}dtype_mismatch",
      site=ctx.label,
      fix=f"return an array of dtype {x.dtype}",
      expected=str(x.dtype),
      received=str(y.dtype),
    )
  return y


def writes_from_input(edit: Edit, x, ctx) -> bool:
  """Whether the value ``edit`` writes depends differentiably on the site value."""
  forward = edit.verb.forward

  def written(x_):
    return _unwrap(forward(x_, edit.params, edit.options, ctx))[0]

  table, _ = dependence.outputs_depend_on_inputs(written, x)
  return any(row[0] for row in table)
