"""The specification's docs-test example, ported to JAX, gives [True, True, True]."""

import flax.linen as nn
import jax
import numpy as np
import torch

import jaxlens as jl
from jaxlens.intervention import keep_grad


def test_spec_docs_example():
  torch.manual_seed(0)
  tmodel = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)).eval()
  x = jax.numpy.asarray(torch.randn(3, 4).double().numpy())
  variables = {
    "params": {
      f"layers_{i}": {
        "kernel": jax.numpy.asarray(l.weight.detach().double().numpy().T),
        "bias": jax.numpy.asarray(l.bias.detach().double().numpy()),
      }
      for i, l in enumerate(tmodel)
    }
  }
  model = nn.Sequential([nn.Dense(4), nn.Dense(2)])
  site = jl.module("layers_0")

  try:
    jl.trace(model.bind(variables), x, intervene=jl.when(site, keep_grad(jl.zero_ablate())))
    refused = False
  except ValueError as error:
    refused = error.fields["code"] == "edit_detached_from_graph"

  def loss(v):
    trace = jl.trace(model.bind(v), x, intervene=jl.when(site, keep_grad(jl.scale(0.0))))
    return trace[trace.output_layers[0]].out.sum()

  grads = jax.grad(loss)(variables)
  # JAX's "out.requires_grad": the output structurally depends on the parameters.
  requires_grad = any(jax.tree.leaves(jl.depends_on(loss, variables)))

  result = [refused, requires_grad, bool(np.all(grads["params"]["layers_0"]["kernel"] == 0))]
  assert result == [True, True, True]
