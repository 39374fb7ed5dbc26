"""kiln.torch: kiln's fused linear cross-entropy as a torch.autograd.Function.

    import kiln.torch
    loss = kiln.torch.cross_entropy(hidden, lm_head.weight, targets)   # hidden (..., H)
    loss.backward()                                                      # hidden.grad, weight.grad

The loss is F.cross_entropy(hidden @ weight.T, targets, ignore_index=-100) without the N x V
logits: kiln_linear_ce (include/kiln.h) walks the vocabulary in chunks and gives the loss and
both gradients in one call, made during the forward and kept for the backward (which scales
them by the incoming gradient). Imported lazily by `kiln.torch`: `import kiln` needs no torch.

What is read where (docs/TRAINING.md, "torch interop"):
  - CPU tensors are read in place: hidden f32 or bf16, any strides along the leading
    dimensions whose rows are evenly spaced (a (N, H) view with stride (s, 1), a storage
    offset, or a (B, T, H) view such as h[:, :-1] whose sequences are read one call each);
    weight (V, H) f32 or bf16 with rows back to back. Anything else (a last dimension that
    is not contiguous, a weight with strided rows) is copied to a contiguous tensor first,
    and counted in kiln.torch.copies.
  - CUDA tensors (when kiln has CUDA): kiln reads them on the tensor's own device; the device
    reads f32 hidden states with rows back to back, so a bf16 or strided hidden is converted
    there first (counted in copies). targets and mask always go to the host.
  - targets: any integer tensor of hidden's leading shape; a negative target (torch's
    ignore_index -100) is not supervised. mask (optional, same shape): 0 is not supervised.
  - reduction "mean" (over the supervised positions) or "sum". The gradients are d loss /
    d hidden in hidden's dtype and d loss / d weight in weight's dtype, computed in float32.
"""
import ctypes
import threading

import numpy as np
import torch

import kiln

__all__ = ["cross_entropy", "copies"]

# Fallback copies made so far (a strided or bf16 hidden on CUDA, a non-contiguous last
# dimension, a weight with strided rows); the in-place paths leave it unchanged.
copies = 0

_local = threading.local()


def _handle(device):
    """This thread's kiln.LinearCrossEntropy for device (-1: the CPU), made once."""
    cache = getattr(_local, "handles", None)
    if cache is None:
        cache = _local.handles = {}
    if device not in cache:
        cache[device] = kiln.LinearCrossEntropy(device)
    return cache[device]


def _copied(t):
    global copies
    copies += 1
    return t


def _uniform_stride(h):
    """The row stride of hidden (..., H) when its rows (every leading index, in order) are
    evenly spaced and do not overlap: each leading dimension of size > 1 steps by the next
    one's size times its step; None otherwise (an expanded dimension, a transposed view)."""
    H = h.shape[-1]
    dims = [(h.shape[d], h.stride(d)) for d in range(h.dim() - 1) if h.shape[d] > 1]
    if not dims:
        return H
    for (_, s0), (n1, s1) in zip(dims, dims[1:]):
        if s0 != s1 * n1:
            return None
    return dims[-1][1] if dims[-1][1] >= H else None


def _row_blocks(h):
    """hidden (..., H) as a list of (tensor, rows, row stride) covering its rows in order, each
    a view of evenly spaced rows read in place: the whole tensor when its rows are evenly
    spaced, else its slices along the first dimension (h[:, :-1] of a (B, T, H) tensor: one
    block per sequence), and a contiguous copy only when neither works."""
    H = h.shape[-1]
    if H > 1 and h.stride(-1) != 1:
        return [(_copied(h.contiguous()), int(np.prod(h.shape[:-1])), H)]
    s = _uniform_stride(h)
    if s is not None:
        return [(h, int(np.prod(h.shape[:-1])), s)]
    if h.dim() > 2:
        return [blk for i in range(h.shape[0]) for blk in _row_blocks(h[i])]
    return [(_copied(h.contiguous()), int(np.prod(h.shape[:-1])), H)]


def _ce(hidden, weight, targets, mask, reduction, want_dh, want_dw):
    """(loss as a float32 tensor, dh (hidden's shape, float32) or None, dW (V, H) float32 or
    None) by kiln_linear_ce, one call per row block."""
    lib = kiln.load_library()
    if hidden.dim() < 1 or weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"cross_entropy: hidden {tuple(hidden.shape)} and weight {tuple(weight.shape)}: "
                         "hidden (..., H) and weight (V, H) expected")
    if hidden.device != weight.device:
        raise ValueError(f"cross_entropy: hidden on {hidden.device}, weight on {weight.device}")
    if hidden.dtype not in (torch.float32, torch.bfloat16):
        raise TypeError(f"cross_entropy: hidden dtype {hidden.dtype}: kiln reads float32 or bfloat16")
    if weight.dtype not in (torch.float32, torch.bfloat16):
        raise TypeError(f"cross_entropy: weight dtype {weight.dtype}: kiln reads float32 or bfloat16")
    if reduction not in ("mean", "sum"):
        raise ValueError(f"cross_entropy: reduction {reduction!r}: 'mean' or 'sum'")
    dev = hidden.device
    if dev.type == "cpu":
        device = -1
    elif dev.type == "cuda":
        device = dev.index if dev.index is not None else torch.cuda.current_device()
        if hidden.dtype != torch.float32:  # the device reads f32 rows
            hidden = _copied(hidden.float())
    else:
        raise ValueError(f"cross_entropy: tensors on {dev}: kiln reads CPU or CUDA tensors")
    lead = tuple(hidden.shape[:-1])
    H, V = hidden.shape[-1], weight.shape[0]
    N = int(np.prod(lead)) if lead else 1
    t = targets.detach().to("cpu") if hasattr(targets, "detach") else torch.as_tensor(targets)
    if tuple(t.shape) != lead:
        raise ValueError(f"cross_entropy: targets {tuple(t.shape)}, expected {lead}")
    if t.dtype.is_floating_point or t.dtype == torch.bool:
        raise TypeError(f"cross_entropy: targets dtype {t.dtype}: integers expected")
    t = np.ascontiguousarray(t.reshape(-1).numpy(), dtype=np.int64)
    if t.size and (t.max() >= V):
        raise ValueError(f"cross_entropy: a target {int(t.max())} >= V = {V}")
    t = t.astype(np.int32)
    m = None
    if mask is not None:
        mt = mask.detach().to("cpu") if hasattr(mask, "detach") else torch.as_tensor(mask)
        if tuple(mt.shape) != lead:
            raise ValueError(f"cross_entropy: mask {tuple(mt.shape)}, expected {lead}")
        m = np.ascontiguousarray(mt.reshape(-1).numpy() != 0, dtype=np.uint8)
    sup = (t >= 0) if m is None else (t >= 0) & (m != 0)
    S = int(sup.sum())
    if S == 0:
        raise ValueError("cross_entropy: no supervised positions (every target negative or masked)")

    w = weight.detach()
    if w.stride(-1) != 1 or (V > 1 and w.stride(0) != H):
        w = _copied(w.contiguous())
    h = hidden.detach()
    if device >= 0 and not h.is_contiguous():  # the device reads rows back to back
        h = _copied(h.contiguous())
    blocks = _row_blocks(h)
    f32 = dict(dtype=torch.float32, device=dev)
    dh = torch.empty((N, H), **f32) if want_dh else None
    dw = torch.zeros((V, H), **f32) if want_dw else None
    ce = _handle(device)
    if device >= 0:  # kiln runs on its own stream: torch's writes must be done
        torch.cuda.synchronize(device)
    one_call = len(blocks) == 1
    loss = 0.0
    row = 0
    for blk, rows, stride in blocks:
        p = lib.kiln_linear_ce_default_params()
        p.N, p.H, p.V = rows, H, V
        p.hidden, p.hidden_stride = blk.data_ptr(), stride
        p.hidden_bf16 = 1 if blk.dtype == torch.bfloat16 else 0
        p.weight, p.weight_bf16 = w.data_ptr(), 1 if w.dtype == torch.bfloat16 else 0
        tb = t[row:row + rows]
        mb = None if m is None else m[row:row + rows]
        p.targets = tb.ctypes.data
        if mb is not None:
            p.mask = mb.ctypes.data
        if one_call:
            p.reduction = 0 if reduction == "mean" else 1
        else:  # a block's share of the whole: the sum over its rows, over S for the mean
            p.reduction, p.scale = 1, (1.0 / S if reduction == "mean" else 1.0)
        if dh is not None:
            p.dhidden = dh[row:row + rows].data_ptr()
        if dw is not None:
            p.dweight = dw.data_ptr()
        block_sup = int(sup[row:row + rows].sum())
        if block_sup == 0:  # nothing to add; its rows' gradient is 0
            if dh is not None:
                dh[row:row + rows].zero_()
        else:
            r = kiln._LinearCEResult()
            kiln._check(lib.kiln_linear_ce_compute(ce._live(), ctypes.byref(p), ctypes.byref(r)))
            # one call: its float32 loss; blocks: their scaled sums (float64), added
            loss = r.loss if one_call else loss + r.loss_f64
        row += rows
    if dh is not None:
        dh = dh.view(*lead, H)
    return torch.tensor(loss, dtype=torch.float32, device=dev), dh, dw


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, mask, reduction):
        want_dh, want_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        loss, dh, dw = _ce(hidden, weight, targets, mask, reduction, want_dh, want_dw)
        ctx.dh, ctx.dw = dh, dw  # not inputs or outputs: kept on ctx
        ctx.dtypes = (hidden.dtype, weight.dtype)
        return loss

    @staticmethod
    def backward(ctx, grad):
        dh, dw = ctx.dh, ctx.dw
        gh = gw = None
        if ctx.needs_input_grad[0]:
            gh = (dh * grad.to(dh.dtype)).to(ctx.dtypes[0])
        if ctx.needs_input_grad[1]:
            gw = (dw * grad.to(dw.dtype)).to(ctx.dtypes[1])
        return gh, gw, None, None, None


def cross_entropy(hidden, weight, targets, mask=None, reduction="mean"):
    """F.cross_entropy(hidden @ weight.T, targets, ignore_index=-100, reduction=reduction) over
    the supervised positions (targets >= 0 and mask != 0), by kiln's fused linear
    cross-entropy: hidden (..., H), weight (V, H), targets (...). Differentiable in hidden and
    weight (the gradients are made in the forward, in float32, and kept: about N x H + V x H
    floats while the graph lives). The loss is a float32 scalar on hidden's device."""
    return _LinearCrossEntropy.apply(hidden, weight, targets, mask, reduction)
