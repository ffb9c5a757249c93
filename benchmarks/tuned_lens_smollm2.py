"""The tuned lens on SmolLM2-135M (or Gemma 3 270M): the held-out per-layer KL to the final
distribution of the logit lens, of the least-squares start alone, and of tuned lenses trained
from zeros (tuned-lens's start) and from the least-squares start, with the same steps, text and
optimiser (tuned-lens's defaults) as ``examples/lenses_smollm2.py``'s tuned lens.

    python benchmarks/tuned_lens_smollm2.py [--steps 24 --batch 2 --seq 32 --held 4]
        [--init-batches 8] [--ridge 1e-3] [--plot docs/lenses_smollm2_kl.png]

Prints the KLs, the training and fitting times (wall and CPU) and, as JSON, all of it.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

_ROOT = Path(__file__).resolve().parent.parent
for p in (_ROOT, _ROOT / "examples"):
  if str(p) not in sys.path:
    sys.path.insert(0, str(p))

import jax  # noqa: E402
import numpy as np  # noqa: E402

import jaxlens.models as jm  # noqa: E402
from benchmarks._torch_peer import cpu_seconds  # noqa: E402
from jaxlens import lens, plot  # noqa: E402
from lenses_smollm2 import _sequences  # noqa: E402


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--model", choices=["smollm2", "gemma3"], default="smollm2")
  parser.add_argument("--steps", type=int, default=24)
  parser.add_argument("--batch", type=int, default=2)
  parser.add_argument("--seq", type=int, default=32)
  parser.add_argument("--held", type=int, default=4)
  parser.add_argument("--init-batches", type=int, default=8)
  parser.add_argument("--ridge", type=float, default=1e-3)
  parser.add_argument("--plot", type=Path, default=None)
  args = parser.parse_args(argv)
  lm = jm.smollm2() if args.model == "smollm2" else jm.gemma3()
  model, variables = lm.model, lm.variables
  train = _sequences(lm, args.seq, args.steps * args.batch)
  held = _sequences(lm, args.seq, args.held, skip=len(train))
  batches = [train[i * args.batch : (i + 1) * args.batch] for i in range(args.steps)]
  kl = jax.jit(lambda v, t, tl: lens.kl_to_final(model, v, t, tl))

  def held_kl(tl):  # row by row: one row's (seq, vocab) logits at a time
    return np.mean([np.asarray(kl(variables, held[i : i + 1], tl)) for i in range(len(held))], 0)

  out: dict = {
    "setting": (
      f"{args.model}, {args.steps} steps of {args.batch} x {args.seq} tokens, held-out "
      f"{args.held} x {args.seq}; lstsq on {args.init_batches} batches, ridge {args.ridge}"
    ),
    "kl": {"logit lens": held_kl(None).tolist()},
    "seconds": {},
  }

  def timed(name, fn):
    c0, w0 = cpu_seconds(), time.perf_counter()
    value = jax.block_until_ready(fn())
    out["seconds"][name] = {"wall": time.perf_counter() - w0, "cpu": cpu_seconds() - c0}
    print(
      f"{name}: {out['seconds'][name]['wall']:.0f} s wall, {out['seconds'][name]['cpu']:.0f} s CPU"
    )
    return value

  start = timed(
    "lstsq",
    lambda: lens.TunedLens.lstsq(model, variables, batches[: args.init_batches], ridge=args.ridge),
  )
  out["kl"]["lstsq start (0 steps)"] = held_kl(start).tolist()
  for init in ("zeros", "lstsq"):
    run = timed(
      f"train from {init}",
      lambda init=init: lens.train_tuned_lens(
        model,
        variables,
        batches,
        steps=args.steps,
        init=init,
        init_batches=args.init_batches,
        ridge=args.ridge,
      ),
    )
    out["kl"][f"tuned from {init}, {args.steps} steps"] = held_kl(run.lens).tolist()
    out[f"train_kl_{init}"] = np.asarray(run.kl).mean(1).round(4).tolist()
  names = list(out["kl"])
  print(out["setting"])
  print("layer  " + "  ".join(f"{n[:22]:>22}" for n in names))
  for i in range(len(out["kl"][names[0]])):
    print(f"{i:5d}  " + "  ".join(f"{out['kl'][n][i]:22.3f}" for n in names))
  if args.plot is not None:
    plot.lens_kl({n: np.asarray(v) for n, v in out["kl"].items()}, title=args.model, path=args.plot)
  print(json.dumps(out))
  return out


if __name__ == "__main__":
  main()
