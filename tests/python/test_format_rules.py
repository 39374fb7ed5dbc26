"""Formats per weight (kiln_context_params.format_rules, `--format mx8,output=mx16,...`,
docs/ARITHMETIC.md "Formats per weight"): rules that select weight matrices by GGUF role and
layer, the last match winning, resolved above the backend into a table of the weights' memory.

On the default model (SmolLM2-135M-Instruct Q4_1, its head tied to the embedding):
- rules naming every product's weight give the bits of the whole-model format (an f32 base with
  every role mx16 is mx16's bits; an mx16 base with every role f32 is f32's), so the table
  reaches every product and the head through the tied embedding;
- the last match wins (a later general rule undoes an earlier specific one, bit for bit);
- a mixed spec's logits against transformers in float64 lie between its two formats' (measured
  below, printed);
- thread counts do not change the bits; the refusals name what was wrong; a receipt records the
  whole spec and verifies; training with rules follows the same equalities (tiny llama).
"""
import json

import numpy as np
import pytest
import torch

import kiln
from test_formats import PROMPTS, hf_model, logits, model, run  # noqa: F401 (fixtures)
from test_train_formats import tiny  # noqa: F401 (a fixture)

torch.set_num_threads(2)

ROLES = ["attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down", "output"]


def every(fmt):
    return ",".join(f"{r}={fmt}" for r in ROLES)


def bits(a):
    return np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)


def test_rules_on_every_weight_are_the_whole_format(model):  # noqa: F811
    ids = model.tokenizer.encode(PROMPTS[0])
    mx16, f32 = logits(model, "mx16", ids), logits(model, "f32", ids)
    assert np.array_equal(bits(logits(model, "f32," + every("mx16"), ids)), bits(mx16))
    assert np.array_equal(bits(logits(model, "mx16," + every("f32"), ids)), bits(f32))
    # a layer range and the head: the same weights
    assert np.array_equal(bits(logits(model, "f32,blk.0-29=mx16,output=mx16", ids)), bits(mx16))
    # a spec that starts with a rule has an f32 base
    assert np.array_equal(bits(logits(model, "blk.0-29=mx16,output=mx16", ids)), bits(mx16))


def test_last_match_wins_and_one_layer_is_reached(model):  # noqa: F811
    ids = model.tokenizer.encode(PROMPTS[2])
    mx8 = logits(model, "mx8", ids)
    assert np.array_equal(bits(logits(model, "mx8,blk.3=f32,blk.0-29=mx8", ids)), bits(mx8))
    assert np.array_equal(bits(logits(model, "mx8,blk.3.attn_v=f32,attn_v=mx8", ids)), bits(mx8))
    one = logits(model, "mx8,blk.29.ffn_down=mx16", ids)
    assert not np.array_equal(bits(one), bits(mx8)), "a rule on one layer's weight changed nothing"
    head = logits(model, "mx8,output=mx16", ids)
    assert not np.array_equal(bits(head), bits(mx8)) and not np.array_equal(bits(head), bits(one))


def test_mixed_spec_against_float64(model, hf_model):  # noqa: F811
    spec = "mx8,output=mx16,attn_v=mx16"
    err = {}
    for fmt in ("mx8", spec, "mx16"):
        worst = 0.0
        for prompt in PROMPTS:
            ids = model.tokenizer.encode(prompt)
            with torch.no_grad():
                ref = hf_model(torch.tensor([ids])).logits[0].numpy()
            got = logits(model, fmt, ids).astype(np.float64)
            e = np.abs(got - ref).max(axis=1) / np.maximum(1.0, np.abs(ref).max(axis=1))
            worst = max(worst, float(e.max()))
        err[fmt] = worst
    print("max normalised logit error against float64: " + ", ".join(f"{k}: {v:.3e}" for k, v in err.items()))
    assert err["mx16"] < err[spec] < err["mx8"], err


def test_thread_count_free(model):  # noqa: F811
    ids = model.tokenizer.encode(PROMPTS[1])
    spec = "mx8,output=mx16,blk.0-3=f32"
    assert np.array_equal(bits(logits(model, spec, ids, n_threads=1)), bits(logits(model, spec, ids, n_threads=2)))


def test_refusals(model):  # noqa: F811
    cases = {
        "mx8,attn_z=f32": "selects no weight matrix of this model (its roles: attn_q, attn_k, attn_v, attn_output, "
                          "ffn_gate, ffn_up, ffn_down, output; layers blk.0-29)",
        "mx8,blk.30=f32": "the model has 30 layers",
        "mx8,token_embd=f32": "the embedding is a lookup",
        "mx8,blk.4-2=f32": "A <= B",
        "mx8,output": "is not SELECTOR=FORMAT",
        "mx8,output=mx4": "'mx4' is not f32, mx16 or mx8",
        "mx8,Attn_q=f32": "is not a role name",
    }
    for spec, why in cases.items():
        with pytest.raises(kiln.KilnError, match="format rule") as e:
            kiln.Context(model, format=spec)
        assert why in str(e.value), (spec, str(e.value))
    with pytest.raises(ValueError, match="format 'mx4'"):
        kiln.Context(model, format="mx4,output=f32")
    with pytest.raises(kiln.KilnError, match="not with fast"):
        kiln.Context(model, format="f32,output=mx16", fast=True)
    # CUDA takes the rules too (test_cuda_rules_are_the_cpu_bits): without a GPU the refusal
    # is the device's, not the rules'
    try:
        kiln.Context(model, format="mx8,output=mx16", device=0).close()
    except kiln.KilnError as e:
        assert "CUDA" in str(e) and "format rule" not in str(e), str(e)


def test_cli_spec_and_receipt(smollm2_gguf, build_dir, tmp_path):
    spec = "mx8,output=mx16,blk.0-3.ffn_down=f32"
    rc = tmp_path / "r.json"
    r = run(build_dir, "generate", "-m", smollm2_gguf, "-p", "The capital of France is", "-n", "6", "--temp", "0",
            "--format", spec, "--threads", "2", "--receipt", str(rc))
    assert r.returncode == 0, r.stderr
    receipt = json.loads(rc.read_text())
    assert receipt["arithmetic"]["format"] == spec
    v = run(build_dir, "verify", str(rc), "-m", smollm2_gguf, "--threads", "1")
    assert v.returncode == 0 and "identical" in (v.stdout + v.stderr).lower(), v.stdout + v.stderr
    receipt["arithmetic"]["format"] = "mx8"  # the rules dropped: another arithmetic
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(receipt))
    assert run(build_dir, "verify", str(bad), "-m", smollm2_gguf, "--threads", "1").returncode != 0
    receipt["arithmetic"]["format"] = "mx8,"
    bad.write_text(json.dumps(receipt))
    v = run(build_dir, "verify", str(bad), "-m", smollm2_gguf)
    assert v.returncode != 0 and "arithmetic.format" in v.stderr, v.stderr
    u = run(build_dir, "generate", "-m", smollm2_gguf, "-p", "x", "-n", "1", "--format", "mx8,ffn=f32")
    assert u.returncode != 0 and "format rule 'ffn=f32' selects no weight matrix" in u.stderr, u.stderr


def train_losses(m, fmt, steps=4, rounding="nearest", device=-1):
    tr = kiln.Trainer(m, max_seq=32, n_threads=2, max_batch=2, format=fmt, lr=3e-3, format_rounding=rounding,
                      device=device)
    rng = np.random.default_rng(0)
    out = []
    for s in range(steps):
        ids = rng.integers(3, m.n_vocab, size=(2, 24)).astype(np.int32)
        tg = np.concatenate([ids[:, 1:], -np.ones((2, 1), np.int32)], 1)
        out.append(tr.step_batch(ids, tg))
        tr.optimizer_step(3e-3)
    tr.close()
    return np.array(out, np.float32)


def test_training_with_rules(tiny):  # noqa: F811
    """Forward and backward, the fused loss's head products and the optimizer's refreshed
    copies: rules on every weight train to the whole format's losses bit for bit."""
    _, m = tiny
    mx16, f32 = train_losses(m, "mx16"), train_losses(m, "f32")
    assert np.array_equal(bits(train_losses(m, "f32," + every("mx16"))), bits(mx16))
    assert np.array_equal(bits(train_losses(m, "mx16," + every("f32"))), bits(f32))
    mixed = train_losses(m, "mx16,output=f32")
    assert np.isfinite(mixed).all() and not np.array_equal(bits(mixed), bits(mx16))
    assert not np.array_equal(bits(mixed), bits(f32))
    # stochastic rounding keys the backward's products whichever weights are in a format
    sr = train_losses(m, "f32,attn_v=mx8", rounding="stochastic")
    assert np.isfinite(sr).all() and not np.array_equal(bits(sr), bits(train_losses(m, "f32,attn_v=mx8")))
    with pytest.raises(kiln.KilnError, match="format rule 'blk.9=mx8'"):
        kiln.Trainer(m, max_seq=16, format="f32,blk.9=mx8")


def has_cuda(m):
    try:
        kiln.Context(m, n_ctx=16, device=0).close()
        return True
    except kiln.KilnError:
        return False


# Specs whose calls mix formats within one product call (q/k/v, gate/up: composed), give a
# whole call another format (ffn_gate and ffn_up both mx8: the format's fused products) or an f32
# call inside an exact base, and move the head (tied or not) to another format.
CUDA_SPECS = ["mx8,attn_v=mx16,blk.0=f32,output=mx16", "f32,ffn_up=mx8,attn_q=mx16",
              "mx16,ffn_gate=mx8,ffn_up=mx8,blk.1.attn_k=f32,output=f32"]


def test_cuda_rules_are_the_cpu_bits(tiny):  # noqa: F811
    """Formats per weight on CUDA: every prefill row and decode step's logits bit-identical to
    the CPU's (the per-weight lookup in matmul, the products op that composes a call of mixed
    formats, the head's format)."""
    _, m = tiny
    if not has_cuda(m):
        pytest.skip("no CUDA device")
    rng = np.random.default_rng(1)
    ids = [int(i) for i in rng.integers(3, m.n_vocab, size=19)]
    steps = [int(i) for i in rng.integers(3, m.n_vocab, size=4)]
    for spec in CUDA_SPECS:
        got = {}
        for dev in (-1, 0):
            with kiln.Context(m, n_ctx=64, n_threads=2, format=spec, device=dev) as ctx:
                rows = [ctx.decode(ids, all_logits=True)] + [ctx.decode([t], all_logits=True) for t in steps]
                got[dev] = np.concatenate(rows)
        assert np.array_equal(bits(got[0]), bits(got[-1])), spec
        assert np.isfinite(got[0]).all()


def test_cuda_training_with_rules(tiny):  # noqa: F811
    """Training with rules on CUDA: the CPU's losses bit for bit, the fused loss's head in
    another format than the base (f32 head copies on an mx base, an mx head on an f32 base) and
    stochastic rounding keyed by the weights in a format."""
    _, m = tiny
    if not has_cuda(m):
        pytest.skip("no CUDA device")
    for spec, rounding in (("mx16,output=f32", "nearest"), ("f32,output=mx8,attn_v=mx16", "nearest"),
                           ("f32,attn_v=mx8,blk.0.ffn_down=mx16", "stochastic")):
        cpu = train_losses(m, spec, rounding=rounding)
        gpu = train_losses(m, spec, rounding=rounding, device=0)
        assert np.array_equal(bits(gpu), bits(cpu)), (spec, rounding, cpu, gpu)
