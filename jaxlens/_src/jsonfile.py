"""JSON read with its nesting depth bounded: the one reader of the JSON files jaxlens loads
(``store.json``, SAELens's ``cfg.json``, Hugging Face's ``config.json``...).

``json.loads`` recurses once per nested array or object, so a file nested a few thousand deep
raises ``RecursionError`` (not a ``ValueError``, which every loader turns into its typed
error). :func:`loads` measures the depth first, in one pass over the brackets outside strings,
and raises a ``ValueError`` beyond ``max_depth``.
"""

from __future__ import annotations

import json
import re

__all__ = ["MAX_DEPTH", "loads"]

MAX_DEPTH = 64
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"', re.DOTALL)
_BRACKET = re.compile(r"[\[\]{}]")


def loads(text: str | bytes, max_depth: int = MAX_DEPTH):
  """``json.loads(text)``, or a ``ValueError`` if arrays and objects nest deeper than
  ``max_depth``.

  >>> from jaxlens.internal import json_loads
  >>> json_loads('{"a": [1, {"b": 2}]}')
  {'a': [1, {'b': 2}]}
  >>> json_loads("[" * 100 + "]" * 100)
  Traceback (most recent call last):
  ...
  ValueError: JSON nested deeper than 64 levels
  """
  if isinstance(text, (bytes, bytearray)):
    text = text.decode("utf-8")
  depth = deepest = 0
  for bracket in _BRACKET.finditer(_STRING.sub('""', text)):
    depth += 1 if bracket.group() in "[{" else -1
    deepest = max(deepest, depth)
    if deepest > max_depth:
      raise ValueError(f"JSON nested deeper than {max_depth} levels")
  return json.loads(text)
