"""Processes of the multi-process saved-spec race (tests/test_spec_files.py).

Spawned (not forked: jax refuses to run in a forked child), so this module is
imported fresh in each process; it imports jaxlens only inside the workers.
"""

import os
import time


def spec(k):
  import jax.numpy as jnp

  import jaxlens as jl

  site = jl.module("layers_0")
  return jl.when(site, jl.scale(float(k))) + jl.when(site, jl.add(jnp.full((4,), float(k))))


def _setup():
  os.environ["JAX_PLATFORMS"] = "cpu"
  import jax

  jax.config.update("jax_enable_x64", True)  # as the test process (tests/conftest.py)
  import jaxlens  # noqa: F401 (imported before the barrier, so every process starts at once)


def writer(path, k, barrier, seconds, queue):
  """Saves spec k to ``path`` until the time is up; reports every exception it saw."""
  _setup()
  the_spec = spec(k)
  barrier.wait()
  stop, saves, errors = time.monotonic() + seconds, 0, []
  while time.monotonic() < stop:
    try:
      the_spec.save(path)
      saves += 1
    except Exception as error:  # noqa: BLE001 (reported to the test, which asserts none)
      errors.append(f"{type(error).__module__}.{type(error).__name__}: {error}")
  queue.put(("writer", saves, errors))


def reader(path, ks, barrier, seconds, queue):
  """Loads ``path`` until the time is up; each load must be one of the specs ``ks``."""
  _setup()
  import jaxlens as jl

  wanted = {repr(spec(k)) for k in ks}
  barrier.wait()
  stop, loads, errors = time.monotonic() + seconds, 0, []
  while time.monotonic() < stop:
    try:
      got = repr(jl.load_spec(path))
      loads += 1
      if got not in wanted:
        errors.append(f"loaded a spec no writer saved: {got}")
    except Exception as error:  # noqa: BLE001
      errors.append(f"{type(error).__module__}.{type(error).__name__}: {error}")
  queue.put(("reader", loads, errors))
