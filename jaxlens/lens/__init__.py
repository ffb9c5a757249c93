"""Lenses: what each layer of a decoder "thinks" (``jaxlens.lens``).

* :func:`logit_lens`: each layer's residual stream through the model's own final norm
  (recomputed on that residual) and unembedding; :func:`logit_lens_topk` its top tokens over
  the vocabulary in chunks, never a ``(layers, positions, vocab)`` array.
* :func:`direct_logit_attribution`: the final logit (or a logit difference) split over the
  embeddings, each attention head, each MLP and the biases, through the final norm with its
  scale frozen: the parts sum to the logit.
* :func:`patchscope`: a source's residual stream written into a target prompt, every source
  layer x target layer in one compiled program; :func:`patchscope_generate` generates from
  the patched target with ``jaxlens.generate``.

Works on the decoders of :mod:`jaxlens.models` (Llama family, GPT-2, GPT-NeoX, Gemma 3/2).
See docs/lenses.md.
"""

from jaxlens.lens._dla import Attribution as Attribution
from jaxlens.lens._dla import direct_logit_attribution as direct_logit_attribution
from jaxlens.lens._logit import TopTokens as TopTokens
from jaxlens.lens._logit import lens_sites as lens_sites
from jaxlens.lens._logit import logit_lens as logit_lens
from jaxlens.lens._logit import logit_lens_topk as logit_lens_topk
from jaxlens.lens._logit import residuals as residuals
from jaxlens.lens._patchscope import PatchscopeGeneration as PatchscopeGeneration
from jaxlens.lens._patchscope import patchscope as patchscope
from jaxlens.lens._patchscope import patchscope_generate as patchscope_generate
from jaxlens.lens._readout import LensError as LensError
from jaxlens.lens._readout import Readout as Readout
from jaxlens.lens._readout import readout as readout

__all__ = [
  "Attribution",
  "LensError",
  "PatchscopeGeneration",
  "Readout",
  "TopTokens",
  "direct_logit_attribution",
  "lens_sites",
  "logit_lens",
  "logit_lens_topk",
  "patchscope",
  "patchscope_generate",
  "readout",
  "residuals",
]
