"""Parity of kiln's forward pass and greedy decoding with transformers.

Tiny random models of every supported architecture are written as Hugging Face folders by the
test itself (config.json, safetensors, tokenizer.json); the oracle is transformers' forward in
float64 on the CPU, from the very weights kiln reads (f32, or bf16 widened exactly).

Bounds: |logit_kiln - logit_hf| <= 1e-4 * max(1, max|logit_hf|) (kiln computes in f32);
greedy continuations of 32 tokens identical; cached decode bit-identical to full recompute;
logits bit-identical for 1 and 2 threads.
"""
import json

import numpy as np
import pytest
import torch

import kiln

torch.set_num_threads(2)

CORPUS = [
    "The quick brown fox jumps over the lazy dog. " * 3,
    "def main():\n    print('hello world')\n    return 0\n",
    "In the beginning was the Word, and the Word was with God.",
    "1234567890 numbers 3.14159 and more numbers 2718281828",
    "Über café naïve résumé – 東京 北京 emoji 🙂🚀",
]


def make_tokenizer(path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS * 4, trainer)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": None, "eos_token": "<|endoftext|>", "add_bos_token": False,
        "tokenizer_class": "PreTrainedTokenizerFast"}))
    return tok.get_vocab_size()


COMMON = dict(hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=448, max_position_embeddings=256, rms_norm_eps=1e-5,
              initializer_range=0.08, bos_token_id=None, eos_token_id=0, pad_token_id=None)


def arch_configs():
    import transformers as tf
    return {
        "llama": lambda: tf.LlamaConfig(**COMMON, tie_word_embeddings=False),
        "llama_tied_mqa": lambda: tf.LlamaConfig(**{**COMMON, "num_key_value_heads": 1}, tie_word_embeddings=True),
        "llama3_rope": lambda: tf.LlamaConfig(**COMMON, tie_word_embeddings=True, rope_theta=500000.0,
                                              rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                            "high_freq_factor": 4.0, "original_max_position_embeddings": 32}),
        "llama_linear_rope": lambda: tf.LlamaConfig(**COMMON, rope_scaling={"rope_type": "linear", "factor": 2.0}),
        "mistral": lambda: tf.MistralConfig(**COMMON, sliding_window=None, tie_word_embeddings=False),
        "qwen2": lambda: tf.Qwen2Config(**COMMON, tie_word_embeddings=True),
        "qwen3": lambda: tf.Qwen3Config(**COMMON, head_dim=32, tie_word_embeddings=True),
    }


def build_model(tmp_path, name, dtype=torch.float32, shard=False):
    from transformers import AutoModelForCausalLM
    d = tmp_path / name
    d.mkdir()
    make_tokenizer(d)
    cfg = arch_configs()[name]()
    torch.manual_seed(1234)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():  # RMSNorm weights away from 1 so they matter
        for n, p in model.named_parameters():
            if "norm" in n or n.endswith(".bias"):
                p.add_(torch.randn_like(p) * 0.1)
    model = model.to(dtype)
    model.save_pretrained(d, max_shard_size="200KB" if shard else "5GB")
    # The oracle reads the very files kiln reads (a .to(bfloat16) model would also have its
    # RoPE buffers rounded to bf16, which a freshly loaded model does not).
    ref = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float64).eval()
    return d, ref


def hf_logits(ref, ids):
    with torch.no_grad():
        return ref(torch.tensor([ids])).logits[0].numpy()


def hf_greedy(ref, ids, n):
    ids = list(ids)
    out = []
    with torch.no_grad():
        for _ in range(n):
            nxt = int(torch.argmax(ref(torch.tensor([ids])).logits[0, -1]))
            ids.append(nxt)
            out.append(nxt)
    return out


PROMPT = "The quick brown fox jumps over the lazy dog. def main(): print('hi') 東京 🙂"


def check_model(d, ref, label):
    m = kiln.Model(d)
    ids = m.tokenizer.encode(PROMPT)
    assert len(ids) >= 10
    ctx = kiln.Context(m, n_ctx=128, n_threads=2)
    got = ctx.decode(ids, all_logits=True)
    want = hf_logits(ref, ids)
    err = np.abs(got.astype(np.float64) - want)
    scale = max(1.0, float(np.abs(want).max()))
    rel = float(err.max() / scale)
    print(f"{label}: logits max abs err {err.max():.3e}, relative {rel:.3e} (|logit| max {np.abs(want).max():.2f})")
    assert rel <= 1e-4, f"{label}: logits differ: max abs {err.max()} (scale {scale})"

    # cached decode == full recomputation, bit for bit
    ctx.truncate(0)
    rows = [ctx.decode(ids[:5], all_logits=True)]
    for t in ids[5:]:
        rows.append(ctx.decode([t], all_logits=True))
    inc = np.concatenate(rows)
    assert np.array_equal(inc.view(np.uint32), got.view(np.uint32)), f"{label}: cached decode differs from full forward"

    # thread-count invariance
    ctx1 = kiln.Context(m, n_ctx=128, n_threads=1)
    one = ctx1.decode(ids, all_logits=True)
    assert np.array_equal(one.view(np.uint32), got.view(np.uint32)), f"{label}: 1 vs 2 threads differ"

    # greedy continuation of 32 tokens
    ctx.truncate(0)
    res = ctx.generate(ids, max_tokens=32, temperature=0.0, ignore_eos=True)
    want_ids = hf_greedy(ref, ids, 32)
    assert res["ids"] == want_ids, f"{label}: greedy continuation differs\nkiln {res['ids']}\nhf   {want_ids}"
    # prefix reuse gives the same continuation
    res2 = ctx.generate(ids, max_tokens=32, temperature=0.0, ignore_eos=True)
    assert res2["n_prompt_cached"] == len(ids) - 1 and res2["ids"] == want_ids
    ctx.close()
    ctx1.close()
    m.close()


@pytest.mark.parametrize("name", ["llama", "llama_tied_mqa", "llama3_rope", "llama_linear_rope",
                                  "mistral", "qwen2", "qwen3"])
def test_arch_parity_f32(tmp_path, build_dir, name):
    d, ref = build_model(tmp_path, name)
    check_model(d, ref, name)


def test_bf16_weights(tmp_path, build_dir):
    d, ref = build_model(tmp_path, "qwen2", dtype=torch.bfloat16)
    check_model(d, ref, "qwen2-bf16")


def test_sharded_safetensors(tmp_path, build_dir):
    d, ref = build_model(tmp_path, "llama", shard=True)
    assert (d / "model.safetensors.index.json").exists()
    check_model(d, ref, "llama-sharded")


def test_bad_ids_and_context(tmp_path, build_dir):
    d, _ = build_model(tmp_path, "llama")
    m = kiln.Model(d)
    ctx = kiln.Context(m, n_ctx=16, n_threads=1)
    with pytest.raises(kiln.KilnError, match="out of range"):
        ctx.decode([1, 2, m.n_vocab])
    with pytest.raises(kiln.KilnError, match="out of range"):
        ctx.decode([-1])
    with pytest.raises(kiln.KilnError, match="context length"):
        ctx.decode(list(range(17)))
    assert ctx.n_past == 0  # nothing half-done
    ctx.decode(list(range(16)))
    with pytest.raises(kiln.KilnError, match="context length"):
        ctx.decode([1])
    with pytest.raises(kiln.KilnError, match="exceeds the model's context length"):
        kiln.Context(m, n_ctx=100000)
