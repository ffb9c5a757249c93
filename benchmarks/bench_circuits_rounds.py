"""Attribution graphs, jaxlens and circuit-tracer 0.5.0 alternately in the same time window:
each round runs benchmarks/bench_circuits_ct.py (circuit-tracer at one torch thread and at its
default, in /work/venv-ct) and then benchmarks/bench_circuits_vs_ct.py (jaxlens on the same
weights), for each prompt length, and records every side's wall and CPU time with the load
average before and after it. On a machine shared with other work the wall times depend on the
load; the CPU times are the steadier figure.

Usage::

  python benchmarks/bench_circuits_rounds.py [ROUNDS] [SEQ ...]   # default 3 rounds, 64 256

Writes benchmarks/results/circuits_rounds_<seqs>.json and prints each row as JSON.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
CT_PYTHON = "/work/venv-ct/bin/python"


def _load() -> float:
  return round(os.getloadavg()[0], 2)


def _run(cmd: list[str]) -> str:
  out = subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=HERE.parent)
  return out.stdout


def _jaxlens(seq: int) -> dict:
  text = _run([sys.executable, str(HERE / "bench_circuits_vs_ct.py"), str(seq), "3"])
  return json.loads(text[text.index("{\n") :])["jaxlens"]


def _circuit_tracer(seq: int) -> dict:
  Path("/tmp/ct").mkdir(exist_ok=True)
  _run([CT_PYTHON, str(HERE / "bench_circuits_ct.py"), str(seq), "1"])
  return json.loads(Path(f"/tmp/ct/bench_{seq}.json").read_text())


def main(rounds: int, seqs: list[int]) -> list[dict]:
  rows = []
  for r in range(rounds):
    for seq in seqs:
      # The side that goes first alternates between rounds.
      sides = [("circuit_tracer", _circuit_tracer), ("jaxlens", _jaxlens)]
      for name, fn in sides if r % 2 == 0 else sides[::-1]:
        before, t0 = _load(), time.time()
        got = fn(seq)
        row = {"round": r, "seq": seq, "side": name, "load_before": before, "load_after": _load()}
        row["utc"] = time.strftime("%H:%M", time.gmtime(t0))
        if name == "jaxlens":
          row.update(wall_s=got["wall_s"], cpu_s=got["cpu_s"], first_call_s=got["first_call_s"])
        else:
          row.update(wall_s=got["wall_s"], cpu_s=got["cpu_s"])
        rows.append(row)
        print(json.dumps(row), flush=True)
  (HERE / "results").mkdir(exist_ok=True)
  (HERE / "results" / f"circuits_rounds_{'_'.join(map(str, seqs))}.json").write_text(
    json.dumps(rows, indent=1)
  )
  return rows


if __name__ == "__main__":
  n = int(sys.argv[1]) if len(sys.argv) > 1 else 3
  main(n, [int(s) for s in sys.argv[2:]] or [64, 256])
