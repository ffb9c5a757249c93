"""jaxlens on ``jax.distributed``: two processes of two CPU devices each, on localhost.

One pair of worker processes (``tests/_dist_worker.py``) runs every scenario on a
``(data=2, model=2)`` mesh whose ``data`` axis spans the two processes (the batch is
split across processes, every Dense kernel across the two devices of a process) and
writes what it got, gathered to the host, to files. This process runs the same
scenarios on one device and compares: traces, live edits and their gradients, keep_grad
refusals, replay and patch_from, selections, patching sweeps (one of them with its cells
spread over all four devices), optax training through an edit, and a saved spec written
once and loaded by both processes. Two more pairs drill the faults: a process that dies
or hangs before a collective makes the other raise a typed ``DistributedError`` within
its timeout, and the launcher kills whatever is left (SIGKILL: jax's preemption notifier
catches SIGTERM), so no run outlives its deadline.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import _dist_worker as worker
import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
WORKER = Path(worker.__file__).resolve()
PROCESSES = 2
DEVICES = 2
TOLERANCE = {"float64": 1e-12, "float32": 1e-6}
PARITY_DEADLINE_S = 420  # the whole parity run; a loaded two-core machine needs minutes


def _free_port() -> int:
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


class Workers:
  """``n`` worker processes of one job, each in its own process group, with a deadline.

  ``wait`` returns when every process has exited, or when the ones in ``until`` have
  (the others are then killed), or at the deadline (everything left is killed). Logs go
  to ``out/log_<i>.txt``.
  """

  def __init__(self, out: Path, n: int, *args: str):
    self.out, self.procs, self.killed = out, [], []
    out.mkdir(parents=True, exist_ok=True)
    port = _free_port()
    env = dict(
      os.environ,
      PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
      JAX_PLATFORMS="cpu",
      PYTHONUNBUFFERED="1",
    )
    try:
      for i in range(n):
        with open(out / f"log_{i}.txt", "wb") as log:
          self.procs.append(
            subprocess.Popen(
              [
                sys.executable,
                str(WORKER),
                "--process-id",
                str(i),
                "--num-processes",
                str(n),
                "--port",
                str(port),
                "--devices",
                str(DEVICES),
                "--out",
                str(out),
                *args,
              ],
              stdout=log,
              stderr=subprocess.STDOUT,
              env=env,
              start_new_session=True,
            )
          )
    except BaseException:
      self.kill()
      raise

  def wait(self, deadline_s: float, until=None):
    until = range(len(self.procs)) if until is None else until
    end = time.monotonic() + deadline_s
    try:
      while time.monotonic() < end:
        if all(self.procs[i].poll() is not None for i in until):
          break
        time.sleep(0.2)
    finally:
      self.kill()
    return [p.returncode for p in self.procs]

  def kill(self):
    for i, p in enumerate(self.procs):
      if p.poll() is None:
        self.killed.append(i)
        try:
          os.killpg(p.pid, signal.SIGKILL)  # the group we started: the worker and its children
        except ProcessLookupError:
          pass
        p.wait()

  def log(self, i: int, tail: int = 3000) -> str:
    text = (self.out / f"log_{i}.txt").read_text(errors="replace")
    return "\n".join(line for line in text[-tail:].splitlines() if not line.startswith("    @"))

  def meta(self, i: int) -> dict:
    return json.loads((self.out / f"meta_{i}.json").read_text())


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
  """Every worker job of this module, started at once: name -> (Workers, output directory).

  The parity job, and the die and hang drills (step timeout 3 s, jax's heartbeat
  timeout 20 s). They run while this process computes its one-device reference.
  """
  started = {}
  try:
    out = tmp_path_factory.mktemp("distributed")
    started["parity"] = (Workers(out, PROCESSES, "--scenario", "parity"), out, time.monotonic())
    for name in ("die", "hang"):
      out = tmp_path_factory.mktemp(name)
      started[name] = (
        Workers(
          out, PROCESSES, "--scenario", name, "--step-timeout", "3", "--heartbeat-timeout", "20"
        ),
        out,
        time.monotonic(),
      )
    yield started
  finally:
    for job, _, _ in started.values():
      job.kill()


@pytest.fixture(scope="module")
def reference(jobs):
  """The same scenarios in this process, on one device, unsharded: dtype -> (values, facts)."""
  result = {}
  for dtype in worker.DTYPES:
    facts = {}
    values = worker.run_scenarios(None, dtype, facts)
    result[dtype] = ({k: np.asarray(a) for k, a in values.items()}, facts)
  return result


@pytest.fixture(scope="module")
def parity_run(jobs, reference):
  """The parity job's results: (per-process values, per-process facts, its directory)."""
  job, out, start = jobs["parity"]
  codes = job.wait(max(1.0, PARITY_DEADLINE_S - (time.monotonic() - start)))
  if codes != [0] * PROCESSES:
    pytest.fail(
      f"distributed workers failed (exit codes {codes}, killed at the deadline: "
      f"{job.killed}):\n"
      + "\n".join(f"--- process {i} ---\n{job.log(i)}" for i in range(PROCESSES))
    )
  values = [dict(np.load(out / f"result_{i}.npz")) for i in range(PROCESSES)]
  facts = [job.meta(i) for i in range(PROCESSES)]
  facts[0]["wall_seconds"] = round(time.monotonic() - start, 1)
  return values, facts, out


@pytest.fixture(scope="module")
def fault_runs(jobs):
  """The die and the hang drills: name -> (Workers, exit codes, seconds since start)."""
  runs = {}
  for name in ("die", "hang"):
    job, _, start = jobs[name]
    # Process 0 must finish on its own; process 1 dies by itself or hangs until killed.
    codes = job.wait(max(1.0, 240 - (time.monotonic() - start)), until=[0])
    runs[name] = (job, codes, time.monotonic() - start)
  return runs


def test_the_mesh_spans_both_processes(parity_run):
  _, facts, _ = parity_run
  for i, f in enumerate(facts):
    assert (f["process_index"], f["process_count"]) == (i, PROCESSES)
    assert (f["devices"], f["local_devices"]) == (PROCESSES * DEVICES, DEVICES)
    assert f["mesh_data_processes"] == [0]  # a model-axis row lies within one process
    for dtype in worker.DTYPES:
      assert f[dtype]["trace_output_processes"] == [0, 1]
      assert f[dtype]["trace_output_fully_addressable"] is False
      assert f[dtype]["host_trace_type"] == "Trace"


GROUPS = [
  "trace",
  "host",
  "eager",
  "live_keep",
  "live_cut",
  "replay",
  "patch_from",
  "select_units",
  "select_subspace",
  "select_subspace_zero",
  "sweep",
  "train_keep",
  "spec",
  "store",
  "sae",
  "circuits",
]
# run in float64 only (tests/_dist_worker.py), to keep the suite lean
FLOAT64_ONLY = {
  "eager",
  "live_cut",
  "replay",
  "patch_from",
  "select_units",
  "select_subspace",
  "select_subspace_zero",
  "train_keep",
  "spec",
  "store",
  "sae",
  "circuits",
}


def _error(a, b) -> float:
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  assert a.shape == b.shape
  return float(np.max(np.abs(a - b), initial=0.0))


@pytest.mark.parametrize("dtype", worker.DTYPES)
@pytest.mark.parametrize("group", GROUPS)
def test_every_process_gets_what_one_process_gets(parity_run, reference, dtype, group):
  values, _, _ = parity_run
  ref, _ = reference[dtype]
  keys = [k for k in ref if k.split("/")[0] == group]
  if group in FLOAT64_ONLY and dtype == "float32":
    assert not keys
    return
  assert keys, group
  for i, got in enumerate(values):
    for key in keys:
      a = got[f"{dtype}:{key}"]
      assert a.dtype == ref[key].dtype, key
      # A value is compared against its own scale: float32 rounding is relative.
      scale = max(1.0, float(np.max(np.abs(ref[key]), initial=0.0)))
      assert _error(a, ref[key]) <= TOLERANCE[dtype] * scale, (i, key)


def test_edits_are_live_and_cuts_cut(reference):
  """The parity above compares values that an edit changes (else it would prove little)."""
  ref, _ = reference["float64"]
  plain = ref["trace/output"]
  for key in (
    "live_keep/output",
    "live_cut/output",
    "replay/output",
    "patch_from/output",
    "select_units/output",
    "select_subspace/output",
    "spec/output",
  ):
    assert _error(ref[key], plain) > 1e-3, key
  np.testing.assert_array_equal(ref["patch_from/block_1"], ref["patch_from/donor_block_1"])
  cut_grads = [k for k in ref if k.startswith("live_cut/grad") and "block_0" in k]
  assert cut_grads and all(not ref[k].any() for k in cut_grads)
  keep_grads = [k for k in ref if k.startswith("live_keep/grad") and "block_0" in k]
  assert keep_grads and all(ref[k].any() for k in keep_grads)


@pytest.mark.parametrize("dtype", worker.DTYPES)
def test_keep_grad_refuses_the_same_way(parity_run, reference, dtype):
  _, facts, _ = parity_run
  want = reference[dtype][1]["keep_grad_refusals"]
  assert want == {
    "zero_ablate": ["edit_detached_from_graph", "block_0"],
    "replace_with": ["edit_detached_from_graph", "block_0"],
  }
  for f in facts:
    assert f[dtype]["keep_grad_refusals"] == want


@pytest.mark.parametrize("dtype", worker.DTYPES)
def test_the_sweep_cells_are_spread_over_every_device(parity_run, reference, dtype):
  values, facts, _ = parity_run
  ref = reference[dtype][0]["sweep/grid"]
  assert ref.shape == (2, worker.SEQ)
  assert np.ptp(ref) > 1e-3  # positions differ: the grid is not a constant
  for f, got in zip(facts, values):
    # 2 sites x 4 positions over 4 devices: each device holds one position of each site,
    # two of them on each process.
    assert f[dtype]["sweep_cells_processes"] == [0, 1]
    assert f[dtype]["sweep_cells_shard_shape"] == [2, 1]
    assert f[dtype]["sweep_cells_local_shards"] == DEVICES
    scale = max(1.0, float(np.max(np.abs(ref))))
    assert _error(got[f"{dtype}:sweep_cells/grid"], ref) <= TOLERANCE[dtype] * scale


def test_a_cut_gives_exact_zero_gradients_upstream_and_training_learns(parity_run):
  """In every process, bit for bit: the cut's gradient upstream is zero, not merely small."""
  values, _, _ = parity_run
  upstream = [k for k in values[0] if k.startswith("float64:live_cut/grad") and "block_0" in k]
  downstream = [k for k in values[0] if k.startswith("float64:live_cut/grad") and "head" in k]
  assert upstream and downstream
  for got in values:
    assert all(not got[k].any() for k in upstream)
    assert all(got[k].any() for k in downstream)
    losses = [float(got[f"float64:train_keep/loss_{i}"]) for i in range(3)]
    assert losses[2] < losses[1] < losses[0]


def test_a_spec_is_written_once_and_loaded_by_every_process(parity_run):
  import jaxlens as jl

  _, facts, out = parity_run
  path = out / "spec_float64"
  digest = json.loads((path / "spec.json").read_text())["sha256"]
  assert [f["float64"]["spec_sha256"] for f in facts] == [digest] * PROCESSES
  loaded = jl.load_spec(path)  # a third process reads it too
  assert len(loaded.rules) == 1
  leftovers = [p.name for p in out.iterdir() if p.name.startswith(".spec_")]
  assert leftovers == []  # no temporary directory of a second writer


def test_a_dead_process_gives_a_typed_error_in_bounded_time(fault_runs):
  """The die drill runs docs/scaling.md's layout (the batch split across processes): gloo
  fails the collective at once when the peer's connection closes, and jd.wait passed JAX's
  raw JaxRuntimeError through (issue 31; the drill used a one-axis mesh, where the survivor
  waits instead). The timeout path is the hang drill's."""
  job, codes, _ = fault_runs["die"]
  assert codes[1] == 3, job.log(1)  # it exited on its own, mid-run
  assert codes[0] == 0, job.log(0)
  report = job.meta(0)
  error = report["error"]
  assert error is not None, job.log(0)
  assert (error["type"], error["code"]) == ("DistributedError", "process_timeout"), error
  assert "has died or hangs" in error["message"] and "Fix:" in error["message"]
  # at once (the lost peer) or at the step timeout, well before jax's heartbeat (20 s)
  assert report["seconds"] < 20
  assert report["seconds"] >= 3 or error["fields"]["cause"]


def test_a_hung_process_gives_a_typed_error_and_is_killed(fault_runs):
  job, codes, seconds = fault_runs["hang"]
  assert codes[0] == 0, job.log(0)
  # The hung process is killed: by jax once process 0 (which hosts the coordination
  # service) is gone (SIGABRT, "the JAX distributed service detected fatal errors"), or
  # else by the launcher (SIGKILL).
  assert codes[1] in (-signal.SIGABRT, -signal.SIGKILL), job.log(1)
  report = job.meta(0)
  assert (report["error"]["type"], report["error"]["code"]) == (
    "DistributedError",
    "process_timeout",
  )
  assert 3 <= report["seconds"] < 20
  barrier = report["barrier_error"]
  assert (barrier["type"], barrier["code"]) == ("DistributedError", "barrier_timeout")
  assert "after-step-2" in barrier["message"]
  assert seconds < 240


def test_bounded_waits_return_at_once_on_one_process():
  import jax.numpy as jnp

  from jaxlens import distributed as jd

  value = jnp.arange(3.0)
  assert jd.wait({"a": value}, timeout_s=5)["a"] is value
  jd.barrier("one-process", timeout_s=1)  # no jax.distributed here: nothing to wait for
  host = jd.host_values({"a": value, "b": 2})
  assert isinstance(host["a"], np.ndarray) and host["b"] == 2


def test_the_cell_sweep_on_one_process_matches_jl_sweep(reference):
  """jl.sweep.patching_sweep(mesh=) on 4 devices of this process: cells over ``data``
  with the kernels split over ``model``, in chunks of one cell; and its input errors."""
  import jax
  from jax.sharding import AxisType

  import jaxlens as jl

  mesh = jax.make_mesh(
    (2, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2, devices=jax.devices()[:4]
  )
  place = worker.Placement(mesh)
  model = worker._model(np.float64)
  rng = np.random.default_rng(1)
  x = rng.normal(size=(worker.BATCH, worker.SEQ, worker.WIDTH))
  variables = worker._host_variables(model, x, seed=2)
  sites = ("block_0", "block_1")
  grid = jl.sweep.patching_sweep(
    model,
    place.variables(variables),
    place.put(2 * x),
    place.put(x),
    worker.metric,
    mesh=mesh,
    sites=sites,
    positions=(3, 1, 2),
    cell_axes=("data",),
    batch_size=1,
  )
  assert grid.shape == (2, 3)  # 3 cells, padded to 4 over the two data shards, then cut
  want = reference["float64"][0]["sweep/grid"][:, [3, 1, 2]]
  np.testing.assert_allclose(np.asarray(grid), want, rtol=0, atol=1e-12)
  with pytest.raises(jl.InvalidArgumentError, match="not axes of the mesh") as error:
    jl.sweep.patching_sweep(
      model, variables, 2 * x, x, worker.metric, mesh=mesh, sites=sites, cell_axes=("cells",)
    )
  assert error.value.code == "invalid_argument" and "cell_axes" in str(error.value)
  with pytest.raises(jl.InvalidArgumentError, match="pass the mesh too") as error:
    jl.sweep.patching_sweep(
      model, variables, 2 * x, x, worker.metric, sites=sites, cell_axes=("data",)
    )
  assert error.value.code == "invalid_argument"
  with pytest.raises(jl.InvalidArgumentError) as error:
    jl.sweep.patching_sweep(
      model, variables, 2 * x, x, worker.metric, mesh=mesh, sites=sites, positions=(worker.SEQ,)
    )
  assert error.value.code == "index_out_of_range"


def test_each_process_stores_its_rows_and_they_read_back_as_the_global_array(parity_run):
  """jaxlens.store per process, in parallel; the value itself is compared in the parity test."""
  from jaxlens import store

  _, facts, out = parity_run
  assert [f["float64"]["store_local_rows"] for f in facts] == [[0, 4], [4, 8]]
  for i in range(PROCESSES):
    local = store.open(out / "store_float64" / f"process_{i}")
    assert local.num_rows == worker.BATCH // PROCESSES
    assert (out / "store_float64" / f"process_{i}" / "COMPLETE").exists()


def test_reading_a_trace_or_spec_needs_no_gather(parity_run):
  """repr and spec.check on values split over processes work without jaxlens.distributed."""
  _, facts, _ = parity_run
  for f in facts:
    probes = f["float64"]["probes"]
    for name in ("repr(trace)", "repr(spec)", "spec.check"):
      assert probes[name] is None, (name, probes[name])


# Three places where jaxlens would read an array's values on the host (np.asarray) and
# fail, on a value whose shards live on other processes, with jax's RuntimeError ("Fetching
# value for `jax.Array` that spans non-addressable ... devices"): each must refuse with a typed
# jaxlens error or work; the probes in tests/_dist_worker.py record which.
HOST_READS = {
  "spec.save": "spec_not_portable",
  "store.collect of a global batch": "store_not_local",
  "eager units mask": None,  # works: checks skipped as for a traced mask
}


@pytest.mark.parametrize("probe", sorted(HOST_READS))
def test_values_on_other_processes_are_refused_typed_or_work(parity_run, probe):
  _, facts, _ = parity_run
  for f in facts:
    got = f["float64"]["probes"][probe]
    if HOST_READS[probe] is None:
      assert got is None, got
    else:
      assert got is not None and got["jaxlens"] and got["code"] == HOST_READS[probe], got


def test_sae_training_takes_each_process_rows(parity_run, reference):
  """jaxlens.sae.train over the mesh: each process passed its half of every batch (and got,
  above, the dictionary the one-device run gets on the whole batches)."""
  _, facts, _ = parity_run
  assert [f["float64"]["sae_local_rows"] for f in facts] == [[0, 8], [8, 16]]
  ref, _ = reference["float64"]
  assert ref["sae/mse_loss"][-1] < ref["sae/mse_loss"][0]  # it trained


def test_the_rows_of_one_graph_are_spread_over_both_processes(parity_run, reference):
  """circuits.attribute(mesh=) with the mesh over both processes: every batch of rows came
  back gathered from devices of both (and, above, the adjacency is the one-device graph's)."""
  _, facts, _ = parity_run
  ref, ref_facts = reference["float64"]
  assert ref_facts["circuits_gathers"] == 0  # one process: nothing to gather
  assert all(f["float64"]["circuits_gathers"] >= 2 for f in facts)  # logit and feature rows
  assert (ref["circuits/adjacency"] != 0).sum() > 1000
