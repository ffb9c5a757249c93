"""Compact weights: matrices kept as int8 (or the GGUF file's own blocks) and dequantised inside
the matmul, and the ``Dense`` / ``Embed`` layers of the zoo that read them.

Decoding one token reads every weight once, so its speed is bounded by memory bandwidth and the
bytes of the weights: float32 reads 4 bytes a weight. A compact matrix reads fewer:

* :class:`Int8Rows`: int8 values with one float32 scale per row (per output channel of a
  kernel, per token of an embedding table): 1 byte a weight; ``weights="int8"`` at load.
* :class:`Blocks`: a GGUF file's own quantisation kept as it is, blocks of 32 values along each
  row with a scale (and for Q4_1 an offset) per block: Q8_0's int8 values, Q4_1's 4-bit values
  unpacked to int8 (XLA on CPU handles 4-bit unpacking slowly), scales as float32: 1.125-1.25
  bytes a weight; ``weights="gguf"`` at load. It dequantises to exactly the float32 weights the
  default load gives (``gguf.quants.dequantize``'s arithmetic), so the model computes the same.
* :class:`Rows`: a float kernel kept as its rows, ``(out, in)``, as torch and safetensors store
  it, in the model's dtype: no fewer bytes, but XLA on CPU multiplies one token by a matrix
  stored so about 1.4x faster than by the same matrix stored ``(in, out)`` (each output is one
  contiguous dot product, where the ``(in, out)`` form updates every output for every input);
  ``load_hf(..., layout="rows")`` or :func:`rows_params`. The model computes the same values
  (the same products, summed in XLA's order for the stored shape).

Both are pytrees (``flax.struct`` dataclasses) stored where the float kernel or embedding would
be (``params[...]["kernel"]``), so sites, edits, traces and ``jax.jit`` see the same model. The
dequantisation happens in :class:`Dense` / :class:`Embed` right before each product, under
``jit``: XLA writes one layer's float32 weight at a time (a few MiB, which stays in the CPU's
cache) instead of reading four bytes a weight from memory. ``weights="bfloat16"`` needs no class:
bfloat16 arrays are multiplied by :func:`times_wide`, in a float32 or a bfloat16 model.

XLA on CPU has no bfloat16 matrix product: it widens a bfloat16 operand to float32 and multiplies
in float32. Left to itself, it widens every weight whole, ahead of its product (and, in a loop
such as ``jl.generate``'s, once before the loop): a float32 copy of every weight, twice the
bfloat16 weights' memory. :func:`times_wide` computes the same product (the same float32 values,
the same float32 products) a chunk of output columns at a time, so only one chunk's float32 copy
(about ``WIDEN_BYTES``; ``WIDEN_BYTES_FEW`` for a decoding step's few rows) exists at once.

Matrices are stored as ``(rows, cols)`` with ``cols`` the contracted axis: a kernel ``(in, out)``
is kept transposed (``(out, in)``, as GGUF and torch store it), an embedding table as is.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from flax.linen.dtypes import promote_dtype

from jaxlens.core import InvalidArgumentError
from jaxlens.models._params import StoredParams

__all__ = [
  "WEIGHTS",
  "FEW_ROWS",
  "WIDEN_BYTES",
  "WIDEN_BYTES_FEW",
  "Blocks",
  "Dense",
  "Embed",
  "Int8Rows",
  "Rows",
  "blocks_from_gguf",
  "compact_params",
  "dequantize",
  "gguf_params",
  "is_compact",
  "rows_params",
  "times_wide",
]

WEIGHTS = ("float32", "bfloat16", "int8", "gguf", "rows")


@flax.struct.dataclass
class Int8Rows:
  """A ``(rows, cols)`` matrix as ``values * scale[:, None]``: int8 values, a float32 scale per
  row."""

  values: Any  # int8 (rows, cols)
  scale: Any  # float32 (rows,)

  @property
  def shape(self):
    return self.values.shape

  def matrix(self, dtype=jnp.float32):
    return self.values.astype(dtype) * self.scale[:, None].astype(dtype)

  def rows(self, index, dtype=jnp.float32):
    return jnp.take(self.values, index, axis=0).astype(dtype) * jnp.take(self.scale, index, axis=0)[
      ..., None
    ].astype(dtype)


@flax.struct.dataclass
class Blocks:
  """A ``(rows, cols)`` matrix in blocks of ``block`` values along each row: ``values *
  scale[..., None] + offset[..., None]`` per block (GGUF's Q8_0: no offset; Q4_1: with one)."""

  values: Any  # int8 (rows, cols // block, block)
  scale: Any  # float32 (rows, cols // block)
  offset: Any = None  # float32 (rows, cols // block), or None

  @property
  def shape(self):
    rows, n, block = self.values.shape
    return (rows, n * block)

  def _dequant(self, values, scale, offset, dtype):
    w = values.astype(dtype) * scale[..., None].astype(dtype)
    if offset is not None:
      w = w + offset[..., None].astype(dtype)
    return w.reshape(w.shape[:-2] + (-1,))

  def matrix(self, dtype=jnp.float32):
    return self._dequant(self.values, self.scale, self.offset, dtype)

  def rows(self, index, dtype=jnp.float32):
    def take(a):
      return None if a is None else jnp.take(a, index, axis=0)

    return self._dequant(take(self.values), take(self.scale), take(self.offset), dtype)


@flax.struct.dataclass
class Rows:
  """A float ``(rows, cols)`` matrix kept as it is: a kernel ``(in, out)`` stored as its rows
  ``(out, in)``, the layout in which XLA on CPU multiplies a few tokens fastest."""

  values: Any  # float (rows, cols)

  @property
  def shape(self):
    return self.values.shape

  @property
  def dtype(self):
    return self.values.dtype

  def matrix(self, dtype=jnp.float32):
    return self.values.astype(dtype)

  def rows(self, index, dtype=jnp.float32):
    return jnp.take(self.values, index, axis=0).astype(dtype)


_COMPACT = (Int8Rows, Blocks, Rows)

# Rows of a compact matrix dequantised at once: 4096 x 576 float32 values are 9 MiB.
_CHUNK = 2**22


def _times_rows(x, w):
  """``x @ w.T`` as one contraction of the last axes of both, ``w`` read as stored: a
  ``w.T`` in the program is a transpose that XLA without its optimising passes copies on every
  call (for a tied unembedding, the whole table: 671 MB for Gemma 3 270M)."""
  return jax.lax.dot_general(x, w, (((x.ndim - 1,), (1,)), ((), ())))


def times_transpose(m, x, dtype):
  """``x @ m.matrix(dtype).T`` for a compact matrix ``m``, dequantised right before the product.

  The float copy is one layer's worth, written just before the product reads it: XLA on CPU
  does not fuse the dequantisation into the product, so where the copy fits the cache, it is
  read from the cache and only the compact bytes come from memory. The copy depends on ``x``
  through an added zero (``0 * isnan(x[0])``, zero for every x): without it XLA schedules
  every layer's dequantisation at the start of the program, all the float weights at once in
  a temporary buffer that the call allocates and faults in (a 4-layer model ran 15x slower than
  float32; XLA on CPU removes ``optimization_barrier`` before scheduling). A larger matrix
  (the unembedding) is dequantised and multiplied in chunks of rows, one after the other.
  """
  if isinstance(m, Rows):  # a float matrix: no dequantisation, read as stored
    if widens(m.values, dtype):
      return times_wide(x, m.values, 1, dtype)
    return _times_rows(x.astype(dtype), m.values.astype(dtype))
  rows, cols = m.shape
  per = max(1, _CHUNK // cols)

  def product(x, part):
    # A zero that depends on x (0 even where x is NaN), added to the dequantised weight.
    first = jax.lax.stop_gradient(x.reshape(-1)[:1])
    zero = (first != first).astype(dtype)[0] * 0
    return _times_rows(x, part.matrix(dtype) + zero)

  if rows <= per:
    return product(x, m)
  n = rows // per
  head = jax.tree.map(lambda a: a[: n * per].reshape((n, per) + a.shape[1:]), m)
  ys = jax.lax.map(lambda part: product(x, part), head)  # (n, ..., per)
  y = jnp.moveaxis(ys, 0, -2).reshape(x.shape[:-1] + (n * per,))
  if n * per < rows:
    tail = jax.tree.map(lambda a: a[n * per :], m)
    y = jnp.concatenate([y, product(x, tail)], axis=-1)
  return y


# The float32 bytes of one chunk of a bfloat16 matrix that times_wide widens at once: small enough
# to stay in the CPU's cache between its widening and its product.
WIDEN_BYTES = 2**22
# The same for a product of at most FEW_ROWS rows (a decoding step), where the widening and the
# loop's own cost per chunk, not the product, take the time: on the shared 2-core machine of
# docs/performance.md ("bfloat16 products"), 2 MiB chunks gave the faster one-token product of a
# 2048 x 8192 matrix and decoding step of the 1B shape in most comparisons made.
WIDEN_BYTES_FEW = 2**21
FEW_ROWS = 8


def widens(matrix, dtype) -> bool:
  """Whether a product of ``matrix`` computed in ``dtype`` goes through :func:`times_wide`: a
  bfloat16 matrix multiplied in bfloat16 or float32 (a float64 product, or a float32 matrix, is
  left to XLA as it is)."""
  return jnp.dtype(matrix.dtype) == jnp.bfloat16 and jnp.dtype(dtype) in (
    jnp.dtype(jnp.bfloat16),
    jnp.dtype(jnp.float32),
  )


def _pinned(matrix, after):
  """``matrix`` as a value XLA sees depending on ``after``: an operation on it can be neither
  hoisted out of a loop nor scheduled before ``after`` exists (removed before the program runs:
  no copy)."""
  return jax.lax.optimization_barrier((matrix, after))[0]


def _chunk_columns(k: int, rows: int) -> int:
  """The output columns of one chunk of a ``k``-deep bfloat16 matrix multiplied by ``rows`` rows
  (whole vectors of 16 columns)."""
  budget = WIDEN_BYTES_FEW if rows <= FEW_ROWS else WIDEN_BYTES
  return max(16, budget // (4 * max(k, 1)) // 16 * 16)


def times_wide(x, matrix, contract: int, dtype, precision=None):
  """``x`` times a bfloat16 ``matrix`` as XLA computes it (``x`` in ``dtype``, both widened to
  float32, a float32 product, the result rounded to ``dtype``), widened a chunk at a time.

  The product of ``jax.lax.dot_general`` on the two operands cast to ``dtype``: each output is
  the same float32 dot product of the same float32 values, rounded to ``dtype`` once. (XLA's
  summation order inside a product depends on the product's shape, so an output can differ from
  the whole matrix's product in its last float32 bit, as XLA's product of one row differs between
  a batch of one and a batch of two; on Llama-3.2-1B's shapes the two agree bit for bit.)

  XLA on CPU widens a whole bfloat16 operand before its product and hoists the widening of a
  weight out of any loop it sits in; here the matrix is split into chunks of output columns of
  about ``WIDEN_BYTES`` of float32 each (``WIDEN_BYTES_FEW`` for at most ``FEW_ROWS`` rows of
  ``x``: a decoding step), multiplied one after the other in a ``lax.fori_loop``; each chunk's
  widening is pinned to its
  own iteration (:func:`_pinned`) and waits for ``x`` (a zero computed from ``x`` is added to
  it), so one chunk's float32 copy is alive at a time. (The added zero reads a ``-0.0`` weight as
  ``+0.0``, which changes no output's value, only the sign of an output that is exactly zero.)

  A chunk costs a widening kernel, a product kernel and the loop's step, so a decoding step
  (about 1,150 chunks for Llama-3.2-1B) reads its bfloat16 weights well below the memory's
  bandwidth. No other spelling reads them faster on XLA:CPU: a product is never fused with
  the widening (a ``dot_general`` of bfloat16 operands, with ``preferred_element_type`` or a
  bfloat16 dot algorithm, compiles to a whole widening and a float32 product), and a
  multiply-and-sum (``jnp.sum(x[..., :, None] * w.astype(float32), -2)``, or over the last axis
  of a transposed matrix), which XLA fuses with the widening into one kernel without a copy,
  runs that kernel slower still (docs/performance.md, "bfloat16 products").

  Args:
    x: ``(..., k)`` activations, any float dtype (cast to ``dtype`` first, as ``promote_dtype``
      does).
    matrix: a bfloat16 ``(k, n)`` kernel (``contract=0``) or ``(n, k)`` table (``contract=1``,
      a tied unembedding).
    contract: the axis of ``matrix`` contracted with ``x``'s last.
    dtype: the product's dtype, bfloat16 or float32.
    precision: ``dot_general``'s (none matters on CPU).

  Returns:
    ``(..., n)`` in ``dtype``.
  """
  x = jnp.asarray(x).astype(dtype).astype(jnp.float32)
  axis = 1 - contract  # the matrix's output axis
  k, n = matrix.shape[contract], matrix.shape[axis]
  per = _chunk_columns(k, x.size // max(k, 1))
  dims = (((x.ndim - 1,), (contract,)), ((), ()))

  # A float32 zero computed from x (zero where x is NaN too): added to each widened chunk, it
  # makes the chunk's widening wait for x. XLA on CPU drops optimization barriers before it
  # schedules the program, and would otherwise widen every layer's first chunk at the start.
  first = jax.lax.stop_gradient(x.reshape(-1)[:1])
  zero = (first != first).astype(jnp.float32)[0] * 0

  def product(m, start, size):
    part = m if size == n else jax.lax.dynamic_slice_in_dim(m, start, size, axis=axis)
    y = jax.lax.dot_general(x, part.astype(jnp.float32) + zero, dims, precision=precision)
    return y.astype(dtype)

  if n <= per:
    return product(_pinned(matrix, x), 0, n)
  chunks = n // per
  # The chunks are written into the result in place. A bfloat16 result is written as its bits
  # (uint16): XLA on CPU computes a bfloat16 update in float32, rewriting the whole result for
  # every chunk (for 512 tokens of a 128k vocabulary, 131 MB per chunk).
  bits = jnp.dtype(dtype) == jnp.bfloat16

  def stored(y):
    return jax.lax.bitcast_convert_type(y, jnp.uint16) if bits else y

  def body(j, y):
    start = j * per
    return jax.lax.dynamic_update_slice_in_dim(
      y, stored(product(_pinned(matrix, j), start, per)), start, axis=-1
    )

  # The result starts as the first chunk's product padded: a result of zeros, which depends on
  # nothing, would be allocated at the start of the program, every layer's at once.
  head = stored(product(_pinned(matrix, x), 0, per))
  y = jnp.pad(head, [(0, 0)] * (head.ndim - 1) + [(0, n - per)])
  y = jax.lax.fori_loop(1, chunks, body, y)
  if chunks * per < n:
    start = chunks * per
    tail = product(_pinned(matrix, y), start, n - start)
    y = jax.lax.dynamic_update_slice_in_dim(y, stored(tail), start, axis=-1)
  return jax.lax.bitcast_convert_type(y, jnp.bfloat16) if bits else y


def is_compact(x) -> bool:
  """Whether ``x`` is a compact matrix (:class:`Int8Rows`, :class:`Blocks` or :class:`Rows`)."""
  return isinstance(x, _COMPACT)


def dequantize(params, dtype=jnp.float32):
  """``params`` with every compact matrix replaced by the float array it stands for (a kernel
  transposed back to ``(in, out)``). The float32 twin of a compact model, for checks."""

  def one(path, x):
    if not is_compact(x):
      return x
    w = x.matrix(dtype)
    return w.T if getattr(path[-1], "key", None) == "kernel" else w

  return jax.tree_util.tree_map_with_path(one, params, is_leaf=is_compact)


class Dense(StoredParams, nn.Dense):
  """``flax.linen.Dense`` that also takes a compact kernel (``params[...]["kernel"]`` an
  :class:`Int8Rows` or :class:`Blocks` of shape ``(features, in)``). With a float kernel it
  computes what ``nn.Dense`` computes. Stored parameters are read directly
  (:class:`~jaxlens.models._params.StoredParams`)."""

  @nn.compact
  def __call__(self, inputs):
    stored = (
      self.get_variable("params", "kernel") if self.has_variable("params", "kernel") else None
    )
    if is_compact(stored):
      dtype = self.dtype or jnp.result_type(inputs)
      (inputs,) = promote_dtype(inputs, dtype=dtype)
      y = times_transpose(stored, inputs, dtype)
    else:
      kernel = self.param(
        "kernel", self.kernel_init, (jnp.shape(inputs)[-1], self.features), self.param_dtype
      )
      dtype = self.dtype or jnp.result_type(inputs, kernel)
      if widens(kernel, dtype):
        y = times_wide(inputs, kernel, 0, dtype, self.precision)
      else:
        inputs, kernel = promote_dtype(inputs, kernel, dtype=self.dtype)
        y = jax.lax.dot_general(
          inputs, kernel, (((inputs.ndim - 1,), (0,)), ((), ())), precision=self.precision
        )
    if self.use_bias:
      bias = self.param("bias", self.bias_init, (self.features,), self.param_dtype)
      y = y + jnp.reshape(bias, (1,) * (y.ndim - 1) + (-1,)).astype(y.dtype)
    return y


class Embed(StoredParams, nn.Module):
  """``flax.linen.Embed`` (the same parameter, ``embedding``, and the same ``__call__`` /
  ``attend``) that also takes a compact table (:class:`Int8Rows` or :class:`Blocks` of shape
  ``(num_embeddings, features)``). A stored table is read directly (``StoredParams``)."""

  num_embeddings: int
  features: int
  dtype: Any = None
  param_dtype: Any = jnp.float32
  embedding_init: Any = nn.initializers.normal(stddev=1.0)

  def setup(self):
    stored = None
    if self.has_variable("params", "embedding"):
      stored = self.get_variable("params", "embedding")
    if is_compact(stored):
      self.embedding = stored
    else:
      self.embedding = self.param(
        "embedding", self.embedding_init, (self.num_embeddings, self.features), self.param_dtype
      )

  def __call__(self, inputs):
    if not jnp.issubdtype(jnp.result_type(inputs), jnp.integer):
      raise ValueError("Input type must be an integer or unsigned integer.")
    if is_compact(self.embedding):
      return self.embedding.rows(inputs, self.dtype or jnp.float32)
    embedding = self.embedding
    if jnp.dtype(embedding.dtype) == jnp.bfloat16:
      # The gather widens only the rows it reads, unless XLA widens the table whole, which it
      # does ahead of a loop (jl.generate's) that the table is invariant in.
      embedding = _pinned(embedding, inputs)
    (embedding,) = promote_dtype(embedding, dtype=self.dtype, inexact=False)
    return jnp.take(embedding, inputs, axis=0)

  def attend(self, query):
    """``query @ embedding.T``: the tied unembedding."""
    if is_compact(self.embedding):
      dtype = self.dtype or jnp.result_type(query)
      (query,) = promote_dtype(query, dtype=dtype)
      return times_transpose(self.embedding, query, dtype)
    dtype = self.dtype or jnp.result_type(query, self.embedding)
    if widens(self.embedding, dtype):
      return times_wide(query, self.embedding, 1, dtype)
    query, embedding = promote_dtype(query, self.embedding, dtype=self.dtype)
    return _times_rows(query, embedding)


# ------------------------------------------------------------------------------ conversion


def _int8_rows(matrix) -> Int8Rows:
  m = np.asarray(matrix, np.float32)
  scale = np.abs(m).max(axis=1) / 127.0
  scale = np.where(scale == 0, 1.0, scale).astype(np.float32)
  values = np.clip(np.rint(m / scale[:, None]), -127, 127).astype(np.int8)
  return Int8Rows(jnp.asarray(values), jnp.asarray(scale))


def _compactable(path) -> str | None:
  """``"kernel"`` / ``"embedding"`` for the matrices a compact load converts (every dense
  kernel and the token embedding; norms, biases and learned positions stay float)."""
  name = getattr(path[-1], "key", None)
  if name == "kernel":
    return "kernel"
  if name == "embedding" and getattr(path[-2], "key", None) == "embed":
    return "embedding"
  return None


def compact_params(params, weights: str):
  """``params`` with its dense kernels and token embedding converted to ``weights``.

  Args:
    params: a zoo model's float params (``variables["params"]``).
    weights: ``"float32"`` (unchanged), ``"bfloat16"`` (bfloat16 arrays, cast back to the
      model's dtype in each product), ``"int8"`` (:class:`Int8Rows`, a scale per output
      channel / per token), ``"rows"`` (the float kernels as :class:`Rows`:
      :func:`rows_params`).

  Raises:
    InvalidArgumentError: ``invalid_argument`` for another ``weights``.
  """
  if weights not in ("float32", "bfloat16", "int8", "rows"):
    raise InvalidArgumentError(
      f"weights={weights!r} is not a compact form for float params",
      code="invalid_argument",
      expected=["float32", "bfloat16", "int8", "rows"],
      received=weights,
      fix='weights="int8", "bfloat16" or "rows" (weights="gguf" only when loading a GGUF file)',
    )
  if weights == "float32":
    return params
  if weights == "rows":
    return rows_params(params)

  def one(path, x):
    kind = _compactable(path)
    if kind is None or is_compact(x) or jnp.ndim(x) != 2:
      return x
    if weights == "bfloat16":
      return jnp.asarray(x, jnp.bfloat16)
    return _int8_rows(np.asarray(x, np.float32).T if kind == "kernel" else x)

  return jax.tree_util.tree_map_with_path(one, params, is_leaf=is_compact)


def rows_params(params):
  """``params`` with every float dense kernel ``(in, out)`` kept as :class:`Rows` ``(out, in)``
  in its own dtype (the layout for decoding on CPU: see the module's docstring); compact
  matrices, embeddings, norms and biases stay as they are. :func:`dequantize` turns it back.
  Each kernel is copied once; ``load_hf(..., layout="rows")`` reads a checkpoint's rows
  without the copy.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from jaxlens.models import Llama, LlamaConfig, compact
    >>> cfg = LlamaConfig(vocab_size=11, d_model=8, n_layers=1, n_heads=2, n_kv_heads=1, d_mlp=12)
    >>> model, tokens = Llama(cfg), jnp.asarray([[1, 2, 3]])
    >>> variables = model.init(jax.random.key(0), tokens)
    >>> rows = {"params": compact.rows_params(variables["params"])}
    >>> rows["params"]["blocks_0"]["mlp"]["up_proj"]["kernel"].shape  # (out, in)
    (12, 8)
    >>> bool(jnp.allclose(model.apply(rows, tokens), model.apply(variables, tokens), atol=1e-6))
    True
  """

  def one(path, x):
    if _compactable(path) != "kernel" or is_compact(x) or jnp.ndim(x) != 2:
      return x
    return Rows(jnp.asarray(np.ascontiguousarray(np.asarray(x).T)))

  return jax.tree_util.tree_map_with_path(one, params, is_leaf=is_compact)


# GGUF block layouts (ggml's): bytes per block of 32 values.
_Q8_0, _Q4_1 = 34, 20


def blocks_from_gguf(data, kind: str, shape) -> Blocks:
  """A :class:`Blocks` matrix from a GGUF tensor's raw bytes.

  Args:
    data: the tensor's bytes, ``uint8`` of shape ``(rows, bytes per row)`` (``t.data`` of a
      ``gguf.GGUFReader`` tensor).
    kind: ``"Q8_0"`` (per block: a float16 scale, 32 int8 values) or ``"Q4_1"`` (a float16
      scale, a float16 minimum, 32 4-bit values packed low nibbles first).
    shape: the matrix's ``(rows, cols)``.
  """
  rows, cols = (int(d) for d in shape)
  raw = np.asarray(data, np.uint8).reshape(rows, cols // 32, -1)
  if kind == "Q8_0" and raw.shape[-1] == _Q8_0:
    scale = raw[..., :2].copy().view(np.float16)[..., 0].astype(np.float32)
    values = raw[..., 2:].copy().view(np.int8)
    return Blocks(jnp.asarray(values), jnp.asarray(scale))
  if kind == "Q4_1" and raw.shape[-1] == _Q4_1:
    scale = raw[..., :2].copy().view(np.float16)[..., 0].astype(np.float32)
    offset = raw[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    packed = raw[..., 4:]
    values = np.concatenate([packed & 0xF, packed >> 4], axis=-1).astype(np.int8)
    return Blocks(jnp.asarray(values), jnp.asarray(scale), jnp.asarray(offset))
  raise InvalidArgumentError(
    f"GGUF blocks of type {kind} ({raw.shape[-1]} bytes per block) are not kept compact",
    code="invalid_argument",
    received=kind,
    expected=["Q8_0", "Q4_1"],
    fix='load with weights="int8" (from the dequantised weights) or the default float32',
  )


_GGUF_PATHS = {
  "attn_q": ("attn", "q_proj"),
  "attn_k": ("attn", "k_proj"),
  "attn_v": ("attn", "v_proj"),
  "attn_output": ("attn", "o_proj"),
  "ffn_gate": ("mlp", "gate_proj"),
  "ffn_up": ("mlp", "up_proj"),
  "ffn_down": ("mlp", "down_proj"),
}


def _unpermute_rows(a, n_heads):
  """llama.cpp's q/k row permutation undone (``loading._unpermute``) on the rows of any array."""
  rows = a.shape[0]
  return a.reshape(n_heads, rows // n_heads // 2, 2, *a.shape[1:]).swapaxes(1, 2).reshape(a.shape)


def gguf_params(params, tensors, config):
  """``params`` (the float load of a Llama GGUF file) with each Q8_0 / Q4_1 matrix replaced by
  its own blocks (:func:`blocks_from_gguf`); other tensors stay as loaded.

  Args:
    params: the zoo params the float load built from the same file.
    tensors: GGUF tensor name -> ``gguf.ReaderTensor``.
    config: the ``LlamaConfig``.
  """
  params = jax.tree.map(lambda x: x, params, is_leaf=is_compact)  # a copy of the dicts
  targets = {"token_embd.weight": ("embed", "embedding"), "output.weight": ("lm_head", "kernel")}
  for i in range(config.n_layers):
    for g, path in _GGUF_PATHS.items():
      targets[f"blk.{i}.{g}.weight"] = (f"blocks_{i}", *path, "kernel")
  for name, path in targets.items():
    t = tensors.get(name)
    if t is None or t.tensor_type.name not in ("Q8_0", "Q4_1"):
      continue
    shape = tuple(int(d) for d in reversed(t.shape))  # (rows, cols): GGUF lists cols first
    m = blocks_from_gguf(t.data, t.tensor_type.name, shape)
    heads = {"attn_q": config.n_heads, "attn_k": config.n_kv_heads}.get(name.split(".")[-2])
    if heads is not None:
      m = jax.tree.map(lambda a, h=heads: jnp.asarray(_unpermute_rows(np.asarray(a), h)), m)
    node = params
    for p in path[:-1]:
      node = node[p]
    node[path[-1]] = m
  return params
