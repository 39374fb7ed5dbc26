"""Write the seed inputs of fuzz_shard into tests/fuzz/corpus_shard/: small valid KILNTOKS
shards laid out as docs/TRAINING_FORMATS.md says (u16 tokens with an EOS, u16 without one, u32
tokens of a vocabulary past 65536, no documents), each behind fuzz_shard's mode byte.
Run: python3 tests/fuzz/make_corpus_shard.py (standard library only)."""
import hashlib
import struct
from pathlib import Path

HERE = Path(__file__).resolve().parent
NO_EOS = 0xFFFFFFFF


def shard(docs, vocab, eos):
    tb = 2 if vocab <= 65536 else 4
    toks, offs = [], [0]
    for d in docs:
        toks += d + ([] if eos == NO_EOS else [eos])
        offs.append(len(toks))
    body = struct.pack(f"<{len(toks)}{'H' if tb == 2 else 'I'}", *toks)
    body += b"\0" * (-(256 + len(body)) % 64)
    off_off = 256 + len(body)
    body += struct.pack(f"<{len(offs)}Q", *offs)
    size = 256 + len(body)
    hdr = bytearray(256)
    hdr[0:8] = b"KILNTOKS"
    struct.pack_into("<IIIIII", hdr, 8, 1, 256, vocab, tb, eos, 0)
    struct.pack_into("<QQQQQ", hdr, 32, len(toks), len(docs), 256, off_off, size)
    hdr[72:104] = hashlib.sha256(b"seed tokenizer").digest()
    hdr[104:136] = hashlib.sha256(body).digest()
    hdr[224:256] = hashlib.sha256(bytes(hdr[:224])).digest()
    return bytes(hdr) + body


def main():
    out = HERE / "corpus_shard"
    out.mkdir(exist_ok=True)
    seeds = {
        "eos_u16": (0x03, shard([[5, 6, 7], [8], [9, 10, 11, 12, 13]], 100, 2)),
        "no_eos_u16": (0x01, shard([[1, 2, 3, 4], [5, 6, 7, 8, 9]], 50, NO_EOS)),
        "u32": (0x02, shard([[70000, 1, 2], [65536, 3]], 70001, 0)),
        "empty": (0x00, shard([], 10, NO_EOS)),
    }
    for name, (mode, b) in seeds.items():
        (out / name).write_bytes(bytes([mode]) + b)


if __name__ == "__main__":
    main()
