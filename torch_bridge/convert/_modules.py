"""The hand-written fast path: readable Flax modules for a fixed set of torch modules.

:func:`torch_bridge.from_torch` uses it when every module of the model is one it knows
(and always when no example inputs are given); everything else goes through
:mod:`torch_bridge.convert._export`. This module's :func:`from_torch` is that fast path. It walks a torch module tree, converts
each module with the converter registered for its type in ``_REGISTRY`` and
returns an unbound linen module, its ``variables`` (weights copied out of
torch) and a *site map* from torch module names to Flax module paths, so that
activations recorded on either side can be matched up.

The converted modules compute what torch computes, with torch's conventions
kept at the module boundary:

* ``nn.Linear`` becomes ``flax.linen.Dense``; the ``(out, in)`` weight is
  transposed into the ``(in, out)`` Dense kernel.
* ``nn.Conv1d/2d/3d`` become :class:`FlaxConv`, which takes and returns
  channels-first arrays (``NCL``/``NCHW``/``NCDHW``) exactly like torch. The
  kernel is stored in Flax's layout ``(*kernel_size, in // groups, out)``; the
  layout change of the activations happens inside the module through the
  convolution's dimension numbers, so no user-side transpose is needed.
* ``nn.Sequential`` becomes ``flax.linen.Sequential`` (children are named
  ``layers_0``, ``layers_1``, ... by Flax, whatever their torch names).
* :class:`GPTBlock` and :class:`TinyGPT`, the reference torch transformer
  of ``_gpt.py``, become :class:`FlaxGPTBlock` and :class:`FlaxTinyGPT` (``_flax_layers.py``).

Matrix products and convolutions run at ``jax.lax.Precision.HIGHEST`` so that
float32 results match torch's CPU results on accelerators too (no TF32).

Anything the converter does not understand raises :class:`ConversionError`
instead of producing a silently different model: an unregistered module type,
a subclass that overrides ``forward``, an attribute value outside the handled
set (see ``_Spec``), an unexpected parameter, buffer, child or public instance
attribute, a module instance used twice, or an unusable dtype.

Torch forward hooks registered on the torch modules are not converted.
Weight tying is not preserved either: each module gets its own copy.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import torch
from flax import linen as nn

from torch_bridge.convert._dtypes import jax_dtype, target_dtype
from torch_bridge.convert._errors import ConversionError
from torch_bridge.convert._flax_layers import (
  _PRECISION,
  FlaxActivation,
  FlaxCausalSelfAttention,
  FlaxConv,
  FlaxGPTBlock,
  FlaxIdentity,
  FlaxLayerNorm,
  FlaxTinyGPT,
)
from torch_bridge.convert._gpt import GPTBlock, TinyGPT

__all__ = ["from_torch", "handles"]


# --------------------------------------------------------------------------
# Conversion machinery.
# --------------------------------------------------------------------------


@dataclasses.dataclass
class _Converted:
  """The result of converting one torch module (and its subtree).

  Attributes:
    module: The unbound linen module.
    params: Its ``params`` collection (nested dict, maybe empty).
    sites: torch name -> Flax path, both relative to this module
      (``"" -> ""`` for the module itself).
  """

  module: nn.Module
  params: dict[str, Any]
  sites: dict[str, str]

  def adopt(self, torch_name: str, flax_name: str, child: _Converted) -> None:
    """Nests ``child`` (torch child ``torch_name``, Flax name ``flax_name``)."""
    if child.params:
      self.params[flax_name] = child.params
    for t, f in child.sites.items():
      self.sites[_join(torch_name, t, ".")] = _join(flax_name, f, "/")


def _join(prefix: str, rest: str, sep: str) -> str:
  return f"{prefix}{sep}{rest}" if prefix and rest else prefix or rest


@dataclasses.dataclass
class _Context:
  """Where in the torch tree a converter runs, and shared conversion state.

  Attributes:
    name: The torch name of the module being converted (``""`` = root).
    dtype: Target parameter dtype, or None to keep each tensor's own.
    seen: ids of torch modules already converted -> their names (to
      detect module instances that are used at two places).
    copy: whether parameters are copied out of torch; False (:func:`handles`) gives their
      shapes and dtypes only.
  """

  name: str
  dtype: Any
  seen: dict[int, str]
  copy: bool = True

  def child(self, name: str) -> _Context:
    return _Context(_join(self.name, name, "."), self.dtype, self.seen, self.copy)

  def param_dtype(self, t: torch.Tensor) -> Any:
    """The jax dtype a copy of parameter ``t`` will have."""
    return self.dtype if self.dtype is not None else jax_dtype(t.dtype)

  def array(self, t: torch.Tensor, transpose: Sequence[int] | None = None) -> jax.Array:
    """Copies parameter ``t`` out of torch (optionally transposed).

    The data is always copied into fresh memory, so later in-place
    updates of the torch weights do not change the Flax variables.
    """
    if not self.copy:
      shape = t.shape if transpose is None else tuple(t.shape[i] for i in transpose)
      return jax.ShapeDtypeStruct(tuple(shape), self.param_dtype(t))
    t = t.detach().cpu()
    host = t.float().numpy() if t.dtype == torch.bfloat16 else t.numpy()
    host = np.array(host if transpose is None else host.transpose(transpose), copy=True)
    return jnp.asarray(host, dtype=self.param_dtype(t))

  def error(self, module: torch.nn.Module, code: str, message: str, **fields: Any):
    """Builds a :class:`ConversionError` about ``module`` at this place."""
    where = repr(self.name) if self.name else "<root>"
    return ConversionError(
      f"cannot convert torch module {where} ({type(module).__name__}): {message}",
      code=code,
      module=self.name,
      type=type(module).__name__,
      **fields,
    )

  def bad_attribute(self, module: torch.nn.Module, attribute: str, value: Any, supported: str):
    """A :class:`ConversionError` for an unsupported attribute value."""
    return self.error(
      module,
      "unsupported_attribute",
      f"attribute {attribute}={value!r} is not supported; supported: {supported}",
      attribute=attribute,
      value=value,
      supported=supported,
    )


Converter = Callable[[Any, _Context], _Converted]


@dataclasses.dataclass(frozen=True)
class _Spec:
  """How one torch module type is converted.

  Attributes:
    convert: The converter function.
    attributes: Public instance attributes the converter reads or
      validates (``training`` is always handled). Any other public
      attribute is rejected, so that a torch version or user code that
      adds behaviour-changing state fails loudly.
    parameters: Parameter slots (registered value may be None).
    children: Allowed child names, or None for containers (any names).
  """

  convert: Converter
  attributes: tuple[str, ...] = ()
  parameters: tuple[str, ...] = ()
  children: tuple[str, ...] | None = ()


def _check_state(module: torch.nn.Module, spec: _Spec, ctx: _Context) -> None:
  """Rejects attributes, parameters, buffers or children ``spec`` doesn't handle."""
  handled = ", ".join(spec.attributes) or "none"
  for attr in vars(module):
    if not attr.startswith("_") and attr != "training" and attr not in spec.attributes:
      raise ctx.bad_attribute(
        module, attr, getattr(module, attr), f"only the attributes: {handled}"
      )
  for pname, p in module._parameters.items():
    if pname not in spec.parameters and p is not None:
      raise ctx.bad_attribute(
        module, pname, "<parameter>", f"only the parameters: {', '.join(spec.parameters) or 'none'}"
      )
  for bname, b in module._buffers.items():
    if b is not None:
      raise ctx.bad_attribute(module, bname, "<buffer>", "no buffers")
  for cname, child in module._modules.items():
    if spec.children is not None and cname not in spec.children:
      raise ctx.bad_attribute(
        module,
        cname,
        type(child).__name__,
        f"only the children: {', '.join(spec.children) or 'none'}",
      )
    if child is None:
      raise ctx.bad_attribute(module, cname, None, "child modules that are not None")


def _lookup(module: torch.nn.Module, ctx: _Context) -> _Spec:
  """Finds the spec for ``module``'s type (or a base whose forward it keeps)."""
  for cls in type(module).__mro__:
    spec = _REGISTRY.get(cls)
    if spec is None:
      continue
    if type(module).forward is not cls.forward:
      raise ctx.error(
        module,
        "unsupported_module",
        f"subclass of {cls.__name__} overrides forward(); only the stock "
        f"forward is supported. Supported types: {_supported_names()}",
      )
    return spec
  raise ctx.error(
    module,
    "unsupported_module",
    f"module type {type(module).__name__} is not supported. Supported types: {_supported_names()}",
  )


def _supported_names() -> str:
  return ", ".join(cls.__name__ for cls in _REGISTRY)


def _convert(
  module: torch.nn.Module, ctx: _Context, converter: Converter | None = None
) -> _Converted:
  """Converts ``module`` with its registered (or the given) converter."""
  if id(module) in ctx.seen:
    raise ctx.error(
      module,
      "shared_module",
      f"the same module instance is also used as {ctx.seen[id(module)]!r}; "
      "supported: each module instance used at one place only",
    )
  ctx.seen[id(module)] = ctx.name
  spec = _lookup(module, ctx)
  _check_state(module, spec, ctx)
  return (converter or spec.convert)(module, ctx)


# ----- converters, one per torch module type ------------------------------


def _convert_linear(m: torch.nn.Linear, ctx: _Context) -> _Converted:
  dense = nn.Dense(
    features=m.out_features,
    use_bias=m.bias is not None,
    param_dtype=ctx.param_dtype(m.weight),
    precision=_PRECISION,
  )
  params = {"kernel": ctx.array(m.weight, transpose=(1, 0))}
  if m.bias is not None:
    params["bias"] = ctx.array(m.bias)
  return _Converted(dense, params, {"": ""})


def _convert_sequential(m: torch.nn.Sequential, ctx: _Context) -> _Converted:
  children = list(m._modules.items())
  if not children:  # torch's empty Sequential is the identity.
    return _Converted(FlaxIdentity(), {}, {"": ""})
  converted = [(name, _convert(child, ctx.child(name))) for name, child in children]
  out = _Converted(nn.Sequential([c.module for _, c in converted]), {}, {"": ""})
  for i, (name, c) in enumerate(converted):
    out.adopt(name, f"layers_{i}", c)  # Flax names list items layers_<i>.
  return out


def _activation(kind: str) -> Converter:
  """A converter for an attribute-free activation of the given kind."""

  def convert(m: torch.nn.Module, ctx: _Context) -> _Converted:
    return _Converted(FlaxActivation(kind), {}, {"": ""})

  return convert


def _convert_gelu(m: torch.nn.GELU, ctx: _Context) -> _Converted:
  kinds = {"none": "gelu", "tanh": "gelu_tanh"}
  if m.approximate not in kinds:
    raise ctx.bad_attribute(m, "approximate", m.approximate, "'none' or 'tanh'")
  return _Converted(FlaxActivation(kinds[m.approximate]), {}, {"": ""})


def _convert_identity(m: torch.nn.Identity, ctx: _Context) -> _Converted:
  return _Converted(FlaxIdentity(), {}, {"": ""})


def _convert_dropout(m: torch.nn.Dropout, ctx: _Context) -> _Converted:
  if m.training:
    raise ctx.bad_attribute(
      m, "training", True, "Dropout in eval mode only (call model.eval() first)"
    )
  return _Converted(FlaxIdentity(), {}, {"": ""})


def _convert_layer_norm(m: torch.nn.LayerNorm, ctx: _Context) -> _Converted:
  # Without elementwise_affine there are no parameters; param_dtype is moot.
  ref = m.weight if m.weight is not None else m.bias
  norm = FlaxLayerNorm(
    normalized_shape=tuple(m.normalized_shape),
    eps=float(m.eps),
    use_scale=m.weight is not None,
    use_bias=m.bias is not None,
    param_dtype=jnp.float32 if ref is None else ctx.param_dtype(ref),
  )
  params = {}
  if m.weight is not None:
    params["scale"] = ctx.array(m.weight)
  if m.bias is not None:
    params["bias"] = ctx.array(m.bias)
  return _Converted(norm, params, {"": ""})


def _convert_embedding(m: torch.nn.Embedding, ctx: _Context) -> _Converted:
  # padding_idx, scale_grad_by_freq and sparse only affect gradients.
  if m.max_norm is not None:
    raise ctx.bad_attribute(
      m, "max_norm", m.max_norm, "max_norm=None (torch renormalises weights in place)"
    )
  embed = nn.Embed(
    num_embeddings=m.num_embeddings,
    features=m.embedding_dim,
    param_dtype=ctx.param_dtype(m.weight),
  )
  return _Converted(embed, {"embedding": ctx.array(m.weight)}, {"": ""})


def _convert_conv(m: torch.nn.modules.conv._ConvNd, ctx: _Context) -> _Converted:
  if m.padding_mode != "zeros":
    raise ctx.bad_attribute(m, "padding_mode", m.padding_mode, "'zeros'")
  if m.transposed:
    raise ctx.bad_attribute(m, "transposed", True, "False")
  n = len(m.kernel_size)
  if m.padding == "valid":
    padding = ((0, 0),) * n
  elif m.padding == "same":
    # torch pads dilation*(k-1) in total, the odd extra one at the end.
    totals = [d * (k - 1) for d, k in zip(m.dilation, m.kernel_size)]
    padding = tuple((t // 2, t - t // 2) for t in totals)
  else:
    padding = tuple((p, p) for p in m.padding)
  conv = FlaxConv(
    features=m.out_channels,
    kernel_size=tuple(m.kernel_size),
    strides=tuple(m.stride),
    padding=padding,
    dilation=tuple(m.dilation),
    groups=m.groups,
    use_bias=m.bias is not None,
    param_dtype=ctx.param_dtype(m.weight),
  )
  # torch (out, in/groups, *k) -> Flax (*k, in/groups, out).
  params = {"kernel": ctx.array(m.weight, transpose=(*range(2, n + 2), 1, 0))}
  if m.bias is not None:
    params["bias"] = ctx.array(m.bias)
  return _Converted(conv, params, {"": ""})


def _reject_multihead_attention(m: torch.nn.MultiheadAttention, ctx: _Context) -> _Converted:
  raise ctx.error(
    m,
    "unsupported_module",
    "nn.MultiheadAttention is only supported as the `attn` of a GPTBlock, "
    "where it is known to be called as causal self-attention; standalone, "
    "its query/key/value and masks are call-time arguments the converter "
    "cannot see",
  )


def _convert_causal_self_attention(m: torch.nn.MultiheadAttention, ctx: _Context) -> _Converted:
  """Converts ``GPTBlock.attn`` (batch-first causal self-attention)."""
  if not m.batch_first:
    raise ctx.bad_attribute(m, "batch_first", m.batch_first, "True")
  if not m._qkv_same_embed_dim:
    raise ctx.bad_attribute(m, "kdim/vdim", (m.kdim, m.vdim), "kdim == vdim == embed_dim")
  if m.bias_k is not None:
    raise ctx.bad_attribute(m, "bias_k", "<parameter>", "add_bias_kv=False")
  if m.add_zero_attn:
    raise ctx.bad_attribute(m, "add_zero_attn", True, "False")
  if m.training and m.dropout > 0:
    raise ctx.bad_attribute(
      m, "training", True, "eval mode or dropout=0.0 (call model.eval() first)"
    )
  if (m.in_proj_bias is None) != (m.out_proj.bias is None):
    raise ctx.bad_attribute(
      m, "out_proj.bias", "<mismatch>", "in_proj and out_proj both with or without bias"
    )
  width = m.embed_dim
  # torch packs [q; k; v] row blocks into in_proj; split into three Denses.
  projections, params = {}, {}
  for i, name in enumerate(("q_proj", "k_proj", "v_proj")):
    rows = slice(i * width, (i + 1) * width)
    projections[name] = nn.Dense(
      width,
      use_bias=m.in_proj_bias is not None,
      param_dtype=ctx.param_dtype(m.in_proj_weight),
      precision=_PRECISION,
    )
    params[name] = {"kernel": ctx.array(m.in_proj_weight[rows], transpose=(1, 0))}
    if m.in_proj_bias is not None:
      params[name]["bias"] = ctx.array(m.in_proj_bias[rows])
  out_proj = _convert(m.out_proj, ctx.child("out_proj"))
  module = FlaxCausalSelfAttention(num_heads=m.num_heads, out_proj=out_proj.module, **projections)
  out = _Converted(module, params, {"": ""})
  out.adopt("out_proj", "out_proj", out_proj)
  return out


def _convert_gpt_block(m: GPTBlock, ctx: _Context) -> _Converted:
  if not isinstance(m.attn, torch.nn.MultiheadAttention):
    raise ctx.child("attn").error(
      m.attn, "unsupported_module", "GPTBlock.attn must be an nn.MultiheadAttention"
    )
  parts = {
    "ln1": _convert(m.ln1, ctx.child("ln1")),
    "attn": _convert(m.attn, ctx.child("attn"), _convert_causal_self_attention),
    "ln2": _convert(m.ln2, ctx.child("ln2")),
    "mlp": _convert(m.mlp, ctx.child("mlp")),
  }
  out = _Converted(FlaxGPTBlock(**{k: v.module for k, v in parts.items()}), {}, {"": ""})
  for name, c in parts.items():
    out.adopt(name, name, c)
  return out


def _convert_tiny_gpt(m: TinyGPT, ctx: _Context) -> _Converted:
  if not isinstance(m.blocks, torch.nn.ModuleList):
    raise ctx.bad_attribute(m, "blocks", type(m.blocks).__name__, "an nn.ModuleList")
  # The ModuleList is never called by torch, so it gets no site of its own.
  ctx.seen[id(m.blocks)] = ctx.child("blocks").name
  parts = {
    "tok_emb": ("tok_emb", _convert(m.tok_emb, ctx.child("tok_emb"))),
    "pos_emb": ("pos_emb", _convert(m.pos_emb, ctx.child("pos_emb"))),
  }
  for i, (name, block) in enumerate(m.blocks._modules.items()):
    parts[f"blocks_{i}"] = (f"blocks.{name}", _convert(block, ctx.child(f"blocks.{name}")))
  parts["ln_f"] = ("ln_f", _convert(m.ln_f, ctx.child("ln_f")))
  parts["head"] = ("head", _convert(m.head, ctx.child("head")))
  module = FlaxTinyGPT(
    tok_emb=parts["tok_emb"][1].module,
    pos_emb=parts["pos_emb"][1].module,
    blocks=[c.module for k, (_, c) in parts.items() if k.startswith("blocks_")],
    ln_f=parts["ln_f"][1].module,
    head=parts["head"][1].module,
    max_len=int(m.max_len),
  )
  out = _Converted(module, {}, {"": ""})
  for flax_name, (torch_name, c) in parts.items():
    out.adopt(torch_name, flax_name, c)
  return out


_WEIGHT_BIAS = ("weight", "bias")
_CONV = ("in_channels", "out_channels", "kernel_size", "stride", "padding", "dilation", "groups",
         "padding_mode", "transposed", "output_padding")  # fmt: skip
_MHA = ("embed_dim", "kdim", "vdim", "num_heads", "head_dim", "dropout", "batch_first", "bias_k",
        "bias_v", "add_zero_attn")  # fmt: skip
_MHA_PARAMETERS = ("in_proj_weight", "in_proj_bias", "q_proj_weight", "k_proj_weight",
                   "v_proj_weight", "bias_k", "bias_v")  # fmt: skip
_EMBEDDING = ("num_embeddings", "embedding_dim", "padding_idx", "max_norm", "norm_type",
              "scale_grad_by_freq", "sparse")  # fmt: skip

# Registry: torch type -> its converter and the attributes, parameters and
# children that converter handles. This order is the one error messages list.
_REGISTRY: dict[type, _Spec] = {
  torch.nn.Linear: _Spec(_convert_linear, ("in_features", "out_features"), _WEIGHT_BIAS),
  torch.nn.Sequential: _Spec(_convert_sequential, children=None),
  torch.nn.ReLU: _Spec(_activation("relu"), ("inplace",)),
  torch.nn.GELU: _Spec(_convert_gelu, ("approximate",)),
  torch.nn.Tanh: _Spec(_activation("tanh")),
  torch.nn.Sigmoid: _Spec(_activation("sigmoid")),
  torch.nn.SiLU: _Spec(_activation("silu"), ("inplace",)),
  torch.nn.Identity: _Spec(_convert_identity),
  torch.nn.Dropout: _Spec(_convert_dropout, ("p", "inplace")),
  torch.nn.LayerNorm: _Spec(
    _convert_layer_norm, ("normalized_shape", "eps", "elementwise_affine"), _WEIGHT_BIAS
  ),
  torch.nn.Embedding: _Spec(_convert_embedding, _EMBEDDING, ("weight",)),
  torch.nn.Conv1d: _Spec(_convert_conv, _CONV, _WEIGHT_BIAS),
  torch.nn.Conv2d: _Spec(_convert_conv, _CONV, _WEIGHT_BIAS),
  torch.nn.Conv3d: _Spec(_convert_conv, _CONV, _WEIGHT_BIAS),
  torch.nn.MultiheadAttention: _Spec(
    _reject_multihead_attention, _MHA, _MHA_PARAMETERS, children=("out_proj",)
  ),
  GPTBlock: _Spec(
    _convert_gpt_block, ("d_model", "n_heads", "mlp_ratio"), children=("ln1", "attn", "ln2", "mlp")
  ),
  TinyGPT: _Spec(
    _convert_tiny_gpt,
    ("vocab", "d_model", "n_heads", "n_layers", "max_len", "mlp_ratio"),
    children=("tok_emb", "pos_emb", "blocks", "ln_f", "head"),
  ),
}


def from_torch(
  module: torch.nn.Module, *, dtype: Any = None
) -> tuple[nn.Module, dict[str, Any], dict[str, str]]:
  """Converts a torch module into an equivalent Flax linen module.

  Supported: ``Linear``, ``Sequential`` (nested; empty is the identity),
  ``ReLU``, ``GELU`` ('none'/'tanh'), ``Tanh``, ``Sigmoid``, ``SiLU``,
  ``Identity``, ``Dropout`` (eval mode only), ``LayerNorm`` (any eps,
  affine or not, with or without bias), ``Embedding`` (``max_norm=None``),
  ``Conv1d/2d/3d`` (zeros padding mode; int, tuple, 'same' or 'valid'
  padding; any stride, dilation, groups, bias), and the reference
  :class:`GPTBlock` / :class:`TinyGPT`. ``nn.MultiheadAttention`` is
  supported only as ``GPTBlock.attn`` (batch_first, packed in-projection,
  no bias_kv, no zero_attn, no dropout in training mode); standalone it
  raises ``unsupported_module``. Subclasses of these types are accepted
  only if they keep the stock ``forward``.

  Args:
    module: The torch model. Its weights are copied, not shared.
    dtype: Parameter dtype of the result (e.g. ``jnp.float32`` or
      ``torch.float64``); None keeps each torch parameter's dtype.
      float64 needs ``jax_enable_x64``.

  Returns:
    ``(flax_module, variables, site_map)``: the unbound linen module,
    ``{"params": ...}`` for ``flax_module.apply``, and a dict from each
    torch module name (as in ``module.named_modules()``; ``""`` is the
    root) to the "/"-joined Flax path of the linen module computing the
    same output (``""`` is the root). ``nn.ModuleList`` containers, which
    torch never calls, have no entry. For ``attn.out_proj`` (whose
    forward torch skips, so its hooks never fire) the Flax module's
    output equals the ``attn`` output.

  Raises:
    ConversionError: For unsupported modules, attribute values, shared
      module instances or dtypes; see ``ConversionError.fields``.
    TypeError: If ``module`` is not a ``torch.nn.Module``.
  """
  if not isinstance(module, torch.nn.Module):
    raise TypeError(f"from_torch expects a torch.nn.Module, got {type(module).__name__}")
  ctx = _Context("", target_dtype(module, dtype), {})
  converted = _convert(module, ctx)
  return converted.module, {"params": converted.params}, converted.sites


def handles(module: torch.nn.Module, *, dtype: Any = None) -> bool:
  """Whether the fast path converts ``module``: each module's type, state and attribute values
  are ones its converters handle, no instance is used twice, the dtype is usable. The
  converters run on shapes only: no parameter is copied."""
  try:
    _convert(module, _Context("", target_dtype(module, dtype), {}, copy=False))
  except ConversionError:
    return False
  return True
