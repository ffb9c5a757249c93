"""A mixture-of-experts MLP with its routing as sites (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE).

A router scores every token against every expert, keeps the ``top_k`` best, and the block's
output is the chosen experts' gated MLPs weighted by their router probabilities (renormalised
over the chosen ones when ``norm_topk_prob``); Qwen2-MoE adds a shared expert that every token
passes through, scaled by a sigmoid gate. Every expert is evaluated on every token and the
unchosen ones are weighted by zero: exact (an unchosen expert adds ``0 * y``), simple, and it
makes routing an ordinary array that edits can rewrite. It costs ``n_experts / top_k`` times the
sparse computation's expert products (8x for OLMoE's 64 experts, top 8).

Sites, under the block's ``mlp`` (``blocks_{i}/mlp/...``), in the order they are computed:

* ``router_logits``: ``(batch, seq, n_experts)``, the router's scores (the ``router`` dense
  layer's output);
* ``top_k_weights``: ``(batch, seq, top_k)``, the chosen experts' weights, best first: the
  softmax of the logits (in at least float32) at the ``top_k`` largest, renormalised to sum to
  one when ``norm_topk_prob``;
* ``routing``: ``(batch, seq, n_experts)``, the same weights spread over all experts, zero for
  an unchosen one. The place to edit a route: zero a column to drop an expert, write a one-hot
  row to force one (every expert's output exists on every token, so any route is exact);
* ``experts/pre``, ``experts/post``: ``(batch, seq, n_experts, d_expert)``, every expert's gate
  before its activation and ``act(gate) * up`` (``mlp/pre`` and ``mlp/post`` of a dense MLP,
  one axis more);
* ``experts``: ``(batch, seq, n_experts, d_model)``, every expert's output, stacked;
* ``experts_{e}/out``: ``(batch, seq, d_model)``, expert ``e``'s output on every token, before
  its routing weight;
* ``routed``: ``(batch, seq, d_model)``, ``sum_e routing[..., e] * experts_{e}/out``;
* with a shared expert: ``shared/pre``, ``shared/post``, ``shared`` (the shared expert's
  output, before its gate) and ``shared_gate`` (the gate's logit, ``(batch, seq, 1)``).

The module's output (``routed``, plus ``sigmoid(shared_gate) * shared`` with a shared expert)
is the block's ``mlp_out``. Which experts were chosen is ``routing != 0`` (an integer site would
not take a gradient, so the indices are not one).

Parameters (``params[...]["mlp"]``): ``router/kernel`` ``(d_model, n_experts)``; the experts
stacked over their first axis, ``experts/gate_proj`` and ``experts/up_proj`` ``(n_experts,
d_model, d_expert)``, ``experts/down_proj`` ``(n_experts, d_expert, d_model)``, computed for all
experts in one product each; with a shared expert, ``shared/{gate,up,down}_proj/kernel`` and
``shared_gate/kernel`` ``(d_model, 1)``.

Example:
  >>> import dataclasses, jax, jax.numpy as jnp, jaxlens as jl
  >>> from jaxlens.models.moe import MoE, MoEConfig
  >>> @dataclasses.dataclass(frozen=True)
  ... class Cfg:
  ...   d_model: int = 8
  ...   dtype: object = jnp.float32
  ...   moe: MoEConfig = MoEConfig(n_experts=4, top_k=2, d_expert=16)
  >>> h = jax.random.normal(jax.random.key(0), (1, 3, 8), jnp.float32)
  >>> variables = MoE(Cfg()).init(jax.random.key(1), h)
  >>> t = jl.trace(MoE(Cfg()), variables, h, save=jl.module("routing"))
  >>> routing = t["routing"].out
  >>> routing.shape, int((routing[0, 0] != 0).sum()), round(float(routing[0, 0].sum()), 5)
  ((1, 3, 4), 2, 1.0)
  >>> drop_0 = jl.when(jl.units(jl.module("routing"), jnp.array([0])), jl.zero_ablate())
  >>> t = jl.trace(MoE(Cfg()), variables, h, save=jl.module("routing"), intervene=drop_0)
  >>> float(jnp.abs(t["routing"].out[..., 0]).max())
  0.0
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jaxlens.core import InvalidArgumentError, named
from jaxlens.models import _hf
from jaxlens.models._layers import softmax_dtype
from jaxlens.models._params import StoredParams
from jaxlens.models.blocks import INIT, GatedMLP, activation, dense

__all__ = ["MoE", "MoEConfig", "hf_moe_weights", "hf_tensor"]


@dataclasses.dataclass(frozen=True)
class MoEConfig:
  """A mixture-of-experts MLP (the ``moe`` of a family config).

  Attributes:
    n_experts: the routed experts (HF ``num_local_experts`` / ``num_experts``).
    top_k: experts chosen per token (``num_experts_per_tok``).
    d_expert: each routed expert's MLP width (Mixtral: ``intermediate_size``; Qwen-MoE:
      ``moe_intermediate_size``; OLMoE: ``intermediate_size``).
    norm_topk_prob: renormalise the chosen experts' probabilities to sum to one (Mixtral
      always; Qwen2/3-MoE and OLMoE as their config says).
    d_shared: the shared expert's width (Qwen2-MoE's ``shared_expert_intermediate_size``), or
      None for no shared expert.
    shared_gate: scale the shared expert by ``sigmoid(shared_gate(x))`` (Qwen2-MoE).
    activation: the experts' gate activation, a Hugging Face ``hidden_act`` name
      (:func:`jaxlens.models.blocks.activation`).

  Raises:
    InvalidArgumentError: ``invalid_argument`` for a non-positive size, ``top_k`` above
      ``n_experts`` or an activation jaxlens does not implement.
  """

  n_experts: int
  top_k: int
  d_expert: int
  norm_topk_prob: bool = True
  d_shared: int | None = None
  shared_gate: bool = False
  activation: str = "silu"

  def __post_init__(self):
    for field in ("n_experts", "top_k", "d_expert", "d_shared"):
      value = getattr(self, field)
      if value is not None and (not isinstance(value, int) or value < 1):
        raise InvalidArgumentError(
          f"MoEConfig.{field}={value!r} is not a positive integer",
          code="invalid_argument",
          expected="a positive integer",
          received=value,
          fix=f"check the checkpoint's config for {field}",
        )
    if self.top_k > self.n_experts:
      raise InvalidArgumentError(
        f"MoEConfig.top_k={self.top_k} chooses more experts than the {self.n_experts} there are",
        code="invalid_argument",
        expected=f"<= {self.n_experts}",
        received=self.top_k,
        fix="top_k (num_experts_per_tok) at most n_experts",
      )
    activation(self.activation)  # refuses a name it does not implement
    if self.shared_gate and self.d_shared is None:
      raise InvalidArgumentError(
        "MoEConfig.shared_gate=True without a shared expert (d_shared=None)",
        code="invalid_argument",
        received=self.shared_gate,
        fix="give d_shared, or shared_gate=False",
      )


class Experts(StoredParams, nn.Module):
  """Every expert's gated MLP on every token: ``(batch, seq, d_model)`` ->
  ``(batch, seq, n_experts, d_model)``, each projection one product over the stacked
  experts. Sites ``pre`` and ``post`` as in a dense gated MLP, with the expert axis third."""

  n_experts: int
  d_expert: int
  activation: str = "silu"
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x):
    d_model = x.shape[-1]

    def stacked(name, shape):
      w = self.param(name, INIT, (self.n_experts, *shape), self.dtype)
      return jnp.asarray(w).astype(self.dtype)

    gate_w = stacked("gate_proj", (d_model, self.d_expert))
    up_w = stacked("up_proj", (d_model, self.d_expert))
    down_w = stacked("down_proj", (self.d_expert, d_model))
    gate = named(jnp.einsum("bsd,edf->bsef", x, gate_w), "pre")
    post = named(activation(self.activation)(gate) * jnp.einsum("bsd,edf->bsef", x, up_w), "post")
    return jnp.einsum("bsef,efd->bsed", post, down_w)


class _Out(nn.Module):
  """Names its input ``out`` under its own name (``experts_{e}/out``)."""

  @nn.compact
  def __call__(self, x):
    return named(x, "out")


def route(logits, top_k: int, norm_topk_prob: bool):
  """``(weights, chosen)`` from router logits ``(..., n_experts)``: ``weights`` ``(..., top_k)``
  the softmax (in at least float32) at the ``top_k`` largest logits, best first, renormalised
  when ``norm_topk_prob``; ``chosen`` ``(..., top_k, n_experts)`` their experts, one-hot. Both
  in the logits' dtype. The choice itself carries no gradient; the weights do."""
  probs = jax.nn.softmax(logits.astype(softmax_dtype(logits.dtype)), axis=-1)
  _, chosen = jax.lax.top_k(jax.lax.stop_gradient(probs), top_k)
  weights = jnp.take_along_axis(probs, chosen, axis=-1)
  if norm_topk_prob:
    weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
  weights = weights.astype(logits.dtype)
  onehot = jax.nn.one_hot(chosen, logits.shape[-1], dtype=logits.dtype)  # (..., k, n_experts)
  return weights, onehot


class MoE(nn.Module):
  """The mixture-of-experts MLP of a block (see the module docstring for its sites).

  ``config`` is the family's config: it needs ``d_model``, ``dtype`` and ``moe`` (a
  :class:`MoEConfig`). Call: ``MoE(config, name="mlp")(h)`` with ``h`` ``(batch, seq, d_model)``.
  """

  config: Any

  @nn.compact
  def __call__(self, h):
    cfg, moe = self.config, self.config.moe
    dtype = cfg.dtype
    logits = named(dense(moe.n_experts, dtype, "router")(h), "router_logits")
    weights, onehot = route(logits, moe.top_k, moe.norm_topk_prob)
    weights = named(weights, "top_k_weights")
    # Each expert appears once among the chosen: the sum over k places each weight, exactly.
    routing = named(jnp.einsum("bsk,bske->bse", weights, onehot), "routing")
    ys = Experts(moe.n_experts, moe.d_expert, moe.activation, dtype, name="experts")(h)
    ys = jnp.stack([_Out(name=f"experts_{e}")(ys[:, :, e]) for e in range(moe.n_experts)], axis=2)
    out = named(jnp.einsum("bse,bsed->bsd", routing, ys), "routed")
    if moe.d_shared is not None:
      shared = GatedMLP(moe.d_shared, cfg.d_model, moe.activation, dtype, name="shared")(h)
      if moe.shared_gate:
        shared = jax.nn.sigmoid(dense(1, dtype, "shared_gate")(h)) * shared
      out = out + shared
    return out


# ------------------------------------------------------------------- Hugging Face checkpoints


def _experts(w):
  """Stacked torch weights ``(n_experts, out, in)`` as the zoo's ``(n_experts, in, out)``."""
  return np.swapaxes(np.asarray(w), 1, 2)


def hf_moe_weights(cfg, path: tuple[str, ...], prefix: str) -> Iterator[tuple]:
  """``(param path, tensor name, transform)`` of the MoE MLP under ``path`` (``(blocks_i,
  "mlp")``) from the tensors under ``prefix`` (``model.layers.{i}.``).

  The expert names are those transformers 5 holds in memory: ``mlp.experts.down_proj``
  ``(n_experts, d_model, d_expert)`` as it is, ``mlp.experts.gate_proj`` and ``up_proj`` the
  halves of its fused ``gate_up_proj``. A checkpoint file (the hub's, or transformers'
  ``save_pretrained``) holds them per expert; :func:`hf_tensor` assembles them.
  """
  t = _hf.t
  yield (*path, "router", "kernel"), prefix + "mlp.gate.weight", t
  for p in ("gate", "up", "down"):
    yield (*path, "experts", f"{p}_proj"), prefix + f"mlp.experts.{p}_proj", _experts
  if cfg.moe.d_shared is not None:
    for p in ("gate", "up", "down"):
      name = prefix + f"mlp.shared_expert.{p}_proj.weight"
      yield (*path, "shared", f"{p}_proj", "kernel"), name, t
    if cfg.moe.shared_gate:
      yield (*path, "shared_gate", "kernel"), prefix + "mlp.shared_expert_gate.weight", t


# Per-expert tensor names in checkpoint files: Mixtral's (under ``block_sparse_moe``) and the
# Qwen-MoE / OLMoE ones (under ``mlp``).
_PER_EXPERT = {
  "gate_proj": ("block_sparse_moe.experts.{e}.w1.weight", "mlp.experts.{e}.gate_proj.weight"),
  "up_proj": ("block_sparse_moe.experts.{e}.w3.weight", "mlp.experts.{e}.up_proj.weight"),
  "down_proj": ("block_sparse_moe.experts.{e}.w2.weight", "mlp.experts.{e}.down_proj.weight"),
}


def hf_tensor(tensors: Mapping[str, Any], name: str, lookup: Callable) -> Any:
  """A tensor :func:`hf_moe_weights` names that ``tensors`` does not hold under that name,
  from the ones it does hold, or None.

  * ``{prefix}mlp.experts.{gate,up}_proj``: a half of the fused ``mlp.experts.gate_up_proj``
    (transformers 5 in memory: gate rows first), or the per-expert weights stacked;
  * ``{prefix}mlp.experts.down_proj``: the per-expert weights stacked;
  * ``{prefix}mlp.gate.weight``: Mixtral's ``block_sparse_moe.gate.weight``.

  Per-expert weights are ``mlp.experts.{e}.{gate,up,down}_proj.weight`` (Qwen-MoE, OLMoE) or
  ``block_sparse_moe.experts.{e}.{w1,w3,w2}.weight`` (Mixtral); ``lookup(tensors, name)`` is
  the loader's lookup (which also tries the name without its ``model.`` prefix). The stacked
  copy is the loader's; each expert's memory-mapped pages are given back once copied
  (``tensors.release``).

  Raises:
    LoadError: ``tensor_shape`` when the experts' weights differ in shape.
  """
  head, _, leaf = name.rpartition("mlp.")
  if leaf == "gate.weight":
    return lookup(tensors, head + "block_sparse_moe.gate.weight")
  kind = leaf.removeprefix("experts.")
  if kind not in _PER_EXPERT:
    return None
  if kind != "down_proj":
    fused = lookup(tensors, head + "mlp.experts.gate_up_proj")
    if fused is not None:
      half = fused.shape[1] // 2
      return fused[:, :half] if kind == "gate_proj" else fused[:, half:]
  for pattern in _PER_EXPERT[kind]:
    parts = []
    while (w := lookup(tensors, head + pattern.format(e=len(parts)))) is not None:
      parts.append(w)
    if parts:
      break
  else:
    return None
  names = [head + pattern.format(e=e) for e in range(len(parts))]
  arrays = [_as_array(w) for w in parts]
  for n, a in zip(names, arrays):
    if a.shape != arrays[0].shape:
      raise _hf.LoadError(
        f"tensor {n!r} has shape {a.shape} where expert 0's {names[0]!r} has {arrays[0].shape}",
        code="tensor_shape",
        tensor=n,
        expected=arrays[0].shape,
        received=a.shape,
        fix="check that the checkpoint's experts are complete and of one model",
      )
  stacked = np.stack(arrays)
  release = getattr(tensors, "release", None)
  for a in arrays if release is not None else ():
    release(a)
  return stacked


def _as_array(x):
  """A numpy array of a tensor (torch's ``detach().numpy()``; bfloat16 through float32)."""
  if hasattr(x, "detach"):  # a torch tensor of an older per-expert state dict
    x = x.detach().cpu()
    return x.float().numpy() if str(x.dtype) == "torch.bfloat16" else x.numpy()
  return np.asarray(x)
