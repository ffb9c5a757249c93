"""jaxlens across processes: helpers for a mesh that spans several hosts (``jaxlens.distributed``).

Under ``jax.distributed`` every process runs the same program on a global mesh, and what
jaxlens returns (a Trace's saved values, a door's output, a sweep's grid) is a global
``jax.Array`` of which each process holds only its own shards. Doors, traces, replay and
sweeps need nothing new for that: they are JAX programs and ``jit`` partitions them. What
does need care is the boundary with the host, and faults:

- :func:`host_values`: the full value of global arrays on every process (a collective:
  every process calls it with the same tree).
- :func:`save_spec`: a spec whose arrays are sharded over processes, gathered, written once
  by process 0, then a barrier, so that every process can :func:`jaxlens.load_spec` it.
- :func:`wait` and :func:`barrier`: bounded waits that raise :class:`DistributedError`
  when another process has died or hangs, instead of blocking forever.

A patching sweep whose cells are spread over every device of every process is
:func:`jaxlens.sweep.patching_sweep` with ``mesh=``.

``docs/scaling.md`` has the launch recipe for a GPU cluster and a TPU pod;
``tests/test_distributed.py`` runs all of this with two processes on localhost.
"""

from __future__ import annotations

import functools
import time
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxlens.core import JaxlensError
from jaxlens.core import load_spec as _load_spec
from jaxlens.core import save_spec as _save_spec
from jaxlens.internal import split_over_processes

__all__ = [
  "DistributedError",
  "barrier",
  "host_values",
  "load_spec",
  "save_spec",
  "wait",
]


class DistributedError(JaxlensError, RuntimeError):
  """Another process died or hangs: a bounded wait ran out.

  Attributes:
    fields: ``"code"`` (``process_timeout`` or ``barrier_timeout``), ``"process"``
      (this process's index), ``"waited_s"``, ``"fix"``.
  """


def _leaves(tree) -> list:
  return [leaf for leaf in jax.tree.leaves(tree) if isinstance(leaf, jax.Array)]


@functools.lru_cache(maxsize=64)
def _replicate(mesh, n: int):
  """The jitted identity of ``n`` arrays that replicates them over ``mesh`` (one per mesh and
  count, so repeated calls reuse its compiled program instead of tracing a new function)."""
  return jax.jit(lambda *xs: xs, out_shardings=(NamedSharding(mesh, P()),) * n)


def host_values(tree):
  """``tree`` with every ``jax.Array`` replaced by its full value as a numpy array.

  Arrays whose shards live on other processes are gathered: those placed with a
  ``NamedSharding`` all at once, by one jitted identity that replicates them (one
  compilation and one exchange for the whole tree), any other with
  ``jax.experimental.multihost_utils.process_allgather``. That is a collective: every
  process must call this with a tree of the same structure and shardings, or the call
  waits for the missing ones. A ``Trace`` or a ``Spec`` is a pytree, so
  ``host_values(trace)[label].out`` is a numpy array.
  """
  from jax.experimental import multihost_utils

  leaves, treedef = jax.tree.flatten(tree)
  remote = [i for i, leaf in enumerate(leaves) if split_over_processes(leaf)]
  named = [i for i in remote if isinstance(leaves[i].sharding, NamedSharding)]
  by_mesh: dict[Any, list[int]] = {}
  for i in named:
    by_mesh.setdefault(leaves[i].sharding.mesh, []).append(i)
  for mesh, group in by_mesh.items():  # one program per mesh (a program has one device set)
    gathered = _replicate(mesh, len(group))(*(leaves[i] for i in group))
    for i, value in zip(group, gathered):
      leaves[i] = value
  for i in remote:
    if i not in named:
      leaves[i] = multihost_utils.process_allgather(leaves[i], tiled=True)
  # A replicated array holds its whole value on this process's devices.
  leaves = [
    np.asarray(leaf.addressable_data(0))
    if split_over_processes(leaf)
    else np.asarray(leaf)
    if isinstance(leaf, jax.Array)
    else leaf
    for leaf in leaves
  ]
  return jax.tree.unflatten(treedef, leaves)


def wait(tree, *, timeout_s: float, what: str = "computation", poll_s: float = 0.01):
  """Blocks until every array of ``tree`` is computed, for at most ``timeout_s`` seconds.

  A collective waits for every process taking part. When one of them has died or hangs,
  ``jax.block_until_ready`` would wait forever (or until JAX's heartbeat timeout kills
  this process with a fatal log, for a process that died); this raises a
  :class:`DistributedError` ``process_timeout`` instead, also when the collective fails
  at once because a peer's connection closed (gloo's "Connection closed by peer" when the
  batch is split across processes). Dispatch is asynchronous, so the wait covers the
  computation, not its compilation. Any other error of the computation itself propagates
  as JAX raises it. Returns ``tree``.
  """
  leaves = _leaves(tree)
  start = time.monotonic()
  try:
    while not all(leaf.is_ready() for leaf in leaves):
      waited = time.monotonic() - start
      if waited > timeout_s:
        raise DistributedError(
          f"{what} not finished after {waited:.1f} s on process {jax.process_index()} of "
          f"{jax.process_count()}: a process it waits for has died or hangs",
          code="process_timeout",
          process=jax.process_index(),
          waited_s=round(waited, 3),
          fix="read the other processes' logs; if the step is only slow, raise timeout_s "
          "(and jax.distributed.initialize(heartbeat_timeout_seconds=...))",
        )
      time.sleep(poll_s)
    return jax.block_until_ready(tree)
  except DistributedError:
    raise
  except Exception as error:  # jax raises its own JaxRuntimeError subclasses
    if not _peer_failure(error):
      raise
    waited = time.monotonic() - start
    first = str(error).splitlines()[0] if str(error) else type(error).__name__
    raise DistributedError(
      f"{what} failed after {waited:.1f} s on process {jax.process_index()} of "
      f"{jax.process_count()}: a process it waits for has died or hangs (its collective "
      f"lost a peer: {first})",
      code="process_timeout",
      process=jax.process_index(),
      waited_s=round(waited, 3),
      cause=first,
      fix="read the other processes' logs; restart the job from its last checkpoint",
    ) from error


# What a collective's error says when a peer process is gone (gloo on CPU, NCCL and the
# coordination service on GPU): such an error is a dead process, not a bug of the step.
_PEER_SIGNS = (
  "connection closed by peer",
  "connection reset",
  "broken pipe",
  "gloo",
  "nccl",
  "unavailable",
  "socket closed",
  "heartbeat",
  "tasks are unhealthy",
)


def _peer_failure(error: BaseException) -> bool:
  if jax.process_count() == 1:
    return False
  text = str(error).lower()
  return any(sign in text for sign in _PEER_SIGNS)


def _client():
  # jax keeps the coordination-service client of jax.distributed.initialize here; there
  # is no public accessor (orbax reads it the same way).
  from jax._src import distributed

  return distributed.global_state.client


def barrier(name: str, *, timeout_s: float) -> None:
  """Waits until every process reaches the barrier ``name``, for at most ``timeout_s``.

  Uses the coordination service of ``jax.distributed`` (no device collective), so it
  also works between programs. Raises :class:`DistributedError` ``barrier_timeout``
  naming the barrier when a process does not arrive in time. Without
  ``jax.distributed`` (one process) it returns at once. Every process must pass the
  barriers of one name the same number of times (the coordination service counts them).
  """
  client = _client()
  if client is None or jax.process_count() == 1:
    return
  start = time.monotonic()
  try:
    client.wait_at_barrier(name, int(timeout_s * 1000))
  except Exception as error:  # jax raises its own XlaRuntimeError subclasses here
    waited = time.monotonic() - start
    raise DistributedError(
      f"barrier {name!r}: not every process arrived within {timeout_s} s "
      f"(process {jax.process_index()} of {jax.process_count()} waited {waited:.1f} s): "
      f"{str(error).splitlines()[0]}",
      code="barrier_timeout",
      process=jax.process_index(),
      waited_s=round(waited, 3),
      barrier=name,
      fix="read the other processes' logs; every process must call barrier() with the same name",
    ) from error


def save_spec(spec, path, *, timeout_s: float = 300.0):
  """Saves ``spec`` once for all processes; every process may load ``path`` on return.

  Its arrays are gathered to the host (:func:`host_values`, a collective, so every
  process calls this), process 0 writes the directory with :func:`jaxlens.save_spec`
  (atomically), and a :func:`barrier` holds the others until it is complete. ``path``
  must be on a file system that every process sees. Returns ``path``.
  """
  host = host_values(spec)
  try:
    if jax.process_index() == 0:
      _save_spec(host, path)
  finally:
    # Also when process 0's save raised (e.g. spec_target_exists): the others then pass
    # the barrier at once and get spec_not_found from load_spec, not a barrier timeout.
    barrier(f"jaxlens.save_spec:{path}", timeout_s=timeout_s)
  return path


def load_spec(path):
  """:func:`jaxlens.load_spec`: every process reads the directory (no collective)."""
  return _load_spec(path)
