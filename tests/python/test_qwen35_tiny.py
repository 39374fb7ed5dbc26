"""scripts/make_tiny_qwen35.py: the tiny random Qwen3.5 text model's folder.

The config is the intended hybrid (three Gated DeltaNet layers, then one gated full-attention
layer; partial rotary); the same seed writes the same bytes; transformers' Qwen3_5ForCausalLM
loads it and its chunked forward over a 100-token prompt (one full 64-token chunk and a padded
one) equals its own token-by-token cached decode; the tokenizer encodes, decodes and renders
ChatML.

transformers runs parts of this model in float32 whatever the dtype it was loaded in
(modeling_qwen3_5.py: the zero-centred RMSNorm's x.float(), the gated RMSNorm's and both gated
delta rule functions' .to(torch.float32), and the recurrent state they return, which the cache
keeps in float32). So the float64 model as shipped agrees with itself only to float32 rounding;
with those casts lifted to float64 (the module's torch.float32 read as float64 and the
zero-centred norm in float64) the chunked and the recurrent forms agree within 1e-9.
"""
import hashlib
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "make_tiny_qwen35.py"
T_PROMPT = 100  # more than one 64-token chunk, not a multiple of 64


def _write(d, seed):
    return subprocess.Popen([sys.executable, str(SCRIPT), str(d), "--seed", str(seed)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _wait(proc):
    out, err = proc.communicate()
    assert proc.returncode == 0, err.decode(errors="replace")[-2000:]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny_qwen35") / "model"
    _wait(_write(d, 3))
    return d


@pytest.fixture(scope="module")
def prompt(tiny_dir):
    """(1, T_PROMPT) token ids drawn over the whole vocabulary, specials included."""
    cfg = json.loads((tiny_dir / "config.json").read_text())
    ids = np.random.default_rng(5).integers(0, cfg["vocab_size"], size=T_PROMPT)
    return torch.tensor([ids.tolist()])


def _digests(d):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.iterdir())}


# ---------------------------------------------------------------------------------------------
# The files


def test_tiny_qwen35_config(tiny_dir):
    cfg = transformers.AutoConfig.from_pretrained(tiny_dir)
    assert cfg.model_type == "qwen3_5_text" and cfg.architectures == ["Qwen3_5ForCausalLM"]
    assert cfg.layer_types == ["linear_attention"] * 3 + ["full_attention"]
    assert (cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers) == (64, 128, 4)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (4, 2, 16)
    assert (cfg.linear_num_key_heads, cfg.linear_num_value_heads) == (2, 4)
    assert (cfg.linear_key_head_dim, cfg.linear_value_head_dim) == (16, 16)
    assert cfg.linear_conv_kernel_dim == 4
    rp = cfg.rope_parameters
    assert rp["rope_type"] == "default" and rp["rope_theta"] == 1e7
    assert rp["partial_rotary_factor"] == 0.25  # rotary on the first 4 of 16 dimensions
    assert cfg.tie_word_embeddings and cfg.rms_norm_eps == 1e-6
    assert cfg.max_position_embeddings == 512
    assert cfg.vocab_size == 512

    from safetensors.numpy import load_file
    w = load_file(str(tiny_dir / "model.safetensors"))
    model = transformers.Qwen3_5ForCausalLM(cfg)
    assert set(w) == {n for n, _ in model.named_parameters()}  # lm_head tied, not stored
    assert all(v.dtype == np.float32 for v in w.values())
    for name, v in w.items():  # nothing left at a constant initialisation
        assert v.std() > 0.01, name
    a_log = np.concatenate([v for n, v in w.items() if n.endswith("A_log")])
    decay = -np.exp(a_log)  # per-token log-decay at softplus(.) = 1
    assert decay.max() > -0.1 and decay.min() < -1.0  # heads that remember and heads that forget

    gen = json.loads((tiny_dir / "generation_config.json").read_text())
    tok = json.loads((tiny_dir / "tokenizer.json").read_text())
    special = {t["content"]: t["id"] for t in tok["added_tokens"]}
    assert gen["eos_token_id"] == [special["<|im_end|>"], special["<|endoftext|>"]]


def test_tiny_qwen35_same_seed_same_bytes(tiny_dir, tmp_path):
    again, other = _write(tmp_path / "again", 3), _write(tmp_path / "other", 4)
    _wait(again)
    _wait(other)
    want = _digests(tiny_dir)
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
            "tokenizer_config.json"} <= set(want)
    assert _digests(tmp_path / "again") == want
    changed = {k for k, v in _digests(tmp_path / "other").items() if want[k] != v}
    assert changed == {"model.safetensors"}  # the seed draws the weights only


def test_tiny_qwen35_tokenizer(tiny_dir):
    tok = transformers.AutoTokenizer.from_pretrained(tiny_dir)
    assert len(tok) == 512
    im_start, im_end, eot = (tok.convert_tokens_to_ids(t)
                             for t in ("<|im_start|>", "<|im_end|>", "<|endoftext|>"))
    assert (eot, im_start, im_end) == (509, 510, 511)
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    assert tok.bos_token is None
    for text in ["Hello world!", "The small model reads a prompt.", "Numbers: 12345, 3.14159",
                 "Über die Brücke; 東京 🙂\n\tdef f(x):\r\n  return x",
                 "  leading and trailing  ",
                 "never seen: ξ ∑ ℵ ゑ"]:
        ids = tok.encode(text)
        assert tok.decode(ids) == text
        assert max(ids) < eot  # plain text never becomes a special token
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == im_start and ids[-1] == im_end

    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"},
            {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Bye"}]
    chatml = ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n"
              "<|im_start|>assistant\nHello.<|im_end|>\n<|im_start|>user\nBye<|im_end|>\n")
    assert tok.apply_chat_template(msgs, tokenize=False) == chatml
    assert (tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
            == chatml + "<|im_start|>assistant\n")
    ids = tok(chatml).input_ids
    assert ids.count(im_start) == 4 and ids.count(im_end) == 4


# ---------------------------------------------------------------------------------------------
# transformers' forward: the whole prompt at once (chunked) against token-by-token decode


def _load(tiny_dir):
    return transformers.Qwen3_5ForCausalLM.from_pretrained(
        tiny_dir, dtype=torch.float64, attn_implementation="eager").eval()


def _decode(model, ids, prefill=0, tamper=None):
    """Logits (T, V) of ids: the first prefill tokens in one call, then one token per call
    through the model's cache. tamper(cache) runs once after the prefill."""
    cache, out = None, []
    with torch.no_grad():
        if prefill:
            o = model(ids[:, :prefill], use_cache=True)
            cache = o.cache
            out.append(o.logits[0])
            if tamper:
                tamper(cache)
        for t in range(prefill, ids.shape[1]):
            o = model(ids[:, t:t + 1], cache=cache, use_cache=True)
            cache = o.cache
            out.append(o.logits[0])
    return torch.cat(out), cache


def _zero_linear_state(kind):
    def tamper(cache):
        for layer in cache.layers:
            states = getattr(layer, kind, None)
            if states is not None:
                states[0].zero_()
    return tamper


def test_tiny_qwen35_decode_matches_chunked(tiny_dir, prompt):
    model = _load(tiny_dir)
    with torch.no_grad():
        full = model(prompt).logits[0]  # (T, V)
    assert full.dtype == torch.float64 and torch.isfinite(full).all()
    scale = max(1.0, float(full.abs().max()))
    dec, cache = _decode(model, prompt)
    # the recurrent state the delta rule returns is float32 (see the module docstring)
    assert cache.layers[0].recurrent_states[0].dtype == torch.float32
    assert float((dec - full).abs().max()) <= 2e-5 * scale
    part, _ = _decode(model, prompt, prefill=70)  # one padded chunk, then decode from its state
    assert float((part - full).abs().max()) <= 2e-5 * scale
    # the bound sees a lost state: after a 64-token prefill, zeroing either linear-layer state
    # changes the logits that follow
    for kind in ("recurrent_states", "conv_states"):
        off, _ = _decode(model, prompt, prefill=64, tamper=_zero_linear_state(kind))
        assert float((off - full).abs().max()) > 1e-3 * scale, kind


@pytest.fixture
def float64_clean(monkeypatch):
    """transformers' Qwen3.5 module with its float32 casts lifted to float64, for this test:
    torch.float32 as the module reads it (the delta rules, the gated norm, the eager softmax)
    and the zero-centred norm. Left in float32: A_log and a in the decay g, and the rotary
    tables; both are per-token functions of the same inputs in the two forms."""
    mq = pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5")

    class TorchFloat64:
        float32 = torch.float64

        def __getattr__(self, name):
            return getattr(torch, name)

    def rms_norm_float64(self, x):  # Qwen3_5RMSNorm.forward without x.float()
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * (1.0 + self.weight)

    monkeypatch.setattr(mq, "torch", TorchFloat64())
    monkeypatch.setattr(mq.Qwen3_5RMSNorm, "forward", rms_norm_float64)


def test_tiny_qwen35_decode_matches_chunked_float64(tiny_dir, prompt, float64_clean):
    model = _load(tiny_dir)
    with torch.no_grad():
        full = model(prompt).logits[0]
    assert torch.isfinite(full).all()
    scale = max(1.0, float(full.abs().max()))
    dec, cache = _decode(model, prompt)
    assert cache.layers[0].recurrent_states[0].dtype == torch.float64  # the patch took
    assert float((dec - full).abs().max()) <= 1e-9 * scale
    part, _ = _decode(model, prompt, prefill=70)
    assert float((part - full).abs().max()) <= 1e-9 * scale
