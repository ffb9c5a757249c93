"""The export path of torch_bridge.from_torch: coverage, sites, interventions, bad input.

Models come from torch_bridge.convert._zoo (small random configs). Parity is the relative max
error ``max|jax - torch| / max|torch|``: float64 <= 1e-10, float32 <= 1e-5. The full table
for every model, dtype and edit is docs/conversion_parity.md (``python -m
torch_bridge.convert --write docs/conversion_parity.md``); the tests check every model's
outputs in float64, a few in float32, and outputs and gradients under edits for the models
that compile fastest, to keep the suite short.
"""

from __future__ import annotations

import warnings

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import jax

jax.config.update("jax_enable_x64", True)

import jax.numpy as jnp
import numpy as np
from torch import nn

import jaxlens as jl
import torch_bridge
from torch_bridge.convert import ConversionError, _parity, _zoo, convert, to_jax

pytestmark = pytest.mark.filterwarnings(
  "ignore::UserWarning", "ignore::FutureWarning", "ignore::DeprecationWarning"
)

# Llama's rotary embedding is computed in float32 by transformers even in a float64 model
# (it casts inv_freq and positions with .float()); torch's and XLA's float32 cos/sin differ
# by an ulp, which bounds that model's float64 parity near 1e-7.
F64_TOL = {"llama": 1e-6}


@pytest.fixture(scope="module")
def gpt2():
  model, inputs, _ = _zoo.build("gpt2", torch.float64)
  fmodel, variables, site_map, program = convert(model, *inputs)
  return model, inputs, fmodel, variables, site_map, program


# gpt2's output is checked on the module fixture; three models in the intervention test.
@pytest.mark.parametrize(
  "name", [n for n in _zoo.ZOO if n not in ("gpt2", "lstm", "multihead_attention", "conv_bn_relu")]
)
def test_output_parity_float64(name):
  r = _parity.check(name, torch.float64, edits=())
  assert r.output <= F64_TOL.get(name, 1e-10), r
  assert r.edits[""][1] <= F64_TOL.get(name, 1e-10), r  # the gradient of an upstream weight


@pytest.mark.parametrize("name", ["transformer_encoder_layer", "gru", "functional"])
def test_output_parity_float32(name):
  r = _parity.check(name, torch.float32, edits=())
  assert r.output <= 1e-5 and r.edits[""][1] <= 1e-5, r


@pytest.mark.parametrize("name", ["lstm", "multihead_attention", "conv_bn_relu"])
def test_interventions_agree_with_torch_hooks(name):
  r = _parity.check(name, torch.float64)
  assert r.output <= 1e-10
  assert set(r.edits) == set(_parity.EDITS)
  for edit, (out, grad) in r.edits.items():
    assert out <= 1e-10 and grad <= 1e-10, (name, edit, out, grad)


def test_gpt2_sites_are_torch_module_names(gpt2):
  model, inputs, fmodel, variables, site_map, _ = gpt2
  assert site_map["transformer.h.0.mlp"] == "transformer/h/0/mlp"
  assert site_map["lm_head"] == "lm_head"
  assert "transformer.h" not in site_map  # the ModuleList is never called
  jin = [to_jax(x) for x in inputs]

  def run(v):
    t = jl.trace(fmodel, v, *jin, save=jl.module("transformer/h/*/mlp"))
    return t.output["logits"], {i: t[f"transformer/h/{i}/mlp"].out for i in range(2)}

  logits, mlps = jax.jit(run)(variables)
  with torch.no_grad():
    want = model(*inputs).logits.numpy()
  np.testing.assert_allclose(np.asarray(logits), want, rtol=0, atol=1e-10 * np.max(np.abs(want)))
  recorded = {}
  hooks = [
    model.get_submodule(f"transformer.h.{i}.mlp").register_forward_hook(
      lambda m, a, out, i=i: recorded.__setitem__(i, out)
    )
    for i in range(2)
  ]
  try:
    with torch.no_grad():
      model(*inputs)
  finally:
    for h in hooks:
      h.remove()
  for i in range(2):
    got = np.asarray(mlps[i])
    np.testing.assert_allclose(got, recorded[i].numpy(), rtol=0, atol=1e-12)


def test_gpt2_tied_weights_are_one_parameter(gpt2):
  _, _, _, variables, _, program = gpt2
  params = variables["params"]
  assert "weight" in params["lm_head"]
  assert "wte" not in params["transformer"]
  assert program.tied == {"transformer.wte.weight": "lm_head.weight"}


def test_gpt2_spec_saved_by_jaxlens_runs_on_torch(gpt2, tmp_path):
  model, inputs, fmodel, variables, site_map, _ = gpt2
  spec = jl.when(jl.module("transformer/h/1/ln_2"), jl.scale(0.25))
  path = spec.save(tmp_path / "spec")
  bound = jl.load_spec(path).bind(fmodel)
  want = _parity.first_leaf(jax.jit(bound)(variables, *map(to_jax, inputs)))
  got = _parity.first_leaf(torch_bridge.load_spec(path, site_map).bind(model)(*inputs))
  np.testing.assert_allclose(np.asarray(want), got.detach().numpy(), rtol=0, atol=1e-10)


def test_from_torch_picks_the_path():
  seq = nn.Sequential(nn.Linear(3, 4), nn.ReLU()).double()
  x = torch.randn(2, 3, dtype=torch.float64)
  _, _, fast = torch_bridge.from_torch(seq, x)
  assert fast["0"] == "layers_0"  # every module known: the hand-written fast path
  _, _, exported = torch_bridge.from_torch(seq, x, method="export")
  assert exported["0"] == "0"
  bn = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4)).double().eval()
  module, variables, site_map = torch_bridge.from_torch(bn, x)
  assert site_map["1"] == "1"
  # state the graph never reads (num_batches_tracked in eval mode) is left out
  assert set(variables["buffers"]["1"]) == {"running_mean", "running_var"}
  with torch.no_grad():
    ref = bn(x)
  np.testing.assert_allclose(
    np.asarray(module.apply(variables, to_jax(x))), ref.numpy(), rtol=0, atol=1e-12
  )


def test_eval_mode_is_restored_and_used():
  model = nn.Sequential(nn.Linear(3, 3), nn.Dropout(0.5), nn.BatchNorm1d(3)).double().train()
  x = torch.randn(4, 3, dtype=torch.float64)
  module, variables, _ = torch_bridge.from_torch(model, x)
  assert model.training and all(m.training for m in model.modules())
  with torch.no_grad():
    ref = model.eval()(x)
  np.testing.assert_allclose(
    np.asarray(module.apply(variables, to_jax(x))), ref.numpy(), rtol=0, atol=1e-12
  )


def test_dynamic_batch_and_sequence():
  model, (x,), _ = _zoo.build("functional", torch.float64)
  batch, seq = torch.export.Dim("batch"), torch.export.Dim("seq", min=2, max=16)
  module, variables, _ = torch_bridge.from_torch(
    model, x, method="export", dynamic_shapes=({0: batch, 1: seq},)
  )
  other = torch.randn(3, 7, 8, dtype=torch.float64)
  with torch.no_grad():
    ref = model(other)
  got = jax.jit(module.apply)(variables, to_jax(other))
  np.testing.assert_allclose(np.asarray(got), ref.numpy(), rtol=0, atol=1e-10)


def test_attention_probabilities_are_a_site():
  model, (x,), _ = _zoo.build("multihead_attention", torch.float64)
  module, variables, _ = torch_bridge.from_torch(model, x, attention_probs=True)
  probs = np.asarray(
    jax.jit(
      lambda v: (
        jl.trace(module, v, to_jax(x), save=jl.module("attn/attn_probs"))["attn/attn_probs"].out
      )
    )(variables)
  )
  assert probs.shape == (2, 2, 5, 5)  # (batch, heads, query, key)
  np.testing.assert_allclose(probs.sum(-1), 1.0, atol=1e-12)
  assert np.all(np.triu(probs, 1) == 0)  # the causal mask
  with torch.no_grad():
    _, weights = model.attn(
      model.proj(x),
      model.proj(x),
      model.proj(x),
      attn_mask=torch.triu(torch.ones(5, 5, dtype=torch.bool), 1),
      average_attn_weights=False,
    )
  np.testing.assert_allclose(probs, weights.numpy(), rtol=0, atol=1e-12)


def test_bfloat16_and_dtype_override():
  model, (idx,), _ = _zoo.build("embedding", torch.float32)
  module, variables, _ = torch_bridge.from_torch(model.to(torch.bfloat16), idx)
  assert {leaf.dtype for leaf in jax.tree.leaves(variables)} == {jnp.dtype(jnp.bfloat16)}
  with torch.no_grad():
    ref = model(idx).float().numpy()
  got = np.asarray(module.apply(variables, to_jax(idx)), np.float32)
  np.testing.assert_allclose(got, ref, rtol=0, atol=2e-2 * np.max(np.abs(ref)))
  module, variables, _ = torch_bridge.from_torch(
    model.float(), idx, method="export", dtype=jnp.float64
  )
  out = module.apply(variables, to_jax(idx))
  assert out.dtype == jnp.float64


def test_embedding_gradient_follows_padding_idx_and_scale_grad_by_freq():
  for kwargs in ({"padding_idx": 0}, {"padding_idx": 1, "scale_grad_by_freq": True}):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(5, 3, **kwargs), nn.Tanh()).double()
    idx = torch.tensor([[0, 1, 1, 3], [3, 3, 0, 2]])
    module, variables, _ = torch_bridge.from_torch(model, idx, method="export")
    jidx = to_jax(idx)
    loss = lambda p, m=module, i=jidx: jnp.sum(m.apply({"params": p}, i) ** 2)
    grad = jax.grad(loss)(variables["params"])
    (model(idx) ** 2).sum().backward()
    want = model[0].weight.grad.numpy()
    np.testing.assert_allclose(
      np.asarray(grad["0"]["weight"]), want, rtol=0, atol=1e-12, err_msg=str(kwargs)
    )
    assert not want[kwargs["padding_idx"]].any()


# -- bad input: one typed error, with the module path ------------------------------------------


class _Gate(nn.Module):
  def forward(self, x):
    return x if x.sum() > 0 else -x


class _Cumprod(nn.Module):
  def forward(self, x):
    return torch.cumprod(x, 1) + torch.logcumsumexp(x, 1)


class _ComplexHalf(nn.Module):
  def forward(self, x):
    return x.to(torch.complex32).real.float()


class _Triple(torch.autograd.Function):
  @staticmethod
  def forward(ctx, x):
    return x * 2

  @staticmethod
  def backward(ctx, g):
    return g * 3


class _Custom(nn.Module):
  def forward(self, x):
    return _Triple.apply(x)


@pytest.mark.parametrize(
  "inner, code, match",
  [
    (_Gate, "export_failed", r"failed in module 'body\.1'"),
    (_Cumprod, "unsupported_op", r"aten\.cumprod\.default, aten\.logcumsumexp\.default"),
    (_ComplexHalf, "unsupported_dtype", r"complex32, which JAX lacks"),
    (_Custom, "custom_autograd_function", r"custom autograd Function _Triple"),
  ],
)
def test_bad_input_is_a_typed_error_with_the_module_path(inner, code, match):
  model = nn.Sequential()
  model.add_module("body", nn.Sequential(nn.Linear(3, 3), inner()))
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    with pytest.raises(ConversionError, match=match) as info:
      torch_bridge.from_torch(model, torch.randn(2, 3))
  assert info.value.fields["code"] == code
  assert info.value.fields["module"] == "body.1"
  assert info.value.fields["fix"]
  if code == "unsupported_op":
    assert [o["op"] for o in info.value.fields["ops"]] == [
      "aten.cumprod.default",
      "aten.logcumsumexp.default",
    ]


def test_float64_without_x64_and_bad_arguments():
  model = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2)).double().eval()
  x = torch.randn(2, 2, dtype=torch.float64)
  jax.config.update("jax_enable_x64", False)
  try:
    with pytest.raises(ConversionError, match=r"needs jax_enable_x64") as info:
      torch_bridge.from_torch(model, x)
    assert info.value.fields["code"] == "unsupported_dtype"
  finally:
    jax.config.update("jax_enable_x64", True)
  with pytest.raises(ConversionError, match=r"\[invalid_method\]"):
    torch_bridge.from_torch(model, x, method="fx")
  with pytest.raises(ConversionError, match=r"\[example_inputs_required\]"):
    convert(model)
  with pytest.raises(ConversionError, match=r"\[unsupported_dtype\] dtype=.*int32"):
    convert(model, x, dtype=jnp.int32)
