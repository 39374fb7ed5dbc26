"""The loss-curve PNG of `kiln train`, decoded independently with Python's zlib + struct.

Drives tests/tools/plot_tool (see its header): two synthetic curves, "train" (0x1F77B4, NaN
every 97th step and on steps 1201..1260) and "eval" (0xFF7F0E, every 100 steps, NaN in
between), on steps 1..2000, falling from about 10.8 to about 2.1. Checks the container
(signature, every chunk CRC, IHDR, one zlib stream whose Adler-32 zlib verifies), the geometry
(the plot frame, the train line inside it, joined across the NaN steps and falling, background
elsewhere), the legend, and that re-plotting from the metrics CSV gives the same curves as
plotting directly.
"""
import os
import struct
import subprocess
import zlib
from pathlib import Path

import numpy as np
import pytest

BUILD = Path(os.environ.get("KILN_BUILD_DIR", Path(__file__).resolve().parents[2] / "build"))
TOOL = BUILD / "plot_tool"

pytestmark = pytest.mark.skipif(not TOOL.exists(), reason="plot_tool not built")

TRAIN = (0x1F, 0x77, 0xB4)
EVAL = (0xFF, 0x7F, 0x0E)
BG = (0xFF, 0xFF, 0xFF)
FRAME = (0x33, 0x33, 0x33)
GRID = (0xE4, 0xE4, 0xE4)
TEXT = (0x22, 0x22, 0x22)
LEGEND_EDGE = (0xBB, 0xBB, 0xBB)


def run_tool(*args, ok=True):
    r = subprocess.run([str(TOOL), *map(str, args)], capture_output=True, text=True, timeout=60)
    if ok:
        assert r.returncode == 0, f"plot_tool {args} failed: {r.stderr}"
    return r


def decode_png(path):
    """Return (width, height, pixels (H, W, 3) uint8), checking the container on the way."""
    data = Path(path).read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, chunks = 8, []
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos:pos + 4])
        ctype = data[pos + 4:pos + 8]
        body = data[pos + 8:pos + 8 + length]
        (crc,) = struct.unpack(">I", data[pos + 8 + length:pos + 12 + length])
        assert len(body) == length, f"chunk {ctype} truncated"
        assert zlib.crc32(ctype + body) == crc, f"bad CRC on chunk {ctype}"
        chunks.append((ctype, body))
        pos += 12 + length
    assert pos == len(data)
    types = [c for c, _ in chunks]
    assert types[0] == b"IHDR" and types[-1] == b"IEND" and b"IDAT" in types
    w, h, depth, ctype, comp, filt, interlace = struct.unpack(">IIBBBBB", chunks[0][1])
    assert (depth, ctype, comp, filt, interlace) == (8, 2, 0, 0, 0)
    raw = zlib.decompress(b"".join(b for c, b in chunks if c == b"IDAT"))  # checks Adler-32
    stride = 1 + 3 * w
    assert len(raw) == stride * h
    rows = np.frombuffer(raw, dtype=np.uint8).reshape(h, stride)
    assert (rows[:, 0] == 0).all(), "only filter type 0 is written"
    return w, h, rows[:, 1:].reshape(h, w, 3)


def mask(img, rgb):
    return (img[:, :, 0] == rgb[0]) & (img[:, :, 1] == rgb[1]) & (img[:, :, 2] == rgb[2])


def plot_frame(img):
    """(left, top, right, bottom) of the plot frame: the rows/columns mostly of frame colour."""
    f = mask(img, FRAME)
    h, w = f.shape
    rows = np.where(f.sum(axis=1) > w // 2)[0]
    cols = np.where(f.sum(axis=0) > h // 2)[0]
    assert len(rows) >= 2 and len(cols) >= 2, "no plot frame found"
    return cols.min(), rows.min(), cols.max(), rows.max()


def test_rgb_round_trip(tmp_path):
    """kiln_png_write_rgb: every pixel comes back through an independent decoder."""
    out = tmp_path / "g.png"
    run_tool("rgb", out, 300, 230)  # raw 207,230 bytes: four stored blocks
    w, h, img = decode_png(out)
    assert (w, h) == (300, 230)
    x = np.arange(w)[None, :]
    y = np.arange(h)[:, None]
    assert (img[:, :, 0] == (x & 255)).all()
    assert (img[:, :, 1] == np.broadcast_to(y & 255, (h, w))).all()
    assert (img[:, :, 2] == ((x ^ y) & 255)).all()


def test_loss_curve_plot(tmp_path):
    out = tmp_path / "loss.png"
    run_tool("curves", out, 800, 500)
    w, h, img = decode_png(out)
    assert (w, h) == (800, 500)
    left, top, right, bottom = plot_frame(img)
    assert 30 < left < 200 and 20 < top < 100 and 700 < right < 800 and 380 < bottom < 480

    train = mask(img, TRAIN)
    inside = np.zeros_like(train)
    inside[top + 1:bottom, left + 1:right] = True
    assert train[inside].sum() > 2000, "the train line is missing from the plot area"
    assert train[~inside].sum() == 0, "train colour outside the plot area"
    assert mask(img, EVAL)[~inside].sum() == 0

    # the line is continuous (the NaN steps are skipped, not gaps) and spans the x range:
    # x starts at 0 and step 1 is ~1/2000 of the width in, so every column from there on
    # to the last step holds train pixels
    cols = np.where(train[top + 1:bottom, :].any(axis=0))[0]
    first, last = cols.min(), cols.max()
    assert first <= left + 3 and last >= right - 3
    # (an eval marker, drawn later, may cover the train line over its 9 columns)
    covered = train | mask(img, EVAL)
    span = covered[top + 1:bottom, first:last + 1].any(axis=0)
    assert span.all(), f"gap in the train line at columns {np.where(~span)[0][:10] + first}"

    # it falls: the loss near step 0 plots high (small y), near the end low (large y)
    ys, xs = np.nonzero(train[top + 1:bottom, left + 1:right])
    ys = ys + top + 1
    xs = xs + left + 1
    pw, ph = right - left, bottom - top
    early = ys[xs < left + pw * 0.03].mean()
    late = ys[xs > left + pw * 0.6].mean()
    assert early < top + 0.3 * ph and late > top + 0.8 * ph and late - early > 0.6 * ph, (early, late)

    # background: the image corners, the strip right of the frame, and most of the plot area
    for y, x in [(0, 0), (0, w - 1), (h - 1, 0), (h - 1, w - 1)]:
        assert tuple(img[y, x]) == BG
    margin = img[top:bottom, right + 1:]
    assert mask(margin, BG).all()
    area = img[top + 1:bottom, left + 1:right]
    assert mask(area, BG).mean() > 0.6
    # inside the plot only the palette appears (no stray colours)
    known = np.zeros(area.shape[:2], dtype=bool)
    for c in (BG, GRID, TRAIN, EVAL, TEXT, LEGEND_EDGE):
        known |= mask(area, c)
    assert known.all(), f"unexpected colours: {np.unique(area[~known].reshape(-1, 3), axis=0)[:5]}"
    # a light grid (vertical and horizontal lines) is drawn
    grid = mask(area, GRID)
    assert (grid.sum(axis=0) > ph * 0.5).sum() >= 4 and (grid.sum(axis=1) > pw * 0.5).sum() >= 4

    # eval markers: 21 evaluation points, each a filled square of eval colour
    ev = mask(area, EVAL)
    assert ev.sum() > 21 * 20

    # the legend: a box edged in LEGEND_EDGE, top right, holding text and both colours
    edge = mask(img, LEGEND_EDGE)
    ey, ex = np.nonzero(edge)
    assert len(ey) > 0, "no legend box"
    ly0, ly1, lx0, lx1 = ey.min(), ey.max(), ex.min(), ex.max()
    assert lx0 > left + pw // 2 and ly1 < top + ph // 3
    box = img[ly0 + 1:ly1, lx0 + 1:lx1]
    assert mask(box, TEXT).sum() > 60, "legend text region is empty"
    assert mask(box, TRAIN).sum() > 20 and mask(box, EVAL).sum() > 20
    # train's legend row is above eval's
    assert np.nonzero(mask(box, TRAIN))[0].mean() < np.nonzero(mask(box, EVAL))[0].mean()

    # text: the title above the frame, tick labels left of and below it
    assert mask(img[:top, :], TEXT).sum() > 100
    assert mask(img[top:bottom, :left], TEXT).sum() > 200
    assert mask(img[bottom + 1:, :], TEXT).sum() > 200


def test_deterministic(tmp_path):
    a, b = tmp_path / "a.png", tmp_path / "b.png"
    run_tool("curves", a, 640, 400)
    run_tool("curves", b, 640, 400)
    assert a.read_bytes() == b.read_bytes()


def test_csv_replot_matches_direct_plot(tmp_path):
    """The CSV keeps every value exactly, so the plot re-made from it (after a resume, say)
    has the same curves, axes and legend as the one plotted directly: only the title differs."""
    csv, from_csv, direct = tmp_path / "m.csv", tmp_path / "c.png", tmp_path / "d.png"
    run_tool("csv", csv, from_csv, 800, 500)
    run_tool("curves", direct, 800, 500)
    lines = csv.read_text().splitlines()
    assert lines[0] == "step,loss,eval_loss,lr,grad_norm,tokens_per_s,elapsed_s"
    assert len(lines) == 2001
    assert lines[97].startswith("97,,,")  # NaN loss: an empty cell
    assert lines[100].split(",")[2] != "" and lines[101].split(",")[2] == ""
    _, _, a = decode_png(from_csv)
    _, _, b = decode_png(direct)
    left, top, right, bottom = plot_frame(b)
    assert (a[top:, :] == b[top:, :]).all()
    assert not (a[:top, :] == b[:top, :]).all()  # the titles differ


def test_empty_plot(tmp_path):
    out = tmp_path / "e.png"
    run_tool("empty", out, 400, 250)
    w, h, img = decode_png(out)
    assert (w, h) == (400, 250)
    assert mask(img, TRAIN).sum() == 0 and mask(img, EVAL).sum() == 0
    left, top, right, bottom = plot_frame(img)
    assert mask(img[top + 1:bottom, left + 1:right], TEXT).sum() > 20  # "no data"
    assert mask(img, LEGEND_EDGE).sum() == 0  # no legend without points


def test_unwritable_path(tmp_path):
    bad = "/nonexistent-kiln-dir/loss.png"
    r = run_tool("curves", bad, 800, 500, ok=False)
    assert r.returncode == 1
    assert bad in r.stderr and "No such file or directory" in r.stderr
    r = run_tool("csv", tmp_path / "nodir" / "m.csv", tmp_path / "x.png", 800, 500, ok=False)
    assert r.returncode == 1 and "m.csv" in r.stderr and "No such file or directory" in r.stderr
