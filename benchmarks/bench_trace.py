"""``jl.trace`` saving every module site against a plain jitted forward, in one process.

All functions are jitted functions of ``(variables, tokens)`` on the built-in GPT:

* ``plain``: ``model.apply(variables, tokens)``;
* ``trace``: ``jl.trace(model, variables, tokens)`` (``save=None``: every module site),
  returning the :class:`jaxlens.Trace` itself, as a user leaving ``jit`` with it does;
* ``trace_lean``: the same with ``keep_inputs=False``, a Trace of the output and the
  saved sites only (no replay from it);
* ``trace_values``: the same trace, returning only ``(trace.output, trace.values)``;
* ``trace_output``: the same trace, returning only ``trace.output`` (XLA drops the rest);
* ``flax_capture``: ``model.apply(..., capture_intermediates=True,
  mutable=["intermediates"])``, flax's own capture of every module's output, for
  reference.

The three trace variants split the cost of a returned trace into its parts: the
interpreter itself (``trace_output``), writing the saved sites out of the program
(``trace_values``), and copying the call's inputs, which a Trace carries for replay
(``trace``). The script checks that every variant gives the plain logits and that the
saved sites equal flax's intermediates.

Usage::

  python benchmarks/bench_trace.py [--size small] [--repeats 20]
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

_ROOT = Path(__file__).resolve().parent.parent
if str(_ROOT) not in sys.path:
  sys.path.insert(0, str(_ROOT))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import jaxlens as jl  # noqa: E402
from benchmarks import _setup  # noqa: E402
from benchmarks._timing import (
  canonical_hlo,
  env_info,
  interleaved,
  max_abs_diff,  # noqa: E402
  median,
  memory_bytes,
  ratio,
  row,
  timed,
  report,
)

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "trace.json"


def parse_args(argv=None):
  p = _setup.parser(__doc__, repeats=20, out=str(DEFAULT_OUT))
  return p.parse_args(argv)


def make_fns(model) -> dict:
  """The jitted variants, each a function of ``(variables, tokens)``."""

  def trace_values(v, x):
    t = jl.trace(model, v, x)
    return t.output, t.values

  return {
    "plain": jax.jit(model.apply),
    "trace": jax.jit(lambda v, x: jl.trace(model, v, x)),
    "trace_lean": jax.jit(lambda v, x: jl.trace(model, v, x, keep_inputs=False)),
    "trace_values": jax.jit(trace_values),
    "trace_output": jax.jit(lambda v, x: jl.trace(model, v, x).output),
    "flax_capture": jax.jit(
      lambda v, x: model.apply(v, x, capture_intermediates=True, mutable=["intermediates"])
    ),
  }


def _flax_value(intermediates, label):
  node = intermediates
  for part in label.split("/"):
    node = node[part]
  return node["__call__"][0]


def _nbytes(tree) -> int:
  return sum(int(np.prod(a.shape)) * a.dtype.itemsize for a in jax.tree.leaves(tree))


def main(argv=None) -> dict:
  """Runs the benchmark; returns (and writes, unless ``--out ''``) the result dict."""
  args = parse_args(argv)
  model, variables, tokens = _setup.build_gpt(args)
  fns = make_fns(model)

  first, outs = {}, {}
  for name, fn in fns.items():
    first[name], outs[name] = timed(fn, variables, tokens)

  # Same logits everywhere; the saved sites are flax's intermediates.
  logits = outs["plain"]
  trace = outs["trace"]
  inter = outs["flax_capture"][1]["intermediates"]
  diffs = {
    "trace_output": max_abs_diff(trace.output, logits),
    "trace_lean_output": max_abs_diff(outs["trace_lean"].output, logits),
    "trace_values_output": max_abs_diff(outs["trace_values"][0], logits),
    "trace_output_only": max_abs_diff(outs["trace_output"], logits),
    "flax_output": max_abs_diff(outs["flax_capture"][0], logits),
    "sites_vs_flax": max(
      max_abs_diff(trace.values[lbl], _flax_value(inter, lbl)) for lbl in trace.labels
    ),
  }
  for key, d in diffs.items():
    if d > 1e-5:
      raise AssertionError(f"{key}: max abs diff {d} > 1e-5")
  flax_labels = {
    "/".join(p.key for p in path[:-2]) for path, _ in jax.tree_util.tree_flatten_with_path(inter)[0]
  }
  flax_labels.discard("")  # the root module's output is the logits themselves

  # Calibration: what writing fresh output buffers of the saved sites' shapes costs by
  # itself: a program that scales each saved value against one that only reduces them.
  saved_vals = list(trace.values.values())
  write = jax.jit(lambda vals: [2.0 * a for a in vals])
  reduce = jax.jit(lambda vals: sum(jnp.sum(2.0 * a) for a in vals))
  timed(write, saved_vals)
  timed(reduce, saved_vals)

  calls = {n: (lambda f=f: f(variables, tokens)) for n, f in fns.items()}
  calls["write_saved_shapes"] = lambda: write(saved_vals)
  calls["reduce_saved_shapes"] = lambda: reduce(saved_vals)
  times = interleaved(calls, args.repeats, args.warmup)
  med = {n: median(ts) for n, ts in times.items()}
  compiled = {n: f.lower(variables, tokens).compile() for n, f in fns.items()}
  mem = {n: memory_bytes(c) for n, c in compiled.items()}
  hlo = {n: canonical_hlo(c.as_text()) for n, c in compiled.items()}
  programs = {
    "trace_output_identical_to_plain": hlo["trace_output"] == hlo["plain"],
    "copy_ops": {n: len(re.findall(r"= \S+ copy\(", t)) for n, t in hlo.items()},
    # Kernels of the entry computation: each fusion is one loop over memory.
    "fusions": {
      n: len(re.findall(r"= \S+ fusion\(", t[t.index("ENTRY") :])) for n, t in hlo.items()
    },
    "hlo_lines": {n: t.count("\n") for n, t in hlo.items()},
  }

  saved_bytes = _nbytes(trace.values)
  input_bytes = _nbytes((variables, tokens))
  rows = [
    row(
      "trace_all_sites",
      "jl.trace saving every module site, Trace returned (keep_inputs=False) / plain forward",
      ratio(med["trace_lean"], med["plain"]),
      target=("<=", 1.1),
      candidate="jit(jl.trace(model, v, x, keep_inputs=False))",
      baseline="jit(model.apply)",
      candidate_value=med["trace_lean"],
      baseline_value=med["plain"],
    ),
    row(
      "trace_all_sites_with_inputs",
      "the same Trace holding the call's inputs for replay (the default) / plain forward",
      ratio(med["trace"], med["plain"]),
      candidate="jit(jl.trace(model, v, x))",
      baseline="jit(model.apply)",
      candidate_value=med["trace"],
      baseline_value=med["plain"],
    ),
    row(
      "trace_all_sites_values",
      "the same trace returning only output and saved values",
      ratio(med["trace_values"], med["plain"]),
      target=("<=", 1.1),
      candidate="jit: (t.output, t.values)",
      baseline="jit(model.apply)",
      candidate_value=med["trace_values"],
      baseline_value=med["plain"],
    ),
    row(
      "trace_output_only",
      "the same trace returning only the output (interpreter cost)",
      ratio(med["trace_output"], med["plain"]),
      candidate="jit: t.output",
      baseline="jit(model.apply)",
      candidate_value=med["trace_output"],
      baseline_value=med["plain"],
    ),
    row(
      "flax_capture_intermediates",
      "flax capture_intermediates=True / plain (reference)",
      ratio(med["flax_capture"], med["plain"]),
      candidate="capture_intermediates=True",
      baseline="jit(model.apply)",
      candidate_value=med["flax_capture"],
      baseline_value=med["plain"],
    ),
    row(
      "trace_vs_flax_capture",
      "jl.trace (Trace returned) / flax capture_intermediates",
      ratio(med["trace"], med["flax_capture"]),
      candidate="jit(jl.trace(...))",
      baseline="capture_intermediates=True",
      candidate_value=med["trace"],
      baseline_value=med["flax_capture"],
    ),
  ]
  result = {
    "benchmark": "trace",
    "title": "jl.trace saving every module site vs a plain forward",
    "config": {
      **_setup.model_config(args, model),
      "repeats": args.repeats,
      "warmup": args.warmup,
      "save": "None (every module site)",
    },
    "env": env_info(),
    "rows": rows,
    "runtime_s": {n: {"median": med[n], "min": min(times[n]), "all": times[n]} for n in times},
    "first_call_s": first,
    "memory_bytes": mem,
    "sizes": {
      "saved_sites": len(trace.labels),
      "flax_sites": len(flax_labels),
      "saved_bytes": saved_bytes,
      "input_bytes": input_bytes,
      "logits_bytes": _nbytes(logits),
      "saved_bytes_over_plain_temp": ratio(saved_bytes, mem["plain"]["temp"]),
    },
    "check": {**diffs, "same_sites_as_flax": sorted(flax_labels) == sorted(trace.labels)},
    "programs": programs,
    "analysis": analysis(med, mem, programs, saved_bytes, input_bytes),
  }
  return report(result, format_table(result), args.out)


def analysis(med, mem, programs, saved_bytes, input_bytes) -> list[str]:
  """What the decomposition says about where the time goes, from the measured figures."""
  base = med["plain"]
  interp = med["trace_output"] / base - 1
  saving = (med["trace_values"] - med["trace_output"]) / base
  copying = (med["trace"] - med["trace_values"]) / base
  mb = 1 / 2**20
  same = (
    "the same optimised program as the plain forward, so this is noise"
    if programs["trace_output_identical_to_plain"]
    else "an optimised program that differs from the plain forward's"
  )
  copies = programs["copy_ops"]
  return [
    f"Interpreter and site markers: {interp:+.1%} of a plain forward (returning only the "
    f"output, XLA compiles {same}).",
    f"Returning the {saved_bytes * mb:.1f} MiB of saved sites: {saving:+.1%} (output "
    f"buffers: {mem['trace_values']['output'] * mb:.1f} MiB against "
    f"{mem['plain']['output'] * mb:.2f} MiB); flax's capture_intermediates, which returns "
    f"the same sites, costs {med['flax_capture'] / base - 1:+.1%}. Writing the buffers is "
    f"not what costs: a program that only writes arrays of the saved sites' shapes costs "
    f"{(med['write_saved_shapes'] - med['reduce_saved_shapes']) / base:+.1%} of a forward "
    "more than one that only reduces them. Each saved value must exist as a buffer of its "
    "own, so XLA cannot fuse through it: the optimised program runs "
    f"{programs['fusions']['trace_values']} fused kernels instead of the plain forward's "
    f"{programs['fusions']['plain']} (flax's capture: {programs['fusions']['flax_capture']}), "
    "each one more pass over memory.",
    f"Copying the call's inputs ({input_bytes * mb:.1f} MiB of variables and tokens, which a "
    f"Trace carries for replay) into the result: {copying:+.1%}. jax.jit does not forward "
    "an input returned unchanged: it copies it into a new output buffer (copy instructions "
    f"in the optimised program: {copies['trace']} for the Trace, {copies['trace_lean']} "
    f"for the Trace with keep_inputs=False, {copies['plain']} for the plain forward). "
    "keep_inputs=False removes that part: "
    f"{med['trace_lean'] / base - 1:+.1%} of a forward in all.",
  ]


def format_table(r: dict) -> str:
  c = r["config"]
  lines = [
    f"{r['title']}: GPT {c['n_layers']} layers, d_model {c['d_model']}, batch "
    f"{c['batch']}, seq {c['seq']}; {r['sizes']['saved_sites']} sites saved",
    "",
    "| measure | median | ratio | target |",
    "|---|---|---|---|",
  ]
  for rw in r["rows"]:
    target = "" if rw["target"] is None else f"{rw['target'][0]} {rw['target'][1]}"
    lines.append(
      f"| {rw['measure']} | {rw['candidate_value'] * 1e3:.2f} ms | {rw['value']:.3f} | {target} |"
    )
  return "\n".join(lines + [""] + r["analysis"])


if __name__ == "__main__":
  main(sys.argv[1:])
