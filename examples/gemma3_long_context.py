"""Gemma 3 270M past its sliding window (512 tokens), on the model from the PyPI wheels.

Two checks too long for the test suite (tests/test_gemma3_real.py checks the same mechanisms
on short prompts, tests/test_zoo_window.py on a tiny config with a window of 3):

1. Induction over a random token sequence repeated twice (2 x 600 tokens, longer than the
   window): the second copy is predicted far better than the first, which needs the global
   layers to reach back 600 tokens and the local ones to be right too.
2. Generation with the KV cache several hundred tokens past the window: ``jl.generate``'s greedy
   tokens equal the uncached forward's argmax at every position (teacher forcing over the whole
   sequence), and each local layer's cache holds 512 entries however long the generation.

Usage::

  python examples/gemma3_long_context.py [--half 600] [--new 700] [--layers N]

``--layers N`` cuts the model after its first N blocks (``Pretrained.first_layers``): both checks
at a fraction of the compile time. The first 12 hold ten local layers and two global ones, and
predict the second copy (22.9 -> 4.2 nats a token over 2 x 12 tokens); the first 6 do not.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

import jaxlens as jl
import jaxlens.models as jm


def main(argv=None) -> dict:
  """Runs both checks (each asserts its claim); returns their figures."""
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--half", type=int, default=600, help="length of each copy")
  p.add_argument("--new", type=int, default=700, help="tokens to generate")
  p.add_argument("--layers", type=int, default=None, help="keep only the first N blocks")
  args = p.parse_args(argv)
  t0 = time.perf_counter()
  lm = jm.gemma3()
  if args.layers is not None:
    lm = lm.first_layers(args.layers)
  print(f"load: {time.perf_counter() - t0:.1f} s")
  forward = jax.jit(lm.model.apply)

  half = np.random.default_rng(0).integers(1000, 30000, size=args.half)
  x = jnp.asarray(np.concatenate([[2], half, half])[None], jnp.int32)
  logp = jax.nn.log_softmax(forward(lm.variables, x)[0, :-1])
  nll = -np.asarray(jnp.take_along_axis(logp, x[0, 1:, None], -1))[:, 0]
  k = args.half
  first, second = nll[1:k].mean(), nll[k + 1 :].mean()
  print(f"induction over 2 x {k} tokens: first copy {first:.2f} nats/token, second {second:.2f}")
  assert second < 0.3 * first

  prompt = lm.encode("Once upon a time, in a small village by the sea, there lived")
  t0 = time.perf_counter()
  out = jl.generate(lm.model, lm.variables, prompt, args.new)
  print(f"generated {args.new} tokens in {time.perf_counter() - t0:.1f} s")
  ids = jnp.concatenate([prompt, jnp.asarray(out.tokens, jnp.int32)], axis=1)
  logits = forward(lm.variables, ids)[0, prompt.shape[1] - 1 : -1]
  agree = np.asarray(jnp.argmax(logits, -1)) == np.asarray(out.tokens[0])
  total = ids.shape[1]
  print(
    f"sequence of {total} tokens (window {lm.config.sliding_window}): cached greedy = "
    f"uncached argmax at {agree.sum()} of {agree.size} positions"
  )
  assert agree.all()
  err = float(jnp.abs(logits - out.logits[0]).max() / jnp.abs(logits).max())
  print(f"max relative logit difference, cached vs uncached: {err:.2e}")
  cache = jax.eval_shape(
    lambda: lm.model.init(jax.random.key(0), jnp.zeros((1, total), jnp.int32), decode=True)
  )["cache"]
  local = {
    cache[f"blocks_{i}"]["attn"]["cached_key"].shape[1]
    for i in range(lm.config.n_layers)
    if lm.config.window(i)
  }
  glob = {
    cache[f"blocks_{i}"]["attn"]["cached_key"].shape[1]
    for i in range(lm.config.n_layers)
    if not lm.config.window(i)
  }
  print(f"cache entries per layer: local {sorted(local)}, global {sorted(glob)}")
  # a ring of the window's length (of the whole sequence when it is shorter than the window)
  assert local == {min(lm.config.sliding_window, total)} and glob == {total}
  print(lm.decode(out.tokens[0][:60]))
  return {
    "induction_nats": (float(first), float(second)),
    "tokens": total,
    "agree": int(agree.sum()),
    "max_relative_logit_difference": err,
    "cache_local": sorted(local),
    "cache_global": sorted(glob),
  }


if __name__ == "__main__":
  main()
