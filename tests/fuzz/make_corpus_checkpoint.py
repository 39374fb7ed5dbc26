"""Write the seed inputs of fuzz_checkpoint into tests/fuzz/corpus_checkpoint/: small
KILNCKPT files (docs/TRAINING_FORMATS.md) with the sections a trainer writes, each behind the
fuzzer's mode byte (1: reseal after mutating, 0: as is). Run:
/root/.cache/kiln-venv/bin/python tests/fuzz/make_corpus_checkpoint.py"""
import hashlib
import struct
from pathlib import Path

OUT = Path(__file__).resolve().parent / "corpus_checkpoint"
F32, BF16 = 0, 2  # kiln_dtype values (include/kiln.h)


def checkpoint(step, sections):
    """sections: (name, type, dtype, shape, data); type 1 raw, 2 JSON, 3 u64, 4 tensor."""
    body, table, pos = bytearray(), bytearray(), 128
    for name, typ, dtype, shape, data in sections:
        pad = (-pos) % 64
        body += bytes(pad)
        pos += pad
        e = bytearray(256)
        e[:len(name)] = name.encode()
        dims = list(shape) + [1] * (4 - len(shape)) if typ == 4 else [0, 0, 0, 0]
        struct.pack_into("<III4x4qQQ", e, 128, typ, dtype if typ == 4 else 0, len(shape) if typ == 4 else 0,
                         *dims, pos, len(data))
        e[192:224] = hashlib.sha256(data).digest()
        table += e
        body += data
        pos += len(data)
    pad = (-pos) % 64
    body += bytes(pad)
    table_offset = pos + pad
    hdr = bytearray(128)
    struct.pack_into("<8sIIQIIQQ", hdr, 0, b"KILNCKPT", 1, 128, step, len(sections), 256, table_offset,
                     table_offset + len(table))
    hdr[48:80] = hashlib.sha256(table).digest()
    hdr[96:128] = hashlib.sha256(hdr[:96]).digest()
    return bytes(hdr + body + table)


def main():
    OUT.mkdir(exist_ok=True)
    w = struct.pack("<12f", *[0.25 * i for i in range(12)])
    trainer_like = checkpoint(3, [
        ("config", 2, 0, (), b'{"format":"kiln-train","version":1,"n_layer":1}'),
        ("run", 2, 0, (), b'{"steps":6,"lr":0.003,"data_position":"step"}'),
        ("step", 3, 0, (), struct.pack("<Q", 3)),
        ("param/model.embed_tokens.weight", 4, F32, (3, 4), w),
        ("param/model.norm.weight", 4, BF16, (4,), bytes(range(8))),
        ("optimizer/matrices", 1, 0, (), bytes(range(96))),
    ])
    tiny = checkpoint(0, [("step", 3, 0, (), struct.pack("<Q", 0))])
    (OUT / "trainer_like").write_bytes(b"\x01" + trainer_like)
    (OUT / "trainer_like_sealed").write_bytes(b"\x00" + trainer_like)
    (OUT / "tiny").write_bytes(b"\x01" + tiny)


if __name__ == "__main__":
    main()
