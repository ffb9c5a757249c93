"""Graph files: a directory of safetensors (the arrays) and JSON (the rest, with the arrays'
SHA-256), written whole or not at all; and the graph JSON circuit-tracer's and Neuronpedia's
graph viewers read."""

from __future__ import annotations

import hashlib
import json
import math
import os
import pathlib
import shutil
import tempfile

import jax.numpy as jnp
import numpy as np

from jaxlens.circuits._attribute import Graph
from jaxlens.circuits._errors import CircuitError
from jaxlens.circuits._prune import prune
from jaxlens.sae import CrossLayerTranscoder, Transcoder
from jaxlens.internal import path_argument

__all__ = ["load_circuit_tracer", "load_graph", "save_graph", "to_neuronpedia_json"]

FORMAT = "jaxlens.circuits.graph"
VERSION = 1
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
  tensors = {name: np.ascontiguousarray(getattr(graph, name)) for name in _ARRAYS}
  data = save(tensors)
  meta = {
    "format": FORMAT,
    "version": VERSION,
    "n_layers": int(graph.n_layers),
    "sha256": hashlib.sha256(data).hexdigest(),
  }
  try:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    try:
      (tmp / "graph.safetensors").write_bytes(data)
      (tmp / "graph.json").write_text(json.dumps(meta, indent=1))
      if path.exists():
        old = path.with_name(f".{path.name}.old")
        os.replace(path, old)
        os.replace(tmp, path)
        shutil.rmtree(old)
      else:
        os.replace(tmp, path)
    finally:
      if tmp.exists():
        shutil.rmtree(tmp)
  except OSError as error:
    raise CircuitError(
      f"saving the graph to {path} failed: {error}",
      code="circuit_save_failed",
      received=str(path),
      fix="a writable path with room for the graph",
    ) from error
  return path


def _corrupt(path, why) -> CircuitError:
  return CircuitError(
    f"{path} is not an intact graph: {why}",
    code="circuit_file_corrupt",
    received=str(path),
    fix="save the graph again (circuits.save_graph)",
  )


@path_argument(CircuitError)
def load_graph(path) -> Graph:
  """Reads a graph :func:`save_graph` wrote.

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
  data = files[1].read_bytes()
  if hashlib.sha256(data).hexdigest() != meta.get("sha256"):
    raise _corrupt(path, "graph.safetensors does not match the SHA-256 graph.json holds")
  n_layers = meta.get("n_layers")
  if isinstance(n_layers, bool) or not isinstance(n_layers, int) or n_layers <= 0:
    raise _corrupt(path, f"n_layers {n_layers!r} is not a positive int")
  try:
    arrays = load(data)
  except Exception as error:  # safetensors raises its own SafetensorError
    raise _corrupt(path, f"graph.safetensors does not read ({error})") from error
  missing = [name for name in _ARRAYS if name not in arrays]
  if missing:
    raise _corrupt(path, f"graph.safetensors lacks {missing}")
  graph = Graph(**{name: arrays[name] for name in _ARRAYS}, n_layers=n_layers)
  n = graph.n_features + graph.n_errors + graph.n_pos + graph.n_logits
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
  dst, src = np.nonzero(edge_mask)
  links = [
    {
      "source": nodes[int(s)]["node_id"],
      "target": nodes[int(d)]["node_id"],
      "weight": float(graph.adjacency[d, s]),
    }
    for d, s in zip(dst, src)
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


@path_argument(CircuitError)
def load_circuit_tracer(path, dtype=None):
  """Reads circuit-tracer's transcoder files: a per-layer transcoder's ``.safetensors`` file
  (``W_enc`` ``(d_transcoder, d_model)``, ``W_dec``, ``b_enc``, ``b_dec``, optional ``W_skip``
  and ``activation_function.threshold``), a list of them (one per layer), or a cross-layer
  transcoder's directory (``W_enc_{i}.safetensors`` with ``W_enc_{i}``, ``b_enc_{i}``,
  ``b_dec_{i}``, optional ``threshold_{i}``, and ``W_dec_{i}.safetensors`` with ``W_dec_{i}``
  ``(d_transcoder, n_layers - i, d_model)``).

  Returns:
    A :class:`jaxlens.sae.Transcoder` (ReLU, or JumpReLU with a threshold), a list of them,
    or a :class:`jaxlens.sae.CrossLayerTranscoder`.

  Raises:
    CircuitError: ``circuit_file_missing``, ``circuit_file_corrupt`` (unreadable, a tensor
      missing or of the wrong shape).
  """

  def cast(a):
    return jnp.asarray(a if dtype is None else np.asarray(a).astype(dtype))

  if isinstance(path, (list, tuple)):
    return [load_circuit_tracer(p, dtype) for p in path]
  path = pathlib.Path(path)
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
