"""The local replacement model of a prompt: a zoo decoder with every norm's scale, every
attention pattern and every MLP output (but a transcoder's skip term) held at their values on
the prompt, so that the residual stream is affine in the graph's nodes.

Freezing is done by value, with flax's ``nn.intercept_methods`` around the zoo's own modules
(no change to the zoo): :func:`record` runs the model once and keeps the frozen values;
:func:`frozen_forward` runs it again with them substituted, taking the token embeddings and
each layer's MLP write as inputs. On the prompt the two agree to rounding; away from it the
frozen model is the replacement model, whose gradient is the gradient under circuit-tracer's
``stop_gradient`` freezes and whose finite interventions are exact edges.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxlens.circuits._errors import CircuitError
from jaxlens.models.blocks import RMSNorm
from jaxlens.models.gemma import GemmaRMSNorm
from jaxlens.models.gpt_neox import LayerNorm

__all__ = ["Recording", "frozen_forward", "record", "stop_gradient_freeze"]

# The zoo's norms (GPT-2's FlaxLayerNorm is a flax.linen.LayerNorm).
_NORMS = (RMSNorm, LayerNorm, GemmaRMSNorm, nn.LayerNorm)
_BLOCK = re.compile(r"^blocks_(\d+)$")


def softmax_dtype(dtype):
  # The zoo's norms compute their statistics in at least float32.
  return jnp.dtype(dtype) if jnp.dtype(dtype).itemsize >= 4 else jnp.dtype(jnp.float32)


def _centred(module, x):
  """``(h, centred)``: ``x`` in the norm's statistics dtype, minus its mean for a LayerNorm."""
  dtype = getattr(module, "dtype", None) or x.dtype
  h = x.astype(softmax_dtype(dtype))
  if isinstance(module, (LayerNorm, nn.LayerNorm)):
    return h, h - jnp.mean(h, axis=-1, keepdims=True)
  return h, h


def norm_scale(module, x):
  """The norm's per-position scale ``1 / sqrt(var + eps)``, ``(..., 1)``."""
  _, c = _centred(module, x)
  eps = module.epsilon if isinstance(module, nn.LayerNorm) else module.eps
  return jax.lax.rsqrt(jnp.mean(c * c, axis=-1, keepdims=True) + eps)


def frozen_norm(module, x, scale):
  """The norm of ``x`` with its scale given (affine in ``x``), as the module computes it."""
  _, c = _centred(module, x)
  params = module.variables.get("params", {})
  h = c * scale.astype(c.dtype)
  if isinstance(module, GemmaRMSNorm):
    return (h * (1.0 + params["weight"].astype(h.dtype))).astype(module.dtype)
  if isinstance(module, RMSNorm):
    return params["weight"] * h.astype(module.dtype)
  if isinstance(module, LayerNorm):
    out = h * params["scale"].astype(h.dtype) + params["bias"].astype(h.dtype)
    return out.astype(module.dtype)
  # flax.linen.LayerNorm
  if module.use_scale:
    h = h * params["scale"].astype(h.dtype)
  if module.use_bias:
    h = h + params["bias"].astype(h.dtype)
  return h.astype(module.dtype or x.dtype)


def _path(context) -> str:
  return "/".join(context.module.path)


def _layer_of(path: str, leaf: str) -> int | None:
  parts = path.split("/")
  if len(parts) == 2 and parts[1] == leaf:
    m = _BLOCK.match(parts[0])
    if m:
      return int(m.group(1))
  return None


@dataclasses.dataclass
class Recording:
  """The values of one run that the replacement model holds (arrays of the model's run).

  Attributes:
    scales: norm path -> its scale ``(batch, seq, ..., 1)``.
    patterns: attention pattern path -> the pattern.
    mlp_in: per layer, the MLP's input ``(batch, seq, d)``.
    mlp_out: per layer, the site ``mlp_out`` (after any post-norm).
    resid0: ``blocks_0/resid_pre``.
    pos: the learned position embeddings added to it (GPT-2), or None.
    final: the final norm's output.
    logits: the model's logits.
  """

  scales: dict
  patterns: dict
  mlp_in: dict
  mlp_out: dict
  resid0: Any = None
  pos: Any = None
  final: Any = None
  logits: Any = None


jax.tree_util.register_dataclass(
  Recording,
  data_fields=["scales", "patterns", "mlp_in", "mlp_out", "resid0", "pos", "final", "logits"],
  meta_fields=[],
)


def record(model, variables, tokens) -> Recording:
  """Runs ``model`` on ``tokens`` and keeps what the replacement model freezes.

  Raises:
    CircuitError: ``circuit_unsupported_model`` for a model without the zoo's sites (scanned
      layers, no ``blocks_0/resid_pre``, ``ln_final`` or per-layer ``mlp``).
  """
  rec = Recording({}, {}, {}, {})

  def intercept(next_fun, args, kwargs, context):
    if context.method_name != "__call__":
      return next_fun(*args, **kwargs)
    path = _path(context)
    module = context.module
    if isinstance(module, _NORMS):
      out = next_fun(*args, **kwargs)
      rec.scales[path] = norm_scale(module, args[0])
      if path == "ln_final":
        rec.final = out
      return out
    out = next_fun(*args, **kwargs)
    if path.endswith("attn/pattern"):
      rec.patterns[path] = out
    elif path == "blocks_0/resid_pre":
      rec.resid0 = out
    elif path == "pos_embed":
      rec.pos = out
    elif (i := _layer_of(path, "mlp")) is not None:
      rec.mlp_in[i] = args[0]
    elif (i := _layer_of(path, "mlp_out")) is not None:
      rec.mlp_out[i] = out
    return out

  with nn.intercept_methods(intercept):
    rec.logits = model.apply(variables, tokens)
  n = model.config.n_layers
  if (
    rec.resid0 is None
    or rec.final is None
    or sorted(rec.mlp_in) != list(range(n))
    or sorted(rec.mlp_out) != list(range(n))
  ):
    raise CircuitError(
      f"{type(model).__name__} does not name the sites an attribution graph freezes "
      "(blocks_0/resid_pre, blocks_{i}/mlp and mlp_out per layer, ln_final)",
      code="circuit_unsupported_model",
      received=type(model).__name__,
      fix="a decoder of jaxlens.models with scan_layers=False",
    )
  return rec


def frozen_forward(model, variables, tokens, rec: Recording, skip, const):
  """The replacement model: ``(tok, writes) -> (mlp_in, final)``.

  ``tok`` ``(seq, d)`` is the token embeddings (``resid0 = tok + pos``), ``writes`` ``(L,
  seq, d)`` what the nodes write to each MLP output; ``mlp_out[l] = writes[l] + skip(l,
  mlp_in[l]) + const[l]``. Every norm runs with its recorded scale and every attention
  pattern is the recorded one, so both outputs (each layer's MLP input ``(L, seq, d_in)`` and
  the final norm's output ``(seq, d)``) are affine in ``(tok, writes)``. Batch 1.

  ``run(tok, writes, upto=l)`` returns only the MLP inputs of layers ``0 .. l`` ``(l + 1,
  seq, d_in)``: nothing after them is an output, so a VJP of it (under ``jit``) runs no
  backward through the later layers, and ``writes`` needs only layers ``0 .. l - 1``.
  """
  pos = 0 if rec.pos is None else rec.pos[0]

  def run(tok, writes, upto=None):
    got: dict = {"mlp_in": {}}

    def intercept(next_fun, args, kwargs, context):
      if context.method_name != "__call__":
        return next_fun(*args, **kwargs)
      path = _path(context)
      module = context.module
      if isinstance(module, _NORMS):
        out = frozen_norm(module, args[0], rec.scales[path])
        if path == "ln_final":
          got["final"] = out
        return out
      if path in rec.patterns:
        return rec.patterns[path]
      if path == "blocks_0/resid_pre":
        return (tok + pos)[None].astype(args[0].dtype)
      if (i := _layer_of(path, "mlp")) is not None:
        got["mlp_in"][i] = args[0]
        return jnp.zeros_like(args[0], shape=rec.mlp_out[i].shape)
      if (i := _layer_of(path, "mlp_out")) is not None:
        x = got["mlp_in"][i][0]
        if i >= len(writes):  # after the last layer asked for (``upto``): not an output
          return jnp.zeros_like(args[0])
        out = writes[i] + skip(i, x) + const[i]
        return out[None].astype(args[0].dtype)
      return next_fun(*args, **kwargs)

    with nn.intercept_methods(intercept):
      model.apply(variables, tokens)
    if upto is not None:
      return jnp.stack([got["mlp_in"][i][0] for i in range(upto + 1)])
    n = len(got["mlp_in"])
    return jnp.stack([got["mlp_in"][i][0] for i in range(n)]), got["final"][0]

  return run


def stop_gradient_freeze(rep=None):
  """An interceptor (for ``flax.linen.intercept_methods``) that freezes by gradient instead of
  by value, as circuit-tracer does: every norm's scale and every attention pattern under
  ``jax.lax.stop_gradient`` and, given a :class:`~jaxlens.circuits.Replacement`, each MLP
  output replaced by ``recon + stop_gradient(mlp_out - recon)`` where ``recon`` is the
  transcoder's output from its activations under ``stop_gradient`` (its skip term live). The
  forward is the model's own (to rounding); only derivatives change, so a gradient through a
  model run under it is a direct effect in the local replacement model.

  Example:
    >>> import flax.linen as nn
    >>> from jaxlens import circuits
    >>> with nn.intercept_methods(circuits.stop_gradient_freeze()):
    ...   pass  # model.apply(...) and its jax.grad here see the frozen derivatives
  """
  got: dict = {"x": {}, "acts": {}}

  def intercept(next_fun, args, kwargs, context):
    if context.method_name != "__call__":
      return next_fun(*args, **kwargs)
    module = context.module
    path = _path(context)
    if isinstance(module, _NORMS):
      x = args[0]
      return frozen_norm(module, x, jax.lax.stop_gradient(norm_scale(module, x)))
    out = next_fun(*args, **kwargs)
    if path.endswith("attn/pattern"):
      return jax.lax.stop_gradient(out)
    if rep is not None and (i := _layer_of(path, "mlp")) is not None:
      x = args[0]
      got["x"][i] = x
      got["acts"][i] = jax.lax.stop_gradient(rep.encoders[i](x).astype(x.dtype))
    elif rep is not None and (i := _layer_of(path, "mlp_out")) is not None:
      recon = rep.b_dec[i] + rep.skip(i, got["x"][i])
      for source in range(i + 1):
        if i - source < rep.W_dec[source].shape[0]:
          recon = recon + got["acts"][source] @ rep.W_dec[source][i - source]
      recon = recon.astype(out.dtype)
      return recon + jax.lax.stop_gradient(out - recon)
    return out

  return intercept
