"""`kiln data` and `kiln train` as real processes: training from scratch makes the loss fall,
an interrupted run resumed from its checkpoint gives the same losses and weights as an
uninterrupted one, the thread count does not change a bit, and bad inputs get clear errors."""
import csv
import subprocess

import pytest

from test_parity import CORPUS, build_model

TEXT = "\n\n".join([
    "In the beginning God created the heaven and the earth.",
    "And the earth was without form, and void; and darkness was upon the face of the deep.",
    "And God said, Let there be light: and there was light.",
    "And God saw the light, that it was good: and God divided the light from the darkness.",
] * 12 + CORPUS)


def kiln(build_dir, *args, check=True):
    r = subprocess.run([str(build_dir / "kiln"), *map(str, args)], capture_output=True, text=True, timeout=600)
    if check:
        assert r.returncode == 0, r.stderr[-3000:]
    return r


def losses(run_dir):
    with open(run_dir / "metrics.csv") as f:
        return [(int(r["step"]), r["loss"], r["eval_loss"]) for r in csv.DictReader(f)]


@pytest.fixture(scope="module")
def setup(tmp_path_factory, build_dir):
    base = tmp_path_factory.mktemp("train")
    d, _ = build_model(base, "llama")
    (base / "corpus.txt").write_text(TEXT)
    r = kiln(build_dir, "data", "-m", d, "-o", base / "corpus.tok", base / "corpus.txt")
    assert "documents" in r.stdout
    return base, d


COMMON = ["--batch", "4", "--seq", "32", "--lr", "3e-3", "--warmup", "3", "--eval-every", "5",
          "--eval-fraction", "0.1", "--eval-batches", "2", "--save-every", "0", "--no-export"]


def test_from_scratch_loss_falls(setup, build_dir):
    base, d = setup
    out = base / "scratch"
    kiln(build_dir, "train", "--config", "tiny", "--tokenizer", d, "--data", base / "corpus.tok", "--out", out,
         "--steps", "30", "--threads", "2", *[a for a in COMMON if a != "--no-export"])
    rows = losses(out)
    assert len(rows) == 30
    first, last = float(rows[0][1]), float(rows[-1][1])
    print(f"from scratch: loss {first:.3f} -> {last:.3f}")
    assert last < first - 1.0
    assert rows[-1][2] != ""  # evaluated at the end
    assert (out / "checkpoints").is_dir()
    assert (out / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # the exported model generates through the CLI
    r = kiln(build_dir, "generate", "-m", out / "model", "-p", "And God said", "-n", "8", "--temp", "0",
             "--ignore-eos", "--json")
    import json
    assert len(json.loads(r.stdout)["ids"]) == 8


def test_resume_equals_uninterrupted_and_threads(setup, build_dir):
    base, d = setup
    full, part, one = base / "full", base / "part", base / "one"
    args = ["-m", d, "--data", base / "corpus.tok", "--steps", "12", *COMMON]
    kiln(build_dir, "train", *args, "--out", full, "--threads", "2")
    r = kiln(build_dir, "train", *args, "--out", part, "--threads", "2", "--stop-after", "5")
    assert "stopped after 5 steps" in r.stderr
    kiln(build_dir, "train", *args, "--out", part, "--threads", "2", "--resume")
    assert losses(part) == losses(full)
    kiln(build_dir, "train", *args, "--out", one, "--threads", "1")
    assert losses(one) == losses(full)


def test_export_reads_without_moving_checkpoints(setup, build_dir):
    """`kiln export RUN` takes the newest valid checkpoint and, unlike a resume, leaves a damaged
    newer one where it is (an export reads)."""
    base, d = setup
    out = base / "exp_damaged"
    args = ["-m", d, "--data", base / "corpus.tok", "--steps", "4", *COMMON]
    args[args.index("--save-every") + 1] = "2"
    kiln(build_dir, "train", *args, "--out", out, "--threads", "2")
    f = out / "checkpoints" / "step-4" / "state.kiln"
    b = bytearray(f.read_bytes())
    b[300] ^= 0x40  # a section's byte: its checksum fails
    f.write_bytes(bytes(b))
    r = kiln(build_dir, "export", out, "-o", base / "exp_out")
    assert "step 2 of" in r.stderr, r.stderr
    assert f.exists() and not list((out / "checkpoints").glob("step-4.rejected-*"))


def test_train_errors(setup, build_dir, tmp_path):
    base, d = setup
    r = kiln(build_dir, "train", "-m", d, "--out", tmp_path / "x", check=False)
    assert r.returncode == 2 and "--data" in r.stderr
    r = kiln(build_dir, "train", "-m", d, "--data", tmp_path / "missing.tok", "--out", tmp_path / "x", check=False)
    assert r.returncode == 1 and "missing.tok" in r.stderr
    r = kiln(build_dir, "train", "--config", "huge", "--tokenizer", d, "--data", base / "corpus.tok",
             "--out", tmp_path / "x", check=False)
    assert r.returncode == 1 and "unknown model configuration" in r.stderr
    r = kiln(build_dir, "train", "-m", d, "--data", base / "corpus.tok", "--out", tmp_path / "y", "--resume",
             *COMMON, check=False)
    assert r.returncode == 1 and "--resume" in r.stderr
    r = kiln(build_dir, "train", "-m", d, "--data", base / "corpus.tok", "--seq", "100000", "--out", tmp_path / "z",
             check=False)
    assert r.returncode == 2 and "context length" in r.stderr
    (tmp_path / "bad.tok").write_bytes(b"KILNTOKS" + b"\0" * 100)
    r = kiln(build_dir, "train", "-m", d, "--data", tmp_path / "bad.tok", "--out", tmp_path / "w", check=False)
    assert r.returncode == 1 and "bad.tok" in r.stderr


def test_seqs_per_forward(setup, build_dir):
    """--seqs-per-forward K: the same run (same batches and steps) with K sequences per forward
    gives the same losses within rounding (not the same bits: the gradient sums run over all K
    sequences' rows at once), and a K that does not divide --batch is refused."""
    base, d = setup
    one, two = base / "pf1", base / "pf2"
    args = ["-m", d, "--data", base / "corpus.tok", "--steps", "6", "--threads", "2", *COMMON]
    kiln(build_dir, "train", *args, "--out", one)
    kiln(build_dir, "train", *args, "--out", two, "--seqs-per-forward", "2")
    a, b = losses(one), losses(two)
    assert len(a) == len(b) == 6
    assert abs(float(a[0][1]) - float(b[0][1])) <= 1e-5 * abs(float(a[0][1]))  # before any update
    for (s1, l1, _), (s2, l2, _) in zip(a, b):
        assert s1 == s2 and abs(float(l1) - float(l2)) <= 1e-3 * abs(float(l1)), (s1, l1, l2)
    r = kiln(build_dir, "train", *args, "--out", base / "pf3", "--seqs-per-forward", "3", check=False)
    assert r.returncode == 2 and "does not divide --batch" in r.stderr
