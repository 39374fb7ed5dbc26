#!/usr/bin/env python3
"""bench_gpu.py -- GPU inference benchmark (issue 4), one run on one GPU, side by side:

  kiln `generate --device cuda` (auditable mode: the CPU's bits)  vs  transformers generate
  (bf16: eager, sdpa, sdpa + static cache; no torch.compile)  vs  a plain-PyTorch bf16 decode
  step (static KV cache, qkv and gate/up fused, greedy argmax on the device) captured in ONE
  CUDA graph  vs  the roofline: bytes read per token (bf16 weights + bf16 KV cache) over the
  device-to-device copy bandwidth measured in the same run.

Models: random weights of real shapes, written here with transformers (bf16 safetensors) plus
a 151,936-token tokenizer.json that kiln loads (the synthetic one scripts/gpu-check.sh uses).

  python3 bench/bench_gpu.py --bin DIR [--models 0.5b,1.5b] [--new 128] [--prefill 512]
      [--json OUT.json]
  DIR holds kiln (built with -DKILN_CUDA=ON) and the shared libraries it needs, and
  libkiln.so (optional: kiln's warm 512-token prefill through the Python binding).
  The tokenizer is written by write_tokenizer (the same file as gpu-check.sh's tok/).
Prints a table last. Decode is batch 1, greedy, --new tokens after a short prompt.
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

SHAPES = {  # name: (hidden, layers, heads, kv heads, ff)
    "Qwen2.5-0.5B": (896, 24, 14, 2, 4864),
    "Qwen2.5-1.5B": (1536, 28, 12, 2, 8960),
}
ALIASES = {"0.5b": "Qwen2.5-0.5B", "1.5b": "Qwen2.5-1.5B"}
VOCAB = 151936
PROMPT = "The quick brown fox jumps over the lazy dog."


def log(*a):
    print(*a, flush=True)


def cuda_time(fn, reps, warm=2):
    """Median seconds of fn() over reps, CUDA events around each call."""
    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) / 1e3)
    return statistics.median(ts)


def wall_time(fn, reps, warm=1):
    for _ in range(warm):
        fn()
    ts = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def measure_device():
    """Copy bandwidth (4 GiB d2d copy), read-only bandwidth (sum of 4 GiB), bf16 matmul rate."""
    nb = 4 << 30
    x = torch.empty(nb, dtype=torch.uint8, device="cuda")
    x.random_()
    y = torch.empty_like(x)
    t = cuda_time(lambda: y.copy_(x), 10)
    xf = x.view(torch.float32)
    tr = cuda_time(lambda: xf.sum(), 10)
    del x, y, xf
    n = 8192
    a = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    tm = cuda_time(lambda: a @ b, 10, warm=3)
    del a, b
    torch.cuda.empty_cache()
    return {
        "copy_bytes": nb, "copy_s": t,
        "copy_rw_GBps": 2 * nb / t / 1e9,   # bytes read + written per second
        "copy_B_over_t_GBps": nb / t / 1e9,  # bytes of the tensor per second (half the traffic)
        "read_sum_GBps": nb / tr / 1e9,      # a reduction: reads only
        "matmul_bf16_TFLOPs": 2 * n ** 3 / tm / 1e12,
    }


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


def write_tokenizer(out):
    """A synthetic byte-level BPE tokenizer.json with VOCAB ids (no merges: one token per
    byte; the 256 byte symbols, fillers "wN", and Qwen2's three special tokens at their ids),
    enough for kiln and transformers to load a Qwen2-shaped folder."""
    special = {151643: "<|endoftext|>", 151644: "<|im_start|>", 151645: "<|im_end|>"}
    vocab, j = {}, 0
    syms = bytes_to_unicode()
    for i in range(VOCAB):
        if i < 256:
            vocab[syms[i]] = i
        elif i in special:
            vocab[special[i]] = i
        else:
            vocab[f"w{j}"] = i
            j += 1
    bl = {"add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    tok = {"version": "1.0", "truncation": None, "padding": None,
           "added_tokens": [{"id": i, "content": c, "single_word": False, "lstrip": False,
                             "rstrip": False, "normalized": False, "special": True}
                            for i, c in special.items()],
           "normalizer": None, "pre_tokenizer": dict(type="ByteLevel", **bl),
           "post_processor": None,
           "decoder": dict(type="ByteLevel", **dict(bl, add_prefix_space=True)),
           "model": {"type": "BPE", "dropout": None, "unk_token": None,
                     "continuing_subword_prefix": None, "end_of_word_suffix": None,
                     "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                     "vocab": vocab, "merges": []}}
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "tokenizer.json"), "w") as f:
        json.dump(tok, f, ensure_ascii=False, indent=2)
    with open(os.path.join(out, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": None, "eos_token": "<|endoftext|>", "add_bos_token": False,
                   "tokenizer_class": "PreTrainedTokenizerFast"}, f)


def make_model(name, root, tokdir):
    import transformers as tf
    C, L, NH, KVH, FF = SHAPES[name]
    out = os.path.join(root, name)
    cfg = tf.Qwen2Config(hidden_size=C, num_hidden_layers=L, num_attention_heads=NH,
                         num_key_value_heads=KVH, intermediate_size=FF, vocab_size=VOCAB,
                         max_position_embeddings=32768, rms_norm_eps=1e-6, rope_theta=1e6,
                         tie_word_embeddings=True, bos_token_id=None, eos_token_id=151643)
    torch.manual_seed(0)
    with torch.device("cuda"):
        m = tf.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    with torch.no_grad():  # norms and biases away from 1 and 0, as in gpu-check.sh
        for n, p in m.named_parameters():
            if "norm" in n or n.endswith(".bias"):
                p.add_(torch.randn_like(p) * 0.1)
    m.save_pretrained(out)
    nbytes = sum(p.numel() * p.element_size() for p in m.parameters())  # tied counted once
    nparams = sum(p.numel() for p in m.parameters())
    del m
    torch.cuda.empty_cache()
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(tokdir, f), out)
    return out, nbytes, nparams


def run_kiln_cli(kiln, path, n_new, reps, env, device="cuda"):
    """kiln generate --device cuda --json, reps times; returns the runs' JSON objects."""
    runs = []
    for _ in range(reps):
        cmd = [kiln, "generate", "-m", path, "-p", PROMPT, "-n", str(n_new), "--temp", "0",
               "--ignore-eos", "--json", "--device", device]
        r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
        if r.returncode != 0:
            log(f"kiln rc={r.returncode}: {r.stderr[-2000:]}")
            return runs
        runs.append(json.loads(r.stdout))
    return runs


def kiln_prefill(libpath, path, n, reps, device=0):
    """Warm prefill of n random ids through the binding (the weights uploaded by a first
    call; then truncate and time kiln_decode of all n, which downloads the last logits)."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
    os.environ["KILN_LIB"] = libpath
    # LD_LIBRARY_PATH set now does not reach this process's loader: load the carried
    # libraries by path first, so that libkiln.so's needs are met by soname (libcudart is
    # the one torch already loaded)
    import ctypes
    d = os.path.dirname(libpath)
    for f in ("libcjson.so.1", "libpcre2-8.so.0", "libutf8proc.so.2", "libcrypto.so.3"):
        if os.path.exists(os.path.join(d, f)):
            ctypes.CDLL(os.path.join(d, f), mode=ctypes.RTLD_GLOBAL)
    import kiln
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 151643, (n,), generator=g).tolist()
    m = kiln.Model(path)
    ctx = kiln.Context(m, n_ctx=max(1024, n + 16), n_batch=n, device=device)
    ctx.decode(ids)
    ts = []
    for _ in range(reps):
        ctx.truncate(0)
        t0 = time.perf_counter()
        ctx.decode(ids)
        ts.append(time.perf_counter() - t0)
    # warm single-token decode through the API, for reference (no sampling, logits downloaded)
    ctx.truncate(0)
    ctx.decode(ids[:20])
    t0 = time.perf_counter()
    for i in range(32):
        ctx.decode([ids[20 + i]])
    step = (time.perf_counter() - t0) / 32
    ctx.close()
    m.close()
    return n / statistics.median(ts), step


def hf_generate(model, ids, n_new, reps, **kw):
    """transformers generate: decode tok/s = (n_new - 1) / (t(n_new tokens) - t(1 token))."""
    att = torch.ones_like(ids)
    common = dict(attention_mask=att, do_sample=False, pad_token_id=0, **kw)

    def gen(k):
        return model.generate(ids, max_new_tokens=k, min_new_tokens=k, **common)

    gen(8)
    t1 = wall_time(lambda: gen(1), reps)
    out = [None]

    def full():
        out[0] = gen(n_new)
    tn = wall_time(full, reps, warm=0)
    return (n_new - 1) / (tn - t1), out[0][0, ids.shape[1]:].tolist()


class GraphDecoder:
    """Qwen2 decode step in bf16 with a static KV cache [L][KVH, T, D], qkv and gate/up
    fused into one matmul each, rope from tables indexed by a device position, attention as
    two batched matmuls over the whole (masked) cache, greedy argmax on the device; one step
    is captured in one CUDA graph that also advances tok and pos, so replays need no host."""

    def __init__(self, hf, T, compile=False):
        cfg = hf.config
        self.compile = compile
        sd = {k: v for k, v in hf.state_dict().items()}
        self.C, self.L = cfg.hidden_size, cfg.num_hidden_layers
        self.NH, self.KVH = cfg.num_attention_heads, cfg.num_key_value_heads
        self.D = self.C // self.NH
        self.eps = cfg.rms_norm_eps
        self.T = T
        p = "model.layers.{}."
        self.layers = []
        for i in range(self.L):
            g = lambda n: sd[p.format(i) + n]
            self.layers.append(dict(
                ln1=g("input_layernorm.weight"), ln2=g("post_attention_layernorm.weight"),
                wqkv=torch.cat([g("self_attn.q_proj.weight"), g("self_attn.k_proj.weight"),
                                g("self_attn.v_proj.weight")]).contiguous(),
                bqkv=torch.cat([g("self_attn.q_proj.bias"), g("self_attn.k_proj.bias"),
                                g("self_attn.v_proj.bias")]).contiguous(),
                wo=g("self_attn.o_proj.weight"),
                wgu=torch.cat([g("mlp.gate_proj.weight"), g("mlp.up_proj.weight")]).contiguous(),
                wd=g("mlp.down_proj.weight")))
        self.emb = sd["model.embed_tokens.weight"]
        self.norm = sd["model.norm.weight"]
        dev, bf = self.emb.device, self.emb.dtype
        rp = getattr(cfg, "rope_parameters", None) or {}
        theta = rp.get("rope_theta", getattr(cfg, "rope_theta", 1e6))
        inv = 1.0 / theta ** (torch.arange(0, self.D, 2, dtype=torch.float32, device=dev) / self.D)
        f = torch.outer(torch.arange(T, dtype=torch.float32, device=dev), inv)
        e = torch.cat([f, f], -1)
        self.cos, self.sin = e.cos().to(bf), e.sin().to(bf)
        self.k = torch.zeros(self.L, self.KVH, T, self.D, dtype=bf, device=dev)
        self.v = torch.zeros_like(self.k)
        self.ar = torch.arange(T, device=dev)
        self.tok = torch.zeros(1, dtype=torch.long, device=dev)
        self.pos = torch.zeros(1, dtype=torch.long, device=dev)
        self.out = torch.zeros(T + 1, dtype=torch.long, device=dev)
        self.logits = None
        self.graph = None

    def _rms(self, x, w):
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return w * xf.to(x.dtype)

    @staticmethod
    def _rot(x):
        h = x.shape[-1] // 2
        return torch.cat([-x[..., h:], x[..., :h]], -1)

    def step(self):
        NH, KVH, D = self.NH, self.KVH, self.D
        G = NH // KVH
        cos, sin = self.cos.index_select(0, self.pos), self.sin.index_select(0, self.pos)
        mask = (self.ar > self.pos).view(1, 1, self.T)
        x = self.emb.index_select(0, self.tok)  # [1, C]
        for i, ly in enumerate(self.layers):
            h = self._rms(x, ly["ln1"])
            qkv = F.linear(h, ly["wqkv"], ly["bqkv"])
            q = qkv[:, :NH * D].view(NH, D)
            k = qkv[:, NH * D:(NH + KVH) * D].view(KVH, D)
            v = qkv[:, (NH + KVH) * D:].view(KVH, 1, D)
            q = q * cos + self._rot(q) * sin
            k = k * cos + self._rot(k) * sin
            self.k[i].index_copy_(1, self.pos, k.view(KVH, 1, D))
            self.v[i].index_copy_(1, self.pos, v)
            s = torch.bmm(q.view(KVH, G, D), self.k[i].transpose(1, 2)).float() * (D ** -0.5)
            s = s.masked_fill(mask, float("-inf"))
            pr = torch.softmax(s, -1).to(x.dtype)
            o = torch.bmm(pr, self.v[i]).reshape(1, NH * D)
            x = x + F.linear(o, ly["wo"])
            h = self._rms(x, ly["ln2"])
            gu = F.linear(h, ly["wgu"])
            ff = gu.shape[-1] // 2
            x = x + F.linear(F.silu(gu[:, :ff]) * gu[:, ff:], ly["wd"])
        logits = F.linear(self._rms(x, self.norm), self.emb)
        nxt = logits.argmax(-1)
        self.out.index_copy_(0, self.pos + 1, nxt)
        self.tok.copy_(nxt)
        self.pos.add_(1)
        return logits

    def capture(self):
        """Warm up (compiling first when asked: torch.compile fuses the elementwise ops, the
        CUDA graph then removes the launches' host cost), then capture one step."""
        fn = torch.compile(self.step, dynamic=False) if self.compile else self.step
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(3):
                self.logits = fn()
        torch.cuda.current_stream().wait_stream(s)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.logits = fn()
        self.reset()

    def reset(self):
        self.k.zero_()
        self.v.zero_()
        self.pos.zero_()

    def prompt(self, ids):
        """Run the prompt one token at a time through the graph (teacher forcing)."""
        self.reset()
        for t in ids:
            self.tok.fill_(t)
            self.graph.replay()

    def decode(self, n):
        for _ in range(n - 1):
            self.graph.replay()


def graph_decode(m, ids, prompt_ids, ref_ids, args, r, comp):
    n_prompt = len(prompt_ids)
    t0 = time.time()
    gd = GraphDecoder(m, T=n_prompt + args.new + 8, compile=comp)
    gd.capture()
    tc = time.time() - t0
    # check the step against the HF forward on the prompt's first token
    gd.reset()
    gd.tok.fill_(prompt_ids[0])
    gd.graph.replay()
    hl = m(ids[:, :1]).logits[0, -1].float()
    rel = ((hl - gd.logits[0].float()).norm() / hl.norm()).item()
    gd.prompt(prompt_ids)
    cuda_time(lambda: gd.decode(args.new), 1, warm=0)
    gen = gd.out[n_prompt:n_prompt + args.new].tolist()
    reps = []
    for _ in range(args.graph_reps):
        gd.prompt(prompt_ids)
        reps.append(cuda_time(lambda: gd.decode(args.new), 1, warm=0))
    gtps = (args.new - 1) / statistics.median(reps)
    agree = next((i for i, (a, b) in enumerate(zip(gen, ref_ids)) if a != b),
                 min(len(gen), len(ref_ids)))
    key = "graph_compiled" if comp else "graph"
    r[key] = dict(tps=gtps, first_logits_rel_l2_vs_hf=rel, greedy_agree_with_hf_sdpa=agree,
                  setup_s=tc)
    log(f"PyTorch CUDA-graph step{' (torch.compile)' if comp else ''}: {gtps:.1f} tok/s "
        f"(setup {tc:.1f} s); first-step logits rel L2 vs HF {rel:.2e}; greedy ids equal to "
        f"HF sdpa for the first {agree} of {args.new}")
    del gd
    return gtps


def bench_model(name, args, dev, env, res):
    C, L, NH, KVH, FF = SHAPES[name]
    D = C // NH
    t0 = time.time()
    path, wbytes, nparams = make_model(name, args.work, os.path.join(args.work, "tok"))
    log(f"== {name}: {nparams / 1e6:.1f}M params, {wbytes / 1e9:.3f} GB bf16, written in "
        f"{time.time() - t0:.1f} s")
    rows = []
    r = dict(model=name, params=nparams, weight_bytes=wbytes)

    # ---- kiln (CLI)
    runs = run_kiln_cli(os.path.join(args.bin, "kiln"), path, args.new, args.kiln_reps, env)
    if not runs:
        log("kiln: no run succeeded")
        prompt_ids = None
    else:
        prompt_ids = runs[0]["prompt_ids"]
        same = all(x["ids"] == runs[0]["ids"] for x in runs)
        dts = [x["decode_tokens_per_s"] for x in runs]
        r["kiln_cli"] = dict(decode_tps=dts, prefill_s=[x["prefill_seconds"] for x in runs],
                             n_prompt=runs[0]["n_prompt"], n_generated=runs[0]["n_generated"],
                             ids_same_each_run=same)
        log(f"kiln cli: decode tok/s {[round(x, 1) for x in dts]}, n_prompt {runs[0]['n_prompt']}, "
            f"cold prefill s {[round(x['prefill_seconds'], 3) for x in runs]}, same ids: {same}")
        rows.append(("kiln --device cuda (auditable)", statistics.median(dts)))
    n_prompt = len(prompt_ids) if prompt_ids else 16
    if prompt_ids is None:
        prompt_ids = torch.randint(0, 151643, (n_prompt,)).tolist()
    # KV bytes at the mean context of the decode, bf16: 2 (k, v) x L x KVH x D x 2 bytes
    kv = 2 * L * KVH * D * 2 * (n_prompt + args.new / 2)
    tok_bytes = wbytes + kv
    r["bytes_per_token"] = tok_bytes
    roof = dev["copy_rw_GBps"] * 1e9 / tok_bytes
    r["roofline_tps"] = roof

    lib = os.path.join(args.bin, "libkiln.so")
    if args.prefill and os.path.exists(lib):
        try:
            ptps, step = kiln_prefill(lib, path, args.prefill, 3)
            r["kiln_prefill_tps"] = ptps
            r["kiln_api_decode_step_ms"] = step * 1e3
            log(f"kiln prefill {args.prefill}: {ptps:.0f} tok/s (warm, binding); "
                f"kiln_decode 1 token: {step * 1e3:.2f} ms")
        except Exception as e:  # report, carry on with PyTorch
            log(f"kiln prefill failed: {e!r}")

    # ---- transformers
    import transformers as tf
    ids = torch.tensor([prompt_ids], device="cuda")
    ref_ids = None
    for impl in ("eager", "sdpa"):
        m = tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16,
                                                    attn_implementation=impl).cuda().eval()
        with torch.no_grad():
            tps, out = hf_generate(m, ids, args.new, args.hf_reps)
            rows.append((f"transformers generate, {impl}", tps))
            log(f"transformers {impl}: {tps:.1f} tok/s")
            if impl == "sdpa":
                ref_ids = out
                try:
                    tps, _ = hf_generate(m, ids, args.new, args.hf_reps,
                                         cache_implementation="static", disable_compile=True)
                    rows.append(("transformers generate, sdpa, static cache", tps))
                    log(f"transformers sdpa static cache: {tps:.1f} tok/s")
                except Exception as e:
                    log(f"transformers static cache failed: {e!r}")
                if args.prefill:
                    x = torch.randint(0, 151643, (1, args.prefill), device="cuda")
                    tp = cuda_time(lambda: m(x, logits_to_keep=1), 5)
                    r["torch_prefill_tps"] = args.prefill / tp
                    log(f"transformers sdpa prefill {args.prefill}: {args.prefill / tp:.0f} tok/s")
                # ---- plain PyTorch: one CUDA graph per step (eager ops; torch.compile'd)
                for comp in (False, True) if args.compile else (False,):
                    try:
                        gtps = graph_decode(m, ids, prompt_ids, ref_ids, args, r, comp)
                        rows.append(("PyTorch bf16, static KV, 1 CUDA graph/step" +
                                     (", torch.compile" if comp else ""), gtps))
                    except Exception as e:
                        log(f"graph decode (compile={comp}) failed: {e!r}")
        del m
        torch.cuda.empty_cache()
    r["rows"] = rows
    res.append(r)
    shutil.rmtree(path, ignore_errors=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", required=True)
    ap.add_argument("--models", default="0.5b,1.5b")
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--prefill", type=int, default=512)
    ap.add_argument("--kiln-reps", type=int, default=3)
    ap.add_argument("--hf-reps", type=int, default=2)
    ap.add_argument("--graph-reps", type=int, default=5)
    ap.add_argument("--work", default="/tmp/kiln-gpu-bench")
    ap.add_argument("--json", default=None)
    ap.add_argument("--no-compile", dest="compile", action="store_false",
                    help="skip the torch.compile'd graph step")
    args = ap.parse_args()
    args.bin = os.path.abspath(args.bin)
    os.makedirs(args.work, exist_ok=True)
    write_tokenizer(os.path.join(args.work, "tok"))
    env = dict(os.environ)
    env["LD_LIBRARY_PATH"] = args.bin + ":" + env.get("LD_LIBRARY_PATH", "")
    os.environ["LD_LIBRARY_PATH"] = env["LD_LIBRARY_PATH"]  # for ctypes' dependencies
    import transformers as tf
    info = dict(gpu=torch.cuda.get_device_name(0), torch=torch.__version__,
                transformers=tf.__version__, cuda=torch.version.cuda)
    try:
        info["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version",
                                         "--format=csv,noheader"], capture_output=True,
                                        text=True).stdout.strip()
    except OSError:
        info["driver"] = "?"
    log(json.dumps(info))
    dev = measure_device()
    log(json.dumps({k: round(v, 2) if isinstance(v, float) else v for k, v in dev.items()}))
    res = []
    for name in args.models.split(","):
        bench_model(ALIASES.get(name, name), args, dev, env, res)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(info=info, device=dev, results=res), f, indent=1)

    bw = dev["copy_rw_GBps"]
    log("")
    log(f"roofline = bytes per token (bf16 weights + bf16 KV at the mean context) / copy "
        f"bandwidth {bw:.0f} GB/s (read + write of a 4 GiB d2d copy); read-only sum "
        f"{dev['read_sum_GBps']:.0f} GB/s; bf16 matmul {dev['matmul_bf16_TFLOPs']:.0f} TFLOP/s")
    log("| model | engine | decode tok/s | ms/token | % of roofline |")
    log("| --- | --- | ---: | ---: | ---: |")
    for r in res:
        log(f"| {r['model']} | roofline ({r['bytes_per_token'] / 1e9:.3f} GB/token) | "
            f"{r['roofline_tps']:.0f} | {1e3 / r['roofline_tps']:.3f} | 100% |")
        for eng, tps in r["rows"]:
            log(f"| {r['model']} | {eng} | {tps:.1f} | {1e3 / tps:.2f} | "
                f"{100 * tps / r['roofline_tps']:.1f}% |")
    if args.prefill:
        log("")
        log(f"| model | prefill {args.prefill} tokens | tok/s | % of bf16 matmul rate |")
        log("| --- | --- | ---: | ---: |")
        for r in res:
            C, L, NH, KVH, FF = SHAPES[r["model"]]
            n = args.prefill
            # matmul FLOPs per token (non-embedding weights; logits of the last token only)
            # plus causal attention (QK and PV, n/2 keys on average)
            flops = 2 * n * (r["params"] - VOCAB * C) + 2 * VOCAB * C + 4 * L * C * n * n / 2
            for eng, key in (("kiln --device cuda (auditable, warm)", "kiln_prefill_tps"),
                             ("transformers sdpa forward", "torch_prefill_tps")):
                if key in r:
                    t = n / r[key]
                    log(f"| {r['model']} | {eng} | {r[key]:.0f} | "
                        f"{100 * flops / t / 1e12 / dev['matmul_bf16_TFLOPs']:.2f}% |")


if __name__ == "__main__":
    main()
