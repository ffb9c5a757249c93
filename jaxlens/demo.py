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
(:func:`jaxlens.sweep.patching_sweep`). The demo writes the grid as a heatmap PNG
and prints the sites that restore the most.

Run ``python -m jaxlens.demo --help`` for the options.
"""

from __future__ import annotations

import argparse
import dataclasses
import struct
import sys
import time
import zlib
from typing import Sequence, TextIO

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["DemoResult", "main", "run_demo", "write_heatmap_png"]

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
# A progress bar, written by hand to avoid a dependency.


class ProgressBar:
  """A one-line text progress bar: ``[#####-----]  50/100  loss 0.1234  3.2s``.

  On a terminal it redraws in place with ``\\r``; elsewhere (a log, a test's
  captured output) it writes a line at most ``lines`` times, so the output stays
  short.
  """

  def __init__(self, total: int, stream: TextIO, width: int = 30, lines: int = 10):
    self.total, self.stream, self.width = total, stream, width
    self.tty = bool(getattr(stream, "isatty", lambda: False)())
    self.every = max(1, total // lines)
    self.start = time.perf_counter()

  def update(self, done: int, loss: float) -> None:
    if not self.tty and done % self.every and done != self.total:
      return
    filled = int(self.width * done / max(self.total, 1))
    bar = "#" * filled + "-" * (self.width - filled)
    text = (f"[{bar}] {done:>{len(str(self.total))}}/{self.total}  loss {loss:.4f}  "
            f"{time.perf_counter() - self.start:.1f}s")
    self.stream.write(("\r" + text) if self.tty else (text + "\n"))
    self.stream.flush()

  def close(self) -> None:
    if self.tty:
      self.stream.write("\n")
      self.stream.flush()


# --------------------------------------------------------------------------
# A heatmap PNG written with numpy and zlib.

# A 3x5 pixel font for labels: each glyph is five rows of three bits.
_FONT = {
    "0": "111101101101111", "1": "010110010010111", "2": "111001111100111",
    "3": "111001111001111", "4": "101101111001001", "5": "111100111001111",
    "6": "111100111101111", "7": "111001001001001", "8": "111101111101111",
    "9": "111101111001111", "a": "000111101111101", "b": "100111101101111",
    "c": "000111100100111", "d": "001111101101111", "e": "000111111100111",
    "f": "011100110100100", "g": "000111101111001", "h": "100111101101101",
    "i": "010000010010010", "j": "001000001101111", "k": "100101110101101",
    "l": "110010010010011", "m": "000111111101101", "n": "000110101101101",
    "o": "000111101101111", "p": "000111101111100", "q": "000111101111001",
    "r": "000111100100100", "s": "000011010001110", "t": "010111010010011",
    "u": "000101101101111", "v": "000101101101010", "w": "000101101111111",
    "x": "000101010010101", "y": "000101111001111", "z": "000111001010111",
    "_": "000000000000111", "/": "001001010100100", ".": "000000000000010",
    "-": "000000111000000", " ": "000000000000000",
}


def _draw_text(img, text: str, top: int, left: int, scale: int, color) -> None:
  """Draws ``text`` into the ``(H, W, 3)`` uint8 image, clipped at its edges."""
  for n, ch in enumerate(text.lower()):
    glyph = _FONT.get(ch, "111111111111111")  # a filled box for a character it lacks
    bits = np.array([int(b) for b in glyph], bool).reshape(5, 3)
    block = np.kron(bits, np.ones((scale, scale), bool))
    y0, x0 = top, left + n * 4 * scale
    h = max(0, min(block.shape[0], img.shape[0] - y0))
    w = max(0, min(block.shape[1], img.shape[1] - x0))
    if h and w:
      img[y0:y0 + h, x0:x0 + w][block[:h, :w]] = color


def _colour(values: np.ndarray) -> np.ndarray:
  """Maps values in [-1, 1] to RGB: blue below zero, white at zero, red above."""
  v = np.clip(np.nan_to_num(values), -1.0, 1.0)[..., None]
  white = np.array([255.0, 255.0, 255.0])
  red = np.array([178.0, 24.0, 43.0])
  blue = np.array([33.0, 102.0, 172.0])
  rgb = np.where(v >= 0, white + v * (red - white), white + (-v) * (blue - white))
  return rgb.astype(np.uint8)


def _png_bytes(img: np.ndarray) -> bytes:
  """Encodes an ``(H, W, 3)`` uint8 image as an 8-bit RGB PNG."""
  height, width, _ = img.shape

  def chunk(kind: bytes, data: bytes) -> bytes:
    body = kind + data
    return struct.pack(">I", len(data)) + body + struct.pack(">I", zlib.crc32(body) & 0xFFFFFFFF)

  # Each scanline starts with filter type 0 (none).
  raw = b"".join(b"\x00" + img[row].tobytes() for row in range(height))
  header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
  return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw, 9))
          + chunk(b"IEND", b""))


def write_heatmap_png(path, grid, row_labels: Sequence[str], col_labels: Sequence[str], *,
                      cell: int = 36) -> None:
  """Writes ``grid`` (values in [-1, 1]) as a labelled heatmap PNG.

  Args:
    path: the file to write.
    grid: a 2-D array, one row per site and one column per position.
    row_labels: a label per row, drawn at the left.
    col_labels: a label per column, drawn above.
    cell: the side of one cell in pixels.
  """
  grid = np.asarray(grid, np.float64)
  rows, cols = grid.shape
  scale = 2
  char_w = 4 * scale
  left = 8 + char_w * max(len(s) for s in row_labels)
  top = 8 + 7 * scale
  img = np.full((top + rows * cell + 8, left + cols * cell + 8, 3), 255, np.uint8)
  cells = np.kron(_colour(grid), np.ones((cell, cell, 1), np.uint8))
  img[top:top + rows * cell, left:left + cols * cell] = cells
  # Thin grey lines between cells.
  for r in range(rows + 1):
    img[min(top + r * cell, img.shape[0] - 1), left:left + cols * cell] = 200
  for c in range(cols + 1):
    img[top:top + rows * cell, min(left + c * cell, img.shape[1] - 1)] = 200
  black = np.array([0, 0, 0], np.uint8)
  for r, label in enumerate(row_labels):
    _draw_text(img, label, top + r * cell + (cell - 5 * scale) // 2, 4, scale, black)
  for c, label in enumerate(col_labels):
    width = len(label) * char_w - scale
    _draw_text(img, label, 4, left + c * cell + (cell - width) // 2, scale, black)
  with open(path, "wb") as f:
    f.write(_png_bytes(img))


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


def run_demo(*, steps: int = 300, batch: int = 128, seq_len: int = 10, vocab: int = 24,
             d_model: int = 64, n_layers: int = 2, n_heads: int = 4, lr: float = 3e-3,
             seed: int = 0, marker_at: int = 3, top: int = 5, out="patching_heatmap.png",
             progress: TextIO | None = None) -> DemoResult:
  """Trains the model, runs the sweep, writes the heatmap; see the module docstring."""
  import optax  # a test dependency; imported here so that `import jaxlens.demo` never needs it

  import jaxlens as jl
  from jaxlens.models import GPT

  if not 0 <= marker_at <= seq_len - 3:
    raise jl.InvalidArgumentError(
        f"marker_at={marker_at} must leave the answer and a later query position in a "
        f"sequence of length {seq_len}", code="invalid_argument",
        fix=f"--marker-at between 0 and {seq_len - 3}")
  model = GPT(vocab_size=vocab, d_model=d_model, n_heads=n_heads, n_layers=n_layers,
              max_len=seq_len, mlp_ratio=2)
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
    updates, state = opt.update(grads, state, p)
    return optax.apply_updates(p, updates), state, value

  @jax.jit
  def evaluate(p, tokens, answers, clean, corrupt):
    accuracy = (model.apply(p, tokens)[:, -1].argmax(-1) == answers).mean()
    return accuracy, metric(model.apply(p, clean)), metric(model.apply(p, corrupt))

  start = time.perf_counter()
  params, state, train_keys, (tokens, answers), pair = setup(jax.random.key(seed))
  clean, corrupt, ans_clean, ans_corrupt = pair
  metric = _LogitDiff(np.asarray(ans_clean), np.asarray(ans_corrupt))
  bar = ProgressBar(steps, progress if progress is not None else sys.stderr)
  losses = []
  for i in range(steps):
    params, state, value = step(params, state, train_keys, i)
    losses.append(float(value))
    bar.update(i + 1, losses[-1])
  bar.close()
  train_seconds = time.perf_counter() - start

  sites = ("embed",) + tuple(s for i in range(n_layers) for s in (f"block_{i}/attn",
                                                                  f"block_{i}"))
  start = time.perf_counter()
  raw = jl.sweep.patching_sweep(model, params, clean, corrupt, metric, sites=sites)
  accuracy, m_clean, m_corrupt = (float(v) for v in
                                  evaluate(params, tokens, answers, clean, corrupt))
  scores = (np.asarray(raw, np.float64) - m_corrupt) / (m_clean - m_corrupt)
  sweep_seconds = time.perf_counter() - start

  positions = tuple(range(seq_len))
  order = np.argsort(-scores, axis=None, kind="stable")[:top]
  best = tuple((sites[i // seq_len], int(i % seq_len), float(scores.flat[i])) for i in order)
  write_heatmap_png(out, scores, sites, [str(p) for p in positions])
  return DemoResult(tuple(losses), accuracy, sites, positions, scores, best, str(out),
                    train_seconds, sweep_seconds)


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
  p.add_argument("--marker-at", type=int, default=3,
                 help="the marker's position in the patched sequences (default 3)")
  p.add_argument("--top", type=int, default=5, help="how many top sites to print (default 5)")
  p.add_argument("--out", default="patching_heatmap.png",
                 help="the heatmap PNG to write (default patching_heatmap.png)")
  return p


def main(argv: Sequence[str] | None = None) -> int:
  """Runs the demo from command-line arguments; returns the exit status."""
  args = _parser().parse_args(argv)
  print(f"jaxlens demo: a {args.layers}-layer GPT (d_model {args.d_model}) learns to return the "
        f"token after a marker; {args.steps} steps of batch {args.batch}")
  start = time.perf_counter()
  result = run_demo(steps=args.steps, batch=args.batch, seq_len=args.seq_len, vocab=args.vocab,
                    d_model=args.d_model, n_layers=args.layers, n_heads=args.heads, lr=args.lr,
                    seed=args.seed, marker_at=args.marker_at, top=args.top, out=args.out)
  print(f"loss {result.losses[0]:.3f} -> {result.losses[-1]:.4f}, accuracy "
        f"{100 * result.accuracy:.1f}% (training {result.train_seconds:.1f}s)")
  print(f"patching sweep: {len(result.sites)} sites x {len(result.positions)} positions in one "
        f"jitted call ({result.sweep_seconds:.1f}s); the token after the marker is at position "
        f"{args.marker_at + 1}, the query at {args.seq_len - 1}")
  print("top sites (fraction of the clean logit difference restored):")
  for rank, (site, pos, score) in enumerate(result.top, 1):
    print(f"  {rank}. {site} @ position {pos}: {score:.2f}")
  print(f"heatmap: {result.png}  (total {time.perf_counter() - start:.1f}s)")
  return 0


if __name__ == "__main__":
  sys.exit(main())
