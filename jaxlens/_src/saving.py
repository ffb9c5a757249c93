"""Floor 5: rules to and from a saved spec directory, through the verb registry.

A saved spec is a directory holding ``spec.json`` (the structure: selectors, verbs
and their arguments, where each array lives) and ``arrays.npz`` (the arrays), with
a SHA-256 content hash over both recorded in ``spec.json``. An edit is saved as its
verb's name and the arguments its factory was called with, and loaded by calling
that factory again (so a loaded edit passes the same argument checks); selectors
save themselves (``Site.to_json``). Nothing here names a verb.

On disk the pair is one version directory, ``v-<id>/``, and ``spec.json`` /
``arrays.npz`` at the top are links through ``current``, a symbolic link to the
version. A save writes and fsyncs a new version, then swaps ``current`` with one
atomic rename, so a reader sees the old spec or the new one, never a mix or
nothing; writers to one path take a lock (``.lock``); a failed save removes what it
wrote and leaves the previous spec in place. A reader that loses a race with the
clean-up of an old version reads ``current`` again. Loading refuses anything but an
intact spec with a typed :class:`SpecFormatError` (``spec_corrupt``,
``spec_not_found``, ``spec_version``).

Only verbs whose arguments are data are portable; a spec holding an opaque Python
callable (a hook, ``splice_module(fn)``) is refused with ``spec_not_portable``.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import re
import shutil
import stat
import uuid
import zipfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxlens._src.edit import (
  ByIdentity,
  Donor,
  Edit,
  Population,
  SavedDonor,
  split_over_processes,
  verb_named,
)
from jaxlens._src.errors import InvalidArgumentError, SpecFormatError
from jaxlens._src.sites import Site, hits, selector_from_json

try:  # Writers lock on POSIX; elsewhere the atomic swap alone protects readers.
  import fcntl
except ImportError:  # pragma: no cover
  fcntl = None

FORMAT = "jaxlens-spec"
VERSION = 2  # 1: edits as params/static; 2: edits as their factory's arguments
_VERSION_DIR = re.compile(r"^v-[0-9a-f]{32}$")
_MAX_DEPTH = 64
_FIX = "save the spec again with spec.save(path)"


# -- encoding -----------------------------------------------------------------


class _Writer:
  def __init__(self):
    self.arrays: dict[str, np.ndarray] = {}
    self.selector: Site | None = None

  def array(self, a, where: str) -> dict:
    if isinstance(a, jax.core.Tracer):
      raise SpecFormatError(
        "cannot save a spec holding traced values (inside jit/grad)",
        code="spec_not_portable",
        site=where,
        fix="save the spec outside transformed functions",
      )
    if split_over_processes(a):
      raise SpecFormatError(
        "cannot save a spec holding an array whose shards live on other processes",
        code="spec_not_portable",
        site=where,
        fix="save it with jaxlens.distributed.save_spec(spec, path), which gathers the values",
      )
    key = f"a{len(self.arrays)}"
    a = np.asarray(a)
    if a.dtype.kind == "V" and a.dtype.names is None:
      # ml_dtypes (bfloat16, float8_*, int4) have no .npy form: numpy writes them as
      # raw void bytes. They are stored as unsigned integers of their width, bit for
      # bit, with the dtype's name beside them.
      self.arrays[key] = a.view(np.dtype(f"u{a.dtype.itemsize}"))
      return {"$bits": [key, a.dtype.name]}
    self.arrays[key] = a
    return {"$array": key}

  def value(self, v, where: str):
    if v is None or isinstance(v, (bool, int, float, str)):
      return v
    if isinstance(v, Edit):
      return {"$edit": self.edit(v, where)}
    if isinstance(v, Population):
      return {"$population": self.array(v.values, where)}
    if isinstance(v, Donor):
      return {"$donor": self.donor(v, where)}
    if isinstance(v, (jax.Array, np.ndarray, np.generic)):
      return self.array(v, where)
    if isinstance(v, dict):
      return {"$dict": {str(k): self.value(x, where) for k, x in v.items()}}
    if isinstance(v, (tuple, list)):
      return {"$tuple": [self.value(x, where) for x in v]}
    if isinstance(v, Site):
      return {"$site": v.to_json()}
    if isinstance(v, ByIdentity):
      raise SpecFormatError(
        f"{where}: holds the Python object {v!r}, which a portable spec cannot store",
        code="spec_not_portable",
        site=where,
        fix="replace the callable with built-in verbs, or keep the spec in memory",
      )
    raise SpecFormatError(
      f"{where}: cannot store a {type(v).__name__}",
      code="spec_not_portable",
      site=where,
      fix="pass arrays, numbers or built-in verbs",
    )

  def donor(self, donor: Donor, where: str) -> dict:
    """The donor's values at the sites the rule edits (all of them if none is known)."""
    values, infos = donor.donor_values(), donor.donor_infos()
    read = [
      lbl
      for lbl, info in infos.items()
      if info is not None and self.selector is not None and hits(self.selector, info)
    ]
    keep = read or list(values)
    out = {}
    layers = getattr(donor, "layers", {})
    for lbl in keep:
      info = infos.get(lbl)
      out[lbl] = {
        "value": self.array(values[lbl], where),
        "layers": layers.get(lbl) if info is None else info.layers,
      }
    return out

  def edit(self, e: Edit, where: str) -> dict:
    return {
      "verb": e.name,
      "keep_grad": e.keep_grad,
      "args": {k: self.value(v, where) for k, v in e.arguments.items()},
    }


def encode(rules) -> tuple[dict, dict]:
  """The JSON structure and the arrays of a spec's rules."""
  writer = _Writer()
  out = []
  for i, (selector, edit) in enumerate(rules):
    writer.selector = selector
    where = f"rule {i} ({selector!r})"
    if not hasattr(selector, "to_json"):
      raise SpecFormatError(
        f"selector {selector!r} has no portable form",
        code="spec_not_portable",
        site=where,
        fix="use jl.module / jl.label / jl.func selectors",
      )
    out.append({"site": selector.to_json(), "edit": writer.edit(edit, where)})
  return {"format": FORMAT, "version": VERSION, "rules": out}, writer.arrays


# -- decoding -----------------------------------------------------------------


def _corrupt(why: str, path) -> SpecFormatError:
  return SpecFormatError(
    f"{path}: malformed spec ({why})", code="spec_corrupt", site=str(path), fix=_FIX
  )


class _Reader:
  def __init__(self, arrays: dict, path, version: int):
    self.arrays, self.path, self.version = arrays, path, version

  def array(self, ref):
    if isinstance(ref, dict) and len(ref) == 1 and "$bits" in ref:
      return self.bits(ref["$bits"])
    if not isinstance(ref, dict) or ref.get("$array") not in self.arrays:
      raise _corrupt(f"bad array reference {ref!r:.80}", self.path)
    # Host arrays: verbs convert them where they are used, and checks on their
    # values (index bounds, basis rank) still run inside jit and grad.
    return self.arrays[ref["$array"]]

  def bits(self, body):
    """An ml_dtypes array stored as unsigned integers of its width (``_Writer.array``)."""
    ok = isinstance(body, list) and len(body) == 2 and all(isinstance(b, str) for b in body)
    if not ok or body[0] not in self.arrays:
      raise _corrupt(f"bad array reference {body!r:.80}", self.path)
    raw = self.arrays[body[0]]
    try:
      dtype = np.dtype(jnp.dtype(body[1]))
    except (TypeError, ValueError, AttributeError):
      raise _corrupt(f"unknown dtype {body[1]!r:.40}", self.path) from None
    if not dtype.type.__module__.startswith("ml_dtypes"):
      raise _corrupt(f"unknown dtype {body[1]!r:.40}", self.path)
    if raw.dtype != np.dtype(f"u{dtype.itemsize}"):
      raise _corrupt(f"array {body[0]} of dtype {raw.dtype} does not hold {dtype}", self.path)
    return raw.view(dtype)

  def value(self, v, depth=0):
    if depth > _MAX_DEPTH:
      raise _corrupt("nested too deeply", self.path)
    if v is None or isinstance(v, (bool, int, float, str)):
      return v
    if not isinstance(v, dict) or len(v) != 1:
      raise _corrupt(f"unexpected value {v!r:.80}", self.path)
    ((tag, body),) = v.items()
    if tag in ("$array", "$bits"):
      return self.array(v)
    if tag == "$edit":
      return self.edit(body, depth + 1)
    if tag == "$population":
      return Population(self.array(body))
    if tag == "$donor" and isinstance(body, dict):
      values, layers = {}, {}
      for lbl, item in body.items():
        if not isinstance(item, dict):
          raise _corrupt(f"bad donor entry {lbl!r}", self.path)
        values[lbl] = self.array(item.get("value"))
        n = item.get("layers")
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
          raise _corrupt(f"bad donor layers {n!r}", self.path)
        layers[lbl] = n
      return SavedDonor(values, layers)
    if tag == "$trace" and isinstance(body, dict):  # version 1: every saved value
      return SavedDonor({lbl: self.array(ref) for lbl, ref in body.items()})
    if tag == "$dict" and isinstance(body, dict):
      return {k: self.value(x, depth + 1) for k, x in body.items()}
    if tag == "$tuple" and isinstance(body, list):
      return tuple(self.value(x, depth + 1) for x in body)
    if tag == "$site":
      return selector_from_json(body)
    raise _corrupt(f"unknown tag {tag!r:.40}", self.path)

  def edit(self, d, depth=0) -> Edit:
    if not isinstance(d, dict) or not isinstance(d.get("verb"), str):
      raise _corrupt(f"bad edit {d!r:.80}", self.path)
    if self.version == 1:
      params = self.value(d.get("params"), depth + 1) or {}
      static = {k: self.value(v, depth + 1) for k, v in d.get("static", [])}
      args = {**params, **static}
      if d["verb"] == "swap_with":
        args = {"other": args.get("site") if args.get("site") is not None else args.get("value")}
    else:
      raw = d.get("args")
      if not isinstance(raw, dict):
        raise _corrupt(f"edit {d['verb']!r} has no arguments", self.path)
      args = {k: self.value(v, depth + 1) for k, v in raw.items()}
    keep = d.get("keep_grad", False)
    if not isinstance(keep, bool):
      raise _corrupt("keep_grad must be true or false", self.path)
    try:
      verb = verb_named(d["verb"])
    except InvalidArgumentError as error:
      # An intact spec from another jaxlens (its hash matched): say so, not "corrupt".
      raise SpecFormatError(
        f"{self.path}: the spec uses the verb {d['verb']!r:.60}, which this jaxlens does not have",
        code="unknown_verb",
        site=str(self.path),
        candidates=error.fields.get("candidates"),
        fix="load it with the jaxlens version that saved it, or save it again without that verb",
      ) from None
    try:
      edit = verb.build(args)
    except InvalidArgumentError as error:
      raise _corrupt(f"edit {d['verb']!r}: {error}", self.path) from None
    except (TypeError, ValueError, AttributeError, IndexError) as error:
      raise _corrupt(f"edit {d['verb']!r}: {type(error).__name__}: {error}", self.path) from None
    return edit.__class__(edit.name, edit.params, edit.static, edit.keeps, keep)


def decode(doc: dict, arrays: dict, path) -> tuple:
  rules = doc.get("rules")
  if not isinstance(rules, list):
    raise _corrupt("no list of rules", path)
  reader = _Reader(arrays, path, doc["version"])
  out = []
  for r in rules:
    if not isinstance(r, dict):
      raise _corrupt(f"bad rule {r!r:.80}", path)
    try:
      selector = selector_from_json(r.get("site"))
    except SpecFormatError as error:
      raise _corrupt(str(error), path) from None
    out.append((selector, reader.edit(r.get("edit"))))
  return tuple(out)


# -- files ------------------------------------------------------------------


def _digest(structure: dict, arrays: dict[str, np.ndarray]) -> str:
  h = hashlib.sha256()
  h.update(json.dumps(structure, sort_keys=True).encode())
  for key in sorted(arrays):
    a = np.ascontiguousarray(arrays[key])
    h.update(f"{key}:{a.dtype.str}:{a.shape}".encode())
    h.update(a.tobytes())
  return h.hexdigest()


def _is_spec_dir(path: Path) -> bool:
  return path.is_dir() and ((path / "current").is_symlink() or (path / "spec.json").exists())


def _write(path: Path, data: bytes):
  with open(path, "wb") as f:
    f.write(data)
    f.flush()
    os.fsync(f.fileno())


def _fsync_dir(path: Path):
  try:
    fd = os.open(path, os.O_RDONLY)
  except OSError:  # pragma: no cover (platforms without directory handles)
    return
  try:
    os.fsync(fd)
  except OSError:  # pragma: no cover
    pass
  finally:
    os.close(fd)


@contextlib.contextmanager
def _locked(path: Path):
  if fcntl is None:  # pragma: no cover
    yield
    return
  with open(path / ".lock", "a") as f:
    fcntl.flock(f, fcntl.LOCK_EX)
    try:
      yield
    finally:
      fcntl.flock(f, fcntl.LOCK_UN)


def _link(target: str, at: Path):
  """Points the symbolic link ``at`` to ``target`` with one atomic rename."""
  tmp = at.parent / f".{at.name}.tmp-{uuid.uuid4().hex}"
  os.symlink(target, tmp)
  try:
    os.replace(tmp, at)
  except BaseException:
    tmp.unlink(missing_ok=True)
    raise


def save_rules(rules, path) -> Path:
  """Saves ``rules`` to the directory ``path`` (atomically; see the module docstring).

  An existing directory at ``path`` is replaced only if it is itself a saved
  spec (or empty); anything else there is refused with ``spec_target_exists``.
  """
  path = Path(path)
  structure, arrays = encode(rules)
  digest = _digest(structure, arrays)
  buf = io.BytesIO()
  np.savez(buf, **arrays)
  blob = json.dumps({**structure, "sha256": digest}, indent=1).encode()
  if path.exists() and not (
    _is_spec_dir(path) or (path.is_dir() and not any(p.name != ".lock" for p in path.iterdir()))
  ):
    raise SpecFormatError(
      f"{path} exists and is not a saved jaxlens spec; refusing to replace it",
      code="spec_target_exists",
      site=str(path),
      fix="save to a new directory",
    )
  try:
    path.mkdir(parents=True, exist_ok=True)
  except OSError as error:
    # A file (or a file among the parents) in the way is a target that exists; a directory
    # the file system refuses to write into (read-only, no permission, full) is a failed save.
    exists = isinstance(error, (FileExistsError, NotADirectoryError))
    raise SpecFormatError(
      f"cannot create {path}: {error}",
      code="spec_target_exists" if exists else "spec_save_failed",
      site=str(path),
      fix="save to a new directory" if exists else "save to a writable directory",
    ) from None
  with _locked(path):
    # What a writer killed mid-save left behind (its lock died with it; a live writer holds
    # the lock, so nothing here is in use).
    for stale in path.iterdir():
      if stale.name.startswith(".tmp-v-") and stale.is_dir() and not stale.is_symlink():
        shutil.rmtree(stale, ignore_errors=True)
      elif stale.name.startswith(".") and ".tmp-" in stale.name and stale.is_symlink():
        stale.unlink(missing_ok=True)
    version = f"v-{uuid.uuid4().hex}"
    tmp = path / f".tmp-{version}"
    published = False
    try:
      tmp.mkdir()
      _write(tmp / "arrays.npz", buf.getvalue())
      _write(tmp / "spec.json", blob)
      _fsync_dir(tmp)
      os.replace(tmp, path / version)
      _fsync_dir(path)
      _link(version, path / "current")
      published = True
      for name in ("spec.json", "arrays.npz"):
        if not (path / name).is_symlink():
          _link(f"current/{name}", path / name)
      _fsync_dir(path)
    except OSError as error:
      raise SpecFormatError(
        f"cannot save the spec to {path}: {error}",
        code="spec_save_failed",
        site=str(path),
        fix="check the directory is writable",
      ) from None
    finally:
      shutil.rmtree(tmp, ignore_errors=True)
      if not published:
        shutil.rmtree(path / version, ignore_errors=True)
    for old in path.iterdir():
      if _VERSION_DIR.match(old.name) and old.name != version:
        shutil.rmtree(old, ignore_errors=True)
  return path


def _read_once(path: Path):
  if (path / "current").is_symlink():
    target = os.readlink(path / "current")
    if not _VERSION_DIR.match(target):
      raise _corrupt(f"current points to {target!r}", path)
    where = path / target
  elif (path / "spec.json").is_file():
    where = path  # a spec saved before versioned layouts
  else:
    raise SpecFormatError(
      f"{path} is not a saved jaxlens spec (spec.json/arrays.npz missing)",
      code="spec_not_found",
      site=str(path),
      fix=_FIX,
    )
  for name in ("spec.json", "arrays.npz"):
    # A FIFO or device there would block the read (or never end): refuse anything but a file.
    # (One stat: a FileNotFoundError, a version a writer just removed, is read again.)
    if not stat.S_ISREG(os.stat(where / name).st_mode):
      raise _corrupt(f"{name} is not a regular file", path)
  return (where / "spec.json").read_bytes(), (where / "arrays.npz").read_bytes()


def load_rules(path) -> tuple:
  """Loads the rules saved by :func:`save_rules`, refusing a truncated or altered spec."""
  path = Path(path)
  for attempt in range(50):
    try:
      text, raw = _read_once(path)
      break
    except FileNotFoundError:
      if attempt == 49 or not (path / "current").is_symlink():
        raise SpecFormatError(
          f"{path} is not a saved jaxlens spec (spec.json/arrays.npz missing)",
          code="spec_not_found",
          site=str(path),
          fix=_FIX,
        ) from None
      # A writer swapped versions between reading current and the files: read again.
    except OSError as error:
      raise SpecFormatError(
        f"{path}: cannot read the saved spec ({error})",
        code="spec_corrupt",
        site=str(path),
        fix=_FIX,
      ) from None
  try:
    doc = json.loads(text)
    with np.load(io.BytesIO(raw), allow_pickle=False) as npz:
      arrays = {k: npz[k] for k in npz.files}
  except (
    ValueError,
    OSError,
    zipfile.BadZipFile,
    EOFError,
    RuntimeError,
    NotImplementedError,
    RecursionError,
    KeyError,
    TypeError,
    UnicodeDecodeError,
    MemoryError,
    OverflowError,
  ) as error:
    raise SpecFormatError(
      f"{path}: cannot read the saved spec ({type(error).__name__}: {error})",
      code="spec_corrupt",
      site=str(path),
      fix=_FIX,
    ) from None
  if not isinstance(doc, dict) or doc.get("format") != FORMAT:
    raise SpecFormatError(
      f"{path}: not a {FORMAT} file", code="spec_corrupt", site=str(path), fix=_FIX
    )
  digest = doc.pop("sha256", None)

  def intact(version):
    try:
      return digest == _digest({**doc, "version": version}, arrays)
    except (TypeError, ValueError, RecursionError):
      return False

  version = doc.get("version")
  if version not in (1, VERSION):
    # Another version is spec_version only when the file is intact as written: a damaged
    # version field (the content hashes as a version this jaxlens reads) or a file whose
    # hash fails with a version that is not a later integer is spec_corrupt.
    newer = type(version) is int and version > VERSION
    if newer and (intact(version) or not any(intact(v) for v in (1, VERSION))):
      raise SpecFormatError(
        f"{path}: format version {version!r} (this jaxlens reads 1 and {VERSION})",
        code="spec_version",
        site=str(path),
        fix="load it with the jaxlens that saved it, or a newer one",
      )
    raise SpecFormatError(
      f"{path}: the format version field is damaged ({version!r})",
      code="spec_corrupt",
      site=str(path),
      fix=_FIX,
    )
  if not intact(version):
    raise SpecFormatError(
      f"{path}: content hash mismatch: the spec was truncated or altered",
      code="spec_corrupt",
      site=str(path),
      fix=_FIX,
    )
  try:
    return decode(doc, arrays, path)
  except RecursionError:
    raise _corrupt("nested too deeply", path) from None
