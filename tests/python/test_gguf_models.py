"""GGUF model files written by gguf-py from tiny random Hugging Face models, in f32, f16 and the
quantized types, for the llama (Q/K rows permuted, as convert_hf_to_gguf does), qwen2 and
qwen3 architectures.

Oracles: (1) kiln on a Hugging Face folder holding gguf-py's dequantization of the same weights
must give BIT-identical logits (computing on quantized blocks = computing on the dequantized
matrix, docs/ARITHMETIC.md), which also checks the Q/K un-permutation; (2) transformers in
float64 on those dequantized weights, within 1e-4 relative, with identical greedy tokens.
"""
import json

import numpy as np
import pytest
import torch

import kiln
from test_parity import CORPUS, PROMPT, build_model, hf_greedy, hf_logits

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as Q  # noqa: E402

ARCH_OF = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}


def hf_to_gguf_name(name):
    name = name.replace("model.embed_tokens.weight", "token_embd.weight")
    name = name.replace("model.norm.weight", "output_norm.weight")
    name = name.replace("lm_head.weight", "output.weight")
    name = name.replace("model.layers.", "blk.")
    for a, b in [("self_attn.q_proj", "attn_q"), ("self_attn.k_proj", "attn_k"), ("self_attn.v_proj", "attn_v"),
                 ("self_attn.o_proj", "attn_output"), ("self_attn.q_norm", "attn_q_norm"),
                 ("self_attn.k_norm", "attn_k_norm"), ("input_layernorm", "attn_norm"),
                 ("post_attention_layernorm", "ffn_norm"), ("mlp.gate_proj", "ffn_gate"),
                 ("mlp.up_proj", "ffn_up"), ("mlp.down_proj", "ffn_down")]:
        name = name.replace(a, b)
    return name


def permute(w, n_head):
    rows = w.shape[0]
    return w.reshape(n_head, 2, rows // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


K_LAYOUT = {  # block bytes, and the offsets of the f16 scale fields to keep small and finite
    Q.Q4_K: (144, [(0, 2e-4), (2, 2e-4)]),
    Q.Q5_K: (176, [(0, 1e-4), (2, 1e-4)]),
    Q.Q6_K: (210, [(208, 3e-5)]),
}


def quantize(g, qtype, rng):
    """gguf-py quantizes the 32-blocks; it cannot quantize K-quants, so for those the blocks
    are random bytes with small random f16 scales (the test needs weights, not a good fit)."""
    if qtype not in K_LAYOUT:
        return gguf.quants.quantize(g, qtype)
    size, scales = K_LAYOUT[qtype]
    rows, cols = g.shape
    blocks = rng.integers(0, 256, size=(rows, cols // 256, size), dtype=np.uint8)
    for off, mag in scales:
        d = (rng.random((rows, cols // 256)) * mag).astype(np.float16)
        blocks[:, :, off:off + 2] = d.view(np.uint8).reshape(rows, cols // 256, 2)
    return blocks.reshape(rows, -1)


def write_gguf(path, arch, cfg, tensors_hf, qtype, tok_json):
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name("tiny-" + arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    theta = getattr(cfg, "rope_theta", None) or cfg.rope_parameters["rope_theta"]
    w.add_rope_freq_base(float(theta))
    hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    w.add_key_length(hd)
    w.add_value_length(hd)
    # tokenizer metadata from tokenizer.json (byte-level BPE, GPT-2 pre-tokenizer)
    vocab = tok_json["model"]["vocab"]
    tokens = [None] * len(vocab)
    for t, i in vocab.items():
        tokens[i] = t
    types = [1] * len(tokens)
    for at in tok_json["added_tokens"]:
        if at["id"] < len(tokens):
            tokens[at["id"]] = at["content"]
            types[at["id"]] = 3 if at["special"] else 4
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok_json["model"]["merges"]]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_eos_token_id(0)
    w.add_add_bos_token(False)
    deq = {}
    rng = np.random.default_rng(7)
    for name, t in tensors_hf.items():
        a = t.detach().to(torch.float32).numpy()
        gname = hf_to_gguf_name(name)
        g = a
        if arch == "llama" and name.endswith("q_proj.weight"):
            g = permute(a, cfg.num_attention_heads)
        if arch == "llama" and name.endswith("k_proj.weight"):
            g = permute(a, cfg.num_key_value_heads)
        if a.ndim == 2 and qtype not in (Q.F32, Q.F16):
            data = quantize(g, qtype, rng)
            w.add_tensor(gname, data, raw_shape=data.shape, raw_dtype=qtype)
            back = gguf.quants.dequantize(data, qtype)
        elif a.ndim == 2 and qtype == Q.F16:
            data = g.astype(np.float16)
            w.add_tensor(gname, data)
            back = data.astype(np.float32)
        else:
            w.add_tensor(gname, g)
            back = g
        if arch == "llama" and (name.endswith("q_proj.weight") or name.endswith("k_proj.weight")):
            n = cfg.num_attention_heads if "q_proj" in name else cfg.num_key_value_heads
            rows = back.shape[0]
            back = back.reshape(n, rows // n // 2, 2, -1).swapaxes(1, 2).reshape(back.shape)  # un-permute
        deq[name] = torch.from_numpy(np.ascontiguousarray(back))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return deq


CASES = [("llama", Q.F32), ("llama", Q.Q8_0), ("llama", Q.Q4_1), ("qwen2", Q.Q4_0), ("qwen2", Q.F16),
         ("qwen3", Q.Q5_0), ("llama", Q.Q5_1), ("llama_k", Q.Q4_K), ("llama_k", Q.Q5_K), ("qwen2_k", Q.Q6_K)]


@pytest.mark.parametrize("name,qtype", CASES, ids=[f"{a}-{q.name}" for a, q in CASES])
def test_gguf_model(tmp_path, build_dir, name, qtype):
    import test_parity
    from transformers import AutoModelForCausalLM
    arch = name.split("_")[0]
    if name.endswith("_k"):  # K-quants need rows of 256: a wider model
        saved = dict(test_parity.COMMON)
        test_parity.COMMON.update(hidden_size=256, intermediate_size=512)
        try:
            d, ref = build_model(tmp_path, arch)
        finally:
            test_parity.COMMON.clear()
            test_parity.COMMON.update(saved)
    else:
        d, ref = build_model(tmp_path, arch)
    cfg = ref.config
    sd = {k: v.to(torch.float32) for k, v in ref.state_dict().items()}
    if cfg.tie_word_embeddings:
        sd.pop("lm_head.weight", None)
    tok_json = json.loads((d / "tokenizer.json").read_text())
    gpath = tmp_path / f"{name}-{qtype.name}.gguf"
    deq = write_gguf(gpath, ARCH_OF[arch], cfg, sd, qtype, tok_json)

    # Hugging Face folder with the dequantized weights: oracle (1) and (2)
    hf = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    missing = hf.load_state_dict(deq, strict=False)
    assert not [k for k in missing.missing_keys if k != "lm_head.weight"]
    if cfg.tie_word_embeddings:
        hf.tie_weights()
    ddir = tmp_path / "deq"
    hf.save_pretrained(ddir)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (ddir / f).write_bytes((d / f).read_bytes())
    ref64 = hf.to(torch.float64).eval()

    mg, mh = kiln.Model(gpath), kiln.Model(ddir)
    ids = mg.tokenizer.encode(PROMPT)
    assert ids == mh.tokenizer.encode(PROMPT)
    cg, ch = kiln.Context(mg, n_ctx=128), kiln.Context(mh, n_ctx=128)
    lg, lh = cg.decode(ids, all_logits=True), ch.decode(ids, all_logits=True)
    assert np.array_equal(lg.view(np.uint32), lh.view(np.uint32)), \
        f"GGUF {qtype.name} logits differ from the dequantized folder: max {np.abs(lg - lh).max()}"
    want = hf_logits(ref64, ids)
    err = np.abs(lg.astype(np.float64) - want).max() / max(1.0, np.abs(want).max())
    print(f"{name} {qtype.name}: relative logits error vs transformers (float64) {err:.3e}")
    assert err <= 1e-4
    cg.truncate(0)
    assert cg.generate(ids, max_tokens=16, ignore_eos=True)["ids"] == hf_greedy(ref64, ids, 16)
    # f32 weight mode (dequantize at load) gives the same bits
    mf = kiln.Model(gpath, f32=True)
    lf = kiln.Context(mf, n_ctx=128).decode(ids, all_logits=True)
    assert np.array_equal(lf.view(np.uint32), lg.view(np.uint32))
