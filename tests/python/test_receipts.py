"""Fingerprints, generation receipts and `kiln verify` (docs/REPRODUCIBILITY.md).

Oracles: the fingerprint recomputed here from the safetensors files with hashlib, following
the written definition (not kiln's code); the receipt's hash chain recomputed from logits that
kiln.Context.decode gives for the prompt and the generated tokens (one forward over all of
them: the batch invariance makes those rows the bits the generation drew from). Properties:
the same weights give the same fingerprint however they are opened (twice, mmap or not, f32
weight mode, GGUF or safetensors); one changed value changes it; a receipt verifies on the CPU
with 1 and 2 threads, greedy and sampled; every kind of tampering is caught and named. The
CUDA cases (-k cuda) skip where no GPU can be used; scripts/gpu-check.sh runs them on one.
"""
import ctypes
import hashlib
import json
import shutil
import struct
import subprocess

import numpy as np
import pytest

import kiln
from test_parity import build_model

FP_MAGIC = b"kiln-fingerprint-v1\n"
RECEIPT_MAGIC = b"kiln-receipt-v1\n"
ST_DTYPES = {"F32": "f32", "F16": "f16", "BF16": "bf16"}


def kiln_cli(build_dir, *args, check=True, timeout=600):
    r = subprocess.run([str(build_dir / "kiln"), *map(str, args)], capture_output=True, text=True, timeout=timeout)
    if check:
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    return r


# ---- the definitions, written again from docs/REPRODUCIBILITY.md -------------------------------

def combine(entries):
    """The fingerprint of (name, dtype, shape, sha256 of the bytes) entries."""
    h = hashlib.sha256(FP_MAGIC + struct.pack("<I", len(entries)))
    for name, dtype, shape, digest in sorted(entries, key=lambda e: e[0].encode()):
        h.update(name.encode() + b"\0" + dtype.encode() + b"\0" + struct.pack("<I", len(shape)))
        h.update(b"".join(struct.pack("<Q", d) for d in shape) + digest)
    return h.hexdigest()


def read_safetensors(path):
    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    header.pop("__metadata__", None)
    return raw, 8 + n, header


def safetensors_entries(folder):
    out = []
    for f in sorted(folder.glob("*.safetensors")):
        raw, base, header = read_safetensors(f)
        for name, t in header.items():
            a, b = t["data_offsets"]
            out.append((name, ST_DTYPES[t["dtype"]], t["shape"], hashlib.sha256(raw[base + a:base + b]).digest()))
    return out


def chain_start(model_fp, tok_fp, prompt):
    return hashlib.sha256(RECEIPT_MAGIC + bytes.fromhex(model_fp) + bytes.fromhex(tok_fp) +
                          struct.pack("<Q", len(prompt)) + np.asarray(prompt, dtype="<i4").tobytes()).digest()


def chain_of(model_fp, tok_fp, prompt, rows):
    c = [chain_start(model_fp, tok_fp, prompt)]
    for row in rows:
        c.append(hashlib.sha256(c[-1] + np.ascontiguousarray(row, dtype="<f4").tobytes()).digest())
    return [x.hex() for x in c]


def rows_of(model, prompt, ids, n_ctx=256):
    """The logits each generated token was drawn from: after prompt + ids[:i], for every i."""
    ctx = kiln.Context(model, n_ctx=n_ctx, n_threads=2)
    seq = list(prompt) + list(ids[:-1])
    return ctx.decode(seq, all_logits=True)[len(prompt) - 1:]


# ---- fixtures -----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A 2-layer Llama in f32 (untied head), as transformers writes it."""
    d, _ = build_model(tmp_path_factory.mktemp("receipts"), "llama")
    return d


@pytest.fixture(scope="module")
def receipt_greedy(smollm2_gguf, build_dir, tmp_path_factory):
    path = tmp_path_factory.mktemp("rcpt") / "greedy.json"
    r = kiln_cli(build_dir, "generate", smollm2_gguf, "-p", "The capital of France is", "-n", "16", "--temp", "0",
                 "--ctx", "256", "-t", "2", "--ignore-eos", "--json", "--receipt", path)
    assert str(path) in r.stderr
    return path, json.loads(r.stdout)


def tampered(src, dst, edit):
    r = json.loads(src.read_text())
    edit(r)
    dst.write_text(json.dumps(r))
    return dst


# ---- fingerprints -------------------------------------------------------------------------------

def test_fingerprint_stable_cli_equals_api(smollm2_gguf, build_dir):
    a = kiln.Model(smollm2_gguf)
    fp = a.fingerprint()
    assert len(fp) == 64 and fp == a.fingerprint()
    assert kiln.Model(smollm2_gguf).fingerprint() == fp  # opened again
    assert kiln.Model(smollm2_gguf, f32=True, use_mmap=False).fingerprint() == fp  # the weights, not the opening
    assert kiln_cli(build_dir, "fingerprint", smollm2_gguf).stdout.strip() == fp
    assert kiln_cli(build_dir, "fingerprint", "-m", smollm2_gguf, "-t", "1").stdout.strip() == fp
    js = json.loads(kiln_cli(build_dir, "fingerprint", smollm2_gguf, "--json").stdout)
    assert js["fingerprint"] == fp and js["definition"] == "kiln-fingerprint-v1"
    assert js["tokenizer_fingerprint"] == a.tokenizer.fingerprint() == kiln.Tokenizer(smollm2_gguf).fingerprint()
    # the listing holds everything the fingerprint is made of, in its order
    names = [t["name"] for t in js["tensors"]]
    assert names == sorted(names, key=str.encode) and len(names) == len(set(names))
    assert "model.embed_tokens.weight" in names and not any(n.startswith("blk.") for n in names)
    assert {t["dtype"] for t in js["tensors"]} >= {"q4_1", "f32"}
    entries = [(t["name"], t["dtype"], t["shape"], bytes.fromhex(t["sha256"])) for t in js["tensors"]]
    assert combine(entries) == fp


@pytest.mark.parametrize("arch,dtype,shard", [("llama", "f32", False), ("qwen2", "bf16", True)])
def test_fingerprint_definition_on_safetensors(tmp_path, build_dir, arch, dtype, shard):
    """kiln's fingerprint of a Hugging Face folder = the definition computed here from its
    files; a change of one value changes it, and only that tensor's hash."""
    import torch
    d, _ = build_model(tmp_path, arch, dtype=torch.float32 if dtype == "f32" else torch.bfloat16, shard=shard)
    want = combine(safetensors_entries(d))
    assert kiln.Model(d).fingerprint() == want
    before = json.loads(kiln_cli(build_dir, "fingerprint", d, "--json").stdout)
    assert before["fingerprint"] == want
    assert {t["dtype"] for t in before["tensors"]} == {dtype}

    e = tmp_path / "edited"
    shutil.copytree(d, e)
    target = "model.layers.1.mlp.down_proj.weight"
    for f in e.glob("*.safetensors"):
        raw, base, header = read_safetensors(f)
        if target in header:
            at = base + header[target]["data_offsets"][0] + 4 * 7  # one value (bytes of element 7 or 14)
            raw = bytearray(raw)
            raw[at] ^= 0x01
            f.write_bytes(bytes(raw))
            break
    else:
        pytest.fail(f"{target} not found")
    after = json.loads(kiln_cli(build_dir, "fingerprint", e, "--json").stdout)
    assert after["fingerprint"] != want
    assert after["fingerprint"] == combine(safetensors_entries(e))
    changed = [a["name"] for a, b in zip(before["tensors"], after["tensors"]) if a["sha256"] != b["sha256"]]
    assert changed == [target]
    assert after["tokenizer_fingerprint"] == before["tokenizer_fingerprint"]


def test_fingerprint_gguf_equals_safetensors_and_trainer(tmp_path, tiny):
    """The same f32 weights in a GGUF file (Q/K rows permuted, llama.cpp's names) and in a
    safetensors folder share a fingerprint; a Q8_0 file differs from both. A trainer's
    fingerprint is its f32 export's: before a step the model's, after one neither."""
    gguf = pytest.importorskip("gguf")
    import torch
    from test_gguf_models import write_gguf
    from transformers import AutoModelForCausalLM
    ref = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32)
    sd = {k: v.to(torch.float32) for k, v in ref.state_dict().items()}
    tok_json = json.loads((tiny / "tokenizer.json").read_text())
    f32 = tmp_path / "tiny-f32.gguf"
    write_gguf(f32, "llama", ref.config, sd, gguf.GGMLQuantizationType.F32, tok_json)
    q8 = tmp_path / "tiny-q8.gguf"
    write_gguf(q8, "llama", ref.config, sd, gguf.GGMLQuantizationType.Q8_0, tok_json)
    mh, mg, mq = kiln.Model(tiny), kiln.Model(f32), kiln.Model(q8)
    assert mg.fingerprint() == mh.fingerprint()
    assert mq.fingerprint() != mh.fingerprint()
    assert mg.tokenizer.fingerprint() == mh.tokenizer.fingerprint()

    t = kiln.Trainer(mh, max_seq=16, n_threads=2)
    assert t.fingerprint() == mh.fingerprint()
    tq = kiln.Trainer(mq, max_seq=16, n_threads=2)
    assert tq.fingerprint() not in (mq.fingerprint(), mh.fingerprint())  # dequantized: other weights
    t.step(list(range(3, 15)))
    t.optimizer_step(1e-2)
    lib = kiln.load_library()
    lib.kiln_train_export_hf.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_int, ctypes.c_int]
    lib.kiln_train_export_hf.restype = ctypes.c_int
    for trainer, name in ((t, "stepped"), (tq, "dequantized")):
        out = tmp_path / name
        assert lib.kiln_train_export_hf(trainer._h, str(out).encode(), 0, 0) == 0, lib.kiln_last_error()
        assert kiln.Model(out).fingerprint() == trainer.fingerprint() == combine(safetensors_entries(out))
    assert t.fingerprint() != mh.fingerprint()


# ---- receipts -----------------------------------------------------------------------------------

def test_receipt_contents_and_chain(smollm2_gguf, receipt_greedy):
    path, out = receipt_greedy
    r = json.loads(path.read_text())
    m = kiln.Model(smollm2_gguf)
    assert r["format"] == "kiln-receipt" and r["version"] == 1 and r["kiln_version"]
    assert r["model"]["fingerprint"] == m.fingerprint()
    assert r["model"]["tokenizer_fingerprint"] == m.tokenizer.fingerprint()
    assert r["prompt"]["text"] == "The capital of France is" and r["prompt"]["chat"] is False
    assert r["prompt"]["ids"] == out["prompt_ids"] and r["output"]["ids"] == out["ids"]
    assert r["output"]["text"] == out["text"] and r["output"]["stop_reason"] == out["stop_reason"] == "length"
    s = r["settings"]
    assert (s["max_tokens"], s["temperature"], s["n_ctx"], s["ignore_eos"]) == (16, 0, 256, True)
    assert isinstance(s["seed"], str) and s["seed"].isdigit()
    assert r["arithmetic"]["mode"] == "auditable" and r["arithmetic"]["device"] == "cpu"
    assert r["arithmetic"]["verifies_across_devices"] is True
    # the chain, recomputed from the definition and logits of one forward
    rows = rows_of(m, out["prompt_ids"], out["ids"])
    assert r["logits_chain"] == chain_of(r["model"]["fingerprint"], r["model"]["tokenizer_fingerprint"],
                                         out["prompt_ids"], rows)
    # the binding's generate gives the same chain (and its struct ends where the C one does)
    assert kiln.load_library().kiln_generate_default_params().logits_chain is None
    ctx = kiln.Context(m, n_ctx=256, n_threads=1)
    g = ctx.generate(out["prompt_ids"], max_tokens=16, ignore_eos=True, logits_chain=True)
    assert g["ids"] == out["ids"] and g["logits_chain"] == r["logits_chain"]


@pytest.mark.parametrize("threads", [1, 2])
def test_verify_identical_cpu(smollm2_gguf, build_dir, receipt_greedy, threads):
    path, out = receipt_greedy
    r = kiln_cli(build_dir, "verify", path, "-m", smollm2_gguf, "-t", threads)
    assert r.stdout.startswith(f"identical: {len(out['ids'])} steps"), r.stdout
    assert f"{threads} thread" in r.stdout


def test_verify_sampled_chat_stop(smollm2_gguf, build_dir, tmp_path):
    """Sampling with a seed (temperature > 0), a chat template with a system message and a stop
    string: verified; the same receipt with another seed does not verify."""
    path = tmp_path / "sampled.json"
    kiln_cli(build_dir, "generate", smollm2_gguf, "-p", "Tell me a story about a dragon", "--chat", "--system",
             "You are a poet.", "-n", "24", "--temp", "0.9", "--top-k", "0", "--seed", "1234", "--stop", "zzz",
             "--ctx", "256", "-t", "2", "--receipt", path)
    r = json.loads(path.read_text())
    assert r["prompt"]["chat"] is True and r["prompt"]["system"] == "You are a poet."
    assert r["settings"]["seed"] == "1234" and r["settings"]["stop"] == ["zzz"] and r["settings"]["temperature"] == 0.9
    v = kiln_cli(build_dir, "verify", path, "-m", smollm2_gguf, "-t", "1")
    assert v.stdout.startswith(f"identical: {len(r['output']['ids'])} steps"), v.stdout
    other = tampered(path, tmp_path / "seed.json", lambda x: x["settings"].update(seed="1235"))
    v = kiln_cli(build_dir, "verify", other, "-m", smollm2_gguf, "-t", "2", check=False)
    assert v.returncode == 1 and "differs" in v.stdout, v.stdout + v.stderr


def test_verify_names_the_tampered_step(smollm2_gguf, build_dir, receipt_greedy, tmp_path):
    path, out = receipt_greedy
    # a logits chain entry: step k's row is logits_chain[k + 1]
    bad = tampered(path, tmp_path / "chain.json",
                   lambda r: r["logits_chain"].__setitem__(6, hashlib.sha256(b"x").hexdigest()))
    v = kiln_cli(build_dir, "verify", bad, "-m", smollm2_gguf, "-t", "2", check=False)
    assert v.returncode == 1 and v.stdout.startswith("differs at step 5 of 16"), v.stdout
    assert "logits differ" in v.stdout and "logits_chain[6]" in v.stdout
    # a generated id: the logits agree, the token does not
    want = out["ids"][9]
    bad = tampered(path, tmp_path / "id.json", lambda r: r["output"]["ids"].__setitem__(9, (want + 1) % 49152))
    v = kiln_cli(build_dir, "verify", bad, "-m", smollm2_gguf, "-t", "2", check=False)
    assert v.returncode == 1 and v.stdout.startswith("differs at step 9 of 16"), v.stdout
    assert f"receipt {(want + 1) % 49152} " in v.stdout and f"this run {want} " in v.stdout
    assert "same logits" in v.stdout
    # the prompt text no longer gives the prompt ids
    bad = tampered(path, tmp_path / "text.json", lambda r: r["prompt"].update(text="The capital of Spain is"))
    v = kiln_cli(build_dir, "verify", bad, "-m", smollm2_gguf, check=False)
    assert v.returncode == 1 and "prompt mismatch" in v.stdout, v.stdout


def test_verify_refuses_wrong_model(smollm2_gguf, build_dir, receipt_greedy, tiny):
    path, _ = receipt_greedy
    v = kiln_cli(build_dir, "verify", path, "-m", tiny, check=False)
    assert v.returncode == 1 and "fingerprint mismatch" in v.stdout and "model" in v.stdout, v.stdout + v.stderr
    assert kiln.Model(tiny).fingerprint() in v.stdout


def test_verify_refuses_bad_receipts(smollm2_gguf, build_dir, receipt_greedy, tmp_path):
    path, _ = receipt_greedy
    text = path.read_text()
    cases = {
        "truncated": (text[:len(text) // 2], "malformed JSON"),
        "not an object": ("[1, 2]", "not a JSON object"),
        "not a receipt": ('{"format": "something"}', "not a kiln receipt"),
    }
    r = json.loads(text)

    def edited(fn):
        x = json.loads(text)
        fn(x)
        return json.dumps(x)

    cases["version"] = (edited(lambda x: x.update(version=2)), "version 2 is unknown")
    cases["one digest short"] = (edited(lambda x: x["logits_chain"].pop()), "logits_chain holds 16 digests for 16")
    cases["one id short"] = (edited(lambda x: x["output"]["ids"].pop()), "logits_chain holds 17 digests for 15")
    cases["c_0"] = (edited(lambda x: x["prompt"]["ids"].__setitem__(0, r["prompt"]["ids"][0] + 1)),
                    "logits_chain[0] is not the chain's start")
    cases["fingerprint"] = (edited(lambda x: x["model"].update(fingerprint="zz")), "model.fingerprint")
    cases["seed"] = (edited(lambda x: x["settings"].update(seed=12)), "settings.seed")
    cases["temperature"] = (edited(lambda x: x["settings"].update(temperature="hot")), "settings.temperature")
    cases["id"] = (edited(lambda x: x["output"]["ids"].__setitem__(0, 1 << 40)), "output.ids[0]")
    cases["mode"] = (edited(lambda x: x["arithmetic"].update(mode="approximate")), "arithmetic.mode")
    cases["device"] = (edited(lambda x: x["arithmetic"].update(device="tpu")), "arithmetic.device")
    for label, (body, msg) in cases.items():
        p = tmp_path / "bad.json"
        p.write_text(body)
        v = kiln_cli(build_dir, "verify", p, "-m", smollm2_gguf, check=False)
        assert v.returncode == 2, (label, v.returncode, v.stdout, v.stderr)
        assert msg in v.stderr and str(p) in v.stderr, (label, v.stderr)
    v = kiln_cli(build_dir, "verify", tmp_path / "absent.json", "-m", smollm2_gguf, check=False)
    assert v.returncode == 2 and "absent.json" in v.stderr
    # usage errors
    for args in (["verify"], ["verify", path], ["verify", path, "-m", smollm2_gguf, "--device", "gpu"],
                 ["verify", path, "-m", smollm2_gguf, "--bogus"], ["fingerprint"],
                 ["generate", smollm2_gguf, "-p", "x", "--receipt"]):
        v = kiln_cli(build_dir, *args, check=False)
        assert v.returncode == 2, (args, v.stderr)
    v = kiln_cli(build_dir, "fingerprint", tmp_path / "nothing", check=False)
    assert v.returncode == 1 and "nothing" in v.stderr


def test_receipt_written_atomically(smollm2_gguf, build_dir, tmp_path):
    """The receipt appears whole under its name, nothing else is left behind; an unwritable
    place fails with exit 1 and a message naming it."""
    path = tmp_path / "r.json"
    kiln_cli(build_dir, "generate", smollm2_gguf, "-p", "Hi", "-n", "3", "--temp", "0", "--ctx", "64", "-t", "2",
             "--receipt", path)
    assert json.loads(path.read_text())["format"] == "kiln-receipt"
    assert [p.name for p in tmp_path.iterdir()] == ["r.json"]
    bad = tmp_path / "no-such-dir" / "r.json"
    v = kiln_cli(build_dir, "generate", smollm2_gguf, "-p", "Hi", "-n", "3", "--temp", "0", "--ctx", "64", "-t", "2",
                 "--receipt", bad, check=False)
    assert v.returncode == 1 and str(bad) in v.stderr


def test_fast_receipt_says_so(smollm2_gguf, build_dir, tmp_path):
    """A fast-arithmetic receipt says it is not expected to verify across devices; on the CPU
    that made it, it verifies (the CPU's fast path is deterministic)."""
    path = tmp_path / "fast.json"
    kiln_cli(build_dir, "generate", smollm2_gguf, "-p", "Hello", "-n", "6", "--temp", "0", "--fast", "--ctx", "64",
             "-t", "2", "--receipt", path)
    r = json.loads(path.read_text())
    assert r["arithmetic"]["mode"] == "fast" and r["arithmetic"]["verifies_across_devices"] is False
    assert "not expected to verify" in r["arithmetic"]["note"]
    v = kiln_cli(build_dir, "verify", path, "-m", smollm2_gguf, "-t", "1")
    assert v.stdout.startswith("identical: 6 steps") and "fast arithmetic" in v.stdout


# ---- CUDA (scripts/gpu-check.sh runs these with -k cuda) -----------------------------------------

def cuda_or_skip(model):
    try:
        kiln.Context(model, n_ctx=16, device=0).close()
    except kiln.KilnError as e:
        pytest.skip(f"no usable CUDA device: {e}")


@pytest.mark.parametrize("temp", ["0", "0.8"])
def test_receipt_cuda_both_ways(build_dir, tiny, tmp_path, temp):
    """A receipt made on the CPU verifies on the GPU, and one made on the GPU on the CPU
    (auditable arithmetic: the same bits), greedy and sampled."""
    cuda_or_skip(kiln.Model(tiny))
    common = ["-p", "And God said, let there be light", "-n", "24", "--temp", temp, "--seed", "99", "--ignore-eos",
              "--ctx", "128"]
    cpu, gpu = tmp_path / "cpu.json", tmp_path / "gpu.json"
    kiln_cli(build_dir, "generate", tiny, *common, "-t", "2", "--receipt", cpu)
    kiln_cli(build_dir, "generate", tiny, *common, "--device", "cuda", "--receipt", gpu)
    a, b = json.loads(cpu.read_text()), json.loads(gpu.read_text())
    assert b["arithmetic"]["device"] == "cuda:0"
    assert a["logits_chain"] == b["logits_chain"] and a["output"]["ids"] == b["output"]["ids"]
    v = kiln_cli(build_dir, "verify", cpu, "-m", tiny, "--device", "cuda")
    assert v.stdout.startswith("identical: 24 steps") and "cuda:0" in v.stdout, v.stdout
    v = kiln_cli(build_dir, "verify", gpu, "-m", tiny, "-t", "2")
    assert v.stdout.startswith("identical: 24 steps"), v.stdout
