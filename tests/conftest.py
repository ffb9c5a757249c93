"""Test environment: float64 on, several CPU devices, warnings as errors (pyproject)."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402

jax.config.update("jax_enable_x64", True)

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def spec_model():
  """The specification's float64 two-layer model: (model, variables, x, x_donor, source)."""
  from jaxlens._src import matrix
  return matrix.spec_model()
