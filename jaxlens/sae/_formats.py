"""Dictionary files other libraries write: EleutherAI ``sparsify`` (both ways),
``dictionary_learning``, Llama Scope, connor-rob's hook_z SAEs, and circuit-tracer's
transcoders (read by :mod:`jaxlens.circuits`).

Each reader computes what the writing library computes on the same file (checked against the
library itself by ``benchmarks/sae_formats_agreement.py``), and records where the dictionary
was trained as ``metadata["hook_name"]`` (the writer's name) and ``metadata["site"]`` (the
zoo's site of that point, where one exists: see :func:`zoo_site`).
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from jaxlens.internal import json_loads, require
from jaxlens.sae._dictionaries import SAE, CrossLayerTranscoder, SAEError, Transcoder
from jaxlens.sae._files import _check_replaceable, _dtype, _read_tensors, _require_finite
from jaxlens.sae._files import _write_directory
from jaxlens.sae._files import _safetensors
from jaxlens.internal import path_argument

__all__ = [
  "zoo_site",
  "load_sparsify",
  "save_sparsify",
  "load_dictionary_learning",
  "load_llama_scope",
  "save_llama_scope",
  "save_gemma_scope",
  "load_gemma_scope_clt",
  "load_hook_z",
  "load_circuit_tracer",
]

# TransformerLens hook names (SAELens's ``hook_name``) -> the zoo's site names.
_TL_HOOKS = {
  "hook_resid_pre": "resid_pre",
  "hook_resid_mid": "resid_mid",
  "hook_resid_post": "resid_post",
  "hook_attn_out": "attn_out",
  "hook_mlp_out": "mlp_out",
  "hook_mlp_in": "ln_2",  # the MLP's input: the second norm's output
  "ln2.hook_normalized": "ln_2",
  "ln1.hook_normalized": "ln_1",
  "attn.hook_z": "attn/z",
  "attn.hook_q": "attn/q",
  "attn.hook_k": "attn/k",
  "attn.hook_v": "attn/v",
  "attn.hook_pattern": "attn/pattern",
  "mlp.hook_pre": "mlp/pre",
  "mlp.hook_post": "mlp/post",
}


def zoo_site(hook_name) -> str | None:
  """The zoo's site for a TransformerLens hook name or a Hugging Face module path.

  ``blocks.5.attn.hook_z`` (TransformerLens, as SAELens and connor-rob name sites) is
  ``blocks_5/attn/z``, the per-head ``(batch, seq, heads, head_dim)`` values a hook_z SAE
  reads (its ``reshape_activations="hook_z"`` flattens the heads); ``blocks.5.hook_mlp_in``
  is ``blocks_5/ln_2`` (the MLP's input). ``layers.5`` / ``model.layers.5`` (a Hugging Face
  decoder layer's output, as sparsify names its hookpoints) is ``blocks_5/resid_post``,
  ``layers.5.mlp`` its MLP's output ``blocks_5/mlp_out``. None where there is no such site.

  Example:
    >>> from jaxlens import sae
    >>> sae.zoo_site("blocks.5.attn.hook_z"), sae.zoo_site("layers.3.mlp")
    ('blocks_5/attn/z', 'blocks_3/mlp_out')
  """
  name = str(hook_name)
  if name in ("hook_embed", "embed_tokens", "model.embed_tokens"):
    return "embed"
  match = re.fullmatch(r"blocks\.(\d+)\.(.+)", name)
  if match and match.group(2) in _TL_HOOKS:
    return f"blocks_{match.group(1)}/{_TL_HOOKS[match.group(2)]}"
  match = re.fullmatch(r"(?:model\.|gpt_neox\.|transformer\.)?(?:layers|h)[._](\d+)(.*)", name)
  if match:
    rest = {
      "": "resid_post",
      ".mlp": "mlp_out",
      "_mlp": "mlp_out",
      ".self_attn": "attn_out",
      ".attn": "attn_out",
    }.get(match.group(2))
    return None if rest is None else f"blocks_{match.group(1)}/{rest}"
  return None


def _input_site(hookpoint: str) -> str | None:
  """The zoo site of a Hugging Face module's input (what a sparsify transcoder reads)."""
  out = zoo_site(hookpoint)
  if out is None:
    return None
  block, _, rest = out.partition("/")
  return {"resid_post": f"{block}/resid_pre", "mlp_out": f"{block}/ln_2"}.get(rest)


def _meta(**fields) -> str:
  return json.dumps({k: v for k, v in fields.items() if v is not None}, sort_keys=True)


def _read_json(path: Path, what: str) -> dict:
  try:
    value = json_loads(path.read_text())
  except (OSError, ValueError, UnicodeDecodeError) as error:
    raise SAEError(
      f"{path} is not readable JSON: {error}",
      code="sae_config_invalid",
      field=path.name,
      fix=f"the {what} its library wrote",
    ) from error
  if not isinstance(value, dict):
    raise SAEError(
      f"{path} holds a {type(value).__name__}, not an object",
      code="sae_config_invalid",
      field=path.name,
      fix=f"the {what} its library wrote",
    )
  return value


def _target(dtype):
  """A dtype given by name (``"bfloat16"``) or as a dtype (``jnp.bfloat16``)."""
  return np.dtype(_dtype(dtype) if isinstance(dtype, str) else jnp.dtype(dtype))


def _missing(path: Path, field: str, fix: str) -> SAEError:
  return SAEError(f"no file {path}", code="sae_file_missing", field=field, fix=fix)


def _positive_int(cfg: dict, name: str, path: Path, default=...):
  value = cfg.get(name, default)
  if value is ...:
    raise SAEError(
      f"{path} has no {name!r}", code="sae_config_invalid", field=name, fix=f'"{name}": 32'
    )
  if isinstance(value, bool) or not isinstance(value, int) or value < 0:
    raise SAEError(
      f"{path}: {name}={value!r} must be a non-negative integer",
      code="sae_config_invalid",
      field=name,
      fix=f'"{name}": 32',
    )
  return value


def _flag(cfg: dict, name: str, path: Path, default: bool = False) -> bool:
  value = cfg.get(name, default)
  if not isinstance(value, bool):
    raise SAEError(
      f"{path}: {name}={value!r} must be true or false",
      code="sae_config_invalid",
      field=name,
      fix=f'"{name}": false',
    )
  return value


def _take(tensors: dict, name: str, shape: tuple, path: Path, fix: str):
  """The tensor ``name``, checked for its shape and finiteness (a typed error naming it)."""
  if name not in tensors:
    raise SAEError(
      f"{path} has no tensor {name!r} (it holds {sorted(tensors)})",
      code="sae_weights_invalid",
      field=name,
      fix=fix,
    )
  value = tensors[name]
  if tuple(np.shape(value)) != tuple(shape):
    raise SAEError(
      f"{path}: {name} has shape {tuple(np.shape(value))}, expected {tuple(shape)}",
      code="sae_weights_invalid",
      field=name,
      expected=str(tuple(shape)),
      received=str(tuple(np.shape(value))),
      fix=fix,
    )
  _require_finite(path, name, value)
  return value


def _safetensors_bytes(tensors: dict, dtype) -> bytes:
  """A safetensors file of numpy arrays (bfloat16 through safetensors' flax writer)."""
  _safetensors()
  if np.dtype(dtype) == jnp.bfloat16:
    from safetensors.flax import save as save_jax

    return save_jax({k: jnp.asarray(v) for k, v in tensors.items()})
  from safetensors.numpy import save

  return save({k: np.ascontiguousarray(v) for k, v in tensors.items()})


def _write_dir(root: Path, marker: str, files: dict, what: str) -> Path:
  """Writes ``files`` (relative path -> bytes) as the directory ``root``, whole or not at all:
  into a temporary sibling renamed into place. An existing ``root`` is replaced only as
  ``_check_replaceable`` allows."""
  _check_replaceable(root, marker, {name.split("/")[0] for name in files}, what)
  return _write_directory(root, files)


def _unsupported(writer: str, problems: list, fix: str) -> None:
  if problems:
    raise SAEError(
      f"{writer} has no dictionary with {problems[0][1]}",
      code="sae_architecture_unsupported",
      field=problems[0][0],
      fix=fix,
    )


def _b_dec_folded(sae):
  """``b_enc`` of the same function without subtracting ``b_dec`` from the input first."""
  if not sae.apply_b_dec_to_input:
    return np.asarray(sae.b_enc)
  folded = np.asarray(sae.b_enc, np.float64) - np.asarray(sae.b_dec, np.float64) @ np.asarray(
    sae.W_enc, np.float64
  )
  return folded.astype(np.dtype(sae.dtype))


# -- EleutherAI sparsify ----------------------------------------------------------------------

SPARSIFY_CFG = "cfg.json"
SPARSIFY_WEIGHTS = "sae.safetensors"


@path_argument(SAEError)
def load_sparsify(path, *, dtype=None):
  """Reads a sparsify (``eai-sparsify``) sparse coder: the directory ``SparseCoder.save_to_disk``
  (and its trainer, one per hookpoint) writes, ``cfg.json`` and ``sae.safetensors``.

  sparsify's forward, term for term: ``relu(x' @ encoder.weight.T + encoder.bias)``, its ``k``
  largest per row, ``@ W_dec + b_dec``, plus ``x @ W_skip.T`` with a skip connection; ``x'`` is
  ``x - b_dec`` for an autoencoder and ``x`` for a transcoder (``"transcode": true``).

  Args:
    path: one hookpoint's directory (``.../layers.5``).
    dtype: the dtype to load in (default: the file's, as sparsify loads it).

  Returns:
    A TopK :class:`SAE` (``apply_b_dec_to_input=True``), or a :class:`Transcoder` for a
    transcoder or an autoencoder with a skip connection (its ``b_dec`` folded into ``b_enc``:
    ``b_enc - b_dec @ W_enc``). ``metadata["hook_name"]`` is the directory's name (sparsify's
    hookpoint) and ``metadata["site"]`` the zoo site it reads (a transcoder: its module's input,
    ``site_out`` its output).

  Raises:
    SAEError: ``sae_file_missing`` (a directory of hookpoints names them in its fix),
      ``sae_config_invalid``, ``sae_architecture_unsupported`` (``"activation": "groupmax"``,
      a ``"signed"`` coder), ``sae_weights_invalid`` (a missing, misshapen or non-finite
      tensor; a coder saved without its decoder), each naming the field.
  """
  root = Path(path)
  if not (root / SPARSIFY_CFG).is_file():
    hookpoints = (
      sorted(p.name for p in root.iterdir() if (p / SPARSIFY_CFG).is_file())
      if root.is_dir()
      else []
    )
    fix = (
      f"one hookpoint's directory: load_sparsify(path / {hookpoints[0]!r}) (of {hookpoints})"
      if hookpoints
      else "the directory SparseCoder.save_to_disk wrote"
    )
    raise SAEError(
      f"{root} has no {SPARSIFY_CFG}", code="sae_file_missing", field=SPARSIFY_CFG, fix=fix
    )
  if not (root / SPARSIFY_WEIGHTS).is_file():
    raise _missing(root / SPARSIFY_WEIGHTS, SPARSIFY_WEIGHTS, "save the sparse coder again")
  where = root / SPARSIFY_CFG
  cfg = _read_json(where, "cfg.json")
  d_in = _positive_int(cfg, "d_in", where)
  activation = cfg.get("activation", "topk")
  if activation != "topk":
    raise SAEError(
      f"{where}: activation {activation!r} is not one jaxlens reads (sparsify's 'topk')",
      code="sae_architecture_unsupported",
      field="activation",
      fix='a coder trained with "activation": "topk"',
    )
  if cfg.get("signed", False):
    raise SAEError(
      f"{where}: a signed coder (signed=true) is not one jaxlens reads",
      code="sae_architecture_unsupported",
      field="signed",
      fix="a coder trained with signed=false",
    )
  k = _positive_int(cfg, "k", where, 32)
  d_sae = _positive_int(cfg, "num_latents", where, 0) or d_in * _positive_int(
    cfg, "expansion_factor", where, 32
  )
  if d_in == 0 or d_sae == 0 or k == 0 or k > d_sae:
    raise SAEError(
      f"{where}: d_in={d_in}, {d_sae} latents, k={k}: each must be positive and k <= latents",
      code="sae_config_invalid",
      field="k" if d_in and d_sae else "d_in",
      fix='"k": 32 with d_in and num_latents positive',
    )
  transcode = _flag(cfg, "transcode", where)
  skip = _flag(cfg, "skip_connection", where)
  tensors = _read_tensors(root / SPARSIFY_WEIGHTS)
  fix = "the sae.safetensors SparseCoder.save_to_disk wrote, with its decoder"
  w_enc = _take(tensors, "encoder.weight", (d_sae, d_in), root / SPARSIFY_WEIGHTS, fix)
  arrays = {
    "W_enc": w_enc.T,
    "b_enc": _take(tensors, "encoder.bias", (d_sae,), root / SPARSIFY_WEIGHTS, fix),
    "W_dec": _take(tensors, "W_dec", (d_sae, d_in), root / SPARSIFY_WEIGHTS, fix),
    "b_dec": _take(tensors, "b_dec", (d_in,), root / SPARSIFY_WEIGHTS, fix),
  }
  if skip:
    arrays["W_skip"] = _take(tensors, "W_skip", (d_in, d_in), root / SPARSIFY_WEIGHTS, fix)
  target = _target(dtype) if dtype is not None else w_enc.dtype
  meta = _meta(
    format="sparsify",
    hook_name=root.name,
    site=_input_site(root.name) if transcode else zoo_site(root.name),
    site_out=zoo_site(root.name) if transcode else None,
    multi_topk=bool(cfg.get("multi_topk", False)),
    normalize_decoder=bool(cfg.get("normalize_decoder", True)),
  )
  common = dict(activation="topk", k=k, metadata_json=meta)
  if not transcode and not skip:
    return SAE(**{n: a.astype(target) for n, a in arrays.items()}, **common)
  if not transcode:
    # x - b_dec is encoded but x is skipped: b_dec goes into the encoder's bias instead.
    b_enc = np.asarray(arrays["b_enc"], np.float64) - np.asarray(
      arrays["b_dec"], np.float64
    ) @ np.asarray(arrays["W_enc"], np.float64)
    arrays["b_enc"] = jnp.asarray(b_enc.astype(np.dtype(target)))
  return Transcoder(**{n: jnp.asarray(a).astype(target) for n, a in arrays.items()}, **common)


def save_sparsify(sae, path) -> Path:
  """Writes a TopK dictionary as sparsify's directory (``SparseCoder.load_from_disk(path)``
  reads it): ``cfg.json`` and ``sae.safetensors``, written beside ``path`` and renamed into
  place.

  A :class:`SAE` becomes an autoencoder (one with ``apply_b_dec_to_input=False`` has
  ``b_dec @ W_enc`` added to its encoder bias, as sparsify always subtracts ``b_dec``); a
  :class:`Transcoder` a transcoder (``"transcode": true``, with ``W_skip`` as its skip
  connection).

  Raises:
    SAEError: ``sae_architecture_unsupported`` (not TopK, or TopK with
      ``rescale_acts_by_decoder_norm``, a run-time normalisation or hook_z reshaping, or a
      transcoder with ``d_out != d_in``: sparsify has none of them), ``sae_file_exists``.
  """
  problems = []
  if not isinstance(sae, SAE) or sae.activation != "topk":
    problems.append(("activation", f"activation {getattr(sae, 'activation', None)!r}"))
  else:
    if sae.rescale_acts_by_decoder_norm:
      problems.append(("rescale_acts_by_decoder_norm", "rescale_acts_by_decoder_norm=True"))
    if sae.normalize_activations not in ("none", "expected_average_only_in"):
      problems.append(("normalize_activations", f"normalize={sae.normalize_activations!r}"))
    if sae.reshape_activations != "none":
      problems.append(("reshape_activations", "reshape_activations='hook_z'"))
    if sae.d_out != sae.d_in:
      problems.append(("d_out", f"d_out={sae.d_out} != d_in={sae.d_in}"))
  _unsupported(
    "sparsify",
    problems,
    "a TopK SAE or transcoder (d_out == d_in) without rescaling, normalisation or hook_z",
  )
  transcode = isinstance(sae, Transcoder)
  b_enc = sae.b_enc
  if not transcode and not sae.apply_b_dec_to_input:
    b_enc = (
      np.asarray(sae.b_enc, np.float64)
      + np.asarray(sae.b_dec, np.float64) @ np.asarray(sae.W_enc, np.float64)
    ).astype(np.dtype(sae.dtype))
  tensors = {
    "encoder.weight": np.ascontiguousarray(np.asarray(sae.W_enc).T),
    "encoder.bias": np.asarray(b_enc),
    "W_dec": np.asarray(sae.W_dec),
    "b_dec": np.asarray(sae.b_dec),
  }
  skip = transcode and sae.W_skip is not None
  if skip:
    tensors["W_skip"] = np.asarray(sae.W_skip)
  cfg = {
    # sparsify's SparseCoderConfig fields, in its order, then d_in (as save_to_disk writes).
    "activation": "topk",
    "expansion_factor": max(1, sae.d_sae // sae.d_in),
    "normalize_decoder": True,
    "num_latents": sae.d_sae,
    "k": int(sae.k),
    "multi_topk": False,
    "skip_connection": skip,
    "transcode": transcode,
    "d_in": sae.d_in,
  }
  files = {
    SPARSIFY_WEIGHTS: _safetensors_bytes(tensors, sae.dtype),
    SPARSIFY_CFG: json.dumps(cfg).encode(),
  }
  return _write_dir(Path(path), SPARSIFY_CFG, files, "sparse coder")


# -- dictionary_learning ----------------------------------------------------------------------

# dict_class -> what its forward is (the classes of dictionary_learning 0.1.0).
_DL_CLASSES = (
  "AutoEncoder",
  "AutoEncoderNew",
  "GatedAutoEncoder",
  "JumpReluAutoEncoder",
  "AutoEncoderTopK",
  "BatchTopKSAE",
  "MatryoshkaBatchTopKSAE",
)


def _torch_load(path: Path) -> dict:
  torch = require("torch", feature="dictionary_learning and hook_z .pt files", extra="compare")
  try:
    state = torch.load(str(path), map_location="cpu", weights_only=True)
  except Exception as error:  # torch raises RuntimeError, UnpicklingError, EOFError...
    raise SAEError(
      f"{path} is not a readable torch state dict: {error}",
      code="sae_weights_invalid",
      field=path.name,
      fix="the .pt file its library saved, intact",
    ) from error
  if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
    raise SAEError(
      f"{path} holds a {type(state).__name__}, not a state dict of tensors",
      code="sae_weights_invalid",
      field=path.name,
      fix="the state dict its library saved",
    )
  return {k: v.detach().to(torch.float64).numpy() for k, v in state.items()}


def _dl_class(tensors: dict, path: Path) -> str:
  keys = set(tensors)
  if "group_sizes" in keys:
    return "MatryoshkaBatchTopKSAE"
  if "r_mag" in keys:
    return "GatedAutoEncoder"
  if {"W_enc", "threshold"} <= keys and "k" not in keys:
    return "JumpReluAutoEncoder"
  if {"bias", "encoder.weight", "decoder.weight"} <= keys:
    return "AutoEncoder"
  if {"encoder.weight", "decoder.bias"} <= keys:
    return "AutoEncoderNew"
  raise SAEError(
    f"{path}: which dictionary_learning class saved it cannot be told from its tensors "
    f"({sorted(keys)}), and there is no config.json beside it",
    code="sae_config_invalid",
    field="dict_class",
    fix=f"dict_class= one of {list(_DL_CLASSES)} (AutoEncoderTopK and BatchTopKSAE save the "
    "same tensors)",
  )


@path_argument(SAEError)
def load_dictionary_learning(path, *, dict_class=None, normalize_decoder=True, dtype=jnp.float32):
  """Reads a ``dictionary_learning`` checkpoint: a trainer's directory (``ae.pt`` and the
  ``config.json`` whose ``trainer.dict_class`` names the class) or a ``.pt`` file (a
  ``checkpoints/ae_{step}.pt`` too). Reading ``.pt`` files needs torch (``weights_only``).

  The forward is the class's default one (what ``ae(x)`` and ``ae.encode(x)`` compute):

  * ``AutoEncoder``: ReLU of ``(x - bias)``; loaded as its ``from_pretrained`` loads it,
    which by default scales each decoder column to unit norm and the encoder row by it
    (``normalize_decoder=True``; the reconstruction is the same, the activations scale);
  * ``AutoEncoderNew``: ReLU of ``x``, ``decoder.bias`` as ``b_dec``;
  * ``GatedAutoEncoder``: the gated SAE (``gate_bias`` is ``b_enc``, ``mag_bias`` ``b_mag``);
  * ``JumpReluAutoEncoder``: JumpReLU, ``x`` not minus ``b_dec`` (its default);
  * ``AutoEncoderTopK``: TopK with the file's ``k``;
  * ``BatchTopKSAE`` / ``MatryoshkaBatchTopKSAE``: ``encode``'s default ``use_threshold=True``,
    a JumpReLU at the file's scalar ``threshold`` (the batch ``k`` in ``metadata["k"]``).

  Args:
    path: the trainer's directory or a ``.pt`` file.
    dict_class: the class name, where no ``config.json`` names it (needed only to tell
      ``AutoEncoderTopK`` from ``BatchTopKSAE``, whose tensors are the same).
    normalize_decoder: for ``AutoEncoder``, what ``from_pretrained`` does by default.
    dtype: the dtype to load in.

  Raises:
    SAEError: ``sae_file_missing``, ``sae_config_invalid`` (no way to tell the class:
      ``dict_class``), ``sae_architecture_unsupported`` (another class, named in
      ``dict_class``), ``sae_weights_invalid`` (each naming the field or tensor).
  """
  root = Path(path)
  file = root / "ae.pt" if root.is_dir() else root
  if not file.is_file():
    raise _missing(file, file.name, "a trainer's directory (ae.pt, config.json) or a .pt file")
  config_file = next(
    (p for p in (file.parent / "config.json", file.parent.parent / "config.json") if p.is_file()),
    None,
  )
  trainer = {}
  if config_file is not None:
    trainer = _read_json(config_file, "config.json").get("trainer") or {}
  tensors = _torch_load(file)
  name = dict_class or trainer.get("dict_class") or _dl_class(tensors, file)
  if name not in _DL_CLASSES:
    raise SAEError(
      f"{file}: dictionary_learning class {name!r} is not one jaxlens reads ({list(_DL_CLASSES)})",
      code="sae_architecture_unsupported",
      field="dict_class",
      fix="a checkpoint of one of those classes",
    )
  fix = f"the ae.pt a {name} saved"
  if name in ("AutoEncoder", "AutoEncoderNew", "AutoEncoderTopK", "BatchTopKSAE"):
    if "encoder.weight" not in tensors or np.ndim(tensors["encoder.weight"]) != 2:
      _take(tensors, "encoder.weight", ("d_sae", "d_in"), file, fix)
    d_sae, d_in = tensors["encoder.weight"].shape
  else:
    if "W_enc" not in tensors and "encoder.weight" in tensors:  # gated
      d_sae, d_in = tensors["encoder.weight"].shape
    elif "W_enc" in tensors and np.ndim(tensors["W_enc"]) == 2:
      d_in, d_sae = tensors["W_enc"].shape
    else:
      _take(tensors, "W_enc", ("d_in", "d_sae"), file, fix)
  take = lambda key, shape: _take(tensors, key, shape, file, fix)  # noqa: E731
  config = {"activation": "relu"}
  meta = {"format": "dictionary_learning", "dict_class": name}
  for key in ("layer", "lm_name", "submodule_name"):
    if trainer.get(key) is not None:
      meta[key] = trainer[key]
  if name in ("AutoEncoder", "AutoEncoderNew", "AutoEncoderTopK", "BatchTopKSAE"):
    w_enc = take("encoder.weight", (d_sae, d_in)).T
    b_enc = take("encoder.bias", (d_sae,))
    w_dec = take("decoder.weight", (d_in, d_sae)).T
    bias = {"AutoEncoder": "bias", "AutoEncoderNew": "decoder.bias"}.get(name, "b_dec")
    b_dec = take(bias, (d_in,))
    arrays = dict(W_enc=w_enc, b_enc=b_enc, W_dec=w_dec, b_dec=b_dec)
    config["apply_b_dec_to_input"] = name != "AutoEncoderNew"
    if name == "AutoEncoder" and normalize_decoder:
      norms = np.linalg.norm(np.asarray(w_dec, np.float32), axis=1).astype(np.float64)
      # from_pretrained leaves the weights as they are when torch.allclose(norms, 1).
      if not np.all(np.abs(norms - 1) <= 1e-8 + 1e-5):
        arrays.update(W_enc=w_enc * norms, b_enc=b_enc * norms, W_dec=w_dec / norms[:, None])
  elif name == "GatedAutoEncoder":
    arrays = dict(
      W_enc=take("encoder.weight", (d_sae, d_in)).T,
      b_enc=take("gate_bias", (d_sae,)),
      W_dec=take("decoder.weight", (d_in, d_sae)).T,
      b_dec=take("decoder_bias", (d_in,)),
      r_mag=take("r_mag", (d_sae,)),
      b_mag=take("mag_bias", (d_sae,)),
    )
    config["activation"] = "gated"
  else:
    arrays = dict(
      W_enc=take("W_enc", (d_in, d_sae)),
      b_enc=take("b_enc", (d_sae,)),
      W_dec=take("W_dec", (d_sae, d_in)),
      b_dec=take("b_dec", (d_in,)),
    )
    config["apply_b_dec_to_input"] = name not in ("JumpReluAutoEncoder",)
  if name == "JumpReluAutoEncoder":
    arrays["threshold"] = take("threshold", (d_sae,))
    config["activation"] = "jumprelu"
  if name in ("AutoEncoderTopK", "BatchTopKSAE", "MatryoshkaBatchTopKSAE"):
    k = int(np.asarray(take("k", ())))
    threshold = float(np.asarray(take("threshold", ())))
    meta.update(k=k, threshold=threshold)
    if name == "AutoEncoderTopK":
      config.update(activation="topk", k=k)
    else:
      # relu(pre) * (relu(pre) > t) is relu(pre) * (pre > t) for every t.
      arrays["threshold"] = np.full((d_sae,), threshold)
      config["activation"] = "jumprelu"
  if name == "MatryoshkaBatchTopKSAE":
    groups = np.asarray(take("group_sizes", np.shape(tensors["group_sizes"])))
    if groups.ndim != 1 or int(groups.sum()) != d_sae or (groups <= 0).any():
      raise SAEError(
        f"{file}: group_sizes {groups.tolist()} must be positive and sum to {d_sae}",
        code="sae_weights_invalid",
        field="group_sizes",
        fix=fix,
      )
    meta["group_sizes"] = [int(g) for g in groups]
  target = _target(dtype)
  return SAE(
    **{n: jnp.asarray(np.asarray(a, np.float64).astype(target)) for n, a in arrays.items()},
    **config,
    metadata_json=json.dumps(meta, sort_keys=True),
  )


# -- Llama Scope ------------------------------------------------------------------------------


@path_argument(SAEError)
def load_llama_scope(path, *, dtype=jnp.float32):
  """Reads a Llama Scope SAE: the directory ``Llama3_1-8B-Base-L{layer}{R,A,M,TC}-{n}x`` of
  ``hyperparams.json`` and ``checkpoints/final.safetensors`` (``encoder.weight (d_sae,
  d_model)``, ``encoder.bias``, ``decoder.weight (d_model, d_sae)``, ``decoder.bias``).

  As SAELens 6 loads it (``llama_scope_sae_huggingface_loader``, then the folding of its
  ``norm_scaling_factor``): a JumpReLU SAE on the raw activations, ``x`` not minus ``b_dec``,
  with the dataset's norm ``s = sqrt(d_model) / dataset_average_activation_norm["in"]`` folded
  in: ``W_enc * s``, ``W_dec / s``, ``b_dec / s`` and the scalar ``jump_relu_threshold * s``
  for every feature. ``metadata["site"]`` is the zoo site of ``hook_point_in``.

  Raises:
    SAEError: ``sae_file_missing``, ``sae_config_invalid`` (a missing or malformed field),
      ``sae_architecture_unsupported`` (an ``act_fn`` other than ``jumprelu``, or
      ``apply_decoder_bias_to_pre_encoder``), ``sae_weights_invalid``, each naming it.
  """
  root = Path(path)
  hyper = root / "hyperparams.json"
  weights = root / "checkpoints" / "final.safetensors"
  for file in (hyper, weights):
    if not file.is_file():
      raise _missing(file, file.name, "a Llama Scope SAE's directory")
  cfg = _read_json(hyper, "hyperparams.json")
  act_fn = cfg.get("act_fn", "jumprelu")
  if act_fn != "jumprelu":
    raise SAEError(
      f"{hyper}: act_fn {act_fn!r} is not a Llama Scope JumpReLU SAE",
      code="sae_architecture_unsupported",
      field="act_fn",
      fix='a Llama Scope SAE with "act_fn": "jumprelu"',
    )
  if cfg.get("apply_decoder_bias_to_pre_encoder", False):
    raise SAEError(
      f"{hyper}: apply_decoder_bias_to_pre_encoder=true is not read (SAELens reads Llama Scope "
      "SAEs without it)",
      code="sae_architecture_unsupported",
      field="apply_decoder_bias_to_pre_encoder",
      fix="a Llama Scope SAE as released",
    )
  d_in = _positive_int(cfg, "d_model", hyper)
  d_sae = _positive_int(cfg, "d_sae", hyper)
  norms = cfg.get("dataset_average_activation_norm")
  norm_in = norms.get("in") if isinstance(norms, dict) else None
  threshold = cfg.get("jump_relu_threshold")
  for field, value in (
    ("dataset_average_activation_norm", norm_in),
    ("jump_relu_threshold", threshold),
  ):
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
      raise SAEError(
        f"{hyper}: {field} is {value!r}, not a finite number",
        code="sae_config_invalid",
        field=field,
        fix="the hyperparams.json Llama Scope released",
      )
  if norm_in <= 0:
    raise SAEError(
      f"{hyper}: dataset_average_activation_norm.in={norm_in} must be positive",
      code="sae_config_invalid",
      field="dataset_average_activation_norm",
      fix="the hyperparams.json Llama Scope released",
    )
  scale = d_in**0.5 / norm_in
  tensors = {k: np.asarray(v, np.float64) for k, v in _read_tensors(weights).items()}
  fix = "the checkpoints/final.safetensors Llama Scope released"
  w_enc = _take(tensors, "encoder.weight", (d_sae, d_in), weights, fix).T
  w_dec = _take(tensors, "decoder.weight", (d_in, d_sae), weights, fix).T
  arrays = dict(
    W_enc=w_enc * scale,
    b_enc=_take(tensors, "encoder.bias", (d_sae,), weights, fix),
    W_dec=w_dec / scale,
    b_dec=_take(tensors, "decoder.bias", (d_in,), weights, fix) / scale,
    threshold=np.full((d_sae,), threshold * scale),
  )
  hook = cfg.get("hook_point_in")
  meta = _meta(
    format="llama_scope",
    hook_name=hook,
    hook_name_out=cfg.get("hook_point_out"),
    site=zoo_site(hook) if hook else None,
    norm_scaling_factor=scale,
  )
  return SAE(
    **{n: jnp.asarray(np.asarray(a, np.float64).astype(_target(dtype))) for n, a in arrays.items()},
    activation="jumprelu",
    apply_b_dec_to_input=False,
    metadata_json=meta,
  )


def _jumprelu_problems(sae) -> list:
  problems = []
  if not isinstance(sae, SAE) or sae.activation != "jumprelu":
    problems.append(("activation", f"activation {getattr(sae, 'activation', None)!r}"))
  elif sae.normalize_activations not in ("none", "expected_average_only_in"):
    problems.append(("normalize_activations", f"normalize={sae.normalize_activations!r}"))
  return problems


def save_llama_scope(sae, path, *, hook_name=None) -> Path:
  """Writes a JumpReLU SAE with one threshold for every feature as a Llama Scope directory
  (``hyperparams.json``, ``checkpoints/final.safetensors``), which :func:`load_llama_scope`
  and SAELens's Llama Scope loader read back as the same function: the dataset norm is written
  as ``sqrt(d_model)`` (so the folded factor is 1), and a ``b_dec`` the SAE subtracts from its
  input is folded into ``encoder.bias`` (Llama Scope encodes ``x`` itself).

  Args:
    sae: a JumpReLU :class:`SAE` whose ``threshold`` is one value.
    path: the directory to write.
    hook_name: ``hook_point_in`` (default: ``metadata["hook_name"]``; SAELens needs one).

  Raises:
    SAEError: ``sae_architecture_unsupported`` (not JumpReLU, per-feature thresholds, a
      transcoder, a run-time normalisation: each naming the field), ``sae_config_invalid``
      (no ``hook_name``), ``sae_file_exists``.
  """
  problems = _jumprelu_problems(sae)
  if not problems and isinstance(sae, Transcoder):
    problems.append(("d_out", "a transcoder's d_out and W_skip"))
  threshold = np.asarray(sae.threshold) if not problems else None
  if threshold is not None and not (threshold == threshold[0]).all():
    problems.append(("threshold", "per-feature thresholds (Llama Scope's is one scalar)"))
  _unsupported("Llama Scope", problems, "a JumpReLU SAE whose threshold is one value")
  hook = hook_name or sae.metadata.get("hook_name")
  if not isinstance(hook, str) or not hook:
    raise SAEError(
      "a Llama Scope directory names its hook_point_in, and this SAE's metadata has none",
      code="sae_config_invalid",
      field="hook_name",
      fix="save_llama_scope(d, path, hook_name='blocks.5.hook_resid_post')",
    )
  d_model = sae.d_in
  hyper = {
    "d_model": d_model,
    "d_sae": sae.d_sae,
    "expansion_factor": max(1, sae.d_sae // d_model),
    "act_fn": "jumprelu",
    "jump_relu_threshold": float(threshold[0]),
    "dataset_average_activation_norm": {"in": d_model**0.5, "out": d_model**0.5},
    "hook_point_in": hook,
    "hook_point_out": hook,
    "apply_decoder_bias_to_pre_encoder": False,
  }
  tensors = {
    "encoder.weight": np.asarray(sae.W_enc).T,
    "encoder.bias": _b_dec_folded(sae),
    "decoder.weight": np.asarray(sae.W_dec).T,
    "decoder.bias": np.asarray(sae.b_dec),
  }
  files = {
    "hyperparams.json": json.dumps(hyper, indent=2).encode(),
    "checkpoints/final.safetensors": _safetensors_bytes(tensors, sae.dtype),
  }
  return _write_dir(Path(path), "hyperparams.json", files, "Llama Scope SAE")


def save_gemma_scope(sae, path, *, model_name=None) -> Path:
  """Writes a JumpReLU SAE or transcoder as a Gemma Scope 2 folder: ``params.safetensors``
  (``w_enc``, ``w_dec``, ``b_enc``, ``b_dec``, ``threshold``, and a transcoder's ``W_skip`` as
  ``affine_skip_connection (d_in, d_out)``) and ``config.json`` (``"architecture":
  "jump_relu"``). :func:`load_gemma_scope` and SAELens's Gemma Scope 2 loader read it back as
  the same function (a ``b_dec`` subtracted from the input is folded into ``b_enc``). Name the
  folder as Gemma Scope 2 does (``resid_post/layer_5_width_16k_l0_small``): the site is read
  from it.

  Args:
    sae: a JumpReLU :class:`SAE` or :class:`Transcoder`.
    path: the folder to write.
    model_name: ``config.json``'s ``model_name`` (default: ``metadata["model_name"]``;
      SAELens needs one), e.g. ``"gemma-v3-270m-pt"``.

  Raises:
    SAEError: ``sae_architecture_unsupported`` (not JumpReLU, or a run-time normalisation),
      ``sae_config_invalid`` (no ``model_name``), ``sae_file_exists``.
  """
  _unsupported("Gemma Scope", _jumprelu_problems(sae), "a JumpReLU SAE or transcoder")
  model_name = model_name or sae.metadata.get("model_name")
  if not isinstance(model_name, str) or not model_name:
    raise SAEError(
      "a Gemma Scope 2 config.json names its model, and this dictionary's metadata has none",
      code="sae_config_invalid",
      field="model_name",
      fix="save_gemma_scope(d, path, model_name='gemma-v3-270m-pt')",
    )
  tensors = {
    "w_enc": np.asarray(sae.W_enc),
    "w_dec": np.asarray(sae.W_dec),
    "b_enc": _b_dec_folded(sae),
    "b_dec": np.asarray(sae.b_dec),
    "threshold": np.asarray(sae.threshold),
  }
  cfg = {"architecture": "jump_relu", "model_name": model_name}
  if isinstance(sae, Transcoder):
    cfg["affine_connection"] = sae.W_skip is not None
    if sae.W_skip is not None:
      tensors["affine_skip_connection"] = np.asarray(sae.W_skip).T
  files = {
    "params.safetensors": _safetensors_bytes(tensors, sae.dtype),
    "config.json": json.dumps(cfg, indent=2).encode(),
  }
  return _write_dir(Path(path), "params.safetensors", files, "Gemma Scope dictionary")


@path_argument(SAEError)
def load_gemma_scope_clt(path, *, dtype=jnp.float32) -> CrossLayerTranscoder:
  """Reads a Gemma Scope 2 cross-layer transcoder: one ``.safetensors`` file per layer (a
  directory of files named ``..layer_{i}..``, or a list of them in layer order), each with
  ``w_enc (d_in, d_sae)``, ``w_dec (d_sae, n_layers, d_out)``, ``b_enc``, ``b_dec (d_out,)``
  and ``threshold``, as circuit-tracer's ``load_gemma_scope_2_clt`` reads them: layer ``i``'s
  features write to layers ``i..n-1`` (``w_dec[:, i:]``).

  Returns:
    A JumpReLU :class:`CrossLayerTranscoder`.

  Raises:
    SAEError: ``sae_file_missing``, ``sae_weights_invalid`` (a missing or misshapen tensor;
      a layer whose ``w_dec`` writes to an earlier layer, which no cross-layer transcoder
      does; a negative threshold), ``sae_architecture_unsupported`` (an
      ``affine_skip_connection``: jaxlens's cross-layer transcoder has no skip term), each
      naming the field.
  """
  if isinstance(path, (list, tuple)):
    files = [Path(p) for p in path]
  else:
    root = Path(path)
    found = {}
    for file in root.glob("*.safetensors") if root.is_dir() else ():
      match = re.search(r"layer_(\d+)", file.name)
      if match:
        found[int(match.group(1))] = file
    if not found or sorted(found) != list(range(len(found))):
      gap = min(set(range(len(found) + 1)) - set(found))
      raise SAEError(
        f"{root} has no file for layer {gap} (found layers {sorted(found)})",
        code="sae_file_missing",
        field=f"layer_{gap}",
        fix="the directory of one Gemma Scope 2 cross-layer transcoder, or a list of its files",
      )
    files = [found[i] for i in range(len(found))]
  for file in files:
    if not file.is_file():
      raise _missing(file, file.name, "the per-layer .safetensors files, in layer order")
  n = len(files)
  layers = []
  for i, file in enumerate(files):
    t = {k: np.asarray(v, np.float64) for k, v in _read_tensors(file).items()}
    fix = "the per-layer file of a Gemma Scope 2 cross-layer transcoder"
    if "affine_skip_connection" in t:
      raise SAEError(
        f"{file}: an affine_skip_connection, which jaxlens's CrossLayerTranscoder does not have",
        code="sae_architecture_unsupported",
        field="affine_skip_connection",
        fix="a cross-layer transcoder without the affine skip connection",
      )
    if "w_enc" not in t or np.ndim(t["w_enc"]) != 2:
      _take(t, "w_enc", ("d_in", "d_sae"), file, fix)
    d_in, d_sae = t["w_enc"].shape
    if "w_dec" not in t or np.ndim(t["w_dec"]) != 3:
      _take(t, "w_dec", (d_sae, n, "d_out"), file, fix)
    d_out = t["w_dec"].shape[-1]
    w_dec = _take(t, "w_dec", (d_sae, n, d_out), file, fix)
    if np.any(w_dec[:, :i] != 0):
      raise SAEError(
        f"{file}: layer {i}'s w_dec writes to earlier layers ({int((w_dec[:, :i] != 0).sum())} "
        "nonzero entries)",
        code="sae_weights_invalid",
        field="w_dec",
        fix="a cross-layer transcoder whose layer i writes to layers i..n-1",
      )
    threshold = _take(t, "threshold", (d_sae,), file, fix)
    if (threshold < 0).any():
      raise SAEError(
        f"{file}: negative thresholds, which jaxlens's JumpReLU (relu(x) * (x > t)) does not "
        "reproduce (circuit-tracer computes x * (x > t))",
        code="sae_weights_invalid",
        field="threshold",
        fix="thresholds >= 0, as trained JumpReLU transcoders have",
      )
    layers.append(
      dict(
        W_enc=_take(t, "w_enc", (d_in, d_sae), file, fix),
        b_enc=_take(t, "b_enc", (d_sae,), file, fix),
        W_dec=np.transpose(w_dec[:, i:], (1, 0, 2)),
        b_dec=_take(t, "b_dec", (d_out,), file, fix),
        threshold=threshold,
      )
    )
    if (d_in, d_sae, d_out) != (layers[0]["W_enc"].shape + (layers[0]["b_dec"].shape[0],)):
      raise SAEError(
        f"{file}: layer {i} is ({d_in}, {d_sae}, {d_out}), layer 0 "
        f"{layers[0]['W_enc'].shape + layers[0]['b_dec'].shape}",
        code="sae_weights_invalid",
        field="w_enc",
        fix="the files of one cross-layer transcoder",
      )
  target = _target(dtype)

  def cast(a):
    return jnp.asarray(np.asarray(a, np.float64).astype(target))

  return CrossLayerTranscoder(
    W_enc=cast(np.stack([lay["W_enc"] for lay in layers])),
    b_enc=cast(np.stack([lay["b_enc"] for lay in layers])),
    W_dec=tuple(cast(lay["W_dec"]) for lay in layers),
    b_dec=cast(np.stack([lay["b_dec"] for lay in layers])),
    threshold=cast(np.stack([lay["threshold"] for lay in layers])),
    activation="jumprelu",
  )


# -- connor-rob hook_z SAEs --------------------------------------------------------------------


@path_argument(SAEError)
def load_hook_z(path, *, dtype=jnp.float32):
  """Reads one of connor-rob's (Kissane, Krzyzanowski et al.) attention-output SAEs: the
  ``.pt`` state dict (``W_enc (d_in, d_sae)``, ``b_enc``, ``W_dec (d_sae, d_in)``,
  ``b_dec``) and the ``_cfg.json`` beside it (``<name>_cfg.json``: ``act_size``,
  ``dict_size``, ``act_name``). Reading ``.pt`` needs torch.

  As SAELens loads them (``connor_rob_hook_z_huggingface_loader``): a ReLU SAE with
  ``apply_b_dec_to_input`` and ``reshape_activations="hook_z"``, trained at
  ``blocks.{L}.attn.hook_z``, the heads' mixed values ``(batch, seq, heads, head_dim)``
  before the output projection, concatenated over heads (``d_in = heads * head_dim``).
  In the zoo that site is ``blocks_{L}/attn/z`` (``metadata["site"]``), of the same shape:
  ``sae.splice(model, "blocks_5/attn/z", d)`` flattens the heads, encodes, and gives the
  reconstruction back per head.

  Raises:
    SAEError: ``sae_file_missing``, ``sae_config_invalid``, ``sae_weights_invalid``.
  """
  file = Path(path)
  cfg_file = file.with_name(file.name.split(".pt")[0] + "_cfg.json")  # as SAELens names it
  for f in (file, cfg_file):
    if not f.is_file():
      raise _missing(f, f.name, "the .pt file and the _cfg.json beside it")
  cfg = _read_json(cfg_file, "_cfg.json")
  d_in = _positive_int(cfg, "act_size", cfg_file)
  d_sae = _positive_int(cfg, "dict_size", cfg_file)
  tensors = _torch_load(file)
  fix = "the .pt file of the SAE its _cfg.json describes"
  arrays = dict(
    W_enc=_take(tensors, "W_enc", (d_in, d_sae), file, fix),
    b_enc=_take(tensors, "b_enc", (d_sae,), file, fix),
    W_dec=_take(tensors, "W_dec", (d_sae, d_in), file, fix),
    b_dec=_take(tensors, "b_dec", (d_in,), file, fix),
  )
  hook = cfg.get("act_name")
  site = zoo_site(hook) if isinstance(hook, str) else None
  return SAE(
    **{n: jnp.asarray(np.asarray(a, np.float64).astype(_target(dtype))) for n, a in arrays.items()},
    activation="relu",
    apply_b_dec_to_input=True,
    reshape_activations="hook_z",
    metadata_json=_meta(format="hook_z", hook_name=hook, site=site),
  )


# -- circuit-tracer -----------------------------------------------------------------------------


@path_argument(SAEError)
def load_circuit_tracer(path, dtype=None):
  """circuit-tracer's transcoder files, read by :func:`jaxlens.circuits.load_circuit_tracer`
  (the same function): a per-layer transcoder's ``.safetensors`` file, a list of them, or a
  cross-layer transcoder's directory.

  Returns:
    A :class:`Transcoder`, a list of them, or a :class:`CrossLayerTranscoder`.

  Raises:
    jaxlens.circuits.CircuitError: ``circuit_file_missing``, ``circuit_file_corrupt``.
  """
  from jaxlens.circuits import load_circuit_tracer as load

  return load(path, dtype)
