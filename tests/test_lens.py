"""jaxlens.lens: the logit lens and direct logit attribution on every zoo decoder family."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from _lens_models import FAMILIES, VOCAB, build
from jaxlens import lens

TOKENS = jnp.asarray([[3, 9, 4, 17, 5, 9, 26, 2], [1, 2, 3, 4, 5, 6, 7, 8]], jnp.int32)


@functools.cache
def _family(name):
  model, variables = build(name)
  lensed, logits = jax.jit(lambda v: (lens.logit_lens(model, v, TOKENS), model.apply(v, TOKENS)))(
    variables
  )
  return name, model, variables, lensed, logits


@pytest.fixture(scope="module", params=FAMILIES)
def family(request):
  """Every family: the claims about the lens's last layer and the attribution's sum."""
  return _family(request.param)


@pytest.fixture(scope="module", params=["llama", "gpt2", "gemma2"])
def some_family(request):
  """RMSNorm with biases, LayerNorm, and Gemma's norm with soft-caps and tied embeddings: the
  readout's code paths, for the checks that do not depend on the family otherwise."""
  return _family(request.param)


def test_last_layer_is_the_models_logits(family):
  name, model, variables, ll, logits = family
  assert ll.shape == (3, 2, 8, VOCAB)
  np.testing.assert_allclose(ll[-1], logits, rtol=1e-12, atol=1e-12)
  # an earlier layer reads another residual: its lens differs from the output
  assert float(jnp.abs(ll[0] - logits).max()) > 1e-3


def test_norm_is_recomputed_per_layer(some_family):
  """The lens of layer 1 is unembed(resid) with that residual's own norm scale, not the final
  position's scale (TransformerLens's old trap)."""
  name, model, variables, ll, _ = some_family
  res = jax.jit(lambda v: lens.residuals(model, v, TOKENS, layers=[1, -1]))(variables)
  ro = lens.readout(model, variables)
  np.testing.assert_allclose(ro.logits(res[0]), ll[1], rtol=1e-12, atol=1e-12)
  np.testing.assert_allclose(model.unembed(variables, res[0]), ll[1], rtol=1e-12, atol=1e-12)
  frozen = ro.chunk_logits(ro.norm(res[0], ro.scale(res[1])), 0, VOCAB)
  assert float(jnp.abs(frozen - ll[1]).max()) > 1e-3


@pytest.mark.parametrize("chunk", [7, 50])  # 50 = 7 * 7 + 1: a last partial chunk
def test_topk_in_chunks_equals_the_full_lens(some_family, chunk):
  name, model, variables, ll, _ = some_family
  top = jax.jit(lambda v: lens.logit_lens_topk(model, v, TOKENS, k=4, chunk=chunk))(variables)
  vals, ids = jax.lax.top_k(ll, 4)
  np.testing.assert_array_equal(top.ids, ids)
  np.testing.assert_allclose(top.logits, vals, rtol=1e-12, atol=1e-12)
  probs = jnp.take_along_axis(jax.nn.softmax(ll, -1), ids, -1)
  np.testing.assert_allclose(top.probs, probs, rtol=1e-10)
  np.testing.assert_allclose(top.log_norm, jax.nn.logsumexp(ll, -1), rtol=1e-12)


def test_topk_never_holds_a_vocab_wide_array():
  """With chunk=7, no value in the program has a layer axis and the vocabulary (50): the
  largest vocabulary-wide value is the model's own output logits (batch, seq, vocab), which
  jit drops as unused."""
  from _jaxprs import equations

  model, variables = build("llama")
  fn = lambda v: lens.logit_lens_topk(model, v, TOKENS, k=3, chunk=7)  # noqa: E731
  jaxpr = jax.make_jaxpr(fn)(variables)
  for eqn in equations(jaxpr.jaxpr):
    for var in eqn.outvars:
      shape = getattr(var.aval, "shape", ())
      assert not (len(shape) >= 4 and VOCAB in shape), (eqn.primitive, shape)
      assert np.prod(shape, dtype=int) <= TOKENS.size * VOCAB, (eqn.primitive, shape)


def test_dla_parts_sum_to_the_logit_difference(family):
  minus = 7
  name, model, variables, _, logits = family
  target = jnp.asarray([11, 30])
  dla = jax.jit(lambda v: lens.direct_logit_attribution(model, v, TOKENS, target, minus=minus))(
    variables
  )
  n_heads = model.config.n_heads
  assert (
    dla.parts.shape[1]
    == len(dla.labels)
    == 1 + 2 * (n_heads + 1) + 1 + 2 * (name in ("llama", "gpt2", "gpt_neox"))
  )
  np.testing.assert_allclose(dla.parts.sum(-1), dla.logit, rtol=1e-11, atol=1e-11)
  if name == "gemma2":  # the parts sum to the logit before the final soft-cap
    logits = 30.0 * jnp.arctanh(logits / 30.0)
  want = logits[jnp.arange(2), -1, target] - logits[:, -1, minus]
  np.testing.assert_allclose(dla.logit, want, rtol=1e-9, atol=1e-9)
  # every kind of part contributes (RMS-normed families have no final bias)
  for comp in set(dla.component) - ({"bias"} if name not in ("gpt2", "gpt_neox") else set()):
    sel = np.asarray(dla.component) == comp
    assert float(jnp.abs(dla.parts[:, sel]).max()) > 0, comp
  assert dla.by_layer().shape == (2, 4)
  np.testing.assert_allclose(dla.by_layer().sum(-1), dla.logit, rtol=1e-11, atol=1e-11)
  assert dla.heads().shape == (2, 2, n_heads)


def test_dla_heads_are_their_own_writes():
  """A head's part is what the residual stream loses when that head's z is zeroed, read
  through the final norm with its scale frozen."""
  import jaxlens as jl

  model, variables = _family("llama")[1:3]

  @jax.jit
  def run(variables):
    dla = lens.direct_logit_attribution(model, variables, TOKENS, 11)
    mask = jnp.ones((4, 4)).at[1].set(0.0)  # (heads, head_dim) with head 1 zeroed
    zero_head = jl.hook(lambda z: z * mask.astype(z.dtype)[None, None])
    save = [jl.module("blocks_1/resid_mid"), jl.module("blocks_1/resid_post")]
    base = jl.trace(model, variables, TOKENS, save=save)
    spec = jl.when(jl.module("blocks_1/attn/z"), zero_head)
    edited = jl.trace(model, variables, TOKENS, intervene=spec, save=save)
    ro = lens.readout(model, variables)
    u = ro.rows(jnp.asarray([11, 11]))
    scale = ro.scale(base["blocks_1/resid_post"].out[:, -1])
    before = ro.norm(base["blocks_1/resid_mid"].out[:, -1], scale)
    after = ro.norm(edited["blocks_1/resid_mid"].out[:, -1], scale)
    return dla, jnp.sum(u * (before - after), -1)

  dla, change = run(variables)
  np.testing.assert_allclose(dla.parts[:, dla.labels.index("L1H1")], change, rtol=1e-9)
  # one target's logit (no difference) is a sum of the parts too
  logits = _family("llama")[4]
  np.testing.assert_allclose(dla.parts.sum(-1), logits[:, -1, 11], rtol=1e-10)


def test_bad_input():
  model, variables = build("llama")
  with pytest.raises(lens.LensError, match="outside the lens's 3 layers") as e:
    lens.logit_lens(model, variables, TOKENS, layers=[3])
  assert e.value.code == "index_out_of_range"
  with pytest.raises(lens.LensError, match="outside the vocabulary") as e:
    lens.direct_logit_attribution(model, variables, TOKENS, VOCAB)
  assert e.value.code == "index_out_of_range"
  with pytest.raises(lens.LensError, match="outside the sequence"):
    lens.direct_logit_attribution(model, variables, TOKENS, 3, position=8)
  with pytest.raises(lens.LensError, match="must be an int token id"):
    lens.direct_logit_attribution(model, variables, TOKENS, 1.5)
  with pytest.raises(lens.LensError, match="positive int") as e:
    lens.logit_lens_topk(model, variables, TOKENS, k=0)
  assert e.value.code == "invalid_argument"
  with pytest.raises(lens.LensError, match="must be ints"):
    lens.logit_lens(model, variables, TOKENS, layers=["1"])
  with pytest.raises(lens.LensError, match="'params' collection"):
    lens.logit_lens_topk(model, variables["params"], TOKENS)
  import flax.linen as nn

  dense = nn.Dense(3)
  with pytest.raises(lens.LensError, match="Dense has no") as e:
    lens.logit_lens(dense, {"params": {}}, TOKENS)
  assert e.value.code == "lens_unsupported_model"
