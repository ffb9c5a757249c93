"""The trained interventions in torch (pairs with ``jaxlens/_src/trained.py``).

The rotation is torch's ``parametrizations.orthogonal`` map written out (``matrix_exp`` for a
square ``raw``, ``householder_product`` for a tall one, times the fixed ``base``), with the
diagonal read through ``sign`` as jaxlens reads it; the verbs are pyvene's and pyreft's
formulas.
"""

from __future__ import annotations

import torch

from torch_bridge.reference._edit import Edit, _donor, _source


def orthogonal(rotation) -> torch.Tensor:
  """The ``(n, k)`` orthogonal matrix of ``{"raw", "base"}`` (no gradient reaches ``base``)."""
  raw, base = rotation["raw"], rotation["base"].detach()
  n, k = raw.shape
  if n == k:
    t = raw.tril()
    q = torch.matrix_exp(t - t.mT)
  else:
    a = raw.tril(-1)
    tau = 2.0 / (1.0 + (a * a).sum(dim=-2))
    q = torch.linalg.householder_product(a, tau) * raw.diagonal().detach().sign().unsqueeze(-2)
  return base.to(q.dtype) @ q


def _src(source, x, ctx, verb):
  return _donor(_source(source, ctx, verb).to(x.dtype), x, ctx, verb, "source")


def das(params, source, *, dim) -> Edit:
  """``concat(sR[:, :dim], xR[:, dim:]) Rᵀ`` (pyvene's RotatedSpaceIntervention)."""

  def fn(x, ctx):
    r = orthogonal(params["rotation"])
    rb, rs = x.to(r.dtype) @ r, _src(source, x, ctx, "das").to(r.dtype) @ r
    return (torch.cat([rs[..., :dim], rb[..., dim:]], dim=-1) @ r.T).to(x.dtype)

  return Edit("das", fn)


def boundless_das(params, source, temperature) -> Edit:
  """``((1 - m) xR + m sR) Rᵀ`` with pyvene's sigmoid boundary mask."""

  def fn(x, ctx):
    r = orthogonal(params["rotation"])
    d = r.shape[0]
    b = torch.clamp(torch.as_tensor(params["boundary"]).reshape(-1)[0], 1e-3, 1.0) * d
    t = torch.as_tensor(temperature, dtype=r.dtype)
    i = torch.arange(d, dtype=r.dtype)
    m = torch.sigmoid(i / t) * torch.sigmoid((b.to(r.dtype) - i) / t)
    rb, rs = x.to(r.dtype) @ r, _src(source, x, ctx, "boundless_das").to(r.dtype) @ r
    return (((1.0 - m) * rb + m * rs) @ r.T).to(x.dtype)

  return Edit("boundless_das", fn)


def low_rank_das(params, source) -> Edit:
  """``x + (sR - xR) Rᵀ`` (pyvene's LowRankRotatedSpaceIntervention)."""

  def fn(x, ctx):
    r = orthogonal(params["rotation"])
    xw = x.to(r.dtype)
    s = _src(source, x, ctx, "low_rank_das").to(r.dtype)
    return (xw + (s @ r - xw @ r) @ r.T).to(x.dtype)

  return Edit("low_rank_das", fn)


def loreft(params) -> Edit:
  """``x + (x Wᵀ + b - x R) Rᵀ`` (pyreft's LoreftIntervention)."""

  def fn(x, ctx):
    r = orthogonal(params["rotation"])
    xw = x.to(r.dtype)
    return (xw + (xw @ params["W"].T + params["b"] - xw @ r) @ r.T).to(x.dtype)

  return Edit("loreft", fn)


def direft(params) -> Edit:
  """``x + (x W1ᵀ + b) W2`` (the ReFT paper's DiReFT, no orthogonality)."""

  def fn(x, ctx):
    xw = x.to(params["W1"].dtype)
    return (xw + (xw @ params["W1"].T + params["b"]) @ params["W2"]).to(x.dtype)

  return Edit("direft", fn)
