"""jaxlens's own frames are left out of the traceback of an error that reaches the user.

As JAX does for its own frames (``jax._src.traceback_util``): on by default, eagerly and
under ``jax.jit``, and ``jax_traceback_filtering="off"`` shows every frame.
"""

import contextlib
import traceback
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest

import jaxlens as jl
from jaxlens._src import tracebacks

PACKAGE = Path(jl.__file__).resolve().parent
THIS_FILE = str(Path(__file__).resolve())


class _Model(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.Dense(2, name="head", param_dtype=jnp.float64)(jnp.tanh(x))


@pytest.fixture(scope="module")
def setup():
  model, x = _Model(), jnp.ones((1, 3), jnp.float64)
  return model, model.init(jax.random.key(0), x), x


@contextlib.contextmanager
def _filtering(mode):
  before = jax.config.jax_traceback_filtering
  jax.config.update("jax_traceback_filtering", mode)
  try:
    yield
  finally:
    jax.config.update("jax_traceback_filtering", before)


def _frames(call, error=jl.JaxlensError):
  with pytest.raises(error) as info:
    call()
  return [str(Path(f.filename).resolve()) for f in traceback.extract_tb(info.value.__traceback__)]


def _internal(frames):
  return [f for f in frames if f.startswith(str(PACKAGE / "_src"))]


def _unmatched_site(setup):
  model, v, x = setup
  return jl.trace(model, v, x, intervene=jl.when(jl.module("nope"), jl.scale(2.0)))


CALLS = {
  # Raised in the door, several jaxlens frames below the user's call.
  "eager door": _unmatched_site,
  "under jax.jit": lambda setup: jax.jit(lambda v: _unmatched_site((setup[0], v, setup[2])))(
    setup[1]
  ),
  # Raised by the bound function a door returns, and by a verb's constructor.
  "bound function": lambda setup: jl.when(jl.module("nope"), jl.scale(2.0)).bind(setup[0])(
    setup[1], setup[2]
  ),
  "verb constructor": lambda setup: jl.clamp(),
}


@pytest.mark.parametrize("name", sorted(CALLS))
def test_typed_errors_show_no_internal_frame(setup, name):
  with _filtering("auto"):
    frames = _frames(lambda: CALLS[name](setup))
  assert THIS_FILE in frames, frames
  assert not _internal(frames), _internal(frames)


@pytest.mark.parametrize("name", ["eager door", "under jax.jit"])
def test_filtering_off_shows_every_frame(setup, name):
  with _filtering("off"):
    frames = _frames(lambda: CALLS[name](setup))
  assert THIS_FILE in frames
  assert _internal(frames), frames


def test_the_users_code_called_by_jaxlens_keeps_its_frame(setup):
  model, v, x = setup

  def broken_hook(y):
    raise RuntimeError("the user's bug")

  with _filtering("auto"):
    frames = _frames(
      lambda: jl.trace(model, v, x, intervene=jl.when(jl.module("head"), jl.hook(broken_hook))),
      RuntimeError,
    )
  assert not _internal(frames), _internal(frames)
  # The hook's own line (in this file) is among the frames, below the test's call.
  assert frames.count(THIS_FILE) >= 2, frames


def test_the_excluded_paths_are_the_library_not_models_or_commands():
  paths = {Path(p).name for p in tracebacks.excluded_paths()}
  assert {"_src", "intervention", "__init__.py", "store.py"} <= paths
  assert not paths & {"models", "__main__.py", "demo.py"}
