"""``python -m jaxlens``: the gradient contract matrix, measured by running it, then the demo.

With torch installed it measures every door and verb on jaxlens and on the torch
reference (``torch_bridge``) and compares them; without torch it measures the
jaxlens column alone. ``import jaxlens`` stays torch-free: torch_bridge is imported
here, inside :func:`main`, only when torch is installed. The exit status is 1 when a
row disagrees between the frameworks or with the specification.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from typing import TextIO

import jax

WIDTH = 100  # the compact summary fits in this many columns

_DESCRIPTION = """\
Measure the gradient contract matrix (every door x every verb, with and without
keep_grad) on jaxlens and, when torch is installed, on the torch reference, then
run the patching demo (python -m jaxlens.demo)."""
_EPILOG = """\
examples:
  python -m jaxlens                         the summary, then the demo
  python -m jaxlens --no-demo --full        the whole matrix, one row per door and verb
  python -m jaxlens --table-out matrix.md   the summary here, the whole matrix in a file
"""


def _torch_available() -> bool:
  return importlib.util.find_spec("torch") is not None


def _parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(
    prog="python -m jaxlens",
    description=_DESCRIPTION,
    epilog=_EPILOG,
    formatter_class=argparse.RawDescriptionHelpFormatter,
  )
  p.add_argument("--no-demo", action="store_true", help="measure the matrix only")
  p.add_argument(
    "--full",
    action="store_true",
    help="print the whole matrix (one row per door and verb, wide) after the summary",
  )
  p.add_argument("--table-out", metavar="PATH", help="write the whole matrix (Markdown) to PATH")
  p.add_argument(
    "--out",
    default="patching_heatmap.png",
    metavar="PATH",
    help="the demo's heatmap; .png, .svg or .pdf (default patching_heatmap.png)",
  )
  p.add_argument("--no-progress", action="store_true", help="no progress bars")
  return p


def main(argv=None) -> int:
  """The matrix summary (both frameworks where torch is installed), then the demo."""
  args = _parser().parse_args(argv)
  status = _matrix_main(full=args.full, table_out=args.table_out, progress=not args.no_progress)
  if not args.no_demo:
    # The demo trains in float32; the matrix needed float64.
    jax.config.update("jax_enable_x64", False)
    from jaxlens import demo

    print("\n" + "=" * 72 + "\n")
    try:
      demo_args = ["--out", args.out] + (["--no-progress"] if args.no_progress else [])
      status = demo.main(demo_args) or status
    finally:
      jax.config.update("jax_enable_x64", True)
  return status


def _bar(total: int, progress: bool, stream: TextIO | None = None):
  from tqdm import tqdm

  return tqdm(
    total=total,
    desc="measuring",
    unit="door",
    disable=not progress,
    file=stream or sys.stderr,
    dynamic_ncols=True,
    leave=False,
  )


def _fit(text: str, width: int) -> str:
  return text if len(text) <= width else text[: width - 1] + "…"


def _summary_lines(doors: dict, counts: dict, rows: int, torch: bool) -> list[str]:
  """Door spellings, then per door how many verbs agree; every line within WIDTH columns.

  ``doors``: door name -> (spelling, runner), the matrix's ``DOORS``.
  """
  lines = [
    ("doors (the spellings of docs/gradient_contract.md; a selection door runs the same edit"),
    "under jl.units(site, ...) or jl.subspace(site, basis, ...)):",
  ]
  name_w = max(len(d) for d in doors if ":" not in d) + 2
  for door in doors:
    if ":" not in door:
      lines.append(_fit(f"  {door:<{name_w}}{doors[door][0]}", WIDTH))
  what = "jaxlens = torch reference" if torch else "jaxlens"
  lines += [
    "",
    f"rows per door ({rows} verbs, each without and with keep_grad):",
    f"  {'door':<34}{what:>26}  {'= specification':>16}",
  ]
  for door in doors:
    agree, spec = counts[door]
    mark = "" if agree == spec == rows else "  <- see --full"
    lines.append(_fit(f"  {door:<34}{f'{agree}/{rows}':>26}  {f'{spec}/{rows}':>16}{mark}", WIDTH))
  return lines


def _matrix_main(*, full: bool = False, table_out: str | None = None, progress: bool = True) -> int:
  jax.config.update("jax_enable_x64", True)
  # The contract matrix (rows, doors, the specification's outcomes) and, with torch, its
  # torch side: the only two imports of the matrix code in this module.
  from jaxlens import contract as matrix

  torch = _torch_available()
  if torch:
    from torch_bridge import matrix as torch_matrix

  _, _, _, _, source = matrix.spec_model()
  doors = dict(matrix.DOORS)
  rows_by_name = {r.name: r for r in matrix.ROWS}
  if torch:
    print("gradient contract matrix: jaxlens and the torch reference (torch_bridge), side by side")
    print(
      f"model: Sequential([Dense(4), Dense(2)]) / nn.Sequential(nn.Linear(4, 4), "
      f"nn.Linear(4, 2)),\n  float64, weights from {source}; edit at {matrix.SITE}\n"
    )
  else:
    print("jaxlens gradient contract matrix")
    print(
      f"model: Sequential([Dense(4), Dense(2)]), float64, edit at {matrix.SITE};\n"
      f"  weights from {source}"
    )
    print(
      "note: torch is not installed, so the torch reference column is not measured\n"
      "  (pip install torch==2.13.0 to compare both frameworks)\n"
    )

  table: dict = {}
  counts: dict = {}
  with _bar(len(doors), progress) as bar:
    for door in doors:
      bar.set_postfix_str(door, refresh=False)
      if torch:
        part = torch_matrix.door_table(door)
        counts[door] = (
          sum(p.agrees for p in part.values()),
          sum(p.matches_spec for p in part.values()),
        )
      else:
        part = matrix.run_matrix((door,))
        ok = sum(
          (a.outcome, b.outcome) == matrix.expected(d, rows_by_name[n])
          for (d, n), (a, b) in part.items()
        )
        counts[door] = (ok, ok)
      table.update(part)
      bar.update(1)

  n_rows = len(matrix.ROWS)
  print("\n".join(_summary_lines(doors, counts, n_rows, torch)))
  if torch:
    whole = torch_matrix.format_both(table)
    agree, spec, total = torch_matrix.summary(table)
    verdict = (
      f"\nagreement: {agree} of {total} rows (jaxlens vs the torch reference: outcomes, "
      f"warnings,\n  outputs and gradients within {torch_matrix.TOL:g}); {spec} of "
      f"{total} match the specification"
    )
    bad = not agree == spec == total
  else:
    whole = matrix.format_matrix(table)
    spec = sum(c[1] for c in counts.values())
    total = len(table)
    verdict = f"\n{spec} of {total} rows agree with the specification."
    bad = spec != total
  if table_out:
    with open(table_out, "w", encoding="utf-8") as f:
      f.write(whole + "\n")
  if full:
    print("\n" + whole)  # it ends with the agreement line
  else:
    print(verdict)
    if table_out:
      print(f"the whole matrix, one row per door and verb, is in\n  {table_out}")
    else:
      print("the whole matrix, one row per door and verb: --full prints it")
  return 1 if bad else 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
