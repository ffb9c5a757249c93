"""The committed matrix block and the two matrix commands, on both frameworks."""

from pathlib import Path

import pytest

# The matrix cells are cached per process: the files reading them share one xdist worker.
pytestmark = pytest.mark.xdist_group("matrix")

CONTRACT = Path(__file__).resolve().parents[2] / "docs" / "gradient_contract.md"


def test_the_committed_matrix_is_a_fresh_run():
  from torch_bridge import _matrix

  block = _matrix.render_block(_matrix.full_table())
  assert _matrix.committed_block(CONTRACT) == block, (
    "docs/gradient_contract.md's matrix differs from this run: "
    "python -m torch_bridge.matrix --write docs/gradient_contract.md"
  )
  agree, spec, total = _matrix.summary(_matrix.full_table())
  assert agree == spec == total


def test_the_matrix_command(tmp_path, capsys):
  from torch_bridge import matrix as command

  copy = tmp_path / "contract.md"
  copy.write_text(CONTRACT.read_text().replace("| yes |", "| edited |", 1))
  assert command.main(["--check", str(copy)]) == 1
  assert command.main(["--write", str(copy)]) == 0
  assert copy.read_text() == CONTRACT.read_text()
  assert command.main(["--check", str(copy)]) == 0
  assert "up to date" in capsys.readouterr().out


def test_python_m_jaxlens_shows_both_frameworks(capsys):
  from jaxlens import __main__ as entry
  from torch_bridge import _matrix

  assert entry.main(["--no-demo"]) == 0
  out = capsys.readouterr().out
  agree, _, total = _matrix.summary(_matrix.full_table())
  assert f"agreement: {agree} of {total} rows" in out and "torch reference" in out


def test_python_m_jaxlens_without_torch(monkeypatch, capsys):
  from jaxlens import __main__ as entry
  from jaxlens import contract as matrix
  from torch_bridge import _matrix

  # The jaxlens cells already measured this session stand in for a fresh jaxlens run.
  cells = {key: pair.jax for key, pair in _matrix.door_table("live_bind").items()}
  monkeypatch.setattr(entry, "_torch_available", lambda: False)
  monkeypatch.setattr(
    matrix,
    "run_matrix",
    lambda doors_=None: {k: v for k, v in cells.items() if doors_ is None or k[0] in doors_},
  )
  monkeypatch.setattr(matrix, "DOORS", {"live_bind": matrix.DOORS["live_bind"]})
  monkeypatch.setattr(matrix, "spec_model", lambda: (None,) * 4 + ("jax.random",))
  assert entry.main(["--no-demo"]) == 0
  out = capsys.readouterr().out
  assert "torch is not installed" in out and "| torch reference |" not in out
  assert f"{len(cells)} of {len(cells)} rows agree" in out
