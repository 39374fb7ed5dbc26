"""Fast mode (kiln_context_params.fast_q8_activations: 8-bit activations for quantized weights
during decode; docs/ARITHMETIC.md, "Fast mode: 8-bit activations") on the default model,
SmolLM2-135M-Instruct Q4_1, against the exact path.

Decode runs one token at a time (N = 1, the int8 path) in both modes; prompts are also fed one
token at a time so every logit row comes from the fast path. Printed: max abs / relative error
of the logits, top-1 agreement at every position and at the last one, and how many of 32
greedy tokens agree (informational: one flipped near-tie changes the rest of a continuation).
Measured: max |error| up to 0.069 x max|logit| (about 1-1.7 in logits of magnitude ~30),
relative L2 0.01-0.05, top-1 51/53 positions, greedy prefixes of [5, 0, 5, 21, 4] tokens.
Bounds (with margin): max |error| <= 8e-2 * max|logit| at each prompt's last position, top-1 equal at >= 4 of 5 last positions, >= 90% of all positions.
"""
import ctypes as C

import numpy as np
import pytest

import kiln

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village by the sea,",
    "Water boils at 100 degrees Celsius. At what temperature does it freeze?",
    "日本の首都は",
]


def make_context(model, fast, n_ctx=256, n_threads=2):
    """A kiln.Context created with fast_q8_activations set (Context() has no such argument)."""
    lib = kiln.load_library()
    p = lib.kiln_context_default_params()
    assert p.fast_q8_activations == 0  # the default is the exact path
    p.n_ctx, p.n_threads, p.fast_q8_activations = n_ctx, n_threads, int(fast)
    h = C.c_void_p()
    assert lib.kiln_context_create(model._h, C.byref(p), C.byref(h)) == 0
    ctx = kiln.Context.__new__(kiln.Context)
    ctx._lib, ctx.model, ctx._h = lib, model, h
    return ctx


@pytest.fixture(scope="module")
def model(smollm2_gguf, build_dir):
    m = kiln.Model(smollm2_gguf)
    yield m
    m.close()


def logits_one_by_one(ctx, ids):
    ctx.truncate(0)
    return np.stack([ctx.decode([t]) for t in ids])


def test_fast_mode_logits_and_greedy(model):
    exact, fast = make_context(model, False), make_context(model, True)
    last_top1, all_top1, all_pos, rel_last = 0, 0, 0, []
    greedy_agree = []
    for prompt in PROMPTS:
        ids = model.tokenizer.encode(prompt)
        le = logits_one_by_one(exact, ids)
        lf = logits_one_by_one(fast, ids)
        err = np.abs(lf.astype(np.float64) - le)
        scale = np.abs(le).max(axis=1)
        rel = err.max(axis=1) / np.maximum(scale, 1.0)
        rel_l2 = np.linalg.norm(lf - le, axis=1) / np.linalg.norm(le, axis=1)
        top_e, top_f = le.argmax(axis=1), lf.argmax(axis=1)
        last_top1 += int(top_e[-1] == top_f[-1])
        all_top1 += int((top_e == top_f).sum())
        all_pos += len(ids)
        rel_last.append(rel[-1])
        exact.truncate(0)
        fast.truncate(0)
        ge = exact.generate(ids, max_tokens=32, ignore_eos=True)["ids"]
        gf = fast.generate(ids, max_tokens=32, ignore_eos=True)["ids"]
        same = 0
        for a, b in zip(ge, gf):
            if a != b:
                break
            same += 1
        greedy_agree.append(same)
        print(f"\n  {prompt[:40]!r}: {len(ids)} positions, max abs err {err.max():.4f} "
              f"(max |logit| {scale.max():.2f}), max rel {rel.max():.4f}, rel L2 last "
              f"{rel_l2[-1]:.4f}, top-1 {int((top_e == top_f).sum())}/{len(ids)}, "
              f"greedy prefix agreeing {same}/32")
    print(f"  top-1 at last positions {last_top1}/5, all positions {all_top1}/{all_pos}, "
          f"greedy agreeing prefix {greedy_agree}")
    print(f"  max |error| / max|logit| at last positions: {max(rel_last):.4f}")
    assert max(rel_last) <= 8e-2
    assert last_top1 >= 4
    assert all_top1 >= 0.9 * all_pos
    exact.close()
    fast.close()


def test_fast_mode_thread_invariant(model):
    ids = model.tokenizer.encode(PROMPTS[2])
    outs = []
    for th in (1, 2, 3):
        ctx = make_context(model, True, n_threads=th)
        outs.append(logits_one_by_one(ctx, ids))
        ctx.close()
    assert np.array_equal(outs[0].view(np.uint32), outs[1].view(np.uint32))
    assert np.array_equal(outs[0].view(np.uint32), outs[2].view(np.uint32))
