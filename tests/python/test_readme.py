"""Every command the README shows runs as written, against the default model
(SmolLM2-135M-Instruct Q4_1, $KILN_SMOLLM2_GGUF):

  * the "Generate and chat" block: each `build/kiln ...` line (the chat one with /bye on stdin);
  * the "Train" block: each line in order, in one folder, with the step counts cut to a few
    steps (what is shown trains for minutes) and a small corpus;
  * the "Serve" blocks: `kiln serve` started as shown (on a free port), then the curl line and
    the Python `openai` example run against it.

The Python package's example is run by test_package.py against an installed wheel.
"""
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
README = (REPO / "README.md").read_text()


def section(title):
    return README.split(f"\n## {title}\n", 1)[1].split("\n## ", 1)[0]


def blocks(text, lang):
    return re.findall(rf"```{lang}\n(.*?)```", text, re.S)


def commands(block):
    """The block's commands: continued lines joined, comments dropped."""
    out, cur = [], ""
    for line in block.splitlines():
        line = line.rstrip()
        if line.endswith("\\"):
            cur += line[:-1] + " "
            continue
        cur += line
        cmd = re.sub(r"\s+#.*$", "", cur).strip()
        cur = ""
        if cmd and not cmd.startswith("#"):
            out.append(cmd)
    return out


def run(cmd, build_dir, model, cwd, stdin=None, timeout=600):
    args = shlex.split(cmd)
    assert args[0] == "build/kiln", cmd
    args = [str(build_dir / "kiln")] + [model if a == "MODEL" else a for a in args[1:]]
    r = subprocess.run(args, cwd=cwd, input=stdin, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, f"{cmd}\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}"
    return r


def test_generate_and_chat_block(build_dir, smollm2_gguf, tmp_path):
    cmds = commands(blocks(section("Generate and chat"), "sh")[0])
    assert len(cmds) >= 6
    for cmd in cmds:
        stdin = "/bye\n" if " chat " in cmd + " " else None
        r = run(cmd, build_dir, str(smollm2_gguf), tmp_path, stdin=stdin, timeout=300)
        if "--json" in cmd:
            assert r.stdout.lstrip().startswith("{"), cmd


def test_train_block(build_dir, smollm2_gguf, tmp_path):
    cmds = commands(blocks(section("Train"), "sh")[0])
    assert any(" data " in c for c in cmds) and any(" export " in c for c in cmds)
    words = ("In the beginning God created the heaven and the earth. And the earth was without form, "
             "and void; and darkness was upon the face of the deep. ").split()
    paragraphs = [" ".join(words[i % 7:] + words[:i % 7]) for i in range(200)]  # documents
    (tmp_path / "corpus.txt").write_text("\n\n".join(paragraphs) + "\n")
    resumed = {re.search(r"--out (\S+)", c).group(1) for c in cmds if "--resume" in c}
    for cmd in cmds:
        # two steps instead of hundreds; a run that a later line resumes stops after one
        if " train " in cmd or " distill " in cmd:
            cmd = re.sub(r"--steps \d+", "--steps 2 --seq 32 --batch 2", cmd)
            out = re.search(r"--out (\S+)", cmd).group(1)
            if out in resumed and "--resume" not in cmd:
                cmd += " --stop-after 1"
        run(cmd, build_dir, str(smollm2_gguf), tmp_path, timeout=900)
    assert (tmp_path / "run" / "model" / "config.json").exists()
    assert any((tmp_path / "run-step300").glob("*.safetensors"))


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_serve_blocks(build_dir, smollm2_gguf, tmp_path):
    sh = blocks(section("Serve"), "sh")
    start = commands(sh[0])[0]
    assert start.startswith("build/kiln serve MODEL --port 8080"), start
    port = free_port()
    args = [str(build_dir / "kiln")] + [str(smollm2_gguf) if a == "MODEL" else a
                                        for a in shlex.split(start)[1:]]
    args[args.index("--port") + 1] = str(port)
    log = open(tmp_path / "serve.log", "w")
    p = subprocess.Popen(args + ["--ctx", "1024"], stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.time() + 120
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
                break
            except OSError:
                assert p.poll() is None and time.time() < deadline, (tmp_path / "serve.log").read_text()
                time.sleep(0.3)
        assert shutil.which("curl"), "curl is missing (scripts/setup-deps.sh installs it)"
        curl = commands(sh[1])[0].replace("8080", str(port))
        r = subprocess.run(curl, shell=True, capture_output=True, text=True, timeout=120)
        assert r.returncode == 0 and '"chat.completion"' in r.stdout, r.stdout + r.stderr
        code = blocks(section("Serve"), "python")[0].replace("8080", str(port))
        (tmp_path / "client.py").write_text(code)
        r = subprocess.run([sys.executable, "client.py"], cwd=tmp_path, capture_output=True, text=True,
                           timeout=300)
        assert r.returncode == 0 and r.stdout.strip(), r.stderr
    finally:
        p.send_signal(signal.SIGTERM)
        try:
            assert p.wait(timeout=60) == 0
        finally:
            if p.poll() is None:
                p.kill()
            log.close()
