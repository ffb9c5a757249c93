"""CPU seconds of the contract matrix's cells (``jaxlens.contract.run_cell``), in one process.

Runs every cell of the matrix (every door x row x keep_grad: 874 cells) once cold (JAX's
eager programs compiled on first use, as in the test suite and ``python -m jaxlens``) and
then ``--repeats`` times warm, and reports the process CPU seconds of each pass. Each
pass checks that the outcomes agree with the specification (``contract.expected``).

The code before a change cannot run in the same process, so a before/after comparison is
two runs back to back on the same machine (``git stash`` is not needed: check out the old
commit in a worktree and run this script there with the same interpreter).

Measured (two cores shared with other work, load 5-8, CPU-s; the code before and after
commit c85b6ee, run alternately): before, cold 36.2 and 30.2, warm 30.9, 29.8, 32.3 and
30.8; after, cold 26.9 and 29.3, warm 24.3, 25.1, 23.8 and 24.7 (about 20% less). Over all
cells, JAX's eager jnp calls fell from 31,267 to 21,375 and the primitives linearised under
``jax.grad`` from 32,648 to 26,879. With the later commits (5d7aa1a: no no-op casts or axis
moves under jl.subspace, 18,987 jnp calls and 24,791 primitives; bab4393: the spec door's
temporary directory in /dev/shm), at 08:36-08:39 UTC (load 1-4), alternately: before
(1bccf58), cold 38.1 and 35.1, warm 28.0 and 29.7; after (bab4393), cold 26.2 and 29.1,
warm 21.8 and 24.0 (about 22% less warm).

Usage::

  python benchmarks/contract_cells.py [--repeats 1]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

_ROOT = Path(__file__).resolve().parent.parent
if str(_ROOT) not in sys.path:
  sys.path.insert(0, str(_ROOT))

# The test suite's XLA settings (tests/conftest.py): the cells' eager programs are tiny.
os.environ.setdefault(
  "XLA_FLAGS", "--xla_cpu_use_fusion_emitters=false --xla_cpu_parallel_codegen_split_count=1"
)
os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")

import jax  # noqa: E402

jax.config.update("jax_enable_x64", True)

from jaxlens import contract  # noqa: E402


def one_pass(model, variables, x, x_donor) -> tuple[float, int, int]:
  """Runs every cell once: (CPU seconds, cells, cells agreeing with the specification)."""
  t0 = time.process_time()
  cells = agree = 0
  for door in contract.DOORS:
    for row in contract.ROWS:
      want = contract.expected(door, row)
      for keep in (False, True):
        cell = contract.run_cell(door, row, keep, model, variables, x, x_donor)
        cells += 1
        agree += cell.outcome == want[keep]
  return time.process_time() - t0, cells, agree


def main(argv=None) -> dict:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--repeats", type=int, default=1, help="warm passes after the cold one")
  args = p.parse_args(argv)
  model, variables, x, x_donor, _ = contract.spec_model()
  out = {}
  for i in range(1 + args.repeats):
    name = "cold" if i == 0 else f"warm{i}"
    seconds, cells, agree = one_pass(model, variables, x, x_donor)
    out[name] = seconds
    print(f"{name}: {seconds:.2f} CPU-s for {cells} cells ({agree} agree with the spec)")
    if agree != cells:
      raise SystemExit(f"{cells - agree} cells disagree with the specification")
  return out


if __name__ == "__main__":
  main()
