"""Memory of a trace that saves one site against a plain forward.

Method: XLA's buffer assignment, read from the compiled program
(``jax.jit(f).lower(...).compile().memory_analysis()``). XLA allocates a program's
temporaries as one block for the whole call, so ``temp + output`` is what one call
adds to the memory already holding its arguments, and ``argument + temp + output``
is the peak while it runs. This is exact for the compiled program and immune to the
noise of a shared machine; the CPU backend keeps no allocator statistics
(``Device.memory_stats()`` is ``None``), so a measured peak is not available there.

Variants, jitted functions of ``(variables, tokens)``:

* ``plain``: ``model.apply``;
* ``trace_one_site``: ``jl.trace(model, v, x, save=jl.module(site), keep_inputs=False)``,
  the Trace returned (output and the saved site);
* ``trace_one_site_with_inputs``: the same with the default ``keep_inputs=True``: the
  Trace also holds the call's inputs for replay;
* ``trace_one_site_values``: the same, returning only ``(t.output, t[site].out)``;
* ``trace_all_sites_values``: every module site saved, returning ``(t.output, t.values)``;
* ``flax_capture``: flax's ``capture_intermediates=True`` (every module), for reference.

It also measures what the result of a call keeps alive beyond its arguments (the bytes
of its arrays whose buffers are not the arguments' own), for the jitted Trace and for
``jl.trace`` run eagerly, which references the arguments instead of copying them.

Usage::

  python benchmarks/bench_memory.py [--size small]
"""

from __future__ import annotations

import sys
from pathlib import Path

_ROOT = Path(__file__).resolve().parent.parent
if str(_ROOT) not in sys.path:
  sys.path.insert(0, str(_ROOT))

import jax  # noqa: E402

import jaxlens as jl  # noqa: E402
from benchmarks import _setup  # noqa: E402
from benchmarks._timing import env_info, max_abs_diff, memory_bytes, ratio, row  # noqa: E402
from benchmarks._timing import report  # noqa: E402

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "memory.json"
MIB = 2**20


def parse_args(argv=None):
  p = _setup.parser(__doc__, repeats=0, out=str(DEFAULT_OUT))
  p.add_argument(
    "--no-eager",
    dest="eager",
    action="store_false",
    help="skip the eager jl.trace (slow: one dispatch per op)",
  )
  return p.parse_args(argv)


def make_fns(model, site: str) -> dict:
  one = jl.module(site)

  def one_values(v, x):
    t = jl.trace(model, v, x, save=one)
    return t.output, t[site].out

  def all_values(v, x):
    t = jl.trace(model, v, x)
    return t.output, t.values

  return {
    "plain": model.apply,
    "trace_one_site": lambda v, x: jl.trace(model, v, x, save=one, keep_inputs=False),
    "trace_one_site_with_inputs": lambda v, x: jl.trace(model, v, x, save=one),
    "trace_one_site_values": one_values,
    "trace_all_sites_values": all_values,
    "flax_capture": lambda v, x: model.apply(
      v, x, capture_intermediates=True, mutable=["intermediates"]
    ),
  }


def retained_bytes(result, arguments) -> int:
  """Bytes of the arrays in ``result`` that do not share a buffer with ``arguments``."""
  own = {a.unsafe_buffer_pointer() for a in jax.tree.leaves(arguments)}
  seen, total = set(), 0
  for a in jax.tree.leaves(result):
    ptr = a.unsafe_buffer_pointer()
    if ptr not in own and ptr not in seen:
      seen.add(ptr)
      total += a.nbytes
  return total


def main(argv=None) -> dict:
  """Runs the benchmark; returns (and writes, unless ``--out ''``) the result dict."""
  args = parse_args(argv)
  model, variables, tokens = _setup.build_gpt(args)
  site = f"block_{model.n_layers // 2}"
  fns = {n: jax.jit(f) for n, f in make_fns(model, site).items()}
  mem = {n: memory_bytes(f.lower(variables, tokens).compile()) for n, f in fns.items()}

  # What a result keeps alive beyond the arguments.
  plain_out = fns["plain"](variables, tokens)
  jit_trace = fns["trace_one_site_with_inputs"](variables, tokens)
  retained = {
    "plain": retained_bytes(plain_out, (variables, tokens)),
    "trace_one_site_jit": retained_bytes(jit_trace, (variables, tokens)),
    "trace_one_site_lean_jit": retained_bytes(
      fns["trace_one_site"](variables, tokens), (variables, tokens)
    ),
  }
  check = {
    "output_max_abs_diff": max_abs_diff(jit_trace.output, plain_out),
    "saved_labels": list(jit_trace.labels),
  }
  if args.eager:
    eager = jl.trace(model, variables, tokens, save=jl.module(site))
    retained["trace_one_site_eager"] = retained_bytes(eager, (variables, tokens))
    check["eager_output_max_abs_diff"] = max_abs_diff(eager.output, plain_out)
  if check["output_max_abs_diff"] > 1e-5:
    raise AssertionError(f"the trace's output differs from the plain forward's: {check}")

  def mem_row(key, measure, cand, field, target=None):
    return row(
      key,
      measure,
      ratio(mem[cand][field], mem["plain"][field]),
      target=target,
      candidate=cand,
      baseline="plain",
      candidate_value=mem[cand][field],
      baseline_value=mem["plain"][field],
      unit="bytes",
    )

  rows = [
    mem_row(
      "memory_trace_one_site",
      "temp + output: jl.trace saving one site, Trace returned (keep_inputs=False) / plain forward",
      "trace_one_site",
      "temp_plus_output",
      ("<=", 1.2),
    ),
    mem_row(
      "memory_trace_one_site_with_inputs",
      "temp + output: the same Trace holding the call's inputs for replay (the default) / plain",
      "trace_one_site_with_inputs",
      "temp_plus_output",
    ),
    mem_row(
      "memory_trace_one_site_values",
      "temp + output: the same, returning output and the site / plain",
      "trace_one_site_values",
      "temp_plus_output",
      ("<=", 1.2),
    ),
    mem_row(
      "memory_trace_one_site_peak",
      "peak (arguments + temp + output): one site, Trace returned / plain",
      "trace_one_site",
      "peak",
    ),
    mem_row(
      "memory_trace_all_sites_values",
      "temp + output: every module site saved / plain",
      "trace_all_sites_values",
      "temp_plus_output",
    ),
    mem_row(
      "memory_flax_capture",
      "temp + output: flax capture_intermediates / plain (reference)",
      "flax_capture",
      "temp_plus_output",
    ),
  ]
  if args.eager:
    rows.append(
      row(
        "memory_retained_eager",
        "bytes a result keeps beyond its arguments: eager jl.trace (one site) / plain",
        ratio(retained["trace_one_site_eager"], retained["plain"]),
        candidate="jl.trace, not jitted",
        baseline="plain",
        candidate_value=retained["trace_one_site_eager"],
        baseline_value=retained["plain"],
        unit="bytes",
      )
    )
  result = {
    "benchmark": "memory",
    "title": "memory of a trace that saves one site vs a plain forward",
    "config": {
      **_setup.model_config(args, model),
      "site": site,
      "method": "compiled memory_analysis (XLA buffer assignment)",
    },
    "env": env_info(),
    "rows": rows,
    "memory_bytes": mem,
    "retained_bytes": retained,
    "check": check,
    "analysis": analysis(mem, retained),
  }
  return report(result, format_table(result), args.out)


def analysis(mem, retained) -> list[str]:
  p, t, v = mem["plain"], mem["trace_one_site_with_inputs"], mem["trace_one_site_values"]
  lean = mem["trace_one_site"]
  lines = [
    f"The one-site program needs {t['temp'] / MIB:.2f} MiB of temporaries against the plain "
    f"forward's {p['temp'] / MIB:.2f} MiB; returning the site adds "
    f"{(v['output'] - p['output']) / MIB:.2f} MiB of output buffers to the logits' "
    f"{p['output'] / MIB:.2f} MiB.",
    f"A Trace returned from jit also carries the call's inputs, and jax.jit copies an input "
    f"it returns unchanged into a new buffer: {(t['output'] - v['output']) / MIB:.2f} MiB of "
    f"the Trace's {t['output'] / MIB:.2f} MiB of outputs are copies of the arguments "
    f"({p['argument'] / MIB:.2f} MiB). With keep_inputs=False the Trace holds the output "
    f"and the site only: {lean['output'] / MIB:.2f} MiB of outputs.",
  ]
  if "trace_one_site_eager" in retained:
    lines.append(
      f"Run eagerly, the Trace references the arguments instead: it keeps "
      f"{retained['trace_one_site_eager'] / MIB:.2f} MiB beyond them (the jitted one "
      f"{retained['trace_one_site_jit'] / MIB:.2f} MiB; the plain logits "
      f"{retained['plain'] / MIB:.2f} MiB)."
    )
  return lines


def format_table(r: dict) -> str:
  lines = [r["title"], "", "| variant | argument | temp | output | peak |", "|---|---|---|---|---|"]
  for n, m in r["memory_bytes"].items():
    lines.append(
      f"| {n} | {m['argument'] / MIB:.2f} MiB | {m['temp'] / MIB:.2f} MiB | "
      f"{m['output'] / MIB:.2f} MiB | {m['peak'] / MIB:.2f} MiB |"
    )
  lines += ["", "| measure | ratio |", "|---|---|"]
  lines += [f"| {rw['measure']} | {rw['value']:.3f} |" for rw in r["rows"]]
  return "\n".join(lines + [""] + r["analysis"])


if __name__ == "__main__":
  main(sys.argv[1:])
