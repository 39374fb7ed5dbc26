#!/usr/bin/env python3
"""profile_decode_gpu.py -- what a kiln decode step's time is made of, kernel by kernel, against
the bytes each kernel must move: the "gap" profile of issue 29's rows.

  python3 bench/profile_decode_gpu.py --bin DIR [--models 0.5b,1.5b,3b] [--formats bf16,q4_k_m]
      [--mode fast|auditable] [--new 128] [--steps 5] [--work /tmp/kiln-prof] [--ncu ncu]

For each model shape (random weights, written as bench_gpu.py writes them: a bf16 HF folder
for bf16, a GGUF file for f16 / q8_0 / q4_k / q4_k_m) and format:
  1. the step as users run it: `kiln generate -m M -p PROMPT -n NEW --temp 0 --ignore-eos
     --json --device cuda [--fast]` (CUDA graphs on), its decode tok/s -> us per token;
  2. the kernels alone: the same command with -n STEPS+1 and KILN_CUDA_GRAPHS=0 under `ncu
     --clock-control none --metrics gpu__time_duration.sum,dram__bytes_read.sum` (ncu
     serialises the launches, so their sum has no overlap and no launch gaps), cut into steps
     at the sampler's launch, the prompt's forward left out;
  3. per kernel and grid: launches a step, us per launch, MB read from DRAM a step, GB/s, and
     "over": its time a step beyond what its DRAM bytes cost at the copy bandwidth measured in
     this run (the bandwidth bench_gpu.py's roofline uses) -- where the gap to the roofline is.
The summary line of each row: the graph's us per token, the kernels' sum, the DRAM bytes of a
step, the roofline's us (those bytes at the copy bandwidth; bench_gpu.py's roofline counts the
weights and the KV cache instead, which the DRAM bytes approach), and kiln's share of it.
"""
import argparse
import json
import os
import shutil
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_gpu as bg  # noqa: E402  (the model shapes and writers)
import ncu_kernel_times as nk  # noqa: E402


def write_model(name, fmt, work):
    """The file or folder of `name` in `fmt`; returns its path."""
    V = bg.SHAPES[name][6]
    special, eos = bg.special_tokens(name)
    tokdir = os.path.join(work, f"tok-{V}")
    toks = bg.write_tokenizer(tokdir, V, special, eos)
    if fmt == "bf16":
        path = os.path.join(work, name)
        if not os.path.exists(os.path.join(path, "config.json")):
            bg.make_model(name, work, tokdir, "cuda")
        return path
    path = os.path.join(work, f"{name}-{fmt}.gguf")
    if not os.path.exists(path):
        bg.write_gguf(path, name, fmt, toks, special, eos, "cuda")
    return path


def kiln_cmd(args, path, n):
    cmd = [os.path.join(args.bin, "kiln"), "generate", "-m", path, "-p", bg.PROMPT, "-n", str(n),
           "--temp", "0", "--ignore-eos", "--device", "cuda"]
    return cmd + (["--fast"] if args.mode == "fast" else [])


def profile(args, env, path, bw):
    """Returns (summary dict, kernel rows) or raises."""
    r = subprocess.run(kiln_cmd(args, path, args.new) + ["--json"], capture_output=True,
                       text=True, env=env, timeout=600)
    if r.returncode:
        raise RuntimeError(f"kiln generate rc={r.returncode}: {r.stderr[-800:]}")
    graph_us = 1e6 / json.loads(r.stdout)["decode_tokens_per_s"]
    csv_path = os.path.join(args.work, "ncu.csv")
    e2 = dict(env, KILN_CUDA_GRAPHS="0")
    with open(csv_path, "w") as f:
        r = subprocess.run([args.ncu, "--clock-control", "none", "--metrics",
                            "gpu__time_duration.sum,dram__bytes_read.sum", "--csv",
                            "--print-units", "base"] + kiln_cmd(args, path, args.steps + 1),
                           stdout=f, stderr=subprocess.PIPE, text=True, env=e2, timeout=900)
    if r.returncode:
        raise RuntimeError(f"ncu rc={r.returncode}: {r.stderr[-800:]}")
    summ, rows = step_table(csv_path, bw)
    summ["graph_us"] = graph_us
    summ["share"] = summ["roofline_us"] / graph_us
    return summ, rows


def step_table(csv_path, bw):
    """The per-step kernel table of an ncu CSV (ncu_kernel_times' launches, by grid): steps cut
    after each sampler launch, the first (the prompt's forward) left out. Returns (summary,
    rows sorted by time a step); bw: bytes/s the "over" column and the roofline use."""
    nk.BY_GRID = True
    ls = nk.launches(csv_path)
    steps = nk.split_steps(ls, "sampler_main")[1:]  # the first: the prompt's forward
    if not steps:
        raise RuntimeError("no decode step in the profile")
    per, k = nk.per_kernel(steps)
    rows = []
    for n, (c, t, b) in per.items():
        us, mb = t / k / 1e3, b / k / 1e6
        rows.append(dict(kernel=n, launches=c / k, us_launch=t / c / 1e3, us_step=us, mb_step=mb,
                         gbps=b / t if t else 0.0, over_us=us - mb * 1e6 / bw * 1e6))
    rows.sort(key=lambda x: -x["us_step"])
    tot_us = sum(x["us_step"] for x in rows)
    tot_mb = sum(x["mb_step"] for x in rows)
    roof_us = tot_mb * 1e6 / bw * 1e6
    summ = dict(kernels_us=tot_us, dram_mb=tot_mb, roofline_us=roof_us,
                launches=sum(x["launches"] for x in rows), steps=k)
    return summ, rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--bin", required=True, help="folder with kiln (and its libraries)")
    ap.add_argument("--models", default="0.5b,1.5b,3b")
    ap.add_argument("--formats", default="bf16", help="bf16, f16, q8_0, q4_k, q4_k_m")
    ap.add_argument("--mode", default="fast", choices=("fast", "auditable"))
    ap.add_argument("--new", type=int, default=128, help="tokens of the graph run")
    ap.add_argument("--steps", type=int, default=5, help="decode steps profiled")
    ap.add_argument("--work", default="/tmp/kiln-prof")
    ap.add_argument("--ncu", default="ncu")
    ap.add_argument("--top", type=int, default=8, help="kernels printed per row")
    ap.add_argument("--json", default=None)
    ap.add_argument("--keep", action="store_true", help="leave the written models in --work")
    args = ap.parse_args()
    args.bin = os.path.abspath(args.bin)
    os.makedirs(args.work, exist_ok=True)
    env = dict(os.environ)
    env["LD_LIBRARY_PATH"] = ":".join(bg.lib_dirs(args.bin) + [env.get("LD_LIBRARY_PATH", "")])
    dev = bg.measure_device("cuda")
    bw = dev["copy_rw_GBps"] * 1e9
    print(f"copy {bw / 1e9:.0f} GB/s read + write; mode {args.mode}", flush=True)
    out, tables = [], []
    for m in [bg.ALIASES.get(x, x) for x in args.models.split(",") if x]:
        for fmt in [x for x in args.formats.split(",") if x]:
            try:
                path = write_model(m, fmt, args.work)
                summ, rows = profile(args, env, path, bw)
            except Exception as e:  # one row's failure must not lose the others
                print(f"{m} {fmt}: failed: {e!r}", flush=True)
                continue
            out.append(dict(model=m, format=fmt, summary=summ, kernels=rows))
            t = [f"### {m} {fmt}, {args.mode}: {summ['graph_us']:.0f} us/token in the graph; "
                 f"kernels alone {summ['kernels_us']:.0f} us in {summ['launches']:.0f} launches; "
                 f"{summ['dram_mb']:.1f} MB from DRAM = {summ['roofline_us']:.0f} us at the copy "
                 f"bandwidth ({100 * summ['share']:.1f}% of the graph's time)",
                 "| kernel (grid) | launches | us/launch | us/step | MB/step | GB/s | over |",
                 "|---|---:|---:|---:|---:|---:|---:|"]
            for x in rows[:args.top]:
                t.append(f"| {x['kernel']} | {x['launches']:.0f} | {x['us_launch']:.2f} | "
                         f"{x['us_step']:.1f} | {x['mb_step']:.1f} | {x['gbps']:.0f} | "
                         f"{x['over_us']:.1f} |")
            rest = rows[args.top:]
            if rest:
                t.append(f"| ({len(rest)} others) | {sum(x['launches'] for x in rest):.0f} | | "
                         f"{sum(x['us_step'] for x in rest):.1f} | "
                         f"{sum(x['mb_step'] for x in rest):.1f} | | "
                         f"{sum(x['over_us'] for x in rest):.1f} |")
            print("\n".join(t), flush=True)
            tables.append("\n".join(t))
            if args.json:
                with open(args.json, "w") as f:
                    json.dump(dict(device=dev, mode=args.mode, rows=out), f, indent=1)
            if not args.keep and fmt != "bf16":
                os.remove(path)
        if not args.keep:
            shutil.rmtree(os.path.join(args.work, m), ignore_errors=True)
    print("\n==== profile_decode_gpu: the tables again\n" + "\n\n".join(tables))


if __name__ == "__main__":
    main()
