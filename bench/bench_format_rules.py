#!/usr/bin/env python3
"""Formats per weight against transformers in float64: the max normalised logit error
(max |logit - float64| / max(1, max |logit|) over every position of 5 prompts) of the default
model with each role moved from the base format to the other (mx8 <-> mx16), and of the specs
given on the command line (docs/ARITHMETIC.md, "Formats per weight").

    python bench/bench_format_rules.py [-m GGUF] [SPEC ...]

Needs a built kiln (KILN_BUILD_DIR or ./build) and transformers with gguf."""
import argparse
import os
import sys
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "python"))
sys.path.insert(0, str(REPO / "tests" / "python"))
import kiln  # noqa: E402
from test_smollm2 import PROMPTS  # noqa: E402 (the 5 prompts the oracle tests use)

ROLES = ["attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down", "output",
         "blk.0-3", "blk.26-29"]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("-m", "--model", default=os.environ.get(
        "KILN_SMOLLM2_GGUF", str(Path.home() / ".cache/kiln/models/SmolLM2-135M-Instruct.Q4_1.gguf")))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("specs", nargs="*", help="more --format specs to measure")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    from transformers import AutoModelForCausalLM
    p = Path(a.model)
    hf = AutoModelForCausalLM.from_pretrained(str(p.parent), gguf_file=p.name, dtype=torch.float32)
    hf = hf.to(torch.float64).eval()
    m = kiln.Model(a.model)
    refs = []
    for prompt in PROMPTS:
        ids = m.tokenizer.encode(prompt)
        with torch.no_grad():
            refs.append((ids, hf(torch.tensor([ids])).logits[0].numpy()))

    def err(spec):
        worst = 0.0
        for ids, ref in refs:
            with kiln.Context(m, n_ctx=256, n_threads=a.threads, format=spec) as ctx:
                got = ctx.decode(ids, all_logits=True).astype(np.float64)
            e = np.abs(got - ref).max(axis=1) / np.maximum(1.0, np.abs(ref).max(axis=1))
            worst = max(worst, float(e.max()))
        return worst

    print("| role | mx8, the role in mx16 | mx16, the role in mx8 |")
    print("|---|---:|---:|")
    print(f"| (none) | {err('mx8'):.3e} | {err('mx16'):.3e} |", flush=True)
    for r in ROLES:
        print(f"| {r} | {err(f'mx8,{r}=mx16'):.3e} | {err(f'mx16,{r}=mx8'):.3e} |", flush=True)
    for s in a.specs:
        print(f"| `{s}` | {err(s):.3e} | |", flush=True)
    m.close()


if __name__ == "__main__":
    main()
