#!/usr/bin/env python3
"""bench_qwen35.py -- training a Qwen3.5-0.8B-shape model (random weights) on one GPU: kiln
against transformers' Qwen3_5ForCausalLM, tokens/s and device memory, one table printed last.

  python3 bench/bench_qwen35.py --bin DIR [--seq 2048] [--batch 4] [--steps 3] [--budget 480]
      [--engines kiln-fast,torch,torch-nofla,torch-compile,torch-compile-nofla] [--fla-path DIR] [--json OUT]
      [--device cuda|cpu] [--shape 0.8b|tiny]

DIR holds libkiln.so (built with -DKILN_CUDA=ON). --device cpu --shape tiny is the smoke mode
of a machine without a GPU (its figures mean nothing).

THE MODEL: Qwen3_5TextConfig at the 0.8B shape -- hidden 1024, 24 layers (18 Gated DeltaNet,
every 4th gated full attention), 8 query / 2 kv heads of 256 with rotary on a quarter, 16 key
and 16 value heads of 128 in the linear layers (conv kernel 4), FFN 3584, vocabulary 248,320,
tied embeddings -- transformers' initialisation (seed 0), saved as a bf16 folder with a
synthetic byte-level tokenizer of that many ids; both engines load that folder (kiln into f32
parameters, torch upcast to f32), so they start from the same values.

ONE STEP = forward + mean next-token cross-entropy over B x (T - 1) targets + backward of B
sequences of T random tokens + clip the gradient norm to 1 + AdamW (lr 1e-4, weight decay 0.1).
tokens/s = B T / median step (after one warm step). Each engine runs in a child process:
  - kiln-fast: kiln.Trainer(max_seq=T, max_batch=B, device=0, fast=True): bf16 tensor-core
    products, f32 parameters, activations and Gated DeltaNet state; step_batch (all B
    sequences in one forward), clip_grads, optimizer_step.
  - torch: transformers' model in f32 under torch.autocast(bfloat16), sdpa attention, the
    Gated DeltaNet through flash-linear-attention's Triton kernels when the `fla` package
    imports (its wheels carried to the GPU machine; the notes say which), else transformers'
    torch fallback; torch.optim.AdamW(fused=True).
  - torch-nofla: torch without flash-linear-attention (transformers' torch fallback).
  - torch-compile: the same as torch with torch.compile(model) (the 2 warm steps' time, compilation,
    in the notes); killed when its share of the budget is spent.
  - torch-compile-nofla: torch.compile over transformers' torch fallback. (flash-linear-attention
    0.6.0 refuses its gated backward on Hopper with the Triton that PyTorch 2.11 ships, which
    gives wrong results there; on such a machine the *-nofla rows are the peers.)
memory = the device's used memory at the step's peak less before the engine started (kiln:
cudaMemGetInfo after the timed steps, kiln holds its arena for the run; torch: its caching
allocator's peak reserved bytes plus the context's baseline is not counted).
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SHAPES = {
    # C, L, NH, KVH, HS, nk, nv, dk, dv, FF, V
    "0.8b": (1024, 24, 8, 2, 256, 16, 16, 128, 128, 3584, 248320),
    "tiny": (64, 4, 4, 2, 16, 2, 4, 16, 16, 128, 512),
}


def log(*a):
    print(*a, file=sys.stderr, flush=True)


def make_model(shape, root):
    """The random model folder (bf16) and its tokenizer; returns its path."""
    import torch
    import transformers as tf
    sys.path.insert(0, os.path.join(REPO, "bench"))
    from bench_gpu import write_tokenizer
    C, L, NH, KVH, HS, nk, nv, dk, dv, FF, V = SHAPES[shape]
    out = os.path.join(root, f"qwen35-{shape}")
    if os.path.exists(os.path.join(out, "config.json")):
        return out
    cfg = tf.Qwen3_5TextConfig(vocab_size=V, hidden_size=C, intermediate_size=FF, num_hidden_layers=L,
                               num_attention_heads=NH, num_key_value_heads=KVH, head_dim=HS,
                               linear_num_key_heads=nk, linear_num_value_heads=nv, linear_key_head_dim=dk,
                               linear_value_head_dim=dv, linear_conv_kernel_dim=4, tie_word_embeddings=True,
                               max_position_embeddings=32768,
                               rope_parameters={"rope_type": "default", "rope_theta": 1e7,
                                                "partial_rotary_factor": 0.25},
                               eos_token_id=V - 1, bos_token_id=None)
    torch.manual_seed(0)
    model = tf.Qwen3_5ForCausalLM(cfg)
    model.to(torch.bfloat16).save_pretrained(out)
    write_tokenizer(out, V, {V - 1: "<|endoftext|>"}, V - 1)
    return out


def batches(V, B, T, n, seed=0):
    import numpy as np
    rng = np.random.default_rng(seed)
    return [rng.integers(0, V - 3, size=(B, T)).astype("int64") for _ in range(n)]


def device_used(dev):
    if dev != "cuda":
        return 0
    import torch
    free, total = torch.cuda.mem_get_info()
    return total - free


def worker_kiln(a):
    os.environ["KILN_LIB"] = os.path.join(a.bin, "libkiln.so")
    sys.path.insert(0, os.path.join(REPO, "python"))
    import kiln
    base = device_used(a.device) if a.device == "cuda" else 0
    m = kiln.Model(a.model)
    dev = 0 if a.device == "cuda" else -1
    tr = kiln.Trainer(m, max_seq=a.seq, max_batch=a.batch, device=dev, fast=a.device == "cuda", lr=1e-4,
                      weight_decay=0.1)
    data = batches(m.n_vocab, a.batch, a.seq, a.steps + 1)
    times = []
    for i, x in enumerate(data):
        ids = [list(map(int, r)) for r in x]
        tg = [r[1:] + [-1] for r in ids]
        t0 = time.perf_counter()
        loss = tr.step_batch(ids, tg)
        tr.clip_grads(1.0)
        tr.optimizer_step(1e-4)
        tr.get_param("model.norm.weight", m.info["n_embd"])  # waits for the device
        times.append(time.perf_counter() - t0)
        log(f"kiln step {i}: {times[-1]:.3f} s loss {loss:.4f}")
    used = device_used(a.device) - base if a.device == "cuda" else 0
    desc, mem = tr.describe()
    return {"step_s": statistics.median(times[1:]), "warm_s": times[0], "mem_bytes": used, "loss": loss,
            "notes": f"kiln trainer arena {mem}"}


def worker_torch(a, compiled, use_fla=True):
    if use_fla and a.fla_path:
        sys.path.insert(0, a.fla_path)
    import torch
    import transformers as tf
    try:
        if not use_fla:
            raise ImportError("not asked for")
        import fla  # noqa: F401
        fla = f"flash-linear-attention {getattr(fla, '__version__', '?')}"
    except Exception as e:  # noqa: BLE001
        fla = f"transformers' torch fallback (no fla: {e})"
    dev = a.device
    torch.manual_seed(0)
    model = tf.Qwen3_5ForCausalLM.from_pretrained(a.model, dtype=torch.float32, attn_implementation="sdpa").to(dev)
    model.train()
    fwd = torch.compile(model) if compiled else model
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1, fused=dev == "cuda")
    data = batches(model.config.vocab_size, a.batch, a.seq, a.steps + (2 if compiled else 1))
    if dev == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times = []
    for i, x in enumerate(data):
        ids = torch.from_numpy(x).to(dev)
        t0 = time.perf_counter()
        with torch.autocast(dev, dtype=torch.bfloat16, enabled=dev == "cuda"):
            loss = fwd(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if dev == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        log(f"torch{'-compile' if compiled else ''} step {i}: {times[-1]:.3f} s loss {loss.item():.4f}")
    warm = 2 if compiled else 1
    peak = torch.cuda.max_memory_reserved() if dev == "cuda" else 0
    return {"step_s": statistics.median(times[warm:]), "warm_s": sum(times[:warm]), "mem_bytes": peak,
            "loss": loss.item(), "notes": f"gated delta rule: {fla}"}


def run_child(a, engine, timeout):
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", engine, "--model", a.model, "--bin", a.bin,
           "--seq", str(a.seq), "--batch", str(a.batch), "--steps", str(a.steps), "--device", a.device,
           "--fla-path", a.fla_path or ""]
    t0 = time.time()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"failed": f"timed out after {timeout:.0f} s"}
    sys.stderr.write(p.stderr[-3000:])
    for line in reversed(p.stdout.splitlines()):
        if line.startswith("{"):
            r = json.loads(line)
            r["wall_s"] = time.time() - t0
            return r
    return {"failed": f"exit {p.returncode}: {p.stderr.strip().splitlines()[-1] if p.stderr.strip() else ''}"}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", default=os.path.join(REPO, "build"))
    ap.add_argument("--shape", default="0.8b", choices=sorted(SHAPES))
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--budget", type=float, default=480)
    ap.add_argument("--engines", default="kiln-fast,torch,torch-compile")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--root", default=os.path.join(REPO, "build", "bench-models"))
    ap.add_argument("--json")
    ap.add_argument("--fla-path", default="", help="a folder holding the fla package (pip --target)")
    ap.add_argument("--worker")
    ap.add_argument("--model")
    a = ap.parse_args()
    if a.worker:
        r = worker_kiln(a) if a.worker == "kiln-fast" else \
            worker_torch(a, a.worker.startswith("torch-compile"), "nofla" not in a.worker)
        print(json.dumps(r), flush=True)
        return 0
    t_start = time.time()
    a.model = make_model(a.shape, a.root)
    log(f"model: {a.model} ({time.time() - t_start:.0f} s)")
    engines = a.engines.split(",")
    rows = []
    for i, e in enumerate(engines):
        left = a.budget - (time.time() - t_start)
        share = left / (len(engines) - i)
        rows.append((e, run_child(a, e, max(30.0, share))))
    tokens = a.batch * a.seq
    print(f"\nQwen3.5 {a.shape} shape, B {a.batch} x T {a.seq}, {a.steps} timed steps, device {a.device}")
    print(f"| engine | tokens/s | step s | memory GiB | first step(s) s | loss | notes |")
    print("|---|---|---|---|---|---|---|")
    for e, r in rows:
        if "failed" in r:
            print(f"| {e} | failed | | | | | {r['failed']} |")
            continue
        print(f"| {e} | {tokens / r['step_s']:.0f} | {r['step_s']:.3f} | {r['mem_bytes'] / 2**30:.1f} | "
              f"{r['warm_s']:.1f} | {r['loss']:.4f} | {r['notes'][:120]} |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"shape": a.shape, "batch": a.batch, "seq": a.seq, "rows": dict(rows)}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
