"""Parity of the zoo's newer families (Mistral, Qwen2, Qwen3, GPT-NeoX, Gemma 3, Gemma 2) with
Hugging Face transformers on tiny random configs whose sliding windows (4 tokens) are shorter
than the 8-token sequence: logits in float64 and float32, the same edit through a jaxlens door
and a torch forward hook (logits and an upstream weight's gradient), and greedy generation
with a steering edit against HF ``generate`` (14 tokens: past every window). Skips without
torch or transformers."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import jaxlens as jl
from hf_tiny import exact_float64, steered_generate, tiny_hf, zoo_twin

FAMILIES = ["mistral", "qwen2", "qwen3", "gpt_neox", "gemma3", "gemma2"]
# Every family, in every check (each costs about 1-3 s of CPU).
EDIT_FAMILIES = GENERATE_FAMILIES = FAMILIES
TOKENS = np.asarray([[3, 9, 4, 17, 5, 9, 26, 2], [1, 2, 3, 4, 5, 6, 7, 8]])
MASK = np.asarray([[1] * 8, [1] * 6 + [0] * 2])


def _build(family, dtype):
  hf = tiny_hf(family, dtype=torch.float64 if dtype == jnp.float64 else torch.float32)
  if dtype == jnp.float64:
    exact_float64(hf)
  return hf, zoo_twin(hf, dtype)


def _rel(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.abs(a - b).max() / np.abs(b).max())


@pytest.mark.parametrize("family", FAMILIES)
def test_float32_logits_match_transformers(family):
  # (float64: test_float64_logits_and_the_same_edit_through_a_door_and_a_torch_hook)
  hf, lm = _build(family, jnp.float32)
  with torch.no_grad():
    ref = hf(torch.tensor(TOKENS), attention_mask=torch.tensor(MASK)).logits.numpy()
  ours = jax.jit(lm.model.apply)(lm.variables, jnp.asarray(TOKENS), jnp.asarray(MASK))
  real = MASK.astype(bool)  # padded query positions are not compared
  err = _rel(np.asarray(ours)[real], ref[real])
  assert err <= 1e-4, err


def _hook_modules(family, hf):
  """The torch modules whose outputs are ``blocks_1/mlp_out`` and ``blocks_1/resid_post``, and
  an upstream weight with its zoo path (torch's Linear weight is the transposed kernel)."""
  if family == "gpt_neox":
    layers = hf.gpt_neox.layers
    return layers[1].mlp, layers[1], layers[0].mlp.dense_h_to_4h.weight, "dense_h_to_4h"
  layers = hf.model.layers
  mlp_out = layers[1].post_feedforward_layernorm if family.startswith("gemma") else layers[1].mlp
  return mlp_out, layers[1], layers[0].mlp.up_proj.weight, "up_proj"


def _replace_output(fn):
  def hook(module, args, output):
    if isinstance(output, tuple):
      return (fn(output[0]),) + tuple(output[1:])
    return fn(output)

  return hook


@pytest.mark.parametrize("family", EDIT_FAMILIES)
def test_float64_logits_and_the_same_edit_through_a_door_and_a_torch_hook(family):
  """The float64 logits with padding, and two edits (logits and an upstream weight's gradient)
  against the same torch forward hooks, all from one jitted call."""
  hf, lm = _build(family, jnp.float64)
  mlp, layer, weight, proj = _hook_modules(family, hf)
  direction = np.linspace(-1.0, 1.0, 32)
  probe = np.random.default_rng(0).normal(size=TOKENS.shape + (64,))
  cases = [
    (mlp, lambda y: torch.zeros_like(y), jl.when(jl.module("blocks_1/mlp_out"), jl.zero_ablate())),
    (
      layer,
      lambda y: y + 2.5 * torch.tensor(direction),
      jl.when(jl.module("blocks_1/resid_post"), jl.steer(jnp.asarray(direction), 2.5)),
    ),
  ]
  x, mask = jnp.asarray(TOKENS), jnp.asarray(MASK)

  def run(v, spec=None):
    return (spec.bind(lm.model) if spec else lm.model.apply)(v, x)

  def edited(v, spec):
    return run(v, spec), jax.grad(lambda w: (run(w, spec) * probe).sum())(v)

  @jax.jit
  def everything(v):
    return lm.model.apply(v, x, mask), [edited(v, spec) for _, _, spec in cases]

  masked, results = everything(lm.variables)
  with torch.no_grad():
    ref = hf(torch.tensor(TOKENS), attention_mask=torch.tensor(MASK)).logits.numpy()
  real = MASK.astype(bool)  # padded query positions are not compared
  err = _rel(np.asarray(masked)[real], ref[real])
  assert err <= 1e-10, err
  for (module, fn, _), (ours, grads) in zip(cases, results, strict=True):
    handle = module.register_forward_hook(_replace_output(fn))
    try:
      hf.zero_grad()
      out = hf(torch.tensor(TOKENS)).logits
      (out * torch.tensor(probe)).sum().backward()
    finally:
      handle.remove()
    assert _rel(ours, out.detach().numpy()) <= 1e-10
    # the edit changed something (the first row is unpadded: the plain logits)
    assert not np.allclose(ours[0], masked[0])
    ours_grad = grads["params"]["blocks_0"]["mlp"][proj]["kernel"]
    assert _rel(ours_grad, weight.grad.detach().numpy().T) <= 1e-10


PROMPT = np.asarray([[3, 9, 4, 17, 5, 9], [1, 2, 3, 4, 5, 6]])
N, MAGNITUDE = 8, 4.0


@pytest.mark.parametrize("family", GENERATE_FAMILIES)
def test_steered_greedy_generation_matches_transformers(family):
  hf, lm = _build(family, jnp.float32)
  layer = _hook_modules(family, hf)[1]
  direction = np.linspace(-1.0, 1.0, 32).astype(np.float32)
  spec = jl.when(jl.module("blocks_1/resid_post"), jl.steer(jnp.asarray(direction), MAGNITUDE))
  ours = jl.generate(lm.model, lm.variables, jnp.asarray(PROMPT), N, intervene=spec)

  tokens, logits = steered_generate(hf, layer, PROMPT, N, torch.tensor(direction), MAGNITUDE)
  np.testing.assert_array_equal(ours.tokens, tokens)
  assert _rel(ours.logits, logits) <= 1e-4


@pytest.mark.parametrize("family", ["qwen3", "gemma3"])
def test_a_saved_hugging_face_directory_loads(family, tmp_path):
  from jaxlens.models import load_hf

  hf, lm = _build(family, jnp.float32)
  hf.save_pretrained(tmp_path, safe_serialization=True)
  loaded = load_hf(tmp_path)
  assert loaded.config == lm.config
  with torch.no_grad():
    ref = hf(torch.tensor(TOKENS)).logits.numpy()
  assert _rel(jax.jit(loaded.model.apply)(loaded.variables, jnp.asarray(TOKENS)), ref) <= 1e-4
