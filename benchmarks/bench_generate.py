"""Generation with a KV cache and the causal-cone sweep, on SmolLM2-135M from its wheel.

Figures (ratios of medians in one process, float32, CPU):

* decode with a steering edit on every token / without (``jl.generate``, ``--new`` tokens);
* uncached greedy decoding (a jitted full forward over the prompt + new-token buffer for every
  new token) / ``jl.generate`` at 64 new tokens;
* tokens per second of ``jl.generate`` (greedy) and of ``transformers``' ``generate`` on the
  same weights (read by transformers from the same GGUF file), same CPU threads (report only);
* ``jl.sweep.cone_sweep`` / ``jl.sweep.patching_sweep`` over all layers x ``--positions``
  positions, and each one's time over its arithmetic floor: the FLOPs its cells recompute
  (blocks and unembedding), timed at the rate of one plain forward.

Usage::

  python benchmarks/bench_generate.py [--new 64] [--positions 16] [--repeats 3] [--no-torch]
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

_ROOT = Path(__file__).resolve().parent.parent
if str(_ROOT) not in sys.path:
  sys.path.insert(0, str(_ROOT))

import jax
import jax.numpy as jnp
import numpy as np

import jaxlens as jl
from benchmarks._timing import env_info, interleaved, median, ratio, report, row, timed

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "generate.json"
PROMPT = "The capital of France is"


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--new", type=int, default=64, help="new tokens per generation")
  p.add_argument("--positions", type=int, default=16, help="sweep positions (= sequence length)")
  p.add_argument("--repeats", type=int, default=3)
  p.add_argument("--warmup", type=int, default=1)
  p.add_argument("--no-torch", action="store_true", help="skip transformers' generate")
  p.add_argument("--no-sweep", action="store_true", help="skip the sweeps")
  p.add_argument("--out", default=str(DEFAULT_OUT), help="JSON result path ('' to skip)")
  return p.parse_args(argv)


def last_logit_diff(logits):
  """A module-level (hashable) metric: logit of token 0 minus token 1 at the last position."""
  return (logits[:, -1, 0] - logits[:, -1, 1]).mean()


def _flops(cfg, tokens: int, keys: int) -> dict:
  """Multiply-add FLOPs of one Llama block and of the unembedding, per token."""
  hd = cfg.d_head
  proj = 2 * cfg.d_model * hd * (2 * cfg.n_heads + 2 * cfg.n_kv_heads)
  mlp = 2 * 3 * cfg.d_model * cfg.d_mlp
  attn = 2 * 2 * cfg.n_heads * hd * keys
  return {"block": proj + mlp + attn, "unembed": 2 * cfg.d_model * cfg.vocab_size}


def measure_generation(lm, args) -> dict:
  model, variables, cfg = lm.model, lm.variables, lm.config
  prompt = lm.encode(PROMPT)
  n = args.new
  direction = jnp.asarray(np.random.default_rng(0).normal(size=cfg.d_model), jnp.float32)
  steer = jl.when(jl.module(f"blocks_{cfg.n_layers // 2}/resid_post"), jl.steer(direction, 4.0))

  def plain():
    return jl.generate(model, variables, prompt, n).tokens

  def steered():
    return jl.generate(model, variables, prompt, n, intervene=steer).tokens

  total = prompt.shape[1] + n
  forward = jax.jit(lambda v, s: model.apply(v, s))

  def uncached():
    # What decoding without a cache costs: a full forward per new token. The buffer holds
    # prompt + new tokens (causal: the unwritten columns do not change the read one), so one
    # compiled forward serves every step.
    seq = jnp.concatenate([prompt, jnp.zeros((1, n), jnp.int32)], 1)
    for t in range(n):
      nxt = jnp.argmax(forward(variables, seq)[:, prompt.shape[1] + t - 1], -1)
      seq = seq.at[:, prompt.shape[1] + t].set(nxt.astype(jnp.int32))
    return seq[:, prompt.shape[1] :]

  first = {
    name: timed(fn)[0]
    for name, fn in (("plain", plain), ("steered", steered), ("uncached", uncached))
  }
  same = bool((plain() == uncached()).all())
  times = interleaved(
    {"plain": plain, "steered": steered, "uncached": uncached}, args.repeats, args.warmup
  )
  med = {k: median(v) for k, v in times.items()}
  out = {
    "new_tokens": n,
    "prompt_tokens": int(prompt.shape[1]),
    "median_s": med,
    "all_s": times,
    "first_call_s": first,
    "cached_equals_uncached": same,
    "tokens_per_s": n / med["plain"],
    "text": lm.decode(plain()),
    "steered_text": lm.decode(steered()),
    "total_len": total,
  }
  if not args.no_torch:
    out["torch"] = measure_torch(lm, prompt, n, plain())
  return out


def measure_torch(lm, prompt, n, ours) -> dict:
  try:
    import torch
    import transformers
  except ImportError as err:
    return {"skipped": str(err)}
  hf = _hf_llama(lm, torch, transformers)
  ids = torch.tensor(np.asarray(prompt))

  # No end-of-sequence token: both generate exactly n greedy tokens (min_new_tokens would
  # instead forbid the EOS token and change the greedy choice).
  hf.generation_config.eos_token_id = None

  def run():
    with torch.no_grad():
      return hf.generate(ids, max_new_tokens=n, do_sample=False, pad_token_id=0)[:, ids.shape[1] :]

  first, tokens = timed(run)
  times = interleaved({"torch": run}, 3, 1)["torch"]
  return {
    "threads": torch.get_num_threads(),
    "median_s": median(times),
    "all_s": times,
    "first_call_s": first,
    "tokens_per_s": n / median(times),
    "same_tokens": bool((tokens.numpy() == np.asarray(ours)).all()),
  }


def _hf_llama(lm, torch, transformers):
  """transformers' LlamaForCausalLM holding the zoo model's weights (the zoo's HF name map,
  inverted: kernels transposed back)."""
  from jaxlens.models._hf import t as _t
  from jaxlens.models.llama import hf_weights as _llama_map

  cfg = lm.config
  hf_cfg = transformers.LlamaConfig(
    vocab_size=cfg.vocab_size,
    hidden_size=cfg.d_model,
    intermediate_size=cfg.d_mlp,
    num_hidden_layers=cfg.n_layers,
    num_attention_heads=cfg.n_heads,
    num_key_value_heads=cfg.n_kv_heads,
    head_dim=cfg.d_head,
    rms_norm_eps=cfg.norm_eps,
    rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_base},
    tie_word_embeddings=cfg.tie_embeddings,
    max_position_embeddings=cfg.max_len,
  )
  hf = transformers.LlamaForCausalLM(hf_cfg).float().eval()
  state = {}
  for path, name, fn in _llama_map(cfg):
    value = lm.variables["params"]
    for p in path:
      value = value[p]
    value = np.asarray(value, np.float32)
    state[name] = torch.tensor(value.T.copy() if fn is _t else value)
  missing, unexpected = hf.load_state_dict(state, strict=False)
  assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
  if cfg.tie_embeddings:
    hf.tie_weights()
  return hf


def measure_sweeps(lm, args) -> dict:
  model, variables, cfg = lm.model, lm.variables, lm.config
  seq = args.positions
  rng = np.random.default_rng(1)
  clean = jnp.asarray(rng.integers(0, 1000, (1, seq)), jnp.int32)
  corrupt = clean.at[:, seq // 2].set(7)
  layers = tuple(range(cfg.n_layers))
  sites = [f"blocks_{k}/resid_post" for k in layers]

  def cone():
    return jl.sweep.cone_sweep(model, variables, clean, corrupt, last_logit_diff, site="resid_post")

  def plain():
    return jl.sweep.patching_sweep(model, variables, clean, corrupt, last_logit_diff, sites=sites)

  forward = jax.jit(lambda v, s: model.apply(v, s))
  first = {}
  for name, fn in (
    ("cone", cone),
    ("plain", plain),
    ("forward", lambda: forward(variables, corrupt)),
  ):
    first[name], value = timed(fn)
    if name == "cone":
      grid_cone = value
    elif name == "plain":
      grid_plain = value
  diff = float(jnp.abs(grid_cone - grid_plain).max())
  times = interleaved(
    {"cone": cone, "plain": plain, "forward": lambda: forward(variables, corrupt)},
    args.repeats,
    args.warmup,
  )
  med = {k: median(v) for k, v in times.items()}
  f = _flops(cfg, seq, seq)
  forward_flops = seq * (cfg.n_layers * f["block"] + f["unembed"])
  later = sum(cfg.n_layers - 1 - k for k in layers)  # blocks after each cell's layer
  cells_per_layer_plain = seq * seq  # tokens per layer, all cells
  cells_per_layer_cone = sum(seq - p for p in range(seq))
  plain_flops = later * cells_per_layer_plain * f["block"] + len(layers) * seq * seq * f["unembed"]
  cone_flops = (
    later * cells_per_layer_cone * f["block"] + len(layers) * cells_per_layer_cone * f["unembed"]
  )
  rate = forward_flops / med["forward"]
  return {
    "layers": len(layers),
    "positions": seq,
    "median_s": med,
    "all_s": times,
    "first_call_s": first,
    "max_abs_diff": diff,
    "flops": {"forward": forward_flops, "plain": plain_flops, "cone": cone_flops},
    "plain_over_floor": med["plain"] / (plain_flops / rate),
    "cone_over_floor": med["cone"] / (cone_flops / rate),
    "cone_over_plain": ratio(med["cone"], med["plain"]),
  }


def main(argv=None) -> dict:
  args = parse_args(argv)
  from jaxlens.models import smollm2

  lm = smollm2()
  g = measure_generation(lm, args)
  rows = [
    row(
      "generate_steer",
      f"jl.generate, {g['new_tokens']} tokens: steering every token / none",
      ratio(g["median_s"]["steered"], g["median_s"]["plain"]),
      target=("<=", 1.03),
      candidate="intervene=jl.steer at one resid_post",
      baseline="no edit",
      candidate_value=g["median_s"]["steered"],
      baseline_value=g["median_s"]["plain"],
    ),
    row(
      "generate_cache",
      f"greedy, {g['new_tokens']} tokens: uncached full forward per token / KV-cache decode",
      ratio(g["median_s"]["uncached"], g["median_s"]["plain"]),
      target=(">=", 10.0),
      kind="speedup",
      candidate="jl.generate",
      baseline="jitted full forward per token",
      candidate_value=g["median_s"]["plain"],
      baseline_value=g["median_s"]["uncached"],
    ),
  ]
  torch_g = g.get("torch") or {}
  if "tokens_per_s" in torch_g:
    rows.append(
      row(
        "generate_vs_torch",
        "greedy tokens/s: jl.generate / transformers generate",
        ratio(g["tokens_per_s"], torch_g["tokens_per_s"]),
        kind="speedup",
        candidate=f"{g['tokens_per_s']:.1f} tok/s",
        baseline=f"{torch_g['tokens_per_s']:.1f} tok/s ({torch_g['threads']} torch threads)",
        candidate_value=g["median_s"]["plain"],
        baseline_value=torch_g["median_s"],
      )
    )
  s = None
  if not args.no_sweep:
    s = measure_sweeps(lm, args)
    shape = f"{s['layers']} layers x {s['positions']} positions"
    rows += [
      row(
        "cone_sweep",
        f"SmolLM2 sweep ({shape}): cone / plain",
        s["cone_over_plain"],
        target=("<=", 0.6),
        candidate="jl.sweep.cone_sweep",
        baseline="jl.sweep.patching_sweep",
        candidate_value=s["median_s"]["cone"],
        baseline_value=s["median_s"]["plain"],
      ),
      row(
        "cone_sweep_floor",
        "cone sweep / its arithmetic floor",
        s["cone_over_floor"],
        note="floor: the FLOPs the cells recompute, at one plain forward's FLOP rate",
      ),
      row("plain_sweep_floor", "plain sweep / its arithmetic floor", s["plain_over_floor"]),
    ]
  result = {
    "benchmark": "generate",
    "title": "generation with a KV cache; causal-cone sweep",
    "config": {
      "model": "SmolLM2-135M-Instruct (Q4_1 dequantised, float32)",
      "new_tokens": args.new,
      "positions": args.positions,
      "repeats": args.repeats,
      "cpu_threads": os.cpu_count(),
    },
    "env": env_info(),
    "rows": rows,
    "generation": g,
    "sweep": s,
  }
  table = "\n".join(f"{r['key']:>20}: {r['value']!s:>8}  {r['measure']}" for r in rows)
  return report(result, table, args.out)


if __name__ == "__main__":
  main()
