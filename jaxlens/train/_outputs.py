"""The model's output at a few positions of each row: a loss on the answer tokens only.

ReFT's loss reads the logits at the positions whose label counts (the answer's; pyreft
masks the prompt's with -100), yet a plain forward computes the last block and the
unembedding at every position. On a causal decoder (:class:`jaxlens.protocol.Decoder`)
whose intervened sites all lie before its last block, :func:`output_at` runs the model with
the edits live only up to the last block's input and its keys and values (at every
position: the later positions attend to them), then runs the last block at the asked
positions alone (:meth:`~jaxlens.protocol.Decoder.run_block`, its queries at those
positions, the keys and values of the whole row as the past) and unembeds those. The rest
of the last block and of the unembedding is dead code in a jitted program. Any other model
or site gets the whole output, gathered at the positions: the same values.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxlens.core import InvalidArgumentError, ShapeError, trace
from jaxlens.core import label as site_label
from jaxlens.protocol import Decoder


def check_positions(output_positions, inputs) -> jax.Array:
  """``output_positions`` as a ``(batch, k)`` int array fitting ``inputs`` ``(batch, seq, ...)``;
  concrete values are checked to lie in ``[0, seq)``."""
  pos = jnp.asarray(output_positions)
  shape = np.shape(inputs)
  if (
    not jnp.issubdtype(pos.dtype, jnp.integer)
    or pos.ndim != 2
    or len(shape) < 2
    or pos.shape[0] != shape[0]
  ):
    raise ShapeError(
      f"output_positions must be a (batch, k) int array of positions along the inputs' axis "
      f"1 (inputs {tuple(shape)}), got {pos.dtype} of shape {pos.shape}",
      code="shape_mismatch",
      fix="output_positions = np.nonzero(weights) per row, padded to one width",
      expected=f"(batch={shape[0] if shape else '?'}, k) int",
      received=list(pos.shape),
    )
  if not isinstance(output_positions, jax.core.Tracer) and pos.size:
    # Read on the host: under jax.jit a jnp reduction of even a concrete array is traced.
    host = np.asarray(output_positions)
    low, high = int(host.min()), int(host.max())
    if low < 0 or high >= shape[1]:
      raise InvalidArgumentError(
        f"output_positions must lie in [0, {shape[1]}) (the inputs' length), got values "
        f"from {low} to {high}",
        code="index_out_of_range",
        fix="positions of the inputs' tokens (pad a row's list with one of its own)",
        received=[low, high],
      )
  return pos.astype(jnp.int32)


def gather_rows(values, positions):
  """``values[b, positions[b, j]]``: ``(batch, seq, ...)`` at ``(batch, k)`` positions."""
  index = positions.reshape(positions.shape + (1,) * (values.ndim - 2))
  return jnp.take_along_axis(values, index, axis=1)


def _last_block(model, sites) -> int | None:
  """The last block's index when ``model`` is an unscanned decoder and every site is a label
  inside an earlier block; None otherwise (the whole output is computed)."""
  if not isinstance(model, Decoder):
    return None
  if getattr(getattr(model, "config", None), "scan_layers", False):
    return None
  try:
    last = len(model.layer_sites()) - 1
    prefixes = [model.block_site(j, "") for j in range(last)]
  except Exception:  # noqa: BLE001 (a decoder whose sites are not named per block)
    return None
  if last < 1 or not all(isinstance(s, str) and s.startswith(tuple(prefixes)) for s in sites):
    return None
  return last


def output_at(model, variables, spec, inputs, positions, sites):
  """``spec.bind(model)(variables, inputs)`` at ``positions`` (``(batch, k)`` ints, checked by
  :func:`check_positions`): ``(batch, k, ...)``. ``sites`` are the sites ``spec`` edits (the
  labels decide whether the last block can run at the positions alone)."""
  last = _last_block(model, sites)
  if last is None:
    return gather_rows(spec.bind(model)(variables, inputs), positions)
  names = [model.block_site(last, n) for n in ("resid_pre", "attn/k", "attn/v")]
  t = trace(
    model,
    variables,
    inputs,
    intervene=spec,
    save=[site_label(n) for n in names],
    keep_inputs=False,
  )
  if not all(n in t.labels for n in names):  # sites named otherwise: the whole output
    return gather_rows(t.output, positions)
  x, keys, values = (t[n].out for n in names)
  batch, k = positions.shape
  seq = keys.shape[1]
  # A query at position p sees the row's keys at 0..p (all of them are the past); the keys
  # run_block computes again for the queries themselves are masked out (already in the past).
  past = jnp.arange(seq, dtype=positions.dtype)[None, None, :] <= positions[:, :, None]
  mask = jnp.concatenate([past, jnp.zeros((batch, k, k), bool)], axis=-1)[:, None]
  out = model.run_block(
    variables,
    last,
    gather_rows(x, positions),
    positions,
    past_keys=keys,
    past_values=values,
    mask=mask,
  )
  return model.unembed(variables, out)


def answer_positions(weights) -> tuple[np.ndarray, np.ndarray] | None:
  """Each row's positions of nonzero weight, padded to the rows' widest count ``k`` with the
  row's last such position, and a ``(rows, k)`` bool mask of the real ones (the padding's
  weight is 0); None when some row counts every position (nothing to save)."""
  counted = np.asarray(weights) != 0
  k = int(counted.sum(axis=1).max()) if counted.size else 0
  if k == 0 or k >= counted.shape[1]:
    return None
  rows, real = [], []
  for row in counted:
    idx = np.nonzero(row)[0]
    fill = idx[-1] if idx.size else 0
    rows.append(np.concatenate([idx, np.full(k - idx.size, fill, idx.dtype)]))
    real.append(np.arange(k) < idx.size)
  return np.stack(rows).astype(np.int32), np.stack(real)
