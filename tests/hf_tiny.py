"""Tiny Hugging Face transformers models with random weights, for the parity tests against
the zoo (tests/test_zoo_torch.py, tests/test_generate_torch.py, tests/test_zoo_families.py). Imported only by test files
that have already skipped without torch and transformers."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import torch
import transformers

from jaxlens.models import config_from_hf, from_state_dict

VOCAB, D_MODEL, D_MLP, LAYERS, HEADS = 64, 32, 48, 2, 4
WINDOW = 4  # the sliding windows: shorter than the tests' 8-token sequences
DECODERS = ("gpt2", "llama", "mistral", "qwen2", "qwen3", "gpt_neox", "gemma3", "gemma2")
# Issue 50's families: Gemma 1, Phi-3 (fused projections, partial rotation, a window on every
# layer), OLMo 2 (norms after the sub-blocks, QK-norm over the projection) and the mixtures of
# experts (4 experts, top 2; run by transformers' eager experts loop, whose grouped_mm
# alternative refuses float64).
NEW_DECODERS = ("gemma", "phi3", "olmo2", "mixtral", "qwen2_moe", "qwen3_moe", "olmoe")
MOE = dict(num_experts_per_tok=2, experts_implementation="eager")
TOKEN_IDS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)


def tiny_hf(family: str, *, dtype=torch.float32, attention: str = "eager", positions: int = 32):
  """A two-layer model of width 32 (a family of ``DECODERS`` or ``bert``) with every parameter
  drawn from a normal (torch seed 0; not the near-zero init some layers get), in eval mode.
  Sliding windows (Mistral: every layer; Qwen2/3: layer 1; Gemma: layer 0) are ``WINDOW``."""
  torch.manual_seed(0)
  common = dict(
    vocab_size=VOCAB,
    hidden_size=D_MODEL,
    intermediate_size=D_MLP,
    num_hidden_layers=LAYERS,
    num_attention_heads=HEADS,
    num_key_value_heads=2,
    max_position_embeddings=positions,
    attn_implementation=attention,
  )
  if family == "mistral":
    cfg = transformers.MistralConfig(
      **common, sliding_window=WINDOW, rope_parameters={"rope_type": "default", "rope_theta": 800.0}
    )
    hf = transformers.MistralForCausalLM(cfg)
  elif family in ("qwen2", "qwen3"):
    cls = transformers.Qwen2Config if family == "qwen2" else transformers.Qwen3Config
    cfg = cls(
      **common,
      use_sliding_window=True,
      sliding_window=WINDOW,
      max_window_layers=1,
      tie_word_embeddings=family == "qwen3",
      **({"head_dim": 16} if family == "qwen3" else {}),
    )
    model = transformers.Qwen2ForCausalLM if family == "qwen2" else transformers.Qwen3ForCausalLM
    hf = model(cfg)
  elif family == "gpt_neox":
    del common["num_key_value_heads"]
    cfg = transformers.GPTNeoXConfig(
      **common,
      rope_parameters={"rope_type": "default", "rope_theta": 900.0, "partial_rotary_factor": 0.5},
    )
    hf = transformers.GPTNeoXForCausalLM(cfg)
  elif family == "gemma3":
    cfg = transformers.Gemma3TextConfig(
      **common,
      head_dim=16,
      sliding_window=WINDOW,
      layer_types=["sliding_attention", "full_attention"],
      query_pre_attn_scalar=12,
      rope_parameters={
        "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
        "full_attention": {"rope_type": "default", "rope_theta": 1000.0},
      },
    )
    hf = transformers.Gemma3ForCausalLM(cfg)
  elif family == "gemma2":
    cfg = transformers.Gemma2Config(
      **common,
      head_dim=16,
      sliding_window=WINDOW,
      query_pre_attn_scalar=12,
      attn_logit_softcapping=3.0,
      final_logit_softcapping=5.0,
      rope_parameters={"rope_type": "default", "rope_theta": 300.0},
    )
    hf = transformers.Gemma2ForCausalLM(cfg)
  elif family == "gemma":
    cfg = transformers.GemmaConfig(
      **common,
      **TOKEN_IDS,
      head_dim=16,
      rope_parameters={"rope_type": "default", "rope_theta": 200.0},
    )
    hf = transformers.GemmaForCausalLM(cfg)
  elif family == "phi3":
    cfg = transformers.Phi3Config(
      **common,
      **TOKEN_IDS,
      sliding_window=WINDOW,
      rope_parameters={"rope_type": "default", "rope_theta": 700.0, "partial_rotary_factor": 0.5},
    )
    hf = transformers.Phi3ForCausalLM(cfg)
  elif family == "olmo2":
    cfg = transformers.Olmo2Config(
      **common, **TOKEN_IDS, rope_parameters={"rope_type": "default", "rope_theta": 600.0}
    )
    hf = transformers.Olmo2ForCausalLM(cfg)
  elif family == "mixtral":
    cfg = transformers.MixtralConfig(
      **common, **TOKEN_IDS, **MOE, num_local_experts=4, sliding_window=WINDOW
    )
    hf = transformers.MixtralForCausalLM(cfg)
  elif family in ("qwen2_moe", "qwen3_moe"):
    moe = dict(**MOE, num_experts=4, moe_intermediate_size=24)
    if family == "qwen2_moe":
      cfg = transformers.Qwen2MoeConfig(
        **common, **TOKEN_IDS, **moe, shared_expert_intermediate_size=40, norm_topk_prob=False
      )
      hf = transformers.Qwen2MoeForCausalLM(cfg)
    else:
      cfg = transformers.Qwen3MoeConfig(
        **common, **TOKEN_IDS, **moe, head_dim=16, norm_topk_prob=True, tie_word_embeddings=True
      )
      hf = transformers.Qwen3MoeForCausalLM(cfg)
  elif family == "olmoe":
    cfg = transformers.OlmoeConfig(**common, **TOKEN_IDS, **MOE, num_experts=4)
    hf = transformers.OlmoeForCausalLM(cfg)
  elif family == "llama":
    cfg = transformers.LlamaConfig(
      vocab_size=VOCAB,
      hidden_size=D_MODEL,
      intermediate_size=D_MLP,
      num_hidden_layers=LAYERS,
      num_attention_heads=HEADS,
      num_key_value_heads=2,
      max_position_embeddings=positions,
      rope_parameters={"rope_type": "default", "rope_theta": 500.0},
      tie_word_embeddings=False,
      attn_implementation=attention,
    )
    hf = transformers.LlamaForCausalLM(cfg)
  elif family == "gpt2":
    cfg = transformers.GPT2Config(
      vocab_size=VOCAB,
      n_positions=positions,
      n_embd=D_MODEL,
      n_layer=LAYERS,
      n_head=HEADS,
      attn_implementation=attention,
    )
    hf = transformers.GPT2LMHeadModel(cfg)
  elif family == "bert":
    cfg = transformers.BertConfig(
      vocab_size=VOCAB,
      hidden_size=D_MODEL,
      num_hidden_layers=LAYERS,
      num_attention_heads=HEADS,
      intermediate_size=D_MLP,
      max_position_embeddings=positions,
      attn_implementation=attention,
    )
    hf = transformers.BertModel(cfg)
  else:
    raise ValueError(
      f"unknown family {family!r}; expected one of {DECODERS + NEW_DECODERS} or 'bert'"
    )
  for p in hf.parameters():
    with torch.no_grad():
      p.normal_(0.0, 0.3 if p.ndim > 1 else 0.5)
  return hf.eval().to(dtype)


def steered_generate(hf, layer, prompt, n: int, direction=None, magnitude: float = 1.0):
  """Greedy ``hf.generate`` of ``n`` tokens after ``prompt`` (int array, no padding) with
  ``magnitude * direction`` added to ``layer``'s output by a plain torch forward hook (no hook
  when ``direction`` is None): ``(new tokens, logits of every step)`` as numpy arrays."""

  def steer(module, args, output):
    if isinstance(output, tuple):
      return (output[0] + magnitude * direction,) + tuple(output[1:])
    return output + magnitude * direction

  handle = None if direction is None else layer.register_forward_hook(steer)
  try:
    with torch.no_grad():
      out = hf.generate(
        torch.as_tensor(prompt),
        max_new_tokens=n,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
        pad_token_id=0,
      )
  finally:
    if handle is not None:
      handle.remove()
  tokens = out.sequences[:, prompt.shape[1] :].numpy()
  return tokens, np.stack([s.numpy() for s in out.logits], axis=1)


def zoo_twin(hf, dtype=jnp.float32):
  """The zoo's model with ``hf``'s weights (``jm.from_state_dict``)."""
  return from_state_dict(hf.state_dict(), config_from_hf(hf.config.to_dict(), dtype))


def _f64_eager(original):
  """The family's eager attention with the softmax in the scores' dtype when it is float64
  (transformers' eager attention takes it in float32 even in a float64 model); float32 calls
  go to the original."""

  def forward(module, query, key, value, attention_mask, scaling=None, softcap=None, **kwargs):
    if query.dtype != torch.float64:
      return original(
        module, query, key, value, attention_mask, scaling=scaling, softcap=softcap, **kwargs
      )
    groups = query.shape[1] // key.shape[1]

    def repeat(x):  # expand + reshape, as transformers' repeat_kv (exportable)
      b, h, s, d = x.shape
      return x[:, :, None].expand(b, h, groups, s, d).reshape(b, h * groups, s, d)

    key, value = repeat(key), repeat(value)
    if scaling is None:
      scaling = query.shape[-1] ** -0.5
    scores = torch.matmul(query, key.transpose(2, 3)) * scaling
    if softcap is not None:
      scores = torch.tanh(scores / softcap) * softcap
    if attention_mask is not None:
      if attention_mask.dtype == torch.bool:
        scores = scores.masked_fill(~attention_mask, torch.finfo(scores.dtype).min)
      else:
        scores = scores + attention_mask[..., : key.shape[-2]]
    weights = torch.softmax(scores, dim=-1)
    return torch.matmul(weights, value).transpose(1, 2).contiguous(), weights

  forward.jaxlens_f64 = True
  return forward


def _rope_base(config, layer_type=None):
  rope = config.rope_parameters
  if layer_type is not None and layer_type in rope:
    rope = rope[layer_type]
  return rope["rope_theta"], rope.get("partial_rotary_factor", 1.0)


def _f64_inv_freq(cfg, head_dim, layer_type, position_ids):
  """The rotary frequencies and cos/sin factor of ``cfg`` (a scaled ``rope_type`` too) as
  transformers' own function computes them, run in float64: its float32 dtype names and
  ``Tensor.float`` are pointed at float64 for the call (transformers computes the frequencies
  in float32)."""
  from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

  rope = cfg.rope_parameters
  if layer_type is not None and layer_type in rope:
    rope = rope[layer_type]
  kind = rope.get("rope_type", "default")
  if kind == "default":
    base, factor = _rope_base(cfg, layer_type)
    dim = int(head_dim * factor)
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)), 1.0
  saved = torch.float, torch.float32, torch.Tensor.float
  torch.float = torch.float32 = torch.float64
  torch.Tensor.float = torch.Tensor.double
  try:
    kwargs = (
      {"layer_type": layer_type}
      if layer_type is not None and layer_type in cfg.rope_parameters
      else {}
    )
    # The sequence length (dynamic scaling's) only here: torch.export cannot read a tensor's
    # value, and the default rotation, which converted models use, needs none.
    seq_len = int(position_ids.max()) + 1
    inv_freq, scale = ROPE_INIT_FUNCTIONS[kind](cfg, None, seq_len=seq_len, **kwargs)
  finally:
    torch.float, torch.float32, torch.Tensor.float = saved
  return inv_freq.double(), float(scale)


def exact_float64(hf):
  """Makes a float64 transformers model compute in float64 throughout: RMSNorm and the rotary
  angles (which transformers computes in float32 even in a float64 model), the eager
  attention's softmax (``_f64_eager``), Gemma's embedding scale (a float32 buffer, so
  ``sqrt(d_model)`` rounded to float32) and a mixture of experts' router softmax. The float32
  comparisons run the unmodified model."""
  import importlib

  module = importlib.import_module(type(hf).__module__)
  if not getattr(module.eager_attention_forward, "jaxlens_f64", False):
    module.eager_attention_forward = _f64_eager(module.eager_attention_forward)

  def rms(mod, gemma):
    eps = getattr(mod, "variance_epsilon", getattr(mod, "eps", 1e-6))

    def forward(h):
      normed = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
      return normed * (1.0 + mod.weight) if gemma else mod.weight * normed

    return forward

  def router(mod):
    # A mixture of experts' router with its softmax in float64 (transformers takes it in
    # float32); Mixtral's always renormalises the top k.
    norm = getattr(mod, "norm_topk_prob", True)

    def forward(h):
      logits = torch.nn.functional.linear(h.reshape(-1, mod.hidden_dim), mod.weight)
      top, index = torch.topk(torch.softmax(logits, dim=-1), mod.top_k, dim=-1)
      return logits, (top / top.sum(dim=-1, keepdim=True) if norm else top), index

    return forward

  cfg = hf.config
  head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads

  def rotary(x, position_ids, layer_type=None):
    inv_freq, scale = _f64_inv_freq(cfg, head_dim, layer_type, position_ids)
    freqs = position_ids[..., None].double() * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return (emb.cos() * scale).to(x.dtype), (emb.sin() * scale).to(x.dtype)

  for mod in hf.modules():
    name = type(mod).__name__
    if name.endswith("RMSNorm"):
      mod.forward = rms(mod, name.startswith("Gemma"))
    elif name.endswith("RotaryEmbedding"):
      mod.forward = rotary
    elif name.endswith("TopKRouter"):
      mod.forward = router(mod)
    elif name.endswith("ScaledWordEmbedding"):
      mod.embed_scale = torch.tensor(cfg.hidden_size**0.5, dtype=torch.float64)
  return hf
