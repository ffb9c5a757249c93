"""The command-line options every benchmark shares, and the GPT they build from them."""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp

from jaxlens import models

__all__ = [
  "add_model_args",
  "add_run_args",
  "build_gpt",
  "model_config",
  "model_overrides",
  "parser",
]


def add_model_args(p: argparse.ArgumentParser) -> None:
  """``--size`` and the per-field overrides of :func:`jaxlens.models.gpt_config`."""
  p.add_argument("--size", default="small", choices=("small", "medium"))
  p.add_argument("--batch", type=int, default=8)
  p.add_argument("--layers", type=int, default=None, help="override the size's n_layers")
  p.add_argument("--d-model", type=int, default=None, help="override the size's d_model")
  p.add_argument("--heads", type=int, default=None, help="override the size's n_heads")
  p.add_argument("--seq", type=int, default=None, help="override the size's sequence length")
  p.add_argument("--seed", type=int, default=0)


def add_run_args(p: argparse.ArgumentParser, *, repeats: int, out: str) -> None:
  """``--repeats``, ``--warmup`` and ``--out`` (the JSON result path, ``''`` to skip)."""
  p.add_argument("--repeats", type=int, default=repeats, help="timed calls of each function")
  p.add_argument("--warmup", type=int, default=1, help="untimed calls after the first")
  p.add_argument("--out", default=out, help="JSON result path ('' to skip)")


def parser(doc: str, *, repeats: int, out: str) -> argparse.ArgumentParser:
  """A benchmark's parser: its docstring's first paragraph, the model and the run options."""
  p = argparse.ArgumentParser(description=doc.split("\n\n")[0])
  add_model_args(p)
  add_run_args(p, repeats=repeats, out=out)
  return p


def model_overrides(args) -> dict:
  """The ``GPT`` fields the command line overrides."""
  overrides = {}
  for flag, field in (
    ("layers", "n_layers"),
    ("d_model", "d_model"),
    ("heads", "n_heads"),
    ("seq", "max_len"),
  ):
    if getattr(args, flag) is not None:
      overrides[field] = getattr(args, flag)
  if "d_model" in overrides and "n_heads" not in overrides:
    # A tiny width keeps a head count that divides it.
    base = models.gpt_config(args.size)["n_heads"]
    overrides["n_heads"] = min(base, overrides["d_model"])
  return overrides


def build_gpt(args, *, dtype=jnp.float32):
  """``(model, variables, tokens)`` of the size and overrides on the command line."""
  return models.init_gpt(
    jax.random.key(args.seed), args.size, batch=args.batch, dtype=dtype, **model_overrides(args)
  )


def model_config(args, model) -> dict:
  """The shape of the benchmarked model, for the result's ``config``."""
  return {
    "size": args.size,
    "batch": args.batch,
    "seq": model.max_len,
    "n_layers": model.n_layers,
    "d_model": model.d_model,
    "n_heads": model.n_heads,
    "vocab_size": model.vocab_size,
    "dtype": "float32",
  }
