"""Data-parallel training on CPU ranks (docs/DISTRIBUTED.md): time per step and memory per rank
at 1, 2 and 4 ranks of `mpirun -np N kiln train`, the same global batch, with ZeRO-2 and ZeRO-3.

Each rank runs under /usr/bin/time (its peak resident set); kiln's own accounting (the run
header's optimizer bytes; ZeRO-3's closing line: the most bytes of weights and gradients rank 0
held, else the run header's params / grads), the resident set at the end of the run (rank 0's
closing line: after the trainer was made whole at start-up, what the steps keep) and the median
step time (metrics.csv's elapsed_s, steps after the first two) come from rank 0. Threads: --cores split between the ranks (at least one
each; more ranks than cores oversubscribe).

    python3 bench/bench_ranks.py --kiln build/kiln --tokenizer MODEL.gguf --data corpus.tok
"""
import argparse
import os
import re
import shutil
import statistics
import subprocess
import tempfile
from pathlib import Path

ENV = {**os.environ, "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
MPI_FLAGS = ["--oversubscribe", "--mca", "btl", "self,vader", "--mca", "btl_vader_single_copy_mechanism", "none"]


def run(args, n, zero, out):
    threads = max(1, args.cores // n)
    cmd = [args.kiln, "train", "--config", args.config, "--tokenizer", args.tokenizer, "--data", args.data,
           "--steps", str(args.steps), "--batch", str(args.batch), "--seq", str(args.seq), "--storage", args.storage,
           "--threads", str(threads), "--save-every", "0", "--eval-fraction", "0", "--no-export", "--out", str(out),
           "--zero", str(zero)]
    timed = ["/usr/bin/time", "-f", "rank-peak-rss-kib %M", *cmd]
    full = [shutil.which("mpirun"), *MPI_FLAGS, "-np", str(n), *timed] if n > 1 else timed
    p = subprocess.run(full, capture_output=True, text=True, env=ENV)
    if p.returncode != 0:
        raise SystemExit(f"{n} ranks failed:\n{p.stderr[-3000:]}")
    rss = [int(x) / 1024 for x in re.findall(r"rank-peak-rss-kib (\d+)", p.stderr)]
    acct = re.search(r"params ([\d.]+) MiB, grads ([\d.]+) MiB, optimizer ([\d.]+) MiB", p.stderr)
    rows = (out / "metrics.csv").read_text().splitlines()[1:]
    el = [float(r.split(",")[-1]) for r in rows]
    step = statistics.median(b - a for a, b in zip(el[1:], el[2:]))
    res = {"ranks": n, "zero": zero if n > 1 else "-", "threads": threads, "step_ms": 1e3 * step, "rss": max(rss),
           "params": float(acct[1]), "grads": float(acct[2]), "optimizer": float(acct[3]), "now": None}
    held = re.search(r"rank 0 of \d+ \(ZeRO-3\): weights held at most (\d+) of \d+ bytes.*?gradients at most (\d+)",
                     p.stderr)
    if held:
        res["params"], res["grads"] = int(held[1]) / 2**20, int(held[2]) / 2**20
    now = re.search(r"rank 0 of \d+ \(ZeRO-\d\):.*?resident set ([\d.]+) MiB", p.stderr)
    if now:
        res["now"] = float(now[1])
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kiln", default="build/kiln")
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--data", required=True)
    ap.add_argument("--config", default="small")
    ap.add_argument("--storage", default="bf16_master")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--ranks", default="1,2,4")
    ap.add_argument("--cores", type=int, default=os.cpu_count())
    ap.add_argument("--zero", default="2,3", help="ZeRO stages to run with more than one rank")
    args = ap.parse_args()
    res = []
    with tempfile.TemporaryDirectory() as tmp:
        for n in map(int, args.ranks.split(",")):
            for zero in map(int, args.zero.split(",")) if n > 1 else [3]:
                res.append(run(args, n, zero, Path(tmp) / f"np{n}_{zero}"))
    print(f"\nkiln train --config {args.config} --storage {args.storage}, global batch {args.batch} x {args.seq} "
          f"tokens, {args.cores} cores")
    print("| ranks | ZeRO | threads a rank | ms a step (median) | tokens/s | peak RSS a rank (MiB) | rank 0's RSS "
          "at the end | params | grads | optimizer (MiB, kiln's accounting, rank 0) |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in res:
        now = f"{r['now']:.0f}" if r["now"] is not None else "-"
        print(f"| {r['ranks']} | {r['zero']} | {r['threads']} | {r['step_ms']:.0f} | "
              f"{args.batch * args.seq / r['step_ms'] * 1e3:.0f} | {r['rss']:.0f} | {now} | {r['params']:.1f} | "
              f"{r['grads']:.1f} | {r['optimizer']:.1f} |")


if __name__ == "__main__":
    main()
