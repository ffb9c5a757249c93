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
  status = demo.main(["--steps", "20", "--batch", "16", "--d-model", "16", "--heads", "2",
                      "--seq-len", str(SEQ), "--vocab", "11", "--marker-at", str(MARKER_AT),
                      "--top", "100", "--out", str(out)])
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
  assert all(scores[(site, p)] == 0.0 for site in ("embed", "block_0", "block_1")
             for p in range(MARKER_AT + 1))
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
