"""Rotary scalings (jaxlens.models.rope) against transformers: every ``rope_type`` on a tiny Llama
in float64 (transformers' float32 frequency computation run in float64, tests/hf_tiny.py) and
float32, greedy generation past the original context, and the published Llama 3.1/3.2 and
Gemma 3 1B configurations translated with frequencies equal to transformers' own. Skips without
torch or transformers."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import jaxlens as jl
from jaxlens.models import LoadError, config_from_hf
from jaxlens.models.rope import Rope
from hf_tiny import exact_float64, zoo_twin

ORIGINAL = 8  # the pretraining context of the scaled configs: the inputs go past it
SCALINGS = {
  "linear": {"rope_type": "linear", "factor": 2.0},
  "dynamic": {"rope_type": "dynamic", "factor": 2.0},
  "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL},
  "llama3": {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": ORIGINAL,
  },
  "longrope": {
    "rope_type": "longrope",
    "short_factor": [1.0, 1.0, 1.1, 1.2, 1.3, 1.5, 1.7, 2.0],
    "long_factor": [1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0],
    "original_max_position_embeddings": ORIGINAL,
  },
}
TOKENS = np.asarray(
  [[3, 9, 4, 17, 5, 9, 26, 2, 8, 1, 30, 12], [1, 2, 3, 4, 5, 6, 7, 8, 9, 2, 3, 4]]
)


def _tiny(kind, dtype):
  torch.manual_seed(0)
  # dynamic scaling changes the frequencies past max_position_embeddings; the others past
  # their original context, inside a longer max_position_embeddings.
  positions = ORIGINAL if kind == "dynamic" else 32
  cfg = transformers.LlamaConfig(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    max_position_embeddings=positions,
    rope_parameters={"rope_theta": 100.0, **SCALINGS[kind]},
    attn_implementation="eager",
  )
  hf = transformers.LlamaForCausalLM(cfg)
  for p in hf.parameters():
    with torch.no_grad():
      p.normal_(0.0, 0.3 if p.ndim > 1 else 0.5)
  hf = hf.eval().to(torch.float64 if dtype == jnp.float64 else torch.float32)
  if dtype == jnp.float64:
    exact_float64(hf)
  return hf, zoo_twin(hf, dtype)


def _rel(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.abs(a - b).max() / np.abs(b).max())


@pytest.mark.parametrize("kind", sorted(SCALINGS))
@pytest.mark.parametrize("dtype", [jnp.float64, jnp.float32], ids=["f64", "f32"])
def test_scaled_rotary_logits_match_transformers(kind, dtype):
  hf, lm = _tiny(kind, dtype)
  assert lm.config.rope_scaling.kind == kind
  with torch.no_grad():
    ref = hf(torch.tensor(TOKENS)).logits.numpy()
  ours = jax.jit(lm.model.apply)(lm.variables, jnp.asarray(TOKENS))
  assert _rel(ours, ref) <= (1e-10 if dtype == jnp.float64 else 1e-4)


def test_scaling_changes_the_model():
  """The scaled model is not the default one (the parity above would hold for a dropped field
  only if the scaling did nothing)."""
  hf, lm = _tiny("llama3", jnp.float64)
  plain = lm.model.clone(config=dataclasses.replace(lm.config, rope_scaling=None))
  x = jnp.asarray(TOKENS)
  both = jax.jit(lambda v: (plain.apply(v, x), lm.model.apply(v, x)))(lm.variables)
  assert _rel(*both) > 1e-3


def test_greedy_generation_past_the_original_context_matches_transformers():
  hf, lm = _tiny("llama3", jnp.float32)
  prompt = TOKENS[:1, :6]
  ours = jl.generate(lm.model, lm.variables, jnp.asarray(prompt), 10)
  with torch.no_grad():
    ref = hf.generate(
      torch.as_tensor(prompt), max_new_tokens=10, do_sample=False, pad_token_id=0
    ).numpy()
  np.testing.assert_array_equal(ours.tokens, ref[:, 6:])


# The published configurations (config.json values of meta-llama/Llama-3.2-1B,
# meta-llama/Llama-3.1-8B and google/gemma-3-1b-pt), without their token ids.
LLAMA_32_1B = {
  "model_type": "llama",
  "architectures": ["LlamaForCausalLM"],
  "attention_bias": False,
  "attention_dropout": 0.0,
  "head_dim": 64,
  "hidden_act": "silu",
  "hidden_size": 2048,
  "initializer_range": 0.02,
  "intermediate_size": 8192,
  "max_position_embeddings": 131072,
  "mlp_bias": False,
  "num_attention_heads": 32,
  "num_hidden_layers": 16,
  "num_key_value_heads": 8,
  "pretraining_tp": 1,
  "rms_norm_eps": 1e-05,
  "rope_scaling": {
    "factor": 32.0,
    "high_freq_factor": 4.0,
    "low_freq_factor": 1.0,
    "original_max_position_embeddings": 8192,
    "rope_type": "llama3",
  },
  "rope_theta": 500000.0,
  "tie_word_embeddings": True,
  "torch_dtype": "bfloat16",
  "transformers_version": "4.45.0.dev0",
  "use_cache": True,
  "vocab_size": 128256,
}
LLAMA_31_8B = {
  **LLAMA_32_1B,
  "hidden_size": 4096,
  "intermediate_size": 14336,
  "num_hidden_layers": 32,
  "head_dim": 128,
  "rope_scaling": {**LLAMA_32_1B["rope_scaling"], "factor": 8.0},
  "tie_word_embeddings": False,
}
GEMMA_3_1B = {
  "model_type": "gemma3_text",
  "architectures": ["Gemma3ForCausalLM"],
  "attention_bias": False,
  "attention_dropout": 0.0,
  "attn_logit_softcapping": None,
  "cache_implementation": "hybrid",
  "final_logit_softcapping": None,
  "head_dim": 256,
  "hidden_activation": "gelu_pytorch_tanh",
  "hidden_size": 1152,
  "initializer_range": 0.02,
  "intermediate_size": 6912,
  "max_position_embeddings": 32768,
  "num_attention_heads": 4,
  "num_hidden_layers": 26,
  "num_key_value_heads": 1,
  "query_pre_attn_scalar": 256,
  "rms_norm_eps": 1e-06,
  "rope_local_base_freq": 10000,
  "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
  "rope_theta": 1000000,
  "sliding_window": 512,
  "sliding_window_pattern": 6,
  "torch_dtype": "bfloat16",
  "use_cache": True,
  "vocab_size": 262144,
}


def _hf_inv_freq(config_dict, cls, layer_type=None):
  from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

  cfg = cls(**{k: v for k, v in config_dict.items() if k != "model_type"})
  rope = cfg.rope_parameters
  if layer_type is not None:
    rope = rope[layer_type]
  if rope["rope_type"] == "default":
    dim = cfg.head_dim
    return 1.0 / rope["rope_theta"] ** (np.arange(0, dim, 2) / dim), 1.0
  kwargs = {"layer_type": layer_type} if layer_type else {}
  inv, scale = ROPE_INIT_FUNCTIONS[rope["rope_type"]](cfg, None, **kwargs)
  return inv.numpy(), scale


@pytest.mark.parametrize("config", [LLAMA_32_1B, LLAMA_31_8B], ids=["llama-3.2-1b", "llama-3.1-8b"])
def test_published_llama_3_configs_load_with_transformers_frequencies(config):
  ours = config_from_hf(config)
  assert ours.rope_scaling.kind == "llama3" and ours.rope_base == 500000.0
  ref, _ = _hf_inv_freq(config, transformers.LlamaConfig)
  np.testing.assert_allclose(ours.rope.inv_freq(ours.d_head), ref, rtol=1e-6)


def test_published_gemma_3_1b_config_scales_only_its_global_layers():
  ours = config_from_hf(GEMMA_3_1B)
  glob, local = ours.rope(5), ours.rope(0)  # layer 5 is global (pattern 6)
  assert glob.kind == "linear" and glob.factor == 8.0 and local == Rope(base=10000.0)
  ref, _ = _hf_inv_freq(GEMMA_3_1B, transformers.Gemma3TextConfig, "full_attention")
  np.testing.assert_allclose(glob.inv_freq(256), ref, rtol=1e-6)
  ref_local, _ = _hf_inv_freq(GEMMA_3_1B, transformers.Gemma3TextConfig, "sliding_attention")
  np.testing.assert_allclose(local.inv_freq(256), ref_local, rtol=1e-6)


def test_an_unknown_rotary_scaling_is_refused_naming_the_field():
  bad = {**LLAMA_32_1B, "rope_scaling": {"rope_type": "su", "factor": 2.0}}
  with pytest.raises(LoadError, match=r"rope_scaling.*'su'") as e:
    config_from_hf(bad)
  assert e.value.fields["code"] == "config_unsupported"
  missing = {**LLAMA_32_1B, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}}
  with pytest.raises(LoadError, match="original_max_position_embeddings"):
    config_from_hf(missing)
