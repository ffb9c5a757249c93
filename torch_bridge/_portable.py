"""Loading a spec saved by jaxlens onto a torch model, as torch forward hooks.

``spec.save(dir)`` in jaxlens writes ``spec.json`` + ``arrays.npz`` (see
``jaxlens.save_spec``). :func:`load_spec` reads it with jaxlens's own loader (so
a truncated or altered spec is refused the same way), maps every site from its Flax
path to the torch module name through the site map of :func:`torch_bridge.from_torch`,
and rebuilds every edit as the torch reference's verb (``torch_bridge.reference``) of
the same name, called with the same arguments (an edit records its factory's
arguments: ``Edit.arguments``), keep_grad included; no verb is named here. The result is a reference :class:`~torch_bridge.reference.Spec`:
``spec.bind(torch_model)(x)`` runs it, and ``spec.hooks()`` gives one
``hook(module, args, output)`` per torch module name for ``register_forward_hook``.
"""

from __future__ import annotations

import inspect
from typing import Any, Mapping

import jax
import numpy as np
import torch

import jaxlens as jl
from torch_bridge import reference as ref


class TorchSpecError(jl.InvalidArgumentError):
  """A saved jaxlens spec that has no torch form (a site outside the map, an unknown verb)."""


def _inverse(site_map: Mapping[str, str]) -> dict[str, str]:
  """Flax path -> torch module name (the site map of ``from_torch`` is one to one)."""
  inverse: dict[str, str] = {}
  for torch_name, flax_path in site_map.items():
    if flax_path in inverse:
      raise TorchSpecError(
        f"the site map sends torch modules {inverse[flax_path]!r} and {torch_name!r} to the "
        f"same Flax path {flax_path!r}",
        code="site_map_ambiguous",
        site=flax_path,
        fix="pass the site map returned by torch_bridge.from_torch",
      )
    inverse[flax_path] = torch_name
  return inverse


class _Converter:
  """Rebuilds jaxlens edits as torch reference edits."""

  def __init__(self, site_map: Mapping[str, str]):
    self.inverse = _inverse(site_map)

  def site(self, selector, where: str) -> str:
    """The torch module name of a jaxlens selector that names one module call."""
    path = selector.module_path()
    if path is None:
      raise TorchSpecError(
        f"{where}: the selector {selector!r} does not name one module of the converted model",
        code="selector_not_portable_to_torch",
        site=repr(selector),
        fix='select modules by their Flax path: jl.module("layers_0")',
      )
    if path not in self.inverse:
      raise jl.SiteError(
        f"{where}: no torch module maps to the Flax path {path!r}",
        code="unknown_site",
        site=path,
        candidates=sorted(self.inverse)[:10],
        fix=f"one of the converted model's paths, e.g. {sorted(self.inverse)[:3]}",
      )
    return self.inverse[path]

  def value(self, v: Any, where: str) -> Any:
    """Arrays become torch tensors, populations and donor traces their torch forms."""
    if v is None or isinstance(v, (bool, int, float, str)):
      return v
    if isinstance(v, jl.intervention.Edit):
      return self.edit(v, where)
    if isinstance(v, jl.Population):
      return ref.Population(self.value(v.values, where))
    if isinstance(v, jl.Donor):
      values = {}
      for label, value in v.donor_values().items():
        if label in self.inverse and self.inverse[label]:
          values[self.inverse[label]] = self.value(value, where)
      return ref.Trace(None, values, None, ())
    if isinstance(v, (np.ndarray, np.generic, jax.Array)):
      return torch.from_numpy(np.array(v))
    if isinstance(v, tuple):
      return tuple(self.value(x, where) for x in v)
    if isinstance(v, dict):  # a trained intervention's parameters
      return {k: self.value(x, where) for k, x in v.items()}
    if isinstance(v, jl.Site):
      return self.site(v, where)
    raise TorchSpecError(
      f"{where}: cannot convert a {type(v).__name__} to torch",
      code="verb_not_in_reference",
      site=where,
      fix="save specs made of built-in verbs",
    )

  def edit(self, e, where: str) -> ref.Edit:
    factory = ref.VERBS.get(e.name)
    if factory is None:
      raise TorchSpecError(
        f"{where}: the torch reference has no verb {e.name!r}",
        code="verb_not_in_reference",
        site=where,
        fix="add the verb to torch_bridge.reference (VERBS)",
      )
    args = {k: self.value(v, where) for k, v in e.arguments.items()}
    out = _call(factory, args)
    return ref.keep_grad(out) if e.keep_grad else out


def _call(factory, arguments: dict):
  """Calls a reference factory with a jaxlens edit's recorded arguments, by name."""
  args, kwargs = [], {}
  for name, p in inspect.signature(factory).parameters.items():
    if name not in arguments:
      continue
    if p.kind is inspect.Parameter.VAR_POSITIONAL:
      args.extend(arguments[name])
    else:
      kwargs[name] = arguments[name]
  return factory(*args, **kwargs)


def load_spec(path, site_map: Mapping[str, str]) -> ref.Spec:
  """Loads a spec saved by jaxlens as torch reference hooks for the converted torch model.

  Args:
    path: the directory ``spec.save(path)`` wrote.
    site_map: the site map from ``torch_bridge.from_torch(torch_model)`` (torch module
      name -> Flax path).

  Returns:
    A ``torch_bridge.reference.Spec`` over torch module names: ``.bind(torch_model)``
    runs the model with the edits live; ``.hooks()`` gives the forward hooks per site.

  Raises:
    jaxlens.SpecFormatError: the directory is not an intact saved spec.
    TorchSpecError: a selector that names no single module of the converted model,
      or a verb without a torch form.

  Example:
    >>> import tempfile, torch, jaxlens as jl, torch_bridge
    >>> tmodel = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    >>> _, _, site_map = torch_bridge.from_torch(tmodel)
    >>> path = jl.when(jl.module("layers_0"), jl.scale(0.5)).save(tempfile.mkdtemp() + "/s")
    >>> sorted(torch_bridge.load_spec(path, site_map).hooks())
    ['0']
  """
  spec = jl.load_spec(path)
  conv = _Converter(site_map)
  rules = []
  for i, (selector, edit) in enumerate(spec.rules):
    where = f"rule {i} ({selector!r})"
    rules.append((conv.site(selector, where), conv.edit(edit, where)))
  return ref.Spec(tuple(rules))
