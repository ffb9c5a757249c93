"""Converted Hugging Face decoders meet the zoo: ``torch_bridge.from_torch`` on transformers
models with their default configuration (``use_cache`` on) answers to the zoo's site names
through the per-``model_type`` tables of ``torch_bridge.convert.HF_SITES``, with the zoo's
values on the same weights (float64), and an analysis written against the zoo runs unchanged
on the converted model. Skips without torch or transformers."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import jaxlens as jl
from hf_tiny import exact_float64, tiny_hf, zoo_twin
from torch_bridge.convert import HF_SITES, ConversionError, from_torch, register_sites

TOKENS = np.asarray([[3, 9, 4, 17, 5, 9, 26, 2], [1, 2, 3, 4, 5, 6, 7, 8]])
CANONICAL = ("resid_pre", "resid_mid", "attn/pattern", "attn_out", "mlp_out", "resid_post")


def _rel(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.abs(a - b).max() / np.abs(b).max())


def analysis(model, variables, tokens):
  """An analysis written against the zoo's names: every block's residual stream and attention
  pattern, and the logits with one block's MLP output removed."""
  sites = jl.module("blocks_*/resid_post") | jl.module("blocks_*/attn/pattern")
  t = jl.trace(model, variables, tokens, save=sites, keep_inputs=False)
  ablate = jl.when(jl.module("blocks_1/mlp_out"), jl.zero_ablate())
  # the logits by their site name: the zoo returns an array, a converted HF model a dict
  ablated = jl.trace(
    model, variables, tokens, intervene=ablate, save=jl.module("logits"), keep_inputs=False
  )
  return {k: t[k].out for k in t.labels}, ablated["logits"].out


# Issue 50's families: Gemma 1 and OLMo 2 (tables of their own) and Mixtral (a mixture of
# experts, run by transformers' batched_mm experts: the eager loop branches on the routing,
# which torch.export refuses). Phi-3, Qwen2/3-MoE and OLMoE use Llama's table and convert as
# well (logits within 2e-15 of the zoo's, checked once; not run here for the CPU time).
NEW = ["gemma", "olmo2", "mixtral"]


@pytest.mark.parametrize(
  "family", ["llama", "mistral", "qwen2", "qwen3", "gemma3", "gemma2", "gpt_neox", "gpt2", *NEW]
)
def test_a_converted_decoder_has_the_zoos_sites_and_values(family):
  hf = exact_float64(tiny_hf(family, dtype=torch.float64))
  if family == "mixtral":
    hf.config._experts_implementation = "batched_mm"
  assert hf.config.use_cache  # transformers' default: the export returns no cache object
  lm = zoo_twin(hf, jnp.float64)
  module, variables, _ = from_torch(hf, torch.tensor(TOKENS))
  assert hf.config.use_cache  # restored
  x = jnp.asarray(TOKENS)
  converted = jax.jit(lambda v: jl.trace(module, v, x, keep_inputs=False))(variables)
  zoo = jax.jit(lambda v: jl.trace(lm.model, v, x, keep_inputs=False))(lm.variables)
  names = [f"blocks_{i}/{s}" for i in range(2) for s in CANONICAL] + ["ln_final", "logits"]
  if family == "gpt_neox":  # the parallel residual computes no resid_mid
    names = [n for n in names if not n.endswith("resid_mid")]
  for name in names:
    assert _rel(converted[name].out, zoo[name].out) <= 1e-10, name
  assert (
    "model/layers/1" in converted.labels
    or "gpt_neox/layers/1" in converted.labels
    or ("transformer/h/1" in converted.labels)
  )  # torch's own module sites are still there
  if family == "llama":  # the same analysis script on both
    (saved, logits), (saved_zoo, logits_zoo) = (
      jax.jit(lambda v: analysis(module, v, x))(variables),
      jax.jit(lambda v: analysis(lm.model, v, x))(lm.variables),
    )
    assert set(saved) == set(saved_zoo) and len(saved) == 4
    for k in saved:
      assert _rel(saved[k], saved_zoo[k]) <= 1e-10, k
    assert _rel(logits, logits_zoo) <= 1e-10
    assert not np.allclose(logits, zoo["logits"].out)  # the ablation changed the logits


def test_topk_and_repeat_interleave_convert():
  """The two ATen operators a mixture of experts' router and batched experts add."""

  class Route(torch.nn.Module):
    def forward(self, x):
      top, index = torch.topk(x, 2, dim=0, largest=False)
      return top, index, torch.repeat_interleave(x, 3, dim=1)

  x = torch.tensor(np.random.default_rng(0).normal(size=(5, 4)))
  module, variables, _ = from_torch(Route(), x)
  ours = module.apply(variables, jnp.asarray(x.numpy()))
  for a, b in zip(ours, Route()(x)):
    np.testing.assert_array_equal(np.asarray(a), b.numpy())


def test_without_example_inputs_the_message_says_to_pass_them():
  hf = tiny_hf("llama")
  with pytest.raises(
    ConversionError, match=r"pass them, from_torch\(model, \*example_inputs\)"
  ) as e:
    from_torch(hf)
  assert e.value.code == "unsupported_module"


def test_a_user_table_for_another_architecture(monkeypatch):
  monkeypatch.setitem(HF_SITES, "my_arch", {})  # removed again after the test
  table = {**HF_SITES["llama"], "blocks_{i}/attn_in": ("model.layers.{i}.self_attn", "in")}
  register_sites("my_arch", table)
  hf = tiny_hf("llama")
  monkeypatch.setattr(hf.config, "model_type", "my_arch")
  module, variables, _ = from_torch(hf, torch.tensor(TOKENS))
  t = jax.jit(
    lambda v: jl.trace(module, v, jnp.asarray(TOKENS), save=jl.module("blocks_*/attn_in"))
  )(variables)
  assert t["blocks_1/attn_in"].out.shape == (2, 8, 32)
  with pytest.raises(ValueError, match="kind 'output' is not"):
    register_sites("my_arch", {"logits": ("", "output")})
