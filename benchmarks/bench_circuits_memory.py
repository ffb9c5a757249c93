"""The longest prompt whose graph fits a memory budget, the jaxlens side: the weights that
``benchmarks/bench_circuits_memory_ct.py weights SEQ`` wrote (the model and transcoders of
benchmarks/bench_circuits_ct.py: a random GPT-2 layout, 4 layers, d_model 64, per-layer
transcoders of 256 features) in the zoo's GPT-2; inside a cgroup-v1 memory cgroup limited to
BUDGET GiB above the process's baseline (``benchmarks/_cgroup.py``), builds the graph on disk
(``circuits.attribute(..., graph_path=...)``, every active feature, ``zero_bos=True`` as
circuit-tracer, float32), prunes it and computes its scores (in blocks of rows), and prints the
times, nodes and peak anonymous resident memory as JSON (a run the budget kills prints
nothing: exit status 137). ``--compare`` also builds the graph in memory (outside the budget)
and compares the adjacency, the pruning masks and the scores.

Usage (as root)::

  /work/venv-ct/bin/python benchmarks/bench_circuits_memory_ct.py weights SEQ
  python benchmarks/bench_circuits_memory.py SEQ [BUDGET_GIB] [--compare] [--dir DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from _cgroup import Budget  # noqa: E402
from bench_circuits_vs_ct import build  # noqa: E402

from jaxlens import circuits  # noqa: E402


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("seq", type=int)
  parser.add_argument("budget_gib", type=float, nargs="?", default=8.0)
  parser.add_argument("--compare", action="store_true")
  parser.add_argument("--dir", default="/tmp/memrun/graphs")
  args = parser.parse_args()
  z = np.load(f"/tmp/ct/mem_{args.seq}.npz")
  model, variables, tcs = build(z, args.seq)
  tokens = jnp.asarray(z["tokens"], jnp.int32)
  Path(args.dir).mkdir(parents=True, exist_ok=True)
  path = Path(args.dir) / f"graph_{args.seq}_{os.getpid()}"
  times = {}
  try:
    with Budget(f"bench_jaxlens_{os.getpid()}", int(args.budget_gib * 2**30)) as budget:
      c0, t0 = time.process_time(), time.perf_counter()
      graph = circuits.attribute(model, variables, tokens, tcs, zero_bos=True, graph_path=path)
      times["attribute"] = (time.perf_counter() - t0, time.process_time() - c0)
      c0, t0 = time.process_time(), time.perf_counter()
      pruned = circuits.prune(graph)
      times["prune"] = (time.perf_counter() - t0, time.process_time() - c0)
      c0, t0 = time.process_time(), time.perf_counter()
      scores = circuits.graph_scores(graph)
      times["graph_scores"] = (time.perf_counter() - t0, time.process_time() - c0)
      n = graph.adjacency.shape[0]
      result = {
        "side": "jaxlens, graph on disk",
        "seq": args.seq,
        "nodes": int(n),
        "active_features": int(len(graph.active_features)),
        "file_gib": (path / "graph.safetensors").stat().st_size / 2**30,
        "wall_s": {k: v[0] for k, v in times.items()},
        "cpu_s": {k: v[1] for k, v in times.items()},
        "kept_nodes": int(pruned.node_mask.sum()),
        "kept_edges": int(pruned.edge_mask.nnz),
        "replacement_score": scores[0],
        "completeness_score": scores[1],
        **budget.report(),
      }
    if args.compare:
      dense = circuits.attribute(model, variables, tokens, tcs, zero_bos=True)
      in_memory = circuits.prune(dense)
      result["compare"] = {
        "adjacency_equal": bool(np.array_equal(dense.adjacency, graph.adjacency)),
        "node_mask_equal": bool(np.array_equal(in_memory.node_mask, pruned.node_mask)),
        "edge_mask_differences": int((pruned.edge_mask.toarray() != in_memory.edge_mask).sum()),
        "scores_max_difference": float(
          np.abs(np.subtract(circuits.graph_scores(dense), scores)).max()
        ),
      }
  finally:
    shutil.rmtree(path, ignore_errors=True)
  print(json.dumps(result))


if __name__ == "__main__":
  main()
