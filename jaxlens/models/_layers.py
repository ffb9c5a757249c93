"""Pieces the zoo's families share: masks, the attention core, the KV cache, RMSNorm, and the
model protocol's common methods (:mod:`jaxlens.protocol`).

Every value interpretability looks at passes through :func:`jaxlens.named`, so it is a site
named by the calling module's path (``blocks_3/attn/pattern``).
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jaxlens.models._params import StoredParams
from jaxlens.models.compact import Dense, Embed
from jaxlens.core import InvalidArgumentError, ShapeError, named


def softmax_dtype(dtype) -> Any:
  """The dtype the softmax and norms run in: at least float32 (bfloat16 is upcast)."""
  # (Not jnp.promote_types, which strict dtype promotion refuses across widths.)
  return jnp.dtype(dtype) if jnp.dtype(dtype).itemsize >= 4 else jnp.dtype(jnp.float32)


def layer_norm_options(dtype) -> dict:
  """Keywords for ``nn.LayerNorm`` in ``dtype``: statistics in at least float32, spelled so that
  strict dtype promotion accepts a float32 or float64 model (flax's float32 upcast calls
  ``jnp.promote_types``, which strict promotion refuses across widths; for those models the
  upcast is a no-op, so leaving it out changes no value). Half precision keeps the upcast."""
  fields = getattr(nn.LayerNorm, "__dataclass_fields__", {})
  if jnp.dtype(dtype).itemsize >= 4 and "force_float32_reductions" in fields:
    return {"force_float32_reductions": False}
  return {}


def check_ids(ids, n: int, what: str, site: str) -> None:
  """Refuses ids that index no row of a table of ``n`` (an embedding): a float or non-array
  ``ids``, and, when they are concrete, an id outside ``[0, n)`` (``index_out_of_range``).

  Traced ids cannot be checked; :func:`lookup_ids` makes a bad one gather NaN instead.
  """
  dtype = getattr(ids, "dtype", None)
  if dtype is None or not jnp.issubdtype(dtype, jnp.integer):
    raise ShapeError(
      f"{what} must be an integer array, got {type(ids).__name__}"
      + (f" of dtype {dtype}" if dtype is not None else ""),
      code="dtype_mismatch",
      site=site,
      fix=f"jnp.asarray({what}, jnp.int32)",
    )
  if isinstance(ids, jax.core.Tracer):
    return
  a = np.asarray(ids)
  bad = (a < 0) | (a >= n)
  if bad.any():
    where = tuple(int(i) for i in np.argwhere(bad)[0])
    raise InvalidArgumentError(
      f"{what}: id {int(a[where])} at index {where} is outside [0, {n})",
      code="index_out_of_range",
      site=site,
      expected=f"[0, {n})",
      received=int(a[where]),
      fix=f"ids in [0, {n}) (a tokenizer that matches the model)",
    )


def lookup_ids(ids):
  """``ids`` as an unsigned int array, for an embedding lookup: jnp's gather wraps a negative
  signed index to the end of the table, while an unsigned one outside the table gathers NaN
  (the error value of a traced id that names no row; see docs/guide.md)."""
  ids = jnp.asarray(ids)
  if jnp.issubdtype(ids.dtype, jnp.unsignedinteger):
    return ids
  wide = ids.dtype.itemsize > 4
  # Widen first, so that -1 of int8 becomes 2**32 - 1 (past any table), not 255.
  return ids.astype(jnp.int64 if wide else jnp.int32).astype(jnp.uint64 if wide else jnp.uint32)


def real_tokens(mask):
  """A padding mask as booleans: True where the entry is nonzero (a boolean mask as it is;
  comparing it with the int 0 is refused under strict dtype promotion)."""
  m = jnp.asarray(mask)
  return m if m.dtype == jnp.bool_ else m != jnp.zeros((), m.dtype)


def check_mask(mask, tokens) -> None:
  """Refuses a padding mask of another shape than the tokens (it would broadcast, or fail
  inside the attention with numpy's words)."""
  if mask is not None and tuple(jnp.shape(mask)) != tuple(tokens.shape):
    raise ShapeError(
      f"attention_mask has shape {tuple(jnp.shape(mask))}, the tokens {tuple(tokens.shape)}",
      code="shape_mismatch",
      expected=tuple(tokens.shape),
      received=tuple(jnp.shape(mask)),
      fix="one mask entry per token: attention_mask.shape == tokens.shape",
    )


def check_length(seq: int, max_len: int, site: str) -> None:
  """Refuses a sequence (a static length) longer than the model's context."""
  if seq > max_len:
    raise InvalidArgumentError(
      f"a sequence of {seq} tokens is longer than the model's context of {max_len}",
      code="index_out_of_range",
      site=site,
      expected=f"<= {max_len}",
      received=seq,
      fix=f"at most {max_len} tokens (config.max_len)",
    )


def decoder_inputs(module, tokens, attention_mask, positions, decode: bool):
  """What every decoder's ``__call__`` starts with: the token ids, length and mask checked
  against ``module.config``, and the positions (``0..seq-1``, or the KV cache's next ones when
  decoding, which also advances the cache's ``index``).

  Returns:
    ``(positions, cache_index)``; ``cache_index`` is None unless ``decode``.
  """
  cfg = module.config
  check_ids(tokens, cfg.vocab_size, "tokens", "embed")
  seq = tokens.shape[1]
  check_length(seq, cfg.max_len, "embed")
  if not decode:  # (decoding, the mask covers the cache)
    check_mask(attention_mask, tokens)
  cache_index = None
  if decode:
    index = module.variable("cache", "index", lambda: jnp.zeros((), jnp.int32))
    cache_index = index.value
    if positions is None:
      positions = cache_index + jnp.arange(seq, dtype=cache_index.dtype)
    if (
      module.is_mutable_collection("cache")
      and module.has_variable("cache", "index")
      and not module.is_initializing()
    ):
      index.value = cache_index + seq
  if positions is None:
    positions = jnp.arange(seq)
  return positions, cache_index


def attention_mask(q_positions, k_positions, *, causal: bool, key_mask=None, window=None):
  """A boolean ``(batch or 1, 1, q, k)`` mask: True where a query may attend to a key.

  Args:
    q_positions: int ``(q,)`` or ``(batch, q)`` positions of the queries.
    k_positions: int ``(k,)`` or ``(batch, k)`` positions of the keys.
    causal: whether a query sees only keys at its own position or before.
    key_mask: optional ``(batch, k)`` padding mask, nonzero for real tokens.
    window: optional sliding window: a query at position ``p`` sees only keys at positions
      ``> p - window`` (itself and the ``window - 1`` keys before it, as Hugging Face's
      sliding-window layers).
  """
  q_positions, k_positions = jnp.atleast_2d(q_positions), jnp.atleast_2d(k_positions)
  if causal:
    mask = k_positions[:, None, :] <= q_positions[:, :, None]
  else:
    mask = jnp.ones((1, q_positions.shape[1], k_positions.shape[1]), bool)
  if window is not None:
    mask = mask & (k_positions[:, None, :] > q_positions[:, :, None] - window)
  mask = mask[:, None]
  if key_mask is not None:
    mask = mask & real_tokens(key_mask)[:, None, None, :]
  return mask


def attend(q, k, v, mask, *, dtype, scale=None, softcap=None):
  """Scaled dot-product attention with grouped-query heads, naming its sites.

  Sites (under the calling module): ``scores`` (scaled, masked, before the softmax,
  ``(batch, heads, q, k)``), ``pattern`` (the softmax probabilities, same shape) and ``z``
  (the per-head mixed values, ``(batch, q, heads, head_dim)``).

  Args:
    q: ``(batch, q, heads, head_dim)``.
    k, v: ``(batch, k, kv_heads, head_dim)``; ``heads`` is a multiple of ``kv_heads``.
    mask: boolean, broadcastable to ``(batch, heads, q, k)``.
    dtype: the computation dtype.
    scale: the scores' factor; ``1 / sqrt(head_dim)`` when None.
    softcap: optional attention-logit soft-capping (Gemma 2): ``softcap * tanh(s / softcap)``
      of the scaled scores, before the mask.
  """
  heads, kv_heads, head_dim = q.shape[2], k.shape[2], q.shape[3]
  if heads != kv_heads:
    k = jnp.repeat(k, heads // kv_heads, axis=2)
    v = jnp.repeat(v, heads // kv_heads, axis=2)
  sdt = softmax_dtype(dtype)
  scores = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(sdt)
  if scale is None:
    scores = scores / jnp.sqrt(jnp.asarray(head_dim, sdt))
  else:
    scores = scores * jnp.asarray(scale, sdt)
  if softcap is not None:
    scores = softcap * jnp.tanh(scores / softcap)
  scores = named(jnp.where(mask, scores, jnp.finfo(sdt).min), "scores")
  pattern = named(jax.nn.softmax(scores, axis=-1).astype(dtype), "pattern")
  return named(jnp.einsum("bhqk,bkhd->bqhd", pattern, v), "z")


def cached_keys_values(module: nn.Module, k, v, index):
  """The decode path's KV cache: writes this step's keys and values at ``index``.

  The ``cache`` collection holds ``cached_key`` and ``cached_value`` of shape ``(batch, cache_len, kv_heads,
  head_dim)``, created at ``init`` (or the first ``apply`` with ``mutable=["cache"]``) with
  the shape of that call's keys, so ``cache_len`` is the sequence length of that call.

  Returns:
    ``(keys, values, initialised)``: the whole cache after the write, and whether the
    cache existed before this call (on the creating call the keys are this call's).
  """
  initialised = module.has_variable("cache", "cached_key")
  ck = module.variable("cache", "cached_key", jnp.zeros, k.shape, k.dtype)
  cv = module.variable("cache", "cached_value", jnp.zeros, v.shape, v.dtype)
  if not initialised:
    return k, v, False
  zero = jnp.zeros((), jnp.int32)
  start = (zero, jnp.asarray(index, jnp.int32), zero, zero)
  ck.value = jax.lax.dynamic_update_slice(ck.value, k.astype(ck.value.dtype), start)
  cv.value = jax.lax.dynamic_update_slice(cv.value, v.astype(cv.value.dtype), start)
  return ck.value, cv.value, True


# The slot of an empty entry of a windowed cache: far enough back for every window to miss it.
_EMPTY = -(2**30)


def windowed_keys_values(module: nn.Module, k, v, index, key_mask, window: int):
  """The decode path's KV cache of a sliding-window layer: a ring of ``window`` entries.

  A query sees only the ``window - 1`` keys before it, so the layer keeps the last ``window``
  keys and values (``cached_key``, ``cached_value``: ``(batch, min(window, cache_len),
  kv_heads, head_dim)``) and the slot each holds (``cached_slot``, ``slot + 1``; 0 for an
  empty entry, so a zero-filled cache is an empty one). Its memory is bounded by the window
  however long the generation. The call attends over the ring as it was before this call
  and this call's keys, then writes this call's last ``min(seq, window)`` keys in.

  Args:
    module: the attention module (its ``cache`` collection).
    k, v: this call's keys and values, ``(batch, seq, kv_heads, head_dim)``.
    index: the slot of this call's first token.
    key_mask: None or the ``(batch, cache_len)`` padding mask over slots.
    window: the sliding window.

  Returns:
    ``(keys, values, key_slots, key_mask, initialised)``; on the creating call (no cache yet)
    this call's keys and values with ``key_slots`` and ``key_mask`` None.
  """
  initialised = module.has_variable("cache", "cached_key")
  batch, seq = k.shape[:2]
  size = min(window, seq)  # on the creating call, seq is the cache's length
  ck = module.variable("cache", "cached_key", jnp.zeros, (batch, size) + k.shape[2:], k.dtype)
  cv = module.variable("cache", "cached_value", jnp.zeros, (batch, size) + v.shape[2:], v.dtype)
  cs = module.variable("cache", "cached_slot", jnp.zeros, (size,), jnp.int32)
  if not initialised:
    return k, v, None, None, False
  size = ck.value.shape[1]
  index = jnp.asarray(index, jnp.int32)
  slots = index + jnp.arange(seq, dtype=jnp.int32)
  old = cs.value - 1
  key_slots = jnp.concatenate([jnp.where(old >= 0, old, _EMPTY), slots])
  keys = jnp.concatenate([ck.value, k.astype(ck.value.dtype)], axis=1)
  values = jnp.concatenate([cv.value, v.astype(cv.value.dtype)], axis=1)
  mask = None
  if key_mask is not None:
    mask = jnp.take(jnp.asarray(key_mask), jnp.maximum(key_slots, 0), axis=1, mode="clip")
  n = min(seq, size)  # distinct ring entries: the last n slots are consecutive
  ring = slots[-n:] % size
  ck.value = ck.value.at[:, ring].set(k[:, -n:].astype(ck.value.dtype))
  cv.value = cv.value.at[:, ring].set(v[:, -n:].astype(cv.value.dtype))
  cs.value = cs.value.at[ring].set(slots[-n:] + 1)
  return keys, values, key_slots, mask, True


def cached_attention(
  module,
  q,
  k,
  v,
  positions,
  *,
  key_mask,
  decode,
  cache_index,
  mask,
  window,
  dtype,
  scale=None,
  softcap=None,
):
  """Causal attention of a decoder layer with its KV cache: the full cache
  (:func:`cached_keys_values`) or, for a sliding-window layer, the ring
  (:func:`windowed_keys_values`); ``mask``, when given, replaces the causal one."""
  q_positions = k_positions = positions
  if decode and window is not None:
    k, v, slots, ring_mask, initialised = windowed_keys_values(
      module, k, v, cache_index, key_mask, window
    )
    if initialised:
      q_positions = cache_index + jnp.arange(q.shape[1], dtype=jnp.int32)
      k_positions, key_mask = slots, ring_mask
  elif decode:
    k, v, initialised = cached_keys_values(module, k, v, cache_index)
    if initialised:
      # Causality in the cache is by slot (a query at slot cache_index + i sees the slots up
      # to its own); positions, which left padding shifts per row, only embed or rotate.
      q_positions = cache_index + jnp.arange(q.shape[1], dtype=cache_index.dtype)
      k_positions = jnp.arange(k.shape[1], dtype=cache_index.dtype)
  if mask is None:
    mask = attention_mask(q_positions, k_positions, causal=True, key_mask=key_mask, window=window)
  return attend(q, k, v, mask, dtype=dtype, scale=scale, softcap=softcap)


class RMSNorm(StoredParams, nn.Module):
  """Root-mean-square norm: ``weight * x / sqrt(mean(x²) + eps)``, computed in at least float32."""

  eps: float = 1e-5
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x):
    weight = self.param("weight", nn.initializers.ones, (x.shape[-1],), self.dtype)
    h = x.astype(softmax_dtype(self.dtype))
    h = h * jax.lax.rsqrt(jnp.mean(h * h, axis=-1, keepdims=True) + self.eps)
    return weight * h.astype(self.dtype)


class LayerNorm(StoredParams, nn.Module):
  """LayerNorm with ``scale`` and ``bias`` (``nn.LayerNorm``'s parameter names), its statistics
  in at least float32 and the result cast to ``dtype``; unlike ``nn.LayerNorm`` it runs in
  bfloat16 under strict dtype promotion."""

  eps: float = 1e-5
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x):
    scale = self.param("scale", nn.initializers.ones, (x.shape[-1],), self.dtype)
    bias = self.param("bias", nn.initializers.zeros, (x.shape[-1],), self.dtype)
    sdt = softmax_dtype(self.dtype)
    h = x.astype(sdt)
    mean = jnp.mean(h, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(h - mean), axis=-1, keepdims=True)
    h = (h - mean) * jax.lax.rsqrt(var + self.eps)
    return (h * scale.astype(sdt) + bias.astype(sdt)).astype(self.dtype)


class FlaxLayerNorm(StoredParams, nn.LayerNorm):
  """``flax.linen.LayerNorm``, its stored parameters read without tracing their initializers
  (:class:`~jaxlens.models._params.StoredParams`)."""


class LayerSites:
  """:class:`jaxlens.protocol.LayeredModel` for the zoo families (a mixin of their top-level
  modules, which have ``config.n_layers`` blocks named ``blocks_{i}``)."""

  @nn.nowrap
  def block_site(self, layer: int, name: str) -> str:
    """``f"blocks_{layer}/{name}"``; in the scanned form (``config.scan_layers``) the label of
    that layer's slice of the stacked site, ``f"blocks/{name}[{layer}]"`` (``jl.label`` selects
    it, as ``jl.module(f"blocks/{name}", layer=layer)`` does)."""
    if getattr(self.config, "scan_layers", False):
      return f"blocks/{name}[{layer}]"
    return f"blocks_{layer}/{name}"

  @nn.nowrap
  def layer_sites(self) -> tuple[str, ...]:
    """``blocks_{i}/resid_pre`` for every block: the residual stream entering each block, which
    :func:`jaxlens.sweep.patching_sweep` patches by default."""
    return tuple(self.block_site(i, "resid_pre") for i in range(self.config.n_layers))

  @nn.nowrap
  def check_inputs(self, tokens=None, *args, **kwargs) -> None:
    """Refuses concrete token ids outside the vocabulary (``index_out_of_range``).

    The model's call checks its concrete ids itself; jaxlens doors that trace the model
    abstractly (``jl.trace``) call this first with the concrete inputs.
    """
    if tokens is not None and hasattr(tokens, "dtype"):
      check_ids(tokens, self.config.vocab_size, "tokens", "embed")
    types = kwargs.get("token_types")
    n_types = getattr(self.config, "type_vocab_size", None)
    if types is not None and n_types is not None and hasattr(types, "dtype"):
      check_ids(types, n_types, "token_types", "type_embed")


def run_block_after(block: nn.Module, params, x, positions, past_keys, past_values, mask):
  """:meth:`jaxlens.protocol.Decoder.run_block` for a zoo block whose call is ``(x, positions,
  key_mask, decode, cache_index, mask)``: the past fills the first slots of the block's KV
  cache, and ``x`` is decoded after it (``cache_index`` = the past's length)."""
  batch, n = x.shape[:2]

  def slots(past):
    return jnp.concatenate([past, jnp.zeros((batch, n) + past.shape[2:], past.dtype)], axis=1)

  cache = {"attn": {"cached_key": slots(past_keys), "cached_value": slots(past_values)}}
  out, _ = block.apply(
    {"params": params, "cache": cache},
    x,
    positions,
    None,
    True,
    jnp.int32(past_keys.shape[1]),
    mask,
    mutable=["cache"],
  )
  return out


def window_mask(mask, positions, past_len: int, window: int | None):
  """``mask`` of :meth:`jaxlens.protocol.Decoder.run_block` restricted to a sliding window:
  the past's keys are at positions ``0 .. past_len - 1``, ``x``'s at ``positions``."""
  if window is None:
    return mask
  q = jnp.atleast_2d(positions)
  past = jnp.broadcast_to(jnp.arange(past_len, dtype=q.dtype), (q.shape[0], past_len))
  k = jnp.concatenate([past, q], axis=1)
  return mask & (k[:, None, :] > q[:, :, None] - window)[:, None]


def unembed_after(norm: nn.Module, config, params, x):
  """:meth:`jaxlens.protocol.Decoder.unembed` for a zoo decoder whose parameters are
  ``ln_final`` and ``lm_head`` (or, with ``config.tie_embeddings``, ``embed``)."""
  x = norm.apply({"params": params["ln_final"]}, x)
  dense = {"dtype": config.dtype, "param_dtype": config.dtype}
  if config.tie_embeddings:
    embed = Embed(config.vocab_size, config.d_model, **dense)
    return embed.apply({"params": params["embed"]}, x, method="attend")
  head = Dense(config.vocab_size, use_bias=False, **dense)
  return head.apply({"params": params["lm_head"]}, x)
