#!/usr/bin/env python3
"""bench_distill_gpu.py -- the distillation benchmark of issue 30: one distillation step of a
Qwen2.5-0.5B-shaped student against a Qwen2.5-1.5B-shaped teacher on one GPU, kiln against a
PyTorch distillation step doing the same losses, tokens/s and memory, one table printed last
and a JSON.

HOW TO RUN (on the GPU machine: python3 with torch and transformers; kiln built with
-DKILN_CUDA=ON into a build folder):

  python3 bench/bench_distill_gpu.py --bin DIR [--batch 8] [--seq 1024] [--micro 4]
      [--steps 3] [--modes fast,auditable] [--compile] [--json OUT.json]
      [--teacher 1.5b] [--student 0.5b] [--no-torch] [--breakdown]
  --breakdown: also times kiln's plain cross-entropy step of the student on the same batches
  (what the teacher's forward and the distillation loss add is the difference).
  --device cpu --quick: the CPU smoke mode (tiny teacher and student, sequences of 32, kiln
  and torch on the CPU): every piece runs end to end; its figures mean nothing.

MODELS: random weights written here with transformers as bf16 Hugging Face folders that both
engines load (bench_train_gpu.make_model: norms and biases perturbed), one synthetic byte-level
tokenizer of the vocabulary (151,936) for both: teacher Qwen2Config C 1536, 28 layers, 12/2
heads, FF 8960; student C 896, 24 layers, 14/2 heads, FF 4864; both tied.

ONE STEP = B sequences of T random ids (the same for both engines): the teacher's forward
(no gradient), the student's forward, per next-token position
    loss = 0.5 * tau^2 * KL(softmax(z_t / tau) || softmax(z_s / tau)) + 0.5 * CE(z_s, target)
with tau 2, averaged over the B x (T - 1) positions, its backward, clip_grad_norm 1.0 and
AdamW (lr 1e-4, weight decay 0.1). tokens/s = B x T / median step time.
  - PyTorch: transformers' models, the student's parameters f32 under
    torch.autocast(bfloat16), the teacher bf16 in eval mode under torch.no_grad(), sdpa
    attention; both logits upcast to f32 and the loss on the whole (B x T, V) logits
    (F.log_softmax, F.kl_div(log_target=True), F.cross_entropy), fused AdamW; --compile adds
    a torch.compile'd student (forward + loss), its first two steps (compilation) untimed.
    The batch goes through --torch-micro sequences at a time (default: all B at once).
  - kiln: kiln.Trainer(student, device 0, fast=True for "fast"; f32 weights and AdamW),
    kiln.Teacher(teacher, trainer), Trainer.distill_step over --micro sequences per call
    (scale micro/B, gradients accumulated), then clip_grads(1.0) and optimizer_step. In kiln
    neither model's (B x T, V) logits exist: the teacher's come block by block and the
    student's chunk by chunk inside the fused loss.
  Memory: PyTorch's torch.cuda.max_memory_allocated over the step (above what was allocated
  before the models), kiln's describe() peak_step, and for both the device's view
  (bench_train_gpu.DevicePeak: polled used memory, minus the used memory before).
"""
import argparse
import json
import os
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import bench_train_gpu as bt  # noqa: E402

bt.SHAPES.setdefault("Qwen2.5-1.5B", ("qwen2", 1536, 28, 12, 2, 8960, 151936, 1e6, 1e-6))
bt.SHAPES.setdefault("tiny-qwen2-teacher", ("qwen2", 96, 3, 4, 2, 192, 768, 1e6, 1e-6))
ALIASES = {"0.5b": "Qwen2.5-0.5B", "1.5b": "Qwen2.5-1.5B", "tiny": "tiny-qwen2",
           "tiny-teacher": "tiny-qwen2-teacher"}
TAU, KD, CE = 2.0, 0.5, 0.5


def log(*a):
    print(*a, flush=True)


def torch_loss(zs, zt, tg):
    """The step's loss on (N, V) f32 logits: KD * tau^2 * KL + CE * CE, mean over positions."""
    logp = F.log_softmax(zt / TAU, dim=-1)
    logq = F.log_softmax(zs / TAU, dim=-1)
    kl = F.kl_div(logq, logp, log_target=True, reduction="batchmean")
    ce = F.cross_entropy(zs, tg)
    return KD * TAU * TAU * kl + CE * ce


def bench_torch(args, teacher_dir, student_dir, batches, compiled=False):
    dev = args.device
    bt.cleanup(dev)
    base = torch.cuda.memory_allocated() if dev == "cuda" else 0
    out = {"engine": "PyTorch" + (" torch.compile" if compiled else " eager")}
    with bt.DevicePeak(dev) as dp:
        teacher = bt.load_torch(teacher_dir, dev, dtype=torch.bfloat16).eval()
        student = bt.load_torch(student_dir, dev)
        student.train()
        opt, note = bt.make_adamw(student)
        out["note"] = note

        def student_loss(ids, zt, tg):
            with torch.autocast(device_type=dev, dtype=torch.bfloat16):
                zs = student(ids).logits
            return torch_loss(zs.float().reshape(-1, zs.shape[-1]), zt, tg)

        fn = torch.compile(student_loss, dynamic=False) if compiled else student_loss
        if dev == "cuda":
            torch.cuda.reset_peak_memory_stats()

        def step(batch):
            B = batch.shape[0]
            mb = args.torch_micro or B
            total = 0.0
            for i in range(0, B, mb):
                x = torch.from_numpy(batch[i:i + mb]).to(dev)
                ids, tg = x[:, :-1], x[:, 1:].reshape(-1)
                with torch.no_grad(), torch.autocast(device_type=dev, dtype=torch.bfloat16):
                    zt = teacher(ids).logits.float().reshape(-1, teacher.config.vocab_size)
                loss = fn(ids, zt, tg) * (ids.shape[0] / B)
                loss.backward()
                total += loss.item()
                del zt, loss
            torch.nn.utils.clip_grad_norm_(student.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            return total

        warm = 2 if compiled else 1
        t0 = time.perf_counter()
        for i in range(warm):
            step(batches[i % len(batches)])
        bt.sync(dev)
        out["warm_s"] = time.perf_counter() - t0
        ts = []
        for i in range(args.steps):
            bt.sync(dev)
            t0 = time.perf_counter()
            out["loss"] = step(batches[(warm + i) % len(batches)])
            bt.sync(dev)
            ts.append(time.perf_counter() - t0)
        out["step_s"] = ts
        if dev == "cuda":
            out["peak_alloc"] = torch.cuda.max_memory_allocated() - base
        del teacher, student, opt
    out["device_peak"] = dp.extra
    B, T = batches[0].shape
    out["tok_s"] = B * (T - 1) / bt.median(ts)
    bt.cleanup(dev)
    return out


def bench_kiln(args, teacher_dir, student_dir, batches, mode):
    kiln = bt.kiln_mod(args)
    dev = args.device
    B, T = batches[0].shape
    T -= 1  # the same B x (T - 1) positions as PyTorch: ids[:, :-1] -> ids[:, 1:]
    out = {"engine": f"kiln {mode}"}
    bt.cleanup(dev)
    with bt.DevicePeak(dev) as dp:
        mt, ms = kiln.Model(teacher_dir), kiln.Model(student_dir)
        kw = {"fast": True} if mode == "fast" else ({"format": mode} if mode in ("mx16", "mx8") else {})
        tr = kiln.Trainer(ms, max_seq=T, max_batch=args.micro, n_threads=0, lr=bt.LR, betas=(0.9, 0.999),
                          eps=1e-8, weight_decay=bt.WD, device=args.kiln_device, **kw)
        teacher = kiln.Teacher(mt, tr)
        try:
            def step(batch):
                total = 0.0
                for i in range(0, B, args.micro):
                    x = batch[i:i + args.micro]
                    r = tr.distill_step(teacher, x[:, :-1], x[:, 1:], temperature=TAU, kd_weight=KD,
                                        ce_weight=CE, scale=x.shape[0] / B, accumulate=i > 0)
                    total += r["loss"]
                tr.clip_grads(1.0)
                tr.optimizer_step(bt.LR)
                return total

            t0 = time.perf_counter()
            step(batches[0])
            bt.sync(dev)
            out["warm_s"] = time.perf_counter() - t0
            n = args.steps if mode == "fast" else 1
            ts = []
            for i in range(n):
                bt.sync(dev)
                t0 = time.perf_counter()
                out["loss"] = step(batches[(1 + i) % len(batches)])
                bt.sync(dev)
                ts.append(time.perf_counter() - t0)
            out["step_s"] = ts
            desc, mem = tr.describe()
            out["describe"], out["peak_alloc"] = desc, mem["peak_step"]
            if args.profile and dev == "cuda":  # one step's kernels (CUPTI records kiln's too)
                from torch.profiler import ProfilerActivity, profile
                bt.sync(dev)
                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    step(batches[1])
                    bt.sync(dev)
                out["profile"] = prof.key_averages().table(sort_by="cuda_time_total", row_limit=args.profile)
            if args.breakdown:  # the student's own step (cross-entropy, no teacher) on the same batches
                def ce_step(batch):
                    for i in range(0, B, args.micro):
                        x = batch[i:i + args.micro]
                        tr.step_batch(x[:, :-1], x[:, 1:], "mean", x.shape[0] / B, accumulate=i > 0)
                    tr.clip_grads(1.0)
                    tr.optimizer_step(bt.LR)
                ce_step(batches[0])
                ts = []
                for i in range(n):
                    bt.sync(dev)
                    t0 = time.perf_counter()
                    ce_step(batches[(1 + i) % len(batches)])
                    bt.sync(dev)
                    ts.append(time.perf_counter() - t0)
                out["ce_step_s"] = ts
        finally:
            teacher.close()
            tr.close()
            mt.close()
            ms.close()
    out["device_peak"] = dp.extra
    out["tok_s"] = B * T / bt.median(out["step_s"])
    bt.cleanup(dev)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--bin", required=True, help="folder with libkiln.so")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--teacher", default=None)
    ap.add_argument("--student", default=None)
    ap.add_argument("--batch", type=int, default=None)
    ap.add_argument("--seq", type=int, default=None, help="tokens per sequence (positions + 1)")
    ap.add_argument("--micro", type=int, default=4, help="kiln: sequences per distill_step")
    ap.add_argument("--torch-micro", type=int, default=0, help="PyTorch: sequences per forward (0: all)")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--modes", default="fast", help="kiln modes: fast,auditable,mx16,mx8")
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--no-torch", action="store_true", help="kiln's rows alone")
    ap.add_argument("--breakdown", action="store_true",
                    help="also time kiln's plain cross-entropy step of the student on the same batches")
    ap.add_argument("--profile", type=int, default=0,
                    help="kiln: the top N kernels of one step by GPU time (torch.profiler), printed last")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--work", default="/tmp/kiln-distill-bench")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    cpu = args.device == "cpu"
    args.teacher = ALIASES.get(args.teacher or ("tiny-teacher" if cpu else "1.5b"), args.teacher)
    args.student = ALIASES.get(args.student or ("tiny" if cpu else "0.5b"), args.student)
    args.batch = args.batch or (2 if cpu else 8)
    args.seq = args.seq or (33 if cpu else 1025)
    args.micro = min(args.micro, args.batch)
    args.kiln_device = -1 if cpu else 0
    if bt.SHAPES[args.teacher][6] != bt.SHAPES[args.student][6]:
        sys.exit("teacher and student need one vocabulary")
    os.makedirs(args.work, exist_ok=True)
    info = {"gpu": torch.cuda.get_device_name(0) if not cpu else "cpu", "torch": torch.__version__}
    log("[bench_distill]", info)
    folders = {}
    for name in (args.teacher, args.student):
        path = os.path.join(args.work, name)
        folders[name] = path if os.path.exists(os.path.join(path, "config.json")) else \
            bt.make_model(name, args.work, args.device)
    V = bt.SHAPES[args.student][6]
    batches = bt.make_batches(V, args.batch, args.seq, args.steps + 2, args.seed)
    rows = []
    for mode in [m for m in args.modes.split(",") if m]:
        try:
            rows.append(bench_kiln(args, folders[args.teacher], folders[args.student], batches, mode))
        except Exception as e:  # a refused mode: its row says why
            rows.append({"engine": f"kiln {mode}", "error": str(e)[:200]})
        log("[bench_distill]", rows[-1].get("engine"), rows[-1].get("tok_s"), rows[-1].get("error", ""))
    for compiled in [] if args.no_torch else ([False, True] if args.compile else [False]):
        try:
            rows.append(bench_torch(args, folders[args.teacher], folders[args.student], batches, compiled))
        except Exception as e:
            rows.append({"engine": "PyTorch" + (" torch.compile" if compiled else " eager"), "error": str(e)[:200]})
            bt.cleanup(args.device)
        log("[bench_distill]", rows[-1].get("engine"), rows[-1].get("tok_s"), rows[-1].get("error", ""))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"info": info, "args": vars(args), "rows": rows}, f, indent=1, default=str)
    B, T = args.batch, args.seq - 1
    print(f"\ndistillation step: teacher {args.teacher}, student {args.student}, {B} x {T} positions, "
          f"tau {TAU}, KL {KD} + CE {CE}; kiln {args.micro} sequences per call")
    print("| engine | tok/s | step s (median) | warm s | peak alloc | device peak | loss |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        if "error" in r:
            print(f"| {r['engine']} | failed: {r['error']} | | | | | |")
            continue
        print(f"| {r['engine']} | {r['tok_s']:,.0f} | {bt.median(r['step_s']):.3f} | {r['warm_s']:.2f} | "
              f"{bt.gib(r.get('peak_alloc'))} GiB | {bt.gib(r.get('device_peak'))} GiB | {r['loss']:.4f} |")
    for r in rows:
        if r.get("profile"):
            print(f"\n{r['engine']}: one step's kernels by GPU time\n{r['profile']}")
    for r in rows:
        if r.get("ce_step_s"):
            print(f"{r['engine']}: the student's cross-entropy step alone {bt.median(r['ce_step_s']):.3f} s "
                  f"(the teacher's forward and the distillation loss's extra: "
                  f"{bt.median(r['step_s']) - bt.median(r['ce_step_s']):.3f} s)")


if __name__ == "__main__":
    main()
