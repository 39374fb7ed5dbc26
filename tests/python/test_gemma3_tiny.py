"""scripts/make_tiny_gemma3.py and docs/models/gemma3-notes.md.

The tiny model's folder: its tokenizer (Gemma's tokenizer.json layout) encodes, decodes and
renders chats in kiln as in transformers; the same seed writes the same bytes. And the notes'
equations: a float64 numpy forward written from docs/models/gemma3-notes.md alone gives
transformers' Gemma3ForCausalLM logits (float64, eager and sdpa attention) on a prompt longer
than the sliding window, and a window one shorter or longer does not.
"""
import hashlib
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from test_gemma3_tokenizer import CONVS, EXTRA, _check_encode, _random_texts
from test_tokenizer import CORPUS, KTok, _check_corpus, _lib

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "make_tiny_gemma3.py"


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny_gemma3") / "model"
    subprocess.run([sys.executable, str(SCRIPT), str(d), "--seed", "3"], check=True,
                   capture_output=True)
    return d


def _digests(d):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.iterdir())}


def test_tiny_gemma3_files(tiny_dir, tmp_path):
    cfg = transformers.AutoConfig.from_pretrained(tiny_dir)
    assert cfg.model_type == "gemma3_text"
    assert cfg.sliding_window == 8 and cfg.head_dim == 16 and cfg.query_pre_attn_scalar == 24
    assert set(cfg.layer_types) == {"sliding_attention", "full_attention"}
    thetas = {k: v["rope_theta"] for k, v in cfg.rope_parameters.items()}
    assert thetas == {"full_attention": 1e6, "sliding_attention": 1e4}
    assert cfg.tie_word_embeddings and cfg.final_logit_softcapping is None
    names = {p.name for p in tiny_dir.iterdir()}
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
            "tokenizer_config.json"} <= names
    again = tmp_path / "again"
    subprocess.run([sys.executable, str(SCRIPT), str(again), "--seed", "3"], check=True,
                   capture_output=True)
    assert _digests(again) == _digests(tiny_dir)


def test_tiny_gemma3_tokenizer(tiny_dir):
    hf = transformers.AutoTokenizer.from_pretrained(tiny_dir)
    kt = KTok(_lib(), tiny_dir)
    try:
        _check_encode(kt, hf, CORPUS + EXTRA + _random_texts(7, 300))
        _check_corpus(kt, hf.backend_tokenizer, CORPUS + EXTRA, parse_special_modes=(True,))
        for msgs in CONVS:
            for gen in (True, False):
                want = hf.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)
                assert kt.chat(msgs, gen) == (0, want)
    finally:
        kt.close()


# ---------------------------------------------------------------------------------------------
# The forward of docs/models/gemma3-notes.md, in float64 numpy


def _rms(x, w, eps):
    """Gemma's RMSNorm over the last axis: x / sqrt(mean(x^2) + eps) * (1 + w)."""
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * (1.0 + w)


def _gelu_tanh(x):
    return 0.5 * x * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (x + 0.044715 * x ** 3)))


def _rope(x, pos, theta):
    """Half-split rotation of x (T, H, HS) at positions pos; the angles are float32 products
    of float32 inverse frequencies, as transformers computes them."""
    HS = x.shape[-1]
    inv = (np.float32(1.0) / (np.float32(theta) ** (np.arange(0, HS, 2, dtype=np.float32)
                                                    / np.float32(HS)))).astype(np.float32)
    ang = pos.astype(np.float32)[:, None] * inv[None, :]          # (T, HS/2) float32
    ang = np.concatenate([ang, ang], axis=-1).astype(np.float64)  # (T, HS)
    cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    half = HS // 2
    rot = np.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rot * sin


def notes_forward(w, cfg, ids, window=None):
    """Logits (T, V) of ids, from weights w (name -> float64 array) and the config."""
    C, NH, KVH, HS = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    eps, W = cfg.rms_norm_eps, cfg.sliding_window if window is None else window
    T = len(ids)
    pos = np.arange(T)
    x = w["model.embed_tokens.weight"][ids] * np.sqrt(C)
    for l, kind in enumerate(cfg.layer_types):
        p = f"model.layers.{l}."
        h = _rms(x, w[p + "input_layernorm.weight"], eps)
        q = (h @ w[p + "self_attn.q_proj.weight"].T).reshape(T, NH, HS)
        k = (h @ w[p + "self_attn.k_proj.weight"].T).reshape(T, KVH, HS)
        v = (h @ w[p + "self_attn.v_proj.weight"].T).reshape(T, KVH, HS)
        q = _rms(q, w[p + "self_attn.q_norm.weight"], eps)
        k = _rms(k, w[p + "self_attn.k_norm.weight"], eps)
        theta = cfg.rope_parameters[kind]["rope_theta"]
        q, k = _rope(q, pos, theta), _rope(k, pos, theta)
        qi, ki = pos[:, None], pos[None, :]
        visible = ki <= qi
        if kind == "sliding_attention":
            visible &= ki > qi - W
        out = np.empty((T, NH, HS))
        for hd in range(NH):
            kv = hd // (NH // KVH)
            s = (q[:, hd] @ k[:, kv].T) * cfg.query_pre_attn_scalar ** -0.5
            s = np.where(visible, s, -np.inf)
            s = np.exp(s - s.max(axis=-1, keepdims=True))
            out[:, hd] = (s / s.sum(axis=-1, keepdims=True)) @ v[:, kv]
        a = out.reshape(T, NH * HS) @ w[p + "self_attn.o_proj.weight"].T
        x = x + _rms(a, w[p + "post_attention_layernorm.weight"], eps)
        h = _rms(x, w[p + "pre_feedforward_layernorm.weight"], eps)
        m = (_gelu_tanh(h @ w[p + "mlp.gate_proj.weight"].T) * (h @ w[p + "mlp.up_proj.weight"].T))
        m = m @ w[p + "mlp.down_proj.weight"].T
        x = x + _rms(m, w[p + "post_feedforward_layernorm.weight"], eps)
    x = _rms(x, w["model.norm.weight"], eps)
    logits = x @ w["model.embed_tokens.weight"].T
    if cfg.final_logit_softcapping is not None:
        logits = np.tanh(logits / cfg.final_logit_softcapping) * cfg.final_logit_softcapping
    return logits


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_notes_forward_matches_transformers(tiny_dir, attn):
    from safetensors.numpy import load_file
    from transformers import AutoTokenizer, Gemma3ForCausalLM
    tok = AutoTokenizer.from_pretrained(tiny_dir)
    ids = tok("The small model reads a prompt; a sliding window of 8 keeps the last few tokens "
              "in view.").input_ids
    assert len(ids) > 3 * 8
    ref = Gemma3ForCausalLM.from_pretrained(tiny_dir, dtype=torch.float64,
                                            attn_implementation=attn).eval()
    with torch.no_grad():
        want = ref(torch.tensor([ids])).logits[0].numpy()
    w = {k: v.astype(np.float64) for k, v in load_file(str(tiny_dir / "model.safetensors")).items()}
    got = notes_forward(w, ref.config, ids)
    scale = max(1.0, float(np.abs(want).max()))
    # transformers keeps float32 in its float64 model (RMSNorm, RoPE angles and cos/sin, eager
    # softmax): about 1e-6 apart; a mask or scale mistake is 1e-1
    assert np.abs(got - want).max() <= 1e-5 * scale
    for off in (-1, 1):  # the window's edge is exact: one more or one fewer key changes logits
        other = notes_forward(w, ref.config, ids, window=ref.config.sliding_window + off)
        assert np.abs(other - want).max() > 1e-3 * scale
