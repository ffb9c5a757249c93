"""Compile time of an intervened model against the plain model, in one process.

Each variant is traced, lowered and compiled afresh (a new function object each time,
so no cache answers), alternating the order every round:

* forward: plain ``model.apply`` against the live door
  ``jl.when(jl.module(site), jl.steer(direction, 2.0)).bind(model)`` and against
  ``jl.trace(model, v, x, intervene=...)`` saving every module site;
* train step: ``jax.value_and_grad`` of the next-token cross-entropy, plain against the
  same with the live edit.

It reports the medians of trace+lower (Python: flax, and the jaxlens interceptor or
interpreter) and of XLA's compile, and the ratio of their sums to the plain model's.

Usage::

  python benchmarks/bench_compile.py [--size small] [--repeats 3]
"""

from __future__ import annotations

import sys
from pathlib import Path

_ROOT = Path(__file__).resolve().parent.parent
if str(_ROOT) not in sys.path:
  sys.path.insert(0, str(_ROOT))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import jaxlens as jl  # noqa: E402
from benchmarks import _setup  # noqa: E402
from benchmarks._timing import aot_times, env_info, median, ratio, row, report  # noqa: E402
from benchmarks.bench_live_edit import loss_from_logits  # noqa: E402

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "compile.json"
MAGNITUDE = 2.0


def parse_args(argv=None):
  p = _setup.parser(__doc__, repeats=3, out=str(DEFAULT_OUT))
  p.add_argument(
    "--no-warm",
    dest="warm",
    action="store_false",
    help="skip the untimed compile of each variant before the timed ones",
  )
  return p.parse_args(argv)


def make_variants(model, site: str) -> dict:
  """name -> a factory returning a new function of ``(variables, tokens, direction)``."""

  def spec(direction):
    return jl.when(jl.module(site), jl.steer(direction, MAGNITUDE, feature_axis=-1))

  def plain_forward():
    return lambda v, x, d: model.apply(v, x)

  def live_forward():
    return lambda v, x, d: spec(d).bind(model)(v, x)

  def trace_forward():
    return lambda v, x, d: jl.trace(model, v, x, intervene=spec(d))

  def plain_step():
    return jax.value_and_grad(lambda v, x, d: loss_from_logits(model.apply(v, x), x))

  def live_step():
    return jax.value_and_grad(lambda v, x, d: loss_from_logits(spec(d).bind(model)(v, x), x))

  return {
    "plain_forward": plain_forward,
    "live_forward": live_forward,
    "trace_forward": trace_forward,
    "plain_step": plain_step,
    "live_step": live_step,
  }


def main(argv=None) -> dict:
  """Runs the benchmark; returns (and writes, unless ``--out ''``) the result dict."""
  args = parse_args(argv)
  model, variables, tokens = _setup.build_gpt(args)
  site = f"block_{max(model.n_layers // 2 - 1, 0)}"
  direction = jax.random.normal(jax.random.key(args.seed + 1), (model.d_model,), jnp.float32)
  call_args = (variables, tokens, direction)
  variants = make_variants(model, site)

  # One untimed compile of each warms the process (imports, lowering-rule caches).
  if args.warm:
    for make in variants.values():
      aot_times(make, call_args)
  lower = {name: [] for name in variants}
  comp = {name: [] for name in variants}
  names = list(variants)
  for r in range(args.repeats):
    for name in names if r % 2 == 0 else names[::-1]:
      lt, ct, _, _ = aot_times(variants[name], call_args)
      lower[name].append(lt)
      comp[name].append(ct)
  total = {n: median(lower[n]) + median(comp[n]) for n in names}

  def compile_row(key, measure, cand, base):
    return row(
      key,
      measure,
      ratio(total[cand], total[base]),
      candidate=cand,
      baseline=base,
      candidate_value=total[cand],
      baseline_value=total[base],
    )

  rows = [
    compile_row(
      "compile_live_forward",
      "trace+lower+compile: forward with a live edit / plain",
      "live_forward",
      "plain_forward",
    ),
    compile_row(
      "compile_trace_forward",
      "trace+lower+compile: jl.trace with an edit (all sites saved) / plain",
      "trace_forward",
      "plain_forward",
    ),
    compile_row(
      "compile_live_step",
      "trace+lower+compile: train step with a live edit / plain step",
      "live_step",
      "plain_step",
    ),
  ]
  result = {
    "benchmark": "compile",
    "title": "compile time of an intervened model vs the plain model",
    "config": {
      **_setup.model_config(args, model),
      "repeats": args.repeats,
      "site": site,
      "edit": f"jl.steer(direction, {MAGNITUDE}, feature_axis=-1)",
    },
    "env": env_info(),
    "rows": rows,
    "trace_lower_s": {n: {"median": median(lower[n]), "all": lower[n]} for n in names},
    "compile_s": {n: {"median": median(comp[n]), "all": comp[n]} for n in names},
    "total_s": total,
    "ratios": {
      f"{cand}_over_{base}": {
        "trace_lower": ratio(median(lower[cand]), median(lower[base])),
        "compile": ratio(median(comp[cand]), median(comp[base])),
      }
      for cand, base in (
        ("live_forward", "plain_forward"),
        ("trace_forward", "plain_forward"),
        ("live_step", "plain_step"),
      )
    },
  }
  return report(result, format_table(result), args.out)


def format_table(r: dict) -> str:
  lines = [r["title"], "", "| variant | trace+lower | XLA compile |", "|---|---|---|"]
  for n in r["total_s"]:
    lines.append(
      f"| {n} | {r['trace_lower_s'][n]['median']:.3f} s | {r['compile_s'][n]['median']:.3f} s |"
    )
  lines += ["", "| measure | ratio |", "|---|---|"]
  lines += [f"| {rw['measure']} | {rw['value']:.3f} |" for rw in r["rows"]]
  return "\n".join(lines)


if __name__ == "__main__":
  main(sys.argv[1:])
