"""Trained pyvene / pyreft interventions as jaxlens.train parameters."""

from __future__ import annotations

import jax.numpy as jnp
import torch

from jaxlens import InvalidArgumentError


def _array(t: torch.Tensor):
  return jnp.asarray(t.detach().cpu().numpy())


def _rotation(layer) -> dict:
  param = getattr(getattr(layer, "parametrizations", None), "weight", None)
  if param is None or not hasattr(param[0], "base"):
    raise InvalidArgumentError(
      "the rotate layer has no torch.nn.utils.parametrizations.orthogonal parametrisation "
      "with a base (use_trivialization=True)",
      code="invalid_argument",
      fix="pass an intervention whose rotate_layer pyvene built (RotatedSpaceIntervention, ...)",
    )
  return {"raw": _array(param.original), "base": _array(param[0].base)}


def from_pyvene(intervention) -> dict:
  """The jaxlens.train parameters of a pyvene (or pyreft) intervention, copied.

  ``RotatedSpaceIntervention`` and ``LowRankRotatedSpaceIntervention`` give
  ``{"rotation"}`` (for ``jt.DAS(dim)`` / ``jt.LowRankDAS(rank)``);
  ``BoundlessRotatedSpaceIntervention`` adds ``"boundary"`` (``jt.BoundlessDAS``; its
  temperature is an argument of the edit, not a parameter); an intervention with a
  ``learned_source`` linear layer (pyreft's ``LoreftIntervention``) adds ``"W"`` and ``"b"``
  (``jt.LoReFT(rank)``). The rotation keeps torch's parametrisation: ``raw`` is
  ``rotate_layer.parametrizations.weight.original`` and ``base`` its fixed base, so
  ``jaxlens.orthogonal`` gives the same matrix.

  Example:
    >>> import pyvene as pv, torch_bridge
    >>> params = torch_bridge.from_pyvene(pv.RotatedSpaceIntervention(embed_dim=4))
    >>> sorted(params["rotation"]), params["rotation"]["raw"].shape
    (['base', 'raw'], (4, 4))
  """
  layer = getattr(intervention, "rotate_layer", None)
  if layer is None:
    raise InvalidArgumentError(
      f"{type(intervention).__name__} has no rotate_layer",
      code="invalid_argument",
      fix="a rotated-space intervention (DAS, Boundless DAS, low-rank, LoReFT)",
    )
  params = {"rotation": _rotation(layer)}
  if hasattr(intervention, "intervention_boundaries"):
    params["boundary"] = _array(intervention.intervention_boundaries)
  source = getattr(intervention, "learned_source", None)
  if isinstance(source, torch.nn.Linear):
    params["W"] = _array(source.weight)
    params["b"] = _array(source.bias) if source.bias is not None else jnp.zeros(source.out_features)
  return params
