"""The causal-cone sweep equals the plain patching sweep (tiny random float32 decoders)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxlens as jl
from jaxlens.sweep import cone_sweep
from jaxlens.models import (
  GPT2,
  Gemma3,
  Gemma3Config,
  GPT2Config,
  GPTNeoX,
  GPTNeoXConfig,
  Llama,
  LlamaConfig,
)
from jaxlens.models.moe import MoEConfig

VOCAB, SEQ = 40, 7
MODELS = {
  "llama": lambda: Llama(
    LlamaConfig(
      vocab_size=VOCAB, d_model=32, n_layers=3, n_heads=4, n_kv_heads=2, d_mlp=48, rope_base=500.0
    )
  ),
  "gpt2": lambda: GPT2(
    GPT2Config(
      vocab_size=VOCAB, d_model=32, n_layers=3, n_heads=4, max_len=16, tie_embeddings=False
    )
  ),
  # local layers with a window of 3 < SEQ: run_block keeps the window
  "gemma3": lambda: Gemma3(
    Gemma3Config(
      vocab_size=VOCAB,
      d_model=32,
      n_layers=3,
      n_heads=4,
      n_kv_heads=2,
      head_dim=8,
      d_mlp=48,
      sliding_window=3,
      sliding_window_pattern=2,
      final_softcap=5.0,
    )
  ),
  "gpt_neox": lambda: GPTNeoX(GPTNeoXConfig(vocab_size=VOCAB, d_model=32, n_layers=3, n_heads=4)),
  # OLMoE-like: norms after the sub-blocks, QK-norm over the projection, experts as the MLP
  "llama_moe": lambda: Llama(
    LlamaConfig(
      vocab_size=VOCAB,
      d_model=32,
      n_layers=3,
      n_heads=4,
      n_kv_heads=2,
      d_mlp=48,
      qk_norm=True,
      qk_norm_scope="proj",
      norm_placement="post",
      moe=MoEConfig(n_experts=4, top_k=2, d_expert=16),
    )
  ),
}


def _init(model):
  rng = np.random.default_rng(0)
  shapes = jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((1, 4), jnp.int32))

  def draw(path, leaf):
    name = jax.tree_util.keystr(path[-1:])
    if "bias" in name:
      return jnp.zeros(leaf.shape, leaf.dtype)
    if "scale" in name or "weight" in name:
      return jnp.ones(leaf.shape, leaf.dtype)
    return jnp.asarray(rng.normal(0.0, 0.3, leaf.shape), leaf.dtype)

  return jax.tree_util.tree_map_with_path(draw, shapes)


def logit_diff(logits):
  return (logits[:, -1, 3] - logits[:, -1, 5]).mean()


def whole_output(logits):  # reads every position: the cells' earlier columns must be right
  weights = jnp.linspace(-1.0, 1.0, logits.shape[1], dtype=logits.dtype)
  return (logits * weights[None, :, None]).sum() / 100.0


@pytest.mark.parametrize("family", sorted(MODELS))
def test_cone_sweep_equals_the_plain_sweep(family):
  model = MODELS[family]()
  variables = _init(model)
  rng = np.random.default_rng(1)
  clean = jnp.asarray(rng.integers(0, VOCAB, (2, SEQ)), jnp.int32)
  corrupt = clean.at[:, 2].set((clean[:, 2] + 7) % VOCAB).at[:, 5].set(1)
  metric = whole_output if family in ("gpt2", "gemma3") else logit_diff
  site = "resid_pre" if family in ("gpt2", "gemma3") else "resid_post"
  layers, positions = (0, 1, 2), (0, 2, 3, 6)
  by_default = {} if site == "resid_pre" else {"site": site}
  cone = cone_sweep(model, variables, clean, corrupt, metric, positions=positions, **by_default)
  sites = tuple(f"blocks_{k}/{site}" for k in layers)
  # A zoo model's default sites are the residual stream entering each block: GPT-2's sweep
  # runs without sites=.
  assert model.layer_sites() == tuple(f"blocks_{k}/resid_pre" for k in layers)
  # Both sweeps default to these sites (issue 31: cone_sweep defaulted to resid_post).
  by_default = {} if site == "resid_pre" else {"sites": sites}
  plain = jl.sweep.patching_sweep(
    model, variables, clean, corrupt, metric, positions=positions, **by_default
  )
  np.testing.assert_allclose(cone, plain, atol=1e-5, rtol=1e-5)
  assert float(jnp.abs(plain - plain[:, :1]).max()) > 1e-2  # the cells differ
  if family not in ("llama", "gemma3"):
    return
  # Both sweeps run a decoder's residual stream through run_block (llama: one block loop over
  # the scanned form; gemma3, whose layers differ: gated copies of each block); the generic
  # path (a replay of the corrupt trace per site, every op of the model's own call) agrees.
  replayed = jl.sweep._patching._sweep(
    model,
    variables,
    clean,
    corrupt,
    metric=metric,
    sites=sites,
    positions=positions,
    batch_size=None,
    replay=True,
  )
  np.testing.assert_allclose(plain, replayed, atol=1e-5, rtol=1e-5)
  if family != "llama":
    return
  # a subset of layers, in another order, gives the same rows
  sub = cone_sweep(
    model, variables, clean, corrupt, metric, layers=(2, 0), positions=positions, site=site
  )
  np.testing.assert_allclose(sub, plain[jnp.asarray([2, 0])], atol=1e-5, rtol=1e-5)


def test_bad_input_gets_typed_errors():
  model = MODELS["llama"]()
  x = jnp.zeros((1, SEQ), jnp.int32)
  cases = [
    ({"positions": (SEQ,)}, "index_out_of_range"),
    ({"layers": (3,)}, "index_out_of_range"),
    ({"site": "mlp_out"}, "invalid_argument"),
  ]
  for kw, code in cases:
    with pytest.raises(jl.InvalidArgumentError) as e:
      cone_sweep(model, {}, x, x, logit_diff, **kw)
    assert e.value.code == code
  with pytest.raises(jl.ShapeError):
    cone_sweep(model, {}, x, x[:, :3], logit_diff)
  import flax.linen as nn

  with pytest.raises(jl.InvalidArgumentError, match=r"protocol\.Decoder") as e:
    cone_sweep(nn.Dense(3), {}, x, x, logit_diff)
  assert e.value.code == "invalid_argument"
