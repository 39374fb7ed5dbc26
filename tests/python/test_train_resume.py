"""Optimizer steps and checkpoints through the training API: AdamW inside kiln against
torch.optim.AdamW on a whole model, resume bit-exactness for every storage variant, refused
checkpoints of another configuration, and a non-finite loss stopped before the weights."""
import numpy as np
import pytest
import torch

import kiln
from test_parity import build_model

torch.set_num_threads(2)


def batches(V, n, seed=11):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, V, size=16).tolist() for _ in range(n)]


def weights(tr):
    return {name: tr.get_param(name, n).copy() for name, n, _ in tr.params()}


def run(tr, data, clip=1.0, lr=3e-3):
    losses = []
    for ids in data:
        losses.append(tr.step(ids))
        tr.clip_grads(clip)
        tr.optimizer_step(lr)
    return losses


def test_adamw_matches_torch_on_a_model(tmp_path, build_dir):
    d, ref = build_model(tmp_path, "qwen2")
    ref = ref.float()
    m = kiln.Model(d)
    tr = kiln.Trainer(m, max_seq=32, n_threads=2, weight_decay=0.1)
    decay = [p for n, p in ref.named_parameters() if not (n.endswith(".bias") or "norm" in n)]
    nodecay = [p for n, p in ref.named_parameters() if n.endswith(".bias") or "norm" in n]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": nodecay, "weight_decay": 0.0}],
                            lr=3e-3, foreach=False)
    data = batches(m.n_vocab, 5)
    for ids in data:
        tr.step(ids)
        tr.clip_grads(1.0)
        tr.optimizer_step(3e-3)
        opt.zero_grad()
        ref(torch.tensor([ids]), labels=torch.tensor([ids])).loss.backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
        opt.step()
    worst = 0.0
    for name, p in ref.named_parameters():
        got = tr.get_param(name, p.numel())
        want = p.detach().numpy().ravel()
        worst = max(worst, float(np.abs(got - want).max()))
    print(f"5 AdamW steps on a model: max |w_kiln - w_torch| = {worst:.3e}")
    # Adam's update m/sqrt(v) is O(1) even for gradients that are pure rounding noise, so f32
    # differences of the forward/backward show up as a small fraction of lr per step; the
    # update rule itself is checked bit for bit in test_adamw.py.
    assert worst <= 0.01 * 3e-3 * len(data)


@pytest.mark.parametrize("storage,moments", [("f32", "f32"), ("bf16_master", "f32"), ("bf16_kahan", "q8"),
                                             ("bf16_sr", "f32")])
def test_resume_is_bit_exact(tmp_path, build_dir, storage, moments):
    d, _ = build_model(tmp_path, "llama")
    m = kiln.Model(d)
    data = batches(m.n_vocab, 6)
    kw = dict(max_seq=32, n_threads=2, storage=storage, moments=moments, seed=5)
    a = kiln.Trainer(m, **kw)
    la = run(a, data)
    b = kiln.Trainer(m, **kw)
    lb = run(b, data[:3])
    b.save(tmp_path / "ck", 3, run_json='{"data_position": 3}')
    b.close()
    c = kiln.Trainer(m, **kw)
    step, run_json = c.load(tmp_path / "ck")
    assert step == 3 and run_json == '{"data_position": 3}'
    lc = run(c, data[3:])
    assert lb + lc == la
    wa, wc = weights(a), weights(c)
    for k in wa:
        assert np.array_equal(wa[k].view(np.uint32), wc[k].view(np.uint32)), k


def test_refused_checkpoints_and_nonfinite(tmp_path, build_dir):
    d, _ = build_model(tmp_path, "llama")
    m = kiln.Model(d)
    a = kiln.Trainer(m, max_seq=32, n_threads=1)
    run(a, batches(m.n_vocab, 1))
    a.save(tmp_path / "ck", 1)
    other = kiln.Trainer(m, max_seq=32, n_threads=1, storage="bf16_master")
    before = weights(other)
    with pytest.raises(kiln.KilnError, match="another configuration"):
        other.load(tmp_path / "ck")
    assert all(np.array_equal(before[k], v) for k, v in weights(other).items())
    with pytest.raises(kiln.KilnError):
        other.load(tmp_path / "missing")
    # a NaN weight makes a non-finite loss: stopped with a clear message, nothing pending
    name, n, _ = a.params()[0]
    w = a.get_param(name, n)
    w[0] = np.nan
    with pytest.raises(kiln.KilnError, match="not finite"):
        a.set_param(name, w)
    desc, mem = a.describe()
    assert mem["params"] > 0 and mem["optimizer"] == 2 * mem["params"] and "adamw" in desc


def test_import_all_and_nonfinite_loss(tmp_path, build_dir):
    d, ref = build_model(tmp_path, "qwen3")
    m = kiln.Model(d)
    tr = kiln.Trainer(m, max_seq=32, n_threads=1)
    sd = {k: v.detach().float().numpy() * 1.5 for k, v in ref.named_parameters()}
    bad = dict(sd)
    bad["model.layers.0.mlp.up_proj.weight"] = bad["model.layers.0.mlp.up_proj.weight"][:-1]  # wrong size
    before = weights(tr)
    with pytest.raises(kiln.KilnError, match="elements"):
        tr.set_params(bad)
    assert all(np.array_equal(before[k], v) for k, v in weights(tr).items())  # nothing written
    tr.set_params(sd)
    for k, v in sd.items():
        assert np.array_equal(tr.get_param(k, v.size), v.ravel()), k
    # weights that overflow the forward: the loss is not finite, stopped before anything else
    huge = {"model.norm.weight": np.full_like(sd["model.norm.weight"], 3e38)}
    tr.set_params(huge)
    ids = list(range(3, 19))
    with pytest.raises(kiln.KilnError, match="not finite"):
        tr.step(ids)
    with pytest.raises(kiln.KilnError, match="no pending step"):
        tr.backward()


# ---- checkpoint damage, settings and fields on resume (issue 34, items 1, 4, 6) -------------

import hashlib  # noqa: E402
import subprocess  # noqa: E402

from test_train_cli import COMMON, TEXT, losses  # noqa: E402


def le(b, off, n=8):
    return int.from_bytes(b[off:off + n], "little")


def entries(b):
    """(name, entry offset) of each table entry of a state.kiln image."""
    n, t = le(b, 24, 4), le(b, 32)
    return [(bytes(b[t + 256 * i:t + 256 * i + 128]).split(b"\0")[0].decode(), t + 256 * i) for i in range(n)]


def reseal(path, b):
    """Write b to path with every section hash, the table hash, the header hash and the
    COMPLETE marker recomputed: a hostile checkpoint that passes every checksum."""
    n, t = le(b, 24, 4), le(b, 32)
    for _, e in entries(b):
        off, size = le(b, e + 176), le(b, e + 184)
        b[e + 192:e + 224] = hashlib.sha256(b[off:off + size]).digest()
    b[48:80] = hashlib.sha256(b[t:t + 256 * n]).digest()
    b[96:128] = hashlib.sha256(b[:96]).digest()
    path.write_bytes(bytes(b))
    (path.parent / "COMPLETE").write_text(f"KILNCKPT-COMPLETE step {le(b, 16)} header-sha256 {b[96:128].hex()}\n")


def section(b, name):
    e = dict(entries(b))[name]
    return le(b, e + 176), le(b, e + 184), e


def test_load_checks_step_and_shapes(tmp_path, build_dir):
    d, _ = build_model(tmp_path, "llama")
    m = kiln.Model(d)
    a = kiln.Trainer(m, max_seq=32, n_threads=1)
    run(a, batches(m.n_vocab, 1))
    a.save(tmp_path / "ck", 3)
    path = tmp_path / "ck" / "step-3" / "state.kiln"
    orig = bytearray(path.read_bytes())
    b = kiln.Trainer(m, max_seq=32, n_threads=1)
    assert b.load(tmp_path / "ck")[0] == 3
    # a parameter (rows, cols) stored as (cols, rows): the same bytes, another shape
    name, e = next((nm, e) for nm, e in entries(orig) if nm.startswith("param/") and le(orig, e + 136, 4) == 2
                   and le(orig, e + 144) != le(orig, e + 152))
    rows, cols = le(orig, e + 144), le(orig, e + 152)
    x = bytearray(orig)
    x[e + 144:e + 152], x[e + 152:e + 160] = orig[e + 152:e + 160], orig[e + 144:e + 152]
    reseal(path, x)
    with pytest.raises(kiln.KilnError, match=rf"step-3/state.kiln: section '{name}' has shape \({cols}, {rows}\); "
                                             rf"the model's is \({rows}, {cols}\)"):
        b.load(tmp_path / "ck")
    # the step section: out of range, and not the header's step
    off, _, _ = section(orig, "step")
    for value, msg in [(2**64 - 1, "section 'step' holds 18446744073709551615, out of range"),
                       (4, "section 'step' holds 4 but the header's step is 3")]:
        x = bytearray(orig)
        x[off:off + 8] = value.to_bytes(8, "little")
        reseal(path, x)
        with pytest.raises(kiln.KilnError, match=msg):
            b.load(tmp_path / "ck")
    # a header step out of range is refused by the container (the checkpoint is not loaded)
    x = bytearray(orig)
    x[16:24] = (2**64 - 1).to_bytes(8, "little")
    reseal(path, x)
    with pytest.raises(kiln.KilnError, match="header step 18446744073709551615 is out of range"):
        b.load(tmp_path / "ck")
    reseal(path, bytearray(orig))
    assert b.load(tmp_path / "ck")[0] == 3


def cli(build_dir, *args):
    return subprocess.run([str(build_dir / "kiln"), *map(str, args)], capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def cli_setup(tmp_path_factory, build_dir):
    base = tmp_path_factory.mktemp("resume_cli")
    d, _ = build_model(base, "llama")
    (base / "corpus.txt").write_text(TEXT)
    r = cli(build_dir, "data", "-m", d, "-o", base / "corpus.tok", base / "corpus.txt")
    assert r.returncode == 0, r.stderr
    return base, d, ["-m", d, "--data", base / "corpus.tok", "--threads", "2", *COMMON]


def test_cli_resume_sets_aside_a_damaged_newest_checkpoint(cli_setup, build_dir):
    base, d, args = cli_setup
    full, part = base / "full", base / "part"
    args = [*args, "--steps", "8"]
    args[args.index("--save-every") + 1] = "2"
    assert cli(build_dir, "train", *args, "--out", full).returncode == 0
    r = cli(build_dir, "train", *args, "--out", part, "--stop-after", "6")
    assert r.returncode == 0, r.stderr[-3000:]
    ck = part / "checkpoints"
    state = ck / "step-6" / "state.kiln"
    b = bytearray(state.read_bytes())
    b[len(b) // 2] ^= 0x20  # inside a section: its checksum no longer matches; COMPLETE stays
    state.write_bytes(bytes(b))
    for attempt in range(2):  # before the fix the second and every later --resume failed too
        r = cli(build_dir, "train", *args, "--out", part, "--resume")
        assert r.returncode == 0, r.stderr[-3000:]
        if attempt == 0:
            assert "passed over a newer checkpoint" in r.stderr and "step-6" in r.stderr
            assert "checksum mismatch" in r.stderr and "set aside as" in r.stderr
            assert "resumed from" in r.stderr and "at step 4" in r.stderr
    aside = list(ck.glob("step-6.rejected-*"))
    assert len(aside) == 1
    reason = (aside[0] / "REASON").read_text()
    assert "checksum mismatch" in reason and "step 6 aside" in reason
    assert (aside[0] / "state.kiln").read_bytes() == bytes(b)  # kept as it was, not deleted
    assert (ck / "step-8" / "COMPLETE").exists()
    assert losses(part) == losses(full)  # resumed from step 4: the uninterrupted run's losses


def run_json_of(state_path):
    b = bytearray(state_path.read_bytes())
    off, size, _ = section(b, "run")
    return bytes(b[off:off + size]).decode()


def test_cli_resume_refuses_other_settings(cli_setup, build_dir):
    base, d, args = cli_setup
    out = base / "hp"
    args = [*args, "--steps", "6"]
    r = cli(build_dir, "train", *args, "--out", out, "--stop-after", "3")
    assert r.returncode == 0, r.stderr[-3000:]

    def with_(**kw):
        a = list(args)
        for k, v in kw.items():
            flag = "--" + k.replace("_", "-")
            if flag in a:
                a[a.index(flag) + 1] = v
            else:
                a += [flag, v]
        return a

    r = cli(build_dir, "train", *with_(lr="1e-3", batch="2"), "--out", out, "--resume")
    assert r.returncode == 1
    assert "--lr: checkpoint 0.003, now 0.001" in r.stderr
    assert "--batch: checkpoint 4, now 2" in r.stderr and "--override-hparams" in r.stderr
    for kw, needle in [(dict(seed="2"), "--seed: checkpoint 1, now 2"), (dict(seq="16"), "--seq: checkpoint 32, now 16"),
                       (dict(warmup="2"), "--warmup: checkpoint 3, now 2"),
                       (dict(schedule="linear"), "--schedule: checkpoint cosine, now linear"),
                       (dict(accum="2"), "--accum: checkpoint 1, now 2"),
                       (dict(min_lr="1e-4"), "--min-lr: checkpoint 0.00030000000000000003, now 0.0001"),
                       (dict(steps="9"), "--steps: checkpoint 6, now 9 (the learning rate")]:
        r = cli(build_dir, "train", *with_(**kw), "--out", out, "--resume")
        assert r.returncode == 1 and needle in r.stderr, (kw, r.stderr[-2000:])
    assert not (out / "checkpoints" / "step-6").exists()
    r = cli(build_dir, "train", *with_(lr="1e-3"), "--out", out, "--override-hparams")
    assert r.returncode == 2 and "--override-hparams goes with --resume" in r.stderr
    # overridden: printed, run to the end, recorded in the checkpoint's run configuration
    r = cli(build_dir, "train", *with_(lr="1e-3"), "--out", out, "--resume", "--override-hparams")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "--override-hparams: --lr 0.003 -> 0.001 from step 3" in r.stderr
    rj = run_json_of(out / "checkpoints" / "step-6" / "state.kiln")
    # --min-lr defaults to lr / 10: it follows
    assert '"lr":0.001,' in rj and '"min_lr":0.0001,' in rj
    assert '"overridden":"at step 3: --lr 0.003 -> 0.001, --min-lr 0.00030000000000000003 -> 0.0001"' in rj


def test_cli_constant_schedule_may_extend_steps(cli_setup, build_dir):
    base, d, args = cli_setup
    out, full = base / "const", base / "const_full"
    args = [*args, "--schedule", "constant"]
    assert cli(build_dir, "train", *args, "--steps", "7", "--out", full).returncode == 0
    r = cli(build_dir, "train", *args, "--steps", "4", "--out", out)
    assert r.returncode == 0, r.stderr[-3000:]
    # the lr of a constant schedule does not depend on --steps: extending is the same run
    r = cli(build_dir, "train", *args, "--steps", "7", "--out", out, "--resume")
    assert r.returncode == 0, r.stderr[-3000:]
    assert [x[:2] for x in losses(out)] == [x[:2] for x in losses(full)]
    r = cli(build_dir, "train", *args, "--steps", "5", "--out", out, "--resume")
    assert r.returncode == 1 and "past --steps 5" in r.stderr


def test_cli_resume_keeps_the_checkpoints_sequences_per_forward(cli_setup, build_dir):
    """--seqs-per-forward left out on --resume: the checkpoint's K (another would change the
    run's bits), the same losses as the uninterrupted run; another K given is refused."""
    base, d, args = cli_setup
    out, full = base / "spf", base / "spf_full"
    args = [*args, "--steps", "6", "--seqs-per-forward", "2"]
    assert cli(build_dir, "train", *args, "--out", full).returncode == 0
    r = cli(build_dir, "train", *args, "--out", out, "--stop-after", "3")
    assert r.returncode == 0, r.stderr[-3000:]
    i = args.index("--seqs-per-forward")
    no_flag = args[:i] + args[i + 2:]
    r = cli(build_dir, "train", *no_flag, "--out", out, "--resume")
    assert r.returncode == 0, r.stderr[-3000:]
    assert losses(out) == losses(full)
    r = cli(build_dir, "train", *no_flag, "--seqs-per-forward", "1", "--steps", "8", "--out", out, "--resume",
            "--schedule", "constant")
    assert r.returncode == 1 and "--seqs-per-forward: checkpoint 2, now 1" in r.stderr, r.stderr[-2000:]
