"""jaxlens.train's methods refuse arguments that would fail deep in XLA or train silently
wrong (issue 48 item 10): a rank below 1, a Boundless DAS boundary outside (0, 1], a
temperature that is not positive."""

import pytest

import jaxlens.train as jt
from jaxlens.core import InvalidArgumentError


@pytest.mark.parametrize(
  "make, name",
  [
    (lambda: jt.LoReFT(-1), "rank"),
    (lambda: jt.DiReFT(0), "rank"),
    (lambda: jt.LowRankDAS(rank=2.5), "rank"),
    (lambda: jt.BoundlessDAS(boundary=0.0), "boundary"),
    (lambda: jt.BoundlessDAS(boundary=1.5), "boundary"),
    (lambda: jt.BoundlessDAS(temperature_end=0.0), "temperature_end"),
    (lambda: jt.BoundlessDAS(temperature_start=float("nan")), "temperature_start"),
  ],
)
def test_bad_method_arguments_are_typed_errors(make, name):
  with pytest.raises(InvalidArgumentError, match=r"\[invalid_argument\]") as info:
    make()
  assert name in str(info.value)


def test_the_edges_are_accepted():
  assert jt.BoundlessDAS(boundary=1.0, temperature_end=1e-3).boundary == 1.0
  assert jt.DiReFT(1).rank == jt.LoReFT(1).rank == 1
