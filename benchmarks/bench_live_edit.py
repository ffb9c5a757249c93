"""A live jaxlens edit against the same edit written by hand, in one process.

The workload is one jitted training step's worth of work on the built-in GPT
(``jaxlens.models``): ``jax.value_and_grad`` of the next-token cross-entropy with
respect to all the variables, with ``2.0 * direction`` added to the output of the
middle block (``block_{L//2 - 1}``). It is written twice:

* jaxlens: ``jl.when(jl.module("block_1"), jl.steer(direction, 2.0)).bind(model)``
  (with ``feature_axis=-1``, so that tiny configs where ``d_model`` equals the batch
  or sequence length are not ambiguous; it changes nothing in the program);
* by hand: ``model.apply`` under ``flax.linen.intercept_methods`` with an
  interceptor that adds ``2.0 * direction`` to the output of module path
  ``("block_1",)``.

Both are jitted functions of ``(variables, tokens, direction)``. The script checks
that they give the same loss and gradients, times their first call (trace +
compile + one run), then times steady-state calls, alternating which of the two
runs first in each round to cancel drift, and reports medians and the ratio of
medians (jaxlens / hand). It also compares the compiled programs (optimised HLO
with metadata and stack-frame tables stripped and values renamed in order): when
they are identical, any runtime ratio away from 1 is noise, and only the
trace/compile time can differ.

Usage::

  python benchmarks/bench_live_edit.py [--size small] [--repeats 30]
  python benchmarks/bench_live_edit.py --layers 2 --d-model 32 --seq 8 --batch 2 --repeats 2
"""

from __future__ import annotations

import difflib
import hashlib
import os
import re
import sys
from pathlib import Path

_ROOT = Path(__file__).resolve().parent.parent
if str(_ROOT) not in sys.path:
  sys.path.insert(0, str(_ROOT))

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import jaxlens as jl  # noqa: E402
from benchmarks import _setup  # noqa: E402
from benchmarks._timing import (
  aot_times,
  canonical_hlo,
  env_info,
  interleaved,  # noqa: E402
  max_abs_diff,
  median,
  ratio,
  row,
  timed,
  report,
)

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "live_edit.json"
MAGNITUDE = 2.0


def parse_args(argv=None):
  p = _setup.parser(__doc__, repeats=30, out=str(DEFAULT_OUT))
  p.set_defaults(warmup=3)
  p.add_argument(
    "--compile-repeats",
    type=int,
    default=5,
    help="fresh trace+compile measurements of each (after the first call)",
  )
  p.add_argument(
    "--no-warmup-compile",
    dest="warmup_compile",
    action="store_false",
    help="skip compiling an unedited step before the measured first calls",
  )
  p.add_argument(
    "--hlo-dir", default="", help="if set, write both optimised HLO texts there for diffing"
  )
  return p.parse_args(argv)


def loss_from_logits(logits, tokens):
  """Mean next-token cross-entropy, in float32."""
  logits = logits[:, :-1].astype(jnp.float32)
  targets = tokens[:, 1:]
  logp = jax.nn.log_softmax(logits, axis=-1)
  return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1))


def make_jaxlens_loss(model, site):
  def jaxlens_loss(variables, tokens, direction):
    spec = jl.when(jl.module(site), jl.steer(direction, MAGNITUDE, feature_axis=-1))
    return loss_from_logits(spec.bind(model)(variables, tokens), tokens)

  return jaxlens_loss


def make_hand_loss(model, site):
  path = tuple(site.split("/"))

  def hand_loss(variables, tokens, direction):
    def interceptor(next_fun, args, kwargs, context):
      out = next_fun(*args, **kwargs)
      if context.method_name == "__call__" and context.module.path == path:
        out = out + MAGNITUDE * direction
      return out

    with nn.intercept_methods(interceptor):
      logits = model.apply(variables, tokens)
    return loss_from_logits(logits, tokens)

  return hand_loss


def make_plain_loss(model):
  def plain_loss(variables, tokens, direction):
    del direction
    return loss_from_logits(model.apply(variables, tokens), tokens)

  return plain_loss


def _normalise_stablehlo(text: str) -> str:
  """StableHLO text (``as_text()`` prints no locations) without the function's name."""
  return re.sub(r"jit_\w+_loss", "jit_loss", text)


def _aot(fn, args):
  """Fresh trace+lower and compile times of ``value_and_grad(fn)``, and its programs."""
  # A new function object each time: no jit cache hit.
  return aot_times(lambda: jax.value_and_grad(lambda *a: fn(*a)), args)


def _diff_lines(a: str, b: str, limit: int = 20) -> list[str]:
  """The lines of a unified diff of ``a`` (jaxlens) against ``b`` (hand), without headers."""
  lines = [
    ln
    for ln in difflib.unified_diff(
      b.splitlines(), a.splitlines(), "hand", "jaxlens", n=0, lineterm=""
    )
    if ln[:1] in "+-" and not ln.startswith(("+++", "---"))
  ]
  return lines[:limit]


def main(argv=None) -> dict:
  """Runs the benchmark; returns (and writes, unless ``--out ''``) the result dict."""
  args = parse_args(argv)
  model, variables, tokens = _setup.build_gpt(args)
  site = f"block_{max(model.n_layers // 2 - 1, 0)}"
  direction = jax.random.normal(jax.random.key(args.seed + 1), (model.d_model,), jnp.float32)
  call_args = (variables, tokens, direction)

  fns = {
    "jaxlens": make_jaxlens_loss(model, site),
    "hand": make_hand_loss(model, site),
  }
  steps = {name: jax.jit(jax.value_and_grad(fn)) for name, fn in fns.items()}

  # Warm the process up (imports, lowering-rule caches) on a step without an edit, so
  # that neither measured first call pays one-time costs for the other.
  if args.warmup_compile:
    timed(jax.jit(jax.value_and_grad(make_plain_loss(model))), *call_args)

  # First calls: trace + lower + compile + one run. Hand first, then jaxlens.
  first_call, outputs = {}, {}
  for name in ("hand", "jaxlens"):
    first_call[name], outputs[name] = timed(steps[name], *call_args)

  # The edit is live: a zero direction (the same compiled step) gives the unedited loss.
  loss_plain, _ = steps["jaxlens"](variables, tokens, jnp.zeros_like(direction))
  # Same loss and gradients.
  (loss_jl, grads_jl), (loss_hand, grads_hand) = outputs["jaxlens"], outputs["hand"]
  loss_diff = abs(float(loss_jl) - float(loss_hand))
  grad_diff = max_abs_diff(grads_jl, grads_hand)
  np.testing.assert_allclose(np.asarray(loss_jl), np.asarray(loss_hand), rtol=1e-5)
  jax.tree.map(
    lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7),
    grads_jl,
    grads_hand,
  )

  # Fresh trace/lower and compile times, alternating the order; the programs' texts.
  lower_s = {"jaxlens": [], "hand": []}
  compile_s = {"jaxlens": [], "hand": []}
  texts = {}
  for r in range(args.compile_repeats):
    order = ("hand", "jaxlens") if r % 2 == 0 else ("jaxlens", "hand")
    for name in order:
      lt, ct, lowered, compiled = _aot(fns[name], call_args)
      lower_s[name].append(lt)
      compile_s[name].append(ct)
      texts[name] = (lowered, compiled)
  for name in fns:
    if name not in texts:  # --compile-repeats 0: the programs of the first calls (cached)
      lowered = steps[name].lower(*call_args)
      texts[name] = (lowered, lowered.compile())
  stablehlo = {n: _normalise_stablehlo(lo.as_text()) for n, (lo, _) in texts.items()}
  hlo = {n: canonical_hlo(co.as_text()) for n, (_, co) in texts.items()}
  if args.hlo_dir:
    os.makedirs(args.hlo_dir, exist_ok=True)
    for n in hlo:
      Path(args.hlo_dir, f"{n}.stablehlo.txt").write_text(stablehlo[n])
      Path(args.hlo_dir, f"{n}.hlo.txt").write_text(hlo[n])

  # Steady state: warm-up calls discarded, then alternate which runs first each round.
  times = interleaved(
    {name: (lambda name=name: steps[name](*call_args)) for name in ("hand", "jaxlens")},
    args.repeats,
    args.warmup,
  )

  med = {n: median(ts) for n, ts in times.items()}
  first = first_call
  comp = {n: None if not lower_s[n] else median(lower_s[n]) + median(compile_s[n]) for n in fns}
  rows = [
    row(
      "live_edit_step",
      "jitted train step with a live edit / the same edit by hand",
      ratio(med["jaxlens"], med["hand"]),
      target=("<=", 1.05),
      candidate="jl.when(site, jl.steer(d, 2.0)).bind(model)",
      baseline="nn.intercept_methods interceptor",
      candidate_value=med["jaxlens"],
      baseline_value=med["hand"],
    ),
    row(
      "live_edit_first_call",
      "first call (trace + compile + run) of that step",
      ratio(first["jaxlens"], first["hand"]),
      candidate="jaxlens step",
      baseline="hand step",
      candidate_value=first["jaxlens"],
      baseline_value=first["hand"],
    ),
  ]
  if comp["jaxlens"] is not None:
    rows.append(
      row(
        "live_edit_compile",
        "trace + lower + XLA compile of that step (fresh)",
        ratio(comp["jaxlens"], comp["hand"]),
        candidate="jaxlens step",
        baseline="hand step",
        candidate_value=comp["jaxlens"],
        baseline_value=comp["hand"],
      )
    )
  result = {
    "benchmark": "live_edit",
    "config": {
      "size": args.size,
      "batch": args.batch,
      "seq": model.max_len,
      "n_layers": model.n_layers,
      "d_model": model.d_model,
      "n_heads": model.n_heads,
      "vocab_size": model.vocab_size,
      "dtype": "float32",
      "site": site,
      "edit": f"jl.steer(direction, {MAGNITUDE}, feature_axis=-1)",
      "repeats": args.repeats,
      "warmup": args.warmup,
      "compile_repeats": args.compile_repeats,
      "workload": "jit(value_and_grad(next-token cross-entropy)) w.r.t. all variables",
    },
    "env": env_info(),
    "rows": rows,
    "runtime_s": {
      "jaxlens_median": med["jaxlens"],
      "hand_median": med["hand"],
      "jaxlens_min": min(times["jaxlens"]),
      "hand_min": min(times["hand"]),
      "jaxlens_all": times["jaxlens"],
      "hand_all": times["hand"],
    },
    "runtime_ratio": med["jaxlens"] / med["hand"],
    "compile_s": {
      "jaxlens_first_call": first["jaxlens"],
      "hand_first_call": first["hand"],
      "jaxlens_trace_lower_median": median(lower_s["jaxlens"]),
      "hand_trace_lower_median": median(lower_s["hand"]),
      "jaxlens_compile_median": median(compile_s["jaxlens"]),
      "hand_compile_median": median(compile_s["hand"]),
      "jaxlens_trace_lower_all": lower_s["jaxlens"],
      "hand_trace_lower_all": lower_s["hand"],
      "jaxlens_compile_all": compile_s["jaxlens"],
      "hand_compile_all": compile_s["hand"],
    },
    "compile_ratio_first_call": first["jaxlens"] / first["hand"],
    "compile_ratio_fresh": ratio(comp["jaxlens"], comp["hand"]),
    "check": {
      "loss_jaxlens": float(loss_jl),
      "loss_hand": float(loss_hand),
      "loss_unedited": float(loss_plain),
      "loss_max_abs_diff": loss_diff,
      "grad_max_abs_diff": grad_diff,
      "allclose_rtol": 1e-5,
    },
    "programs": {
      "stablehlo_identical": stablehlo["jaxlens"] == stablehlo["hand"],
      "optimized_hlo_identical": hlo["jaxlens"] == hlo["hand"],
      "optimized_hlo_sha256": {
        n: hashlib.sha256(t.encode()).hexdigest()[:16] for n, t in hlo.items()
      },
      "stablehlo_lines": {n: t.count("\n") for n, t in stablehlo.items()},
      "optimized_hlo_lines": {n: t.count("\n") for n, t in hlo.items()},
      "stablehlo_diff": _diff_lines(stablehlo["jaxlens"], stablehlo["hand"]),
      "optimized_hlo_diff": _diff_lines(hlo["jaxlens"], hlo["hand"]),
    },
  }

  table = format_table(result)
  for kind in ("stablehlo", "optimized_hlo"):
    if not result["programs"][f"{kind}_identical"]:
      table += f"\n\n{kind} lines that differ (- hand, + jaxlens; first 20):\n"
      table += "\n".join("  " + ln for ln in result["programs"][f"{kind}_diff"])
  return report(result, table, args.out)


def format_table(r: dict) -> str:
  c, rt, cs = r["config"], r["runtime_s"], r["compile_s"]
  ms = lambda s: f"{s * 1e3:.2f} ms"  # noqa: E731
  lines = [
    f"live edit `{c['edit']}` at `{c['site']}`: GPT {c['n_layers']} layers, d_model "
    f"{c['d_model']}, batch {c['batch']}, seq {c['seq']}; {c['workload']}; "
    f"{r['env']['backend']} ({r['env']['device']}), jax {r['env']['jax']}",
    "",
    "| measure | jaxlens | hand (`nn.intercept_methods`) | ratio jaxlens/hand |",
    "|---|---|---|---|",
    f"| step, median of {c['repeats']} | {ms(rt['jaxlens_median'])} | "
    f"{ms(rt['hand_median'])} | {r['runtime_ratio']:.3f} |",
    f"| step, min | {ms(rt['jaxlens_min'])} | {ms(rt['hand_min'])} | "
    f"{rt['jaxlens_min'] / rt['hand_min']:.3f} |",
    f"| first call (trace+compile+run) | {cs['jaxlens_first_call']:.3f} s | "
    f"{cs['hand_first_call']:.3f} s | {r['compile_ratio_first_call']:.3f} |",
    "",
    f"loss: jaxlens {r['check']['loss_jaxlens']:.6f}, hand {r['check']['loss_hand']:.6f} "
    f"(unedited {r['check']['loss_unedited']:.6f}); max abs diff: loss "
    f"{r['check']['loss_max_abs_diff']:.3g}, gradients {r['check']['grad_max_abs_diff']:.3g}",
    f"compiled programs identical (optimised HLO, metadata stripped): "
    f"{r['programs']['optimized_hlo_identical']}; StableHLO identical: "
    f"{r['programs']['stablehlo_identical']}",
  ]
  if cs["jaxlens_compile_median"] is not None:
    lines[-3:-3] = [
      f"| trace+lower, median of {c['compile_repeats']} fresh | "
      f"{cs['jaxlens_trace_lower_median']:.3f} s | {cs['hand_trace_lower_median']:.3f} s | "
      f"{cs['jaxlens_trace_lower_median'] / cs['hand_trace_lower_median']:.3f} |",
      f"| XLA compile, median of {c['compile_repeats']} fresh | "
      f"{cs['jaxlens_compile_median']:.3f} s | {cs['hand_compile_median']:.3f} s | "
      f"{cs['jaxlens_compile_median'] / cs['hand_compile_median']:.3f} |",
      f"| trace+lower+compile, sum of medians | "
      f"{cs['jaxlens_trace_lower_median'] + cs['jaxlens_compile_median']:.3f} s | "
      f"{cs['hand_trace_lower_median'] + cs['hand_compile_median']:.3f} s | "
      f"{r['compile_ratio_fresh']:.3f} |",
    ]
  return "\n".join(lines)


if __name__ == "__main__":
  main(sys.argv[1:])
