"""Lenses on SmolLM2-135M (or Gemma 3 270M): logit lens, direct logit attribution,
patchscopes and a tuned lens trained offline on a CPU.

    python examples/lenses_smollm2.py [--model smollm2|gemma3] [--out DIR] [--steps N]

1. The logit lens's top tokens at every layer and position of "The capital of France is",
   over the vocabulary in chunks (``lens.logit_lens_topk``), drawn as a grid.
2. Direct logit attribution of " Paris" - " Rome" at the last position: the embeddings,
   every head, every MLP; the parts sum to the logit difference (checked), drawn as bars.
3. A patchscope: the last position of the France prompt, from every layer, written into an
   identity prompt ("cat -> cat; 1135 -> 1135; hello -> hello; ? ->") at every layer in one
   compiled program, and a few tokens generated from the patched identity prompt.
4. A tuned lens trained with tuned-lens's optimiser on text that ships with Python
   (``pydoc_data.topics``, as examples/sae_smollm2.py; each row begins with the tokenizer's
   ``<bos>`` where it has one, as Gemma's), its per-layer KL to the final distribution on
   held-out text against the logit lens's, drawn as curves; saved in tuned-lens's files
   under ``--out`` (with ``report.json``). ``--init lstsq`` starts it from a least-squares fit
   (``TunedLens.lstsq``) instead of zeros.

The numbers it prints are the ones quoted in docs/lenses.md. ``--layers N`` cuts the model
after its first N blocks (``Pretrained.first_layers``): every step at a fraction of the compile
time, a quick check that it runs rather than a result (the cut model's top token need not be
" Paris").
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

import jaxlens.models as jm
from jaxlens import lens, plot

PROMPT = "The capital of France is"
IDENTITY = "cat -> cat; 1135 -> 1135; hello -> hello; ? ->"


def _sequences(lm, seq: int, n: int, skip: int = 0):
  """``n`` rows of ``seq`` tokens of the Python help topics, after the first ``skip`` rows;
  each row starts with the tokenizer's own prefix (Gemma's ``<bos>``; SmolLM2 has none), as
  the model expects at the start of a text."""
  text = "\n\n".join(pydoc_data.topics.topics[k] for k in sorted(pydoc_data.topics.topics))
  prefix = np.asarray(lm.tokenizer.encode("").ids, np.int32)
  ids = np.asarray(lm.tokenizer.encode(text, add_special_tokens=False).ids, np.int32)
  body = seq - len(prefix)
  rows = ids[: (len(ids) // body) * body].reshape(-1, body)[skip : skip + n]
  return jnp.asarray(np.concatenate([np.broadcast_to(prefix, (len(rows), len(prefix))), rows], 1))


def _token(lm, text: str) -> int:
  """The id of ``text`` as one token, without the tokenizer's prefix."""
  ids = lm.tokenizer.encode(text, add_special_tokens=False).ids
  if len(ids) != 1:
    raise ValueError(f"{text!r} is {len(ids)} tokens for this tokenizer, not one")
  return ids[0]


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--model", choices=["smollm2", "gemma3"], default="smollm2")
  parser.add_argument("--out", type=pathlib.Path, default=None)
  parser.add_argument("--steps", type=int, default=250, help="tuned-lens training steps")
  parser.add_argument(
    "--init",
    choices=["zeros", "lstsq"],
    default="zeros",
    help="the translators' start: zeros (the logit lens, tuned-lens's) or a least-squares fit "
    "on the first batch (lower KL in fewer steps; docs/lenses.md)",
  )
  parser.add_argument("--batch", type=int, default=4, help="sequences a training step")
  parser.add_argument("--seq", type=int, default=64, help="tokens a sequence")
  parser.add_argument("--held", type=int, default=8, help="held-out sequences")
  parser.add_argument("--new", type=int, default=4, help="tokens the patchscope generates")
  parser.add_argument("--every", type=int, default=1, help="patchscope every k-th layer")
  parser.add_argument(
    "--layers", type=int, default=None, help="keep only the first N blocks (a quick run)"
  )
  args = parser.parse_args(argv)
  out = args.out or pathlib.Path(tempfile.mkdtemp(prefix="lenses_"))
  out.mkdir(parents=True, exist_ok=True)
  lm = jm.smollm2() if args.model == "smollm2" else jm.gemma3()
  if args.layers is not None:
    lm = lm.first_layers(args.layers)
  model, variables = lm.model, lm.variables
  n = len(model.layer_sites())
  report: dict = {"model": args.model, "layers": n}

  # 1. The logit lens's top tokens, in vocabulary chunks.
  tokens = lm.encode(PROMPT)
  top = jax.jit(lambda v, t: lens.logit_lens_topk(model, v, t, k=3))(variables, tokens)
  final_top = lm.decode(int(top.ids[-1, 0, -1, 0]))
  report["final_top"] = final_top
  report["first_paris_layer"] = next(
    (i for i in range(n + 1) if lm.decode(int(top.ids[i, 0, -1, 0])) == " Paris"), None
  )
  plot.lens_grid(
    top.ids[:, 0],
    top.probs[:, 0],
    vocab=lambda i: lm.decode(i),
    col_labels=lm.tokens(PROMPT),
    title=f"logit lens, {args.model}",
    path=out / "logit_lens.png",
  )
  print(
    f"logit lens: the last layer's top token is {final_top!r}; ' Paris' first tops layer "
    f"{report['first_paris_layer']}"
  )

  # 2. Direct logit attribution of " Paris" - " Rome".
  paris, rome = _token(lm, " Paris"), _token(lm, " Rome")
  dla = jax.jit(lambda v, t: lens.direct_logit_attribution(model, v, t, paris, minus=rome))(
    variables, tokens
  )
  total, logit = float(dla.parts[0].sum()), float(dla.logit[0])
  assert abs(total - logit) <= 1e-3 * max(1.0, abs(logit)), (total, logit)
  order = np.argsort(-np.abs(np.asarray(dla.parts[0])))[:5]
  report["dla_logit_diff"] = logit
  report["dla_top"] = [(dla.labels[i], float(dla.parts[0, i])) for i in order]
  plot.dla_bars(dla.parts[0], dla.labels, k=15, title="' Paris' - ' Rome'", path=out / "dla.png")
  print(
    f"DLA: logit(' Paris') - logit(' Rome') = {logit:.3f} = sum of {len(dla.labels)} parts "
    f"({total:.3f}); largest: " + ", ".join(f"{k} {v:+.2f}" for k, v in report["dla_top"])
  )

  # 3. Patchscope into an identity prompt.
  target = lm.encode(IDENTITY)
  t0 = time.perf_counter()
  scoped = list(range(0, n + 1, args.every))
  grid = lens.patchscope(
    model,
    variables,
    tokens,
    target,
    source_layers=scoped,
    target_layers=scoped,
    read=lambda logits: jnp.argmax(logits, -1),
  )
  grid = np.asarray(grid)  # (source layer, target layer, batch)
  report["patchscope_seconds"] = time.perf_counter() - t0
  report["patchscope_diagonal"] = {
    layer: lm.decode(int(grid[i, i, 0])) for i, layer in enumerate(scoped)
  }
  layers = sorted({0, n // 4, n // 2, 3 * n // 4}) if args.every == 1 else scoped[:-1]
  gen = lens.patchscope_generate(
    model, variables, tokens, target, args.new, source_layers=layers, target_layers=layers
  )
  report["patchscope_generated"] = {
    layer: lm.decode(np.asarray(gen.tokens[i, i, 0])) for i, layer in enumerate(layers)
  }
  print(
    f"patchscope: {len(scoped) ** 2} cells in {report['patchscope_seconds']:.1f} s; "
    f"generated from layer l into layer l: {report['patchscope_generated']}"
  )

  # 4. A tuned lens, trained offline.
  train = _sequences(lm, args.seq, args.steps * args.batch)
  held = _sequences(lm, args.seq, args.held, skip=len(train))
  batches = (train[i * args.batch : (i + 1) * args.batch] for i in range(args.steps))
  t0 = time.perf_counter()
  result = lens.train_tuned_lens(model, variables, batches, steps=args.steps, init=args.init)
  report["train_seconds"] = time.perf_counter() - t0
  report["train_kl_first_last"] = [
    float(result.kl[0].mean()),
    float(result.kl[-1].mean()),
  ]
  both = jax.jit(
    lambda v, t, tl: (lens.kl_to_final(model, v, t, tl), lens.kl_to_final(model, v, t, None))
  )
  # Row by row (every row has seq real tokens, so the mean of the rows' means is the mean):
  # a row's (seq, vocab) logits at a time, whatever the vocabulary.
  per_row = [both(variables, held[i : i + 1], result.lens) for i in range(len(held))]
  tuned, logit = (np.mean([np.asarray(r[j]) for r in per_row], 0) for j in (0, 1))
  report["kl_tuned"], report["kl_logit"] = tuned.tolist(), logit.tolist()
  report["tuned_below_logit"] = bool(np.all(tuned[:-1] < logit[:-1]))
  plot.lens_kl({"logit lens": logit, "tuned lens": tuned}, title=args.model, path=out / "kl.png")
  lens.save_tuned_lens(out / "tuned_lens", result.lens, model, variables, model_name=args.model)
  print(
    f"tuned lens: {args.steps} steps of {args.batch} x {args.seq} tokens in "
    f"{report['train_seconds']:.0f} s; held-out KL (nats) per layer, logit -> tuned:"
  )
  for i in range(n):
    print(f"  layer {i:2d}: {logit[i]:7.3f} -> {tuned[i]:7.3f}")
  print(f"tuned lens below the logit lens at every layer: {report['tuned_below_logit']}")
  (out / "report.json").write_text(json.dumps(report, indent=1))
  print(f"figures, the lens and report.json in {out}")
  return report


if __name__ == "__main__":
  main()
