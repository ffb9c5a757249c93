"""Faults in long jobs (issue 31, item 4): a store collection killed at a random point resumes
to the uninterrupted result; a full disk during a spec save or a store write leaves the previous
state intact and typed; a sweep over a mesh, one compiled call with no partial state, reruns to
the identical grid.

(The SAE and intervention training loops of ``jaxlens.sae.train`` and ``jaxlens.train`` test
their own checkpoint-resume in their suites; tests/test_wings.py and
tests/test_wings_properties.py fault their checkpoints: a real full disk, a second run, damage,
a kill at a random batch or mid-save.)
"""

import errno
import os

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxlens as jl
from jaxlens import store

N, ROWS = 5, 2


class Killed(BaseException):
  """What a SIGKILL looks like from inside: nothing after it runs (not an Exception, so no
  handler of the library sees it; ``finally`` blocks still run, as the worst case for them)."""


@pytest.fixture(scope="module")
def net(tmp_path_factory):
  model = nn.Sequential([nn.Dense(4), nn.tanh, nn.Dense(3)])
  variables = model.init(jax.random.key(0), jnp.zeros((1, 2, 3), jnp.float32))
  ref = tmp_path_factory.mktemp("ref") / "acts"
  s = store.collect(model, variables, batches(), ref, sites=["layers_*"], progress=False)
  return model, variables, {k: s.array(k) for k in s.labels}


def batches(kill_at=None):
  for i in range(N):
    if i == kill_at:
      raise Killed
    yield np.random.default_rng(i).standard_normal((ROWS, 2, 3)).astype(np.float32)


def _same_as_reference(path, ref):
  s = store.open(path)
  assert s.complete and s.num_batches == N
  for k, want in ref.items():
    np.testing.assert_array_equal(s.array(k), want)


# The phases a kill can hit while batch k is written: its .tmp half written, written but not
# renamed, renamed (the shard is whole); or the loader between batches.
PHASES = ("loader", "half_tmp", "whole_tmp", "renamed")


@pytest.mark.parametrize("phase", PHASES)
def test_a_collection_killed_anywhere_resumes_to_the_uninterrupted_store(
  net, tmp_path, monkeypatch, phase
):
  model, variables, ref = net
  at = int(np.random.default_rng(len(phase)).integers(1, N))  # a random batch, fixed per phase
  path = tmp_path / "acts"
  if phase == "loader":
    with pytest.raises(Killed):
      store.collect(model, variables, batches(kill_at=at), path, sites=["layers_*"], progress=False)
  else:
    real_replace = os.replace

    def dying_replace(src, dst):
      # The shard's .tmp is whole here; the kill lands before, during or after the rename.
      if str(dst).endswith(f"shard_{at:06d}.safetensors"):
        if phase == "half_tmp":
          with open(src, "r+b") as f:
            f.truncate(os.path.getsize(src) // 2)
          raise Killed
        if phase == "whole_tmp":
          raise Killed
        real_replace(src, dst)
        raise Killed
      return real_replace(src, dst)

    monkeypatch.setattr(store.os, "replace", dying_replace)
    with pytest.raises(Killed):
      store.collect(model, variables, batches(), path, sites=["layers_*"], progress=False)
    monkeypatch.setattr(store.os, "replace", real_replace)
  crashed = store.open(path)
  assert not crashed.complete
  done = crashed.num_batches
  assert done in (at, at + 1)  # no partial batch is visible
  for k, want in ref.items():
    np.testing.assert_array_equal(crashed.array(k), want[: done * ROWS])
  store.collect(model, variables, batches(), path, sites=["layers_*"], progress=False)
  _same_as_reference(path, ref)
  assert not list(path.glob("*.tmp"))


def test_a_store_killed_while_it_was_created_can_be_collected_again(net, tmp_path):
  model, variables, ref = net
  path = tmp_path / "acts"
  path.mkdir()
  (path / "store.json.tmp").write_text('{"vers')  # the only thing a kill at creation leaves
  store.collect(model, variables, batches(), path, sites=["layers_*"], progress=False)
  _same_as_reference(path, ref)


@pytest.mark.parametrize("where", ["store.json", "COMPLETE"])
def test_a_full_disk_at_the_store_metadata_is_disk_full_and_resumable(
  net, tmp_path, monkeypatch, where
):
  import pathlib

  model, variables, ref = net
  path = tmp_path / "acts"
  real_write = pathlib.Path.write_text

  def full(self, data, *args, **kwargs):
    if self.name.startswith(where):
      real_write(self, data[: len(data) // 2], *args, **kwargs)
      raise OSError(errno.ENOSPC, "No space left on device")
    return real_write(self, data, *args, **kwargs)

  monkeypatch.setattr(pathlib.Path, "write_text", full)
  with pytest.raises(store.StoreError, match=r"\[disk_full\]"):
    store.collect(model, variables, batches(), path, sites=["layers_*"], progress=False)
  monkeypatch.undo()
  assert not (path / "COMPLETE").exists() and not list(path.glob("*.tmp"))
  store.collect(model, variables, batches(), path, sites=["layers_*"], progress=False)
  _same_as_reference(path, ref)


# -- spec saves ------------------------------------------------------------------------------


def _spec(k):
  return jl.when(jl.module("layers_0"), jl.steer(jnp.arange(4.0), float(k)))


@pytest.mark.parametrize("fail", ["arrays.npz", "spec.json", "fsync", "rename"])
def test_a_full_disk_during_a_spec_save_keeps_the_previous_spec(tmp_path, monkeypatch, fail):
  import jaxlens._src.saving as saving

  path = _spec(1).save(tmp_path / "s")
  before = sorted(p.name for p in path.iterdir())
  enospc = OSError(errno.ENOSPC, "No space left on device")
  if fail in ("arrays.npz", "spec.json"):
    real = saving._write

    def full(target, data):
      if target.name == fail:
        with open(target, "wb") as f:
          f.write(data[: len(data) // 2])
        raise enospc
      real(target, data)

    monkeypatch.setattr(saving, "_write", full)
  elif fail == "fsync":
    monkeypatch.setattr(saving.os, "fsync", lambda fd: (_ for _ in ()).throw(enospc))
  else:
    real_replace = os.replace

    def replace(a, b):
      if str(a).endswith(".tmp-" + pathlib_name(b)):
        raise enospc
      real_replace(a, b)

    def pathlib_name(b):
      return os.path.basename(str(b))

    monkeypatch.setattr(saving.os, "replace", replace)
  with pytest.raises(jl.SpecFormatError, match=r"\[spec_save_failed\]"):
    _spec(2).save(path)
  monkeypatch.undo()
  assert repr(jl.load_spec(path)) == repr(_spec(1))
  assert sorted(p.name for p in path.iterdir()) == before  # no debris
  assert repr(jl.load_spec(_spec(3).save(path))) == repr(_spec(3))


# -- a sweep over a mesh ----------------------------------------------------------------------


def test_a_sweep_over_a_mesh_reruns_to_the_identical_grid(net):
  """A sweep is one compiled call: a kill loses it whole (there is no partial grid to resume),
  and the rerun gives the same grid bit for bit, on a mesh as without one."""
  from jaxlens.models import init_gpt

  model, variables, clean = init_gpt(
    0, n_layers=1, d_model=8, n_heads=2, max_len=4, vocab_size=8, batch=2
  )
  corrupt = clean.at[:, 1].set(0)
  # jax.make_mesh's default axis type is Explicit: slicing the padded grid (4 positions on 8
  # devices) raised JAX's raw ShardingTypeError.
  mesh = jax.make_mesh((len(jax.devices()),), ("cells",))

  def metric(out):
    return out[:, -1, 0].mean()

  first = jl.sweep.patching_sweep(model, variables, clean, corrupt, metric, mesh=mesh)
  again = jl.sweep.patching_sweep(model, variables, clean, corrupt, metric, mesh=mesh)
  plain = jl.sweep.patching_sweep(model, variables, clean, corrupt, metric)
  assert first.shape == plain.shape == (1, 4)
  np.testing.assert_array_equal(np.asarray(first), np.asarray(again))
  np.testing.assert_allclose(np.asarray(first), np.asarray(plain), rtol=1e-6, atol=1e-7)
