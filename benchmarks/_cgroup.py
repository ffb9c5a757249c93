"""A memory budget for a benchmark process: a cgroup-v1 memory cgroup (run as root) whose
``memory.limit_in_bytes`` is the budget, joined by the process after its setup (what it held
before stays charged where it was, so the budget is above the process's baseline), and a
sampler of the process's anonymous resident memory (``RssAnon``: what the page cache of a file
does not count in). No jax or torch import: both sides of a comparison use it."""

from __future__ import annotations

import os
import pathlib
import threading
import time

ROOT = pathlib.Path("/sys/fs/cgroup/memory")


def _status(field: str) -> int:
  for line in pathlib.Path("/proc/self/status").read_text().splitlines():
    if line.startswith(field + ":"):
      return int(line.split()[1]) * 1024
  return 0


class Budget:
  """``with Budget(name, limit) as b:`` runs the block in the cgroup ``name`` limited to
  ``limit`` bytes; ``b.report()`` gives the peak anonymous RSS above the baseline, the cgroup's
  peak usage (page cache included) and its failure count. The cgroup is removed on exit (a
  process killed in it leaves it: remove it with ``rmdir``)."""

  def __init__(self, name: str, limit: int, interval: float = 0.05):
    self.dir = ROOT / name
    self.limit = int(limit)
    self.interval = interval
    self.peak_anon = 0
    self.base_anon = 0
    self._stop = threading.Event()

  def _sample(self):
    while not self._stop.is_set():
      self.peak_anon = max(self.peak_anon, _status("RssAnon"))
      time.sleep(self.interval)

  def __enter__(self):
    self.dir.mkdir(exist_ok=True)
    (self.dir / "memory.limit_in_bytes").write_text(str(self.limit))
    (self.dir / "cgroup.procs").write_text(str(os.getpid()))
    self.base_anon = self.peak_anon = _status("RssAnon")
    self._thread = threading.Thread(target=self._sample, daemon=True)
    self._thread.start()
    return self

  def report(self) -> dict:
    self.peak_anon = max(self.peak_anon, _status("RssAnon"))
    read = lambda f: int((self.dir / f).read_text().split()[0])  # noqa: E731
    return {
      "limit_bytes": self.limit,
      "baseline_anon_mb": self.base_anon / 2**20,
      "peak_anon_mb": self.peak_anon / 2**20,
      "peak_anon_above_baseline_mb": (self.peak_anon - self.base_anon) / 2**20,
      "cgroup_peak_usage_mb": read("memory.max_usage_in_bytes") / 2**20,
      "cgroup_failcnt": read("memory.failcnt"),
    }

  def __exit__(self, *exc):
    self._stop.set()
    self._thread.join()
    (ROOT / "cgroup.procs").write_text(str(os.getpid()))
    try:
      self.dir.rmdir()
    except OSError:
      pass
    return False
