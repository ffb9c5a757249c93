"""Floor 8: specs, the doors that bind them, and their saved form.

* ``jl.when(site, edit)`` is a :class:`Spec`: an ordered tuple of (selector, edit)
  rules; specs are pytrees (the edits' arrays are leaves) and combine with ``+``.
* ``spec.bind(model)`` returns the model's function with the edits live: of
  ``*inputs`` for a bound module or an NNX module, of ``(variables, *inputs)``
  otherwise. Module sites run through the live interceptor (``interceptor.py``);
  op sites and single layers of a scanned stack through the captured program
  (``interpret.py``), which alone sees them.
* ``spec.save(dir)`` / ``jl.load_spec(dir)`` through ``saving.py``;
  ``jl.check_spec`` checks a spec against a model abstractly.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
from flax import nnx

from jaxlens._src import interceptor, interpret, model_calls, render, runtime, saving, viewing
from jaxlens._src.edit import Edit
from jaxlens._src.errors import InvalidArgumentError, SiteError
from jaxlens._src.selections import Selection, show_selection
from jaxlens._src.sites import as_selector
from jaxlens._src.tracebacks import api_boundary
from jaxlens._src.verbs import as_edit

__all__ = ["Spec", "when", "load_spec", "save_spec", "check_spec", "SpecReport"]


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
    return " + ".join(_show_rule(s, e) for s, e in self.rules) or "Spec()"

  @api_boundary
  def save(self, path):
    """Saves this spec to a directory (portable JSON + npz, hashed, atomic)."""
    return save_spec(self, path)

  @api_boundary
  def check(self, model, *args) -> "SpecReport":
    """Checks this spec against a model's sites; see ``jl.check_spec``."""
    return check_spec(self, model, *args)

  def __treescope_repr__(self, path, subtree_renderer):
    """treescope's view: the rules, each edit coloured by what it does to the gradient."""
    return render.treescope_repr(viewing.spec_view(self), path, subtree_renderer)

  def to_html(self, path=None, *, title: str | None = None, trace=None) -> str:
    """A standalone HTML page of this spec's view (:func:`jaxlens.views.to_html`); with
    ``trace``, where each rule fires among its sites."""
    infos = None if trace is None else list(trace.sites)
    return render.html_page(viewing.spec_view(self, infos), title or "jaxlens Spec", path)

  @property
  def keep_grad(self) -> bool:
    return runtime.asks_keep_grad(self.rules)

  @api_boundary
  def bind(
    self, model, *, method: str | Callable | None = None, step=None, **apply_kwargs
  ) -> Callable[..., Any]:
    """The model's function with this spec's edits live.

    Args:
      model: a bound linen module (``model.bind(variables)``) or an ``nnx.Module``,
        giving a function of ``*inputs``; or an unbound linen module, giving a
        function of ``(variables, *inputs)``.
      method: the module method to call (default ``__call__``).
      step: the decoding step of the calls (an int or a traced int scalar), which edits read
        as ``FireContext.step`` (:func:`jaxlens.at_steps` selects steps by it);
        :func:`jaxlens.generate` passes its call index. Default None: not a generation.
      **apply_kwargs: passed to ``Module.apply`` (``rngs=``, ``mutable=``).

    Returns:
      A pure function returning what the model returns.
    """
    call, bound_vars = model_calls.split(model)
    rules = self.rules
    if any(sel.may_match_ops() or sel.picks_layer() for sel, _ in rules):
      # Op-level sites, and single layers of a scanned stack (whose index only the
      # captured program sees), need the captured program.
      def run(call, variables, inputs, kwargs):
        return interpret.capture(
          call,
          variables,
          inputs,
          kwargs,
          rules,
          None,
          save_given=False,
          method=method,
          apply_kwargs=dict(apply_kwargs),
          step=step,
        ).output
    else:

      def run(call, variables, inputs, kwargs):
        return interceptor.run_live(
          call,
          variables,
          inputs,
          kwargs,
          rules,
          method=method,
          apply_kwargs=apply_kwargs,
          step=step,
        )[0]

    if isinstance(model, nnx.Module):
      # An NNX module is mutable (optimisers update it in place): read its state
      # at every call, so the bound function follows the module.
      def nnx_fn(*inputs, **kwargs):
        call, state = model_calls.split(model)
        return run(call, state, inputs, kwargs)

      return api_boundary(nnx_fn)
    if bound_vars is not None:
      return api_boundary(lambda *inputs, **kwargs: run(call, bound_vars, inputs, kwargs))

    def unbound_fn(variables, *inputs, **kwargs):
      _, variables, inputs = model_calls.resolve(
        model,
        (variables, *inputs),
        "spec.bind(model)(variables, x), or spec.bind(model.bind(variables))(x)",
      )
      return run(call, variables, inputs, kwargs)

    return api_boundary(unbound_fn)


def _show_rule(selector, edit: Edit) -> str:
  if edit.verb.wraps:
    inner = edit.params["edit"]
    shown = show_selection(edit.name, edit.arguments)
    site = f"jl.{edit.name}({selector!r}{', ' + shown if shown else ''})"
    inner = dataclasses.replace(inner, keep_grad=edit.keep_grad or inner.keep_grad)
    return f"jl.when({site}, {inner!r})"
  return f"jl.when({selector!r}, {edit!r})"


@api_boundary
def when(site, edit) -> Spec:
  """A spec that applies ``edit`` at every site ``site`` selects.

  Args:
    site: a selector (``jl.module("layers_0")``), a site label, or a selection
      (``jl.units``, ``jl.subspace``).
    edit: a verb (``jl.scale(0.5)``), ``keep_grad(verb)``, an
      ``InterventionDecision``, a callable of the site value, or an array (written
      with ``replace_with``).

  Example:
    >>> import jaxlens as jl
    >>> jl.when(jl.module("layers_0"), jl.scale(0.5))
    jl.when(jl.module('layers_0'), jl.scale(0.5))
  """
  return Spec((rule(site, edit),))


def rule(site, edit) -> tuple:
  """One (selector, edit) rule; a selection (``jl.units``, ``jl.subspace``) wraps the edit."""
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
    code="invalid_spec",
    fix='intervene=jl.when(jl.module("layers_0"), jl.zero_ablate())',
  )


# --------------------------------------------------------------------------
# Saved specs.


@api_boundary
def save_spec(spec: Spec, path):
  """Saves ``spec`` to the directory ``path`` (atomic; see ``docs/guide.md``).

  An existing directory at ``path`` is replaced only if it is itself a saved
  spec; anything else there is refused with ``spec_target_exists``.
  """
  return saving.save_rules(as_spec(spec).rules, path)


@api_boundary
def load_spec(path) -> Spec:
  """Loads a spec saved by :func:`save_spec`, refusing a truncated or altered one."""
  return Spec(saving.load_rules(path))


@dataclasses.dataclass(frozen=True)
class SpecReport:
  """What :func:`check_spec` found: rules whose site is missing or whose values mismatch."""

  missing: tuple = ()
  mismatched: tuple = ()

  @property
  def ok(self) -> bool:
    return not self.missing and not self.mismatched


@api_boundary
def check_spec(spec: Spec, model, *args) -> SpecReport:
  """Checks each rule of ``spec`` against ``model``'s sites, abstractly (no compute).

  Args:
    spec: the spec (for example one from :func:`load_spec`).
    model, *args: as for ``jl.trace``: a bound model and its inputs, or an unbound
      model, its variables and inputs.

  Returns:
    A SpecReport listing ``(rule index, selector, message)`` for every rule whose
    site does not exist (``missing``) and every rule that fails on the model's
    values, such as a donor or direction of the wrong shape (``mismatched``).
  """
  call, variables, args = model_calls.resolve(
    model, args, "jl.check_spec(spec, model, variables, x)"
  )
  missing, mismatched = [], []
  for i, r in enumerate(as_spec(spec).rules):
    try:
      jax.eval_shape(
        lambda r=r: (
          interpret.capture(
            call,
            variables,
            args,
            {},
            (r,),
            None,
            save_given=False,
            method=None,
            apply_kwargs={},
          ).output
        )
      )
    except SiteError as error:
      missing.append((i, repr(r[0]), str(error)))
    except InvalidArgumentError as error:
      mismatched.append((i, repr(r[0]), str(error)))
  return SpecReport(tuple(missing), tuple(mismatched))
