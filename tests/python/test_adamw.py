"""kiln's AdamW and clip_grad_norm_ against torch.optim.AdamW / torch.nn.utils.clip_grad_norm_.

The C side runs in tests/tools/adamw_tool.c (the optimizer is internal, not in the ctypes
binding). Every run does >= 10 steps with fresh random gradients, Trainer-style parameter
groups (no weight decay for biases and norm weights) and a changing learning rate.

torch's CPU Tensor.sqrt on float32 vectors is not correctly rounded on this build (about 20%
of elements differ by 1 ulp from the exact sqrt; its scalar tail is exact), while kiln's sqrt
is IEEE sqrtf (docs/ARITHMETIC.md). So kiln is compared twice: bit for bit with torch's AdamW
running with a correctly rounded Tensor.sqrt, and within 1e-6 with torch's AdamW as it is.
"""

import contextlib
import os
import struct
import subprocess
import tempfile

import numpy as np
import pytest

torch = pytest.importorskip("torch")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BUILD = os.environ.get("KILN_BUILD_DIR", os.path.join(ROOT, "build"))
TOOL = os.path.join(BUILD, "adamw_tool")

pytestmark = pytest.mark.skipif(not os.path.exists(TOOL), reason="adamw_tool not built")

W_F32, W_MASTER, W_KAHAN, W_SR = 0, 1, 2, 3
M_F32, M_Q8 = 0, 1

SHAPES = [
    ("model.embed_tokens.weight", (61, 48)),
    ("model.layers.0.input_layernorm.weight", (48,)),
    ("model.layers.0.self_attn.q_proj.weight", (64, 48)),
    ("model.layers.0.self_attn.q_proj.bias", (64,)),
    ("model.layers.0.self_attn.q_norm.weight", (16,)),
    ("model.layers.0.mlp.up_proj.weight", (37, 29)),
    ("model.norm.weight", (48,)),
    ("lm_head.weight", (61, 48)),
]
NO_DECAY = {"model.layers.0.input_layernorm.weight", "model.layers.0.self_attn.q_proj.bias",
            "model.layers.0.self_attn.q_norm.weight", "model.norm.weight"}

HP = dict(beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1)


def make_inputs(seed, steps, bf16_init, grad_scale=1.0):
    g = torch.Generator().manual_seed(seed)
    init = []
    for _, shape in SHAPES:
        w = torch.randn(shape, generator=g) * 0.5
        if bf16_init:
            w = w.bfloat16().float()
        init.append(w)
    grads = [[torch.randn(shape, generator=g) * grad_scale * (1 + 0.3 * i)
              for i, (_, shape) in enumerate(SHAPES)] for _ in range(steps)]
    lrs = [1e-2 * (1.0 - 0.05 * t) for t in range(steps)]  # a decaying schedule
    return init, grads, lrs


def run_tool(init, grads, lrs, weights, moments, max_norm=0.0, seed=1234, threads=1,
             decay_override=None):
    P, steps = len(SHAPES), len(lrs)
    with tempfile.TemporaryDirectory() as d:
        pin, pout = os.path.join(d, "in.bin"), os.path.join(d, "out.bin")
        with open(pin, "wb") as f:
            f.write(struct.pack("<4i", P, steps, weights, moments))
            f.write(struct.pack("<4dQd", HP["beta1"], HP["beta2"], HP["eps"],
                                HP["weight_decay"], seed, max_norm))
            f.write(np.asarray(lrs, np.float64).tobytes())
            for name, shape in SHAPES:
                nb = name.encode()
                dec = -1 if decay_override is None else decay_override.get(name, -1)
                f.write(struct.pack("<i", len(nb)) + nb +
                        struct.pack("<qi", int(np.prod(shape)), dec))
            for w in init:
                f.write(w.numpy().astype(np.float32).tobytes())
            for step_grads in grads:
                for gr in step_grads:
                    f.write(gr.numpy().astype(np.float32).tobytes())
        subprocess.run([TOOL, pin, pout, str(threads)], check=True)
        data = open(pout, "rb").read()
    off = 0
    clip = []
    if max_norm > 0:
        for _ in range(steps):
            total, coef = np.frombuffer(data, np.float32, 2, off)
            off += 8
            norms = np.frombuffer(data, np.float32, P, off)
            off += 4 * P
            clip.append((total, coef, norms.copy()))
    out = []
    for _, shape in SHAPES:
        n = int(np.prod(shape))
        decay = struct.unpack_from("<i", data, off)[0]
        off += 4
        arrs = []
        for _ in range(5):
            arrs.append(np.frombuffer(data, np.float32, n, off).reshape(shape).copy())
            off += 4 * n
        out.append(dict(decay=decay, w=arrs[0], master=arrs[1], comp=arrs[2], m=arrs[3],
                        v=arrs[4]))
    desc = data[off:].decode().strip()
    return out, clip, desc, data


@contextlib.contextmanager
def exact_sqrt():
    """Tensor.sqrt correctly rounded (float64 sqrt of a float32 rounds correctly to float32)."""
    orig = torch.Tensor.sqrt
    torch.Tensor.sqrt = lambda self: torch.sqrt(self.double()).to(self.dtype)
    try:
        yield
    finally:
        torch.Tensor.sqrt = orig


def run_torch(init, grads, lrs, max_norm=0.0, patched=False):
    params = [torch.nn.Parameter(w.clone()) for w in init]
    decay = [p for (name, _), p in zip(SHAPES, params) if name not in NO_DECAY]
    no_decay = [p for (name, _), p in zip(SHAPES, params) if name in NO_DECAY]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": HP["weight_decay"]},
         {"params": no_decay, "weight_decay": 0.0}],
        lr=lrs[0], betas=(HP["beta1"], HP["beta2"]), eps=HP["eps"], foreach=False)
    clip = []
    for t, step_grads in enumerate(grads):
        for p, gr in zip(params, step_grads):
            p.grad = gr.clone()
        if max_norm > 0:
            norms = [torch.linalg.vector_norm(p.grad).numpy().copy() for p in params]
            total = torch.nn.utils.clip_grad_norm_(params, max_norm)
            coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)  # torch's own expression
            clip.append((total.numpy().copy(), coef.numpy().copy(), np.array(norms)))
        for grp in opt.param_groups:
            grp["lr"] = lrs[t]
        with exact_sqrt() if patched else contextlib.nullcontext():
            opt.step()
    out = []
    for p in params:
        st = opt.state[p]
        out.append(dict(w=p.detach().numpy().copy(), m=st["exp_avg"].numpy().copy(),
                        v=st["exp_avg_sq"].numpy().copy()))
    return out, clip


def bits_equal(a, b):
    return np.array_equal(np.asarray(a, np.float32).view(np.uint32),
                          np.asarray(b, np.float32).view(np.uint32))


def bf16_rne(x):
    return torch.from_numpy(np.ascontiguousarray(x)).bfloat16().float().numpy()


def bf16_ulp(x):
    """Spacing of bf16 numbers at |x| (normal range)."""
    e = np.floor(np.log2(np.maximum(np.abs(x), 1e-30)))
    return np.exp2(e - 7)


STEPS = 12


def test_f32_matches_torch_bits_and_1e6():
    init, grads, lrs = make_inputs(1, STEPS, bf16_init=False)
    kout, _, desc, _ = run_tool(init, grads, lrs, W_F32, M_F32)
    exact, _ = run_torch(init, grads, lrs, patched=True)
    plain, _ = run_torch(init, grads, lrs, patched=False)
    max_diff = 0.0
    for (name, _), k, e, p in zip(SHAPES, kout, exact, plain):
        assert k["decay"] == (0 if name in NO_DECAY else 1), name
        assert bits_equal(k["w"], e["w"]), name
        assert bits_equal(k["m"], e["m"]), name
        assert bits_equal(k["v"], e["v"]), name
        max_diff = max(max_diff, float(np.max(np.abs(k["w"] - p["w"]))))
    print(f"f32 AdamW, {STEPS} steps: bit-identical to torch with exact sqrt; "
          f"max |kiln - torch| = {max_diff:.3g}")
    assert max_diff <= 1e-6
    assert "f32 weights" in desc


def test_thread_count_invariance():
    init, grads, lrs = make_inputs(2, 10, bf16_init=True)
    for w, m in [(W_F32, M_Q8), (W_SR, M_F32), (W_KAHAN, M_Q8)]:
        *_, d1 = run_tool(init, grads, lrs, w, m, max_norm=1.0, threads=1)
        *_, d2 = run_tool(init, grads, lrs, w, m, max_norm=1.0, threads=2)
        *_, d3 = run_tool(init, grads, lrs, w, m, max_norm=1.0, threads=3)
        assert d1 == d2 == d3


@pytest.mark.parametrize("max_norm", [0.5, 1e4])
def test_clip_grad_norm_bits(max_norm):
    init, grads, lrs = make_inputs(3, STEPS, bf16_init=False, grad_scale=0.05)
    kout, kclip, _, _ = run_tool(init, grads, lrs, W_F32, M_F32, max_norm=max_norm)
    tout, tclip = run_torch(init, grads, lrs, max_norm=max_norm, patched=True)
    for t, ((kt, kc, kn), (tt, tc, tn)) in enumerate(zip(kclip, tclip)):
        assert bits_equal(kn, tn), (t, kn, tn)
        assert bits_equal(kt, tt), (t, kt, tt)
        assert bits_equal(kc, tc), (t, kc, tc)
        if max_norm > 1:
            assert kc == 1.0
        else:
            assert kc < 1.0
    for k, e in zip(kout, tout):
        assert bits_equal(k["w"], e["w"])


def test_bf16_master():
    init, grads, lrs = make_inputs(4, STEPS, bf16_init=True)
    kout, _, desc, _ = run_tool(init, grads, lrs, W_MASTER, M_F32)
    exact, _ = run_torch(init, grads, lrs, patched=True)
    for (name, _), k, e in zip(SHAPES, kout, exact):
        assert bits_equal(k["master"], e["w"]), name       # the master is f32 AdamW
        assert bits_equal(k["w"], bf16_rne(k["master"])), name
    assert "f32 master" in desc


def test_bf16_kahan():
    init, grads, lrs = make_inputs(5, STEPS, bf16_init=True)
    kout, _, desc, _ = run_tool(init, grads, lrs, W_KAHAN, M_F32)
    ref, _ = run_torch(init, grads, lrs)
    worst_sum, worst_w = 0.0, 0.0
    for (name, _), k, r in zip(SHAPES, kout, ref):
        # the compensation is the rounding error of the weights, itself rounded to bf16
        assert np.all(np.abs(k["comp"]) <= bf16_ulp(k["w"]) / 2 + 1e-30), name
        # w + c carries about 16 significant bits: each step loses at most ~2^-16 of the
        # tensor's scale, so after STEPS steps w + c is within STEPS * 2^-16 * max|w|
        scale = float(np.max(np.abs(r["w"])))
        err_sum = np.abs(k["w"] + k["comp"] - r["w"])
        worst_sum = max(worst_sum, float(np.max(err_sum)) / (scale * 2.0 ** -16))
        # and the weights are within half a bf16 ulp of that value
        err_w = np.abs(k["w"] - r["w"]) - err_sum
        worst_w = max(worst_w, float(np.max(err_w / bf16_ulp(r["w"]))))
    print(f"Kahan: max |w + c - torch| = {worst_sum:.2f} x 2^-16 x max|w| after {STEPS} steps;"
          f" |w - torch| - |w + c - torch| <= {worst_w:.3f} bf16 ulp")
    assert worst_sum <= STEPS
    assert worst_w <= 0.5 + 1e-3
    assert "Kahan" in desc


def test_bf16_stochastic_rounding():
    init, grads, lrs = make_inputs(6, STEPS, bf16_init=True)
    kout, _, desc, _ = run_tool(init, grads, lrs, W_SR, M_F32, seed=99)
    kout2, *_ = run_tool(init, grads, lrs, W_SR, M_F32, seed=100)
    ref, _ = run_torch(init, grads, lrs)
    errs, errs2 = [], []
    for (name, _), k, k2, r in zip(SHAPES, kout, kout2, ref):
        # errors in ulps of the tensor's largest weight: a weight may have been larger earlier
        # (or cross zero), and its error comes from the ulps of the values it took
        ulp = bf16_ulp(np.max(np.abs(r["w"])))
        errs.append(((k["w"] - r["w"]) / ulp).ravel())
        errs2.append(((k2["w"] - r["w"]) / ulp).ravel())
        assert bits_equal(k["w"], bf16_rne(k["w"])), name  # representable in bf16
    e, e2 = np.concatenate(errs), np.concatenate(errs2)
    n = e.size
    # each step moves the error by a zero-mean amount of at most one ulp
    assert np.max(np.abs(e)) <= STEPS
    # unbiased: the mean error is ~0 (each error's std is below sqrt(STEPS) / 2 ulp)
    bound = 5 * np.sqrt(STEPS) / 2 / np.sqrt(n)
    print(f"SR: {n} weights, mean error {e.mean():.4f} ulp (bound {bound:.4f}), "
          f"rms {np.sqrt((e * e).mean()):.3f} ulp, max {np.max(np.abs(e)):.2f} ulp "
          f"(ulps of each tensor's max |w|)")
    assert abs(e.mean()) < bound and abs(e2.mean()) < bound
    assert not np.array_equal(e, e2)  # the seed matters
    assert "stochastic" in desc


def test_q8_moments():
    init, grads, lrs = make_inputs(7, STEPS, bf16_init=False)
    kout, _, desc, _ = run_tool(init, grads, lrs, W_F32, M_Q8)
    ref, _ = run_torch(init, grads, lrs)
    worst_w, worst_m, worst_v = 0.0, 0.0, 0.0
    for (name, _), k, r in zip(SHAPES, kout, ref):
        worst_w = max(worst_w, float(np.max(np.abs(k["w"] - r["w"]))))
        worst_m = max(worst_m, float(np.max(np.abs(k["m"] - r["m"]) /
                                            np.max(np.abs(r["m"])))))
        worst_v = max(worst_v, float(np.max(np.abs(k["v"] - r["v"]) / np.abs(r["v"]))))
    lr_sum = sum(lrs)
    print(f"8-bit moments: max |w - torch| = {worst_w:.3g} ({worst_w / lr_sum:.3f} x sum(lr)), "
          f"m error {worst_m:.3g} of the tensor's max |m|, v relative error {worst_v:.3g}")
    # documented bound: each step's update within 15% of lr of torch's
    assert worst_w <= 0.15 * lr_sum
    assert worst_m <= 0.1
    assert worst_v <= 0.35
    assert "8-bit" in desc


def test_explicit_decay_map():
    init, grads, lrs = make_inputs(8, 10, bf16_init=False)
    override = {"model.layers.0.self_attn.q_proj.bias": 1, "lm_head.weight": 0}
    kout, *_ = run_tool(init, grads, lrs, W_F32, M_F32, decay_override=override)
    global NO_DECAY
    saved = NO_DECAY
    NO_DECAY = (saved - {"model.layers.0.self_attn.q_proj.bias"}) | {"lm_head.weight"}
    try:
        ref, _ = run_torch(init, grads, lrs, patched=True)
    finally:
        NO_DECAY = saved
    for (name, _), k, r in zip(SHAPES, kout, ref):
        assert k["decay"] == (0 if name in (saved - {"model.layers.0.self_attn.q_proj.bias"})
                              | {"lm_head.weight"} else 1)
        assert bits_equal(k["w"], r["w"]), name
