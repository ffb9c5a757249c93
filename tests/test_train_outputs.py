"""The output at a few positions (``jt.intervened_output(output_positions=)``, and
``jt.train_reft``'s loss on the answer tokens only): on a zoo decoder whose site lies before
its last block, the last block and the unembedding run at those positions only; the values
are the whole output's, gathered (float64, 1e-12), and ReFT training gives the losses and
parameters of the loss over every position's logits.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxlens as jl
import jaxlens.models as jm
from jaxlens import train as jt

F64 = jnp.float64
V, S, B = 40, 8, 3


def _decoders():
  return {
    "gpt2": jm.GPT2(
      jm.GPT2Config(vocab_size=V, d_model=16, n_layers=2, n_heads=2, max_len=32, dtype=F64)
    ),
    # Rotary queries at their own positions, grouped keys, a sliding window of 3 tokens.
    "llama": jm.Llama(
      jm.LlamaConfig(
        vocab_size=V,
        d_model=16,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        d_mlp=24,
        sliding_window=3,
        max_len=32,
        dtype=F64,
      )
    ),
  }


@pytest.fixture(scope="module")
def decoders():
  # Random variables of the model's shapes (no compiled init: the tests' cost is compiling).
  tokens = jnp.zeros((1, S), jnp.int32)
  rng = np.random.default_rng(0)
  out = {}
  for k, m in _decoders().items():
    shapes = jax.eval_shape(m.init, jax.random.key(0), tokens)
    out[k] = (m, jax.tree.map(lambda a: jnp.asarray(0.3 * rng.normal(size=a.shape), F64), shapes))
  return out


def _close(a, b, atol=1e-12):
  return all(jax.tree.leaves(jax.tree.map(lambda x, y: bool(jnp.allclose(x, y, 0, atol)), a, b)))


def _positions():
  rng = np.random.default_rng(0)
  return np.stack([np.sort(rng.choice(S, 3, replace=False)) for _ in range(B)]).astype(np.int32)


def test_output_at_positions_equals_the_whole_output_gathered(decoders):
  """On Llama (rotary queries at their own positions, grouped keys, a sliding window);
  GPT-2's, cached, through train_reft below."""
  model, variables = decoders["llama"]
  method = jt.LoReFT(rank=2)
  params = method.init(jax.random.key(1), 16, dtype=F64)
  tokens = jnp.asarray(np.random.default_rng(1).integers(0, V, (B, S)), jnp.int32)
  at = _positions()
  site = model.block_site(0, "resid_post")

  def run(positions):
    return jt.intervened_output(
      model, variables, site, method, params, tokens, output_positions=positions
    )

  # One program: the whole output and the output at the positions (the cached prefix's
  # outputs at positions: train_reft below).
  whole, got = jax.jit(lambda at: (run(None), run(at)))(at)
  assert got.shape == (B, 3, V)
  want = jnp.take_along_axis(whole, jnp.asarray(at)[..., None], axis=1)
  np.testing.assert_allclose(got, want, rtol=0, atol=1e-12)

  # The last block's products and the unembedding run on B * 3 rows, not B * S.
  fast = jax.jit(run).lower(at).as_text()
  assert f"tensor<{B}x{S}x{V}xf64>" not in fast and f"tensor<{B}x3x{V}xf64>" in fast
  # A site in the last block: the whole output, gathered.
  last = model.block_site(len(model.layer_sites()) - 1, "resid_pre")
  whole = jax.jit(
    lambda at: jt.intervened_output(
      model, variables, last, method, params, tokens, output_positions=at
    )
  )
  assert f"tensor<{B}x{S}x{V}xf64>" in whole.lower(at).as_text()


def test_train_reft_on_the_answer_positions_equals_the_loss_over_every_position(decoders):
  """train_reft against a plain optax loop whose loss reads every
  position's logits, weighted by answer_batch's weights: the same losses and parameters."""
  model, variables = decoders["gpt2"]
  rng = np.random.default_rng(2)
  pairs = [
    (rng.integers(1, V, 2 + i % 3).tolist(), rng.integers(1, V, 1 + i % 2).tolist())
    for i in range(6)
  ]
  method = jt.LoReFT(rank=2)
  params = method.init(jax.random.key(3), 16, dtype=F64)
  site = "blocks_0/resid_post"
  steps, opt = 3, optax.adam(0.05)
  kw = dict(steps=steps, batch_size=3, optimizer=opt, progress=False)
  # Cached (the uncached loss is the same function of the step's spec, and equals the
  # cached one in tests/test_train_cache.py).
  result = jt.train_reft(model, variables, site, method, params, pairs, cache_prefix=True, **kw)

  data = jt.answer_batch(pairs)
  assert 0 < data["weights"].sum(1).max() < data["weights"].shape[1]  # a few positions count

  tokens, targets, weights = (jnp.asarray(data[k]) for k in ("tokens", "targets", "weights"))

  def loss(p, idx):
    out = jl.when(site, jl.loreft(p)).bind(model)(variables, tokens[idx])
    logp = jax.nn.log_softmax(out)
    ce = -jnp.take_along_axis(logp, targets[idx][..., None], -1)[..., 0]
    w = weights[idx].astype(F64)
    return jnp.sum(ce * w) / jnp.maximum(jnp.sum(w), 1.0)

  p, state, losses = params, opt.init(params), []
  grad = jax.jit(jax.value_and_grad(loss))
  for step in range(steps):
    idx = np.random.default_rng([0, step // 2]).permutation(6)[(step % 2) * 3 : (step % 2 + 1) * 3]
    value, g = grad(p, idx)
    with jax.numpy_dtype_promotion("standard"):
      updates, state = opt.update(g, state, p)
    p = optax.apply_updates(p, updates)
    losses.append(float(value))
  np.testing.assert_allclose(result.losses, losses, rtol=0, atol=1e-12)
  assert _close(result.params, p)
  assert not _close(p, params)  # it trained


def test_output_positions_are_checked(decoders):
  model, variables = decoders["gpt2"]
  method = jt.LoReFT(rank=2)
  params = method.init(jax.random.key(1), 16, dtype=F64)
  tokens = jnp.zeros((B, S), jnp.int32)
  site = "blocks_0/resid_post"
  with pytest.raises(jl.ShapeError, match=r"\[shape_mismatch\].*\(batch, k\) int array"):
    jt.intervened_output(
      model, variables, site, method, params, tokens, output_positions=np.zeros((B,), np.int32)
    )
  with pytest.raises(jl.ShapeError, match=r"\[shape_mismatch\].*\(batch, k\) int array"):
    jt.intervened_output(
      model, variables, site, method, params, tokens, output_positions=np.zeros((B, 2))
    )
  with pytest.raises(jl.InvalidArgumentError, match=r"\[index_out_of_range\].*\[0, 8\)"):
    jt.intervened_output(
      model, variables, site, method, params, tokens, output_positions=np.full((B, 2), S)
    )
  # A concrete array closed over by a jitted function is checked too (on the host).
  outside = jnp.full((B, 2), -1, jnp.int32)
  with pytest.raises(jl.InvalidArgumentError, match=r"\[index_out_of_range\].*from -1 to -1"):
    jax.jit(
      lambda: jt.intervened_output(
        model, variables, site, method, params, tokens, output_positions=outside
      )
    )()


def test_train_iit_reads_the_last_position_only(decoders):
  """train_iit's default readout on a zoo decoder computes the output at the last position
  alone: the losses and parameters of SGD on a loss that reads it from the whole output."""
  model, variables = decoders["gpt2"]
  rng = np.random.default_rng(4)
  batch = {
    "base": rng.integers(0, V, (B, S)).astype(np.int32),
    "source": rng.integers(0, V, (B, S)).astype(np.int32),
    "label": rng.integers(0, V, (B,)).astype(np.int32),
  }
  das = jt.DAS(dim=4)
  params = das.init(jax.random.key(5), 16, dtype=F64)
  site = "blocks_0/resid_post"
  # SGD: adam's first steps divide by |gradient| + 1e-8, which turns a rounding difference
  # of a gradient entry near 1e-8 into a thousand times larger difference in the update.
  fast = jt.train_iit(
    model,
    variables,
    site,
    das,
    params,
    [batch],
    steps=2,
    optimizer=optax.sgd(1.0),
    positions=[S - 2],
    progress=False,
  )

  @jax.jit
  def grad(p):
    def loss(p):
      out = jt.intervened_output(
        model, variables, site, das, p, batch["base"], batch["source"], positions=[S - 2]
      )
      logp = jax.nn.log_softmax(out[:, -1])  # the whole output's last position
      return -jnp.mean(jnp.take_along_axis(logp, jnp.asarray(batch["label"])[:, None], 1))

    return jax.value_and_grad(loss)(p)

  p, losses = params, []
  for _ in range(2):
    value, g = grad(p)
    p = jax.tree.map(lambda a, b: a - b, p, g)  # the rotation's base gets no gradient
    losses.append(float(value))
  np.testing.assert_allclose(fast.losses, losses, rtol=0, atol=1e-12)
  assert _close(fast.params, p) and not _close(p, params)
