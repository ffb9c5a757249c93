"""Dictionary formats beyond SAELens's original four: gated and AbsTopK SAELens directories,
written by SAELens itself and read back by it, and the refusals of configs jaxlens would
misread.

In the ``saelens`` xdist group (SAELens's import costs seconds; the worker that runs
test_sae_saelens.py has paid it).
"""

import json

import numpy as np
import pytest

import jax.numpy as jnp

from jaxlens import sae as jsae

from lazy_import import LazyModule, missing

pytestmark = [
  pytest.mark.skipif(bool(missing("torch", "sae_lens")), reason="needs torch and sae-lens"),
  pytest.mark.xdist_group("saelens"),
]
torch = LazyModule("torch")
sae_lens = LazyModule("sae_lens")

D_IN, D_SAE = 6, 16


def rel(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


def _make(arch, **cfg):
  from sae_lens.saes.abstopk_sae import AbsTopKSAE, AbsTopKSAEConfig
  from sae_lens.saes.gated_sae import GatedSAE, GatedSAEConfig

  cls, cfg_cls = {"gated": (GatedSAE, GatedSAEConfig), "abstopk": (AbsTopKSAE, AbsTopKSAEConfig)}[
    arch
  ]
  model = cls(cfg_cls(d_in=D_IN, d_sae=D_SAE, **cfg))
  g = torch.Generator().manual_seed(3)
  with torch.no_grad():
    for p in model.parameters():
      p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float32) * 0.5)
  return model.eval()


CASES = [
  ("gated", {}),
  ("abstopk", {"k": 4}),
  ("abstopk", {"k": 3, "rescale_acts_by_decoder_norm": True, "apply_b_dec_to_input": False}),
]


@pytest.fixture(scope="module")
def x():
  return np.random.default_rng(0).normal(size=(3, 4, D_IN)).astype(np.float32) * 2.0


def _agree(ref, ours, x):
  xt = torch.from_numpy(x)
  with torch.no_grad():
    acts, recon, out = ref.encode(xt), None, ref(xt)
    recon = ref.decode(acts)
  ours_acts = np.asarray(ours.encode(x))
  assert rel(ours_acts, acts.numpy()) <= 1e-6
  assert (ours_acts != 0).sum() == int((acts != 0).sum()) > 0
  assert rel(ours.decode(jnp.asarray(acts.numpy()), x), recon.numpy()) <= 1e-6
  assert rel(ours(x), out.numpy()) <= 1e-6
  return ours_acts


@pytest.mark.parametrize("arch, cfg", CASES, ids=[f"{a}-{len(c)}" for a, c in CASES])
def test_saelens_gated_and_abstopk_both_ways(arch, cfg, x, tmp_path):
  ref = _make(arch, **cfg)
  ref.save_model(tmp_path / "theirs")
  ours = jsae.load_saelens(tmp_path / "theirs")
  assert ours.activation == arch
  acts = _agree(ref, ours, x)
  if arch == "abstopk":  # signed activations, exactly k per row
    assert (acts < 0).any() and ((acts != 0).sum(-1) == cfg["k"]).all()
  else:  # a feature the gate closes is zero although its magnitude path is positive
    xs = jnp.asarray(x)
    assert ((np.asarray(ours.hidden_pre(xs)) > 0) & (acts == 0)).any()
  jsae.save_saelens(ours, tmp_path / "ours")
  back = sae_lens.SAE.load_from_disk(str(tmp_path / "ours")).eval()
  assert type(back) is type(ref) and back.cfg.architecture() == arch
  _agree(back, ours, x)


def test_saelens6_config_without_architecture_is_refused(tmp_path):
  from sae_lens import TopKSAE, TopKSAEConfig

  TopKSAE(TopKSAEConfig(d_in=D_IN, d_sae=D_SAE, k=4)).save_model(tmp_path / "d")
  cfg = json.loads((tmp_path / "d" / "cfg.json").read_text())
  del cfg["architecture"]
  (tmp_path / "d" / "cfg.json").write_text(json.dumps(cfg))
  with pytest.raises(jsae.SAEError) as info:
    jsae.load_saelens(tmp_path / "d")
  assert info.value.fields["code"] == "sae_config_invalid"
  assert info.value.fields["field"] == "architecture"


def test_gated_needs_its_magnitude_path():
  d = jsae.SAE.init(__import__("jax").random.key(0), D_IN, D_SAE, activation="gated")
  assert d.r_mag.shape == (D_SAE,)
  with pytest.raises(jsae.SAEError) as info:
    d.replace(b_mag=None)
  assert info.value.fields["field"] == "r_mag"
  with pytest.raises(jsae.SAEError):
    d.activate(d.hidden_pre(jnp.ones((2, D_IN), d.dtype)))


def test_pre_6_0_boolean_normalize_activations_reads_as_saelens_does(tmp_path, x):
  from sae_lens import StandardSAE, StandardSAEConfig

  ref = StandardSAE(StandardSAEConfig(d_in=D_IN, d_sae=D_SAE))
  with torch.no_grad():
    for i, p in enumerate(ref.parameters()):
      p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(i)) * 0.5)
  ref.save_model(tmp_path / "d")
  cfg = json.loads((tmp_path / "d" / "cfg.json").read_text())
  for key in ("architecture", "metadata"):
    cfg.pop(key)
  cfg.update(normalize_activations=True, activation_fn_str="relu", hook_point="blocks.0.hook_x")
  (tmp_path / "d" / "cfg.json").write_text(json.dumps(cfg))
  ours = jsae.load_saelens(tmp_path / "d")
  assert ours.normalize_activations == "expected_average_only_in"
  theirs = sae_lens.SAE.load_from_disk(str(tmp_path / "d")).eval()
  assert theirs.cfg.normalize_activations == "expected_average_only_in"
  _agree(theirs, ours, x)


@pytest.mark.parametrize("skip", [False, True])
def test_transcoder_with_layer_norm_computes_what_saelens_does(skip, tmp_path, x):
  from sae_lens import SkipTranscoder, SkipTranscoderConfig, Transcoder, TranscoderConfig

  cls, cfg_cls = (SkipTranscoder, SkipTranscoderConfig) if skip else (Transcoder, TranscoderConfig)
  ref = cls(
    cfg_cls(
      d_in=D_IN,
      d_sae=D_SAE,
      d_out=5,
      normalize_activations="layer_norm",
      apply_b_dec_to_input=False,
    )
  )
  with torch.no_grad():
    for i, p in enumerate(ref.parameters()):
      p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(i)) * 0.5)
  ref.save_model(tmp_path / "d")
  ours = jsae.load_saelens(tmp_path / "d")
  assert ours.normalize_activations == "layer_norm"
  with torch.no_grad():
    expected = ref.eval()(torch.from_numpy(x)).numpy()
    decoded = ref.decode(ref.encode(torch.from_numpy(x))).numpy()
  assert rel(ours(x), expected) <= 1e-6
  # decode needs no input: the normalisation is not undone (SAELens's decode(encode(norm(x))))
  assert rel(ours.decode(ours.encode(x)), decoded) <= 1e-6
