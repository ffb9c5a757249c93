"""Sparse dictionaries: SAEs, transcoders and cross-layer transcoders as sites.

* Dictionaries as pytrees: :class:`SAE` (ReLU, JumpReLU, TopK, BatchTopK),
  :class:`Transcoder` (optional skip connection), :class:`CrossLayerTranscoder`;
  ``encode``, ``decode`` and ``__call__`` are pure functions.
* Files: :func:`load_saelens` / :func:`save_saelens` (SAELens's directory format, both
  ways), :func:`load_gemma_scope` / :func:`save_gemma_scope` (Gemma Scope and Gemma Scope
  2), :func:`load_gemma_scope_clt` (its cross-layer transcoders), :func:`load_sparsify` /
  :func:`save_sparsify` (EleutherAI sparsify), :func:`load_dictionary_learning`,
  :func:`load_llama_scope` / :func:`save_llama_scope`, :func:`load_hook_z` (connor-rob's
  attention SAEs),
  :func:`load_circuit_tracer` (as :mod:`jaxlens.circuits` reads them); :func:`zoo_site`.
* :func:`splice` puts a dictionary at a site of a model (a cross-layer transcoder at every
  layer's MLP, sites ``<mlp>/clt/acts``); its features become the sites
  ``<site>/sae/acts`` (and ``.../recon``, ``.../error``).
* ``jaxlens.sae.train``: training on activations (``jaxlens.store`` or any iterator).
* :func:`evaluate` (and its parts :func:`reconstruction_metrics`,
  :func:`sparsity_variance_metrics`, :func:`weight_metrics`): SAELens's evaluation metrics.

See docs/dictionaries.md.
"""

from jaxlens.sae._dictionaries import ACTIVATIONS as ACTIVATIONS
from jaxlens.sae._dictionaries import SAE as SAE
from jaxlens.sae._dictionaries import CrossLayerTranscoder as CrossLayerTranscoder
from jaxlens.sae._dictionaries import SAEError as SAEError
from jaxlens.sae._dictionaries import Transcoder as Transcoder
from jaxlens.sae._files import load_gemma_scope as load_gemma_scope
from jaxlens.sae._files import load_saelens as load_saelens
from jaxlens.sae._files import save_saelens as save_saelens
from jaxlens.sae._formats import load_circuit_tracer as load_circuit_tracer
from jaxlens.sae._formats import load_dictionary_learning as load_dictionary_learning
from jaxlens.sae._formats import load_gemma_scope_clt as load_gemma_scope_clt
from jaxlens.sae._formats import load_hook_z as load_hook_z
from jaxlens.sae._formats import load_llama_scope as load_llama_scope
from jaxlens.sae._formats import load_sparsify as load_sparsify
from jaxlens.sae._formats import save_gemma_scope as save_gemma_scope
from jaxlens.sae._formats import save_llama_scope as save_llama_scope
from jaxlens.sae._formats import save_sparsify as save_sparsify
from jaxlens.sae._formats import zoo_site as zoo_site

__all__ = [
  "ACTIVATIONS",
  "SAE",
  "CrossLayerTranscoder",
  "SAEError",
  "Transcoder",
  "load_circuit_tracer",
  "load_dictionary_learning",
  "load_gemma_scope",
  "load_gemma_scope_clt",
  "load_hook_z",
  "load_llama_scope",
  "load_saelens",
  "load_sparsify",
  "save_gemma_scope",
  "save_llama_scope",
  "save_saelens",
  "save_sparsify",
  "zoo_site",
]
from jaxlens.sae._splice import splice as splice  # noqa: E402

__all__ += ["splice"]
from jaxlens.sae._view import Feature as Feature  # noqa: E402
from jaxlens.sae._view import FeatureView as FeatureView  # noqa: E402
from jaxlens.sae._view import feature_view as feature_view  # noqa: E402

__all__ += ["Feature", "FeatureView", "feature_view"]
from jaxlens.sae._eval import evaluate as evaluate  # noqa: E402
from jaxlens.sae._eval import reconstruction_metrics as reconstruction_metrics  # noqa: E402
from jaxlens.sae._eval import sparsity_variance_metrics as sparsity_variance_metrics  # noqa: E402
from jaxlens.sae._eval import weight_metrics as weight_metrics  # noqa: E402

__all__ += ["evaluate", "reconstruction_metrics", "sparsity_variance_metrics", "weight_metrics"]
