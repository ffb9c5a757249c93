"""Floor 5: what every door does at a site, once: the rule-firing loop, the no_grad
scope, and the keep_grad probe's verdict.

The live interceptor, the program interpreter and its scan bodies all call
:func:`fire_rules` at each site they evaluate; none has a loop of its own.
"""

from __future__ import annotations

import contextlib
import threading

import jax
import jax.numpy as jnp

from jaxlens._src.edit import FireContext, check_keep_grad_preconditions, fire
from jaxlens._src.errors import GradientContractError
from jaxlens._src.sites import SiteInfo, matched_layers

# --------------------------------------------------------------------------
# no_grad: the JAX meaning of "gradients are disabled".

_local = threading.local()


def grad_disabled() -> bool:
  return getattr(_local, "no_grad", 0) > 0


@contextlib.contextmanager
def no_grad():
  """A scope in which every jaxlens door stops gradients at its inputs.

  JAX has no global gradient switch; inside this scope the doors apply
  ``jax.lax.stop_gradient`` to the variables and inputs they are called with, so
  nothing a door computes carries a gradient, and ``keep_grad`` raises
  ``grad_disabled``. The scope is read when the door runs (for a jitted function:
  when it is traced).
  """
  _local.no_grad = getattr(_local, "no_grad", 0) + 1
  try:
    yield
  finally:
    _local.no_grad -= 1


def stop(tree):
  """``stop_gradient`` on every float leaf of ``tree``."""
  return jax.tree.map(
    lambda a: jax.lax.stop_gradient(a) if jnp.issubdtype(jnp.result_type(a), jnp.inexact) else a,
    tree,
  )


# --------------------------------------------------------------------------
# The one rule-firing loop.


class Firing:
  """What the rules did over one door call: how often each fired, what to probe."""

  def __init__(self, n_rules: int, probe: bool = False):
    self.fired = [0] * n_rules
    self.probe = probe
    self.recorded: list = []  # probe: (label, site value) of the keep_grad sites
    self.hook_asked = False  # a hook returned InterventionDecision(keep_grad=True)

  def merge(self, other: "Firing") -> None:
    for r, count in enumerate(other.fired):
      self.fired[r] += count
    self.hook_asked |= other.hook_asked


def fire_rules(rules, info: SiteInfo, value, ctx: FireContext, firing: Firing, layer=None):
  """Applies, in order, every rule whose selector selects the site ``info``.

  For a site of a scan body (``info.layers`` set, ``layer`` the traced iteration
  index) a rule that selects some layers only writes where the index is one of
  them; the other layers keep the value and its gradient untouched.

  Under a probe (``firing.probe``) edits fire without their keep_grad checks and
  the site value of each keep_grad rule is recorded, so that one abstract pass
  can tell whether those sites have a graph (:func:`raise_no_graph`).
  """
  stacked = info.layers is not None and info.layer is None
  for r, (selector, edit) in enumerate(rules):
    if stacked:
      chosen = matched_layers(selector, info)
      if not chosen:
        continue
      ctx.static_layer = chosen[0] if len(chosen) == 1 else None
    elif selector.matches(info):
      chosen = None
    else:
      continue
    firing.fired[r] += 1
    ctx.checks = not firing.probe
    edited = fire(edit, value, ctx)
    if firing.probe:
      # A value inside a scan body cannot leave it: layer sites are not recorded.
      if not stacked and (edit.asks_keep_grad() or ctx.asked_keep_grad):
        firing.recorded.append((info.label, value))
    else:
      firing.hook_asked |= ctx.asked_keep_grad
    ctx.asked_keep_grad = False
    if chosen is not None and len(chosen) < info.layers:
      mask = jnp.asarray([k in chosen for k in range(info.layers)])
      edited = jnp.where(mask[layer], edited, value)
    value = edited
  return value


def raise_no_graph(labels, table, dtypes):
  """Raises for the first probed keep_grad site that is not float or has no graph.

  Args:
    labels, dtypes: the probed sites' labels and dtypes.
    table: ``dependence.outputs_depend_on_inputs`` rows, one per probed site.
  """
  for label, row, dtype in zip(labels, table, dtypes):
    if not jnp.issubdtype(dtype, jnp.inexact):
      check_keep_grad_preconditions(jax.ShapeDtypeStruct((), dtype), FireContext(label))
    if not any(row):
      raise GradientContractError(
        "keep_grad: the site value does not depend on any float variable or input of the "
        "call, so there is no gradient to keep",
        code="site_has_no_graph",
        site=label,
        fix="drop keep_grad here, or edit a site downstream of the parameters",
      )


def asks_keep_grad(rules) -> bool:
  return any(edit.asks_keep_grad() for _, edit in rules)


# --------------------------------------------------------------------------
# Elements of a module's tuple, list or dict output (selected with ``output=``).


def output_elements(out) -> list:
  """``(index or key, array)`` for each array element of a tuple/list/dict output."""
  if isinstance(out, dict):
    items = list(out.items())
  elif isinstance(out, (tuple, list)):
    items = list(enumerate(out))
  else:
    return []
  return [
    (k, v)
    for k, v in items
    if isinstance(k, (int, str)) and (isinstance(v, jax.Array) or hasattr(v, "aval"))
  ]


def replace_elements(out, new: dict):
  """``out`` with the elements in ``new`` replaced (the container type kept)."""
  if not new:
    return out
  if isinstance(out, dict):
    copy = type(out)(out) if type(out) is not dict else dict(out)
    copy.update(new)
    return copy
  items = [new.get(k, v) for k, v in enumerate(out)]
  if isinstance(out, list):
    return items
  if hasattr(out, "_fields"):  # a namedtuple
    return type(out)(*items)
  return type(out)(items)
