"""``Pretrained.first_layers(n)``: the model cut after ``n`` blocks computes the logit lens of
``blocks_{n-1}/resid_post`` of the whole model, shares its arrays, and refuses a bad ``n``."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxlens as jl
import jaxlens.models as jm
from jaxlens.core import InvalidArgumentError
from jaxlens.models.loading import Pretrained

F64 = jnp.float64
TOKENS = jnp.asarray([[3, 9, 4, 17, 5, 9]])


@functools.cache
def _gemma3():
  config = jm.Gemma3Config(
    vocab_size=32,
    d_model=16,
    n_layers=3,
    n_heads=2,
    n_kv_heads=1,
    head_dim=8,
    d_mlp=24,
    query_pre_attn_scalar=8.0,
    sliding_window=2,
    layer_types=("sliding_attention", "full_attention", "sliding_attention"),
    max_len=16,
    dtype=F64,
  )
  model = jm.Gemma3(config)
  return Pretrained(model, jax.jit(model.init)(jax.random.key(0), TOKENS), None, config)


def test_the_cut_model_is_the_logit_lens_of_its_last_block():
  lm = _gemma3()
  cut = lm.first_layers(2)
  assert cut.config.n_layers == 2 and cut.config.layer_types == lm.config.layer_types[:2]
  assert "blocks_2" not in cut.variables["params"]
  assert cut.variables["params"]["blocks_1"] is not None
  assert (
    cut.variables["params"]["embed"]["embedding"] is lm.variables["params"]["embed"]["embedding"]
  )
  site = "blocks_1/resid_post"
  whole = lm.first_layers(3)

  @jax.jit  # one program (not eager ops)
  def run(variables, cut_variables, whole_variables, tokens):
    resid = jl.trace(lm.model, variables, tokens, save=jl.module(site))[site].out
    lens = lm.model.unembed(variables, resid)
    logits = lm.model.apply(variables, tokens)
    return (
      lens,
      cut.model.apply(cut_variables, tokens),
      whole.model.apply(whole_variables, tokens),
      logits,
    )

  lens, got, whole_logits, logits = run(lm.variables, cut.variables, whole.variables, TOKENS)
  np.testing.assert_allclose(got, lens, rtol=1e-12, atol=1e-12)
  np.testing.assert_array_equal(whole_logits, logits)


@pytest.mark.parametrize("n", [0, 4, -1, 1.0, True, "2"])
def test_a_bad_count_is_refused(n):
  with pytest.raises(InvalidArgumentError, match="first_layers") as e:
    _gemma3().first_layers(n)
  assert e.value.code == "invalid_argument"
