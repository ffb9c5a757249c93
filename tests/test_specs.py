"""Saved specs: portable round trip, atomic writes, refusal of damaged files, checks."""

import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxlens as jl
from jaxlens import contract as matrix
from jaxlens import intervention as ji

SITE = jl.module("layers_0")


@pytest.fixture
def case(spec_model):
  model, variables, x, x_donor, _ = spec_model
  return matrix.make_case(model, variables, x, x_donor)


@pytest.mark.parametrize(
  "row",
  [r for r in matrix.ROWS if r.name not in ("hook callable", "splice_module")],
  ids=lambda r: r.name,
)
def test_every_portable_verb_round_trips(spec_model, case, row, tmp_path):
  model, variables, x, _, _ = spec_model
  site = jl.subspace(SITE, case.basis) if row.name in matrix.SUBSPACE_ONLY else SITE
  spec = jl.when(site, row.build(case)) + jl.when(
    jl.module("layers_1"), ji.keep_grad(jl.scale(2.0))
  )
  loaded = jl.load_spec(spec.save(tmp_path / "spec"))
  # A donor trace is saved as the values the rule reads (the site it edits).
  donors = lambda s: re.sub(r"<donor: [^>]*>", "<donor>", repr(s))
  assert donors(loaded) == donors(spec)
  # both runs in one jitted program (not eager ops)
  runs = jax.jit(lambda v, x_: (loaded.bind(model)(v, x_), spec.bind(model)(v, x_)))
  got, want = runs(variables, x)
  assert np.array_equal(got, want)
  assert loaded.rules[1][1].keep_grad


def test_selectors_round_trip(tmp_path):
  sel = (jl.module("a/b", call=2) | jl.label("tanh_1")) & (jl.func("dot_*") | jl.in_module("c"))
  loaded = jl.load_spec(jl.when(sel, jl.scale(1.0)).save(tmp_path / "s"))
  assert loaded.rules[0][0] == sel


@pytest.mark.parametrize(
  "edit",
  [lambda y: y, jl.splice_module(jnp.tanh), ji.compose(jl.scale(2.0), lambda y: y)],
  ids=["hook", "splice", "compose-with-hook"],
)
def test_opaque_callables_are_refused(edit, tmp_path):
  with pytest.raises(jl.SpecFormatError, match=r"\[spec_not_portable\]") as info:
    jl.when(SITE, edit).save(tmp_path / "s")
  assert "rule 0" in info.value.fields["site"]
  assert not (tmp_path / "s").exists()
  assert list(tmp_path.iterdir()) == []  # no temporary directory left behind


def _saved(tmp_path, case):
  spec = jl.when(SITE, jl.patch_from(case.donor_trace)) + jl.when(SITE, jl.steer(case.direction))
  return spec, spec.save(tmp_path / "spec")


def test_truncated_arrays_are_refused(tmp_path, case):
  _, path = _saved(tmp_path, case)
  data = (path / "arrays.npz").read_bytes()
  (path / "arrays.npz").write_bytes(data[: len(data) // 2])
  with pytest.raises(jl.SpecFormatError, match=r"\[spec_corrupt\]"):
    jl.load_spec(path)


def test_altered_arrays_are_refused(tmp_path, case):
  _, path = _saved(tmp_path, case)
  with np.load(path / "arrays.npz") as npz:
    arrays = {k: npz[k].copy() for k in npz.files}
  first = sorted(arrays)[0]
  arrays[first].flat[0] += 1.0
  np.savez(path / "arrays.npz", **arrays)
  with pytest.raises(jl.SpecFormatError, match=r"\[spec_corrupt\].*hash mismatch"):
    jl.load_spec(path)


@pytest.mark.parametrize("damage", ["edit_value", "truncate", "not_json"])
def test_altered_structure_is_refused(tmp_path, case, damage):
  _, path = _saved(tmp_path, case)
  text = (path / "spec.json").read_text()
  if damage == "edit_value":
    doc = json.loads(text)
    doc["rules"][1]["edit"]["verb"] = "zero_ablate"
    text = json.dumps(doc)
  elif damage == "truncate":
    text = text[: len(text) // 2]
  else:
    text = "garbage"
  (path / "spec.json").write_text(text)
  with pytest.raises(jl.SpecFormatError, match=r"\[spec_corrupt\]"):
    jl.load_spec(path)


def test_missing_spec(tmp_path):
  with pytest.raises(jl.SpecFormatError, match=r"\[spec_not_found\]"):
    jl.load_spec(tmp_path / "nothing")


def test_a_failed_save_loses_nothing(tmp_path, case, spec_model):
  model, variables, x, _, _ = spec_model
  spec, path = _saved(tmp_path, case)
  files = lambda: (
    {n: (path / n).read_bytes() for n in ("spec.json", "arrays.npz")},
    sorted(p.name for p in path.iterdir()),
  )
  before = files()
  with pytest.raises(jl.SpecFormatError, match="spec_not_portable"):
    jl.when(SITE, lambda y: y).save(path)
  assert files() == before
  # Saving over a saved spec replaces it atomically.
  jl.when(SITE, jl.scale(3.0)).save(path)
  assert repr(jl.load_spec(path)) == repr(jl.when(SITE, jl.scale(3.0)))
  assert sorted(p.name for p in tmp_path.iterdir()) == ["spec"]
  # One version on disk, no temporary files.
  assert len([p for p in path.iterdir() if p.name.startswith("v-")]) == 1
  assert not [p for p in path.iterdir() if "tmp" in p.name]


def test_refuses_to_replace_a_directory_that_is_not_a_spec(tmp_path):
  user = tmp_path / "results"
  user.mkdir()
  (user / "important.txt").write_text("keep me")
  with pytest.raises(jl.SpecFormatError, match=r"\[spec_target_exists\]"):
    jl.when(SITE, jl.scale(2.0)).save(user)
  assert (user / "important.txt").read_text() == "keep me"


def test_check_reports_missing_and_mismatched_sites(spec_model, tmp_path):
  model, variables, x, _, _ = spec_model
  spec = (
    jl.when(SITE, jl.scale(2.0))
    + jl.when(jl.module("layers_7"), jl.scale(2.0))
    + jl.when(jl.module("layers_1"), jl.replace_with(jnp.ones((3, 5))))
  )
  loaded = jl.load_spec(spec.save(tmp_path / "s"))
  report = loaded.check(model, variables, x)
  assert not report.ok
  assert [m[0] for m in report.missing] == [1]
  assert [m[0] for m in report.mismatched] == [2]
  assert "shape (3, 5)" in report.mismatched[0][2]
  assert jl.check_spec(jl.when(SITE, jl.scale(2.0)), model, variables, x).ok


def test_traced_values_cannot_be_saved(tmp_path):
  import jax

  def f(d):
    jl.when(SITE, jl.steer(d)).save(tmp_path / "s")
    return d

  with pytest.raises(jl.SpecFormatError, match="traced values"):
    jax.jit(f)(jnp.ones(4))


@pytest.mark.parametrize(
  "edit",
  [jl.grad_scale(2.0), jl.grad_zero(), jl.grad_clip(0.5)],
  ids=["grad_scale", "grad_zero", "grad_clip"],
)
def test_backward_verbs_round_trip(spec_model, edit, tmp_path):
  import jax

  model, variables, x, _, _ = spec_model
  spec = jl.when(SITE, edit)
  loaded = jl.load_spec(spec.save(tmp_path / "s"))
  grad = lambda s: jax.grad(lambda v: s.bind(model)(v, x).sum())(variables)
  for a, b in zip(jax.tree.leaves(grad(loaded)), jax.tree.leaves(grad(spec))):
    assert np.array_equal(a, b)
