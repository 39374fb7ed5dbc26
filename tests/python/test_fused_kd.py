"""kiln's fused distillation loss (src/ops/fused_kd.h, driven through tests/tools/kd_tool) against
torch in float64 on materialised logits -- KL(softmax(Z/tau) || softmax(s/tau)) * tau^2 and the
hard cross-entropy -- with autograd for the gradients of the hidden states and of the weight;
and its properties: the same bits for any thread count and SIMD path, accumulation is one
addition onto the caller's buffers, kd_weight 0 / ce_weight 1 is kiln_fused_ce's bits, a
strided teacher is read only where it lies, the scratch does not grow with N.

Bounds (docs/ARITHMETIC.md, "Fused distillation loss", "Tolerance against float64"):
  - ce within 1e-5 relative; kl_n within 1e-5 |kl_n| + 2^-22 (1 + L_n / tau), L_n the row's
    largest |logit| of teacher and student (the KL is a small difference of terms of size
    L_n / tau), the reduced kl and the loss accordingly; with a teacher far from the student
    (the "random" cases) loss, kl and ce within 1e-5 relative, as the cross-entropy's;
  - every element of dh and dW within 1e-5 of the largest element of the same product on the
    terms' magnitudes, |g| <= gs (kd_weight tau (q + p) + ce_weight (softmax + onehot)); with a
    far teacher also within 1e-5 of the largest element of the float64 gradient, as the
    cross-entropy's. As the teacher approaches the student the gradient (q - p) vanishes while
    the error of the f32 logits s = h W^T does not.
"""
import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from test_fused_ce import make_case as make_ce_case

REPO = Path(__file__).resolve().parents[2]
BUILD = Path(os.environ.get("KILN_BUILD_DIR", REPO / "build"))
TOOL = BUILD / "kd_tool"
CE_TOOL = BUILD / "ce_tool"

LOSS_RTOL = 1e-5
GRAD_TOL = 1e-5
OUTPUTS = ("dh.f32", "dw.f32", "row_kl.f32", "row_ce.f32")


@pytest.fixture(scope="module")
def tool():
    if not TOOL.exists():
        pytest.fail(f"{TOOL} not found: build first (cmake --build {BUILD})")
    return TOOL


def make_case(tmp, rng, N, H, V, mask=True, ignore=True, wdtype="f32", teacher="random",
              teacher_ld=0):
    """test_fused_ce's case (h, W in [-2, 2], targets, mask) and the teacher's logits Z,
    written to tmp. teacher: "random" (independent, logits ~ N(0, 2^2)), "near" (the student's
    float64 logits plus N(0, 0.3^2) noise: a small KL) or "close" (plus N(0, 0.01^2): a tiny
    KL and gradient). With teacher_ld > V the file has ld columns, the padding NaN (never
    read)."""
    h, w, t, m = make_ce_case(tmp, rng, N, H, V, mask, ignore, wdtype, wscale=2.0)
    if teacher == "random":
        z = rng.normal(0, 2, (N, V))
    else:
        noise = 0.3 if teacher == "near" else 0.01
        z = h.astype(np.float64) @ w.astype(np.float64).T + rng.normal(0, noise, (N, V))
    z = z.astype(np.float32)
    zfile = z
    if teacher_ld > V:
        zfile = np.full((N, teacher_ld), np.nan, dtype=np.float32)
        zfile[:, :V] = z
    zfile.tofile(tmp / "teacher.f32")
    return h, w, z, t, m


def run_tool(tmp, N, H, V, env=None, **opts):
    cmd = [str(TOOL), "run", str(tmp), str(N), str(H), str(V)]
    cmd += [f"{k}={v!r}" if isinstance(v, float) else f"{k}={v}" for k, v in opts.items()]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                          env={**os.environ, **(env or {})})


def run_ok(tmp, N, H, V, env=None, **opts):
    r = run_tool(tmp, N, H, V, env=env, **opts)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def supervised(t, m):
    return (t >= 0) & (m.astype(bool) if m is not None else True)


def torch_reference(h, w, z, t, m, tau, kd, ce, red, scale):
    """The float64 reference: a dict with loss, kl, ce (reduced), dh, dw, row_kl, row_ce (N,
    0 at unsupervised rows), S, and the bounds' scales: kl_abs (N: 2^-22 (1 + L_n / tau),
    0 at unsupervised rows), mag_dh and mag_dw (the products on the terms' magnitudes)."""
    h64 = torch.tensor(h, dtype=torch.float64, requires_grad=True)
    w64 = torch.tensor(w, dtype=torch.float64, requires_grad=True)
    sup = torch.tensor(supervised(t, m))
    tt = torch.tensor(t, dtype=torch.int64)[sup]
    s = (h64 @ w64.T)[sup]
    zs = torch.tensor(z, dtype=torch.float64)[sup]
    logp = F.log_softmax(zs / tau, dim=-1)
    logq = F.log_softmax(s / tau, dim=-1)
    row_kl = (logp.exp() * (logp - logq)).sum(-1)
    row_ce = torch.logsumexp(s, dim=-1) - s.gather(1, tt[:, None])[:, 0]
    row_loss = kd * tau * tau * row_kl + ce * row_ce
    S = int(sup.sum())
    div = S if red == "mean" else 1
    loss = row_loss.sum() / div * scale
    loss.backward()
    sup_np = sup.numpy()
    out = {"loss": loss.item(), "kl": row_kl.sum().item() / div * scale,
           "ce": row_ce.sum().item() / div * scale, "dh": h64.grad.numpy(),
           "dw": w64.grad.numpy(), "S": S}
    for name, rows in (("row_kl", row_kl), ("row_ce", row_ce)):
        out[name] = np.zeros(len(t))
        out[name][sup_np] = rows.detach().numpy()
    with torch.no_grad():
        L = torch.maximum(s.abs().amax(-1), zs.abs().amax(-1))
        out["kl_abs"] = np.zeros(len(t))
        out["kl_abs"][sup_np] = (2.0 ** -22 * (1 + L / tau)).numpy()
        onehot = F.one_hot(tt, s.shape[1]).double()
        g_mag = abs(scale) / div * (kd * tau * (logq.exp() + logp.exp())
                                    + ce * (F.softmax(s, -1) + onehot))
        out["mag_dh"] = (g_mag @ w64.abs()).max().item()
        out["mag_dw"] = (g_mag.T @ h64[sup].abs()).max().item()
    out["kl_tol"] = 1e-5 * abs(out["kl"]) + out["kl_abs"].sum() / div * abs(scale)
    out["loss_tol"] = 1e-5 * abs(out["loss"]) + kd * tau * tau * (out["kl_tol"]
                                                                  - 1e-5 * abs(out["kl"]))
    return out


def check_against(tmp, out, ref, N, H, V, far):
    """out (the tool's JSON) and the files in tmp against ref within the module's bounds; far:
    also the cross-entropy's bounds (a teacher far from the student)."""
    assert out["n_supervised"] == ref["S"]
    dh = read_out(tmp, "dh.f32", (N, H))
    dw = read_out(tmp, "dw.f32", (V, H))
    rkl = np.fromfile(tmp / "row_kl.f32", dtype=np.float32)
    rce = np.fromfile(tmp / "row_ce.f32", dtype=np.float32)
    dh_err, dw_err = np.abs(dh - ref["dh"]).max(), np.abs(dw - ref["dw"]).max()
    print(f"loss {out['loss']:.9g} vs {ref['loss']:.12g} (rel {rel(out['loss'], ref['loss']):.1e}),"
          f" kl {out['kl']:.9g} vs {ref['kl']:.12g} (rel {rel(out['kl'], ref['kl']):.1e}), "
          f"ce rel {rel(out['ce'], ref['ce']):.1e}; dh {dh_err / ref['mag_dh']:.1e} of the terms' "
          f"{dh_err / np.abs(ref['dh']).max():.1e} of max |grad|; dW "
          f"{dw_err / ref['mag_dw']:.1e}, {dw_err / np.abs(ref['dw']).max():.1e}")
    assert rel(out["ce"], ref["ce"]) <= LOSS_RTOL
    assert abs(out["kl"] - ref["kl"]) <= ref["kl_tol"]
    assert abs(out["loss"] - ref["loss"]) <= ref["loss_tol"]
    assert abs(out["loss_f64"] - ref["loss"]) <= ref["loss_tol"]
    assert np.all(np.abs(rkl - ref["row_kl"]) <= 1e-5 * np.abs(ref["row_kl"]) + ref["kl_abs"])
    assert np.abs(rce - ref["row_ce"]).max() <= 1e-5 * max(1.0, np.abs(ref["row_ce"]).max())
    assert dh_err <= GRAD_TOL * ref["mag_dh"]
    assert dw_err <= GRAD_TOL * ref["mag_dw"]
    if far:
        for key in ("loss", "kl", "ce"):
            assert rel(out[key], ref[key]) <= LOSS_RTOL, key
        assert rel(out["loss_f64"], ref["loss"]) <= LOSS_RTOL
        assert dh_err <= GRAD_TOL * np.abs(ref["dh"]).max()
        assert dw_err <= GRAD_TOL * np.abs(ref["dw"]).max()
    return dh, rkl, rce


def read_out(tmp, name, shape):
    return np.fromfile(tmp / name, dtype=np.float32).reshape(shape)


def rel(a, b):
    return abs(a - b) / abs(b)


CASES = [
    # N, H, V, chunk, mask, ignore, reduction, scale, wdtype, tau, kd, ce, teacher
    (64, 48, 1001, 128, True, True, "mean", 1.0, "f32", 1.0, 1.0, 0.0, "random"),   # kd only
    (64, 48, 1001, 100, True, True, "mean", 1.0, "f32", 2.0, 0.7, 0.3, "random"),   # both
    (50, 33, 257, 0, False, True, "sum", 0.5, "f32", 4.0, 1.0, 1.0, "random"),      # chunk > V
    (50, 33, 257, 7, True, False, "mean", 1.0 / 50, "f32", 0.5, 0.5, 0.5, "random"),
    (48, 40, 333, 50, True, True, "sum", 1.0, "f32", 2.0, 0.0, 1.0, "random"),      # ce only
    (40, 64, 515, 100, True, True, "mean", 0.25, "bf16", 2.0, 1.0, 0.5, "random"),
    (64, 48, 1001, 128, True, True, "mean", 1.0, "f32", 1.0, 1.0, 0.5, "near"),     # small KL
    (64, 48, 1001, 96, False, False, "sum", 1.0, "f32", 4.0, 1.0, 0.0, "near"),
    (32, 48, 777, 64, True, True, "mean", 1.0, "bf16", 0.5, 2.0, 0.0, "near"),
    (48, 64, 901, 256, True, True, "mean", 1.0, "f32", 4.0, 1.0, 0.0, "close"),     # tiny KL
    (48, 64, 901, 100, True, False, "sum", 0.5, "f32", 1.0, 1.0, 0.1, "close"),
]


@pytest.mark.parametrize("N,H,V,chunk,mask,ignore,red,scale,wdtype,tau,kd,ce,teacher", CASES)
def test_against_torch(tool, tmp_path, N, H, V, chunk, mask, ignore, red, scale, wdtype, tau,
                       kd, ce, teacher):
    rng = np.random.default_rng(N * 1000 + V + chunk + int(tau * 8))
    h, w, z, t, m = make_case(tmp_path, rng, N, H, V, mask, ignore, wdtype, teacher)
    out = run_ok(tmp_path, N, H, V, chunk=chunk, reduction=red, scale=scale, threads=2,
                 weight=wdtype, tau=tau, kd=kd, ce=ce)
    assert out["scratch_bytes"] == out["scratch_formula"]
    ref = torch_reference(h, w, z, t, m, tau, kd, ce, red, scale)
    dh, rkl, rce = check_against(tmp_path, out, ref, N, H, V, far=teacher == "random")
    sup = supervised(t, m)
    assert np.all(dh[~sup] == 0)  # overwritten: the tool filled dh with 7.0
    assert np.all(rkl[~sup] == 0) and np.all(rce[~sup] == 0)


def test_qwen_vocabulary(tool, tmp_path):
    """V = 151,936 (Qwen's vocabulary) with the default chunk (4096 does not divide it)."""
    N, H, V = 6, 16, 151936
    rng = np.random.default_rng(151936)
    h, w, z, t, m = make_case(tmp_path, rng, N, H, V, mask=True, ignore=False)
    out = run_ok(tmp_path, N, H, V, threads=2, tau=2.0, kd=0.5, ce=0.5)
    ref = torch_reference(h, w, z, t, m, 2.0, 0.5, 0.5, "mean", 1.0)
    check_against(tmp_path, out, ref, N, H, V, far=True)


def outputs_of(tmp, out):
    return (out["loss"], out["kl"], out["ce"], out["loss_f64"],
            *((tmp / name).read_bytes() for name in OUTPUTS))


def test_thread_count_invariance(tool, tmp_path):
    N, H, V = 48, 40, 333
    make_case(tmp_path, np.random.default_rng(7), N, H, V)
    outs = [outputs_of(tmp_path, run_ok(tmp_path, N, H, V, chunk=50, threads=threads, tau=2.0,
                                          kd=0.6, ce=0.4))
            for threads in (1, 2, 3)]
    assert outs[0] == outs[1] == outs[2]


def test_simd_path_invariance(tool, tmp_path):
    """KILN_CPU_PATH forces the backend's path (one this CPU lacks falls back to the next)."""
    N, H, V = 40, 72, 700
    make_case(tmp_path, np.random.default_rng(11), N, H, V, wdtype="bf16")
    outs, used = {}, set()
    for path in ("portable", "avx2", "avx512"):
        out = run_ok(tmp_path, N, H, V, env={"KILN_CPU_PATH": path}, chunk=300, threads=2,
                     weight="bf16", tau=0.5, kd=1.0, ce=0.25)
        used.add(out["path"])
        outs[path] = outputs_of(tmp_path, out)
    print("paths run:", sorted(used))
    assert "portable" in used
    assert outs["portable"] == outs["avx2"] == outs["avx512"]


def test_accumulate(tool, tmp_path):
    """dh += and dW += are one addition of this call's gradient onto the caller's values: the
    bits of the fresh call's outputs added in f32; unsupervised rows of dh untouched."""
    N, H, V = 40, 32, 401
    rng = np.random.default_rng(5)
    h, w, z, t, m = make_case(tmp_path, rng, N, H, V)
    opts = dict(chunk=64, reduction="sum", scale=0.5, threads=2, tau=2.0, kd=1.0, ce=0.5)
    run_ok(tmp_path, N, H, V, **opts)
    dh_fresh, dw_fresh = read_out(tmp_path, "dh.f32", (N, H)), read_out(tmp_path, "dw.f32", (V, H))
    dh_in = rng.normal(0, 1, (N, H)).astype(np.float32)
    dw_in = rng.normal(0, 1, (V, H)).astype(np.float32)
    dh_in.tofile(tmp_path / "dh_in.f32")
    dw_in.tofile(tmp_path / "dw_in.f32")
    run_ok(tmp_path, N, H, V, accumulate=1, **opts)
    dh, dw = read_out(tmp_path, "dh.f32", (N, H)), read_out(tmp_path, "dw.f32", (V, H))
    sup = supervised(t, m)
    assert np.array_equal(dh[sup], dh_in[sup] + dh_fresh[sup])
    assert np.array_equal(dh[~sup], dh_in[~sup])
    assert np.array_equal(dw, dw_in + dw_fresh)


def test_ce_only_is_fused_ce(tool, tmp_path):
    """kd_weight 0, ce_weight 1: kiln_fused_ce's bits (loss, dh, dW, the row losses)."""
    if not CE_TOOL.exists():
        pytest.fail(f"{CE_TOOL} not found")
    for N, H, V, chunk, wdtype, red in ((48, 40, 333, 50, "f32", "mean"),
                                        (40, 64, 515, 0, "bf16", "sum")):
        make_case(tmp_path, np.random.default_rng(N + V), N, H, V, wdtype=wdtype)
        kd = run_ok(tmp_path, N, H, V, chunk=chunk, reduction=red, scale=0.75, threads=2,
                    weight=wdtype, tau=3.0, kd=0.0, ce=1.0)
        kd_files = {name: (tmp_path / name).read_bytes() for name in OUTPUTS}
        r = subprocess.run([str(CE_TOOL), "run", str(tmp_path), str(N), str(H), str(V),
                            str(chunk), red, "0.75", "2", wdtype],
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        ce = json.loads(r.stdout)
        assert (kd["loss"], kd["ce"], kd["loss_f64"]) == (ce["loss"], ce["loss"], ce["loss_f64"])
        assert kd_files["dh.f32"] == (tmp_path / "dh.f32").read_bytes()
        assert kd_files["dw.f32"] == (tmp_path / "dw.f32").read_bytes()
        assert kd_files["row_ce.f32"] == (tmp_path / "row_loss.f32").read_bytes()


def test_strided_teacher_and_loss_only(tool, tmp_path):
    """teacher_ld > V: the padding (NaN) is never read; the same bits as the packed teacher.
    Without dh and dW (grads=0) only pass 1 runs: the same loss."""
    N, H, V = 24, 32, 300
    make_case(tmp_path, np.random.default_rng(9), N, H, V, teacher_ld=V + 13)
    strided = run_ok(tmp_path, N, H, V, chunk=64, teacher_ld=V + 13, tau=2.0, kd=1.0, ce=1.0)
    strided_files = outputs_of(tmp_path, strided)
    make_case(tmp_path, np.random.default_rng(9), N, H, V)
    packed = run_ok(tmp_path, N, H, V, chunk=64, tau=2.0, kd=1.0, ce=1.0)
    assert strided_files == outputs_of(tmp_path, packed)
    loss_only = run_ok(tmp_path, N, H, V, chunk=64, tau=2.0, kd=1.0, ce=1.0, grads=0)
    assert (loss_only["loss"], loss_only["kl"], loss_only["ce"]) == \
        (packed["loss"], packed["kl"], packed["ce"])
    assert loss_only["scratch_bytes"] < packed["scratch_bytes"]
    assert loss_only["scratch_bytes"] == loss_only["scratch_formula"]


def test_scratch_bound(tool):
    """kiln's own accounting during a call sees exactly the documented scratch, the same for N
    = 256 and N = 2048 with the same S supervised rows: the bound follows S, H, V and the chunk,
    never N x V."""
    outs = []
    for N in (256, 2048):
        r = subprocess.run([str(TOOL), "bench", str(N), "64", "8192", "2048", "2", "1", "128"],
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr
        outs.append(json.loads(r.stdout))
        print(outs[-1])
    for o in outs:
        assert o["S"] == 128
        assert o["peak_extra_bytes"] == o["scratch_bytes"] == o["scratch_formula"]
    assert outs[0]["peak_extra_bytes"] == outs[1]["peak_extra_bytes"]
    # S = 128, H = 64, chunk 2048: 4 (2 S cn + 4 S H + 2 cn H + cn) bytes, 60 S bytes of row
    # state (the cross-entropy's 24, the distillation's 36) and 64-byte alignment of 22 regions
    S, H, cn = 128, 64, 2048
    assert outs[1]["scratch_bytes"] <= 4 * (2 * S * cn + 4 * S * H + 2 * cn * H + cn) + 60 * S \
        + 64 * 22
    assert outs[1]["logits_bytes"] / outs[1]["scratch_bytes"] > 20


def error_of(tmp, N, H, V, **opts):
    """The error message of a call that must fail, after checking that it wrote none of the
    caller's outputs (kd_tool checks its buffers)."""
    r = run_tool(tmp, N, H, V, **opts)
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    assert "kd_tool: outputs untouched" in r.stderr, r.stderr
    return r.stderr


def test_errors(tool, tmp_path):
    N, H, V = 8, 16, 20
    rng = np.random.default_rng(3)
    h, w, z, t, m = make_case(tmp_path, rng, N, H, V, mask=True, ignore=False)
    np.ones(N, dtype=np.uint8).tofile(tmp_path / "mask.u8")
    assert "tau 0 must be finite and > 0" in error_of(tmp_path, N, H, V, tau=0.0)
    assert "tau -1 must be finite and > 0" in error_of(tmp_path, N, H, V, tau=-1.0)
    assert "must be finite and > 0" in error_of(tmp_path, N, H, V, tau=float("inf"))
    assert "both 0" in error_of(tmp_path, N, H, V, kd=0.0, ce=0.0)
    assert "must be finite and >= 0" in error_of(tmp_path, N, H, V, kd=-0.5, ce=1.0)
    # a non-finite teacher logit in a supervised row, named by position and column
    z[5, 11] = np.inf
    z.tofile(tmp_path / "teacher.f32")
    err = error_of(tmp_path, N, H, V, chunk=8)
    assert "position 5" in err and "column 11 is not finite" in err, err
    z[5, 11] = 0.0
    # ... and in an unsupervised row it is never read
    z[3, 2] = np.nan
    z.tofile(tmp_path / "teacher.f32")
    mask = np.ones(N, dtype=np.uint8)
    mask[3] = 0
    mask.tofile(tmp_path / "mask.u8")
    run_ok(tmp_path, N, H, V)
    np.ones(N, dtype=np.uint8).tofile(tmp_path / "mask.u8")
    z[3, 2] = 0.0
    z.tofile(tmp_path / "teacher.f32")
    # a target >= V
    t[6] = V
    t.tofile(tmp_path / "targets.i32")
    assert "fused_kd: position 6: target 20 >= vocabulary size 20" in \
        error_of(tmp_path, N, H, V)
    t[6] = 1
    t.tofile(tmp_path / "targets.i32")
    # no supervised position
    np.zeros(N, dtype=np.uint8).tofile(tmp_path / "mask.u8")
    assert "no supervised positions" in error_of(tmp_path, N, H, V)
    np.ones(N, dtype=np.uint8).tofile(tmp_path / "mask.u8")
    # a teacher row stride below V (the tool reads N x ld floats)
    z[:, :V - 1].copy().tofile(tmp_path / "teacher.f32")
    assert "teacher_ld 19 < V 20" in error_of(tmp_path, N, H, V, teacher_ld=V - 1)
    z.tofile(tmp_path / "teacher.f32")
    # a non-finite student logit: the row's loss
    h[2, 3] = np.inf
    h.tofile(tmp_path / "h.f32")
    err = error_of(tmp_path, N, H, V)
    assert "position 2" in err and "loss is not finite" in err, err
