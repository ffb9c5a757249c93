"""The docs run: every ```python block of docs/*.md, and the generated matrix is current.

The blocks of one page run in order in one namespace (a page reads like a notebook).
A block preceded by the line ``<!-- no-run -->`` is not run. A block containing
``# docs-test: expected=<literal>`` must leave ``RESULT == <literal>``. Blocks run under
strict dtype promotion (tests/conftest.py), except a block preceded by the line
``<!-- docs-test: promotion=standard -->``, for a third-party library that mixes dtypes
itself (the page says which next to the marker).
"""

from __future__ import annotations

import ast
import contextlib
import importlib.util
import re
import tempfile
from pathlib import Path

import jax
import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = sorted((ROOT / "docs").glob("*.md"))
# The files that load the pretrained wheels (SmolLM2, Gemma 3: one cached load each per
# process) run in one xdist worker.
pytestmark = pytest.mark.xdist_group("pretrained")
CONTRACT = ROOT / "docs" / "gradient_contract.md"
_EXPECTED = re.compile(r"^# docs-test: expected=(.*)$", re.M)
# A page that needs optional packages (the model wheels) says so and is skipped without them.
_REQUIRES = re.compile(r"^<!-- docs-test: requires=(\S+) -->$", re.M)
_STANDARD_PROMOTION = "<!-- docs-test: promotion=standard -->"


def python_blocks(path: Path) -> list[tuple[int, str]]:
  """``(first code line number, code)`` of each runnable python block of ``path``."""
  lines = path.read_text().splitlines()
  blocks, i = [], 0
  while i < len(lines):
    if lines[i].strip() == "```python":
      previous = next((l.strip() for l in reversed(lines[:i]) if l.strip()), "")
      j = i + 1
      while j < len(lines) and lines[j].strip() != "```":
        j += 1
      if j == len(lines):
        raise AssertionError(f"{path}:{i + 1}: unterminated python block")
      if previous != "<!-- no-run -->":
        blocks.append((i + 2, "\n".join(lines[i + 1 : j])))
      i = j
    i += 1
  return blocks


def standard_promotion_blocks(path: Path) -> set[int]:
  """First code line numbers of the python blocks marked to run under standard promotion."""
  lines = path.read_text().splitlines()
  return {
    i + 2
    for i, line in enumerate(lines)
    if line.strip() == "```python"
    and next((l.strip() for l in reversed(lines[:i]) if l.strip()), "") == _STANDARD_PROMOTION
  }


def test_the_contract_page_has_examples():
  assert len(python_blocks(CONTRACT)) >= 4


@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.name)
def test_docs_examples_run(path, tmp_path, monkeypatch):
  # Examples that save write under tempfile.mkdtemp(): here, under the test's tmp_path.
  monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
  requires = _REQUIRES.search(path.read_text())
  for name in requires.group(1).split(",") if requires else ():
    if importlib.util.find_spec(name) is None:
      pytest.skip(f"{path.name} needs {name}")
  namespace = {"__name__": f"docs_{path.stem}"}
  standard = standard_promotion_blocks(path)
  for line, code in python_blocks(path):
    promotion = (
      jax.numpy_dtype_promotion("standard") if line in standard else contextlib.nullcontext()
    )
    # Padding puts the block at its own line numbers, so a traceback points into the page.
    with promotion:
      exec(compile("\n" * (line - 1) + code, str(path), "exec"), namespace)
    expected = _EXPECTED.search(code)
    if expected:
      assert namespace.get("RESULT") == ast.literal_eval(expected.group(1)), (
        f"{path}:{line}: RESULT is {namespace.get('RESULT')!r}"
      )


# Packages outside the `[tests]` extra (the `[compare]` extra and the model wheels): a page whose
# runnable blocks import one must declare it, so that `pip install '.[tests]'` skips the page.
_OPTIONAL = {"torch", "torch_bridge", "transformers", "sae_lens", "pyvene", "torchlens"}
_IMPORTED = re.compile(r"^\s*(?:import|from)\s+([\w.]+(?:\s*,\s*[\w.]+)*)", re.M)


@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.name)
def test_a_page_declares_the_optional_packages_it_imports(path):
  declared = (
    set(_REQUIRES.search(path.read_text()).group(1).split(","))
    if _REQUIRES.search(path.read_text())
    else set()
  )
  imported = {
    name.strip().split(".")[0]
    for _, code in python_blocks(path)
    for names in _IMPORTED.findall(code)
    for name in names.split(",")
  }
  needs = {"torch" if name == "torch_bridge" else name for name in imported & _OPTIONAL}
  assert needs <= declared, (
    f"{path.name}: add <!-- docs-test: requires={','.join(sorted(needs))} -->"
  )


def test_the_runner_skips_marked_blocks(tmp_path):
  page = tmp_path / "page.md"
  page.write_text(
    "text\n\n```python\nA = 1\n```\n\n<!-- no-run -->\n```python\nraise SystemExit\n```\n"
  )
  assert python_blocks(page) == [(4, "A = 1")]


def test_the_runner_finds_standard_promotion_blocks(tmp_path):
  page = tmp_path / "page.md"
  page.write_text(
    "```python\nA = 1\n```\n\n<!-- docs-test: promotion=standard -->\n```python\nB = 2\n```\n"
  )
  assert python_blocks(page) == [(2, "A = 1"), (7, "B = 2")]
  assert standard_promotion_blocks(page) == {7}
