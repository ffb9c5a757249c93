"""Floor 6: the model as a flat program whose every value is a labelled site.

``jl.trace`` turns the model call into a jaxpr (``jax.make_jaxpr``) while a Flax
interceptor marks each module output with an identity ``checkpoint_name`` equation
and opens a named scope per module call, so that every equation can be attributed
to the module that ran it. Nested ``jit`` calls are inlined; every other equation
is one *op site*, labelled ``<primitive>_<n>`` in the order it runs
(``dot_general_3``). Module outputs are *module sites*, labelled by path.
``interpret.py`` evaluates the program.

Layer stacks: a ``scan`` whose body runs modules (``nn.scan``, ``nnx.scan``) is
kept as a scan, and its body becomes a sub-program (see ``interpret.py``).

Other control flow: ``while`` and ``cond`` bodies, and scans nested in a scanned
body, run as single op sites (``remat`` bodies are inlined); a module site inside
one cannot be edited or selected for saving, and asking for one raises
``unsupported_control_flow``.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
from typing import Any

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.extend import core as jcore

from jaxlens._src import runtime
from jaxlens._src.edit import is_array
from jaxlens._src.errors import InvalidArgumentError, SiteError
from jaxlens._src.sites import SiteInfo, hits, unmatched_error

MARK = "jaxlens:"
INPUT_MARK = "jlin:"  # a module call's input leaf (save_inputs); not a site of its own
SCOPE = "jl@"
_INLINE = ("jit", "pjit", "closed_call", "core_call")
_REMAT = ("remat2", "checkpoint")
_CONTROL = ("scan", "while", "cond", "custom_vjp_call", "custom_vjp_call_jaxpr")


@dataclasses.dataclass
class Node:
  """One equation of the flattened program."""

  prim: Any
  params: dict
  ins: list  # int ids, or ("lit", value)
  outs: list[int]
  infos: list[SiteInfo | None]
  module: str  # the module path that ran it ("" for the root)
  # A scanned layer stack: the body as a sub-program, and the body's constants.
  sub: "Program | None" = None
  sub_consts: list = dataclasses.field(default_factory=list)


class Program:
  """A model call as a flat list of nodes over integer value ids (static data).

  Equality is identity: a program is built once per capture.
  """

  def __init__(self):
    self.nodes: list[Node] = []
    self.n_ids = 0
    self.in_ids: list[int] = []
    self.const_ids: list[int] = []
    self.out_ids: list = []
    self.in_tree = None
    self.in_shapes: tuple | None = None  # the shapes of the captured call's input leaves
    self.out_tree = None
    self.n_var_leaves = 0
    self.module_infos: dict[str, SiteInfo] = {}
    self.hidden: dict[str, str] = {}  # module label -> control-flow primitive hiding it
    self.nonarray: dict[str, tuple] = {}  # module label -> (info, type) of non-array outputs
    self.producer: dict[int, int] = {}
    self.data_ids: set[int] = set()  # values that depend on the model inputs
    self.id_label: dict[int, str] = {}
    # save_inputs: module label -> (treedef of (args, kwargs), [value id or ("static", leaf)])
    self.input_sites: dict[str, tuple] = {}
    self.input_marks: dict[str, dict[int, int]] = {}  # call label -> {leaf: value id}

  def fresh(self) -> int:
    self.n_ids += 1
    return self.n_ids - 1

  @property
  def infos(self) -> list[SiteInfo]:
    out = []
    for n in self.nodes:
      if n.sub is not None:
        out.extend(n.sub.infos)
      out.extend(i for i in n.infos if i is not None)
    return out

  def __hash__(self):
    return id(self)

  def __eq__(self, other):
    return self is other


def _module_of(name_stack) -> str:
  parts = [str(s.name) for s in getattr(name_stack, "stack", ()) if hasattr(s, "name")]
  for part in reversed(parts):
    if part.startswith(SCOPE):
      return part[len(SCOPE) :]
  text = str(name_stack)
  for part in reversed(text.split("/")):
    if part.startswith(SCOPE):
      return part[len(SCOPE) :]
  return ""


def _has_marks(j) -> bool:
  j = getattr(j, "jaxpr", j)
  for e in j.eqns:
    if e.primitive.name == "name" and str(e.params.get("name", "")).startswith(MARK):
      return True
    for v in e.params.values():
      vs = v if isinstance(v, (tuple, list)) else (v,)
      if any(isinstance(w, (jcore.Jaxpr, jcore.ClosedJaxpr)) and _has_marks(w) for w in vs):
        return True
  return False


def _flatten(
  prog: Program, jaxpr, in_ids, const_vals, consts_out, prefix_stack=None, in_scan=False
):
  """Appends the nodes of ``jaxpr`` to ``prog``; returns the ids of its outputs."""
  env: dict = {}
  for var, i in zip(jaxpr.invars, in_ids):
    env[var] = i
  for var, val in zip(jaxpr.constvars, const_vals):
    i = prog.fresh()
    prog.const_ids.append(i)
    consts_out.append(val)
    env[var] = i

  def read(v):
    if isinstance(v, jcore.Literal):
      return ("lit", v.val)
    return env[v]

  for eqn in jaxpr.eqns:
    stack = (
      eqn.source_info.name_stack
      if prefix_stack is None
      else prefix_stack + eqn.source_info.name_stack
    )
    name = eqn.primitive.name
    if name in _INLINE + _REMAT and "jaxpr" in eqn.params:
      # Nested jit calls, and remat bodies, are inlined: their ops become sites. (A
      # remat body evaluated by the interpreter is not rematerialised.)
      inner = eqn.params["jaxpr"]
      closed = isinstance(inner, jcore.ClosedJaxpr)
      outs = _flatten(
        prog,
        inner.jaxpr if closed else inner,
        [read(v) for v in eqn.invars],
        inner.consts if closed else [],
        consts_out,
        stack,
        in_scan,
      )
      for var, o in zip(eqn.outvars, outs):
        env[var] = o
      continue
    if name == "scan" and not in_scan and _has_marks(eqn.params["jaxpr"]):
      # A layer stack: its body becomes a sub-program sharing the module tables.
      body = eqn.params["jaxpr"]
      sub = Program()
      sub.module_infos, sub.hidden, sub.nonarray = prog.module_infos, prog.hidden, prog.nonarray
      sub.in_ids = [sub.fresh() for _ in body.jaxpr.invars]
      sub_consts: list = []
      sub.out_ids = _flatten(
        sub, body.jaxpr, sub.in_ids, body.consts, sub_consts, stack, in_scan=True
      )
      outs = []
      for var in eqn.outvars:
        i = prog.fresh()
        env[var] = i
        outs.append(i)
      prog.nodes.append(
        Node(
          eqn.primitive,
          dict(eqn.params),
          [read(v) for v in eqn.invars],
          outs,
          [None] * len(outs),
          _module_of(stack),
          sub,
          sub_consts,
        )
      )
      continue
    if name in _CONTROL or any(
      isinstance(v, (jcore.Jaxpr, jcore.ClosedJaxpr)) for v in eqn.params.values()
    ):
      _note_hidden(prog, eqn)
    outs = []
    for var in eqn.outvars:
      i = prog.fresh()
      env[var] = i
      outs.append(i)
    ins = [read(v) for v in eqn.invars]
    # A literal id mapping (outer literal passed into an inlined call) is a tuple.
    prog.nodes.append(
      Node(
        eqn.primitive,
        eqn.primitive.get_bind_params(eqn.params),
        ins,
        outs,
        [None] * len(outs),
        _module_of(stack),
      )
    )
  return [read(v) for v in jaxpr.outvars]


def _note_hidden(prog, eqn):
  def walk(j):
    j = getattr(j, "jaxpr", j)
    for e in j.eqns:
      if e.primitive.name == "name" and str(e.params.get("name", "")).startswith(MARK):
        prog.hidden[e.params["name"][len(MARK) :]] = eqn.primitive.name
      for v in e.params.values():
        if isinstance(v, (jcore.Jaxpr, jcore.ClosedJaxpr)):
          walk(v)
        elif isinstance(v, (tuple, list)):
          for w in v:
            if isinstance(w, (jcore.Jaxpr, jcore.ClosedJaxpr)):
              walk(w)

  for v in eqn.params.values():
    if isinstance(v, (jcore.Jaxpr, jcore.ClosedJaxpr)):
      walk(v)
    elif isinstance(v, (tuple, list)):
      for w in v:
        if isinstance(w, (jcore.Jaxpr, jcore.ClosedJaxpr)):
          walk(w)


def _label_nodes(prog: Program, counts=None, calls=None, seen=None, layers=None):
  """Labels every node. Module calls are numbered in the order their markers appear
  in the program: Flax traces a scanned body more than once, and only the last trace
  is in the jaxpr, so the interceptor's own call counts would run ahead."""
  top = counts is None
  if top:
    counts, calls, seen = {}, {}, {}
  for k, node in enumerate(prog.nodes):
    for i in node.outs:
      prog.producer[i] = k
    if node.sub is not None:
      _label_nodes(node.sub, counts, calls, seen, node.params["length"])
    pname = node.prim.name
    marker = node.params.get("name") if pname == "name" else None
    if isinstance(marker, str) and marker.startswith(INPUT_MARK):
      # "jlin:<call label>#<leaf>": an identity on a module call's input leaf.
      call_label, _, leaf = marker[len(INPUT_MARK) :].rpartition("#")
      prog.id_label[node.outs[0]] = f"{call_label}.input[{leaf}]"
      if layers is None:
        prog.input_marks.setdefault(call_label, {})[int(leaf)] = node.outs[0]
      continue
    if isinstance(marker, str) and marker.startswith(MARK):
      first = prog.module_infos[marker[len(MARK) :]]
      key = (first.path, first.method, first.output)
      calls[key] = calls.get(key, 0) + 1
      info = dataclasses.replace(first, call=calls[key], layers=layers)
      seen[marker[len(MARK) :]] = info
      node.infos = [info]
      prog.id_label[node.outs[0]] = info.label
      continue
    counts[pname] = counts.get(pname, 0) + 1
    for j, out in enumerate(node.outs):
      info = SiteInfo(
        node.module,
        "",
        counts[pname],
        "",
        func=pname,
        kind="op",
        index=j if len(node.outs) > 1 else None,
        layers=layers,
      )
      node.infos[j] = info
      prog.id_label[out] = info.label
  if top:
    # Inputs by the final labels of their calls (array-valued module calls outside scans).
    for call_label, (tree, leaves) in list(prog.input_sites.items()):
      marks = prog.input_marks.get(call_label, {})
      final = seen.get(call_label)
      del prog.input_sites[call_label]
      if final is not None and final.layers is None:
        prog.input_sites[final.label] = (
          tree,
          [marks.get(k, leaf) for k, leaf in enumerate(leaves)],
        )
    # Module infos by their final labels; modules hidden in control flow keep theirs.
    kept = {
      old: info for old, info in prog.module_infos.items() if old in prog.hidden and old not in seen
    }
    prog.module_infos.clear()
    prog.module_infos.update({info.label: info for info in seen.values()})
    prog.module_infos.update(kept)


# Captured programs, reused as ``jax.jit`` reuses a trace: for the same model (an unbound
# linen module compared by its fields, an NNX graph definition), input structure, shapes and
# dtypes, static keyword arguments and JAX configuration. Capturing costs more than
# evaluating the small models of interpretability work, and sweeps, patching and training
# loops trace one model many times. Least recently used first out.
_PROGRAMS: collections.OrderedDict = collections.OrderedDict()
_PROGRAMS_MAX = 32
_programs_lock = threading.Lock()


def clear_caches() -> None:
  """Forgets every captured program, so that the next trace of each model runs its Python
  code again (as ``jax.clear_caches`` does for jitted functions): for a model whose Python
  reads state that its fields and inputs do not show, such as a global flag."""
  with _programs_lock:
    _PROGRAMS.clear()


try:  # what jax.jit keys its traces on: every configuration option that changes a trace
  from jax._src.config import trace_context as _trace_context
except ImportError:  # pragma: no cover - a jax without it: the options that matter here

  def _trace_context():
    return (
      jax.config.jax_enable_x64,
      jax.config.jax_numpy_dtype_promotion,
      jax.config.jax_default_matmul_precision,
    )


def _static(tree):
  """A hashable stand-in for keyword arguments that hold no arrays (an array would be baked
  into the program as a constant), or None. Each leaf is keyed with its type: ``True``
  and ``1`` trace differently."""
  leaves, treedef = jax.tree.flatten(tree)
  if any(is_array(x) for x in leaves):
    return None
  return treedef, tuple((type(x), x) for x in leaves)


def _program_key(module, leaves, in_tree, kwargs, method, apply_kwargs, save_inputs):
  call = module.cache_key()  # LinenCall or NnxCall (model_calls)
  statics = (_static(kwargs), _static(apply_kwargs))
  if call is None or None in statics:
    return None
  context = _trace_context()
  avals = tuple((jnp.shape(x), jnp.result_type(x)) for x in leaves)
  key = (call, in_tree, avals, statics, method, save_inputs, context)
  try:
    hash(key)
  except TypeError:  # a module field or argument that cannot be hashed: capture every time
    return None
  return key


def build_program(
  module, variables, inputs, kwargs, method, apply_kwargs, *, save_inputs: bool = False
):
  """Captures ``module.run(variables, inputs, ...)`` (a model call from ``calls``) as a
  :class:`Program` with its consts and flat input leaves.

  With ``save_inputs`` every array leaf of each module call's ``(args, kwargs)`` is
  marked too (an identity that is not a site), so that the evaluation can return the
  inputs of the saved module sites; without it the program is unchanged.

  A program is static data and is shared: the same call on inputs of the same structure,
  shapes and dtypes returns the program captured first (see ``_PROGRAMS``)."""
  leaves, in_tree = jax.tree.flatten((variables, inputs))
  key = _program_key(module, leaves, in_tree, kwargs, method, apply_kwargs, save_inputs)
  if key is not None:
    with _programs_lock:
      hit = _PROGRAMS.get(key)
      if hit is not None:
        _PROGRAMS.move_to_end(key)
    if hit is not None:
      return hit[0], list(hit[1]), leaves
  prog, consts = _capture_program(
    module, variables, inputs, kwargs, method, apply_kwargs, save_inputs, leaves, in_tree
  )
  # A constant that is a tracer belongs to an enclosing transformation's trace.
  if key is not None and not any(isinstance(c, jax.core.Tracer) for c in consts):
    with _programs_lock:
      _PROGRAMS[key] = (prog, tuple(consts))
      while len(_PROGRAMS) > _PROGRAMS_MAX:
        _PROGRAMS.popitem(last=False)
  return prog, consts, leaves


def _capture_program(
  module, variables, inputs, kwargs, method, apply_kwargs, save_inputs, leaves, in_tree
):
  prog = Program()
  calls: dict[tuple, int] = {}

  def interceptor(next_fun, args, kw, context):
    path = "/".join(context.path)
    key = (path, context.method_name)
    calls[key] = calls.get(key, 0) + 1
    info = SiteInfo(path, context.method_name, calls[key], context.module_type)
    if save_inputs and path:
      leaves, tree = jax.tree.flatten((args, kw))
      marked = [
        checkpoint_name(x, f"{INPUT_MARK}{info.label}#{k}")
        if isinstance(x, jax.Array) or hasattr(x, "aval")
        else x
        for k, x in enumerate(leaves)
      ]
      prog.input_sites[info.label] = (
        tree,
        [("static", x) if m is x else None for x, m in zip(leaves, marked)],
      )
      args, kw = jax.tree.unflatten(tree, marked)
    if path:
      with jax.named_scope(SCOPE + path):
        out = next_fun(*args, **kw)
    else:
      out = next_fun(*args, **kw)
    if path and (isinstance(out, jax.Array) or hasattr(out, "aval")):
      prog.module_infos[info.label] = info
      return checkpoint_name(out, MARK + info.label)
    if path:
      prog.nonarray[info.label] = (info, type(out).__name__)
      # Each array element of a tuple/list/dict output is a site of its own.
      marked = {}
      for k, value in runtime.output_elements(out):
        one = dataclasses.replace(info, output=k)
        prog.module_infos[one.label] = one
        marked[k] = checkpoint_name(value, MARK + one.label)
      out = runtime.replace_elements(out, marked)
    return out

  prog.in_tree = in_tree
  prog.in_shapes = tuple(jnp.shape(x) for x in leaves)
  prog.n_var_leaves = len(jax.tree.leaves(variables))
  out_box = []

  def fn(*flat):
    v, xs = jax.tree.unflatten(in_tree, flat)
    out = module.run(v, xs, kwargs, interceptor, method, apply_kwargs)
    out_leaves, out_tree = jax.tree.flatten(out)
    out_box.append(out_tree)
    return out_leaves

  abstract = [jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x)) for x in leaves]
  closed = jax.make_jaxpr(fn)(*abstract)
  prog.out_tree = out_box[-1]
  prog.in_ids = [prog.fresh() for _ in closed.jaxpr.invars]
  consts: list = []
  prog.out_ids = _flatten(prog, closed.jaxpr, prog.in_ids, closed.consts, consts)
  _label_nodes(prog)
  data = set(prog.in_ids[prog.n_var_leaves :])
  for node in prog.nodes:
    if any(not isinstance(a, tuple) and a in data for a in node.ins):
      data.update(node.outs)
  prog.data_ids = data
  for k, i in enumerate(prog.in_ids):
    prog.id_label[i] = (
      f"input_{k - prog.n_var_leaves}" if k >= prog.n_var_leaves else f"variables_{k}"
    )
  return prog, consts


def check_selectable(prog: Program, selector, what: str, *, editing: bool = True):
  """Raises when ``selector`` names a module site that cannot be edited or saved."""
  if editing:
    # A module returning a non-array may run in a layer stack: let layer selectors see it.
    longest = max((n.params["length"] for n in prog.nodes if n.sub is not None), default=None)
    for label, (info, type_name) in prog.nonarray.items():
      if hits(selector, dataclasses.replace(info, layers=longest)):
        raise InvalidArgumentError(
          f"{what}: the site value is a {type_name}, not an array; edits apply to array sites",
          code="site_not_array",
          site=label,
          fix=f"select one element: jl.module({info.path!r}, output=0)",
        )
  if not editing and getattr(selector, "broad", False):
    # "Every site" skips the ones hidden in control flow rather than refusing.
    return
  for label, prim in prog.hidden.items():
    info = prog.module_infos.get(label)
    if info is not None and selector.matches(info):
      raise InvalidArgumentError(
        f"{what}: the module site {label!r} runs inside a `{prim}` body, which jaxlens "
        "runs as one op site; its value cannot be edited or saved from outside",
        code="unsupported_control_flow",
        site=label,
        fix=f"select the `{prim}` op site itself, or move the module out of the {prim}",
      )


def save_miss(prog: Program, selector) -> Exception:
  """The error for a ``save=`` selector that selected nothing: names what did run.

  A module that ran but returned a non-array (a tuple, a dict) is named as such,
  with the spelling that selects one of its elements.
  """
  for label, (info, type_name) in prog.nonarray.items():
    if selector.matches(info):
      return SiteError(
        f"save=: the module {label!r} ran but returned a {type_name}, not an array; "
        "select one element of its output",
        code="site_not_array",
        site=repr(selector),
        fix=f"jl.module({info.path!r}, output=0)",
      )
  return unmatched_error(selector, prog.infos, "save=")
