"""Every docstring example in jaxlens runs and prints what it shows.

Public objects show ``jaxlens`` as their module, so ``doctest.testmod`` (which keeps
the objects of the module it is given) would skip them; the examples are collected
here from each module's own definitions instead.
"""

import doctest
import importlib
import inspect
import pkgutil
import tempfile

import pytest

import jaxlens


def _modules():
  names = [jaxlens.__name__]
  for info in pkgutil.walk_packages(jaxlens.__path__, prefix="jaxlens."):
    if info.name.endswith("__main__") or info.name == "jaxlens.demo":
      continue  # a command, not a library module
    names.append(info.name)
  return names


def _examples():
  finder = doctest.DocTestFinder(exclude_empty=True)
  flat = doctest.DocTestFinder(exclude_empty=True, recurse=False)
  seen, out = set(), []
  for name in _modules():
    module = importlib.import_module(name)
    path = getattr(module, "__file__", None)
    candidates = [(name, module)] if module.__doc__ else []
    for attr, obj in vars(module).items():
      if not (inspect.isfunction(obj) or inspect.isclass(obj)):
        continue
      if not getattr(obj, "__module__", "").startswith("jaxlens"):
        continue
      try:
        # Unwrapped: a public entry point is wrapped by jaxlens's traceback boundary.
        defined_here = inspect.getsourcefile(inspect.unwrap(obj)) == path
      except TypeError:
        defined_here = False
      if defined_here:
        candidates.append((f"{name}.{attr}", obj))
    for qualname, obj in candidates:
      # A module's own docstring only: its members are listed above.
      find = flat.find if inspect.ismodule(obj) else finder.find
      for test in find(obj, qualname, module=False, globs={}):
        if test.examples and (test.filename, test.lineno, test.name) not in seen:
          seen.add((test.filename, test.lineno, test.name))
          out.append(test)
  return out


EXAMPLES = _examples()


def test_examples_are_found():
  assert len(EXAMPLES) >= 12, [t.name for t in EXAMPLES]


@pytest.mark.parametrize("test", EXAMPLES, ids=lambda t: t.name)
def test_docstring_example(test, tmp_path, monkeypatch):
  # Examples that save write under tempfile.mkdtemp(): here, under the test's tmp_path.
  monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
  runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
  runner.run(test, out=lambda text: None)
  result = runner.summarize(verbose=False)
  assert result.failed == 0, f"{test.name} ({test.filename}:{test.lineno}) fails"
