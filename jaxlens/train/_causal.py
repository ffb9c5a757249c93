"""A small causal model: variables, parents, functions; factual and counterfactual data.

:class:`CausalModel` is the high-level model a network is hypothesised to implement (as
``pyvene.CausalModel``): each variable has its possible values, its parents and a function
of the parents' values (an input has no parents). It runs forward under interventions,
runs interchanges (a variable set to the value it takes on a source input), and generates
the examples interchange intervention training needs, with their counterfactual labels,
so labels are never written by hand.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

import numpy as np

from jaxlens.core import InvalidArgumentError


def _fail(msg, fix, **fields):
  raise InvalidArgumentError(msg, code="invalid_argument", fix=fix, **fields)


class CausalModel:
  """Variables with values, parents and functions, run in topological order.

  Args:
    values: ``{variable: the list of its possible values}``.
    parents: ``{variable: the list of its parents}`` (``[]`` for an input).
    functions: ``{variable: f(*parent values)}``; inputs need none.

  Attributes:
    variables: every variable, parents before children.
    inputs: the variables without parents.
    outputs: the variables that are no variable's parent.

  Raises:
    InvalidArgumentError: ``invalid_argument``: a parent that is not a variable, a
      cycle, a non-input without a function, a variable without values.

  Example:
    >>> from jaxlens import train as jt
    >>> m = jt.CausalModel(
    ...   values={"a": [0, 1], "b": [0, 1], "and": [0, 1]},
    ...   parents={"a": [], "b": [], "and": ["a", "b"]},
    ...   functions={"and": lambda a, b: a & b},
    ... )
    >>> m.run({"a": 1, "b": 1})["and"]
    1
    >>> m.interchange({"a": 1, "b": 0}, {"b": {"a": 0, "b": 1}})["and"]  # b from the source
    1
  """

  def __init__(
    self,
    values: Mapping[str, Sequence],
    parents: Mapping[str, Sequence[str]],
    functions: Mapping[str, Callable],
  ):
    self.values = {k: list(v) for k, v in values.items()}
    self.parents = {k: list(parents.get(k, ())) for k in self.values}
    self.functions = dict(functions)
    extra = sorted(set(parents) - set(self.values))
    if extra:
      _fail(
        f"parents names variables without values: {extra}",
        "give every variable its values",
        received=extra,
      )
    for var, vals in self.values.items():
      if not vals:
        _fail(f"variable {var!r} has no values", f'values["{var}"] = [...]')
      unknown = [p for p in self.parents[var] if p not in self.values]
      if unknown:
        _fail(
          f"variable {var!r} has parents {unknown} that are not variables",
          "parents among the variables",
          candidates=sorted(self.values),
        )
      if self.parents[var] and not callable(self.functions.get(var)):
        _fail(
          f"variable {var!r} has parents but no function",
          f'functions["{var}"] = lambda {", ".join(self.parents[var])}: ...',
        )
    self.variables = self._order()
    self.inputs = [v for v in self.variables if not self.parents[v]]
    used = {p for ps in self.parents.values() for p in ps}
    self.outputs = [v for v in self.variables if v not in used]

  def _order(self):
    order, done, visiting = [], set(), set()

    def visit(v, path):
      if v in done:
        return
      if v in visiting:
        _fail(
          f"the parents form a cycle: {' -> '.join(path + [v])}",
          "a causal model is acyclic",
        )
      visiting.add(v)
      for p in self.parents[v]:
        visit(p, path + [v])
      visiting.discard(v)
      done.add(v)
      order.append(v)

    for v in sorted(self.values):
      visit(v, [])
    return order

  def run(self, inputs: Mapping[str, Any], interventions: Mapping[str, Any] | None = None):
    """Every variable's value on ``inputs``, with ``interventions`` (``{variable: value}``)
    held fixed (pyvene's ``run_forward(intervention)`` with the inputs in it)."""
    missing = [v for v in self.inputs if v not in inputs and v not in (interventions or {})]
    if missing:
      _fail(f"run needs the inputs {missing}", "run({input: value, ...})", expected=self.inputs)
    setting = {}
    for v in self.variables:
      if interventions is not None and v in interventions:
        setting[v] = interventions[v]
      elif not self.parents[v]:
        setting[v] = inputs[v]
      else:
        setting[v] = self.functions[v](*(setting[p] for p in self.parents[v]))
    return setting

  def interchange(self, base: Mapping[str, Any], sources: Mapping[str, Mapping[str, Any]]):
    """The setting on ``base`` with each variable of ``sources`` set to the value it takes
    on its source input (pyvene's ``run_interchange``): the counterfactual label."""
    unknown = [v for v in sources if v not in self.values]
    if unknown:
      _fail(f"interchange of unknown variables {unknown}", "variables of the model")
    held = {v: self.run(src)[v] for v, src in sources.items()}
    return self.run(base, held)

  def sample_input(self, rng: np.random.Generator, where: Callable | None = None):
    """A random input setting (each input uniform over its values); with ``where``, one
    whose full setting satisfies ``where(setting)`` (by rejection)."""
    for _ in range(10_000):
      inputs = {v: self.values[v][rng.integers(len(self.values[v]))] for v in self.inputs}
      if where is None or where(self.run(inputs)):
        return inputs
    _fail("no sampled input satisfied the condition in 10,000 tries", "a looser condition")

  def factual(self, n: int, *, seed: int = 0, encode: Callable | None = None, output=None):
    """``n`` sampled inputs and their outputs: ``{"inputs", "settings", "base", "label"}``.

    ``base`` is ``[encode(inputs) for each]`` stacked (when ``encode`` is given) and
    ``label`` the values of ``output`` (default the model's one output) as indices into
    its values.
    """
    rng = np.random.default_rng(seed)
    out = self._output(output)
    inputs = [self.sample_input(rng) for _ in range(n)]
    settings = [self.run(i) for i in inputs]
    batch = {
      "inputs": inputs,
      "settings": settings,
      "label": np.asarray([self.values[out].index(s[out]) for s in settings], np.int32),
    }
    if encode is not None:
      batch["base"] = np.stack([np.asarray(encode(i)) for i in inputs])
    return batch

  def counterfactual(
    self,
    n: int,
    variables: str | Sequence[str],
    *,
    seed: int = 0,
    encode: Callable | None = None,
    output=None,
    where: Callable | None = None,
  ):
    """``n`` interchange examples for ``variables``, with their counterfactual labels.

    Each example has a base input and, per variable, a source input; its ``label`` is the
    output when each variable takes its value on its source (:meth:`interchange`), as
    an index into the output's values; ``base_label`` is the output on the base alone.

    Args:
      n: the number of examples.
      variables: the interchanged variable (a name), or several (one source each).
      seed: the sampling seed.
      encode: maps an input setting to the network's input array (``base`` and the
        sources are then stacked arrays, ready for :func:`train_iit` (one variable:
        ``source``) or :func:`train_multi` (``sources``, in ``variables``' order).
      output: the output variable (default the model's one output).
      where: keep only examples whose counterfactual setting satisfies it.

    Returns:
      ``{"base", "source" or "sources", "label", "base_label", "inputs", "source_inputs"}``.
    """
    one = isinstance(variables, str)
    names = [variables] if one else list(variables)
    unknown = [v for v in names if v not in self.values]
    if unknown or not names:
      _fail(
        f"counterfactual: unknown variables {unknown}" if unknown else "no variable",
        "variables of the model",
        candidates=sorted(self.values),
      )
    out = self._output(output)
    rng = np.random.default_rng(seed)
    bases, sources, labels, base_labels = [], [], [], []
    tries = 0
    while len(bases) < n:
      tries += 1
      if tries > 100 * n + 10_000:
        _fail("the condition kept almost no example", "a looser where=")
      base = self.sample_input(rng)
      srcs = {v: self.sample_input(rng) for v in names}
      setting = self.interchange(base, srcs)
      if where is not None and not where(setting):
        continue
      bases.append(base)
      sources.append([srcs[v] for v in names])
      labels.append(self.values[out].index(setting[out]))
      base_labels.append(self.values[out].index(self.run(base)[out]))
    batch = {
      "inputs": bases,
      "source_inputs": sources,
      "label": np.asarray(labels, np.int32),
      "base_label": np.asarray(base_labels, np.int32),
    }
    if encode is not None:
      batch["base"] = np.stack([np.asarray(encode(b)) for b in bases])
      stacked = [np.stack([np.asarray(encode(s[i])) for s in sources]) for i in range(len(names))]
      if one:
        batch["source"] = stacked[0]
      else:
        batch["sources"] = stacked
    return batch

  def _output(self, output):
    if output is None:
      if len(self.outputs) != 1:
        _fail(
          f"the model has outputs {self.outputs}: name one",
          f'output="{self.outputs[0]}"',
          candidates=self.outputs,
        )
      return self.outputs[0]
    if output not in self.values:
      _fail(f"no variable {output!r}", "an output variable", candidates=self.outputs)
    return output

  def __repr__(self):
    edges = ", ".join(f"{p}->{v}" for v in self.variables for p in self.parents[v])
    return f"CausalModel({len(self.variables)} variables: {edges})"
