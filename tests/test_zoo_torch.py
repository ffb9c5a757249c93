"""Parity of the zoo with Hugging Face transformers' torch models (random small configs, the
same weights through ``from_state_dict``), and the same edit through a jaxlens door and a plain
torch forward hook. Skips without torch or transformers."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import jaxlens as jl
from hf_tiny import tiny_hf, zoo_twin
from jaxlens.models import load_hf

TOKENS = np.asarray([[3, 9, 4, 17, 5, 9, 26, 2], [1, 2, 3, 4, 5, 6, 7, 8]])
MASK = np.asarray([[1] * 8, [1] * 6 + [0] * 2])


def _float64_llama(hf):
  """Hugging Face computes RMSNorm and the rotary angles in float32 even in a float64 model;
  for the float64 comparison this test computes both in float64 (the float32 comparison runs
  the unmodified model)."""

  def rms(mod):
    def forward(h):
      return mod.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + mod.variance_epsilon))

    return forward

  for mod in hf.modules():
    if type(mod).__name__ == "LlamaRMSNorm":
      mod.forward = rms(mod)
  rot = hf.model.rotary_emb
  dim = hf.config.hidden_size // hf.config.num_attention_heads
  base = hf.config.rope_parameters["rope_theta"]
  inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))

  def rotary(x, position_ids):
    freqs = position_ids[..., None].double() * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(x.dtype), emb.sin().to(x.dtype)

  rot.forward = rotary
  return hf


def _build(family, dtype):
  torch_dtype = torch.float64 if dtype == jnp.float64 else torch.float32
  attention = "sdpa" if family == "llama" else "eager"  # Llama's default attention kernel
  positions = 32 if family == "llama" else 16  # GPT-2's and BERT's learned tables: 16 rows
  hf = tiny_hf(family, dtype=torch_dtype, attention=attention, positions=positions)
  if family == "llama" and dtype == jnp.float64:
    _float64_llama(hf)
  return hf, zoo_twin(hf, dtype)


def _hf_out(family, hf, tokens, mask=None):
  kw = {} if mask is None else {"attention_mask": torch.tensor(mask)}
  out = hf(torch.tensor(tokens), **kw)
  return out.last_hidden_state if family == "bert" else out.logits


def _jl_fn(family, lm, mask=None):
  if family == "bert":
    return lambda v, x, spec=None: (spec.bind(lm.model) if spec else lm.model.apply)(
      v, x, attention_mask=mask
    )
  return lambda v, x, spec=None: (spec.bind(lm.model) if spec else lm.model.apply)(v, x, mask)


def _rel(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.abs(a - b).max() / np.abs(b).max())


@pytest.mark.parametrize("family", ["gpt2", "llama", "bert"])
@pytest.mark.parametrize("dtype", [jnp.float64, jnp.float32], ids=["f64", "f32"])
def test_outputs_match_transformers(family, dtype):
  hf, lm = _build(family, dtype)
  with torch.no_grad():
    ref = _hf_out(family, hf, TOKENS, MASK).numpy()
  mask = jnp.asarray(MASK)
  ours = jax.jit(_jl_fn(family, lm, mask))(lm.variables, jnp.asarray(TOKENS))
  real = MASK.astype(bool)  # padded query positions are not compared
  err = _rel(np.asarray(ours)[real], ref[real])
  assert err <= (1e-10 if dtype == jnp.float64 else 1e-4), err
  if family == "bert":
    with torch.no_grad():
      pooled = hf(torch.tensor(TOKENS)).pooler_output.numpy()
    pool = jax.jit(lambda v, x: lm.model.apply(v, x, method="pool"))
    assert _rel(pool(lm.variables, jnp.asarray(TOKENS)), pooled) <= (
      1e-10 if dtype == jnp.float64 else 1e-4
    )


def _hook_modules(family, hf):
  """The torch modules whose outputs are ``blocks_1/mlp_out`` and ``blocks_1/resid_post``, and
  the upstream weight whose gradient is compared (with its zoo path, transposed or not)."""
  if family == "llama":
    return (
      hf.model.layers[1].mlp,
      hf.model.layers[1],
      hf.model.layers[0].mlp.up_proj.weight,
      ("blocks_0", "mlp", "up_proj", "kernel"),
      True,
    )
  if family == "gpt2":
    h = hf.transformer.h
    return h[1].mlp, h[1], h[0].mlp.c_fc.weight, ("blocks_0", "mlp", "c_fc", "kernel"), False
  layer = hf.encoder.layer
  return (
    layer[1].output.dense,
    layer[1],
    layer[0].intermediate.dense.weight,
    ("blocks_0", "mlp", "up", "kernel"),
    True,
  )


def _replace_output(fn):
  def hook(module, args, output):
    if isinstance(output, tuple):
      return (fn(output[0]),) + tuple(output[1:])
    return fn(output)

  return hook


@pytest.mark.parametrize("family", ["gpt2", "llama", "bert"])
def test_the_same_edit_through_a_door_and_a_torch_hook(family):
  hf, lm = _build(family, jnp.float64)
  mlp, layer, weight, path, transpose = _hook_modules(family, hf)
  direction = np.linspace(-1.0, 1.0, 32)
  probe = np.random.default_rng(0).normal(size=_hf_out(family, hf, TOKENS).shape)
  cases = [
    (mlp, lambda y: torch.zeros_like(y), jl.when(jl.module("blocks_1/mlp_out"), jl.zero_ablate())),
    (
      layer,
      lambda y: y + 2.5 * torch.tensor(direction),
      jl.when(jl.module("blocks_1/resid_post"), jl.steer(jnp.asarray(direction), 2.5)),
    ),
  ]
  run = _jl_fn(family, lm)
  x = jnp.asarray(TOKENS)

  @jax.jit
  def everything(v):  # the plain output, and each edit's output and gradient: one program
    def edited(spec):
      return run(v, x, spec), jax.grad(lambda w: (run(w, x, spec) * probe).sum())(v)

    return run(v, x), [edited(spec) for _, _, spec in cases]

  plain, results = everything(lm.variables)
  for (module, fn, _), (ours, grads) in zip(cases, results, strict=True):
    handle = module.register_forward_hook(_replace_output(fn))
    try:
      hf.zero_grad()
      out = _hf_out(family, hf, TOKENS)
      (out * torch.tensor(probe)).sum().backward()
    finally:
      handle.remove()
    ref_grad = weight.grad.detach().numpy()
    ref_grad = ref_grad.T if transpose else ref_grad
    assert _rel(ours, out.detach().numpy()) <= 1e-10
    assert not np.allclose(ours, plain)  # the edit changed something
    grads = grads["params"]
    for p in path:
      grads = grads[p]
    assert _rel(grads, ref_grad) <= 1e-10


def test_a_saved_hugging_face_directory_loads(tmp_path):
  hf, lm = _build("gpt2", jnp.float32)
  hf.save_pretrained(tmp_path, safe_serialization=True)
  loaded = load_hf(tmp_path)
  assert loaded.config == lm.config
  with torch.no_grad():
    ref = _hf_out("gpt2", hf, TOKENS).numpy()
  assert _rel(jax.jit(loaded.model.apply)(loaded.variables, jnp.asarray(TOKENS)), ref) <= 1e-4
