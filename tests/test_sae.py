"""jaxlens.sae dictionaries as data: pytrees under jit/grad/vmap in every float dtype, the
cross-layer transcoder, the Gemma Scope layout, and every typed refusal."""

import json

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from jaxlens import sae as jsae

D_IN, D_SAE = 6, 16


def _sae(activation="relu", dtype=jnp.float32, seed=0, **config):
  k = {"topk": 3, "batchtopk": 2.0, "abstopk": 3}.get(activation)
  d = jsae.SAE.init(
    jax.random.key(seed), D_IN, D_SAE, activation=activation, k=k, dtype=dtype, **config
  )
  # Non-zero biases and thresholds, so that every term is exercised.
  return d.replace(
    b_enc=jnp.linspace(-0.1, 0.1, D_SAE).astype(dtype),
    b_dec=jnp.linspace(-0.2, 0.3, d.d_out).astype(dtype),
    threshold=None if d.threshold is None else jnp.full((D_SAE,), 0.02, dtype),
  )


X = np.random.default_rng(0).normal(size=(4, D_IN)).astype(np.float32)


@pytest.mark.parametrize("activation", jsae.ACTIVATIONS)
def test_encode_decode_are_pure_under_jit_grad_vmap(activation):
  d = _sae(activation)
  acts = d.encode(X)
  assert acts.shape == (4, D_SAE) and bool((acts >= 0).all() or activation == "abstopk")
  if activation in ("topk", "abstopk"):
    assert int((acts != 0).sum(-1).max()) <= 3
  if activation == "batchtopk":
    assert int((acts != 0).sum()) <= 2 * 4
  np.testing.assert_allclose(jax.jit(lambda d, x: d(x))(d, X), d(X), rtol=1e-6)
  np.testing.assert_allclose(d(X), d.decode(acts, X), rtol=1e-6)
  grads = jax.grad(lambda d: jnp.sum(d(X) ** 2))(d)
  assert type(grads) is jsae.SAE and float(jnp.abs(grads.W_dec).sum()) > 0
  if activation != "batchtopk":  # BatchTopK couples the rows of a batch by design
    rows = jax.vmap(lambda r: d(r[None])[0])(jnp.asarray(X))
    np.testing.assert_allclose(rows, d(X), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16, jnp.float32, jnp.float64])
def test_every_float_dtype(dtype):
  d = _sae("jumprelu", dtype=dtype)
  out = d(X)
  assert out.dtype == dtype and d.encode(X).dtype == dtype
  ref = _sae("jumprelu", dtype=jnp.float64)
  tol = {jnp.float16: 5e-2, jnp.bfloat16: 2e-1}.get(dtype, 1e-5)
  np.testing.assert_allclose(np.asarray(out, np.float64), np.asarray(ref(X)), atol=tol, rtol=tol)


def test_transcoder_with_and_without_skip():
  t = jsae.Transcoder.init(jax.random.key(1), D_IN, D_SAE, d_out=5, skip=True)
  t = t.replace(W_skip=jnp.ones((5, D_IN), jnp.float32))
  assert t(X).shape == (4, 5)
  np.testing.assert_allclose(t(X), t.decode(t.encode(X)) + X @ t.W_skip.T, rtol=1e-6)
  plain = jsae.Transcoder.init(jax.random.key(1), D_IN, D_SAE, d_out=5)
  assert plain.W_skip is None and plain(X).shape == (4, 5)
  assert jax.jit(lambda t: t(X))(t).shape == (4, 5)


def test_cross_layer_transcoder_writes_every_later_layer():
  clt = jsae.CrossLayerTranscoder.init(jax.random.key(2), 3, D_IN, D_SAE, 5)
  xs = jnp.asarray(np.random.default_rng(1).normal(size=(3, 4, D_IN)), jnp.float32)
  acts = clt.encode(xs)
  out = clt(xs)
  assert acts.shape == (3, 4, D_SAE) and out.shape == (3, 4, 5)
  # Layer 2's output is the sum of the three layers' features through their decoders.
  want = clt.b_dec[2] + sum(acts[s] @ clt.W_dec[s][2 - s] for s in range(3))
  np.testing.assert_allclose(out[2], want, rtol=1e-5)
  # Layer 0's features reach layer 2: zeroing them changes it.
  assert not np.allclose(clt.decode(acts.at[0].set(0.0))[2], out[2])
  np.testing.assert_allclose(clt.decode(acts.at[2].set(0.0))[:2], out[:2])
  np.testing.assert_allclose(
    clt.layer(1)(xs[1]), clt.decode_layer(1, acts.at[0].set(0.0)), rtol=1e-5
  )
  g = jax.jit(jax.grad(lambda c: c(xs).sum()))(clt)
  assert len(g.W_dec) == 3 and g.W_dec[0].shape == (3, D_SAE, 5)


def test_gemma_scope_npz_and_safetensors(tmp_path):
  rng = np.random.default_rng(3)
  params = {
    "W_enc": rng.normal(size=(D_IN, D_SAE)).astype(np.float32),
    "W_dec": rng.normal(size=(D_SAE, D_IN)).astype(np.float32),
    "b_enc": rng.normal(size=(D_SAE,)).astype(np.float32),
    "b_dec": rng.normal(size=(D_IN,)).astype(np.float32),
    "threshold": np.abs(rng.normal(size=(D_SAE,))).astype(np.float32),
  }
  np.savez(tmp_path / "params.npz", **params)
  d = jsae.load_gemma_scope(tmp_path)
  assert d.activation == "jumprelu" and not d.apply_b_dec_to_input
  pre = X @ params["W_enc"] + params["b_enc"]
  want = (np.maximum(pre, 0) * (pre > params["threshold"])) @ params["W_dec"] + params["b_dec"]
  np.testing.assert_allclose(d(X), want, rtol=1e-5)
  from safetensors.numpy import save_file

  save_file({k.lower(): v for k, v in params.items()}, str(tmp_path / "tc.safetensors"))
  again = jsae.load_gemma_scope(tmp_path / "tc.safetensors")
  np.testing.assert_allclose(again(X), want, rtol=1e-5)
  np.savez(tmp_path / "nan.npz", **dict(params, threshold=np.full(D_SAE, np.nan, np.float32)))
  with pytest.raises(jsae.SAEError, match=r"\[sae_weights_invalid\].*threshold holds 16 NaN"):
    jsae.load_gemma_scope(tmp_path / "nan.npz")
  short = dict(params, W_dec=params["W_dec"][:, :5], b_dec=params["b_dec"][:5])
  np.savez(tmp_path / "t.npz", **short)
  assert isinstance(jsae.load_gemma_scope(tmp_path / "t.npz"), jsae.Transcoder)


def test_round_trip_of_the_directory_format(tmp_path):
  d = _sae("topk", rescale_acts_by_decoder_norm=True, metadata_json='{"hook_name": "h"}')
  jsae.save_saelens(d, tmp_path / "d")
  jsae.save_saelens(d, tmp_path / "d")  # replaces a dictionary directory
  back = jsae.load_saelens(tmp_path / "d")
  assert back.k == 3 and back.rescale_acts_by_decoder_norm and back.metadata["hook_name"] == "h"
  np.testing.assert_array_equal(back(X), d(X))
  assert sorted(p.name for p in tmp_path.iterdir()) == ["d"]


# -- typed refusals ---------------------------------------------------------------------------


def _dir(tmp_path, cfg=None, tensors=None):
  from safetensors.numpy import save_file

  path = tmp_path / "bad"
  path.mkdir(exist_ok=True)
  base = {
    "d_in": D_IN,
    "d_sae": D_SAE,
    "architecture": "standard",
    "dtype": "float32",
    "metadata": {"sae_lens_version": "6.54.12"},
  }
  (path / "cfg.json").write_text(
    cfg if isinstance(cfg, str) else json.dumps({**base, **(cfg or {})})
  )
  rng = np.random.default_rng(0)
  arrays = {
    "W_enc": rng.normal(size=(D_IN, D_SAE)).astype(np.float32),
    "b_enc": np.zeros(D_SAE, np.float32),
    "W_dec": rng.normal(size=(D_SAE, D_IN)).astype(np.float32),
    "b_dec": np.zeros(D_IN, np.float32),
  }
  arrays.update(tensors or {})
  save_file(
    {k: v for k, v in arrays.items() if v is not None}, str(path / "sae_weights.safetensors")
  )
  return path


@pytest.mark.parametrize(
  "cfg, tensors, code, field",
  [
    ({"architecture": "matching_pursuit"}, None, "sae_architecture_unsupported", "architecture"),
    ({"d_in": "six"}, None, "sae_config_invalid", "d_in"),
    ({"d_sae": None}, None, "sae_config_invalid", "d_sae"),
    ({"apply_b_dec_to_input": "yes"}, None, "sae_config_invalid", "apply_b_dec_to_input"),
    ({"dtype": "int8"}, None, "sae_config_invalid", "dtype"),
    ({"architecture": "topk", "k": 0}, None, "sae_config_invalid", "k"),
    ({"normalize_activations": "whiten"}, None, "sae_config_invalid", "normalize_activations"),
    ({}, {"W_dec": None}, "sae_weights_invalid", "W_dec"),
    ({}, {"b_enc": np.zeros(3, np.float32)}, "sae_weights_invalid", "b_enc"),
    ({"architecture": "jumprelu"}, None, "sae_weights_invalid", "threshold"),
    ({}, {"b_dec": np.full(D_IN, np.nan, np.float32)}, "sae_weights_invalid", "b_dec"),
    ({}, {"W_enc": np.full((D_IN, D_SAE), np.inf, np.float32)}, "sae_weights_invalid", "W_enc"),
    ("{not json", None, "sae_config_invalid", "cfg.json"),
    ("[1, 2]", None, "sae_config_invalid", "cfg.json"),
  ],
)
def test_bad_saelens_files_name_the_field(tmp_path, cfg, tensors, code, field):
  with pytest.raises(jsae.SAEError, match=rf"\[{code}\]") as info:
    jsae.load_saelens(_dir(tmp_path, cfg, tensors))
  assert info.value.fields["field"] == field


def test_missing_and_unreadable_files(tmp_path):
  with pytest.raises(jsae.SAEError, match=r"\[sae_file_missing\]") as info:
    jsae.load_saelens(tmp_path)
  assert info.value.fields["field"] == "cfg.json"
  path = _dir(tmp_path)
  (path / "sae_weights.safetensors").write_bytes(b"garbage")
  with pytest.raises(jsae.SAEError, match=r"\[sae_weights_invalid\]"):
    jsae.load_saelens(path)
  with pytest.raises(jsae.SAEError, match=r"\[sae_file_missing\]"):
    jsae.load_gemma_scope(tmp_path / "nothing.npz")
  (tmp_path / "empty").mkdir()
  with pytest.raises(jsae.SAEError, match=r"\[sae_file_missing\]"):
    jsae.load_gemma_scope(tmp_path / "empty")
  (tmp_path / "bad.npz").write_bytes(b"garbage")
  with pytest.raises(jsae.SAEError, match=r"\[sae_weights_invalid\]"):
    jsae.load_gemma_scope(tmp_path / "bad.npz")
  np.savez(tmp_path / "partial.npz", W_enc=np.zeros((2, 3)))
  with pytest.raises(jsae.SAEError, match=r"\[sae_weights_invalid\]") as info:
    jsae.load_gemma_scope(tmp_path / "partial.npz")
  assert info.value.fields["field"] == "W_dec"
  np.savez(
    tmp_path / "flat.npz",
    W_enc=np.zeros(3),
    W_dec=np.zeros(3),
    b_enc=np.zeros(3),
    b_dec=np.zeros(3),
  )
  with pytest.raises(jsae.SAEError, match=r"\[sae_weights_invalid\]"):
    jsae.load_gemma_scope(tmp_path / "flat.npz")


def test_bad_dictionaries(tmp_path):
  d = _sae()
  with pytest.raises(jsae.SAEError, match=r"\[sae_config_invalid\]") as info:
    d.replace(activation="gelu")
  assert info.value.fields["field"] == "activation"
  with pytest.raises(jsae.SAEError, match=r"\[sae_config_invalid\]"):
    d.replace(activation="topk", k=None)
  with pytest.raises(jsae.SAEError, match=r"\[sae_config_invalid\]") as info:
    d.replace(activation="jumprelu", threshold=None)
  assert info.value.fields["field"] == "threshold"
  with pytest.raises(jsae.SAEError, match=r"\[sae_weights_invalid\]") as info:
    d.replace(b_dec=jnp.zeros(3))
  assert info.value.fields["field"] == "b_dec"
  with pytest.raises(jsae.SAEError, match=r"\[sae_weights_invalid\]"):
    d.replace(W_enc=jnp.zeros(3))
  with pytest.raises(jsae.SAEError, match=r"\[sae_shape_mismatch\]"):
    d.encode(jnp.zeros((2, 5)))
  normed = d.replace(normalize_activations="layer_norm")
  with pytest.raises(jsae.SAEError, match=r"\[sae_decode_needs_input\]"):
    normed.decode(normed.encode(X))
  with pytest.raises(jsae.SAEError, match=r"\[sae_config_invalid\]"):
    jsae.Transcoder.init(jax.random.key(0), D_IN, D_SAE, d_out=5).replace(apply_b_dec_to_input=True)
  t = jsae.Transcoder.init(jax.random.key(0), D_IN, D_SAE, d_out=5)
  # As SAELens: the output is decode(encode(norm(x))), the normalisation not undone.
  ln = t.replace(normalize_activations="layer_norm")
  np.testing.assert_allclose(ln(X), ln.decode(ln.encode(X)), rtol=1e-6)
  with pytest.raises(jsae.SAEError, match=r"\[sae_architecture_unsupported\]") as info:
    jsae.save_saelens(_sae("batchtopk"), tmp_path / "b")
  assert "to_jumprelu" in info.value.fields["fix"]
  (tmp_path / "file").write_text("x")
  with pytest.raises(jsae.SAEError, match=r"\[sae_file_exists\]"):
    jsae.save_saelens(d, tmp_path / "file")
  clt = jsae.CrossLayerTranscoder.init(jax.random.key(0), 2, D_IN, D_SAE)
  with pytest.raises(jsae.SAEError, match=r"\[sae_weights_invalid\]"):
    jsae.CrossLayerTranscoder(clt.W_enc, clt.b_enc, list(clt.W_dec), clt.b_dec)
  with pytest.raises(jsae.SAEError, match=r"\[sae_weights_invalid\]") as info:
    jsae.CrossLayerTranscoder(clt.W_enc, clt.b_enc, (clt.W_dec[0], clt.W_dec[0]), clt.b_dec)
  assert info.value.fields["field"] == "W_dec[1]"
  with pytest.raises(jsae.SAEError, match=r"\[sae_config_invalid\]"):
    jsae.CrossLayerTranscoder(clt.W_enc, clt.b_enc, clt.W_dec, clt.b_dec, activation="jumprelu")


def test_feature_view_page_and_figure(tmp_path):
  d = _sae("relu")
  acts = np.random.default_rng(4).normal(size=(3, 5, D_IN)).astype(np.float32)
  tokens = [[f"t{s}{p}<" for p in range(5)] for s in range(3)]
  unembed = np.random.default_rng(5).normal(size=(D_IN, 10)).astype(np.float32)
  vocab = [f"v{i}" for i in range(10)]
  encoded = np.asarray(d.encode(acts))
  f = int(np.argmax((encoded > 0).mean((0, 1))))
  view = jsae.feature_view(
    d,
    acts,
    tokens,
    features=[f],
    unembed=unembed,
    vocabulary=vocab,
    contexts=2,
    window=3,
    top_logits=3,
  )
  (feat,) = view.features
  peak = np.unravel_index(np.argmax(encoded[..., f]), encoded.shape[:2])
  assert feat.contexts[0][0] == pytest.approx(float(encoded[..., f].max()))
  assert feat.contexts[0][1][-1][0] == tokens[peak[0]][peak[1]]
  effect = np.asarray(d.W_dec[f]) @ unembed
  assert [t for t, _ in feat.top_logits] == [vocab[i] for i in np.argsort(effect)[::-1][:3]]
  page = view.to_html(tmp_path / "f.html").read_text()
  assert f"feature {f}" in page and "&lt;" in page  # tokens are escaped
  assert len(view.figure().axes) == 2
  with pytest.raises(jsae.SAEError, match=r"\[sae_shape_mismatch\]"):
    jsae.feature_view(d, acts[:2], tokens, features=[0])
