#!/usr/bin/env python3
"""ncu_sass_report.py -- where a kernel's time goes, instruction by instruction, from Nsight
Compute's source page: stall reasons, loops, hot instructions and the opcode mix.

  ncu --clock-control none --set full -k regex:NAME -o rep PROGRAM ...
  ncu -i rep.ncu-rep --page source --csv --print-source sass > sass.csv
  python3 bench/ncu_sass_report.py sass.csv [--kernel REGEX] [--top 12]

For each kernel in the CSV (or those whose name matches --kernel):
  - the warp-state samples and the executed warp instructions in all;
  - the stall reasons, as shares of the samples;
  - regions: runs of consecutive instructions that executed the same number of times. A loop
    body shows as a region whose count is (trips x warps); a block's prologue and epilogue as
    regions at the block count. Each with its instructions, count and share of the samples;
  - the instructions with the most samples, with their largest stall reason;
  - the opcode mix: each opcode's share of the samples and of the executed instructions.
(This is how the attention backward's dk/dv loop was found reading L and D through generic
64-bit loads: docs/CUDA.md, "The wgmma tiles' addressing".)
"""
import argparse
import collections
import csv
import re
import sys

SAMPLES = "Warp Stall Sampling (All Samples)"
EXECUTED = "Instructions Executed"


def parse(lines):
    """The kernels of an ncu source-page CSV: a list of (name, header, rows)."""
    kernels, cur = [], None
    for row in csv.reader(lines):
        if not row:
            continue
        if row[0] == "Kernel Name":
            cur = [row[1] if len(row) > 1 else "?", None, []]
            kernels.append(cur)
        elif cur is not None and row[0] == "Address":
            cur[1] = {h: i for i, h in enumerate(row)}
        elif cur is not None and cur[1] is not None:
            cur[2].append(row)
    return [(n, h, r) for n, h, r in kernels if h is not None]


def _int(s):
    try:
        return int(float(s.replace(",", "")))
    except (ValueError, AttributeError):
        return 0


def opcode(source):
    """The opcode of a SASS line without its predicate and modifiers: '@!P0 FFMA.FTZ ..' -> FFMA."""
    words = source.split()
    if words and words[0].startswith("@"):
        words = words[1:]
    return words[0].split(".")[0] if words else "?"


def analyse(header, rows, top=12, min_region=5):
    """The report's figures for one kernel, as a dict (see the module's docstring)."""
    si, ei, src = header[SAMPLES], header[EXECUTED], header["Source"]
    stall_cols = [h for h in header if h.startswith("stall_") and "Not Issued" not in h]
    samples = [_int(r[si]) for r in rows]
    executed = [_int(r[ei]) for r in rows]
    total_s, total_e = sum(samples), sum(executed)
    stalls = collections.Counter()
    for r in rows:
        for h in stall_cols:
            stalls[h[len("stall_"):]] += _int(r[header[h]])
    regions, start = [], 0
    for i in range(1, len(rows) + 1):
        if i == len(rows) or executed[i] != executed[start]:
            s = sum(samples[start:i])
            if i - start >= min_region or (total_s and s >= 0.01 * total_s):
                regions.append({"first": start, "last": i - 1, "count": executed[start],
                                "instructions": i - start, "samples": s})
            start = i
    hot = []
    for i in sorted(range(len(rows)), key=lambda i: -samples[i])[:top]:
        reason = max(stall_cols, key=lambda h: _int(rows[i][header[h]]), default=None)
        hot.append({"index": i, "source": rows[i][src].strip(), "samples": samples[i],
                    "executed": executed[i],
                    "reason": reason[len("stall_"):] if reason else "-"})
    mix_s, mix_e = collections.Counter(), collections.Counter()
    for r, s, e in zip(rows, samples, executed):
        op = opcode(r[src])
        mix_s[op] += s
        mix_e[op] += e
    return {"samples": total_s, "executed": total_e, "instructions": len(rows),
            "stalls": stalls, "regions": regions, "hot": hot, "mix_samples": mix_s,
            "mix_executed": mix_e}


def share(part, whole):
    return 100.0 * part / whole if whole else 0.0


def report(name, a, top=12, out=sys.stdout):
    w = out.write
    w(f"== {name}\n")
    w(f"  {a['instructions']} SASS instructions, {a['executed']} warp instructions executed, "
      f"{a['samples']} samples\n")
    w("  stalls: " + ", ".join(f"{k} {share(v, a['samples']):.1f}%"
                               for k, v in a["stalls"].most_common(8) if v) + "\n")
    w("  regions (consecutive instructions executed equally often):\n")
    for r in a["regions"]:
        w(f"    {r['first']:5d}-{r['last']:5d}  x{r['count']:<10d} {r['instructions']:5d} instr  "
          f"{share(r['samples'], a['samples']):5.1f}% of samples\n")
    w("  hottest instructions:\n")
    for h in a["hot"][:top]:
        w(f"    {h['index']:5d} {share(h['samples'], a['samples']):5.1f}% ({h['reason']}) "
          f"x{h['executed']}  {h['source'][:70]}\n")
    w("  opcodes (share of samples / of executed instructions):\n")
    for op, s in a["mix_samples"].most_common(top):
        w(f"    {op:12s} {share(s, a['samples']):5.1f}%  "
          f"{share(a['mix_executed'][op], a['executed']):5.1f}%\n")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("csv", help="ncu -i REP --page source --csv --print-source sass > CSV")
    ap.add_argument("--kernel", default="", help="only kernels whose name matches this regex")
    ap.add_argument("--top", type=int, default=12)
    args = ap.parse_args(argv)
    with open(args.csv, newline="") as f:
        kernels = parse(f)
    picked = [k for k in kernels if re.search(args.kernel, k[0])]
    if not picked:
        sys.exit(f"ncu_sass_report: no kernel{' matching ' + args.kernel if args.kernel else ''} "
                 f"in {args.csv} (is it ncu's source page with --print-source sass?)")
    for name, header, rows in picked:
        report(name, analyse(header, rows, args.top), args.top)


if __name__ == "__main__":
    main()
