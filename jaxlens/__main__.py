"""``python -m jaxlens``: the gradient contract matrix, measured by running it.

With torch installed it measures every door and verb on jaxlens and on the torch
reference (``torch_bridge``) and prints them side by side with the agreement count;
without torch it prints the jaxlens column alone. ``import jaxlens`` stays torch-free:
torch_bridge is imported here, inside :func:`main`, only when torch is installed.
The exit status is 1 when a row disagrees between the frameworks or with the
specification.
"""

from __future__ import annotations

import importlib.util
import sys

import jax


def _torch_available() -> bool:
  return importlib.util.find_spec("torch") is not None


def main(argv=None) -> int:
  """The matrix (both frameworks where torch is installed), then the patching demo.

  ``--matrix-only`` skips the demo; ``--demo-out PATH`` sets where its heatmap goes.
  """
  import argparse
  parser = argparse.ArgumentParser(prog="python -m jaxlens", description=__doc__.split("\n")[0])
  parser.add_argument("--matrix-only", action="store_true", help="skip the patching demo")
  parser.add_argument("--demo-out", default="patching_heatmap.png",
                      help="the demo's heatmap PNG (default patching_heatmap.png)")
  args = parser.parse_args(argv)
  status = _matrix_main()
  if not args.matrix_only:
    # The demo trains in float32; the matrix needed float64.
    jax.config.update("jax_enable_x64", False)
    from jaxlens import demo
    print("\n" + "=" * 72 + "\n")
    try:
      status = demo.main(["--out", args.demo_out]) or status
    finally:
      jax.config.update("jax_enable_x64", True)
  return status


def _matrix_main() -> int:
  jax.config.update("jax_enable_x64", True)
  from jaxlens import contract as matrix

  _, _, _, _, source = matrix.spec_model()
  if not _torch_available():
    print("jaxlens gradient contract matrix")
    print(f"model: Sequential([Dense(4), Dense(2)]), float64, weights from {source}; "
          f"edit at {matrix.SITE}")
    print("note: torch is not installed, so the torch reference column is not measured "
          "(pip install torch==2.13.0 to compare both frameworks)\n")
    table = matrix.run_matrix()
    print(matrix.format_matrix(table))
    rows = {r.name: r for r in matrix.ROWS}
    bad = sum((a.outcome, b.outcome) != matrix.expected(d, rows[n])
              for (d, n), (a, b) in table.items())
    return 1 if bad else 0

  from torch_bridge import matrix as _matrix

  print("gradient contract matrix: jaxlens and the torch reference (torch_bridge), side by side")
  print(f"model: Sequential([Dense(4), Dense(2)]) / nn.Sequential(nn.Linear(4, 4), "
        f"nn.Linear(4, 2)), float64, weights from {source}; edit at {matrix.SITE} / "
        f"\"{_matrix.SITE}\"\n")
  table = _matrix.full_table()
  print(_matrix.format_both(table))
  agree, spec, total = _matrix.summary(table)
  print(f"\nagreement: {agree} of {total} rows (jaxlens vs the torch reference); "
        f"{spec} of {total} match the specification")
  return 0 if agree == spec == total else 1


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
