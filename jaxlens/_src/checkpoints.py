"""Checkpoints of a training loop's state with orbax: the one helper ``jaxlens.train`` and
``jaxlens.sae.train`` share.

A :class:`Checkpoints` wraps an orbax ``CheckpointManager`` over a directory: ``save(step,
state)`` every ``every`` steps (the last two kept), ``restore(template)`` the latest one in
the template's structure, dtypes and shapes. With ``meta=True`` each checkpoint also holds a
JSON-able dict (what the loop needs besides arrays: how many batches it consumed, its metric
history, the state's structure), restorable on its own before the state, so a loop can check
that a checkpoint is its own before restoring it. Orbax writes each checkpoint to a temporary
directory and renames it when complete, so a crash mid-save leaves the previous one; with
several processes every process calls ``save`` and ``restore``.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp

from jaxlens._src.optional import require

__all__ = ["Checkpoints"]


class Checkpoints:
  """An orbax ``CheckpointManager`` of one state pytree (and, with ``meta=True``, a JSON dict).

  Args:
    directory: the checkpoint directory (created).
    every: steps between checkpoints (``save(step, ...)`` saves when ``step % every == 0``).
    meta: whether checkpoints hold a JSON dict beside the state.
    feature, extra: what the missing-orbax error names.
  """

  def __init__(
    self, directory, every: int, *, meta: bool = False, feature="checkpoints", extra="train"
  ):
    self.ocp = require("orbax.checkpoint", feature=feature, extra=extra, package="orbax-checkpoint")
    options = self.ocp.CheckpointManagerOptions(max_to_keep=2, create=True)
    self.every = every
    self.meta = meta
    self.manager = self.ocp.CheckpointManager(
      os.path.abspath(directory),
      options=options,
      item_names=("state", "meta") if meta else None,
    )

  def latest_step(self):
    """The latest checkpoint's step, or None."""
    return self.manager.latest_step()

  def restore_meta(self) -> dict | None:
    """The latest checkpoint's JSON dict (``meta=True``), or None without a checkpoint."""
    step = self.manager.latest_step()
    if step is None:
      return None
    out = self.manager.restore(step, args=self.ocp.args.Composite(meta=self.ocp.args.JsonRestore()))
    return dict(out["meta"])

  def restore(self, template):
    """The latest checkpoint's state, in ``template``'s structure, dtypes and shapes; None
    without a checkpoint."""
    step = self.manager.latest_step()
    if step is None:
      return None
    abstract = jax.tree.map(
      lambda a: jax.ShapeDtypeStruct(jnp.shape(a), jnp.asarray(a).dtype), template
    )
    if not self.meta:
      return self.manager.restore(step, args=self.ocp.args.StandardRestore(abstract))
    out = self.manager.restore(
      step, args=self.ocp.args.Composite(state=self.ocp.args.StandardRestore(abstract))
    )
    return out["state"]

  def save(self, step: int, state, meta: dict | None = None, force: bool = False):
    """Saves ``state`` (and ``meta``) as checkpoint ``step`` when ``step % every == 0`` or
    ``force``."""
    if not (force or step % self.every == 0):
      return
    if self.meta:
      args = self.ocp.args.Composite(
        state=self.ocp.args.StandardSave(state), meta=self.ocp.args.JsonSave(meta or {})
      )
    else:
      args = self.ocp.args.StandardSave(state)
    self.manager.save(step, args=args, force=True)

  def close(self):
    """Waits for pending saves and releases the manager."""
    self.manager.wait_until_finished()
    self.manager.close()
