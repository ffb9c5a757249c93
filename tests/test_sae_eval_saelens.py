"""jaxlens.sae.evaluate against SAELens's own ``run_evals``: the same SAE on the same tiny
GPT-2 (transformers' model for SAELens, its zoo twin for jaxlens, float64) gives the same
KL divergences, cross-entropies and scores, shrinkage, sparsity, variance and per-feature
metrics.

SAELens's evaluation calls a TransformerLens model only through ``__call__``,
``run_with_hooks`` and ``run_with_cache``; ``_Hooked`` gives it those over the transformers
model (a forward hook on the MLP, TransformerLens's ``lm_cross_entropy_loss``), so SAELens's
own code does the splicing, the masking and every reduction.
"""

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from jaxlens import sae as jsae

from lazy_import import LazyModule, missing

pytestmark = [
  pytest.mark.skipif(
    bool(missing("torch", "sae_lens", "transformers")), reason="needs torch, sae-lens, transformers"
  ),
  pytest.mark.xdist_group("saelens"),
]
torch = LazyModule("torch")

HOOK = "blocks.0.hook_mlp_out"
BOS = 1


class _Hooked:
  """TransformerLens's interface, as far as ``sae_lens.evals`` uses it, over a transformers
  GPT-2 whose block-0 MLP output is the hook point."""

  def __init__(self, hf):
    self.hf, self.site = hf, hf.transformer.h[0].mlp

  def __call__(self, tokens, return_type="both", loss_per_token=True, **kwargs):
    from transformer_lens.utils import lm_cross_entropy_loss

    logits = self.hf(tokens).logits
    return logits, lm_cross_entropy_loss(logits, tokens, per_token=loss_per_token)

  def run_with_hooks(self, tokens, fwd_hooks=(), **kwargs):
    ((name, fn),) = fwd_hooks
    assert name == HOOK
    handle = self.site.register_forward_hook(lambda module, args, out: fn(out, hook=None))
    try:
      return self(tokens, **kwargs)
    finally:
      handle.remove()

  def run_with_cache(self, tokens, names_filter=(), **kwargs):
    saved = {}
    handle = self.site.register_forward_hook(lambda m, a, out: saved.setdefault(HOOK, out))
    try:
      self.hf(tokens)
    finally:
      handle.remove()
    return None, saved


class _Store:
  """The activation store's token batches (all SAELens's evals read from it)."""

  def __init__(self, batches):
    self.batches, self.i = batches, 0
    self.store_batch_size_prompts, self.context_size = batches[0].shape

  def get_batch_tokens(self, n):
    batch = self.batches[self.i % len(self.batches)]
    self.i += 1
    return torch.from_numpy(batch)

  def reset_input_dataset(self):
    self.i = 0


@pytest.fixture(scope="module")
def gpt2():
  from hf_tiny import exact_float64, tiny_hf, zoo_twin

  hf = exact_float64(tiny_hf("gpt2", dtype=torch.float64))
  twin = zoo_twin(hf, jnp.float64)
  rng = np.random.default_rng(0)
  batches = [rng.integers(3, 64, size=(3, 10)) for _ in range(2)]
  for b in batches:
    b[:, 0] = BOS  # ignored, as SAELens ignores special tokens
  b[1, 4] = BOS
  return hf, twin, batches


def _saes(arch, **cfg):
  """The same random SAE in SAELens (float64, hooked at HOOK) and in jaxlens."""
  from sae_lens.registry import get_sae_class

  cls, cfg_cls = get_sae_class(arch)
  ref = cls(cfg_cls(d_in=32, d_sae=48, dtype="float64", **cfg)).eval()
  ref.cfg.metadata.hook_name = HOOK
  g = torch.Generator().manual_seed(1)
  with torch.no_grad():
    for name, p in ref.named_parameters():
      value = torch.randn(p.shape, generator=g, dtype=torch.float64) * 0.3
      p.copy_(value.abs() if name == "threshold" else value)
  weights = {n: jnp.asarray(p.detach().numpy()) for n, p in ref.named_parameters()}
  if "b_gate" in weights:
    weights["b_enc"] = weights.pop("b_gate")
  ours = jsae.SAE(**weights, activation=arch, k=cfg.get("k"))
  return ref, ours


# SAELens counts in float32 (torch's default dtype): L0 per token and the features' firing
# counts; jaxlens's are exact ratios of integers.
FLOAT32 = {"l0": 1e-7, "feature_density": 1e-7, "consistent_activation_heuristic": 1e-7}


def test_evaluate_is_saelens_run_evals(gpt2):
  """A JumpReLU SAE with an activation scale not folded in (SAELens's ActivationScaler)."""
  from sae_lens.evals import get_eval_everything_config, run_evals
  from sae_lens.training.activation_scaler import ActivationScaler

  hf, twin, batches = gpt2
  ref, ours = _saes("jumprelu")
  factor = 0.8
  with torch.no_grad():
    want, want_features = run_evals(
      ref,
      _Store(batches),
      _Hooked(hf),
      ActivationScaler(scaling_factor=factor),
      get_eval_everything_config(
        batch_size_prompts=3, n_eval_reconstruction_batches=2, n_eval_sparsity_variance_batches=2
      ),
      exclude_special_tokens=[BOS],
    )
  got, got_features = jsae.evaluate(
    twin.model,
    twin.variables,
    [jnp.asarray(b) for b in batches],
    "blocks_0/mlp",
    ours,
    ignore_tokens=[BOS],
    scaling_factor=factor,
  )
  del want["token_stats"]
  assert sorted(got) == sorted(want)
  for group, values in want.items():
    assert sorted(got[group]) == sorted(values), group
    for name, value in values.items():
      tol = FLOAT32.get(name, 1e-12)
      assert got[group][name] == pytest.approx(value, rel=tol, abs=1e-12), (group, name)
  assert 0 < got["model_performance_preservation"]["ce_loss_score"] != 1
  assert sorted(got_features) == sorted(want_features)
  for name, value in want_features.items():
    tol = FLOAT32.get(name, 1e-12)
    np.testing.assert_allclose(got_features[name], value, rtol=tol, atol=1e-12, err_msg=name)


def test_weight_metrics_of_a_gated_sae_and_refusals(gpt2):
  from sae_lens.evals import get_featurewise_weight_based_metrics

  ref, ours = _saes("gated")
  want = get_featurewise_weight_based_metrics(ref)
  got = jsae.weight_metrics(ours)
  assert sorted(got) == sorted(want) == ["encoder_decoder_cosine_sim", "encoder_norm"]
  for name, value in want.items():
    np.testing.assert_allclose(got[name], value, rtol=1e-12, err_msg=name)

  _, twin, batches = gpt2
  tc = jsae.Transcoder.init(jax.random.key(0), 32, 8, d_out=32)

  def code(fn):
    with pytest.raises(jsae.SAEError) as e:
      fn()
    return e.value.fields["code"], e.value.fields["field"]

  run = jsae.reconstruction_metrics
  tokens = jnp.asarray(batches[0])
  assert code(lambda: run(twin.model, twin.variables, tokens, "blocks_0/mlp", tc)) == (
    "sae_invalid_argument",
    "dictionary",
  )
  assert code(
    lambda: run(twin.model, twin.variables, tokens, "blocks_0/mlp", ours, scaling_factor=0.0)
  ) == ("sae_invalid_argument", "scaling_factor")
  assert code(lambda: run(twin.model, twin.variables, tokens[0], "blocks_0/mlp", ours)) == (
    "sae_invalid_argument",
    "tokens",
  )
  ones = jnp.full((2, 5), BOS)
  assert code(
    lambda: run(twin.model, twin.variables, ones, "blocks_0/mlp", ours, ignore_tokens=[BOS])
  ) == ("sae_invalid_argument", "ignore_tokens")
  x = jnp.zeros((2, 5, 7))
  assert code(lambda: jsae.sparsity_variance_metrics(ours, x)) == (
    "sae_shape_mismatch",
    "activations",
  )
  assert code(lambda: jsae.weight_metrics("sae")) == ("sae_invalid_argument", "dictionary")
