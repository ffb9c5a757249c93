"""Loading a spec saved by jaxlens onto a torch model, as torch forward hooks.

``spec.save(dir)`` in jaxlens writes ``spec.json`` + ``arrays.npz`` (see
``jaxlens._src.portable``). :func:`load_spec` reads it with jaxlens's own loader (so
a truncated or altered spec is refused the same way), maps every site from its Flax
path to the torch module name through the site map of :func:`torch_bridge.from_torch`,
and rebuilds every edit as the torch reference's verb (``torch_bridge.reference``),
keep_grad included. The result is a reference :class:`~torch_bridge.reference.Spec`:
``spec.bind(torch_model)(x)`` runs it, and ``spec.hooks()`` gives one
``hook(module, args, output)`` per torch module name for ``register_forward_hook``.
"""

from __future__ import annotations

from typing import Any, Mapping

import jax
import numpy as np
import torch

from jaxlens._src import portable, sites, verbs
from jaxlens._src.errors import InvalidArgumentError, SiteError
from jaxlens._src.tracing import Trace as JaxTrace
from torch_bridge import _reference as ref


class TorchSpecError(InvalidArgumentError):
  """A saved jaxlens spec that has no torch form (a site outside the map, an unknown verb)."""


def _inverse(site_map: Mapping[str, str]) -> dict[str, str]:
  """Flax path -> torch module name (the site map of ``from_torch`` is one to one)."""
  inverse: dict[str, str] = {}
  for torch_name, flax_path in site_map.items():
    if flax_path in inverse:
      raise TorchSpecError(
          f"the site map sends torch modules {inverse[flax_path]!r} and {torch_name!r} to the "
          f"same Flax path {flax_path!r}", code="site_map_ambiguous", site=flax_path,
          fix="pass the site map returned by torch_bridge.from_torch")
    inverse[flax_path] = torch_name
  return inverse


class _Converter:
  """Rebuilds jaxlens edits as torch reference edits."""

  def __init__(self, site_map: Mapping[str, str]):
    self.inverse = _inverse(site_map)

  def site(self, selector, where: str) -> str:
    """The torch module name of a jaxlens selector that names one module call."""
    if isinstance(selector, sites._Module) and selector.method == "__call__" and (
        selector.call in (None, 1)) and not any(ch in selector.path for ch in "*?["):
      path = selector.path
    elif isinstance(selector, sites._Label) and selector.label in self.inverse:
      path = selector.label
    else:
      raise TorchSpecError(
          f"{where}: the selector {selector!r} does not name one module of the converted model",
          code="selector_not_portable_to_torch", site=repr(selector),
          fix='select modules by their Flax path: jl.module("layers_0")')
    if path not in self.inverse:
      raise SiteError(
          f"{where}: no torch module maps to the Flax path {path!r}", code="unknown_site",
          site=path, candidates=sorted(self.inverse)[:10],
          fix=f"one of the converted model's paths, e.g. {sorted(self.inverse)[:3]}")
    return self.inverse[path]

  def value(self, v: Any, where: str) -> Any:
    """Arrays become torch tensors, populations and donor traces their torch forms."""
    if v is None or isinstance(v, (bool, int, float, str)):
      return v
    if isinstance(v, verbs.Edit):
      return self.edit(v, where)
    if isinstance(v, verbs.Population):
      return ref.Population(self.value(v.values, where))
    if isinstance(v, JaxTrace):
      values = {}
      for label, value in v.values.items():
        if label in self.inverse and self.inverse[label]:
          values[self.inverse[label]] = self.value(value, where)
      return ref.Trace(None, values, None, ())
    if isinstance(v, (np.ndarray, np.generic, jax.Array)):
      return torch.from_numpy(np.array(v))
    if isinstance(v, tuple):
      return tuple(self.value(x, where) for x in v)
    if isinstance(v, sites.Site):
      return self.site(v, where)
    raise TorchSpecError(f"{where}: cannot convert a {type(v).__name__} to torch",
                         code="verb_not_in_reference", site=where,
                         fix="save specs made of built-in verbs")

  def edit(self, e: verbs.Edit, where: str) -> ref.Edit:
    p = {k: self.value(v, where) for k, v in (e.params or {}).items()}
    s = e.options
    name = e.name
    if name == "scale":
      out = ref.scale(p["factor"])
    elif name == "clamp":
      out = ref.clamp(min=p["min"], max=p["max"])
    elif name == "add_noise":
      out = ref.add_noise(p["std"], seed=p["seed"])
    elif name == "steer":
      out = ref.steer(p["direction"], p["magnitude"], feature_axis=s["feature_axis"])
    elif name == "add":
      out = ref.add(p["delta"])
    elif name in ("project_onto", "project_out"):
      out = getattr(ref, name)(p["direction"], feature_axis=s["feature_axis"])
    elif name == "mean_ablate":
      out = ref.mean_ablate(dim=s["dim"], source=p["source"])
    elif name == "scramble_elements":
      out = ref.scramble_elements(seed=p["seed"], source=p["source"])
    elif name == "permute_batch":
      out = ref.permute_batch(seed=p["seed"], axis=s["axis"])
    elif name == "set_direction_mean":
      out = ref.set_direction_mean(p["direction"], p["source"], feature_axis=s["feature_axis"])
    elif name == "compose":
      out = ref.compose(*p["edits"])
    elif name == "zero_ablate":
      out = ref.zero_ablate()
    elif name == "replace_with":
      out = ref.replace_with(p["value"])
    elif name == "swap_with":
      other = s.get("site")
      out = ref.swap_with(self.site(other, where) if other is not None else p["value"])
    elif name == "patch_from":
      out = ref.patch_from(p["source"])
    elif name == "resample_rows_from":
      out = ref.resample_rows_from(p["source"], seed=p["seed"], axis=s["axis"])
    elif name == "at_positions":
      out = ref.at_positions(p["positions"], p["edit"], axis=s["axis"])
    elif name == "units":
      out = ref.Selection(None, "units", {"indices": p["indices"]},
                          s["feature_axis"]).wrap(p["edit"])
    elif name == "subspace":
      out = ref.Selection(None, "subspace", {"basis": p["basis"], "origin": p["origin"]},
                          s["feature_axis"]).wrap(p["edit"])
    elif name == "set_affine_coordinates":
      out = ref.set_affine_coordinates(p["W"], p["b"])
    else:
      raise TorchSpecError(f"{where}: the torch reference has no verb {name!r}",
                           code="verb_not_in_reference", site=where,
                           fix="add the verb to torch_bridge._reference and to _portable")
    return ref.keep_grad(out) if e.keep_grad else out


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
  spec = portable.load_spec(path)
  conv = _Converter(site_map)
  rules = []
  for i, (selector, edit) in enumerate(spec.rules):
    where = f"rule {i} ({selector!r})"
    rules.append((conv.site(selector, where), conv.edit(edit, where)))
  return ref.Spec(tuple(rules))
