"""The door x verb coverage of the scan and NNX tests, proved from their parameters.

The linen matrix (tests/test_matrix.py) runs the full door x verb x keep_grad product.
The scanned-stack and NNX tests run a covering design: every verb on every door those
model kinds have, without the keep_grad column for scans (keep_grad at a scanned layer
is tested on its own). This test fails if a verb or a door drops out of either.
"""

import test_nnx
import test_scan

from jaxlens import contract as matrix

VERBS = {r.name for r in matrix.ROWS}


def test_scan_runs_every_verb_on_every_door():
  doors = set(test_scan.DOORS)
  assert {"live_bind", "live_trace", "replay", "rerun", "differentiable_replay"} <= doors
  assert any(d.startswith("units:") for d in doors)
  rows = [r.name for chunk in test_scan.CHUNKS for r in chunk]
  assert len(rows) == len(set(rows))
  covered = {(d, name) for d in doors for name in rows}
  assert covered == {(d, v) for d in doors for v in VERBS}


def test_nnx_runs_every_verb_on_every_door():
  doors = set(test_nnx.NNX_DOORS)
  assert {"live_bind", "live_trace", "replay", "rerun"} <= doors
  rows = test_nnx.test_nnx_matrix_rows_match_linen.pytestmark
  params = {m.args[0]: m.args[1] for m in rows if m.name == "parametrize"}
  verbs = {r.name for r in params["row"]}
  # set_affine_coordinates only runs under jl.subspace, which the NNX doors reach through
  # the same edit wrapper as linen.
  assert verbs == VERBS - matrix.SUBSPACE_ONLY
  assert set(params["door"]) == doors
