"""Attribution graphs: ``circuits.attribute`` (every row from one VJP of the frozen forward,
``jax.vmap`` over batches of cotangents) against a baseline in the same process that runs one
jitted forward and backward of the frozen model per row (what a user writes with ``jax.grad``;
circuit-tracer also runs the forward per row, on a batch of copies of the prompt). Both compute
every feature row and logit row of the same graph; the script checks that they agree and
reports the wall time, rows per second and the ratio, and the time of pruning and scores.

Usage::

  python benchmarks/bench_circuits.py [--seq 32] [--layers 4] [--d-model 64] [--d-sae 256]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

_ROOT = Path(__file__).resolve().parent.parent
if str(_ROOT) not in sys.path:
  sys.path.insert(0, str(_ROOT))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import jaxlens.models as jm  # noqa: E402
from jaxlens import circuits, sae  # noqa: E402
from jaxlens.core import compilation_cache_dir  # noqa: E402


def _setup(seq, layers, d_model, d_sae):
  cfg = jm.LlamaConfig(
    vocab_size=512,
    d_model=d_model,
    n_layers=layers,
    n_heads=4,
    n_kv_heads=2,
    d_mlp=2 * d_model,
    max_len=max(seq, 8),
  )
  model = jm.Llama(cfg)
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, 512, seq), jnp.int32)
  variables = model.init(jax.random.key(0), tokens[None])
  tcs = []
  for i in range(layers):
    t = sae.Transcoder.init(jax.random.key(i), d_in=d_model, d_sae=d_sae, skip=True)
    # sparse-ish: a few percent of the features fire
    tcs.append(t.replace(W_enc=t.W_enc * 60, b_enc=t.b_enc - 4.0))
  return model, variables, tokens, tcs


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--seq", type=int, default=32)
  parser.add_argument("--layers", type=int, default=4)
  parser.add_argument("--d-model", type=int, default=64)
  parser.add_argument("--d-sae", type=int, default=256)
  parser.add_argument("--batch-size", type=int, default=64)
  parser.add_argument("--baseline-rows", type=int, default=64, help="rows timed for the baseline")
  args = parser.parse_args(argv)
  model, variables, tokens, tcs = _setup(args.seq, args.layers, args.d_model, args.d_sae)

  load_before = os.getloadavg()[0]
  t0, c0 = time.perf_counter(), time.process_time()
  graph = circuits.attribute(model, variables, tokens, tcs, batch_size=args.batch_size)
  t_graph, c_graph = time.perf_counter() - t0, time.process_time() - c0
  # Again: the programs are compiled, as for another prompt of the same length.
  t0, c0 = time.perf_counter(), time.process_time()
  circuits.attribute(model, variables, tokens, tcs, batch_size=args.batch_size)
  t_again, c_again = time.perf_counter() - t0, time.process_time() - c0
  rows = graph.n_features + graph.n_logits

  # Baseline: one jitted forward + backward of the frozen model per row (feature rows only).
  lr = circuits.local_replacement(model, variables, tokens, tcs)
  rep = circuits.replacement(model, tcs)
  writes = lr.node_writes + lr.errors
  feats = graph.active_features

  @jax.jit
  def one_row(layer, pos, enc):
    def target(tok, w):
      mlp_in, _ = lr.run(tok, w)
      return mlp_in[layer, pos] @ enc

    g_tok, g_w = jax.grad(target, argnums=(0, 1))(lr.tok, writes)
    return g_tok, g_w

  n_base = min(args.baseline_rows, graph.n_features)
  pick = np.linspace(0, graph.n_features - 1, n_base).astype(int)
  layer0, pos0, f0 = feats[pick[0]]
  jax.block_until_ready(one_row(int(layer0), int(pos0), rep.W_enc[layer0][:, f0]))  # compile
  t0, c0 = time.perf_counter(), time.process_time()
  max_diff = 0.0
  scale = float(np.abs(graph.adjacency).max())
  for i in pick:
    layer, pos, f = (int(v) for v in feats[i])
    g_tok, g_w = one_row(layer, pos, rep.W_enc[layer][:, f])
    err = np.asarray(jnp.einsum("lsd,lsd->ls", g_w, lr.errors)).reshape(-1)
    sl = graph.node_slices()
    max_diff = max(max_diff, float(np.abs(err - graph.adjacency[i, sl["errors"]]).max()))
    tk = np.asarray(jnp.einsum("sd,sd->s", g_tok, lr.tok))
    max_diff = max(max_diff, float(np.abs(tk - graph.adjacency[i, sl["tokens"]]).max()))
  t_base_rows = (time.perf_counter() - t0) / n_base
  c_base_rows = (time.process_time() - c0) / n_base

  t0, c0 = time.perf_counter(), time.process_time()
  pruned = circuits.prune(graph)
  scores = circuits.graph_scores(graph)
  t_prune, c_prune = time.perf_counter() - t0, time.process_time() - c0

  result = {
    "devices": str(jax.devices()),
    # the first call's compilation is read from here when an earlier run wrote it
    "compilation_cache": str(compilation_cache_dir()),
    "shape": vars(args),
    "active_features": int(len(feats)),
    "nodes": int(graph.adjacency.shape[0]),
    "rows": rows,
    "load_average": [load_before, os.getloadavg()[0]],
    "graph_s": t_graph,
    "graph_cpu_s": c_graph,
    "graph_rows_per_s": rows / t_graph,
    "graph_again_s": t_again,
    "graph_again_cpu_s": c_again,
    "baseline_s_per_row": t_base_rows,
    "baseline_cpu_s_per_row": c_base_rows,
    "baseline_rows_per_s": 1.0 / t_base_rows,
    "baseline_projected_graph_s": t_base_rows * rows,
    "baseline_projected_graph_cpu_s": c_base_rows * rows,
    "speedup_vs_baseline": t_base_rows * rows / t_graph,
    "speedup_vs_baseline_cpu": c_base_rows * rows / c_graph,
    "max_abs_diff_over_max_edge": max_diff / scale,
    "prune_and_scores_s": t_prune,
    "prune_and_scores_cpu_s": c_prune,
    "kept_nodes": int(pruned.node_mask.sum()),
    "replacement_score": scores[0],
    "completeness_score": scores[1],
  }
  print(json.dumps(result, indent=1))
  return result


if __name__ == "__main__":
  main()
