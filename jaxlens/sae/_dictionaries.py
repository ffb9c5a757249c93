"""Sparse dictionaries as pytrees: SAEs, transcoders and cross-layer transcoders.

Each dictionary is a frozen dataclass registered as a pytree: its arrays are leaves
(so it passes through ``jax.jit``, ``jax.grad`` and ``jax.vmap`` as an argument, and
optax trains it directly) and its configuration (activation, ``k``, normalisation)
is static. The forward definitions are SAELens's (``sae_lens.saes``), term for term:

* input: cast to the dictionary's dtype, ``hook_z`` reshaping, run-time
  normalisation (``constant_norm_rescale``, ``layer_norm``), minus ``b_dec`` when
  ``apply_b_dec_to_input``;
* ``hidden_pre = x @ W_enc + b_enc`` (times the decoder row norms for a TopK SAE with
  ``rescale_acts_by_decoder_norm``);
* activation: ``relu``; ``jumprelu`` (``relu(pre) * (pre > threshold)``); ``topk``
  (the ``k`` largest of each row, through ReLU); ``batchtopk`` (the ``k * rows``
  largest of the whole batch, through ReLU);
* ``decode(acts) = acts @ W_dec + b_dec``, then the inverse normalisation.
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxlens.core import InvalidArgumentError

__all__ = ["SAE", "Transcoder", "CrossLayerTranscoder", "SAEError", "ACTIVATIONS"]

ACTIVATIONS = ("relu", "jumprelu", "topk", "batchtopk", "abstopk", "gated")
NORMALISATIONS = ("none", "expected_average_only_in", "constant_norm_rescale", "layer_norm")


class SAEError(InvalidArgumentError):
  """A dictionary, its file or its splice that jaxlens refuses (``.fields["code"]``, and
  ``.fields["field"]`` naming the config field or tensor involved)."""


def _check_choice(value, choices, field):
  if value not in choices:
    raise SAEError(
      f"{field}={value!r} is not one of {list(choices)}",
      code="sae_config_invalid",
      field=field,
      fix=f"{field}={choices[0]!r}",
    )


def topk_relu(pre, k: int):
  """The ``k`` largest entries of each row of ``pre`` through ReLU, zeros elsewhere."""
  values, index = jax.lax.top_k(pre, k)
  return jnp.put_along_axis(jnp.zeros_like(pre), index, jax.nn.relu(values), axis=-1, inplace=False)


def batch_topk_relu(pre, k: float):
  """BatchTopK: the ``int(k * rows)`` largest entries of ``relu(pre)`` over the whole batch."""
  acts = jax.nn.relu(pre)
  rows = math.prod(pre.shape[:-1])
  flat = acts.reshape(-1)
  values, index = jax.lax.top_k(flat, int(k * rows))
  return jnp.zeros_like(flat).at[index].set(values).reshape(pre.shape)


def _runtime_norm(kind, x, d_in):
  """``(normalised x, state)`` for the run-time normalisations; ``state`` undoes it."""
  if kind == "constant_norm_rescale":
    coeff = (d_in**0.5) / jnp.linalg.norm(x, axis=-1, keepdims=True)
    return x * coeff, ("scale", coeff)
  if kind == "layer_norm":
    mu = x.mean(axis=-1, keepdims=True)
    centred = x - mu
    std = jnp.std(centred, axis=-1, keepdims=True, ddof=1)  # torch's x.std is unbiased
    return centred / (std + 1e-5), ("ln", mu, std)
  return x, None


def _undo_norm(state, y):
  if state is None:
    return y
  if state[0] == "scale":
    return y / state[1]
  return y * state[2] + state[1]


def _meta(metadata) -> str:
  return json.dumps(dict(metadata or {}), sort_keys=True, default=str)


@dataclasses.dataclass(frozen=True)
class SAE:
  """A sparse autoencoder: ``x -> acts = act(x @ W_enc + b_enc) -> acts @ W_dec + b_dec``.

  Attributes:
    W_enc: ``(d_in, d_sae)``.
    b_enc: ``(d_sae,)``.
    W_dec: ``(d_sae, d_in)`` (row ``i`` is feature ``i``'s direction).
    b_dec: ``(d_in,)``.
    threshold: ``(d_sae,)`` for ``activation="jumprelu"``, else None.
    activation: ``"relu"``, ``"jumprelu"``, ``"topk"``, ``"batchtopk"``, ``"abstopk"`` (the
      ``k`` entries of largest magnitude, signed, no ReLU) or ``"gated"`` (static).
    k: the TopK ``k`` (an int), or BatchTopK's mean active features per row (static).
    apply_b_dec_to_input: subtract ``b_dec`` from the input before encoding (SAELens's
      default).
    normalize_activations: SAELens's ``normalize_activations`` (``"none"``,
      ``"expected_average_only_in"`` (identity here, as in SAELens at inference),
      ``"constant_norm_rescale"``, ``"layer_norm"``).
    rescale_acts_by_decoder_norm: TopK (and BatchTopK) select on ``hidden_pre * |W_dec row|``
      and decode ``acts / |W_dec row|``.
    reshape_activations: ``"none"`` or ``"hook_z"`` (flatten ``(..., heads, d_head)``).
    metadata_json: SAELens's ``metadata`` (hook name, model name...) as JSON text.
    r_mag, b_mag: a gated SAE's magnitude path (``(d_sae,)`` each): ``acts = (x @ W_enc +
      b_enc > 0) * relu(x @ (W_enc * exp(r_mag)) + b_mag)``, ``b_enc`` being SAELens's
      ``b_gate``; None otherwise.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from jaxlens import sae
    >>> d = sae.SAE.init(jax.random.key(0), d_in=8, d_sae=32, activation="topk", k=4)
    >>> acts = d.encode(jnp.ones((2, 8), jnp.float32))
    >>> int((acts != 0).sum(-1).max()) <= 4, d(jnp.ones((2, 8), jnp.float32)).shape
    (True, (2, 8))
  """

  W_enc: Any
  b_enc: Any
  W_dec: Any
  b_dec: Any
  threshold: Any = None
  activation: str = "relu"
  k: Any = None
  apply_b_dec_to_input: bool = True
  normalize_activations: str = "none"
  rescale_acts_by_decoder_norm: bool = False
  reshape_activations: str = "none"
  metadata_json: str = "{}"
  r_mag: Any = None
  b_mag: Any = None

  _data = ("W_enc", "b_enc", "W_dec", "b_dec", "threshold", "r_mag", "b_mag")

  def __post_init__(self):
    _check_choice(self.activation, ACTIVATIONS, "activation")
    _check_choice(self.normalize_activations, NORMALISATIONS, "normalize_activations")
    _check_choice(self.reshape_activations, ("none", "hook_z"), "reshape_activations")
    if self.activation in ("topk", "batchtopk", "abstopk") and (
      self.k is None or isinstance(self.k, bool) or not self.k > 0
    ):
      raise SAEError(
        f"activation={self.activation!r} needs a positive k, got {self.k!r}",
        code="sae_config_invalid",
        field="k",
        fix=f"activation={self.activation!r}, k=32",
      )
    if self.activation == "jumprelu" and self.threshold is None:
      raise SAEError(
        "activation='jumprelu' needs a threshold array of shape (d_sae,)",
        code="sae_config_invalid",
        field="threshold",
        fix="threshold=jnp.zeros((d_sae,))",
      )
    if (self.activation == "gated") != (self.r_mag is not None and self.b_mag is not None):
      raise SAEError(
        "r_mag and b_mag are a gated SAE's (activation='gated' needs both, others neither)",
        code="sae_config_invalid",
        field="r_mag",
        fix="activation='gated', r_mag=..., b_mag=... (arrays of shape (d_sae,))",
      )
    self._check_shapes()

  def _check_shapes(self):
    def shape(name):
      value = getattr(self, name)
      return None if value is None else tuple(np.shape(value))

    d_in, d_sae = (shape("W_enc") + (None, None))[:2] if shape("W_enc") else (None, None)
    expected = {
      "W_enc": (d_in, d_sae),
      "b_enc": (d_sae,),
      "W_dec": (d_sae, self._d_out(d_in)),
      "b_dec": (self._d_out(d_in),),
      "threshold": (d_sae,),
      "r_mag": (d_sae,),
      "b_mag": (d_sae,),
      **self._extra_shapes(d_in, d_sae),
    }
    if shape("W_enc") is None or len(shape("W_enc")) != 2:
      raise SAEError(
        f"W_enc must be a (d_in, d_sae) matrix, got shape {shape('W_enc')}",
        code="sae_weights_invalid",
        field="W_enc",
        fix="W_enc of shape (d_in, d_sae)",
      )
    for name, want in expected.items():
      got = shape(name)
      if got is None or any(w is None for w in want):
        continue
      if got != want:
        raise SAEError(
          f"{name} has shape {got}, expected {want} (from W_enc {shape('W_enc')})",
          code="sae_weights_invalid",
          field=name,
          expected=str(want),
          received=str(got),
          fix=f"{name} of shape {want}",
        )

  def _d_out(self, d_in):
    return d_in

  def _extra_shapes(self, d_in, d_sae):
    return {}

  # -- pytree --------------------------------------------------------------

  @classmethod
  def _fields(cls):
    data = [f.name for f in dataclasses.fields(cls) if f.name in cls._data]
    meta = [f.name for f in dataclasses.fields(cls) if f.name not in cls._data]
    return data, meta

  def tree_flatten(self):
    data, meta = self._fields()
    return tuple(getattr(self, n) for n in data), tuple(getattr(self, n) for n in meta)

  @classmethod
  def tree_unflatten(cls, meta_values, children):
    data, meta = cls._fields()
    obj = object.__new__(cls)
    for name, value in zip(data, children):
      object.__setattr__(obj, name, value)
    for name, value in zip(meta, meta_values):
      object.__setattr__(obj, name, value)
    return obj

  # -- construction --------------------------------------------------------

  @classmethod
  def init(
    cls,
    key,
    d_in: int,
    d_sae: int,
    *,
    activation: str = "relu",
    k=None,
    dtype=jnp.float32,
    decoder_init_norm: float | None = 0.1,
    threshold: float = 0.0,
    **config,
  ):
    """SAELens's initialisation: ``W_dec`` Kaiming-uniform rows scaled to
    ``decoder_init_norm``, ``W_enc = W_dec.T``, zero biases, a constant ``threshold``."""
    d_out = config.pop("d_out", d_in)
    bound = math.sqrt(6.0 / d_out)
    w_dec = jax.random.uniform(key, (d_sae, d_out), jnp.float32, -bound, bound)
    if decoder_init_norm is not None:
      w_dec = w_dec / jnp.linalg.norm(w_dec, axis=-1, keepdims=True) * decoder_init_norm
    if d_out == d_in:
      w_enc = w_dec.T
    else:
      w_enc = jax.random.uniform(
        jax.random.fold_in(key, 1), (d_in, d_sae), jnp.float32, -bound, bound
      )
    extra = {}
    if cls is Transcoder and config.pop("skip", False):
      extra["W_skip"] = jnp.zeros((d_out, d_in), dtype)
    if cls is not Transcoder:
      config.pop("skip", None)
    return cls(
      W_enc=w_enc.astype(dtype),
      b_enc=jnp.zeros((d_sae,), dtype),
      W_dec=w_dec.astype(dtype),
      b_dec=jnp.zeros((d_out,), dtype),
      threshold=jnp.full((d_sae,), threshold, dtype) if activation == "jumprelu" else None,
      activation=activation,
      k=k,
      **(
        {"r_mag": jnp.zeros((d_sae,), dtype), "b_mag": jnp.zeros((d_sae,), dtype)}
        if activation == "gated"
        else {}
      ),
      **extra,
      **config,
    )

  def replace(self, **changes):
    """A copy with some fields changed (``dataclasses.replace``)."""
    return dataclasses.replace(self, **changes)

  # -- shapes --------------------------------------------------------------

  @property
  def d_in(self) -> int:
    return int(np.shape(self.W_enc)[0])

  @property
  def d_sae(self) -> int:
    return int(np.shape(self.W_enc)[1])

  @property
  def d_out(self) -> int:
    return int(np.shape(self.W_dec)[1])

  @property
  def dtype(self):
    return jnp.result_type(self.W_enc)

  @property
  def metadata(self) -> dict:
    return json.loads(self.metadata_json)

  def astype(self, dtype):
    """The same dictionary with every array in ``dtype``."""
    return jax.tree.map(lambda a: jnp.asarray(a).astype(dtype), self)

  # -- forward -------------------------------------------------------------

  def _flatten_in(self, x):
    x = jnp.asarray(x)
    if self.reshape_activations == "hook_z" and x.ndim >= 2 and x.shape[-1] != self.d_in:
      x = x.reshape(*x.shape[:-2], x.shape[-2] * x.shape[-1])
    return x

  def _prepare(self, x):
    x = self._flatten_in(x).astype(self.dtype)
    if x.shape[-1] != self.d_in:
      raise SAEError(
        f"the input's last axis has size {x.shape[-1]}, but this dictionary reads d_in={self.d_in}",
        code="sae_shape_mismatch",
        field="d_in",
        expected=str(self.d_in),
        received=str(x.shape[-1]),
        fix="splice it at a site whose last axis is d_in",
      )
    x, state = _runtime_norm(self.normalize_activations, x, self.d_in)
    if self.apply_b_dec_to_input:
      x = x - self.b_dec
    return x, state

  def _decoder_norm(self):
    return jnp.linalg.norm(self.W_dec, axis=-1)

  def hidden_pre(self, x):
    """``x @ W_enc + b_enc`` of the prepared input (SAELens's ``hook_sae_acts_pre``; a gated
    SAE's magnitude pre-activation ``x @ (W_enc * exp(r_mag)) + b_mag``)."""
    x, _ = self._prepare(x)
    if self.activation == "gated":
      return x @ (self.W_enc * jnp.exp(self.r_mag)) + self.b_mag
    return x @ self.W_enc + self.b_enc

  def activate(self, pre):
    """The activation function on pre-activations."""
    if self.activation == "relu":
      return jax.nn.relu(pre)
    if self.activation == "jumprelu":
      return jax.nn.relu(pre) * (pre > self.threshold).astype(pre.dtype)
    if self.activation == "gated":
      raise SAEError(
        "a gated SAE's activation needs its input (the gate): use encode(x)",
        code="sae_config_invalid",
        field="activation",
        fix="sae.encode(x)",
      )
    if self.rescale_acts_by_decoder_norm:
      pre = pre * self._decoder_norm()
    if self.activation == "topk":
      return topk_relu(pre, int(self.k))
    if self.activation == "abstopk":
      _, index = jax.lax.top_k(jnp.abs(pre), int(self.k))
      values = jnp.take_along_axis(pre, index, axis=-1)
      return jnp.put_along_axis(jnp.zeros_like(pre), index, values, axis=-1, inplace=False)
    return batch_topk_relu(pre, self.k)

  def encode(self, x):
    """The feature activations of ``x`` (``(..., d_in) -> (..., d_sae)``)."""
    if self.activation == "gated":
      x, _ = self._prepare(x)
      gate = (x @ self.W_enc + self.b_enc > 0).astype(x.dtype)
      return gate * jax.nn.relu(x @ (self.W_enc * jnp.exp(self.r_mag)) + self.b_mag)
    return self.activate(self.hidden_pre(x))

  def decode(self, acts, x=None):
    """The reconstruction from feature activations (``(..., d_sae) -> (..., d_out)``).

    Args:
      acts: feature activations.
      x: the input they were encoded from; needed only to undo a run-time
        normalisation (``constant_norm_rescale``, ``layer_norm``) or ``hook_z``.
    """
    if self.activation in ("topk", "batchtopk", "abstopk") and self.rescale_acts_by_decoder_norm:
      acts = acts / self._decoder_norm()
    out = acts.astype(self.dtype) @ self.W_dec + self.b_dec
    if self.normalize_activations in ("constant_norm_rescale", "layer_norm"):
      if x is None:
        raise SAEError(
          f"normalize_activations={self.normalize_activations!r} is undone per input: "
          "decode needs the input x",
          code="sae_decode_needs_input",
          field="normalize_activations",
          fix="sae.decode(acts, x)",
        )
      _, state = _runtime_norm(
        self.normalize_activations, self._flatten_in(x).astype(self.dtype), self.d_in
      )
      out = _undo_norm(state, out)
    if x is not None and jnp.ndim(x) > out.ndim:
      out = out.reshape(jnp.shape(x)[:-2] + (-1, jnp.shape(x)[-1]))
    return out

  def __call__(self, x):
    """The reconstruction ``decode(encode(x), x)``."""
    return self.decode(self.encode(x), x)

  def parts(self, x):
    """``(acts, reconstruction)`` of ``x`` in one pass."""
    acts = self.encode(x)
    return acts, self.decode(acts, x)

  def to_jumprelu(self, threshold):
    """A JumpReLU SAE with this one's weights and a (scalar or per-feature) threshold:
    what a BatchTopK SAE becomes for inference (as SAELens saves it). With
    ``rescale_acts_by_decoder_norm`` the decoder norms are folded into the encoder first
    (the threshold is in those units, as SAELens's)."""
    d = self
    if self.rescale_acts_by_decoder_norm:
      norm = self._decoder_norm()
      d = self.replace(
        W_enc=self.W_enc * norm, b_enc=self.b_enc * norm, W_dec=self.W_dec / norm[:, None]
      )
    return d.replace(
      activation="jumprelu",
      k=None,
      rescale_acts_by_decoder_norm=False,
      threshold=jnp.broadcast_to(jnp.asarray(threshold, self.dtype), (self.d_sae,)),
    )


jax.tree_util.register_pytree_node(SAE, SAE.tree_flatten, SAE.tree_unflatten)


@dataclasses.dataclass(frozen=True)
class Transcoder(SAE):
  """A transcoder: reads one site (``d_in``), writes another (``d_out``).

  ``__call__(x) = decode(encode(x)) + x @ W_skip.T`` (the skip term with ``W_skip``
  ``(d_out, d_in)``, SAELens's ``skip_transcoder``). ``b_dec`` has the output's width,
  so it is never subtracted from the input (``apply_b_dec_to_input=False``).
  """

  W_skip: Any = None
  apply_b_dec_to_input: bool = False

  _data = ("W_enc", "b_enc", "W_dec", "b_dec", "threshold", "W_skip")

  def __post_init__(self):
    if self.apply_b_dec_to_input:
      raise SAEError(
        "a transcoder's b_dec has the output's width: apply_b_dec_to_input must be False",
        code="sae_config_invalid",
        field="apply_b_dec_to_input",
        fix="apply_b_dec_to_input=False",
      )
    super().__post_init__()

  def _d_out(self, d_in):
    return int(np.shape(self.W_dec)[1]) if self.W_dec is not None else None

  def _extra_shapes(self, d_in, d_sae):
    return {"W_skip": (self._d_out(d_in), d_in)}

  def skip(self, x):
    """The skip term ``x @ W_skip.T`` (zeros without ``W_skip``)."""
    if self.W_skip is None:
      return None
    return self._flatten_in(x).astype(self.dtype) @ self.W_skip.T

  def decode(self, acts, x=None):
    # A transcoder's output lives in another space: as SAELens's, it does not undo the
    # input's run-time normalisation (decode(encode(norm(x)))).
    return acts.astype(self.dtype) @ self.W_dec + self.b_dec

  def __call__(self, x):
    out = self.decode(self.encode(x))
    skip = self.skip(x)
    return out if skip is None else out + skip

  def parts(self, x):
    acts = self.encode(x)
    out = self.decode(acts)
    skip = self.skip(x)
    return acts, (out if skip is None else out + skip)


jax.tree_util.register_pytree_node(Transcoder, Transcoder.tree_flatten, Transcoder.tree_unflatten)


@dataclasses.dataclass(frozen=True)
class CrossLayerTranscoder:
  """A cross-layer transcoder over ``L`` layers: layer ``l``'s encoder reads that layer's
  MLP input; its features write to the MLP output of every layer ``l' >= l``.

  ``out[l'] = b_dec[l'] + sum_{l <= l'} acts[l] @ W_dec[l][l' - l]``.

  Attributes:
    W_enc: ``(L, d_in, d_sae)``.
    b_enc: ``(L, d_sae)``.
    W_dec: a tuple of ``L`` arrays, ``W_dec[l]`` of shape ``(L - l, d_sae, d_out)``.
    b_dec: ``(L, d_out)``.
    threshold: ``(L, d_sae)`` for ``activation="jumprelu"``.
    activation, k: as for :class:`SAE` (``relu``, ``jumprelu``, ``topk``).
  """

  W_enc: Any
  b_enc: Any
  W_dec: tuple
  b_dec: Any
  threshold: Any = None
  activation: str = "relu"
  k: Any = None

  def __post_init__(self):
    _check_choice(self.activation, ACTIVATIONS[:3], "activation")
    n = int(np.shape(self.W_enc)[0])
    if not isinstance(self.W_dec, tuple) or len(self.W_dec) != n:
      raise SAEError(
        f"W_dec must be a tuple of {n} arrays (one per layer), got {type(self.W_dec).__name__}",
        code="sae_weights_invalid",
        field="W_dec",
        fix="W_dec=tuple(W_dec[l] of shape (L - l, d_sae, d_out) for l in range(L))",
      )
    for layer, w in enumerate(self.W_dec):
      if np.shape(w)[:2] != (n - layer, np.shape(self.W_enc)[2]):
        raise SAEError(
          f"W_dec[{layer}] has shape {np.shape(w)}, expected ({n - layer}, d_sae, d_out)",
          code="sae_weights_invalid",
          field=f"W_dec[{layer}]",
          fix="W_dec[l] of shape (L - l, d_sae, d_out)",
        )
    if self.activation == "jumprelu" and self.threshold is None:
      raise SAEError(
        "activation='jumprelu' needs threshold (L, d_sae)",
        code="sae_config_invalid",
        field="threshold",
        fix="threshold=jnp.zeros((L, d_sae))",
      )

  @property
  def n_layers(self) -> int:
    return int(np.shape(self.W_enc)[0])

  def replace(self, **changes):
    """A copy with some fields changed (``dataclasses.replace``)."""
    return dataclasses.replace(self, **changes)

  @classmethod
  def init(cls, key, n_layers, d_in, d_sae, d_out=None, *, dtype=jnp.float32, **config):
    d_out = d_in if d_out is None else d_out
    k1, k2 = jax.random.split(key)
    bound = math.sqrt(6.0 / d_in)
    w_enc = jax.random.uniform(k1, (n_layers, d_in, d_sae), jnp.float32, -bound, bound)
    w_dec = tuple(
      (
        jax.random.uniform(
          jax.random.fold_in(k2, layer), (n_layers - layer, d_sae, d_out), jnp.float32
        )
        - 0.5
      ).astype(dtype)
      * (0.1 / math.sqrt(d_sae))
      for layer in range(n_layers)
    )
    threshold = (
      jnp.zeros((n_layers, d_sae), dtype) if config.get("activation") == "jumprelu" else None
    )
    return cls(
      w_enc.astype(dtype),
      jnp.zeros((n_layers, d_sae), dtype),
      w_dec,
      jnp.zeros((n_layers, d_out), dtype),
      threshold,
      **config,
    )

  def tree_flatten(self):
    return (self.W_enc, self.b_enc, self.W_dec, self.b_dec, self.threshold), (
      self.activation,
      self.k,
    )

  @classmethod
  def tree_unflatten(cls, meta, children):
    obj = object.__new__(cls)
    for name, value in zip(("W_enc", "b_enc", "W_dec", "b_dec", "threshold"), children):
      object.__setattr__(obj, name, value)
    object.__setattr__(obj, "activation", meta[0])
    object.__setattr__(obj, "k", meta[1])
    return obj

  def layer(self, layer: int) -> Transcoder:
    """Layer ``layer``'s encoder with its decoder to its own layer, as a :class:`Transcoder`."""
    return Transcoder(
      W_enc=self.W_enc[layer],
      b_enc=self.b_enc[layer],
      W_dec=self.W_dec[layer][0],
      b_dec=self.b_dec[layer],
      threshold=None if self.threshold is None else self.threshold[layer],
      activation=self.activation,
      k=self.k,
    )

  def encode_layer(self, layer: int, x):
    """Layer ``layer``'s feature activations of its input ``x``."""
    pre = jnp.asarray(x).astype(self.W_enc.dtype) @ self.W_enc[layer] + self.b_enc[layer]
    if self.activation == "relu":
      return jax.nn.relu(pre)
    if self.activation == "jumprelu":
      return jax.nn.relu(pre) * (pre > self.threshold[layer]).astype(pre.dtype)
    return topk_relu(pre, int(self.k))

  def encode(self, xs):
    """``(L, ..., d_in) -> (L, ..., d_sae)``: every layer's features."""
    return jnp.stack([self.encode_layer(layer, xs[layer]) for layer in range(self.n_layers)])

  def decode_layer(self, layer: int, acts):
    """Layer ``layer``'s output from the features of layers ``0..layer`` (``acts[:layer+1]``)."""
    out = self.b_dec[layer]
    for source in range(layer + 1):
      out = out + acts[source] @ self.W_dec[source][layer - source]
    return out

  def decode(self, acts):
    """``(L, ..., d_sae) -> (L, ..., d_out)``."""
    return jnp.stack([self.decode_layer(layer, acts) for layer in range(self.n_layers)])

  def __call__(self, xs):
    return self.decode(self.encode(xs))


jax.tree_util.register_pytree_node(
  CrossLayerTranscoder, CrossLayerTranscoder.tree_flatten, CrossLayerTranscoder.tree_unflatten
)
