"""Write the seed inputs of fuzz_gguf into tests/fuzz/corpus_gguf/ (small GGUF files made
with gguf-py). Run: /root/.cache/kiln-venv/bin/python tests/fuzz/make_corpus_gguf.py"""
from pathlib import Path

import numpy as np
import gguf
from gguf import GGMLQuantizationType as QT

OUT = Path(__file__).resolve().parent / "corpus_gguf"


def write(name, fill):
    w = gguf.GGUFWriter(str(OUT / name), "llama")
    fill(w)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def metadata(w):
    w.add_string("general.name", "seed")
    w.add_uint8("t.u8", 7)
    w.add_int8("t.i8", -7)
    w.add_uint16("t.u16", 700)
    w.add_int16("t.i16", -700)
    w.add_uint32("t.u32", 70000)
    w.add_int32("t.i32", -70000)
    w.add_float32("t.f32", 0.5)
    w.add_bool("t.bool", True)
    w.add_uint64("t.u64", 1 << 40)
    w.add_int64("t.i64", -(1 << 40))
    w.add_float64("t.f64", 0.25)
    w.add_array("t.arr_i32", [1, -2, 3])
    w.add_array("t.arr_f32", [0.5, -1.5])
    w.add_array("t.arr_str", ["a", "bc", ""])
    w.add_array("t.nested", [[1, 2], ["x"]])


def tensors(w):
    w.add_custom_alignment(64)
    rng = np.random.default_rng(0)
    w.add_tensor("f32", rng.standard_normal((2, 4)).astype(np.float32))
    w.add_tensor("f16", rng.standard_normal((3,)).astype(np.float16))
    w.add_tensor("i32", np.arange(3, dtype=np.int32))
    w.add_tensor("i64", np.arange(2, dtype=np.int64))
    for qt in (QT.BF16, QT.Q8_0, QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1):
        q = gguf.quants.quantize(rng.standard_normal((1, 32)).astype(np.float32), qt)
        w.add_tensor(qt.name.lower(), q, raw_dtype=qt)
    for qt in (QT.Q4_K, QT.Q5_K, QT.Q6_K):
        bs, ts = gguf.GGML_QUANT_SIZES[qt]
        w.add_tensor(qt.name.lower(), rng.integers(0, 256, (1, ts), dtype=np.uint8), raw_dtype=qt)


if __name__ == "__main__":
    OUT.mkdir(exist_ok=True)
    write("metadata.gguf", metadata)
    write("tensors.gguf", tensors)
    write("empty.gguf", lambda w: None)
    for p in sorted(OUT.iterdir()):
        print(p.name, p.stat().st_size)
