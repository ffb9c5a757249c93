"""Causal-cone patching sweeps: each cell recomputes only what its patch can reach.

In a causal decoder, patching the residual stream of layer ``k`` at position ``p`` changes
nothing at positions before ``p``, and nothing in layers up to ``k``. The cell ``(k, p)`` of a
sweep therefore needs only layers after ``k`` at positions ``p ..`` (the cone); everything else,
the earlier positions' keys and values included, is the corrupt run's.

:func:`cone_sweep` computes the whole grid in one jitted call with that arithmetic and no more:

* the corrupt run is computed once (its residual stream, keys and values, and logits) and the
  clean run once (the patched sites);
* the cells of one layer are *packed*: for the positions ``p_1 .. p_n`` the packed sequence
  holds positions ``p_1 .. S-1``, then ``p_2 .. S-1``, ... (``sum(S - p_j)`` tokens), and one
  attention mask lets each packed token see the corrupt keys before its cell's position and its
  own cell's keys up to itself;
* the rows (layers) run one after another (``lax.map``), each row's blocks in a ``lax`` loop
  that starts at its own layer (``jaxlens.sweep._blocks``): on a model with a scanned form
  (:class:`jaxlens.protocol.Scannable`: ``Llama``, ``GPT2``, converted inside the call when
  given unrolled) the compiled program holds one block whatever the depth, and its first call
  costs little more than its second.

A cell at layer ``k`` thus costs ``(L - 1 - k) * (S - p)`` token-layers, where a sweep that
replays the patched site's downstream cone (:func:`jaxlens.sweep.patching_sweep`) spends
``(L - 1 - k) * S``; on 16 positions that is 136 token-layers per layer instead of 256.
Results equal :func:`jaxlens.sweep.patching_sweep` on the sites ``blocks_{k}/resid_pre`` (both
sweeps' default) or ``blocks_{k}/resid_post``, up to float rounding.

The sweep asks the model through :class:`jaxlens.protocol.Decoder`: its sites
(``block_site``), and how to run one block after a given past (``run_block``) and to turn the
last residual stream into logits (``unembed``); a decoder without a scanned form (Gemma 3's
mixed layers, GPT-NeoX) runs the same rows with a gated copy of each block.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxlens.core import InvalidArgumentError, ShapeError
from jaxlens.internal import api_boundary
from jaxlens.protocol import Decoder
from jaxlens.sweep._blocks import Runs
from jaxlens.sweep._patching import check_batch_size, check_metric

__all__ = ["cone_sweep"]

_SITES = ("resid_post", "resid_pre")


def _check_decoder(model) -> None:
  if not isinstance(model, Decoder):
    raise InvalidArgumentError(
      f"cone_sweep runs causal decoders that can run one block on its own "
      f"(jaxlens.protocol.Decoder: the zoo's Llama, GPT2), got {type(model).__name__}",
      code="invalid_argument",
      fix="jl.sweep.patching_sweep(...) for other models",
    )


def _layout(positions, seq):
  """The packed cells: per packed token its cell's position and its own; the mask; and, per
  cell, where its tokens start in the packed sequence."""
  cell_pos, tok_pos, starts = [], [], []
  for p in positions:
    starts.append(len(tok_pos))
    cell_pos += [p] * (seq - p)
    tok_pos += list(range(p, seq))
  cell_pos, tok_pos = np.asarray(cell_pos), np.asarray(tok_pos)
  corrupt_keys = np.arange(seq)[None, :] < cell_pos[:, None]
  cell_ids = np.repeat(np.arange(len(positions)), [seq - p for p in positions])
  packed_keys = (cell_ids[None, :] == cell_ids[:, None]) & (tok_pos[None, :] <= tok_pos[:, None])
  mask = np.concatenate([corrupt_keys, packed_keys], axis=1)[None, None]
  # Full logits of the cell at positions[j]: column q < p from the corrupt run, column q >= p
  # from the packed tokens (index seq + starts[j] + q - p of [corrupt | packed]).
  gather = np.asarray(
    [[q if q < p else seq + s + q - p for q in range(seq)] for p, s in zip(positions, starts)]
  )
  return cell_pos, tok_pos, mask, gather


@functools.partial(
  jax.jit, static_argnames=("model", "metric", "layers", "positions", "site", "batch_size")
)
def _cone(model, variables, clean, corrupt, *, metric, layers, positions, site, batch_size):
  seq = corrupt.shape[1]
  cell_pos, tok_pos, mask, gather = _layout(positions, seq)
  runs = Runs(model, variables, clean, corrupt)
  first = jnp.asarray(tok_pos == cell_pos)[None, :, None]  # the patched token of each cell
  mask, gather = jnp.asarray(mask), jnp.asarray(gather)
  packed_positions = jnp.asarray(tok_pos)[None]

  def row(start):
    # The packed tokens of the row's cells: the corrupt stream entering block `start`, the
    # patched position of each cell from the clean run; then blocks start .. L-1 on them.
    x = jnp.where(first, runs.donor[start][:, tok_pos], runs.stream[start][:, tok_pos])
    x = runs.run_from(start, x, packed_positions, mask, past=seq)
    both = jnp.concatenate([runs.logits, runs.unembed(x)], axis=1)
    full = jnp.take(both, gather, axis=1)  # (batch, positions, seq, vocab)
    one = metric(full[:, 0])  # (traced and unused: a str or None is refused here, not by vmap)
    values = jax.vmap(metric, in_axes=1)(full) if isinstance(one, (jax.Array, float)) else one
    if not isinstance(values, jax.Array):
      raise ShapeError(
        f"cone_sweep: metric returned a {type(values).__name__}, expected a scalar array",
        code="metric_not_scalar",
        fix="return one number: e.g. logits[:, -1, 0].mean()",
      )
    if values.shape != (len(positions),):
      raise ShapeError(
        f"cone_sweep: metric returned shape {values.shape[1:]}, expected a scalar",
        code="metric_not_scalar",
        fix="reduce the metric over the batch: .mean()",
      )
    return values

  starts = np.asarray([k + (site == "resid_post") for k in layers], np.int32)
  # Rows in order of their layer, batch_size at a time: a batch of rows runs from its lowest
  # layer, the rows above it gated, so neighbouring layers waste the fewest blocks.
  order = np.argsort(starts, kind="stable")
  size = None if batch_size == 1 else batch_size or len(layers)
  grid = jax.lax.map(row, jnp.asarray(starts[order]), batch_size=size)
  return grid[np.argsort(order)]


@api_boundary
def cone_sweep(
  model,
  variables,
  clean,
  corrupt,
  metric: Callable[[Any], Any],
  *,
  layers: Sequence[int] | None = None,
  positions: Sequence[int] | None = None,
  site: str = "resid_pre",
  batch_size: int | None = 3,
):
  """Patches the clean residual stream into the corrupt run at every (layer, position).

  Cell ``[i, j]`` is ``metric(logits)`` for the corrupt run with ``blocks_{layers[i]}/{site}``
  at position ``positions[j]`` replaced by its value in the clean run: what
  ``jl.sweep.patching_sweep(model, variables, clean, corrupt, metric,
  sites=[f"blocks_{k}/{site}" for k in layers], positions=positions)`` gives, computed
  recomputing only the cone of each cell (see the module docstring), in one jitted call.

  Args:
    model: an unbound causal decoder with the :class:`jaxlens.protocol.Decoder` methods (the
      zoo's :class:`jaxlens.models.Llama`, :class:`jaxlens.models.GPT2`), in either form
      (``scan_layers``): the unrolled one runs through its scanned form inside the call.
    variables: its variables.
    clean, corrupt: int ``(batch, seq)`` token ids of one shape (no padding).
    metric: a function of the logits ``(batch, seq, vocab)`` returning a scalar; hashable (a
      module-level function avoids a recompile per call).
    layers: the layers (default: all).
    positions: the positions (default: all).
    site: ``"resid_pre"`` (a block's input, the default: the sites of
      ``model.layer_sites()``, which :func:`patching_sweep` patches by default, so the two
      sweeps' default grids are the same) or ``"resid_post"`` (a block's output).
    batch_size: how many layers' cells run at once (default 3): the cells of neighbouring
      layers batched into one product, running from the lowest of their layers with the
      layers above gated (on SmolLM2, 30 layers x 10 positions on two CPU cores, 3 was about
      1.3x faster warm than 1, which runs each layer's cells alone from its own layer; None,
      all layers at once, was 2-3x slower). It also bounds the memory of the logits to that
      many layers' cells.

  Returns:
    A float array ``(len(layers), len(positions))``.

  Raises:
    InvalidArgumentError: ``invalid_argument`` (not a ``Decoder``, an unknown ``site``),
      ``index_out_of_range`` (a layer or position outside the model or sequence);
      :class:`ShapeError` ``shape_mismatch`` or ``metric_not_scalar``.
  """
  _check_decoder(model)
  check_metric(metric, "cone_sweep")
  check_batch_size(batch_size, "cone_sweep")
  n_layers = len(model.layer_sites())
  if site not in _SITES:
    raise InvalidArgumentError(
      f"cone_sweep patches the residual stream, got site={site!r}",
      code="invalid_argument",
      fix='site="resid_post" or "resid_pre"',
    )
  if jnp.shape(clean) != jnp.shape(corrupt) or jnp.ndim(clean) != 2:
    raise ShapeError(
      f"cone_sweep: clean {jnp.shape(clean)} and corrupt {jnp.shape(corrupt)} "
      "must be token ids of one shape (batch, seq)",
      code="shape_mismatch",
      fix="pad or crop the two inputs to one shape",
    )
  seq = jnp.shape(clean)[1]
  layers = tuple(range(n_layers)) if layers is None else tuple(int(k) for k in layers)
  positions = tuple(range(seq)) if positions is None else tuple(int(p) for p in positions)
  for name, values, bound in (("layers", layers, n_layers), ("positions", positions, seq)):
    bad = [x for x in values if not 0 <= x < bound]
    if bad or not values:
      raise InvalidArgumentError(
        f"cone_sweep: {name} {bad or '()'} outside [0, {bound})",
        code="index_out_of_range",
        fix=f"{name} in [0, {bound})",
        received=str(bad),
      )
  return _cone(
    model,
    variables,
    jnp.asarray(clean),
    jnp.asarray(corrupt),
    metric=metric,
    layers=layers,
    positions=positions,
    site=site,
    batch_size=batch_size,
  )
