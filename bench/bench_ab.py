#!/usr/bin/env python3
"""bench_ab.py -- two builds of kiln side by side on one machine in one run: decode and
prefill through `kiln generate --json`, training steps through the Python binding, the builds
alternating rep by rep so that drift of the machine falls on both. For "before/after" figures
of a change (bench/RESULTS.md); the peers' figures are bench_gpu.py's and
bench_train_gpu.py's.

  python3 bench/bench_ab.py --a BUILD_BEFORE --b BUILD_AFTER [--c BUILD_3] [--d BUILD_4] [--labels before,after]
      [--modes auditable,fast,mx16,mx8] [--train-modes fast,mx16]
      [--parts decode,batch,train] [--model 0.5b|1.5b|3b|tiny] [--new 128] [--prefill 2048 (0: none)] [--reps 3]
      [--seq 2048] [--batch 8] [--micro 1,8] [--steps 3] [--device cuda|cpu] [--json OUT]

Each build folder holds `kiln` and `libkiln.so` (a CMake build folder; its scripts/gpu-deps.sh
dependencies in BUILD/deps are found). A build may name environment variables after an @:
`--a build-gpu@KILN_CUDA_PDL=0 --b build-gpu` compares one build with a switch off and on. The model: bench_gpu.py's random bf16 Qwen2.5-0.5B
shape (--model tiny: a 2-layer qwen2 for a CPU smoke run). Decode: tokens/s of 128 greedy
tokens after bench_gpu's prompt, auditable and --fast, the median of --reps processes per
build, and whether each build's greedy ids equal the first build's; prefill: the prompt tokens/s of a --prefill-token prompt, in a cold process (`kiln generate`,
the first forward uploads the weights) and warm (the binding: the median of 5 forwards after a
first one); batch: tokens/s of all --batch sequences decoding together (kiln_decode_batch,
32-token random prompts, 64 steps, the median of 3 after a warm step). A mode is auditable, fast, or an exact format (mx16, mx8: --format). Train:
kiln.Trainer(max_seq=--seq, max_batch=K, the --train-modes mode) steps of --batch sequences (K per forward), one
warm step then --steps timed, tokens/s; each build in its own process.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)


def split_spec(spec):
    """A build's folder and extra environment: "DIR" or "DIR@VAR=VAL[,VAR=VAL...]"."""
    folder, _, extra = spec.partition("@")
    env = dict(kv.split("=", 1) for kv in extra.split(",") if kv)
    return folder, env


def env_for(spec):
    build, extra = split_spec(spec)
    env = dict(os.environ)
    env.update(extra)
    libs = [build, os.path.join(build, "deps", "usr", "lib", "x86_64-linux-gnu")]
    env["LD_LIBRARY_PATH"] = ":".join(libs + [env.get("LD_LIBRARY_PATH", "")])
    env["KILN_LIB"] = os.path.join(build, "libkiln.so")
    return env


def mode_flags(mode):
    """kiln generate's flags of a mode: auditable, fast, mx16 or mx8."""
    return [] if mode == "auditable" else ["--fast"] if mode == "fast" else ["--format", mode]


def generate(build, model, prompt, n_new, mode, device):
    cmd = [os.path.join(split_spec(build)[0], "kiln"), "generate", "-m", model, "-p", prompt, "-n", str(n_new), "--temp", "0",
           "--ignore-eos", "--json", "--device", device, "--ctx", "8192"] + mode_flags(mode)
    r = subprocess.run(cmd, capture_output=True, text=True, env=env_for(build), timeout=600)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: rc {r.returncode}: {r.stderr[-1500:]}")
    return json.loads(r.stdout)


TRAIN_WORKER = r"""
import json, sys, time
import numpy as np
sys.path.insert(0, sys.argv[1])
import kiln
model, seq, batch, micro, steps, device, mode = sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6]), int(sys.argv[7]), sys.argv[8]
m = kiln.Model(model)
kw = dict(max_seq=seq, max_batch=micro, device=device)
if mode == "fast":
    kw["fast"] = True
elif mode != "auditable":
    kw["format"] = mode
tr = kiln.Trainer(m, **kw)
rng = np.random.default_rng(1)
def step():
    for b in range(0, batch, micro):
        ids = rng.integers(0, min(1000, m.n_vocab - 3), size=(micro, seq + 1)).astype(np.int32)
        tr.step_batch(ids[:, :-1], ids[:, 1:], reduction="sum", accumulate=b > 0)
    tr.clip_grads(1.0)
    tr.optimizer_step(1e-4)
step()
t0 = time.perf_counter()
for _ in range(steps):
    step()
dt = (time.perf_counter() - t0) / steps
print(json.dumps({"tok_s": batch * seq / dt, "step_s": dt}))
"""


PREFILL_WORKER = r"""
import json, statistics, sys, time
import numpy as np
sys.path.insert(0, sys.argv[1])
import kiln
model, n, device, mode, reps = sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5], int(sys.argv[6])
m = kiln.Model(model)
ctx = kiln.Context(m, n_ctx=n + 16, n_batch=n, device=device, fast=mode == "fast",
                   format=mode if mode.startswith("mx") else "f32")
ids = np.random.default_rng(1).integers(3, min(30000, m.n_vocab), size=n).tolist()
ctx.decode(ids)  # warm: the weights' upload, workspaces
times = []
for _ in range(reps):
    ctx.truncate(0)
    t0 = time.perf_counter()
    ctx.decode(ids)  # returns the last row's logits: the forward has finished
    times.append(time.perf_counter() - t0)
print(json.dumps({"tok_s": n / statistics.median(times)}))
"""


BATCH_WORKER = r"""
import json, statistics, sys, time
import numpy as np
sys.path.insert(0, sys.argv[1])
import kiln
model, B, n, n_new, device, mode, reps = sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6]), sys.argv[7], int(sys.argv[8])
m = kiln.Model(model)
ctx = kiln.Context(m, n_ctx=n + n_new * (reps + 1) + 8, n_batch=max(B, n), device=device,
                   fast=mode == "fast", format=mode if mode.startswith("mx") else "f32", n_seq=B)
rng = np.random.default_rng(1)
for b in range(B):
    ctx.decode_seq(b, rng.integers(3, min(30000, m.n_vocab), size=n).tolist())
ids = [int(x) for x in ctx.decode_batch(list(range(3, 3 + B))).argmax(axis=1)]
ctx.decode_batch(ids, logits=False)  # records the graph for this B
rates = []
for _ in range(reps):
    t0 = time.perf_counter()
    for _ in range(n_new):
        ctx.decode_batch(ids, logits=False)
    rates.append(B * n_new / (time.perf_counter() - t0))
print(json.dumps({"tok_s": statistics.median(rates)}))
"""


def run_worker(source, build, *args):
    """Run a worker script (source) with build's libkiln.so and the binding, args after the
    binding's path; the JSON object its last output line holds."""
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(source)
        worker = f.name
    cmd = [sys.executable, worker, os.path.join(HERE, "..", "python")] + [str(a) for a in args]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, env=env_for(build), timeout=900)
    finally:
        os.unlink(worker)
    if r.returncode != 0:
        raise RuntimeError(f"worker: rc {r.returncode}: {r.stderr[-1500:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def prefill_warm(build, model, n, device, mode, reps=5):
    """Prompt tokens/s of an n-token forward in a process that has run it once (binding)."""
    dev = 0 if device == "cuda" else -1
    return run_worker(PREFILL_WORKER, build, model, n, dev, mode, reps)["tok_s"]


def batch_decode(build, model, B, n, n_new, device, mode, reps=3):
    """Decode tokens/s of all B sequences (kiln_decode_batch: n-token random prompts, one step
    of B tokens per forward, the tokens fed, not sampled): the median of reps runs of n_new
    steps after a warm one."""
    dev = 0 if device == "cuda" else -1
    return run_worker(BATCH_WORKER, build, model, B, n, n_new, dev, mode, reps)["tok_s"]


def train(build, model, seq, batch, micro, steps, device, mode):
    dev = 0 if device == "cuda" else -1
    return run_worker(TRAIN_WORKER, build, model, seq, batch, micro, steps, dev, mode)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--a", required=True)
    ap.add_argument("--b", default=None, help="a second build (optional: modes side by side of one build)")
    ap.add_argument("--c", default=None, help="a third build (between the two), optional")
    ap.add_argument("--d", default=None, help="a fourth build, optional")
    ap.add_argument("--labels", default="before,after", help="labels of --a,--b[,--c[,--d]]")
    ap.add_argument("--modes", default="auditable,fast")
    ap.add_argument("--train-modes", default=None, help="training modes (default: fast on cuda, auditable on cpu)")
    ap.add_argument("--parts", default="decode,train")
    ap.add_argument("--model", default="0.5b")
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--prefill", type=int, default=2048)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--micro", default="1,8")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--work", default="/tmp/kiln-bench-ab")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    import torch
    import bench_gpu
    builds = dict(zip(args.labels.split(","), [x for x in (args.a, args.b, args.c, args.d) if x]))
    dev = "cuda" if args.device == "cuda" and torch.cuda.is_available() else "cpu"
    os.makedirs(args.work, exist_ok=True)
    name = {"0.5b": "Qwen2.5-0.5B", "1.5b": "Qwen2.5-1.5B", "3b": "Llama-3.2-3B", "tiny": "tiny"}[args.model]
    V = bench_gpu.hf_config(name).vocab_size
    tokdir = os.path.join(args.work, "tok-" + name)
    os.makedirs(tokdir, exist_ok=True)
    special, eos = bench_gpu.special_tokens(name)
    bench_gpu.write_tokenizer(tokdir, V, special, eos)
    model = bench_gpu.make_model(name, args.work, tokdir, dev)[0]
    rows = []
    parts = args.parts.split(",")
    if "decode" in parts:
        long_prompt = ("the kiln fires clay into stone " * (args.prefill // 31 + 1))[: args.prefill]
        for mode in args.modes.split(","):
            dec = {k: [] for k in builds}
            pre = {k: [] for k in builds}
            warm = {k: [] for k in builds}
            ids = {}
            for _ in range(args.reps):
                for label, b in builds.items():
                    g = generate(b, model, bench_gpu.PROMPT, args.new, mode, args.device)
                    dec[label].append(g["decode_tokens_per_s"])
                    ids.setdefault(label, g["ids"])
                    if args.prefill > 0:
                        r = generate(b, model, long_prompt, 1, mode, args.device)
                        pre[label].append(len(r["prompt_ids"]) / r["prefill_seconds"])
                        warm[label].append(prefill_warm(b, model, args.prefill, args.device, mode))
            figures = [("decode tok/s", dec)]
            if args.prefill > 0:
                figures += [(f"prefill tok/s ({len(r['prompt_ids'])} tokens, cold process)", pre),
                            (f"prefill tok/s ({args.prefill} tokens, warm)", warm)]
            for what, d in figures:
                rows.append((f"{what}, {mode}", {k: statistics.median(v) for k, v in d.items()}))
                print("row", rows[-1], flush=True)
            first = next(iter(ids.values()))
            for label, v in ids.items():  # greedy ids against the first build's
                k = next((i for i, (x, y) in enumerate(zip(first, v)) if x != y), None)
                print(f"ids {mode} {label}: " + ("the first build's" if k is None else f"differ from index {k}"),
                      flush=True)
    if "batch" in parts:
        for mode in args.modes.split(","):
            got = {label: batch_decode(b, model, args.batch, 32, 64, args.device, mode)
                   for label, b in builds.items()}
            rows.append((f"decode tok/s, {mode}, batch {args.batch} (all sequences)", got))
            print("row", rows[-1], flush=True)
    if "train" in parts:
        tmodes = args.train_modes or ("fast" if args.device == "cuda" else "auditable")
        for tmode in tmodes.split(","):
            for micro in [int(x) for x in args.micro.split(",")]:
                got = {}
                for label, b in builds.items():
                    got[label] = train(b, model, args.seq, args.batch, micro, args.steps, args.device, tmode)["tok_s"]
                rows.append((f"train tok/s, {tmode}, {args.batch} x {args.seq}, {micro} per forward", got))
                print("row", rows[-1], flush=True)
    labels = list(builds)
    print(f"\n{'figure':58s} " + " ".join(f"{l:>12s}" for l in labels) +
          "".join(f" {l + '/' + labels[0]:>14s}" for l in labels[1:]))
    for what, vals in rows:
        ratios = [vals[l] / vals[labels[0]] if vals[labels[0]] else float("nan") for l in labels[1:]]
        print(f"{what:58s} " + " ".join(f"{vals[l]:12.1f}" for l in labels) + "".join(f" {r:14.3f}" for r in ratios))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "builds": builds, "time": time.time()}, f, indent=1)


if __name__ == "__main__":
    main()
