"""A view of dictionary features: top-activating contexts and top logit effects.

:func:`feature_view` reads a dictionary's features off a set of activations and their
tokens; the :class:`FeatureView` it returns renders as a standalone HTML page
(:meth:`FeatureView.to_html`, each context's tokens shaded by the feature's activation),
in treescope (a dataclass of plain values), and as a matplotlib figure
(:meth:`FeatureView.figure`: each feature's activation histogram and top logit effects).
"""

from __future__ import annotations

import dataclasses
import html
from pathlib import Path
from typing import Sequence

import jax.numpy as jnp
import numpy as np

from jaxlens.internal import require
from jaxlens.sae._dictionaries import SAE, SAEError

__all__ = ["FeatureView", "Feature", "feature_view"]


@dataclasses.dataclass(frozen=True)
class Feature:
  """One feature: its index, firing frequency, top contexts and top logit effects.

  Attributes:
    index: the feature's index.
    frequency: the fraction of tokens on which it fires.
    contexts: ``(max activation, [(token, activation), ...])`` for its top contexts, the
      tokens before and at the maximum.
    top_logits: ``[(token, effect), ...]``: the tokens whose logits its decoder row raises
      most through the unembedding (``W_dec[f] @ W_U``).
    bottom_logits: the tokens it lowers most.
    activations: a sample of its non-zero activations (for the histogram).
  """

  index: int
  frequency: float
  contexts: list
  top_logits: list
  bottom_logits: list
  activations: np.ndarray


@dataclasses.dataclass(frozen=True)
class FeatureView:
  """Features of a dictionary on a dataset (see :func:`feature_view`)."""

  features: list
  title: str = "features"

  def to_html(self, path) -> Path:
    """Writes a standalone page (no script, no network) and returns its path."""
    rows = [
      "<!doctype html><meta charset='utf-8'>",
      f"<title>{html.escape(self.title)}</title>",
      "<style>body{font-family:sans-serif;max-width:70em;margin:auto}"
      ".tok{white-space:pre;font-family:monospace;border-radius:2px}"
      "td{vertical-align:top;padding:2px 8px}</style>",
      f"<h1>{html.escape(self.title)}</h1>",
    ]
    for f in self.features:
      rows.append(
        f"<h2>feature {f.index} <small>(fires on {100 * f.frequency:.2f}% of tokens)</small></h2>"
      )
      up = ", ".join(f"{html.escape(repr(t))} {v:+.2f}" for t, v in f.top_logits)
      down = ", ".join(f"{html.escape(repr(t))} {v:+.2f}" for t, v in f.bottom_logits)
      rows.append(f"<p><b>raises</b> {up}<br><b>lowers</b> {down}</p><table>")
      for peak, tokens in f.contexts:
        cells = []
        for token, value in tokens:
          alpha = 0.0 if peak <= 0 else max(0.0, min(1.0, value / peak))
          cells.append(
            f"<span class='tok' style='background:rgba(255,140,0,{alpha:.2f})' "
            f"title='{value:.3f}'>{html.escape(token)}</span>"
          )
        rows.append(f"<tr><td>{peak:.2f}</td><td>{''.join(cells)}</td></tr>")
      rows.append("</table>")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(rows))
    return path

  def figure(self):
    """A matplotlib figure: per feature, its activation histogram and top logit effects."""
    require("matplotlib", feature="FeatureView.figure", extra="plot")
    from matplotlib.figure import Figure

    n = len(self.features)
    fig = Figure(figsize=(10, 2.2 * n), layout="constrained")
    axes = fig.subplots(n, 2, squeeze=False)
    for row, f in zip(axes, self.features):
      row[0].hist(np.asarray(f.activations), bins=30, color="tab:orange")
      row[0].set_title(
        f"feature {f.index}: activations ({100 * f.frequency:.2f}% of tokens)", fontsize=9
      )
      names = [repr(t) for t, _ in f.top_logits][::-1]
      values = [v for _, v in f.top_logits][::-1]
      row[1].barh(names, values, color="tab:blue")
      row[1].set_title(f"feature {f.index}: top logit effects", fontsize=9)
      row[1].tick_params(labelsize=7)
    return fig


def feature_view(
  dictionary: SAE,
  activations,
  token_strings: Sequence[Sequence[str]],
  *,
  features: Sequence[int],
  unembed=None,
  vocabulary: Sequence[str] | None = None,
  contexts: int = 5,
  window: int = 8,
  top_logits: int = 8,
  title: str = "features",
) -> FeatureView:
  """The top-activating contexts and top logit effects of some features.

  Args:
    dictionary: the SAE.
    activations: ``(sequences, seq, d_in)`` site values.
    token_strings: ``(sequences, seq)`` the tokens as strings.
    features: the feature indices to show.
    unembed: ``(d_in, vocab)`` the unembedding, for the logit effects (optional).
    vocabulary: the token strings of the vocabulary's ids (with ``unembed``).
    contexts: top contexts per feature; window: tokens shown up to the maximum.
    top_logits: how many logit effects to list each way.
  """
  acts = np.asarray(dictionary.encode(jnp.asarray(activations)), np.float32)
  if acts.ndim != 3 or acts.shape[:2] != (len(token_strings), len(token_strings[0])):
    raise SAEError(
      f"feature_view: activations {np.shape(activations)} do not match the tokens "
      f"({len(token_strings)} sequences of {len(token_strings[0])})",
      code="sae_shape_mismatch",
      field="activations",
      fix="activations of shape (sequences, seq, d_in) for the same tokens",
    )
  out = []
  for f in features:
    a = acts[..., f]
    flat = np.argsort(a.reshape(-1))[::-1][:contexts]
    ctx = []
    for i in flat:
      s, p = np.unravel_index(i, a.shape)
      if a[s, p] <= 0:
        break
      lo = max(0, p - window + 1)
      ctx.append(
        (float(a[s, p]), [(token_strings[s][q], float(a[s, q])) for q in range(lo, p + 1)])
      )
    up, down = [], []
    if unembed is not None:
      effect = np.asarray(
        jnp.asarray(dictionary.W_dec[f], jnp.float32) @ jnp.asarray(unembed, jnp.float32)
      )
      order = np.argsort(effect)
      name = (lambda i: vocabulary[i]) if vocabulary is not None else str
      up = [(name(int(i)), float(effect[i])) for i in order[::-1][:top_logits]]
      down = [(name(int(i)), float(effect[i])) for i in order[:top_logits]]
    nonzero = a[a > 0]
    out.append(Feature(int(f), float((a > 0).mean()), ctx, up, down, nonzero[:2000]))
  return FeatureView(out, title)
