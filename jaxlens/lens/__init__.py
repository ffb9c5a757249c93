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
* :class:`JacobianLens`: per layer, the average Jacobian of the last block's output with
  respect to the layer's, fitted by :func:`fit_jacobian_lens` (one forward and a ``vmap`` of
  one VJP per prompt), read and written in the published artifact format
  (:func:`load_jacobian_lens`, :func:`save_jacobian_lens`), read by :func:`jacobian_lens`, and
  steering, ablation and swap through it as jaxlens edits (:func:`jacobian_steering`, ...).
* :class:`TunedLens`: affine translators per layer, trained by :func:`train_tuned_lens` (all
  layers in one jitted step, tuned-lens's optimiser by default), read and written in the
  ``tuned-lens`` package's files (:func:`load_tuned_lens`, :func:`save_tuned_lens`) without
  torch; :func:`kl_to_final` compares a lens with the logit lens layer by layer.

Works on the decoders of :mod:`jaxlens.models` (Llama family, GPT-2, GPT-NeoX, Gemma 3/2).
See docs/lenses.md.
"""

from jaxlens.lens._dla import Attribution as Attribution
from jaxlens.lens._dla import direct_logit_attribution as direct_logit_attribution
from jaxlens.lens._jacobian import JacobianLens as JacobianLens
from jaxlens.lens._jacobian import fit_jacobian_lens as fit_jacobian_lens
from jaxlens.lens._jacobian import jacobian_ablation as jacobian_ablation
from jaxlens.lens._jacobian import jacobian_lens as jacobian_lens
from jaxlens.lens._jacobian import jacobian_lens_topk as jacobian_lens_topk
from jaxlens.lens._jacobian import jacobian_lens_vectors as jacobian_lens_vectors
from jaxlens.lens._jacobian import jacobian_steering as jacobian_steering
from jaxlens.lens._jacobian import jacobian_swap as jacobian_swap
from jaxlens.lens._jacobian import load_jacobian_lens as load_jacobian_lens
from jaxlens.lens._jacobian import save_jacobian_lens as save_jacobian_lens
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
from jaxlens.lens._tuned import TrainResult as TrainResult
from jaxlens.lens._tuned import TunedLens as TunedLens
from jaxlens.lens._tuned import kl_to_final as kl_to_final
from jaxlens.lens._tuned import load_tuned_lens as load_tuned_lens
from jaxlens.lens._tuned import save_tuned_lens as save_tuned_lens
from jaxlens.lens._tuned import train_tuned_lens as train_tuned_lens
from jaxlens.lens._tuned import tuned_lens as tuned_lens
from jaxlens.lens._tuned import tuned_lens_optimizer as tuned_lens_optimizer
from jaxlens.lens._tuned import unembed_hash as unembed_hash

__all__ = [
  "Attribution",
  "JacobianLens",
  "LensError",
  "PatchscopeGeneration",
  "Readout",
  "TopTokens",
  "TrainResult",
  "TunedLens",
  "direct_logit_attribution",
  "fit_jacobian_lens",
  "jacobian_ablation",
  "jacobian_lens",
  "jacobian_lens_topk",
  "jacobian_lens_vectors",
  "jacobian_steering",
  "jacobian_swap",
  "kl_to_final",
  "lens_sites",
  "load_jacobian_lens",
  "load_tuned_lens",
  "logit_lens",
  "logit_lens_topk",
  "patchscope",
  "patchscope_generate",
  "readout",
  "residuals",
  "save_jacobian_lens",
  "save_tuned_lens",
  "train_tuned_lens",
  "tuned_lens",
  "tuned_lens_optimizer",
  "unembed_hash",
]
