"""Hostile files for every loader (issue 31, item 3): safetensors, torch ``state_dict``, GGUF,
Hugging Face ``config.json``, ``tokenizer.json``, saved specs, activation-store shards and
SAELens dictionaries, each cut at every tenth of its length, with a flipped header byte, wrong
dtypes, mismatched shapes, NaN weights and an unknown architecture.

Each gives a typed error naming the file, field or tensor (a code docs/errors.md lists), or,
where the damage leaves a valid file, a result equal to the intact one; nothing is half-loaded
and nothing already on disk is written over.
"""

import json
import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxlens as jl
from jaxlens import store
from jaxlens.models import LlamaConfig, LoadError, load_gguf, load_hf, params_from_hf
from jaxlens.models.llama import Llama

DOCUMENTED = set(
  re.findall(r"`([a-z0-9_]+)`", (pathlib.Path(__file__).parents[1] / "docs/errors.md").read_text())
)
CFG = LlamaConfig(vocab_size=16, d_model=8, n_layers=1, n_heads=2, n_kv_heads=1, d_mlp=12)
HF_CONFIG = {
  "model_type": "llama",
  "vocab_size": 16,
  "hidden_size": 8,
  "num_hidden_layers": 1,
  "num_attention_heads": 2,
  "num_key_value_heads": 1,
  "intermediate_size": 12,
  "max_position_embeddings": 2048,
  "rope_theta": 1e4,
  "rms_norm_eps": 1e-5,
  "tie_word_embeddings": False,
}
TOKENS = jnp.asarray([[1, 2, 3]])
TENTHS = [k / 10 for k in range(10)]


def _typed(error, *codes):
  assert isinstance(error, (jl.InvalidArgumentError, store.StoreError)), repr(error)
  assert error.fields["code"] in DOCUMENTED, error.fields["code"]
  if codes:
    assert error.fields["code"] in codes, (error.fields["code"], str(error))


def _raises(call, *codes):
  try:
    call()
  except Exception as error:  # noqa: BLE001 (the test inspects what was raised)
    _typed(error, *codes)
    return error
  pytest.fail(f"accepted a hostile file (expected {codes})")


@pytest.fixture(scope="module")
def checkpoint():
  """(variables, HF-named float32 tensors) of a tiny Llama."""
  variables = jax.jit(Llama(CFG).init)(jax.random.key(0), TOKENS)  # one program, not eager ops
  p = jax.tree.map(np.asarray, variables["params"])  # transposed by numpy below
  b = p["blocks_0"]
  tensors = {
    "model.embed_tokens.weight": p["embed"]["embedding"],
    "model.norm.weight": p["ln_final"]["weight"],
    "lm_head.weight": p["lm_head"]["kernel"].T,
    "model.layers.0.input_layernorm.weight": b["ln_1"]["weight"],
    "model.layers.0.post_attention_layernorm.weight": b["ln_2"]["weight"],
  }
  for q in "qkvo":
    tensors[f"model.layers.0.self_attn.{q}_proj.weight"] = b["attn"][f"{q}_proj"]["kernel"].T
  for q in ("gate", "up", "down"):
    tensors[f"model.layers.0.mlp.{q}_proj.weight"] = b["mlp"][f"{q}_proj"]["kernel"].T
  return variables, {k: np.asarray(v, np.float32) for k, v in tensors.items()}


def _hf_dir(path, tensors, config=HF_CONFIG, tokenizer=True):
  from safetensors.numpy import save_file

  path.mkdir(parents=True, exist_ok=True)
  (path / "config.json").write_text(json.dumps(config))
  save_file(tensors, str(path / "model.safetensors"))
  if tokenizer:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"t{i}": i for i in range(15)} | {"[UNK]": 15}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    (path / "tokenizer.json").write_text(tok.to_str())
  return path


def _same(a, b):
  return jax.tree.all(jax.tree.map(lambda x, y: bool(np.array_equal(x, y)), a, b))


# -- safetensors and state_dict tensors ---------------------------------------------------


def test_a_cut_or_flipped_safetensors_file_is_refused_naming_it(checkpoint, tmp_path):
  _, tensors = checkpoint
  good = load_hf(_hf_dir(tmp_path / "good", tensors))
  data = (tmp_path / "good" / "model.safetensors").read_bytes()
  header = 8 + int.from_bytes(data[:8], "little")
  for k, frac in enumerate(TENTHS):
    d = _hf_dir(tmp_path / f"cut{k}", tensors, tokenizer=False)
    (d / "model.safetensors").write_bytes(data[: int(len(data) * frac)])
    e = _raises(lambda d=d: load_hf(d), "truncated_file")
    assert e.fields["tensor"] == "model.safetensors"
  # A flipped byte of the header: refused, naming the file or the tensor it renamed, or (a
  # byte of JSON whitespace or of a float tensor name's digit that still names one) intact.
  rng = np.random.default_rng(0)
  for k, at in enumerate(sorted(rng.choice(np.arange(8, header), 12, replace=False))):
    d = _hf_dir(tmp_path / f"flip{k}", tensors, tokenizer=False)
    flipped = bytearray(data)
    flipped[at] ^= 0x20
    (d / "model.safetensors").write_bytes(bytes(flipped))
    try:
      loaded = load_hf(d)
    except Exception as error:  # noqa: BLE001
      _typed(error, "truncated_file", "missing_tensor", "tensor_shape", "tensor_dtype")
      assert error.fields["tensor"], error
    else:
      assert _same(loaded.variables, good.variables), f"byte {at} changed the weights silently"


@pytest.mark.parametrize(
  "damage, code",
  [
    (lambda t: {**t, "model.norm.weight": t["model.norm.weight"].astype(np.int32)}, "tensor_dtype"),
    (lambda t: {**t, "model.norm.weight": t["model.norm.weight"][:-1]}, "tensor_shape"),
    (lambda t: {**t, "model.norm.weight": t["model.norm.weight"] * np.nan}, "tensor_not_finite"),
    (
      lambda t: {k: v for k, v in t.items() if k != "model.layers.0.mlp.up_proj.weight"},
      "missing_tensor",
    ),
    (
      lambda t: {**t, "lm_head.weight": np.where(np.eye(16, 8) > 0, np.inf, t["lm_head.weight"])},
      "tensor_not_finite",
    ),
  ],
  ids=["int dtype", "shape", "nan", "missing", "inf"],
)
def test_bad_tensors_are_refused_naming_them(checkpoint, tmp_path, damage, code):
  _, tensors = checkpoint
  bad = damage(tensors)
  # as a state_dict (any name -> array mapping) and as a safetensors directory
  e = _raises(lambda: params_from_hf(CFG, bad), code)
  assert e.fields["tensor"] in tensors
  e = _raises(lambda: load_hf(_hf_dir(tmp_path / "d", bad, tokenizer=False)), code)
  assert e.fields["tensor"] in tensors


def test_a_zip_archive_cut_short_is_refused(checkpoint, tmp_path):
  import shutil

  _, tensors = checkpoint
  archive = shutil.make_archive(str(tmp_path / "m"), "zip", _hf_dir(tmp_path / "d", tensors))
  data = pathlib.Path(archive).read_bytes()
  assert load_hf(archive).config == load_hf(tmp_path / "d").config
  for frac in TENTHS[1:]:
    (tmp_path / "cut.zip").write_bytes(data[: int(len(data) * frac)])
    _raises(lambda: load_hf(tmp_path / "cut.zip"), "truncated_file", "file_not_found")


# -- config.json and tokenizer.json ----------------------------------------------------------


@pytest.mark.parametrize(
  "change, field",
  [
    ({"model_type": "falcon"}, None),
    ({"vocab_size": "16"}, "vocab_size"),
    ({"num_hidden_layers": 0}, "n_layers"),
    ({"hidden_size": 8.5}, "d_model"),
    ({"rope_theta": float("nan")}, "rope_base"),
    ({"num_attention_heads": None}, None),
    ({"intermediate_size": True}, "d_mlp"),
  ],
)
def test_a_bad_config_field_is_refused_naming_it(checkpoint, tmp_path, change, field):
  _, tensors = checkpoint
  d = _hf_dir(tmp_path / "d", tensors, {**HF_CONFIG, **change}, tokenizer=False)
  e = _raises(lambda: load_hf(d), "config_invalid", "unknown_architecture")
  if field is not None:
    assert e.fields["field"] == field
  missing = {k: v for k, v in HF_CONFIG.items() if k != "intermediate_size"}
  e = _raises(lambda: jl.models.config_from_hf(missing), "config_invalid")
  assert e.fields["field"] == "intermediate_size"


def test_a_cut_config_or_tokenizer_is_refused_naming_it(checkpoint, tmp_path):
  _, tensors = checkpoint
  d = _hf_dir(tmp_path / "d", tensors)
  good = load_hf(d)
  for name, code in (("config.json", "config_invalid"), ("tokenizer.json", "truncated_file")):
    data = (d / name).read_bytes()
    for frac in TENTHS:
      (d / name).write_bytes(data[: int(len(data) * frac)])
      e = _raises(lambda: load_hf(d), code)
      assert e.fields["tensor"] == name
    (d / name).write_bytes(data)
  assert load_hf(d).encode("t3 t4").tolist() == good.encode("t3 t4").tolist() == [[3, 4]]
  # Nested too deep for json's recursion: config_invalid, not RecursionError.
  (d / "config.json").write_text('{"a": ' + "[" * 30000 + "]" * 30000 + "}")
  with pytest.raises(LoadError, match=r"config.json .*nested deeper than 64"):
    load_hf(d)


# -- GGUF ----------------------------------------------------------------------------------------


def _gguf(path, tensors, arch="llama", nan=False, heads=2, extra=None):
  import gguf

  w = gguf.GGUFWriter(str(path), arch)
  w.add_block_count(1)
  w.add_context_length(64)
  w.add_embedding_length(8)
  w.add_feed_forward_length(12)
  w.add_head_count(heads)
  if extra is not None:
    extra(w)
  w.add_head_count_kv(1)
  w.add_vocab_size(16)
  names = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
    "model.layers.0.input_layernorm.weight": "blk.0.attn_norm.weight",
    "model.layers.0.post_attention_layernorm.weight": "blk.0.ffn_norm.weight",
  }
  for q in "qkv":
    names[f"model.layers.0.self_attn.{q}_proj.weight"] = f"blk.0.attn_{q}.weight"
  names["model.layers.0.self_attn.o_proj.weight"] = "blk.0.attn_output.weight"
  for q in ("gate", "up", "down"):
    names[f"model.layers.0.mlp.{q}_proj.weight"] = f"blk.0.ffn_{q}.weight"
  for name, t in tensors.items():
    t = np.array(t, np.float32)
    if nan and name == "model.norm.weight":
      t[0] = np.nan
    w.add_tensor(names[name], t)
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
  return path


def test_hostile_gguf_files_are_refused_naming_the_tensor(checkpoint, tmp_path):
  pytest.importorskip("gguf")
  _, tensors = checkpoint
  path = _gguf(tmp_path / "m.gguf", tensors)
  good = load_gguf(path, tokenizer=False)
  data = path.read_bytes()
  for frac in TENTHS:
    (tmp_path / "cut.gguf").write_bytes(data[: int(len(data) * frac)])
    e = _raises(lambda: load_gguf(tmp_path / "cut.gguf", tokenizer=False), "truncated_file")
    if frac >= 0.5:  # past the metadata, into the tensors: the tensor is named
      assert e.fields["tensor"] and e.fields["tensor"].endswith(".weight"), str(e)
  # A flipped byte of the fixed header (magic, version, counts): refused.
  for at in range(0, 24, 2):
    flipped = bytearray(data)
    flipped[at] ^= 0x41
    (tmp_path / "flip.gguf").write_bytes(bytes(flipped))
    try:
      loaded = load_gguf(tmp_path / "flip.gguf", tokenizer=False)
    except Exception as error:  # noqa: BLE001
      _typed(error)
    else:  # (a count's high byte that gguf ignores)
      assert _same(loaded.variables, good.variables), at
  e = _raises(
    lambda: load_gguf(_gguf(tmp_path / "nan.gguf", tensors, nan=True), tokenizer=False),
    "tensor_not_finite",
  )
  assert e.fields["tensor"] == "model.norm.weight"
  _raises(
    lambda: load_gguf(_gguf(tmp_path / "x.gguf", tensors, arch="falcon")), "unknown_architecture"
  )


@pytest.mark.parametrize(
  "heads, extra, code, field",
  [
    (0, None, "config_invalid", "llama.attention.head_count"),
    (2, lambda w: w.add_key_length(0), "config_invalid", "llama.attention.key_length"),
    (2, lambda w: w.add_rope_freq_base(float("nan")), "config_invalid", "llama.rope.freq_base"),
    (
      2,
      lambda w: w.add_layer_norm_rms_eps(float("nan")),
      "config_invalid",
      "llama.attention.layer_norm_rms_epsilon",
    ),
    (2, lambda w: w.add_token_list([f"t{i}" for i in range(15)]), "tensor_shape", None),
  ],
)
def test_gguf_metadata_out_of_range_is_refused_naming_the_key(
  checkpoint, tmp_path, heads, extra, code, field
):
  """Issue 49: a zero head count or key length divided by zero, a NaN rope base or norm
  epsilon gave NaN logits, an embedding of more rows than the tokenizer has tokens loaded."""
  pytest.importorskip("gguf")
  path = _gguf(tmp_path / "m.gguf", checkpoint[1], heads=heads, extra=extra)
  match = "not a positive int|not a finite positive" if field else "rows, the tokenizer 15"
  with pytest.raises(LoadError, match=match) as info:
    load_gguf(path, tokenizer=False)
  assert info.value.code == code
  assert info.value.fields["tensor"] == (field or "token_embd.weight")


def test_a_gguf_tensor_reading_into_the_next_and_an_empty_chunk_list_are_refused(
  checkpoint, tmp_path
):
  pytest.importorskip("gguf")
  import struct

  data = bytearray(_gguf(tmp_path / "m.gguf", checkpoint[1]).read_bytes())
  # token_embd.weight's second dimension (its rows), 16 -> 17: one row more than its bytes.
  at = data.index(b"token_embd.weight") + len("token_embd.weight") + 4 + 8
  assert struct.unpack_from("<Q", data, at)[0] == 16
  struct.pack_into("<Q", data, at, 17)
  (tmp_path / "over.gguf").write_bytes(bytes(data))
  with pytest.raises(LoadError, match="token_embd.weight' overlaps tensor") as info:
    load_gguf(tmp_path / "over.gguf", tokenizer=False)
  assert info.value.code == "truncated_file"
  with pytest.raises(LoadError, match="an empty list of chunks"):
    load_gguf([])


# -- saved specs ---------------------------------------------------------------------------


def test_a_cut_or_flipped_saved_spec_is_refused_and_the_previous_version_kept(tmp_path):
  import os

  spec = jl.when(jl.module("blocks_0"), jl.steer(jnp.arange(8.0), 2.0))
  path = spec.save(tmp_path / "s")
  version = path / os.readlink(path / "current")
  for name in ("spec.json", "arrays.npz"):
    data = (version / name).read_bytes()
    for frac in TENTHS:
      (version / name).write_bytes(data[: int(len(data) * frac)])
      _raises(lambda: jl.load_spec(path), "spec_corrupt")
    for at in range(0, min(len(data), 64), 7):
      flipped = bytearray(data)
      flipped[at] ^= 0x10
      (version / name).write_bytes(bytes(flipped))
      try:
        loaded = jl.load_spec(path)
      except Exception as error:  # noqa: BLE001
        _typed(error, "spec_corrupt", "spec_version")
      else:  # a byte the zip format does not read (a timestamp): the same spec
        assert repr(loaded) == repr(spec), at
    (version / name).write_bytes(data)
  assert repr(jl.load_spec(path)) == repr(spec)


# -- activation-store shards --------------------------------------------------------------------


@pytest.fixture(scope="module")
def collected(tmp_path_factory):
  from jaxlens.models import init_gpt

  model, variables, tokens = init_gpt(
    0, n_layers=1, d_model=8, n_heads=2, max_len=4, vocab_size=8, batch=2
  )
  path = tmp_path_factory.mktemp("store") / "acts"
  s = store.collect(
    model, variables, [tokens, (tokens + 1) % 8], path, sites=["block_0"], progress=False
  )
  return model, variables, tokens, path, s.array("block_0")


def _copy(src, dst):
  import shutil

  shutil.copytree(src, dst)
  return dst


def test_hostile_store_files_are_store_corrupt_and_collect_writes_nothing_over(collected, tmp_path):
  from safetensors.numpy import save_file

  model, variables, tokens, path, want = collected
  shard = "shard_000001.safetensors"
  data = (path / shard).read_bytes()
  for frac in TENTHS:
    d = _copy(path, tmp_path / f"cut{frac}")
    (d / shard).write_bytes(data[: int(len(data) * frac)])
    e = _raises(lambda d=d: store.open(d).array("block_0"), "store_corrupt")
    assert shard in e.fields["path"]
  flipped = bytearray(data)
  flipped[12] ^= 0x01  # inside the JSON header
  d = _copy(path, tmp_path / "flip")
  (d / shard).write_bytes(bytes(flipped))
  _raises(lambda: store.open(d).array("block_0"), "store_corrupt")
  # A shard of another dtype, or another row shape, than store.json says.
  for k, arr in enumerate((want[:2].astype(np.float16), want[:2, :, :4])):
    d = _copy(path, tmp_path / f"other{k}")
    save_file({"block_0": np.ascontiguousarray(arr)}, str(d / shard))
    e = _raises(lambda d=d: store.open(d).array("block_0"), "store_corrupt")
    assert e.fields["site"] == "block_0"
  # store.json cut short: reading and resuming refuse it, and nothing of the store changes.
  d = _copy(path, tmp_path / "meta")
  meta = (d / "store.json").read_bytes()
  before = {p.name: p.read_bytes() for p in d.iterdir()}
  for frac in TENTHS:
    (d / "store.json").write_bytes(meta[: int(len(meta) * frac)])
    _raises(lambda: store.open(d), "store_corrupt", "store_missing")
    _raises(
      lambda: store.collect(model, variables, [tokens], d, sites=["block_0"], progress=False),
      "store_corrupt",
      "store_not_empty",
    )
  (d / "store.json").write_bytes(meta)
  assert {p.name: p.read_bytes() for p in d.iterdir()} == before
  np.testing.assert_array_equal(store.open(d).array("block_0"), want)


# -- SAELens dictionaries (jaxlens.sae) -----------------------------------------------------------


def test_hostile_dictionary_files_are_typed(tmp_path):
  from jaxlens import sae

  path = sae.save_saelens(sae.SAE.init(jax.random.key(0), 8, 16), tmp_path / "sae")
  files = sorted(p for p in path.iterdir() if p.is_file())
  for f in files:
    data = f.read_bytes()
    for frac in TENTHS:
      f.write_bytes(data[: int(len(data) * frac)])
      _raises(lambda: sae.load_saelens(path))
    f.write_bytes(data)
  sae.load_saelens(path)
