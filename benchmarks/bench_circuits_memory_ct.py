"""The longest prompt whose graph fits a memory budget, the circuit-tracer side (run in its own
environment, /work/venv-ct: circuit-tracer 0.5.0 pins transformers 4.56-4.57): the model and
transcoders of benchmarks/bench_circuits_ct.py (a random GPT-2-layout TransformerLens model, 4
layers, d_model 64, 4 heads, vocabulary 512, per-layer transcoders of 256 features), built for a
prompt of SEQ tokens; ``run`` builds circuit-tracer's graph (every active feature, batch 256,
torch's default threads) inside a cgroup-v1 memory cgroup limited to BUDGET GiB above the
process's baseline (``benchmarks/_cgroup.py``), and prints its time, nodes and peak anonymous
resident memory as JSON (a run the budget kills prints nothing: its exit status is 137);
``weights`` writes the weights and prompt to /tmp/ct/mem_<SEQ>.npz for
benchmarks/bench_circuits_memory.py (the jaxlens side).

Usage (as root)::

  /work/venv-ct/bin/python benchmarks/bench_circuits_memory_ct.py weights SEQ
  /work/venv-ct/bin/python benchmarks/bench_circuits_memory_ct.py run SEQ [BUDGET_GIB]
"""

import json
import os
import sys
import time

import numpy as np
import torch
from circuit_tracer import attribute
from circuit_tracer.replacement_model import ReplacementModel
from circuit_tracer.transcoder import SingleLayerTranscoder, TranscoderSet
from transformer_lens import HookedTransformerConfig

sys.path.insert(0, os.path.dirname(__file__))
from _cgroup import Budget  # noqa: E402

mode, seq = sys.argv[1], int(sys.argv[2])
budget_gib = float(sys.argv[3]) if len(sys.argv) > 3 else 8.0
L, D, V, F = 4, 64, 512, 256

# The model and transcoders of benchmarks/bench_circuits_ct.py, the same seeds.
torch.manual_seed(0)
cfg = HookedTransformerConfig(
  n_layers=L,
  d_model=D,
  n_ctx=max(seq, 16),
  d_head=16,
  n_heads=4,
  d_mlp=4 * D,
  d_vocab=V,
  act_fn="gelu_new",
  normalization_type="LN",
  dtype=torch.float32,
  device="cpu",
  positional_embedding_type="standard",
)
g = torch.Generator().manual_seed(1)
tcs = {}
for i in range(L):
  t = SingleLayerTranscoder(
    D, F, torch.nn.ReLU(), i, dtype=torch.float32, device=torch.device("cpu")
  )
  with torch.no_grad():
    t.W_enc.copy_(torch.randn(F, D, generator=g) * 0.3)
    t.b_enc.copy_(torch.randn(F, generator=g) * 0.1 - 4.0)  # a few percent fire
    t.W_dec.copy_(torch.randn(F, D, generator=g) * 0.2)
    t.b_dec.copy_(torch.randn(D, generator=g) * 0.05)
  tcs[i] = t
tset = TranscoderSet(
  tcs, feature_input_hook="ln2.hook_normalized", feature_output_hook="hook_mlp_out"
)
model = ReplacementModel.from_config(cfg, tset, backend="transformerlens")


class Tok:
  all_special_ids = [0]
  bos_token_id = 0
  pad_token_id = 0
  eos_token_id = 0
  vocab_size = V
  padding_side = "right"

  def decode(self, ids):
    ids = ids if isinstance(ids, list) else [int(ids)] if np.ndim(ids) == 0 else list(ids)
    return " ".join(f"t{int(i)}" for i in ids)


model.tokenizer = Tok()
rng = np.random.default_rng(0)
tokens = torch.tensor(np.concatenate([[0], rng.integers(1, V, seq - 1)]))

if mode == "weights":
  out = {
    f"w/{k}": v.detach().numpy() for k, v in model.state_dict().items() if "transcoders" not in k
  }
  for i in range(L):
    for k in ("W_enc", "b_enc", "W_dec", "b_dec"):
      out[f"tc{i}/{k}"] = getattr(tcs[i], k).detach().numpy()
  out["tokens"] = tokens.numpy()
  os.makedirs("/tmp/ct", exist_ok=True)
  np.savez(f"/tmp/ct/mem_{seq}.npz", **out)
  sys.exit(0)

with Budget(f"bench_ct_{os.getpid()}", int(budget_gib * 2**30)) as budget:
  c0, t0 = time.process_time(), time.perf_counter()
  graph = attribute(tokens, model, batch_size=256, max_feature_nodes=None, verbose=False)
  wall, cpu = time.perf_counter() - t0, time.process_time() - c0
  result = {
    "side": "circuit-tracer 0.5.0",
    "seq": seq,
    "nodes": int(graph.adjacency_matrix.shape[0]),
    "active_features": int(len(graph.active_features)),
    "wall_s": wall,
    "cpu_s": cpu,
    "threads": torch.get_num_threads(),
    **budget.report(),
  }
print(json.dumps(result))
