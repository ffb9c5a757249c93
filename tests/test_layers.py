"""The layering of ``jaxlens/_src``, checked from the source.

Every module sits on a floor and imports only modules of lower floors, at module
level: no import cycle, and no import inside a function to dodge one. A new module
must be given a floor here; an upward import fails this test.
"""

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parent.parent / "jaxlens" / "_src"

FLOORS = {
  # -1: jaxlens's frames left out of tracebacks (api_boundary; imports only jax).
  "tracebacks": -1,
  # 0: typed errors; structural dependence on jaxprs.
  "errors": 0,
  "dependence": 0,
  # 1: site infos and selectors; how a door calls a linen or NNX model; named values
  # (identity modules whose call is a site).
  "sites": 1,
  "model_calls": 1,
  "named": 1,
  # 2: the edit type, firing, the keep_grad check, donors, the verb registry.
  "edit": 2,
  # 3: forward verbs (and gate, keep_grad, compose, hook); backward verbs.
  "verbs": 3,
  "backward": 3,
  # 4: selections: units, subspace and the subspace_* edits.
  "selections": 4,
  # 5: the one rule-firing loop and no_grad; rules <-> saved spec files.
  "runtime": 5,
  "saving": 5,
  # 6: the live interceptor door; the model call as a program.
  "interceptor": 6,
  "program": 6,
  # 7: evaluating a program (edits, saves, replay cones, scan bodies).
  "interpret": 7,
  # 8: Spec, when, bind, load/save/check.
  "doors": 8,
  # 9: Trace and the trace doors.
  "tracing": 9,
}


def _modules():
  return sorted(p.stem for p in SRC.glob("*.py") if p.stem != "__init__")


def _imports(tree):
  """``(imported _src module or "jaxlens", line, at module level)`` for each jaxlens import."""
  top = set(map(id, tree.body))
  for node in ast.walk(tree):
    names = []
    if isinstance(node, ast.Import):
      names = [a.name for a in node.names]
    elif isinstance(node, ast.ImportFrom) and node.module:
      if node.module == "jaxlens._src":
        names = [f"jaxlens._src.{a.name}" for a in node.names]
      else:
        names = [node.module]
    for name in names:
      if name == "jaxlens" or name.startswith("jaxlens."):
        parts = name.split(".")
        target = parts[2] if len(parts) > 2 and parts[1] == "_src" else "jaxlens"
        yield target, node.lineno, id(node) in top


def test_every_module_has_a_floor():
  assert set(_modules()) == set(FLOORS), "give each jaxlens/_src module a floor in FLOORS"


@pytest.mark.parametrize("name", _modules())
def test_imports_go_down(name):
  tree = ast.parse((SRC / f"{name}.py").read_text())
  for target, line, top in _imports(tree):
    where = f"jaxlens/_src/{name}.py:{line}"
    assert top, f"{where}: imports {target} inside a function (move it to module level)"
    assert target != "jaxlens", f"{where}: _src imports the public package"
    assert FLOORS[target] < FLOORS[name], (
      f"{where}: {name} (floor {FLOORS[name]}) imports {target} (floor {FLOORS[target]})"
    )


@pytest.mark.parametrize("name", _modules())
def test_no_function_level_imports(name):
  tree = ast.parse((SRC / f"{name}.py").read_text())
  for node in ast.walk(tree):
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
      for inner in ast.walk(node):
        assert not isinstance(inner, (ast.Import, ast.ImportFrom)), (
          f"jaxlens/_src/{name}.py:{inner.lineno}: an import inside {node.name}()"
        )


def test_the_checker_sees_an_upward_import():
  tree = ast.parse("from jaxlens._src import tracing\ndef f():\n  from jaxlens._src import doors\n")
  found = list(_imports(tree))
  assert [(t, top) for t, _, top in found] == [("tracing", True), ("doors", False)]
