"""jaxlens.lens's tuned lens: it starts as the logit lens, training brings every layer's KL
below the logit lens's, tuned-lens's optimiser is torch's SGD, and the files are tuned-lens's
(params.pt read and written without torch, read by torch.load), with typed refusals."""

from __future__ import annotations

import json
import zipfile

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from _lens_models import VOCAB, build
from jaxlens import lens

TOKENS = jnp.asarray([[3, 9, 4, 17, 5, 9, 26, 2], [1, 2, 3, 4, 5, 6, 7, 8]], jnp.int32)


@pytest.fixture(scope="module")
def llama():
  return build("llama")


def _batches(seed, n):
  key = jax.random.key(seed)
  for k in jax.random.split(key, n):
    yield jax.random.randint(k, (4, 8), 0, VOCAB, jnp.int32)


@pytest.fixture(scope="module")
def trained(llama):
  model, variables = llama
  return lens.train_tuned_lens(model, variables, _batches(1, 40), steps=40)


def test_zero_translators_are_the_logit_lens(llama):
  model, variables = llama
  zero = lens.TunedLens.for_model(model)
  np.testing.assert_array_equal(zero.weight, 0)
  got, want = jax.jit(
    lambda v: (lens.tuned_lens(model, v, zero, TOKENS), lens.logit_lens(model, v, TOKENS))
  )(variables)
  np.testing.assert_allclose(got, want, rtol=1e-12)


def test_training_beats_the_logit_lens_at_every_layer(llama, trained):
  model, variables = llama
  assert trained.kl.shape == (40, 2)
  held = next(_batches(99, 1))
  kl = jax.jit(lambda v, t, tl: lens.kl_to_final(model, v, t, tl))
  tuned, logit = kl(variables, held, trained.lens), kl(variables, held, None)
  assert abs(float(logit[-1])) < 1e-12 and abs(float(tuned[-1])) < 1e-12
  assert bool(jnp.all(tuned[:-1] < 0.8 * logit[:-1])), (tuned, logit)
  # the first step's KL is the logit lens's on that batch (the translators start at zero)
  first = kl(variables, next(_batches(1, 1)), None)
  np.testing.assert_allclose(trained.kl[0], first[:-1], rtol=1e-10)


def test_optimizer_is_tuned_lens_clipped_torch_sgd():
  torch = pytest.importorskip("torch")
  steps, w0 = 4, np.asarray([1.0, -2.0, 0.5])
  target = np.asarray([0.3, 0.1, -0.2])
  opt = lens.tuned_lens_optimizer(steps)
  w, state = jnp.asarray(w0), None
  state = opt.init(w)
  for _ in range(steps):
    g = 2 * (w - target)
    upd, state = opt.update(g, state, w)
    w = w + upd
  p = torch.nn.Parameter(torch.tensor(w0))
  sgd = torch.optim.SGD([p], lr=1.0 * (1 - 0.9), momentum=0.9, nesterov=True, weight_decay=1e-3)
  sched = torch.optim.lr_scheduler.LambdaLR(sgd, lambda t: max(0.0, (steps - t) / steps))
  for _ in range(steps):
    sgd.zero_grad()
    ((p - torch.tensor(target)) ** 2).sum().backward()
    torch.nn.utils.clip_grad_norm_([p], 1.0)  # tuned-lens's train loop clips at 1.0
    sgd.step()
    sched.step()
  np.testing.assert_allclose(np.asarray(w), p.detach().numpy(), rtol=1e-12)


def test_files_round_trip_and_torch_reads_them(llama, trained, tmp_path):
  model, variables = llama
  path = lens.save_tuned_lens(tmp_path / "lens", trained.lens, model, variables, model_name="t")
  assert sorted(p.name for p in path.iterdir()) == ["config.json", "params.pt"]
  config = json.loads((path / "config.json").read_text())
  assert config["num_hidden_layers"] == 2 and config["d_model"] == 16
  assert config["unembed_hash"] == lens.unembed_hash(model, variables)
  back = lens.load_tuned_lens(path, model, variables, model_name="t")
  np.testing.assert_array_equal(back.weight, trained.lens.weight)
  np.testing.assert_array_equal(back.bias, trained.lens.bias)
  torch = pytest.importorskip("torch")
  state = torch.load(path / "params.pt", weights_only=True)
  assert sorted(state) == ["0.bias", "0.weight", "1.bias", "1.weight"]
  np.testing.assert_array_equal(state["1.weight"].numpy(), np.asarray(trained.lens.weight[1]))
  # a torch ModuleList of Linear translators saved by torch reads back
  translators = torch.nn.ModuleList([torch.nn.Linear(16, 16, dtype=torch.float64) for _ in "ab"])
  torch.save(translators.state_dict(), path / "params.pt")
  got = lens.load_tuned_lens(path, model, variables)
  h = jax.jit(lambda v: lens.residuals(model, v, TOKENS, layers=[1]))(variables)[0]
  with torch.no_grad():
    want = h + translators[1](torch.tensor(np.asarray(h))).numpy()
  np.testing.assert_allclose(got.translate(h[None], [1])[0], want, rtol=1e-12)


def test_bad_files(llama, trained, tmp_path):
  model, variables = llama
  path = lens.save_tuned_lens(tmp_path / "lens", trained.lens, model, variables, model_name="t")
  with pytest.raises(lens.LensError, match="is for 't', not 'u'") as e:
    lens.load_tuned_lens(path, model, variables, model_name="u")
  assert e.value.code == "lens_file_mismatch"
  other, other_vars = build("llama", seed=5)
  with pytest.raises(lens.LensError, match="unembed_hash differs"):
    lens.load_tuned_lens(path, other, other_vars)
  config = json.loads((path / "config.json").read_text())
  (path / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 3}))
  with pytest.raises(lens.LensError, match="for 3 layers of width 16, the model has 2"):
    lens.load_tuned_lens(path, model, variables)
  (path / "config.json").write_text(json.dumps(config))
  data = (path / "params.pt").read_bytes()
  (path / "params.pt").write_bytes(data[: len(data) // 2])  # truncated
  with pytest.raises(lens.LensError, match="not a readable torch file") as e:
    lens.load_tuned_lens(path, model, variables)
  assert e.value.code == "lens_file_corrupt"
  edited = bytearray(data)
  at = data.index(np.asarray(trained.lens.bias[0]).tobytes()[:8])
  edited[at] ^= 0xFF  # a flipped byte in a tensor: the zip's CRC no longer matches
  (path / "params.pt").write_bytes(bytes(edited))
  with pytest.raises(lens.LensError, match="not a readable torch file"):
    lens.load_tuned_lens(path, model, variables)
  (path / "params.pt").unlink()
  with pytest.raises(lens.LensError, match="no file at") as e:
    lens.load_tuned_lens(path, model, variables)
  assert e.value.code == "lens_file_missing"
  with pytest.raises(lens.LensError, match="no config.json"):
    lens.load_tuned_lens(tmp_path / "nowhere", model, variables)
  with pytest.raises(lens.LensError, match="for a model of 2 layers") as e:
    lens.tuned_lens(model, variables, lens.TunedLens.zeros(3, 16), TOKENS)
  assert e.value.code == "lens_file_mismatch"


def test_save_is_atomic(llama, trained, tmp_path, monkeypatch):
  model, variables = llama
  path = lens.save_tuned_lens(tmp_path / "lens", trained.lens, model, variables)
  before = (path / "params.pt").read_bytes()

  def broken(*args, **kwargs):
    raise OSError("disk full")

  monkeypatch.setattr(zipfile.ZipFile, "writestr", broken)
  with pytest.raises(lens.LensError, match="disk full") as e:
    lens.save_tuned_lens(path, lens.TunedLens.for_model(model), model, variables)
  assert e.value.code == "lens_save_failed"
  assert (path / "params.pt").read_bytes() == before
  assert sorted(p.name for p in path.iterdir()) == ["config.json", "params.pt"]


def test_bad_training_data(llama):
  model, variables = llama
  with pytest.raises(lens.LensError, match="expected int tokens") as e:
    lens.train_tuned_lens(model, variables, [TOKENS.astype(jnp.float32)], steps=1)
  assert e.value.code == "lens_data_invalid"
  nan = jax.tree.map(lambda x: x.at[(0,) * x.ndim].set(jnp.nan), variables)
  with pytest.raises(lens.LensError, match="batch 0: the KL is not finite"):
    lens.train_tuned_lens(model, nan, [TOKENS], steps=1)
  with pytest.raises(lens.LensError, match="ran out after 0 of 2"):
    lens.train_tuned_lens(model, variables, [], steps=2)
  with pytest.raises(lens.LensError, match="steps must be a positive int"):
    lens.train_tuned_lens(model, variables, [TOKENS], steps=0)


def test_agrees_with_the_tuned_lens_package(tmp_path):
  """The same translators give the same lens outputs in tuned-lens 0.2.0 and in jaxlens
  (float32, 1e-5 relative), its files read here and ours read there, the same unembed hash."""
  torch = pytest.importorskip("torch")
  pytest.importorskip("transformers")
  tl_lenses = pytest.importorskip("tuned_lens.nn.lenses")
  from hf_tiny import tiny_hf, zoo_twin

  torch.manual_seed(0)
  hf = tiny_hf("llama")
  lm = zoo_twin(hf, jnp.float32)
  theirs = tl_lenses.TunedLens.from_model(hf)
  with torch.no_grad():
    for t in theirs.layer_translators:
      t.weight.normal_(0, 0.05)
      t.bias.normal_(0, 0.05)
  theirs.save(tmp_path / "tl")
  n = len(theirs)
  with torch.no_grad():
    hs = hf(torch.tensor(np.asarray(TOKENS)), output_hidden_states=True).hidden_states
    want = np.stack([theirs(hs[i], i).numpy() for i in range(n)])
  ours = lens.load_tuned_lens(tmp_path / "tl", lm.model, lm.variables)
  run = jax.jit(lambda v, tl: lens.tuned_lens(lm.model, v, tl, TOKENS, layers=list(range(n))))
  got = run(lm.variables, ours)
  assert float(np.abs(np.asarray(got) - want).max() / np.abs(want).max()) < 1e-5
  lens.save_tuned_lens(tmp_path / "jl", ours, lm.model, lm.variables, model_name="tiny")
  unembed = theirs.unembed
  back = tl_lenses.TunedLens.from_unembed_and_pretrained(unembed, str(tmp_path / "jl"))
  with torch.no_grad():
    again = np.stack([back(hs[i], i).numpy() for i in range(n)])
  np.testing.assert_array_equal(again, want)
  assert json.loads((tmp_path / "jl" / "config.json").read_text())["unembed_hash"] == (
    unembed.unembedding_hash()
  )


def test_data_parallel_over_a_mesh_trains_the_same_lens(llama):
  """Each batch split over a 2-device mesh's data axis: the same lens as on one device. The
  mesh is ``jax.make_mesh``'s, whose axes are Explicit (the embedding lookup of sharded tokens
  has no sharding rule there: the training runs it with Auto axes)."""
  if len(jax.devices()) < 2:
    pytest.skip("needs 2 devices (tests/conftest.py gives the CPU 8)")
  model, variables = llama
  mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
  assert mesh.axis_types == (jax.sharding.AxisType.Explicit,)
  one = lens.train_tuned_lens(model, variables, _batches(3, 3), steps=3)
  two = lens.train_tuned_lens(model, variables, _batches(3, 3), steps=3, mesh=mesh)
  np.testing.assert_allclose(two.lens.weight, one.lens.weight, rtol=1e-9, atol=1e-12)
  np.testing.assert_allclose(two.kl, one.kl, rtol=1e-9)
  assert float(jnp.abs(one.lens.weight).max()) > 0


def test_training_gradient_is_the_kl_gradient():
  """The trainer's one-pass gradient (the lens logits' ``q - p`` pulled back through the final
  norm and unembedding) is ``jax.grad`` of the summed per-layer KL, on Gemma 3's arithmetic
  (``1 + weight`` norm, embedding scale, tied unembedding), with a padding mask."""
  model, variables = build("gemma3")
  n, d = len(model.layer_sites()), model.config.d_model
  kw, kb = jax.random.split(jax.random.key(7))
  start = lens.TunedLens(
    0.1 * jax.random.normal(kw, (n, d, d), jnp.float64),
    0.1 * jax.random.normal(kb, (n, d), jnp.float64),
  )
  mask = jnp.asarray([[1] * 8, [1] * 5 + [0] * 3], jnp.int32)
  step = lens.train_tuned_lens(
    model, variables, [(TOKENS, mask)], steps=1, lens=start, optimizer=optax.sgd(1.0)
  )
  kl = lambda tl: lens.kl_to_final(model, variables, TOKENS, tl, attention_mask=mask)  # noqa: E731
  want = jax.jit(jax.grad(lambda tl: jnp.sum(kl(tl))))(start)
  got = jax.tree.map(lambda a, b: a - b, start, step.lens)
  assert float(jnp.abs(want.weight).max()) > 1e-3
  for g, w in zip(got, want):
    np.testing.assert_allclose(g, w, rtol=1e-9, atol=1e-13)
  np.testing.assert_allclose(step.kl[0], jax.jit(kl)(start)[:-1], rtol=1e-12)


def test_least_squares_start(llama):
  """``TunedLens.lstsq`` is the least-squares fit of the last block's output on each layer's
  residual (with an intercept; ridge 0 matches ``numpy.linalg.lstsq``), its held-out KL is
  below the zero start's (the logit lens) at every layer, and ``init="lstsq"`` starts there."""
  model, variables = llama
  batches = list(_batches(1, 4))
  fitted = lens.TunedLens.lstsq(model, variables, batches, ridge=0.0)
  res = jax.jit(lambda v, t: lens.residuals(model, v, t))(variables, jnp.concatenate(batches))
  res = np.asarray(res).reshape(res.shape[0], -1, res.shape[-1])
  for layer in range(2):
    x = np.concatenate([res[layer], np.ones((res.shape[1], 1))], 1)
    coef = np.linalg.lstsq(x, res[-1], rcond=None)[0]  # h_final ~ h @ A + c
    np.testing.assert_allclose(np.eye(16) + fitted.weight[layer].T, coef[:-1], atol=1e-8)
    np.testing.assert_allclose(fitted.bias[layer], coef[-1], atol=1e-8)
  held = next(_batches(99, 1))
  kl = jax.jit(lambda v, t, tl: lens.kl_to_final(model, v, t, tl))
  ridged = lens.TunedLens.lstsq(model, variables, batches)
  start, logit = kl(variables, held, ridged), kl(variables, held, None)
  assert bool(jnp.all(start[:-1] < 0.95 * logit[:-1])), (start, logit)  # 1.17 < 1.24, 0.41 < 0.51
  run = lens.train_tuned_lens(model, variables, batches, steps=1, init="lstsq", init_batches=4)
  np.testing.assert_allclose(run.kl[0], kl(variables, batches[0], ridged)[:-1], rtol=1e-10)
  with pytest.raises(lens.LensError, match="init must be 'zeros' or 'lstsq'"):
    lens.train_tuned_lens(model, variables, batches, steps=1, init="identity")
  with pytest.raises(lens.LensError, match="init_batches must be a positive int"):
    lens.train_tuned_lens(model, variables, batches, steps=1, init="lstsq", init_batches=0)
  with pytest.raises(lens.LensError, match="ridge must be a number >= 0"):
    lens.TunedLens.lstsq(model, variables, batches, ridge=-1.0)
  with pytest.raises(lens.LensError, match="no token to fit") as e:
    lens.TunedLens.lstsq(model, variables, [])
  assert e.value.code == "lens_data_invalid"
