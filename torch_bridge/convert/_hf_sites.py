"""The zoo's site names on converted Hugging Face decoders: one table per ``model_type``.

A table maps each canonical site (``blocks_{i}/resid_post``; ``{i}`` is the layer) to the
torch module whose value it is, and which value: ``"out"`` (the module's output; for a module
returning ``(output, extras)``, the output), ``"in"`` (the input shaped as its output: a
decoder layer's hidden states) or ``"probs"`` (the attention probabilities computed inside
the module). ``("", "out")`` is the model's output (the logits). :func:`from_torch` adds
these sites to a converted model whose ``config.model_type`` has a table, beside torch's own
module sites; a user adds a table for another architecture with :func:`register_sites`.
"""

from __future__ import annotations

from collections.abc import Mapping

__all__ = ["HF_SITES", "register_sites", "sites_for"]

_LLAMA = {
  "embed": ("model.embed_tokens", "out"),
  "blocks_{i}/resid_pre": ("model.layers.{i}", "in"),
  "blocks_{i}/attn/pattern": ("model.layers.{i}.self_attn", "probs"),
  "blocks_{i}/attn_out": ("model.layers.{i}.self_attn", "out"),
  "blocks_{i}/resid_mid": ("model.layers.{i}.post_attention_layernorm", "in"),
  "blocks_{i}/mlp_out": ("model.layers.{i}.mlp", "out"),
  "blocks_{i}/resid_post": ("model.layers.{i}", "out"),
  "ln_final": ("model.norm", "out"),
  "logits": ("", "out"),
}
# Gemma: attn_out and mlp_out are what each sub-block adds to the residual stream, after its
# post-norm (as in jaxlens.models.gemma3).
_GEMMA = {
  **{k: v for k, v in _LLAMA.items() if k != "embed"},
  "embed_scaled": ("model.embed_tokens", "out"),  # Gemma's embedding module scales
  "blocks_{i}/attn_out": ("model.layers.{i}.post_attention_layernorm", "out"),
  "blocks_{i}/resid_mid": ("model.layers.{i}.pre_feedforward_layernorm", "in"),
  "blocks_{i}/mlp_out": ("model.layers.{i}.post_feedforward_layernorm", "out"),
}
# Gemma 1: Llama's block (no post-norms) with Gemma's scaled embedding.
_GEMMA1 = {
  **{k: v for k, v in _LLAMA.items() if k != "embed"},
  "embed_scaled": ("model.embed_tokens", "out"),
}
# OLMo 2: norms after the sub-blocks only; attn_out and mlp_out are after them.
_OLMO2 = {
  **_LLAMA,
  "blocks_{i}/attn_out": ("model.layers.{i}.post_attention_layernorm", "out"),
  "blocks_{i}/resid_mid": ("model.layers.{i}.mlp", "in"),
  "blocks_{i}/mlp_out": ("model.layers.{i}.post_feedforward_layernorm", "out"),
}
# GPT-NeoX's parallel residual computes no resid_mid (x + attn + mlp in one sum).
_NEOX = {
  "embed": ("gpt_neox.embed_in", "out"),
  "blocks_{i}/resid_pre": ("gpt_neox.layers.{i}", "in"),
  "blocks_{i}/attn/pattern": ("gpt_neox.layers.{i}.attention", "probs"),
  "blocks_{i}/attn_out": ("gpt_neox.layers.{i}.attention", "out"),
  "blocks_{i}/mlp_out": ("gpt_neox.layers.{i}.mlp", "out"),
  "blocks_{i}/resid_post": ("gpt_neox.layers.{i}", "out"),
  "ln_final": ("gpt_neox.final_layer_norm", "out"),
  "logits": ("", "out"),
}
_GPT2 = {
  "blocks_{i}/resid_pre": ("transformer.h.{i}", "in"),
  "blocks_{i}/attn/pattern": ("transformer.h.{i}.attn", "probs"),
  "blocks_{i}/attn_out": ("transformer.h.{i}.attn", "out"),
  "blocks_{i}/resid_mid": ("transformer.h.{i}.ln_2", "in"),
  "blocks_{i}/mlp_out": ("transformer.h.{i}.mlp", "out"),
  "blocks_{i}/resid_post": ("transformer.h.{i}", "out"),
  "ln_final": ("transformer.ln_f", "out"),
  "logits": ("", "out"),
}

# model_type -> {canonical site: (torch module path, "in" | "out" | "probs")}
HF_SITES: dict[str, dict[str, tuple[str, str]]] = {
  "llama": _LLAMA,
  "mistral": _LLAMA,
  "qwen2": _LLAMA,
  "qwen3": _LLAMA,
  "phi3": _LLAMA,
  "gemma": _GEMMA1,
  "olmo2": _OLMO2,
  # Mixtures of experts: the MoE block is the layer's mlp (Mixtral's too, in transformers 5).
  "mixtral": _LLAMA,
  "qwen2_moe": _LLAMA,
  "qwen3_moe": _LLAMA,
  "olmoe": _LLAMA,
  "gemma3_text": _GEMMA,
  "gemma2": _GEMMA,
  "gpt_neox": _NEOX,
  "gpt2": _GPT2,
}


def register_sites(model_type: str, table: Mapping[str, tuple[str, str]]) -> None:
  """Adds (or replaces) the canonical-site table of a Hugging Face ``model_type``.

  Example: ``register_sites("olmo", {**HF_SITES["llama"]})`` for an architecture whose module
  names are Llama's.
  """
  for site, (_, kind) in table.items():
    if kind not in ("in", "out", "probs"):
      raise ValueError(f"site {site!r}: kind {kind!r} is not 'in', 'out' or 'probs'")
  HF_SITES[model_type] = dict(table)


def sites_for(model) -> tuple:
  """The ``((torch path, kind), site)`` pairs of a Hugging Face model (its config's
  ``model_type`` and layer count), or ``()`` for a model without a table."""
  config = getattr(model, "config", None)
  table = HF_SITES.get(getattr(config, "model_type", None))
  if table is None:
    return ()
  layers = getattr(config, "num_hidden_layers", None) or getattr(config, "n_layer", 0)
  pairs = []
  for site, (path, kind) in table.items():
    for i in range(layers) if "{i}" in site else (None,):
      name, where = (site, path) if i is None else (site.format(i=i), path.format(i=i))
      pairs.append(((where, kind), name))
  return tuple(pairs)
