"""The same patching sweep on 1 process x 4 devices and on 2 processes x 2 devices.

A tiny GPT (``jaxlens.models.GPT``, float32) and a clean/corrupt pair are swept over
every block x every position in two layouts, each on a ``(data=2, model=2)`` mesh:

* cells: ``jl.sweep.patching_sweep(..., mesh=)``, the positions split over all four
  devices; every device holds the whole model and replays its own cells;
* tensor-parallel: ``jl.sweep.patching_sweep`` on the mesh, the batch split over
  ``data`` and every Dense kernel of the GPT over ``model`` (XLA partitions the sweep).

Each layout runs once in one process with four CPU devices and once in two processes
(``jax.distributed`` on localhost, gloo collectives) with two devices each, where the
``data`` axis spans the processes. The script reports, per layout, the ratio of medians
(2 x 2 / 1 x 4; reported, not asserted), and the bytes the compiled program moves per
cell in collectives whose device group spans both processes, and in those within one,
read from its optimised HLO (a ring model: an all-reduce of ``S`` bytes over ``g``
devices sends ``2 (g - 1) / g * S`` per device). With two processes on CPU every
collective goes through gloo (TCP), also between two devices of one process. From those it writes an estimate for a full
layer x position sweep of a 7B Llama on 64 accelerators (see ``docs/scaling.md``).

Usage::

  python benchmarks/bench_distributed.py [--repeats 5] [--layers 2] [--d-model 32] [--seq 8]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

_ROOT = Path(__file__).resolve().parent.parent
if str(_ROOT) not in sys.path:
  sys.path.insert(0, str(_ROOT))

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "distributed.json"
_OPS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
_DTYPE_BYTES = {
  "f64": 8,
  "f32": 4,
  "bf16": 2,
  "f16": 2,
  "s32": 4,
  "u32": 4,
  "s8": 1,
  "u8": 1,
  "pred": 1,
  "s64": 8,
  "u64": 8,
}


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--repeats", type=int, default=5)
  p.add_argument("--layers", type=int, default=2)
  p.add_argument("--d-model", type=int, default=32)
  p.add_argument("--seq", type=int, default=8)
  p.add_argument("--batch", type=int, default=4)
  p.add_argument("--timeout", type=float, default=600.0, help="per job, seconds")
  p.add_argument("--out", default=str(DEFAULT_OUT), help="JSON result path ('' to skip)")
  # Internal: one process of a job.
  p.add_argument("--role", default="main", choices=("main", "worker"))
  p.add_argument("--processes", type=int, default=1)
  p.add_argument("--process-id", type=int, default=0)
  p.add_argument("--port", type=int, default=0)
  p.add_argument("--result", default="")
  return p.parse_args(argv)


# -- collectives in optimised HLO --------------------------------------------------------


def _shape_bytes(text: str) -> int:
  total = 0
  for dtype, dims in re.findall(r"\b([a-z]+\d*)\[([\d,]*)\]", text):
    if dtype in _DTYPE_BYTES:
      n = 1
      for d in filter(None, dims.split(",")):
        n *= int(d)
      total += n * _DTYPE_BYTES[dtype]
  return total


def _groups(line: str, n_devices: int) -> list[list[int]]:
  """The device groups of a collective: explicit (``{{0,1},{2,3}}``), iota (``[2,2]<=[4]``,
  ``[2,2]<=[2,2]T(1,0)``) or over a mesh (``mesh['axis_0'=2,'axis_1'=2] {'axis_1'}``: the
  devices numbered row-major over the mesh, a group for each value of the other axes)."""
  import numpy as np

  m = re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", line)
  if m:
    axes = re.findall(r"'([^']+)'=(\d+)", m.group(1))
    names, sizes = [a for a, _ in axes], [int(n) for _, n in axes]
    grouped = [names.index(a) for a in re.findall(r"'([^']+)'", m.group(2))]
    rest = [i for i in range(len(names)) if i not in grouped]
    ids = np.arange(int(np.prod(sizes))).reshape(sizes).transpose(rest + grouped)
    return ids.reshape(-1, int(np.prod([sizes[i] for i in grouped]))).tolist()
  m = re.search(r"replica_groups=\{(\{[\d,{}]*\})\}", line)
  if m:
    return [[int(i) for i in g.split(",") if i] for g in re.findall(r"\{([\d,]*)\}", m.group(1))]
  m = re.search(r"replica_groups=\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", line)
  if m:
    shape = [int(i) for i in m.group(1).split(",")]
    src = [int(i) for i in m.group(2).split(",")]
    ids = np.arange(int(np.prod(src))).reshape(src)
    if m.group(3):
      ids = ids.transpose([int(i) for i in m.group(3).split(",")])
    return ids.reshape(shape).tolist()
  m = re.search(r"source_target_pairs=\{([\d,{}]*)\}", line)
  if m:
    return [[int(i) for i in g.split(",")] for g in re.findall(r"\{(\d+,\d+)\}", m.group(1))]
  return [list(range(n_devices))]


def collectives(hlo: str, process_of: list[int]) -> dict:
  """Counts the collectives of an optimised HLO module and the bytes they move.

  ``process_of[i]`` is the process of logical device ``i``. Returns per op kind the
  count, and the bytes sent (ring model, summed over the devices of every group) by
  groups that span processes (``cross_bytes``) and by all groups (``all_bytes``).
  """
  out = {op: {"count": 0, "cross_bytes": 0.0, "all_bytes": 0.0} for op in _OPS}
  for line in hlo.splitlines():
    m = re.match(r"\s*(?:ROOT\s+)?%\S+\s*=\s*(.*?)\s(" + "|".join(_OPS) + r")(-start)?\(", line)
    if not m:
      continue
    size, op = _shape_bytes(m.group(1)), m.group(2)
    for group in _groups(line, len(process_of)):
      g = len(group)
      if op == "collective-permute":
        sent = float(size)  # one source sends its buffer to one target
      elif op == "all-reduce":
        sent = 2.0 * (g - 1) / g * size * g
      elif op == "reduce-scatter":
        sent = (g - 1) * size * g  # size is one device's scattered shard
      else:  # all-gather (size: the gathered result), all-to-all
        sent = (g - 1) / g * size * g
      out[op]["all_bytes"] += sent
      if len({process_of[i] for i in group if i < len(process_of)}) > 1:
        out[op]["cross_bytes"] += sent
    out[op]["count"] += 1
  return out


# -- one process of a job ----------------------------------------------------------------


def metric(out):
  return out[:, -1, 0].mean()


def worker(args) -> None:
  os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={4 // args.processes}"
  import jax

  if args.processes > 1:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
      coordinator_address=f"127.0.0.1:{args.port}",
      num_processes=args.processes,
      process_id=args.process_id,
      initialization_timeout=120,
      heartbeat_timeout_seconds=120,
    )
  import jax.numpy as jnp
  import numpy as np
  from jax.sharding import AxisType, NamedSharding
  from jax.sharding import PartitionSpec as P

  import jaxlens as jl
  from benchmarks._timing import interleaved, median
  from jaxlens import distributed as jd
  from jaxlens import models
  from jaxlens.sweep import _patching as sweep_internals  # the compiled program, for its HLO

  mesh = jax.make_mesh((2, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
  model, host_vars, clean = models.init_gpt(
    0,
    "small",
    batch=args.batch,
    n_layers=args.layers,
    d_model=args.d_model,
    n_heads=min(4, args.d_model),
    max_len=args.seq,
    dtype=jnp.float32,
  )
  host_vars = jax.tree.map(np.asarray, host_vars)
  clean = np.asarray(clean)
  corrupt = clean.copy()
  corrupt[:, args.seq // 2] = (corrupt[:, args.seq // 2] + 1) % model.vocab_size

  def put(a, *spec):
    return jax.make_array_from_callback(
      a.shape, NamedSharding(mesh, P(*spec)), lambda index: a[index]
    )

  def tp_spec(path, leaf):
    name = path[-1].key
    if name == "kernel" and leaf.shape[-1] % 2 == 0:
      return (None,) * (leaf.ndim - 1) + ("model",)
    return ()

  replicated = jax.tree.map(put, host_vars)
  tp_vars = jax.tree_util.tree_map_with_path(lambda p, a: put(a, *tp_spec(p, a)), host_vars)
  sites = jl.sweep.layer_sites(model.n_layers)
  cells = len(sites) * args.seq

  rc, rk = put(clean), put(corrupt)
  dc, dk = put(clean, "data"), put(corrupt, "data")
  tp_sweep = jax.jit(lambda v, c, k: jl.sweep.patching_sweep(model, v, c, k, metric, sites=sites))
  runs = {
    "cells": lambda: jl.sweep.patching_sweep(
      model, replicated, rc, rk, metric, mesh=mesh, sites=sites
    ),
    "tensor_parallel": lambda: tp_sweep(tp_vars, dc, dk),
  }
  grids = {name: jd.host_values(jd.wait(run(), timeout_s=600)) for name, run in runs.items()}
  positions = jax.make_array_from_callback(
    (args.seq,),
    NamedSharding(mesh, P(("data", "model"))),
    lambda index: np.arange(args.seq, dtype=np.int32)[index],
  )
  hlo = {
    "cells": sweep_internals._sharded_sweep.lower(
      model,
      replicated,
      rc,
      rk,
      positions,
      metric=metric,
      sites=tuple(sites),
      mesh=mesh,
      cell_axes=("data", "model"),
      batch_size=None,
    )
    .compile()
    .as_text(),
    "tensor_parallel": tp_sweep.lower(tp_vars, dc, dk).compile().as_text(),
  }
  # Logical device i of a compiled program is mesh.devices.flat[i]; with one process
  # the "process" is the one the same device would have in the two-process job.
  flat = list(mesh.devices.flat)
  process_of = (
    [d.process_index for d in flat] if args.processes > 1 else [i // 2 for i in range(len(flat))]
  )
  fns = {name: (lambda run=run: jd.wait(run(), timeout_s=600)) for name, run in runs.items()}
  if args.processes == 1:
    # A cell's cost in plain forwards, on one device: the sweep / cells / a forward.
    forward = jax.jit(model.apply)
    one_device = jax.jit(
      lambda v, c, k: jl.sweep.patching_sweep(model, v, c, k, metric, sites=sites)
    )
    fns["one_device_sweep"] = lambda: one_device(host_vars, clean, corrupt)
    fns["one_device_forward"] = lambda: forward(host_vars, corrupt)
  times = interleaved(fns, args.repeats)
  if jax.process_index() == 0:
    Path(args.result).write_text(
      json.dumps(
        {
          "processes": args.processes,
          "devices": jax.device_count(),
          "cells": cells,
          "median_s": {name: median(ts) for name, ts in times.items()},
          "all_s": times,
          "grids": {name: np.asarray(g).tolist() for name, g in grids.items()},
          "collectives": {name: collectives(text, process_of) for name, text in hlo.items()},
        },
        indent=1,
      )
    )
  jd.barrier("bench-done", timeout_s=120)


# -- the main process --------------------------------------------------------------------


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _job(args, processes: int, result: Path) -> dict:
  common = [
    "--role",
    "worker",
    "--processes",
    str(processes),
    "--result",
    str(result),
    "--repeats",
    str(args.repeats),
    "--layers",
    str(args.layers),
    "--d-model",
    str(args.d_model),
    "--seq",
    str(args.seq),
    "--batch",
    str(args.batch),
    "--port",
    str(_free_port()),
  ]
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  env.pop("XLA_FLAGS", None)
  procs = [
    subprocess.Popen(
      [sys.executable, __file__, *common, "--process-id", str(i)], env=env, start_new_session=True
    )
    for i in range(processes)
  ]
  end = time.monotonic() + args.timeout
  try:
    while time.monotonic() < end and any(p.poll() is None for p in procs):
      time.sleep(0.2)
  finally:
    for p in procs:
      if p.poll() is None:
        os.killpg(p.pid, 9)
        p.wait()
  codes = [p.returncode for p in procs]
  if codes != [0] * processes:
    raise RuntimeError(f"the {processes}-process job failed: exit codes {codes}")
  return json.loads(result.read_text())


def estimate_7b(
  tiny_cell_over_forward: float, cross_bytes_per_cell: float, activations_per_cell_layer: float
) -> dict:
  """A full layer x position sweep of a 7B Llama on 64 accelerators, written out.

  Llama-2-7B: 32 layers, d_model 4096, MLP 11008, 6.7e9 parameters, bfloat16; the sweep
  patches each of the 32 block outputs at each of 512 positions (16384 cells), batch 8,
  on 64 accelerators (8 hosts x 8, H100-class: 989 TFLOP/s dense bf16, 40 % of it used;
  NVLink 450 GB/s within a host).

  Cells layout (``jl.sweep.patching_sweep(..., mesh=)``): every device holds the model
  and both traces and replays 256 cells. A cell at layer ``l`` recomputes layers
  ``l..31`` and the head: on average (L + 1) / 2L of a forward in arithmetic (on the
  tiny benchmark model a cell costs ``tiny_cell_over_forward`` forwards, lower because
  vmapping amortises the dispatch that dominates there). Nothing crosses devices but
  one float per cell.

  Tensor-parallel layout (``jl.sweep.patching_sweep`` on a (data, model) mesh: batch
  over the 8 hosts, kernels over the 8 devices of a host): what crosses hosts per cell
  is the metric's reduction over the batch (``cross_bytes_per_cell``, measured, does not
  grow with the model); within a host the kernels' split gathers activations,
  ``activations_per_cell_layer`` ``(batch, seq, d)`` activations per cell and replayed
  layer (measured on the benchmark model), scaled to the 7B model's bf16 activations of
  one host's batch share and 16.5 replayed layers per cell.
  """
  layers, d, mlp, params, seq, batch, devices, hosts = 32, 4096, 11008, 6.7e9, 512, 8, 64, 8
  bf16 = 2
  cells = layers * seq
  forward_s = 2 * params * seq * batch / (989e12 * 0.4)
  cone = (layers + 1) / (2 * layers)
  per_device = cells / devices
  activation = batch * seq * d * bf16
  # Values a default trace saves per layer and position: q, k, v, attention out, 2 norms,
  # the block output (d each), gate and up (mlp each), down (d): about 8 d + 2 mlp.
  saved_per_layer = (8 * d + 2 * mlp) * batch * seq * bf16
  chunk = 16  # cells replayed at once (batch_size=16): a few activations and the scores each
  chunk_bytes = chunk * (4 * activation + batch * 32 * seq * seq * bf16)
  intra = activations_per_cell_layer * cone * layers * activation / hosts
  return {
    "cells": cells,
    "cells_per_device": per_device,
    "forward_s": forward_s,
    "cell_over_forward": cone,
    "tiny_cell_over_forward_measured": tiny_cell_over_forward,
    "cells_layout_s": per_device * cone * forward_s + 2 * forward_s,
    "memory_per_device_gb": {
      "weights": params * bf16 / 1e9,
      "clean_trace_32_block_outputs": layers * activation / 1e9,
      "corrupt_trace_all_module_sites": layers * saved_per_layer / 1e9,
      f"replay_chunk_of_{chunk}": chunk_bytes / 1e9,
    },
    "cells_layout_bytes_per_cell": 4,
    "tensor_parallel_cross_host_bytes_per_cell": cross_bytes_per_cell,
    "tensor_parallel_intra_host_bytes_per_cell": intra,
    "tensor_parallel_intra_host_s_at_450GBps": intra * cells / 450e9,
  }


def main(argv=None) -> dict:
  args = parse_args(argv)
  if args.role == "worker":
    worker(args)
    return {}
  import tempfile

  from benchmarks._timing import env_info, ratio, report, row

  with tempfile.TemporaryDirectory() as tmp:
    one = _job(args, 1, Path(tmp) / "one.json")
    two = _job(args, 2, Path(tmp) / "two.json")
  import numpy as np

  for name in one["grids"]:
    diff = float(np.max(np.abs(np.subtract(one["grids"][name], two["grids"][name]))))
    if diff > 1e-5:
      raise AssertionError(f"{name}: the two layouts' grids differ by {diff}")
  cells = one["cells"]
  rows, per_cell = [], {}
  for name in two["median_s"]:
    cross = sum(c["cross_bytes"] for c in two["collectives"][name].values())
    within = sum(c["all_bytes"] - c["cross_bytes"] for c in two["collectives"][name].values())
    per_cell[name] = {
      "cross_process_bytes": cross / cells,
      "within_process_bytes": within / cells,
      "collectives": {op: c["count"] for op, c in two["collectives"][name].items() if c["count"]},
    }
    rows.append(
      row(
        f"distributed_{name}",
        f"sweep, {name} layout: 2 processes x 2 devices / 1 process x 4 devices",
        ratio(two["median_s"][name], one["median_s"][name]),
        candidate="2 x 2 (gloo)",
        baseline="1 x 4",
        candidate_value=two["median_s"][name],
        baseline_value=one["median_s"][name],
        note=f"{cross / cells:.0f} bytes per cell in collectives spanning processes, "
        f"{within / cells:.0f} in collectives within one",
      )
    )
  med = one["median_s"]
  activation = args.batch * args.seq * args.d_model * 4
  estimate = estimate_7b(
    tiny_cell_over_forward=med["one_device_sweep"] / cells / med["one_device_forward"],
    cross_bytes_per_cell=per_cell["tensor_parallel"]["cross_process_bytes"],
    activations_per_cell_layer=per_cell["tensor_parallel"]["within_process_bytes"]
    / activation
    / args.layers,
  )
  result = {
    "benchmark": "distributed",
    "title": "one sweep, 1 process x 4 devices vs 2 x 2",
    "config": {
      "layers": args.layers,
      "d_model": args.d_model,
      "seq": args.seq,
      "batch": args.batch,
      "repeats": args.repeats,
      "cells": cells,
    },
    "env": env_info(),
    "rows": rows,
    "one": one,
    "two": two,
    "per_cell": per_cell,
    "estimate_7b_64": estimate,
  }
  header = "| layout | 1x4 s | 2x2 s | ratio | B/cell across processes | B/cell within |"
  lines = [result["title"], "", header, "|---|---|---|---|---|---|"]
  for r in rows:
    name = r["key"].removeprefix("distributed_")
    lines.append(
      f"| {name} | {r['baseline_value']:.4f} | {r['candidate_value']:.4f} | "
      f"{r['value']:.2f} | {per_cell[name]['cross_process_bytes']:.0f} | "
      f"{per_cell[name]['within_process_bytes']:.0f} |"
    )
  lines.append("")
  e = estimate
  lines.append(
    f"7B Llama, 32 layers x 512 positions, batch 8, on 64 devices (cells layout): "
    f"{e['cells_layout_s']:.0f} s, {e['cells_per_device']:.0f} cells per device; "
    f"memory per device (GB): "
    + ", ".join(f"{k} {v:.1f}" for k, v in e["memory_per_device_gb"].items())
  )
  lines.append(
    f"tensor-parallel layout: {e['tensor_parallel_cross_host_bytes_per_cell']:.0f} B "
    f"across hosts and {e['tensor_parallel_intra_host_bytes_per_cell'] / 1e6:.0f} MB "
    f"within a host per cell, {e['tensor_parallel_intra_host_s_at_450GBps']:.0f} s "
    "of NVLink transfer"
  )
  return report(result, "\n".join(lines), args.out)


if __name__ == "__main__":
  main(sys.argv[1:])
