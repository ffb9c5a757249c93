"""The real-model demo: an activation-patching sweep over layers x token positions on
SmolLM2-135M (``python -m jaxlens.models``).

The prompt pair is a factual-recall one: the clean run completes "The capital of France is"
with " Paris", the corrupt run "The capital of Italy is" with " Rome". Patching the clean
residual stream ``blocks_{l}/resid_pre`` at one position into the corrupt run and measuring the
logit difference " Paris" - " Rome" at the last position localises the fact: it sits on the
" France" token in the early and middle layers, and moves to the last position at a few late
layers (the pattern reported for factual recall, Meng et al. 2022).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import jaxlens as jl

__all__ = ["factual_recall", "patching_grid"]


def patching_grid(
  model, variables, clean, corrupt, metric: Callable[[Any], Any], *, sites, batch_size: int = 50
):
  """``grid[i, p]``: ``metric`` of the corrupt run with ``sites[i]`` at position ``p`` patched
  from the clean run. One compiled program for the whole grid: every site has a rule
  ``jl.gate(layer == i, ...)``, and the cells are mapped over (``lax.map``, vectorised in
  chunks of ``batch_size``)."""
  return _grid(
    model, variables, clean, corrupt, metric=metric, sites=tuple(sites), batch_size=batch_size
  )


@functools.partial(jax.jit, static_argnames=("model", "metric", "sites", "batch_size"))
def _grid(model, variables, clean, corrupt, *, metric, sites, batch_size):
  n_pos = clean.shape[1]
  donor = jl.trace(model, variables, clean, save=[jl.module(s) for s in sites], keep_inputs=False)

  def cell(c):
    layer, pos = c // n_pos, c % n_pos
    spec = None
    for i, site in enumerate(sites):
      edit = jl.gate(layer == i, jl.at_positions(pos[None], jl.patch_from(donor)))
      rule = jl.when(jl.module(site), edit)
      spec = rule if spec is None else spec + rule
    return metric(spec.bind(model)(variables, corrupt))

  cells = jnp.arange(len(sites) * n_pos)
  return jax.lax.map(cell, cells, batch_size=batch_size).reshape(len(sites), n_pos)


@functools.cache
def _logit_diff(good: int, bad: int):
  def metric(logits):
    return logits[0, -1, good] - logits[0, -1, bad]

  return metric


def factual_recall(
  lm,
  layers=None,
  clean="The capital of France is",
  corrupt="The capital of Italy is",
  answers=(" Paris", " Rome"),
):
  """The demo's sweep on a loaded SmolLM2: ``(grid, layer labels, token labels, baselines)``,
  with ``baselines = (clean metric, corrupt metric)``."""
  clean_ids, corrupt_ids = lm.encode(clean), lm.encode(corrupt)
  good, bad = (lm.tokenizer.encode(a).ids[0] for a in answers)
  metric = _logit_diff(good, bad)
  layers = range(lm.config.n_layers) if layers is None else layers
  sites = [f"blocks_{i}/resid_pre" for i in layers]
  grid = patching_grid(lm.model, lm.variables, clean_ids, corrupt_ids, metric, sites=sites)
  f = jax.jit(lm.model.apply)
  base = (float(metric(f(lm.variables, clean_ids))), float(metric(f(lm.variables, corrupt_ids))))
  tokens = [t.replace("Ġ", " ") for t in lm.tokens(clean)]
  corrupt_tokens = [t.replace("Ġ", " ") for t in lm.tokens(corrupt)]
  labels = [a if a == b else f"{a}/{b}" for a, b in zip(tokens, corrupt_tokens)]
  return np.asarray(grid), [f"L{i}" for i in layers], labels, base
