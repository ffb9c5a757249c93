"""jaxlens against the published torchlens 2.36.1 on the same weights, in one process.

The model is torch_bridge's reference ``TinyGPT`` at the benchmark size (same vocab,
width, heads, layers and sequence length as the built-in GPT), converted to Flax with
``torch_bridge.from_torch``, so both frameworks run the same weights on the same tokens.
The edit is ``scale(0.5)`` at the output of block ``L//2 - 1`` (``blocks.k`` in torch,
``blocks_k`` in Flax). Two workloads, each written for both libraries:

* trace with an edit: ``tl.trace(model, idx, intervene=tl.when(tl.module("blocks.k"),
  tl.scale(0.5)))`` (every op recorded) against
  ``jax.jit(lambda v, x: jl.trace(model, v, x, intervene=jl.when(jl.module("blocks_k"),
  jl.scale(0.5))))`` (every module site saved, the Trace returned);
* the same plus a backward pass of the next-token cross-entropy to every weight:
  ``loss.backward()`` on the torchlens output against ``jax.jit(jax.value_and_grad(...,
  has_aux=True))`` that also returns the saved sites.

Plain torch with a forward hook doing the same edit is timed too, so the table shows
how much of torchlens's time is torch's own. The script checks that the logits, the
losses and the head's weight gradient agree across the frameworks.

torchlens and torch are imported only here (``import jaxlens`` never imports torch).

Usage::

  python benchmarks/bench_torchlens.py [--size small] [--repeats 5]
"""

from __future__ import annotations

import sys
from pathlib import Path

_ROOT = Path(__file__).resolve().parent.parent
if str(_ROOT) not in sys.path:
  sys.path.insert(0, str(_ROOT))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import jaxlens as jl  # noqa: E402
from benchmarks import _setup  # noqa: E402
from benchmarks._timing import (
  env_info,
  interleaved,
  max_abs_diff,
  median,  # noqa: E402
  ratio,
  row,
  timed,
  report,
)
from jaxlens import models  # noqa: E402

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "torchlens.json"
FACTOR = 0.5
PIN = "2.36.1"


def parse_args(argv=None):
  p = _setup.parser(__doc__, repeats=5, out=str(DEFAULT_OUT))
  return p.parse_args(argv)


def jax_loss(logits, tokens):
  """Mean next-token cross-entropy."""
  logp = jax.nn.log_softmax(logits[:, :-1], axis=-1)
  return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1))


def main(argv=None) -> dict:
  """Runs the benchmark; returns (and writes, unless ``--out ''``) the result dict."""
  args = parse_args(argv)
  import torch
  import torchlens as tl

  from torch_bridge import from_torch
  from torch_bridge.convert import TinyGPT

  if tl.__version__ != PIN:
    raise SystemExit(
      f"torchlens {tl.__version__} is installed; this benchmark measures "
      f"the published {PIN} (pip install torchlens=={PIN})"
    )
  cfg = {**models.gpt_config(args.size), **_setup.model_overrides(args)}
  n, seq = cfg["n_layers"], cfg["max_len"]
  k = max(n // 2 - 1, 0)
  torch.manual_seed(args.seed)
  tmodel = TinyGPT(
    cfg["vocab_size"], cfg["d_model"], cfg["n_heads"], n, seq, cfg["mlp_ratio"]
  ).eval()
  fmodel, fvars, site_map = from_torch(tmodel)
  idx = torch.randint(0, cfg["vocab_size"], (args.batch, seq))
  tokens = jnp.asarray(idx.numpy(), jnp.int32)
  t_site, f_site = f"blocks.{k}", site_map[f"blocks.{k}"]

  # torch: torchlens, and plain torch with a forward hook doing the same edit.
  def tl_trace():
    tr = tl.trace(tmodel, idx, intervene=tl.when(tl.module(t_site), tl.scale(FACTOR)))
    return tr[tr.output_layers[0]].out

  def torch_ce(logits):
    return torch.nn.functional.cross_entropy(
      logits[:, :-1].reshape(-1, logits.shape[-1]), idx[:, 1:].reshape(-1)
    )

  def tl_backward():
    tmodel.zero_grad(set_to_none=True)
    loss = torch_ce(tl_trace())
    loss.backward()
    return loss.detach(), tmodel.head.weight.grad

  block = tmodel.blocks[k]

  def hooked(fn):
    handle = block.register_forward_hook(lambda mod, inp, out: out * FACTOR)
    try:
      return fn()
    finally:
      handle.remove()

  def torch_forward():
    with torch.no_grad():
      return hooked(lambda: tmodel(idx))

  def torch_backward():
    tmodel.zero_grad(set_to_none=True)
    loss = hooked(lambda: torch_ce(tmodel(idx)))
    loss.backward()
    return loss.detach(), tmodel.head.weight.grad

  # jaxlens.
  spec = jl.when(jl.module(f_site), jl.scale(FACTOR))
  jl_trace = jax.jit(lambda v, x: jl.trace(fmodel, v, x, intervene=spec))

  def loss_and_sites(v, x):
    t = jl.trace(fmodel, v, x, intervene=spec)
    return jax_loss(t.output, x), t.values

  jl_backward = jax.jit(jax.value_and_grad(loss_and_sites, has_aux=True))
  # The same step without jaxlens (and without the edit): what XLA's backward costs.
  flax_backward = jax.jit(jax.value_and_grad(lambda v, x: jax_loss(fmodel.apply(v, x), x)))

  first = {}
  first["torchlens_trace"], tl_logits = timed(tl_trace)
  first["torchlens_backward"], (tl_loss, tl_grad) = timed(tl_backward)
  first["jaxlens_trace"], jl_t = timed(jl_trace, fvars, tokens)
  first["jaxlens_backward"], ((jl_loss, _), jl_grads) = timed(jl_backward, fvars, tokens)
  first["torch_forward"], t_logits = timed(torch_forward)
  first["torch_backward"], _ = timed(torch_backward)
  first["flax_backward"], _ = timed(flax_backward, fvars, tokens)

  unedited = jax.jit(fmodel.apply)(fvars, tokens)
  check = {
    "logits_max_abs_diff": max_abs_diff(jl_t.output, tl_logits.detach().numpy()),
    "torch_hook_vs_torchlens": max_abs_diff(t_logits.numpy(), tl_logits.detach().numpy()),
    "loss_torchlens": float(tl_loss),
    "loss_jaxlens": float(jl_loss),
    "head_grad_max_abs_diff": max_abs_diff(jl_grads["params"]["head"]["kernel"], tl_grad.numpy().T),
    "edit_changes_logits": max_abs_diff(jl_t.output, unedited),
    "torchlens_ops_recorded": None,
    "jaxlens_sites_saved": len(jl_t.labels),
  }
  tol = 1e-4
  for key in ("logits_max_abs_diff", "torch_hook_vs_torchlens", "head_grad_max_abs_diff"):
    if check[key] > tol:
      raise AssertionError(f"{key} = {check[key]} > {tol}")
  np.testing.assert_allclose(check["loss_jaxlens"], check["loss_torchlens"], rtol=1e-5)
  if check["edit_changes_logits"] == 0:
    raise AssertionError("the edit did not change the logits")
  tr = tl.trace(tmodel, idx, intervene=tl.when(tl.module(t_site), tl.scale(FACTOR)))
  check["torchlens_ops_recorded"] = len(tr.layer_labels)

  times = interleaved(
    {
      "torchlens_trace": tl_trace,
      "jaxlens_trace": lambda: jl_trace(fvars, tokens),
      "torchlens_backward": tl_backward,
      "jaxlens_backward": lambda: jl_backward(fvars, tokens),
      "torch_forward": torch_forward,
      "torch_backward": torch_backward,
      "flax_backward": lambda: flax_backward(fvars, tokens),
    },
    args.repeats,
    args.warmup,
  )
  med = {name: median(ts) for name, ts in times.items()}
  rows = [
    row(
      "torchlens_trace",
      "trace with an edit: torchlens / jaxlens",
      ratio(med["torchlens_trace"], med["jaxlens_trace"]),
      target=(">=", 20.0),
      kind="speedup",
      candidate="jit(jl.trace(..., intervene=...))",
      baseline=f"tl.trace(..., intervene=...) (torchlens {tl.__version__})",
      candidate_value=med["jaxlens_trace"],
      baseline_value=med["torchlens_trace"],
    ),
    row(
      "torchlens_backward",
      "trace with an edit + backward: torchlens / jaxlens",
      ratio(med["torchlens_backward"], med["jaxlens_backward"]),
      target=(">=", 20.0),
      kind="speedup",
      candidate="jit(value_and_grad(jl.trace loss))",
      baseline="tl.trace + loss.backward()",
      candidate_value=med["jaxlens_backward"],
      baseline_value=med["torchlens_backward"],
    ),
    row(
      "jaxlens_backward_over_flax",
      "jaxlens trace + edit + backward / plain flax step",
      ratio(med["jaxlens_backward"], med["flax_backward"]),
      candidate="jit(value_and_grad(jl.trace loss))",
      baseline="jit(value_and_grad(loss))",
      candidate_value=med["jaxlens_backward"],
      baseline_value=med["flax_backward"],
    ),
    row(
      "torchlens_over_torch",
      "torchlens trace / plain torch forward with a hook",
      ratio(med["torchlens_trace"], med["torch_forward"]),
      candidate="tl.trace",
      baseline="torch forward + register_forward_hook",
      candidate_value=med["torchlens_trace"],
      baseline_value=med["torch_forward"],
    ),
    row(
      "torch_over_jaxlens",
      "plain torch forward with a hook / jaxlens trace",
      ratio(med["torch_forward"], med["jaxlens_trace"]),
      kind="speedup",
      candidate="jit(jl.trace(...))",
      baseline="torch forward + hook",
      candidate_value=med["jaxlens_trace"],
      baseline_value=med["torch_forward"],
    ),
    row(
      "torchlens_vs_jaxlens_first_call",
      "first call, jaxlens including trace + compile: torchlens / jaxlens",
      ratio(first["torchlens_trace"], first["jaxlens_trace"]),
      kind="speedup",
      candidate="jaxlens first call",
      baseline="torchlens first call",
      candidate_value=first["jaxlens_trace"],
      baseline_value=first["torchlens_trace"],
    ),
  ]
  result = {
    "benchmark": "torchlens",
    "title": f"jaxlens vs torchlens {tl.__version__} on the same weights",
    "config": {
      "size": args.size,
      "batch": args.batch,
      "seq": seq,
      "n_layers": n,
      "d_model": cfg["d_model"],
      "n_heads": cfg["n_heads"],
      "vocab_size": cfg["vocab_size"],
      "dtype": "float32",
      "site": t_site,
      "flax_site": f_site,
      "edit": f"scale({FACTOR})",
      "repeats": args.repeats,
      "warmup": args.warmup,
      "model": "torch_bridge TinyGPT, from_torch weights",
      "torch": torch.__version__,
      "torchlens": tl.__version__,
      "torch_threads": torch.get_num_threads(),
    },
    "env": env_info(),
    "rows": rows,
    "runtime_s": {
      name: {"median": med[name], "min": min(ts), "all": ts} for name, ts in times.items()
    },
    "first_call_s": first,
    "check": check,
  }
  return report(result, format_table(result), args.out)


def format_table(r: dict) -> str:
  lines = [r["title"], "", "| measure | value |", "|---|---|"]
  for rw in r["rows"]:
    lines.append(f"| {rw['measure']} | {rw['value']:.2f} |")
  return "\n".join(lines)


if __name__ == "__main__":
  main(sys.argv[1:])
