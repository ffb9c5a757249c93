"""The zoo's scanned form (scan_layers=True): the same numbers as the unrolled form, sites named
through layer=, one block in the compiled program, variables converted both ways."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxlens as jl
from jaxlens.models import GPT2, GPT2Config, Llama, LlamaConfig, scan

TOKENS = jnp.asarray([[3, 1, 4, 1, 5, 9]])
CONFIGS = {
  "llama": (
    Llama,
    LlamaConfig(vocab_size=32, d_model=16, n_layers=3, n_heads=2, n_kv_heads=1, d_mlp=24),
  ),
  "gpt2": (GPT2, GPT2Config(vocab_size=32, d_model=16, n_layers=3, n_heads=2, max_len=16)),
}


@pytest.fixture(scope="module", params=list(CONFIGS))
def pair(request):
  cls, cfg = CONFIGS[request.param]
  cfg = dataclasses.replace(cfg, dtype=jnp.float64)
  unrolled = cls(cfg)
  # Random values of the init's shapes (an init, traced and compiled, costs seconds here).
  shapes = jax.eval_shape(unrolled.init, jax.random.key(0), TOKENS)
  rng = np.random.default_rng(0)
  variables = jax.tree.map(lambda s: jnp.asarray(0.2 * rng.normal(size=s.shape), s.dtype), shapes)
  return unrolled, variables, cls(dataclasses.replace(cfg, scan_layers=True))


def test_scanned_equals_unrolled_with_sites_and_edits_through_layer(pair):
  unrolled, variables, scanned = pair
  stacked = scan.stack_blocks(variables, 3)
  assert jax.tree.leaves(stacked["params"]["blocks"])[0].shape[0] == 3
  # The conversion round-trips, and the scanned init has the same structure.
  back = scan.unstack_blocks(stacked)
  assert jax.tree.structure(back) == jax.tree.structure(variables)
  init = jax.eval_shape(scanned.init, jax.random.key(0), TOKENS)
  assert jax.tree.structure(init) == jax.tree.structure(stacked)
  d = jnp.linspace(-1, 1, 16)

  def both(v, sv):
    flat = jl.when(jl.module("blocks_1/resid_mid"), jl.steer(d, 2.0))
    scanned_rule = jl.when(jl.module("blocks/resid_mid", layer=1), jl.steer(d, 2.0))
    t = jl.trace(unrolled, v, TOKENS, save=jl.module("blocks_*/resid_post"), intervene=flat)
    ts = jl.trace(scanned, sv, TOKENS, save=jl.module("blocks/resid_post"), intervene=scanned_rule)
    return t.output, t.values, ts.output, ts.values, unrolled.apply(v, TOKENS)

  out, values, out_s, values_s, plain = jax.jit(both)(variables, stacked)
  np.testing.assert_allclose(out_s, out, atol=1e-12)
  assert values_s["blocks/resid_post"].shape == (3,) + values["blocks_0/resid_post"].shape
  for k in range(3):
    np.testing.assert_allclose(values_s["blocks/resid_post"][k], values[f"blocks_{k}/resid_post"])
  assert np.abs(plain - out).max() > 1e-3  # the steer changed the output
  # One block in the scanned program, three in the unrolled: two blocks' products fewer.
  jaxprs = [
    str(jax.make_jaxpr(m.apply)(v, TOKENS)) for m, v in ((unrolled, variables), (scanned, stacked))
  ]
  dots = [j.count("dot_general") for j in jaxprs]
  assert jaxprs[1].count("scan[") == 1 and dots[1] < dots[0] and (dots[0] - dots[1]) % 2 == 0


def _last_logit(logits):
  return logits[:, -1, 3].mean()


@pytest.mark.parametrize("pair", ["llama"], indirect=True)  # the scan is the same helper
def test_generation_and_the_sweeps_are_the_same_in_both_forms(pair):
  unrolled, variables, scanned = pair
  stacked = scan.stack_blocks(variables, 3)
  a = jl.generate(unrolled, variables, TOKENS, 4)
  b = jl.generate(scanned, stacked, TOKENS, 4)
  np.testing.assert_array_equal(a.tokens, b.tokens)
  np.testing.assert_allclose(a.logits, b.logits, atol=1e-12)
  # The sweeps take either form (the unrolled one is converted inside the compiled call); the
  # scanned form names its layers' sites blocks/resid_pre[k].
  corrupt = TOKENS.at[:, 2].set(7)
  assert scanned.layer_sites() == tuple(f"blocks/resid_pre[{k}]" for k in range(3))
  grids = [
    jl.sweep.patching_sweep(m, v, TOKENS, corrupt, _last_logit, positions=(0, 2, 5))
    for m, v in ((unrolled, variables), (scanned, stacked))
  ]
  np.testing.assert_allclose(grids[1], grids[0], atol=1e-12, rtol=0)
  assert float(jnp.abs(grids[0][:, 1] - grids[0][:, 0]).max()) > 1e-3  # the cells differ
  cone = jl.sweep.cone_sweep(scanned, stacked, TOKENS, corrupt, _last_logit, positions=(0, 2, 5))
  np.testing.assert_allclose(cone, grids[0], atol=1e-12, rtol=0)
  with pytest.raises(jl.InvalidArgumentError, match="needs the params of blocks_0 .. blocks_3"):
    scan.stack_blocks(variables, 4)


def test_mixed_windows_cannot_scan():
  cfg = LlamaConfig(
    vocab_size=32,
    d_model=16,
    n_layers=2,
    n_heads=2,
    n_kv_heads=1,
    d_mlp=24,
    sliding_window=4,
    layer_types=("sliding_attention", "full_attention"),
    scan_layers=True,
  )
  with pytest.raises(jl.InvalidArgumentError, match="sliding windows differ"):
    jax.eval_shape(Llama(cfg).init, jax.random.key(0), TOKENS)
