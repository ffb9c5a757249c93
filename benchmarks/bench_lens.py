"""Lenses: the patchscope grid in one program against a loop of one forward per cell, and the
logit lens's top-k in vocabulary chunks against the full logit lens (peak memory).

* patchscope: every source layer x target layer of a decoder, the source's last position
  written into a target prompt (``jaxlens.lens.patchscope``: one jitted program that runs the
  target once and each cell only the blocks from its target layer on, at the positions from
  the patched one on) against the way the peers run it (nnterp: one traced forward per cell): a jitted
  single-patch forward per target layer, called once per cell from Python. Both read the
  target's last-position logits; the script checks that they agree, and times each after its
  compilation (median of ``--repeats``, the two interleaved).
* logit lens: ``lens.logit_lens_topk`` (chunks of ``--chunk`` vocabulary entries) against
  ``lens.logit_lens`` followed by ``lax.top_k``: XLA's peak temporary memory of each compiled
  program (``compiled.memory_analysis()``), and the largest vocabulary-wide array's size.

* tuned-lens training (``--part tuned``): time to the ``tuned-lens`` package's (0.2.0) per-layer
  KL. Its training loop trains ``--tl-steps`` steps on a GPT-2-layout model (built by
  transformers, loaded by ``jaxlens.models.load_hf``) with its defaults; the held-out per-layer
  KL of its lens is the target. jaxlens starts from the least-squares fit
  (``train_tuned_lens(init="lstsq")``) and trains the fewest of 0, 1, 2, 4, ... steps that reach
  the target at every layer on the same held-out tokens. The package's ``Train.execute`` cannot
  be imported with the installed torchdata (0.11 has no ``dataloader2``), so its loop body is
  run as written: the model's forward with the hidden states, the final log-probabilities, then
  per layer its ``TunedLens`` forward under ``torch.autocast(bfloat16)`` (hard-coded in
  ``Train``: no option turns it off), the KL, ``backward``, and the step (``clip_grad_norm_`` at
  1, torch SGD with Nesterov momentum, its learning rate and weight decay, the linear schedule).
  It runs with the autocast off (float32) for all its steps and as shipped (bfloat16 autocast)
  for ``--tl-shipped-steps`` steps (its time for all steps extrapolated: about 25x slower on a
  CPU without native bfloat16), each at one torch thread and the default, all interleaved with
  jaxlens in one process; the faster thread setting is the peer's figure. Wall and CPU time;
  also jaxlens's zero start for the same steps (the per-step comparison; its KL is the peer's).

* Jacobian-lens fit over prompts of many lengths (``--part jacobian``): ``fit_jacobian_lens``
  with its default ``length_bucket=16`` (prompts padded at the end, a program per bucket)
  against ``length_bucket=1`` (a program per prompt length), both from a cold start (their
  compilations included) and again warm; wall and CPU time, and the largest difference
  between the two fits' matrices.

Usage::

  python benchmarks/bench_lens.py [--part patchscope,topk,tuned,jacobian] [--model tiny|smollm2]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

_ROOT = Path(__file__).resolve().parent.parent
if str(_ROOT) not in sys.path:
  sys.path.insert(0, str(_ROOT))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import jaxlens as jl  # noqa: E402
import jaxlens.models as jm  # noqa: E402
from jaxlens import lens  # noqa: E402


def _model(name: str):
  if name == "smollm2":
    lm = jm.smollm2()
    return (
      lm.model,
      lm.variables,
      lm.encode("The capital of France is"),
      lm.encode("cat -> cat; 1135 -> 1135; hello -> hello; ? ->"),
    )
  cfg = jm.LlamaConfig(
    vocab_size=32768, d_model=256, n_layers=8, n_heads=8, n_kv_heads=4, d_mlp=768, max_len=128
  )
  model = jm.Llama(cfg)
  source = jnp.arange(3, 9, dtype=jnp.int32)[None]
  target = jnp.arange(100, 116, dtype=jnp.int32)[None]
  return model, model.init(jax.random.key(0), target), source, target


def _median_time(fn, repeats: int) -> float:
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    jax.block_until_ready(fn())
    times.append(time.perf_counter() - t0)
  return float(np.median(times))


def bench_patchscope(model, variables, source, target, repeats: int) -> dict:
  n = len(model.layer_sites()) + 1
  grid_fn = lambda: lens.patchscope(model, variables, source, target)  # noqa: E731
  grid = jax.block_until_ready(grid_fn())  # compiles
  vectors = lens.residuals(model, variables, source)[:, :, -1]  # (n, batch, d)
  sites = lens.lens_sites(model)
  pos = jnp.asarray([target.shape[1] - 1])

  def single(site):
    @jax.jit
    def run(variables, vector):
      edit = jl.at_positions(pos, jl.replace_with(vector[:, None]))
      return jl.when(jl.label(site), edit).bind(model)(variables, target)[:, -1]

    return run

  singles = [single(s) for s in sites]
  for j in range(n):  # compile each target layer's forward once
    jax.block_until_ready(singles[j](variables, vectors[0]))

  def loop():
    return [[singles[j](variables, vectors[i]) for j in range(n)] for i in range(n)]

  looped = jax.block_until_ready(loop())
  diff = max(float(jnp.abs(grid[i, j] - looped[i][j]).max()) for i in range(n) for j in range(n))
  t_grid, t_loop = [], []
  for _ in range(repeats):  # interleaved
    t_grid.append(_median_time(grid_fn, 1))
    t_loop.append(_median_time(loop, 1))
  g, lp = float(np.median(t_grid)), float(np.median(t_loop))
  return {
    "cells": n * n,
    "grid_s": g,
    "loop_s": lp,
    "speedup": lp / g,
    "max_abs_diff": diff,
  }


def bench_topk_memory(model, variables, tokens, chunk: int) -> dict:
  k = 5

  def full(v, t):
    return jax.lax.top_k(lens.logit_lens(model, v, t), k)

  def chunked(v, t):
    return lens.logit_lens_topk(model, v, t, k=k, chunk=chunk)

  out = {}
  for name, fn in (("full", full), ("chunked", chunked)):
    compiled = jax.jit(fn).lower(variables, tokens).compile()
    mem = compiled.memory_analysis()
    out[f"{name}_temp_bytes"] = int(getattr(mem, "temp_size_in_bytes", -1)) if mem else -1
  n = len(model.layer_sites()) + 1
  vocab = model.config.vocab_size
  itemsize = jnp.dtype(model.config.dtype).itemsize
  out["full_logits_bytes"] = n * tokens.size * vocab * itemsize
  out["chunk_logits_bytes"] = n * tokens.size * min(chunk, vocab) * itemsize
  a, b = jax.jit(full)(variables, tokens), jax.jit(chunked)(variables, tokens)
  out["same_ids"] = bool(jnp.all(a[1] == b.ids))
  return out


def _gpt2(layers: int, width: int, vocab: int, seq: int):
  """A GPT-2-layout model from transformers (seed 0) and the same weights in jaxlens."""
  import tempfile

  import torch
  import transformers

  torch.manual_seed(0)
  cfg = transformers.GPT2Config(
    n_layer=layers,
    n_embd=width,
    n_head=max(width // 64, 1),
    vocab_size=vocab,
    n_positions=max(seq, 64),
    use_cache=False,
  )
  hf = transformers.GPT2LMHeadModel(cfg).eval()
  hf.requires_grad_(False)
  with tempfile.TemporaryDirectory() as tmp:
    hf.save_pretrained(tmp)
    lm = jm.load_hf(tmp, dtype=jnp.float32)
  return hf, lm.model, lm.variables


def _tuned_lens_package_trainer(hf, steps: int, autocast: bool):
  """The ``tuned-lens`` 0.2.0 training loop (``scripts/train_loop.py::Train.execute``, one
  batch a step, KL loss, token shift 0) on ``hf``: a function of the batches that trains a
  fresh lens for ``len(batches)`` steps and returns it and the last step's per-layer KL."""
  import torch as th
  from transformers import get_linear_schedule_with_warmup
  from tuned_lens import TunedLens
  from tuned_lens.utils import shift_labels, shift_preds

  def train(batches):
    lens = TunedLens.from_model(hf)
    params = [p for p in lens.parameters() if p.requires_grad]
    # ingredients.Optimizer.create_optim / create_scheduler at their defaults (SGD, no warmup)
    opt = th.optim.SGD(params, lr=1.0 * (1 - 0.9), momentum=0.9, nesterov=True, weight_decay=1e-3)
    scheduler = get_linear_schedule_with_warmup(opt, 0, steps)
    losses = []
    for batch in batches:
      with th.no_grad():
        output = hf(input_ids=batch, output_hidden_states=True)
      final_logits = output.logits
      hidden_states = output.hidden_states[:-1]
      labels = shift_labels(final_logits.float().log_softmax(dim=-1), 0)
      losses = []
      for i, h in enumerate(hidden_states):
        with th.autocast("cpu", dtype=th.bfloat16, enabled=autocast):
          logits = shift_preds(lens(h, idx=i), 0)
          loss = th.sum(labels.exp() * (labels - logits.log_softmax(-1)), dim=-1).mean()
          losses.append(loss.detach().item())
        loss.backward()
      th.nn.utils.clip_grad_norm_(lens.parameters(), 1.0)
      opt.step()
      opt.zero_grad(set_to_none=False)
      scheduler.step()
    return lens, np.asarray(losses)

  return train


def _peer_lens(theirs, dtype):
  """A tuned-lens ``TunedLens``'s translators as a jaxlens ``TunedLens``."""
  ts = theirs.layer_translators
  weight = np.stack([t.weight.detach().float().numpy() for t in ts])
  bias = np.stack([t.bias.detach().float().numpy() for t in ts])
  return lens.TunedLens(jnp.asarray(weight, dtype), jnp.asarray(bias, dtype))


def bench_tuned(args) -> dict:
  """Time to the tuned-lens trainer's per-layer KL: the package's loop trains ``--tl-steps``
  steps (its defaults; its lens's held-out per-layer KL is the target); jaxlens starts from the
  least-squares fit (``init="lstsq"`` on the first ``--tl-init-batches`` batches) and trains the
  fewest of 0, 1, 2, 4, ... steps that reach the target at every layer on the same held-out
  tokens. Both are timed interleaved in one process, the peer at one torch thread and the
  default, with its autocast off (float32) for the whole run, and as shipped (bfloat16 autocast)
  for ``--tl-shipped-steps`` steps, its time for all steps extrapolated from those (its
  trajectory is the float32 one in bfloat16 rounding). jaxlens's same-step zero-start run is
  timed too (the per-step comparison)."""
  import torch

  from benchmarks._torch_peer import cpu_seconds

  hf, model, variables = _gpt2(args.tl_layers, args.tl_width, args.tl_vocab, args.tl_seq)
  rng = np.random.default_rng(0)
  steps = args.tl_steps
  tokens = rng.integers(0, args.tl_vocab, (steps, args.tl_batch, args.tl_seq), np.int32)
  held = rng.integers(0, args.tl_vocab, (2 * args.tl_batch, args.tl_seq), np.int32)
  torch_batches = [torch.from_numpy(t.astype(np.int64)) for t in tokens]
  held_kl = jax.jit(lambda tl: lens.kl_to_final(model, variables, held, tl)[:-1])
  dtype = model.config.dtype
  n_init = min(args.tl_init_batches, steps)

  def ours(k):  # the least-squares start, then k steps; the lens
    if k == 0:
      return lens.TunedLens.lstsq(model, variables, list(tokens[:n_init]), ridge=args.tl_ridge)
    r = lens.train_tuned_lens(
      model, variables, list(tokens[:k]), steps=k, init="lstsq",
      init_batches=min(n_init, k), ridge=args.tl_ridge,
    )  # fmt: skip
    return r.lens

  def ours_zeros():
    return lens.train_tuned_lens(model, variables, list(tokens), steps=steps).lens

  default = torch.get_num_threads()
  f32 = _tuned_lens_package_trainer(hf, steps, autocast=False)
  shipped = _tuned_lens_package_trainer(hf, steps, autocast=True)
  n_shipped = min(args.tl_shipped_steps, steps)

  # the target: the package's lens after its steps (float32; one thread, as every setting)
  torch.set_num_threads(1)
  try:
    peer_lens, _ = f32(torch_batches)
  finally:
    torch.set_num_threads(default)
  target = np.asarray(held_kl(_peer_lens(peer_lens, dtype)))
  logit = np.asarray(held_kl(None))

  t0 = time.perf_counter()
  jax.block_until_ready(ours_zeros())
  compile_s = {"zeros": time.perf_counter() - t0}
  searched = {}
  for k in [0] + [2**i for i in range(20) if 2**i <= steps]:
    t0 = time.perf_counter()
    got = np.asarray(held_kl(jax.block_until_ready(ours(k))))
    compile_s[f"lstsq+{k}"] = time.perf_counter() - t0  # compilation and one run
    searched[k] = got.round(5).tolist()
    if np.all(got <= target):
      break
  else:
    raise SystemExit(f"jaxlens did not reach the target in {steps} steps: {searched}")
  zeros_kl = np.asarray(held_kl(ours_zeros()))

  sides = {
    f"jaxlens lstsq + {k} steps": (lambda: ours(k), None, 1),
    f"jaxlens zeros, {steps} steps": (ours_zeros, None, 1),
  }
  for threads in (1, default):
    plural = "s" * (threads > 1)
    sides[f"tuned-lens float32, {threads} thread{plural}"] = (
      lambda: f32(torch_batches),
      threads,
      1,
    )
    sides[f"tuned-lens as shipped (bfloat16 autocast), {threads} thread{plural}"] = (
      lambda: _tuned_lens_package_trainer(hf, steps, True)(torch_batches[:n_shipped]),
      threads,
      steps / n_shipped,
    )
  del shipped
  names = list(sides)
  walls: dict[str, list[float]] = {n: [] for n in names}
  cpus: dict[str, list[float]] = {n: [] for n in names}
  try:
    for r in range(args.repeats):  # interleaved, the order rotating and flipping
      order = names[r % len(names) :] + names[: r % len(names)]
      for name in order if r % 2 == 0 else order[::-1]:
        fn, threads, scale = sides[name]
        if "shipped" in name and r >= args.tl_shipped_repeats:
          continue
        torch.set_num_threads(threads or default)
        c0, w0 = cpu_seconds(), time.perf_counter()
        jax.block_until_ready(fn())
        walls[name].append((time.perf_counter() - w0) * scale)
        cpus[name].append((cpu_seconds() - c0) * scale)
  finally:
    torch.set_num_threads(default)
  out: dict = {
    "setting": (
      f"GPT-2 layout, {args.tl_layers} blocks, width {args.tl_width}, vocabulary "
      f"{args.tl_vocab}, {steps} steps of {args.tl_batch} x {args.tl_seq} tokens, float32 "
      f"model; tuned-lens's defaults (SGD Nesterov, lr 0.1, weight decay 1e-3, clip 1); "
      f"held-out KL on {held.shape[0]} x {held.shape[1]} tokens; lstsq on {n_init} batches, "
      f"ridge {args.tl_ridge}"
    ),
    "steps_to_target": k,
    "held_kl": {
      "logit lens": logit.round(5).tolist(),
      f"tuned-lens, {steps} steps (target)": target.round(5).tolist(),
      f"jaxlens zeros, {steps} steps": zeros_kl.round(5).tolist(),
      **{f"jaxlens lstsq + {j} steps": v for j, v in searched.items()},
    },
    "jaxlens_compile_and_first_run_s": {n: round(v, 1) for n, v in compile_s.items()},
  }
  for n in names:
    out[n] = {
      "wall_s": float(np.median(walls[n])),
      "cpu_s": float(np.median(cpus[n])),
      "wall_s_all": [round(w, 2) for w in walls[n]],
    }
  peers = [n for n in names if n.startswith("tuned-lens")]
  ours_name = names[0]
  for label, group in (
    ("float32", [n for n in peers if "float32" in n]),
    ("shipped", [n for n in peers if "shipped" in n]),
  ):
    best = min(group, key=lambda n: out[n]["wall_s"])
    out[f"best_{label}"] = best
    out[f"speedup_{label}_wall"] = out[best]["wall_s"] / out[ours_name]["wall_s"]
    out[f"speedup_{label}_cpu"] = out[best]["cpu_s"] / out[ours_name]["cpu_s"]
  zeros_name = names[1]
  best = out["best_float32"]
  out["same_steps_speedup_cpu"] = out[best]["cpu_s"] / out[zeros_name]["cpu_s"]
  out["same_steps_speedup_wall"] = out[best]["wall_s"] / out[zeros_name]["wall_s"]
  out["zeros_vs_peer_kl_max_rel_diff"] = float(np.max(np.abs(zeros_kl - target) / target))
  return out


def bench_jacobian_lengths(args) -> dict:
  from benchmarks._torch_peer import cpu_seconds

  _, model, variables = _gpt2(args.jl_layers, args.jl_width, 2048, 64)
  rng = np.random.default_rng(1)
  lengths = list(range(args.jl_min_len, args.jl_min_len + args.jl_prompts))
  prompts = [rng.integers(0, 2048, n).astype(np.int32) for n in lengths]
  out: dict = {
    "setting": (
      f"GPT-2 layout, {args.jl_layers} blocks, width {args.jl_width}, {len(prompts)} prompts "
      f"of {lengths[0]}..{lengths[-1]} tokens, skip 16, float32"
    )
  }
  fits = {}
  for bucket in (16, 1):  # the bucketed run first: its padded shapes are not the exact ones
    for phase in ("cold", "warm"):
      c0, w0 = cpu_seconds(), time.perf_counter()
      fits[bucket] = lens.fit_jacobian_lens(model, variables, prompts, length_bucket=bucket)
      out[f"bucket_{bucket}_{phase}"] = {
        "wall_s": time.perf_counter() - w0,
        "cpu_s": cpu_seconds() - c0,
      }
  out["programs"] = {16: len({-(-n // 16) * 16 for n in lengths}), 1: len(lengths)}
  out["max_abs_diff"] = max(
    float(np.abs(fits[16].jacobians[k] - fits[1].jacobians[k]).max()) for k in fits[1].jacobians
  )
  out["max_abs"] = max(float(np.abs(m).max()) for m in fits[1].jacobians.values())
  return out


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--part", default="patchscope,topk", help="patchscope, topk, tuned")
  parser.add_argument("--model", choices=["tiny", "smollm2"], default="tiny")
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--chunk", type=int, default=4096)
  parser.add_argument("--tl-layers", type=int, default=6)
  parser.add_argument("--tl-width", type=int, default=256)
  parser.add_argument("--tl-vocab", type=int, default=16384)
  parser.add_argument("--tl-batch", type=int, default=4)
  parser.add_argument("--tl-seq", type=int, default=64)
  parser.add_argument("--tl-steps", type=int, default=32)
  parser.add_argument("--tl-init-batches", type=int, default=4)
  parser.add_argument("--tl-ridge", type=float, default=1e-3)
  parser.add_argument(
    "--tl-shipped-repeats", type=int, default=1, help="timed runs of the bfloat16 autocast loop"
  )
  parser.add_argument(
    "--tl-shipped-steps", type=int, default=1, help="steps of the bfloat16 loop timed a run"
  )
  parser.add_argument("--jl-layers", type=int, default=4)
  parser.add_argument("--jl-width", type=int, default=128)
  parser.add_argument("--jl-prompts", type=int, default=16)
  parser.add_argument("--jl-min-len", type=int, default=40)
  args = parser.parse_args(argv)
  parts = set(args.part.split(","))
  result: dict = {"model": args.model, "devices": str(jax.devices())}
  if parts & {"patchscope", "topk"}:
    model, variables, source, target = _model(args.model)
  if "patchscope" in parts:
    result["patchscope"] = bench_patchscope(model, variables, source, target, args.repeats)
    p = result["patchscope"]
    print(
      f"patchscope, {p['cells']} cells: grid {p['grid_s'] * 1e3:.1f} ms, loop of one forward "
      f"per cell {p['loop_s'] * 1e3:.1f} ms: {p['speedup']:.1f}x "
      f"(max |diff| {p['max_abs_diff']:.1e})"
    )
  if "topk" in parts:
    result["topk"] = t = bench_topk_memory(model, variables, target, args.chunk)
    print(
      f"logit-lens top-k, XLA temporary memory: full {t['full_temp_bytes'] / 2**20:.1f} MiB, "
      f"chunked {t['chunked_temp_bytes'] / 2**20:.1f} MiB (the (layers, positions, vocab) "
      f"logits alone: {t['full_logits_bytes'] / 2**20:.1f} MiB; same ids: {t['same_ids']})"
    )
  if "tuned" in parts:
    result["tuned"] = t = bench_tuned(args)
    print(t["setting"])
    for name, kl in t["held_kl"].items():
      print(f"  held-out KL, {name}: {kl}")
    for name in [n for n in t if isinstance(t[n], dict) and "wall_s" in t[n]]:
      print(
        f"  {name}: {t[name]['wall_s']:.2f} s wall, {t[name]['cpu_s']:.2f} s CPU "
        f"({t[name]['wall_s_all']})"
      )
    print(
      f"time to tuned-lens's per-layer KL: jaxlens lstsq + {t['steps_to_target']} steps, "
      f"{t['speedup_float32_wall']:.1f}x wall / {t['speedup_float32_cpu']:.1f}x CPU against "
      f"{t['best_float32']}, {t['speedup_shipped_wall']:.0f}x / {t['speedup_shipped_cpu']:.0f}x "
      f"against {t['best_shipped']}; the same steps from zero: "
      f"{t['same_steps_speedup_wall']:.2f}x wall / {t['same_steps_speedup_cpu']:.2f}x CPU "
      f"(KL within {t['zeros_vs_peer_kl_max_rel_diff']:.1e} of the peer's); compilations "
      f"{t['jaxlens_compile_and_first_run_s']}"
    )
  if "jacobian" in parts:
    result["jacobian"] = j = bench_jacobian_lengths(args)
    print(j["setting"])
    for k in ("bucket_16_cold", "bucket_16_warm", "bucket_1_cold", "bucket_1_warm"):
      print(f"  {k}: {j[k]['wall_s']:.1f} s wall, {j[k]['cpu_s']:.1f} s CPU")
    print(
      f"Jacobian fit over {args.jl_prompts} prompt lengths: {j['programs'][16]} programs "
      f"(length_bucket=16) against {j['programs'][1]} (length_bucket=1): cold "
      f"{j['bucket_1_cold']['wall_s'] / j['bucket_16_cold']['wall_s']:.1f}x wall; warm "
      f"{j['bucket_1_warm']['wall_s'] / j['bucket_16_warm']['wall_s']:.2f}x; matrices within "
      f"{j['max_abs_diff']:.1e} (largest entry {j['max_abs']:.2f})"
    )
  return result


if __name__ == "__main__":
  main()
