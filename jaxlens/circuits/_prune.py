"""Influence, pruning and the graph's scores, as circuit-tracer defines them (``graph.py``),
with the cumulative-influence thresholds found by selection instead of a full sort.

A graph on disk (its adjacency a ``numpy.memmap``, as ``attribute(..., graph_path=...)`` and
``load_graph(..., mmap=True)`` give) is worked in blocks of rows: its influence in one backward
pass over the rows (a graph's edges go from earlier layers to later ones, so each block's
influence is complete once the later rows are done), the edge threshold by bisection over the
scores' bit patterns (a histogram a pass), so that no more than a block of rows and the
kept nodes' vectors is ever in memory."""

from __future__ import annotations

import collections
from typing import NamedTuple

import numpy as np

from jaxlens.circuits._errors import CircuitError

__all__ = [
  "PruneResult",
  "block",
  "entries",
  "is_on_disk",
  "is_sparse",
  "compute_influence",
  "find_threshold",
  "graph_scores",
  "normalize_matrix",
  "partial_influences",
  "prune",
]


def _drop_dangling(node_mask, keep, r, c, inner: int, n_features: int) -> None:
  """Drops, in place until nothing changes, the nodes among the first ``inner`` (features and
  errors) without a kept outgoing edge (column ``c``) and the features without a kept incoming
  one (row ``r``), and the edges ``keep`` marks that touch a dropped node."""
  n = len(node_mask)
  while True:
    old = node_mask.copy()
    node_mask[:inner] &= np.bincount(c[keep], minlength=n)[:inner] > 0
    node_mask[:n_features] &= np.bincount(r[keep], minlength=n)[:n_features] > 0
    keep &= node_mask[r] & node_mask[c]
    if np.array_equal(node_mask, old):
      break


def is_sparse(matrix) -> bool:
  """Whether ``matrix`` is a ``scipy.sparse`` matrix or array (a graph with sparse rows)."""
  return hasattr(matrix, "tocsr") and not isinstance(matrix, np.ndarray)


def is_on_disk(matrix) -> bool:
  """Whether ``matrix`` is a ``numpy.memmap`` (a graph on disk: worked in blocks of rows)."""
  return isinstance(matrix, np.memmap)


def _coordinates(csr):
  """``(rows, columns)`` of a CSR matrix's stored entries."""
  return np.repeat(np.arange(csr.shape[0]), np.diff(csr.indptr)), csr.indices


def entries(matrix, rows, columns):
  """``matrix[rows[i], columns[i]]`` for each ``i`` (dense or sparse)."""
  rows, columns = np.asarray(rows, np.int64), np.asarray(columns, np.int64)
  if not is_sparse(matrix):
    return np.asarray(matrix)[rows, columns]
  if len(rows) == 0:
    return np.zeros(0, matrix.dtype)
  return np.asarray(matrix.tocsr()[rows, columns]).ravel()


def block(matrix, nodes):
  """The dense block ``matrix[nodes][:, nodes]`` (dense or sparse)."""
  nodes = np.asarray(nodes, np.int64)
  if is_sparse(matrix):
    return matrix.tocsr()[nodes][:, nodes].toarray()
  return np.asarray(matrix)[np.ix_(nodes, nodes)]


def _row_normalized(a, eps):
  # |A| with each row divided by max(its sum, eps); a sparse A stays sparse (same entries).
  if is_sparse(a):
    out = a.tocsr().copy()
    out.data = np.abs(out.data)
    sums = np.bincount(_coordinates(out)[0], out.data, minlength=out.shape[0])
    out.data = out.data / np.repeat(np.maximum(sums, eps), np.diff(out.indptr)).astype(out.dtype)
    return out
  a = np.abs(a)
  return a / np.maximum(a.sum(axis=1, keepdims=True), eps)


def normalize_matrix(matrix):
  """``|A|`` with each row divided by its sum (rows summing to zero stay zero); a sparse
  ``A`` (``scipy.sparse``) gives a CSR array with the same entries."""
  return _row_normalized(matrix, 1e-10)


def compute_influence(a, logit_weights, max_iter: int = 1000):
  """``w A + w A² + ...`` (the total influence on the weighted logits); ``A`` is nilpotent
  for a graph (every edge goes forward), so the sum ends.

  Raises:
    CircuitError: ``circuit_not_acyclic`` when it does not end within ``max_iter`` terms.
  """
  current = logit_weights @ a
  influence = current.copy()
  for _ in range(max_iter):
    if not current.any():
      return influence
    current = current @ a
    influence += current
  raise CircuitError(
    f"the influence did not converge in {max_iter} iterations: the adjacency has a cycle",
    code="circuit_not_acyclic",
    fix="an adjacency whose edges all go forward (a graph from circuits.attribute)",
  )


def partial_influences(edge_matrix, logit_p, row_to_node, max_iter: int = 128):
  """circuit-tracer's influence of every column from the rows computed so far (the order in
  which a node budget visits the features)."""
  a = _row_normalized(edge_matrix, 1e-8)
  influence = np.zeros(edge_matrix.shape[1], a.dtype)
  prod = np.zeros(edge_matrix.shape[1], a.dtype)
  prod[len(prod) - len(logit_p) :] = logit_p
  for _ in range(max_iter):
    prod = prod[row_to_node] @ a
    if not prod.any():
      return influence
    influence += prod
  raise CircuitError(
    f"the partial influence did not converge in {max_iter} iterations",
    code="circuit_not_acyclic",
    fix="an adjacency whose edges all go forward",
  )


def find_threshold(scores, threshold: float):
  """The largest score ``t`` such that the scores ``>= t`` hold at least ``threshold`` of the
  total: circuit-tracer's sorted-cumsum threshold, found by selection (``np.partition``,
  linear time on average) instead of sorting every score. At ``threshold >= 1`` every score
  is kept (the smallest is returned), as circuit-tracer intends (its cumulative sum reaches 1
  or not by rounding)."""
  s = np.asarray(scores).ravel()
  if threshold >= 1.0:
    return s.min()
  need = threshold * s.sum()
  above = 0.0  # the sum of the scores known to be above the candidates
  cand = s
  while cand.size > 256:
    pivot = np.partition(cand, cand.size // 2)[cand.size // 2]
    high = cand[cand > pivot]
    if above + high.sum() >= need:
      cand = high
      continue
    above += high.sum() + pivot * np.count_nonzero(cand == pivot)
    if above >= need:
      return pivot
    cand = cand[cand < pivot]
  if cand.size == 0:
    return s.min()
  ordered = np.sort(cand)[::-1]
  cum = above + np.cumsum(ordered)
  i = int(np.searchsorted(cum, need))
  return ordered[min(i, len(ordered) - 1)]


class PruneResult(NamedTuple):
  """``node_mask``, ``edge_mask`` (boolean) and each node's cumulative influence score."""

  node_mask: np.ndarray
  edge_mask: np.ndarray
  cumulative_scores: np.ndarray


def _check_fraction(value, name):
  if not isinstance(value, (int, float, np.floating)) or not 0.0 <= float(value) <= 1.0:
    raise CircuitError(
      f"{name} must be a fraction in [0, 1], got {value!r}",
      code="invalid_argument",
      received=repr(value),
      fix=f"{name}=0.8",
    )


def prune(graph, node_threshold: float = 0.8, edge_threshold: float = 0.98) -> PruneResult:
  """circuit-tracer's ``prune_graph``: keep the nodes holding ``node_threshold`` of the
  influence on the logits (tokens and logits always), then the edges holding
  ``edge_threshold`` of the edge influence, then drop features and errors left without an
  outgoing edge and features without an incoming one, until nothing changes.

  A graph with sparse rows is pruned over its stored entries (the rest are zero); its
  ``edge_mask`` is then a ``scipy.sparse.csr_array`` of booleans.

  Raises:
    CircuitError: ``invalid_argument`` for a threshold outside ``[0, 1]``.
  """
  _check_fraction(node_threshold, "node_threshold")
  _check_fraction(edge_threshold, "edge_threshold")
  if is_on_disk(graph.adjacency):
    return _prune_blocked(graph, node_threshold, edge_threshold)
  if is_sparse(graph.adjacency):
    return _prune_sparse(graph, node_threshold, edge_threshold)
  a = np.asarray(graph.adjacency)
  n_logits, n_tokens, n_features = graph.n_logits, graph.n_pos, graph.n_features
  weights = graph.logit_weights()
  node_influence = compute_influence(normalize_matrix(a), weights)
  node_mask = node_influence >= find_threshold(node_influence, node_threshold)
  node_mask[len(node_mask) - n_logits - n_tokens :] = True
  pruned = a.copy()
  pruned[~node_mask] = 0
  pruned[:, ~node_mask] = 0
  normalized = normalize_matrix(pruned)
  edge_influence = compute_influence(normalized, weights) + weights
  edge_scores = normalized * edge_influence[:, None]
  edge_mask = edge_scores >= find_threshold(edge_scores, edge_threshold)
  inner = len(node_mask) - n_logits - n_tokens
  old = node_mask.copy()
  node_mask[:inner] &= edge_mask[:, :inner].any(0)
  node_mask[:n_features] &= edge_mask[:n_features].any(1)
  while not np.array_equal(node_mask, old):
    old[:] = node_mask
    edge_mask[~node_mask] = False
    edge_mask[:, ~node_mask] = False
    node_mask[:inner] &= edge_mask[:, :inner].any(0)
    node_mask[:n_features] &= edge_mask[:n_features].any(1)
  return PruneResult(node_mask, edge_mask, _cumulative(node_influence))


def _cumulative(node_influence):
  order = np.argsort(-node_influence, kind="stable")
  cumulative = np.cumsum(node_influence[order]) / node_influence.sum()
  scores = np.zeros_like(node_influence)
  scores[order] = cumulative
  return scores


def _prune_sparse(graph, node_threshold, edge_threshold) -> PruneResult:
  """:func:`prune` over the stored entries of a sparse adjacency (the others are zero): the
  same steps, on the entries' values; the edge mask is a CSR array of the same layout."""
  from scipy import sparse

  a = graph.adjacency.tocsr()
  n = a.shape[0]
  r, c = _coordinates(a)
  n_logits, n_tokens, n_features = graph.n_logits, graph.n_pos, graph.n_features
  weights = graph.logit_weights()
  node_influence = compute_influence(normalize_matrix(a), weights)
  node_mask = node_influence >= find_threshold(node_influence, node_threshold)
  node_mask[n - n_logits - n_tokens :] = True
  pruned = a.copy()
  pruned.data = np.where(node_mask[r] & node_mask[c], a.data, 0)
  normalized = normalize_matrix(pruned)
  edge_influence = compute_influence(normalized, weights) + weights
  edge_scores = normalized.data * edge_influence[r]
  keep = edge_scores >= find_threshold(edge_scores, edge_threshold)
  _drop_dangling(node_mask, keep, r, c, n - n_logits - n_tokens, n_features)
  edge_mask = sparse.csr_array((keep, a.indices.copy(), a.indptr.copy()), shape=a.shape)
  edge_mask.eliminate_zeros()
  return PruneResult(node_mask, edge_mask, _cumulative(node_influence))


def graph_scores(graph) -> tuple[float, float]:
  """circuit-tracer's ``compute_graph_scores``: ``(replacement, completeness)``.

  The replacement score is the tokens' share of the influence of tokens and errors on the
  logits; the completeness score the share of each node's input that does not come from
  errors, averaged with weights the nodes' influence (plus the logits' own weights).
  """
  sl = graph.node_slices()
  weights = graph.logit_weights()
  if is_on_disk(graph.adjacency):
    return _graph_scores_blocked(graph, sl, weights)
  adjacency = graph.adjacency if is_sparse(graph.adjacency) else np.asarray(graph.adjacency)
  normalized = normalize_matrix(adjacency)
  influence = compute_influence(normalized, weights)
  token = influence[sl["tokens"]].sum()
  error = influence[sl["errors"]].sum()
  replacement = token / (token + error)
  if is_sparse(normalized):
    r, c = _coordinates(normalized)
    from_errors = (c >= sl["errors"].start) & (c < sl["errors"].stop)
    n = normalized.shape[0]
    non_error = 1 - np.bincount(r, normalized.data * from_errors, minlength=n)
  else:
    non_error = 1 - normalized[:, sl["errors"]].sum(axis=-1)
  out = influence + weights
  completeness = (non_error * out).sum() / out.sum()
  return float(replacement), float(completeness)


# A graph on disk: the bytes of rows read at a time (a block of rows and its normalised copy,
# in float64 for the products, is what the passes hold beside the node vectors).
_BLOCK_BYTES = 32 * 2**20
# The passes over a graph on disk, by kind (tests check which way its influence went).
PASSES: collections.Counter = collections.Counter()


class _Rows:
  """The square matrix ``adjacency[nodes][:, nodes]`` (``nodes`` ascending; None: every node),
  read a block of rows at a time: from the file, or from memory once it is small enough."""

  def __init__(self, adjacency, nodes=None):
    self.dtype = adjacency.dtype
    self.m = adjacency.shape[0] if nodes is None else len(nodes)
    # a block's rows are read whole (every column) before the kept columns are taken
    self.step = max(1, _BLOCK_BYTES // max(1, adjacency.shape[1] * self.dtype.itemsize))
    self.source, self.nodes = adjacency, nodes
    if nodes is not None and self.m**2 * self.dtype.itemsize <= _BLOCK_BYTES:
      # the kept nodes' square fits in a block: read it once
      self.source, self.nodes = (
        np.concatenate([self.block(lo, min(lo + self.step, self.m)) for lo in self.starts()]),
        None,
      )
      self.step = max(1, _BLOCK_BYTES // max(1, self.m * self.dtype.itemsize))

  def block(self, lo: int, hi: int):
    if self.nodes is None:
      return np.array(self.source[lo:hi])
    return np.asarray(self.source[self.nodes[lo:hi]])[:, self.nodes]

  def starts(self):
    return range(0, self.m, self.step)


def _influence_blocked(rows: _Rows, weights, eps, on_block=None):
  """``compute_influence(|A| / row sums, weights)`` over ``rows`` (plus the row sums), the
  rows read a block at a time.

  One backward pass when every edge into a row that has edges comes from a later row (a
  graph's: its targets are features ordered by layer, then logits; errors and tokens have
  no row): each block's influence is then complete once the later blocks are done, and the
  edges within a block are a triangular solve. Otherwise (an edited graph), the power series
  by passes, as :func:`compute_influence`. ``on_block(lo, hi, normalized)`` sees each block.
  """
  from scipy.linalg import solve_triangular

  m = rows.m
  sums = np.zeros(m, rows.dtype)
  influence = np.zeros(m)
  w = np.asarray(weights, np.float64)
  ordered = True
  for lo in reversed(rows.starts()):
    hi = min(lo + rows.step, m)
    r = np.abs(rows.block(lo, hi))
    sums[lo:hi] = r.sum(axis=1)
    r /= np.maximum(sums[lo:hi], eps)[:, None]
    if on_block is not None:
      on_block(lo, hi, r)
    if not ordered or not sums[lo:hi].any():
      continue
    has_row = sums[lo:] > 0  # columns at or after the block whose node has a row
    inner = r[:, lo:hi]
    if np.triu(inner)[:, has_row[: hi - lo]].any() or r[:, hi:][:, has_row[hi - lo :]].any():
      ordered = False
      continue
    below = np.tril(inner, -1).astype(np.float64)
    y = solve_triangular(np.eye(hi - lo) - below.T, w[lo:hi] + influence[lo:hi], lower=False)
    influence += y @ r
  PASSES["backward"] += 1
  if ordered:
    return influence, sums
  # The power series, a pass over the rows a term.
  current = w
  influence = np.zeros(m)
  for _ in range(1000):
    nxt = np.zeros(m)
    for lo in rows.starts():
      hi = min(lo + rows.step, m)
      if current[lo:hi].any():
        nxt += current[lo:hi] @ (np.abs(rows.block(lo, hi)) / np.maximum(sums[lo:hi], eps)[:, None])
    PASSES["series"] += 1
    if not nxt.any():
      return influence, sums
    influence += nxt
    current = nxt
  raise CircuitError(
    "the influence did not converge in 1000 iterations: the adjacency has a cycle",
    code="circuit_not_acyclic",
    fix="an adjacency whose edges all go forward (a graph from circuits.attribute)",
  )


def _bits(scores):
  """The scores' bit patterns as int64 (ordered as the scores, which are >= 0)."""
  return scores.view(np.int32 if scores.dtype.itemsize == 4 else np.int64).astype(np.int64)


def _edge_threshold_blocked(rows: _Rows, row_weights, threshold):
  """:func:`find_threshold` of the scores ``|A| / row sums * row_weights[:, None]`` over
  ``rows``, never holding them all: bisection over the scores' bit patterns, a histogram of
  2**16 bins a pass (two passes in float32, four in float64). Returns ``(t, row sums)``."""
  dtype = rows.dtype
  sums = np.zeros(rows.m, dtype)
  for lo in rows.starts():
    hi = min(lo + rows.step, rows.m)
    sums[lo:hi] = np.abs(rows.block(lo, hi)).sum(axis=1)
  if threshold >= 1.0:
    return dtype.type(0), sums
  denominators = np.maximum(sums, 1e-10)
  bins = 1 << 16
  lo_bits, hi_bits = 0, int(_bits(np.asarray([np.finfo(dtype).max], dtype))[0]) + 1
  above, need = 0.0, None
  while hi_bits - lo_bits > 1:
    width = -(-(hi_bits - lo_bits) // bins)
    hist = np.zeros(bins)
    for lo in rows.starts():
      hi = min(lo + rows.step, rows.m)
      scores = np.abs(rows.block(lo, hi)) / denominators[lo:hi, None] * row_weights[lo:hi, None]
      b = _bits(scores.ravel())
      sel = (b >= lo_bits) & (b < hi_bits)
      hist += np.bincount((b[sel] - lo_bits) // width, scores.ravel()[sel], minlength=bins)[:bins]
    if need is None:  # the first pass covers every score
      need = threshold * hist.sum()
    from_top = above + np.cumsum(hist[::-1])
    k = int(np.searchsorted(from_top, need))  # the first bin (from the top) that reaches it
    if k >= bins:  # rounding: the total falls short of need; keep the smallest scores
      k = bins - 1
    at = bins - 1 - k
    above = from_top[k - 1] if k > 0 else above
    lo_bits, hi_bits = lo_bits + at * width, min(lo_bits + (at + 1) * width, hi_bits)
  t = np.asarray([lo_bits], np.int32 if dtype.itemsize == 4 else np.int64).view(dtype)[0]
  return t, sums


def _prune_blocked(graph, node_threshold, edge_threshold) -> PruneResult:
  """:func:`prune` of a graph on disk, in blocks of rows: the node influence in one pass over
  the file, then the edge influence, threshold and kept edges over the kept nodes' rows only
  (their columns restricted to the kept nodes: the pruned matrix is zero elsewhere). The edge
  mask is a CSR array of the kept edges."""
  from scipy import sparse

  a = graph.adjacency
  n = a.shape[0]
  n_logits, n_tokens, n_features = graph.n_logits, graph.n_pos, graph.n_features
  weights = graph.logit_weights()
  node_influence = _influence_blocked(_Rows(a), weights, 1e-10)[0].astype(a.dtype)
  node_mask = node_influence >= find_threshold(node_influence, node_threshold)
  node_mask[n - n_logits - n_tokens :] = True
  kept = np.flatnonzero(node_mask)
  rows = _Rows(a, kept)
  edge_influence, _ = _influence_blocked(rows, weights[kept], 1e-10)
  row_weights = (edge_influence + weights[kept]).astype(a.dtype)
  t, sums = _edge_threshold_blocked(rows, row_weights, edge_threshold)
  r_all, c_all = [], []
  denominators = np.maximum(sums, 1e-10)
  for lo in rows.starts():
    hi = min(lo + rows.step, rows.m)
    scores = np.abs(rows.block(lo, hi)) / denominators[lo:hi, None] * row_weights[lo:hi, None]
    r, c = np.nonzero(scores >= t if t > 0 else scores > 0)
    r_all.append(kept[r + lo])
    c_all.append(kept[c])
  r = np.concatenate(r_all) if r_all else np.zeros(0, np.int64)
  c = np.concatenate(c_all) if c_all else np.zeros(0, np.int64)
  keep = np.ones(len(r), bool)
  _drop_dangling(node_mask, keep, r, c, n - n_logits - n_tokens, n_features)
  edge_mask = sparse.csr_array((np.ones(int(keep.sum()), bool), (r[keep], c[keep])), shape=(n, n))
  return PruneResult(node_mask, edge_mask, _cumulative(node_influence))


def _graph_scores_blocked(graph, sl, weights) -> tuple[float, float]:
  """:func:`graph_scores` of a graph on disk: one pass over its rows."""
  n = graph.adjacency.shape[0]
  from_errors = np.zeros(n)

  def errors_share(lo, hi, normalized):
    from_errors[lo:hi] = normalized[:, sl["errors"]].sum(axis=-1)

  influence, _ = _influence_blocked(_Rows(graph.adjacency), weights, 1e-10, errors_share)
  influence = influence.astype(graph.adjacency.dtype)
  token = influence[sl["tokens"]].sum()
  error = influence[sl["errors"]].sum()
  out = influence + weights
  completeness = ((1 - from_errors) * out).sum() / out.sum()
  return float(token / (token + error)), float(completeness)
