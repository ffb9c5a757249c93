"""Test environment: float64 on, several CPU devices, warnings as errors (pyproject)."""

import importlib.util
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402

jax.config.update("jax_enable_x64", True)

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
