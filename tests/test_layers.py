"""The layering of jaxlens and torch_bridge, checked from the source.

* ``jaxlens/_src`` (the core) is built in floors: each module imports only modules of lower
  floors. A new core module must be given a floor here.
* Outside the core, only three facades import ``jaxlens._src``: ``jaxlens.core`` (the core's
  public names), ``jaxlens.intervention`` (every edit builder) and ``jaxlens.internal`` (the
  semi-public helpers tools build on). Every tool, the zoo, the subpackages and torch_bridge
  import those (or other public modules), and a private module (``_name``) only from inside
  its own package.
* Imports of jaxlens and torch_bridge modules are at module level (a command-line entry point,
  ``__main__.py``, may import a subcommand's modules when it runs), and the module-level import
  graph of both packages has no cycle: root -> tools -> core -> ``_src``.
Third-party imports may be deferred into functions (optional dependencies load where used).
"""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SRC = ROOT / "jaxlens" / "_src"
FACADES = {"jaxlens.core", "jaxlens.intervention", "jaxlens.internal"}
# Deliberate function-level imports, each with its reason (none at present).
# Imports made at call time, each for a reason: jaxlens.circuits is built on jaxlens.sae, and
# sae.load_circuit_tracer hands over to circuits' reader (one reader, reachable from both).
DEFERRED: set[tuple[str, str]] = {("jaxlens.sae._formats", "jaxlens.circuits")}
OURS = ("jaxlens", "torch_bridge")

FLOORS = {
  # -1: jaxlens's frames left out of tracebacks (api_boundary; imports only jax).
  "tracebacks": -1,
  # 0: typed errors; structural dependence on jaxprs; drawing views (treescope, HTML).
  "errors": 0,
  "dependence": 0,
  "render": 0,
  # 0: JSON read with its depth bounded (every loader of a JSON file).
  "jsonfile": 0,
  # 0: the matrix exponential of the trained rotations (products only; imports only jax).
  "expm": 0,
  # 1: site infos and selectors; how a door calls a linen or NNX model; named values
  # (identity modules whose call is a site); optional dependencies; the compilation cache; the
  # path argument of every loader, checked.
  "paths": 1,
  "sites": 1,
  "model_calls": 1,
  "named": 1,
  "optional": 1,
  "compile_cache": 1,
  # 2: the edit type, firing, the keep_grad check, donors, the verb registry; orbax
  # checkpoints of a training loop's state (jaxlens.train and jaxlens.sae.train); the views of
  # traces, specs and selectors.
  "edit": 2,
  "checkpoints": 2,
  "viewing": 2,
  # 3: forward verbs (and gate, at_steps, keep_grad, compose, hook); backward verbs; trained
  # interventions (DAS, ReFT).
  "verbs": 3,
  "backward": 3,
  "trained": 3,
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
  # 9: gradients at sites (site_grads, trace.grad) over any run of a spec.
  "gradients": 9,
  # 10: the engines behind a trace's doors (replay, rerun, set_only, grad).
  "replay": 10,
  # 11: the Trace record and jl.trace.
  "tracing": 11,
}


def _module_name(path: Path) -> str:
  parts = list(path.relative_to(ROOT).with_suffix("").parts)
  if parts[-1] == "__init__":
    parts.pop()
  return ".".join(parts)


MODULES = {_module_name(p): p for package in OURS for p in sorted((ROOT / package).rglob("*.py"))}


def _imports(tree):
  """``(imported module, line, at module level)`` for each import of jaxlens or torch_bridge;
  ``from a import b`` names the module ``a.b`` when it is one."""
  top = set(map(id, tree.body))
  for node in ast.walk(tree):
    targets = []
    if isinstance(node, ast.Import):
      targets = [a.name for a in node.names]
    elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
      targets = [
        f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in MODULES else node.module
        for a in node.names
      ]
    for target in targets:
      if target.split(".")[0] in OURS:
        yield target, node.lineno, id(node) in top


def _core_floor(module: str):
  parts = module.split(".")
  return parts[2] if len(parts) > 2 and parts[:2] == ["jaxlens", "_src"] else None


def test_every_core_module_has_a_floor():
  core = {_core_floor(m) for m in MODULES} - {None}
  assert core == set(FLOORS), "give each jaxlens/_src module a floor in FLOORS"


@pytest.mark.parametrize("name", sorted(n for n in MODULES if _core_floor(n)))
def test_core_imports_go_down(name):
  for target, line, top in _imports(ast.parse(MODULES[name].read_text())):
    where = f"{MODULES[name].relative_to(ROOT)}:{line}"
    floor = _core_floor(target)
    assert top, f"{where}: imports {target} inside a function"
    assert floor is not None, f"{where}: the core imports {target}, above it"
    assert FLOORS[floor] < FLOORS[_core_floor(name)], f"{where}: imports {target}, a floor up"


def _private_outside_its_package(name: str, target: str) -> bool:
  """Whether ``target`` has a private part (``_x``) that ``name`` is not inside of."""
  parts = target.split(".")
  for i, part in enumerate(parts):
    if part.startswith("_") and not part.startswith("__"):
      owner = ".".join(parts[:i])
      return not (name == owner or name.startswith(owner + "."))
  return False


@pytest.mark.parametrize("name", sorted(n for n in MODULES if not _core_floor(n)))
def test_tools_use_the_public_api_at_module_level(name):
  path = MODULES[name]
  for target, line, top in _imports(ast.parse(path.read_text())):
    where = f"{path.relative_to(ROOT)}:{line}"
    if _core_floor(target):
      assert name in FACADES, f"{where}: imports {target}; use jaxlens.core/.internal"
    else:
      assert not _private_outside_its_package(name, target), f"{where}: imports {target}"
    deferred = path.name == "__main__.py" or (name, target) in DEFERRED
    assert top or deferred, f"{where}: imports {target} inside a function"


def test_the_import_graph_has_no_cycle():
  graph = {
    name: sorted(
      {t for t, _, top in _imports(ast.parse(path.read_text())) if top and t in MODULES} - {name}
    )
    for name, path in MODULES.items()
  }
  state: dict[str, int] = {}  # 1: on the current path, 2: done

  def visit(name, path):
    state[name] = 1
    for nxt in graph[name]:
      if state.get(nxt) == 1:
        cycle = path[path.index(nxt) :] + [nxt]
        raise AssertionError("import cycle: " + " -> ".join(cycle))
      if nxt not in state:
        visit(nxt, path + [nxt])
    state[name] = 2

  for name in sorted(graph):
    if name not in state:
      visit(name, [name])


def test_the_checker_sees_a_private_import_and_a_function_level_one():
  tree = ast.parse("from jaxlens._src import tracing\ndef f():\n  from jaxlens import store\n")
  found = list(_imports(tree))
  assert found == [("jaxlens._src.tracing", 1, True), ("jaxlens.store", 3, False)]
  assert _private_outside_its_package("jaxlens.sweep", "jaxlens.models._layers")
  assert not _private_outside_its_package("jaxlens.sweep", "jaxlens.sweep._cone")
