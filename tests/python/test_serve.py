"""`kiln serve` black-box: the real binary on a loopback port, driven by the official `openai`
client and by plain HTTP (http.client, so headers, status codes and raw SSE are visible).

Properties checked: greedy answers equal `kiln generate`'s text for the same prompt (plain
and --chat); streaming concatenates to the non-streaming answer; a seed reproduces, and n > 1
gives choice i the answer of seed + i alone; stop strings cut the text; usage counts add up;
logprobs have OpenAI's shapes; bad bodies give 400 naming the field; 401 / 404 / 405 / 413 /
429 as documented; /metrics parses as Prometheus text with consistent histograms; tokenize
and detokenize round-trip; a client that leaves mid-stream gets its request cancelled and
the server carries on; SIGTERM drains a stream to its end and exits 0 with no kiln memory
held.
"""
import http.client
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

import pytest

openai = pytest.importorskip("openai")

PROMPT = "The capital of France is"
CHAT = "Name three colours."


def kiln_bin(build_dir):
    p = Path(build_dir) / "kiln"
    if not p.exists():
        pytest.fail(f"{p} not found: build first")
    return str(p)


class Server:
    """A `kiln serve` process on 127.0.0.1 and a free port (--port 0, read back from its
    first line)."""

    def __init__(self, build_dir, model, *args, env=None):
        self.cmd = [kiln_bin(build_dir), "serve", "-m", model, "--port", "0", "--ctx", "1024", "--threads", "2", *args]
        self.proc = subprocess.Popen(self.cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     env=None if env is None else {**os.environ, **env})
        line = self.proc.stdout.readline()
        m = re.search(r"http://127\.0\.0\.1:(\d+)/ \(model (\S+), device (\w+)", line)
        if not m:
            self.proc.kill()
            err = self.proc.stderr.read()
            pytest.fail(f"kiln serve did not start: {line!r} {err}")
        self.port, self.model, self.device = int(m.group(1)), m.group(2), m.group(3)
        self.url = f"http://127.0.0.1:{self.port}"
        for _ in range(100):
            try:
                if self.http("GET", "/health")[0] == 200:
                    break
            except OSError:
                time.sleep(0.05)

    def http(self, method, path, body=None, headers=None, timeout=120):
        c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        data = json.dumps(body) if isinstance(body, (dict, list)) else body
        c.request(method, path, body=data, headers=headers or {})
        r = c.getresponse()
        out = r.read()
        c.close()
        return r.status, {k.lower(): v for k, v in r.getheaders()}, out

    def client(self, key="none"):
        return openai.OpenAI(base_url=self.url + "/v1", api_key=key, max_retries=0, timeout=120)

    def stop(self, sig=signal.SIGTERM, timeout=60):
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            rc = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            rc = self.proc.wait()
        err = self.proc.stderr.read()
        return rc, err


@pytest.fixture(scope="module")
def server(build_dir, smollm2_gguf):
    s = Server(build_dir, smollm2_gguf)
    yield s
    rc, err = s.stop()
    assert rc == 0, err
    assert "still held: 0 bytes in 0 blocks" in err, err


def generate(build_dir, model, prompt, n, chat=False, extra=()):
    cmd = [kiln_bin(build_dir), "generate", "-m", model, "-p", prompt, "-n", str(n), "--temp", "0", "--json",
           "--seed", "1", "-t", "2", *extra]
    if chat:
        cmd.append("--chat")
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    return json.loads(out)


def metrics(s):
    st, _, body = s.http("GET", "/metrics")
    assert st == 200
    values = {}
    for line in body.decode().splitlines():
        if not line or line.startswith("#"):
            continue
        name, value = line.rsplit(" ", 1)
        values[name] = float(value)
    return values


# ---- answers ---------------------------------------------------------------------------------


def test_health_models(server):
    st, _, body = server.http("GET", "/health")
    assert st == 200 and json.loads(body)["status"] == "ok"
    models = server.client().models.list()
    assert [m.id for m in models.data] == [server.model]
    st, h, body = server.http("GET", "/")
    assert st == 200 and h["content-type"].startswith("text/html") and b"/v1/chat/completions" in body


def test_page_script_parses(server, tmp_path):
    node = shutil.which("node")
    if not node:
        pytest.skip("node not installed: the page's script is not syntax-checked")
    body = server.http("GET", "/")[2].decode()
    script = body[body.index("<script>") + len("<script>"):body.index("</script>")]
    (tmp_path / "page.js").write_text(script)
    r = subprocess.run([node, "--check", str(tmp_path / "page.js")], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_completion_greedy_equals_generate(server, build_dir, smollm2_gguf):
    ref = generate(build_dir, smollm2_gguf, PROMPT, 24)
    r = server.client().completions.create(model=server.model, prompt=PROMPT, max_tokens=24, temperature=0)
    assert r.object == "text_completion"
    assert r.choices[0].text == ref["text"]
    assert r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == ref["n_prompt"] == len(ref["prompt_ids"])
    assert r.usage.completion_tokens == 24
    assert r.usage.total_tokens == r.usage.prompt_tokens + 24
    # the same prompt as token ids
    r2 = server.client().completions.create(model=server.model, prompt=ref["prompt_ids"], max_tokens=24, temperature=0)
    assert r2.choices[0].text == ref["text"]


def test_chat_greedy_equals_generate(server, build_dir, smollm2_gguf):
    ref = generate(build_dir, smollm2_gguf, CHAT, 20, chat=True)
    r = server.client().chat.completions.create(model=server.model, messages=[{"role": "user", "content": CHAT}],
                                                max_tokens=20, temperature=0)
    assert r.object == "chat.completion"
    m = r.choices[0].message
    assert m.role == "assistant" and m.content == ref["text"]
    assert r.usage.prompt_tokens == ref["n_prompt"]
    assert r.usage.completion_tokens == ref["n_generated"]
    assert r.choices[0].finish_reason == ("length" if ref["stop_reason"] in ("length", "context") else "stop")


def test_chat_stream_equals_whole(server):
    c = server.client()
    msgs = [{"role": "system", "content": "You are brief."}, {"role": "user", "content": [{"type": "text", "text": CHAT}]}]
    whole = c.chat.completions.create(model=server.model, messages=msgs, max_tokens=16, temperature=0)
    chunks = list(c.chat.completions.create(model=server.model, messages=msgs, max_tokens=16, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == whole.choices[0].message.content
    finals = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert finals == [whole.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert all(ch.object == "chat.completion.chunk" and ch.id == chunks[0].id for ch in chunks)


def test_completion_stream_raw_sse(server):
    st, h, body = server.http("POST", "/v1/completions", {"prompt": PROMPT, "max_tokens": 6, "temperature": 0,
                                                           "stream": True})
    assert st == 200 and h["content-type"].startswith("text/event-stream")
    events = body.decode().split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    objs = [json.loads(e[len("data: "):]) for e in events[:-2]]
    assert all(o["object"] == "text_completion" for o in objs)
    assert objs[-1]["choices"][0]["finish_reason"] == "length"
    whole = server.client().completions.create(model=server.model, prompt=PROMPT, max_tokens=6, temperature=0)
    assert "".join(o["choices"][0]["text"] for o in objs) == whole.choices[0].text


def test_seed_reproducible_and_n(server):
    c = server.client()
    kw = dict(model=server.model, prompt="Once upon a time", max_tokens=12, temperature=1.0, top_p=0.95)
    a = c.completions.create(seed=42, n=3, **kw)
    b = c.completions.create(seed=42, n=3, **kw)
    assert sorted(ch.index for ch in a.choices) == [0, 1, 2]
    ta = {ch.index: ch.text for ch in a.choices}
    assert ta == {ch.index: ch.text for ch in b.choices}
    # choice i is the request with seed 42 + i alone
    for i in range(3):
        one = c.completions.create(seed=42 + i, n=1, **kw)
        assert one.choices[0].text == ta[i]
    assert 3 <= a.usage.completion_tokens <= 36 and a.usage.prompt_tokens == one.usage.prompt_tokens
    # n > 1 streamed: every index gets its text and a finish
    chunks = list(c.completions.create(seed=42, n=3, stream=True, **kw))
    got = {}
    for ch in chunks:
        for x in ch.choices:
            got[x.index] = got.get(x.index, "") + x.text
    assert got == ta


def verify(build_dir, model, rec, tmp_path, name, *args):
    f = tmp_path / f"{name}.json"
    f.write_text(json.dumps(rec))
    return subprocess.run([kiln_bin(build_dir), "verify", str(f), "-m", model, *args], capture_output=True,
                          text=True, timeout=300)


def test_receipts_verify(server, build_dir, smollm2_gguf, tmp_path):
    """"receipt": true gives every choice a generation receipt (docs/REPRODUCIBILITY.md) that
    `kiln verify` replays alone, step for step: chat with n = 2 and a seed (choice i's seed is
    seed + i), a streamed completion (the receipt in the choice's last chunk), a concurrent
    neighbour not mattering; penalties are refused; without the field, no receipt."""
    c = server.client()
    r = c.chat.completions.create(model=server.model, messages=[{"role": "user", "content": "Name a color."}],
                                  max_tokens=10, temperature=0.9, seed=7, n=2, extra_body={"receipt": True})
    for ch in r.choices:
        rec = ch.model_extra["kiln_receipt"]
        assert rec["settings"]["seed"] == str(7 + ch.index) and rec["arithmetic"]["mode"] == "auditable"
        assert len(rec["logits_chain"]) == len(rec["output"]["ids"]) + 1
        v = verify(build_dir, smollm2_gguf, rec, tmp_path, f"chat{ch.index}", "--threads", "1")
        assert v.returncode == 0 and "identical" in v.stdout, v.stdout + v.stderr
    # streamed, while another request runs beside it
    import threading
    side = threading.Thread(target=lambda: c.completions.create(model=server.model, prompt="A long story:",
                                                               max_tokens=40, temperature=0))
    side.start()
    rec = None
    for chunk in c.completions.create(model=server.model, prompt="The capital of France is", max_tokens=8,
                                      stream=True, extra_body={"receipt": True}):
        for x in chunk.choices:
            rec = (x.model_extra or {}).get("kiln_receipt", rec)
    side.join()
    assert rec is not None
    v = verify(build_dir, smollm2_gguf, rec, tmp_path, "stream")
    assert v.returncode == 0, v.stdout + v.stderr
    # a flipped id is named by verify
    rec["output"]["ids"][0] ^= 1
    v = verify(build_dir, smollm2_gguf, rec, tmp_path, "bad")
    assert v.returncode in (1, 2), v.stdout + v.stderr
    st, _, body = server.http("POST", "/v1/completions", {"prompt": "x", "max_tokens": 2, "receipt": True,
                                                          "frequency_penalty": 0.5})
    assert st == 400 and b"penalty" in body
    st, _, body = server.http("POST", "/v1/completions", {"prompt": "x", "max_tokens": 2})
    assert st == 200 and b"kiln_receipt" not in body


def test_stop_strings(server):
    c = server.client()
    base = c.completions.create(model=server.model, prompt=PROMPT, max_tokens=24, temperature=0).choices[0].text
    words = base.split()
    assert len(words) >= 3
    stop = words[2]
    cut = base[: base.index(stop)]
    r = c.completions.create(model=server.model, prompt=PROMPT, max_tokens=24, temperature=0, stop=[stop, "zzzz"])
    assert r.choices[0].text == cut
    assert r.choices[0].finish_reason == "stop"
    chunks = list(c.completions.create(model=server.model, prompt=PROMPT, max_tokens=24, temperature=0, stop=stop,
                                       stream=True))
    assert "".join(x.choices[0].text for x in chunks if x.choices) == cut


def test_logprobs_shapes(server):
    c = server.client()
    r = c.chat.completions.create(model=server.model, messages=[{"role": "user", "content": CHAT}], max_tokens=8,
                                  temperature=0, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for t in content:
        assert len(t.top_logprobs) == 3
        lps = [x.logprob for x in t.top_logprobs]
        assert lps == sorted(lps, reverse=True) and all(lp <= 0 for lp in lps)
        assert t.logprob == pytest.approx(lps[0])  # greedy: the chosen token is the top one
        assert t.token == t.top_logprobs[0].token and bytes(t.bytes).decode("utf-8", "replace") == t.token
    r = c.completions.create(model=server.model, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 6
    assert all(len(d) <= 2 for d in lp.top_logprobs) and lp.text_offset[0] == 0
    assert "".join(lp.tokens) == r.choices[0].text
    r = c.completions.create(model=server.model, prompt=PROMPT, max_tokens=4, temperature=0)
    assert r.choices[0].logprobs is None


def test_tokenize_roundtrip(server):
    text = "Hello, world! Ünïcödé 日本"
    st, _, body = server.http("POST", "/tokenize", {"prompt": text, "add_special": False})
    assert st == 200
    toks = json.loads(body)["tokens"]
    assert toks and all(isinstance(t, int) for t in toks)
    st, _, body = server.http("POST", "/detokenize", {"tokens": toks})
    assert st == 200 and json.loads(body)["prompt"] == text
    st, _, body = server.http("POST", "/tokenize", {"text": text})
    assert st == 200 and len(json.loads(body)["tokens"]) >= len(toks)
    assert server.http("POST", "/detokenize", {"tokens": [1, "x"]})[0] == 400


# ---- errors ----------------------------------------------------------------------------------


@pytest.mark.parametrize("kind,extra,param", [
    ("chat", {"temperature": "hot"}, "temperature"),
    ("chat", {"n": 17}, "n"),
    ("chat", {"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ("chat", {"top_logprobs": 3}, "top_logprobs"),
    ("completion", {"max_tokens": -5}, "max_tokens"),
    ("completion", {"top_p": 1.5}, "top_p"),
    ("completion", {"prompt": [1, -1]}, "prompt"),
])
def test_bad_request_400(server, kind, extra, param):
    c = server.client()
    with pytest.raises(openai.BadRequestError) as ei:
        if kind == "chat":
            body = dict(model=server.model, messages=[{"role": "user", "content": "x"}], max_tokens=4)
            body.update(extra)
            c.chat.completions.create(**body)
        else:
            body = dict(model=server.model, prompt="x", max_tokens=4)
            body.update(extra)
            c.completions.create(**body)
    err = ei.value.body
    assert ei.value.status_code == 400
    assert err["type"] == "invalid_request_error" and err["param"] == param and param in err["message"]


def test_http_errors(server):
    st, _, body = server.http("POST", "/v1/chat/completions", "{not json")
    assert st == 400 and "JSON" in json.loads(body)["error"]["message"]
    st, _, body = server.http("GET", "/v1/nothing")
    assert st == 404 and json.loads(body)["error"]["code"] == "not_found"
    st, _, _ = server.http("GET", "/v1/completions")
    assert st == 405
    st, _, body = server.http("POST", "/v1/completions", {"model": "other", "prompt": "x"})
    assert st == 404 and json.loads(body)["error"]["param"] == "model"
    big = b'{"prompt": "' + b"a" * (9 << 20) + b'"}'
    st, _, body = server.http("POST", "/v1/completions", big, {"Content-Type": "application/json"})
    assert st == 413 and json.loads(body)["error"]["code"] == "request_too_large"
    # a prompt longer than the context
    st, _, body = server.http("POST", "/v1/completions", {"prompt": [1] * 2000, "max_tokens": 4})
    assert st == 400 and json.loads(body)["error"]["param"] == "prompt"
    # and the server still answers
    assert server.client().completions.create(model=server.model, prompt="x", max_tokens=2).usage.completion_tokens >= 1


def test_metrics_prometheus(server):
    server.client().completions.create(model=server.model, prompt=PROMPT, max_tokens=4, temperature=0)
    v = metrics(server)
    for name in ["kiln_requests_submitted_total", "kiln_requests_finished_total", "kiln_generated_tokens_total",
                 "kiln_queue_depth", "kiln_running_requests", "kiln_kv_blocks_used", "kiln_kv_blocks_free",
                 "kiln_kv_blocks_cached", "kiln_prefix_cache_hit_rate", "kiln_http_active_requests"]:
        assert name in v, name
    assert v["kiln_requests_finished_total"] >= 1 and v["kiln_generated_tokens_total"] >= 4
    assert 0 <= v["kiln_prefix_cache_hit_rate"] <= 1
    for h in ["kiln_time_to_first_token_seconds", "kiln_inter_token_latency_seconds"]:
        buckets = [(k, x) for k, x in v.items() if k.startswith(h + "_bucket")]
        counts = [x for _, x in buckets]
        assert counts == sorted(counts) and buckets[-1][0].endswith('le="+Inf"}')
        assert buckets[-1][1] == v[h + "_count"] and v[h + "_sum"] >= 0
    assert v["kiln_time_to_first_token_seconds_count"] >= 1
    # the text parses with the reference parser too, when it is installed
    try:
        from prometheus_client.parser import text_string_to_metric_families
    except ImportError:
        return
    st, _, body = server.http("GET", "/metrics")
    assert len(list(text_string_to_metric_families(body.decode()))) >= 15


def test_client_disconnect_cancels(server):
    before = metrics(server)
    c = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    c.request("POST", "/v1/completions", json.dumps({"prompt": "Write a long story.", "max_tokens": 400,
                                                     "ignore_eos": True, "stream": True}))
    r = c.getresponse()
    assert r.status == 200
    got = b""
    while got.count(b"\n\n") < 3:
        got += r.read1(4096) if hasattr(r, "read1") else r.read(64)
    c.sock.close()  # leave mid-stream
    c.close()
    deadline = time.time() + 30
    while time.time() < deadline:
        v = metrics(server)
        if v["kiln_requests_cancelled_total"] > before["kiln_requests_cancelled_total"]:
            break
        time.sleep(0.1)
    assert v["kiln_requests_cancelled_total"] == before["kiln_requests_cancelled_total"] + 1
    assert v["kiln_http_client_disconnects_total"] >= before["kiln_http_client_disconnects_total"] + 1
    assert v["kiln_generated_tokens_total"] - before["kiln_generated_tokens_total"] < 400
    # a client that leaves while waiting for a whole (non-streamed) answer: cancelled too
    before = v
    sock = socket.create_connection(("127.0.0.1", server.port))
    body = json.dumps({"prompt": "Write a long story.", "max_tokens": 400, "ignore_eos": True}).encode()
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n" % len(body) + body)
    deadline = time.time() + 30
    while time.time() < deadline and metrics(server)["kiln_running_requests"] == 0:
        time.sleep(0.02)
    sock.close()
    deadline = time.time() + 30
    while time.time() < deadline:
        v = metrics(server)
        if v["kiln_requests_cancelled_total"] > before["kiln_requests_cancelled_total"]:
            break
        time.sleep(0.1)
    assert v["kiln_requests_cancelled_total"] == before["kiln_requests_cancelled_total"] + 1
    assert v["kiln_generated_tokens_total"] - before["kiln_generated_tokens_total"] < 400
    # later requests are unaffected
    r = server.client().completions.create(model=server.model, prompt=PROMPT, max_tokens=5, temperature=0)
    assert r.usage.completion_tokens == 5
    assert metrics(server)["kiln_running_requests"] == 0


# ---- servers of their own ----------------------------------------------------------------------


def test_api_key(build_dir, smollm2_gguf, tmp_path):
    keyfile = tmp_path / "key"
    keyfile.write_text("s3cret-key\n")
    s = Server(build_dir, smollm2_gguf, "--api-key-file", str(keyfile), "--model-name", "tiny")
    try:
        assert s.model == "tiny"
        assert s.http("GET", "/health")[0] == 200  # public
        assert s.http("GET", "/")[0] == 200        # the page is public, its fetches are not
        for path in ["/v1/models", "/metrics"]:
            st, h, body = s.http("GET", path)
            assert st == 401 and json.loads(body)["error"]["code"] == "invalid_api_key"
        st, _, _ = s.http("POST", "/tokenize", {"prompt": "x"}, {"Authorization": "Bearer wrong"})
        assert st == 401
        with pytest.raises(openai.AuthenticationError):
            s.client("wrong").completions.create(model="tiny", prompt="x", max_tokens=2)
        r = s.client("s3cret-key").completions.create(model="tiny", prompt="x", max_tokens=2)
        assert r.model == "tiny" and r.usage.completion_tokens >= 1
        assert s.http("GET", "/metrics", headers={"Authorization": "Bearer s3cret-key"})[0] == 200
    finally:
        rc, err = s.stop()
    assert rc == 0, err


def test_queue_full_429(build_dir, smollm2_gguf):
    s = Server(build_dir, smollm2_gguf, "--max-queue", "1", "--max-seqs", "1")
    results = []
    lock = threading.Lock()

    def one(n=24):
        st, h, body = s.http("POST", "/v1/completions", {"prompt": "Count to ten:", "max_tokens": n,
                                                         "ignore_eos": True})
        with lock:
            results.append((st, h, body))

    try:
        threads = [threading.Thread(target=one) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        codes = sorted(st for st, _, _ in results)
        assert 200 in codes and 429 in codes, codes
        assert set(codes) <= {200, 429}
        for st, h, body in results:
            if st == 429:
                assert h["retry-after"] == "1"
                assert json.loads(body)["error"]["type"] == "rate_limit_error"
        assert metrics(s)["kiln_requests_rejected_total"] == codes.count(429)
        # the client names it too: fill the running slot, then the queue (one at a time: a
        # request counts as queued until the worker takes it), then one more
        client = s.client()
        ths = []

        def wait_for(name, value):
            deadline = time.time() + 60
            while time.time() < deadline and metrics(s)[name] != value:
                time.sleep(0.01)
            assert metrics(s)[name] == value, name

        try:
            for name in ["kiln_running_requests", "kiln_queue_depth"]:
                ths.append(threading.Thread(target=one, args=(160,)))
                ths[-1].start()
                wait_for(name, 1)
            with pytest.raises(openai.RateLimitError):
                client.completions.create(model=s.model, prompt="x", max_tokens=24)
        finally:
            for t in ths:
                t.join()
    finally:
        rc, err = s.stop()
    assert rc == 0, err


def test_sigterm_drains(build_dir, smollm2_gguf):
    s = Server(build_dir, smollm2_gguf)
    c = http.client.HTTPConnection("127.0.0.1", s.port, timeout=60)
    c.request("POST", "/v1/completions", json.dumps({"prompt": PROMPT, "max_tokens": 40, "ignore_eos": True,
                                                     "temperature": 0, "stream": True}))
    r = c.getresponse()
    first = r.read1(4096) if hasattr(r, "read1") else r.read(64)
    assert first.startswith(b"data: ")
    s.proc.send_signal(signal.SIGTERM)
    rest = r.read()  # the stream runs to its end
    events = (first + rest).decode().split("\n\n")
    assert events[-2] == "data: [DONE]"
    finish = json.loads(events[-3][len("data: "):])["choices"][0]["finish_reason"]
    assert finish == "length"
    rc = s.proc.wait(60)  # no second signal: that one would end it at once
    err = s.proc.stderr.read()
    assert rc == 0, err
    assert "draining" in err and "still held: 0 bytes in 0 blocks" in err
    with pytest.raises(OSError):
        s.http("GET", "/health", timeout=2)


def test_usage_errors(build_dir, smollm2_gguf, tmp_path):
    k = kiln_bin(build_dir)
    for args, needle in [([], "a model is required"),
                         (["-m", smollm2_gguf, "--port", "70000"], "--port"),
                         (["-m", smollm2_gguf, "--kv-blocks", "8", "--kv-memory", "1M"], "not both"),
                         (["-m", smollm2_gguf, "--kv-memory", "12Q"], "--kv-memory"),
                         (["-m", smollm2_gguf, "--bogus"], "unknown option")]:
        r = subprocess.run([k, "serve", *args], capture_output=True, text=True, timeout=60)
        assert r.returncode == 2 and needle in r.stderr, (args, r.stderr)
    empty = tmp_path / "empty"
    empty.write_text("\n")
    r = subprocess.run([k, "serve", "-m", smollm2_gguf, "--api-key-file", str(empty)], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 1 and "empty" in r.stderr
    # a port in use: a clean error, exit 1
    s = Server(build_dir, smollm2_gguf)
    try:
        r = subprocess.run([k, "serve", "-m", smollm2_gguf, "--ctx", "128", "--port", str(s.port)],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 1 and "cannot listen" in r.stderr, r.stderr
    finally:
        rc, err = s.stop()
    assert rc == 0, err


def test_engine_options_same_answers(server, build_dir, smollm2_gguf):
    """A tight engine (2 slots, 3 KV blocks of 64 positions for answers that need 2 each, so
    it preempts; 16-token steps, no prefix cache) under 4 concurrent requests gives each the
    answer the roomy server gives it alone."""
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "Water boils at"]
    kw = dict(max_tokens=80, temperature=0.8, seed=7, extra_body={"ignore_eos": True})
    ref = [server.client().completions.create(model=server.model, prompt=p, **kw).choices[0].text for p in prompts]
    s = Server(build_dir, smollm2_gguf, "--ctx", "128", "--max-seqs", "2", "--kv-blocks", "3",
               "--max-batch-tokens", "16", "--no-prefix-cache")
    try:
        got = [None] * len(prompts)

        def one(i):
            got[i] = s.client().completions.create(model=s.model, prompt=prompts[i], **kw).choices[0].text

        ths = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
        for t in ths:
            t.start()
        for t in ths:
            t.join()
        assert got == ref
        v = metrics(s)
        assert v["kiln_kv_blocks_total"] == 3 and v["kiln_preemptions_total"] >= 1
    finally:
        rc, err = s.stop()
    assert rc == 0, err


def test_step_log(build_dir, smollm2_gguf, tmp_path):
    """KILN_SERVE_STEP_LOG: one line a step whose counts add up to the requests' tokens (16-token
    steps, so prompts are cut into chunks beside the decodes), times in order; a path that
    cannot be written stops the server at start with the variable named."""
    log = tmp_path / "steps.txt"
    s = Server(build_dir, smollm2_gguf, "--max-batch-tokens", "16", "--max-seqs", "4", "--no-prefix-cache",
               env={"KILN_SERVE_STEP_LOG": str(log)})
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a land far away,"]
    usage = [None] * len(prompts)
    try:
        def one(i):
            r = s.client().completions.create(model=s.model, prompt=prompts[i], max_tokens=12, temperature=0.0,
                                              extra_body={"ignore_eos": True})
            usage[i] = r.usage

        ths = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
        for t in ths:
            t.start()
        for t in ths:
            t.join()
    finally:
        rc, err = s.stop()
    assert rc == 0, err
    lines = log.read_text().splitlines()
    assert lines[0].startswith("# t_begin t_end n_decode n_prefill n_out prefill_cap running waiting")
    rows = [ln.split() for ln in lines[1:]]
    assert rows and all(len(r) == 8 for r in rows)
    t = [(float(r[0]), float(r[1])) for r in rows]
    n = [[int(v) for v in r[2:]] for r in rows]
    assert all(0 <= b <= e for b, e in t) and all(t[i][1] <= t[i + 1][0] for i in range(len(t) - 1))
    assert all(dec + pre <= 16 and dec <= run and out <= run for dec, pre, out, cap, run, wait in n)
    assert all(cap == -1 or cap >= 16 for dec, pre, out, cap, run, wait in n)
    # every prompt token and every answer token but the last goes through one row once; every
    # answer token is one output row's sample. A row is a decode row when it is its request's only
    # row in the step with a token to sample: every fed-back answer token, and a prompt's last token
    # when a chunk boundary leaves it alone (16-token steps: how often depends on the interleaving)
    assert sum(x[0] + x[1] for x in n) == sum(u.prompt_tokens + u.completion_tokens - 1 for u in usage)
    assert sum(x[2] for x in n) == sum(u.completion_tokens for u in usage) == 12 * len(prompts)
    fed_back = sum(u.completion_tokens - 1 for u in usage)
    assert fed_back <= sum(x[0] for x in n) <= fed_back + len(prompts)
    r = subprocess.run([kiln_bin(build_dir), "serve", "-m", smollm2_gguf, "--port", "0"], capture_output=True,
                       text=True, timeout=60, env={**os.environ, "KILN_SERVE_STEP_LOG": str(tmp_path / "no" / "x")})
    assert r.returncode == 1 and "KILN_SERVE_STEP_LOG" in r.stderr, r.stderr
    # an engine that fails after opening its log (its worker cannot start the device: no
    # machine has a GPU 1000) leaves no header-only log behind
    gone = tmp_path / "gone.txt"
    r = subprocess.run([kiln_bin(build_dir), "serve", "-m", smollm2_gguf, "--port", "0", "--device", "cuda:1000"],
                       capture_output=True, text=True, timeout=60, env={**os.environ, "KILN_SERVE_STEP_LOG": str(gone)})
    assert r.returncode == 1 and "CUDA" in r.stderr and not gone.exists(), (r.stderr, gone.exists())


@pytest.mark.parametrize("args", [("--fast",), ("--fast", "--batch-invariant"), ("--format", "mx8"),
                                  ("--format", "mx8,output=mx16,blk.0-3=f32")],
                         ids=["fast", "fast-batch-invariant", "format-mx8", "format-rules"])
def test_invariant_arithmetic_equals_generate(build_dir, smollm2_gguf, args):
    """The batch-invariant arithmetics on the CPU: concurrent requests get `kiln generate`'s
    greedy text with the same options. --fast takes the 8-bit path at every batch size (so
    --batch-invariant changes nothing on the CPU); --format mx8 quantizes each token's row on
    its own and sums exact integers."""
    prompts = ["The capital of France is", "Once upon a time", "def fibonacci(n):"]
    ref = [generate(build_dir, smollm2_gguf, p, 16, extra=args)["text"] for p in prompts]
    s = Server(build_dir, smollm2_gguf, *args)
    try:
        got = [None] * len(prompts)

        def one(i):
            got[i] = s.client().completions.create(model=s.model, prompt=prompts[i], max_tokens=16,
                                                   temperature=0).choices[0].text

        ths = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
        for t in ths:
            t.start()
        for t in ths:
            t.join()
        assert got == ref
    finally:
        rc, err = s.stop()
    assert rc == 0, err
