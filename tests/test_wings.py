"""The training wings' checkpoints and data (issue 49, items 1, 2 and 5): a run that ends on a
checkpoint step and a finished run called again, damaged, mismatched, locked and unwritable
checkpoint directories (a real full disk, a real second process), non-finite batches and bad
arguments of ``jaxlens.train`` and ``jaxlens.sae.train``: each a result or a typed error."""

import contextlib
import dataclasses
import os
import resource
import signal
import threading

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxlens as jl
from jaxlens import sae, store
from jaxlens import train as jt
from jaxlens.internal import Checkpoints
from jaxlens.sae import train as st

D = 4


@pytest.fixture(scope="module")
def mlp():
  model = nn.Sequential(
    [nn.Dense(D, param_dtype=jnp.float64), jnp.tanh, nn.Dense(3, param_dtype=jnp.float64)]
  )
  return model, model.init(jax.random.key(1), jnp.zeros((2, 1, D), jnp.float64))


def _batches(n, nan_at=None):
  out = []
  for i, k in enumerate(jax.random.split(jax.random.key(0), n)):
    kb, ks = jax.random.split(k)
    base = jax.random.normal(kb, (4, 1, D), jnp.float64)
    source = jax.random.normal(ks, (4, 1, D), jnp.float64)
    if i == nan_at:
      base = base.at[1, 0, 2].set(jnp.nan)
    out.append({"base": base, "source": source, "label": (source[:, 0, 0] > 0).astype(jnp.int32)})
  return out


def _iit(mlp, batches, method=None, **kw):
  model, variables = mlp
  method = jt.LowRankDAS(rank=2) if method is None else method
  params = method.init(jax.random.key(0), D, jnp.float64)
  kw = {"optimizer": optax.adam(0.05), "progress": False, **kw}
  return jt.train_iit(model, variables, "layers_0", method, params, batches, **kw)


def test_a_run_ending_on_a_checkpoint_step_and_called_again_returns_its_result(mlp, tmp_path):
  ckpt = tmp_path / "ck"
  # 6 steps, a checkpoint every 3: the last step is a checkpoint step (orbax's
  # StepAlreadyExistsError before) and is saved once.
  first = _iit(mlp, _batches(3), steps=6, checkpoint=ckpt, checkpoint_every=3)
  assert first.step == 6 and len(first.losses) == 6
  assert sorted(p.name for p in ckpt.iterdir() if p.name.isdigit()) == ["3", "6"]
  again = _iit(mlp, _batches(3), steps=6, checkpoint=ckpt, checkpoint_every=3)
  assert again.step == 6 and again.losses == []
  for a, b in zip(jax.tree.leaves(first.params), jax.tree.leaves(again.params)):
    np.testing.assert_array_equal(a, b)
  # A checkpoint past the steps asked for is not returned as their result.
  with pytest.raises(jl.CheckpointError, match=r"\[checkpoint_mismatch\].*step 6, past this"):
    _iit(mlp, _batches(3), steps=4, checkpoint=ckpt, checkpoint_every=3)
  # Another method's parameters (rank 3) do not resume rank 2's checkpoint.
  with pytest.raises(jl.CheckpointError, match=r"\[checkpoint_mismatch\].*another configuration"):
    _iit(mlp, _batches(3), method=jt.LowRankDAS(rank=3), steps=7, checkpoint=ckpt)


def _saved(path, value=1.0):
  state = {"w": jax.random.normal(jax.random.key(0), (32, 32)) * value, "n": jnp.asarray(3)}
  with Checkpoints(path, 1) as c:
    c.save(1, state, {"consumed": 1})
  return state


def _damage(path, how):
  step = path / "1"
  if how == "meta deleted":
    os.remove(step / "meta" / "metadata")
    return
  # The largest file of the state is the array's bytes.
  files = [p for p in (step / "state").rglob("*") if p.is_file()]
  target = max(files, key=lambda p: p.stat().st_size)
  data = bytearray(target.read_bytes())
  if how == "state cut short":
    target.write_bytes(bytes(data[: len(data) // 2]))
  else:
    data[len(data) // 2] ^= 0x10
    target.write_bytes(bytes(data))


@pytest.mark.parametrize("how", ["state cut short", "meta deleted", "byte flipped"])
def test_a_damaged_checkpoint_is_checkpoint_corrupt_naming_the_step(tmp_path, how):
  state = _saved(tmp_path / "ck")
  _damage(tmp_path / "ck", how)
  with Checkpoints(tmp_path / "ck", 1) as c:
    with pytest.raises(jl.CheckpointError, match=r"\[checkpoint_corrupt\].*ck/1 is damaged"):
      c.restore(state)


def test_a_file_a_lock_and_a_bad_interval_are_typed(tmp_path):
  (tmp_path / "file").write_text("x")
  with pytest.raises(jl.CheckpointError, match=r"\[checkpoint_path_invalid\].*is a file"):
    Checkpoints(tmp_path / "file", 1)
  # A second run on the directory (another process, or another open file here: an flock is
  # held per open file, so the two behave alike) is refused while the first has it open.
  with Checkpoints(tmp_path / "ck", 1):
    with pytest.raises(jl.CheckpointError, match=r"\[checkpoint_locked\]"):
      Checkpoints(tmp_path / "ck", 1)
  with Checkpoints(tmp_path / "ck", 1):  # released on close
    pass
  with pytest.raises(jl.InvalidArgumentError, match=r"checkpoint_every must be a positive int"):
    Checkpoints(tmp_path / "ck", 0)


@contextlib.contextmanager
def _file_size_limit(size):
  """A real full disk for this process: writes past ``size`` bytes fail with ``EFBIG`` (the
  signal a file-size limit sends is ignored, so the write returns the error)."""
  soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
  handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
  resource.setrlimit(resource.RLIMIT_FSIZE, (size, hard))
  try:
    yield
  finally:
    resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    signal.signal(signal.SIGXFSZ, handler)


def _threads():
  return {t for t in threading.enumerate() if not t.daemon}


def test_a_real_full_disk_is_disk_full_keeps_the_last_checkpoint_and_leaves_no_thread(
  tmp_path, dense
):
  """Checkpoints and the store on a full disk (the library's real write errors): typed, what
  was complete is kept, and no thread is left that would keep the process from exiting
  (orbax's asynchronous saves left non-daemon threads waiting for minutes)."""
  state = _saved(tmp_path / "ck")
  bigger = {"w": state["w"] * 2, "n": state["n"]}
  before = _threads()
  with _file_size_limit(2000):
    with Checkpoints(tmp_path / "ck", 1) as c:
      with pytest.raises(jl.CheckpointError, match=r"\[disk_full\].*refused checkpoint 2"):
        c.save(2, bigger)
  assert _threads() <= before
  with Checkpoints(tmp_path / "ck", 1) as c:  # the checkpoint before is intact
    assert c.latest_step() == 1
    np.testing.assert_array_equal(c.restore(state)["w"], state["w"])
  assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == [".jaxlens-lock", "1"]
  # The store: batch 0's shard (2 rows) fits under the limit, batch 1's (200 rows) does not.
  model, v = dense
  rows = [np.ones((n, 3), np.float32) for n in (2, 200)]
  store.collect(model, v, rows, tmp_path / "warm", sites=["layers_0"], progress=False)
  with _file_size_limit(1500):  # (after the warm-up: nothing is compiled, or cached, under it)
    with pytest.raises(store.StoreError, match=r"\[disk_full\]"):
      store.collect(model, v, rows, tmp_path / "acts", sites=["layers_0"], progress=False)
  assert store.open(tmp_path / "acts").num_batches == 1
  assert not list((tmp_path / "acts").glob("*.tmp"))


def test_a_nan_batch_stops_train_iit_naming_it_and_the_checkpoint_keeps_the_steps_before(
  mlp, tmp_path
):
  ckpt = tmp_path / "ck"
  with pytest.raises(jl.InvalidArgumentError, match=r"\[batch_not_finite\] batch 2 \(step 2\)"):
    _iit(mlp, _batches(4, nan_at=2), steps=4, checkpoint=ckpt, checkpoint_every=1)
  with Checkpoints(ckpt, 1) as c:
    assert c.latest_step() == 2
  # Finite batches whose loss is not: a readout of infinite logits.
  with pytest.raises(jl.InvalidArgumentError, match=r"\[loss_not_finite\].*step 0 \(batch 0"):
    _iit(mlp, _batches(2), steps=2, readout=lambda out: out[:, -1] * jnp.inf)


@pytest.mark.parametrize(
  "kw, match",
  [
    ({"steps": 0}, "steps must be a positive int"),
    ({"steps": 2, "checkpoint_every": 0}, "checkpoint_every must be a positive int"),
    ({"batches": []}, "non-empty sequence of dicts"),
    ({"batches": {"base": 1}}, "non-empty sequence of dicts"),
    ({"batches": [{"base": 1, "source": 2}]}, r"the first lacks \['label'\]"),
  ],
)
def test_train_iit_refuses_bad_arguments(mlp, kw, match):
  kw = {"batches": _batches(1), **kw}
  with pytest.raises(jl.InvalidArgumentError, match=match):
    _iit(mlp, kw.pop("batches"), **kw)


def _mesh(n=2):
  return jax.make_mesh((n,), ("data",), devices=jax.devices()[:n])


def _labelled(label):
  return [{**b, "label": label} for b in _batches(1)]


@pytest.mark.parametrize(
  "call, code, match",
  [
    (lambda m: _iit(m, _labelled(jnp.zeros(3, jnp.int32))), "shape_mismatch", r"shape \(4,\)"),
    (lambda m: _iit(m, _labelled(jnp.zeros(4))), "shape_mismatch", "int class indices"),
    (lambda m: _iit(m, _labelled(jnp.full(4, 3))), "index_out_of_range", r"in \[0, 3\)"),
    (lambda m: _iit(m, _labelled(jnp.full(4, -1))), "index_out_of_range", "from -1 to -1"),
    (lambda m: _iit(m, _batches(1), optimizer="adam"), "invalid_argument", "optax"),
    (lambda m: _iit(m, _batches(1), readout=lambda out: None), "invalid_argument", "readout"),
    (
      lambda m: jt.train_iit(*m, "layers_0", jt.DAS(2), {}, _batches(1)),
      "invalid_argument",
      r"params lack \['rotation'\]",
    ),
    (lambda m: jt.iia(*m, "layers_0", jt.DAS(2), {}, []), "invalid_argument", "non-empty"),
    (
      lambda m: jt.iia(*m, "layers_0", jt.DAS(2), {}, [{"base": 1, "source": 1}]),
      "invalid_argument",
      r"lacks \['label'\]",
    ),
    (lambda m: jt.LoReFT(1).init(jax.random.key(0), -1), "invalid_argument", "positive int"),
    (lambda m: _iit(m, _batches(1), checkpoint=5), "checkpoint_path_invalid", "must be a path"),
    (lambda m: _iit(m, _batches(1), mesh="data"), "invalid_argument", "jax.sharding.Mesh"),
    (lambda m: _iit(m, _batches(1), mesh=_mesh(), data_axis="x"), "invalid_argument", "'x' is not"),
    (lambda m: _iit(m, _batches(1), mesh=_mesh(3)), "shape_mismatch", "4 rows, which do not split"),
  ],
)
def test_train_iit_and_iia_refuse_labels_optimisers_readouts_and_params_they_cannot_use(
  mlp, call, code, match
):
  with pytest.raises(jl.JaxlensError, match=match) as info:
    call(mlp)
  assert info.value.code == code


@pytest.mark.parametrize(
  "kw, code, match",
  [
    ({"batch_size": -1}, "invalid_argument", "batch_size must be a positive int"),
    ({"seed": 2**64}, "invalid_seed", r"seed must be an int in \[0, 2\*\*32\)"),
    ({"pairs": []}, "invalid_argument", "non-empty sequence"),
    ({"pairs": [([1, 2], [])]}, "invalid_argument", r"pairs\[0\] is not a"),
    ({"pairs": [([1, np.nan], [2])]}, "invalid_argument", r"pairs\[0\] holds a token id"),
    ({"pairs": [([1, 2], [2**40])]}, "invalid_argument", r"pairs\[0\] holds a token id"),
    ({"pairs": [([1, -1], [2])]}, "invalid_argument", r"pairs\[0\] holds a token id"),
    ({"steps": 1, "log_every": 1}, None, "unexpected keyword"),
    ({"pairs": [([[1, 2]], [3])]}, "invalid_argument", "not a flat list"),
    ({"pad_token": 1.5}, "invalid_argument", "pad_token must be a token id"),
    ({"pad_token": -1}, "invalid_argument", "pad_token must be a token id"),
    ({"method": jt.DAS(1)}, "invalid_argument", "DAS interchanges with a source run"),
  ],
)
def test_train_reft_refuses_bad_arguments(kw, code, match):
  model = nn.Dense(3)
  kw = {"pairs": [([1, 2], [3])], "steps": 1, **kw}
  error = TypeError if code is None else jl.InvalidArgumentError
  method = kw.pop("method", jt.LoReFT(1))
  with pytest.raises(error, match=match) as info:
    jt.train_reft(model, {}, "x", method, {}, kw.pop("pairs"), **kw)
  if code is not None:
    assert info.value.code == code


def _rows(n, bad=None, value=np.nan, rows=16):
  rng = np.random.default_rng(0)
  for i in range(n):
    x = rng.normal(size=(rows, 8)).astype(np.float32)
    if i == bad:
      x[3, 1] = value
    yield x


@pytest.mark.parametrize(
  "value, code",
  [(np.nan, "batch_not_finite"), (np.inf, "batch_not_finite"), (1e30, "loss_not_finite")],
)
def test_sae_training_stops_on_a_non_finite_batch_or_step_naming_it(tmp_path, value, code):
  cfg = st.TrainConfig(d_sae=8, architecture="relu", l1_coefficient=0.1, grad_clip=None)
  with pytest.raises(sae.SAEError, match=rf"\[{code}\]") as info:
    st.train(
      _rows(6, bad=3, value=value),
      cfg,
      steps=6,
      progress=False,
      log_every=2,
      checkpoint_dir=tmp_path / "ck",
      checkpoint_every=1,
    )
  assert info.value.fields["batch"] == 3 and info.value.fields["step"] == 4
  with Checkpoints(tmp_path / "ck", 1) as c:  # no checkpoint holds the bad step
    assert c.latest_step() == 3


def test_nonfinite_skip_drops_the_bad_batch_as_if_it_were_not_there_and_counts_it(mlp, tmp_path):
  """``nonfinite="skip"``: the bad step changes nothing, so the result is the one a run
  without that batch gives, bit for bit; the step is listed, and a resumed (here: finished)
  run keeps the list."""
  good = _batches(4)
  bad = _batches(4, nan_at=2)
  kw = dict(checkpoint=tmp_path / "iit", checkpoint_every=1, nonfinite="skip")
  skipped = _iit(mlp, bad, steps=4, **kw)
  without = _iit(mlp, [good[0], good[1], good[3]], steps=3)
  for a, b in zip(jax.tree.leaves(skipped.params), jax.tree.leaves(without.params), strict=True):
    np.testing.assert_array_equal(a, b)
  assert skipped.skipped == [{"batch": 2, "step": 2, "code": "batch_not_finite"}]
  assert skipped.step == 4 and skipped.losses == without.losses
  assert _iit(mlp, bad, steps=4, **kw).skipped == skipped.skipped  # from the checkpoint
  kw["nonfinite"] = "raise"  # (the finished run, called in the other mode, keeps the list)
  assert _iit(mlp, bad, steps=4, **kw).skipped == skipped.skipped

  cfg = st.TrainConfig(d_sae=8, architecture="relu", l1_coefficient=0.1, grad_clip=None)
  kw = dict(progress=False, log_every=2, checkpoint_dir=tmp_path / "sae", checkpoint_every=1)
  dropped = st.train(_rows(6, bad=3), cfg, steps=6, nonfinite="skip", **kw)
  rows = list(_rows(6))
  # (The same program: the data ends after 5 steps, and nothing is skipped.)
  plain = st.train(rows[:3] + rows[4:], cfg, steps=6, nonfinite="skip", progress=False)
  assert plain.skipped == [] and int(plain.state.step) == 5
  np.testing.assert_array_equal(dropped.sae.W_enc, plain.sae.W_enc)
  for a, b in zip(jax.tree.leaves(dropped.state.opt_state), jax.tree.leaves(plain.state.opt_state)):
    np.testing.assert_array_equal(a, b)
  assert dropped.skipped == [{"batch": 3, "step": 4, "code": "batch_not_finite"}]
  assert list(dropped.metrics["step"]) == [1, 2, 3, 5, 6]
  again = st.train(_rows(6, bad=3), cfg, steps=6, nonfinite="skip", **kw)
  assert again.skipped == dropped.skipped
  assert st.train(_rows(6, bad=3), cfg, steps=6, **kw).skipped == dropped.skipped
  with pytest.raises(jl.CheckpointError, match=r"\[checkpoint_mismatch\].*past this run's steps=5"):
    st.train(_rows(6, bad=3), cfg, steps=5, nonfinite="skip", **kw)


def test_train_reft_names_the_step_and_pairs_of_a_non_finite_loss_or_skips_them():
  """ReFT's batches are token ids (always finite): a token past the vocabulary reads a NaN
  embedding row, so that batch's loss is NaN; the error names the step and the pairs."""
  model = nn.Sequential(
    [nn.Embed(8, 4, param_dtype=jnp.float64), nn.Dense(8, param_dtype=jnp.float64)]
  )
  variables = model.init(jax.random.key(0), jnp.zeros((1, 3), jnp.int32))
  method = jt.LoReFT(1)
  params = method.init(jax.random.key(0), 4, jnp.float64)
  pairs = [([1, 2], [3]), ([2, 3], [4]), ([1, 9], [5]), ([3, 4], [5])]  # 9: past the vocabulary
  kw = dict(steps=4, batch_size=2, progress=False)
  with pytest.raises(jl.InvalidArgumentError, match=r"\[loss_not_finite\].*pairs \[") as info:
    jt.train_reft(model, variables, "layers_0", method, params, pairs, **kw)
  assert 2 in info.value.fields["pairs"] and info.value.fields["step"] == 0
  result = jt.train_reft(
    model, variables, "layers_0", method, params, pairs, nonfinite="skip", **kw
  )
  # Two epochs of two batches: pair 2 is in one batch of each.
  assert [r["step"] for r in result.skipped] == [0, 3]
  assert all(2 in r["pairs"] and r["code"] == "loss_not_finite" for r in result.skipped)
  assert len(result.losses) == 2 and np.isfinite(result.losses).all()
  assert all(np.isfinite(leaf).all() for leaf in jax.tree.leaves(result.params))


@pytest.mark.parametrize(
  "call",
  [
    lambda mlp: _iit(mlp, _batches(1), nonfinite="ignore"),
    lambda mlp: jt.train_reft(
      nn.Dense(3), {}, "x", jt.LoReFT(1), {}, [([1], [2])], steps=1, nonfinite=None
    ),
    lambda mlp: st.train(
      _rows(1), st.TrainConfig(d_sae=8, architecture="relu"), steps=1, nonfinite="x"
    ),
  ],
)
def test_nonfinite_is_raise_or_skip(mlp, call):
  with pytest.raises(jl.JaxlensError, match=r'nonfinite must be "raise" or "skip"'):
    call(mlp)


@pytest.mark.parametrize(
  "call, code, match",
  [
    (lambda cfg: st.train(_rows(2), cfg, steps=2, log_every=0), "sae_config_invalid", "log_every"),
    (
      lambda cfg: st.train(_rows(2), cfg, steps=2, checkpoint_every=0),
      "sae_config_invalid",
      "checkpoint_every",
    ),
    (
      lambda cfg: st.TrainConfig(d_sae=8, architecture="relu", dtype="float33"),
      "sae_config_invalid",
      "float33",
    ),
    (
      lambda cfg: st.train(_rows(2), cfg, steps=2, init=sae.SAE.init(jax.random.key(0), 6, 8)),
      "sae_shape_mismatch",
      "init's d_in is 6, the data's 8",
    ),
    (
      lambda cfg: st.train(_rows(2), cfg, steps=2, init=sae.SAE.init(jax.random.key(0), 8, 4)),
      "sae_config_invalid",
      "init has 4 features",
    ),
    (
      lambda cfg: st.train(
        _rows(2), cfg, steps=2, init=sae.SAE.init(jax.random.key(0), 8, 8, dtype=jnp.float64)
      ),
      "sae_config_invalid",
      "init's weights are float64, the config's dtype float32",
    ),
    (
      lambda cfg: st.train([np.ones((4, 8), np.int32)], cfg, steps=2),
      "sae_batch_invalid",
      "batch 0 must be a non-empty float array",
    ),
    (
      lambda cfg: st.train([np.ones((4, 8), np.float32), np.ones((4, 7))], cfg, steps=2),
      "sae_batch_invalid",
      "batch 1 has 7 features",
    ),
    (lambda cfg: st.train(None, cfg, steps=2), "sae_batch_invalid", "iterable of batches"),
    (lambda cfg: st.train(_rows(2), {"d_sae": 8}, steps=2), "sae_config_invalid", "TrainConfig"),
    (
      lambda cfg: st.train(_rows(2), dataclasses.replace(cfg, lr=float("nan")), steps=2),
      "sae_config_invalid",
      "lr: nan is not a finite number",
    ),
    (
      lambda cfg: st.train(_rows(2), dataclasses.replace(cfg, grad_clip=0.0), steps=2),
      "sae_config_invalid",
      "grad_clip",
    ),
    (
      lambda cfg: st.train(_rows(2), dataclasses.replace(cfg, seed=2**70), steps=2),
      "sae_config_invalid",
      r"seed: \d+ is not an int in \[0, 2\*\*32\)",
    ),
    (
      lambda cfg: st.train(_rows(2), cfg, steps=2, checkpoint_dir=3),
      "checkpoint_path_invalid",
      "must be a path",
    ),
    (lambda cfg: st.train(_rows(2), cfg, steps=2, mesh=_mesh(3)), "sae_batch_invalid", "16 rows"),
    (
      lambda cfg: st.train(_rows(2), cfg, steps=2, mesh=_mesh(), data_axis="x"),
      "sae_config_invalid",
      "'x' is not an axis",
    ),
  ],
)
def test_sae_train_refuses_bad_arguments(call, code, match):
  cfg = st.TrainConfig(d_sae=8, architecture="relu")
  with pytest.raises(jl.JaxlensError, match=match) as info:
    call(cfg)
  assert info.value.code == code


# --------------------------------------------------------------------------------------------
# The activation store knows what it holds.


def _data(n=3):
  for i in range(n):
    yield np.random.default_rng(i).normal(size=(2, 3)).astype(np.float32)


@pytest.fixture(scope="module")
def dense():
  model = nn.Sequential([nn.Dense(5)])
  return model, model.init(jax.random.key(0), jnp.zeros((1, 3), jnp.float32))


def _collect(dense, path):
  model, v = dense
  return store.collect(model, v, _data(), path, sites=["layers_0"], progress=False)


def test_a_shard_missing_or_damaged_in_a_complete_store_is_found_and_recollected(dense, tmp_path):
  want = _collect(dense, tmp_path / "ref").array("layers_0")
  path = tmp_path / "acts"
  _collect(dense, path)
  kept = (path / "shard_000002.safetensors").stat().st_mtime_ns
  (path / "shard_000001.safetensors").unlink()
  with pytest.raises(store.StoreError, match=r"\[store_corrupt\].*shards \[1\] are missing"):
    store.open(path)
  again = _collect(dense, path)  # recomputes shard 1 only
  np.testing.assert_array_equal(again.array("layers_0"), want)
  assert (path / "shard_000002.safetensors").stat().st_mtime_ns == kept
  # A flipped byte in a value: the shard's CRC-32 refuses it when read.
  shard = path / "shard_000000.safetensors"
  data = bytearray(shard.read_bytes())
  data[-3] ^= 0x40
  shard.write_bytes(bytes(data))
  with pytest.raises(store.StoreError, match=r"\[store_corrupt\].*differ from the CRC-32"):
    store.open(path).array("layers_0")
  # A shard cut short: collect recomputes it.
  shard.write_bytes(bytes(data[: len(data) // 2]))
  np.testing.assert_array_equal(_collect(dense, path).array("layers_0"), want)
  # A damaged COMPLETE marker, and a store.json nested too deep to parse.
  (path / "COMPLETE").write_text("three")
  with pytest.raises(store.StoreError, match=r"\[store_corrupt\].*does not hold a batch count"):
    store.open(path)
  (path / "COMPLETE").write_text("3\n")
  (path / "store.json").write_text("[" * 50000 + "]" * 50000)
  with pytest.raises(store.StoreError, match=r"\[store_corrupt\].*nested deeper"):
    store.open(path)


def test_store_arguments_are_checked_at_the_boundary(dense, tmp_path):
  model, v = dense
  s = _collect(dense, tmp_path / "acts")

  def collect(path=tmp_path / "new", **kw):
    return store.collect(model, v, _data(1), path, sites=["layers_0"], progress=False, **kw)

  cases = [
    (lambda: collect(max_pending=0), "invalid_argument", "max_pending must be a positive int"),
    (lambda: collect(num_batches=-1), "invalid_argument", "num_batches must be a positive int"),
    (lambda: collect(path=5), "store_path_invalid", "must be a str or os.PathLike"),
    (lambda: store.open(5), "store_path_invalid", "must be a str or os.PathLike"),
    (lambda: s.batch("0", "layers_0"), "index_out_of_range", "'0' is not an index"),
    (lambda: next(s.batches([])), "invalid_argument", "at least one site label"),
    (lambda: next(s.batches("layers_0", batch_size=True)), "invalid_argument", "batch_size"),
    (lambda: next(s.batches("layers_0", shuffle=True, seed=-1)), "invalid_seed", "seed"),
  ]
  for call, code, match in cases:
    with pytest.raises(jl.JaxlensError, match=match) as info:
      call()
    assert info.value.code == code
  assert not (tmp_path / "new").exists()  # refused before anything was written


# --------------------------------------------------------------------------------------------
# Dictionary files: a damaged Gemma Scope npz, a SAELens cfg.json nested too deep.


def test_a_damaged_gemma_scope_npz_and_a_deep_cfg_json_are_typed(tmp_path):
  rng = np.random.default_rng(0)
  params = {
    "W_enc": rng.normal(size=(4, 6)).astype(np.float32),
    "W_dec": rng.normal(size=(6, 4)).astype(np.float32),
    "b_enc": np.zeros(6, np.float32),
    "b_dec": np.zeros(4, np.float32),
    "threshold": np.zeros(6, np.float32),
  }
  np.savez_compressed(tmp_path / "params.npz", **params)
  whole = (tmp_path / "params.npz").read_bytes()
  assert sae.load_gemma_scope(tmp_path / "params.npz").d_sae == 6
  flipped = bytearray(whole)
  flipped[len(whole) // 3] ^= 0x08
  for damaged in (whole[: len(whole) // 2], bytes(flipped)):
    (tmp_path / "params.npz").write_bytes(damaged)
    with pytest.raises(sae.SAEError, match=r"\[sae_weights_invalid\].*not a readable npz"):
      sae.load_gemma_scope(tmp_path / "params.npz")
  d = sae.SAE.init(jax.random.key(0), 4, 6)
  sae.save_saelens(d, tmp_path / "dict")
  (tmp_path / "dict" / "cfg.json").write_text('{"a": ' + "[" * 30000 + "]" * 30000 + "}")
  with pytest.raises(sae.SAEError, match=r"\[sae_config_invalid\].*nested deeper"):
    sae.load_saelens(tmp_path / "dict")


# --------------------------------------------------------------------------------------------
# Arguments checked at the boundary: jl.generate and the sweeps.


@pytest.fixture(scope="module")
def decoder():
  from jaxlens.models import Llama, LlamaConfig

  model = Llama(LlamaConfig(vocab_size=16, d_model=8, n_layers=1, n_heads=2, n_kv_heads=1, d_mlp=8))
  tokens = jnp.asarray([[1, 2, 3]], jnp.int32)
  # Zeros of the parameters' shapes (no initialiser compiled): the checks need no trained model.
  shapes = jax.eval_shape(model.init, jax.random.key(0), tokens)
  return model, jax.tree.map(lambda a: np.zeros(a.shape, a.dtype), shapes), tokens


@pytest.mark.parametrize(
  "kw, code, match",
  [
    ({"prompt": [[1, 2], [3]]}, "not_left_padded", "not a rectangular array"),
    ({"prompt": [[1, 2**40]]}, "index_out_of_range", "does not fit in int32"),
    ({"seed": 2**64}, "invalid_seed", r"seed must be an int in \[0, 2\*\*32\)"),
    ({"seed": -1}, "invalid_seed", "seed must be an int"),
    ({"stop_tokens": (2**40,)}, "invalid_argument", "stop_tokens and pad_token"),
    ({"stop_tokens": 3}, "invalid_argument", "stop_tokens must be a sequence of token ids"),
    ({"pad_token": -3}, "invalid_argument", "stop_tokens and pad_token"),
    ({"temperature": "hot"}, "invalid_argument", "temperature must be a number"),
    ({"max_new_tokens": True}, "invalid_argument", "max_new_tokens must be a positive int"),
  ],
)
def test_generate_refuses_bad_arguments_before_tracing(decoder, kw, code, match):
  model, variables, tokens = decoder
  kw = {"prompt": tokens, **kw}
  with pytest.raises(jl.InvalidArgumentError, match=match) as info:
    jl.generate(model, variables, kw.pop("prompt"), **kw)
  assert info.value.code == code


@pytest.mark.parametrize("sweep", ["cone_sweep", "patching_sweep"])
def test_sweeps_refuse_a_metric_that_is_not_a_scalar_and_a_bad_batch_size(decoder, sweep):
  model, variables, tokens = decoder
  run = getattr(jl.sweep, sweep)
  corrupt = tokens.at[:, 0].set(5)
  for metric in (lambda out: None, lambda out: (out.sum(), out.mean()), lambda out: "x"):
    match = "metric returned a (NoneType|tuple|str)|metric returned shape"
    with pytest.raises(jl.ShapeError, match=match) as info:
      run(model, variables, tokens, corrupt, metric=metric)
    assert info.value.code == "metric_not_scalar"
  for size in (-1, 0, 1.5):
    with pytest.raises(jl.InvalidArgumentError, match="batch_size must be a positive int"):
      run(model, variables, tokens, corrupt, metric=lambda out: out.sum(), batch_size=size)


# --------------------------------------------------------------------------------------------
# jl.das takes a full rotation; parameters of every dtype initialise.


def test_das_refuses_a_low_rank_rotation_and_a_self_interchange_keeps_the_output(mlp, tmp_path):
  model, variables = mlp
  x = jax.random.normal(jax.random.key(3), (2, 1, D), jnp.float64)
  site = jl.module("layers_0")
  low = jt.LowRankDAS(rank=2).init(jax.random.key(0), D, jnp.float64)
  with pytest.raises(jl.ShapeError, match=r"das: a rotation of 2 columns in 4 features") as info:
    jl.trace(model, variables, x, intervene=jl.when(site, jl.das(low, x, dim=1)))
  assert info.value.code == "shape_mismatch"
  with pytest.raises(jl.ShapeError, match=r"boundless_das: a rotation of 2 columns"):
    jl.trace(model, variables, x, intervene=jl.when(site, jl.boundless_das(low, x, 0.1)))
  # A full rotation interchanging a run with itself, through a saved spec: the output unchanged.
  full = jt.DAS(dim=2).init(jax.random.key(0), D, jnp.float64)
  full["rotation"]["raw"] = full["rotation"]["raw"] + 0.3  # away from its base
  donor = jl.trace(model, variables, x, save=site)
  jl.save_spec(jl.when(site, jl.das(full, donor[site].out, dim=2)), tmp_path / "spec")
  out = jl.load_spec(tmp_path / "spec").bind(model)(variables, x)
  np.testing.assert_allclose(out, model.apply(variables, x), atol=1e-12)


def test_the_methods_with_a_qr_initialise_in_bfloat16():
  dtype = jnp.bfloat16
  for method in (jt.LowRankDAS(2),):  # a tall rotation: a QR (DiReFT's W2 is made alike)
    params = method.init(jax.random.key(0), 8, dtype)
    assert {leaf.dtype for leaf in jax.tree.leaves(params)} == {jnp.dtype(dtype)}
  with pytest.raises(jl.InvalidArgumentError, match="must be a float dtype, got 'float33'"):
    jt.DAS(2).init(jax.random.key(0), 8, "float33")


# --------------------------------------------------------------------------------------------
# One home per name.


def test_each_public_name_has_one_home():
  """No object is exported both by jaxlens.internal (or core / intervention) and by a tool:
  Donor, SiteGrad and SiteGrads live in jaxlens.core, orthogonal and boundary_mask in
  jaxlens.intervention (the root re-exports both facades by design)."""
  import importlib

  from jaxlens import internal

  facades = {"jaxlens.core": jl.core, "jaxlens.intervention": jl.intervention}
  facades["jaxlens.internal"] = internal
  tools = [*(f"jaxlens.{t}" for t in jl._TOOLS), "jaxlens.contract", "jaxlens.train", "jaxlens.sae"]
  seen = {}
  for name in [*facades, *tools]:
    module = facades.get(name) or importlib.import_module(name)
    for export in module.__all__:
      seen.setdefault(id(getattr(module, export)), []).append(f"{name}.{export}")
  doubled = [v for v in seen.values() if len(v) > 1]
  assert not doubled, doubled
  assert jl.Donor is jl.core.Donor and jl.SiteGrads is jl.core.SiteGrads
  assert jl.orthogonal is jl.intervention.orthogonal


# --------------------------------------------------------------------------------------------
# Loaders given something that is not a path.

LOADERS = [
  ("jaxlens.models", "load_hf", "LoadError"),
  ("jaxlens.models", "load_gguf", "LoadError"),
  ("jaxlens.sae", "load_saelens", "SAEError"),
  ("jaxlens.sae", "load_gemma_scope", "SAEError"),
  ("jaxlens.sae", "load_sparsify", "SAEError"),
  ("jaxlens.sae", "load_dictionary_learning", "SAEError"),
  ("jaxlens.sae", "load_llama_scope", "SAEError"),
  ("jaxlens.sae", "load_gemma_scope_clt", "SAEError"),
  ("jaxlens.sae", "load_hook_z", "SAEError"),
  ("jaxlens.sae", "load_circuit_tracer", "SAEError"),
  ("jaxlens.circuits", "load_circuit_tracer", "CircuitError"),
  ("jaxlens.lens", "load_jacobian_lens", "LensError"),
  ("jaxlens.lens", "load_tuned_lens", "LensError"),
  ("jaxlens.circuits", "load_graph", "CircuitError"),
]


@pytest.mark.parametrize(
  ("module", "name", "error"), LOADERS, ids=[f"{m}.{n}" for m, n, _ in LOADERS]
)
def test_a_loader_given_no_path_is_a_typed_error(module, name, error):
  """None, a number or an empty string is the module's own error with ``invalid_argument``
  (a raw TypeError from ``Path``/``open`` before), raised before the loader's other arguments
  are read."""
  import importlib

  loader = getattr(importlib.import_module(module), name)
  error_class = next(
    getattr(importlib.import_module(m), error)
    for m in (module, "jaxlens.models", "jaxlens.circuits")
    if hasattr(importlib.import_module(m), error)
  )
  for bad in (None, 42, ""):
    with pytest.raises(error_class, match=f"{name}: path must be a str or os.PathLike") as e:
      loader(bad)
    assert e.value.code == "invalid_argument" and e.value.fields["received"] == type(bad).__name__
