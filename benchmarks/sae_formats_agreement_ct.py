"""Gemma Scope 2 cross-layer transcoders, the circuit-tracer side: writes a random one in the
Gemma Scope 2 layout (one safetensors file per layer: ``w_enc (d_in, d_sae)``, ``w_dec (d_sae,
n_layers, d_out)`` zero before the layer, ``b_enc``, ``b_dec``, ``threshold``) to
/tmp/ct_gs2/, reads it with circuit-tracer 0.5.0's ``load_gemma_scope_2_clt``, and saves its
encoding and forward of random inputs to /tmp/ct_gs2/exchange.npz for
benchmarks/sae_formats_agreement.py (the jaxlens side).

Run it in circuit-tracer's environment (see benchmarks/circuits_agreement_ct.py)::

  /work/venv-ct/bin/python benchmarks/sae_formats_agreement_ct.py
"""

import os

import numpy as np
import torch
from safetensors.torch import save_file

from circuit_tracer.transcoder.cross_layer_transcoder import load_gemma_scope_2_clt

OUT = "/tmp/ct_gs2"
N, D, F = 3, 8, 16
torch.manual_seed(0)
os.makedirs(OUT, exist_ok=True)
paths = {}
for i in range(N):
  w_dec = torch.randn(F, N, D) * 0.3
  w_dec[:, :i] = 0  # layer i writes to layers i..N-1
  tensors = {
    "w_enc": torch.randn(D, F) * 0.3,
    "w_dec": w_dec,
    "b_enc": torch.randn(F) * 0.3,
    "b_dec": torch.randn(D) * 0.3,
    "threshold": torch.rand(F) * 0.3,
  }
  paths[i] = f"{OUT}/layer_{i}_width_16_l0_small.safetensors"
  save_file(tensors, paths[i])
# load_gemma_scope_2_clt reads layers range(max(paths)): one key past the last layer makes it
# read all N (given keys 0..N-1 it leaves the last layer out).
clt = load_gemma_scope_2_clt(
  {**paths, N: paths[N - 1]}, device=torch.device("cpu"), dtype=torch.float32
)
assert clt.n_layers == N
x = torch.randn(N, 5, D)
with torch.no_grad():
  acts = clt.encode(x)
  out = clt(x)
np.savez(f"{OUT}/exchange.npz", x=x.numpy(), acts=acts.numpy(), out=out.numpy())
print(f"wrote {OUT}: {N} layers, acts {tuple(acts.shape)}, {int((acts != 0).sum())} active")
