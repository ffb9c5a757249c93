"""The Jacobian lens (Gurnee et al., 2026; TransformerLens 4.3's ``JacobianLens``, after
Anthropic's reference implementation): per source layer, the average Jacobian of the last
block's output with respect to that layer's block output, read through the model's own final
norm and unembedding.

For a prompt with valid positions ``V`` (the first ``skip_first_positions`` and the last
position left out), layer ``l``'s matrix is

  ``J_l = mean over prompts of (1/|V|) sum_{t in V} sum_{t' in V} d h_final[t'] / d h_l[t]``

(causal attention makes the terms with ``t' < t`` zero). Row ``i`` of ``J_l`` for every layer
at once is one vector-Jacobian product with the cotangent ``e_i`` at every valid position; the
fit runs the prompt forward once and ``jax.vmap``s that one VJP over the ``d_model`` directions
(TransformerLens replicates the prompt ``dim_batch`` times and runs ``d_model / dim_batch``
backward passes).
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import functools
import os
import warnings
from pathlib import Path
from typing import Any, Mapping, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jaxlens import core as jl
from jaxlens import intervention as ji
from jaxlens.core import JaxlensWarning
from jaxlens.lens._logit import TopTokens, layer_count, topk_chunked
from jaxlens.lens._readout import LensError, readout
from jaxlens.lens._torchfile import read_object, write_object
from jaxlens.internal import path_argument

__all__ = [
  "JacobianLens",
  "fit_jacobian_lens",
  "jacobian_ablation",
  "jacobian_lens",
  "jacobian_lens_topk",
  "jacobian_lens_vectors",
  "jacobian_steering",
  "jacobian_swap",
  "load_jacobian_lens",
  "save_jacobian_lens",
]

ESTIMATOR = "jacobian_lens"
DEFAULT_SKIP_FIRST_POSITIONS = 16
# Metadata a fit records that a merge must find equal in every shard (all but the count).
_COUNT = "n_prompts"
_WHAT = "a Jacobian lens artifact (.pt, written by JacobianLens.save or save_jacobian_lens)"


def _wide(dtype):
  """``dtype`` when it is at least float32, else float32 (the precision the lens computes in)."""
  return jnp.dtype(dtype) if jnp.dtype(dtype).itemsize >= 4 else jnp.dtype(jnp.float32)


def _site(model, layer: int) -> str:
  return model.block_site(layer, "resid_post")


@dataclasses.dataclass(frozen=True)
class JacobianLens:
  """A fitted Jacobian lens: one ``(d_model, d_model)`` transport matrix per source layer.

  Layer ``l`` is the **output of block** ``l`` (``blocks_{l}/resid_post``, the published
  artifacts' convention; it is lens layer ``l + 1`` of :func:`jaxlens.lens.lens_sites`). Its
  matrix maps that residual stream to the last block's output (before the final norm); the last
  block itself is never fitted (its transport is the identity), so a full fit has source layers
  ``0 .. n_layers - 2``.

  Attributes:
    jacobians: ``{layer: (d_model, d_model)}`` float32 numpy arrays; row ``i`` is the
      derivative of the final stream's coordinate ``i``.
    n_prompts: how many prompts the matrices average.
    d_model: the residual stream's width.
    metadata: provenance (estimator, target layer, skipped positions, ...); kept by
      :func:`save_jacobian_lens` and :func:`load_jacobian_lens`.
  """

  jacobians: Mapping[int, Any]
  n_prompts: int
  d_model: int
  metadata: Mapping[str, Any] = dataclasses.field(default_factory=dict)

  def __post_init__(self):
    if not self.jacobians:
      raise LensError(
        "a Jacobian lens needs at least one layer's matrix",
        code="invalid_argument",
        fix="JacobianLens({0: matrix}, n_prompts=..., d_model=...)",
      )
    fixed = {}
    for layer, matrix in self.jacobians.items():
      a = np.asarray(matrix, np.float32)
      if a.shape != (self.d_model, self.d_model):
        raise LensError(
          f"jacobians[{layer}] has shape {a.shape}, not (d_model, d_model)",
          code="lens_file_mismatch",
          expected=(self.d_model, self.d_model),
          received=a.shape,
          fix="matrices of the lens's d_model",
        )
      fixed[int(layer)] = a
    object.__setattr__(self, "jacobians", dict(sorted(fixed.items())))
    object.__setattr__(self, "metadata", dict(self.metadata or {}))

  @property
  def source_layers(self) -> list[int]:
    """The layers with a matrix, sorted."""
    return sorted(self.jacobians)

  def transport(self, residual, layer: int):
    """``residual @ J[layer].T`` in float32 (float64 for a float64 residual): block
    ``layer``'s output carried to the last block's output basis."""
    if layer not in self.jacobians:
      raise LensError(
        f"layer {layer} is not one of this lens's source layers {self.source_layers}",
        code="index_out_of_range",
        expected=self.source_layers,
        received=layer,
        fix="a layer the lens was fitted for",
      )
    residual = jnp.asarray(residual)
    dt = _wide(residual.dtype)
    return residual.astype(dt) @ jnp.asarray(self.jacobians[layer]).astype(dt).T

  @classmethod
  def merge(cls, lenses: Sequence[JacobianLens]) -> JacobianLens:
    """Lenses fitted on disjoint prompt sets, averaged weighted by their prompt counts (the
    reference's merge): the same lens as one fit on all the prompts.

    Raises:
      LensError: ``invalid_argument`` for no lenses or a lens with no prompts,
        ``lens_file_mismatch`` when the layers, widths or provenance (all metadata but the
        prompt count) differ.
    """
    lenses = list(lenses)
    if not lenses or any(lens.n_prompts <= 0 for lens in lenses):
      raise LensError(
        "merge needs one or more lenses, each fitted on at least one prompt",
        code="invalid_argument",
        received=[lens.n_prompts for lens in lenses],
        fix="JacobianLens.merge([fit_a, fit_b])",
      )
    first = lenses[0]
    provenance = {k: v for k, v in first.metadata.items() if k != _COUNT}
    for other in lenses[1:]:
      other_provenance = {k: v for k, v in other.metadata.items() if k != _COUNT}
      if (other.source_layers, other.d_model) != (first.source_layers, first.d_model) or (
        other_provenance != provenance
      ):
        raise LensError(
          "the lenses to merge differ in their layers, width or provenance",
          code="lens_file_mismatch",
          expected=(first.source_layers, first.d_model, provenance),
          received=(other.source_layers, other.d_model, other_provenance),
          fix="merge fits of the same model, layers and settings",
        )
    total = sum(lens.n_prompts for lens in lenses)
    merged = {
      layer: sum(lens.jacobians[layer].astype(np.float64) * lens.n_prompts for lens in lenses)
      / total
      for layer in first.source_layers
    }
    metadata = dict(first.metadata)
    if metadata:
      metadata[_COUNT] = total
    return cls(merged, n_prompts=total, d_model=first.d_model, metadata=metadata)


def _check_lens(lens: JacobianLens, model) -> int:
  """Refuses a lens that does not fit ``model``; returns the model's number of blocks."""
  n = layer_count(model)
  d = int(model.config.d_model)
  if lens.d_model != d:
    raise LensError(
      f"the lens was fitted for d_model={lens.d_model}, the model has {d}",
      code="lens_file_mismatch",
      expected=d,
      received=lens.d_model,
      fix="the lens fitted for this model",
    )
  bad = [layer for layer in lens.source_layers if not 0 <= layer < n - 1]
  if bad:
    raise LensError(
      f"the lens has source layers {bad} outside the model's 0 .. {n - 2}",
      code="lens_file_mismatch",
      expected=f"layers in 0 .. {n - 2}",
      received=bad,
      fix="the lens fitted for this model",
    )
  target = lens.metadata.get("target_layer", n - 1)
  if target != n - 1:
    raise LensError(
      f"the lens targets block {target}'s output, not the last block's ({n - 1})",
      code="lens_file_mismatch",
      expected=n - 1,
      received=target,
      fix="a lens fitted to the last block's output (the published convention)",
    )
  return n


def _check_block_layers(layers, n: int, what: str = "layers") -> list[int]:
  seq = [layers] if isinstance(layers, (int, np.integer)) else list(layers)
  out = []
  for layer in seq:
    if isinstance(layer, bool) or not isinstance(layer, (int, np.integer)) or not (-n <= layer < n):
      raise LensError(
        f"{what}: {layer!r} is not a block of the model's {n} (block outputs 0 .. {n - 1})",
        code="index_out_of_range",
        expected=f"an int in [{-n}, {n})",
        received=repr(layer),
        fix=f"{what}=[0, {n // 2}]",
      )
    out.append(int(layer) % n)
  return out


# ------------------------------------------------------------------------------------- fitting


# The most bytes of per-position MLP Jacobians one fit program holds (the (positions, d, d)
# matrices the pullback keeps, summed over blocks); the blocks past it use the MLP's own
# pullback. 0 turns the per-position Jacobians off.
_MLP_JACOBIAN_BYTES = 1 << 30


# Positions whose MLP Jacobians are formed together: the (chunk, d, d_mlp) scaled identity that
# jax.jacfwd materialises stays small (all positions at once: (positions, d, d_mlp), 580 MB a
# block for 111 positions of Gemma 3 270M) and in cache (forming M alone at width 256: about 20%
# faster than all positions at once; the whole fit within the noise).
_MLP_JACOBIAN_CHUNK = 4


def _per_position(fn, x):
  """``jax.vmap(fn)(x)`` over ``x``'s rows, :data:`_MLP_JACOBIAN_CHUNK` rows at a time (a
  ``lax.map``)."""
  rows, c = x.shape[0], _MLP_JACOBIAN_CHUNK
  if rows <= c:
    return jax.vmap(fn)(x)
  pad = (-rows) % c
  xs = jnp.pad(x, ((0, pad), (0, 0))).reshape(-1, c, x.shape[1])
  out = jax.lax.map(jax.vmap(fn), xs)
  return out.reshape(-1, *out.shape[2:])[:rows]


def _mlp_jacobians(budget: int):
  """A ``flax.linen.intercept_methods`` interceptor that gives each block's MLP (the submodule
  named ``mlp``, whatever its kind: GPT-2's, a gated MLP, a mixture of experts) a pullback
  through its per-position Jacobian.

  The MLP acts on each position alone, so at position ``t`` its derivative is one ``(d, d)``
  matrix ``M_t``. The intercepted call returns the MLP's output (its value, no derivative) plus
  the linear term ``M_t (x_t - x_t)``, zero in value, whose derivative is ``M_t``: the
  pullback of the fit's ``vmap`` over directions is then one ``(d, d)`` product per position
  and direction, instead of the MLP's two (or, gated, three) products of width ``d_mlp``.
  ``M`` comes from ``jax.jacfwd`` of the MLP as a pure function of one position, ``vmap``ped
  over a few positions at a time: the identity tangent is not batched over positions, so the
  first projection of the identity is computed once per chunk, and forming ``M`` costs one
  ``d x d_mlp x d`` product per position (GPT-2 at ``d_mlp = 4 d``: the backward's MLP
  ``16 T d^3`` FLOPs for ``d`` directions become ``8 T d^3 + 2 T d^3``).

  ``budget`` bounds the bytes of the ``M`` of all blocks together; a block past it, or a call
  the interceptor does not recognise, runs as it is. The interceptor's ``formed`` lists the
  input shapes of the calls it gave a per-position Jacobian."""
  spent = [0]
  busy = [False]
  formed: list = []

  def intercept(next_fun, args, kwargs, context):
    module = context.module
    if (
      busy[0]
      or context.method_name != "__call__"
      or module.name != "mlp"
      or kwargs
      or len(args) != 1
      or not hasattr(args[0], "ndim")
      or args[0].ndim < 1
    ):
      return next_fun(*args, **kwargs)
    (x,) = args
    d = x.shape[-1]
    rows = int(np.prod(x.shape[:-1]))
    cost = rows * d * d * jnp.dtype(x.dtype).itemsize
    if spent[0] + cost > budget:
      return next_fun(*args, **kwargs)
    spent[0] += cost
    unbound, variables = module.unbind()

    def one(xt):  # the MLP on one position, as a (1, 1, d) sequence (a MoE's call wants 3-D)
      y = unbound.apply(variables, xt.reshape(1, 1, d))
      return y.reshape(y.shape[-1])

    x0 = jax.lax.stop_gradient(x)
    busy[0] = True
    try:
      y = next_fun(x0)
      m = _per_position(jax.jacfwd(one), x0.reshape(rows, d))  # (rows, d_out, d_in)
    finally:
      busy[0] = False
    if y.shape != x.shape:  # not a width-preserving MLP: leave it alone
      return next_fun(*args, **kwargs)
    m = m.reshape(*x.shape, d)
    formed.append(x.shape)
    return jax.lax.stop_gradient(y) + jnp.einsum("...oi,...i->...o", m, x - x0).astype(y.dtype)

  intercept.formed = formed  # type: ignore[attr-defined]
  return intercept


@functools.partial(
  jax.jit, static_argnames=("model", "layers", "skip", "dim_batch", "mlp_jacobian_bytes")
)
def _prompt_sums(
  model, variables, tokens, lengths, *, layers, skip, dim_batch, mlp_jacobian_bytes=0
):
  """``(len(layers), d, d)``: the sum over the rows of ``tokens`` of each prompt's Jacobian,
  averaged over its valid source positions. Row ``r`` holds a prompt of ``lengths[r]`` tokens
  padded at the end to the rows' common length: causal attention keeps the padding out of the
  prompt's positions, and the padding's positions get no cotangent and no weight, so one
  compiled program serves every length up to the rows'.

  Only the valid positions ``skip .. seq - 2`` take part in the derivative: a position before
  ``skip`` influences only itself and later positions, but its own gradient reaches only
  earlier positions (never a valid one), and the last position's cotangent is zero. The prompt
  therefore runs once; the differentiated function runs blocks ``min(layers) + 1 ..`` on the
  valid positions alone, attending to that run's keys and values before ``skip`` as constants
  (:meth:`jaxlens.protocol.Decoder.run_block`), with a zero added at each source layer's
  output. Each block's MLP pulls back through its per-position Jacobian (:func:`_mlp_jacobians`,
  up to ``mlp_jacobian_bytes`` of them)."""
  n = layer_count(model)
  b, seq = tokens.shape
  first = layers[0]
  d, dtype = int(model.config.d_model), jnp.dtype(model.config.dtype)
  at = model.block_site
  kv = [(at(j, "attn/k"), at(j, "attn/v")) for j in range(first + 1, n)]
  start = at(first, "resid_post")
  t = jl.trace(
    model,
    variables,
    tokens,
    keep_inputs=False,
    save=[jl.label(s) for s in (start, *(x for pair in kv for x in pair))],
  )
  x0 = jax.lax.stop_gradient(t[start].out[:, skip : seq - 1])
  past = {
    j: (jax.lax.stop_gradient(t[k].out[:, :skip]), jax.lax.stop_gradient(t[v].out[:, :skip]))
    for j, (k, v) in zip(range(first + 1, n), kv)
  }
  positions = jnp.arange(skip, seq - 1, dtype=jnp.int32)[None]
  mask = (jnp.arange(seq - 1, dtype=jnp.int32)[None, :] <= positions[0][:, None])[None, None]
  valid = positions <= (lengths[:, None] - 2)  # (b, positions): the prompt's, not padding
  weight = valid.astype(dtype) / (lengths[:, None] - 1 - skip).astype(dtype)

  def forward(deltas):
    added = dict(zip(layers, deltas))
    x = x0 + added[first]
    with nn.intercept_methods(_mlp_jacobians(mlp_jacobian_bytes)):
      for j in range(first + 1, n):
        keys, values = past[j]
        x = model.run_block(
          variables, j, x, positions, past_keys=keys, past_values=values, mask=mask
        )
        if j in added:
          x = x + added[j]
    return x

  zeros = tuple(jnp.zeros(x0.shape, dtype) for _ in layers)
  _, vjp = jax.vjp(forward, zeros)

  def rows(i):
    cotangent = valid[..., None].astype(dtype) * jax.nn.one_hot(i, d, dtype=dtype)
    (grads,) = vjp(cotangent)
    return jnp.stack([jnp.einsum("bp,bpd->d", weight, g) for g in grads])

  out = jax.lax.map(rows, jnp.arange(d), batch_size=min(dim_batch, d))  # (d_out, n_src, d_in)
  return jnp.moveaxis(out, 1, 0)


_CPU_THREADS = 2  # batches in flight on a CPU, at most (and at most the usable cores)


def _threads(threads: int | None, n_batches: int) -> int:
  """How many threads run the fit's batches: ``threads``, or by default on a CPU the cores this
  process may use (at most :data:`_CPU_THREADS`), else 1; never more than the batches."""
  if threads is None:
    if jax.default_backend() != "cpu":
      threads = 1
    else:
      cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
      threads = min(_CPU_THREADS, cores or 1)
  return max(1, min(int(threads), n_batches))


try:  # what jax.jit keys its traces on: the configuration, thread-local parts included
  from jax._src.config import trace_context as _trace_context
except ImportError:  # pragma: no cover - a jax without it: the options that matter here

  def _trace_context():
    return (jax.config.jax_enable_x64, jax.config.jax_numpy_dtype_promotion)


# Programs known to be compiled: (program key, argument shapes, configuration), the most recent
# _COMPILED_MAX; a batch whose program is not among them runs alone first (see _in_order).
_COMPILED: collections.OrderedDict = collections.OrderedDict()
_COMPILED_MAX = 64


def _in_order(fn, batches: Sequence[tuple], threads: int, program: Any = None):
  """Yields ``fn(*batch)`` for each batch, in the batches' order, computed by ``threads``
  threads with at most ``2 * threads`` batches in flight.

  A new thread does not inherit the caller's thread-local JAX configuration (``with
  jax.enable_x64(...)``, a dtype-promotion context): each worker enters the caller's x64 and
  promotion settings, and when the configuration a worker traces under still differs from the
  caller's, the batches run in the calling thread. The first batch of each shape is waited for
  before the next is queued, so each program is traced and compiled once, unless an earlier call
  ran it (``program`` names the program apart from the batch's shapes: its static arguments)."""
  pool = concurrent.futures.ThreadPoolExecutor(threads) if threads > 1 else None
  x64 = bool(jax.config.jax_enable_x64)
  promotion = jax.config.jax_numpy_dtype_promotion

  def call(work, *args):
    with jax.enable_x64(x64), jax.numpy_dtype_promotion(promotion):
      return work(*args)

  if pool is not None and pool.submit(call, _trace_context).result() != _trace_context():
    pool.shutdown()
    pool = None
  in_flight: collections.deque = collections.deque()
  try:
    for batch in batches:
      if pool is None:
        yield fn(*batch)
        continue
      done = pool.submit(call, fn, *batch)
      key = (program, tuple(np.shape(a) for a in batch), _trace_context())
      if key not in _COMPILED:
        done.result()
        _COMPILED[key] = None
        while len(_COMPILED) > _COMPILED_MAX:
          _COMPILED.popitem(last=False)
      in_flight.append(done)
      while len(in_flight) > 2 * threads:
        yield in_flight.popleft().result()
    while in_flight:
      yield in_flight.popleft().result()
  finally:
    if pool is not None:
      pool.shutdown(cancel_futures=True)


def _prompt_list(prompts, max_seq_len: int) -> list[np.ndarray]:
  if hasattr(prompts, "ndim") and getattr(prompts, "ndim", 0) == 2:
    rows = list(np.asarray(prompts))
  elif isinstance(prompts, (list, tuple)):
    rows = [np.asarray(p) for p in prompts]
  else:
    rows = None
  if rows is None or not all(r.ndim == 1 and np.issubdtype(r.dtype, np.integer) for r in rows):
    raise LensError(
      "prompts must be int token ids: a (n, seq) array or a list of 1-D arrays",
      code="lens_data_invalid",
      received=type(prompts).__name__,
      fix="prompts=[lm.encode(text) for text in texts]",
    )
  return [r[:max_seq_len].astype(np.int32) for r in rows]


def fit_jacobian_lens(
  model,
  variables,
  prompts,
  *,
  source_layers=None,
  skip_first_positions: int = DEFAULT_SKIP_FIRST_POSITIONS,
  max_seq_len: int = 128,
  dim_batch: int = 32,
  prompt_batch: int = 1,
  length_bucket: int = 16,
  threads: int | None = None,
  metadata: Mapping[str, Any] | None = None,
) -> JacobianLens:
  """Fits a Jacobian lens: per source layer, the average Jacobian of the last block's output
  with respect to that layer's block output (TransformerLens's and the reference's estimator).

  Each prompt runs forward once; ``jax.vjp`` gives the pullback from the final stream to every
  source layer at once, and a ``jax.vmap`` of it over the one-hot directions (``dim_batch`` at
  a time, a ``lax.map`` over the chunks) gives the matrices' rows, averaged over the prompt's
  valid source positions (all but the first ``skip_first_positions`` and the last). Inside the
  pullback each block's MLP applies its per-position Jacobian, formed once a prompt, to the
  directions (one ``(d, d)`` product a position instead of the MLP's own, wider ones; the same
  matrices). Prompts count equally. Each prompt is padded at the end to a multiple of ``length_bucket`` tokens
  (the padding takes no part in the estimate: attention is causal), so prompts of many
  lengths share a few compiled programs; ``prompt_batch`` prompts of one bucket run together.
  On a CPU the batches run on two threads at once (one program keeps about one core busy), and
  their sums are added in the calling thread in the batches' order, so the result does not
  depend on ``threads``.

  Args:
    model: a decoder of :mod:`jaxlens.models`.
    variables: its variables.
    prompts: token ids, a ``(n, seq)`` int array or a list of 1-D int arrays. Each is cut to
      ``max_seq_len``; one with no valid position (``len <= skip_first_positions + 1``) is
      skipped with a :class:`jaxlens.core.JaxlensWarning` and not counted.
    source_layers: block outputs to fit (default all but the last block's; negative ints
      count from ``n_layers``).
    skip_first_positions: leading positions left out of the source average (attention sinks).
    max_seq_len: the longest prompt used.
    dim_batch: directions per vectorised VJP (the result is the same; on a CPU, chunks whose
      working set stays in cache are fastest: 32 beat 128 by 2x at width 128).
    prompt_batch: prompts of one bucket run together.
    length_bucket: prompts are padded to a multiple of it (at most ``max_seq_len`` and the
      model's ``max_len``); 1 compiles a program per prompt length.
    threads: batches run at once, each from its own thread (XLA releases the GIL while a
      program runs). Default: on a CPU, the cores this process may use, at most 2; else 1.
    metadata: extra provenance kept in the lens (JSON-like values).

  Returns:
    A :class:`JacobianLens` (float32 matrices).

  Raises:
    LensError: ``index_out_of_range`` (a source layer that is not below the last block),
      ``invalid_argument`` (a count that is not a positive int), ``lens_data_invalid``
      (prompts that are not token ids, or none long enough).

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from jaxlens import lens
    >>> from jaxlens.models import Llama, LlamaConfig
    >>> model = Llama(LlamaConfig(vocab_size=64, d_model=16, n_layers=3, n_heads=2,
    ...                           n_kv_heads=1, d_mlp=32))
    >>> prompts = jnp.arange(24).reshape(2, 12)
    >>> variables = model.init(jax.random.key(0), prompts)
    >>> fit = lens.fit_jacobian_lens(model, variables, prompts, skip_first_positions=2)
    >>> fit.source_layers, fit.n_prompts, fit.jacobians[0].shape
    ([0, 1], 2, (16, 16))
  """
  n = layer_count(model)
  for name, value, low in (
    ("skip_first_positions", skip_first_positions, 0),
    ("max_seq_len", max_seq_len, 2),
    ("dim_batch", dim_batch, 1),
    ("prompt_batch", prompt_batch, 1),
    ("length_bucket", length_bucket, 1),
    ("threads", 1 if threads is None else threads, 1),
  ):
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
      raise LensError(
        f"{name} must be an int >= {low}, got {value!r}",
        code="invalid_argument",
        received=repr(value),
        fix=f"{name}={ {'skip_first_positions': 16, 'max_seq_len': 128}.get(name, 8) }",
      )
  layers = sorted(
    set(
      _check_block_layers(
        list(range(n - 1)) if source_layers is None else source_layers, n, "source_layers"
      )
    )
  )
  if not layers or layers[-1] >= n - 1:
    raise LensError(
      f"source layers must be below the last block ({n - 1}), got {layers}",
      code="index_out_of_range",
      expected=f"layers in 0 .. {n - 2}",
      received=layers,
      fix="source_layers=None (every block but the last)",
    )
  rows = _prompt_list(prompts, max_seq_len)
  kept = [r for r in rows if r.shape[0] > skip_first_positions + 1]
  if len(kept) < len(rows):
    warnings.warn(
      JaxlensWarning(
        f"{len(rows) - len(kept)} prompt(s) with at most skip_first_positions + 1 = "
        f"{skip_first_positions + 1} tokens skipped (no valid position)",
        code="jacobian_prompt_skipped",
      ),
      stacklevel=2,
    )
  if not kept:
    raise LensError(
      f"every prompt is too short: a prompt needs more than {skip_first_positions + 1} tokens",
      code="lens_data_invalid",
      received=[int(r.shape[0]) for r in rows][:8],
      fix="longer prompts, or a smaller skip_first_positions",
    )
  d = int(model.config.d_model)
  longest = min(max_seq_len, getattr(model.config, "max_len", None) or max_seq_len)
  by_length: dict[int, list[np.ndarray]] = {}
  for r in kept:
    n_tokens = int(r.shape[0])
    padded = max(n_tokens, min(-(-n_tokens // length_bucket) * length_bucket, longest))
    by_length.setdefault(padded, []).append(r)
  batches = []
  for padded, group in by_length.items():
    for start in range(0, len(group), prompt_batch):
      chunk = group[start : start + prompt_batch]
      tokens = np.zeros((len(chunk), padded), np.int32)
      for row, r in zip(tokens, chunk):
        row[: r.shape[0]] = r
      batches.append((tokens, np.asarray([r.shape[0] for r in chunk], np.int32)))

  budget = int(_MLP_JACOBIAN_BYTES)

  def sums(tokens, lengths):
    out = _prompt_sums(
      model,
      variables,
      jnp.asarray(tokens),
      jnp.asarray(lengths),
      layers=tuple(layers),
      skip=int(skip_first_positions),
      dim_batch=int(dim_batch),
      mlp_jacobian_bytes=budget,
    )
    return np.asarray(out)  # waits for the program in this thread

  total = np.zeros((len(layers), d, d), np.float64)
  program = (
    model,
    tuple(layers),
    int(skip_first_positions),
    int(dim_batch),
    budget,
    jax.tree.structure(variables),
  )
  for part in _in_order(sums, batches, _threads(threads, len(batches)), program):
    total += part.astype(np.float64)
  count = len(kept)
  info = {
    **dict(metadata or {}),
    "estimator": ESTIMATOR,
    "jaxlens_fit": True,
    "target_layer": n - 1,
    "skip_first_positions": int(skip_first_positions),
    "max_seq_len": int(max_seq_len),
    "fit_dtype": str(jnp.dtype(model.config.dtype)),
    _COUNT: count,
  }
  jacobians = {layer: total[i] / count for i, layer in enumerate(layers)}
  return JacobianLens(jacobians, n_prompts=count, d_model=d, metadata=info)


# ------------------------------------------------------------------------------------ files


def save_jacobian_lens(path, lens: JacobianLens, *, dtype=np.float16) -> None:
  """Writes ``lens`` in the published artifact format (Anthropic's reference and
  TransformerLens's ``JacobianLens.save``): a torch file holding ``{"J": {layer: matrix},
  "n_prompts", "source_layers", "d_model"}`` and, when there is any, ``"metadata"``. Written
  without torch, atomically (a temporary file renamed over ``path``).

  Args:
    path: the ``.pt`` file.
    lens: the lens.
    dtype: the matrices' storage dtype (float16 as the reference; float32 keeps every bit).
  """
  payload: dict[str, Any] = {
    "J": {layer: np.asarray(m).astype(dtype) for layer, m in lens.jacobians.items()},
    "n_prompts": int(lens.n_prompts),
    "source_layers": list(lens.source_layers),
    "d_model": int(lens.d_model),
  }
  if lens.metadata:
    payload["metadata"] = dict(lens.metadata)
  write_object(Path(path), payload)


def _clean_metadata(value):
  if isinstance(value, np.ndarray):
    return None
  if isinstance(value, dict):
    return {k: _clean_metadata(v) for k, v in value.items() if not isinstance(v, np.ndarray)}
  if isinstance(value, (list, tuple)):
    return type(value)(_clean_metadata(v) for v in value)
  return value


@path_argument(LensError)
def load_jacobian_lens(path, model=None) -> JacobianLens:
  """Reads a Jacobian lens artifact (:func:`save_jacobian_lens`, TransformerLens's
  ``JacobianLens.save``, the reference's files) or a fit checkpoint of the reference
  (``jacobian_sum`` running sums and ``n_done``), without torch.

  Args:
    path: the ``.pt`` file.
    model: when given, the lens is checked against it (width, source layers below the last
      block, the final-block target).

  Raises:
    LensError: ``lens_file_missing``; ``lens_file_corrupt`` (not a readable torch file, or
      neither schema); ``lens_file_mismatch`` (a matrix of the wrong size, a lens for another
      model).
  """
  payload = read_object(path, what=_WHAT)

  def corrupt(why):
    return LensError(
      f"{path} is not a Jacobian lens: {why}",
      code="lens_file_corrupt",
      path=str(path),
      fix=_WHAT,
    )

  if not isinstance(payload, dict):
    raise corrupt("it does not hold a dict")
  try:
    if "J" in payload:
      mats = {int(k): v for k, v in dict(payload["J"]).items()}
      lens = JacobianLens(
        mats,
        n_prompts=int(payload.get("n_prompts", 0)),
        d_model=int(payload["d_model"]),
        metadata=_clean_metadata(dict(payload.get("metadata") or {})),
      )
    elif "jacobian_sum" in payload:
      count = int(payload.get("n_done", payload.get("n_prompts", 0)))
      sums = {int(k): v for k, v in dict(payload["jacobian_sum"]).items()}
      if count <= 0 or not sums:
        raise corrupt(f"a fit checkpoint with n_done={count} and {len(sums)} matrices")
      meta = _clean_metadata(dict(payload.get("metadata") or {}))
      if "target_layer" in payload:
        meta.setdefault("target_layer", int(payload["target_layer"]))
      meta["converted_from"] = "jacobian_lens_checkpoint"
      first = next(iter(sums.values()))
      lens = JacobianLens(
        {k: np.asarray(v, np.float32) / count for k, v in sums.items()},
        n_prompts=count,
        d_model=int(first.shape[0]),
        metadata=meta,
      )
    else:
      raise corrupt("no 'J' (artifact) or 'jacobian_sum' (fit checkpoint) key")
  except (KeyError, TypeError, ValueError, AttributeError) as e:
    raise corrupt(f"{type(e).__name__}: {e}") from e
  if model is not None:
    _check_lens(lens, model)
  return lens


# ------------------------------------------------------------------------------------ reading


def _read_layers(lens, model, layers, use_jacobian) -> tuple[int, list[int]]:
  n = _check_lens(lens, model)
  chosen = [*lens.source_layers, n - 1] if layers is None else _check_block_layers(layers, n)
  if use_jacobian:
    missing = [layer for layer in chosen if layer != n - 1 and layer not in lens.jacobians]
    if missing:
      raise LensError(
        f"layers {missing} have no matrix in this lens (source layers {lens.source_layers}; "
        f"the last block, {n - 1}, reads as the model's output)",
        code="index_out_of_range",
        expected=[*lens.source_layers, n - 1],
        received=missing,
        fix="layers the lens was fitted for",
      )
  return n, chosen


def _transported(model, variables, tokens, lens, layers, use_jacobian, attention_mask):
  """The final-basis stream of each layer, ``(len(layers), batch, seq, d)``: ``h @ J.T`` in
  float32 (the last block's output as it is), then cast to the model's dtype."""
  n, chosen = _read_layers(lens, model, layers, use_jacobian)
  sites = [_site(model, layer) for layer in chosen]
  kwargs = {} if attention_mask is None else {"attention_mask": attention_mask}
  t = jl.trace(
    model,
    variables,
    tokens,
    save=[jl.label(s) for s in dict.fromkeys(sites)],
    keep_inputs=False,
    **kwargs,
  )
  dtype = model.config.dtype
  out = []
  for layer, site in zip(chosen, sites):
    h = t[site].out
    if use_jacobian and layer != n - 1:
      h = lens.transport(h, layer).astype(_wide(dtype))
    out.append(h.astype(dtype))
  return jnp.stack(out)


def jacobian_lens(
  model, variables, tokens, lens: JacobianLens, *, layers=None, use_jacobian=True,
  attention_mask=None,
):  # fmt: skip
  """The Jacobian lens's logits: each block output ``h_l`` carried by ``J_l`` to the last
  block's output basis, then the model's own final norm and unembedding,
  ``unembed(norm(J_l h_l))``. The last block (``n_layers - 1``) reads as the model's logits;
  ``use_jacobian=False`` gives the logit lens of the same block outputs.

  Args:
    model, variables: a decoder of :mod:`jaxlens.models` and its variables.
    tokens: int ``(batch, seq)``.
    lens: a :class:`JacobianLens` fitted for the model.
    layers: block outputs to read (default the lens's source layers and the last block).
    use_jacobian: False for the identity transport (the logit lens).
    attention_mask: optional padding mask.

  Returns:
    Logits ``(len(layers), batch, seq, vocab)``; :func:`jacobian_lens_topk` never holds them.

  Raises:
    LensError: ``index_out_of_range`` (a layer without a matrix), ``lens_file_mismatch`` (a
      lens for another model).
  """
  x = _transported(model, variables, tokens, lens, layers, use_jacobian, attention_mask)
  n, b = x.shape[:2]
  out = model.unembed(variables, x.reshape(n * b, *x.shape[2:]))
  return out.reshape(n, b, *out.shape[1:])


def jacobian_lens_topk(
  model, variables, tokens, lens: JacobianLens, k: int = 10, *, layers=None, use_jacobian=True,
  chunk: int = 8192, attention_mask=None,
) -> TopTokens:  # fmt: skip
  """:func:`jacobian_lens`'s ``k`` top tokens per layer and position, over the vocabulary one
  ``chunk`` at a time (as :func:`jaxlens.lens.logit_lens_topk`: no ``(layers, positions,
  vocab)`` array).

  Raises:
    LensError: as :func:`jacobian_lens`; ``invalid_argument`` for ``k`` or ``chunk``.
  """
  ro = readout(model, variables)
  for name, value, top in (("k", k, ro.vocab), ("chunk", chunk, None)):
    if (
      isinstance(value, bool)
      or not isinstance(value, (int, np.integer))
      or value < 1
      or (top and value > top)
    ):
      raise LensError(
        f"{name} must be a positive int{f' at most the vocabulary ({top})' if top else ''}, "
        f"got {value!r}",
        code="invalid_argument",
        received=repr(value),
        fix=f"{name}=10" if name == "k" else "chunk=8192",
      )
  x = _transported(model, variables, tokens, lens, layers, use_jacobian, attention_mask)
  return topk_chunked(ro, ro.norm(x), int(k), min(int(chunk), ro.vocab))


# ---------------------------------------------------------------------------- interventions


def _token_ids(model, variables, tokens) -> np.ndarray:
  vocab = readout(model, variables).vocab
  ids = np.atleast_1d(np.asarray(tokens))
  if ids.ndim != 1 or not np.issubdtype(ids.dtype, np.integer) or ids.size == 0:
    raise LensError(
      "tokens must be int token ids (one or a list)",
      code="invalid_argument",
      received=repr(tokens),
      fix="tokens=lm.encode(' Paris')[-1:]",
    )
  bad = [int(i) for i in ids if not 0 <= i < vocab]
  if bad:
    raise LensError(
      f"token ids {bad} are outside the vocabulary of {vocab}",
      code="index_out_of_range",
      expected=f"[0, {vocab})",
      received=bad,
      fix="ids from the model's tokenizer",
    )
  return ids.astype(np.int32)


def jacobian_lens_vectors(model, variables, lens: JacobianLens, tokens, layer: int):
  """The J-lens vectors of tokens at block output ``layer``: ``v_t = J[layer]^T W_U[:, t]``
  (row ``t`` of ``W_U J``), the residual directions that the lens reads as token ``t``;
  ``(len(tokens), d_model)`` in float32 (float64 for a float64 model).

  Raises:
    LensError: ``index_out_of_range`` (a token or a layer without a matrix).
  """
  n = _check_lens(lens, model)
  (layer,) = _check_block_layers(layer, n)
  ids = _token_ids(model, variables, tokens)
  if layer not in lens.jacobians:
    lens.transport(jnp.zeros(lens.d_model), layer)  # refuses the layer
  rows = readout(model, variables).rows(jnp.asarray(ids))
  dt = _wide(rows.dtype)
  return rows.astype(dt) @ jnp.asarray(lens.jacobians[layer]).astype(dt)


def _unit_rows(v, layer):
  norms = jnp.linalg.norm(v, axis=-1, keepdims=True)
  if not bool(jnp.all(jnp.isfinite(norms) & (norms > float(jnp.finfo(jnp.float32).eps)))):
    raise LensError(
      f"the lens vectors at layer {layer} include a zero or non-finite direction",
      code="invalid_argument",
      fix="other tokens, or a lens fitted on more prompts",
    )
  return v / norms


def _positions_edit(transform, positions):
  """An edit applying ``transform(selected)`` to the positions (all when None) of a ``(batch,
  seq, d)`` site and keeping the rest."""
  if positions is not None:
    positions = [int(p) for p in np.atleast_1d(positions)]
    if not positions:
      raise LensError(
        "positions must hold at least one index",
        code="invalid_argument",
        fix="positions=None (every position)",
      )

  def fn(x):
    if positions is None:
      return transform(x).astype(x.dtype)
    seq = x.shape[1]
    bad = [p for p in positions if not -seq <= p < seq]
    if bad:
      raise LensError(
        f"positions {bad} are outside the sequence of {seq}",
        code="index_out_of_range",
        expected=f"[{-seq}, {seq})",
        received=bad,
        fix="positions=[-1]",
      )
    idx = jnp.asarray([p % seq for p in positions])
    return x.at[:, idx].set(transform(x[:, idx]).astype(x.dtype))

  return ji.hook(fn)


def jacobian_steering(
  model, variables, lens: JacobianLens, token, layers, *, alpha: float = 4.0, positions=None
) -> list:
  """Rules that steer the residual stream toward a token's J-lens vector (TransformerLens's
  ``steering_hooks``): at each block output, ``h <- h + alpha * median|h| * v̂`` (``v̂`` the
  unit lens vector, ``median|h|`` the lower median of the selected positions' norms, so that
  attention sinks do not set the scale).

  The edit is a :func:`jaxlens.hook` of the site value: it **keeps the gradient** (through
  ``h`` and through the norm-matched scale). Pass the list as ``intervene=`` to
  :func:`jaxlens.trace` or bind it with ``jaxlens.when``'s ``.bind``.

  Args:
    model, variables, lens: the model and a lens fitted for it.
    token: the token id to steer toward.
    layers: block outputs to edit.
    alpha: strength (0 leaves the stream unchanged).
    positions: positions to edit (negative ints count from the end); None for all.

  Returns:
    A list of ``jaxlens.when(site, edit)`` rules, one per layer.
  """
  n = _check_lens(lens, model)
  rules = []
  for layer in _check_block_layers(layers, n):
    unit = _unit_rows(jacobian_lens_vectors(model, variables, lens, token, layer), layer)[0]

    def transform(x, unit=unit):
      h = x.astype(_wide(x.dtype))
      norms = jnp.sort(jnp.linalg.norm(h, axis=-1).reshape(-1))
      scale = alpha * norms[(norms.shape[0] - 1) // 2]
      return h + scale * unit.astype(h.dtype)

    rules.append(jl.when(jl.label(_site(model, layer)), _positions_edit(transform, positions)))
  return rules


def _orthonormal_span(units):
  """An orthonormal basis ``(d, r)`` of the span of ``units``' rows (a reduced SVD; ``r`` the
  numerical rank at TransformerLens's threshold)."""
  u, s, _ = jnp.linalg.svd(units.T, full_matrices=False)
  tol = float(s[0]) * max(units.shape) * float(jnp.finfo(jnp.float32).eps)
  return u[:, : int(jnp.sum(s > tol))]


def jacobian_ablation(
  model, variables, lens: JacobianLens, tokens, layers, *, positions=None
) -> list:
  """Rules that project tokens' J-lens vectors out of the residual stream (TransformerLens's
  ``ablation_hooks``): with ``Q`` an orthonormal basis of the vectors' span, ``h <- h - Q Q^T
  h``, so the stream ends with no component along any of them.

  A projection of the site value: it **keeps the gradient** (through the orthogonal
  complement of the span).

  Returns:
    A list of ``jaxlens.when(site, edit)`` rules, one per layer.
  """
  n = _check_lens(lens, model)
  rules = []
  for layer in _check_block_layers(layers, n):
    units = _unit_rows(jacobian_lens_vectors(model, variables, lens, tokens, layer), layer)
    basis = _orthonormal_span(units)

    def transform(x, basis=basis):
      h = x.astype(_wide(x.dtype))
      q = basis.astype(h.dtype)
      return h - (h @ q) @ q.T

    rules.append(jl.when(jl.label(_site(model, layer)), _positions_edit(transform, positions)))
  return rules


def jacobian_swap(
  model, variables, lens: JacobianLens, source_token, target_token, layers, *,
  alpha: float = 1.0, positions=None, clamp_to: Mapping[int, Any] | None = None,
) -> list:  # fmt: skip
  """Rules that exchange two concepts' coordinates in lens space (TransformerLens's
  ``swap_hooks``, the paper's patching in lens coordinates): with ``V = [v_s, v_t]`` the two
  J-lens vectors and ``c = V^+ h``, ``h <- h + alpha * V (c* - c)``, where ``c*`` is ``c`` with
  its two coordinates exchanged (the live stream's), or with ``clamp_to`` the exchanged
  coordinates of a clean run's stream, fixed when the rules are built. The component of ``h``
  outside ``span V`` is untouched; ``alpha=2`` is the paper's double-strength swap.

  Gradient: without ``clamp_to`` the written value is a function of ``h`` and **keeps the
  gradient**. With ``clamp_to``, ``c*`` is a constant: the gradient flows through ``h``'s
  part outside ``span V`` (and, when ``alpha != 1``, the remaining ``1 - alpha`` of its
  coordinates); at ``alpha=1`` the span's written coordinates carry none.

  Args:
    model, variables, lens: the model and a lens fitted for it.
    source_token, target_token: two different token ids.
    layers: block outputs to edit.
    alpha: strength.
    positions: positions to edit (None: all).
    clamp_to: ``{layer: (batch or 1, seq, d)}`` a clean run's block outputs (e.g.
      ``lens.residuals`` rows, or ``trace[model.block_site(l, "resid_post")].out``).

  Returns:
    A list of ``jaxlens.when(site, edit)`` rules, one per layer.

  Raises:
    LensError: ``invalid_argument`` (the same token twice), ``index_out_of_range``,
      ``lens_data_invalid`` (``clamp_to`` lacks a layer).
  """
  n = _check_lens(lens, model)
  ids = _token_ids(model, variables, [source_token, target_token])
  if ids[0] == ids[1]:
    raise LensError(
      "source_token and target_token are the same token: the swap would change nothing",
      code="invalid_argument",
      received=int(ids[0]),
      fix="two different token ids",
    )
  rules = []
  for layer in _check_block_layers(layers, n):
    vectors = jacobian_lens_vectors(model, variables, lens, ids, layer)
    _unit_rows(vectors, layer)
    basis = vectors.T  # (d, 2)
    pinv = jnp.linalg.pinv(basis)  # (2, d)
    clamped = None
    if clamp_to is not None:
      if layer not in clamp_to:
        raise LensError(
          f"clamp_to has no block output for layer {layer}",
          code="lens_data_invalid",
          expected=layer,
          received=sorted(clamp_to),
          fix="clamp_to={layer: clean_trace[model.block_site(layer, 'resid_post')].out}",
        )
      clean = jnp.asarray(clamp_to[layer])
      clean = clean.astype(_wide(clean.dtype))
      if positions is not None:
        seq = clean.shape[1]
        clean = clean[:, jnp.asarray([int(p) % seq for p in np.atleast_1d(positions)])]
      clamped = (clean @ pinv.T.astype(clean.dtype))[..., ::-1]

    def transform(x, basis=basis, pinv=pinv, clamped=clamped):
      h = x.astype(_wide(x.dtype))
      coords = h @ pinv.T.astype(h.dtype)
      target = coords[..., ::-1] if clamped is None else clamped.astype(h.dtype)
      return h + alpha * ((target - coords) @ basis.T.astype(h.dtype))

    rules.append(jl.when(jl.label(_site(model, layer)), _positions_edit(transform, positions)))
  return rules
