"""Training sparse dictionaries in JAX: ``jaxlens.sae.train``.

:func:`train` fits an SAE (or a transcoder, from pairs of sites) to batches of
activations, from a :mod:`jaxlens.store` dataset (``store.batches(site, batch_size=...,
flatten=True, shuffle=True)``) or any iterator of arrays, with optax. Each step is one
compiled program (forward, loss terms, gradient, clipping, Adam, decoder normalisation,
dead-feature counters and metrics); with ``mesh=`` the batch is split over the mesh's
devices (data parallel: the dictionary is replicated and XLA sums the gradients), in one
process or across processes.

Architectures and losses (SAELens's definitions, ``sae_lens.saes.*TrainingSAE``):

* ``"relu"`` (SAELens ``standard``): ``mse + l1_coefficient * mean(|acts * |W_dec row||_1)``.
* ``"topk"``: ``mse + aux_loss_coefficient * AuxK``, where AuxK has the top ``d_in // 2``
  pre-activations of the dead features reconstruct the residual ``x - x_hat`` (scaled down
  while fewer than ``d_in // 2`` features are dead).
* ``"batchtopk"``: TopK's losses with the ``k * rows`` largest activations of the whole
  batch; a running threshold (the mean of each batch's smallest kept activation, at rate
  ``topk_threshold_lr``) makes the inference SAE a JumpReLU one (:meth:`Trained.inference`).
* ``"matryoshka_batchtopk"``: BatchTopK's losses plus ``inner_mse_loss_{width}`` for each
  nested width of ``matryoshka_widths`` but the last (the reconstruction from the features
  below it); with ``use_matryoshka_aux_loss`` each level has its own AuxK.
* ``"jumprelu"``: ``mse + l0_coefficient * mean(sparsity)``, the JumpReLU through a
  straight-through estimator (rectangle kernel of width ``jumprelu_bandwidth``) for the
  threshold, which is clamped at 0 before each step; the sparsity is the L0 through the same
  estimator (``"step"``), ``sum tanh(scale * acts * |W_dec row|)`` (``"tanh"``) or
  ``2 / target_l0 * (L0 - target_l0)^2`` (``"quadratic"``); optionally Anthropic's
  pre-activation loss on dead features and the estimators' gradient to the input.
* ``"gated"``: ``mse + l1_coefficient * mean(sum(relu(gate_pre) * |W_dec row|))`` plus the
  reconstruction error of ``relu(gate_pre) @ W_dec + b_dec``.

``mse`` is the squared error summed over the feature axis and averaged over rows. The
sparsity coefficient warms up linearly over ``coefficient_warm_up_steps``; the learning
rate follows SAELens's schedule (:func:`schedule`: warm-up, constant or cosine to ``lr_end``,
linear decay to 0); gradients are clipped to global norm 1 as torch's ``clip_grad_norm_``
does. ``normalize_activations="expected_average_only_in"`` trains on activations scaled by
:func:`estimate_scaling_factor` and folds the factor into the result
(:func:`fold_activation_scale`); :func:`fold_decoder_norm` gives unit decoder rows.
``b_dec`` starts at the mean of the first batch (``b_dec_init="mean"``).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Iterable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxlens import core as jl
from jaxlens.internal import Checkpoints, auto_axes, require, signature
from jaxlens.intervention import zero_ablate
from jaxlens.sae._dictionaries import SAE, SAEError, Transcoder, batch_topk_relu
from jaxlens.sae._splice import splice

__all__ = [
  "ARCHITECTURES",
  "TrainConfig",
  "Trained",
  "train",
  "schedule",
  "estimate_scaling_factor",
  "fold_activation_scale",
  "fold_decoder_norm",
  "loss_terms",
  "explained_variance",
  "ce_loss_recovered",
  "jumprelu",
  "step_function",
]


ARCHITECTURES = ("relu", "topk", "batchtopk", "matryoshka_batchtopk", "jumprelu", "gated")
_TOPK = ("topk", "batchtopk", "matryoshka_batchtopk")  # the k family
_BATCH = ("batchtopk", "matryoshka_batchtopk")  # a running threshold, JumpReLU at inference


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  """What :func:`train` fits and how.

  Attributes:
    d_sae: the number of features.
    architecture: ``"relu"``, ``"topk"``, ``"batchtopk"``, ``"matryoshka_batchtopk"``,
      ``"jumprelu"`` or ``"gated"``.
    k: TopK's active features per row; BatchTopK's mean active features per row.
    transcoder: fit a :class:`~jaxlens.sae.Transcoder` to ``(x, y)`` batches.
    skip: a transcoder with a skip connection ``W_skip``.
    lr, adam_beta1, adam_beta2: Adam's (SAELens's defaults).
    lr_scheduler: ``"constant"`` or ``"cosineannealing"`` (SAELens's ``lr_scheduler_name``):
      the learning rate between the warm-up and the decay, constant at ``lr`` or a cosine
      from ``lr`` to ``lr_end`` over those steps.
    lr_end: the cosine's final learning rate and the start of the final decay (default
      ``lr / 10``, as SAELens's); ignored by ``"constant"``, whose decay starts at ``lr``.
    lr_warm_up_steps, lr_decay_steps: linear warm-up from ``lr / warm_up`` and linear
      decay to 0 over the last ``lr_decay_steps`` of ``steps``.
    l1_coefficient: ReLU's and gated's L1 coefficient (on decoder-norm-weighted
      activations; gated: on the gate's ReLU).
    l0_coefficient: JumpReLU's L0 coefficient.
    jumprelu_sparsity_loss_mode: JumpReLU's sparsity loss: ``"step"`` (the L0 through the
      step function's straight-through estimator, DeepMind's), ``"tanh"`` (``sum
      tanh(jumprelu_tanh_scale * acts * |W_dec row|)``, Anthropic's) or ``"quadratic"``
      (``2 / target_l0 * (L0 - target_l0)^2``, Gemma Scope 2's).
    jumprelu_tanh_scale: the tanh loss's scale.
    target_l0: the quadratic loss's target L0 (required by it, in ``(0, d_sae]``).
    pre_act_loss_coefficient: Anthropic's pre-activation loss on dead features
      (``sum relu(threshold - pre) * dead * |W_dec row|``), None for none.
    jumprelu_ste_to_input: the straight-through estimators also pass their gradient to the
      pre-activations (Anthropic's), not only to the threshold (DeepMind's).
    matryoshka_widths: Matryoshka BatchTopK's nested widths, strictly increasing (``d_sae``
      is appended when the last is smaller, as SAELens does); each width but the last adds
      an ``inner_mse_loss_{width}`` of the reconstruction from the features below it.
    use_matryoshka_aux_loss: Matryoshka's AuxK per level (each level's dead features
      reconstruct that level's residual) instead of the whole SAE's.
    normalize_activations: ``"none"`` or ``"expected_average_only_in"``: the first
      ``n_batches_for_norm_estimate`` batches estimate a factor ``sqrt(d_in) / mean |x|``,
      training runs on the scaled batches that follow, and the factor is folded into the
      trained dictionary (:func:`fold_activation_scale`), as SAELens's trainer does.
    n_batches_for_norm_estimate: batches read for that estimate.
    coefficient_warm_up_steps: linear warm-up of the L1 / L0 coefficient.
    aux_loss_coefficient: TopK / BatchTopK's AuxK coefficient.
    jumprelu_init_threshold, jumprelu_bandwidth: JumpReLU's initial threshold and STE
      bandwidth.
    topk_threshold_lr: BatchTopK's running-threshold rate.
    rescale_acts_by_decoder_norm: TopK / BatchTopK select on ``pre * |W_dec row|``.
    apply_b_dec_to_input: subtract ``b_dec`` before encoding (SAEs; never transcoders).
    decoder_init_norm: initial norm of each decoder row.
    normalize_decoder: renormalise decoder rows to unit norm after every step.
    b_dec_init: ``"mean"`` (the first batch's mean) or ``"zeros"``.
    dead_feature_window: a feature that has not fired for more than this many steps is
      dead (AuxK's mask, the dead fraction metric).
    grad_clip: global gradient-norm clip (SAELens: 1.0); None for none.
    dtype: the dictionary's dtype.
    seed: the initialisation's seed.
  """

  d_sae: int
  architecture: str = "topk"
  k: Any = None
  transcoder: bool = False
  skip: bool = False
  lr: float = 3e-4
  adam_beta1: float = 0.9
  adam_beta2: float = 0.999
  lr_scheduler: str = "constant"
  lr_end: float | None = None
  lr_warm_up_steps: int = 0
  lr_decay_steps: int = 0
  l1_coefficient: float = 1.0
  l0_coefficient: float = 1.0
  jumprelu_sparsity_loss_mode: str = "step"
  jumprelu_tanh_scale: float = 4.0
  target_l0: float | None = None
  pre_act_loss_coefficient: float | None = None
  jumprelu_ste_to_input: bool = False
  matryoshka_widths: tuple = ()
  use_matryoshka_aux_loss: bool = False
  normalize_activations: str = "none"
  n_batches_for_norm_estimate: int = 1000
  coefficient_warm_up_steps: int = 0
  aux_loss_coefficient: float = 1.0
  jumprelu_init_threshold: float = 0.01
  jumprelu_bandwidth: float = 0.05
  topk_threshold_lr: float = 0.01
  rescale_acts_by_decoder_norm: bool = False
  apply_b_dec_to_input: bool = True
  decoder_init_norm: float | None = 0.1
  normalize_decoder: bool = False
  b_dec_init: str = "mean"
  dead_feature_window: int = 1000
  grad_clip: float | None = 1.0
  dtype: Any = "float32"
  seed: int = 0

  def __post_init__(self):
    def bad(field, why, fix):
      raise SAEError(f"TrainConfig.{field}: {why}", code="sae_config_invalid", field=field, fix=fix)

    if self.architecture not in ARCHITECTURES:
      bad(
        "architecture",
        f"{self.architecture!r} is not one of {', '.join(ARCHITECTURES)}",
        'architecture="topk"',
      )
    if isinstance(self.d_sae, bool) or not isinstance(self.d_sae, int) or self.d_sae < 1:
      bad("d_sae", f"{self.d_sae!r} is not a positive int", "d_sae=4096")
    if self.architecture in _TOPK and (
      self.k is None or isinstance(self.k, bool) or not self.k > 0 or self.k > self.d_sae
    ):
      bad("k", f"{self.k!r} must be in (0, d_sae] for {self.architecture}", "k=32")
    if self.b_dec_init not in ("mean", "zeros"):
      bad("b_dec_init", f"{self.b_dec_init!r} is not 'mean' or 'zeros'", 'b_dec_init="mean"')
    if self.skip and not self.transcoder:
      bad("skip", "a skip connection is for transcoders", "transcoder=True, skip=True")
    try:
      floating = jnp.issubdtype(jnp.dtype(self.dtype), jnp.floating)
    except TypeError:
      floating = False
    if not floating:
      bad("dtype", f"{self.dtype!r} is not a float dtype", 'dtype="float32"')
    if self.lr_scheduler not in ("constant", "cosineannealing"):
      bad(
        "lr_scheduler",
        f"{self.lr_scheduler!r} is not 'constant' or 'cosineannealing'",
        'lr_scheduler="cosineannealing"',
      )
    if self.lr_end is not None and not (math.isfinite(self.lr_end) and self.lr_end >= 0):
      bad("lr_end", f"{self.lr_end!r} is not a finite number >= 0", "lr_end=lr / 10")
    lr_end = self.lr / 10 if self.lr_end is None else self.lr_end
    if self.lr_decay_steps > 0 and self.lr_scheduler != "constant" and lr_end == 0:
      bad(
        "lr_end",
        "a decay after a cosine to lr_end=0 would decay from 0 to 0 (SAELens refuses it too)",
        "lr_end > 0, or lr_decay_steps=0",
      )
    mode = self.jumprelu_sparsity_loss_mode
    if mode not in ("step", "tanh", "quadratic"):
      bad("jumprelu_sparsity_loss_mode", f"{mode!r} is not step/tanh/quadratic", '"step"')
    if self.architecture == "jumprelu" and mode == "quadratic":
      t = self.target_l0
      if t is None or isinstance(t, bool) or not (0 < t <= self.d_sae):
        bad("target_l0", f"{t!r} must be in (0, d_sae] for the quadratic L0 loss", "target_l0=32")
    scale = self.jumprelu_tanh_scale
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not 0 < scale < math.inf:
      bad("jumprelu_tanh_scale", f"{scale!r} is not a finite number > 0", "jumprelu_tanh_scale=4.0")
    pre_act = self.pre_act_loss_coefficient
    if pre_act is not None and (
      isinstance(pre_act, bool)
      or not isinstance(pre_act, (int, float))
      or not 0 <= pre_act < math.inf
    ):
      bad(
        "pre_act_loss_coefficient",
        f"{pre_act!r} is not None or a finite number >= 0",
        "pre_act_loss_coefficient=3e-6",
      )
    if self.normalize_activations not in ("none", "expected_average_only_in"):
      bad(
        "normalize_activations",
        f"{self.normalize_activations!r} is not 'none' or 'expected_average_only_in'",
        'normalize_activations="expected_average_only_in"',
      )
    n = self.n_batches_for_norm_estimate
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
      bad("n_batches_for_norm_estimate", f"{n!r} is not a positive int", "1000")
    if self.normalize_activations != "none" and self.transcoder:
      bad(
        "normalize_activations",
        "a transcoder's input and output would need two factors; scale the data instead",
        'normalize_activations="none"',
      )
    widths = tuple(self.matryoshka_widths)
    object.__setattr__(self, "matryoshka_widths", widths)  # hashable (the compile cache)
    if self.architecture == "matryoshka_batchtopk":
      if not widths or any(isinstance(w, bool) or not isinstance(w, int) for w in widths):
        bad("matryoshka_widths", f"{widths!r} is not a non-empty list of ints", "(512, 2048)")
      if any(b <= a for a, b in zip(widths, widths[1:])) or widths[0] < 1:
        bad(
          "matryoshka_widths", f"{widths!r} is not strictly increasing and positive", "(512, 2048)"
        )
      if widths[-1] > self.d_sae:
        bad("matryoshka_widths", f"{widths[-1]} is wider than d_sae={self.d_sae}", "(512, d_sae)")
      if widths[-1] != self.d_sae:
        object.__setattr__(self, "matryoshka_widths", widths + (self.d_sae,))
    if self.transcoder and self.architecture in ("gated", "matryoshka_batchtopk"):
      bad("architecture", f"{self.architecture} trains SAEs only here", 'architecture="topk"')


# --------------------------------------------------------------------------------------------
# Straight-through estimators (SAELens's JumpReLU and Step autograd functions).


def _rectangle(x):
  return ((x > -0.5) & (x < 0.5)).astype(x.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _jumprelu(x, threshold, bandwidth, ste_to_input):
  return x * (x > threshold).astype(x.dtype)


def _jumprelu_fwd(x, threshold, bandwidth, ste_to_input):
  return _jumprelu(x, threshold, bandwidth, ste_to_input), (x, threshold)


def _jumprelu_bwd(bandwidth, ste_to_input, res, g):
  x, threshold = res
  ste = (threshold / bandwidth) * _rectangle((x - threshold) / bandwidth) * g
  dthreshold = -ste.reshape(-1, x.shape[-1]).sum(0)
  dx = (x > threshold).astype(x.dtype) * g
  if ste_to_input:
    dx = dx + ste
  return dx, dthreshold.astype(threshold.dtype)


_jumprelu.defvjp(_jumprelu_fwd, _jumprelu_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _step(x, threshold, bandwidth, ste_to_input):
  return (x > threshold).astype(x.dtype)


def _step_fwd(x, threshold, bandwidth, ste_to_input):
  return _step(x, threshold, bandwidth, ste_to_input), (x, threshold)


def _step_bwd(bandwidth, ste_to_input, res, g):
  x, threshold = res
  ste = (1.0 / bandwidth) * _rectangle((x - threshold) / bandwidth) * g
  dthreshold = -ste.reshape(-1, x.shape[-1]).sum(0)
  # The step depends on x only through x - threshold: x's estimate is the threshold's negated.
  dx = ste if ste_to_input else jnp.zeros_like(x)
  return dx, dthreshold.astype(threshold.dtype)


_step.defvjp(_step_fwd, _step_bwd)


def jumprelu(x, threshold, bandwidth: float, ste_to_input: bool = False):
  """``x * (x > threshold)``, with the straight-through gradient for ``threshold`` (and with
  ``ste_to_input`` for ``x`` too, Anthropic's variant)."""
  return _jumprelu(x, threshold, float(bandwidth), bool(ste_to_input))


def step_function(x, threshold, bandwidth: float, ste_to_input: bool = False):
  """``(x > threshold)``, with the straight-through gradient for ``threshold`` (the L0; with
  ``ste_to_input`` for ``x`` too)."""
  return _step(x, threshold, float(bandwidth), bool(ste_to_input))


# --------------------------------------------------------------------------------------------
# The loss.


# TopK's sparse products. A TopK row has k active features out of d_sae: the decoder reads
# k of its rows, and the gradients of W_enc and W_dec touch only the active columns / rows.
# XLA's CPU gather and scatter-add are many times slower on one (rows * k)-row operand than
# on k operands of `rows` rows each (at 1024 rows, k 32, d 256: a gather 24 ms against 1 ms,
# a scatter-add 27 ms against 4 ms, where a dense one-hot (rows, d_sae) product costs 20 ms),
# so the row reads and the weight gradients loop over the k slots.


def _rows_dot(coef, index, table):
  """``sum_s coef[:, s, None] * table[index[:, s]]``: ``(rows, k) x (n, d) -> (rows, d)``."""

  def body(s, acc):
    rows = table.at[index[:, s]].get(mode="promise_in_bounds")
    return acc + coef[:, s, None] * rows

  init = jnp.zeros((index.shape[0], table.shape[-1]), table.dtype)
  return jax.lax.fori_loop(0, index.shape[1], body, init, unroll=min(index.shape[1], 8))


def _rows_inner(vectors, index, table):
  """``(vectors[:, None, :] * table[index]).sum(-1)``: ``(rows, d), (rows, k) -> (rows, k)``."""

  def body(s, acc):
    rows = table.at[index[:, s]].get(mode="promise_in_bounds")
    return acc.at[s].set(jnp.sum(vectors * rows, -1))

  init = jnp.zeros(index.shape[::-1], table.dtype)
  return jax.lax.fori_loop(0, index.shape[1], body, init, unroll=min(index.shape[1], 8)).T


def _outer_rows(coef, index, vectors, n, transpose=False):
  """``out[j] = sum_{index[b, s] = j} coef[b, s] * vectors[b]``: ``(n, d)``, or ``(d, n)``
  with ``transpose`` (the encoder's layout): one scatter-add of ``rows`` rows per slot."""

  def body(s, acc):
    upd = coef[:, s, None] * vectors
    return acc.at[index[:, s]].add(upd, mode="promise_in_bounds")

  init = jnp.zeros((n, vectors.shape[-1]), vectors.dtype)
  out = jax.lax.fori_loop(0, index.shape[1], body, init, unroll=min(index.shape[1], 8))
  return out.T if transpose else out


@jax.custom_vjp
def _sparse_decode_raw(values, index, W_dec):
  return _rows_dot(values, index, W_dec)


def _sparse_decode_fwd(values, index, W_dec):
  return _rows_dot(values, index, W_dec), (values, index, W_dec)


def _sparse_decode_bwd(res, g):
  values, index, W_dec = res
  d_values = _rows_inner(g, index, W_dec)
  d_W_dec = _outer_rows(values, index, g, W_dec.shape[0])
  return d_values, None, d_W_dec


_sparse_decode_raw.defvjp(_sparse_decode_fwd, _sparse_decode_bwd)


@jax.custom_vjp
def _pick(x, shift, W_enc, b_enc, index, value):
  """``value``, which is ``pre[b, index[b, s]]`` with ``pre = (x - shift) @ W_enc + b_enc``
  (computed once, without gradient), differentiable in ``x``, ``shift``, ``W_enc`` and
  ``b_enc`` through the ``k`` picked columns only."""
  return value


def _pick_fwd(x, shift, W_enc, b_enc, index, value):
  return value, (x, shift, W_enc, index)


def _pick_bwd(res, g):
  x, shift, W_enc, index = res
  n = W_enc.shape[1]
  d_b_enc = jnp.zeros((n,), g.dtype).at[index.reshape(-1)].add(g.reshape(-1))
  d_W_enc = _outer_rows(g, index, x - shift, n, transpose=True)
  d_x = _rows_dot(g, index, W_enc.T)  # dead code in training: x is data
  d_shift = -(W_enc @ d_b_enc)
  return d_x, d_shift, d_W_enc, d_b_enc, None, None


_pick.defvjp(_pick_fwd, _pick_bwd)


def _sparse_decode(values, index, W_dec, norm=None):
  """``sum_j values[..., j] * W_dec[index[..., j]]`` (divided by the row norms when given): a
  TopK decode that reads only the ``k`` active rows, and whose gradient writes only them."""
  if norm is not None:
    values = values / norm.at[index].get(mode="promise_in_bounds")
  return _sparse_decode_raw(values, index, W_dec)


def _topk_aux(d, cfg, x, out, pre, dead, pick):
  """SAELens's TopK auxiliary loss: the top dead pre-activations reconstruct the residual.
  ``pre`` is the (rescaled) pre-activation without gradient; ``pick(index)`` its entries at
  ``index`` with their gradient."""
  num_dead = dead.sum()
  k_aux = min(x.shape[-1] // 2, d.d_sae)
  norm = jnp.linalg.norm(d.W_dec, axis=-1) if cfg.rescale_acts_by_decoder_norm else None

  def aux():
    scale = jnp.minimum(num_dead / (x.shape[-1] // 2), 1.0).astype(x.dtype)
    # The top min(k_aux, num_dead) dead pre-activations (raw, not through ReLU, as SAELens):
    # past the dead ones top_k returns -inf entries, which count as zero.
    top, index = jax.lax.top_k(jnp.where(dead, pre, -jnp.inf), k_aux)
    values = jnp.where(jnp.isfinite(top), pick(index), jnp.zeros((), top.dtype))
    recons = _sparse_decode(values, index, d.W_dec, norm)
    residual = jax.lax.stop_gradient(x - out)
    loss = jnp.mean(jnp.sum((recons - residual) ** 2, axis=-1))
    return (cfg.aux_loss_coefficient * scale * loss).astype(x.dtype)

  # Without dead features the term is zero and its gather is skipped.
  return jax.lax.cond(num_dead > 0, aux, lambda: jnp.zeros((), x.dtype))


def forward(d: SAE, cfg: TrainConfig, x):
  """The training forward: ``(acts, hidden_pre, x_hat)`` (SAELens's ``hidden_pre`` is the
  pre-activation after the decoder-norm rescaling of TopK)."""
  acts, pre, out, _, _ = _forward(d, cfg, x)
  return acts, pre, out


def _forward(d: SAE, cfg: TrainConfig, x):
  """:func:`forward`, and for TopK ``active``, the ``(rows, k)`` activations and their
  feature indices, and ``pick(index)``: the (rescaled) pre-activations at
  ``index`` with their gradient (``pre`` itself carries none for TopK: its gradient would be
  a dense ``(rows, d_sae)`` product where only ``k`` columns per row are nonzero)."""
  sae_in = x.astype(d.dtype)
  norm = jnp.linalg.norm(d.W_dec, axis=-1)
  rescale = cfg.architecture in _TOPK and cfg.rescale_acts_by_decoder_norm
  pick = active = None
  if cfg.architecture == "topk":
    shift = d.b_dec if d.apply_b_dec_to_input else jnp.zeros_like(d.b_dec)
    lead = sae_in.shape[:-1]
    flat = sae_in.reshape(-1, sae_in.shape[-1])
    # One product gives the rescaled pre-activation: (x - shift) @ W + b is x @ W + (b -
    # shift @ W), the norm scales W's columns, and the bias rides on a column of ones (no
    # pass over the (rows, d_sae) result but top_k's).
    scale = jax.lax.stop_gradient(norm) if rescale else jnp.ones_like(norm)
    W = jax.lax.stop_gradient(d.W_enc) * scale
    b = jax.lax.stop_gradient(d.b_enc - shift @ d.W_enc) * scale
    ones = jnp.ones((flat.shape[0], 1), flat.dtype)
    pre = jnp.concatenate([flat, ones], -1) @ jnp.concatenate([W, b[None]], 0)

    def pick(index):
      at = scale.at[index].get(mode="promise_in_bounds")
      raw = jax.lax.stop_gradient(jnp.take_along_axis(pre, index, axis=-1) / at)
      values = _pick(flat, shift, d.W_enc, d.b_enc, index, raw)
      return values * norm.at[index].get(mode="promise_in_bounds") if rescale else values

    # The loss decodes the k active features (k rows of W_dec, and its gradient writes only
    # them); the dense activations carry no gradient (the training step counts firing
    # features from the k values and indices).
    _, index = jax.lax.top_k(pre, int(cfg.k))
    values = jax.nn.relu(pick(index))
    out = _sparse_decode(values, index, d.W_dec, norm if rescale else None) + d.b_dec
    acts = jnp.zeros_like(pre).at[jnp.arange(pre.shape[0])[:, None], index].set(values)
    acts = jax.lax.stop_gradient(acts)
    pre, acts, out = (a.reshape(*lead, a.shape[-1]) for a in (pre, acts, out))
    pick_lead = pick
    pick = lambda index: pick_lead(index.reshape(-1, index.shape[-1]))  # noqa: E731
    active = (jax.lax.stop_gradient(values), index)
  else:
    if d.apply_b_dec_to_input:
      sae_in = sae_in - d.b_dec
    if cfg.architecture == "gated":
      # The gate's pre-activation (b_enc is SAELens's b_gate) picks the features, without
      # gradient; the magnitude path shares W_enc, rescaled by exp(r_mag).
      gate = (sae_in @ d.W_enc + d.b_enc > 0).astype(sae_in.dtype)
      pre = sae_in @ (d.W_enc * jnp.exp(d.r_mag)) + d.b_mag
    else:
      pre = sae_in @ d.W_enc + d.b_enc
    if rescale:
      pre = pre * norm
    if cfg.architecture == "relu":
      acts = jax.nn.relu(pre)
    elif cfg.architecture == "gated":
      acts = jax.lax.stop_gradient(gate) * jax.nn.relu(pre)
    elif cfg.architecture == "jumprelu":
      threshold = d.threshold.astype(pre.dtype)
      acts = jumprelu(pre, threshold, cfg.jumprelu_bandwidth, cfg.jumprelu_ste_to_input)
    else:
      acts = batch_topk_relu(pre, cfg.k)
    out = (acts / norm if rescale else acts) @ d.W_dec + d.b_dec
  if isinstance(d, Transcoder) and d.W_skip is not None:
    out = out + x.astype(d.dtype) @ d.W_skip.T
  return acts, pre, out, pick, active


def loss_terms(d: SAE, cfg: TrainConfig, x, *, target=None, dead=None, coefficient=None):
  """The loss and its terms for one batch: ``(total, {name: value}, (acts, pre, x_hat))``.

  Args:
    d: the dictionary being trained.
    cfg: the training configuration.
    x: ``(rows, d_in)`` activations.
    target: what to reconstruct (a transcoder's output site; default ``x``).
    dead: ``(d_sae,)`` bool, the dead features (TopK's AuxK); default none dead.
    coefficient: the sparsity coefficient now (default the configured one).

  The terms are named as in SAELens: ``mse_loss``, ``l1_loss`` (relu), ``l0_loss``
  (jumprelu), ``auxiliary_reconstruction_loss`` (topk, batchtopk).
  """
  total, terms, aux, _ = _loss_terms(d, cfg, x, target=target, dead=dead, coefficient=coefficient)
  return total, terms, aux


def _loss_terms(d, cfg, x, *, target, dead, coefficient):
  """:func:`loss_terms`, and TopK's ``(values, index)`` (None otherwise)."""
  target = x if target is None else target
  target = target.astype(d.dtype)
  acts, pre, out, pick, active = _forward(d, cfg, x)
  mse = jnp.mean(jnp.sum((out - target) ** 2, axis=-1))
  terms = {"mse_loss": mse}
  if dead is None:
    dead = jnp.zeros((d.d_sae,), bool)
  norm = jnp.linalg.norm(d.W_dec, axis=-1)
  if cfg.architecture == "relu":
    c = cfg.l1_coefficient if coefficient is None else coefficient
    terms["l1_loss"] = jnp.mean(c * jnp.sum(jnp.abs(acts * norm), axis=-1))
  elif cfg.architecture == "gated":
    # SAELens's gated losses: an L1 on the gate's ReLU (weighted by the decoder norms), and
    # the reconstruction from the gate's ReLU alone.
    c = cfg.l1_coefficient if coefficient is None else coefficient
    sae_in = x.astype(d.dtype) - (d.b_dec if d.apply_b_dec_to_input else 0)
    via_gate = jax.nn.relu(sae_in @ d.W_enc + d.b_enc)
    terms["l1_loss"] = c * jnp.mean(jnp.sum(via_gate * norm, axis=-1))
    recon = via_gate @ d.W_dec + d.b_dec
    terms["auxiliary_reconstruction_loss"] = jnp.mean(jnp.sum((recon - target) ** 2, axis=-1))
  elif cfg.architecture == "jumprelu":
    terms.update(_jumprelu_losses(d, cfg, acts, pre, norm, dead, coefficient))
  else:
    if pick is None:  # BatchTopK: pre carries its gradient
      pick = functools.partial(jnp.take_along_axis, pre, axis=-1)
    if cfg.architecture == "matryoshka_batchtopk":
      inner, partial = _matryoshka_decodes(d, cfg, acts, norm)
      if cfg.use_matryoshka_aux_loss:
        aux = _matryoshka_aux(d, cfg, target, partial, pre, dead, norm)
      else:
        aux = _topk_aux(d, cfg, target, out, pre, dead, pick)
      terms["auxiliary_reconstruction_loss"] = aux
      for width, decoded in zip(cfg.matryoshka_widths[:-1], inner):
        terms[f"inner_mse_loss_{width}"] = jnp.mean(jnp.sum((decoded - target) ** 2, axis=-1))
    else:
      terms["auxiliary_reconstruction_loss"] = _topk_aux(d, cfg, target, out, pre, dead, pick)
  total = sum(terms.values())
  return total, terms, (acts, pre, out), active


def _jumprelu_losses(d, cfg, acts, pre, norm, dead, coefficient):
  """JumpReLU's sparsity loss (``l0_loss``, in ``jumprelu_sparsity_loss_mode``) and, with a
  ``pre_act_loss_coefficient``, Anthropic's ``pre_act_loss`` on the dead features."""
  c = cfg.l0_coefficient if coefficient is None else coefficient
  threshold = d.threshold.astype(pre.dtype)
  mode = cfg.jumprelu_sparsity_loss_mode
  if mode == "tanh":
    per_row = jnp.sum(jnp.tanh(cfg.jumprelu_tanh_scale * acts * norm), axis=-1)
  else:
    l0 = jnp.sum(
      step_function(pre, threshold, cfg.jumprelu_bandwidth, cfg.jumprelu_ste_to_input), -1
    )
    if mode == "quadratic":
      per_row = 2 / cfg.target_l0 * (l0 - cfg.target_l0) ** 2
    else:
      per_row = l0
  terms = {"l0_loss": jnp.mean(c * per_row)}
  if cfg.pre_act_loss_coefficient is not None:
    gap = jax.nn.relu(threshold - pre) * dead.astype(pre.dtype) * norm
    terms["pre_act_loss"] = cfg.pre_act_loss_coefficient * jnp.mean(jnp.sum(gap, axis=-1))
  return terms


def _matryoshka_decodes(d, cfg, acts, norm):
  """The nested reconstructions: for each width, ``b_dec`` plus the decode of the features
  below it (``(inner ones, all)``; the last of all is the SAE's own output)."""
  if cfg.rescale_acts_by_decoder_norm:
    acts = acts * (1 / norm)
  decoded, prev, out = d.b_dec, 0, []
  for width in cfg.matryoshka_widths:
    decoded = acts[..., prev:width] @ d.W_dec[prev:width] + decoded
    out.append(decoded)
    prev = width
  return out[:-1], out


def _matryoshka_aux(d, cfg, x, partial, pre, dead, norm):
  """Matryoshka's per-level AuxK: each level's top dead pre-activations reconstruct the
  residual of the reconstruction up to that level, scaled down while fewer than ``d_in // 2``
  of its features are dead; levels without dead features add nothing."""
  half = x.shape[-1] // 2
  W = d.W_dec / norm[:, None] if cfg.rescale_acts_by_decoder_norm else d.W_dec
  total = jnp.zeros((), x.dtype)
  prev = 0
  for width, decoded in zip(cfg.matryoshka_widths, partial):
    n_dead = dead[prev:width].sum()
    scale = jnp.minimum(n_dead / max(half, 1), 1.0).astype(x.dtype)
    level = pre[..., prev:width]
    # As in _topk_aux: past the level's dead features top_k returns -inf entries (zeros).
    top, index = jax.lax.top_k(
      jnp.where(dead[prev:width], level, -jnp.inf), min(half, width - prev)
    )
    values = jnp.where(jnp.isfinite(top), jnp.take_along_axis(level, index, -1), 0)
    aux_acts = jnp.put_along_axis(jnp.zeros_like(level), index, values, axis=-1, inplace=False)
    residual = jax.lax.stop_gradient(x - decoded)
    loss = jnp.mean(jnp.sum((aux_acts @ W[prev:width] - residual) ** 2, axis=-1))
    total = total + jnp.where(n_dead > 0, scale * loss, 0)
    prev = width
  return (cfg.aux_loss_coefficient * total).astype(x.dtype)


def explained_variance(x, x_hat):
  """``1 - sum((x - x_hat)^2) / sum((x - mean(x))^2)`` over the rows (one number)."""
  x = jnp.asarray(x, jnp.float32)
  resid = jnp.sum((x - jnp.asarray(x_hat, jnp.float32)) ** 2)
  total = jnp.sum((x - x.mean(0)) ** 2)
  return 1.0 - resid / total


# --------------------------------------------------------------------------------------------
# State and one step.


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class State:
  """What changes from step to step (a pytree, checkpointed whole)."""

  sae: Any
  opt_state: Any
  step: Any  # int32 scalar
  since_fired: Any  # (d_sae,) int32: steps since each feature last fired
  topk_threshold: Any  # float32 scalar: BatchTopK's running threshold


def schedule(cfg: TrainConfig, steps: int):
  """The learning rate at each step as an optax schedule: SAELens's ``get_lr_scheduler``
  (a linear warm-up from ``lr / lr_warm_up_steps`` to ``lr`` over ``lr_warm_up_steps``;
  then ``lr``, or a cosine from ``lr`` to ``lr_end``; then a linear decay to 0 over the last
  ``lr_decay_steps``, from ``lr_end``, or from ``lr`` after a constant)."""
  optax = require("optax", feature="jaxlens.sae.train", extra="sae")
  warm, decay = cfg.lr_warm_up_steps, cfg.lr_decay_steps
  cosine = cfg.lr_scheduler == "cosineannealing"
  lr_end = (cfg.lr / 10 if cfg.lr_end is None else cfg.lr_end) if cosine else cfg.lr
  parts, bounds = [], []
  if warm > 0:
    parts.append(optax.linear_schedule(cfg.lr / warm, cfg.lr, max(warm - 1, 1)))
    bounds.append(warm)
  if cosine:
    main = max(steps - warm - decay, 1)
    parts.append(optax.cosine_decay_schedule(cfg.lr, main, alpha=lr_end / cfg.lr))
  else:
    parts.append(optax.constant_schedule(cfg.lr))
  if decay > 0:
    parts.append(optax.linear_schedule(lr_end, 0.0, decay))
    bounds.append(max(steps - decay, bounds[-1] if bounds else 0))
  return optax.join_schedules(parts, bounds) if bounds else parts[0]


_schedule = schedule


def optimizer(cfg: TrainConfig, steps: int):
  """The optax transformation :func:`train` uses: clipping, then Adam on the schedule."""
  optax = require("optax", feature="jaxlens.sae.train", extra="sae")
  adam = optax.adam(_schedule(cfg, steps), b1=cfg.adam_beta1, b2=cfg.adam_beta2)
  if cfg.grad_clip is None:
    return adam
  return optax.chain(_clip_by_global_norm(cfg.grad_clip), adam)


def _clip_by_global_norm(max_norm: float):
  """torch's ``clip_grad_norm_`` (SAELens's trainer): gradients times
  ``min(1, max_norm / (norm + 1e-6))`` (optax's clip has no 1e-6)."""
  optax = require("optax", feature="jaxlens.sae.train", extra="sae")

  def update(updates, state, params=None):
    del params
    norm = optax.global_norm(updates)
    coef = jnp.minimum(max_norm / (norm + 1e-6), 1.0)
    return jax.tree.map(lambda g: g * coef.astype(g.dtype), updates), state

  return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


@functools.lru_cache(maxsize=16)
def _compiled(cfg: TrainConfig, steps: int, skip: bool = False):
  """The jitted initial state and the jitted step for one configuration (a second
  :func:`train` call with the same configuration and shapes reuses both programs)."""
  tx = optimizer(cfg, steps)
  return jax.jit(make_init(cfg, tx)), jax.jit(make_step(cfg, tx, skip))


@functools.lru_cache(maxsize=16)
def _compiled_on(cfg: TrainConfig, steps: int, skip: bool, mesh):
  """:func:`_compiled` for data parallel training over ``mesh`` (its outputs replicated): a
  second :func:`train` call on the same mesh reuses both programs too."""
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  tx = optimizer(cfg, steps)
  replicated = NamedSharding(mesh, P())
  return (
    jax.jit(make_init(cfg, tx), out_shardings=replicated),
    jax.jit(make_step(cfg, tx, skip), out_shardings=(replicated, replicated)),
  )


def make_init(cfg: TrainConfig, tx):
  """``(key, first_x, first_y, init) -> State`` (not jitted): the dictionary (``init``, or
  :func:`init_dictionary`'s), its optimizer state and the counters. Jitted, it is one
  compilation instead of one per array operation."""

  def init_fn(key, first_x, first_y, init):
    d = init if init is not None else init_dictionary(key, cfg, first_x, first_y)
    with jax.numpy_dtype_promotion("standard"):
      opt_state = tx.init(d)
    return State(
      d,
      opt_state,
      jnp.asarray(0, jnp.int32),
      jnp.zeros((d.d_sae,), jnp.int32),
      # BatchTopK's running threshold, at least float32 (SAELens keeps it in float64).
      jnp.asarray(0.0, jnp.float64 if d.dtype == jnp.float64 else jnp.float32),
    )

  return init_fn


def _coefficient(cfg: TrainConfig, step, dtype=jnp.float32):
  """The sparsity coefficient at ``step``, in ``dtype`` (at least float32)."""
  dtype = jnp.float64 if jnp.dtype(dtype) == jnp.float64 else jnp.float32
  base = cfg.l1_coefficient if cfg.architecture in ("relu", "gated") else cfg.l0_coefficient
  if cfg.coefficient_warm_up_steps <= 0:
    return jnp.asarray(base, dtype)
  return base * jnp.minimum(step.astype(dtype) / cfg.coefficient_warm_up_steps, 1.0)


def _normalise_rows(w):
  return w / jnp.linalg.norm(w, axis=-1, keepdims=True)


def _finite_tree(tree):
  leaves = [jnp.all(jnp.isfinite(a)) for a in jax.tree.leaves(tree)]
  return jnp.all(jnp.stack(leaves)) if leaves else jnp.asarray(True)


def _not_finite(batch_finite: bool, index: int, step: int) -> SAEError:
  """The error for a step whose loss or gradient is not finite (no checkpoint holds it)."""
  if not batch_finite:
    return SAEError(
      f"batch {index} (step {step}) holds NaN or infinite values: training stopped (the "
      "checkpoints hold only steps before it)",
      code="batch_not_finite",
      field="data",
      fix="drop or repair that batch",
      batch=index,
      step=step,
    )
  return SAEError(
    f"the loss or its gradient is NaN or infinite at step {step} (batch {index}, whose values "
    "are finite): training diverged and stopped (the checkpoints hold only steps before it)",
    code="loss_not_finite",
    field="data",
    fix="a smaller lr, or grad_clip",
    batch=index,
    step=step,
  )


def make_step(cfg: TrainConfig, tx, skip: bool = False):
  """The train step ``(state, x, target) -> (state, metrics)`` (not jitted). With ``skip``,
  a step whose loss or gradient is not finite changes nothing but the step count."""
  optax = require("optax", feature="jaxlens.sae.train", extra="sae")

  def step_fn(state: State, x, target):
    d = state.sae
    if cfg.architecture == "jumprelu":
      d = d.replace(threshold=jnp.maximum(d.threshold, 0.0))
    dead = state.since_fired > cfg.dead_feature_window
    coefficient = _coefficient(cfg, state.step, d.dtype).astype(d.dtype)

    def loss_fn(d):
      total, terms, aux, active = _loss_terms(
        d, cfg, x, target=target, dead=dead, coefficient=coefficient
      )
      return total, (terms, aux, active)

    (total, (terms, (acts, pre, out), active)), grads = jax.value_and_grad(loss_fn, has_aux=True)(d)
    # optax's Adam mixes its int32 step count with floats (bias correction), which strict
    # dtype promotion refuses: the update is traced under standard promotion.
    with jax.numpy_dtype_promotion("standard"):
      updates, opt_state = tx.update(grads, state.opt_state, d)
      new = optax.apply_updates(d, updates)
    if cfg.normalize_decoder:
      new = new.replace(W_dec=_normalise_rows(new.W_dec))
    if active is None:
      fired = (acts != 0).reshape(-1, acts.shape[-1]).any(0)
      l0 = jnp.mean(jnp.sum(acts != 0, axis=-1).astype(jnp.float32))
    else:  # TopK: from the k values per row, not the dense activations
      values, index = active
      fired = jnp.zeros((d.d_sae,), bool).at[index.reshape(-1)].max(values.reshape(-1) != 0)
      l0 = jnp.mean(jnp.sum(values != 0, axis=-1).astype(jnp.float32))
    since = jnp.where(fired, 0, state.since_fired + 1)
    threshold = state.topk_threshold
    if cfg.architecture in _BATCH:
      positive = acts > 0
      smallest = jnp.min(jnp.where(positive, acts, jnp.inf)).astype(threshold.dtype)
      threshold = jnp.where(
        positive.any(),
        (1 - cfg.topk_threshold_lr) * threshold + cfg.topk_threshold_lr * smallest,
        threshold,
      )
    tgt = x if target is None else target
    metrics = {
      "loss": total,
      **terms,
      "explained_variance": explained_variance(tgt, out),
      "l0": l0,
      "dead_fraction": jnp.mean(dead.astype(jnp.float32)),
      # Read by train's _flush (not metrics): whether the step's loss and gradient, and the
      # batch, were finite.
      "_finite": jnp.isfinite(total) & _finite_tree(grads),
      "_batch_finite": _finite_tree((x, target)),
    }
    after = State(new, opt_state, state.step + 1, since, threshold)
    if skip:
      kept = dataclasses.replace(state, step=state.step + 1)
      after = jax.tree.map(lambda a, b: jnp.where(metrics["_finite"], a, b), after, kept)
    return after, metrics

  return step_fn


# --------------------------------------------------------------------------------------------
# Initialisation, checkpoints and the loop.


def init_dictionary(key, cfg: TrainConfig, first_x, first_y=None):
  """A dictionary to train: SAELens's initialisation, ``b_dec`` from the data."""
  d_in = int(first_x.shape[-1])
  dtype = jnp.dtype(cfg.dtype)
  activation = {"matryoshka_batchtopk": "batchtopk"}.get(cfg.architecture, cfg.architecture)
  common = dict(dtype=dtype, decoder_init_norm=cfg.decoder_init_norm)
  if cfg.transcoder:
    d_out = int(first_y.shape[-1])
    d = Transcoder.init(
      key,
      d_in,
      cfg.d_sae,
      activation=activation,
      k=cfg.k,
      d_out=d_out,
      skip=cfg.skip,
      threshold=cfg.jumprelu_init_threshold,
      **common,
    )
    data_for_bias = first_y
  else:
    d = SAE.init(
      key,
      d_in,
      cfg.d_sae,
      activation=activation,
      k=cfg.k,
      threshold=cfg.jumprelu_init_threshold,
      apply_b_dec_to_input=cfg.apply_b_dec_to_input,
      rescale_acts_by_decoder_norm=cfg.rescale_acts_by_decoder_norm and cfg.architecture in _TOPK,
      **common,
    )
    data_for_bias = first_x
  if cfg.b_dec_init == "mean":
    data = jnp.asarray(data_for_bias)
    # At least float32 (a bfloat16 batch's mean in bfloat16 loses digits), float64 kept.
    wide = jnp.float64 if data.dtype == jnp.float64 else jnp.float32
    mean = data.reshape(-1, d.d_out).astype(wide).mean(0)
    d = d.replace(b_dec=mean.astype(dtype))
  return d


@dataclasses.dataclass(frozen=True)
class Trained:
  """What :func:`train` returns.

  Attributes:
    sae: the trained dictionary (the training form: a BatchTopK SAE is still BatchTopK).
    state: the final :class:`State` (optimizer state, counters).
    metrics: ``{name: np.ndarray over logged steps}`` and ``"step"``.
    config: the :class:`TrainConfig`.
    skipped: with ``nonfinite="skip"``, the skipped steps (resumed runs' included), each
      ``{"batch": i, "step": s, "code": "batch_not_finite" | "loss_not_finite"}``.
  """

  sae: Any
  state: State
  metrics: dict
  config: TrainConfig
  scaling_factor: float | None = None
  skipped: list = dataclasses.field(default_factory=list)

  def inference(self):
    """The dictionary for inference: a (Matryoshka) BatchTopK SAE becomes the JumpReLU one
    with its running threshold (decoder norms folded in, as SAELens saves it); others as
    trained."""
    d = self.sae
    if self.config.architecture not in _BATCH:
      return d
    threshold = self.state.topk_threshold
    if self.scaling_factor is not None and self.config.rescale_acts_by_decoder_norm:
      # The threshold is in units of pre * |W_dec row|, and the fold divided W_dec.
      threshold = threshold / self.scaling_factor
    return d.to_jumprelu(threshold)

  @property
  def dead_fraction(self) -> float:
    dead = np.asarray(self.state.since_fired) > self.config.dead_feature_window
    return float(dead.mean())


def _checkpoints(directory, every: int):
  return Checkpoints(directory, every, feature="jaxlens.sae.train checkpoints", extra="sae")


def _restore(ckpt, state: State, directory):
  """``(state, batches consumed, metric history)`` from the latest checkpoint, or None."""
  meta = ckpt.restore_meta()
  if meta is None:
    return None
  if meta["signature"] != signature(state):
    raise SAEError(
      f"the checkpoint in {directory} is of another configuration (its state has another "
      "structure, shape or dtype)",
      code="sae_checkpoint_mismatch",
      field="checkpoint_dir",
      fix="a new checkpoint_dir, or the TrainConfig the checkpoint was written with",
    )
  skipped = list(meta.get("skipped", []))
  return ckpt.restore(state, meta), meta["consumed"], meta["metrics"], skipped


def _save(ckpt, state: State, consumed: int, metrics: dict, skipped: list):
  meta = {
    "consumed": consumed,
    "metrics": {k: [float(v) for v in vs] for k, vs in metrics.items()},
    "skipped": skipped,
  }
  ckpt.save(int(state.step), state, meta, force=True)


def _split_batch(batch, transcoder: bool):
  if transcoder:
    if isinstance(batch, dict) and len(batch) == 2:
      x, y = list(batch.values())
    elif isinstance(batch, (tuple, list)) and len(batch) == 2:
      x, y = batch
    else:
      raise SAEError(
        f"a transcoder trains on (x, y) pairs, got a {type(batch).__name__}",
        code="sae_batch_invalid",
        field="data",
        fix="store.batches([in_site, out_site], ...) or an iterator of (x, y)",
      )
    return x, y
  if isinstance(batch, (tuple, list, dict)):
    raise SAEError(
      f"an SAE trains on arrays of (rows, d_in), got a {type(batch).__name__}",
      code="sae_batch_invalid",
      field="data",
      fix="store.batches(site, batch_size=4096, flatten=True)",
    )
  return batch, None


def _rows(a, index: int, features=None):
  """Batch ``index`` as ``(rows, d)``, refused unless a non-empty float array (with the
  first batch's feature size ``features``)."""
  try:
    a = jnp.asarray(a)
  except (TypeError, ValueError) as error:
    raise SAEError(
      f"batch {index} is not an array ({type(error).__name__}: {error})",
      code="sae_batch_invalid",
      field="data",
      fix="batches of (rows, d_in) float arrays",
    ) from None
  if a.ndim < 1 or a.size == 0 or not jnp.issubdtype(a.dtype, jnp.floating):
    raise SAEError(
      f"batch {index} must be a non-empty float array of (rows, d_in), got "
      f"{a.dtype}{list(a.shape)}",
      code="sae_batch_invalid",
      field="data",
      fix="batches of (rows, d_in) float arrays",
    )
  a = a.reshape(-1, a.shape[-1])
  if features is not None and a.shape[1:] != features:
    raise SAEError(
      f"batch {index} has {a.shape[-1]} features, the first batch {features[0]}",
      code="sae_batch_invalid",
      field="data",
      fix="batches of one site (one feature size)",
    )
  return a


def _check_init(init, config: TrainConfig, fx, fy):
  """``init`` is a dictionary of the configuration's kind and size that fits the data."""
  kind = Transcoder if config.transcoder else SAE
  if not isinstance(init, SAE) or isinstance(init, Transcoder) != config.transcoder:
    raise SAEError(
      f"init must be a {kind.__name__} (config.transcoder={config.transcoder}), got "
      f"{type(init).__name__}",
      code="sae_config_invalid",
      field="init",
      fix=f"init={kind.__name__}(...) or None",
    )
  if init.d_sae != config.d_sae:
    raise SAEError(
      f"init has {init.d_sae} features, the config's d_sae {config.d_sae}",
      code="sae_config_invalid",
      field="init",
      fix=f"TrainConfig(d_sae={init.d_sae}, ...)",
    )
  dtypes = sorted({str(jnp.asarray(leaf).dtype) for leaf in (init.W_enc, init.W_dec)})
  if dtypes != [str(jnp.dtype(config.dtype))]:
    # Training would silently run in the init's dtype, not the configuration's.
    raise SAEError(
      f"init's weights are {', '.join(dtypes)}, the config's dtype {jnp.dtype(config.dtype)}",
      code="sae_config_invalid",
      field="init",
      fix=f'TrainConfig(dtype="{dtypes[0]}", ...) or an init of dtype {jnp.dtype(config.dtype)}',
    )
  want = [("d_in", init.d_in, fx.shape[-1])]
  if fy is not None:
    want.append(("d_out", init.d_out, fy.shape[-1]))
  for name, have, data in want:
    if have != data:
      raise SAEError(
        f"init's {name} is {have}, the data's {data} features",
        code="sae_shape_mismatch",
        field="init",
        fix=f"a dictionary of {name}={data}",
      )


def _check_numbers(config: TrainConfig) -> None:
  """The numeric fields of ``config`` that a run reads: finite, and in their range (a NaN
  learning rate or coefficient made NaN weights with finite losses and gradients)."""

  def bad(field, value, why, fix):
    raise SAEError(
      f"TrainConfig.{field}: {value!r} {why}", code="sae_config_invalid", field=field, fix=fix
    )

  def number(value):
    return isinstance(value, (int, float, np.number)) and not isinstance(value, bool)

  for field, low, open_low, high, fix in (
    ("lr", 0.0, True, None, "lr=3e-4"),
    ("adam_beta1", 0.0, False, 1.0, "adam_beta1=0.9"),
    ("adam_beta2", 0.0, False, 1.0, "adam_beta2=0.999"),
    ("l1_coefficient", 0.0, False, None, "l1_coefficient=1.0"),
    ("l0_coefficient", 0.0, False, None, "l0_coefficient=1.0"),
    ("aux_loss_coefficient", 0.0, False, None, "aux_loss_coefficient=1.0"),
    ("jumprelu_bandwidth", 0.0, True, None, "jumprelu_bandwidth=0.05"),
    ("jumprelu_init_threshold", 0.0, False, None, "jumprelu_init_threshold=0.01"),
    ("topk_threshold_lr", 0.0, False, 1.0, "topk_threshold_lr=0.01"),
  ):
    value = getattr(config, field, 0.5)
    if not number(value) or not math.isfinite(value):
      bad(field, value, "is not a finite number", fix)
    if value < low or (open_low and value == low) or (high is not None and value >= high):
      where = f"{'(' if open_low else '['}{low}, {high if high is not None else 'inf'})"
      bad(field, value, f"is outside {where}", fix)
  if config.grad_clip is not None and not (
    number(config.grad_clip) and math.isfinite(config.grad_clip) and config.grad_clip > 0
  ):
    bad("grad_clip", config.grad_clip, "is not None or a finite number > 0", "grad_clip=1.0")
  for field in (
    "dead_feature_window",
    "lr_warm_up_steps",
    "lr_decay_steps",
    "coefficient_warm_up_steps",
  ):
    value = getattr(config, field, 0)
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
      bad(field, value, "is not an int >= 0", f"{field}=0")
  seed = config.seed
  if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or not 0 <= seed < 2**32:
    bad("seed", seed, "is not an int in [0, 2**32)", "seed=0")


def train(
  data: Iterable,
  config: TrainConfig,
  *,
  steps: int,
  init: Any = None,
  mesh=None,
  data_axis: str | None = None,
  checkpoint_dir=None,
  checkpoint_every: int = 1000,
  log_every: int = 10,
  progress: bool = True,
  callback: Callable | None = None,
  nonfinite: str = "raise",
) -> Trained:
  """Trains a dictionary on batches of activations.

  Args:
    data: an iterable of ``(rows, d_in)`` arrays (leading axes are merged into rows), or of
      ``(x, y)`` pairs / two-entry dicts for a transcoder; for example
      ``jaxlens.store.open(path).batches(site, batch_size=4096, flatten=True, shuffle=True)``.
      Every batch must have the first batch's row count (a shorter last batch is skipped).
    config: a :class:`TrainConfig`.
    steps: the number of steps (batches); fewer if ``data`` ends first.
    init: a dictionary to start from (default: SAELens's initialisation, ``b_dec`` from
      the first batch).
    mesh: a ``jax.sharding.Mesh`` (Auto or Explicit axes): the rows of each batch are split
      over ``data_axis`` (default: the mesh's first axis), the dictionary is replicated;
      each process passes its own rows (``jax.make_array_from_process_local_data``).
    checkpoint_dir: a directory for checkpoints (every ``checkpoint_every`` steps and at the
      end). If it holds one, training resumes from it: the batches it had consumed are
      skipped (``data`` must yield the same batches in the same order), and the result is
      the one an uninterrupted run gives, bit for bit.
    log_every: the metrics (every step's) are read back to the host every this many steps.
    progress: a tqdm progress bar (MSE, L0, explained variance).
    callback: called as ``callback(step, metrics)`` at every logged step.
    nonfinite: what a step whose batch, loss or gradient holds NaN or infinity does:
      ``"raise"`` (the default: ``batch_not_finite`` / ``loss_not_finite`` below) or
      ``"skip"``: the step changes nothing but the step count (it still counts as one of
      ``steps``; the dictionary, its optimiser state and the dead-feature counters are those
      before it, and it has no metrics) and is listed in :attr:`Trained.skipped`, which
      checkpoints keep across a resume.

  Returns:
    A :class:`Trained`.

  Raises:
    SAEError: ``sae_batch_invalid`` (no batches, or batches of the wrong kind, shape or
      dtype), ``sae_checkpoint_mismatch``, ``sae_config_invalid`` (an argument, or an
      ``init`` of another kind or size), ``sae_shape_mismatch`` (an ``init`` whose ``d_in``
      differs from the data's), ``batch_not_finite`` / ``loss_not_finite`` (a batch holding
      NaN or infinity, or a diverged step: ``fields["batch"]`` and ``fields["step"]`` name it;
      the metrics are read every ``log_every`` steps, so training stops within that many;
      with ``nonfinite="skip"``, such steps are skipped instead).
    jaxlens.CheckpointError: a checkpoint directory that is a file, locked by another run,
      damaged, or on a full disk (``disk_full``).
  """
  if nonfinite not in ("raise", "skip"):
    raise SAEError(
      f'nonfinite must be "raise" or "skip", got {nonfinite!r}',
      code="sae_config_invalid",
      field="nonfinite",
      fix='nonfinite="raise"',
    )
  skip = nonfinite == "skip"
  if not isinstance(config, TrainConfig):
    raise SAEError(
      f"config must be a TrainConfig, got {type(config).__name__}",
      code="sae_config_invalid",
      field="config",
      fix='config=TrainConfig(d_sae=4096, architecture="topk", k=32)',
    )
  _check_numbers(config)
  for name, value, fix in (
    ("steps", steps, "steps=1000"),
    ("log_every", log_every, "log_every=10"),
    ("checkpoint_every", checkpoint_every, "checkpoint_every=1000"),
  ):
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
      raise SAEError(
        f"{name} must be a positive int, got {value!r}",
        code="sae_config_invalid",
        field=name,
        fix=fix,
      )
  try:
    iterator = iter(data)
  except TypeError:
    raise SAEError(
      f"train: data must be an iterable of batches, got {type(data).__name__}",
      code="sae_batch_invalid",
      field="data",
      fix="store.open(path).batches(site, batch_size=4096, flatten=True), or a list of arrays",
    ) from None
  factor = None
  if config.normalize_activations == "expected_average_only_in":
    factor = _estimate_from(iterator, config)
  try:
    first = next(iterator)
  except StopIteration:
    raise SAEError(
      "train: the data yields no batch"
      + (" after the batches of the scale estimate" if factor is not None else ""),
      code="sae_batch_invalid",
      field="data",
      fix="an iterator of (rows, d_in) arrays",
    ) from None
  fx, fy = _split_batch(first, config.transcoder)
  fx = _rows(fx, 0)
  if factor is not None:
    fx = fx * factor
  fy = None if fy is None else _rows(fy, 0)
  rows = fx.shape[0]
  if fy is not None and fy.shape[0] != rows:
    raise SAEError(
      f"a transcoder's x and y must have as many rows, got {rows} and {fy.shape[0]}",
      code="sae_batch_invalid",
      field="data",
      fix="pairs of activations of the same tokens",
    )
  if init is not None:
    _check_init(init, config, fx, fy)
  if mesh is None:
    init_state, jitted = _compiled(config, steps, skip)

    def put(a):
      return a
  else:
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    if not isinstance(mesh, jax.sharding.Mesh):
      raise SAEError(
        f"mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}",
        code="sae_config_invalid",
        field="mesh",
        fix='mesh=jax.make_mesh((jax.device_count(),), ("data",))',
      )
    axis = data_axis or mesh.axis_names[0]
    if axis not in mesh.axis_names or (jax.process_count() == 1 and rows % mesh.shape[axis]):
      raise SAEError(
        f"data_axis={axis!r} is not an axis of the mesh {tuple(mesh.axis_names)}"
        if axis not in mesh.axis_names
        else f"a batch's {rows} rows do not split evenly over the mesh's {mesh.shape[axis]} "
        f"devices along {axis!r}",
        code="sae_config_invalid" if axis not in mesh.axis_names else "sae_batch_invalid",
        field="data_axis" if axis not in mesh.axis_names else "data",
        fix=f"data_axis={mesh.axis_names[0]!r}, and batches of a multiple of the axis's devices",
      )
    # The step is partitioned by XLA from the batch's sharding (Auto axes): top_k over a
    # batch sharded in an Explicit mesh's types has no sharding rule.
    mesh = auto_axes(mesh)
    replicated = NamedSharding(mesh, P())
    sharded = NamedSharding(mesh, P(axis))
    init_state, jitted = _compiled_on(config, steps, skip, mesh)

    def put(a):
      return None if a is None else jax.make_array_from_process_local_data(sharded, np.asarray(a))

  # With several processes each holds its own rows of the first batch: put() makes them the
  # global batch, so b_dec starts at its mean, the same in every process.
  state = init_state(jax.random.key(config.seed), put(fx), put(fy), init)

  history: dict[str, list] = {}
  skipped: list | None = [] if skip else None  # (None: a non-finite step raises)
  earlier: list = []  # the steps an earlier nonfinite="skip" run of the checkpoint skipped
  consumed = 0
  ckpt = None if checkpoint_dir is None else _checkpoints(checkpoint_dir, checkpoint_every)

  def batches():
    yield first
    yield from iterator

  bar = None
  pending = []
  try:
    restored = None if ckpt is None else _restore(ckpt, state, checkpoint_dir)
    if restored is not None:
      state, consumed, history, was_skipped = restored
      ckpt.check_within(int(state.step), steps)
      skipped, earlier = (was_skipped, []) if skip else (None, was_skipped)
      if mesh is not None:
        state = jax.device_put(state, replicated)
    if progress:
      from tqdm.auto import tqdm

      bar = tqdm(total=steps, initial=consumed, desc="sae.train", unit="step", leave=False)
    done = int(state.step)
    position = consumed
    for i, batch in enumerate(batches()):
      if i < consumed:
        continue  # resumed: already trained on
      if done >= steps:
        break
      x, y = _split_batch(batch, config.transcoder)
      x = _rows(x, i, fx.shape[1:])
      if factor is not None:
        x = x * factor
      y = None if y is None else _rows(y, i, fy.shape[1:])
      position = i + 1
      if x.shape[0] != rows or (y is not None and y.shape[0] != rows):
        continue  # a short last batch would recompile the step and change BatchTopK's k
      state, metrics = jitted(state, put(x), put(y))
      done += 1
      pending.append((done, i, metrics))
      if done % log_every == 0 or done == steps:
        _flush(pending, history, bar, callback, skipped)
      if ckpt is not None and done % checkpoint_every == 0:
        _flush(pending, history, bar, callback, skipped)
        _save(ckpt, state, position, history, earlier + (skipped or []))
    _flush(pending, history, bar, callback, skipped)
    if ckpt is not None:
      _save(ckpt, state, position, history, earlier + (skipped or []))
  finally:
    if bar is not None:
      bar.close()
    if ckpt is not None:
      ckpt.close()  # releases the directory's lock
  metrics = {k: np.asarray(v) for k, v in history.items()}
  skipped = earlier + (skipped or [])
  if factor is None:
    return Trained(state.sae, state, metrics, config, skipped=skipped)
  return Trained(
    fold_activation_scale(state.sae, factor), state, metrics, config, factor, skipped=skipped
  )


def _estimate_from(iterator, config: TrainConfig) -> float:
  """The scale factor from the first ``n_batches_for_norm_estimate`` batches of
  ``iterator`` (consumed), as SAELens's trainer reads them from its data provider."""
  batches = []
  for i in range(config.n_batches_for_norm_estimate):
    try:
      batch = next(iterator)
    except StopIteration:
      raise SAEError(
        f"the data ended after {i} of the n_batches_for_norm_estimate="
        f"{config.n_batches_for_norm_estimate} batches of the scale estimate",
        code="sae_batch_invalid",
        field="data",
        fix="more batches, or a smaller n_batches_for_norm_estimate",
      ) from None
    batches.append(_rows(_split_batch(batch, False)[0], i))
  return estimate_scaling_factor(batches)


def estimate_scaling_factor(batches) -> float:
  """SAELens's activation scale: ``sqrt(d_in) / mean |x|`` over the rows of ``batches``
  (an iterable of ``(..., d_in)`` arrays), so that scaled rows have mean norm
  ``sqrt(d_in)``. The norms are summed in float64 on the host."""
  total, count, d_in = 0.0, 0, None
  for i, batch in enumerate(batches):
    a = _rows(batch, i, None if d_in is None else (d_in,))
    d_in = a.shape[-1]
    wide = jnp.float64 if a.dtype == jnp.float64 else jnp.float32
    norms = np.asarray(jnp.linalg.norm(a.astype(wide), axis=-1), np.float64)
    total += float(norms.sum())
    count += norms.size
  if count == 0:
    raise SAEError(
      "estimate_scaling_factor: no batch",
      code="sae_batch_invalid",
      field="batches",
      fix="one or more (rows, d_in) arrays",
    )
  if not (math.isfinite(total) and total > 0):
    raise SAEError(
      f"estimate_scaling_factor: the rows' mean norm is {total / count!r}",
      code="sae_batch_invalid",
      field="batches",
      fix="activations that are finite and not all zero",
    )
  return math.sqrt(d_in) / (total / count)


def fold_activation_scale(d, factor: float):
  """The dictionary that reads raw activations and writes raw reconstructions, from one
  trained on activations scaled by ``factor``: ``W_enc * factor``, ``W_dec / factor``,
  ``b_dec / factor`` (SAELens's ``fold_activation_norm_scaling_factor``; its features
  are the same numbers)."""
  if not isinstance(d, SAE) or isinstance(d, Transcoder):
    raise SAEError(
      f"fold_activation_scale folds into an SAE, got {type(d).__name__}",
      code="sae_invalid_argument",
      field="d",
      fix="an SAE trained on scaled activations",
    )
  if not (isinstance(factor, (int, float)) and math.isfinite(factor) and factor > 0):
    raise SAEError(
      f"the scale factor must be a finite positive number, got {factor!r}",
      code="sae_invalid_argument",
      field="factor",
      fix="the factor of estimate_scaling_factor",
    )
  return d.replace(W_enc=d.W_enc * factor, W_dec=d.W_dec / factor, b_dec=d.b_dec / factor)


def fold_decoder_norm(d):
  """The same dictionary with unit-norm decoder rows: each row's norm moves into its
  encoder column and bias (``b_enc``, a JumpReLU's threshold, a gated SAE's ``b_mag``), so
  the reconstruction is unchanged and each feature's activation is multiplied by its norm
  (SAELens's ``fold_W_dec_norm``; norms clamped at 1e-8). A TopK SAE needs
  ``rescale_acts_by_decoder_norm`` (otherwise folding changes which features win)."""
  if not isinstance(d, SAE):
    raise SAEError(
      f"fold_decoder_norm folds an SAE or transcoder, got {type(d).__name__}",
      code="sae_invalid_argument",
      field="d",
      fix="an SAE or a Transcoder",
    )
  if d.activation in ("topk", "batchtopk", "abstopk") and not d.rescale_acts_by_decoder_norm:
    raise SAEError(
      f"folding the decoder norms of a {d.activation} SAE without "
      "rescale_acts_by_decoder_norm changes which features are selected",
      code="sae_config_invalid",
      field="rescale_acts_by_decoder_norm",
      fix="keep the norms, or train with rescale_acts_by_decoder_norm=True",
    )
  norm = jnp.maximum(jnp.linalg.norm(d.W_dec, axis=-1), 1e-8)
  changes = dict(W_dec=d.W_dec / norm[:, None], W_enc=d.W_enc * norm, b_enc=d.b_enc * norm)
  if d.threshold is not None:
    changes["threshold"] = d.threshold * norm
  if d.b_mag is not None:
    changes["b_mag"] = d.b_mag * norm
  return d.replace(**changes)


def _flush(pending, history, bar, callback, skipped=None):
  """Reads the pending steps' metrics into ``history``; a non-finite step raises, or is
  listed in ``skipped`` (a list: ``nonfinite="skip"``, whose step changed nothing)."""
  if not pending:
    return
  read = jax.device_get([m for _, _, m in pending])
  for (step, index, _), m in zip(pending, read):
    finite, batch_finite = bool(m.pop("_finite")), bool(m.pop("_batch_finite"))
    if not finite and skipped is not None:
      code = "loss_not_finite" if batch_finite else "batch_not_finite"
      skipped.append({"batch": index, "step": step, "code": code})
      continue
    if not finite:
      pending.clear()
      raise _not_finite(batch_finite, index, step)
    history.setdefault("step", []).append(step)
    for k, v in m.items():
      history.setdefault(k, []).append(float(v))
    if callback is not None:
      callback(step, m)
  if bar is not None:
    last = read[-1]
    bar.update(pending[-1][0] - bar.n)
    bar.set_postfix(
      mse=f"{float(last['mse_loss']):.4g}",
      l0=f"{float(last['l0']):.1f}",
      ev=f"{float(last['explained_variance']):.3f}",
    )
  pending.clear()


# --------------------------------------------------------------------------------------------
# Evaluation by splicing.


def ce_loss_recovered(model, variables, tokens, site, dictionary):
  """Cross-entropy loss recovered by splicing ``dictionary`` at ``site`` (without its error).

  ``(ce_zero - ce_spliced) / (ce_zero - ce_clean)`` with the next-token cross-entropy of
  the model as it is (``ce_clean``), with the site replaced by the dictionary's
  reconstruction (``ce_spliced``) and with the site zero-ablated (``ce_zero``). The three
  forward passes are one compiled program.

  Returns:
    ``{"ce_clean", "ce_spliced", "ce_zero", "loss_recovered"}`` (floats).
  """

  def ce(logits, tokens):
    logp = jax.nn.log_softmax(logits[:, :-1].astype(jnp.float32), axis=-1)
    picked = jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]
    return -picked.mean()

  @jax.jit
  def losses(variables, tokens, dictionary):
    zeroed = jl.when(jl.module(site), zero_ablate()).bind(model)
    return (
      ce(model.apply(variables, tokens), tokens),
      ce(splice(model, site, dictionary, keep_error=False).apply(variables, tokens), tokens),
      ce(zeroed(variables, tokens), tokens),
    )

  clean, spliced, zero = (float(x) for x in losses(variables, tokens, dictionary))
  recovered = (zero - spliced) / (zero - clean) if zero != clean else math.nan
  return {
    "ce_clean": clean,
    "ce_spliced": spliced,
    "ce_zero": zero,
    "loss_recovered": recovered,
  }
