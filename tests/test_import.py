"""`import jaxlens` never imports torch."""

import subprocess
import sys


def test_import_jaxlens_does_not_import_torch():
  code = "import sys, jaxlens, jaxlens.intervention; print('torch' in sys.modules)"
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
  assert out.stdout.strip() == "False"
