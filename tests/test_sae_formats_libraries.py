"""Dictionary files other libraries write: sparsify, dictionary_learning, Llama Scope, Gemma Scope 2,
connor-rob hook_z and circuit-tracer.

Each file is laid out here as its library writes it (the names, shapes and config fields of
``sparsify.SparseCoder.save_to_disk`` 1.3.3, ``dictionary_learning``'s ``trainSAE`` 0.1.0, and
the layouts SAELens 6.54.12's pretrained loaders read), and jaxlens's reading is checked against
the library's forward written out in numpy. ``benchmarks/sae_formats_agreement.py`` checks the
same readers against files the libraries themselves wrote, and against SAELens's loaders.

In the ``saelens`` xdist group: the ``.pt`` files need torch, which that worker has imported.
"""

import json

import numpy as np
import pytest
from safetensors.numpy import save_file

import jax.numpy as jnp

from jaxlens import sae as jsae
from jaxlens.circuits import load_circuit_tracer

from lazy_import import LazyModule, missing

pytestmark = pytest.mark.xdist_group("saelens")
torch = LazyModule("torch")
needs_torch = pytest.mark.skipif(bool(missing("torch")), reason="needs torch for .pt files")

D, F, K = 6, 20, 4
RNG = np.random.default_rng(0)
X = RNG.normal(size=(9, D)).astype(np.float32)


def rand(*shape, scale=0.5):
  return (RNG.normal(size=shape) * scale).astype(np.float32)


def close(a, b, tol=2e-6):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  assert a.shape == b.shape
  assert np.abs(a - b).max() <= tol * max(np.abs(b).max(), 1.0)


def relu(a):
  return np.maximum(a, 0)


def topk_rows(a, k):
  out = np.zeros_like(a)
  idx = np.argsort(-a, axis=-1)[..., :k]
  np.put_along_axis(out, idx, np.take_along_axis(a, idx, -1), -1)
  return out


def field(info):
  return info.value.fields["code"], info.value.fields["field"]


# -- sparsify ------------------------------------------------------------------------------


def write_sparsify(root, *, transcode=False, skip=False, **cfg_changes):
  """sparsify 1.3.3's save_to_disk: safetensors of the module's state dict, and cfg.json of
  SparseCoderConfig.to_dict() plus d_in."""
  root.mkdir(parents=True)
  w = {"encoder.weight": rand(F, D), "encoder.bias": rand(F), "W_dec": rand(F, D), "b_dec": rand(D)}
  if skip:
    w["W_skip"] = rand(D, D)
  save_file(w, str(root / "sae.safetensors"))
  cfg = {
    "activation": "topk",
    "expansion_factor": 32,
    "normalize_decoder": True,
    "num_latents": F,
    "k": K,
    "multi_topk": False,
    "skip_connection": skip,
    "transcode": transcode,
    "d_in": D,
    **cfg_changes,
  }
  (root / "cfg.json").write_text(json.dumps(cfg))
  return w


def sparsify_forward(w, x, transcode):
  # SparseCoder.forward: fused_encoder (relu, then top-k), decode, + x @ W_skip.T
  pre = relu((x if transcode else x - w["b_dec"]) @ w["encoder.weight"].T + w["encoder.bias"])
  acts = topk_rows(pre, K)
  out = acts @ w["W_dec"] + w["b_dec"]
  return acts, (out + x @ w["W_skip"].T if "W_skip" in w else out)


@pytest.mark.parametrize(
  "transcode, skip", [(False, False), (False, True), (True, False), (True, True)]
)
def test_sparsify_reads_as_sparsify_computes_and_writes_back(tmp_path, transcode, skip):
  w = write_sparsify(tmp_path / "run" / "layers.2.mlp", transcode=transcode, skip=skip)
  d = jsae.load_sparsify(tmp_path / "run" / "layers.2.mlp")
  assert isinstance(d, jsae.Transcoder) == (transcode or skip) and d.k == K
  acts, out = sparsify_forward(w, X, transcode)
  close(d.encode(X), acts)
  close(d(X), out)
  assert (np.asarray(d.encode(X)) != 0).sum() == (acts != 0).sum() > 0
  meta = d.metadata
  assert meta["hook_name"] == "layers.2.mlp"
  assert meta["site"] == ("blocks_2/ln_2" if transcode else "blocks_2/mlp_out")
  jsae.save_sparsify(d, tmp_path / "back")
  cfg = json.loads((tmp_path / "back" / "cfg.json").read_text())
  assert set(cfg) == set(json.loads((tmp_path / "run/layers.2.mlp/cfg.json").read_text()))
  assert (cfg["transcode"], cfg["skip_connection"]) == (transcode or skip, skip)
  again = jsae.load_sparsify(tmp_path / "back")
  close(again.encode(X), acts)
  close(again(X), out)


def test_sparsify_refusals(tmp_path):
  write_sparsify(tmp_path / "run" / "layers.0", activation="groupmax")
  write_sparsify(tmp_path / "run" / "layers.1", signed=True)
  with pytest.raises(jsae.SAEError) as info:
    jsae.load_sparsify(tmp_path / "run")  # the run's directory, not a hookpoint's
  assert field(info) == ("sae_file_missing", "cfg.json") and "layers.0" in str(info.value)
  with pytest.raises(jsae.SAEError) as info:
    jsae.load_sparsify(tmp_path / "run" / "layers.0")
  assert field(info) == ("sae_architecture_unsupported", "activation")
  with pytest.raises(jsae.SAEError) as info:
    jsae.load_sparsify(tmp_path / "run" / "layers.1")
  assert field(info) == ("sae_architecture_unsupported", "signed")
  w = write_sparsify(tmp_path / "nodec")
  del w["W_dec"]
  save_file(w, str(tmp_path / "nodec" / "sae.safetensors"))
  with pytest.raises(jsae.SAEError) as info:
    jsae.load_sparsify(tmp_path / "nodec")
  assert field(info) == ("sae_weights_invalid", "W_dec")
  relu_sae = jsae.SAE(W_enc=rand(D, F), b_enc=rand(F), W_dec=rand(F, D), b_dec=rand(D))
  with pytest.raises(jsae.SAEError) as info:
    jsae.save_sparsify(relu_sae, tmp_path / "x")
  assert field(info) == ("sae_architecture_unsupported", "activation")
  wide = jsae.Transcoder(
    W_enc=rand(D, F), b_enc=rand(F), W_dec=rand(F, 3), b_dec=rand(3), activation="topk", k=K
  )
  with pytest.raises(jsae.SAEError) as info:
    jsae.save_sparsify(wide, tmp_path / "x")
  assert field(info) == ("sae_architecture_unsupported", "d_out")


def test_sparsify_writes_an_sae_without_b_dec_input_as_the_same_function(tmp_path):
  d = jsae.SAE(
    W_enc=rand(D, F),
    b_enc=rand(F),
    W_dec=rand(F, D),
    b_dec=rand(D),
    activation="topk",
    k=K,
    apply_b_dec_to_input=False,
  )
  jsae.save_sparsify(d, tmp_path / "s")
  back = jsae.load_sparsify(tmp_path / "s")
  assert back.apply_b_dec_to_input  # sparsify always subtracts b_dec: it went into b_enc
  close(back.encode(X), d.encode(X), 1e-5)
  close(back(X), d(X), 1e-5)


# -- dictionary_learning --------------------------------------------------------------------


def dl_state(name):
  """The state dict each dictionary_learning 0.1.0 class saves (its parameters and buffers)."""
  linear = {"encoder.weight": rand(F, D), "encoder.bias": rand(F), "decoder.weight": rand(D, F)}
  direct = {"W_enc": rand(D, F), "b_enc": rand(F), "W_dec": rand(F, D), "b_dec": rand(D)}
  return {
    "AutoEncoder": lambda: {"bias": rand(D), **linear},
    "AutoEncoderNew": lambda: {**linear, "decoder.bias": rand(D)},
    "GatedAutoEncoder": lambda: {
      "decoder_bias": rand(D),
      "encoder.weight": rand(F, D),
      "r_mag": rand(F),
      "gate_bias": rand(F),
      "mag_bias": rand(F),
      "decoder.weight": rand(D, F),
    },
    "JumpReluAutoEncoder": lambda: {**direct, "threshold": np.abs(rand(F))},
    "AutoEncoderTopK": lambda: {**linear, "b_dec": rand(D), "k": K, "threshold": 0.3},
    "BatchTopKSAE": lambda: {**linear, "b_dec": rand(D), "k": K, "threshold": 0.3},
    "MatryoshkaBatchTopKSAE": lambda: {
      **direct,
      "k": K,
      "threshold": 0.3,
      "group_sizes": [5, 5, 10],
    },
  }[name]()


def dl_forward(name, s, x):
  """Each class's default encode and forward (``use_threshold`` defaults included)."""
  if name == "AutoEncoder":
    # from_pretrained(normalize_decoder=True): unit decoder columns, the encoder scaled by them
    n = np.linalg.norm(s["decoder.weight"], axis=0)
    acts = relu((x - s["bias"]) @ (s["encoder.weight"] * n[:, None]).T + s["encoder.bias"] * n)
    return acts, acts @ (s["decoder.weight"] / n).T + s["bias"]
  if name == "AutoEncoderNew":
    acts = relu(x @ s["encoder.weight"].T + s["encoder.bias"])
    return acts, acts @ s["decoder.weight"].T + s["decoder.bias"]
  if name == "GatedAutoEncoder":
    x_enc = (x - s["decoder_bias"]) @ s["encoder.weight"].T
    gate = (x_enc + s["gate_bias"] > 0).astype(np.float32)
    acts = gate * relu(np.exp(s["r_mag"]) * x_enc + s["mag_bias"])
    return acts, acts @ s["decoder.weight"].T + s["decoder_bias"]
  if name == "JumpReluAutoEncoder":
    pre = x @ s["W_enc"] + s["b_enc"]
    acts = relu(pre * (pre > s["threshold"]))
    return acts, acts @ s["W_dec"] + s["b_dec"]
  if name in ("AutoEncoderTopK", "BatchTopKSAE"):
    post = relu((x - s["b_dec"]) @ s["encoder.weight"].T + s["encoder.bias"])
    acts = topk_rows(post, K) if name == "AutoEncoderTopK" else post * (post > s["threshold"])
    return acts, acts @ s["decoder.weight"].T + s["b_dec"]
  post = relu((x - s["b_dec"]) @ s["W_enc"] + s["b_enc"])
  acts = post * (post > s["threshold"])
  return acts, acts @ s["W_dec"] + s["b_dec"]


DL_CLASSES = [
  "AutoEncoder",
  "AutoEncoderNew",
  "GatedAutoEncoder",
  "JumpReluAutoEncoder",
  "AutoEncoderTopK",
  "BatchTopKSAE",
  "MatryoshkaBatchTopKSAE",
]


def save_pt(state, path):
  torch.save({k: torch.tensor(np.asarray(v)) for k, v in state.items()}, str(path))


@needs_torch
def test_dictionary_learning_classes_read_as_their_forward(tmp_path):
  for name in DL_CLASSES:
    s = dl_state(name)
    run = tmp_path / name / "trainer_0"
    (run / "checkpoints").mkdir(parents=True)
    # trainSAE's files: config.json ({"trainer": trainer.config}), ae.pt, checkpoints/ae_{step}.pt
    (run / "config.json").write_text(json.dumps({"trainer": {"dict_class": name, "layer": 3}}))
    save_pt(s, run / "ae.pt")
    save_pt(s, run / "checkpoints" / "ae_10.pt")
    acts, out = dl_forward(name, {k: np.asarray(v, np.float32) for k, v in s.items()}, X)
    # a checkpoint file reads as the trainer's directory does (config.json one level up)
    wheres = (run, run / "checkpoints" / "ae_10.pt") if name == "AutoEncoderTopK" else (run,)
    for where in wheres:
      d = jsae.load_dictionary_learning(where)
      close(d.encode(X), acts)
      close(d(X), out)
      assert d.metadata["dict_class"] == name and d.metadata["layer"] == 3
    assert ((np.asarray(d.encode(X)) != 0) == (acts != 0)).all() and (acts != 0).any(), name


@needs_torch
def test_dictionary_learning_refusals(tmp_path):
  s = dl_state("BatchTopKSAE")
  save_pt(s, tmp_path / "ae.pt")
  with pytest.raises(jsae.SAEError) as info:  # TopK and BatchTopK save the same tensors
    jsae.load_dictionary_learning(tmp_path)
  assert field(info) == ("sae_config_invalid", "dict_class")
  d = jsae.load_dictionary_learning(tmp_path, dict_class="BatchTopKSAE")
  close(d(X), dl_forward("BatchTopKSAE", s, X)[1])
  with pytest.raises(jsae.SAEError) as info:
    jsae.load_dictionary_learning(tmp_path, dict_class="CrossCoder")
  assert field(info) == ("sae_architecture_unsupported", "dict_class")
  save_pt({**s, "decoder.weight": rand(D + 1, F)}, tmp_path / "ae.pt")
  with pytest.raises(jsae.SAEError) as info:
    jsae.load_dictionary_learning(tmp_path, dict_class="BatchTopKSAE")
  assert field(info) == ("sae_weights_invalid", "decoder.weight")
  (tmp_path / "ae.pt").write_bytes(b"not a zip")
  with pytest.raises(jsae.SAEError) as info:
    jsae.load_dictionary_learning(tmp_path, dict_class="BatchTopKSAE")
  assert field(info) == ("sae_weights_invalid", "ae.pt")


# -- Llama Scope ----------------------------------------------------------------------------


def test_llama_scope_reads_as_saelens_folds_it(tmp_path):
  root = tmp_path / "Llama3_1-8B-Base-L5R-8x"
  (root / "checkpoints").mkdir(parents=True)
  hyper = {
    "d_model": D,
    "d_sae": F,
    "act_fn": "jumprelu",
    "jump_relu_threshold": 0.2,
    "dataset_average_activation_norm": {"in": 4.0, "out": 4.0},
    "hook_point_in": "blocks.5.hook_resid_post",
    "hook_point_out": "blocks.5.hook_resid_post",
  }
  (root / "hyperparams.json").write_text(json.dumps(hyper))
  w = {
    "encoder.weight": rand(F, D),
    "encoder.bias": rand(F),
    "decoder.weight": rand(D, F),
    "decoder.bias": rand(D),
  }
  save_file(w, str(root / "checkpoints" / "final.safetensors"))
  d = jsae.load_llama_scope(root)
  # SAELens: W_enc = encoder.weight.T, threshold jump_relu_threshold * s, then
  # fold_activation_norm_scaling_factor(s): W_enc * s, W_dec / s, b_dec / s.
  s = D**0.5 / 4.0
  pre = X @ (w["encoder.weight"].T * s) + w["encoder.bias"]
  acts = relu(pre) * (pre > 0.2 * s)
  close(d.encode(X), acts)
  close(d(X), acts @ (w["decoder.weight"].T / s) + w["decoder.bias"] / s)
  assert (acts != 0).any() and not d.apply_b_dec_to_input
  assert d.metadata["site"] == "blocks_5/resid_post"
  # written back: the same function, the norm written as sqrt(d_model)
  jsae.save_llama_scope(d, tmp_path / "back")
  back = jsae.load_llama_scope(tmp_path / "back")
  close(back.encode(X), acts)
  assert back.metadata["hook_name"] == "blocks.5.hook_resid_post"
  per_feature = d.replace(threshold=d.threshold * jnp.linspace(1, 2, F, dtype=d.dtype))
  with pytest.raises(jsae.SAEError) as info:
    jsae.save_llama_scope(per_feature, tmp_path / "x")
  assert field(info) == ("sae_architecture_unsupported", "threshold")
  with pytest.raises(jsae.SAEError) as info:
    jsae.save_llama_scope(d.replace(metadata_json="{}"), tmp_path / "x")
  assert field(info) == ("sae_config_invalid", "hook_name")
  (root / "hyperparams.json").write_text(json.dumps({**hyper, "act_fn": "topk"}))
  with pytest.raises(jsae.SAEError) as info:
    jsae.load_llama_scope(root)
  assert field(info) == ("sae_architecture_unsupported", "act_fn")
  del hyper["dataset_average_activation_norm"]
  (root / "hyperparams.json").write_text(json.dumps(hyper))
  with pytest.raises(jsae.SAEError) as info:
    jsae.load_llama_scope(root)
  assert field(info) == ("sae_config_invalid", "dataset_average_activation_norm")


# -- Gemma Scope 2 --------------------------------------------------------------------------


def gemma_scope_2(root, d_in, d_out, **extra):
  root.mkdir(parents=True)
  w = {
    "w_enc": rand(d_in, F),
    "w_dec": rand(F, d_out),
    "b_enc": rand(F),
    "b_dec": rand(d_out),
    "threshold": np.abs(rand(F, scale=0.2)),
    **extra,
  }
  save_file(w, str(root / "params.safetensors"))
  (root / "config.json").write_text(json.dumps({"architecture": "jump_relu"}))
  return w


def test_gemma_scope_2_affine_transcoder_and_attn_out(tmp_path):
  skip = rand(D, 5)  # affine_skip_connection is stored (d_in, d_out)
  tc = tmp_path / "transcoder_all" / "layer_4_width_16k_l0_small_affine"
  w = gemma_scope_2(tc, D, 5, affine_skip_connection=skip)
  d = jsae.load_gemma_scope(tc)
  assert isinstance(d, jsae.Transcoder) and d.W_skip.shape == (5, D)
  pre = X @ w["w_enc"] + w["b_enc"]
  acts = relu(pre) * (pre > w["threshold"])
  close(d(X), acts @ w["w_dec"] + w["b_dec"] + X @ skip)
  assert (d.metadata["site"], d.metadata["site_out"]) == ("blocks_4/ln_2", "blocks_4/mlp_out")
  jsae.save_gemma_scope(d, tmp_path / "back" / tc.name, model_name="gemma-v3-270m-pt")
  back = jsae.load_gemma_scope(tmp_path / "back" / tc.name)
  np.testing.assert_array_equal(back.W_skip, d.W_skip)
  close(back(X), acts @ w["w_dec"] + w["b_dec"] + X @ skip)
  # an SAE that subtracts b_dec is written with it folded into b_enc (Gemma Scope does not)
  sub = jsae.SAE(**{n: getattr(d, n) for n in ("W_enc", "b_enc", "threshold")},
                 W_dec=rand(F, D), b_dec=rand(D), activation="jumprelu")  # fmt: skip
  jsae.save_gemma_scope(sub, tmp_path / "sub", model_name="m")
  close(jsae.load_gemma_scope(tmp_path / "sub")(X), sub(X), 1e-5)
  with pytest.raises(jsae.SAEError) as info:
    jsae.save_gemma_scope(sub, tmp_path / "x")
  assert field(info) == ("sae_config_invalid", "model_name")
  with pytest.raises(jsae.SAEError) as info:
    jsae.save_gemma_scope(sub.replace(activation="relu", threshold=None), tmp_path / "x")
  assert field(info) == ("sae_architecture_unsupported", "activation")
  # attn_out: the output projection's input, heads concatenated; the zoo's attn/z is per head
  at = tmp_path / "attn_out" / "layer_4_width_16k_l0_small"
  w = gemma_scope_2(at, 6, 6)
  d = jsae.load_gemma_scope(at)
  assert d.metadata["site"] == "blocks_4/attn/z" and d.reshape_activations == "hook_z"
  z = RNG.normal(size=(2, 5, 3, 2)).astype(np.float32)  # (batch, seq, heads, head_dim)
  flat = z.reshape(2, 5, 6)
  pre = flat @ w["w_enc"] + w["b_enc"]
  acts = relu(pre) * (pre > w["threshold"])
  close(d.encode(z), acts)
  close(d(z), (acts @ w["w_dec"] + w["b_dec"]).reshape(z.shape))
  close(d(flat), acts @ w["w_dec"] + w["b_dec"])


def test_gemma_scope_refusals(tmp_path):
  rp = tmp_path / "resid_post" / "layer_1_width_16k_l0_big"
  gemma_scope_2(rp, D, D)
  (rp / "config.json").write_text(json.dumps({"architecture": "topk"}))
  with pytest.raises(jsae.SAEError) as info:
    jsae.load_gemma_scope(rp)
  assert field(info) == ("sae_architecture_unsupported", "architecture")
  clt = tmp_path / "clt" / "layer_1_width_16k"
  gemma_scope_2(clt, D, D)
  save_file(
    {"w_enc": rand(D, F), "w_dec": rand(F, 2, D), "b_enc": rand(F), "b_dec": rand(D)},
    str(clt / "params.safetensors"),
  )
  with pytest.raises(jsae.SAEError) as info:
    jsae.load_gemma_scope(clt)
  assert field(info) == ("sae_weights_invalid", "W_dec")
  # a truncated params.npz (issue 48 item 7: it raised zipfile.BadZipFile)
  np.savez(
    tmp_path / "params.npz", W_enc=rand(D, F), W_dec=rand(F, D), b_enc=rand(F), b_dec=rand(D)
  )
  data = (tmp_path / "params.npz").read_bytes()
  for cut in (len(data) // 2, len(data) - 30):
    (tmp_path / "cut.npz").write_bytes(data[:cut])
    with pytest.raises(jsae.SAEError) as info:
      jsae.load_gemma_scope(tmp_path / "cut.npz")
    assert field(info) == ("sae_weights_invalid", "cut.npz")


def test_gemma_scope_2_cross_layer_transcoder(tmp_path):
  n, xs = 3, RNG.normal(size=(3, 4, D)).astype(np.float32)
  files = []
  for i in range(n):
    w_dec = rand(F, n, D)
    w_dec[:, :i] = 0  # layer i writes to layers i..n-1
    w = {"w_enc": rand(D, F), "w_dec": w_dec, "b_enc": rand(F), "b_dec": rand(D)}
    w["threshold"] = np.abs(rand(F, scale=0.2))
    save_file(w, str(tmp_path / f"layer_{i}_width_16k.safetensors"))
    files.append(w)
  clt = jsae.load_gemma_scope_clt(tmp_path)
  assert isinstance(clt, jsae.CrossLayerTranscoder) and clt.n_layers == n
  acts = []
  for i, w in enumerate(files):  # circuit-tracer's encode: x * (x > threshold) per layer
    pre = xs[i] @ w["w_enc"] + w["b_enc"]
    acts.append(pre * (pre > w["threshold"]))
  out = [files[j]["b_dec"] + sum(acts[i] @ files[i]["w_dec"][:, j] for i in range(j + 1))
         for j in range(n)]  # fmt: skip
  close(clt.encode(xs), np.stack(acts))
  close(clt(xs), np.stack(out))
  # a layer writing to an earlier one, an affine skip, a missing layer: refused
  bad = dict(files[2], w_dec=rand(F, n, D))
  save_file(bad, str(tmp_path / "layer_2_width_16k.safetensors"))
  with pytest.raises(jsae.SAEError) as info:
    jsae.load_gemma_scope_clt(tmp_path)
  assert field(info) == ("sae_weights_invalid", "w_dec")
  save_file(
    dict(files[2], affine_skip_connection=rand(D, D)),
    str(tmp_path / "layer_2_width_16k.safetensors"),
  )
  with pytest.raises(jsae.SAEError) as info:
    jsae.load_gemma_scope_clt(tmp_path)
  assert field(info) == ("sae_architecture_unsupported", "affine_skip_connection")
  (tmp_path / "layer_1_width_16k.safetensors").unlink()
  with pytest.raises(jsae.SAEError) as info:
    jsae.load_gemma_scope_clt(tmp_path)
  assert field(info) == ("sae_file_missing", "layer_1")


# -- connor-rob hook_z, circuit-tracer, sites -------------------------------------------------


@needs_torch
def test_hook_z_sae_reads_the_zoo_attn_z_site(tmp_path):
  heads, d_head = 3, 2
  name = "gpt2-small_L5_Hcat_z_lr1.20e-03_l11.00e+00_ds24576_v9"
  w = {"W_enc": rand(6, F), "b_enc": rand(F), "W_dec": rand(F, 6), "b_dec": rand(6)}
  save_pt(w, tmp_path / f"{name}.pt")
  cfg = {"act_size": heads * d_head, "dict_size": F, "act_name": "blocks.5.attn.hook_z"}
  (tmp_path / f"{name}_cfg.json").write_text(json.dumps(cfg))
  d = jsae.load_hook_z(tmp_path / f"{name}.pt")
  assert d.metadata["site"] == "blocks_5/attn/z" and d.reshape_activations == "hook_z"
  z = RNG.normal(size=(2, 4, heads, d_head)).astype(np.float32)
  flat = z.reshape(2, 4, 6)
  acts = relu((flat - w["b_dec"]) @ w["W_enc"] + w["b_enc"])
  close(d.encode(z), acts)
  close(d(z), (acts @ w["W_dec"] + w["b_dec"]).reshape(z.shape))
  (tmp_path / f"{name}_cfg.json").write_text(json.dumps({**cfg, "dict_size": F + 1}))
  with pytest.raises(jsae.SAEError) as info:
    jsae.load_hook_z(tmp_path / f"{name}.pt")
  assert field(info) == ("sae_weights_invalid", "W_enc")


def test_circuit_tracer_transcoders_are_reachable_from_sae(tmp_path):
  w = {"W_enc": rand(F, D), "W_dec": rand(F, D), "b_enc": rand(F), "b_dec": rand(D)}
  w["activation_function.threshold"] = np.abs(rand(F, scale=0.2))
  save_file(w, str(tmp_path / "layer_0.safetensors"))
  ours = jsae.load_circuit_tracer(tmp_path / "layer_0.safetensors", np.float32)
  theirs = load_circuit_tracer(tmp_path / "layer_0.safetensors", np.float32)
  assert isinstance(ours, jsae.Transcoder) and ours.activation == "jumprelu"
  np.testing.assert_array_equal(ours(X), theirs(X))
  pre = X @ w["W_enc"].T + w["b_enc"]
  close(ours(X), (relu(pre) * (pre > w["activation_function.threshold"])) @ w["W_dec"] + w["b_dec"])


@pytest.mark.parametrize(
  "hook, site",
  [
    ("blocks.0.hook_resid_pre", "blocks_0/resid_pre"),
    ("blocks.11.hook_mlp_out", "blocks_11/mlp_out"),
    ("blocks.3.hook_mlp_in", "blocks_3/ln_2"),
    ("blocks.3.attn.hook_z", "blocks_3/attn/z"),
    ("model.layers.7", "blocks_7/resid_post"),
    ("layers.7.self_attn", "blocks_7/attn_out"),
    ("embed_tokens", "embed"),
    ("blocks.3.hook_nonsense", None),
  ],
)
def test_zoo_site(hook, site):
  assert jsae.zoo_site(hook) == site


def test_dtype_argument(tmp_path):
  write_sparsify(tmp_path / "s")
  assert jsae.load_sparsify(tmp_path / "s").dtype == jnp.float32
  assert jsae.load_sparsify(tmp_path / "s", dtype="bfloat16").dtype == jnp.bfloat16
  assert jsae.load_sparsify(tmp_path / "s", dtype=jnp.float64).dtype == jnp.float64


@needs_torch
def test_a_hook_z_sae_spliced_at_the_zoo_site(tmp_path):
  import jax

  from jaxlens import module, trace
  from jaxlens.models import GPT2, GPT2Config

  model = GPT2(GPT2Config(vocab_size=11, d_model=8, n_layers=1, n_heads=2, max_len=6))
  tokens = jnp.asarray([[1, 2, 3, 4, 5]])
  variables = jax.jit(model.init)(jax.random.key(0), tokens)
  w = {"W_enc": rand(8, F), "b_enc": rand(F, scale=0.1), "W_dec": rand(F, 8), "b_dec": rand(8)}
  save_pt(w, tmp_path / "L0_z.pt")
  cfg = {"act_size": 8, "dict_size": F, "act_name": "blocks.0.attn.hook_z"}
  (tmp_path / "L0_z_cfg.json").write_text(json.dumps(cfg))
  d = jsae.load_hook_z(tmp_path / "L0_z.pt")
  site = d.metadata["site"]
  spliced = jsae.splice(model, site, d)
  run = jax.jit(lambda v, x: trace(spliced, v, x, save=module(f"{site}*"), keep_inputs=False))
  t = run(variables, tokens)
  z = np.asarray(t[site].out)
  assert z.shape == (1, 5, 2, 4)  # (batch, seq, heads, head_dim): the heads flattened to d_in 8
  close(t[f"{site}/sae/acts"].out, d.encode(z), 1e-5)
  close(t[f"{site}/sae/recon"].out, d(z), 1e-5)
  assert np.asarray(t[f"{site}/sae/acts"].out).any()
  close(t.output, jax.jit(model.apply)(variables, tokens), 1e-5)  # recon + error is z
