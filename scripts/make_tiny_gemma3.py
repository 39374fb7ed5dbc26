#!/usr/bin/env python3
"""Write a tiny random Gemma 3 text model as a Hugging Face folder, for parity tests.

    make_tiny_gemma3.py OUT_DIR [--seed N]

OUT_DIR gets config.json (Gemma3TextConfig, model_type gemma3_text), model.safetensors
(float32, lm_head tied to the embedding), generation_config.json, and a Gemma-layout tokenizer
(tokenizer.json + tokenizer_config.json written by transformers' GemmaTokenizer: Replace(' ',
'▁') normalizer, BPE with byte fallback, <bos> added, <start_of_turn>/<end_of_turn> special,
and a chat template that renders Gemma 3's turn format).

The configuration keeps what makes Gemma 3 Gemma 3, at toy size: hidden 64, 4 layers, 4 query
heads over 2 KV heads of 16, MLP 128, a sliding window of 8 (so a prompt of more than 8 tokens
uses it) on layers 0, 1 and 3 and full attention on layer 2 (the real models put one full
layer after five sliding ones), different RoPE bases for the two layer types, and
query_pre_attn_scalar 24 (not head_dim: the scale 24**-0.5 must come from the config, as it
does in Gemma 3 27B). RMSNorm weights are drawn around 0 (Gemma's norms multiply by 1 + w) so
they matter. The same seed gives the same files. Requires torch, transformers, tokenizers.
"""
import argparse
import json
import sys
from pathlib import Path

# Training text for the tokenizer: plain sentences, code, numbers and a few scripts, written
# for this script.
CORPUS = [
    "The small model reads a prompt and writes the next word.",
    "A sliding window keeps only the last few tokens in view; a full layer sees them all.",
    "Numbers like 12, 345 and 6789 split into digits; 3.14159 keeps its point.",
    "def add(a, b):\n    return a + b\n\nprint(add(2, 3))\n",
    "for (int i = 0; i < n; i++) {\n    sum += x[i];\n}\n",
    "Quiet rivers run past old stone bridges in the morning light.",
    "She asked, \"Is it raining?\" He said: no, not yet.",
    "Über die Brücke gehen wir morgen früh; café, naïve, résumé.",
    "東京と大阪は日本の大きな都市です。",
    "emoji: 🙂 🚀 ✨  tabs\tand  double  spaces",
    "<start_of_turn>user\nHello there!<end_of_turn>\n<start_of_turn>model\nHi! How can I help?<end_of_turn>\n",
]

SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_turn>", "<end_of_turn>"]

# Gemma 3's conversation format: <bos>, then per message '<start_of_turn>' + role ('model' for
# the assistant) + '\n' + content|trim + '<end_of_turn>\n'; a leading system message goes in
# front of the first user turn followed by a blank line; roles alternate user/model.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if messages and messages[0]['role'] == 'system' %}"
    "{% set first_user_prefix = messages[0]['content'] + '\\n\\n' %}"
    "{% set loop_messages = messages[1:] %}"
    "{% else %}{% set first_user_prefix = '' %}{% set loop_messages = messages %}{% endif %}"
    "{% for message in loop_messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}"
    "{{ '<start_of_turn>' + ('model' if message['role'] == 'assistant' else message['role']) + '\\n'"
    " + (first_user_prefix if loop.first else '') + (message['content'] | trim)"
    " + '<end_of_turn>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}"
)


def make_tokenizer(out, vocab_size=512):
    """A Gemma-layout tokenizer of vocab_size ids: the special tokens, the 256 byte tokens
    <0x00>..<0xFF>, then BPE pieces trained on CORPUS (merges over the whole text, spaces as
    '▁', as Gemma's tokenizer has no pre-tokenizer split)."""
    from tokenizers import Tokenizer, models, normalizers, trainers
    from transformers import GemmaTokenizer

    n_fixed = len(SPECIALS) + 256
    bpe = Tokenizer(models.BPE())
    bpe.normalizer = normalizers.Replace(" ", "▁")
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - n_fixed, show_progress=False,
                                  initial_alphabet=["▁"], limit_alphabet=120)
    bpe.train_from_iterator(CORPUS * 8, trainer)
    trained = sorted(bpe.get_vocab().items(), key=lambda kv: kv[1])
    vocab = {t: i for i, t in enumerate(SPECIALS)}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for piece, _ in trained:
        if piece not in vocab:
            vocab[piece] = len(vocab)
    model = json.loads(bpe.to_str())["model"]
    merges = [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    tok = GemmaTokenizer(vocab=vocab, merges=merges, add_bos_token=True, add_eos_token=False,
                         extra_special_tokens=["<start_of_turn>", "<end_of_turn>"])
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(str(out))
    return len(vocab)


def make_config(vocab_size):
    from transformers import Gemma3TextConfig
    return Gemma3TextConfig(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        hidden_activation="gelu_pytorch_tanh", max_position_embeddings=256, rms_norm_eps=1e-6,
        sliding_window=8,
        layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}},
        query_pre_attn_scalar=24, final_logit_softcapping=None, attn_logit_softcapping=None,
        tie_word_embeddings=True, initializer_range=0.08,
        pad_token_id=0, eos_token_id=1, bos_token_id=2)


def make_model(out, seed=0):
    """Write the tiny model and its tokenizer into out; returns the config."""
    import torch
    from transformers import Gemma3ForCausalLM, GenerationConfig

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    vocab_size = make_tokenizer(out)
    cfg = make_config(vocab_size)
    model = Gemma3ForCausalLM(cfg).to(torch.float32).eval()
    with torch.no_grad():  # norm weights away from 0 (the norm multiplies by 1 + w)
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(torch.randn_like(p) * 0.2)
    model.generation_config = GenerationConfig(bos_token_id=2, eos_token_id=[1, SPECIALS.index("<end_of_turn>")],
                                               pad_token_id=0)
    model.save_pretrained(str(out))
    return cfg


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out_dir")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    make_model(a.out_dir, a.seed)
    print(a.out_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
