"""DAS and Boundless DAS find the causal variable of hierarchical equality in an MLP trained here.

``PYTHONPATH=. python examples/das_hierarchical_equality.py``

The task (Geiger et al.): four shapes ``a, b, c, d``; the label is ``(a == b) == (c == d)``.
As in the DAS paper's trained network (pyvene's ``DAS_Main_Introduction`` tutorial), every
example draws fresh random vectors (uniform in ``[-1, 1]``), so the network must compute
equality rather than memorise a vocabulary. The shapes are 2-d here; an MLP
(8 -> 32 -> 32 -> 2, ReLU) learns the task to ~99.5%.

The causal model has two intermediate variables, ``V1 = (a == b)`` and ``V2 = (c == d)``.
Interchange intervention training aligns V1 with a learned subspace of a site: the base runs
with the site's subspace taken from a source input, and the counterfactual label is
``V1(source) == V2(base)``.

Where V1 lives, and how small it can be: at the first hidden layer (``layers_0``, before its
ReLU) the site is ``W_a a + W_b b + W_c c + W_d d``, so everything it holds about V1 is in the
span of ``W_a`` and ``W_b`` (``2 * EMBED`` = 4 coordinates), or in 2 if the layer reads the
difference ``a - b``. DAS finds V1 there with 2 of the 32 coordinates (1 is not enough), and
Boundless DAS, started from a small boundary, learns a boundary of 2.5-3.5 coordinates. At the
logits (``layers_4``) V1 is not separable from the output (the counterfactual label is
independent of the base's and the source's outputs): IIA stays at chance (0.5) for both.
"""

from __future__ import annotations

import argparse
import json
import math
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from jaxlens import train as jt

EMBED, HIDDEN = 2, 32
RIGHT, WRONG = "layers_0", "layers_4"  # the first hidden layer; the logits

# Boundless DAS for a 32-feature layer. The paper's schedule (50 -> 0.1, boundary 0.5) is for
# layers of thousands of features: over 32 a mask at temperature 50 is flat. Starting at
# temperature 0.5 keeps the mask's edge under a coordinate wide. Starting the boundary small
# (2.5 coordinates) lets the rotation put V1 in the first coordinates and the boundary grow
# only if the loss asks for it; started at half the layer, the rotation spreads V1 over every
# coordinate inside the mask first and the boundary stays at 5-10 coordinates. The penalty
# weight 3 makes each coordinate cost 3/32 nats of cross-entropy.
BOUNDLESS = dict(temperature_start=0.5, temperature_end=0.1, boundary=2.5 / HIDDEN)
BOUNDARY_WEIGHT = 3.0


def sample(key, n):
  """``n`` inputs with ``V1`` and ``V2`` each true half of the time: ``(x, v1, v2)``."""
  ks = jax.random.split(key, 6)
  a, b, c, d = (jax.random.uniform(k, (n, EMBED), jnp.float32, -1.0, 1.0) for k in ks[:4])
  v1 = jax.random.bernoulli(ks[4], 0.5, (n,))
  v2 = jax.random.bernoulli(ks[5], 0.5, (n,))
  b = jnp.where(v1[:, None], a, b)
  d = jnp.where(v2[:, None], c, d)
  return jnp.concatenate([a, b, c, d], -1), v1, v2


def train_model(steps=3000, seed=0, batch=256):
  """The MLP trained on the task (one jitted ``lax.scan``); returns ``(model, variables,
  accuracy)``."""
  model = nn.Sequential([nn.Dense(HIDDEN), nn.relu, nn.Dense(HIDDEN), nn.relu, nn.Dense(2)])
  variables = model.init(jax.random.key(seed + 1), jnp.zeros((1, 4 * EMBED), jnp.float32))
  opt = optax.adam(3e-3)

  def loss(v, key):
    x, v1, v2 = sample(key, batch)
    logp = jax.nn.log_softmax(model.apply(v, x))
    return -jnp.mean(jnp.take_along_axis(logp, (v1 == v2).astype(jnp.int32)[:, None], 1))

  @jax.jit
  def train(v):
    def body(carry, key):
      v, state = carry
      g = jax.grad(loss)(v, key)
      with jax.numpy_dtype_promotion("standard"):
        updates, state = opt.update(g, state, v)
      return (optax.apply_updates(v, updates), state), None

    with jax.numpy_dtype_promotion("standard"):
      state = opt.init(v)
    keys = jax.random.split(jax.random.key(seed + 2), steps)
    return jax.lax.scan(body, (v, state), keys)[0][0]

  variables = train(variables)
  x, v1, v2 = sample(jax.random.key(seed + 9), 2000)
  guess = jnp.argmax(model.apply(variables, x), -1).astype(jnp.int32)
  accuracy = float(jnp.mean(guess == (v1 == v2).astype(jnp.int32)))
  return model, variables, accuracy


def interchange_batch(key, n):
  """Base and source inputs with the counterfactual label of interchanging V1."""
  kb, ks = jax.random.split(key)
  xb, _, b2 = sample(kb, n)
  xs, s1, _ = sample(ks, n)
  return {"base": xb, "source": xs, "label": (s1 == b2).astype(jnp.int32)}


def data(seed=0, batches=16, batch=256, test=2000):
  """``(train_batches, test_batch)`` of interchange examples."""
  keys = jax.random.split(jax.random.key(seed + 3), batches)
  return [interchange_batch(k, batch) for k in keys], interchange_batch(
    jax.random.key(seed + 4), test
  )


def das(model, variables, site, dim, batches, test, steps, seed=0, progress=False):
  """Fixed-dimension DAS at ``site``; returns its IIA on ``test``."""
  width = 2 if site == WRONG else HIDDEN
  method = jt.DAS(dim=dim)
  params = method.init(jax.random.key(seed + 5), width)
  result = jt.train_iit(
    model,
    variables,
    site,
    method,
    params,
    batches,
    steps=steps,
    optimizer=optax.adam(1e-2),
    progress=progress,
  )
  return jt.iia(model, variables, site, method, result.params, test)


def boundless(model, variables, site, batches, test, steps, seed=0, progress=False):
  """Boundless DAS at ``site``; returns ``(iia, learned size in coordinates)``."""
  width = 2 if site == WRONG else HIDDEN
  method = jt.BoundlessDAS(**BOUNDLESS)
  params = method.init(jax.random.key(seed + 6), width)
  result = jt.train_iit(
    model,
    variables,
    site,
    method,
    params,
    batches,
    steps=steps,
    optimizer=optax.adam(1e-2),
    boundary_weight=BOUNDARY_WEIGHT,
    progress=progress,
  )
  iia = jt.iia(model, variables, site, method, result.params, test)
  return iia, method.size(result.params)


def run(
  model_steps=3000,
  das_steps=300,
  boundless_steps=1000,
  wrong_steps=None,
  seed=0,
  dims=(1, 2),
  progress=False,
):
  """Trains the model, DAS at two sites (and at ``dims`` at the right one), Boundless DAS at
  both sites, and DAS with as many coordinates as Boundless DAS learned; returns the figures.

  ``wrong_steps`` (default ``min(das_steps, 60)``) is the number of steps at the logits: with
  more, DAS there fits the training pairs' logit magnitudes and its test IIA drifts from 0.5
  in either direction (0.42 after 300 steps), which is no variable either.
  """
  t0 = time.perf_counter()
  wrong_steps = min(das_steps, 60) if wrong_steps is None else wrong_steps
  model, variables, accuracy = train_model(model_steps, seed)
  batches, test = data(seed)
  out = {"model_accuracy": accuracy}
  for dim in dims:
    out[f"das_iia_{RIGHT}_dim{dim}"] = das(
      model, variables, RIGHT, dim, batches, test, das_steps, seed, progress
    )
  out[f"das_iia_{WRONG}"] = das(model, variables, WRONG, 1, batches, test, wrong_steps, seed)
  iia, size = boundless(model, variables, RIGHT, batches, test, boundless_steps, seed, progress)
  out["boundless_iia"], out["boundless_size"] = iia, size
  # The same number of coordinates as a fixed DAS dimension (coordinate 0 counts half in the
  # boundary mask, so a size of 3.5 interchanges about 3 coordinates).
  k = max(1, math.floor(size))
  out["das_dim_of_boundless"] = k
  out["das_iia_at_boundless_dim"] = (
    out[f"das_iia_{RIGHT}_dim{k}"]
    if k in dims
    else das(model, variables, RIGHT, k, batches, test, das_steps, seed)
  )
  out[f"boundless_iia_{WRONG}"] = boundless(
    model, variables, WRONG, batches, test, wrong_steps, seed
  )[0]
  out["seconds"] = round(time.perf_counter() - t0, 1)
  return out


def main(argv=None):
  """The command line: ``run`` with its step counts; prints and returns the figures."""
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--model-steps", type=int, default=3000)
  parser.add_argument("--das-steps", type=int, default=300)
  parser.add_argument("--boundless-steps", type=int, default=1000)
  args = parser.parse_args(argv)
  result = run(
    model_steps=args.model_steps,
    das_steps=args.das_steps,
    boundless_steps=args.boundless_steps,
    seed=args.seed,
    progress=True,
  )
  print(json.dumps(result, indent=2))
  return result


if __name__ == "__main__":
  main()
