"""The Jacobian lens against TransformerLens 4.3.0's ``JacobianLens``, on the same GPT-2 weights:
agreement (fitted matrices, readouts, merge, the artifact files both ways, steering, ablation and
swap) and the fit's speed in prompts per second.

The weights are a GPT-2 built by transformers with its own random initialisation (seed 0; no
pretrained checkpoint is on this machine, and nothing is downloaded), written as a Hugging Face
directory that TransformerLens boots (``TransformerBridge.boot_transformers``, raw weights, as its
Jacobian lens requires) and jaxlens loads (``jaxlens.models.load_hf``). The tokenizer is a
word-level stand-in (``t0 .. t{V-1}``); TransformerLens prepends its BOS, and jaxlens is given the
same ids. Both sides run in one process, float32.

Run it with the separate environment's Python (TransformerLens is not a jaxlens requirement)::

  /work/venv-tl/bin/pip install transformer-lens==4.3.0  # beside torch 2.13.0
  /work/venv-tl/bin/python benchmarks/jacobian_lens_agreement.py [--bench] [--repeats 3]

The script adds jaxlens's virtualenv's site-packages after its own (jax, flax, optax), so
torch, transformers and TransformerLens are those of /work/venv-tl.

Speed (``--bench``; with ``--no-agreement`` about 2 minutes on the two-core machine when idle):
for each shape of :data:`SHAPES` (or ``--bench-shape``), jaxlens's ``fit_jacobian_lens``
(compiled first; its default threads, and one thread) against ``JacobianLens.fit`` at torch's
one thread and its default, called in turn for ``--repeats`` rounds, wall and CPU time per
prompt, the load average recorded; a ``SUMMARY`` line per shape gives jaxlens's prompts per
second against TransformerLens's better thread setting::

  /work/venv-tl/bin/python benchmarks/jacobian_lens_agreement.py --bench --no-agreement
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

_ROOT = Path(__file__).resolve().parent.parent
_MAIN_SITE = _ROOT / ".venv" / "lib" / "python3.11" / "site-packages"
if str(_ROOT) not in sys.path:
  sys.path.insert(0, str(_ROOT))
try:
  import jax  # noqa: F401
except ImportError:
  sys.path.append(str(_MAIN_SITE))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

import jaxlens as jl  # noqa: E402
import jaxlens.models as jm  # noqa: E402
from jaxlens import lens  # noqa: E402


def build(directory: Path, *, vocab: int, width: int, layers: int, heads: int, n_ctx: int):
  """A random GPT-2 written to ``directory``; returns TransformerLens's bridge and jaxlens's
  (model, variables) on the same weights."""
  import transformers
  from tokenizers import Tokenizer, models, pre_tokenizers
  from transformer_lens.model_bridge import TransformerBridge

  transformers.logging.set_verbosity_error()
  torch.manual_seed(0)
  cfg = transformers.GPT2Config(
    vocab_size=vocab,
    n_positions=n_ctx,
    n_embd=width,
    n_layer=layers,
    n_head=heads,
    bos_token_id=1,
    eos_token_id=1,
  )
  hf = transformers.GPT2LMHeadModel(cfg).eval()
  hf.save_pretrained(directory)
  words = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
  words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
  transformers.PreTrainedTokenizerFast(
    tokenizer_object=words, bos_token="t1", eos_token="t1", unk_token="t0", pad_token="t2"
  ).save_pretrained(directory)
  tok = transformers.AutoTokenizer.from_pretrained(directory)
  bridge = TransformerBridge.boot_transformers(
    str(directory), device="cpu", hf_model=hf, tokenizer=tok
  )
  bridge.eval()
  pretrained = jm.load_hf(directory, dtype=jnp.float32)
  return bridge, pretrained.model, pretrained.variables


def prompts(n: int, length: int, vocab: int, seed: int) -> list[str]:
  rng = np.random.default_rng(seed)
  return [" ".join(f"t{i}" for i in rng.integers(3, vocab, length)) for _ in range(n)]


def rel(a, b) -> float:
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


def agreement(args) -> dict:
  from transformer_lens.tools.analysis import JacobianLens

  out: dict = {}
  with tempfile.TemporaryDirectory() as tmp:
    tmp = Path(tmp)
    bridge, model, variables = build(
      tmp / "gpt2", vocab=1024, width=128, layers=4, heads=4, n_ctx=128
    )
    texts = prompts(6, 40, 1024, seed=1) + prompts(2, 31, 1024, seed=2)
    ids = [bridge.to_tokens(t)[0].numpy().astype(np.int32) for t in texts]
    out["model"] = "GPT-2 layout, 4 blocks, width 128, 4 heads, vocabulary 1024, float32"
    out["prompts"] = f"{len(ids)} prompts of {sorted({len(i) for i in ids})} tokens (BOS included)"
    skip = 16
    tl_fit = JacobianLens.fit(
      bridge, texts, corpus="agreement", skip_first_positions=skip, show_progress=False
    )
    jl_fit = lens.fit_jacobian_lens(model, variables, ids, skip_first_positions=skip)
    assert tl_fit.source_layers == jl_fit.source_layers == [0, 1, 2]
    out["matrices_rel"] = {
      layer: rel(jl_fit.jacobians[layer], tl_fit.jacobians[layer].numpy())
      for layer in jl_fit.source_layers
    }
    out["matrices_max_abs"] = float(
      max(np.abs(tl_fit.jacobians[layer].numpy()).max() for layer in tl_fit.source_layers)
    )
    # Merge: halves merged weighted by counts, on both sides.
    tl_merged = JacobianLens.merge(
      [
        JacobianLens.fit(
          bridge, texts[:3], corpus="m", skip_first_positions=skip, show_progress=False
        ),
        JacobianLens.fit(
          bridge, texts[3:], corpus="m", skip_first_positions=skip, show_progress=False
        ),
      ]
    )
    jl_merged = lens.JacobianLens.merge(
      [
        lens.fit_jacobian_lens(model, variables, ids[:3], skip_first_positions=skip),
        lens.fit_jacobian_lens(model, variables, ids[3:], skip_first_positions=skip),
      ]
    )
    out["merge_rel"] = max(
      rel(jl_merged.jacobians[k], tl_merged.jacobians[k].numpy()) for k in jl_merged.source_layers
    )
    out["merge_vs_one_fit_rel"] = max(
      rel(jl_merged.jacobians[k], jl_fit.jacobians[k]) for k in jl_fit.source_layers
    )
    # Files: TransformerLens's artifact read by jaxlens, jaxlens's read by TransformerLens.
    tl_path, jl_path = tmp / "tl.pt", tmp / "jl.pt"
    tl_fit.save(str(tl_path), dtype=torch.float32)
    from_tl = lens.load_jacobian_lens(tl_path, model)
    out["tl_file_read_by_jaxlens_equal"] = (
      all(
        np.array_equal(from_tl.jacobians[k], tl_fit.jacobians[k].numpy())
        for k in tl_fit.source_layers
      )
      and from_tl.n_prompts == tl_fit.n_prompts
    )
    tl_fit.save(str(tl_path))  # float16, the default
    half = lens.load_jacobian_lens(tl_path, model)
    out["tl_fp16_file_read_by_jaxlens_equal"] = all(
      np.array_equal(half.jacobians[k], tl_fit.jacobians[k].half().float().numpy())
      for k in tl_fit.source_layers
    )
    lens.save_jacobian_lens(jl_path, jl_fit, dtype=np.float32)
    back = JacobianLens.load(str(jl_path))
    out["jaxlens_file_read_by_tl_equal"] = (
      all(
        np.array_equal(back.jacobians[k].numpy(), jl_fit.jacobians[k]) for k in jl_fit.source_layers
      )
      and back.n_prompts == jl_fit.n_prompts
      and back.d_model == jl_fit.d_model
    )
    # Readouts: the same lens (TransformerLens's matrices) read by both, full logits.
    probe = prompts(1, 20, 1024, seed=3)[0]
    probe_ids = bridge.to_tokens(probe)
    ro = tl_fit.readout(bridge, probe_ids, return_full_logits=True)
    tokens = jnp.asarray(probe_ids.numpy(), jnp.int32)
    logits = np.asarray(lens.jacobian_lens(model, variables, tokens, from_tl))
    layers = [*from_tl.source_layers, 3]
    out["readout_rel"] = {
      layer: rel(logits[i, 0], ro.lens_logits[layer].numpy()) for i, layer in enumerate(layers)
    }
    top = lens.jacobian_lens_topk(model, variables, tokens, from_tl, k=10)
    out["readout_top10_ids_equal"] = all(
      np.array_equal(np.asarray(top.ids[i, 0]), ro.lens_topk_indices[layer].numpy())
      for i, layer in enumerate(layers)
    )
    # The same readout from jaxlens's own fit against TransformerLens's own fit.
    own = np.asarray(lens.jacobian_lens(model, variables, tokens, jl_fit))
    out["readout_own_fits_rel"] = max(
      rel(own[i, 0], ro.lens_logits[layer].numpy()) for i, layer in enumerate(layers)
    )
    # Interventions: the model's logits with TransformerLens's hooks and jaxlens's rules.
    clean_logits, cache = bridge.run_with_cache(probe_ids)
    edits = {
      "steering": (
        tl_fit.steering_hooks(bridge, 17, [1, 2], alpha=2.0, positions=[-1, 5]),
        lens.jacobian_steering(model, variables, from_tl, 17, [1, 2], alpha=2.0, positions=[-1, 5]),
      ),
      "ablation": (
        tl_fit.ablation_hooks(bridge, [17, 30, 99], [0, 2]),
        lens.jacobian_ablation(model, variables, from_tl, [17, 30, 99], [0, 2]),
      ),
      "swap": (
        tl_fit.swap_hooks(bridge, 17, 30, [1], alpha=2.0),
        lens.jacobian_swap(model, variables, from_tl, 17, 30, [1], alpha=2.0),
      ),
      "swap_clamped": (
        tl_fit.swap_hooks(bridge, 17, 30, [1, 2], clamp_to=cache),
        lens.jacobian_swap(
          model,
          variables,
          from_tl,
          17,
          30,
          [1, 2],
          clamp_to={k: jnp.asarray(cache[f"blocks.{k}.hook_out"].numpy()) for k in (1, 2)},
        ),
      ),
    }
    out["edits_rel"] = {}
    for name, (hooks, rules) in edits.items():
      want = bridge.run_with_hooks(probe_ids, fwd_hooks=hooks).detach().numpy()
      got = np.asarray(jl.trace(model, variables, tokens, intervene=rules).output)
      out["edits_rel"][name] = rel(got, want)
      out["edits_rel"][name + "_changed_logits"] = rel(want, clean_logits.detach().numpy())
  return out


# The benchmark's shapes, LAYERSxWIDTHxSEQxPROMPTS: the GPT-2 of 4 blocks, width 128 and
# 64-token prompts, and a more realistic one (width 256, the reference's 128-token prompts).
SHAPES = ("4x128x64x4", "4x256x128x2")


def _shape(text: str) -> dict:
  layers, width, seq, n = (int(x) for x in text.lower().split("x"))
  return {"layers": layers, "width": width, "seq": seq, "prompts": n}


def bench_shape(shape: dict, *, repeats: int, dim_batch: int) -> dict:
  """jaxlens's fit (its default threads, and one thread) against ``JacobianLens.fit`` at torch's
  one thread and its default, called in turn (the order rotating every round) in this process;
  wall and CPU time (user + system, every thread) per prompt, medians over the rounds."""
  from transformer_lens.tools.analysis import JacobianLens

  from benchmarks._torch_peer import cpu_seconds
  from jaxlens.lens._jacobian import _threads

  with tempfile.TemporaryDirectory() as tmp:
    bridge, model, variables = build(
      Path(tmp) / "gpt2",
      vocab=2048,
      width=shape["width"],
      layers=shape["layers"],
      heads=shape["width"] // 32,
      n_ctx=shape["seq"],
    )
    texts = prompts(shape["prompts"], shape["seq"] - 1, 2048, seed=4)
    ids = np.stack([bridge.to_tokens(t)[0].numpy().astype(np.int32) for t in texts])
    n = len(texts)
    default = torch.get_num_threads()
    threads = _threads(None, n)

    def ours(t=None):
      fit = lens.fit_jacobian_lens(model, variables, ids, dim_batch=dim_batch, threads=t)
      return fit.jacobians

    def peer(k):
      torch.set_num_threads(k)
      return JacobianLens.fit(bridge, texts, corpus="bench", show_progress=False).jacobians

    sides = {
      f"jaxlens {threads} threads": ours,
      "jaxlens 1 thread": lambda: ours(1),
      "TransformerLens 1 thread": lambda: peer(1),
      f"TransformerLens {default} threads": lambda: peer(default),
    }
    if threads == 1:
      del sides["jaxlens 1 thread"]
    load = [os.getloadavg()[0]]
    a, b = ours(), peer(1)  # compiles; the matrices of both
    torch.set_num_threads(default)
    same = max(rel(a[k], b[k].numpy()) for k in a)
    names = list(sides)
    dropped: set = set()
    walls: dict = {k: [] for k in names}
    cpus: dict = {k: [] for k in names}
    try:
      for r in range(repeats):
        order = names[r % len(names) :] + names[: r % len(names)]
        for name in order if r % 2 == 0 else order[::-1]:
          if name in dropped:
            continue
          c0, t0 = cpu_seconds(), time.perf_counter()
          sides[name]()
          walls[name].append((time.perf_counter() - t0) / n)
          cpus[name].append((cpu_seconds() - c0) / n)
          print(
            f"round {r}: {name}: {1000 * walls[name][-1]:.0f} ms wall, "
            f"{1000 * cpus[name][-1]:.0f} ms CPU a prompt",
            file=sys.stderr,
            flush=True,
          )
        load.append(os.getloadavg()[0])
        # A TransformerLens setting over 3x slower than its other one (torch's threads spinning
        # for a core on a loaded machine: seconds a prompt) is not its best: not run again.
        peers = [k for k in names if k.startswith("TransformerLens") and k not in dropped]
        if len(peers) == 2:
          slow, fast = sorted(peers, key=lambda k: -np.median(walls[k]))
          if np.median(walls[slow]) > 3 * np.median(walls[fast]):
            dropped.add(slow)
    finally:
      torch.set_num_threads(default)
  out: dict = {
    k: {
      "wall_ms": 1000 * float(np.median(walls[k])),
      "cpu_ms": 1000 * float(np.median(cpus[k])),
      "prompts_per_s": 1.0 / float(np.median(walls[k])),
      "wall_ms_all": [round(1000 * w, 1) for w in walls[k]],
      "cpu_ms_all": [round(1000 * c, 1) for c in cpus[k]],
    }
    for k in names
  }
  ours_name = names[0]
  best = min((k for k in names if k.startswith("TransformerLens")), key=lambda k: out[k]["wall_ms"])
  out.update(
    setting=(
      f"GPT-2 layout, {shape['layers']} blocks, width {shape['width']}, {shape['width'] // 32} "
      f"heads, {n} prompts of {shape['seq']} tokens, skip 16, float32; jaxlens dim_batch="
      f"{dim_batch}, TransformerLens dim_batch=8 (its default)"
    ),
    same_matrix_rel=same,
    best_torch=best,
    speedup_wall=out[best]["wall_ms"] / out[ours_name]["wall_ms"],
    speedup_cpu=out[best]["cpu_ms"] / out[ours_name]["cpu_ms"],
    # against TransformerLens's least CPU a prompt (one thread, usually): the steadier figure
    speedup_cpu_least=min(out[k]["cpu_ms"] for k in names if k.startswith("TransformerLens"))
    / out[ours_name]["cpu_ms"],
    jaxlens=ours_name,
    load_average=[round(x, 2) for x in load],
    cores_busy={k: out[k]["cpu_ms"] / out[k]["wall_ms"] for k in names},
  )
  out["summary"] = (
    f"{shape['layers']}x{shape['width']}x{shape['seq']}: {ours_name} "
    f"{out[ours_name]['prompts_per_s']:.2f} prompts/s, {best} (the better) "
    f"{out[best]['prompts_per_s']:.2f}: {out['speedup_wall']:.2f}x wall "
    f"({out['speedup_cpu']:.2f}x its CPU; {out['speedup_cpu_least']:.2f}x TransformerLens's "
    f"least CPU), target 3x "
    f"{'met' if out['speedup_wall'] >= 3 else 'NOT met'}; load {min(load):.1f}-{max(load):.1f}"
  )
  if "jaxlens 1 thread" in out and ours_name != "jaxlens 1 thread":
    one = out["jaxlens 1 thread"]
    out["speedup_wall_1_thread"] = out[best]["wall_ms"] / one["wall_ms"]
    out["summary"] += (
      f" (jaxlens at 1 thread: {one['prompts_per_s']:.2f} prompts/s, "
      f"{out['speedup_wall_1_thread']:.2f}x)"
    )
  return out


def bench(args) -> dict:
  return {
    text: bench_shape(_shape(text), repeats=args.repeats, dim_batch=args.dim_batch)
    for text in args.bench_shape or SHAPES
  }


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--bench", action="store_true", help="also time the fit")
  parser.add_argument("--no-agreement", action="store_true")
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument(
    "--bench-shape",
    action="append",
    help=f"LAYERSxWIDTHxSEQxPROMPTS, repeatable (default: {', '.join(SHAPES)})",
  )
  parser.add_argument("--dim-batch", type=int, default=32)
  args = parser.parse_args(argv)
  result: dict = {"torch": torch.__version__, "jax": jax.__version__}
  import transformer_lens  # noqa: F401
  from importlib.metadata import version

  result["transformer_lens"] = version("transformer-lens")
  if not args.no_agreement:
    t0 = time.time()
    result["agreement"] = agreement(args)
    result["agreement_s"] = time.time() - t0
  if args.bench:
    result["bench"] = bench(args)
  print(json.dumps(result, indent=1, default=str))
  for shape in result.get("bench", {}).values():
    print("SUMMARY", shape["summary"])
  return result


if __name__ == "__main__":
  main()
