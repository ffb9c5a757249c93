"""jaxlens.lens patchscopes: the grid in one program equals one patched forward per cell, an
identity patch changes nothing, and the generation-based patchscope holds its patch."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxlens as jl
from _lens_models import build
from jaxlens import lens

SOURCE = jnp.asarray([[3, 9, 4, 17, 5, 9], [1, 2, 3, 4, 5, 6]], jnp.int32)
TARGET = jnp.asarray([[7, 8, 9, 10]], jnp.int32)


@pytest.fixture(scope="module")
def model():
  return build("llama_tied")


def test_grid_equals_one_patched_forward_per_cell(model):
  model, variables = model
  layers = [0, 2]
  grid = lens.patchscope(
    model,
    variables,
    SOURCE,
    TARGET,
    source_position=2,
    target_position=1,
    source_layers=layers,
    target_layers=layers,
  )
  assert grid.shape == (2, 2, 2, 50)
  res = jax.jit(lambda v: lens.residuals(model, v, SOURCE, layers=layers))(variables)[:, :, 2]
  sites = lens.lens_sites(model)
  target = jnp.broadcast_to(TARGET, (2, 4))
  for i, j in [(1, 0), (0, 1)]:
    edit = jl.at_positions(jnp.asarray([1]), jl.replace_with(res[i][:, None]))
    patched = jax.jit(jl.when(jl.label(sites[layers[j]]), edit).bind(model))
    np.testing.assert_allclose(grid[i, j], patched(variables, target)[:, 1], rtol=1e-10, atol=1e-10)
  assert float(jnp.abs(grid[0, 0] - grid[1, 0]).max()) > 1e-3


def test_blocks_from_the_target_layer_on_equal_the_full_patched_forward():
  """A Gemma 2 layout (mixed sliding windows: no scanned form, one cond-gated copy of each
  block): the grid, which reruns only the blocks from each target layer on and the positions
  from the patched one on, equals full patched forwards (the generic program), for a read
  position after the patch and before it."""
  from jaxlens.lens import _patchscope

  model, variables = build("gemma2")
  target = jnp.asarray([[7, 8, 9, 10, 11, 12]] * 2, jnp.int32)
  vectors = lens.residuals(model, variables, SOURCE, layers=[1])[:, :, 2]
  for read_position in (4, 1):
    grid = lens.patchscope(
      model, variables, SOURCE, target[:1], source_position=2, target_position=2,
      source_layers=[1], read_position=read_position,
    )  # fmt: skip
    full = _patchscope._grid(
      model, variables, target, vectors, jnp.arange(3, dtype=jnp.int32), tgt_layers=(0, 1, 2),
      tpos=2, rpos=read_position, read=_patchscope._identity,
    )  # fmt: skip
    np.testing.assert_allclose(grid, full, rtol=1e-10, atol=1e-10)
  assert float(jnp.abs(grid[0, 0] - grid[0, 1]).max()) == 0.0  # the read precedes the patch


def test_identity_patch_changes_nothing(model):
  model, variables = model
  grid = lens.patchscope(
    model, variables, SOURCE, SOURCE, source_position=3, target_position=3, target_layers=[1]
  )
  logits = jax.jit(model.apply)(variables, SOURCE)[:, 3]
  np.testing.assert_allclose(grid[1, 0], logits, rtol=1e-10, atol=1e-10)


def test_one_program_whatever_the_grid():
  """The compiled grid holds one forward: its equation count does not grow with the grid."""
  from _jaxprs import equations

  model, variables = build("llama")

  def count(layers):
    fn = lambda v: lens.patchscope(  # noqa: E731
      model, v, SOURCE, TARGET, source_layers=layers, target_layers=[0, 1]
    )
    eqns = equations(jax.make_jaxpr(fn)(variables).jaxpr)
    return sum(1 for e in eqns if e.primitive.name == "dot_general")

  assert count([0]) == count([0, 1, 2]) > 0


def test_generation_holds_the_patch(model):
  model, variables = model
  gen = lens.patchscope_generate(
    model,
    variables,
    SOURCE[:1],
    TARGET,
    3,
    source_position=2,
    target_position=2,
    source_layers=[1, 2],
    target_layers=[1],
  )
  assert gen.tokens.shape == (2, 1, 1, 3)
  res = lens.residuals(model, variables, SOURCE[:1], layers=[2])[0][:, 2]
  site = lens.lens_sites(model)[1]
  edit = jl.when(jl.label(site), jl.at_positions(jnp.asarray([2]), jl.replace_with(res[:, None])))
  want = jl.generate(model, variables, TARGET, 3, prefill=edit)
  np.testing.assert_array_equal(gen.tokens[1, 0], want.tokens)
  # the patch is in the prefill's cache: another source layer's patch continues differently
  logits = gen.generation.logits  # rows: source layer 1, source layer 2
  assert float(jnp.abs(logits[0, 1:] - logits[1, 1:]).max()) > 1e-3


def test_bad_input():
  model, variables = build("llama")
  with pytest.raises(lens.LensError, match="target_position 4 is outside") as e:
    lens.patchscope(model, variables, SOURCE, TARGET, target_position=4)
  assert e.value.code == "index_out_of_range"
  with pytest.raises(lens.LensError, match="source_layers: layer 5"):
    lens.patchscope(model, variables, SOURCE, TARGET, source_layers=[5])
