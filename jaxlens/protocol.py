"""What a model tells jaxlens's tools about itself (``jaxlens.protocol``).

The tools never ask a model what class it is: :func:`jaxlens.sweep.patching_sweep`,
:func:`jaxlens.sweep.cone_sweep` and :func:`jaxlens.generate` call the methods below, and a
model family implements them in its own file (``docs/models.md``, "Adding a model family").
Both protocols are structural (``typing.Protocol``): a linen module has them when it defines
the methods (marked ``@nn.nowrap``, since the tools call them on the unbound module), with no
base class to inherit.

* :class:`LayeredModel`: a model made of numbered layers whose sites have names
  (``jaxlens.models.Bert``, the demo ``GPT``).
* :class:`Decoder`: a causal language model with a KV cache that can also run one block on
  its own (``jaxlens.models.Llama``, ``jaxlens.models.GPT2``).
* :class:`Scannable`: a decoder that can also run its blocks as one loop over stacked
  parameters, the layer index being data (``Llama``, ``GPT2``). Optional: the sweeps use it
  when a model has it, so that their compiled program holds one block whatever the depth;
  a :class:`Decoder` without it gets a program with one copy of each block.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

__all__ = ["Decoder", "LayeredModel", "Scannable"]


@runtime_checkable
class LayeredModel(Protocol):
  """A model made of numbered layers.

  :func:`jaxlens.sweep.patching_sweep` patches ``layer_sites()`` when given no ``sites=``.
  """

  def layer_sites(self) -> tuple[str, ...]:
    """One site label per layer, in order: the site a layer sweep patches by default (the
    zoo: the residual stream entering each block, ``blocks_{i}/resid_pre``)."""
    ...

  def block_site(self, layer: int, name: str) -> str:
    """The label of the site ``name`` (``"resid_pre"``, ``"attn/k"``, ...; ``docs/models.md``
    lists the names) inside layer ``layer`` (the zoo: ``f"blocks_{layer}/{name}"``)."""
    ...


@runtime_checkable
class Decoder(LayeredModel, Protocol):
  """A causal language model with a KV cache, for generation and causal-cone sweeps.

  The call is ``model.apply(variables, tokens, attention_mask=None, positions=None,
  decode=False)`` and gives logits ``(batch, seq, vocab)``; with ``decode=True`` it reads and
  updates a ``cache`` collection (``mutable=["cache"]``) that ``model.init(key, tokens,
  decode=True)`` creates for ``tokens.shape[1]`` slots. ``attention_mask`` is then over the
  cache's slots, and ``positions`` (``(batch, seq)``) place left-padded rows. Blocks name the
  sites ``resid_pre``, ``attn/k``, ``attn/v`` (``(batch, seq, kv_heads, head_dim)``, after any
  rotation) and ``resid_post`` (:meth:`LayeredModel.block_site`).
  """

  def __call__(self, tokens, attention_mask=None, positions=None, decode: bool = False) -> Any:
    """The logits of ``tokens``."""
    ...

  def max_positions(self) -> int | None:
    """How many positions the model's call accepts (its context length), or None when
    unbounded. :func:`jaxlens.generate` refuses a prompt and generation longer than this."""
    ...

  def run_block(self, variables, layer: int, x, positions, *, past_keys, past_values, mask) -> Any:
    """Block ``layer`` on ``x`` after a given past: the block's output ``(batch, n, d_model)``.

    The block reads ``x`` (``(batch, n, d_model)``, the residual stream entering it) at
    ``positions`` (``(1, n)`` or ``(batch, n)``); its attention sees the keys and values
    ``past_keys``, ``past_values`` (``(batch, m, kv_heads, head_dim)``, as the sites
    ``attn/k``, ``attn/v`` hold them) followed by those of ``x`` itself, as the boolean
    ``mask`` (broadcastable to ``(batch, heads, n, m + n)``) allows.

    Args:
      variables: the whole model's variables (``{"params": ...}``).
      layer: the block's index.
      x: the residual stream entering the block.
      positions: the positions of ``x``'s tokens.
      past_keys, past_values: the keys and values before ``x``.
      mask: which keys each query sees.
    """
    ...

  def unembed(self, variables, x) -> Any:
    """The logits of the residual stream ``x`` leaving the last block (the final norm, then
    the unembedding)."""
    ...


@runtime_checkable
class Scannable(Decoder, Protocol):
  """A :class:`Decoder` whose blocks can run as one loop over stacked parameters.

  :func:`jaxlens.sweep.patching_sweep` (on the residual stream) and
  :func:`jaxlens.sweep.cone_sweep` convert such a model with :meth:`scanned`, trace it once,
  and run its blocks in a ``lax`` loop whose counter is the layer: their compiled program
  holds one block, not one per layer or per cell.
  """

  def scanned(self, variables) -> tuple[Any, Any] | None:
    """This model in its scanned form and ``variables`` in that form (unchanged when it is
    scanned already), or None when its blocks differ and cannot share one loop body. The
    scanned model's :meth:`Decoder.run_block` accepts a traced int32 ``layer``."""
    ...

  def stack_site(self, name: str) -> str:
    """In the scanned form, the label of the block site ``name`` of every layer at once (a
    value stacked ``(n_layers, ...)``; the zoo: ``f"blocks/{name}"``)."""
    ...
