"""Checkpoint formats as transformers writes them: bfloat16 and float16 safetensors, the sharded
layout (``model.safetensors.index.json`` and its shards), loaded into float32, bfloat16 and
float64 models; a damaged index or shard refused with a typed error; and the peak resident
memory of a memory-mapped load. Skips without torch and transformers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from _checkpoints import llama_checkpoint
from hf_tiny import tiny_hf
from jaxlens.models import LoadError, load_hf

TOKENS = np.asarray([[3, 9, 4, 17, 5, 9, 26, 2], [1, 2, 3, 4, 5, 6, 7, 8]])


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  """A tiny Llama saved by transformers as one float32 file, as float32 shards, and as one
  bfloat16 and one float16 file; with its float32 logits and its bfloat16 twin's."""
  hf = tiny_hf("llama")
  root = tmp_path_factory.mktemp("formats")
  hf.save_pretrained(root / "f32")
  hf.save_pretrained(root / "sharded", max_shard_size="20KB")
  with torch.no_grad():
    logits = hf(torch.as_tensor(TOKENS)).logits.numpy()
    hf.to(torch.float16).save_pretrained(root / "f16")
    bf16 = tiny_hf("llama", dtype=torch.bfloat16)
    bf16.save_pretrained(root / "bf16")
    # the bfloat16 weights computed in float32 (a float32 model given them: casting the model
    # itself would round its rotary frequencies too), what a float32 model of the file computes
    ref = tiny_hf("llama")
    ref.load_state_dict({k: v.float() for k, v in bf16.state_dict().items()})
    logits_bf16 = ref(torch.as_tensor(TOKENS)).logits.numpy()
  return root, logits, logits_bf16


_FORWARD = {}  # config -> the jitted forward (one compile per config for the module)


def _logits(lm):
  assert lm.model == type(lm.model)(lm.config)  # the loaded model is its config's
  forward = _FORWARD.setdefault(lm.config, jax.jit(type(lm.model)(lm.config).apply))
  return np.asarray(forward(lm.variables, TOKENS), np.float64)


def _rel(a, b):
  return float(np.abs(a - b).max() / np.abs(b).max())


def test_sharded_directory_equals_the_single_file_and_transformers(saved):
  root, logits, _ = saved
  index = json.loads((root / "sharded" / "model.safetensors.index.json").read_text())
  assert len(set(index["weight_map"].values())) >= 3  # really several shards
  one, sharded = load_hf(root / "f32"), load_hf(root / "sharded")
  assert jax.tree.all(jax.tree.map(np.array_equal, one.variables, sharded.variables))
  assert _rel(_logits(sharded), logits) < 1e-4


@pytest.mark.parametrize(
  "dtype, tol", [(jnp.float32, 1e-4), (jnp.float64, 1e-4), (jnp.bfloat16, 5e-2)]
)
def test_a_bfloat16_file_loads_into_each_dtype(saved, dtype, tol):
  root, _, logits_bf16 = saved
  lm = load_hf(root / "bf16", dtype=dtype)
  leaves = jax.tree.leaves(lm.variables)
  assert {x.dtype for x in leaves} == {jnp.dtype(dtype)}
  # every weight is the file's bfloat16 value exactly (widening is exact)
  ref = load_hf(root / "bf16", dtype=jnp.bfloat16).variables
  same = jax.tree.map(
    lambda a, b: bool((np.asarray(a, np.float64) == np.asarray(b, np.float64)).all()),
    lm.variables,
    ref,
  )
  assert jax.tree.all(same)
  assert _rel(_logits(lm), logits_bf16) < tol


def test_a_float16_file_and_a_bfloat16_state_dict(saved):
  root, logits, logits_bf16 = saved
  f16 = load_hf(root / "f16")
  assert _rel(_logits(f16), logits) < 2e-2  # float16 rounding of the weights
  from jaxlens.models import config_from_hf, from_state_dict

  hf = tiny_hf("llama", dtype=torch.bfloat16)
  lm = from_state_dict(hf.state_dict(), config_from_hf(hf.config.to_dict(), jnp.float32))
  assert _rel(_logits(lm), logits_bf16) < 1e-4


def _copy(src, dst):
  import shutil

  shutil.copytree(src, dst)
  return dst


def _raises(fn, code):
  with pytest.raises(LoadError, match=rf"\[{code}\]") as info:
    fn()
  return info.value


def test_a_damaged_sharded_directory_is_refused_naming_what(saved, tmp_path):
  root = saved[0] / "sharded"
  index = json.loads((root / "model.safetensors.index.json").read_text())
  shards = sorted(set(index["weight_map"].values()))
  # a shard the index names is missing
  d = _copy(root, tmp_path / "missing")
  (d / shards[1]).unlink()
  assert _raises(lambda: load_hf(d), "missing_shard").fields["tensor"] == shards[1]
  # the index puts a tensor in a shard that does not hold it
  d = _copy(root, tmp_path / "moved")
  name = next(k for k, v in index["weight_map"].items() if v == shards[0])
  moved = {**index, "weight_map": {**index["weight_map"], name: shards[1]}}
  (d / "model.safetensors.index.json").write_text(json.dumps(moved))
  assert _raises(lambda: load_hf(d), "shard_index").fields["tensor"] == name
  # a shard outside the directory
  (d / "model.safetensors.index.json").write_text(
    json.dumps({"weight_map": {name: "../f32/model.safetensors"}})
  )
  _raises(lambda: load_hf(d), "shard_index")
  # an index that is not one
  for text in ("{not json", '{"metadata": {}}', '{"weight_map": {"a": 3}}'):
    (d / "model.safetensors.index.json").write_text(text)
    e = _raises(lambda: load_hf(d), "truncated_file")
    assert e.fields["tensor"] == "model.safetensors.index.json"
  # a shard whose header is damaged: its size field, then its JSON
  for k, damage in enumerate(
    (
      lambda b: (10**9).to_bytes(8, "little") + b[8:],
      lambda b: b[:8] + b"[" + b[9:],
      lambda b: b[: len(b) - 4],
    )
  ):
    d = _copy(root, tmp_path / f"header{k}")
    (d / shards[0]).write_bytes(damage((d / shards[0]).read_bytes()))
    assert _raises(lambda d=d: load_hf(d), "truncated_file").fields["tensor"] == shards[0]


# The peak resident memory of loading, measured in a fresh process: a model of 63 MB of float32
# weights written as one safetensors file, loaded into float32 and bfloat16 models.
_MEMORY = textwrap.dedent(
  """
  import gc, json, sys
  import jax, jax.numpy as jnp, numpy as np
  from jaxlens.models import load_hf

  def status(key):
    line = next(l for l in open("/proc/self/status") if l.startswith(key))
    return int(line.split()[1]) * 1024

  load_hf(sys.argv[2])  # a tiny model first: what a load costs once per process is not measured
  out = {}
  for name in sys.argv[3:]:
    base = status("VmRSS:")
    open("/proc/self/clear_refs", "w").write("5")  # VmHWM := VmRSS
    lm = load_hf(sys.argv[1], dtype=getattr(jnp, name))
    weights = sum(x.nbytes for x in jax.tree.leaves(lm.variables))
    out[name] = [weights, status("VmHWM:") - base]
    del lm
    gc.collect()
  print(json.dumps(out))
  """
)


def test_loading_peaks_near_the_weights_size(saved, tmp_path):
  rng = np.random.default_rng(0)
  llama_checkpoint(
    tmp_path,
    vocab=8192,
    width=512,
    mlp=2048,
    heads=4,
    kv_heads=2,
    draw=lambda shape: rng.standard_normal(shape, np.float32),
    rms_norm_eps=1e-5,
    rope_theta=1e4,
  )
  run = subprocess.run(
    [sys.executable, "-c", _MEMORY, str(tmp_path), str(saved[0] / "f32"), "float32", "bfloat16"],
    capture_output=True,
    text=True,
    check=True,
    # glibc's defaults but a fixed mmap threshold, not the suite's tunables (conftest.py keeps
    # freed memory and pads the heap by 64 MiB): every array is its own mapping, returned
    # when freed, so resident memory is what the loads hold
    env={
      **{k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"},
      "JAX_PLATFORMS": "cpu",
      "MALLOC_MMAP_THRESHOLD_": "131072",
    },
  )
  got = json.loads(run.stdout.splitlines()[-1])
  for name, (weights, peak) in got.items():
    # the weights in the chosen dtype plus at most one part of the file (16 MiB) and the
    # loader's small change; before the mapped reader, the whole file was read into memory
    # (+63 MB for the float32 model, +95 MB for the bfloat16 one)
    assert peak <= weights + 20 * 2**20, (name, weights, peak)
    assert peak >= weights, (name, weights, peak)
