"""Attribution graphs side by side with circuit-tracer 0.5.0, the circuit-tracer side (run in its
own environment: it pins transformers 4.56-4.57). A random GPT-2-layout TransformerLens model
(4 layers, d_model 64, 4 heads, vocabulary 512) with random per-layer transcoders of 256
features, built offline (the tokenizer attribute is a stand-in); for each prompt length its
``attribute`` (every active feature, batch 256) runs at one torch thread and at torch's default
thread count, alternately; the script writes the weights, each run's wall and CPU time and the
process's peak resident memory to /tmp/ct/bench_<seq>.json / .npz for
benchmarks/bench_circuits_vs_ct.py, which times jaxlens on the same weights.

Usage::

  /work/venv-ct/bin/python benchmarks/bench_circuits_ct.py SEQ [REPEATS]
"""

import json
import resource
import sys
import time

import numpy as np
import torch
from circuit_tracer import attribute
from circuit_tracer.replacement_model import ReplacementModel
from circuit_tracer.transcoder import SingleLayerTranscoder, TranscoderSet
from transformer_lens import HookedTransformerConfig

seq = int(sys.argv[1])
repeats = int(sys.argv[2]) if len(sys.argv) > 2 else 1
L, D, V, F = 4, 64, 512, 256


def peak_mb():
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def cpu_s():
  r = resource.getrusage(resource.RUSAGE_SELF)
  return r.ru_utime + r.ru_stime


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


class Tok:
  all_special_ids = [0]
  bos_token_id = 0
  pad_token_id = 0
  eos_token_id = 0
  vocab_size = V
  padding_side = "right"

  def decode(self, ids):
    ids = ids if isinstance(ids, list) else [int(ids)] if np.ndim(ids) == 0 else list(ids)
    return " ".join(f"t{int(i)}" for i in ids)


model.tokenizer = Tok()
rng = np.random.default_rng(0)
tokens = torch.tensor(np.concatenate([[0], rng.integers(1, V, seq - 1)]))
out = {
  f"w/{k}": v.detach().numpy() for k, v in model.state_dict().items() if "transcoders" not in k
}
for i in range(L):
  for k in ("W_enc", "b_enc", "W_dec", "b_dec"):
    out[f"tc{i}/{k}"] = getattr(tcs[i], k).detach().numpy()
out["tokens"] = tokens.numpy()
default = torch.get_num_threads()
runs = {"1": [], str(default): []}
cpus = {"1": [], str(default): []}
before = peak_mb()
graph = None
for r in range(repeats):
  for threads in [1, default] if r % 2 == 0 else [default, 1]:
    torch.set_num_threads(threads)
    graph = None  # the previous graph is not held through the next (the peak is one graph's)
    c0, t0 = cpu_s(), time.perf_counter()
    graph = attribute(tokens, model, batch_size=256, max_feature_nodes=None, verbose=False)
    runs[str(threads)].append(time.perf_counter() - t0)
    cpus[str(threads)].append(cpu_s() - c0)
out["n_active"] = np.asarray(len(graph.active_features))
np.savez(f"/tmp/ct/bench_{seq}.npz", **out)
result = {
  "seq": seq,
  "nodes": int(graph.adjacency_matrix.shape[0]),
  "active_features": int(len(graph.active_features)),
  "wall_s": {k: float(np.median(v)) for k, v in runs.items()},
  "cpu_s": {k: float(np.median(v)) for k, v in cpus.items()},
  "peak_rss_mb": peak_mb(),
  "rss_before_mb": before,
  "threads_default": default,
}
Path = __import__("pathlib").Path
Path(f"/tmp/ct/bench_{seq}.json").write_text(json.dumps(result, indent=1))
print(json.dumps(result))
