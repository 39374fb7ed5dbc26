#!/usr/bin/env python3
"""Write a tiny random Qwen3.5 text model as a Hugging Face folder, for parity tests.

    make_tiny_qwen35.py OUT_DIR [--seed N]

OUT_DIR gets config.json (Qwen3_5TextConfig, model_type qwen3_5_text, for transformers'
Qwen3_5ForCausalLM), model.safetensors (float32, lm_head tied to the embedding),
generation_config.json (eos = <|im_end|> and <|endoftext|>), and a Qwen-layout tokenizer
(tokenizer.json, tokenizer_config.json and chat_template.jinja written by transformers'
Qwen3_5Tokenizer: NFC normalizer, Qwen3.5's split regex, byte-level BPE without byte fallback;
<|endoftext|>, <|im_start|> and <|im_end|> special, after the BPE ids as in Qwen's
vocabularies; a plain ChatML chat template with add_generation_prompt. Qwen3.5's own template
is ChatML with thinking and tool-call blocks on top; this one keeps only the ChatML turns.)

The configuration keeps what makes Qwen3.5 Qwen3.5, at toy size: hidden 64, MLP 128, 4 layers
of which layers 0, 1 and 2 are Gated DeltaNet linear attention and layer 3 gated full attention
(full_attention_interval 4, as in the released models; layer_types is written out). Full
attention: 4 query heads over 2 KV heads of 16, q_proj producing a query and an output gate per
head, zero-centred q/k norms, rotary on the first 4 of 16 dimensions (partial_rotary_factor
0.25) with rope_theta 1e7 as in Qwen3.5-0.8B. Linear attention: 2 key heads and 4 value heads of
16 (each key head serves two consecutive value heads, so the repeat is exercised), a causal
convolution of width 4. Tied embeddings, rms_norm_eps 1e-6, vocabulary 512 (the tokenizer's).

Every parameter is drawn from one torch generator seeded with --seed, so nothing is left at an
initialisation that would hide a mistake: the zero-centred norms (which multiply by 1 + w)
around 0, the linear layers' gated norm (which multiplies by w) around 1, A_log log-uniform and
stratified per layer so that the decays exp(-exp(A_log) softplus(a + dt_bias)) range from
forgetting within a token to carrying the state across a 64-token chunk, dt_bias, and the
convolution. The same seed gives the same bytes.
Requires torch, transformers, tokenizers.
"""
import argparse
import json
import math
import sys
from pathlib import Path

# Training text for the tokenizer: plain sentences, code, numbers, a few scripts and ChatML
# turns, written for this script.
CORPUS = [
    "The small model reads a prompt and writes the next word.",
    "A linear layer keeps a fixed-size state; a full attention layer keeps every key and value.",
    "The state decays a little at each token, and the delta rule writes what the keys "
    "predict wrong.",
    "Numbers like 12, 345 and 6789 split into digits; 3.14159 keeps its point.",
    "def add(a, b):\n    return a + b\n\nprint(add(2, 3))\n",
    "for (int i = 0; i < n; i++) {\n    sum += x[i];\n}\n",
    "static float dot(const float *a, const float *b, int n) { return a[0] * b[0]; }\n",
    "Quiet rivers run past old stone bridges in the morning light.",
    "She asked, \"Is it raining?\" He said: no, not yet. They're sure it'll clear by noon.",
    "Über die Brücke gehen wir morgen früh; café, naïve, résumé, façade.",
    "東京と大阪は日本の大きな都市です。",
    "Привет, мир! Как дела?",
    "emoji: 🙂 🚀 ✨  tabs\tand  double  spaces\r\nwindows line ends",
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "<|im_start|>user\nHello there!<|im_end|>\n"
    "<|im_start|>assistant\nHi! How can I help?<|im_end|>\n",
]

# Added after the BPE ids, in this order, as Qwen's vocabularies do (<|endoftext|> first).
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

# ChatML: per message '<|im_start|>' + role + '\n' + content + '<|im_end|>\n'; with
# add_generation_prompt, '<|im_start|>assistant\n' after the last message.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def make_tokenizer(out, vocab_size=512):
    """A Qwen3.5-layout tokenizer of vocab_size ids: BPE ids 0..vocab_size-4 (the 256 byte-level
    symbols, then merges trained on CORPUS under Qwen3.5's normalizer and pre-tokenizer), then
    SPECIALS. Returns the vocabulary size and the special tokens' ids."""
    from tokenizers import pre_tokenizers, trainers
    from transformers import Qwen3_5Tokenizer

    # An empty Qwen3_5Tokenizer's backend carries Qwen3.5's normalizer, pre-tokenizer and
    # decoder; train its BPE model in place.
    bpe = Qwen3_5Tokenizer()._tokenizer
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - len(SPECIALS), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator(CORPUS * 8, trainer)
    model = json.loads(bpe.to_str())["model"]
    vocab = model["vocab"]
    if len(vocab) != vocab_size - len(SPECIALS):
        raise RuntimeError(f"BPE training gave {len(vocab)} ids, not {vocab_size - len(SPECIALS)}")
    merges = [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    # the specials first as one list (so they get ids in SPECIALS' order), then their roles
    tok = Qwen3_5Tokenizer(vocab=vocab, merges=merges, unk_token=None, bos_token=None,
                           eos_token=None, pad_token=None, extra_special_tokens=SPECIALS)
    tok.eos_token, tok.pad_token = "<|im_end|>", "<|endoftext|>"
    ids = {t: tok.convert_tokens_to_ids(t) for t in SPECIALS}
    if list(ids.values()) != list(range(len(vocab), vocab_size)):
        raise RuntimeError(f"special tokens got ids {ids}")
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(str(out))
    return vocab_size, ids


def make_config(vocab_size, specials):
    from transformers import Qwen3_5TextConfig
    return Qwen3_5TextConfig(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        hidden_act="silu", rms_norm_eps=1e-6, max_position_embeddings=512,
        tie_word_embeddings=True, initializer_range=0.08,
        layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
        full_attention_interval=4,
        # full attention
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, attention_bias=False,
        attn_output_gate=True,  # recorded as in the released configs; transformers always gates
        # Qwen3.5-0.8B's rope parameters; mrope_section scaled to the 2 rotary frequencies
        # (for text the three position axes are equal, so the sections change nothing)
        rope_parameters={"rope_type": "default", "rope_theta": 10_000_000.0,
                         "partial_rotary_factor": 0.25, "mrope_interleaved": True,
                         "mrope_section": [1, 1, 0]},
        # linear attention
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
        linear_value_head_dim=16, linear_conv_kernel_dim=4,
        mamba_ssm_dtype="float32",  # recorded as in the released configs
        bos_token_id=None, eos_token_id=specials["<|endoftext|>"],
        pad_token_id=specials["<|endoftext|>"])


def randomize(model, seed, std=0.08):
    """Overwrite every parameter of model from a torch generator seeded with seed, in
    named_parameters order (the tied lm_head is the embedding and is drawn once)."""
    import torch

    gen = torch.Generator().manual_seed(seed)

    def normal(p, mean, sd):
        return mean + sd * torch.randn(p.shape, generator=gen, dtype=torch.float32)

    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("linear_attn.norm.weight"):  # gated RMSNorm: multiplies by w
                v = normal(p, 1.0, 0.3)
            elif name.endswith("norm.weight"):  # zero-centred RMSNorm: multiplies by 1 + w
                v = normal(p, 0.0, 0.3)
            elif name.endswith("A_log"):  # (nv,) decay rate A = exp(A_log) in [0.01, 16]
                # log-uniform, one draw from each of nv equal strata in random head order, so
                # every layer has a head that keeps its state across a chunk and one that
                # forgets within a few tokens
                n, lo, hi = p.numel(), math.log(0.01), math.log(16.0)
                u = (torch.arange(n) + torch.rand(n, generator=gen)) / n
                v = (lo + (hi - lo) * u)[torch.randperm(n, generator=gen)]
            elif name.endswith("dt_bias"):  # (nv,) inside softplus(a + dt_bias)
                v = normal(p, 0.0, 1.0)
            elif name.endswith("conv1d.weight"):  # (conv_dim, 1, K) depthwise taps
                v = normal(p, 0.0, 0.5)
            else:  # linear layers and the embedding
                v = normal(p, 0.0, std)
            p.copy_(v)


def make_model(out, seed=0):
    """Write the tiny model and its tokenizer into out; returns the config."""
    import torch
    from transformers import GenerationConfig, Qwen3_5ForCausalLM

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    vocab_size, specials = make_tokenizer(out)
    cfg = make_config(vocab_size, specials)
    model = Qwen3_5ForCausalLM(cfg).to(torch.float32).eval()
    randomize(model, seed, std=cfg.initializer_range)
    eos = [specials["<|im_end|>"], specials["<|endoftext|>"]]
    model.generation_config = GenerationConfig(eos_token_id=eos,
                                               pad_token_id=specials["<|endoftext|>"])
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
