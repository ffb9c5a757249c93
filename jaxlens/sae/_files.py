"""Dictionary files: SAELens's directory format both ways, and the Gemma Scope layout.

SAELens (``SAE.save_model`` / ``SAE.load_from_disk``) writes a directory of
``cfg.json`` (the config's fields, ``"architecture"`` and ``"metadata"``) and
``sae_weights.safetensors`` (the state dict: ``W_enc (d_in, d_sae)``, ``b_enc``,
``W_dec (d_sae, d_out)``, ``b_dec``, and ``threshold`` / ``W_skip`` where the
architecture has them). Gemma Scope publishes ``params.npz`` (or a safetensors file)
with the same tensors (lower-case names in its later releases) and no config.
"""

from __future__ import annotations

import json
import re
import zipfile
import zlib
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from jaxlens.internal import json_loads, require
from jaxlens.sae._dictionaries import SAE, SAEError, Transcoder
from jaxlens.internal import path_argument, write_directory

__all__ = ["load_saelens", "save_saelens", "load_gemma_scope"]

CFG = "cfg.json"
WEIGHTS = "sae_weights.safetensors"
# The SAELens release whose format this module writes (its cfg.json "metadata" carries it,
# and SAELens reads configs without it as pre-6.0 ones).
SAELENS_VERSION = "6.54.12"

# architecture -> (class, activation, has a skip connection)
_ARCHITECTURES = {
  "standard": (SAE, "relu", False),
  "jumprelu": (SAE, "jumprelu", False),
  "topk": (SAE, "topk", False),
  "batchtopk": (SAE, "batchtopk", False),
  "abstopk": (SAE, "abstopk", False),
  "gated": (SAE, "gated", False),
  "transcoder": (Transcoder, "relu", False),
  "skip_transcoder": (Transcoder, "relu", True),
  "jumprelu_transcoder": (Transcoder, "jumprelu", False),
  "jumprelu_skip_transcoder": (Transcoder, "jumprelu", True),
}
_DTYPES = {
  "float32": jnp.float32,
  "float64": jnp.float64,
  "float16": jnp.float16,
  "bfloat16": jnp.bfloat16,
}


def _safetensors():
  return require("safetensors", feature="jaxlens.sae files", extra="sae")


def _dtype(name, field="dtype"):
  text = str(name).removeprefix("torch.")
  if text not in _DTYPES:
    raise SAEError(
      f"{field}={name!r} is not a float dtype jaxlens reads ({sorted(_DTYPES)})",
      code="sae_config_invalid",
      field=field,
      fix='"dtype": "float32"',
    )
  return _DTYPES[text]


def _require_finite(path: Path, name: str, value) -> None:
  """Refuses a tensor holding NaN or infinity (a damaged or diverged file), naming it."""
  bad = ~np.isfinite(np.asarray(value, np.float32))
  if bad.any():
    raise SAEError(
      f"{path}: {name} holds {int(bad.sum())} NaN or infinite values (first at index "
      f"{tuple(int(i) for i in np.argwhere(bad)[0])})",
      code="sae_weights_invalid",
      field=name,
      fix="save or download the dictionary again; a damaged or diverged one cannot be loaded",
    )


def _read_tensors(path: Path) -> dict:
  _safetensors()
  from safetensors import SafetensorError, safe_open

  try:
    with safe_open(str(path), framework="flax") as f:
      return {k: f.get_tensor(k) for k in f.keys()}
  except (SafetensorError, OSError, ValueError) as error:
    raise SAEError(
      f"{path} is not a readable safetensors file: {error}",
      code="sae_weights_invalid",
      field=path.name,
      fix="save the dictionary again",
    ) from error


def _config_field(cfg, name, kind, path, default=...):
  if name not in cfg:
    if default is not ...:
      return default
    raise SAEError(
      f"{path} has no {name!r}",
      code="sae_config_invalid",
      field=name,
      fix=f"add {name!r} to {CFG}",
    )
  value = cfg[name]
  if kind is int and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
    raise SAEError(
      f"{path}: {name}={value!r} must be a positive integer",
      code="sae_config_invalid",
      field=name,
      fix=f'"{name}": 128',
    )
  if kind is bool and not isinstance(value, bool):
    raise SAEError(
      f"{path}: {name}={value!r} must be true or false",
      code="sae_config_invalid",
      field=name,
      fix=f'"{name}": false',
    )
  return value


def _pre_6_0(cfg: dict) -> dict:
  """SAELens's renames of configs older than 6.0 (``handle_pre_6_0_config``)."""
  renames = {"hook_point": "hook_name", "activation_fn_str": "activation_fn"}
  cfg = {renames.get(k, k): v for k, v in cfg.items()}
  cfg.setdefault("architecture", "standard")
  if isinstance(cfg.get("normalize_activations"), bool):
    # SAELens's backwards compatibility: true was "expected_average_only_in" (the scaling is
    # folded into the weights, identity at inference).
    cfg["normalize_activations"] = (
      "expected_average_only_in" if cfg["normalize_activations"] else "none"
    )
  kwargs = cfg.get("activation_fn_kwargs") or {}
  if cfg.get("activation_fn") == "topk" and kwargs.get("k") is not None:
    cfg["architecture"] = "topk"
    cfg["k"] = kwargs["k"]
  return cfg


@path_argument(SAEError)
def load_saelens(path, *, dtype=None):
  """Reads a dictionary saved by SAELens (``sae.save_model(path)``) or :func:`save_saelens`.

  Args:
    path: the directory holding ``cfg.json`` and ``sae_weights.safetensors``.
    dtype: the dtype to load in (default: the config's ``"dtype"``).

  Returns:
    An :class:`SAE` (architectures ``standard``, ``jumprelu``, ``topk``, ``batchtopk``)
    or a :class:`Transcoder` (``transcoder``, ``skip_transcoder``, ``jumprelu_transcoder``,
    ``jumprelu_skip_transcoder``).

  Raises:
    SAEError: ``sae_file_missing`` (no such directory or file), ``sae_config_invalid``
      (a missing or malformed config field, named in ``fields["field"]``),
      ``sae_architecture_unsupported``, ``sae_weights_invalid`` (a missing tensor or one
      of the wrong shape, named in ``fields["field"]``).
  """
  root = Path(path)
  for name in (CFG, WEIGHTS):
    if not (root / name).is_file():
      raise SAEError(
        f"{root} has no {name}: not a SAELens dictionary directory",
        code="sae_file_missing",
        field=name,
        fix="the directory SAELens's sae.save_model(path) wrote",
      )
  try:
    cfg = json_loads((root / CFG).read_text())
  except (ValueError, UnicodeDecodeError) as error:  # nested too deep, too
    raise SAEError(
      f"{root / CFG} is not JSON: {error}",
      code="sae_config_invalid",
      field=CFG,
      fix="save the dictionary again",
    ) from error
  if not isinstance(cfg, dict):
    raise SAEError(
      f"{root / CFG} holds a {type(cfg).__name__}, not an object",
      code="sae_config_invalid",
      field=CFG,
      fix="save the dictionary again",
    )
  metadata = cfg.get("metadata") if isinstance(cfg.get("metadata"), dict) else {}
  version = str(cfg.get("sae_lens_version") or metadata.get("sae_lens_version") or "")
  major = version.split(".")[0]
  if not major.isdigit() or int(major) < 6:
    cfg = _pre_6_0(cfg)
  elif "architecture" not in cfg:
    # SAELens 6 refuses such a config; read as "standard" it would turn a TopK or JumpReLU
    # dictionary into a ReLU one without a word.
    raise SAEError(
      f'{root / CFG} (SAELens {version}) has no "architecture"',
      code="sae_config_invalid",
      field="architecture",
      fix='add the architecture SAELens saved it with, e.g. "architecture": "topk"',
    )
  arch = cfg.get("architecture", "standard")
  if arch not in _ARCHITECTURES:
    raise SAEError(
      f"{root / CFG}: architecture {arch!r} is not one jaxlens reads ({sorted(_ARCHITECTURES)})",
      code="sae_architecture_unsupported",
      field="architecture",
      fix="convert it to one of those architectures in SAELens first",
    )
  cls, activation, skip = _ARCHITECTURES[arch]
  d_in = _config_field(cfg, "d_in", int, root / CFG)
  d_sae = _config_field(cfg, "d_sae", int, root / CFG)
  d_out = _config_field(cfg, "d_out", int, root / CFG) if cls is Transcoder else d_in
  apply_b_dec = _config_field(cfg, "apply_b_dec_to_input", bool, root / CFG, default=cls is SAE)
  norm = cfg.get("normalize_activations", "none") or "none"
  target = _dtype(dtype if dtype is not None else cfg.get("dtype", "float32"))
  tensors = _read_tensors(root / WEIGHTS)
  if "log_threshold" in tensors and "threshold" not in tensors:
    tensors["threshold"] = jnp.exp(tensors.pop("log_threshold"))
  meta = dict(metadata)
  if arch == "batchtopk" and "topk_threshold" in tensors:
    meta["topk_threshold"] = float(np.asarray(tensors["topk_threshold"], np.float64))
  if arch == "gated" and "b_gate" in tensors:
    tensors["b_enc"] = tensors.pop("b_gate")
  names = ["W_enc", "b_enc", "W_dec", "b_dec"]
  if activation == "jumprelu":
    names.append("threshold")
  if activation == "gated":
    names += ["r_mag", "b_mag"]
  if skip:
    names.append("W_skip")
  shapes = {
    "W_enc": (d_in, d_sae),
    "b_enc": (d_sae,),
    "W_dec": (d_sae, d_out),
    "b_dec": (d_out,),
    "threshold": (d_sae,),
    "W_skip": (d_out, d_in),
    "r_mag": (d_sae,),
    "b_mag": (d_sae,),
  }
  arrays = {}
  for name in names:
    if name not in tensors:
      raise SAEError(
        f"{root / WEIGHTS} has no tensor {name!r} (architecture {arch!r} needs {names})",
        code="sae_weights_invalid",
        field=name,
        fix="save the dictionary again",
      )
    value = tensors[name]
    if tuple(value.shape) != shapes[name]:
      raise SAEError(
        f"{root / WEIGHTS}: {name} has shape {tuple(value.shape)}, but {CFG} gives {shapes[name]}",
        code="sae_weights_invalid",
        field=name,
        expected=str(shapes[name]),
        received=str(tuple(value.shape)),
        fix="the config and the weights of one save",
      )
    _require_finite(root / WEIGHTS, name, value)
    arrays[name] = value.astype(target)
  config = dict(
    activation=activation,
    apply_b_dec_to_input=apply_b_dec,
    normalize_activations=norm,
    reshape_activations=cfg.get("reshape_activations", "none") or "none",
    metadata_json=json.dumps(meta, sort_keys=True, default=str),
  )
  if activation in ("topk", "batchtopk", "abstopk"):
    k = cfg.get("k")
    if isinstance(k, bool) or not isinstance(k, (int, float)) or k <= 0:
      raise SAEError(
        f"{root / CFG}: k={k!r} must be a positive number for architecture {arch!r}",
        code="sae_config_invalid",
        field="k",
        fix='"k": 32',
      )
    config["k"] = float(k) if activation == "batchtopk" else int(k)
    config["rescale_acts_by_decoder_norm"] = bool(cfg.get("rescale_acts_by_decoder_norm", False))
  return cls(**arrays, **config)


def _config_dict(sae) -> tuple[str, dict]:
  if isinstance(sae, Transcoder):
    arch = {"relu": "transcoder", "jumprelu": "jumprelu_transcoder"}.get(sae.activation)
    if arch is not None and sae.W_skip is not None:
      arch = arch.replace("transcoder", "skip_transcoder")
  elif isinstance(sae, SAE):
    arch = {
      "relu": "standard",
      "jumprelu": "jumprelu",
      "topk": "topk",
      "abstopk": "abstopk",
      "gated": "gated",
    }.get(sae.activation)
  else:
    arch = None
  if arch is None:
    fix = (
      "sae.to_jumprelu(threshold) (SAELens saves BatchTopK SAEs as JumpReLU ones)"
      if getattr(sae, "activation", None) == "batchtopk"
      else "an SAE or Transcoder with an activation SAELens has"
    )
    raise SAEError(
      f"SAELens has no inference architecture for {type(sae).__name__} with activation "
      f"{getattr(sae, 'activation', None)!r}",
      code="sae_architecture_unsupported",
      field="architecture",
      fix=fix,
    )
  metadata = {**sae.metadata}
  metadata.setdefault("sae_lens_version", SAELENS_VERSION)
  metadata.setdefault("sae_lens_training_version", SAELENS_VERSION)
  dtype = jnp.dtype(sae.dtype).name
  cfg = {
    "d_in": sae.d_in,
    "d_sae": sae.d_sae,
    "dtype": dtype,
    "device": "cpu",
    "apply_b_dec_to_input": bool(sae.apply_b_dec_to_input),
    "normalize_activations": sae.normalize_activations,
    "reshape_activations": sae.reshape_activations,
    "metadata": metadata,
    "architecture": arch,
  }
  if arch in ("topk", "abstopk"):
    cfg["k"] = int(sae.k)
    cfg["rescale_acts_by_decoder_norm"] = bool(sae.rescale_acts_by_decoder_norm)
  if isinstance(sae, Transcoder):
    cfg["d_out"] = sae.d_out
  return arch, cfg


def save_saelens(sae, path) -> Path:
  """Writes ``sae`` as SAELens's directory format (``SAE.load_from_disk(path)`` reads it).

  The directory is written atomically: the files go to a temporary sibling that
  replaces ``path`` once complete (an existing directory is replaced only if it holds
  a dictionary).

  Raises:
    SAEError: ``sae_architecture_unsupported`` (a dictionary SAELens has no class for:
      a BatchTopK SAE, which SAELens saves as JumpReLU: ``sae.to_jumprelu(t)``),
      ``sae_file_exists`` (``path`` is a file, a non-empty directory without
      ``cfg.json``, or a dictionary's directory holding other files, which replacing it
      would delete), ``sae_save_failed`` (the file system refused the write).
  """
  arch, cfg = _config_dict(sae)
  root = Path(path)
  # SAELens keeps a dictionary's feature sparsity beside it (stale once it is replaced).
  _check_replaceable(root, CFG, (CFG, WEIGHTS, "sparsity.safetensors"), "dictionary")
  names = ["W_enc", "b_enc", "W_dec", "b_dec"]
  if "jumprelu" in arch:
    names.append("threshold")
  if "skip" in arch:
    names.append("W_skip")
  if arch == "gated":
    names += ["r_mag", "b_mag"]
  # SAELens names a gated SAE's gate bias b_gate (it has no b_enc).
  file_names = {"b_enc": "b_gate"} if arch == "gated" else {}
  _safetensors()
  from safetensors.flax import save

  weights = save({file_names.get(n, n): jnp.asarray(getattr(sae, n)) for n in names})
  return _write_directory(root, {WEIGHTS: weights, CFG: json.dumps(cfg, indent=2).encode()})


def _write_directory(root: Path, files: dict) -> Path:
  """``write_directory``, its OS errors (an unwritable or missing parent, a full disk) as
  ``sae_save_failed`` (they were raw ``OSError``s); nothing is left at ``root``."""
  try:
    return write_directory(root, files)
  except OSError as error:
    raise SAEError(
      f"cannot save the dictionary to {root}: {type(error).__name__}: {error}",
      code="sae_save_failed",
      field=str(root),
      fix="a writable directory with free space; an existing dictionary there is kept",
    ) from None


def _check_replaceable(root: Path, marker: str, own, what: str) -> None:
  """An existing ``root`` may be replaced only if it is empty, or holds ``marker`` (a
  directory of the same format) and nothing but the format's files (``own``: top-level
  names); the replacement deleted everything in it, a user's README or plots too."""
  if not root.exists():
    return
  if not root.is_dir() or (any(root.iterdir()) and not (root / marker).is_file()):
    raise SAEError(
      f"{root} exists and is not a {what}'s directory: refusing to replace it",
      code="sae_file_exists",
      field=str(root),
      fix="a new or empty directory",
    )
  others = sorted(p.name for p in root.iterdir() if p.name not in set(own))
  if others:
    raise SAEError(
      f"{root} holds files that are not the {what}'s ({others[:5]}): replacing the directory "
      "would delete them",
      code="sae_file_exists",
      field=str(root / others[0]),
      fix="move them out of the directory, or save to a new one",
    )


@path_argument(SAEError)
def load_gemma_scope(path, *, dtype=jnp.float32, apply_b_dec_to_input: bool = False):
  """Reads a Gemma Scope or Gemma Scope 2 dictionary: ``params.npz`` or a ``.safetensors``
  file (``params.safetensors``), or the directory holding it.

  Tensors ``W_enc (d_in, d_sae)``, ``W_dec (d_sae, d_out)``, ``b_enc``, ``b_dec`` and
  ``threshold`` (any case: ``w_enc`` in the later releases); with ``threshold`` the
  dictionary is a JumpReLU one. ``d_out != d_in`` (or a ``W_skip`` of shape
  ``(d_out, d_in)``) makes a :class:`Transcoder`. Gemma Scope encodes ``x`` itself, not
  ``x - b_dec`` (``apply_b_dec_to_input=False``, as SAELens's loader sets).

  Gemma Scope 2 (Gemma 3; SAELens's ``gemma_3_sae_huggingface_loader``): the folder
  ``{resid_post,attn_out,mlp_out,transcoder...}/layer_{L}_...`` holds ``params.safetensors``
  and, in most releases, a ``config.json`` whose ``"architecture"`` must be ``"jump_relu"``;
  an affine transcoder's ``affine_skip_connection (d_in, d_out)`` is its ``W_skip``
  transposed. The folder names the site: ``metadata["hook_name"]`` is SAELens's hook and
  ``metadata["site"]`` the zoo's (``blocks_{L}/resid_post``, ``attn/z``, ``mlp_out``; a
  transcoder reads ``blocks_{L}/ln_2``, the MLP's input, and writes ``metadata["site_out"]``
  ``blocks_{L}/mlp_out``). An ``attn_out`` SAE reads the output projection's input, the
  heads' values concatenated: it is given ``reshape_activations="hook_z"``, so it reads
  ``blocks_{L}/attn/z`` ``(..., heads, head_dim)`` as well as the flat values.

  Raises:
    SAEError: ``sae_file_missing``, ``sae_weights_invalid`` (a missing or misshapen
      tensor, named in ``fields["field"]``; a cross-layer transcoder's 3-D ``w_dec``),
      ``sae_architecture_unsupported`` (a ``config.json`` architecture other than
      ``jump_relu``).
  """
  path = Path(path)
  if path.is_dir():
    found = [path / "params.npz", *sorted(path.glob("*.safetensors"))]
    found = [p for p in found if p.is_file()]
    if not found:
      raise SAEError(
        f"{path} holds neither params.npz nor a .safetensors file",
        code="sae_file_missing",
        field="params.npz",
        fix="the directory of one Gemma Scope dictionary",
      )
    path = found[0]
  if not path.is_file():
    raise SAEError(
      f"no file {path}",
      code="sae_file_missing",
      field=path.name,
      fix="the path of params.npz or of the .safetensors file",
    )
  if path.suffix == ".npz":
    try:
      # The file is opened here: np.load leaves its own handle open when the zip is bad.
      with path.open("rb") as handle, np.load(handle) as npz:
        raw = {k: jnp.asarray(npz[k]) for k in npz.files}
    except (
      OSError,
      ValueError,
      EOFError,
      KeyError,
      NotImplementedError,
      zipfile.BadZipFile,
      zlib.error,
    ) as error:  # cut short, a flipped byte (a bad CRC), a member that is not an array
      raise SAEError(
        f"{path} is not a readable npz file: {error}",
        code="sae_weights_invalid",
        field=path.name,
        fix="download the file again",
      ) from error
  else:
    raw = _read_tensors(path)
  config = _gemma_scope_2_config(path)
  tensors = {}
  for key, value in raw.items():
    canonical = {"w_enc": "W_enc", "w_dec": "W_dec", "w_skip": "W_skip"}.get(key.lower(), key)
    if key == "affine_skip_connection":  # Gemma Scope 2 stores it (d_in, d_out)
      canonical, value = "W_skip", value.T
    tensors[canonical] = value
  for name in ("W_enc", "W_dec", "b_enc", "b_dec"):
    if name not in tensors:
      raise SAEError(
        f"{path} has no tensor {name!r} (found {sorted(raw)})",
        code="sae_weights_invalid",
        field=name,
        fix="a Gemma Scope params file (W_enc, W_dec, b_enc, b_dec, threshold)",
      )
  if tensors["W_enc"].ndim != 2:
    raise SAEError(
      f"{path}: W_enc has shape {tuple(tensors['W_enc'].shape)}, expected (d_in, d_sae)",
      code="sae_weights_invalid",
      field="W_enc",
      fix="a Gemma Scope params file",
    )
  if tensors["W_dec"].ndim != 2:
    raise SAEError(
      f"{path}: W_dec has shape {tuple(tensors['W_dec'].shape)}, expected (d_sae, d_out): "
      "a cross-layer transcoder's layer, which writes to several layers",
      code="sae_weights_invalid",
      field="W_dec",
      fix="sae.load_gemma_scope_clt(the directory of its per-layer files)",
    )
  for name in ("W_enc", "W_dec", "b_enc", "b_dec", "threshold"):
    if name in tensors:
      _require_finite(path, name, tensors[name])
  arrays = {n: tensors[n].astype(dtype) for n in ("W_enc", "W_dec", "b_enc", "b_dec")}
  jump = "threshold" in tensors
  if jump:
    arrays["threshold"] = tensors["threshold"].astype(dtype)
  transcoder = "W_skip" in tensors or arrays["W_dec"].shape[-1] != arrays["W_enc"].shape[0]
  config = {"activation": "jumprelu" if jump else "relu", **config}
  if transcoder:
    config.pop("reshape_activations", None)
    if "W_skip" in tensors:
      arrays["W_skip"] = tensors["W_skip"].astype(dtype)
    return Transcoder(**arrays, **config)
  return SAE(**arrays, apply_b_dec_to_input=apply_b_dec_to_input, **config)


def _gemma_scope_2_config(path: Path) -> dict:
  """The site and checks of a Gemma Scope 2 folder (SAELens's ``get_gemma_3_config_from_hf``):
  ``{kind}/layer_{L}_...`` and its optional ``config.json``."""
  folder = f"{path.parent.parent.name}/{path.parent.name}"
  cfg_file = path.parent / "config.json"
  model = None
  if cfg_file.is_file():
    try:
      raw = json_loads(cfg_file.read_text())
    except (ValueError, UnicodeDecodeError) as error:
      raise SAEError(
        f"{cfg_file} is not JSON: {error}",
        code="sae_config_invalid",
        field="config.json",
        fix="the config.json Gemma Scope 2 released",
      ) from error
    if not isinstance(raw, dict) or raw.get("architecture") != "jump_relu":
      found = raw.get("architecture") if isinstance(raw, dict) else raw
      raise SAEError(
        f"{cfg_file}: architecture {found!r} is not a Gemma Scope 2 JumpReLU dictionary",
        code="sae_architecture_unsupported",
        field="architecture",
        fix='a Gemma Scope 2 folder whose config.json has "architecture": "jump_relu"',
      )
    model = raw.get("model_name") if isinstance(raw.get("model_name"), str) else None
  layer = re.search(r"layer_(\d+)", folder)
  if layer is None:
    return {}
  i = layer.group(1)
  hooks = (
    ("transcoder", f"blocks.{i}.hook_mlp_in", f"blocks_{i}/ln_2"),
    ("clt", f"blocks.{i}.hook_mlp_in", f"blocks_{i}/ln_2"),
    ("resid_post", f"blocks.{i}.hook_resid_post", f"blocks_{i}/resid_post"),
    ("attn_out", f"blocks.{i}.attn.hook_z", f"blocks_{i}/attn/z"),
    ("mlp_out", f"blocks.{i}.hook_mlp_out", f"blocks_{i}/mlp_out"),
  )
  for kind, hook, site in hooks:
    if kind in folder:
      meta = {"format": "gemma_scope_2", "hook_name": hook, "site": site}
      if model is not None:
        meta["model_name"] = model
      if kind in ("transcoder", "clt"):
        meta.update(hook_name_out=f"blocks.{i}.hook_mlp_out", site_out=f"blocks_{i}/mlp_out")
      config = {"metadata_json": json.dumps(meta, sort_keys=True)}
      if kind == "attn_out":
        config["reshape_activations"] = "hook_z"
      return config
  return {}
