"""Attribution graphs: the direct effects between active transcoder features, error nodes,
token embeddings and logits, in circuit-tracer's layout, from one VJP of the replacement
model (:mod:`jaxlens.circuits._freeze`)."""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import functools
import os
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxlens import distributed
from jaxlens.internal import auto_axes
from jaxlens.circuits._errors import CircuitError
from jaxlens.circuits._freeze import Recording, frozen_forward, record
from jaxlens.circuits._ondisk import GraphWriter, check_graph_path
from jaxlens.lens import readout
from jaxlens.circuits._prune import partial_influences
from jaxlens.sae import CrossLayerTranscoder, Transcoder

__all__ = [
  "Graph",
  "LocalReplacement",
  "Replacement",
  "attribute",
  "local_replacement",
  "memory_estimate",
  "replacement",
]


@dataclasses.dataclass(frozen=True)
class Replacement:
  """The transcoders of a model, one layout for per-layer transcoders and a cross-layer one.

  Attributes:
    n_layers: the model's layers.
    W_enc: per layer ``(d_in, d_sae)``.
    b_enc: per layer ``(d_sae,)``.
    W_dec: per source layer, ``(n_targets, d_sae, d)``: its decoders into layers
      ``l, l + 1, ...`` (one for a per-layer transcoder).
    b_dec: per layer ``(d,)``.
    W_skip: per layer ``(d, d_in)`` or None.
    encoders: per layer, ``x -> acts`` (the transcoder's own ``encode``).
    cross_layer: whether the features write to later layers too.
  """

  n_layers: int
  W_enc: tuple
  b_enc: tuple
  W_dec: tuple
  b_dec: tuple
  W_skip: tuple
  encoders: tuple
  cross_layer: bool
  source: Any = None  # the transcoders it was built from (arguments of the cached programs)

  def skip(self, layer: int, x):
    w = self.W_skip[layer]
    return jnp.zeros_like(x) if w is None else x.astype(w.dtype) @ w.T

  def decode_writes(self, acts):
    """Per layer, what the features write (no ``b_dec``): ``acts`` is per layer ``(seq, d_sae)``."""
    out = []
    for j in range(self.n_layers):
      total = 0
      for i in range(j + 1):
        if j - i < self.W_dec[i].shape[0]:
          total = total + acts[i] @ self.W_dec[i][j - i]
      out.append(total)
    return jnp.stack(out)


def _mismatch(message, **fields) -> CircuitError:
  return CircuitError(message, code="circuit_transcoder_mismatch", **fields)


def replacement(model, transcoders) -> Replacement:
  """The :class:`Replacement` of ``transcoders`` for ``model``: a sequence of one
  :class:`jaxlens.sae.Transcoder` per layer (reading the MLP's input, writing ``mlp_out``) or
  one :class:`jaxlens.sae.CrossLayerTranscoder`.

  Raises:
    CircuitError: ``circuit_transcoder_mismatch`` (another layer count, widths that are not
      the model's, a run-time normalisation the graph cannot freeze, a TopK activation).
  """
  n = model.config.n_layers
  d = model.config.d_model
  if isinstance(transcoders, CrossLayerTranscoder):
    clt = transcoders
    if clt.n_layers != n:
      raise _mismatch(
        f"the cross-layer transcoder has {clt.n_layers} layers, the model {n}",
        expected=n,
        received=clt.n_layers,
        fix="one encoder per layer of the model",
      )
    if clt.W_enc.shape[1] != d or clt.b_dec.shape[-1] != d:
      raise _mismatch(
        f"the cross-layer transcoder reads {clt.W_enc.shape[1]} and writes "
        f"{clt.b_dec.shape[-1]} features, the model's width is {d}",
        expected=d,
        received=(int(clt.W_enc.shape[1]), int(clt.b_dec.shape[-1])),
        fix="a transcoder trained on this model's MLP inputs and outputs",
      )
    return Replacement(
      n,
      tuple(clt.W_enc[i] for i in range(n)),
      tuple(clt.b_enc[i] for i in range(n)),
      tuple(clt.W_dec),
      tuple(clt.b_dec[i] for i in range(n)),
      (None,) * n,
      tuple(lambda x, i=i: clt.encode_layer(i, x) for i in range(n)),
      True,
      clt,
    )
  if (
    not isinstance(transcoders, Sequence)
    or not all(t is None or isinstance(t, Transcoder) for t in transcoders)
    or all(t is None for t in transcoders)
  ):
    raise CircuitError(
      "transcoders must be a sequence of jaxlens.sae.Transcoder (one per layer, None for a "
      "layer without one, at least one given) or a jaxlens.sae.CrossLayerTranscoder, got "
      f"{type(transcoders).__name__}",
      code="invalid_argument",
      received=type(transcoders).__name__,
      fix="[sae.Transcoder.init(...) for each layer] or sae.CrossLayerTranscoder.init(...)",
    )
  if len(transcoders) != n:
    raise _mismatch(
      f"{len(transcoders)} transcoders for a model of {n} layers",
      expected=n,
      received=len(transcoders),
      fix="one transcoder per layer, in layer order",
    )
  for i, t in enumerate(transcoders):
    if t is None:
      continue
    if t.d_in != d or t.d_out != d:
      raise _mismatch(
        f"transcoder {i} reads {t.d_in} and writes {t.d_out} features, the model's width is {d}",
        site=f"blocks_{i}/mlp",
        expected=d,
        received=(t.d_in, t.d_out),
        fix="a transcoder trained on this model's MLP inputs and outputs",
      )
    if t.normalize_activations != "none" or t.activation in ("topk", "batchtopk"):
      raise _mismatch(
        f"transcoder {i} has normalize_activations={t.normalize_activations!r} and activation "
        f"{t.activation!r}: a graph needs each feature's pre-activation linear in its input "
        "and its activation a function of its own pre-activation",
        site=f"blocks_{i}/mlp",
        received=(t.normalize_activations, t.activation),
        fix="normalize_activations='none' and a relu or jumprelu activation",
      )
  transcoders = _fill_missing(transcoders)
  return Replacement(
    n,
    tuple(t.W_enc for t in transcoders),
    tuple(t.b_enc for t in transcoders),
    tuple(t.W_dec[None] for t in transcoders),
    tuple(t.b_dec for t in transcoders),
    tuple(t.W_skip for t in transcoders),
    tuple(t.encode for t in transcoders),
    False,
    tuple(transcoders),
  )


def _without_transcoder(transcoders) -> frozenset:
  """The layers given ``None`` in a list of per-layer transcoders (no features there)."""
  if isinstance(transcoders, CrossLayerTranscoder):
    return frozenset()
  return frozenset(i for i, t in enumerate(transcoders) if t is None)


def _fill_missing(transcoders):
  """``transcoders`` with each ``None`` (a layer without a transcoder) made a transcoder of
  the others' width whose features never fire (``relu(0 x - 1)``) and that writes nothing: the
  layer's whole MLP output is its error node."""
  given = next(t for t in transcoders if t is not None)
  silent = Transcoder(
    W_enc=jnp.zeros_like(given.W_enc),
    b_enc=jnp.full_like(given.b_enc, -1.0),
    W_dec=jnp.zeros_like(given.W_dec),
    b_dec=jnp.zeros_like(given.b_dec),
    activation="relu",
  )
  return [silent if t is None else t for t in transcoders]


@dataclasses.dataclass(frozen=True)
class Graph:
  """An attribution graph in circuit-tracer's layout.

  Nodes are ordered ``[selected features, errors (layer-major, then position), tokens,
  logits]``; ``adjacency[target, source]`` is the direct effect of ``source`` on ``target``
  (a feature's pre-activation, or a logit): rows of errors and tokens are zero.

  Attributes:
    adjacency: ``(n, n)`` numpy array.
    input_tokens: int ``(seq,)``.
    active_features: int ``(n_active, 3)``: ``(layer, position, feature)`` of every active
      feature, in that order.
    activation_values: ``(n_active,)``.
    selected_features: int indices into ``active_features`` of the feature nodes.
    logit_tokens: int ``(n_logits,)`` (``-1`` for a direction the user gave).
    logit_probabilities: ``(n_logits,)``: the weights of the logit nodes.
    n_layers: the model's layers.
  """

  adjacency: Any
  input_tokens: Any
  active_features: Any
  activation_values: Any
  selected_features: Any
  logit_tokens: Any
  logit_probabilities: Any
  n_layers: int

  @property
  def n_pos(self) -> int:
    return int(len(self.input_tokens))

  @property
  def n_features(self) -> int:
    return int(len(self.selected_features))

  @property
  def n_logits(self) -> int:
    return int(len(self.logit_tokens))

  @property
  def n_errors(self) -> int:
    return self.n_layers * self.n_pos

  def node_slices(self) -> dict[str, slice]:
    """The node kinds' index ranges: ``features``, ``errors``, ``tokens``, ``logits``."""
    f, e, t = self.n_features, self.n_errors, self.n_pos
    return {
      "features": slice(0, f),
      "errors": slice(f, f + e),
      "tokens": slice(f + e, f + e + t),
      "logits": slice(f + e + t, f + e + t + self.n_logits),
    }

  def logit_weights(self):
    """``(n,)``: the logit nodes' probabilities, zero elsewhere (the influence's start)."""
    w = np.zeros(self.adjacency.shape[0], self.adjacency.dtype)
    w[self.node_slices()["logits"]] = self.logit_probabilities
    return w


@functools.partial(jax.jit, static_argnames=("model",))
def _id_targets(model, variables, logits, ids):
  TRACES["targets"] += 1
  unembed, _ = _unembedding(model, variables)
  return jax.nn.softmax(logits)[ids], unembed(ids) - unembed(None)


def _token_targets(model, variables, logits, ids):
  """circuit-tracer's targets from token ids: their probabilities and demeaned rows."""
  p, vecs = _call(_id_targets, model, variables, logits, jnp.asarray(ids))
  return np.asarray(ids), np.asarray(p), np.asarray(vecs)


@functools.partial(jax.jit, static_argnames=("model", "k"))
def _top_targets(model, variables, logits, k):
  TRACES["targets"] += 1
  unembed, _ = _unembedding(model, variables)
  top_p, top_idx = jax.lax.top_k(jax.nn.softmax(logits), k)
  return top_p, top_idx, unembed(top_idx) - unembed(None)


def _salient_logits(model, variables, logits, max_n_logits: int, desired_logit_prob: float):
  """circuit-tracer's ``compute_salient_logits``: the fewest top tokens whose probability
  reaches ``desired_logit_prob`` (at most ``max_n_logits``), their probabilities and their
  unembedding rows minus the mean row."""
  k = min(max_n_logits, logits.shape[-1])
  out = _call(_top_targets, model, variables, logits, k=k)
  top_p, top_idx, vecs = (np.asarray(a) for a in out)
  cutoff = int(np.searchsorted(np.cumsum(top_p), desired_logit_prob)) + 1
  return top_idx[:cutoff], top_p[:cutoff], vecs[:cutoff]


def _check_graph(graph) -> None:
  """``invalid_argument`` unless ``graph`` is a :class:`Graph`."""
  if not isinstance(graph, Graph):
    raise CircuitError(
      f"graph must be a circuits.Graph, got {type(graph).__name__}",
      code="invalid_argument",
      received=type(graph).__name__,
      fix="graph = circuits.attribute(model, variables, tokens, transcoders)",
    )


def _check_tokens(model, tokens):
  if getattr(model, "config", None) is None or not hasattr(model.config, "n_layers"):
    # (the demo GPT has layer sites but no zoo configuration: config.n_layers raised a raw
    # AttributeError)
    raise CircuitError(
      f"{type(model).__name__} is not a decoder of jaxlens.models: an attribution graph reads "
      "its configuration and the sites the zoo names",
      code="circuit_unsupported_model",
      received=type(model).__name__,
      fix="a decoder of jaxlens.models with scan_layers=False",
    )
  t = np.asarray(tokens)
  if t.ndim == 2 and t.shape[0] == 1:
    t = t[0]
  if t.ndim != 1 or not np.issubdtype(t.dtype, np.integer):
    raise CircuitError(
      f"tokens must be one prompt of int token ids (seq,) or (1, seq), got {t.dtype} "
      f"of shape {t.shape}",
      code="invalid_argument",
      received=str(t.shape),
      fix="jnp.asarray(token_ids, jnp.int32)",
    )
  if t.size == 0:
    raise CircuitError(
      "the prompt is empty: a graph needs at least one token",
      code="invalid_argument",
      received=0,
      fix="a prompt of one or more tokens",
    )
  vocab = model.config.vocab_size
  bad = (t < 0) | (t >= vocab)
  if bad.any():
    raise CircuitError(
      f"token id {int(t[bad][0])} is outside the vocabulary [0, {vocab})",
      code="index_out_of_range",
      expected=f"[0, {vocab})",
      received=int(t[bad][0]),
      fix="token ids of the model's tokenizer",
    )
  return jnp.asarray(t, jnp.int32)


def _positive_int(value, name, allow_none=False):
  if value is None and allow_none:
    return
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value <= 0:
    raise CircuitError(
      f"{name} must be a positive int, got {value!r}",
      code="invalid_argument",
      received=repr(value),
      fix=f"{name}=64" if name == "batch_size" else f"{name}=10",
    )


def _unembedding(model, variables):
  """``index -> rows`` of the unembedding (``None``: the mean row), in the model's dtype."""
  ro = readout(model, variables)

  def rows(index):
    if index is None:
      return jnp.mean(ro.chunk_rows(0, ro.vocab).astype(ro.dtype), axis=0)
    return ro.rows(index).astype(ro.dtype)

  return rows, ro.vocab


@dataclasses.dataclass(frozen=True)
class LocalReplacement:
  """The local replacement model of one prompt.

  ``run(tok, writes) -> (mlp_in, final)`` is affine (a jitted
  :func:`~jaxlens.circuits.frozen_forward`); at ``(tok, node_writes + errors)`` it gives the
  model's own values on the prompt.

  Attributes:
    recording: the model's run (:class:`~jaxlens.circuits.Recording`).
    acts: ``(L, seq, d_sae)`` feature activations (zero at position 0 with ``zero_bos``).
    node_writes: ``(L, seq, d)``: what the features write to each MLP output.
    errors: ``(L, seq, d)``: the error nodes (MLP output minus the transcoder's).
    const: ``(L, seq, d)``: the rest of each MLP output (``b_dec``; the first position's
      error with ``zero_bos``).
    tok: ``(seq, d)``: the token embeddings (the residual stream entering block 0, less
      learned position embeddings).
    run: the replacement model.
  """

  recording: Any
  acts: Any
  node_writes: Any
  errors: Any
  const: Any
  tok: Any
  run: Any


# Traces of the cached programs, by name (tests count recompilations with it).
TRACES: collections.Counter = collections.Counter()


def _call(program, model, *args, **static):
  """``program(model, *args, **static)`` (a jitted function whose model and keywords are
  static), or, for a model that is not hashable, a program of this call only."""
  if _hashable(model):
    return program(model, *args, **static)
  return jax.jit(functools.partial(program.__wrapped__, model, **static))(*args)


def _hashable(model) -> bool:
  """Whether ``model`` can key the cached programs (a zoo model is; one whose config holds a
  list or dict is not, and gets programs of its own call)."""
  try:
    hash(model)
  except TypeError:
    return False
  return True


def _prepare(model, variables, toks, rep, zero_bos):
  """The model's run and the graph's nodes: ``(recording, acts, node_writes, errors, const,
  tok)``."""
  n_layers, seq = rep.n_layers, toks.shape[0]
  rec = record(model, variables, toks[None])
  dtype = rec.resid0.dtype
  acts = [rep.encoders[i](rec.mlp_in[i][0]).astype(dtype) for i in range(n_layers)]
  if zero_bos:
    acts = [a.at[0].set(0) for a in acts]
  skips = jnp.stack([rep.skip(i, rec.mlp_in[i][0]) for i in range(n_layers)]).astype(dtype)
  node_writes = rep.decode_writes(acts).astype(dtype)
  mlp_out = jnp.stack([rec.mlp_out[i][0] for i in range(n_layers)])
  bdec = jnp.stack([jnp.broadcast_to(b, (seq, b.shape[-1])) for b in rep.b_dec]).astype(dtype)
  errors = mlp_out - node_writes - bdec - skips
  if zero_bos:
    errors = errors.at[:, 0].set(0)
  const = mlp_out - node_writes - errors - skips
  tok = rec.resid0[0] - (0 if rec.pos is None else rec.pos[0])
  return rec, jnp.stack(acts), node_writes, errors, const, tok


@functools.partial(jax.jit, static_argnames=("model", "zero_bos"))
def _prepare_cached(model, variables, toks, transcoders, zero_bos):
  # One program per model, shapes and transcoder layout: the weights, prompt and
  # transcoders are arguments, so another prompt of the same length reuses it.
  TRACES["prepare"] += 1
  return _prepare(model, variables, toks, replacement(model, transcoders), zero_bos)


def local_replacement(model, variables, tokens, transcoders, *, zero_bos: bool = False):
  """The :class:`LocalReplacement` of ``model`` on ``tokens`` (``(seq,)`` or ``(1, seq)``)
  with ``transcoders`` (a :class:`Replacement`, a list of per-layer transcoders or a
  cross-layer transcoder).

  Raises:
    CircuitError: as :func:`attribute`.
  """
  toks = _check_tokens(model, tokens)
  rep = transcoders if isinstance(transcoders, Replacement) else replacement(model, transcoders)
  if rep.source is not None and _hashable(model):
    out = _prepare_cached(model, variables, toks, rep.source, bool(zero_bos))
  else:  # a Replacement built by hand: its functions are constants of the program
    out = jax.jit(lambda v, t: _prepare(model, v, t, rep, bool(zero_bos)))(variables, toks)
  rec, acts, node_writes, errors, const, tok = out
  run = jax.jit(frozen_forward(model, variables, toks[None], rec, rep.skip, const))
  return LocalReplacement(rec, acts, node_writes, errors, const, tok, run)


def _prefix(rec: Recording, length: int) -> Recording:
  """The recording of the prompt's first ``length`` positions (a causal model's run on them)."""

  def cut(a):
    return None if a is None else a[:, :length]

  return Recording(
    scales={k: cut(v) for k, v in rec.scales.items()},
    patterns={k: v[:, :, :length, :length] for k, v in rec.patterns.items()},
    mlp_in={k: cut(v) for k, v in rec.mlp_in.items()},
    mlp_out={k: cut(v) for k, v in rec.mlp_out.items()},
    resid0=cut(rec.resid0),
    pos=cut(rec.pos),
    final=cut(rec.final),
    logits=cut(rec.logits),
  )


def _rows(
  model, rep, part, variables, toks, rec, const, tok, node_writes, errors, padded, slots, cot
):
  """Rows of the graph, one per cotangent: ``cot = (layer, position, v_in, v_final)``, each
  batched; a row is ``[features (padded), errors, tokens]``. The frozen forward is linearised
  once and its VJP vmapped over the batch.

  ``part = (upto, length)``. ``upto < n_layers``: every row's target is a feature of layer
  ``upto`` at a position before ``length``, so the forward runs on the prompt's first
  ``length`` tokens (the model is causal; its frozen values are cut to them) and stops at that
  layer's MLP input, and only the sources of earlier layers and positions are contracted (the
  others are zero: nothing they write reaches the targets). ``upto == n_layers``: any row, on
  the whole prompt.
  """
  upto, length = part
  li, pi, v_in, v_final = cot
  n_layers, (seq, d), d_in, dtype = rep.n_layers, tok.shape, v_in.shape[-1], tok.dtype
  writes = node_writes + errors
  if length < seq:
    toks, rec, const, tok = toks[:length], _prefix(rec, length), const[:, :length], tok[:length]
    writes, errors = writes[:, :length], errors[:, :length]
  run = frozen_forward(model, variables, toks[None], rec, rep.skip, const)
  # The writes as one input per layer that reaches the targets: each layer's cotangent is then
  # its own array (a stacked input's VJP pads every layer's into the full stack and adds them).
  writes = tuple(writes[i] for i in range(min(upto, n_layers)))
  if upto < n_layers:  # the forward's output stops at layer upto's MLP input
    _, vjp = jax.vjp(lambda t, w: run(t, w, upto=upto), tok, writes)

    def one(li, pi, vi, vf):
      return vjp(jnp.zeros((upto + 1, length, d_in), dtype).at[li, pi].set(vi))

  else:
    _, vjp = jax.vjp(run, tok, writes)

    def one(li, pi, vi, vf):
      ci = jnp.zeros((n_layers, seq, d_in), dtype).at[li, pi].set(vi)
      cf = jnp.zeros((seq, d), dtype).at[seq - 1].set(vf)
      return vjp((ci, cf))

  g_tok, g_w = jax.vmap(one)(li, pi, v_in, v_final)
  batch, width = li.shape[0], padded.shape[1]
  # (batch, upto, length, d): the sources that reach the targets
  g_w = jnp.stack(g_w, axis=1) if g_w else jnp.zeros((li.shape[0], 0, length, d), dtype)

  def place(x, trailing=()):
    # (batch, upto, length, *trailing) into (batch, n_layers, seq, *trailing), zeros around
    pad = [(0, 0), (0, n_layers - upto), (0, seq - length)] + [(0, 0)] * len(trailing)
    return jnp.pad(x, pad).reshape(batch, -1)

  # The decoders as one batched matmul: each (target layer, position) holds the decoder
  # vectors written there, padded to the fullest one; a feature's edge is the sum of its
  # slots (one per layer it writes to; the last entry is a zero).
  dec = padded.reshape(n_layers, seq, width, d)[:upto, :length].reshape(-1, width, d)
  per_slot = jnp.einsum("bkd,kgd->bkg", g_w.reshape(batch, -1, d), dec)
  per_slot = place(per_slot.reshape(batch, upto, length, width), (width,))
  feat = jnp.concatenate([per_slot, jnp.zeros((batch, 1), dtype)], axis=1)[:, slots].sum(-1)
  err = place(jnp.einsum("blsd,lsd->bls", g_w, errors[:upto]))
  tk = jnp.pad(jnp.einsum("bsd,sd->bs", g_tok, tok), [(0, 0), (0, seq - length)])
  return jnp.concatenate([feat, err, tk], axis=1)


@functools.partial(jax.jit, static_argnames=("model", "part"))
def _rows_cached(model, part, transcoders, *args):
  TRACES["rows"] += 1
  return _rows(model, replacement(model, transcoders), part, *args)


try:  # what jax.jit keys its traces on: the configuration, thread-local parts included
  from jax._src.config import trace_context as _trace_context
except ImportError:  # pragma: no cover - a jax without it: the options that matter here

  def _trace_context():
    return (
      jax.config.jax_enable_x64,
      jax.config.jax_numpy_dtype_promotion,
      jax.config.jax_default_matmul_precision,
    )


_CPU_ROWS = 16  # rows per call and device on CPU
_FLUSH_BYTES = 256 * 2**20  # a graph on disk: rows written between flushes
_CPU_WORKERS = 2  # threads running batches on CPU, at most (and at most the cores)
_POSITION_GROUPS = 4  # at most, for split_rows
_GROUP_POSITIONS = 16  # at least, per group


def _bucket(n: int, floor: int = 64) -> int:
  """``n`` rounded up to one of a few sizes per octave (the padded active-feature count, so
  that prompts whose counts differ a little share a compiled program)."""
  if n <= floor:
    return floor
  step = max(floor, 1 << max(int(n - 1).bit_length() - 4, 0))
  return -(-n // step) * step


def memory_estimate(
  *,
  n_layers: int,
  seq: int,
  d_model: int,
  d_in: int,
  n_heads: int,
  n_active: int,
  n_features: int,
  n_logits: int,
  batch_size: int,
  itemsize: int,
  decoder_width: int = 1,
  n_dec: int = 1,
  row_top_k: int | None = None,
  on_disk: bool = False,
) -> int:
  """Bytes :func:`attribute` adds at its peak, estimated from the graph's sizes: the square
  adjacency (written in place; with a node budget also the budget's dense rows, with
  ``row_top_k`` the kept entries instead), the decoder table and each feature's decoder and
  encoder vectors, one batch of cotangents and gradients with their host copies, the frozen
  forward's values and residuals (the attention patterns dominate: ``n_layers * n_heads *
  seq**2``), and XLA's compiled programs (a constant and a term per token, fitted to measured
  peaks: within 4% of the measured increase from 16 to 256 tokens on
  ``benchmarks/bench_circuits_vs_ct.py``'s model). ``on_disk``: the adjacency is written to a
  file (``attribute(graph_path=...)``), so it is not counted (its pages are the page cache's,
  which the system reclaims)."""
  n = n_active + (n_layers + 1) * seq + n_logits
  n_rows = n_features + n_logits
  if row_top_k is not None:  # the kept entries, listed then assembled (int64 coordinates)
    graph = n_rows * min(row_top_k, n) * (2 * itemsize + 28) // itemsize
  elif on_disk:  # written to its file as the rows come
    graph = 0
  elif n_features == n_active:  # the adjacency, written in place
    graph = (n_features + (n_layers + 1) * seq + n_logits) ** 2
  else:  # the budget's dense rows, their kept columns, and the adjacency
    graph = 2 * n_rows * n + n * n
  decoders = n_layers * seq * decoder_width * d_model + n_active * (2 * n_dec * d_model + d_in)
  batch = batch_size * (2 * n_layers * seq * (d_in + d_model) + 3 * n)
  forward = 6 * n_layers * (n_heads * seq * seq + 8 * seq * max(d_model, d_in))
  # XLA's compiled programs and runtime buffers: fitted to the peaks measured by
  # benchmarks/bench_circuits_vs_ct.py (16 to 256 tokens: 73 to 149 MiB above the rest).
  compiled = (68 + 0.45 * seq) * 2**20
  return int(itemsize * (graph + decoders + batch + forward) + compiled)


def attribute(
  model,
  variables,
  tokens,
  transcoders,
  *,
  max_n_logits: int = 10,
  desired_logit_prob: float = 0.95,
  directions=None,
  target_tokens=None,
  max_feature_nodes: int | None = None,
  batch_size: int = 64,
  zero_bos: bool = False,
  update_interval: int = 4,
  local: LocalReplacement | None = None,
  memory_budget: int | None = None,
  row_top_k: int | None = None,
  row_threshold: float | None = None,
  mesh=None,
  split_rows: bool | None = None,
  graph_path=None,
) -> Graph:
  """The attribution graph of ``tokens`` through ``transcoders`` (circuit-tracer's
  ``attribute``).

  The model is replaced by its local replacement model on the prompt (norm scales, attention
  patterns and MLP outputs frozen; a skip transcoder's skip term live), one VJP of which gives
  every row: a feature target's cotangent is its encoder vector at its layer's MLP input and
  position, a logit target's the demeaned unembedding row at the final norm's output (last
  position); the rows are contracted with each source's write (a feature's decoder vectors
  times its activation, an error vector, a token embedding).

  Args:
    model: a decoder of :mod:`jaxlens.models` (not scanned).
    variables: its variables.
    tokens: int ``(seq,)`` or ``(1, seq)``.
    transcoders: one :class:`jaxlens.sae.Transcoder` per layer, or a
      :class:`jaxlens.sae.CrossLayerTranscoder`.
    max_n_logits, desired_logit_prob: the logit targets: the most likely next tokens until
      their probability reaches ``desired_logit_prob``, at most ``max_n_logits``.
    directions: instead, ``(k, d_model)`` directions read at the final norm's output (last
      position), each weighted ``1 / k``.
    target_tokens: instead, these token ids (circuit-tracer's tensor of indices): their
      demeaned unembedding rows, weighted by their probabilities.
    max_feature_nodes: a budget of feature nodes, chosen greedily by partial influence on the
      logits as circuit-tracer does (``None``: every active feature, exact).
    batch_size: rows per batch (the cadence of a node budget's re-ranking, as
      circuit-tracer's); on CPU each batch runs 16 rows a device at a time, and without a
      ``mesh`` the batches run on two threads (both cores of a two-core machine) while the
      finished ones are written into the graph.
    zero_bos: zero the first position's activations and error (circuit-tracer does when the
      first token is a special token).
    update_interval: batches between re-rankings under a budget.
    local: the :class:`LocalReplacement` of this prompt and transcoders, when it is built
      already (:func:`local_replacement`; ``zero_bos`` is then its own).
    memory_budget: bytes the graph may take (:func:`memory_estimate`: the adjacency, or the
      entries ``row_top_k`` keeps; with ``row_threshold`` alone the dense adjacency, an upper
      bound; the decoder table, one batch of cotangents and gradients, the forward's
      residuals, the compiled programs); checked once the active features are known, before
      the rows are computed.
    row_top_k: keep only each row's ``row_top_k`` entries of largest magnitude (the
      adjacency is then a ``scipy.sparse.csr_array`` of the kept entries).
    row_threshold: keep only the entries of each row at least ``row_threshold`` times the
      row's largest magnitude (a fraction in ``[0, 1]``; ``0`` keeps every nonzero entry),
      sparse as with ``row_top_k``; both may be given. The kept entries equal the dense
      graph's; the dropped ones are zero in it (see docs/circuits.md for what this changes in
      pruning and the scores).
    mesh: a ``jax.sharding.Mesh``: each batch of rows is spread over its devices (the batch
      rounded up to a multiple of their number), the model and the frozen values replicated;
      the graph equals the one-device graph. The mesh may span processes
      (``jax.distributed``): every process then calls ``attribute`` alike, each batch's rows
      are gathered to every process, and each returns the whole graph.
    split_rows: run the feature rows by layer and by prefix of the prompt (up to 4 groups of
      positions, one per 16 tokens), each group through a program that runs the model on
      the prefix that holds its targets, stops at their layer's MLP input and contracts only
      the sources of earlier layers and positions (less than half the work at 4 layers, for
      up to ``4 * n_layers`` more compiled programs); ``None``: from 1,024 active features and 128
      a layer. The graph is the same.
    graph_path: a new directory to write the graph to as its rows are computed (the format
      :func:`save_graph` writes, built under a temporary name beside it and renamed into place
      when whole; nothing is left on an error): the adjacency is then a read-only
      ``numpy.memmap`` of that file, so a graph larger than memory is built, pruned and scored
      (:func:`prune` and :func:`graph_scores` work on it in blocks of rows). Every active
      feature (no ``max_feature_nodes``), dense rows (no ``row_top_k`` or ``row_threshold``).

  Returns:
    A :class:`Graph` (its adjacency dense, a memmap with ``graph_path``, or sparse with
    ``row_top_k`` or ``row_threshold``).

  Raises:
    CircuitError: ``invalid_argument`` (an empty prompt, a budget, batch size or
      ``row_top_k`` that is not a positive int, a ``row_threshold`` outside ``[0, 1]``, a
      ``mesh`` that is not a ``jax.sharding.Mesh``), ``index_out_of_range`` (a token outside the vocabulary),
      ``circuit_transcoder_mismatch``, ``circuit_unsupported_model``,
      ``circuit_memory_budget`` (the estimate exceeds ``memory_budget``);
      with ``graph_path``: ``circuit_file_exists`` (the path exists), ``circuit_graph_path``
      (its directory is missing, or its file system has not room for the adjacency: checked
      before the rows), ``circuit_save_failed`` (the file system refused), ``invalid_argument``
      (with ``max_feature_nodes``, ``row_top_k`` or ``row_threshold``).
  """
  toks = _check_tokens(model, tokens)
  if graph_path is not None:
    graph_path = check_graph_path(graph_path)
    given = [
      name
      for name, value in (
        ("max_feature_nodes", max_feature_nodes),
        ("row_top_k", row_top_k),
        ("row_threshold", row_threshold),
      )
      if value is not None
    ]
    if given:
      raise CircuitError(
        f"graph_path writes the dense graph of every active feature; {given[0]} was given",
        code="invalid_argument",
        received=given[0],
        fix="graph_path=... alone (the graph on disk holds every row), or no graph_path",
      )
  _positive_int(batch_size, "batch_size")
  _positive_int(memory_budget, "memory_budget", allow_none=True)
  _positive_int(max_n_logits, "max_n_logits")
  _positive_int(max_feature_nodes, "max_feature_nodes", allow_none=True)
  _positive_int(update_interval, "update_interval")
  _positive_int(row_top_k, "row_top_k", allow_none=True)
  if row_threshold is not None and (
    isinstance(row_threshold, bool)
    or not isinstance(row_threshold, (int, float, np.floating))
    or not 0.0 <= float(row_threshold) <= 1.0
  ):
    raise CircuitError(
      f"row_threshold must be a fraction in [0, 1], got {row_threshold!r}",
      code="invalid_argument",
      received=repr(row_threshold),
      fix="row_threshold=1e-3 (entries under 1e-3 of the row's largest are dropped)",
    )
  if mesh is not None and not isinstance(mesh, jax.sharding.Mesh):
    raise CircuitError(
      f"mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}",
      code="invalid_argument",
      received=type(mesh).__name__,
      fix="mesh=jax.make_mesh((len(jax.devices()),), ('rows',))",
    )
  rep = replacement(model, transcoders)
  n_layers, seq = rep.n_layers, int(toks.shape[0])
  if directions is not None and (
    np.ndim(directions) != 2 or np.shape(directions)[-1] != model.config.d_model
  ):
    raise CircuitError(
      f"directions must be (k, {model.config.d_model}), got shape {np.shape(directions)}",
      code="invalid_argument",
      received=str(np.shape(directions)),
      fix="directions=jnp.stack([direction_1, direction_2])",
    )
  if target_tokens is not None:
    ids = np.asarray(target_tokens)
    vocab = model.config.vocab_size
    if ids.ndim != 1 or ids.size == 0 or not np.issubdtype(ids.dtype, np.integer):
      raise CircuitError(
        f"target_tokens must be a non-empty 1-D array of int token ids, got {ids.dtype} "
        f"of shape {ids.shape}",
        code="invalid_argument",
        received=str(ids.shape),
        fix="target_tokens=[id_1, id_2]",
      )
    if ((ids < 0) | (ids >= vocab)).any():
      bad = int(ids[(ids < 0) | (ids >= vocab)][0])
      raise CircuitError(
        f"target token {bad} is outside the vocabulary [0, {vocab})",
        code="index_out_of_range",
        expected=f"[0, {vocab})",
        received=bad,
        fix="token ids of the model's tokenizer",
      )
    if directions is not None:
      raise CircuitError(
        "give directions or target_tokens, not both",
        code="invalid_argument",
        fix="one kind of target per graph",
      )
  if local is None:
    local = local_replacement(model, variables, toks, rep, zero_bos=zero_bos)
  lr = local
  rec, acts, node_writes, errors, tok = lr.recording, lr.acts, lr.node_writes, lr.errors, lr.tok
  dtype = tok.dtype
  acts_np = np.asarray(acts)  # (L, seq, d_sae)
  active = np.argwhere(acts_np != 0)  # (n_active, 3), ordered (layer, pos, feature)
  values = acts_np[tuple(active.T)] if len(active) else np.zeros(0, acts_np.dtype)
  n_active = len(active)

  # Targets: logits.
  if target_tokens is not None:
    logit_idx, logit_p, logit_vecs = _token_targets(
      model, variables, rec.logits[0, -1], target_tokens
    )
  elif directions is None:
    logit_idx, logit_p, logit_vecs = _salient_logits(
      model, variables, rec.logits[0, -1], max_n_logits, desired_logit_prob
    )
  else:
    logit_vecs = jnp.asarray(directions)
    logit_idx = np.full(logit_vecs.shape[0], -1)
    logit_p = np.full(logit_vecs.shape[0], 1.0 / logit_vecs.shape[0])
  logit_vecs = jnp.asarray(logit_vecs, dtype)
  n_logits = len(logit_idx)

  # The sources' writes: features (decoder vectors times activation), errors, tokens.
  n_dec = max(w.shape[0] for w in rep.W_dec)
  d = tok.shape[-1]
  d_in = rec.mlp_in[0].shape[-1]
  np_dtype = np.dtype(dtype)
  dec = np.zeros((n_active, n_dec, d), np_dtype)
  enc = np.zeros((n_active, d_in), np_dtype)
  for i in range(n_layers):
    sel = np.flatnonzero(active[:, 0] == i) if n_active else np.zeros(0, int)
    if sel.size:
      w = np.asarray(rep.W_dec[i])[:, active[sel, 2]]  # (J_i, n_sel, d)
      dec[sel, : w.shape[0]] = np.moveaxis(w, 0, 1)
      enc[sel] = np.asarray(rep.W_enc[i])[:, active[sel, 2]].T
  dec *= values.astype(np_dtype)[:, None, None]
  later = (active[:, :1] if n_active else np.zeros((0, 1), int)) + np.arange(n_dec)[None]
  # Each (target layer, position) holds the decoder vectors written there, padded to the
  # fullest one; sizes rounded up (_bucket) so another prompt of the same length reuses the
  # compiled row program.
  valid = later < n_layers
  feature, j = np.nonzero(valid)
  key = later[feature, j] * seq + active[feature, 1]
  counts = np.bincount(key, minlength=n_layers * seq)
  width = _bucket(max(int(counts.max()) if len(key) else 0, 1), 8)
  order = np.argsort(key, kind="stable")
  first = np.concatenate([[0], np.cumsum(counts)[:-1]])
  slot = np.empty(len(key), int)
  slot[order] = np.arange(len(key)) - first[key[order]]
  padded = np.zeros((n_layers * seq, width, d), np_dtype)
  padded[key, slot] = dec[feature, j]
  n_pad = _bucket(n_active)
  slots = np.full((n_pad, n_dec), n_layers * seq * width, np.int32)  # the last entry: a zero
  slots[feature, j] = key * width + slot
  del dec

  sparse = row_top_k is not None or row_threshold is not None
  devices = 1 if mesh is None else int(mesh.size)
  # Rows per call: the batch, at most _CPU_ROWS a device on CPU (where smaller batches keep
  # the backward's values in cache), a multiple of the devices.
  on_cpu = (jax.default_backend() if mesh is None else mesh.devices.flat[0].platform) == "cpu"
  # Threads running the batches (without a mesh): on CPU as many as the cores, at most two.
  workers = min(_CPU_WORKERS, os.cpu_count() or 1) if on_cpu and mesh is None else 1
  per_device = -(-batch_size // devices)
  rows_per_call = devices * (min(per_device, _CPU_ROWS) if on_cpu else per_device)
  consts = (variables, toks, rec, lr.const, tok, node_writes, errors, padded, slots)
  if split_rows is None:  # worth its more programs from about a thousand feature rows, and
    # a hundred a layer (each layer's program compiles once)
    split_rows = n_active >= max(1024, 128 * n_layers)
  # Feature rows split by layer and by prefix of the prompt: (layer, group) -> a program.
  n_groups = max(1, min(_POSITION_GROUPS, seq // _GROUP_POSITIONS)) if split_rows else 1
  lengths = np.asarray([-(-seq * (k + 1) // n_groups) for k in range(n_groups)])
  group_of = np.searchsorted(lengths, active[:, 1] + 1) if n_active else np.zeros(0, int)
  if rep.source is not None and _hashable(model):
    program, source = functools.partial(_rows_cached, model), rep.source
  else:  # a Replacement built by hand: its functions are constants of the program
    hand = {}

    def program(part, _, *a):
      if part not in hand:
        hand[part] = jax.jit(functools.partial(_rows, model, rep, part))
      return hand[part](*a)

    source = None
  if mesh is None:
    consts = jax.tree.map(jnp.asarray, consts)
    spread = None
  else:
    from jax.sharding import NamedSharding, PartitionSpec

    # Sharding propagation decides the layout (an Explicit mesh would type every scatter).
    mesh = auto_axes(mesh)
    consts, source = jax.device_put((consts, source), NamedSharding(mesh, PartitionSpec()))
    spread = NamedSharding(mesh, PartitionSpec(tuple(mesh.axis_names)))

  def batch(li, pi, v_in, v_final, part=(n_layers, seq)):
    # Padded to rows_per_call rows: one compiled program for every batch (of a layer).
    k = len(li)
    pad = rows_per_call - k

    def grow(a, dt):
      a = np.asarray(a, dt)
      return np.concatenate([a, np.zeros((pad,) + a.shape[1:], a.dtype)])

    cot = (grow(li, np.int32), grow(pi, np.int32), grow(v_in, np_dtype), grow(v_final, np_dtype))
    if spread is not None:
      cot = jax.device_put(cot, spread)
    out = program(part, source, *consts, cot)
    if not out.is_fully_addressable:  # a mesh over processes: every process gets every row
      out = distributed.host_values(out)
    out = np.asarray(out)[:k]
    # [features (padded to n_pad), errors, tokens] -> [features, errors, tokens]
    return np.concatenate([out[:, :n_active], out[:, n_pad:]], axis=1)

  def logit_rows(vecs):
    k = len(vecs)
    return batch(np.zeros(k), np.zeros(k), np.zeros((k, d_in)), vecs)

  def feature_rows(idx):
    # idx: features of one layer and position group when split_rows
    if split_rows:
      part = (int(active[idx[0], 0]), int(lengths[group_of[idx[0]]]))
    else:
      part = (n_layers, seq)
    return batch(active[idx, 0], active[idx, 1], enc[idx], np.zeros((len(idx), d)), part)

  logit_offset = n_active + (n_layers + 1) * seq
  total_nodes = logit_offset + n_logits
  budget = n_active if max_feature_nodes is None else min(max_feature_nodes, n_active)
  if memory_budget is not None:
    need = memory_estimate(
      n_layers=n_layers,
      seq=seq,
      d_model=d,
      d_in=d_in,
      n_heads=int(rec.patterns[next(iter(rec.patterns))].shape[1]) if rec.patterns else 1,
      n_active=n_active,
      n_features=budget,
      n_logits=n_logits,
      batch_size=rows_per_call * workers,  # the batches that run at once
      itemsize=np_dtype.itemsize,
      decoder_width=width,
      n_dec=n_dec,
      row_top_k=row_top_k,
      on_disk=graph_path is not None,
    )
    if need > memory_budget:
      raise CircuitError(
        f"the graph of this prompt needs about {need / 2**20:.0f} MiB ({n_active} active "
        f"features, {total_nodes} nodes), over the memory_budget of "
        f"{memory_budget / 2**20:.0f} MiB",
        code="circuit_memory_budget",
        expected=f"<= {memory_budget} bytes",
        received=int(need),
        fix="a shorter prompt, max_feature_nodes=..., row_top_k=..., or a larger memory_budget",
      )
  n = budget + (n_layers + 1) * seq + n_logits
  exact = budget == n_active
  # Where the rows go: a dense (n, n) adjacency written in place (every feature kept), the
  # dense rows of a budget (columns chosen at the end), or the kept entries of each row.
  writer = None
  if sparse:
    kept: list = []
  elif exact and graph_path is not None:
    writer = GraphWriter(
      graph_path,
      n,
      np_dtype,
      {
        "input_tokens": np.asarray(toks),
        "active_features": active,
        "activation_values": values,
        "selected_features": np.arange(n_active),
        "logit_tokens": np.asarray(logit_idx),
        "logit_probabilities": np.asarray(logit_p, np_dtype),
      },
      n_layers,
    )
    full = writer.adjacency
  elif exact:
    full = np.zeros((n, n), np_dtype)
  else:
    edge = np.zeros((budget + n_logits, total_nodes), np_dtype)
  row_to_node = np.zeros(budget + n_logits, np.int64)
  written = [0]  # bytes written to a graph on disk since its last flush

  def store(st, rows, nodes):
    row_to_node[st : st + len(rows)] = nodes
    if writer is not None:  # bound the dirty pages: flushed every _FLUSH_BYTES
      written[0] += rows.nbytes
      if written[0] >= _FLUSH_BYTES:
        full.flush()
        written[0] = 0
    if sparse:
      kept.extend(_kept_entries(rows, row_top_k, row_threshold))
    elif exact:  # a feature's row is its node; a logit's is among the last
      at = np.where(nodes >= logit_offset, nodes - logit_offset + n - n_logits, nodes)
      full[at, :logit_offset] = rows
    else:
      edge[st : st + len(rows), :logit_offset] = rows

  try:  # a graph on disk is removed on any error
    # Threads for the feature rows' batches: a mesh's batches stay in one thread (a mesh over
    # processes runs them as collectives, in the same order on every process).
    pool = concurrent.futures.ThreadPoolExecutor(workers) if mesh is None else None
    if pool is not None and pool.submit(_trace_context).result() != _trace_context():
      # Under a thread-local configuration (``with jax.enable_x64():``, a dtype promotion
      # context...) that a new thread does not inherit: the batches run in this thread.
      pool.shutdown()
      pool = None

    def run_batch(fn, idx):
      if pool is not None:
        return pool.submit(fn, idx)
      done: concurrent.futures.Future = concurrent.futures.Future()
      done.set_result(fn(idx))
      return done

    for s in range(0, n_logits, rows_per_call):
      vecs = np.asarray(logit_vecs[s : s + rows_per_call])
      store(s, logit_rows(vecs), np.arange(s, s + len(vecs)) + logit_offset)
    st = n_logits
    visited = np.zeros(n_active, bool)
    n_visited = 0
    try:
      while n_visited < budget:
        if exact:
          pending = np.arange(n_active)
        else:
          so_far = _csr(kept, total_nodes, np_dtype) if sparse else edge[:st]
          influence = partial_influences(so_far, logit_p, row_to_node[:st])
          rank = np.argsort(-influence[:n_active], kind="stable")
          size = min(update_interval * batch_size, budget - n_visited)
          pending = rank[~visited[rank]][:size]
        if split_rows:  # the batches of each layer and position group, in that order
          key = active[pending, 0] * n_groups + group_of[pending]
          pending = pending[np.argsort(key, kind="stable")]
          groups = np.split(pending, np.flatnonzero(np.diff(np.sort(key, kind="stable"))) + 1)
        else:
          groups = [pending]
        # Batches run on `workers` threads (XLA releases the GIL while a program runs), at most
        # `2 * workers` in flight; the main thread stores each finished batch in order, meanwhile.
        # A group's first batch is waited for before the next is queued, so each program is
        # traced and compiled once.
        in_flight: collections.deque = collections.deque()
        for group in groups:
          for s in range(0, len(group), rows_per_call):
            idx = group[s : s + rows_per_call]
            n_visited += len(idx)
            done = run_batch(feature_rows, idx)
            if s == 0 and pool is not None:
              done.result()
            in_flight.append((st, idx, done))
            st += len(idx)
            while len(in_flight) > (0 if pool is None else 2 * workers):
              at, rows_idx, got = in_flight.popleft()
              store(at, got.result(), rows_idx)
              visited[rows_idx] = True
        while in_flight:
          at, rows_idx, got = in_flight.popleft()
          store(at, got.result(), rows_idx)
          visited[rows_idx] = True
    finally:
      if pool is not None:
        pool.shutdown(cancel_futures=True)
  except BaseException:
    if writer is not None:
      writer.abort()
    raise
  selected = np.flatnonzero(visited)
  if sparse:
    # Rows in node order, columns renumbered to the kept features.
    columns = np.full(total_nodes, -1, np.int64)
    columns[selected] = np.arange(budget)
    columns[n_active:] = np.arange(budget, n)
    is_logit = row_to_node >= logit_offset
    target = np.where(
      is_logit, row_to_node - logit_offset + n - n_logits, np.searchsorted(selected, row_to_node)
    )
    adjacency = _csr(kept, n, np_dtype, rows=target, columns=columns)
  elif exact:
    adjacency = full if writer is None else writer.finish()
  else:
    edge = edge[:, np.concatenate([selected, np.arange(n_active, total_nodes)])]
    edge = edge[np.argsort(row_to_node, kind="stable")]
    adjacency = np.zeros((n, n), edge.dtype)
    adjacency[:budget] = edge[:budget]
    adjacency[n - n_logits :] = edge[budget:]
  return Graph(
    adjacency=adjacency,
    input_tokens=np.asarray(toks),
    active_features=active,
    activation_values=values,
    selected_features=selected,
    logit_tokens=np.asarray(logit_idx),
    logit_probabilities=np.asarray(logit_p, np.dtype(dtype)),
    n_layers=n_layers,
  )


def _kept_entries(rows, top_k, threshold):
  """Per row, ``(columns, values)`` of the entries kept: nonzero, at least ``threshold`` times
  the row's largest magnitude, and among its ``top_k`` largest magnitudes."""
  out = []
  mag = np.abs(rows)
  for row, m in zip(rows, mag):
    floor = 0.0 if threshold is None else threshold * m.max(initial=0.0)
    cols = np.flatnonzero((m > 0) & (m >= floor))
    if top_k is not None and len(cols) > top_k:
      cols = cols[np.argpartition(-m[cols], top_k - 1)[:top_k]]
      cols.sort()
    out.append((cols.astype(np.int32), row[cols]))
  return out


def _csr(kept, n_cols, dtype, *, rows=None, columns=None):
  """The kept entries as a ``scipy.sparse.csr_array``: ``kept[i]`` is the entries of row
  ``rows[i]`` (default ``i``) with columns renumbered by ``columns`` (``-1``: dropped)."""
  from scipy import sparse

  n_rows = len(kept) if rows is None else n_cols
  rows = np.arange(len(kept)) if rows is None else rows
  r = np.repeat(rows, [len(c) for c, _ in kept]).astype(np.int64)
  c = np.concatenate([c for c, _ in kept]).astype(np.int64) if kept else np.zeros(0, np.int64)
  v = np.concatenate([v for _, v in kept]).astype(dtype) if kept else np.zeros(0, dtype)
  if columns is not None:
    c = columns[c]
    r, c, v = r[c >= 0], c[c >= 0], v[c >= 0]
  return sparse.csr_array((v, (r, c)), shape=(n_rows, n_cols))
