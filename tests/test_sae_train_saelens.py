"""jaxlens.sae.train's training methods against SAELens's own trainer (``SAETrainer.fit``):
the same initial weights and batches give the same loss terms at every step and the same
parameters after a few steps, in float64.

SAELens keeps a JumpReLU threshold in float32 whatever the SAE's dtype, and sums the norms of
its scale estimate in float32: those cases agree to float32 rounding (stated per case).
"""

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from jaxlens import sae as jsae
from jaxlens.sae import train as st

from lazy_import import LazyModule, missing

pytestmark = [
  pytest.mark.skipif(bool(missing("torch", "sae_lens")), reason="needs torch and sae-lens"),
  pytest.mark.xdist_group("saelens"),
]
torch = LazyModule("torch")

D_IN, D_SAE, ROWS, STEPS = 6, 16, 24, 4


def rel(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


def _batches(n, seed=0, scale=3.0):
  rng = np.random.default_rng(seed)
  return [rng.normal(size=(ROWS, D_IN)) * scale + 0.5 for _ in range(n)]


def _saelens_fit(arch, sae_cfg, trainer_cfg, batches, seed=0, setup=None):
  """SAELens's training SAE (float64, random weights from ``seed``), trained by its own
  ``SAETrainer.fit`` on ``batches``: ``(initial weights, per-step losses, trained SAE,
  trainer)``."""
  from sae_lens.config import SAETrainerConfig
  from sae_lens.registry import get_sae_training_class
  from sae_lens.training.sae_trainer import SAETrainer

  cls, cfg_cls = get_sae_training_class(arch)
  ref = cls(cfg_cls(d_in=D_IN, d_sae=D_SAE, dtype="float64", **sae_cfg))
  g = torch.Generator().manual_seed(seed)
  with torch.no_grad():
    for name, p in ref.named_parameters():
      value = torch.randn(p.shape, generator=g, dtype=torch.float64) * 0.5
      if name == "threshold":  # float32 in SAELens; values exact in float32
        value = (value.abs() * 0.5).float().double()
      p.copy_(value.to(p.dtype))
    if setup is not None:
      setup(ref)
  initial = {n: p.detach().double().numpy().copy() for n, p in ref.named_parameters()}
  steps = len(batches) - trainer_cfg.get("n_batches_for_norm_estimate", 0)
  trainer_cfg = {"lr_end": trainer_cfg.get("lr", 3e-4) / 10, **trainer_cfg}  # the runner's default
  cfg = SAETrainerConfig(
    total_training_samples=steps * ROWS, train_batch_size_samples=ROWS, **trainer_cfg
  )
  trainer = SAETrainer(cfg, ref, iter([torch.from_numpy(b) for b in batches]))
  losses = []
  inner = trainer._train_step

  def record(sae, sae_in):
    out = inner(sae=sae, sae_in=sae_in)
    losses.append(
      {k: float(v.detach()) for k, v in out.losses.items()} | {"loss": float(out.loss.detach())}
    )
    return out

  trainer._train_step = record
  trained = trainer.fit()
  return initial, losses, trained, trainer


def _some_dead(ref):
  """Features that never fire (so the dead-feature losses have work from the second step)."""
  bias = ref.b_gate if hasattr(ref, "b_gate") else ref.b_enc
  bias[[1, 2, 5, 7, 11, 12, 13]] = -50.0


def _jaxlens(initial, arch, **fields):
  names = {"b_gate": "b_enc"}
  weights = {names.get(n, n): jnp.asarray(v) for n, v in initial.items()}
  return jsae.SAE(**weights, activation=arch, **fields)


def _compare(losses, trained_jl, ref, tol, skip=()):
  for step, want in enumerate(losses):
    for name, value in want.items():
      got = trained_jl.metrics[name][step]
      assert got == pytest.approx(value, rel=tol, abs=tol * 1e-2), (step, name)
  names = {"b_gate": "b_enc"}
  for name, p in ref.named_parameters():
    if name in skip:
      continue
    got = getattr(trained_jl.sae, names.get(name, name))
    assert rel(got, p.detach().double().numpy()) <= tol, name


# The JumpReLU cases: SAELens's threshold is float32, so 1e-6 (float64 otherwise agrees to
# ~1e-13).
JUMPRELU = [
  ({"l0_coefficient": 0.3, "pre_act_loss_coefficient": 0.05, "l0_warm_up_steps": 2}, {}),
  ({"jumprelu_sparsity_loss_mode": "tanh", "jumprelu_ste_to_input": True}, {}),
  ({"jumprelu_sparsity_loss_mode": "quadratic", "target_l0": 5.0, "l0_coefficient": 0.1}, {}),
]


@pytest.mark.parametrize("cfg, _", JUMPRELU, ids=["step-preact-warmup", "tanh-ste", "quadratic"])
def test_jumprelu_variants_train_as_saelens(cfg, _):
  batches = _batches(STEPS)
  cfg = dict(cfg)
  warm = cfg.pop("l0_warm_up_steps", 0)
  sae_cfg = {"jumprelu_bandwidth": 0.5, **cfg}
  trainer = {"lr": 1e-2, "dead_feature_window": 0}
  initial, losses, ref, _ = _saelens_fit(
    "jumprelu", {**sae_cfg, "l0_warm_up_steps": warm}, trainer, batches, setup=_some_dead
  )
  ours_cfg = st.TrainConfig(
    d_sae=D_SAE,
    architecture="jumprelu",
    lr=1e-2,
    dead_feature_window=0,
    dtype="float64",
    coefficient_warm_up_steps=warm,
    **sae_cfg,
  )
  ours = st.train(
    iter(batches), ours_cfg, steps=STEPS, init=_jaxlens(initial, "jumprelu"), progress=False
  )
  assert "pre_act_loss" not in cfg or max(ours.metrics["pre_act_loss"]) > 0
  _compare(losses, ours, ref, 1e-6)


def test_gated_trains_as_saelens():
  batches = _batches(STEPS, seed=1)
  initial, losses, ref, _ = _saelens_fit(
    "gated", {"l1_coefficient": 0.2, "l1_warm_up_steps": 2}, {"lr": 1e-2}, batches
  )
  cfg = st.TrainConfig(
    d_sae=D_SAE,
    architecture="gated",
    lr=1e-2,
    l1_coefficient=0.2,
    coefficient_warm_up_steps=2,
    dtype="float64",
  )
  ours = st.train(iter(batches), cfg, steps=STEPS, init=_jaxlens(initial, "gated"), progress=False)
  _compare(losses, ours, ref, 1e-11)


def test_matryoshka_batchtopk_trains_as_saelens():
  """With the per-level AuxK and decoder-norm rescaling (without them, the AuxK is
  BatchTopK's, checked in tests/test_sae_saelens.py)."""
  matryoshka_aux = True
  batches = _batches(STEPS, seed=2)
  sae_cfg = {
    "k": 3.0,
    "matryoshka_widths": [5, D_SAE],
    "use_matryoshka_aux_loss": matryoshka_aux,
    "rescale_acts_by_decoder_norm": matryoshka_aux,
    "aux_loss_coefficient": 0.5,
  }
  initial, losses, ref, _ = _saelens_fit(
    "matryoshka_batchtopk",
    sae_cfg,
    {"lr": 1e-2, "dead_feature_window": 0},
    batches,
    setup=_some_dead,
  )
  assert max(s["auxiliary_reconstruction_loss"] for s in losses) > 0
  cfg = st.TrainConfig(
    d_sae=D_SAE, architecture="matryoshka_batchtopk", lr=1e-2, dead_feature_window=0,
    dtype="float64", **{**sae_cfg, "matryoshka_widths": (5,)},
  )  # fmt: skip
  assert cfg.matryoshka_widths == (5, D_SAE)  # d_sae appended, as SAELens does
  init = _jaxlens(
    initial,
    "batchtopk",
    k=3.0,
    rescale_acts_by_decoder_norm=sae_cfg["rescale_acts_by_decoder_norm"],
  )
  ours = st.train(iter(batches), cfg, steps=STEPS, init=init, progress=False)
  _compare(losses, ours, ref, 1e-10)
  assert float(ours.state.topk_threshold) == pytest.approx(float(ref.topk_threshold), rel=1e-12)


def test_scale_estimate_schedules_and_fold_as_saelens():
  """BatchTopK with ``expected_average_only_in``: the factor from the first batches, training
  on the scaled ones after a warm-up, a cosine to lr_end and a final decay, the fold, and the
  running threshold through the fold (SAELens's fix #763) into the inference JumpReLU SAE."""
  n_norm = 2
  batches = _batches(n_norm + 6, seed=3)
  trainer = {
    "lr": 2e-2,
    "lr_scheduler_name": "cosineannealing",
    "lr_end": 4e-3,
    "lr_warm_up_steps": 2,
    "lr_decay_steps": 2,
    "n_batches_for_norm_estimate": n_norm,
    "dead_feature_window": 1,
  }
  sae_cfg = {
    "k": 3.0,
    "normalize_activations": "expected_average_only_in",
    "rescale_acts_by_decoder_norm": True,
  }
  initial, losses, ref, _ = _saelens_fit("batchtopk", sae_cfg, trainer, batches)
  cfg = st.TrainConfig(
    d_sae=D_SAE, architecture="batchtopk", k=3.0, lr=2e-2, lr_scheduler="cosineannealing",
    rescale_acts_by_decoder_norm=True, lr_end=4e-3, lr_warm_up_steps=2, lr_decay_steps=2,
    dead_feature_window=1, normalize_activations="expected_average_only_in",
    n_batches_for_norm_estimate=n_norm, dtype="float64",
  )  # fmt: skip
  init = _jaxlens(initial, "batchtopk", k=3.0, rescale_acts_by_decoder_norm=True)
  ours = st.train(iter(batches), cfg, steps=6, init=init, progress=False)
  want = np.sqrt(D_IN) / np.mean([np.linalg.norm(b, axis=-1).mean() for b in batches[:n_norm]])
  assert ours.scaling_factor == pytest.approx(want, rel=1e-13)
  # SAELens sums the norms in float32: its factor, and everything after it, to ~1e-7.
  _compare(losses, ours, ref, 1e-6)
  x = batches[-1]
  with torch.no_grad():
    assert rel(ours.sae.encode(x), ref.encode(torch.from_numpy(x)).numpy()) <= 1e-6
  inference = ours.inference()
  assert float(inference.threshold[0]) == pytest.approx(float(ref.topk_threshold), rel=1e-6)
  assert ref.topk_threshold != 0


@pytest.mark.parametrize(
  "name, warm, decay, lr_end",
  [("constant", 0, 0, None), ("constant", 3, 4, None), ("cosineannealing", 2, 3, 0.05)],
)
def test_learning_rate_schedules_are_saelens(name, warm, decay, lr_end):
  from sae_lens.training.optim import get_lr_scheduler

  steps, lr = 14, 0.3
  param = torch.nn.Parameter(torch.zeros(1))
  opt = torch.optim.Adam([param], lr=lr)
  end = lr / 10 if lr_end is None else lr_end
  sched = get_lr_scheduler(name, opt, steps, lr, warm, decay, end, 1)
  want = []
  for _ in range(steps):
    want.append(opt.param_groups[0]["lr"])
    opt.step()
    sched.step()
  cfg = st.TrainConfig(
    d_sae=4, architecture="relu", lr=lr, lr_scheduler=name, lr_end=lr_end,
    lr_warm_up_steps=warm, lr_decay_steps=decay,
  )  # fmt: skip
  ours = st.schedule(cfg, steps)
  np.testing.assert_allclose([float(ours(i)) for i in range(steps)], want, rtol=1e-12)


@pytest.mark.parametrize(
  "arch, cfg",
  [("jumprelu", {}), ("gated", {}), ("topk", {"k": 3, "rescale_acts_by_decoder_norm": True})],
)
def test_fold_decoder_norm_is_saelens(arch, cfg):
  from sae_lens.registry import get_sae_class

  cls, cfg_cls = get_sae_class(arch)
  ref = cls(cfg_cls(d_in=D_IN, d_sae=D_SAE, dtype="float64", **cfg))
  g = torch.Generator().manual_seed(5)
  with torch.no_grad():
    for _, p in ref.named_parameters():
      p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64).abs() * 0.5)
  fields = {
    "k": cfg.get("k"),
    "rescale_acts_by_decoder_norm": cfg.get("rescale_acts_by_decoder_norm", False),
  }
  ours = _jaxlens({n: p.detach().numpy() for n, p in ref.named_parameters()}, arch, **fields)
  ref.fold_W_dec_norm()
  folded = st.fold_decoder_norm(ours)
  for name, p in ref.named_parameters():
    got = getattr(folded, {"b_gate": "b_enc"}.get(name, name))
    assert rel(got, p.detach().numpy()) <= 1e-14, name
  x = np.random.default_rng(6).normal(size=(5, D_IN))
  assert rel(folded(x), ours(x)) <= 1e-12


def test_refusals_of_the_training_methods():
  def code(fn):
    with pytest.raises(jsae.SAEError) as e:
      fn()
    return e.value.fields["code"], e.value.fields["field"]

  def config(**fields):
    return lambda: st.TrainConfig(**{"d_sae": 8, "architecture": "relu", **fields})

  bad = "sae_config_invalid"
  jump, mat = {"architecture": "jumprelu"}, {"architecture": "matryoshka_batchtopk", "k": 2.0}
  scaled = {"normalize_activations": "expected_average_only_in"}
  for fields, field in [
    ({**jump, "jumprelu_sparsity_loss_mode": "l2"}, "jumprelu_sparsity_loss_mode"),
    ({**jump, "jumprelu_sparsity_loss_mode": "quadratic"}, "target_l0"),
    ({**jump, "jumprelu_sparsity_loss_mode": "quadratic", "target_l0": 9}, "target_l0"),
    ({**mat, "matryoshka_widths": (4, 4)}, "matryoshka_widths"),
    ({**mat, "matryoshka_widths": (16,)}, "matryoshka_widths"),
    ({**mat}, "matryoshka_widths"),
    ({**jump, "jumprelu_tanh_scale": float("nan")}, "jumprelu_tanh_scale"),
    ({**jump, "pre_act_loss_coefficient": -1.0}, "pre_act_loss_coefficient"),
    ({"lr_scheduler": "cosineannealingwarmrestarts"}, "lr_scheduler"),
    ({"lr_scheduler": "cosineannealing", "lr_end": 0.0, "lr_decay_steps": 3}, "lr_end"),
    ({"lr_end": -1.0}, "lr_end"),
    ({"normalize_activations": "layer_norm"}, "normalize_activations"),
    ({**scaled, "transcoder": True}, "normalize_activations"),
    ({**scaled, "n_batches_for_norm_estimate": 0}, "n_batches_for_norm_estimate"),
    ({"architecture": "gated", "transcoder": True}, "architecture"),
  ]:
    assert code(config(**fields)) == (bad, field), fields
  topk = jsae.SAE.init(jax.random.key(0), 4, 8, activation="topk", k=2)
  assert code(lambda: st.fold_decoder_norm(topk)) == (bad, "rescale_acts_by_decoder_norm")
  assert code(lambda: st.fold_decoder_norm("sae")) == ("sae_invalid_argument", "d")
  assert code(lambda: st.fold_activation_scale(topk, 0.0)) == ("sae_invalid_argument", "factor")
  assert code(lambda: st.estimate_scaling_factor([np.zeros((3, 4))])) == (
    "sae_batch_invalid",
    "batches",
  )
  assert code(lambda: st.estimate_scaling_factor([])) == ("sae_batch_invalid", "batches")
  short = config(architecture="topk", k=2, n_batches_for_norm_estimate=3, **scaled)()
  run = lambda: st.train(iter(_batches(2)), short, steps=1, progress=False)  # noqa: E731
  assert code(run) == ("sae_batch_invalid", "data")
