"""Test environment: float64 on, strict dtype promotion, several CPU devices, warnings as errors
(pyproject)."""

import importlib.util
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402

jax.config.update("jax_enable_x64", True)
# Strict promotion: an implicit mix of dtypes (a float32 array meeting a float64 one, an int meeting
# a float) raises instead of silently widening, so jaxlens works for users who turn it on. A test
# that needs a third-party library which mixes dtypes itself opts out with `standard_promotion`.
jax.config.update("jax_numpy_dtype_promotion", "strict")

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def matrix_weights():
  """Where the matrix model's weights come from: the specification's torch draws where torch
  is installed (so jaxlens's cells and the torch parity tests share one measurement), a
  ``jax.random`` draw otherwise."""
  if importlib.util.find_spec("torch") is None:
    from jaxlens import contract

    return contract.spec_model
  from torch_bridge import matrix

  return matrix.spec_model


@pytest.fixture(scope="session")
def spec_model(matrix_weights):
  """The specification's float64 two-layer model: (model, variables, x, x_donor, source)."""
  return matrix_weights()


@pytest.fixture
def standard_promotion():
  """Standard dtype promotion for one test, for a third-party library that mixes dtypes itself
  (the test says which and why)."""
  with jax.numpy_dtype_promotion("standard"):
    yield
