"""Agreement with circuit-tracer 0.5.0, the jaxlens side (run after circuits_agreement_ct.py,
which writes /tmp/ct/exchange_<layout>_<kind>[_b].npz from its own environment): the same weights
in the zoo's GPT-2, Llama, Gemma (with Gemma 2's options, with or without a sliding window) or
GPT-NeoX, the same transcoders, the same graph, compared in float32 and
float64 (adjacency, active and selected features, logit targets, pruning masks, scores), and
circuits.feature_intervention / feature_intervention_generate against circuit-tracer's
(logits and feature pre-activations under each freezing setting, generated tokens and logits).

Usage::

  LAYOUT=gpt2|llama|gemma2|gemma2_window|neox [BUDGET=50] python benchmarks/circuits_agreement.py plain|skip|clt
"""

import sys
import jax
import jax.numpy as jnp
import numpy as np

jax.config.update("jax_enable_x64", True)
from jaxlens import circuits, sae
from jaxlens.models import GPT2, GPT2Config

kind = sys.argv[1] if len(sys.argv) > 1 else "plain"
import os

budget = int(os.environ.get("BUDGET", "0")) or None
layout = os.environ.get("LAYOUT", "gpt2")
z = np.load(f"/tmp/ct/exchange_{layout}_{kind}{'_b' if budget else ''}.npz")
w = {k[2:]: z[k] for k in z.files if k.startswith("w/")}


def get(suffix):
  hits = [k for k in w if k.endswith(suffix)]
  assert len(hits) == 1, (suffix, hits)
  return w[hits[0]]


L, D, V = 2, 32, 50


def build(dtype):
  if layout == "llama":
    return build_llama(dtype)
  if layout in ("gemma2", "gemma2_window"):
    return build_gemma2(dtype)
  if layout == "neox":
    return build_neox(dtype)
  m = GPT2(
    GPT2Config(
      vocab_size=V,
      d_model=D,
      n_layers=L,
      n_heads=4,
      d_mlp=64,
      max_len=16,
      tie_embeddings=False,
      dtype=dtype,
    )
  )
  c = lambda a: jnp.asarray(a, dtype)
  p = {
    "embed": {"embedding": c(get("embed.W_E"))},
    "pos_embed": {"embedding": c(get("pos_embed.W_pos"))},
    "ln_final": {"scale": c(get("ln_final.w")), "bias": c(get("ln_final.b"))},
    "lm_head": {"kernel": c(get("W_U"))},
  }
  for i in range(L):
    b = f"blocks.{i}."
    g = lambda s, b=b: get(b + s)
    attn = {}
    for n, x in (("q_proj", "Q"), ("k_proj", "K"), ("v_proj", "V")):
      W = g(f"attn.W_{x}")  # (h, d, e)
      attn[n] = {
        "kernel": c(W.transpose(1, 0, 2).reshape(D, -1)),
        "bias": c(g(f"attn.b_{x}").reshape(-1)),
      }
    attn["c_proj"] = {"kernel": c(g("attn.W_O").reshape(-1, D)), "bias": c(g("attn.b_O"))}
    mlp_in = [k for k in w if k.startswith(b) and k.endswith("W_in")][0]
    pre = mlp_in[: -len("W_in")]
    p[f"blocks_{i}"] = {
      "attn": attn,
      "ln_1": {"scale": c(g("ln1.w")), "bias": c(g("ln1.b"))},
      "ln_2": {"scale": c(g("ln2.w")), "bias": c(g("ln2.b"))},
      "mlp": {
        "c_fc": {"kernel": c(w[pre + "W_in"]), "bias": c(w[pre + "b_in"])},
        "c_proj": {"kernel": c(w[pre + "W_out"]), "bias": c(w[pre + "b_out"])},
      },
    }
  assert np.abs(get("b_U")).max() == 0
  return m, {"params": p}, transcoders(dtype)


def transcoders(dtype):
  c = lambda a: jnp.asarray(a, dtype)
  if kind == "clt":
    clt = sae.CrossLayerTranscoder.init(jax.random.key(0), n_layers=L, d_in=D, d_sae=64)
    return clt.replace(
      W_enc=c(z["clt/W_enc"].transpose(0, 2, 1)),
      b_enc=c(z["clt/b_enc"]),
      W_dec=tuple(c(z[f"clt/W_dec{i}"].transpose(1, 0, 2)) for i in range(L)),
      b_dec=c(z["clt/b_dec"]),
    )
  tcs = []
  for i in range(L):
    t = sae.Transcoder.init(jax.random.key(0), d_in=D, d_sae=64, dtype=dtype, skip=kind == "skip")
    ch = dict(
      W_enc=c(z[f"tc{i}/W_enc"].T),
      b_enc=c(z[f"tc{i}/b_enc"]),
      W_dec=c(z[f"tc{i}/W_dec"]),
      b_dec=c(z[f"tc{i}/b_dec"]),
    )
    if kind == "skip":
      ch["W_skip"] = c(z[f"tc{i}/W_skip"])
    tcs.append(t.replace(**ch))
  return tcs


def build_llama(dtype):
  from jaxlens.models import Llama, LlamaConfig

  m = Llama(
    LlamaConfig(
      vocab_size=V,
      d_model=D,
      n_layers=L,
      n_heads=4,
      n_kv_heads=4,
      d_mlp=64,
      max_len=16,
      dtype=dtype,
    )
  )
  c = lambda a: jnp.asarray(a, dtype)
  p = {
    "embed": {"embedding": c(get("embed.W_E"))},
    "ln_final": {"weight": c(get("ln_final.w"))},
    "lm_head": {"kernel": c(get("W_U"))},
  }
  for i in range(L):
    b = f"blocks.{i}."
    g = lambda s, b=b: get(b + s)
    attn = {}
    for n, x in (("q_proj", "Q"), ("k_proj", "K"), ("v_proj", "V")):
      attn[n] = {"kernel": c(g(f"attn.W_{x}").transpose(1, 0, 2).reshape(D, -1))}
      assert np.abs(g(f"attn.b_{x}")).max() == 0
    attn["o_proj"] = {"kernel": c(g("attn.W_O").reshape(-1, D))}
    pre = [k for k in w if k.startswith(b) and k.endswith("W_in")][0][: -len("W_in")]
    assert np.abs(w[pre + "b_in"]).max() == 0 and np.abs(w[pre + "b_out"]).max() == 0
    p[f"blocks_{i}"] = {
      "attn": attn,
      "ln_1": {"weight": c(g("ln1.w"))},
      "ln_2": {"weight": c(g("ln2.w"))},
      "mlp": {
        "gate_proj": {"kernel": c(w[pre + "W_gate"])},
        "up_proj": {"kernel": c(w[pre + "W_in"])},
        "down_proj": {"kernel": c(w[pre + "W_out"])},
      },
    }
  return m, {"params": p}, transcoders(dtype)


def build_neox(dtype):
  from jaxlens.models.gpt_neox import GPTNeoX, GPTNeoXConfig

  m = GPTNeoX(
    GPTNeoXConfig(
      vocab_size=V,
      d_model=D,
      n_layers=L,
      n_heads=4,
      d_mlp=64,
      rotary_pct=0.25,  # TransformerLens's rotary_dim 2 of d_head 8, rotate-half as NeoX
      activation="gelu",
      max_len=16,
      dtype=dtype,
    )
  )
  c = lambda a: jnp.asarray(a, dtype)  # noqa: E731
  p = {
    "embed": {"embedding": c(get("embed.W_E"))},
    "ln_final": {"scale": c(get("ln_final.w")), "bias": c(get("ln_final.b"))},
    "lm_head": {"kernel": c(get("W_U"))},
  }
  for i in range(L):
    b = f"blocks.{i}."
    g = lambda s, b=b: get(b + s)  # noqa: E731
    attn = {}
    for n, x in (("q_proj", "Q"), ("k_proj", "K"), ("v_proj", "V")):
      attn[n] = {
        "kernel": c(g(f"attn.W_{x}").transpose(1, 0, 2).reshape(D, -1)),
        "bias": c(g(f"attn.b_{x}").reshape(-1)),
      }
    attn["dense"] = {"kernel": c(g("attn.W_O").reshape(-1, D)), "bias": c(g("attn.b_O"))}
    pre = [k for k in w if k.startswith(b) and k.endswith("W_in")][0][: -len("W_in")]
    p[f"blocks_{i}"] = {
      "attn": attn,
      "ln_1": {"scale": c(g("ln1.w")), "bias": c(g("ln1.b"))},
      "ln_2": {"scale": c(g("ln2.w")), "bias": c(g("ln2.b"))},
      "mlp": {
        "dense_h_to_4h": {"kernel": c(w[pre + "W_in"]), "bias": c(w[pre + "b_in"])},
        "dense_4h_to_h": {"kernel": c(w[pre + "W_out"]), "bias": c(w[pre + "b_out"])},
      },
    }
  assert np.abs(get("b_U")).max() == 0
  return m, {"params": p}, transcoders(dtype)


def build_gemma2(dtype):
  from jaxlens.models import Gemma3, Gemma3Config

  m = Gemma3(
    Gemma3Config(
      vocab_size=V,
      d_model=D,
      n_layers=L,
      n_heads=4,
      n_kv_heads=4,
      head_dim=8,
      d_mlp=64,
      query_pre_attn_scalar=64.0,
      # gemma2_window: layer 0 sees itself and the 2 tokens before (TransformerLens's
      # window_size 3), layer 1 the whole prompt
      sliding_window=3 if layout == "gemma2_window" else None,
      layer_types=("sliding_attention", "full_attention") if layout == "gemma2_window" else None,
      rope_base=10000.0,
      rope_local_base=10000.0,
      qk_norm=False,
      attn_softcap=50.0,
      final_softcap=30.0,
      tie_embeddings=False,
      max_len=16,
      dtype=dtype,
    )
  )
  c = lambda a: jnp.asarray(a, dtype)  # noqa: E731
  one = lambda a: c(np.asarray(a, np.float64) - 1.0)  # noqa: E731  (Gemma's norm is 1 + weight)
  # TransformerLens's Gemma folds sqrt(d_model) into W_E when it loads; built from a config it
  # has none, while the zoo scales its embedding by sqrt(d_model).
  p = {
    "embed": {"embedding": c(np.asarray(get("embed.W_E"), np.float64) / np.sqrt(D))},
    "ln_final": {"weight": one(get("ln_final.w"))},
    "lm_head": {"kernel": c(get("W_U"))},
  }
  for i in range(L):
    b = f"blocks.{i}."
    g = lambda s, b=b: get(b + s)  # noqa: E731
    attn = {}
    for n, x in (("q_proj", "Q"), ("k_proj", "K"), ("v_proj", "V")):
      attn[n] = {"kernel": c(g(f"attn.W_{x}").transpose(1, 0, 2).reshape(D, -1))}
    attn["o_proj"] = {"kernel": c(g("attn.W_O").reshape(-1, D))}
    pre = [k for k in w if k.startswith(b) and k.endswith("W_in")][0][: -len("W_in")]
    p[f"blocks_{i}"] = {
      "attn": attn,
      "ln_1": {"weight": one(g("ln1.w"))},
      "ln_1_post": {"weight": one(g("ln1_post.w"))},
      "ln_2": {"weight": one(g("ln2.w"))},
      "ln_2_post": {"weight": one(g("ln2_post.w"))},
      "mlp": {
        "gate_proj": {"kernel": c(w[pre + "W_gate"])},
        "up_proj": {"kernel": c(w[pre + "W_in"])},
        "down_proj": {"kernel": c(w[pre + "W_out"])},
      },
    }
  return m, {"params": p}, transcoders(dtype)


tokens = jnp.asarray(z["tokens"], jnp.int32)
for dtype in (jnp.float32, jnp.float64):
  m, v, tcs = build(dtype)
  g = circuits.attribute(m, v, tokens, tcs, zero_bos=True, batch_size=16, max_feature_nodes=budget)
  A, B = g.adjacency, z["adjacency"]
  same_feats = np.array_equal(g.active_features, z["active_features"])
  print(
    dtype.__name__,
    "adjacency shapes",
    A.shape,
    B.shape,
    "same active features",
    same_feats,
    "same selected",
    np.array_equal(g.selected_features, z["selected_features"]),
    "same logits",
    np.array_equal(g.logit_tokens, z["logit_tokens"]),
  )
  if A.shape == B.shape:
    scale = np.abs(B).max()
    print(
      "  max |A - A_ct| / max|A_ct|",
      float(np.abs(A - B).max() / scale),
      " max rel (entries > 1e-3 max):",
      float((np.abs(A - B) / np.maximum(np.abs(B), 1e-3 * scale)).max()),
    )
    print(
      "  activations max rel",
      float(
        np.abs(g.activation_values - z["activation_values"]).max()
        / np.abs(z["activation_values"]).max()
      ),
    )
    r = circuits.prune(g)
    print(
      "  node masks equal",
      np.array_equal(r.node_mask, z["node_mask"]),
      "edge masks equal",
      np.array_equal(r.edge_mask, z["edge_mask"]),
      "edge mask diffs",
      int((r.edge_mask != z["edge_mask"]).sum()),
    )
    s = circuits.graph_scores(g)
    print(
      "  scores", s, "circuit-tracer", z["scores"], "diff", np.abs(np.array(s) - z["scores"]).max()
    )

  # Interventions: the same features set to 0 and to 3x their activation, under each setting.
  settings = {
    "all": dict(constrained_layers=range(L)),
    "late": dict(constrained_layers=range(1, L)),
    "frozen_attn": dict(),
    "live_attn": dict(freeze_attention=False),
  }
  for factor in (0.0, 3.0):
    feats, vals = z[f"iv/{factor}/features"], z[f"iv/{factor}/values"]
    ivs = [(int(a), int(b), int(c), float(x)) for (a, b, c), x in zip(feats, vals)]
    for name, kw in settings.items():
      got = circuits.feature_intervention(
        m, v, tokens, tcs, ivs, zero_bos=True, apply_activation_function=False, **kw
      )
      ref_l, ref_a = z[f"iv/{factor}/{name}/logits"], z[f"iv/{factor}/{name}/acts"]
      base = z["iv/base/logits"] if "iv/base/logits" in z.files else None
      effect = np.abs(ref_l - base).max() if base is not None else float("nan")
      print(
        f"  intervention x{factor} {name}: max |logits - ct| {np.abs(got.logits - ref_l).max():.2e}"
        f" (logits up to {np.abs(ref_l).max():.2f}, change up to {effect:.2f}),"
        f" pre-activations {np.abs(got.activations - ref_a).max():.2e}"
      )
  if "gen/logits" in z.files:
    feats, vals = z["iv/3.0/features"], z["iv/3.0/values"]
    ivs = [(int(a), slice(int(b), None), int(c), float(x)) for (a, b, c), x in zip(feats, vals)]
    gen = circuits.feature_intervention_generate(
      m, v, tokens, tcs, ivs, len(z["gen/tokens"]), zero_bos=True
    )
    print(
      "  generation: same tokens",
      np.array_equal(np.asarray(gen.tokens[0]), z["gen/tokens"]),
      f"max |logits - ct| {np.abs(np.asarray(gen.logits[0]) - z['gen/logits']).max():.2e}",
    )
