"""Floor 7: evaluating a captured program: edits, saves, replay cones, scan bodies.

The program (``program.py``) is evaluated by a small interpreter that binds each
primitive under whatever transforms are active (``jit``, ``grad``, ``vmap``),
applies the rules at every site they select (``runtime.fire_rules``), and keeps
the values ``save=`` selects. Replay evaluates only the downstream cone of the
edited sites, taking the values it needs from the saved ones and recomputing the
rest from the stored inputs.

Layer stacks: a scanned body is evaluated by the same interpreter inside
``lax.scan``, with the iteration index in the carry. A site in the body stands
for every layer at once (saved stacked along axis 0); an edit at one layer
(``jl.module(path, layer=k)``) is applied where the index equals ``k``, so the
stack is never unrolled.

:func:`capture` is what every program door starts with: build the program, check
the selectors against it, probe the keep_grad sites, and evaluate it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from jaxlens._src import dependence, program, runtime
from jaxlens._src.edit import FireContext
from jaxlens._src.program import Program
from jaxlens._src.sites import SiteInfo, matched_layers, unmatched_error


def _is_float(x) -> bool:
  return jnp.issubdtype(jnp.result_type(x), jnp.inexact)


class Evaluation:
  """The values of one evaluation of a program."""

  def __init__(self, n_rules: int, probe: bool):
    self.env: dict[int, Any] = {}
    self.saved: dict[str, Any] = {}
    self.saved_infos: dict[str, SiteInfo] = {}
    self.firing = runtime.Firing(n_rules, probe)
    self.frontier: dict[str, Any] = {}
    self.saved_layers: dict[str, list[int]] = {}  # scan-body sites: the layers saved
    self.saved_inputs: dict[str, Any] = {}  # label -> (args, kwargs) of a saved module call

  @property
  def fired(self) -> list[int]:
    return self.firing.fired


@dataclasses.dataclass(frozen=True)
class Replay:
  """What makes an evaluation a replay: only the downstream cone of ``starts`` runs.

  Attributes:
    starts: the labels of the edited sites.
    known: label -> value of saved sites, used for values outside the cone.
    releaf: re-leaf the values entering the cone (differentiable replay).
    frontier_values: label -> value overriding frontier values (attribution).
    reuse: start sites (module sites outside layer stacks) whose value before the edit is
      ``known[label]``; the replay starts from that value instead of recomputing the
      module's own operations and the inputs they need.
  """

  starts: tuple
  known: dict = dataclasses.field(default_factory=dict)
  releaf: bool = False
  frontier_values: dict | None = None
  reuse: tuple = ()


@dataclasses.dataclass(frozen=True)
class Plan:
  """How a program is evaluated: the options every evaluation of it shares, scan bodies
  included (a replay's options, ``replay``, apply at the top level only).

  Attributes:
    rules: (selector, edit) pairs applied at every evaluated site they match.
    save: a selector of the sites to keep, or None.
    grad_disabled: inside ``jl.no_grad`` (edits see it in their fire context).
    probe: fire edits without keep_grad checks and record keep_grad site values.
    releaf_layers: differentiable replay from sites in a scan body: label -> the first
      layer replayed. At that layer the values entering the body, and the site's own value
      before the edit, are re-leafed, as the frontier of the same replay on the unrolled
      stack would be.
    step: the decoding step, passed to the edits as ``FireContext.step``.
    replay: when given, evaluate only the downstream cone of the edited sites.
  """

  rules: tuple = ()
  save: Any = None
  grad_disabled: bool = False
  probe: bool = False
  releaf_layers: dict | None = None
  step: Any = None
  replay: Replay | None = None


def evaluate(
  prog: Program,
  args,
  consts,
  plan: Plan,
  *,
  layer=None,
  site_values: dict | None = None,
) -> Evaluation:
  """Runs the program, applying ``plan.rules`` and keeping the sites ``plan.save`` selects.

  Args:
    prog: the program.
    args, consts: the flat input leaves and the program's constants.
    plan: the options (:class:`Plan`).
    layer: inside a scan body, the traced iteration index.
    site_values: the module sites that already ran (a scan body sees its caller's).
  """
  rules, save, replay = plan.rules, plan.save, plan.replay
  releaf = replay is not None and replay.releaf
  frontier_values = None if replay is None else replay.frontier_values
  releaf_layers = plan.releaf_layers
  ev = Evaluation(len(rules), plan.probe)
  env = ev.env
  for i, a in zip(prog.in_ids, args):
    env[i] = a
  for i, c in zip(prog.const_ids, consts):
    env[i] = c

  run_nodes = range(len(prog.nodes))
  frontier_ids: set[int] = set()
  reused: dict[int, Any] = {}  # node index -> the saved value its site starts from
  if replay is not None:
    known = replay.known
    reuse_labels = set(replay.reuse) & set(known)
    run_nodes, frontier_ids, reused_nodes = _replay_plan(prog, replay.starts, known, reuse_labels)
    for k in reused_nodes:
      reused[k] = known[prog.nodes[k].infos[0].label]
    # Values read by the nodes that run but produced by none of them come from the
    # saved sites (the frontier, and saved values the recomputed nodes need).
    produced = {i for k in run_nodes for i in prog.nodes[k].outs}
    for k in run_nodes:
      for i in prog.nodes[k].ins:
        if isinstance(i, tuple) or i in produced or i in env:
          continue
        lbl = prog.id_label.get(i)
        if lbl in known:
          env[i] = known[lbl]
  site_values = {} if site_values is None else site_values

  def read(a):
    if isinstance(a, tuple):
      return a[1]
    return env[a]

  frontier_ids &= prog.data_ids
  if releaf or frontier_values:
    for i in frontier_ids:
      if i in env:
        lbl = prog.id_label[i]
        if frontier_values is not None and lbl in frontier_values:
          env[i] = frontier_values[lbl]
        elif releaf and _is_float(env[i]):
          env[i] = jax.lax.stop_gradient(env[i])
        ev.frontier[lbl] = env[i]

  pending_frontier = {i for i in frontier_ids if i not in env}
  for k in run_nodes:
    node = prog.nodes[k]
    if k in reused:
      # The site's saved value, as it was before the edit: the module is not recomputed.
      # It enters the replayed computation from outside, so it is a frontier value.
      lbl = node.infos[0].label
      val = reused[k]
      if frontier_values is not None and lbl in frontier_values:
        val = frontier_values[lbl]
      elif releaf and _is_float(val):
        val = jax.lax.stop_gradient(val)
      if node.outs[0] in prog.data_ids and (releaf or frontier_values):
        ev.frontier[lbl] = val
      outs = [val]
    elif node.sub is not None:
      outs = _eval_scan(node, [read(a) for a in node.ins], plan, ev, site_values)
    else:
      out = node.prim.bind(*[read(a) for a in node.ins], **node.params)
      outs = list(out) if node.prim.multiple_results else [out]
    for j, (i, info) in enumerate(zip(node.outs, node.infos)):
      val = outs[j]
      if info is not None:
        if releaf_layers and info.label in releaf_layers and _is_float(val):
          val = jnp.where(layer == releaf_layers[info.label], jax.lax.stop_gradient(val), val)
        ctx = FireContext(
          info.label,
          info.path,
          info.module_type,
          site_values=site_values,
          grad_disabled=plan.grad_disabled,
          layer=layer,
          step=plan.step,
        )
        val = runtime.fire_rules(rules, info, val, ctx, ev.firing, layer)
        if info.kind == "module":
          site_values[info.label] = (info, val)
        _keep(info, val, save, ev)
      if i in pending_frontier:
        lbl = prog.id_label[i]
        if frontier_values is not None and lbl in frontier_values:
          val = frontier_values[lbl]
        elif releaf and _is_float(val):
          val = jax.lax.stop_gradient(val)
        ev.frontier[lbl] = val
      env[i] = val
  for lbl in ev.saved:
    # The inputs of a saved module call, where this evaluation computed them.
    tree, leaves = prog.input_sites.get(lbl, (None, None))
    if tree is not None and all(
      isinstance(a, tuple) or (a is not None and a in env) for a in leaves
    ):
      ev.saved_inputs[lbl] = jax.tree.unflatten(
        tree, [a[1] if isinstance(a, tuple) else env[a] for a in leaves]
      )
  return ev


def _keep(info, val, save, ev):
  """Saves the site value when ``save`` selects it (for a scan-body site: some layers)."""
  if save is None:
    return
  if info.layers is None:
    if save.matches(info):
      ev.saved[info.label] = val
      ev.saved_infos[info.label] = info
    return
  chosen = matched_layers(save, info)
  if chosen:
    ev.saved[info.label] = val
    ev.saved_infos[info.label] = info
    ev.saved_layers[info.label] = chosen


def _eval_scan(node, invals, plan: Plan, outer: Evaluation, site_values):
  """Runs a layer stack as ``lax.scan`` over its body sub-program."""
  p = node.params
  nc, ncar, n, rev = p["num_consts"], p["num_carry"], p["length"], p["reverse"]
  consts, carry, xs = invals[:nc], invals[nc : nc + ncar], invals[nc + ncar :]
  box: dict = {}
  body_labels = {i.label for i in node.sub.infos}
  firsts = [k for lbl, k in (plan.releaf_layers or {}).items() if lbl in body_labels]
  body_plan = dataclasses.replace(plan, replay=None)
  first = min(firsts) if firsts else None

  def body(c, x):
    k, carry = c
    if first is not None:
      carry = [
        jnp.where(k == first, jax.lax.stop_gradient(a), a) if _is_float(a) else a for a in carry
      ]
    sev = evaluate(
      node.sub,
      [*consts, *carry, *x],
      node.sub_consts,
      body_plan,
      layer=k,
      site_values=dict(site_values),
    )
    outs = [o[1] if isinstance(o, tuple) else sev.env[o] for o in node.sub.out_ids]
    box["ev"], box["labels"] = sev, list(sev.saved)
    return (k + (-1 if rev else 1), outs[:ncar]), (
      outs[ncar:],
      [sev.saved[lbl] for lbl in box["labels"]],
    )

  start = jnp.asarray(n - 1 if rev else 0, jnp.int32)
  (_, carry_out), (ys, stacks) = jax.lax.scan(
    body, (start, list(carry)), list(xs), length=n, reverse=rev, unroll=p.get("unroll", 1)
  )
  sev = box["ev"]
  outer.firing.merge(sev.firing)
  for lbl, stack in zip(box["labels"], stacks):
    info, chosen = sev.saved_infos[lbl], sev.saved_layers[lbl]
    if len(chosen) == n:
      outer.saved[lbl], outer.saved_infos[lbl] = stack, info
    else:
      for k in chosen:
        one = info.at_layer(k)
        outer.saved[one.label], outer.saved_infos[one.label] = stack[k], one
  return [*carry_out, *ys]


def _replay_plan(prog: Program, start_labels, known: dict, reuse_labels=frozenset()):
  """The nodes to evaluate for a replay from ``start_labels``, the frontier ids, and
  the start nodes that read their site's saved value (``reuse_labels``) instead of
  their input."""
  starts = set(start_labels)
  cone: set[int] = set()
  tainted: set[int] = set()
  reused: set[int] = set()
  for k, node in enumerate(prog.nodes):
    is_start = any(info is not None and info.label in starts for info in node.infos) or (
      node.sub is not None and any(info.label in starts for info in node.sub.infos)
    )
    if is_start or any(not isinstance(a, tuple) and a in tainted for a in node.ins):
      cone.add(k)
      tainted.update(node.outs)
      if (
        is_start
        and node.sub is None
        and len(node.infos) == 1
        and node.infos[0] is not None
        and node.infos[0].kind == "module"
        and node.infos[0].layers is None
        and node.infos[0].label in reuse_labels
        and not any(not isinstance(a, tuple) and a in tainted for a in node.ins)
      ):
        reused.add(k)
  # Values the cone reads from outside it. Only those computed from the model inputs
  # form the frontier; values computed from the variables alone (a reshaped bias)
  # stay connected to the parameters downstream of the edit.
  frontier = set()
  for k in cone:
    if k in reused:
      continue  # reads its saved value, not its input
    for a in prog.nodes[k].ins:
      if not isinstance(a, tuple) and a not in tainted:
        frontier.add(a)
  # What must be recomputed: frontier values that are neither inputs nor saved.
  available = set(prog.in_ids) | set(prog.const_ids)
  available |= {i for i, lbl in prog.id_label.items() if lbl in known}
  need = {i for i in frontier if i not in available}
  extra: set[int] = set()
  for k in range(len(prog.nodes) - 1, -1, -1):
    if k in cone:
      continue
    node = prog.nodes[k]
    if any(o in need for o in node.outs):
      extra.add(k)
      for a in node.ins:
        if not isinstance(a, tuple) and a not in available:
          need.add(a)
  # Outputs not in the cone come from the original trace; nothing else to run.
  return sorted(cone | extra), frontier, reused


# --------------------------------------------------------------------------
# What the program doors share: output assembly, keep_grad probes, capture.


def program_output(prog: Program, ev: Evaluation, original):
  """The model output of an evaluation; outputs outside a replay cone come from ``original``."""
  orig_leaves = jax.tree.leaves(original)
  leaves = []
  for k, i in enumerate(prog.out_ids):
    if isinstance(i, tuple):
      leaves.append(i[1])
    elif i in ev.env:
      leaves.append(ev.env[i])
    else:
      leaves.append(orig_leaves[k])
  return jax.tree.unflatten(prog.out_tree, leaves)


def probe_sites(prog: Program, args, consts, plan: Plan):
  """Raises site_has_no_graph (or site_not_float) for a keep_grad site without a graph.

  The program is evaluated abstractly with the edits applied (no keep_grad checks),
  and the derivative's jaxpr tells whether each keep_grad site value depends on a
  float input (a replay's known saved values count as inputs: it reads them).
  """
  labels, dtypes = [], []
  replay = plan.replay

  def probe_fn(args, known):
    probe = dataclasses.replace(
      plan,
      save=None,
      probe=True,
      replay=None if replay is None else dataclasses.replace(replay, known=known),
    )
    ev = evaluate(prog, args, consts, probe)
    recorded = ev.firing.recorded
    labels[:] = [lbl for lbl, _ in recorded]
    dtypes[:] = [v.dtype for _, v in recorded]
    return [v for _, v in recorded]

  known = {} if replay is None else dict(replay.known)
  table, _ = dependence.outputs_depend_on_inputs(probe_fn, list(args), known)
  return labels, table, dtypes


@dataclasses.dataclass
class Captured:
  """One program door call: the program, its flat inputs and constants, the evaluation."""

  program: Program
  consts: list
  args: list
  evaluation: Evaluation
  output: Any


def capture(
  call,
  variables,
  inputs,
  kwargs,
  rules,
  save,
  *,
  save_given,
  method,
  apply_kwargs,
  save_inputs: bool = False,
  step=None,
) -> Captured:
  """Builds the program of a model call, checks the rules against it, and evaluates it."""
  # The program is built from abstract inputs, so a model's own checks of concrete input
  # values (the zoo's token ids) cannot run inside it: a model that has them offers
  # check_inputs, called here with the concrete inputs.
  check = getattr(getattr(call, "module", None), "check_inputs", None)
  if callable(check):
    check(*inputs, **kwargs)
  disabled = runtime.grad_disabled()
  if disabled:
    variables, inputs = runtime.stop(variables), runtime.stop(inputs)
  prog, consts, args = program.build_program(
    call, variables, inputs, kwargs, method, apply_kwargs, save_inputs=save_inputs
  )
  for selector, _ in rules:
    program.check_selectable(prog, selector, "intervene=")
  if save_given:
    program.check_selectable(prog, save, "save=", editing=False)
  probed = False
  if not disabled and runtime.asks_keep_grad(rules):
    runtime.raise_no_graph(*probe_sites(prog, args, consts, Plan(tuple(rules), step=step)))
    probed = True
  ev = evaluate(prog, args, consts, Plan(tuple(rules), save, grad_disabled=disabled, step=step))
  seen = prog.infos
  for (selector, _), count in zip(rules, ev.fired):
    if count == 0:
      raise unmatched_error(selector, seen, "intervene=")
  if save_given and not ev.saved:
    raise program.save_miss(prog, save)
  if not probed and ev.firing.hook_asked:
    # A hook may ask for keep_grad at fire time (InterventionDecision): check its site.
    runtime.raise_no_graph(*probe_sites(prog, args, consts, Plan(tuple(rules), step=step)))
  return Captured(prog, consts, args, ev, program_output(prog, ev, None))
