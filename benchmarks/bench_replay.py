"""Replay from a block's output against a full forward, in one process.

A trace saved once (``jl.trace(model, variables, tokens)``, every module site) is a
pytree; replaying an edit at ``block_k`` recomputes only the downstream cone of that
site from the saved values. For each ``k`` the script jits

  ``replay_k(trace) = trace.fork().do(jl.module(f"block_{k}"), jl.scale(0.5)).output``

and times it against the jitted plain forward ``model.apply(variables, tokens)`` and the
jitted ``jl.trace`` that saved the trace, alternating the order every round. The cone of
``block_k`` holds the blocks after it (``L - k - 1`` of ``L``), the final LayerNorm and
the head, so a replay should cost about ``(L - k - 1) / L`` of a forward, and at most
``(L - k) / L`` (the target: what ``block_k`` and the blocks after it cost). The script
checks that each replay gives the logits of the same edit made live.

Usage::

  python benchmarks/bench_replay.py [--size small] [--repeats 20] [--ks 0,1,2,3]
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
from benchmarks._timing import (
  env_info,
  interleaved,
  max_abs_diff,
  median,  # noqa: E402
  ratio,
  row,
  timed,
  report,
)

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "replay.json"
FACTOR = 0.5


def parse_args(argv=None):
  p = _setup.parser(__doc__, repeats=20, out=str(DEFAULT_OUT))
  p.add_argument("--ks", default="", help="comma-separated block indices (default: every block)")
  return p.parse_args(argv)


def make_replay(k: int):
  """The jitted replay of ``jl.scale(0.5)`` at ``block_k``, a function of the saved trace."""
  return jax.jit(lambda t: t.fork().do(jl.module(f"block_{k}"), jl.scale(FACTOR)).output)


def middle(n_layers: int) -> int:
  """The block whose output is the middle site: ``block_{L//2}`` (half the blocks follow)."""
  return n_layers // 2


def main(argv=None) -> dict:
  """Runs the benchmark; returns (and writes, unless ``--out ''``) the result dict."""
  args = parse_args(argv)
  model, variables, tokens = _setup.build_gpt(args)
  n = model.n_layers
  ks = [int(k) for k in args.ks.split(",")] if args.ks else list(range(n))
  if any(not 0 <= k < n for k in ks):
    raise SystemExit(f"--ks: every k must be in [0, {n}), got {ks}")

  plain = jax.jit(model.apply)
  capture = jax.jit(lambda v, x: jl.trace(model, v, x))
  replays = {k: make_replay(k) for k in ks}

  first = {"plain": timed(plain, variables, tokens)[0]}
  first["trace"], saved = timed(capture, variables, tokens)
  diffs = {}
  for k, fn in replays.items():
    first[f"replay_{k}"], got = timed(fn, saved)
    live = jl.when(jl.module(f"block_{k}"), jl.scale(FACTOR)).bind(model)(variables, tokens)
    diffs[k] = max_abs_diff(got, live)
    if diffs[k] > 1e-5:
      raise AssertionError(f"replay at block_{k} differs from the live edit by {diffs[k]}")

  fns = {"plain": lambda: plain(variables, tokens), "trace": lambda: capture(variables, tokens)}
  fns.update({f"replay_{k}": (lambda fn=fn: fn(saved)) for k, fn in replays.items()})
  times = interleaved(fns, args.repeats, args.warmup)
  med = {name: median(ts) for name, ts in times.items()}

  mid = middle(n)
  rows = []
  per_k = []
  for k in ks:
    r = ratio(med[f"replay_{k}"], med["plain"])
    per_k.append(
      {
        "k": k,
        "ratio_vs_plain": r,
        "ratio_vs_trace": ratio(med[f"replay_{k}"], med["trace"]),
        "expected_cone": (n - k - 1) / n,
        "target": (n - k) / n,
        "median_s": med[f"replay_{k}"],
        "max_abs_diff_vs_live": diffs[k],
      }
    )
    if k == mid:
      rows.append(
        row(
          "replay_middle",
          f"replay from block_{k} (of {n}) / full forward",
          r,
          target=("<=", (n - k) / n),
          candidate=f"jit(t.fork().do(block_{k}, scale))",
          baseline="jit(model.apply)",
          candidate_value=med[f"replay_{k}"],
          baseline_value=med["plain"],
          note=f"expected about (L-k-1)/L = {(n - k - 1) / n:.2f}: the blocks "
          "after the edited one, plus ln_f and the head",
        )
      )
  rows.append(
    row(
      "trace_vs_plain_replay_run",
      "jl.trace that saved the trace / full forward",
      ratio(med["trace"], med["plain"]),
      candidate="jit(jl.trace(...))",
      baseline="jit(model.apply)",
      candidate_value=med["trace"],
      baseline_value=med["plain"],
    )
  )
  result = {
    "benchmark": "replay",
    "title": "replay from block_k vs a full forward",
    "config": {
      **_setup.model_config(args, model),
      "repeats": args.repeats,
      "warmup": args.warmup,
      "ks": ks,
      "edit": f"jl.scale({FACTOR})",
    },
    "env": env_info(),
    "rows": rows,
    "per_k": per_k,
    "runtime_s": {
      name: {"median": med[name], "min": min(ts), "all": ts} for name, ts in times.items()
    },
    "first_call_s": first,
    "check": {"max_abs_diff_vs_live": max(diffs.values()), "allclose_atol": 1e-5},
  }
  return report(result, format_table(result), args.out)


def format_table(r: dict) -> str:
  c = r["config"]
  lines = [
    f"{r['title']}: GPT {c['n_layers']} layers, d_model {c['d_model']}, batch "
    f"{c['batch']}, seq {c['seq']}; edit {c['edit']}",
    "",
    "| k | replay / forward | expected (L-k-1)/L | target <= (L-k)/L | met |",
    "|---|---|---|---|---|",
  ]
  for p in r["per_k"]:
    met = "yes" if p["ratio_vs_plain"] <= p["target"] else "no"
    lines.append(
      f"| {p['k']} | {p['ratio_vs_plain']:.3f} | {p['expected_cone']:.3f} | "
      f"{p['target']:.3f} | {met} |"
    )
  return "\n".join(lines)


if __name__ == "__main__":
  main(sys.argv[1:])
