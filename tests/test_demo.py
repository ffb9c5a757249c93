"""The demo: trains, sweeps, draws the heatmap with matplotlib and prints the top sites."""

import re

import numpy as np
import pytest

from jaxlens import demo

pytest.importorskip("matplotlib")

SEQ, MARKER_AT = 6, 2


def test_main_trains_sweeps_and_draws_the_heatmap(tmp_path, capsys, monkeypatch):
  out = tmp_path / "heat.png"
  figures = []
  real_run = demo.run_demo
  monkeypatch.setattr(demo, "run_demo", lambda **kw: figures.append(real_run(**kw)) or figures[-1])
  status = demo.main(
    [
      "--steps",
      "20",
      "--batch",
      "16",
      "--d-model",
      "16",
      "--heads",
      "2",
      "--seq-len",
      str(SEQ),
      "--vocab",
      "11",
      "--marker-at",
      str(MARKER_AT),
      "--top",
      "100",
      "--out",
      str(out),
    ]
  )
  assert status == 0
  printed = capsys.readouterr()
  # tqdm's bar goes to stderr and ends at the last step.
  assert re.search(r"training: 100%.*20/20", printed.err)
  assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

  m = re.search(r"loss (\d+\.\d+) -> (\d+\.\d+)", printed.out)
  assert m and float(m.group(1)) > 0
  top = re.findall(r"^\s+\d+\. (\S+) @ position (\d+): (-?\d+\.\d+)$", printed.out, re.MULTILINE)
  scores = {(site, int(pos)): float(score) for site, pos, score in top}
  # --top 100 prints every cell: 5 sites (embed, block_i/attn, block_i) x SEQ positions.
  assert len(scores) == 5 * SEQ
  assert list(scores.values()) == sorted(scores.values(), reverse=True)
  # Cells fixed by causality, trained or not: patching the embedding where the runs differ,
  # or the last block at the query position, restores all; patching earlier changes nothing.
  assert scores[("embed", MARKER_AT + 1)] == 1.0
  assert scores[("block_1", SEQ - 1)] == 1.0
  assert all(
    scores[(site, p)] == 0.0
    for site in ("embed", "block_0", "block_1")
    for p in range(MARKER_AT + 1)
  )
  assert f"heatmap: {out}" in printed.out

  # The figure shows what was printed: the grid, the site and position labels, a title.
  result = figures[0]
  ax = result.figure.axes[0]
  np.testing.assert_array_equal(ax.images[0].get_array(), result.scores)
  assert [t.get_text() for t in ax.get_yticklabels()] == list(result.sites)
  ticks = [t.get_text() for t in ax.get_xticklabels()]
  assert ticks[MARKER_AT] == f"{MARKER_AT} marker" and ticks[-1] == f"{SEQ - 1} query"
  assert "Activation patching" in ax.get_title()
  assert "restored" in result.figure.axes[-1].get_ylabel()  # the colour bar


def test_python_m_jaxlens_summary_fits_100_columns(tmp_path, capsys, monkeypatch):
  """The command's own layout, on stand-in cells (the matrix itself is tested elsewhere)."""
  from jaxlens import __main__ as entry
  from jaxlens import contract as matrix

  doors = {k: matrix.DOORS[k] for k in ("live_bind", "replay", "units:differentiable_replay")}
  cells = {
    (d, r.name): tuple(matrix.Cell(o) for o in matrix.expected(d, r))
    for d in doors
    for r in matrix.ROWS
  }
  monkeypatch.setattr(entry, "_torch_available", lambda: False)
  monkeypatch.setattr(matrix, "DOORS", doors)
  monkeypatch.setattr(
    matrix, "run_matrix", lambda doors_: {k: v for k, v in cells.items() if k[0] in doors_}
  )
  monkeypatch.setattr(matrix, "spec_model", lambda: (None,) * 4 + ("jax.random",))
  table = tmp_path / "matrix.md"
  assert entry.main(["--no-demo", "--no-progress", "--table-out", str(table)]) == 0
  out = capsys.readouterr().out
  assert all(len(line) <= entry.WIDTH for line in out.splitlines() if str(table) not in line)
  n = len(matrix.ROWS)
  assert out.count("rows agree with the specification") == 1
  assert f"{3 * n} of {3 * n} rows agree" in out and f"is in\n  {table}\n" in out
  # Spellings come from the matrix's own table (the one the docs' generated block prints).
  assert f"live_bind  {matrix.DOORS['live_bind'][0]}" in out
  assert f"  units:differentiable_replay{n}/{n}".replace(" ", "") in out.replace(" ", "")
  assert table.read_text().count("\n| `") == 3 * n  # the whole table, one line per row

  with pytest.raises(SystemExit):
    entry.main(["--help"])
  helptext = capsys.readouterr().out
  assert "``" not in helptext and "--no-demo" in helptext and "--matrix-only" not in helptext
  for removed in (["--matrix-only"], ["--demo-out", "x.png"]):  # no hidden old spellings
    with pytest.raises(SystemExit):
      entry._parser().parse_args(removed)
  assert "unrecognized arguments" in capsys.readouterr().err
