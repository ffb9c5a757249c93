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

import jax
import numpy as np

import jaxlens as jl

__all__ = ["factual_recall"]


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
  layer_sites = lm.model.layer_sites()
  sites = [layer_sites[i] for i in layers]
  grid = jl.sweep.patching_sweep(
    lm.model, lm.variables, clean_ids, corrupt_ids, metric, sites=sites
  )
  f = jax.jit(lm.model.apply)
  base = (float(metric(f(lm.variables, clean_ids))), float(metric(f(lm.variables, corrupt_ids))))
  tokens = [t.replace("Ġ", " ") for t in lm.tokens(clean)]
  corrupt_tokens = [t.replace("Ġ", " ") for t in lm.tokens(corrupt)]
  labels = [a if a == b else f"{a}/{b}" for a, b in zip(tokens, corrupt_tokens)]
  return np.asarray(grid), [f"L{i}" for i in layers], labels, base
