"""Parity of issue 50's families with Hugging Face transformers on tiny random configs
(tests/hf_tiny.py): Gemma 1, Phi-3 (fused projections, half the head rotated, a 4-token window
on every layer), OLMo 2 (norms after the sub-blocks, QK-norm over the projection) and the
mixtures of experts Mixtral (with a window), Qwen2-MoE (shared expert), Qwen3-MoE and OLMoE
(4 experts, top 2).

Per family, in float64 (transformers' float32 islands patched, ``exact_float64``): the logits
with padding, an edit through a door against the same torch forward hook, and an upstream
weight's gradient under the edit, all from one jitted call. For the mixtures the edit drops
expert 1 in block 1's ``routing`` (torch: its weight zeroed at the router's output) and the
weight is block 0's router, whose gradient goes through the routing softmax; for the others
the edit zero-ablates ``blocks_1/mlp_out`` and the weight is block 0's ``down_proj``. In
float32 (transformers as it is): greedy generation steered at ``blocks_1/resid_post`` against
``hf.generate`` with the same torch hook, 8 tokens past the window, for Phi-3, OLMo 2 and
Mixtral (``GENERATE``), and the logits for the others. Skips without torch or
transformers."""

from __future__ import annotations

import copy
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import jaxlens as jl
from hf_tiny import NEW_DECODERS, exact_float64, steered_generate, tiny_hf, zoo_twin
from jaxlens.models import Pretrained

MOE = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe")
TOKENS = np.asarray([[3, 9, 4, 17, 5, 9, 26, 2], [1, 2, 3, 4, 5, 6, 7, 8]])
MASK = np.asarray([[1] * 8, [1] * 6 + [0] * 2])
PROBE = np.random.default_rng(0).normal(size=TOKENS.shape + (64,))
DROP = 1  # the expert dropped in block 1


def _rel(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.abs(a - b).max() / np.abs(b).max())


def _edit(family, hf):
  """``(jaxlens spec, torch module, torch hook, upstream torch weight, its zoo kernel path)``."""
  layers = hf.model.layers
  if family in MOE:
    site = jl.units(jl.module("blocks_1/mlp/routing"), jnp.asarray([DROP]))

    def drop(module, args, output):
      logits, top, index = output
      return logits, torch.where(index == DROP, torch.zeros_like(top), top), index

    return (
      jl.when(site, jl.zero_ablate()),
      layers[1].mlp.gate,
      drop,
      layers[0].mlp.gate.weight,
      ("blocks_0", "mlp", "router", "kernel"),
    )
  mlp_out = layers[1].post_feedforward_layernorm if family == "olmo2" else layers[1].mlp
  return (
    jl.when(jl.module("blocks_1/mlp_out"), jl.zero_ablate()),
    mlp_out,
    lambda module, args, output: torch.zeros_like(output),
    layers[0].mlp.down_proj.weight,
    ("blocks_0", "mlp", "down_proj", "kernel"),
  )


@pytest.fixture(scope="module", params=NEW_DECODERS)
def models(request):
  """``(family, {dtype: (transformers model, zoo twin)})``: the float32 model as drawn, and a
  float64 copy made exact (the same weights widened); the zoo's float32 twin is its float64
  twin's parameters narrowed back (the drawn float32 values)."""
  hf32 = tiny_hf(request.param)
  hf64 = exact_float64(copy.deepcopy(hf32).to(torch.float64))
  lm64 = zoo_twin(hf64, jnp.float64)
  cfg32 = dataclasses.replace(lm64.config, dtype=jnp.float32)
  v32 = jax.tree.map(lambda a: a.astype(jnp.float32), lm64.variables)
  lm32 = Pretrained(type(lm64.model)(cfg32), v32, None, cfg32)
  return request.param, {jnp.float64: (hf64, lm64), jnp.float32: (hf32, lm32)}


def test_float64_logits_edit_and_gradient_match_transformers(models):
  family, pair = models
  hf, lm = pair[jnp.float64]
  spec, module, hook, weight, path = _edit(family, hf)
  x, mask = jnp.asarray(TOKENS), jnp.asarray(MASK)

  def run(v):  # one program: the plain logits, the edited ones and their pullback
    ours, pullback = jax.vjp(lambda w: spec.bind(lm.model)(w, x), v)
    return lm.model.apply(v, x, mask), ours, pullback(jnp.asarray(PROBE))[0]

  plain, ours, grads = jax.jit(run)(lm.variables)
  with torch.no_grad():
    ref = hf(torch.tensor(TOKENS), attention_mask=torch.tensor(MASK)).logits.numpy()
  real = MASK.astype(bool)  # padded query positions are not compared
  assert _rel(np.asarray(plain)[real], ref[real]) <= 1e-10

  handle = module.register_forward_hook(hook)
  try:
    hf.zero_grad()
    out = hf(torch.tensor(TOKENS)).logits
    (out * torch.tensor(PROBE)).sum().backward()
  finally:
    handle.remove()
  assert _rel(ours, out.detach().numpy()) <= 1e-10
  with torch.no_grad():
    assert not np.allclose(out.numpy(), hf(torch.tensor(TOKENS)).logits.numpy())  # it edits
  ours_grad = grads["params"]
  for p in path:
    ours_grad = ours_grad[p]
  assert np.abs(weight.grad.numpy()).max() > 0
  assert _rel(ours_grad, weight.grad.numpy().T) <= 1e-10


PROMPT = np.asarray([[3, 9, 4, 17, 5, 9], [1, 2, 3, 4, 5, 6]])
N, MAGNITUDE = 8, 4.0
# Generation for the families whose decoding differs from the prefill's computation besides
# the MLP (a token's MLP, or mixture, sees that token alone): Phi-3 (a window on every layer
# and half of each head rotated), OLMo 2 (its QK-norm over the whole projection and norms
# after the sub-blocks) and Mixtral (a window, and the experts). The others' logits in float32
# without generation (each generation check costs about 1.5 s of CPU).
GENERATE = ("phi3", "olmo2", "mixtral")


def test_float32_logits_or_steered_generation_match_transformers(models):
  family, pair = models
  hf, lm = pair[jnp.float32]
  if family not in GENERATE:
    with torch.no_grad():
      ref = hf(torch.tensor(TOKENS), attention_mask=torch.tensor(MASK)).logits.numpy()
    ours = jax.jit(lm.model.apply)(lm.variables, jnp.asarray(TOKENS), jnp.asarray(MASK))
    real = MASK.astype(bool)
    assert _rel(np.asarray(ours)[real], ref[real]) <= 1e-4
    return
  direction = np.linspace(-1.0, 1.0, 32).astype(np.float32)
  spec = jl.when(jl.module("blocks_1/resid_post"), jl.steer(jnp.asarray(direction), MAGNITUDE))
  gen = jl.generate(lm.model, lm.variables, jnp.asarray(PROMPT), N, intervene=spec)
  layer = hf.model.layers[1]
  tokens, logits = steered_generate(hf, layer, PROMPT, N, torch.tensor(direction), MAGNITUDE)
  np.testing.assert_array_equal(gen.tokens, tokens)
  assert _rel(gen.logits, logits) <= 1e-4  # float32 logits of the prompt and every step
