"""Graph files: a directory of safetensors (the arrays) and JSON (the rest, with the arrays'
SHA-256), written whole or not at all; and the graph JSON circuit-tracer's and Neuronpedia's
graph viewers read."""

from __future__ import annotations

import hashlib
import json
import math
import os
import pathlib

import jax.numpy as jnp
import numpy as np

from jaxlens.circuits._attribute import Graph
from jaxlens.circuits._errors import CircuitError
from jaxlens.circuits._ondisk import open_safetensors, sha256_file
from jaxlens.circuits._prune import entries, is_sparse, prune
from jaxlens.sae import CrossLayerTranscoder, Transcoder
from jaxlens.internal import path_argument, write_directory

__all__ = [
  "load_circuit_tracer",
  "load_graph",
  "save_graph",
  "save_transcoders",
  "to_neuronpedia_json",
]

FORMAT = "jaxlens.circuits.graph"
VERSION = 2  # 2: a sparse adjacency (CSR: adjacency_data, _indices, _indptr)
_ARRAYS = (
  "adjacency",
  "input_tokens",
  "active_features",
  "activation_values",
  "selected_features",
  "logit_tokens",
  "logit_probabilities",
)


def save_graph(graph: Graph, path, *, overwrite: bool = False) -> pathlib.Path:
  """Writes ``graph`` to the directory ``path``: ``graph.safetensors`` (its arrays) and
  ``graph.json`` (format, version, ``n_layers`` and the SHA-256 of the safetensors file). The
  directory is written beside the target and renamed into place, so a failed save leaves
  nothing behind. No pickle.

  Raises:
    CircuitError: ``circuit_file_exists`` (``path`` exists and is not a graph, or is one and
      ``overwrite`` is False), ``circuit_save_failed`` (the file system refused).
  """
  from safetensors.numpy import save

  path = pathlib.Path(path)
  if path.exists():
    if not (path / "graph.json").is_file() or not overwrite:
      raise CircuitError(
        f"{path} exists" + ("" if (path / "graph.json").is_file() else " and is not a graph"),
        code="circuit_file_exists",
        received=str(path),
        fix="a new path, or overwrite=True over a saved graph",
      )
  sparse = is_sparse(graph.adjacency)
  tensors = {
    name: np.ascontiguousarray(getattr(graph, name))
    for name in _ARRAYS
    if not (sparse and name == "adjacency")
  }
  if sparse:  # the kept entries, CSR
    csr = graph.adjacency.tocsr()
    tensors["adjacency_data"] = np.ascontiguousarray(csr.data)
    tensors["adjacency_indices"] = np.ascontiguousarray(csr.indices.astype(np.int64))
    tensors["adjacency_indptr"] = np.ascontiguousarray(csr.indptr.astype(np.int64))
  data = save(tensors)
  meta = {
    "format": FORMAT,
    # version 2 only for a sparse adjacency, so that dense files stay readable by version 1
    "version": VERSION if sparse else 1,
    "n_layers": int(graph.n_layers),
    "sha256": hashlib.sha256(data).hexdigest(),
  }
  files = {"graph.safetensors": data, "graph.json": json.dumps(meta, indent=1).encode()}
  return _write_directory(path, files, "graph")


def _corrupt(path, why) -> CircuitError:
  return CircuitError(
    f"{path} is not an intact graph: {why}",
    code="circuit_file_corrupt",
    received=str(path),
    fix="save the graph again (circuits.save_graph)",
  )


@path_argument(CircuitError)
def load_graph(path, *, mmap: bool = False) -> Graph:
  """Reads a graph :func:`save_graph` (or ``attribute(..., graph_path=...)``) wrote.

  ``mmap=True``: a dense adjacency is not read into memory but opened as a read-only
  ``numpy.memmap`` of the file (the file is hashed a block at a time), so a graph larger than
  memory opens; :func:`prune` and :func:`graph_scores` work on it in blocks of rows.

  Raises:
    CircuitError: ``circuit_file_missing`` (no ``graph.json`` or ``graph.safetensors``),
      ``circuit_file_corrupt`` (a truncated or edited file: the SHA-256 or the JSON does not
      match; arrays of the wrong shapes), ``circuit_file_version`` (a later format).
  """
  from safetensors.numpy import load

  path = pathlib.Path(path)
  files = path / "graph.json", path / "graph.safetensors"
  for f in files:
    if not f.is_file():
      raise CircuitError(
        f"no {f.name} in {path}",
        code="circuit_file_missing",
        received=str(path),
        fix="the directory circuits.save_graph wrote",
      )
  try:
    meta = json.loads(files[0].read_text())
  except (ValueError, UnicodeDecodeError) as error:
    raise _corrupt(path, f"graph.json is not JSON ({error})") from error
  if not isinstance(meta, dict) or meta.get("format") != FORMAT:
    raise _corrupt(path, "graph.json does not describe a jaxlens graph")
  if not isinstance(meta.get("version"), int) or meta["version"] > VERSION:
    raise CircuitError(
      f"{path} has format version {meta.get('version')!r}; this jaxlens reads up to {VERSION}",
      code="circuit_file_version",
      received=repr(meta.get("version")),
      fix="a newer jaxlens",
    )
  if mmap:
    digest = sha256_file(files[1])
  else:
    data = files[1].read_bytes()
    digest = hashlib.sha256(data).hexdigest()
  if digest != meta.get("sha256"):
    raise _corrupt(path, "graph.safetensors does not match the SHA-256 graph.json holds")
  n_layers = meta.get("n_layers")
  if isinstance(n_layers, bool) or not isinstance(n_layers, int) or n_layers <= 0:
    raise _corrupt(path, f"n_layers {n_layers!r} is not a positive int")
  if mmap:
    arrays, mapped = open_safetensors(files[1], lambda why: _corrupt(path, why))
    if mapped is not None:
      arrays["adjacency"] = mapped
  else:
    try:
      arrays = load(data)
    except Exception as error:  # safetensors raises its own SafetensorError
      raise _corrupt(path, f"graph.safetensors does not read ({error})") from error
  csr = ("adjacency_data", "adjacency_indices", "adjacency_indptr")
  sparse = "adjacency" not in arrays and all(name in arrays for name in csr)
  missing = [
    name for name in _ARRAYS if name not in arrays and not (sparse and name == "adjacency")
  ]
  if missing:
    raise _corrupt(path, f"graph.safetensors lacks {missing}")
  fields = {name: arrays[name] for name in _ARRAYS if name != "adjacency"}
  n = len(fields["selected_features"]) + (n_layers + 1) * len(fields["input_tokens"])
  n += len(fields["logit_tokens"])
  if sparse:
    from scipy import sparse as sp

    data, indices, indptr = (arrays[name] for name in csr)
    if (
      indptr.shape != (n + 1,)
      or indices.shape != data.shape
      or indptr[0] != 0
      or indptr[-1] != len(data)
      or np.any(np.diff(indptr) < 0)
      or (len(indices) and (indices.min() < 0 or indices.max() >= n))
    ):
      raise _corrupt(path, f"the sparse adjacency's arrays do not make an ({n}, {n}) matrix")
    adjacency = sp.csr_array((data, indices, indptr), shape=(n, n))
  else:
    adjacency = arrays["adjacency"]
  graph = Graph(adjacency=adjacency, **fields, n_layers=n_layers)
  if graph.adjacency.shape != (n, n):
    raise _corrupt(path, f"the adjacency is {graph.adjacency.shape}, its nodes make {n}")
  return graph


def to_neuronpedia_json(
  graph: Graph,
  path=None,
  *,
  slug: str = "jaxlens-graph",
  scan: str = "jaxlens",
  token_strings=None,
  prompt: str = "",
  node_threshold: float = 0.8,
  edge_threshold: float = 0.98,
  d_transcoder: int | None = None,
) -> dict:
  """The graph JSON that circuit-tracer's local graph server and Neuronpedia read (the
  ``Model`` of circuit-tracer's ``frontend/graph_models.py``: ``metadata``, ``qParams``,
  ``nodes`` and ``links`` of the pruned graph), written to ``path`` when given.

  Args:
    graph: the graph.
    path: a ``.json`` file to write (written whole or not at all), or None.
    slug, scan, prompt: the metadata's; ``scan`` names the transcoders.
    token_strings: ``id -> str`` for the prompt and logit tokens (default ``str(id)``).
    node_threshold, edge_threshold: pruning (:func:`~jaxlens.circuits.prune`).
    d_transcoder: the features per layer, for Neuronpedia's feature numbering
      (``feature + 10**ceil(log10(d_transcoder)) * layer``); None numbers by feature alone.
  """
  text = token_strings or str
  mask, edge_mask, cumulative = prune(graph, node_threshold, edge_threshold)
  sl = graph.node_slices()
  offset = 10 ** math.ceil(math.log10(d_transcoder)) if d_transcoder else 0
  nodes: dict[int, dict] = {}
  for i in np.flatnonzero(mask):
    i = int(i)
    base = {"token_prob": 0.0, "is_target_logit": False, "run_idx": 0, "reverse_ctx_idx": 0}
    base["clerp"] = ""
    if i < sl["features"].stop:
      layer, pos, feat = (int(v) for v in graph.active_features[graph.selected_features[i]])
      node = {
        "node_id": f"{layer}_{feat}_{pos}",
        "feature": feat + offset * layer,
        "layer": str(layer),
        "ctx_idx": pos,
        "feature_type": "cross layer transcoder",
        "jsNodeId": f"{layer}_{feat}-0",
        "activation": float(graph.activation_values[graph.selected_features[i]]),
      }
    elif i < sl["errors"].stop:
      layer, pos = divmod(i - sl["errors"].start, graph.n_pos)
      node = {
        "node_id": f"0_{layer}_{pos}",
        "feature": -1,
        "layer": str(layer),
        "ctx_idx": pos,
        "feature_type": "mlp reconstruction error",
        "jsNodeId": f"{layer}_{pos}-0",
        "activation": None,
      }
    elif i < sl["tokens"].stop:
      pos = i - sl["tokens"].start
      vocab = int(graph.input_tokens[pos])
      node = {
        "node_id": f"E_{vocab}_{pos}",
        "feature": pos,
        "layer": "E",
        "ctx_idx": pos,
        "feature_type": "embedding",
        "jsNodeId": f"E_{vocab}-{pos}",
        "activation": None,
      }
    else:
      k = i - sl["logits"].start
      vocab, p = int(graph.logit_tokens[k]), float(graph.logit_probabilities[k])
      layer = str(graph.n_layers + 1)
      pos = graph.n_pos - 1
      node = {
        "node_id": f"{layer}_{vocab}_{pos}",
        "feature": vocab,
        "layer": layer,
        "ctx_idx": pos,
        "feature_type": "logit",
        "jsNodeId": f"L_{vocab}-{pos}",
        "activation": None,
      }
      base.update(token_prob=p, is_target_logit=k == 0)
      base["clerp"] = f'Output "{text(vocab)}" (p={p:.3f})'
    node["influence"] = None if i >= sl["logits"].start else float(cumulative[i])
    nodes[i] = {**base, **node}
  dst, src = edge_mask.nonzero() if is_sparse(edge_mask) else np.nonzero(edge_mask)
  weights = entries(graph.adjacency, dst, src)
  links = [
    {
      "source": nodes[int(s)]["node_id"],
      "target": nodes[int(d)]["node_id"],
      "weight": float(w),
    }
    for d, s, w in zip(dst, src, weights)
    if int(s) in nodes and int(d) in nodes
  ]
  connected = {link["source"] for link in links} | {link["target"] for link in links}
  used = [
    n
    for n in nodes.values()
    if n["node_id"] in connected or n["feature_type"] in ("embedding", "logit")
  ]
  out = {
    "metadata": {
      "slug": slug,
      "scan": scan,
      "transcoder_list": [],
      "prompt_tokens": [text(int(t)) for t in graph.input_tokens],
      "prompt": prompt,
      "node_threshold": node_threshold,
    },
    "qParams": {
      "pinnedIds": [],
      "supernodes": [],
      "linkType": "both",
      "clickedId": "",
      "sg_pos": "",
    },
    "nodes": used,
    "links": links,
  }
  if path is not None:
    path = pathlib.Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
      tmp.write_text(json.dumps(out))
      os.replace(tmp, path)
    except OSError as error:
      tmp.unlink(missing_ok=True)
      raise CircuitError(
        f"writing {path} failed: {error}",
        code="circuit_save_failed",
        received=str(path),
        fix="a writable path",
      ) from error
  return out


def _tensors(path):
  from safetensors.numpy import load_file

  try:
    return load_file(str(path))
  except FileNotFoundError as error:
    raise CircuitError(
      f"no transcoder file at {path}",
      code="circuit_file_missing",
      received=str(path),
      fix="the .safetensors file (or CLT directory) circuit-tracer's to_safetensors wrote",
    ) from error
  except Exception as error:  # safetensors raises its own SafetensorError
    raise CircuitError(
      f"{path} is not a readable safetensors file ({error})",
      code="circuit_file_corrupt",
      received=str(path),
      fix="the file circuit-tracer's to_safetensors wrote, intact",
    ) from error


def _need(tensors, key, path):
  if key not in tensors:
    raise CircuitError(
      f"{path} has no tensor {key!r} (it holds {sorted(tensors)})",
      code="circuit_file_corrupt",
      received=str(path),
      fix="a transcoder file in circuit-tracer's layout",
    )
  return tensors[key]


def _shape_error(path, what, got, expected):
  return CircuitError(
    f"{path}: {what} has shape {tuple(got)}, expected {tuple(expected)}",
    code="circuit_file_corrupt",
    received=str(tuple(got)),
    expected=str(tuple(expected)),
    fix="a transcoder file in circuit-tracer's layout",
  )


def _check_threshold(threshold, path):
  # circuit-tracer's JumpReLU is x * (x > t); jaxlens's relu(x) * (x > t): equal for t >= 0.
  if threshold is not None and np.any(np.asarray(threshold, np.float64) < 0):
    raise CircuitError(
      f"{path} has negative JumpReLU thresholds, which jaxlens's JumpReLU (relu(x) * (x > t)) "
      "does not reproduce",
      code="circuit_file_corrupt",
      received=float(np.min(threshold)),
      fix="thresholds >= 0 (as trained JumpReLU transcoders have)",
    )


TRANSCODERS = "jaxlens.circuits.transcoders"


def save_transcoders(transcoders, path, *, overwrite: bool = False) -> pathlib.Path:
  """Writes per-layer transcoders to the directory ``path``: ``layer_{i}.safetensors`` per
  layer, in circuit-tracer's format (``SingleLayerTranscoder``'s tensors: ``W_enc``
  ``(d_transcoder, d_model)``, ``W_dec``, ``b_enc``, ``b_dec``, ``W_skip``,
  ``activation_function.threshold``), and ``transcoders.json`` (the layer count and each
  layer's file, ``null`` for a layer given as ``None``). Written beside the target and
  renamed into place, as :func:`save_graph` does. :func:`load_circuit_tracer` reads it back.

  Args:
    transcoders: one ReLU or JumpReLU :class:`jaxlens.sae.Transcoder` per layer, or ``None``.
    path: the directory.
    overwrite: replace a directory this function wrote.

  Returns:
    ``path``.

  Raises:
    CircuitError: ``invalid_argument`` (not a sequence of transcoders and ``None``, or a
      transcoder whose activation circuit-tracer's format cannot hold), ``circuit_file_exists``,
      ``circuit_save_failed``.

  Example:
    >>> import jax, tempfile
    >>> from jaxlens import circuits, sae
    >>> t = sae.Transcoder.init(jax.random.key(0), d_in=8, d_sae=16, skip=True)
    >>> path = circuits.save_transcoders([t, None], tempfile.mkdtemp() + "/tc")
    >>> [type(x).__name__ for x in circuits.load_circuit_tracer(path)]
    ['Transcoder', 'NoneType']
  """
  from safetensors.numpy import save

  if (
    isinstance(transcoders, (str, bytes, Transcoder))
    or not hasattr(transcoders, "__len__")
    or not all(t is None or type(t) is Transcoder for t in transcoders)
    or all(t is None for t in transcoders)
  ):
    raise CircuitError(
      "save_transcoders takes a sequence of jaxlens.sae.Transcoder (None for a layer without "
      f"one, at least one given), got {type(transcoders).__name__}",
      code="invalid_argument",
      received=type(transcoders).__name__,
      fix="save_transcoders([transcoder_0, transcoder_1, ...], path)",
    )
  files: dict = {}
  for i, t in enumerate(transcoders):
    if t is None:
      continue
    if t.activation not in ("relu", "jumprelu") or t.normalize_activations != "none":
      raise CircuitError(
        f"transcoder {i} has activation {t.activation!r} and normalize_activations="
        f"{t.normalize_activations!r}; circuit-tracer's files hold ReLU and JumpReLU "
        "transcoders without a run-time normalisation",
        code="invalid_argument",
        received=(t.activation, t.normalize_activations),
        fix="Trained.inference() of a BatchTopK transcoder (JumpReLU), or a ReLU one",
      )
    tensors = {
      "W_enc": np.asarray(t.W_enc).T,
      "W_dec": np.asarray(t.W_dec),
      "b_enc": np.asarray(t.b_enc),
      "b_dec": np.asarray(t.b_dec),
    }
    if t.W_skip is not None:
      tensors["W_skip"] = np.asarray(t.W_skip)
    if t.activation == "jumprelu":
      tensors["activation_function.threshold"] = np.asarray(t.threshold)
    files[f"layer_{i}.safetensors"] = save({k: np.ascontiguousarray(v) for k, v in tensors.items()})
  meta = {
    "format": TRANSCODERS,
    "version": VERSION,
    "n_layers": len(transcoders),
    "files": [
      f"layer_{i}.safetensors" if t is not None else None for i, t in enumerate(transcoders)
    ],
  }
  path = pathlib.Path(path)
  index = path / "transcoders.json"
  if path.exists() and (not index.is_file() or not overwrite):
    raise CircuitError(
      f"{path} exists" + ("" if index.is_file() else " and is not a set of transcoders"),
      code="circuit_file_exists",
      received=str(path),
      fix="a new path, or overwrite=True over saved transcoders",
    )
  files["transcoders.json"] = json.dumps(meta, indent=1).encode()
  return _write_directory(path, files, "transcoders")


def _load_transcoder_set(path, dtype):
  """The list :func:`save_transcoders` wrote to ``path`` (``None`` where a layer has none)."""
  try:
    meta = json.loads((path / "transcoders.json").read_text())
    files = meta["files"]
    ok = meta.get("format") == TRANSCODERS and isinstance(files, list)
    ok = ok and len(files) == meta["n_layers"] and any(f is not None for f in files)
    ok = ok and all(f is None or (isinstance(f, str) and "/" not in f) for f in files)
  except (OSError, ValueError, KeyError, TypeError) as error:
    raise CircuitError(
      f"{path / 'transcoders.json'} is not readable: {error}",
      code="circuit_file_corrupt",
      received=str(path),
      fix="save the transcoders again (circuits.save_transcoders)",
    ) from None
  if not ok:
    raise CircuitError(
      f"{path / 'transcoders.json'} is not an index of per-layer transcoders",
      code="circuit_file_corrupt",
      received=str(path),
      fix="save the transcoders again (circuits.save_transcoders)",
    )
  if meta.get("version", VERSION) > VERSION:
    raise CircuitError(
      f"{path} is format version {meta['version']}; this jaxlens reads up to {VERSION}",
      code="circuit_file_version",
      received=meta["version"],
      expected=VERSION,
      fix="a newer jaxlens",
    )
  return [None if f is None else load_circuit_tracer(path / f, dtype) for f in files]


@path_argument(CircuitError, chunks=True)  # a list of per-layer files is a path too
def load_circuit_tracer(path, dtype=None):
  """Reads circuit-tracer's transcoder files: a per-layer transcoder's ``.safetensors`` file
  (``W_enc`` ``(d_transcoder, d_model)``, ``W_dec``, ``b_enc``, ``b_dec``, optional ``W_skip``
  and ``activation_function.threshold``), a list of them (one per layer), a directory
  :func:`save_transcoders` wrote (``transcoders.json`` and those files), or a cross-layer
  transcoder's directory (``W_enc_{i}.safetensors`` with ``W_enc_{i}``, ``b_enc_{i}``,
  ``b_dec_{i}``, optional ``threshold_{i}``, and ``W_dec_{i}.safetensors`` with ``W_dec_{i}``
  ``(d_transcoder, n_layers - i, d_model)``).

  Returns:
    A :class:`jaxlens.sae.Transcoder` (ReLU, or JumpReLU with a threshold), a list of them
    (``None`` for a layer saved without one), or a :class:`jaxlens.sae.CrossLayerTranscoder`.

  Raises:
    CircuitError: ``circuit_file_missing``, ``circuit_file_corrupt`` (unreadable, a tensor
      missing or of the wrong shape).
  """

  def cast(a):
    return jnp.asarray(a if dtype is None else np.asarray(a).astype(dtype))

  if isinstance(path, (list, tuple)):
    return [load_circuit_tracer(p, dtype) for p in path]
  path = pathlib.Path(path)
  if path.is_dir() and (path / "transcoders.json").is_file():
    return _load_transcoder_set(path, dtype)
  if path.is_dir():
    n = 0
    while (path / f"W_enc_{n}.safetensors").is_file():
      n += 1
    if n == 0:
      raise CircuitError(
        f"{path} holds no W_enc_0.safetensors",
        code="circuit_file_missing",
        received=str(path),
        fix="the directory circuit-tracer's CrossLayerTranscoder.to_safetensors wrote",
      )
    enc, b_enc, b_dec, thr, dec = [], [], [], [], []
    for i in range(n):
      t = _tensors(path / f"W_enc_{i}.safetensors")
      enc.append(_need(t, f"W_enc_{i}", path).T)
      b_enc.append(_need(t, f"b_enc_{i}", path))
      b_dec.append(_need(t, f"b_dec_{i}", path))
      if f"threshold_{i}" in t:
        _check_threshold(t[f"threshold_{i}"], path)
        thr.append(t[f"threshold_{i}"])
      w = _need(_tensors(path / f"W_dec_{i}.safetensors"), f"W_dec_{i}", path)
      expected = (enc[0].shape[1], n - i, enc[0].shape[0])
      if w.shape != expected:
        raise _shape_error(path, f"W_dec_{i}", w.shape, expected)
      dec.append(np.transpose(w, (1, 0, 2)))
    for i, e in enumerate(enc):
      if e.shape != enc[0].shape:
        raise _shape_error(path, f"W_enc_{i}", e.T.shape, enc[0].T.shape)
    return CrossLayerTranscoder(
      W_enc=cast(np.stack(enc)),
      b_enc=cast(np.stack(b_enc)),
      W_dec=tuple(cast(w) for w in dec),
      b_dec=cast(np.stack(b_dec)),
      threshold=cast(np.stack(thr)) if len(thr) == n else None,
      activation="jumprelu" if len(thr) == n else "relu",
    )
  t = _tensors(path)
  w_enc = _need(t, "W_enc", path)
  d_tc, d_model = w_enc.shape
  w_dec = _need(t, "W_dec", path)
  if w_dec.shape[0] != d_tc:
    raise _shape_error(path, "W_dec", w_dec.shape, (d_tc, w_dec.shape[-1]))
  threshold = t.get("activation_function.threshold")
  _check_threshold(threshold, path)
  return Transcoder(
    W_enc=cast(w_enc.T),
    b_enc=cast(_need(t, "b_enc", path)),
    W_dec=cast(w_dec),
    b_dec=cast(_need(t, "b_dec", path)),
    threshold=None if threshold is None else cast(np.reshape(threshold, (d_tc,))),
    W_skip=None if t.get("W_skip") is None else cast(t["W_skip"]),
    activation="relu" if threshold is None else "jumprelu",
  )


def _write_directory(path: pathlib.Path, files: dict[str, bytes], what: str) -> pathlib.Path:
  """:func:`jaxlens._src.paths.write_directory`, its OS errors as this module's error.

  Raises:
    CircuitError: ``circuit_save_failed`` on any OS error, naming ``what`` was being saved.
  """
  try:
    return write_directory(path, files)
  except OSError as error:
    raise CircuitError(
      f"saving the {what} to {path} failed: {error}",
      code="circuit_save_failed",
      received=str(path),
      fix=f"a writable path with room for the {what}",
    ) from error
