"""Attribution graphs (jaxlens.circuits) on tiny random float64 decoders: the graph's edges are
the replacement model's real interventions, the frozen forward is the model's own on the prompt,
the gradient under circuit-tracer's stop-gradient freezes gives the same edges, and pruning and
the scores follow circuit-tracer's definitions."""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxlens import circuits, sae
from jaxlens.models import GPT2, Gemma3, Gemma3Config, GPT2Config, Llama, LlamaConfig

# One worker for this file and tests/test_circuits_on_disk.py, which reuses its graphs.
pytestmark = pytest.mark.xdist_group("circuits")

VOCAB, D, L, SAE_WIDTH = 31, 16, 2, 24
F64 = jnp.float64
TOKENS = jnp.asarray([1, 5, 7, 3, 9], jnp.int32)

MODELS = {
  "llama": lambda: Llama(
    LlamaConfig(
      vocab_size=VOCAB, d_model=D, n_layers=L, n_heads=4, n_kv_heads=2, d_mlp=24, dtype=F64
    )
  ),
  "gpt2": lambda: GPT2(
    GPT2Config(
      vocab_size=VOCAB, d_model=D, n_layers=L, n_heads=4, max_len=8, tie_embeddings=False, dtype=F64
    )
  ),
  # post-norms, QK-norm, a final soft-cap and tied embeddings
  "gemma": lambda: Gemma3(
    Gemma3Config(
      vocab_size=VOCAB,
      d_model=D,
      n_layers=L,
      n_heads=4,
      n_kv_heads=2,
      head_dim=4,
      d_mlp=24,
      final_softcap=5.0,
      dtype=F64,
    )
  ),
}


def _init(model):
  rng = np.random.default_rng(0)
  shapes = jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((1, 4), jnp.int32))

  def draw(path, leaf):
    name = jax.tree_util.keystr(path[-1:])
    if "bias" in name:
      return jnp.asarray(rng.normal(0.0, 0.1, leaf.shape), leaf.dtype)
    if "scale" in name or "weight" in name:
      return jnp.asarray(1.0 + rng.normal(0.0, 0.2, leaf.shape), leaf.dtype)
    return jnp.asarray(rng.normal(0.0, 0.3, leaf.shape), leaf.dtype)

  return jax.tree_util.tree_map_with_path(draw, shapes)


def _transcoders(kind):
  if kind == "clt":
    clt = sae.CrossLayerTranscoder.init(jax.random.key(7), n_layers=L, d_in=D, d_sae=SAE_WIDTH)
    clt = jax.tree.map(lambda a: a.astype(F64), clt)
    return clt.replace(
      b_enc=clt.b_enc - 0.3, b_dec=clt.b_dec + 0.05, W_dec=tuple(w * 5.0 for w in clt.W_dec)
    )
  out = []
  for i in range(L):
    t = sae.Transcoder.init(
      jax.random.key(i), d_in=D, d_sae=SAE_WIDTH, dtype=F64, skip=kind == "skip"
    )
    extra = {
      "W_enc": t.W_enc * 10,
      "b_enc": t.b_enc - 0.2,
      "b_dec": t.b_dec + 0.05,
      "W_dec": t.W_dec * 3.0,
    }
    if kind == "skip":
      extra["W_skip"] = jnp.asarray(np.random.default_rng(i).normal(0, 0.2, (D, D)), F64)
    out.append(t.replace(**extra))
  return out


# family -> the transcoders it is tested with (each kind on one family, to keep the cost down)
CASES = {"llama": "skip", "gpt2": "plain", "gemma": "clt"}


@functools.cache
def _build(family):
  model = MODELS[family]()
  variables = _init(model)
  tcs = _transcoders(CASES[family])
  lr = circuits.local_replacement(model, variables, TOKENS, tcs)
  graph = circuits.attribute(model, variables, TOKENS, tcs, batch_size=32, local=lr)
  return family, model, variables, tcs, graph, lr


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request):
  return _build(request.param)


@pytest.fixture(scope="module")
def llama():
  return _build("llama")


@pytest.fixture(scope="module")
def gpt2():
  return _build("gpt2")


def _unembedding(family, variables):
  p = variables["params"]
  return p["embed"]["embedding"] if family == "gemma" else p["lm_head"]["kernel"].T


def _targets(case):
  """``(tok, writes) -> every row target's value``: selected features' pre-activations (their
  linear part) and the logit targets (demeaned unembedding rows at the final norm's output)."""
  family, model, variables, tcs, graph, lr = case
  rep = circuits.replacement(model, tcs)
  feats = graph.active_features[graph.selected_features]
  enc = jnp.stack([rep.W_enc[layer][:, f] for layer, _, f in feats])
  w_u = _unembedding(family, variables)
  vecs = w_u[graph.logit_tokens] - w_u.mean(0)

  @jax.jit
  def targets(tok, writes):
    mlp_in, final = lr.run(tok, writes)
    pre = jnp.einsum("nd,nd->n", mlp_in[feats[:, 0], feats[:, 1]], enc)
    return jnp.concatenate([pre, vecs @ final[-1]])

  return targets, rep


def test_the_frozen_forward_is_the_model_on_the_prompt(case):
  family, model, variables, tcs, graph, lr = case
  mlp_in, final = lr.run(lr.tok, lr.node_writes + lr.errors)
  rec = lr.recording
  want_in = jnp.stack([rec.mlp_in[i][0] for i in range(L)])
  assert float(jnp.abs(mlp_in - want_in).max()) < 1e-12
  assert float(jnp.abs(final - rec.final[0]).max()) < 1e-12
  # the recorded run is the model's own
  logits = jax.jit(model.apply)(variables, TOKENS[None])
  assert float(jnp.abs(rec.logits - logits).max()) < 1e-12
  # and the graph is not trivial
  assert graph.n_features > 20 and graph.n_logits >= 1
  assert np.abs(graph.adjacency).max() > 1e-3


def test_edges_equal_interventions_in_the_frozen_model(case):
  """Ablating one node in the frozen model moves every target by its edge, to rounding."""
  family, model, variables, tcs, graph, lr = case
  targets, rep = _targets(case)
  writes = lr.node_writes + lr.errors
  clean = targets(lr.tok, writes)
  sl = graph.node_slices()
  rows = np.r_[sl["features"], sl["logits"]]
  rng = np.random.default_rng(0)
  feats = rng.choice(graph.n_features, 6, replace=False)

  tok, writes, errors = np.asarray(lr.tok), np.asarray(writes), np.asarray(lr.errors)

  def without_feature(i):
    layer, pos, f = graph.active_features[graph.selected_features[i]]
    a = graph.activation_values[graph.selected_features[i]]
    w = writes.copy()
    for j in range(layer, L):
      if j - layer < rep.W_dec[layer].shape[0]:
        w[j, pos] -= a * np.asarray(rep.W_dec[layer][j - layer, f])
    return w

  ablations = [(tok, without_feature(i), sl["features"].start + i) for i in feats]
  for layer, pos in [(0, 0), (0, 3), (1, 4), (1, 2)]:
    w = writes.copy()
    w[layer, pos] -= errors[layer, pos]
    ablations.append((tok, w, sl["errors"].start + layer * graph.n_pos + pos))
  for pos in (0, 2, 4):
    t = tok.copy()
    t[pos] = 0.0
    ablations.append((t, writes, sl["tokens"].start + pos))
  scale = np.abs(graph.adjacency).max()
  for t, w, col in ablations:
    effect = np.asarray(clean - targets(t, w))
    np.testing.assert_allclose(effect, graph.adjacency[rows, col], rtol=0, atol=1e-11 * scale)
  # direct effects only: a feature cannot reach a target at its own layer or before
  feats_all = graph.active_features[graph.selected_features]
  a_ff = graph.adjacency[sl["features"], sl["features"]]
  if not isinstance(tcs, sae.CrossLayerTranscoder):
    upstream = feats_all[:, 0][None, :] >= feats_all[:, 0][:, None]
    assert np.all(a_ff[upstream] == 0)
  later_pos = feats_all[:, 1][None, :] > feats_all[:, 1][:, None]
  assert np.all(a_ff[later_pos] == 0)


def test_stop_gradient_freezes_on_the_real_model_give_the_same_edges(llama):
  """circuit-tracer's freezing by stop_gradient, on the model's own forward, gives the token
  and error columns of the graph (an independent path: no recorded values)."""
  family, model, variables, tcs, graph, lr = llama
  rep = circuits.replacement(model, tcs)
  feats = graph.active_features[graph.selected_features]
  enc = jnp.stack([rep.W_enc[layer][:, f] for layer, _, f in feats])
  w_u = _unembedding(family, variables)
  vecs = w_u[graph.logit_tokens] - w_u.mean(0)

  def targets(d_tok, d_err):
    got = {}

    def perturb(next_fun, args, kwargs, context):
      out = next_fun(*args, **kwargs)
      path = "/".join(context.module.path)
      if path == "blocks_0/resid_pre":
        return out + d_tok[None]
      if path.endswith("/mlp_out"):
        return out + d_err[int(path.split("/")[0][len("blocks_") :])][None]
      return out

    def read(next_fun, args, kwargs, context):
      path = "/".join(context.module.path)
      if path.endswith("/mlp"):
        got[int(path.split("/")[0][len("blocks_") :])] = args[0][0]
      out = next_fun(*args, **kwargs)
      if path == "ln_final":
        got["final"] = out[0]
      return out

    with nn.intercept_methods(read), nn.intercept_methods(perturb):
      with nn.intercept_methods(circuits.stop_gradient_freeze(rep)):
        model.apply(variables, TOKENS[None])
    mlp_in = jnp.stack([got[i] for i in range(L)])
    pre = jnp.einsum("nd,nd->n", mlp_in[feats[:, 0], feats[:, 1]], enc)
    return jnp.concatenate([pre, vecs @ got["final"][-1]])

  zeros = (jnp.zeros_like(lr.tok), jnp.zeros_like(lr.errors))
  j_tok, j_err = jax.jit(jax.jacrev(targets, argnums=(0, 1)))(*zeros)
  token_cols = np.asarray(jnp.einsum("rsd,sd->rs", j_tok, lr.tok))
  error_cols = np.asarray(jnp.einsum("rlsd,lsd->rls", j_err, lr.errors)).reshape(len(j_tok), -1)
  sl = graph.node_slices()
  rows = np.r_[sl["features"], sl["logits"]]
  scale = np.abs(graph.adjacency).max()
  np.testing.assert_allclose(token_cols, graph.adjacency[rows][:, sl["tokens"]], atol=1e-11 * scale)
  np.testing.assert_allclose(error_cols, graph.adjacency[rows][:, sl["errors"]], atol=1e-11 * scale)


def test_a_node_budget_keeps_exact_rows_of_the_greedy_features(gpt2):
  family, model, variables, tcs, graph, lr = gpt2
  budget = 7
  small = circuits.attribute(
    model,
    variables,
    TOKENS,
    tcs,
    max_feature_nodes=budget,
    batch_size=4,
    update_interval=1,
    local=lr,
  )
  assert small.n_features == budget
  sel = small.selected_features
  cols = np.r_[sel, np.arange(graph.n_features, graph.adjacency.shape[0])]
  rows_small = np.r_[np.arange(budget), small.adjacency.shape[0] - np.arange(small.n_logits, 0, -1)]
  rows_full = np.r_[sel, graph.adjacency.shape[0] - np.arange(graph.n_logits, 0, -1)]
  np.testing.assert_allclose(
    small.adjacency[rows_small], graph.adjacency[rows_full][:, cols], atol=1e-12
  )
  # the first batch (4 features) is the top of the logit rows' influence
  from jaxlens.circuits._prune import partial_influences

  n = graph.adjacency.shape[0]
  logit_rows = graph.adjacency[n - graph.n_logits :]
  # columns before the graph's own reordering: active features first, as attribute builds them
  influence = partial_influences(
    logit_rows, graph.logit_probabilities, np.arange(n - graph.n_logits, n)
  )[: graph.n_features]
  first = set(np.argsort(-influence, kind="stable")[:4])
  assert first <= set(sel)


def test_zero_bos_and_user_directions(gpt2):
  family, model, variables, tcs, graph, lr = gpt2
  bos = circuits.local_replacement(model, variables, TOKENS, tcs, zero_bos=True)
  assert not np.any(np.asarray(bos.acts)[:, 0]) and np.asarray(bos.acts)[:, 1:].any()
  assert not np.any(np.asarray(bos.errors)[:, 0]) and np.asarray(bos.errors)[:, 1:].any()
  mlp_in, final = bos.run(bos.tok, bos.node_writes + bos.errors)  # still the model's values
  assert float(jnp.abs(final - lr.recording.final[0]).max()) < 1e-12
  # a direction read at the final norm's output: its row is that logit's row, rescaled
  w_u = _unembedding(family, variables)
  top = int(graph.logit_tokens[0])
  direction = (w_u[top] - w_u.mean(0))[None] * 2.0
  g = circuits.attribute(model, variables, TOKENS, tcs, directions=direction, local=lr)
  assert g.n_logits == 1 and g.logit_tokens[0] == -1 and g.logit_probabilities[0] == 1.0
  # token targets: the same rows as the salient logits, weighted by their probabilities
  picked = graph.logit_tokens[::-1]
  gt = circuits.attribute(model, variables, TOKENS, tcs, target_tokens=picked, local=lr)
  np.testing.assert_array_equal(gt.logit_tokens, picked)
  np.testing.assert_allclose(gt.logit_probabilities, graph.logit_probabilities[::-1], rtol=1e-12)
  k = graph.n_logits
  np.testing.assert_allclose(gt.adjacency[-k:], graph.adjacency[-k:][::-1], atol=1e-12)
  base = g.adjacency.shape[0] - 1
  np.testing.assert_allclose(
    g.adjacency[-1, :base], 2.0 * graph.adjacency[-graph.n_logits, :base], atol=1e-12
  )


def test_logit_targets_follow_circuit_tracer(case):
  family, model, variables, tcs, graph, lr = case
  probs = np.asarray(jax.nn.softmax(lr.recording.logits[0, -1]))
  order = np.argsort(-probs)
  k = graph.n_logits
  np.testing.assert_array_equal(graph.logit_tokens, order[:k])
  np.testing.assert_allclose(graph.logit_probabilities, probs[order[:k]], rtol=1e-12)
  cum = np.cumsum(probs[order])
  assert k == min(10, int(np.searchsorted(cum, 0.95)) + 1)


# -- pruning and scores --------------------------------------------------------------------


def _sorted_threshold(scores, fraction):  # circuit-tracer's find_threshold, by a full sort
  s = np.sort(np.ravel(scores))[::-1]
  cum = np.cumsum(s) / s.sum()
  return s[min(int(np.searchsorted(cum, fraction)), len(s) - 1)]


@pytest.mark.parametrize("n", [5, 300, 5000])
def test_find_threshold_by_selection_equals_the_sort(n):
  rng = np.random.default_rng(n)
  scores = np.abs(rng.standard_cauchy(n))
  scores[: n // 3] = np.round(scores[: n // 3], 1)  # ties
  scores[rng.random(n) < 0.3] = 0.0
  for fraction in (0.0, 0.5, 0.8, 0.98, 0.999):
    assert circuits.find_threshold(scores, fraction) == _sorted_threshold(scores, fraction)
  assert circuits.find_threshold(scores, 1.0) == scores.min()  # keeps everything


def _hand_graph(adjacency):
  return circuits.Graph(
    adjacency=np.asarray(adjacency, np.float64),
    input_tokens=np.array([0]),
    active_features=np.array([[0, 0, 0]]),
    activation_values=np.array([1.0]),
    selected_features=np.array([0]),
    logit_tokens=np.array([0]),
    logit_probabilities=np.array([1.0]),
    n_layers=1,
  )


def test_scores_on_a_graph_worked_by_hand():
  # nodes: feature, error, token, logit; the feature reads the error and the token equally
  a = [[0, 1, 1, 0], [0, 0, 0, 0], [0, 0, 0, 0], [2, 1, 1, 0]]
  replacement, completeness = circuits.graph_scores(_hand_graph(a))
  # influence: feature 0.5, error 0.25 + 0.25, token 0.25 + 0.25
  assert replacement == pytest.approx(0.5, abs=1e-15)
  # non-error input fractions (0.5, 1, 1, 0.75) weighted by (0.5, 0.5, 0.5, 1) / 2.5
  assert completeness == pytest.approx(0.8, abs=1e-15)


def _prune_by_sorting(graph, node_threshold, edge_threshold):
  """circuit-tracer 0.5's prune_graph as it is written (full sorts), in numpy."""
  a = graph.adjacency
  n_logits, n_tokens, n_features = graph.n_logits, graph.n_pos, graph.n_features
  w = np.zeros(len(a))
  w[-n_logits:] = graph.logit_probabilities

  def influence(m):
    current = w @ m
    total = current.copy()
    while current.any():
      current = current @ m
      total += current
    return total

  def normalize(m):
    m = np.abs(m)
    return m / np.maximum(m.sum(1, keepdims=True), 1e-10)

  node_influence = influence(normalize(a))
  node_mask = node_influence >= _sorted_threshold(node_influence, node_threshold)
  node_mask[-n_logits - n_tokens :] = True
  pruned = a.copy()
  pruned[~node_mask] = 0
  pruned[:, ~node_mask] = 0
  normalized = normalize(pruned)
  edge_scores = normalized * (influence(normalized) + w)[:, None]
  edge_mask = edge_scores >= _sorted_threshold(edge_scores, edge_threshold)
  old = node_mask.copy()
  node_mask[: -n_logits - n_tokens] &= edge_mask[:, : -n_logits - n_tokens].any(0)
  node_mask[:n_features] &= edge_mask[:n_features].any(1)
  while not np.all(node_mask == old):
    old[:] = node_mask
    edge_mask[~node_mask] = False
    edge_mask[:, ~node_mask] = False
    node_mask[: -n_logits - n_tokens] &= edge_mask[:, : -n_logits - n_tokens].any(0)
    node_mask[:n_features] &= edge_mask[:n_features].any(1)
  return node_mask, edge_mask


def test_pruning_keeps_what_circuit_tracer_keeps(case):
  family, model, variables, tcs, graph, lr = case
  for node_threshold, edge_threshold in [(0.8, 0.98), (0.5, 0.9), (0.95, 0.999)]:
    result = circuits.prune(graph, node_threshold=node_threshold, edge_threshold=edge_threshold)
    node_mask, edge_mask = _prune_by_sorting(graph, node_threshold, edge_threshold)
    np.testing.assert_array_equal(result.node_mask, node_mask)
    np.testing.assert_array_equal(result.edge_mask, edge_mask)
  sl = graph.node_slices()
  assert result.node_mask[sl["tokens"]].all() and result.node_mask[sl["logits"]].all()
  assert 0 < result.edge_mask.sum() < result.edge_mask.size
  assert np.isclose(result.cumulative_scores.max(), 1.0)
  r, c = circuits.graph_scores(graph)
  assert 0 < r < 1 and 0 < c < 1


# -- bad input -----------------------------------------------------------------------------


def test_bad_input_is_refused_with_a_typed_error(gpt2):
  family, model, variables, tcs, graph, lr = gpt2

  def refused(code, match, **kwargs):
    args = {"tokens": TOKENS, "transcoders": tcs, **kwargs}
    with pytest.raises(circuits.CircuitError, match=match) as info:
      circuits.attribute(model, variables, args.pop("tokens"), args.pop("transcoders"), **args)
    assert info.value.fields["code"] == code

  refused("invalid_argument", "empty", tokens=jnp.zeros((0,), jnp.int32))
  refused("index_out_of_range", "outside the vocabulary", tokens=jnp.asarray([1, VOCAB]))
  refused("invalid_argument", "one prompt", tokens=jnp.zeros((2, 3), jnp.int32))
  refused("invalid_argument", "max_feature_nodes must be a positive int", max_feature_nodes=0)
  refused("invalid_argument", "batch_size", batch_size=-1)
  refused("circuit_transcoder_mismatch", "1 transcoders for a model of 2", transcoders=tcs[:1])
  wide = [sae.Transcoder.init(jax.random.key(0), d_in=D + 1, d_sae=4, dtype=F64)] * L
  refused("circuit_transcoder_mismatch", "model's width is 16", transcoders=wide)
  topk = [t.replace(activation="topk", k=2) for t in tcs]
  refused("circuit_transcoder_mismatch", "linear in its input", transcoders=topk)
  refused("invalid_argument", "sequence of jaxlens.sae.Transcoder", transcoders=[1, 2])
  refused("invalid_argument", "directions must be", directions=jnp.ones((D,)))
  refused("index_out_of_range", "target token 31 is outside", target_tokens=[2, VOCAB])
  refused("invalid_argument", "non-empty 1-D", target_tokens=[])
  clt = sae.CrossLayerTranscoder.init(jax.random.key(0), n_layers=3, d_in=D, d_sae=4)
  refused("circuit_transcoder_mismatch", "3 layers, the model 2", transcoders=clt)
  with pytest.raises(circuits.CircuitError, match="fraction in"):
    circuits.prune(graph, node_threshold=1.5)


# -- files ---------------------------------------------------------------------------------


def test_graph_files_round_trip_and_refuse_damage(gpt2, tmp_path):
  family, model, variables, tcs, graph, lr = gpt2
  path = circuits.save_graph(graph, tmp_path / "g")
  again = circuits.load_graph(path)
  for name in ("adjacency", "active_features", "selected_features", "logit_tokens"):
    np.testing.assert_array_equal(getattr(again, name), getattr(graph, name))
  assert again.n_layers == graph.n_layers and again.adjacency.dtype == graph.adjacency.dtype
  assert sorted(p.name for p in tmp_path.iterdir()) == ["g"]  # nothing left beside it

  def refused(code, match, where=path):
    with pytest.raises(circuits.CircuitError, match=match) as info:
      circuits.load_graph(where)
    assert info.value.fields["code"] == code

  data = (path / "graph.safetensors").read_bytes()
  (path / "graph.safetensors").write_bytes(data[: len(data) // 2])  # truncated
  refused("circuit_file_corrupt", "SHA-256")
  edited = bytearray(data)
  edited[-3] ^= 1
  (path / "graph.safetensors").write_bytes(bytes(edited))
  refused("circuit_file_corrupt", "SHA-256")
  (path / "graph.safetensors").write_bytes(data)
  meta = (path / "graph.json").read_text()
  (path / "graph.json").write_text(meta[:-5])
  refused("circuit_file_corrupt", "not JSON")
  (path / "graph.json").write_text(meta.replace('"version": 1', '"version": 9'))
  refused("circuit_file_version", "format version 9")
  refused("circuit_file_missing", "no graph.json", tmp_path / "nowhere")
  with pytest.raises(circuits.CircuitError, match="exists") as info:
    circuits.save_graph(graph, path)
  assert info.value.fields["code"] == "circuit_file_exists"
  circuits.save_graph(graph, path, overwrite=True)
  assert circuits.load_graph(path).n_features == graph.n_features


def test_neuronpedia_json_has_the_viewers_fields(gpt2, tmp_path):
  family, model, variables, tcs, graph, lr = gpt2
  import json

  out = circuits.to_neuronpedia_json(graph, tmp_path / "g.json", slug="t", d_transcoder=SAE_WIDTH)
  assert json.loads((tmp_path / "g.json").read_text()) == out
  assert set(out) == {"metadata", "qParams", "nodes", "links"}
  assert out["metadata"]["prompt_tokens"] == [str(int(t)) for t in TOKENS]
  kinds = {n["feature_type"] for n in out["nodes"]}
  assert {"embedding", "logit"} <= kinds
  ids = {n["node_id"] for n in out["nodes"]}
  assert all(link["source"] in ids and link["target"] in ids for link in out["links"])
  mask = circuits.prune(graph)
  assert len(out["links"]) == int(mask.edge_mask.sum())
  logits = [n for n in out["nodes"] if n["feature_type"] == "logit"]
  assert sum(n["is_target_logit"] for n in logits) == 1 and logits[0]["layer"] == str(L + 1)
  feature = next(n for n in out["nodes"] if n["feature_type"] == "cross layer transcoder")
  layer, feat, pos = (int(x) for x in feature["node_id"].split("_"))
  assert feature["feature"] == feat + 100 * layer and feature["ctx_idx"] == pos


def test_circuit_tracer_transcoder_files_are_read(tmp_path):
  """Files in circuit-tracer's layout (its to_safetensors: W_enc as (features, d_model), a CLT
  as W_enc_{i} / W_dec_{i} files) read back as jaxlens dictionaries computing the same."""
  from safetensors.numpy import save_file

  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.normal(size=(4, D)))
  w = {k: rng.normal(size=s) for k, s in [("W_enc", (8, D)), ("W_dec", (8, D)), ("W_skip", (D, D))]}
  w |= {"b_enc": rng.normal(size=8), "b_dec": rng.normal(size=D)}
  w["activation_function.threshold"] = np.abs(rng.normal(size=8))
  save_file(w, str(tmp_path / "t.safetensors"))
  t = circuits.load_circuit_tracer(tmp_path / "t.safetensors")
  pre = np.asarray(x) @ w["W_enc"].T + w["b_enc"]
  acts = pre * (pre > w["activation_function.threshold"])
  np.testing.assert_allclose(np.asarray(t.encode(x)), acts, atol=1e-12)
  want = acts @ w["W_dec"] + w["b_dec"] + np.asarray(x) @ w["W_skip"].T
  np.testing.assert_allclose(np.asarray(t(x)), want, atol=1e-12)
  n = 3
  for i in range(n):
    enc = {f"W_enc_{i}": rng.normal(size=(8, D)), f"b_enc_{i}": rng.normal(size=8)}
    save_file(enc | {f"b_dec_{i}": rng.normal(size=D)}, str(tmp_path / f"W_enc_{i}.safetensors"))
    save_file(
      {f"W_dec_{i}": rng.normal(size=(8, n - i, D))}, str(tmp_path / f"W_dec_{i}.safetensors")
    )
  clt = circuits.load_circuit_tracer(tmp_path)
  assert isinstance(clt, sae.CrossLayerTranscoder) and clt.n_layers == n
  w_dec1 = np.asarray(clt.W_dec[1])  # (n - 1, features, d)
  from safetensors.numpy import load_file

  np.testing.assert_array_equal(
    w_dec1[1], load_file(str(tmp_path / "W_dec_1.safetensors"))["W_dec_1"][:, 1]
  )

  def refused(match, where):
    with pytest.raises(circuits.CircuitError, match=match):
      circuits.load_circuit_tracer(where)

  save_file({"W_enc": w["W_enc"]}, str(tmp_path / "part.safetensors"))
  refused("no tensor 'W_dec'", tmp_path / "part.safetensors")
  save_file(w | {"activation_function.threshold": -np.ones(8)}, str(tmp_path / "neg.safetensors"))
  refused("negative JumpReLU thresholds", tmp_path / "neg.safetensors")
  refused("no transcoder file", tmp_path / "none.safetensors")
  (tmp_path / "bad.safetensors").write_bytes(b"\x08\x00")
  refused("not a readable safetensors", tmp_path / "bad.safetensors")
  refused(
    "holds no W_enc_0", tmp_path / "empty_dir" if (tmp_path / "empty_dir").mkdir() is None else None
  )


# Interventions on features (circuit-tracer's feature_intervention semantics).


def _pick(graph, ks):
  return [tuple(int(a) for a in graph.active_features[graph.selected_features[k]]) for k in ks]


@pytest.mark.parametrize("family", ["llama", "gemma"])
def test_a_constrained_intervention_moves_logits_and_features_by_the_graphs_edges(family):
  # With every layer constrained (attention, norms and MLP outputs held) the model is the local
  # replacement model: scaling a feature by c moves each logit target (demeaned) and each
  # feature's pre-activation by (c - 1) times the graph's edge, summed over the features.
  family, model, variables, tcs, graph, _ = _build(family)
  sl = graph.node_slices()
  ks = [0, graph.n_features // 2, graph.n_features - 1]
  feats = graph.active_features[graph.selected_features]
  kw = dict(constrained_layers=range(L), apply_activation_function=False)
  base = circuits.feature_intervention(model, variables, TOKENS, tcs, [], **kw)
  ivs = [(lay, p, f, circuits.Scale(2.5)) for lay, p, f in _pick(graph, ks[:2])]
  ivs += [(lay, p, f, 0.0) for lay, p, f in _pick(graph, ks[2:])]
  out = circuits.feature_intervention(model, variables, TOKENS, tcs, ivs, **kw)
  factor = np.asarray([1.5, 1.5, -1.0])
  scale = np.abs(graph.adjacency).max()
  d_pre = np.asarray(out.activations - base.activations)[feats[:, 0], feats[:, 1], feats[:, 2]]
  want_pre = graph.adjacency[sl["features"]][:, ks] @ factor
  assert np.abs(want_pre).max() > 1e-3 * scale  # the edges are not all zero
  np.testing.assert_allclose(d_pre, want_pre, atol=1e-11 * scale)
  if family != "gemma":  # Gemma's logits pass its final soft-cap, which is not linear
    d_logit = np.asarray(out.logits[-1] - base.logits[-1])
    want = graph.adjacency[sl["logits"]][:, ks] @ factor
    np.testing.assert_allclose(
      (d_logit - d_logit.mean())[graph.logit_tokens], want, atol=1e-11 * scale
    )
  # The edit is an ordinary spec: bound on the live door it gives the same logits.
  bound = out.spec.bind(model)(variables, TOKENS[None])
  np.testing.assert_allclose(bound[0], out.logits, atol=1e-12)


def test_an_unconstrained_intervention_is_the_spliced_transcoders_edit(llama):
  # With nothing held, circuit-tracer's intervention adds decoder * (value - activation) to the
  # real MLP output, the activation read on the edited run: that is editing the features of
  # the transcoders spliced into the model (jaxlens.sae.splice keeps the error term).
  import jaxlens as jl

  _, model, variables, tcs, graph, _ = llama
  (l0, p0, f0), (l1, p1, f1) = _pick(graph, [0, graph.n_features - 1])
  ivs = [(l0, p0, f0, 3.0), (l1, slice(p1, None), f1, circuits.Scale(0.5))]
  out = circuits.feature_intervention(model, variables, TOKENS, tcs, ivs, freeze_attention=False)
  spliced = model
  for i in range(L):
    spliced = sae.splice(spliced, f"blocks_{i}/mlp_out", tcs[i], reads=f"blocks_{i}/ln_2")

  def edit(layer, fn):
    return jl.when(jl.module(f"blocks_{layer}/mlp_out/sae/acts"), jl.hook(fn))

  spec = edit(l0, lambda a: a.at[0, p0, f0].set(3.0))
  spec = spec + edit(l1, lambda a: a.at[0, p1:, f1].multiply(0.5))
  want = spec.bind(spliced)(variables, TOKENS[None])[0]
  plain = model.apply(variables, TOKENS[None])[0]
  assert np.abs(np.asarray(want - plain)).max() > 1e-2
  np.testing.assert_allclose(out.logits, want, atol=1e-12)


@pytest.mark.parametrize("family", ["llama", "gemma"])
def test_the_graphs_linearisation_moves_logits_and_features_by_its_total_effects(family):
  # mlps="linear" with the attention patterns and norms held: every feature responds along the
  # graph's edges (its gate held), errors held. Setting features C to c_s times their
  # activations moves each feature's pre-activation and each logit target by the graph's
  # edges times the activations' changes, per unit of the source's activation, where the
  # changes solve the graph's linear system with C's incoming edges cut.
  family, model, variables, tcs, graph, _ = _build(family)
  sl = graph.node_slices()
  nf = graph.n_features
  ks = [0, nf // 3, nf - 1]
  c = np.asarray([0.0, 2.0, -1.0])
  act = np.asarray(graph.activation_values)[graph.selected_features]
  ivs = [(lay, p, f, float(ci * act[k])) for (lay, p, f), ci, k in zip(_pick(graph, ks), c, ks)]
  kw = dict(mlps="linear", freeze_norms=True, apply_activation_function=False)
  base = circuits.feature_intervention(model, variables, TOKENS, tcs, [], **kw)
  out = circuits.feature_intervention(model, variables, TOKENS, tcs, ivs, **kw)
  per_unit = graph.adjacency[:, :nf] / act
  cut = per_unit[:nf].copy()
  cut[ks] = 0
  push = np.zeros(nf)
  push[ks] = (c - 1.0) * act[ks]
  change = np.linalg.solve(np.eye(nf) - cut, push)
  scale = np.abs(graph.adjacency).max()
  feats = graph.active_features[graph.selected_features]
  d_pre = np.asarray(out.activations - base.activations)[feats[:, 0], feats[:, 1], feats[:, 2]]
  want_pre = per_unit[:nf] @ change
  np.testing.assert_allclose(d_pre, want_pre, atol=1e-10 * scale)
  if family != "gemma":  # Gemma's logits pass its final soft-cap, which is not linear
    d_logit = np.asarray(out.logits[-1] - base.logits[-1])
    want = per_unit[sl["logits"]] @ change
    # paths through the layer-1 features carry part of the change (not the direct edges alone)
    assert np.abs(want - graph.adjacency[sl["logits"]][:, ks] @ (c - 1.0)).max() > 1e-3 * scale
    np.testing.assert_allclose(
      (d_logit - d_logit.mean())[graph.logit_tokens], want, atol=1e-10 * scale
    )
  bound = out.spec.bind(model)(variables, TOKENS[None])
  np.testing.assert_allclose(bound[0], out.logits, atol=1e-12)


def test_transcoder_mlps_are_the_spliced_transcoders_with_their_errors_held(llama):
  # mlps="transcoders" with nothing else held: each MLP is its transcoder (every feature live
  # through its activation function) plus its error on the prompt: the transcoders spliced
  # into the model with each error term held at its value on the prompt.
  import jaxlens as jl

  _, model, variables, tcs, graph, _ = llama
  (l0, p0, f0), (l1, p1, f1) = _pick(graph, [0, graph.n_features - 1])
  ivs = [(l0, p0, f0, 3.0), (l1, p1, f1, 0.0)]
  kw = dict(mlps="transcoders", freeze_attention=False)
  out = circuits.feature_intervention(model, variables, TOKENS, tcs, ivs, **kw)
  spliced = model
  for i in range(L):
    spliced = sae.splice(spliced, f"blocks_{i}/mlp_out", tcs[i], reads=f"blocks_{i}/ln_2")
  errors = [f"blocks_{i}/mlp_out/sae/error" for i in range(L)]
  prompt = jl.trace(spliced, variables, TOKENS[None], save=[jl.module(e) for e in errors])
  spec = jl.when(
    jl.module(f"blocks_{l0}/mlp_out/sae/acts"), jl.hook(lambda a: a.at[0, p0, f0].set(3.0))
  )
  spec = spec + jl.when(
    jl.module(f"blocks_{l1}/mlp_out/sae/acts"), jl.hook(lambda a: a.at[0, p1, f1].set(0.0))
  )
  for e in errors:
    spec = spec + jl.when(jl.module(e), jl.hook(lambda x, v=prompt[e].out: v))
  want = spec.bind(spliced)(variables, TOKENS[None])[0]
  model_mlps = circuits.feature_intervention(
    model, variables, TOKENS, tcs, ivs, freeze_attention=False
  )
  assert np.abs(np.asarray(want - model_mlps.logits)).max() > 1e-3  # the MLPs respond otherwise
  np.testing.assert_allclose(out.logits, want, atol=1e-12)


def test_generation_holds_open_ended_interventions_through_the_kv_cache():
  # Open-ended interventions hold their features on every generated token: each logit that
  # chose a token equals the uncached intervention on the whole sequence so far (Gemma, a
  # cross-layer transcoder: the change reaches later layers through the KV cache).
  _, model, variables, tcs, graph, _ = _build("gemma")
  (l0, p0, f0), (l1, p1, f1) = _pick(graph, [0, 1])
  ivs = [(l0, slice(p0, None), f0, 4.0), (l1, slice(p1, None), f1, circuits.Scale(3.0))]
  gen = circuits.feature_intervention_generate(
    model, variables, TOKENS, tcs, ivs, 3, freeze_attention=False
  )
  seq = jnp.concatenate([TOKENS, gen.tokens[0, :-1]])
  full = circuits.feature_intervention(model, variables, seq, tcs, ivs, freeze_attention=False)
  plain = jax.jit(model.apply)(variables, seq[None])[0]  # one program, not eager ops
  n = len(TOKENS)
  assert np.abs(np.asarray(full.logits - plain))[n:].max() > 1e-2  # held on new tokens
  np.testing.assert_allclose(gen.logits[0], full.logits[n - 1 :], atol=1e-12)


def test_bad_interventions_are_refused_with_a_typed_error(llama):
  _, model, variables, tcs, _, _ = llama

  def run(ivs, **kw):
    return circuits.feature_intervention(model, variables, TOKENS, tcs, ivs, **kw)

  with pytest.raises(circuits.CircuitError, match="layer 2 of a model of 2") as e:
    run([(2, 0, 0, 1.0)])
  assert e.value.code == "index_out_of_range"
  with pytest.raises(circuits.CircuitError, match="not a feature index") as e:
    run([(0, 0, SAE_WIDTH, 1.0)])
  assert e.value.code == "index_out_of_range"
  with pytest.raises(circuits.CircuitError, match="position \\[5\\] of a prompt of 5") as e:
    run([(0, 5, 0, 1.0)])
  assert e.value.code == "index_out_of_range"
  with pytest.raises(circuits.CircuitError, match="finite number") as e:
    run([(0, 1, 0, float("nan"))])
  assert e.value.code == "invalid_argument"
  with pytest.raises(circuits.CircuitError, match="is \\(layer, position, feature, value\\)"):
    run([(0, 1, 0)])
  with pytest.raises(circuits.CircuitError, match="constrained_layers must be"):
    run([(0, 1, 0, 1.0)], constrained_layers=range(3))
  with pytest.raises(circuits.CircuitError, match="mlps must be one of") as e:
    run([(0, 1, 0, 1.0)], mlps="linearised")
  assert e.value.code == "invalid_argument"
  with pytest.raises(circuits.CircuitError, match="MLP outputs are held") as e:
    run([(0, 1, 0, 1.0)], mlps="linear", constrained_layers=range(L))
  assert e.value.code == "invalid_argument"
  with pytest.raises(circuits.CircuitError, match="makes its own prefill="):
    circuits.feature_intervention_generate(
      model, variables, TOKENS, tcs, [(0, 1, 0, 1.0)], 2, prefill=None
    )


def _largest_edges(graph, n):
  sl = graph.node_slices()
  sub = np.abs(graph.adjacency[:, : sl["tokens"].stop])
  sub[sl["errors"].start : sl["tokens"].stop] = 0  # no incoming edges
  idx = np.argsort(-sub.ravel(), kind="stable")[:n]
  return np.stack(np.unravel_index(idx, sub.shape), 1)


def test_head_loadings_split_each_edge_into_its_first_attention_heads():
  # Gemma: post-norms and GQA. The parts (no attention, one per first head) sum to the edge;
  # a path that changes position crosses a head; no head before its source's MLP (or at its
  # layer) or after its target's MLP input carries it.
  _, model, variables, tcs, graph, lr = _build("gemma")
  sl = graph.node_slices()
  edges = _largest_edges(graph, 8)
  first_token = sl["tokens"].start
  layer0 = [
    k for k in range(graph.n_features) if graph.active_features[graph.selected_features[k]][0] == 0
  ]
  edges = np.concatenate([edges, [[layer0[-1], first_token]]])  # token 0 -> a layer-0 feature
  hl = circuits.head_loadings(model, variables, TOKENS, tcs, graph, edges, local=lr)
  scale = np.abs(graph.adjacency).max()
  np.testing.assert_allclose(
    hl.total, graph.adjacency[edges[:, 0], edges[:, 1]], atol=1e-12 * scale
  )
  np.testing.assert_allclose(hl.residual + hl.heads.sum((1, 2)), hl.total, atol=1e-12 * scale)
  assert np.abs(hl.heads).max() > 1e-2 * scale

  def where(node):  # (layer of the write or read, position); tokens write before layer 0
    if node < sl["features"].stop:
      layer, pos, _ = graph.active_features[graph.selected_features[node]]
      return int(layer), int(pos)
    if node < sl["errors"].stop:
      e = node - sl["errors"].start
      return e // graph.n_pos, e % graph.n_pos
    if node < sl["tokens"].stop:
      return -1, node - sl["tokens"].start
    return L, graph.n_pos - 1

  for r, (target, source) in enumerate(edges):
    (ls, ps), (lt, pt) = where(source), where(target)
    if ps != pt:
      assert hl.residual[r] == 0.0
    assert np.abs(hl.heads[r, : ls + 1]).max(initial=0.0) == 0.0
    assert np.abs(hl.heads[r, lt + 1 :]).max(initial=0.0) == 0.0
  # token 0 -> a layer-0 feature at a later position: only layer 0's heads carry it
  assert where(int(edges[-1, 0]))[1] > 0
  np.testing.assert_allclose(hl.heads[-1, 0].sum(), hl.total[-1], atol=1e-12 * scale)


def test_qk_attribution_splits_a_score_into_query_and_key_side_nodes(llama):
  # q . k of a head is bilinear in the nodes: the parts sum to the model's own score, and
  # removing a node (its feature set to 0 in the constrained intervention) moves the query and
  # the key by exactly its parts.
  import jaxlens as jl

  _, model, variables, tcs, graph, lr = llama
  layer, head, qp, kp = 1, 3, 4, 2
  qa = circuits.qk_attribution(model, variables, TOKENS, tcs, graph, layer, head, qp, kp, local=lr)
  score = jl.trace(model, variables, TOKENS[None], save=jl.module(f"blocks_{layer}/attn/scores"))
  model_score = score[f"blocks_{layer}/attn/scores"].out[0, head, qp, kp] * (D // 4) ** 0.5
  np.testing.assert_allclose(qa.score, model_score, rtol=1e-12)
  for total in (qa.query_side.sum(), qa.key_side.sum(), qa.pairs().sum()):
    np.testing.assert_allclose(total, qa.score, rtol=1e-12)
  feats = graph.active_features[graph.selected_features]
  # layer-0 features at the query's and at the key's position: one reaches only the query,
  # the other only the key (layer 1's attention comes after its query and key)
  ks = [int(np.flatnonzero((feats[:, 0] == 0) & (feats[:, 1] == p))[0]) for p in (qp, kp)]
  assert np.abs(qa.queries[ks[0]]).max() > 1e-3 and np.abs(qa.keys[ks[1]]).max() > 1e-3
  assert not qa.keys[ks[0]].any() and not qa.queries[ks[1]].any()
  ivs = [(int(feats[k, 0]), int(feats[k, 1]), int(feats[k, 2]), 0.0) for k in ks]
  out = circuits.feature_intervention(
    model, variables, TOKENS, tcs, ivs, constrained_layers=range(L)
  )
  sites = [jl.module(f"blocks_{layer}/attn/q"), jl.module(f"blocks_{layer}/attn/k")]
  t = jl.trace(model, variables, TOKENS[None], intervene=out.spec, save=sites)
  q = t[f"blocks_{layer}/attn/q"].out[0, qp, head]
  kv = t[f"blocks_{layer}/attn/k"].out[0, kp, head // 2]
  q0, k0 = qa.queries.sum(0), qa.keys.sum(0)
  np.testing.assert_allclose(q, q0 - qa.queries[ks].sum(0), atol=1e-12)
  np.testing.assert_allclose(kv, k0 - qa.keys[ks].sum(0), atol=1e-12)
  with pytest.raises(circuits.CircuitError, match="head=4 is outside") as e:
    circuits.qk_attribution(model, variables, TOKENS, tcs, graph, 1, 4, 0, 0, local=lr)
  assert e.value.code == "index_out_of_range"
  with pytest.raises(circuits.CircuitError, match="error or token node"):
    circuits.head_loadings(model, variables, TOKENS, tcs, graph, [[graph.n_features, 0]])


_GRAPH_PROBE = """<script>
window.addEventListener("load", () => {
  const box = (e) => e.getBoundingClientRect();
  const nodes = [...document.querySelectorAll("circle.node")];
  const seen = nodes.filter((e) => box(e).width > 0);
  const y = (kind) => nodes.filter((e) => e.dataset.kind === kind).map((e) => box(e).top);
  const edges = [...document.querySelectorAll("line.edge")].filter((e) => box(e).width + box(e).height > 0);
  const out = document.createElement("pre");
  out.id = "probe";
  out.textContent = JSON.stringify({
    nodes: seen.length, edges: edges.length,
    token_top: Math.min(...y("token")), logit_bottom: Math.max(...y("logit")),
  });
  document.body.appendChild(out);
});
</script></body>"""


def _chromium():
  import shutil

  return next(
    (shutil.which(b) for b in ("chromium", "chromium-browser", "google-chrome") if shutil.which(b)),
    None,
  )


@pytest.mark.skipif(_chromium() is None, reason="no Chromium on this machine")
def test_graph_html_renders_the_pruned_graph_in_headless_chromium(gpt2, tmp_path):
  import json
  import re
  import subprocess

  graph = gpt2[4]
  kept = circuits.prune(graph)
  page = circuits.graph_html(graph, tmp_path / "g.html", pruned=kept, token_strings=list("abcde"))
  assert (tmp_path / "g.html").read_text() == page and "<script" not in page
  probe = tmp_path / "probe.html"
  probe.write_text(page.replace("</body>", _GRAPH_PROBE))
  out = subprocess.run(
    [
      _chromium(),
      "--headless",
      "--no-sandbox",
      "--disable-gpu",
      "--no-first-run",
      f"--user-data-dir={tmp_path / 'profile'}",
      "--virtual-time-budget=10000",
      "--dump-dom",
      probe.as_uri(),
    ],
    capture_output=True,
    text=True,
    timeout=180,
    check=False,
  )
  m = re.search(r'<pre id="probe">(.*?)</pre>', out.stdout, re.DOTALL)
  assert m, out.stdout[-2000:] + out.stderr[-2000:]
  got = json.loads(m.group(1))
  n_edges = int((kept.edge_mask & (graph.adjacency != 0)).sum())
  assert got["nodes"] == int(kept.node_mask.sum()) and got["edges"] == n_edges > 0
  assert got["logit_bottom"] < got["token_top"]  # logits drawn above the tokens


def test_plot_graph_draws_the_kept_nodes_and_edges(gpt2, tmp_path):
  graph = gpt2[4]
  kept = circuits.prune(graph)
  fig = circuits.plot_graph(graph, tmp_path / "g.png", pruned=kept)
  ax = fig.axes[0]
  assert sum(len(c.get_offsets()) for c in ax.collections[1:]) == int(kept.node_mask.sum())
  assert len(ax.collections[0].get_segments()) == int(
    (kept.edge_mask & (graph.adjacency != 0)).sum()
  )
  assert (tmp_path / "g.png").stat().st_size > 1000
  with pytest.raises(circuits.CircuitError, match="pruning masks are for a graph of"):
    circuits.graph_html(
      graph, pruned=circuits.PruneResult(kept.node_mask[:3], kept.edge_mask, kept.cumulative_scores)
    )


def test_a_memory_budget_that_cannot_hold_the_graph_is_refused_before_the_rows(gpt2):
  _, model, variables, tcs, graph, lr = gpt2
  n = graph.adjacency.shape[0]
  need = circuits.memory_estimate(
    n_layers=L,
    seq=graph.n_pos,
    d_model=D,
    d_in=D,
    n_heads=4,
    n_active=graph.n_features,
    n_features=graph.n_features,
    n_logits=graph.n_logits,
    batch_size=32,
    itemsize=8,
  )
  assert need > 8 * n * n  # at least the square adjacency
  with pytest.raises(circuits.CircuitError, match="over the memory_budget") as e:
    circuits.attribute(
      model, variables, TOKENS, tcs, local=lr, batch_size=32, memory_budget=need // 4
    )
  assert e.value.code == "circuit_memory_budget"
  with pytest.raises(circuits.CircuitError, match="memory_budget must be a positive int"):
    circuits.attribute(model, variables, TOKENS, tcs, local=lr, memory_budget=0)


# Sparse rows, rows over a mesh, and the compiled programs reused.


def _sparse(case, **kw):
  _, model, variables, tcs, _, lr = case
  return circuits.attribute(model, variables, TOKENS, tcs, batch_size=32, local=lr, **kw)


def test_sparse_rows_hold_the_dense_graphs_entries_and_prune_alike(case):
  family, model, variables, tcs, graph, lr = case
  before = dict(circuits._attribute.TRACES)
  dense = np.asarray(graph.adjacency)
  every = _sparse(case, row_threshold=0.0)  # drops only the zeros
  assert every.adjacency.nnz == np.count_nonzero(dense)
  assert (every.adjacency.toarray() == dense).all()
  kept, kept_sparse = circuits.prune(graph), circuits.prune(every)
  assert (kept.node_mask == kept_sparse.node_mask).all()
  assert (kept.edge_mask == kept_sparse.edge_mask.toarray()).all()
  np.testing.assert_allclose(circuits.graph_scores(every), circuits.graph_scores(graph), rtol=1e-12)
  np.testing.assert_allclose(kept_sparse.cumulative_scores, kept.cumulative_scores, rtol=1e-12)
  # top-k: each row's k entries of largest magnitude, with the dense values
  k = 5
  top = _sparse(case, row_top_k=k).adjacency
  mag = np.abs(dense)
  for r in range(dense.shape[0]):
    cols = top.indices[top.indptr[r] : top.indptr[r + 1]]
    assert len(cols) == min(k, np.count_nonzero(dense[r]))
    assert (top.data[top.indptr[r] : top.indptr[r + 1]] == dense[r, cols]).all()
    if len(cols):
      assert np.delete(mag[r], cols).max(initial=0.0) <= mag[r, cols].min()
  # a threshold relative to the row's largest magnitude
  low = _sparse(case, row_threshold=0.25).adjacency.toarray()
  assert (low == np.where(mag >= 0.25 * mag.max(1, keepdims=True), dense, 0)).all()
  assert dict(circuits._attribute.TRACES) == before  # three more graphs, no new program


def test_a_sparse_graph_under_a_node_budget_saves_views_and_refuses_damage(gpt2, tmp_path):
  _, model, variables, tcs, graph, lr = gpt2
  dense = circuits.attribute(model, variables, TOKENS, tcs, local=lr, max_feature_nodes=9)
  sparse = circuits.attribute(
    model, variables, TOKENS, tcs, local=lr, max_feature_nodes=9, row_threshold=0.0
  )
  assert (sparse.selected_features == dense.selected_features).all()
  assert (sparse.adjacency.toarray() == dense.adjacency).all()
  every = _sparse(gpt2, row_threshold=0.0)
  layout, layout_sparse = circuits.graph_layout(graph), circuits.graph_layout(every)
  assert (layout.nodes == layout_sparse.nodes).all()
  assert (layout.edges == layout_sparse.edges).all() and len(layout.edges)
  assert (layout.weights == layout_sparse.weights).all()
  links = circuits.to_neuronpedia_json(every)["links"]
  assert links == circuits.to_neuronpedia_json(graph)["links"]
  path = circuits.save_graph(every, tmp_path / "sparse")
  back = circuits.load_graph(path)
  assert (
    back.adjacency != every.adjacency
  ).nnz == 0 and back.adjacency.shape == graph.adjacency.shape
  from safetensors.numpy import load_file, save_file

  arrays = load_file(str(path / "graph.safetensors"))
  arrays["adjacency_indptr"] = arrays["adjacency_indptr"][:-1]
  save_file(arrays, str(path / "graph.safetensors"))
  with pytest.raises(circuits.CircuitError) as e:
    circuits.load_graph(path)
  assert e.value.code == "circuit_file_corrupt"


def test_rows_over_a_mesh_equal_the_one_device_graph(gpt2):
  _, model, variables, tcs, graph, lr = gpt2
  assert len(jax.devices()) == 8  # tests/conftest.py's host devices
  mesh = jax.make_mesh((8,), ("rows",))
  # 12 rows a batch: 16 a call, two on each device
  spread = circuits.attribute(model, variables, TOKENS, tcs, local=lr, batch_size=12, mesh=mesh)
  scale = np.abs(graph.adjacency).max()
  np.testing.assert_allclose(spread.adjacency, graph.adjacency, rtol=0, atol=1e-13 * scale)
  top = circuits.attribute(
    model, variables, TOKENS, tcs, local=lr, batch_size=12, mesh=mesh, row_top_k=4
  )
  assert (top.adjacency.toarray() == _sparse(gpt2, row_top_k=4).adjacency.toarray()).all()


def test_another_prompt_of_the_same_length_reuses_the_compiled_programs(llama):
  _, model, variables, tcs, graph, lr = llama
  other = jnp.asarray([2, 8, 4, 6, 11], jnp.int32)
  before = dict(circuits._attribute.TRACES)
  second = circuits.attribute(model, variables, other, tcs, batch_size=32)
  assert len(second.active_features) != len(graph.active_features)  # another graph
  assert dict(circuits._attribute.TRACES) == before
  first = circuits.feature_intervention(model, variables, TOKENS, tcs, [(0, 1, 3, 2.0)])
  count = circuits._attribute.TRACES["feature_intervention"]
  again = circuits.feature_intervention(
    model, variables, other, tcs, [(0, 2, 7, circuits.Scale(0.5))]
  )
  assert circuits._attribute.TRACES["feature_intervention"] == count
  assert not np.allclose(first.logits, again.logits)


def test_bad_sparse_and_mesh_options_are_refused(gpt2):
  _, model, variables, tcs, graph, lr = gpt2
  for kw, match in (
    ({"row_top_k": 0}, "row_top_k must be a positive int"),
    ({"row_threshold": 1.5}, "row_threshold must be a fraction"),
    ({"row_threshold": True}, "row_threshold must be a fraction"),
    ({"mesh": "rows"}, "mesh must be a jax.sharding.Mesh"),
  ):
    with pytest.raises(circuits.CircuitError, match=match) as e:
      circuits.attribute(model, variables, TOKENS, tcs, local=lr, **kw)
    assert e.value.code == "invalid_argument"


def test_rows_split_by_layer_and_prefix_give_the_same_graph(monkeypatch):
  # the cross-layer transcoder (a feature writes to every later layer); two prefixes of the
  # five-token prompt (three and five tokens)
  family, model, variables, tcs, graph, lr = _build("gemma")
  monkeypatch.setattr(circuits._attribute, "_GROUP_POSITIONS", 2)
  split = circuits.attribute(
    model, variables, TOKENS, tcs, batch_size=32, local=lr, split_rows=True
  )
  scale = np.abs(graph.adjacency).max()
  np.testing.assert_allclose(split.adjacency, graph.adjacency, rtol=0, atol=1e-13 * scale)


def test_row_batches_run_on_threads_unless_the_configuration_is_thread_local(gpt2, monkeypatch):
  # the rows' batches run on worker threads; under a thread-local jax configuration
  # (which a new thread would not inherit) they run in the calling thread; the graph is the
  # same either way
  import threading

  _, model, variables, tcs, graph, lr = gpt2
  threads = []
  rows = circuits._attribute._rows_cached

  def spy(*args, **kwargs):
    threads.append(threading.get_ident())
    return rows(*args, **kwargs)

  monkeypatch.setattr(circuits._attribute, "_rows_cached", spy)
  kw = dict(batch_size=32, local=lr)  # the fixture's programs: 16 rows a call
  threaded = circuits.attribute(model, variables, TOKENS, tcs, **kw)
  assert set(threads) - {threading.get_ident()}
  threads.clear()
  with jax.numpy_dtype_promotion("standard"):
    alone = circuits.attribute(model, variables, TOKENS, tcs, **kw)
  assert set(threads) == {threading.get_ident()}
  scale = np.abs(graph.adjacency).max()
  for g in (threaded, alone):
    np.testing.assert_allclose(g.adjacency, graph.adjacency, rtol=0, atol=1e-13 * scale)
