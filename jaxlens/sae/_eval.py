"""Evaluating a dictionary as SAELens reports it (``sae_lens.evals.run_evals``).

Three groups of numbers, each SAELens's definition term for term:

* :func:`reconstruction_metrics` (the model with the SAE spliced in at a site, and with the
  site zero-ablated): per-token KL divergence ``KL(clean || edited)`` of the next-token
  distributions, next-token cross-entropy, and the scores ``kl_div_score =
  (kl_ablation - kl_sae) / kl_ablation`` and ``ce_loss_score = (ce_ablation - ce_sae) /
  (ce_ablation - ce_clean)``;
* :func:`sparsity_variance_metrics` (the dictionary on activations): L2 norms in and out
  and their per-token ratio (shrinkage), the relative reconstruction bias (``E|x_hat|^2 /
  E<x, x_hat>``, Eq. 10 of arXiv:2404.16014), L0, L1, explained variance (and SAELens's
  legacy per-token form), MSE, cosine similarity, and per feature the density and the
  consistent-activation heuristic;
* :func:`weight_metrics`: per feature the encoder norm, the encoder-decoder cosine
  similarity and the encoder bias.

:func:`evaluate` runs all three on a model and token batches, grouped as ``run_evals``
returns them.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import jax
import jax.numpy as jnp
import numpy as np

from jaxlens import core as jl
from jaxlens.intervention import hook, zero_ablate
from jaxlens.sae._dictionaries import SAE, SAEError, Transcoder

__all__ = ["evaluate", "reconstruction_metrics", "sparsity_variance_metrics", "weight_metrics"]


def _check_sae(dictionary, fn: str):
  if not isinstance(dictionary, SAE) or isinstance(dictionary, Transcoder):
    raise SAEError(
      f"{fn} evaluates an SAE (it reads and writes one site), got {type(dictionary).__name__}",
      code="sae_invalid_argument",
      field="dictionary",
      fix="an SAE; a transcoder's output is another site's (splice it and compare the model)",
    )


def _check_scale(scaling_factor):
  if scaling_factor is not None and not (
    isinstance(scaling_factor, (int, float))
    and not isinstance(scaling_factor, bool)
    and math.isfinite(scaling_factor)
    and scaling_factor > 0
  ):
    raise SAEError(
      f"scaling_factor must be None or a finite positive number, got {scaling_factor!r}",
      code="sae_invalid_argument",
      field="scaling_factor",
      fix="the factor training used (Trained.scaling_factor), or None once folded",
    )


def _batches(tokens) -> list:
  """One ``(batch, seq)`` array, or an iterable of them, as a list of arrays."""
  if hasattr(tokens, "shape"):
    tokens = [tokens]
  out = [jnp.asarray(t) for t in tokens]
  if not out or any(t.ndim != 2 or not jnp.issubdtype(t.dtype, jnp.integer) for t in out):
    raise SAEError(
      "tokens must be a (batch, seq) int array or a non-empty list of them, got "
      + ", ".join(f"{t.dtype}{list(t.shape)}" for t in out),
      code="sae_invalid_argument",
      field="tokens",
      fix="tokens of shape (batch, seq)",
    )
  return out


def _keep(tokens, ignore_tokens):
  """SAELens's mask: the positions whose token is not one of ``ignore_tokens``."""
  keep = jnp.ones(tokens.shape, bool)
  for token in ignore_tokens:
    keep = keep & (tokens != token)
  return keep


def _replace(dictionary, scaling_factor):
  """The site's value replaced by the reconstruction (scaled in and out as SAELens's
  ``ActivationScaler``), where ``keep`` is true."""

  def reconstruct(x):
    scaled = x if scaling_factor is None else x * scaling_factor
    out = dictionary.decode(dictionary.encode(scaled), scaled).astype(x.dtype)
    return out if scaling_factor is None else out / scaling_factor

  return reconstruct


def _selector(site):
  return jl.module(site) if isinstance(site, str) else site


def reconstruction_metrics(
  model,
  variables,
  tokens,
  site,
  dictionary,
  *,
  ignore_tokens: Iterable[int] = (),
  scaling_factor: float | None = None,
) -> dict:
  """KL divergence and cross-entropy with the SAE spliced in at ``site`` and with the site
  zero-ablated (SAELens's ``get_downstream_reconstruction_metrics``).

  Args:
    model: a linen module whose output is the logits ``(batch, seq, vocab)``.
    variables: its variables.
    tokens: a ``(batch, seq)`` int array, or a list of them (the means are over every kept
      token of every batch).
    site: the module path whose output the SAE reads and replaces (or a ``jl.module``
      selector).
    dictionary: an :class:`~jaxlens.sae.SAE`.
    ignore_tokens: token ids (BOS, padding...) whose positions keep the model's own value at
      the site and are left out of the means (SAELens's ``exclude_special_tokens``; the
      zero ablation replaces every position, as SAELens's does).
    scaling_factor: the activation scale the SAE was trained at, if not folded in.

  Returns:
    ``{"kl_div_with_sae", "kl_div_with_ablation", "kl_div_score", "ce_loss_with_sae",
    "ce_loss_without_sae", "ce_loss_with_ablation", "ce_loss_score"}`` (floats). The
    cross-entropy at position ``i`` predicts token ``i + 1`` and is kept when token ``i`` is.
  """
  _check_sae(dictionary, "reconstruction_metrics")
  _check_scale(scaling_factor)
  ignore = tuple(int(t) for t in ignore_tokens)
  selector = _selector(site)
  reconstruct = _replace(dictionary, scaling_factor)

  @jax.jit
  def sums(variables, tokens):
    keep = _keep(tokens, ignore)

    def spliced_site(x):
      return jnp.where(keep[..., None], reconstruct(x), x)

    clean = model.apply(variables, tokens)
    spliced = jl.when(selector, hook(spliced_site)).bind(model)(variables, tokens)
    zeroed = jl.when(selector, zero_ablate()).bind(model)(variables, tokens)
    logp = jax.nn.log_softmax(clean, axis=-1)
    out = {}
    for name, logits in (("sae", spliced), ("ablation", zeroed)):
      logq = jax.nn.log_softmax(logits, axis=-1)
      kl = jnp.sum(jnp.exp(logp) * (logp - logq), axis=-1)
      out[f"kl_div_with_{name}"] = jnp.sum(jnp.where(keep, kl, 0))
    ce_keep = keep[:, :-1]
    for name, logits in (("sae", spliced), ("ablation", zeroed), (None, clean)):
      logq = jax.nn.log_softmax(logits[:, :-1], axis=-1)
      ce = -jnp.take_along_axis(logq, tokens[:, 1:, None], axis=-1)[..., 0]
      key = "ce_loss_without_sae" if name is None else f"ce_loss_with_{name}"
      out[key] = jnp.sum(jnp.where(ce_keep, ce, 0))
    return out, jnp.sum(keep), jnp.sum(ce_keep)

  batches = _batches(tokens)
  if not any(bool(_keep(b, ignore)[:, :-1].any()) for b in batches):
    raise SAEError(
      "every position is an ignored token (or the sequences have one token)",
      code="sae_invalid_argument",
      field="ignore_tokens",
      fix="fewer ignore_tokens, or longer sequences",
    )
  totals: dict = {}
  n_kl = n_ce = 0
  for batch in batches:
    out, kept, ce_kept = jax.device_get(sums(variables, batch))
    for k, v in out.items():
      totals[k] = totals.get(k, 0.0) + float(v)
    n_kl += int(kept)
    n_ce += int(ce_kept)
  m = {k: v / (n_ce if k.startswith("ce") else n_kl) for k, v in totals.items()}
  m["kl_div_score"] = (m["kl_div_with_ablation"] - m["kl_div_with_sae"]) / m["kl_div_with_ablation"]
  m["ce_loss_score"] = (m["ce_loss_with_ablation"] - m["ce_loss_with_sae"]) / (
    m["ce_loss_with_ablation"] - m["ce_loss_without_sae"]
  )
  order = (
    "kl_div_with_sae",
    "kl_div_with_ablation",
    "kl_div_score",
    "ce_loss_with_sae",
    "ce_loss_without_sae",
    "ce_loss_with_ablation",
    "ce_loss_score",
  )
  return {k: m[k] for k in order}


@jax.jit
def _batch_sums(dictionary, x, keep, scaling_factor):
  """One batch's sums for :func:`sparsity_variance_metrics` (``x``: ``(batch, ctx, d)``)."""
  scaled = x * scaling_factor
  acts = dictionary.encode(scaled)
  out = dictionary.decode(acts, scaled).astype(x.dtype) / scaling_factor
  w = keep.astype(x.dtype)
  n = jnp.sum(w)
  norm_in = jnp.linalg.norm(x, axis=-1)
  norm_out = jnp.linalg.norm(out, axis=-1)
  ratio = norm_out / jnp.where(jnp.abs(norm_in) < 1e-4, 1, norm_in)
  dot = jnp.sum(x * out, axis=-1)
  resid = jnp.sum((x - out) ** 2, axis=-1)
  mean = jnp.sum(x * w[..., None], axis=(0, 1)) / n
  batch_var = jnp.sum((x - mean) ** 2, axis=-1)
  cos = dot / (norm_in * norm_out)
  fired = (acts != 0) & keep[..., None]
  sums = {
    "l2_norm_in": norm_in,
    "l2_norm_out": norm_out,
    "l2_ratio": ratio,
    "l0": jnp.sum(acts != 0, axis=-1).astype(x.dtype),
    "l1": jnp.sum(jnp.abs(acts), axis=-1).astype(x.dtype),
    "explained_variance_legacy": 1 - resid / batch_var,
    "mse": resid,
    "cossim": cos,
  }
  sums = {k: jnp.sum(jnp.where(keep, v, 0)) for k, v in sums.items()}
  # The relative reconstruction bias is a ratio of this batch's means (averaged over batches).
  rrb = jnp.sum(jnp.where(keep, norm_out**2, 0)) / jnp.sum(jnp.where(keep, dot, 0))
  variance = {
    "sum_x": jnp.sum(x * w[..., None], axis=(0, 1)),
    "sum_sq": jnp.sum(jnp.where(keep[..., None], x**2, 0)),
    "sum_resid": sums["mse"],
  }
  features = {
    "acts": jnp.sum(fired, axis=(0, 1)),
    "prompts": jnp.sum(jnp.any(fired, axis=1), axis=0),
  }
  return sums, rrb, variance, features, n


def sparsity_variance_metrics(
  dictionary,
  activations,
  *,
  keep=None,
  scaling_factor: float | None = None,
) -> tuple[dict, dict]:
  """Shrinkage, sparsity and reconstruction metrics of ``dictionary`` on ``activations``
  (SAELens's ``get_sparsity_and_variance_metrics``; float64 sums on the host, as its
  explained-variance calculator).

  Args:
    dictionary: an :class:`~jaxlens.sae.SAE`.
    activations: ``(batch, ctx, d_in)`` activations, or a list of such batches.
    keep: ``(batch, ctx)`` bool (or a list, one per batch): the tokens counted (default
      all); SAELens's mask of special tokens.
    scaling_factor: the activation scale the SAE was trained at, if not folded in (the
      dictionary sees ``x * factor``, its reconstruction is divided by it).

  Returns:
    ``(metrics, feature_metrics)``: ``metrics`` has ``l2_norm_in``, ``l2_norm_out``,
    ``l2_ratio`` (per token, an input norm under 1e-4 counted as 1),
    ``relative_reconstruction_bias`` (per batch, averaged over batches), ``l0``, ``l1``,
    ``explained_variance_legacy``, ``mse``, ``cossim``, ``explained_variance``;
    ``feature_metrics`` has ``feature_density`` (the fraction of kept tokens each feature
    fires on) and ``consistent_activation_heuristic`` (tokens fired on per prompt fired in),
    as ``(d_sae,)`` arrays.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from jaxlens import sae
    >>> d = sae.SAE.init(jax.random.key(1), 8, 32, activation="topk", k=4)
    >>> x = jax.random.normal(jax.random.key(2), (2, 5, 8), jnp.float32)
    >>> metrics, per_feature = sae.sparsity_variance_metrics(d, x)
    >>> metrics["l0"], per_feature["feature_density"].shape
    (4.0, (32,))
  """
  _check_sae(dictionary, "sparsity_variance_metrics")
  _check_scale(scaling_factor)
  xs = [activations] if hasattr(activations, "shape") else list(activations)
  keeps = [keep] if keep is None or hasattr(keep, "shape") else list(keep)
  if keep is None:
    keeps = [None] * len(xs)
  if not xs or len(keeps) != len(xs):
    raise SAEError(
      f"{len(xs)} activation batches and {len(keeps)} masks",
      code="sae_invalid_argument",
      field="keep",
      fix="one (batch, ctx) mask per activation batch, or keep=None",
    )
  sums: dict = {}
  rrbs, n_tokens = [], 0
  sum_x, sum_sq, sum_resid = 0.0, 0.0, 0.0
  fired_acts = fired_prompts = 0
  for i, (x, k) in enumerate(zip(xs, keeps)):
    x = jnp.asarray(x)
    if x.ndim != 3 or x.shape[-1] != dictionary.d_in:
      raise SAEError(
        f"activation batch {i} has shape {x.shape}, expected (batch, ctx, {dictionary.d_in})",
        code="sae_shape_mismatch",
        field="activations",
        expected=f"(batch, ctx, {dictionary.d_in})",
        received=str(x.shape),
        fix="the site's activations as (batch, ctx, d_in)",
      )
    k = jnp.ones(x.shape[:2], bool) if k is None else jnp.asarray(k, bool)
    scale = jnp.asarray(1.0 if scaling_factor is None else scaling_factor, x.dtype)
    s, rrb, var, feat, n = jax.device_get(_batch_sums(dictionary, x, k, scale))
    for name, v in s.items():
      sums[name] = sums.get(name, 0.0) + float(v)
    rrbs.append(float(rrb))
    n_tokens += int(n)
    sum_x = sum_x + np.asarray(var["sum_x"], np.float64)
    sum_sq += float(var["sum_sq"])
    sum_resid += float(var["sum_resid"])
    fired_acts = fired_acts + np.asarray(feat["acts"], np.float64)
    fired_prompts = fired_prompts + np.asarray(feat["prompts"], np.float64)
  if n_tokens == 0:
    raise SAEError(
      "no token is kept",
      code="sae_invalid_argument",
      field="keep",
      fix="a mask that keeps some tokens",
    )
  metrics = {k: v / n_tokens for k, v in sums.items()}
  metrics["relative_reconstruction_bias"] = float(np.mean(rrbs))
  total_variance = sum_sq / n_tokens - float(np.sum((sum_x / n_tokens) ** 2))
  mse = sum_resid / n_tokens
  if total_variance < 1e-10:
    metrics["explained_variance"] = 1.0 if mse < 1e-10 else 0.0
  else:
    metrics["explained_variance"] = 1.0 - mse / total_variance
  with np.errstate(divide="ignore", invalid="ignore"):
    features = {
      "feature_density": fired_acts / n_tokens,
      "consistent_activation_heuristic": fired_acts / fired_prompts,
    }
  return metrics, features


def weight_metrics(dictionary) -> dict:
  """Per feature: ``encoder_norm`` (the norm of its ``W_enc`` column),
  ``encoder_decoder_cosine_sim`` (the cosine of its encoder column and decoder row) and
  ``encoder_bias`` (``b_enc``; not for a gated SAE, whose ``b_enc`` is the gate's, as
  SAELens's ``get_featurewise_weight_based_metrics``), as ``(d_sae,)`` arrays."""
  if not isinstance(dictionary, SAE):
    raise SAEError(
      f"weight_metrics reads an SAE or a transcoder, got {type(dictionary).__name__}",
      code="sae_invalid_argument",
      field="dictionary",
      fix="an SAE",
    )
  enc = dictionary.W_enc / jnp.linalg.norm(dictionary.W_enc, axis=0, keepdims=True)
  dec = dictionary.W_dec / jnp.linalg.norm(dictionary.W_dec, axis=1, keepdims=True)
  # torch's cosine_similarity: the dot over the product of norms clamped at 1e-8.
  dot = jnp.sum(enc.T * dec, axis=-1)
  den = jnp.maximum(jnp.linalg.norm(enc, axis=0) * jnp.linalg.norm(dec, axis=1), 1e-8)
  out = {
    "encoder_norm": np.asarray(jnp.linalg.norm(dictionary.W_enc, axis=0)),
    "encoder_decoder_cosine_sim": np.asarray(dot / den),
  }
  if dictionary.activation != "gated":
    out["encoder_bias"] = np.asarray(dictionary.b_enc)
  return out


def evaluate(
  model,
  variables,
  tokens,
  site,
  dictionary,
  *,
  ignore_tokens: Iterable[int] = (),
  scaling_factor: float | None = None,
) -> tuple[dict, dict]:
  """Every metric of SAELens's ``run_evals`` (``get_eval_everything_config``) on ``tokens``.

  The site's activations are collected from the same batches (the sparsity and variance
  metrics leave out the ``ignore_tokens`` positions too). Arguments as
  :func:`reconstruction_metrics`.

  Returns:
    ``(metrics, feature_metrics)``: ``metrics`` grouped as SAELens's
    (``model_behavior_preservation``, ``model_performance_preservation``, ``shrinkage``,
    ``sparsity``, ``reconstruction_quality``), ``feature_metrics`` the per-feature arrays of
    :func:`sparsity_variance_metrics` and :func:`weight_metrics`.

  (docs/dictionaries.md, "Evaluation", has the table of metrics.)
  """
  _check_sae(dictionary, "evaluate")
  batches = _batches(tokens)
  ignore = tuple(int(t) for t in ignore_tokens)
  r = reconstruction_metrics(
    model,
    variables,
    batches,
    site,
    dictionary,
    ignore_tokens=ignore,
    scaling_factor=scaling_factor,
  )
  selector = _selector(site)
  collect = jax.jit(
    lambda v, t: list(jl.trace(model, v, t, save=[selector], keep_inputs=False).values.values())
  )
  xs = []
  for batch in batches:
    values = collect(variables, batch)
    if len(values) != 1 or not hasattr(values[0], "shape") or values[0].ndim != 3:
      raise SAEError(
        f"the site {site!r} gives {len(values)} values, not one (batch, seq, d) array",
        code="sae_invalid_argument",
        field="site",
        fix="one module path whose output is (batch, seq, d)",
      )
    xs.append(values[0])
  keeps = [_keep(b, ignore) for b in batches]
  s, features = sparsity_variance_metrics(dictionary, xs, keep=keeps, scaling_factor=scaling_factor)
  groups = {
    "model_behavior_preservation": {k: r[k] for k in r if k.startswith("kl")},
    "model_performance_preservation": {k: r[k] for k in r if k.startswith("ce")},
    "shrinkage": {
      k: s[k] for k in ("l2_norm_in", "l2_norm_out", "l2_ratio", "relative_reconstruction_bias")
    },
    "sparsity": {k: s[k] for k in ("l0", "l1")},
    "reconstruction_quality": {
      k: s[k] for k in ("explained_variance", "explained_variance_legacy", "mse", "cossim")
    },
  }
  return groups, {**features, **weight_metrics(dictionary)}
