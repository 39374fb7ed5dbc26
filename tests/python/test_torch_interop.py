"""torch interop (issue 32, item 3): kiln.torch.cross_entropy against
torch.nn.functional.cross_entropy(hidden @ weight.T) in float64 with autograd (strided views,
storage offsets, bf16, masks, reductions), and the Trainer's torch-facing methods against
transformers' autograd and torch.optim.AdamW on tiny random models: parameters and
gradients, clip_coef's bits, adamw_step with per-name weight decay (bit for bit with torch's
AdamW under a correctly rounded sqrt, within 1e-6 of it as it is: test_adamw.py's bounds),
and adamw_state / load_adamw_state resuming bit for bit.
"""
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import kiln
from test_adamw import exact_sqrt
from test_parity import build_model

torch.set_num_threads(2)
REPO_PY = str(__import__("pathlib").Path(__file__).resolve().parents[2] / "python")

LOSS_RTOL = 1e-5  # test_linear_ce_api.py's bounds (f32 arithmetic against float64)
GRAD_TOL = 1e-5   # every element within this much of the largest |grad|


def bits(x):
    return np.asarray(x, dtype=np.float32).view(np.uint32)


def test_import_kiln_does_not_import_torch(build_dir):
    code = ("import sys; sys.modules['torch'] = None; sys.path.insert(0, %r); import kiln; "
            "assert 'kiln.torch' not in sys.modules; kiln.load_library(); print('ok')" % REPO_PY)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr


# ---- kiln.torch.cross_entropy --------------------------------------------------------------

def reference(h, w, t, mask, reduction):
    """float64 loss and autograd gradients of the values h and w hold."""
    h64 = h.detach().double().requires_grad_()
    w64 = w.detach().double().requires_grad_()
    tt = t.clone().long()
    if mask is not None:
        tt[mask == 0] = -100
    V = w.shape[0]
    loss = F.cross_entropy((h64 @ w64.T).reshape(-1, V), tt.reshape(-1), ignore_index=-100,
                           reduction=reduction)
    loss.backward()
    return loss.item(), h64.grad, w64.grad


def layouts(N, H, gen):
    """(name, base leaf, function base -> hidden (..., H), in place?) for hidden's layouts."""
    return [
        ("contiguous", torch.randn(N, H, generator=gen), lambda b: b, True),
        # rows strided, with a storage offset: the middle H columns of rows 1.. of a wider matrix
        ("strided rows + offset", torch.randn(N + 1, H + 7, generator=gen), lambda b: b[1:, 3:3 + H], True),
        # (B, T, H) shifted as for next-token targets: each sequence is one call
        ("shifted sequences", torch.randn(4, N // 4 + 1, H, generator=gen), lambda b: b[:, :-1], True),
        # every other row of a (2N, H) matrix, viewed as (2, N/2, H): evenly spaced, one call
        ("every other row 3-D", torch.randn(2 * N, H, generator=gen), lambda b: b[::2].view(2, N // 2, H), True),
        # a transposed layout (last dimension not contiguous): copied
        ("transposed", torch.randn(H, N, generator=gen), lambda b: b.T, False),
    ]


@pytest.mark.parametrize("hdt,wdt", [("f32", "f32"), ("f32", "bf16"), ("bf16", "f32"), ("bf16", "bf16")])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("with_mask", [False, True])
def test_cross_entropy_against_torch(build_dir, hdt, wdt, reduction, with_mask):
    N, H, V = 24, 40, 301
    gen = torch.Generator().manual_seed(7)
    dt = {"f32": torch.float32, "bf16": torch.bfloat16}
    for name, base0, view, in_place in layouts(N, H, gen):
        base = base0.to(dt[hdt]).requires_grad_()
        w = (torch.randn(V, H, generator=gen) * 0.5).to(dt[wdt]).requires_grad_()
        h = view(base)
        lead = h.shape[:-1]
        t = torch.randint(0, V, lead, generator=gen)
        t.view(-1)[::5] = -100
        mask = (torch.rand(lead, generator=gen) < 0.7).to(torch.uint8) if with_mask else None
        before = kiln.torch.copies
        loss = kiln.torch.cross_entropy(h, w, t, mask=mask, reduction=reduction)
        assert (kiln.torch.copies == before) == in_place, name
        loss.backward()
        ref_loss, ref_dh, ref_dw = reference(h, w, t, mask, reduction)
        label = f"{name}, hidden {hdt}, weight {wdt}, {reduction}, mask {with_mask}"
        assert loss.dtype == torch.float32 and loss.dim() == 0
        assert abs(loss.item() - ref_loss) <= LOSS_RTOL * abs(ref_loss), (label, loss.item(), ref_loss)
        # the base leaf's gradient: the view's rows, zero elsewhere (autograd through the view)
        ref_base = torch.zeros(base.shape, dtype=torch.float64)
        view(ref_base)[...] = ref_dh
        for got, want, what in ((base.grad, ref_base, "hidden"), (w.grad, ref_dw, "weight")):
            assert got.dtype == (base.dtype if what == "hidden" else w.dtype), label
            err = (got.double() - want).abs()
            # a bf16 gradient is the f32 one rounded: half a bf16 ulp (2^-9 relative) more
            tol = GRAD_TOL * want.abs().max() + (2.0 ** -8 * want.abs() if got.dtype == torch.bfloat16 else 0)
            assert bool((err <= tol).all()), f"{label}: d{what} error {err.max().item():.3g}"


def test_cross_entropy_one_call_is_linear_ce(build_dir):
    """The 2-D in-place call is kiln_linear_ce itself: the bits of kiln.LinearCrossEntropy on
    a contiguous copy, strided or not."""
    N, H, V = 16, 32, 97
    g = torch.Generator().manual_seed(3)
    big = torch.randn(N, H + 5, generator=g)
    w = torch.randn(V, H, generator=g)
    t = torch.randint(0, V, (N,), generator=g)
    hv = big[:, 2:2 + H].requires_grad_(False)
    h_leaf = hv.clone().requires_grad_()
    w_leaf = w.clone().requires_grad_()
    loss = kiln.torch.cross_entropy(hv.clone().requires_grad_(), w_leaf, t)
    loss2 = kiln.torch.cross_entropy(big[:, 2:2 + H], w, t)  # no grad wanted: loss only
    ce = kiln.LinearCrossEntropy("cpu")
    dh, dw = np.zeros((N, H), np.float32), np.zeros((V, H), np.float32)
    want = ce(np.ascontiguousarray(hv.numpy()), w.numpy(), t.numpy(), dhidden=dh, dweight=dw)
    assert bits(loss.item()) == bits(want) and bits(loss2.item()) == bits(want)
    loss3 = kiln.torch.cross_entropy(h_leaf, w_leaf, t)
    w_leaf.grad = None
    loss3.backward()
    assert np.array_equal(bits(h_leaf.grad.numpy()), bits(dh))
    assert np.array_equal(bits(w_leaf.grad.numpy()), bits(dw))
    # the incoming gradient scales both (chain rule): 3 * loss
    h_leaf.grad = w_leaf.grad = None
    (3.0 * kiln.torch.cross_entropy(h_leaf, w_leaf, t)).backward()
    assert np.array_equal(h_leaf.grad.numpy(), dh * np.float32(3.0))


def test_cross_entropy_errors(build_dir):
    h, w = torch.randn(6, 8), torch.randn(11, 8)
    t = torch.randint(0, 11, (6,))
    with pytest.raises(ValueError, match="no supervised"):
        kiln.torch.cross_entropy(h, w, torch.full((6,), -100))
    with pytest.raises(ValueError, match="no supervised"):
        kiln.torch.cross_entropy(h, w, t, mask=torch.zeros(6))
    with pytest.raises(ValueError, match="V = 11"):
        kiln.torch.cross_entropy(h, w, torch.full((6,), 11))
    with pytest.raises(TypeError, match="float64"):
        kiln.torch.cross_entropy(h.double(), w, t)
    with pytest.raises(ValueError, match="reduction"):
        kiln.torch.cross_entropy(h, w, t, reduction="none")
    with pytest.raises(ValueError, match="targets"):
        kiln.torch.cross_entropy(h, w, t[:5])
    with pytest.raises(ValueError, match="weight"):
        kiln.torch.cross_entropy(h, w[:, :4], t)


def test_linear_ce_c_api_stride_and_bf16(build_dir):
    """The C API's own additions: hidden_stride reads a strided buffer in place with the bits
    of the contiguous rows, and hidden_bf16 the bits of the widened values; a stride below H
    is refused naming it."""
    import ctypes
    lib = kiln.load_library()
    N, H, V, ld = 12, 24, 50, 31
    rng = np.random.default_rng(4)
    big = rng.standard_normal((N, ld)).astype(np.float32)
    w = rng.standard_normal((V, H)).astype(np.float32)
    t = rng.integers(0, V, N).astype(np.int32)
    ce = kiln.LinearCrossEntropy("cpu")

    def run(hptr, stride, bf16, dh):
        p = lib.kiln_linear_ce_default_params()
        assert p.hidden_stride == 0 and p.hidden_bf16 == 0
        p.N, p.H, p.V = N, H, V
        p.hidden, p.hidden_stride, p.hidden_bf16 = hptr, stride, bf16
        p.weight, p.targets, p.dhidden = w.ctypes.data, t.ctypes.data, dh.ctypes.data
        r = kiln._LinearCEResult()
        st = lib.kiln_linear_ce_compute(ce._h, ctypes.byref(p), ctypes.byref(r))
        return st, r.loss

    dh1, dh2 = np.zeros((N, H), np.float32), np.zeros((N, H), np.float32)
    st1, l1 = run(big.ctypes.data + 4 * 5, ld, 0, dh1)  # columns 5..5+H of each row
    dense = np.ascontiguousarray(big[:, 5:5 + H])  # kept alive across the call
    st2, l2 = run(dense.ctypes.data, 0, 0, dh2)
    assert st1 == st2 == 0 and bits(l1) == bits(l2) and np.array_equal(bits(dh1), bits(dh2))
    hb = torch.from_numpy(big).bfloat16()
    hb_bits = hb.view(torch.int16).numpy()
    st3, l3 = run(hb_bits.ctypes.data + 2 * 5, ld, 1, dh1)
    widened = np.ascontiguousarray(hb.float().numpy()[:, 5:5 + H])
    st4, l4 = run(widened.ctypes.data, 0, 0, dh2)
    assert st3 == st4 == 0 and bits(l3) == bits(l4) and np.array_equal(bits(dh1), bits(dh2))
    st5, _ = run(big.ctypes.data, H - 1, 0, dh1)
    assert st5 == 1 and "hidden_stride" in lib.kiln_last_error().decode()


def test_cross_entropy_cuda(build_dir):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU visible to torch")
    try:
        kiln.LinearCrossEntropy("cuda").close()
    except kiln.KilnError as e:
        pytest.skip(f"kiln has no CUDA device: {e.message}")
    N, H, V = 32, 64, 500
    g = torch.Generator().manual_seed(9)
    base = torch.randn(2, N // 2 + 1, H, generator=g)
    w = torch.randn(V, H, generator=g) * 0.5
    t = torch.randint(0, V, (2, N // 2), generator=g)
    dev = torch.device("cuda", torch.cuda.device_count() - 1)
    bc, wc = base.to(dev).requires_grad_(), w.to(dev).requires_grad_()
    loss = kiln.torch.cross_entropy(bc[:, :-1], wc, t.to(dev))
    loss.backward()
    assert loss.device == dev
    ref_loss, ref_dh, ref_dw = reference(base[:, :-1], w, t, None, "mean")
    assert abs(loss.item() - ref_loss) <= LOSS_RTOL * abs(ref_loss)
    assert (bc.grad[:, :-1].cpu().double() - ref_dh).abs().max() <= GRAD_TOL * ref_dh.abs().max()
    assert (wc.grad.cpu().double() - ref_dw).abs().max() <= GRAD_TOL * ref_dw.abs().max()


# ---- the Trainer -----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    d, _ = build_model(tmp_path_factory.mktemp("torch_interop"), "llama")
    from transformers import AutoModelForCausalLM
    return d, lambda: AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)


def batches(V, steps, T=20):
    g = torch.Generator().manual_seed(11)
    return [torch.randint(3, V, (T,), generator=g) for _ in range(steps)]


def step_grads(tr, ids):
    """A next-token step on kiln (forward + backward through the torch-facing calls)."""
    targets = torch.cat([ids[1:], torch.tensor([-1])])
    loss = tr.train_forward(ids, targets)
    tr.train_backward()
    return loss


def test_parameters_and_grads_match_transformers(llama, build_dir):
    d, load = llama
    ref = load()
    m = kiln.Model(d)
    tr = kiln.Trainer(m, max_seq=32, n_threads=2)
    got = tr.parameters()
    want = dict(ref.named_parameters())
    assert list(got) == list(want)  # names and order: named_parameters()
    for name, p in want.items():
        assert got[name].shape == p.shape and got[name].dtype == torch.float32, name
        assert torch.equal(got[name], p.detach()), name
    ids = batches(m.n_vocab, 1)[0]
    loss = step_grads(tr, ids)
    out = ref(ids[None], labels=ids[None])
    out.loss.backward()
    assert abs(loss.item() - out.loss.item()) <= 1e-5 * out.loss.item()
    grads = tr.grads()
    for name, p in want.items():
        rel = (grads[name] - p.grad).norm() / p.grad.norm()
        assert rel <= 1e-4, (name, rel.item())
    # load_parameters writes what parameters() reads; a wrong shape or name changes nothing
    new = {name: t * 0.5 for name, t in got.items()}
    with pytest.raises(ValueError, match="shape"):
        tr.load_parameters({**new, "model.norm.weight": torch.zeros(3)})
    with pytest.raises(KeyError, match="nope"):
        tr.load_parameters({"nope": torch.zeros(3)})
    assert all(torch.equal(v, got[k]) for k, v in tr.parameters().items())
    tr.load_parameters(new)
    assert all(torch.equal(v, new[k]) for k, v in tr.parameters().items())


def test_hidden_and_kiln_torch_head(llama, build_dir):
    """hidden() + kiln.torch.cross_entropy on the untied head + train_backward(h.grad) gives
    train_forward's loss and gradients (the head's from autograd, the trunk's from kiln)."""
    d, load = llama
    m = kiln.Model(d)
    a = kiln.Trainer(m, max_seq=32, n_threads=2)
    b = kiln.Trainer(m, max_seq=32, n_threads=2)
    ids = batches(m.n_vocab, 1)[0]
    targets = torch.cat([ids[1:], torch.tensor([-100])])
    la = step_grads(a, ids)
    h = b.hidden(ids).requires_grad_()
    head = b.parameters()["lm_head.weight"].requires_grad_()
    lb = kiln.torch.cross_entropy(h, head, targets)
    lb.backward()
    b.train_backward(h.grad)
    assert abs(la.item() - lb.item()) <= 1e-6 * la.item()
    ga, gb = a.grads(), b.grads()
    for name in ga:
        want = ga[name]
        got = head.grad if name == "lm_head.weight" else gb[name]
        assert (got - want).norm() <= 1e-5 * want.norm(), name


def torch_adamw(params, names, weight_decay, lr):
    """torch.optim.AdamW over params with kiln's weight decay semantics for weight_decay: None
    (the trainer's rule: 0.01, none for norms and biases), a float, or {name: float}."""
    def own(n):
        return 0.0 if ("norm" in n or "bias" in n) else 0.01
    if weight_decay is None:
        wds = [own(n) for n in names]
    elif isinstance(weight_decay, dict):
        wds = [weight_decay.get(n, own(n)) for n in names]
    else:
        wds = [float(weight_decay)] * len(names)
    groups = [{"params": [p], "weight_decay": wd} for p, wd in zip(params, wds)]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.999), eps=1e-8, foreach=False)


@pytest.mark.parametrize("weight_decay", [None, 0.1, {"model.norm.weight": 0.5, "lm_head.weight": 0.0,
                                                       "model.layers.0.mlp.up_proj.weight": 0.2}])
def test_adamw_step_matches_torch(llama, build_dir, weight_decay):
    """Each step: kiln's gradients go to torch's parameters too; clip_coef has the bits of
    clip_grad_norm_'s coefficient; adamw_step(grad_scale=coef) gives torch.optim.AdamW's
    weights and moments (bit for bit with a correctly rounded sqrt, within 1e-6 without)."""
    d, load = llama
    m = kiln.Model(d)
    tr = kiln.Trainer(m, max_seq=32, n_threads=2)
    start = tr.parameters()
    names = list(start)
    exact = [torch.nn.Parameter(start[n].clone()) for n in names]
    plain = [torch.nn.Parameter(start[n].clone()) for n in names]
    opt_e = torch_adamw(exact, names, weight_decay, 1e-2)
    opt_p = torch_adamw(plain, names, weight_decay, 1e-2)
    for k, ids in enumerate(batches(m.n_vocab, 4)):
        lr = 1e-2 * (1 - 0.1 * k)
        step_grads(tr, ids)
        g = tr.grads()
        for ps in (exact, plain):
            for n, p in zip(names, ps):
                p.grad = g[n].clone()
        max_norm = 0.05 if k % 2 == 0 else 1e4  # a real clip, then none
        total, coef = tr.clip_coef(max_norm, with_norm=True)
        # torch's clip_grad_norm_: its total norm, then its own expression for the coefficient
        total_t = torch.nn.utils.get_total_norm([p.grad for p in exact])
        coef_t = torch.clamp(max_norm / (total_t + 1e-6), max=1.0)
        # the coefficient of a total has torch's bits; the totals agree to the last bit but for
        # torch's sum of a short vector of norms (here 21), which is not always kiln's lane
        # order: within one ulp (docs/TRAINING.md, "torch interop")
        coef_k = torch.clamp(max_norm / (torch.tensor(total, dtype=torch.float32) + 1e-6), max=1.0)
        assert bits(coef) == bits(coef_k.item()), (k, coef, coef_k)
        ulps = abs(int(bits(total)) - int(bits(total_t.item())))
        assert ulps <= 1, (k, total, total_t)
        if ulps == 0:
            assert bits(coef) == bits(coef_t.item()), (k, coef, coef_t)
        assert (coef < 1.0) == (k % 2 == 0)
        for ps in (exact, plain):  # clip_grad_norm_'s scaling, with kiln's coefficient
            torch._foreach_mul_([p.grad for p in ps], torch.tensor(coef, dtype=torch.float32))
        tr.adamw_step(lr, weight_decay=weight_decay, grad_scale=coef)
        for opt in (opt_e, opt_p):
            for grp in opt.param_groups:
                grp["lr"] = lr
        with exact_sqrt():
            opt_e.step()
        opt_p.step()
        got, st = tr.parameters(), tr.adamw_state()
        worst = 0.0
        for n, pe, pp in zip(names, exact, plain):
            assert np.array_equal(bits(got[n].numpy()), bits(pe.detach().numpy())), (k, n)
            s_t = opt_e.state[pe]
            assert np.array_equal(bits(st[n]["exp_avg"].numpy()), bits(s_t["exp_avg"].numpy())), (k, n)
            assert np.array_equal(bits(st[n]["exp_avg_sq"].numpy()), bits(s_t["exp_avg_sq"].numpy())), (k, n)
            assert st[n]["step"].dtype == s_t["step"].dtype and st[n]["step"].item() == s_t["step"].item()
            worst = max(worst, (got[n] - pp.detach()).abs().max().item())
        assert worst <= 1e-6, (k, worst)
        # the gradients now read are the clipped ones (p.grad.mul_(coef))
        if k == 0:
            gg = tr.grads()
            assert all(np.array_equal(bits(gg[n].numpy()), bits(p.grad.numpy())) for n, p in zip(names, exact))


def test_adamw_state_resumes_bit_for_bit(llama, build_dir):
    """A run of 4 steps, and a run of 2 steps whose parameters() and adamw_state() are loaded
    into a fresh trainer that runs steps 3 and 4: the same bits; also from a torch
    optimizer's state_dict (torch's AdamW run on kiln's gradients, correctly rounded sqrt)."""
    d, _ = llama
    m = kiln.Model(d)
    data = batches(m.n_vocab, 4)
    wd = {"model.norm.weight": 0.3}

    def run(tr, steps):
        for k in steps:
            step_grads(tr, data[k])
            tr.adamw_step(1e-2 * (1 - 0.1 * k), weight_decay=wd, grad_scale=tr.clip_coef(0.1))

    a = kiln.Trainer(m, max_seq=32, n_threads=2)
    run(a, range(4))
    b = kiln.Trainer(m, max_seq=32, n_threads=2)
    run(b, range(2))
    params, state = b.parameters(), b.adamw_state()
    c = kiln.Trainer(m, max_seq=32, n_threads=2)
    c.load_parameters(params)
    c.load_adamw_state(state)
    assert all(torch.equal(c.adamw_state()[n][k], state[n][k]) for n in state for k in state[n])
    run(c, range(2, 4))
    pa, pc = a.parameters(), c.parameters()
    for n in pa:
        assert np.array_equal(bits(pa[n].numpy()), bits(pc[n].numpy())), n

    # torch.optim.AdamW's state_dict() (integer keys, param_groups) loads the same way
    names = list(params)
    ps = [torch.nn.Parameter(params[n].clone()) for n in names]
    opt = torch_adamw(ps, names, wd, 1e-2)
    for i, p in enumerate(ps):  # torch's state at step 2: kiln's moments
        opt.state[p] = {k: v.clone() for k, v in state[names[i]].items()}
    sd = opt.state_dict()
    assert set(sd["state"]) == set(range(len(names)))
    e = kiln.Trainer(m, max_seq=32, n_threads=2)
    e.load_parameters(params)
    e.load_adamw_state(sd)
    run(e, range(2, 4))
    pe = e.parameters()
    assert all(np.array_equal(bits(pa[n].numpy()), bits(pe[n].numpy())) for n in pa)

    # refused, with nothing written: a missing parameter, unequal steps
    with pytest.raises(KeyError):
        e.load_adamw_state({n: state[n] for n in names[1:]})
    bad = {n: dict(state[n]) for n in names}
    bad[names[0]]["step"] = torch.tensor(5.0)
    with pytest.raises(ValueError, match="different steps"):
        e.load_adamw_state(bad)


def test_q8_moments_state(llama, build_dir):
    """8-bit moments: adamw_state gives their dequantized values; loading them requantizes
    (documented as lossy): the reloaded values stay within a block's quantization error."""
    d, _ = llama
    m = kiln.Model(d)
    tr = kiln.Trainer(m, max_seq=32, n_threads=2, moments="q8")
    for k, ids in enumerate(batches(m.n_vocab, 2)):
        step_grads(tr, ids)
        tr.adamw_step(1e-2)
    st = tr.adamw_state()
    u = kiln.Trainer(m, max_seq=32, n_threads=2, moments="q8")
    u.load_parameters(tr.parameters())
    u.load_adamw_state(st)
    st2 = u.adamw_state()
    for n in st:
        for k in ("exp_avg", "exp_avg_sq"):
            a, b = st[n][k], st2[n][k]
            assert (a - b).abs().max() <= 0.1 * a.abs().max() + 1e-30, (n, k)
        assert st2[n]["step"].item() == 2.0


def test_weight_decay_and_grad_scale_contracts(llama, build_dir):
    d, _ = llama
    m = kiln.Model(d)
    tr = kiln.Trainer(m, max_seq=32, n_threads=2, storage="bf16_kahan")
    ids = batches(m.n_vocab, 1)[0]
    step_grads(tr, ids)
    before = tr.parameters()
    # Kahan: the decay is part of the update's rounding: only a parameter's own decay
    with pytest.raises(kiln.KilnError, match="model.norm.weight|lm_head.weight") as e:
        tr.adamw_step(1e-2, weight_decay={"lm_head.weight": 0.5})
    assert e.value.status == 4
    assert all(torch.equal(v, before[k]) for k, v in tr.parameters().items())
    tr.adamw_step(1e-2, weight_decay={"lm_head.weight": 0.01, "model.norm.weight": 0.0})  # their own
    with pytest.raises(KeyError, match="nope"):
        tr.adamw_step(1e-2, weight_decay={"nope": 0.1})
    with pytest.raises(ValueError, match="weight_decay"):
        tr.adamw_step(1e-2, weight_decay=-1.0)
    # grad_scale > 1 multiplies the stored gradients in place (p.grad.mul_)
    f = kiln.Trainer(m, max_seq=32, n_threads=2)
    step_grads(f, ids)
    g0 = f.grads()
    f.adamw_step(1e-3, grad_scale=4.0)
    g1 = f.grads()
    assert all(np.array_equal(bits(g1[n].numpy()), bits((g0[n] * 4.0).numpy())) for n in g0)
    with pytest.raises(kiln.KilnError, match="grad_scale"):
        f.adamw_step(1e-3, grad_scale=float("inf"))


def test_bf16_master_per_name_decay(llama, build_dir):
    """bf16 + f32 master: a per-name decay runs on the master copy, so the weights stay the
    bf16 rounding of torch's f32 AdamW from the same (bf16) start and gradients."""
    d, _ = llama
    m = kiln.Model(d)
    tr = kiln.Trainer(m, max_seq=32, n_threads=2, storage="bf16_master")
    start = tr.parameters()  # bf16 values (matrices), f32 vectors
    names = list(start)
    ps = [torch.nn.Parameter(start[n].clone()) for n in names]
    wd = {"model.layers.0.mlp.up_proj.weight": 0.3, "model.norm.weight": 0.2}
    opt = torch_adamw(ps, names, wd, 1e-2)
    for k, ids in enumerate(batches(m.n_vocab, 3)):
        step_grads(tr, ids)
        g = tr.grads()
        for n, p in zip(names, ps):
            p.grad = g[n].clone()
        tr.adamw_step(1e-2, weight_decay=wd)
        with exact_sqrt():
            opt.step()
        got = tr.parameters()
        for n, p in zip(names, ps):
            want = p.detach()
            if got[n].dim() == 2:  # a matrix: bf16 weights, RNE of the f32 master
                want = want.bfloat16().float()
            assert np.array_equal(bits(got[n].numpy()), bits(want.numpy())), (k, n)
