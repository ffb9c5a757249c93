"""``python -m jaxlens``: print the gradient contract matrix, measured by running it."""

from __future__ import annotations

import sys

import jax


def main(argv=None) -> int:
  jax.config.update("jax_enable_x64", True)
  from jaxlens._src import matrix

  _, _, _, _, source = matrix.spec_model()
  print("jaxlens gradient contract matrix")
  print(f"model: Sequential([Dense(4), Dense(2)]), float64, weights from {source}; "
        "edit at layers_0\n")
  table = matrix.run_matrix()
  print(matrix.format_matrix(table))
  rows = {r.name: r for r in matrix.ROWS}
  bad = sum((a.outcome, b.outcome) != matrix.expected(d, rows[n])
            for (d, n), (a, b) in table.items())
  return 1 if bad else 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
