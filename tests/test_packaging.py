"""One dependency list: pyproject.toml's extras name the packages, requirements-dev.txt pins
them (``pip install '.[tests]' && python -m pytest`` and ``pip install -r requirements-dev.txt``
install the same packages)."""

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# Pinned in requirements-dev.txt without being a dependency of an extra: the linter, the type
# checker, and jaxlib, which jax needs at its own version.
TOOLS = {"ruff", "mypy", "jaxlib"}


def _name(requirement: str) -> str:
  return re.split(r"[\[<>=!~; ]", requirement.strip(), maxsplit=1)[0].lower().replace("_", "-")


def _packages(project: dict, extras: list[str]) -> set[str]:
  """The packages of the base dependencies and ``extras``, following ``jaxlens[...]``."""
  found, todo, seen = {_name(r) for r in project["dependencies"]}, list(extras), set()
  while todo:
    extra = todo.pop()
    if extra in seen:
      continue
    seen.add(extra)
    for requirement in project["optional-dependencies"][extra]:
      if _name(requirement) == project["name"]:
        todo += re.search(r"\[(.*)\]", requirement).group(1).split(",")
      else:
        found.add(_name(requirement))
  return found


def test_requirements_dev_pins_exactly_the_extras():
  project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
  lines = [
    line.strip()
    for line in (ROOT / "requirements-dev.txt").read_text().splitlines()
    if line.strip() and not line.startswith("#")
  ]
  installs = [line for line in lines if line.startswith("-e")]
  assert installs == ["-e .[tests,compare]"]
  pins = {_name(line): line.split("==")[1] for line in lines if "==" in line}
  assert all("==" in line for line in lines if not line.startswith("-")), lines
  wanted = _packages(project, ["tests", "compare"])
  assert wanted - set(pins) == set(), "pin these in requirements-dev.txt"
  assert set(pins) - wanted - TOOLS == set(), "add these to a pyproject extra or drop them"


def test_the_tests_extra_holds_what_the_test_command_needs():
  project = tomllib.loads((ROOT / "pyproject.toml").read_text())
  needs = _packages(project["project"], ["tests"])
  addopts = project["tool"]["pytest"]["ini_options"]["addopts"]
  assert "-n" in addopts.split() and "pytest-xdist" in needs
  assert {"pytest", "hypothesis", "chex", "optax", "safetensors", "gguf", "matplotlib"} <= needs
