"""`kiln serve` under load, black-box (issue 28): the real binary on a loopback port, many
clients at once. test_serve.py checks the routes one request at a time; this file checks what
only concurrency shows.

- Batch invariance over HTTP: a greedy and a seeded sampled chat request, alone and then among
  31 concurrent others (other prompts, lengths, streamed or not) on a server whose 64-token
  steps mix prefill chunks with decode tokens, get the same tokens with bit-identical
  log-probabilities (logprobs, top_logprobs=5).
- Prefix sharing: chat requests sharing a system prompt of more than two 64-token blocks report
  cached prompt tokens (usage and /metrics) and answer exactly what a --no-prefix-cache server
  answers.
- Preemption: 8 concurrent requests on a KV pool just above one request's need all finish with
  the answers (and log-probabilities) they get alone, and /metrics counts preemptions.
- Soak: 64 streaming clients for KILN_SOAK_SECONDS (default 20), some leaving mid-stream, mixed
  with malformed requests (bad JSON, wrong types, huge max_tokens, unknown routes, wrong
  methods, truncated bodies and garbage over raw sockets): only the expected status codes, no
  crash, the KV pool and the queues back to 0, RSS within 64 MiB of its value after a warm-up,
  SIGTERM exits 0 with no kiln memory held. With KILN_ASAN_BUILD_DIR (a build with
  -DKILN_SANITIZE=ON) a short soak runs on that binary with ASAN_OPTIONS=detect_leaks=1.
- The chat page in headless Chromium: `/?q=TEXT&temperature=0&max_tokens=N` sends TEXT on
  load; the streamed answer the page shows equals the API's non-streamed greedy answer. The
  browser is driven over the DevTools protocol on a pipe (--remote-debugging-pipe: fd 3 in,
  fd 4 out, NUL-separated JSON), because --dump-dom with --virtual-time-budget dumps the page
  before a streamed fetch has finished, and the standard library has no websocket client. A
  screenshot and the final DOM are kept under the test's tmp dir and copied to
  $KILN_TEST_ARTIFACTS when set. Skipped without chromium.
"""
import base64
import fcntl
import html
import http.client
import json
import os
import random
import re
import select
import shutil
import signal
import socket
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

openai = pytest.importorskip("openai")

BASE = ["--ctx", "512", "--threads", "2"]
TOPICS = ["the sea", "a red bicycle", "bread baking", "the moon landing", "prime numbers", "a lost cat",
          "volcanoes", "jazz music", "the French revolution", "honey bees", "rainy Mondays", "chess openings"]


# ---- a server ----------------------------------------------------------------------------------


class Server:
    """`kiln serve` on 127.0.0.1 and a free port (--port 0, read back from its first line).
    Its stderr goes to a file, not a pipe: a long run's log lines must never block it."""

    def __init__(self, build_dir, model, tmp_path, *args, env=None, name="serve"):
        exe = Path(build_dir) / "kiln"
        if not exe.exists():
            pytest.fail(f"{exe} not found: build first")
        self.errpath = Path(tmp_path) / f"{name}.stderr"
        self.errfile = open(self.errpath, "w")
        self.cmd = [str(exe), "serve", "-m", model, "--port", "0", *BASE, *args]
        self.proc = subprocess.Popen(self.cmd, stdout=subprocess.PIPE, stderr=self.errfile, text=True,
                                     env={**os.environ, **(env or {})})
        line = self.proc.stdout.readline()
        m = re.search(r"http://127\.0\.0\.1:(\d+)/ \(model (\S+), device (\w+)", line)
        if not m:
            self.proc.kill()
            self.proc.wait()
            pytest.fail(f"kiln serve did not start: {line!r} {self.stderr()}")
        self.port, self.model = int(m.group(1)), m.group(2)
        self.url = f"http://127.0.0.1:{self.port}"
        for _ in range(200):
            try:
                if self.http("GET", "/health")[0] == 200:
                    break
            except OSError:
                time.sleep(0.05)

    def stderr(self):
        self.errfile.flush()
        return self.errpath.read_text(errors="replace")

    def http(self, method, path, body=None, headers=None, timeout=120):
        c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            data = json.dumps(body) if isinstance(body, (dict, list)) else body
            c.request(method, path, body=data, headers=headers or {})
            r = c.getresponse()
            return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()
        finally:
            c.close()

    def client(self):
        return openai.OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0, timeout=300)

    def metrics(self):
        st, _, body = self.http("GET", "/metrics")
        assert st == 200
        values = {}
        for line in body.decode().splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                values[name] = float(value)
        return values

    def rss_kib(self):
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
        raise AssertionError("no VmRSS")

    def wait_idle(self, timeout=60):
        """Wait until nothing runs, waits or holds a KV block; return the metrics."""
        deadline = time.time() + timeout
        while True:
            v = self.metrics()
            idle = (v["kiln_running_requests"] == 0 and v["kiln_queue_depth"] == 0 and v["kiln_kv_blocks_used"] == 0
                    and v["kiln_http_active_requests"] <= 1)  # the /metrics request itself may count
            if idle or time.time() > deadline:
                return v
            time.sleep(0.05)

    def stop(self, timeout=120):
        """SIGTERM (drain), then the exit status and stderr."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            rc = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            rc = self.proc.wait()
        self.errfile.close()
        return rc, self.errpath.read_text(errors="replace")


def stopped_clean(s):
    rc, err = s.stop()
    assert rc == 0, err[-4000:]
    assert "still held: 0 bytes in 0 blocks" in err, err[-4000:]


@pytest.fixture(scope="module")
def crowd(build_dir, smollm2_gguf, tmp_path_factory):
    """32 slots and 64-token steps: a crowd's prefill chunks share steps with decode tokens."""
    s = Server(build_dir, smollm2_gguf, tmp_path_factory.mktemp("crowd"), "--max-seqs", "32",
               "--max-batch-tokens", "64")
    yield s
    stopped_clean(s)


def chat_tokens(r):
    """A chat answer's tokens with all their log-probabilities, for exact comparison."""
    ch = r.choices[0]
    return (ch.message.content, ch.finish_reason,
            [(t.token, t.logprob, tuple(t.bytes or ()), tuple((x.token, x.logprob) for x in t.top_logprobs))
             for t in ch.logprobs.content])


def run_all(fns, workers):
    """Run the callables at once (a barrier releases them together); their results in order."""
    barrier = threading.Barrier(len(fns))

    def go(fn):
        barrier.wait()
        return fn()

    with ThreadPoolExecutor(workers) as ex:
        return [f.result() for f in [ex.submit(go, fn) for fn in fns]]


class Peak:
    """Polls /metrics in the background and keeps each gauge's largest value."""

    def __init__(self, s, names):
        self.s, self.names, self.peak = s, names, {n: 0.0 for n in names}
        self.stop_ev = threading.Event()
        self.th = threading.Thread(target=self.run, daemon=True)
        self.th.start()

    def run(self):
        while not self.stop_ev.is_set():
            try:
                v = self.s.metrics()
                for n in self.names:
                    self.peak[n] = max(self.peak[n], v[n])
            except OSError:
                pass
            time.sleep(0.05)

    def done(self):
        self.stop_ev.set()
        self.th.join()
        return self.peak


# ---- batch invariance ----------------------------------------------------------------------------


def test_batch_invariance_over_http(crowd):
    c = crowd.client()
    targets = [
        dict(messages=[{"role": "user", "content": "Name three colours."}], max_tokens=16, temperature=0),
        dict(messages=[{"role": "system", "content": "You are a poet."},
                       {"role": "user", "content": "Write about the sea."}],
             max_tokens=16, temperature=0.9, top_p=0.95, seed=1234),
    ]
    for t in targets:
        t.update(model=crowd.model, logprobs=True, top_logprobs=5)
    alone = [chat_tokens(c.chat.completions.create(**t)) for t in targets]
    assert alone == [chat_tokens(c.chat.completions.create(**t)) for t in targets]  # reproducible at all
    assert all(len(a[2]) >= 4 for a in alone)

    rng = random.Random(28)

    def other(i):
        topic = TOPICS[i % len(TOPICS)]
        words = " ".join([f"Tell me about {topic}."] * (1 + i % 6))  # prompts of 1 to 6 sentences
        n = rng.randint(4, 24)
        if i % 3 == 0:
            return lambda: c.completions.create(model=crowd.model, prompt=words, max_tokens=n, temperature=0,
                                                extra_body={"ignore_eos": True}).usage.completion_tokens
        if i % 3 == 1:
            return lambda: c.chat.completions.create(model=crowd.model, messages=[{"role": "user", "content": words}],
                                                     max_tokens=n, temperature=0.8, seed=i).usage.completion_tokens
        return lambda: sum(1 for ch in c.chat.completions.create(
            model=crowd.model, messages=[{"role": "user", "content": words}], max_tokens=n, temperature=0.7,
            stream=True) if ch.choices and ch.choices[0].delta.content)

    def target(t):
        # join the crowd once it is running, so that this request's prefill chunks share
        # steps with the others' decode tokens
        deadline = time.time() + 60
        while time.time() < deadline and crowd.metrics()["kiln_running_requests"] < 8:
            time.sleep(0.01)
        return chat_tokens(c.chat.completions.create(**t))

    before = crowd.metrics()
    peak = Peak(crowd, ["kiln_running_requests"])
    fns = [other(i) for i in range(30)] + [lambda t=t: target(t) for t in targets]
    out = run_all(fns, len(fns))
    p = peak.done()
    assert all(n >= 1 for n in out[:30])
    assert p["kiln_running_requests"] >= 16, p  # they did run together
    v = crowd.wait_idle()
    assert v["kiln_requests_finished_total"] - before["kiln_requests_finished_total"] == 32
    for got, ref in zip(out[30:], alone):
        assert got[0] == ref[0] and got[1] == ref[1]
        for k, (a, b) in enumerate(zip(got[2], ref[2])):
            assert a == b, f"token {k}: {a} != {b}"  # same token, bit-identical log-probabilities
        assert len(got[2]) == len(ref[2])


# ---- prefix sharing ------------------------------------------------------------------------------


SYSTEM = ("You are Kiln, a careful assistant for a small bakery. " + " ".join(
    f"Rule {i}: answer politely, mention {TOPICS[i % len(TOPICS)]} only when asked, and keep the answer short."
    for i in range(10)))
QUESTIONS = ["What time do you open?", "Do you sell rye bread?", "Can I order a cake?", "Where are you?",
             "Is there parking?"]


def prefix_answers(s):
    """The first question alone, then the other four at once; the answers and their usage."""
    c = s.client()

    def ask(q):
        r = c.chat.completions.create(model=s.model, messages=[{"role": "system", "content": SYSTEM},
                                                                {"role": "user", "content": q}],
                                      max_tokens=12, temperature=0, logprobs=True, top_logprobs=2)
        d = r.usage.prompt_tokens_details
        return chat_tokens(r), r.usage.prompt_tokens, (d.cached_tokens if d else None)

    first = ask(QUESTIONS[0])
    rest = run_all([lambda q=q: ask(q) for q in QUESTIONS[1:]], 4)
    return [first, *rest]


def test_prefix_sharing(crowd, build_dir, smollm2_gguf, tmp_path):
    before = crowd.metrics()
    shared = prefix_answers(crowd)
    v = crowd.wait_idle()
    assert all(n > 2 * 64 + 16 for _, n, _ in shared)  # the system prompt spans more than 2 blocks
    assert shared[0][2] == 0  # the first has nothing to share
    for _, n, cached in shared[1:]:
        assert cached is not None and cached >= 128 and cached % 64 == 0 and cached < n, shared
    cached_total = v["kiln_prompt_tokens_cached_total"] - before["kiln_prompt_tokens_cached_total"]
    assert cached_total == sum(x[2] for x in shared)
    assert v["kiln_prefix_cache_hit_rate"] > 0

    s = Server(build_dir, smollm2_gguf, tmp_path, "--max-seqs", "32", "--max-batch-tokens", "64",
               "--no-prefix-cache")
    try:
        plain = prefix_answers(s)
        v = s.wait_idle()
        assert v["kiln_prompt_tokens_cached_total"] == 0 and v["kiln_prefix_cache_hit_rate"] == 0
    finally:
        stopped_clean(s)
    assert all(x[2] == 0 for x in plain)
    assert [x[:2] for x in plain] == [x[:2] for x in shared]  # same tokens, same log-probabilities


# ---- preemption ------------------------------------------------------------------------------------


def test_preemption_under_load(build_dir, smollm2_gguf, tmp_path):
    """Each request needs 2 KV blocks (a ~45-token prompt and 28 tokens of answer); the pool has
    3 (--ctx 128 needs 2), so concurrent requests grow into each other and the last admitted is preempted."""
    s = Server(build_dir, smollm2_gguf, tmp_path, "--ctx", "128", "--kv-blocks", "3", "--max-seqs", "8",
               "--max-batch-tokens", "32")
    try:
        c = s.client()
        prompts = [f"Here is a short story about {TOPICS[i]}. It was a quiet evening and nobody expected "
                   f"anything unusual to happen. The wind was cold, the streets were empty and the lamps "
                   f"flickered, but then something changed. Number {i}:" for i in range(8)]

        def one(i):
            kw = dict(temperature=0) if i % 2 == 0 else dict(temperature=0.9, seed=100 + i)
            r = c.completions.create(model=s.model, prompt=prompts[i], max_tokens=28, logprobs=3,
                                     extra_body={"ignore_eos": True}, **kw)
            ch = r.choices[0]
            assert 64 < r.usage.prompt_tokens + r.usage.completion_tokens <= 128
            return ch.text, ch.logprobs.tokens, ch.logprobs.token_logprobs, ch.logprobs.top_logprobs

        got = run_all([lambda i=i: one(i) for i in range(8)], 8)
        v = s.wait_idle()
        assert v["kiln_kv_blocks_total"] == 3
        preempted = v["kiln_preemptions_total"]
        assert preempted >= 1
        assert v["kiln_requests_finished_total"] == 8 and v["kiln_requests_failed_total"] == 0
        alone = [one(i) for i in range(8)]
        assert s.metrics()["kiln_preemptions_total"] == preempted  # alone, nothing is preempted
        for i in range(8):
            assert got[i] == alone[i], i
    finally:
        stopped_clean(s)


# ---- soak --------------------------------------------------------------------------------------------


def raw(port, data, shut=False, read=True, timeout=10):
    """Send bytes on a fresh connection; optionally half-close; return what comes back."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    try:
        sock.sendall(data)
        if shut:
            sock.shutdown(socket.SHUT_WR)
        if not read:
            return b""
        got = b""
        while True:
            try:
                d = sock.recv(65536)
            except (ConnectionResetError, socket.timeout):
                break
            if not d:
                break
            got += d
        return got
    finally:
        sock.close()


def status_of(resp):
    m = re.match(rb"HTTP/1\.[01] (\d{3})", resp)
    return int(m.group(1)) if m else None


def post(path, body, extra=b""):
    return (b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n%s\r\n"
            % (path.encode(), len(body), extra)) + body


# malformed requests: (name, callable(port) -> status or None for "no answer is fine") and the
# statuses each may get
MALFORMED = {
    "bad_json": (lambda s: s.http("POST", "/v1/chat/completions", "{not json")[0], {400}),
    "not_object": (lambda s: s.http("POST", "/v1/completions", "[1, 2]")[0], {400}),
    "wrong_type": (lambda s: s.http("POST", "/v1/chat/completions",
                                    {"messages": "hi", "max_tokens": 4})[0], {400}),
    "wrong_type2": (lambda s: s.http("POST", "/v1/completions", {"prompt": "x", "temperature": "hot"})[0], {400}),
    "huge_max_tokens": (lambda s: s.http("POST", "/v1/completions", {"prompt": "x", "max_tokens": 10 ** 12})[0],
                        {400}),
    "bad_n": (lambda s: s.http("POST", "/v1/completions", {"prompt": "x", "n": 99})[0], {400}),
    "bad_token": (lambda s: s.http("POST", "/v1/completions", {"prompt": [1, 10 ** 9], "max_tokens": 2})[0], {400}),
    "long_prompt": (lambda s: s.http("POST", "/v1/completions", {"prompt": [1] * 600, "max_tokens": 2})[0], {400}),
    "unknown_route": (lambda s: s.http("GET", "/v1/nothing")[0], {404}),
    "unknown_route_post": (lambda s: s.http("POST", "/v2/chat", {"x": 1})[0], {404}),
    "wrong_model": (lambda s: s.http("POST", "/v1/completions", {"model": "zz", "prompt": "x"})[0], {404}),
    "wrong_method": (lambda s: s.http("DELETE", "/v1/completions")[0], {405}),
    "too_large": (lambda s: status_of(raw(s.port, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                                                  b"Content-Length: 999999999999\r\n\r\n{\"prompt\"", shut=True)),
                  {413}),
    "truncated_close": (lambda s: raw(s.port, post("/v1/completions", b'{"prompt": "hello", "max_tokens": 4}')[:-12],
                                      read=False) and None, {b"", None}),
    "truncated_shut": (lambda s: status_of(raw(s.port, post("/v1/chat/completions",
                                                            b'{"messages": [{"role": "user"}]}')[:-8], shut=True)),
                       {None, 400}),
    "garbage": (lambda s: status_of(raw(s.port, b"\x00\xffGARBAGE / NOPE\r\n\r\n", shut=True)), {None, 400, 505}),
    "bad_chunked": (lambda s: status_of(raw(s.port, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                                                    b"Transfer-Encoding: chunked\r\n\r\nzz\r\nabc\r\n0\r\n\r\n",
                                            shut=True)), {400}),
}


def stream_client(s, rng, deadline, stats, lock, max_new, short):
    """One streaming request: maybe leave after a random number of chunks. Raises on anything
    unexpected."""
    chat = rng.random() < (0.25 if short else 0.5)
    n = rng.randint(1, max_new)
    huge = rng.random() < 0.05  # a huge (but valid) max_tokens: always left mid-stream
    body = {"max_tokens": 2 ** 30 if huge else n, "stream": True, "temperature": rng.choice([0, 0.8]),
            "seed": rng.randint(0, 1000)}
    text = f"Say something about {rng.choice(TOPICS)}." * (1 if short else rng.randint(1, 4))
    if chat:
        body["messages"] = [{"role": "user", "content": text}]
    else:
        body["prompt"] = text
    leave_after = rng.randint(0, 4) if (huge or rng.random() < 0.3) else None
    c = http.client.HTTPConnection("127.0.0.1", s.port, timeout=120)
    try:
        c.request("POST", "/v1/chat/completions" if chat else "/v1/completions", json.dumps(body),
                  {"Content-Type": "application/json"})
        r = c.getresponse()
        assert r.status == 200, (r.status, r.read()[:300])
        buf, events = b"", []
        while True:
            if leave_after is not None and len(events) >= leave_after or time.time() > deadline + 5:
                with lock:
                    stats["left"] += 1
                return  # leave mid-stream: close without reading on
            d = r.read1(65536)
            if not d:
                break
            buf += d
            while b"\n\n" in buf:
                ev, buf = buf.split(b"\n\n", 1)
                events.append(ev)
        assert buf == b"" and events and events[-1] == b"data: [DONE]", events[-3:]
        objs = [json.loads(e[len(b"data: "):]) for e in events[:-1]]
        assert not any("error" in o for o in objs), objs
        finishes = [ch["finish_reason"] for o in objs for ch in o["choices"] if ch.get("finish_reason")]
        assert finishes in (["length"], ["stop"]), finishes
        with lock:
            stats["done"] += 1
    finally:
        c.close()


def soak(s, seconds, clients=64, malformed_rate=0.15, seed=0, max_new=16, short=False):
    """`clients` threads each loop until the deadline: a streaming request, or now and then a
    malformed one; one more thread sends every kind of malformed request in turn. Returns the
    counts; the first unexpected outcome fails the test."""
    deadline = time.time() + seconds
    stats = {"done": 0, "left": 0, "malformed": 0}
    lock = threading.Lock()
    errors = []

    def worker(k):
        rng = random.Random(seed * 1000 + k)
        try:
            while time.time() < deadline and not errors:
                if rng.random() < malformed_rate:
                    name = rng.choice(sorted(MALFORMED))
                    fn, ok = MALFORMED[name]
                    st = fn(s)
                    assert st in ok, (name, st)
                    with lock:
                        stats["malformed"] += 1
                else:
                    stream_client(s, rng, deadline, stats, lock, max_new, short)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(f"client {k}: {type(e).__name__}: {e}")

    def every_kind():  # and one more client goes round all the malformed kinds, in order
        try:
            k = 0
            while (k < len(MALFORMED) or time.time() < deadline) and not errors:
                name = sorted(MALFORMED)[k % len(MALFORMED)]
                fn, ok = MALFORMED[name]
                st = fn(s)
                assert st in ok, (name, st)
                with lock:
                    stats["malformed"] += 1
                k += 1
                time.sleep(0.05)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(f"malformed round: {type(e).__name__}: {e}")

    ths = [threading.Thread(target=worker, args=(k,)) for k in range(clients)]
    ths.append(threading.Thread(target=every_kind))
    for t in ths:
        t.start()
    for t in ths:
        t.join()
    assert not errors, errors[:5]
    assert s.proc.poll() is None, s.stderr()[-4000:]
    return stats


EXPECTED_CODES = {"200", "400", "404", "405", "413"}


def check_after_soak(s, before):
    v = s.wait_idle()
    assert v["kiln_running_requests"] == 0 and v["kiln_queue_depth"] == 0
    assert v["kiln_kv_blocks_used"] == 0, v
    codes = {k[len('kiln_http_responses_total{code="'):-2]: x for k, x in v.items()
             if k.startswith("kiln_http_responses_total{")}
    unexpected = {k: x for k, x in codes.items() if x and k not in EXPECTED_CODES}
    assert not unexpected, codes
    assert v["kiln_requests_failed_total"] == before.get("kiln_requests_failed_total", 0)
    assert v["kiln_requests_cancelled_total"] > before.get("kiln_requests_cancelled_total", 0)
    # and it still answers
    r = s.client().completions.create(model=s.model, prompt="The capital of France is", max_tokens=4,
                                      temperature=0)
    assert r.usage.completion_tokens == 4
    return v


def soak_seconds(name, default):
    return float(os.environ.get(name, default))


def test_soak(build_dir, smollm2_gguf, tmp_path):
    seconds = soak_seconds("KILN_SOAK_SECONDS", 20)
    # 48 blocks: 32 running requests fill the pool (so the warm-up touches all of it) and the
    # odd long request preempts
    s = Server(build_dir, smollm2_gguf, tmp_path, "--max-connections", "256", "--kv-blocks", "48")
    try:
        warm = soak(s, min(5.0, seconds / 3), seed=1)
        check_after_soak(s, {})
        rss_warm = s.rss_kib()
        before = s.metrics()
        stats = soak(s, seconds, seed=2)
        check_after_soak(s, before)
        rss_after = s.rss_kib()
        print(f"soak {seconds}s: {stats} (warm-up {warm}); RSS {rss_warm >> 10} MiB after the warm-up, "
              f"{rss_after >> 10} MiB after the soak")
        assert stats["done"] >= 32 and stats["left"] >= 8 and stats["malformed"] >= 2 * len(MALFORMED), stats
        assert rss_after <= rss_warm + 64 * 1024, (rss_warm, rss_after)
    finally:
        stopped_clean(s)


def test_soak_asan(smollm2_gguf, tmp_path):
    """The soak, short, on a build with AddressSanitizer + UBSan and leak checking at exit."""
    d = os.environ.get("KILN_ASAN_BUILD_DIR")
    if not d:
        pytest.skip("KILN_ASAN_BUILD_DIR not set (a -DKILN_SANITIZE=ON build of the kiln target)")
    env = {"ASAN_OPTIONS": "detect_leaks=1:abort_on_error=0", "UBSAN_OPTIONS": "print_stacktrace=1"}
    # a Debug build under ASan runs the model ~30 times slower (prefill ~14 tokens/s): a few
    # clients, short prompts and answers
    s = Server(d, smollm2_gguf, tmp_path, "--max-connections", "64", "--kv-blocks", "24", "--max-seqs", "8",
               env=env, name="asan")
    try:
        t0 = time.time()
        stats = soak(s, soak_seconds("KILN_ASAN_SOAK_SECONDS", 20), clients=4, seed=3, max_new=4, short=True)
        t1 = time.time()
        check_after_soak(s, {})
        print(f"ASan soak: {stats}; {t1 - t0:.1f} s, then {time.time() - t1:.1f} s to idle")
        assert stats["done"] >= 4 and stats["malformed"] >= len(MALFORMED), stats
    finally:
        rc, err = s.stop(timeout=300)
    for needle in ["ERROR: AddressSanitizer", "ERROR: LeakSanitizer", "runtime error:"]:
        assert needle not in err, err[-6000:]
    assert rc == 0, err[-6000:]
    assert "still held: 0 bytes in 0 blocks" in err


# ---- the chat page in a browser -------------------------------------------------------------------


class Chromium:
    """Headless Chromium driven over the DevTools protocol on a pipe (--remote-debugging-pipe:
    the browser reads commands on fd 3 and writes answers and events on fd 4, each message a JSON
    text ending with NUL). No websocket needed."""

    def __init__(self, exe, profile):
        def high(fd):  # above 4, so the child's dup2 onto 3 and 4 cannot clobber them
            n = fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 10)
            os.close(fd)
            return n

        to_r, self.to_w = map(high, os.pipe())
        self.from_r, from_w = map(high, os.pipe())

        def child():
            os.dup2(to_r, 3)
            os.dup2(from_w, 4)

        self.proc = subprocess.Popen([exe, "--headless=new", "--no-sandbox", "--disable-gpu", "--no-first-run",
                                      "--disable-extensions", "--remote-debugging-pipe", "--window-size=1000,800",
                                      f"--user-data-dir={profile}", "about:blank"],
                                     pass_fds=(3, 4), preexec_fn=child, stdin=subprocess.DEVNULL,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        os.close(to_r)
        os.close(from_w)
        self.buf, self.next_id = b"", 0

    def call(self, method, params=None, session=None, timeout=30):
        self.next_id += 1
        msg = {"id": self.next_id, "method": method, "params": params or {}}
        if session:
            msg["sessionId"] = session
        os.write(self.to_w, json.dumps(msg).encode() + b"\0")
        deadline = time.time() + timeout
        while True:
            while b"\0" in self.buf:
                text, self.buf = self.buf.split(b"\0", 1)
                j = json.loads(text)
                if j.get("id") == self.next_id:
                    if "error" in j:
                        raise RuntimeError(f"{method}: {j['error']}")
                    return j["result"]
            left = deadline - time.time()
            if left <= 0:
                raise TimeoutError(method)
            if select.select([self.from_r], [], [], left)[0]:
                d = os.read(self.from_r, 1 << 20)
                if not d:
                    raise EOFError(f"chromium exited (rc {self.proc.poll()})")
                self.buf += d

    def close(self):
        try:
            self.call("Browser.close", timeout=10)
        except (OSError, EOFError, TimeoutError, RuntimeError):
            pass
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        os.close(self.to_w)
        os.close(self.from_r)


def keep_artifact(path):
    d = os.environ.get("KILN_TEST_ARTIFACTS")
    if d:
        os.makedirs(d, exist_ok=True)
        shutil.copy(path, d)


def test_chat_page_in_chromium(crowd, tmp_path):
    exe = next((p for p in map(shutil.which, ["chromium", "chromium-browser", "google-chrome"]) if p), None)
    if not exe:
        pytest.skip("chromium not installed")
    question = "Name three colours."
    ref = crowd.client().chat.completions.create(model=crowd.model, messages=[{"role": "user", "content": question}],
                                                 max_tokens=16, temperature=0).choices[0].message.content
    assert ref
    url = f"{crowd.url}/?q=Name%20three%20colours.&temperature=0&max_tokens=16"
    b = Chromium(exe, tmp_path / "profile")
    try:
        target = b.call("Target.createTarget", {"url": "about:blank"})["targetId"]
        sess = b.call("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        b.call("Page.enable", session=sess)
        b.call("Page.navigate", {"url": url}, session=sess)
        probe = ("JSON.stringify({stats: document.getElementById('stats').textContent, busy: "
                 "document.getElementById('send').disabled, url: location.href, msgs: "
                 "[...document.querySelectorAll('#log .msg')].map(d => [d.className, d.textContent])})")
        deadline, page = time.time() + 60, None
        while time.time() < deadline:
            r = b.call("Runtime.evaluate", {"expression": probe, "returnByValue": True}, session=sess)
            if "exceptionDetails" not in r and r["result"].get("type") == "string":
                page = json.loads(r["result"]["value"])
                if page["stats"] or any("error" in cls for cls, _ in page["msgs"]):
                    break
            time.sleep(0.1)
        shot = tmp_path / "chat_page.png"
        shot.write_bytes(base64.b64decode(b.call("Page.captureScreenshot", {"format": "png"}, session=sess)["data"]))
        dom = tmp_path / "chat_page.html"
        dom.write_text(b.call("Runtime.evaluate", {"expression": "document.documentElement.outerHTML",
                                                   "returnByValue": True}, session=sess)["result"]["value"])
    finally:
        b.close()
    keep_artifact(shot)
    keep_artifact(dom)
    assert page, "the page did not load"
    assert page["msgs"] == [["msg user", question], ["msg assistant", ref]], page
    assert not page["busy"] and "chunks" in page["stats"]
    assert "?" not in page["url"]  # the q parameter is dropped: a reload does not send again
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert html.escape(ref, quote=False) in dom.read_text()
