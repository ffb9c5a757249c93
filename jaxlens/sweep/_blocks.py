"""The sweeps' engine for causal decoders: residual-stream patches replayed block by block, with
the layer as data.

A patch of the residual stream entering block ``j`` (``blocks_{j}/resid_pre``, or
``blocks_{j-1}/resid_post``: the same value) at position ``p`` changes nothing before block
``j``. A cell therefore starts from the corrupt run's stream entering block ``j`` with the clean
run's value at ``p`` and runs blocks ``j .. L-1`` (:meth:`jaxlens.protocol.Decoder.run_block`),
then the unembedding. The rows of a grid are a ``lax.map`` over their stream indices ``j``, and a
row's blocks a ``lax.fori_loop`` from ``j`` to ``L`` over the stacked block parameters of the
model's scanned form (:class:`jaxlens.protocol.Scannable`): the compiled program holds one block
and one unembedding whatever the number of layers, rows or cells, and each cell costs the blocks
after its layer only (the loop's start is data, not a mask). A :class:`Decoder` without a scanned
form runs the same rows with one ``lax.cond``-gated copy of each block.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxlens.core import module, trace
from jaxlens.protocol import Decoder, Scannable

__all__ = ["Runs", "residual_rows"]

RESIDUAL = ("resid_pre", "resid_post")


def residual_rows(model, sites) -> tuple[int, ...] | None:
  """The stream index of each site when ``model`` is a :class:`Decoder` and every site is a
  block's ``resid_pre`` (index ``k``) or ``resid_post`` (index ``k + 1``); else None."""
  if not isinstance(model, Decoder):
    return None
  n_layers = len(model.layer_sites())
  table = {
    model.block_site(k, name): k + (name == "resid_post")
    for name in RESIDUAL
    for k in range(n_layers)
  }
  rows = tuple(table.get(s) for s in sites)
  return None if None in rows else rows


class Runs:
  """The clean and corrupt runs of a causal decoder, and its blocks run from a layer on.

  Attributes:
    stream: the corrupt run's residual stream entering each block and leaving the last,
      ``(L + 1, batch, seq, d)``; ``donor``: the clean run's, the same shape.
    keys, values: the corrupt run's ``attn/k``, ``attn/v`` of every block, stacked.
    logits: the corrupt run's output.
  """

  def __init__(self, model, variables, clean, corrupt):
    self.n_layers = len(model.layer_sites())
    form = model.scanned(variables) if isinstance(model, Scannable) else None
    self.loop = form is not None
    given = model, variables
    if self.loop:
      model, variables = form
    self.model, self.variables = model, variables
    # The two runs below go through the unrolled form (when given it) if any weight is
    # bfloat16: nn.scan slices the stacked weights with a dynamic slice, which XLA:CPU computes
    # in float32 after widening the whole stack (a float32 copy of every block's weights,
    # twice their bfloat16 bytes); the block loop reads its layers without it
    # (jaxlens.models.scan.layer_of).
    scan_runs = self.loop and not (
      given[0] is not model
      and any(jnp.dtype(a.dtype) == jnp.bfloat16 for a in jax.tree.leaves(given[1]))
    )
    names = ("resid_pre", "attn/k", "attn/v")
    last = self.n_layers - 1
    batch = corrupt.shape[0]
    # One forward over the corrupt and the clean rows together: one copy of the model in the
    # compiled program instead of two (the clean rows' keys and values go unused).
    both = jnp.concatenate([corrupt, clean])
    if scan_runs:
      stacked = {n: module(model.stack_site(n)) for n in names}
      final = module(model.stack_site("resid_post"), layer=last)
      t = trace(model, variables, both, keep_inputs=False, save=[*stacked.values(), final])

      def read(name):
        return t[stacked[name]].out

      def read_final():
        return t[final].out

    else:
      at = given[0].block_site
      t = trace(
        given[0],
        given[1],
        both,
        keep_inputs=False,
        save=[module(at(j, n)) for j in range(self.n_layers) for n in names]
        + [module(at(last, "resid_post"))],
      )

      def read(name):
        return jnp.stack([t[at(j, name)].out for j in range(self.n_layers)])

      def read_final():
        return t[at(last, "resid_post")].out

    stream = jnp.concatenate([read("resid_pre"), read_final()[None]])
    self.stream, self.donor = stream[:, :batch], stream[:, batch:]
    self.keys, self.values = read("attn/k")[:, :batch], read("attn/v")[:, :batch]
    self.logits = t.output[:batch]

  def run_from(self, start, x, positions, mask, past: int):
    """Blocks ``start .. L-1`` on ``x`` (``start`` an int32 scalar, possibly traced); each
    block's attention sees the corrupt run's first ``past`` keys and values, then ``x``'s,
    as ``mask`` allows."""

    def past_of(stacked, j):
      # x may hold several cells' sequences for each of the runs' (cell-major)
      a = stacked[j][:, :past]
      return jnp.tile(a, (x.shape[0] // a.shape[0],) + (1,) * (a.ndim - 1))

    def block(j, x):
      return self.model.run_block(
        self.variables,
        j,
        x,
        positions,
        past_keys=past_of(self.keys, j),
        past_values=past_of(self.values, j),
        mask=mask,
      )

    if self.loop:
      return jax.lax.fori_loop(start, self.n_layers, block, x)
    for j in range(self.n_layers):
      x = jax.lax.cond(j >= start, lambda x, j=j: block(j, x), lambda x: x, x)
    return x

  def unembed(self, x):
    """The logits of the stream ``x`` leaving the last block."""
    return self.model.unembed(self.variables, x)
