"""Every field of a supported family's ``config.json`` is read, known not to change an inference
forward pass (``_hf.INERT``), or refused: walked over transformers' own config classes for
every ``model_type`` the zoo loads. The fields that used to be dropped silently (an activation,
MLP biases) change jaxlens's output as they change transformers'; impossible head layouts and
layer types are refused at load. Skips without transformers."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from jaxlens.models import LoadError, config_from_hf, from_state_dict
from jaxlens.models import _hf
from jaxlens.models.loading import FAMILIES, _MODULE_OF
from hf_tiny import tiny_hf

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _defaults(model_type):
  return transformers.AutoConfig.for_model(model_type).to_dict()


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_every_field_of_transformers_config_is_read_inert_or_refused(model_type):
  config = _defaults(model_type)
  reader = _hf.HFConfig(config)
  _MODULE_OF[model_type].from_hf(reader, jnp.float32)
  reader.finish()  # the defaults load
  unread = sorted(k for k in config if k not in reader.read and k not in _hf.INERT)
  for key in unread:
    # Unread fields are absent-like (None, False, empty) in the defaults; given a value,
    # they are refused by name.
    assert config[key] in (None, False, {}, []), (key, config[key])
    with pytest.raises(LoadError, match=rf"config\.json's {key} ") as e:
      config_from_hf({**config, key: 3})
    assert e.value.fields["code"] == "config_unsupported"
  with pytest.raises(LoadError, match="config.json's frobnicate = 3") as e:
    config_from_hf({**config, "frobnicate": 3})
  assert e.value.fields["field"] == "frobnicate"


def _twin(family, **changes):
  """A tiny transformers model of ``family`` with ``changes`` to its config, random weights
  (as tests/hf_tiny.py draws them), and the zoo's model loaded from it."""
  base = tiny_hf(family)
  cfg = base.config.__class__(**{**base.config.to_dict(), **changes})
  torch.manual_seed(1)
  hf = type(base)(cfg)
  for p in hf.parameters():
    with torch.no_grad():
      p.normal_(0.0, 0.3 if p.ndim > 1 else 0.5)
  hf.eval()
  return hf, from_state_dict(hf.state_dict(), config_from_hf(hf.config.to_dict()))


TOKENS = np.asarray([[3, 9, 4, 17, 5, 9, 26, 2]])


@pytest.mark.parametrize(
  "family,changes",
  [
    ("qwen2", {"hidden_act": "gelu"}),
    ("gpt_neox", {"hidden_act": "silu"}),
    ("llama", {"mlp_bias": True, "attention_bias": True}),
  ],
  ids=["qwen2-gelu", "neox-silu", "llama-biases"],
)
def test_fields_once_dropped_change_the_output_as_in_transformers(family, changes):
  hf, lm = _twin(family, **changes)
  with torch.no_grad():
    ref = hf(torch.tensor(TOKENS)).logits.numpy()
  ours = np.asarray(jax.jit(lm.model.apply)(lm.variables, jnp.asarray(TOKENS)))
  assert np.abs(ours - ref).max() <= 1e-4 * np.abs(ref).max()


def _gemma3():
  return tiny_hf("gemma3").config.to_dict()


@pytest.mark.parametrize(
  "make,field,code",
  [
    (
      lambda: {**_gemma3(), "layer_types": ["chunked_attention", "full_attention"]},
      "layer_types",
      "config_unsupported",
    ),
    (lambda: {**_gemma3(), "layer_types": ["full_attention"]}, "layer_types", "config_unsupported"),
    (
      lambda: {**tiny_hf("llama").config.to_dict(), "num_key_value_heads": 3},
      "n_kv_heads",
      "config_invalid",
    ),
    (
      lambda: {**tiny_hf("gpt_neox").config.to_dict(), "num_attention_heads": 5},
      "n_heads",
      "config_invalid",
    ),
    (
      lambda: {**tiny_hf("llama").config.to_dict(), "head_dim": 7},
      "rotary",
      "config_invalid",
    ),
    (
      lambda: {**tiny_hf("qwen2").config.to_dict(), "hidden_act": "mish"},
      "hidden_act",
      "config_unsupported",
    ),
  ],
  ids=["unknown-layer-type", "short-layer-types", "kv-heads", "width", "odd-rotary", "activation"],
)
def test_impossible_layouts_are_refused_at_load_naming_the_field(make, field, code):
  with pytest.raises(LoadError, match=r"config\.json") as e:
    config_from_hf(make())
  assert e.value.fields["code"] == code and e.value.fields["field"] == field


def test_a_tensor_shape_error_gives_the_checkpoints_shape():
  hf = tiny_hf("gpt_neox")
  state = {k: v.numpy() for k, v in hf.state_dict().items()}
  name = "gpt_neox.layers.0.attention.query_key_value.weight"
  state[name] = state[name][:-1]
  with pytest.raises(LoadError, match=r"shape \(95, 32\) in the checkpoint") as e:
    from_state_dict(state, config_from_hf(hf.config.to_dict()))
  assert e.value.fields["code"] == "tensor_shape" and e.value.fields["received"] == (95, 32)
