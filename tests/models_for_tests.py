"""Small linen models the door and error tests share."""

import flax.linen as nn
import jax
import jax.numpy as jnp


class MLP(nn.Module):
  """block_i/mlp nesting, a shared module called twice, and an int-valued site."""

  @nn.compact
  def __call__(self, x):
    shared = nn.Dense(4, name="shared", param_dtype=jnp.float64)
    for i in range(2):
      x = Block(name=f"block_{i}")(x)
    x = shared(x)
    x = shared(jnp.tanh(x))
    return nn.Dense(2, name="head", param_dtype=jnp.float64)(x)


class Block(nn.Module):
  @nn.compact
  def __call__(self, x):
    return x + MLPPart(name="mlp")(x)


class MLPPart(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.Dense(4, name="fc", param_dtype=jnp.float64)(jnp.tanh(x))


class WithDetached(nn.Module):
  """A site whose value depends on no float input (site_has_no_graph)."""

  @nn.compact
  def __call__(self, x):
    frozen = Frozen(name="frozen")(x)
    return nn.Dense(2, name="head", param_dtype=jnp.float64)(x + frozen)


class Frozen(nn.Module):
  @nn.compact
  def __call__(self, x):
    return jax.lax.stop_gradient(nn.Dense(4, name="inner", param_dtype=jnp.float64)(x))


class WithIntSite(nn.Module):
  """A site of integer dtype and a site returning a tuple."""

  @nn.compact
  def __call__(self, x):
    idx = ArgMax(name="argmax")(x)
    pair = Pair(name="pair")(x)
    return nn.Dense(2, name="head", param_dtype=jnp.float64)(
      x + idx[:, None].astype(x.dtype) + pair[0]
    )


class ArgMax(nn.Module):
  @nn.compact
  def __call__(self, x):
    return jnp.argmax(x, axis=-1)


class Pair(nn.Module):
  @nn.compact
  def __call__(self, x):
    return x, x * 2


def init(model, x):
  return model.init(jax.random.key(0), x)
