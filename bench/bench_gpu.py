#!/usr/bin/env python3
"""bench_gpu.py -- the GPU inference benchmark of issue 4: one run on one GPU (1 x H200), every
figure side by side, one table printed last and a JSON.

HOW TO RUN (on the GPU machine: python3 with torch and transformers; kiln built with
-DKILN_CUDA=ON, e.g. by scripts/gpu-check.sh into build-gpu):

  scripts/gpu-bench.sh build-gpu                       # every part, models 0.5b,1.5b,3b
  python3 bench/bench_gpu.py --bin DIR [--models 0.5b,1.5b,3b]
      [--parts decode,prefill,quant,batch8] [--quick] [--new 128] [--prefill 512,4096]
      [--batch 8] [--quant f16,q8_0,q4_k,q4_k_m] [--llama-bench PATH] [--keep]
      [--json OUT.json] [--no-compile] [--device cuda|cpu]

  DIR holds `kiln` and `libkiln.so` (a build folder, or a folder made by
  `scripts/gpu-bench.sh prepare`); their shared libraries are found through LD_LIBRARY_PATH
  (gpu-bench.sh adds DIR and DIR/deps/usr/lib/x86_64-linux-gnu).
  --quick: 32 new tokens, prefill 512 only, one repetition, no torch.compile, no eager
  transformers: a check that everything runs, not figures to quote.
  --budget S (default 500): the optional pieces (torch.compile'd steps, transformers eager and
  static cache) are skipped, with "skipped (--budget)" in the table, when they would not fit
  in S seconds keeping --reserve (110) seconds for each model still to come; a model that
  would start within 30 s of S is skipped. The JSON is rewritten after every model. The
  default run is meant to take about 8 minutes on an H200 (the device tool stops a command at
  10); --budget 1e9 runs everything.
  --device cpu --models tiny --quick: the CPU smoke mode (a 2-layer, 64-wide qwen2 model with a
  512-token vocabulary; kiln on the CPU, PyTorch's step uncaptured): every part's logic runs
  end to end on a machine without a GPU; its figures mean nothing.

MODELS: random weights of real shapes written here with transformers (bf16 safetensors, norms
and biases perturbed away from 1 and 0): Qwen2.5-0.5B and Qwen2.5-1.5B (Qwen2Config, tied,
vocabulary 151,936) and Llama-3.2-3B (LlamaConfig: C 3072, 28 layers, 24/8 heads, ff 8192,
vocabulary 128,256, tied, rope theta 500000, no rope scaling). Each gets a synthetic
byte-level BPE tokenizer.json of exactly its vocabulary size (write_tokenizer: 256 byte
tokens, fillers, the family's special tokens at their real ids, no merges: one token per
byte). Decode prompt: the 44 bytes of PROMPT.

THE PARTS AND WHAT EACH TABLE ROW MEANS (columns: model | figure | engine | value | vs ceiling
| notes):

decode (batch 1, greedy, --new tokens after the prompt; tok/s = (new - 1) / decode time):
  - roofline: bytes read per token = bf16 weights (the tied matrix once) + a bf16 KV cache at
    the mean context (prompt + new/2 positions), over the device-to-device copy bandwidth
    measured in this run (read + write bytes of a 4 GiB copy_ / its time). "vs ceiling" of a
    decode row = its tok/s / the roofline's.
  - kiln auditable: `kiln generate -m DIR -p PROMPT -n NEW --temp 0 --ignore-eos --json
    --device cuda`, the median of --kiln-reps processes' decode_tokens_per_s (the CPU's bits;
    the step replayed as a CUDA graph unless KILN_CUDA_GRAPHS=0).
  - kiln fast: the same with --fast (bf16 tensor cores for prefill, f32 matvec kernels on the
    weights for decode, split-key decode attention, CUDA graph). Notes: "auditable cost" =
    fast tok/s / auditable tok/s; how many greedy ids equal the auditable run's and the first
    index where they differ (with the number of distinct ids: a random model's greedy
    continuation often repeats one token, which makes equality easy); and "max norm logit diff" = max over the prompt's positions t of
    max_i |fast[t,i] - aud[t,i]| / max_i |aud[t,i]|, the logits of the whole prompt from the
    binding (Context(model, device=0, fast=...).decode(prompt_ids, all_logits=True)).
  - transformers generate (bf16; eager, sdpa, sdpa + static cache, no torch.compile):
    (new - 1) / (t(new tokens) - t(1 token)).
  - PyTorch graph step: a bf16 decode step written here (static KV cache, q/k/v and gate/up
    fused into one matmul each, rope from tables indexed by a device position, attention as
    two batched matmuls over the masked cache, greedy argmax on the device, tok/pos advanced
    on the device) captured in ONE CUDA graph and replayed with no host work; eager ops, and
    torch.compile'd (inductor, one compiled layer function reused by every layer). Notes: the
    first step's logits against transformers (relative L2) and greedy agreement with
    transformers sdpa.
batch8 (--batch B sequences of the same length, row 0 the decode prompt, the others random ids):
  - the PyTorch graph step at batch B (eager and compiled): tok/s = B x (new - 1) / time (all
    sequences together; notes: per sequence); roofline = B x bandwidth / (weights + B KV
    caches); kiln: kiln_decode_batch through the binding (B sequences in one KV cache, one
    forward and one CUDA graph per step), auditable and fast; tokens fed, no sampling.
prefill (--prefill lengths, random ids):
  - kiln auditable / fast: through the binding, a warm context (n_ctx = longest + 16,
    n_batch = longest, so each prompt is one batch; one untimed decode first uploads the
    weights), the median time of Context.decode(ids) (the last position's logits downloaded)
    after truncate(0); repetitions stop early past --prefill-budget seconds.
  - transformers sdpa forward (bf16, logits_to_keep=1), CUDA events.
  - the fast row's notes: "auditable cost" = auditable time / fast time.
  - "vs ceiling" = achieved FLOP/s / the bf16 matrix rate measured in this run (a cuBLAS
    bf16 8192^3 matmul through torch), with the prefill FLOPs of T tokens
        F(T) = 2 * P * T + 2 * T^2 * HS * NH * L + 2 * V * C
    P = parameters without the embedding (the tied matrix counted once, as the embedding);
    attention: QK^T and PV, 2 FLOPs per multiply-add, T^2/2 causal (query, key) pairs,
    HS * NH per pair and layer: 2 * 2 * (T^2 / 2) * HS * NH * L; the last position's lm_head.
quant (0.5b, 1.5b, 3b shapes; tiny in the smoke mode): GGUF v3 files written here (write_gguf)
  with random blocks and small f16 scales, architecture qwen2 or llama, the tokenizer in the
  metadata:
  - q8_0: every matrix Q8_0 (token embedding / lm_head too).
  - q4_k: every layer matrix Q4_K, token embedding / lm_head Q6_K (like llama.cpp's Q4_K_S);
    a matrix whose row length is not a multiple of 256 (Qwen2.5-0.5B's C = 896) falls back as
    llama.cpp does: Q4_K -> Q5_0, Q6_K -> Q8_0 (the notes give the mix).
  - q4_k_m: llama.cpp's Q4_K_M mix: Q4_K, with Q6_K for attn_v and ffn_down of the first and
    last eighth of the layers and every third layer between, and for the (tied) output.
  - f16: every matrix F16 (random, spread 0.02): llama.cpp's comparison file for the bf16 rows.
  - rows: kiln auditable and fast `generate` on each file; "vs ceiling" against the quantized
    roofline = (GGUF tensor bytes + the bf16-convention KV bytes) / copy bandwidth; notes: the
    ratio to kiln's bf16 decode of the same mode. With --llama-bench PATH (a llama.cpp CUDA
    build's llama-bench), llama.cpp's decode of the same file: `llama-bench -m FILE -ngl 99 -p 0
    -n NEW -r --llama-reps -o json`, its mean tok/s; the note gives kiln fast / llama.cpp.
"""
import argparse
import ctypes
import json
import os
import shutil
import statistics
import struct
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

# name: (family, hidden C, layers L, heads NH, kv heads KVH, ff FF, vocab V)
SHAPES = {
    "Qwen2.5-0.5B": ("qwen2", 896, 24, 14, 2, 4864, 151936),
    "Qwen2.5-1.5B": ("qwen2", 1536, 28, 12, 2, 8960, 151936),
    "Llama-3.2-3B": ("llama", 3072, 28, 24, 8, 8192, 128256),
    "tiny": ("qwen2", 64, 2, 4, 2, 256, 512),
}
ALIASES = {"0.5b": "Qwen2.5-0.5B", "1.5b": "Qwen2.5-1.5B", "3b": "Llama-3.2-3B"}
QUANT_SHAPES = ("Qwen2.5-0.5B", "Qwen2.5-1.5B", "Llama-3.2-3B", "tiny")
QUANTS = ("f16", "q8_0", "q4_k", "q4_k_m")
PARTS = ("decode", "prefill", "quant", "batch8")
PROMPT = "The quick brown fox jumps over the lazy dog."
KILN_NO_BATCH = "n/a"


def special_tokens(name):
    """{id: text} of the family's special tokens and the EOS id, at their real ids."""
    fam, V = SHAPES[name][0], SHAPES[name][6]
    if fam == "llama":
        return {128000: "<|begin_of_text|>", 128001: "<|end_of_text|>", 128009: "<|eot_id|>"}, 128001
    if V == 151936:
        return {151643: "<|endoftext|>", 151644: "<|im_start|>", 151645: "<|im_end|>"}, 151643
    return {V - 3: "<|endoftext|>", V - 2: "<|im_start|>", V - 1: "<|im_end|>"}, V - 3


def log(*a):
    print(*a, flush=True)


# ---- timing ----------------------------------------------------------------------------------

def sync(dev):
    if dev == "cuda":
        torch.cuda.synchronize()


def dev_time(dev, fn, reps, warm=2):
    """Median seconds of fn() over reps: CUDA events on the GPU, perf_counter on the CPU."""
    for _ in range(warm):
        fn()
    sync(dev)
    ts = []
    for _ in range(reps):
        if dev == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            ts.append(a.elapsed_time(b) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def wall_time(dev, fn, reps, warm=1):
    for _ in range(warm):
        fn()
    ts = []
    for _ in range(reps):
        sync(dev)
        t0 = time.perf_counter()
        fn()
        sync(dev)
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def measure_device(dev):
    """Copy bandwidth (d2d copy of 4 GiB; 256 MiB on the CPU), read-only bandwidth (a sum of the
    same bytes), bf16 matmul rate (8192^3; 512^3 on the CPU)."""
    nb, n = (4 << 30, 8192) if dev == "cuda" else (256 << 20, 512)
    x = torch.empty(nb, dtype=torch.uint8, device=dev)
    x.random_()
    y = torch.empty_like(x)
    t = dev_time(dev, lambda: y.copy_(x), 10)
    xf = x.view(torch.float32)
    tr = dev_time(dev, lambda: xf.sum(), 10)
    del x, y, xf
    a = torch.randn(n, n, dtype=torch.bfloat16, device=dev)
    b = torch.randn(n, n, dtype=torch.bfloat16, device=dev)
    tm = dev_time(dev, lambda: a @ b, 10, warm=3)
    del a, b
    if dev == "cuda":
        torch.cuda.empty_cache()
    return {
        "copy_bytes": nb, "copy_s": t,
        "copy_rw_GBps": 2 * nb / t / 1e9,   # bytes read + written per second
        "copy_B_over_t_GBps": nb / t / 1e9,  # bytes of the tensor per second (half the traffic)
        "read_sum_GBps": nb / tr / 1e9,      # a reduction: reads only
        "matmul_n": n,
        "matmul_bf16_TFLOPs": 2 * n ** 3 / tm / 1e12,
    }


# ---- tokenizer and models --------------------------------------------------------------------

def bytes_to_unicode():
    """GPT-2's byte-level alphabet: printable bytes map to themselves, the rest to 256+."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("\xa1"), ord("\xac") + 1)) + \
        list(range(ord("\xae"), ord("\xff") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return [chr(c) for c in cs]


def token_list(vocab, special):
    """The token texts in id order: the 256 byte symbols, then fillers "wN", the special
    tokens at their ids."""
    syms = bytes_to_unicode()
    out, j = [], 0
    for i in range(vocab):
        if i < 256:
            out.append(syms[i])
        elif i in special:
            out.append(special[i])
        else:
            out.append(f"w{j}")
            j += 1
    return out


def write_tokenizer(out, vocab, special, eos):
    """A synthetic byte-level BPE tokenizer.json with exactly `vocab` ids (no merges: one token
    per byte; special: {id: text} marked special), enough for kiln and transformers to load a
    model folder. Returns the token texts in id order (the GGUF writer embeds the same)."""
    if vocab < 256 + len(special) or any(not 256 <= i < vocab for i in special):
        raise ValueError(f"vocab {vocab}: too small for 256 bytes and the special ids {sorted(special)}")
    toks = token_list(vocab, special)
    bl = {"add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    tok = {"version": "1.0", "truncation": None, "padding": None,
           "added_tokens": [{"id": i, "content": c, "single_word": False, "lstrip": False,
                             "rstrip": False, "normalized": False, "special": True}
                            for i, c in sorted(special.items())],
           "normalizer": None, "pre_tokenizer": dict(type="ByteLevel", **bl),
           "post_processor": None,
           "decoder": dict(type="ByteLevel", **dict(bl, add_prefix_space=True)),
           "model": {"type": "BPE", "dropout": None, "unk_token": None,
                     "continuing_subword_prefix": None, "end_of_word_suffix": None,
                     "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                     "vocab": {t: i for i, t in enumerate(toks)}, "merges": []}}
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "tokenizer.json"), "w") as f:
        json.dump(tok, f, ensure_ascii=False, indent=2)
    with open(os.path.join(out, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": None, "eos_token": special[eos], "add_bos_token": False,
                   "tokenizer_class": "PreTrainedTokenizerFast"}, f)
    return toks


def hf_config(name):
    import transformers as tf
    fam, C, L, NH, KVH, FF, V = SHAPES[name]
    _, eos = special_tokens(name)
    common = dict(hidden_size=C, num_hidden_layers=L, num_attention_heads=NH,
                  num_key_value_heads=KVH, intermediate_size=FF, vocab_size=V,
                  tie_word_embeddings=True, eos_token_id=eos)
    if fam == "llama":
        return tf.LlamaConfig(max_position_embeddings=131072, rms_norm_eps=1e-5,
                              rope_theta=500000.0, bos_token_id=128000, **common)
    return tf.Qwen2Config(max_position_embeddings=32768, rms_norm_eps=1e-6, rope_theta=1e6,
                          bos_token_id=None, **common)


def make_model(name, root, tokdir, dev):
    """Write a random bf16 model folder; returns (path, weight bytes, params, params without
    the embedding)."""
    import transformers as tf
    out = os.path.join(root, name)
    cfg = hf_config(name)
    torch.manual_seed(0)
    with torch.device(dev):
        m = tf.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    with torch.no_grad():  # norms and biases away from 1 and 0, as in gpu-check.sh
        for n, p in m.named_parameters():
            if "norm" in n or n.endswith(".bias"):
                p.add_(torch.randn_like(p) * 0.1)
    m.save_pretrained(out)
    nbytes = sum(p.numel() * p.element_size() for p in m.parameters())  # tied counted once
    nparams = sum(p.numel() for p in m.parameters())
    nemb = m.get_input_embeddings().weight.numel()
    del m
    if dev == "cuda":
        torch.cuda.empty_cache()
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(tokdir, f), out)
    return out, nbytes, nparams, nparams - nemb


def kv_bytes(name, ctx):
    """bf16 K and V of all layers at ctx positions."""
    _, C, L, NH, KVH, _, _ = SHAPES[name]
    return 2 * L * KVH * (C // NH) * 2 * ctx


# ---- GGUF writer -----------------------------------------------------------------------------

GGML = {"f32": (0, 1, 4), "f16": (1, 1, 2), "q5_0": (6, 32, 22), "q8_0": (8, 32, 34), "q4_k": (12, 256, 144),
        "q6_k": (14, 256, 210)}  # name: (ggml type id, block elements, block bytes)
# the f16 scale fields of a block: (byte offset, lowest, highest value); values chosen so that
# a random block's weights have a spread of about 0.02-0.1, like the bf16 models'
SCALES = {"q5_0": [(0, 1.5e-3, 2.5e-3)], "q8_0": [(0, 2e-4, 3e-4)],
          "q4_k": [(0, 1.0e-4, 1.8e-4), (2, 7e-4, 1.3e-3)], "q6_k": [(208, 6.2e-5, 1e-4)]}
FALLBACK = {"q4_k": "q5_0", "q6_k": "q8_0"}  # llama.cpp's, for rows not a multiple of 256
GGUF_U32, GGUF_I32, GGUF_F32, GGUF_BOOL, GGUF_STR, GGUF_ARR = 4, 5, 6, 7, 8, 9
ALIGN = 32


def _gstr(s):
    b = s.encode("utf-8")
    return struct.pack("<Q", len(b)) + b


def _gkv(key, vtype, value):
    """One metadata entry: key, type, value (arrays: (element type, list))."""
    out = _gstr(key) + struct.pack("<I", vtype)
    if vtype == GGUF_ARR:
        et, items = value
        out += struct.pack("<IQ", et, len(items))
        if et == GGUF_STR:
            out += b"".join(_gstr(x) for x in items)
        elif et == GGUF_I32:
            out += struct.pack(f"<{len(items)}i", *items)
        else:
            raise ValueError(f"array element type {et}")
        return out
    if vtype == GGUF_STR:
        return out + _gstr(value)
    fmt = {GGUF_U32: "<I", GGUF_I32: "<i", GGUF_F32: "<f", GGUF_BOOL: "<B"}[vtype]
    return out + struct.pack(fmt, value)


def use_more_bits(i, n):
    """llama.cpp's choice of the Q4_K_M layers whose attn_v / ffn_down get Q6_K: the first and
    last eighth of the layers and every third layer between."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def gguf_plan(name, quant):
    """The tensors of a qwen2/llama GGUF of shape `name`: [(name, dtype, rows, cols)], matrices
    in the quant's types (with llama.cpp's fallbacks), vectors f32. q4_k_m is llama.cpp's
    Q4_K_M mix: Q4_K, with Q6_K for attn_v and ffn_down of the use_more_bits layers and for
    the (tied) output matrix."""
    fam, C, L, NH, KVH, FF, V = SHAPES[name]
    HS = C // NH
    layer_t, emb_t = {"f16": ("f16", "f16"), "q8_0": ("q8_0", "q8_0"), "q4_k": ("q4_k", "q6_k"),
                      "q4_k_m": ("q4_k", "q6_k")}[quant]

    def mt(t, cols):
        blk = GGML[t][1]
        return t if cols % blk == 0 else FALLBACK[t]
    ts = [("token_embd.weight", mt(emb_t, C), V, C), ("output_norm.weight", "f32", 1, C)]
    for i in range(L):
        p = f"blk.{i}."
        more = quant == "q4_k_m" and use_more_bits(i, L)
        vd_t = "q6_k" if more else layer_t
        ts += [(p + "attn_norm.weight", "f32", 1, C),
               (p + "attn_q.weight", mt(layer_t, C), NH * HS, C),
               (p + "attn_k.weight", mt(layer_t, C), KVH * HS, C),
               (p + "attn_v.weight", mt(vd_t, C), KVH * HS, C),
               (p + "attn_output.weight", mt(layer_t, NH * HS), C, NH * HS),
               (p + "ffn_norm.weight", "f32", 1, C),
               (p + "ffn_gate.weight", mt(layer_t, C), FF, C),
               (p + "ffn_up.weight", mt(layer_t, C), FF, C),
               (p + "ffn_down.weight", mt(vd_t, FF), C, FF)]
        if fam == "qwen2":
            ts += [(p + "attn_q.bias", "f32", 1, NH * HS), (p + "attn_k.bias", "f32", 1, KVH * HS),
                   (p + "attn_v.bias", "f32", 1, KVH * HS)]
    return ts


def gguf_tensor_bytes(dtype, rows, cols):
    _, be, bb = GGML[dtype]
    return rows * (cols // be) * bb


def random_tensor(dtype, rows, cols, dev, gen, is_norm):
    """Random data of one tensor as a CPU uint8 tensor: quantized blocks of random bytes with
    f16 scales in SCALES' ranges; f32 vectors near 1 (norms) or 0 (biases)."""
    n = rows * cols
    if dtype == "f32":
        v = torch.randn(n, generator=gen, device=dev) * 0.1 + (1.0 if is_norm else 0.0)
        return v.float().cpu().view(torch.uint8)
    if dtype == "f16":  # the spread of the bf16 models' initialisation
        return (torch.randn(n, generator=gen, device=dev) * 0.02).half().cpu().view(torch.uint8)
    _, be, bb = GGML[dtype]
    nblk = n // be
    blk = torch.randint(0, 256, (nblk, bb), generator=gen, dtype=torch.uint8, device=dev)
    for off, lo, hi in SCALES[dtype]:
        d = torch.empty(nblk, dtype=torch.float32, device=dev).uniform_(lo, hi, generator=gen)
        blk[:, off:off + 2] = d.to(torch.float16).view(torch.uint8).view(nblk, 2)
    return blk.cpu().view(-1)


def write_gguf(path, name, quant, toks, special, eos, dev, chat_template=None):
    """A GGUF v3 file kiln can run: architecture metadata, the byte-level tokenizer (model
    gpt2, pre qwen2/llama-bpe, tokens, token types, no merges, EOS; chat_template if given),
    random tensors per gguf_plan. Returns (tensor bytes, {dtype: count of matrices})."""
    fam, C, L, NH, KVH, FF, V = SHAPES[name]
    arch = "llama" if fam == "llama" else "qwen2"
    plan = gguf_plan(name, quant)
    kvs = [_gkv("general.architecture", GGUF_STR, arch),
           _gkv("general.name", GGUF_STR, f"{name}-random-{quant}"),
           _gkv("general.alignment", GGUF_U32, ALIGN),
           _gkv(f"{arch}.block_count", GGUF_U32, L),
           _gkv(f"{arch}.context_length", GGUF_U32, 32768),
           _gkv(f"{arch}.embedding_length", GGUF_U32, C),
           _gkv(f"{arch}.feed_forward_length", GGUF_U32, FF),
           _gkv(f"{arch}.attention.head_count", GGUF_U32, NH),
           _gkv(f"{arch}.attention.head_count_kv", GGUF_U32, KVH),
           _gkv(f"{arch}.rope.freq_base", GGUF_F32, 500000.0 if fam == "llama" else 1e6),
           _gkv(f"{arch}.attention.layer_norm_rms_epsilon", GGUF_F32,
                1e-5 if fam == "llama" else 1e-6),
           _gkv(f"{arch}.vocab_size", GGUF_U32, V),
           _gkv("tokenizer.ggml.model", GGUF_STR, "gpt2"),
           _gkv("tokenizer.ggml.pre", GGUF_STR, "llama-bpe" if fam == "llama" else "qwen2"),
           _gkv("tokenizer.ggml.tokens", GGUF_ARR, (GGUF_STR, toks)),
           _gkv("tokenizer.ggml.token_type", GGUF_ARR,
                (GGUF_I32, [3 if i in special else 1 for i in range(len(toks))])),
           _gkv("tokenizer.ggml.merges", GGUF_ARR, (GGUF_STR, [])),
           _gkv("tokenizer.ggml.eos_token_id", GGUF_U32, eos),
           _gkv("tokenizer.ggml.add_bos_token", GGUF_BOOL, 0)]
    if chat_template:
        kvs.append(_gkv("tokenizer.chat_template", GGUF_STR, chat_template))
    infos, off, total, mix = [], 0, 0, {}
    for tname, dt, rows, cols in plan:
        nb = gguf_tensor_bytes(dt, rows, cols)
        dims = [cols] if rows == 1 else [cols, rows]  # GGUF ne[]: innermost first
        infos.append(_gstr(tname) + struct.pack("<I", len(dims)) +
                     struct.pack(f"<{len(dims)}Q", *dims) +
                     struct.pack("<IQ", GGML[dt][0], off))
        off += (nb + ALIGN - 1) // ALIGN * ALIGN
        total += nb
        if rows > 1:
            mix[dt] = mix.get(dt, 0) + 1
    head = b"GGUF" + struct.pack("<IQQ", 3, len(plan), len(kvs)) + b"".join(kvs) + b"".join(infos)
    gen = torch.Generator(device=dev).manual_seed(1234)
    with open(path, "wb") as f:
        f.write(head)
        f.write(b"\0" * (-len(head) % ALIGN))
        for tname, dt, rows, cols in plan:
            data = random_tensor(dt, rows, cols, dev, gen, tname.endswith("norm.weight"))
            assert data.numel() == gguf_tensor_bytes(dt, rows, cols), tname
            data.numpy().tofile(f)
            f.write(b"\0" * (-data.numel() % ALIGN))
    return total, mix


# ---- kiln ------------------------------------------------------------------------------------

def lib_dirs(bindir):
    """Where kiln's shared libraries may be: the bin/build folder and a build's unpacked
    .deb dependencies (scripts/gpu-deps.sh)."""
    return [bindir, os.path.join(bindir, "deps", "usr", "lib", "x86_64-linux-gnu")]


_kiln = None


def kiln_binding(bindir):
    """The Python binding over bindir/libkiln.so. LD_LIBRARY_PATH set after this process
    started does not reach its loader: load the carried libraries by path first, so that
    libkiln.so's needs are met by soname (libcudart: the one torch already loaded)."""
    global _kiln
    if _kiln is None:
        for d in lib_dirs(bindir):
            for f in ("libcjson.so.1", "libpcre2-8.so.0", "libutf8proc.so.2", "libcrypto.so.3"):
                if os.path.exists(os.path.join(d, f)):
                    ctypes.CDLL(os.path.join(d, f), mode=ctypes.RTLD_GLOBAL)
        os.environ["KILN_LIB"] = os.path.join(bindir, "libkiln.so")
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
        import kiln
        _kiln = kiln
    return _kiln


def run_kiln_cli(args, env, path, n_new, reps, fast):
    """kiln generate ... --json, reps processes; returns the runs' JSON objects (fewer when
    one fails: its stderr is printed)."""
    runs = []
    for _ in range(reps):
        cmd = [os.path.join(args.bin, "kiln"), "generate", "-m", path, "-p", PROMPT, "-n",
               str(n_new), "--temp", "0", "--ignore-eos", "--json", "--device", args.device]
        if fast:
            cmd.append("--fast")
        r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
        if r.returncode != 0:
            log(f"kiln {' '.join(cmd[1:])}: rc={r.returncode}: {r.stderr[-2000:]}")
            return runs
        runs.append(json.loads(r.stdout))
    return runs


def summarize_cli(runs):
    dts = [x["decode_tokens_per_s"] for x in runs]
    return dict(decode_tps=dts, median_tps=statistics.median(dts), ids=runs[0]["ids"],
                prompt_ids=runs[0]["prompt_ids"],
                ids_same_each_run=all(x["ids"] == runs[0]["ids"] for x in runs),
                cold_prefill_s=[x["prefill_seconds"] for x in runs])


def first_divergence(a, b):
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def kiln_binding_part(args, path, prompt_ids, prefill_ids, want_logits):
    """Through the binding, for the auditable and the fast mode: the whole prompt's logits
    (want_logits) and warm prefill times of each length of prefill_ids (a list of id lists).
    Returns {"logits": {mode: array}, "prefill": {mode: {T: seconds}}}."""
    kiln = kiln_binding(args.bin)
    dev_index = 0 if args.device == "cuda" else -1
    m = kiln.Model(path)
    out = {"logits": {}, "prefill": {}}
    lens = [len(x) for x in prefill_ids]
    longest = max(lens + [len(prompt_ids)])
    try:
        for mode, fast in (("auditable", False), ("fast", True)):
            ctx = kiln.Context(m, n_ctx=longest + 16, n_batch=max(lens + [512]), device=dev_index,
                               fast=fast)
            try:
                if want_logits:
                    out["logits"][mode] = ctx.decode(prompt_ids, all_logits=True)
                    ctx.truncate(0)
                if prefill_ids:
                    ctx.decode(prefill_ids[0])  # uploads the weights, sizes the workspaces
                    res = {}
                    for ids in prefill_ids:
                        ts = []
                        for _ in range(args.prefill_reps):
                            ctx.truncate(0)
                            t0 = time.perf_counter()
                            ctx.decode(ids)
                            ts.append(time.perf_counter() - t0)
                            if sum(ts) > args.prefill_budget:
                                break
                        res[len(ids)] = statistics.median(ts)
                        log(f"kiln {mode} prefill {len(ids)}: {len(ids) / res[len(ids)]:.0f} tok/s "
                            f"({len(ts)} timed)")
                    out["prefill"][mode] = res
            finally:
                ctx.close()
    finally:
        m.close()
    return out


def logit_diff(fast, aud):
    """max over positions of max|fast - aud| / max|aud| (numpy (T, V) arrays)."""
    import numpy as np
    num = np.abs(fast.astype(np.float64) - aud).max(axis=1)
    den = np.abs(aud.astype(np.float64)).max(axis=1)
    return float((num / np.maximum(den, 1e-30)).max())


# ---- PyTorch ---------------------------------------------------------------------------------

def hf_generate(dev, model, ids, n_new, reps, **kw):
    """transformers generate: decode tok/s = (n_new - 1) / (t(n_new tokens) - t(1 token))."""
    att = torch.ones_like(ids)
    common = dict(attention_mask=att, do_sample=False, pad_token_id=0, **kw)

    def gen(k):
        return model.generate(ids, max_new_tokens=k, min_new_tokens=k, **common)

    gen(8)
    t1 = wall_time(dev, lambda: gen(1), reps)
    out = [None]

    def full():
        out[0] = gen(n_new)
    tn = wall_time(dev, full, reps, warm=0)
    return (n_new - 1) / max(tn - t1, 1e-9), out[0][0, ids.shape[1]:].tolist()


def _rms(x, w, eps):
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return w * xf.to(x.dtype)


def _rot(x):
    h = x.shape[-1] // 2
    return torch.cat([-x[..., h:], x[..., :h]], -1)


def decode_layer(x, cos, sin, mask, pos, ln1, wqkv, bqkv, wo, ln2, wgu, wd, kc, vc, dims):
    """One transformer layer of a decode step at batch B: x [B, C], cos/sin [1, D], mask
    [1, 1, 1, T] (True = masked), pos [1] (the same position for every sequence), caches
    kc/vc [B, KVH, T, D] written at pos; dims = (NH, KVH, D, eps). Returns the new x."""
    NH, KVH, D, eps = dims
    B, G = x.shape[0], NH // KVH
    h = _rms(x, ln1, eps)
    qkv = F.linear(h, wqkv, bqkv)
    q = qkv[:, :NH * D].view(B, NH, D)
    k = qkv[:, NH * D:(NH + KVH) * D].view(B, KVH, D)
    v = qkv[:, (NH + KVH) * D:].view(B, KVH, 1, D)
    q = q * cos + _rot(q) * sin
    k = k * cos + _rot(k) * sin
    kc.index_copy_(2, pos, k.view(B, KVH, 1, D))
    vc.index_copy_(2, pos, v)
    s = torch.matmul(q.view(B, KVH, G, D), kc.transpose(-1, -2)).float() * (D ** -0.5)
    s = s.masked_fill(mask, float("-inf"))  # [B, KVH, G, T]
    pr = torch.softmax(s, -1).to(x.dtype)
    o = torch.matmul(pr, vc).reshape(B, NH * D)
    x = x + F.linear(o, wo)
    h = _rms(x, ln2, eps)
    gu = F.linear(h, wgu)
    ff = gu.shape[-1] // 2
    return x + F.linear(F.silu(gu[:, :ff]) * gu[:, ff:], wd)


_compiled_layer = None


def compiled_layer():
    """decode_layer torch.compile'd once: every layer (and every model of the same shapes)
    reuses the compiled code, guarded on the arguments' shapes, so a model compiles in
    seconds instead of tracing its whole step."""
    global _compiled_layer
    if _compiled_layer is None:
        import torch._dynamo as dyn
        for k in ("cache_size_limit", "recompile_limit", "accumulated_cache_size_limit"):
            try:  # names differ between torch versions
                setattr(dyn.config, k, max(getattr(dyn.config, k), 256))
            except (AttributeError, TypeError):
                pass
        _compiled_layer = torch.compile(decode_layer, dynamic=False)
    return _compiled_layer


class GraphDecoder:
    """A bf16 decode step of B sequences of the same length: static KV caches, q/k/v and
    gate/up fused into one matmul each, rope from tables indexed by a device position,
    attention as two batched matmuls over the whole (masked) cache, greedy argmax on the
    device; on the GPU one step is captured in one CUDA graph that also advances tok and pos,
    so replays need no host work. On the CPU (smoke mode) replay() runs the step eagerly."""

    def __init__(self, hf, T, B=1, compile=False):
        cfg = hf.config
        dev_t = hf.model.embed_tokens.weight.device
        self.cuda = dev_t.type == "cuda"
        self.layer_fn = compiled_layer() if compile else decode_layer
        sd = dict(hf.state_dict())
        C, L = cfg.hidden_size, cfg.num_hidden_layers
        NH, KVH = cfg.num_attention_heads, cfg.num_key_value_heads
        D = getattr(cfg, "head_dim", None) or C // NH
        self.dims = (NH, KVH, D, float(cfg.rms_norm_eps))
        self.T, self.B, self.L = T, B, L
        p = "model.layers.{}."
        self.layers = []
        for i in range(L):
            def g(n):
                return sd.get(p.format(i) + n)
            bias = [g(f"self_attn.{x}_proj.bias") for x in "qkv"]
            self.layers.append(dict(
                ln1=g("input_layernorm.weight"), ln2=g("post_attention_layernorm.weight"),
                wqkv=torch.cat([g("self_attn.q_proj.weight"), g("self_attn.k_proj.weight"),
                                g("self_attn.v_proj.weight")]).contiguous(),
                bqkv=torch.cat(bias).contiguous() if all(b is not None for b in bias) else None,
                wo=g("self_attn.o_proj.weight"),
                wgu=torch.cat([g("mlp.gate_proj.weight"), g("mlp.up_proj.weight")]).contiguous(),
                wd=g("mlp.down_proj.weight")))
        self.emb = sd["model.embed_tokens.weight"]
        self.head = sd.get("lm_head.weight", self.emb)
        self.norm = sd["model.norm.weight"]
        bf = self.emb.dtype
        rp = getattr(cfg, "rope_parameters", None) or {}
        theta = rp.get("rope_theta", getattr(cfg, "rope_theta", 1e6))
        inv = 1.0 / theta ** (torch.arange(0, D, 2, dtype=torch.float32, device=dev_t) / D)
        f = torch.outer(torch.arange(T, dtype=torch.float32, device=dev_t), inv)
        e = torch.cat([f, f], -1)
        self.cos, self.sin = e.cos().to(bf), e.sin().to(bf)
        self.kc = [torch.zeros(B, KVH, T, D, dtype=bf, device=dev_t) for _ in range(L)]
        self.vc = [torch.zeros_like(x) for x in self.kc]
        self.ar = torch.arange(T, device=dev_t)
        self.tok = torch.zeros(B, dtype=torch.long, device=dev_t)
        self.pos = torch.zeros(1, dtype=torch.long, device=dev_t)
        self.out = torch.zeros(T + 1, B, dtype=torch.long, device=dev_t)
        self.logits = None
        self.graph = None

    def step(self):
        cos, sin = self.cos.index_select(0, self.pos), self.sin.index_select(0, self.pos)
        mask = (self.ar > self.pos).view(1, 1, 1, self.T)
        x = self.emb.index_select(0, self.tok)  # [B, C]
        for i, ly in enumerate(self.layers):
            x = self.layer_fn(x, cos, sin, mask, self.pos, ly["ln1"], ly["wqkv"], ly["bqkv"],
                              ly["wo"], ly["ln2"], ly["wgu"], ly["wd"], self.kc[i], self.vc[i],
                              self.dims)
        logits = F.linear(_rms(x, self.norm, self.dims[3]), self.head)  # [B, V]
        nxt = logits.argmax(-1)
        self.out.index_copy_(0, self.pos + 1, nxt.view(1, self.B))
        self.tok.copy_(nxt)
        self.pos.add_(1)
        return logits

    def capture(self):
        """Warm up (compiling first when asked), then capture one step (GPU only)."""
        if not self.cuda:
            self.logits = self.step()
            self.reset()
            return
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(3):
                self.logits = self.step()
        torch.cuda.current_stream().wait_stream(s)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.logits = self.step()
        self.reset()

    def replay(self):
        if self.graph is not None:
            self.graph.replay()
        else:
            self.logits = self.step()

    def reset(self):
        for x in self.kc + self.vc:
            x.zero_()
        self.pos.zero_()

    def prompt(self, ids):
        """Run the prompts [B, n] one position at a time through the step (teacher forcing)."""
        self.reset()
        for t in range(ids.shape[1]):
            self.tok.copy_(ids[:, t])
            self.replay()

    def decode(self, n):
        for _ in range(n - 1):
            self.replay()


def graph_decode(dev, m, prompts, n_new, reps, B, comp):
    """The graph step at batch B on prompts [B, n]: returns dict(tps (all sequences), ids of
    row 0, first-step logits rel L2 vs transformers (max over rows), setup seconds)."""
    n_prompt = prompts.shape[1]
    t0 = time.time()
    gd = GraphDecoder(m, T=n_prompt + n_new + 8, B=B, compile=comp)
    gd.capture()
    setup = time.time() - t0
    gd.reset()
    gd.tok.copy_(prompts[:, 0])
    gd.replay()
    with torch.no_grad():
        hl = m(prompts[:, :1]).logits[:, -1].float()
    gl = gd.logits.float()
    rel = max(((hl[b] - gl[b]).norm() / hl[b].norm()).item() for b in range(B))
    gd.prompt(prompts)
    gd.decode(n_new)
    gen = gd.out[n_prompt:n_prompt + n_new, 0].tolist()
    ts = []
    for _ in range(reps):
        gd.prompt(prompts)
        ts.append(dev_time(dev, lambda: gd.decode(n_new), 1, warm=0))
    del gd
    return dict(tps=B * (n_new - 1) / statistics.median(ts), ids=gen,
                first_logits_rel_l2_vs_hf=rel, setup_s=setup)


# ---- one model -------------------------------------------------------------------------------

def prefill_flops(r, T):
    _, C, L, NH, _, _, V = SHAPES[r["model"]]
    return 2 * r["params_nonemb"] * T + 2 * T * T * (C // NH) * NH * L + 2 * V * C


def can_afford(args, cost):
    """Whether an optional piece of about `cost` seconds fits the --budget, keeping
    --reserve seconds for each model still to come."""
    return time.time() + cost + args.reserve * args.models_after < args.t_end


def bench_model(name, args, dev_info, env, res, rows):
    V = SHAPES[name][6]
    dev = args.device
    special, eos = special_tokens(name)
    id_hi = min(special)  # random ids stay below the special tokens
    tokdir = os.path.join(args.work, f"tok-{V}")
    toks = write_tokenizer(tokdir, V, special, eos)
    r = dict(model=name)
    res.append(r)
    hf_parts = [p for p in args.parts if p != "quant"]
    bw = args.bw
    tag = {"auditable": "kiln auditable", "fast": "kiln fast"}
    if dev == "cpu":
        tag = {"auditable": "kiln cpu (exact)", "fast": "kiln cpu --fast (q8 activations)"}
    g = torch.Generator().manual_seed(1)
    n_prompt_default = len(PROMPT.encode())  # one token per byte
    path = None
    if hf_parts:
        t0 = time.time()
        path, wbytes, nparams, nonemb = make_model(name, args.work, tokdir, dev)
        r.update(params=nparams, params_nonemb=nonemb, weight_bytes=wbytes)
        log(f"== {name}: {nparams / 1e6:.1f}M params, {wbytes / 1e9:.3f} GB bf16, written in "
            f"{time.time() - t0:.1f} s")

    # ---- kiln: the CLI (decode), then the binding (prompt logits of both modes, prefill)
    kiln_tps, cli, prompt_ids = {}, {}, None
    if "decode" in args.parts:
        for mode in ("auditable", "fast"):
            runs = run_kiln_cli(args, env, path, args.new, args.kiln_reps, mode == "fast")
            if runs:
                cli[mode] = summarize_cli(runs)
                kiln_tps[mode] = cli[mode]["median_tps"]
                log(f"{tag[mode]} cli: decode tok/s {[round(x, 1) for x in cli[mode]['decode_tps']]}, "
                    f"same ids each run: {cli[mode]['ids_same_each_run']}")
        r["kiln_cli"] = {k: {kk: vv for kk, vv in v.items() if kk != "prompt_ids"}
                         for k, v in cli.items()}
        if cli:
            prompt_ids = next(iter(cli.values()))["prompt_ids"]
    if prompt_ids is None:
        prompt_ids = torch.randint(0, id_hi, (n_prompt_default,), generator=g).tolist()
    n_prompt = len(prompt_ids)
    r["n_prompt"] = n_prompt
    if cli:
        r["prompt_ids"] = prompt_ids  # kiln's tokenization of PROMPT with the HF folder
    pre_ids = [torch.randint(0, id_hi, (n,), generator=g).tolist() for n in args.prefill]
    if "prefill" not in args.parts:
        pre_ids = []
    want_logits = "auditable" in cli and "fast" in cli
    binding = {"logits": {}, "prefill": {}}
    if want_logits or pre_ids:
        try:
            binding = kiln_binding_part(args, path, prompt_ids, pre_ids, want_logits)
        except Exception as e:  # report, carry on with PyTorch
            log(f"kiln binding failed: {e!r}")
    r["kiln_prefill_s"] = binding["prefill"]

    # ---- decode rows: roofline, kiln's two modes
    if "decode" in args.parts:
        tok_bytes = r["weight_bytes"] + kv_bytes(name, n_prompt + args.new / 2)
        roof = bw / tok_bytes
        r.update(bytes_per_token=tok_bytes, roofline_tps=roof)
        rows.append((name, "decode b1", "roofline", roof, 1.0,
                     f"{tok_bytes / 1e9:.3f} GB/token at {bw / 1e9:.0f} GB/s"))
        notes = {"auditable": "CPU's bits" if dev == "cuda" else "", "fast": ""}
        if want_logits:
            a, f = cli["auditable"], cli["fast"]
            n_eq = sum(x == y for x, y in zip(a["ids"], f["ids"]))
            div = first_divergence(a["ids"], f["ids"])
            cost = f["median_tps"] / a["median_tps"]
            fva = dict(auditable_cost=cost, ids_equal=n_eq, n_ids=len(a["ids"]), first_divergence=div)
            notes["fast"] = (f"auditable cost {cost:.2f}x; greedy ids equal {n_eq}/{len(a['ids'])}, "
                             f"first divergence {div if div < len(a['ids']) else 'none'} "
                             f"({len(set(a['ids']))} distinct ids in the auditable run)")
            lg = binding["logits"]
            if "fast" in lg and "auditable" in lg:
                d = logit_diff(lg["fast"], lg["auditable"])
                fva["max_norm_logit_diff"] = d
                notes["fast"] += f"; max norm logit diff {d:.2e} ({n_prompt} prompt positions)"
            else:
                notes["fast"] += "; logit diff: binding failed"
            r["fast_vs_auditable"] = fva
        for mode in ("auditable", "fast"):
            if mode in cli:
                same = "" if cli[mode]["ids_same_each_run"] else "; ids differ between runs!"
                rows.append((name, "decode b1", tag[mode], kiln_tps[mode], kiln_tps[mode] / roof,
                             notes[mode] + same))
            else:
                rows.append((name, "decode b1", tag[mode], None, None, "failed (see log)"))

    # ---- transformers (sdpa first: the reference ids; eager last, if time allows) and the
    # plain-PyTorch step
    if hf_parts:
        import transformers as tf
        ids = torch.tensor([prompt_ids], device=dev)
        ref_ids = None
        impls = ["sdpa"]
        if "decode" in args.parts and not args.quick:
            impls.append("eager")
        for impl in impls:
            if impl == "eager" and not can_afford(args, 30):
                rows.append((name, "decode b1", "transformers generate, eager", None, None,
                             "skipped (--budget)"))
                continue
            m = tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16,
                                                        attn_implementation=impl).to(dev).eval()
            with torch.no_grad():
                if "decode" in args.parts:
                    tps, out = hf_generate(dev, m, ids, args.new, args.hf_reps)
                    rows.append((name, "decode b1", f"transformers generate, {impl}", tps,
                                 tps / r["roofline_tps"], ""))
                    log(f"transformers {impl}: {tps:.1f} tok/s")
                    if impl == "sdpa":
                        ref_ids = out
                if impl == "sdpa":
                    if pre_ids:
                        tp = {}
                        for x in pre_ids:
                            xt = torch.tensor([x], device=dev)
                            tp[len(x)] = dev_time(dev, lambda: m(xt, logits_to_keep=1),
                                                  args.hf_prefill_reps, warm=1)
                            log(f"transformers sdpa prefill {len(x)}: {len(x) / tp[len(x)]:.0f} tok/s")
                        r["torch_prefill_s"] = tp
                    bench_graph_steps(name, args, m, prompt_ids, ref_ids, id_hi, r, rows, path)
                    if "decode" in args.parts and not args.quick:
                        if can_afford(args, 20):
                            try:
                                tps, _ = hf_generate(dev, m, ids, args.new, args.hf_reps,
                                                     cache_implementation="static",
                                                     disable_compile=True)
                                rows.append((name, "decode b1",
                                             "transformers generate, sdpa, static cache", tps,
                                             tps / r["roofline_tps"], ""))
                                log(f"transformers sdpa static cache: {tps:.1f} tok/s")
                            except Exception as e:
                                log(f"transformers static cache failed: {e!r}")
                        else:
                            rows.append((name, "decode b1", "transformers generate, sdpa, static cache",
                                         None, None, "skipped (--budget)"))
            del m
            if dev == "cuda":
                torch.cuda.empty_cache()

    # ---- prefill rows
    if pre_ids and "params_nonemb" in r:
        rate = dev_info["matmul_bf16_TFLOPs"] * 1e12
        for n in args.prefill:
            fl = prefill_flops(r, n)
            cells = [(tag[mode], r["kiln_prefill_s"].get(mode, {}).get(n))
                     for mode in ("auditable", "fast")]
            cells.append(("transformers sdpa forward", r.get("torch_prefill_s", {}).get(n)))
            t_aud = cells[0][1]
            for eng, t in cells:
                note = f"{fl / 1e12:.2f} TFLOP, {1e3 * t:.1f} ms" if t else "failed (see log)"
                if t and t_aud and eng == tag["fast"]:
                    note += f"; auditable cost {t_aud / t:.2f}x"
                rows.append((name, f"prefill {n}", eng, n / t if t else None,
                             fl / t / rate if t else None, note))
    if path and not args.keep:
        shutil.rmtree(path, ignore_errors=True)

    # ---- quantized decode
    if "quant" in args.parts and name in args.quant_models:
        bench_quant(name, args, env, r, rows, toks, special, eos, kiln_tps, bw, tag)


def kiln_batch_decode(args, path, prompts, n_new):
    """kiln's batched decode through the binding (kiln_decode_batch), auditable and fast: B
    sequences prefilled one by one (decode_seq), one warm step, then n_new - 1 timed steps of
    one token per sequence. The tokens fed are each sequence's greedy token of the first step,
    repeated (no sampling: the logits stay on the device), so the figure is the engine's
    decode step. Returns {mode: tok/s of all sequences}."""
    kiln = kiln_binding(args.bin)
    dev_index = 0 if args.device == "cuda" else -1
    B = len(prompts)
    m = kiln.Model(path)
    out = {}
    try:
        for mode, fast in (("auditable", False), ("fast", True)):
            n = max(len(p) for p in prompts)
            ctx = kiln.Context(m, n_ctx=n + n_new + 8, n_batch=max(B, n), device=dev_index,
                               fast=fast, n_seq=B)
            try:
                for b, p in enumerate(prompts):
                    ctx.decode_seq(b, p)
                first = ctx.decode_batch([int(p[-1]) for p in prompts])
                ids = [int(x) for x in first.argmax(axis=1)]
                ctx.decode_batch(ids, logits=False)  # records the graph for this B
                t0 = time.perf_counter()
                for _ in range(n_new - 1):
                    ctx.decode_batch(ids, logits=False)
                dt = time.perf_counter() - t0
                out[mode] = B * (n_new - 1) / dt
                log(f"kiln {mode} batch {B}: {out[mode]:.1f} tok/s")
            finally:
                ctx.close()
    finally:
        m.close()
    return out


def bench_graph_steps(name, args, m, prompt_ids, ref_ids, id_hi, r, rows, path=None):
    """The PyTorch step at batch 1 (decode part) and at batch --batch (batch8 part), eager and
    (unless --no-compile / --quick) torch.compile'd. Row 0 of a batch is the decode prompt, the
    other rows random ids below id_hi (no special tokens)."""
    dev = args.device
    variants = [False, True] if args.compile else [False]
    g = torch.Generator().manual_seed(2)
    cases = []
    if "decode" in args.parts:
        cases.append(1)
    if "batch8" in args.parts:
        cases.append(args.batch)
    for B in cases:
        n = len(prompt_ids)
        prompts = torch.cat([torch.tensor([prompt_ids]),
                             torch.randint(0, id_hi, (B - 1, n), generator=g)])
        prompts = prompts.to(dev)
        fig = "decode b1" if B == 1 else f"decode b{B}"
        roof = B * args.bw / (r["weight_bytes"] + B * kv_bytes(name, n + args.new / 2))
        if B > 1:
            rows.append((name, fig, "roofline", roof, 1.0,
                         f"{(r['weight_bytes'] + B * kv_bytes(name, n + args.new / 2)) / 1e9:.3f} GB/step"))
            try:
                kb = kiln_batch_decode(args, path, [list(map(int, x)) for x in prompts.tolist()],
                                       args.new)
                r["kiln_batch"] = kb
                for mode in ("auditable", "fast"):
                    if mode in kb:
                        rows.append((name, fig, f"kiln {mode}", kb[mode], kb[mode] / roof,
                                     f"{kb[mode] / B:.1f} tok/s per sequence; kiln_decode_batch, "
                                     "one graph per step, tokens fed (no sampling)"))
            except Exception as e:
                log(f"kiln batch {B} failed: {e!r}")
                rows.append((name, fig, "kiln", KILN_NO_BATCH, None, f"failed: {e!r}"[:120]))
        for comp in variants:
            label = ("PyTorch graph step" if dev == "cuda" else "PyTorch step (cpu, no graph)") + \
                (", torch.compile" if comp else "")
            if comp and not can_afford(args, 45):
                rows.append((name, fig, label, None, None, "skipped (--budget)"))
                continue
            try:
                x = graph_decode(dev, m, prompts, args.new, args.graph_reps, B, comp)
            except Exception as e:
                log(f"{label} B={B} failed: {e!r}")
                rows.append((name, fig, label, None, None, "failed (see log)"))
                continue
            note = f"first-step logits rel L2 vs HF {x['first_logits_rel_l2_vs_hf']:.1e}"
            if B == 1 and ref_ids:
                a = first_divergence(x["ids"], ref_ids)
                note += f"; greedy = HF sdpa for {a}/{len(ref_ids)}"
                x["greedy_agree_with_hf_sdpa"] = a
            if B > 1:
                note += f"; {x['tps'] / B:.1f} tok/s per sequence"
                b1 = r.get("graph", {}).get(("b1", comp))
                if b1:
                    note += f"; row 0 greedy = b1's for {first_divergence(x['ids'], b1)}"
            note += f"; setup {x['setup_s']:.1f} s"
            r.setdefault("graph", {})[(f"b{B}", comp)] = x["ids"]
            r.setdefault("graph_steps", []).append(dict(B=B, compile=comp, tps=x["tps"],
                                                        rel_l2=x["first_logits_rel_l2_vs_hf"],
                                                        setup_s=x["setup_s"]))
            rows.append((name, fig, label, x["tps"], x["tps"] / roof, note))
            log(f"{label} B={B}: {x['tps']:.1f} tok/s; {note}")
    r.pop("graph", None)  # tuple keys: not for the JSON


def bench_quant(name, args, env, r, rows, toks, special, eos, kiln_tps, bw, tag):
    n_prompt = r.get("n_prompt", len(PROMPT.encode()))
    for q in args.quant:
        path = os.path.join(args.work, f"{name}-{q}.gguf")
        t0 = time.time()
        try:
            nbytes, mix = write_gguf(path, name, q, toks, special, eos, args.device)
        except Exception as e:
            log(f"GGUF {q} not written: {e!r}")
            rows.append((name, f"decode b1 {q}", "kiln", None, None, "GGUF writer failed"))
            continue
        tok_bytes = nbytes + kv_bytes(name, n_prompt + args.new / 2)
        roof = bw / tok_bytes
        mixs = ", ".join(f"{v} {k}" for k, v in sorted(mix.items()))
        log(f"== {name} {q}: {nbytes / 1e9:.3f} GB of tensors ({mixs} matrices), written in "
            f"{time.time() - t0:.1f} s")
        rows.append((name, f"decode b1 {q}", "roofline (quantized)", roof, 1.0,
                     f"{tok_bytes / 1e9:.3f} GB/token; matrices: {mixs}"))
        qr = dict(file_bytes=os.path.getsize(path), tensor_bytes=nbytes, mix=mix, roofline_tps=roof)
        for mode in ("auditable", "fast"):
            runs = run_kiln_cli(args, env, path, args.new, args.quant_reps, mode == "fast")
            if not runs:
                rows.append((name, f"decode b1 {q}", tag[mode], None, None, "failed (see log)"))
                continue
            s = summarize_cli(runs)
            qr[mode] = dict(decode_tps=s["decode_tps"], ids_same_each_run=s["ids_same_each_run"],
                            prompt_ids_equal_hf_folder=s["prompt_ids"] == r.get("prompt_ids"))
            ratio = f"{s['median_tps'] / kiln_tps[mode]:.2f}x kiln bf16 {mode}" if mode in kiln_tps \
                else "no bf16 figure"
            if "prompt_ids" in r and s["prompt_ids"] != r["prompt_ids"]:
                ratio += "; prompt ids differ from the bf16 folder's!"
            rows.append((name, f"decode b1 {q}", tag[mode], s["median_tps"], s["median_tps"] / roof,
                         ratio))
            log(f"{tag[mode]} {q}: {s['median_tps']:.1f} tok/s ({ratio})")
        if args.llama_bench:
            lb = run_llama_bench(args, env, path, qr)
            fast = qr.get("fast", {}).get("decode_tps")
            if lb is None:
                rows.append((name, f"decode b1 {q}", "llama.cpp CUDA", None, None,
                             "failed (see log)"))
            else:
                note = f"llama-bench tg{args.new}, -ngl 99, flash attention {lb['fa']}, " \
                       f"{len(lb['ts'])} reps"
                if fast:
                    note += f"; kiln fast / llama.cpp {statistics.median(fast) / lb['tps']:.2f}x"
                rows.append((name, f"decode b1 {q}", "llama.cpp CUDA", lb["tps"], lb["tps"] / roof,
                             note))
                log(f"llama.cpp {q}: {lb['tps']:.1f} tok/s ({note})")
        r.setdefault("quant", {})[q] = qr
        if not args.keep:
            os.remove(path)


def run_llama_bench(args, env, path, qr):
    """llama.cpp's decode of the same file: `llama-bench -m PATH -ngl 99 -p 0 -n NEW -r REPS
    -o json` (its default flash-attention setting). Returns dict(tps (mean of the reps, as
    llama-bench reports), ts (each rep), fa) or None."""
    cmd = [args.llama_bench, "-m", path, "-ngl", "99", "-p", "0", "-n", str(args.new), "-r",
           str(args.llama_reps), "-o", "json"]
    p = None
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
        out = json.loads(p.stdout)
        e = next(x for x in out if x.get("n_gen") == args.new)
    except (OSError, subprocess.SubprocessError, ValueError, StopIteration) as e:
        log(f"llama-bench {path}: {e!r}; stderr: {p.stderr[-1500:] if p else ''}")
        return None
    lb = dict(tps=e["avg_ts"], ts=e.get("samples_ts", []), fa=e.get("flash_attn"),
              build=e.get("build_commit"), backends=e.get("backends"))
    qr["llama_cpp"] = lb
    return lb


# ---- main ------------------------------------------------------------------------------------

def figure_rank(fig):
    """Table order within a model (a stable sort keeps the measuring order inside a figure):
    decode b1, decode bB, prefill (by length), quantized decode."""
    if fig == "decode b1":
        return (0, 0)
    if fig.startswith("decode b1 "):
        return (3, 0)
    if fig.startswith("decode b"):
        return (1, 0)
    if fig.startswith("prefill "):
        return (2, int(fig.split()[1]))
    return (4, 0)


def fmt_row(row):
    model, fig, eng, val, frac, note = row
    if isinstance(val, str):
        v = val
    elif val is None:
        v = "-"
    else:
        v = f"{val:.1f}" if val < 1000 else f"{val:.0f}"
    f = "-" if frac is None else f"{100 * frac:.1f}%"
    return f"| {model} | {fig} | {eng} | {v} | {f} | {note} |"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--bin", required=True, help="folder with kiln and libkiln.so")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--models", default="0.5b,1.5b,3b", help="0.5b, 1.5b, 3b, tiny")
    ap.add_argument("--parts", default=",".join(PARTS))
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--new", type=int, default=None, help="tokens generated (128; quick 32)")
    ap.add_argument("--prefill", default=None, help="prefill lengths (512,4096; quick 512)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--quant", default="q8_0,q4_k")
    ap.add_argument("--quant-models", default=None,
                    help="models of the quant part (default: those of --models among 0.5b, 1.5b, 3b, tiny)")
    ap.add_argument("--kiln-reps", type=int, default=None, help="kiln processes per mode (2; quick 1)")
    ap.add_argument("--quant-reps", type=int, default=1)
    ap.add_argument("--llama-bench", default=None,
                    help="llama.cpp's llama-bench (a CUDA build): also time its decode of each GGUF")
    ap.add_argument("--llama-reps", type=int, default=3)
    ap.add_argument("--keep", action="store_true",
                    help="leave the model folders and GGUF files in --work (for a profile after)")
    ap.add_argument("--hf-reps", type=int, default=1)
    ap.add_argument("--hf-prefill-reps", type=int, default=None, help="(5; quick 2)")
    ap.add_argument("--graph-reps", type=int, default=None, help="(5; quick 2)")
    ap.add_argument("--prefill-reps", type=int, default=None, help="kiln prefill reps (2; quick 1)")
    ap.add_argument("--prefill-budget", type=float, default=10.0,
                    help="stop repeating a kiln prefill after this many seconds")
    ap.add_argument("--budget", type=float, default=500.0,
                    help="seconds: optional pieces (torch.compile'd steps, transformers eager and "
                         "static cache) are skipped when they would not fit")
    ap.add_argument("--reserve", type=float, default=110.0,
                    help="seconds kept for each model still to come when deciding that")
    ap.add_argument("--work", default="/tmp/kiln-gpu-bench")
    ap.add_argument("--json", default=None)
    ap.add_argument("--no-compile", dest="compile", action="store_false",
                    help="skip the torch.compile'd graph steps")
    args = ap.parse_args()
    q = args.quick
    args.new = args.new or (32 if q else 128)
    args.prefill = [int(x) for x in (args.prefill or ("512" if q else "512,4096")).split(",") if x]
    args.kiln_reps = args.kiln_reps or (1 if q else 2)
    args.hf_prefill_reps = args.hf_prefill_reps or (2 if q else 5)
    args.graph_reps = args.graph_reps or (2 if q else 5)
    args.prefill_reps = args.prefill_reps or (1 if q else 2)
    if q or args.device == "cpu":
        args.compile = False
    args.parts = [p for p in args.parts.split(",") if p]
    bad = [p for p in args.parts if p not in PARTS]
    if bad:
        ap.error(f"unknown parts {bad} (known: {', '.join(PARTS)})")
    args.quant = [x for x in args.quant.split(",") if x]
    if any(x not in QUANTS for x in args.quant):
        ap.error(f"--quant: some of {', '.join(QUANTS)}")
    models = [ALIASES.get(x, x) for x in args.models.split(",") if x]
    for x in models:
        if x not in SHAPES:
            ap.error(f"unknown model {x} (known: {', '.join(list(ALIASES) + ['tiny'])})")
    if args.quant_models is None:
        args.quant_models = [x for x in models if x in QUANT_SHAPES]
    else:
        args.quant_models = [ALIASES.get(x, x) for x in args.quant_models.split(",") if x]
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("no CUDA device visible to torch (use --device cpu for the smoke mode)")
    args.bin = os.path.abspath(args.bin)
    for f in ("kiln", "libkiln.so"):
        if not os.path.exists(os.path.join(args.bin, f)):
            log(f"warning: {args.bin}/{f} missing")
    os.makedirs(args.work, exist_ok=True)
    env = dict(os.environ)
    env["LD_LIBRARY_PATH"] = ":".join(lib_dirs(args.bin) + [env.get("LD_LIBRARY_PATH", "")])
    t_start = time.time()

    import transformers as tf
    info = dict(device=args.device, torch=torch.__version__, transformers=tf.__version__,
                cuda=torch.version.cuda, args={k: v for k, v in vars(args).items()})
    if args.device == "cuda":
        info["gpu"] = torch.cuda.get_device_name(0)
        try:
            info["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version",
                                             "--format=csv,noheader"], capture_output=True,
                                            text=True).stdout.strip()
        except OSError:
            info["driver"] = "?"
    try:
        info["kiln_commit"] = open(os.path.join(args.bin, "COMMIT")).read().strip()
    except OSError:
        info["kiln_commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"],
                                             capture_output=True, text=True,
                                             cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
    log(json.dumps(info))
    dev_info = measure_device(args.device)
    args.bw = dev_info["copy_rw_GBps"] * 1e9
    log(json.dumps({k: round(v, 2) if isinstance(v, float) else v for k, v in dev_info.items()}))
    res, rows = [], []
    args.t_end = t_start + args.budget

    def dump_json():  # after every model: a run stopped from outside keeps what it measured
        if args.json:
            with open(args.json, "w") as f:
                json.dump(dict(info=info, device=dev_info, results=res,
                               total_s=time.time() - t_start,
                               table=[dict(zip(("model", "figure", "engine", "value",
                                                "fraction", "notes"), x)) for x in rows]),
                          f, indent=1)
    for i, name in enumerate(models):
        args.models_after = len(models) - 1 - i
        if time.time() > args.t_end - 30:
            log(f"-- {name}: skipped (--budget {args.budget:.0f} s spent)")
            rows.append((name, "-", "-", None, None, "skipped (--budget)"))
            continue
        t0 = time.time()
        try:
            bench_model(name, args, dev_info, env, res, rows)
        except Exception as e:  # one model's failure must not lose the others' figures
            import traceback
            traceback.print_exc()
            log(f"{name}: failed: {e!r}")
            rows.append((name, "-", "-", None, None, f"failed: {e!r}"[:200]))
        log(f"-- {name}: {time.time() - t0:.0f} s (total {time.time() - t_start:.0f} s)")
        dump_json()
    total = time.time() - t_start

    log("")
    log(f"==== bench_gpu: {info.get('gpu', args.device)}, kiln {info['kiln_commit']}, "
        f"torch {torch.__version__}, transformers {tf.__version__}; {total:.0f} s")
    log(f"copy {dev_info['copy_rw_GBps']:.0f} GB/s read + write (d2d copy of "
        f"{dev_info['copy_bytes'] >> 20} MiB), read-only sum {dev_info['read_sum_GBps']:.0f} GB/s, "
        f"bf16 matmul {dev_info['matmul_bf16_TFLOPs']:.3g} TFLOP/s ({dev_info['matmul_n']}^3); "
        f"decode b1: {args.new} greedy tokens after {len(PROMPT.encode())} prompt tokens")
    log("value: tok/s (decode b8: all sequences); vs ceiling: decode = % of the roofline, "
        "prefill = % of the bf16 matmul rate, quantized decode = % of the quantized roofline")
    log("| model | figure | engine | value | vs ceiling | notes |")
    log("| --- | --- | --- | ---: | ---: | --- |")
    for row in sorted(rows, key=lambda x: (models.index(x[0]), figure_rank(x[1]))):
        log(fmt_row(row))

if __name__ == "__main__":
    main()
