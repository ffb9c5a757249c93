"""Conversion cost and speed of models converted from torch (torch_bridge.from_torch, export path).

For a Hugging Face GPT-2 and a ResNet-18 built from torch.nn layers (random weights, float32,
on the CPU), in one process:

* conversion time: ``torch.export`` + grouping + building the Flax model (median of
  ``--repeats`` conversions), next to the torch eager forward it replaces;
* the converted model's jitted forward against the torch eager forward of the same model on
  the same inputs (ratio of medians; torch with ``--torch-threads``, default 1);
* the converted GPT-2's jitted forward against the zoo's hand-written Flax GPT-2
  (jaxlens.models, loaded from the same Hugging Face weights; target <= 1.1).

Usage::

  python benchmarks/bench_convert.py [--repeats 5] [--out benchmarks/results/convert.json]
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from pathlib import Path

_ROOT = Path(__file__).resolve().parent.parent
if str(_ROOT) not in sys.path:
  sys.path.insert(0, str(_ROOT))

import jax
import numpy as np
import torch

from benchmarks._timing import env_info, interleaved, median, ratio, report, row
from jaxlens import models
from torch_bridge.convert import _zoo, convert, to_jax

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "convert.json"
GPT = {"n_layer": 4, "n_embd": 128, "n_head": 4, "vocab_size": 256, "seq": 64, "batch": 4}


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--repeats", type=int, default=5)
  p.add_argument("--warmup", type=int, default=1)
  p.add_argument("--out", default=str(DEFAULT_OUT), help="JSON result path ('' to skip)")
  p.add_argument(
    "--torch-threads",
    type=int,
    default=1,
    help="torch intra-op threads (1: no spinning threads fighting XLA's on a shared machine)",
  )
  return p.parse_args(argv)


def gpt2_model():
  _zoo._quiet_transformers()
  from transformers import GPT2Config, GPT2LMHeadModel

  cfg = GPT2Config(
    n_layer=GPT["n_layer"],
    n_embd=GPT["n_embd"],
    n_head=GPT["n_head"],
    vocab_size=GPT["vocab_size"],
    n_positions=GPT["seq"],
    use_cache=False,
    bos_token_id=0,
    eos_token_id=0,
  )
  torch.manual_seed(0)
  model = GPT2LMHeadModel(cfg).eval()
  x = torch.randint(0, GPT["vocab_size"], (GPT["batch"], GPT["seq"]))
  return model, (x,)


def resnet_model():
  torch.manual_seed(0)
  return _zoo.ResNet18(width=16).eval(), (torch.randn(4, 3, 64, 64),)


def measure(name, model, inputs, repeats, warmup):
  times, last = [], None
  for _ in range(max(repeats // 2, 1)):
    t0 = time.perf_counter()
    last = convert(model, *inputs)
    times.append(time.perf_counter() - t0)
  fmodel, variables, _, _ = last
  jin = [to_jax(x) for x in inputs]
  fwd = jax.jit(fmodel.apply)
  out = fwd(variables, *jin)
  with torch.no_grad():
    want = model(*inputs)
  got = out["logits"] if isinstance(out, dict) else out
  want = want.logits if hasattr(want, "logits") else want
  err = float(np.max(np.abs(np.asarray(got) - want.numpy())) / np.max(np.abs(want.numpy())))

  def torch_fwd():
    with torch.no_grad():
      return model(*inputs)

  t = interleaved({"converted": lambda: fwd(variables, *jin), "torch": torch_fwd}, repeats, warmup)
  return {
    "convert": median(times),
    "converted": median(t["converted"]),
    "torch": median(t["torch"]),
    "rel_error": err,
    "fmodel": fmodel,
    "variables": variables,
    "jin": jin,
  }


def main(argv=None) -> dict:
  args = parse_args(argv)
  warnings.filterwarnings("ignore")
  torch.set_num_threads(args.torch_threads)
  rows, figures = [], {}
  for name, make in (("gpt2", gpt2_model), ("resnet18", resnet_model)):
    model, inputs = make()
    m = measure(name, model, inputs, args.repeats, args.warmup)
    figures[name] = {k: v for k, v in m.items() if k not in ("fmodel", "variables", "jin")}
    rows.append(
      row(
        f"convert_{name}",
        f"{name}: conversion time / one torch eager forward",
        ratio(m["convert"], m["torch"]),
        candidate="from_torch (export path)",
        baseline="torch eager forward",
        candidate_value=m["convert"],
        baseline_value=m["torch"],
      )
    )
    rows.append(
      row(
        f"forward_{name}",
        f"{name}: converted jitted forward / torch eager forward",
        ratio(m["converted"], m["torch"]),
        candidate="jax.jit(converted.apply)",
        baseline="torch eager (no_grad)",
        candidate_value=m["converted"],
        baseline_value=m["torch"],
      )
    )
    if name == "gpt2":
      # The zoo's hand-written Flax GPT-2 with the same Hugging Face weights.
      lm = models.from_state_dict(model.state_dict(), models.config_from_hf(model.config.to_dict()))
      hand_fwd = jax.jit(lambda v, x, lm=lm: lm.model.apply(v, x))
      conv_fwd = jax.jit(m["fmodel"].apply)
      variables, jin = m["variables"], m["jin"]
      hand_logits = np.asarray(hand_fwd(lm.variables, jin[0]))
      conv_logits = np.asarray(conv_fwd(variables, *jin)["logits"])
      figures["gpt2"]["vs_zoo_rel_error"] = float(
        np.max(np.abs(hand_logits - conv_logits)) / np.max(np.abs(hand_logits))
      )
      t = interleaved(
        {
          "converted": lambda: conv_fwd(variables, *jin),  # noqa: B023
          "hand": lambda: hand_fwd(lm.variables, jin[0]),  # noqa: B023
        },
        args.repeats,
        args.warmup,
      )
      figures["gpt2"]["hand_written"] = median(t["hand"])
      rows.append(
        row(
          "forward_gpt2_vs_hand_written",
          "gpt2: converted jitted forward / the zoo's hand-written Flax GPT-2",
          ratio(median(t["converted"]), median(t["hand"])),
          target=("<=", 1.1),
          candidate="converted GPT-2",
          baseline="jaxlens.models GPT-2, same weights",
          candidate_value=median(t["converted"]),
          baseline_value=median(t["hand"]),
        )
      )
  result = {
    "benchmark": "convert",
    "title": "torch -> Flax conversion: time and forward speed",
    "config": {
      "gpt2": GPT,
      "resnet18": {"width": 16, "input": [4, 3, 64, 64]},
      "dtype": "float32",
      "repeats": args.repeats,
      "torch_threads": torch.get_num_threads(),
    },
    "figures": figures,
    "rows": rows,
    "env": env_info(),
  }
  lines = ["| measure | candidate (s) | baseline (s) | ratio |", "|---|---|---|---|"]
  for r in rows:
    target = f" (target {r['target'][0]} {r['target'][1]})" if r["target"] else ""
    lines.append(
      f"| {r['measure']} | {r['candidate_value']:.4f} | {r['baseline_value']:.4f} | "
      f"{r['value']:.2f}{target} |"
    )
  for name, f in figures.items():
    lines.append(f"\n{name}: output relative error {f['rel_error']:.1e}")
  return report(result, "\n".join(lines), args.out)


if __name__ == "__main__":
  main()
