"""After a whole run of the suite (``python -m pytest``), ``python tests/scope_seconds.py``
writes the seconds each scope (a test file, or an xdist group of files) took, as pytest's cache
recorded them, into tests/scope_seconds.json: the table tests/conftest.py's scheduling reads to
start the longest scopes first."""

import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
TABLE = HERE / "scope_seconds.json"
CACHE = HERE.parent / ".pytest_cache/v/jaxlens/scope_seconds"


def main() -> int:
  measured = json.loads(CACHE.read_text())
  known = json.loads(TABLE.read_text()) if TABLE.is_file() else {}
  # A partial run (some files, -k) records only the scopes it ran, some of them in part.
  if len(measured) < 0.9 * len(known):
    print(f"the last run measured {len(measured)} scopes of {len(known)}: not a whole run")
    return 1
  TABLE.write_text(json.dumps(measured, indent=1, sort_keys=True) + "\n")
  print(f"{TABLE}: {len(measured)} scopes, {sum(measured.values()):.0f} s")
  return 0


if __name__ == "__main__":
  sys.exit(main())
