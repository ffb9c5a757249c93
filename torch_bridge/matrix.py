"""``python -m torch_bridge.matrix``: the contract matrix on jaxlens and the torch reference.

Usage::

  python -m torch_bridge.matrix                                   # print the table
  python -m torch_bridge.matrix --write docs/gradient_contract.md # regenerate the docs block
  python -m torch_bridge.matrix --check docs/gradient_contract.md # exit 1 if it is stale

The exit status is 1 when a row disagrees between the frameworks or with the
specification, or (``--check``) when the committed block differs from this run.
The table itself lives in :mod:`torch_bridge._matrix`; this module is its public
entry point (``python -m jaxlens`` reaches torch through it alone).
"""

from __future__ import annotations

import argparse
import sys

import jax

from torch_bridge import _matrix
from torch_bridge._matrix import SITE as SITE
from torch_bridge._matrix import TOL as TOL
from torch_bridge._matrix import door_table as door_table
from torch_bridge._matrix import format_both as format_both
from torch_bridge._matrix import full_table as full_table
from torch_bridge._matrix import spec_model as spec_model
from torch_bridge._matrix import summary as summary

__all__ = [
  "SITE",
  "TOL",
  "door_table",
  "format_both",
  "full_table",
  "main",
  "spec_model",
  "summary",
]


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(
    prog="python -m torch_bridge.matrix",
    description=__doc__,
    formatter_class=argparse.RawDescriptionHelpFormatter,
  )
  group = parser.add_mutually_exclusive_group()
  group.add_argument("--write", metavar="FILE", help="replace the matrix block of FILE")
  group.add_argument("--check", metavar="FILE", help="fail if FILE's matrix block is stale")
  args = parser.parse_args(argv)
  jax.config.update("jax_enable_x64", True)
  table = _matrix.full_table()
  block = _matrix.render_block(table)
  agree, spec, total = _matrix.summary(table)
  status = 0 if agree == spec == total else 1
  if args.write:
    changed = _matrix.write_block(args.write, block)
    print(
      f"{args.write}: {'updated' if changed else 'already up to date'}; "
      f"{agree} of {total} rows agree, {spec} of {total} match the specification"
    )
  elif args.check:
    if _matrix.committed_block(args.check) != block:
      print(
        f"{args.check}: the matrix block is stale; run "
        f"python -m torch_bridge.matrix --write {args.check}"
      )
      status = 1
    else:
      print(f"{args.check}: up to date")
  else:
    print(_matrix.format_both(table))
  return status


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
