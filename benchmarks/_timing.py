"""Timing, memory and result helpers shared by the benchmarks.

Every benchmark compares a candidate with a baseline *in the same process*, calls them
alternately (the order flips every round, so that drift and the neighbour's cache
effects fall on both) and reports the ratio of their medians. The machine is shared and
noisy: only ratios measured this way mean anything; absolute times are given for scale.

A benchmark's result is a JSON-able dict with a list of ``rows``, one per figure of
docs/performance.md (see :func:`row`).
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import re
import statistics
import time
from pathlib import Path
from typing import Any, Callable

import jax
import numpy as np

__all__ = [
  "aot_times",
  "block",
  "canonical_hlo",
  "env_info",
  "interleaved",
  "max_abs_diff",
  "median",
  "memory_bytes",
  "ratio",
  "row",
  "timed",
  "write_json",
]


def block(out):
  """Waits for every array in ``out``: jax arrays, and torch tensors (already synchronous)."""
  return jax.block_until_ready(out)


def timed(fn: Callable, *args) -> tuple[float, Any]:
  """The wall time of one call of ``fn(*args)``, waiting for its result, and the result."""
  t0 = time.perf_counter()
  out = block(fn(*args))
  return time.perf_counter() - t0, out


def interleaved(
  fns: dict[str, Callable[[], Any]], repeats: int, warmup: int = 1
) -> dict[str, list[float]]:
  """Times zero-argument callables alternately; returns each one's call times.

  Args:
    fns: name -> callable; each is called ``warmup`` times untimed, then ``repeats``
      times timed.
    repeats: the timed calls of each.
    warmup: the untimed calls of each, after any compilation the caller did.

  Returns:
    name -> the ``repeats`` call times in seconds. Round ``r`` calls the functions in
    the given order when ``r`` is even and in reverse order when it is odd.
  """
  names = list(fns)
  for _ in range(warmup):
    for name in names:
      block(fns[name]())
  times: dict[str, list[float]] = {name: [] for name in names}
  for r in range(repeats):
    for name in names if r % 2 == 0 else names[::-1]:
      dt, _ = timed(fns[name])
      times[name].append(dt)
  return times


def median(xs) -> float | None:
  return float(statistics.median(xs)) if xs else None


def ratio(a, b) -> float | None:
  return None if a is None or b is None or b == 0 else a / b


def max_abs_diff(a, b) -> float:
  """The largest absolute difference between two pytrees of arrays (jax, numpy) alike."""
  diffs = jax.tree.leaves(
    jax.tree.map(
      lambda x, y: float(
        np.max(np.abs(np.asarray(x, np.float64) - np.asarray(y, np.float64)), initial=0.0)
      ),
      a,
      b,
    )
  )
  return max(diffs) if diffs else 0.0


def aot_times(make_fn: Callable[[], Callable], args) -> tuple[float, float, Any, Any]:
  """Fresh trace+lower and XLA compile times of ``jax.jit(make_fn())`` on ``args``.

  ``make_fn`` must return a new function object on every call, so that neither jit's
  trace cache nor the compilation cache (keyed on the function) can answer.

  Returns:
    ``(trace_lower_s, compile_s, lowered, compiled)``.
  """
  fn = jax.jit(make_fn())
  t0 = time.perf_counter()
  lowered = fn.lower(*args)
  t1 = time.perf_counter()
  compiled = lowered.compile()
  t2 = time.perf_counter()
  return t1 - t0, t2 - t1, lowered, compiled


def canonical_hlo(text: str) -> str:
  """Optimised HLO with only what it computes.

  Drops the stack-frame tables and ``metadata={...}`` (they name source files and
  functions) and the parameter names of the entry signature (jit names them after
  the Python arguments), and renames every ``%value`` by order of first use (XLA
  names values after the JAX primitive that made them, so the same program can name
  one value ``%mul.3`` and ``%broadcast.7``).
  """
  keep = [
    re.sub(r"[\w.\-]+: ", "", ln) if ln.startswith("ENTRY") else ln
    for ln in text.splitlines()
    if ln.startswith(("%", "ENTRY", " ", "}"))
  ]
  text = "\n".join(keep)
  text = re.sub(r",?\s*metadata=\{[^}]*\}", "", text)
  names: dict[str, str] = {}
  return re.sub(r"%[\w.\-]+", lambda m: names.setdefault(m.group(0), f"%v{len(names)}"), text)


def memory_bytes(compiled) -> dict[str, int]:
  """XLA's buffer-assignment sizes of a compiled function, in bytes.

  ``temp`` is the scratch space the program allocates while it runs, ``output`` its
  results, ``argument`` its inputs, ``alias`` the outputs that reuse an input buffer.
  ``peak`` (``argument + output + temp - alias``) is what is live at the worst moment of
  one call: XLA allocates all temporaries of a program up front, in one block.
  """
  m = compiled.memory_analysis()
  sizes = {
    "argument": int(m.argument_size_in_bytes),
    "output": int(m.output_size_in_bytes),
    "temp": int(m.temp_size_in_bytes),
    "alias": int(m.alias_size_in_bytes),
    "generated_code": int(m.generated_code_size_in_bytes),
  }
  sizes["temp_plus_output"] = sizes["temp"] + sizes["output"] - sizes["alias"]
  sizes["peak"] = sizes["argument"] + sizes["temp_plus_output"]
  return sizes


def row(
  key: str,
  measure: str,
  value: float | None,
  *,
  target: tuple[str, float] | None = None,
  kind: str = "ratio",
  candidate: str = "",
  baseline: str = "",
  candidate_value: float | None = None,
  baseline_value: float | None = None,
  unit: str = "s",
  note: str = "",
) -> dict:
  """One figure of the performance table.

  Args:
    key: a stable identifier (``"trace_all_sites"``).
    measure: what is compared, in words.
    value: the figure: a ratio of medians (``kind="ratio"``: candidate / baseline, lower
      is better) or a speedup (``kind="speedup"``: baseline / candidate, higher is better).
    target: ``("<=", 1.1)`` or ``(">=", 20.0)``, or None when the figure is reported
      without a target.
    kind: ``"ratio"`` or ``"speedup"``.
    candidate, baseline: what ran, in words.
    candidate_value, baseline_value: the medians behind the figure, in ``unit``.
    unit: ``"s"`` or ``"bytes"``.
    note: one sentence shown under the table.

  Returns:
    A JSON-able dict with ``met`` True/False, or None without a target.
  """
  met = None
  if target is not None and value is not None:
    op, bound = target
    met = bool(value <= bound) if op == "<=" else bool(value >= bound)
  return {
    "key": key,
    "measure": measure,
    "value": value,
    "kind": kind,
    "target": None if target is None else list(target),
    "met": met,
    "candidate": candidate,
    "baseline": baseline,
    "candidate_value": candidate_value,
    "baseline_value": baseline_value,
    "unit": unit,
    "note": note,
  }


def env_info() -> dict:
  """The software and machine a result was measured on."""
  import flax

  return {
    "jax": jax.__version__,
    "flax": flax.__version__,
    "python": platform.python_version(),
    "backend": jax.default_backend(),
    "device": jax.devices()[0].device_kind,
    "device_count": jax.device_count(),
    "cpu_count": os.cpu_count(),
    "machine": f"{platform.system()} {platform.machine()}",
    "processor": _processor_name(),
    "x64": bool(jax.config.jax_enable_x64),
    "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
  }


def _processor_name() -> str:
  try:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
      if line.startswith("model name"):
        return line.split(":", 1)[1].strip()
  except OSError:
    pass
  return platform.processor() or "unknown"


def write_json(result: dict, out: str) -> Path | None:
  """Writes ``result`` to ``out`` (creating folders); ``out=''`` writes nothing."""
  if not out:
    return None
  path = Path(out)
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text(json.dumps(result, indent=2) + "\n")
  return path


def report(result: dict, table: str, out: str) -> dict:
  """Prints a benchmark's table, writes its JSON (unless ``out=''``) and returns ``result``."""
  print(table)
  path = write_json(result, out)
  if path is not None:
    print(f"\nwrote {path}")
  return result
