"""The attribution graph of ``bench_big.py --parts graph --graph-layers all`` in circuit-tracer
0.5.0 (run in its own environment, /work/venv-ct: it pins transformers 4.56-4.57).

Reads the Llama-3.2-1B-shaped checkpoint that ``bench_big.py`` wrote (``--path``: config.json
and safetensors, float32) into a TransformerLens ``HookedTransformer`` of the same shape
(Llama-3.2-1B's TransformerLens config: rotary with llama3's NTK-by-parts scaling, grouped
keys and values, SwiGLU, RMSNorm; the weights mapped as TransformerLens's
``convert_llama_weights`` maps them, the tied embedding copied into the unembedding), and the
transcoders that jaxlens's side used (``--work``/jax_float32_graph.npz). circuit-tracer reads a
transcoder at ``ln2.hook_normalized``, before the norm's gain, where jaxlens reads the norm's
output, so each encoder here is jaxlens's times the gain (the same pre-activations and the same
edges). The prompt starts with token 0, the stand-in tokenizer's special token, so
circuit-tracer prepends nothing and zeroes the first position's features, as jaxlens's side
does with ``zero_bos=True``.

``attribute`` (batch 64, ``--nodes`` feature nodes) runs at one torch thread and at torch's
default, alternately (``--repeats`` rounds); the result (wall and CPU time of each call, the
peak resident memory of the calls over the process's memory before the model was built, the
load average) is printed as one JSON line, and the graph is written to
``--work``/ct_float32_graph.npz for ``bench_big.py`` to compare.

Usage::

  /work/venv-ct/bin/python benchmarks/bench_big_ct.py --path CKPT --work DIR [--repeats 1]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch
from circuit_tracer import attribute
from circuit_tracer.replacement_model.replacement_model_transformerlens import (
  TransformerLensReplacementModel,
)
from circuit_tracer.transcoder import SingleLayerTranscoder, TranscoderSet
from safetensors import safe_open
from transformer_lens import HookedTransformerConfig

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _ct_model import Tok  # noqa: E402


def _status(key: str) -> int:
  with open("/proc/self/status") as f:
    for line in f:
      if line.startswith(key):
        return int(line.split()[1]) * 1024
  raise KeyError(key)


def _reset_peak() -> None:
  with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # VmHWM := VmRSS


def tl_config(cfg: dict) -> HookedTransformerConfig:
  """TransformerLens's Llama-3.2-1B config (loading_from_pretrained.py), from ``cfg``."""
  rope = cfg.get("rope_scaling") or {}
  ntk = (
    dict(
      use_NTK_by_parts_rope=True,
      NTK_by_parts_low_freq_factor=rope["low_freq_factor"],
      NTK_by_parts_high_freq_factor=rope["high_freq_factor"],
      NTK_by_parts_factor=rope["factor"],
      NTK_original_ctx_len=rope["original_max_position_embeddings"],
    )
    if rope.get("rope_type") == "llama3"
    else {}
  )
  return HookedTransformerConfig(
    d_model=cfg["hidden_size"],
    d_head=cfg.get("head_dim", cfg["hidden_size"] // cfg["num_attention_heads"]),
    n_heads=cfg["num_attention_heads"],
    d_mlp=cfg["intermediate_size"],
    n_layers=cfg["num_hidden_layers"],
    n_ctx=2048,
    eps=cfg["rms_norm_eps"],
    d_vocab=cfg["vocab_size"],
    act_fn="silu",
    n_key_value_heads=cfg["num_key_value_heads"],
    normalization_type="RMS",
    positional_embedding_type="rotary",
    rotary_adjacent_pairs=False,
    rotary_dim=cfg.get("head_dim", cfg["hidden_size"] // cfg["num_attention_heads"]),
    final_rms=True,
    gated_mlp=True,
    rotary_base=cfg["rope_theta"],
    dtype=torch.float32,
    device="cpu",
    init_weights=False,
    **ntk,
  )


def load_weights(model, path: Path, cfg: dict) -> None:
  """The checkpoint's tensors copied into ``model`` one at a time (TransformerLens's
  ``convert_llama_weights``' layout)."""
  n, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
  index = path / "model.safetensors.index.json"
  files = (
    sorted(set(json.loads(index.read_text())["weight_map"].values()))
    if index.exists()
    else ["model.safetensors"]
  )
  sd = {k: v for k, v in model.named_parameters() if not k.startswith("transcoders.")}
  written = set()

  def put(name, value):
    with torch.no_grad():
      sd[name].copy_(value)
    written.add(name)

  for file in files:
    with safe_open(str(path / file), framework="pt") as f:
      for key in f.keys():
        t = f.get_tensor(key).float()
        if key == "model.embed_tokens.weight":
          put("embed.W_E", t)
          if cfg["tie_word_embeddings"]:
            put("unembed.W_U", t.T)
        elif key == "lm_head.weight":
          put("unembed.W_U", t.T)
        elif key == "model.norm.weight":
          put("ln_final.w", t)
        else:
          parts = key.split(".")
          i, rest = int(parts[2]), ".".join(parts[3:])
          b = f"blocks.{i}."
          if rest == "input_layernorm.weight":
            put(b + "ln1.w", t)
          elif rest == "post_attention_layernorm.weight":
            put(b + "ln2.w", t)
          elif rest == "self_attn.q_proj.weight":
            put(b + "attn.W_Q", t.reshape(n, -1, t.shape[1]).transpose(1, 2))
          elif rest in ("self_attn.k_proj.weight", "self_attn.v_proj.weight"):
            name = b + ("attn._W_K" if "k_proj" in rest else "attn._W_V")
            put(name, t.reshape(kv, -1, t.shape[1]).transpose(1, 2))
          elif rest == "self_attn.o_proj.weight":
            put(b + "attn.W_O", t.T.reshape(n, -1, t.shape[0]))
          elif rest == "mlp.gate_proj.weight":
            put(b + "mlp.W_gate", t.T)
          elif rest == "mlp.up_proj.weight":
            put(b + "mlp.W_in", t.T)
          elif rest == "mlp.down_proj.weight":
            put(b + "mlp.W_out", t.T)
          else:
            raise KeyError(key)
        del t
  with torch.no_grad():  # the biases TransformerLens keeps for Llama are zero
    for name, p in sd.items():
      if name.split(".")[-1].lstrip("_").startswith("b_"):
        p.zero_()
        written.add(name)
  missing = set(sd) - written
  if missing:  # init_weights=False leaves them uninitialised
    raise RuntimeError(f"parameters not written: {sorted(missing)[:5]}")


def main(argv=None) -> dict:
  p = argparse.ArgumentParser()
  p.add_argument("--path", required=True)
  p.add_argument("--work", required=True)
  p.add_argument("--nodes", type=int, default=128)
  p.add_argument("--repeats", type=int, default=1)
  args = p.parse_args(argv)
  path, work = Path(args.path), Path(args.work)
  cfg = json.loads((path / "config.json").read_text())
  z = np.load(work / "jax_float32_graph.npz")
  base = _status("VmRSS:")
  t0 = time.perf_counter()
  tcs = {}
  for i in range(cfg["num_hidden_layers"]):
    w_enc = z[f"tc{i}/W_enc"]
    t = SingleLayerTranscoder(
      w_enc.shape[0],
      w_enc.shape[1],
      torch.nn.ReLU(),
      i,
      dtype=torch.float32,
      device=torch.device("cpu"),
    )
    tcs[i] = t
  tset = TranscoderSet(
    tcs, feature_input_hook="ln2.hook_normalized", feature_output_hook="hook_mlp_out"
  )
  # ReplacementModel.from_config's two steps, the weights written between them (while the
  # parameters keep TransformerLens's names)
  model = TransformerLensReplacementModel(tl_config(cfg))
  load_weights(model, path, cfg)
  model._configure_replacement_model(tset)
  with torch.no_grad():
    for i, t in tcs.items():
      gain = model.blocks[i].ln2.w.detach()
      t.W_enc.copy_((torch.from_numpy(z[f"tc{i}/W_enc"]) * gain[:, None]).T)
      t.b_enc.copy_(torch.from_numpy(z[f"tc{i}/b_enc"]))
      t.W_dec.copy_(torch.from_numpy(z[f"tc{i}/W_dec"]))
      t.b_dec.copy_(torch.from_numpy(z[f"tc{i}/b_dec"]))
  model.tokenizer = Tok(cfg["vocab_size"])
  build_s = time.perf_counter() - t0
  built = _status("VmRSS:") - base
  tokens = torch.from_numpy(z["tokens"].astype(np.int64))
  default = torch.get_num_threads()
  walls: dict = {"1": [], str(default): []}
  cpus: dict = {"1": [], str(default): []}
  loads = []
  graph = None
  _reset_peak()
  for r in range(args.repeats):
    for threads in [1, default] if r % 2 == 0 else [default, 1]:
      torch.set_num_threads(threads)
      graph = None  # the previous graph is not held through the next
      c0, w0 = time.process_time(), time.perf_counter()
      graph = attribute(tokens, model, batch_size=64, max_feature_nodes=args.nodes, verbose=False)
      walls[str(threads)].append(time.perf_counter() - w0)
      cpus[str(threads)].append(time.process_time() - c0)
      loads.append(os.getloadavg())
  peak = _status("VmHWM:") - base
  np.savez(
    work / "ct_float32_graph.npz",
    adjacency=graph.adjacency_matrix.float().numpy(),
    active_features=graph.active_features.numpy(),
    activation_values=graph.activation_values.float().numpy(),
    selected_features=graph.selected_features.numpy(),
    logit_tokens=graph.logit_token_ids.numpy(),
  )
  weights = sum(q.numel() * q.element_size() for q in model.parameters())
  result = {
    "side": "circuit-tracer 0.5.0 (TransformerLens)",
    "threads_default": default,
    "wall_s": walls,
    "cpu_s": cpus,
    "load_average": loads,
    "build_s": build_s,
    "model_and_transcoders_bytes": weights,
    "after_build_bytes": built,
    "peak_bytes": peak,
    "active_features": int(len(graph.active_features)),
    "adjacency_shape": list(graph.adjacency_matrix.shape),
  }
  print(json.dumps(result))
  return result


if __name__ == "__main__":
  main()
