"""The torch side's tests: collected only where torch is installed (``import jaxlens`` and
its own tests never need it)."""

import importlib.util

if importlib.util.find_spec("torch") is None:
  collect_ignore_glob = ["test_*.py"]
