"""Activation-patching sweeps as one compiled call, on one device or spread over a mesh.

An activation-patching sweep asks, for every layer ``l`` and sequence position
``p``: if the corrupt run is given the clean run's value of layer ``l`` at
position ``p``, how much of the clean behaviour comes back? Written as a Python
loop it is ``L * P`` model runs and as many dispatches.

Here the whole grid is one jitted call. The corrupt run is traced once; for each
site, the cells are a batch of replays of that site's downstream cone
(``corrupt_trace.fork().do(site, jl.at_positions(p, jl.patch_from(clean)))``),
``jax.vmap``ped over the position, which is an edit leaf. A cell at layer ``l``
recomputes only what lies after ``l``, and equals the single live patch (replay
evaluates the same operations on the same values). With ``mesh=``, the same cells
are split over the mesh's devices (``jax.shard_map``): each device runs the two
traces and its own cells.

A causal decoder's residual stream (:class:`jaxlens.protocol.Decoder`, every site a block's
``resid_pre`` or ``resid_post``: the zoo's default sites) takes another road with the same
cells: the rows run one after another, each from its own layer in a ``lax`` loop over the
blocks (``jaxlens.sweep._blocks``), so on a model with a scanned form the compiled program
holds one block whatever the number of layers and cells.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxlens.core import InvalidArgumentError, ShapeError, module, trace
from jaxlens.internal import api_boundary
from jaxlens.intervention import at_positions, patch_from
from jaxlens.protocol import LayeredModel
from jaxlens.sweep._blocks import Runs, residual_rows

__all__ = ["layer_sites", "patching_sweep"]


@api_boundary
def layer_sites(n_layers: int, pattern: str = "block_{}") -> tuple[str, ...]:
  """The site paths ``pattern.format(l)`` for ``l`` in ``range(n_layers)``."""
  return tuple(pattern.format(i) for i in range(n_layers))


def check_metric(metric, sweep: str) -> None:
  """A sweep's metric is a static argument of its jitted call: it must be callable and
  hashable (jit's own error, "Non-hashable static arguments", names neither)."""
  if not callable(metric):
    raise InvalidArgumentError(
      f"{sweep}: metric must be a function of the model output, got {type(metric).__name__}",
      code="invalid_argument",
      fix="metric=lambda out: out[:, -1, 0].mean()",
    )
  try:
    hash(metric)
  except TypeError:
    raise InvalidArgumentError(
      f"{sweep}: the metric {type(metric).__name__} is not hashable (it defines __eq__ without "
      "__hash__); the sweep's compiled call is keyed by it",
      code="invalid_argument",
      fix="a module-level function, a lambda, or give the class a __hash__ (e.g. "
      "@dataclasses.dataclass(frozen=True))",
    ) from None


def _check(clean, corrupt, sites, positions):
  if not sites:
    raise InvalidArgumentError(
      "patching_sweep needs at least one site to patch",
      code="invalid_argument",
      fix="patching_sweep(..., sites=jl.sweep.layer_sites(2))",
    )
  if jnp.shape(clean) != jnp.shape(corrupt):
    raise ShapeError(
      f"patching_sweep: clean has shape {jnp.shape(clean)} but corrupt has "
      f"{jnp.shape(corrupt)}; a patch needs the same positions in both runs",
      code="shape_mismatch",
      fix="pad or crop the two inputs to one shape",
      expected=str(jnp.shape(clean)),
      received=str(jnp.shape(corrupt)),
    )
  if jnp.ndim(clean) < 2:
    raise ShapeError(
      f"patching_sweep: inputs must be (batch, seq, ...), got shape {jnp.shape(clean)}",
      code="shape_mismatch",
      fix="add a batch axis: tokens[None]",
    )
  seq = jnp.shape(clean)[1]
  bad = [p for p in positions if not 0 <= p < seq]
  if bad:
    raise InvalidArgumentError(
      f"patching_sweep: positions {bad} are out of range for sequence length {seq}",
      code="index_out_of_range",
      fix=f"positions in [0, {seq})",
      expected=f"[0, {seq})",
      received=str(bad),
    )


def check_batch_size(batch_size, sweep: str) -> None:
  """``batch_size`` is None or a positive int."""
  if batch_size is not None and (
    isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer)) or batch_size < 1
  ):
    raise InvalidArgumentError(
      f"{sweep}: batch_size must be a positive int or None, got {batch_size!r}",
      code="invalid_argument",
      fix="batch_size=4 (or None: every cell at once)",
      received=repr(batch_size),
    )


def _check_scalar(value):
  if not isinstance(value, (jax.Array, np.ndarray, np.generic, int, float)) or isinstance(
    value, bool
  ):
    raise ShapeError(
      f"patching_sweep: metric returned a {type(value).__name__}, expected a scalar array",
      code="metric_not_scalar",
      fix="return one number: e.g. out[:, -1, 0].mean()",
    )
  value = jnp.asarray(value)
  if value.shape != ():
    raise ShapeError(
      f"patching_sweep: metric returned shape {value.shape}, expected a scalar",
      code="metric_not_scalar",
      fix="reduce the metric over the batch: .mean()",
    )
  return value


def _cells(model, variables, clean, corrupt, cells, *, metric, sites, batch_size, replay=False):
  """The grid rows of ``sites`` at the positions ``cells`` (an int array)."""
  rows = None if replay else residual_rows(model, sites)
  if rows is not None:
    return _residual_cells(model, variables, clean, corrupt, cells, rows, metric, batch_size)
  donor = trace(model, variables, clean, save=[module(s) for s in sites])
  # The corrupt run once, every module site saved: a cell at site i replays only the
  # downstream cone of site i from these values, not the layers below it.
  base = trace(model, variables, corrupt)

  grid = []
  for path in sites:

    def one(position, path=path):
      edit = at_positions(position[None], patch_from(donor))
      return _check_scalar(metric(base.fork().do(module(path), edit).output))

    if batch_size is None:
      grid.append(jax.vmap(one)(cells))
    else:
      # lax.map vectorises chunks of batch_size cells with vmap and loops over the chunks.
      grid.append(jax.lax.map(one, cells, batch_size=batch_size))
  return jnp.stack(grid)


def _residual_cells(model, variables, clean, corrupt, cells, rows, metric, batch_size):
  """A causal decoder's residual-stream rows (stream indices ``rows``), one block loop
  (``jaxlens.sweep._blocks``): the program holds one block whatever the layers and cells.

  A row's cells (``batch_size`` at a time) run as one batch of sequences through the blocks,
  the metric then ``vmap``ped over them: a bfloat16 weight is widened once for all of them
  (under ``vmap`` each cell would widen its own copy, ``compact.times_wide``'s added zero
  depending on the cell's values)."""
  runs = Runs(model, variables, clean, corrupt)
  batch, seq = corrupt.shape[:2]
  positions = jnp.arange(seq, dtype=jnp.int32)[None]
  causal = jnp.tril(jnp.ones((seq, seq), bool))[None, None]

  def group(start, ps):
    clean_in, corrupt_in = runs.donor[start], runs.stream[start]
    here = (jnp.arange(seq, dtype=jnp.int32) == ps[:, None])[:, None, :, None]
    x = jnp.where(here, clean_in[None], corrupt_in[None])  # (cells, batch, seq, d)
    x = runs.run_from(start, x.reshape((-1,) + x.shape[2:]), positions, causal, past=0)
    logits = runs.unembed(x)
    logits = logits.reshape((ps.shape[0], batch) + logits.shape[1:])
    return jax.vmap(lambda out: _check_scalar(metric(out)))(logits)

  def row(start):
    n = cells.shape[0]
    if batch_size is None or batch_size >= n:
      return group(start, cells)
    k = -(-n // batch_size)
    padded = jnp.concatenate([cells, jnp.broadcast_to(cells[:1], (k * batch_size - n,))])
    out = jax.lax.map(lambda ps: group(start, ps), padded.reshape(k, batch_size))
    return out.reshape(-1)[:n]

  # The rows one after another: each row's block loop starts at its own layer.
  return jax.lax.map(row, jnp.asarray(rows, jnp.int32))


@functools.partial(
  jax.jit, static_argnames=("model", "metric", "sites", "positions", "batch_size", "replay")
)
def _sweep(model, variables, clean, corrupt, *, metric, sites, positions, batch_size, replay=False):
  # replay=True: the generic path (a fork of the corrupt trace per site) even for a decoder's
  # residual stream; the tests compare the block loop with it.
  cells = jnp.asarray(positions, jnp.int32)
  return _cells(
    model,
    variables,
    clean,
    corrupt,
    cells,
    metric=metric,
    sites=sites,
    batch_size=batch_size,
    replay=replay,
  )


@functools.partial(
  jax.jit, static_argnames=("model", "metric", "sites", "mesh", "cell_axes", "batch_size")
)
def _sharded_sweep(
  model, variables, clean, corrupt, cells, *, metric, sites, mesh, cell_axes, batch_size
):
  # Manual over the cell axes only: any other mesh axis (a model axis the variables are
  # split over) stays with XLA's partitioner inside each cell shard.
  body = jax.shard_map(
    lambda v, a, b, c: _cells(model, v, a, b, c, metric=metric, sites=sites, batch_size=batch_size),
    mesh=mesh,
    in_specs=(P(), P(), P(), P(cell_axes)),
    out_specs=P(None, cell_axes),
    axis_names=set(cell_axes),
    check_vma=False,
  )
  return body(variables, clean, corrupt, cells)


def _on_mesh(
  model, variables, clean, corrupt, *, metric, sites, positions, mesh, cell_axes, batch_size
):
  cell_axes = tuple(mesh.axis_names if cell_axes is None else cell_axes)
  unknown = [a for a in cell_axes if a not in mesh.axis_names]
  if unknown:
    raise InvalidArgumentError(
      f"patching_sweep: cell_axes {unknown} are not axes of the mesh {mesh.axis_names}",
      code="invalid_argument",
      fix=f"cell_axes={tuple(mesh.axis_names)!r}",
    )
  shards = int(np.prod([mesh.shape[a] for a in cell_axes]))
  padded = positions + (0,) * (-len(positions) % shards)
  cells = jax.make_array_from_callback(
    (len(padded),),
    NamedSharding(mesh, P(cell_axes)),
    lambda index: np.asarray(padded, np.int32)[index],
  )
  grid = _sharded_sweep(
    model,
    variables,
    clean,
    corrupt,
    cells,
    metric=metric,
    sites=sites,
    mesh=mesh,
    cell_axes=cell_axes,
    batch_size=batch_size,
  )
  if len(padded) == len(positions):
    return grid
  explicit = {
    name
    for name, kind in zip(mesh.axis_names, mesh.axis_types)
    if kind == jax.sharding.AxisType.Explicit
  }
  if explicit & set(cell_axes):
    # Slicing an axis split over Explicit mesh axes is refused by JAX ("out sharding could
    # not be resolved"): replicate the grid (one float per cell) first.
    grid = jax.device_put(grid, NamedSharding(mesh, P()))
  return grid[:, : len(positions)]


def _default_sites(model) -> tuple[str, ...]:
  """A model's own per-layer sites (:meth:`jaxlens.protocol.LayeredModel.layer_sites`), else
  ``block_0`` .. ``block_{L-1}`` from an ``n_layers`` attribute."""
  if isinstance(model, LayeredModel):
    return tuple(model.layer_sites())
  n_layers = getattr(model, "n_layers", None)
  if n_layers is None:
    raise InvalidArgumentError(
      f"patching_sweep: a {type(model).__name__} has neither layer_sites() (see "
      "jaxlens.protocol.LayeredModel) nor n_layers; name the sites",
      code="invalid_argument",
      fix='patching_sweep(..., sites=("layers_0", "layers_1"))',
    )
  return layer_sites(n_layers)


@api_boundary
def patching_sweep(
  model,
  variables,
  clean,
  corrupt,
  metric: Callable[[Any], Any],
  *,
  sites: Sequence[str] | None = None,
  positions: Sequence[int] | None = None,
  batch_size: int | None = None,
  mesh: jax.sharding.Mesh | None = None,
  cell_axes: Sequence[str] | None = None,
):
  """Patches the clean run into the corrupt one at every (site, position); returns the metric.

  Cell ``[i, j]`` of the result is ``metric(out)`` where ``out`` is the model's
  output on ``corrupt`` with the value of ``sites[i]`` at sequence position
  ``positions[j]`` (axis 1 of that site's value) replaced by its value in the run
  on ``clean`` (``jl.at_positions([p], jl.patch_from(clean_trace))``); nothing
  else is edited. The whole grid is one jitted call: the cells are a batch of
  edits, vectorised with ``jax.vmap`` (in chunks of ``batch_size`` when given). On a causal
  decoder's residual stream (the zoo's default sites, in either form, ``scan_layers`` or not)
  the rows run one after another, each through the blocks after its layer in one ``lax`` loop,
  a row's cells as one batch of sequences: the compiled program does not grow with the number
  of layers or cells.

  Args:
    model: an unbound linen module whose sites ``sites`` return
      ``(batch, seq, ...)`` values (``jaxlens.models.GPT``: ``"block_0"`` ..; the zoo's
      ``Llama``, ``GPT2``, ``Bert``: ``"blocks_0/resid_pre"`` ..).
    variables: its variables.
    clean: the input whose values are patched in, ``(batch, seq, ...)``.
    corrupt: the input that is run, of the same shape.
    metric: a function of the model output returning a scalar (for example the
      mean logit difference between the clean and the corrupt answer). It must be
      hashable; a module-level function avoids a recompile per call.
    sites: the module paths to patch, in order (default: the model's
      ``layer_sites()``, which for the zoo's models is the residual stream entering
      each block, ``blocks_{i}/resid_pre``; else ``block_0`` .. ``block_{L-1}`` from
      ``model.n_layers``).
    positions: the sequence positions (default: all of them).
    batch_size: how many cells to run at once (default: all; with ``mesh``: of a device's
      cells); bounds memory.
    mesh: spread the cells over the devices of this mesh, which may span several processes
      (``docs/scaling.md``). The positions are split over the mesh axes ``cell_axes``, so
      every device gets ``len(positions) / n_devices`` cells of each site; each device runs
      the clean and the corrupt trace once and replays its own cells, so no activation
      crosses devices. ``variables``, ``clean`` and ``corrupt`` are replicated over the cell
      axes: this layout is for a model that fits on one device (a bigger one shards over a
      model axis left out of ``cell_axes``). Positions are padded to a multiple of the
      number of cell shards with position 0 and the padding is dropped.
    cell_axes: the mesh axes the cells are split over (default: all of them).

  Returns:
    A float array of shape ``(len(sites), len(positions))``; with ``mesh``, a global array
    whose position axis is sharded over ``cell_axes`` (when padding was needed, as XLA
    places the sliced result): ``jaxlens.distributed.host_values`` gives it on the host.

  Raises:
    InvalidArgumentError: ``invalid_argument`` (no sites; a model without
      ``layer_sites()`` and no ``sites``; ``cell_axes`` that are not axes of ``mesh``), ``index_out_of_range``
      (a position outside the sequence); :class:`ShapeError` ``shape_mismatch``
      (clean and corrupt differ in shape) or ``metric_not_scalar``.

  Example:
    >>> import jax.numpy as jnp, jaxlens as jl
    >>> from jaxlens.models import init_gpt
    >>> model, variables, clean = init_gpt(0, n_layers=1, d_model=8, n_heads=2, max_len=3,
    ...                                    vocab_size=8, batch=2)
    >>> corrupt = clean.at[:, 1].set(0)
    >>> grid = jl.sweep.patching_sweep(model, variables, clean, corrupt,
    ...                                lambda out: out[:, -1, 0].mean())
    >>> grid.shape
    (1, 3)
  """
  check_metric(metric, "patching_sweep")
  check_batch_size(batch_size, "patching_sweep")
  if sites is None:
    sites = _default_sites(model)
  sites = tuple(sites)
  seq = jnp.shape(clean)[1] if jnp.ndim(clean) >= 2 else 0
  positions = tuple(range(seq)) if positions is None else tuple(int(p) for p in positions)
  _check(clean, corrupt, sites, positions)
  if mesh is not None:
    return _on_mesh(
      model,
      variables,
      clean,
      corrupt,
      metric=metric,
      sites=sites,
      positions=positions,
      mesh=mesh,
      cell_axes=cell_axes,
      batch_size=batch_size,
    )
  if cell_axes is not None:
    raise InvalidArgumentError(
      "patching_sweep: cell_axes= splits the cells over a mesh; pass the mesh too",
      code="invalid_argument",
      fix="patching_sweep(..., mesh=mesh, cell_axes=('data',))",
    )
  return _sweep(
    model,
    variables,
    clean,
    corrupt,
    metric=metric,
    sites=sites,
    positions=positions,
    batch_size=batch_size,
  )
