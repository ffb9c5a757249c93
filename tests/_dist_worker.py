"""Scenarios run by tests/test_distributed.py, in worker processes and in the test process.

Run as a script, this is one process of a ``jax.distributed`` job on localhost::

  python tests/_dist_worker.py --process-id 0 --num-processes 2 --port 12345 --out DIR

Every process builds a ``(data, model)`` mesh over all devices of all processes (with two
processes of two CPU devices each, ``data`` spans the processes and ``model`` the devices
of one process), places the variables and inputs on it, runs every scenario of
:func:`run_scenarios` and writes ``DIR/result_<i>.npz`` (every value, gathered to the
host) and ``DIR/meta_<i>.json`` (error codes, placement facts, timings). Imported, the
same scenarios run without a mesh, on one device: that is the reference the test
compares with. ``--scenario die`` / ``hang`` run the fault drills instead.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

BATCH, SEQ, WIDTH, HIDDEN = 8, 4, 8, 16
DTYPES = ("float64", "float32")


def _model(dtype):
  import flax.linen as nn
  import jax.numpy as jnp

  class Block(nn.Module):
    """``x + cumsum(down(tanh(up(x))))`` over the sequence: positions mix, causally."""

    @nn.compact
    def __call__(self, x):
      h = nn.Dense(HIDDEN, dtype=dtype, param_dtype=dtype, name="up")(x)
      return x + jnp.cumsum(
        nn.Dense(WIDTH, dtype=dtype, param_dtype=dtype, name="down")(jnp.tanh(h)), axis=1
      )

  class Net(nn.Module):
    @nn.compact
    def __call__(self, x):
      for i in range(2):
        x = Block(name=f"block_{i}")(x)
      return nn.Dense(4, dtype=dtype, param_dtype=dtype, name="head")(x)

  return Net()


def metric(out):
  """The sweep's metric: a module-level function, so every call reuses one compilation."""
  return out[:, -1, 0].mean()


class Placement:
  """Puts host arrays on the mesh (``mesh=None``: on the default device, unsharded)."""

  def __init__(self, mesh):
    self.mesh = mesh

  def put(self, a, *spec):
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    a = np.asarray(a)
    if self.mesh is None:
      return jnp.asarray(a)
    # Every process holds the same host value; each places the shards of its devices.
    return jax.make_array_from_callback(
      a.shape, NamedSharding(self.mesh, P(*spec)), lambda index: a[index]
    )

  def variables(self, host):
    """Dense kernels split on their output axis over ``model``, biases alike (tensor parallel)."""
    import jax

    def spec(path, leaf):
      name = path[-1].key
      if name == "kernel" and leaf.shape[-1] % 2 == 0:
        return (None, "model")
      if name == "bias" and leaf.shape[0] % 2 == 0:
        return ("model",)
      return ()

    return jax.tree_util.tree_map_with_path(lambda p, a: self.put(a, *spec(p, a)), host)


def _host_variables(model, x, seed):
  """numpy-drawn variables (no initialiser compiles), identical in every process."""
  import jax

  rng = np.random.default_rng(seed)
  shapes = jax.eval_shape(model.init, jax.random.key(0), x)

  def draw(path, leaf):
    if "bias" in jax.tree_util.keystr(path[-1:]):
      return rng.normal(0.0, 0.1, leaf.shape).astype(leaf.dtype)
    return rng.normal(0.0, 0.4, leaf.shape).astype(leaf.dtype)

  return jax.tree_util.tree_map_with_path(draw, shapes)


def _flat(prefix, tree, out):
  import jax

  for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
    out[prefix + jax.tree_util.keystr(path)] = leaf


def _probe(fn):
  """``None`` when ``fn()`` runs, else what it raised: class, code (if any), first line."""
  try:
    fn()
    return None
  except Exception as error:  # noqa: BLE001 (recorded, compared by the test)
    import traceback

    import jaxlens as jl

    frames = [
      f for f in traceback.extract_tb(error.__traceback__) if f"jaxlens{os.sep}" in f.filename
    ]
    where = (
      f"{frames[-1].filename.split(os.sep + 'jaxlens' + os.sep)[-1]}:{frames[-1].lineno} "
      f"({frames[-1].name})"
      if frames
      else None
    )
    return {
      "type": type(error).__name__,
      "jaxlens": isinstance(error, jl.JaxlensError),
      "code": getattr(error, "fields", {}).get("code"),
      "where": where,
      "message": str(error).splitlines()[0][:300],
    }


def run_scenarios(mesh, dtype, facts, spec_dir=None):
  """Every scenario on ``mesh`` (or one device); returns name -> array (device or host).

  ``facts`` collects what is not an array: error codes, and where a value lives. In
  float64 every scenario runs; in float32 (to keep the suite lean) the trace, a keeping
  live edit with its gradient and the sweeps.
  """
  full = dtype == "float64"
  import flax.linen as nn  # noqa: F401  (imported before jaxlens, as users do)
  import jax
  import jax.numpy as jnp
  import optax

  import jaxlens as jl
  from jaxlens import distributed as jd
  from jaxlens.intervention import keep_grad

  dt = np.dtype(dtype)
  place = Placement(mesh)
  model = _model(jnp.dtype(dtype))
  rng = np.random.default_rng(1)
  x_h = rng.normal(size=(BATCH, SEQ, WIDTH)).astype(dt)
  donor_x_h = (2.0 * x_h).astype(dt)
  variables_h = _host_variables(model, x_h, seed=2)
  direction_h = rng.normal(size=WIDTH).astype(dt)
  donor_h = rng.normal(size=(BATCH, SEQ, WIDTH)).astype(dt)
  basis_h = np.linalg.qr(rng.normal(size=(WIDTH, 2)))[0].astype(dt)
  mask_h = rng.random((BATCH, SEQ, WIDTH)) < 0.5

  v = place.variables(variables_h)
  x = place.put(x_h, "data")
  donor_x = place.put(donor_x_h, "data")
  site = jl.module("block_0")
  out = {}
  clock = [time.perf_counter()]
  facts["section_seconds"] = {}

  def mark(section):
    now = time.perf_counter()
    facts["section_seconds"][section] = round(now - clock[0], 2)
    clock[0] = now

  def spans(a):
    """Which processes hold a shard of ``a``."""
    return sorted({d.process_index for d in a.sharding.device_set})

  # -- a trace saving sites, jitted and eager ----------------------------------------
  saved = [jl.module("block_0"), jl.module("block_1"), jl.module("block_1/up")]
  capture = jax.jit(lambda v, x: jl.trace(model, v, x, save=saved))
  t = capture(v, x)
  out["trace/output"] = t.output
  for label in ("block_0", "block_1", "block_1/up"):
    out[f"trace/{label}"] = t[label].out
  facts["trace_labels"] = list(t.labels)
  facts["trace_output_processes"] = spans(t.output)
  facts["trace_output_fully_addressable"] = bool(t.output.is_fully_addressable)
  host = jd.host_values(t)  # the whole Trace, gathered to numpy on every process
  facts["host_trace_type"] = type(host).__name__
  out["host/block_1"] = host["block_1"].out
  mark("trace")
  if full:
    eager = jl.trace(model, v, x, save=saved)
    out["eager/output"] = eager.output
    out["eager/block_1"] = eager["block_1"].out

  mark("eager")

  # -- live edits with gradients (a keeping and a cutting verb) and selections (a units
  # mask and a subspace basis placed like the site): every edit in one compiled program --
  direction = place.put(direction_h, "model")
  donor_trace = capture(v, donor_x)
  mask = place.put(mask_h, "data", None, "model")
  basis = place.put(basis_h, "model", None)
  edits = {"live_keep": jl.when(site, keep_grad(jl.steer(direction, 2.0, feature_axis=-1)))}
  if full:
    edits.update(
      {
        "live_cut": jl.when(site, jl.zero_ablate()),
        "select_units": jl.when(jl.units(site, mask), jl.scale(3.0)),
        "select_subspace": jl.when(jl.subspace(site, basis), jl.patch_from(donor_trace)),
        "select_subspace_zero": jl.when(jl.subspace(site, basis), jl.zero_ablate()),
      }
    )

  def loss(v, x, spec):
    y = spec.bind(model)(v, x)
    return jnp.sum(y**2), y

  @jax.jit
  def grads(v, x, edits):
    return {name: jax.grad(loss, has_aux=True)(v, x, spec) for name, spec in edits.items()}

  for name, (g, y) in grads(v, x, edits).items():
    out[f"{name}/output"] = y
    _flat(f"{name}/grad", g, out)
  refusals = {}
  for name, spec in {
    "zero_ablate": jl.when(site, keep_grad(jl.zero_ablate())),
    "replace_with": jl.when(site, keep_grad(jl.replace_with(place.put(donor_h, "data")))),
  }.items():
    try:
      jax.grad(lambda v, spec=spec: jnp.sum(spec.bind(model)(v, x)))(v)
      refusals[name] = None
    except jl.GradientContractError as error:
      refusals[name] = [error.fields["code"], error.fields.get("site")]
  facts["keep_grad_refusals"] = refusals
  mark("live")

  # -- replay and patch_from a donor trace --------------------------------------------
  if full:
    replay = jax.jit(lambda t: t.fork().do(site, jl.scale(0.5)))
    r = replay(t)
    out["replay/output"] = r.output
    out["replay/block_1"] = r["block_1"].out
    patched = jax.jit(
      lambda v, x, d: jl.trace(
        model,
        v,
        x,
        intervene=jl.when(jl.module("block_1"), jl.patch_from(d)),
        save=jl.module("block_1"),
      )
    )(v, x, donor_trace)
    out["patch_from/output"] = patched.output
    out["patch_from/block_1"] = patched["block_1"].out
    out["patch_from/donor_block_1"] = donor_trace["block_1"].out
  mark("replay")

  # -- patching sweeps: jl.sweep's on the sharded model, and one with its cells spread --
  sites = ("block_0", "block_1")
  out["sweep/grid"] = jl.sweep.patching_sweep(model, v, donor_x, x, metric, sites=sites)
  if mesh is not None:
    cells = jl.sweep.patching_sweep(model, v, donor_x, x, metric, mesh=mesh, sites=sites)
    out["sweep_cells/grid"] = cells
    facts["sweep_cells_processes"] = spans(cells)
    facts["sweep_cells_shard_shape"] = list(cells.sharding.shard_shape(cells.shape))
    facts["sweep_cells_local_shards"] = len(cells.addressable_shards)
  mark("sweep")

  # -- optax training steps through an edit (every variant in one compiled step) -------
  target = place.put(rng.normal(size=(BATCH, SEQ, 4)).astype(dt), "data")
  opt = optax.adam(1e-2)
  # float64 only, one keeping edit: what a cutting verb does to the gradient is checked on
  # live_cut.
  train = {}
  if full:
    train = {"train_keep": jl.when(site, keep_grad(jl.steer(direction, 0.5, feature_axis=-1)))}

  # Global arrays are arguments: a jitted function may not close over one that spans
  # other processes' devices.
  @jax.jit
  def step(params, states, x, target, train):
    new = {}
    for name, spec in train.items():
      f = spec.bind(model)
      value, g = jax.value_and_grad(lambda p, f=f: jnp.mean((f(p, x) - target) ** 2))(params[name])
      # optax.adam's bias correction raises a float to its int32 step count, which strict
      # dtype promotion (tests/conftest.py) refuses: only the optimiser runs under standard.
      with jax.numpy_dtype_promotion("standard"):
        updates, state = opt.update(g, states[name], params[name])
      new[name] = (optax.apply_updates(params[name], updates), state, value)
    return new

  params = {name: v for name in train}
  states = {name: opt.init(v) for name in train}
  for i in range(3 if train else 0):
    new = step(params, states, x, target, train)
    for name, (p, state, value) in new.items():
      params[name], states[name] = p, state
      out[f"{name}/loss_{i}"] = value
  for name, p in params.items():
    _flat(f"{name}/params", p, out)
  mark("train")

  # -- a saved spec: written once, loaded by every process ----------------------------
  if not full:
    pass
  elif spec_dir is not None:
    # The donor is split over ``data``: its shards live on different processes.
    spec = jl.when(site, jl.replace_with(place.put(donor_h, "data")))
    path = Path(spec_dir) / f"spec_{dtype}"
    jd.save_spec(spec, path, timeout_s=120)
    loaded = jd.load_spec(path)
    out["spec/output"] = jax.jit(loaded.bind(model))(v, x)
    facts["spec_sha256"] = json.loads((path / "spec.json").read_text())["sha256"]
    # The host boundary without the helpers: what a user who does not gather gets.
    facts["probes"] = {
      "spec.save": _probe(lambda: spec.save(Path(spec_dir) / f"plain_{jax.process_index()}")),
      "repr(trace)": _probe(lambda: repr(t)),
      "repr(spec)": _probe(lambda: repr(spec)),
      "spec.check": _probe(lambda: spec.check(model, v, x).ok),
      # An eager door with a units mask split over processes (jitted, it works above).
      "eager units mask": _probe(
        lambda: jl.when(jl.units(site, mask), jl.scale(3.0)).bind(model)(v, x)
      ),
    }
  else:
    spec = jl.when(site, jl.replace_with(jnp.asarray(donor_h)))  # one process: no saving
    out["spec/output"] = spec.bind(model)(v, x)
  mark("spec")

  # -- the activation store: each process collects the rows of its own devices, in
  # parallel, into a store of its own; read back, they form the global array ----------
  if full and mesh is not None and spec_dir is not None:
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from jaxlens import store

    rows = x.addressable_shards[0].index[0]  # this process's slice of the batch
    local = x_h[rows]
    half = len(local) // 2
    root = Path(spec_dir) / f"store_{dtype}" / f"process_{jax.process_index()}"
    store.collect(
      model, variables_h, [local[:half], local[half:]], root, sites=["block_1"], progress=False
    )
    back = store.open(root).array("block_1")
    out["store/block_1"] = jax.make_array_from_process_local_data(
      NamedSharding(mesh, P("data")), back, (BATCH, SEQ, WIDTH)
    )
    facts["store_local_rows"] = [rows.start or 0, rows.stop]
    facts["probes"]["store.collect of a global batch"] = _probe(
      lambda: store.collect(
        model,
        v,
        [x],
        Path(spec_dir) / f"store_global_{jax.process_index()}",
        sites=["block_1"],
        progress=False,
      )
    )
  elif full:
    out["store/block_1"] = t["block_1"].out
  mark("store")

  # -- SAE training, data parallel: each process passes its own rows of every batch (b_dec
  # starts at the global batch's mean) and gets the one-device run's dictionary ------------
  if full:
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from jaxlens.sae import train as sae_train

    acts_h = np.random.default_rng(3).normal(size=(4, 16, WIDTH)).astype(dt)
    cfg = sae_train.TrainConfig(d_sae=16, architecture="topk", k=3, lr=1e-2, dtype=dtype)
    batches, kw = list(acts_h), {}
    if mesh is not None:
      index = NamedSharding(mesh, P("data")).addressable_devices_indices_map(acts_h.shape[1:])
      rows = next(iter(index.values()))[0]  # this process's rows: the data axis spans processes
      batches, kw = [b[rows] for b in acts_h], {"mesh": mesh, "data_axis": "data"}
      facts["sae_local_rows"] = [rows.start or 0, rows.stop]
    trained = sae_train.train(batches, cfg, steps=len(batches), progress=False, **kw)
    for name in ("W_enc", "b_enc", "W_dec", "b_dec"):
      out[f"sae/{name}"] = getattr(trained.sae, name)
    out["sae/mse_loss"] = jnp.asarray(trained.metrics["mse_loss"])
  mark("sae")

  # -- an attribution graph whose rows are spread over every device of every process --------
  if full:
    out["circuits/adjacency"], facts["circuits_gathers"] = _circuit_graph(mesh, dt)
  mark("circuits")
  return out


def _circuit_graph(mesh, dt):
  """``circuits.attribute`` on a tiny Llama (``mesh=``: each batch of rows spread over the
  mesh, gathered to every process): its dense adjacency, and how many batches came back
  from devices of several processes."""
  import jax.numpy as jnp

  from jaxlens import circuits
  from jaxlens import distributed as jd
  from jaxlens.models import Llama, LlamaConfig
  from jaxlens.sae import Transcoder

  cfg = LlamaConfig(
    vocab_size=29, d_model=8, n_layers=2, n_heads=2, n_kv_heads=1, d_mlp=12, dtype=jnp.dtype(dt)
  )
  model, tokens = Llama(cfg), jnp.asarray([1, 4, 9, 2, 7], jnp.int32)
  variables = _host_variables(model, np.asarray(tokens[None]), seed=4)
  rng = np.random.default_rng(5)
  tcs = [
    Transcoder(
      W_enc=jnp.asarray(rng.normal(0.0, 1.0, (8, 16)).astype(dt)),
      b_enc=jnp.asarray(rng.normal(0.0, 0.1, 16).astype(dt)),
      W_dec=jnp.asarray(rng.normal(0.0, 0.3, (16, 8)).astype(dt)),
      b_dec=jnp.zeros(8, dt),
      W_skip=jnp.asarray(rng.normal(0.0, 0.1, (8, 8)).astype(dt)),
      activation="relu",
    )
    for _ in range(2)
  ]
  gathers = [0]
  plain = jd.host_values

  def counted(tree):
    gathers[0] += 1
    return plain(tree)

  jd.host_values = counted  # what attribute calls on rows that live on several processes
  try:
    graph = circuits.attribute(model, variables, tokens, tcs, mesh=mesh, batch_size=32)
  finally:
    jd.host_values = plain
  return graph.adjacency, gathers[0]


def _init_distributed(args):
  # The inherited XLA flags (tests/conftest.py's compile settings) with this job's device count.
  inherited = os.environ.get("XLA_FLAGS", "").split()
  os.environ["XLA_FLAGS"] = " ".join(
    [f for f in inherited if not f.startswith("--xla_force_host_platform_device_count")]
    + [f"--xla_force_host_platform_device_count={args.devices}"]
  )
  import jax

  jax.config.update("jax_enable_x64", True)
  # As tests/conftest.py: strict dtype promotion. Tracebacks keep jaxlens's frames, which
  # the probes record (where a failure happened).
  jax.config.update("jax_numpy_dtype_promotion", "strict")
  jax.config.update("jax_traceback_filtering", "off")
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(
    coordinator_address=f"127.0.0.1:{args.port}",
    num_processes=args.num_processes,
    process_id=args.process_id,
    initialization_timeout=args.init_timeout,
    heartbeat_timeout_seconds=args.heartbeat_timeout,
    shutdown_timeout_seconds=10,
  )
  return jax


def _parity(args, out_dir):
  jax = _init_distributed(args)
  from jaxlens import distributed as jd

  n = jax.process_count()
  # Auto axes: XLA propagates the shardings of the inputs (the usual multi-host recipe).
  mesh = jax.make_mesh(
    (n, jax.local_device_count()), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2
  )
  facts = {
    "process_index": jax.process_index(),
    "process_count": n,
    "devices": len(jax.devices()),
    "local_devices": jax.local_device_count(),
    "mesh_data_processes": sorted({d.process_index for d in mesh.devices[0]}),
    "seconds": {},
  }
  values = {}
  for dtype in DTYPES:
    start = time.perf_counter()
    dtype_facts = {}
    result = run_scenarios(mesh, dtype, dtype_facts, spec_dir=out_dir)
    result = jd.wait(result, timeout_s=args.step_timeout, what=f"scenarios {dtype}")
    gather = time.perf_counter()
    host = jd.host_values(result)
    dtype_facts["section_seconds"]["gather"] = round(time.perf_counter() - gather, 2)
    values.update({f"{dtype}:{k}": np.asarray(a) for k, a in host.items()})
    facts[dtype] = dtype_facts
    facts["seconds"][dtype] = round(time.perf_counter() - start, 2)
  np.savez(out_dir / f"result_{args.process_id}.npz", **values)
  (out_dir / f"meta_{args.process_id}.json").write_text(json.dumps(facts, indent=1))


def _fault(args, out_dir):
  """Process 1 dies or hangs before a collective; the others must fail, typed and in time."""
  jax = _init_distributed(args)
  import jax.numpy as jnp
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  from jaxlens import distributed as jd

  if args.scenario == "die":
    # The layout docs/scaling.md recommends: the batch split across processes, each
    # process's devices on a second axis. A dead peer makes gloo fail the collective at
    # once (a JaxRuntimeError), not hang.
    mesh = jax.make_mesh(
      (jax.process_count(), jax.local_device_count()),
      ("data", "model"),
      axis_types=(jax.sharding.AxisType.Auto,) * 2,
    )
    a = jax.make_array_from_callback(
      (4, 8), NamedSharding(mesh, P("data", "model")), lambda index: np.ones((4, 8))[index]
    )
  else:
    mesh = jax.make_mesh(
      (len(jax.devices()),), ("cells",), axis_types=(jax.sharding.AxisType.Auto,)
    )
    a = jax.make_array_from_callback(
      (8,), NamedSharding(mesh, P("cells")), lambda index: np.arange(8.0)[index]
    )
  total = jax.jit(lambda a: jnp.sum(a**2))
  jd.wait(total(a), timeout_s=args.step_timeout)  # compiled and run once by everyone
  report = {"process_index": jax.process_index()}
  if args.process_id == 1:
    if args.scenario == "die":
      os._exit(3)
    time.sleep(3600)  # hang: alive (heartbeats flow) but never reaches the collective
  start = time.monotonic()
  try:
    jd.wait(total(2 * a), timeout_s=args.step_timeout, what="step 2")
    report["error"] = None
  except jd.DistributedError as error:
    report["error"] = {
      "type": type(error).__name__,
      "code": error.code,
      "message": str(error),
      "fields": error.fields,
    }
  except Exception as error:  # noqa: BLE001 (what jd.wait let through, for the test to see)
    report["error"] = {"type": type(error).__name__, "code": None, "message": str(error)}
  report["seconds"] = round(time.monotonic() - start, 2)
  if args.scenario == "hang":
    try:
      jd.barrier("after-step-2", timeout_s=args.step_timeout)
      report["barrier_error"] = None
    except jd.DistributedError as error:
      report["barrier_error"] = {
        "type": type(error).__name__,
        "code": error.code,
        "message": str(error),
      }
  (out_dir / f"meta_{args.process_id}.json").write_text(json.dumps(report, indent=1))
  sys.stdout.flush()
  # The step that never finished still holds a thread inside the collective: leave at once
  # rather than let jax.distributed's shutdown wait on the missing process.
  os._exit(0)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--process-id", type=int, required=True)
  parser.add_argument("--num-processes", type=int, required=True)
  parser.add_argument("--port", type=int, required=True)
  parser.add_argument("--devices", type=int, default=2, help="CPU devices per process")
  parser.add_argument("--out", type=Path, required=True)
  parser.add_argument("--scenario", choices=("parity", "die", "hang"), default="parity")
  parser.add_argument("--init-timeout", type=int, default=60)
  parser.add_argument("--heartbeat-timeout", type=int, default=60)
  parser.add_argument("--step-timeout", type=float, default=120.0)
  args = parser.parse_args(argv)
  args.out.mkdir(parents=True, exist_ok=True)
  if args.scenario == "parity":
    _parity(args, args.out)
  else:
    _fault(args, args.out)


if __name__ == "__main__":
  main()
