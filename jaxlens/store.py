"""Activations to disk at dataset scale: collect sites over a dataset, read them back.

:func:`collect` runs one jitted :func:`jaxlens.trace` per batch of a dataset
iterator and streams the chosen sites' values to a directory, one
`safetensors <https://huggingface.co/docs/safetensors>`_ shard per batch;
:func:`open` reads them back as numpy or JAX arrays, or as an iterator of
batches for probe or sparse-autoencoder training.

The layout (a directory)::

  store.json                 the sites, their per-row shapes and dtypes, the batch count
  shard_000000.safetensors   batch 0: {label: array of (rows, *shape)}
  shard_000001.safetensors   ...
  COMPLETE                   written once the iterator is exhausted

Guarantees:

* **No partial batch is ever read back.** A shard is written to a temporary file
  and renamed into place (``os.replace``, atomic on POSIX), so a crash leaves
  either the whole shard or no shard (and maybe a ``shard_*.safetensors.tmp`` that
  is ignored and deleted on resume; no other file of the directory is touched).
* **Resumable.** ``collect`` on an existing store checks that its sites, shapes
  and dtypes are the same, skips the batches already on disk (the iterator must
  yield the same batches in the same order) and appends the rest.
* **One writer.** A collection holds an ``flock`` on ``.jaxlens-lock`` in the
  store while it writes; a second one (another process or thread) is refused
  with ``store_locked`` instead of deleting the first's partial shards. The
  lock dies with its process: a killed collection is resumed by the next call.
* **Bounded memory.** A background thread writes the shards; at most
  ``max_pending`` batches of site values wait for it, so host memory holds about
  ``max_pending + 1`` batches of activations however long the dataset.
* **Typed errors.** A path that is a file or cannot be created, a non-empty
  directory that is not a store, a store of other sites, and a full disk
  (checked before starting when the batch count is known, and on every write)
  raise :class:`StoreError` with a ``code`` and a ``fix``.

Why safetensors shards: one file per batch makes a crash-safe append trivial
(an atomic rename per batch, no shared metadata rewritten per batch), the files
are read with zero-copy memory maps, and they open unchanged in torch, numpy, JAX
and the Hugging Face tools that SAE trainers use. A chunked zarr array through
tensorstore (as orbax uses) gives one array per site, but a resumable append
would need its own record of which chunks are complete, and a batch that does not
fill a chunk is a partial write.

Example:
  >>> import jax, tempfile, jaxlens as jl
  >>> from jaxlens import store
  >>> from jaxlens.models import init_gpt
  >>> model, variables, tokens = init_gpt(0, n_layers=1, d_model=16, n_heads=2, max_len=4,
  ...                                     vocab_size=8, batch=2)
  >>> path = tempfile.mkdtemp() + "/acts"
  >>> s = store.collect(model, variables, [tokens, tokens], path, sites=["block_0"],
  ...                   progress=False)
  >>> s.num_rows, s.shape("block_0")
  (4, (4, 16))
"""

from __future__ import annotations

import errno
import json
import os
import queue
import shutil
import threading
import zlib
from collections.abc import Iterable, Iterator, Sequence, Sized
from pathlib import Path
from typing import Any

import jax
import numpy as np

from jaxlens import core as jl
from jaxlens.core import InvalidArgumentError, JaxlensError
from jaxlens.internal import api_boundary, json_loads, split_over_processes

__all__ = ["ActivationStore", "StoreError", "collect", "open"]

_META = "store.json"
_DONE = "COMPLETE"
_LOCK = ".jaxlens-lock"
_CRC = "jaxlens_crc32"
_FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
_VERSION = 1


class StoreError(JaxlensError, OSError):
  """The activation store cannot be written or read as asked.

  Attributes:
    fields: ``{"code": ..., "path": ..., "fix": ...}``; codes: ``store_path_invalid``,
      ``store_not_empty``, ``store_mismatch``, ``store_locked``, ``disk_full``,
      ``store_missing``, ``store_corrupt``, ``unknown_site``, ``store_not_local``,
      ``store_batch_invalid``.
  """


def _as_path(path) -> Path:
  try:
    if not os.fspath(path):  # (Path("") is the current directory: a store in the cwd)
      raise TypeError
    return Path(path)
  except TypeError:
    raise StoreError(
      f"a store path must be a str or os.PathLike, got {type(path).__name__}"
      + (" '' (the current directory)" if path == "" else ""),
      code="store_path_invalid",
      path=repr(path)[:80],
      fix="path='acts/layer_3' (a directory)",
    ) from None


def _shard(root: Path, i: int) -> Path:
  return root / f"shard_{i:06d}.safetensors"


def _committed(root: Path) -> int:
  """The number of consecutive shards from 0 on disk (later ones are ignored)."""
  n = 0
  while _shard(root, n).exists():
    n += 1
  return n


def _disk_full(path, error=None) -> StoreError:
  return StoreError(
    f"no space left on the device of {path}" + (f": {error}" if error else ""),
    code="disk_full",
    path=str(path),
    fix="free space or collect to another path; collect() again resumes "
    "after the last complete batch",
  )


def _prepare(root: Path, meta: dict, overwrite: bool):
  """Creates or checks the store directory and locks it; returns the indices of the batches
  already there and the lock (an open file: closing it releases the lock)."""
  if root.exists() and not root.is_dir():
    raise StoreError(
      f"{root} is a file, not a store directory",
      code="store_path_invalid",
      path=str(root),
      fix="collect(..., path=<a new or existing directory>)",
    )
  try:
    root.mkdir(parents=True, exist_ok=True)
  except OSError as error:
    if error.errno in _FULL:
      raise _disk_full(root, error) from error
    raise StoreError(
      f"cannot create the store directory {root}: {error}",
      code="store_path_invalid",
      path=str(root),
      fix="a path in a writable directory",
    ) from error
  if not os.access(root, os.W_OK):
    raise StoreError(
      f"the store directory {root} is not writable",
      code="store_path_invalid",
      path=str(root),
      fix="a path in a writable directory",
    )
  if not (root / _META).exists() and any(
    p.name not in (_META + ".tmp", _LOCK) for p in root.iterdir()
  ):
    raise _not_a_store(root)  # (refused before a lock file is left in it)
  lock = _lock(root)
  try:
    return _prepare_locked(root, meta, overwrite), lock
  except BaseException:
    lock.close()
    raise


def _not_a_store(root: Path) -> StoreError:
  return StoreError(
    f"{root} is a non-empty directory that is not an activation store",
    code="store_not_empty",
    path=str(root),
    fix="an empty or new directory, or collect(..., overwrite=True) on a store",
  )


def _lock(root: Path):
  """An ``flock`` on the store's lock file, held while one collection writes into it: a
  second collection (another process or thread) would delete the first's partial shards
  and interleave its batches."""
  import fcntl

  try:
    handle = (root / _LOCK).open("a+")
  except OSError as error:
    if error.errno in _FULL:
      raise _disk_full(root, error) from error
    raise StoreError(
      f"cannot create the lock file of the store directory {root}: {error}",
      code="store_path_invalid",
      path=str(root),
      fix="a path in a writable directory",
    ) from error
  try:
    fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
  except OSError as error:
    handle.close()
    if error.errno not in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
      raise
    raise StoreError(
      f"another collection (process or thread) is writing into the store {root}",
      code="store_locked",
      path=str(root),
      fix="wait for it to finish (then collect() again returns the store), or another path",
    ) from None
  return handle


def _is_shard_name(name: str) -> bool:
  """Whether ``name`` is a shard's (``shard_NNNNNN.safetensors``)."""
  index = name[len("shard_") : -len(".safetensors")]
  return name.startswith("shard_") and name.endswith(".safetensors") and index.isdigit()


def _is_own_tmp(name: str) -> bool:
  """Whether ``name`` is a temporary file this module writes (``store.json.tmp``, or a shard's
  ``shard_NNNNNN.safetensors.tmp``): a user's own ``*.tmp`` beside the store is not one."""
  return name == _META + ".tmp" or (name.endswith(".safetensors.tmp") and _is_shard_name(name[:-4]))


def _is_own(entry: Path) -> bool:
  """Whether ``entry`` is one of the files a store writes."""
  name = entry.name
  own = name in (_META, _DONE) or _is_own_tmp(name)
  return entry.is_file() and (own or _is_shard_name(name))


def _prepare_locked(root: Path, meta: dict, overwrite: bool) -> set[int]:
  if overwrite and (root / _META).exists():
    entries = [e for e in root.iterdir() if e.name != _LOCK]
    foreign = sorted(e.name for e in entries if not _is_own(e))
    if foreign:  # (overwrite deleted every entry: the user's files beside the store too)
      raise StoreError(
        f"{root} holds files that are not the store's ({foreign[:5]}); overwrite=True would "
        "delete them with the store",
        code="store_not_empty",
        path=str(root / foreign[0]),
        fix="move them out of the store directory, or collect into a new directory",
      )
    for entry in entries:
      entry.unlink()
  if not (root / _META).exists():
    # A process killed while creating the store leaves only its store.json.tmp: empty.
    if all(p.name in (_META + ".tmp", _LOCK) for p in root.iterdir()):
      (root / (_META + ".tmp")).unlink(missing_ok=True)
    if any(p.name != _LOCK for p in root.iterdir()):
      raise _not_a_store(root)
    _write_json(root / _META, meta)
    return set()
  old = _read_meta(root)
  if {k: old.get(k) for k in ("version", "sites")} != {k: meta[k] for k in ("version", "sites")}:
    raise StoreError(
      f"{root} holds other sites, shapes or dtypes ({old.get('sites')}) than this "
      f"collection ({meta['sites']})",
      code="store_mismatch",
      path=str(root),
      fix="another path, or collect(..., overwrite=True) to replace it",
    )
  for tmp in root.glob("*.tmp"):
    if _is_own_tmp(tmp.name):  # (a user's own *.tmp in the directory is left alone)
      tmp.unlink()
  return _present(root)


def _present(root: Path) -> set[int]:
  """The indices of the shards on disk whose header reads (a shard cut short does not)."""
  from safetensors import safe_open

  present = set()
  for p in root.glob("shard_*.safetensors"):
    index = p.name[len("shard_") : -len(".safetensors")]
    if not index.isdigit():
      continue
    try:
      with safe_open(str(p), framework="numpy"):
        pass
    except Exception:  # safetensors raises its own SafetensorError
      p.unlink()  # recomputed by this collection
      continue
    present.add(int(index))
  return present


def _complete_count(root: Path) -> int | None:
  """The batch count ``COMPLETE`` records (None without it); a damaged marker is
  ``store_corrupt``."""
  try:
    text = (root / _DONE).read_text()
  except FileNotFoundError:
    return None
  except (OSError, UnicodeDecodeError) as error:
    text = f"<{error}>"
  if not text.strip().isdigit():
    raise StoreError(
      f"{root / _DONE} does not hold a batch count: {text[:40]!r}",
      code="store_corrupt",
      path=str(root / _DONE),
      fix="delete it and collect() again with the same batches: it resumes",
    )
  return int(text)


def _read_meta(root: Path) -> dict:
  """``store.json``, checked: a truncated or altered one is ``store_corrupt``."""
  try:
    meta = json_loads((root / _META).read_text())
    sites = meta["sites"]
    ok = isinstance(sites, dict) and all(
      isinstance(v, dict)
      and isinstance(v.get("shape"), list)
      and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in v["shape"])
      and isinstance(v.get("dtype"), str)
      for v in sites.values()
    )
    if ok:
      for v in sites.values():
        np.dtype(v["dtype"])
  except (OSError, ValueError, KeyError, TypeError, UnicodeDecodeError) as error:
    ok, why = False, f"{type(error).__name__}: {error}"
  else:
    why = "its sites are malformed"
  if not ok:
    raise StoreError(
      f"{root / _META} cannot be read ({why})",
      code="store_corrupt",
      path=root / _META,
      fix="the store's metadata is damaged: collect(..., overwrite=True) to rebuild it",
    )
  return meta


def _write_json(path: Path, obj) -> None:
  """Writes ``path`` atomically; a failed write leaves nothing (a full disk is ``disk_full``)."""
  tmp = path.with_name(path.name + ".tmp")
  try:
    tmp.write_text(json.dumps(obj, indent=1))
    os.replace(tmp, path)
  except OSError as error:
    tmp.unlink(missing_ok=True)
    if error.errno in _FULL:
      raise _disk_full(path.parent, error) from error
    raise


def _crc(array: np.ndarray) -> int:
  return zlib.crc32(np.ascontiguousarray(array).view(np.uint8).reshape(-1).data)


def _save_shard(arrays: dict, path: Path) -> None:
  """Writes one shard atomically: a temporary file, then a rename. Its header holds each
  site's CRC-32, checked when the site is read."""
  from safetensors.numpy import save

  data = save(arrays, metadata={_CRC: json.dumps({k: _crc(v) for k, v in arrays.items()})})
  tmp = path.with_name(path.name + ".tmp")
  try:
    with tmp.open("wb") as f:  # a plain write: a full disk is an OSError with its errno
      f.write(data)
      f.flush()
      os.fsync(f.fileno())
    os.replace(tmp, path)
  except BaseException:
    tmp.unlink(missing_ok=True)
    raise


def _check_local(values: dict, root: Path) -> None:
  """Refuses site values split over processes: the writer can read only local shards."""
  split = sorted(k for k, v in values.items() if split_over_processes(v))
  if split:
    raise StoreError(
      f"the values of {split} are split over processes; this process cannot write them",
      code="store_not_local",
      path=str(root),
      site=split[0],
      fix="collect one store per process from its local rows (see docs/scaling.md), "
      "or gather the batch first",
    )


def _check_batch(values: dict, meta: dict, index: int, root: Path) -> None:
  """Batch ``index``'s site values have a rows axis and the first batch's per-row shape and
  dtype (another one was written, then read back as a damaged shard)."""
  for label, value in values.items():
    want = meta["sites"][label]
    shape, dtype = list(np.shape(value)[1:]), str(value.dtype)
    if np.ndim(value) and shape == want["shape"] and dtype == want["dtype"]:
      continue
    raise StoreError(
      f"batch {index} gives {label!r} as {tuple(np.shape(value))} {dtype}"
      + (
        ", with no rows axis"
        if not np.ndim(value)
        else f"; the first batch gave rows of {tuple(want['shape'])} {want['dtype']}"
      ),
      code="store_batch_invalid",
      path=str(root),
      site=label,
      batch=index,
      fix="batches of one per-row shape and dtype, each with a leading rows axis (the last "
      "may have fewer rows)",
    )


def _check_finite(arrays: dict, index: int, root: Path) -> None:
  """Refuses a batch whose site values hold NaN or infinity: stored, they would surface only
  later (an SAE trained on the store stops at ``batch_not_finite``, a probe learns NaN)."""
  for label, array in arrays.items():
    if not np.issubdtype(array.dtype, np.inexact) or np.isfinite(array).all():
      continue
    bad = int(array.size - np.count_nonzero(np.isfinite(array)))
    raise StoreError(
      f"batch {index} gives {label!r} with {bad} non-finite values (NaN or infinity) of "
      f"{array.size}; the batches before it are stored",
      code="store_batch_not_finite",
      path=str(root),
      site=label,
      batch=index,
      fix="find why the model overflows on this batch (its inputs, the dtype: float32 instead "
      "of float16), or collect(..., allow_nonfinite=True) to store them as they are",
    )


class _Writer(threading.Thread):
  """Writes queued ``(index, {label: array})`` batches; remembers the first error."""

  def __init__(self, root: Path, max_pending: int, on_written, allow_nonfinite: bool = False):
    super().__init__(daemon=True, name="jaxlens-store-writer")
    self.root, self.on_written, self.allow_nonfinite = root, on_written, allow_nonfinite
    self.queue: queue.Queue = queue.Queue(maxsize=max_pending)
    self.error: BaseException | None = None

  def run(self):
    while True:
      item = self.queue.get()
      if item is None:
        return
      if self.error is not None:
        continue  # drain without writing after a failure
      index, values = item
      try:
        arrays = {k: np.ascontiguousarray(np.asarray(v)) for k, v in values.items()}
        del values, item
        if not self.allow_nonfinite:
          _check_finite(arrays, index, self.root)
        _save_shard(arrays, _shard(self.root, index))
        self.on_written(arrays)
      except OSError as error:
        self.error = _disk_full(self.root, error) if error.errno in _FULL else error
      except BaseException as error:  # noqa: BLE001 (re-raised in the main thread)
        self.error = error

  def put(self, item):
    # A bounded put that notices a dead writer instead of blocking forever.
    while True:
      if self.error is not None:
        raise self.error
      try:
        self.queue.put(item, timeout=0.1)
        return
      except queue.Full:
        continue


def _selectors(sites):

  if isinstance(sites, (str, jl.Site)):
    sites = [sites]
  sites = list(sites or ())
  if not sites:
    raise InvalidArgumentError(
      "collect needs the sites to store",
      code="invalid_argument",
      fix='collect(..., sites=["block_0", "block_1"])',
    )
  return [jl.module(s) if isinstance(s, str) else s for s in sites]


def _runner(model, selectors: tuple, method, apply_kwargs: dict):
  """The jitted forward that returns the sites' values; one per model and sites."""

  def make():
    return jax.jit(
      lambda v, *x: (
        jl.trace(
          model, v, *x, save=list(selectors), keep_inputs=False, method=method, **apply_kwargs
        ).values
      )
    )

  try:
    key = (model, selectors, method, tuple(sorted(apply_kwargs.items())))
    hash(key)
  except TypeError:  # an unhashable model or keyword: compile for this call only
    return make()
  if key not in _RUNNERS:
    _RUNNERS[key] = make()
  return _RUNNERS[key]


_RUNNERS: dict = {}


@api_boundary
def collect(
  model,
  variables,
  batches: Iterable,
  path,
  *,
  sites: Sequence[Any],
  num_batches: int | None = None,
  overwrite: bool = False,
  max_pending: int = 2,
  progress: bool = True,
  allow_nonfinite: bool = False,
  method=None,
  **apply_kwargs,
) -> ActivationStore:
  """Runs the model over ``batches`` and streams the ``sites``' values to ``path``.

  Args:
    model: an unbound linen module.
    variables: its variables.
    batches: an iterable of model inputs, one batch each (an array, or a tuple of
      the model's positional inputs). Every batch must give the sites the same
      per-row shape; the last may have fewer rows. On resume it must yield the
      same batches in the same order.
    path: the store directory (created; an existing store of the same sites is
      resumed after its last complete batch).
    sites: module paths (``"block_0"``, globs allowed) or selectors; every site
      they select is stored under its label.
    num_batches: the number of batches, for the progress bar and the free-space
      check (default ``len(batches)`` when it has one).
    overwrite: replace an existing store at ``path`` instead of resuming it.
    max_pending: batches computed but not yet written that may wait in memory.
    progress: show a tqdm progress bar.
    allow_nonfinite: store site values that hold NaN or infinity (refused by default:
      ``store_batch_not_finite``).
    method, **apply_kwargs: passed to :func:`jaxlens.trace`.

  Returns:
    The :class:`ActivationStore` at ``path``.

  Raises:
    StoreError: ``store_path_invalid``, ``store_not_empty``, ``store_mismatch``,
      ``store_locked`` (another collection is writing into ``path``), ``disk_full``,
      ``store_batch_invalid`` (a batch whose site values have no rows axis, or another
      per-row shape or dtype than the first batch's; the batches before it are kept),
      ``store_batch_not_finite`` (site values with NaN or infinity; the batches before it are
      kept, so a corrected dataset resumes after them).
  """
  root = _as_path(path)
  selectors = _selectors(sites)
  if num_batches is None and isinstance(batches, Sized):
    num_batches = len(batches)
  for name, value, allowed in (
    ("num_batches", num_batches, None),
    ("max_pending", max_pending, ...),
  ):
    if (value is None and allowed is None) or (
      isinstance(value, (int, np.integer)) and not isinstance(value, bool) and value >= 1
    ):
      continue
    raise InvalidArgumentError(
      f"{name} must be a positive int{' or None' if allowed is None else ''}, got {value!r}",
      code="invalid_argument",
      fix=f"{name}={'None' if allowed is None else 2}",
      received=repr(value),
    )

  run = _runner(model, tuple(selectors), method, apply_kwargs)
  iterator = iter(batches)
  try:
    first = next(iterator)
  except StopIteration:
    first = None
  as_args = lambda b: b if isinstance(b, tuple) else (b,)
  if first is None:
    raise StoreError(
      "collect was given no batches",
      code="store_empty_dataset",
      path=str(root),
      fix="an iterable that yields at least one batch",
    )
  try:
    shapes = jax.eval_shape(run, variables, *as_args(first))
  except TypeError as error:
    _refuse_model_keyword(error, apply_kwargs)
    raise
  meta = {
    "version": _VERSION,
    "sites": {k: {"shape": list(s.shape[1:]), "dtype": str(s.dtype)} for k, s in shapes.items()},
  }
  _check_batch(shapes, meta, 0, root)  # a rows axis (a scalar site has none)
  present, lock = _prepare(root, meta, overwrite)
  with lock:  # held until the store is complete or the collection fails
    total = _complete_count(root)
    if total is not None:
      if present == set(range(total)):
        return ActivationStore(root)
      (root / _DONE).unlink()  # a shard missing or damaged, or a wrong count: collect again
    done = len(present)
    row_bytes = sum(
      int(np.prod(s.shape[1:], dtype=np.int64)) * np.dtype(s.dtype).itemsize
      for s in shapes.values()
    )
    batch_bytes = row_bytes * int(next(iter(shapes.values())).shape[0])
    if num_batches is not None:
      need = batch_bytes * max(0, num_batches - done)
      free = shutil.disk_usage(root).free
      if need > free:
        raise _disk_full(
          root, f"the {num_batches - done} batches left need about {need} bytes and {free} are free"
        )

    from tqdm import tqdm

    bar = tqdm(
      total=num_batches,
      initial=done,
      desc=f"collecting {root.name}",
      unit="batch",
      disable=not progress,
      dynamic_ncols=True,
      mininterval=0.5,
    )
    written = {"bytes": 0}

    def on_written(arrays):
      written["bytes"] += sum(a.nbytes for a in arrays.values())
      bar.update(1)
      bar.set_postfix(MB=f"{written['bytes'] / 2**20:.0f}", refresh=False)

    writer = _Writer(root, max_pending, on_written, bool(allow_nonfinite))
    writer.start()
    index = 0
    try:
      for batch in _chain(first, iterator):
        if index not in present:
          values = run(variables, *as_args(batch))
          _check_local(values, root)
          _check_batch(values, meta, index, root)
          writer.put((index, values))
        index += 1
    finally:
      writer.queue.put(None)
      writer.join()
      bar.close()
    if writer.error is not None:
      raise writer.error
    try:
      (root / _DONE).write_text(f"{index}\n")
    except OSError as error:
      (root / _DONE).unlink(missing_ok=True)  # (a half-written marker would still say complete)
      if error.errno in _FULL:
        raise _disk_full(root, error) from error
      raise
    return ActivationStore(root)


def _refuse_model_keyword(error: TypeError, apply_kwargs: dict) -> None:
  """A keyword the model refused, which :func:`collect` passed on to it (a misspelt
  ``overwrite=`` reached the model as ``Dense.__call__() got an unexpected keyword``)."""
  import difflib

  text = str(error)
  for name in apply_kwargs:
    if f"unexpected keyword argument '{name}'" in text:
      own = (
        "sites",
        "num_batches",
        "overwrite",
        "max_pending",
        "progress",
        "allow_nonfinite",
        "method",
      )
      close = difflib.get_close_matches(name, own, n=1)
      raise InvalidArgumentError(
        f"collect: the model takes no keyword {name!r} (collect passes the keywords it does "
        f"not know to the model: {text})",
        code="invalid_argument",
        fix=f"{close[0]}=" if close else f"drop {name}=, or a keyword the model's call takes",
        received=name,
        expected=list(own),
      ) from None


def _chain(first, rest):
  yield first
  yield from rest


class ActivationStore:
  """A store written by :func:`collect` (open one with :func:`open`).

  Only complete shards are read: the consecutive shards from the first, as they
  were when the store was opened.

  Attributes:
    path: the directory.
    labels: the stored site labels.
    num_batches: the complete batches.
    complete: whether :func:`collect` finished (the iterator was exhausted).
  """

  def __init__(self, path):
    root = _as_path(path)
    if not (root / _META).is_file():
      raise StoreError(
        f"{root} is not an activation store (no {_META})",
        code="store_missing",
        path=str(root),
        fix="jaxlens.store.collect(..., path) first",
      )
    self.path = root
    self._meta = _read_meta(root)
    self.labels = tuple(self._meta["sites"])
    self.num_batches = _committed(root)
    total = _complete_count(root)
    self.complete = total is not None
    if total is not None and self.num_batches != total:
      missing = [i for i in range(total) if not _shard(root, i).exists()]
      what = f"shards {missing[:8]} are missing" if missing else f"it holds {self.num_batches}"
      raise StoreError(
        f"{root} is a complete store of {total} batches, but {what}",
        code="store_corrupt",
        path=str(_shard(root, missing[0]) if missing else root),
        fix="collect() again with the same batches: it recomputes the missing shards",
      )
    self._rows: list[int] | None = None

  def __repr__(self) -> str:
    state = "complete" if self.complete else "incomplete"
    sites = ", ".join(
      f"{k}: {tuple(v['shape'])} {v['dtype']}" for k, v in self._meta["sites"].items()
    )
    return (
      f"ActivationStore({str(self.path)!r}, {self.num_batches} batches, {self.num_rows} "
      f"rows, {state}; {sites})"
    )

  def _check(self, label: str) -> str:
    if label not in self._meta["sites"]:
      raise StoreError(
        f"the store has no site {label!r}; it has {list(self.labels)}",
        code="unknown_site",
        path=str(self.path),
        site=label,
        fix=f"one of {list(self.labels)}",
      )
    return label

  def shape(self, label: str) -> tuple[int, ...]:
    """The per-row shape of a site (its value's shape without the batch axis)."""
    return tuple(self._meta["sites"][self._check(label)]["shape"])

  def dtype(self, label: str) -> np.dtype:
    return np.dtype(self._meta["sites"][self._check(label)]["dtype"])

  def _open(self, i: int):
    from safetensors import safe_open

    try:
      return safe_open(str(_shard(self.path, i)), framework="numpy")
    except Exception as error:  # safetensors raises its own SafetensorError
      raise StoreError(
        f"shard {i} of {self.path} cannot be read: {error}",
        code="store_corrupt",
        path=str(_shard(self.path, i)),
        fix="delete that shard, then collect() again with the same batches to recompute it",
      ) from error

  def _tensor(self, f, i: int, label: str, *, shape_only: bool = False):
    """Site ``label`` of open shard ``i``, checked against ``store.json`` (a shard of other
    sites, shapes or dtypes is ``store_corrupt``, naming the shard and the site)."""
    want_shape, want_dtype = self.shape(label), self.dtype(label)
    try:
      if shape_only:
        sl = f.get_slice(label)
        shape, value = tuple(sl.get_shape()), None
      else:
        value = f.get_tensor(label)
        shape = tuple(value.shape)
    except Exception as error:  # safetensors raises its own SafetensorError
      raise StoreError(
        f"shard {i} of {self.path} has no readable {label!r}: {error}",
        code="store_corrupt",
        path=_shard(self.path, i),
        site=label,
        fix="delete that shard, then collect() again with the same batches to recompute it",
      ) from error
    bad = len(shape) != len(want_shape) + 1 or shape[1:] != want_shape
    if value is not None and value.dtype != want_dtype:
      bad = True
    if bad:
      got = f"{shape}" + ("" if value is None else f" {value.dtype}")
      raise StoreError(
        f"shard {i} of {self.path} holds {label!r} as {got}; store.json says rows of "
        f"{want_shape} {want_dtype}",
        code="store_corrupt",
        path=_shard(self.path, i),
        site=label,
        fix="delete that shard, then collect() again with the same batches to recompute it",
      )
    if value is not None:
      self._check_crc(f, i, label, value)
    return shape[0] if value is None else value

  def _check_crc(self, f, i: int, label: str, value: np.ndarray) -> None:
    try:
      want = json_loads((f.metadata() or {}).get(_CRC, "{}")).get(label)
    except (ValueError, AttributeError):
      want = "unreadable"
    if want is not None and want != _crc(value):
      raise StoreError(
        f"shard {i} of {self.path}: the values of {label!r} differ from the CRC-32 saved with "
        "them (the file is damaged)",
        code="store_corrupt",
        path=_shard(self.path, i),
        site=label,
        fix="delete that shard, then collect() again with the same batches to recompute it",
      )

  @property
  def rows_per_batch(self) -> list[int]:
    if self._rows is None:
      label = self.labels[0]
      rows = []
      for i in range(self.num_batches):
        with self._open(i) as f:
          rows.append(self._tensor(f, i, label, shape_only=True))
      self._rows = rows
    return self._rows

  @property
  def num_rows(self) -> int:
    return sum(self.rows_per_batch)

  def __len__(self) -> int:
    return self.num_rows

  def batch(self, i: int, label: str) -> np.ndarray:
    """The ``i``-th stored batch of a site."""
    self._check(label)
    if isinstance(i, bool) or not isinstance(i, (int, np.integer)) or not 0 <= i < self.num_batches:
      raise StoreError(
        f"batch {i!r} is not an index of the store's {self.num_batches} batches",
        code="index_out_of_range",
        path=str(self.path),
        fix=f"0 <= i < {self.num_batches}",
      )
    with self._open(i) as f:
      return self._tensor(f, i, label)

  def array(self, label: str, *, as_jax: bool = False):
    """Every stored row of a site, ``(num_rows, *shape)``, in memory."""
    self._check(label)
    out = np.empty((self.num_rows, *self.shape(label)), self.dtype(label))
    at = 0
    for i in range(self.num_batches):
      part = self.batch(i, label)
      out[at : at + len(part)] = part
      at += len(part)
    return jax.numpy.asarray(out) if as_jax else out

  def batches(
    self,
    labels: str | Sequence[str],
    *,
    batch_size: int | None = None,
    flatten: bool = False,
    shuffle: bool = False,
    seed: int = 0,
    as_jax: bool = False,
  ) -> Iterator:
    """Iterates over the stored rows in batches, one shard in memory at a time.

    Args:
      labels: a site label (yields arrays) or several (yields ``{label: array}``).
      batch_size: rows per yielded batch (default: the stored batches as they are).
      flatten: merge every axis but the last into rows (``(batch, seq, d)`` becomes
        ``(batch * seq, d)``: one row per token, as probes and SAEs train on).
      shuffle: visit the shards in a random order and permute the rows within
        each (a shard-local shuffle: memory stays one shard).
      seed: the shuffle's seed (``numpy.random.default_rng``).
      as_jax: yield JAX arrays instead of numpy arrays.
    """
    single = isinstance(labels, str)
    names: list[str] = [labels] if isinstance(labels, str) else list(labels)
    if not names:
      raise InvalidArgumentError(
        "batches needs at least one site label",
        code="invalid_argument",
        fix=f"batches({list(self.labels)[:1]!r}, ...)",
      )
    for name in names:
      self._check(name)
    if batch_size is not None and (
      isinstance(batch_size, bool)
      or not isinstance(batch_size, (int, np.integer))
      or batch_size < 1
    ):
      raise InvalidArgumentError(
        f"batch_size must be a positive int, got {batch_size!r}",
        code="invalid_argument",
        fix="batch_size=4096",
      )
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
      raise InvalidArgumentError(
        f"seed must be a non-negative int, got {seed!r}",
        code="invalid_seed",
        fix="seed=0",
        received=repr(seed),
      )
    rng = np.random.default_rng(seed)
    order = rng.permutation(self.num_batches) if shuffle else range(self.num_batches)
    convert = jax.numpy.asarray if as_jax else (lambda a: a)

    def emit(parts):
      out = {k: convert(v) for k, v in parts.items()}
      return out[names[0]] if single else out

    carry: dict[str, list] = {k: [] for k in names}
    held = 0
    for i in order:
      with self._open(int(i)) as f:
        parts = {k: self._tensor(f, int(i), k) for k in names}
      if flatten:
        parts = {k: v.reshape(-1, v.shape[-1]) if v.ndim > 1 else v for k, v in parts.items()}
      n = len(next(iter(parts.values())))
      if shuffle:
        perm = rng.permutation(n)
        parts = {k: v[perm] for k, v in parts.items()}
      if batch_size is None:
        yield emit(parts)
        continue
      for k in names:
        carry[k].append(parts[k])
      held += n
      while held >= batch_size:
        joined = {k: np.concatenate(carry[k]) for k in names}
        yield emit({k: v[:batch_size] for k, v in joined.items()})
        carry = {k: [v[batch_size:]] for k, v in joined.items()}
        held -= batch_size
    if batch_size is not None and held:
      yield emit({k: np.concatenate(carry[k]) for k in names})


@api_boundary
def open(path) -> ActivationStore:
  """Opens a store written by :func:`collect`."""
  return ActivationStore(path)
