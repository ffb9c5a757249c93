"""Greedy generation with a steering edit on every token: jl.generate against Hugging Face
transformers' generate with a plain torch forward hook, on the same random weights (float32).
Skips without torch or transformers."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import jaxlens as jl
from hf_tiny import steered_generate, tiny_hf, zoo_twin

PROMPT = np.asarray([[3, 9, 4, 17, 5, 9], [1, 2, 3, 4, 5, 6]])
N, MAGNITUDE = 8, 4.0


def _build(family):
  hf = tiny_hf(family)
  layer = hf.model.layers[1] if family == "llama" else hf.transformer.h[1]
  return hf, layer, zoo_twin(hf)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_steered_greedy_generation_matches_transformers(family):
  hf, layer, lm = _build(family)
  direction = np.linspace(-1.0, 1.0, 32).astype(np.float32)
  spec = jl.when(jl.module("blocks_1/resid_post"), jl.steer(jnp.asarray(direction), MAGNITUDE))
  ours = jl.generate(lm.model, lm.variables, jnp.asarray(PROMPT), N, intervene=spec)
  ref_tokens, ref_logits = steered_generate(
    hf, layer, PROMPT, N, torch.tensor(direction), MAGNITUDE
  )
  np.testing.assert_array_equal(ours.tokens, ref_tokens)
  err = np.abs(np.asarray(ours.logits) - ref_logits).max() / np.abs(ref_logits).max()
  assert err <= 1e-4, err
  plain_tokens, _ = steered_generate(hf, layer, PROMPT, N)
  assert (plain_tokens != ref_tokens).any()  # the steering changed the generation
