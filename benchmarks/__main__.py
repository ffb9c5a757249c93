"""``python -m benchmarks``: runs the suite and writes docs/performance.md (see run_all.py)."""

import sys

from benchmarks.run_all import main

sys.exit(main(sys.argv[1:]))
