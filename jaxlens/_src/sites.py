"""Site selectors: small frozen predicates over the sites a model run visits.

A *site* is one call of a Flax module method (by default ``__call__``); its value
is what the call returned. Sites are named by the module path Flax gives them,
joined with ``/`` (``"layers_0"``, ``"block_1/mlp"``); the n-th call (n >= 2) of
the same module in one run is labelled ``"path:n"``. The root module's output is
labelled ``"output"``.

Selectors combine with ``&`` and ``|`` and have a readable ``repr``.
"""

from __future__ import annotations

import dataclasses
import difflib
import fnmatch
import re
from typing import Iterable

from jaxlens._src import render
from jaxlens._src.errors import InvalidArgumentError, SiteError, SpecFormatError
from jaxlens._src.tracebacks import api_boundary

__all__ = [
  "Site",
  "SiteInfo",
  "module",
  "func",
  "label",
  "in_module",
  "all_sites",
  "module_sites",
  "as_selector",
]

OUTPUT_LABEL = "output"
# (A "[k]" layer suffix is not read here: "layers_[01]" is a glob; jl.label takes it.)
_LABEL = re.compile(r"^(?P<path>[^:#]*?)(?::(?P<call>\d+))?(?:#(?P<output>\w+))?$")


@dataclasses.dataclass(frozen=True)
class SiteInfo:
  """What a selector sees of one site call.

  Attributes:
    path: the module path joined with ``/`` (``""`` for the root module); for an
      op site, the module that ran the op.
    method: the method name (``"__call__"``; ``""`` for an op site).
    call: 1 for the first call of this module method in the run, 2 for the next;
      for an op site, n in its label ``<func>_<n>``.
    module_type: the module class name.
    func: the primitive name of an op site (``"dot_general"``).
    kind: ``"module"`` or ``"op"``.
    index: the output index of a multiple-output op.
    layer: for a site inside a ``scan`` body (an ``nn.scan`` / ``nnx.scan`` layer
      stack), the iteration (layer) this info stands for; ``None`` for the site as a
      whole (its value stacks every layer along axis 0).
    layers: the scan length for a site inside a ``scan`` body, else ``None``.
    output: for one element of a module's tuple, list or dict output, its index or
      key (label ``"path#0"``, ``"path#hidden"``); ``None`` for the output as a whole.
  """

  path: str
  method: str
  call: int
  module_type: str
  func: str | None = None
  kind: str = "module"
  index: int | None = None
  layer: int | None = None
  layers: int | None = None
  output: int | str | None = None

  @property
  def label(self) -> str:
    if self.kind == "op":
      base = f"{self.func}_{self.call}"
      base = base if self.index is None else f"{base}:{self.index}"
    else:
      base = OUTPUT_LABEL if self.path == "" else self.path
      if self.method != "__call__":
        base = f"{base}.{self.method}"
      base = base if self.call == 1 else f"{base}:{self.call}"
      base = base if self.output is None else f"{base}#{self.output}"
    return base if self.layer is None else f"{base}[{self.layer}]"

  def at_layer(self, layer: int) -> "SiteInfo":
    return dataclasses.replace(self, layer=layer)


def matched_layers(selector: "Site", info: SiteInfo) -> list[int] | None:
  """The layers of a scan-body site that ``selector`` selects (None outside scans)."""
  if info.layers is None or info.layer is not None:
    return None
  return [k for k in range(info.layers) if selector.matches(info.at_layer(k))]


def hits(selector: "Site", info: SiteInfo) -> bool:
  """Whether ``selector`` selects ``info`` or, for a scan-body site, one of its layers."""
  if selector.matches(info):
    return True
  return bool(matched_layers(selector, info))


class Site:
  """Base class of site selectors: a predicate over :class:`SiteInfo`."""

  def matches(self, info: SiteInfo) -> bool:
    raise NotImplementedError

  def may_match_ops(self) -> bool:
    """Whether this selector can select op sites (which need the captured program)."""
    return True

  def picks_layer(self) -> bool:
    """Whether this selector names one layer of a scanned stack (needs the program)."""
    return False

  def __and__(self, other: "Site") -> "Site":
    return _And(self, as_selector(other))

  def __or__(self, other: "Site") -> "Site":
    return _Or(self, as_selector(other))

  def __treescope_repr__(self, path, subtree_renderer):
    """treescope's view: the selector as written."""
    return render.treescope_repr(render.SelectorView(self), path, subtree_renderer)

  def describe_miss(self, seen: Iterable[SiteInfo]) -> tuple[str, list[str]]:
    """A sentence on why nothing matched and the closest existing labels."""
    labels = sorted({s.label for s in seen})
    return f"{self!r} matched no site of this run", labels[:10]

  def to_json(self) -> dict:
    """The selector's saved form: ``{"kind": ..., field: value, ...}``."""
    out = {"kind": self.kind}
    for f in dataclasses.fields(self):
      value = getattr(self, f.name)
      out[f.name] = value.to_json() if isinstance(value, Site) else value
    return out

  def module_path(self) -> str | None:
    """The module path when this selector names the first call of one module, else None.

    (What another framework's twin of the model can map: torch_bridge uses it.)
    """
    return None


_KINDS: dict[str, type] = {}


def _kind(name: str):
  """Registers a selector class under the ``kind`` its saved form carries."""

  def register(cls):
    cls.kind = name
    _KINDS[name] = cls
    return cls

  return register


def selector_from_json(d, *, depth: int = 0) -> "Site":
  """The selector a :meth:`Site.to_json` form describes; a typed error for anything else."""

  def bad(why):
    return SpecFormatError(
      f"malformed selector {d!r:.200}: {why}",
      code="spec_corrupt",
      fix="save the spec again with spec.save(path)",
    )

  if depth > 64:
    raise bad("nested too deeply")
  if not isinstance(d, dict) or d.get("kind") not in _KINDS:
    raise bad(f"unknown kind (one of {sorted(_KINDS)})")
  cls = _KINDS[d["kind"]]
  values = {}
  for f in dataclasses.fields(cls):
    if f.name not in d:
      if f.default is dataclasses.MISSING:
        raise bad(f"missing {f.name!r}")
      continue
    value = d[f.name]
    if f.type in ("Site", Site):
      value = selector_from_json(value, depth=depth + 1)
    elif f.type in ("str", str):
      if not isinstance(value, str):
        raise bad(f"{f.name} must be a string")
    elif f.name == "output" and isinstance(value, str):
      pass
    elif value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
      raise bad(f"{f.name} must be a non-negative int or null")
    values[f.name] = value
  return cls(**values)


@_kind("module")
@dataclasses.dataclass(frozen=True)
class _Module(Site):
  path: str
  method: str = "__call__"
  call: int | None = None
  layer: int | None = None
  output: int | str | None = None

  def matches(self, info: SiteInfo) -> bool:
    if info.kind != "module" or info.method != self.method or info.output != self.output:
      return False
    if self.call is not None and info.call != self.call:
      return False
    if self.layer is not None and info.layer != self.layer:
      return False
    if any(ch in self.path for ch in "*?["):
      return fnmatch.fnmatchcase(info.path, self.path)
    return info.path == self.path

  def may_match_ops(self) -> bool:
    return False

  def picks_layer(self) -> bool:
    return self.layer is not None

  def module_path(self) -> str | None:
    if (
      self.method != "__call__"
      or self.call not in (None, 1)
      or self.layer is not None
      or self.output is not None
      or any(ch in self.path for ch in "*?[")
    ):
      return None
    return self.path

  def describe_miss(self, seen):
    if self.layer is not None:
      stacks = [
        s for s in seen if s.layers is not None and dataclasses.replace(self, layer=None).matches(s)
      ]
      if stacks:
        n = stacks[0].layers
        return (
          f"layer {self.layer} is out of range: {stacks[0].label!r} runs in a scan of {n} layers",
          [stacks[0].at_layer(k).label for k in range(min(n, 10))],
        )
    elements = sorted(
      {
        s.label
        for s in seen
        if s.kind == "module"
        and s.output is not None
        and dataclasses.replace(self, output=s.output).matches(s)
      }
    )
    if elements:
      return (
        f"the module {self.path!r} returns a tuple or dict; select one element with output=",
        elements[:10],
      )
    same_path = sorted(
      {s.label for s in seen if s.kind == "module" and s.path == self.path and s.layers is None}
    )
    if same_path and not any(ch in self.path for ch in "*?["):
      calls = sorted(
        {
          (s.method, s.call)
          for s in seen
          if s.kind == "module" and s.path == self.path and s.layers is None
        }
      )
      ran = ", ".join(f"{m} call {c}" for m, c in calls)
      return (
        f"the module {self.path!r} ran ({ran}), but not as method={self.method!r} "
        f"call={self.call!r}"
        + (f" layer={self.layer!r}" if self.layer is not None else "")
        + (f" output={self.output!r}" if self.output is not None else "")
        + "; select one of the calls that ran",
        same_path[:10],
      )
    paths = sorted({s.path for s in seen if s.path and s.kind == "module"} - {self.path})
    close = difflib.get_close_matches(self.path, paths, n=5, cutoff=0.4)
    suffix = [p for p in paths if p.endswith("/" + self.path)]
    candidates = list(dict.fromkeys(suffix + close)) or paths[:10]
    return f"no module at path {self.path!r} ran in this model", candidates

  def __repr__(self) -> str:
    extra = "" if self.method == "__call__" else f", method={self.method!r}"
    extra += "" if self.call is None else f", call={self.call}"
    extra += "" if self.layer is None else f", layer={self.layer}"
    extra += "" if self.output is None else f", output={self.output!r}"
    return f"jl.module({self.path!r}{extra})"


@_kind("label")
@dataclasses.dataclass(frozen=True)
class _Label(Site):
  label: str

  def module_path(self) -> str | None:
    return self.label

  def matches(self, info: SiteInfo) -> bool:
    return info.label == self.label

  def picks_layer(self) -> bool:
    return self.label.endswith("]")

  def describe_miss(self, seen):
    labels = sorted({s.label for s in seen})
    return (
      f"no site labelled {self.label!r} in this run",
      difflib.get_close_matches(self.label, labels, n=5, cutoff=0.4) or labels[:10],
    )

  def __repr__(self) -> str:
    return f"jl.label({self.label!r})"


@_kind("and")
@dataclasses.dataclass(frozen=True)
class _And(Site):
  left: Site
  right: Site

  def matches(self, info: SiteInfo) -> bool:
    return self.left.matches(info) and self.right.matches(info)

  def may_match_ops(self) -> bool:
    return self.left.may_match_ops() and self.right.may_match_ops()

  def picks_layer(self) -> bool:
    return self.left.picks_layer() or self.right.picks_layer()

  def __repr__(self) -> str:
    return f"({self.left!r} & {self.right!r})"


@_kind("or")
@dataclasses.dataclass(frozen=True)
class _Or(Site):
  left: Site
  right: Site

  def matches(self, info: SiteInfo) -> bool:
    return self.left.matches(info) or self.right.matches(info)

  def may_match_ops(self) -> bool:
    return self.left.may_match_ops() or self.right.may_match_ops()

  def picks_layer(self) -> bool:
    return self.left.picks_layer() or self.right.picks_layer()

  def __repr__(self) -> str:
    return f"({self.left!r} | {self.right!r})"


@_kind("func")
@dataclasses.dataclass(frozen=True)
class _Func(Site):
  name: str

  def matches(self, info: SiteInfo) -> bool:
    return info.kind == "op" and fnmatch.fnmatchcase(info.func or "", self.name)

  def describe_miss(self, seen):
    funcs = sorted({s.func for s in seen if s.kind == "op"})
    return (
      f"no op {self.name!r} ran in this model",
      difflib.get_close_matches(self.name, funcs, n=5, cutoff=0.4) or funcs[:10],
    )

  def __repr__(self) -> str:
    return f"jl.func({self.name!r})"


@_kind("in_module")
@dataclasses.dataclass(frozen=True)
class _InModule(Site):
  path: str

  def matches(self, info: SiteInfo) -> bool:
    if info.kind != "op":
      return False
    return (
      info.path == self.path
      or info.path.startswith(self.path + "/")
      or (any(ch in self.path for ch in "*?[") and fnmatch.fnmatchcase(info.path, self.path))
    )

  def describe_miss(self, seen):
    paths = sorted({s.path for s in seen if s.path})
    return (
      f"no op ran inside module {self.path!r}",
      difflib.get_close_matches(self.path, paths, n=5, cutoff=0.4) or paths[:10],
    )

  def __repr__(self) -> str:
    return f"jl.in_module({self.path!r})"


@_kind("module_sites")
@dataclasses.dataclass(frozen=True)
class _ModuleSites(Site):
  broad = True

  def matches(self, info: SiteInfo) -> bool:
    return info.kind == "module"

  def may_match_ops(self) -> bool:
    return False

  def __repr__(self) -> str:
    return "jl.module_sites()"


@_kind("all")
@dataclasses.dataclass(frozen=True)
class _All(Site):
  broad = True

  def matches(self, info: SiteInfo) -> bool:
    return True

  def __repr__(self) -> str:
    return "jl.all_sites()"


@api_boundary
def module(
  path: str,
  *,
  method: str = "__call__",
  call: int | None = None,
  layer: int | None = None,
  output: int | str | None = None,
) -> Site:
  """Selects the output of the Flax submodule at ``path``.

  Args:
    path: the module path Flax gives the submodule, parts joined with ``/``
      (``"layers_0"``, ``"block_1/mlp"``). Glob patterns (``"block_*/mlp"``)
      select every matching module.
    method: the method whose return value is the site (default ``__call__``).
    call: only the n-th call of that module (1-based) when it runs several times.
    layer: for a module inside an ``nn.scan`` / ``nnx.scan`` layer stack, only the
      layer with this index (0-based, the index of its stacked parameters); without
      it every layer is selected. The stack is not unrolled: the edit is applied
      inside the scan body where the iteration index equals ``layer``.
    output: for a module that returns a tuple, list or dict (a Hugging Face-style
      decoder layer returning ``(hidden, ...)``), the index or key of the element
      to select (label ``"path#0"``); the other elements pass through unchanged.

  Example:
    >>> import jaxlens as jl
    >>> jl.module("layers_0") | jl.module("layers_1")
    (jl.module('layers_0') | jl.module('layers_1'))
  """
  if not isinstance(path, str):
    raise InvalidArgumentError(
      f"jl.module expects a module path string, got {type(path).__name__}",
      code="invalid_site",
      fix='jl.module("layers_0")',
    )
  path = path.strip("/")
  # A label the trace printed ("path:2", "path#0") names the same site.
  found = _LABEL.match(path)
  if found and any(found.group(g) is not None for g in ("call", "output")):
    path = found.group("path")
    if found.group("call") is not None and call is None:
      call = int(found.group("call"))
    if found.group("output") is not None and output is None:
      o = found.group("output")
      output = int(o) if o.isdigit() else o
  if call is not None and (not isinstance(call, int) or call < 1):
    raise InvalidArgumentError(
      f"call must be a positive int, got {call!r}",
      code="invalid_site",
      site=path,
      fix=f'jl.module("{path}", call=1)',
    )
  if layer is not None and (isinstance(layer, bool) or not isinstance(layer, int) or layer < 0):
    raise InvalidArgumentError(
      f"layer must be a non-negative int, got {layer!r}",
      code="invalid_site",
      site=path,
      fix=f'jl.module("{path}", layer=0)',
    )
  if output is not None and (
    isinstance(output, bool)
    or not isinstance(output, (int, str))
    or (isinstance(output, int) and output < 0)
  ):
    raise InvalidArgumentError(
      f"output must be an element index or a dict key, got {output!r}",
      code="invalid_site",
      site=path,
      fix=f'jl.module("{path}", output=0)',
    )
  return _Module(path, method, call, layer, output)


@api_boundary
def all_sites() -> Site:
  """Selects every site: module outputs and every op."""
  return _All()


@api_boundary
def module_sites() -> Site:
  """Selects every module output (the default of ``save=``)."""
  return _ModuleSites()


@api_boundary
def func(name: str) -> Site:
  """Selects op sites by primitive name (``"tanh"``, ``"dot_general"``; globs allowed).

  Example:
    >>> import jaxlens as jl
    >>> jl.func("tanh") & jl.in_module("block_1")
    (jl.func('tanh') & jl.in_module('block_1'))
  """
  if not isinstance(name, str):
    raise InvalidArgumentError(
      f"jl.func expects a primitive name, got {type(name).__name__}",
      code="invalid_site",
      fix='jl.func("tanh")',
    )
  return _Func(name)


@api_boundary
def label(name: str) -> Site:
  """Selects the site with this exact label (``"dot_general_3"``, ``"block_0/mlp"``)."""
  if not isinstance(name, str):
    raise InvalidArgumentError(
      f"jl.label expects a label string, got {type(name).__name__}",
      code="invalid_site",
      fix='jl.label("tanh_1")',
    )
  return _Label(name)


@api_boundary
def in_module(path: str) -> Site:
  """Selects the op sites run by the module at ``path`` or its submodules."""
  if not isinstance(path, str):
    raise InvalidArgumentError(
      f"jl.in_module expects a module path, got {type(path).__name__}",
      code="invalid_site",
      fix='jl.in_module("block_1")',
    )
  return _InModule(path.strip("/"))


def as_selector(obj) -> Site:
  """A selector from a selector or a site label string."""
  if isinstance(obj, Site):
    return obj
  if isinstance(obj, str):
    return _Label(obj)
  raise InvalidArgumentError(
    f"expected a site selector (jl.module(...)) or a label string, got {type(obj).__name__}",
    code="invalid_site",
    fix='jl.module("layers_0")',
  )


def unmatched_error(selector: Site, seen: list[SiteInfo], what: str) -> SiteError:
  sentence, candidates = selector.describe_miss(seen)
  fix = f"one of: {', '.join(candidates)}" if candidates else None
  return SiteError(
    f"{what}: {sentence}", code="unknown_site", site=repr(selector), fix=fix, candidates=candidates
  )
