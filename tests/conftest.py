"""Test environment: float64 on, strict dtype promotion, several CPU devices, warnings as errors
(pyproject)."""

import atexit
import functools
import gc
import importlib.util
import json
import os
import re
import shutil
import tempfile
from pathlib import Path

# XLA:CPU's newer MLIR fusion emitters take about twice as long to compile a fusion as the
# elemental emitters they replace; the tests compile thousands of tiny programs (every eager
# primitive, every jitted cell) whose run time is negligible, so compile time is what counts.
# XLA:CPU also splits each program's LLVM module into several parts to compile them on
# its thread pool; a worker's pool has one thread (see below), so the parts only add LLVM's
# per-module cost: one part takes a fifth off the compile time of the zoo's models.
XLA_TEST_FLAGS = "--xla_cpu_use_fusion_emitters=false --xla_cpu_parallel_codegen_split_count=1"
os.environ.setdefault("XLA_FLAGS", f"--xla_force_host_platform_device_count=8 {XLA_TEST_FLAGS}")
# The tests' programs are tiny, so XLA's optimising passes cost more than they save (the
# compile time of a small model's jitted forward and backward falls by about a third);
# tests/test_properties.py turns them back on for its bit-identity checks. Set in the
# environment so that the tests' subprocesses (distributed workers, benchmarks) inherit it.
os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")
# One compilation cache for this run, shared by the xdist workers and the tests'
# subprocesses: eager execution compiles every primitive per shape and dtype (about 0.1 s
# each on CPU) and the workers compile many of the same ones; a cache hit costs a third.
# The controller makes the directory (workers inherit the environment) and removes it.
if "PYTEST_XDIST_WORKER" not in os.environ and "JAX_COMPILATION_CACHE_DIR" not in os.environ:
  _CACHE = tempfile.mkdtemp(prefix="jaxlens-tests-xla-")
  os.environ["JAX_COMPILATION_CACHE_DIR"] = _CACHE
  os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
  os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "-1"
  atexit.register(shutil.rmtree, _CACHE, ignore_errors=True)

# Memory the processes free stays theirs to reuse: glibc neither trims its heap nor maps
# arrays below 32 MiB on their own, and grows the heap 64 MiB at a time, in huge pages. On a
# virtual machine whose host reclaims the guest's free pages, as this project's CI machine
# does, the first touch of a page costs about 30 us (2 GiB touched anew: 16 s of system time),
# and system time was a fifth of the suite's CPU time. Read by the workers and subprocesses,
# which inherit the environment; see also _free_between_files below.
os.environ.setdefault(
  "GLIBC_TUNABLES",
  "glibc.malloc.hugetlb=1:glibc.malloc.trim_threshold=4294967295"
  ":glibc.malloc.top_pad=67108864:glibc.malloc.mmap_threshold=33554432",
)

# pytest-xdist runs one worker per core, and each worker's libraries would start a thread
# pool as wide as the machine (XLA's intra-op pool and compiler threads, torch's OpenMP,
# OpenBLAS). Their threads spin while they wait for work, on cores that the other workers
# need. Each worker's pools get its share of the cores instead: the environment for OpenMP
# and OpenBLAS (read when they load), and for XLA, whose pool is as wide as the cores the
# process may run on when JAX creates its CPU client, a temporary CPU affinity (see below).
# On two cores that saves about 40 of the suite's 720 CPU-seconds.
_WORKER = os.environ.get("PYTEST_XDIST_WORKER", "")
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
_CORES = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
_SHARE = max(1, len(_CORES) // max(1, _WORKERS))
_SHARED_OUT = bool(_WORKER) and _SHARE < len(_CORES)  # a worker that gets part of the cores
if _SHARED_OUT:
  for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, str(_SHARE))

import jax  # noqa: E402

jax.config.update("jax_enable_x64", True)
if _SHARED_OUT:
  _start = int(_WORKER.removeprefix("gw")) % (len(_CORES) // _SHARE) * _SHARE
  os.sched_setaffinity(0, _CORES[_start : _start + _SHARE])
  jax.devices()  # the CPU client and its thread pool, sized by the affinity
  os.sched_setaffinity(0, _CORES)  # this thread (the tests' own) runs on any core
# Strict promotion: an implicit mix of dtypes (a float32 array meeting a float64 one, an int meeting
# a float) raises instead of silently widening, so jaxlens works for users who turn it on. A test
# that needs a third-party library which mixes dtypes itself opts out with `standard_promotion`.
jax.config.update("jax_numpy_dtype_promotion", "strict")

import pytest  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

# The property tests (tests/test_properties.py, tests/test_zoo_properties.py) give only
# max_examples: the same examples on every run (derandomized, no example database), no
# deadline (the first example of a test compiles its programs).
settings.register_profile(
  "jaxlens",
  deadline=None,
  derandomize=True,
  database=None,
  suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile("jaxlens")

_ROOT = Path(__file__).resolve().parent.parent
# `pytestmark = pytest.mark.xdist_group("g")`, alone or in a module-level list of marks.
_GROUP_MARK = re.compile(
  r"""^pytestmark = (?:\[[^\]]*?)?pytest\.mark\.xdist_group\(["']([\w-]+)["']\)""", re.M
)


@functools.cache
def _file_groups() -> dict[str, str]:
  """``{test file relative to the root: group}`` from each file's module-level
  ``pytestmark = pytest.mark.xdist_group(name)``."""
  groups = {}
  for path in sorted((_ROOT / "tests").rglob("test_*.py")):
    found = _GROUP_MARK.search(path.read_text())
    if found:
      groups[path.relative_to(_ROOT).as_posix()] = found.group(1)
  return groups


# Scheduling (``-n auto --dist loadgroup``). A test file is one scope, run whole by one worker,
# so its module fixtures are made once; files that share an expensive fixture (the measured
# contract matrix, the pretrained models) name one ``xdist_group`` and run together. Scopes
# start longest first, so that no long one is left for the end while the other worker idles:
# their seconds come from tests/scope_seconds.json (a whole run's measured seconds, committed,
# so a fresh clone schedules as well as a rerun), updated from pytest's cache by
# ``python tests/scope_seconds.py`` after a whole run. A scope missing from it is estimated at
# ``_PER_TEST`` seconds a test.
_SECONDS = "jaxlens/scope_seconds"
_TABLE = Path(__file__).resolve().parent / "scope_seconds.json"
_PER_TEST = 0.4


def _scope(nodeid: str, groups: dict[str, str]) -> str:
  """A test's scope: its file's group, or its file."""
  path = nodeid.split("::", 1)[0]
  return groups.get(path, path)


def pytest_collection_modifyitems(config, items):
  """Under ``--dist loadgroup``, the tests in the order their scopes should start (an xdist
  worker, which collects for the scheduler, sees ``dist`` "no" and ``loadgroup`` True)."""
  dist = config.getoption("dist", default=None)  # None without pytest-xdist
  if dist != "loadgroup" and not getattr(config.option, "loadgroup", False):
    return
  groups = _file_groups()
  seconds = json.loads(_TABLE.read_text()) if _TABLE.is_file() else {}
  scopes = [_scope(item.nodeid, groups) for item in items]
  sizes = {scope: scopes.count(scope) for scope in set(scopes)}
  cost = {scope: seconds.get(scope, _PER_TEST * n) for scope, n in sizes.items()}
  order = sorted(range(len(items)), key=lambda i: (-cost[scopes[i]], scopes[i]))
  items[:] = [items[i] for i in order]


_spent: dict[str, float] = {}


def pytest_runtest_logreport(report):
  """Adds up each scope's seconds (in the process that runs pytest; xdist's controller gets
  every worker's reports)."""
  if "PYTEST_XDIST_WORKER" not in os.environ:
    scope = _scope(report.nodeid, _file_groups())
    _spent[scope] = _spent.get(scope, 0.0) + report.duration


def pytest_sessionfinish(session):
  """Each scope's seconds of this run, into pytest's cache (read by ``python tests/scope_seconds.py``)."""
  cache = getattr(session.config, "cache", None)
  if "PYTEST_XDIST_WORKER" not in os.environ and _spent and cache is not None:
    cache.set(_SECONDS, {scope: round(s, 1) for scope, s in sorted(_spent.items())})


@pytest.hookimpl(optionalhook=True, tryfirst=True)
def pytest_xdist_make_scheduler(config, log):
  """xdist's ``loadscope`` with the scopes above. (pytest-xdist 3.8's own ``loadgroup`` marks a
  group by rewriting ``item._nodeid``, which pytest 9 no longer reads, so it sent the tests of a
  group to any worker.) Scopes go out in the collection's order."""
  if config.getvalue("dist") != "loadgroup":
    return None
  from xdist.scheduler import LoadScopeScheduling

  groups = _file_groups()
  config.option.loadscopereorder = False  # keep the collection's order

  class FileGroups(LoadScopeScheduling):
    def _split_scope(self, nodeid: str) -> str:
      return _scope(nodeid, groups)

  return FileGroups(config, log)


# Tracing and compiling allocate millions of short-lived objects, so the collector's default
# thresholds ran about 8,000 collections in each xdist worker (12-20 s of a run). A larger
# first threshold and, after collection, frozen imports (jax, flax, torch, transformers:
# never garbage, but traversed by every full collection) bring that to about 3 s.
gc.set_threshold(20_000, 50, 100)


def pytest_collection_finish(session):
  gc.collect()
  gc.freeze()


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


# Groups whose tests share no compiled program, only what a cache outside JAX holds (the
# pretrained models, which ``jm.smollm2()`` and ``jm.gemma3()`` keep for the process): each
# example and docs page there jits its own functions, so keeping their programs until the end
# of the group only grew the worker (7.3 GB at its peak, 4.9 GB when dropped after each test).
_NOTHING_SHARED = {"pretrained"}


@pytest.fixture(scope="module", autouse=True)
def _free_between_files(request):
  """After a file that is in no group, JAX's caches (the file's compiled programs, which no
  other file calls) are dropped, so the next file reuses their memory instead of growing the
  worker by fresh pages (see GLIBC_TUNABLES above). A group's files share their programs."""
  yield
  if request.node.nodeid.split("::")[0] not in _file_groups():
    jax.clear_caches()
    gc.collect()


@pytest.fixture(autouse=True)
def _free_between_tests(request):
  """After each test of a group in ``_NOTHING_SHARED``, JAX's caches are dropped (the
  collector is left to its thresholds: a full collection per test cost more than it freed)."""
  yield
  if _scope(request.node.nodeid, _file_groups()) in _NOTHING_SHARED:
    jax.clear_caches()
