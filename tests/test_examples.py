"""Every example (examples/*.py) is run by CI (.ci/run), with small arguments where it takes any.

They are not in ``python -m pytest``: run in this process they take about 180 s of CPU
(look_and_collect.py alone 123 s on SmolLM2, train_through_edits.py 37 s, patching_sweep.py
21 s, measured on the shared two-core machine; sae_smollm2.py trains an SAE on SmolLM2), more than the suite's whole time budget allows.
"""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_ci_runs_every_example():
  ci = (ROOT / ".ci" / "run").read_text()
  ran = set(re.findall(r"^python examples/(\w+)\.py", ci, re.M))
  assert ran == {p.stem for p in (ROOT / "examples").glob("*.py")}
