"""The frozen prefix, run once per dataset: the site's values cached across training steps.

In DAS and ReFT training the model is frozen and nothing before the intervened site depends
on a trained parameter, so the site's value on each example (the base run's, and the source
run's for an interchange) is a constant of the dataset. ``cache_prefix=True`` on
:func:`jaxlens.train.train_iit` and :func:`jaxlens.train.train_reft` records those values
once, before the first step, with an ordinary capture (:func:`site_values`: ``jl.trace`` with
``save=site``); each step then *replaces* the whole site with the cached value
(``jl.replace_with``) and applies the trained edit on top. The step's output no longer
depends on the model's computation before the site, so under ``jax.jit`` JAX's dead-code
elimination drops it from the step's program, and the source run disappears entirely.

The cache is right only where the site's value is a constant of the example, which
:func:`check_cacheable` and the capture check (each refusal is ``prefix_not_cacheable``):
the model frozen (``frozen=True``), a fixed dataset (a sequence of batches, not a
function of the step), a model that draws no random numbers and writes no collection
(dropout, batch statistics), one firing of the site per call, outside a scanned stack, and,
for ReFT's shuffled batches, an example's value that does not depend on the other examples
of its batch (checked on the first batch). Whether it is *faster* depends on the site being
the whole input of what follows: at a residual-stream site (``blocks_k/resid_post``)
nothing before it stays live; at a branch (``attn_out``, ``mlp_out``) the residual add
still reads the prefix, which then stays in the program (the results are the same either
way).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxlens.core import InvalidArgumentError, trace
from jaxlens.internal import as_selector

# The key under which a batch carries its cached site values through the loop.
CACHE_KEY = "site_cache"


def _refuse(message: str, fix: str, **fields) -> InvalidArgumentError:
  return InvalidArgumentError(message, code="prefix_not_cacheable", fix=fix, **fields)


def check_cacheable(frozen: bool, batches) -> None:
  """``cache_prefix=True`` needs a frozen model and a fixed dataset."""
  if not frozen:
    raise _refuse(
      "cache_prefix=True with frozen=False: the model's parameters before the site train, so "
      "the site's value changes at every step",
      fix="frozen=True, or cache_prefix=False to co-train the model",
    )
  if callable(batches):
    raise _refuse(
      "cache_prefix=True needs a fixed dataset (a sequence of batches); a function of the "
      "step may give new examples at every step, whose site values no cache holds",
      fix="batches=[batch_0, batch_1, ...] (a list, cycled), or cache_prefix=False",
    )


def _capture(model, selector):
  """A jitted capture of the site's value (the variables an argument: XLA would fold them)."""
  capture = _capture_sites(model, [selector])
  return lambda variables, inputs: capture(variables, inputs)[0][0]


def _capture_sites(model, selectors):
  """A jitted capture of several sites' values: ``(values in the order of selectors, the
  order in which their sites ran)``. Each selector must select one site, outside a scanned
  stack, and the model must draw no random numbers."""

  @jax.jit
  def run(variables, inputs):
    return trace(model, variables, inputs, save=list(selectors), keep_inputs=False)

  flax_errors = _flax_errors()

  def capture(variables, inputs):
    try:
      t = run(variables, inputs)
    except flax_errors as e:
      raise _refuse(
        f"the model's forward draws random numbers or writes a collection (dropout, batch "
        f"statistics: {type(e).__name__}), so its site value is not a constant of the "
        "example",
        fix="a deterministic model (deterministic=True, use_running_average=True), or "
        "cache_prefix=False",
        site=str(selectors[0]),
      ) from e
    values, firsts = [], []
    for selector in selectors:
      hits = list(t.labels)
      if len(selectors) > 1:
        hits = [lbl for lbl in hits if t.infos.get(lbl) and selector.matches(t.infos[lbl])]
      if len(hits) != 1:
        raise _refuse(
          f"the site {selector!r} fires {len(hits)} times in one call ({hits}); "
          "the cache holds one value per example",
          fix="a selector of one site (jl.label(...)), or cache_prefix=False",
          site=str(selector),
        )
      info = t.infos.get(hits[0])
      if info is not None and (info.layers or info.layer is not None):
        raise _refuse(
          f"the site {hits[0]!r} is inside a scanned stack of layers; the cache holds one "
          "value per example, not one per layer",
          fix="an unscanned model, or cache_prefix=False",
          site=hits[0],
        )
      values.append(t[hits[0]].out)
      firsts.append(t.labels.index(hits[0]))
    return values, firsts

  return capture


def _flax_errors() -> tuple:
  import flax.errors

  return (
    flax.errors.InvalidRngError,
    flax.errors.ModifyScopeVariableError,
    flax.errors.ScopeCollectionNotFound,
  )


def site_values(model, variables, site, inputs) -> jax.Array:
  """The value of ``site`` when ``model`` runs on ``inputs``: what ``cache_prefix=True`` records.

  An ordinary capture (``jl.trace(model, variables, inputs, save=site)`` under ``jax.jit``),
  with the checks that make the value a constant of the example: the site fires once per
  call, outside a scanned stack, and the model draws no random numbers. Passed to
  :func:`jaxlens.train.intervened_output` as ``site_values=``, the values replace the site
  and its prefix drops out of a jitted program.

  Args:
    model: an unbound Flax linen module.
    variables: its variables.
    site: the site (a selector or label).
    inputs: the model's input.

  Returns:
    the site's value, an array.

  Raises:
    InvalidArgumentError: ``prefix_not_cacheable`` (the site fires several times, sits in a
      scanned stack, or the model draws random numbers or writes a collection).

  Example:
    >>> import jax, jax.numpy as jnp, flax.linen as nn
    >>> from jaxlens import train as jt
    >>> model = nn.Sequential([nn.Dense(4), jnp.tanh, nn.Dense(2)])
    >>> variables = model.init(jax.random.key(0), jnp.zeros((1, 3), jnp.float32))
    >>> jt.site_values(model, variables, "layers_0", jnp.ones((5, 3), jnp.float32)).shape
    (5, 4)
  """
  return _capture(model, as_selector(site))(variables, inputs)


def iit_batches(model, variables, site, batches, needs_source: bool) -> list:
  """``batches`` with their site values: each batch gains ``{CACHE_KEY: {"base", "source"}}``,
  captured once (one program per input shape)."""
  capture = _capture(model, as_selector(site))
  out = []
  for batch in batches:
    cache = {"base": capture(variables, batch["base"])}
    if needs_source:
      cache["source"] = capture(variables, batch["source"])
    out.append({**batch, CACHE_KEY: cache})
  return out


def reft_rows(model, variables, site, tokens, batch_size: int, first_rows) -> np.ndarray:
  """The site's value for every row of ``tokens``, captured in chunks of ``batch_size`` rows
  (the last one padded, so one program runs them all).

  ReFT's batches are drawn from the rows by a permutation per epoch, so the cache is per
  row: right when a row's value does not depend on the other rows of its batch. That is
  checked on ``first_rows`` (the first training batch's rows), captured as a batch of their
  own and compared with their cached values.
  """
  capture = _capture(model, as_selector(site))
  n = tokens.shape[0]
  chunks = []
  for start in range(0, n, batch_size):
    rows = np.arange(start, start + batch_size)
    value = capture(variables, tokens[np.minimum(rows, n - 1)])
    chunks.append(np.asarray(value)[: min(batch_size, n - start)])
  cache = np.concatenate(chunks, axis=0)
  together = np.asarray(capture(variables, tokens[first_rows]))
  alone = cache[first_rows]
  if jnp.issubdtype(together.dtype, jnp.inexact):
    eps = float(jnp.finfo(together.dtype).eps)
    scale = float(np.max(np.abs(alone))) if alone.size else 0.0
    same = np.allclose(together, alone, rtol=256 * eps, atol=256 * eps * scale)
  else:
    same = np.array_equal(together, alone)
  if not same:
    raise _refuse(
      "an example's site value depends on the other examples of its batch (the first "
      "batch's rows captured together differ from the same rows captured in other batches), "
      "so a per-example cache would change the training",
      fix="a model whose rows do not interact, or cache_prefix=False",
    )
  return cache


def multi_batches(model, variables, sites, sources, batches, base_key: str) -> list:
  """``batches`` with the site values :func:`jaxlens.train.multi_output` reads from its
  cache, captured once: under ``CACHE_KEY``, ``{"base": {"<j>": value}, "sources": {"<i>":
  {"<j>": value}}}``, ``j`` the index of a site in ``sites`` (distinct selectors) and ``i``
  a source's. The base holds only the site that runs first (every later site depends on
  the edit there), each source the sites its placements read."""
  capture_all = _capture_sites(model, sites)
  first = None
  out = []
  for batch in batches:
    if first is None:  # which site runs first: one capture of every site on the base
      _, order = capture_all(variables, batch[base_key])
      first = int(np.argmin(order))
      capture_base = _capture_sites(model, [sites[first]])
      capture_source = {i: _capture_sites(model, [sites[j] for j in js]) for i, js in sources}
    cache = {"base": {str(first): capture_base(variables, batch[base_key])[0][0]}, "sources": {}}
    given = batch.get("sources")
    if given is None and "source" in batch:
      given = [batch["source"]]
    for i, js in sources:
      if given is None or not 0 <= i < len(given):
        continue  # refused by multi_output, with the sources the batch holds
      values, _ = capture_source[i](variables, given[i])
      cache["sources"][str(i)] = {str(j): v for j, v in zip(js, values)}
    out.append({**batch, CACHE_KEY: cache})
  return out
