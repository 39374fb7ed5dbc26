"""The CLI's manners (issue 32, part 5): `kiln chat` driven in a pseudo-terminal (banner,
/help, /reset, /bye, an empty line ignored, Ctrl-C stopping a reply and clearing a line), a
random seed printed so a run can be repeated, `kiln train` refusing a used --out and
stopping with a checkpoint on SIGINT, `kiln export` from a checkpoint, `kiln help CMD` and
the model as a bare argument."""
import json
import os
import pty
import select
import signal
import subprocess
import time

import pytest

from test_parity import CORPUS, build_model

CHATML = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
          "<|im_start|>assistant\n")


def kiln(build_dir, *args, check=True, timeout=600):
    r = subprocess.run([str(build_dir / "kiln"), *map(str, args)], capture_output=True, text=True, timeout=timeout)
    if check:
        assert r.returncode == 0, r.stderr[-3000:]
    return r


def add_chat_template(d):
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["chat_template"] = CHATML
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A 2-layer Llama with a ChatML template, and a token shard of the test corpus."""
    base = tmp_path_factory.mktemp("manners")
    d, _ = build_model(base, "llama")
    add_chat_template(d)
    return base, d


@pytest.fixture(scope="module")
def shard(tiny, build_dir):
    base, d = tiny
    (base / "corpus.txt").write_text("\n\n".join(CORPUS * 8))
    kiln(build_dir, "data", "-m", d, "-o", base / "corpus.tok", base / "corpus.txt")
    return base / "corpus.tok"


@pytest.fixture(scope="module")
def slow_chat_model(tmp_path_factory):
    """A wider Llama with a long context whose end-of-text rows of the LM head are zero: greedy
    replies run to -n (thousands of tokens, seconds), long enough to be interrupted."""
    import torch
    import transformers as tf
    from test_parity import make_tokenizer
    d = tmp_path_factory.mktemp("slow") / "slow"
    d.mkdir()
    make_tokenizer(d)
    add_chat_template(d)
    cfg = tf.LlamaConfig(hidden_size=512, intermediate_size=1536, num_hidden_layers=4, num_attention_heads=8,
                         num_key_value_heads=4, vocab_size=448, max_position_embeddings=4096, rms_norm_eps=1e-5,
                         bos_token_id=None, eos_token_id=0, pad_token_id=None, tie_word_embeddings=False)
    torch.manual_seed(7)
    model = tf.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        model.lm_head.weight[:3] = 0  # <|endoftext|>, <|im_start|>, <|im_end|>: never the argmax
    model.save_pretrained(d)
    return d


class Pty:
    """A child process on a pseudo-terminal; expect() reads until a text shows up."""

    def __init__(self, argv):
        self.pid, self.fd = pty.fork()
        if self.pid == 0:
            try:
                os.execv(argv[0], argv)
            finally:
                os._exit(127)
        self.out = ""

    def read(self, timeout):
        r, _, _ = select.select([self.fd], [], [], timeout)
        if not r:
            return False
        try:
            data = os.read(self.fd, 65536)
        except OSError:  # EIO: the child closed the terminal
            return None
        if not data:
            return None
        self.out += data.decode("utf-8", "replace")
        return True

    def expect(self, text, timeout=60, since=0):
        end = time.time() + timeout
        while text not in self.out[since:]:
            left = end - time.time()
            got = self.read(max(left, 0))
            assert got is not None and left > 0, f"no {text!r} in output:\n{self.out[-3000:]}"
        return self.out.index(text, since) + len(text)

    def send(self, text):
        os.write(self.fd, text.encode())

    def wait(self, timeout=30):
        end = time.time() + timeout
        while time.time() < end:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                while self.read(0.1):
                    pass
                return os.waitstatus_to_exitcode(status)
            self.read(0.1)
        os.kill(self.pid, signal.SIGKILL)
        os.waitpid(self.pid, 0)
        raise AssertionError(f"the child did not exit:\n{self.out[-3000:]}")

    def close(self):
        try:
            os.kill(self.pid, signal.SIGKILL)
            os.waitpid(self.pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass
        os.close(self.fd)


def test_chat_in_a_terminal(build_dir, slow_chat_model):
    p = Pty([str(build_dir / "kiln"), "chat", str(slow_chat_model), "--temp", "0", "-n", "3900", "--ctx", "4096",
             "-t", "2"])
    try:
        # the banner: model name, architecture, context, how to quit, the seed
        at = p.expect("/help for commands")
        assert "slow" in p.out and "llama" in p.out and "context 4096" in p.out
        assert "/bye or Ctrl-D" in p.out and "[kiln] seed" in p.out
        at = p.expect("> ", since=at)
        p.send("/help\n")
        at = p.expect("/reset", since=at)
        at = p.expect("> ", since=at)
        # an empty line is ignored: the prompt comes back and kiln still runs
        p.send("\n")
        at = p.expect("> ", since=at)
        p.send("/reset\n")
        at = p.expect("conversation cleared", since=at)
        at = p.expect("> ", since=at)
        # Ctrl-C during a long reply stops only the reply
        p.send("tell me everything\n")
        p.expect("tell me everything", since=at)
        time.sleep(1.5)
        t0 = time.time()
        p.send("\x03")
        at = p.expect("[interrupted]", timeout=20, since=at)
        assert time.time() - t0 < 15
        at = p.expect("> ", since=at)
        # Ctrl-C at the prompt clears the line; kiln keeps running
        p.send("half a line")
        time.sleep(0.2)
        p.send("\x03")
        at = p.expect("line cleared", since=at)
        at = p.expect("> ", since=at)
        p.send("/help\n")  # still alive after the cleared line
        at = p.expect("/bye", since=at)
        p.expect("> ", since=at)
        p.send("/bye\n")
        assert p.wait() == 0
    finally:
        p.close()


def test_chat_second_ctrl_c_and_ctrl_d_quit(build_dir, tiny):
    _, d = tiny
    p = Pty([str(build_dir / "kiln"), "chat", "-m", str(d)])
    try:
        at = p.expect("> ")
        p.send("\x03")
        at = p.expect("line cleared", since=at)
        p.expect("> ", since=at)
        p.send("\x03")
        assert p.wait() == 0
    finally:
        p.close()
    p = Pty([str(build_dir / "kiln"), "chat", "-m", str(d)])
    try:
        p.expect("> ")
        p.send("\x04")
        assert p.wait() == 0
    finally:
        p.close()


def test_chat_commands_are_not_sent_piped(build_dir, tiny):
    """Not on a terminal: commands and empty lines behave the same; end of input quits."""
    _, d = tiny
    r = subprocess.run([str(build_dir / "kiln"), "chat", d, "--temp", "0", "-n", "4"], input="\n/help\n\n/reset\n/bye\nnever\n",
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "/reset" in r.stdout and "conversation cleared" in r.stdout
    assert "never" not in r.stdout


def test_seed_printed_and_repeatable(build_dir, tiny):
    _, d = tiny
    args = ["generate", d, "-p", "And God said", "-n", "12", "--temp", "1.5", "--top-k", "0", "--min-p", "0"]
    a, b = kiln(build_dir, *args), kiln(build_dir, *args)
    seeds = []
    for r in (a, b):
        line = [ln for ln in r.stderr.splitlines() if ln.startswith("[kiln] seed ")]
        assert line, r.stderr
        seed = line[0].split()[2]
        assert f"(repeat with --seed {seed})" in line[0]
        seeds.append(seed)
    assert seeds[0] != seeds[1]  # 64 random bits each run
    again = kiln(build_dir, *args, "--seed", seeds[0])
    assert again.stdout == a.stdout
    assert f"[kiln] seed {seeds[0]} (repeat with --seed {seeds[0]})" in again.stderr
    s1, s2 = kiln(build_dir, *args, "--seed", "42"), kiln(build_dir, *args, "--seed", "42")
    assert s1.stdout == s2.stdout


def test_generate_errors_and_positional_model(build_dir, tiny, tmp_path):
    _, d = tiny
    r = kiln(build_dir, "generate", "-m", tmp_path / "nonexistent", "-p", "hi", check=False)
    assert r.returncode == 1 and r.stderr.count(str(tmp_path / "nonexistent")) == 1, r.stderr
    r = kiln(build_dir, "generate", d, "--system", "be brief", "-p", "hi", check=False)
    assert r.returncode == 2 and "add --chat" in r.stderr
    r = kiln(build_dir, "generate", d, "-p", "And God said let there be light", "--ctx", "3", check=False)
    assert r.returncode == 1 and "--ctx" in r.stderr
    r = kiln(build_dir, "generate", check=False)
    assert r.returncode == 2 and "MODEL" in r.stderr
    pos = kiln(build_dir, "generate", d, "-p", "And God", "-n", "4", "--temp", "0", "--json")
    opt = kiln(build_dir, "generate", "-m", d, "-p", "And God", "-n", "4", "--temp", "0", "--json")
    assert json.loads(pos.stdout)["ids"] == json.loads(opt.stdout)["ids"]
    info = kiln(build_dir, "info", d, "--json", "--no-tensors")
    assert json.loads(info.stdout)["architecture"] == "llama"


def test_help_cmd(build_dir):
    for cmd in ("generate", "chat", "train", "export", "info", "data", "serve", "fingerprint", "verify", "distill", "audit"):
        r = kiln(build_dir, "help", cmd)
        assert r.stdout.startswith(f"usage: kiln {cmd}"), (cmd, r.stdout[:200])
        assert r.stdout == kiln(build_dir, cmd, "--help").stdout
    r = kiln(build_dir, "help")
    assert "commands:" in r.stdout and "export" in r.stdout


TRAIN = ["--batch", "2", "--seq", "16", "--lr", "3e-3", "--warmup", "1", "--schedule", "constant", "--eval-every", "0",
         "--eval-fraction", "0", "--save-every", "0", "--threads", "1"]


def test_train_refuses_used_out(build_dir, tiny, shard, tmp_path):
    _, d = tiny
    out = tmp_path / "run"
    args = ["train", "-m", d, "--data", shard, "--out", out, "--steps", "2", *TRAIN, "--no-export"]
    kiln(build_dir, *args)
    r = kiln(build_dir, *args, check=False)
    assert r.returncode == 2 and str(out) in r.stderr and "--resume" in r.stderr and "--overwrite" in r.stderr
    kiln(build_dir, *args, "--overwrite")  # a new run: its step-2 checkpoint is written again
    r = kiln(build_dir, *args, "--overwrite", "--resume", check=False)
    assert r.returncode == 2
    empty = tmp_path / "empty"
    empty.mkdir()
    kiln(build_dir, "train", "-m", d, "--data", shard, "--out", empty, "--steps", "1", *TRAIN, "--no-export")


@pytest.mark.parametrize("sig,code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_train_signal_checkpoints_and_resumes(build_dir, tiny, shard, tmp_path, sig, code):
    _, d = tiny
    out = tmp_path / "run"
    args = ["train", "-m", d, "--data", shard, "--out", out, *TRAIN, "--no-export"]
    p = subprocess.Popen([str(build_dir / "kiln"), *map(str, args), "--steps", "100000"], stderr=subprocess.PIPE,
                         text=True)
    try:
        end = time.time() + 120
        while time.time() < end:  # a few steps done
            m = out / "metrics.csv"
            if m.exists() and len(m.read_text().splitlines()) >= 4:
                break
            time.sleep(0.1)
        p.send_signal(sig)
        _, err = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert p.returncode == code, err[-2000:]
    assert "checkpoint" in err and str(out / "checkpoints") in err, err[-2000:]
    steps = sorted(int(x.name.split("-")[1]) for x in (out / "checkpoints").iterdir() if x.name.startswith("step-"))
    assert steps, list((out / "checkpoints").iterdir())
    k = steps[-1]
    assert f"step-{k}" in err
    rows = (out / "metrics.csv").read_text().splitlines()
    assert len(rows) == k + 1  # a header and one row a step: the checkpoint is the last step done
    r = kiln(build_dir, *args, "--steps", str(k + 2), "--resume")
    assert f"at step {k}" in r.stderr
    assert len((out / "metrics.csv").read_text().splitlines()) == k + 3


def test_export_from_checkpoint(build_dir, tiny, shard, tmp_path):
    """`kiln export` of a run's last checkpoint gives the very folder the run exported."""
    base, d = tiny
    run = tmp_path / "run"
    kiln(build_dir, "train", "-m", d, "--data", shard, "--out", run, "--steps", "3", *TRAIN)
    exp = tmp_path / "exported"
    r = kiln(build_dir, "export", run, "-o", exp)
    assert str(exp) in r.stderr
    assert (exp / "model.safetensors").read_bytes() == (run / "model" / "model.safetensors").read_bytes()
    g = kiln(build_dir, "generate", exp, "-p", "And God said", "-n", "5", "--temp", "0", "--ignore-eos", "--json")
    assert len(json.loads(g.stdout)["ids"]) == 5
    # the checkpoints folder itself, -m, and --overwrite
    r = kiln(build_dir, "export", run / "checkpoints", "--out", exp, check=False)
    assert r.returncode == 1 and "--overwrite" in r.stderr
    kiln(build_dir, "export", run / "checkpoints", "--out", exp, "-m", d, "--overwrite")
    assert (exp / "model.safetensors").read_bytes() == (run / "model" / "model.safetensors").read_bytes()
    # a from-scratch run records its --config and --tokenizer
    scratch = tmp_path / "scratch"
    kiln(build_dir, "train", "--config", "tiny", "--tokenizer", d, "--data", shard, "--out", scratch, "--steps", "2",
         *TRAIN)
    kiln(build_dir, "export", scratch, "-o", tmp_path / "scratch-exp")
    assert ((tmp_path / "scratch-exp" / "model.safetensors").read_bytes()
            == (scratch / "model" / "model.safetensors").read_bytes())
    r = kiln(build_dir, "export", tmp_path / "nothing", "-o", tmp_path / "x", check=False)
    assert r.returncode == 1 and str(tmp_path / "nothing") in r.stderr


def test_generate_fits_the_context_to_a_long_prompt(build_dir, tiny, tmp_path):
    """Without --ctx the default context (the model's, at most 4096 positions) grows to hold a
    longer prompt and -n as far as the model's trained context goes; past that, a clear refusal.
    With --ctx the user's size holds."""
    import shutil
    _, d = tiny
    big = tmp_path / "long-context"
    shutil.copytree(d, big)
    cfg = json.loads((big / "config.json").read_text())
    cfg["max_position_embeddings"] = 6000
    (big / "config.json").write_text(json.dumps(cfg))
    text = "And God said let there be light and there was light. " * 125
    prompt = tmp_path / "prompt.txt"
    prompt.write_text(text)
    r = kiln(build_dir, "generate", big, "-f", prompt, "-n", "4", "--temp", "0", "--ignore-eos", "--json")
    out = json.loads(r.stdout)
    assert 4096 < out["n_prompt"] <= 6000 - 4 and out["n_generated"] == 4, (out["n_prompt"], out["n_generated"])
    r = kiln(build_dir, "generate", big, "-f", prompt, "-n", "4", "--ctx", "4096", check=False)
    assert r.returncode == 1 and "larger --ctx" in r.stderr, r.stderr
    prompt.write_text(text * 2)
    r = kiln(build_dir, "generate", big, "-f", prompt, "-n", "4", check=False)
    assert r.returncode == 1 and "model's context is 6000: shorten the prompt" in r.stderr, r.stderr
