"""Attention in an attribution graph: each edge split into the attention heads that carry it,
and an attention score attributed to the graph's nodes on its query and key sides.

Both are read from the local replacement model (:func:`~jaxlens.circuits.local_replacement`),
where attention patterns and norm scales are held, so the residual stream, every query and
every key are affine in the graph's nodes.

* :func:`head_loadings`: a path from a source to a target either crosses no attention (it stays
  at the source's position) or crosses a first attention head, ``(layer, head)``. The edge is
  the sum of its no-attention part and one part per first head, computed by pushing the
  source's write forward (``jax.jvp``) with the attention heads' outputs (``attn/z``) cut
  before that layer and kept for that one head at it (less the same push with that layer's
  heads all cut). The parts sum to the edge exactly.
* :func:`qk_attribution`: the query and the key of a head at two positions are affine in the
  nodes, ``q = sum_i q_i + q_0`` and ``k = sum_j k_j + k_0`` (``q_0``, ``k_0``: biases and
  constants); their product splits into ``q_i . k_j`` pairs. Each node's query-side part is
  ``q_i . k`` and its key-side part ``q . k_j``.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jaxlens.circuits._attribute import (
  Graph,
  LocalReplacement,
  _check_graph,
  _check_tokens,
  _unembedding,
  _without_transcoder,
  local_replacement,
  replacement,
)
from jaxlens.circuits._errors import CircuitError
from jaxlens.circuits._freeze import frozen_forward

__all__ = ["HeadLoadings", "QKAttribution", "head_loadings", "qk_attribution"]

_Z = re.compile(r"^blocks_(\d+)/attn/z$")


@dataclasses.dataclass(frozen=True)
class HeadLoadings:
  """Edges split by the first attention head their paths cross.

  Attributes:
    edges: int ``(n, 2)``: ``(target, source)`` node indices of the graph.
    total: ``(n,)``: each edge (the graph's ``adjacency[target, source]``, recomputed).
    residual: ``(n,)``: the part that crosses no attention head.
    heads: ``(n, n_layers, n_heads)``: the part whose first attention head is ``(layer,
      head)``. ``residual + heads.sum((1, 2)) == total``.
  """

  edges: Any
  total: Any
  residual: Any
  heads: Any


@dataclasses.dataclass(frozen=True)
class QKAttribution:
  """An attention score ``q . k`` of one head, split over the graph's nodes.

  Sources are the graph's nodes before its logits (features, errors, tokens), then one
  constant (biases, ``b_dec``, position embeddings, a zeroed first position's values).

  Attributes:
    score: ``q . k`` (the score the softmax reads is this times the layer's scale, then
      soft-capped where the model caps).
    queries: ``(n_sources + 1, d_head)``: each source's part of the query.
    keys: ``(n_sources + 1, d_head)``: each source's part of the key.
    query_side: ``(n_sources + 1,)``: ``q_i . k`` (sums to ``score``).
    key_side: ``(n_sources + 1,)``: ``q . k_j`` (sums to ``score``).
  """

  score: Any
  queries: Any
  keys: Any
  query_side: Any
  key_side: Any

  def pairs(self):
    """``(n_sources + 1, n_sources + 1)``: ``q_i . k_j``; sums to ``score``."""
    return self.queries @ self.keys.T


def _setup(model, variables, tokens, transcoders, graph, local):
  toks = _check_tokens(model, tokens)
  _check_graph(graph)
  if not np.array_equal(np.asarray(graph.input_tokens), np.asarray(toks)):
    raise CircuitError(
      "the graph was built on another prompt",
      code="invalid_argument",
      expected=np.asarray(graph.input_tokens).tolist(),
      received=np.asarray(toks).tolist(),
      fix="the tokens the graph was attributed on",
    )
  rep = replacement(model, transcoders)
  missing = _without_transcoder(transcoders)
  at = sorted({int(a) for a in graph.active_features[:, 0]} & missing)
  if at:
    # A layer given None has a stand-in that writes nothing: its features' parts would be 0.
    raise CircuitError(
      f"the graph has features at layer {at[0]}, which has no transcoder here (None in the "
      "list of transcoders): it was built with other transcoders",
      code="invalid_argument",
      site=f"blocks_{at[0]}/mlp",
      received=at,
      fix="the transcoders the graph was attributed with",
    )
  lr = (
    local if isinstance(local, LocalReplacement) else local_replacement(model, variables, toks, rep)
  )
  return toks, rep, lr


def _masked_run(model, variables, toks, rep, lr):
  """``(tok, writes, mask) -> (mlp_in, final, q, k)``: the replacement model with each attention
  head's output ``attn/z`` times ``mask[layer, head]``, and every layer's query and key."""
  run = frozen_forward(model, variables, toks[None], lr.recording, rep.skip, lr.const)

  def masked(tok, writes, mask):
    got: dict = {"q": {}, "k": {}}

    def intercept(next_fun, args, kwargs, context):
      out = next_fun(*args, **kwargs)
      if context.method_name != "__call__":
        return out
      path = "/".join(context.module.path)
      m = _Z.match(path)
      if m:
        return out * mask[int(m.group(1))][None, None, :, None].astype(out.dtype)
      for side in ("q", "k"):
        m = re.match(rf"^blocks_(\d+)/attn/{side}$", path)
        if m:
          got[side][int(m.group(1))] = out[0]
      return out

    with nn.intercept_methods(intercept):
      mlp_in, final = run(tok, writes)
    return mlp_in, final, got["q"], got["k"]

  return masked


def _node_writes(graph, lr, rep, nodes):
  """Each node's write ``(tok (seq, d), writes (L, seq, d))``, stacked over ``nodes``."""
  sl = graph.node_slices()
  seq, n_layers = graph.n_pos, graph.n_layers
  tok = np.asarray(lr.tok)
  errors = np.asarray(lr.errors)
  d = tok.shape[-1]
  dtok = np.zeros((len(nodes), seq, d), tok.dtype)
  dw = np.zeros((len(nodes), n_layers, seq, d), tok.dtype)
  for r, node in enumerate(nodes):
    node = int(node)
    if node < sl["features"].stop:
      k = graph.selected_features[node]
      layer, pos, feature = (int(a) for a in graph.active_features[k])
      value = graph.activation_values[k]
      for j in range(layer, n_layers):
        if j - layer < rep.W_dec[layer].shape[0]:
          dw[r, j, pos] = value * np.asarray(rep.W_dec[layer][j - layer][feature])
    elif node < sl["errors"].stop:
      e = node - sl["errors"].start
      dw[r, e // seq, e % seq] = errors[e // seq, e % seq]
    elif node < sl["tokens"].stop:
      p = node - sl["tokens"].start
      dtok[r, p] = tok[p]
    else:
      raise CircuitError(
        f"node {node} is a logit: it writes nothing",
        code="invalid_argument",
        received=node,
        fix="a feature, error or token node as a source",
      )
  return dtok, dw


def _readout(model, variables, graph, rep, lr, node):
  """The target ``node`` as ``(c_in (L, seq, d_in), c_final (seq, d))``: its value is
  ``sum(mlp_in * c_in) + sum(final * c_final)`` (a feature's pre-activation, or a logit's
  demeaned unembedding row at the last position)."""
  sl = graph.node_slices()
  node = int(node)
  mlp_in = lr.recording.mlp_in
  dtype = np.dtype(lr.tok.dtype)
  c_in = np.zeros((graph.n_layers, graph.n_pos, mlp_in[0].shape[-1]), dtype)
  c_final = np.zeros(lr.tok.shape, dtype)
  if node < sl["features"].stop:
    layer, pos, feature = (int(a) for a in graph.active_features[graph.selected_features[node]])
    c_in[layer, pos] = np.asarray(rep.W_enc[layer][:, feature])
    return c_in, c_final
  if sl["logits"].start <= node < sl["logits"].stop:
    token = int(graph.logit_tokens[node - sl["logits"].start])
    if token < 0:
      raise CircuitError(
        "the graph's logit target is a direction it does not store",
        code="invalid_argument",
        received=node,
        fix="a graph whose logit targets are tokens, or a feature target",
      )
    rows, _ = _unembedding(model, variables)
    c_final[-1] = np.asarray(rows(jnp.asarray([token]))[0] - rows(None))
    return c_in, c_final
  raise CircuitError(
    f"node {node} is an error or token node: it has no incoming edges",
    code="invalid_argument",
    received=node,
    fix="a feature or logit node as a target",
  )


def head_loadings(
  model,
  variables,
  tokens,
  transcoders,
  graph: Graph,
  edges,
  *,
  local: LocalReplacement | None = None,
) -> HeadLoadings:
  """Splits each of ``edges`` by the first attention head its paths cross.

  Args:
    model, variables, tokens, transcoders: as :func:`~jaxlens.circuits.attribute` (the
      graph's own, with ``zero_bos`` as it was built).
    graph: the :class:`~jaxlens.circuits.Graph`.
    edges: ``(target, source)`` node index pairs of the graph.
    local: the prompt's :class:`~jaxlens.circuits.LocalReplacement`, if built already.

  Returns:
    :class:`HeadLoadings`.

  Raises:
    CircuitError: ``invalid_argument`` (another prompt, a source that is a logit, a target
      that is an error or a token), and as :func:`~jaxlens.circuits.attribute`.
  """
  toks, rep, lr = _setup(model, variables, tokens, transcoders, graph, local)
  edges = np.asarray(edges, np.int64).reshape(-1, 2)
  n_layers = rep.n_layers
  masked = _masked_run(model, variables, toks, rep, lr)
  tok0, w0 = lr.tok, lr.node_writes + lr.errors
  n_heads = int(lr.recording.patterns["blocks_0/attn/pattern"].shape[1])
  # Mask configurations: C_b keeps every head of layers >= b and cuts the others (C_0 is the
  # edge, C_L its part that crosses no attention); (a, h) cuts layers < a, keeps head h alone
  # at layer a and every head after it. The output is affine in layer a's row of the mask,
  # so the part whose first head is (a, h) is config (a, h) minus C_{a+1}.
  eye = np.eye(n_heads)
  configs = []
  for b in range(n_layers + 1):
    m = np.ones((n_layers, n_heads))
    m[:b] = 0
    configs.append(m)
  for a in range(n_layers):
    for h in range(n_heads):
      m = np.ones((n_layers, n_heads))
      m[:a] = 0
      m[a] = eye[h]
      configs.append(m)
  configs = jnp.asarray(np.stack(configs), tok0.dtype)
  n_nodes = graph.adjacency.shape[0]
  if edges.size and (edges.min() < 0 or edges.max() >= n_nodes):
    raise CircuitError(
      f"an edge names a node outside the graph's {n_nodes}",
      code="index_out_of_range",
      expected=f"[0, {n_nodes})",
      received=edges.tolist(),
      fix="(target, source) indices of graph.adjacency",
    )
  dtok, dw = _node_writes(graph, lr, rep, edges[:, 1])
  reads = [_readout(model, variables, graph, rep, lr, t) for t in edges[:, 0]]
  c_in = np.stack([r[0] for r in reads]) if reads else np.zeros((0,) + w0.shape[:2] + (1,))
  c_final = np.stack([r[1] for r in reads]) if reads else np.zeros((0,) + tok0.shape)

  @jax.jit
  def push(dt, dwr, ci, cf):
    # One edge under every mask configuration: the source's write pushed forward, read out.
    def one(mask):
      def f(tok, writes):
        mlp_in, final, _, _ = masked(tok, writes, mask)
        return jnp.sum(mlp_in * ci) + jnp.sum(final * cf)

      return jax.jvp(f, (tok0, w0), (dt, dwr))[1]

    return jax.vmap(one)(configs)

  out = np.zeros((len(edges), len(configs)), np.dtype(tok0.dtype))
  for r in range(len(edges)):
    out[r] = np.asarray(push(dtok[r], dw[r], c_in[r], c_final[r]))
  cuts = out[:, : n_layers + 1]
  heads = out[:, n_layers + 1 :].reshape(len(edges), n_layers, n_heads)
  heads = heads - cuts[:, 1:, None]
  return HeadLoadings(edges=edges, total=cuts[:, 0], residual=cuts[:, -1], heads=heads)


def qk_attribution(
  model,
  variables,
  tokens,
  transcoders,
  graph: Graph,
  layer: int,
  head: int,
  query_position: int,
  key_position: int,
  *,
  local: LocalReplacement | None = None,
) -> QKAttribution:
  """Attributes head ``head``'s score ``q . k`` at layer ``layer`` between ``query_position``
  and ``key_position`` to the graph's nodes on the query and the key sides.

  Args:
    model, variables, tokens, transcoders: as :func:`~jaxlens.circuits.attribute`.
    graph: its :class:`~jaxlens.circuits.Graph`.
    layer, head: the attention head.
    query_position, key_position: the score's query and key positions.
    local: the prompt's :class:`~jaxlens.circuits.LocalReplacement`, if built already.

  Returns:
    :class:`QKAttribution`.

  Raises:
    CircuitError: ``index_out_of_range`` (a layer, head or position outside the model or
      prompt), ``invalid_argument`` (another prompt).
  """
  toks, rep, lr = _setup(model, variables, tokens, transcoders, graph, local)
  seq, n_layers = graph.n_pos, rep.n_layers
  n_heads = int(lr.recording.patterns["blocks_0/attn/pattern"].shape[1])
  for name, value, bound in (
    ("layer", layer, n_layers),
    ("head", head, n_heads),
    ("query_position", query_position, seq),
    ("key_position", key_position, seq),
  ):
    if (
      isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not 0 <= value < bound
    ):
      raise CircuitError(
        f"{name}={value!r} is outside [0, {bound})",
        code="index_out_of_range",
        expected=f"[0, {bound})",
        received=repr(value),
        fix=f"an int {name} in [0, {bound})",
      )
  masked = _masked_run(model, variables, toks, rep, lr)
  ones = jnp.ones((n_layers, n_heads), lr.tok.dtype)
  tok0, w0 = lr.tok, lr.node_writes + lr.errors

  def qk(tok, writes):
    _, _, q, k = masked(tok, writes, ones)
    q, k = q[layer], k[layer]
    kv = head // (q.shape[1] // k.shape[1])
    return q[query_position, head], k[key_position, kv]

  q0, k0 = jax.jit(qk)(tok0, w0)
  _, vjp = jax.vjp(qk, tok0, w0)
  eye = jnp.eye(q0.shape[-1], dtype=q0.dtype)
  zeros = jnp.zeros_like(eye)
  # The rows of the linear maps from (tok, writes) to q and to k.
  gq = jax.jit(jax.vmap(lambda c: vjp((c, zeros[0]))))(eye)
  gk = jax.jit(jax.vmap(lambda c: vjp((zeros[0], c))))(eye)
  n_src = graph.node_slices()["tokens"].stop
  nodes = np.arange(n_src)
  dtok, dw = _node_writes(graph, lr, rep, nodes)

  def parts(g):
    g_tok, g_w = (np.asarray(a) for a in g)
    return np.einsum("esd,nsd->ne", g_tok, dtok) + np.einsum("elsd,nlsd->ne", g_w, dw)

  q_parts, k_parts = parts(gq), parts(gk)
  q0, k0 = np.asarray(q0), np.asarray(k0)
  queries = np.concatenate([q_parts, (q0 - q_parts.sum(0))[None]])
  keys = np.concatenate([k_parts, (k0 - k_parts.sum(0))[None]])
  return QKAttribution(
    score=float(q0 @ k0),
    queries=queries,
    keys=keys,
    query_side=queries @ k0,
    key_side=keys @ q0,
  )
