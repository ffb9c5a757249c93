"""The reference torch transformer (:class:`TinyGPT` of :class:`GPTBlock`\s) that the fast
path converts module by module into :class:`torch_bridge.convert._flax_layers.FlaxTinyGPT`."""

from __future__ import annotations


import torch

__all__ = ["GPTBlock", "TinyGPT"]


# --------------------------------------------------------------------------
# Reference torch transformer (the GPT-style model the converter supports).
# --------------------------------------------------------------------------


class GPTBlock(torch.nn.Module):
  """Pre-LayerNorm GPT block: ``x + attn(ln1(x))`` then ``x + mlp(ln2(x))``.

  Attention is ``torch.nn.MultiheadAttention(batch_first=True)`` applied as
  causal self-attention (boolean upper-triangular ``attn_mask``, True means
  "may not attend"). The MLP is ``Linear, GELU, Linear``.

  Args:
    d_model: Width of the residual stream.
    n_heads: Number of attention heads (must divide ``d_model``).
    mlp_ratio: Hidden width of the MLP as a multiple of ``d_model``.
  """

  def __init__(self, d_model: int, n_heads: int, mlp_ratio: int = 4) -> None:
    super().__init__()
    self.d_model = d_model
    self.n_heads = n_heads
    self.mlp_ratio = mlp_ratio
    self.ln1 = torch.nn.LayerNorm(d_model)
    self.attn = torch.nn.MultiheadAttention(d_model, n_heads, batch_first=True)
    self.ln2 = torch.nn.LayerNorm(d_model)
    self.mlp = torch.nn.Sequential(
      torch.nn.Linear(d_model, mlp_ratio * d_model),
      torch.nn.GELU(),
      torch.nn.Linear(mlp_ratio * d_model, d_model),
    )

  def forward(self, x: torch.Tensor) -> torch.Tensor:
    """Applies the block to ``x`` of shape ``(batch, seq, d_model)``."""
    seq = x.shape[-2]
    causal_mask = torch.triu(torch.ones(seq, seq, dtype=torch.bool, device=x.device), diagonal=1)
    h = self.ln1(x)
    attn_out, _ = self.attn(h, h, h, attn_mask=causal_mask, need_weights=False)
    x = x + attn_out
    return x + self.mlp(self.ln2(x))


class TinyGPT(torch.nn.Module):
  """Small GPT: token + learned position embeddings, blocks, LayerNorm, head.

  Args:
    vocab: Vocabulary size (embedding rows and head outputs).
    d_model: Width of the residual stream.
    n_heads: Attention heads per block.
    n_layers: Number of :class:`GPTBlock` in ``blocks``.
    max_len: Longest supported sequence (rows of ``pos_emb``).
    mlp_ratio: MLP width multiple passed to each block.
  """

  def __init__(
    self,
    vocab: int,
    d_model: int,
    n_heads: int,
    n_layers: int,
    max_len: int,
    mlp_ratio: int = 4,
  ) -> None:
    super().__init__()
    self.vocab = vocab
    self.d_model = d_model
    self.n_heads = n_heads
    self.n_layers = n_layers
    self.max_len = max_len
    self.mlp_ratio = mlp_ratio
    self.tok_emb = torch.nn.Embedding(vocab, d_model)
    self.pos_emb = torch.nn.Embedding(max_len, d_model)
    self.blocks = torch.nn.ModuleList(
      [GPTBlock(d_model, n_heads, mlp_ratio) for _ in range(n_layers)]
    )
    self.ln_f = torch.nn.LayerNorm(d_model)
    self.head = torch.nn.Linear(d_model, vocab)

  def forward(self, idx: torch.Tensor) -> torch.Tensor:
    """Maps token ids ``(batch, seq)`` to logits ``(batch, seq, vocab)``."""
    pos = torch.arange(idx.shape[-1], device=idx.device)
    x = self.tok_emb(idx) + self.pos_emb(pos)
    for block in self.blocks:
      x = block(x)
    return self.head(self.ln_f(x))
