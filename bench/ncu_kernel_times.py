#!/usr/bin/env python3
"""ncu_kernel_times.py -- where a decode step's time goes, kernel by kernel, from Nsight
Compute's per-launch durations.

  KILN_CUDA_GRAPHS=0 ncu --clock-control none --metrics gpu__time_duration.sum --csv \\
      --print-units base kiln generate -m MODEL -p PROMPT -n 9 --temp 0 --ignore-eos \\
      --device cuda --fast > times.csv
  python3 bench/ncu_kernel_times.py times.csv [--step-kernel sampler_main] [--skip-steps 1]

Every launch's gpu__time_duration (the kernel alone, launches serialised by ncu: no overlap
and no launch gaps, so the sum is a lower bound of a step's time). A "step" starts after each
launch of --step-kernel (the sampler: one per generated token); the first --skip-steps steps
(the prompt's forward) are left out. Prints, per kernel name (template arguments cut), the
launches per step, microseconds per step and per launch, and the share; then the total per
step and the launches per step.
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


def launches(path):
    """(kernel name, nanoseconds) per launch, in launch order."""
    rows = []
    with open(path, newline="") as f:
        lines = [l for l in f if l.startswith('"')]  # ncu's own log lines are not CSV
    for r in csv.DictReader(lines):
        if r.get("Metric Name") != "gpu__time_duration.sum":
            continue
        v = float(r["Metric Value"].replace(",", ""))
        unit = r.get("Metric Unit", "nsecond")
        scale = {"nsecond": 1.0, "usecond": 1e3, "msecond": 1e6, "second": 1e9}.get(unit, 1.0)
        rows.append((int(r["ID"]), short(r["Kernel Name"]), v * scale))
    rows.sort()
    return [(n, t) for _, n, t in rows]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("csv")
    ap.add_argument("--step-kernel", default="sampler_main")
    ap.add_argument("--skip-steps", type=int, default=1)
    args = ap.parse_args()
    ls = launches(args.csv)
    if not ls:
        sys.exit(f"{args.csv}: no gpu__time_duration.sum rows")
    steps, cur = [], []
    for n, t in ls:
        cur.append((n, t))
        if args.step_kernel in n:
            steps.append(cur)
            cur = []
    steps = steps[args.skip_steps:]
    if not steps:
        sys.exit(f"no step after {args.skip_steps} skipped (step kernel '{args.step_kernel}' "
                 f"launched {sum(args.step_kernel in n for n, _ in ls)} times)")
    per = collections.defaultdict(lambda: [0, 0.0])
    for s in steps:
        for n, t in s:
            per[n][0] += 1
            per[n][1] += t
    k = len(steps)
    total = sum(v[1] for v in per.values()) / k
    print(f"{len(steps)} steps; per step: {total / 1e3:.1f} us in "
          f"{sum(v[0] for v in per.values()) / k:.0f} launches")
    print(f"| kernel | launches/step | us/step | us/launch | share |")
    print(f"|---|---:|---:|---:|---:|")
    for n, (c, t) in sorted(per.items(), key=lambda kv: -kv[1][1]):
        print(f"| {n} | {c / k:.1f} | {t / k / 1e3:.1f} | {t / c / 1e3:.2f} | {100 * t / k / total:.1f}% |")


if __name__ == "__main__":
    main()
