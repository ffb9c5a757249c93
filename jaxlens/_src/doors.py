"""Doors: where edits enter a model run.

The live doors run a Flax linen model under ``flax.linen.intercept_methods`` with
an interceptor that, at each module method call, records the site value, applies
the edits whose selectors match, and returns the edited value to the model.

* ``jl.when(site, edit).bind(model)`` returns the model's function with the edit
  live: of ``*inputs`` for a bound module, of ``(variables, *inputs)`` otherwise.
* ``jl.trace(model, *inputs, intervene=..., save=...)`` runs it once and returns a
  :class:`Trace` (a pytree) with the output and the saved site values.

What cannot be intercepted: code that is not a Flax module method call (a plain
``jnp`` function between modules is part of the enclosing module's site), and
modules inside lifted transforms that hide their calls from the interceptor.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxlens._src import dependence
from jaxlens._src.errors import GradientContractError, InvalidArgumentError
from jaxlens._src.sites import SiteInfo, as_selector, unmatched_error
from jaxlens._src.verbs import Edit, FireContext, as_edit, check_keep_grad_preconditions, fire

__all__ = ["Spec", "when", "no_grad"]


# --------------------------------------------------------------------------
# no_grad: the JAX meaning of "gradients are disabled".

_local = threading.local()


def _grad_disabled() -> bool:
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


# --------------------------------------------------------------------------
# Specs.


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True)
class Spec:
  """An intervention spec: an ordered tuple of (selector, edit) rules.

  Specs are pytrees (the edits' arrays are leaves), combine with ``+``, and bind
  to a model with :meth:`bind`.
  """

  rules: tuple

  def tree_flatten(self):
    return tuple(e for _, e in self.rules), tuple(s for s, _ in self.rules)

  @classmethod
  def tree_unflatten(cls, selectors, edits):
    return cls(tuple(zip(selectors, edits)))

  def __add__(self, other: "Spec") -> "Spec":
    return Spec(self.rules + as_spec(other).rules)

  def __repr__(self) -> str:
    return " + ".join(f"jl.when({s!r}, {e!r})" for s, e in self.rules) or "Spec()"

  def __treescope_repr__(self, path, subtree_renderer):
    from jaxlens import views  # treescope's notebook view
    return views.render(self, path, subtree_renderer)

  def to_html(self, path=None, **kwargs) -> str:
    """A standalone HTML page of this spec's view (:func:`jaxlens.views.to_html`)."""
    from jaxlens import views
    return views.to_html(self, path, **kwargs)

  def save(self, path):
    """Saves this spec to a directory (portable JSON + npz, hashed, atomic)."""
    from jaxlens._src.portable import save_spec
    return save_spec(self, path)

  def check(self, model, *args):
    """Checks this spec against a model's sites; see ``jl.check_spec``."""
    from jaxlens._src.portable import check_spec
    return check_spec(self, model, *args)

  @property
  def keep_grad(self) -> bool:
    return any(_asks_keep_grad(e) for _, e in self.rules)

  def bind(self, model: nn.Module, *, method: str | Callable | None = None,
           **apply_kwargs) -> Callable[..., Any]:
    """The model's function with this spec's edits live.

    Args:
      model: a bound linen module (``model.bind(variables)``) or an ``nnx.Module``,
        giving a function of ``*inputs``; or an unbound linen module, giving a
        function of ``(variables, *inputs)``.
      method: the module method to call (default ``__call__``).
      **apply_kwargs: passed to ``Module.apply`` (``rngs=``, ``mutable=``).

    Returns:
      A pure function returning what the model returns.
    """
    module, bound_vars = _split(model)
    spec = self
    if any(sel.may_match_ops() or sel.picks_layer() for sel, _ in self.rules):
      # Op-level sites, and single layers of a scanned stack (whose index only the
      # captured program sees), need the captured program: run through jl.trace.
      from jaxlens._src.tracing import _capture

      def run(variables, inputs, kwargs):
        t = _capture(module, variables, inputs, kwargs, spec, None, save_given=False,
                     method=method, apply_kwargs=dict(apply_kwargs))
        return t.output
    else:
      def run(variables, inputs, kwargs):
        return _run(module, variables, inputs, kwargs, spec, save=None, method=method,
                    apply_kwargs=apply_kwargs)[0]

    from flax import nnx
    if isinstance(model, nnx.Module):
      # An NNX module is mutable (optimisers update it in place): read its state
      # at every call, so the bound function follows the module.
      def nnx_fn(*inputs, **kwargs):
        nonlocal module
        module, state = _split(model)
        return run(state, inputs, kwargs)
      return nnx_fn
    if bound_vars is not None:
      return lambda *inputs, **kwargs: run(bound_vars, inputs, kwargs)
    return lambda variables, *inputs, **kwargs: run(variables, inputs, kwargs)


def _asks_keep_grad(edit: Edit) -> bool:
  if edit.keep_grad:
    return True
  if edit.name == "compose":
    return any(_asks_keep_grad(e) for e in edit.params["edits"])
  # A hook may still ask at fire time by returning InterventionDecision(keep_grad=True).
  return False


def when(site, edit) -> Spec:
  """A spec that applies ``edit`` at every site ``site`` selects.

  Args:
    site: a selector (``jl.module("layers_0")``) or a site label.
    edit: a verb (``jl.scale(0.5)``), ``keep_grad(verb)``, an
      ``InterventionDecision``, a callable of the site value, or an array (written
      with ``replace_with``).

  Example:
    >>> import jaxlens as jl
    >>> jl.when(jl.module("layers_0"), jl.scale(0.5))
    jl.when(jl.module('layers_0'), jl.scale())
  """
  return Spec((rule(site, edit),))


def rule(site, edit) -> tuple:
  """One (selector, edit) rule; a selection (``jl.units``, ``jl.subspace``) wraps the edit."""
  from jaxlens._src.selections import Selection
  if isinstance(site, Selection):
    return (site.site, site.wrap(edit))
  return (as_selector(site), as_edit(edit))


def as_spec(obj) -> Spec:
  if obj is None:
    return Spec(())
  if isinstance(obj, Spec):
    return obj
  if isinstance(obj, (list, tuple)):
    out = Spec(())
    for item in obj:
      out = out + as_spec(item)
    return out
  raise InvalidArgumentError(
      f"intervene= expects a spec from jl.when(...) or a list of them, got {type(obj).__name__}",
      code="invalid_spec", fix='intervene=jl.when(jl.module("layers_0"), jl.zero_ablate())')


# --------------------------------------------------------------------------
# Running a model with edits.


def _split(model):
  from jaxlens._src.calls import split
  return split(model)


class _Run:
  """The mutable state of one door call, alive while the model is traced."""

  def __init__(self, spec: Spec, save, grad_disabled: bool, probe: list | None = None):
    self.rules = spec.rules
    self.fired = [0] * len(self.rules)
    self.save = save
    self.save_hits = 0
    self.seen: list[SiteInfo] = []
    self.calls: dict[tuple, int] = {}
    self.values: dict[str, tuple[SiteInfo, Any]] = {}
    self.saved: dict[str, Any] = {}
    self.infos: dict[str, SiteInfo] = {}
    self.grad_disabled = grad_disabled
    self.probe = probe
    self.hook_asked = False

  def interceptor(self, next_fun, args, kwargs, context):
    out = next_fun(*args, **kwargs)
    path = "/".join(context.path)
    key = (path, context.method_name)
    self.calls[key] = self.calls.get(key, 0) + 1
    info = SiteInfo(path, context.method_name, self.calls[key], context.module_type)
    self.seen.append(info)
    ctx = FireContext(info.label, path, info.module_type,
                      site_values=self.values, grad_disabled=self.grad_disabled)
    for i, (selector, edit) in enumerate(self.rules):
      if selector.matches(info):
        self.fired[i] += 1
        if self.probe is None:
          out = fire(edit, out, ctx)
          self.hook_asked |= ctx.asked_keep_grad
        else:
          site_value = out
          ctx.checks = False
          out = fire(edit, out, ctx)
          if _asks_keep_grad(edit) or ctx.asked_keep_grad:
            self.probe.append((info.label, site_value))
        ctx.asked_keep_grad = False
    self.values[info.label] = (info, out)
    if self.save is not None and self.save.matches(info):
      self.save_hits += 1
      self.saved[info.label] = out
      self.infos[info.label] = info
    return out

  def check(self, save_given: bool):
    for (selector, _), count in zip(self.rules, self.fired):
      if count == 0:
        raise unmatched_error(selector, self.seen, "intervene=")
    if save_given and self.save_hits == 0:
      raise unmatched_error(self.save, self.seen, "save=")


def _stop(tree):
  return jax.tree.map(
      lambda a: jax.lax.stop_gradient(a) if jnp.issubdtype(jnp.result_type(a), jnp.inexact)
      else a, tree)


def _apply(call, variables, inputs, kwargs, run: _Run, method, apply_kwargs):
  return call.run(variables, inputs, kwargs, run.interceptor, method, apply_kwargs)


def _probe_site_graphs(module, variables, inputs, kwargs, spec, method, apply_kwargs):
  """Raises site_has_no_graph where a keep_grad site value depends on no float input.

  It traces the model abstractly once with the edits applied, returning the site
  values of the keep_grad rules, and reads off the jaxpr of their derivative
  whether they depend on any float leaf of the variables or inputs.
  """
  labels: list[str] = []
  dtypes: list = []

  def probe_fn(variables, inputs):
    recorded: list = []
    run = _Run(spec, None, False, probe=recorded)
    _apply(module, variables, inputs, kwargs, run, method, apply_kwargs)
    labels[:] = [lbl for lbl, _ in recorded]
    dtypes[:] = [jnp.result_type(v) for _, v in recorded]
    return [v for _, v in recorded]

  table, _ = dependence.outputs_depend_on_inputs(probe_fn, variables, inputs)
  raise_no_graph(labels, table, dtypes)


def raise_no_graph(labels, table, dtypes):
  """Raises for the first probed keep_grad site that is not float or has no graph.

  Args:
    labels, dtypes: the probed sites' labels and dtypes.
    table: ``outputs_depend_on_inputs`` rows, one per probed site.
  """
  for label, row, dtype in zip(labels, table, dtypes):
    if not jnp.issubdtype(dtype, jnp.inexact):
      check_keep_grad_preconditions(jax.ShapeDtypeStruct((), dtype), FireContext(label))
    if not any(row):
      raise GradientContractError(
          "keep_grad: the site value does not depend on any float variable or input of the "
          "call, so there is no gradient to keep", code="site_has_no_graph", site=label,
          fix="drop keep_grad here, or edit a site downstream of the parameters")


def _run(module, variables, inputs, kwargs, spec: Spec, *, save, method, apply_kwargs,
         save_given=False):
  disabled = _grad_disabled()
  if disabled:
    variables, inputs = _stop(variables), _stop(inputs)
  probed = False
  if not disabled and any(_asks_keep_grad(e) for _, e in spec.rules):
    _probe_site_graphs(module, variables, inputs, kwargs, spec, method, apply_kwargs)
    probed = True
  run = _Run(spec, save, disabled)
  out = _apply(module, variables, inputs, kwargs, run, method, apply_kwargs)
  run.check(save_given)
  if run.hook_asked and not probed:
    # A hook asked for keep_grad through an InterventionDecision: check its site now.
    _probe_site_graphs(module, variables, inputs, kwargs, spec, method, apply_kwargs)
  return out, run
