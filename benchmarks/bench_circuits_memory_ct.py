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

from circuit_tracer import attribute

sys.path.insert(0, os.path.dirname(__file__))
from _cgroup import Budget  # noqa: E402
from _ct_model import build, weights  # noqa: E402

mode, seq = sys.argv[1], int(sys.argv[2])
budget_gib = float(sys.argv[3]) if len(sys.argv) > 3 else 8.0

# The model and transcoders of benchmarks/bench_circuits_ct.py, the same seeds.
model, tcs, tokens = build(seq)

if mode == "weights":
  import numpy as np

  os.makedirs("/tmp/ct", exist_ok=True)
  np.savez(f"/tmp/ct/mem_{seq}.npz", **weights(model, tcs, tokens))
  sys.exit(0)

import torch  # noqa: E402

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
