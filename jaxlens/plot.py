"""Figures of what jaxlens measures, drawn with matplotlib (``pip install 'jaxlens[plot]'``).

Every function returns a :class:`matplotlib.figure.Figure` (built without pyplot, so
no window opens and no global state changes), draws into ``ax=`` when given one,
and writes the figure to ``path=`` when given one (the format follows the suffix:
``.png``, ``.svg``, ``.pdf``).

* :func:`patching_heatmap`: sites x positions scores, a diverging colour map
  centred at zero, a colour bar, token labels.
* :func:`attention_pattern`: one head's query x key weights with token labels.
* :func:`logit_lens`: the top token per layer and position, coloured by its probability.
* :func:`top_sites`: the highest-scoring (site, position) cells of a sweep as bars.
* :func:`lens_grid`: a lens's top tokens (``jaxlens.lens.logit_lens_topk``) per layer and
  position, coloured by their probability, without the vocabulary-wide logits.
* :func:`lens_kl`: per-layer KL divergence to the final distribution, one curve per lens.
* :func:`dla_bars`: a direct logit attribution's largest parts, by component or head.

Example:
  >>> import numpy as np
  >>> from jaxlens import plot
  >>> fig = plot.patching_heatmap(np.array([[0.1, -0.5], [1.0, 0.0]]),
  ...                             row_labels=["embed", "block_0"], col_labels=["The", "cat"],
  ...                             title="restored logit difference")
  >>> fig.axes[0].get_title()
  'restored logit difference'

matplotlib is imported when a function here is first called: ``import jaxlens``
(and ``import jaxlens.plot``) never imports it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from jaxlens.core import InvalidArgumentError, ShapeError
from jaxlens.internal import require

__all__ = [
  "attention_pattern",
  "dla_bars",
  "lens_grid",
  "lens_kl",
  "logit_lens",
  "patching_heatmap",
  "top_sites",
]

# Grids with at most this many cells get their values written in the cells.
_ANNOTATE_MAX_CELLS = 400


def _figure(ax, figsize):
  """``(figure, axes)``: the given axes' figure, or a new pyplot-free figure."""
  if ax is not None:
    return ax.figure, ax
  figure_mod = require(
    "matplotlib.figure", feature="jaxlens.plot", extra="plot", package="matplotlib"
  )
  fig = figure_mod.Figure(figsize=figsize, layout="constrained")
  return fig, fig.add_subplot()


def _finish(fig, path):
  if path is not None:
    fig.savefig(path, dpi=150, bbox_inches="tight")
  return fig


def _grid(values, name: str, ndim: int = 2) -> np.ndarray:
  try:
    grid = np.asarray(values, dtype=np.float64)
  except (TypeError, ValueError) as error:
    raise InvalidArgumentError(
      f"{name} must be a numeric array: {error}",
      code="invalid_argument",
      fix=f"{name}=np.asarray(...)",
    ) from error
  if grid.ndim != ndim:
    raise ShapeError(
      f"{name} must be {ndim}-D, got shape {grid.shape}",
      code="shape_mismatch",
      expected=f"{ndim}-D",
      received=str(grid.shape),
      fix=f"pass a {ndim}-D array (e.g. {name}[0] for one batch row)",
    )
  return grid


def _labels(labels, n: int, name: str, axis: str) -> list[str]:
  if labels is None:
    return [str(i) for i in range(n)]
  labels = [str(s) for s in labels]
  if len(labels) != n:
    raise ShapeError(
      f"{name} has {len(labels)} labels for {n} {axis}",
      code="label_count_mismatch",
      expected=n,
      received=len(labels),
      fix=f"give {name} one label per {axis[:-1]}",
    )
  return labels


def _annotate(ax, grid, text, norm, cmap):
  """Writes ``text[i][j]`` in each cell, black or white by the cell's brightness."""
  for (i, j), value in np.ndenumerate(grid):
    rgba = cmap(norm(value)) if np.isfinite(value) else (1, 1, 1, 1)
    luminance = 0.299 * rgba[0] + 0.587 * rgba[1] + 0.114 * rgba[2]
    ax.text(
      j,
      i,
      text[i][j],
      ha="center",
      va="center",
      fontsize=7,
      color="black" if luminance > 0.5 else "white",
    )


def patching_heatmap(
  values,
  *,
  row_labels: Sequence[str] | None = None,
  col_labels: Sequence[str] | None = None,
  title: str | None = None,
  ax=None,
  xlabel: str = "position",
  ylabel: str = "site",
  colorbar_label: str = "score",
  vmax: float | None = None,
  cmap: str = "RdBu_r",
  annotate: bool | None = None,
  path=None,
):
  """A heatmap of a sites x positions grid (activation or attribution patching).

  The colour map is diverging and centred at zero: zero is white, the two signs
  get the two hues, and the limits are symmetric (``±vmax``, by default the
  largest absolute value), so equal magnitudes look equally strong.

  Args:
    values: a 2-D array, one row per site (layer) and one column per position.
    row_labels: a label per row (site names).
    col_labels: a label per column (token strings or positions).
    title: the figure title.
    ax: matplotlib axes to draw into (default: a new figure).
    xlabel, ylabel: the axis names.
    colorbar_label: the colour bar's name.
    vmax: the colour limit (default ``max |values|``).
    cmap: a diverging matplotlib colour map name.
    annotate: write each value in its cell (default: for grids of at most 400 cells).
    path: write the figure there too.

  Returns:
    The figure; its first axes hold the image (``fig.axes[0].images[0].get_array()``
    is ``values``), its last the colour bar.
  """
  grid = _grid(values, "values")
  rows, cols = grid.shape
  rlabels = _labels(row_labels, rows, "row_labels", "rows")
  clabels = _labels(col_labels, cols, "col_labels", "columns")
  colors = require("matplotlib.colors", feature="jaxlens.plot", extra="plot", package="matplotlib")
  fig, ax = _figure(ax, (max(4.0, 0.55 * cols + 2.5), max(2.5, 0.4 * rows + 1.5)))
  finite = grid[np.isfinite(grid)]
  limit = vmax if vmax is not None else (float(np.abs(finite).max()) if finite.size else 1.0)
  norm = colors.Normalize(vmin=-(limit or 1.0), vmax=limit or 1.0)
  image = ax.imshow(grid, cmap=cmap, norm=norm, aspect="auto", interpolation="nearest")
  ax.set_xticks(
    range(cols),
    clabels,
    rotation=45 if max(map(len, clabels)) > 3 else 0,
    ha="right" if max(map(len, clabels)) > 3 else "center",
  )
  ax.set_yticks(range(rows), rlabels)
  ax.set_xlabel(xlabel)
  ax.set_ylabel(ylabel)
  if title is not None:
    ax.set_title(title)
  fig.colorbar(image, ax=ax, label=colorbar_label)
  if annotate or (annotate is None and grid.size <= _ANNOTATE_MAX_CELLS):
    # "-0.00" (a tiny negative) reads as a sign that is not there.
    cells = [[f"{v:.2f}".replace("-0.00", "0.00") for v in row] for row in grid]
    _annotate(ax, grid, cells, norm, image.cmap)
  return _finish(fig, path)


def attention_pattern(
  weights,
  *,
  tokens: Sequence[str] | None = None,
  query_tokens: Sequence[str] | None = None,
  title: str | None = None,
  ax=None,
  cmap: str = "Blues",
  path=None,
):
  """One attention head's weights: queries down, keys across, with token labels.

  Args:
    weights: a ``(queries, keys)`` array of attention weights (rows sum to 1 for
      a softmax pattern; causal masks show as zeros above the diagonal).
    tokens: the key tokens (also the query tokens unless ``query_tokens`` is given).
    query_tokens: the query tokens when they differ from the keys.
    title: the figure title.
    ax: axes to draw into.
    cmap: a sequential colour map name.
    path: write the figure there too.

  Returns:
    The figure (``fig.axes[0].images[0].get_array()`` is ``weights``).
  """
  grid = _grid(weights, "weights")
  q, k = grid.shape
  klabels = _labels(tokens, k, "tokens", "keys")
  qlabels = _labels(
    query_tokens
    if query_tokens is not None
    else (tokens if tokens is not None and q == k else None),
    q,
    "query_tokens",
    "queries",
  )
  fig, ax = _figure(ax, (max(3.5, 0.45 * k + 2.0), max(3.0, 0.45 * q + 1.2)))
  image = ax.imshow(
    grid, cmap=cmap, vmin=0.0, vmax=max(1e-12, float(np.nanmax(grid))), interpolation="nearest"
  )
  ax.set_xticks(range(k), klabels, rotation=90)
  ax.set_yticks(range(q), qlabels)
  ax.set_xlabel("key")
  ax.set_ylabel("query")
  if title is not None:
    ax.set_title(title)
  fig.colorbar(image, ax=ax, label="attention weight")
  return _finish(fig, path)


def _softmax(logits: np.ndarray) -> np.ndarray:
  z = logits - logits.max(axis=-1, keepdims=True)
  e = np.exp(z)
  return e / e.sum(axis=-1, keepdims=True)


def logit_lens(
  logits,
  *,
  vocab: Sequence[str] | Callable[[int], str] | None = None,
  row_labels: Sequence[str] | None = None,
  col_labels: Sequence[str] | None = None,
  title: str | None = None,
  ax=None,
  cmap: str = "viridis",
  path=None,
):
  """The logit lens: the top token at each layer and position, coloured by its probability.

  Args:
    logits: ``(layers, positions, vocab)``: each layer's residual stream passed
      through the final norm and the unembedding (for a jaxlens trace of the
      built-in GPT: ``model.apply(variables, trace[f"block_{i}"].out, method=...)``,
      or ``head(ln_f(h))`` by hand).
    vocab: token strings indexed by id, or a function of an id (a tokenizer's
      ``decode``); default: the ids themselves.
    row_labels: a label per layer.
    col_labels: a label per position (the input tokens).
    title: the figure title.
    ax: axes to draw into.
    cmap: a sequential colour map for the probability.
    path: write the figure there too.

  Returns:
    The figure; each cell's text is the top token, ``fig.axes[0].images[0]`` holds
    the top tokens' probabilities.
  """
  array = np.asarray(logits, dtype=np.float64)
  if array.ndim != 3:
    raise ShapeError(
      f"logits must be (layers, positions, vocab), got shape {array.shape}",
      code="shape_mismatch",
      expected="3-D",
      received=str(array.shape),
      fix="stack each layer's logits for one sequence: np.stack([...])",
    )
  probs = _softmax(array)
  top = probs.argmax(-1)
  top_p = np.take_along_axis(probs, top[..., None], -1)[..., 0]
  decode = (
    vocab if callable(vocab) else (lambda i: str(i)) if vocab is None else (lambda i: str(vocab[i]))
  )
  # A blank token (a space, a newline) is shown as its repr, so that the cell says what it is.
  shown = lambda t: t if t.strip() else repr(t)
  text = [[shown(decode(int(t))) for t in row] for row in top]
  layers, positions = top.shape
  rlabels = _labels(row_labels, layers, "row_labels", "layers")
  clabels = _labels(col_labels, positions, "col_labels", "positions")
  fig, ax = _figure(ax, (max(4.0, 0.7 * positions + 2.5), max(2.5, 0.45 * layers + 1.5)))
  image = ax.imshow(top_p, cmap=cmap, vmin=0.0, vmax=1.0, aspect="auto", interpolation="nearest")
  ax.set_xticks(range(positions), clabels, rotation=45, ha="right")
  ax.set_yticks(range(layers), rlabels)
  ax.set_xlabel("position (input token)")
  ax.set_ylabel("layer")
  if title is not None:
    ax.set_title(title)
  fig.colorbar(image, ax=ax, label="top-token probability")
  _annotate(ax, top_p, text, lambda v: v, image.cmap)
  return _finish(fig, path)


def top_sites(
  values,
  *,
  row_labels: Sequence[str],
  col_labels: Sequence[str] | None = None,
  k: int = 10,
  title: str | None = None,
  ax=None,
  path=None,
):
  """The ``k`` highest (site, position) cells of a sweep, as horizontal bars.

  Args:
    values: the sweep's ``(sites, positions)`` grid.
    row_labels: the site names.
    col_labels: the position labels (tokens); default the positions.
    k: how many cells to show.
    title: the figure title.
    ax: axes to draw into.
    path: write the figure there too.

  Returns:
    The figure; bar ``i`` (top to bottom) is the i-th highest cell, labelled
    ``"site @ label"``.
  """
  grid = _grid(values, "values")
  rlabels = _labels(row_labels, grid.shape[0], "row_labels", "rows")
  clabels = _labels(col_labels, grid.shape[1], "col_labels", "columns")
  if not isinstance(k, int) or k < 1:
    raise InvalidArgumentError(
      f"k must be a positive int, got {k!r}", code="invalid_argument", fix="k=10"
    )
  flat = np.where(np.isfinite(grid), grid, -np.inf).ravel()
  order = np.argsort(-flat, kind="stable")[:k]
  names = [f"{rlabels[i // grid.shape[1]]} @ {clabels[i % grid.shape[1]]}" for i in order]
  scores = grid.ravel()[order]
  fig, ax = _figure(ax, (6.0, max(2.0, 0.35 * len(order) + 1.0)))
  colours = ["#b2182b" if s >= 0 else "#2166ac" for s in scores]
  ax.barh(range(len(order)), scores, color=colours)
  ax.set_yticks(range(len(order)), names)
  ax.invert_yaxis()
  ax.axvline(0.0, color="black", linewidth=0.8)
  ax.set_xlabel("score")
  ax.set_ylabel("site @ position")
  if title is not None:
    ax.set_title(title)
  return _finish(fig, path)


def _decoder(vocab):
  if callable(vocab):
    return vocab
  return (lambda i: str(i)) if vocab is None else (lambda i: str(vocab[i]))


def lens_grid(
  ids,
  probs,
  *,
  vocab: Sequence[str] | Callable[[int], str] | None = None,
  row_labels: Sequence[str] | None = None,
  col_labels: Sequence[str] | None = None,
  title: str | None = None,
  ax=None,
  cmap: str = "viridis",
  path=None,
):
  """A lens's top token at each layer and position, coloured by its probability.

  Args:
    ids: ``(layers, positions)`` top token ids (or ``(layers, positions, k)``: the first is
      shown), e.g. ``jaxlens.lens.logit_lens_topk(...).ids[:, 0]`` for batch row 0.
    probs: their probabilities, the same shape.
    vocab, row_labels, col_labels, title, ax, cmap, path: as :func:`logit_lens`.

  Returns:
    The figure; each cell's text is the top token, ``fig.axes[0].images[0]`` holds the
    probabilities.
  """
  ids, probs = np.asarray(ids), np.asarray(probs, dtype=np.float64)
  if ids.ndim == 3:
    ids, probs = ids[..., 0], probs[..., 0]
  if ids.ndim != 2 or ids.shape != probs.shape:
    raise ShapeError(
      f"ids and probs must be (layers, positions), got {ids.shape} and {probs.shape}",
      code="shape_mismatch",
      expected="2-D, the same shape",
      received=f"{ids.shape}, {probs.shape}",
      fix="one batch row: top.ids[:, 0], top.probs[:, 0]",
    )
  decode = _decoder(vocab)
  shown = lambda t: t if t.strip() else repr(t)
  text = [[shown(decode(int(t))) for t in row] for row in ids]
  layers, positions = ids.shape
  rlabels = _labels(row_labels, layers, "row_labels", "layers")
  clabels = _labels(col_labels, positions, "col_labels", "positions")
  fig, ax = _figure(ax, (max(4.0, 0.7 * positions + 2.5), max(2.5, 0.45 * layers + 1.5)))
  image = ax.imshow(probs, cmap=cmap, vmin=0.0, vmax=1.0, aspect="auto", interpolation="nearest")
  ax.set_xticks(range(positions), clabels, rotation=45, ha="right")
  ax.set_yticks(range(layers), rlabels)
  ax.set_xlabel("position (input token)")
  ax.set_ylabel("layer")
  if title is not None:
    ax.set_title(title)
  fig.colorbar(image, ax=ax, label="top-token probability")
  _annotate(ax, probs, text, lambda v: v, image.cmap)
  return _finish(fig, path)


def lens_kl(
  curves,
  *,
  title: str | None = None,
  log: bool = True,
  ax=None,
  path=None,
):
  """Per-layer KL divergence to the model's final distribution, one curve per lens.

  Args:
    curves: ``{name: (layers,) values}`` (e.g. ``{"logit lens": kl_to_final(...),
      "tuned lens": kl_to_final(..., lens)}``).
    title: the figure title.
    log: a logarithmic y axis (the last layer's 0 is left out of it).
    ax, path: as :func:`patching_heatmap`.

  Returns:
    The figure; ``fig.axes[0].lines[i]`` is curve ``i`` in ``curves``' order, labelled with
    its name.
  """
  if not isinstance(curves, dict) or not curves:
    raise InvalidArgumentError(
      "curves must be a non-empty dict of name -> per-layer values",
      code="invalid_argument",
      fix='curves={"logit lens": kl}',
    )
  fig, ax = _figure(ax, (6.0, 3.5))
  for name, values in curves.items():
    y = _grid(values, f"curves[{name!r}]", ndim=1)
    x = np.arange(len(y))
    keep = y > 0 if log else np.ones(len(y), bool)
    ax.plot(x[keep], y[keep], marker="o", label=str(name))
  if log:
    ax.set_yscale("log")
  ax.set_xlabel("layer")
  ax.set_ylabel("KL to the final distribution (nats)")
  ax.legend()
  if title is not None:
    ax.set_title(title)
  return _finish(fig, path)


def dla_bars(
  parts,
  labels: Sequence[str],
  *,
  k: int | None = 20,
  title: str | None = None,
  ax=None,
  path=None,
):
  """A direct logit attribution's parts as horizontal bars, the largest in size first.

  Args:
    parts: ``(n_parts,)`` one batch row of ``jaxlens.lens.Attribution.parts`` (or any
      per-component scores: ``by_layer()[0]``, a head grid flattened).
    labels: a label per part (``Attribution.labels``).
    k: how many parts (the largest in absolute value); None for all, in order.
    title, ax, path: as :func:`top_sites`.

  Returns:
    The figure; bar ``i`` (top to bottom) is the i-th shown part.
  """
  values = _grid(parts, "parts", ndim=1)
  names = _labels(labels, len(values), "labels", "parts")
  if k is not None and (not isinstance(k, int) or k < 1):
    raise InvalidArgumentError(
      f"k must be a positive int or None, got {k!r}", code="invalid_argument", fix="k=20"
    )
  order = np.arange(len(values)) if k is None else np.argsort(-np.abs(values), kind="stable")[:k]
  shown = values[order]
  fig, ax = _figure(ax, (6.0, max(2.0, 0.3 * len(order) + 1.0)))
  ax.barh(range(len(order)), shown, color=["#b2182b" if v >= 0 else "#2166ac" for v in shown])
  ax.set_yticks(range(len(order)), [names[i] for i in order])
  ax.invert_yaxis()
  ax.axvline(0.0, color="black", linewidth=0.8)
  ax.set_xlabel("direct logit attribution")
  if title is not None:
    ax.set_title(title)
  return _finish(fig, path)
