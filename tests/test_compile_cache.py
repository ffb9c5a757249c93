"""JAX's persistent compilation cache: on by default in a user directory, with a switch."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import pytest

import jaxlens as jl
from jaxlens._src import compile_cache as cc

ROOT = Path(__file__).resolve().parents[1]


def test_import_time_choice_respects_what_is_set():
  home = {"HOME": "/home/u"}
  assert cc.import_time_choice(home, None) == "/home/u/.cache/jaxlens/xla"
  assert cc.import_time_choice({**home, "XDG_CACHE_HOME": "/c"}, None) == "/c/jaxlens/xla"
  # An existing choice (environment or jax.config) is kept; the switch turns it off or moves it.
  assert cc.import_time_choice({**home, "JAX_COMPILATION_CACHE_DIR": "/j"}, None) is None
  assert cc.import_time_choice(home, "/already") is None
  for off in ("0", "off", "False", "no", ""):
    assert cc.import_time_choice({**home, cc.ENV: off}, None) is None
  assert cc.import_time_choice({**home, cc.ENV: "/mine"}, None) == "/mine"
  assert cc.import_time_choice({**home, cc.ENV: "/mine"}, "/already") is None
  assert str(cc.default_cache_dir(home, "darwin")) == "/home/u/Library/Caches/jaxlens/xla"
  win = cc.default_cache_dir({**home, "LOCALAPPDATA": "C:/L"}, "win32")
  assert win.as_posix() == "C:/L/jaxlens/xla"


def test_the_suite_keeps_its_own_cache_dir():
  # tests/conftest.py sets JAX_COMPILATION_CACHE_DIR for the run; import jaxlens kept it.
  assert jl.compilation_cache_dir() == os.environ["JAX_COMPILATION_CACHE_DIR"]


def test_set_compilation_cache_switches_and_refuses_a_non_path(tmp_path):
  before = jax.config.jax_compilation_cache_dir
  try:
    assert jl.set_compilation_cache(tmp_path / "c") == str(tmp_path / "c")
    assert jl.compilation_cache_dir() == str(tmp_path / "c")
    assert jl.set_compilation_cache(False) is None
    assert jl.compilation_cache_dir() is None
    with pytest.raises(jl.InvalidArgumentError, match="takes a directory"):
      jl.set_compilation_cache(3)
  finally:
    jl.set_compilation_cache(before or False)


def test_a_new_process_writes_then_reads_the_default_directory(tmp_path):
  """A fresh process with no cache configured writes compiled programs under
  $XDG_CACHE_HOME/jaxlens/xla and, its in-memory caches cleared (what a new process starts
  with), reads them back from there."""
  script = textwrap.dedent(
    """
    import jax, jax.numpy as jnp
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    import jaxlens as jl
    hits = []
    jax.monitoring.register_event_listener(
      lambda e, **k: hits.append(e) if e == "/jax/compilation_cache/cache_hits" else None)
    print(jl.compilation_cache_dir())
    x = jnp.ones(7)
    jax.jit(lambda x: jnp.tanh(x) * 3 + 1)(x).block_until_ready()
    print(len(hits))
    jax.clear_caches()
    jax.jit(lambda x: jnp.tanh(x) * 3 + 1)(x).block_until_ready()
    print(len(hits))
    """
  )
  env = {
    k: v
    for k, v in os.environ.items()
    if k not in ("JAX_COMPILATION_CACHE_DIR", cc.ENV) and not k.startswith("JAX_PERSISTENT")
  }
  env.update(XDG_CACHE_HOME=str(tmp_path), PYTHONPATH=str(ROOT))
  r = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True)
  assert r.returncode == 0, r.stderr
  where, hits_first, hits_again = r.stdout.split()
  assert where == str(tmp_path / "jaxlens" / "xla")
  assert any((tmp_path / "jaxlens" / "xla").iterdir())
  assert hits_first == "0" and hits_again == "1"
