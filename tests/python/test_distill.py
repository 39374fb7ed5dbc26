"""Distillation (issue 30): kiln's distillation step (kiln.Teacher, Trainer.distill_step,
kiln_train_distill_step) against transformers' models in float64 with autograd -- the loss,
its KL and CE parts, and every student parameter's gradient -- and `kiln distill` on the CLI.

The loss per supervised row: kd_weight * tau^2 * KL(softmax(zt / tau) || softmax(zs / tau))
+ ce_weight * CE(zs, target), zt the teacher's logits (no gradient), zs the student's.
Bounds as test_train_grad.py's: loss within 1e-5 relative, per parameter
||g_kiln - g_torch|| <= 1e-4 ||g_torch||.
"""
import json
from pathlib import Path
import re
import shutil
import subprocess

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import kiln
from test_parity import build_model
from test_train_grad import compare_grads, rand_ids, torch_grads

torch.set_num_threads(2)


def torch_distill(ref_s, ref_t, ids, tg, tau, kd, ce_w, reduction, scale):
    """The loss and its parts (reduced and scaled, parts unweighted) in float64; backward
    of the loss leaves the student's gradients in ref_s."""
    ids_t = torch.tensor(ids)
    with torch.no_grad():
        zt = ref_t(ids_t).logits.reshape(-1, ref_t.config.vocab_size)
    zs = ref_s(ids_t).logits.reshape(-1, ref_s.config.vocab_size)
    tg = torch.tensor(tg).reshape(-1)
    sup = tg >= 0
    zs, zt, tg = zs[sup], zt[sup], tg[sup]
    logp = F.log_softmax(zt / tau, dim=-1)
    logq = F.log_softmax(zs / tau, dim=-1)
    kl = (logp.exp() * (logp - logq)).sum(-1)
    ce = F.cross_entropy(zs, tg, reduction="none")
    red = (lambda x: x.mean()) if reduction == "mean" else (lambda x: x.sum())
    loss = scale * red(kd * tau * tau * kl + ce_w * ce)
    loss.backward()
    return loss.item(), scale * red(kl).item(), scale * red(ce).item()


def batch(m, B, T, seed):
    ids = np.array([rand_ids(T, m.n_vocab, seed + b) for b in range(B)])
    tg = np.concatenate([ids[:, 1:], -np.ones((B, 1), dtype=ids.dtype)], axis=1)
    return ids, tg


@pytest.mark.parametrize("student,tau,kd,ce_w,reduction", [
    ("llama", 2.0, 0.7, 0.3, "mean"),      # untied head
    ("qwen2", 1.0, 0.5, 0.5, "sum"),       # tied head: the KL's gradient reaches the embedding
    ("llama_tied_mqa", 4.0, 1.0, 0.0, "mean"),  # KL alone
    ("llama", 0.5, 0.0, 1.0, "mean"),      # CE alone
])
def test_distill_step_matches_torch(tmp_path, build_dir, student, tau, kd, ce_w, reduction):
    ds, ref_s = build_model(tmp_path, student)
    dt, ref_t = build_model(tmp_path, "qwen3")
    ms, mt = kiln.Model(ds), kiln.Model(dt)
    tr = kiln.Trainer(ms, max_seq=16, n_threads=2, max_batch=2)
    teacher = kiln.Teacher(mt, tr)
    ids, tg = batch(ms, 2, 13, 3)
    tg[1, ::3] = -1
    r = tr.distill_step(teacher, ids, tg, temperature=tau, kd_weight=kd, ce_weight=ce_w,
                        reduction=reduction, scale=0.5)
    loss, kl, ce = torch_distill(ref_s, ref_t, ids, tg, tau, kd, ce_w, reduction, 0.5)
    assert abs(r["loss"] - loss) <= 1e-5 * abs(loss), (r, loss)
    assert abs(r["kl"] - kl) <= 1e-5 * abs(kl) + 1e-7, (r, kl)
    assert abs(r["ce"] - ce) <= 1e-5 * abs(ce), (r, ce)
    assert r["n_supervised"] == int((tg >= 0).sum())
    compare_grads(tr, torch_grads(ref_s), f"distill {student} tau {tau}")

    # the same bits for one thread as for two
    tr1 = kiln.Trainer(ms, max_seq=16, n_threads=1, max_batch=2)
    r1 = tr1.distill_step(kiln.Teacher(mt, tr1), ids, tg, temperature=tau, kd_weight=kd, ce_weight=ce_w,
                          reduction=reduction, scale=0.5)
    assert np.float32(r1["loss"]).view(np.uint32) == np.float32(r["loss"]).view(np.uint32)
    for name, n, _ in tr.params():
        assert np.array_equal(tr.get_grad(name, n).view(np.uint32), tr1.get_grad(name, n).view(np.uint32)), name


def test_accumulate_and_ce_alone_is_the_trainers_loss(tmp_path, build_dir):
    ds, ref_s = build_model(tmp_path, "llama")
    dt, ref_t = build_model(tmp_path, "qwen3")
    ms, mt = kiln.Model(ds), kiln.Model(dt)
    tr = kiln.Trainer(ms, max_seq=16, n_threads=2, max_batch=2)
    teacher = kiln.Teacher(mt, tr)
    a, ta = batch(ms, 2, 10, 11)
    b, tb = batch(ms, 1, 14, 12)
    tr.distill_step(teacher, a, ta, temperature=2.0, kd_weight=0.5, ce_weight=0.5, scale=0.25)
    tr.distill_step(teacher, b, tb, temperature=2.0, kd_weight=0.5, ce_weight=0.5, scale=0.25, accumulate=True)
    torch_distill(ref_s, ref_t, a, ta, 2.0, 0.5, 0.5, "mean", 0.25)
    torch_distill(ref_s, ref_t, b, tb, 2.0, 0.5, 0.5, "mean", 0.25)
    compare_grads(tr, torch_grads(ref_s), "distill accumulate")

    # kd_weight 0: the cross-entropy step's loss, within rounding (another summation order)
    ce_only = tr.distill_step(teacher, a, ta, kd_weight=0.0, ce_weight=1.0)["loss"]
    plain = tr.step_batch(a, ta)
    assert abs(ce_only - plain) <= 1e-5 * abs(plain), (ce_only, plain)


def test_refusals_and_lifetimes(tmp_path, build_dir):
    ds, _ = build_model(tmp_path, "llama")
    dt, _ = build_model(tmp_path, "qwen3")
    ms, mt = kiln.Model(ds), kiln.Model(dt)
    tr = kiln.Trainer(ms, max_seq=16, n_threads=1, max_batch=2)
    other = kiln.Trainer(ms, max_seq=16, n_threads=1, max_batch=2)
    teacher = kiln.Teacher(mt, tr)
    ids, tg = batch(ms, 2, 8, 5)
    with pytest.raises(ValueError, match="made for this trainer"):
        other.distill_step(teacher, ids, tg)
    for kw, msg in [(dict(temperature=0.0), "temperature"), (dict(kd_weight=0.0, ce_weight=0.0, hidden_weight=0.0), "not all 0"),
                    (dict(kd_weight=-1.0), "kd_weight")]:
        with pytest.raises(kiln.KilnError, match=msg):
            tr.distill_step(teacher, ids, tg, **kw)
    with pytest.raises(kiln.KilnError, match="max_seq|made for"):
        tr.distill_step(teacher, np.zeros((2, 17), np.int32), np.zeros((2, 17), np.int32))
    bad = tg.copy()
    bad[0, 2] = ms.n_vocab
    with pytest.raises(kiln.KilnError, match="out of range"):
        tr.distill_step(teacher, ids, bad)
    with pytest.raises(kiln.KilnError, match="no supervised"):
        tr.distill_step(teacher, ids, np.full_like(tg, -1))
    r = tr.distill_step(teacher, ids, tg)  # the failures left nothing behind
    assert np.isfinite(r["loss"]) and r["kl"] > 0

    # another tokenizer (the same size, two tokens swapped) is refused
    dx = tmp_path / "other-tok"
    shutil.copytree(dt, dx)
    tok = json.loads((dx / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    k1, k2 = [k for k, v in vocab.items() if v in (300, 301)]
    vocab[k1], vocab[k2] = vocab[k2], vocab[k1]
    (dx / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(kiln.KilnError, match="tokenizer"):
        kiln.Teacher(kiln.Model(dx), tr)

    # a trainer's close closes its teachers first; the teacher model closes after them
    tr.close()
    assert teacher._raw is None
    mt.close()
    assert mt._raw is None  # no user left: closed at once


def cuda_trainer(ms, **kw):
    """A trainer on CUDA device 0, or a skip where there is none (the GPU check fails a skip)."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    try:
        return kiln.Trainer(ms, device=0, **kw)
    except kiln.KilnError as e:
        pytest.skip(f"kiln has no CUDA device: {e.message}")


@pytest.mark.parametrize("fmt", ["f32", "mx16"])
def test_distill_cuda_has_the_cpus_bits(tmp_path, build_dir, fmt):
    """The distillation step on CUDA (the teacher's forward, the fused distillation loss and
    the student's backward on the device) in auditable mode and in mx16: three optimizer steps
    with the CPU's bits -- the losses and their parts, every gradient and every weight."""
    ds, _ = build_model(tmp_path, "qwen2")
    dt, _ = build_model(tmp_path, "qwen3")
    ms, mt = kiln.Model(ds), kiln.Model(dt)
    kw = dict(max_seq=16, max_batch=2, lr=1e-2, format=fmt)
    gpu = cuda_trainer(ms, **kw)
    cpu = kiln.Trainer(ms, n_threads=2, **kw)
    tg_gpu, tg_cpu = kiln.Teacher(mt, gpu), kiln.Teacher(mt, cpu)
    for step in range(3):
        ids, tg = batch(ms, 2, 13, 20 + step)
        tg[step % 2, ::4] = -1
        r = [tr.distill_step(t, ids, tg, temperature=2.0, kd_weight=0.7, ce_weight=0.3, scale=0.5)
             for tr, t in ((gpu, tg_gpu), (cpu, tg_cpu))]
        for k in ("loss", "kl", "ce"):
            assert np.float32(r[0][k]).view(np.uint32) == np.float32(r[1][k]).view(np.uint32), (step, k, r)
        for name, n, _ in cpu.params():
            assert np.array_equal(gpu.get_grad(name, n).view(np.uint32), cpu.get_grad(name, n).view(np.uint32)), \
                (step, name)
        for tr in (gpu, cpu):
            tr.clip_grads(1.0)
            tr.optimizer_step(1e-2)
    for name, n, _ in cpu.params():
        assert np.array_equal(gpu.get_param(name, n).view(np.uint32), cpu.get_param(name, n).view(np.uint32)), name


@pytest.mark.parametrize("loss_kind", ["mse", "cosine"])
def test_distill_cuda_hidden_matching_has_the_cpus_bits(tmp_path, build_dir, loss_kind):
    """Hidden-state matching on CUDA (a wider teacher: trained projections) in auditable mode:
    two optimizer steps with the CPU's bits, the projections' gradients and weights included."""
    ds, _ = build_model(tmp_path, "llama")
    dt, _ = build_wide_teacher(tmp_path)
    ms, mt = kiln.Model(ds), kiln.Model(dt)
    pairs = [(1, 2), (2, 3)]
    extra = kiln.hidden_projections(mt, ms, len(pairs))
    kw = dict(max_seq=16, max_batch=2, extra=extra, seed=5, lr=1e-2)
    gpu = cuda_trainer(ms, **kw)
    cpu = kiln.Trainer(ms, n_threads=2, **kw)
    teachers = [kiln.Teacher(mt, tr, hidden=pairs, hidden_loss=loss_kind) for tr in (gpu, cpu)]
    for step in range(2):
        ids, tg = batch(ms, 2, 11, 40 + step)
        tg[0, ::4] = -1
        r = [tr.distill_step(t, ids, tg, temperature=2.0, kd_weight=0.6, ce_weight=0.4, hidden_weight=0.7)
             for tr, t in zip((gpu, cpu), teachers)]
        for k in ("loss", "kl", "ce", "hidden"):
            assert np.float32(r[0][k]).view(np.uint32) == np.float32(r[1][k]).view(np.uint32), (step, k, r)
        for name, n, _ in cpu.params():
            assert np.array_equal(gpu.get_grad(name, n).view(np.uint32), cpu.get_grad(name, n).view(np.uint32)), \
                (step, name)
        for tr in (gpu, cpu):
            tr.optimizer_step(1e-2)
    for name, n, _ in cpu.params():
        assert np.array_equal(gpu.get_param(name, n).view(np.uint32), cpu.get_param(name, n).view(np.uint32)), name


def test_distill_cuda_fast_matches_the_cpu(tmp_path, build_dir):
    """Fast mode (bf16 tensor-core products): the step's loss and gradients within bf16
    rounding of the CPU's."""
    ds, _ = build_model(tmp_path, "qwen2")
    dt, _ = build_model(tmp_path, "qwen3")
    ms, mt = kiln.Model(ds), kiln.Model(dt)
    gpu = cuda_trainer(ms, max_seq=16, max_batch=2, fast=True)
    cpu = kiln.Trainer(ms, max_seq=16, max_batch=2, n_threads=2)
    ids, tg = batch(ms, 2, 13, 31)
    r = [tr.distill_step(kiln.Teacher(mt, tr), ids, tg, temperature=2.0, kd_weight=0.7, ce_weight=0.3)
         for tr in (gpu, cpu)]
    assert abs(r[0]["loss"] - r[1]["loss"]) <= 2e-2 * abs(r[1]["loss"]), r
    for name, n, _ in cpu.params():
        g, c = gpu.get_grad(name, n), cpu.get_grad(name, n)
        assert np.linalg.norm(g - c) <= 5e-2 * np.linalg.norm(c) + 1e-6, name


def shard(kiln_bin, tok_model, tmp_path):
    text = tmp_path / "corpus.txt"
    rng = np.random.default_rng(0)
    words = "the quick brown fox jumps over lazy dog river stone tree light house blue green red".split()
    text.write_text("\n\n".join(" ".join(rng.choice(words, 200)) for _ in range(60)))
    out = tmp_path / "data.tok"
    subprocess.run([str(kiln_bin), "data", "-m", str(tok_model), "-o", str(out), str(text)], check=True,
                   capture_output=True)
    return out


def test_kiln_distill_cli_lowers_the_kl(tmp_path, build_dir):
    """A teacher trained by `kiln train` on a small corpus, then `kiln distill` of a new
    student from it (KL alone): the KL falls; the run writes the model and its metrics; in
    mx16 the KL falls along f32's."""
    kiln_bin = build_dir / "kiln"
    dt, _ = build_model(tmp_path, "qwen3")  # its tokenizer
    data = shard(kiln_bin, dt, tmp_path)
    common = ["--config", "tiny", "--tokenizer", str(dt), "--data", str(data), "--batch", "4", "--seq", "32",
              "--lr", "3e-3", "--warmup", "2", "--eval-every", "0", "--save-every", "0", "--threads", "2"]
    p = subprocess.run([str(kiln_bin), "train", *common, "--steps", "60", "--out", str(tmp_path / "teacher")],
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    teacher = tmp_path / "teacher" / "model"
    out = tmp_path / "run"
    p = subprocess.run([str(kiln_bin), "distill", "--teacher", str(teacher), *common, "--steps", "30", "--seed", "2",
                        "--temperature", "2", "--alpha", "1", "--out", str(out)],
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "[kiln distill] teacher" in p.stderr
    kls = [float(x) for x in re.findall(r"\(kl ([0-9.]+) ce", p.stderr)]
    assert len(kls) >= 3, p.stderr[-2000:]
    assert kls[-1] < 0.5 * kls[0], kls
    assert (out / "model" / "config.json").exists() and (out / "metrics.csv").exists()

    # in an exact format (the teacher's forward and the student's products, its head's in the
    # fused KL too): the KL falls along f32's
    p = subprocess.run([str(kiln_bin), "distill", "--teacher", str(teacher), *common, "--steps", "30", "--seed", "2",
                        "--temperature", "2", "--alpha", "1", "--format", "mx16", "--out", str(tmp_path / "run16")],
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    kls16 = [float(x) for x in re.findall(r"\(kl ([0-9.]+) ce", p.stderr)]
    print("kl f32", kls, "mx16", kls16)
    assert len(kls16) == len(kls) and kls16[-1] < 0.5 * kls16[0], kls16
    assert abs(kls16[-1] - kls[-1]) < 0.1 * kls[-1], (kls16, kls)

    # usage errors name what is wrong
    for args, msg in [([], "--teacher MODEL is required"), (["--teacher", str(teacher), "--alpha", "2"], "--alpha")]:
        q = subprocess.run([str(kiln_bin), "distill", "--config", "tiny", "--data", str(data)] + args,
                           capture_output=True, text=True)
        assert q.returncode == 2 and msg in q.stderr, q.stderr


# ---- hidden-state matching --------------------------------------------------------------------

def build_wide_teacher(tmp_path):
    """A llama teacher 96 wide with 3 layers (the students are 64 wide, 2 layers), on the same
    tokenizer as build_model's."""
    import transformers as tf
    from transformers import AutoModelForCausalLM
    from test_parity import COMMON, make_tokenizer
    d = tmp_path / "wide"
    d.mkdir()
    make_tokenizer(d)
    cfg = tf.LlamaConfig(**{**COMMON, "hidden_size": 96, "intermediate_size": 200, "num_hidden_layers": 3},
                         tie_word_embeddings=False)
    torch.manual_seed(99)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(d)
    return d, AutoModelForCausalLM.from_pretrained(d, dtype=torch.float64).eval()


def torch_distill_hidden(ref_s, ref_t, ids, tg, tau, kd, ce_w, hw, pairs, projs, loss_kind, scale):
    """torch_distill's loss plus hw x the hidden-state loss over the supervised rows (mean over
    them): pair k's rows of ref_s's hidden_states[s] projected by projs[k] (None: equal widths)
    against ref_t's hidden_states[t]. Returns (loss, kl, ce, hidden); backward leaves the
    gradients in ref_s and in the projections."""
    ids_t = torch.tensor(ids)
    with torch.no_grad():
        out_t = ref_t(ids_t, output_hidden_states=True)
    out_s = ref_s(ids_t, output_hidden_states=True)
    V = ref_s.config.vocab_size
    zs, zt = out_s.logits.reshape(-1, V), out_t.logits.reshape(-1, ref_t.config.vocab_size)
    tgf = torch.tensor(tg).reshape(-1)
    sup = tgf >= 0
    S = int(sup.sum())
    logp = F.log_softmax(zt[sup] / tau, dim=-1)
    logq = F.log_softmax(zs[sup] / tau, dim=-1)
    kl = (logp.exp() * (logp - logq)).sum(-1).sum() / S
    ce = F.cross_entropy(zs[sup], tgf[sup], reduction="sum") / S
    hid = 0
    for (s, t), P in zip(pairs, projs):
        hs = out_s.hidden_states[s].reshape(-1, ref_s.config.hidden_size)[sup]
        ht = out_t.hidden_states[t].reshape(-1, ref_t.config.hidden_size)[sup]
        y = hs @ P.T if P is not None else hs
        if loss_kind == "mse":
            hid = hid + ((y - ht) ** 2).mean(-1).sum() / S
        else:
            hid = hid + (1 - F.cosine_similarity(y, ht, dim=-1, eps=1e-8)).sum() / S
    loss = scale * (kd * tau * tau * kl + ce_w * ce + hw * hid)
    loss.backward()
    return loss.item(), scale * kl.item(), scale * ce.item(), scale * (hid.item() if torch.is_tensor(hid) else 0.0)


@pytest.mark.parametrize("loss_kind,wide,pairs", [
    ("mse", True, [(1, 2), (2, 3)]),      # projections 96 x 64, the student's last layer included
    ("cosine", True, [(2, 1)]),
    ("mse", False, [(1, 1), (2, 2)]),     # equal widths: no projection
])
def test_hidden_matching_matches_torch(tmp_path, build_dir, loss_kind, wide, pairs):
    """The distillation step with hidden-state matching against transformers in float64: the
    loss and its parts, every student gradient and each projection's gradient. The last layer's
    output is matched before the final norm (transformers' hidden_states[L] is after it, so the
    oracle taps the layer's output with a hook there)."""
    ds, ref_s = build_model(tmp_path, "llama")
    dt, ref_t = build_wide_teacher(tmp_path) if wide else build_model(tmp_path, "qwen3")
    ms, mt = kiln.Model(ds), kiln.Model(dt)
    extra = kiln.hidden_projections(mt, ms, len(pairs))
    assert len(extra) == (len(pairs) if wide else 0)
    tr = kiln.Trainer(ms, max_seq=16, n_threads=2, max_batch=2, extra=extra, seed=5)
    teacher = kiln.Teacher(mt, tr, hidden=pairs, hidden_loss=loss_kind)
    ids, tg = batch(ms, 2, 11, 8)
    tg[0, ::4] = -1
    r = tr.distill_step(teacher, ids, tg, temperature=2.0, kd_weight=0.6, ce_weight=0.4, hidden_weight=0.7, scale=0.5)

    # the projections as kiln made them: normal(0, 1 / cols)
    projs = []
    for name, rows, cols in extra:
        w = tr.get_param(name, rows * cols).astype(np.float64).reshape(rows, cols)
        assert abs(w.std() * np.sqrt(cols) - 1) < 0.1, w.std()
        projs.append(torch.tensor(w, requires_grad=True))
    # transformers' last hidden state is after the final norm: take the last layer's output
    hooks, outs = [], {}
    for ref, key in ((ref_s, "s"), (ref_t, "t")):
        hooks.append(ref.model.layers[-1].register_forward_hook(
            lambda mod, inp, out, key=key: outs.__setitem__(key, out[0] if isinstance(out, tuple) else out)))
    L_s, L_t = ref_s.config.num_hidden_layers, ref_t.config.num_hidden_layers

    class Tapped:
        def __init__(self, ref, key, L):
            self.ref, self.key, self.L, self.config = ref, key, L, ref.config

        def __call__(self, ids_t, output_hidden_states):
            o = self.ref(ids_t, output_hidden_states=True)
            hs = list(o.hidden_states)
            hs[self.L] = outs[self.key]
            return type("O", (), {"logits": o.logits, "hidden_states": hs})

    loss, kl, ce, hid = torch_distill_hidden(Tapped(ref_s, "s", L_s), Tapped(ref_t, "t", L_t), ids, tg, 2.0, 0.6, 0.4,
                                             0.7, pairs, projs if wide else [None] * len(pairs), loss_kind, 0.5)
    for h in hooks:
        h.remove()
    assert abs(r["hidden"] - hid) <= 1e-5 * abs(hid), (r, hid)
    assert abs(r["loss"] - loss) <= 1e-5 * abs(loss), (r, loss)
    assert abs(r["kl"] - kl) <= 1e-5 * abs(kl) + 1e-7 and abs(r["ce"] - ce) <= 1e-5 * abs(ce), (r, kl, ce)
    want = torch_grads(ref_s)
    for (name, _, _), P in zip(extra, projs):
        want[name] = P.grad.numpy()
    compare_grads(tr, want, f"hidden {loss_kind} {pairs}")

    # one thread: the same bits
    tr1 = kiln.Trainer(ms, max_seq=16, n_threads=1, max_batch=2, extra=extra, seed=5)
    r1 = tr1.distill_step(kiln.Teacher(mt, tr1, hidden=pairs, hidden_loss=loss_kind), ids, tg, temperature=2.0,
                          kd_weight=0.6, ce_weight=0.4, hidden_weight=0.7, scale=0.5)
    assert np.float32(r1["loss"]).view(np.uint32) == np.float32(r["loss"]).view(np.uint32)
    for name, n, _ in tr.params():
        assert np.array_equal(tr.get_grad(name, n).view(np.uint32), tr1.get_grad(name, n).view(np.uint32)), name


def test_hidden_matching_refusals(tmp_path, build_dir):
    ds, _ = build_model(tmp_path, "llama")
    dt, _ = build_wide_teacher(tmp_path)
    ms, mt = kiln.Model(ds), kiln.Model(dt)
    tr = kiln.Trainer(ms, max_seq=16, n_threads=1, max_batch=2)
    with pytest.raises(kiln.KilnError, match=r"needs the projection 'distill.hidden.0.proj', a 96 x 64 matrix"):
        kiln.Teacher(mt, tr, hidden=[(1, 1)])
    tr2 = kiln.Trainer(ms, max_seq=16, n_threads=1, max_batch=2, extra=kiln.hidden_projections(mt, ms, 2))
    for pairs, msg in [([(3, 1)], "the student's layers are 1..2, the teacher's 1..3"),
                       ([(1, 4)], "the teacher's 1..3"), ([(1, 1), (2, 1)], "share a layer")]:
        with pytest.raises(kiln.KilnError, match=msg):
            kiln.Teacher(mt, tr2, hidden=pairs)
    with pytest.raises(kiln.KilnError, match="has the name of a parameter of the model"):
        kiln.Trainer(ms, max_seq=16, extra=[("lm_head.weight", 2, 2)])
    with pytest.raises(kiln.KilnError, match=r"\[A-Za-z0-9_.-\]"):
        kiln.Trainer(ms, max_seq=16, extra=[("a b", 2, 2)])
    # the extras come after the model's parameters (the CLI test checks they are not exported)
    t = kiln.Teacher(mt, tr2, hidden=[(1, 2), (2, 3)])
    ids, tg = batch(ms, 2, 8, 1)
    r = tr2.distill_step(t, ids, tg, kd_weight=0.0, ce_weight=0.0, hidden_weight=1.0)  # the hidden loss alone
    assert r["hidden"] > 0 and r["loss"] == r["hidden"]
    names = [n for n, _, _ in tr2.params()]
    assert names[-2:] == ["distill.hidden.0.proj", "distill.hidden.1.proj"]


@pytest.mark.parametrize("arch", ["gemma3", "qwen35"])
def test_hidden_matching_other_architectures(tmp_path, build_dir, arch):
    """The taps of Gemma 3 (sliding-window layers, sandwich norms) and Qwen3.5 (linear-attention
    layers): two tiny random models of one architecture (its own tokenizer), the student's layers
    1 and 3 matched to the teacher's 3 and 2, against transformers in float64."""
    import sys
    from transformers import AutoModelForCausalLM
    script = Path(__file__).resolve().parents[2] / "scripts" / f"make_tiny_{arch}.py"
    ds, dt = tmp_path / "student", tmp_path / "teacher"
    for d, seed in ((ds, 5), (dt, 6)):
        subprocess.run([sys.executable, str(script), str(d), "--seed", str(seed)], check=True, capture_output=True)
    ref_s = AutoModelForCausalLM.from_pretrained(ds, dtype=torch.float64).eval()
    ref_t = AutoModelForCausalLM.from_pretrained(dt, dtype=torch.float64).eval()
    ms, mt = kiln.Model(ds), kiln.Model(dt)
    pairs = [(1, 3), (3, 2)]
    tr = kiln.Trainer(ms, max_seq=16, n_threads=2, max_batch=2)
    teacher = kiln.Teacher(mt, tr, hidden=pairs)
    ids, tg = batch(ms, 2, 12, 4)
    r = tr.distill_step(teacher, ids, tg, temperature=1.5, kd_weight=0.5, ce_weight=0.5, hidden_weight=2.0)
    loss, _, _, hid = torch_distill_hidden(ref_s, ref_t, ids, tg, 1.5, 0.5, 0.5, 2.0, pairs, [None, None], "mse", 1.0)
    assert abs(r["hidden"] - hid) <= 1e-5 * abs(hid), (r, hid)
    assert abs(r["loss"] - loss) <= 1e-5 * abs(loss), (r, loss)
    compare_grads(tr, torch_grads(ref_s), f"hidden {arch}")


def test_kiln_distill_cli_hidden_map(tmp_path, build_dir):
    """`kiln distill --hidden-map` with a teacher wider than the student: the projections are
    trained (the hidden part falls), kept in the checkpoints (a resume with another map is
    refused; with the same map it goes on), and not exported."""
    kiln_bin = build_dir / "kiln"
    dt, _ = build_wide_teacher(tmp_path)
    data = shard(kiln_bin, dt, tmp_path)
    out = tmp_path / "run"
    common = ["--teacher", str(dt), "--config", "tiny", "--data", str(data), "--batch", "4", "--seq", "32",
              "--lr", "3e-3", "--warmup", "2", "--eval-every", "0", "--save-every", "10", "--threads", "2",
              "--hidden-map", "1:2,2:3", "--hidden-weight", "0.5", "--out", str(out)]
    p = subprocess.run([str(kiln_bin), "distill", *common, "--steps", "20", "--stop-after", "10"],
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    hid0 = float(re.findall(r"hidden ([0-9.]+)\)", p.stderr)[0])  # step 1
    assert "[kiln distill] hidden states 1:2,2:3 (mse, weight 0.5): a projection a pair" in p.stderr, p.stderr
    ck = out / "checkpoints" / "step-10" / "state.kiln"
    assert b"param/distill.hidden.1.proj" in ck.read_bytes()
    bad = [c if c != "1:2,2:3" else "1:1,2:3" for c in common]
    q = subprocess.run([str(kiln_bin), "distill", *bad, "--steps", "20", "--resume"], capture_output=True, text=True)
    assert q.returncode != 0 and "--hidden-map" in q.stderr and "1:2,2:3" in q.stderr, q.stderr[-2000:]
    p = subprocess.run([str(kiln_bin), "distill", *common, "--steps", "20", "--resume"], capture_output=True, text=True,
                       timeout=600)
    assert p.returncode == 0 and "at step 10" in p.stderr, p.stderr[-3000:]
    hid = [float(x) for x in re.findall(r"hidden ([0-9.]+)\)", p.stderr)]
    assert hid and hid[-1] < hid0, (hid0, hid, p.stderr[-2000:])  # the projections and the student learn
    from safetensors.numpy import load_file
    keys = set(load_file(str(out / "model" / "model.safetensors")))
    assert keys and not any(k.startswith("distill.") for k in keys), keys
    # `kiln export` of the run later: the checkpoint's configuration names the projections'
    # shapes, so its trainer loads it; they are left out again
    e = subprocess.run([str(kiln_bin), "export", str(out), "-o", str(tmp_path / "exported")], capture_output=True,
                       text=True)
    assert e.returncode == 0, e.stderr[-2000:]
    assert set(load_file(str(tmp_path / "exported" / "model.safetensors"))) == keys
    # usage errors
    for args, msg in [(["--hidden-map", "1-2"], "--hidden-map takes"), (["--hidden-loss", "l1"], "mse or cosine"),
                      (["--hidden-weight", "2"], "need --hidden-map")]:
        r = subprocess.run([str(kiln_bin), "distill", "--teacher", str(dt), "--config", "tiny", "--data", str(data),
                            *args], capture_output=True, text=True)
        assert r.returncode == 2 and msg in r.stderr, r.stderr


def test_kiln_distill_cli_cuda_has_the_cpus_bits(tmp_path, build_dir):
    """`kiln distill --device cuda` (a wider teacher, hidden-state matching through projections)
    exports the very student `--device cpu` does: the same bytes after 4 steps."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    kiln_bin = build_dir / "kiln"
    dt, _ = build_wide_teacher(tmp_path)
    data = shard(kiln_bin, dt, tmp_path)
    outs = {}
    for dev in ("cpu", "cuda"):
        outs[dev] = tmp_path / f"run-{dev}"
        p = subprocess.run([str(kiln_bin), "distill", "--teacher", str(dt), "--config", "tiny", "--data", str(data),
                            "--batch", "4", "--seq", "32", "--lr", "3e-3", "--warmup", "2", "--eval-every", "0",
                            "--save-every", "0", "--threads", "2", "--hidden-map", "1:2,2:3", "--temperature", "2",
                            "--steps", "4", "--device", dev, "--out", str(outs[dev])],
                           capture_output=True, text=True, timeout=600)
        if dev == "cuda" and p.returncode != 0 and "no usable CUDA device" in p.stderr:
            pytest.skip("kiln has no CUDA device")
        assert p.returncode == 0, (dev, p.stderr[-3000:])
    a, b = ((outs[d] / "model" / "model.safetensors").read_bytes() for d in ("cpu", "cuda"))
    assert a == b

