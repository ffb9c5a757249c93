"""Checkpoints of a training loop's state with orbax: the one helper ``jaxlens.train`` and
``jaxlens.sae.train`` share.

A :class:`Checkpoints` wraps an orbax ``CheckpointManager`` over a directory: ``save(step,
state, meta)`` every ``every`` steps (the last two kept), ``restore(template)`` the latest one
in the template's structure, dtypes and shapes. Each checkpoint holds the state and a JSON dict
(what the loop needs besides arrays: how many batches it consumed, its metric history) with the
state's signature (its structure and each leaf's shape and dtype), checked before the state is
read, so a loop never resumes from a checkpoint of another configuration, and a CRC-32 of each
leaf, checked after (a flipped byte in an array's file is not a silently different state); the
JSON dict holds its own CRC-32 too.

Every failure is a :class:`CheckpointError` naming the directory and the cause: a path that is
a file (``checkpoint_path_invalid``), a directory another process is training into
(``checkpoint_locked``: process 0 of a job holds an ``flock`` on ``.jaxlens-lock`` in the
directory while the manager is open), a damaged step (``checkpoint_corrupt``), another
configuration (``checkpoint_mismatch``), a full disk (``disk_full``) or another refused write
(``checkpoint_save_failed``). Saves are synchronous: orbax's asynchronous saves leave
non-daemon threads waiting minutes for a signal after a failed write, so the process could not
exit. Orbax writes each checkpoint to a temporary directory and renames it when complete, so a
crash mid-save leaves the previous one. A step is saved once: a loop that ends on a checkpoint
step, or is called again after it finished, does not write it again.
"""

from __future__ import annotations

import errno
import gc
import json
import glob
import os
import shutil
import sys
import zlib

import jax
import jax.numpy as jnp
import numpy as np

from jaxlens._src.errors import InvalidArgumentError, JaxlensError
from jaxlens._src.optional import require

__all__ = ["CheckpointError", "Checkpoints", "signature"]

_LOCK = ".jaxlens-lock"
_FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


class CheckpointError(JaxlensError, OSError):
  """A training checkpoint directory that cannot be written, read or resumed.

  Attributes:
    fields: ``{"code": ..., "path": ..., "fix": ...}``; codes: ``checkpoint_path_invalid``,
      ``checkpoint_locked``, ``checkpoint_corrupt``, ``checkpoint_mismatch``, ``disk_full``,
      ``checkpoint_save_failed``.
  """


def signature(state) -> dict:
  """What a checkpoint must share with a run to resume it: the state's structure and each
  leaf's shape and dtype."""
  leaves, treedef = jax.tree.flatten(state)
  return {
    "treedef": str(treedef),
    "leaves": [[list(np.shape(a)), str(jnp.result_type(a))] for a in leaves],
  }


def _checksums(state) -> list | None:
  """A CRC-32 of each leaf's bytes (None when a leaf is split over processes: each process
  holds only its part)."""
  leaves = jax.tree.leaves(state)
  if not all(getattr(a, "is_fully_addressable", True) for a in leaves):
    return None
  return [_crc(jax.device_get(a)) for a in leaves]


def _crc(array) -> int:
  # A view of the bytes, not a copy (a bfloat16 array has no buffer of its own type).
  return zlib.crc32(np.ascontiguousarray(array).view(np.uint8).reshape(-1).data)


def _json_crc(obj) -> int:
  return zlib.crc32(json.dumps(obj, sort_keys=True).encode())


def _drop_orbax_leftovers():
  """Collects the coroutines a failed orbax restore leaves unfinished, now, without their
  "coroutine ignored GeneratorExit" reports (they would surface at a random later point)."""
  hook = sys.unraisablehook
  sys.unraisablehook = lambda unraisable: None
  try:
    gc.collect()
  finally:
    sys.unraisablehook = hook


def _cause(error: BaseException) -> str:
  text = str(error).strip().splitlines()
  first = text[0] if text else ""
  return f"{type(error).__name__}: {first[:300]}"


def _is_full(error: BaseException) -> bool:
  """A full disk, as the OS says it (``ENOSPC``, a quota, a file-size limit) or as
  tensorstore reports it (``RESOURCE_EXHAUSTED``)."""
  seen = set()
  while error is not None and id(error) not in seen:
    seen.add(id(error))
    if isinstance(error, OSError) and error.errno in _FULL:
      return True
    text = str(error)
    if "RESOURCE_EXHAUSTED" in text or any(f"os_error_code='{c}'" in text for c in _FULL):
      return True
    error = error.__cause__ or error.__context__
  return False


def check_every(every, name: str = "checkpoint_every") -> int:
  """``every`` as a positive int, or an :class:`InvalidArgumentError` naming ``name``."""
  if isinstance(every, bool) or not isinstance(every, (int, np.integer)) or every < 1:
    raise InvalidArgumentError(
      f"{name} must be a positive int, got {every!r}",
      code="invalid_argument",
      fix=f"{name}=50",
      expected="int >= 1",
      received=repr(every),
    )
  return int(every)


class Checkpoints:
  """An orbax ``CheckpointManager`` of one state pytree and a JSON dict, locked while open.

  Use it as a context manager (or call :meth:`close`): closing releases the lock.

  Args:
    directory: the checkpoint directory (created).
    every: steps between checkpoints (``save(step, ...)`` saves when ``step % every == 0``).
    feature, extra: what the missing-orbax error names.
  """

  def __init__(self, directory, every: int, *, feature="checkpoints", extra="train"):
    self.every = check_every(every)
    self.ocp = require("orbax.checkpoint", feature=feature, extra=extra, package="orbax-checkpoint")
    try:
      given = os.fspath(directory)
      if not given:  # ("" is the current directory to abspath: a checkpoint in the cwd)
        raise TypeError
      self.path = os.path.abspath(given)
    except TypeError:
      raise CheckpointError(
        f"the checkpoint directory must be a path (a str or os.PathLike), got "
        f"{type(directory).__name__}" + (" '' (the current directory)" if directory == "" else ""),
        code="checkpoint_path_invalid",
        path=repr(directory)[:80],
        fix="checkpoint='runs/das' (a directory; it is created)",
      ) from None
    self.manager = None
    self._lock = None
    self._failed = False
    if os.path.exists(self.path) and not os.path.isdir(self.path):
      raise CheckpointError(
        f"the checkpoint directory {self.path} is a file",
        code="checkpoint_path_invalid",
        path=self.path,
        fix="checkpoint= a directory (it is created)",
      )
    try:
      os.makedirs(self.path, exist_ok=True)
    except OSError as error:
      raise self._write_error(error, "cannot be created") from error
    self._refuse_foreign_steps()
    if jax.process_index() == 0:
      self._lock = self._acquire_lock()
      # What a run killed mid-save left, removed here and now: orbax's own cleanup runs in a
      # thread that can race the first save of the same step (its files deleted under it).
      for leftover in glob.glob(os.path.join(glob.escape(self.path), "*.orbax-checkpoint-tmp*")):
        shutil.rmtree(leftover, ignore_errors=True)
    try:
      options = self.ocp.CheckpointManagerOptions(
        max_to_keep=2, create=True, enable_async_checkpointing=False
      )
      self.manager = self.ocp.CheckpointManager(
        self.path, options=options, item_names=("state", "meta")
      )
    except BaseException as error:
      self.close()
      if isinstance(error, Exception):
        raise self._read_error(error, None) from error
      raise

  def _refuse_foreign_steps(self):
    """Refuses a directory whose step-named entries (``1``, ``7``: what orbax takes for
    checkpoints) are not checkpoints: a user's folders. Orbax would read them as damaged
    checkpoints (whose fix, "delete it", would delete the user's files) and, past
    ``max_to_keep``, delete them itself."""
    try:
      names = os.listdir(self.path)
    except OSError:
      return  # (the makedirs or the lock reports an unreadable directory)
    marks = ("_CHECKPOINT_METADATA", "state", "meta")
    foreign = sorted(
      (n for n in names if n.isdigit() and not any(
        os.path.exists(os.path.join(self.path, n, m)) for m in marks
      )),
      key=int,
    )  # fmt: skip
    if foreign:
      raise CheckpointError(
        f"the checkpoint directory {self.path} holds {foreign[:5]}, which are not checkpoints "
        "but are named as checkpoint steps: they would be read as damaged checkpoints, and "
        "old steps are deleted by number",
        code="checkpoint_path_invalid",
        path=os.path.join(self.path, foreign[0]),
        fix="a checkpoint directory of its own (a new or empty one, e.g. a subdirectory)",
      )

  def _acquire_lock(self):
    import fcntl

    try:
      handle = open(os.path.join(self.path, _LOCK), "a+")
    except OSError as error:
      raise self._write_error(error, "cannot hold its lock file") from error
    try:
      fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as error:
      handle.close()
      if error.errno in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
        raise CheckpointError(
          f"another training run (process or thread) has the checkpoint directory {self.path} open",
          code="checkpoint_locked",
          path=self.path,
          fix="wait for it to finish, or give this run its own checkpoint directory",
        ) from None
      raise self._write_error(error, "cannot be locked") from error
    return handle

  def _write_error(self, error: BaseException, what: str) -> CheckpointError:
    if _is_full(error):
      return CheckpointError(
        f"the disk is full: the checkpoint directory {self.path} {what} ({_cause(error)})",
        code="disk_full",
        path=self.path,
        fix="free space and call again: training resumes from the last complete checkpoint",
      )
    return CheckpointError(
      f"the checkpoint directory {self.path} {what} ({_cause(error)})",
      code="checkpoint_save_failed",
      path=self.path,
      fix="a writable checkpoint directory; the last complete checkpoint is kept",
    )

  def _read_error(self, error: BaseException, step) -> CheckpointError:
    where = self.path if step is None else os.path.join(self.path, str(step))
    return CheckpointError(
      f"the checkpoint {where} is damaged or unreadable ({_cause(error)})",
      code="checkpoint_corrupt",
      path=where,
      fix=f"delete {where} to resume from the checkpoint before it, or a new directory",
    )

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()

  def _reading(self, step, read):
    """``read()``, or ``checkpoint_corrupt`` for the step. The error does not chain orbax's:
    its traceback would keep the coroutines of the failed read alive until some later
    collection reports them ("coroutine ignored GeneratorExit"), so they are collected now."""
    try:
      return read()
    except (Exception, RecursionError) as error:
      failed = self._read_error(error, step)
    self._failed = True
    _drop_orbax_leftovers()
    raise failed

  def latest_step(self):
    """The latest checkpoint's step, or None."""
    return self._reading(None, self.manager.latest_step)

  def restore_meta(self) -> dict | None:
    """The latest checkpoint's JSON dict, or None without a checkpoint."""
    step = self.latest_step()
    if step is None:
      return None
    args = self.ocp.args.Composite(meta=self.ocp.args.JsonRestore())
    meta = self._reading(step, lambda: self.manager.restore(step, args=args)["meta"])
    if not isinstance(meta, dict) or not isinstance(meta.get("signature"), dict):
      raise self._read_error(ValueError("its meta item is not a jaxlens checkpoint's"), step)
    meta = dict(meta)
    if meta.pop("meta_crc32", None) != _json_crc(meta):
      raise self._read_error(
        ValueError("its meta item differs from the CRC-32 saved with it"), step
      )
    return meta

  def restore(self, template, meta: dict | None = None):
    """The latest checkpoint's state, in ``template``'s structure, dtypes and shapes; None
    without a checkpoint. ``meta`` is :meth:`restore_meta`'s dict, if already read."""
    meta = self.restore_meta() if meta is None else meta
    if meta is None:
      return None
    step = self.latest_step()
    if meta["signature"] != signature(template):
      raise CheckpointError(
        f"the checkpoint {os.path.join(self.path, str(step))} is of another configuration (its "
        "state has another structure, shape or dtype than this run's)",
        code="checkpoint_mismatch",
        path=self.path,
        fix="a new checkpoint directory, or the configuration the checkpoint was written with",
      )
    abstract = jax.tree.map(
      lambda a: jax.ShapeDtypeStruct(jnp.shape(a), jnp.asarray(a).dtype), template
    )
    args = self.ocp.args.Composite(state=self.ocp.args.StandardRestore(abstract))

    def read():
      state = self.manager.restore(step, args=args)["state"]
      if jax.tree.structure(state) != jax.tree.structure(template):
        raise ValueError("the restored state has another structure")
      return state

    state = self._reading(step, read)
    saved = meta.get("checksums")
    if saved is not None and _checksums(state) not in (None, saved):
      raise self._read_error(
        ValueError("its values differ from the checksums saved with them"), step
      )
    return state

  def check_within(self, at: int, steps: int) -> None:
    """``checkpoint_mismatch`` when the checkpoint restored at step ``at`` is past the run's
    ``steps`` (its result would be another run's, longer than the one asked for)."""
    if at > steps:
      raise CheckpointError(
        f"the checkpoint {os.path.join(self.path, str(at))} is at step {at}, past this run's "
        f"steps={steps}",
        code="checkpoint_mismatch",
        path=self.path,
        fix=f"steps >= {at} to resume it, or a new checkpoint directory",
      )

  def save(self, step: int, state, meta: dict | None = None, force: bool = False) -> bool:
    """Saves ``state`` and ``meta`` as checkpoint ``step`` when ``step % every == 0`` or
    ``force``, unless checkpoint ``step`` exists. Returns whether it saved."""
    if not (force or step % self.every == 0):
      return False
    if self.latest_step() == step:
      return False
    meta = {**(meta or {}), "signature": signature(state), "checksums": _checksums(state)}
    meta["meta_crc32"] = _json_crc(meta)
    try:
      json.dumps(meta)
      args = self.ocp.args.Composite(
        state=self.ocp.args.StandardSave(state), meta=self.ocp.args.JsonSave(meta)
      )
      self.manager.save(step, args=args, force=True)
      self.manager.wait_until_finished()
    except Exception as error:
      failed = self._write_error(error, f"refused checkpoint {step}")
    else:
      return True
    for leftover in glob.glob(
      os.path.join(glob.escape(self.path), f"{step}.orbax-checkpoint-tmp*")
    ):
      shutil.rmtree(leftover, ignore_errors=True)  # the failed save's partial files
    self._failed = True
    _drop_orbax_leftovers()
    raise failed

  def close(self):
    """Waits for pending saves, releases the manager and the lock."""
    try:
      if self.manager is not None:
        manager, self.manager = self.manager, None
        try:
          manager.wait_until_finished()
        finally:
          manager.close()
    finally:
      if self._lock is not None:
        lock, self._lock = self._lock, None
        lock.close()  # closing the file releases the flock
      if self._failed:
        _drop_orbax_leftovers()  # what a failed read or save left, now its loop is closed
