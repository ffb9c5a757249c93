"""Llama checkpoints written as transformers writes them (Hugging Face tensor names, kernels
``(out, in)``, ``config.json`` beside ``model.safetensors``), for the loader's tests."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np


def llama_checkpoint(
  path: Path,
  *,
  vocab: int,
  width: int,
  mlp: int,
  heads: int,
  kv_heads: int,
  draw: Callable[[tuple], np.ndarray],
  layers: int = 2,
  **config,
) -> Path:
  """Writes an untied Llama of these sizes to the directory ``path``, each tensor ``draw(shape)``
  in the order transformers lists them; ``config`` adds or overrides ``config.json`` fields."""
  from safetensors.numpy import save_file

  d, kv = width, width // heads * kv_heads
  shapes = {"model.embed_tokens.weight": (vocab, d), "model.norm.weight": (d,)}
  shapes["lm_head.weight"] = (vocab, d)
  for i in range(layers):
    b = f"model.layers.{i}."
    shapes |= {b + "input_layernorm.weight": (d,), b + "post_attention_layernorm.weight": (d,)}
    for p, s in (("q", (d, d)), ("k", (kv, d)), ("v", (kv, d)), ("o", (d, d))):
      shapes[b + f"self_attn.{p}_proj.weight"] = s
    for p, s in (("gate", (mlp, d)), ("up", (mlp, d)), ("down", (d, mlp))):
      shapes[b + f"mlp.{p}_proj.weight"] = s
  config = {
    "model_type": "llama",
    "vocab_size": vocab,
    "hidden_size": d,
    "intermediate_size": mlp,
    "num_hidden_layers": layers,
    "num_attention_heads": heads,
    "num_key_value_heads": kv_heads,
    "tie_word_embeddings": False,
    **config,
  }
  tensors = {k: draw(s) for k, s in shapes.items()}
  (path / "config.json").write_text(json.dumps(config))
  save_file(tensors, str(path / "model.safetensors"))
  return path
