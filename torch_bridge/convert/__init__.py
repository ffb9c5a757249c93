"""Convert torch models to Flax linen models whose sites carry torch's module names.

One entry point, :func:`from_torch`, two converters behind it:

* the **fast path** (:mod:`torch_bridge.convert._modules`): readable hand-written Flax modules
  for ``Linear``, ``Conv1d/2d/3d``, ``LayerNorm``, ``Embedding``, activations, ``Sequential``
  and the reference :class:`TinyGPT`; used when every module of the model is one of these;
* the **export path** (:mod:`torch_bridge.convert._export`): any model ``torch.export`` can
  export, interpreted op by op from one ATen -> JAX table (:mod:`torch_bridge.convert._aten`),
  with one Flax module per torch module.

Both return ``(flax_module, variables, site_map)``; ``docs/conversion.md`` documents the site
map and what each path supports.
"""

from __future__ import annotations

from typing import Any

import torch

from torch_bridge.convert import _modules
from torch_bridge.convert._arrays import to_jax, to_torch
from torch_bridge.convert._dtypes import dtype_argument
from torch_bridge.convert._errors import ConversionError
from torch_bridge.convert._export import ExportOptions, convert_exported, export_model
from torch_bridge.convert._gpt import GPTBlock, TinyGPT
from torch_bridge.convert._hf_sites import HF_SITES, register_sites, sites_for

__all__ = [
  "HF_SITES",
  "ConversionError",
  "ExportOptions",
  "GPTBlock",
  "TinyGPT",
  "convert",
  "from_torch",
  "register_sites",
  "sites_for",
  "to_jax",
  "to_torch",
]

_METHODS = ("auto", "modules", "export")


def from_torch(
  module: torch.nn.Module,
  *example_args: Any,
  example_kwargs: dict | None = None,
  dtype: Any = None,
  method: str = "auto",
  dynamic_shapes: Any = None,
  attention_probs: bool = False,
  eval_mode: bool = True,
  canonical_sites: bool = True,
) -> tuple[Any, dict[str, Any], dict[str, str]]:
  """Converts a torch model into an equivalent Flax linen model, with a site map.

  Args:
    module: the torch model. Its weights are copied, not shared.
    *example_args: example inputs (tensors) for the export path; the converted model takes
      arrays in the same positions (``flax_module.apply(variables, *args)``).
    example_kwargs: example keyword inputs (tensors), passed by name to the converted model.
    dtype: floating dtype of the parameters and buffers (``jnp.float32``, ``torch.float64``);
      None keeps torch's. float64 needs ``jax_enable_x64``.
    method: ``"auto"`` (the fast path when every module is one it knows, or when no example
      inputs are given; else the export path), ``"modules"`` (fast path only) or ``"export"``.
    dynamic_shapes: export path: ``torch.export`` dynamic shapes (e.g. ``{"input_ids": {0:
      torch.export.Dim("batch")}}``); other sizes are fixed to the example's.
    attention_probs: export path: each softmax and ``scaled_dot_product_attention`` computes
      its probabilities in a child Flax module ``attn_probs``, a site of its own.
    eval_mode: export path: export in eval mode (BatchNorm running statistics, dropout off);
      each module's training flag is restored afterwards.
    canonical_sites: export path, a Hugging Face model whose ``config.model_type`` has a table
      in :data:`HF_SITES` (Llama, Mistral, Qwen2/3, Gemma 2/3, GPT-NeoX, GPT-2): the converted
      model also answers to the zoo's site names (``blocks_{i}/resid_post``,
      ``blocks_{i}/attn/pattern``, ``logits``, ...; the attention probabilities become sites).
      A Hugging Face model's KV cache output (``use_cache``, on by default) is turned off for
      the export and restored.

  Returns:
    ``(flax_module, variables, site_map)``. ``variables`` is ``{"params": ...}`` (plus
    ``"buffers"`` on the export path). ``site_map`` maps each torch module name (as in
    ``named_modules()``; ``""`` the root) that has a site to the "/"-joined Flax path of the
    module computing the same output. The fast path names Flax children its own way
    (``layers_0`` for a ``Sequential``'s ``0``); the export path keeps torch's names
    (``transformer/h/0/mlp`` for ``transformer.h.0.mlp``). See ``docs/conversion.md``.

  Raises:
    ConversionError: the model cannot be converted faithfully; ``fields["code"]`` says why
      (``docs/errors.md``).
    TypeError: ``module`` is not a ``torch.nn.Module``.
  """
  if not isinstance(module, torch.nn.Module):
    raise TypeError(f"from_torch expects a torch.nn.Module, got {type(module).__name__}")
  if method not in _METHODS:
    raise ConversionError(
      f"method={method!r} is not one of {_METHODS}",
      code="invalid_method",
      module="",
      fix="method='auto'",
    )
  has_example = bool(example_args) or bool(example_kwargs)
  if method == "auto" and not has_example:
    try:
      return _modules.from_torch(module, dtype=dtype)
    except ConversionError as e:
      if e.code != "unsupported_module":
        raise
      # The module-by-module converter does not know this model; the export path would
      # convert it, given example inputs: the message says so (fields unchanged).
      message = str(e).split("] ", 1)[-1]
      raise ConversionError(
        f"{message}. The export path converts any model torch.export can trace, on example "
        "inputs: pass them, from_torch(model, *example_inputs) (a Hugging Face model: "
        "from_torch(model, input_ids))",
        **e.fields,
      ) from None
  if method == "modules":
    return _modules.from_torch(module, dtype=dtype)
  if method == "auto" and _modules.handles(module, dtype=dtype):
    return _modules.from_torch(module, dtype=dtype)
  flax_module, variables, site_map, _ = convert(
    module,
    *example_args,
    example_kwargs=example_kwargs,
    dtype=dtype,
    dynamic_shapes=dynamic_shapes,
    attention_probs=attention_probs,
    eval_mode=eval_mode,
    canonical_sites=canonical_sites,
  )
  return flax_module, variables, site_map


def convert(
  module: torch.nn.Module,
  *example_args: Any,
  example_kwargs: dict | None = None,
  dtype: Any = None,
  dynamic_shapes: Any = None,
  attention_probs: bool = False,
  eval_mode: bool = True,
  canonical_sites: bool = True,
):
  """The export path of :func:`from_torch`; also returns the :class:`Program` it built."""
  if not example_args and not example_kwargs:
    raise ConversionError(
      "the export path traces the model on example inputs",
      code="example_inputs_required",
      module="",
      fix="from_torch(model, *example_inputs)",
    )
  target = dtype_argument(dtype)
  sites = sites_for(module) if canonical_sites else ()
  options = ExportOptions(
    dynamic_shapes=dynamic_shapes,
    attention_probs=attention_probs or bool(sites),
    eval_mode=eval_mode,
    sites=sites,
  )
  config = getattr(module, "config", None)
  use_cache = getattr(config, "use_cache", None)
  if use_cache:  # a Hugging Face model would return its KV cache object: export without it
    config.use_cache = False
  try:
    ep = export_model(module, tuple(example_args), dict(example_kwargs or {}), options)
  finally:
    if use_cache:
      config.use_cache = use_cache
  return convert_exported(ep, options, dtype=target)
