"""Data-parallel training (docs/DISTRIBUTED.md, "Data-parallel training"): `mpirun -np N kiln
train` against one process with the same global batch, bit for bit -- the losses and gradient
norms of every step, and the final checkpoint's every weight and the whole AdamW state (moments,
master copy, Kahan compensation, step) -- for f32, bf16 + master and bf16 + Kahan storage, an
untied and a tied (MQA) llama; a 2-rank run's checkpoint resumed on 1 and on 4 ranks equals the
uninterrupted run; the optimizer state per rank is 1/N of one process's (kiln's own accounting);
the refusals; a rank that stops before the others does not leave them waiting.

The equalities: N ranks with one micro-batch of K = B / N sequences each (the default) equal one
process with --seqs-per-forward K (N micro-batches of K, accumulated); see the doc for why one
micro-batch per rank. Skipped when mpirun is absent or kiln was built without MPI."""
import json
import os
import random
import re
from pathlib import Path
import shutil
import signal
import subprocess
import time

import numpy as np
import pytest

from test_parity import build_model
from test_train_cli import TEXT

MPIRUN = shutil.which("mpirun")
pytestmark = pytest.mark.skipif(MPIRUN is None, reason="mpirun not installed (Open MPI: apt-get install openmpi-bin)")

ENV = {**os.environ, "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1", "OMPI_MCA_rmaps_base_oversubscribe": "1"}


def mpi_flags():
    v = subprocess.run([MPIRUN, "--version"], capture_output=True, text=True, env=ENV).stdout
    # Open MPI 4.1 in a container without network: shared memory only, more ranks than cores
    return ["--oversubscribe", "--mca", "btl", "self,vader", "--mca", "btl_vader_single_copy_mechanism", "none"] \
        if "Open MPI" in v or "OpenRTE" in v else []


def kiln(build_dir, n, *args, timeout=300, chunk=None):
    """kiln on n ranks (n 1: one process, no mpirun); chunk: KILN_DP_CHUNK, the elements of a
    rank's range the collectives move at once (small: many chunk boundaries)."""
    cmd = [str(build_dir / "kiln"), *map(str, args)]
    env = dict(ENV)
    if chunk:
        env["KILN_DP_CHUNK"] = str(chunk)
    if n > 1:
        flags = mpi_flags()
        if chunk and flags:
            flags += ["-x", "KILN_DP_CHUNK"]
        cmd = [MPIRUN, *flags, "-np", str(n), *cmd]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)


def le(b, off, n=8):
    return int.from_bytes(b[off:off + n], "little")


def sections(path):
    """{name: bytes} of a state.kiln or a shard (docs/TRAINING_FORMATS.md), all but the run settings."""
    b = path.read_bytes()
    n, t = le(b, 24, 4), le(b, 32)
    out = {}
    for i in range(n):
        e = t + 256 * i
        name = bytes(b[e:e + 128]).split(b"\0")[0].decode()
        off, size = le(b, e + 176), le(b, e + 184)
        if name != "run":
            out[name] = b[off:off + size]
    return out


def widen16(b):
    """bf16 (or any u16) bits as the 4-byte words of the flat vector: the bits in the high half."""
    a = np.frombuffer(b, dtype="<u2").astype("<u4") << 16
    return a.tobytes()


def adamw_arrays(blob):
    """{slot name: [arrays]} of an optimizer blob (src/train/adamw.c kiln_adamw_save; f32 moments):
    m and v (f32), then the master copy (f32, bf16 + master) or the compensation (bf16, Kahan)."""
    assert blob[:8] == b"KILNADMW"
    weights, moments, n_params = le(blob, 12, 4), le(blob, 16, 4), le(blob, 20, 4)
    assert moments == 0
    o, slots = 80, []
    for _ in range(n_params):
        ln = le(blob, o, 4)
        name = blob[o + 4:o + 4 + ln].decode()
        n = le(blob, o + 4 + ln)
        slots.append((name, n))
        o += 4 + ln + 8 + 4
    out = {}
    for name, n in slots:
        arrs = [blob[o:o + 4 * n], blob[o + 4 * n:o + 8 * n]]
        o += 8 * n
        if weights == 1:
            arrs.append(blob[o:o + 4 * n])
            o += 4 * n
        elif weights == 2:
            arrs.append(widen16(blob[o:o + 2 * n]))
            o += 2 * n
        out[name] = (arrs, weights)
    assert blob[o:o + 8] == b"ADMWEND\0"
    return out


def flat_state(step_dir):
    """The whole training state of a checkpoint, whatever wrote it, as the flat vector's arrays
    (docs/DISTRIBUTED.md, "Checkpoints"): {"flat/weight", "flat/m", "flat/v", "flat/master" or
    "flat/compensation": bytes of 4-byte words, "optimizer/step": int, "config": bytes}. A set of
    shards: each array the shards' pieces in rank order. One process's state.kiln: the
    parameters and the optimizers' slots put in the trainer's order."""
    one = step_dir / "state.kiln"
    if one.exists():
        sec = sections(one)
        cfg = json.loads(sec["config"])
        storage = cfg["weight_storage"]
        opt = {**adamw_arrays(sec["optimizer/matrices"]), **adamw_arrays(sec["optimizer/vectors"])}
        out = {"flat/weight": b"", "flat/m": b"", "flat/v": b""}
        extra = {1: "flat/master", 2: "flat/compensation"}.get(storage)
        if extra:
            out[extra] = b""
        for name, n in cfg["params"]:
            w = sec[f"param/{name}"]
            out["flat/weight"] += w if len(w) == 4 * n else widen16(w)
            arrs, kind = opt[name]
            out["flat/m"] += arrs[0]
            out["flat/v"] += arrs[1]
            if extra:
                out[extra] += arrs[2] if kind else bytes(4 * n)  # vectors: no master, no compensation
        out["optimizer/step"] = le(sec["optimizer/matrices"], 32)
        out["config"] = sec["config"]
        return out
    files = sorted(step_dir.glob("shard-*-of-*.kiln"))
    assert files, f"{step_dir}: neither state.kiln nor shards"
    marker = (step_dir / "COMPLETE").read_text().splitlines()
    assert marker[0].endswith(f"shards {len(files)}") and len(marker) == 1 + len(files), marker
    out = {}
    for f in files:
        sec = sections(f)
        for k, v in sec.items():
            if k.startswith("flat/"):
                out[k] = out.get(k, b"") + v
        out["optimizer/step"] = le(sec["optimizer/step"], 0)
        out["config"] = sec["config"]
    return out
def steps(run):
    """(step, loss, grad_norm) texts of metrics.csv: 17 significant digits, so equal texts are
    equal bits."""
    lines = (run / "metrics.csv").read_text().splitlines()
    head = lines[0].split(",")
    i, j = head.index("loss"), head.index("grad_norm")
    return [(r.split(",")[0], r.split(",")[i], r.split(",")[j]) for r in lines[1:]]


def same_run(a, b, step):
    assert steps(a) == steps(b)
    sa, sb = (flat_state(r / "checkpoints" / f"step-{step}") for r in (a, b))
    assert sa.keys() == sb.keys()
    differ = [k for k in sa if sa[k] != sb[k]]
    assert not differ, differ
    assert {"flat/weight", "flat/m", "flat/v"} <= sa.keys() and sa["optimizer/step"] == step


@pytest.fixture(scope="module")
def setup(tmp_path_factory, build_dir):
    base = tmp_path_factory.mktemp("dp")
    models = {name: build_model(base, name)[0] for name in ("llama", "llama_tied_mqa")}
    (base / "corpus.txt").write_text(TEXT)
    r = kiln(build_dir, 1, "data", "-m", models["llama"], "-o", base / "corpus.tok", base / "corpus.txt")
    assert r.returncode == 0, r.stderr
    r = kiln(build_dir, 2, "train", "-m", models["llama"], "--data", base / "corpus.tok", "--steps", "1", "--batch", "2",
             "--seq", "8", "--out", base / "probe", "--no-export")
    if "built without MPI" in r.stderr:
        pytest.skip("kiln was built without MPI (KILN_MPI)")
    assert r.returncode == 0, r.stderr[-3000:]
    return base, models


def common(models, model, base, storage):
    return ["-m", models[model], "--data", base / "corpus.tok", "--threads", "1", "--batch", "4", "--seq", "32",
            "--lr", "3e-3", "--warmup", "2", "--steps", "5", "--save-every", "0", "--no-export",
            "--eval-fraction", "0", "--storage", storage]


@pytest.mark.parametrize("model,storage,chunk,fmt,zero", [("llama", "f32", None, None, 3), ("llama", "f32", None, None, 2),
                                                          ("llama", "bf16_master", None, None, 3),
                                                          ("llama", "bf16_kahan", 333, None, 3),
                                                          ("llama", "bf16_kahan", 333, None, 2),
                                                          ("llama_tied_mqa", "f32", None, None, 3),
                                                          ("llama", "bf16_master", None, "mx16", 3),
                                                          ("llama", "f32", None, "mx8:stochastic", 3)])
def test_ranks_equal_one_process(setup, build_dir, model, storage, chunk, fmt, zero):
    """fmt: every product in an exact block format (its bits do not depend on the rank count
    either: each rank's products are the one process's micro-batch products; "mx8:stochastic"
    the gradients rounded stochastically, keyed by the micro-batch's place in the step, not the
    rank). zero: the ZeRO
    stage (3, the default: the weights sharded too, each layer gathered for its work; 2: every
    rank keeps the whole weights)."""
    base, models = setup
    fmt, _, rounding = (fmt or "").partition(":")
    args = (common(models, model, base, storage) + (["--format", fmt] if fmt else [])
            + (["--format-rounding", rounding] if rounding else []) + ["--zero", zero])
    tag = f"{model}_{storage}_{fmt}{rounding}_{zero}"
    for n, k in [(2, 2), (4, 1)]:
        one, many = base / f"one_{tag}_{k}", base / f"np{n}_{tag}"
        r = kiln(build_dir, 1, "train", *args, "--seqs-per-forward", k, "--out", one)
        assert r.returncode == 0, r.stderr[-3000:]
        r = kiln(build_dir, n, "train", *args, "--out", many, chunk=chunk)
        assert r.returncode == 0, r.stderr[-3000:]
        assert f"[kiln train] {n} ranks (mpi): the global batch of 4 sequences as {n} micro-batches of {k}" in r.stderr
        assert r.stderr.count("step 5/5") == 1  # rank 0 alone reports
        assert r.stderr.count(f"of {n} (ZeRO-{zero})") == n  # every rank's closing line
        if chunk:  # the collectives moved the ranges in chunks of 333 elements
            assert re.search(r"staging 0\.0 MiB", r.stderr), r.stderr[-2000:]
        same_run(one, many, 5)
        # clipping was active: the norms are the clip's input
        assert any(float(g) > 1.0 for _, _, g in steps(many))


def test_resume_on_other_rank_counts(setup, build_dir):
    """A 2-rank run stopped at step 3 and resumed on 1 process and on 4 ranks: the uninterrupted
    2-rank run's losses, weights and optimizer state. (The checkpoint's --seqs-per-forward 2 is
    kept: 4 ranks run its 2 micro-batches on ranks 0 and 1, ranks 2 and 3 hold only their share
    of the optimizer state.)"""
    base, models = setup
    args = common(models, "llama", base, "bf16_master")
    args[args.index("--steps") + 1] = "6"
    full = base / "resume_full"
    r = kiln(build_dir, 2, "train", *args, "--out", full)
    assert r.returncode == 0, r.stderr[-3000:]
    for n in (1, 4):
        part = base / f"resume_on_{n}"
        r = kiln(build_dir, 2, "train", *args, "--out", part, "--stop-after", "3")
        assert r.returncode == 0, r.stderr[-3000:]
        assert (part / "checkpoints" / "step-3" / "COMPLETE").exists()
        r = kiln(build_dir, n, "train", *args, "--out", part, "--resume", chunk=1000 if n == 4 else None)
        assert r.returncode == 0, r.stderr[-3000:]
        assert "resumed from" in r.stderr and "at step 3" in r.stderr
        same_run(full, part, 6)
    # a 4-rank run (1 sequence a micro-batch) cannot continue on 2 ranks: its 4 micro-batches
    # would be 2 a rank; said so, nothing written
    part = base / "resume_4_on_2"
    r = kiln(build_dir, 4, "train", *args, "--out", part, "--stop-after", "2")
    assert r.returncode == 0, r.stderr[-3000:]
    r = kiln(build_dir, 2, "train", *args, "--out", part, "--resume")
    assert r.returncode != 0 and "is 4 micro-batches, more than the 2 ranks" in r.stderr, r.stderr[-2000:]
    assert not (part / "checkpoints" / "step-3").exists()


def test_sharded_checkpoint_sets(setup, build_dir):
    """N ranks save a set: one shard a rank (its range of the weights and the optimizer state)
    and a COMPLETE manifest naming every shard's header hash. A 4-rank run stopped at step 3
    resumes on one process (re-sharded 4 -> 1) to the uninterrupted run's state. A set missing a
    shard, or holding a shard of another save, is refused by name and set aside on resume; the
    run goes on from the set before it."""
    base, models = setup
    args = common(models, "llama", base, "bf16_kahan")
    args[args.index("--steps") + 1] = "6"
    full = base / "sets_full"
    r = kiln(build_dir, 4, "train", *args, "--out", full, "--save-every", "3")
    assert r.returncode == 0, r.stderr[-3000:]
    s3 = full / "checkpoints" / "step-3"
    assert sorted(p.name for p in s3.iterdir()) == ["COMPLETE"] + [f"shard-{k:05d}-of-00004.kiln" for k in range(4)]
    # each shard holds a quarter of the flat vector (the last one may be short)
    total = len(flat_state(s3)["flat/m"]) // 4
    for k in range(4):
        sec = sections(s3 / f"shard-{k:05d}-of-00004.kiln")
        lo, hi = le(sec["shard/lo"], 0), le(sec["shard/hi"], 0)
        assert lo == k * -(-total // 4) and hi == min(lo + -(-total // 4), total) and len(sec["flat/m"]) == 4 * (hi - lo)
    part = base / "sets_4_on_1"
    r = kiln(build_dir, 4, "train", *args, "--out", part, "--save-every", "3", "--stop-after", "3")
    assert r.returncode == 0, r.stderr[-3000:]
    r = kiln(build_dir, 1, "train", *args, "--out", part, "--save-every", "3", "--resume")
    assert r.returncode == 0 and "at step 3" in r.stderr, r.stderr[-3000:]
    assert (part / "checkpoints" / "step-6" / "state.kiln").exists()  # one process writes one file
    same_run(full, part, 6)
    # `kiln export` reads a set as it reads one file
    r = kiln(build_dir, 1, "export", full, "-o", base / "sets_export")
    assert r.returncode == 0 and (base / "sets_export" / "config.json").exists(), r.stderr[-2000:]

    # damaged sets: a shard gone; a shard of step 3 in step 6's set
    for damage, needle in [("missing", "shard 2 of 4 (shard-00002-of-00004.kiln) is missing"),
                           ("mixed", "the marker does not match")]:
        run = base / f"sets_{damage}"
        shutil.copytree(full, run)
        s6 = run / "checkpoints" / "step-6"
        if damage == "missing":
            (s6 / "shard-00002-of-00004.kiln").unlink()
        else:
            shutil.copy(run / "checkpoints" / "step-3" / "shard-00001-of-00004.kiln", s6 / "shard-00001-of-00004.kiln")
        r = kiln(build_dir, 4, "train", *args, "--out", run, "--save-every", "3", "--resume")
        assert r.returncode == 0 and "at step 3" in r.stderr and needle in r.stderr, r.stderr[:3000]
        assert list((run / "checkpoints").glob("step-6.rejected-*")), "the damaged set is set aside"
        same_run(full, run, 6)


def kill_session(sid):
    """SIGKILL every process of session sid and wait until none is left, reaped ones included:
    mpirun and its ranks (Open MPI gives each rank a process group of its own, so killing mpirun's
    group would leave the ranks running on, still writing the run's files while the next attempt
    starts; and a checkpoint writer's pid that is not reaped yet still counts as alive to the next
    run's housekeeping). The leader sid itself is the caller's child, for the caller to reap."""
    os.kill(sid, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while True:
        live = []
        for d in os.listdir("/proc"):
            try:
                if d.isdigit() and int(d) != sid and os.getsid(int(d)) == sid:
                    live.append(int(d))
            except OSError:
                pass
        if not live:
            return
        for pid in live:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        assert time.monotonic() < deadline, f"processes of session {sid} outlived SIGKILL: {live}"
        time.sleep(0.01)


def test_kill_during_saves(setup, build_dir):
    """kill -9 of every rank at random moments of a run that saves every step (so most kills
    land in a save: a shard half written, the manifest not yet there): each time the newest
    complete set loads, and the run resumed to its end equals the uninterrupted run."""
    base, models = setup
    args = common(models, "llama", base, "f32")
    args[args.index("--steps") + 1] = "60"
    args[args.index("--save-every") + 1] = "1"
    args += ["--keep-last", "3"]
    full = base / "kill_full"
    t0 = time.monotonic()
    r = kiln(build_dir, 2, "train", *args, "--out", full)
    assert r.returncode == 0, r.stderr[-3000:]
    wall = time.monotonic() - t0
    run = base / "kill_run"
    rng = random.Random(7)
    cmd = [MPIRUN, *mpi_flags(), "-np", "2", str(build_dir / "kiln"), "train", *map(str, args), "--out", str(run)]
    kills, debris = 0, 0
    for attempt in range(6):
        p = subprocess.Popen(cmd + (["--resume"] if attempt else []), env=ENV, stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE, start_new_session=True)
        try:
            # from the first complete checkpoint on (before it, a resume has nothing to load)
            while p.poll() is None and not list((run / "checkpoints").glob("step-*/COMPLETE")):
                time.sleep(0.005)
            p.wait(timeout=rng.uniform(0.0, 0.5) * wall)
        except subprocess.TimeoutExpired:
            kill_session(p.pid)  # mpirun and every rank
            p.wait()
            kills += 1
        err = p.stderr.read().decode(errors="replace")
        p.stderr.close()
        if p.returncode == 0:
            break
        ck = run / "checkpoints"
        if ck.exists():
            debris += any(".tmp-" in d.name or (d.is_dir() and not (d / "COMPLETE").exists()) for d in ck.iterdir())
        if attempt and "resumed from" not in err and p.returncode != -9:
            raise AssertionError(err[-3000:])
    print(f"{kills} kills, {debris} left a partial save behind")
    r = kiln(build_dir, 2, "train", *args, "--out", run, "--resume")
    assert r.returncode == 0, r.stderr[-3000:]
    assert kills >= 3
    same_run(full, run, 60)
    assert not [d for d in (run / "checkpoints").iterdir() if ".tmp-" in d.name]  # housekeeping removed them


def optimizer_bytes(stderr):
    """Rank 0's optimizer-owned bytes (matrices + vectors) from the run header."""
    return sum(int(x) for x in re.findall(r"optimizer-owned (\d+) B", stderr))


def test_optimizer_memory_per_rank(setup, build_dir):
    base, models = setup
    args = common(models, "llama", base, "bf16_master")
    args[args.index("--steps") + 1] = "1"
    got = {}
    for n in (1, 2, 4):
        r = kiln(build_dir, n, "train", *args, "--out", base / f"mem{n}")
        assert r.returncode == 0, r.stderr[-3000:]
        got[n] = optimizer_bytes(r.stderr)
        if n > 1:
            m = re.search(r"data-parallel rank 0 of (\d+): optimizer state for elements \[(\d+), (\d+)\) of (\d+)", r.stderr)
            assert m and int(m[1]) == n and int(m[2]) == 0
            total = int(m[4])
            assert int(m[3]) == -(-total // n)  # S = ceil(total / N)
    print("optimizer bytes of rank 0 at 1/2/4 ranks:", got)
    for n in (2, 4):
        # bf16 + master: 12 B a matrix element, 8 a vector element; a range mixes them
        assert got[1] / n * 0.95 <= got[n] <= got[1] / n * 1.05, got


def held_lines(stderr):
    """Each rank's closing line of a ZeRO-3 run: {rank: (held, whole, range, window, resident MiB)}."""
    out = {}
    for m in re.finditer(r"rank (\d+) of \d+ \(ZeRO-3\): weights held at most (\d+) of (\d+) bytes \(its range (\d+), "
                         r"a step's window up to (\d+)\).*?resident set ([\d.]+) MiB", stderr):
        out[int(m[1])] = tuple(int(x) for x in m.groups()[1:5]) + (float(m[6]),)
    return out


def test_zero3_weights_memory_per_rank(setup, build_dir):
    """ZeRO-3: what a rank holds of the weights (kiln's count) is its range, every vector, and at
    most one layer and the rest (embedding, final norm) at once; that falls as 1/N plus the
    window. --config small (6 layers of 192, the test tokenizer's 400 tokens: the layers are most
    of the model). And the system's count agrees: a 19M-parameter model's resident set after the
    run is at least the released weights and gradients below ZeRO-2's, and so is its peak (a
    ZeRO-3 rank's trainer is made holding its range alone: kiln_train_create_rank)."""
    base, models = setup
    args = ["--config", "small", "--tokenizer", models["llama"], "--data", base / "corpus.tok", "--threads", "1",
            "--batch", "4", "--seq", "32", "--steps", "2", "--no-export", "--eval-fraction", "0.1",
            "--eval-every", "1"]
    held = {}
    for n in (2, 4):
        r = kiln(build_dir, n, "train", *args, "--out", base / f"z3mem{n}")
        assert r.returncode == 0, r.stderr[-3000:]
        h = held_lines(r.stderr)
        assert sorted(h) == list(range(n)), r.stderr[-3000:]
        for rk, (w, whole, own, window, _) in h.items():
            # the range is 1/N of the flat vector (in bytes: f32 here), the peak that plus the window
            assert abs(own - whole / n) <= 0.01 * whole, (n, rk, h)
            assert own <= w <= own + window + 0.01 * whole, (n, rk, h)
        held[n] = max(w for w, *_ in h.values()) / h[0][1]
    print("ZeRO-3 weights held at most (fraction of the whole) at 2 / 4 ranks:", held)
    assert held[2] < 0.75 and held[4] < 0.5 and held[4] < held[2]
    # the system's count: ZeRO-2 against ZeRO-3, same run, a model whose weights are 76 MB
    big = ["--config", "base", "--tokenizer", models["llama"], "--data", base / "corpus.tok", "--threads", "1",
           "--batch", "2", "--seq", "16", "--steps", "1", "--no-export", "--eval-fraction", "0"]
    rss, peak = {}, {}
    for zero in (2, 3):
        r = kiln(build_dir, 2, "train", *big, "--zero", zero, "--out", base / f"z3rss{zero}")
        assert r.returncode == 0, r.stderr[-3000:]
        m = re.search(r"rank 0 of 2 \(ZeRO-\d\):.*?resident set ([\d.]+) MiB, peak ([\d.]+) MiB", r.stderr)
        rss[zero], peak[zero] = float(m[1]), float(m[2])
        if zero == 3:
            w, whole, own, window, _ = held_lines(r.stderr)[0]
    released = 2 * (whole - w) / 1048576  # the weights and the gradients rank 0 does not hold
    print(f"rank 0's resident set after the run: ZeRO-2 {rss[2]} MiB, ZeRO-3 {rss[3]} MiB; peak {peak[2]} and "
          f"{peak[3]} MiB (kiln's count of the released weights and gradients: {released:.1f} MiB)")
    assert rss[3] <= rss[2] - 0.9 * released, (rss, released)
    assert peak[3] <= peak[2] - 0.9 * released, (peak, released)
    # the source model's initial weights (--config: 76 MB on every rank) are given back once the
    # trainer has its copy (kiln_train_release_source), and a ZeRO-3 rank consumes them as it
    # copies them (kiln_train_create_rank with consume): they never sit whole beside the trainer,
    # so its peak stays within half of them of where the run ends
    assert rss[2] <= peak[2] - 0.5 * whole / 1048576, (rss, peak, whole)
    assert peak[3] <= rss[3] + 0.5 * whole / 1048576, (rss, peak, whole)
    same_run(base / "z3rss2", base / "z3rss3", 1)  # consumed, not damaged: the same weights


def test_zero3_evaluation_equals_one_process(setup, build_dir):
    """An evaluation on ZeRO-3 ranks (every rank runs it: its forwards gather the layers) gives
    the one process's eval losses, bit for bit, and so does ZeRO-2's (rank 0 alone)."""
    base, models = setup
    args = common(models, "llama", base, "f32")
    args[args.index("--eval-fraction") + 1] = "0.1"
    args += ["--eval-every", "2"]

    def evals(run):
        lines = (run / "metrics.csv").read_text().splitlines()
        i = lines[0].split(",").index("eval_loss")
        return [r.split(",")[i] for r in lines[1:]]

    one = base / "ev_one"
    r = kiln(build_dir, 1, "train", *args, "--seqs-per-forward", "2", "--out", one)
    assert r.returncode == 0, r.stderr[-3000:]
    want = evals(one)
    assert sum(1 for e in want if e not in ("", "nan")) == 3, want  # steps 2, 4 and the last
    for zero in (3, 2):
        run = base / f"ev_np2_{zero}"
        r = kiln(build_dir, 2, "train", *args, "--zero", zero, "--out", run)
        assert r.returncode == 0, r.stderr[-3000:]
        assert evals(run) == want, (zero, evals(run), want)
        same_run(one, run, 5)


@pytest.mark.parametrize("arch", ["gemma3", "qwen35"])
def test_zero3_other_architectures(setup, build_dir, tmp_path, arch):
    """The layer events of Gemma 3's loops (sandwich norms, sliding windows, the norms' 1 + w
    multipliers made from the rest's vectors before the layers) and Qwen3.5's (linear-attention
    layers, convolution taps among the vectors): 2 ZeRO-3 ranks equal one process, bit for bit."""
    import sys
    base, _ = setup
    script = Path(__file__).resolve().parents[2] / "scripts" / f"make_tiny_{arch}.py"
    model = tmp_path / arch
    subprocess.run([sys.executable, str(script), str(model), "--seed", "7"], check=True, capture_output=True)
    r = kiln(build_dir, 1, "data", "-m", model, "-o", tmp_path / "corpus.tok", base / "corpus.txt")
    assert r.returncode == 0, r.stderr
    args = ["-m", model, "--data", tmp_path / "corpus.tok", "--threads", "1", "--batch", "4", "--seq", "16",
            "--lr", "3e-3", "--warmup", "1", "--steps", "3", "--save-every", "0", "--no-export",
            "--eval-fraction", "0"]
    one, many = tmp_path / "one", tmp_path / "np2"
    r = kiln(build_dir, 1, "train", *args, "--seqs-per-forward", "2", "--out", one)
    assert r.returncode == 0, r.stderr[-3000:]
    r = kiln(build_dir, 2, "train", *args, "--out", many)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stderr.count("of 2 (ZeRO-3)") == 2
    same_run(one, many, 3)


def test_refusals_and_a_rank_that_stops(setup, build_dir):
    base, models = setup
    args = common(models, "llama", base, "f32")
    for extra, needle in [(["--accum", "2"], "--accum > 1"), (["--batch", "3"], "--batch 3 is not a multiple of the 2 ranks"),
                          (["--storage", "bf16_sr"], "stochastic rounding with 2 ranks is not supported yet"),
                          (["--seqs-per-forward", "1"], "is 4 micro-batches, more than the 2 ranks")]:
        a = list(args)
        for i in range(0, len(extra), 2):
            if extra[i] in a:
                a[a.index(extra[i]) + 1] = extra[i + 1]
            else:
                a += extra[i:i + 2]
        r = kiln(build_dir, 2, "train", *a, "--out", base / "refused", timeout=120)
        assert r.returncode != 0 and needle in r.stderr, (extra, r.stderr[-2000:])
    # rank 0 refuses a used --out (no --resume): the other ranks stop too, none waits for ever
    used = base / "used"
    used.mkdir()
    (used / "x").write_text("x")
    r = kiln(build_dir, 2, "train", *args, "--out", used, timeout=120)
    assert r.returncode == 2 and "is not empty" in r.stderr  # rank 0's usage status, on every rank


@pytest.mark.parametrize("storage", ["f32", "bf16_master"])
def test_device_path_rank_equals_one_process(setup, build_dir, storage):
    """CPU and GPU ranks together (`mpirun -np 2 kiln train --device cpu,cuda`: over MPI, the GPU
    rank's pieces downloaded to host memory for each collective and uploaded back) run the device
    path of src/train/trainer_dp.c on the GPU rank. Here on the CPU: KILN_DP_DEVICE_PATH=1 gives
    rank 1's CPU trainer that path (its downloads and uploads are copies), rank 0 the host path,
    and the chunks of 333 elements cross tensors: the two ranks equal one process bit for bit.
    The GPU's own run is test_train_gpu_ranks.py's."""
    base, models = setup
    args = [str(build_dir / "kiln"), "train", *map(str, common(models, "llama", base, storage)),
            "--device", "cpu,cpu"]
    one, many = base / f"one_devpath_{storage}", base / f"np2_devpath_{storage}"
    r = kiln(build_dir, 1, "train", *common(models, "llama", base, storage), "--seqs-per-forward", 2, "--out", one)
    assert r.returncode == 0, r.stderr[-3000:]
    env = {**ENV, "KILN_DP_CHUNK": "333"}
    flags = mpi_flags() + (["-x", "KILN_DP_CHUNK"] if mpi_flags() else [])
    cmd = [MPIRUN, *flags, "-np", "1", *args, "--out", str(many), ":",
           "-np", "1", "env", "KILN_DP_DEVICE_PATH=1", *args, "--out", str(many)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "2 ranks (mpi)" in r.stderr and r.stderr.count("of 2 (ZeRO-2)") == 2, r.stderr[-2000:]
    assert r.stderr.count("staged through host memory") == 1, r.stderr[-2000:]  # rank 1 only
    same_run(one, many, 5)
    # the list's refusals: one device a rank, the auditable arithmetic, ZeRO-2
    a = [*args[2:], "--out", base / "refused_list"]
    r = kiln(build_dir, 2, "train", *[x if x != "cpu,cpu" else "cpu,cpu,cpu" for x in a], timeout=120)
    assert r.returncode == 2 and "names 3 devices for 2 ranks" in r.stderr, r.stderr[-2000:]
    for extra, needle in [(["--zero", "3"], "not with --zero 3"), (["--fast"], "--fast")]:
        r = kiln(build_dir, 2, "train", *a, *extra, timeout=120)
        assert r.returncode == 2 and needle in r.stderr, (extra, r.stderr[-2000:])
    r = kiln(build_dir, 2, "train", *[x if x != "cpu,cpu" else "cpu,gpu" for x in a], timeout=120)
    assert r.returncode == 2 and "--device 'gpu'" in r.stderr, r.stderr[-2000:]


@pytest.mark.parametrize("storage", ["bf16_master", "bf16_kahan"])
def test_device_path_resumes_a_set(setup, build_dir, storage):
    """A set of shards loads into a GPU trainer, one process or a rank, through the device path
    (the weights uploaded a chunk at a time, each optimizer slot's state gathered in a host copy
    and uploaded once; src/train/trainer_dp.c dev_state_write). On the CPU, KILN_DP_DEVICE_PATH=1
    gives a CPU trainer that path: a 2-rank run's set of step 3 resumed by one process and by two
    ranks (rank 1 on the device path) equals the uninterrupted run (moments, master copy or Kahan
    compensation, weights). The GPU's own runs are test_train_gpu_ranks.py's."""
    base, models = setup
    args = [*map(str, common(models, "llama", base, storage)), "--zero", "2"]
    args[args.index("--steps") + 1] = "6"
    full = base / f"devload_full_{storage}"
    r = kiln(build_dir, 2, "train", *args, "--out", full)
    assert r.returncode == 0, r.stderr[-3000:]
    kbin = str(build_dir / "kiln")
    for how in ("one", "ranks"):
        part = base / f"devload_{how}_{storage}"
        r = kiln(build_dir, 2, "train", *args, "--out", part, "--stop-after", "3")
        assert r.returncode == 0, r.stderr[-3000:]
        if how == "one":
            r = subprocess.run([kbin, "train", *args, "--out", str(part), "--resume", "--seqs-per-forward", "2"],
                               capture_output=True, text=True, timeout=300, env={**ENV, "KILN_DP_DEVICE_PATH": "1"})
        else:
            tail = ["train", *args, "--out", str(part), "--resume"]
            cmd = [MPIRUN, *mpi_flags(), "-np", "1", kbin, *tail, ":", "-np", "1", "env", "KILN_DP_DEVICE_PATH=1",
                   kbin, *tail]
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=ENV)
        assert r.returncode == 0 and "at step 3" in r.stderr, r.stderr[-3000:]
        same_run(full, part, 6)


@pytest.mark.parametrize("hidden", [False, True])
def test_distill_ranks_equal_one_process(setup, build_dir, hidden):
    """`mpirun -np N kiln distill`: every rank holds the whole teacher and runs its forward over
    the rank's own sequences; the student is sharded as `kiln train`'s. A new student (--config
    tiny, the teacher's tokenizer) distilled on 2 and on 4 ranks equals one process with the
    same micro-batches: the losses, their KL and CE parts, the gradient norms, and the final
    checkpoint's weights and AdamW state, bit for bit. hidden: a teacher 96 wide (the student
    64) with hidden-state matching, whose projections are sharded with the student."""
    base, models = setup
    args = common(models, "llama", base, "bf16_master")
    teacher = models["llama"]
    if hidden:
        from test_distill import build_wide_teacher
        teacher = base / "wide" if (base / "wide").exists() else build_wide_teacher(base)[0]
    args[args.index("-m"):args.index("-m") + 2] = ["--teacher", teacher, "--config", "tiny"]
    args += ["--temperature", "2", "--alpha", "0.7", "--seed", "3"]
    if hidden:
        args += ["--hidden-map", "1:2,2:3", "--hidden-loss", "cosine"]

    def parts(stderr):
        return re.findall(r"step (\d+)/\d+ loss \S+ \(kl (\S+) ce (\S+)( hidden \S+)?\)", stderr)

    for n, k in [(2, 2), (4, 1)]:
        one, many = base / f"kd{hidden:d}_one_{k}", base / f"kd{hidden:d}_np{n}"
        r1 = kiln(build_dir, 1, "distill", *args, "--seqs-per-forward", k, "--out", one)
        assert r1.returncode == 0, r1.stderr[-3000:]
        r = kiln(build_dir, n, "distill", *args, "--out", many)
        assert r.returncode == 0, r.stderr[-3000:]
        assert r.stderr.count("[kiln distill] teacher") == 1  # rank 0 alone reports
        assert f"{n} ranks (mpi): the global batch of 4 sequences as {n} micro-batches of {k}" in r.stderr
        assert parts(r.stderr) and parts(r.stderr) == parts(r1.stderr), (parts(r.stderr), parts(r1.stderr))
        same_run(one, many, 5)


def test_audit_of_ranks_replays_on_one_process(setup, build_dir):
    """A 2-rank run with --audit (rank 0 keeps the log, whose command line gets the ranks' chosen
    --seqs-per-forward): `kiln audit --from 0` and `--from 2` replay it on one process and every
    step's batch hash, loss, gradient-norm bits and weights' fingerprint match."""
    base, models = setup
    args = common(models, "llama", base, "f32")
    args[args.index("--steps") + 1] = "4"
    args[args.index("--save-every") + 1] = "2"
    out = base / "audited"
    r = kiln(build_dir, 2, "train", *args, "--out", out, "--audit")
    assert r.returncode == 0, r.stderr[-3000:]
    for frm in ("0", "2"):
        r = kiln(build_dir, 1, "audit", out, "--from", frm)
        assert r.returncode == 0, r.stderr[-3000:]
        assert "match their records" in r.stderr
