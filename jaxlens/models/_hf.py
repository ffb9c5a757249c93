"""What every family's Hugging Face translation shares: the loaders' error, a ``config.json``
reader that knows which fields it has read (so that a field that would change the computation
is never ignored silently), the rotary and activation fields, and the tensor transforms of the
weight maps.

A family module (``llama.py``, ``gemma3.py``, ...) owns its translation: ``MODEL_TYPES`` (the
``model_type`` values it reads), ``from_hf(reader, dtype)`` (a :class:`HFConfig` to the
family's config) and ``hf_weights(config)`` (yields ``(param path, tensor name, transform)``).
:mod:`jaxlens.models.loading` keeps the file formats and walks the families.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from jaxlens.core import InvalidArgumentError
from jaxlens.models.rope import KINDS, Rope

__all__ = [
  "HFConfig",
  "LoadError",
  "activation_field",
  "ident",
  "layer_norm",
  "linear",
  "rope_from_hf",
  "t",
]


class LoadError(InvalidArgumentError):
  """A checkpoint that cannot be loaded: ``.fields["code"]`` says why, ``["tensor"]`` names it."""


# Fields of a config.json that do not change an inference forward pass: bookkeeping,
# generation defaults, token ids, dropout probabilities (the zoo runs in eval mode), training
# losses and initialisers.
INERT = frozenset(
  {
    "_name_or_path",
    "architectures",
    "model_type",
    "transformers_version",
    "dtype",
    "torch_dtype",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    "sep_token_id",
    "decoder_start_token_id",
    "id2label",
    "label2id",
    "problem_type",
    "tokenizer_class",
    "prefix",
    "task_specific_params",
    "chunk_size_feed_forward",
    "is_encoder_decoder",
    "is_decoder",
    "output_attentions",
    "output_hidden_states",
    "return_dict",
    "use_cache",
    "cache_implementation",
    "initializer_range",
    "initializer_factor",
    "attention_dropout",
    "hidden_dropout",
    "hidden_dropout_prob",
    "attention_probs_dropout_prob",
    "classifier_dropout",
    "embd_pdrop",
    "resid_pdrop",
    "attn_pdrop",
    "output_router_logits",
    "router_aux_loss_coef",
    "router_z_loss_coef",
    "router_jitter_noise",
    # Llama's tensor-parallel slicing of its products in pretraining: the same products.
    "pretraining_tp",
    "use_return_dict",
    "torchscript",
    "tf_legacy_loss",
    "pruned_heads",
    "tie_encoder_decoder",
    "finetuning_task",
    "max_length",
    "min_length",
    "do_sample",
    "num_beams",
    "temperature",
    "top_k",
    "top_p",
    "repetition_penalty",
    "generation_config",
  }
)


class HFConfig:
  """A ``config.json`` dict that records the fields read.

  ``get``/``[]`` read a field; :meth:`finish` refuses every field that was neither read nor
  :data:`INERT` nor given an absent-like value (None or False), with ``config_unsupported``
  naming it: a field jaxlens does not implement must not be dropped silently.
  """

  def __init__(self, config: Mapping[str, Any]):
    self.config = config
    self.read: set[str] = set()

  @property
  def model_type(self) -> Any:
    return self.get("model_type")

  def __contains__(self, key: str) -> bool:
    return key in self.config

  def __getitem__(self, key: str) -> Any:
    self.read.add(key)
    return self.config[key]

  def get(self, key: str, default: Any = None) -> Any:
    self.read.add(key)
    value = self.config.get(key, default)
    return default if value is None else value

  def seen(self, *keys: str) -> None:
    """Marks ``keys`` as handled (their value was checked by the caller)."""
    self.read.update(keys)

  def refuse(self, key: str, why: str, fix: str) -> LoadError:
    return LoadError(
      f"config.json's {key} = {self.config.get(key)!r:.60} {why}",
      code="config_unsupported",
      tensor="config.json",
      field=key,
      received=repr(self.config.get(key))[:60],
      fix=fix,
    )

  def require(self, key: str, allowed: Iterable[Any], why: str) -> None:
    """Refuses ``key`` unless absent or one of ``allowed``."""
    self.read.add(key)
    if key in self.config and self.config[key] is not None and self.config[key] not in allowed:
      raise self.refuse(key, why, f"{key} in {list(allowed)!r}")

  def finish(self, inert: Iterable[str] = ()) -> None:
    """Refuses the first field that was neither read nor inert and has a value."""
    skip = INERT | set(inert)
    for key, value in self.config.items():
      if key in self.read or key in skip or value is None or value is False:
        continue
      if isinstance(value, (dict, list)) and not value:
        continue
      raise self.refuse(
        key,
        f"is not implemented by jaxlens's {self.model_type!r} family",
        "remove the field if it does not change the model (docs/models.md lists what each "
        "family reads)",
      )


# Hugging Face activation names and what they compute; jax.nn's functions are picked in
# blocks.activation.
ACTIVATIONS = (
  "silu",
  "swish",
  "gelu",
  "gelu_python",
  "gelu_new",
  "gelu_pytorch_tanh",
  "gelu_fast",
  "quick_gelu",
  "relu",
)


def activation_field(config: HFConfig, *keys: str, default: str) -> str:
  """The MLP activation: the first of ``keys`` present (``hidden_act``,
  ``hidden_activation``, ``activation_function``), refused when jaxlens does not implement it."""
  for key in keys:
    config.seen(key)
  for key in keys:
    value = config.config.get(key)
    if value is not None:
      if value not in ACTIVATIONS:
        raise config.refuse(key, "is not an activation jaxlens implements", f"one of {ACTIVATIONS}")
      return value
  return default


def _rope_dict(config: HFConfig, layer_type: str | None) -> dict:
  config.seen("rope_parameters", "rope_scaling", "rope_theta", "partial_rotary_factor")
  rope = config.config.get("rope_parameters") or config.config.get("rope_scaling") or {}
  if not isinstance(rope, Mapping):
    raise config.refuse("rope_parameters", "is not an object", "a dict with rope_type")
  if layer_type is not None and isinstance(rope.get(layer_type), Mapping):
    rope = rope[layer_type]
  return dict(rope)


def rope_from_hf(
  config: HFConfig, *, default_base: float = 10000.0, layer_type: str | None = None
) -> tuple[float, Rope | None]:
  """``(base, scaling)`` of a config: the rotary base and, when the rotation is scaled or
  partial, the :class:`~jaxlens.models.rope.Rope` (None for the plain default rotation).

  Reads ``rope_parameters`` (transformers 5; per layer type for Gemma 3) or the older
  ``rope_scaling`` + ``rope_theta``, and ``partial_rotary_factor``.

  Raises:
    LoadError: ``config_unsupported`` for a scaling jaxlens does not implement or a missing
      parameter of one it does.
  """
  rope = _rope_dict(config, layer_type)
  key = "rope_parameters" if config.config.get("rope_parameters") else "rope_scaling"
  kind = rope.get("rope_type", rope.get("type")) or "default"
  if kind not in KINDS:
    raise config.refuse(key, f"names the rotary scaling {kind!r}", f"rope_type in {KINDS}")
  base = rope.get("rope_theta") or config.config.get("rope_theta") or default_base
  fraction = rope.get("partial_rotary_factor") or config.config.get("partial_rotary_factor") or 1.0
  if not (isinstance(base, (int, float)) and not isinstance(base, bool) and math.isfinite(base)):
    raise LoadError(
      f"config.json gives rope_base = {base!r:.40}, which must be a finite number",
      code="config_invalid",
      tensor="config.json",
      field="rope_base",
      received=repr(base)[:40],
      fix="check config.json against the checkpoint (rope_theta)",
    )
  if kind == "default" and fraction == 1.0:
    return float(base), None

  def need(name, default=None):
    value = rope.get(name, default)
    if value is None:
      raise config.refuse(key, f"has no {name!r}, which rotary scaling {kind!r} needs", name)
    return value

  original = rope.get("original_max_position_embeddings") or config.config.get(
    "original_max_position_embeddings"
  )
  fields: dict[str, Any] = {"base": float(base), "kind": kind, "fraction": float(fraction)}
  if kind in ("linear", "dynamic", "llama3"):
    fields["factor"] = float(need("factor"))
  if kind == "dynamic":
    fields["original_max_len"] = int(config.get("max_position_embeddings", 2048))
  if kind == "llama3":
    fields["original_max_len"] = int(need("original_max_position_embeddings"))
    fields["low_freq_factor"] = float(need("low_freq_factor"))
    fields["high_freq_factor"] = float(need("high_freq_factor"))
  if kind == "yarn":
    original = original or config.config.get("max_position_embeddings")
    factor = rope.get("factor") or config.config["max_position_embeddings"] / original
    fields.update(
      factor=float(factor),
      original_max_len=int(original),
      beta_fast=float(rope.get("beta_fast") or 32),
      beta_slow=float(rope.get("beta_slow") or 1),
      truncate=bool(rope.get("truncate", True)),
      attention_factor=rope.get("attention_factor"),
      mscale=rope.get("mscale"),
      mscale_all_dim=rope.get("mscale_all_dim"),
    )
  if kind == "longrope":
    original = int(original or config.config["max_position_embeddings"])
    factor = rope.get("factor") or config.config["max_position_embeddings"] / original
    fields.update(
      factor=float(factor),
      original_max_len=original,
      attention_factor=rope.get("attention_factor"),
      short_factor=tuple(float(f) for f in need("short_factor")),
      long_factor=tuple(float(f) for f in need("long_factor")),
    )
  return float(base), Rope(**fields)


def linear(path: tuple[str, ...], name: str, bias: bool = True):
  """The weight map of a torch ``Linear`` called ``name`` as the flax ``Dense`` at ``path``."""
  yield (*path, "kernel"), name + ".weight", t
  if bias:
    yield (*path, "bias"), name + ".bias", ident


def layer_norm(path: tuple[str, ...], name: str):
  """The weight map of a torch ``LayerNorm`` called ``name`` as the flax one at ``path``."""
  yield (*path, "scale"), name + ".weight", ident
  yield (*path, "bias"), name + ".bias", ident


def t(w):
  """A torch ``Linear`` weight ``(out, in)`` as a flax kernel ``(in, out)``."""
  return np.asarray(w).T


def ident(w):
  return np.asarray(w)
