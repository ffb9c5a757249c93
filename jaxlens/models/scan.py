"""The scanned form of the zoo's decoders: one block traced and compiled once, run over stacked
parameters with ``nn.scan``.

``LlamaConfig(..., scan_layers=True)`` (or ``GPT2Config``) builds the same model with its blocks
in one ``nn.scan``: one block is traced and compiled whatever the depth, so the first call of a
30-layer model compiles one block instead of thirty. The parameters of block ``k`` are slice
``k`` of ``params["blocks"]`` (each leaf gains a leading layer axis), the KV cache likewise, and
the sites keep their names with ``layer=``: ``jl.module("blocks/resid_post", layer=3)`` is the
unrolled form's ``blocks_3/resid_post`` (``docs/models.md``). A trace saving
``jl.module("blocks/resid_post")`` holds all layers stacked, ``(n_layers, batch, seq, d)``.

The two forms compute the same numbers; :func:`stack_blocks` and :func:`unstack_blocks` convert
variables between them (``jm.smollm2()`` loads the unrolled form).

Example:
  >>> import dataclasses, jax, jax.numpy as jnp, jaxlens as jl
  >>> from jaxlens.models import Llama, LlamaConfig, scan
  >>> cfg = LlamaConfig(vocab_size=32, d_model=16, n_layers=3, n_heads=2, n_kv_heads=1, d_mlp=24)
  >>> tokens = jnp.arange(5)[None]
  >>> unrolled = Llama(cfg).init(jax.random.key(0), tokens)
  >>> scanned = Llama(dataclasses.replace(cfg, scan_layers=True))
  >>> variables = scan.stack_blocks(unrolled, cfg.n_layers)
  >>> t = jl.trace(scanned, variables, tokens, save=jl.module("blocks/resid_post", layer=1))
  >>> t[jl.module("blocks/resid_post", layer=1)].out.shape
  (1, 5, 16)
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxlens.core import InvalidArgumentError

__all__ = ["ScanForm", "scan_blocks", "stack_blocks", "uniform_window", "unstack_blocks"]


def uniform_window(config):
  """The one sliding window of every layer of ``config`` (None for full attention).

  Raises:
    InvalidArgumentError: ``invalid_argument`` when layers differ (a scan runs one block).
  """
  windows = {config.window(i) for i in range(config.n_layers)}
  if len(windows) > 1:
    raise InvalidArgumentError(
      f"scan_layers runs one block for every layer, but the layers' sliding windows differ "
      f"({sorted(windows, key=str)})",
      code="invalid_argument",
      fix="scan_layers=False for models that mix local and global layers",
    )
  return windows.pop()


def scan_blocks(block: nn.Module, n_layers: int, x, *args):
  """Runs ``block`` (a linen block named ``"blocks"``, called as ``block(x, *args) -> x``)
  ``n_layers`` times over stacked ``params`` and ``cache``; ``args`` are the same for every
  layer."""

  def body(module, carry):
    # The arguments are closed over (the same in every layer; ``decode`` stays a Python bool).
    return module(carry, *args), None

  stack = nn.scan(
    body,
    variable_axes={"params": 0, "cache": 0},
    split_rngs={"params": True},
    length=n_layers,
  )
  return stack(block, x)[0]


def _layers_of(variables):
  names = [k for k in variables.get("params", {}) if k.startswith("blocks_")]
  return sorted(names, key=lambda k: int(k.split("_")[1]))


def stack_blocks(variables, n_layers: int):
  """The scanned form's variables from the unrolled form's: ``blocks_0 .. blocks_{n-1}`` of each
  collection (``params``, ``cache``) stacked into ``blocks`` along a new leading axis.

  Raises:
    InvalidArgumentError: ``invalid_argument`` when the variables do not hold exactly the
      blocks ``blocks_0 .. blocks_{n_layers - 1}``.
  """
  names = _layers_of(variables)
  if names != [f"blocks_{i}" for i in range(n_layers)]:
    raise InvalidArgumentError(
      f"stack_blocks needs the params of blocks_0 .. blocks_{n_layers - 1}, found "
      f"{names[:4]}{'...' if len(names) > 4 else ''}",
      code="invalid_argument",
      fix="pass the unrolled model's variables and its config.n_layers",
    )
  out = {}
  for collection, tree in variables.items():
    tree = dict(tree)
    blocks = [tree.pop(f"blocks_{i}") for i in range(n_layers) if f"blocks_{i}" in tree]
    if blocks:
      tree["blocks"] = jax.tree.map(lambda *a: _stack(a), *blocks)
    out[collection] = tree
  return out


def unstack_blocks(variables):
  """The unrolled form's variables from the scanned form's: slice ``k`` of ``blocks`` of each
  collection becomes ``blocks_k``."""
  out = {}
  for collection, tree in variables.items():
    tree = dict(tree)
    stacked = tree.pop("blocks", None)
    if stacked is not None:
      n = jax.tree.leaves(stacked)[0].shape[0]
      for i in range(n):
        tree[f"blocks_{i}"] = jax.tree.map(lambda a, i=i: a[i], stacked)
    out[collection] = tree
  return out


@jax.custom_jvp
def _stack_bits(arrays):
  bits = jnp.stack([jax.lax.bitcast_convert_type(a, jnp.uint16) for a in arrays])
  return jax.lax.bitcast_convert_type(bits, arrays[0].dtype)


@_stack_bits.defjvp
def _stack_bits_jvp(primals, tangents):
  return _stack_bits(primals[0]), jnp.stack(tangents[0])


def _stack(arrays):
  """``jnp.stack(arrays)``; bfloat16 arrays are stacked as their bits (uint16): XLA:CPU
  concatenates bfloat16 arrays in float32 (a float32 copy of the whole stack)."""
  if jnp.dtype(arrays[0].dtype) == jnp.bfloat16:
    return _stack_bits(tuple(arrays))
  return jnp.stack(arrays)


@jax.custom_jvp
def _layer_of_bits(stacked, layer):
  bits = jax.lax.bitcast_convert_type(stacked, jnp.uint16)
  one = jax.lax.dynamic_index_in_dim(bits, layer, keepdims=False)
  return jax.lax.bitcast_convert_type(one, stacked.dtype)


@_layer_of_bits.defjvp
def _layer_of_bits_jvp(primals, tangents):
  stacked, layer = primals
  return _layer_of_bits(stacked, layer), jax.lax.dynamic_index_in_dim(
    tangents[0], layer, keepdims=False
  )


def layer_of(stacked, layer):
  """Slice ``layer`` (an int or a traced int scalar) of a stacked array.

  A bfloat16 array is sliced as its bits (uint16): XLA:CPU computes a dynamic slice of a
  bfloat16 array in float32, and in a loop over the layers it widens the whole stack once,
  before the loop (a float32 copy of every stacked weight: twice the bfloat16 weights).
  """
  if jnp.dtype(stacked.dtype) == jnp.bfloat16:
    return _layer_of_bits(stacked, layer)
  return jax.lax.dynamic_index_in_dim(stacked, layer, keepdims=False)


class ScanForm:
  """:class:`jaxlens.protocol.Scannable` for a zoo decoder with a ``config.scan_layers`` option
  (a mixin of ``Llama`` and ``GPT2``, next to ``LayerSites``): the sweeps run its blocks as one
  loop over stacked parameters with the layer index as data."""

  @nn.nowrap
  def scanned(self, variables):
    """This model in its scanned form and ``variables`` in that form (both unchanged when the
    model is scanned already), or None when its layers differ (mixed sliding windows)."""
    cfg = self.config
    if cfg.scan_layers:
      return self, variables
    if hasattr(cfg, "window"):
      try:
        uniform_window(cfg)
      except InvalidArgumentError:
        return None
    model = type(self)(dataclasses.replace(cfg, scan_layers=True))
    return model, stack_blocks(variables, cfg.n_layers)

  @nn.nowrap
  def stack_site(self, name: str) -> str:
    """The scanned form's label of the site ``name`` of every block at once (its value stacks
    the layers along axis 0): ``f"blocks/{name}"``."""
    return f"blocks/{name}"

  @nn.nowrap
  def block_params(self, variables, layer):
    """The params of block ``layer``: ``blocks_{layer}`` of the unrolled form (a Python int), or
    slice ``layer`` (an int or a traced int scalar) of the scanned form's ``blocks``."""
    params = variables["params"]
    if not self.config.scan_layers:
      return params[f"blocks_{layer}"]
    return jax.tree.map(lambda a: layer_of(a, layer), params["blocks"])

  @nn.nowrap
  def block_window(self, layer):
    """The sliding window of block ``layer`` (the scanned form: the one window of every block)."""
    cfg = self.config
    return uniform_window(cfg) if cfg.scan_layers else cfg.window(layer)
