"""Gemma 3 in kiln (src/models/gemma3.c) against transformers' Gemma3ForCausalLM.

  * A tiny random Gemma 3 (scripts/make_tiny_gemma3.py: sliding window 8, a full layer among
    sliding ones, query_pre_attn_scalar != head_dim) read from its Hugging Face folder: logits
    within 1e-4 of transformers' float64 forward on prompts longer than the window and across
    a 64-key block, cached decode bit-identical to the full forward, thread-count invariance,
    greedy continuations identical (test_parity.check_model's checks).
  * Training the tiny model: the loss and every gradient against transformers' float64
    autograd (one sequence longer than the window, and a batch of two), the final hidden
    states, and an exported step that transformers and kiln read back to the same logits.
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


def _grads(ref):
    return {n: p.grad.detach().numpy() for n, p in ref.named_parameters() if p.grad is not None}


def _compare_grads(tr, want, label, bound=1e-4):
    names = set()
    worst = 0.0
    for name, n, _ in tr.params():
        names.add(name)
        g = tr.get_grad(name, n).astype(np.float64)
        w = want[name].ravel()
        rel = float(np.linalg.norm(g - w) / max(np.linalg.norm(w), 1e-12))
        worst = max(worst, rel)
        assert rel <= bound, f"{label}: gradient of {name}: relative error {rel:.3e}"
    assert names == set(want), f"{label}: parameter sets differ: {names ^ set(want)}"
    print(f"{label}: {len(names)} parameters, worst relative gradient error {worst:.3e}")


def test_tiny_loss_and_gradients(tiny, build_dir):
    """One training step of a 40-token sequence (window 8, so the sliding layers cut most keys):
    the loss and every parameter's gradient (the norms' w, the tied embedding) against
    transformers' float64 autograd; the same bits with one thread; and the parameters kiln
    trains are transformers' w, not the 1 + w the forward multiplies by."""
    d, ref = tiny
    m = kiln.Model(d)
    ids = [2] + [int(x) for x in np.random.default_rng(2).integers(7, m.n_vocab, size=39)]
    tr = kiln.Trainer(m, max_seq=64, n_threads=2)
    loss = tr.step(ids)
    ref.zero_grad()
    out = ref(torch.tensor([ids]), labels=torch.tensor([ids]))
    out.loss.backward()
    assert abs(loss - out.loss.item()) <= 1e-5 * abs(out.loss.item()), (loss, out.loss.item())
    _compare_grads(tr, _grads(ref), "gemma3 tiny")
    for name, p in ref.named_parameters():
        if "norm" in name:
            got = tr.get_param(name, p.numel())
            assert np.array_equal(got, p.detach().float().numpy().ravel()), name
    tr1 = kiln.Trainer(m, max_seq=64, n_threads=1)
    assert tr1.step(ids) == loss
    for name, n, _ in tr.params():
        assert np.array_equal(tr.get_grad(name, n).view(np.uint32), tr1.get_grad(name, n).view(np.uint32)), name
    tr.close()
    tr1.close()
    m.close()


def test_tiny_batch_and_hidden(tiny, build_dir):
    """Two sequences in one forward (step_batch) = transformers' batch of two; the training
    forward's final hidden states against transformers' last_hidden_state after the norm."""
    d, ref = tiny
    m = kiln.Model(d)
    rng = np.random.default_rng(3)
    seqs = [[2] + [int(x) for x in rng.integers(7, m.n_vocab, size=29)] for _ in range(2)]
    targets = [s[1:] + [-1] for s in seqs]
    tr = kiln.Trainer(m, max_seq=32, max_batch=2, n_threads=2)
    loss = tr.step_batch(seqs, targets)
    ref.zero_grad()
    logits = ref(torch.tensor(seqs)).logits
    want = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                             torch.tensor(targets).reshape(-1), ignore_index=-1)
    want.backward()
    assert abs(loss - want.item()) <= 1e-5 * abs(want.item()), (loss, want.item())
    _compare_grads(tr, _grads(ref), "gemma3 tiny batch")
    pos = [29, 0, 11]
    h = tr.forward_hidden(seqs[0], pos)
    with torch.no_grad():
        hs = ref.model(torch.tensor([seqs[0]])).last_hidden_state[0, pos].numpy()
    assert np.abs(h - hs).max() <= 1e-4 * max(1.0, np.abs(hs).max())
    tr.discard()
    tr.close()
    m.close()


def test_tiny_train_and_export(tiny, build_dir, tmp_path):
    """A step of training, exported as a Hugging Face folder: the weights are the trainer's, the
    config reads back in transformers and kiln, and both give the same logits (which moved)."""
    from test_export import export, check_weights
    d, ref0 = tiny
    m = kiln.Model(d)
    ids = [2] + [int(x) for x in np.random.default_rng(4).integers(7, m.n_vocab, size=30)]
    tr = kiln.Trainer(m, max_seq=32, n_threads=2, lr=1e-2, weight_decay=0.1)
    tr.step(ids)
    tr.optimizer_step(1e-2)
    out = tmp_path / "exported"
    export(tr, out)
    check_weights(tr, out, bf16=False)
    km = kiln.Model(out)
    for k in ("architecture", "n_layer", "n_embd", "n_head", "n_head_kv", "head_dim", "n_ff", "n_vocab",
              "rms_norm_eps", "rope_theta", "tied_embeddings", "qk_norm", "n_params"):
        assert km.info[k] == m.info[k], k
    ref = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float64,
                                                            attn_implementation="eager").eval()
    cfg0, cfg1 = ref0.config, ref.config
    for k in ("sliding_window", "layer_types", "query_pre_attn_scalar", "rope_parameters", "hidden_activation"):
        assert getattr(cfg1, k) == getattr(cfg0, k), k
    probe = [2] + [int(x) for x in np.random.default_rng(5).integers(7, m.n_vocab, size=40)]
    ctx = kiln.Context(km, n_ctx=64, n_threads=2)
    got = ctx.decode(probe, all_logits=True).astype(np.float64)
    with torch.no_grad():
        want = ref(torch.tensor([probe])).logits[0].numpy()
        before = ref0(torch.tensor([probe])).logits[0].numpy()
    scale = max(1.0, float(np.abs(want).max()))
    assert float(np.abs(got - want).max()) / scale <= 1e-4
    assert float(np.abs(before - want).max()) / scale > 1e-4  # the step is in the export
    ctx.close()
    km.close()
    tr.close()
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
