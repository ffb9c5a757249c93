"""Issue 31, item 1: no silent wrong result on the real-model layer (one regression test per
defect; each failed before its fix)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxlens as jl
from jaxlens.models import bert, gpt2, llama

VOCAB = 32


@pytest.fixture(scope="module")
def decoders():
  """Tiny Llama (tied embeddings, max_len 12) and GPT-2 of float32, with their variables."""
  tokens = jnp.arange(4)[None]
  out = {}
  lc = llama.LlamaConfig(
    vocab_size=VOCAB,
    d_model=16,
    n_layers=1,
    n_heads=2,
    n_kv_heads=1,
    d_mlp=24,
    tie_embeddings=True,
    max_len=12,
  )
  gc = gpt2.GPT2Config(vocab_size=VOCAB, d_model=16, n_layers=1, n_heads=2, max_len=12)
  for name, model in (("llama", llama.Llama(lc)), ("gpt2", gpt2.GPT2(gc))):
    out[name] = (model, model.init(jax.random.key(0), tokens))
  return out


@pytest.fixture(scope="module")
def encoder():
  cfg = bert.BertConfig(vocab_size=VOCAB, d_model=16, n_layers=1, n_heads=2, d_mlp=24, max_len=12)
  model = bert.Bert(cfg)
  return model, model.init(jax.random.key(0), jnp.zeros((1, 4), jnp.int32))


TOKENS = jnp.asarray([[1, 5, 7, 2]])


@pytest.mark.parametrize("bad", [-1, VOCAB])
@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_a_token_id_outside_the_vocabulary_is_refused_or_nan(decoders, family, bad):
  model, variables = decoders[family]
  ids = TOKENS.at[0, 1].set(bad)
  # Concrete ids: the model's call, the trace door and generation refuse them, naming the id.
  for call in (
    lambda: model.apply(variables, ids),
    lambda: jl.trace(model, variables, ids),
    lambda: jl.generate(model, variables, ids, 2),
  ):
    with pytest.raises(jl.InvalidArgumentError, match=rf"\[index_out_of_range\].*{bad}") as info:
      call()
    assert info.value.fields["site"] == "embed"
  # Traced ids cannot raise: the bad position's embedding is NaN (and so is what attention
  # mixes it into), never the embedding of another row (-1 used to read the last one).
  f = jax.jit(lambda t: model.apply(variables, t))
  assert np.isnan(f(ids)[0, 1]).all()
  np.testing.assert_allclose(f(TOKENS), model.apply(variables, TOKENS), rtol=1e-5, atol=1e-6)


def test_token_ids_of_any_int_dtype_are_read_as_their_value(decoders):
  model, variables = decoders["llama"]
  want = model.apply(variables, TOKENS)
  for dtype in (jnp.int8, jnp.uint8, jnp.int16, jnp.uint32, jnp.int64):
    np.testing.assert_array_equal(model.apply(variables, TOKENS.astype(dtype)), want)
  with pytest.raises(jl.ShapeError, match=r"\[dtype_mismatch\]"):
    model.apply(variables, TOKENS.astype(jnp.float32))
  # -1 of int8 must not become 255 (a valid row of a bigger vocabulary) under jit.
  out = jax.jit(lambda t: model.apply(variables, t))(TOKENS.astype(jnp.int8).at[0, 3].set(-1))
  assert np.isnan(out[0, 3]).all()


def test_padding_ids_of_a_generation_prompt_are_not_read(decoders):
  model, variables = decoders["llama"]
  mask = jnp.asarray([[0, 1, 1]])
  want = jl.generate(model, variables, jnp.asarray([[0, 5, 7]]), 3, attention_mask=mask)
  got = jl.generate(model, variables, jnp.asarray([[-9, 5, 7]]), 3, attention_mask=mask)
  np.testing.assert_array_equal(got.tokens, want.tokens)
  assert not np.isnan(got.logits).any()


def test_bert_takes_the_mask_and_token_types_by_keyword_only(encoder):
  model, variables = encoder
  ids, mask = jnp.asarray([[3, 4, 5, 0]]), jnp.asarray([[1, 1, 1, 0]])
  # HF's BertModel order is (input_ids, attention_mask, token_type_ids): a positional mask used
  # to be read as token types. Now a positional second argument is refused.
  for method in (None, "pool"):
    with pytest.raises(jl.InvalidArgumentError, match=r"\[invalid_argument\].*by keyword"):
      model.apply(variables, ids, mask, method=method)
  by_keyword = model.apply(variables, ids, attention_mask=mask)
  np.testing.assert_allclose(by_keyword[:, :3], model.apply(variables, ids[:, :3]), atol=1e-6)
  # sentence_embedding keeps its one positional mask, in HF's place.
  np.testing.assert_allclose(
    model.apply(variables, ids, mask, method="sentence_embedding"),
    model.apply(variables, ids[:, :3], method="sentence_embedding"),
    atol=1e-6,
  )
  with pytest.raises(jl.InvalidArgumentError, match=r"\[index_out_of_range\].*token_types"):
    jl.trace(model, variables, ids, token_types=jnp.full((1, 4), 2))


def test_an_empty_prompt_is_a_typed_error(decoders):
  model, variables = decoders["llama"]
  with pytest.raises(jl.ShapeError, match=r"\[shape_mismatch\].*no tokens"):
    jl.generate(model, variables, jnp.zeros((1, 0), jnp.int32), 2)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_a_prompt_longer_than_the_context_is_refused(decoders, family):
  model, variables = decoders[family]
  with pytest.raises(jl.InvalidArgumentError, match=r"\[index_out_of_range\].*context of 12"):
    jl.generate(model, variables, jnp.ones((1, 10), jnp.int32), 3)
  with pytest.raises(jl.InvalidArgumentError, match=r"\[index_out_of_range\].*context of 12"):
    model.apply(variables, jnp.ones((1, 13), jnp.int32))
  assert jl.generate(model, variables, jnp.ones((1, 10), jnp.int32), 2).tokens.shape == (1, 2)


def test_a_call_that_did_not_run_names_the_calls_that_did(decoders):
  model, variables = decoders["llama"]  # tied: embed runs __call__ once and attend once
  with pytest.raises(jl.SiteError, match=r"\[unknown_site\].*'embed' ran \(__call__ call 1") as e:
    jl.trace(model, variables, TOKENS, save=jl.module("embed", call=2))
  assert e.value.fields["candidates"][:1] == ["embed"]
  assert "embed.attend" in e.value.fields["candidates"]


def test_a_string_factor_is_a_typed_error(decoders):
  model, variables = decoders["llama"]
  with pytest.raises(jl.ShapeError, match=r"\[dtype_mismatch\].*'2'"):
    jl.scale("2")
  # The same value reaching a verb's parameter some other way (a hand-built edit).
  edit = jl.intervention.Edit("scale", {"factor": "2"})
  with pytest.raises(jl.ShapeError, match=r"\[dtype_mismatch\].*factor"):
    jl.when(jl.module("blocks_0"), edit).bind(model)(variables, TOKENS)


def test_at_positions_with_a_python_list_is_a_jit_argument(decoders):
  model, variables = decoders["llama"]
  site = jl.module("blocks_0/resid_post")
  f = jax.jit(lambda e: jl.when(site, e).bind(model)(variables, TOKENS))
  want = f(jl.at_positions(jnp.asarray([2]), jl.zero_ablate()))
  np.testing.assert_array_equal(f(jl.at_positions([2], jl.zero_ablate())), want)
  np.testing.assert_array_equal(f(jl.at_positions((2,), jl.zero_ablate())), want)
  # and it still refuses a concrete position outside the site
  with pytest.raises(jl.InvalidArgumentError, match=r"\[index_out_of_range\]"):
    jl.when(site, jl.at_positions([9], jl.zero_ablate())).bind(model)(variables, TOKENS)


def test_a_truncated_gguf_names_the_tensor_cut(tmp_path):
  gguf = pytest.importorskip("gguf")
  from jaxlens.models import LoadError, load_gguf

  path = tmp_path / "m.gguf"
  w = gguf.GGUFWriter(str(path), "llama")
  w.add_block_count(1)
  w.add_tensor("token_embd.weight", np.ones((8, 4), np.float32))
  w.add_tensor("output_norm.weight", np.ones((4,), np.float32))
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
  data = path.read_bytes()
  (tmp_path / "cut.gguf").write_bytes(data[:-24])  # inside the last tensor (16 bytes + 16 padding)
  with pytest.raises(LoadError, match=r"\[truncated_file\].*'output_norm.weight'") as e:
    load_gguf(tmp_path / "cut.gguf")
  assert e.value.fields["tensor"] == "output_norm.weight"


# -- saved specs --------------------------------------------------------------------


def _spec():
  return jl.when(jl.module("blocks_0"), jl.scale(2.0))


def test_a_spec_version_holding_fifos_is_refused_without_hanging(tmp_path):
  import os
  import threading

  path = _spec().save(tmp_path / "s")
  version = path / os.readlink(path / "current")
  for name in ("spec.json", "arrays.npz"):
    (version / name).unlink()
    os.mkfifo(version / name)
  result = {}

  def load():
    try:
      jl.load_spec(path)
    except jl.InvalidArgumentError as error:
      result["error"] = error

  thread = threading.Thread(target=load, daemon=True)
  thread.start()
  thread.join(20)
  if thread.is_alive():  # unblock the reader before failing
    with open(version / "spec.json", "wb"):
      pass
    pytest.fail("load_spec blocked on a FIFO")
  assert result["error"].code == "spec_corrupt"
  assert "not a regular file" in str(result["error"])


def test_a_save_cleans_up_what_a_killed_save_left(tmp_path):
  path = _spec().save(tmp_path / "s")
  stale = path / ".tmp-v-0123456789abcdef0123456789abcdef"
  stale.mkdir()
  (stale / "arrays.npz").write_bytes(b"half")
  (path / ".current.tmp-deadbeef").symlink_to("v-nowhere")
  _spec().save(path)
  assert sorted(p.name for p in path.iterdir() if p.name.startswith(".")) == [".lock"]
  assert len(jl.load_spec(path).rules) == 1


def test_a_spec_naming_an_unknown_verb_says_so(tmp_path):
  import json

  from jaxlens._src import saving

  path = _spec().save(tmp_path / "s")
  doc = json.loads((path / "spec.json").read_text())
  doc.pop("sha256")
  doc["rules"][0]["edit"]["verb"] = "scale_v2"
  with np.load(path / "arrays.npz") as npz:
    arrays = {k: npz[k] for k in npz.files}
  target = (path / "spec.json").resolve()
  target.write_text(json.dumps({**doc, "sha256": saving._digest(doc, arrays)}))
  with pytest.raises(jl.InvalidArgumentError, match=r"\[unknown_verb\].*'scale_v2'") as e:
    jl.load_spec(path)
  assert "scale" in e.value.fields["candidates"]


# -- sweeps ------------------------------------------------------------------------------


def _last_logit(logits):
  return logits[:, -1, 3].mean()


def test_the_two_sweeps_default_to_the_same_sites(decoders):
  model, variables = decoders["llama"]
  clean, corrupt = TOKENS, TOKENS.at[:, 1].set(9)
  cone = jl.sweep.cone_sweep(model, variables, clean, corrupt, _last_logit)
  plain = jl.sweep.patching_sweep(model, variables, clean, corrupt, _last_logit)
  # cone_sweep defaulted to resid_post: its row i was patching_sweep's row i + 1
  np.testing.assert_allclose(cone, plain, rtol=1e-5, atol=1e-6)
  assert float(jnp.abs(plain).max()) > 0


def test_a_gate_with_a_non_scalar_flag_is_a_typed_error(decoders):
  model, variables = decoders["llama"]
  edit = jl.gate(jnp.asarray([True, False]), jl.zero_ablate())
  with pytest.raises(jl.ShapeError, match=r"\[shape_mismatch\].*gate.*scalar"):
    jl.when(jl.module("blocks_0/resid_post"), edit).bind(model)(variables, TOKENS)


def test_an_unhashable_metric_is_a_typed_error(decoders):
  model, variables = decoders["llama"]

  class Metric:
    def __eq__(self, other):
      return isinstance(other, Metric)

    def __call__(self, out):
      return out[:, -1, 0].mean()

  for sweep in (jl.sweep.patching_sweep, jl.sweep.cone_sweep):
    with pytest.raises(jl.InvalidArgumentError, match=r"\[invalid_argument\].*not hashable"):
      sweep(model, variables, TOKENS, TOKENS, Metric())
