"""Parity of converted models with torch: outputs, and outputs and gradients under edits.

For a zoo model (:mod:`torch_bridge.convert._zoo`) :func:`check` converts it with
:func:`torch_bridge.from_torch` (export path) and measures, against the torch model:

* the output (relative max error: ``max|jax - torch| / max|torch|``);
* for each edit of :data:`EDITS` at the model's middle site, through a jaxlens door on the
  converted model (``jl.when(...).bind``) and through the torch reference
  (:mod:`torch_bridge.reference`, plain forward hooks) on the original: the edited output and
  the gradient of a fixed random projection of it with respect to an upstream weight (the
  model's first parameter), both as relative max errors.

``python -m torch_bridge.convert --write docs/conversion_parity.md`` writes the table.
"""

from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np
import torch
from torch.utils import _pytree as tree

import jaxlens as jl
from torch_bridge import reference as ref
from torch_bridge.convert import _zoo, convert
from torch_bridge.convert._arrays import to_jax

__all__ = ["EDITS", "Result", "check", "first_leaf"]

UNITS = [0, 1]


def _edits(jdonor, tdonor):
  """(name, kind, jaxlens spec builder, torch spec builder) per edit."""
  return [
    (
      "scale(0.5)",
      "keeping",
      lambda s: jl.when(jl.module(s), jl.scale(0.5)),
      lambda s: ref.when(s, ref.scale(0.5)),
    ),
    (
      "zero_ablate",
      "cutting",
      lambda s: jl.when(jl.module(s), jl.zero_ablate()),
      lambda s: ref.when(s, ref.zero_ablate()),
    ),
    (
      "patch_from(donor)",
      "cutting",
      lambda s: jl.when(jl.module(s), jl.patch_from(jdonor)),
      lambda s: ref.when(s, ref.patch_from(tdonor)),
    ),
    (
      "units([0, 1]) zero_ablate",
      "selection",
      lambda s: jl.when(jl.units(jl.module(s), jnp.asarray(UNITS)), jl.zero_ablate()),
      lambda s: ref.when(ref.units(s, UNITS), ref.zero_ablate()),
    ),
  ]


EDITS = ("scale(0.5)", "zero_ablate", "patch_from(donor)", "units([0, 1]) zero_ablate")


@dataclasses.dataclass
class Result:
  """Parity figures of one model in one dtype (relative max errors)."""

  model: str
  dtype: str
  site: str
  flax_site: str
  weight: str
  output: float
  edits: dict  # edit name ("" without edits) -> (output error, gradient error)
  convert_s: float


def first_leaf(out):
  """The first tensor of a model output (torch or the converted model's), in torch's order."""
  if isinstance(out, dict):
    return first_leaf(next(iter(out.values())))
  if isinstance(out, (tuple, list)):
    return first_leaf(out[0])
  if isinstance(out, (torch.Tensor, jax.Array)):
    return out
  leaves = [t for t in tree.tree_leaves(out) if isinstance(t, torch.Tensor)]
  return leaves[0]


def _rel(a, b) -> float:
  a = np.asarray(a, dtype=np.float64)
  b = np.asarray(b.detach().double().numpy() if isinstance(b, torch.Tensor) else b, np.float64)
  assert a.shape == b.shape, (a.shape, b.shape)
  scale = float(np.max(np.abs(b))) if b.size else 0.0
  return float(np.max(np.abs(a - b))) / (scale if scale > 0 else 1.0)


def _donor_inputs(inputs):
  torch.manual_seed(1)
  out = []
  for x in inputs:
    if x.is_floating_point():
      out.append(torch.randn_like(x))
    else:
      out.append(torch.randint(0, int(x.max()) + 1, x.shape, dtype=x.dtype))
  return tuple(out)


def _get(tree_, path):
  for p in path.split("."):
    tree_ = tree_[p]
  return tree_


def check(
  name: str, dtype: torch.dtype = torch.float64, edits: tuple = EDITS, attention_probs: bool = False
) -> Result:
  """Converts zoo model ``name`` and measures its parity (see the module docstring)."""
  model, inputs, site = _zoo.build(name, dtype)
  t0 = time.perf_counter()
  fmodel, variables, site_map, program = convert(model, *inputs, attention_probs=attention_probs)
  convert_s = time.perf_counter() - t0
  jin = [to_jax(x) for x in inputs]
  with torch.no_grad():
    want = first_leaf(model(*inputs))
  weight = next(n for n, _ in model.named_parameters())
  jweight = program.tied.get(weight, weight)
  torch.manual_seed(2)
  proj = torch.randn(want.shape, dtype=want.dtype)
  jproj = to_jax(proj)
  if not edits:  # the output, and the gradient of its projection without edits

    def plain(params):
      y = first_leaf(fmodel.apply({**variables, "params": params}, *jin))
      return jnp.sum(y * jproj), y

    (_, y), grad = jax.jit(jax.value_and_grad(plain, has_aux=True))(variables["params"])
    model.zero_grad(set_to_none=True)
    (first_leaf(model(*inputs)) * proj).sum().backward()
    tgrad = dict(model.named_parameters())[weight].grad
    model.zero_grad(set_to_none=True)
    return Result(
      name,
      str(dtype).removeprefix("torch."),
      site,
      site_map.get(site, ""),
      weight,
      _rel(y, want),
      {"": (0.0, _rel(_get(grad, jweight), tgrad))},
      convert_s,
    )
  donor_in = _donor_inputs(inputs)
  jdonor_in = [to_jax(x) for x in donor_in]
  tdonor = ref.trace(model, *donor_in)
  flax_site = site_map[site]
  chosen = [e for e in _edits(None, tdonor) if e[0] in edits]

  @jax.jit
  def jax_side(v):
    # One compiled function for every edit: a donor trace, then each edit's output and the
    # gradient of the projected output with respect to the upstream weight.
    jdonor = jl.trace(fmodel, v, *jdonor_in)
    out = {"": first_leaf(fmodel.apply(v, *jin))}
    for ename, _, jspec, _ in _edits(jdonor, None):
      if ename not in edits:
        continue
      f = jspec(flax_site).bind(fmodel)

      def loss(params, f=f):  # only the parameters: buffers may be integers
        y = first_leaf(f({**v, "params": params}, *jin))
        return jnp.sum(y * jproj), y

      (_, y), grad = jax.value_and_grad(loss, has_aux=True)(v["params"])
      out[ename] = (y, _get(grad, jweight))
    return out

  jax_out = jax_side(variables)
  results = {}
  for ename, _, _, tspec in chosen:
    jy, jg = jax_out[ename]
    model.zero_grad(set_to_none=True)
    ty = first_leaf(tspec(site).bind(model)(*inputs))
    if ty.requires_grad:  # a cut can leave the output without a path to any parameter
      (ty * proj).sum().backward()
    param = dict(model.named_parameters())[weight]
    tg = torch.zeros_like(param) if param.grad is None else param.grad
    results[ename] = (_rel(jy, ty), _rel(jg, tg))
  model.zero_grad(set_to_none=True)
  output = _rel(jax_out[""], want)
  return Result(
    name, str(dtype).removeprefix("torch."), site, flax_site, weight, output, results, convert_s
  )


def table(results: list[Result]) -> str:
  """The markdown table of :func:`check` results."""
  head = (
    "| model | dtype | site (torch -> Flax) | output | "
    + " | ".join(f"{e}: out / grad" for e in EDITS)
    + " |"
  )
  lines = [head, "|" + "---|" * (4 + len(EDITS))]
  for r in results:
    cells = [f"{r.edits[e][0]:.1e} / {r.edits[e][1]:.1e}" if e in r.edits else "-" for e in EDITS]
    lines.append(
      f"| {r.model} | {r.dtype} | `{r.site}` -> `{r.flax_site}` | {r.output:.1e} | "
      + " | ".join(cells)
      + " |"
    )
  return "\n".join(lines)
