"""Trained interventions: jaxlens.train against pyvene 0.1.8 on the same GPT-2, in one process.

The model is a random GPT-2 (Hugging Face ``GPT2LMHeadModel``; default 4 layers, d_model 256,
vocabulary 512), saved with ``save_pretrained`` and loaded into jaxlens's zoo ``GPT2`` with
``jaxlens.models.load_hf``: the same weights on both sides. Three figures, each the ratio of
medians of interleaved calls (the order flips every round). pyvene runs at
``torch.set_num_threads(1)`` and at torch's default, both interleaved with jaxlens in the same
process (``benchmarks._torch_peer``); the faster setting counts, and each side's wall and CPU
time per step are reported:

* a DAS training step (interchange dim d/4 at the last position of ``blocks_{L/2}``'s output,
  cross-entropy on the last token, one adam step): pyvene's ``RotatedSpaceIntervention`` with
  ``loss.backward()`` and ``torch.optim.Adam`` / a jitted jaxlens step (target >= 3x), the
  jaxlens step both as it runs the model (the base run and the source run up to the site)
  and with the site's values cached (``cache_prefix=True``: ``jt.site_values`` once, then
  ``jt.intervened_output(..., site_values=)``, whose prefix is dead code in the program);
  both read the logits at the last position only (``output_positions=``, as
  ``jt.train_iit`` does with its default readout: the last block's query and the
  unembedding there alone);
* a LoReFT training step (rank 4 at every position of the same site, loss on the last half of
  the tokens): pyvene with pyreft's ``LoreftIntervention`` formula as a pyvene intervention /
  jaxlens, uncached and cached (tokens per second, and the ratio; target >= 3x). The loss
  counts 15 of the 32 positions (the weights' nonzero ones, as pyreft's -100 labels mask
  the prompt): jaxlens computes the logits there only (``output_positions=``, as
  ``jt.train_reft`` does: the last block's queries and the unembedding at those positions),
  pyvene at every position, as pyreft does;
* end to end over ``--epochs`` epochs of ``--n-batches`` batches: ``jt.train_iit`` /
  ``jt.train_reft`` as a user calls them (tracing, compilation, the structural check and,
  cached, the capture pass all counted) against pyvene's loop over the same batches at its
  faster thread setting of the step figures; each jaxlens loop is called twice, the second
  call ("again") finding its compiled programs in JAX's persistent compilation cache when one
  is on (jaxlens's default; run with ``JAXLENS_COMPILATION_CACHE=<a new directory>`` so the
  first call compiles, or ``=0`` so both do);
* ``jl.generate`` of 32 tokens with the trained LoReFT live / without an edit (target <= 1.05).

Each step's compiled program is described too (``flops`` from XLA's cost analysis, the
number of ``dot_general`` in the lowered program): the cached step's lack the prefix.

Usage::

  python benchmarks/bench_train.py [--layers 4 --d-model 256 --seq 32 --batch 8 --repeats 10]
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
if str(_ROOT) not in sys.path:
  sys.path.insert(0, str(_ROOT))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import jaxlens as jl  # noqa: E402
import jaxlens.models as jm  # noqa: E402
from benchmarks._timing import interleaved, median  # noqa: E402
from benchmarks._torch_peer import against_torch_peer, cpu_seconds  # noqa: E402
from jaxlens import train as jt  # noqa: E402


def _models(layers, d_model, vocab, seq):
  import torch
  import transformers

  torch.manual_seed(0)
  cfg = transformers.GPT2Config(
    n_layer=layers,
    n_embd=d_model,
    n_head=max(d_model // 64, 1),
    vocab_size=vocab,
    n_positions=max(seq * 2, 64),
    use_cache=False,
  )
  model = transformers.GPT2LMHeadModel(cfg).eval()
  path = Path(tempfile.mkdtemp()) / "gpt2"
  model.save_pretrained(path)
  lm = jm.load_hf(path)
  for p in model.parameters():
    p.requires_grad_(False)
  return model, lm


def _loreft_class(pv, torch):
  """pyreft's LoreftIntervention (pyreft is not installed), on pyvene's classes."""
  from pyvene.models.layers import LowRankRotateLayer

  class LoreftIntervention(
    pv.SourcelessIntervention, pv.TrainableIntervention, pv.DistributedRepresentationIntervention
  ):
    def __init__(self, **kwargs):
      super().__init__(**kwargs, keep_last_dim=True)
      rotate = LowRankRotateLayer(self.embed_dim, kwargs["low_rank_dimension"], init_orth=True)
      self.rotate_layer = torch.nn.utils.parametrizations.orthogonal(rotate)
      self.learned_source = torch.nn.Linear(self.embed_dim, kwargs["low_rank_dimension"])

    def forward(self, base, source=None, subspaces=None):
      rotated = self.rotate_layer(base)
      return base + torch.matmul(self.learned_source(base) - rotated, self.rotate_layer.weight.T)

  return LoreftIntervention


def _program(step, *args) -> dict:
  """The compiled step's size: XLA's flop estimate and the lowered program's products."""
  lowered = step.lower(*args)
  cost = lowered.compile().cost_analysis()
  cost = cost[0] if isinstance(cost, list) else cost
  return {"flops": cost.get("flops"), "dot_general": lowered.as_text().count("dot_general")}


def _end_to_end(fn) -> dict:
  """One call's wall and CPU seconds (every thread of the process)."""
  c0, t0 = cpu_seconds(), time.perf_counter()
  fn()
  return {"wall_s": time.perf_counter() - t0, "cpu_s": cpu_seconds() - c0}


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--layers", type=int, default=4)
  parser.add_argument("--d-model", type=int, default=256)
  parser.add_argument("--vocab", type=int, default=512)
  parser.add_argument("--seq", type=int, default=32)
  parser.add_argument("--batch", type=int, default=8)
  parser.add_argument("--repeats", type=int, default=10)
  parser.add_argument("--new-tokens", type=int, default=32)
  parser.add_argument("--epochs", type=int, default=5)
  parser.add_argument("--n-batches", type=int, default=8)
  parser.add_argument("--out", default=None)
  args = parser.parse_args(argv)

  import pyvene as pv
  import torch

  tmodel, lm = _models(args.layers, args.d_model, args.vocab, args.seq)
  d, layer, b, s = args.d_model, args.layers // 2, args.batch, args.seq
  site = f"blocks_{layer}/resid_post"
  rng = np.random.default_rng(0)
  base = rng.integers(0, args.vocab, (b, s))
  source = rng.integers(0, args.vocab, (b, s))
  label = rng.integers(0, args.vocab, (b,))
  out = {"config": vars(args)}

  # -- DAS training step ------------------------------------------------------------------
  das = pv.RotatedSpaceIntervention(embed_dim=d)
  das.set_interchange_dim(d // 4)
  cfg = pv.IntervenableConfig(
    representations=[
      pv.RepresentationConfig(layer, "block_output", "pos", 1, intervention=das),
    ]
  )
  ivm = pv.IntervenableModel(cfg, tmodel)
  ivm.disable_model_gradients()
  opt_t = torch.optim.Adam([das.rotate_layer.parametrizations.weight.original], lr=1e-3)
  tb, ts, tl = (torch.from_numpy(a) for a in (base, source, label))
  where = [[[s - 1]] * b]

  def pyvene_das(tb=tb, ts=ts, tl=tl):
    _, o = ivm({"input_ids": tb}, [{"input_ids": ts}], {"sources->base": (where, where)})
    loss = torch.nn.functional.cross_entropy(o.logits[:, -1], tl)
    opt_t.zero_grad()
    loss.backward()
    opt_t.step()
    return loss.detach()

  method = jt.DAS(dim=d // 4)
  params = {
    "rotation": {
      "raw": jnp.asarray(das.rotate_layer.parametrizations.weight.original.detach().numpy()),
      "base": jnp.asarray(das.rotate_layer.parametrizations.weight[0].base.numpy()),
    }
  }
  opt_j = optax.adam(1e-3)
  state = {"p": params, "s": opt_j.init(params)}
  jb, js, jlab = jnp.asarray(base), jnp.asarray(source), jnp.asarray(label)
  # The loss reads the last position's logits: computed there alone, as train_iit does.
  last = jnp.full((b, 1), s - 1, jnp.int32)

  @jax.jit
  def jax_das_step(p, st, v):
    def loss(p):
      o = jt.intervened_output(
        lm.model, v, site, method, p, jb, js, positions=[s - 1], output_positions=last
      )
      logp = jax.nn.log_softmax(o[:, -1])
      return -jnp.mean(jnp.take_along_axis(logp, jlab[:, None], 1))

    value, g = jax.value_and_grad(loss)(p)
    updates, st = opt_j.update(g, st, p)
    return optax.apply_updates(p, updates), st, value

  def jaxlens_das():
    state["p"], state["s"], value = jax_das_step(state["p"], state["s"], lm.variables)
    return value

  # The same step with the site's values cached: the base's and the source's, recorded once.
  cached = {"base": jt.site_values(lm.model, lm.variables, site, jb)}
  cached["source"] = jt.site_values(lm.model, lm.variables, site, js)

  @jax.jit
  def jax_das_cached_step(p, st, v, cache):
    def loss(p):
      o = jt.intervened_output(
        lm.model,
        v,
        site,
        method,
        p,
        jb,
        js,
        positions=[s - 1],
        site_values=cache,
        output_positions=last,
      )
      logp = jax.nn.log_softmax(o[:, -1])
      return -jnp.mean(jnp.take_along_axis(logp, jlab[:, None], 1))

    value, g = jax.value_and_grad(loss)(p)
    updates, st = opt_j.update(g, st, p)
    return optax.apply_updates(p, updates), st, value

  cstate = {"p": params, "s": opt_j.init(params)}

  def jaxlens_das_cached():
    cstate["p"], cstate["s"], value = jax_das_cached_step(
      cstate["p"], cstate["s"], lm.variables, cached
    )
    return value

  first_c = float(jaxlens_das_cached())
  first_t, first_j = float(pyvene_das()), float(jaxlens_das())
  out["das_first_loss"] = {"pyvene": first_t, "jaxlens": first_j, "jaxlens cached": first_c}
  out["das_program"] = {
    "uncached": _program(jax_das_step, state["p"], state["s"], lm.variables),
    "cached": _program(jax_das_cached_step, cstate["p"], cstate["s"], lm.variables, cached),
  }
  out["das_step"] = against_torch_peer(jaxlens_das, pyvene_das, args.repeats, peer_name="pyvene")
  out["das_speedup"] = out["das_step"]["speedup_wall"]
  out["das_step_cached"] = against_torch_peer(
    jaxlens_das_cached, pyvene_das, args.repeats, peer_name="pyvene"
  )
  out["das_speedup_cached"] = out["das_step_cached"]["speedup_wall"]

  # -- DAS end to end ------------------------------------------------------------------------
  n_steps = args.epochs * args.n_batches
  data = [
    {
      "base": rng.integers(0, args.vocab, (b, s)),
      "source": rng.integers(0, args.vocab, (b, s)),
      "label": rng.integers(0, args.vocab, (b,)),
    }
    for _ in range(args.n_batches)
  ]
  tdata = [{k: torch.from_numpy(v) for k, v in batch.items()} for batch in data]
  jdata = [{k: jnp.asarray(v) for k, v in batch.items()} for batch in data]
  best = out["das_step"]["best_torch"]
  threads = 1 if best.endswith(" 1 thread") else out["das_step"]["threads_default"]

  def pyvene_das_epochs():
    torch.set_num_threads(threads)
    for _ in range(args.epochs):
      for batch in tdata:
        pyvene_das(batch["base"], batch["source"], batch["label"])

  def jaxlens_das_epochs(cache):
    return jt.train_iit(
      lm.model,
      lm.variables,
      site,
      method,
      params,
      jdata,
      steps=n_steps,
      optimizer=opt_j,
      positions=[s - 1],
      progress=False,
      cache_prefix=cache,
    )

  out["das_end_to_end"] = {
    "steps": n_steps,
    "pyvene threads": threads,
    "jaxlens cached": _end_to_end(lambda: jaxlens_das_epochs(True)),
    "jaxlens": _end_to_end(lambda: jaxlens_das_epochs(False)),
    "pyvene": _end_to_end(pyvene_das_epochs),
    "jaxlens cached, again": _end_to_end(lambda: jaxlens_das_epochs(True)),
    "jaxlens, again": _end_to_end(lambda: jaxlens_das_epochs(False)),
  }
  torch.set_num_threads(out["das_step"]["threads_default"])

  # -- LoReFT training step ----------------------------------------------------------------
  loreft_cls = _loreft_class(pv, torch)
  torch.manual_seed(1)
  reft = loreft_cls(embed_dim=d, low_rank_dimension=4)
  cfg = pv.IntervenableConfig(
    representations=[pv.RepresentationConfig(layer, "block_output", "pos", s, intervention=reft)]
  )
  rvm = pv.IntervenableModel(cfg, tmodel)
  rvm.disable_model_gradients()
  opt_r = torch.optim.Adam([p for p in reft.parameters() if p.requires_grad], lr=1e-3)
  targets = np.concatenate([base[:, 1:], base[:, :1]], 1)
  weights = np.zeros((b, s), np.float32)
  weights[:, s // 2 : -1] = 1.0
  tt, tw = torch.from_numpy(targets), torch.from_numpy(weights)
  everywhere = [[list(range(s))] * b]

  def pyvene_reft():
    _, o = rvm({"input_ids": tb}, unit_locations={"sources->base": (None, everywhere)})
    ce = torch.nn.functional.cross_entropy(
      o.logits.reshape(-1, args.vocab), tt.reshape(-1), reduction="none"
    )
    loss = (ce * tw.reshape(-1)).sum() / tw.sum()
    opt_r.zero_grad()
    loss.backward()
    opt_r.step()
    return loss.detach()

  rparams = jt.LoReFT(4).init(jax.random.key(0), d)
  rstate = {"p": rparams, "s": opt_j.init(rparams)}
  method_r = jt.LoReFT(4)
  # The loss counts the positions of nonzero weight only (as pyreft's -100 labels): the
  # jaxlens steps compute the logits there alone (output_positions=, as train_reft does),
  # pyvene every position's, as pyreft does.
  at = np.stack([np.nonzero(row)[0] for row in weights]).astype(np.int32)
  jt_at = jnp.asarray(at)
  jt_targets = jnp.asarray(np.take_along_axis(targets, at, 1))
  jt_weights = jnp.asarray(np.take_along_axis(weights, at, 1))

  def reft_loss(p, v, cache=None):
    o = jt.intervened_output(
      lm.model, v, site, method_r, p, jb, site_values=cache, output_positions=jt_at
    )
    ce = -jnp.take_along_axis(jax.nn.log_softmax(o), jt_targets[..., None], -1)[..., 0]
    return jnp.sum(ce * jt_weights) / jnp.sum(jt_weights)

  @jax.jit
  def jax_reft_step(p, st, v):
    value, g = jax.value_and_grad(reft_loss)(p, v)
    updates, st = opt_j.update(g, st, p)
    return optax.apply_updates(p, updates), st, value

  def jaxlens_reft():
    rstate["p"], rstate["s"], value = jax_reft_step(rstate["p"], rstate["s"], lm.variables)
    return value

  @jax.jit
  def jax_reft_cached_step(p, st, v, cache):
    value, g = jax.value_and_grad(reft_loss)(p, v, cache)
    updates, st = opt_j.update(g, st, p)
    return optax.apply_updates(p, updates), st, value

  rcached = {"base": cached["base"]}
  crstate = {"p": rparams, "s": opt_j.init(rparams)}

  def jaxlens_reft_cached():
    crstate["p"], crstate["s"], value = jax_reft_cached_step(
      crstate["p"], crstate["s"], lm.variables, rcached
    )
    return value

  out["reft_first_loss"] = {
    "jaxlens cached": float(jaxlens_reft_cached()),
    "pyvene": float(pyvene_reft()),
    "jaxlens": float(jaxlens_reft()),
  }
  out["reft_program"] = {
    "uncached": _program(jax_reft_step, rstate["p"], rstate["s"], lm.variables),
    "cached": _program(jax_reft_cached_step, crstate["p"], crstate["s"], lm.variables, rcached),
  }
  reft = against_torch_peer(jaxlens_reft, pyvene_reft, args.repeats, peer_name="pyvene")
  out["reft_step"] = reft
  out["reft_tokens_per_s"] = {
    "jaxlens": 1000 * b * s / reft["jaxlens"]["wall_ms"],
    "pyvene": 1000 * b * s / reft[reft["best_torch"]]["wall_ms"],
  }
  out["reft_speedup"] = reft["speedup_wall"]
  reft_c = against_torch_peer(jaxlens_reft_cached, pyvene_reft, args.repeats, peer_name="pyvene")
  out["reft_step_cached"] = reft_c
  out["reft_speedup_cached"] = reft_c["speedup_wall"]

  # -- LoReFT end to end: train_reft on (prompt, answer) pairs whose padded batches are the
  # step figures' (prompt s/2 + 1 tokens, loss on the rest but the last) ----------------------
  n_pairs = args.n_batches * b
  tokens = rng.integers(1, args.vocab, (n_pairs, s))
  pairs = [(row[: s // 2 + 1].tolist(), row[s // 2 + 1 :].tolist()) for row in tokens]
  ab = jt.answer_batch(pairs)
  tt_all, tw_all = torch.from_numpy(ab["targets"]).long(), torch.from_numpy(ab["weights"])
  tk_all = torch.from_numpy(ab["tokens"]).long()
  best = reft["best_torch"]
  threads = 1 if best.endswith(" 1 thread") else reft["threads_default"]

  def pyvene_reft_batch(idx):
    _, o = rvm({"input_ids": tk_all[idx]}, unit_locations={"sources->base": (None, everywhere)})
    ce = torch.nn.functional.cross_entropy(
      o.logits.reshape(-1, args.vocab), tt_all[idx].reshape(-1), reduction="none"
    )
    w = tw_all[idx].reshape(-1)
    loss = (ce * w).sum() / w.sum()
    opt_r.zero_grad()
    loss.backward()
    opt_r.step()

  def pyvene_reft_epochs():
    torch.set_num_threads(threads)
    for e in range(args.epochs):
      order = torch.from_numpy(np.random.default_rng([0, e]).permutation(n_pairs))
      for i in range(args.n_batches):
        pyvene_reft_batch(order[i * b : (i + 1) * b])

  def jaxlens_reft_epochs(cache):
    return jt.train_reft(
      lm.model,
      lm.variables,
      site,
      method_r,
      rparams,
      pairs,
      steps=n_steps,
      batch_size=b,
      optimizer=opt_j,
      progress=False,
      cache_prefix=cache,
    )

  out["reft_end_to_end"] = {
    "steps": n_steps,
    "pyvene threads": threads,
    "jaxlens cached": _end_to_end(lambda: jaxlens_reft_epochs(True)),
    "jaxlens": _end_to_end(lambda: jaxlens_reft_epochs(False)),
    "pyvene": _end_to_end(pyvene_reft_epochs),
    "jaxlens cached, again": _end_to_end(lambda: jaxlens_reft_epochs(True)),
    "jaxlens, again": _end_to_end(lambda: jaxlens_reft_epochs(False)),
  }
  torch.set_num_threads(reft["threads_default"])
  out["load_average"] = os.getloadavg()
  out["compilation_cache"] = str(jax.config.jax_compilation_cache_dir)

  # -- generation with a trained LoReFT ------------------------------------------------------
  spec = jl.when(site, jl.loreft(rstate["p"]))
  prompt = jb[:, : s // 2]

  def plain():
    return jl.generate(lm.model, lm.variables, prompt, args.new_tokens).tokens

  def edited():
    return jl.generate(lm.model, lm.variables, prompt, args.new_tokens, intervene=spec).tokens

  plain(), edited()
  times = interleaved({"plain": plain, "loreft": edited}, args.repeats)
  gen = {k: median(v) for k, v in times.items()}
  out["generate_s"] = gen
  out["generate_overhead"] = gen["loreft"] / gen["plain"]
  print(json.dumps(out, indent=2))
  if args.out:
    Path(args.out).write_text(json.dumps(out, indent=2))
  return out


if __name__ == "__main__":
  with jax.numpy_dtype_promotion("standard"):
    main()
