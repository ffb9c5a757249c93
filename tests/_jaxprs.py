"""Walking a jaxpr for the tests that check what a program contains."""

import jax


def equations(jaxpr):
  """Every equation of ``jaxpr`` and of the jaxprs nested in its equations' parameters
  (jit, scan, cond, custom_vjp ...), outer ones first."""
  for eqn in jaxpr.eqns:
    yield eqn
    for sub in jax.core.jaxprs_in_params(eqn.params):
      yield from equations(sub)
