"""A torch peer (SAELens, pyvene) timed at its best thread setting, beside jaxlens.

torch's default intra-op thread count on a small machine that other processes share can be
its worst setting (its threads spin-wait for a core), and one thread its best; which wins
depends on the shapes and on the load. :func:`against_torch_peer` therefore calls jaxlens,
the peer with ``torch.set_num_threads(1)`` and the peer with torch's default thread count
alternately in one process (the order rotates every round), records the wall time and the
process's CPU time (user + system, ``resource.getrusage``) of every call, and compares
jaxlens with whichever torch setting had the lower median wall time.
"""

from __future__ import annotations

import resource
import time
from typing import Any, Callable

from benchmarks._timing import block, median

__all__ = ["against_torch_peer", "cpu_seconds"]


def cpu_seconds() -> float:
  """The process's CPU time so far, user + system, in seconds (all its threads)."""
  r = resource.getrusage(resource.RUSAGE_SELF)
  return r.ru_utime + r.ru_stime


def against_torch_peer(
  ours: Callable[[], Any],
  peer: Callable[[], Any],
  repeats: int,
  *,
  per_call: int = 1,
  warmup: int = 1,
  peer_name: str = "peer",
) -> dict:
  """Times ``ours`` against ``peer`` at torch's one-thread and default settings.

  Args:
    ours: a zero-argument callable (already compiled: the caller warms it up).
    peer: the torch side, a zero-argument callable.
    repeats: timed calls of each of the three.
    per_call: the steps one call runs (the figures are per step).
    warmup: untimed calls of each first.
    peer_name: the peer's name in the result.

  Returns:
    ``{"jaxlens": {...}, "<peer> 1 thread": {...}, "<peer> N threads": {...}, "best_torch":
    name, "threads_default": N, "speedup_wall": peer best / ours, "speedup_cpu": ...}``;
    each side's ``wall_ms`` and ``cpu_ms`` are medians per step, ``wall_ms_all`` every call.
  """
  import torch

  default = torch.get_num_threads()
  one, many = f"{peer_name} 1 thread", f"{peer_name} {default} threads"
  settings = {one: 1, many: default}
  fns: dict[str, Callable[[], Any]] = {"jaxlens": ours, one: peer, many: peer}

  def call(name):
    if name in settings:
      torch.set_num_threads(settings[name])
    return fns[name]()

  names = list(fns)
  for _ in range(warmup):
    for name in names:
      block(call(name))
  walls: dict[str, list[float]] = {n: [] for n in names}
  cpus: dict[str, list[float]] = {n: [] for n in names}
  try:
    for r in range(repeats):
      order = names[r % 3 :] + names[: r % 3]
      for name in order if r % 2 == 0 else order[::-1]:
        if name in settings:
          torch.set_num_threads(settings[name])
        c0, t0 = cpu_seconds(), time.perf_counter()
        block(fns[name]())
        walls[name].append((time.perf_counter() - t0) / per_call)
        cpus[name].append((cpu_seconds() - c0) / per_call)
  finally:
    torch.set_num_threads(default)
  out: dict[str, Any] = {
    n: {
      "wall_ms": 1000 * median(walls[n]),
      "cpu_ms": 1000 * median(cpus[n]),
      "wall_ms_all": [round(1000 * w, 3) for w in walls[n]],
    }
    for n in names
  }
  best = min((one, many), key=lambda n: out[n]["wall_ms"])
  out["best_torch"] = best
  out["threads_default"] = default
  out["speedup_wall"] = out[best]["wall_ms"] / out["jaxlens"]["wall_ms"]
  out["speedup_cpu"] = out[best]["cpu_ms"] / out["jaxlens"]["cpu_ms"]
  return out
