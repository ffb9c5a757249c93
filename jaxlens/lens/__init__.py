"""Lenses: what each layer of a decoder "thinks" (``jaxlens.lens``).

* :func:`logit_lens`: each layer's residual stream through the model's own final norm
  (recomputed on that residual) and unembedding; :func:`logit_lens_topk` its top tokens over
  the vocabulary in chunks, never a ``(layers, positions, vocab)`` array.
* :func:`direct_logit_attribution`: the final logit (or a logit difference) split over the
  embeddings, each attention head, each MLP and the biases, through the final norm with its
  scale frozen: the parts sum to the logit.

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
from jaxlens.lens._readout import LensError as LensError
from jaxlens.lens._readout import Readout as Readout
from jaxlens.lens._readout import readout as readout

__all__ = [
  "Attribution",
  "LensError",
  "Readout",
  "TopTokens",
  "direct_logit_attribution",
  "lens_sites",
  "logit_lens",
  "logit_lens_topk",
  "readout",
  "residuals",
]
