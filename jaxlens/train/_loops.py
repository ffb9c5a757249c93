"""Training loops for trained interventions: interchange intervention training and ReFT.

Both loops are an optax loop around one jitted step whose loss runs the model through
a live door (``jl.when(site, edit).bind(model)``). With ``frozen=True`` (the default)
the model's variables enter the loss through ``jax.lax.stop_gradient``: the gradient is
cut there, so only the intervention's parameters train, and before the first step
:func:`jaxlens.depends_on` (the structural analysis behind ``keep_grad``) checks it:
the loss must depend on every trained leaf of the intervention and on no leaf of the
model. With ``frozen=False`` the model's variables train with it.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import inspect
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxlens import internal
from jaxlens.core import GradientContractError, InvalidArgumentError, depends_on, trace, when
from jaxlens.internal import ByIdentity, as_selector, auto_axes, check_every
from jaxlens.protocol import Decoder
from jaxlens.intervention import at_positions, compose, replace_with
from jaxlens.train import _cache, _outputs
from jaxlens.train._methods import frozen_leaves


@dataclasses.dataclass
class TrainResult:
  """What a training loop returns.

  Attributes:
    params: the trained intervention parameters.
    variables: the model's variables (trained too when ``frozen=False``).
    losses: the loss of every step run by this call (a float each).
    opt_state: the optimiser's state after the last step.
    step: the number of steps done in all (resumed ones included).
    depends: the structural check before the first step: ``{"params": pytree of bool,
      "variables": pytree of bool}``, whether the loss depends on each leaf.
    skipped: with ``nonfinite="skip"``, the steps skipped (resumed runs' included), each
      ``{"batch": i, "step": s, "code": "batch_not_finite" | "loss_not_finite"}`` (ReFT's
      with ``"pairs"``, the indices of the pairs in the batch); empty otherwise.
  """

  params: Any
  variables: Any
  losses: list
  opt_state: Any
  step: int
  depends: Any = None
  skipped: list = dataclasses.field(default_factory=list)


def _key_part(value):
  """``value`` as part of a cache key: a list or tuple as a tuple of parts, a hashable value
  (a method's frozen dataclass, a label, a number) as itself, anything else by identity
  (a model, which may be bound to its own variables; a function; anything unhashable)."""
  if isinstance(value, (list, tuple)):
    return (type(value).__name__, *(_key_part(v) for v in value))
  try:
    hash(value)
  except TypeError:
    return ByIdentity(value)
  return ByIdentity(value) if callable(value) else value


# The loops' and iia's jitted programs, by what their traced functions close over (the model,
# the site, the method, the readout, the optimiser...): a second call with the same
# configuration reuses the compiled programs instead of compiling them anew (each call made
# a new ``jax.jit`` of a new closure, which JAX cannot match with the last one's). Bounded, so
# that the models and optimisers the keys hold are let go.
_PROGRAMS: collections.OrderedDict = collections.OrderedDict()
_PROGRAMS_KEPT = 16


def _program(key, make):
  """The program cached under ``key`` (``make()`` on a miss)."""
  program = _PROGRAMS.get(key)
  if program is None:
    program = _PROGRAMS[key] = make()
    while len(_PROGRAMS) > _PROGRAMS_KEPT:
      _PROGRAMS.popitem(last=False)
  else:
    _PROGRAMS.move_to_end(key)
  return program


@functools.cache
def _default_optimizer(learning_rate: float):
  """One default optax Adam per learning rate (a new one per call would key a new step)."""
  return _optax().adam(learning_rate)


def last_position(out):
  """The default readout: the logits at the last position (``(B, S, V) -> (B, V)``)."""
  return out[:, -1] if out.ndim == 3 else out


def _optax():
  return internal.require("optax", feature="jaxlens.train", extra="train")


def _optimizer(optimizer, params):
  """``optimizer`` on the trained leaves; rotation bases stay as they are."""
  optax = _optax()
  labels = jax.tree.map(lambda frozen: "frozen" if frozen else "train", frozen_leaves(params))
  return optax.multi_transform({"train": optimizer, "frozen": optax.set_to_zero()}, labels)


def _batch_at(batches, step):
  if callable(batches):
    return batches(step)
  return batches[step % len(batches)]


def _as_arrays(batch, index):
  """``batch`` with its list and tuple entries as arrays (a label list reached the loss as a
  pytree of scalars: a raw ``TypeError``), checked to hold one example or more (the mean
  loss over none is NaN: it read as a diverged step)."""
  if not isinstance(batch, dict):
    return batch
  batch = {k: np.asarray(a) if isinstance(a, (list, tuple)) else a for k, a in batch.items()}
  for path, leaf in jax.tree_util.tree_flatten_with_path(batch)[0]:
    if np.ndim(leaf) and not np.shape(leaf)[0]:
      raise InvalidArgumentError(
        f"batch {index}: {jax.tree_util.keystr(path)} holds no examples (shape "
        f"{np.shape(leaf)}); the loss is a mean over the batch's examples",
        code="invalid_argument",
        fix="drop the empty batch",
        batch=index,
        received=list(np.shape(leaf)),
      )
  return batch


def _check_mesh(mesh, axis):
  """``mesh`` is a ``jax.sharding.Mesh`` with the axis ``axis`` (or None)."""
  if mesh is None:
    return
  if not isinstance(mesh, jax.sharding.Mesh):
    raise InvalidArgumentError(
      f"mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}",
      code="invalid_argument",
      fix='mesh=jax.make_mesh((jax.device_count(),), ("data",))',
    )
  if axis not in mesh.axis_names:
    raise InvalidArgumentError(
      f"data_axis={axis!r} is not an axis of the mesh {tuple(mesh.axis_names)}",
      code="invalid_argument",
      fix=f"data_axis={mesh.axis_names[0]!r}",
    )


def _check_rows(tree, mesh, axis, index):
  """Each array of batch ``index`` splits evenly over the mesh's ``axis``."""
  if mesh is None:
    return
  n = mesh.shape[axis]
  for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
    rows = np.shape(leaf)[0] if np.ndim(leaf) else None
    if rows is not None and rows % n:
      raise InvalidArgumentError(
        f"batch {index}: {jax.tree_util.keystr(path)} has {rows} rows, which do not split "
        f"evenly over the mesh's {n} devices along {axis!r}",
        code="shape_mismatch",
        fix=f"batches of a multiple of {n} rows",
        batch=index,
      )


def _shard(tree, mesh, axis):
  if mesh is None:
    return tree
  data = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(axis))
  return jax.tree.map(lambda a: jax.device_put(jnp.asarray(a), data), tree)


def _replicate(tree, mesh):
  if mesh is None:
    return tree
  rep = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  return jax.tree.map(lambda a: jax.device_put(a, rep), tree)


# Checkpoints: orbax, through the helper jaxlens.sae.train shares.
_Checkpoints = internal.Checkpoints


def _all_finite(tree):
  """Whether every float leaf of ``tree`` is finite (a traced bool)."""
  leaves = [jnp.asarray(a) for a in jax.tree.leaves(tree)]
  checks = [jnp.all(jnp.isfinite(a)) for a in leaves if jnp.issubdtype(a.dtype, jnp.inexact)]
  return jnp.all(jnp.stack(checks)) if checks else jnp.asarray(True)


def _not_finite(batch_finite: bool, index: int, step: int, pairs=None) -> InvalidArgumentError:
  """The error for a step whose loss or gradient is not finite; the parameters, the
  optimiser state and the checkpoints stay those before the step. ``pairs``: ReFT's pairs
  in the batch."""
  where = {"batch": index, "step": step, **({} if pairs is None else {"pairs": pairs})}
  if not batch_finite:
    return InvalidArgumentError(
      f"batch {index} (step {step}) holds NaN or infinite values; training stopped before "
      "the step changed the parameters",
      code="batch_not_finite",
      fix='drop or repair that batch (checkpoints keep the steps before it), or nonfinite="skip"',
      **where,
    )
  return InvalidArgumentError(
    f"the loss or its gradient is NaN or infinite at step {step} (batch {index}"
    + (f", pairs {pairs}" if pairs is not None else "")
    + ", whose values are finite): training diverged, or the model's output is not finite on "
    "that batch; stopped before the step changed the parameters",
    code="loss_not_finite",
    fix="a smaller learning rate, a readout whose logits stay finite, token ids inside the "
    'vocabulary, or nonfinite="skip" to drop such batches',
    **where,
  )


def _check_nonfinite(nonfinite) -> bool:
  """Whether ``nonfinite`` asks to skip (``"skip"``) or to raise (``"raise"``)."""
  if nonfinite not in ("raise", "skip"):
    raise InvalidArgumentError(
      f'nonfinite must be "raise" or "skip", got {nonfinite!r}',
      code="invalid_argument",
      fix='nonfinite="raise"',
      expected=["raise", "skip"],
      received=repr(nonfinite),
    )
  return nonfinite == "skip"


def _positive_int(value, name: str, fix: str) -> int:
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
    raise InvalidArgumentError(
      f"{name} must be a positive int, got {value!r}",
      code="invalid_argument",
      fix=fix,
      expected="int >= 1",
      received=repr(value),
    )
  return int(value)


def _check_batches(batches, keys):
  """``batches`` is a function of the step or a non-empty sequence of dicts holding ``keys``
  (the first batch is checked; a function's too)."""
  if not callable(batches):
    if isinstance(batches, dict) or not isinstance(batches, Sequence) or not len(batches):
      raise InvalidArgumentError(
        f"batches must be a non-empty sequence of dicts or a function of the step, got "
        f"{type(batches).__name__}" + (" of length 0" if hasattr(batches, "__len__") else ""),
        code="invalid_argument",
        fix="batches=[{" + ", ".join(f'"{k}": ...' for k in keys) + "}, ...]",
      )
  first = _batch_at(batches, 0)
  missing = [k for k in keys if not isinstance(first, dict) or k not in first]
  if missing:
    raise InvalidArgumentError(
      f"a batch must be a dict with keys {list(keys)}; the first lacks {missing}"
      if isinstance(first, dict)
      else f"a batch must be a dict with keys {list(keys)}, got {type(first).__name__}",
      code="invalid_argument",
      fix="{" + ", ".join(f'"{k}": ...' for k in keys) + "}",
      expected=list(keys),
      received=sorted(first) if isinstance(first, dict) else type(first).__name__,
    )


def _check_labels(logits, labels) -> int:
  """The readout's logits and a batch's labels fit (checked while the loss is traced):
  float ``(..., classes)`` logits, int labels of their leading shape. Returns ``classes``."""
  if not isinstance(logits, jax.Array) or logits.ndim < 1:
    raise InvalidArgumentError(
      f"readout must return (batch, classes) logits, got {type(logits).__name__}"
      + (f" of shape {logits.shape}" if hasattr(logits, "shape") else ""),
      code="invalid_argument",
      fix="readout=lambda out: out[:, -1] (the default)",
    )
  labels = jnp.asarray(labels)
  if not jnp.issubdtype(labels.dtype, jnp.integer) or labels.shape != logits.shape[:-1]:
    raise InvalidArgumentError(
      f"a batch's labels must be int class indices of shape {logits.shape[:-1]} (the readout's "
      f"logits are {logits.shape}), got {labels.dtype} of shape {labels.shape}",
      code="shape_mismatch",
      fix="one int label per example: batch['label'] of shape (batch,)",
      expected=list(logits.shape[:-1]),
      received=list(labels.shape),
    )
  return int(logits.shape[-1])


def _check_params(method, params):
  """``params`` holds every top-level entry ``method.init`` gives (a missing one was a raw
  ``KeyError`` at the first step)."""
  try:
    want = jax.eval_shape(lambda: method.init(jax.random.key(0), 16))
  except Exception:  # noqa: BLE001 (a method whose init needs more: not checked here)
    return
  if isinstance(want, dict):
    missing = sorted(set(want) - set(params)) if isinstance(params, dict) else sorted(want)
    if missing:
      raise InvalidArgumentError(
        f"params lack {missing}: they are not {type(method).__name__}'s parameters",
        code="invalid_argument",
        fix=f"params = {type(method).__name__}(...).init(key, d)",
        received=type(params).__name__ if not isinstance(params, dict) else sorted(params),
      )


def _progress(total, initial, enabled, desc):
  if not enabled:
    return None
  tqdm = internal.require("tqdm", feature="progress bars", extra="train").tqdm
  return tqdm(total=total, initial=initial, desc=desc, leave=False)


def _check_depends(loss_of, params, variables, frozen, *args):
  """The structural check: the loss depends on every trained leaf, and (frozen) on no
  model leaf."""
  # One structural analysis for both (it traces the loss's forward-mode derivative once).
  dep_p, dep_v = depends_on(lambda both, *a: loss_of(*both, *a), (params, variables), *args)
  flat_dep, _ = jax.tree_util.tree_flatten_with_path(dep_p)
  flat_frozen = jax.tree.leaves(frozen_leaves(params))
  detached = [
    jax.tree_util.keystr(path)
    for (path, dep), frozen_leaf in zip(flat_dep, flat_frozen)
    if not dep and not frozen_leaf
  ]
  if detached:
    raise GradientContractError(
      f"the loss does not depend on the intervention parameters {detached}: they would "
      "never train (is the site downstream of the readout, or the edit cut?)",
      code="intervention_detached",
      fix="intervene at a site the readout depends on",
      leaves=detached,
    )
  if frozen and any(jax.tree.leaves(dep_v)):
    leaked = [
      jax.tree_util.keystr(path)
      for path, dep in jax.tree_util.tree_flatten_with_path(dep_v)[0]
      if dep
    ]
    raise GradientContractError(  # pragma: no cover (stop_gradient makes this unreachable)
      f"frozen model, yet the loss depends on {leaked}",
      code="intervention_detached",
      fix="frozen=False to co-train the model",
    )
  return {"params": dep_p, "variables": dep_v}


def _loop(
  loss_of,
  params,
  variables,
  batches,
  *,
  steps,
  optimizer,
  frozen,
  mesh,
  data_axis,
  checkpoint,
  checkpoint_every,
  progress,
  desc,
  nonfinite="raise",
  pairs_of=None,
  check_batch=None,
  key=None,
):
  """The optax loop around one jitted step of ``loss_of``. ``key``: what ``loss_of`` closes
  over, as a cache key (:func:`_program`): a later call with an equal key and the same
  optimiser reuses the compiled step."""
  optax = _optax()
  skip = _check_nonfinite(nonfinite)
  if not (
    callable(getattr(optimizer, "init", None)) and callable(getattr(optimizer, "update", None))
  ):
    raise InvalidArgumentError(
      f"optimizer must be an optax GradientTransformation, got {type(optimizer).__name__}",
      code="invalid_argument",
      fix="optimizer=optax.adam(1e-3)",
      received=repr(optimizer)[:80],
    )
  if steps is None:
    if callable(batches):
      raise InvalidArgumentError(
        "steps= is needed when batches is a function of the step",
        code="invalid_argument",
        fix="train_iit(..., steps=200)",
      )
    steps = len(batches)
  steps = _positive_int(steps, "steps", "steps=200")
  check_every(checkpoint_every)
  trained = params if frozen else (params, variables)
  tx = _optimizer(optimizer, params) if frozen else _co_optimizer(optimizer, params, variables)
  opt_state = tx.init(trained)

  def loss_trained(t, v, batch, step):
    if frozen:
      return loss_of(t, jax.lax.stop_gradient(v), batch, step)
    return loss_of(t[0], t[1], batch, step)

  def step_of(t, v, state, batch, step):
    value, grads = jax.value_and_grad(loss_trained)(t, v, batch, step)
    # optax's bias corrections raise a float to an int32 step count, which strict dtype
    # promotion refuses; the update runs under standard promotion (the loss does not).
    with jax.numpy_dtype_promotion("standard"):
      updates, state = tx.update(grads, state, t)
      new = optax.apply_updates(t, updates)
    # A batch's cached site values are not its data: a site that is not finite on finite
    # inputs is the model's doing (loss_not_finite), as without the cache.
    data = {k: a for k, a in batch.items() if k != _cache.CACHE_KEY}
    return new, state, value, _all_finite((value, grads)), _all_finite(data)

  # The step's program depends on the loss (key), the optimiser, and the trained tree's
  # structure (the optimiser's labels of frozen leaves are built from it).
  step_key = (
    None
    if key is None
    else ("step", key, _key_part(optimizer), frozen, jax.tree.structure(trained))
  )
  train_step = (
    jax.jit(step_of) if step_key is None else _program(step_key, lambda: jax.jit(step_of))
  )

  _check_mesh(mesh, data_axis)
  # XLA partitions the step from the batch's sharding (an Explicit mesh's types have no rule
  # for an embedding lookup of sharded token ids).
  mesh = auto_axes(mesh)
  first = _as_arrays(_batch_at(batches, 0), 0)
  _check_rows(first, mesh, data_axis, 0)
  first = _shard(first, mesh, data_axis)
  depends = _check_depends(
    lambda p, v, b, s: loss_of(p, jax.lax.stop_gradient(v) if frozen else v, b, s),
    params,
    variables,
    frozen,
    first,
    jnp.asarray(0),
  )

  start = 0
  ckpt = _Checkpoints(checkpoint, checkpoint_every) if checkpoint is not None else None
  losses = []
  skipped: list = []
  bar = None
  try:
    if ckpt is not None:
      state = {"trained": trained, "opt_state": opt_state, "step": jnp.asarray(0)}
      meta = ckpt.restore_meta()
      restored = ckpt.restore(state, meta)
      if restored is not None:
        trained, opt_state = restored["trained"], restored["opt_state"]
        start = int(restored["step"])
        ckpt.check_within(start, steps)
        skipped = list(meta.get("skipped", []))
    trained, opt_state = _replicate(trained, mesh), _replicate(opt_state, mesh)
    variables = _replicate(variables, mesh)
    bar = _progress(steps, start, progress, desc)
    for step in range(start, steps):
      index = step if callable(batches) else step % len(batches)
      # One call of a function of the step per step (it may read a stream).
      batch = _as_arrays(_batch_at(batches, step), index)
      if check_batch is not None:
        check_batch(batch, index)
      _check_rows(batch, mesh, data_axis, index)
      batch = _shard(batch, mesh, data_axis)
      new_trained, new_state, value, finite, batch_finite = train_step(
        trained, variables, opt_state, batch, jnp.asarray(step)
      )
      if not bool(finite):
        pairs = None if pairs_of is None else pairs_of(step)
        if not skip:
          raise _not_finite(bool(batch_finite), index, step, pairs)
        # Skipped: the step counts, the parameters and the optimiser state stay as they were.
        code = "batch_not_finite" if not bool(batch_finite) else "loss_not_finite"
        record = {"batch": index, "step": step, "code": code}
        skipped.append(record if pairs is None else {**record, "pairs": pairs})
      else:
        trained, opt_state = new_trained, new_state
        losses.append(value)
      if bar is not None:
        bar.update(1)
        if step % 10 == 0:
          bar.set_postfix(loss=f"{float(value):.4f}")
      if ckpt is not None:
        ckpt.save(
          step + 1,
          {"trained": trained, "opt_state": opt_state, "step": jnp.asarray(step + 1)},
          {"skipped": skipped},
        )
    if ckpt is not None and start < steps:
      ckpt.save(
        steps,
        {"trained": trained, "opt_state": opt_state, "step": jnp.asarray(steps)},
        {"skipped": skipped},
        force=True,
      )
  finally:
    if bar is not None:
      bar.close()
    if ckpt is not None:
      ckpt.close()
  params, variables = (trained, variables) if frozen else trained
  return TrainResult(
    params, variables, [float(v) for v in losses], opt_state, max(steps, start), depends, skipped
  )


def _co_optimizer(optimizer, params, variables):
  optax = _optax()
  labels = (
    jax.tree.map(lambda f: "frozen" if f else "train", frozen_leaves(params)),
    jax.tree.map(lambda _: "train", variables),
  )
  return optax.multi_transform({"train": optimizer, "frozen": optax.set_to_zero()}, labels)


def _spec(site, edit, positions, value=None):
  """The rule writing ``edit`` at ``site`` (at ``positions``); with ``value``, the whole site
  is first replaced by that cached value, so nothing the output depends on reads the site's
  live value (nor what the model computed before it)."""
  if positions is not None:
    edit = at_positions(positions, edit)
  if value is not None:
    edit = compose(replace_with(value), edit)
  return when(site, edit)


def intervened_output(
  model,
  variables,
  site,
  method,
  params,
  base,
  source=None,
  *,
  positions=None,
  temperature=None,
  subspaces=None,
  site_values=None,
  output_positions=None,
):
  """The model's output on ``base`` with ``method``'s edit at ``site`` (source: ``source``'s run).

  Args:
    model: an unbound Flax linen module.
    variables: its variables.
    site: a selector or label of the intervened site.
    method: a method of :mod:`jaxlens.train` (``DAS(dim)``, ``LoReFT(rank)``, ...).
    params: its parameters.
    base: the base inputs.
    source: the source inputs (for the interchange methods).
    positions: sequence positions to intervene at (``jl.at_positions``), or None for all.
    temperature: Boundless DAS's temperature (default: the schedule's last).
    subspaces: a per-example mask of the interchanged coordinates
      (:func:`jaxlens.train.subspace_mask`); a batch's ``"subspaces"`` in the loops.
    site_values: the site's cached values (:func:`jaxlens.train.site_values`),
      ``{"base": value on base, "source": value on source}`` (``"source"`` for the
      interchange methods): the whole site is replaced by the base's value and the edit
      reads the source's, so no source run is made and, under ``jax.jit``, the model's
      computation before the site is dead code (``cache_prefix=True`` in the loops).
    output_positions: a ``(batch, k)`` int array: the output only at these positions of
      each row, ``(batch, k, ...)`` (``out[b, output_positions[b, j]]``), as a loss on a
      few tokens reads it. On a :class:`jaxlens.protocol.Decoder` whose ``site`` (a label)
      lies before its last block, the last block runs its queries, and the unembedding
      runs, at these positions only (the keys and values at every position); any other
      model or site computes the whole output and gathers it. The same values either way,
      to rounding.

  Raises:
    InvalidArgumentError: ``invalid_argument`` (no ``source`` for an interchange, malformed
      ``site_values``, ``subspaces`` for a method without them); ``shape_mismatch`` /
      ``index_out_of_range`` (``output_positions`` not ``(batch, k)`` ints in
      ``[0, seq)``).
  """
  selector = as_selector(site)
  donor = None
  if site_values is not None:
    if not isinstance(site_values, dict) or "base" not in site_values:
      raise InvalidArgumentError(
        'site_values must be a dict holding the site\'s value on base ("base")',
        code="invalid_argument",
        fix='site_values={"base": jt.site_values(model, variables, site, base)}',
      )
    if method.needs_source and "source" not in site_values:
      raise InvalidArgumentError(
        f"{type(method).__name__} interchanges with a source run: site_values needs its "
        '"source" value',
        code="invalid_argument",
        fix='site_values={"base": site_values(model, v, site, base), "source": ...}',
      )
    donor = site_values.get("source") if method.needs_source else None
  elif method.needs_source:
    if source is None:
      raise InvalidArgumentError(
        f"{type(method).__name__} interchanges with a source run: pass source=",
        code="invalid_argument",
        fix="intervened_output(..., base, source)",
      )
    donor = trace(model, variables, source, save=selector, keep_inputs=False)
  extra = {}
  if subspaces is not None:
    if "subspaces" not in inspect.signature(method.edit).parameters:
      raise InvalidArgumentError(
        f"{type(method).__name__} takes no per-example subspaces (a batch's 'subspaces')",
        code="invalid_argument",
        fix="DAS, LowRankDAS, PCAInterchange or SAEInterchange, or no 'subspaces'",
      )
    extra["subspaces"] = subspaces
  edit = method.edit(params, donor, temperature, **extra)
  cached = None if site_values is None else site_values["base"]
  spec = _spec(selector, edit, positions, cached)
  if output_positions is not None:
    at = _outputs.check_positions(output_positions, base)
    return _outputs.output_at(model, variables, spec, base, at, [site])
  return spec.bind(model)(variables, base)


def _last_only(model, readout, base):
  """With the default readout on a zoo decoder's tokens, the output at the last position
  only (``(batch, 1)`` positions: the last block's query and the unembedding there alone;
  ``last_position`` reads the same logits from it); None otherwise."""
  if readout is not last_position or not isinstance(model, Decoder) or np.ndim(base) != 2:
    return None
  b, s = np.shape(base)
  return jnp.full((b, 1), s - 1, jnp.int32)


def _cross_entropy(logits, labels):
  logp = jax.nn.log_softmax(logits.astype(jnp.float32) if logits.dtype == jnp.bfloat16 else logits)
  return -jnp.take_along_axis(logp, labels[..., None].astype(jnp.int32), axis=-1)[..., 0]


def train_iit(
  model,
  variables,
  site,
  method,
  params,
  batches: Sequence[dict] | Callable[[int], dict],
  *,
  steps: int | None = None,
  optimizer=None,
  frozen: bool = True,
  positions=None,
  readout: Callable = last_position,
  boundary_weight: float = 0.0,
  mesh=None,
  data_axis: str = "data",
  checkpoint=None,
  checkpoint_every: int = 50,
  progress: bool = True,
  nonfinite: str = "raise",
  cache_prefix: bool = False,
) -> TrainResult:
  """Interchange intervention training: align ``method``'s subspace with a causal variable.

  Each batch is a dict ``{"base", "source", "label"}``: the model runs on ``base`` with
  the site's value interchanged (in the learned subspace) with its value on ``source``,
  and the loss is the cross-entropy of ``readout(output)`` against ``label``, the output
  the causal model predicts under the same interchange (the counterfactual label).

  Args:
    model: an unbound Flax linen module; ``variables`` its variables.
    variables: the model's variables.
    site: the intervened site (a selector or label).
    method: ``DAS(dim)``, ``BoundlessDAS()`` or ``LowRankDAS(rank)``.
    params: the method's initial parameters (``method.init(key, d)``).
    batches: a sequence of batches (cycled) or a function of the step returning one.
    steps: the number of steps (default: ``len(batches)``).
    optimizer: an optax optimiser (default ``optax.adam(1e-3)``).
    frozen: cut the model's gradients (True) or co-train it (False).
    positions: sequence positions to intervene at, or None.
    readout: maps the output to ``(batch, classes)`` logits (default: last position).
    boundary_weight: Boundless DAS: adds ``boundary_weight * boundary`` to the loss, which
      pushes the learned subspace to be small (pyvene's tutorial uses 1.0).
    mesh: a ``jax.sharding.Mesh``: batches are split along ``data_axis`` (data parallel),
      parameters replicated.
    data_axis: the mesh axis the batch is split over.
    checkpoint: a directory: the state is saved every ``checkpoint_every`` steps and at the
      end (orbax), and a later call with the same directory resumes from the last save (a
      call after the run finished returns its result, with no loss: no step is run). One
      run at a time trains into a directory (a lock file in it).
    checkpoint_every: steps between checkpoints.
    progress: show a tqdm progress bar.
    nonfinite: what a step whose batch, loss or gradient holds NaN or infinity does:
      ``"raise"`` (the default: ``batch_not_finite`` / ``loss_not_finite`` below) or
      ``"skip"``: the step changes nothing (no update of the parameters or the optimiser
      state; it still counts as one of ``steps``, and has no entry in ``losses``) and is
      listed in :attr:`TrainResult.skipped`, which checkpoints keep across a resume.
    cache_prefix: run the frozen model up to the site once per batch, before the first
      step (:func:`jaxlens.train.site_values` on each batch's base and source), and at
      each step replace the site with the cached base value and apply the edit on top,
      reading the cached source value: the step then computes only what follows the site
      (the prefix is dead code in its jitted program) and makes no source run. The same
      losses and parameters as without it, to rounding. It holds two site values per
      example in memory. Needs ``frozen=True`` and a sequence of batches; see
      docs/trained_interventions.md for the conditions.

  Returns:
    a :class:`TrainResult`.

  Raises:
    InvalidArgumentError: ``prefix_not_cacheable`` (``cache_prefix=True`` with
      ``frozen=False``, batches given as a function of the step, a model that draws random
      numbers or writes a collection, a site that fires several times per call or inside
      a scanned stack); ``invalid_argument`` (a batch without ``base``, ``source`` or
      ``label``, no batches, a step count or interval that is not a positive int, an
      optimiser that is not an optax transformation, ``params`` lacking the method's entries,
      a readout that does not return logits); ``shape_mismatch`` (labels that are not int
      class indices of the logits' leading shape); ``index_out_of_range`` (labels outside
      ``[0, classes)``, ``fields["batch"]`` names the batch);
      ``batch_not_finite`` / ``loss_not_finite``: a batch holding NaN or infinity, or a step
      whose loss or gradient is not (``fields["batch"]``, ``fields["step"]``): training stops
      before that step changes the parameters or reaches a checkpoint.
    jaxlens.CheckpointError: the checkpoint directory is a file, locked by another run,
      damaged, of another configuration (``checkpoint_mismatch``) or unwritable
      (``disk_full``).
  """
  _check_batches(batches, ("base", "source", "label") if method.needs_source else ("base", "label"))
  optimizer = _default_optimizer(1e-3) if optimizer is None else optimizer
  steps_total = steps if steps is not None else (None if callable(batches) else len(batches))
  temperature_of = getattr(method, "temperature", None)
  _check_params(method, params)
  if boundary_weight and not (isinstance(params, dict) and "boundary" in params):
    raise InvalidArgumentError(  # (it was ignored: a loss without the term asked for)
      f"boundary_weight={boundary_weight!r} weighs Boundless DAS's boundary; "
      f"{type(method).__name__}'s parameters have none",
      code="invalid_argument",
      fix="boundary_weight=0.0, or method=BoundlessDAS()",
      received=repr(boundary_weight),
    )
  if cache_prefix:
    _cache.check_cacheable(frozen, batches)
    batches = _cache.iit_batches(model, variables, site, batches, method.needs_source)
  classes = {"n": None}  # the readout's class count, known once the loss is traced

  def check_batch(batch, index):
    if not getattr(batch["label"], "is_fully_addressable", True):
      return  # split over processes: each checks nothing it cannot read
    labels = np.asarray(batch["label"])
    n = classes["n"]
    if labels.size and (labels.min() < 0 or (n is not None and labels.max() >= n)):
      raise InvalidArgumentError(
        f"batch {index}'s labels must be class indices in [0, {n}) (the readout's classes), "
        f"got values from {labels.min()} to {labels.max()}",
        code="index_out_of_range",
        fix="labels in [0, classes), or a readout with as many classes as the labels need",
        batch=index,
      )

  def loss_of(p, v, batch, step):
    t = None
    if temperature_of is not None:
      t = temperature_of(jnp.asarray(step, float), steps_total or 1)
    out = intervened_output(
      model,
      v,
      site,
      method,
      p,
      batch["base"],
      batch.get("source"),
      positions=positions,
      temperature=t,
      subspaces=batch.get("subspaces"),
      site_values=batch.get(_cache.CACHE_KEY),
      output_positions=_last_only(model, readout, batch["base"]),
    )
    logits = readout(out)
    classes["n"] = _check_labels(logits, batch["label"])
    loss = jnp.mean(_cross_entropy(logits, batch["label"]))
    if boundary_weight and "boundary" in p:
      loss = loss + boundary_weight * jnp.sum(jnp.clip(p["boundary"], 1e-3, 1.0))
    return loss

  return _loop(
    loss_of,
    params,
    variables,
    batches,
    steps=steps,
    optimizer=optimizer,
    frozen=frozen,
    mesh=mesh,
    data_axis=data_axis,
    checkpoint=checkpoint,
    checkpoint_every=checkpoint_every,
    progress=progress,
    desc=f"IIT {type(method).__name__}",
    nonfinite=nonfinite,
    check_batch=check_batch,
    # What loss_of closes over (the step count only where a temperature schedule reads it).
    key=(
      "iit",
      ByIdentity(model),
      _key_part(site),
      _key_part(method),
      _key_part(positions),
      _key_part(readout),
      _key_part(boundary_weight),
      steps_total if temperature_of is not None else None,
    ),
  )


def iia(
  model,
  variables,
  site,
  method,
  params,
  batches,
  *,
  positions=None,
  readout: Callable = last_position,
  temperature=None,
  cache_prefix: bool = False,
) -> float:
  """Interchange intervention accuracy: the fraction of examples whose intervened output
  predicts the counterfactual label (``argmax(readout(output)) == label``).

  With ``cache_prefix=True`` the site's values on each batch's base and source are captured
  first (:func:`jaxlens.train.site_values`) and the evaluation replaces the site with them,
  as :func:`train_iit`'s ``cache_prefix`` does: the same predictions, by the program a
  cached training step runs (the prefix before the site is dead code in it, and no source
  run is made). One call does the same work either way (the capture runs the prefix).
  Refused with ``prefix_not_cacheable`` where a cached value would be wrong (a model that
  draws random numbers or writes a collection, a site that fires several times per call
  or inside a scanned stack).
  """

  # The variables are an argument, not a closure constant (XLA would fold a model's weights).
  def hits_of(p, variables, batch):
    out = intervened_output(
      model,
      variables,
      site,
      method,
      p,
      batch["base"],
      batch.get("source"),
      positions=positions,
      temperature=temperature,
      subspaces=batch.get("subspaces"),
      site_values=batch.get(_cache.CACHE_KEY),
      output_positions=_last_only(model, readout, batch["base"]),
    )
    guess = jnp.argmax(readout(out), axis=-1)
    return jnp.sum(guess == jnp.asarray(batch["label"]).astype(guess.dtype)), guess.size

  # One program per configuration, as the loops' steps (see _program).
  key = (
    "iia",
    ByIdentity(model),
    _key_part(site),
    _key_part(method),
    _key_part(positions),
    _key_part(readout),
    _key_part(temperature),
  )
  hits = _program(key, lambda: jax.jit(hits_of))
  batches = [batches] if isinstance(batches, dict) else list(batches)
  _check_batches(batches, ("base", "source", "label") if method.needs_source else ("base", "label"))
  if cache_prefix:
    batches = _cache.iit_batches(model, variables, site, batches, method.needs_source)
  right = total = 0
  for batch in batches:
    h, n = hits(params, variables, batch)
    right += int(h)
    total += int(n)
  return _accuracy(right, total, "iia")


def _accuracy(right: int, total: int, name: str) -> float:
  if not total:
    raise InvalidArgumentError(
      f"{name}: the batches hold no examples, whose accuracy is undefined (it read as 0.0)",
      code="invalid_argument",
      fix="batches of one example or more",
    )
  return right / total


# --------------------------------------------------------------------------
# ReFT: fine-tuning a frozen language model through a trained intervention.


def answer_batch(pairs, pad_token: int = 0):
  """Right-padded ``(tokens, targets, weights)`` arrays from ``(prompt, answer)`` pairs.

  ``tokens`` is prompt + answer; ``targets[:, t]`` is the token at ``t + 1``; ``weights``
  is 1 where that token belongs to the answer (the loss is on the answer tokens only)
  and 0 on the prompt and the padding.
  """
  rows = [list(map(int, p)) + list(map(int, a)) for p, a in pairs]
  width = max(len(r) for r in rows)
  tokens = np.full((len(rows), width), pad_token, np.int32)
  targets = np.full((len(rows), width), pad_token, np.int32)
  weights = np.zeros((len(rows), width), np.float32)
  for i, ((p, _), row) in enumerate(zip(pairs, rows)):
    tokens[i, : len(row)] = row
    targets[i, : len(row) - 1] = row[1:]
    weights[i, len(p) - 1 : len(row) - 1] = 1.0
  return {"tokens": tokens, "targets": targets, "weights": weights}


def _check_pairs(pairs):
  if isinstance(pairs, (str, bytes, dict)) or not isinstance(pairs, Sequence) or not len(pairs):
    raise InvalidArgumentError(
      f"pairs must be a non-empty sequence of (prompt_tokens, answer_tokens), got "
      f"{type(pairs).__name__}" + (" of length 0" if hasattr(pairs, "__len__") else ""),
      code="invalid_argument",
      fix="pairs=[([1, 2, 3], [4, 5]), ...]",
    )
  for i, pair in enumerate(pairs):
    try:
      prompt, answer = pair
      sizes = np.size(prompt), np.size(answer)
    except (TypeError, ValueError):
      sizes = None
    if sizes is None or min(sizes) < 1:
      raise InvalidArgumentError(
        f"pairs[{i}] is not a (prompt_tokens, answer_tokens) pair of non-empty token lists",
        code="invalid_argument",
        fix="pairs=[([1, 2, 3], [4, 5]), ...]",
        received=repr(pair)[:80],
      )
    for part in (prompt, answer):
      try:
        tokens = np.asarray(part)
        tokens = tokens if tokens.ndim == 1 else np.asarray([np.nan])
      except (TypeError, ValueError):
        tokens = np.asarray([np.nan])
      ok = tokens.dtype.kind in "iu" or (
        tokens.dtype == object and all(_token_id(t) for t in tokens.tolist())
      )
      if not ok or (tokens.dtype.kind in "iu" and (tokens.min() < 0 or tokens.max() >= 2**31)):
        raise InvalidArgumentError(
          f"pairs[{i}] holds a token id that is not an int in [0, 2**31), or is not a flat "
          f"list of them: {part!r:.80}",
          code="invalid_argument",
          fix="token ids from the tokenizer (ints)",
          received=repr(pair)[:80],
        )


def _token_id(t) -> bool:
  return isinstance(t, (int, np.integer)) and not isinstance(t, bool) and 0 <= t < 2**31


def _check_seed(seed):
  if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or not 0 <= seed < 2**32:
    raise InvalidArgumentError(
      f"seed must be an int in [0, 2**32), got {seed!r}",
      code="invalid_seed",
      fix="seed=0",
      received=repr(seed),
    )


def train_reft(
  model,
  variables,
  site,
  method,
  params,
  pairs,
  *,
  steps: int,
  batch_size: int = 8,
  optimizer=None,
  pad_token: int = 0,
  seed: int = 0,
  mesh=None,
  data_axis: str = "data",
  checkpoint=None,
  checkpoint_every: int = 50,
  progress: bool = True,
  nonfinite: str = "raise",
  cache_prefix: bool = False,
) -> TrainResult:
  """Representation fine-tuning on ``(prompt, answer)`` token pairs, the model frozen.

  The intervention (``LoReFT(rank)`` or ``DiReFT(rank)``) is applied at every position of
  ``site``, as it will be during :func:`jaxlens.generate`; the loss is the next-token
  cross-entropy on the answer tokens only (:func:`answer_batch`).

  Args:
    model: an unbound Flax linen language model returning ``(batch, seq, vocab)`` logits.
    variables: its variables (never changed).
    site: the intervened site (e.g. ``"blocks_3/resid_post"``).
    method: ``LoReFT(rank)`` or ``DiReFT(rank)``.
    params: the method's initial parameters.
    pairs: a sequence of ``(prompt_tokens, answer_tokens)``.
    steps: optimiser steps.
    batch_size: examples per step (batches are drawn by a seeded permutation per epoch).
    optimizer: an optax optimiser (default ``optax.adam(4e-3)``).
    pad_token: the padding token.
    seed: the shuffling seed.
    mesh, data_axis, checkpoint, checkpoint_every, progress: as :func:`train_iit`.
    nonfinite: ``"raise"`` or ``"skip"``, as :func:`train_iit`. The token batches are always
      finite; a step's loss is not when the model's output is not (a token id past the
      vocabulary reads a NaN embedding row, for example): ``loss_not_finite`` names the
      step and the indices of the batch's pairs (``fields["pairs"]``).
    cache_prefix: run the frozen model up to the site once for every pair, before the
      first step (in chunks of ``batch_size``), and at each step replace the site with the
      cached values of the batch's pairs and apply the edit on top: the step computes only
      what follows the site. The same losses and parameters as without it, to rounding;
      it holds one site value (``(tokens, d)``) per pair in memory. Batches are drawn
      from the pairs anew each epoch, so an example's site value must not depend on the
      other examples of its batch: checked on the first batch.

  Returns:
    a :class:`TrainResult`.

  Raises:
    InvalidArgumentError: ``prefix_not_cacheable`` (with ``cache_prefix=True``: a model
      that draws random numbers or writes a collection, a site that fires several times
      per call or inside a scanned stack, an example whose site value depends on the
      other examples of its batch); ``invalid_argument`` (no pairs, a pair that is not two non-empty
      lists of token ids in ``[0, 2**31)``, a step count or batch size that is not a positive
      int), ``invalid_seed``, ``loss_not_finite`` (see ``nonfinite``).
    jaxlens.CheckpointError: as :func:`train_iit`.
  """
  _check_pairs(pairs)
  _check_nonfinite(nonfinite)
  steps = _positive_int(steps, "steps", "steps=200")
  batch_size = _positive_int(batch_size, "batch_size", "batch_size=8")
  _check_seed(seed)
  if not _token_id(pad_token):
    raise InvalidArgumentError(
      f"pad_token must be a token id (an int in [0, 2**31)), got {pad_token!r}",
      code="invalid_argument",
      fix="pad_token=0",
      received=repr(pad_token),
    )
  if method.needs_source:
    raise InvalidArgumentError(
      f"train_reft trains a ReFT method (LoReFT, DiReFT, ...); {type(method).__name__} "
      "interchanges with a source run",
      code="invalid_argument",
      fix="train_iit(...) for the interchange methods",
    )
  _check_params(method, params)
  optimizer = _default_optimizer(4e-3) if optimizer is None else optimizer
  data = answer_batch(pairs, pad_token)
  # The loss reads the logits at the answer's positions only: each row's, padded to the
  # widest answer (weight 0), so the last block and the unembedding run there alone.
  answers = _outputs.answer_positions(data["weights"])
  if answers is not None:
    at, real = answers
    data["targets"] = np.take_along_axis(data["targets"], at, axis=1)
    data["weights"] = np.take_along_axis(data["weights"], at, axis=1) * real
    data["at"] = at
  n = len(pairs)
  batch_size = min(batch_size, n)
  per_epoch = n // batch_size
  orders = {}

  def pairs_at(step):
    epoch, i = divmod(step, per_epoch)
    if epoch not in orders:
      orders.clear()
      orders[epoch] = np.random.default_rng([seed, epoch]).permutation(n)
    return orders[epoch][i * batch_size : (i + 1) * batch_size]

  cached = None
  if cache_prefix:
    cached = _cache.reft_rows(model, variables, site, data["tokens"], batch_size, pairs_at(0))

  def batch_at(step):
    idx = pairs_at(step)
    batch = {k: v[idx] for k, v in data.items()}
    if cached is not None:
      batch[_cache.CACHE_KEY] = cached[idx]
    return batch

  selector = as_selector(site)

  def loss_of(p, v, batch, step):
    spec = _spec(selector, method.edit(p), None, batch.get(_cache.CACHE_KEY))
    if "at" in batch:
      out = _outputs.output_at(model, v, spec, batch["tokens"], batch["at"], [site])
    else:
      out = spec.bind(model)(v, batch["tokens"])
    ce = _cross_entropy(out, batch["targets"])
    w = batch["weights"].astype(ce.dtype)
    return jnp.sum(ce * w) / jnp.maximum(jnp.sum(w), 1.0)

  return _loop(
    loss_of,
    params,
    variables,
    batch_at,
    steps=steps,
    optimizer=optimizer,
    frozen=True,
    mesh=mesh,
    data_axis=data_axis,
    checkpoint=checkpoint,
    checkpoint_every=checkpoint_every,
    progress=progress,
    desc=f"ReFT {type(method).__name__}",
    nonfinite=nonfinite,
    pairs_of=lambda step: [int(i) for i in pairs_at(step)],
    key=("reft", ByIdentity(model), _key_part(site), _key_part(method)),
  )


__all__ = [
  "TrainResult",
  "answer_batch",
  "iia",
  "intervened_output",
  "last_position",
  "train_iit",
  "train_reft",
]
