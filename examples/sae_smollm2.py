"""A TopK SAE on SmolLM2-135M's residual stream, trained offline in a few minutes on a CPU.

    python examples/sae_smollm2.py [--out DIR] [--steps N] [--block 3] [--layers N]

1. Text that ships with Python (``pydoc_data.topics``: the language reference's help topics),
   tokenised by SmolLM2's tokenizer into sequences of 64 tokens; nothing is downloaded.
2. The residual stream after block 3 (``blocks_3/resid_post``) collected with
   ``jaxlens.store.collect``. Only the first four blocks run: a ``Trunk`` module built from
   the zoo's ``LlamaBlock`` with the same parameter names reads SmolLM2's variables and has
   the same site names, at 4/30 of the cost.
3. A TopK SAE (2 x 576 features, k = 32, 800 steps of 512 activations) trained with ``jaxlens.sae.train``.
4. Held-out explained variance and L0, and the cross-entropy loss recovered when the SAE is
   spliced into the whole model.
5. A feature view: top-activating contexts and top logit effects through the unembedding,
   as an HTML page and a matplotlib figure.
6. Using a feature: ablate it and steer with it through the usual verbs on the spliced model,
   with the effect on the next-token distribution.

The numbers it prints are the ones quoted in docs/dictionaries.md. ``--layers N`` cuts the
model after its first N blocks (``Pretrained.first_layers``) for steps 4 and 6: a quick run
(with ``--block B``, the SAE on ``blocks_B/resid_post`` and a trunk of B + 1 blocks, B < N).
"""

from __future__ import annotations

import argparse
import pathlib
import tempfile
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pydoc_data.topics

import jaxlens as jl
import jaxlens.models as jm
from jaxlens import sae
from jaxlens.models.llama import LlamaBlock
from jaxlens.sae import train as sae_train

SEQ = 64


class Trunk(nn.Module):
  """SmolLM2's embedding and first ``n_blocks`` blocks, with the zoo model's names."""

  config: jm.LlamaConfig
  n_blocks: int

  @nn.compact
  def __call__(self, tokens):
    cfg = self.config
    x = nn.Embed(cfg.vocab_size, cfg.d_model, dtype=cfg.dtype, param_dtype=cfg.dtype, name="embed")(
      tokens
    )
    positions = jnp.arange(tokens.shape[1])
    for i in range(self.n_blocks):
      x = LlamaBlock(cfg, name=f"blocks_{i}")(x, positions)
    return x


def sequences(lm, n: int):
  text = "\n\n".join(pydoc_data.topics.topics[k] for k in sorted(pydoc_data.topics.topics))
  ids = np.asarray(lm.tokenizer.encode(text).ids, np.int32)
  usable = (len(ids) // SEQ) * SEQ
  seqs = ids[:usable].reshape(-1, SEQ)
  rng = np.random.default_rng(0)
  return seqs[rng.permutation(len(seqs))[:n]]


def next_token_table(lm, logits, k=5):
  p = jax.nn.softmax(logits.astype(jnp.float32))
  top = np.argsort(np.asarray(p))[::-1][:k]
  return [(lm.decode(int(i)), round(float(p[i]), 3)) for i in top]


def main(argv=None) -> dict:
  """Collects, trains, evaluates, draws the feature view and uses a feature; returns the
  figures."""
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", default=None, help="where the page and the figure go")
  parser.add_argument("--steps", type=int, default=800)
  parser.add_argument("--width", type=int, default=2, help="features per model dimension")
  parser.add_argument("--batch", type=int, default=512, help="activations per step")
  parser.add_argument("--sequences", type=int, default=640, help="sequences of 64 tokens")
  parser.add_argument("--held", type=int, default=64, help="of which held out for evaluation")
  parser.add_argument(
    "--layers", type=int, default=None, help="keep only the first N blocks (past the SAE's)"
  )
  parser.add_argument("--block", type=int, default=3, help="the SAE reads this block's output")
  args = parser.parse_args(argv)
  out = pathlib.Path(args.out or tempfile.mkdtemp(prefix="sae_smollm2_"))
  out.mkdir(parents=True, exist_ok=True)
  clock = time.perf_counter()

  lm = jm.smollm2()
  if args.layers is not None:
    lm = lm.first_layers(args.layers)  # steps 4 and 6 then run the cut model
  cfg = lm.config
  site = f"blocks_{args.block}/resid_post"
  trunk = Trunk(cfg, args.block + 1)
  params = lm.variables["params"]
  trunk_vars = {
    "params": {k: params[k] for k in ["embed"] + [f"blocks_{i}" for i in range(args.block + 1)]}
  }

  seqs = sequences(lm, args.sequences)
  train_seqs, held_seqs = seqs[: -args.held], seqs[-args.held :]
  batches = [train_seqs[i : i + 16] for i in range(0, len(train_seqs), 16)]
  store = jl.store.collect(trunk, trunk_vars, batches, out / "acts", sites=[site], progress=True)
  acts = store.array(site)[:, 1:]  # position 0 (no BOS here) is an outlier: left out
  rows = acts.reshape(-1, cfg.d_model).astype(np.float32)
  t_collect = time.perf_counter() - clock
  print(f"collected {rows.shape[0]} activations of {site} in {t_collect:.0f} s")

  rng = np.random.default_rng(1)

  def epochs(batch=args.batch):
    while True:
      order = rng.permutation(len(rows))
      for i in range(0, len(order) - batch + 1, batch):
        yield rows[order[i : i + batch]]

  config = sae_train.TrainConfig(
    d_sae=args.width * cfg.d_model,
    architecture="topk",
    k=32,
    lr=4e-4,
    lr_warm_up_steps=50,
    lr_decay_steps=args.steps // 5,
    dead_feature_window=200,
  )
  clock = time.perf_counter()
  result = sae_train.train(epochs(), config, steps=args.steps, log_every=50)
  t_train = time.perf_counter() - clock
  d = result.inference()
  print(
    f"trained {args.steps} steps of {args.batch} rows ({config.d_sae} features, k=32) in "
    f"{t_train:.0f} s"
  )

  held = np.asarray(jax.jit(trunk.apply)(trunk_vars, held_seqs))
  held_rows = held[:, 1:].reshape(-1, cfg.d_model)
  recon = np.asarray(jax.jit(d.__call__)(held_rows))
  ev = float(sae_train.explained_variance(held_rows, recon))
  l0 = float(np.mean(np.sum(np.asarray(d.encode(held_rows)) != 0, -1)))
  print(
    f"held-out explained variance {ev:.3f}, L0 {l0:.1f}, dead fraction {result.dead_fraction:.3f}"
  )

  ce = sae_train.ce_loss_recovered(lm.model, lm.variables, jnp.asarray(held_seqs[:16]), site, d)
  print(
    "CE clean {ce_clean:.3f}, spliced {ce_spliced:.3f}, zero-ablated {ce_zero:.3f}: "
    "loss recovered {loss_recovered:.3f}".format(**ce)
  )

  # The feature view: a few features that fire on 0.2-3% of held-out tokens.
  held_acts = np.asarray(d.encode(held_rows))
  freq = (held_acts > 0).mean(0)
  candidates = np.where((freq > 0.002) & (freq < 0.03))[0]
  chosen = [int(f) for f in candidates[np.argsort(-held_acts[:, candidates].max(0))][:4]]
  strings = [[lm.decode(int(t)) for t in row] for row in held_seqs]
  unembed = lm.variables["params"]["embed"]["embedding"].T  # SmolLM2 ties its embeddings
  vocabulary = [lm.decode(i) for i in range(cfg.vocab_size)]
  view = sae.feature_view(
    d,
    held,
    strings,
    features=chosen,
    unembed=unembed,
    vocabulary=vocabulary,
    title=f"SmolLM2 {site} TopK SAE",
  )
  page = view.to_html(out / "features.html")
  fig = view.figure()
  fig.savefig(out / "features.png", dpi=80)
  for f in view.features:
    best = "".join(t for t, _ in f.contexts[0][1]) if f.contexts else ""
    print(
      f"feature {f.index}: fires on {100 * f.frequency:.2f}% of tokens; top context "
      f"{best[-40:]!r}; raises {[t for t, _ in f.top_logits[:5]]}"
    )
  print(f"feature view: {page} and {out / 'features.png'}")

  # Using a feature on the whole model, spliced.
  spliced = sae.splice(lm.model, site, d)
  feature = chosen[0]
  s, p = np.unravel_index(np.argmax(held_acts[:, feature]), held[:, 1:].shape[:2])
  prompt = jnp.asarray(held_seqs[s : s + 1, : p + 2])  # up to the token where it peaks
  acts_site = jl.module(f"{site}/sae/acts")
  ablate = jl.when(jl.units(acts_site, jnp.asarray([feature])), jl.zero_ablate())
  other = jnp.asarray(held_seqs[(s + 1) % len(held_seqs) : (s + 1) % len(held_seqs) + 1, :16])
  peak = float(held_acts[:, feature].max())
  one_hot = jnp.zeros((d.d_sae,), jnp.float32).at[feature].set(1.0)
  steer = jl.when(acts_site, jl.at_positions([15], jl.steer(one_hot, 2.0 * peak)))

  @jax.jit
  def next_logits(variables, prompt, other):
    """The last position's logits of the four runs, in one program: the spliced model as is
    and with the feature ablated on ``prompt``, as is and steered on ``other``."""
    return [
      f(variables, x)[0, -1]
      for f, x in [
        (spliced.apply, prompt),
        (ablate.bind(spliced), prompt),
        (spliced.apply, other),
        (steer.bind(spliced), other),
      ]
    ]

  base, ablated, plain, steered = next_logits(lm.variables, prompt, other)
  print(f"prompt ...{lm.decode(prompt[0, -12:])!r}")
  print(f"  next token, as is:            {next_token_table(lm, base)}")
  print(f"  feature {feature} ablated:    {next_token_table(lm, ablated)}")
  print(f"prompt ...{lm.decode(other[0, -12:])!r}")
  print(f"  next token, as is:            {next_token_table(lm, plain)}")
  print(f"  feature {feature} steered (+{2 * peak:.1f}): {next_token_table(lm, steered)}")
  return {
    "rows": rows.shape[0],
    "explained_variance": ev,
    "l0": l0,
    "loss_recovered": ce["loss_recovered"],
    "features": chosen,
    "ablated_change": float(jnp.abs(ablated - base).max()),
    "steered_change": float(jnp.abs(steered - plain).max()),
    "page": page,
  }


if __name__ == "__main__":
  main()
