"""Defects of the newer wings (training, dictionaries, store, checkpoints, loaders) on plausible
but unusual inputs: each is a typed jaxlens error with its code, or a correct result."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxlens as jl

from jaxlens import train as jt
from jaxlens.core import JaxlensWarning

SITE = "layers_1"


@pytest.fixture(scope="module")
def embedded():
  """A float64 model with an ``nn.Embed`` lookup (tokens -> logits over 16 classes) and a mesh
  of 2 devices with Explicit axes (``jax.make_mesh``'s default)."""
  model = nn.Sequential(
    [
      nn.Embed(16, 8, param_dtype=jnp.float64),
      nn.Dense(8, param_dtype=jnp.float64),
      jnp.tanh,
      nn.Dense(16, param_dtype=jnp.float64),
    ]
  )
  variables = model.init(jax.random.key(0), jnp.zeros((1, 4), jnp.int32))
  rng = np.random.default_rng(0)

  def tokens(*shape):
    return rng.integers(0, 16, shape).astype(np.int32)

  batches = [{"base": tokens(4, 4), "source": tokens(4, 4), "label": tokens(4)} for _ in range(2)]
  mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
  return model, variables, batches, mesh


def _f64(tree):
  return jax.tree.map(
    lambda a: a.astype(jnp.float64) if jnp.issubdtype(a.dtype, jnp.floating) else a, tree
  )


def test_training_loops_on_a_mesh_with_embeddings(embedded):
  """Data parallel over a mesh trains a model with an embedding lookup (it raised a raw
  ShardingTypeError under jax.make_mesh's Explicit axes) with the losses of one device:
  train_iit with and without the prefix cache, train_multi (the same loss as train_iit for
  one placement) and train_reft (cached)."""
  model, variables, batches, mesh = embedded
  das = jt.DAS(dim=2)
  params = _f64(das.init(jax.random.key(1), 8))
  kw = dict(steps=2, progress=False, optimizer=optax.adam(0.1))
  # The run on one device takes its batches from a function of the step, called once a step
  # (it was three times), with the labels as a list (a raw TypeError in the loss).
  calls = []

  def batch_of(step):
    calls.append(step)
    return {**batches[step % 2], "label": batches[step % 2]["label"].tolist()}

  alone = jt.train_iit(model, variables, SITE, das, params, batch_of, **kw)
  assert calls.count(1) == 1
  assert alone.losses[1] != alone.losses[0]  # the second step ran on trained parameters
  for cache_prefix in (False, True):
    split = jt.train_iit(
      model, variables, SITE, das, params, batches, mesh=mesh, cache_prefix=cache_prefix, **kw
    )
    np.testing.assert_allclose(split.losses, alone.losses, rtol=0, atol=1e-10)
  multi = jt.train_multi(
    model, variables, [jt.At(SITE, das)], {"main": params}, batches, mesh=mesh, **kw
  )
  np.testing.assert_allclose(multi.losses, alone.losses, rtol=0, atol=1e-10)

  reft = jt.LoReFT(rank=2)
  params = _f64(reft.init(jax.random.key(2), 8))
  pairs = [([1, 2, 3], [4]), ([5, 6, 7], [8]), ([9, 1, 2], [3]), ([4, 5, 6], [7])]
  kw = dict(kw, batch_size=2)
  alone = jt.train_reft(model, variables, SITE, reft, params, pairs, **kw)
  split = jt.train_reft(
    model, variables, SITE, reft, params, pairs, mesh=mesh, cache_prefix=True, **kw
  )
  np.testing.assert_allclose(split.losses, alone.losses, rtol=0, atol=1e-10)


GPT2_CONFIG = {
  "model_type": "gpt2",
  "vocab_size": 16,
  "n_embd": 8,
  "n_layer": 1,
  "n_head": 2,
  "n_positions": 8,
}


@pytest.mark.parametrize("dtype", [jnp.int32, "int8", "bogus", None])
def test_loaders_refuse_a_dtype_that_is_not_float(dtype, tmp_path):
  """An int dtype cast every weight to it (a model of truncated weights), an unknown one
  failed later with a raw error: refused before any file is read."""
  from jaxlens.models import LoadError, config_from_hf, load_gguf, load_hf

  with pytest.raises(LoadError, match="not a float dtype") as e:
    config_from_hf(GPT2_CONFIG, dtype=dtype)
  assert e.value.fields["code"] == "unsupported_dtype"
  for load in (load_hf, load_gguf):
    with pytest.raises(LoadError, match="not a float dtype"):
      load(tmp_path / "absent", dtype=dtype)


def test_loaders_refuse_float64_without_x64():
  from jaxlens.models import LoadError, config_from_hf

  assert config_from_hf(GPT2_CONFIG, dtype=jnp.float64).dtype == jnp.float64
  with jax.enable_x64(False), pytest.raises(LoadError, match="without jax_enable_x64"):
    config_from_hf(GPT2_CONFIG, dtype=jnp.float64)


def test_empty_batches_and_an_ignored_argument_are_refused(embedded):
  """A batch of no examples made a NaN mean loss, reported as a diverged step
  (``loss_not_finite``); an accuracy over no examples read as 0.0; ``boundary_weight`` on a
  method without a boundary was ignored."""
  model, variables, batches, _ = embedded
  das = jt.DAS(dim=2)
  params = _f64(das.init(jax.random.key(1), 8))
  empty = {k: a[:0] for k, a in batches[0].items()}
  with pytest.raises(jl.InvalidArgumentError, match=r"batch 1: \['base'\] holds no examples") as e:
    jt.train_iit(model, variables, SITE, das, params, [batches[0], empty], steps=2, progress=False)
  assert e.value.fields["code"] == "invalid_argument"
  with pytest.raises(jl.InvalidArgumentError, match="DAS's parameters have none"):
    jt.train_iit(model, variables, SITE, das, params, batches, boundary_weight=1.0)  # ignored
  with pytest.raises(jl.InvalidArgumentError, match="iia: the batches hold no examples"):
    jt.iia(model, variables, SITE, das, params, [empty])
  with pytest.raises(jl.InvalidArgumentError, match="iia_multi: the batches hold no examples"):
    jt.iia_multi(model, variables, [jt.At(SITE, das)], {"main": params}, [])


def test_store_refuses_a_batch_of_another_row_shape(tmp_path):
  """A batch whose site gives another per-row shape was written, then refused as a damaged
  shard (``store_corrupt``: "delete that shard"); it is refused before it is written, and a
  collection with the right batches resumes after the first."""
  from jaxlens import store

  model = nn.Sequential([nn.Dense(5)])
  variables = model.init(jax.random.key(0), jnp.zeros((1, 3), jnp.float32))
  good = [np.full((4, 3), i, np.float32) for i in range(2)]
  with pytest.raises(store.StoreError, match=r"batch 1 gives 'layers_0' as \(4, 2, 5\)") as e:
    store.collect(
      model, variables, [good[0], np.zeros((4, 2, 3), np.float32)], tmp_path / "s",
      sites=["layers_0"], progress=False,
    )  # fmt: skip
  assert e.value.fields["code"] == "store_batch_invalid"
  s = store.collect(model, variables, good, tmp_path / "s", sites=["layers_0"], progress=False)
  assert s.complete and s.num_batches == 2
  np.testing.assert_array_equal(s.array("layers_0")[4:], model.apply(variables, good[1]))


def test_store_keeps_a_users_tmp_files_and_refuses_nan_activations(tmp_path):
  """Resuming a store deleted every ``*.tmp`` in its directory, a user's own files too; and a
  batch whose activations held NaN was stored (an SAE trained on it stopped much later at
  ``batch_not_finite``). Now only the store's own temporary shards go, and a non-finite batch is
  refused with the batches before it kept, unless ``allow_nonfinite=True``."""
  from jaxlens import store

  model = nn.Sequential([nn.Dense(5)])
  variables = model.init(jax.random.key(0), jnp.zeros((1, 3), jnp.float32))
  good = [np.full((4, 3), i, np.float32) for i in range(3)]
  bad = good[:2] + [np.full((4, 3), np.nan, np.float32)]
  path = tmp_path / "s"
  with pytest.raises(store.StoreError, match=r"batch 2 gives 'layers_0' with 20 non-finite") as e:
    store.collect(model, variables, bad, path, sites=["layers_0"], progress=False)
  assert (e.value.fields["code"], e.value.fields["site"], e.value.fields["batch"]) == (
    "store_batch_not_finite",
    "layers_0",
    2,
  )
  notes = path / "notes.tmp"
  notes.write_text("mine")
  (path / "shard_000002.safetensors.tmp").write_bytes(b"half a shard")
  s = store.collect(model, variables, good, path, sites=["layers_0"], progress=False)
  assert s.complete and s.num_batches == 3 and notes.read_text() == "mine"
  assert not (path / "shard_000002.safetensors.tmp").exists()
  np.testing.assert_array_equal(s.array("layers_0")[8:], model.apply(variables, good[2]))
  kept = store.collect(
    model, variables, bad, tmp_path / "t", sites=["layers_0"], progress=False,
    allow_nonfinite=True,
  )  # fmt: skip
  assert np.isnan(kept.array("layers_0")[8:]).all()


def test_a_checkpoint_directory_holding_step_named_folders_is_refused(tmp_path):
  """A user's folders named as steps (``1``, ``7``) were read as a damaged checkpoint whose
  fix said to delete them (and orbax deletes old steps by number): refused, left as they were."""
  from jaxlens._src.checkpoints import Checkpoints

  for name in ("1", "7"):
    (tmp_path / name).mkdir()
    (tmp_path / name / "notes.txt").write_text("mine")
  with pytest.raises(jl.CheckpointError, match=r"holds \['1', '7'\], which are not checkpoints"):
    Checkpoints(tmp_path, 1)
  assert (tmp_path / "7" / "notes.txt").read_text() == "mine"
  with Checkpoints(tmp_path / "run", 1) as c:  # a directory of its own, beside them
    assert c.save(1, {"w": jnp.zeros(3)}, {})
  with Checkpoints(tmp_path / "run", 1) as c:  # its own steps are checkpoints
    assert c.latest_step() == 1


def test_store_overwrite_keeps_files_that_are_not_the_stores(tmp_path):
  """``overwrite=True`` deleted every entry of the store's directory, a user's files too."""
  from jaxlens import store

  model = nn.Sequential([nn.Dense(5)])
  variables = model.init(jax.random.key(0), jnp.zeros((1, 3), jnp.float32))
  batches = [np.ones((2, 3), np.float32)]
  kw = dict(sites=["layers_0"], progress=False)
  store.collect(model, variables, batches, tmp_path / "s", **kw)
  (tmp_path / "s" / "notes.txt").write_text("mine")
  with pytest.raises(store.StoreError, match=r"\(\['notes.txt'\]\); overwrite=True would delete"):
    store.collect(model, variables, batches, tmp_path / "s", overwrite=True, **kw)
  assert (tmp_path / "s" / "notes.txt").read_text() == "mine"
  (tmp_path / "s" / "notes.txt").unlink()
  s = store.collect(
    model, variables, [2 * b for b in batches], tmp_path / "s", overwrite=True, **kw
  )
  np.testing.assert_array_equal(s.array("layers_0"), model.apply(variables, 2 * batches[0]))


@pytest.mark.parametrize("fmt", ["saelens", "sparsify"])
def test_replacing_a_dictionary_keeps_the_users_files(tmp_path, fmt):
  """Saving over a dictionary's directory deleted every file in it (a README, plots/; SAELens's
  writer raised a raw IsADirectoryError on a folder, after the swap); a ``.NAME.old`` left by
  a crash between the two renames made every later save a raw ``OSError`` (ENOTEMPTY)."""
  from jaxlens import sae

  save = sae.save_saelens if fmt == "saelens" else sae.save_sparsify
  load = sae.load_saelens if fmt == "saelens" else sae.load_sparsify
  rng = np.random.default_rng(0)

  def dictionary(scale):
    return sae.SAE(
      W_enc=jnp.asarray(scale * rng.normal(size=(4, 6)), jnp.float32),
      b_enc=jnp.zeros(6, jnp.float32),
      W_dec=jnp.asarray(rng.normal(size=(6, 4)), jnp.float32),
      b_dec=jnp.zeros(4, jnp.float32),
      activation="topk",
      k=2,
    )

  path = tmp_path / "d"
  save(dictionary(1.0), path)
  (path / "plots").mkdir()
  (path / "README.md").write_text("mine")
  with pytest.raises(sae.SAEError, match=r"\(\['README.md', 'plots'\]\): replacing") as e:
    save(dictionary(2.0), path)
  assert e.value.fields["code"] == "sae_file_exists"
  assert (path / "README.md").read_text() == "mine" and (path / "plots").is_dir()
  (path / "README.md").unlink()
  (path / "plots").rmdir()
  (tmp_path / ".d.old").mkdir()  # what a crash between the renames left
  (tmp_path / ".d.old" / "x").write_text("x")
  new = dictionary(3.0)
  save(new, path)
  np.testing.assert_array_equal(load(path).W_enc, new.W_enc)


GEMMA2_CONFIG = {
  "model_type": "gemma2", "vocab_size": 16, "hidden_size": 8, "intermediate_size": 16,
  "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 4,
  "max_position_embeddings": 8, "sliding_window": 4,
}  # fmt: skip


@pytest.mark.parametrize(
  "field, value, name",
  [
    ("query_pre_attn_scalar", 0, "query_pre_attn_scalar"),  # a scale of 0 ** -0.5: inf
    ("query_pre_attn_scalar", -4, "query_pre_attn_scalar"),  # NaN scores
    ("attn_logit_softcapping", "50", "attn_softcap"),  # a raw TypeError at the first call
    ("final_logit_softcapping", 0.0, "final_softcap"),  # logits / 0
    ("rms_norm_eps", -1e-6, "norm_eps"),  # the root of a negative variance
    ("rms_norm_eps", 10**400, "norm_eps"),  # a raw TypeError from np.isfinite
  ],
)
def test_config_numbers_a_model_divides_by_are_checked(field, value, name):
  from jaxlens.models import LoadError, config_from_hf

  assert config_from_hf(GEMMA2_CONFIG).attn_softcap is None  # (the defaults load)
  with pytest.raises(LoadError, match=rf"gives {name} = .*, which must be a finite number") as e:
    config_from_hf({**GEMMA2_CONFIG, field: value})
  assert e.value.fields["code"] == "config_invalid" and e.value.fields["field"] == name


def test_store_collect_names_a_misspelt_keyword(tmp_path):
  """``collect`` passes the keywords it does not know to the model: ``overwite=True`` was
  the model's raw ``TypeError`` (``Dense.__call__() got an unexpected keyword``)."""
  from jaxlens import store

  model = nn.Sequential([nn.Dense(5)])
  variables = model.init(jax.random.key(0), jnp.zeros((1, 3), jnp.float32))
  with pytest.raises(jl.InvalidArgumentError, match="takes no keyword 'overwite'") as e:
    store.collect(
      model, variables, [np.ones((2, 3), np.float32)], tmp_path / "s", sites=["layers_0"],
      progress=False, overwite=True,
    )  # fmt: skip
  assert e.value.fields["fix"] == "overwrite=" and not (tmp_path / "s").exists()


def test_an_empty_path_is_not_the_current_directory(tmp_path, monkeypatch):
  """``checkpoint=""`` trained into the current directory (``os.path.abspath("")``), and
  ``store.collect(..., "")`` collected into it: both refused, nothing written."""
  from jaxlens import store
  from jaxlens._src.checkpoints import Checkpoints

  monkeypatch.chdir(tmp_path)
  with pytest.raises(jl.CheckpointError, match=r"got str '' \(the current directory\)") as e:
    Checkpoints("", 1)
  assert e.value.fields["code"] == "checkpoint_path_invalid"
  model = nn.Sequential([nn.Dense(5)])
  variables = model.init(jax.random.key(0), jnp.zeros((1, 3), jnp.float32))
  with pytest.raises(store.StoreError, match=r"got str '' \(the current directory\)"):
    store.collect(model, variables, [np.ones((2, 3), np.float32)], "", sites=["layers_0"])
  assert not any(tmp_path.iterdir())


def test_a_dictionary_writer_refused_by_the_file_system_is_typed(tmp_path):
  """A parent that is a file (or unwritable, or a full disk) was a raw ``OSError``."""
  from jaxlens import sae

  d = sae.SAE(
    W_enc=jnp.zeros((4, 6), jnp.float32), b_enc=jnp.zeros(6, jnp.float32),
    W_dec=jnp.zeros((6, 4), jnp.float32), b_dec=jnp.zeros(4, jnp.float32),
    activation="topk", k=2,
  )  # fmt: skip
  (tmp_path / "file").write_text("x")
  for save in (sae.save_saelens, sae.save_sparsify):
    with pytest.raises(sae.SAEError, match="cannot save the dictionary to .*file/d") as e:
      save(d, tmp_path / "file" / "d")
    assert e.value.fields["code"] == "sae_save_failed"


def test_lenses_refuse_a_model_that_is_not_a_zoo_decoder():
  """The demo GPT has layer sites but no zoo configuration, ``resid_post`` sites or readout:
  the lenses raised ``unknown_site`` for ``block_1/resid_post``, a raw ``AttributeError``
  (``config``) or the model's own ``TypeError`` (``attention_mask``); each is now
  ``lens_unsupported_model``."""
  from jaxlens import lens
  from jaxlens.models import init_gpt

  model, variables, tokens = init_gpt(
    0, n_layers=2, d_model=16, n_heads=2, max_len=8, vocab_size=32, batch=2
  )
  tokens = np.asarray(tokens)
  calls = [
    lambda: lens.logit_lens(model, variables, tokens),
    lambda: lens.patchscope(model, variables, tokens, tokens),
    lambda: lens.fit_jacobian_lens(model, variables, tokens, skip_first_positions=1),
    lambda: lens.TunedLens.lstsq(model, variables, [tokens]),
    lambda: lens.train_tuned_lens(model, variables, [tokens], steps=1),
  ]
  for call in calls:
    with pytest.raises(lens.LensError, match="GPT has no final norm and unembedding") as e:
      call()
    assert e.value.fields["code"] == "lens_unsupported_model"


def test_a_checkpoint_tensor_the_configuration_leaves_out_is_named(tmp_path):
  """A checkpoint holding a tensor no parameter reads (attention biases in a Llama checkpoint
  whose config says none) loaded without a word; it loads as in transformers, with an
  ``unused_tensors`` warning naming it, and a clean checkpoint loads without one."""
  import json
  import warnings

  from safetensors.numpy import save_file

  import jaxlens.models as jm

  config = {
    "model_type": "llama", "hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 1,
    "num_attention_heads": 2, "num_key_value_heads": 2, "vocab_size": 16,
    "max_position_embeddings": 8, "rms_norm_eps": 1e-6, "tie_word_embeddings": True,
  }  # fmt: skip
  (tmp_path / "config.json").write_text(json.dumps(config))
  rng = np.random.default_rng(0)
  shapes = {
    "model.embed_tokens.weight": (16, 8), "model.norm.weight": (8,),
    "self_attn.q_proj.weight": (8, 8), "self_attn.k_proj.weight": (8, 8),
    "self_attn.v_proj.weight": (8, 8), "self_attn.o_proj.weight": (8, 8),
    "mlp.gate_proj.weight": (16, 8), "mlp.up_proj.weight": (16, 8),
    "mlp.down_proj.weight": (8, 16), "input_layernorm.weight": (8,),
    "post_attention_layernorm.weight": (8,),
    # a buffer older transformers saved: not a weight, never reported
    "self_attn.rotary_emb.inv_freq": (2,),
  }  # fmt: skip
  weights = {
    (k if k.startswith("model.") else f"model.layers.0.{k}"): rng.normal(size=s).astype("f4")
    for k, s in shapes.items()
  }
  save_file(weights, str(tmp_path / "model.safetensors"))
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    clean = jm.load_hf(tmp_path)
  weights["model.layers.0.self_attn.q_proj.bias"] = np.ones(8, np.float32)
  save_file(weights, str(tmp_path / "model.safetensors"))
  with pytest.warns(JaxlensWarning, match=r"q_proj\.bias") as record:
    loaded = jm.load_hf(tmp_path)
  assert [w.message.fields["code"] for w in record] == ["unused_tensors"]
  tokens = np.array([[1, 2, 3]])
  np.testing.assert_array_equal(
    loaded.model.apply(loaded.variables, tokens), clean.model.apply(clean.variables, tokens)
  )


@pytest.fixture
def read_only_dir(tmp_path):
  """A directory nothing can be created in, holding a user's file: ``chattr +i`` as root (root
  ignores permission bits), ``chmod 555`` otherwise."""
  import os
  import subprocess

  path = tmp_path / "read_only"
  path.mkdir()
  (path / "mine.txt").write_text("mine")
  if os.geteuid() == 0:
    made = subprocess.run(["chattr", "+i", str(path)], capture_output=True).returncode == 0
  else:
    path.chmod(0o555)
    made = True
  try:
    (path / "probe").touch()
  except OSError:
    pass
  else:
    made = False
  try:
    if not made:  # (a file system without the immutable attribute, such as tmpfs)
      pytest.skip("this file system cannot make a read-only directory for root")
    yield path
  finally:
    if os.geteuid() == 0:
      subprocess.run(["chattr", "-i", str(path)], capture_output=True)
    path.chmod(0o755)


def test_writers_refuse_a_read_only_directory_with_their_own_codes(read_only_dir):
  """Every writer of the newer wings given a directory it cannot write into raises its typed
  error and leaves the directory as it was: the lens writers raised a raw ``PermissionError``
  and the spec writer said ``spec_target_exists`` (no such target existed)."""
  from jaxlens import circuits, lens, sae, store
  from jaxlens.internal import Checkpoints

  model = jm_llama()
  variables = model.init(jax.random.key(0), jnp.zeros((1, 3), jnp.int32))
  tiny = nn.Sequential([nn.Dense(5)])
  tiny_vars = tiny.init(jax.random.key(0), jnp.zeros((1, 3), jnp.float32))
  dictionary = sae.SAE.init(jax.random.key(0), 8, 12)
  jacobian = lens.JacobianLens({0: np.eye(8, dtype=np.float32)}, n_prompts=1, d_model=8)
  ro = read_only_dir
  writes = {
    "store_path_invalid": lambda: store.collect(
      tiny,
      tiny_vars,
      [np.ones((2, 3), np.float32)],
      ro / "acts",
      sites=["layers_0"],
      progress=False,
    ),  # fmt: skip
    "sae_save_failed": lambda: sae.save_saelens(dictionary, ro / "sae"),
    "checkpoint_save_failed": lambda: Checkpoints(ro / "ckpt", 1).save(1, {"a": jnp.ones(2)}),
    "spec_save_failed": lambda: jl.save_spec(jl.when(jl.module("x"), jl.zero_ablate()), ro / "s"),
    "circuit_save_failed": lambda: circuits.save_transcoders(
      [sae.Transcoder.init(jax.random.key(1), 8, 12)], ro / "tc"
    ),
    "lens_save_failed": lambda: lens.save_tuned_lens(
      ro / "tuned", lens.TunedLens.for_model(model), model, variables
    ),
  }
  for code, write in writes.items():
    with pytest.raises(jl.JaxlensError) as e:
      write()
    assert e.value.fields["code"] == code, (code, e.value)
  with pytest.raises(lens.LensError) as e:
    lens.save_jacobian_lens(ro / "j.pt", jacobian)
  assert e.value.fields["code"] == "lens_save_failed"
  assert sorted(p.name for p in ro.iterdir()) == ["mine.txt"]


def jm_llama():
  import jaxlens.models as jm

  return jm.Llama(
    jm.LlamaConfig(vocab_size=16, d_model=8, n_layers=2, n_heads=2, n_kv_heads=2, d_mlp=16)
  )


def test_a_file_of_the_model_directory_and_a_non_zoo_model_are_named(tmp_path):
  """``load_hf`` given the directory's ``config.json`` said "config.json is not a readable zip
  archive (truncated or corrupt)"; ``circuits.attribute`` given the demo GPT raised a raw
  ``AttributeError`` (``config``)."""
  from jaxlens import circuits
  from jaxlens.models import init_gpt, load_hf

  (tmp_path / "config.json").write_text("{}")
  with pytest.raises(jl.JaxlensError, match="is a file, not a model directory") as e:
    load_hf(tmp_path / "config.json")
  assert e.value.fields["code"] == "file_not_found"
  assert repr(str(tmp_path)) in e.value.fields["fix"]
  model, variables, tokens = init_gpt(
    0, n_layers=1, d_model=8, n_heads=2, max_len=4, vocab_size=8, batch=1
  )
  with pytest.raises(jl.JaxlensError, match="GPT is not a decoder of jaxlens.models") as e:
    circuits.attribute(model, variables, np.asarray(tokens)[0], [None])
  assert e.value.fields["code"] == "circuit_unsupported_model"
