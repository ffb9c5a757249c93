"""Every refusal of the torch reference and of its spec loader: typed, with a code."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import jaxlens as jl
from torch_bridge import _matrix, _portable
from torch_bridge import reference as ref

X = torch.linspace(-1, 1, 12, dtype=torch.float64).reshape(3, 4)
SQUARE = torch.ones(4, 4, dtype=torch.float64)
BASIS = np.asarray([[1.0, 0.0], [0.0, 1.0], [0.0, 0.0], [0.0, 0.0]])


def _ambiguous_units():
  mask = np.zeros((3, 4), bool)
  mask[0, 1] = True
  return ref.Selection(None, "units", {"indices": mask}).wrap(ref.permute_batch(seed=0))(X)


CASES = {
  "clamp without bounds": (lambda: ref.clamp(), "invalid_argument"),
  "empty compose": (lambda: ref.compose(), "invalid_argument"),
  "hook of a number": (lambda: ref.hook(3), "invalid_argument"),
  "splice of a number": (lambda: ref.splice_module(3), "invalid_argument"),
  "not an edit": (lambda: ref.as_edit(object()), "invalid_edit"),
  "unseeded draw": (lambda: ref.add_noise(0.1)(X), "seed_required"),
  "direction too short": (lambda: ref.steer(np.ones(5))(X), "shape_mismatch"),
  "direction not 1-D": (lambda: ref.steer(np.ones((2, 2)))(X), "shape_mismatch"),
  "wrong feature axis": (lambda: ref.steer(np.ones(4), feature_axis=0)(X), "shape_mismatch"),
  "ambiguous axis": (lambda: ref.project_out(np.ones(4))(SQUARE), "feature_axis_ambiguous"),
  "delta shape": (lambda: ref.add(np.ones(5))(X), "shape_mismatch"),
  "donor dtype": (lambda: ref.replace_with(X.float())(X), "dtype_mismatch"),
  "donor shape": (
    lambda: ref.swap_with(torch.ones(2, 4, dtype=torch.float64))(X),
    "shape_mismatch",
  ),
  "hook shape": (lambda: ref.hook(lambda y: y[0])(X), "hook_shape_mismatch"),
  "hook non-tensor": (lambda: ref.hook(lambda y: 1.0)(X), "hook_shape_mismatch"),
  "hook dtype": (lambda: ref.hook(lambda y: y.float())(X), "hook_dtype_mismatch"),
  "site not a tensor": (lambda: ref.scale(2.0)((X,)), "site_not_array"),
  "integer site": (
    lambda: ref.keep_grad(ref.scale(2))(torch.ones(3, dtype=torch.long)),
    "site_not_float",
  ),
  "empty population": (lambda: ref.population(), "invalid_source"),
  "population of a trace": (
    lambda: ref.population(ref.trace(torch.nn.Identity(), X)),
    "invalid_source",
  ),
  "source type": (lambda: ref.patch_from("donor")(X), "invalid_source"),
  "scramble source size": (
    lambda: ref.scramble_elements(seed=0, source=torch.ones(5))(X),
    "shape_mismatch",
  ),
  "resample source rows": (
    lambda: ref.resample_rows_from(torch.ones(6, 3), seed=0)(X),
    "shape_mismatch",
  ),
  "direction mean source": (
    lambda: ref.set_direction_mean(np.ones(4), torch.ones(6, 3))(X),
    "shape_mismatch",
  ),
  "mean source shape": (
    lambda: ref.mean_ablate(source=torch.ones(6, 3, dtype=torch.float64))(X),
    "shape_mismatch",
  ),
  "position range": (lambda: ref.at_positions([9], ref.scale(2.0))(X), "index_out_of_range"),
  "position dtype": (lambda: ref.at_positions([0.5], ref.scale(2.0))(X), "dtype_mismatch"),
  "position axis": (lambda: ref.at_positions([0], ref.scale(2.0), axis=5)(X), "shape_mismatch"),
  "empty units": (
    lambda: ref.Selection(None, "units", {"indices": np.zeros((3, 4), bool)}).wrap(ref.scale(2.0))(
      X
    ),
    "empty_selection",
  ),
  "unit range": (
    lambda: ref.Selection(None, "units", {"indices": [7]}).wrap(ref.scale(2.0))(X),
    "index_out_of_range",
  ),
  "element range": (
    lambda: ref.Selection(None, "units", {"indices": [[5, 0]]}).wrap(ref.scale(2.0))(X),
    "index_out_of_range",
  ),
  "unit index shape": (
    lambda: ref.Selection(None, "units", {"indices": [[1, 2, 3]]}).wrap(ref.scale(2.0))(X),
    "shape_mismatch",
  ),
  "unit dtype": (
    lambda: ref.Selection(None, "units", {"indices": [0.5]}).wrap(ref.scale(2.0))(X),
    "dtype_mismatch",
  ),
  "mask shape": (
    lambda: ref.Selection(None, "units", {"indices": np.ones(5, bool)}).wrap(ref.scale(2.0))(X),
    "shape_mismatch",
  ),
  "row-moving verb": (_ambiguous_units, "mask_not_row_equivariant"),
  "basis shape": (lambda: ref.subspace_scale(np.ones((3, 2)), 0.5)(X), "shape_mismatch"),
  "empty basis": (lambda: ref.subspace_scale(np.ones((4, 0)), 0.5)(X), "empty_selection"),
  "dependent basis": (lambda: ref.subspace_scale(np.ones((4, 2)), 0.5)(X), "basis_rank_deficient"),
  "projection in subspace": (
    lambda: ref.Selection(None, "subspace", {"basis": BASIS, "origin": None}).wrap(
      ref.project_onto(np.ones(4))
    )(X),
    "subspace_edit_unsupported",
  ),
  "affine outside subspace": (
    lambda: ref.set_affine_coordinates(np.ones((2, 4)), np.ones(2))(X),
    "affine_source_needs_subspace",
  ),
  "site not a name": (lambda: ref.when(0, ref.scale(2.0)), "invalid_site"),
  "unsaved site": (lambda: ref.trace(torch.nn.Identity(), X)["0"], "unknown_site"),
  "donor site missing": (
    lambda: ref.patch_from(ref.trace(torch.nn.Identity(), X))(X),
    "donor_site_missing",
  ),
}


@pytest.mark.parametrize("name", list(CASES))
def test_refusal(name):
  call, code = CASES[name]
  with pytest.raises(jl.InvalidArgumentError, match=rf"\[{code}\]") as info:
    call()
  assert info.value.fields["code"] == code and "fix" in info.value.fields


def test_a_module_that_did_not_run():
  net = torch.nn.ModuleDict({"used": torch.nn.Identity(), "unused": torch.nn.Identity()})
  net.forward = lambda x: net["used"](x)
  with pytest.raises(jl.SiteError, match=r"\[unknown_site\].*did not run"):
    ref.when("unused", ref.scale(2.0)).bind(net)(X)


def test_the_spec_loader_refuses_unknown_verbs_and_values():
  conv = _portable._Converter({"0": "layers_0"})
  with pytest.raises(_portable.TorchSpecError, match=r"\[verb_not_in_reference\].*'nope'"):
    conv.edit(jl.intervention.Edit("nope", {}), "rule 0")
  with pytest.raises(_portable.TorchSpecError, match=r"\[verb_not_in_reference\].*object"):
    conv.value(object(), "rule 0")


def test_a_page_without_the_matrix_markers(tmp_path):
  page = tmp_path / "page.md"
  page.write_text("no markers\n")
  with pytest.raises(jl.InvalidArgumentError, match=r"\[no_matrix_block\]"):
    _matrix.committed_block(page)
