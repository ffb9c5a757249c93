"""Runs every benchmark at the named sizes and writes docs/performance.md.

Usage (from the repository root)::

  python -m benchmarks                        # small and medium, full repeats (~35 min)
  python -m benchmarks --quick medium         # small full, medium quick (~10 min)
  python -m benchmarks --quick --sizes small  # a few minutes
  python benchmarks/run_all.py --only trace,replay --sizes small

Each benchmark runs in this process, one after the other, through its ``main(argv)``;
its JSON result goes to ``--results-dir/<size>/<name>.json`` and its rows (ratios of
medians, each with its target) to the generated page. A benchmark that fails is
reported on the page with its error, and the command exits with status 1.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import json
import shlex
import sys
import time
import traceback
from pathlib import Path

_ROOT = Path(__file__).resolve().parent.parent
if str(_ROOT) not in sys.path:
  sys.path.insert(0, str(_ROOT))

from benchmarks import _timing  # noqa: E402

SUITE = ("trace", "live_edit", "replay", "sweep", "torchlens", "compile", "memory")
DEFAULT_DOC = _ROOT / "docs" / "performance.md"
DEFAULT_RESULTS = _ROOT / "benchmarks" / "results"
SIZES = {
  "small": "GPT 4 layers x d_model 256 x seq 64 x batch 8",
  "medium": "GPT 8 layers x d_model 512 x seq 128 x batch 8",
  "smoke": "GPT 1 layer x d_model 32 x seq 8 x batch 2 (a smoke test: ratios mean nothing)",
}
_SMOKE_MODEL = ["--size", "small", "--layers", "1", "--d-model", "32", "--seq", "8", "--batch", "2"]

# Per benchmark and size: the arguments of a full run and of a --quick one.
_BUDGET = {
  "trace": {
    "small": (["--repeats", "20"], ["--repeats", "7"]),
    "medium": (["--repeats", "10"], ["--repeats", "4"]),
  },
  "live_edit": {
    "small": (
      ["--repeats", "20", "--warmup", "2", "--compile-repeats", "2"],
      ["--repeats", "7", "--warmup", "1", "--compile-repeats", "1"],
    ),
    "medium": (
      ["--repeats", "8", "--warmup", "1", "--compile-repeats", "1"],
      ["--repeats", "3", "--warmup", "1", "--compile-repeats", "0", "--no-warmup-compile"],
    ),
  },
  "replay": {
    "small": (["--repeats", "20"], ["--repeats", "7"]),
    "medium": (["--repeats", "10"], ["--repeats", "4", "--ks", "0,2,4,6,7"]),
  },
  "sweep": {
    "small": (
      ["--repeats", "3", "--positions", "8", "--tiny-reference"],
      ["--repeats", "2", "--positions", "4", "--tiny-reference", "--tiny-repeats", "10"],
    ),
    "medium": (
      ["--repeats", "2", "--positions", "4"],
      ["--repeats", "2", "--positions", "2", "--warmup", "0"],
    ),
  },
  "torchlens": {
    "small": (["--repeats", "5"], ["--repeats", "2", "--warmup", "0"]),
    "medium": (["--repeats", "3"], ["--repeats", "2", "--warmup", "0"]),
  },
  "compile": {
    "small": (["--repeats", "3"], ["--repeats", "1"]),
    "medium": (["--repeats", "2"], ["--repeats", "1"]),
  },
  "memory": {"small": ([], []), "medium": (["--no-eager"], ["--no-eager"])},
}
_SMOKE = {
  "trace": ["--repeats", "2"],
  "live_edit": ["--repeats", "2", "--warmup", "1", "--compile-repeats", "0", "--no-warmup-compile"],
  "replay": ["--repeats", "2"],
  "sweep": ["--repeats", "1", "--positions", "2"],
  "torchlens": ["--repeats", "1", "--warmup", "0"],
  "compile": ["--repeats", "1", "--no-warm"],
  "memory": ["--no-eager"],
}

# What a missed target means, from profiling the benchmark (shown only when it misses):
# a sentence, or a function of the benchmark's result that writes one from its figures.


def _miss_trace(r):
  return (
    "The interpreter itself costs nothing: returning only the output, XLA compiles the plain "
    "forward's program (see the split above). What remains is, first, returning every saved "
    "site: each must be materialised as its own buffer, which splits the fused kernels of "
    "the plain forward into more passes over memory; flax's `capture_intermediates`, which "
    "returns the same sites, compiles to as many kernels and pays about the same, so this is "
    "the price of the values leaving the program, not of jaxlens. Second, for a Trace that "
    "keeps its inputs (the default, for replay), copying them: `jax.jit` copies an input it "
    "returns unchanged; `keep_inputs=False` removes that. To pay less: save fewer sites "
    "(`save=`)."
  )


def _miss_live_edit(r):
  if r["programs"]["optimized_hlo_identical"]:
    return (
      "The two compiled programs are identical (optimised HLO, names and metadata "
      "stripped), so the ratio away from 1 is the shared machine's noise during this "
      "run (see the spread of the call times in the JSON); rerun it on a quiet machine."
    )
  return "The compiled programs differ; the diff is in the JSON (`programs`)."


def _miss_torchlens_trace(r):
  rows = {rw["key"]: rw for rw in r["rows"]}
  torch = rows["torch_over_jaxlens"]["value"]
  than = f"{torch:.1f}x slower than" if torch >= 1 else f"{1 / torch:.1f}x faster than"
  return (
    f"torchlens costs {rows['torchlens_over_torch']['value']:.1f} plain torch forwards (with a "
    f"hook doing the edit), and plain torch is {than} the jitted jaxlens trace (which saves "
    "every module site); the speedup is the product of the two. torchlens's "
    "overhead is per recorded op, so at a size where each op's arithmetic dominates it "
    "shrinks relative to the forward, and what remains is torch's eager CPU kernels against "
    "XLA's compiled program."
  )


def _miss_torchlens_backward(r):
  rows = {rw["key"]: rw for rw in r["rows"]}
  fwd = r["runtime_s"]["jaxlens_trace"]["median"]
  step = r["runtime_s"]["jaxlens_backward"]["median"]
  over = rows["jaxlens_backward_over_flax"]["value"]
  where = (
    "so the backward is XLA's on this CPU, not jaxlens's"
    if over <= 1.1
    else "the rest is returning every saved site from the differentiated program (the "
    "trace rows: each must be materialised) on top of XLA's backward"
  )
  return (
    f"jaxlens's jitted step costs {step / fwd:.1f} of its forwards, and {over:.2f} of the same "
    f"step written in plain flax without jaxlens, the edit or the saved sites; {where}. "
    "torchlens's overhead is per recorded op on the forward; its backward is plain "
    "autograd, so the ratio with a backward is lower than the forward's."
  )


MISSES = {
  "trace_all_sites": _miss_trace,
  "trace_all_sites_values": _miss_trace,
  "live_edit_step": _miss_live_edit,
  "memory_trace_one_site": (
    "The program needs no more temporaries than the plain forward; what is left is the "
    "saved site's own output buffer next to the logits."
  ),
  "sweep_vmapped": (
    "A loop cell of an arithmetic-bound forward costs about one plain forward (per-cell "
    "figures above). The sweep computes, per cell, only the blocks after the patched one "
    "(the prefix once per block), so it saves the prefix, the dispatch and what a larger "
    "batch gains in matmul efficiency; the rest is the later blocks, which every cell must "
    "recompute in full, since patching one position changes the residual stream of every "
    "later position. 10x holds where calls, not arithmetic, dominate (the tiny-GPT row); it "
    "is not reachable on two CPU cores at these sizes without skipping work the cells need."
  ),
  "torchlens_trace": _miss_torchlens_trace,
  "torchlens_backward": _miss_torchlens_backward,
}


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument(
    "--sizes",
    default="small,medium",
    help="comma-separated sizes: small, medium (and smoke, for tests)",
  )
  p.add_argument(
    "--quick",
    nargs="?",
    const="all",
    default="",
    help="fewer repeats and a smaller sweep: at every size, or at the "
    "comma-separated sizes given (--quick medium)",
  )
  p.add_argument("--only", default="", help=f"comma-separated benchmarks of {', '.join(SUITE)}")
  p.add_argument("--out", default=str(DEFAULT_DOC), help="the page to write ('' to skip)")
  p.add_argument(
    "--results-dir",
    default=str(DEFAULT_RESULTS),
    help="where each benchmark's JSON goes ('' to skip)",
  )
  p.add_argument(
    "--render-only",
    action="store_true",
    help="run nothing: rewrite the page from --results-dir/suite.json",
  )
  return p.parse_args(argv)


def bench_argv(name: str, size: str, quick: bool, results_dir: str) -> list[str]:
  """The command line of one benchmark at one size."""
  if size == "smoke":
    argv = _SMOKE_MODEL + _SMOKE[name]
  else:
    full, fast = _BUDGET[name][size]
    argv = ["--size", size] + (fast if quick else full)
  out = str(Path(results_dir) / size / f"{name}.json") if results_dir else ""
  return argv + ["--out", out]


def run_one(name: str, argv: list[str]) -> dict:
  """Runs one benchmark's ``main``; a failure becomes a result with ``error``."""
  t0 = time.perf_counter()
  try:
    module = importlib.import_module(f"benchmarks.bench_{name}")
    result = module.main(argv)
  except Exception as e:  # noqa: BLE001 (the page reports every failure)
    result = {
      "benchmark": name,
      "error": f"{type(e).__name__}: {e}",
      "traceback": traceback.format_exc().splitlines()[-12:],
      "rows": [],
    }
  result["wall_s"] = time.perf_counter() - t0
  result["argv"] = argv
  return result


def main(argv=None) -> int:
  args = parse_args(argv)
  if args.render_only:
    return _render_saved(args)
  sizes = [s for s in args.sizes.split(",") if s]
  names = [n for n in args.only.split(",") if n] or list(SUITE)
  for s in sizes:
    if s not in SIZES:
      raise SystemExit(f"--sizes: unknown size {s!r}; expected some of {sorted(SIZES)}")
  for n in names:
    if n not in SUITE:
      raise SystemExit(f"--only: unknown benchmark {n!r}; expected some of {list(SUITE)}")
  quick = set(sizes) if args.quick == "all" else {s for s in args.quick.split(",") if s}
  if quick - set(sizes):
    raise SystemExit(f"--quick: {sorted(quick - set(sizes))} are not among --sizes {sizes}")
  t0 = time.perf_counter()
  results: dict[str, list[dict]] = {}
  for size in sizes:
    results[size] = []
    for name in names:
      argv_one = bench_argv(name, size, size in quick, args.results_dir)
      print(f"\n=== {size}: {name} ({' '.join(argv_one)})", flush=True)
      results[size].append(run_one(name, argv_one))
  wall = time.perf_counter() - t0
  command = "python -m benchmarks " + " ".join(argv if argv is not None else sys.argv[1:])
  command = command.strip()
  date = datetime.datetime.now().astimezone()
  page = render(results, command=command, wall_s=wall, quick=sorted(quick), date=date)
  if args.out:
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(page)
    print(f"\nwrote {args.out} ({wall / 60:.1f} min)")
  if args.results_dir:
    _timing.write_json(
      {
        "command": command,
        "wall_s": wall,
        "quick": sorted(quick),
        "date": date.isoformat(timespec="seconds"),
        "results": results,
      },
      str(Path(args.results_dir) / "suite.json"),
    )
  failed = [f"{s}/{r['benchmark']}" for s, rs in results.items() for r in rs if "error" in r]
  if failed:
    print(f"failed: {', '.join(failed)}", file=sys.stderr)
  return 1 if failed else 0


def _render_saved(args) -> int:
  """Rewrites the page from a saved suite run (the page is a function of the results)."""
  saved = json.loads((Path(args.results_dir) / "suite.json").read_text())
  results = saved["results"]
  dates = [r["env"]["date"] for rs in results.values() for r in rs if "env" in r]
  date = saved.get("date") or (max(dates) if dates else None)
  quick = saved.get("quick")
  if quick is None:  # a suite.json written before "quick" was saved: read its command
    old = parse_args(shlex.split(saved["command"])[3:])
    sizes = [s for s in old.sizes.split(",") if s]
    quick = sizes if old.quick == "all" else [s for s in old.quick.split(",") if s]
  page = render(
    results,
    command=saved["command"],
    wall_s=saved["wall_s"],
    quick=quick,
    date=None if date is None else datetime.datetime.fromisoformat(date),
  )
  Path(args.out).write_text(page)
  print(f"wrote {args.out} from {Path(args.results_dir) / 'suite.json'}")
  return 0


# ---------------------------------------------------------------------------
# The page.


def _fmt_value(v, unit):
  if v is None:
    return ""
  if unit == "bytes":
    return f"{v / 2**20:.2f} MiB"
  return f"{v * 1e3:.1f} ms" if v < 1 else f"{v:.2f} s"


def _fmt_figure(r):
  if r["value"] is None:
    return ""
  if r["kind"] == "speedup":
    v = r["value"]
    return f"{v:.1f}x faster" if v >= 1 else f"{1 / v:.1f}x slower"
  return f"{r['value']:.3f}"


def _fmt_target(r):
  if r["target"] is None:
    return "-"
  op, bound = r["target"]
  if r["kind"] == "speedup":
    return f"{op} {bound:g}x faster"
  return f"{op} {bound:.3g}"


def _fmt_met(r):
  return {True: "met", False: "**missed**", None: "-"}[r["met"]]


def _env_line(results) -> str:
  env = next((r["env"] for rs in results.values() for r in rs if "env" in r), None)
  if env is None:
    return "unknown machine"
  extra = ""
  for rs in results.values():
    for r in rs:
      if r.get("benchmark") == "torchlens" and "config" in r:
        extra = (
          f", torch {r['config']['torch']}, torchlens {r['config']['torchlens']} "
          f"({r['config']['torch_threads']} torch threads)"
        )
  devices = f"{env['device_count']} device{'s' if env['device_count'] != 1 else ''}"
  return (
    f"{env['machine']}, {env['processor']}, {env['cpu_count']} CPUs; jax {env['jax']} "
    f"({env['backend']}, {devices}), flax {env['flax']}, Python {env['python']}{extra}"
  )


def render(
  results: dict[str, list[dict]],
  *,
  command: str,
  wall_s: float,
  quick=(),
  date: datetime.datetime | None = None,
) -> str:
  """The markdown page of a suite run (dated ``date``, default now)."""
  date = date or datetime.datetime.now().astimezone()
  now = date.strftime("%Y-%m-%d %H:%M %Z")
  lines = [
    "# Performance",
    "",
    f"Generated by `{command}` on {now}, in {wall_s / 60:.1f} minutes"
    + (f" (quick, fewer repeats, at {', '.join(quick)})" if quick else "")
    + ". Do not edit by hand: rerun the command.",
    "",
    f"Machine: {_env_line(results)}.",
    "",
    "Every figure is measured in one process against its baseline, the two called "
    "alternately (the order flips every round), and is a ratio of medians: candidate / "
    "baseline for costs (lower is better), baseline / candidate for speedups. The machine "
    "is shared and its absolute times drift; the ratios are what to read. Memory figures "
    "come from XLA's buffer assignment and are exact.",
    "",
    "Run it from the repository root: `python -m benchmarks` (small and medium, full "
    "repeats; roughly 8 minutes for small and 25 for medium on 2 shared CPU cores), "
    "`python -m benchmarks --quick medium` (small full, medium quick: 9 to 13 minutes), "
    "`python -m benchmarks --quick --sizes small` (about 4 minutes), `--only trace,replay` "
    "for some benchmarks, `--render-only` to rewrite this page from the saved results. Each "
    "benchmark is also a script (`python benchmarks/bench_replay.py --help`); results go "
    "to benchmarks/results/<size>/<name>.json. The wall time of each benchmark in this "
    "run is under its table.",
  ]
  for size, rs in results.items():
    lines += [
      "",
      f"## {size}: {SIZES[size]}",
      "",
      "| figure | candidate | baseline | ratio | target | |",
      "|---|---|---|---|---|---|",
    ]
    for r in rs:
      if "error" in r:
        lines.append(f"| {r['benchmark']}: **failed** ({r['error'][:120]}) | | | | | |")
      for rw in r["rows"]:
        lines.append(
          f"| {rw['measure']} | {_fmt_value(rw['candidate_value'], rw['unit'])} | "
          f"{_fmt_value(rw['baseline_value'], rw['unit'])} | {_fmt_figure(rw)} | "
          f"{_fmt_target(rw)} | {_fmt_met(rw)} |"
        )
    lines += [
      "",
      "Wall time per benchmark: "
      + ", ".join(f"{r['benchmark']} {r['wall_s']:.0f} s" for r in rs)
      + ".",
    ]
    for r in rs:
      lines += _details(r)
  # The SmolLM2 figures of benchmarks/bench_speed.py (run on its own), kept from its results.
  from benchmarks.bench_speed import render_saved

  speed = render_saved()
  if speed:
    lines += ["", speed.rstrip("\n")]
  # The billion-parameter section (benchmarks/bench_big.py, run on its own), kept as it is.
  from benchmarks.bench_big import kept_section

  big = kept_section(DEFAULT_DOC)
  if big:
    lines += ["", big]
  lines += ["", "## Method", ""] + _METHOD
  return "\n".join(lines) + "\n"


def _details(r: dict) -> list[str]:
  name = r["benchmark"]
  out = ["", f"### {name}"]
  if "error" in r:
    return out + ["", f"Failed: `{r['error']}`", "", "```"] + r["traceback"] + ["```"]
  c = r.get("config", {})
  out += ["", _DESCRIPTIONS[name].format(**c)]
  if name == "replay":
    out += [
      "",
      "| k | replay / forward | expected (L-k-1)/L | target <= (L-k)/L | |",
      "|---|---|---|---|---|",
    ]
    for p in r["per_k"]:
      met = "met" if p["ratio_vs_plain"] <= p["target"] else "**missed**"
      out.append(
        f"| {p['k']} | {p['ratio_vs_plain']:.3f} | {p['expected_cone']:.3f} | "
        f"{p['target']:.3f} | {met} |"
      )
  if name == "memory":
    out += ["", "| program | argument | temp | output | peak |", "|---|---|---|---|---|"]
    for n, m in r["memory_bytes"].items():
      out.append(
        f"| {n} | {m['argument'] / 2**20:.2f} MiB | {m['temp'] / 2**20:.2f} MiB | "
        f"{m['output'] / 2**20:.2f} MiB | {m['peak'] / 2**20:.2f} MiB |"
      )
  if name == "compile":
    out += ["", "| program | trace + lower | XLA compile |", "|---|---|---|"]
    for n in r["total_s"]:
      out.append(
        f"| {n} | {r['trace_lower_s'][n]['median']:.2f} s | {r['compile_s'][n]['median']:.2f} s |"
      )
  if name == "live_edit":
    prog = r["programs"]
    out += [
      "",
      f"The compiled programs are identical (optimised HLO, metadata and names "
      f"stripped): {prog['optimized_hlo_identical']}; any runtime ratio away from 1 is "
      "then noise.",
    ]
  checks = {k: v for k, v in r.get("check", {}).items() if not isinstance(v, (list, dict))}
  if checks:
    out += ["", "Checks: " + ", ".join(f"{k} {_fmt_check(v)}" for k, v in checks.items()) + "."]
  out += [""] * bool(r.get("analysis")) + [f"- {a}" for a in r.get("analysis", [])]
  said = set()
  for rw in r["rows"]:
    if rw["met"] is False and rw["key"] in MISSES:
      why = MISSES[rw["key"]]
      text = why(r) if callable(why) else why
      # Rows that miss for one reason share one explanation.
      out += [
        "",
        f"**{rw['measure']}: missed.** " + (text if text not in said else "For the reason above."),
      ]
      said.add(text)
  return out


def _fmt_check(v):
  if isinstance(v, float):
    return f"{v:.3g}"
  return str(v)


_DESCRIPTIONS = {
  "trace": (
    "`jax.jit(lambda v, x: jl.trace(model, v, x))` (every module site saved) against "
    "`jax.jit(model.apply)`; flax's `capture_intermediates=True` for reference. "
    "{repeats} timed calls of each."
  ),
  "live_edit": (
    "`jax.jit(jax.value_and_grad(loss))` with `jl.when(jl.module('{site}'), "
    "jl.steer(d, 2.0)).bind(model)` against the same edit by hand under "
    "`nn.intercept_methods`; {repeats} timed calls of each."
  ),
  "replay": (
    "`jax.jit(lambda t: t.fork().do(jl.module(f'block_{{k}}'), jl.scale(0.5)).output)` "
    "on a saved trace, against `jax.jit(model.apply)`; {repeats} timed calls of each. "
    "The cone of `block_k` holds the blocks after it, `ln_f` and the head."
  ),
  "sweep": (
    "Layers x positions {positions} patching grid: "
    "`jl.when(jl.module(f'block_{{k}}'), jl.at_positions(p[None], "
    "jl.patch_from(clean_trace)))`, one jitted call vmapped over positions against one "
    "jitted call per cell; {repeats} timed sweeps of each."
  ),
  "torchlens": (
    "torch_bridge `TinyGPT` with the same weights in both frameworks (`from_torch`), "
    "edit `scale(0.5)` at `{site}` / `{flax_site}`; torchlens {torchlens} on torch "
    "{torch}; {repeats} timed calls of each."
  ),
  "compile": (
    "Fresh trace + lower + XLA compile (new function objects), median of {repeats}, "
    "edit `{edit}` at `{site}`."
  ),
  "memory": (
    "Compiled memory analysis of each program; the site saved is `{site}`. "
    "`temp + output` is what a call adds to the memory holding its arguments."
  ),
}

_METHOD = [
  "- Timing: each benchmark compiles its functions first (the first call is reported "
  "separately where it matters), discards warm-up calls, then times calls round-robin, "
  "reversing the order every round, with `jax.block_until_ready` on every result. Figures "
  "are ratios of the medians.",
  "- Memory: `jax.jit(f).lower(...).compile().memory_analysis()`: XLA's buffer assignment. "
  "`temp` is the scratch block a call allocates for its whole duration, `output` its result "
  "buffers, `argument` its inputs; `temp + output` is what a call adds on top of its "
  "arguments, and `argument + temp + output` its peak. The CPU backend keeps no allocator "
  "statistics (`Device.memory_stats()` is `None`), so these are not measured peaks; for "
  "the eager trace the page counts the bytes of result arrays whose buffers are not the "
  "arguments' own.",
  "- Correctness: every benchmark checks that candidate and baseline compute the same values "
  "(logits, losses, gradients, sweep grids) before it times them.",
]


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
