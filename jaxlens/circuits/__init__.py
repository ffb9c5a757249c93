"""Attribution graphs over transcoders (circuit-tracer's method), exact and by one VJP.

* :func:`attribute`: the graph of a prompt through per-layer transcoders (with or without
  skip connections) or a cross-layer transcoder, on the zoo's decoders: active features,
  one error node per layer and position, token embeddings and logit targets; an edge is the
  direct effect of a source's write on a target's pre-activation or logit, in the local
  replacement model (norm scales, attention patterns and MLP outputs frozen on the prompt).
* :func:`prune`, :func:`graph_scores`: circuit-tracer's pruning by node and edge influence and
  its replacement and completeness scores.
* :func:`feature_intervention`, :func:`feature_intervention_generate`,
  :func:`intervention_spec`: set or scale features and rerun or generate (circuit-tracer's
  semantics), as an ordinary jaxlens spec.
* :func:`head_loadings`, :func:`qk_attribution`: each edge split into the attention heads
  that carry it, and an attention score split over query-side and key-side nodes.
* :func:`graph_html`, :func:`plot_graph`: the pruned graph as a self-contained HTML page
  (inline SVG) and as a static matplotlib figure.
* :func:`save_graph` / :func:`load_graph` (safetensors + JSON), :func:`to_neuronpedia_json`;
  :func:`load_circuit_tracer` reads circuit-tracer's transcoder files,
  :func:`save_transcoders` writes per-layer ones.

See docs/circuits.md.
"""

from jaxlens.circuits._attribute import Graph as Graph
from jaxlens.circuits._attribute import Replacement as Replacement
from jaxlens.circuits._attribute import LocalReplacement as LocalReplacement
from jaxlens.circuits._attribute import attribute as attribute
from jaxlens.circuits._attribute import local_replacement as local_replacement
from jaxlens.circuits._attribute import memory_estimate as memory_estimate
from jaxlens.circuits._attribute import replacement as replacement
from jaxlens.circuits._errors import CircuitError as CircuitError
from jaxlens.circuits._files import load_circuit_tracer as load_circuit_tracer
from jaxlens.circuits._files import load_graph as load_graph
from jaxlens.circuits._files import save_graph as save_graph
from jaxlens.circuits._files import save_transcoders as save_transcoders
from jaxlens.circuits._files import to_neuronpedia_json as to_neuronpedia_json
from jaxlens.circuits._freeze import Recording as Recording
from jaxlens.circuits._freeze import frozen_forward as frozen_forward
from jaxlens.circuits._freeze import record as record
from jaxlens.circuits._freeze import stop_gradient_freeze as stop_gradient_freeze
from jaxlens.circuits._heads import HeadLoadings as HeadLoadings
from jaxlens.circuits._heads import QKAttribution as QKAttribution
from jaxlens.circuits._heads import head_loadings as head_loadings
from jaxlens.circuits._heads import qk_attribution as qk_attribution
from jaxlens.circuits._intervene import Intervened as Intervened
from jaxlens.circuits._intervene import Scale as Scale
from jaxlens.circuits._intervene import feature_intervention as feature_intervention
from jaxlens.circuits._intervene import (
  feature_intervention_generate as feature_intervention_generate,
)
from jaxlens.circuits._intervene import intervention_spec as intervention_spec
from jaxlens.circuits._prune import PruneResult as PruneResult
from jaxlens.circuits._view import GraphLayout as GraphLayout
from jaxlens.circuits._view import graph_html as graph_html
from jaxlens.circuits._view import graph_layout as graph_layout
from jaxlens.circuits._view import plot_graph as plot_graph
from jaxlens.circuits._prune import find_threshold as find_threshold
from jaxlens.circuits._prune import graph_scores as graph_scores
from jaxlens.circuits._prune import prune as prune

__all__ = [
  "CircuitError",
  "Graph",
  "GraphLayout",
  "HeadLoadings",
  "Intervened",
  "LocalReplacement",
  "PruneResult",
  "QKAttribution",
  "Recording",
  "Replacement",
  "Scale",
  "attribute",
  "feature_intervention",
  "feature_intervention_generate",
  "find_threshold",
  "frozen_forward",
  "graph_html",
  "graph_layout",
  "graph_scores",
  "head_loadings",
  "intervention_spec",
  "load_circuit_tracer",
  "load_graph",
  "local_replacement",
  "memory_estimate",
  "plot_graph",
  "prune",
  "qk_attribution",
  "record",
  "replacement",
  "save_graph",
  "save_transcoders",
  "stop_gradient_freeze",
  "to_neuronpedia_json",
]
