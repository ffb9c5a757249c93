"""The lens views of jaxlens.plot: the top-token grid, the per-layer KL curve, the DLA bars."""

from __future__ import annotations

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
