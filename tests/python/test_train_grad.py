"""Training on the CPU against transformers' autograd in float64: the loss and every
parameter's gradient for tiny random models of each supported architecture, with masks and
scale, and through a caller's head (train_forward_hidden / train_backward(dh)).

Bound: per parameter, ||g_kiln - g_torch|| <= 1e-4 * ||g_torch|| (kiln computes in f32);
loss within 1e-5 relative.
"""
import numpy as np
import pytest
import torch

import kiln
from test_parity import build_model

torch.set_num_threads(2)
ARCHS = ["llama", "llama_tied_mqa", "mistral", "qwen2", "qwen3", "llama3_rope"]


def rand_ids(n, V, seed):
    return np.random.default_rng(seed).integers(3, V, size=n).tolist()


def torch_grads(ref):
    return {n: p.grad.detach().numpy() for n, p in ref.named_parameters() if p.grad is not None}


def compare_grads(tr, ref_grads, label, bound=1e-4):
    worst = 0.0
    names = set()
    for name, n, _ in tr.params():
        names.add(name)
        g = tr.get_grad(name, n).astype(np.float64)
        want = ref_grads[name].ravel()
        denom = max(np.linalg.norm(want), 1e-12)
        rel = np.linalg.norm(g - want) / denom
        worst = max(worst, rel)
        assert rel <= bound, f"{label}: gradient of {name}: relative error {rel:.3e}"
    assert names == set(ref_grads), f"{label}: parameter sets differ: {names ^ set(ref_grads)}"
    print(f"{label}: {len(names)} parameters, worst relative gradient error {worst:.3e}")


@pytest.mark.parametrize("arch", ARCHS)
def test_loss_and_gradients(tmp_path, build_dir, arch):
    d, ref = build_model(tmp_path, arch)
    m = kiln.Model(d)
    tr = kiln.Trainer(m, max_seq=64, n_threads=2)
    ids = rand_ids(24, m.n_vocab, 1)
    loss = tr.step(ids)
    out = ref(torch.tensor([ids]), labels=torch.tensor([ids]))
    out.loss.backward()
    assert abs(loss - out.loss.item()) <= 1e-5 * abs(out.loss.item()), (loss, out.loss.item())
    compare_grads(tr, torch_grads(ref), arch)

    # thread-count invariance of every gradient; and the fused loss's kept logits (the
    # default keeps them all here) give the bits of recomputing them (ce_keep_mib=0)
    tr1 = kiln.Trainer(m, max_seq=64, n_threads=1)
    tr0 = kiln.Trainer(m, max_seq=64, n_threads=2, ce_keep_mib=0)
    assert tr1.step(ids) == loss and tr0.step(ids) == loss
    for name, n, _ in tr.params():
        g = tr.get_grad(name, n).view(np.uint32)
        assert np.array_equal(g, tr1.get_grad(name, n).view(np.uint32)), name
        assert np.array_equal(g, tr0.get_grad(name, n).view(np.uint32)), f"{name} (no kept logits)"
    assert "kept logits" in tr.describe()[0] and "kept logits" not in tr0.describe()[0]


def test_mask_scale_and_accumulate(tmp_path, build_dir):
    d, ref = build_model(tmp_path, "qwen2")
    m = kiln.Model(d)
    tr = kiln.Trainer(m, max_seq=64, n_threads=2)
    a, b = rand_ids(20, m.n_vocab, 2), rand_ids(16, m.n_vocab, 3)
    ta = [t if i % 3 else -1 for i, t in enumerate(a[1:] + [-1])]
    tb = b[1:] + [-1]
    la = tr.forward(a, ta, reduction="sum", scale=0.25)
    tr.backward()
    lb = tr.forward(b, tb, reduction="mean", scale=0.5)
    tr.backward(accumulate=True)
    lossf = torch.nn.functional.cross_entropy
    la_t = 0.25 * lossf(ref(torch.tensor([a])).logits[0], torch.tensor(ta), ignore_index=-1, reduction="sum")
    lb_t = 0.5 * lossf(ref(torch.tensor([b])).logits[0], torch.tensor(tb), ignore_index=-1, reduction="mean")
    (la_t + lb_t).backward()
    assert abs(la - la_t.item()) <= 1e-5 * abs(la_t.item())
    assert abs(lb - lb_t.item()) <= 1e-5 * abs(lb_t.item())
    compare_grads(tr, torch_grads(ref), "qwen2 mask+scale+accumulate")


def test_hidden_states_and_own_head(tmp_path, build_dir):
    d, ref = build_model(tmp_path, "qwen3")
    m = kiln.Model(d)
    tr = kiln.Trainer(m, max_seq=64, n_threads=2)
    ids = rand_ids(18, m.n_vocab, 4)
    pos = [17, 3, 9, 0]
    h = tr.forward_hidden(ids, pos)
    head = np.random.default_rng(5).standard_normal((h.shape[1], 7))
    h_t = ref.model(torch.tensor([ids])).last_hidden_state[0, pos]
    assert np.abs(h - h_t.detach().numpy()).max() <= 1e-4 * max(1.0, np.abs(h_t.detach().numpy()).max())
    head_t = torch.tensor(head)
    (h_t @ head_t).pow(2).sum().backward()
    dh = 2.0 * (h.astype(np.float64) @ head) @ head.T  # the caller's head, in numpy
    tr.backward(dh.astype(np.float32))
    compare_grads(tr, torch_grads(ref), "qwen3 hidden head", bound=2e-4)


def test_pending_step_and_bad_inputs(tmp_path, build_dir):
    d, _ = build_model(tmp_path, "llama")
    m = kiln.Model(d)
    tr = kiln.Trainer(m, max_seq=32, n_threads=1)
    ids = rand_ids(10, m.n_vocab, 6)
    tr.forward(ids, ids[1:] + [-1])
    for call in (lambda: tr.step(ids), lambda: tr.grad_sq_norm(), lambda: tr.optimizer_step(1e-3),
                 lambda: tr.forward(ids, ids[1:] + [-1])):
        with pytest.raises(kiln.KilnError, match="pending"):
            call()
    tr.discard()
    with pytest.raises(kiln.KilnError, match="no pending step"):
        tr.backward()
    with pytest.raises(kiln.KilnError, match="out of range"):
        tr.step(ids[:5] + [m.n_vocab])
    with pytest.raises(kiln.KilnError, match="max_seq"):
        tr.step(rand_ids(33, m.n_vocab, 7))
    with pytest.raises(kiln.KilnError, match="no supervised positions"):
        tr.forward(ids, [-1] * len(ids))
    with pytest.raises(kiln.KilnError, match="vocabulary size"):
        tr.forward(ids, [m.n_vocab] * len(ids))  # "target ... >= vocabulary size"
    # nothing pending after the failures: a step works
    assert np.isfinite(tr.step(ids))


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_batch_of_sequences(tmp_path, build_dir, arch):
    """forward_batch: n_seq sequences in one forward = PyTorch's batch in one step (loss over
    all supervised positions, its gradient); each sequence's positions start at 0."""
    d, ref = build_model(tmp_path, arch)
    m = kiln.Model(d)
    B, T = 3, 14
    tr = kiln.Trainer(m, max_seq=16, n_threads=2, max_batch=4)
    ids = np.array([rand_ids(T, m.n_vocab, 20 + b) for b in range(B)])
    tg = np.concatenate([ids[:, 1:], -np.ones((B, 1), dtype=ids.dtype)], axis=1)
    tg[1, ::4] = -1  # unequal target counts: MEAN is over all supervised positions
    loss = tr.forward_batch(ids, tg, reduction="mean", scale=0.5)
    tr.backward()
    logits = ref(torch.tensor(ids)).logits
    loss_t = 0.5 * torch.nn.functional.cross_entropy(logits.reshape(B * T, -1), torch.tensor(tg).reshape(-1),
                                                     ignore_index=-1)
    loss_t.backward()
    assert abs(loss - loss_t.item()) <= 1e-5 * abs(loss_t.item()), (loss, loss_t.item())
    compare_grads(tr, torch_grads(ref), f"{arch} batch of {B}")

    # each sequence's forward is the one it has alone: a batch of one gives forward()'s bits,
    # and a batch's SUM loss is within rounding of the sum of its sequences' losses
    one = tr.forward_batch(ids[:1], tg[:1], reduction="sum")
    tr.discard()
    assert one == tr.forward(ids[0].tolist(), tg[0].tolist(), reduction="sum")
    tr.discard()
    total = tr.forward_batch(ids, tg, reduction="sum")
    tr.discard()
    parts = 0.0
    for b in range(B):
        parts += tr.forward(ids[b].tolist(), tg[b].tolist(), reduction="sum")
        tr.discard()
    assert abs(total - parts) <= 1e-5 * abs(parts), (total, parts)

    with pytest.raises(kiln.KilnError, match="max_batch"):
        tr.forward_batch(np.tile(ids[:1], (5, 1)), np.tile(tg[:1], (5, 1)))
    with pytest.raises(kiln.KilnError, match="max_seq"):
        tr.forward_batch(np.zeros((2, 17), dtype=np.int32), np.zeros((2, 17), dtype=np.int32))
    bad = ids.copy()
    bad[2, 5] = m.n_vocab
    with pytest.raises(kiln.KilnError, match="out of range"):
        tr.forward_batch(bad, tg)
    assert np.isfinite(tr.step(ids[0].tolist()))  # nothing pending after the failures


def test_step_batch_is_forward_batch_then_backward(tmp_path, build_dir):
    """step_batch (one call: forward_batch + backward) gives forward_batch + backward's loss
    and gradient bits, accumulating or not; its input errors come before anything changes."""
    d, _ = build_model(tmp_path, "llama")
    m = kiln.Model(d)
    B, T = 2, 12
    a = kiln.Trainer(m, max_seq=16, n_threads=2, max_batch=2)
    b = kiln.Trainer(m, max_seq=16, n_threads=2, max_batch=2)
    batches = [np.array([rand_ids(T, m.n_vocab, 40 + 2 * k + j) for j in range(B)]) for k in range(2)]
    for k, ids in enumerate(batches):
        tg = np.concatenate([ids[:, 1:], -np.ones((B, 1), dtype=ids.dtype)], axis=1)
        la = a.forward_batch(ids, tg, "mean", 0.5)
        a.backward(accumulate=k > 0)
        lb = b.step_batch(ids, tg, "mean", 0.5, accumulate=k > 0)
        assert np.float32(la).view(np.uint32) == np.float32(lb).view(np.uint32), (k, la, lb)
    for name, n, _ in a.params():
        assert np.array_equal(a.get_grad(name, n).view(np.uint32), b.get_grad(name, n).view(np.uint32)), name
    before = {name: b.get_grad(name, n).copy() for name, n, _ in b.params()}
    ids = batches[0]
    bad_tg = np.full_like(ids, -1)
    with pytest.raises(kiln.KilnError, match="no supervised"):
        b.step_batch(ids, bad_tg, accumulate=True)
    bad = ids.copy()
    bad[1, 3] = m.n_vocab
    with pytest.raises(kiln.KilnError, match="out of range"):
        b.step_batch(bad, bad_tg, accumulate=True)
    for name, n, _ in b.params():  # the failed calls changed nothing
        assert np.array_equal(before[name].view(np.uint32), b.get_grad(name, n).view(np.uint32)), name
    b.clip_grads(1.0)
    b.optimizer_step(1e-3)


def test_clip_coefficient_applied_in_the_optimizer(tmp_path, build_dir):
    """clip_grads leaves its coefficient for AdamW to apply as it reads each gradient: the
    weights must have the bits of scaling the stored gradients first (forced here by
    grad_sq_norm, which applies a pending coefficient), and get_grad must return the clipped
    gradients either way."""
    d, _ = build_model(tmp_path, "qwen2")
    m = kiln.Model(d)
    ids = rand_ids(24, m.n_vocab, 5)
    a = kiln.Trainer(m, max_seq=32, n_threads=2, lr=1e-2)
    b = kiln.Trainer(m, max_seq=32, n_threads=2, lr=1e-2)
    for step in range(3):
        assert a.step(ids) == b.step(ids)
        na = a.clip_grads(0.05)
        nb = b.clip_grads(0.05)
        assert na == nb and 0.0 < na[1] < 1.0, na  # a real clip
        b.grad_sq_norm()  # applies b's pending coefficient to its stored gradients
        for name, n, _ in a.params():
            assert np.array_equal(a.get_grad(name, n).view(np.uint32), b.get_grad(name, n).view(np.uint32)), name
        a.optimizer_step(1e-2)
        b.optimizer_step(1e-2)
        for name, n, _ in a.params():
            assert np.array_equal(a.get_param(name, n).view(np.uint32), b.get_param(name, n).view(np.uint32)), \
                f"step {step}: {name}"
