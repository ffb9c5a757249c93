"""Property and fault suites of the wings (issue 49, item 6), kept small.

* Random damage (a cut, a flipped byte, a deleted file) to every file type the wings write: a
  training checkpoint, an activation store, a saved trained-intervention spec (each with
  checksums) reads back as the very same values or raises a typed error whose code
  docs/errors.md lists; a SAELens dictionary directory (a format without checksums) loads or
  raises a typed error, never a raw exception.
* Random arguments of ``jaxlens.sae.train``: a result or a typed error.
* Faults: SAE training killed at a random batch or inside a checkpoint save resumes to the
  uninterrupted result, bit for bit.
"""

import pathlib
import re
import shutil

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import jaxlens as jl
from jaxlens import sae, store
from jaxlens import train as jt
from jaxlens.internal import Checkpoints
from jaxlens.sae import train as sae_train

CODES = set(
  re.findall(r"`([a-z0-9_]+)`", (pathlib.Path(__file__).parents[1] / "docs/errors.md").read_text())
)
FEW = settings(
  max_examples=12,
  deadline=None,
  suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


def _typed(error):
  assert isinstance(error, jl.JaxlensError), f"raw {type(error).__name__}: {error}"
  assert error.code in CODES, error.code


@pytest.fixture(scope="module")
def written(tmp_path_factory):
  """One of each file type, written once."""
  root = tmp_path_factory.mktemp("written")
  state = {"w": jax.random.normal(jax.random.key(0), (16, 16)), "n": jnp.asarray(7)}
  with Checkpoints(root / "checkpoint", 1) as c:
    c.save(1, state, {"consumed": 3})
  model = nn.Sequential([nn.Dense(4)])
  v = model.init(jax.random.key(0), jnp.zeros((1, 3), jnp.float32))
  data = [np.random.default_rng(i).normal(size=(2, 3)).astype(np.float32) for i in range(2)]
  stored = store.collect(model, v, data, root / "store", sites=["layers_0"], progress=False)
  params = jt.DAS(dim=1).init(jax.random.key(1), 4)
  x = jnp.asarray(data[0])
  spec = jl.when(jl.module("layers_0"), jl.das(params, jnp.ones((2, 4), jnp.float32), dim=1))
  jl.save_spec(spec, root / "spec")
  d = sae.SAE.init(jax.random.key(2), 4, 6)
  sae.save_saelens(d, root / "dict")
  return {
    "root": root,
    "state": state,
    "store": stored.array("layers_0"),
    "spec": (model, v, x, spec.bind(model)(v, x)),
    "dict": (d, x @ jnp.ones((3, 4), jnp.float32)),
  }


def _files(path):
  return sorted(p for p in path.rglob("*") if p.is_file() and p.name != ".jaxlens-lock")


def _damage(src, dst, data):
  shutil.copytree(src, dst)
  target = data.draw(st.sampled_from(_files(dst)), label="file")
  how = data.draw(st.sampled_from(["cut", "flip", "delete"]), label="how")
  raw = bytearray(target.read_bytes())
  if how == "delete" or not raw:
    target.unlink()
  elif how == "cut":
    target.write_bytes(bytes(raw[: data.draw(st.integers(0, len(raw) - 1), label="at")]))
  else:
    at = data.draw(st.integers(0, len(raw) - 1), label="at")
    raw[at] ^= 1 << data.draw(st.integers(0, 7), label="bit")
    target.write_bytes(bytes(raw))
  return dst


@FEW
@given(data=st.data(), kind=st.sampled_from(["checkpoint", "store", "spec", "dict"]))
def test_a_damaged_file_reads_back_the_same_or_is_typed(written, tmp_path_factory, data, kind):
  path = _damage(written["root"] / kind, tmp_path_factory.mktemp("d") / kind, data)
  try:
    if kind == "checkpoint":
      with Checkpoints(path, 1) as c:
        got = c.restore(written["state"])
      if got is not None:  # (None: the step directory's files deleted, no checkpoint left)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(written["state"])):
          np.testing.assert_array_equal(a, b)
    elif kind == "store":
      np.testing.assert_array_equal(store.open(path).array("layers_0"), written["store"])
    elif kind == "spec":
      model, v, x, want = written["spec"]
      np.testing.assert_array_equal(jl.load_spec(path).bind(model)(v, x), want)
    else:  # no checksums in SAELens's format: any result, or a typed error
      d = sae.load_saelens(path)
      d(written["dict"][1])
  except jl.JaxlensError as error:
    _typed(error)


@FEW
@given(
  steps=st.one_of(st.integers(-2, 3), st.just(True), st.just(2.0)),
  log_every=st.one_of(st.integers(-1, 3), st.just(None)),
  rows=st.integers(0, 3),
  width=st.sampled_from([4, 5]),
  dtype=st.sampled_from(["float32", "int32", "float33"]),
)
def test_sae_train_on_random_arguments_trains_or_is_typed(steps, log_every, rows, width, dtype):
  def batches():
    for i in range(3):
      yield np.random.default_rng(i).normal(size=(rows, 4 if i == 0 else width)).astype("float32")

  try:
    cfg = sae_train.TrainConfig(d_sae=4, architecture="relu", dtype=dtype)
    out = sae_train.train(batches(), cfg, steps=steps, log_every=log_every, progress=False)
  except jl.JaxlensError as error:
    _typed(error)
  else:
    assert out.state.step >= 1 and all(np.isfinite(np.asarray(out.sae.W_enc)).ravel())


# --------------------------------------------------------------------------------------------
# Faults: a training run killed anywhere resumes to the uninterrupted result.


class Killed(BaseException):
  """What a SIGKILL looks like from inside: no library handler sees it."""


def _rows(n, kill_at=None):
  for i in range(n):
    if i == kill_at:
      raise Killed
    yield np.random.default_rng(i).normal(size=(16, 8)).astype(np.float32)


CFG = sae_train.TrainConfig(d_sae=8, architecture="topk", k=2, lr=1e-2)


@pytest.fixture(scope="module")
def uninterrupted():
  return sae_train.train(_rows(6), CFG, steps=6, progress=False, log_every=2)


@pytest.mark.parametrize("phase", ["loader", "inside a save"])
def test_sae_training_killed_anywhere_resumes_bit_identical(uninterrupted, tmp_path, phase):
  at = int(np.random.default_rng(len(phase)).integers(2, 5))  # a random point, fixed per phase
  kw = dict(steps=6, progress=False, log_every=2, checkpoint_dir=tmp_path, checkpoint_every=1)
  with pytest.raises(Killed):
    sae_train.train(_rows(6, kill_at=at), CFG, **kw)
  if phase == "inside a save":
    # What a kill while orbax writes step at + 1 leaves: its temporary directory, half written
    # (orbax renames it to "{step}" once complete).
    partial = tmp_path / f"{at + 1}.orbax-checkpoint-tmp"
    shutil.copytree(tmp_path / str(at), partial)
    for f in (partial / "state").rglob("*"):
      if f.is_file():
        f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
  with Checkpoints(tmp_path, 1) as c:
    assert c.latest_step() == at
  resumed = sae_train.train(_rows(6), CFG, **kw)
  for a, b in zip(jax.tree.leaves(uninterrupted.state), jax.tree.leaves(resumed.state)):
    np.testing.assert_array_equal(a, b)
  np.testing.assert_array_equal(uninterrupted.metrics["mse_loss"], resumed.metrics["mse_loss"])
