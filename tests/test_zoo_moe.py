"""The zoo's mixture-of-experts MLP (jaxlens.models.moe) against transformers' own sparse-MoE
blocks, Mixtral's (top-k renormalised) and Qwen2-MoE's (not renormalised, a gated shared
expert; Qwen3-MoE's and OLMoE's blocks are these two's code), with the same random weights in
float64 (transformers' router takes its softmax in float32 even in a float64 model; the
router's forward is replaced by the same lines in float64): the output, the routing sites
against the router's own outputs, each expert's output site against the block's experts
module routed to that expert alone, and the gradient at ``router_logits`` against torch's at
the router's logits, all from one jitted call per block. Checkpoint files with per-expert
tensors (what ``save_pretrained`` writes, as on the hub) load into the stacked experts; config
fields the zoo does not implement are refused. Whole models, edits of ``routing`` and the
router's gradient through them: tests/test_zoo_families_new.py. Skips without torch or
transformers."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import jaxlens as jl
from hf_tiny import tiny_hf
from jaxlens.core import InvalidArgumentError
from jaxlens.models import LoadError, config_from_hf, load_hf, params_from_hf
from jaxlens.models.moe import MoE, MoEConfig

D_MODEL, N_EXPERTS, TOP_K, D_EXPERT, D_SHARED = 16, 4, 2, 12, 20
FAMILIES = ["mixtral", "qwen2_moe"]


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


def _f64_router(router, norm: bool):
  """The router's forward in float64 (transformers' lines with the softmax's float32 cast
  left out)."""

  def forward(hidden_states):
    hidden_states = hidden_states.reshape(-1, router.hidden_dim)
    logits = torch.nn.functional.linear(hidden_states, router.weight)
    probs = torch.softmax(logits, dim=-1)
    top, index = torch.topk(probs, router.top_k, dim=-1)
    if norm:
      top = top / top.sum(dim=-1, keepdim=True)
    return logits, top, index

  return forward


H = np.random.default_rng(0).normal(size=(2, 5, D_MODEL))
PROBE = np.random.default_rng(1).normal(size=(2, 5, D_MODEL))
SITES = ["router_logits", "top_k_weights", "routing"] + [f"experts_{e}/out" for e in range(4)]


def _rel(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.abs(a - b).max() / np.abs(b).max())


@pytest.mark.parametrize("family", FAMILIES)
def test_block_and_its_sites_equal_transformers(family):
  block, moe = _hf_block(family, torch.float64)
  block.gate.forward = _f64_router(block.gate, moe.norm_topk_prob)
  model = MoE(_Cfg(moe))

  def observe(v, h):
    t = jl.trace(model, v, h, save=[jl.module(n) for n in SITES])
    g = jl.site_grads(model, v, h, metric=lambda out: (out * PROBE).sum(), sites=["router_logits"])
    return t.output, {n: t[n].out for n in SITES}, g.grad["router_logits"]

  out, sites, logits_grad = jax.jit(observe)(_params(block, moe), jnp.asarray(H))

  kept = []
  f64 = block.gate.forward

  def keep_logits(hidden_states):
    logits, top, index = f64(hidden_states)
    logits.retain_grad()
    kept.append(logits)
    return logits, top, index

  block.gate.forward = keep_logits
  ref = block(torch.tensor(H))
  (ref * torch.tensor(PROBE)).sum().backward()
  block.gate.forward = f64
  assert _rel(out, ref.detach().numpy()) <= 1e-10
  assert np.abs(kept[0].grad.numpy()).max() > 0
  assert _rel(logits_grad.reshape(-1, N_EXPERTS), kept[0].grad.numpy()) <= 1e-10

  with torch.no_grad():
    x = torch.tensor(H).reshape(-1, D_MODEL)
    logits, top, index = block.gate(x)
  assert _rel(sites["router_logits"].reshape(-1, N_EXPERTS), logits.numpy()) <= 1e-12
  assert _rel(sites["top_k_weights"].reshape(-1, TOP_K), top.numpy()) <= 1e-12
  routing = np.asarray(sites["routing"]).reshape(-1, N_EXPERTS)
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
    assert _rel(sites[f"experts_{e}/out"].reshape(-1, D_MODEL), only_e.numpy()) <= 1e-12


def _saved(family, path):
  """A tiny model of ``family`` written by ``save_pretrained`` to ``path``: its in-memory
  (fused) tensors as numpy, and the file's tensor names."""
  from safetensors.numpy import load_file

  hf = tiny_hf(family)
  hf.save_pretrained(path, safe_serialization=True)
  memory = {k: v.detach().numpy() for k, v in hf.state_dict().items()}
  return hf, memory, load_file(str(path / "model.safetensors"))


@pytest.mark.parametrize("family", FAMILIES)
def test_a_checkpoint_with_per_expert_tensors_loads(family, tmp_path):
  hf, memory, file = _saved(family, tmp_path)
  expert_names = [k for k in file if ".experts.1." in k]
  assert expert_names and not any("gate_up_proj" in k for k in file)  # per expert on disk
  lm = load_hf(tmp_path)
  for i in range(2):
    mlp = lm.variables["params"][f"blocks_{i}"]["mlp"]
    gate_up = memory[f"model.layers.{i}.mlp.experts.gate_up_proj"]
    d = gate_up.shape[1] // 2
    stacked = {
      "gate_proj": gate_up[:, :d],
      "up_proj": gate_up[:, d:],
      "down_proj": memory[f"model.layers.{i}.mlp.experts.down_proj"],
    }
    for name, w in stacked.items():
      np.testing.assert_array_equal(mlp["experts"][name], w.transpose(0, 2, 1))
    router = memory[f"model.layers.{i}.mlp.gate.weight"].T
    np.testing.assert_array_equal(mlp["router"]["kernel"], router)
    if family == "qwen2_moe":
      shared = memory[f"model.layers.{i}.mlp.shared_expert.up_proj.weight"].T
      np.testing.assert_array_equal(mlp["shared"]["up_proj"]["kernel"], shared)
      gate = memory[f"model.layers.{i}.mlp.shared_expert_gate.weight"].T
      np.testing.assert_array_equal(mlp["shared_gate"]["kernel"], gate)


def test_experts_of_different_shapes_are_refused(tmp_path):
  hf, _, file = _saved("qwen3_moe", tmp_path)
  name = "model.layers.1.mlp.experts.2.up_proj.weight"
  file[name] = file[name][:-1]
  with pytest.raises(LoadError, match="experts.2.up_proj.weight' has shape") as e:
    params_from_hf(config_from_hf(hf.config.to_dict()), file)
  assert e.value.fields["code"] == "tensor_shape"


def _config(kind, **fields):
  return {
    "model_type": kind,
    "vocab_size": 64,
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    **fields,
  }


@pytest.mark.parametrize(
  "kind, field, value",
  [
    ("qwen2_moe", "mlp_only_layers", [1]),
    ("qwen3_moe", "decoder_sparse_step", 2),
    ("qwen3_moe", "use_sliding_window", True),
    ("olmoe", "clip_qkv", 8.0),
  ],
)
def test_config_fields_the_zoo_does_not_run_are_refused(kind, field, value):
  with pytest.raises(LoadError, match=f"{field} = ") as e:
    config_from_hf(_config(kind, **{field: value}))
  assert e.value.fields["code"] == "config_unsupported"


def test_config_translation():
  mixtral = config_from_hf(_config("mixtral", num_local_experts=6))
  assert mixtral.moe == MoEConfig(6, 2, 48, norm_topk_prob=True)
  assert mixtral.rope_base == 1e6  # transformers' Mixtral default
  qwen = config_from_hf(_config("qwen2_moe", num_experts=8, norm_topk_prob=True))
  assert qwen.moe == MoEConfig(8, 4, 1408, True, d_shared=5632, shared_gate=True)
  assert qwen.qkv_bias and not qwen.o_bias
  olmoe = config_from_hf(_config("olmoe", num_experts=8))
  assert (olmoe.qk_norm, olmoe.qk_norm_scope) == (True, "proj")
  with pytest.raises(LoadError, match="differs from num_local_experts"):
    config_from_hf(_config("qwen3_moe", num_experts=8, num_local_experts=4))


def test_moe_config_refusals():
  with pytest.raises(InvalidArgumentError, match="top_k=5 chooses more experts"):
    MoEConfig(4, 5, 8)
  with pytest.raises(InvalidArgumentError, match="unknown activation .tanh."):
    MoEConfig(4, 2, 8, activation="tanh")
  with pytest.raises(InvalidArgumentError, match="d_expert=0 is not a positive integer"):
    MoEConfig(4, 2, 0)
  with pytest.raises(InvalidArgumentError, match="shared_gate=True without a shared expert"):
    MoEConfig(4, 2, 8, shared_gate=True)
