"""The exact block formats as an arithmetic of the whole model (kiln_context_params.format,
`kiln generate --format`, docs/ARITHMETIC.md "Exact block formats"): every matmul of the default
model, SmolLM2-135M-Instruct Q4_1, in mx16 or mx8 on the CPU, against transformers loading the
same GGUF in float64 (as test_smollm2.py), and the f32 auditable path.

Measured (5 prompts, every position): max |logit - float64| / max(1, max|logit|) at a position:
f32 2.9e-6, mx16 3.0e-3, mx8 0.11; top-1 equal to float64's at every position for mx16, 86-100%
for mx8. Bounds (with margin): mx16 <= 6e-3 and top-1 at >= 95% of the positions; mx8 <= 0.2
and >= 75%. The per-product exactness (every bit against an exact integer oracle) is
test_mx.py's; here: the format reaches every product of the model (mx16 is not f32's bits, mx8
is not mx16's), the bits do not depend on the thread count, the settings that cannot go with a
format are refused, and a receipt made in a format verifies.
"""
import json
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

import kiln

torch.set_num_threads(2)

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village by the sea,",
    "Water boils at 100 degrees Celsius. At what temperature does it freeze?",
    "日本の首都は",
]
BOUND = {"mx16": (6e-3, 0.95), "mx8": (0.2, 0.75)}


@pytest.fixture(scope="module")
def model(smollm2_gguf, build_dir):
    m = kiln.Model(smollm2_gguf)
    yield m
    m.close()


@pytest.fixture(scope="module")
def hf_model(smollm2_gguf):
    from transformers import AutoModelForCausalLM
    p = Path(smollm2_gguf)
    m = AutoModelForCausalLM.from_pretrained(str(p.parent), gguf_file=p.name, dtype=torch.float32)
    return m.to(torch.float64).eval()


def logits(model, fmt, ids, n_threads=2):
    with kiln.Context(model, n_ctx=256, n_threads=n_threads, format=fmt) as ctx:
        return ctx.decode(ids, all_logits=True)


@pytest.mark.parametrize("fmt", ["mx16", "mx8"])
def test_format_against_float64(model, hf_model, fmt):
    bound, top1_share = BOUND[fmt]
    worst, agree, total = 0.0, 0, 0
    for prompt in PROMPTS:
        ids = model.tokenizer.encode(prompt)
        with torch.no_grad():
            ref = hf_model(torch.tensor([ids])).logits[0].numpy()
        got = logits(model, fmt, ids).astype(np.float64)
        f32 = logits(model, "f32", ids)
        # the format reaches the products: not the f32 path's bits
        assert not np.array_equal(got.astype(np.float32), f32), f"{fmt} gave f32's bits: the format is not used"
        err = np.abs(got - ref).max(axis=1) / np.maximum(1.0, np.abs(ref).max(axis=1))
        worst = max(worst, float(err.max()))
        agree += int((got.argmax(1) == ref.argmax(1)).sum())
        total += len(ids)
    print(f"{fmt}: max normalised logit error {worst:.2e}, top-1 {agree}/{total}")
    assert worst <= bound, f"{fmt}: max normalised error {worst:.3e} > {bound}"
    assert agree >= top1_share * total, f"{fmt}: top-1 agrees at {agree}/{total} positions"


def test_formats_differ_and_thread_count_free(model):
    ids = model.tokenizer.encode(PROMPTS[2])
    a = logits(model, "mx16", ids, n_threads=1)
    b = logits(model, "mx16", ids, n_threads=2)
    assert np.array_equal(a.view(np.uint32), b.view(np.uint32)), "mx16 logits depend on the thread count"
    c = logits(model, "mx8", ids, n_threads=1)
    d = logits(model, "mx8", ids, n_threads=2)
    assert np.array_equal(c.view(np.uint32), d.view(np.uint32)), "mx8 logits depend on the thread count"
    assert not np.array_equal(a, c), "mx8 gave mx16's bits"


def test_format_refusals(model):
    with pytest.raises(ValueError, match="format"):
        kiln.Context(model, format="mx4")
    with pytest.raises(kiln.KilnError, match="not with fast"):
        kiln.Context(model, format="mx16", fast=True)
    # the formats run on CUDA too (tests/gpu/test_cuda_model.c): without a GPU the context is
    # refused for want of CUDA, not for the format
    try:
        kiln.Context(model, format="mx8", device=0).close()
    except kiln.KilnError as e:
        assert "CUDA" in str(e) and "format" not in str(e), str(e)


def run(build_dir, *args):
    return subprocess.run([str(Path(build_dir) / "kiln"), *args], capture_output=True, text=True, timeout=600)


def test_cli_format_and_receipt(smollm2_gguf, build_dir, tmp_path):
    rc = tmp_path / "r.json"
    r = run(build_dir, "generate", "-m", smollm2_gguf, "-p", "The capital of France is", "-n", "8", "--temp", "0",
            "--format", "mx8", "--threads", "2", "--receipt", str(rc), "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    receipt = json.loads(rc.read_text())
    assert receipt["arithmetic"]["format"] == "mx8"
    v = run(build_dir, "verify", str(rc), "-m", smollm2_gguf, "--threads", "1")
    assert v.returncode == 0, v.stdout + v.stderr
    assert "identical" in (v.stdout + v.stderr).lower()
    # the same prompt in f32 is another arithmetic: its receipt's ids need not match, and
    # a receipt whose format is changed no longer verifies (the logits chain differs)
    receipt["arithmetic"]["format"] = "mx16"
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(receipt))
    v2 = run(build_dir, "verify", str(bad), "-m", smollm2_gguf, "--threads", "1")
    assert v2.returncode != 0, "a receipt verified under another format"
    assert out["ids"], "no tokens generated"
    u = run(build_dir, "generate", "-m", smollm2_gguf, "-p", "x", "--format", "mx4")
    assert u.returncode == 2 and "--format" in u.stderr
