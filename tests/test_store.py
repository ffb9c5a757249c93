"""jaxlens.store: collect sites over a dataset to disk, crash and resume, bounded memory."""

import json
import os
import shutil
import subprocess
import sys
import textwrap

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxlens as jl
from jaxlens import store

pytest.importorskip("safetensors")

N_BATCHES, BATCH, SEQ = 5, 3, 4


class Net(nn.Module):
  @nn.compact
  def __call__(self, x):
    h = nn.Dense(6, name="layers_0")(x)
    return nn.Dense(2, name="layers_1")(jnp.tanh(h))


def data(n=N_BATCHES, fail_at=None):
  """A deterministic dataset; the last batch is short. ``fail_at``: the loader crashes there."""
  for i in range(n):
    if i == fail_at:
      raise RuntimeError("the data loader crashed")
    rows = BATCH if i < n - 1 else 1
    yield np.random.default_rng(i).standard_normal((rows, SEQ, 5)).astype(np.float32)


@pytest.fixture(scope="module")
def net():
  model = Net()
  return model, jax.jit(model.init)(jax.random.key(0), jnp.zeros((1, SEQ, 5), jnp.float32))


@pytest.fixture(scope="module")
def reference(net, tmp_path_factory):
  """An uninterrupted collection, and the values computed directly."""
  model, v = net
  path = tmp_path_factory.mktemp("ref") / "acts"
  s = store.collect(model, v, data(), path, sites=["layers_*"], progress=False)
  direct = jax.jit(lambda v, b: jl.trace(model, v, b, keep_inputs=False).values)
  batches = [direct(v, b) for b in data()]
  want = {k: np.concatenate([np.asarray(b[k]) for b in batches]) for k in ("layers_0", "layers_1")}
  return s, want


def test_collect_stores_every_row_and_reads_it_back(reference):
  s, want = reference
  assert s.complete and s.num_batches == N_BATCHES and len(s) == BATCH * (N_BATCHES - 1) + 1
  assert s.labels == ("layers_0", "layers_1")
  assert s.shape("layers_0") == (SEQ, 6) and s.dtype("layers_1") == np.float32
  for k in s.labels:
    np.testing.assert_allclose(s.array(k), want[k], rtol=1e-6)
  # Re-chunked, one row per token, as a probe or SAE trains on.
  flat = list(s.batches("layers_0", batch_size=5, flatten=True))
  assert [len(b) for b in flat][:-1] == [5] * (len(flat) - 1)
  np.testing.assert_allclose(np.concatenate(flat), want["layers_0"].reshape(-1, 6), rtol=1e-6)
  # Shuffled: the same rows in another order; several sites stay aligned.
  mixed = list(s.batches(["layers_0", "layers_1"], shuffle=True, seed=1, as_jax=True))
  got0 = np.concatenate([np.asarray(b["layers_0"]) for b in mixed])
  got1 = np.concatenate([np.asarray(b["layers_1"]) for b in mixed])
  assert isinstance(mixed[0]["layers_0"], jax.Array)
  order = [int(np.flatnonzero((want["layers_0"] == row).all(axis=(1, 2)))[0]) for row in got0]
  assert sorted(order) == list(range(len(want["layers_0"]))) and order != sorted(order)
  np.testing.assert_array_equal(got1, want["layers_1"][order])
  assert "5 batches, 13 rows, complete" in repr(store.open(s.path))


def test_crash_mid_write_then_resume_equals_an_uninterrupted_run(
  net, reference, tmp_path, monkeypatch
):
  model, v = net
  path = tmp_path / "acts"
  real_save = store._save_shard
  calls = []

  def crashing_save(arrays, shard):
    calls.append(shard)
    if len(calls) == 3:  # the third shard: half a file on disk, then the process "dies"
      shard.with_name(shard.name + ".tmp").write_bytes(b"\x10\x00partial")
      raise KeyboardInterrupt
    real_save(arrays, shard)

  monkeypatch.setattr(store, "_save_shard", crashing_save)
  with pytest.raises(KeyboardInterrupt):
    store.collect(model, v, data(), path, sites=["layers_*"], progress=False)
  monkeypatch.setattr(store, "_save_shard", real_save)
  crashed = store.open(path)
  assert not crashed.complete and crashed.num_batches == 2  # no partial batch is visible
  np.testing.assert_array_equal(
    crashed.array("layers_0"), reference[0].array("layers_0")[: 2 * BATCH]
  )

  # A crash in the data loader, then a resume that completes it.
  with pytest.raises(RuntimeError, match="loader crashed"):
    store.collect(model, v, data(fail_at=4), path, sites=["layers_*"], progress=False)
  assert store.open(path).num_batches == 4 and not list(path.glob("*.tmp"))
  resumed = store.collect(model, v, data(), path, sites=["layers_*"], progress=False)
  assert resumed.complete and resumed.num_batches == N_BATCHES
  for k in resumed.labels:
    np.testing.assert_array_equal(resumed.array(k), reference[0].array(k))


def test_typed_errors_for_bad_paths_other_sites_and_a_full_disk(
  net, reference, tmp_path, monkeypatch
):
  model, v = net
  a_file = tmp_path / "file"
  a_file.write_text("x")
  with pytest.raises(store.StoreError, match="store_path_invalid"):
    store.collect(model, v, data(), a_file, sites=["layers_0"], progress=False)
  with pytest.raises(store.StoreError, match="store_path_invalid"):
    store.collect(model, v, data(), a_file / "below", sites=["layers_0"], progress=False)
  (tmp_path / "busy").mkdir()
  (tmp_path / "busy" / "notes.txt").write_text("mine")
  with pytest.raises(store.StoreError, match="store_not_empty"):
    store.collect(model, v, data(), tmp_path / "busy", sites=["layers_0"], progress=False)
  with pytest.raises(store.StoreError, match="store_mismatch"):
    store.collect(model, v, data(), reference[0].path, sites=["layers_0"], progress=False)
  with pytest.raises(store.StoreError, match="store_missing"):
    store.open(tmp_path / "busy")
  with pytest.raises(store.StoreError, match="unknown_site") as caught:
    reference[0].array("layers_2")
  assert caught.value.fields["fix"] == "one of ['layers_0', 'layers_1']"

  # Not enough free space for the batches announced: refused before any work.
  class Usage:
    free = 100

  monkeypatch.setattr(store.shutil, "disk_usage", lambda p: Usage)
  with pytest.raises(store.StoreError, match="disk_full"):
    store.collect(model, v, list(data()), tmp_path / "small", sites=["layers_0"], progress=False)
  monkeypatch.undo()
  # A real full disk while writing: tests/test_wings.py (a file-size limit).


MEMORY_SCRIPT = textwrap.dedent("""
    import json, sys
    import numpy as np, jax, jax.numpy as jnp, flax.linen as nn
    from jaxlens import store

    def status(key):
      for line in open("/proc/self/status"):
        if line.startswith(key):
          return int(line.split()[1]) * 1024

    model = nn.Sequential([nn.Dense(256)])
    v = model.init(jax.random.key(0), jnp.zeros((1, 64, 16), jnp.float32))
    n = int(sys.argv[1])
    def data(n):
      for i in range(n):
        yield np.random.default_rng(i).standard_normal((64, 64, 16)).astype(np.float32)
    root = sys.argv[2]
    store.collect(model, v, data(2), root + "/warm", sites=["layers_0"], progress=False)
    with open("/proc/self/clear_refs", "w") as f:
      f.write("5")  # resets the peak (VmHWM) to the current RSS
    base = status("VmRSS")
    s = store.collect(model, v, data(n), root + "/acts", sites=["layers_0"], progress=False)
    print(json.dumps({"peak_growth": status("VmHWM") - base, "rows": s.num_rows,
                      "stored": s.num_rows * 64 * 256 * 4}))
""")


def test_a_dataset_larger_than_the_memory_cap_is_collected_within_it(tmp_path):
  cap = 80 * 2**20  # 20 batches of 4 MiB of activations; the dataset is 320 MiB
  # A fixed mmap threshold: glibc otherwise raises it to the size of a freed 4 MiB batch, so
  # later batches come from the heap, whose fragments the peak counts though malloc reuses
  # them (20 to 93 MiB of growth from run to run; with it, 20 to 24 MiB).
  env = dict(os.environ, MALLOC_MMAP_THRESHOLD_=str(128 * 2**10))
  env.pop("GLIBC_TUNABLES", None)  # the suite's own (tests/conftest.py) keeps freed memory
  out = subprocess.run(
    [sys.executable, "-c", MEMORY_SCRIPT, "80", str(tmp_path)],
    capture_output=True,
    text=True,
    check=True,
    env=env,
  )
  shutil.rmtree(tmp_path / "acts")  # 320 MiB: not left for pytest's retention of old runs
  got = json.loads(out.stdout.strip().splitlines()[-1])
  assert got["rows"] == 80 * 64 and got["stored"] == 320 * 2**20 == 4 * cap
  assert got["peak_growth"] < cap, got
