"""Splicing a dictionary into a model: its features become sites.

``sae.splice(model, site, dictionary)`` returns the model with the dictionary at
``site``: a model of the same class and fields (a subclass made for the splice) whose
``apply`` runs the original under a Flax method interceptor. When the module at
``site`` returns ``y``, the interceptor computes, with the dictionary's pure functions,

* ``acts = encode(x)`` (``x = y`` for an SAE; for a transcoder, the module call's first
  input, or the value of its ``reads=`` site),
* ``recon = decode(acts)`` (plus the skip term of a transcoder),
* ``error = y - decode(encode(x))`` (from the unedited features),

passes each through an identity module (:class:`jaxlens.Named`) whose path is
``<site>/sae/acts``, ``<site>/sae/recon`` and ``<site>/sae/error``, and returns
``recon + error`` (``recon`` alone with ``keep_error=False``). Identity modules are
sites on every door, so the features are edited, saved, patched and differentiated like
any other site; and since ``recon + error`` equals ``y`` up to rounding, the spliced
model computes what the model computes until something edits a feature.

A :class:`~jaxlens.sae.CrossLayerTranscoder` is spliced at ``L`` modules at once (each
layer's MLP): layer ``j``'s features ``encode_layer(j, x_j)`` of the MLP's input are the site
``<mlp_j>/clt/acts``, and the MLP's output becomes the decoders of the (possibly edited)
features of layers ``0..j`` into layer ``j`` (``<mlp_j>/clt/recon``) plus the error
``<mlp_j>/clt/error`` computed from the unedited features.

The dictionary's arrays are constants of the spliced model (held by its class, not its
variables): the model's variables are unchanged, and a captured program is reused for
the same spliced model.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping

import flax.linen as nn
import jax
from flax import nnx
from flax.core.scope import Scope

from jaxlens.core import Named, NamedNNX, Site, SiteError
from jaxlens.core import module as module_selector
from jaxlens.internal import SiteInfo, api_boundary, unmatched_error
from jaxlens.sae._dictionaries import SAE, CrossLayerTranscoder, SAEError, Transcoder

__all__ = ["splice", "SUFFIXES"]

SUFFIXES = ("acts", "recon", "error")


class _Entry:
  def __init__(self, selector, dictionary, reads, keep_error, stop_error_grad):
    self.selector = selector
    self.dictionary = dictionary
    self.reads = reads
    self.keep_error = keep_error
    self.stop_error_grad = stop_error_grad


class _CLTEntry:
  """A cross-layer transcoder over the modules ``selectors`` (one per layer) or, for one
  selector (a glob), over its matches in the order they first run."""

  def __init__(self, selectors, dictionary, keep_error, stop_error_grad):
    self.selectors = selectors
    self.selector = selectors[0] if len(selectors) == 1 else None
    self.dictionary = dictionary
    self.reads = None
    self.keep_error = keep_error
    self.stop_error_grad = stop_error_grad

  def describe(self):
    return ", ".join(repr(s) for s in self.selectors)


def _named(path: tuple, value):
  """``value`` through an identity module at ``path``: a site on every door."""
  return Named(parent=Scope({}, rngs=None, path=path))(value)


def _linen_names(prefix: tuple):
  return lambda suffix, value: _named(prefix + (suffix,), value)


class _Run:
  """One ``apply`` of a spliced model: call counts, values read, splices done."""

  def __init__(self, entries):
    self.entries = entries
    self.calls: dict = {}
    self.read: dict = {}
    self.fired = [0] * len(entries)
    self.seen: list[SiteInfo] = []
    self.clt: dict = {}  # entry -> {layer: (clean acts, acts)}
    self.layers: dict = {}  # entry -> {path: layer} (a glob's matches in call order)

  def _clt_layer(self, i, entry, info):
    """The layer of a cross-layer transcoder that the module call ``info`` is, or None."""
    if entry.selector is None:
      for layer, selector in enumerate(entry.selectors):
        if selector.matches(info):
          self.layers.setdefault(i, {})[info.path] = layer
          return layer
      return None
    if not entry.selector.matches(info):
      return None
    layers = self.layers.setdefault(i, {})
    if info.path not in layers:
      if len(layers) == entry.dictionary.n_layers:
        raise SAEError(
          f"splice: {entry.selector!r} matched more modules than the cross-layer transcoder's "
          f"{entry.dictionary.n_layers} layers ({sorted(layers)} and {info.path!r})",
          code="sae_shape_mismatch",
          field="n_layers",
          site=info.label,
          fix="name the layers' MLPs: sae.splice(model, [f'block_{i}/mlp' for i in range(L)], clt)",
        )
      layers[info.path] = len(layers)
    return layers[info.path]

  def interceptor(self, next_fun, args, kwargs, context):
    out = next_fun(*args, **kwargs)
    if context.method_name == "setup":
      return out
    mod = context.module
    path = tuple(mod.path)
    key = (path, context.method_name)
    self.calls[key] = self.calls.get(key, 0) + 1
    info = SiteInfo("/".join(path), context.method_name, self.calls[key], type(mod).__name__)
    self.seen.append(info)
    for i, entry in enumerate(self.entries):
      if isinstance(entry, _CLTEntry):
        layer = self._clt_layer(i, entry, info)
        if layer is not None:
          x = args[0] if args else None
          name = _linen_names(path + ("clt",))
          out = _apply_clt(entry, self.clt.setdefault(i, {}), layer, name, info.label, out, x)
          self.fired[i] += 1
        continue
      if entry.reads is not None and entry.reads.matches(info):
        self.read[i] = out
      if entry.selector.matches(info):
        x = args[0] if args else None
        if entry.reads is not None:
          if i not in self.read:
            raise SiteError(
              f"splice: the site {info.label!r} ran before its reads= site {entry.reads!r}",
              code="sae_reads_missing",
              site=info.label,
              fix="reads= a site that runs before the spliced one (the MLP's input)",
            )
          x = self.read[i]
        out = _apply(entry, _linen_names(path + ("sae",)), info.label, out, x)
        self.fired[i] += 1
    return out

  def check(self):
    for i, (entry, count) in enumerate(zip(self.entries, self.fired)):
      if isinstance(entry, _CLTEntry):
        found = len(self.layers.get(i, {}))
        if found == 0:
          raise unmatched_error(entry.selectors[0], self.seen, "sae.splice")
        if found != entry.dictionary.n_layers or len(set(self.layers[i].values())) != found:
          raise SAEError(
            f"splice: the cross-layer transcoder has {entry.dictionary.n_layers} layers but "
            f"{entry.describe()} matched {found} distinct modules ({sorted(self.layers[i])})",
            code="sae_shape_mismatch",
            field="n_layers",
            fix="one module (the layer's MLP) per layer, in order",
          )
      elif count == 0:
        raise unmatched_error(entry.selector, self.seen, "sae.splice")


def _width(d, a) -> int:
  """The width ``d`` reads of ``a``: a hook_z dictionary flattens ``(..., heads, head_dim)``."""
  if d.reshape_activations == "hook_z" and a.ndim >= 2 and a.shape[-1] != d.d_in:
    return a.shape[-2] * a.shape[-1]
  return a.shape[-1]


def _apply(entry: _Entry, name, label: str, y, x):
  """The site's new value; ``name(suffix, value)`` passes a value through its site."""
  d = entry.dictionary
  if not isinstance(y, jax.Array) and not hasattr(y, "aval"):
    raise SiteError(
      f"splice: the site {label!r} returns a {type(y).__name__}, not an array",
      code="sae_site_not_array",
      site=label,
      fix="splice at a module that returns one array",
    )
  transcoder = isinstance(d, Transcoder)
  source = x if transcoder else y
  if transcoder and (source is None or not hasattr(source, "shape")):
    raise SiteError(
      f"splice: a transcoder at {label!r} reads the module's first input, which is not an array",
      code="sae_site_not_array",
      site=label,
      fix="reads= the site holding the transcoder's input",
    )
  width = d.d_out if transcoder else d.d_in
  if _width(d, y) != width or _width(d, source) != d.d_in:
    raise SAEError(
      f"splice at {label!r}: the site's last axis is {y.shape[-1]} (input {source.shape[-1]}), "
      f"but the dictionary reads {d.d_in} and writes {width}",
      code="sae_shape_mismatch",
      field="d_in",
      site=label,
      fix="a dictionary trained on this site",
    )
  acts_clean, recon_clean = d.parts(source)
  error = y.astype(recon_clean.dtype) - recon_clean
  if entry.stop_error_grad:
    error = jax.lax.stop_gradient(error)
  acts = name("acts", acts_clean)
  recon = d.decode(acts, source)
  if transcoder and d.W_skip is not None:
    recon = recon + d.skip(source)
  recon = name("recon", recon)
  error = name("error", error)
  new = recon + error if entry.keep_error else recon
  return new.astype(y.dtype)


def _apply_clt(entry: _CLTEntry, store: dict, layer: int, name, label: str, y, x):
  """Layer ``layer``'s MLP output ``y`` through the cross-layer transcoder: its features from
  the MLP input ``x``, its output the decoders of layers ``0..layer`` into it (plus error)."""
  d = entry.dictionary
  if not hasattr(y, "shape") or x is None or not hasattr(x, "shape"):
    raise SiteError(
      f"splice: a cross-layer transcoder at {label!r} needs a module that takes and returns "
      "one array (an MLP)",
      code="sae_site_not_array",
      site=label,
      fix="splice at each layer's MLP module",
    )
  d_in, d_out = d.W_enc.shape[1], d.b_dec.shape[-1]
  if y.shape[-1] != d_out or x.shape[-1] != d_in:
    raise SAEError(
      f"splice at {label!r}: the MLP reads {x.shape[-1]} and writes {y.shape[-1]}, but the "
      f"cross-layer transcoder reads {d_in} and writes {d_out}",
      code="sae_shape_mismatch",
      field="d_in",
      site=label,
      fix="a cross-layer transcoder trained on these MLPs",
    )
  missing = [i for i in range(layer) if i not in store]
  if missing:
    raise SiteError(
      f"splice: the cross-layer transcoder's layer {layer} ({label!r}) ran before its "
      f"layers {missing}",
      code="sae_reads_missing",
      site=label,
      fix="list the layers' modules in the order the model runs them",
    )
  clean = d.encode_layer(layer, x)
  acts = name("acts", clean)
  store[layer] = (clean, acts)
  w = d.W_dec
  recon_clean = d.b_dec[layer] + sum(store[i][0] @ w[i][layer - i] for i in range(layer + 1))
  recon = d.b_dec[layer] + sum(store[i][1] @ w[i][layer - i] for i in range(layer + 1))
  error = y.astype(recon_clean.dtype) - recon_clean
  if entry.stop_error_grad:
    error = jax.lax.stop_gradient(error)
  recon = name("recon", recon)
  error = name("error", error)
  new = recon + error if entry.keep_error else recon
  return new.astype(y.dtype)


_SPLICED: dict = {}
_lock = threading.Lock()


def _spliced_class(base: type, entries: tuple) -> type:
  def apply(self, variables, *args, **kwargs):
    run = _Run(entries)
    with nn.intercept_methods(run.interceptor):
      out = base.apply(self, variables, *args, **kwargs)
    run.check()
    return out

  namespace = {
    "apply": nn.nowrap(apply),
    "__module__": base.__module__,
    "__qualname__": base.__qualname__,
    "_jaxlens_splices": entries,
    "_jaxlens_base": base,
  }
  # A decoder's block-at-a-time methods (jaxlens.protocol.Decoder / Scannable, which the
  # sweeps use to run blocks on their own) would run the blocks without the splice: a
  # spliced model does not offer them (None makes the protocol checks fail), so the sweeps
  # take their general path through the doors, or refuse.
  for method in ("run_block", "scanned"):
    if hasattr(base, method):
      namespace[method] = None
  return type(base.__name__, (base,), namespace)


# -- NNX -------------------------------------------------------------------------------------
#
# An NNX model is spliced in a copy (``nnx.clone``): each matched submodule's class becomes a
# subclass made for the splice, whose ``__call__`` runs the original and then the dictionary,
# and the submodule gets a child ``sae`` (``clt``) holding three identity modules
# (:class:`jaxlens.NamedNNX`) ``acts``, ``recon`` and ``error``. Those are submodules of the
# model, so the doors' NNX interception sees them at ``<site>/sae/acts`` etc. The dictionary
# is a class attribute of the subclass (a constant, as for linen: the model's state is
# unchanged), and ``nnx.split`` / ``nnx.merge`` keep the subclass in the graph definition.


class _NNXSites(nnx.Module):
  def __init__(self):
    self.acts = NamedNNX()
    self.recon = NamedNNX()
    self.error = NamedNNX()


_clt_runs = threading.local()


def _clt_store(entry, layer: int) -> dict:
  """The features of this forward's earlier layers of a cross-layer transcoder (NNX): layer 0
  starts a new store and the last layer drops it, so a forward that skips a layer is refused
  rather than given another forward's features."""
  stores = _clt_runs.__dict__.setdefault("stores", {})
  if layer == 0:
    stores[id(entry)] = {}
  return stores.setdefault(id(entry), {})


def _nnx_spliced_class(base: type, entry, label: str, layer) -> type:
  child = "sae" if layer is None else "clt"

  def __call__(self, *args, **kwargs):
    out = base.__call__(self, *args, **kwargs)
    sites = getattr(self, child)
    name = lambda suffix, value: getattr(sites, suffix)(value)  # noqa: E731
    x = args[0] if args else None
    if layer is None:
      return _apply(entry, name, label, out, x)
    store = _clt_store(entry, layer)
    try:
      return _apply_clt(entry, store, layer, name, label, out, x)
    finally:
      if layer == entry.dictionary.n_layers - 1:
        _clt_runs.stores.pop(id(entry), None)

  namespace = {
    "__call__": __call__,
    "__module__": base.__module__,
    "__qualname__": base.__qualname__,
  }
  return type(base)(base.__name__, (base,), namespace)


def _splice_nnx(model, entries):
  for entry in entries:
    if entry.reads is not None:
      raise SAEError(
        "splice: reads= is for linen models; in an NNX model a transcoder reads the spliced "
        "module's first input",
        code="sae_invalid_argument",
        field="reads",
        fix="splice the transcoder at the module whose input it reads (the MLP)",
      )
  model = nnx.clone(model)
  modules = [("/".join(str(p) for p in path), sub) for path, sub in nnx.iter_modules(model)]
  infos = [SiteInfo(path, "__call__", 1, type(sub).__name__) for path, sub in modules]
  for entry in entries:
    if isinstance(entry, _CLTEntry):
      if entry.selector is not None:
        found = [m for m, info in zip(modules, infos) if entry.selector.matches(info)]
      else:
        found = []
        for selector in entry.selectors:
          hits = [m for m, info in zip(modules, infos) if selector.matches(info)]
          if len(hits) != 1:
            raise SAEError(
              f"splice: {selector!r} matched {len(hits)} modules; each layer of a cross-layer "
              "transcoder is one module",
              code="sae_shape_mismatch",
              field="n_layers",
              fix="one module path per layer",
            )
          found += hits
      if not found:
        raise unmatched_error(entry.selectors[0], infos, "sae.splice")
      if len(found) != entry.dictionary.n_layers:
        raise SAEError(
          f"splice: the cross-layer transcoder has {entry.dictionary.n_layers} layers but "
          f"{entry.describe()} matched {len(found)} modules ({[p for p, _ in found]})",
          code="sae_shape_mismatch",
          field="n_layers",
          fix="one module (the layer's MLP) per layer, in order",
        )
      for layer, (path, sub) in enumerate(found):
        _splice_nnx_module(sub, path, entry, layer, "clt")
      continue
    found = [m for m, info in zip(modules, infos) if entry.selector.matches(info)]
    if not found:
      raise unmatched_error(entry.selector, infos, "sae.splice")
    for path, sub in found:
      _splice_nnx_module(sub, path, entry, None, "sae")
  return model


def _splice_nnx_module(sub, path: str, entry, layer, child: str):
  if hasattr(sub, child):
    raise SAEError(
      f"splice: the NNX module at {path!r} already has an attribute {child!r} (spliced "
      "there already?)",
      code="sae_invalid_argument",
      field="site",
      fix="splice one dictionary per module",
    )
  sub.__class__ = _nnx_spliced_class(type(sub), entry, path, layer)
  setattr(sub, child, _NNXSites())


def _as_selector(site):
  if isinstance(site, Site):
    return site
  if isinstance(site, str):
    return module_selector(site)
  raise SAEError(
    f"splice: a site is a module path or a jl.module(...) selector, got {type(site).__name__}",
    code="sae_invalid_argument",
    field="site",
    fix='sae.splice(model, "blocks_3/resid_post", d)',
  )


def _clt_entry(site, d, reads, keep_error, stop_error_grad):
  if reads is not None:
    raise SAEError(
      "splice: a cross-layer transcoder reads each layer's MLP input; reads= is not for it",
      code="sae_invalid_argument",
      field="reads",
      fix="drop reads= (splice at the MLP modules, whose inputs the encoders read)",
    )
  sites = list(site) if isinstance(site, tuple) else [site]
  if len(sites) > 1 and len(sites) != d.n_layers:
    raise SAEError(
      f"splice: {len(sites)} sites for a cross-layer transcoder of {d.n_layers} layers",
      code="sae_shape_mismatch",
      field="n_layers",
      fix="one site (each layer's MLP) per layer, in order, or a glob such as 'block_*/mlp'",
    )
  return _CLTEntry(
    tuple(_as_selector(x) for x in sites), d, bool(keep_error), bool(stop_error_grad)
  )


@api_boundary
def splice(
  model,
  site,
  dictionary=None,
  *,
  reads=None,
  keep_error: bool = True,
  stop_error_grad: bool = False,
):
  """The model with a dictionary spliced in at ``site``.

  Args:
    model: a linen module, unbound (the result is too) or bound (the result is bound to
      the same variables), or an NNX module (the result is a spliced copy). A model already
      spliced can be spliced again (at other modules).
    site: the module path (``"blocks_3/mlp"``; globs splice every match) or a
      ``jl.module(...)`` selector; or a mapping ``{site: dictionary}`` for several. For a
      cross-layer transcoder: a list of its layers' modules in order, or one glob whose
      matches are the layers in the order they first run.
    dictionary: an :class:`~jaxlens.sae.SAE` (reads and writes the site's value), a
      :class:`~jaxlens.sae.Transcoder` (reads the module call's first input, or
      ``reads=``, and replaces the module's output) or a
      :class:`~jaxlens.sae.CrossLayerTranscoder` (reads each layer's module input, writes
      each layer's module output).
    reads: the site whose value a transcoder reads (default: the spliced module's input).
    keep_error: add the reconstruction error back (the default: the model's output is
      unchanged to rounding); ``False`` replaces the site by the reconstruction.
    stop_error_grad: no gradient through the error term (SAELens's convention, where the
      error is computed under ``torch.no_grad``); by default the error carries its
      gradient, so the gradient upstream of the splice is the model's own.

  Returns:
    A model of the same class and fields whose runs expose the sites
    ``<site>/sae/acts``, ``<site>/sae/recon`` and ``<site>/sae/error`` (for a cross-layer
    transcoder ``<layer module>/clt/acts|recon|error`` for each layer).

  Raises:
    SAEError: ``sae_model_unsupported`` (not a linen or NNX module), ``sae_invalid_argument``,
      ``sae_shape_mismatch`` (when it runs: the site's width is not the dictionary's; or
      the modules are not one per layer of a cross-layer transcoder).
    SiteError: when it runs, ``unknown_site`` (``site`` matched no module call),
      ``sae_site_not_array``, ``sae_reads_missing``.
  """
  if isinstance(site, Mapping):
    if dictionary is not None:
      raise SAEError(
        "splice: pass either a {site: dictionary} mapping or a site and a dictionary",
        code="sae_invalid_argument",
        field="dictionary",
        fix="sae.splice(model, {site_a: d_a, site_b: d_b})",
      )
    pairs = list(site.items())
  else:
    pairs = [(tuple(site) if isinstance(site, list) else site, dictionary)]
  if not isinstance(model, (nn.Module, nnx.Module)):
    raise SAEError(
      f"splice needs a flax.linen or flax.nnx Module, got {type(model).__name__}",
      code="sae_model_unsupported",
      field="model",
      fix="a linen model (the zoo's, your own, or one converted from torch) or an nnx.Module",
    )
  entries = []
  for s, d in pairs:
    if isinstance(d, CrossLayerTranscoder):
      entries.append(_clt_entry(s, d, reads, keep_error, stop_error_grad))
      continue
    if not isinstance(d, SAE):
      raise SAEError(
        f"splice: expected a jaxlens.sae.SAE, Transcoder or CrossLayerTranscoder at {s!r}, "
        f"got {type(d).__name__}",
        code="sae_invalid_argument",
        field="dictionary",
        fix="sae.load_saelens(path) or sae.SAE.init(...)",
      )
    if reads is not None and not isinstance(d, Transcoder):
      raise SAEError(
        "splice: reads= is for transcoders (an SAE reads the site it writes)",
        code="sae_invalid_argument",
        field="reads",
        fix="drop reads=",
      )
    entries.append(
      _Entry(
        _as_selector(s),
        d,
        None if reads is None else _as_selector(reads),
        bool(keep_error),
        bool(stop_error_grad),
      )
    )
  if isinstance(model, nnx.Module):
    return _splice_nnx(model, entries)
  if model.scope is not None:
    unbound, variables = model.unbind()
    return splice(
      unbound, dict(pairs), reads=reads, keep_error=keep_error, stop_error_grad=stop_error_grad
    ).bind(variables)
  cls = _spliced_class(type(model), tuple(entries))
  fields = {
    f: getattr(model, f)
    for f in model.__dataclass_fields__
    if f not in ("parent", "name") and model.__dataclass_fields__[f].init
  }
  return cls(**fields, name=model.name)
