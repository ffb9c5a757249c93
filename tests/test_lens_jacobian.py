"""jaxlens.lens's Jacobian lens: the fit equals the reference's estimator computed from a direct
float64 Jacobian (jax.jacrev), fits merge weighted by their prompt counts, the artifact format
reads back, the readout is the logit lens at J = I, and the edits do what they say and keep the
gradient. (Agreement with TransformerLens 4.3.0 itself: benchmarks/jacobian_lens_agreement.py.)"""

from __future__ import annotations

import threading
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxlens as jl
import jaxlens.models as jm
from jaxlens import intervention as ji
from jaxlens import lens
from jaxlens.core import JaxlensWarning

SKIP = 2
PROMPTS = [
  np.asarray([3, 9, 4, 17, 5, 9, 11, 2], np.int32),
  np.asarray([1, 2, 3, 4, 5, 6, 7, 8], np.int32),
  np.asarray([8, 30, 2, 41, 6, 6, 12, 40], np.int32),
]


@pytest.fixture(scope="module")
def gpt2():
  model = jm.GPT2(
    jm.GPT2Config(vocab_size=50, d_model=8, n_layers=3, n_heads=2, max_len=16, dtype=jnp.float64)
  )
  shapes = jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((1, 4), jnp.int32))
  paths, tree = jax.tree_util.tree_flatten_with_path(shapes)
  keys = jax.random.split(jax.random.key(1), len(paths))
  leaves = [
    0.3 * jax.random.normal(k, x.shape, x.dtype) + (1.0 if p[-1].key == "scale" else 0.0)
    for (p, x), k in zip(paths, keys)
  ]
  return model, jax.tree_util.tree_unflatten(tree, leaves)


@pytest.fixture(scope="module")
def fitted(gpt2):
  model, variables = gpt2
  with pytest.warns(JaxlensWarning, match="skipped"):
    fit = lens.fit_jacobian_lens(
      model,
      variables,
      [*PROMPTS, np.asarray([1, 2, 3], np.int32)],  # the last has no valid position
      skip_first_positions=SKIP,
      dim_batch=4,  # 8 directions in two chunks
    )
  return fit


def _direct(model, variables, tokens):
  """The reference's per-prompt matrices of layers 0 and 1 from the full Jacobian (jax.jacrev)
  of the last block's output with respect to each block output (the block output replaced by
  the Jacobian's input), in one compiled program."""
  final = model.block_site(2, "resid_post")

  @jax.jit
  def jacobians(variables, tokens):
    out = []
    for layer in (0, 1):
      name = model.block_site(layer, "resid_post")
      site = jl.label(name)
      h0 = jl.trace(model, variables, tokens[None], save=site)[name].out[0]

      def f(h, site=site):
        spec = jl.when(site, ji.hook(lambda x: h[None].astype(x.dtype)))
        t = jl.trace(model, variables, tokens[None], intervene=spec, save=jl.label(final))
        return t[final].out[0]

      out.append(jax.jacrev(f)(h0))  # (seq, d, seq, d): d final[t', i] / d h[t, j]
    return out

  valid = np.arange(SKIP, tokens.shape[0] - 1)
  return [
    np.asarray(jac[valid][:, :, valid].sum(axis=(0, 2)) / len(valid))  # t' in V, t in V
    for jac in jacobians(variables, tokens)
  ]


def test_fit_is_the_reference_estimator(gpt2, fitted):
  model, variables = gpt2
  assert fitted.source_layers == [0, 1]
  assert fitted.n_prompts == 3
  direct = [_direct(model, variables, jnp.asarray(p)) for p in PROMPTS]  # one program
  for layer in (0, 1):
    want = np.mean([d[layer] for d in direct], axis=0)
    # float32 storage of a float64 fit
    np.testing.assert_allclose(fitted.jacobians[layer], want, rtol=1e-6, atol=1e-6)
    assert np.abs(want).max() > 0.1


def test_gated_mlp_fit_is_the_reference_estimator(monkeypatch):
  """A Llama (gated MLP): the fit, whose MLPs pull back through their per-position Jacobians,
  equals the direct estimator."""
  from jaxlens.lens import _jacobian

  model = jm.Llama(
    jm.LlamaConfig(
      vocab_size=50, d_model=8, n_layers=3, n_heads=2, n_kv_heads=1, d_mlp=12, max_len=16,
      dtype=jnp.float64,
    )
  )  # fmt: skip
  variables = model.init(jax.random.key(2), jnp.asarray(PROMPTS[0])[None])
  variables = jax.tree.map(
    lambda x: x + 0.2 * jax.random.normal(jax.random.key(3), x.shape, x.dtype), variables
  )
  made = []
  real = _jacobian._mlp_jacobians
  monkeypatch.setattr(
    _jacobian, "_mlp_jacobians", lambda budget: made.append(real(budget)) or made[-1]
  )
  fit = lens.fit_jacobian_lens(
    model, variables, PROMPTS[:2], skip_first_positions=SKIP, dim_batch=8, length_bucket=1
  )
  # Both later blocks' MLPs (blocks 1 and 2, on the 5 valid positions) took the Jacobian path.
  assert [f.formed for f in made] == [[(1, 5, 8), (1, 5, 8)]]
  direct = [_direct(model, variables, jnp.asarray(p)) for p in PROMPTS[:2]]
  for layer in (0, 1):
    want = np.mean([d[layer] for d in direct], axis=0)
    np.testing.assert_allclose(fit.jacobians[layer], want, rtol=1e-6, atol=1e-6)
    assert np.abs(want).max() > 0.1


def test_merge_is_weighted_by_prompt_counts(gpt2, fitted):
  model, variables = gpt2
  kw = dict(skip_first_positions=SKIP, source_layers=[0, 1], dim_batch=4)
  a = lens.fit_jacobian_lens(model, variables, PROMPTS[:1], **kw)
  b = lens.fit_jacobian_lens(model, variables, PROMPTS[1:], **kw)
  merged = lens.JacobianLens.merge([a, b])
  assert merged.n_prompts == 3 and merged.metadata["n_prompts"] == 3
  for layer in (0, 1):
    np.testing.assert_allclose(merged.jacobians[layer], fitted.jacobians[layer], atol=1e-6)
  # prompts of 8 and 6 tokens padded to one length in one batch: each is its own estimate
  # (the 6-token prompt's equals its fit at its exact length)
  short = PROMPTS[1][:6]
  mixed = lens.fit_jacobian_lens(model, variables, [PROMPTS[0], short], prompt_batch=2, **kw)
  alone = lens.fit_jacobian_lens(model, variables, [short], length_bucket=1, **kw)
  both = lens.JacobianLens.merge([a, alone])
  for layer in (0, 1):
    np.testing.assert_allclose(mixed.jacobians[layer], both.jacobians[layer], atol=1e-6)
    assert np.abs(alone.jacobians[layer] - a.jacobians[layer]).max() > 1e-2
  other = lens.JacobianLens(a.jacobians, 1, 8, {**a.metadata, "skip_first_positions": 3})
  with pytest.raises(lens.LensError) as e:
    lens.JacobianLens.merge([a, other])
  assert e.value.fields["code"] == "lens_file_mismatch"


def test_batches_on_threads_give_the_same_fit(gpt2, fitted):
  from jax._src.config import trace_context

  from jaxlens.lens import _jacobian

  model, variables = gpt2
  kw = dict(skip_first_positions=SKIP, dim_batch=4)
  one = lens.fit_jacobian_lens(model, variables, PROMPTS, threads=1, **kw)
  two = lens.fit_jacobian_lens(model, variables, PROMPTS, threads=2, **kw)
  for layer in fitted.source_layers:  # the sums are added in the batches' order: bit for bit
    np.testing.assert_array_equal(one.jacobians[layer], two.jacobians[layer])
    np.testing.assert_allclose(two.jacobians[layer], fitted.jacobians[layer], atol=1e-6)
  # the workers (not this thread) run under the caller's thread-local configuration, and the
  # results come in order
  main = threading.get_ident()
  with jax.numpy_dtype_promotion("standard"), jax.enable_x64(False):
    want = trace_context()
    got = list(
      _jacobian._in_order(
        lambda i: (i, trace_context(), threading.get_ident() == main), [(i,) for i in range(7)], 2
      )
    )
  assert got == [(i, want, False) for i in range(7)]


def test_artifact_round_trip_and_refusals(gpt2, fitted, tmp_path):
  from jaxlens.lens._torchfile import write_object

  model, variables = gpt2
  path = tmp_path / "lens.pt"
  lens.save_jacobian_lens(path, fitted, dtype=np.float32)
  back = lens.load_jacobian_lens(path, model)
  assert back.source_layers == fitted.source_layers and back.n_prompts == 3
  assert back.metadata == fitted.metadata
  for layer in (0, 1):
    np.testing.assert_array_equal(back.jacobians[layer], fitted.jacobians[layer])
  lens.save_jacobian_lens(path, fitted)  # float16, the reference's default
  half = lens.load_jacobian_lens(path)
  np.testing.assert_allclose(half.jacobians[1], fitted.jacobians[1], rtol=2e-3, atol=1e-3)
  # The reference's fit checkpoint: running sums and a count.
  ck = tmp_path / "ck.pt"
  sums = {k: v * 3 for k, v in fitted.jacobians.items()}
  write_object(ck, {"jacobian_sum": sums, "n_done": 3, "target_layer": 2, "skip_first": SKIP})
  from_ck = lens.load_jacobian_lens(ck, model)
  np.testing.assert_allclose(from_ck.jacobians[0], fitted.jacobians[0], rtol=1e-6)
  assert from_ck.metadata["converted_from"] == "jacobian_lens_checkpoint"

  def code(fn):
    with pytest.raises(lens.LensError) as e:
      fn()
    return e.value.fields["code"]

  assert code(lambda: lens.load_jacobian_lens(tmp_path / "none.pt")) == "lens_file_missing"
  bad = tmp_path / "bad.pt"
  bad.write_bytes(path.read_bytes()[:-40])
  assert code(lambda: lens.load_jacobian_lens(bad)) == "lens_file_corrupt"
  write_object(bad, {"weights": np.zeros(3)})
  assert code(lambda: lens.load_jacobian_lens(bad)) == "lens_file_corrupt"
  wide = lens.JacobianLens({0: np.eye(4)}, n_prompts=1, d_model=4)
  lens.save_jacobian_lens(bad, wide)
  assert code(lambda: lens.load_jacobian_lens(bad, model)) == "lens_file_mismatch"
  deep = lens.JacobianLens({2: np.eye(8)}, n_prompts=1, d_model=8)  # the last block
  assert code(lambda: lens.jacobian_lens(model, variables, PROMPTS[0][None], deep)) == (
    "lens_file_mismatch"
  )


def test_readout(gpt2, fitted):
  model, variables = gpt2
  tokens = jnp.asarray(PROMPTS[0])[None]

  @jax.jit  # one program: cheaper than the calls one by one
  def readouts(v):
    return (
      lens.jacobian_lens(model, v, tokens, fitted),
      model.apply(v, tokens),
      lens.logit_lens(model, v, tokens, layers=[1, 2]),
      lens.jacobian_lens(model, v, tokens, fitted, layers=[0, 1], use_jacobian=False),
      lens.residuals(model, v, tokens, layers=[1])[0],
      lens.jacobian_lens_topk(model, v, tokens, fitted, k=4, chunk=16).ids,
    )

  logits, out, plain, identity, h, top_ids = readouts(variables)
  assert logits.shape == (3, 1, 8, 50)
  np.testing.assert_allclose(logits[-1], out, atol=1e-12)
  # Without the transport it is the logit lens of the block outputs (lens layer l + 1).
  np.testing.assert_allclose(identity, plain, atol=1e-12)
  # By hand: unembed(J h).
  by_hand = model.unembed(variables, h @ jnp.asarray(fitted.jacobians[0], jnp.float64).T)
  np.testing.assert_allclose(logits[0], by_hand, rtol=1e-5, atol=1e-5)
  np.testing.assert_array_equal(top_ids, jax.lax.top_k(logits, 4)[1])
  with pytest.raises(lens.LensError) as e:
    lens.jacobian_lens(model, variables, tokens, lens.JacobianLens({0: np.eye(8)}, 1, 8), layers=1)
  assert e.value.fields["code"] == "index_out_of_range"


def test_edits_and_their_gradients(gpt2, fitted):
  model, variables = gpt2
  tokens = jnp.asarray(PROMPTS[1])[None]
  layer = 1
  site = model.block_site(layer, "resid_post")
  vecs = lens.jacobian_lens_vectors(model, variables, fitted, [5, 7, 9], layer)
  ro = lens.readout(model, variables)
  np.testing.assert_allclose(
    vecs[0], np.asarray(ro.rows(jnp.asarray(5))) @ fitted.jacobians[layer], rtol=1e-6
  )

  def at_site(v, tokens, rules):
    return jl.trace(model, v, tokens, intervene=rules, save=jl.label(site))[site].out

  # One program per batch of runs (cheaper than one call each).
  clean, donor = jax.jit(
    lambda v: (at_site(v, tokens, []), at_site(v, jnp.asarray(PROMPTS[0])[None], []))
  )(variables)
  edits = {
    "ablation": lens.jacobian_ablation(
      model, variables, fitted, [5, 7, 9], [layer], positions=[-1, 2]
    ),
    "steering": lens.jacobian_steering(model, variables, fitted, 5, [layer], alpha=2.0),
    "swap": lens.jacobian_swap(model, variables, fitted, 5, 7, [layer]),
    "clamped": lens.jacobian_swap(model, variables, fitted, 5, 7, [layer], clamp_to={layer: donor}),
  }
  got = jax.jit(lambda v: {k: at_site(v, tokens, r)[0] for k, r in edits.items()})(variables)

  # Ablation: no component left along any of the three vectors, at the chosen positions only.
  h = got["ablation"]
  assert float(jnp.abs(h[jnp.asarray([2, 7])] @ vecs.T.astype(h.dtype)).max()) < 1e-5
  kept = np.asarray([0, 1, 3, 4, 5, 6])
  np.testing.assert_array_equal(np.asarray(h)[kept], np.asarray(clean)[0, kept])
  # Steering: h + alpha * lower-median norm * unit vector.
  norms = np.sort(np.linalg.norm(np.asarray(clean[0]), axis=-1))
  unit = np.asarray(vecs[0]) / np.linalg.norm(vecs[0])
  np.testing.assert_allclose(
    got["steering"], clean[0] + 2.0 * norms[3] * unit, rtol=1e-6, atol=1e-6
  )
  # Swap: the two lens coordinates exchanged, the rest of the stream untouched; clamped to
  # another run's coordinates (exchanged), at alpha = 1.
  basis = np.asarray(vecs[:2], np.float64).T
  coords = lambda x: np.asarray(x) @ np.linalg.pinv(basis).T  # noqa: E731
  np.testing.assert_allclose(coords(got["swap"]), coords(clean[0])[:, ::-1], rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(
    coords(got["clamped"]), coords(donor[0])[:, ::-1], rtol=1e-5, atol=1e-5
  )

  # Gradient: every edit keeps it (keep_grad's structural check passes) and it reaches block 0
  # (the live swap is the clamped one's code with the live coordinates as its target).
  def grads(v):
    out = []
    for name in ("steering", "ablation", "clamped"):
      kept = [jl.when(sel, ji.keep_grad(edit)) for r in edits[name] for sel, edit in r.rules]
      loss = lambda v, kept=kept: jl.trace(model, v, tokens, intervene=kept).output.sum()  # noqa: E731
      out.append(jax.grad(loss)(v)["params"]["blocks_0"])
    return out

  for g in jax.jit(grads)(variables):
    assert float(max(jnp.abs(x).max() for x in jax.tree_util.tree_leaves(g))) > 0

  def code(fn):
    with pytest.raises(lens.LensError) as e:
      fn()
    return e.value.fields["code"]

  assert code(lambda: lens.jacobian_swap(model, variables, fitted, 5, 5, [1])) == (
    "invalid_argument"
  )
  assert code(lambda: lens.jacobian_steering(model, variables, fitted, 50, [1])) == (
    "index_out_of_range"
  )
  assert code(lambda: lens.jacobian_steering(model, variables, fitted, 5, [3])) == (
    "index_out_of_range"
  )
  assert code(
    lambda: lens.jacobian_swap(model, variables, fitted, 5, 7, [1], clamp_to={0: donor})
  ) == ("lens_data_invalid")


def test_fit_refusals(gpt2):
  model, variables = gpt2

  def code(fn):
    with pytest.raises(lens.LensError) as e, warnings.catch_warnings():
      warnings.simplefilter("ignore", JaxlensWarning)
      fn()
    return e.value.fields["code"]

  fit = lambda p, **kw: lens.fit_jacobian_lens(model, variables, p, **kw)  # noqa: E731
  assert code(lambda: fit(PROMPTS, source_layers=[2])) == "index_out_of_range"
  assert code(lambda: fit(PROMPTS, source_layers=[5])) == "index_out_of_range"
  assert code(lambda: fit([np.ones(3, np.float32)])) == "lens_data_invalid"
  assert code(lambda: fit([np.arange(3)])) == "lens_data_invalid"  # all too short
  assert code(lambda: fit(PROMPTS, dim_batch=0)) == "invalid_argument"
  assert code(lambda: fit(PROMPTS, length_bucket=0)) == "invalid_argument"
  assert code(lambda: fit(PROMPTS, threads=0)) == "invalid_argument"
