"""jl.generate: the KV-cache decode loop equals the uncached forward, edits during generation,
saved sites per step, sampling, stop tokens, gradients (tiny random float32 decoders)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxlens as jl
from jaxlens import at_steps
from jaxlens.generation import generate, left_pad
from jaxlens.models import GPT2, GPT2Config, Llama, LlamaConfig

VOCAB, D, N = 48, 32, 6
ROWS = [[3, 9, 4, 17, 5], [7, 8], [11, 2, 30]]
SITE = "blocks_1/resid_post"


def _numpy_init(model, seed=0):
  """normal(0, 0.3) weights drawn with numpy (varied greedy tokens; no initialiser compile)."""
  rng = np.random.default_rng(seed)
  shapes = jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((1, 4), jnp.int32))

  def draw(path, leaf):
    name = jax.tree_util.keystr(path[-1:])
    if "bias" in name:
      return jnp.zeros(leaf.shape, leaf.dtype)
    if "scale" in name or "weight" in name:
      return jnp.ones(leaf.shape, leaf.dtype)
    return jnp.asarray(rng.normal(0.0, 0.3, leaf.shape), leaf.dtype)

  return jax.tree_util.tree_map_with_path(draw, shapes)


FAMILIES = {
  "llama": lambda: Llama(
    LlamaConfig(
      vocab_size=VOCAB, d_model=D, n_layers=2, n_heads=4, n_kv_heads=2, d_mlp=48, rope_base=500.0
    )
  ),
  "gpt2": lambda: GPT2(GPT2Config(vocab_size=VOCAB, d_model=D, n_layers=2, n_heads=4, max_len=16)),
}
TOKENS, MASK = left_pad(ROWS)
S = TOKENS.shape[1]


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request):
  model = FAMILIES[request.param]()
  return request.param, model, _numpy_init(model)


@pytest.fixture(scope="module")
def llama():
  model = FAMILIES["llama"]()
  return model, _numpy_init(model)


def _direction(seed):
  return jnp.asarray(np.random.default_rng(seed).normal(size=D), jnp.float32)


def _uncached(model, variables, n, spec=None, save=None):
  """Greedy decoding of the padded batch by a full forward over the whole sequence per new
  token: a fixed buffer of prompt + new tokens (causal, so later columns do not matter), the
  prompt mask, per-row positions. Returns tokens, logits and ``save``'s value per forward."""
  store = {}
  full = jl.Spec(()) if spec is None else spec
  if save is not None:
    full = full + jl.when(
      jl.module(save), jl.intervention.hook(lambda x, hook: store.__setitem__("v", x) or x)
    )

  @jax.jit
  def forward(spec_, seq):
    mask = jnp.concatenate([MASK, jnp.ones((len(ROWS), n), MASK.dtype)], 1)
    positions = jnp.maximum(jnp.cumsum(mask, 1) - 1, 0)
    out = (
      spec_.bind(model)(variables, seq, mask, positions)
      if spec_.rules
      else model.apply(variables, seq, mask, positions)
    )
    return out, store.get("v")

  seq = jnp.concatenate([TOKENS, jnp.zeros((len(ROWS), n), jnp.int32)], 1)
  logits, values = [], []
  for t in range(n):
    out, value = forward(full, seq)
    logits.append(out[:, S + t - 1])
    values.append(value)
    seq = seq.at[:, S + t].set(jnp.argmax(out[:, S + t - 1], -1).astype(jnp.int32))
  return np.asarray(seq[:, S:]), np.asarray(jnp.stack(logits, 1)), values


def test_greedy_equals_the_uncached_forward_for_every_decoder(family):
  name, model, variables = family
  out = generate(model, variables, TOKENS, N, attention_mask=MASK)
  ref_tokens, ref_logits, _ = _uncached(model, variables, N)
  np.testing.assert_array_equal(out.tokens, ref_tokens, err_msg=name)
  np.testing.assert_allclose(out.logits, ref_logits, atol=1e-4, rtol=1e-4)
  # the most padded row generates what it generates alone
  alone = generate(model, variables, jnp.asarray([ROWS[1]]), N)
  np.testing.assert_array_equal(out.tokens[1], alone.tokens[0])
  assert len(set(np.asarray(out.tokens).ravel().tolist())) >= 3  # not a degenerate model
  np.testing.assert_array_equal(out.lengths, [N] * len(ROWS))
  assert out.sequences.shape == (len(ROWS), S + N)


def test_steering_on_every_token_equals_the_uncached_steered_forward(llama):
  # (GPT-2's steered generation is compared with transformers in test_generate_torch.py.)
  model, variables = llama
  name = "llama"
  spec = jl.when(jl.module(SITE), jl.steer(_direction(1), 6.0))
  out = generate(model, variables, TOKENS, N, attention_mask=MASK, intervene=spec)
  ref_tokens, ref_logits, _ = _uncached(model, variables, N, spec)
  np.testing.assert_array_equal(out.tokens, ref_tokens, err_msg=name)
  np.testing.assert_allclose(out.logits, ref_logits, atol=1e-4, rtol=1e-4)
  plain = generate(model, variables, TOKENS, N, attention_mask=MASK)
  assert (out.tokens != plain.tokens).any()  # the steering changed the generation
  # Any nonzero mask entry marks a real token (the same program: the mask is normalised).
  twos = generate(model, variables, TOKENS, N, attention_mask=2 * MASK)
  np.testing.assert_array_equal(twos.logits, plain.logits)


def test_prefill_decode_chosen_steps_and_saved_sites(llama):
  """prefill= at one prompt position, decode= on every decode call, at_steps on calls 2 and 4,
  sites saved per call: equal to the uncached forward with the same edits at the columns those
  calls compute (call t >= 1 computes column S + t - 1)."""
  model, variables = llama
  a, b, c = _direction(2), _direction(3), _direction(4)
  out = generate(
    model,
    variables,
    TOKENS,
    N,
    attention_mask=MASK,
    prefill=jl.when(jl.module(SITE), jl.at_positions(jnp.asarray([3]), jl.steer(a, 4.0))),
    decode=jl.when(jl.module(SITE), jl.steer(b, 2.0)),
    intervene=jl.when(jl.module("blocks_0/mlp_out"), at_steps([2, 4], jl.steer(c, 5.0))),
    save=[jl.module(SITE), jl.module("blocks_0/attn/pattern")],
  )
  ref_spec = (
    jl.when(
      jl.module("blocks_0/mlp_out"), jl.at_positions(jnp.asarray([S + 1, S + 3]), jl.steer(c, 5.0))
    )
    + jl.when(jl.module(SITE), jl.at_positions(jnp.asarray([3]), jl.steer(a, 4.0)))
    + jl.when(jl.module(SITE), jl.at_positions(jnp.arange(S, S + N - 1), jl.steer(b, 2.0)))
  )
  ref_tokens, ref_logits, values = _uncached(model, variables, N, ref_spec, save=SITE)
  np.testing.assert_array_equal(out.tokens, ref_tokens)
  np.testing.assert_allclose(out.logits, ref_logits, atol=1e-4, rtol=1e-4)
  assert out.prefill[SITE].shape == (len(ROWS), S, D)
  assert out.steps[SITE].shape == (N - 1, len(ROWS), 1, D)
  assert out.steps["blocks_0/attn/pattern"].shape == (N - 1, len(ROWS), 4, 1, S + N)
  real = np.asarray(MASK, bool)  # padded positions attend to nothing real: not compared
  np.testing.assert_allclose(
    np.asarray(out.prefill[SITE])[real], np.asarray(values[0])[:, :S][real], atol=1e-4
  )
  for t in range(1, N):
    np.testing.assert_allclose(out.steps[SITE][t - 1, :, 0], values[t][:, S + t - 1], atol=1e-4)
  # Each edit changed something: without c the logits of call 2 differ.
  without_c = _uncached(model, variables, N, jl.Spec(ref_spec.rules[1:]))[1]
  assert not np.allclose(without_c[:, 2], ref_logits[:, 2], atol=1e-3)


def test_patch_from_another_prompt_at_prefill(llama):
  model, variables = llama
  other = (TOKENS + 13) % VOCAB
  donor = jax.jit(lambda v, x: jl.trace(model, v, x, save=jl.module("embed"), keep_inputs=False))(
    variables, other
  )
  # Patching every prompt embedding fills the cache with the other prompt's keys and values:
  # from there on the generation is the other prompt's.
  out = generate(
    model,
    variables,
    TOKENS,
    N,
    attention_mask=MASK,
    prefill=jl.when(jl.module("embed"), jl.patch_from(donor)),
  )
  from_other = generate(model, variables, other, N, attention_mask=MASK)
  np.testing.assert_array_equal(out.tokens, from_other.tokens)
  np.testing.assert_allclose(out.logits, from_other.logits, atol=1e-5)
  assert (
    from_other.tokens != generate(model, variables, TOKENS, N, attention_mask=MASK).tokens
  ).any()


def test_sampling(llama):
  model, variables = llama
  greedy = generate(model, variables, TOKENS, N, attention_mask=MASK)

  def sample(seed, k, p):
    return generate(
      model, variables, TOKENS, N, attention_mask=MASK, temperature=1.5, seed=seed, top_k=k, top_p=p
    )

  np.testing.assert_array_equal(sample(0, 1, 1.0).tokens, greedy.tokens)
  np.testing.assert_array_equal(sample(0, VOCAB, 1e-6).tokens, greedy.tokens)
  a, b, c = sample(0, 20, 0.95), sample(0, 20, 0.95), sample(1, 20, 0.95)
  np.testing.assert_array_equal(a.tokens, b.tokens)
  assert (a.tokens != c.tokens).any()
  assert (a.tokens != greedy.tokens).any()
  k3 = sample(3, 3, 1.0)  # every sampled token is among the 3 most probable
  top3 = np.argsort(-np.asarray(k3.logits), axis=-1)[..., :3]
  assert (top3 == np.asarray(k3.tokens)[..., None]).any(-1).all()


def test_stop_tokens(llama):
  model, variables = llama
  greedy = generate(model, variables, TOKENS, N, attention_mask=MASK)
  stop = int(greedy.tokens[0, 2])
  for early in (True, False):
    out = generate(
      model,
      variables,
      TOKENS,
      N,
      attention_mask=MASK,
      stop_tokens=(stop,),
      pad_token=47,
      early_stop=early,
    )
    for i in range(len(ROWS)):
      hits = np.flatnonzero(np.asarray(greedy.tokens[i]) == stop)
      n = hits[0] + 1 if hits.size else N
      assert int(out.lengths[i]) == n
      np.testing.assert_array_equal(out.tokens[i, :n], greedy.tokens[i, :n])
      assert (np.asarray(out.tokens[i, n:]) == 47).all()


def test_a_keeping_prefill_edit_is_differentiable(llama):
  model, variables = llama
  probe = jnp.asarray(np.random.default_rng(4).normal(size=(len(ROWS), N, VOCAB)), jnp.float32)
  direction = _direction(5)
  out = generate(
    model,
    variables,
    TOKENS,
    N,
    attention_mask=MASK,
    prefill=jl.when(jl.module(SITE), jl.steer(direction, 1.0)),
  )

  def through_generation(v):  # keep_grad: the structural check runs inside the loop
    keep = jl.intervention.keep_grad(jl.steer(v, 1.0))
    g = generate(
      model, variables, TOKENS, N, attention_mask=MASK, prefill=jl.when(jl.module(SITE), keep)
    )
    return jnp.sum(g.logits * probe)

  mask = jnp.concatenate([MASK, jnp.ones((len(ROWS), N), MASK.dtype)], 1)
  positions = jnp.maximum(jnp.cumsum(mask, 1) - 1, 0)
  seq = jnp.concatenate([TOKENS, out.tokens], 1)

  def uncached(v):  # the same edit on the prompt's columns, then every token's forward
    spec = jl.when(jl.module(SITE), jl.at_positions(jnp.arange(S), jl.steer(v, 1.0)))
    logits = spec.bind(model)(variables, seq, mask, positions)[:, S - 1 : S + N - 1]
    return jnp.sum(logits * probe)

  g = jax.jit(jax.grad(through_generation))(direction)
  np.testing.assert_allclose(g, jax.jit(jax.grad(uncached))(direction), atol=1e-3, rtol=1e-4)
  assert float(jnp.abs(g).max()) > 1e-2


def test_training_a_steering_vector_through_a_generation(llama):
  model, variables = llama
  target = 5

  @jax.jit
  @jax.value_and_grad
  def loss(v):
    out = generate(
      model,
      variables,
      TOKENS,
      N,
      attention_mask=MASK,
      intervene=jl.when(jl.module(SITE), jl.steer(v, 6.0)),
    )
    return -jnp.mean(jax.nn.log_softmax(out.logits)[..., target])

  opt = optax.adam(0.1)
  v = jnp.zeros(D, jnp.float32)
  state = opt.init(v)
  first = float(loss(v)[0])
  for _ in range(30):
    _, g = loss(v)
    # optax.adam's bias correction raises a float to its int32 step count, which strict
    # dtype promotion (tests/conftest.py) refuses: only the optimiser runs under standard.
    with jax.numpy_dtype_promotion("standard"):
      updates, state = opt.update(g, state)
    v = optax.apply_updates(v, updates)
  assert float(loss(v)[0]) < 0.5 * first
  out = generate(
    model,
    variables,
    TOKENS,
    N,
    attention_mask=MASK,
    intervene=jl.when(jl.module(SITE), jl.steer(v, 6.0)),
  )
  assert (np.asarray(out.tokens) == target).all()


def test_bad_input_gets_typed_errors(llama):
  model, variables = llama
  row = jnp.asarray([ROWS[0]])
  with pytest.raises(jl.InvalidArgumentError) as e:
    generate(model, variables, TOKENS, N, attention_mask=1 - MASK)
  assert e.value.code == "not_left_padded"
  with pytest.raises(jl.InvalidArgumentError) as e:
    generate(model, variables, row, 0)
  assert e.value.code == "invalid_argument"
  with pytest.raises(jl.SiteError) as e:
    generate(model, variables, row, 2, intervene=jl.when(jl.module("blocks_9"), jl.scale(2.0)))
  assert e.value.code == "unknown_site"
  with pytest.raises(jl.InvalidArgumentError) as e:
    at_steps(1, jl.scale(2.0))(jnp.ones(3), jl.intervention.FireContext("x"))
  assert e.value.code == "outside_generation"
  import flax.linen as nn

  with pytest.raises(jl.InvalidArgumentError) as e:
    generate(nn.Dense(3), {}, row, 2)
  assert e.value.code == "no_kv_cache"
  gpt = FAMILIES["gpt2"]()
  with pytest.raises(jl.InvalidArgumentError) as e:
    generate(gpt, {}, row, 12)
  assert e.value.code == "index_out_of_range"
  with pytest.raises(jl.InvalidArgumentError) as e:
    generate(model, variables, row, 2, temperature=1.0, top_p=0.0)
  assert e.value.code == "invalid_argument"


def test_the_decoder_init_is_traced_once_per_model_and_cache_size(llama, monkeypatch):
  # The check that the model keeps a KV cache and the cache's shapes come from one abstract
  # init per (model, batch, cache length): a first generation on a model new to the process
  # traces init once (it traced it twice, once for the check and once for the shapes), and a
  # second one, the same shapes with a new steering value, traces none.
  import dataclasses

  base, variables = llama
  model = Llama(dataclasses.replace(base.config, max_len=1234))  # max_len: documentation only
  inits = []
  real_init = Llama.init
  monkeypatch.setattr(
    Llama, "init", lambda self, *a, **k: inits.append(1) or real_init(self, *a, **k)
  )
  counts = []
  for magnitude in (1.0, 2.0):
    spec = jl.when(jl.module(SITE), jl.steer(_direction(0), magnitude))
    out = generate(model, variables, TOKENS, N, attention_mask=MASK, intervene=spec)
    counts.append(len(inits))
  assert counts == [1, 1]
  assert out.tokens.shape == (TOKENS.shape[0], N)


def test_at_steps_reads_the_step_from_the_fire_context():
  """The step reaches at_steps through FireContext.step, set by spec.bind(model, step=)."""
  import flax.linen as nn

  x = jnp.ones((2, 3), jnp.float32)
  edit = at_steps([1, 3], jl.scale(2.0))
  np.testing.assert_array_equal(edit(x, jl.intervention.FireContext("x", step=3)), 2 * x)
  np.testing.assert_array_equal(edit(x, jl.intervention.FireContext("x", step=2)), x)
  model = nn.Sequential([nn.Dense(3), nn.Dense(2)])
  variables = model.init(jax.random.key(0), x)
  spec = jl.when(jl.module("layers_0"), edit)
  plain = model.apply(variables, x)
  run = jax.jit(lambda step: spec.bind(model, step=step)(variables, x))
  np.testing.assert_allclose(run(jnp.int32(0)), plain)
  assert not np.allclose(run(jnp.int32(1)), plain)
