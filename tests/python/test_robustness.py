"""Bad input end to end: allocation failure during a model load, broken model folders, and the
CLI's errors and JSON output, run as real processes."""
import json
import shutil
import subprocess

import pytest

from test_parity import build_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d, _ = build_model(tmp_path_factory.mktemp("tiny"), "qwen2")
    return d


def run(build_dir, *args, input=None):
    return subprocess.run([str(build_dir / "kiln"), *map(str, args)], capture_output=True, text=True,
                          input=input, timeout=300)


def test_alloc_failure_sweep(build_dir, tiny):
    r = subprocess.run([str(build_dir / "alloc_fail_load"), str(tiny)], capture_output=True, text=True, timeout=600)
    print(r.stdout, r.stderr[-2000:])
    assert r.returncode == 0, r.stderr[-2000:]
    assert " 0 failed" in r.stdout


def test_alloc_failure_sweep_training(build_dir, tiny, tmp_path):
    """Every allocation of trainer creation, one training step and a checkpoint load failed
    in turn: each run returns a clean out-of-memory error and leaves nothing allocated."""
    r = subprocess.run([str(build_dir / "alloc_fail_load"), "--train", str(tiny), str(tmp_path / "ckpt")],
                       capture_output=True, text=True, timeout=900)
    print(r.stdout, r.stderr[-2000:])
    assert r.returncode == 0, r.stderr[-2000:]
    runs, failed = r.stdout.split(" runs, ")
    assert int(runs) > 50 and failed.startswith("0 failed")


def test_broken_folders(build_dir, tiny, tmp_path):
    import kiln
    with pytest.raises(kiln.KilnError, match="no such file"):
        kiln.Model(tmp_path / "nope")
    bad = tmp_path / "bad"
    shutil.copytree(tiny, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["num_key_value_heads"] = 3  # 4 heads do not split into 3 groups
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(kiln.KilnError, match="num_key_value_heads|n_head_kv"):
        kiln.Model(bad)
    cfg["num_key_value_heads"] = 2
    cfg["model_type"] = "gpt_neox"
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(kiln.KilnError, match="gpt_neox"):
        kiln.Model(bad)
    cfg["model_type"] = "qwen2"
    cfg["hidden_size"] = 96  # weights no longer match
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(kiln.KilnError, match="shape|elements"):
        kiln.Model(bad)
    (bad / "config.json").write_text("{not json")
    with pytest.raises(kiln.KilnError, match="config.json"):
        kiln.Model(bad)


def test_sparse_tokenizer_ids(tiny, tmp_path):
    """One huge id in a small vocabulary is refused before the id-indexed tables are allocated
    (the fuzzer's input: a 60M id in a 10-token file cost more than 2 GB)."""
    import kiln
    bad = tmp_path / "sparse"
    shutil.copytree(tiny, bad)
    tok = json.loads((bad / "tokenizer.json").read_text())
    first = next(iter(tok["model"]["vocab"]))
    tok["model"]["vocab"][first] = 60_000_000
    (bad / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(kiln.KilnError, match="too sparse"):
        kiln.Model(bad)


def test_cli_generate_json(build_dir, tiny):
    r = run(build_dir, "generate", "-m", tiny, "-p", "The quick brown fox", "-n", "8", "--temp", "0",
            "--ignore-eos", "--json", "--threads", "2")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["n_generated"] == 8 and len(out["ids"]) == 8
    assert out["prompt_ids"] and out["stop_reason"] == "length"
    assert out["decode_tokens_per_s"] > 0 and out["prefill_tokens_per_s"] > 0
    # same seed, same tokens; sampling is deterministic
    a = run(build_dir, "generate", "-m", tiny, "-p", "hello", "-n", "8", "--seed", "7", "--temp", "1.0",
            "--ignore-eos", "--json")
    b = run(build_dir, "generate", "-m", tiny, "-p", "hello", "-n", "8", "--seed", "7", "--temp", "1.0",
            "--ignore-eos", "--json", "--threads", "1")
    assert json.loads(a.stdout)["ids"] == json.loads(b.stdout)["ids"]


def test_cli_errors(build_dir, tiny, tmp_path):
    r = run(build_dir, "generate", "-p", "x")
    assert r.returncode == 2 and "model is required" in r.stderr
    r = run(build_dir, "generate", "-m", tiny, "-p", "x", "--temp", "abc")
    assert r.returncode == 2 and "--temp" in r.stderr
    r = run(build_dir, "generate", "-m", tmp_path / "missing.gguf", "-p", "x")
    assert r.returncode == 1 and "missing.gguf" in r.stderr
    r = run(build_dir, "frobnicate")
    assert r.returncode == 2 and "unknown command" in r.stderr
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(b"GGUF\x03\x00\x00\x00" + b"\xff" * 64)
    r = run(build_dir, "info", "-m", garbage)
    assert r.returncode == 1 and "garbage.gguf" in r.stderr
    for cmd in ("generate", "chat", "tokenize", "detokenize", "info"):
        r = run(build_dir, cmd, "--help")
        assert r.returncode == 0 and "usage" in r.stdout


def test_cli_tokenize_roundtrip(build_dir, tiny):
    r = run(build_dir, "tokenize", "-m", tiny, "-p", "hello world 🙂", "--json")
    assert r.returncode == 0, r.stderr
    ids = json.loads(r.stdout)["ids"]
    r = run(build_dir, "detokenize", "-m", tiny, *ids)
    assert r.returncode == 0 and r.stdout == "hello world 🙂\n"


def test_cli_info(build_dir, tiny):
    r = run(build_dir, "info", "-m", tiny, "--json")
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    assert info["architecture"] == "qwen2" and info["n_layer"] == 2
    assert any(t["name"] == "model.layers.0.self_attn.q_proj.bias" for t in info["tensors"])
