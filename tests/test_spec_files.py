"""Saved specs on disk: every corruption is a typed error, concurrent saves are atomic."""

import threading
import time

import jax.numpy as jnp
import numpy as np
import pytest

import jaxlens as jl

SITE = jl.module("layers_0")


def _spec(k):
  return jl.when(SITE, jl.scale(float(k))) + jl.when(SITE, jl.add(jnp.full((4,), float(k))))


def test_every_flipped_byte_and_every_truncation_is_refused_or_harmless(tmp_path):
  path = _spec(1).save(tmp_path / "s")
  want = repr(jl.load_spec(path))
  for name in ("spec.json", "arrays.npz"):
    target = path / name
    data = target.read_bytes()
    damaged = [data[:n] for n in range(len(data))]
    damaged += [data[:i] + bytes([data[i] ^ 0xFF]) + data[i + 1 :] for i in range(len(data))]
    for blob in damaged:
      target.write_bytes(blob)
      try:
        got = repr(jl.load_spec(path))
      except jl.SpecFormatError as error:
        assert error.code == "spec_corrupt", error  # never spec_version: a damaged file
      else:  # a change the format does not read (JSON whitespace): the same spec
        assert got == want
    target.write_bytes(data)
  assert repr(jl.load_spec(path)) == want


@pytest.mark.parametrize(
  "doc",
  [
    '{"format": "jaxlens-spec", "version": 2, "rules": ' + "[" * 5000 + "]" * 5000 + "}",
    '{"format": "jaxlens-spec", "version": 2, "rules": [{"site": 3, "edit": []}]}',
    '{"format": "jaxlens-spec", "version": "2", "rules": []}',
    "[1, 2]",
  ],
  ids=["deep", "wrong-types", "version-type", "not-an-object"],
)
def test_hostile_structure_is_a_typed_error(tmp_path, doc):
  path = _spec(1).save(tmp_path / "s")
  (path / "spec.json").write_text(doc)
  with pytest.raises(jl.SpecFormatError):
    jl.load_spec(path)


def test_a_damaged_version_field_is_spec_corrupt_and_a_newer_version_spec_version(tmp_path):
  import json

  from jaxlens._src import saving

  path = _spec(1).save(tmp_path / "s")
  text = (path / "spec.json").read_text()
  doc = json.loads(text)
  assert doc["version"] == saving.VERSION
  for damaged in (saving.VERSION + 1, 0, 12, "2", None):
    (path / "spec.json").write_text(json.dumps({**doc, "version": damaged}))
    with pytest.raises(jl.SpecFormatError, match="version field is damaged") as error:
      jl.load_spec(path)
    assert error.value.code == "spec_corrupt"
  # A later version written intact (its hash holds) is spec_version.
  newer = {k: v for k, v in doc.items() if k != "sha256"}
  newer["version"] = saving.VERSION + 1
  with np.load(path / "arrays.npz") as npz:
    arrays = {k: npz[k] for k in npz.files}
  newer["sha256"] = saving._digest(newer, arrays)
  (path / "spec.json").write_text(json.dumps(newer))
  with pytest.raises(jl.SpecFormatError, match="format version 3") as error:
    jl.load_spec(path)
  assert error.value.code == "spec_version"


def test_concurrent_writers_and_a_reader(tmp_path):
  """Writers replace the spec while a reader loads it: every load is one whole spec."""
  path = _spec(0).save(tmp_path / "s")
  wanted = {repr(_spec(k)) for k in range(4)}
  errors, loads = [], []
  stop = time.monotonic() + 3.0

  def writer(k):
    try:
      while time.monotonic() < stop:
        _spec(k).save(path)
    except Exception as error:  # noqa: BLE001 (collected and asserted below)
      errors.append(error)

  def reader():
    try:
      while time.monotonic() < stop:
        loads.append(repr(jl.load_spec(path)))
    except Exception as error:  # noqa: BLE001
      errors.append(error)

  threads = [threading.Thread(target=writer, args=(k,)) for k in range(1, 4)]
  threads.append(threading.Thread(target=reader))
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  assert not errors, errors
  assert loads and set(loads) <= wanted
  assert sorted(p.name for p in tmp_path.iterdir()) == ["s"]
  names = [p.name for p in path.iterdir()]
  assert len([n for n in names if n.startswith("v-")]) == 1
  assert not [n for n in names if "tmp" in n]


def test_concurrent_writer_processes_and_a_reader_process(tmp_path):
  """Two writer processes save to one path while a reader process loads it in a loop:
  every load is one whole spec (never spec_not_found or spec_corrupt), no writer raises,
  and nothing temporary is left behind."""
  import multiprocessing

  import _spec_race_worker as worker

  path = _spec(0).save(tmp_path / "s")
  ctx = multiprocessing.get_context("spawn")
  ks, seconds = (1, 2), 1.5
  barrier, queue = ctx.Barrier(len(ks) + 1), ctx.Queue()
  procs = [
    ctx.Process(target=worker.writer, args=(str(path), k, barrier, seconds, queue)) for k in ks
  ]
  procs.append(
    ctx.Process(target=worker.reader, args=(str(path), (0, *ks), barrier, seconds, queue))
  )
  for p in procs:
    p.start()
  try:
    # Each process imports jax (a few seconds), meets the others, then races for `seconds`.
    reports = [queue.get(timeout=120) for _ in procs]
  finally:
    for p in procs:
      p.join(timeout=30)
      if p.is_alive():
        p.terminate()
        p.join()
  assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
  errors = [e for _, _, errs in reports for e in errs]
  assert not errors, errors[:5]
  counts = {role: sum(n for r, n, _ in reports if r == role) for role in ("writer", "reader")}
  assert counts["writer"] > 0 and counts["reader"] > 0, counts
  assert repr(jl.load_spec(path)) in {repr(_spec(k)) for k in ks}
  assert sorted(p.name for p in tmp_path.iterdir()) == ["s"]
  names = [p.name for p in path.iterdir()]
  assert len([n for n in names if n.startswith("v-")]) == 1, names
  assert not [n for n in names if "tmp" in n], names


def test_a_failed_write_leaves_the_old_spec_and_no_debris(tmp_path, monkeypatch):
  path = _spec(1).save(tmp_path / "s")
  import jaxlens._src.saving as saving

  def broken(target, at):
    raise OSError("disk full")

  monkeypatch.setattr(saving, "_link", broken)
  with pytest.raises(jl.SpecFormatError, match=r"\[spec_save_failed\]"):
    _spec(2).save(path)
  assert repr(jl.load_spec(path)) == repr(_spec(1))
  assert not [p for p in path.iterdir() if "tmp" in p.name]
  assert len([p for p in path.iterdir() if p.name.startswith("v-")]) == 1


def test_a_donor_trace_is_saved_as_the_site_it_reads(tmp_path, spec_model):
  model, variables, x, x_donor, _ = spec_model
  donor = jl.trace(model, variables, x_donor)
  path = jl.when(SITE, jl.patch_from(donor)).save(tmp_path / "s")
  with np.load(path / "arrays.npz") as npz:
    assert len(npz.files) == 1
  loaded = jl.load_spec(path)
  np.testing.assert_array_equal(
    loaded.bind(model)(variables, x), jl.when(SITE, jl.patch_from(donor)).bind(model)(variables, x)
  )
