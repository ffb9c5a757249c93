"""The general converter: any model ``torch.export`` can export becomes a Flax linen model.

How it works:

1. ``torch.export.export`` (non-strict) traces the model on the example inputs, in eval mode,
   under hooks that watch for what export would silently change (a custom
   ``torch.autograd.Function``, whose backward export drops) and that remember which module was
   running if export fails. ``run_decompositions({})`` then functionalises the graph (in-place
   ops and views become pure ops) without decomposing any operator.
2. Each graph node carries ``nn_module_stack``: the torch module calls it ran inside. The nodes
   are grouped into a tree of module *calls*; a call's inputs are the values it uses from
   outside, its output the values used after it (one value: that value, as torch's module
   returned it; several: a tuple).
3. The Flax model mirrors torch's module tree: one :class:`_Node` linen module per torch module,
   named by the torch attribute name, so ``transformer.h.0.mlp`` is the Flax path
   ``transformer/h/0/mlp``. Modules torch never calls (``ModuleList``) exist as containers
   and are never called. Every torch module call is a call of its Flax module, which
   interprets that call's nodes with the ATen table (:mod:`torch_bridge.convert._aten`);
   repeated calls of one module are repeated calls of one Flax module (sites ``path:2``...).
4. Parameters live in the Flax module of their torch owner (collection ``params``), buffers and
   lifted constants in ``buffers``, with torch's names and layouts. A module that uses a
   parameter of another module (tied weights, ``MultiheadAttention`` reading
   ``out_proj.weight``) reads it from the owner's Flax module; tied weights are one parameter.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import torch
from torch.utils import _pytree as tree

from torch_bridge.convert._aten import ATEN, HI, sdpa_logits
from jaxlens.core import Named
from torch_bridge.convert._dtypes import JAX_LACKS, runtime_dtype
from torch_bridge.convert._errors import ConversionError

__all__ = ["ExportOptions", "convert_exported", "export_model"]

_SOFTMAX = ("aten.softmax.int", "aten._softmax.default")
_SDPA = "aten.scaled_dot_product_attention.default"
PROBS = "attn_probs"


@dataclasses.dataclass(frozen=True)
class ExportOptions:
  """Export-time options of :func:`torch_bridge.from_torch`'s export path.

  Attributes:
    dynamic_shapes: passed to ``torch.export.export`` (e.g. ``{"input_ids": {0:
      torch.export.Dim("batch")}}``); dims left static are fixed to the example's sizes.
    attention_probs: make the attention probabilities a site: every softmax and every
      ``scaled_dot_product_attention`` of a module computes its probabilities in a child Flax
      module ``attn_probs`` (calls numbered ``attn_probs:2``...).
    eval_mode: export in eval mode (BatchNorm running statistics, dropout off), restoring
      each module's training flag afterwards.
  """

  dynamic_shapes: Any = None
  attention_probs: bool = False
  eval_mode: bool = True
  # ((torch module path, "in" | "out" | "probs"), canonical site) pairs: extra sites naming a
  # module's input, output or attention probabilities (torch_bridge.convert.hf_sites).
  sites: tuple = ()


# -- export ---------------------------------------------------------------------


class _Watch:
  """Module hooks during export: the running module stack, and custom autograd Functions."""

  def __init__(self, model: torch.nn.Module):
    self.names = {id(m): n for n, m in model.named_modules(remove_duplicate=False)}
    self.stack: list[str] = []
    self.failed_in: str | None = None
    self.custom: tuple[str, str] | None = None

  def pre(self, module, args, kwargs=None):
    name = self.names.get(id(module))
    if name is not None:
      self.stack.append(name)

  def post(self, module, args, output):
    if self.names.get(id(module)) is not None and self.stack:
      self.stack.pop()

  @contextlib.contextmanager
  def active(self):
    from torch.nn.modules import module as mm

    handles = [
      mm.register_module_forward_pre_hook(self.pre),
      mm.register_module_forward_hook(self.post),
    ]
    function = torch.autograd.Function
    original = function.__dict__["apply"]
    watch = self

    def apply(cls, *args, **kwargs):
      if watch.custom is None:
        watch.custom = (cls.__qualname__, watch.stack[-1] if watch.stack else "")
      raise _CustomFunction()

    function.apply = classmethod(apply)
    try:
      yield self
    except BaseException:
      self.failed_in = self.stack[-1] if self.stack else ""
      raise
    finally:
      function.apply = original
      for h in handles:
        h.remove()


class _CustomFunction(Exception):
  pass


def export_model(model: torch.nn.Module, args: tuple, kwargs: dict, options: ExportOptions):
  """``torch.export`` of ``model`` (eval mode, functionalised), or a typed ConversionError."""
  flags = [(m, m.training) for m in model.modules()]
  if options.eval_mode:
    model.eval()
  watch = _Watch(model)
  try:
    with watch.active():
      ep = torch.export.export(
        model, args, kwargs, dynamic_shapes=options.dynamic_shapes, strict=False
      )
  except _CustomFunction:
    name, module = watch.custom
    raise ConversionError(
      f"module {module or '<root>'!r} calls the custom autograd Function {name}; "
      "torch.export would keep its forward and drop its backward, so the converted model's "
      "gradients would differ",
      code="custom_autograd_function",
      module=module,
      function=name,
      fix="replace the autograd.Function by plain torch ops (or by a module whose gradient "
      "is the autograd one) before converting",
    ) from None
  except ConversionError:
    raise
  except Exception as error:
    module = watch.failed_in or ""
    first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    raise ConversionError(
      f"torch.export could not export the model (failed in module {module or '<root>'!r}): "
      f"{type(error).__name__}: {first[:300]}. Data-dependent control flow (an `if` on a "
      "tensor's values) is the usual cause",
      code="export_failed",
      module=module,
      cause=type(error).__name__,
      fix="make the branch static, or use torch.cond, or pass the shapes that vary as "
      "dynamic_shapes",
    ) from error
  finally:
    for m, training in flags:
      m.training = training
  # Functionalising costs as much as exporting; it is needed only for in-place ops (and
  # for higher-order ops such as set_grad_enabled regions, which it inlines).
  if any(_needs_functionalization(n) for n in ep.graph.nodes):
    ep = ep.run_decompositions({})
  return ep


def _needs_functionalization(node) -> bool:
  if node.op != "call_function":
    return False
  target = node.target
  if isinstance(target, torch._ops.OpOverload):
    return target._schema.is_mutable
  return str(target) not in ATEN


# -- the static program ------------------------------------------------------------


@dataclasses.dataclass
class _Call:
  """One module call in the exported graph (``path`` "" is the root call)."""

  key: str
  path: str
  type: str
  items: list = dataclasses.field(default_factory=list)  # fx nodes and child _Calls
  inputs: list = dataclasses.field(default_factory=list)
  outputs: list = dataclasses.field(default_factory=list)
  template: _Call | None = None  # the call whose nodes this call runs (repeated calls)


class Program:
  """The exported graph, grouped into module calls; shared by every Flax module of a model.

  Identity-hashed: Flax modules hold it as a field.
  """

  def __init__(self, ep, options: ExportOptions):
    self.options = options
    self.site_of = dict(options.sites)
    self.graph = ep.graph
    sig = ep.graph_signature
    self.user_inputs: list = []
    self.state: dict[Any, tuple[str, str]] = {}  # placeholder node -> (collection, fqn)
    kinds = {"PARAMETER": "params", "BUFFER": "buffers", "CONSTANT_TENSOR": "buffers"}
    placeholders = [n for n in ep.graph.nodes if n.op == "placeholder"]
    for node, spec in zip(placeholders, sig.input_specs):
      kind = spec.kind.name
      if kind == "USER_INPUT":
        self.user_inputs.append(node)
      elif kind in kinds:
        self.state[node] = (kinds[kind], spec.target)
      else:
        raise _error(
          "unsupported_input",
          "",
          f"an input of kind {kind} ({spec.target})",
          "export a model whose inputs are tensors, parameters and buffers",
        )
    for spec in sig.output_specs:
      if spec.kind.name != "USER_OUTPUT":
        raise _error(
          "buffer_mutation",
          _owner(spec.target),
          f"the model writes its buffer {spec.target!r} ({spec.kind.name})",
          "convert the model in eval mode (eval_mode=True, the default)",
        )
    self.out_spec = ep.call_spec.out_spec
    values = {}
    values.update(ep.state_dict)
    values.update(ep.constants)
    self.values = {node: values[fqn] for node, (_, fqn) in self.state.items() if fqn in values}
    self.root = self._group()
    self.templates: dict[str, list[_Call]] = {}
    self.children: dict[str, list[str]] = {"": []}
    self._index(self.root)
    for _node, (_, fqn) in self.state.items():
      self._add_path(_owner(fqn))
    self.owned: dict[str, list] = {}  # torch module -> its (placeholder, collection, fqn)
    for node, (collection, fqn) in self.state.items():
      self.owned.setdefault(_owner(fqn), []).append((node, collection, fqn))
    self.sites: dict[str, str] = {}
    for path in self.templates:
      self.sites[path] = path.replace(".", "/")

  # grouping nodes into calls
  def _group(self) -> _Call:
    root = _Call("", "", "")
    open_: list[_Call] = [root]
    closed: set[str] = set()
    where: dict[Any, _Call] = {}
    for node in self.graph.nodes:
      if node.op != "call_function":
        continue
      stack = [(k, v) for k, v in (node.meta.get("nn_module_stack") or {}).items() if v[0]]
      depth = 0  # how much of the open stack this node's stack continues
      while (
        depth < len(stack) and depth + 1 < len(open_) and open_[depth + 1].key == stack[depth][0]
      ):
        depth += 1
      while len(open_) > depth + 1:
        closed.add(open_.pop().key)
      for key, (path, typ) in stack[depth:]:
        if key in closed:  # a call that already ended: run the node in its caller
          break
        call = _Call(key, path, typ if isinstance(typ, str) else getattr(typ, "__name__", ""))
        open_[-1].items.append(call)
        open_.append(call)
      open_[-1].items.append(node)
      for c in open_:
        where.setdefault(node, c)
      where[node] = open_[-1]
    self._where = where
    self._io(root)
    return root

  def _io(self, call: _Call) -> set:
    """Fills inputs/outputs of ``call`` and its children; returns the nodes it defines."""
    defined: set = set()
    used: list = []
    for item in call.items:
      if isinstance(item, _Call):
        defined |= self._io(item)
        used.extend(item.inputs)
      else:
        defined.add(item)
        used.extend(_node_args(item))
    seen = set()
    for n in used:
      if n not in defined and n not in seen and n not in self.state:
        seen.add(n)
        call.inputs.append(n)
    if call.path:
      outs = []
      for n in _ordered(call, defined):
        if any(u not in defined for u in n.users):
          outs.append(n)
      call.outputs = outs
    return defined

  def _index(self, call: _Call) -> None:
    for item in call.items:
      if not isinstance(item, _Call):
        continue
      calls = self.templates.setdefault(item.path, [])
      for earlier in calls:
        if _same_code(earlier, item):
          item.template = earlier
          break
      if item.template is None:
        if calls:  # a call computing differently from the first: its own Flax module
          item.path_alias = f"{item.path}@{len(calls)}"
        calls.append(item)
      self._add_path(getattr(item, "path_alias", item.path))
      self._index(item)

  def _add_path(self, path: str) -> None:
    parts = path.split(".") if path else []
    for i in range(len(parts)):
      parent, child = ".".join(parts[:i]), ".".join(parts[: i + 1])
      kids = self.children.setdefault(parent, [])
      if child not in kids:
        kids.append(child)
      self.children.setdefault(child, [])

  def check_ops(self) -> None:
    missing = []
    for node in self.graph.nodes:
      if node.op == "call_function" and str(node.target) not in ATEN:
        stack = list((node.meta.get("nn_module_stack") or {}).values())
        missing.append(
          {"op": str(node.target), "node": node.name, "module": stack[-1][0] if stack else ""}
        )
      elif node.op not in ("call_function", "placeholder", "output"):
        missing.append({"op": f"{node.op}:{node.target}", "node": node.name, "module": ""})
    if missing:
      ops = sorted({m["op"] for m in missing})
      lines = "; ".join(
        f"{m['op']} at node {m['node']} in module {m['module'] or '<root>'!r}" for m in missing[:20]
      )
      more = f" (and {len(missing) - 20} more nodes)" if len(missing) > 20 else ""
      raise ConversionError(
        f"{len(ops)} ATen operator(s) have no JAX entry: {', '.join(ops)}. Nodes: {lines}{more}",
        code="unsupported_op",
        module=missing[0]["module"],
        ops=missing,
        fix="add the operators to torch_bridge.convert._aten.ATEN, or rewrite that part of "
        "the model with supported ops",
      )

  def template_of(self, path: str) -> _Call:
    if "@" in path.rsplit(".", 1)[-1]:
      base, k = path.rsplit("@", 1)
      return self.templates[base][int(k)]
    return self.templates[path][0] if path else self.root


def _ordered(call: _Call, defined: set) -> list:
  order = []
  for item in call.items:
    if isinstance(item, _Call):
      order.extend(_ordered(item, defined))
    else:
      order.append(item)
  return order


def _same_code(a: _Call, b: _Call) -> bool:
  return _code(a) == _code(b)


def _code(call: _Call) -> tuple:
  """The computation of a call up to renaming of its nodes (for reusing one Flax module)."""
  local = {n: ("in", i) for i, n in enumerate(call.inputs)}
  out = [len(call.inputs), len(call.outputs)]

  def ref(a):
    if isinstance(a, torch.fx.Node):
      return local.get(a, ("state", a.name))
    return a

  def walk(c):
    for item in c.items:
      if isinstance(item, _Call):
        out.append(("call", item.path, tuple(ref(n) for n in item.inputs)))
        for j, n in enumerate(item.outputs):
          local[n] = ("out", len(out), j)
      else:
        local[item] = ("n", len(out))
        out.append((str(item.target), _map_args(item.args, ref), _map_args(item.kwargs, ref)))

  walk(call)
  out.append(tuple(ref(n) for n in call.outputs))
  return tuple(out)


def _map_args(a, fn):
  if isinstance(a, (list, tuple)):
    return tuple(_map_args(x, fn) for x in a)
  if isinstance(a, dict):
    return tuple((k, _map_args(v, fn)) for k, v in a.items())
  if isinstance(a, torch.fx.Node):
    return fn(a)
  if isinstance(a, (torch.dtype, torch.device, torch.layout, torch.memory_format)):
    return str(a)
  return a


def _node_args(node) -> list:
  found = []
  torch.fx.node.map_arg((node.args, node.kwargs), found.append)
  return found


def _owner(fqn: str) -> str:
  return fqn.rsplit(".", 1)[0] if "." in fqn else ""


def _leaf(fqn: str) -> str:
  return fqn.rsplit(".", 1)[-1]


def _error(code: str, module: str, what: str, fix: str) -> ConversionError:
  return ConversionError(
    f"module {module or '<root>'!r}: {what}",
    code=code,
    module=module,
    fix=fix,
  )


# -- the Flax modules ----------------------------------------------------------------------


def _arg(a):
  if isinstance(a, torch.dtype):
    return runtime_dtype(a)
  if isinstance(a, (torch.device, torch.layout, torch.memory_format)):
    return None
  return a


class _Node(nn.Module):
  """The Flax module of one torch module (``path``); see the module docstring."""

  program: Any
  tpath: str

  def setup(self):
    prog = self.program
    prefix = len(self.tpath) + 1 if self.tpath else 0
    self.kids = {c[prefix:]: _Node(prog, c, name=c[prefix:]) for c in prog.children[self.tpath]}
    own = {}
    for node, collection, fqn in prog.owned.get(self.tpath, ()):
      if node.users and node in prog.values:
        value = prog.values[node]
        init = _constant_init(value, prog.dtype_of(node))
        if collection == "params":
          own[_leaf(fqn)] = self.param(_leaf(fqn), init)
        else:
          own[_leaf(fqn)] = self.variable(collection, _leaf(fqn), init, None).value
    self.own = own
    if prog.options.attention_probs:
      self.probs = _Probs(name=PROBS)
    if self.tpath == "" and prog.options.sites:
      self.canon = _site_tree(self, [name for _, name in prog.options.sites])

  def _tb_named(self, name: str, x):
    """``x`` through the canonical site ``name`` (an identity module under the root)."""
    root: Any = self
    while root.tpath:
      root = root.parent
    node = root.canon
    for part in name.split("/"):
      if not hasattr(node, "__getitem__"):
        node = node.kids
      node = node[part]
    if isinstance(x, tuple):  # a module returning (output, extras): the output is the site
      return (node(x[0]),) + x[1:]
    return node(x)

  def __call__(self, *args, **kwargs):
    prog = self.program
    if self.tpath == "":  # the root: flatten the user's inputs as torch did
      leaves, _ = tree.tree_flatten((args, kwargs))
      if len(leaves) != len(prog.user_inputs):
        raise TypeError(
          f"the converted model takes {len(prog.user_inputs)} input arrays "
          f"(as the example inputs), got {len(leaves)}"
        )
      call = prog.root
      env = dict(zip(prog.user_inputs, leaves))
    else:
      call = prog.template_of(self.tpath)
      call = call.template or call
      env = dict(zip(call.inputs, args))
    self._tb_run(call, env)
    if self.tpath == "":
      outs = [
        env.get(n) if isinstance(n, torch.fx.Node) else n for n in _output_node(prog.graph).args[0]
      ]
      name = prog.site_of.get(("", "out"))
      if name is not None and outs:
        outs[0] = self._tb_named(name, outs[0])
      return _unflatten(outs, prog.out_spec)
    outs = [env[n] for n in call.outputs]
    return outs[0] if len(outs) == 1 else tuple(outs)

  def _tb_module(self, path: str) -> _Node:
    node: Any = self
    while node.tpath and not path.startswith(node.tpath + "."):
      node = node.parent
    rel = path[len(node.tpath) + 1 :] if node.tpath else path
    for part in rel.split(".") if rel else ():
      node = node.kids[part]
    return node

  def _tb_state(self, node) -> Any:
    _, fqn = self.program.state[node]
    owner = _owner(fqn)
    return (self if owner == self.tpath else self._tb_module(owner)).own[_leaf(fqn)]

  def _tb_run(self, call: _Call, env: dict) -> None:
    prog = self.program

    def value(a):
      if isinstance(a, torch.fx.Node):
        if a in env:
          return env[a]
        if a in prog.state:
          env[a] = self._tb_state(a)
          return env[a]
        raise KeyError(a.name)
      if isinstance(a, (list, tuple)):
        return type(a)(value(x) for x in a)
      if isinstance(a, dict):
        return {k: value(v) for k, v in a.items()}
      return _arg(a)

    for item in call.items:
      if isinstance(item, _Call):
        module = self._tb_module(getattr(item, "path_alias", None) or item.path)
        args = [value(n) for n in item.inputs]
        name = prog.site_of.get((item.path, "in"))
        if name is not None:
          # The module's main input: the one shaped as its output (a decoder layer's hidden
          # states, not its rotary tables or mask). Every later user of that value in this
          # scope reads the site's value, so an edit there reaches the residual path too.
          k = _main_input(item)
          args[k] = self._tb_named(name, args[k])
          env[item.inputs[k]] = args[k]
        result = module(*args)
        name = prog.site_of.get((item.path, "out"))
        if name is not None:
          result = self._tb_named(name, result)
        outs = item.outputs
        if len(outs) == 1:
          env[outs[0]] = result
        else:
          env.update(zip(outs, result))
        continue
      target = str(item.target)
      args, kwargs = value(item.args), value(item.kwargs)
      probs_site = prog.site_of.get((self.tpath, "probs"))
      if prog.options.attention_probs and target in _SOFTMAX:
        out = self.probs(args[0], args[1])
        if probs_site is not None:
          out = self._tb_named(probs_site, out)
      elif prog.options.attention_probs and target == _SDPA:
        logits, v = sdpa_logits(*args, **kwargs)
        probs = self.probs(logits, -1)
        if probs_site is not None:
          probs = self._tb_named(probs_site, probs)
        out = jnp.matmul(probs, v, precision=HI)
      else:
        out = ATEN[target](*args, **kwargs)
      env[item] = _as_recorded(out, item, prog.dtype_override)


def _main_input(call: _Call) -> int:
  """The index of ``call``'s input shaped as its first output (else 0)."""
  want = getattr(call.outputs[0].meta.get("val"), "shape", None) if call.outputs else None
  for k, n in enumerate(call.inputs):
    if isinstance(n, torch.fx.Node) and getattr(n.meta.get("val"), "shape", None) == want:
      return k
  return 0


def _site_tree(root: nn.Module, names: list) -> dict:
  """Identity modules for the "/"-separated site ``names``, as nested dicts of modules whose
  paths are the names (``blocks_3/attn/pattern``)."""

  class _Group(nn.Module):
    names: tuple

    def setup(self):
      self.kids = _kids(self.names)

  def _kids(names):
    groups: dict = {}
    leaves = []
    for n in names:
      head, _, rest = n.partition("/")
      if rest:
        groups.setdefault(head, []).append(rest)
      elif head not in leaves:
        leaves.append(head)
    kids = {h: _Group(tuple(r), name=h) for h, r in groups.items()}
    kids.update({h: Named(name=h) for h in leaves})
    return kids

  return _kids(names)


class _Probs(nn.Module):
  """Softmax in its own module, so that attention probabilities are a site."""

  @nn.compact
  def __call__(self, logits, axis):
    return jax.nn.softmax(logits, axis=axis)


def _constant_init(value, dtype):
  array = _to_numpy(value)

  def init(*_):
    return jnp.asarray(array, dtype=dtype)

  return init


def _to_numpy(t: torch.Tensor) -> np.ndarray:
  t = t.detach().cpu()
  if t.dtype == torch.bfloat16:
    return t.float().numpy().astype(jnp.bfloat16)
  return t.numpy()


def _as_recorded(out, node, override=None):
  """Casts a tensor result to the dtype torch recorded for the node (floating: ``override``)."""
  val = node.meta.get("val")
  if isinstance(val, torch.Tensor) and isinstance(out, jax.Array):
    want = runtime_dtype(val.dtype)
    if override is not None and val.dtype.is_floating_point:
      want = override
    if out.dtype != want:
      out = out.astype(want)
  return out


def _output_node(graph):
  for node in reversed(graph.nodes):
    if node.op == "output":
      return node
  raise AssertionError("graph without output")


def _unflatten(leaves: list, spec) -> Any:
  """Rebuilds torch's output structure with JAX containers (other nodes become dicts)."""
  it = iter(leaves)

  def build(s):
    if s.is_leaf():
      return next(it)
    kids = [build(c) for c in s.children_specs]
    if s.type in (tuple, list):
      return s.type(kids)
    if s.type is dict or isinstance(s.context, (list, tuple)):
      return dict(zip(s.context, kids))
    if _is_namedtuple(s.type):
      return s.type(*kids)
    return tuple(kids)

  return build(spec)


def _is_namedtuple(t) -> bool:
  return isinstance(t, type) and issubclass(t, tuple) and hasattr(t, "_fields")


# -- conversion ---------------------------------------------------------------------


def convert_exported(ep, options: ExportOptions, dtype=None):
  """Builds ``(flax_module, variables, site_map)`` from an exported program."""
  program = Program(ep, options)
  program.dtype_override = dtype
  program.dtype_of = lambda node: _state_dtype(program, node)
  _check_dtypes(program)
  program.check_ops()
  module = _Node(program, "")
  variables: dict = {}
  for node, (collection, fqn) in program.state.items():
    if node not in program.values:
      continue
    if not node.users:  # tied: export uses one placeholder; the other has no users
      continue
    d = variables.setdefault(collection, {})
    *parents, leaf = fqn.split(".")
    for p in parents:
      d = d.setdefault(p, {})
    d[leaf] = jnp.asarray(_to_numpy(program.values[node]), dtype=program.dtype_of(node))
  variables.setdefault("params", {})
  site_map = {path: flax for path, flax in program.sites.items()}
  site_map[""] = ""
  program.tied = _tied(program)
  return module, variables, site_map, program


def _state_dtype(program, node):
  value = program.values[node]
  if program.dtype_override is not None and value.is_floating_point():
    return program.dtype_override
  return runtime_dtype(value.dtype)


def _check_dtypes(program) -> None:
  x64 = jax.config.read("jax_enable_x64")
  for node in program.graph.nodes:
    val = node.meta.get("val")
    vals = val if isinstance(val, (list, tuple)) else [val]
    for v in vals:
      if not isinstance(v, torch.Tensor):
        continue
      module = ""
      stack = list((node.meta.get("nn_module_stack") or {}).values())
      if stack:
        module = stack[-1][0]
      elif node in program.state:
        module = _owner(program.state[node][1])
      if v.dtype in JAX_LACKS or v.is_complex() or v.is_quantized:
        lacks = "which JAX lacks" if v.dtype in JAX_LACKS else "which the converter lacks"
        raise _error(
          "unsupported_dtype",
          module,
          f"node {node.name} has dtype {v.dtype}, {lacks}",
          "convert the model to a real floating dtype (e.g. model.float())",
        )
      if v.dtype == torch.float64 and not x64 and program.dtype_override is None:
        raise _error(
          "unsupported_dtype",
          module,
          f"node {node.name} is float64, which needs jax_enable_x64",
          'enable it with jax.config.update("jax_enable_x64", True) or pass dtype=jnp.float32',
        )
      try:
        runtime_dtype(v.dtype)
      except TypeError:
        raise _error(
          "unsupported_dtype",
          module,
          f"node {node.name} has dtype {v.dtype}, which JAX lacks",
          "convert the model to float32, float64 or bfloat16",
        ) from None


def _tied(program) -> dict[str, str]:
  """Parameters torch ties to another (``{"transformer.wte.weight": "lm_head.weight"}``)."""
  tied = {}
  by_id: dict[int, str] = {}
  for node, (_collection, fqn) in program.state.items():
    if node not in program.values:
      continue
    key = id(program.values[node])
    if key in by_id:
      a, b = by_id[key], fqn
      used = a if any(n.users for n, (_, f) in program.state.items() if f == a) else b
      tied[b if used == a else a] = used
    else:
      by_id[key] = fqn
  return tied
