#!/usr/bin/env python3
"""ncu_kernel_times.py -- where a decode step's time goes, kernel by kernel, from Nsight
Compute's per-launch durations.

  KILN_CUDA_GRAPHS=0 ncu --clock-control none --metrics gpu__time_duration.sum,dram__bytes_read.sum --csv \\
      --print-units base kiln generate -m MODEL -p PROMPT -n 9 --temp 0 --ignore-eos \\
      --device cuda --fast > times.csv
  python3 bench/ncu_kernel_times.py times.csv [--step-kernel sampler_main] [--skip-steps 1] [--by-grid]
      [--whole: every launch counts as one step, for a training step or a prefill]

Every launch's gpu__time_duration (the kernel alone, launches serialised by ncu: no overlap
and no launch gaps, so the sum is a lower bound of a step's time). A "step" starts after each
launch of --step-kernel (the sampler: one per generated token); the first --skip-steps steps
(the prompt's forward) are left out. Prints, per kernel name (template arguments cut), the
launches per step, microseconds per step and per launch, and the share; then the total per
step and the launches per step. With dram__bytes_read.sum among the metrics, also the bytes each
kernel read from DRAM per step and their rate over its time (bytes moved against time).
"""
import argparse
import collections
import csv
import re
import sys


def short(name):
    name = re.sub(r"\(.*$", "", name)  # arguments
    depth, out = 0, []
    for ch in name:  # template arguments
        if ch == "<":
            depth += 1
        elif ch == ">":
            depth -= 1
        elif depth == 0:
            out.append(ch)
    return "".join(out).replace("void ", "").strip()


BY_GRID = False  # --by-grid: one row per (kernel, grid), e.g. the products of each shape


def launches(path):
    """(kernel name, nanoseconds, DRAM bytes read or None) per launch, in launch order."""
    by_id = {}
    with open(path, newline="") as f:
        lines = [l for l in f if l.startswith('"')]  # ncu's own log lines are not CSV
    for r in csv.DictReader(lines):
        name = r.get("Metric Name")
        if name not in ("gpu__time_duration.sum", "dram__bytes_read.sum"):
            continue
        v = float(r["Metric Value"].replace(",", ""))
        unit = r.get("Metric Unit", "")
        if name == "gpu__time_duration.sum":
            v *= {"nsecond": 1.0, "usecond": 1e3, "msecond": 1e6, "second": 1e9}.get(unit or "nsecond", 1.0)
        else:
            v *= {"byte": 1.0, "Kbyte": 1e3, "Mbyte": 1e6, "Gbyte": 1e9}.get(unit or "byte", 1.0)
        name_k = short(r["Kernel Name"])
        if BY_GRID:
            name_k += " " + r.get("Grid Size", "").replace(" ", "")
        e = by_id.setdefault(int(r["ID"]), [name_k, None, None])
        e[1 if name == "gpu__time_duration.sum" else 2] = v
    return [(n, t, b) for _, (n, t, b) in sorted(by_id.items()) if t is not None]


def split_steps(ls, step_kernel):
    """The launches cut into steps, each ending with a launch of step_kernel (a tail after the
    last one is dropped)."""
    steps, cur = [], []
    for n, t, b in ls:
        cur.append((n, t, b))
        if step_kernel in n:
            steps.append(cur)
            cur = []
    return steps


def per_kernel(steps):
    """{kernel: [launches, ns, DRAM bytes]} summed over the steps, and the step count."""
    per = collections.defaultdict(lambda: [0, 0.0, 0.0])
    for s in steps:
        for n, t, b in s:
            per[n][0] += 1
            per[n][1] += t
            per[n][2] += b or 0.0
    return per, len(steps)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("csv")
    ap.add_argument("--step-kernel", default="sampler_main")
    ap.add_argument("--skip-steps", type=int, default=1)
    ap.add_argument("--by-grid", action="store_true", help="a row per (kernel, grid size)")
    ap.add_argument("--whole", action="store_true",
                    help="every launch as one step (a training step, a prefill: no sampler to cut at)")
    args = ap.parse_args()
    global BY_GRID
    BY_GRID = args.by_grid
    ls = launches(args.csv)
    if not ls:
        sys.exit(f"{args.csv}: no gpu__time_duration.sum rows")
    steps = [ls] if args.whole else split_steps(ls, args.step_kernel)[args.skip_steps:]
    if not steps:
        sys.exit(f"no step after {args.skip_steps} skipped (step kernel '{args.step_kernel}' "
                 f"launched {sum(args.step_kernel in n for n, _, _ in ls)} times)")
    per, k = per_kernel(steps)
    total = sum(v[1] for v in per.values()) / k
    nbytes = sum(v[2] for v in per.values()) / k
    has_bytes = nbytes > 0
    print(f"{len(steps)} steps; per step: {total / 1e3:.1f} us in "
          f"{sum(v[0] for v in per.values()) / k:.0f} launches" +
          (f", {nbytes / 1e6:.1f} MB read from DRAM ({nbytes / total:.0f} GB/s over the kernels' time)"
           if has_bytes else ""))
    print("| kernel | launches/step | us/step | us/launch | share |" + (" MB/step | GB/s |" if has_bytes else ""))
    print("|---|---:|---:|---:|---:|" + ("---:|---:|" if has_bytes else ""))
    for n, (c, t, b) in sorted(per.items(), key=lambda kv: -kv[1][1]):
        row = f"| {n} | {c / k:.1f} | {t / k / 1e3:.1f} | {t / c / 1e3:.2f} | {100 * t / k / total:.1f}% |"
        if has_bytes:
            row += f" {b / k / 1e6:.2f} | {b / t:.0f} |"
        print(row)


if __name__ == "__main__":
    main()
