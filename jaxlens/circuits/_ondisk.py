"""A graph written to disk as its rows are computed: the directory :func:`save_graph` writes
(``graph.safetensors`` and ``graph.json``), its adjacency a ``numpy.memmap`` of the
safetensors file's last tensor, built under a temporary name beside the target and renamed
into place once whole (nothing is left behind on an error); and such a file opened without
reading it into memory."""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import shutil
import tempfile

import numpy as np

from jaxlens.circuits._errors import CircuitError

__all__ = ["GraphWriter", "check_graph_path", "open_safetensors", "sha256_file"]

FORMAT = "jaxlens.circuits.graph"
_DTYPES = {"F32": np.float32, "F64": np.float64, "F16": np.float16}
# Room left on the file system beyond the graph's own bytes.
_SPARE_BYTES = 64 * 2**20


def _path_error(path, why, fix) -> CircuitError:
  return CircuitError(
    f"graph_path={str(path)!r}: {why}", code="circuit_graph_path", received=str(path), fix=fix
  )


def check_graph_path(path) -> pathlib.Path:
  """``path`` as a new graph directory in an existing directory.

  Raises:
    CircuitError: ``invalid_argument`` (not a str or path), ``circuit_file_exists`` (it
      exists), ``circuit_graph_path`` (its directory is missing or not a directory).
  """
  if not isinstance(path, (str, os.PathLike)) or not str(path):
    raise CircuitError(
      f"graph_path must be a str or os.PathLike naming a new directory, got "
      f"{type(path).__name__} {path!r:.60}",
      code="invalid_argument",
      received=type(path).__name__,
      fix='graph_path="graphs/my_prompt"',
    )
  path = pathlib.Path(path)
  if path.exists() or path.is_symlink():
    raise CircuitError(
      f"{path} exists: a graph on disk is written to a new path",
      code="circuit_file_exists",
      received=str(path),
      fix="a new path (remove the old graph first)",
    )
  if not path.parent.is_dir():
    raise _path_error(path, f"its directory {path.parent} does not exist", "mkdir it first")
  return path


def sha256_file(path, chunk: int = 16 * 2**20) -> str:
  """The SHA-256 of a file, read a chunk at a time."""
  digest = hashlib.sha256()
  with open(path, "rb") as f:
    while block := f.read(chunk):
      digest.update(block)
  return digest.hexdigest()


class GraphWriter:
  """Writes a dense graph's directory with its adjacency filled in place: ``adjacency`` is a
  writable ``(n, n)`` ``numpy.memmap`` (zeros until written); :meth:`finish` hashes the file,
  writes ``graph.json`` and renames the directory into place; :meth:`abort` removes it.

  Raises:
    CircuitError: ``circuit_graph_path`` (the file system has not room for the adjacency),
      ``circuit_save_failed`` (it refused to write).
  """

  def __init__(self, path: pathlib.Path, n: int, dtype, arrays: dict, n_layers: int):
    from safetensors.numpy import save

    self.path, self.n_layers = path, int(n_layers)
    dtype = np.dtype(dtype)
    name = {v: k for k, v in _DTYPES.items()}[dtype.type]
    nbytes = n * n * dtype.itemsize
    free = shutil.disk_usage(path.parent).free
    if free < nbytes + _SPARE_BYTES:
      raise _path_error(
        path,
        f"the adjacency takes {nbytes / 2**30:.2f} GiB, the file system has "
        f"{free / 2**30:.2f} GiB free",
        "a path on a file system with room for it, or a shorter prompt",
      )
    small = save({k: np.ascontiguousarray(v) for k, v in arrays.items()})
    length = int.from_bytes(small[:8], "little")
    header = json.loads(small[8 : 8 + length])
    body = small[8 + length :]
    header["adjacency"] = {
      "dtype": name,
      "shape": [n, n],
      "data_offsets": [len(body), len(body) + nbytes],
    }
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    self.offset = 8 + len(text) + len(body)
    try:
      self.tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    except OSError as error:
      raise _failed(path, error) from error
    try:
      self.file = self.tmp / "graph.safetensors"
      with open(self.file, "wb") as f:
        f.write(len(text).to_bytes(8, "little") + text + body)
        f.truncate(self.offset + nbytes)  # the zeros: a sparse file until the rows arrive
      self.adjacency = np.memmap(self.file, dtype, "r+", self.offset, (n, n))
    except OSError as error:
      self.abort()
      raise _failed(path, error) from error
    self.shape, self.dtype = (n, n), dtype

  def finish(self):
    """The adjacency flushed, the file hashed, ``graph.json`` written and the directory
    renamed into place; returns the adjacency as a read-only memmap of the final file."""
    try:
      self.adjacency.flush()
      del self.adjacency
      meta = {
        "format": FORMAT,
        "version": 1,
        "n_layers": self.n_layers,
        "sha256": sha256_file(self.file),
      }
      (self.tmp / "graph.json").write_text(json.dumps(meta, indent=1))
      if self.path.exists():
        raise CircuitError(
          f"{self.path} appeared while the graph was written",
          code="circuit_file_exists",
          received=str(self.path),
          fix="a new path",
        )
      os.rename(self.tmp, self.path)
    except OSError as error:
      self.abort()
      raise _failed(self.path, error) from error
    except BaseException:
      self.abort()
      raise
    file = self.path / "graph.safetensors"
    return np.memmap(file, self.dtype, "r", self.offset, self.shape)

  def abort(self):
    """Removes what was written."""
    if hasattr(self, "adjacency"):
      del self.adjacency
    shutil.rmtree(self.tmp, ignore_errors=True)


def _failed(path, error) -> CircuitError:
  return CircuitError(
    f"writing the graph to {path} failed: {error}",
    code="circuit_save_failed",
    received=str(path),
    fix="a writable path with room for the graph",
  )


def open_safetensors(file: pathlib.Path, corrupt):
  """``(arrays, adjacency)`` of a graph's safetensors file without reading it whole: the small
  arrays read, the ``adjacency`` a read-only memmap (None if the file has none: a sparse
  graph's CSR arrays are then among the arrays). ``corrupt(why)`` makes the error."""
  size = file.stat().st_size
  with open(file, "rb") as f:
    head = f.read(8)
    length = int.from_bytes(head, "little") if len(head) == 8 else -1
    if length <= 0 or 8 + length > size:
      raise corrupt("graph.safetensors has no readable header")
    try:
      header = json.loads(f.read(length))
    except ValueError as error:
      raise corrupt(f"graph.safetensors's header is not JSON ({error})") from error
    start = 8 + length
    arrays, adjacency = {}, None
    try:
      entries = {k: v for k, v in header.items() if k != "__metadata__"}
      end = max((int(v["data_offsets"][1]) for v in entries.values()), default=0)
      if start + end != size:
        raise corrupt(f"graph.safetensors holds {size} bytes, its header {start + end}")
      for name, v in entries.items():
        lo, hi = (int(x) for x in v["data_offsets"])
        shape = tuple(int(x) for x in v["shape"])
        dtype = np.dtype(_DTYPES.get(v["dtype"]) or {"I64": np.int64, "I32": np.int32}[v["dtype"]])
        if hi - lo != int(np.prod(shape)) * dtype.itemsize or lo < 0:
          raise corrupt(f"the tensor {name} does not fit its offsets")
        if name == "adjacency":
          adjacency = np.memmap(file, dtype, "r", start + lo, shape)
        else:
          f.seek(start + lo)
          arrays[name] = np.frombuffer(f.read(hi - lo), dtype).reshape(shape).copy()
    except CircuitError:
      raise
    except (KeyError, TypeError, ValueError) as error:
      why = f"graph.safetensors's header does not describe its tensors ({error})"
      raise corrupt(why) from error
  return arrays, adjacency
