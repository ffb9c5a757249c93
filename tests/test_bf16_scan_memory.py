"""A bfloat16 model's stacked weights stay bfloat16 in the compiled sweep: XLA:CPU computes a
concatenation and a dynamic slice of a bfloat16 array in float32, and in a loop over the layers
it widened the whole stack of every weight once, before the loop (a float32 copy of the block
weights: the patching sweep of Llama-3.2-1B in bfloat16 peaked at 3.3x its weights). The stack
is built and sliced as its bits (``jaxlens.models.scan.stack_blocks``, ``layer_of``) and the
sweep's two runs go through the unrolled form."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxlens.models import Llama, LlamaConfig
from jaxlens.models.scan import layer_of, stack_blocks
from jaxlens.sweep import _patching

L = 3  # not the number of cells (4), so a stack's shape is not a batch of cells'
CFG = LlamaConfig(
  vocab_size=64, d_model=32, n_layers=L, n_heads=4, n_kv_heads=2, d_mlp=64, max_len=8
)


def _metric(logits):
  return (logits[..., -1, 1] - logits[..., -1, 2]).sum()


@pytest.fixture(scope="module")
def bf16_sweep():
  """A bfloat16 Llama given unrolled, its inputs, and its patching sweep's compiled program."""
  model = Llama(dataclasses.replace(CFG, dtype=jnp.bfloat16))
  clean = jnp.arange(4, dtype=jnp.int32)[None] + 1
  variables = jax.jit(model.init)(jax.random.key(0), clean)
  variables = jax.tree.map(lambda a: a.astype(jnp.bfloat16), variables)
  corrupt = clean.at[0, 1].set(7)
  kw = dict(metric=_metric, sites=tuple(model.layer_sites()), positions=(0, 1, 2, 3))
  compiled = _patching._sweep.lower(
    model, variables, clean, corrupt, batch_size=None, **kw
  ).compile()
  return model, variables, clean, corrupt, kw, compiled


def _materialized(hlo: str):
  """The array types of the instructions outside fused computations (the buffers the program
  allocates; a fusion's inner values are not)."""
  out, fused = [], False
  for line in hlo.splitlines():
    if line.startswith("%") or line.startswith("ENTRY"):
      fused = line.startswith("%fused") or ".fused" in line.split("(")[0]
    elif not fused:
      m = re.match(r"\s+(?:ROOT )?%\S+ = (\w+\[[0-9,]*\])", line)
      if m:
        out.append(m.group(1))
  return out


def test_the_sweep_holds_no_float32_stack_of_a_weight(bf16_sweep):
  model, variables, *_, compiled = bf16_sweep
  kernels = {a.shape for a in jax.tree.leaves(variables["params"]["blocks_0"]) if jnp.ndim(a) == 2}
  stacks = {f"f32[{L},{a},{b}]" for a, b in kernels}
  hlo = compiled.as_text()
  buffers = _materialized(hlo)
  assert not stacks & set(buffers), sorted(stacks & set(buffers))
  assert any(b.startswith("u16[") for b in buffers)  # the stack, as its bits
  # Nor a stack concatenated in float32 inside a fusion (at this size XLA fuses it with its
  # consumer; at Llama-3.2-1B's it was a buffer of 1 GB a weight).
  concatenated = set(re.findall(r"= (f32\[[0-9,]+\])\S* concatenate\(", hlo))
  assert not stacks & concatenated, sorted(stacks & concatenated)


def test_the_bfloat16_sweep_equals_the_replayed_cells(bf16_sweep):
  model, variables, clean, corrupt, kw, compiled = bf16_sweep
  loop = compiled(variables, clean, corrupt)
  replay = _patching._sweep(model, variables, clean, corrupt, batch_size=None, replay=True, **kw)
  assert loop.dtype == jnp.bfloat16
  scale = float(jnp.abs(replay.astype(jnp.float32)).max())
  np.testing.assert_allclose(
    np.asarray(loop, np.float32), np.asarray(replay, np.float32), atol=0.05 * scale
  )


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_stacked_layers_slice_and_differentiate_like_jnp(dtype):
  rows = [jnp.arange(5, dtype=dtype) + 5 * i - 7 for i in range(3)]

  def stacked(rows):
    v = {"params": {f"blocks_{i}": {"w": r} for i, r in enumerate(rows)}}
    return stack_blocks(v, 3)["params"]["blocks"]["w"]

  got = jax.jit(stacked)(rows)
  assert got.dtype == jnp.dtype(dtype)
  np.testing.assert_array_equal(
    np.asarray(got, np.float32), np.asarray(jnp.stack(rows), np.float32)
  )
  layer = jnp.int32(2)
  one = jax.jit(layer_of)(got, layer)
  assert one.dtype == jnp.dtype(dtype)
  np.testing.assert_array_equal(np.asarray(one, np.float32), np.asarray(rows[2], np.float32))
  weights = jnp.arange(5, dtype=dtype)
  grads = jax.grad(lambda r: (layer_of(stacked(r), layer) * weights).sum().astype(jnp.float32))(
    rows
  )
  for i, g in enumerate(grads):
    np.testing.assert_array_equal(np.asarray(g, np.float32), np.arange(5) * (i == 2))
