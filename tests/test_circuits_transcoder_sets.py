"""Sets of per-layer transcoders for jaxlens.circuits: a layer given ``None`` (its whole MLP
output is its error node) and the files ``circuits.save_transcoders`` writes."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxlens import circuits, sae
from jaxlens.models import GPT2, GPT2Config

D, L, F64 = 16, 2, jnp.float64
TOKENS = jnp.asarray([1, 5, 7, 3, 9], jnp.int32)


def _model():
  model = GPT2(
    GPT2Config(
      vocab_size=31, d_model=D, n_layers=L, n_heads=4, max_len=8, tie_embeddings=False, dtype=F64
    )
  )
  rng = np.random.default_rng(0)
  shapes = jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((1, 4), jnp.int32))

  def draw(path, leaf):
    name = jax.tree_util.keystr(path[-1:])
    mean = 1.0 if "scale" in name else 0.0
    return jnp.asarray(rng.normal(mean, 0.2 if mean else 0.3, leaf.shape), leaf.dtype)

  return model, jax.tree_util.tree_map_with_path(draw, shapes)


def _transcoder(i, **kw):
  t = sae.Transcoder.init(jax.random.key(i), d_in=D, d_sae=24, dtype=F64, **kw)
  return t.replace(W_enc=t.W_enc * 10, b_enc=t.b_enc - 0.2, W_dec=t.W_dec * 3.0)


def test_a_layer_without_a_transcoder_is_its_error_node():
  # With layer 0's transcoder (no b_dec) the layer's MLP output is its features' writes plus
  # its error; without it (None) it is one error node. The frozen model is linear in the
  # writes, so every edge out of that error node is the sum of the other graph's edges out of
  # the features and the error at its position, and nothing else changes.
  model, variables = _model()
  t0 = _transcoder(0)
  t0 = t0.replace(b_dec=jnp.zeros_like(t0.b_dec))
  t1 = _transcoder(1)
  full = circuits.attribute(model, variables, TOKENS, [t0, t1], batch_size=32)
  none = circuits.attribute(model, variables, TOKENS, [None, t1], batch_size=32)
  fa, na = full.active_features, none.active_features
  assert (fa[:, 0] == 0).any() and not (na[:, 0] == 0).any()
  np.testing.assert_array_equal(na, fa[fa[:, 0] == 1])
  np.testing.assert_array_equal(none.logit_tokens, full.logit_tokens)
  a_full, a_none = np.asarray(full.adjacency), np.asarray(none.adjacency)
  sf, sn, seq = full.node_slices(), none.node_slices(), len(TOKENS)
  # Rows: the layer-1 features and the logits, in both graphs.
  rows_full = np.r_[np.flatnonzero(fa[:, 0] == 1), np.arange(sf["logits"].start, len(a_full))]
  rows_none = np.r_[np.arange(none.n_features), np.arange(sn["logits"].start, len(a_none))]
  for pos in range(seq):
    feats = np.flatnonzero((fa[:, 0] == 0) & (fa[:, 1] == pos))
    want = a_full[np.ix_(rows_full, feats)].sum(1) + a_full[rows_full, sf["errors"].start + pos]
    got = a_none[rows_none, sn["errors"].start + pos]
    np.testing.assert_allclose(got, want, atol=1e-11 * np.abs(a_full).max())
  later = np.r_[np.arange(seq, 2 * seq)]  # layer 1's errors, then the tokens
  np.testing.assert_allclose(
    a_none[np.ix_(rows_none, sn["errors"].start + later)],
    a_full[np.ix_(rows_full, sf["errors"].start + later)],
    atol=1e-11 * np.abs(a_full).max(),
  )
  np.testing.assert_allclose(
    a_none[rows_none, sn["tokens"]], a_full[rows_full, sf["tokens"]], atol=1e-11
  )
  with pytest.raises(circuits.CircuitError, match="at least one given") as e:
    circuits.attribute(model, variables, TOKENS, [None, None])
  assert e.value.code == "invalid_argument"
  # Setting a feature of a layer without a transcoder would write nothing: every entry point
  # refuses it, naming the layer (before anything runs).
  edit = [(1, 2, 3, 0.0), (0, 2, 3, 5.0)]
  for call in (
    circuits.feature_intervention,
    circuits.intervention_spec,
    lambda *a: circuits.feature_intervention_generate(*a, 2),
  ):
    with pytest.raises(circuits.CircuitError, match="layer 0, which has no transcoder") as e:
      call(model, variables, TOKENS, [None, t1], edit)
    assert e.value.code == "invalid_argument" and e.value.fields["site"] == "blocks_0/mlp"
  # A graph with layer-0 features read through transcoders without one there.
  with pytest.raises(circuits.CircuitError, match="features at layer 0, which has no") as e:
    circuits.head_loadings(model, variables, TOKENS, [None, t1], full, [(0, 1)])
  assert e.value.code == "invalid_argument"
  with pytest.raises(circuits.CircuitError, match="features at layer 0, which has no"):
    circuits.qk_attribution(model, variables, TOKENS, [None, t1], full, 1, 0, 3, 2)


def test_save_transcoders_writes_circuit_tracers_files_and_reads_them_back(tmp_path):
  from safetensors.numpy import load_file

  jump = _transcoder(0, skip=True).replace(
    activation="jumprelu", threshold=jnp.linspace(0.0, 0.5, 24, dtype=F64)
  )
  relu = _transcoder(1)
  path = circuits.save_transcoders([jump, None, relu], tmp_path / "tc")
  assert sorted(p.name for p in path.iterdir()) == [
    "layer_0.safetensors",
    "layer_2.safetensors",
    "transcoders.json",
  ]
  # circuit-tracer's SingleLayerTranscoder layout: W_enc is (features, d_model).
  raw = load_file(str(path / "layer_0.safetensors"))
  assert raw["W_enc"].shape == (24, D) and "activation_function.threshold" in raw
  back = circuits.load_circuit_tracer(path)
  assert back[1] is None and back[2].W_skip is None and back[2].activation == "relu"
  x = jnp.asarray(np.random.default_rng(0).normal(size=(4, D)))
  for a, b in ((back[0], jump), (back[2], relu)):
    np.testing.assert_array_equal(np.asarray(a(x)), np.asarray(b(x)))
  # one layer's file, and a list of them, as circuit-tracer names them
  listed = circuits.load_circuit_tracer(
    [path / "layer_0.safetensors", path / "layer_2.safetensors"]
  )
  np.testing.assert_array_equal(np.asarray(listed[1].W_dec), np.asarray(relu.W_dec))

  def refused(code, match, *args, **kw):
    with pytest.raises(circuits.CircuitError, match=match) as e:
      circuits.save_transcoders(*args, **kw)
    assert e.value.code == code

  refused("circuit_file_exists", "exists", [relu], path)
  assert circuits.save_transcoders([relu], path, overwrite=True) == path
  assert len(circuits.load_circuit_tracer(path)) == 1
  refused("circuit_file_exists", "not a set of transcoders", [relu], tmp_path, overwrite=True)
  refused("invalid_argument", "at least one given", [None], tmp_path / "x")
  refused("invalid_argument", "got Transcoder", relu, tmp_path / "x")
  topk = relu.replace(activation="topk", k=2)
  refused("invalid_argument", "activation 'topk'", [topk], tmp_path / "x")
  assert not (tmp_path / "x").exists()
  meta = json.loads((path / "transcoders.json").read_text())
  (path / "transcoders.json").write_text(json.dumps(meta | {"files": ["../evil"]}))
  with pytest.raises(circuits.CircuitError, match="not an index") as e:
    circuits.load_circuit_tracer(path)
  assert e.value.code == "circuit_file_corrupt"
  (path / "transcoders.json").write_text("{")
  with pytest.raises(circuits.CircuitError, match="not readable"):
    circuits.load_circuit_tracer(path)
