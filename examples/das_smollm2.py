"""Low-rank DAS on SmolLM2-135M-Instruct: where "The capital of X is" keeps X.

``PYTHONPATH=. python examples/das_smollm2.py [--steps 30] [--site blocks_4/resid_post]
[--layers N]``

Four prompts "The capital of {France, Italy, Germany, Spain} is" (5 tokens each; the country is
token 3). Interchange intervention training aligns a rank-4 subspace of the residual stream after
block 4 at the country's position: the base prompt runs with that subspace taken from the source
prompt, and the label is the source's capital. All 16 (base, source) pairs are the training batch
and the evaluation (a demonstration that the loop runs on the shipped model offline, not a
held-out finding). ``--layers N`` runs the model cut after its first N blocks
(``Pretrained.first_layers``): the same loop at a fraction of the compile time, whose labels are
then read through the logit lens of block N - 1 (with ``--site`` on one of those blocks).
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxlens.models as jm
from jaxlens import train as jt

SITE, POSITION = "blocks_4/resid_post", 3
COUNTRIES = ["France", "Italy", "Germany", "Spain"]
CAPITALS = [" Paris", " Rome", " Berlin", " Madrid"]


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=30)
  parser.add_argument("--site", default=SITE, help="the residual stream site aligned")
  parser.add_argument(
    "--layers", type=int, default=None, help="keep only the first N blocks (past the site's)"
  )
  args = parser.parse_args(argv)
  lm = jm.smollm2()
  if args.layers is not None:
    lm = lm.first_layers(args.layers)
  tokens = jnp.stack([lm.encode(f"The capital of {c} is")[0] for c in COUNTRIES])
  answers = jnp.asarray([lm.encode(c)[0, 0] for c in CAPITALS])
  base, source = np.repeat(np.arange(4), 4), np.tile(np.arange(4), 4)
  batch = {"base": tokens[base], "source": tokens[source], "label": answers[source]}
  method = jt.LowRankDAS(rank=4)
  params = method.init(jax.random.key(0), 576)
  t0 = time.perf_counter()
  result = jt.train_iit(
    lm.model,
    lm.variables,
    args.site,
    method,
    params,
    [batch],
    steps=args.steps,
    optimizer=optax.adam(5e-2),
    positions=[POSITION],
  )
  seconds = time.perf_counter() - t0
  iia = jt.iia(
    lm.model, lm.variables, args.site, method, result.params, batch, positions=[POSITION]
  )
  report = {
    "site": args.site,
    "position": POSITION,
    "rank": 4,
    "steps": args.steps,
    "loss_first": round(result.losses[0], 3),
    "loss_last": round(result.losses[-1], 3),
    "train_seconds": round(seconds, 1),
    "iia": iia,
  }
  print(json.dumps(report, indent=2))
  return report


if __name__ == "__main__":
  main()
