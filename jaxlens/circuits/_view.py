"""Views of an attribution graph's pruned circuit: a self-contained HTML page (inline SVG, no
script, no network) and a static matplotlib figure, both from one layout.

Layout: a column per prompt position, a row per layer (token embeddings below layer 0, the
logits above the last layer, spread over the width); the kept nodes of a (row, position) cell
are spread across its column. An edge is drawn from source to target, its width proportional to ``|weight|`` relative
to the largest kept edge, blue when positive and red when negative.
"""

from __future__ import annotations

import dataclasses
import html as _html
from pathlib import Path

import numpy as np

from jaxlens.circuits._attribute import Graph, _check_graph
from jaxlens.circuits._errors import CircuitError
from jaxlens.circuits._prune import PruneResult, block, is_sparse, prune
from jaxlens.internal import require

__all__ = ["GraphLayout", "graph_html", "graph_layout", "plot_graph"]

_POSITIVE, _NEGATIVE = "#2166ac", "#b2182b"
_COLOURS = {"feature": "#4d4d4d", "error": "#999999", "token": "#1b7837", "logit": "#762a83"}


@dataclasses.dataclass(frozen=True)
class GraphLayout:
  """The kept nodes and edges of a graph, placed.

  Attributes:
    nodes: kept node indices of the graph.
    kinds: each node's kind (``feature``, ``error``, ``token``, ``logit``).
    labels: each node's label (``L1 P3 F17``, ``err L0 P2``, ``tok P0 'The'``, ``logit ' Paris'``).
    x, y: each node's place (``x`` in positions, ``y`` in rows: ``-1`` tokens, ``L`` logits).
    edges: ``(n_edges, 2)`` ``(target, source)`` indices into ``nodes``.
    weights: each edge's weight.
  """

  nodes: np.ndarray
  kinds: list
  labels: list
  x: np.ndarray
  y: np.ndarray
  edges: np.ndarray
  weights: np.ndarray


def _token_text(token_strings, i, token_id):
  if token_strings is None:
    return str(int(token_id))
  if callable(token_strings):
    return str(token_strings(int(token_id)))
  return str(token_strings[i])


def _shape(a):
  return tuple(a.shape) if is_sparse(a) else np.shape(a)


def graph_layout(graph: Graph, pruned: PruneResult | None = None, *, token_strings=None):
  """The :class:`GraphLayout` of ``graph``'s kept nodes and edges.

  Args:
    graph: an attribution graph.
    pruned: which nodes and edges to keep (default :func:`~jaxlens.circuits.prune` at
      circuit-tracer's thresholds).
    token_strings: the prompt's token strings (a sequence, one per position), or a function
      of a token id; default the ids.

  Raises:
    CircuitError: ``invalid_argument`` (not a graph, or masks of another graph's size).
  """
  _check_graph(graph)
  pruned = prune(graph) if pruned is None else pruned
  n = graph.adjacency.shape[0]
  if np.shape(pruned.node_mask) != (n,) or _shape(pruned.edge_mask) != (n, n):
    raise CircuitError(
      f"the pruning masks are for a graph of {np.shape(pruned.node_mask)} nodes, this one has {n}",
      code="invalid_argument",
      expected=n,
      received=str(np.shape(pruned.node_mask)),
      fix="circuits.prune(graph) of this graph",
    )
  sl = graph.node_slices()
  seq, n_layers = graph.n_pos, graph.n_layers
  nodes = np.flatnonzero(pruned.node_mask)
  kinds, labels, row, col = [], [], [], []
  for node in nodes:
    if node < sl["features"].stop:
      layer, pos, feature = (int(a) for a in graph.active_features[graph.selected_features[node]])
      kinds.append("feature")
      labels.append(f"L{layer} P{pos} F{feature}")
      row.append(layer)
      col.append(pos)
    elif node < sl["errors"].stop:
      e = node - sl["errors"].start
      kinds.append("error")
      labels.append(f"err L{e // seq} P{e % seq}")
      row.append(e // seq)
      col.append(e % seq)
    elif node < sl["tokens"].stop:
      p = node - sl["tokens"].start
      kinds.append("token")
      text = _token_text(token_strings, p, graph.input_tokens[p])
      labels.append(f"tok P{p} {text!r}")
      row.append(-1)
      col.append(p)
    else:
      k = node - sl["logits"].start
      token = int(graph.logit_tokens[k])
      text = f"direction {k}" if token < 0 else repr(_token_text(_ids(token_strings), k, token))
      kinds.append("logit")
      labels.append(f"logit {text} p={float(graph.logit_probabilities[k]):.3f}")
      row.append(n_layers)
      col.append(seq - 1)
  row, col = np.asarray(row, float), np.asarray(col, float)
  x = col.copy()
  for r, c in set(zip(row.tolist(), col.tolist(), strict=True)):
    members = np.flatnonzero((row == r) & (col == c))
    if len(members) > 1:  # spread within the column, in node order
      x[members] = c - 0.35 + 0.7 * np.arange(len(members)) / (len(members) - 1)
  logits = np.flatnonzero(row == n_layers)
  if len(logits) > 1:  # the logits read the last position; spread over the width
    x[logits] = np.linspace(0, seq - 1, len(logits))
  weights = block(graph.adjacency, nodes)
  t, s = np.nonzero(block(pruned.edge_mask, nodes) & (weights != 0))
  return GraphLayout(
    nodes=nodes,
    kinds=kinds,
    labels=labels,
    x=x,
    y=row,
    edges=np.stack([t, s], 1) if len(t) else np.zeros((0, 2), int),
    weights=weights[t, s],
  )


def _ids(token_strings):
  # Logit tokens are vocabulary ids: only a function of an id can name them.
  return token_strings if callable(token_strings) else None


def graph_html(
  graph: Graph,
  path=None,
  *,
  pruned: PruneResult | None = None,
  token_strings=None,
  title: str = "attribution graph",
) -> str:
  """The pruned graph as a self-contained HTML page: inline SVG (no script, no network), a
  circle per kept node with its label and influence in its tooltip, a line per kept edge.

  Args:
    graph: an attribution graph.
    path: write the page there too.
    pruned: the kept nodes and edges (default :func:`~jaxlens.circuits.prune`).
    token_strings: the prompt's token strings, or a function of a token id.
    title: the page title.

  Returns:
    The page.
  """
  pruned = prune(graph) if pruned is None else pruned
  lay = graph_layout(graph, pruned, token_strings=token_strings)
  esc = _html.escape
  seq, n_layers = graph.n_pos, graph.n_layers
  cw, rh, pad = 110.0, 80.0, 60.0
  width, height = pad * 2 + cw * max(seq - 1, 1), pad * 2 + rh * (n_layers + 1)

  def px(x, y):
    return pad + cw * x, height - pad - rh * (y + 1)

  top = float(np.abs(lay.weights).max()) if len(lay.weights) else 1.0
  parts = []
  for (t, s), w in zip(lay.edges, lay.weights, strict=True):
    x1, y1 = px(lay.x[s], lay.y[s])
    x2, y2 = px(lay.x[t], lay.y[t])
    colour = _POSITIVE if w > 0 else _NEGATIVE
    stroke = 0.3 + 4.0 * abs(float(w)) / top
    tip = f"{lay.labels[s]} -> {lay.labels[t]}: {float(w):+.4g}"
    parts.append(
      f'<line class="edge" x1="{x1:.1f}" y1="{y1:.1f}" x2="{x2:.1f}" y2="{y2:.1f}" '
      f'stroke="{colour}" stroke-width="{stroke:.2f}" stroke-opacity="0.6" '
      f'data-source="{int(lay.nodes[s])}" data-target="{int(lay.nodes[t])}" '
      f'data-weight="{float(w):.6g}"><title>{esc(tip)}</title></line>'
    )
  influence = np.asarray(pruned.cumulative_scores)
  for i, node in enumerate(lay.nodes):
    cx, cy = px(lay.x[i], lay.y[i])
    tip = f"{lay.labels[i]} (node {int(node)}, cumulative influence {float(influence[node]):.3f})"
    parts.append(
      f'<circle class="node {lay.kinds[i]}" cx="{cx:.1f}" cy="{cy:.1f}" r="7" '
      f'fill="{_COLOURS[lay.kinds[i]]}" data-node="{int(node)}" data-kind="{lay.kinds[i]}">'
      f"<title>{esc(tip)}</title></circle>"
    )
  for p in range(seq):
    x, y = px(p, -1)
    text = _token_text(token_strings, p, graph.input_tokens[p])
    parts.append(
      f'<text class="token-label" x="{x:.1f}" y="{y + 24:.1f}" text-anchor="middle">'
      f"{esc(text)}</text>"
    )
  for r in range(-1, n_layers + 1):
    name = "tokens" if r < 0 else "logits" if r == n_layers else f"layer {r}"
    _, y = px(0, r)
    parts.append(f'<text class="row-label" x="4" y="{y + 4:.1f}">{esc(name)}</text>')
  svg = (
    f'<svg xmlns="http://www.w3.org/2000/svg" width="{width:.0f}" height="{height:.0f}" '
    f'viewBox="0 0 {width:.0f} {height:.0f}" font-family="monospace" font-size="11">'
    + "".join(parts)
    + "</svg>"
  )
  page = (
    f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{esc(title)}</title></head>"
    f"<body><h3>{esc(title)}</h3><p>{len(lay.nodes)} nodes and {len(lay.edges)} edges kept of "
    f"{graph.adjacency.shape[0]} nodes; blue positive, red negative, width |weight|.</p>"
    f"{svg}</body></html>"
  )
  if path is not None:
    Path(path).write_text(page, encoding="utf-8")
  return page


def plot_graph(
  graph: Graph,
  path=None,
  *,
  pruned: PruneResult | None = None,
  token_strings=None,
  ax=None,
  title: str | None = "attribution graph",
):
  """The pruned graph as a static matplotlib figure (built without pyplot).

  Args:
    graph: an attribution graph.
    path: write the figure there too (``.png``, ``.svg``, ``.pdf``).
    pruned: the kept nodes and edges (default :func:`~jaxlens.circuits.prune`).
    token_strings: the prompt's token strings, or a function of a token id.
    ax: draw into these axes.
    title: the axes' title.

  Returns:
    The :class:`matplotlib.figure.Figure`.
  """
  lay = graph_layout(graph, prune(graph) if pruned is None else pruned, token_strings=token_strings)
  collections = require(
    "matplotlib.collections", feature="circuits.plot_graph", extra="plot", package="matplotlib"
  )
  if ax is None:
    figure_mod = require(
      "matplotlib.figure", feature="circuits.plot_graph", extra="plot", package="matplotlib"
    )
    fig = figure_mod.Figure(figsize=(1.2 + 1.1 * graph.n_pos, 1.5 + 0.9 * graph.n_layers))
    ax = fig.add_subplot()
  else:
    fig = ax.figure
  top = float(np.abs(lay.weights).max()) if len(lay.weights) else 1.0
  segments = [((lay.x[s], lay.y[s]), (lay.x[t], lay.y[t])) for t, s in lay.edges]
  colours = [_POSITIVE if w > 0 else _NEGATIVE for w in lay.weights]
  widths = [0.3 + 3.0 * abs(float(w)) / top for w in lay.weights]
  ax.add_collection(
    collections.LineCollection(segments, colors=colours, linewidths=widths, alpha=0.6, zorder=1)
  )
  for kind, colour in _COLOURS.items():
    idx = [i for i, k in enumerate(lay.kinds) if k == kind]
    if idx:
      ax.scatter(lay.x[idx], lay.y[idx], s=30, c=colour, label=kind, zorder=2)
  ax.set_xticks(range(graph.n_pos))
  ax.set_xticklabels(
    [_token_text(token_strings, p, t) for p, t in enumerate(graph.input_tokens)], rotation=45
  )
  ax.set_yticks(range(-1, graph.n_layers + 1))
  ax.set_yticklabels(["tokens"] + [f"layer {i}" for i in range(graph.n_layers)] + ["logits"])
  ax.set_xlim(-0.6, graph.n_pos - 0.4)
  ax.set_ylim(-1.6, graph.n_layers + 0.6)
  ax.legend(loc="upper left", fontsize="small", frameon=False)
  if title:
    ax.set_title(title)
  if path is not None:
    fig.savefig(path, dpi=150, bbox_inches="tight")
  return fig
