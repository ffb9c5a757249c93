"""One public surface: ``jaxlens.intervention`` is complete, the root a superset, every name
shows ``jaxlens`` as its module, and every error code the code raises is documented."""

import ast
import inspect
import re
from pathlib import Path

import jaxlens as jl
from jaxlens import intervention as ji

ROOT = Path(__file__).resolve().parent.parent


def test_the_root_is_a_superset_of_intervention():
  assert set(ji.__all__) <= set(jl.__all__)
  for name in ji.__all__:
    assert getattr(jl, name) is getattr(ji, name), name


def test_the_root_is_what_its_rule_says():
  """The core, every edit builder, each tool once as a module and the tools' listed entry
  points (the rule in jaxlens/__init__.py's docstring); nothing else."""
  import types

  tools = {n for n in jl.__all__ if isinstance(getattr(jl, n), types.ModuleType)}
  assert tools == {"core", "intervention", *jl._TOOLS}
  assert set(jl.__all__) == {*jl.core.__all__, *ji.__all__, *tools, *jl._ENTRY_POINTS}
  for name in jl.core.__all__:
    assert getattr(jl, name) is getattr(jl.core, name), name
  for name in jl._ENTRY_POINTS:
    assert any(getattr(jl, name) is getattr(getattr(jl, t), name, None) for t in jl._TOOLS)


def test_all_lists_are_unique_and_resolve():
  from jaxlens import circuits, internal

  for module in (jl, ji, jl.sweep, jl.core, internal, circuits):
    assert len(module.__all__) == len(set(module.__all__)), module.__name__
    for name in module.__all__:
      assert hasattr(module, name), f"{module.__name__}.{name}"


def test_every_edit_builder_is_in_intervention():
  """Every public function returning an Edit or a Selection lives in jaxlens.intervention."""
  for name in jl.__all__:
    obj = getattr(jl, name)
    if inspect.isfunction(obj):
      ret = inspect.signature(obj).return_annotation
      if ret in ("Edit", "Selection", ji.Edit, ji.Selection):
        assert name in ji.__all__, name


def test_every_verb_is_public_under_its_name():
  from jaxlens._src.edit import REGISTRY

  for name, verb in REGISTRY.items():
    if verb.wraps:  # units/subspace edits come from jl.units / jl.subspace (.wrap)
      assert hasattr(ji, name)
      continue
    assert getattr(ji, name) is verb.factory, name


def test_public_objects_show_the_public_module():
  for name in jl.__all__:
    obj = getattr(jl, name)
    if inspect.isclass(obj) or inspect.isfunction(obj):
      assert not obj.__module__.startswith("jaxlens._src"), f"{name}: {obj.__module__}"


def _raised_codes():
  """Every ``code=`` string literal (and f-string prefix) in jaxlens and torch_bridge."""
  codes = set()
  for path in [*ROOT.glob("jaxlens/**/*.py"), *ROOT.glob("torch_bridge/**/*.py")]:
    for node in ast.walk(ast.parse(path.read_text())):
      if isinstance(node, ast.keyword) and node.arg == "code":
        value = node.value
        if isinstance(value, ast.Constant) and isinstance(value.value, str):
          codes.add(value.value)
        elif isinstance(value, ast.JoinedStr):
          tail = "".join(v.value for v in value.values if isinstance(v, ast.Constant))
          codes.update({tail, f"hook_{tail}"})
  return codes


def test_every_error_code_is_documented():
  text = (ROOT / "docs" / "errors.md").read_text()
  documented = set(re.findall(r"`([a-z0-9_]+)`", text))
  missing = sorted(_raised_codes() - documented)
  assert not missing, f"add to docs/errors.md: {missing}"
