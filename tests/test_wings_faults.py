"""The wings' fault suite with real processes (issue 49, item 6).

One worker process (this file run as a script) trains a sparse autoencoder with a checkpoint
every step and, at the same time, collects an activation store; the test kills it with SIGKILL
at a random point once both have written some of their files. While it runs, this process
trains into the same checkpoint directory and collects into the same store: both are refused
(``checkpoint_locked``, ``store_locked``). Then this process resumes both, and the results
are the ones an uninterrupted run gives, bit for bit: the dictionary, its optimiser state and
the metric history of every step, and every shard of the store, byte for byte.

The worker and this process compute with the same configuration (float64 on, strict dtype
promotion, the test environment's XLA flags, inherited), so their steps agree bit for bit.
"""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

STEPS = 12  # training steps, and batches collected
CFG = dict(d_sae=8, architecture="topk", k=2, lr=1e-2)


def _rows(n, pause=0.0, drawn=None, gate=None):
  """The training data: batch i is seeded by i, so a resumed run sees the same batches.
  Batch 2 waits for the file ``gate``."""
  for i in range(n):
    time.sleep(pause)
    parent = os.getppid()
    while i == 2 and gate is not None and not gate.exists():
      if os.getppid() != parent:  # the test is gone: no one will open the gate
        sys.exit(1)
      time.sleep(0.01)
    if drawn is not None:
      drawn.append(i)
    yield np.random.default_rng(i).normal(size=(16, 8)).astype(np.float32)


def _inputs(n, behind):
  for i in range(n):
    while behind(i):
      time.sleep(0.01)
    yield np.random.default_rng(100 + i).normal(size=(4, 3)).astype(np.float32)


def _dense():
  model = nn.Sequential([nn.Dense(5)])
  return model, model.init(jax.random.key(0), jnp.zeros((1, 3), jnp.float32))


def _train(ckpt, pause=0.0, drawn=None, gate=None):
  from jaxlens.sae import train as st

  kw = {} if ckpt is None else {"checkpoint_dir": ckpt, "checkpoint_every": 1}
  return st.train(
    _rows(STEPS, pause, drawn, gate),
    st.TrainConfig(**CFG),
    steps=STEPS,
    progress=False,
    log_every=1,
    **kw,
  )


def _collect(path, behind=lambda i: False):
  from jaxlens import store

  model, variables = _dense()
  return store.collect(
    model, variables, _inputs(STEPS, behind), path, sites=["layers_0"], progress=False
  )


def _worker(ckpt, acts):
  """Trains into ``ckpt`` and collects into ``acts`` at once, slowly (the test kills it),
  waiting before batch 2 for the test's ``go`` file."""
  import threading

  jax.config.update("jax_enable_x64", True)
  jax.config.update("jax_numpy_dtype_promotion", "strict")
  drawn = []  # the training batches drawn so far: the collection keeps pace with them
  collector = threading.Thread(target=_collect, args=(acts, lambda i: len(drawn) <= i), daemon=True)
  collector.start()
  _train(ckpt, pause=0.1, drawn=drawn, gate=ckpt.parent / "go")
  collector.join()
  print("finished", flush=True)


def _steps(ckpt: Path) -> list[int]:
  return sorted(int(p.name) for p in ckpt.glob("*") if p.name.isdigit()) if ckpt.exists() else []


def _shards(acts: Path) -> int:
  return len(list(acts.glob("shard_*.safetensors")))


def test_killed_training_and_collection_resume_bit_identical_and_a_second_writer_is_refused(
  tmp_path,
):
  import jaxlens as jl
  from jaxlens import store

  rng = np.random.default_rng()
  seed = int(rng.integers(2**31))
  rng = np.random.default_rng(seed)  # printed with any failure: the kill point is replayable
  want_steps, want_shards = (int(n) for n in rng.integers(2, STEPS - 3, size=2))
  delay = float(rng.uniform(0, 0.1))
  ckpt, acts = tmp_path / "ck", tmp_path / "acts"
  log = (tmp_path / "worker.log").open("w+")
  worker = subprocess.Popen(
    [sys.executable, __file__, str(ckpt), str(acts)], stdout=log, stderr=subprocess.STDOUT
  )
  why = f"seed {seed}: kill after step {want_steps} and shard {want_shards}, then {delay:.3f} s"
  deadline = time.monotonic() + 120

  def wait_for(steps, shards):
    while not (_steps(ckpt) and _steps(ckpt)[-1] >= steps and _shards(acts) >= shards):
      assert worker.poll() is None, f"{why}: the worker ended early: {Path(log.name).read_text()}"
      assert time.monotonic() < deadline, f"{why}: the worker is too slow"
      time.sleep(0.005)

  try:
    wait_for(1, 1)  # the worker holds both directories, and waits for "go" before batch 2
    # A second process training into the directory, or collecting into the store, while the
    # worker holds them: a typed refusal, before it writes anything.
    try:
      _train(ckpt)
    except jl.CheckpointError as error:
      assert error.code == "checkpoint_locked", why
    else:
      raise AssertionError(f"{why}: a second run trained into a locked checkpoint directory")
    try:
      _collect(acts)
    except store.StoreError as error:
      assert error.code == "store_locked", why
    else:
      raise AssertionError(f"{why}: a second collection wrote into a store being collected")
    (tmp_path / "go").touch()
    wait_for(want_steps, want_shards)
    time.sleep(delay)
    worker.send_signal(signal.SIGKILL)
    assert worker.wait(timeout=60) == -signal.SIGKILL, why
  finally:
    if worker.poll() is None:
      worker.kill()
      worker.wait()
    log.close()
  killed_at, shards_at = _steps(ckpt)[-1], _shards(acts)
  assert killed_at < STEPS and not (acts / "COMPLETE").exists(), f"{why}: not killed mid-way"

  # Resumed here (the worker's locks died with it), and uninterrupted runs to compare.
  resumed, whole = _train(ckpt), _train(None)
  for a, b in zip(jax.tree.leaves(whole.state), jax.tree.leaves(resumed.state), strict=True):
    np.testing.assert_array_equal(a, b, err_msg=f"{why}, killed at step {killed_at}")
  assert sorted(resumed.metrics) == sorted(whole.metrics)
  for name, values in whole.metrics.items():  # every step's metrics, none lost or repeated
    np.testing.assert_array_equal(values, resumed.metrics[name], err_msg=f"{why}: {name}")
  assert list(resumed.metrics["step"]) == list(range(1, STEPS + 1))
  assert not list(ckpt.glob("*tmp*")), why

  s, ref = _collect(acts), _collect(tmp_path / "ref")
  assert s.complete and s.num_batches == STEPS, f"{why}; {shards_at} shards at the kill"
  for i in range(STEPS):
    name = f"shard_{i:06d}.safetensors"
    assert (acts / name).read_bytes() == (tmp_path / "ref" / name).read_bytes(), f"{why}: {name}"
  np.testing.assert_array_equal(s.array("layers_0"), ref.array("layers_0"))
  assert not list(acts.glob("*.tmp")), why


if __name__ == "__main__":
  _worker(Path(sys.argv[1]), Path(sys.argv[2]))
