"""The zoo's newer families on tiny random configs, without torch: Gemma 3 (local and global
layers), a Mistral-style Llama (every layer local), Qwen2/3 options and GPT-NeoX. The same
block sites as every family, windowed attention patterns, left padding, KV-cache decoding past
the window (a local layer's cache is a ring of the window's length), jl.generate equal to the
uncached forward's greedy tokens, and the dtypes under jit, vmap and grad."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxlens as jl
from jaxlens.models import (
  Gemma3,
  Gemma3Config,
  GPTNeoX,
  GPTNeoXConfig,
  Llama,
  LlamaConfig,
  LoadError,
  load_gguf,
)

WINDOW = 3
GEMMA = Gemma3Config(
  vocab_size=64,
  d_model=32,
  n_layers=2,
  n_heads=4,
  n_kv_heads=2,
  head_dim=8,
  d_mlp=48,
  sliding_window=WINDOW,
  layer_types=("sliding_attention", "full_attention"),
  rope_base=1000.0,
  rope_local_base=100.0,
  attn_softcap=20.0,
  final_softcap=10.0,
  dtype=jnp.float64,
)
MISTRAL = LlamaConfig(
  vocab_size=64,
  d_model=32,
  n_layers=2,
  n_heads=4,
  n_kv_heads=2,
  d_mlp=48,
  qkv_bias=True,
  qk_norm=True,
  sliding_window=WINDOW,
  dtype=jnp.float64,
)
NEOX = GPTNeoXConfig(
  vocab_size=64, d_model=32, n_layers=2, n_heads=4, rotary_pct=0.5, dtype=jnp.float64
)
TOKENS = jnp.asarray(
  [[3, 9, 4, 17, 5, 9, 26, 2, 11, 7], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]], jnp.int32
)
BLOCK_SITES = {
  "resid_pre",
  "attn/q",
  "attn/k",
  "attn/v",
  "attn/scores",
  "attn/pattern",
  "attn/z",
  "attn_out",
  "resid_mid",
  "mlp/pre",
  "mlp/post",
  "mlp_out",
  "resid_post",
}
MODELS = {"gemma3": (Gemma3, GEMMA), "mistral": (Llama, MISTRAL), "gpt_neox": (GPTNeoX, NEOX)}


def _model(name, dtype=jnp.float64):
  cls, cfg = MODELS[name]
  return cls(cfg.__class__(**{**cfg.__dict__, "dtype": dtype}))


@functools.cache
def _variables(name):
  """The float64 model's parameters (one initialiser compile per family for the module)."""
  return jax.jit(_model(name).init)(jax.random.key(0), TOKENS)


@functools.cache
def _forward64(name):
  """The float64 model's jitted forward, shared by the tests that run it alone."""
  return jax.jit(_model(name).apply)


@pytest.fixture(scope="module", params=list(MODELS))
def family(request):
  return request.param, _model(request.param), _variables(request.param)


def test_sites_windows_and_the_residual_sums(family):
  name, model, variables = family
  t = jax.jit(lambda v: jl.trace(model, v, TOKENS, keep_inputs=False))(variables)
  have = {lbl[len("blocks_1/") :] for lbl in t.labels if lbl.startswith("blocks_1/")}
  assert BLOCK_SITES <= have, BLOCK_SITES - have
  assert model.layer_sites() == ("blocks_0/resid_pre", "blocks_1/resid_pre")
  assert isinstance(model, jl.protocol.Decoder)
  for i in range(2):
    b = f"blocks_{i}/"
    np.testing.assert_allclose(
      t[b + "resid_mid"].out, t[b + "resid_pre"].out + t[b + "attn_out"].out, atol=1e-12
    )
    np.testing.assert_allclose(
      t[b + "resid_post"].out, t[b + "resid_mid"].out + t[b + "mlp_out"].out, atol=1e-12
    )
  # Which keys each query sees: the last WINDOW tokens in a local layer, all before it in a global.
  seen = [(np.asarray(t[f"blocks_{i}/attn/pattern"].out) > 0).sum(-1) for i in range(2)]
  windowed = np.minimum(np.arange(1, 11), WINDOW)
  full = np.arange(1, 11)
  local = {"gemma3": (True, False), "mistral": (True, True), "gpt_neox": (False, False)}[name]
  for i in range(2):
    assert (seen[i] == (windowed if local[i] else full)).all(), (i, seen[i][0, 0])
  if name == "gemma3":  # the logits are soft-capped
    assert float(jnp.abs(t["logits"].out).max()) < GEMMA.final_softcap


def test_left_padding(family):
  name, model, variables = family
  row, pad = TOKENS[:1, :7], 3
  padded = jnp.concatenate([jnp.zeros((1, pad), jnp.int32), row], 1)
  mask = jnp.asarray([[0] * pad + [1] * 7])
  positions = jnp.maximum(jnp.cumsum(mask, 1) - 1, 0)
  out, ref = jax.jit(lambda v: (model.apply(v, padded, mask, positions), model.apply(v, row)))(
    variables
  )
  np.testing.assert_allclose(out[:, pad:], ref, atol=1e-10)


def test_kv_cache_past_the_window_and_the_local_ring(family):
  name, model, variables = family
  shapes = jax.eval_shape(
    lambda: model.init(jax.random.key(0), jnp.zeros((2, 10), jnp.int32), decode=True)
  )["cache"]
  for i, local in enumerate({"gemma3": (1, 0), "mistral": (1, 1), "gpt_neox": (0, 0)}[name]):
    # A local layer keeps WINDOW keys whatever the cache's length; a global one all 10.
    assert shapes[f"blocks_{i}"]["attn"]["cached_key"].shape[1] == (WINDOW if local else 10)

  @jax.jit
  def run(v):
    cache = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
    outs = []
    for lo, hi in ((0, 5), (5, 6), (6, 8), (8, 9), (9, 10)):  # a prefill, then short steps
      out, state = model.apply(
        {**v, "cache": cache}, TOKENS[:, lo:hi], decode=True, mutable=["cache"]
      )
      cache = state["cache"]
      outs.append(out)
    return model.apply(v, TOKENS), jnp.concatenate(outs, axis=1)

  full, decoded = run(variables)
  np.testing.assert_allclose(decoded, full, atol=1e-10)


def test_generate_equals_the_uncached_greedy_tokens(family):
  name, model, variables = family
  prompt, n = TOKENS[:, :4], 9
  out = jl.generate(model, variables, prompt, n)
  forward = _forward64(name)
  ids = np.zeros((2, 4 + n), np.int32)  # causal: the zeros after the last token change nothing
  ids[:, :4] = prompt
  for k in range(4, 4 + n):
    ids[:, k] = np.argmax(forward(variables, jnp.asarray(ids))[:, k - 1], -1)
  np.testing.assert_array_equal(out.tokens, ids[:, 4:])


@pytest.mark.parametrize("name", ["gemma3", "gpt_neox"])
def test_bfloat16_under_jit_vmap_grad(name):
  dtype = jnp.bfloat16  # float32 and float64 run in the parity tests
  variables64 = _variables(name)
  model = _model(name, dtype)
  variables = jax.tree.map(lambda a: a.astype(dtype), variables64)

  @jax.jit
  def run(v):
    logits = model.apply(v, TOKENS)
    rows = jax.vmap(lambda t: model.apply(v, t[None])[0])(TOKENS)
    grads = jax.grad(lambda w: model.apply(w, TOKENS).astype(jnp.float32).sum())(v)
    return logits, rows, grads

  logits, rows, grads = run(variables)
  assert logits.dtype == dtype
  up = jax.tree.map(lambda a: a.astype(jnp.float64), variables)
  ref = np.asarray(_forward64(name)(up, TOKENS))
  tol = 0.05 * np.abs(ref).max()
  np.testing.assert_allclose(np.asarray(logits, np.float64), ref, rtol=0, atol=tol)
  np.testing.assert_allclose(
    np.asarray(rows, np.float64), np.asarray(logits, np.float64), rtol=0, atol=tol
  )
  assert all(bool(jnp.isfinite(g).all()) for g in jax.tree.leaves(grads))
  assert np.asarray(grads["params"]["blocks_0"]["attn"]["q_proj"]["kernel"]).any()


def test_gemma3_gguf_refusals(tmp_path):
  gguf = pytest.importorskip("gguf")
  path = tmp_path / "g.gguf"
  writer = gguf.GGUFWriter(str(path), "gemma3")
  writer.add_block_count(2)
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()
  with pytest.raises(LoadError, match="llama-architecture") as e:
    load_gguf(path, weights="int8")
  assert e.value.code == "invalid_argument"
  with pytest.raises(LoadError, match="gemma3.attention.head_count") as e:
    load_gguf(path)  # a file without the architecture's fields names the first missing one
  assert e.value.code == "missing_tensor"
  half = tmp_path / "half"
  half.write_bytes(path.read_bytes()[:10])
  with pytest.raises(LoadError, match="SHA-256") as e:
    load_gguf([path, half], sha256="0" * 64)
  assert e.value.code == "truncated_file"
  with pytest.raises(LoadError, match="no such file") as e:
    load_gguf([path, tmp_path / "missing"])
  assert e.value.code == "file_not_found"
