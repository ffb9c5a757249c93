"""jaxlens.sae.train: every architecture learns, schedules, dead features, checkpoints with
identical resume, data parallel over a mesh, transcoders from a store, CE loss recovered."""

import dataclasses

import numpy as np
import optax
import pytest

import jax
import jax.numpy as jnp

import jaxlens as jl
from jaxlens import sae
from jaxlens.sae import train as st

D, F_TRUE, ROWS = 16, 48, 128
_FEATURES = np.random.default_rng(0).normal(size=(F_TRUE, D)).astype(np.float32)


def data(n, seed=0, rows=ROWS):
  """Sparse combinations of fixed ground-truth directions."""
  rng = np.random.default_rng(seed)
  for _ in range(n):
    coef = (rng.random((rows, F_TRUE)) < 0.06) * rng.exponential(1.0, (rows, F_TRUE))
    yield (coef @ _FEATURES).astype(np.float32)


ARCHS = {
  "relu": dict(l1_coefficient=0.2),
  "topk": dict(k=4),
  "batchtopk": dict(k=4.0),
  "jumprelu": dict(l0_coefficient=0.02),
}


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_every_architecture_learns(arch):
  cfg = st.TrainConfig(d_sae=64, architecture=arch, lr=3e-3, **ARCHS[arch])
  result = st.train(data(120), cfg, steps=120, progress=False, log_every=20)
  m = result.metrics
  assert list(m["step"]) == list(range(1, 121))
  assert m["mse_loss"][-1] < 0.5 * m["mse_loss"][0]
  assert m["explained_variance"][-1] > 0.7
  if arch in ("topk", "batchtopk"):
    assert m["l0"][-1] == pytest.approx(4.0, abs=0.01)
  d = result.inference()
  x = next(data(1, seed=9))
  assert float(st.explained_variance(x, d(x))) > 0.6
  if arch == "batchtopk":
    assert d.activation == "jumprelu"
    assert 1.0 < float(jnp.mean(jnp.sum(d.encode(x) != 0, -1))) < 12.0


def test_schedules_decoder_normalisation_and_dead_features():
  cfg = st.TrainConfig(d_sae=32, architecture="relu", lr=1e-2, lr_warm_up_steps=4, lr_decay_steps=4)
  schedule = st._schedule(cfg, 20)
  assert float(schedule(0)) == pytest.approx(1e-2 / 4)
  assert float(schedule(3)) == pytest.approx(1e-2)
  assert float(schedule(10)) == pytest.approx(1e-2)
  assert float(schedule(20)) == pytest.approx(0.0, abs=1e-9)
  warm = st.TrainConfig(
    d_sae=32, architecture="relu", l1_coefficient=2.0, coefficient_warm_up_steps=4
  )
  assert float(st._coefficient(warm, jnp.asarray(0))) == 0.0
  assert float(st._coefficient(warm, jnp.asarray(2))) == pytest.approx(1.0)
  assert float(st._coefficient(warm, jnp.asarray(9))) == pytest.approx(2.0)
  # One feature that can never fire is counted dead after the window.
  cfg = st.TrainConfig(
    d_sae=32, architecture="topk", k=3, dead_feature_window=5, normalize_decoder=True, lr=1e-3
  )
  first = next(data(1))
  d = st.init_dictionary(jax.random.key(0), cfg, jnp.asarray(first))
  d = d.replace(W_enc=d.W_enc.at[:, 7].set(0.0), b_enc=d.b_enc.at[7].set(-1e6))
  result = st.train(data(12), cfg, steps=12, init=d, progress=False, log_every=1)
  assert int(result.state.since_fired[7]) == 12
  assert result.metrics["dead_fraction"][6] >= 1 / 32
  assert result.metrics["auxiliary_reconstruction_loss"][-1] > 0
  np.testing.assert_allclose(jnp.linalg.norm(result.sae.W_dec, axis=-1), 1.0, rtol=1e-5)
  # b_dec starts at the first batch's mean.
  np.testing.assert_allclose(d.b_dec, first.mean(0), rtol=1e-5, atol=1e-6)


class Crash(Exception):
  pass


def _crashing(n, at):
  for i, batch in enumerate(data(n)):
    if i == at:
      raise Crash
    yield batch


def test_checkpoint_resume_is_identical(tmp_path):
  cfg = st.TrainConfig(d_sae=32, architecture="batchtopk", k=3.0, lr=3e-3)
  whole = st.train(data(25), cfg, steps=25, progress=False, log_every=5)
  with pytest.raises(Crash):
    st.train(
      _crashing(25, 13),
      cfg,
      steps=25,
      progress=False,
      log_every=5,
      checkpoint_dir=tmp_path / "ck",
      checkpoint_every=5,
    )
  # Orbax's layout: one directory per saved step (the last two kept), the state and a JSON
  # item; and the lock file of the run that has it open.
  assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == [".jaxlens-lock", "10", "5"]
  assert sorted(
    p.name for p in (tmp_path / "ck" / "10").iterdir() if "meta" in p.name or "state" in p.name
  ) == ["meta", "state"]
  resumed = st.train(
    data(25),
    cfg,
    steps=25,
    progress=True,
    log_every=5,
    checkpoint_dir=tmp_path / "ck",
    checkpoint_every=5,
  )
  for a, b in zip(jax.tree.leaves(whole.state), jax.tree.leaves(resumed.state)):
    np.testing.assert_array_equal(a, b)
  np.testing.assert_array_equal(whole.metrics["mse_loss"], resumed.metrics["mse_loss"])
  other = st.TrainConfig(d_sae=32, architecture="relu")
  with pytest.raises(sae.SAEError, match=r"\[sae_checkpoint_mismatch\]"):
    st.train(data(2), other, steps=2, progress=False, checkpoint_dir=tmp_path / "ck")
  wider = st.TrainConfig(d_sae=48, architecture="batchtopk", k=3.0, lr=3e-3)  # same structure
  with pytest.raises(sae.SAEError, match=r"\[sae_checkpoint_mismatch\]"):
    st.train(data(2), wider, steps=2, progress=False, checkpoint_dir=tmp_path / "ck")


@pytest.mark.parametrize("kind", ["Auto", "Explicit"])
def test_data_parallel_over_a_mesh_matches_one_device(kind):
  if jax.device_count() < 2:
    pytest.skip("needs two devices (tests/conftest.py sets several CPU devices)")
  axis_type = getattr(jax.sharding.AxisType, kind)
  mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2], axis_types=(axis_type,))
  cfg = st.TrainConfig(d_sae=32, architecture="topk", k=3, lr=3e-3)
  one = st.train(data(10), cfg, steps=10, progress=False)
  two = st.train(data(10), cfg, steps=10, progress=False, mesh=mesh)
  assert len(two.sae.W_enc.sharding.device_set) == 2
  np.testing.assert_allclose(two.sae.W_enc, one.sae.W_enc, rtol=1e-4, atol=1e-6)
  np.testing.assert_allclose(two.metrics["mse_loss"], one.metrics["mse_loss"], rtol=1e-5)


@pytest.fixture(scope="module")
def gpt_store(tmp_path_factory):
  from jaxlens.models import init_gpt

  model, variables, tokens = init_gpt(
    0, n_layers=1, d_model=D, n_heads=2, max_len=8, vocab_size=13, batch=8
  )
  batches = [jax.random.randint(jax.random.key(i), (8, 8), 0, 13) for i in range(6)]
  path = tmp_path_factory.mktemp("sae_store") / "acts"
  store = jl.store.collect(
    model, variables, batches, path, sites=["block_0/mlp/fc", "block_0/mlp"], progress=False
  )
  return model, variables, batches[0], store


def test_sae_and_transcoder_from_a_store(gpt_store):
  model, variables, tokens, store = gpt_store
  cfg = st.TrainConfig(d_sae=32, architecture="topk", k=4, lr=3e-3)
  batches = store.batches("block_0/mlp", batch_size=64, flatten=True)
  trained = st.train(batches, cfg, steps=6, progress=False, log_every=2)
  assert trained.sae.d_in == D and len(trained.metrics["step"]) == 6
  tcfg = st.TrainConfig(
    d_sae=32, architecture="relu", transcoder=True, skip=True, lr=3e-3, l1_coefficient=0.01
  )
  pairs = store.batches(["block_0/mlp/fc", "block_0/mlp"], batch_size=64, flatten=True)
  tc = st.train(pairs, tcfg, steps=12, progress=False, log_every=4)
  assert isinstance(tc.sae, sae.Transcoder) and tc.sae.W_skip.shape == (D, 4 * D)
  assert tc.metrics["mse_loss"][-1] < tc.metrics["mse_loss"][0]


def test_ce_loss_recovered_by_splicing(gpt_store):
  model, variables, tokens, _ = gpt_store
  eye = jnp.eye(D, dtype=jnp.float32)
  exact = sae.SAE(
    W_enc=jnp.concatenate([eye, -eye], 1),
    b_enc=jnp.zeros(2 * D, jnp.float32),
    W_dec=jnp.concatenate([eye, -eye], 0),
    b_dec=jnp.zeros(D, jnp.float32),
  )
  r = st.ce_loss_recovered(model, variables, tokens, "block_0/mlp", exact)
  assert r["loss_recovered"] == pytest.approx(1.0, abs=1e-4)
  assert r["ce_zero"] != pytest.approx(r["ce_clean"])
  useless = exact.replace(W_dec=jnp.zeros((2 * D, D), jnp.float32))
  r0 = st.ce_loss_recovered(model, variables, tokens, "block_0/mlp", useless)
  assert r0["loss_recovered"] == pytest.approx(0.0, abs=1e-4)


def test_training_refusals():
  with pytest.raises(sae.SAEError, match=r"\[sae_config_invalid\]") as info:
    st.TrainConfig(d_sae=8, architecture="matching_pursuit")
  assert info.value.fields["field"] == "architecture"
  with pytest.raises(sae.SAEError, match=r"\[sae_config_invalid\]"):
    st.TrainConfig(d_sae=0)
  with pytest.raises(sae.SAEError, match=r"\[sae_config_invalid\]") as info:
    st.TrainConfig(d_sae=8, architecture="topk", k=9)
  assert info.value.fields["field"] == "k"
  with pytest.raises(sae.SAEError, match=r"\[sae_config_invalid\]"):
    st.TrainConfig(d_sae=8, architecture="relu", b_dec_init="median")
  with pytest.raises(sae.SAEError, match=r"\[sae_config_invalid\]"):
    st.TrainConfig(d_sae=8, architecture="relu", skip=True)
  cfg = st.TrainConfig(d_sae=8, architecture="relu")
  with pytest.raises(sae.SAEError, match=r"\[sae_config_invalid\]"):
    st.train(data(1), cfg, steps=0)
  with pytest.raises(sae.SAEError, match=r"\[sae_batch_invalid\]"):
    st.train(iter([]), cfg, steps=1)
  with pytest.raises(sae.SAEError, match=r"\[sae_batch_invalid\]"):
    st.train([(np.zeros((4, 3)), np.zeros((4, 3)))], cfg, steps=1)
  tcfg = st.TrainConfig(d_sae=8, architecture="relu", transcoder=True)
  with pytest.raises(sae.SAEError, match=r"\[sae_batch_invalid\]"):
    st.train([np.zeros((4, 3), np.float32)], tcfg, steps=1)


def test_topk_sparse_step_equals_the_dense_formula():
  """The TopK step (custom VJPs over the k active rows and columns: slot-by-slot gathers and
  scatter-adds) against plain autodiff of the dense formula, with dead features (AuxK) and the
  rescaling: the loss, every gradient, and the parameters after one whole step (clipping and
  Adam) to 1e-12 in float64."""
  d_in, rows, d_sae, k = 6, 5, 40, 2
  cfg = st.TrainConfig(d_sae=d_sae, architecture="topk", k=k, rescale_acts_by_decoder_norm=True)
  keys = jax.random.split(jax.random.key(0), 4)
  d = sae.SAE.init(keys[0], d_in, d_sae, activation="topk", k=k, dtype=jnp.float64)
  d = d.replace(
    b_enc=jax.random.normal(keys[1], (d_sae,), jnp.float64) * 0.1,
    b_dec=jax.random.normal(keys[2], (d_in,), jnp.float64) * 0.1,
  )
  x = jax.random.normal(keys[3], (rows, d_in), jnp.float64)
  dead = jnp.arange(d_sae) % 3 == 0

  def dense(d):
    norm = jnp.linalg.norm(d.W_dec, axis=-1)
    pre = ((x - d.b_dec) @ d.W_enc + d.b_enc) * norm
    values, index = jax.lax.top_k(pre, k)
    acts = jnp.put_along_axis(jnp.zeros_like(pre), index, jax.nn.relu(values), -1, inplace=False)
    out = (acts / norm) @ d.W_dec + d.b_dec
    mse = jnp.mean(jnp.sum((out - x) ** 2, -1))
    top, index = jax.lax.top_k(jnp.where(dead, pre, -jnp.inf), d_in // 2)
    top = jnp.where(jnp.isfinite(top), top, 0.0)
    aux_acts = jnp.put_along_axis(jnp.zeros_like(pre), index, top, -1, inplace=False)
    recons = (aux_acts / norm) @ d.W_dec
    aux = jnp.mean(jnp.sum((recons - jax.lax.stop_gradient(x - out)) ** 2, -1))
    return mse + jnp.minimum(dead.sum() / (d_in // 2), 1.0) * aux

  tx = st.optimizer(cfg, 10)

  @jax.jit
  def both(d):
    ours = jax.value_and_grad(lambda d: st.loss_terms(d, cfg, x, dead=dead)[0])(d)
    ref = jax.value_and_grad(dense)(d)
    state = st.make_init(cfg, tx)(None, x, None, d)
    state = dataclasses.replace(state, since_fired=jnp.where(dead, 10**6, 0).astype(jnp.int32))
    stepped = st.make_step(cfg, tx)(state, x, None)[0].sae
    with jax.numpy_dtype_promotion("standard"):
      updates, _ = tx.update(ref[1], state.opt_state, d)
    return ours, ref, stepped, optax.apply_updates(d, updates)

  ours, ref, stepped, by_dense = both(d)
  np.testing.assert_allclose(ours[0], ref[0], rtol=1e-12)
  for name in ("W_enc", "b_enc", "W_dec", "b_dec"):
    a, b = getattr(ours[1], name), getattr(ref[1], name)
    assert float(jnp.abs(b).max()) > 0
    np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12, err_msg=name)
    moved = getattr(by_dense, name) - getattr(d, name)
    assert float(jnp.abs(moved).max()) > 0
    np.testing.assert_allclose(getattr(stepped, name), getattr(by_dense, name), rtol=0, atol=1e-12)
