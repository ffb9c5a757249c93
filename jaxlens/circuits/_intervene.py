"""Interventions on a graph's features, with circuit-tracer's semantics, as ordinary jaxlens
edits: a spec (``jl.when(site, jl.hook(...))`` rules) on the model's own sites, live on every
door, and through :func:`jaxlens.generate`'s KV cache for open-ended generation.

An intervention ``(layer, position, feature, value)`` sets a transcoder feature's activation
to ``value`` (or, with :class:`Scale`, multiplies it): the MLP output it writes to (``mlp_out``
of that layer, and of every later layer for a cross-layer transcoder) gets the feature's
decoder vector times ``value - activation``, as circuit-tracer's ``feature_intervention``
does. The model's own MLPs stay in place.

* Unconstrained (``constrained_layers=None``): the activation is the transcoder's on the
  MLP's input of the edited run, so effects propagate through every later MLP, norm and (with
  ``freeze_attention=False``) attention pattern.
* Constrained to layers ``R``: each MLP output in ``R`` is held at its value on the prompt
  (a skip transcoder's skip term stays live), the change is computed from the prompt's
  activations and written only to the layers of ``R``; the attention patterns are held, and
  every norm's scale too when ``R`` covers every layer. That is the local replacement model,
  where a change of the logits is exactly the graph's edges times the change of the features.
* Unconstrained with ``mlps="transcoders"`` or ``"linear"``: from the first intervened layer
  on, each MLP output is its value on the prompt plus the change of its transcoder's output
  (the error term held at its value on the prompt), so every feature responds, not only the
  intervened ones; ``"linear"`` also holds each feature's gate (active on the prompt: linear
  in its pre-activation; inactive: off). With ``freeze_attention`` and ``freeze_norms`` that
  is the graph's own linearisation, where an intervention moves a logit by the graph's total
  effect along every path through the other features.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

import jaxlens as jl
from jaxlens.circuits._attribute import (
  TRACES,
  Replacement,
  _check_tokens,
  _fill_missing,
  _hashable,
  _without_transcoder,
  replacement,
)
from jaxlens.circuits._errors import CircuitError
from jaxlens.sae import CrossLayerTranscoder

__all__ = [
  "Intervened",
  "Scale",
  "feature_intervention",
  "feature_intervention_generate",
  "intervention_spec",
]

_NORM_LEAVES = ("ln_final",)


@dataclasses.dataclass(frozen=True)
class Scale:
  """An intervention value that multiplies the feature's activation by ``factor`` (instead of
  setting it): ``(layer, position, feature, circuits.Scale(0.5))``."""

  factor: float


class Intervened:
  """What :func:`feature_intervention` returns.

  Attributes:
    logits: ``(seq, vocab)``: the model's logits with the intervention.
    activations: ``(L, seq, d_sae)``: each layer's transcoder activations of its MLP input in
      the edited run (pre-activations with ``apply_activation_function=False``; the first
      position's zero with ``zero_bos``).
    spec: the jaxlens spec that made the edit (``spec.bind(model)(variables, tokens[None])``),
      built when first read.
  """

  def __init__(self, logits, activations, spec):
    self.logits = logits
    self.activations = activations
    self._spec = spec  # the spec, or a function that builds it

  @property
  def spec(self):
    if not isinstance(self._spec, jl.Spec):
      self._spec = self._spec()
    return self._spec

  def __repr__(self) -> str:
    return (
      f"Intervened(logits={getattr(self.logits, 'shape', None)}, "
      f"activations={getattr(self.activations, 'shape', None)})"
    )


def _is_norm(path: str) -> bool:
  leaf = path.split("/")[-1]
  return leaf.startswith("ln_") or leaf in _NORM_LEAVES or leaf.endswith("_norm")


def _input_label(labels, layer: int) -> str:
  """The site whose value is layer ``layer``'s MLP input: its pre-norm ``ln_2``, or
  ``resid_mid`` where the block has no norm before the MLP."""
  for leaf in ("ln_2", "resid_mid"):
    label = f"blocks_{layer}/{leaf}"
    if label in labels:
      return label
  raise CircuitError(
    f"the model has no blocks_{layer}/ln_2 or resid_mid site to read its MLP's input from",
    code="circuit_unsupported_model",
    fix="a decoder of jaxlens.models with scan_layers=False",
  )


def _positions(pos, seq: int, layer: int, feature: int) -> np.ndarray:
  if isinstance(pos, slice):
    return np.arange(seq)[pos]
  p = np.asarray(pos)
  if not np.issubdtype(p.dtype, np.integer) or p.ndim > 1:
    raise CircuitError(
      f"intervention ({layer}, {pos!r}, {feature}, ...): a position is an int, a slice or "
      "a sequence of ints",
      code="invalid_argument",
      received=repr(pos),
      fix="(layer, 3, feature, value) or (layer, slice(1, None), feature, value)",
    )
  p = p.reshape(-1)
  if ((p < -seq) | (p >= seq)).any():
    raise CircuitError(
      f"intervention at position {p.tolist()} of a prompt of {seq} tokens",
      code="index_out_of_range",
      expected=f"[0, {seq})",
      received=p.tolist(),
      fix="a position of the prompt",
    )
  return p % seq


def _check(interventions, rep: Replacement, d_sae: int, missing=frozenset()):
  if (
    isinstance(interventions, tuple) and len(interventions) == 4 and np.ndim(interventions[0]) == 0
  ):
    interventions = [interventions]
  out = []
  for item in interventions:
    if not isinstance(item, (tuple, list)) or len(item) != 4:
      raise CircuitError(
        f"an intervention is (layer, position, feature, value), got {item!r}",
        code="invalid_argument",
        received=repr(item),
        fix="[(1, 3, 17, 0.0)] sets feature 17 of layer 1 at position 3 to 0",
      )
    layer, pos, feature, value = item
    if isinstance(layer, bool) or not isinstance(layer, (int, np.integer)):
      raise CircuitError(
        f"intervention layer must be an int, got {layer!r}",
        code="invalid_argument",
        received=repr(layer),
        fix="an int layer index",
      )
    if not 0 <= layer < rep.n_layers:
      raise CircuitError(
        f"intervention at layer {layer} of a model of {rep.n_layers} layers",
        code="index_out_of_range",
        expected=f"[0, {rep.n_layers})",
        received=int(layer),
        fix="a layer of the model",
      )
    if layer in missing:
      # Its silent stand-in (``_fill_missing``) writes nothing: the edit would do nothing.
      raise CircuitError(
        f"intervention at layer {layer}, which has no transcoder (None in the list of "
        "transcoders): it has no features to set",
        code="invalid_argument",
        site=f"blocks_{layer}/mlp",
        received=int(layer),
        expected=f"a layer with a transcoder: {sorted(set(range(rep.n_layers)) - missing)}",
        fix="give that layer a transcoder, or intervene on a layer that has one",
      )
    f = np.asarray(feature)
    if not np.issubdtype(f.dtype, np.integer) or ((f < 0) | (f >= d_sae)).any():
      raise CircuitError(
        f"intervention feature {feature!r} is not a feature index in [0, {d_sae})",
        code="index_out_of_range",
        expected=f"[0, {d_sae})",
        received=repr(feature),
        fix="the feature's index in its transcoder",
      )
    if not isinstance(value, Scale) and (
      isinstance(value, bool) or not np.isfinite(np.asarray(value, np.float64)).all()
    ):
      raise CircuitError(
        f"intervention value must be a finite number or circuits.Scale, got {value!r}",
        code="invalid_argument",
        received=repr(value),
        fix="0.0 to ablate, circuits.Scale(2.0) to double",
      )
    out.append((int(layer), pos, f, value))
  return out


def _tables(items, seq: int, d_sae: int, dtype, *, open_ended_only: bool = False):
  """Per intervened layer, ``(mask, is_scale, value)`` arrays ``(seq, d_sae)``."""
  tables: dict = {}
  for layer, pos, feature, value in items:
    if open_ended_only:
      if not (isinstance(pos, slice) and pos.stop is None):
        continue
      ps = np.arange(seq)
    else:
      ps = _positions(pos, seq, layer, feature)
    mask, scale, val = tables.setdefault(
      layer,
      (np.zeros((seq, d_sae), bool), np.zeros((seq, d_sae), bool), np.zeros((seq, d_sae))),
    )
    pp, ff = np.meshgrid(ps, np.atleast_1d(feature), indexing="ij")
    mask[pp, ff] = True
    if isinstance(value, Scale):
      scale[pp, ff] = True
      val[pp, ff] = value.factor
    else:
      scale[pp, ff] = False
      val[pp, ff] = np.broadcast_to(np.asarray(value, np.float64), np.shape(pp))
  return {
    layer: (jnp.asarray(m), jnp.asarray(s), jnp.asarray(v, dtype))
    for layer, (m, s, v) in tables.items()
  }


def _target(acts, table):
  mask, is_scale, value = table
  new = jnp.where(is_scale, value * acts, value)
  return jnp.where(mask, new, acts)


def _pre_fns(transcoders):
  if isinstance(transcoders, CrossLayerTranscoder):
    clt = transcoders
    return [
      (lambda x, i=i: x.astype(clt.W_enc.dtype) @ clt.W_enc[i] + clt.b_enc[i])
      for i in range(clt.n_layers)
    ]
  return [t.hidden_pre for t in _fill_missing(transcoders)]  # None: features that never fire


def _dec(rep: Replacement, source: int, target: int):
  """Layer ``source``'s decoder into layer ``target``'s MLP output, or None."""
  k = target - source
  if k < 0 or k >= rep.W_dec[source].shape[0]:
    return None
  return rep.W_dec[source][k]


def _fit(value, x):
  """``value`` recorded on the prompt, in ``x``'s dtype."""
  return jnp.asarray(value, x.dtype)


def _delta_hook(rep, layer, tables, input_labels, zero_bos, first):
  """``mlp_out`` of ``layer`` plus the decoders times (target - activation) of the
  intervened features, their activations computed on the edited run's MLP inputs."""

  def fn(x, *, hook):
    delta = jnp.zeros(x.shape, x.dtype)
    for source, table in tables.items():
      w = _dec(rep, source, layer)
      if w is None:
        continue
      xin = hook.site_values[input_labels[source]][1]
      acts = rep.encoders[source](xin).astype(x.dtype)
      if zero_bos and first:
        acts = acts.at[..., 0, :].set(0)
      delta = delta + ((_target(acts, table) - acts) @ w.astype(x.dtype)).astype(x.dtype)
    return x + delta

  return fn


def _frozen_hook(rep, layer, out, delta, x_in, input_label):
  """``mlp_out`` held at its prompt value plus the change, the skip term live."""

  def fn(x, *, hook):
    held = _fit(out + delta, x)
    if rep.W_skip[layer] is None:
      return held
    xin = hook.site_values[input_label][1]
    live = rep.skip(layer, xin).astype(x.dtype)
    return held + live - _fit(rep.skip(layer, x_in).astype(x.dtype), x)

  return fn


def _replacement_hook(rep, layer, tables, input_labels, zero_bos, prompt, gates, pre):
  """``mlp_out`` of ``layer``: its value on the prompt plus the change of the transcoders'
  writes into it and of its skip term, every feature's activation computed on the edited
  run's MLP inputs (``gates``: each feature's gate held at the prompt's, else live).
  ``prompt``: ``(inputs, outputs, acts)`` per layer on the prompt."""
  prompt_inputs, prompt_out, prompt_acts = prompt

  def fn(x, *, hook):
    delta = jnp.zeros(x.shape, x.dtype)
    for source in range(layer + 1):
      w = _dec(rep, source, layer)
      if w is None:
        continue
      xin = hook.site_values[input_labels[source]][1]
      if gates is None:
        acts = rep.encoders[source](xin)
      else:
        acts = pre[source](xin) * gates[source]
      acts = acts.astype(x.dtype)
      if zero_bos:
        acts = acts.at[..., 0, :].set(0)
      if source in tables:
        acts = _target(acts, tables[source])
      delta = delta + ((acts - _fit(prompt_acts[source], x)) @ w.astype(x.dtype)).astype(x.dtype)
    if rep.W_skip[layer] is not None:
      xin = hook.site_values[input_labels[layer]][1]
      skip = rep.skip(layer, xin).astype(x.dtype)
      delta = delta + skip - _fit(rep.skip(layer, prompt_inputs[layer]), x)
    return _fit(prompt_out[layer], x) + delta

  return fn


def _held(value):
  return lambda x: _fit(value, x)


def _record(model, variables, toks, n_layers):
  """The prompt's run: its labels and the values the constrained intervention holds."""
  inputs = jl.module("blocks_*/ln_2") | jl.module("blocks_*/resid_mid")
  save = [
    jl.module("blocks_*/attn/pattern"),
    jl.func("rsqrt"),
    inputs,
    jl.module("blocks_*/mlp_out"),
  ]
  t = jl.trace(model, variables, toks[None], save=save)
  input_labels = [_input_label(set(t.labels), i) for i in range(n_layers)]
  norm_labels = [lbl for lbl in t.labels if lbl.startswith("rsqrt_") and _is_norm(t[lbl].info.path)]
  return t, input_labels, norm_labels


def intervention_spec(
  model,
  variables,
  tokens,
  transcoders,
  interventions,
  *,
  constrained_layers=None,
  freeze_attention: bool = True,
  zero_bos: bool = False,
  open_ended: bool = False,
  mlps: str = "model",
  freeze_norms: bool = False,
):
  """The jaxlens spec of a feature intervention (circuit-tracer's ``feature_intervention``).

  Args:
    model: a decoder of :mod:`jaxlens.models` (not scanned).
    variables: its variables.
    tokens: the prompt, int ``(seq,)`` or ``(1, seq)``.
    transcoders: one :class:`jaxlens.sae.Transcoder` per layer or a
      :class:`jaxlens.sae.CrossLayerTranscoder`.
    interventions: ``(layer, position, feature, value)`` tuples: ``position`` an int, a
      sequence of ints or a slice (``slice(k, None)`` is open-ended: it also holds the
      feature on generated tokens); ``value`` a number (set) or :class:`Scale` (multiply).
    constrained_layers: ``None`` (effects propagate through the model) or the layers
      (``range(a, b)``) whose MLP outputs are held and receive the change (see the module).
    freeze_attention: hold every attention pattern at its value on the prompt.
    zero_bos: the first position's activations count as zero (circuit-tracer's default).
    open_ended: the spec of a generation's decode steps instead: only the open-ended
      interventions, on the one new position, nothing held.
    mlps: unconstrained, what responds to the change: ``"model"`` (the model's own MLPs, the
      intervened features' change added: circuit-tracer's), ``"transcoders"`` (each MLP from
      the first intervened layer on is its transcoder with its error held at its value on
      the prompt: every feature responds through its activation function) or ``"linear"``
      (as ``"transcoders"``, each feature's gate held at the prompt's). Only with
      ``constrained_layers=None``.
    freeze_norms: hold every norm's scale at its value on the prompt (constrained over every
      layer, they are held anyway). With ``mlps="linear"`` and ``freeze_attention``, the
      graph's linearisation: an intervention moves each logit by the graph's total effect.

  Returns:
    A :class:`jaxlens.Spec` for ``model`` (``spec.bind(model)(variables, tokens[None])``,
    ``jl.trace(..., intervene=spec)``, ``jl.generate(..., prefill=spec)``).

  Raises:
    CircuitError: ``invalid_argument``, ``index_out_of_range`` (a layer, position or feature
      outside the model, prompt or transcoder), ``circuit_transcoder_mismatch``,
      ``circuit_unsupported_model``.
  """
  spec, _ = _spec(
    model,
    variables,
    tokens,
    transcoders,
    interventions,
    constrained_layers=constrained_layers,
    freeze_attention=freeze_attention,
    zero_bos=zero_bos,
    open_ended=open_ended,
    mlps=mlps,
    freeze_norms=freeze_norms,
  )
  return spec


_MLPS = ("model", "transcoders", "linear")


def _check_mlps(mlps, layers):
  if not isinstance(mlps, str) or mlps not in _MLPS:
    raise CircuitError(
      f"mlps must be one of {_MLPS}, got {mlps!r}",
      code="invalid_argument",
      received=repr(mlps),
      expected=repr(_MLPS),
      fix='mlps="model" (the model\'s MLPs) or "linear" (the graph\'s linearisation)',
    )
  if mlps != "model" and layers is not None:
    raise CircuitError(
      f"mlps={mlps!r} with constrained_layers: the constrained layers' MLP outputs are held",
      code="invalid_argument",
      received=repr(mlps),
      fix="constrained_layers=None with mlps='transcoders' or 'linear'",
    )
  return mlps


def _layers(constrained_layers, n_layers):
  if constrained_layers is None:
    return None
  try:
    layers = sorted({int(i) for i in constrained_layers})
  except (TypeError, ValueError):
    layers = None
  if not layers or layers[0] < 0 or layers[-1] >= n_layers:
    raise CircuitError(
      f"constrained_layers must be a non-empty range of the model's {n_layers} layers, got "
      f"{constrained_layers!r}",
      code="invalid_argument",
      received=repr(constrained_layers),
      fix=f"constrained_layers=range({n_layers})",
    )
  return layers


def _spec(
  model,
  variables,
  tokens,
  transcoders,
  interventions,
  *,
  constrained_layers,
  freeze_attention,
  zero_bos,
  open_ended,
  patterns=None,
  mlps="model",
  freeze_norms=False,
):
  toks = _check_tokens(model, tokens)
  rep = replacement(model, transcoders)
  n, seq = rep.n_layers, int(toks.shape[0])
  d_sae = int(rep.W_enc[0].shape[-1])
  items = _check(interventions, rep, d_sae, _without_transcoder(transcoders))
  layers = _layers(constrained_layers, n)
  _check_mlps(mlps, layers)
  dtype = jnp.result_type(rep.W_dec[0])
  if open_ended:
    tables = _tables(items, 1, d_sae, dtype, open_ended_only=True)
  else:
    tables = _tables(items, seq, d_sae, dtype)
  return _spec_of_tables(
    model,
    variables,
    toks,
    rep,
    tables,
    layers,
    freeze_attention,
    zero_bos,
    open_ended,
    patterns,
    mlps,
    bool(freeze_norms),
  )


def _spec_of_tables(
  model,
  variables,
  toks,
  rep,
  tables,
  layers,
  freeze_attention,
  zero_bos,
  open_ended,
  patterns,
  mlps="model",
  freeze_norms=False,
):
  n = rep.n_layers
  dtype = jnp.result_type(rep.W_dec[0])
  t, input_labels, norm_labels = _record(model, variables, toks, n)
  rules = []
  if open_ended:
    targets = sorted({j for i in tables for j in range(i, n) if _dec(rep, i, j) is not None})
    for j in targets:
      hook = _delta_hook(rep, j, tables, input_labels, False, False)
      rules.append(jl.when(jl.module(f"blocks_{j}/mlp_out"), jl.hook(hook)))
    return _joined(rules), t
  if (freeze_attention or layers is not None) and tables:
    for i in range(n):
      label = f"blocks_{i}/attn/pattern"
      held = t[label].out if patterns is None else patterns[label]
      rules.append(jl.when(jl.module(label), jl.hook(_held(held))))
  if layers is None:
    if freeze_norms and tables:
      for label in norm_labels:
        rules.append(jl.when(jl.label(label), jl.hook(_held(t[label].out))))
    if mlps == "model":
      targets = sorted({j for i in tables for j in range(i, n) if _dec(rep, i, j) is not None})
      for j in targets:
        hook = _delta_hook(rep, j, tables, input_labels, zero_bos, True)
        rules.append(jl.when(jl.module(f"blocks_{j}/mlp_out"), jl.hook(hook)))
      return _joined(rules), t
    if tables:
      inputs = [t[input_labels[i]].out for i in range(n)]
      outs = [t[f"blocks_{i}/mlp_out"].out for i in range(n)]
      acts = [rep.encoders[i](inputs[i]).astype(dtype) for i in range(n)]
      if zero_bos:
        acts = [a.at[..., 0, :].set(0) for a in acts]
      gates = None if mlps == "transcoders" else [(a != 0).astype(dtype) for a in acts]
      pre = _pre_fns(rep.source)
      for j in range(min(tables), n):
        hook = _replacement_hook(
          rep, j, tables, input_labels, zero_bos, (inputs, outs, acts), gates, pre
        )
        rules.append(jl.when(jl.module(f"blocks_{j}/mlp_out"), jl.hook(hook)))
    return _joined(rules), t
  if layers == list(range(n)) or (freeze_norms and tables):
    for label in norm_labels:
      rules.append(jl.when(jl.label(label), jl.hook(_held(t[label].out))))
  acts = {}
  for i in tables:
    a = rep.encoders[i](t[input_labels[i]].out).astype(dtype)
    acts[i] = a.at[..., 0, :].set(0) if zero_bos else a
  for j in layers:
    out = t[f"blocks_{j}/mlp_out"].out
    delta = jnp.zeros(out.shape, out.dtype)
    for i, table in tables.items():
      w = _dec(rep, i, j)
      if w is not None:
        delta = delta + ((_target(acts[i], table) - acts[i]) @ w).astype(out.dtype)
    hook = _frozen_hook(rep, j, out, delta, t[input_labels[j]].out, input_labels[j])
    rules.append(jl.when(jl.module(f"blocks_{j}/mlp_out"), jl.hook(hook)))
  return _joined(rules), t


def _joined(rules):
  return jl.Spec(tuple(rule for spec in rules for rule in spec.rules))


def _activations(transcoders, rep, values, input_labels, apply_activation_function, zero_bos):
  pre = _pre_fns(transcoders)
  out = []
  for i, label in enumerate(input_labels):
    x = values[label][0]
    a = rep.encoders[i](x) if apply_activation_function else pre[i](x)
    out.append(a.at[0].set(0) if zero_bos else a)
  return jnp.stack(out)


def feature_intervention(
  model,
  variables,
  tokens,
  transcoders,
  interventions,
  *,
  constrained_layers=None,
  freeze_attention: bool = True,
  apply_activation_function: bool = True,
  zero_bos: bool = False,
  mlps: str = "model",
  freeze_norms: bool = False,
) -> Intervened:
  """Runs ``model`` on ``tokens`` with ``interventions`` on transcoder features
  (circuit-tracer's ``ReplacementModel.feature_intervention``).

  The edit is :func:`intervention_spec`'s spec on the live door. With
  ``constrained_layers=range(n_layers)`` the run is the local replacement model's, where the
  change of a logit (or of a later feature's pre-activation) is the graph's edge times the
  feature's change. With ``mlps="linear", freeze_norms=True`` (and ``freeze_attention``) it
  is the graph's linearisation, where the change of a logit is the graph's total effect
  along every path through the other features.

  Args:
    model, variables, tokens, transcoders, interventions, constrained_layers,
      freeze_attention, zero_bos, mlps, freeze_norms: as :func:`intervention_spec`.
    apply_activation_function: the returned activations after the transcoders' activation
      function (``False``: pre-activations, what a graph's edges predict).

  Returns:
    An :class:`Intervened`.

  Raises:
    CircuitError: as :func:`intervention_spec`.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from jaxlens import circuits, sae
    >>> from jaxlens.models import Llama, LlamaConfig
    >>> config = LlamaConfig(vocab_size=29, d_model=8, n_layers=1, n_heads=2, n_kv_heads=2, d_mlp=12)
    >>> model = Llama(config)
    >>> tokens = jnp.asarray([1, 4, 9], jnp.int32)
    >>> variables = model.init(jax.random.key(0), tokens[None])
    >>> tcs = [sae.Transcoder.init(jax.random.key(1), d_in=8, d_sae=16)]
    >>> out = circuits.feature_intervention(model, variables, tokens, tcs, [(0, 2, 5, 3.0)])
    >>> out.logits.shape, out.activations.shape
    ((3, 29), (1, 3, 16))
  """
  toks = _check_tokens(model, tokens)
  rep = replacement(model, transcoders)
  d_sae = int(rep.W_enc[0].shape[-1])
  items = _check(interventions, rep, d_sae, _without_transcoder(transcoders))
  layers = _layers(constrained_layers, rep.n_layers)
  _check_mlps(mlps, layers)
  tables = _tables(items, int(toks.shape[0]), d_sae, jnp.result_type(rep.W_dec[0]))
  if _hashable(model):
    program = functools.partial(_intervened, model)
  else:  # programs of this call only: the model is a constant of them
    static = (
      "layers",
      "freeze_attention",
      "zero_bos",
      "apply_activation_function",
      "mlps",
      "freeze_norms",
    )
    program = jax.jit(functools.partial(_intervened.__wrapped__, model), static_argnames=static)
  logits, acts = program(
    variables,
    toks,
    rep.source,
    tables,
    layers=None if layers is None else tuple(layers),
    freeze_attention=bool(freeze_attention),
    zero_bos=bool(zero_bos),
    apply_activation_function=bool(apply_activation_function),
    mlps=mlps,
    freeze_norms=bool(freeze_norms),
  )

  def spec():
    args = (layers, bool(freeze_attention), bool(zero_bos), False, None, mlps, bool(freeze_norms))
    return _spec_of_tables(model, variables, toks, rep, tables, *args)[0]

  return Intervened(logits, acts, spec)


@functools.partial(
  jax.jit,
  static_argnames=(
    "model",
    "layers",
    "freeze_attention",
    "zero_bos",
    "apply_activation_function",
    "mlps",
    "freeze_norms",
  ),
)
def _intervened(
  model,
  variables,
  toks,
  transcoders,
  tables,
  *,
  layers,
  freeze_attention,
  zero_bos,
  apply_activation_function,
  mlps,
  freeze_norms,
):
  # One program per model, shapes, intervened layers and options: the weights, prompt,
  # transcoders and intervention values are arguments, so another prompt of the same length
  # or other values reuse it.
  TRACES["feature_intervention"] += 1
  rep = replacement(model, transcoders)
  layers = None if layers is None else list(layers)
  rules, t = _spec_of_tables(
    model,
    variables,
    toks,
    rep,
    tables,
    layers,
    freeze_attention,
    zero_bos,
    False,
    None,
    mlps,
    freeze_norms,
  )
  input_labels = [_input_label(set(t.labels), i) for i in range(rep.n_layers)]
  run = jl.trace(
    model,
    variables,
    toks[None],
    intervene=rules if rules.rules else None,
    save=[jl.module(lbl) for lbl in input_labels],
  )
  values = {lbl: run[lbl].out for lbl in input_labels}
  acts = _activations(transcoders, rep, values, input_labels, apply_activation_function, zero_bos)
  return run.output[0], acts


def feature_intervention_generate(
  model,
  variables,
  tokens,
  transcoders,
  interventions,
  max_new_tokens: int = 16,
  *,
  constrained_layers=None,
  freeze_attention: bool = True,
  zero_bos: bool = False,
  **generate_kwargs,
):
  """Generates from ``tokens`` with ``interventions`` held, through :func:`jaxlens.generate`'s
  KV cache (circuit-tracer's ``feature_intervention_generate``).

  The prefill (the prompt) runs :func:`intervention_spec`'s spec (its attention, norms and
  MLP outputs held as asked); every decode step runs the open-ended interventions
  (``position=slice(k, None)``) on its new token, with nothing held, as circuit-tracer does.

  Args:
    model, variables, tokens, transcoders, interventions, constrained_layers,
      freeze_attention, zero_bos: as :func:`intervention_spec`.
    max_new_tokens: tokens to generate.
    **generate_kwargs: passed to :func:`jaxlens.generate` (``temperature``, ``save``...).

  Returns:
    :func:`jaxlens.generate`'s ``Generation`` (``tokens``, ``logits`` that chose them).

  Raises:
    CircuitError: as :func:`intervention_spec`.
  """
  toks = _check_tokens(model, tokens)
  rep = replacement(model, transcoders)  # the arguments checked before the generation runs
  _check(interventions, rep, int(rep.W_enc[0].shape[-1]), _without_transcoder(transcoders))
  _layers(constrained_layers, rep.n_layers)
  for key in ("intervene", "prefill", "decode", "prompt"):
    if key in generate_kwargs:
      raise CircuitError(
        f"feature_intervention_generate makes its own {key}= spec",
        code="invalid_argument",
        received=key,
        fix="jl.generate(..., prefill=circuits.intervention_spec(...)) to combine specs",
      )
  common = dict(zero_bos=zero_bos)
  patterns = None
  if freeze_attention or constrained_layers is not None:
    # The prefill's attention runs over the cache, laid out as the model lays it out (Gemma's
    # keeps the prompt at an offset): its patterns are recorded from a generation's prefill.
    kw = {k: v for k, v in generate_kwargs.items() if k != "save"}
    pattern = jl.module("blocks_*/attn/pattern")
    patterns = jl.generate(model, variables, toks[None], max_new_tokens, save=pattern, **kw).prefill
  prefill, _ = _spec(
    model,
    variables,
    toks,
    transcoders,
    interventions,
    constrained_layers=constrained_layers,
    freeze_attention=freeze_attention,
    open_ended=False,
    patterns=patterns,
    **common,
  )
  decode, _ = _spec(
    model,
    variables,
    toks,
    transcoders,
    interventions,
    constrained_layers=None,
    freeze_attention=False,
    open_ended=True,
    **common,
  )
  return jl.generate(
    model,
    variables,
    toks[None],
    max_new_tokens,
    prefill=prefill if prefill.rules else None,
    decode=decode if decode.rules else None,
    **generate_kwargs,
  )
