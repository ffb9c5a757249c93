"""Saving and loading intervention specs in a portable format.

A saved spec is a directory holding ``spec.json`` (the structure: selectors,
verbs, their options and where each array lives) and ``arrays.npz`` (the arrays),
with a SHA-256 content hash over both recorded in ``spec.json``. Writing is
atomic: the files are written to a temporary sibling directory that replaces the
target only once complete, so a failed save leaves what was on disk untouched.
Loading refuses a truncated or altered spec with ``spec_corrupt``.

Only verbs whose arguments are data are portable; a spec holding an opaque Python
callable (a hook, ``splice_module(fn)``) is refused with ``spec_not_portable``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import os
import shutil
import uuid
import zipfile
from pathlib import Path

import jax
import numpy as np

from jaxlens._src import backward, selections, sites, sweep, verbs
from jaxlens._src.doors import Spec
from jaxlens._src.errors import InvalidArgumentError, SiteError

FORMAT = "jaxlens-spec"
VERSION = 1

_IMPLS = {
    "scale": verbs._scale, "clamp": verbs._clamp, "add_noise": verbs._add_noise,
    "steer": verbs._steer, "add": verbs._add, "project_onto": verbs._project_onto,
    "project_out": verbs._project_out, "mean_ablate": verbs._mean_ablate,
    "scramble_elements": verbs._scramble, "permute_batch": verbs._permute_batch,
    "set_direction_mean": verbs._set_direction_mean, "compose": verbs._compose,
    "zero_ablate": verbs._zero_ablate, "replace_with": verbs._replace_with,
    "swap_with": verbs._swap_with, "patch_from": verbs._patch_from,
    "resample_rows_from": verbs._resample_rows, "at_positions": verbs._at_positions,
    "units": selections._units, "subspace": selections._subspace,
    "set_affine_coordinates": selections._set_affine,
    "grad_scale": backward._grad_scale, "grad_zero": backward._grad_zero,
    "grad_clip": backward._grad_clip, "gate": sweep._gate,
}


class SpecFormatError(InvalidArgumentError):
  """A saved spec that is missing, truncated, altered or not portable."""


# -- selectors --------------------------------------------------------------


def _selector_to_json(s) -> dict:
  if isinstance(s, sites._Module):
    return {"kind": "module", "path": s.path, "method": s.method, "call": s.call}
  if isinstance(s, sites._Label):
    return {"kind": "label", "label": s.label}
  if isinstance(s, sites._Func):
    return {"kind": "func", "name": s.name}
  if isinstance(s, sites._InModule):
    return {"kind": "in_module", "path": s.path}
  if isinstance(s, (sites._And, sites._Or)):
    return {"kind": "and" if isinstance(s, sites._And) else "or",
            "left": _selector_to_json(s.left), "right": _selector_to_json(s.right)}
  if isinstance(s, sites._All):
    return {"kind": "all"}
  if isinstance(s, sites._ModuleSites):
    return {"kind": "module_sites"}
  raise SpecFormatError(f"selector {s!r} has no portable form", code="spec_not_portable",
                        site=repr(s), fix="use jl.module / jl.label / jl.func selectors")


def _selector_from_json(d: dict):
  kind = d["kind"]
  if kind == "module":
    return sites._Module(d["path"], d["method"], d["call"])
  if kind == "label":
    return sites._Label(d["label"])
  if kind == "func":
    return sites._Func(d["name"])
  if kind == "in_module":
    return sites._InModule(d["path"])
  if kind in ("and", "or"):
    cls = sites._And if kind == "and" else sites._Or
    return cls(_selector_from_json(d["left"]), _selector_from_json(d["right"]))
  if kind == "all":
    return sites._All()
  if kind == "module_sites":
    return sites._ModuleSites()
  raise KeyError(kind)


# -- edits ------------------------------------------------------------------


class _Writer:
  def __init__(self):
    self.arrays: dict[str, np.ndarray] = {}

  def array(self, a) -> dict:
    key = f"a{len(self.arrays)}"
    self.arrays[key] = np.asarray(a)
    return {"$array": key}

  def value(self, v, where: str):
    from jaxlens._src.tracing import Trace
    if v is None or isinstance(v, (bool, int, float, str)):
      return v
    if isinstance(v, verbs.Edit):
      return {"$edit": self.edit(v, where)}
    if isinstance(v, verbs.Population):
      return {"$population": self.array(v.values)}
    if isinstance(v, Trace):
      return {"$trace": {lbl: self.array(val) for lbl, val in v.values.items()}}
    if isinstance(v, (jax.Array, np.ndarray, np.generic)):
      if isinstance(v, jax.core.Tracer):
        raise SpecFormatError("cannot save a spec holding traced values (inside jit/grad)",
                              code="spec_not_portable", site=where,
                              fix="save the spec outside transformed functions")
      return self.array(v)
    if isinstance(v, dict):
      return {"$dict": {k: self.value(x, where) for k, x in v.items()}}
    if isinstance(v, (tuple, list)):
      return {"$tuple": [self.value(x, where) for x in v]}
    if isinstance(v, sites.Site):
      return {"$site": _selector_to_json(v)}
    if isinstance(v, verbs._ByIdentity):
      raise SpecFormatError(
          f"{where}: holds the Python object {v!r}, which a portable spec cannot store",
          code="spec_not_portable", site=where,
          fix="replace the callable with built-in verbs, or keep the spec in memory")
    raise SpecFormatError(f"{where}: cannot store a {type(v).__name__}",
                          code="spec_not_portable", site=where,
                          fix="pass arrays, numbers or built-in verbs")

  def edit(self, e: verbs.Edit, where: str) -> dict:
    if e.name not in _IMPLS or e.impl is not _IMPLS[e.name]:
      raise SpecFormatError(
          f"{where}: {e!r} is not a portable built-in verb (hooks and splice_module hold "
          "Python callables)", code="spec_not_portable", site=where,
          fix="use built-in verbs in a spec you save; bind callables in memory")
    return {"verb": e.name, "keeps": e.keeps, "keep_grad": e.keep_grad,
            "static": [[k, self.value(v, where)] for k, v in e.static],
            "params": self.value(e.params, where)}


def _read_value(v, arrays):
  if not isinstance(v, dict):
    return v
  if "$array" in v:
    # Host arrays: verbs convert them where they are used, and checks on their
    # values (index bounds, basis rank) still run inside jit and grad.
    return arrays[v["$array"]]
  if "$edit" in v:
    return _read_edit(v["$edit"], arrays)
  if "$population" in v:
    return verbs.Population(arrays[v["$population"]["$array"]])
  if "$trace" in v:
    from jaxlens._src.tracing import Trace
    values = {lbl: arrays[ref["$array"]] for lbl, ref in v["$trace"].items()}
    return Trace(None, values, {lbl: None for lbl in values})
  if "$dict" in v:
    return {k: _read_value(x, arrays) for k, x in v["$dict"].items()}
  if "$tuple" in v:
    return tuple(_read_value(x, arrays) for x in v["$tuple"])
  if "$site" in v:
    return _selector_from_json(v["$site"])
  raise KeyError(next(iter(v)))


def _read_edit(d, arrays) -> verbs.Edit:
  static = tuple((k, _read_value(v, arrays)) for k, v in d["static"])
  params = _read_value(d["params"], arrays)
  if d["verb"] == "compose":
    params = {"edits": tuple(params["edits"])}
  return verbs.Edit(d["verb"], _IMPLS[d["verb"]], params, static, d["keeps"], d["keep_grad"])


# -- files ------------------------------------------------------------------


def _digest(structure: dict, arrays: dict[str, np.ndarray]) -> str:
  h = hashlib.sha256()
  h.update(json.dumps(structure, sort_keys=True).encode())
  for key in sorted(arrays):
    a = np.ascontiguousarray(arrays[key])
    h.update(f"{key}:{a.dtype.str}:{a.shape}".encode())
    h.update(a.tobytes())
  return h.hexdigest()


def save_spec(spec: Spec, path) -> Path:
  """Saves ``spec`` to the directory ``path`` (atomically; see the module docstring).

  An existing directory at ``path`` is replaced only if it is itself a saved
  spec; anything else there is refused with ``spec_target_exists``.
  """
  path = Path(path)
  writer = _Writer()
  rules = []
  for i, (selector, edit) in enumerate(spec.rules):
    where = f"rule {i} ({selector!r})"
    rules.append({"site": _selector_to_json(selector), "edit": writer.edit(edit, where)})
  structure = {"format": FORMAT, "version": VERSION, "rules": rules}
  digest = _digest(structure, writer.arrays)
  if path.exists() and not (path.is_dir() and (path / "spec.json").is_file()):
    raise SpecFormatError(f"{path} exists and is not a saved jaxlens spec; refusing to replace it",
                          code="spec_target_exists", site=str(path),
                          fix="save to a new directory")
  path.parent.mkdir(parents=True, exist_ok=True)
  tmp = path.parent / f".{path.name}.tmp-{uuid.uuid4().hex}"
  tmp.mkdir()
  try:
    buf = io.BytesIO()
    np.savez(buf, **writer.arrays)
    _write(tmp / "arrays.npz", buf.getvalue())
    _write(tmp / "spec.json", json.dumps({**structure, "sha256": digest}, indent=1).encode())
    if path.exists():
      old = path.parent / f".{path.name}.old-{uuid.uuid4().hex}"
      os.replace(path, old)
      os.replace(tmp, path)
      shutil.rmtree(old, ignore_errors=True)
    else:
      os.replace(tmp, path)
  finally:
    if tmp.exists():
      shutil.rmtree(tmp, ignore_errors=True)
  return path


def _write(path: Path, data: bytes):
  with open(path, "wb") as f:
    f.write(data)
    f.flush()
    os.fsync(f.fileno())


def load_spec(path) -> Spec:
  """Loads a spec saved by :func:`save_spec`, refusing a truncated or altered one."""
  path = Path(path)
  fix = "save the spec again with spec.save(path)"
  if not (path / "spec.json").is_file() or not (path / "arrays.npz").is_file():
    raise SpecFormatError(f"{path} is not a saved jaxlens spec (spec.json/arrays.npz missing)",
                          code="spec_not_found", site=str(path), fix=fix)
  try:
    doc = json.loads((path / "spec.json").read_text())
    raw = (path / "arrays.npz").read_bytes()
    with np.load(io.BytesIO(raw), allow_pickle=False) as npz:
      arrays = {k: npz[k] for k in npz.files}
  except (ValueError, OSError, zipfile.BadZipFile, EOFError) as error:
    raise SpecFormatError(f"{path}: cannot read the saved spec ({error})", code="spec_corrupt",
                          site=str(path), fix=fix) from None
  if not isinstance(doc, dict) or doc.get("format") != FORMAT:
    raise SpecFormatError(f"{path}: not a {FORMAT} file", code="spec_corrupt", site=str(path),
                          fix=fix)
  if doc.get("version") != VERSION:
    raise SpecFormatError(f"{path}: format version {doc.get('version')} (this jaxlens reads "
                          f"{VERSION})", code="spec_version", site=str(path), fix=fix)
  digest = doc.pop("sha256", None)
  if digest != _digest(doc, arrays):
    raise SpecFormatError(f"{path}: content hash mismatch: the spec was truncated or altered",
                          code="spec_corrupt", site=str(path), fix=fix)
  try:
    rules = tuple((_selector_from_json(r["site"]), _read_edit(r["edit"], arrays))
                  for r in doc["rules"])
  except (KeyError, TypeError) as error:
    raise SpecFormatError(f"{path}: malformed spec ({error!r})", code="spec_corrupt",
                          site=str(path), fix=fix) from None
  return Spec(rules)


@dataclasses.dataclass(frozen=True)
class SpecReport:
  """What :func:`check_spec` found: rules whose site is missing or whose values mismatch."""

  missing: tuple = ()
  mismatched: tuple = ()

  @property
  def ok(self) -> bool:
    return not self.missing and not self.mismatched


def check_spec(spec: Spec, model, *args) -> SpecReport:
  """Checks each rule of ``spec`` against ``model``'s sites, abstractly (no compute).

  Args:
    spec: the spec (for example one from :func:`load_spec`).
    model, *args: as for ``jl.trace``: a bound model and its inputs, or an unbound
      model, its variables and inputs.

  Returns:
    A SpecReport listing ``(rule index, selector, message)`` for every rule whose
    site does not exist (``missing``) and every rule that fails on the model's
    values, such as a donor or direction of the wrong shape (``mismatched``).
  """
  from jaxlens._src.tracing import trace
  missing, mismatched = [], []
  for i, rule in enumerate(spec.rules):
    try:
      jax.eval_shape(lambda: trace(model, *args, intervene=Spec((rule,)), save=False).output)
    except SiteError as error:
      missing.append((i, repr(rule[0]), str(error)))
    except InvalidArgumentError as error:
      mismatched.append((i, repr(rule[0]), str(error)))
  return SpecReport(tuple(missing), tuple(mismatched))
