#!/usr/bin/env python3
"""Training throughput on the CPU: kiln against PyTorch, same model, same data, same threads,
AdamW, in one run; and the memory of kiln's fused loss against PyTorch's materialised logits.

    python bench/bench_train.py [--threads 2] [--seq 256] [--steps 3] [--markdown]

Models: "small" (kiln's ~12M configuration: 6 x 192, tied, 49152-token SmolLM2 vocabulary, random
weights written as a Hugging Face folder) and SmolLM2-135M-Instruct (the default model's GGUF,
dequantized to f32 by both sides). One step = forward + loss + backward of one sequence of
--seq tokens + clip + AdamW. Needs the oracle venv (scripts/setup-venv.sh) and a kiln build.
"""
import argparse
import datetime
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "python"))

import numpy as np  # noqa: E402
import torch  # noqa: E402

import kiln  # noqa: E402


def smollm2_path():
    p = os.environ.get("KILN_SMOLLM2_GGUF")
    if p:
        return Path(p)
    out = subprocess.run(["bash", str(REPO / "scripts/fetch-model.sh")], capture_output=True, text=True, check=True)
    return Path(out.stdout.strip())


def make_small(gguf, d):
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    cfg = LlamaConfig(hidden_size=192, intermediate_size=512, num_hidden_layers=6, num_attention_heads=6,
                      num_key_value_heads=2, vocab_size=49152, max_position_embeddings=2048, rms_norm_eps=1e-5,
                      tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(d)
    tok.save_pretrained(d)
    return d


def torch_model(path, gguf=None):
    from transformers import AutoModelForCausalLM
    if gguf:
        return AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)


def bench_torch(model, batches, compile_model=False):
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1)
    fn = torch.compile(model) if compile_model else model
    times = []
    for i, ids in enumerate(batches):
        t0 = time.perf_counter()
        x = torch.tensor([ids])
        loss = fn(x, labels=x).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        if i:
            times.append(time.perf_counter() - t0)
    return times


def bench_kiln(path, batches, threads):
    m = kiln.Model(path)
    tr = kiln.Trainer(m, max_seq=len(batches[0]), n_threads=threads, lr=1e-4, weight_decay=0.1)
    times = []
    for i, ids in enumerate(batches):
        t0 = time.perf_counter()
        tr.step(ids)
        tr.clip_grads(1.0)
        tr.optimizer_step(1e-4)
        if i:
            times.append(time.perf_counter() - t0)
    _, mem = tr.describe()
    tr.close()
    m.close()
    return times, mem


CE_PROBE = r"""
import resource, sys, torch
V, H, N, threads = map(int, sys.argv[1:5])
torch.set_num_threads(threads)
h = torch.randn(N, H, requires_grad=True)
W = torch.randn(V, H, requires_grad=True)
t = torch.randint(0, V, (N,))
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
loss = torch.nn.functional.cross_entropy(h @ W.T, t)
loss.backward()
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) * 1024)
"""


def ce_memory(V, H=576, N=2048, threads=2):
    """PyTorch's peak memory growth for cross-entropy on materialised logits (forward +
    backward), measured in a fresh process; and the size of the logits themselves."""
    out = subprocess.run([sys.executable, "-c", CE_PROBE, str(V), str(H), str(N), str(threads)],
                         capture_output=True, text=True, check=True)
    return N * V * 4, int(out.stdout.strip().splitlines()[-1])


def kiln_ce_memory(V, H=576, N=2048, threads=2):
    """kiln's fused loss: peak bytes by kiln's own accounting (tests/tools/ce_tool bench)."""
    build = Path(os.environ.get("KILN_BUILD_DIR", REPO / "build"))
    out = subprocess.run([str(build / "ce_tool"), "bench", str(N), str(H), str(V), "4096", str(threads), "1"],
                         capture_output=True, text=True)
    return out.stdout.strip() if out.returncode == 0 else f"ce_tool failed: {out.stderr.strip()[:200]}"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--skip-135m", action="store_true")
    ap.add_argument("--markdown", action="store_true")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    gguf = smollm2_path()
    rng = np.random.default_rng(0)
    batches = [rng.integers(3, 49152, size=a.seq).tolist() for _ in range(a.steps + 1)]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        small = make_small(gguf, Path(tmp) / "small")
        kt, kmem = bench_kiln(small, batches, a.threads)
        tt = bench_torch(torch_model(small), batches)
        rows.append(("small (11.8M)", np.median(kt), np.median(tt), kmem))
        if not a.skip_135m:
            kt, kmem = bench_kiln(gguf, batches, a.threads)
            tt = bench_torch(torch_model(None, gguf), batches)
            rows.append(("SmolLM2-135M", np.median(kt), np.median(tt), kmem))
    ce = [(V,) + ce_memory(V, threads=a.threads) + (kiln_ce_memory(V, threads=a.threads),) for V in (49152, 151936)]
    rev = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), platform.machine())
    if a.markdown:
        print(f"{datetime.date.today()}, {cpu}, {os.cpu_count()} cores, {a.threads} threads; torch {torch.__version__}; "
              f"kiln {rev}; `python bench/bench_train.py --threads {a.threads} --seq {a.seq} --steps {a.steps}`\n")
        print("| model | kiln tokens/s | PyTorch tokens/s | kiln / PyTorch | kiln params+grads+AdamW+activations |")
        print("|---|---|---|---|---|")
        for name, k, t, mem in rows:
            tot = (mem["params"] + mem["grads"] + mem["optimizer"] + mem["activations"]) / 2**20
            print(f"| {name} | {a.seq / k:.0f} | {a.seq / t:.0f} | {t / k:.2f}x | {tot:.0f} MiB |")
        print("\n| V | materialised logits (N=2048, H=576, f32) | PyTorch peak growth, CE fwd+bwd | kiln fused CE (ce_tool bench) |")
        print("|---|---|---|---|")
        for V, logits, peak, k in ce:
            print(f"| {V} | {logits / 2**20:.0f} MiB | {peak / 2**20:.0f} MiB | {k} |")
    print("\nmodel            kiln tok/s  torch tok/s  ratio")
    for name, k, t, _ in rows:
        print(f"{name:16s} {a.seq / k:10.0f} {a.seq / t:12.0f} {t / k:6.2f}x")


if __name__ == "__main__":
    main()
