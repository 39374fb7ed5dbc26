#!/usr/bin/env python3
"""Seconds per CPU training step of kiln on the default model (SmolLM2-135M-Instruct): random
tokens, forward + loss + backward + clip + AdamW, printed per step. For comparing two kiln
builds against each other, alternating them (KILN_LIB selects the library):

    KILN_LIB=old/libkiln.so python bench/train_step_time.py; KILN_LIB=new/libkiln.so python ...

    python bench/train_step_time.py [--seq 256] [--threads 2] [--steps 4]
"""
import argparse
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "python"))

import numpy as np  # noqa: E402

import kiln  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=4)
    a = ap.parse_args()
    gguf = subprocess.run(["bash", str(REPO / "scripts/fetch-model.sh")], capture_output=True, text=True,
                          check=True).stdout.strip()
    m = kiln.Model(gguf)
    tr = kiln.Trainer(m, max_seq=a.seq, n_threads=a.threads, lr=1e-4, weight_decay=0.1)
    rng = np.random.default_rng(0)
    times = []
    for _ in range(a.steps):
        ids = rng.integers(0, 49152, a.seq).astype(np.int32)
        t0 = time.perf_counter()
        tr.step(ids)
        tr.clip_grads(1.0)
        tr.optimizer_step(1e-4)
        times.append(time.perf_counter() - t0)
    print(" ".join(f"{t:.2f}" for t in times), "s per step (the first includes warm-up)")
    tr.close()
    m.close()


if __name__ == "__main__":
    main()
