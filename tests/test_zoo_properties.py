"""Property-based tests (hypothesis) of the real-model layer: tiny models of every family of
``jaxlens.models`` (Llama, GPT-2, BERT, GPT-NeoX, Gemma 3) under hostile token arrays, masks, generation
arguments and site/edit pairs (issue 31, item 2).

Each generated call either raises a typed jaxlens error whose code docs/errors.md lists, or
gives the result of the same call done by hand:

* token ids of any int dtype, negative, past the vocabulary, empty, longer than the context:
  the typed ``index_out_of_range`` (concrete ids), or the int32 call's result; under ``jit``
  the rows holding a bad id are NaN and the others are the eager result;
* ragged masks with padding on either side: every row's real positions equal the row run alone
  (decoders with per-row positions for left padding; BERT with right padding);
* random ``jl.generate`` arguments: greedy tokens equal an uncached argmax loop over the growing
  sequence, with a stopped row's later tokens ``pad_token``; sampling gives ids of the vocabulary;
* random (canonical site, edit) pairs on four doors: the output equals the model with that
  site's value edited by hand (``flax.linen.intercept_methods``); a traced position out of range
  makes the output NaN.

Kept fast: the models are cached, derandomized, a few examples each (``deadline=None``).
"""

import functools
import pathlib
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

import jaxlens as jl
from jaxlens.models import bert, gemma, gpt2, gpt_neox, llama

pytestmark = pytest.mark.xdist_group("zoo_properties")

DOCUMENTED = set(
  re.findall(r"`([a-z0-9_]+)`", (pathlib.Path(__file__).parents[1] / "docs/errors.md").read_text())
)
VOCAB, MAX_LEN = 13, 6
FAMILIES = ("llama", "gpt2", "bert", "gpt_neox", "gemma3")
DECODERS = ("llama", "gpt2", "gpt_neox", "gemma3")
# The jitted forward compiles once per dtype and shape: four dtypes cover the casts (narrow
# signed, unsigned, the default, wide).
INT_DTYPES = (jnp.int8, jnp.int32, jnp.int64, jnp.uint8)


@functools.lru_cache(maxsize=None)
def zoo(family):
  """(model, variables) of a tiny float32 model of ``family``."""
  sizes = dict(vocab_size=VOCAB, d_model=8, n_layers=1, n_heads=2, max_len=MAX_LEN)
  if family == "llama":
    model = llama.Llama(llama.LlamaConfig(**sizes, n_kv_heads=1, d_mlp=12, tie_embeddings=True))
  elif family == "gpt2":
    model = gpt2.GPT2(gpt2.GPT2Config(**sizes))
  elif family == "gpt_neox":
    model = gpt_neox.GPTNeoX(gpt_neox.GPTNeoXConfig(**sizes, rotary_pct=0.5))
  elif family == "gemma3":
    model = gemma.Gemma3(
      gemma.Gemma3Config(
        **sizes, n_kv_heads=1, head_dim=4, d_mlp=12, query_pre_attn_scalar=4.0, sliding_window=3
      )
    )
  else:
    model = bert.Bert(bert.BertConfig(**sizes, d_mlp=12))
  tokens = jnp.asarray([[1, 2, 3, 4]])
  return model, jax.jit(model.init)(jax.random.key(0), tokens)


@functools.lru_cache(maxsize=None)
def canonical_sites(family):
  """The labels of the family's module sites (first ``__call__`` of each module)."""
  model, variables = zoo(family)
  t = jax.jit(lambda v: jl.trace(model, v, jnp.asarray([[1, 2, 3, 4]])))(variables)
  return tuple(
    s.label
    for s in t.sites
    if s.kind == "module" and s.method == "__call__" and s.call == 1 and s.output is None
  )


@functools.lru_cache(maxsize=None)
def jitted(family):
  """The family's jitted forward (compiled once per input shape and dtype)."""
  model, _ = zoo(family)
  return jax.jit(lambda v, t, kw: model.apply(v, t, **kw))


def forward(family, tokens, **kwargs):
  return jitted(family)(zoo(family)[1], jnp.asarray(tokens), kwargs)


def _typed(error, *codes):
  """A jaxlens error whose code docs/errors.md lists (and is one of ``codes`` if given)."""
  assert isinstance(error, jl.InvalidArgumentError), repr(error)
  assert error.code in DOCUMENTED, error.code
  if codes:
    assert error.code in codes, (error.code, str(error))


def _outcome(call):
  try:
    return call(), None
  except Exception as error:  # noqa: BLE001 (the property inspects what was raised)
    return None, error


# -- token arrays --------------------------------------------------------------------


@st.composite
def token_arrays(draw):
  dtype = draw(st.sampled_from(INT_DTYPES))
  # Few shapes (each compiles), hostile values: empty, longer than the context.
  batch, seq = draw(st.sampled_from([(2, 4), (2, 4), (2, 4), (1, 0), (1, MAX_LEN + 1)]))
  info = jnp.iinfo(dtype)
  lo, hi = max(int(info.min), -3), min(int(info.max), VOCAB + 3)
  ids = draw(st.lists(st.integers(lo, hi), min_size=batch * seq, max_size=batch * seq))
  return np.asarray(ids, dtype=np.dtype(dtype)).reshape(batch, seq)


@pytest.mark.parametrize("family", FAMILIES)
@settings(max_examples=3)
@example(tokens=np.asarray([[3, -1, 2, 1], [1, 2, 3, 4]], np.int8))  # -1 must not read row 255
@given(tokens=token_arrays())
def test_token_arrays_give_a_typed_error_or_the_int32_result(family, tokens):
  model, variables = zoo(family)
  bad = (tokens.astype(np.int64) < 0) | (tokens.astype(np.int64) >= VOCAB)
  refused = tokens.shape[1] > MAX_LEN or bad.any()
  if refused:  # concrete ids: the call and the trace door refuse them before computing
    for call in (
      lambda: model.apply(variables, jnp.asarray(tokens)),
      lambda: jl.trace(model, variables, jnp.asarray(tokens)).output,
    ):
      _, error = _outcome(call)
      assert error is not None, "a bad id or a too-long input was accepted"
      _typed(error, "index_out_of_range")
  if tokens.shape[1] > MAX_LEN or tokens.dtype not in (np.int8, np.int32):
    return  # (each dtype and shape compiles the forward: int8 is the narrow case, -1 not 255)
  if tokens.size == 0 and tokens.dtype != np.int32:
    return
  # Traced ids cannot raise: a row with a bad id is NaN, the others are the int32 result
  # (the result of concrete ids too: the call is the same program).
  out = forward(family, tokens)
  rows = bad.any(axis=1)
  assert np.isnan(out[rows]).any(axis=tuple(range(1, out.ndim))).all()
  want = forward(family, np.where(bad, 0, tokens).astype(np.int32))
  np.testing.assert_allclose(out[~rows], want[~rows], rtol=1e-5, atol=1e-6)


# -- masks and padding -----------------------------------------------------------------


@st.composite
def padded_batches(draw, family):
  batch, width = 2, 4
  side = "right" if family == "bert" else draw(st.sampled_from(["left", "right"]))
  # Ragged rows of two lengths (each length compiles the row-alone forward once).
  lengths = [draw(st.sampled_from([1, 3])) for _ in range(batch)]
  rows = [draw(st.lists(st.integers(0, VOCAB - 1), min_size=n, max_size=n)) for n in lengths]
  real = draw(st.sampled_from([1, 2, True]))  # any nonzero entry marks a real token
  pad = draw(st.integers(0, VOCAB - 1))
  tokens = np.full((batch, width), pad, np.int32)
  mask = np.zeros((batch, width), np.int32 if real is not True else bool)
  for i, r in enumerate(rows):
    sl = slice(width - len(r), width) if side == "left" else slice(0, len(r))
    tokens[i, sl] = r
    mask[i, sl] = real
  return rows, tokens, mask, side


@pytest.mark.parametrize("family", FAMILIES)
@settings(max_examples=3)
@given(data=st.data())
def test_padding_either_side_gives_each_row_its_own_result(family, data):
  model, variables = zoo(family)
  rows, tokens, mask, side = data.draw(padded_batches(family))
  kwargs = {"attention_mask": jnp.asarray(mask)}
  if side == "left":
    kwargs["positions"] = np.maximum(np.cumsum(mask.astype(bool), axis=1) - 1, 0).astype(np.int32)
  out = forward(family, tokens, **kwargs)
  width = tokens.shape[1]
  for i, r in enumerate(rows):
    alone = forward(family, np.asarray([r], np.int32))[0]
    got = out[i, width - len(r) :] if side == "left" else out[i, : len(r)]
    np.testing.assert_allclose(got, alone, rtol=1e-5, atol=1e-5)
  # A mask of another shape than the tokens is refused, typed.
  _, error = _outcome(
    lambda: model.apply(variables, jnp.asarray(tokens), attention_mask=mask[:, 1:])
  )
  if width > 1:
    _typed(error, "shape_mismatch")


# -- generation ------------------------------------------------------------------------


def _greedy_by_hand(family, row, n, stops, pad):
  seq, out, stopped = list(row), [], False
  for _ in range(n):
    if stopped:
      out.append(pad)
      continue
    token = int(jnp.argmax(forward(family, np.asarray([seq], np.int32))[0, -1]))
    out.append(token)
    seq.append(token)
    stopped = token in stops
  return out


@st.composite
def generation_arguments(draw):
  batch = draw(st.integers(1, 2))
  lo = -1 if draw(st.booleans()) and draw(st.booleans()) else 0  # now and then a bad id
  rows = [draw(st.lists(st.integers(lo, VOCAB - 1), min_size=0, max_size=3)) for _ in range(batch)]
  return {
    "rows": rows,
    "max_new_tokens": draw(st.sampled_from([1, 3, 3, 0, MAX_LEN])),
    "temperature": draw(st.sampled_from([0.0, 0.0, 0.0, 0.8, -1.0])),
    "top_k": draw(st.sampled_from([None, None, 1, 3, 0])),
    "top_p": draw(st.sampled_from([None, None, 0.5, 1.0, 0.0, 1.5])),
    "stop_tokens": tuple(draw(st.lists(st.integers(0, VOCAB - 1), max_size=2))),
    "pad_token": draw(st.integers(0, VOCAB - 1)),
    "early_stop": draw(st.booleans()),
  }


@pytest.mark.parametrize("family", DECODERS)
@settings(max_examples=2)
@example(  # one greedy run with a stop token, whatever the draws give
  args={
    "rows": [[1, 2], [3]],
    "max_new_tokens": 3,
    "temperature": 0.0,
    "top_k": None,
    "top_p": None,
    "stop_tokens": (5,),
    "pad_token": 0,
    "early_stop": True,
  }
)
@given(args=generation_arguments())
def test_generation_arguments_give_a_typed_error_or_the_hand_loop(family, args):
  model, variables = zoo(family)
  args = dict(args)
  rows = args.pop("rows")
  if any(len(r) == 0 for r in rows):
    prompt, mask = jnp.zeros((len(rows), 0), jnp.int32), None
  else:
    prompt, mask = jl.generation.left_pad(rows)
  out, error = _outcome(lambda: jl.generate(model, variables, prompt, attention_mask=mask, **args))
  n, temperature = args["max_new_tokens"], args["temperature"]
  refused = (
    prompt.shape[1] == 0
    or any(t < 0 for r in rows for t in r)
    or prompt.shape[1] + n > MAX_LEN
    or n < 1
    or temperature < 0
    or args["top_k"] == 0
    or args["top_p"] in (0.0, 1.5)
  )
  if refused:
    assert error is not None, f"accepted {args} for {rows}"
    _typed(error)
    return
  assert error is None, repr(error)
  assert out.tokens.shape == (len(rows), n)
  if temperature == 0 or args["top_k"] == 1:
    for i, r in enumerate(rows):
      stops = args["stop_tokens"]
      want = _greedy_by_hand(family, r, n, stops, args["pad_token"])
      assert out.tokens[i].tolist() == want, (i, r)
  else:
    assert ((out.tokens >= 0) & (out.tokens < VOCAB)).all()


# -- site and edit pairs -----------------------------------------------------------------


def _by_hand(model, variables, tokens, label, fn):
  """The model's output with the first ``__call__`` of the module at ``label`` edited by ``fn``."""
  target, seen = tuple(label.split("/")), []

  def edit(next_fun, args, kwargs, context):
    out = next_fun(*args, **kwargs)
    if context.method_name == "__call__" and tuple(context.module.path) == target and not seen:
      seen.append(1)
      out = fn(out)
    return out

  with nn.intercept_methods(edit):
    return model.apply(variables, tokens)


@st.composite
def site_edits(draw, sites):
  """(site, edit, by-hand function of the site value or the expected error code)."""
  label = draw(st.sampled_from(sites))
  kind = draw(st.sampled_from(["scale", "zero", "add", "at_positions"]))
  c = draw(st.sampled_from([0.0, 0.5, -2.0, 3.0]))
  if kind == "scale":
    return label, jl.scale(c), lambda x: x * jnp.asarray(c, x.dtype)
  if kind == "zero":
    return label, jl.zero_ablate(), jnp.zeros_like
  if kind == "add":
    return label, jl.add(c), lambda x: x + jnp.asarray(c, x.dtype)
  p = draw(st.integers(-6, 5))

  def at(x, p=p, c=c):
    n = x.shape[1]
    if not -n <= p < n:
      return "index_out_of_range"
    return x.at[:, p].multiply(jnp.asarray(c, x.dtype))

  return label, jl.at_positions([p], jl.scale(c)), at


DOORS = ("bind", "trace", "replay", "jit")


def _door(door, model, variables, tokens, site, edit):
  selector = jl.module(site)
  if door == "bind":
    return jl.when(selector, edit).bind(model)(variables, tokens)
  if door == "trace":
    return jl.trace(model, variables, tokens, intervene=jl.when(selector, edit)).output
  if door == "replay":
    return jl.trace(model, variables, tokens).fork().do(selector, edit).output
  return jax.jit(lambda v, e: jl.when(selector, e).bind(model)(v, tokens))(variables, edit)


@pytest.mark.parametrize("family", FAMILIES)
@settings(max_examples=2)
@given(data=st.data())
def test_site_edit_pairs_equal_the_edit_by_hand(family, data):
  model, variables = zoo(family)
  sites = canonical_sites(family)
  tokens = jnp.asarray([[1, 5, 7, 2], [3, 3, 0, 12]], jnp.int32)
  site, edit, fn = data.draw(site_edits(sites))
  door = data.draw(st.sampled_from(DOORS))
  # The site's value (what fn is applied to), to know what the hand edit says.
  value = {}

  def peek(x):
    value["x"] = x
    return x

  _by_hand(model, variables, tokens, site, peek)
  want = fn(value["x"])
  got, error = _outcome(lambda: _door(door, model, variables, tokens, site, edit))
  if isinstance(want, str):
    if door == "jit":  # a traced position cannot raise: the output is NaN instead
      assert error is None and np.isnan(got).any(), (site, repr(error))
    else:
      assert error is not None, f"{door} accepted {edit!r} at {site}"
      _typed(error, want)
    return
  assert error is None, (site, door, repr(error))
  np.testing.assert_allclose(
    got, _by_hand(model, variables, tokens, site, fn), rtol=1e-5, atol=1e-5, err_msg=site
  )
