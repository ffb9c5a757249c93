"""How a door calls a model: Flax linen through ``intercept_methods``, NNX through
an equivalent interception of ``__call__``.

Both give the doors the same interface: ``call.run(variables, inputs, kwargs,
interceptor, method, apply_kwargs)``, where ``interceptor(next_fun, args, kwargs,
info)`` sees every module method call with a :class:`CallInfo`.

NNX interception patches ``__call__`` on the classes of the model's submodules
for the duration of the call (restored in ``finally``, guarded by a lock) and
dispatches on the instance, so modules outside the model, and other threads'
calls, are not intercepted. Only ``__call__`` is intercepted for NNX modules.

NNX lifted transforms (``nnx.scan`` over a stack of layers built with
``nnx.vmap``) call fresh module instances merged from a slice of the stacked
state. Such an instance is given the path of the model submodule it was sliced
from: the one of the same class and state structure whose every state leaf has
the instance's shape plus one leading axis; if no submodule or more than one
fits, the instance is not intercepted (and a selector naming it matches nothing).
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Mapping
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxlens._src.errors import InvalidArgumentError


@dataclasses.dataclass(frozen=True)
class CallInfo:
  """One intercepted module call: its path (tuple of names), method and class name."""

  path: tuple
  method_name: str
  module_type: str


@dataclasses.dataclass(frozen=True, eq=False)
class LinenCall:
  """A linen module, called with ``Module.apply``."""

  module: nn.Module

  def run(self, variables, inputs, kwargs, interceptor, method, apply_kwargs):
    def adapt(next_fun, args, kw, context):
      if context.method_name == "setup":
        return next_fun(*args, **kw)
      info = CallInfo(
        tuple(context.module.path), context.method_name, type(context.module).__name__
      )
      return interceptor(next_fun, args, kw, info)

    with nn.intercept_methods(adapt):
      return self.module.apply(variables, *inputs, method=method, **apply_kwargs, **kwargs)

  def cache_key(self):
    """What determines this call's program besides its arguments (the unbound module's class
    and fields, submodules and lists of them included), or None where a program built now
    must not be reused: under another interceptor, which may change what runs, or for a
    field that cannot be compared by value (an array: it would be baked in)."""
    if nn.module._global_interceptor_stack:
      return None
    try:
      return ("linen", _frozen(self.module))
    except (TypeError, AttributeError):
      return None


def _frozen(value):
  """A hashable value equal for equal linen module configurations; TypeError otherwise."""
  if isinstance(value, nn.Module):
    fields = [f.name for f in dataclasses.fields(value) if f.name != "parent"]
    return (type(value), tuple((name, _frozen(getattr(value, name))) for name in fields))
  if isinstance(value, (list, tuple)):
    return (type(value), tuple(_frozen(v) for v in value))
  if isinstance(value, Mapping):
    return (type(value), tuple(sorted(((repr(k), _frozen(v)) for k, v in value.items()))))
  if isinstance(value, (jax.Array, np.ndarray)) or hasattr(value, "aval"):
    raise TypeError("an array field")
  hash(value)
  return (type(value), value)


def check_variables(variables, model, fix: str):
  """Refuses, as ``missing_variables``, what cannot be an unbound linen module's variables.

  ``jl.trace(model, x)`` on an unbound module takes ``x`` for the variables; ``apply``
  would fail on it with an error about arrays, far from the mistake.
  """
  if not isinstance(variables, Mapping):
    raise InvalidArgumentError(
      f"{type(model).__name__} is an unbound linen module, so its first argument must be its "
      f"variables (a dict such as model.init(key, x) returns); got {type(variables).__name__}",
      code="missing_variables",
      fix=fix,
    )


_patch_lock = threading.RLock()
_active = threading.local()


def _owner_of_call(cls):
  for klass in cls.__mro__:
    if "__call__" in klass.__dict__:
      return klass
  return None


def _make_wrapper(original):
  def __call__(self, *args, **kwargs):
    state = getattr(_active, "state", None)
    if state is not None and id(self) not in state["paths"]:
      _adopt(state, self)
    if state is None or state["paths"].get(id(self)) is None or id(self) in state["inside"]:
      return original(self, *args, **kwargs)
    info = CallInfo(state["paths"][id(self)], "__call__", type(self).__name__)
    state["inside"].add(id(self))
    try:

      def next_fun(*a, **k):
        return original(self, *a, **k)

      return state["interceptor"](next_fun, args, kwargs, info)
    finally:
      state["inside"].discard(id(self))

  __call__.__jaxlens_wrapped__ = original
  return __call__


def _shapes(module):
  leaves, tree = jax.tree.flatten(nnx.state(module))
  return tree, [tuple(jnp.shape(x)) for x in leaves]


def _adopt(state, fresh):
  """Gives a module instance created by a lifted transform its stacked original's path."""
  state["paths"][id(fresh)] = None  # looked at once
  tree, shapes = _shapes(fresh)
  if not shapes:
    return
  fits = []
  for path, sub in state["modules"]:
    if type(sub) is not type(fresh):
      continue
    sub_tree, sub_shapes = _shapes(sub)
    if sub_tree == tree and all(
      len(a) == len(b) + 1 and a[1:] == b for a, b in zip(sub_shapes, shapes)
    ):
      fits.append(path)
  if len(fits) != 1:
    return
  for rel, sub in nnx.iter_modules(fresh):
    state["paths"].setdefault(id(sub), None)
    if state["paths"][id(sub)] is None:
      state["paths"][id(sub)] = fits[0] + tuple(str(p) for p in rel)
  state["keep"].append(fresh)  # ids stay unique while the call runs


@contextlib.contextmanager
def _intercept_nnx(model, interceptor):
  modules = [(tuple(str(p) for p in path), sub) for path, sub in nnx.iter_modules(model)]
  paths = {id(sub): path for path, sub in modules}
  owners = {_owner_of_call(type(sub)) for _, sub in nnx.iter_modules(model)} - {None}
  with _patch_lock:
    saved = {}
    for klass in owners:
      current = klass.__dict__["__call__"]
      if hasattr(current, "__jaxlens_wrapped__"):
        continue  # already patched by an enclosing door
      saved[klass] = current
      klass.__call__ = _make_wrapper(current)
    previous = getattr(_active, "state", None)
    _active.state = {
      "paths": paths,
      "interceptor": interceptor,
      "inside": set(),
      "modules": modules,
      "keep": [],
    }
    try:
      yield
    finally:
      _active.state = previous
      for klass, original in saved.items():
        klass.__call__ = original


@dataclasses.dataclass(frozen=True, eq=False)
class NnxCall:
  """An NNX module as a pure function of its state (``nnx.split`` / ``nnx.merge``)."""

  graphdef: Any

  def run(self, state, inputs, kwargs, interceptor, method, apply_kwargs):
    if apply_kwargs:
      raise InvalidArgumentError(
        f"NNX models take no Module.apply options, got {sorted(apply_kwargs)}",
        code="invalid_argument",
        fix="pass rngs to the NNX module's constructor",
      )
    model = nnx.merge(self.graphdef, state)
    fn = model if method is None else getattr(model, method)
    with _intercept_nnx(model, interceptor):
      return fn(*inputs, **kwargs)

  def cache_key(self):
    """The graph definition (structure and static attributes), or None inside an enclosing
    door, whose interception would be part of the program."""
    if getattr(_active, "state", None) is not None:
      return None
    return ("nnx", self.graphdef)


def resolve(model, args, fix: str) -> tuple[Any, Any, tuple]:
  """``(call, variables, inputs)`` of a door called as ``door(model, *args)``.

  A bound linen module and an NNX module carry their variables; an unbound linen module
  takes them as the first of ``args`` (refused as ``missing_variables``, naming ``fix``,
  when absent or not variables).
  """
  call, variables = split(model)
  if variables is None:
    if not args:
      raise InvalidArgumentError(
        "an unbound module needs its variables as the first argument",
        code="missing_variables",
        fix=fix,
      )
    variables, args = args[0], args[1:]
    check_variables(variables, model, fix)
  return call, variables, tuple(args)


def split(model) -> tuple[Any, Any]:
  """``(call, variables)`` for a door: variables is None for an unbound linen module."""
  if isinstance(model, nnx.Module):
    graphdef, state = nnx.split(model)
    return NnxCall(graphdef), state
  if isinstance(model, nn.Module):
    if model.scope is not None:
      module, variables = model.unbind()
      return LinenCall(module), variables
    return LinenCall(model), None
  raise InvalidArgumentError(
    f"expected a flax.linen or flax.nnx Module, got {type(model).__name__}",
    code="invalid_model",
    fix="jl.trace(model.bind(variables), x), jl.trace(model, variables, x) or an nnx.Module",
  )
