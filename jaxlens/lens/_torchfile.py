"""torch's ``torch.save`` zip format, read and written without torch: a flat dict of arrays
(tuned-lens's ``params.pt``) or a nested structure of dicts, lists, numbers, strings and arrays
(a Jacobian lens artifact).

A ``.pt`` file is a zip holding ``<name>/data.pkl`` (a pickle whose tensors are calls of
``torch._utils._rebuild_tensor_v2`` on storages named by persistent ids) and one raw
little-endian file per storage, ``<name>/data/<key>``. Reading needs no torch: a restricted
unpickler accepts only those globals (and ``collections.OrderedDict``), so a file cannot run
code. Writing emits the same pickle, which ``torch.load(weights_only=True)`` reads.
"""

from __future__ import annotations

import collections
import io
import os
import pickle
import tempfile
import types
import zipfile
from pathlib import Path

import jax
import numpy as np

from jaxlens.lens._readout import LensError

__all__ = ["read_object", "read_state_dict", "write_object", "write_state_dict"]

_STORAGES = {
  "FloatStorage": np.float32,
  "DoubleStorage": np.float64,
  "HalfStorage": np.float16,
  "LongStorage": np.int64,
  "IntStorage": np.int32,
  "BoolStorage": np.bool_,
}
_NAMES = {np.dtype(v): k for k, v in _STORAGES.items()}


def _corrupt(path, why: str) -> LensError:
  return LensError(
    f"{path} is not a readable torch file: {why}",
    code="lens_file_corrupt",
    path=str(path),
    fix="the params.pt written by tuned-lens's TunedLens.save or jaxlens.lens.save_tuned_lens",
  )


class _Storage:
  def __init__(self, dtype):
    self.dtype = np.dtype(dtype)


def _rebuild(storage, offset, size, stride, *_):
  flat = storage
  size, stride = tuple(size), tuple(stride)
  if not size:
    return flat[offset].copy()
  span = offset + sum((n - 1) * s for n, s in zip(size, stride)) + 1
  if min(size) > 0 and span > flat.size:
    raise ValueError(f"a tensor of size {size} runs past its storage of {flat.size}")
  strides = tuple(s * flat.itemsize for s in stride)
  return np.lib.stride_tricks.as_strided(flat[offset:], size, strides).copy()


class _Reader(pickle.Unpickler):
  def __init__(self, data, archive, prefix):
    super().__init__(data)
    self.archive, self.prefix = archive, prefix

  def find_class(self, module, name):
    if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
      return _rebuild
    if (module, name) == ("collections", "OrderedDict"):
      return collections.OrderedDict
    if module == "torch" and name in _STORAGES:
      return _Storage(_STORAGES[name])
    raise pickle.UnpicklingError(f"refused global {module}.{name}")

  def persistent_load(self, pid):
    if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
      raise pickle.UnpicklingError(f"unknown persistent id {pid!r}")
    storage, key, numel = pid[1], pid[2], pid[4]
    if not isinstance(storage, _Storage):
      raise pickle.UnpicklingError(f"unknown storage type {storage!r}")
    raw = self.archive.read(f"{self.prefix}data/{key}")
    flat = np.frombuffer(raw, storage.dtype.newbyteorder("<"))
    if flat.size != numel:
      raise ValueError(f"storage {key} holds {flat.size} values, its header says {numel}")
    return flat


def read_object(path, *, what: str = "a tuned lens's params.pt") -> object:
  """The object saved in the torch file ``path``: dicts, lists, numbers and strings as
  themselves, tensors as numpy arrays.

  Args:
    path: the file.
    what: what the file should be, for the errors' ``fix``.

  Raises:
    LensError: ``lens_file_missing``; ``lens_file_corrupt`` for a truncated or edited file or
      one that needs any global but a tensor rebuild.
  """
  path = Path(path)
  if not path.is_file():
    raise LensError(
      f"no file at {path}",
      code="lens_file_missing",
      path=str(path),
      fix=f"the path of {what}",
    )
  try:
    with zipfile.ZipFile(path) as archive:
      names = [n for n in archive.namelist() if n.endswith("data.pkl")]
      if len(names) != 1:
        raise _corrupt(path, "no data.pkl record")
      prefix = names[0][: -len("data.pkl")]
      return _Reader(io.BytesIO(archive.read(names[0])), archive, prefix).load()
  except LensError:
    raise
  except (zipfile.BadZipFile, pickle.UnpicklingError, EOFError, KeyError, ValueError) as e:
    raise _corrupt(path, str(e) or type(e).__name__) from e


def read_state_dict(path) -> dict[str, np.ndarray]:
  """The ``{name: array}`` dict saved in the torch file ``path``.

  Raises:
    LensError: ``lens_file_missing``; ``lens_file_corrupt`` for a truncated or edited file,
      or one holding anything but a dict of tensors.
  """
  if not Path(path).is_file():
    raise LensError(
      f"no file at {path}",
      code="lens_file_missing",
      path=str(path),
      fix="the directory holding a tuned lens's params.pt and config.json",
    )
  obj = read_object(path)
  if not isinstance(obj, dict) or not all(
    isinstance(k, str) and isinstance(v, np.ndarray) for k, v in obj.items()
  ):
    raise _corrupt(path, "it does not hold a dict of tensors")
  return dict(obj)


def _global(module: str, name: str):
  def marker():
    raise AssertionError("a pickling marker")

  marker.torch_global = (module, name)  # type: ignore[attr-defined]
  return marker


_REBUILD = _global("torch._utils", "_rebuild_tensor_v2")
_STORAGE_GLOBALS = {dtype: _global("torch", name) for dtype, name in _NAMES.items()}


class _Tensor:
  def __init__(self, array, key):
    self.array, self.key = array, key

  def __reduce__(self):
    a = self.array
    stride = tuple(s // a.itemsize for s in a.strides) if a.ndim else ()
    storage = _StorageRef(a, self.key)
    return _REBUILD, (storage, 0, a.shape, stride, False, collections.OrderedDict())


class _StorageRef:
  def __init__(self, array, key):
    self.array, self.key = array, key


class _Writer(pickle._Pickler):  # the Python pickler, whose save_global can be extended
  def persistent_id(self, obj):
    if isinstance(obj, _StorageRef):
      kind = _STORAGE_GLOBALS[obj.array.dtype]
      return ("storage", kind, obj.key, "cpu", obj.array.size)
    return None

  def save_global(self, obj, name=None):
    spelled = getattr(obj, "torch_global", None)
    if spelled is None:
      return super().save_global(obj, name)
    module, gname = spelled
    self.write(pickle.GLOBAL + f"{module}\n{gname}\n".encode())
    self.memoize(obj)


# The Python pickler dispatches functions to the base class's save_global by its table.
_Writer.dispatch = {**pickle._Pickler.dispatch, types.FunctionType: _Writer.save_global}


def _tensors(obj, blobs: list):
  """``obj`` with each array replaced by a pickled tensor; their bytes appended to ``blobs``."""
  if isinstance(obj, np.generic):
    return obj.item()
  if isinstance(obj, (np.ndarray, jax.Array)):
    a = np.ascontiguousarray(np.asarray(obj))
    if a.dtype not in _NAMES:
      a = a.astype(np.float32)
    a = a.astype(a.dtype.newbyteorder("<"), copy=False)
    key = str(len(blobs))
    blobs.append((key, a.tobytes()))
    return _Tensor(a, key)
  if isinstance(obj, collections.OrderedDict):
    return collections.OrderedDict((k, _tensors(v, blobs)) for k, v in obj.items())
  if isinstance(obj, dict):
    return {k: _tensors(v, blobs) for k, v in obj.items()}
  if isinstance(obj, (list, tuple)):
    return type(obj)(_tensors(v, blobs) for v in obj)
  return obj


def write_object(path, obj) -> None:
  """Writes ``obj`` (dicts, lists, tuples, numbers, strings, None and arrays; arrays in a
  torch dtype or written as float32) as a torch file at ``path`` that
  ``torch.load(weights_only=True)`` reads, atomically: to a temporary file in the same
  directory, then renamed over ``path``."""
  path = Path(path)
  blobs: list = []
  state = _tensors(obj, blobs)
  buf = io.BytesIO()
  _Writer(buf, protocol=2).dump(state)
  archive = path.stem or "archive"

  def fill(f):
    with zipfile.ZipFile(f, "w", zipfile.ZIP_STORED) as z:
      z.writestr(f"{archive}/data.pkl", buf.getvalue())
      z.writestr(f"{archive}/byteorder", "little")
      for key, data in blobs:
        z.writestr(f"{archive}/data/{key}", data)
      z.writestr(f"{archive}/version", "3\n")

  write_atomic(path, fill)


def write_atomic(path: Path, fill) -> None:
  """Writes ``path`` atomically: ``fill(f)`` writes a temporary file in the same directory,
  which is then renamed over ``path``; on any error the temporary file is removed, and an
  ``OSError`` is ``lens_save_failed``."""
  try:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
  except OSError as error:
    raise save_failed(path, error) from error
  try:
    with os.fdopen(fd, "wb") as f:
      fill(f)
    os.replace(tmp, path)
  except BaseException as error:
    Path(tmp).unlink(missing_ok=True)
    if isinstance(error, OSError):
      raise save_failed(path, error) from error
    raise


def save_failed(path: Path, error: OSError) -> LensError:
  """The file system refused to write a lens file (a read-only or missing directory, a full
  disk); nothing of the file is left behind."""
  return LensError(
    f"cannot write the lens file {path}: {error}",
    code="lens_save_failed",
    path=str(path),
    fix="a path in a writable directory with room for the file",
  )


def write_state_dict(path, arrays: dict[str, np.ndarray]) -> None:
  """Writes ``arrays`` as a torch file at ``path`` (readable by ``torch.load``), atomically:
  to a temporary file in the same directory, then renamed over ``path``."""
  write_object(path, collections.OrderedDict((k, np.asarray(v)) for k, v in arrays.items()))
