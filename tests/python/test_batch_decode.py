"""Batched decode: kiln_decode_batch runs one token of each of B sequences in one forward, and
every row must carry the bits that sequence gets when decoded alone (the auditable arithmetic
is per row), so a request's tokens never depend on the rest of the batch. Checked on the CPU
here and, where a GPU is present, on CUDA (auditable) too: the same bits as the CPU.
"""
import numpy as np
import pytest

import kiln
from test_parity import build_model

PROMPTS = [[3, 7, 11, 19, 23], [5, 2], [40, 41, 42, 43, 44, 45, 46, 47, 48]]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, build_dir):
    d, _ = build_model(tmp_path_factory.mktemp("batch"), "qwen2")
    return d


def alone(m, prompt, steps, device=-1):
    """Logits of each step of one sequence decoded alone, token by token."""
    c = kiln.Context(m, n_ctx=64, n_threads=1, device=device)
    last = c.decode(prompt)
    rows, tok = [], []
    for s in range(steps):
        t = int(np.argmax(last))
        tok.append(t)
        last = c.decode([t])
        rows.append(last.copy())
    return tok, rows


def batched(m, steps, device=-1):
    c = kiln.Context(m, n_ctx=64, n_threads=2, device=device, n_seq=len(PROMPTS) + 1)
    last = [c.decode_seq(i, p) for i, p in enumerate(PROMPTS)]
    rows = [[] for _ in PROMPTS]
    for s in range(steps):
        ids = [int(np.argmax(x)) for x in last]
        out = c.decode_batch(ids)
        for i in range(len(PROMPTS)):
            rows[i].append(out[i].copy())
        last = list(out)
    for i, p in enumerate(PROMPTS):
        assert c.seq_n_past(i) == len(p) + steps
    return rows


def test_batch_rows_equal_alone(tiny):
    m = kiln.Model(tiny)
    rows = batched(m, 4)
    for i, p in enumerate(PROMPTS):
        _, ref = alone(m, p, 4)
        for s in range(4):
            assert rows[i][s].tobytes() == ref[s].tobytes(), (i, s)


def test_batch_errors(tiny):
    m = kiln.Model(tiny)
    c = kiln.Context(m, n_ctx=8, n_seq=2)
    with pytest.raises(kiln.KilnError):
        c.decode_batch([1, 2, 3])  # B > n_seq
    with pytest.raises(kiln.KilnError):
        c.decode_batch([1, 10 ** 6])  # id out of range
    assert c.seq_n_past(0) == 0 and c.seq_n_past(1) == 0  # nothing advanced
    with pytest.raises(kiln.KilnError):
        c.decode_seq(2, [1])  # no such sequence
    c.decode_seq(1, [1] * 8)
    with pytest.raises(kiln.KilnError):
        c.decode_batch([1, 2])  # sequence 1 is full
    assert c.seq_n_past(0) == 0


def test_batch_cuda_equals_cpu(tiny):
    m = kiln.Model(tiny)
    try:
        kiln.Context(m, n_ctx=8, device=0)
    except kiln.KilnError:
        pytest.skip("no usable CUDA device")
    cpu = batched(m, 4)
    gpu = batched(m, 4, device=0)
    for i in range(len(PROMPTS)):
        for s in range(4):
            assert gpu[i][s].tobytes() == cpu[i][s].tobytes(), (i, s)
