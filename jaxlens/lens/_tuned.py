"""The tuned lens (Belrose et al., 2023): one affine translator per layer, ``h + W h + b``,
read through the model's final norm and unembedding; trained on the KL divergence to the
model's final distribution, every layer in one jitted optax step. Files are the ``tuned-lens``
package's (``params.pt`` and ``config.json``), read and written without torch."""

from __future__ import annotations

import functools
import hashlib
import itertools
import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxlens.lens._logit import check_layers, layer_count, residuals
from jaxlens.lens._readout import LensError, readout
from jaxlens.lens._torchfile import read_state_dict, save_failed, write_atomic, write_state_dict
from jaxlens.internal import auto_axes, path_argument

__all__ = [
  "TrainResult",
  "TunedLens",
  "kl_to_final",
  "load_tuned_lens",
  "save_tuned_lens",
  "train_tuned_lens",
  "tuned_lens",
  "tuned_lens_optimizer",
  "unembed_hash",
]


class TunedLens(NamedTuple):
  """Affine translators for layers ``0 .. n_layers - 1`` (a pytree).

  Attributes:
    weight: ``(n_layers, d_model, d_model)``, torch's ``Linear`` layout (output, input):
      layer ``i`` reads ``h + h @ weight[i].T + bias[i]``.
    bias: ``(n_layers, d_model)``.
  """

  weight: Any
  bias: Any

  @classmethod
  def zeros(cls, n_layers: int, d_model: int, dtype=jnp.float32) -> TunedLens:
    """Translators initialised at zero: the lens starts as the logit lens."""
    return cls(
      jnp.zeros((n_layers, d_model, d_model), dtype), jnp.zeros((n_layers, d_model), dtype)
    )

  @classmethod
  def for_model(cls, model, dtype=None) -> TunedLens:
    """Zero translators sized for ``model`` (a decoder of :mod:`jaxlens.models`)."""
    n = layer_count(model)  # (refuses a model that is not a decoder of the zoo)
    return cls.zeros(n, model.config.d_model, dtype or model.config.dtype)

  @classmethod
  def lstsq(cls, model, variables, batches: Iterable, *, ridge: float = 1e-3) -> TunedLens:
    """Translators fitted by least squares: layer ``i``'s affine map is the ridge regression of
    the last block's output (what the final norm and unembedding read) on layer ``i``'s
    residual, over the real tokens of ``batches``. A closed form, one ``(d, d)`` solve a layer
    from accumulated centred second moments (float64 on the host), and a better start for
    training than zeros (the logit lens): the KL to the final distribution is lower at once.

    The ridge term shrinks each map towards the identity (the zero translator), scaled by the
    layer's mean variance: ``(C_ii + ridge * tr(C_ii) / d * I)^-1`` times the cross moment.

    Args:
      model: a decoder of :mod:`jaxlens.models`.
      variables: its variables.
      batches: int token arrays ``(batch, seq)`` or ``(tokens, attention_mask)`` pairs, all
        read.
      ridge: the ridge term, relative to the layer's mean variance (>= 0).

    Returns:
      A :class:`TunedLens` in the model's dtype.

    Raises:
      LensError: ``lens_data_invalid`` (no batch, a batch that is not int tokens, no real
        token, or a statistic that is not finite), ``invalid_argument`` (``ridge``).
    """
    if not isinstance(ridge, (int, float)) or isinstance(ridge, bool) or not ridge >= 0:
      raise LensError(
        f"ridge must be a number >= 0, got {ridge!r}",
        code="invalid_argument",
        received=repr(ridge),
        fix="ridge=1e-3",
      )
    total = None
    for i, batch in enumerate(batches):
      tokens, mask = _batch_arrays(batch, i)
      moments = tuple(np.asarray(m, np.float64) for m in _moments(model, variables, tokens, mask))
      total = moments if total is None else _merge_moments(total, moments)
    if total is None or total[0] == 0:
      raise LensError(
        "no token to fit the translators on (no batch, or every token masked)",
        code="lens_data_invalid",
        fix="one batch of token ids at least",
      )
    _, mean, c_xx, c_xy = total
    if not (np.all(np.isfinite(c_xx)) and np.all(np.isfinite(c_xy))):
      raise LensError(
        "the residual streams' moments are not finite (NaN or infinity in the model's values)",
        code="lens_data_invalid",
        fix="check the batches and the model's variables for NaN",
      )
    d = c_xx.shape[-1]
    weights, biases = [], []
    for layer in range(c_xx.shape[0]):
      a = c_xx[layer] + ridge * max(np.trace(c_xx[layer]) / d, 1e-30) * np.eye(d)
      delta = np.linalg.solve(a, c_xy[layer] - c_xx[layer])  # h -> h + h @ delta + b
      weights.append(delta.T)  # torch's Linear layout: h @ weight.T
      biases.append(mean[-1] - mean[layer] - mean[layer] @ delta)
    dtype = model.config.dtype
    return cls(jnp.asarray(np.stack(weights), dtype), jnp.asarray(np.stack(biases), dtype))

  def translate(self, h, layers):
    """``h`` (``(len(layers), ..., d)``) through each layer's translator; a layer equal to
    ``n_layers`` (the last block's output) passes unchanged."""
    n = self.weight.shape[0]
    out = []
    for h_i, layer in zip(h, layers):
      if layer == n:
        out.append(h_i)
      else:
        w, b = self.weight[layer].astype(h_i.dtype), self.bias[layer].astype(h_i.dtype)
        out.append(h_i + jnp.einsum("...i,oi->...o", h_i, w) + b)
    return jnp.stack(out)


def _batch_arrays(batch, i: int):
  """A batch (tokens, or ``(tokens, attention_mask)``) as int tokens and an int mask."""
  tokens, mask = batch if isinstance(batch, tuple) else (batch, None)
  tokens = jnp.asarray(tokens)
  if not jnp.issubdtype(tokens.dtype, jnp.integer) or tokens.ndim != 2:
    raise LensError(
      f"batch {i}: expected int tokens (batch, seq), got {tokens.dtype} {tokens.shape}",
      code="lens_data_invalid",
      received=f"{tokens.dtype} {tokens.shape}",
      fix="token ids from the model's tokenizer, (batch, seq) int32",
    )
  mask = jnp.ones(tokens.shape, jnp.int32) if mask is None else jnp.asarray(mask)
  return tokens, mask


@functools.partial(jax.jit, static_argnames=("model",))
def _moments(model, variables, tokens, mask):
  """One batch's token count, each layer's mean residual ``(n_layers + 1, d)``, and per layer
  ``i < n_layers`` the centred moments ``C_ii = X_i^T X_i`` and ``C_if = X_i^T X_f`` (``X``
  the real tokens' centred residuals, ``f`` the last layer), ``(n_layers, d, d)`` each; in
  float32 at least."""
  sites = check_layers(model, None)
  res = residuals(model, variables, tokens, layers=sites, attention_mask=mask)
  wide = jnp.float32 if jnp.dtype(res.dtype).itemsize < 4 else res.dtype  # bfloat16: float32
  res = res.reshape(res.shape[0], -1, res.shape[-1]).astype(wide)
  w = mask.reshape(-1).astype(wide)
  n = jnp.sum(w)
  mean = jnp.einsum("t,ltd->ld", w, res) / jnp.maximum(n, 1)
  x = (res - mean[:, None]) * w[None, :, None]
  c_xx = jnp.einsum("lti,ltj->lij", x[:-1], x[:-1])
  c_xy = jnp.einsum("lti,tj->lij", x[:-1], x[-1])
  return n, mean, c_xx, c_xy


def _merge_moments(a, b):
  """Two batches' moments as one (Chan et al.'s pairwise update of centred moments)."""
  n_a, mean_a, xx_a, xy_a = a
  n_b, mean_b, xx_b, xy_b = b
  n = n_a + n_b
  if n == 0:
    return a
  delta = mean_b - mean_a
  f = n_a * n_b / n
  xx = xx_a + xx_b + f * np.einsum("li,lj->lij", delta[:-1], delta[:-1])
  xy = xy_a + xy_b + f * np.einsum("li,j->lij", delta[:-1], delta[-1])
  return n, mean_a + delta * (n_b / n), xx, xy


def _check_lens(model, lens: TunedLens) -> None:
  n, d = layer_count(model), model.config.d_model
  if tuple(lens.weight.shape) != (n, d, d) or tuple(lens.bias.shape) != (n, d):
    raise LensError(
      f"a lens of translators {tuple(lens.weight.shape)} for a model of {n} layers of width {d}",
      code="lens_file_mismatch",
      expected=f"weight {(n, d, d)}, bias {(n, d)}",
      received=f"weight {tuple(lens.weight.shape)}, bias {tuple(lens.bias.shape)}",
      fix="a lens trained for this model (TunedLens.for_model(model) for a new one)",
    )


def tuned_lens(model, variables, lens: TunedLens, tokens, *, layers=None, attention_mask=None):
  """The tuned lens's logits at each layer: the layer's residual through its translator, then
  the model's own final norm and unembedding. Layer ``n_layers`` is the model's logits.

  Args:
    model: a decoder of :mod:`jaxlens.models`.
    variables: its variables.
    lens: a :class:`TunedLens`.
    tokens: int ``(batch, seq)``.
    layers: lens layers (None: all ``n_layers + 1``).
    attention_mask: optional padding mask.

  Returns:
    ``(len(layers), batch, seq, vocab)`` logits.
  """
  layers = check_layers(model, layers)
  _check_lens(model, lens)
  res = residuals(model, variables, tokens, layers=layers, attention_mask=attention_mask)
  h = lens.translate(res, layers)
  n, b = h.shape[:2]
  out = model.unembed(variables, h.reshape(n * b, *h.shape[2:]))
  return out.reshape(n, b, *out.shape[1:])


def _kl(final_logits, logits, mask):
  """Mean over real tokens of KL(final || lens), ``(layers,)``."""
  sdt = jnp.float32 if jnp.dtype(logits.dtype).itemsize < 4 else logits.dtype
  p_log = jax.nn.log_softmax(final_logits.astype(sdt), -1)
  q_log = jax.nn.log_softmax(logits.astype(sdt), -1)
  kl = jnp.sum(jnp.exp(p_log) * (p_log - q_log), -1)  # (layers, batch, seq)
  m = mask.astype(sdt)
  return jnp.sum(kl * m, axis=(1, 2)) / jnp.maximum(jnp.sum(m), 1)


def _final_distribution(model, variables, final_residual, mask):
  """The model's final distribution (in float32 at least), ``sum(p * log p)`` per token, and
  each token's weight in the mean over real tokens, ``mask / sum(mask)``."""
  logits = model.unembed(variables, final_residual)
  sdt = jnp.float32 if jnp.dtype(logits.dtype).itemsize < 4 else logits.dtype
  p_log = jax.nn.log_softmax(logits.astype(sdt), -1)
  p = jnp.exp(p_log)
  m = mask.astype(sdt)
  return p, jnp.sum(p * p_log, -1), m / jnp.maximum(jnp.sum(m), 1)


def _kl_and_grad(model, variables, h, p, p_entropy, weight):
  """One layer's mean KL(final || lens) and its gradient with respect to the translated
  residual ``h``, in one pass: the gradient of the KL with respect to the lens's logits ``z``
  is ``weight * (q - p)``, pulled back through the final norm and unembedding. Two products
  with the unembedding (forward and pullback), where differentiating the KL through a
  checkpoint takes three. Per token, ``KL = sum(p log p) - sum(p z) + logsumexp(z)``."""
  logits, pullback = jax.vjp(lambda x: model.unembed(variables, x), h)
  z = logits.astype(p.dtype)
  top = jax.lax.stop_gradient(jnp.max(z, -1, keepdims=True))
  e = jnp.exp(z - top)  # one exponential a logit: q and logsumexp(z) both from it
  total = jnp.sum(e, -1, keepdims=True)
  lse = (top + jnp.log(total))[..., 0]
  kl = jnp.sum((p_entropy - jnp.sum(p * z, -1) + lse) * weight)
  (grad,) = pullback(((e / total - p) * weight[..., None]).astype(logits.dtype))
  return kl, grad


def kl_to_final(model, variables, tokens, lens: TunedLens | None = None, *, attention_mask=None):
  """Per layer, the mean KL divergence from the model's final distribution to the lens's
  (the tuned lens, or the logit lens when ``lens`` is None), ``(n_layers + 1,)``; the last is
  0."""
  layers = check_layers(model, None)
  res = residuals(model, variables, tokens, layers=layers, attention_mask=attention_mask)
  h = res if lens is None else lens.translate(res, layers)
  tokens = jnp.asarray(tokens)
  mask = jnp.ones(tokens.shape, bool) if attention_mask is None else jnp.asarray(attention_mask)
  final = model.unembed(variables, h[-1])

  def layer_kl(x):  # one layer's logits at a time: the peak is one (batch, seq, vocab) array
    return _kl(final[None], model.unembed(variables, x)[None], mask)[0]

  return jax.lax.map(layer_kl, h)


def _clip_like_torch(max_norm: float) -> optax.GradientTransformation:
  """``torch.nn.utils.clip_grad_norm_``: every gradient times ``min(1, max_norm / (norm +
  1e-6))``, the norm taken over all of them."""

  def clip(updates, params=None):
    del params
    norm = optax.global_norm(updates)
    coef = jnp.minimum(max_norm / (norm + 1e-6), 1.0)
    return jax.tree.map(lambda u: u * coef.astype(u.dtype), updates)

  return optax.stateless(clip)


@functools.lru_cache(maxsize=64)  # the same optimiser object: train_tuned_lens's step is reused
def tuned_lens_optimizer(
  steps: int,
  *,
  lr_scale: float = 1.0,
  momentum: float = 0.9,
  weight_decay: float = 1e-3,
  clip: float = 1.0,
) -> optax.GradientTransformation:
  """The ``tuned-lens`` package's default optimiser (its ``train`` command): the gradient's
  global norm clipped to ``clip`` (1.0), then SGD with Nesterov momentum 0.9 and learning rate
  ``lr_scale * (1 - momentum)`` (0.1) decayed linearly to zero over ``steps``, with torch's
  coupled weight decay 1e-3 (added to the gradient)."""
  lr = lr_scale * (1 - momentum)

  def schedule(count):  # torch's LambdaLR of get_linear_schedule_with_warmup(opt, 0, steps)
    t = jnp.asarray(count, jnp.result_type(float))  # float64 under x64, as torch computes
    return lr * jnp.clip(1.0 - t / steps, 0.0, 1.0)

  return optax.chain(
    _clip_like_torch(clip),
    optax.add_decayed_weights(weight_decay),
    optax.sgd(schedule, momentum=momentum, nesterov=True),
  )


@functools.partial(jax.jit, static_argnames=("model", "opt"))
def _train_step(model, opt, variables, lens, state, tokens, mask):
  """One step of every layer's translator (the model's variables an argument, not constants);
  one compiled program per model, optimiser and batch shape."""
  sites = check_layers(model, None)
  res = residuals(model, variables, tokens, layers=sites, attention_mask=mask)
  res = jax.lax.stop_gradient(res)
  p, p_entropy, weight = _final_distribution(model, variables, res[-1], mask)
  h, translate_vjp = jax.vjp(lambda lens: lens.translate(res[:-1], sites[:-1]), lens)
  # One layer at a time (lax.map): the peak is a few (batch, seq, vocab) arrays, not one per
  # layer; each layer's gradient comes with its KL, so nothing is recomputed or kept.
  kl, g = jax.lax.map(lambda x: _kl_and_grad(model, variables, x, p, p_entropy, weight), h)
  (grads,) = translate_vjp(g)
  updates, state = opt.update(grads, state, lens)
  return optax.apply_updates(lens, updates), state, kl


class TrainResult(NamedTuple):
  """What :func:`train_tuned_lens` returns.

  Attributes:
    lens: the trained :class:`TunedLens`.
    kl: ``(steps, n_layers)`` each step's per-layer KL (before its update).
  """

  lens: TunedLens
  kl: Any


def train_tuned_lens(
  model,
  variables,
  batches: Iterable,
  *,
  steps: int,
  lens: TunedLens | None = None,
  optimizer: optax.GradientTransformation | None = None,
  mesh=None,
  data_axis: str = "data",
  init: str = "zeros",
  init_batches: int = 1,
  ridge: float = 1e-3,
) -> TrainResult:
  """Trains a tuned lens: every layer's translator in one jitted step on the sum over layers
  of the KL divergence from the model's final distribution (the model itself is frozen).

  Args:
    model: a decoder of :mod:`jaxlens.models`.
    variables: its variables.
    batches: an iterable of int token arrays ``(batch, seq)`` (or ``(tokens, attention_mask)``
      pairs); ``steps`` of them are read.
    steps: how many steps.
    lens: where to start (default: as ``init`` says).
    optimizer: an optax optimiser (default :func:`tuned_lens_optimizer`, tuned-lens's).
    mesh: an optional ``jax.sharding.Mesh``: each batch is split over its ``data_axis``
      (data parallel), the lens and the model replicated.
    data_axis: the mesh axis of the batch.
    init: without ``lens``, where to start: ``"zeros"`` (the logit lens, tuned-lens's start)
      or ``"lstsq"`` (:meth:`TunedLens.lstsq` on the first ``init_batches`` batches, which
      training then reads as well: the KL starts lower and fewer steps reach a given KL).
    init_batches: how many batches the least-squares start reads.
    ridge: the least-squares start's ridge term (:meth:`TunedLens.lstsq`).

  Returns:
    A :class:`TrainResult`.

  Raises:
    LensError: ``lens_data_invalid`` (a batch that is not int tokens, or a loss that is not
      finite: NaN in the data or the model), ``invalid_argument`` (``steps``, ``init``,
      ``init_batches``, ``ridge``).
  """
  if not isinstance(steps, int) or steps < 1:
    raise LensError(
      f"steps must be a positive int, got {steps!r}",
      code="invalid_argument",
      received=repr(steps),
      fix="steps=100",
    )
  if init not in ("zeros", "lstsq"):
    raise LensError(
      f"init must be 'zeros' or 'lstsq', got {init!r}",
      code="invalid_argument",
      received=repr(init),
      fix='init="lstsq"',
    )
  if not isinstance(init_batches, int) or init_batches < 1:
    raise LensError(
      f"init_batches must be a positive int, got {init_batches!r}",
      code="invalid_argument",
      received=repr(init_batches),
      fix="init_batches=1",
    )
  it = iter(batches)
  if lens is None and init == "lstsq":
    first = list(itertools.islice(it, init_batches))
    lens = TunedLens.lstsq(model, variables, first, ridge=ridge)
    it = itertools.chain(first, it)
  lens = TunedLens.for_model(model) if lens is None else lens
  _check_lens(model, lens)
  opt = tuned_lens_optimizer(steps) if optimizer is None else optimizer
  state = opt.init(lens)

  history = []
  for i in range(steps):
    try:
      batch = next(it)
    except StopIteration:
      raise LensError(
        f"the batches ran out after {i} of {steps} steps",
        code="lens_data_invalid",
        fix="more batches, or fewer steps",
      ) from None
    tokens, mask = _batch_arrays(batch, i)
    if mesh is not None:
      from jax.sharding import NamedSharding, PartitionSpec

      # Auto axes: XLA partitions the step from the batch's sharding (under an Explicit mesh,
      # jax.make_mesh's default, the embedding lookup of sharded tokens has no sharding rule).
      rows = NamedSharding(auto_axes(mesh), PartitionSpec(data_axis))
      tokens, mask = jax.device_put(tokens, rows), jax.device_put(mask, rows)
    lens, state, kl = _train_step(model, opt, variables, lens, state, tokens, mask)
    if not bool(jnp.all(jnp.isfinite(kl))):
      raise LensError(
        f"batch {i}: the KL is not finite (NaN or infinity in the model's values on it)",
        code="lens_data_invalid",
        received=str(np.asarray(kl)),
        fix="check the batch and the model's variables for NaN",
      )
    history.append(kl)
  return TrainResult(lens, jnp.stack(history))


# -- tuned-lens files -----------------------------------------------------------------------------


def unembed_hash(model, variables) -> str:
  """The ``tuned-lens`` package's hash of the model's unembedding matrix (torch layout
  ``(vocab, d_model)``): sha256 of ``numpy.array_str(matrix, precision=1)`` at numpy's
  default print options."""
  ro = readout(model, variables)
  matrix = np.asarray(ro.rows(jnp.arange(ro.vocab)), np.float32)
  with np.printoptions(threshold=1000, edgeitems=3, linewidth=75, suppress=False):
    return hashlib.sha256(str.encode(np.array_str(matrix, precision=1))).hexdigest()


def save_tuned_lens(path, lens: TunedLens, model, variables, *, model_name: str = "") -> Path:
  """Writes ``lens`` as the ``tuned-lens`` package does (``TunedLens.save``): a directory
  with ``params.pt`` (translator ``i``'s ``{i}.weight``, ``{i}.bias``) and ``config.json``
  (``base_model_name_or_path``, ``d_model``, ``num_hidden_layers``, ``bias``,
  ``unembed_hash``, ``lens_type``). Each file is written atomically. No torch needed.

  Returns:
    The directory.

  Raises:
    LensError: ``lens_save_failed`` when the file system refuses a write (nothing of the file
      is left behind).
  """
  _check_lens(model, lens)
  path = Path(path)
  try:
    path.mkdir(parents=True, exist_ok=True)
  except OSError as error:
    raise save_failed(path, error) from error
  arrays = {}
  for i in range(lens.weight.shape[0]):
    arrays[f"{i}.weight"] = np.asarray(lens.weight[i])
    arrays[f"{i}.bias"] = np.asarray(lens.bias[i])
  write_state_dict(path / "params.pt", arrays)
  config = {
    "base_model_name_or_path": model_name,
    "d_model": int(lens.weight.shape[1]),
    "num_hidden_layers": int(lens.weight.shape[0]),
    "bias": True,
    "base_model_revision": None,
    "unembed_hash": unembed_hash(model, variables),
    "lens_type": "linear_tuned_lens",
  }
  write_atomic(path / "config.json", lambda f: f.write(json.dumps(config).encode()))
  return path


def _mismatch(path, message: str, **fields) -> LensError:
  return LensError(
    f"{path}: {message}",
    code="lens_file_mismatch",
    path=str(path),
    fix="a lens trained for this model (config.json says which)",
    **fields,
  )


@path_argument(LensError)
def load_tuned_lens(
  path, model, variables, *, model_name: str | None = None, check_hash: bool = True
) -> TunedLens:
  """Reads a ``tuned-lens`` directory (``params.pt`` and ``config.json``: a published lens, or
  one :func:`save_tuned_lens` wrote) for ``model``. No torch needed.

  Args:
    path: the directory.
    model: the decoder the lens is for; its width and depth must match the file's.
    variables: its variables (for the unembedding hash).
    model_name: when given, ``config.json``'s ``base_model_name_or_path`` must equal it.
    check_hash: refuse a lens whose ``unembed_hash`` differs from the model's (tuned-lens only
      warns).

  Raises:
    LensError: ``lens_file_missing``, ``lens_file_corrupt`` (a truncated or edited file),
      ``lens_file_mismatch`` (sizes, layer count, unembedding hash or model name).
  """
  path = Path(path)
  config_path = path / "config.json"
  if not config_path.is_file():
    raise LensError(
      f"no config.json in {path}",
      code="lens_file_missing",
      path=str(path),
      fix="the directory holding a tuned lens's params.pt and config.json",
    )
  try:
    config = json.loads(config_path.read_text())
    d, n = int(config["d_model"]), int(config["num_hidden_layers"])
  except (ValueError, KeyError, TypeError) as e:
    raise LensError(
      f"{config_path} is not a tuned-lens config: {e}",
      code="lens_file_corrupt",
      path=str(config_path),
      fix="the config.json tuned-lens's TunedLens.save wrote",
    ) from e
  want_n, want_d = layer_count(model), int(model.config.d_model)
  if (n, d) != (want_n, want_d):
    raise _mismatch(
      path,
      f"the lens is for {n} layers of width {d}, the model has {want_n} of width {want_d}",
      expected=(want_n, want_d),
      received=(n, d),
    )
  name = config.get("base_model_name_or_path")
  if model_name is not None and name != model_name:
    raise _mismatch(path, f"the lens is for {name!r}, not {model_name!r}", received=name)
  stored_hash = config.get("unembed_hash")
  if check_hash and stored_hash and stored_hash != unembed_hash(model, variables):
    raise _mismatch(
      path,
      "its unembed_hash differs from the model's unembedding: another model's lens",
      received=stored_hash,
    )
  state = read_state_dict(path / "params.pt")
  want = {f"{i}.{k}" for i in range(n) for k in ("weight", "bias")}
  if set(state) != want:
    missing, extra = sorted(want - set(state)), sorted(set(state) - want)
    raise _mismatch(path, f"params.pt lacks {missing[:4]} / has extra {extra[:4]}")
  dtype = jnp.dtype(model.config.dtype)
  for i in range(n):
    for key, shape in (("weight", (d, d)), ("bias", (d,))):
      if state[f"{i}.{key}"].shape != shape:
        raise _mismatch(
          path,
          f"params.pt's {i}.{key} has shape {state[f'{i}.{key}'].shape}, expected {shape}",
          expected=shape,
          received=state[f"{i}.{key}"].shape,
        )
  weight = np.stack([state[f"{i}.weight"] for i in range(n)])
  bias = np.stack([state[f"{i}.bias"] for i in range(n)])
  return TunedLens(jnp.asarray(weight, dtype), jnp.asarray(bias, dtype))
