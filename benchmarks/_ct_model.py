"""The circuit-tracer side's model for benchmarks/bench_circuits_ct.py and
benchmarks/bench_circuits_memory_ct.py (run in /work/venv-ct: circuit-tracer 0.5.0 pins
transformers 4.56-4.57): a random GPT-2-layout TransformerLens model (4 layers, d_model 64, 4
heads, vocabulary 512) with random per-layer ReLU transcoders of 256 features, built offline (the
tokenizer attribute is a stand-in, since ``set_tokenizer`` downloads one), and the weights in the
layout benchmarks/bench_circuits_vs_ct.py and bench_circuits_memory.py read back for jaxlens.
``Tok`` also serves benchmarks/circuits_agreement_ct.py and bench_big_ct.py."""

import numpy as np
import torch
from circuit_tracer.replacement_model import ReplacementModel
from circuit_tracer.transcoder import SingleLayerTranscoder, TranscoderSet
from transformer_lens import HookedTransformerConfig

L, D, V, F = 4, 64, 512, 256


class Tok:
  """What circuit-tracer reads of a tokenizer: the special ids (token 0) and ``decode``."""

  all_special_ids = [0]
  bos_token_id = 0
  pad_token_id = 0
  eos_token_id = 0
  padding_side = "right"

  def __init__(self, vocab_size: int):
    self.vocab_size = vocab_size

  def decode(self, ids):
    ids = ids if isinstance(ids, list) else [int(ids)] if np.ndim(ids) == 0 else list(ids)
    return " ".join(f"t{int(i)}" for i in ids)


def build(seq: int):
  """``(model, transcoders, tokens)`` for a ``seq``-token prompt (token 0 first, as a BOS), the
  same draws for every ``seq``."""
  torch.manual_seed(0)
  cfg = HookedTransformerConfig(
    n_layers=L,
    d_model=D,
    n_ctx=max(seq, 16),
    d_head=16,
    n_heads=4,
    d_mlp=4 * D,
    d_vocab=V,
    act_fn="gelu_new",
    normalization_type="LN",
    dtype=torch.float32,
    device="cpu",
    positional_embedding_type="standard",
  )
  g = torch.Generator().manual_seed(1)
  tcs = {}
  for i in range(L):
    t = SingleLayerTranscoder(
      D, F, torch.nn.ReLU(), i, dtype=torch.float32, device=torch.device("cpu")
    )
    with torch.no_grad():
      t.W_enc.copy_(torch.randn(F, D, generator=g) * 0.3)
      t.b_enc.copy_(torch.randn(F, generator=g) * 0.1 - 4.0)  # a few percent fire
      t.W_dec.copy_(torch.randn(F, D, generator=g) * 0.2)
      t.b_dec.copy_(torch.randn(D, generator=g) * 0.05)
    tcs[i] = t
  tset = TranscoderSet(
    tcs, feature_input_hook="ln2.hook_normalized", feature_output_hook="hook_mlp_out"
  )
  model = ReplacementModel.from_config(cfg, tset, backend="transformerlens")
  model.tokenizer = Tok(V)
  rng = np.random.default_rng(0)
  tokens = torch.tensor(np.concatenate([[0], rng.integers(1, V, seq - 1)]))
  return model, tcs, tokens


def weights(model, tcs, tokens) -> dict:
  """The model's weights (``w/<TransformerLens name>``), the transcoders' (``tc<layer>/<name>``)
  and the prompt, as numpy arrays."""
  out = {
    f"w/{k}": v.detach().numpy() for k, v in model.state_dict().items() if "transcoders" not in k
  }
  for i in range(L):
    for k in ("W_enc", "b_enc", "W_dec", "b_dec"):
      out[f"tc{i}/{k}"] = getattr(tcs[i], k).detach().numpy()
  out["tokens"] = tokens.numpy()
  return out
