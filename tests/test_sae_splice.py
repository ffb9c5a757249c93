"""sae.splice: a dictionary at a site of a model, its features as sites on every door, verb,
selection, gradient, sweep and generation."""

import flax.linen as nn
import numpy as np
from flax import nnx
import pytest

import jax
import jax.numpy as jnp

import jaxlens as jl
from jaxlens import sae
from jaxlens.intervention import keep_grad
from jaxlens.models import Llama, LlamaConfig, init_gpt
from jaxlens.protocol import Decoder

D, F = 8, 48
L, FC = 2, 12  # the cross-layer transcoder's layers and features
ACTS = "block_0/sae/acts"


@pytest.fixture(scope="module")
def gpt64():
  """One small GPT in float64 for every test of this file (the SAE's and the cross-layer
  transcoder's): its compiled programs are shared. Also its output, jitted."""
  model, variables, tokens = init_gpt(
    0, n_layers=L, d_model=D, n_heads=2, max_len=6, vocab_size=11, batch=2, mlp_ratio=2,
    dtype=jnp.float64,
  )  # fmt: skip
  variables = jax.tree.map(lambda a: a.astype(jnp.float64), variables)
  return model, variables, tokens, jax.jit(model.apply)(variables, tokens)


@pytest.fixture(scope="module")
def gpt(gpt64):
  model, variables, tokens, _ = gpt64
  d = sae.SAE.init(jax.random.key(1), D, F, activation="topk", k=6, dtype=jnp.float64)
  d = d.replace(b_enc=jnp.full((F,), 0.05), b_dec=jnp.full((D,), 0.1))
  return model, variables, tokens, d, sae.splice(model, "block_0", d)


def by_hand(d, edit_acts=lambda a: a):
  """The site function a splice computes, written out: decode(edited acts) + error."""

  def fn(y):
    acts = d.encode(y)
    return d.decode(edit_acts(acts), y) + (y - d(y))

  return jl.splice_module(fn)


def test_the_spliced_model_computes_the_model_and_exposes_the_sites(gpt, gpt64):
  model, variables, tokens, d, spliced = gpt
  base = gpt64[3]
  t = jl.trace(spliced, variables, tokens, save=jl.module("block_0*"))
  assert [l for l in t.labels if "/sae/" in l] == [ACTS, "block_0/sae/recon", "block_0/sae/error"]
  np.testing.assert_allclose(t.output, base, atol=1e-5)
  np.testing.assert_allclose(spliced.apply(variables, tokens), base, atol=1e-5)
  y = t["block_0"].out
  np.testing.assert_allclose(t[ACTS].out, d.encode(y), rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(t["block_0/sae/recon"].out, d(y), rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(t["block_0/sae/error"].out, y - d(y), rtol=1e-5, atol=1e-6)
  # Bound in, bound out; and the variables are the model's own.
  bound = sae.splice(model.bind(variables), "block_0", d)
  np.testing.assert_allclose(jl.trace(bound, tokens).output, base, atol=1e-5)
  # Without the error term the site is the reconstruction.
  lossy = sae.splice(model, "block_0", d, keep_error=False)
  t2 = jl.trace(lossy, variables, tokens, save=jl.module("block_0"))
  np.testing.assert_allclose(t2["block_0"].out, d(y), rtol=1e-5, atol=1e-6)


def test_feature_ablation_on_every_door(gpt, gpt64, tmp_path):
  model, variables, tokens, d, spliced = gpt
  feats = jnp.asarray([1, 4, 7])
  site = jl.units(jl.module(ACTS), feats)
  spec = jl.when(site, jl.zero_ablate())
  want = jl.when(jl.module("block_0"), by_hand(d, lambda a: a.at[..., feats].set(0.0))).bind(model)(
    variables, tokens
  )
  live = spec.bind(spliced)(variables, tokens)
  np.testing.assert_allclose(live, want, atol=1e-5)
  assert float(jnp.abs(live - gpt64[3]).max()) > 1e-4  # it did something
  t = jl.trace(spliced, variables, tokens)
  doors = {
    "capture": jl.trace(spliced, variables, tokens, intervene=spec).output,
    "replay": t.fork().do(site, jl.zero_ablate()).output,
    "rerun": t.do(site, jl.zero_ablate(), model=spliced, inputs=(tokens,)).output,
    "jit": jax.jit(spec.bind(spliced))(variables, tokens),
  }
  spec.save(tmp_path / "spec")
  doors["saved spec"] = jl.load_spec(tmp_path / "spec").bind(spliced)(variables, tokens)
  for name, out in doors.items():
    np.testing.assert_allclose(out, live, atol=1e-5, err_msg=name)


def test_steering_a_feature_adds_its_decoder_row(gpt):
  model, variables, tokens, d, spliced = gpt
  onehot = jnp.zeros((F,), jnp.float64).at[5].set(1.0)
  steered = jl.when(jl.module(ACTS), jl.steer(onehot, 3.0)).bind(spliced)(variables, tokens)
  want = jl.when(jl.module("block_0"), jl.steer(d.W_dec[5], 3.0)).bind(model)(variables, tokens)
  np.testing.assert_allclose(steered, want, atol=1e-5)
  # At some positions only, with at_positions.
  one = jl.when(jl.module(ACTS), jl.at_positions([2], jl.steer(onehot, 3.0))).bind(spliced)
  ref = jl.when(jl.module("block_0"), jl.at_positions([2], jl.steer(d.W_dec[5], 3.0))).bind(model)
  np.testing.assert_allclose(one(variables, tokens), ref(variables, tokens), atol=1e-5)


def test_patching_features_from_another_prompt(gpt):
  model, variables, tokens, d, spliced = gpt
  other = (tokens + 3) % 11
  donor = jl.trace(spliced, variables, other, save=jl.module(ACTS))
  feats = jnp.asarray([0, 2, 9])
  out = jl.when(jl.units(jl.module(ACTS), feats), jl.patch_from(donor)).bind(spliced)(
    variables, tokens
  )
  donor_acts = donor[ACTS].out
  want = jl.when(
    jl.module("block_0"), by_hand(d, lambda a: a.at[..., feats].set(donor_acts[..., feats]))
  ).bind(model)(variables, tokens)
  np.testing.assert_allclose(out, want, atol=1e-5)


def test_feature_gradients_and_keep_grad(gpt):
  model, variables, tokens, d, spliced = gpt
  metric = lambda out: out[:, -1, 3].sum()  # noqa: E731
  t = jl.trace(spliced, variables, tokens)
  g = t.grad(metric, sites=[ACTS])
  assert g.grad[ACTS].shape == (2, 6, F)
  # Finite difference along one feature.
  bump = jnp.zeros((2, 6, F), jnp.float64).at[0, 5, 2].set(1e-2)
  moved = jl.when(jl.module(ACTS), jl.add(bump)).bind(spliced)(variables, tokens)
  fd = (metric(moved) - metric(t.output)) / 1e-2
  assert float(g.grad[ACTS][0, 5, 2]) == pytest.approx(float(fd), rel=2e-2, abs=1e-3)
  # keep_grad through the splice: the embedding upstream of block_0 gets its gradient.
  # (Jitted: one compilation each costs less than running a tiny model's gradient eagerly.)
  f = jl.when(jl.module(ACTS), keep_grad(jl.scale(1.0))).bind(spliced)
  grads = jax.jit(jax.grad(lambda v: metric(f(v, tokens))))(variables)
  plain = jax.jit(jax.grad(lambda v: metric(model.apply(v, tokens))))(variables)
  np.testing.assert_allclose(
    grads["params"]["embed"]["embedding"], plain["params"]["embed"]["embedding"], atol=1e-4
  )
  with pytest.raises(jl.GradientContractError, match="edit_detached_from_graph"):
    cutting = jl.when(jl.module(ACTS), keep_grad(jl.zero_ablate())).bind(spliced)
    jax.jit(jax.grad(lambda v: metric(cutting(v, tokens))))(variables)
  # stop_error_grad: the gradient upstream flows through the features only.
  cut = sae.splice(model, "block_0", d, stop_error_grad=True)
  g_cut = jax.jit(jax.grad(lambda v: metric(cut.apply(v, tokens))))(variables)
  assert not np.allclose(
    g_cut["params"]["embed"]["embedding"], plain["params"]["embed"]["embedding"], atol=1e-4
  )


class Linear(nn.Module):
  @nn.compact
  def __call__(self, x):
    h = nn.Dense(D, param_dtype=jnp.float64, name="resid")(x)
    return nn.Dense(3, param_dtype=jnp.float64, name="head")(h)


def test_attribution_patching_equals_exact_patching_on_a_linear_model():
  model = Linear()
  clean = jax.random.normal(jax.random.key(0), (4, 5), jnp.float64)
  corrupt = jax.random.normal(jax.random.key(1), (4, 5), jnp.float64)
  variables = model.init(jax.random.key(2), clean)
  d = sae.SAE.init(jax.random.key(3), D, F, dtype=jnp.float64)
  spliced = sae.splice(model, "resid", d)
  metric = lambda out: out[:, 0].sum()  # noqa: E731
  acts = "resid/sae/acts"
  g = jl.site_grads(spliced, variables, corrupt, metric=metric, sites=[acts])
  donor = jl.trace(spliced, variables, clean, save=jl.module(acts))
  delta = donor[acts].out - g.out[acts]
  attribution = (g.grad[acts] * delta).sum(0)
  base = metric(spliced.apply(variables, corrupt))
  exact = []
  for feature in range(0, F, 7):
    patched = jl.when(jl.units(jl.module(acts), jnp.asarray([feature])), jl.patch_from(donor))
    exact.append(metric(patched.bind(spliced)(variables, corrupt)) - base)
  np.testing.assert_allclose(attribution[::7], jnp.stack(exact), atol=1e-10)
  assert float(jnp.abs(attribution).max()) > 1e-3


def test_sweeps_over_feature_sites(gpt):
  model, variables, tokens, d, spliced = gpt
  corrupt = tokens.at[:, 2].set((tokens[:, 2] + 1) % 11)
  metric = _metric
  grid = jl.sweep.patching_sweep(
    spliced, variables, tokens, corrupt, metric, sites=(ACTS, "block_0/sae/error")
  )
  clean_trace = jl.trace(spliced, variables, tokens)
  one = jl.when(jl.module(ACTS), jl.at_positions([2], jl.patch_from(clean_trace)))
  assert grid.shape == (2, 6)
  assert float(grid[0, 2]) == pytest.approx(
    float(metric(one.bind(spliced)(variables, corrupt))), abs=1e-5
  )


def _metric(out):
  return out[:, -1, 1].mean()


def test_generation_with_a_feature_steered():
  model = Llama(
    LlamaConfig(vocab_size=13, d_model=D, n_layers=1, n_heads=4, n_kv_heads=2, d_mlp=32)
  )
  prompt = jnp.asarray(np.random.default_rng(0).integers(0, 13, (2, 4)), jnp.int32)
  # Jitted: the model only runs jitted below (the forward and generation), so an eager init
  # would compile each of its ops for nothing else.
  variables = jax.jit(model.init)(jax.random.key(0), prompt)
  d = sae.SAE.init(jax.random.key(1), D, F, activation="relu")
  spliced = sae.splice(model, "blocks_0/resid_pre", d)
  plain = jax.jit(model.apply)(variables, prompt)[:, -1]  # the prefill's logits, unsteered
  onehot = jnp.zeros((F,), jnp.float32).at[3].set(1.0)
  steer = jl.when(jl.module("blocks_0/resid_pre/sae/acts"), jl.steer(onehot, 40.0))
  steered = jl.generate(spliced, variables, prompt, max_new_tokens=2, intervene=steer)
  by_hand_ = jl.when(jl.module("blocks_0/resid_pre"), jl.steer(d.W_dec[3], 40.0))
  want = jl.generate(model, variables, prompt, max_new_tokens=2, intervene=by_hand_)
  np.testing.assert_array_equal(steered.tokens, want.tokens)
  np.testing.assert_allclose(steered.logits, want.logits, atol=1e-5)
  # The sweeps' block-at-a-time path would bypass the splice: a spliced decoder does not
  # offer it (they run it through the doors, or refuse).
  assert isinstance(model, Decoder) and not isinstance(spliced, Decoder)
  assert float(jnp.abs(steered.logits[:, 0] - plain).max()) > 1e-2


def test_a_transcoder_replaces_the_mlp_output(gpt64):
  model, variables, tokens, base = gpt64
  tc = sae.Transcoder.init(jax.random.key(2), D, F, d_out=D, skip=True, dtype=jnp.float64)
  tc = tc.replace(W_skip=0.1 * jnp.eye(D, dtype=jnp.float64))
  kept = sae.splice(model, "block_0/mlp", tc)
  np.testing.assert_allclose(jax.jit(kept.apply)(variables, tokens), base, atol=1e-12)
  replaced = sae.splice(model, "block_0/mlp", tc, keep_error=False)
  t = jl.trace(replaced, variables, tokens, save=jl.module("block_0/*"))
  np.testing.assert_allclose(t["block_0/mlp"].out, tc(t["block_0/ln_2"].out), atol=1e-12)
  assert "block_0/mlp/sae/acts" in t.labels
  assert float(jnp.abs(t.output - base).max()) > 1e-3
  # reads= another site (here the same value, from the module that makes it).
  via = sae.splice(model, "block_0/mlp", tc, reads="block_0/ln_2", keep_error=False)
  np.testing.assert_allclose(via.apply(variables, tokens), t.output, atol=1e-12)


class Pair(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.Dense(D, name="a")(x), x


class KwModel(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.Dense(D, name="sub")(inputs=x)


class TupleModel(nn.Module):
  @nn.compact
  def __call__(self, x):
    a, _ = Pair(name="pair")(x)
    return nn.Dense(2, name="head")(a)


def test_splice_refusals(gpt):
  model, variables, tokens, d, spliced = gpt
  with pytest.raises(sae.SAEError, match=r"\[sae_model_unsupported\]"):
    sae.splice(lambda x: x, "x", d)
  with pytest.raises(sae.SAEError, match=r"\[sae_invalid_argument\]") as info:
    sae.splice(model, 3, d)
  assert info.value.fields["field"] == "site"
  with pytest.raises(sae.SAEError, match=r"\[sae_invalid_argument\]"):
    sae.splice(model, "block_0", "not a dictionary")
  with pytest.raises(sae.SAEError, match=r"\[sae_invalid_argument\]"):
    sae.splice(model, "block_0", d, reads="embed")
  with pytest.raises(sae.SAEError, match=r"\[sae_invalid_argument\]"):
    sae.splice(model, {"block_0": d}, d)
  narrow = sae.SAE.init(jax.random.key(0), D // 2, F, dtype=jnp.float64)
  with pytest.raises(sae.SAEError, match=r"\[sae_shape_mismatch\]"):
    sae.splice(model, "block_0", narrow).apply(variables, tokens)
  with pytest.raises(jl.SiteError, match=r"\[unknown_site\]"):
    sae.splice(model, "block_9", d).apply(variables, tokens)
  x = jnp.ones((2, 4), jnp.float32)
  tm = TupleModel()
  tv = tm.init(jax.random.key(0), x)
  with pytest.raises(jl.SiteError, match=r"\[sae_site_not_array\]"):
    sae.splice(tm, "pair", sae.SAE.init(jax.random.key(0), D, F)).apply(tv, x)
  km = KwModel()
  kv = km.init(jax.random.key(0), x)
  with pytest.raises(jl.SiteError, match=r"\[sae_site_not_array\]"):
    sae.splice(km, "sub", sae.Transcoder.init(jax.random.key(0), 4, F, d_out=D)).apply(kv, x)
  tc = sae.Transcoder.init(jax.random.key(0), D, F, d_out=D)
  with pytest.raises(jl.SiteError, match=r"\[sae_reads_missing\]"):
    sae.splice(model, "block_0", tc, reads="block_1").apply(variables, tokens)


# -- cross-layer transcoders ---------------------------------------------------------------

DC = D
MLPS = [f"block_{i}/mlp" for i in range(L)]
LN2 = jl.module("block_*/ln_2")  # the MLPs' inputs


@pytest.fixture(scope="module")
def clt_gpt(gpt64):
  """The GPT (two blocks, float64) and a ReLU cross-layer transcoder over its MLPs."""
  model, variables, tokens, _ = gpt64
  clt = sae.CrossLayerTranscoder.init(jax.random.key(1), L, DC, FC, dtype=jnp.float64)
  clt = clt.replace(b_enc=jnp.full((L, FC), 0.05), b_dec=jnp.full((L, DC), 0.1))
  return model, variables, tokens, clt, sae.splice(model, "block_*/mlp", clt)


def clt_by_hand(model, clt, edit=lambda layer, acts: acts, keep_error=True):
  """The spliced model written out with a Flax interceptor: layer j's MLP output becomes
  ``b_dec[j] + sum_{i<=j} edit(i, relu(x_i W_enc[i] + b_enc[i])) W_dec[i][j-i]``, plus the
  error ``y_j - (the same with unedited features)``."""

  def run(variables, tokens):
    store = []

    def intercept(next_fun, args, kwargs, context):
      out = next_fun(*args, **kwargs)
      path = "/".join(context.module.path)
      if context.method_name != "__call__" or path not in MLPS:
        return out
      j = MLPS.index(path)
      acts = jax.nn.relu(args[0] @ clt.W_enc[j] + clt.b_enc[j])
      store.append((acts, edit(j, acts)))
      clean = clt.b_dec[j] + sum(store[i][0] @ clt.W_dec[i][j - i] for i in range(j + 1))
      new = clt.b_dec[j] + sum(store[i][1] @ clt.W_dec[i][j - i] for i in range(j + 1))
      return new + (out - clean) if keep_error else new

    with nn.intercept_methods(intercept):
      return model.apply(variables, tokens)

  return run


def test_a_cross_layer_transcoder_splice_is_the_model_and_its_decoders(clt_gpt, gpt64):
  model, variables, tokens, clt, spliced = clt_gpt
  base = gpt64[3]
  t = jl.trace(spliced, variables, tokens, save=jl.module("block_*/mlp/clt/*") | LN2)
  assert [l for l in t.labels if "/clt/" in l] == [
    f"{m}/clt/{s}" for m in MLPS for s in ("acts", "recon", "error")
  ]
  np.testing.assert_allclose(t.output, base, atol=1e-12)
  for j, m in enumerate(MLPS):
    np.testing.assert_allclose(
      t[f"{m}/clt/acts"].out, clt.encode_layer(j, t[f"block_{j}/ln_2"].out)
    )
  # Without the error each MLP's output is the decoders of the layers up to it.
  lossy = sae.splice(model, MLPS, clt, keep_error=False)  # the sites listed, not a glob
  t2 = jl.trace(lossy, variables, tokens, save=jl.module("block_*/mlp") | LN2)
  xs = jnp.stack([t2[f"block_{j}/ln_2"].out for j in range(L)])
  want = clt(xs)
  for j, m in enumerate(MLPS):
    np.testing.assert_allclose(t2[m].out, want[j], atol=1e-12)
  np.testing.assert_allclose(
    t2.output, clt_by_hand(model, clt, keep_error=False)(variables, tokens)
  )
  assert float(jnp.abs(t2.output - base).max()) > 1e-3


def test_cross_layer_features_on_every_door_and_verb(clt_gpt, gpt64, tmp_path):
  model, variables, tokens, clt, spliced = clt_gpt
  acts0 = jl.module("block_0/mlp/clt/acts")
  # Ablating a layer-0 feature changes layers 0 and 1 through its two decoders.
  site = jl.units(acts0, jnp.asarray([2, 5]))
  spec = jl.when(site, jl.zero_ablate())
  want = clt_by_hand(model, clt, lambda j, a: a.at[..., [2, 5]].set(0.0) if j == 0 else a)
  want = want(variables, tokens)
  live = spec.bind(spliced)(variables, tokens)
  np.testing.assert_allclose(live, want, atol=1e-12)
  assert float(jnp.abs(live - gpt64[3]).max()) > 1e-4
  t = jl.trace(spliced, variables, tokens)
  spec.save(tmp_path / "spec")
  doors = {
    "capture": jl.trace(spliced, variables, tokens, intervene=spec).output,
    "replay": t.fork().do(site, jl.zero_ablate()).output,
    "jit": jax.jit(spec.bind(spliced))(variables, tokens),
    "saved spec": jl.load_spec(tmp_path / "spec").bind(spliced)(variables, tokens),
  }
  for name, out in doors.items():
    np.testing.assert_allclose(out, want, atol=1e-12, err_msg=name)
  # Steering a layer-1 feature adds its decoder into layer 1.
  onehot = jnp.zeros((FC,), jnp.float64).at[4].set(1.0)
  steered = jl.when(jl.module("block_1/mlp/clt/acts"), jl.steer(onehot, 2.0)).bind(spliced)
  by_hand = clt_by_hand(model, clt, lambda j, a: a + 2.0 * onehot if j == 1 else a)
  np.testing.assert_allclose(steered(variables, tokens), by_hand(variables, tokens), atol=1e-12)
  # Patching layer-0 features from another prompt.
  other = (tokens + 3) % 11
  donor = jl.trace(spliced, variables, other, save=acts0)
  d0 = donor["block_0/mlp/clt/acts"].out
  patched = jl.when(jl.units(acts0, jnp.asarray([1, 7])), jl.patch_from(donor)).bind(spliced)
  by_hand = clt_by_hand(
    model, clt, lambda j, a: a.at[..., [1, 7]].set(d0[..., [1, 7]]) if j == 0 else a
  )
  np.testing.assert_allclose(patched(variables, tokens), by_hand(variables, tokens), atol=1e-12)
  # trace.grad on layer-0 features: the gradient through both layers' decoders.
  metric = lambda out: out[:, -1, 3].sum()  # noqa: E731
  g = t.grad(metric, sites=["block_0/mlp/clt/acts"]).grad["block_0/mlp/clt/acts"]
  zero = jnp.zeros((2, 6, FC), jnp.float64)
  want_g = jax.grad(
    lambda delta: metric(clt_by_hand(model, clt, lambda j, a: a + delta if j == 0 else a)(
      variables, tokens
    ))
  )(zero)  # fmt: skip
  np.testing.assert_allclose(g, want_g, atol=1e-12)
  assert float(jnp.abs(g).max()) > 1e-4


def test_cross_layer_transcoder_refusals(clt_gpt):
  model, variables, tokens, clt, spliced = clt_gpt
  with pytest.raises(sae.SAEError, match=r"\[sae_shape_mismatch\]") as info:
    sae.splice(model, MLPS[:1] * (L + 1), clt)
  assert info.value.fields["field"] == "n_layers"
  with pytest.raises(sae.SAEError, match=r"\[sae_invalid_argument\]") as info:
    sae.splice(model, MLPS, clt, reads="embed")
  assert info.value.fields["field"] == "reads"
  fewer = sae.CrossLayerTranscoder.init(jax.random.key(0), L - 1, DC, FC, dtype=jnp.float64)
  with pytest.raises(sae.SAEError, match=r"\[sae_shape_mismatch\].*more modules"):
    sae.splice(model, "block_*/mlp", fewer).apply(variables, tokens)
  more = sae.CrossLayerTranscoder.init(jax.random.key(0), L + 1, DC, FC, dtype=jnp.float64)
  with pytest.raises(sae.SAEError, match=rf"\[sae_shape_mismatch\].*matched {L} distinct"):
    sae.splice(model, "block_*/mlp", more).apply(variables, tokens)
  wide = sae.CrossLayerTranscoder.init(jax.random.key(0), L, 6, FC, dtype=jnp.float64)
  with pytest.raises(sae.SAEError, match=r"\[sae_shape_mismatch\]"):
    sae.splice(model, MLPS, wide).apply(variables, tokens)
  with pytest.raises(jl.SiteError, match=r"\[sae_reads_missing\]"):
    sae.splice(model, MLPS[::-1], clt).apply(variables, tokens)
  with pytest.raises(jl.SiteError, match=r"\[unknown_site\]"):
    sae.splice(model, "nothing_*", clt).apply(variables, tokens)


# -- NNX models ----------------------------------------------------------------------------


class NMLP(nnx.Module):
  def __init__(self, rngs):
    self.up = nnx.Linear(DC, 2 * DC, rngs=rngs, param_dtype=jnp.float64)
    self.down = nnx.Linear(2 * DC, DC, rngs=rngs, param_dtype=jnp.float64)

  def __call__(self, h):
    return self.down(jax.nn.relu(self.up(h)))


class NBlock(nnx.Module):
  def __init__(self, rngs):
    self.mlp = NMLP(rngs)

  def __call__(self, h):
    return h + self.mlp(jnp.tanh(h))


class NNet(nnx.Module):
  def __init__(self, rngs):
    self.inp = nnx.Linear(4, DC, rngs=rngs, param_dtype=jnp.float64)
    self.blocks = nnx.List([NBlock(rngs) for _ in range(L)])
    self.out = nnx.Linear(DC, 2, rngs=rngs, param_dtype=jnp.float64)

  def __call__(self, x):
    h = self.inp(x)
    for block in self.blocks:
      h = block(h)
    return self.out(h)


def nnet_by_hand(net, block_out=None, mlp_out=None):
  """NNet's forward written out, with a replacement for a block's or an MLP's output."""
  h, store = net.inp(X_NNX), []
  for j, block in enumerate(net.blocks):
    x = jnp.tanh(h)
    y = block.mlp(x)
    y = y if mlp_out is None else mlp_out(j, x, y, store)
    h = h + y
    h = h if block_out is None or j != 0 else block_out(h)
  return net.out(h)


X_NNX = jax.random.normal(jax.random.key(5), (3, 4), jnp.float64)


def test_splicing_an_nnx_model():
  net = NNet(nnx.Rngs(0))
  base = net(X_NNX)
  d = sae.SAE.init(jax.random.key(1), DC, FC, dtype=jnp.float64).replace(b_dec=jnp.full(DC, 0.1))
  spliced = sae.splice(net, "blocks/0", d)
  assert type(net.blocks[0]) is NBlock  # the model passed in is not changed
  t = jl.trace(spliced, X_NNX, save=jl.module("blocks/0*"))
  assert [l for l in t.labels if "/sae/" in l] == [
    f"blocks/0/sae/{s}" for s in ("acts", "recon", "error")
  ]
  np.testing.assert_allclose(t.output, base, atol=1e-12)
  np.testing.assert_allclose(t["blocks/0/sae/acts"].out, d.encode(t["blocks/0"].out), atol=1e-12)
  # Ablating two features: equal to the forward written out, on the live door, jit and replay.
  feats = jnp.asarray([1, 6])
  site = jl.units(jl.module("blocks/0/sae/acts"), feats)
  spec = jl.when(site, jl.zero_ablate())
  want = nnet_by_hand(net, lambda h: d.decode(d.encode(h).at[..., feats].set(0.0)) + h - d(h))
  np.testing.assert_allclose(spec.bind(spliced)(X_NNX), want, atol=1e-12)
  assert float(jnp.abs(want - base).max()) > 1e-4
  jitted = nnx.jit(lambda m, x: spec.bind(m)(x))(spliced, X_NNX)
  np.testing.assert_allclose(jitted, want, atol=1e-12)
  np.testing.assert_allclose(t.fork().do(site, jl.zero_ablate()).output, want, atol=1e-12)
  # A transcoder at an MLP reads its input; a cross-layer transcoder at every MLP.
  tc = sae.Transcoder.init(jax.random.key(2), DC, FC, dtype=jnp.float64)
  lossy = sae.splice(net, "blocks/1/mlp", tc, keep_error=False)
  np.testing.assert_allclose(
    lossy(X_NNX), nnet_by_hand(net, mlp_out=lambda j, x, y, s: tc(x) if j == 1 else y), atol=1e-12
  )
  clt = sae.CrossLayerTranscoder.init(jax.random.key(3), L, DC, FC, dtype=jnp.float64)
  cross = sae.splice(net, "blocks/*/mlp", clt)
  np.testing.assert_allclose(cross(X_NNX), base, atol=1e-12)

  def clt_ablated(j, x, y, store):
    acts = clt.encode_layer(j, x)
    store.append((acts, acts.at[..., 3].set(0.0) if j == 0 else acts))
    decode = lambda k: clt.b_dec[j] + sum(store[i][k] @ clt.W_dec[i][j - i] for i in range(j + 1))  # noqa: E731
    return decode(1) + y - decode(0)

  ablate = jl.when(jl.units(jl.module("blocks/0/mlp/clt/acts"), jnp.asarray([3])), jl.zero_ablate())
  np.testing.assert_allclose(
    ablate.bind(cross)(X_NNX), nnet_by_hand(net, mlp_out=clt_ablated), atol=1e-12
  )
  with pytest.raises(sae.SAEError, match=r"\[sae_invalid_argument\]") as info:
    sae.splice(net, "blocks/1/mlp", tc, reads="inp")
  assert info.value.fields["field"] == "reads"
  with pytest.raises(sae.SAEError, match=r"\[sae_invalid_argument\]"):
    sae.splice(spliced, "blocks/0", d)
  with pytest.raises(jl.SiteError, match=r"\[unknown_site\]"):
    sae.splice(net, "blocks/7", d)
  with pytest.raises(sae.SAEError, match=r"\[sae_shape_mismatch\]"):
    sae.splice(net, ["blocks/0/mlp", "blocks/*/mlp"], clt)
  with pytest.raises(sae.SAEError, match=r"\[sae_shape_mismatch\]"):
    sae.splice(net, "blocks/0/m*", clt)


def test_splicing_a_converted_torch_model():
  torch = pytest.importorskip("torch")
  from torch_bridge.convert import from_torch

  torch.manual_seed(0)
  seq = torch.nn.Sequential(torch.nn.Linear(D, D), torch.nn.Tanh(), torch.nn.Linear(D, 3))
  model, variables, site_map = from_torch(seq.double(), dtype=torch.float64)
  site = site_map["1"]  # the Tanh's output
  d = sae.SAE.init(jax.random.key(2), D, F, activation="relu", dtype=jnp.float64)
  d = d.replace(b_enc=jnp.full((F,), 0.05))
  spliced = sae.splice(model, site, d)
  x = jnp.asarray(np.random.default_rng(0).normal(size=(4, D)))
  w1, b1, w2, b2 = (
    p.detach().numpy() for p in (seq[0].weight, seq[0].bias, seq[2].weight, seq[2].bias)
  )
  h = np.tanh(np.asarray(x) @ w1.T + b1)
  np.testing.assert_allclose(spliced.apply(variables, x), h @ w2.T + b2, atol=1e-12)
  acts = jl.trace(spliced, variables, x, save=jl.module(f"{site}/sae/acts"))[f"{site}/sae/acts"]
  np.testing.assert_allclose(acts.out, d.encode(h), atol=1e-12)
  feats = jnp.asarray([0, 3, 5])
  spec = jl.when(jl.units(jl.module(f"{site}/sae/acts"), feats), jl.zero_ablate())
  ablated = d.decode(d.encode(h).at[..., feats].set(0.0)) + (h - d(h))
  np.testing.assert_allclose(spec.bind(spliced)(variables, x), ablated @ w2.T + b2, atol=1e-12)
  assert float(jnp.abs(d.encode(h)[..., feats]).max()) > 0  # the ablation removed something
