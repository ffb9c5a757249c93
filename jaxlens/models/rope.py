"""Rotary position embeddings and their scalings, as Hugging Face transformers computes them.

A :class:`Rope` holds everything that sets a layer's rotation: the base, how many features of
each head rotate, and the scaling of the frequencies (``rope_type`` of a ``config.json``):

* ``"default"``: ``inv_freq[i] = base ** (-2 i / dim)``;
* ``"linear"``: every frequency divided by ``factor`` (position interpolation);
* ``"dynamic"``: NTK-aware: past ``original_max_len`` positions the base grows with the
  sequence length (the length is the largest position + 1, so a KV-cache step sees the same
  frequencies as transformers' stateful update for increasing positions);
* ``"yarn"``: interpolation below a ramp of wavelengths, extrapolation above, and the cosines
  and sines multiplied by an attention factor;
* ``"llama3"``: Llama 3.1's piecewise scaling by wavelength (``low_freq_factor``,
  ``high_freq_factor``);
* ``"longrope"``: per-frequency ``short_factor`` / ``long_factor`` (Phi-3), the long ones past
  ``original_max_len`` positions, and an attention factor.

The frequencies are computed in float64 with numpy when the model is built (transformers
computes them in float32), so a float64 model is exact; :func:`rotary` applies them.

Example:
  >>> import numpy as np
  >>> from jaxlens.models.rope import Rope
  >>> r = Rope(base=10000.0, kind="linear", factor=4.0)
  >>> bool(np.allclose(r.inv_freq(8) * 4, Rope(base=10000.0).inv_freq(8)))
  True
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax.numpy as jnp
import numpy as np

from jaxlens.models._layers import softmax_dtype

__all__ = ["KINDS", "Rope", "rotary"]

# The scalings implemented, as a config.json's ``rope_type`` spells them.
KINDS = ("default", "linear", "dynamic", "yarn", "llama3", "longrope")


@dataclasses.dataclass(frozen=True)
class Rope:
  """One layer's rotary embedding.

  Attributes:
    base: the rotary base (``rope_theta``).
    kind: the scaling, one of :data:`KINDS`.
    factor: the scaling factor (linear, dynamic, yarn, llama3; longrope's default attention
      factor).
    original_max_len: the pretraining context (``original_max_position_embeddings``; for
      ``dynamic``, the model's ``max_position_embeddings``).
    low_freq_factor, high_freq_factor: llama3's wavelength bounds.
    beta_fast, beta_slow, truncate: yarn's ramp.
    attention_factor: yarn's and longrope's multiplier of the cosines and sines (None: the
      default transformers derives from ``factor``); ``mscale``, ``mscale_all_dim``: yarn's
      alternative derivation.
    short_factor, long_factor: longrope's per-frequency factors.
    fraction: the fraction of each head's features that rotate (``partial_rotary_factor``).
  """

  base: float = 10000.0
  kind: str = "default"
  factor: float | None = None
  original_max_len: int | None = None
  low_freq_factor: float = 1.0
  high_freq_factor: float = 4.0
  beta_fast: float = 32.0
  beta_slow: float = 1.0
  truncate: bool = True
  attention_factor: float | None = None
  mscale: float | None = None
  mscale_all_dim: float | None = None
  short_factor: tuple[float, ...] | None = None
  long_factor: tuple[float, ...] | None = None
  fraction: float = 1.0

  def dims(self, head_dim: int) -> int:
    """How many features of a head of ``head_dim`` rotate."""
    return int(head_dim * self.fraction)

  def inv_freq(self, dim: int, long: bool = False) -> np.ndarray:
    """The float64 inverse frequencies of ``dim`` rotated features (``dim / 2`` of them);
    ``long``: longrope's long factors."""
    exponent = np.arange(0, dim, 2, dtype=np.float64) / dim
    inv = 1.0 / self.base**exponent
    if self.kind == "linear":
      return inv / self.factor
    if self.kind == "llama3":
      old = self.original_max_len
      low_wave, high_wave = old / self.low_freq_factor, old / self.high_freq_factor
      wave = 2 * math.pi / inv
      scaled = np.where(wave > low_wave, inv / self.factor, inv)
      smooth = (old / wave - self.low_freq_factor) / (self.high_freq_factor - self.low_freq_factor)
      smoothed = (1 - smooth) * scaled / self.factor + smooth * scaled
      medium = ~(wave < high_wave) & ~(wave > low_wave)
      return np.where(medium, smoothed, scaled)
    if self.kind == "yarn":
      return self._yarn(dim, exponent)
    if self.kind == "longrope":
      factors = self.long_factor if long else self.short_factor
      return inv / np.asarray(factors, np.float64)
    return inv

  def _yarn(self, dim: int, exponent) -> np.ndarray:
    pos_freqs = self.base**exponent
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (self.factor * pos_freqs)

    def correction_dim(rotations):
      return (dim * math.log(self.original_max_len / (rotations * 2 * math.pi))) / (
        2 * math.log(self.base)
      )

    low, high = correction_dim(self.beta_fast), correction_dim(self.beta_slow)
    if self.truncate:
      low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
      high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0, 1)
    keep = 1 - ramp  # the share of extrapolation
    return interpolation * (1 - keep) + extrapolation * keep

  def scale(self) -> float:
    """The factor of the cosines and sines (yarn's and longrope's attention factor; 1
    otherwise)."""
    if self.kind == "yarn":
      if self.attention_factor is not None:
        return float(self.attention_factor)

      def mscale(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

      if self.mscale and self.mscale_all_dim:
        return mscale(self.factor, self.mscale) / mscale(self.factor, self.mscale_all_dim)
      return mscale(self.factor)
    if self.kind == "longrope":
      if self.attention_factor is not None:
        return float(self.attention_factor)
      if self.factor is None or self.factor <= 1.0:
        return 1.0
      return math.sqrt(1 + math.log(self.factor) / math.log(self.original_max_len))
    return 1.0


def _angles(rope: Rope, positions, dim: int, adt):
  """``positions[..., None] * inv_freq`` in ``adt`` (at least float32), ``(b, seq, dim / 2)``."""
  pos = jnp.atleast_2d(positions).astype(adt)[..., None]
  if rope.kind == "dynamic":
    # The base grows with the sequence length once it passes the original context.
    seq = jnp.maximum(jnp.max(positions) + 1, rope.original_max_len).astype(adt)
    factor, original = jnp.asarray(rope.factor, adt), jnp.asarray(rope.original_max_len, adt)
    base = rope.base * ((factor * seq / original) - (factor - 1)) ** (dim / (dim - 2))
    exponent = jnp.asarray(np.arange(0, dim, 2, dtype=np.float64) / dim, adt)
    return pos * (1.0 / base**exponent)
  if rope.kind == "longrope":
    long = jnp.max(positions) + 1 > rope.original_max_len
    inv = jnp.where(
      long,
      jnp.asarray(rope.inv_freq(dim, long=True), adt),
      jnp.asarray(rope.inv_freq(dim), adt),
    )
    return pos * inv
  return pos * jnp.asarray(rope.inv_freq(dim), adt)


def rotary(x, positions, rope: Rope | float, dims: int | None = None):
  """Rotates ``x`` (``(batch, seq, heads, head_dim)``) by its positions (``(seq,)`` or
  ``(batch, seq)``), "rotate half" style, as Hugging Face checkpoints expect.

  Args:
    x: the queries or keys.
    positions: int positions.
    rope: a :class:`Rope`, or a bare rotary base (the default scaling).
    dims: rotate only the first ``dims`` features of each head (partial rotary; default:
      ``rope.dims(head_dim)``); the rest pass through.

  The angles are computed in at least float32 (float64 for a float64 model).
  """
  if not isinstance(rope, Rope):
    rope = Rope(base=float(rope))
  dims = rope.dims(x.shape[-1]) if dims is None else dims
  if dims < x.shape[-1]:
    return jnp.concatenate([_rotate(x[..., :dims], positions, rope), x[..., dims:]], axis=-1)
  return _rotate(x, positions, rope)


def _rotate(x, positions, rope: Rope) -> Any:
  dim = x.shape[-1]
  adt = softmax_dtype(x.dtype)
  angles = _angles(rope, positions, dim, adt)
  angles = jnp.concatenate([angles, angles], axis=-1)[:, :, None, :]  # (b, seq, 1, dim)
  scale = rope.scale()
  cos, sin = jnp.cos(angles), jnp.sin(angles)
  if scale != 1.0:
    cos, sin = cos * scale, sin * scale
  cos, sin = cos.astype(x.dtype), sin.astype(x.dtype)
  x1, x2 = x[..., : dim // 2], x[..., dim // 2 :]
  return x * cos + jnp.concatenate([-x2, x1], axis=-1) * sin
