"""jaxlens.sae against SAELens itself (torch): files both ways, the same forward for every
architecture, and one training step's loss terms and gradients.

Every test that imports sae_lens is in this file (its import costs seconds), in one xdist group.
"""

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from jaxlens import sae as jsae

from lazy_import import LazyModule, missing

pytestmark = [
  pytest.mark.skipif(bool(missing("torch", "sae_lens")), reason="needs torch and sae-lens"),
  pytest.mark.xdist_group("saelens"),
]
torch = LazyModule("torch")
sae_lens = LazyModule("sae_lens")

D_IN, D_SAE, D_OUT = 6, 16, 5


def rel(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


def _randomise(model, seed):
  """Random weights (and positive thresholds) in every parameter of a SAELens module."""
  g = torch.Generator().manual_seed(seed)
  with torch.no_grad():
    for name, p in model.named_parameters():
      value = torch.randn(p.shape, generator=g, dtype=torch.float32) * 0.5
      if name == "threshold":
        value = value.abs() * 0.5
      p.copy_(value)
  return model


def _make(arch, seed=0, **cfg):
  from sae_lens import (
    JumpReLUSAE,
    JumpReLUSAEConfig,
    JumpReLUSkipTranscoder,
    JumpReLUSkipTranscoderConfig,
    JumpReLUTranscoder,
    JumpReLUTranscoderConfig,
    SkipTranscoder,
    SkipTranscoderConfig,
    StandardSAE,
    StandardSAEConfig,
    TopKSAE,
    TopKSAEConfig,
    Transcoder,
    TranscoderConfig,
  )

  classes = {
    "standard": (StandardSAE, StandardSAEConfig),
    "jumprelu": (JumpReLUSAE, JumpReLUSAEConfig),
    "topk": (TopKSAE, TopKSAEConfig),
    "transcoder": (Transcoder, TranscoderConfig),
    "skip_transcoder": (SkipTranscoder, SkipTranscoderConfig),
    "jumprelu_transcoder": (JumpReLUTranscoder, JumpReLUTranscoderConfig),
    "jumprelu_skip_transcoder": (JumpReLUSkipTranscoder, JumpReLUSkipTranscoderConfig),
  }
  cls, cfg_cls = classes[arch]
  if "transcoder" in arch:
    cfg = {"d_out": D_OUT, "apply_b_dec_to_input": False, **cfg}
  return _randomise(cls(cfg_cls(d_in=D_IN, d_sae=D_SAE, **cfg)), seed).eval()


CASES = [
  ("standard", {}),
  ("standard", {"apply_b_dec_to_input": False}),
  ("standard", {"normalize_activations": "constant_norm_rescale"}),
  ("standard", {"normalize_activations": "layer_norm"}),
  ("jumprelu", {}),
  ("topk", {"k": 4}),
  ("topk", {"k": 3, "rescale_acts_by_decoder_norm": True}),
  ("transcoder", {}),
  ("skip_transcoder", {}),
  ("jumprelu_transcoder", {}),
  ("jumprelu_skip_transcoder", {}),
]


@pytest.fixture(scope="module")
def x():
  return np.random.default_rng(0).normal(size=(3, 4, D_IN)).astype(np.float32) * 2.0


def _agree(ref, ours, x):
  """encode, decode and forward of SAELens's ``ref`` and jaxlens's ``ours`` on ``x``."""
  xt = torch.from_numpy(x)
  with torch.no_grad():
    acts = ref.encode(xt)
    recon = ref.decode(acts) if not hasattr(ref, "W_skip") else None
    out = ref(xt)
  ours_acts = ours.encode(x)
  assert rel(ours_acts, acts.numpy()) <= 1e-6
  assert int((np.asarray(ours_acts) != 0).sum()) == int((acts != 0).sum())
  if recon is not None:
    assert rel(ours.decode(jnp.asarray(acts.numpy()), x), recon.numpy()) <= 1e-6
  assert rel(ours(x), out.numpy()) <= 1e-6


@pytest.mark.parametrize("arch, cfg", CASES, ids=[f"{a}-{'-'.join(c)}" for a, c in CASES])
def test_saved_by_saelens_loads_and_agrees(arch, cfg, x, tmp_path):
  ref = _make(arch, **cfg)
  ref.save_model(tmp_path / "d")
  ours = jsae.load_saelens(tmp_path / "d")
  expected_cls = jsae.Transcoder if "transcoder" in arch else jsae.SAE
  assert type(ours) is expected_cls
  assert ours.W_enc.dtype == jnp.float32 and ours.d_sae == D_SAE
  _agree(ref, ours, x)


# One case per architecture (the options are read and written by the same code).
BACK = [c for i, c in enumerate(CASES) if i == 0 or CASES[i - 1][0] != c[0]]


@pytest.mark.parametrize("arch, cfg", BACK, ids=[f"{a}-{'-'.join(c)}" for a, c in BACK])
def test_saved_by_jaxlens_loads_in_saelens(arch, cfg, x, tmp_path):
  ours = jsae.load_saelens(_saved(arch, cfg, tmp_path / "ref"))
  jsae.save_saelens(ours, tmp_path / "ours")
  back = sae_lens.SAE.load_from_disk(str(tmp_path / "ours")).eval()
  assert back.cfg.architecture() == arch
  assert back.cfg.d_sae == D_SAE
  _agree(back, ours, x)


def _saved(arch, cfg, path):
  _make(arch, seed=1, **cfg).save_model(path)
  return path


def test_batchtopk_training_sae_agrees_and_saves_as_jumprelu(x, tmp_path):
  from sae_lens import BatchTopKTrainingSAE, BatchTopKTrainingSAEConfig

  ref = _randomise(
    BatchTopKTrainingSAE(
      BatchTopKTrainingSAEConfig(d_in=D_IN, d_sae=D_SAE, k=3.0, rescale_acts_by_decoder_norm=False)
    ),
    2,
  )
  flat = x.reshape(-1, D_IN)
  with torch.no_grad():
    acts = ref.encode(torch.from_numpy(flat))
  ours = jsae.SAE(
    *(jnp.asarray(getattr(ref, n).detach().numpy()) for n in ("W_enc", "b_enc", "W_dec", "b_dec")),
    activation="batchtopk",
    k=3.0,
  )
  assert rel(ours.encode(flat), acts.numpy()) <= 1e-6
  assert int((np.asarray(ours.encode(flat)) != 0).sum()) == 3 * flat.shape[0]
  # SAELens's inference save of a BatchTopK SAE is a JumpReLU one with the running threshold.
  with torch.no_grad():
    ref.topk_threshold.fill_(0.25)
  ref.save_inference_model(tmp_path / "inf")
  loaded = jsae.load_saelens(tmp_path / "inf")
  assert loaded.activation == "jumprelu"
  np.testing.assert_allclose(loaded.threshold, 0.25, rtol=1e-7)
  assert rel(loaded.encode(flat), ours.to_jumprelu(0.25).encode(flat)) <= 1e-6
  # Its training save (architecture "batchtopk") loads as a BatchTopK SAE.
  ref.save_model(tmp_path / "train")
  again = jsae.load_saelens(tmp_path / "train")
  assert again.activation == "batchtopk" and again.k == 3.0
  assert again.metadata["topk_threshold"] == pytest.approx(0.25)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float64"])
def test_other_dtypes_round_trip(dtype, x, tmp_path):
  ref = _make("standard", seed=3, dtype=dtype)
  ref.save_model(tmp_path / "d")
  ours = jsae.load_saelens(tmp_path / "d")
  assert ours.dtype == jnp.dtype(dtype)
  jsae.save_saelens(ours, tmp_path / "back")
  back = sae_lens.SAE.load_from_disk(str(tmp_path / "back"))
  assert str(back.W_enc.dtype) == f"torch.{dtype}"
  with torch.no_grad():
    want = back(torch.from_numpy(x).to(getattr(torch, dtype))).float().numpy()
  tol = {"float16": 2e-2, "bfloat16": 1e-1, "float64": 1e-12}[dtype]
  assert rel(np.asarray(ours(x).astype(jnp.float32)), want) <= tol


# -- one training step: the same loss terms and gradients as SAELens's training SAEs -----------

TRAIN_CASES = [
  ("standard", "relu", {"l1_coefficient": 0.7}),
  ("topk", "topk", {"k": 4, "rescale_acts_by_decoder_norm": False}),
  ("topk", "topk", {"k": 4, "rescale_acts_by_decoder_norm": True}),
  ("batchtopk", "batchtopk", {"k": 3.0, "rescale_acts_by_decoder_norm": True}),
  ("jumprelu", "jumprelu", {"l0_coefficient": 0.3, "jumprelu_bandwidth": 0.5}),
]


@pytest.mark.parametrize(
  "arch, ours_arch, cfg", TRAIN_CASES, ids=[f"{a}-{i}" for i, (a, _, _) in enumerate(TRAIN_CASES)]
)
def test_one_training_step_matches_saelens(arch, ours_arch, cfg):
  from jaxlens.sae import train as jtrain
  from sae_lens.saes.sae import TrainStepInput

  cls, cfg_cls = sae_lens.registry.get_sae_training_class(arch)
  ref = _randomise(cls(cfg_cls(d_in=D_IN, d_sae=D_SAE, **cfg)), 4)
  if arch == "jumprelu":
    with torch.no_grad():
      ref.threshold.copy_(torch.linspace(0.0, 0.6, D_SAE))
  x = np.random.default_rng(5).normal(size=(12, D_IN)).astype(np.float32)
  dead = np.zeros(D_SAE, bool)
  dead[[1, 3, 5, 8, 13]] = True
  coefficient = cfg.get("l1_coefficient", cfg.get("l0_coefficient", 1.0))
  out = ref.training_forward_pass(
    TrainStepInput(
      sae_in=torch.from_numpy(x),
      coefficients={"l1": coefficient, "l0": coefficient},
      dead_neuron_mask=torch.from_numpy(dead),
      n_training_steps=0,
      is_logging_step=False,
    )
  )
  out.loss.backward()
  names = ["W_enc", "b_enc", "W_dec", "b_dec"] + (["threshold"] if arch == "jumprelu" else [])
  weights = {n: jnp.asarray(getattr(ref, n).detach().numpy()) for n in names}
  ours_cfg = jtrain.TrainConfig(
    d_sae=D_SAE,
    architecture=ours_arch,
    **{k: v for k, v in cfg.items() if k != "l1_coefficient" and k != "l0_coefficient"},
    l1_coefficient=cfg.get("l1_coefficient", 1.0),
    l0_coefficient=cfg.get("l0_coefficient", 1.0),
  )
  d = jsae.SAE(
    **weights,
    activation={"relu": "relu"}.get(ours_arch, ours_arch),
    k=cfg.get("k"),
    rescale_acts_by_decoder_norm=cfg.get("rescale_acts_by_decoder_norm", False),
  )

  def loss(d):
    total, terms, _ = jtrain.loss_terms(d, ours_cfg, jnp.asarray(x), dead=jnp.asarray(dead))
    return total, terms

  # Jitted: one compilation costs less than dispatching every op (and cond branch) eagerly.
  (total, terms), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(d)
  assert sorted(terms) == sorted(out.losses)
  for name, value in out.losses.items():
    assert float(terms[name]) == pytest.approx(float(value.detach()), rel=1e-5, abs=1e-7), name
  assert float(total) == pytest.approx(float(out.loss.detach()), rel=1e-5)
  if ours_arch in ("topk", "batchtopk"):
    assert float(terms["auxiliary_reconstruction_loss"]) > 0  # the dead mask was used
  for name in names:
    assert rel(getattr(grads, name), getattr(ref, name).grad.numpy()) <= 1e-5, name
