"""A graph on disk (``attribute(..., graph_path=...)``): its file is the saved graph's, its
adjacency equals the in-memory graph's, and pruning and the scores worked in blocks of rows
equal the in-memory ones; an error mid-way leaves no file, and bad paths are typed errors."""

from __future__ import annotations

import numpy as np
import pytest
from test_circuits import CASES, TOKENS, _build

from jaxlens import circuits
from jaxlens.circuits import _attribute, _prune

# In test_circuits.py's worker: its graphs (_build) are made once for both files.
pytestmark = pytest.mark.xdist_group("circuits")


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request):
  return _build(request.param)


def _same_pruning(on_disk, in_memory):
  assert np.array_equal(on_disk.node_mask, in_memory.node_mask)
  assert np.array_equal(on_disk.edge_mask.toarray(), in_memory.edge_mask)
  np.testing.assert_allclose(on_disk.cumulative_scores, in_memory.cumulative_scores, rtol=1e-12)


def test_a_graph_on_disk_equals_the_graph_in_memory(case, tmp_path, monkeypatch):
  _, model, variables, tcs, graph, lr = case
  monkeypatch.setattr(_attribute, "_FLUSH_BYTES", 2**12)  # flushed mid-way too
  on_disk = circuits.attribute(
    model, variables, TOKENS, tcs, batch_size=32, local=lr, graph_path=tmp_path / "g"
  )
  assert isinstance(on_disk.adjacency, np.memmap) and not on_disk.adjacency.flags.writeable
  # the rows are the in-memory graph's, bit for bit (the same programs computed them)
  assert np.array_equal(on_disk.adjacency, graph.adjacency)
  for name in ("active_features", "activation_values", "selected_features", "logit_tokens"):
    assert np.array_equal(getattr(on_disk, name), getattr(graph, name))
  assert [p.name for p in tmp_path.iterdir()] == ["g"]  # no temporary left
  # the file is a saved graph: it loads whole, or mapped
  assert np.array_equal(circuits.load_graph(tmp_path / "g").adjacency, graph.adjacency)
  mapped = circuits.load_graph(tmp_path / "g", mmap=True)
  assert isinstance(mapped.adjacency, np.memmap)
  assert np.array_equal(mapped.adjacency, graph.adjacency)
  # Pruning and the scores in blocks of 2 and 16 rows (the kept nodes' rows read from the
  # file in blocks too), against the in-memory code; the influence in one backward pass.
  n = graph.adjacency.shape[0]
  for rows in (2, 16):
    monkeypatch.setattr(_prune, "_BLOCK_BYTES", rows * n * 8)
    for node_threshold, edge_threshold in ((0.8, 0.98), (0.5, 0.7)):
      expected = circuits.prune(graph, node_threshold, edge_threshold)
      before = _prune.PASSES.copy()
      _same_pruning(circuits.prune(mapped, node_threshold, edge_threshold), expected)
      assert _prune.PASSES - before == {"backward": 2}  # node, then edge influence
    scores = circuits.graph_scores(on_disk)
    np.testing.assert_allclose(scores, circuits.graph_scores(graph), rtol=1e-12)


def test_an_edited_graph_on_disk_is_pruned_by_the_power_series(gpt2_graph, tmp_path, monkeypatch):
  # An edge into an earlier feature from a later one (a graph attribute never makes): the
  # backward pass does not apply, the power series does, and agrees with the in-memory code.
  graph = gpt2_graph
  edited = np.array(graph.adjacency)
  edited[0, graph.n_features - 1] = edited[: graph.n_features].max()
  edited[graph.n_features - 1, 0] = 0.0
  in_memory = _graph_with(graph, edited)
  mapped = np.memmap(tmp_path / "a", edited.dtype, "w+", shape=edited.shape)
  mapped[:] = edited
  on_disk = _graph_with(graph, mapped)
  monkeypatch.setattr(_prune, "_BLOCK_BYTES", 4 * edited.shape[0] * 8)
  before = _prune.PASSES.copy()
  _same_pruning(circuits.prune(on_disk), circuits.prune(in_memory))
  np.testing.assert_allclose(
    circuits.graph_scores(on_disk), circuits.graph_scores(in_memory), rtol=1e-12
  )
  assert (_prune.PASSES - before)["series"] > 2


def _graph_with(graph, adjacency):
  import dataclasses

  return dataclasses.replace(graph, adjacency=adjacency)


@pytest.fixture(scope="module")
def gpt2_graph():
  return _build("gpt2")[4]


def test_an_error_mid_way_leaves_no_file_and_bad_paths_are_refused(tmp_path, monkeypatch):
  _, model, variables, tcs, graph, lr = _build("gpt2")
  calls = []
  rows = _attribute._rows_cached

  def failing(*args, **kwargs):
    calls.append(1)
    if len(calls) == 2:
      raise KeyboardInterrupt  # a batch after the first
    return rows(*args, **kwargs)

  monkeypatch.setattr(_attribute, "_rows_cached", failing)
  with pytest.raises(KeyboardInterrupt):
    circuits.attribute(
      model, variables, TOKENS, tcs, batch_size=16, local=lr, graph_path=tmp_path / "g"
    )
  assert len(calls) == 2 and list(tmp_path.iterdir()) == []
  monkeypatch.undo()

  def refused(code, match, **kwargs):
    with pytest.raises(circuits.CircuitError, match=match) as info:
      circuits.attribute(model, variables, TOKENS, tcs, local=lr, **kwargs)
    assert info.value.code == code

  refused("circuit_graph_path", "does not exist", graph_path=tmp_path / "missing" / "g")
  (tmp_path / "file").write_text("x")
  refused("circuit_graph_path", "does not exist", graph_path=tmp_path / "file" / "g")
  refused("circuit_file_exists", "exists", graph_path=tmp_path / "file")
  refused("invalid_argument", "graph_path must be", graph_path=3)
  refused("invalid_argument", "max_feature_nodes", graph_path=tmp_path / "g", max_feature_nodes=4)
  refused("invalid_argument", "row_top_k", graph_path=tmp_path / "g", row_top_k=4)
  monkeypatch.setattr("shutil.disk_usage", lambda path: type("Usage", (), {"free": 1000})())
  refused("circuit_graph_path", "GiB free", graph_path=tmp_path / "g")
  assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]


def test_the_memory_estimate_of_a_graph_on_disk_leaves_out_the_adjacency():
  sizes = dict(
    n_layers=4, seq=1000, d_model=64, d_in=64, n_heads=4, n_active=46_000, n_features=46_000
  )
  sizes.update(n_logits=10, batch_size=32, itemsize=4, decoder_width=64)
  n = 46_000 + 5 * 1000 + 10
  dense = circuits.memory_estimate(**sizes)
  assert dense - circuits.memory_estimate(**sizes, on_disk=True) == 4 * n * n
