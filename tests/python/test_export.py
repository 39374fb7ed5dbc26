"""kiln_train_export_hf: a trained model as a Hugging Face folder that transformers and kiln load.

Tiny random models of each architecture (built by test_parity.build_model as HF folders) and the
default model's GGUF (SmolLM2-135M, whose tokenizer.json is written from the GGUF vocabulary)
go through a kiln.Trainer; after one optimizer step the weights differ from the source, and the
exported folder must give:
  (0) model.safetensors == the trainer's parameters, bit for bit (f32) or rounded to nearest
      even (bf16);
  (a) transformers' logits in float64 == kiln.Model(folder)'s logits within 1e-4 relative
      (kiln computes in f32), and they differ from the source model's;
  (b) kiln.Model(folder) loads (config round trip) and generates the greedy tokens transformers
      generates;
  (c) AutoTokenizer.from_pretrained(folder) encodes a varied corpus to kiln's ids;
  (d) exporting onto an existing folder is refused without overwrite, and replaces it with.
"""
import ctypes as C
import json

import numpy as np
import pytest
import torch

import kiln
from test_parity import build_model

torch.set_num_threads(2)

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "def main():\n    print('hello world')\n    return 0\n",
    "In the beginning was the Word, and the Word was with God.",
    "1234567890 numbers 3.14159 and 2718281828, 1,000,000",
    "Über café naïve résumé – 東京 北京 emoji 🙂🚀 family 👨‍👩‍👧",
    "lots of     spaces\t\ttabs\n\n\nnewlines   \n  ",
    "I'm sure you've seen it; they'll say we'd done it. DON'T",
    "<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|>text after a special token",
    "",
]


def export(trainer, path, bf16=False, overwrite=False):
    f = trainer._lib.kiln_train_export_hf
    f.argtypes = [C.c_void_p, C.c_char_p, C.c_int, C.c_int]
    f.restype = C.c_int
    kiln._check(f(trainer._h, str(path).encode(), int(bf16), int(overwrite)))


def train_one_step(model, text, lr=1e-2):
    tr = kiln.Trainer(model, max_seq=32, n_threads=2, lr=lr, weight_decay=0.0)
    ids = model.tokenizer.encode(text)[:32]
    tr.step(ids)
    tr.optimizer_step(lr)
    return tr


def bf16_round(a):
    """f32 -> bf16 bits, round to nearest even (kiln_fp32_to_bf16), widened back to f32."""
    u = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32).astype(np.uint64)
    u = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) << 16
    return u.astype(np.uint32).view(np.float32)


def check_weights(tr, out, bf16):
    from safetensors.torch import load_file
    sd = load_file(str(out / "model.safetensors"))
    names = [n for n, _, _ in tr.params()]
    assert sorted(sd) == sorted(names)
    for name, n, shape in tr.params():
        want = tr.get_param(name, n)
        got = sd[name]
        assert got.numel() == n
        vector = "norm" in name or name.endswith((".bias", ".A_log", ".dt_bias"))
        assert got.dim() == (3 if name.endswith("conv1d.weight") else 1 if vector else 2), name
        if bf16:
            assert got.dtype == torch.bfloat16
            got = got.float()
            want = bf16_round(want)
        else:
            assert got.dtype == torch.float32
        got = got.numpy().ravel()
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), name


def check_tokenizer(km, out, texts, src=None):
    """kiln's ids == HF's on the exported folder: the raw tokenizer.json through `tokenizers`,
    and AutoTokenizer. transformers 5 rebuilds the pre-tokenizer of some model types' own
    tokenizer classes (Qwen2Tokenizer ignores tokenizer.json's), so with a source folder
    AutoTokenizer is held to what it gives on the source instead."""
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer
    raw = Tokenizer.from_file(str(out / "tokenizer.json"))
    hf = AutoTokenizer.from_pretrained(str(out))
    hf_src = AutoTokenizer.from_pretrained(str(src)) if src is not None else None
    n = 0
    for text in texts:
        for add in (False, True):
            got = km.tokenizer.encode(text, add_special=add)
            want = raw.encode(text, add_special_tokens=add).ids
            assert got == want, f"tokenizers add_special={add} text={text!r}\n got {got}\nwant {want}"
            auto = hf.encode(text, add_special_tokens=add)
            if hf_src is None:
                assert got == auto, f"AutoTokenizer add_special={add} text={text!r}\n got {got}\nwant {auto}"
            else:
                assert auto == hf_src.encode(text, add_special_tokens=add), text
            n += 1
        ids = km.tokenizer.encode(text, add_special=False)
        assert km.tokenizer.decode(ids) == hf.decode(ids, skip_special_tokens=True)
    return n


def hf_logits(ref, ids):
    with torch.no_grad():
        return ref(torch.tensor([ids])).logits[0].numpy()


def rel_err(got, want):
    return float(np.abs(got.astype(np.float64) - want).max() / max(1.0, float(np.abs(want).max())))


def check_refusal(tr, out):
    before = sorted(p.name for p in out.iterdir())
    with pytest.raises(kiln.KilnError, match="already exists"):
        export(tr, out)
    assert sorted(p.name for p in out.iterdir()) == before
    (out / "stale.txt").write_text("old export")
    export(tr, out, overwrite=True)
    assert not (out / "stale.txt").exists()
    assert sorted(p.name for p in out.iterdir()) == before
    # nothing temporary left beside it
    assert [p.name for p in out.parent.iterdir() if p.name.startswith(out.name + ".")] == []


@pytest.mark.parametrize("name", ["llama", "qwen2", "qwen3", "mistral"])
def test_export_tiny(tmp_path, build_dir, name):
    from transformers import AutoModelForCausalLM
    src, ref0 = build_model(tmp_path, name)
    m = kiln.Model(src)
    tr = train_one_step(m, TEXTS[0] + TEXTS[1])
    out = tmp_path / "exported"
    export(tr, out)
    assert sorted(p.name for p in out.iterdir()) == sorted([
        "config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
        "tokenizer_config.json"])
    check_weights(tr, out, bf16=False)

    # the config reads back to the same model description
    km = kiln.Model(out)
    for k in ("architecture", "n_layer", "n_embd", "n_head", "n_head_kv", "head_dim", "n_ff",
              "n_vocab", "n_ctx_train", "rms_norm_eps", "rope_theta", "tied_embeddings",
              "attn_bias", "qk_norm", "n_params"):
        assert km.info[k] == m.info[k], k

    # (a) transformers float64 vs kiln on the exported weights
    ref = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float64).eval()
    ids = km.tokenizer.encode(TEXTS[2] + TEXTS[4])[:48]
    ctx = kiln.Context(km, n_ctx=128, n_threads=2)
    got = ctx.decode(ids, all_logits=True)
    want = hf_logits(ref, ids)
    rel = rel_err(got, want)
    moved = rel_err(hf_logits(ref0, ids), want)
    print(f"{name}: exported logits vs transformers rel {rel:.2e}; moved from source by {moved:.2e}")
    assert rel <= 1e-4
    assert moved > 1e-4  # the optimizer step is in the export

    # (b) generation: kiln's greedy tokens == transformers' greedy tokens
    ctx.truncate(0)
    gen = ctx.generate(ids[:8], max_tokens=8, temperature=0.0, ignore_eos=True)
    with torch.no_grad():
        hf_gen = ref.generate(torch.tensor([ids[:8]]), max_new_tokens=8, do_sample=False,
                              eos_token_id=None, pad_token_id=0)[0, 8:].tolist()
    assert list(gen["ids"]) == hf_gen

    # (c) tokenizer (copied from the source folder)
    check_tokenizer(km, out, TEXTS, src=src)
    km.close()

    # (d)
    check_refusal(tr, out)
    tr.close()


def test_export_smollm2_gguf(tmp_path, build_dir, smollm2_gguf):
    """The default model: a GGUF source, so tokenizer.json / tokenizer_config.json are written
    from the GGUF vocabulary; bf16 weights (the f32 export would be ~540 MB)."""
    from transformers import AutoModelForCausalLM
    m = kiln.Model(smollm2_gguf)
    tr = kiln.Trainer(m, max_seq=32, n_threads=2)
    out = tmp_path / "smollm2-hf"
    export(tr, out, bf16=True)
    check_weights(tr, out, bf16=True)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == "llama" and cfg["dtype"] == "bfloat16" and cfg["tie_word_embeddings"]
    tcfg = json.loads((out / "tokenizer_config.json").read_text())
    assert tcfg["eos_token"] == m.tokenizer.piece(cfg["eos_token_id"] if isinstance(cfg["eos_token_id"], int)
                                                 else cfg["eos_token_id"][0])
    assert "im_start" in tcfg["chat_template"]

    # (c) the written tokenizer.json in HF tokenizers == kiln's GGUF tokenizer
    n = check_tokenizer(m, out, TEXTS + ["SmolLM2 is a family of compact language models " * 4])
    print(f"smollm2: {n} encodings identical")

    # (a) + (b): kiln on the exported folder vs transformers
    km = kiln.Model(out)
    ref = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float64).eval()
    ids = km.tokenizer.encode("The capital of France is Paris, and the capital of Italy is")
    ctx = kiln.Context(km, n_ctx=64, n_threads=2)
    got = ctx.decode(ids, all_logits=True)
    want = hf_logits(ref, ids)
    rel = rel_err(got, want)
    print(f"smollm2 bf16 export: logits vs transformers float64 rel {rel:.2e}")
    assert rel <= 1e-4
    ctx.truncate(0)
    gen = ctx.generate(ids, max_tokens=6, temperature=0.0, ignore_eos=True)
    with torch.no_grad():
        hf_gen = ref.generate(torch.tensor([ids]), max_new_tokens=6, do_sample=False,
                              eos_token_id=None, pad_token_id=0)[0, len(ids):].tolist()
    assert list(gen["ids"]) == hf_gen
    km.close()
    del ref

    # (d) on the large folder too, then clean up
    with pytest.raises(kiln.KilnError, match="already exists"):
        export(tr, out, bf16=True)
    tr.close()
    import shutil
    shutil.rmtree(out)


def test_pre_tokenizer_round_trip(tmp_path, build_dir):
    """A tokenizer.json whose pre-tokenizer kiln has no name for (a Split with a literal and the
    Removed behavior, a regex Split merged with the previous piece, Digits in runs, ByteLevel's
    regex) is written back with the same steps: a model trained from scratch on it exports, and
    the exported tokenizer.json gives `tokenizers`' ids; an export of that export is the same
    file (the folder made by one run is the tokenizer of the next)."""
    import subprocess
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from test_parity import CORPUS
    src = tmp_path / "tok"
    src.mkdir()
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split("--", behavior="removed"),
        pre_tokenizers.Split(Regex(r"[!?]+"), behavior="merged_with_previous"),
        pre_tokenizers.Digits(individual_digits=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS * 4, trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>"],
                                                            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                            show_progress=False))
    tok.save(str(src / "tokenizer.json"))
    (src / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>", "add_bos_token": False}))
    text = tmp_path / "t.txt"
    text.write_text("\n\n".join(CORPUS))
    kiln_bin = str(build_dir / "kiln")
    subprocess.run([kiln_bin, "data", "-m", str(src), "-o", str(tmp_path / "d.tok"), str(text)], check=True,
                   capture_output=True)
    outs = []
    for i, tk in enumerate([src, tmp_path / "run0" / "model"]):
        r = subprocess.run([kiln_bin, "train", "--config", "tiny", "--tokenizer", str(tk), "--data",
                            str(tmp_path / "d.tok"), "--steps", "1", "--batch", "1", "--seq", "16", "--eval-every", "0",
                            "--save-every", "0", "--eval-fraction", "0", "--threads", "1", "--out", str(tmp_path / f"run{i}")],
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr[-2000:]
        outs.append(tmp_path / f"run{i}" / "model" / "tokenizer.json")
    want = json.loads((src / "tokenizer.json").read_text())["pre_tokenizer"]
    got = json.loads(outs[0].read_text())["pre_tokenizer"]
    assert [p["type"] for p in got["pretokenizers"]] == [p["type"] for p in want["pretokenizers"]], got
    assert outs[0].read_text() == outs[1].read_text()
    raw_src, raw_out = Tokenizer.from_file(str(src / "tokenizer.json")), Tokenizer.from_file(str(outs[0]))
    for t in ["a--b c!!! d?! 12345 x", "the 2024-12-05 release -- costs 1000!?"] + CORPUS[:3]:
        assert raw_out.encode(t).ids == raw_src.encode(t).ids, t
