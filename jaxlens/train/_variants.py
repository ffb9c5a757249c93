"""More methods: pyvene's sigmoid masks, PCA and SAE interchanges; pyreft's ReFT variants.

Each is a frozen dataclass with the methods' protocol (``needs_source``, ``init(key, d)``,
``edit(params, source, temperature=None)``), so :func:`train_iit`, :func:`train_reft`,
:func:`iia` and :func:`train_interchange` take them as they take ``DAS``. The interchange
methods also take ``subspaces=`` (a per-example mask, :func:`subspace_mask`) where pyvene
does.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxlens.core import InvalidArgumentError
from jaxlens.train import _edits
from jaxlens.train._methods import (
  _float_dtype,
  _in_range,
  _linear,
  _positive_rank,
  init_rotation,
)


@dataclasses.dataclass(frozen=True)
class _Annealed:
  """A temperature falling linearly from ``temperature_start`` to ``temperature_end``."""

  temperature_start: float
  temperature_end: float

  def _check(self, name):
    _in_range(name, "temperature_start", self.temperature_start, 0.0, None)
    _in_range(name, "temperature_end", self.temperature_end, 0.0, None)

  def temperature(self, step, steps):
    """The schedule's temperature at ``step`` of ``steps``."""
    frac = step / max(steps - 1, 1)
    return self.temperature_start + (self.temperature_end - self.temperature_start) * frac

  def _at(self, temperature):
    t = self.temperature_end if temperature is None else temperature
    if not isinstance(t, jax.core.Tracer):
      _in_range(type(self).__name__, "temperature", float(np.asarray(t)), 0.0, None)
    return t


@dataclasses.dataclass(frozen=True)
class SigmoidMask(_Annealed):
  """A learned mask over the site's features (pyvene's ``SigmoidMaskIntervention``).

  Writes ``(1 - m) x + m s`` with ``m = σ(mask / T)``: where the mask is high the feature
  comes from the source. ``mask`` starts at 0 (``m = 0.5``), as in pyvene; pyvene's fixed
  temperature is 0.01, the default here at both ends of the schedule.

  Attributes:
    temperature_start, temperature_end: the temperature schedule (both > 0).
  """

  temperature_start: float = 0.01
  temperature_end: float = 0.01
  needs_source = True

  def __post_init__(self):
    self._check("SigmoidMask")

  def init(self, key, d: int, dtype=jnp.float32) -> dict:
    """``{"mask": zeros(d)}``."""
    del key
    return {"mask": jnp.zeros((d,), _float_dtype(dtype))}

  def edit(self, params, source, temperature=None):
    return _edits.sigmoid_mask_interchange(params["mask"], source, self._at(temperature))

  @staticmethod
  def selected(params, temperature) -> jax.Array:
    """The mask's values ``σ(mask / T)``."""
    return jax.nn.sigmoid(params["mask"] / temperature)


@dataclasses.dataclass(frozen=True)
class SigmoidMaskDAS(_Annealed):
  """A learned mask over a learned rotation's coordinates
  (pyvene's ``SigmoidMaskRotatedSpaceIntervention``).

  Writes ``((1 - m) xR + m sR) Rᵀ`` with ``m = σ(masks / T)``; ``masks`` start at 100
  and the temperature at 50, as in pyvene (every coordinate nearly fully interchanged). A
  sparsity penalty on ``m`` (``train_iit(..., mask_weight=)``... or your own loss) shrinks it
  to the variable's coordinates.

  Attributes:
    temperature_start, temperature_end: the temperature schedule (both > 0).
  """

  temperature_start: float = 50.0
  temperature_end: float = 0.1
  needs_source = True

  def __post_init__(self):
    self._check("SigmoidMaskDAS")

  def init(self, key, d: int, dtype=jnp.float32) -> dict:
    """``{"rotation": init_rotation(key, d), "masks": 100 * ones(d)}``."""
    dtype = _float_dtype(dtype)
    return {"rotation": init_rotation(key, d, None, dtype), "masks": jnp.full((d,), 100.0, dtype)}

  def edit(self, params, source, temperature=None):
    return _edits.sigmoid_mask_interchange(
      params["masks"], source, self._at(temperature), params["rotation"]
    )


def pca_basis(activations, k: int, dtype=None) -> dict:
  """The standardised PCA basis of ``activations`` for :class:`PCAInterchange`.

  ``mean`` and ``std`` are per feature (over every leading axis); ``components`` are the
  top ``k`` right singular vectors of the standardised activations (rows, as scikit-learn's
  ``PCA(k).fit(...).components_`` up to each row's sign), which pyvene's
  ``PCARotatedSpaceIntervention`` takes with the mean and std.

  Args:
    activations: ``(..., d)`` site values.
    k: the number of components (``1 <= k <= d``).
    dtype: the basis's dtype (default the activations').
  """
  a = jnp.asarray(activations)
  a = a.reshape(-1, a.shape[-1])
  if dtype is not None:
    a = a.astype(_float_dtype(dtype))
  d = a.shape[-1]
  if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or not 1 <= k <= d:
    raise InvalidArgumentError(
      f"pca_basis: k={k!r} components of {d} features",
      code="invalid_argument",
      fix=f"1 <= k <= {d}",
    )
  mean = a.mean(0)
  std = a.std(0)
  z = (a - mean) / jnp.where(std > 0, std, 1.0)
  _, _, vt = jnp.linalg.svd(z - z.mean(0), full_matrices=False)
  return {"components": vt[:k], "mean": mean, "std": jnp.where(std > 0, std, 1.0)}


@dataclasses.dataclass(frozen=True)
class PCAInterchange:
  """Interchange in a fixed PCA basis (pyvene's ``PCARotatedSpaceIntervention``).

  ``params`` is :func:`pca_basis`'s dict; the first ``dim`` components come from the
  source (or, with ``subspaces``, each example's). Nothing trains: it is a baseline for
  :func:`iia` beside DAS.

  Attributes:
    dim: the number of interchanged components.
  """

  dim: int
  needs_source = True

  def __post_init__(self):
    _positive_rank("PCAInterchange", self.dim)

  def edit(self, params, source, temperature=None, subspaces=None):
    del temperature
    k = params["components"].shape[0]
    if subspaces is None:
      if self.dim > k:
        raise InvalidArgumentError(
          f"PCAInterchange: dim={self.dim} of a basis of {k} components",
          code="invalid_argument",
          fix=f"dim <= {k}",
        )
      subspaces = (jnp.arange(k) < self.dim).astype(params["components"].dtype)
    return _edits.pca_interchange(params, source, subspaces)


@dataclasses.dataclass(frozen=True, eq=False)
class SAEInterchange:
  """Interchange in a dictionary's features (a :class:`jaxlens.sae.SAE`).

  Writes ``decode(f_x + m ⊙ (f_s - f_x))`` with ``f = sae.encode(.)`` and ``m`` over the
  dictionary's features: ``features`` (fixed), a learned ``σ(mask / T)``
  (``learn_mask=True``: trained by :func:`train_iit`, it finds the features that carry a
  variable), or each example's ``subspaces``. pyvene's
  ``JumpReLUAutoencoderIntervention`` writes the reconstruction (``keep_error=False``);
  ``keep_error=True`` adds the site's reconstruction error back, so with no feature
  interchanged the site is unchanged.

  Attributes:
    sae: the dictionary (its arrays are constants here, not trained).
    features: the interchanged features' indices (when the mask is not learned).
    learn_mask: learn a sigmoid mask over the features.
    keep_error: add ``x - decode(f_x)`` back.
    mask_temperature: the learned mask's temperature (> 0).
  """

  sae: Any
  features: tuple = ()
  learn_mask: bool = False
  keep_error: bool = False
  mask_temperature: float = 1.0
  needs_source = True

  def __post_init__(self):
    _in_range("SAEInterchange", "mask_temperature", self.mask_temperature, 0.0, None)
    n = self.sae.W_enc.shape[1]
    bad = [f for f in self.features if not isinstance(f, (int, np.integer)) or not 0 <= f < n]
    if bad:
      raise InvalidArgumentError(
        f"SAEInterchange: features {bad} are not indices of the dictionary's {n} features",
        code="invalid_argument",
        fix=f"features=(0, 5) within [0, {n})",
      )

  def init(self, key, d: int, dtype=jnp.float32) -> dict:
    """``{"sae": the dictionary}``, with ``"mask": zeros(d_sae)`` when the mask is learned.

    The dictionary rides in the parameters so the training step takes it as an argument
    (a closure constant would be folded into the compiled program); :func:`frozen_leaves`
    marks it, so no optimiser moves it."""
    del key
    if d != self.sae.W_enc.shape[0]:
      raise InvalidArgumentError(
        f"SAEInterchange: a site of {d} features for a dictionary of d_in "
        f"{self.sae.W_enc.shape[0]}",
        code="shape_mismatch",
        fix="the dictionary trained on this site",
      )
    if self.learn_mask:
      return {"sae": self.sae, "mask": jnp.zeros((self.sae.W_enc.shape[1],), _float_dtype(dtype))}
    return {"sae": self.sae}

  def edit(self, params, source, temperature=None, subspaces=None):
    del temperature
    n = self.sae.W_enc.shape[1]
    dtype = jnp.asarray(self.sae.W_enc).dtype
    if subspaces is not None:
      mask = subspaces
    elif self.learn_mask:
      mask = jax.nn.sigmoid(params["mask"].astype(dtype) / self.mask_temperature)
    else:
      mask = jnp.zeros((n,), dtype).at[jnp.asarray(self.features, jnp.int32)].set(1.0)
    sae = params.get("sae", self.sae) if isinstance(params, dict) else self.sae
    return _edits.sae_interchange(sae, source, mask, keep_error=self.keep_error)


@dataclasses.dataclass(frozen=True)
class NoReFT:
  """pyreft's NoReFT: ``h + (W h + b - P h) P``, LoReFT with a free (not orthonormal) ``P``.

  Attributes:
    rank: the subspace's dimension.
    bias: give ``P`` a bias ``c`` (pyreft's ``add_bias``): ``h + (W h + b - P h - c) P``.
  """

  rank: int
  bias: bool = False
  needs_source = False

  def __post_init__(self):
    _positive_rank("NoReFT", self.rank)

  def init(self, key, d: int, dtype=jnp.float32) -> dict:
    """``P`` (and ``c``) and ``W, b`` as torch's ``nn.Linear(d, rank)``."""
    dtype = _float_dtype(dtype)
    k1, k2 = jax.random.split(key)
    p, c = _linear(k1, d, self.rank, dtype)
    w, b = _linear(k2, d, self.rank, dtype)
    return {"P": p, "W": w, "b": b, **({"c": c} if self.bias else {})}

  def edit(self, params, source=None, temperature=None):
    del source, temperature
    return _edits.noreft(params)


@dataclasses.dataclass(frozen=True)
class ConsReFT:
  """pyreft's ConsReFT: ``h + Rᵀ(b - R h)``: the subspace's coordinates set to a learned
  constant ``b`` (``R`` orthonormal, as LoReFT's)."""

  rank: int
  needs_source = False

  def __post_init__(self):
    _positive_rank("ConsReFT", self.rank)

  def init(self, key, d: int, dtype=jnp.float32) -> dict:
    """The rotation as LoReFT's; ``b`` uniform in [0, 1) (torch.rand, as pyreft)."""
    dtype = _float_dtype(dtype)
    k1, k2 = jax.random.split(key)
    return {
      "rotation": init_rotation(k1, d, self.rank, dtype),
      "b": jax.random.uniform(k2, (self.rank,), dtype),
    }

  def edit(self, params, source=None, temperature=None):
    del source, temperature
    return _edits.consreft(params)


@dataclasses.dataclass(frozen=True)
class LoBiReFT(ConsReFT):
  """pyreft's LoBiReFT: ``h + Rᵀ b``: a learned bias in a learned orthonormal subspace."""

  def __post_init__(self):
    _positive_rank("LoBiReFT", self.rank)

  def edit(self, params, source=None, temperature=None):
    del source, temperature
    return _edits.lobireft(params)
