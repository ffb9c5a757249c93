"""Billion-parameter models on one machine: Llama-3.2-1B, Gemma-2-2B and Llama-3.1-8B shapes.

Writes checkpoints with random weights in each model's real shape (its published config.json,
Hugging Face tensor names, float32 or bfloat16, one file or shards with an index) into a
temporary directory (``--dir``, deleted at the end unless ``--keep``), then measures, each in a
fresh process so that its peak resident memory (``VmHWM``) is its own:

* ``load``: ``jaxlens.models.load_hf`` time and peak RSS over the weights' bytes in the chosen
  dtype (target <= 1.1), beside ``transformers.AutoModelForCausalLM.from_pretrained``;
* ``trace``: a jitted ``jl.trace`` saving every ``blocks_*/resid_post`` at 512 tokens: peak RSS
  over the weights + the saved values + the logits (target <= 1.2), time, and the last
  position's logits against transformers' (``output_hidden_states=True``);
* ``decode``: greedy ``jl.generate`` tokens/s against the memory-bandwidth floor (the bytes of
  weights a step reads over the bandwidth of a jitted sum over 1 GiB, measured in the same
  process; target >= 0.8 of the floor), with flax's ``(in, out)`` kernels and again with
  ``load_hf(layout="rows")`` (``jax_rows`` in the results), beside transformers' ``generate``;
* ``products`` (no checkpoint): one token times one bfloat16 ``2048 x 8192`` kernel, each way
  XLA:CPU might compute it (:func:`child_products`), against a jitted sum's bandwidth;
* ``graph``: ``jaxlens.circuits.attribute`` through random transcoders on four layers, or on
  every layer (``--graph-layers all``) (:func:`_graph`): time and peak RSS; with ``--ct``,
  circuit-tracer 0.5.0's graph of the same weights, transcoders and prompt
  (``benchmarks/bench_big_ct.py``, in /work/venv-ct), and the two graphs compared;
* ``sweep``: ``jl.sweep.patching_sweep`` over every layer's residual stream x every position
  of a ``--sweep-seq``-token prompt (1B shape only): time and peak RSS, beside the same grid by
  transformers' forward hooks, one forward per cell (``--sweep-cells``: a measured subset).

``--models tiny`` runs Llama-3.2-1B's layout at tiny widths (a check of the plumbing).

Torch runs at one thread and at its default (two here); the table gives the better, with its CPU
time beside its wall time. The 8B model is written in bfloat16 only (float32 would not fit in
24 GB) and run only with ``--models`` naming it and 19 GB of memory available.

Llama 3.x configs name ``rope_scaling`` of type llama3; where the zoo refuses it, the config is
written without it (for both sides) and the result says so.

Usage::

  python benchmarks/bench_big.py --models 1b --parts load,trace,decode,sweep [--torch]
  python benchmarks/bench_big.py --models 8b --parts load,decode --dtypes bfloat16
  python benchmarks/bench_big.py --models 1b --dtypes float32 --parts graph --graph-layers all \
    --features 1024 --ct --repeats 2
  python benchmarks/bench_big.py --models 1b --dtypes float32 --parts sweep --torch \
    --sweep-seq 8 --sweep-cells 64
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zlib
from pathlib import Path

_ROOT = Path(__file__).resolve().parent.parent
if str(_ROOT) not in sys.path:
  sys.path.insert(0, str(_ROOT))

import numpy as np

DEFAULT_OUT = _ROOT / "benchmarks" / "results" / "big.json"
GIB = 2**30

_LLAMA3_ROPE = {
  "high_freq_factor": 4.0,
  "low_freq_factor": 1.0,
  "original_max_position_embeddings": 8192,
  "rope_type": "llama3",
}
# The published config.json of each model (meta-llama/Llama-3.2-1B, meta-llama/Llama-3.1-8B,
# google/gemma-2-2b), less the token ids.
CONFIGS = {
  "1b": {
    "name": "Llama-3.2-1B",
    "architectures": ["LlamaForCausalLM"],
    "attention_bias": False,
    "head_dim": 64,
    "hidden_act": "silu",
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "max_position_embeddings": 131072,
    "mlp_bias": False,
    "model_type": "llama",
    "num_attention_heads": 32,
    "num_hidden_layers": 16,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-05,
    "rope_scaling": {"factor": 32.0, **_LLAMA3_ROPE},
    "rope_theta": 500000.0,
    "tie_word_embeddings": True,
    "vocab_size": 128256,
  },
  # Llama-3.2-1B's layout at tiny widths: a check of the benchmark's own plumbing (`--models
  # tiny`), seconds instead of minutes
  "tiny": {
    "name": "Llama-3.2-1B layout, tiny",
    "architectures": ["LlamaForCausalLM"],
    "attention_bias": False,
    "head_dim": 16,
    "hidden_act": "silu",
    "hidden_size": 64,
    "intermediate_size": 128,
    "max_position_embeddings": 131072,
    "mlp_bias": False,
    "model_type": "llama",
    "num_attention_heads": 4,
    "num_hidden_layers": 4,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-05,
    "rope_scaling": {"factor": 32.0, **_LLAMA3_ROPE},
    "rope_theta": 500000.0,
    "tie_word_embeddings": True,
    "vocab_size": 512,
  },
  "8b": {
    "name": "Llama-3.1-8B",
    "architectures": ["LlamaForCausalLM"],
    "attention_bias": False,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "max_position_embeddings": 131072,
    "mlp_bias": False,
    "model_type": "llama",
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-05,
    "rope_scaling": {"factor": 8.0, **_LLAMA3_ROPE},
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
    "vocab_size": 128256,
  },
  "2b": {
    "name": "Gemma-2-2B",
    "architectures": ["Gemma2ForCausalLM"],
    "attention_bias": False,
    "attn_logit_softcapping": 50.0,
    "final_logit_softcapping": 30.0,
    "head_dim": 256,
    "hidden_act": "gelu_pytorch_tanh",
    "hidden_activation": "gelu_pytorch_tanh",
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "max_position_embeddings": 8192,
    "model_type": "gemma2",
    "num_attention_heads": 8,
    "num_hidden_layers": 26,
    "num_key_value_heads": 4,
    "query_pre_attn_scalar": 256,
    "rms_norm_eps": 1e-06,
    "rope_theta": 10000.0,
    "sliding_window": 4096,
    "tie_word_embeddings": True,
    "vocab_size": 256000,
  },
}


# ---------------------------------------------------------------------------- checkpoints


def tensor_shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
  """Hugging Face tensor name -> shape, in the order transformers writes them."""
  d, f, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
  hd = cfg.get("head_dim", d // cfg["num_attention_heads"])
  q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
  norms = ["input_layernorm", "post_attention_layernorm"]
  if cfg["model_type"] == "gemma2":
    norms += ["pre_feedforward_layernorm", "post_feedforward_layernorm"]
  out = {"model.embed_tokens.weight": (v, d)}
  for i in range(cfg["num_hidden_layers"]):
    h = f"model.layers.{i}."
    for n in norms:
      out[h + f"{n}.weight"] = (d,)
    for p, s in (("q", (q, d)), ("k", (kv, d)), ("v", (kv, d)), ("o", (d, q))):
      out[h + f"self_attn.{p}_proj.weight"] = s
    for p, s in (("gate", (f, d)), ("up", (f, d)), ("down", (d, f))):
      out[h + f"mlp.{p}_proj.weight"] = s
  out["model.norm.weight"] = (d,)
  if not cfg["tie_word_embeddings"]:
    out["lm_head.weight"] = (v, d)
  return out


def n_params(cfg: dict) -> int:
  return sum(math.prod(s) for s in tensor_shapes(cfg).values())


_POOL = None


def _pool() -> np.ndarray:
  """64 Mi normal values (std 0.02) that every tensor takes its values from, cyclically, from a
  start of its own: random-looking weights at disk speed (drawing 8e9 normals takes minutes)."""
  global _POOL
  if _POOL is None:
    _POOL = (np.random.default_rng(0).standard_normal(2**26, np.float32) * 0.02).astype(np.float32)
  return _POOL


def _values(n: int, start: int, dtype, norm: bool, gemma: bool):
  """``n`` values in parts of at most 16 Mi, as ``dtype``."""
  pool = _pool()
  at = start % pool.size
  while n:
    k = min(n, pool.size - at, 2**24)
    part = pool[at : at + k]
    if norm and not gemma:
      part = part + np.float32(1.0)  # RMSNorm weights near 1 (Gemma stores 1 + w: near 0)
    yield part.astype(dtype)
    n, at = n - k, (at + k) % pool.size


def write_checkpoint(path: Path, cfg: dict, dtype: str, shard_bytes: int | None = None) -> int:
  """Writes config.json and the safetensors file(s) of ``cfg`` with random weights of
  ``dtype`` ("float32" / "bfloat16"), one tensor at a time; returns the weights' bytes."""
  import ml_dtypes

  np_dtype = np.dtype(ml_dtypes.bfloat16 if dtype == "bfloat16" else np.float32)
  st_dtype = {"float32": "F32", "bfloat16": "BF16"}[dtype]
  path.mkdir(parents=True, exist_ok=True)
  config = {k: v for k, v in cfg.items() if k != "name"}
  config["torch_dtype"] = dtype
  (path / "config.json").write_text(json.dumps(config, indent=2))
  shapes = tensor_shapes(cfg)
  shards: list[list[str]] = [[]]
  size = 0
  for name, shape in shapes.items():
    nbytes = math.prod(shape) * np_dtype.itemsize
    if shard_bytes and shards[-1] and size + nbytes > shard_bytes:
      shards.append([])
      size = 0
    shards[-1].append(name)
    size += nbytes
  gemma = cfg["model_type"] == "gemma2"
  files = (
    ["model.safetensors"]
    if len(shards) == 1
    else [f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors" for k in range(len(shards))]
  )
  total = 0
  for file, names in zip(files, shards):
    header, off = {}, 0
    for name in names:
      n = math.prod(shapes[name]) * np_dtype.itemsize
      header[name] = {
        "dtype": st_dtype,
        "shape": list(shapes[name]),
        "data_offsets": [off, off + n],
      }
      off += n
    header["__metadata__"] = {"format": "pt"}
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with (path / file).open("wb") as f:
      f.write(len(text).to_bytes(8, "little"))
      f.write(text)
      for name in names:
        norm = len(shapes[name]) == 1
        for part in _values(
          math.prod(shapes[name]), zlib.crc32(name.encode()) % 2**26, np_dtype, norm, gemma
        ):
          f.write(part.tobytes())
    total += off
  if len(files) > 1:
    index = {
      "metadata": {"total_size": total},
      "weight_map": {n: file for file, names in zip(files, shards) for n in names},
    }
    (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
  return total


# ------------------------------------------------------------------------------ children


def _status(key: str) -> int:
  with open("/proc/self/status") as f:
    for line in f:
      if line.startswith(key):
        return int(line.split()[1]) * 1024
  raise KeyError(key)


def _reset_peak() -> None:
  with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # VmHWM := VmRSS


def _tokens(vocab: int, seq: int, seed: int = 0) -> np.ndarray:
  return np.random.default_rng(seed).integers(1, vocab, (1, seq)).astype(np.int32)


def _jax_load(path, dtype, layout="columns"):
  import jax
  import jax.numpy as jnp

  from jaxlens.models import load_hf

  jnp.zeros(3).block_until_ready()
  base = _status("VmRSS:")
  _reset_peak()
  t0, c0 = time.perf_counter(), time.process_time()
  lm = load_hf(path, dtype=getattr(jnp, dtype), layout=layout)
  jax.block_until_ready(lm.variables)
  load_s, load_cpu_s = time.perf_counter() - t0, time.process_time() - c0
  weights = sum(x.nbytes for x in jax.tree.leaves(lm.variables))
  return lm, {
    "load_s": load_s,
    "load_cpu_s": load_cpu_s,
    "weights_bytes": weights,
    "base_rss": base,
    "load_peak_bytes": _status("VmHWM:") - base,
    "after_load_bytes": _status("VmRSS:") - base,
  }


def _bandwidth() -> dict:
  import jax
  import jax.numpy as jnp

  a = jnp.ones((GIB // 4,), jnp.float32)
  f = jax.jit(jnp.sum)
  f(a).block_until_ready()
  times = []
  for _ in range(7):
    t0 = time.perf_counter()
    f(a).block_until_ready()
    times.append(time.perf_counter() - t0)
  del a
  s = sorted(times)[3]
  return {"bytes": GIB, "median_s": s, "gb_s": GIB / s / 1e9}


def _step_bytes(variables, tied: bool) -> int:
  """Bytes of parameters a decoding step reads: every array once, except an untied token
  embedding (one row is read); a tied one is read whole by the unembedding."""
  import jax

  total = sum(x.nbytes for x in jax.tree.leaves(variables))
  if not tied:
    total -= variables["params"]["embed"]["embedding"].nbytes
  return total


def child_jax(args) -> dict:
  import jax
  import jax.numpy as jnp

  import jaxlens as jl

  if args.widen_bytes:
    import jaxlens.models.compact

    jaxlens.models.compact.WIDEN_BYTES = args.widen_bytes
    jaxlens.models.compact.WIDEN_BYTES_FEW = args.widen_bytes
  out: dict = {"side": "jaxlens", "dtype": args.dtype}
  lm, out["load"] = _jax_load(args.path, args.dtype, args.layout)
  out["layout"] = args.layout
  cfg = json.loads((Path(args.path) / "config.json").read_text())
  model, variables = lm.model, lm.variables
  base = out["load"]["base_rss"]
  weights = out["load"]["weights_bytes"]
  if "trace" in args.parts:
    x = jnp.asarray(_tokens(cfg["vocab_size"], args.seq))
    every = jl.module("blocks*/resid_post")

    def values(v, x):
      t = jl.trace(model, v, x, save=every, keep_inputs=False)
      return t.output, t.values

    f = jax.jit(values)
    _reset_peak()
    t0, c0 = time.perf_counter(), time.process_time()
    logits, saved = jax.block_until_ready(f(variables, x))
    first, first_cpu = time.perf_counter() - t0, time.process_time() - c0
    del logits, saved  # the peak is one trace's: the first call's values are not kept alive
    t0, c0 = time.perf_counter(), time.process_time()
    logits, saved = jax.block_until_ready(f(variables, x))
    second, second_cpu = time.perf_counter() - t0, time.process_time() - c0
    saved_bytes = sum(v.nbytes for v in jax.tree.leaves(saved))
    peak = _status("VmHWM:") - base
    np.save(Path(args.work) / f"jax_{args.dtype}_logits.npy", np.asarray(logits[0, -1], np.float32))
    out["trace"] = {
      "seq": args.seq,
      "sites": len(saved),
      "first_s": first,
      "first_cpu_s": first_cpu,
      "second_s": second,
      "second_cpu_s": second_cpu,
      "saved_bytes": saved_bytes,
      "logits_bytes": logits.nbytes,
      "peak_bytes": peak,
      "peak_over_weights_saved": peak / (weights + saved_bytes),
      "peak_over_weights_saved_logits": peak / (weights + saved_bytes + logits.nbytes),
    }
    del logits, saved, f
    print("trace", out["trace"], file=sys.stderr, flush=True)
  if "decode" in args.parts:
    bw = _bandwidth()
    prompt = jnp.asarray(_tokens(cfg["vocab_size"], 8, seed=1))

    def gen(n):
      return jl.generate(model, variables, prompt, n).tokens

    times = {}
    for n in (1, args.new):
      jax.block_until_ready(gen(n))  # compiles
      ts = []
      for _ in range(args.repeats):
        t0, c0 = time.perf_counter(), time.process_time()
        toks = jax.block_until_ready(gen(n))
        ts.append((time.perf_counter() - t0, time.process_time() - c0))
      times[n] = sorted(ts)[len(ts) // 2]
    step_s = (times[args.new][0] - times[1][0]) / (args.new - 1)
    step_cpu_s = (times[args.new][1] - times[1][1]) / (args.new - 1)
    b = _step_bytes(variables, cfg["tie_word_embeddings"])
    floor_s = b / (bw["gb_s"] * 1e9)
    np.save(Path(args.work) / f"jax_{args.dtype}_tokens.npy", np.asarray(toks))
    out["decode"] = {
      "bandwidth": bw,
      "new_tokens": args.new,
      "generate_s": {str(k): v[0] for k, v in times.items()},
      "generate_cpu_s": {str(k): v[1] for k, v in times.items()},
      "step_s": step_s,
      "step_cpu_s": step_cpu_s,
      "tokens_per_s": 1 / step_s,
      "step_bytes": b,
      "floor_s": floor_s,
      "floor_tokens_per_s": 1 / floor_s,
      "of_floor": floor_s / step_s,
      "peak_bytes": _status("VmHWM:") - base,
    }
    print("decode", out["decode"], file=sys.stderr, flush=True)
  if "sweep" in args.parts:
    clean = jnp.asarray(_tokens(cfg["vocab_size"], args.sweep_seq, seed=2))
    corrupt = clean.at[0, 3].set((clean[0, 3] + 1) % cfg["vocab_size"])
    _reset_peak()
    times, cpus = [], []
    for _ in range(2):
      t0, c0 = time.perf_counter(), time.process_time()
      grid = jax.block_until_ready(
        jl.sweep.patching_sweep(model, variables, clean, corrupt, _metric)
      )
      times.append(time.perf_counter() - t0)
      cpus.append(time.process_time() - c0)
    np.save(Path(args.work) / f"jax_{args.dtype}_sweep.npy", np.asarray(grid, np.float32))
    out["sweep"] = {
      "grid": list(grid.shape),
      "first_s": times[0],
      "second_s": times[1],
      "second_cpu_s": cpus[1],
      "peak_bytes": _status("VmHWM:") - base,
      "peak_over_weights": (_status("VmHWM:") - base) / weights,
    }
    print("sweep", out["sweep"], file=sys.stderr, flush=True)
  if "graph" in args.parts:
    out["graph"] = _graph(model, variables, cfg, args, base, weights)
    print("graph", out["graph"], file=sys.stderr, flush=True)
  return out


def _graph(model, variables, cfg, args, base, weights) -> dict:
  """An attribution graph (``jaxlens.circuits.attribute``) of a ``--sweep-seq``-token prompt
  through random transcoders of ``--features`` features, each feature's encoder bias set so
  that about 1% of the prompt's positions activate it, under a budget of ``--graph-nodes``
  feature nodes: time, CPU time and peak RSS of the one call (its compilation included).

  ``--graph-layers four``: transcoders on four layers (first, a third, two thirds, last;
  ``None`` elsewhere). ``--graph-layers all``: one on every layer (circuit-tracer needs one per
  layer), the prompt's first token 0 (the stand-in tokenizer's special token) and its
  activations zeroed as circuit-tracer does; the transcoders and the graph are then written to
  ``--work`` for :mod:`benchmarks.bench_big_ct`, which builds the same graph in circuit-tracer.
  """
  import jax
  import jax.numpy as jnp

  import jaxlens as jl
  from jaxlens import circuits, sae

  n, d = cfg["num_hidden_layers"], cfg["hidden_size"]
  every = args.graph_layers == "all"
  layers = list(range(n)) if every else sorted({0, n // 3, 2 * n // 3, n - 1})
  toks = _tokens(cfg["vocab_size"], args.sweep_seq, seed=3)
  if every:
    toks[0, 0] = 0
  tokens = jnp.asarray(toks)
  dtype = jax.tree.leaves(variables)[0].dtype
  inputs = jl.trace(
    model, variables, tokens, save=jl.module("blocks_*/ln_2"), keep_inputs=False
  ).values
  transcoders: list = [None] * n
  for i in layers:
    t = sae.Transcoder.init(jax.random.key(i), d_in=d, d_sae=args.features, dtype=dtype)
    x = inputs[f"blocks_{i}/ln_2"].reshape(-1, d).astype(jnp.float32)
    pre = x @ t.W_enc.astype(jnp.float32)
    cut = jnp.quantile(pre, 0.99, axis=0)  # each feature fires at ~1% of the positions
    transcoders[i] = t.replace(b_enc=(-cut).astype(dtype), W_dec=t.W_dec * 30.0)
  del inputs
  _reset_peak()
  t0, c0 = time.perf_counter(), time.process_time()
  graph = circuits.attribute(
    model,
    variables,
    tokens,
    transcoders,
    max_feature_nodes=args.graph_nodes,
    batch_size=64,
    zero_bos=every,
  )
  seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
  peak = _status("VmHWM:") - base
  if every:
    f32 = lambda a: np.asarray(a, np.float32)  # noqa: E731
    np.savez(
      Path(args.work) / f"jax_{args.dtype}_graph.npz",
      tokens=toks[0],
      adjacency=f32(graph.adjacency),
      active_features=np.asarray(graph.active_features),
      activation_values=f32(graph.activation_values),
      selected_features=np.asarray(graph.selected_features),
      logit_tokens=np.asarray(graph.logit_tokens),
      **{
        f"tc{i}/{k}": f32(getattr(transcoders[i], k))
        for i in layers
        for k in ("W_enc", "b_enc", "W_dec", "b_dec")
      },
    )
  return {
    "layers": layers,
    "features_per_layer": args.features,
    "seq": args.sweep_seq,
    "zero_bos": every,
    "active_features": int(len(graph.active_features)),
    "feature_nodes_budget": args.graph_nodes,
    "adjacency_shape": list(graph.adjacency.shape),
    "s": seconds,
    "cpu_s": cpu,
    "load_average": os.getloadavg(),
    "peak_bytes": peak,
    "peak_over_weights": peak / weights,
  }


def child_products(args) -> dict:
  """One token's product with one bfloat16 ``2048 x 8192`` kernel (Llama-3.2-1B's MLP shape),
  spelled each way XLA:CPU might compute it well: time, the bfloat16 bytes over the time against
  a jitted sum's bandwidth (measured between the rounds), XLA's temporary bytes (a whole float32
  copy of the kernel is 67 MB), and the largest difference from ``times_wide``'s product over
  float32's bound for a sum of ``k`` products (``k * 2**-24 * sum |x w|``; <= 1 is within it)."""
  import jax
  import jax.numpy as jnp

  from jaxlens.models import compact

  f32 = jnp.float32
  k, n = 2048, 8192
  rng = np.random.default_rng(0)
  w = jnp.asarray(rng.standard_normal((k, n), np.float32) * 0.02).astype(jnp.bfloat16)
  w_t = jnp.asarray(np.asarray(w).T.copy())  # the kernel stored transposed, (out, in)
  x = jnp.asarray(rng.standard_normal((1, k), np.float32))
  dims = (((1,), (0,)), ((), ()))

  def chunked(budget):
    def f(x, w, w_t):
      compact.WIDEN_BYTES_FEW, old = budget, compact.WIDEN_BYTES_FEW
      try:
        return compact.times_wide(x, w, 0, f32)
      finally:
        compact.WIDEN_BYTES_FEW = old

    return f

  ways = {
    "times_wide, 2 MiB chunks (now)": chunked(2**21),
    "times_wide, 4 MiB chunks (before)": chunked(2**22),
    "times_wide, 1 MiB chunks": chunked(2**20),
    "x @ w.astype(float32) (whole widening)": lambda x, w, w_t: x @ w.astype(f32),
    "dot_general, bfloat16 operands, preferred float32": lambda x, w, w_t: jax.lax.dot_general(
      x.astype(jnp.bfloat16), w, dims, preferred_element_type=f32
    ),
    "dot_general, algorithm BF16_BF16_F32": lambda x, w, w_t: jax.lax.dot_general(
      x.astype(jnp.bfloat16),
      w,
      dims,
      precision=jax.lax.DotAlgorithmPreset.BF16_BF16_F32,
      preferred_element_type=f32,
    ),
    "sum(x[:, :, None] * w.astype(f32), 1)": lambda x, w, w_t: jnp.sum(
      x[:, :, None] * w.astype(f32)[None], axis=1
    ),
    "sum(x[0] * w_t.astype(f32), -1) (transposed kernel)": lambda x, w, w_t: jnp.sum(
      x[0] * w_t.astype(f32), axis=-1
    )[None],
    "float32 kernel, x @ w (4 bytes a weight)": None,
  }
  w32 = w.astype(f32)
  x64, w64 = np.asarray(x, np.float64), np.asarray(w, np.float64)
  bound = k * 2.0**-24 * (np.abs(x64) @ np.abs(w64))
  want = np.asarray(jax.jit(compact.times_wide, static_argnums=(2, 3))(x, w, 0, f32), np.float64)
  fns, out = {}, {}
  for name, f in ways.items():
    if f is None:
      fn, a = jax.jit(lambda x, w: x @ w), (x, w32)
    else:
      fn, a = jax.jit(f), (x, w, w_t)
    compiled = fn.lower(*a).compile()
    y = np.asarray(fn(*a), np.float64).reshape(want.shape)
    fns[name] = (fn, a)
    out[name] = {
      "temp_bytes": compiled.memory_analysis().temp_size_in_bytes,
      "of_bound_vs_times_wide": float(np.max(np.abs(y - want) / bound)),
      "of_bound_vs_float64": float(np.max(np.abs(y - x64 @ w64) / bound)),
    }
    jax.block_until_ready(fn(*a))
  a = jnp.ones((GIB // 4,), f32)
  total = jax.jit(jnp.sum)
  total(a).block_until_ready()
  times: dict = {name: [] for name in fns}
  sums = []
  for r in range(args.repeats * 5):
    t0 = time.perf_counter()
    total(a).block_until_ready()
    sums.append(time.perf_counter() - t0)
    for name in list(fns) if r % 2 else list(fns)[::-1]:
      fn, a_ = fns[name]
      t0 = time.perf_counter()
      jax.block_until_ready(fn(*a_))
      times[name].append(time.perf_counter() - t0)
  gb_s = GIB / float(np.median(sums)) / 1e9
  for name in fns:
    t = float(np.median(times[name]))
    out[name].update({"s": t, "min_s": min(times[name]), "of_floor": w.nbytes / t / 1e9 / gb_s})
  return {"bandwidth_gb_s": gb_s, "load": os.getloadavg()[0], "bytes": w.nbytes, "ways": out}


# The sweep's metric: the last position's logit of token 1 minus token 2 (module level, so the
# sweep's program is not recompiled for a new closure).
def _metric(logits):
  return (logits[..., -1, 1] - logits[..., -1, 2]).sum()


def child_torch(args) -> dict:
  import torch
  import transformers

  torch.set_num_threads(args.threads)
  tdtype = getattr(torch, args.dtype)
  out: dict = {"side": "transformers", "dtype": args.dtype, "threads": torch.get_num_threads()}
  cfg = json.loads((Path(args.path) / "config.json").read_text())
  base = _status("VmRSS:")
  _reset_peak()
  t0, c0 = time.perf_counter(), time.process_time()
  hf = transformers.AutoModelForCausalLM.from_pretrained(args.path, dtype=tdtype).eval()
  weights = sum(p.numel() * p.element_size() for p in hf.parameters())
  out["load"] = {
    "load_s": time.perf_counter() - t0,
    "load_cpu_s": time.process_time() - c0,
    "weights_bytes": weights,
    "load_peak_bytes": _status("VmHWM:") - base,
    "after_load_bytes": _status("VmRSS:") - base,
  }
  print("torch load", out["load"], file=sys.stderr, flush=True)
  with torch.no_grad():
    if "trace" in args.parts:
      x = torch.as_tensor(_tokens(cfg["vocab_size"], args.seq), dtype=torch.long)
      times = []
      _reset_peak()
      for _ in range(2):
        t0, c0 = time.perf_counter(), time.process_time()
        res = hf(x, output_hidden_states=True)
        times.append((time.perf_counter() - t0, time.process_time() - c0))
      saved = sum(h.numel() * h.element_size() for h in res.hidden_states[1:])
      np.save(Path(args.work) / f"torch_{args.dtype}_logits.npy", res.logits[0, -1].float().numpy())
      peak = _status("VmHWM:") - base
      out["trace"] = {
        "first_s": times[0][0],
        "second_s": times[1][0],
        "second_cpu_s": times[1][1],
        "saved_bytes": saved,
        "logits_bytes": res.logits.numel() * res.logits.element_size(),
        "peak_bytes": peak,
        "peak_over_weights_saved": peak / (weights + saved),
      }
      del res
      print("torch trace", out["trace"], file=sys.stderr, flush=True)
    if "decode" in args.parts:
      prompt = torch.as_tensor(_tokens(cfg["vocab_size"], 8, seed=1), dtype=torch.long)

      def gen(n):
        return hf.generate(
          prompt, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0
        )

      times = {}
      for n in (1, args.new):
        gen(n)
        ts = []
        for _ in range(args.repeats):
          t0, c0 = time.perf_counter(), time.process_time()
          toks = gen(n)
          ts.append((time.perf_counter() - t0, time.process_time() - c0))
        times[n] = sorted(ts)[len(ts) // 2]
      step = (times[args.new][0] - times[1][0]) / (args.new - 1)
      step_cpu = (times[args.new][1] - times[1][1]) / (args.new - 1)
      np.save(Path(args.work) / f"torch_{args.dtype}_tokens.npy", toks[:, 8:].numpy())
      out["decode"] = {
        "step_s": step,
        "step_cpu_s": step_cpu,
        "tokens_per_s": 1 / step,
        "generate_s": {str(k): v for k, v in times.items()},
      }
      print("torch decode", out["decode"], file=sys.stderr, flush=True)
    if "sweep" in args.parts:
      out["sweep"] = _torch_sweep(hf, cfg, args)
      print("torch sweep", out["sweep"], file=sys.stderr, flush=True)
  return out


def _sweep_cells(n_layers: int, seq: int, count: int) -> list[tuple[int, int]]:
  """The (row, position) cells transformers' sweep runs: all of them (``count`` 0), or
  ``count`` spread evenly over the grid in row-major order."""
  cells = [(i, p) for i in range(n_layers) for p in range(seq)]
  if not count or count >= len(cells):
    return cells
  return [cells[round(k * len(cells) / count)] for k in range(count)]


def _torch_sweep(hf, cfg, args) -> dict:
  """``child_jax``'s patching grid as a transformers user computes it: forward hooks, one
  forward of the corrupt prompt per cell. Row ``i`` patches the residual stream entering layer
  ``i`` (jaxlens's default sites, ``blocks_{i}/resid_pre``): the output of layer ``i - 1``
  (its ``resid_post``), or for row 0 the token embedding's, at one position, from the clean
  run. The cells alternate between one torch thread and torch's default; each cell's wall
  time is kept with its thread count, and the peak RSS is the process's over the sweep."""
  import torch

  clean = torch.as_tensor(_tokens(cfg["vocab_size"], args.sweep_seq, seed=2), dtype=torch.long)
  corrupt = clean.clone()
  corrupt[0, 3] = (corrupt[0, 3] + 1) % cfg["vocab_size"]
  layers = hf.model.layers
  # the module whose output is the stream entering layer i
  writers = [hf.model.embed_tokens, *layers[:-1]]
  default = torch.get_num_threads()
  base = _status("VmRSS:")
  _reset_peak()
  t_all, c_all = time.perf_counter(), time.process_time()
  stored = {}

  def keep(i):
    def hook(module, inputs, output):
      stored[i] = output.detach().clone()

    return hook

  handles = [w.register_forward_hook(keep(i)) for i, w in enumerate(writers)]
  hf(clean)
  for h in handles:
    h.remove()
  cells = _sweep_cells(len(layers), args.sweep_seq, args.sweep_cells)
  grid = np.full((len(layers), args.sweep_seq), np.nan, np.float32)
  per_cell: dict = {1: [], default: []}
  for k, (i, p) in enumerate(cells):

    def patch(module, inputs, output, i=i, p=p):
      out = output.clone()
      out[:, p] = stored[i][:, p]
      return out

    threads = 1 if k % 2 == 0 else default
    torch.set_num_threads(threads)
    handle = writers[i].register_forward_hook(patch)
    t0 = time.perf_counter()
    logits = hf(corrupt).logits
    grid[i, p] = float(logits[0, -1, 1] - logits[0, -1, 2])
    per_cell[threads].append(time.perf_counter() - t0)
    handle.remove()
  torch.set_num_threads(args.threads)
  np.save(Path(args.work) / f"torch_{args.dtype}_sweep.npy", grid)
  medians = {str(t): float(np.median(v)) for t, v in per_cell.items() if v}
  best = min(medians.values())
  n_all = len(layers) * args.sweep_seq
  return {
    "grid": list(grid.shape),
    "cells_run": len(cells),
    "time_s": time.perf_counter() - t_all,
    "cpu_s": time.process_time() - c_all,
    "cell_median_s": medians,
    "best_threads": min(medians, key=medians.get),
    "all_cells_at_best_s": best * n_all,
    "load_average": os.getloadavg(),
    "peak_bytes": _status("VmHWM:") - base,
    "rss_before_bytes": base,
  }


# ------------------------------------------------------------------------------- parent


def _available_gb() -> float:
  with open("/proc/meminfo") as f:
    for line in f:
      if line.startswith("MemAvailable:"):
        return int(line.split()[1]) / 2**20
  return 0.0


def _run_child(argv: list[str], need_gb: float, timeout: float) -> dict:
  if _available_gb() < need_gb:
    return {"skipped": f"{_available_gb():.1f} GB available, {need_gb:.1f} GB needed"}
  cmd = [sys.executable, str(Path(__file__).resolve()), "--child", *argv]
  print("$", " ".join(cmd[2:]), flush=True)
  try:
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
  except subprocess.TimeoutExpired:
    return {"error": f"timed out after {timeout:.0f} s"}
  sys.stderr.write(run.stderr[-3000:])
  if run.returncode != 0:
    return {"error": run.stderr[-2000:]}
  return json.loads(run.stdout.strip().splitlines()[-1])


def _zoo_takes_rope_scaling(cfg: dict) -> bool:
  from jaxlens.models import LoadError, config_from_hf

  try:
    config_from_hf({k: v for k, v in cfg.items() if k != "name"})
  except LoadError:
    return False
  return True


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--models", default="1b,2b", help="comma-separated of 1b, 2b, 8b, tiny")
  p.add_argument("--dtypes", default="float32,bfloat16")
  p.add_argument("--parts", default="load,trace,decode,sweep")
  p.add_argument("--torch", action="store_true", help="transformers' figures beside")
  p.add_argument("--no-jax", dest="no_jax", action="store_true", help="transformers' figures only")
  p.add_argument(
    "--widen-bytes",
    dest="widen_bytes",
    type=int,
    default=0,
    help="one chunk size (compact.WIDEN_BYTES and WIDEN_BYTES_FEW) for jaxlens (0: the library's)",
  )
  p.add_argument("--threads", default="1,0", help="torch thread counts (0: its default)")
  p.add_argument("--seq", type=int, default=512, help="tokens of the trace")
  p.add_argument("--new", type=int, default=16, help="new tokens of the decoding")
  p.add_argument("--sweep-seq", type=int, default=16, help="positions of the sweep")
  p.add_argument("--repeats", type=int, default=3)
  p.add_argument("--features", type=int, default=4096, help="features of each graph transcoder")
  p.add_argument("--graph-nodes", dest="graph_nodes", type=int, default=128)
  p.add_argument(
    "--graph-layers",
    dest="graph_layers",
    choices=("four", "all"),
    default="four",
    help="transcoders on four layers, or on every layer (as circuit-tracer needs)",
  )
  p.add_argument(
    "--ct",
    action="store_true",
    help="circuit-tracer's graph beside (float32, --graph-layers all; needs /work/venv-ct)",
  )
  p.add_argument("--ct-python", dest="ct_python", default="/work/venv-ct/bin/python")
  p.add_argument(
    "--sweep-cells",
    dest="sweep_cells",
    type=int,
    default=0,
    help="transformers' sweep: time only this many cells, spread over the grid (0: all)",
  )
  p.add_argument("--dir", default=None, help="where to write the checkpoints (a temp dir)")
  p.add_argument("--keep", action="store_true", help="keep the checkpoints")
  p.add_argument("--out", default=str(DEFAULT_OUT))
  # a child's arguments
  p.add_argument("--child", choices=("jax", "torch", "products"), default=None)
  p.add_argument("--path", default=None)
  p.add_argument("--work", default=None)
  p.add_argument("--dtype", default="float32")
  p.add_argument(
    "--layout",
    default="columns",
    choices=("columns", "rows"),
    help="a child's load_hf layout (the parent runs decode in both)",
  )
  p.add_argument("--threads-one", dest="threads_one", type=int, default=0)
  return p.parse_args(argv)


def _child_argv(args, side, path, dtype, parts, threads=0) -> list[str]:
  return [
    side,
    "--path",
    str(path),
    "--work",
    str(args.work),
    "--dtype",
    dtype,
    "--parts",
    ",".join(parts),
    "--seq",
    str(args.seq),
    "--new",
    str(args.new),
    "--sweep-seq",
    str(args.sweep_seq),
    "--repeats",
    str(args.repeats),
    "--threads-one",
    str(threads),
    "--widen-bytes",
    str(args.widen_bytes),
    "--features",
    str(args.features),
    "--graph-nodes",
    str(args.graph_nodes),
    "--graph-layers",
    args.graph_layers,
    "--sweep-cells",
    str(args.sweep_cells),
  ]


def main(argv=None) -> dict:
  args = parse_args(argv)
  if args.child:
    args.parts = args.parts.split(",")
    args.threads = args.threads_one or (os.cpu_count() or 1)
    child = {"jax": child_jax, "torch": child_torch, "products": child_products}[args.child]
    result = child(args)
    print(json.dumps(result, default=float))
    return result
  root = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="jaxlens_big_"))
  args.work = root / "work"
  args.work.mkdir(parents=True, exist_ok=True)
  models = [m for m in args.models.split(",") if m]
  dtypes = [d for d in args.dtypes.split(",") if d]
  parts = [p for p in args.parts.split(",") if p]
  results: dict = {"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "models": {}}
  if DEFAULT_OUT.exists() and args.out == str(DEFAULT_OUT):
    results["models"] = json.loads(DEFAULT_OUT.read_text()).get("models", {})
  if "products" in parts:
    # one matrix, no checkpoint: the ways of multiplying a bfloat16 kernel, for one token
    results["products"] = _run_child(["products", "--repeats", str(args.repeats)], 1.5, 1800)
    print(json.dumps(results["products"], indent=1, default=float), flush=True)
    parts.remove("products")
    if not parts:
      models = []
  try:
    for m in models:
      cfg = dict(CONFIGS[m])
      note = None
      if "rope_scaling" in cfg and not _zoo_takes_rope_scaling(cfg):
        cfg.pop("rope_scaling")
        note = "rope_scaling removed from the config (the zoo refused it)"
      res = results["models"].setdefault(cfg["name"], {})
      res["params"] = n_params(cfg)
      res["rope_scaling"] = note or "as published"
      for dtype in dtypes if m != "8b" else ["bfloat16"]:
        weights_gb = n_params(cfg) * (4 if dtype == "float32" else 2) / 1e9
        one = root / f"{m}_{dtype}"
        shards = root / f"{m}_{dtype}_sharded"
        t0 = time.perf_counter()
        if m != "8b":
          write_checkpoint(one, cfg, dtype)
        write_checkpoint(shards, cfg, dtype, shard_bytes=5 * 10**9 if m == "8b" else GIB)
        r = res.setdefault(dtype, {})
        r["write_s"] = time.perf_counter() - t0
        need = weights_gb * 1.1 + 1.0  # a load: the weights and a part (the rest: more)
        # loading only, every layout and cast: the same-dtype file, the other dtype's file
        if "load" in parts and not args.no_jax:
          r["load_sharded"] = _run_child(
            _child_argv(args, "jax", shards, dtype, ["load"]), need, 1800
          )
          if m != "8b":
            r["load_single"] = _run_child(
              _child_argv(args, "jax", one, dtype, ["load"]), need, 1800
            )
        src = shards if m == "8b" else one
        rest = [p for p in parts if p not in ("load", "casts")]
        if rest and not args.no_jax:
          r["jax"] = _run_child(_child_argv(args, "jax", src, dtype, rest), need + 2, 3600)
        if "decode" in parts and not args.no_jax:
          # the same decoding with every kernel kept as the checkpoint's (out, in) rows
          r["jax_rows"] = _run_child(
            _child_argv(args, "jax", src, dtype, ["decode"]) + ["--layout", "rows"], need + 2, 3600
          )
        if args.ct and "graph" in parts and dtype == "float32":
          r["circuit_tracer"] = _run_ct(args, src, need + 2)
          r["graph_agreement"] = _compare_graphs(args.work, dtype)
          print("graph agreement", r["graph_agreement"], flush=True)
        if args.torch:
          # load, trace and decode at each thread count; the sweep (hundreds of forwards) in
          # one child whose cells alternate between the thread counts
          for t in [int(x) for x in args.threads.split(",")]:
            some = [p for p in parts if p not in ("sweep", "casts", "graph")]
            if not some:
              break
            r[f"torch_{t or 'default'}"] = _run_child(
              _child_argv(args, "torch", src, dtype, some, t), need + 1, 3600
            )
          if "sweep" in parts:
            # one child: its cells alternate between one thread and the default
            r["torch_sweep"] = _run_child(
              _child_argv(args, "torch", src, dtype, ["sweep"], 0), need + 1, 3600
            )
        _compare(args.work, dtype, r)
        print(json.dumps({cfg["name"]: {dtype: r}}, indent=1, default=float), flush=True)
        if not args.keep:
          for d in (one, shards):
            shutil.rmtree(d, ignore_errors=True)
      if m != "8b" and "casts" in parts:
        # the casts: the bfloat16 file into a float32 model and the float32 file into bfloat16
        res["casts"] = {}
        for file_dtype, model_dtype in (("bfloat16", "float32"), ("float32", "bfloat16")):
          path = root / f"{m}_{file_dtype}"
          write_checkpoint(path, cfg, file_dtype)
          need = n_params(cfg) * (4 if model_dtype == "float32" else 2) / 1e9 * 1.25 + 1.5
          res["casts"][f"{file_dtype} file -> {model_dtype}"] = _run_child(
            _child_argv(args, "jax", path, model_dtype, ["load"]), need, 1800
          )
          shutil.rmtree(path, ignore_errors=True)
  finally:
    if not args.keep:
      shutil.rmtree(root, ignore_errors=True)
  if args.out:
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=1, default=float) + "\n")
    print("wrote", args.out)
  return results


SECTION = "## Billion-parameter models on one 24 GB machine"


def kept_section(page: Path) -> str | None:
  """The section of docs/performance.md this benchmark's figures are written in, as the page
  has it now (``run_all`` keeps it when it rewrites the page), or None."""
  if not Path(page).exists():
    return None
  text = Path(page).read_text()
  start = text.find(SECTION)
  if start < 0:
    return None
  end = text.find("\n## ", start + len(SECTION))
  return text[start : end if end >= 0 else len(text)].rstrip("\n")


def _run_ct(args, path: Path, need_gb: float) -> dict:
  """circuit-tracer's graph of the jaxlens child's transcoders and prompt
  (benchmarks/bench_big_ct.py, in circuit-tracer's environment)."""
  if _available_gb() < need_gb:
    return {"skipped": f"{_available_gb():.1f} GB available, {need_gb:.1f} GB needed"}
  script = Path(__file__).resolve().parent / "bench_big_ct.py"
  cmd = [args.ct_python, str(script), "--path", str(path), "--work", str(args.work)]
  cmd += ["--nodes", str(args.graph_nodes), "--repeats", str(args.repeats)]
  print("$", " ".join(cmd), flush=True)
  try:
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
  except subprocess.TimeoutExpired:
    return {"error": "timed out after 3600 s"}
  sys.stderr.write(run.stderr[-3000:])
  if run.returncode != 0:  # -9: killed (out of memory on the shared machine)
    return {"error": run.stderr[-2000:], "returncode": run.returncode}
  return json.loads(run.stdout.strip().splitlines()[-1])


def _compare_graphs(work: Path, dtype: str) -> dict:
  """jaxlens's graph against circuit-tracer's: the same active features (and their
  activations), the same selected feature nodes and logit targets, and the adjacency's largest
  difference relative to its largest entry (float32 rounding: about 1e-6 to 1e-4)."""
  a_file, b_file = Path(work) / f"jax_{dtype}_graph.npz", Path(work) / f"ct_{dtype}_graph.npz"
  if not (a_file.exists() and b_file.exists()):
    return {"missing": [str(f) for f in (a_file, b_file) if not f.exists()]}
  a, b = np.load(a_file), np.load(b_file)
  out: dict = {
    "active_features": [len(a["active_features"]), len(b["active_features"])],
    "same_active_features": bool(np.array_equal(a["active_features"], b["active_features"])),
    "same_selected": bool(np.array_equal(a["selected_features"], b["selected_features"])),
    "same_logit_tokens": bool(np.array_equal(a["logit_tokens"], b["logit_tokens"])),
    "adjacency_shapes": [list(a["adjacency"].shape), list(b["adjacency"].shape)],
  }
  if out["same_active_features"]:
    va, vb = a["activation_values"].astype(np.float64), b["activation_values"].astype(np.float64)
    out["activations_rel_max_diff"] = float(np.abs(va - vb).max() / np.abs(vb).max())
  if a["adjacency"].shape == b["adjacency"].shape:
    x, y = a["adjacency"].astype(np.float64), b["adjacency"].astype(np.float64)
    scale = np.abs(y).max()
    out["adjacency_rel_max_diff"] = float(np.abs(x - y).max() / scale)
    # a small slice: the first 8 feature rows against every source, entry by entry
    big = np.abs(y[:8]) > 1e-3 * scale
    out["slice_rows_8_entries_over_1e-3"] = int(big.sum())
    out["slice_rel_max_diff"] = float((np.abs(x[:8] - y[:8])[big] / np.abs(y[:8])[big]).max())
  out["logit_tokens"] = [a["logit_tokens"].tolist(), b["logit_tokens"].tolist()]
  n = len(b["logit_tokens"])
  if a["adjacency"].shape == b["adjacency"].shape and n:
    rows = (np.abs(a["adjacency"][-n:] - b["adjacency"][-n:])).max()
    out["logit_rows_rel_max_diff"] = float(rows / np.abs(b["adjacency"][-n:]).max())
  for f in (a_file, b_file):  # kept under --keep, for a second look
    f.rename(f.with_suffix(".compared.npz"))
  return out


def _compare(work: Path, dtype: str, r: dict) -> None:
  """jaxlens against transformers on the same weights: the trace's last logits (relative max
  difference), the greedy tokens, the sweep grid."""
  work = Path(work)
  out = {}
  for what in ("logits", "tokens", "sweep"):
    a, b = work / f"jax_{dtype}_{what}.npy", work / f"torch_{dtype}_{what}.npy"
    if a.exists() and b.exists():
      x, y = np.load(a).astype(np.float64), np.load(b).astype(np.float64)
      if what == "tokens":
        out["tokens_differing"] = int((x != y).sum())
        out["tokens"] = int(x.size)
      elif what == "sweep":  # transformers may have run a subset of the cells (NaN elsewhere)
        ran = np.isfinite(y)
        out["sweep_cells_compared"] = int(ran.sum())
        out["sweep_rel_max_diff"] = float(np.abs(x - y)[ran].max() / max(np.abs(x).max(), 1e-30))
        out["sweep_abs_max_diff"] = float(np.abs(x - y)[ran].max())
      else:
        out[f"{what}_rel_max_diff"] = float(np.abs(x - y).max() / max(np.abs(y).max(), 1e-30))
  for f in work.glob(f"*_{dtype}_*.npy"):
    f.unlink()
  if out:
    r["agreement"] = out


if __name__ == "__main__":
  main()
