"""The zoo's mixture-of-experts MLP (jaxlens.models.moe) against transformers' own sparse-MoE
blocks (Mixtral, Qwen2-MoE with its gated shared expert, Qwen3-MoE, OLMoE) with the same random
weights: the output in float64 (transformers' router takes its softmax in float32 even in a
float64 model; the comparison replaces the router's forward with the same lines in float64;
tests/test_zoo_families_new.py compares whole models in float32 with transformers as it is), each expert's output site against the
block's own experts module routed to that expert alone, dropping an expert by an edit of
``routing`` against torch with that expert's weight zeroed, and the gradient through the
router. Skips without torch or transformers."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import jaxlens as jl
from jaxlens.core import InvalidArgumentError
from jaxlens.models.moe import MoE, MoEConfig

D_MODEL, N_EXPERTS, TOP_K, D_EXPERT, D_SHARED = 16, 4, 2, 12, 20
FAMILIES = ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe"]


@dataclasses.dataclass(frozen=True)
class _Cfg:
  moe: MoEConfig
  d_model: int = D_MODEL
  dtype: object = jnp.float64


def _hf_block(family: str, dtype):
  """transformers' sparse-MoE block of ``family`` (normal random weights, torch seed 0) and
  the MoEConfig its config translates to."""
  torch.manual_seed(0)
  common = dict(
    hidden_size=D_MODEL,
    num_experts_per_tok=TOP_K,
    experts_implementation="eager",
    hidden_act="silu",
  )
  if family == "mixtral":
    from transformers.models.mixtral import modeling_mixtral as m

    cfg = transformers.MixtralConfig(
      **common, intermediate_size=D_EXPERT, num_local_experts=N_EXPERTS
    )
    block = m.MixtralSparseMoeBlock(cfg)
    moe = MoEConfig(N_EXPERTS, TOP_K, D_EXPERT, norm_topk_prob=True)
  elif family in ("qwen2_moe", "qwen3_moe"):
    if family == "qwen2_moe":
      from transformers.models.qwen2_moe import modeling_qwen2_moe as m

      cfg = transformers.Qwen2MoeConfig(
        **common,
        num_experts=N_EXPERTS,
        moe_intermediate_size=D_EXPERT,
        shared_expert_intermediate_size=D_SHARED,
        norm_topk_prob=False,
      )
      block = m.Qwen2MoeSparseMoeBlock(cfg)
      moe = MoEConfig(
        N_EXPERTS, TOP_K, D_EXPERT, norm_topk_prob=False, d_shared=D_SHARED, shared_gate=True
      )
    else:
      from transformers.models.qwen3_moe import modeling_qwen3_moe as m

      cfg = transformers.Qwen3MoeConfig(
        **common, num_experts=N_EXPERTS, moe_intermediate_size=D_EXPERT, norm_topk_prob=True
      )
      block = m.Qwen3MoeSparseMoeBlock(cfg)
      moe = MoEConfig(N_EXPERTS, TOP_K, D_EXPERT, norm_topk_prob=True)
  elif family == "olmoe":
    from transformers.models.olmoe import modeling_olmoe as m

    cfg = transformers.OlmoeConfig(
      **common, intermediate_size=D_EXPERT, num_experts=N_EXPERTS, norm_topk_prob=False
    )
    block = m.OlmoeSparseMoeBlock(cfg)
    moe = MoEConfig(N_EXPERTS, TOP_K, D_EXPERT, norm_topk_prob=False)
  else:
    raise ValueError(family)
  for p in block.parameters():
    with torch.no_grad():
      p.normal_(0.0, 0.3)
  return block.eval().to(dtype), moe


def _params(block, moe: MoEConfig):
  """The zoo's ``mlp`` params from the block's transformers 5 tensors (experts fused as
  ``gate_up_proj`` ``(E, 2 F, D)`` and ``down_proj`` ``(E, D, F)``)."""
  sd = {k: v.detach().numpy() for k, v in block.state_dict().items()}
  gate_up, down = sd["experts.gate_up_proj"], sd["experts.down_proj"]
  f = moe.d_expert
  params = {
    "router": {"kernel": sd["gate.weight"].T},
    "experts": {
      "gate_proj": gate_up[:, :f].transpose(0, 2, 1),
      "up_proj": gate_up[:, f:].transpose(0, 2, 1),
      "down_proj": down.transpose(0, 2, 1),
    },
  }
  if moe.d_shared is not None:
    params["shared"] = {
      p: {"kernel": sd[f"shared_expert.{p}.weight"].T}
      for p in ("gate_proj", "up_proj", "down_proj")
    }
    params["shared_gate"] = {"kernel": sd["shared_expert_gate.weight"].T}
  return {"params": jax.tree.map(jnp.asarray, params)}


def _f64_router(router, norm: bool, drop: int | None = None):
  """The router's forward in float64 (transformers' lines with the softmax's float32 cast
  left out); ``drop``: that expert's weight zeroed after the top-k (what an edit of
  ``routing`` does)."""

  def forward(hidden_states):
    hidden_states = hidden_states.reshape(-1, router.hidden_dim)
    logits = torch.nn.functional.linear(hidden_states, router.weight)
    probs = torch.softmax(logits, dim=-1)
    top, index = torch.topk(probs, router.top_k, dim=-1)
    if norm:
      top = top / top.sum(dim=-1, keepdim=True)
    if drop is not None:
      top = torch.where(index == drop, torch.zeros_like(top), top)
    return logits, top, index

  return forward


H = np.random.default_rng(0).normal(size=(2, 5, D_MODEL))
PROBE = np.random.default_rng(1).normal(size=(2, 5, D_MODEL))


def _rel(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.abs(a - b).max() / np.abs(b).max())


@pytest.fixture(scope="module", params=FAMILIES)
def pair(request):
  block, moe = _hf_block(request.param, torch.float64)
  block.gate.forward = _f64_router(block.gate, moe.norm_topk_prob)
  return block, moe, _params(block, moe)


def _trace(moe, variables, h, **kwargs):
  return jl.trace(MoE(_Cfg(moe)), variables, jnp.asarray(h), **kwargs)


def test_output_equals_transformers_float64(pair):
  block, moe, variables = pair
  with torch.no_grad():
    ref = block(torch.tensor(H)).numpy()
  out = MoE(_Cfg(moe)).apply(variables, jnp.asarray(H))
  assert _rel(out, ref) <= 1e-10


def test_sites_read_the_routing_and_each_expert(pair):
  block, moe, variables = pair
  names = ["router_logits", "top_k_weights", "routing"] + [
    f"experts_{e}/out" for e in range(N_EXPERTS)
  ]
  t = _trace(moe, variables, H, save=[jl.module(n) for n in names])
  with torch.no_grad():
    x = torch.tensor(H).reshape(-1, D_MODEL)
    logits, top, index = block.gate(x)
  assert _rel(t["router_logits"].out.reshape(-1, N_EXPERTS), logits.numpy()) <= 1e-12
  assert _rel(t["top_k_weights"].out.reshape(-1, TOP_K), top.numpy()) <= 1e-12
  routing = np.asarray(t["routing"].out).reshape(-1, N_EXPERTS)
  expected = np.zeros_like(routing)
  np.put_along_axis(expected, index.numpy(), top.numpy(), axis=-1)
  assert _rel(routing, expected) <= 1e-12
  assert ((routing != 0).sum(-1) == TOP_K).all()
  for e in range(N_EXPERTS):
    # transformers' experts module with every token routed to expert e alone, weight 1.
    with torch.no_grad():
      only_e = block.experts(
        x, torch.full((x.shape[0], 1), e), torch.ones((x.shape[0], 1), dtype=x.dtype)
      )
    assert _rel(t[f"experts_{e}/out"].out.reshape(-1, D_MODEL), only_e.numpy()) <= 1e-12


def test_dropping_an_expert_equals_zeroing_its_weight_in_torch(pair):
  block, moe, variables = pair
  drop = 3
  spec = jl.when(jl.units(jl.module("routing"), jnp.asarray([drop])), jl.zero_ablate())
  plain = _trace(moe, variables, H)
  edited = _trace(moe, variables, H, intervene=spec)
  original = block.gate.forward
  block.gate.forward = _f64_router(block.gate, moe.norm_topk_prob, drop=drop)
  try:
    with torch.no_grad():
      ref = block(torch.tensor(H)).numpy()
  finally:
    block.gate.forward = original
  assert _rel(edited.output, ref) <= 1e-10
  assert not np.allclose(edited.output, plain.output)  # the expert was routed to somewhere


def test_gradient_through_the_router(pair):
  block, moe, variables = pair
  spec = jl.when(jl.units(jl.module("routing"), jnp.asarray([1])), jl.zero_ablate())
  f = spec.bind(MoE(_Cfg(moe)))
  grads = jax.grad(lambda v: (f(v, jnp.asarray(H)) * PROBE).sum())(variables)["params"]

  original = block.gate.forward
  block.gate.forward = _f64_router(block.gate, moe.norm_topk_prob, drop=1)
  try:
    block.zero_grad()
    (block(torch.tensor(H)) * torch.tensor(PROBE)).sum().backward()
  finally:
    block.gate.forward = original
  router_grad = block.gate.weight.grad.numpy().T
  assert np.abs(router_grad).max() > 0
  assert _rel(grads["router"]["kernel"], router_grad) <= 1e-10
  gate_up = block.experts.gate_up_proj.grad.numpy()
  assert _rel(grads["experts"]["up_proj"], gate_up[:, D_EXPERT:].transpose(0, 2, 1)) <= 1e-10


def test_gradient_at_the_router_logits_site(pair):
  """The gradient of a metric at the ``router_logits`` site (``jl.site_grads``) equals
  torch's gradient at the router's logits."""
  block, moe, variables = pair
  g = jl.site_grads(
    MoE(_Cfg(moe)),
    variables,
    jnp.asarray(H),
    metric=lambda out: (out * PROBE).sum(),
    sites=["router_logits"],
  )
  kept = []
  f64 = _f64_router(block.gate, moe.norm_topk_prob)

  def forward(hidden_states):
    logits, top, index = f64(hidden_states)
    logits.retain_grad()
    kept.append(logits)
    return logits, top, index

  original = block.gate.forward
  block.gate.forward = forward
  try:
    (block(torch.tensor(H)) * torch.tensor(PROBE)).sum().backward()
  finally:
    block.gate.forward = original
  ref = kept[0].grad.numpy()
  assert np.abs(ref).max() > 0
  assert _rel(np.asarray(g.grad["router_logits"]).reshape(-1, N_EXPERTS), ref) <= 1e-10


def test_config_refusals():
  with pytest.raises(InvalidArgumentError, match="top_k=5 chooses more experts"):
    MoEConfig(4, 5, 8)
  with pytest.raises(InvalidArgumentError, match="unknown activation .tanh."):
    MoEConfig(4, 2, 8, activation="tanh")
  with pytest.raises(InvalidArgumentError, match="d_expert=0 is not a positive integer"):
    MoEConfig(4, 2, 0)
  with pytest.raises(InvalidArgumentError, match="shared_gate=True without a shared expert"):
    MoEConfig(4, 2, 8, shared_gate=True)
