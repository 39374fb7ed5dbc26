"""The public fused linear cross-entropy (include/kiln.h, kiln_linear_ce_*) through the binding
(kiln.LinearCrossEntropy): against torch.nn.functional.cross_entropy on materialised logits
in float64 with autograd (the bounds of test_fused_ce.py, docs/ARITHMETIC.md), the same bits
as the internal call (tests/tools/ce_tool), accumulation, the errors, and torch tensors.

On a machine with a CUDA GPU (torch.cuda.is_available() and kiln built with CUDA) the same
file checks the GPU: auditable mode's bits equal the CPU's, fast mode (both walks) within a
stated bound of float64. Without one those cases skip.
"""
import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import kiln
from test_fused_ce import bf16_round as bf16_bits
from test_fused_ce import torch_reference

REPO = Path(__file__).resolve().parents[2]
BUILD = Path(os.environ.get("KILN_BUILD_DIR", REPO / "build"))

LOSS_RTOL = 1e-5   # auditable: the loss, relative
GRAD_TOL = 1e-5    # auditable: every element within this much of the largest |grad|
FAST_LOSS_RTOL = 1e-3  # fast (bf16 products): the loss, relative
FAST_GRAD_TOL = 2e-2   # fast: the gradients' error norm over their norm


def case(seed, N, H, V, mask, ignore, wscale=2.0):
    rng = np.random.default_rng(seed)
    h = rng.uniform(-1, 1, (N, H)).astype(np.float32)
    w = rng.uniform(-wscale, wscale, (V, H)).astype(np.float32)
    t = rng.integers(0, V, N).astype(np.int32)
    t[0], t[-1] = 0, V - 1
    if ignore:
        t[1::4] = -100
    m = None
    if mask:
        m = (rng.random(N) < 0.7).astype(np.uint8)
        m[0] = 1
    return h, w, t, m


def reference(h, w, t, m, red, scale):
    """torch float64 (test_fused_ce.py's): loss, dh, dW, S, and the unreduced row losses."""
    loss, dh, dw, S = torch_reference(h, w, t, m, red, scale)
    tt = torch.tensor(t, dtype=torch.int64)
    if m is not None:
        tt[torch.tensor(m) == 0] = -100
    with torch.no_grad():
        logits = torch.tensor(h, dtype=torch.float64) @ torch.tensor(w, dtype=torch.float64).T
        rows = F.cross_entropy(logits, tt, ignore_index=-100, reduction="none").numpy()
    return loss, dh, dw, rows, S


CASES = [
    # N, H, V, chunk, mask, ignore, reduction, scale, weight
    (64, 48, 1001, 128, True, True, "mean", 1.0, "f32"),
    (50, 33, 257, 0, False, True, "sum", 0.5, "f32"),
    (40, 64, 515, 100, True, False, "mean", 0.25, "bf16"),
]


@pytest.fixture(scope="module")
def cpu(build_dir):
    ce = kiln.LinearCrossEntropy("cpu")
    yield ce
    ce.close()


def test_param_layout(build_dir):
    """The binding's _LinearCEParams against the C defaults (a shifted field would read the
    defaults elsewhere)."""
    p = kiln.load_library().kiln_linear_ce_default_params()
    assert (p.N, p.H, p.V, p.weight_bf16, p.reduction, p.dhidden_accumulate) == (0, 0, 0, 0, 0, 0)
    assert p.scale == 1.0 and p.chunk == 0 and p.row_block == 0
    assert not any((p.hidden, p.weight, p.targets, p.mask, p.dhidden, p.dweight, p.row_loss))


@pytest.mark.parametrize("N,H,V,chunk,mask,ignore,red,scale,wdt", CASES)
def test_against_torch(cpu, N, H, V, chunk, mask, ignore, red, scale, wdt):
    h, w, t, m = case(N * 1000 + V, N, H, V, mask, ignore)
    wk = w
    if wdt == "bf16":
        wk, w = bf16_bits(w)  # kiln reads the bits, torch the values they stand for
    dh = np.full((N, H), np.nan, np.float32)  # overwritten, every row
    dw = np.zeros((V, H), np.float32)
    rl = np.full(N, np.nan, np.float32)
    loss = cpu(h, wk, t, mask=m, reduction=red, scale=scale, dhidden=dh, dweight=dw,
               row_loss=rl, chunk=chunk)
    ref_loss, ref_dh, ref_dw, ref_rows, S = reference(h, w, t, m, red, scale)
    assert cpu.last["n_supervised"] == S
    assert abs(loss - ref_loss) <= LOSS_RTOL * abs(ref_loss)
    assert abs(cpu.last["loss_f64"] - ref_loss) <= LOSS_RTOL * abs(ref_loss)
    assert np.abs(dh - ref_dh).max() <= GRAD_TOL * np.abs(ref_dh).max()
    assert np.abs(dw - ref_dw).max() <= GRAD_TOL * np.abs(ref_dw).max()
    sup = (t >= 0) & (m.astype(bool) if m is not None else True)
    assert np.all(dh[~sup] == 0) and np.all(rl[~sup] == 0)
    assert np.abs(rl - ref_rows).max() <= 1e-5 * max(1.0, np.abs(ref_rows).max())


def test_same_bits_as_the_internal_call(cpu, build_dir, tmp_path):
    """The public call is kiln_fused_ce itself: ce_tool's outputs, bit for bit."""
    N, H, V, chunk = 48, 40, 333, 50
    h, w, t, m = case(11, N, H, V, True, True)
    for name, a in (("h.f32", h), ("w.f32", w), ("targets.i32", t), ("mask.u8", m)):
        a.tofile(tmp_path / name)
    r = subprocess.run([str(build_dir / "ce_tool"), "run", str(tmp_path), str(N), str(H), str(V),
                        str(chunk), "mean", "1.0", "2", "f32"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    dh, dw = np.zeros((N, H), np.float32), np.zeros((V, H), np.float32)
    rl = np.zeros(N, np.float32)
    loss = cpu(h, w, t, mask=m, dhidden=dh, dweight=dw, row_loss=rl, chunk=chunk)
    assert np.float32(loss) == np.float32(out["loss"])
    assert dh.tobytes() == (tmp_path / "dh.f32").read_bytes()
    assert dw.tobytes() == (tmp_path / "dw.f32").read_bytes()
    assert rl.tobytes() == (tmp_path / "row_loss.f32").read_bytes()


def test_accumulation(cpu):
    """dweight is added to; dhidden is overwritten, or added to with dhidden_accumulate
    (unsupervised rows untouched then)."""
    N, H, V = 24, 16, 77
    h, w, t, _ = case(5, N, H, V, False, True)
    dh1, dw1 = np.zeros((N, H), np.float32), np.zeros((V, H), np.float32)
    cpu(h, w, t, dhidden=dh1, dweight=dw1)
    dh2 = np.full((N, H), 3.0, np.float32)
    dw2 = dw1.copy()
    cpu(h, w, t, dhidden=dh2, dweight=dw2, dhidden_accumulate=True)
    sup = t >= 0
    np.testing.assert_array_equal(dh2[sup], np.float32(3.0) + dh1[sup])
    assert np.all(dh2[~sup] == 3.0)
    np.testing.assert_array_equal(dw2, dw1 + dw1)
    # the loss alone (no gradient asked for): the same loss
    assert cpu(h, w, t) == cpu(h, w, t, dhidden=dh1)


def test_torch_cpu_tensors(cpu):
    """CPU torch tensors are read in place; a bfloat16 weight tensor is the bf16 weight."""
    N, H, V = 16, 32, 90
    h, w, t, _ = case(9, N, H, V, False, False)
    bits, wv = bf16_bits(w)
    dw_np = np.zeros((V, H), np.float32)
    ref = cpu(h, bits, t, dweight=dw_np)
    ht = torch.from_numpy(h)
    wt = torch.from_numpy(wv).to(torch.bfloat16)
    dw_t = torch.zeros(V, H)
    got = cpu(ht, wt, torch.from_numpy(t).long(), dweight=dw_t)
    assert got == ref
    assert dw_t.numpy().tobytes() == dw_np.tobytes()


def test_errors(cpu):
    N, H, V = 8, 16, 20
    h, w, t, _ = case(3, N, H, V, False, False)
    dh = np.full((N, H), 7.0, np.float32)
    dw = np.full((V, H), 7.0, np.float32)
    bad = t.copy()
    bad[5] = V
    with pytest.raises(kiln.KilnError) as e:
        cpu(h, w, bad, dhidden=dh, dweight=dw)
    assert e.value.status == 6 and "position 5" in e.value.message, e.value.message
    assert np.all(dh == 7.0) and np.all(dw == 7.0)  # nothing written
    with pytest.raises(kiln.KilnError) as e:
        cpu(h, w, t, mask=np.zeros(N, np.uint8))
    assert "no supervised positions" in e.value.message
    hinf = h.copy()
    hinf[2, 3] = np.inf
    with pytest.raises(kiln.KilnError) as e:
        cpu(hinf, w, t, dhidden=dh)
    assert "position 2" in e.value.message and np.all(dh == 7.0)
    with pytest.raises(ValueError, match="shape"):
        cpu(h, w[:, :8], t)
    with pytest.raises(ValueError, match="dtype"):
        cpu(h.astype(np.float64), w, t)
    with pytest.raises(ValueError, match="contiguous"):
        cpu(np.asfortranarray(h), w, t)
    with pytest.raises(ValueError, match="targets"):
        cpu(h, w, t[:-1])
    with pytest.raises(kiln.KilnError) as e:
        kiln.LinearCrossEntropy("cpu", fast=True)
    assert e.value.status == 4 and "fast" in e.value.message


# ---- the GPU (skips without one) ---------------------------------------------------------

def cuda_handle(fast):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU visible to torch")
    try:
        return kiln.LinearCrossEntropy("cuda", fast=fast)
    except kiln.KilnError as e:
        pytest.skip(f"kiln has no CUDA device: {e.message}")


def on_gpu(*arrays):
    return [torch.from_numpy(a).cuda() if a is not None else None for a in arrays]


@pytest.mark.parametrize("N,H,V,chunk,mask,ignore,red,scale,wdt", CASES)
def test_cuda_auditable_has_the_cpus_bits(cpu, N, H, V, chunk, mask, ignore, red, scale, wdt):
    gpu = cuda_handle(fast=False)
    h, w, t, m = case(N * 1000 + V, N, H, V, mask, ignore)
    wk = bf16_bits(w)[0] if wdt == "bf16" else w
    dh, dw, rl = np.zeros((N, H), np.float32), np.zeros((V, H), np.float32), np.zeros(N, np.float32)
    loss = cpu(h, wk, t, mask=m, reduction=red, scale=scale, dhidden=dh, dweight=dw,
               row_loss=rl, chunk=chunk)
    hg, wg, dhg, dwg, rlg = on_gpu(h, wk.view(np.int16) if wdt == "bf16" else wk,
                                   np.zeros_like(dh), np.zeros_like(dw), np.zeros_like(rl))
    if wdt == "bf16":
        wg = wg.view(torch.bfloat16)
    got = gpu(hg, wg, t, mask=m, reduction=red, scale=scale, dhidden=dhg, dweight=dwg,
              row_loss=rlg, chunk=chunk)
    assert np.float32(got) == np.float32(loss)
    assert dhg.cpu().numpy().tobytes() == dh.tobytes()
    assert dwg.cpu().numpy().tobytes() == dw.tobytes()
    assert rlg.cpu().numpy().tobytes() == rl.tobytes()
    gpu.close()


@pytest.mark.parametrize("row_block", [0, 64])
def test_cuda_fast_against_torch(row_block):
    """Fast mode, the vocabulary walk (row_block 0) and the row walk (64 rows a block: four
    blocks), against float64 on the bf16 weight's values."""
    gpu = cuda_handle(fast=True)
    N, H, V = 256, 128, 3000
    h, w, t, m = case(21, N, H, V, True, True, wscale=0.5)
    bits, wv = bf16_bits(w)
    hg, wg = on_gpu(h, bits.view(np.int16))
    wg = wg.view(torch.bfloat16)
    dhg, dwg = torch.zeros(N, H, device="cuda"), torch.zeros(V, H, device="cuda")
    loss = gpu(hg, wg, t, mask=m, dhidden=dhg, dweight=dwg, row_block=row_block)
    ref_loss, ref_dh, ref_dw, _, S = reference(h, wv, t, m, "mean", 1.0)
    assert gpu.last["n_supervised"] == S
    assert abs(loss - ref_loss) <= FAST_LOSS_RTOL * abs(ref_loss)
    for got, ref in ((dhg.cpu().numpy(), ref_dh), (dwg.cpu().numpy(), ref_dw)):
        assert np.linalg.norm(got - ref) <= FAST_GRAD_TOL * np.linalg.norm(ref)
    # deterministic: a second call gives the same bits
    dh2, dw2 = torch.zeros_like(dhg), torch.zeros_like(dwg)
    assert gpu(hg, wg, t, mask=m, dhidden=dh2, dweight=dw2, row_block=row_block) == loss
    assert torch.equal(dh2, dhg) and torch.equal(dw2, dwg)
    gpu.close()


def test_cuda_refuses_host_memory():
    gpu = cuda_handle(fast=False)
    h, w, t, _ = case(1, 8, 16, 20, False, False)
    with pytest.raises(ValueError, match="CUDA device"):
        gpu(h, w, t)
    gpu.close()
