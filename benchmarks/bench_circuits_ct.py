"""Attribution graphs side by side with circuit-tracer 0.5.0, the circuit-tracer side (run in its
own environment: it pins transformers 4.56-4.57). A random GPT-2-layout TransformerLens model
(4 layers, d_model 64, 4 heads, vocabulary 512) with random per-layer transcoders of 256
features, built offline (the tokenizer attribute is a stand-in); for each prompt length its
``attribute`` (every active feature, batch 256) runs at one torch thread and at torch's default
thread count, alternately; the script writes the weights, each run's wall and CPU time and the
process's peak resident memory to /tmp/ct/bench_<seq>.json / .npz for
benchmarks/bench_circuits_vs_ct.py, which times jaxlens on the same weights.

Usage::

  /work/venv-ct/bin/python benchmarks/bench_circuits_ct.py SEQ [REPEATS]
"""

import json
import os
import resource
import sys
import time
from pathlib import Path

import numpy as np
import torch
from circuit_tracer import attribute

sys.path.insert(0, os.path.dirname(__file__))
from _ct_model import build, weights  # noqa: E402

seq = int(sys.argv[1])
repeats = int(sys.argv[2]) if len(sys.argv) > 2 else 1


def peak_mb():
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def cpu_s():
  r = resource.getrusage(resource.RUSAGE_SELF)
  return r.ru_utime + r.ru_stime


model, tcs, tokens = build(seq)
out = weights(model, tcs, tokens)
default = torch.get_num_threads()
runs = {"1": [], str(default): []}
cpus = {"1": [], str(default): []}
before = peak_mb()
graph = None
for r in range(repeats):
  for threads in [1, default] if r % 2 == 0 else [default, 1]:
    torch.set_num_threads(threads)
    graph = None  # the previous graph is not held through the next (the peak is one graph's)
    c0, t0 = cpu_s(), time.perf_counter()
    graph = attribute(tokens, model, batch_size=256, max_feature_nodes=None, verbose=False)
    runs[str(threads)].append(time.perf_counter() - t0)
    cpus[str(threads)].append(cpu_s() - c0)
out["n_active"] = np.asarray(len(graph.active_features))
np.savez(f"/tmp/ct/bench_{seq}.npz", **out)
result = {
  "seq": seq,
  "nodes": int(graph.adjacency_matrix.shape[0]),
  "active_features": int(len(graph.active_features)),
  "wall_s": {k: float(np.median(v)) for k, v in runs.items()},
  "cpu_s": {k: float(np.median(v)) for k, v in cpus.items()},
  "peak_rss_mb": peak_mb(),
  "rss_before_mb": before,
  "threads_default": default,
}
Path(f"/tmp/ct/bench_{seq}.json").write_text(json.dumps(result, indent=1))
print(json.dumps(result))
