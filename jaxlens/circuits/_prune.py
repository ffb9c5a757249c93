"""Influence, pruning and the graph's scores, as circuit-tracer defines them (``graph.py``),
with the cumulative-influence thresholds found by selection instead of a full sort."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from jaxlens.circuits._errors import CircuitError

__all__ = [
  "PruneResult",
  "block",
  "entries",
  "is_sparse",
  "compute_influence",
  "find_threshold",
  "graph_scores",
  "normalize_matrix",
  "partial_influences",
  "prune",
]


def is_sparse(matrix) -> bool:
  """Whether ``matrix`` is a ``scipy.sparse`` matrix or array (a graph with sparse rows)."""
  return hasattr(matrix, "tocsr") and not isinstance(matrix, np.ndarray)


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
  inner = n - n_logits - n_tokens
  while True:
    old = node_mask.copy()
    node_mask[:inner] &= np.bincount(c[keep], minlength=n)[:inner] > 0
    node_mask[:n_features] &= np.bincount(r[keep], minlength=n)[:n_features] > 0
    keep &= node_mask[r] & node_mask[c]
    if np.array_equal(node_mask, old):
      break
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
