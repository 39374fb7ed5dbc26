#!/usr/bin/env python3
"""Fail when ptxas serializes the wgmma products of a kiln kernel.

ptxas does not refuse a Hopper kernel whose asynchronous wgmma products it cannot keep in flight:
it makes every product wait for itself (each HGMMA gets its own gsb0 wait in the SASS) and says so
only as an "info" line under -Xptxas -v:

    (C7510) ... serialized due to wgmma pipeline crossing function boundary ...
    (C7514) ... serialized due to non wgmma instructions reading accumulator registers ...
    (C7515) ... serialized due to non wgmma instructions defining accumulator registers ...

The build prints none of that, so a change to an attention kernel can quietly cost it its overlap
(docs/CUDA.md, "A check that ptxas keeps the wgmma products pipelined"). This check recompiles, for sm_90a alone and with -Xptxas -v, every
CUDA source of kiln that includes cuda_wgmma.cuh, with the build's own flags (the build directory's
compile_commands.json), and fails naming each kernel ptxas serialized. Injected waits (C7517) are
reported but allowed. First it compiles tests/cuda_checks/wgmma_serialized.cu, a kernel that reads
an accumulator while its product is in flight, and fails unless ptxas reports that one: so the
check cannot pass merely because ptxas reworded its messages.

Usage: check_wgmma_pipelines.py BUILD_DIR. Exit 0: no kernel serialized; 1: some were (or the
planted one was not detected); 77: nothing to check (no CUDA build, no nvcc, no commands).
"""
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile

SERIALIZED = re.compile(r"\((C7510|C7514|C7515)\)[^\n]*?function '([^']+)'")
INJECTED = re.compile(r"\(C7517\)[^\n]*?function '([^']+)'")
ARCH = "--generate-code=arch=compute_90a,code=[sm_90a]"


def sm90a_command(entry, out):
    """The entry's nvcc command for sm_90a alone with ptxas's report, output to out."""
    args = entry.get("arguments") or shlex.split(entry["command"])
    cmd, skip = [], False
    for a in args:
        if skip:
            skip = False
            continue
        if a in ("-o", "-MF", "-MT", "-gencode"):
            skip = True
            continue
        if a.startswith(("--generate-code", "-gencode=", "-arch", "--gpu-architecture")) or a in (
                "-MD", "-MMD"):
            continue
        cmd.append(a)
    return cmd + [ARCH, "-Xptxas", "-v", "-o", out]


def ptxas_report(cmd, cwd):
    try:
        r = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)
    except OSError as e:  # the build's nvcc gone since it configured
        print(f"check_wgmma_pipelines: cannot run {cmd[0]}: {e}; skipped")
        raise SystemExit(77)
    if r.returncode != 0:
        sys.stderr.write(r.stdout + r.stderr)
        raise SystemExit(f"check_wgmma_pipelines: the compile failed: {' '.join(cmd)}")
    return r.stdout + r.stderr


def demangle(names):
    try:
        r = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True)
        return r.stdout.split("\n")[: len(names)] if r.returncode == 0 else names
    except OSError:
        return names


def main():
    if len(sys.argv) != 2:
        raise SystemExit(__doc__)
    build = os.path.abspath(sys.argv[1])
    db = os.path.join(build, "compile_commands.json")
    if not os.path.exists(db):
        print(f"check_wgmma_pipelines: no {db}; skipped")
        return 77
    with open(db) as f:
        entries = json.load(f)
    src_dir = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
    cuda = [e for e in entries if e["file"].endswith(".cu") and "/src/ops/cuda/" in e["file"]]
    wg = []
    for e in cuda:
        with open(e["file"]) as f:
            if "cuda_wgmma.cuh" in f.read():
                wg.append(e)
    if not wg:
        print("check_wgmma_pipelines: no wgmma sources in the build; skipped")
        return 77
    with tempfile.TemporaryDirectory() as tmp:
        # the planted kernel: compiled with the first wgmma source's flags
        planted = dict(wg[0])
        fixture = os.path.abspath(os.path.join(src_dir, "tests/cuda_checks/wgmma_serialized.cu"))
        cmd = sm90a_command(planted, os.path.join(tmp, "planted.o"))
        cmd = [fixture if a == planted["file"] else a for a in cmd]
        if fixture not in cmd:
            print(f"check_wgmma_pipelines: cannot find {planted['file']} in its compile command")
            return 1
        hits = SERIALIZED.findall(ptxas_report(cmd, planted["directory"]))
        if not any("wgmma_serialized_kernel" in name for _, name in hits):
            print("check_wgmma_pipelines: ptxas did not report the planted serialized kernel "
                  "(tests/cuda_checks/wgmma_serialized.cu); its messages may have changed")
            return 1
        bad, injected = [], []
        for e in wg:
            out = os.path.join(tmp, os.path.basename(e["file"]) + ".o")
            text = ptxas_report(sm90a_command(e, out), e["directory"])
            bad += [(os.path.basename(e["file"]), code, name) for code, name in SERIALIZED.findall(text)]
            injected += INJECTED.findall(text)
    names = demangle(sorted(set(injected)))
    for n in names:
        print(f"note: ptxas injected warpgroup waits (C7517) in {n}")
    if bad:
        full = demangle([name for _, _, name in bad])
        for (f, code, _), n in zip(bad, full):
            print(f"SERIALIZED ({code}): {n} in {f}")
        return 1
    print(f"check_wgmma_pipelines: {len(wg)} sources, no serialized wgmma pipelines "
          f"(planted kernel detected)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
