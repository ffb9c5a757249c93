"""jaxlens.sae against SAELens, in one process: training speed, splice overhead, feature recovery.

1. Training: a TopK SAE (same width, k, batch, ``rescale_acts_by_decoder_norm``, Adam, gradient
   clipping), float32, at each ``--shapes`` (256 -> 2,048 and SmolLM2's 576 -> 16,384 by
   default): jaxlens's compiled step against SAELens's ``SAETrainer._train_step`` on the same
   batches, and end to end ``jaxlens.sae.train.train`` against ``SAETrainer.fit`` (the trainer
   ``sae_lens.synthetic.train_toy_sae`` sets up, set-up included; jaxlens's compilation is in
   the warm-up). SAELens runs at ``torch.set_num_threads(1)`` and at torch's default, interleaved
   with jaxlens in the same process (``benchmarks._torch_peer``); the faster setting counts, and
   each side's wall and CPU time per step are reported (target: >= 2x).
2. Splice overhead: the jitted forward of a model with an SAE spliced (``sae.splice``, which
   also exposes three sites) against the jitted forward with the same SAE written by hand into
   the model through a plain Flax method interceptor (target <= 1.1).
3. Feature recovery: SAELens's synthetic data (``FeatureDictionary`` + ``ActivationGenerator``,
   ground-truth features of known directions); both train the same TopK SAE for the same steps
   on the same batches; the figure is the mean correlation coefficient (SAELens's
   ``mean_correlation_coefficient``: matched |cosine| between decoder rows and true features)
   of jaxlens's over SAELens's (target >= 1.0).

Usage::

  python benchmarks/bench_sae.py [--d-in 256] [--d-sae 2048] [--k 32] [--batch 1024]
                                 [--steps 100] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

_ROOT = Path(__file__).resolve().parent.parent
if str(_ROOT) not in sys.path:
  sys.path.insert(0, str(_ROOT))

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks._timing import env_info, interleaved, median  # noqa: E402
from benchmarks._torch_peer import against_torch_peer  # noqa: E402
from jaxlens import sae  # noqa: E402
from jaxlens.sae import train as sae_train  # noqa: E402

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "sae.json"


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument(
    "--shapes", default="256x2048,576x16384", help="d_in x d_sae of each training figure"
  )
  p.add_argument("--k", type=int, default=32)
  p.add_argument("--batch", type=int, default=1024)
  p.add_argument("--step-calls", type=int, default=5, help="steps per timed call")
  p.add_argument("--fit-steps", type=int, default=30, help="steps per end-to-end fit (0: none)")
  p.add_argument("--fit-repeats", type=int, default=2)
  p.add_argument("--repeats", type=int, default=4)
  p.add_argument("--recovery-steps", type=int, default=1500)
  p.add_argument("--sections", default="train,splice,recovery")
  p.add_argument("--out", default=str(DEFAULT_OUT))
  return p.parse_args(argv)


def _saelens_trainer(d_in, d_sae, k, batch, steps, batches_t, lr=3e-4):
  from sae_lens import LoggingConfig, TopKTrainingSAE, TopKTrainingSAEConfig
  from sae_lens.config import SAETrainerConfig
  from sae_lens.training.sae_trainer import SAETrainer

  ref = TopKTrainingSAE(TopKTrainingSAEConfig(d_in=d_in, d_sae=d_sae, k=k))
  cfg = SAETrainerConfig(
    total_training_samples=steps * batch,
    train_batch_size_samples=batch,
    lr=lr,
    lr_end=lr,
    lr_scheduler_name="constant",
    dead_feature_window=1000,
    feature_sampling_window=2000,
    logger=LoggingConfig(log_to_wandb=False, eval_every_n_wandb_logs=2**31 - 1),
  )

  def provider():
    i = 0
    while True:
      yield batches_t[i % len(batches_t)]
      i += 1

  return ref, SAETrainer(cfg=cfg, sae=ref, data_provider=provider())


def _shape_config(d_sae, k):
  return sae_train.TrainConfig(
    d_sae=d_sae,
    architecture="topk",
    k=k,
    rescale_acts_by_decoder_norm=True,
    b_dec_init="zeros",
  )


def training_speed(args, out, d_in, d_sae):
  """Per step and end to end, against SAELens at its best torch thread setting."""
  import contextlib
  import io

  import torch

  rng = np.random.default_rng(0)
  batches = [rng.normal(size=(args.batch, d_in)).astype(np.float32) for _ in range(8)]
  batches_t = [torch.from_numpy(b) for b in batches]
  config = _shape_config(d_sae, args.k)
  result = {"d_in": d_in, "d_sae": d_sae, "k": args.k, "batch": args.batch}

  # The step alone: jaxlens's compiled step against SAELens's SAETrainer._train_step.
  per_call = args.step_calls
  init, step = sae_train._compiled(config, 10**6)
  holder = {"state": init(jax.random.key(0), jnp.asarray(batches[0]), None, None)}
  xs = [jnp.asarray(b) for b in batches]
  ref, trainer = _saelens_trainer(d_in, d_sae, args.k, args.batch, 10**6, batches_t)

  def ours_steps():
    s = holder["state"]
    for i in range(per_call):
      s, m = step(s, xs[i % 8], None)
    holder["state"] = s
    return m["loss"]

  def theirs_steps():
    for i in range(per_call):
      trainer._train_step(ref, batches_t[i % 8])

  result["step"] = against_torch_peer(
    ours_steps, theirs_steps, args.repeats, per_call=per_call, peer_name="saelens"
  )
  if args.fit_steps:
    # End to end: train() / SAETrainer.fit() on fit_steps batches, set-up included (jaxlens's
    # programs compiled once in the warm-up call and cached).
    n = args.fit_steps

    def ours_fit():
      data = (batches[i % 8] for i in range(n))
      r = sae_train.train(data, config, steps=n, progress=False, log_every=n)
      return r.sae.W_enc

    def theirs_fit():
      _, fit_trainer = _saelens_trainer(d_in, d_sae, args.k, args.batch, n, batches_t)
      with contextlib.redirect_stderr(io.StringIO()):  # its tqdm bar
        fit_trainer.fit()

    result["fit"] = against_torch_peer(
      ours_fit, theirs_fit, args.fit_repeats, per_call=n, peer_name="saelens"
    )
  out.setdefault("train", []).append(result)
  return result


def splice_overhead(args, out):
  from jaxlens.models import init_gpt

  model, variables, tokens = init_gpt(
    0, n_layers=4, d_model=256, n_heads=4, max_len=64, vocab_size=512, batch=8
  )
  d = sae.SAE.init(jax.random.key(1), 256, 2048, activation="topk", k=32)
  spliced = jax.jit(sae.splice(model, "block_1", d).apply)

  def by_hand_interceptor(next_fun, args_, kwargs, context):
    y = next_fun(*args_, **kwargs)
    if context.method_name == "__call__" and tuple(context.module.path) == ("block_1",):
      acts = d.encode(y)
      return d.decode(acts, y) + (y - d.decode(d.encode(y), y))
    return y

  @jax.jit
  def by_hand(v, t):
    with nn.intercept_methods(by_hand_interceptor):
      return model.apply(v, t)

  diff = float(jnp.abs(spliced(variables, tokens) - by_hand(variables, tokens)).max())
  times = interleaved(
    {"splice": lambda: spliced(variables, tokens), "hand": lambda: by_hand(variables, tokens)},
    max(args.repeats * 10, 30),
    warmup=3,
  )
  plain = jax.jit(model.apply)
  times_plain = interleaved(
    {"hand": lambda: by_hand(variables, tokens), "plain": lambda: plain(variables, tokens)},
    max(args.repeats * 10, 30),
    warmup=3,
  )
  out["splice"] = {
    "splice_ms": 1000 * median(times["splice"]),
    "by_hand_ms": 1000 * median(times["hand"]),
    "ratio": median(times["splice"]) / median(times["hand"]),
    "sae_cost_over_plain_forward": median(times_plain["hand"]) / median(times_plain["plain"]),
    "max_abs_diff": diff,
  }


def feature_recovery(args, out):
  import torch
  from sae_lens.synthetic import ActivationGenerator, FeatureDictionary
  from sae_lens.synthetic.evals import mean_correlation_coefficient

  torch.manual_seed(0)
  n_true, hidden, batch = 256, 64, 1024
  fd = FeatureDictionary(n_true, hidden, seed=0)
  gen = ActivationGenerator(
    n_true, firing_probabilities=0.02, std_firing_magnitudes=0.2, mean_firing_magnitudes=1.0
  )
  steps = args.recovery_steps
  with torch.no_grad():
    data_t = [fd(gen.sample(batch)) for _ in range(steps)]
  data = [t.numpy() for t in data_t]
  d_sae, k, lr = 384, 8, 3e-3
  config = sae_train.TrainConfig(
    d_sae=d_sae, architecture="topk", k=k, lr=lr, rescale_acts_by_decoder_norm=True
  )
  t0 = time.perf_counter()
  ours = sae_train.train(iter(data), config, steps=steps, progress=False, log_every=100)
  t_ours = time.perf_counter() - t0
  ref, trainer = _saelens_trainer(hidden, d_sae, k, batch, steps, data_t, lr=lr)
  import contextlib
  import io

  t0 = time.perf_counter()
  with contextlib.redirect_stderr(io.StringIO()):
    trainer.fit()
  t_theirs = time.perf_counter() - t0
  truth = fd.feature_vectors.detach()
  mcc_ours = mean_correlation_coefficient(torch.from_numpy(np.asarray(ours.sae.W_dec)), truth)
  mcc_theirs = mean_correlation_coefficient(ref.W_dec.detach(), truth)
  x = data[-1]
  ev_ours = float(sae_train.explained_variance(x, ours.sae(x)))
  with torch.no_grad():
    ev_theirs = float(sae_train.explained_variance(x, ref(torch.from_numpy(x)).numpy()))
  out["recovery"] = {
    "true_features": n_true,
    "hidden": hidden,
    "d_sae": d_sae,
    "k": k,
    "steps": steps,
    "mcc_jaxlens": mcc_ours,
    "mcc_saelens": mcc_theirs,
    "ratio": mcc_ours / mcc_theirs,
    "explained_variance_jaxlens": ev_ours,
    "explained_variance_saelens": ev_theirs,
    "seconds_jaxlens": t_ours,
    "seconds_saelens": t_theirs,
  }


def main(argv=None):
  args = parse_args(argv)
  out = {"env": env_info(), "args": vars(args)}
  sections = args.sections.split(",")
  if "train" in sections:
    for shape in args.shapes.split(","):
      d_in, d_sae = (int(v) for v in shape.split("x"))
      print(json.dumps(training_speed(args, out, d_in, d_sae), indent=1), flush=True)
  if "splice" in sections:
    splice_overhead(args, out)
    print(json.dumps(out["splice"], indent=1), flush=True)
  if "recovery" in sections:
    feature_recovery(args, out)
    print(json.dumps(out["recovery"], indent=1), flush=True)
  if args.out:
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1, default=str))
  return out


if __name__ == "__main__":
  main()
