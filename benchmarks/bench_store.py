"""Activation store: collection throughput against the jitted forward alone, in one process.

``jaxlens.store.collect`` runs a jitted ``jl.trace`` per batch and writes the chosen
sites (by default every block's output, the residual stream) to disk, one
safetensors shard per batch, from a background thread. The baseline is the jitted
``model.apply`` over the same batches (already on the host, so neither side pays
for making data). The figure is throughput(collect) / throughput(forward) =
time(forward) / time(collect); the target is >= 0.8 (writing costs at most 25%).

Usage::

  python benchmarks/bench_store.py [--size small] [--batches 32] [--repeats 3] [--dir /tmp/x]
"""

from __future__ import annotations

import shutil
import sys
import tempfile
import time
from pathlib import Path

_ROOT = Path(__file__).resolve().parent.parent
if str(_ROOT) not in sys.path:
  sys.path.insert(0, str(_ROOT))

import jax
import numpy as np

from benchmarks import _setup
from benchmarks._timing import env_info, median, report, row
from jaxlens import store

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "store.json"


def parse_args(argv=None):
  p = _setup.parser(__doc__, repeats=3, out=str(DEFAULT_OUT))
  p.add_argument("--batches", type=int, default=32, help="batches per collection")
  p.add_argument("--sites", default="", help="comma-separated sites (default: every block)")
  p.add_argument("--dir", default="", help="where to write the store (default: a temp dir)")
  return p.parse_args(argv)


def main(argv=None) -> dict:
  args = parse_args(argv)
  model, variables, tokens = _setup.build_gpt(args)
  sites = args.sites.split(",") if args.sites else [f"block_{i}" for i in range(model.n_layers)]
  rng = np.random.default_rng(args.seed)
  data = [
    rng.integers(0, model.vocab_size, tokens.shape, dtype=np.int32) for _ in range(args.batches)
  ]
  work = Path(args.dir or tempfile.mkdtemp(prefix="bench_store_"))
  forward = jax.jit(model.apply)

  def run_forward():
    t0 = time.perf_counter()
    out = None
    for batch in data:
      out = forward(variables, batch)
    jax.block_until_ready(out)
    return time.perf_counter() - t0

  def run_collect():
    t0 = time.perf_counter()
    s = store.collect(
      model, variables, data, work / "acts", sites=sites, overwrite=True, progress=False
    )
    took = time.perf_counter() - t0
    assert s.complete and s.num_batches == len(data)
    return took

  # Compile both, and check that the store holds what a trace gives.
  run_forward()
  run_collect()
  import jaxlens as jl

  direct = jl.trace(model, variables, data[-1], save=[jl.module(s) for s in sites])
  stored = store.open(work / "acts")
  diff = max(
    float(np.max(np.abs(stored.batch(len(data) - 1, s) - np.asarray(direct[s].out)))) for s in sites
  )
  if diff > 1e-5:
    raise AssertionError(f"the stored values differ from a trace by {diff}")

  times = {"forward": [], "collect": []}
  for r in range(args.warmup + args.repeats):
    order = ("forward", "collect") if r % 2 == 0 else ("collect", "forward")
    for name in order:
      t = run_forward() if name == "forward" else run_collect()
      if r >= args.warmup:
        times[name].append(t)
  med = {k: median(v) for k, v in times.items()}
  bytes_per_batch = sum(stored.batch(0, s).nbytes for s in sites)
  throughput = med["forward"] / med["collect"]
  rows = [
    row(
      "store_throughput",
      "collect (forward + write) throughput / jitted forward alone",
      throughput,
      kind="speedup",
      target=(">=", 0.8),
      candidate=f"store.collect({len(sites)} sites)",
      baseline="jit(model.apply)",
      candidate_value=med["collect"],
      baseline_value=med["forward"],
      note=f"{bytes_per_batch / 2**20:.1f} MiB written per batch, {args.batches} batches",
    )
  ]
  result = {
    "benchmark": "store",
    "title": "activation store: collection throughput vs the jitted forward",
    "config": {
      **_setup.model_config(args, model),
      "batches": args.batches,
      "sites": sites,
      "repeats": args.repeats,
      "warmup": args.warmup,
      "bytes_per_batch": bytes_per_batch,
    },
    "env": env_info(),
    "rows": rows,
    "runtime_s": {k: {"median": med[k], "all": v} for k, v in times.items()},
    "write_MiB_per_s": bytes_per_batch * args.batches / med["collect"] / 2**20,
    "check": {"max_abs_diff_vs_trace": diff},
  }
  if not args.dir:
    shutil.rmtree(work, ignore_errors=True)
  c = result["config"]
  table = (
    f"{result['title']}: GPT {c['n_layers']} layers, d_model {c['d_model']}, batch "
    f"{c['batch']}, seq {c['seq']}; {len(sites)} sites, {args.batches} batches, "
    f"{bytes_per_batch / 2**20:.2f} MiB per batch\n\n"
    "| forward (s) | collect (s) | throughput ratio | target | met | write MiB/s |\n"
    "|---|---|---|---|---|---|\n"
    f"| {med['forward']:.3f} | {med['collect']:.3f} | {throughput:.3f} | >= 0.8 | "
    f"{'yes' if throughput >= 0.8 else 'no'} | {result['write_MiB_per_s']:.0f} |"
  )
  return report(result, table, args.out)


if __name__ == "__main__":
  main(sys.argv[1:])
