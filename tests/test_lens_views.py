"""The lens views of jaxlens.plot: the top-token grid, the per-layer KL curve, the DLA bars."""

from __future__ import annotations

import shutil
import subprocess

import numpy as np
import pytest

pytest.importorskip("matplotlib")

from jaxlens import plot
from jaxlens.core import InvalidArgumentError, ShapeError


def test_lens_grid_writes_each_top_token(tmp_path):
  ids = np.asarray([[[1, 0]], [[2, 1]]])  # (layers=2, positions=1, k=2)
  probs = np.asarray([[[0.6, 0.1]], [[0.9, 0.05]]])
  fig = plot.lens_grid(ids, probs, vocab=["a", " ", "cat"], path=tmp_path / "g.png")
  texts = [t.get_text() for t in fig.axes[0].texts]
  assert texts == [" ", "cat"] or texts == ["' '", "cat"]
  np.testing.assert_allclose(fig.axes[0].images[0].get_array(), [[0.6], [0.9]])
  assert (tmp_path / "g.png").stat().st_size > 0
  with pytest.raises(ShapeError, match="must be \\(layers, positions\\)"):
    plot.lens_grid(ids[0, 0], probs[0, 0])


def test_lens_kl_draws_one_curve_per_lens():
  fig = plot.lens_kl({"logit lens": [3.0, 1.0, 0.0], "tuned lens": [0.5, 0.2, 0.0]})
  lines = fig.axes[0].lines
  assert [line.get_label() for line in lines] == ["logit lens", "tuned lens"]
  np.testing.assert_allclose(lines[1].get_ydata(), [0.5, 0.2])  # the final 0 is off a log axis
  with pytest.raises(InvalidArgumentError, match="non-empty dict"):
    plot.lens_kl([1.0, 2.0])


def test_dla_bars_show_the_largest_parts_first():
  fig = plot.dla_bars([0.1, -2.0, 0.5, 1.0], ["embed", "L0H0", "L0 mlp", "bias"], k=3)
  ax = fig.axes[0]
  assert [t.get_text() for t in ax.get_yticklabels()] == ["L0H0", "bias", "L0 mlp"]
  assert [p.get_width() for p in ax.patches] == [-2.0, 1.0, 0.5]
  with pytest.raises(InvalidArgumentError, match="k must be a positive int"):
    plot.dla_bars([1.0], ["a"], k=0)
  with pytest.raises(ShapeError):
    plot.dla_bars([1.0, 2.0], ["a"])


def _cells(page):
  from html.parser import HTMLParser

  cells = []

  class Cells(HTMLParser):
    def handle_starttag(self, tag, attrs):
      if tag == "td":
        cells.append([dict(attrs), ""])

    def handle_data(self, data):
      if cells and not cells[-1][1]:
        cells[-1][1] = data

  Cells().feed(page)
  return cells


def test_lens_html_is_a_table_of_top_tokens(tmp_path):
  from jaxlens import views

  ids = np.asarray([[[1, 0]], [[2, 1]]])
  probs = np.asarray([[[0.6, 0.1]], [[0.9, 0.05]]])
  page = views.lens_html(
    ids, probs, tmp_path / "lens.html", vocab=["a", "<b>", "cat"], col_labels=["x"]
  )
  assert (tmp_path / "lens.html").read_text() == page
  cells = _cells(page)
  assert [c[1] for c in cells] == ["'<b>'", "'cat'"]  # escaped in the page, read back
  assert [float(c[0]["data-p"]) for c in cells] == [0.6, 0.9]
  assert "'a' 0.100" in cells[0][0]["title"]  # the runner-up in the tooltip
  with pytest.raises(ShapeError, match="must be \\(layers, positions"):
    views.lens_html(ids[0, 0], probs[0, 0])


@pytest.mark.skipif(
  not any(shutil.which(b) for b in ("chromium", "chromium-browser", "google-chrome")),
  reason="no Chromium on this machine",
)
def test_lens_html_renders_in_headless_chromium(tmp_path):
  from jaxlens import views

  browser = next(
    shutil.which(b) for b in ("chromium", "chromium-browser", "google-chrome") if shutil.which(b)
  )
  views.lens_html(np.asarray([[3]]), np.asarray([[0.7]]), tmp_path / "l.html", vocab=str)
  out = subprocess.run(
    [
      browser,
      "--headless",
      "--no-sandbox",
      "--disable-gpu",
      "--no-first-run",
      f"--user-data-dir={tmp_path / 'profile'}",
      "--dump-dom",
      (tmp_path / "l.html").as_uri(),
    ],
    capture_output=True,
    text=True,
    timeout=180,
    check=False,
  )
  assert [c[1] for c in _cells(out.stdout)] == ["'3'"], out.stderr[-2000:]
