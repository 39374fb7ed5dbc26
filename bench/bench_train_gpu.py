#!/usr/bin/env python3
"""bench_train_gpu.py -- the GPU training benchmark of issue 5: one run on one GPU (1 x H200),
kiln (auditable and fast) against PyTorch (eager and torch.compile) on the same models and
data, the fused loss, the optimizer-storage memory, in one table per part printed last and a
JSON.

HOW TO RUN (on the GPU machine: python3 with torch and transformers; kiln built with
-DKILN_CUDA=ON into a build folder, e.g. by scripts/gpu-check.sh into build-gpu):

  scripts/gpu-train-bench.sh build-gpu            # everything, about 7-8 minutes on an H200
  python3 bench/bench_train_gpu.py --bin DIR [--parts train,ce,memory] [--models 135m,0.5b]
      [--seqs 2048,1024] [--batches 16,8] [--steps 3] [--budget 450] [--no-compile]
      [--json OUT.json] [--device cuda|cpu] [--quick] [--micro 8,4]
      [--kiln-variants 'vocabulary walk:ce_row_block=0;q8 moments:moments=q8;
                        attn 3 blocks:env.KILN_ATTN_BWD_BLOCKS=3']

  DIR holds libkiln.so (the Python binding python/kiln loads it through $KILN_LIB, set here)
  and, for the fused-loss part, the program bench_cuda_fused_ce (tests/gpu/, built with the
  GPU tests; gpu-train-bench.sh builds it when DIR is a CMake build folder).
  --budget S (default 450): seconds for the whole run. Pieces that would not fit are
  measured with fewer steps or skipped, and say so in their notes. Order: the training part
  (PyTorch eager, kiln fast, kiln auditable per configuration), then torch.compile (a child
  process per model, killed when its share of the budget less --reserve-after (120) seconds
  is spent: "failed: timed out ..."), then the fused loss, then the memory part.
  --device cpu --quick: the CPU smoke mode (two tiny models, sequences 64 and 32, batch 2,
  kiln on the CPU, torch on the CPU, no torch.compile): every part's logic runs end to end on
  a machine without a GPU; its figures mean nothing.

MODELS (random weights, written here with transformers as a bf16 Hugging Face folder that both
engines load; torch upcasts it to f32 master weights, kiln's trainer to its f32 storage, so
both start from identical values; norms and biases perturbed away from 1 and 0):
  SmolLM2-135M shape: LlamaConfig C 576, L 30, 9 heads, 3 kv heads, FF 1536, V 49152, tied,
      rope theta 1e5 -- at batch 16;
  Qwen2.5-0.5B shape: Qwen2Config C 896, L 24, 14 heads, 2 kv heads, FF 4864, V 151936,
      tied, q/k/v biases, rope theta 1e6 -- at batch 8;
  each at sequence lengths 2048 and 1024. A synthetic byte-level tokenizer of exactly V ids
  (bench_gpu.write_tokenizer). Data: random token ids in [0, V - 3) from numpy's generator
  seeded by (--seed, T), the same batches for every engine.

ONE TRAINING STEP = forward + loss (mean next-token cross-entropy over the B x (T - 1)
targets) + backward of B sequences of T tokens + clip_grad_norm_(1.0) + AdamW (lr 1e-4,
betas 0.9/0.999, eps 1e-8, weight decay 0.1). tokens/s = B x T / (median step time).
  - PyTorch eager: transformers' model, f32 parameters, torch.autocast(bfloat16) around the
    forward and loss (transformers computes the loss on logits.float()), sdpa attention,
    torch.optim.AdamW(fused=True); the whole batch in one forward.
  - PyTorch torch.compile: the same with torch.compile(model, dynamic=False) (the model's
    forward and loss; AdamW is already one fused kernel), in a child process (python3
    this-file --worker ...): the 2 warm steps' time (compilation) is in the notes, not in
    tokens/s.
  - kiln fast: kiln.Trainer(model, max_seq=T, device=0, fast=True) (bf16 tensor-core
    products, f32 weights and optimizer); kiln trains one sequence per forward, so a step is
    B x (forward(ids, targets, mean, scale 1/B) + backward(accumulate)) -- the same loss and
    gradients as the batch mean -- then clip_grads(1.0) and optimizer_step. One warm step,
    then --steps timed steps (fewer when a step is slow: notes).
  - kiln auditable: the same without fast (exact f32 arithmetic, the CPU's bits: slow). Its
    step is EXTRAPOLATED: one warm sequence, then up to --aud-seqs timed sequences (forward +
    backward of one sequence, the unit a full step repeats B times), then one timed
    clip + AdamW; step = B x median(sequence) + clip/AdamW (notes say so).
  When the binding's Trainer has no `fast` argument, the fast rows read "n/a".

COLUMNS of the training table:
  tok/s      B x T / step seconds.
  MFU        tok/s x F / R. F = FLOPs per token = 6 N + 6 L C T: N = every matrix
             parameter (q, k, v, o, gate, up, down of every layer, and the lm_head = the tied
             embedding, counted once; norms and biases left out), 6 N = 2 (forward) + 4
             (backward) FLOPs per multiply-add; 6 L C T = attention's QK^T and PV
             (2 x 2 x C x T per token and layer forward, x 3 with backward, halved by the
             causal mask), L layers, C width (= heads x head size here), T sequence length.
             R = the bf16 matrix rate measured in this run (torch bf16 8192^3 matmul).
  peak alloc allocator accounting: PyTorch torch.cuda.max_memory_allocated() over the run
             (above what was allocated before); kiln describe()'s peak_step (its own
             accounting: parameters, gradients, optimizer state, saved activations, scratch,
             the fused loss's scratch of the step, and since session 11 the backend's own
             workspaces and the peak of its short-lived allocations). kiln's cudaMalloc is invisible to
             torch's counters, so these come from each engine's own books.
  device     the device's view, the same method for both: a thread polls
             torch.cuda.mem_get_info every 2 ms; (largest used memory seen) - (used memory
             before the engine's model/trainer was created). Includes allocator caches,
             cuBLAS/cuBLASLt workspaces and (first kiln trainer only) kiln's module load;
             polling can miss a spike shorter than 2 ms.
  notes      step time, how it was measured, compile time, ratios: a fast row's "auditable
             cost" = fast tok/s / auditable tok/s, "x compile" = kiln fast tok/s / the
             compiled PyTorch's, "mem x compile" = kiln device peak / the compiled
             PyTorch's device peak.

THE FUSED LOSS (--parts ce) at V 151936, H 896, N 8192 rows (quick/cpu: V 1024, H 64, N 256):
  - kiln: the program bench_cuda_fused_ce (kiln_fused_ce on a CUDA backend,
    kiln_backend_cuda_create_mode(0, fast), on device buffers; the binding's
    kiln.LinearCrossEntropy wraps the same call), auditable and fast, f32 and bf16 weight,
    "fwd" (the loss
    alone: pass 1) and "fwd+bwd" (loss, dh, dW); median of 3 calls. In fast mode also
    "kiln fast, row walk": the row-block walk (params.row_block 2048, bf16 weight, the
    one-call form with the caller's scratch: what the training step calls), each call waited
    for; its memory is kiln's accounting only (the scratch is allocated before the calls).
  - PyTorch: F.cross_entropy((h @ W.T).float(), t) on materialised logits, h and W in bf16 or
    f32 (f32: true f32 matmuls, TF32 off, torch's default), eager and torch.compile'd;
    "fwd" under no_grad, "fwd+bwd" = loss.backward() into h.grad, W.grad; CUDA events, median.
  COLUMNS: ms; TFLOP/s of the model FLOPs (fwd 2NVH, fwd+bwd 6NVH; kiln's backward
  recomputes the logits, 8NVH done, not counted; the row walk makes them once, 6NVH);
  "peak above inputs" = the memory beyond h, W and the targets, outputs (dh, dW) included:
  PyTorch max_memory_allocated - allocated before; kiln scratch_bytes (its accounting) + the
  f32 dh and dW it writes; notes: kiln's device view (free memory polled every 100 us inside
  the program) and the logits' size.

MEMORY OF A FULL STEP (--parts memory), the Qwen2.5-0.5B shape at T 2048, batch 8 (quick/cpu:
the tiny qwen2, T 64, batch 2):
  - kiln: one trainer per storage variant (weights f32 / bf16 + f32 master / bf16 + Kahan /
    bf16 + stochastic rounding; moments f32 / 8-bit), fast mode when available (else
    auditable): create, one sequence forward + backward, clip, AdamW; describe()'s figures
    (params, grads, optimizer, activations, scratch, peak) and the device view. kiln's
    memory does not depend on B (one sequence at a time), so this is the full step's.
  - PyTorch: f32 params + bf16 autocast + fused AdamW (batch 8 in one forward), pure bf16
    params + fused AdamW (batch 8), and f32 params + autocast with micro-batch 1 x 8
    gradient accumulation (kiln's schedule); two steps each (the first allocates AdamW's
    state); params / grads / optimizer-state bytes from the tensors, peak alloc =
    max_memory_allocated, and the device view.

SUMMARY: auditable cost (fast tok/s / auditable tok/s) per configuration, and the issue's goals
(MFU >= 55%, >= 1.2 x torch.compile's tok/s, <= 0.5 x its peak memory) checked per
configuration against what was measured.
"""
import argparse
import inspect
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import threading
import time

import numpy as np
import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

# name: (family, C, L, NH, KVH, FF, V, rope theta, rms eps)
SHAPES = {
    "SmolLM2-135M": ("llama", 576, 30, 9, 3, 1536, 49152, 1e5, 1e-5),
    "Qwen2.5-0.5B": ("qwen2", 896, 24, 14, 2, 4864, 151936, 1e6, 1e-6),
    "tiny-llama": ("llama", 64, 2, 4, 2, 128, 512, 1e4, 1e-5),
    "tiny-qwen2": ("qwen2", 64, 2, 4, 2, 160, 768, 1e6, 1e-6),
}
ALIASES = {"135m": "SmolLM2-135M", "0.5b": "Qwen2.5-0.5B"}
PARTS = ("train", "ce", "memory")
VARIANTS = [("f32", "f32"), ("bf16_master", "f32"), ("bf16_kahan", "f32"), ("bf16_sr", "f32"),
            ("f32", "q8"), ("bf16_master", "q8"), ("bf16_kahan", "q8"), ("bf16_sr", "q8")]
LR, WD = 1e-4, 0.1
GiB = float(1 << 30)


def log(*a):
    print(*a, flush=True)


def sync(dev):
    if dev == "cuda":
        torch.cuda.synchronize()


def cleanup(dev):
    import gc
    gc.collect()
    if dev == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def median(xs):
    return statistics.median(xs) if xs else None


# ---- shapes, FLOPs, data ---------------------------------------------------------------------

def matrix_params(name):
    """N of the MFU formula: every matrix parameter (attention q, k, v, o; MLP gate, up, down;
    the lm_head = tied embedding counted once)."""
    _, C, L, NH, KVH, FF, V, _, _ = SHAPES[name]
    HS = C // NH
    return L * (C * NH * HS + 2 * C * KVH * HS + NH * HS * C + 3 * C * FF) + V * C


def flops_per_token(name, T):
    _, C, L, _, _, _, _, _, _ = SHAPES[name]
    return 6 * matrix_params(name) + 6 * L * C * T


def make_batches(V, B, T, n, seed):
    """n batches (B, T) of random ids in [0, V - 3) (below the special tokens), int64."""
    rng = np.random.default_rng(seed * 1000003 + T)
    return [rng.integers(0, V - 3, size=(B, T), dtype=np.int64) for _ in range(n)]


def hf_config(name):
    import transformers as tf
    fam, C, L, NH, KVH, FF, V, theta, eps = SHAPES[name]
    common = dict(hidden_size=C, num_hidden_layers=L, num_attention_heads=NH,
                  num_key_value_heads=KVH, intermediate_size=FF, vocab_size=V,
                  tie_word_embeddings=True, eos_token_id=V - 3, rms_norm_eps=eps,
                  rope_theta=theta, max_position_embeddings=8192)
    if fam == "llama":
        return tf.LlamaConfig(bos_token_id=None, **common)
    return tf.Qwen2Config(bos_token_id=None, **common)


def make_model(name, root, dev):
    """Write the random model folder (bf16 safetensors + tokenizer); returns its path."""
    import transformers as tf
    from bench_gpu import write_tokenizer
    V = SHAPES[name][6]
    out = os.path.join(root, name)
    torch.manual_seed(0)
    with torch.device(dev):
        m = tf.AutoModelForCausalLM.from_config(hf_config(name), dtype=torch.bfloat16)
    with torch.no_grad():
        for n, p in m.named_parameters():
            if "norm" in n or n.endswith(".bias"):
                p.add_(torch.randn_like(p) * 0.1)
    m.save_pretrained(out)
    del m
    cleanup(dev)
    special = {V - 3: "<|endoftext|>", V - 2: "<|im_start|>", V - 1: "<|im_end|>"}
    write_tokenizer(out, V, special, V - 3)
    return out


def load_torch(path, dev, dtype=torch.float32):
    import transformers as tf
    m = tf.AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    return m.to(dev)


# ---- device memory ---------------------------------------------------------------------------

class DevicePeak:
    """The device's view of memory: a thread polls torch.cuda.mem_get_info every `interval`
    seconds; .extra = the largest used memory seen - the used memory at entry (None off
    CUDA)."""

    def __init__(self, dev, interval=0.002):
        self.dev, self.interval = dev, interval
        self.extra = None
        self._stop = threading.Event()

    def _used(self):
        free, total = torch.cuda.mem_get_info()
        return total - free

    def _poll(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, self._used())
            time.sleep(self.interval)

    def __enter__(self):
        if self.dev == "cuda":
            torch.cuda.synchronize()
            self.base = self.peak = self._used()
            self._th = threading.Thread(target=self._poll, daemon=True)
            self._th.start()
        return self

    def __exit__(self, *exc):
        if self.dev == "cuda":
            torch.cuda.synchronize()
            self._stop.set()
            self._th.join()
            self.peak = max(self.peak, self._used())
            self.extra = self.peak - self.base
        return False


def gib(x):
    return "-" if x is None else f"{x / GiB:.2f}"


def mib(x):
    return "-" if x is None else f"{x / 2**20:.0f} MiB"


# ---- PyTorch training --------------------------------------------------------------------------

def make_adamw(model):
    """torch.optim.AdamW(fused=True); (optimizer, note) -- foreach when fused is refused."""
    kw = dict(lr=LR, betas=(0.9, 0.999), eps=1e-8, weight_decay=WD)
    try:
        return torch.optim.AdamW(model.parameters(), fused=True, **kw), ""
    except (RuntimeError, TypeError, ValueError) as e:
        return torch.optim.AdamW(model.parameters(), foreach=True, **kw), f"fused AdamW refused ({e}); foreach"


def torch_step(fn, model, opt, x, dev, autocast=True, micro=None):
    B = x.shape[0]
    mb = micro or B
    for i in range(0, B, mb):
        xi = x[i:i + mb]
        with torch.autocast(device_type=dev, dtype=torch.bfloat16, enabled=autocast):
            loss = fn(input_ids=xi, labels=xi).loss
        (loss * (xi.shape[0] / B)).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss


def state_bytes(model, opt):
    pb = sum(p.numel() * p.element_size() for p in model.parameters())
    ob = sum(v.numel() * v.element_size() for st in opt.state.values() for v in st.values()
             if torch.is_tensor(v))
    return pb, ob


def bench_torch(path, dev, batches, warm, steps, compiled=False, dtype=torch.float32,
                micro=None, time_left=None):
    """PyTorch training steps on the model folder: warm steps (compilation), then up to
    `steps` timed ones (fewer when time_left() says the budget is short). Returns a dict."""
    cleanup(dev)
    base_alloc = torch.cuda.memory_allocated() if dev == "cuda" else 0
    if dev == "cuda":
        torch.cuda.reset_peak_memory_stats()
    B, T = batches[0].shape
    out = dict(B=B, T=T, compiled=compiled, dtype=str(dtype), micro=micro)
    with DevicePeak(dev) as dp:
        model = load_torch(path, dev, dtype)
        model.train()
        opt, note = make_adamw(model)
        fn = torch.compile(model, dynamic=False) if compiled else model
        xs = [torch.from_numpy(b).to(dev) for b in batches]
        autocast = dtype == torch.float32
        t0 = time.perf_counter()
        for i in range(warm):
            torch_step(fn, model, opt, xs[i % len(xs)], dev, autocast, micro)
        sync(dev)
        out["warm_s"] = time.perf_counter() - t0
        ts = []
        for i in range(steps):
            if ts and time_left is not None and time_left() < 2 * ts[-1]:
                break
            sync(dev)
            t0 = time.perf_counter()
            loss = torch_step(fn, model, opt, xs[(warm + i) % len(xs)], dev, autocast, micro)
            sync(dev)
            ts.append(time.perf_counter() - t0)
        out["loss"] = loss.detach().item()
        out["params_bytes"], out["optimizer_bytes"] = state_bytes(model, opt)
        out["grads_bytes"] = out["params_bytes"]  # one gradient per parameter, same dtype
        del fn, opt, model, xs
    out["step_s"] = ts
    out["tok_s"] = B * T / median(ts) if ts else None
    out["peak_alloc"] = torch.cuda.max_memory_allocated() - base_alloc if dev == "cuda" else None
    out["device_peak"] = dp.extra
    out["note"] = note
    cleanup(dev)
    return out


# ---- kiln training -----------------------------------------------------------------------------

_kiln = None


def kiln_mod(args):
    global _kiln
    if _kiln is None:
        from bench_gpu import kiln_binding
        _kiln = kiln_binding(args.bin)
    return _kiln


def trainer_has_fast(kiln):
    return "fast" in inspect.signature(kiln.Trainer.__init__).parameters


def kiln_sequence(tr, row, B, accumulate):
    """Forward + backward of one sequence: mean loss over its T - 1 targets, scaled by 1/B,
    gradients accumulated (a batch mean over equal-length sequences)."""
    ids = row.tolist()
    loss = tr.forward(ids, ids[1:] + [-1], "mean", 1.0 / B)
    tr.backward(accumulate=accumulate)
    return loss


def kiln_step(tr, batch, micro=1):
    """One optimizer step over the batch: sequence by sequence (micro 1), or micro sequences
    per forward (forward_batch: the micro-batch's mean loss scaled by micro / B -- the same
    batch mean), gradients accumulated, then clip + AdamW."""
    B = batch.shape[0]
    loss = 0.0
    if micro > 1:
        for i in range(0, B, micro):
            ids = batch[i:i + micro]
            tg = np.concatenate([ids[:, 1:], -np.ones((ids.shape[0], 1), dtype=ids.dtype)], axis=1)
            if hasattr(tr, "step_batch"):  # one call: no wait between forward and backward
                loss += tr.step_batch(ids, tg, "mean", ids.shape[0] / B, accumulate=i > 0)
            else:
                loss += tr.forward_batch(ids, tg, "mean", ids.shape[0] / B)
                tr.backward(accumulate=i > 0)
    else:
        for b in range(B):
            loss += kiln_sequence(tr, batch[b], B, b > 0)
    tr.clip_grads(1.0)
    tr.optimizer_step(LR)
    return loss


def bench_kiln(args, model, batches, fast, steps, storage="f32", moments="f32", one_seq=False,
               micro=1, trainer_kw=None):
    """kiln training: fast mode runs real steps (1 warm + up to `steps` timed); auditable mode
    (or one_seq) extrapolates a step from single sequences (see the docstring). trainer_kw:
    more kiln.Trainer arguments (--kiln-variants). Returns a dict; raises KilnError when the
    trainer cannot be made."""
    kiln = kiln_mod(args)
    dev = args.device
    B, T = batches[0].shape
    extra = {"fast": True} if fast else {}
    if micro > 1:
        extra["max_batch"] = micro
    extra.update(trainer_kw or {})
    out = dict(B=B, T=T, fast=fast, storage=storage, moments=moments, micro=micro)
    cleanup(dev)
    with DevicePeak(dev) as dp:
        t0 = time.perf_counter()
        tr = kiln.Trainer(model, max_seq=T, n_threads=0, lr=LR, betas=(0.9, 0.999), eps=1e-8,
                          weight_decay=WD, storage=storage, moments=moments,
                          device=args.kiln_device, **extra)
        out["create_s"] = time.perf_counter() - t0
        try:
            if (fast or micro > 1) and not one_seq:
                t0 = time.perf_counter()
                kiln_step(tr, batches[0], micro)
                sync(dev)
                tw = time.perf_counter() - t0
                out["warm_s"] = tw
                n = max(1, min(steps, int(args.per_config / max(tw, 1e-6))))
                ts = []
                for i in range(n):
                    sync(dev)
                    t0 = time.perf_counter()
                    out["loss"] = kiln_step(tr, batches[(1 + i) % len(batches)], micro)
                    sync(dev)
                    ts.append(time.perf_counter() - t0)
                out["step_s"] = ts
                out["how"] = f"{len(ts)} timed step(s) after 1 warm"
                if len(ts) < steps:
                    out["how"] += f" (fewer than --steps {steps}: budget)"
            else:
                t0 = time.perf_counter()
                out["loss"] = B * kiln_sequence(tr, batches[0][0], B, False)  # its own mean
                sync(dev)
                tw = time.perf_counter() - t0
                seqs = []
                k = 0 if tw > args.per_config or one_seq else args.aud_seqs
                for i in range(k):
                    if seqs and sum(seqs) + tw > args.per_config:
                        break
                    sync(dev)
                    t0 = time.perf_counter()
                    kiln_sequence(tr, batches[0][(1 + i) % B], B, True)
                    sync(dev)
                    seqs.append(time.perf_counter() - t0)
                sync(dev)
                t0 = time.perf_counter()
                tr.clip_grads(1.0)
                tr.optimizer_step(LR)
                sync(dev)
                t_opt = time.perf_counter() - t0
                t_seq = median(seqs) if seqs else tw
                out["seq_s"], out["warm_seq_s"], out["opt_s"] = seqs, tw, t_opt
                out["step_s"] = [B * t_seq + t_opt]
                out["how"] = (f"extrapolated: {B} x {'median of ' + str(len(seqs)) if seqs else 'one cold'}"
                              f" sequence(s) ({t_seq:.3f} s) + clip/AdamW ({t_opt:.3f} s)")
            desc, mem = tr.describe()
            out["describe"], out["mem"] = desc, mem
            # "(fast)" or "(fast, step graphs...)"; a libkiln.so older than the binding ignores p.fast
            if fast and "(fast" not in desc:
                out["how"] = "WARNING: describe() does not say (fast): stale libkiln.so? " + out["how"]
        finally:
            tr.close()
    sync(dev)
    out["tok_s"] = B * T / median(out["step_s"])
    out["peak_alloc"] = out["mem"]["peak_step"]
    out["device_peak"] = dp.extra
    cleanup(dev)
    return out


# ---- torch.compile in a child process ----------------------------------------------------------

def worker_main(args):
    """--worker: the compiled PyTorch runs of one model, one JSON line per sequence length."""
    dev = args.device
    V = SHAPES[args.worker_model][6]
    for T in args.seqs:
        B = args.worker_batch
        batches = make_batches(V, B, T, args.steps + 2, args.seed)
        try:
            r = bench_torch(args.worker_folder, dev, batches, 2, args.steps, compiled=True)
            r["ok"] = True
        except Exception as e:  # report, go on with the next length
            r = dict(ok=False, error=f"{type(e).__name__}: {e}"[:300], T=T, B=B)
        r["T"] = T
        print("WORKER_RESULT " + json.dumps(r), flush=True)


def run_compile_worker(args, name, folder, B, timeout):
    """Run --worker in a child process (its own session, killed as a group at the timeout);
    returns {T: result dict}, with an error entry for each length not reached."""
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--worker-folder", folder,
           "--worker-model", name, "--worker-batch", str(B), "--seqs",
           ",".join(str(t) for t in args.seqs), "--steps", str(args.steps), "--seed",
           str(args.seed), "--device", args.device, "--bin", args.bin]
    log(f"torch.compile worker for {name} (timeout {timeout:.0f} s): {' '.join(cmd[1:])}")
    t0 = time.time()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         start_new_session=True)
    res, tail = {}, []

    def reader():
        for line in p.stdout:
            if line.startswith("WORKER_RESULT "):
                r = json.loads(line[len("WORKER_RESULT "):])
                res[r["T"]] = r
                log(f"  compile {name} T={r['T']}: " +
                    (f"{r['tok_s']:.0f} tok/s, warm (compile) {r['warm_s']:.0f} s" if r.get("ok")
                     and r.get("tok_s") else r.get("error", "no figure")))
            else:
                tail.append(line.rstrip())
                del tail[:-40]
    th = threading.Thread(target=reader, daemon=True)
    th.start()
    timed_out = False
    try:
        p.wait(timeout=max(timeout, 1))
    except subprocess.TimeoutExpired:
        timed_out = True
        os.killpg(p.pid, signal.SIGKILL)  # the child's own session: it and its compile workers
        p.wait()
    th.join(timeout=10)
    el = time.time() - t0
    for T in args.seqs:
        if T not in res:
            why = f"timed out after {el:.0f} s (--budget)" if timed_out else \
                f"worker rc={p.returncode}: {' | '.join(tail[-3:])[:200]}"
            res[T] = dict(ok=False, error=why, T=T, B=B)
    if p.returncode not in (0, None) and not timed_out:
        log("\n".join(tail[-20:]))
    return res


# ---- the parts -------------------------------------------------------------------------------

def parse_variants(ap, spec):
    """--kiln-variants 'LABEL:k=v,k=v;...' -> [(label, {k: v})]; ints where they parse. A key
    env.KILN_X sets that environment variable (kiln's kernel choices, read on each call)
    while the variant runs; a comma splits settings only where a key follows, so an env value
    may hold commas (env.KILN_X=1,16)."""
    out = []
    for item in filter(None, (x.strip() for x in spec.split(";"))):
        label, _, kvs = item.partition(":")
        kw = {}
        for kv in filter(None, (x.strip() for x in re.split(r",(?=\s*[A-Za-z_.]+=)", kvs))):
            k, eq, v = kv.partition("=")
            env_ok = k.startswith("env.KILN_") and len(k) > len("env.KILN_")
            if not eq or not (env_ok or k in ("ce_row_block", "ce_logits_f32", "moments",
                                              "storage")):
                ap.error(f"--kiln-variants: '{kv}': expected ce_row_block=N, ce_logits_f32=0|1, "
                         "moments=M, storage=S or env.KILN_NAME=value")
            kw[k] = int(v) if k in ("ce_row_block", "ce_logits_f32") else v
        if not label.strip() or not kw:
            ap.error(f"--kiln-variants: '{item}': expected LABEL:key=value[,key=value]")
        out.append((label.strip(), kw))
    return out


def part_train(args, R, rows, res, folders):
    """PyTorch eager, kiln fast and kiln auditable for each model and length; fills folders
    {name: model folder} for the later parts."""
    dev = args.device
    kiln = kiln_mod(args)
    has_fast = trainer_has_fast(kiln)
    for name, B, micro in zip(args.models, args.batches, args.micro):
        log(f"== {name}: writing the model folder")
        t0 = time.time()
        folders[name] = folder = make_model(name, args.work, dev)
        log(f"   {time.time() - t0:.1f} s; N (matrix params) = {matrix_params(name) / 1e6:.1f} M")
        V = SHAPES[name][6]
        km = kiln.Model(folder)
        try:
            for T in args.seqs:
                batches = make_batches(V, B, T, args.steps + 2, args.seed)
                F_tok = flops_per_token(name, T)
                key = f"{name} T={T} B={B}"
                r = res.setdefault(key, dict(model=name, T=T, B=B, flops_per_token=F_tok))

                def add(engine, x, note=""):
                    tok = x.get("tok_s") if x else None
                    rows.append(dict(model=name, T=T, B=B, engine=engine, tok_s=tok,
                                     mfu=tok * F_tok / R if tok else None,
                                     peak_alloc=x.get("peak_alloc") if x else None,
                                     device_peak=x.get("device_peak") if x else None,
                                     notes=note))
                def steps_row(eng, fast, **kw):
                    """A kiln row of real steps (bench_kiln with kw), added to the table and
                    returned; on a failure a 'failed' row and None."""
                    try:
                        x = bench_kiln(args, km, batches, fast, args.steps, **kw)
                    except Exception as e:
                        log(f"{key} {eng} failed: {e!r}")
                        add(eng, None, f"failed: {e}"[:200])
                        return None
                    add(eng, x, f"step {median(x['step_s']):.3f} s: {x['how']}; "
                        f"loss {x['loss']:.3f}")
                    log(f"{key} {eng}: {x['tok_s']:.1f} tok/s; {x['describe']}")
                    return x

                # PyTorch eager
                if args.time_left() > 20:
                    try:
                        x = bench_torch(folder, dev, batches, 2, args.steps,
                                        time_left=args.time_left)
                        r["torch_eager"] = x
                        add("PyTorch eager", x, f"step {median(x['step_s']):.3f} s ({len(x['step_s'])} timed "
                            f"after 2 warm); loss {x['loss']:.3f} {x['note']}".strip())
                        log(f"{key} torch eager: {x['tok_s']:.0f} tok/s")
                    except Exception as e:
                        log(f"{key} torch eager failed: {e!r}")
                        add("PyTorch eager", None, f"failed: {e!r}"[:200])
                else:
                    add("PyTorch eager", None, "skipped (--budget)")
                # kiln fast, then auditable
                for fast in (True, False):
                    eng = "kiln fast" if fast else "kiln auditable"
                    if fast and not has_fast:
                        add(eng, None, "n/a (the binding's Trainer has no fast argument)")
                        continue
                    if args.time_left() < 15:
                        add(eng, None, "skipped (--budget)")
                        continue
                    try:
                        x = bench_kiln(args, km, batches, fast, args.steps)
                    except Exception as e:
                        log(f"{key} {eng} failed: {e!r}")
                        add(eng, None, f"n/a: {e}"[:200] if fast else f"failed: {e}"[:200])
                        continue
                    r["kiln_fast" if fast else "kiln_auditable"] = x
                    add(eng, x, f"step {median(x['step_s']):.3f} s: {x['how']}; loss {x['loss']:.3f}")
                    log(f"{key} {eng}: {x['tok_s']:.1f} tok/s ({x['how']}); {x['describe']}")
                    # --micro M: fast mode again (auditable on the CPU, which has no fast mode)
                    # with M sequences per forward (forward_batch), real steps
                    if (fast or dev == "cpu") and micro > 1 and B % micro == 0 \
                            and args.time_left() > 15:
                        eng_m = f"kiln {'fast' if fast else 'auditable'}, {micro} seqs/forward"
                        x = steps_row(eng_m, fast, micro=micro)
                        if x:
                            r[f"kiln_fast_micro{micro}"] = x
                    # --kiln-variants: the same fast step with other trainer settings
                    for label, kw in (args.kiln_variants if fast else []):
                        m = micro if micro > 1 and B % micro == 0 else 1
                        eng_v = f"kiln fast{f', {m} seqs/forward' if m > 1 else ''}, {label}"
                        if args.time_left() < 15:
                            add(eng_v, None, "skipped (--budget)")
                            continue
                        env = {k[4:]: v for k, v in kw.items() if k.startswith("env.")}
                        saved = {k: os.environ.get(k) for k in env}
                        os.environ.update(env)
                        try:
                            steps_row(eng_v, True, micro=m, storage=kw.get("storage", "f32"),
                                      moments=kw.get("moments", "f32"),
                                      trainer_kw={k: v for k, v in kw.items()
                                                  if k not in ("storage", "moments")
                                                  and not k.startswith("env.")})
                        finally:
                            for k, v in saved.items():
                                if v is None:
                                    os.environ.pop(k, None)
                                else:
                                    os.environ[k] = v
        finally:
            km.close()


def part_compile(args, R, rows, res, folders):
    """torch.compile'd PyTorch for each model, each in a child process, with the remaining
    budget (less --reserve-after for the parts still to come) split between the models."""
    todo = [(n, B) for n, B in zip(args.models, args.batches) if n in folders]
    after = args.reserve_after if ("ce" in args.parts or "memory" in args.parts) else 0
    for i, (name, B) in enumerate(todo):
        left = args.time_left() - 5 - after
        share = left / (len(todo) - i)
        if not args.compile:
            for T in args.seqs:
                rows.append(dict(model=name, T=T, B=B, engine="PyTorch torch.compile", tok_s=None,
                                 mfu=None, peak_alloc=None, device_peak=None,
                                 notes="skipped (--no-compile; the default in --quick / cpu)"))
            continue
        if share < 30:
            for T in args.seqs:
                rows.append(dict(model=name, T=T, B=B, engine="PyTorch torch.compile", tok_s=None,
                                 mfu=None, peak_alloc=None, device_peak=None,
                                 notes=f"skipped (--budget: {max(share, 0):.0f} s left)"))
            continue
        cleanup(args.device)
        out = run_compile_worker(args, name, folders[name], B, share)
        for T in args.seqs:
            x = out[T]
            key = f"{name} T={T} B={B}"
            res.setdefault(key, {})["torch_compile"] = x
            ok = x.get("ok") and x.get("tok_s")
            F_tok = flops_per_token(name, T)
            note = (f"step {median(x['step_s']):.3f} s ({len(x['step_s'])} timed after 2 warm); "
                    f"warm/compile {x['warm_s']:.0f} s; loss {x['loss']:.3f}" if ok
                    else f"failed: {x.get('error', '?')}"[:200])
            rows.append(dict(model=name, T=T, B=B, engine="PyTorch torch.compile",
                             tok_s=x.get("tok_s") if ok else None,
                             mfu=x["tok_s"] * F_tok / R if ok else None,
                             peak_alloc=x.get("peak_alloc") if ok else None,
                             device_peak=x.get("device_peak") if ok else None, notes=note))


def parse_ce_lines(text):
    """RESULT key=value lines of bench_cuda_fused_ce -> list of dicts (numbers converted)."""
    out = []
    for line in text.splitlines():
        if not line.startswith("RESULT "):
            continue
        d = {}
        for kv in line.split()[1:]:
            k, _, v = kv.partition("=")
            for conv in (int, float, str):  # "nan" / "inf" become floats, words stay strings
                try:
                    d[k] = conv(v)
                    break
                except ValueError:
                    pass
        out.append(d)
    return out


def torch_ce(dev, N, H, V, dtype, compiled, backward, reps):
    """PyTorch's materialised cross-entropy: (ms, peak bytes above the inputs, warm s)."""
    from bench_gpu import dev_time
    g = torch.Generator(device=dev).manual_seed(3)
    h = ((torch.rand(N, H, generator=g, device=dev) * 2 - 1)).to(dtype).requires_grad_(backward)
    W = ((torch.rand(V, H, generator=g, device=dev) * 2 - 1) / 32).to(dtype).requires_grad_(backward)
    t = torch.randint(0, V, (N,), generator=g, device=dev)

    def f(h, W, t):
        return F.cross_entropy((h @ W.T).float(), t)
    fn = torch.compile(f) if compiled else f

    def run():
        h.grad = W.grad = None
        if backward:
            fn(h, W, t).backward()
        else:
            with torch.no_grad():
                fn(h, W, t)
    t0 = time.perf_counter()
    run()
    sync(dev)
    warm = time.perf_counter() - t0
    peak = None
    if dev == "cuda":
        h.grad = W.grad = None
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        run()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
    ms = 1e3 * dev_time(dev, run, reps, warm=1)
    del h, W, t
    cleanup(dev)
    return ms, peak, warm


def part_ce(args, ce_rows, res):
    dev = args.device
    N, H, V = args.ce_shape
    fw, fb = 2 * N * V * H, 6 * N * V * H
    logits = N * V * 4
    out = res.setdefault("fused_ce", dict(N=N, H=H, V=V))
    # kiln, through bench_cuda_fused_ce
    exe = os.path.join(args.bin, "bench_cuda_fused_ce")
    if not os.path.exists(exe):
        ce_rows.append(dict(engine="kiln", weights="-", pass_="-", ms=None, tflops=None, peak=None,
                            notes=f"n/a: {exe} not built (cmake --build DIR --target bench_cuda_fused_ce)"))
    else:
        cmd = [exe, "--N", str(N), "--H", str(H), "--V", str(V), "--reps", str(args.ce_reps)]
        log("kiln fused CE: " + " ".join(cmd))
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=max(args.time_left(), 45))
            text = p.stdout + p.stderr
            log(text.strip()[-3000:])
            found = parse_ce_lines(p.stdout)
            out["kiln"] = dict(rc=p.returncode, results=found)
            for d in found:
                bwd = d["pass"] == "fwd+bwd"
                io_out = (N * H + V * H) * 4 if bwd else 0  # the f32 dh and dW it writes
                ms = d["ms"]
                rows_walk = d.get("walk") == "rows"  # the training step's one-call form
                walk = (f"row-block walk, {d.get('row_block')} rows a block, bf16 logits, the "
                        f"caller's scratch" if rows_walk else f"chunk {d['chunk']}")
                view = ("" if rows_walk else
                        f"; device view +{mib(d['dev_extra_bytes'])} during the calls")
                ce_rows.append(dict(
                    engine=f"kiln {d['mode']}" + (", row walk" if rows_walk else ""),
                    weights=d["wdtype"], pass_=d["pass"], ms=ms,
                    tflops=(fb if bwd else fw) / (ms * 1e-3) / 1e12 if ms > 0 else None,
                    peak=d["scratch_bytes"] + io_out,
                    notes=f"scratch {mib(d['scratch_bytes'])} (kiln accounting){view}; {walk}; "
                          f"loss {d['loss']:.4f}"))
            for line in p.stdout.splitlines():
                if line.startswith("SKIP"):
                    ce_rows.append(dict(engine="kiln", weights="-", pass_="-", ms=None, tflops=None,
                                        peak=None, notes=line[:200]))
            if not found and p.returncode == 77:
                ce_rows.append(dict(engine="kiln", weights="-", pass_="-", ms=None, tflops=None,
                                    peak=None, notes="n/a: no GPU (bench_cuda_fused_ce rc 77)"))
            elif not found:
                ce_rows.append(dict(engine="kiln", weights="-", pass_="-", ms=None, tflops=None,
                                    peak=None, notes=f"failed: rc {p.returncode}: {text.strip()[-150:]}"))
        except subprocess.TimeoutExpired:
            ce_rows.append(dict(engine="kiln", weights="-", pass_="-", ms=None, tflops=None,
                                peak=None, notes="failed: timed out (--budget)"))
    # PyTorch
    # torch.compile'd: fwd+bwd only (two compilations), when the budget allows
    cases = [(False, dt, bwd) for dt in (torch.bfloat16, torch.float32) for bwd in (False, True)]
    if args.compile:
        cases += [(True, dt, True) for dt in (torch.bfloat16, torch.float32)]
    for compiled, dt, bwd in cases:
        eng = "PyTorch " + ("torch.compile" if compiled else "eager")
        wname = "bf16" if dt == torch.bfloat16 else "f32"
        ps = "fwd+bwd" if bwd else "fwd"
        need = 40 if compiled else 8
        if args.time_left() < need:
            ce_rows.append(dict(engine=eng, weights=wname, pass_=ps, ms=None, tflops=None,
                                peak=None, notes="skipped (--budget)"))
            continue
        try:
            ms, peak, warm = torch_ce(dev, N, H, V, dt, compiled, bwd, args.ce_reps)
        except Exception as e:
            log(f"torch CE {eng} {wname} {ps} failed: {e!r}")
            cleanup(dev)
            ce_rows.append(dict(engine=eng, weights=wname, pass_=ps, ms=None, tflops=None,
                                peak=None, notes=f"failed: {e!r}"[:200]))
            continue
        out.setdefault("torch", []).append(dict(engine=eng, weights=wname, pass_=ps, ms=ms,
                                                peak=peak, warm_s=warm))
        note = f"f32 logits {mib(logits)}" + (f"; compile {warm:.0f} s" if compiled else "")
        ce_rows.append(dict(engine=eng, weights=wname, pass_=ps, ms=ms,
                            tflops=(fb if bwd else fw) / (ms * 1e-3) / 1e12, peak=peak,
                            notes=note))
        log(f"torch CE {eng} {wname} {ps}: {ms:.2f} ms, peak {mib(peak)}")


def part_memory(args, mem_rows, res, folder):
    dev = args.device
    name, B, T = args.mem_model, args.mem_batch, args.mem_seq
    V = SHAPES[name][6]
    kiln = kiln_mod(args)
    fast = trainer_has_fast(kiln) and dev == "cuda"
    batches = make_batches(V, B, T, 3, args.seed)
    out = res.setdefault("memory", dict(model=name, B=B, T=T, kiln=[], torch=[]))
    km = kiln.Model(folder)
    try:
        for storage, moments in VARIANTS:
            label = f"kiln {'fast' if fast else 'auditable'}, weights {storage}, moments {moments}"
            if args.time_left() < 10:
                mem_rows.append(dict(variant=label, notes="skipped (--budget)"))
                continue
            x, why = None, ""
            for mode_fast in ((True, False) if fast else (False,)):
                try:
                    x = bench_kiln(args, km, batches, mode_fast, 1, storage, moments, one_seq=True)
                    break
                except Exception as e:
                    log(f"{label} ({'fast' if mode_fast else 'auditable'}): failed: {e!r}")
                    why += f"{'fast' if mode_fast else 'auditable'} failed: {e}; "
                    label = label.replace("kiln fast", "kiln auditable")
            if x is None:
                mem_rows.append(dict(variant=label, notes=why[:200]))
                continue
            m = x["mem"]
            out["kiln"].append(dict(storage=storage, moments=moments, mem=m, describe=x["describe"],
                                    device_peak=x["device_peak"]))
            mem_rows.append(dict(variant=label, params=m["params"], grads=m["grads"],
                                 optimizer=m["optimizer"], activations=m["activations"],
                                 scratch=m["scratch"], peak_alloc=m["peak_step"],
                                 device_peak=x["device_peak"],
                                 notes=f"{why}one sequence of {T} (a step of {B} repeats "
                                       f"it); create {x['create_s']:.1f} s"))
            log(f"{label}: {x['describe']}; device +{gib(x['device_peak'])} GiB")
    finally:
        km.close()
    cases = [("PyTorch AdamW (fused), f32 params + bf16 autocast", torch.float32, None),
             ("PyTorch AdamW (fused), bf16 params", torch.bfloat16, None),
             (f"PyTorch AdamW (fused), f32 params + bf16 autocast, micro-batch 1 x {B}",
              torch.float32, 1)]
    for label, dt, micro in cases:
        if args.time_left() < 10:
            mem_rows.append(dict(variant=label, notes="skipped (--budget)"))
            continue
        try:
            x = bench_torch(folder, dev, batches, 1, 1, dtype=dt, micro=micro)
        except Exception as e:
            log(f"{label}: failed: {e!r}")
            mem_rows.append(dict(variant=label, notes=f"failed: {e!r}"[:200]))
            cleanup(dev)
            continue
        out["torch"].append(dict(label=label, **{k: x[k] for k in (
            "params_bytes", "grads_bytes", "optimizer_bytes", "peak_alloc", "device_peak")}))
        mem_rows.append(dict(variant=label, params=x["params_bytes"], grads=x["grads_bytes"],
                             optimizer=x["optimizer_bytes"], peak_alloc=x["peak_alloc"],
                             device_peak=x["device_peak"],
                             notes=f"batch {B} x {T}, 2 steps (the first allocates AdamW's state) "
                                   f"{x['note']}".strip()))
        log(f"{label}: peak alloc {gib(x['peak_alloc'])} GiB, device +{gib(x['device_peak'])} GiB")


# ---- tables ------------------------------------------------------------------------------------

def fmt_num(v):
    if v is None:
        return "-"
    return f"{v:.1f}" if v < 1000 else f"{v:.0f}"


def pct(v):
    return "-" if v is None else f"{100 * v:.1f}%"


def add_ratios(rows):
    """Notes of the kiln fast rows: auditable cost, x compile, mem x compile."""
    by = {}
    for r in rows:
        by[(r["model"], r["T"], r["engine"])] = r
    summary = []
    for r in rows:
        if not r["engine"].startswith("kiln fast") or not r["tok_s"]:
            continue
        k = (r["model"], r["T"])
        aud = by.get(k + ("kiln auditable",))
        comp = by.get(k + ("PyTorch torch.compile",))
        eager = by.get(k + ("PyTorch eager",))
        label = r["model"] + r["engine"][len("kiln fast"):]  # ", M seqs/forward" when batched
        s = dict(model=label, T=r["T"], B=r["B"], mfu=r["mfu"])
        extra = []
        if aud and aud["tok_s"]:
            s["auditable_cost"] = r["tok_s"] / aud["tok_s"]
            extra.append(f"auditable cost {s['auditable_cost']:.1f}x")
        for tag, ref in (("compile", comp), ("eager", eager)):
            if ref and ref["tok_s"]:
                s[f"x_{tag}"] = r["tok_s"] / ref["tok_s"]
                extra.append(f"{s[f'x_{tag}']:.2f}x {tag} tok/s")
                if ref.get("device_peak") and r.get("device_peak"):
                    s[f"mem_x_{tag}"] = r["device_peak"] / ref["device_peak"]
                    extra.append(f"mem {s[f'mem_x_{tag}']:.2f}x {tag}")
        if extra:
            r["notes"] = "; ".join(extra) + "; " + r["notes"]
        summary.append(s)
    return summary


def print_tables(args, info, R, rows, ce_rows, mem_rows, summary, total):
    log("")
    log(f"==== bench_train_gpu: {info.get('gpu', args.device)}, kiln {info['kiln_commit']}, "
        f"torch {torch.__version__}, transformers {info['transformers']}; {total:.0f} s; "
        f"bf16 matmul {R / 1e12:.1f} TFLOP/s ({info['matmul_n']}^3, the MFU denominator)")
    if rows:
        log("\n-- training (step = B sequences x T tokens: fwd + loss + bwd + clip + AdamW); "
            "MFU = tok/s x (6N + 6LCT) / bf16 matmul rate; memory in GiB")
        log("| model | T | B | engine | tok/s | MFU | peak alloc | device | notes |")
        log("| --- | ---: | ---: | --- | ---: | ---: | ---: | ---: | --- |")
        order = {"PyTorch eager": 0, "PyTorch torch.compile": 1, "kiln fast": 2, "kiln auditable": 3}
        for r in sorted(rows, key=lambda r: (args.models.index(r["model"]), -r["T"],
                                             order.get(r["engine"], 9))):
            log(f"| {r['model']} | {r['T']} | {r['B']} | {r['engine']} | {fmt_num(r['tok_s'])} | "
                f"{pct(r['mfu'])} | {gib(r['peak_alloc'])} | {gib(r['device_peak'])} | {r['notes']} |")
    if ce_rows:
        N, H, V = args.ce_shape
        log(f"\n-- fused loss, N {N} rows, H {H}, V {V} (materialised f32 logits would be "
            f"{N * V * 4 / GiB:.2f} GiB); peak above inputs: outputs dh, dW included")
        log("| engine | weights | pass | ms | TFLOP/s | peak above inputs | notes |")
        log("| --- | --- | --- | ---: | ---: | ---: | --- |")
        for r in ce_rows:
            log(f"| {r['engine']} | {r['weights']} | {r['pass_']} | "
                f"{'-' if r['ms'] is None else format(r['ms'], '.2f')} | "
                f"{fmt_num(r['tflops'])} | {mib(r['peak'])} | {r['notes']} |")
    if mem_rows:
        log(f"\n-- memory of a full step, {args.mem_model} shape, T {args.mem_seq}, batch "
            f"{args.mem_batch} (GiB; kiln: describe()'s accounting; device: polled)")
        log("| variant | params | grads | optimizer | activations | scratch | peak alloc | device | notes |")
        log("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
        for r in mem_rows:
            log(f"| {r['variant']} | {gib(r.get('params'))} | {gib(r.get('grads'))} | "
                f"{gib(r.get('optimizer'))} | {gib(r.get('activations'))} | {gib(r.get('scratch'))} | "
                f"{gib(r.get('peak_alloc'))} | {gib(r.get('device_peak'))} | {r.get('notes', '')} |")
    if summary:
        log("\n-- summary: kiln fast against the issue's goals (MFU >= 55%, >= 1.2x torch.compile "
            "tok/s, <= 0.5x its device peak); auditable cost = fast tok/s / auditable tok/s")
        log("| model | T | B | MFU | x compile tok/s | mem x compile | x eager tok/s | mem x eager | auditable cost |")
        log("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")

        def f(s, k, goal=None, le=False):
            v = s.get(k)
            if v is None:
                return "-"
            txt = f"{v:.2f}x"
            if goal is not None:
                txt += " ok" if (v <= goal if le else v >= goal) else " (goal missed)"
            return txt
        for s in summary:
            m = s.get("mfu")
            mt = "-" if m is None else f"{100 * m:.1f}%" + (" ok" if m >= 0.55 else " (goal missed)")
            log(f"| {s['model']} | {s['T']} | {s['B']} | {mt} | {f(s, 'x_compile', 1.2)} | "
                f"{f(s, 'mem_x_compile', 0.5, True)} | {f(s, 'x_eager')} | {f(s, 'mem_x_eager')} | "
                f"{f(s, 'auditable_cost')} |")


# ---- main --------------------------------------------------------------------------------------

def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--bin", default=None, help="folder with libkiln.so (and bench_cuda_fused_ce)")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--parts", default=",".join(PARTS))
    ap.add_argument("--models", default=None, help="135m,0.5b (quick/cpu: tiny-llama,tiny-qwen2)")
    ap.add_argument("--batches", default=None, help="batch per model (16,8; quick 2,2)")
    ap.add_argument("--seqs", default=None, help="sequence lengths (2048,1024; quick 64,32)")
    ap.add_argument("--steps", type=int, default=3, help="timed steps per configuration")
    ap.add_argument("--aud-seqs", type=int, default=1,
                    help="timed sequences of kiln auditable (after one warm sequence)")
    ap.add_argument("--per-config", type=float, default=25.0,
                    help="seconds a kiln configuration may spend on timed work before it "
                         "measures fewer steps")
    ap.add_argument("--ce-reps", type=int, default=3)
    ap.add_argument("--reserve-after", type=float, default=120.0,
                    help="seconds the models' torch.compile (run after the training part) "
                         "leaves for the fused-loss and memory parts")
    ap.add_argument("--budget", type=float, default=450.0, help="seconds for the whole run")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--no-compile", dest="compile", action="store_false", default=None,
                    help="no torch.compile rows (the default in --quick and --device cpu)")
    ap.add_argument("--compile", dest="compile", action="store_true",
                    help="torch.compile rows even in --quick / --device cpu")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--micro", default="0",
                    help="also run kiln fast with this many sequences per forward (forward_batch; "
                         "must divide the batch): one value, or one per model (4,2)")
    ap.add_argument("--kiln-variants", default="",
                    help="more kiln fast rows, each with --micro's sequences a forward and other "
                         "trainer settings: 'LABEL:key=value,key=value;LABEL2:...' with keys "
                         "ce_row_block, ce_logits_f32, moments, storage, or env.KILN_NAME (an environment "
                         "variable set while the row runs; e.g. 'vocabulary walk:"
                         "ce_row_block=0;q8 moments:moments=q8;attn 3 blocks:"
                         "env.KILN_ATTN_BWD_BLOCKS=3')")
    ap.add_argument("--work", default="/tmp/kiln-train-bench")
    ap.add_argument("--json", default=None)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--worker-folder", help=argparse.SUPPRESS)
    ap.add_argument("--worker-model", help=argparse.SUPPRESS)
    ap.add_argument("--worker-batch", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.kiln_variants = parse_variants(ap, args.kiln_variants)
    small = args.quick or args.device == "cpu"
    args.seqs = [int(x) for x in (args.seqs or ("64,32" if small else "2048,1024")).split(",") if x]
    if args.worker:
        worker_main(args)
        return
    if args.bin is None:
        ap.error("--bin DIR (the folder with libkiln.so) is required")
    args.bin = os.path.abspath(args.bin)
    models = args.models or ("tiny-llama,tiny-qwen2" if small else "135m,0.5b")
    args.models = [ALIASES.get(x, x) for x in models.split(",") if x]
    for x in args.models:
        if x not in SHAPES:
            ap.error(f"unknown model {x} (known: {', '.join(list(ALIASES) + ['tiny-llama', 'tiny-qwen2'])})")
    defaults = {"SmolLM2-135M": 16, "Qwen2.5-0.5B": 8}
    args.batches = [int(x) for x in args.batches.split(",")] if args.batches else \
        [2 if small else defaults.get(m, 8) for m in args.models]
    if len(args.batches) != len(args.models):
        ap.error("--batches: one per model")
    args.micro = [int(x) for x in args.micro.split(",") if x]
    if len(args.micro) == 1:
        args.micro = args.micro * len(args.models)
    if len(args.micro) != len(args.models):
        ap.error("--micro: one value, or one per model")
    args.parts = [p for p in args.parts.split(",") if p]
    if any(p not in PARTS for p in args.parts):
        ap.error(f"--parts: a subset of {','.join(PARTS)}")
    if args.compile is None:
        args.compile = not small
    if small:
        args.steps = min(args.steps, 2)
    args.ce_shape = (256, 64, 1024) if small else (8192, 896, 151936)
    args.mem_model = "tiny-qwen2" if small else "Qwen2.5-0.5B"
    args.mem_batch, args.mem_seq = (2, 64) if small else (8, 2048)
    args.kiln_device = 0 if args.device == "cuda" else -1
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("no CUDA device visible to torch (use --device cpu for the smoke mode)")
    os.makedirs(args.work, exist_ok=True)
    t_start = time.time()
    args.time_left = lambda: t_start + args.budget - time.time()

    import transformers as tf
    try:
        tf.utils.logging.disable_progress_bar()
    except AttributeError:
        pass
    info = dict(device=args.device, torch=torch.__version__, transformers=tf.__version__,
                cuda=torch.version.cuda, argv=sys.argv[1:])
    if args.device == "cuda":
        info["gpu"] = torch.cuda.get_device_name(0)
    try:
        info["kiln_commit"] = open(os.path.join(args.bin, "COMMIT")).read().strip()
    except OSError:
        info["kiln_commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                             text=True, cwd=HERE).stdout.strip()
    kiln = kiln_mod(args)
    info["trainer_has_fast"] = trainer_has_fast(kiln)
    log(json.dumps(info))

    from bench_gpu import dev_time
    n = 8192 if args.device == "cuda" else 512
    a = torch.randn(n, n, dtype=torch.bfloat16, device=args.device)
    b = torch.randn(n, n, dtype=torch.bfloat16, device=args.device)
    R = 2 * n ** 3 / dev_time(args.device, lambda: a @ b, 10, warm=3)
    del a, b
    cleanup(args.device)
    info["matmul_bf16_TFLOPs"], info["matmul_n"] = R / 1e12, n
    log(f"bf16 matmul {n}^3: {R / 1e12:.1f} TFLOP/s")

    rows, ce_rows, mem_rows, res = [], [], [], {}
    folders = {}

    def dump():
        if args.json:
            with open(args.json, "w") as f:
                json.dump(dict(info=info, results=res, train_rows=rows, ce_rows=ce_rows,
                               memory_rows=mem_rows, total_s=time.time() - t_start), f, indent=1,
                          default=str)

    def guarded(label, fn):
        try:
            fn()
        except Exception as e:  # one part's failure must not lose the others' figures
            import traceback
            traceback.print_exc()
            log(f"{label}: failed: {e!r}")
        dump()

    if "train" in args.parts:
        guarded("train", lambda: part_train(args, R, rows, res, folders))
        # torch.compile next (it decides the comparison), keeping --reserve-after
        # seconds for the fused-loss and memory parts that follow
        guarded("compile", lambda: part_compile(args, R, rows, res, folders))
    if "ce" in args.parts:
        guarded("ce", lambda: part_ce(args, ce_rows, res))
    if "memory" in args.parts:
        def mem():
            if args.mem_model not in folders:
                folders[args.mem_model] = make_model(args.mem_model, args.work, args.device)
            part_memory(args, mem_rows, res, folders[args.mem_model])
        guarded("memory", mem)
    summary = add_ratios(rows)
    res["summary"] = summary
    dump()
    print_tables(args, info, R, rows, ce_rows, mem_rows, summary, time.time() - t_start)
    if args.json:
        log(f"\nJSON: {args.json}")


if __name__ == "__main__":
    main()
