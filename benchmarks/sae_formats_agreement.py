"""Dictionary formats against the libraries that write them: jaxlens.sae reads files written by
EleutherAI sparsify 1.3.3 and dictionary_learning 0.1.0 themselves, and reads the Llama Scope,
Gemma Scope 2 and connor-rob hook_z layouts as SAELens 6.54.12's pretrained loaders do; for
each, the feature activations and the reconstruction of random inputs are compared (largest
difference over the largest value); what jaxlens writes (sparsify directories, Gemma Scope 2
folders, Llama Scope directories) is read back by sparsify and by SAELens's loaders.

Neither library is a jaxlens requirement, and dictionary-learning would replace the pinned torch;
both are installed beside the virtualenv without their dependencies (sparsify's natsort and
schedulefree come along; dictionary_learning's package imports nnsight for its activation buffer,
which this script does not use, so a stand-in module is put in its place)::

  pip install --no-deps --target /tmp/h4/sp eai-sparsify==1.3.3 natsort schedulefree
  pip install --no-deps --target /tmp/h4/dl dictionary-learning==0.1.0
  PYTHONPATH=/tmp/h4/sp:/tmp/h4/dl python benchmarks/sae_formats_agreement.py

Gemma Scope 2's cross-layer transcoders are checked against circuit-tracer 0.5.0's loader
through benchmarks/sae_formats_agreement_ct.py, run first in circuit-tracer's environment.

Prints one line per case and exits non-zero if any differs by more than 1e-5 (float32).
"""

from __future__ import annotations

import json
import sys
import tempfile
import types
from pathlib import Path
from unittest import mock

import numpy as np
import torch
from safetensors.torch import save_file

from jaxlens import sae as jsae

TOL = 1e-5
FAILED = []
torch.manual_seed(0)


def rel(a, b) -> float:
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


def report(name, acts_ours, acts_theirs, out_ours, out_theirs):
  ra, ro = rel(acts_ours, acts_theirs), rel(out_ours, out_theirs)
  active = int((np.asarray(acts_theirs) != 0).sum())
  same = bool(((np.asarray(acts_ours) != 0) == (np.asarray(acts_theirs) != 0)).all())
  ok = ra <= TOL and ro <= TOL and same and active > 0
  if not ok:
    FAILED.append(name)
  print(
    f"{'ok  ' if ok else 'FAIL'} {name:58s} acts {ra:.1e}  out {ro:.1e}  "
    f"active {active} same support {same}"
  )


def randomise(module, scale=0.3):
  with torch.no_grad():
    for p in module.parameters():
      p.copy_(torch.randn(p.shape) * scale)


# -- sparsify -------------------------------------------------------------------------------


def sparsify_cases(tmp: Path):
  from sparsify import SparseCoder, SparseCoderConfig

  d_in, n, k = 16, 64, 6
  x = torch.randn(40, d_in)
  for transcode in (False, True):
    for skip in (False, True):
      name = f"sparsify {'transcoder' if transcode else 'autoencoder'}{' skip' if skip else ''}"
      cfg = SparseCoderConfig(num_latents=n, k=k, transcode=transcode, skip_connection=skip)
      coder = SparseCoder(d_in, cfg)
      randomise(coder)
      where = tmp / f"sparsify_{transcode}_{skip}" / "layers.3"
      coder.save_to_disk(where)
      ours = jsae.load_sparsify(where)
      with torch.no_grad():
        enc = coder.encode(x)
        acts = torch.zeros(x.shape[0], n).scatter_(-1, enc.top_indices, enc.top_acts)
        out = coder(x).sae_out
      report(name + " (read)", ours.encode(x.numpy()), acts, ours(x.numpy()), out)
      meta = json.loads(ours.metadata_json)
      assert meta["site"] == ("blocks_3/resid_pre" if transcode else "blocks_3/resid_post"), meta
      # jaxlens writes it, sparsify reads it.
      back_dir = tmp / f"sparsify_back_{transcode}_{skip}"
      jsae.save_sparsify(ours, back_dir)
      back = SparseCoder.load_from_disk(back_dir)
      with torch.no_grad():
        enc = back.encode(x)
        acts_b = torch.zeros(x.shape[0], n).scatter_(-1, enc.top_indices, enc.top_acts)
        out_b = back(x).sae_out
      report(
        name + " (written, read by sparsify)",
        ours.encode(x.numpy()),
        acts_b,
        ours(x.numpy()),
        out_b,
      )
  # groupmax is refused, naming the field.
  coder = SparseCoder(d_in, SparseCoderConfig(num_latents=n, k=4, activation="groupmax"))
  coder.save_to_disk(tmp / "groupmax")
  try:
    jsae.load_sparsify(tmp / "groupmax")
    FAILED.append("sparsify groupmax refused")
  except jsae.SAEError as error:
    print(f"ok   sparsify groupmax refused: {error.fields['code']} field={error.fields['field']}")
  # SAELens 6.54.12's own sparsify reader on a sparsify 1.3.3 directory (for the record).
  from sae_lens import SAE
  from sae_lens.loading.pretrained_sae_loaders import sparsify_disk_loader

  where = tmp / "sparsify_False_False" / "layers.3"
  cfg_dict, state = sparsify_disk_loader(where)
  print(
    "note SAELens's sparsify_disk_loader on sparsify 1.3.3's directory: W_dec "
    f"{tuple(state['W_dec'].shape)} (SAELens's is (d_sae, d_in) = ({n}, {d_in})), "
    f"apply_b_dec_to_input={cfg_dict['apply_b_dec_to_input']} (sparsify subtracts b_dec)"
  )
  try:
    SAE.load_from_disk(where, converter=sparsify_disk_loader)
    print("note SAE.load_from_disk(converter=sparsify_disk_loader) reads it")
  except RuntimeError as error:
    print(f"note SAE.load_from_disk(converter=sparsify_disk_loader) fails: {str(error)[:160]!r}")


# -- dictionary_learning ---------------------------------------------------------------------


def dictionary_learning_cases(tmp: Path):
  if "nnsight" not in sys.modules:
    try:
      import nnsight  # noqa: F401
    except ImportError:  # only dictionary_learning.buffer imports it
      sys.modules["nnsight"] = types.SimpleNamespace(LanguageModel=object)
  from dictionary_learning.dictionary import (
    AutoEncoder,
    AutoEncoderNew,
    GatedAutoEncoder,
    JumpReluAutoEncoder,
  )
  from dictionary_learning.trainers.batch_top_k import BatchTopKSAE
  from dictionary_learning.trainers.matryoshka_batch_top_k import MatryoshkaBatchTopKSAE
  from dictionary_learning.trainers.top_k import AutoEncoderTopK

  d, f, k = 16, 64, 6
  x = torch.randn(40, d)
  makers = {
    "AutoEncoder": lambda: AutoEncoder(d, f),
    "AutoEncoderNew": lambda: AutoEncoderNew(d, f),
    "GatedAutoEncoder": lambda: GatedAutoEncoder(d, f),
    "JumpReluAutoEncoder": lambda: JumpReluAutoEncoder(d, f),
    "AutoEncoderTopK": lambda: AutoEncoderTopK(d, f, k),
    "BatchTopKSAE": lambda: BatchTopKSAE(d, f, k),
    "MatryoshkaBatchTopKSAE": lambda: MatryoshkaBatchTopKSAE(d, f, k, [16, 16, 32]),
  }
  for name, make in makers.items():
    ae = make()
    randomise(ae)
    if hasattr(ae, "threshold"):
      with torch.no_grad():
        if ae.threshold.ndim == 0:
          ae.threshold.fill_(0.4)  # a trained BatchTopK threshold
        else:
          ae.threshold.copy_(torch.rand(f) * 0.5)
    where = tmp / f"dl_{name}" / "trainer_0"
    where.mkdir(parents=True)
    # As training.py's trainSAE saves: config.json ({"trainer": trainer.config}) and ae.pt.
    (where / "config.json").write_text(
      json.dumps(
        {"trainer": {"dict_class": name, "layer": 3, "submodule_name": "resid_post_layer_3"}}
      )
    )
    torch.save({key: v.cpu() for key, v in ae.state_dict().items()}, where / "ae.pt")
    cls = type(ae)
    # the library's own loader reads the file back (AutoEncoder's normalises its decoder)
    if name in ("AutoEncoderNew", "GatedAutoEncoder"):
      ref = cls.from_pretrained(str(where / "ae.pt"))
    else:
      ref = cls.from_pretrained(str(where / "ae.pt"))
    ours = jsae.load_dictionary_learning(where)
    with torch.no_grad():
      acts, out = ref.encode(x), ref(x)
    report(f"dictionary_learning {name}", ours.encode(x.numpy()), acts, ours(x.numpy()), out)
  # trainSAE itself: a few steps of real training, normalize_activations=True (trainSAE scales
  # the biases and thresholds back to the raw activations' units before it saves), a save step
  if "wandb" not in sys.modules:
    try:
      import wandb  # noqa: F401
    except ImportError:  # training.py imports it at the top; use_wandb=False never calls it
      sys.modules["wandb"] = types.SimpleNamespace()
  import itertools

  from dictionary_learning.trainers.batch_top_k import BatchTopKTrainer
  from dictionary_learning.trainers.jumprelu import JumpReluTrainer
  from dictionary_learning.trainers.top_k import TopKTrainer
  from dictionary_learning.training import trainSAE

  def batches():
    g = torch.Generator().manual_seed(1)
    for _ in itertools.count():
      yield torch.randn(64, d, generator=g) * 3.0 + 1.0

  common = dict(steps=40, activation_dim=d, dict_size=f, layer=3, lm_name="tiny", device="cpu")
  configs = [
    dict(trainer=TopKTrainer, k=k, warmup_steps=5, threshold_start_step=5, **common),
    dict(trainer=BatchTopKTrainer, k=k, warmup_steps=5, threshold_start_step=5, **common),
    dict(trainer=JumpReluTrainer, warmup_steps=5, sparsity_warmup_steps=5, **common),
  ]
  trainSAE(
    batches(),
    configs,
    steps=40,
    save_dir=str(tmp / "trained"),
    save_steps=[20],
    normalize_activations=True,
    device="cpu",
  )
  for i, cls in enumerate((AutoEncoderTopK, BatchTopKSAE, JumpReluAutoEncoder)):
    for where in (
      tmp / "trained" / f"trainer_{i}",
      tmp / "trained" / f"trainer_{i}" / "checkpoints" / "ae_20.pt",
    ):
      file = where / "ae.pt" if where.is_dir() else where
      ref = cls.from_pretrained(str(file))
      ours = jsae.load_dictionary_learning(where)
      with torch.no_grad():
        acts, out = ref.encode(x * 3.0 + 1.0), ref(x * 3.0 + 1.0)
      report(
        f"dictionary_learning trainSAE {cls.__name__} {file.name}",
        ours.encode(x.numpy() * 3.0 + 1.0),
        acts,
        ours(x.numpy() * 3.0 + 1.0),
        out,
      )
  # a checkpoint without config.json whose class its tensors do not tell is refused
  ae = AutoEncoderTopK(d, f, k)
  (tmp / "bare").mkdir()
  torch.save(ae.state_dict(), tmp / "bare" / "ae_100.pt")
  try:
    jsae.load_dictionary_learning(tmp / "bare" / "ae_100.pt")
    FAILED.append("dictionary_learning ambiguous refused")
  except jsae.SAEError as error:
    print(
      f"ok   dictionary_learning TopK/BatchTopK without config refused: field={error.fields['field']}"
    )


# -- SAELens's pretrained loaders ---------------------------------------------------------------


def _saelens_sae(loader, repo, folder, files, fold=None, shapes=None):
  """What ``SAE.from_pretrained`` builds from a loader's output, with the hub served from
  ``files`` (a folder standing in for the repository)."""
  from sae_lens import SAE
  from sae_lens.loading import pretrained_sae_loaders as loaders
  from sae_lens.loading.pretrained_sae_loaders import handle_config_defaulting

  def download(repo_id, filename=None, subfolder=None, **_):
    path = files / (f"{subfolder}/{filename}" if subfolder else filename)
    return str(path)

  patches = [mock.patch.object(loaders, "hf_hub_download", download)]
  if shapes is not None:
    patches.append(mock.patch.object(loaders, "get_safetensors_tensor_shapes", shapes))
  for p in patches:
    p.start()
  try:
    cfg_dict, state, _ = loader(repo, folder, device="cpu", cfg_overrides={"dtype": "float32"})
  finally:
    for p in patches:
      p.stop()
  cfg_dict = handle_config_defaulting(cfg_dict)
  sae_cfg = SAE.get_sae_config_class_for_architecture(cfg_dict["architecture"]).from_dict(cfg_dict)
  model = SAE.get_sae_class_for_architecture(sae_cfg.architecture())(sae_cfg)
  model.process_state_dict_for_loading(state)
  model.load_state_dict(state)
  if fold is not None:
    model.fold_activation_norm_scaling_factor(fold)
  return model.eval()


def llama_scope_case(tmp: Path):
  from sae_lens.loading.pretrained_sae_loaders import llama_scope_sae_huggingface_loader

  d, f = 32, 128
  folder = "Llama3_1-8B-Base-L5R-8x"
  root = tmp / "llama" / folder
  (root / "checkpoints").mkdir(parents=True)
  norm_in = 7.5
  hyper = {
    "d_model": d,
    "d_sae": f,
    "expansion_factor": f // d,
    "act_fn": "jumprelu",
    "jump_relu_threshold": 0.35,
    "dataset_average_activation_norm": {"in": norm_in, "out": norm_in},
    "hook_point_in": "blocks.5.hook_resid_post",
    "hook_point_out": "blocks.5.hook_resid_post",
    "apply_decoder_bias_to_pre_encoder": False,
  }
  (root / "hyperparams.json").write_text(json.dumps(hyper))
  save_file(
    {
      "encoder.weight": torch.randn(f, d) * 0.3,
      "encoder.bias": torch.randn(f) * 0.3,
      "decoder.weight": torch.randn(d, f) * 0.3,
      "decoder.bias": torch.randn(d) * 0.3,
    },
    str(root / "checkpoints" / "final.safetensors"),
  )
  # The release's norm_scaling_factor (pretrained_saes.yaml) is sqrt(d_model) / norm_in: for
  # Llama3_1-8B-Base-L0R-8x, 58.935251798561154 = 64 / 1.0859375.
  ref = _saelens_sae(
    llama_scope_sae_huggingface_loader, "fnlp/x", folder, tmp / "llama", fold=d**0.5 / norm_in
  )
  ours = jsae.load_llama_scope(root)
  x = torch.randn(40, d) * norm_in / d**0.5 * 3
  with torch.no_grad():
    acts, out = ref.encode(x), ref(x)
  report(
    "Llama Scope (SAELens's loader + norm folding)",
    ours.encode(x.numpy()),
    acts,
    ours(x.numpy()),
    out,
  )
  # jaxlens writes it back (the norm written as sqrt(d_model): the folded factor is 1)
  jsae.save_llama_scope(ours, tmp / "llama_back" / folder)
  back = _saelens_sae(
    llama_scope_sae_huggingface_loader, "fnlp/x", folder, tmp / "llama_back", fold=1.0
  )
  with torch.no_grad():
    acts, out = back.encode(x), back(x)
  report(
    "Llama Scope (written, read by SAELens's loader)",
    ours.encode(x.numpy()),
    acts,
    ours(x.numpy()),
    out,
  )


def gemma_scope_2_cases(tmp: Path):
  from sae_lens.loading.pretrained_sae_loaders import gemma_3_sae_huggingface_loader

  d, f, d_head, heads = 16, 64, 4, 4
  repo = tmp / "gs2"
  cases = [
    ("resid_post/layer_3_width_16k_l0_small", d, d, False),
    ("attn_out/layer_3_width_16k_l0_small", heads * d_head, d, False),
    ("mlp_out/layer_3_width_16k_l0_small", d, d, False),
    ("transcoder/layer_3_width_16k_l0_small", d, d, False),
    ("transcoder/layer_3_width_16k_l0_small_affine", d, d, True),
  ]
  for folder, d_in, d_out, affine in cases:
    if "attn_out" in folder:
      d_out = d_in
    root = repo / folder
    root.mkdir(parents=True)
    tensors = {
      "w_enc": torch.randn(d_in, f) * 0.3,
      "w_dec": torch.randn(f, d_out) * 0.3,
      "b_enc": torch.randn(f) * 0.3,
      "b_dec": torch.randn(d_out) * 0.3,
      "threshold": torch.rand(f) * 0.3,
    }
    if affine:
      tensors["affine_skip_connection"] = torch.randn(d_in, d_out) * 0.3
    save_file(tensors, str(root / "params.safetensors"))
    raw = {"architecture": "jump_relu", "model_name": "gemma-v3-270m-pt"}
    if "transcoder" in folder:
      raw["affine_connection"] = affine
    (root / "config.json").write_text(json.dumps(raw))

    def shapes(repo_id, filename, root=root):
      from safetensors import safe_open

      with safe_open(str(root / "params.safetensors"), "pt") as fh:
        return {key: list(fh.get_slice(key).get_shape()) for key in fh.keys()}

    ref = _saelens_sae(
      gemma_3_sae_huggingface_loader, "google/gemma-scope-2-270m-pt", folder, repo, shapes=shapes
    )
    ours = jsae.load_gemma_scope(root)
    meta = json.loads(ours.metadata_json)
    x = torch.randn(40, d_in)
    with torch.no_grad():
      acts, out = ref.encode(x), ref(x)
    report(
      f"Gemma Scope 2 {folder.split('/')[0]}{' affine' if affine else ''} -> {meta['site']}",
      ours.encode(x.numpy()),
      acts,
      ours(x.numpy()),
      out,
    )
    # jaxlens writes the folder back; SAELens's loader reads it
    back_root = tmp / "gs2_back" / folder
    jsae.save_gemma_scope(ours, back_root)
    back = _saelens_sae(
      gemma_3_sae_huggingface_loader,
      "google/gemma-scope-2-270m-pt",
      folder,
      tmp / "gs2_back",
      shapes=lambda repo_id, filename, root=back_root: shapes(repo_id, filename, root),
    )
    with torch.no_grad():
      acts, out = back.encode(x), back(x)
    kind = f"{folder.split('/')[0]}{' affine' if affine else ''}"
    report(
      f"Gemma Scope 2 {kind} (written, read by SAELens)",
      ours.encode(x.numpy()),
      acts,
      ours(x.numpy()),
      out,
    )
  # a config.json with another architecture is refused, naming the field
  (repo / "resid_post/layer_3_width_16k_l0_small/config.json").write_text(
    json.dumps({"architecture": "topk"})
  )
  try:
    jsae.load_gemma_scope(repo / "resid_post/layer_3_width_16k_l0_small")
    FAILED.append("Gemma Scope 2 architecture refused")
  except jsae.SAEError as error:
    print(f"ok   Gemma Scope 2 architecture 'topk' refused: field={error.fields['field']}")


def hook_z_case(tmp: Path):
  from sae_lens.loading.pretrained_sae_loaders import connor_rob_hook_z_huggingface_loader

  heads, d_head, f = 4, 8, 96
  d = heads * d_head
  name = "gpt2-small_L5_Hcat_z_lr1.20e-03_l11.00e+00_ds24576_bs4096_dc1.00e-06_rsanthropic_rie25000_nr4_v9.pt"
  root = tmp / "hookz"
  root.mkdir()
  torch.save(
    {
      "W_enc": torch.randn(d, f) * 0.3,
      "b_enc": torch.randn(f) * 0.3,
      "W_dec": torch.randn(f, d) * 0.3,
      "b_dec": torch.randn(d) * 0.3,
    },
    root / name,
  )
  (root / name.replace(".pt", "_cfg.json")).write_text(
    json.dumps({"act_size": d, "dict_size": f, "act_name": "blocks.5.attn.hook_z", "layer": 5})
  )
  ref = _saelens_sae(connor_rob_hook_z_huggingface_loader, "ckkissane/x", name, root)
  ours = jsae.load_hook_z(root / name)
  z = torch.randn(3, 7, heads, d_head)  # (batch, seq, heads, d_head), as blocks_5/attn/z
  with torch.no_grad():
    acts, out = ref.encode(z), ref(z)
  report(
    f"connor-rob hook_z at {json.loads(ours.metadata_json)['site']} (4-D z)",
    ours.encode(z.numpy()),
    acts,
    ours(z.numpy()),
    out,
  )


def gemma_scope_2_clt_case():
  """Against circuit-tracer's load_gemma_scope_2_clt, through sae_formats_agreement_ct.py."""
  exchange = Path("/tmp/ct_gs2/exchange.npz")
  if not exchange.is_file():
    print("skip Gemma Scope 2 CLT: run benchmarks/sae_formats_agreement_ct.py in venv-ct first")
    return
  data = np.load(exchange)
  ours = jsae.load_gemma_scope_clt(exchange.parent)
  report(
    f"Gemma Scope 2 CLT ({ours.n_layers} layers, circuit-tracer's loader)",
    ours.encode(data["x"]),
    data["acts"],
    ours(data["x"]),
    data["out"],
  )


def main():
  with tempfile.TemporaryDirectory() as tmp:
    tmp = Path(tmp)
    sparsify_cases(tmp)
    dictionary_learning_cases(tmp)
    llama_scope_case(tmp)
    gemma_scope_2_cases(tmp)
    hook_z_case(tmp)
  gemma_scope_2_clt_case()
  print("FAILED: " + ", ".join(FAILED) if FAILED else "all agree")
  return 1 if FAILED else 0


if __name__ == "__main__":
  sys.exit(main())
