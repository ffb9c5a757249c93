"""Compatibility names: the converter now lives in :mod:`torch_bridge.convert`."""

from torch_bridge.convert import ConversionError, from_torch, to_jax, to_torch  # noqa: F401
from torch_bridge.convert._layers import (  # noqa: F401
  FlaxActivation,
  FlaxCausalSelfAttention,
  FlaxConv,
  FlaxGPTBlock,
  FlaxIdentity,
  FlaxLayerNorm,
  FlaxTinyGPT,
  GPTBlock,
  TinyGPT,
)
