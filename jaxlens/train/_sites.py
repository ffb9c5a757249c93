"""Several interventions in one step: sites, sources, tied weights, per-example positions.

An :class:`At` places one method at one site: which parameters it uses (a name: two
``At`` naming the same parameters share, or *tie*, them, as one pyvene intervention object
given to several representations does), which source run it reads, and where along the
sequence it writes (all positions, fixed ones, or each example's own, as pyreft's first
and last prompt tokens). :func:`train_multi` trains every placement in one jitted step:
interchange intervention training on ``label`` (a batch with ``sources``) or ReFT on
answer tokens (a batch from :func:`reft_batch`).
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxlens import intervention as ji
from jaxlens.core import InvalidArgumentError, trace, when
from jaxlens.internal import ByIdentity, as_selector
from jaxlens.train import _cache, _loops
from jaxlens.train._loops import last_position


@dataclasses.dataclass(frozen=True)
class At:
  """One method at one site.

  Attributes:
    site: the site (a selector or label).
    method: a method of :mod:`jaxlens.train` (``DAS(2)``, ``LoReFT(4)``, ...).
    params: the name of its parameters in the params dict: placements that name the same
      parameters share them (tied weights; their gradients add up).
    source: which of the batch's ``sources`` the interchange reads (an index).
    positions: where along axis 1 it writes: None (every position), a sequence of ints
      (:func:`jaxlens.at_positions`), or a name: the batch's ``positions[name]``, a
      ``(batch, n)`` int array of each example's positions (``-1`` for none:
      :func:`reft_positions`).
  """

  site: Any
  method: Any
  params: str = "main"
  source: int = 0
  positions: Any = None

  def __post_init__(self):
    if not isinstance(self.params, str):
      raise InvalidArgumentError(
        f"At: params must be a name (str), got {self.params!r}",
        code="invalid_argument",
        fix='At(site, method, params="shared")',
      )
    if isinstance(self.source, bool) or not isinstance(self.source, (int, np.integer)):
      raise InvalidArgumentError(
        f"At: source must be an index into the batch's sources, got {self.source!r}",
        code="invalid_argument",
        fix="At(site, method, source=1)",
      )


def example_positions(positions, edit):
  """``edit`` written at each example's own positions along axis 1 (a ``(batch, n)`` int
  array; entries outside ``[0, seq)``, such as ``-1``, write nothing)."""

  def fn(x, *, hook):
    pos = jnp.asarray(positions)
    if pos.ndim != 2 or pos.shape[0] != x.shape[0] or x.ndim < 2:
      raise InvalidArgumentError(
        f"per-example positions of shape {pos.shape} for a site of shape {x.shape}",
        code="shape_mismatch",
        site=hook.label,
        expected=f"(batch={x.shape[0]}, n)",
        received=str(pos.shape),
        fix="positions from reft_positions(prompt_lengths, ...)",
      )
    seq = jnp.arange(x.shape[1], dtype=pos.dtype)
    mask = jnp.any(seq[None, :, None] == pos[:, None, :], axis=-1)
    mask = mask.reshape(mask.shape + (1,) * (x.ndim - 2))
    return jnp.where(mask, edit(x, hook), x)

  return ji.hook(fn)


def _check_ats(ats, params):
  if isinstance(ats, At):
    ats = [ats]
  if not isinstance(ats, Sequence) or not ats or not all(isinstance(a, At) for a in ats):
    raise InvalidArgumentError(
      "ats must be a non-empty sequence of jaxlens.train.At",
      code="invalid_argument",
      fix="[At(site_a, DAS(2), params='r'), At(site_b, DAS(2), params='r', source=1)]",
    )
  missing = sorted({a.params for a in ats} - set(params))
  if missing:
    raise InvalidArgumentError(
      f"the placements name parameters {missing} that params does not hold",
      code="invalid_argument",
      expected=sorted({a.params for a in ats}),
      received=sorted(params),
      fix="params={name: method.init(key, d), ...}",
    )
  return list(ats)


def _per_name(value, name):
  """A batch field given per placement name (a dict) or for every placement."""
  if isinstance(value, dict):
    return value.get(name)
  return value


def _distinct_sites(ats):
  """The placements' distinct sites (selectors) and each placement's index among them."""
  sites, keys, index = [], [], []
  for a in ats:
    selector = as_selector(a.site)
    key = repr(selector)
    if key not in keys:
      keys.append(key)
      sites.append(selector)
    index.append(keys.index(key))
  return sites, index


def _cached_sources(ats, index):
  """``[(source i, [site indices its interchange placements read]), ...]``."""
  out: dict[int, list[int]] = {}
  for a, j in zip(ats, index):
    if a.method.needs_source and j not in out.setdefault(int(a.source), []):
      out[int(a.source)].append(j)
  return sorted(out.items())


def multi_output(model, variables, ats, params, batch, *, temperatures=None, site_values=None):
  """The model's output on ``batch["base"]`` with every placement live.

  Args:
    model: an unbound Flax linen module.
    variables: its variables.
    ats: the placements (:class:`At`).
    params: ``{name: parameters}``.
    batch: ``{"base", "sources" (a sequence of inputs, or "source" for one), "subspaces"
      (optional: a mask for every placement, or ``{params name: mask}``), "positions"
      (the named per-example positions)}``.
    temperatures: ``{params name: temperature}`` for methods with a schedule.
    site_values: the cached site values ``train_multi(cache_prefix=True)`` captures (the
      site that runs first on the base, replaced whole; each source's value at the sites
      its placements read, so no source run is made).
  """
  ats = _check_ats(ats, params)
  sites, index = _distinct_sites(ats)
  sources = batch.get("sources")
  if sources is None and "source" in batch:
    sources = [batch["source"]]
  donors = {}
  for i in sorted({a.source for a in ats if a.method.needs_source}):
    if site_values is not None and str(i) in site_values["sources"]:
      donors[i] = site_values["sources"][str(i)]
      continue
    if sources is None or not 0 <= i < len(sources):
      raise InvalidArgumentError(
        f"a placement reads source {i}; the batch holds "
        f"{0 if sources is None else len(sources)} sources",
        code="invalid_argument",
        fix='batch["sources"] = [source_0, source_1, ...]',
      )
    saved = [as_selector(a.site) for a in ats if a.method.needs_source and a.source == i]
    donors[i] = trace(model, variables, sources[i], save=saved, keep_inputs=False)
  spec = None
  if site_values is not None:  # the first site's cached value on the base, replaced whole
    ((first, value),) = site_values["base"].items()
    spec = when(sites[int(first)], ji.replace_with(value))
  for a, j in zip(ats, index):
    kwargs = {}
    sub = _per_name(batch.get("subspaces"), a.params)
    if sub is not None:
      if "subspaces" not in inspect.signature(a.method.edit).parameters:
        raise InvalidArgumentError(
          f"{type(a.method).__name__} (parameters {a.params!r}) takes no per-example subspaces",
          code="invalid_argument",
          fix="give subspaces per parameter name: {name: mask} for the methods that take them",
        )
      kwargs["subspaces"] = sub
    t = None if temperatures is None else temperatures.get(a.params)
    if a.method.needs_source:
      donor = donors[a.source]
      donor = donor[str(j)] if isinstance(donor, dict) else donor
      edit = a.method.edit(params[a.params], donor, t, **kwargs)
    else:
      edit = a.method.edit(params[a.params], None, t, **kwargs)
    if isinstance(a.positions, str):
      named = batch.get("positions") or {}
      if a.positions not in named:
        raise InvalidArgumentError(
          f"a placement writes at positions {a.positions!r}, which the batch's positions "
          f"do not hold ({sorted(named)})",
          code="invalid_argument",
          fix=f'batch["positions"] = {{"{a.positions}": (batch, n) int array}}',
        )
      edit = example_positions(named[a.positions], edit)
    elif a.positions is not None:
      edit = ji.at_positions(a.positions, edit)
    rule = when(a.site, edit)
    spec = rule if spec is None else spec + rule
  return spec.bind(model)(variables, batch["base"])


def _temperatures(ats, step, steps):
  out = {}
  for a in ats:
    schedule = getattr(a.method, "temperature", None)
    if callable(schedule):
      out[a.params] = schedule(jnp.asarray(step, float), steps or 1)
  return out


def train_multi(
  model,
  variables,
  ats,
  params: dict,
  batches: Sequence[dict] | Callable[[int], dict],
  *,
  steps: int | None = None,
  optimizer=None,
  readout: Callable = last_position,
  frozen: bool = True,
  mesh=None,
  data_axis: str = "data",
  checkpoint=None,
  checkpoint_every: int = 50,
  progress: bool = True,
  nonfinite: str = "raise",
  cache_prefix: bool = False,
):
  """Trains every placement together: several sites, sources and tied weights in one step.

  A batch holding ``label`` trains by interchange (the cross-entropy of
  ``readout(output)`` against it, as :func:`train_iit`); one holding ``targets`` and
  ``weights`` (:func:`reft_batch`) trains ReFT on the answer tokens (as
  :func:`train_reft`), its ``tokens`` the base.

  Args:
    model, variables: the model (unbound linen) and its variables.
    ats: the placements (:class:`At`).
    params: ``{name: the method's parameters}``; each name trained once, whatever number
      of placements use it.
    batches: a sequence of batches (cycled) or a function of the step.
    steps, optimizer, readout, frozen, mesh, data_axis, checkpoint, checkpoint_every,
      progress, nonfinite: as :func:`train_iit` (default optimiser ``optax.adam(1e-3)``).
    cache_prefix: capture, once per batch before the first step, the base's value at the
      placements' site that runs first and each source's value at the sites its placements
      read; each step then replaces that first site whole with its cached value and
      applies every edit on top, with no source run (as :func:`train_iit`'s
      ``cache_prefix``: the same losses and parameters, to rounding; the prefix before the
      first site is dead code in the step's program). Needs ``frozen=True`` and a sequence
      of batches.

  Returns:
    a :class:`TrainResult` whose ``params`` is the dict of named parameters.

  Raises:
    InvalidArgumentError: ``prefix_not_cacheable`` (``cache_prefix=True`` with
      ``frozen=False``, batches given as a function of the step, a model that draws random
      numbers or writes a collection, a placement's site that fires several times per call
      or inside a scanned stack); the errors of :func:`train_iit`.
  """
  ats = _check_ats(ats, params)
  try:
    first = _loops._batch_at(batches, 0)
  except (TypeError, IndexError, KeyError, ZeroDivisionError):
    first = None  # refused by the check below, with the keys it needs
  reft = isinstance(first, dict) and "targets" in first
  keys = ("tokens", "targets", "weights") if reft else ("base", "label")
  _loops._check_batches(batches, keys)
  optimizer = _loops._default_optimizer(1e-3) if optimizer is None else optimizer
  steps_total = steps if steps is not None else (None if callable(batches) else len(batches))
  if cache_prefix:
    _cache.check_cacheable(frozen, batches)
    sites, index = _distinct_sites(ats)
    sources = _cached_sources(ats, index)
    base_key = "tokens" if reft else "base"
    batches = _cache.multi_batches(model, variables, sites, sources, batches, base_key)

  def loss_of(p, v, batch, step):
    temps = _temperatures(ats, step, steps_total)
    cached = {"site_values": batch.get(_cache.CACHE_KEY)}
    if reft:
      base = {**batch, "base": batch["tokens"]}
      out = multi_output(model, v, ats, p, base, temperatures=temps, **cached)
      ce = _loops._cross_entropy(out, batch["targets"])
      w = batch["weights"].astype(ce.dtype)
      return jnp.sum(ce * w) / jnp.maximum(jnp.sum(w), 1.0)
    out = multi_output(model, v, ats, p, batch, temperatures=temps, **cached)
    return jnp.mean(_loops._cross_entropy(readout(out), batch["label"]))

  return _loops._loop(
    loss_of,
    params,
    variables,
    batches,
    steps=steps,
    optimizer=optimizer,
    frozen=frozen,
    mesh=mesh,
    data_axis=data_axis,
    checkpoint=checkpoint,
    checkpoint_every=checkpoint_every,
    progress=progress,
    desc=f"{len(ats)} placements",
    nonfinite=nonfinite,
    # What loss_of closes over: the step keeps its program for a later call (_loops._program).
    key=(
      "multi",
      ByIdentity(model),
      _loops._key_part(ats),
      _loops._key_part(readout),
      reft,
      steps_total,
    ),
  )


def iia_multi(model, variables, ats, params, batches, *, readout=last_position, temperatures=None):
  """Interchange intervention accuracy with every placement live (as :func:`iia`)."""

  def hits_of(p, v, batch):
    out = multi_output(model, v, ats, p, batch, temperatures=temperatures)
    guess = jnp.argmax(readout(out), axis=-1)
    return jnp.sum(guess == jnp.asarray(batch["label"]).astype(guess.dtype)), guess.size

  # One program per configuration, as iia's (_loops._program).
  key = (
    "iia_multi",
    ByIdentity(model),
    _loops._key_part(ats),
    _loops._key_part(readout),
    _loops._key_part(temperatures),
  )
  hits = _loops._program(key, lambda: jax.jit(hits_of))

  if isinstance(batches, dict):
    batches = [batches]
  right = total = 0
  for batch in batches:
    h, n = hits(params, variables, batch)
    right += int(h)
    total += int(n)
  return _loops._accuracy(right, total, "iia_multi")


# --------------------------------------------------------------------------
# pyreft's position sets.


def parse_positions(positions: str) -> tuple[int, int]:
  """pyreft's position string: ``"f3"``, ``"l2"`` or ``"f3+l2"`` as ``(first_n, last_n)``."""
  text = positions.strip() if isinstance(positions, str) else None
  first = last = 0
  ok = bool(text)
  for part in (text or "").split("+"):
    part = part.strip()
    if len(part) < 2 or part[0] not in "fl" or not part[1:].isdigit():
      ok = False
      break
    if part[0] == "f":
      first = int(part[1:])
    else:
      last = int(part[1:])
  if not ok:
    raise InvalidArgumentError(
      f"positions must be pyreft's 'f<n>', 'l<n>' or 'f<n>+l<n>', got {positions!r}",
      code="invalid_argument",
      fix='positions="f1+l1"',
    )
  return first, last


def reft_positions(prompt_lengths, positions: str = "f1+l1", share_weights: bool = False):
  """The first ``n`` and last ``m`` prompt tokens of each example, as pyreft chooses them.

  As pyreft's ``get_intervention_locations``: each set takes at most half the prompt
  (``min(len // 2, n)``); what is missing is padded to pyreft's widths, here with ``-1``
  (no position; pyreft points the padding at a pad token its attention mask hides, which
  writes nothing the model reads either).

  Args:
    prompt_lengths: each example's prompt length.
    positions: ``"f<n>"``, ``"l<m>"`` or ``"f<n>+l<m>"``.
    share_weights: one set for one intervention (``{"all": ...}``) or, with both first
      and last, one set each for two interventions (``{"first": ..., "last": ...}``).

  Returns:
    ``{name: (batch, n) int32 array}`` for :class:`At`'s ``positions=name``.

  Example:
    >>> from jaxlens import train as jt
    >>> {k: v.tolist() for k, v in jt.reft_positions([6, 3], "f2+l2").items()}
    {'first': [[0, 1], [0, -1]], 'last': [[4, 5], [2, -1]]}
  """
  first_n, last_n = parse_positions(positions)
  rows = {"all": []} if share_weights or not (first_n and last_n) else {"first": [], "last": []}
  for length in np.asarray(prompt_lengths, dtype=np.int64).reshape(-1).tolist():
    f, l_ = min(length // 2, first_n), min(length // 2, last_n)
    head = list(range(f)) + [-1] * (first_n - f)
    tail = list(range(length - l_, length)) + [-1] * (last_n - l_)
    if "all" in rows:
      rows["all"].append(head[:f] + tail[:l_] + [-1] * (first_n - f + last_n - l_))
    else:  # both padded to one width, as pyreft pads them
      width = max(first_n, last_n)
      rows["first"].append(head + [-1] * (width - first_n))
      rows["last"].append(tail + [-1] * (width - last_n))
  return {k: np.asarray(v, np.int32).reshape(len(v), -1) for k, v in rows.items()}


def reft_batch(pairs, positions: str = "f1+l1", share_weights: bool = False, pad_token: int = 0):
  """:func:`answer_batch` of ``(prompt, answer)`` pairs with pyreft's positions
  (:func:`reft_positions`) under ``"positions"``: a batch for :func:`train_multi`."""
  _loops._check_pairs(pairs)
  out = _loops.answer_batch(pairs, pad_token)
  out["positions"] = reft_positions([len(p) for p, _ in pairs], positions, share_weights)
  return out
