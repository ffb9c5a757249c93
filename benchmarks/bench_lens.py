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

Usage::

  python benchmarks/bench_lens.py [--model tiny|smollm2] [--repeats 3]
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


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--model", choices=["tiny", "smollm2"], default="tiny")
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--chunk", type=int, default=4096)
  args = parser.parse_args(argv)
  model, variables, source, target = _model(args.model)
  result = {"model": args.model, "devices": str(jax.devices())}
  result["patchscope"] = bench_patchscope(model, variables, source, target, args.repeats)
  result["topk"] = bench_topk_memory(model, variables, target, args.chunk)
  p, t = result["patchscope"], result["topk"]
  print(
    f"patchscope, {p['cells']} cells: grid {p['grid_s'] * 1e3:.1f} ms, loop of one forward "
    f"per cell {p['loop_s'] * 1e3:.1f} ms: {p['speedup']:.1f}x (max |diff| {p['max_abs_diff']:.1e})"
  )
  print(
    f"logit-lens top-k, XLA temporary memory: full {t['full_temp_bytes'] / 2**20:.1f} MiB, "
    f"chunked {t['chunked_temp_bytes'] / 2**20:.1f} MiB (the (layers, positions, vocab) logits "
    f"alone: {t['full_logits_bytes'] / 2**20:.1f} MiB; same ids: {t['same_ids']})"
  )
  return result


if __name__ == "__main__":
  main()
