"""LoReFT of rank 4 on SmolLM2-135M-Instruct: learn a fixed answer format from 32 examples.

``PYTHONPATH=. python examples/reft_smollm2.py [--steps 60] [--batch 8] [--held 12]
[--out reft_smollm2.json] [--site blocks_10/resid_post] [--layers N]``

The base model answers "What is 3 + 4?" in its own words. 32 (question, answer) pairs whose
answers all read "The answer is N." train a rank-4 LoReFT at one layer's residual stream with
the model frozen (its weights are checked unchanged, bit for bit); the trained intervention is
then saved as a spec, loaded back, and applied while jl.generate decodes 12 held-out questions
with the KV cache. The script prints (and writes as JSON) the training time, the losses, the
fraction of held-out generations in the format, and how many are also right. ``--layers N``
runs the model cut after its first N blocks (``Pretrained.first_layers``): the same loop at a
fraction of the compile time, a quick check that it runs rather than a result (with
``--site`` on one of those blocks).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import tempfile
import time
from pathlib import Path

import jax
import numpy as np
import optax

import jaxlens as jl
import jaxlens.models as jm
from jaxlens import train as jt
from jaxlens.generation import left_pad

SITE = "blocks_10/resid_post"
FORMAT = "The answer is"


def _chat(lm, question):
  # SmolLM2-Instruct's chat template, written out.
  text = f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"
  return lm.encode(text)[0].tolist()


def _questions(rng, n):
  out = []
  for _ in range(n):
    a, b = rng.integers(1, 10, 2)
    out.append((f"What is {a} + {b}?", int(a + b)))
  return out


def _digest(variables):
  h = hashlib.sha256()
  for leaf in jax.tree.leaves(variables):
    h.update(np.ascontiguousarray(leaf))  # the buffer itself, not a bytes copy of it
  return h.hexdigest()


def _generate(lm, prompts, spec, n):
  tokens, mask = left_pad(prompts)
  out = jl.generate(lm.model, lm.variables, tokens, n, attention_mask=mask, intervene=spec)
  return [lm.decode(row) for row in np.asarray(out.tokens)]


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=60)
  parser.add_argument("--rank", type=int, default=4)
  parser.add_argument("--lr", type=float, default=1e-2)
  parser.add_argument("--batch", type=int, default=8, help="training examples a step")
  parser.add_argument("--held", type=int, default=12, help="held-out questions generated")
  parser.add_argument("--out", default=None, help="a JSON file, or a directory to write one in")
  parser.add_argument("--site", default=SITE, help="the residual stream site trained")
  parser.add_argument(
    "--layers", type=int, default=None, help="keep only the first N blocks (past the site's)"
  )
  args = parser.parse_args(argv)

  lm = jm.smollm2()
  if args.layers is not None:
    lm = lm.first_layers(args.layers)
  before = _digest(lm.variables)
  rng = np.random.default_rng(0)
  train_q, test_q = _questions(rng, 32), _questions(rng, args.held)
  pairs = [(_chat(lm, q), lm.encode(f"{FORMAT} {a}.")[0].tolist()) for q, a in train_q]
  method = jt.LoReFT(rank=args.rank)
  params = method.init(jax.random.key(0), 576)
  t0 = time.perf_counter()
  result = jt.train_reft(
    lm.model,
    lm.variables,
    args.site,
    method,
    params,
    pairs,
    steps=args.steps,
    batch_size=args.batch,
    optimizer=optax.adam(args.lr),
  )
  train_s = time.perf_counter() - t0
  assert _digest(result.variables) == before == _digest(lm.variables)

  path = Path(tempfile.mkdtemp()) / "reft"
  jl.when(args.site, jl.loreft(result.params)).save(path)
  spec = jl.load_spec(path)
  prompts = [_chat(lm, q) for q, _ in test_q]
  t1 = time.perf_counter()
  plain = _generate(lm, prompts, None, 8)
  steered = _generate(lm, prompts, spec, 8)
  gen_s = time.perf_counter() - t1
  in_format = [s.strip().startswith(FORMAT) for s in steered]
  right = [s.strip().startswith(f"{FORMAT} {a}") for s, (_, a) in zip(steered, test_q)]
  report = {
    "site": args.site,
    "rank": args.rank,
    "steps": args.steps,
    "examples": len(pairs),
    "train_seconds": round(train_s, 1),
    "loss_first": round(result.losses[0], 4),
    "loss_last": round(result.losses[-1], 4),
    "held_out_in_format": f"{sum(in_format)}/{len(in_format)}",
    "held_out_right": f"{sum(right)}/{len(right)}",
    "plain_in_format": f"{sum(s.strip().startswith(FORMAT) for s in plain)}/{len(plain)}",
    "weights_unchanged": True,
    "generate_seconds": round(gen_s, 1),
    "examples_out": [
      {"question": q, "plain": p, "loreft": s}
      for (q, _), p, s in list(zip(test_q, plain, steered))[:3]
    ],
  }
  print(json.dumps(report, indent=2))
  if args.out:
    out = Path(args.out)
    out = out / "reft_smollm2.json" if out.is_dir() else out
    out.write_text(json.dumps(report, indent=2))
  return report


if __name__ == "__main__":
  main()
