"""kiln's fused linear cross-entropy (src/train/fused_ce.c, driven through tests/tools/ce_tool)
against torch.nn.functional.cross_entropy on materialised logits in float64, with autograd for
the gradients of the hidden states and of the weight.

Bound (docs/ARITHMETIC.md, "Fused linear cross-entropy"): the loss within 1e-5 relative; every
element of dh and dW within 1e-5 of the largest element of the float64 gradient in magnitude.
"""
import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[2]
BUILD = Path(os.environ.get("KILN_BUILD_DIR", REPO / "build"))
TOOL = BUILD / "ce_tool"

LOSS_RTOL = 1e-5
GRAD_TOL = 1e-5


@pytest.fixture(scope="module")
def tool():
    if not TOOL.exists():
        pytest.fail(f"{TOOL} not found: build first (cmake --build {BUILD})")
    return TOOL


def bf16_round(a):
    """float32 -> the bf16 bits (round to nearest even) and their exact float32 values."""
    u = a.astype(np.float32).view(np.uint32).astype(np.uint64)
    u = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    return u, (u.astype(np.uint32) << 16).view(np.float32)


def make_case(tmp, rng, N, H, V, mask, ignore, wdtype, wscale=1.0):
    h = rng.uniform(-1, 1, (N, H)).astype(np.float32)
    w = rng.uniform(-wscale, wscale, (V, H)).astype(np.float32)
    if wdtype == "bf16":
        bits, w = bf16_round(w)
        bits.tofile(tmp / "w.bf16")
    else:
        w.tofile(tmp / "w.f32")
    t = rng.integers(0, V, N).astype(np.int32)
    t[0], t[-1] = 0, V - 1
    if ignore:
        t[1::4] = -100
    h.tofile(tmp / "h.f32")
    t.tofile(tmp / "targets.i32")
    m = None
    if mask:
        m = (rng.random(N) < 0.7).astype(np.uint8)
        m[0] = 1
        m.tofile(tmp / "mask.u8")
    return h, w, t, m


def run_tool(tool, tmp, N, H, V, chunk, red, scale, threads, wdtype):
    cmd = [str(tool), "run", str(tmp), str(N), str(H), str(V), str(chunk), red, repr(scale),
           str(threads), wdtype]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


def torch_reference(h, w, t, m, red, scale):
    h64 = torch.tensor(h, dtype=torch.float64, requires_grad=True)
    w64 = torch.tensor(w, dtype=torch.float64, requires_grad=True)
    tt = torch.tensor(t, dtype=torch.int64)
    if m is not None:
        tt[torch.tensor(m) == 0] = -100
    logits = h64 @ w64.T
    loss = F.cross_entropy(logits, tt, ignore_index=-100, reduction=red) * scale
    loss.backward()
    return loss.item(), h64.grad.numpy(), w64.grad.numpy(), int((tt >= 0).sum())


CASES = [
    # N, H, V, chunk, mask, ignore, reduction, scale, wdtype
    (64, 48, 1001, 128, True, True, "mean", 1.0, "f32"),
    (64, 48, 1001, 7, True, False, "mean", 1.0 / 64, "f32"),   # batch mean over N
    (50, 33, 257, 0, False, True, "sum", 0.5, "f32"),          # default chunk (> V)
    (50, 33, 257, 256, True, True, "sum", 2.0, "f32"),         # chunk V-1
    (40, 64, 515, 100, True, True, "mean", 0.25, "bf16"),
]


@pytest.mark.parametrize("N,H,V,chunk,mask,ignore,red,scale,wdtype", CASES)
def test_against_torch(tool, tmp_path, N, H, V, chunk, mask, ignore, red, scale, wdtype):
    rng = np.random.default_rng(N * 1000 + V + chunk)
    h, w, t, m = make_case(tmp_path, rng, N, H, V, mask, ignore, wdtype, wscale=2.0)
    r = run_tool(tool, tmp_path, N, H, V, chunk, red, scale, 2, wdtype)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    ref_loss, ref_dh, ref_dw, S = torch_reference(h, w, t, m, red, scale)
    assert out["n_supervised"] == S
    dh = np.fromfile(tmp_path / "dh.f32", dtype=np.float32).reshape(N, H)
    dw = np.fromfile(tmp_path / "dw.f32", dtype=np.float32).reshape(V, H)
    loss_err = abs(out["loss"] - ref_loss) / abs(ref_loss)
    dh_err = np.abs(dh - ref_dh).max() / np.abs(ref_dh).max()
    dw_err = np.abs(dw - ref_dw).max() / np.abs(ref_dw).max()
    print(f"loss {out['loss']:.9g} vs torch {ref_loss:.12g}: rel {loss_err:.2e}; "
          f"dh {dh_err:.2e}, dW {dw_err:.2e} of max |grad|")
    assert loss_err <= LOSS_RTOL
    assert abs(out["loss_f64"] - ref_loss) / abs(ref_loss) <= LOSS_RTOL
    assert dh_err <= GRAD_TOL
    assert dw_err <= GRAD_TOL
    # unsupervised rows of dh are exactly zero
    sup = (t >= 0) & (m.astype(bool) if m is not None else True)
    assert np.all(dh[~sup] == 0)
    # per-row losses: torch's unreduced loss
    rl = np.fromfile(tmp_path / "row_loss.f32", dtype=np.float32)
    with torch.no_grad():
        tt = torch.tensor(t, dtype=torch.int64)
        if m is not None:
            tt[torch.tensor(m) == 0] = -100
        ref_rl = F.cross_entropy(torch.tensor(h, dtype=torch.float64)
                                 @ torch.tensor(w, dtype=torch.float64).T, tt,
                                 ignore_index=-100, reduction="none").numpy()
    assert np.all(rl[~sup] == 0)
    assert np.abs(rl - ref_rl).max() <= 1e-5 * max(1.0, np.abs(ref_rl).max())


def test_thread_count_invariance(tool, tmp_path):
    N, H, V = 48, 40, 333
    rng = np.random.default_rng(7)
    make_case(tmp_path, rng, N, H, V, True, True, "f32")
    outs = []
    for threads in (1, 2, 3):
        r = run_tool(tool, tmp_path, N, H, V, 50, "mean", 1.0, threads, "f32")
        assert r.returncode == 0, r.stderr
        outs.append((json.loads(r.stdout)["loss"],
                     (tmp_path / "dh.f32").read_bytes(), (tmp_path / "dw.f32").read_bytes()))
    assert outs[0] == outs[1] == outs[2]


def test_errors(tool, tmp_path):
    N, H, V = 8, 16, 20
    rng = np.random.default_rng(3)
    h, w, t, m = make_case(tmp_path, rng, N, H, V, True, False, "f32")
    np.zeros(N, dtype=np.uint8).tofile(tmp_path / "mask.u8")
    r = run_tool(tool, tmp_path, N, H, V, 0, "mean", 1.0, 1, "f32")
    assert r.returncode == 2 and "no supervised positions" in r.stderr, r.stderr
    np.ones(N, dtype=np.uint8).tofile(tmp_path / "mask.u8")
    t[5] = V
    t.tofile(tmp_path / "targets.i32")
    r = run_tool(tool, tmp_path, N, H, V, 0, "mean", 1.0, 1, "f32")
    assert r.returncode == 2 and "position 5: target 20 >= vocabulary size 20" in r.stderr, r.stderr
    t[5] = 1
    t.tofile(tmp_path / "targets.i32")
    h[2, 3] = np.inf
    h.tofile(tmp_path / "h.f32")
    r = run_tool(tool, tmp_path, N, H, V, 0, "mean", 1.0, 1, "f32")
    assert r.returncode == 2 and "position 2" in r.stderr and "not finite" in r.stderr, r.stderr
