"""Generation with a KV cache, and edits while a model generates (``jl.generate``).

One jitted call generates ``max_new_tokens`` tokens: a prefill runs the prompt through the
model in decode mode (filling the ``cache`` collection of the zoo's decoders), then one
compiled decode step per new token runs inside ``lax.scan`` (or ``lax.while_loop`` when stop
tokens may end every row early). Edits are jaxlens specs applied through the live door
(``spec.bind(model)``, the interceptor path) in those calls:

* ``intervene=``: in the prefill and in every decode step (a steering vector on every token);
* ``prefill=``: in the prefill only (``jl.patch_from`` a trace of another prompt);
* ``decode=``: in the decode steps only;
* :func:`jaxlens.at_steps` selects, inside any of these, the calls that produce chosen new
  tokens (the call index reaches edits as ``FireContext.step``).

Call ``c`` is the forward pass whose last logits choose new token ``c``: call 0 is the prefill,
call ``c >= 1`` feeds new token ``c - 1`` (at absolute position ``prompt_len + c - 1`` of an
unpadded row) and chooses token ``c``. Within the prefill, ``jl.at_positions`` selects prompt
positions as usual; a decode step's site values have a sequence axis of length 1.

Example:
  >>> import jax, jax.numpy as jnp, jaxlens as jl
  >>> from jaxlens.models import Llama, LlamaConfig
  >>> model = Llama(LlamaConfig(vocab_size=32, d_model=16, n_layers=2, n_heads=2, n_kv_heads=1,
  ...                           d_mlp=24))
  >>> prompt = jnp.asarray([[1, 2, 3]])
  >>> variables = model.init(jax.random.key(0), prompt)
  >>> out = jl.generate(model, variables, prompt, 4)
  >>> out.tokens.shape, out.sequences.shape
  ((1, 4), (1, 7))
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence
from typing import Any

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from jaxlens.core import InvalidArgumentError, ShapeError, Spec, when
from jaxlens.internal import api_boundary, as_selector, as_spec
from jaxlens.intervention import hook

__all__ = ["Generation", "generate", "left_pad"]


@flax.struct.dataclass
class Generation:
  """What :func:`generate` returns (a pytree: return it from ``jax.jit``, differentiate it).

  Attributes:
    prompt: the ``(batch, prompt_len)`` prompt as given (left-padded rows included).
    tokens: ``(batch, max_new_tokens)`` new tokens; after a row's stop token, ``pad_token``.
    logits: ``(batch, max_new_tokens, vocab)`` the model's logits (edits applied, before any
      temperature) that chose each new token; zeros after a row stopped early with
      ``early_stop``.
    lengths: ``(batch,)`` new tokens per row up to and including its stop token.
    prefill: saved site values of the prefill call, by label (``(batch, prompt_len, ...)``).
    steps: saved site values of the decode calls 1 .. ``max_new_tokens - 1``, by label,
      stacked along a leading step axis (``steps[label][t - 1]`` is call ``t``'s value).
  """

  prompt: Any
  tokens: Any
  logits: Any
  lengths: Any
  prefill: dict
  steps: dict

  @property
  def sequences(self):
    """``(batch, prompt_len + max_new_tokens)``: the prompt followed by the new tokens."""
    # The wider of the two int dtypes, cast explicitly (strict dtype promotion refuses a mix).
    dtype = max(jnp.result_type(self.prompt), self.tokens.dtype, key=lambda d: d.itemsize)
    return jnp.concatenate([self.prompt.astype(dtype), self.tokens.astype(dtype)], axis=1)


def left_pad(rows: Sequence[Sequence[int]], pad_token: int = 0):
  """Left-pads token lists to one length: ``(tokens, attention_mask)``, both ``(batch, len)``.

  A decoder generating a batch needs every row's last prompt token in the last column.
  """
  if not rows or any(len(r) == 0 for r in rows):
    raise InvalidArgumentError(
      "left_pad needs at least one non-empty row",
      code="invalid_argument",
      fix="left_pad([[1, 2], [3]])",
    )
  width = max(len(r) for r in rows)
  tokens = np.full((len(rows), width), pad_token, np.int32)
  mask = np.zeros((len(rows), width), np.int32)
  for i, r in enumerate(rows):
    tokens[i, width - len(r) :] = r
    mask[i, width - len(r) :] = 1
  return jnp.asarray(tokens), jnp.asarray(mask)


# ---------------------------------------------------------------------------------- sampling


def _choose(logits, key, *, greedy, temperature, top_k, top_p):
  """The next token of each row from ``(batch, vocab)`` logits (``top_k``/``top_p``: traced
  scalars, or None when unused)."""
  if greedy:
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)
  logits = logits.astype(jnp.float32) / temperature
  neg = jnp.finfo(jnp.float32).min
  if top_k is not None or top_p is not None:
    order = jnp.argsort(-logits, axis=-1)
    sorted_logits = jnp.take_along_axis(logits, order, axis=-1)
    drop_sorted = jnp.zeros(logits.shape, bool)
    if top_k is not None:
      drop_sorted |= jnp.arange(logits.shape[-1], dtype=top_k.dtype) >= top_k
    if top_p is not None:
      # The smallest set of most probable tokens whose probability reaches top_p (the most
      # probable token always stays).
      probs = jax.nn.softmax(sorted_logits, axis=-1)
      drop_sorted |= (jnp.cumsum(probs, axis=-1) - probs) >= top_p
    rows = jnp.arange(logits.shape[0])[:, None]
    drop = jnp.zeros_like(drop_sorted).at[rows, order].set(drop_sorted)
    logits = jnp.where(drop, neg, logits)
  return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


# -------------------------------------------------------------------------------- the loop


def _recorder(store: dict):
  def record(x, hook):
    store[hook.label] = x
    return x

  return hook(record)


def _forward(module, variables, cache, tokens, key_mask, positions, spec: Spec, save, call):
  """One decode-mode call with ``spec`` live; returns ``(logits, cache, saved values)``."""
  store: dict = {}
  if save is not None:
    spec = spec + when(save, _recorder(store))
  if spec.rules:
    logits, updated = spec.bind(module, mutable=["cache"], step=call)(
      {**variables, "cache": cache}, tokens, key_mask, positions=positions, decode=True
    )
  else:
    logits, updated = module.apply(
      {**variables, "cache": cache},
      tokens,
      key_mask,
      positions=positions,
      decode=True,
      mutable=["cache"],
    )
  return logits, updated["cache"], store


@functools.partial(
  jax.jit,
  static_argnames=("module", "max_new_tokens", "save", "greedy", "has_stops", "pad_token", "loop"),
)
def _generate(
  module,
  variables,
  prompt,
  mask,
  prefill_spec,
  decode_spec,
  key,
  temperature,
  top_k,
  top_p,
  stops,
  *,
  max_new_tokens,
  save,
  greedy,
  has_stops,
  pad_token,
  loop,
):
  batch, plen = prompt.shape
  n = max_new_tokens
  total = plen + n
  cache = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), _cache_shapes(module, batch, total))
  key_mask = jnp.concatenate([mask, jnp.ones((batch, n), mask.dtype)], axis=1)
  # int32 like the decode step counter they meet (a sum or cumsum would widen to int64 under
  # x64, and strict dtype promotion refuses the mix).
  positions = jnp.maximum(jnp.cumsum(mask, axis=1, dtype=jnp.int32) - 1, 0)
  n_real = jnp.sum(mask, axis=1, dtype=jnp.int32)
  choose = functools.partial(
    _choose, greedy=greedy, temperature=temperature, top_k=top_k, top_p=top_p
  )

  def pick(logits, call, done):
    tok = choose(logits, jax.random.fold_in(key, call))
    tok = jnp.where(done, pad_token, tok)
    stopped = done | jnp.isin(tok, stops) if has_stops else done
    return tok, stopped

  # Padding is never attended to, but an id outside the vocabulary there would embed as NaN
  # (see jaxlens.models), and NaN times a zero attention weight is NaN: feed id 0 instead.
  ids = jnp.where(mask.astype(bool), prompt, jnp.zeros((), prompt.dtype))
  logits, cache, prefill_saved = _forward(
    module, variables, cache, ids, key_mask, positions, prefill_spec, save, 0
  )
  last = logits[:, -1]
  done0 = jnp.zeros((batch,), bool)
  tok, done = pick(last, 0, done0)
  out_tokens = jnp.full((batch, n), pad_token, jnp.int32).at[:, 0].set(tok)
  out_logits = jnp.zeros((batch, n) + last.shape[1:], last.dtype).at[:, 0].set(last)
  lengths = jnp.ones((batch,), jnp.int32)

  def step(cache, tok, call):
    pos = (n_real + call - 1)[:, None]
    logits, cache, saved = _forward(
      module, variables, cache, tok[:, None], key_mask, pos, decode_spec, save, call
    )
    return logits[:, -1], cache, saved

  steps_saved: dict = {}
  if n > 1:
    buffers = {}
    if save is not None:
      # The shapes of a decode step's saved values (a trace of the whole model, so only
      # when something is saved).
      _, _, saved_shapes = jax.eval_shape(step, cache, tok, jnp.int32(1))
      buffers = {k: jnp.zeros((n - 1,) + v.shape, v.dtype) for k, v in saved_shapes.items()}

    def body(carry):
      call, cache, tok, done, out_tokens, out_logits, lengths, buffers = carry
      logits, cache, saved = step(cache, tok, call)
      lengths = lengths + (~done).astype(jnp.int32)
      tok, done = pick(logits, call, done)
      out_tokens = jax.lax.dynamic_update_index_in_dim(out_tokens, tok, call, 1)
      out_logits = jax.lax.dynamic_update_index_in_dim(out_logits, logits, call, 1)
      buffers = {
        k: jax.lax.dynamic_update_index_in_dim(b, saved[k], call - 1, 0) for k, b in buffers.items()
      }
      return call + 1, cache, tok, done, out_tokens, out_logits, lengths, buffers

    carry = (jnp.int32(1), cache, tok, done, out_tokens, out_logits, lengths, buffers)
    if loop == "while":
      carry = jax.lax.while_loop(lambda c: (c[0] < n) & ~jnp.all(c[3]), body, carry)
    else:
      carry = jax.lax.scan(lambda c, _: (body(c), None), carry, None, length=n - 1)[0]
    _, _, _, _, out_tokens, out_logits, lengths, steps_saved = carry
  return Generation(prompt, out_tokens, out_logits, lengths, prefill_saved, steps_saved)


_INT32 = (-(2**31), 2**31)


def _as_ids(value, name: str):
  """``value`` as an array; ragged rows and ids that do not fit in int32 are refused here
  (``jnp.asarray`` would raise its own ``ValueError`` or ``OverflowError``)."""
  if isinstance(value, jax.Array):
    return value
  try:
    array = np.asarray(value)
  except (ValueError, TypeError) as error:
    raise InvalidArgumentError(
      f"generate: {name} is not a rectangular array ({error}); rows of different lengths "
      "must be left-padded",
      code="not_left_padded",
      fix="tokens, mask = jl.generation.left_pad(list_of_token_lists)",
    ) from None
  if array.dtype == object:
    raise InvalidArgumentError(
      f"generate: {name} is not a rectangular array of ints; rows of different lengths "
      "must be left-padded",
      code="not_left_padded",
      fix="tokens, mask = jl.generation.left_pad(list_of_token_lists)",
    )
  if np.issubdtype(array.dtype, np.integer) and array.size:
    low, high = int(array.min()), int(array.max())
    if low < _INT32[0] or high >= _INT32[1]:
      raise InvalidArgumentError(
        f"generate: {name} holds {high if high >= _INT32[1] else low}, which does not fit in "
        "int32 (token ids are int32)",
        code="index_out_of_range",
        fix="token ids in [0, vocab_size)",
      )
    array = array.astype(np.int32)
  return jnp.asarray(array)


def _check_scalars(temperature, seed, stop_tokens, pad_token):
  """The sampling arguments: a real temperature, a seed in [0, 2**32), int32 token ids."""
  if isinstance(temperature, bool) or not isinstance(temperature, (int, float, np.number)):
    raise InvalidArgumentError(
      f"temperature must be a number >= 0, got {temperature!r}",
      code="invalid_argument",
      fix="temperature=0.7 (or 0 for greedy)",
    )
  if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or not 0 <= seed < 2**32:
    raise InvalidArgumentError(
      f"seed must be an int in [0, 2**32), got {seed!r}",
      code="invalid_seed",
      fix="seed=0",
      received=repr(seed),
    )
  if isinstance(stop_tokens, (str, bytes)) or not isinstance(stop_tokens, Iterable):
    raise InvalidArgumentError(
      f"stop_tokens must be a sequence of token ids, got {type(stop_tokens).__name__}",
      code="invalid_argument",
      fix="stop_tokens=(eos_id,)",
      received=repr(stop_tokens)[:80],
    )
  tokens = [*stop_tokens, pad_token]
  for t in tokens:
    if isinstance(t, bool) or not isinstance(t, (int, np.integer)) or not 0 <= t < _INT32[1]:
      raise InvalidArgumentError(
        f"stop_tokens and pad_token must be token ids in [0, 2**31), got {t!r}",
        code="invalid_argument",
        fix="stop_tokens=(eos_id,), pad_token=0",
        received=repr(t),
      )


def _check_prompt(prompt, mask, module, max_new_tokens):
  if jnp.ndim(prompt) != 2 or not jnp.issubdtype(jnp.result_type(prompt), jnp.integer):
    raise ShapeError(
      f"generate: the prompt must be int token ids of shape (batch, len), got "
      f"{jnp.result_type(prompt)} of shape {jnp.shape(prompt)}",
      code="shape_mismatch",
      fix="prompt = jnp.asarray([[1, 2, 3]], jnp.int32)",
    )
  if jnp.shape(prompt)[1] == 0:
    raise ShapeError(
      f"generate: the prompt has no tokens (shape {jnp.shape(prompt)}); the first new token "
      "is chosen by the prompt's last one",
      code="shape_mismatch",
      fix="a prompt of at least one token, e.g. a BOS token: jnp.asarray([[bos_id]])",
    )
  if (
    isinstance(max_new_tokens, bool)
    or not isinstance(max_new_tokens, (int, np.integer))
    or max_new_tokens < 1
  ):
    raise InvalidArgumentError(
      f"max_new_tokens must be a positive int, got {max_new_tokens!r}",
      code="invalid_argument",
      fix="generate(..., max_new_tokens=16)",
    )
  if jnp.shape(mask) != jnp.shape(prompt):
    raise ShapeError(
      f"generate: attention_mask has shape {jnp.shape(mask)}, the prompt {jnp.shape(prompt)}",
      code="shape_mismatch",
      fix="one 0/1 mask entry per prompt token (jl.generation.left_pad)",
    )
  if not isinstance(mask, jax.core.Tracer):
    m = np.asarray(mask) != 0
    # Left padding: each row's real tokens are one block ending in the last column.
    if not (m[:, -1].all() and (np.diff(m.astype(np.int8), axis=1) >= 0).all()):
      raise InvalidArgumentError(
        "generate needs left-padded prompts: every row's real tokens must be one block "
        "ending in the last column",
        code="not_left_padded",
        fix="tokens, mask = jl.generation.left_pad(list_of_token_lists)",
      )
  config = getattr(module, "config", None)
  vocab = getattr(config, "vocab_size", None)
  if isinstance(vocab, int) and not isinstance(prompt, jax.core.Tracer):
    # (A traced prompt is checked by the zoo's models themselves: a bad id gives NaN logits.)
    ids = np.asarray(prompt)
    bad = ((ids < 0) | (ids >= vocab)) & (np.asarray(mask) != 0)
    if bad.any():
      where = tuple(int(i) for i in np.argwhere(bad)[0])
      raise InvalidArgumentError(
        f"generate: prompt token id {int(ids[where])} at {where} is outside the model's "
        f"vocabulary [0, {vocab})",
        code="index_out_of_range",
        site="embed",
        fix=f"ids in [0, {vocab}) (a tokenizer that matches the model)",
      )
  # How many positions the model can take (jaxlens.protocol.Decoder.max_positions).
  max_positions = getattr(module, "max_positions", None)
  max_len = max_positions() if callable(max_positions) else None
  if isinstance(max_len, int) and jnp.shape(prompt)[1] + max_new_tokens > max_len:
    raise InvalidArgumentError(
      f"generate: prompt length {jnp.shape(prompt)[1]} + {max_new_tokens} new tokens exceeds "
      f"the model's context of {max_len} (max_positions())",
      code="index_out_of_range",
      fix=f"max_new_tokens <= {max_len - jnp.shape(prompt)[1]}"
      if jnp.shape(prompt)[1] < max_len
      else f"a prompt of fewer than {max_len} tokens",
    )


@functools.lru_cache(maxsize=64)
def _cache_shapes(model: nn.Module, batch: int, length: int):
  """The shapes of ``model``'s ``cache`` collection for ``batch`` rows of ``length`` tokens.

  Raises ``no_kv_cache`` unless ``model`` keeps a KV cache. It traces the model's ``init``
  abstractly (about a second for a 30-layer model), so it is cached: ``generate`` checks the
  model with it before compiling and reads the shapes from it while tracing.
  """
  try:
    shapes = jax.eval_shape(
      lambda: model.init(jax.random.key(0), jnp.zeros((batch, length), jnp.int32), decode=True)
    )
  except TypeError as err:
    raise InvalidArgumentError(
      f"generate: {type(model).__name__} has no decode mode ({err})",
      code="no_kv_cache",
      fix="a decoder of jaxlens.models (Llama, GPT2)",
    ) from None
  if "cache" not in shapes:
    raise InvalidArgumentError(
      f"generate: {type(model).__name__} keeps no KV cache",
      code="no_kv_cache",
      fix="a decoder of jaxlens.models (Llama, GPT2)",
    )
  return shapes["cache"]


@api_boundary
def generate(
  model: nn.Module,
  variables,
  prompt,
  max_new_tokens: int = 16,
  *,
  attention_mask=None,
  intervene=None,
  prefill=None,
  decode=None,
  save=None,
  temperature: float = 0.0,
  top_k: int | None = None,
  top_p: float | None = None,
  seed: int = 0,
  stop_tokens: Sequence[int] = (),
  pad_token: int = 0,
  early_stop: bool = True,
) -> Generation:
  """Generates ``max_new_tokens`` tokens with a KV cache, with edits live, in one jitted call.

  Without an edit, greedy decoding gives the tokens of the uncached full-sequence forward.

  Args:
    model: an unbound decoder of the zoo (:class:`jaxlens.models.Llama`,
      :class:`jaxlens.models.GPT2`) or any linen module with their call signature
      ``(tokens, attention_mask, positions, decode=)`` and a ``cache`` collection.
    variables: its variables (``{"params": ...}``).
    prompt: int ``(batch, prompt_len)`` token ids, ``prompt_len >= 1``; rows of different
      lengths are left-padded (:func:`left_pad`) with ``attention_mask`` marking the real
      tokens (the padding's ids are not read).
    max_new_tokens: how many tokens to generate (static: a new value recompiles).
    attention_mask: ``(batch, prompt_len)``, nonzero for real tokens (default: all real).
    intervene: a spec (``jl.when(site, verb)``, or a list) live in every call.
    prefill: a spec live in the prefill call only.
    decode: a spec live in the decode steps only.
    save: a selector (or list) of sites whose values are returned: the prefill's in
      ``.prefill``, the decode steps' stacked in ``.steps``.
    temperature: 0 for greedy decoding; otherwise sample from ``softmax(logits / temperature)``.
    top_k, top_p: keep the ``top_k`` most probable tokens / the smallest most probable set
      reaching probability ``top_p`` before sampling.
    seed: the sampling seed (``jax.random.key(seed)``, folded with the call index).
    stop_tokens: a row that generates one of these ends: its later tokens are ``pad_token``.
    pad_token: the token written after a row stopped.
    early_stop: with stop tokens, stop the loop once every row stopped (``lax.while_loop``);
      ``False`` always runs ``max_new_tokens`` calls in ``lax.scan``, which reverse-mode
      differentiation needs. Without stop tokens the loop is a scan.

  Returns:
    A :class:`Generation`.

  Raises:
    InvalidArgumentError: ``invalid_argument``, ``not_left_padded``, ``index_out_of_range``
      (a prompt id outside the vocabulary, or more tokens than the model's ``max_len``),
      ``no_kv_cache``; ``unknown_site`` for a spec
      or ``save`` selector matching nothing. :class:`ShapeError` ``shape_mismatch``.
  """
  prompt = _as_ids(prompt, "prompt")
  mask = (
    jnp.ones(prompt.shape, jnp.int32)
    if attention_mask is None
    else _as_ids(attention_mask, "attention_mask")
  )
  _check_prompt(prompt, mask, model, max_new_tokens)
  # Nonzero marks a real token (the documented meaning): positions and the cache read 0/1.
  mask = (mask != 0).astype(jnp.int32)
  _check_scalars(temperature, seed, stop_tokens, pad_token)
  if not isinstance(model, nn.Module) or model.scope is not None:
    raise InvalidArgumentError(
      f"generate takes an unbound linen decoder and its variables, got {type(model).__name__}",
      code="invalid_argument",
      fix="jl.generate(lm.model, lm.variables, prompt)",
    )
  _cache_shapes(model, prompt.shape[0], prompt.shape[1] + max_new_tokens)
  greedy = temperature == 0
  if not greedy and not temperature > 0:
    raise InvalidArgumentError(
      f"temperature must be >= 0, got {temperature!r}",
      code="invalid_argument",
      fix="temperature=0.7 (or 0 for greedy)",
    )
  if top_k is not None and not (isinstance(top_k, (int, np.integer)) and top_k >= 1):
    raise InvalidArgumentError(
      f"top_k must be a positive int, got {top_k!r}", code="invalid_argument", fix="top_k=50"
    )
  if top_p is not None and not 0 < top_p <= 1:
    raise InvalidArgumentError(
      f"top_p must be in (0, 1], got {top_p!r}", code="invalid_argument", fix="top_p=0.9"
    )
  if save is not None:
    if isinstance(save, (list, tuple)):
      selector = None
      for s in save:
        selector = as_selector(s) if selector is None else selector | as_selector(s)
      save = selector
    else:
      save = as_selector(save)
  everywhere = as_spec(intervene)
  stop_tokens = tuple(int(t) for t in stop_tokens)
  loop = "while" if stop_tokens and early_stop else "scan"
  return _generate(
    model,
    variables,
    prompt,
    mask,
    everywhere + as_spec(prefill),
    everywhere + as_spec(decode),
    jax.random.key(seed),
    jnp.float32(temperature if not greedy else 1.0),
    None if top_k is None else jnp.int32(top_k),
    None if top_p is None else jnp.float32(top_p),
    jnp.asarray(stop_tokens or (0,), jnp.int32),
    max_new_tokens=int(max_new_tokens),
    save=save,
    greedy=greedy,
    has_stops=bool(stop_tokens),
    pad_token=int(pad_token),
    loop=loop,
  )
