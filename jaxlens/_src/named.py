"""Named values: a site for any intermediate value of a model.

A site is one call of a module; an identity module therefore makes any value a site,
named by the module's path, on every door (live interceptor, trace, replay, rerun,
saved specs) with no door knowing about it. This is jaxlens's counterpart of
TransformerLens's ``HookPoint`` and penzai's named values.
"""

from __future__ import annotations

import flax.linen as nn
from flax import nnx

__all__ = ["Named", "NamedNNX", "named"]


class Named(nn.Module):
  """An identity linen module: its call is a site whose value is its input.

  Use it as a submodule (``self.resid_pre = jl.Named()`` in ``setup``, or
  ``jl.Named(name="resid_pre")(x)`` in a compact method); its site is the module's
  path, ``"blocks_0/resid_pre"``.
  """

  def __call__(self, x):
    return x


class NamedNNX(nnx.Module):
  """An identity NNX module: ``self.resid_pre = jl.NamedNNX()`` makes ``blocks/0/resid_pre``."""

  def __call__(self, x):
    return x


def named(x, name: str):
  """Names ``x`` as the site ``<this module's path>/<name>`` and returns it unchanged.

  Call it inside a linen ``@nn.compact`` method (it creates a :class:`Named` submodule
  called ``name``). Without a door it costs nothing in a jitted function.

  Example:
    >>> import jax, jax.numpy as jnp, flax.linen as nn, jaxlens as jl
    >>> class Block(nn.Module):
    ...   @nn.compact
    ...   def __call__(self, x):
    ...     h = jl.named(jnp.tanh(nn.Dense(3, name="fc")(x)), "hidden")
    ...     return nn.Dense(2, name="out")(h)
    >>> x = jnp.ones((1, 3), jnp.float32)
    >>> variables = Block().init(jax.random.key(0), x)
    >>> t = jl.trace(Block(), variables, x, save=jl.module("hidden"))
    >>> t["hidden"].out.shape
    (1, 3)
  """
  return Named(name=name)(x)
