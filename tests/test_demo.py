"""The demo: trains, sweeps, writes a valid heatmap PNG and prints the top sites."""

import re
import struct
import zlib

import numpy as np

from jaxlens import demo

SEQ, MARKER_AT = 6, 2


def _read_png(path):
  """Parses a PNG written by the demo; checks every chunk's CRC. Returns (width, height, rgb)."""
  data = path.read_bytes()
  assert data[:8] == b"\x89PNG\r\n\x1a\n"
  chunks, at = {}, 8
  while at < len(data):
    (length,) = struct.unpack(">I", data[at:at + 4])
    kind, body = data[at + 4:at + 8], data[at + 8:at + 8 + length]
    (crc,) = struct.unpack(">I", data[at + 8 + length:at + 12 + length])
    assert crc == zlib.crc32(kind + body) & 0xFFFFFFFF, kind
    chunks[kind] = chunks.get(kind, b"") + body
    at += 12 + length
  assert set(chunks) == {b"IHDR", b"IDAT", b"IEND"}
  width, height, depth, colour, _, _, _ = struct.unpack(">IIBBBBB", chunks[b"IHDR"])
  assert (depth, colour) == (8, 2)  # 8-bit RGB
  raw = np.frombuffer(zlib.decompress(chunks[b"IDAT"]), np.uint8).reshape(height, 1 + 3 * width)
  assert (raw[:, 0] == 0).all()  # filter type "none" on every scanline
  return width, height, raw[:, 1:].reshape(height, width, 3)


def test_main_trains_sweeps_and_writes_the_heatmap(tmp_path, capsys):
  out = tmp_path / "heat.png"
  status = demo.main(["--steps", "20", "--batch", "16", "--d-model", "16", "--heads", "2",
                      "--seq-len", str(SEQ), "--vocab", "11", "--marker-at", str(MARKER_AT),
                      "--top", "100", "--out", str(out)])
  assert status == 0
  printed = capsys.readouterr()
  # The progress bar goes to stderr and ends at the last step.
  assert re.search(r"\[#{30}\] 20/20  loss \d+\.\d{4}", printed.err)

  width, height, rgb = _read_png(out)
  assert width > 10 * SEQ and height > 5 * 5
  assert (rgb == 255).all(axis=-1).any() and (rgb != 255).any()  # background and ink

  m = re.search(r"loss (\d+\.\d+) -> (\d+\.\d+)", printed.out)
  assert m and float(m.group(1)) > 0
  top = re.findall(r"^\s+\d+\. (\S+) @ position (\d+): (-?\d+\.\d+)$", printed.out, re.M)
  scores = {(site, int(pos)): float(score) for site, pos, score in top}
  # --top 100 prints every cell: 5 sites (embed, block_i/attn, block_i) x SEQ positions.
  assert len(scores) == 5 * SEQ
  assert list(scores.values()) == sorted(scores.values(), reverse=True)
  # Cells fixed by causality, trained or not: patching the embedding where the runs differ,
  # or the last block at the query position, restores all; patching earlier changes nothing.
  assert scores[("embed", MARKER_AT + 1)] == 1.0
  assert scores[("block_1", SEQ - 1)] == 1.0
  assert all(scores[(site, p)] == 0.0 for site in ("embed", "block_0", "block_1")
             for p in range(MARKER_AT + 1))
  assert f"heatmap: {out}" in printed.out


def test_png_writer_round_trips_the_colours(tmp_path):
  path = tmp_path / "grid.png"
  grid = np.array([[1.0, 0.0], [-1.0, 0.5]])
  demo.write_heatmap_png(path, grid, ["ab", "c"], ["0", "1"], cell=10)
  _, _, rgb = _read_png(path)
  # The bottom-right corner of each cell is free of grid lines and labels.
  top = 8 + 14
  left = 8 + 8 * 2
  pick = lambda r, c: tuple(rgb[top + r * 10 + 8, left + c * 10 + 8])
  assert pick(0, 0) == (178, 24, 43)  # +1: red
  assert pick(0, 1) == (255, 255, 255)  # 0: white
  assert pick(1, 0) == (33, 102, 172)  # -1: blue
  assert pick(1, 1) == (216, 139, 149)  # halfway to red


def test_progress_bar_redraws_in_place_on_a_terminal():
  import io

  class Terminal(io.StringIO):
    def isatty(self):
      return True

  stream = Terminal()
  bar = demo.ProgressBar(4, stream, width=4)
  for i in range(1, 5):
    bar.update(i, 1.0 / i)
  bar.close()
  text = stream.getvalue()
  assert text.count("\r") == 4 and text.endswith("\n") and text.count("\n") == 1
  assert "\r[##--] 2/4  loss 0.5000" in text and "\r[####] 4/4  loss 0.2500" in text
