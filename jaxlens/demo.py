"""``python -m jaxlens.demo``: train a tiny transformer, then find where it keeps the answer.

The task is one-hop retrieval. Each sequence holds random content tokens and one
marker token (``0``) somewhere; the model must predict, at the last position, the
token that follows the marker. A two-layer :class:`jaxlens.models.GPT` learns it
in a few hundred steps on a CPU.

Then an activation-patching sweep asks where the answer lives. The clean and the
corrupt sequences have the marker at the same position and differ only in the
token after it; for each site (the embedding, each block's attention output, each
block's output) and each position, the corrupt run is given the clean run's
value there (``jl.at_positions([p], jl.patch_from(clean))``), and the score is the
fraction of the clean logit difference (clean answer minus corrupt answer, at the
last position) that comes back: 1 restores the clean answer, 0 changes nothing.
The whole sites x positions grid is one jitted call
(:func:`jaxlens.sweep.patching_sweep`). The demo draws the grid as a heatmap with
matplotlib (:func:`jaxlens.plot.patching_heatmap`; ``pip install 'jaxlens[plot]'``)
and prints the sites that restore the most.

Run ``python -m jaxlens.demo --help`` for the options.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from collections.abc import Sequence
from typing import TextIO

import jax
import jax.numpy as jnp
import numpy as np

import jaxlens as jl
from jaxlens import plot
from jaxlens.internal import require
from jaxlens.models import GPT

__all__ = ["DemoResult", "main", "run_demo"]

MARKER = 0


# --------------------------------------------------------------------------
# The task.


def make_batch(key, batch: int, seq_len: int, vocab: int, marker_at=None):
  """Random sequences with one marker; returns ``(tokens, answers)``.

  Args:
    key: a ``jax.random`` key.
    batch: the number of sequences.
    seq_len: their length.
    vocab: the vocabulary size; content tokens are ``1 .. vocab - 1``.
    marker_at: the marker's position for every sequence, or ``None`` for a random
      one in ``[0, seq_len - 2)`` (never the last two positions, so that the
      answer is not the query token itself).

  Returns:
    int32 ``tokens`` of shape ``(batch, seq_len)`` and the int32 answers, the
    token after the marker.
  """
  k_tokens, k_pos = jax.random.split(key)
  tokens = jax.random.randint(k_tokens, (batch, seq_len), 1, vocab, dtype=jnp.int32)
  if marker_at is None:
    pos = jax.random.randint(k_pos, (batch,), 0, seq_len - 2, dtype=jnp.int32)
  else:
    pos = jnp.full((batch,), marker_at, jnp.int32)
  rows = jnp.arange(batch)
  tokens = tokens.at[rows, pos].set(MARKER)
  return tokens, tokens[rows, pos + 1]


def clean_corrupt_pair(key, batch: int, seq_len: int, vocab: int, marker_at: int):
  """A clean batch and a corrupt copy whose token after the marker is another one.

  Returns:
    ``(clean, corrupt, clean_answer, corrupt_answer)``.
  """
  k_batch, k_shift = jax.random.split(key)
  clean, answer = make_batch(k_batch, batch, seq_len, vocab, marker_at)
  # A different content token: shift within 1 .. vocab-1 by a non-zero amount.
  shift = jax.random.randint(k_shift, (batch,), 1, vocab - 1, dtype=jnp.int32)
  other = (answer - 1 + shift) % (vocab - 1) + 1
  corrupt = clean.at[:, marker_at + 1].set(other)
  return clean, corrupt, answer, other


# --------------------------------------------------------------------------
# The demo.


@dataclasses.dataclass(frozen=True)
class DemoResult:
  """What :func:`run_demo` measured.

  Attributes:
    losses: the training loss at every step.
    accuracy: the trained model's accuracy on a fresh batch.
    sites: the patched sites (the heatmap's rows).
    positions: the patched positions (its columns).
    scores: the ``(sites, positions)`` grid of restored fractions.
    top: the ``(site, position, score)`` triples with the highest scores.
    png: the heatmap's path.
    figure: the heatmap's matplotlib figure.
    train_seconds: the training time, compilation included.
    sweep_seconds: the sweep's time, compilation included.
  """

  losses: tuple
  accuracy: float
  sites: tuple
  positions: tuple
  scores: np.ndarray
  top: tuple
  png: str
  train_seconds: float
  sweep_seconds: float
  figure: object = None


def run_demo(
  *,
  steps: int = 300,
  batch: int = 128,
  seq_len: int = 10,
  vocab: int = 24,
  d_model: int = 64,
  n_layers: int = 2,
  n_heads: int = 4,
  lr: float = 3e-3,
  seed: int = 0,
  marker_at: int = 3,
  top: int = 5,
  out="patching_heatmap.png",
  progress: TextIO | bool | None = None,
) -> DemoResult:
  """Trains the model, runs the sweep, writes the heatmap; see the module docstring.

  ``progress`` is the stream of the training progress bar (default stderr), or
  ``False`` for none. The heatmap is drawn with :func:`jaxlens.plot.patching_heatmap`.
  """
  import optax  # a test dependency; imported here so that `import jaxlens.demo` never needs it

  # Fail before training, not after, when matplotlib is missing.
  require("matplotlib.figure", feature="the demo's heatmap", extra="plot", package="matplotlib")

  if not 0 <= marker_at <= seq_len - 3:
    raise jl.InvalidArgumentError(
      f"marker_at={marker_at} must leave the answer and a later query position in a "
      f"sequence of length {seq_len}",
      code="invalid_argument",
      fix=f"--marker-at between 0 and {seq_len - 3}",
    )
  model = GPT(
    vocab_size=vocab,
    d_model=d_model,
    n_heads=n_heads,
    n_layers=n_layers,
    max_len=seq_len,
    mlp_ratio=2,
  )
  opt = optax.adam(lr)

  # Every array the demo needs, made in one compiled call: on a CPU, each eager op
  # (a key split, a randint) is compiled on first use and costs more than it computes.
  @jax.jit
  def setup(key):
    k_init, k_train, k_eval, k_pair = jax.random.split(key, 4)
    params = model.init(k_init, jnp.zeros((1, seq_len), jnp.int32))
    # 64 evaluation sequences, as many as the sweep's, so `evaluate` compiles once.
    evaluation = make_batch(k_eval, 64, seq_len, vocab)
    pair = clean_corrupt_pair(k_pair, 64, seq_len, vocab, marker_at)
    return params, opt.init(params), jax.random.split(k_train, steps), evaluation, pair

  def loss_fn(p, tokens, answers):
    logits = model.apply(p, tokens)[:, -1]
    return optax.softmax_cross_entropy_with_integer_labels(logits, answers).mean()

  @jax.jit
  def step(p, state, keys, i):
    tokens, answers = make_batch(keys[i], batch, seq_len, vocab)
    value, grads = jax.value_and_grad(loss_fn)(p, tokens, answers)
    # optax.adam's bias correction raises a float to its int32 step count: standard dtype
    # promotion for the optimiser, so the demo also runs where a user turned on strict.
    with jax.numpy_dtype_promotion("standard"):
      updates, state = opt.update(grads, state, p)
    return optax.apply_updates(p, updates), state, value

  @jax.jit
  def evaluate(p, tokens, answers, clean, corrupt):
    accuracy = (model.apply(p, tokens)[:, -1].argmax(-1).astype(answers.dtype) == answers).mean()
    return accuracy, metric(model.apply(p, clean)), metric(model.apply(p, corrupt))

  start = time.perf_counter()
  params, state, train_keys, (tokens, answers), pair = setup(jax.random.key(seed))
  clean, corrupt, ans_clean, ans_corrupt = pair
  metric = _LogitDiff(np.asarray(ans_clean), np.asarray(ans_corrupt))
  from tqdm import tqdm

  losses = []
  with tqdm(
    total=steps,
    desc="training",
    unit="step",
    file=progress or sys.stderr,
    disable=progress is False,
    dynamic_ncols=True,
    mininterval=0.5,
  ) as bar:
    for i in range(steps):
      params, state, value = step(params, state, train_keys, i)
      losses.append(float(value))
      bar.update(1)
      if i % 10 == 0 or i == steps - 1:
        bar.set_postfix(loss=f"{losses[-1]:.4f}", refresh=False)
  train_seconds = time.perf_counter() - start

  sites = ("embed",) + tuple(s for i in range(n_layers) for s in (f"block_{i}/attn", f"block_{i}"))
  start = time.perf_counter()
  raw = jl.sweep.patching_sweep(model, params, clean, corrupt, metric, sites=sites)
  accuracy, m_clean, m_corrupt = (
    float(v) for v in evaluate(params, tokens, answers, clean, corrupt)
  )
  scores = (np.asarray(raw, np.float64) - m_corrupt) / (m_clean - m_corrupt)
  sweep_seconds = time.perf_counter() - start

  positions = tuple(range(seq_len))
  order = np.argsort(-scores, axis=None, kind="stable")[:top]
  best = tuple((sites[i // seq_len], int(i % seq_len), float(scores.flat[i])) for i in order)
  roles = {marker_at: "marker", marker_at + 1: "answer", seq_len - 1: "query"}
  labels = [f"{p} {roles[p]}" if p in roles else str(p) for p in positions]
  figure = plot.patching_heatmap(
    scores,
    row_labels=sites,
    col_labels=labels,
    path=out,
    xlabel="position (role)",
    colorbar_label="logit difference restored",
    title=f"Activation patching: where the answer lives ({n_layers}-layer GPT)",
  )
  return DemoResult(
    tuple(losses),
    accuracy,
    sites,
    positions,
    scores,
    best,
    str(out),
    train_seconds,
    sweep_seconds,
    figure,
  )


class _LogitDiff:
  """The mean over the batch of logit[clean answer] - logit[corrupt answer], last position.

  A class rather than a closure so that two equal metrics hash equal and the
  jitted sweep is reused.
  """

  def __init__(self, clean_answers: np.ndarray, corrupt_answers: np.ndarray):
    self.clean, self.corrupt = clean_answers, corrupt_answers
    self._key = (clean_answers.tobytes(), corrupt_answers.tobytes())

  def __eq__(self, other):
    return isinstance(other, _LogitDiff) and other._key == self._key

  def __hash__(self):
    return hash(self._key)

  def __call__(self, out):
    last = out[:, -1]
    rows = jnp.arange(last.shape[0])
    return (last[rows, self.clean] - last[rows, self.corrupt]).mean()


def _parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(prog="python -m jaxlens.demo", description=__doc__.split("\n")[0])
  p.add_argument("--steps", type=int, default=300, help="training steps (default 300)")
  p.add_argument("--batch", type=int, default=128, help="sequences per step (default 128)")
  p.add_argument("--seq-len", type=int, default=10, help="sequence length (default 10)")
  p.add_argument("--vocab", type=int, default=24, help="vocabulary size (default 24)")
  p.add_argument("--d-model", type=int, default=64, help="model width (default 64)")
  p.add_argument("--layers", type=int, default=2, help="transformer blocks (default 2)")
  p.add_argument("--heads", type=int, default=4, help="attention heads (default 4)")
  p.add_argument("--lr", type=float, default=3e-3, help="adam learning rate (default 3e-3)")
  p.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
  p.add_argument(
    "--marker-at",
    type=int,
    default=3,
    help="the marker's position in the patched sequences (default 3)",
  )
  p.add_argument("--top", type=int, default=5, help="how many top sites to print (default 5)")
  p.add_argument(
    "--out",
    default="patching_heatmap.png",
    help="the heatmap to write; .png, .svg or .pdf (default patching_heatmap.png)",
  )
  p.add_argument("--no-progress", action="store_true", help="no progress bar")
  return p


def main(argv: Sequence[str] | None = None) -> int:
  """Runs the demo from command-line arguments; returns the exit status."""
  args = _parser().parse_args(argv)
  print(
    f"jaxlens demo: a {args.layers}-layer GPT (d_model {args.d_model}) learns to return the "
    f"token after a marker; {args.steps} steps of batch {args.batch}"
  )
  start = time.perf_counter()
  result = run_demo(
    steps=args.steps,
    batch=args.batch,
    seq_len=args.seq_len,
    vocab=args.vocab,
    d_model=args.d_model,
    n_layers=args.layers,
    n_heads=args.heads,
    lr=args.lr,
    seed=args.seed,
    marker_at=args.marker_at,
    top=args.top,
    out=args.out,
    progress=False if args.no_progress else None,
  )
  print(
    f"loss {result.losses[0]:.3f} -> {result.losses[-1]:.4f}, accuracy "
    f"{100 * result.accuracy:.1f}% (training {result.train_seconds:.1f}s)"
  )
  print(
    f"patching sweep: {len(result.sites)} sites x {len(result.positions)} positions in one "
    f"jitted call ({result.sweep_seconds:.1f}s); the token after the marker is at position "
    f"{args.marker_at + 1}, the query at {args.seq_len - 1}"
  )
  print("top sites (fraction of the clean logit difference restored):")
  for rank, (site, pos, score) in enumerate(result.top, 1):
    print(f"  {rank}. {site} @ position {pos}: {score:.2f}")
  print(f"heatmap: {result.png}  (total {time.perf_counter() - start:.1f}s)")
  return 0


if __name__ == "__main__":
  sys.exit(main())
