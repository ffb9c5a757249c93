"""jaxlens.train's cached prefix (``cache_prefix=True``): the frozen model runs up to the site
once per dataset, not once per step (issue 48 item 3).

On a tiny float64 language model (embedding, two hidden layers, unembedding; the site the
second hidden layer's output): cached training gives the uncached losses and parameters to
1e-12 for DAS (train_iit, at the last position) and LoReFT (train_reft); the cached step's
program has no products of the prefix (dead code, eliminated when it is lowered); and the
cases where a cache would be wrong are refused with ``prefix_not_cacheable``.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxlens as jl
from jaxlens import train as jt

V, D, S = 11, 8, 5
SITE = "layers_3"  # the second hidden layer's output: what follows reads only it
F64 = {"param_dtype": jnp.float64}


def _lm(mix=None):
  layers = [nn.Embed(V, D, **F64), nn.Dense(D, **F64), jnp.tanh]
  if mix is not None:
    layers.append(mix)
  layers += [nn.Dense(D, **F64), jnp.tanh, nn.Dense(V, **F64)]
  return nn.Sequential(layers)


@pytest.fixture(scope="module")
def lm():
  model = _lm()
  return model, model.init(jax.random.key(0), jnp.zeros((1, S), jnp.int32))


def _batches(n=2, b=4, seed=0):
  rng = np.random.default_rng(seed)
  return [
    {
      "base": rng.integers(0, V, (b, S)).astype(np.int32),
      "source": rng.integers(0, V, (b, S)).astype(np.int32),
      "label": rng.integers(0, V, (b,)).astype(np.int32),
    }
    for _ in range(n)
  ]


def _pairs(n=6, seed=1):
  rng = np.random.default_rng(seed)
  return [
    (rng.integers(1, V, 3).tolist(), rng.integers(1, V, 1 + i % 2).tolist()) for i in range(n)
  ]


def _close(a, b):
  return all(jax.tree.leaves(jax.tree.map(lambda x, y: bool(jnp.allclose(x, y, 0, 1e-12)), a, b)))


def test_cached_training_equals_uncached_for_das_and_loreft(lm):
  model, variables = lm
  das = jt.DAS(dim=2)
  params = das.init(jax.random.key(1), D, dtype=jnp.float64)
  kw = dict(steps=4, optimizer=optax.adam(0.05), positions=[S - 1], progress=False)
  batches = _batches()
  plain = jt.train_iit(model, variables, SITE, das, params, batches, **kw)
  cached = jt.train_iit(model, variables, SITE, das, params, batches, cache_prefix=True, **kw)
  assert len(plain.losses) == 4 and not _close(plain.params, params)  # it trained
  np.testing.assert_allclose(cached.losses, plain.losses, rtol=0, atol=1e-12)
  assert _close(cached.params, plain.params)

  reft = jt.LoReFT(rank=2)
  rparams = reft.init(jax.random.key(2), D, dtype=jnp.float64)
  kw = dict(steps=4, batch_size=4, optimizer=optax.adam(0.05), progress=False)
  pairs = _pairs()  # 6 pairs in batches of 4: the cache's last chunk is padded
  plain = jt.train_reft(model, variables, SITE, reft, rparams, pairs, **kw)
  cached = jt.train_reft(model, variables, SITE, reft, rparams, pairs, cache_prefix=True, **kw)
  assert len(plain.losses) == 4 and not _close(plain.params, rparams)
  np.testing.assert_allclose(cached.losses, plain.losses, rtol=0, atol=1e-12)
  assert _close(cached.params, plain.params)


def test_the_prefix_is_dead_code_in_the_cached_step(lm):
  """The prefix (two products: the first hidden layer and the site's own layer) is gone from
  the lowered program of the loss and its gradient: once for LoReFT, twice for DAS (the base
  run's and the source run's)."""
  model, variables = lm
  batch = _batches(1)[0]
  base, source, label = batch["base"], batch["source"], batch["label"]
  cache = {"base": jt.site_values(model, variables, SITE, base)}
  cache["source"] = jt.site_values(model, variables, SITE, source)
  assert cache["base"].shape == (4, S, D)

  def products(loss, params):
    text = jax.jit(jax.value_and_grad(loss)).lower(params, variables).as_text()
    return text.count("stablehlo.dot_general")

  das = jt.DAS(dim=2)
  dparams = das.init(jax.random.key(1), D, dtype=jnp.float64)

  def das_loss(cached):
    def loss(p, v):
      out = jt.intervened_output(
        model,
        v,
        SITE,
        das,
        p,
        base,
        source,
        positions=[S - 1],
        site_values=cache if cached else None,
      )
      return -jnp.mean(jax.nn.log_softmax(out[:, -1])[jnp.arange(4), label])

    return loss

  plain, cached = products(das_loss(False), dparams), products(das_loss(True), dparams)
  assert plain - cached == 4, (plain, cached)

  reft = jt.LoReFT(rank=2)
  rparams = reft.init(jax.random.key(2), D, dtype=jnp.float64)

  def reft_loss(cached):
    def loss(p, v):
      out = jt.intervened_output(
        model, v, SITE, reft, p, base, site_values={"base": cache["base"]} if cached else None
      )
      return jnp.mean(out)

    return loss

  plain, cached = products(reft_loss(False), rparams), products(reft_loss(True), rparams)
  assert plain - cached == 2, (plain, cached)


def test_cache_prefix_refuses_what_it_would_get_wrong(lm):
  model, variables = lm
  das = jt.DAS(dim=2)
  params = das.init(jax.random.key(1), D, dtype=jnp.float64)
  batches = _batches(1)
  kw = dict(steps=1, progress=False, cache_prefix=True)
  with pytest.raises(jl.InvalidArgumentError, match=r"\[prefix_not_cacheable\].*frozen=False"):
    jt.train_iit(model, variables, SITE, das, params, batches, frozen=False, **kw)
  with pytest.raises(jl.InvalidArgumentError, match=r"\[prefix_not_cacheable\].*fixed dataset"):
    jt.train_iit(model, variables, SITE, das, params, lambda step: batches[0], **kw)
  with pytest.raises(jl.InvalidArgumentError, match=r"site_values needs its \"source\""):
    jt.intervened_output(
      model,
      variables,
      SITE,
      das,
      params,
      batches[0]["base"],
      site_values={"base": jnp.zeros((4, S, D))},
    )
  with pytest.raises(jl.InvalidArgumentError, match=r"on base \(\"base\"\)"):
    jt.intervened_output(model, variables, SITE, das, params, batches[0]["base"], site_values=[])
  with pytest.raises(jl.InvalidArgumentError, match=r"\[prefix_not_cacheable\].*fires 2 times"):
    jt.train_iit(model, variables, jl.func("tanh"), das, params, batches, **kw)

  # Dropout before the site: the model draws random numbers.
  noisy = _lm(nn.Dropout(0.5, deterministic=True))
  noisy_vars = noisy.init(jax.random.key(0), jnp.zeros((1, S), jnp.int32))
  noisy = _lm(nn.Dropout(0.5, deterministic=False))
  with pytest.raises(jl.InvalidArgumentError, match=r"\[prefix_not_cacheable\].*random numbers"):
    jt.site_values(noisy, noisy_vars, "layers_4", batches[0]["base"])

  # A layer that mixes the rows of a batch before the site: ReFT's shuffled batches would
  # meet cached values computed beside other rows.
  mixing = _lm(lambda x: x - jnp.mean(x, axis=0, keepdims=True))
  mixing_vars = mixing.init(jax.random.key(0), jnp.zeros((1, S), jnp.int32))
  reft = jt.LoReFT(rank=2)
  rparams = reft.init(jax.random.key(2), D, dtype=jnp.float64)
  with pytest.raises(jl.InvalidArgumentError, match=r"\[prefix_not_cacheable\].*other examples"):
    jt.train_reft(mixing, mixing_vars, "layers_4", reft, rparams, _pairs(), batch_size=4, **kw)


def test_train_multi_and_iia_cached_equal_uncached(lm):
  """train_multi with two placements at two sites and two sources (the placement listed
  first runs second: the base's cache holds the site that runs first), and iia: cached ==
  uncached."""
  model, variables = lm
  das = jt.DAS(dim=2)
  params = {
    "late": das.init(jax.random.key(1), D, dtype=jnp.float64),
    "early": das.init(jax.random.key(2), D, dtype=jnp.float64),
  }
  ats = [
    jt.At(SITE, das, params="late", source=0, positions=[S - 1]),
    jt.At("layers_1", das, params="early", source=1, positions=[S - 2]),
  ]
  batches = [
    {"base": b["base"], "sources": [b["source"], b["base"][::-1]], "label": b["label"]}
    for b in _batches()
  ]
  kw = dict(steps=3, optimizer=optax.adam(0.05), progress=False)
  plain = jt.train_multi(model, variables, ats, params, batches, **kw)
  cached = jt.train_multi(model, variables, ats, params, batches, cache_prefix=True, **kw)
  assert not _close(plain.params, params)
  np.testing.assert_allclose(cached.losses, plain.losses, rtol=0, atol=1e-12)
  assert _close(cached.params, plain.params)
  with pytest.raises(jl.InvalidArgumentError, match=r"\[prefix_not_cacheable\].*frozen=False"):
    jt.train_multi(model, variables, ats, params, batches, frozen=False, cache_prefix=True, **kw)
  with pytest.raises(jl.InvalidArgumentError, match=r"\[prefix_not_cacheable\].*fixed dataset"):
    jt.train_multi(model, variables, ats, params, lambda s: batches[0], cache_prefix=True, **kw)

  # iia, its labels the uncached predictions on half of the rows (accuracy 1/2).
  evals = _batches(2, b=8, seed=4)
  p = plain.params["late"]
  kw = dict(positions=[S - 1])
  for b in evals:
    out = jt.intervened_output(model, variables, SITE, das, p, b["base"], b["source"], **kw)
    guess = np.asarray(jnp.argmax(out[:, -1], -1))
    b["label"] = np.where(np.arange(8) % 2, guess, (guess + 1) % V).astype(np.int32)
  want = jt.iia(model, variables, SITE, das, p, evals, **kw)
  got = jt.iia(model, variables, SITE, das, p, evals, cache_prefix=True, **kw)
  assert got == want == 0.5
  with pytest.raises(jl.InvalidArgumentError, match=r"\[prefix_not_cacheable\].*fires 2 times"):
    jt.iia(model, variables, jl.func("tanh"), das, p, evals, cache_prefix=True, **kw)
