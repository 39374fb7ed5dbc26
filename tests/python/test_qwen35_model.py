"""Qwen3.5 in kiln (src/models/qwen35.c) against transformers' Qwen3_5ForCausalLM.

The tiny random hybrid of scripts/make_tiny_qwen35.py (three Gated DeltaNet layers, one gated
attention layer, every parameter drawn) read from its Hugging Face folder:

  * logits against the float64 forward written from docs/models/qwen35-notes.md (tight: kiln
    computes in float32, the reference in float64) and against transformers (float32-level:
    transformers computes the linear layers in float32 whatever the model's dtype), on 150
    tokens: more than two 64-token chunks, not a multiple of 64;
  * the recurrent state: a prompt prefilled in chunks and then decoded token by token gives the
    full forward's bits; two sequences in one batch give their solo bits; one or two threads
    the same bits; greedy continuations equal transformers'; a context cannot be truncated
    into the middle of what its state absorbed, and generate's prefix reuse continues a state
    only where it stands;
  * training: the loss and every gradient (A_log, dt_bias, the convolution's taps, the gated
    norm, the norms' w, the tied embedding) against transformers' autograd, one sequence and a
    batch of two; the custom-head path (hidden states out, d hidden in) against the built-in
    loss; a trained step exported as a folder that transformers and kiln read back to the same
    logits.
"""
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import kiln
from test_parity import hf_greedy
from test_qwen35_notes import _load, notes_logits

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("qwen35_model") / "tiny"
    subprocess.run([sys.executable, str(REPO / "scripts" / "make_tiny_qwen35.py"), str(d), "--seed", "3"],
                   check=True, capture_output=True)
    ref = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float64).eval()
    return d, ref


def _ids(n, seed, V=509):
    return [int(x) for x in np.random.default_rng(seed).integers(0, V, size=n)]


def _rel(got, want):
    return float(np.abs(np.asarray(got, np.float64) - want).max() / max(1.0, float(np.abs(want).max())))


def test_tiny_logits(tiny, build_dir):
    d, ref = tiny
    W, cfg = _load(d)
    ids = _ids(150, 1)
    m = kiln.Model(d)
    assert m.info["architecture"] == "qwen35"
    ctx = kiln.Context(m, n_ctx=256, n_threads=2)
    got = ctx.decode(ids, all_logits=True)
    notes = notes_logits(W, cfg, ids)
    with torch.no_grad():
        want = ref(torch.tensor([ids])).logits[0].numpy()
    e_notes, e_hf = _rel(got, notes), _rel(got, want)
    print(f"qwen35 tiny: logits vs float64 notes {e_notes:.2e}, vs transformers {e_hf:.2e}")
    assert e_notes <= 5e-6, e_notes
    assert e_hf <= 5e-5, e_hf
    ctx.close()
    m.close()


def test_tiny_state_paths(tiny, build_dir):
    d, ref = tiny
    m = kiln.Model(d)
    ids = _ids(150, 2)
    full = kiln.Context(m, n_ctx=256, n_threads=2)
    want = full.decode(ids, all_logits=True)
    # chunked prefill (48-token batches), then one token at a time
    ctx = kiln.Context(m, n_ctx=256, n_batch=48, n_threads=2)
    rows = [ctx.decode(ids[:130], all_logits=True)] + [ctx.decode([t], all_logits=True) for t in ids[130:]]
    assert np.array_equal(np.concatenate(rows).view(np.uint32), want.view(np.uint32))
    # one thread
    one = kiln.Context(m, n_ctx=256, n_threads=1)
    assert np.array_equal(one.decode(ids, all_logits=True).view(np.uint32), want.view(np.uint32))
    # two sequences decoded together: each its solo bits
    other = _ids(20, 3)
    two = kiln.Context(m, n_ctx=256, n_seq=2, n_threads=2)
    two.decode_seq(0, ids[:20], all_logits=False)
    two.decode_seq(1, other, all_logits=False)
    solo = kiln.Context(m, n_ctx=256, n_threads=2)
    solo.decode(other, all_logits=False)
    for k in range(5):
        got = two.decode_batch([ids[20 + k], 7 + k])
        assert np.array_equal(got[0].view(np.uint32), want[20 + k].view(np.uint32)), k
        assert np.array_equal(got[1].view(np.uint32), solo.decode([7 + k], all_logits=True)[0].view(np.uint32)), k
    # the state cannot go back into what it absorbed
    with pytest.raises(kiln.KilnError, match="recurrent state"):
        ctx.truncate(100)
    ctx.truncate(0)
    assert np.array_equal(ctx.decode(ids, all_logits=True).view(np.uint32), want.view(np.uint32))
    for c in (full, ctx, one, two, solo):
        c.close()
    m.close()


def test_tiny_greedy(tiny, build_dir):
    d, ref = tiny
    m = kiln.Model(d)
    ids = _ids(40, 4)
    ctx = kiln.Context(m, n_ctx=256, n_threads=2)
    res = ctx.generate(ids, max_tokens=24, temperature=0.0, ignore_eos=True)
    want = hf_greedy(ref, ids, 24)
    assert res["ids"] == want
    # the same prompt again: the state stands past it, so nothing is reused; same tokens
    again = ctx.generate(ids, max_tokens=24, temperature=0.0, ignore_eos=True)
    assert again["n_prompt_cached"] == 0 and again["ids"] == want
    # a prompt that continues what the context holds continues the state
    longer = ids + want
    cont = ctx.generate(longer + [5], max_tokens=4, temperature=0.0, ignore_eos=True)
    assert cont["n_prompt_cached"] == len(longer) - 1 or cont["n_prompt_cached"] == 0
    assert cont["ids"] == hf_greedy(ref, longer + [5], 4)
    ctx.close()
    m.close()


def _grads(ref):
    return {n: p.grad.detach().numpy() for n, p in ref.named_parameters() if p.grad is not None}


def _compare_grads(tr, want, label, bound=1e-4, skip=()):
    worst, names = 0.0, set()
    for name, n, _ in tr.params():
        names.add(name)
        if name in skip:
            continue
        g = tr.get_grad(name, n).astype(np.float64)
        w = want[name].ravel()
        rel = float(np.linalg.norm(g - w) / max(np.linalg.norm(w), 1e-12))
        worst = max(worst, rel)
        assert rel <= bound, f"{label}: gradient of {name}: relative error {rel:.3e}"
    assert names == set(want), f"{label}: parameter sets differ: {names ^ set(want)}"
    print(f"{label}: {len(names)} parameters, worst relative gradient error {worst:.3e}")


def test_tiny_gradients(tiny, build_dir):
    d, ref = tiny
    m = kiln.Model(d)
    ids = _ids(150, 5)
    tr = kiln.Trainer(m, max_seq=160, n_threads=2)
    loss = tr.step(ids)
    ref.zero_grad()
    out = ref(torch.tensor([ids]), labels=torch.tensor([ids]))
    out.loss.backward()
    assert abs(loss - out.loss.item()) <= 1e-5 * abs(out.loss.item()), (loss, out.loss.item())
    _compare_grads(tr, _grads(ref), "qwen35 tiny")
    # the norms' parameters are transformers' w (the zero-centred ones) and w (the gated norm)
    for name, p in ref.named_parameters():
        if "norm" in name or "A_log" in name or "dt_bias" in name or "conv1d" in name:
            assert np.array_equal(tr.get_param(name, p.numel()), p.detach().float().numpy().ravel()), name
    tr1 = kiln.Trainer(m, max_seq=160, n_threads=1)
    assert tr1.step(ids) == loss
    for name, n, _ in tr.params():
        assert np.array_equal(tr.get_grad(name, n).view(np.uint32), tr1.get_grad(name, n).view(np.uint32)), name
    tr.close()
    tr1.close()
    m.close()


def test_tiny_batch_and_custom_head(tiny, build_dir):
    d, ref = tiny
    m = kiln.Model(d)
    rng = np.random.default_rng(6)
    seqs = [[int(x) for x in rng.integers(0, 509, size=70)] for _ in range(2)]
    targets = [s[1:] + [-1] for s in seqs]
    targets[1][50:] = [-1] * 20  # a padded tail: its positions carry no loss
    tr = kiln.Trainer(m, max_seq=80, max_batch=2, n_threads=2)
    loss = tr.step_batch(seqs, targets)
    ref.zero_grad()
    logits = ref(torch.tensor(seqs)).logits
    want = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                             torch.tensor(targets).reshape(-1), ignore_index=-1)
    want.backward()
    assert abs(loss - want.item()) <= 1e-5 * abs(want.item()), (loss, want.item())
    _compare_grads(tr, _grads(ref), "qwen35 tiny batch")
    tr.discard()
    tr.close()

    # the custom-head path: the final hidden states out, the caller's loss through the tied head
    # (float64 here), d hidden in: every gradient but the embedding's (whose head part is the
    # caller's) equals the built-in loss's
    ids = _ids(90, 7)
    a = kiln.Trainer(m, max_seq=96, n_threads=2)
    a.step(ids)
    b = kiln.Trainer(m, max_seq=96, n_threads=2)
    pos = list(range(len(ids) - 1))
    h = b.forward_hidden(ids, pos).astype(np.float64)
    E = b.get_param("model.embed_tokens.weight", m.n_vocab * m.info["n_embd"]).reshape(m.n_vocab, -1)
    z = h @ E.astype(np.float64).T
    p = np.exp(z - z.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    p[np.arange(len(pos)), ids[1:]] -= 1.0
    b.backward((p @ E.astype(np.float64) / len(pos)).astype(np.float32))
    for name, n, _ in a.params():
        if name == "model.embed_tokens.weight":
            continue
        ga, gb = a.get_grad(name, n).astype(np.float64), b.get_grad(name, n).astype(np.float64)
        rel = float(np.linalg.norm(ga - gb) / max(np.linalg.norm(ga), 1e-12))
        assert rel <= 1e-5, f"custom head: {name}: {rel:.3e}"
    a.close()
    b.close()
    m.close()


def test_tiny_train_and_export(tiny, build_dir, tmp_path):
    from test_export import check_weights, export
    d, ref0 = tiny
    m = kiln.Model(d)
    ids = _ids(70, 8)
    tr = kiln.Trainer(m, max_seq=80, n_threads=2, lr=1e-2, weight_decay=0.1)
    tr.step(ids)
    tr.optimizer_step(1e-2)
    out = tmp_path / "exported"
    export(tr, out)
    check_weights(tr, out, bf16=False)
    ref = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float64).eval()
    for k in ("layer_types", "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
              "linear_value_head_dim", "linear_conv_kernel_dim", "head_dim", "num_key_value_heads"):
        assert getattr(ref.config, k) == getattr(ref0.config, k), k
    assert ref.config.rope_parameters["partial_rotary_factor"] == 0.25
    km = kiln.Model(out)
    probe = _ids(50, 9)
    ctx = kiln.Context(km, n_ctx=64, n_threads=2)
    got = ctx.decode(probe, all_logits=True)
    with torch.no_grad():
        want = ref(torch.tensor([probe])).logits[0].numpy()
        before = ref0(torch.tensor([probe])).logits[0].numpy()
    assert _rel(got, want) <= 5e-5
    assert _rel(before, want) > 1e-4  # the step is in the export
    ctx.close()
    km.close()
    tr.close()
    m.close()


def test_released_layout(tiny, build_dir, tmp_path):
    """The released checkpoints' layout (model_type qwen3_5, the text model's config in
    text_config, its tensors below model.language_model., a vision tower and an MTP head kiln
    does not read): the same logits as the text-only folder; a bad text_config is refused."""
    import json
    import shutil
    from safetensors.numpy import load_file, save_file
    d, _ = tiny
    out = tmp_path / "released"
    out.mkdir()
    for f in d.iterdir():
        if f.name not in ("config.json", "model.safetensors"):
            shutil.copy(f, out / f.name)
    text = json.loads((d / "config.json").read_text())
    tie = text.pop("tie_word_embeddings")
    cfg = {"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5",
           "tie_word_embeddings": tie, "text_config": text,
           "vision_config": {"depth": 1, "hidden_size": 8, "model_type": "qwen3_5_vision"}}
    (out / "config.json").write_text(json.dumps(cfg))
    w = {k.replace("model.", "model.language_model.", 1): v for k, v in load_file(str(d / "model.safetensors")).items()}
    w["model.visual.patch_embed.weight"] = np.zeros((8, 3), np.float32)
    w["mtp.fc.weight"] = np.zeros((4, 4), np.float32)
    save_file(w, str(out / "model.safetensors"))
    ids = _ids(80, 10)
    logits = []
    for folder in (d, out):
        m = kiln.Model(folder)
        ctx = kiln.Context(m, n_ctx=128, n_threads=2)
        logits.append(ctx.decode(ids, all_logits=True))
        ctx.close()
        m.close()
    assert np.array_equal(logits[0].view(np.uint32), logits[1].view(np.uint32))
    cfg["text_config"] = "qwen"
    (out / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(kiln.KilnError, match="text_config"):
        kiln.Model(out)


@pytest.mark.parametrize("storage,moments", [("f32", "f32"), ("bf16_kahan", "q8"), ("bf16_sr", "f32")])
def test_tiny_resume_bits(tiny, build_dir, tmp_path, storage, moments):
    """AdamW steps on the hybrid model (each storage kind), saved and resumed: the resumed
    trainer's next steps give the uninterrupted run's weights bit for bit."""
    d, _ = tiny
    m = kiln.Model(d)
    batches = [_ids(64, 20 + i) for i in range(4)]

    def run(tr, bs):
        for b in bs:
            tr.step(b)
            tr.optimizer_step(3e-3)

    a = kiln.Trainer(m, max_seq=64, n_threads=2, storage=storage, moments=moments, weight_decay=0.1)
    run(a, batches[:2])
    a.save(tmp_path / "ck", 2)
    run(a, batches[2:])
    b = kiln.Trainer(m, max_seq=64, n_threads=2, storage=storage, moments=moments, weight_decay=0.1)
    assert b.load(tmp_path / "ck")[0] == 2
    run(b, batches[2:])
    for name, n, _ in a.params():
        assert np.array_equal(a.get_param(name, n).view(np.uint32), b.get_param(name, n).view(np.uint32)), name
    a.close()
    b.close()
    m.close()
