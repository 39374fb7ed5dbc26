"""docs/models/qwen35-notes.md against transformers' Qwen3_5ForCausalLM.

A float64 numpy forward written from the notes alone (the zero-centred norms, the gated
attention with its partial rotary embedding, the Gated DeltaNet layer as its token-by-token
recurrence, the gated norm) gives transformers' logits for the tiny random model of
scripts/make_tiny_qwen35.py, on a prompt longer than one 64-token chunk and not a multiple of
it. transformers computes parts of this model in float32 whatever its dtype (the notes, "What
transformers' float64 forward is not"), so the bound is float32-level: 2e-5 of the largest
logit. Changing one detail the notes insist on (which key head a value head reads, the rotary
dimension) must break the agreement.
"""
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
safetensors_numpy = pytest.importorskip("safetensors.numpy")

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "make_tiny_qwen35.py"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("qwen35_notes") / "model"
    subprocess.run([sys.executable, str(SCRIPT), str(d), "--seed", "7"], check=True, capture_output=True)
    return d


def _zc_norm(x, w, eps):
    """Zero-centred RMSNorm: x / sqrt(mean(x^2) + eps) * (1 + w), over the last axis."""
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * (1.0 + w)


def _silu(x):
    return x / (1.0 + np.exp(-x))


def _softplus(x):
    return np.log1p(np.exp(-np.abs(x))) + np.maximum(x, 0.0)


def _rope_partial(x, pos, theta, rot):
    """Rotate-half on x[..., :rot] (x: (T, H, HS)), the rest passed through."""
    inv = 1.0 / theta ** (np.arange(0, rot, 2, dtype=np.float64) / rot)
    ang = pos[:, None] * inv[None, :]
    cos = np.concatenate([np.cos(ang), np.cos(ang)], axis=-1)[:, None, :]
    sin = np.concatenate([np.sin(ang), np.sin(ang)], axis=-1)[:, None, :]
    r, rest = x[..., :rot], x[..., rot:]
    half = rot // 2
    rh = np.concatenate([-r[..., half:], r[..., :half]], axis=-1)
    return np.concatenate([r * cos + rh * sin, rest], axis=-1)


def _gated_attention(h, W, p, cfg, pos, rot_factor=None):
    T = h.shape[0]
    NH, KVH, HS = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    qg = (h @ W[p + "self_attn.q_proj.weight"].T).reshape(T, NH, 2 * HS)
    q, gate = qg[..., :HS], qg[..., HS:].reshape(T, NH * HS)
    k = (h @ W[p + "self_attn.k_proj.weight"].T).reshape(T, KVH, HS)
    v = (h @ W[p + "self_attn.v_proj.weight"].T).reshape(T, KVH, HS)
    eps = cfg["rms_norm_eps"]
    q = _zc_norm(q, W[p + "self_attn.q_norm.weight"], eps)
    k = _zc_norm(k, W[p + "self_attn.k_norm.weight"], eps)
    rp = cfg["rope_parameters"]
    rot = int(HS * (rot_factor or rp.get("partial_rotary_factor", 0.25)))
    q, k = _rope_partial(q, pos, rp["rope_theta"], rot), _rope_partial(k, pos, rp["rope_theta"], rot)
    out = np.zeros((T, NH, HS))
    for hh in range(NH):
        g = hh // (NH // KVH)
        s = q[:, hh] @ k[:, g].T / np.sqrt(HS)
        s = s + np.triu(np.full((T, T), -np.inf), 1)
        s = np.exp(s - s.max(axis=1, keepdims=True))
        out[:, hh] = (s / s.sum(axis=1, keepdims=True)) @ v[:, g]
    out = out.reshape(T, NH * HS) * (1.0 / (1.0 + np.exp(-gate)))
    return out @ W[p + "self_attn.o_proj.weight"].T


def _gated_deltanet(h, W, p, cfg, key_of=None):
    T = h.shape[0]
    nk, dk = cfg["linear_num_key_heads"], cfg["linear_key_head_dim"]
    nv, dv = cfg["linear_num_value_heads"], cfg["linear_value_head_dim"]
    K, KD, VD = cfg["linear_conv_kernel_dim"], nk * dk, nv * dv
    mixed = h @ W[p + "linear_attn.in_proj_qkv.weight"].T  # (T, 2KD + VD)
    w = W[p + "linear_attn.conv1d.weight"][:, 0, :]  # (conv_dim, K)
    padded = np.concatenate([np.zeros((K - 1, mixed.shape[1])), mixed], axis=0)
    u = np.stack([(padded[t:t + K] * w.T).sum(axis=0) for t in range(T)])
    u = _silu(u)
    q, k, v = u[:, :KD].reshape(T, nk, dk), u[:, KD:2 * KD].reshape(T, nk, dk), u[:, 2 * KD:].reshape(T, nv, dv)
    z = (h @ W[p + "linear_attn.in_proj_z.weight"].T).reshape(T, nv, dv)
    b = h @ W[p + "linear_attn.in_proj_b.weight"].T
    a = h @ W[p + "linear_attn.in_proj_a.weight"].T
    beta = 1.0 / (1.0 + np.exp(-b))
    g = -np.exp(W[p + "linear_attn.A_log"]) * _softplus(a + W[p + "linear_attn.dt_bias"])

    def l2(x):
        return x / np.sqrt((x * x).sum(-1, keepdims=True) + 1e-6)

    q, k = l2(q) / np.sqrt(dk), l2(k)
    key_of = key_of or (lambda j: j // (nv // nk))
    o = np.zeros((T, nv, dv))
    for j in range(nv):
        S = np.zeros((dk, dv))
        kh = key_of(j)
        for t in range(T):
            S = np.exp(g[t, j]) * S
            delta = beta[t, j] * (v[t, j] - S.T @ k[t, kh])
            S = S + np.outer(k[t, kh], delta)
            o[t, j] = S.T @ q[t, kh]
    eps = cfg["rms_norm_eps"]
    y = o / np.sqrt(np.mean(o * o, axis=-1, keepdims=True) + eps) * W[p + "linear_attn.norm.weight"] * _silu(z)
    return y.reshape(T, VD) @ W[p + "linear_attn.out_proj.weight"].T


def notes_logits(W, cfg, ids, key_of=None, rot_factor=None):
    T = len(ids)
    pos = np.arange(T, dtype=np.float64)
    eps = cfg["rms_norm_eps"]
    x = W["model.embed_tokens.weight"][ids]
    for layer, kind in enumerate(cfg["layer_types"]):
        p = f"model.layers.{layer}."
        h = _zc_norm(x, W[p + "input_layernorm.weight"], eps)
        if kind == "linear_attention":
            x = x + _gated_deltanet(h, W, p, cfg, key_of)
        else:
            x = x + _gated_attention(h, W, p, cfg, pos, rot_factor)
        h = _zc_norm(x, W[p + "post_attention_layernorm.weight"], eps)
        gu = _silu(h @ W[p + "mlp.gate_proj.weight"].T) * (h @ W[p + "mlp.up_proj.weight"].T)
        x = x + gu @ W[p + "mlp.down_proj.weight"].T
    x = _zc_norm(x, W["model.norm.weight"], eps)
    head = W.get("lm_head.weight", W["model.embed_tokens.weight"])
    return x @ head.T


def _load(d):
    import json
    cfg = json.loads((d / "config.json").read_text())
    if "text_config" in cfg:
        cfg = {**cfg, **cfg["text_config"]}
    W = {k: v.astype(np.float64) for k, v in safetensors_numpy.load_file(str(d / "model.safetensors")).items()}
    return W, cfg


def test_notes_forward_matches_transformers(tiny):
    W, cfg = _load(tiny)
    assert "linear_attention" in cfg["layer_types"] and "full_attention" in cfg["layer_types"]
    ref = transformers.AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float64,
                                                            attn_implementation="eager").eval()
    rng = np.random.default_rng(11)
    ids = [int(x) for x in rng.integers(3, cfg["vocab_size"], size=100)]  # > one chunk, not a multiple
    with torch.no_grad():
        want = ref(torch.tensor([ids])).logits[0].numpy()
    got = notes_logits(W, cfg, ids)
    scale = max(1.0, float(np.abs(want).max()))
    err = float(np.abs(got - want).max()) / scale
    print(f"notes vs transformers: max |diff| / max |logit| = {err:.2e}")
    assert err <= 2e-5, err

    # the details the notes insist on, each changed alone, must break the agreement
    nk, nv = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    variants = [("rotary over the whole head", {"rot_factor": 1.0})]
    if nv != nk:
        variants.append(("value head j reading key head j % nk", {"key_of": lambda j: j % nk}))
    for label, kw in variants:
        off = float(np.abs(notes_logits(W, cfg, ids, **kw) - want).max()) / scale
        assert off > 1e-3, f"{label}: still agrees ({off:.2e})"
