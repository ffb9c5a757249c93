"""Training through edits on a tiny GPT: three optax loops with an edit live in the model.

  python examples/train_through_edits.py [--steps 150]

(a) The whole model trains with a steering edit live at ``block_0``: the gradient
    reaches the parameters upstream of the edit (the embeddings, ``block_0``).
(b) The model is frozen and a steering vector is the only trained parameter: it is
    passed into ``jl.steer`` inside the loss, and learns to make the model answer a
    fixed token.
(c) The model trains with ``block_0/mlp`` zero-ablated in the loop; the ablated MLP
    gets an exactly-zero gradient, the rest learns the task without it.

It also shows ``keep_grad`` refusing a cutting edit in a train step, and a jitted
train step that takes the spec as an argument compiling once while the edit's
values (a magnitude, a direction) change at every step.

The task is the demo's (``jaxlens.demo``): predict the token after a marker.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import optax

import jaxlens as jl
from jaxlens.demo import make_batch
from jaxlens.intervention import keep_grad
from jaxlens.models import GPT

SEQ, VOCAB = 8, 16
MODEL = GPT(vocab_size=VOCAB, d_model=32, n_heads=2, n_layers=2, max_len=SEQ, mlp_ratio=2)


def cross_entropy(logits, labels):
  return optax.softmax_cross_entropy_with_integer_labels(logits[:, -1], labels).mean()


def train(loss, params, keys, lr=3e-3):
  """Adam on ``loss(params, tokens, answers)`` over one batch per key.

  Returns:
    ``(params, first loss, last loss)``.
  """
  opt = optax.adam(lr)

  @jax.jit
  def step(p, state, k):
    tokens, answers = make_batch(k, 64, SEQ, VOCAB)
    value, grads = jax.value_and_grad(loss)(p, tokens, answers)
    updates, state = opt.update(grads, state, p)
    return optax.apply_updates(p, updates), state, value

  state = opt.init(params)
  losses = []
  for k in keys:
    params, state, value = step(params, state, k)
    losses.append(float(value))
  return params, losses[0], sum(losses[-10:]) / len(losses[-10:])


def main(argv=None) -> dict:
  """Runs (a)-(c) and the recompilation check; returns their figures."""
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--steps", type=int, default=150)
  args = parser.parse_args(argv)
  keys = jax.random.split(jax.random.key(0), args.steps)
  init = jax.jit(MODEL.init)(jax.random.key(1), jnp.zeros((1, SEQ), jnp.int32))
  direction = jax.random.normal(jax.random.key(2), (32,))
  direction = direction / jnp.linalg.norm(direction)

  # (a) Train every parameter through a keeping edit (keep_grad checks it keeps).
  steered = jl.when(jl.module("block_0"), keep_grad(jl.steer(direction, 0.05))).bind(MODEL)
  loss_a = lambda p, t, a: cross_entropy(steered(p, t), a)
  trained, first, last = train(loss_a, init, keys)
  report = {"a": (first, last)}
  print(f"(a) whole model, steer at block_0 live:     loss {first:.3f} -> {last:.3f}")

  # (b) Freeze the model; the steering vector is the trained parameter. The goal: answer 5.
  target = 5

  def loss_b(vec, tokens, answers):
    del answers
    out = jl.when(jl.module("block_1"), jl.steer(vec, 1.0)).bind(MODEL)(trained, tokens)
    return cross_entropy(out, jnp.full((tokens.shape[0],), target))

  vec, first, last = train(loss_b, jnp.zeros((32,)), keys, lr=0.2)
  report["b"] = (first, last)
  print(
    f"(b) frozen model, trained steering vector:  loss {first:.3f} -> {last:.3f} "
    f"(|vec| = {float(jnp.linalg.norm(vec)):.2f})"
  )

  # (c) Train with block_0's MLP ablated in the loop.
  ablated = jl.when(jl.module("block_0/mlp"), jl.zero_ablate()).bind(MODEL)
  loss_c = lambda p, t, a: cross_entropy(ablated(p, t), a)
  grads = jax.jit(jax.grad(loss_c))(init, *make_batch(keys[0], 64, SEQ, VOCAB))
  mlp_grad = max(
    float(jnp.abs(g).max()) for g in jax.tree.leaves(grads["params"]["block_0"]["mlp"])
  )
  _, first, last = train(loss_c, init, keys)
  report["c"], report["ablated_mlp_gradient"] = (first, last), mlp_grad
  print(
    f"(c) whole model, block_0/mlp zero-ablated:  loss {first:.3f} -> {last:.3f} "
    f"(largest gradient reaching the ablated MLP: {mlp_grad})"
  )

  # keep_grad refuses a cutting edit where the gradient is needed.
  refused = jl.when(jl.module("block_0/mlp"), keep_grad(jl.zero_ablate())).bind(MODEL)
  try:
    jax.grad(
      lambda p: cross_entropy(
        refused(p, *make_batch(keys[0], 8, SEQ, VOCAB)[:1]), jnp.zeros((8,), jnp.int32)
      )
    )(init)
  except jl.GradientContractError as error:
    report["refused"] = error.code
    print(
      f"keep_grad(zero_ablate) refused: code {error.fields['code']}, fix: {error.fields['fix']}"
    )

  # The spec is an argument of the jitted step: new values do not recompile.
  traces = []
  opt = optax.adam(3e-3)

  @jax.jit
  def step(p, state, spec, k):
    traces.append(1)  # runs once per trace, not per call
    tokens, answers = make_batch(k, 64, SEQ, VOCAB)
    value, grads = jax.value_and_grad(
      lambda p_: cross_entropy(spec.bind(MODEL)(p_, tokens), answers)
    )(p)
    updates, state = opt.update(grads, state, p)
    return optax.apply_updates(p, updates), state, value

  params, state = init, opt.init(init)
  for i, k in enumerate(keys[:20]):
    spec = jl.when(jl.module("block_0"), jl.steer(jnp.roll(direction, i), 0.1 * i))
    params, state, _ = step(params, state, spec, k)
  print(f"20 steps with a new steering direction and magnitude each: traced {len(traces)} time")
  report["traces"] = len(traces)
  return report


if __name__ == "__main__":
  main()
