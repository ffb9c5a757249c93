"""jaxlens.plot: each figure holds the data, labels and titles it was given."""

import subprocess
import sys

import numpy as np
import pytest

import jaxlens as jl

pytest.importorskip("matplotlib")
from jaxlens import plot
from jaxlens import MissingDependencyError


def _ticks(labels):
  return [t.get_text() for t in labels]


def test_patching_heatmap_is_diverging_centred_at_zero_with_labels(tmp_path):
  grid = np.array([[0.5, -1.0, 0.0], [2.0, 0.25, -0.5]])
  fig = plot.patching_heatmap(
    grid,
    row_labels=["embed", "block_0"],
    col_labels=["The", "cat", "sat"],
    title="restored",
    path=tmp_path / "h.png",
  )
  ax, bar = fig.axes
  image = ax.images[0]
  np.testing.assert_array_equal(image.get_array(), grid)
  assert (image.norm.vmin, image.norm.vmax) == (-2.0, 2.0)  # symmetric about zero
  # Zero maps to the colour map's white middle; the two signs to the two hues.
  white = np.array(image.cmap(image.norm(0.0))[:3])
  assert np.all(white > 0.9)
  red, blue = image.cmap(image.norm(2.0)), image.cmap(image.norm(-2.0))
  assert red[0] > red[2] and blue[2] > blue[0]
  assert _ticks(ax.get_xticklabels()) == ["The", "cat", "sat"]
  assert _ticks(ax.get_yticklabels()) == ["embed", "block_0"]
  assert (ax.get_title(), ax.get_xlabel(), ax.get_ylabel()) == ("restored", "position", "site")
  assert bar.get_ylabel() == "score"
  # Small grids carry their values.
  assert "-1.00" in [t.get_text() for t in ax.texts]
  assert (tmp_path / "h.png").read_bytes()[:4] == b"\x89PNG"


def test_patching_heatmap_draws_into_given_axes_and_refuses_bad_labels():
  from matplotlib.figure import Figure

  fig = Figure()
  ax = fig.add_subplot()
  assert (
    plot.patching_heatmap(np.eye(2), row_labels=["a", "b"], col_labels=["0", "1"], ax=ax) is fig
  )
  with pytest.raises(jl.ShapeError, match="label_count_mismatch"):
    plot.patching_heatmap(np.eye(2), row_labels=["a"], col_labels=["0", "1"])
  with pytest.raises(jl.ShapeError, match="must be 2-D"):
    plot.patching_heatmap(np.ones(3), row_labels=["a"], col_labels=["0"])


def test_attention_pattern_labels_queries_and_keys():
  w = np.tril(np.ones((3, 3)))
  w /= w.sum(-1, keepdims=True)
  fig = plot.attention_pattern(w, tokens=["a", "b", "c"], title="head 0.1")
  ax = fig.axes[0]
  np.testing.assert_allclose(ax.images[0].get_array(), w)
  assert _ticks(ax.get_xticklabels()) == _ticks(ax.get_yticklabels()) == ["a", "b", "c"]
  assert (ax.get_title(), ax.get_xlabel(), ax.get_ylabel()) == ("head 0.1", "key", "query")


def test_logit_lens_writes_the_top_token_per_layer_and_position():
  logits = np.zeros((2, 3, 4))
  logits[0, :, 1] = 5.0  # layer 0: token 1 everywhere
  logits[1, :, 3] = [1.0, 2.0, 9.0]  # layer 1: token 3, growing confidence
  vocab = ["<s>", "cat", "dog", "mat"]
  fig = plot.logit_lens(
    logits, vocab=vocab, row_labels=["block_0", "block_1"], col_labels=["x", "y", "z"], title="lens"
  )
  ax = fig.axes[0]
  assert [t.get_text() for t in ax.texts] == ["cat"] * 3 + ["mat"] * 3
  probs = ax.images[0].get_array()
  assert probs.shape == (2, 3) and probs[1, 2] > probs[1, 1] > probs[1, 0]
  np.testing.assert_allclose(probs[1, 2], np.exp(9) / (np.exp(9) + 3))
  assert _ticks(ax.get_yticklabels()) == ["block_0", "block_1"]
  assert ax.get_title() == "lens"


def test_top_sites_orders_bars_by_score():
  grid = np.array([[0.1, 0.9], [-0.3, 0.5]])
  fig = plot.top_sites(grid, row_labels=["embed", "block_0"], col_labels=["a", "b"], k=3)
  ax = fig.axes[0]
  assert _ticks(ax.get_yticklabels()) == ["embed @ b", "block_0 @ b", "embed @ a"]
  assert ax.get_ylabel() == "site @ position" and ax.get_xlabel() == "score"
  np.testing.assert_allclose([p.get_width() for p in ax.patches], [0.9, 0.5, 0.1])
  with pytest.raises(jl.InvalidArgumentError, match="k must be a positive int"):
    plot.top_sites(grid, row_labels=["embed", "block_0"], k=0)


def test_missing_matplotlib_is_a_typed_error(monkeypatch):
  monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
  with pytest.raises(MissingDependencyError, match=r"jaxlens\[plot\]") as caught:
    plot.patching_heatmap(np.eye(2), row_labels=["a", "b"], col_labels=["0", "1"])
  assert caught.value.code == "missing_dependency" and isinstance(caught.value, ImportError)


def test_import_jaxlens_and_jaxlens_plot_do_not_import_matplotlib():
  code = (
    "import sys, jaxlens, jaxlens.plot, jaxlens.store, "
    "jaxlens.attribution; "
    "print(sorted(m for m in ('matplotlib', 'tqdm', 'torch') "
    "if m in sys.modules))"
  )
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
  assert out.stdout.strip() == "[]"
