#!/usr/bin/env python3
"""profile_train_gpu.py -- where a kiln training step spends its GPU time: one sequence's
forward + loss + backward, then clip + AdamW, under torch.profiler (CUPTI records every
kernel of the process, kiln's included), with wall-clock phase times.

  python3 bench/profile_train_gpu.py --bin build-gpu [--models 135m,0.5b] [--seq 2048]
      [--batch 2] [--micro 1] [--top 25] [--auditable] [--torch] [--split]
      [--ce-row-block N] [--ce-logits-f32] [--moments f32|q8]

Models, data and the trainer settings are bench_train_gpu.py's. Prints, per model: the phase
times (each ends with a device sync), then the top kernels by total GPU time with their share
of all kernel time, calls and mean microseconds. --torch also profiles PyTorch eager (the
benchmark's f32 parameters + bf16 autocast + fused AdamW, micro-batches of --micro) on the
same model and batch: its step time and top kernels, for a kernel-by-kernel comparison.
"""
import argparse
import os
import sys
import tempfile
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_train_gpu as btg  # noqa: E402


# --no-phase-sync: no device wait around each phase (the benchmark's timeline, where the host
# queues the next phase while the device runs this one); a phase's time is then the host's.
PHASE_SYNC = True


def phase(name, fn, times):
    if PHASE_SYNC:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    r = fn()
    if PHASE_SYNC:
        torch.cuda.synchronize()
    times.append((name, time.perf_counter() - t0))
    return r


def profile_model(args, name, root):
    kiln = btg.kiln_mod(args)
    path = btg.make_model(name, root, "cuda")
    V = btg.SHAPES[name][6]
    B, T = args.batch, args.seq
    batch = btg.make_batches(V, B, T, 1, 1)[0]
    km = kiln.Model(path)
    M = max(1, args.micro)
    if B % M:
        raise SystemExit(f"--micro {M} must divide --batch {B}")
    extra = {"max_batch": M} if M > 1 else {}
    if args.ce_row_block is not None:
        extra["ce_row_block"] = args.ce_row_block
    if args.ce_logits_f32:
        extra["ce_logits_f32"] = True
    if args.moments:
        extra["moments"] = args.moments
    tr = kiln.Trainer(km, max_seq=T, n_threads=0, lr=btg.LR, betas=(0.9, 0.999), eps=1e-8,
                      weight_decay=btg.WD, device=0, fast=not args.auditable, **extra)
    for _ in range(2):  # warm: the second step records the step graphs (fast mode)
        btg.kiln_step(tr, batch, M)
    times = []
    from torch.profiler import profile, ProfilerActivity
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        torch.cuda.synchronize()
        t_step = time.perf_counter()
        for b in range(0, B, M):
            if M > 1:
                ids = batch[b:b + M]
                tg = np.concatenate([ids[:, 1:], -np.ones((M, 1), dtype=ids.dtype)], axis=1)
                if args.split:
                    phase("forward+loss", lambda: tr.forward_batch(ids, tg, "mean", M / B), times)
                else:  # the benchmark's call: forward + backward without a wait between
                    phase("step_batch", lambda: tr.step_batch(ids, tg, "mean", M / B,
                                                              accumulate=b > 0), times)
                    continue
            else:
                ids = batch[b].tolist()
                phase("forward+loss", lambda: tr.forward(ids, ids[1:] + [-1], "mean", 1.0 / B),
                      times)
            phase("backward", lambda: tr.backward(accumulate=b > 0), times)
        phase("clip", lambda: tr.clip_grads(1.0), times)
        phase("adamw", lambda: tr.optimizer_step(btg.LR), times)
        torch.cuda.synchronize()
        t_step = time.perf_counter() - t_step
    agg = {}
    for n, t in times:
        agg.setdefault(n, []).append(t)
    print(f"\n== {name} T {T} B {B} micro {M} {'auditable' if args.auditable else 'fast'}: "
          f"phases (ms{', host time: no device wait between them' if not PHASE_SYNC else ''}) ==")
    tot = sum(t for _, t in times) if PHASE_SYNC else t_step
    for n, ts in agg.items():
        print(f"  {n:14s} n={len(ts)}  each {1e3 * sum(ts) / len(ts):9.2f}  total {1e3 * sum(ts):9.2f}")
    print(f"  step {1e3 * tot:.1f} ms = {B * T / tot:.0f} tok/s")
    print_kernels(args, prof)
    del tr, km
    torch.cuda.empty_cache()
    if args.torch:
        profile_torch(args, path, batch, M)


def profile_torch(args, path, batch, M):
    model = btg.load_torch(path, "cuda")
    opt, _ = btg.make_adamw(model)
    x = torch.tensor(batch, dtype=torch.long, device="cuda")
    for _ in range(2):
        btg.torch_step(model, model, opt, x, "cuda", True, M)
    torch.cuda.synchronize()
    from torch.profiler import profile, ProfilerActivity
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        btg.torch_step(model, model, opt, x, "cuda", True, M)
        torch.cuda.synchronize()
        dt = time.perf_counter() - t0
    B, T = batch.shape
    print(f"\n== PyTorch eager (autocast bf16, fused AdamW, micro {M}): step {1e3 * dt:.1f} ms = "
          f"{B * T / dt:.0f} tok/s (under the profiler) ==")
    print_kernels(args, prof)
    del model, opt
    torch.cuda.empty_cache()


def print_kernels(args, prof):
    ev = prof.key_averages()
    rows = []
    for e in ev:
        t = getattr(e, "device_time_total", None)
        if t is None:
            t = getattr(e, "cuda_time_total", 0)
        if t > 0:
            rows.append((t, e.count, e.key))
    rows.sort(reverse=True)
    allt = sum(r[0] for r in rows)
    print(f"  kernels: {allt / 1e3:.1f} ms GPU time in {sum(r[1] for r in rows)} launches")
    for t, c, k in rows[:args.top]:
        print(f"  {100 * t / allt:5.1f}%  {t / 1e3:9.2f} ms  {c:6d} x {t / c:9.1f} us  {k[:90]}")
    # Host side: the CUDA runtime / driver calls kineto saw (CUPTI), by total host time; and
    # where the GPU sat idle: gaps between consecutive kernels, by the kernel that ended each.
    api = sorted(((e.cpu_time_total, e.count, e.key) for e in ev
                  if e.cpu_time_total > 0 and e.key.startswith("cu")), reverse=True)
    if api:
        print(f"  host API calls: {sum(a[0] for a in api) / 1e3:.1f} ms in "
              f"{sum(a[1] for a in api)} calls")
        for t, c, k in api[:6]:
            print(f"    {t / 1e3:8.2f} ms  {c:6d} x {t / c:7.1f} us  {k[:60]}")
    from torch.autograd import DeviceType
    ks = sorted((e.time_range.start, e.time_range.end, e.key) for e in prof.events()
                if e.device_type == DeviceType.CUDA)
    gaps, end, last = {}, None, None
    for a, b, k in ks:
        if end is not None and a > end:
            g = gaps.setdefault(last[:50], [0.0, 0])
            g[0] += a - end
            g[1] += 1
        if end is None or b > end:
            end, last = b, k
    tot_gap = sum(g[0] for g in gaps.values())
    print(f"  GPU idle between kernels: {tot_gap / 1e3:.1f} ms in {sum(g[1] for g in gaps.values())}"
          f" gaps; largest totals after:")
    for k, (t, c) in sorted(gaps.items(), key=lambda kv: -kv[1][0])[:6]:
        print(f"    {t / 1e3:8.2f} ms  {c:6d} gaps  after {k}")
    if args.neighbours:  # what runs just before and after the events named so (who asks for them)
        pairs = {}
        for i, (_, _, k) in enumerate(ks):
            if args.neighbours in k:
                prev = ks[i - 1][2][:45] if i > 0 else "-"
                nxt = ks[i + 1][2][:45] if i + 1 < len(ks) else "-"
                pairs[(prev, nxt)] = pairs.get((prev, nxt), 0) + 1
        print(f"  neighbours of '{args.neighbours}' (before -> after), by count:")
        for (a, b), c in sorted(pairs.items(), key=lambda kv: -kv[1])[:8]:
            print(f"    {c:5d} x  {a}  ->  {b}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", required=True)
    ap.add_argument("--models", default="135m,0.5b")
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--auditable", action="store_true")
    ap.add_argument("--ce-row-block", type=int, default=None,
                    help="the trainer's ce_row_block (default: the library's; 0: the loss's "
                         "vocabulary walk)")
    ap.add_argument("--ce-logits-f32", action="store_true",
                    help="the row walk keeps the loss's logits in f32 (the trainer's "
                         "ce_logits_f32; default bf16)")
    ap.add_argument("--moments", default=None, choices=["f32", "q8"],
                    help="the optimizer's moments (default: the library's, f32)")
    ap.add_argument("--split", action="store_true",
                    help="micro-batches as forward_batch + backward (two phases) instead of step_batch")
    ap.add_argument("--micro", type=int, default=1,
                    help="sequences per forward (forward_batch); must divide --batch")
    ap.add_argument("--neighbours", default=None,
                    help="list the kernels just before and after each one whose name holds this")
    ap.add_argument("--no-phase-sync", action="store_true",
                    help="no device wait around each phase: the benchmark's timeline (the step "
                         "time is then the wall time of the whole step)")
    ap.add_argument("--torch", action="store_true",
                    help="also profile PyTorch eager on the same model and batch")
    args = ap.parse_args()
    global PHASE_SYNC
    PHASE_SYNC = not args.no_phase_sync
    args.device = "cuda"
    args.kiln_device = 0
    with tempfile.TemporaryDirectory() as root:
        for m in args.models.split(","):
            profile_model(args, btg.ALIASES.get(m, m), root)


if __name__ == "__main__":
    main()
