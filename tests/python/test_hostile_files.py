"""Inputs that once made kiln hang, grow without bound or silently damage its output, run as
real processes: FIFOs and devices where a file belongs, endless inputs, a shard written over
its own input, shards that are damaged or come from another tokenizer."""
import json
import os
import shutil
import struct
import subprocess

import pytest

from test_parity import build_model

# A hang is the defect these tests look for: every process gets a short limit, so a
# regression fails as a timeout instead of wedging the suite.
LIMIT_S = 60


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d, _ = build_model(tmp_path_factory.mktemp("tiny"), "qwen2")
    return d


def run(build_dir, *args, input=None, cwd=None):
    return subprocess.run([str(build_dir / "kiln"), *map(str, args)], capture_output=True, text=True,
                          input=input, timeout=LIMIT_S, cwd=cwd)


def run_capped(build_dir, *args, cap_gb=4):
    """run() under a 4 GB address-space limit (RLIMIT_AS, set in the child): a process that
    slurps an endless input fails its allocations there instead of finishing with the bounded
    error. (Peak RSS cannot be read reliably from here: a forked child starts with pytest's.)"""
    import resource

    def cap():
        resource.setrlimit(resource.RLIMIT_AS, (cap_gb << 30, cap_gb << 30))
    return subprocess.run([str(build_dir / "kiln"), *map(str, args)], capture_output=True, text=True,
                          timeout=LIMIT_S, preexec_fn=cap)


def fifo(path):
    os.mkfifo(path)
    return path


# ---- files that are not regular files -----------------------------------------------------

def test_fifo_model_path(build_dir, tmp_path):
    r = run(build_dir, "info", "-m", fifo(tmp_path / "model.gguf"))
    assert r.returncode != 0
    assert "FIFO" in r.stderr and "not a regular file" in r.stderr, r.stderr


def test_device_model_path(build_dir):
    r = run(build_dir, "info", "-m", "/dev/zero")
    assert r.returncode != 0 and "character device" in r.stderr, r.stderr


def test_missing_model_path(build_dir, tmp_path):
    r = run(build_dir, "info", "-m", tmp_path / "absent.gguf")
    assert r.returncode != 0 and "no such file or folder" in r.stderr, r.stderr


@pytest.mark.parametrize("name", ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                                  "tokenizer_config.json"])
def test_fifo_in_model_folder(build_dir, tiny, tmp_path, name):
    d = tmp_path / "m"
    shutil.copytree(tiny, d)
    (d / name).unlink(missing_ok=True)
    fifo(d / name)
    r = run(build_dir, "info", "-m", d)
    assert r.returncode != 0, r.stdout
    assert name in r.stderr and "FIFO" in r.stderr, r.stderr


def make_shard(build_dir, tok_src, tmp_path, name="c.tok", docs=200):
    text = tmp_path / (name + ".txt")
    text.write_text("\n\n".join(f"document {i} says hello to the world" for i in range(docs)))
    out = tmp_path / name
    r = run(build_dir, "data", "-m", tok_src, "-o", out, text)
    assert r.returncode == 0, r.stderr
    return out


def test_fifo_data_shard(build_dir, tiny, tmp_path):
    r = run(build_dir, "train", "-m", tiny, "--data", fifo(tmp_path / "c.tok"), "--out", tmp_path / "run",
            "--steps", "1", "--batch", "1", "--seq", "8")
    assert r.returncode != 0 and "FIFO" in r.stderr, r.stderr


def test_fifo_metrics_csv(build_dir, tiny, tmp_path):
    shard = make_shard(build_dir, tiny, tmp_path)
    out = tmp_path / "run"
    out.mkdir()
    fifo(out / "metrics.csv")
    args = ["train", "-m", tiny, "--data", shard, "--out", out, "--steps", "1", "--batch", "1", "--seq", "8",
            "--threads", "1", "--overwrite"]  # a used --out needs --overwrite (or --resume)
    r = run(build_dir, *args)
    assert r.returncode != 0 and "metrics.csv" in r.stderr and "FIFO" in r.stderr, r.stderr


# ---- endless inputs are refused with bounded memory -----------------------------------------

def test_generate_prompt_from_dev_zero(build_dir, tiny):
    # the bound is the context's worth of text; the process never holds gigabytes
    r = run_capped(build_dir, "generate", "-m", tiny, "-f", "/dev/zero", "-n", "1", "--threads", "1")
    assert r.returncode != 0 and "longer than" in r.stderr, r.stderr


def test_generate_prompt_bounded_by_context(build_dir, tiny, tmp_path):
    """A prompt file far past what the context holds is refused by its size; one that fits in
    bytes but not in tokens is refused by the generation with the token count."""
    big = tmp_path / "big.txt"
    big.write_text("hello world " * 2_000_000)  # 24 MB
    r = run(build_dir, "generate", "-m", tiny, "-f", big, "-n", "1", "--ctx", "64")
    assert r.returncode != 0 and "longer than" in r.stderr, r.stderr
    small = tmp_path / "small.txt"
    small.write_text("hello world " * 200)
    r = run(build_dir, "generate", "-m", tiny, "-f", small, "-n", "1", "--ctx", "64")
    assert r.returncode != 0 and "longer than" not in r.stderr, r.stderr


def test_data_from_dev_zero(build_dir, tiny, tmp_path):
    r = run_capped(build_dir, "data", "-m", tiny, "-o", tmp_path / "z.tok", "/dev/zero")
    assert r.returncode != 0 and "without a separator" in r.stderr, r.stderr
    assert not list(tmp_path.glob("z.tok*")), "a refused shard leaves nothing behind"


def read_shard(path):
    """The documents of a KILNTOKS shard (docs/TRAINING_FORMATS.md), EOS dropped."""
    b = path.read_bytes()
    assert b[:8] == b"KILNTOKS"
    vocab, tb, eos = struct.unpack_from("<III", b, 16)
    n_tok, n_docs, tok_off, off_off = struct.unpack_from("<QQQQ", b, 32)
    toks = struct.unpack_from(f"<{n_tok}{'H' if tb == 2 else 'I'}", b, tok_off)
    offs = struct.unpack_from(f"<{n_docs + 1}Q", b, off_off)
    return [list(toks[offs[d]:offs[d + 1] - 1]) for d in range(n_docs)]


@pytest.mark.parametrize("split_on", ["blank", "line"])
def test_data_streams_corpus_like_a_whole_read(build_dir, tiny, tmp_path, split_on):
    """kiln data reads a corpus a megabyte at a time; documents and their tokens are exactly
    those of splitting the whole text at once, also where a separator or a run of newlines
    straddles two reads."""
    import random
    import kiln
    rng = random.Random(5)
    words = "the lord said unto moses and aaron in the land of egypt".split()
    parts = []
    while sum(map(len, parts)) < 2_600_000:  # three reads of 1 MiB
        parts.append(" ".join(rng.choice(words) for _ in range(rng.randint(1, 30))))
        parts.append("\n" * rng.choice([1, 2, 2, 3, 5]))
    text = "".join(parts)
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(text)
    out = tmp_path / "c.tok"
    r = run(build_dir, "data", "-m", tiny, "-o", out, "--split-on", split_on, corpus)
    assert r.returncode == 0, r.stderr
    sep = "\n\n" if split_on == "blank" else "\n"
    want, start = [], 0
    while start < len(text):  # the documented rule: a separator, then any newlines, end a document
        hit = text.find(sep, start)
        end = hit if hit >= 0 else len(text)
        want.append(text[start:end])
        start = end + len(sep)
        while hit >= 0 and start < len(text) and text[start] == "\n":
            start += 1
    want = [d for d in want if d.strip(" \n\r\t")]
    got = read_shard(out)
    assert len(got) == len(want)
    tok = kiln.Tokenizer(tiny / "tokenizer.json")
    for i in list(range(0, len(want), 97)) + [len(want) - 1]:
        assert got[i] == list(tok.encode(want[i], add_special=False, parse_special=False)), i


def test_data_output_is_its_input(build_dir, tiny, tmp_path):
    text = tmp_path / "corpus.txt"
    text.write_text("one document\n\nanother one\n")
    before = text.read_bytes()
    r = run(build_dir, "data", "-m", tiny, "-o", text, text)
    assert r.returncode == 2 and "would replace it" in r.stderr, r.stderr
    assert text.read_bytes() == before
    link = tmp_path / "link.txt"
    link.symlink_to(text)
    r = run(build_dir, "data", "-m", tiny, "-o", link, text)
    assert r.returncode == 2 and "would replace it" in r.stderr, r.stderr
    with open(text) as f:
        r = subprocess.run([str(build_dir / "kiln"), "data", "-m", str(tiny), "-o", str(text), "-"], stdin=f,
                           capture_output=True, text=True, timeout=LIMIT_S)
    assert r.returncode == 2 and "would replace it" in r.stderr, r.stderr
    assert text.read_bytes() == before
    tj = tiny / "tokenizer.json"
    r = run(build_dir, "data", "-m", tj, "-o", tj, text)
    assert r.returncode == 2 and "tokenizer" in r.stderr, r.stderr


def test_detokenize_stdin_id_out_of_range(build_dir, tiny):
    r = run(build_dir, "detokenize", "-m", tiny, input="1 2 99999999999\n")
    assert r.returncode == 2 and "99999999999" in r.stderr, r.stderr


# ---- shards: damage and another tokenizer ------------------------------------------------------

def test_shard_flipped_token_is_refused(build_dir, tiny, tmp_path):
    shard = make_shard(build_dir, tiny, tmp_path)
    b = bytearray(shard.read_bytes())
    # token 3 (u16 at 256 + 2*3): another id that is still inside the vocabulary
    old = struct.unpack_from("<H", b, 262)[0]
    struct.pack_into("<H", b, 262, old ^ 1)
    shard.write_bytes(bytes(b))
    r = run(build_dir, "train", "-m", tiny, "--data", shard, "--out", tmp_path / "run", "--steps", "1",
            "--batch", "1", "--seq", "8", "--threads", "1")
    assert r.returncode != 0 and "checksum mismatch" in r.stderr, r.stderr
    assert not (tmp_path / "run" / "checkpoints").exists() or not any((tmp_path / "run" / "checkpoints").iterdir())


def test_shard_from_another_tokenizer_is_refused(build_dir, tiny, tmp_path):
    other = tmp_path / "other"
    shutil.copytree(tiny, other)
    tj = json.loads((other / "tokenizer.json").read_text())
    vocab = tj["model"]["vocab"]
    # the same number of tokens, two of them swapped: the same ids mean other text
    (a, ia), (b, ib) = list(vocab.items())[300:302]
    vocab[a], vocab[b] = ib, ia
    (other / "tokenizer.json").write_text(json.dumps(tj))
    shard = make_shard(build_dir, other / "tokenizer.json", tmp_path)
    r = run(build_dir, "train", "-m", tiny, "--data", shard, "--out", tmp_path / "run", "--steps", "1",
            "--batch", "1", "--seq", "8", "--threads", "1")
    assert r.returncode != 0 and "another tokenizer" in r.stderr, r.stderr
    # the model's own tokenizer's shard trains
    good = make_shard(build_dir, tiny, tmp_path, "good.tok")
    r = run(build_dir, "train", "-m", tiny, "--data", good, "--out", tmp_path / "run2", "--steps", "1",
            "--batch", "1", "--seq", "8", "--threads", "1", "--eval-fraction", "0")
    assert r.returncode == 0, r.stderr


# ---- names with NULs, a missing output layer ---------------------------------------------------

def rewrite_safetensors_header(path, edit):
    """Rewrite a safetensors file's JSON header through edit(dict) -> dict; data unchanged."""
    b = path.read_bytes()
    n = struct.unpack_from("<Q", b, 0)[0]
    hdr = edit(json.loads(b[8:8 + n]))
    raw = json.dumps(hdr).encode()  # json.dumps writes a NUL as the escape \u0000
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + b[8 + n:])


def test_escaped_nul_in_model_type(build_dir, tiny, tmp_path):
    d = tmp_path / "m"
    shutil.copytree(tiny, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["model_type"] = cfg["model_type"] + "\u0000junk"
    (d / "config.json").write_text(json.dumps(cfg))
    assert "\\u0000" in (d / "config.json").read_text()
    r = run(build_dir, "info", "-m", d)
    assert r.returncode != 0 and "config.json" in r.stderr and "escaped NUL" in r.stderr, r.stderr


def test_escaped_nul_in_tensor_name(build_dir, tiny, tmp_path):
    d = tmp_path / "m"
    shutil.copytree(tiny, d)

    def edit(h):
        h["model.norm.weight\u0000junk"] = h.pop("model.norm.weight")
        return h
    rewrite_safetensors_header(d / "model.safetensors", edit)
    r = run(build_dir, "info", "-m", d)
    assert r.returncode != 0 and "model.safetensors" in r.stderr and "escaped NUL" in r.stderr, r.stderr


def test_untied_model_without_lm_head(build_dir, tiny, tmp_path):
    """tie_word_embeddings false (transformers would give the model a random output layer) and
    no lm_head.weight: refused, not tied behind the user's back."""
    d = tmp_path / "m"
    shutil.copytree(tiny, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["tie_word_embeddings"] = False
    (d / "config.json").write_text(json.dumps(cfg))

    def edit(h):
        h.pop("lm_head.weight", None)
        return h
    rewrite_safetensors_header(d / "model.safetensors", edit)
    r = run(build_dir, "info", "-m", d)
    assert r.returncode != 0 and "lm_head.weight" in r.stderr and "tie_word_embeddings" in r.stderr, r.stderr
    cfg["tie_word_embeddings"] = True  # said so: the embedding is the output layer
    (d / "config.json").write_text(json.dumps(cfg))
    r = run(build_dir, "info", "-m", d)
    assert r.returncode == 0, r.stderr
