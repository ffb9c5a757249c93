"""One table: ATen operator -> the JAX function computing it.

:data:`ATEN` maps the operator's name as ``str(node.target)`` prints it (``"aten.add.Tensor"``)
to a function of the node's evaluated arguments. Arguments arrive as torch wrote them, with
tensors replaced by JAX arrays and ``torch.dtype`` values by JAX dtypes; the converter casts
every tensor result to the dtype torch recorded for the node, so the functions here need not
reproduce torch's type promotion. Matrix products and convolutions run at
``Precision.HIGHEST`` (exact float32, as torch's CPU kernels).

Operators that depend on the interpreter (parameters, submodule calls, attention
probabilities as a site) are not here; see :mod:`torch_bridge.convert._export`.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

__all__ = ["ATEN", "sdpa_logits"]

HI = lax.Precision.HIGHEST


def _dim(x, d: int) -> int:
  return d % max(x.ndim, 1)


def _dims(x, dims) -> tuple[int, ...]:
  if dims is None or (isinstance(dims, (list, tuple)) and len(dims) == 0):
    return tuple(range(x.ndim))
  if isinstance(dims, int):
    dims = [dims]
  return tuple(_dim(x, d) for d in dims)


def _shape(x, sizes) -> tuple[int, ...]:
  return tuple(int(s) for s in sizes)


# -- creation ---------------------------------------------------------------


def _full(shape, value, dtype=None):
  return jnp.full(tuple(int(s) for s in shape), value, dtype=dtype or jnp.result_type(value))


def _arange(*args, dtype=None, **_):
  args = [a for a in args]
  start, end, step = (0, args[0], 1) if len(args) == 1 else (args + [1])[:3]
  return jnp.arange(start, end, step, dtype=dtype)


# -- shapes -----------------------------------------------------------------


def _expand(x, sizes, implicit=False):
  sizes = list(sizes)
  lead = len(sizes) - x.ndim
  shape = [x.shape[i - lead] if (s == -1 and i >= lead) else s for i, s in enumerate(sizes)]
  return jnp.broadcast_to(x, tuple(int(s) for s in shape))


def _slice(x, dim=0, start=None, end=None, step=1):
  idx = [slice(None)] * x.ndim
  idx[_dim(x, dim)] = slice(start, end, step)
  return x[tuple(idx)]


def _select(x, dim, index):
  return jnp.take(x, index, axis=_dim(x, dim))


def _squeeze(x, dims=None):
  dims = _dims(x, dims)
  return jnp.squeeze(x, tuple(d for d in dims if x.shape[d] == 1))


def _flatten(x, start=0, end=-1):
  if x.ndim == 0:
    return x.reshape(1)
  s, e = _dim(x, start), _dim(x, end)
  return x.reshape(x.shape[:s] + (-1,) + x.shape[e + 1 :])


def _unflatten(x, dim, sizes):
  d = _dim(x, dim)
  return x.reshape(x.shape[:d] + tuple(sizes) + x.shape[d + 1 :])


def _split(x, split_size, dim=0):
  d = _dim(x, dim)
  n = x.shape[d]
  edges = list(range(split_size, n, split_size)) if split_size else []
  return jnp.split(x, edges, axis=d)


def _split_with_sizes(x, sizes, dim=0):
  d = _dim(x, dim)
  edges, total = [], 0
  for s in sizes[:-1]:
    total += s
    edges.append(total)
  return jnp.split(x, edges, axis=d)


def _unbind(x, dim=0):
  d = _dim(x, dim)
  return [jnp.take(x, i, axis=d) for i in range(x.shape[d])]


def _chunk(x, chunks, dim=0):
  d = _dim(x, dim)
  return _split(x, -(-x.shape[d] // chunks), d)


def _index(x, indices):
  idx = tuple(slice(None) if i is None else i for i in indices)
  return x[idx]


def _index_put(x, indices, values, accumulate=False):
  idx = tuple(slice(None) if i is None else i for i in indices)
  return x.at[idx].add(values) if accumulate else x.at[idx].set(values)


def _select_scatter(x, src, dim, index):
  idx = [slice(None)] * x.ndim
  idx[_dim(x, dim)] = index
  return x.at[tuple(idx)].set(src.astype(x.dtype))


def _slice_scatter(x, src, dim=0, start=None, end=None, step=1):
  idx = [slice(None)] * x.ndim
  idx[_dim(x, dim)] = slice(start, end, step)
  return x.at[tuple(idx)].set(src.astype(x.dtype))


def _copy(x, src, non_blocking=False):
  return jnp.broadcast_to(jnp.asarray(src).astype(x.dtype), x.shape)


def _diff(x, n=1, dim=-1, prepend=None, append=None):
  return jnp.diff(x, n=n, axis=dim, prepend=prepend, append=append)


def _roll(x, shifts, dims=()):
  if not dims:
    return jnp.roll(x.reshape(-1), shifts).reshape(x.shape)
  return jnp.roll(x, shifts, axis=tuple(dims))


def _repeat(x, repeats):
  repeats = tuple(repeats)
  x = x.reshape((1,) * (len(repeats) - x.ndim) + x.shape)
  return jnp.tile(x, repeats)


# -- reductions ---------------------------------------------------------------


def _mean(x, dims=None, keepdim=False, dtype=None):
  return jnp.mean(x, axis=_dims(x, dims), keepdims=keepdim, dtype=dtype)


def _sum(x, dims=None, keepdim=False, dtype=None):
  return jnp.sum(x, axis=_dims(x, dims), keepdims=keepdim, dtype=dtype)


def _var(x, dims=None, correction=1, keepdim=False, unbiased=None):
  if unbiased is not None:
    correction = 1 if unbiased else 0
  return jnp.var(
    x, axis=_dims(x, dims), ddof=1 if correction is None else correction, keepdims=keepdim
  )


def _max_dim(x, dim, keepdim=False):
  return (jnp.max(x, axis=dim, keepdims=keepdim), jnp.argmax(x, axis=dim, keepdims=keepdim))


def _min_dim(x, dim, keepdim=False):
  return (jnp.min(x, axis=dim, keepdims=keepdim), jnp.argmin(x, axis=dim, keepdims=keepdim))


def _topk(x, k, dim=-1, largest=True, sorted=True):
  """``torch.topk``: the ``k`` largest (or smallest) along ``dim`` and their indices, best
  first (also for ``sorted=False``, which leaves the order to the implementation). Equal values:
  the lower index first."""
  del sorted
  x = jnp.moveaxis(x, dim, -1)
  values, index = jax.lax.top_k(x if largest else -x, k)
  values = values if largest else -values
  return jnp.moveaxis(values, -1, dim), jnp.moveaxis(index, -1, dim)


# -- elementwise --------------------------------------------------------------


def _add(a, b, alpha=1):
  return a + b * alpha if alpha != 1 else a + b


def _sub(a, b, alpha=1):
  return a - b * alpha if alpha != 1 else a - b


def _div(a, b, rounding_mode=None):
  if rounding_mode == "floor":
    return jnp.floor_divide(a, b) if _is_int(a) and _is_int(b) else jnp.floor(a / b)
  if rounding_mode == "trunc":
    return jnp.trunc(a / b)
  return jnp.true_divide(a, b)


def _is_int(a) -> bool:
  return isinstance(a, int) or jnp.issubdtype(jnp.result_type(a), jnp.integer)


def _gelu(x, approximate="none"):
  return jax.nn.gelu(x, approximate=approximate == "tanh")


def _softplus(x, beta=1, threshold=20):
  bx = x * beta
  return jnp.where(bx > threshold, x, jnp.log1p(jnp.exp(bx)) / beta)


def _clamp(x, lo=None, hi=None):
  if lo is not None:
    x = jnp.maximum(x, lo)
  if hi is not None:
    x = jnp.minimum(x, hi)
  return x


def _where_scalar(cond, a, b):
  return jnp.where(cond, a, b)


def _masked_fill(x, mask, value):
  return jnp.where(mask, jnp.asarray(value, x.dtype), x)


# -- linear algebra -------------------------------------------------------------


def _matmul(a, b):
  return jnp.matmul(a, b, precision=HI)


def _times_rows(x, w):
  """``x @ w.T`` for a weight ``w`` of shape (out, in), read as stored: one contraction of the
  last axes of both. A ``w.T`` in the program is a transpose that XLA without its optimising
  passes copies on every call (as jaxlens.models does for a tied unembedding)."""
  return jnp.einsum("...i,oi->...o", x, w, precision=HI)


def _linear(x, w, b=None):
  y = _times_rows(x, w) if w.ndim == 2 else jnp.matmul(x, w, precision=HI)
  return y if b is None else y + b


def _addmm(bias, a, b, beta=1, alpha=1):
  y = jnp.matmul(a, b, precision=HI)
  return beta * bias + alpha * y if (beta != 1 or alpha != 1) else bias + y


def _baddbmm(bias, a, b, beta=1, alpha=1):
  return beta * bias + alpha * jnp.matmul(a, b, precision=HI)


def _einsum(equation, tensors, path=None):
  return jnp.einsum(equation, *tensors, precision=HI)


# -- neural network layers ------------------------------------------------------


_SPATIAL = {1: "H", 2: "HW", 3: "DHW"}


def _conv(x, w, b=None, stride=1, padding=0, dilation=1, groups=1):
  n = w.ndim - 2
  unbatched = x.ndim == n + 1
  if unbatched:
    x = x[None]
  expand = lambda v: tuple(v) * n if len(tuple(v)) == 1 else tuple(v)
  stride, dilation = expand(_listify(stride)), expand(_listify(dilation))
  if isinstance(padding, str):
    if padding == "valid":
      pad = [(0, 0)] * n
    else:  # "same": torch pads d*(k-1) in total, the odd one at the end
      totals = [d * (k - 1) for d, k in zip(dilation, w.shape[2:])]
      pad = [(t // 2, t - t // 2) for t in totals]
  else:
    pad = [(p, p) for p in expand(_listify(padding))]
  sp = _SPATIAL[n]
  dn = lax.conv_dimension_numbers(x.shape, w.shape, ("NC" + sp, "OI" + sp, "NC" + sp))
  y = lax.conv_general_dilated(
    x,
    w,
    stride,
    pad,
    rhs_dilation=dilation,
    dimension_numbers=dn,
    feature_group_count=groups,
    precision=HI,
  )
  if b is not None:
    y = y + b.reshape((-1,) + (1,) * n)
  return y[0] if unbatched else y


def _listify(v):
  return list(v) if isinstance(v, (list, tuple)) else [v]


def _convolution(x, w, b, stride, padding, dilation, transposed, output_padding, groups):
  if transposed:
    return _conv_transpose(x, w, b, stride, padding, output_padding, groups, dilation)
  return _conv(x, w, b, stride, padding, dilation, groups)


def _conv_transpose(x, w, b=None, stride=1, padding=0, output_padding=0, groups=1, dilation=1):
  n = w.ndim - 2
  unbatched = x.ndim == n + 1
  if unbatched:
    x = x[None]
  expand = lambda v: tuple(v) * n if len(tuple(v)) == 1 else tuple(v)
  stride, padding = expand(_listify(stride)), expand(_listify(padding))
  output_padding, dilation = expand(_listify(output_padding)), expand(_listify(dilation))
  # torch weight (in, out/groups, *k) -> (out, in/groups, *k), spatially flipped.
  cin, cout_g = w.shape[0], w.shape[1]
  w = w.reshape((groups, cin // groups, cout_g) + w.shape[2:])
  w = jnp.swapaxes(w, 1, 2).reshape((groups * cout_g, cin // groups) + w.shape[3:])
  w = jnp.flip(w, axis=tuple(range(2, n + 2)))
  pad = [
    (d * (k - 1) - p, d * (k - 1) - p + op)
    for d, k, p, op in zip(dilation, w.shape[2:], padding, output_padding)
  ]
  sp = _SPATIAL[n]
  dn = lax.conv_dimension_numbers(x.shape, w.shape, ("NC" + sp, "OI" + sp, "NC" + sp))
  y = lax.conv_general_dilated(
    x,
    w,
    (1,) * n,
    pad,
    lhs_dilation=stride,
    rhs_dilation=dilation,
    dimension_numbers=dn,
    feature_group_count=groups,
    precision=HI,
  )
  if b is not None:
    y = y + b.reshape((-1,) + (1,) * n)
  return y[0] if unbatched else y


def _pool_pads(size, k, s, p, d, ceil_mode):
  out = (size + 2 * p - d * (k - 1) - 1) / s + 1
  out = math.ceil(out) if ceil_mode else math.floor(out)
  if ceil_mode and (out - 1) * s >= size + p:  # the last window must start inside
    out -= 1
  high = max((out - 1) * s + d * (k - 1) + 1 - size - p, 0)
  return (p, high)


def _max_pool(n):
  def pool(x, kernel_size, stride=(), padding=0, dilation=1, ceil_mode=False):
    unbatched = x.ndim == n + 1
    if unbatched:
      x = x[None]
    expand = lambda v: tuple(v) * n if len(tuple(v)) == 1 else tuple(v)
    k = expand(_listify(kernel_size))
    s = expand(_listify(stride)) if _listify(stride) else k
    p, d = expand(_listify(padding)), expand(_listify(dilation))
    pads = [_pool_pads(x.shape[2 + i], k[i], s[i], p[i], d[i], ceil_mode) for i in range(n)]
    # A Python scalar init: JAX differentiates reduce_window only for its known monoids.
    init = -float("inf") if jnp.issubdtype(x.dtype, jnp.floating) else int(jnp.iinfo(x.dtype).min)
    y = lax.reduce_window(
      x, init, lax.max, (1, 1) + k, (1, 1) + s, [(0, 0), (0, 0)] + pads, window_dilation=(1, 1) + d
    )
    return y[0] if unbatched else y

  return pool


def _avg_pool(n):
  def pool(
    x,
    kernel_size,
    stride=(),
    padding=0,
    ceil_mode=False,
    count_include_pad=True,
    divisor_override=None,
  ):
    unbatched = x.ndim == n + 1
    if unbatched:
      x = x[None]
    expand = lambda v: tuple(v) * n if len(tuple(v)) == 1 else tuple(v)
    k = expand(_listify(kernel_size))
    s = expand(_listify(stride)) if _listify(stride) else k
    p = expand(_listify(padding))
    pads = [(0, 0), (0, 0)] + [
      _pool_pads(x.shape[2 + i], k[i], s[i], p[i], 1, ceil_mode) for i in range(n)
    ]
    total = lax.reduce_window(x, 0.0, lax.add, (1, 1) + k, (1, 1) + s, pads)
    if divisor_override:
      y = total / divisor_override
    elif count_include_pad:  # padding counts, the ceil-mode overhang does not
      sym = [(0, 0), (0, 0)] + [(p[i], p[i]) for i in range(n)]
      ones = jnp.pad(jnp.ones(x.shape[2:], x.dtype), sym[2:], constant_values=1)
      ones = jnp.pad(ones, [(0, pads[2 + i][1] - p[i]) for i in range(n)])
      cnt = lax.reduce_window(
        ones[None, None],
        jnp.asarray(0, x.dtype),
        lax.add,
        (1, 1) + k,
        (1, 1) + s,
        [(0, 0)] * (n + 2),
      )
      y = total / cnt
    else:
      cnt = lax.reduce_window(
        jnp.ones((1, 1) + x.shape[2:], x.dtype),
        jnp.asarray(0, x.dtype),
        lax.add,
        (1, 1) + k,
        (1, 1) + s,
        pads,
      )
      y = total / cnt
    return y[0] if unbatched else y

  return pool


def _adaptive_avg_pool(n):
  def pool(x, output_size):
    out = tuple(_listify(output_size))
    out = out * n if len(out) == 1 else out
    lead = x.ndim - n
    y = x
    for i in range(n):
      axis = lead + i
      size, o = x.shape[axis], out[i]
      if o is None:
        continue
      parts = []
      for j in range(o):
        start, end = (j * size) // o, -(-((j + 1) * size) // o)
        parts.append(jnp.mean(lax.slice_in_dim(y, start, end, axis=axis), axis=axis, keepdims=True))
      y = jnp.concatenate(parts, axis=axis)
    return y

  return pool


def _layer_norm(x, shape, w=None, b=None, eps=1e-5, cudnn=True):
  axes = tuple(range(x.ndim - len(shape), x.ndim))
  mean = jnp.mean(x, axis=axes, keepdims=True)
  c = x - mean
  var = jnp.mean(jnp.square(c), axis=axes, keepdims=True)
  y = c * lax.rsqrt(var + eps)
  if w is not None:
    y = y * w
  if b is not None:
    y = y + b
  return y


def _native_layer_norm(x, shape, w, b, eps):
  axes = tuple(range(x.ndim - len(shape), x.ndim))
  mean = jnp.mean(x, axis=axes, keepdims=True)
  rstd = lax.rsqrt(jnp.var(x, axis=axes, keepdims=True) + eps)
  return (_layer_norm(x, shape, w, b, eps), mean, rstd)


def _bn_eval(x, w, b, mean, var, eps):
  shape = (1, -1) + (1,) * (x.ndim - 2)
  y = (x - mean.reshape(shape)) * lax.rsqrt(var.reshape(shape) + eps)
  if w is not None:
    y = y * w.reshape(shape)
  if b is not None:
    y = y + b.reshape(shape)
  return y


def _batch_norm_no_training(x, w, b, mean, var, momentum, eps):
  return (_bn_eval(x, w, b, mean, var, eps), jnp.zeros((0,), x.dtype), jnp.zeros((0,), x.dtype))


def _batch_norm(x, w, b, mean, var, training, momentum, eps, cudnn=True):
  if training or mean is None:
    raise NotImplementedError("batch_norm in training mode")
  return _bn_eval(x, w, b, mean, var, eps)


def _group_norm(x, groups, w=None, b=None, eps=1e-5):
  n, c = x.shape[:2]
  g = x.reshape((n, groups, -1))
  mean = jnp.mean(g, axis=-1, keepdims=True)
  var = jnp.mean(jnp.square(g - mean), axis=-1, keepdims=True)
  y = ((g - mean) * lax.rsqrt(var + eps)).reshape(x.shape)
  shape = (1, c) + (1,) * (x.ndim - 2)
  if w is not None:
    y = y * w.reshape(shape)
  if b is not None:
    y = y + b.reshape(shape)
  return y


def _embedding(w, idx, padding_idx=-1, scale_grad_by_freq=False, sparse=False):
  rows = jnp.take(w, idx, axis=0)
  if padding_idx < 0 and not scale_grad_by_freq:
    return rows
  # torch's backward gives the padding row no gradient and, with scale_grad_by_freq, divides
  # each row's gradient by its count in the batch. (rows - stop_gradient(rows)) is exactly zero,
  # so the forward value is unchanged and only the gradient is scaled.
  factor = jnp.ones(idx.shape, w.dtype)
  if padding_idx >= 0:
    factor = jnp.where(idx == padding_idx, 0, factor).astype(w.dtype)
  if scale_grad_by_freq:
    counts = jnp.zeros((w.shape[0],), w.dtype).at[idx.reshape(-1)].add(1)
    factor = factor / jnp.take(counts, idx)
  fixed = lax.stop_gradient(rows)
  return fixed + (rows - fixed) * factor[..., None]


def _softmax(x, dim, half_to_float=False):
  return jax.nn.softmax(x, axis=dim)


def _log_softmax(x, dim, half_to_float=False):
  return jax.nn.log_softmax(x, axis=dim)


def sdpa_logits(
  q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False
):
  """The masked, scaled attention logits of ``scaled_dot_product_attention``, and ``v``."""
  if dropout_p:
    raise NotImplementedError("scaled_dot_product_attention with dropout_p > 0")
  if enable_gqa and q.ndim >= 3 and k.shape[-3] != q.shape[-3]:
    rep = q.shape[-3] // k.shape[-3]
    k = jnp.repeat(k, rep, axis=-3)
    v = jnp.repeat(v, rep, axis=-3)
  scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
  logits = jnp.matmul(q, jnp.swapaxes(k, -1, -2), precision=HI) * jnp.asarray(scale, q.dtype)
  L, S = q.shape[-2], k.shape[-2]
  if is_causal:
    logits = jnp.where(jnp.tril(jnp.ones((L, S), bool)), logits, -jnp.inf)
  if attn_mask is not None:
    if attn_mask.dtype == jnp.bool_:
      logits = jnp.where(attn_mask, logits, -jnp.inf)
    else:
      logits = logits + attn_mask
  return logits, v


def _sdpa(q, k, v, *args, **kwargs):
  logits, v = sdpa_logits(q, k, v, *args, **kwargs)
  return jnp.matmul(jax.nn.softmax(logits, axis=-1), v, precision=HI)


# -- recurrent layers -------------------------------------------------------------


def _rnn(cell, n_state):
  """aten.lstm.input / aten.gru.input: a stack of (bi)directional layers over lax.scan."""

  def run(x, hx, params, has_biases, num_layers, dropout, train, bidirectional, batch_first):
    if train and dropout:
      raise NotImplementedError("recurrent dropout in training mode")
    if not isinstance(hx, (list, tuple)):  # GRU passes its one state as a tensor
      hx = [hx]
    dirs = 2 if bidirectional else 1
    per = 4 if has_biases else 2
    if len(params) != num_layers * dirs * per:
      raise NotImplementedError("LSTM proj_size")
    unbatched = x.ndim == 2
    if unbatched:
      x = x[:, None] if not batch_first else x[None]
      hx = [h[:, None] for h in hx]
    seq = jnp.swapaxes(x, 0, 1) if batch_first else x  # (time, batch, features)
    finals = [[] for _ in range(n_state)]
    for layer in range(num_layers):
      outs = []
      for d in range(dirs):
        i = layer * dirs + d
        w = params[i * per : (i + 1) * per]
        w_ih, w_hh = w[0], w[1]
        b_ih, b_hh = (w[2], w[3]) if has_biases else (None, None)
        state = tuple(h[i] for h in hx)
        xs = seq[::-1] if d == 1 else seq
        pre = _times_rows(xs, w_ih)
        if b_ih is not None:
          pre = pre + b_ih

        def step(carry, p, w_hh=w_hh, b_hh=b_hh):
          carry = cell(carry, p, w_hh, b_hh)
          return carry, carry[0]

        state, ys = lax.scan(step, state, pre)
        outs.append(ys[::-1] if d == 1 else ys)
        for j in range(n_state):
          finals[j].append(state[j])
      seq = jnp.concatenate(outs, axis=-1) if dirs == 2 else outs[0]
    out = jnp.swapaxes(seq, 0, 1) if batch_first else seq
    states = [jnp.stack(f) for f in finals]
    if unbatched:
      out = out[0] if batch_first else out[:, 0]
      states = [s[:, 0] for s in states]
    return (out, *states)

  return run


def _lstm_cell(carry, pre, w_hh, b_hh):
  h, c = carry
  g = pre + _times_rows(h, w_hh)
  if b_hh is not None:
    g = g + b_hh
  i, f, gg, o = jnp.split(g, 4, axis=-1)
  c = jax.nn.sigmoid(f) * c + jax.nn.sigmoid(i) * jnp.tanh(gg)
  h = jax.nn.sigmoid(o) * jnp.tanh(c)
  return (h, c)


def _gru_cell(carry, pre, w_hh, b_hh):
  (h,) = carry
  gh = _times_rows(h, w_hh)
  if b_hh is not None:
    gh = gh + b_hh
  xr, xz, xn = jnp.split(pre, 3, axis=-1)
  hr, hz, hn = jnp.split(gh, 3, axis=-1)
  r = jax.nn.sigmoid(xr + hr)
  z = jax.nn.sigmoid(xz + hz)
  n = jnp.tanh(xn + r * hn)
  return ((1 - z) * n + z * h,)


def _identity(x, *args, **kwargs):
  return x


def _none(*args, **kwargs):
  return None


def _dropout(x, p, train):
  if train and p:
    raise NotImplementedError("dropout in training mode")
  return x


def _cast(x, *args, dtype=None, **kwargs):
  for a in args:  # to.dtype(x, dtype, ...) passes the dtype positionally
    if isinstance(a, jnp.dtype) or (isinstance(a, type) and issubclass(a, jnp.generic)):
      dtype = a
      break
  return x if dtype is None else x.astype(dtype)


def _like(fill):
  def make(x, *args, dtype=None, **kwargs):
    return jnp.full(x.shape, fill, dtype=dtype or x.dtype)

  return make


def _new(fill):
  def make(x, size, *args, dtype=None, **kwargs):
    return jnp.full(tuple(size), fill, dtype=dtype or x.dtype)

  return make


ATEN: dict[str, Callable[..., Any]] = {
  # creation
  "aten.arange.default": _arange,
  "aten.arange.start": _arange,
  "aten.arange.start_step": _arange,
  "aten.zeros.default": lambda size, dtype=None, **_: jnp.zeros(tuple(size), dtype),
  "aten.ones.default": lambda size, dtype=None, **_: jnp.ones(tuple(size), dtype),
  "aten.full.default": lambda size, v, dtype=None, **_: _full(size, v, dtype),
  "aten.scalar_tensor.default": lambda v, dtype=None, **_: jnp.asarray(v, dtype),
  "aten.zeros_like.default": _like(0),
  "aten.ones_like.default": _like(1),
  "aten.full_like.default": lambda x, v, dtype=None, **_: jnp.full(x.shape, v, dtype or x.dtype),
  "aten.new_zeros.default": _new(0),
  "aten.new_ones.default": _new(1),
  "aten.new_full.default": lambda x, size, v, dtype=None, **_: jnp.full(
    tuple(size), v, dtype or x.dtype
  ),
  # identity-like
  "aten.clone.default": _identity,
  "aten.alias.default": _identity,
  "aten.contiguous.default": _identity,
  "aten.lift_fresh_copy.default": _identity,
  "aten.detach.default": lambda x: lax.stop_gradient(x),
  "aten.dropout.default": _dropout,
  "aten._assert_tensor_metadata.default": _none,
  "aten._to_copy.default": _cast,
  "aten.to.dtype": _cast,
  "aten.to.dtype_layout": _cast,
  "aten.type_as.default": lambda x, other: x.astype(other.dtype),
  # shapes
  "aten.view.default": lambda x, s: x.reshape(_shape(x, s)),
  "aten.reshape.default": lambda x, s: x.reshape(_shape(x, s)),
  "aten._unsafe_view.default": lambda x, s: x.reshape(_shape(x, s)),
  "aten.expand.default": _expand,
  "aten.permute.default": lambda x, dims: jnp.transpose(x, _dims(x, dims)),
  "aten.transpose.int": lambda x, a, b: jnp.swapaxes(x, a, b),
  "aten.t.default": lambda x: x.T,
  "aten.unsqueeze.default": lambda x, d: jnp.expand_dims(x, d % (x.ndim + 1)),
  "aten.squeeze.dim": lambda x, d: _squeeze(x, [d]),
  "aten.squeeze.dims": _squeeze,
  "aten.squeeze.default": lambda x: _squeeze(x, None),
  "aten.flatten.using_ints": _flatten,
  "aten.unflatten.int": _unflatten,
  "aten.slice.Tensor": _slice,
  "aten.select.int": _select,
  "aten.narrow.default": lambda x, d, start, n: _slice(x, d, start, start + n),
  "aten.split.Tensor": _split,
  "aten.split_with_sizes.default": _split_with_sizes,
  "aten.chunk.default": _chunk,
  "aten.unbind.int": _unbind,
  "aten.cat.default": lambda ts, dim=0: jnp.concatenate(ts, axis=dim),
  "aten.stack.default": lambda ts, dim=0: jnp.stack(ts, axis=dim),
  "aten.index.Tensor": _index,
  "aten.index_put.default": _index_put,
  "aten.index_select.default": lambda x, d, i: jnp.take(x, i, axis=d),
  "aten.gather.default": lambda x, d, i, sparse_grad=False: jnp.take_along_axis(x, i, axis=d),
  "aten.select_scatter.default": _select_scatter,
  "aten.slice_scatter.default": _slice_scatter,
  "aten.copy.default": _copy,
  "aten.flip.default": lambda x, dims: jnp.flip(x, axis=tuple(dims)),
  "aten.roll.default": _roll,
  "aten.repeat.default": _repeat,
  "aten.repeat_interleave.self_int": lambda x, r, dim=None, output_size=None: jnp.repeat(
    x, r, axis=dim
  ),
  "aten.tril.default": lambda x, k=0: jnp.tril(x, k),
  "aten.triu.default": lambda x, k=0: jnp.triu(x, k),
  "aten.diff.default": _diff,
  "aten.cumsum.default": lambda x, d, dtype=None: jnp.cumsum(x, axis=d, dtype=dtype),
  # reductions
  "aten.mean.dim": _mean,
  "aten.mean.default": lambda x, dtype=None: jnp.mean(x, dtype=dtype),
  "aten.sum.dim_IntList": _sum,
  "aten.sum.default": lambda x, dtype=None: jnp.sum(x, dtype=dtype),
  "aten.amax.default": lambda x, d=(), k=False: jnp.max(x, axis=_dims(x, d), keepdims=k),
  "aten.amin.default": lambda x, d=(), k=False: jnp.min(x, axis=_dims(x, d), keepdims=k),
  "aten.max.dim": _max_dim,
  "aten.min.dim": _min_dim,
  "aten.argmax.default": lambda x, d=None, k=False: jnp.argmax(x, axis=d, keepdims=k),
  "aten.topk.default": _topk,
  "aten.var.correction": _var,
  "aten.var.dim": _var,
  # elementwise arithmetic
  "aten.add.Tensor": _add,
  "aten.add.Scalar": _add,
  "aten.sub.Tensor": _sub,
  "aten.sub.Scalar": _sub,
  "aten.rsub.Scalar": lambda a, b, alpha=1: b - a * alpha,
  "aten.rsub.Tensor": lambda a, b, alpha=1: b - a * alpha,
  "aten.mul.Tensor": operator.mul,
  "aten.mul.Scalar": operator.mul,
  "aten.div.Tensor": _div,
  "aten.div.Scalar": _div,
  "aten.div.Tensor_mode": _div,
  "aten.pow.Tensor_Scalar": lambda x, e: x**e,
  "aten.pow.Tensor_Tensor": lambda x, e: x**e,
  "aten.pow.Scalar": lambda b, x: jnp.power(b, x),
  "aten.neg.default": operator.neg,
  "aten.abs.default": jnp.abs,
  "aten.sign.default": jnp.sign,
  "aten.reciprocal.default": lambda x: 1 / x,
  "aten.sqrt.default": jnp.sqrt,
  "aten.rsqrt.default": lax.rsqrt,
  "aten.exp.default": jnp.exp,
  "aten.log.default": jnp.log,
  "aten.log1p.default": jnp.log1p,
  "aten.sin.default": jnp.sin,
  "aten.cos.default": jnp.cos,
  "aten.tanh.default": jnp.tanh,
  "aten.erf.default": jax.scipy.special.erf,
  "aten.floor.default": jnp.floor,
  "aten.maximum.default": jnp.maximum,
  "aten.minimum.default": jnp.minimum,
  "aten.clamp.default": _clamp,
  "aten.clamp.Tensor": _clamp,
  "aten.clamp_min.default": lambda x, lo: jnp.maximum(x, lo),
  "aten.clamp_max.default": lambda x, hi: jnp.minimum(x, hi),
  # comparisons and logic
  "aten.eq.Tensor": operator.eq,
  "aten.eq.Scalar": operator.eq,
  "aten.ne.Tensor": operator.ne,
  "aten.ne.Scalar": operator.ne,
  "aten.lt.Tensor": operator.lt,
  "aten.lt.Scalar": operator.lt,
  "aten.le.Tensor": operator.le,
  "aten.le.Scalar": operator.le,
  "aten.gt.Tensor": operator.gt,
  "aten.gt.Scalar": operator.gt,
  "aten.ge.Tensor": operator.ge,
  "aten.ge.Scalar": operator.ge,
  "aten.__and__.Tensor": operator.and_,
  "aten.bitwise_and.Tensor": operator.and_,
  "aten.__or__.Tensor": operator.or_,
  "aten.bitwise_or.Tensor": operator.or_,
  "aten.bitwise_not.default": operator.invert,
  "aten.logical_not.default": jnp.logical_not,
  "aten.logical_and.default": jnp.logical_and,
  "aten.logical_or.default": jnp.logical_or,
  "aten.where.self": jnp.where,
  "aten.where.ScalarOther": _where_scalar,
  "aten.where.ScalarSelf": _where_scalar,
  "aten.where.Scalar": _where_scalar,
  "aten.masked_fill.Scalar": _masked_fill,
  "aten.masked_fill.Tensor": _masked_fill,
  # activations
  "aten.relu.default": jax.nn.relu,
  "aten.gelu.default": _gelu,
  "aten.silu.default": jax.nn.silu,
  "aten.sigmoid.default": jax.nn.sigmoid,
  "aten.hardtanh.default": lambda x, lo=-1.0, hi=1.0: jnp.clip(x, lo, hi),
  "aten.leaky_relu.default": lambda x, s=0.01: jnp.where(x > 0, x, x * s),
  "aten.elu.default": lambda x, a=1.0, scale=1.0, iscale=1.0: jnp.where(
    x > 0, x * scale, a * scale * jnp.expm1(x * iscale)
  ),
  "aten.softplus.default": _softplus,
  "aten.softmax.int": _softmax,
  "aten._softmax.default": _softmax,
  "aten.log_softmax.int": _log_softmax,
  "aten._log_softmax.default": _log_softmax,
  # linear algebra
  "aten.linear.default": _linear,
  "aten.matmul.default": _matmul,
  "aten.mm.default": _matmul,
  "aten.bmm.default": _matmul,
  "aten.addmm.default": _addmm,
  "aten.baddbmm.default": _baddbmm,
  "aten.einsum.default": _einsum,
  "aten.scaled_dot_product_attention.default": _sdpa,
  # layers
  "aten.conv1d.default": _conv,
  "aten.conv2d.default": _conv,
  "aten.conv3d.default": _conv,
  "aten.conv1d.padding": _conv,
  "aten.conv2d.padding": _conv,
  "aten.conv3d.padding": _conv,
  "aten.convolution.default": _convolution,
  "aten.conv_transpose1d.default": _conv_transpose,
  "aten.conv_transpose2d.input": _conv_transpose,
  "aten.conv_transpose3d.input": _conv_transpose,
  "aten.max_pool1d.default": _max_pool(1),
  "aten.max_pool2d.default": _max_pool(2),
  "aten.max_pool3d.default": _max_pool(3),
  "aten.avg_pool1d.default": _avg_pool(1),
  "aten.avg_pool2d.default": _avg_pool(2),
  "aten.avg_pool3d.default": _avg_pool(3),
  "aten.adaptive_avg_pool1d.default": _adaptive_avg_pool(1),
  "aten.adaptive_avg_pool2d.default": _adaptive_avg_pool(2),
  "aten.adaptive_avg_pool3d.default": _adaptive_avg_pool(3),
  "aten.layer_norm.default": _layer_norm,
  "aten.native_layer_norm.default": _native_layer_norm,
  "aten.group_norm.default": lambda x, g, w=None, b=None, eps=1e-5, cudnn=True: _group_norm(
    x, g, w, b, eps
  ),
  "aten._native_batch_norm_legit_no_training.default": _batch_norm_no_training,
  "aten.batch_norm.default": _batch_norm,
  "aten.embedding.default": _embedding,
  "aten.lstm.input": _rnn(_lstm_cell, 2),
  "aten.gru.input": _rnn(_gru_cell, 1),
  # Python operators on values and symbolic sizes
  "<built-in function getitem>": operator.getitem,
  "<built-in function add>": operator.add,
  "<built-in function sub>": operator.sub,
  "<built-in function mul>": operator.mul,
  "<built-in function floordiv>": operator.floordiv,
  "<built-in function truediv>": operator.truediv,
  "<built-in function mod>": operator.mod,
  "<built-in function neg>": operator.neg,
  "aten.sym_size.int": lambda x, d: x.shape[d],
  "aten.sym_numel.default": lambda x: x.size,
  "aten.sym_storage_offset.default": lambda x: 0,
}
