"""Tiny Hugging Face transformers models with random weights, for the parity tests against
the zoo (tests/test_zoo_torch.py, tests/test_generate_torch.py). Imported only by test files
that have already skipped without torch and transformers."""

from __future__ import annotations

import jax.numpy as jnp
import torch
import transformers

from jaxlens.models import config_from_hf, from_state_dict

VOCAB, D_MODEL, D_MLP, LAYERS, HEADS = 64, 32, 48, 2, 4


def tiny_hf(family: str, *, dtype=torch.float32, attention: str = "eager", positions: int = 32):
  """A two-layer ``llama``, ``gpt2`` or ``bert`` of width 32 with every parameter drawn
  from a normal (torch seed 0; not the near-zero init some layers get), in eval mode."""
  torch.manual_seed(0)
  if family == "llama":
    cfg = transformers.LlamaConfig(
      vocab_size=VOCAB,
      hidden_size=D_MODEL,
      intermediate_size=D_MLP,
      num_hidden_layers=LAYERS,
      num_attention_heads=HEADS,
      num_key_value_heads=2,
      max_position_embeddings=positions,
      rope_parameters={"rope_type": "default", "rope_theta": 500.0},
      tie_word_embeddings=False,
      attn_implementation=attention,
    )
    hf = transformers.LlamaForCausalLM(cfg)
  elif family == "gpt2":
    cfg = transformers.GPT2Config(
      vocab_size=VOCAB,
      n_positions=positions,
      n_embd=D_MODEL,
      n_layer=LAYERS,
      n_head=HEADS,
      attn_implementation=attention,
    )
    hf = transformers.GPT2LMHeadModel(cfg)
  elif family == "bert":
    cfg = transformers.BertConfig(
      vocab_size=VOCAB,
      hidden_size=D_MODEL,
      num_hidden_layers=LAYERS,
      num_attention_heads=HEADS,
      intermediate_size=D_MLP,
      max_position_embeddings=positions,
      attn_implementation=attention,
    )
    hf = transformers.BertModel(cfg)
  else:
    raise ValueError(f"unknown family {family!r}; expected 'llama', 'gpt2' or 'bert'")
  for p in hf.parameters():
    with torch.no_grad():
      p.normal_(0.0, 0.3 if p.ndim > 1 else 0.5)
  return hf.eval().to(dtype)


def zoo_twin(hf, dtype=jnp.float32):
  """The zoo's model with ``hf``'s weights (``jm.from_state_dict``)."""
  return from_state_dict(hf.state_dict(), config_from_hf(hf.config.to_dict(), dtype))
