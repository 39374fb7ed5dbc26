"""Gemma 3 in kiln (src/models/gemma3.c) against transformers' Gemma3ForCausalLM.

  * A tiny random Gemma 3 (scripts/make_tiny_gemma3.py: sliding window 8, a full layer among
    sliding ones, query_pre_attn_scalar != head_dim) read from its Hugging Face folder: logits
    within 1e-4 of transformers' float64 forward on prompts longer than the window and across
    a 64-key block, cached decode bit-identical to the full forward, thread-count invariance,
    greedy continuations identical (test_parity.check_model's checks).
  * The real Gemma 3 270M Q4_K_M GGUF (scripts/fetch-gemma3.sh): greedy continuations equal
    transformers' reading the same file (dequantized to float32), for several prompts, one of
    them longer than the 512-position window. Skipped without the file.
"""
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import kiln
from test_gemma3_tokenizer import gemma3_path  # noqa: F401  (the fixture)
from test_parity import check_model, hf_greedy

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("gemma3_model") / "tiny"
    subprocess.run([sys.executable, str(REPO / "scripts" / "make_tiny_gemma3.py"), str(d), "--seed", "5"],
                   check=True, capture_output=True)
    ref = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float64, attn_implementation="eager")
    ref.eval()
    return d, ref


def test_tiny_parity(tiny, build_dir):
    d, ref = tiny
    check_model(d, ref, "gemma3 tiny")


def test_tiny_long_prompt(tiny, build_dir):
    """130 tokens (window 8, key blocks of 64): every position's logits, prefilled in chunks of
    48 and then decoded token by token, against transformers."""
    d, ref = tiny
    m = kiln.Model(d)
    rng = np.random.default_rng(1)
    ids = [2] + [int(x) for x in rng.integers(7, 500, size=129)]
    ctx = kiln.Context(m, n_ctx=256, n_batch=48, n_threads=2)
    got = ctx.decode(ids[:100], all_logits=True)
    rows = [got] + [ctx.decode([t], all_logits=True) for t in ids[100:]]
    got = np.concatenate(rows).astype(np.float64)
    with torch.no_grad():
        want = ref(torch.tensor([ids])).logits[0].numpy()
    rel = float(np.abs(got - want).max() / max(1.0, float(np.abs(want).max())))
    assert rel <= 1e-4, f"logits differ: relative {rel:.3e}"
    ctx.close()
    m.close()


def test_tiny_training_refused(tiny, build_dir):
    d, _ = tiny
    m = kiln.Model(d)
    with pytest.raises(kiln.KilnError, match="training gemma3 models is not implemented"):
        kiln.Trainer(m, max_seq=16)
    m.close()


PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village by the sea,",
]


@pytest.fixture(scope="module")
def real(gemma3_path):
    p = Path(gemma3_path)
    ref = transformers.AutoModelForCausalLM.from_pretrained(p.parent, gguf_file=p.name, dtype=torch.float32)
    ref.eval()
    return p, ref


def test_real_gguf_greedy(real, build_dir):
    path, ref = real
    m = kiln.Model(str(path))
    long_text = " ".join(f"Item {i}: the {['red', 'green', 'blue'][i % 3]} box holds {i * 7} marbles." for i in range(60))
    long_prompt = long_text + " In total, the boxes"
    cases = [(p, 12) for p in PROMPTS] + [(long_prompt, 6)]
    for text, n in cases:
        ids = m.tokenizer.encode(text)
        ctx = kiln.Context(m, n_ctx=1024, n_threads=2)
        res = ctx.generate(ids, max_tokens=n, temperature=0.0, ignore_eos=True)
        want = hf_greedy(ref, ids, n)
        assert res["ids"] == want, f"{len(ids)}-token prompt {text[:40]!r}: kiln {res['ids']} vs transformers {want}"
        if text == long_prompt:
            assert len(ids) > 512, "the long prompt must cross the sliding window"
        ctx.close()
    m.close()
