"""Sparse dictionaries: SAEs, transcoders and cross-layer transcoders as sites.

* Dictionaries as pytrees: :class:`SAE` (ReLU, JumpReLU, TopK, BatchTopK),
  :class:`Transcoder` (optional skip connection), :class:`CrossLayerTranscoder`;
  ``encode``, ``decode`` and ``__call__`` are pure functions.
* Files: :func:`load_saelens` / :func:`save_saelens` (SAELens's directory format, both
  ways), :func:`load_gemma_scope` (``params.npz`` / safetensors).
* :func:`splice` puts a dictionary at a site of a model (a cross-layer transcoder at every
  layer's MLP, sites ``<mlp>/clt/acts``); its features become the sites
  ``<site>/sae/acts`` (and ``.../recon``, ``.../error``).
* ``jaxlens.sae.train``: training on activations (``jaxlens.store`` or any iterator).

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

__all__ = [
  "ACTIVATIONS",
  "SAE",
  "CrossLayerTranscoder",
  "SAEError",
  "Transcoder",
  "load_gemma_scope",
  "load_saelens",
  "save_saelens",
]
from jaxlens.sae._splice import splice as splice  # noqa: E402

__all__ += ["splice"]
from jaxlens.sae._view import Feature as Feature  # noqa: E402
from jaxlens.sae._view import FeatureView as FeatureView  # noqa: E402
from jaxlens.sae._view import feature_view as feature_view  # noqa: E402

__all__ += ["Feature", "FeatureView", "feature_view"]
