"""The trained interventions' configurations: each initialises its parameters and builds its edit.

A method is a small frozen dataclass holding what does not train (the interchanged
dimension, the rank, the temperature schedule). ``method.init(key, d)`` returns the
parameters, a dict of arrays (what optax trains and a checkpoint holds), and
``method.edit(params, source)`` the :class:`jaxlens.Edit` that applies them: the verbs
``jl.das``, ``jl.boundless_das``, ``jl.low_rank_das``, ``jl.loreft`` and ``jl.direft``.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxlens import intervention as trained
from jaxlens.core import InvalidArgumentError
from jaxlens.sae import SAE
from jaxlens.train import _edits


def init_rotation(key, d: int, k: int | None = None, dtype=jnp.float32) -> dict:
  """A rotation parameter ``{"raw", "base"}`` whose matrix starts as a random orthogonal one.

  As torch's ``parametrizations.orthogonal`` registered on a layer initialised with
  ``torch.nn.init.orthogonal_`` (pyvene's ``RotateLayer`` / ``LowRankRotateLayer``):
  ``base`` is a random orthogonal ``(d, d)`` matrix (for ``k < d``, ``k`` random
  orthonormal columns completed to a square one by QR) and ``raw`` is ``-I[:, :k]``, the
  point the map sends to ``base[:, :k]``.

  Args:
    key: a ``jax.random`` key.
    d: the feature size of the site.
    k: the number of columns (default ``d``: a full rotation).
    dtype: the parameters' dtype.
  """
  k = d if k is None else k
  for name, value in (("d", d), ("k", k)):
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
      raise InvalidArgumentError(
        f"init_rotation: {name} must be an int, got {value!r}",
        code="invalid_argument",
        fix="init_rotation(key, d=16, k=4)",
      )
  if not 0 < k <= d:
    raise InvalidArgumentError(
      f"a rotation of {k} columns in {d} features",
      code="invalid_argument",
      fix=f"0 < k <= d ({d})",
    )
  dtype = _float_dtype(dtype)
  # The QR runs in float32 at least (LAPACK has no bfloat16 or float16 QR), then is cast.
  wide = jnp.float64 if dtype == jnp.float64 else jnp.float32
  k1, k2 = jax.random.split(key)
  w = jax.nn.initializers.orthogonal()(k1, (d, k), wide)
  if k < d:
    full = jnp.concatenate([w, jax.random.normal(k2, (d, d - k), wide)], axis=1)
    q, r = jnp.linalg.qr(full)
    w = q * jnp.sign(jnp.diagonal(r))[None, :]
  return {"raw": -jnp.eye(d, k, dtype=dtype), "base": w.astype(dtype)}


def _float_dtype(dtype):
  """``dtype`` as a float dtype, or ``invalid_argument``."""
  try:
    dt = jnp.dtype(dtype)
  except TypeError:
    dt = None
  if dt is None or not jnp.issubdtype(dt, jnp.floating):
    raise InvalidArgumentError(
      f"the parameters' dtype must be a float dtype, got {dtype!r}",
      code="invalid_argument",
      fix="dtype=jnp.float32",
    )
  return dt


def _linear(key, d, k, dtype):
  """torch ``nn.Linear(d, k)``'s default init: U(-1/√d, 1/√d) for the weight and the bias."""
  if isinstance(d, bool) or not isinstance(d, (int, np.integer)) or d < 1:
    raise InvalidArgumentError(
      f"init: d (the site's feature count) must be a positive int, got {d!r}",
      code="invalid_argument",
      fix="method.init(key, d) with d the site's last dimension",
      received=repr(d),
    )
  kw, kb = jax.random.split(key)
  bound = 1.0 / jnp.sqrt(jnp.asarray(d, dtype))
  w = jax.random.uniform(kw, (k, d), dtype, -bound, bound)
  b = jax.random.uniform(kb, (k,), dtype, -bound, bound)
  return w, b


def _positive_rank(method, rank):
  """``rank`` a positive int, or ``invalid_argument`` naming the method."""
  if isinstance(rank, bool) or not isinstance(rank, (int, np.integer)) or rank < 1:
    raise InvalidArgumentError(
      f"{method}: rank must be a positive int, got {rank!r}",
      code="invalid_argument",
      fix=f"{method}(rank=4)",
    )


def _in_range(method, name, value, low, high, low_open=True):
  """``value`` a finite number in ``(low, high]`` (``[low, high]`` when not ``low_open``)."""
  ok = (
    not isinstance(value, bool)
    and isinstance(value, (int, float, np.integer, np.floating))
    and np.isfinite(value)
    and (value > low if low_open else value >= low)
    and (high is None or value <= high)
  )
  if not ok:
    span = f"({low}, {high}]" if high is not None else f"> {low}"
    raise InvalidArgumentError(
      f"{method}: {name}={value!r} must be a finite number {span}",
      code="invalid_argument",
      fix=f"{method}({name}=...) within {span}",
    )


@dataclasses.dataclass(frozen=True)
class DAS:
  """Distributed alignment search with a full learned rotation (:func:`jaxlens.das`).

  With ``subspaces`` (a ``(batch, d)`` 0/1 mask from :func:`subspace_mask`, which also reads
  pyvene's subspace partitions: several variables in one rotation), each example
  interchanges its own rotated coordinates instead of the first ``dim``.

  Attributes:
    dim: the number of rotated coordinates interchanged with the source.
  """

  dim: int
  needs_source = True

  def init(self, key, d: int, dtype=jnp.float32) -> dict:
    """``{"rotation": init_rotation(key, d)}``."""
    return {"rotation": init_rotation(key, d, None, dtype)}

  def edit(self, params, source, temperature=None, subspaces=None):
    del temperature
    if subspaces is not None:
      return _edits.rotated_interchange(params["rotation"], source, subspaces)
    return trained.das(params, source, dim=self.dim)


@dataclasses.dataclass(frozen=True)
class BoundlessDAS:
  """Boundless DAS (:func:`jaxlens.boundless_das`): a learned soft boundary.

  The temperature falls linearly from ``temperature_start`` to ``temperature_end``
  over training (pyvene's tutorial schedule, ``torch.linspace(50, 0.1, steps)``); the
  boundary starts at ``boundary`` (a fraction of the features). The defaults suit layers
  of thousands of features; on a few dozen, start near temperature 0.5 with a small
  boundary (examples/das_hierarchical_equality.py: 0.5 and 2.5 of 32 features).

  Attributes:
    temperature_start: the first step's temperature.
    temperature_end: the last step's.
    boundary: the initial boundary, in (0, 1].
  """

  temperature_start: float = 50.0
  temperature_end: float = 0.1
  boundary: float = 0.5
  needs_source = True

  def __post_init__(self):
    # A temperature <= 0 turns the boundary mask's sigmoid into NaN gradients; a boundary
    # outside (0, 1] is clipped to a constant mask that never trains.
    _in_range("BoundlessDAS", "temperature_start", self.temperature_start, 0.0, None)
    _in_range("BoundlessDAS", "temperature_end", self.temperature_end, 0.0, None)
    _in_range("BoundlessDAS", "boundary", self.boundary, 0.0, 1.0)

  def init(self, key, d: int, dtype=jnp.float32) -> dict:
    """``{"rotation": init_rotation(key, d), "boundary": [self.boundary]}``."""
    return {
      "rotation": init_rotation(key, d, None, dtype),
      "boundary": jnp.asarray([self.boundary], dtype),
    }

  def temperature(self, step, steps):
    """The schedule's temperature at ``step`` of ``steps``."""
    frac = step / max(steps - 1, 1)
    return self.temperature_start + (self.temperature_end - self.temperature_start) * frac

  def edit(self, params, source, temperature=None):
    t = self.temperature_end if temperature is None else temperature
    return trained.boundless_das(params, source, t)  # (refuses a concrete t <= 0)

  @staticmethod
  def size(params) -> float:
    """The learned subspace's size: ``clip(boundary, 1e-3, 1) * d`` coordinates."""
    d = params["rotation"]["raw"].shape[0]
    return float(jnp.clip(params["boundary"][0], 1e-3, 1.0) * d)


@dataclasses.dataclass(frozen=True)
class LowRankDAS:
  """DAS in the span of ``rank`` learned orthonormal columns (:func:`jaxlens.low_rank_das`)."""

  rank: int
  needs_source = True

  def __post_init__(self):
    _positive_rank("LowRankDAS", self.rank)

  def init(self, key, d: int, dtype=jnp.float32) -> dict:
    """``{"rotation": init_rotation(key, d, rank)}``."""
    return {"rotation": init_rotation(key, d, self.rank, dtype)}

  def edit(self, params, source, temperature=None, subspaces=None):
    """The edit; with ``subspaces`` (a ``(batch, rank)`` mask), per-example columns."""
    del temperature
    if subspaces is not None:
      return _edits.rotated_interchange(params["rotation"], source, subspaces)
    return trained.low_rank_das(params, source)


@dataclasses.dataclass(frozen=True)
class LoReFT:
  """Low-rank linear subspace representation fine-tuning (:func:`jaxlens.loreft`)."""

  rank: int
  needs_source = False

  def __post_init__(self):
    _positive_rank("LoReFT", self.rank)

  def init(self, key, d: int, dtype=jnp.float32) -> dict:
    """The rotation as in pyreft (orthogonal init) and ``W, b`` as torch's ``nn.Linear(d, rank)``."""
    dtype = _float_dtype(dtype)
    k1, k2 = jax.random.split(key)
    w, b = _linear(k2, d, self.rank, dtype)
    return {"rotation": init_rotation(k1, d, self.rank, dtype), "W": w, "b": b}

  def edit(self, params, source=None, temperature=None):
    del source, temperature
    return trained.loreft(params)


@dataclasses.dataclass(frozen=True)
class DiReFT:
  """DiReFT (:func:`jaxlens.direft`): ``h + W2ᵀ(W1 h + b)``, no orthogonality.

  With ``orthogonal=True``, pyreft's ``DireftIntervention``: ``h + (W1 h + b) Rᵀ`` with
  ``R`` a learned ``(d, rank)`` matrix of orthonormal columns (``params["rotation"]``,
  parametrised as LoReFT's) in place of ``W2``.

  Attributes:
    rank: the subspace's dimension.
    orthogonal: keep the write-back projection orthonormal (pyreft) or free (the paper).
  """

  rank: int
  orthogonal: bool = False
  needs_source = False

  def __post_init__(self):
    _positive_rank("DiReFT", self.rank)
    if not isinstance(self.orthogonal, bool):
      raise InvalidArgumentError(
        f"DiReFT: orthogonal must be a bool, got {self.orthogonal!r}",
        code="invalid_argument",
        fix="DiReFT(rank=4, orthogonal=True)",
      )

  def init(self, key, d: int, dtype=jnp.float32) -> dict:
    """``W1, b`` as torch's ``nn.Linear(d, rank)``; ``W2`` (or the rotation) starts with
    orthonormal rows (columns)."""
    dtype = _float_dtype(dtype)
    k1, k2 = jax.random.split(key)
    w1, b = _linear(k2, d, self.rank, dtype)
    if self.orthogonal:
      return {"rotation": init_rotation(k1, d, self.rank, dtype), "W1": w1, "b": b}
    wide = jnp.float64 if dtype == jnp.float64 else jnp.float32  # (LAPACK: no bfloat16 QR)
    w2 = jax.nn.initializers.orthogonal()(k1, (d, self.rank), wide).T.astype(dtype)
    return {"W1": w1, "b": b, "W2": w2}

  def edit(self, params, source=None, temperature=None):
    del source, temperature
    if self.orthogonal:
      return _edits.direft_orthogonal(params)
    return trained.direft(params)


def frozen_leaves(params):
  """A pytree of booleans, True at the leaves no optimiser should move: rotation bases, and
  a dictionary in the parameters (:class:`SAEInterchange` carries its
  :class:`jaxlens.sae.SAE` there: an argument of the step, not a constant XLA would fold)."""

  def mark(path, value):
    if isinstance(value, SAE):
      return jax.tree.map(lambda _: True, value)
    last = path[-1] if path else None
    return getattr(last, "key", None) == "base"

  return jax.tree_util.tree_map_with_path(mark, params, is_leaf=lambda v: isinstance(v, SAE))
