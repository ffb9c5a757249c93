"""``python -m jaxlens.models``: the activation-patching demo on SmolLM2-135M (see
:mod:`jaxlens.models.demo`). Writes ``patching_heatmap_smollm2.png`` (with ``jaxlens.plot``
when it is available) and prints the grid."""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np


def _table(grid, rows, cols) -> str:
  width = max(8, max(len(c) for c in cols) + 1)
  lines = [" " * 5 + "".join(f"{c:>{width}}" for c in cols)]
  for r, row in zip(rows, grid):
    lines.append(f"{r:>5}" + "".join(f"{v:>{width}.2f}" for v in row))
  return "\n".join(lines)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(prog="python -m jaxlens.models", description=__doc__)
  parser.add_argument(
    "--out",
    default="patching_heatmap_smollm2.png",
    help="where to write the heatmap (default: %(default)s)",
  )
  args = parser.parse_args(argv)
  from jaxlens.models import demo, hub

  t0 = time.perf_counter()
  lm = hub.smollm2()
  t1 = time.perf_counter()
  print(
    f"SmolLM2-135M loaded from {hub.smollm2_path().name} in {t1 - t0:.1f} s "
    f"({lm.config.n_layers} layers, d_model {lm.config.d_model})"
  )
  grid, rows, cols, (clean, corrupt) = demo.factual_recall(lm)
  t2 = time.perf_counter()
  print(f"patching sweep: {grid.shape[0]} layers x {grid.shape[1]} positions in {t2 - t1:.1f} s")
  print(
    f"metric: logit(' Paris') - logit(' Rome') at the last position; "
    f"clean {clean:.2f}, corrupt {corrupt:.2f}"
  )
  print(_table(grid, rows, cols))
  best = np.unravel_index(np.argmax(grid), grid.shape)
  print(f"largest recovery: {rows[best[0]]} at {cols[best[1]]!r}")
  try:
    from jaxlens import plot
  except ImportError:
    print("(jaxlens.plot is not available: the table above is the heatmap)")
    return 0
  fig = plot.patching_heatmap(
    grid,
    row_labels=rows,
    col_labels=cols,
    title="SmolLM2-135M: France run's resid_pre patched into the Italy run",
    xlabel="token (clean/corrupt)",
    ylabel="blocks_{l}/resid_pre",
    colorbar_label="logit(' Paris') - logit(' Rome')",
  )
  fig.savefig(args.out, dpi=120, bbox_inches="tight")
  print(f"wrote {args.out}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
