"""Attribution graphs side by side with circuit-tracer 0.5.0, the jaxlens side: the weights that
benchmarks/bench_circuits_ct.py wrote (a random GPT-2-layout model, 4 layers, d_model 64, 4
per-layer transcoders of 256 features) in the zoo's GPT-2, the graph of the same prompt (every
active feature, the first position's features zeroed as circuit-tracer does), float32; reports
the first call (compilation included) and the median of the next ones (the compiled programs
reused), CPU time, peak resident memory (its increase is what ``circuits.memory_estimate``
estimates), the longest prompt whose estimate fits in 8 GiB (dense, and with 256 entries kept a
row), and circuit-tracer's figures from /tmp/ct/bench_<seq>.json beside them.

Usage::

  /work/venv-ct/bin/python benchmarks/bench_circuits_ct.py SEQ [REPEATS]
  python benchmarks/bench_circuits_vs_ct.py SEQ [REPEATS]
"""

from __future__ import annotations

import json
import resource
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxlens import circuits, sae
from jaxlens.models import GPT2, GPT2Config

L, D, V, F = 4, 64, 512, 256


def peak_mb():
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def cpu_s():
  r = resource.getrusage(resource.RUSAGE_SELF)
  return r.ru_utime + r.ru_stime


def build(z, seq):
  w = {k[2:]: z[k] for k in z.files if k.startswith("w/")}

  def get(suffix):
    hits = [k for k in w if k.endswith(suffix)]
    assert len(hits) == 1, (suffix, hits)
    return w[hits[0]]

  model = GPT2(
    GPT2Config(
      vocab_size=V,
      d_model=D,
      n_layers=L,
      n_heads=4,
      d_mlp=4 * D,
      max_len=max(seq, 16),
      tie_embeddings=False,
    )
  )
  c = jnp.asarray
  p = {
    "embed": {"embedding": c(get("embed.W_E"))},
    "pos_embed": {"embedding": c(get("pos_embed.W_pos"))},
    "ln_final": {"scale": c(get("ln_final.w")), "bias": c(get("ln_final.b"))},
    "lm_head": {"kernel": c(get("W_U"))},
  }
  for i in range(L):
    b = f"blocks.{i}."
    attn = {}
    for n, x in (("q_proj", "Q"), ("k_proj", "K"), ("v_proj", "V")):
      attn[n] = {
        "kernel": c(get(b + f"attn.W_{x}").transpose(1, 0, 2).reshape(D, -1)),
        "bias": c(get(b + f"attn.b_{x}").reshape(-1)),
      }
    attn["c_proj"] = {
      "kernel": c(get(b + "attn.W_O").reshape(-1, D)),
      "bias": c(get(b + "attn.b_O")),
    }
    pre = [k for k in w if k.startswith(b) and k.endswith("W_in")][0][: -len("W_in")]
    p[f"blocks_{i}"] = {
      "attn": attn,
      "ln_1": {"scale": c(get(b + "ln1.w")), "bias": c(get(b + "ln1.b"))},
      "ln_2": {"scale": c(get(b + "ln2.w")), "bias": c(get(b + "ln2.b"))},
      "mlp": {
        "c_fc": {"kernel": c(w[pre + "W_in"]), "bias": c(w[pre + "b_in"])},
        "c_proj": {"kernel": c(w[pre + "W_out"]), "bias": c(w[pre + "b_out"])},
      },
    }
  tcs = []
  for i in range(L):
    t = sae.Transcoder.init(jax.random.key(0), d_in=D, d_sae=F)
    tcs.append(
      t.replace(
        W_enc=c(z[f"tc{i}/W_enc"].T),
        b_enc=c(z[f"tc{i}/b_enc"]),
        W_dec=c(z[f"tc{i}/W_dec"]),
        b_dec=c(z[f"tc{i}/b_dec"]),
      )
    )
  return model, {"params": p}, tcs


def estimate(graph, seq, **kw) -> int:
  """``circuits.memory_estimate`` of a graph like ``graph`` (its active features per token)
  on a prompt of ``seq`` tokens."""
  n_active = round(len(graph.active_features) * seq / graph.n_pos)
  return circuits.memory_estimate(
    n_layers=L,
    seq=seq,
    d_model=D,
    d_in=D,
    n_heads=4,
    n_active=n_active,
    n_features=n_active,
    n_logits=graph.n_logits,
    batch_size=32,  # two batches of 16 rows run at once (two threads)
    itemsize=4,
    decoder_width=64,
    **kw,
  )


def longest(graph, budget, **kw) -> int:
  """The longest prompt whose estimate fits in ``budget`` bytes (bisection)."""
  lo, hi = 1, 1 << 20
  while lo < hi:
    mid = (lo + hi + 1) // 2
    lo, hi = (mid, hi) if estimate(graph, mid, **kw) <= budget else (lo, mid - 1)
  return lo


def main(seq: int, repeats: int = 2) -> dict:
  z = np.load(f"/tmp/ct/bench_{seq}.npz")
  model, variables, tcs = build(z, seq)
  tokens = jnp.asarray(z["tokens"], jnp.int32)
  before = peak_mb()
  walls, cpus = [], []
  for _ in range(1 + repeats):
    graph = None  # the previous graph is not held through the next (the peak is one graph's)
    c0, t0 = cpu_s(), time.perf_counter()
    graph = circuits.attribute(model, variables, tokens, tcs, zero_bos=True, batch_size=64)
    walls.append(time.perf_counter() - t0)
    cpus.append(cpu_s() - c0)
  ours = {
    "seq": seq,
    "nodes": int(graph.adjacency.shape[0]),
    "active_features": int(len(graph.active_features)),
    "first_call_s": walls[0],
    "wall_s": float(np.median(walls[1:])),
    "cpu_s": float(np.median(cpus[1:])),
    "rows_per_s": (graph.n_features + graph.n_logits) / float(np.median(walls[1:])),
    "peak_rss_mb": peak_mb(),
    "rss_before_mb": before,
    "memory_estimate_mb": estimate(graph, seq) / 2**20,
    "longest_prompt_8gib_dense": longest(graph, 8 * 2**30),
    "longest_prompt_8gib_top_256": longest(graph, 8 * 2**30, row_top_k=256),
  }
  ct_file = Path(f"/tmp/ct/bench_{seq}.json")
  ct = json.loads(ct_file.read_text()) if ct_file.exists() else None
  out = {"jaxlens": ours, "circuit_tracer": ct}
  if ct is not None:
    best = min(ct["wall_s"].values())
    out["speedup_wall"] = best / ours["wall_s"]
    out["speedup_wall_first_call"] = best / ours["first_call_s"]
    out["same_active_features"] = ours["active_features"] == ct["active_features"]
  print(json.dumps(out, indent=1))
  return out


if __name__ == "__main__":
  main(int(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else 2)
