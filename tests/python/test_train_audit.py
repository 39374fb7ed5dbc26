"""The training audit log (issue 33, item 5; docs/REPRODUCIBILITY.md, "Training audit log"):
`kiln train --audit` chains a record per step by SHA-256, `kiln audit RUN` checks the chain and
`kiln audit RUN --from N` replays the steps from a checkpoint (or from the initial weights) and
compares every record.

Properties checked: a run interrupted and resumed (with another thread count) keeps one intact
chain; replays from step 0 and from a checkpoint, with 1 or 2 threads, match every record bit
for bit; an edited record, an edited record whose own hash was recomputed, a removed record and
a cut line are each named at the right line; a log forged consistently (a loss changed and
every later hash recomputed) passes the chain check but its replay names the step and field;
usage errors exit 2.
"""
import hashlib
import json
import subprocess

import pytest

MODEL_ENV = "KILN_SMOLLM2_GGUF"


def run(kiln, *args, cwd=None):
    return subprocess.run([str(kiln), *map(str, args)], capture_output=True, text=True, cwd=cwd, timeout=600)


@pytest.fixture(scope="module")
def audited(tmp_path_factory, build_dir, smollm2_gguf):
    """A tiny run of 8 steps with --audit, stopped after 4 and resumed with another thread
    count; checkpoints every 2 steps, all kept."""
    kiln = build_dir / "kiln"
    d = tmp_path_factory.mktemp("audit")
    words = "in the beginning god created the heaven and the earth and the earth was without form".split()
    (d / "t.txt").write_text("\n\n".join(" ".join(words[(i + j) % len(words)] for j in range(120)) for i in range(40)))
    r = run(kiln, "data", "-m", smollm2_gguf, "-o", "d.tok", "t.txt", cwd=d)
    assert r.returncode == 0, r.stderr
    common = ["train", "--config", "tiny", "--tokenizer", smollm2_gguf, "--data", "d.tok", "--steps", "8",
              "--batch", "2", "--seq", "32", "--eval-every", "0", "--save-every", "2", "--keep-last", "0",
              "--audit", "--out", "run"]
    r = run(kiln, *common, "--threads", "2", "--stop-after", "4", cwd=d)
    assert r.returncode == 0, r.stderr
    assert len((d / "run" / "audit.jsonl").read_text().splitlines()) == 5  # header + 4 steps
    r = run(kiln, *common, "--threads", "1", "--resume", cwd=d)
    assert r.returncode == 0, r.stderr
    return kiln, d


def lines(d):
    return (d / "run" / "audit.jsonl").read_text().splitlines()


def rehash(line, prev=None):
    """The line with prev replaced (when given) and its hash recomputed, as a forger would."""
    body = line[:line.rindex(',"hash":"')]
    if prev is not None:
        body = body[:body.rindex(',"prev":"')] + f',"prev":"{prev}"'
    h = hashlib.sha256(body.encode()).hexdigest()
    return body + f',"hash":"{h}"}}', h


def test_chain_and_records(audited):
    kiln, d = audited
    ls = lines(d)
    assert len(ls) == 9
    head = json.loads(ls[0])
    assert head["kind"] == "kiln-train-audit" and head["version"] == 1 and head["argv"][0] == "train"
    prev = "0" * 64
    for i, line in enumerate(ls):
        rec = json.loads(line)
        body = line[:line.rindex(',"hash":"')]
        assert rec["prev"] == prev and rec["hash"] == hashlib.sha256(body.encode()).hexdigest()
        prev = rec["hash"]
        if i:
            assert rec["step"] == i and rec["loss"].startswith("0x") and len(rec["params"]) == 64
    r = run(kiln, "audit", "run", cwd=d)
    assert r.returncode == 0 and "intact: 8 step records (steps 1..8)" in r.stdout, r.stdout + r.stderr


@pytest.mark.parametrize("args", [["--from", "0"], ["--from", "2", "--to", "6", "--threads", "1"],
                                  ["--from", "4", "--threads", "2"]])
def test_replay_matches(audited, args):
    kiln, d = audited
    r = run(kiln, "audit", "run", *args, cwd=d)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "match their records" in r.stderr


def write_log(d, name, ls):
    out = d / name
    if out.exists():
        subprocess.run(["rm", "-rf", str(out)], check=True)
    subprocess.run(["cp", "-r", str(d / "run"), str(out)], check=True)
    (out / "audit.jsonl").write_text("\n".join(ls) + "\n")
    return out


def test_tampering_is_named(audited):
    kiln, d = audited
    ls = lines(d)
    cases = []
    edited = ls.copy()  # a value changed, the hash left
    edited[3] = edited[3].replace('"step":3', '"step":3 ')
    cases.append((edited, "line 4: its hash does not match"))
    forged = ls.copy()  # a value changed and its own hash recomputed: the next line's link breaks
    g = json.loads(ls[3])
    forged[3], _ = rehash(ls[3].replace(g["batch"], "0" * 64))
    cases.append((forged, "line 5: its prev is not the hash"))
    removed = ls[:4] + ls[5:]
    cases.append((removed, "line 5: its prev is not the hash"))
    cases.append((ls[:-1] + [ls[-1][:-10]], "line 9"))
    for i, (bad, msg) in enumerate(cases):
        out = write_log(d, f"bad{i}", bad)
        r = run(kiln, "audit", out, cwd=d)
        assert r.returncode == 1 and msg in r.stderr, (i, r.stderr)


def test_consistent_forgery_fails_the_replay(audited):
    """A forger who changes step 6's loss and recomputes every later hash keeps the chain
    intact; the replay names step 6 and its loss."""
    kiln, d = audited
    ls = lines(d)
    rec = json.loads(ls[6])
    bits = int(rec["loss"], 16) ^ 1
    ls[6], h = rehash(ls[6].replace(rec["loss"], f"0x{bits:016x}"))
    for i in range(7, len(ls)):
        ls[i], h = rehash(ls[i], prev=h)
    out = write_log(d, "forged", ls)
    r = run(kiln, "audit", out, cwd=d)
    assert r.returncode == 0, r.stderr
    r = run(kiln, "audit", out, "--from", "4", cwd=d)
    assert r.returncode == 1, r.stderr
    assert "step 5/8 matches" in r.stderr and "loss: logged" in r.stderr and "step 6 differs" in r.stderr, r.stderr


def test_usage_errors(audited, tmp_path):
    kiln, d = audited
    for args, msg in [([], "RUN"), (["run", "--to", "3"], "--to goes with --from"),
                      (["run", "--from", "8"], "holds steps 1..8"), (["run", "--bogus"], "unknown option")]:
        r = run(kiln, "audit", *args, cwd=d)
        assert r.returncode == 2 and msg in r.stderr, (args, r.stderr)
    r = run(kiln, "audit", tmp_path)  # no log there
    assert r.returncode == 1 and "audit.jsonl" in r.stderr
    r = run(kiln, "audit", "run", "--from", "1", cwd=d)  # no checkpoint of step 1
    assert r.returncode == 1 and "step-1" in r.stderr
