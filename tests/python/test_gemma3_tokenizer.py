"""Gemma 3 tokenizer and chat template: kiln against transformers.

The oracle is transformers' own tokenizer built from the GGUF file
(`AutoTokenizer.from_pretrained(dir, gguf_file=name)`, which for general.architecture gemma3
builds a GemmaTokenizer: Replace(' ', '▁') normalizer, BPE with byte fallback over merges it
derives from the vocabulary, control tokens special, user-defined tokens added). Two sets:

  * the real Gemma 3 270M GGUF (scripts/fetch-gemma3.sh; env KILN_GEMMA3_GGUF or the cache
    path the script writes); skipped when it is not there;
  * a small GGUF written here with gguf-py, general.architecture gemma3, whose vocabulary is
    made so that the Gemma rules show (merge order by position, not score; whitespace runs as
    ordinary pieces); always runs.

The chat template: Gemma 3 270M's GGUF carries none (kiln then renders Gemma 3's rules by
architecture); the oracle is transformers' apply_chat_template with the file's own template
when it has one, else with Gemma 3's (GEMMA3_TEMPLATE of test_tokenizer.py).
"""
import json
import os
import random
import subprocess
from pathlib import Path

import pytest

from test_tokenizer import CORPUS, GEMMA3_TEMPLATE, KTok, _check_corpus, _lib

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

REPO = Path(__file__).resolve().parents[2]
BUILD = Path(os.environ.get("KILN_BUILD_DIR", REPO / "build"))
GGUF_NAME = "gemma-3-270m-q4_k_m.gguf"

EXTRA = [
    "<start_of_turn>user\nHello!<end_of_turn>\n<start_of_turn>model\n",
    "<bos>text<eos> <pad><mask><unk> <unused0> <start_of_image>[multimodal]<end_of_image>",
    "<table><tr><td>1</td></tr></table> <div>x</div> <s>strike</s> <b>b</b>",
    "a  b   c    d     e      f",
    " " * 31, " " * 32, " " * 40, " " * 59, " " * 64 + "x", "x" + " " * 100 + "y",
    "\t\t\ttabs\t \t", "\n" * 35 + "x", "\r\n\r\n", "▁ literal marks ▁▁ and spaces  ",
    ">  </tag>", "    def f(x):\n        return x  # two  spaces\n",
    "ﬁ ﬀ ① Ⅻ ＡＢＣ ｶﾀｶﾅ", "e\u0301 vs é", "\u200b\u200d\ufeff", "\x00\x01\x1f\x7f",
    "한국어 日本語 中文 العربية हिन्दी ไทย ελληνικά",
    "🙂🙃 👍🏽 👨‍👩‍👧‍👦 🇫🇷 🏳️‍🌈",
    "1234567890 3.14159 1,000,000 0x1F 1e-9",
]


def _random_texts(seed, n):
    """Strings that mix spaces, newlines, tabs, specials and scripts (a fixed seed)."""
    rng = random.Random(seed)
    pool = (list(" \n\t\r") + [" "] * 6 + list("abcxyzABZ019._-=<>/\\'\"(){}[]#*")
            + ["▁", "é", "e\u0301", "日", "語", "🙂", "👍🏽", "\u00a0", "\u3000", "ß", "ﬁ", "\x00",
               "\u200b", "ا", "ह", "ि", "<start_of_turn>", "<end_of_turn>", "<bos>", "<eos>",
               "<unused3>", "<s>", "</div>", "[multimodal]", "the", " the", "ing", "  ", "\n\n",
               "\t\t", ">  </", "    def "])
    return ["".join(rng.choice(pool) for _ in range(rng.randint(0, 60))) for _ in range(n)]


def _hf_from_gguf(path):
    """transformers' tokenizer for a GGUF, or a skip when this transformers has no Gemma
    builder for GGUF files."""
    from transformers.integrations.gguf import gguf_tokenizer_mapping as m
    if "gemma3" not in getattr(m, "GGUF_SENTENCEPIECE_BUILDERS", {}):
        pytest.skip(f"transformers {transformers.__version__} builds no Gemma 3 tokenizer from GGUF")
    from transformers import AutoTokenizer
    path = Path(path)
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


class _Info:
    """kiln_tokenizer_get_info through ctypes."""

    def __init__(self, lib, kt):
        import ctypes as C

        class Info(C.Structure):
            _fields_ = [("type", C.c_char_p), ("pre", C.c_char_p), ("n_vocab", C.c_int),
                        ("bos_id", C.c_int32), ("eos_id", C.c_int32), ("eot_id", C.c_int32),
                        ("pad_id", C.c_int32), ("unk_id", C.c_int32), ("add_bos", C.c_int),
                        ("add_eos", C.c_int), ("chat_template_name", C.c_char_p),
                        ("chat_template", C.c_char_p)]
        info = Info()
        lib.kiln_tokenizer_get_info.argtypes = [C.c_void_p, C.POINTER(Info)]
        assert lib.kiln_tokenizer_get_info(kt.h, C.byref(info)) == 0
        self.__dict__.update({f: getattr(info, f) for f, _ in Info._fields_})


def _check_encode(kt, hf, texts):
    """ids with and without special-token parsing, and with BOS, equal transformers'."""
    tk = hf.backend_tokenizer
    for text in texts:
        for ps in (True, False):
            tk.encode_special_tokens = not ps
            want = tk.encode(text, add_special_tokens=False).ids
            got = kt.encode(text, parse_special=ps)
            assert got == want, (f"parse_special={ps} {text!r}\n got {tk.decode(got)!r} {got}\n"
                                 f"want {want} {[tk.id_to_token(i) for i in want]}")
        tk.encode_special_tokens = False
        assert kt.encode(text, add_special=True, parse_special=True) == hf(text).input_ids, text


# ---------------------------------------------------------------------------------------------
# The real Gemma 3 270M GGUF


@pytest.fixture(scope="module")
def gemma3_path():
    p = os.environ.get("KILN_GEMMA3_GGUF")
    if not p:
        cache = Path(os.environ.get("KILN_CACHE", Path.home() / ".cache" / "kiln"))
        p = str(cache / "models" / GGUF_NAME)
    if not Path(p).exists():
        pytest.skip(f"Gemma 3 GGUF {p} not found (bash scripts/fetch-gemma3.sh, or set KILN_GEMMA3_GGUF)")
    return p


@pytest.fixture(scope="module")
def gemma3(gemma3_path):
    hf = _hf_from_gguf(gemma3_path)  # ~20 s: transformers derives 262k pieces' merges in Python
    lib = _lib()
    kt = KTok(lib, gemma3_path)
    yield kt, hf, lib
    kt.close()


def test_gemma3_vocabulary(gemma3, gemma3_path):
    kt, hf, lib = gemma3
    r = gguf.GGUFReader(gemma3_path)
    assert bytes(r.fields["general.architecture"].parts[-1]).decode() == "gemma3"
    info = _Info(lib, kt)
    assert info.type == b"spm" and info.n_vocab == len(hf) == 262144
    assert (info.bos_id, info.eos_id, info.pad_id, info.unk_id) == (2, 1, 0, 3)
    assert (info.add_bos, info.add_eos) == (1, 0)
    assert hf.convert_ids_to_tokens([2, 1, 105, 106]) == ["<bos>", "<eos>", "<start_of_turn>",
                                                          "<end_of_turn>"]
    # generation stops at either
    assert info.eot_id == 106


def test_gemma3_encode_decode(gemma3):
    kt, hf, _ = gemma3
    _check_encode(kt, hf, CORPUS + EXTRA)
    # decode (render special on and off) and the stream, from the oracle's ids
    _check_corpus(kt, hf.backend_tokenizer, CORPUS + EXTRA, parse_special_modes=(True,))


def test_gemma3_random_strings(gemma3):
    kt, hf, _ = gemma3
    _check_encode(kt, hf, _random_texts(1234, 600))


def test_gemma3_whitespace_runs(gemma3):
    kt, hf, _ = gemma3
    # runs of 2..31 spaces are single pieces ▁▁..; longer runs split as transformers merges
    # them (59 spaces: 16 + 16 + 27), not by longest match (31 + 28, llama.cpp)
    assert kt.encode(" " * 59) == [152, 152, 163]
    assert [kt.encode(" " * n) for n in (2, 31)] == [[138], [167]]
    texts = [" " * n for n in range(1, 70)] + [f"a{' ' * n}b" for n in range(1, 70)]
    texts += ["\n" * n for n in range(1, 40)] + ["\t" * n for n in range(1, 40)]
    _check_encode(kt, hf, texts)
    for n in (2, 31, 59):
        ids = kt.encode(" " * n)
        assert kt.decode(ids) == b" " * n


def test_gemma3_special_tokens(gemma3):
    kt, hf, _ = gemma3
    for tok in ["<bos>", "<eos>", "<pad>", "<mask>", "<start_of_turn>", "<end_of_turn>",
                "<start_of_image>", "[multimodal]", "</div>", "\n\n"]:
        i = hf.convert_tokens_to_ids(tok)
        assert kt.encode(tok, parse_special=True) == [i], tok
    # control tokens are text without parse_special; user-defined ones always match
    assert len(kt.encode("<start_of_turn>", parse_special=False)) > 1
    assert kt.encode("<start_of_image>", parse_special=False) == [255999]
    # decode skips control tokens unless asked to render them
    ids = kt.encode("<start_of_turn>user\nhi<end_of_turn>", parse_special=True)
    assert kt.decode(ids) == b"user\nhi"
    assert kt.decode(ids, render_special=True) == b"<start_of_turn>user\nhi<end_of_turn>"


def test_gemma3_cli_tokenize(gemma3, gemma3_path):
    kt, hf, _ = gemma3
    text = "<start_of_turn>user\nWho  are you?<end_of_turn>\n"
    out = subprocess.run([str(BUILD / "kiln"), "tokenize", "-m", gemma3_path, "-p", text, "--json"],
                         capture_output=True, text=True, check=True).stdout
    got = json.loads(out)
    assert got["ids"] == hf(text).input_ids
    assert got["pieces"] == hf.convert_ids_to_tokens(got["ids"])


CONVS = [
    [{"role": "user", "content": "  Hi!\n"}],
    [{"role": "system", "content": " Be brief. \n"}, {"role": "user", "content": "2+2?"},
     {"role": "assistant", "content": " 4 "}, {"role": "user", "content": "more  \n"}],
    [{"role": "user", "content": "日本語 🎉"}, {"role": "assistant", "content": "ok"}],
    [{"role": "system", "content": "system alone"}],
]


def test_gemma3_chat_template(gemma3, gemma3_path):
    kt, hf, lib = gemma3
    tmpl = hf.chat_template or GEMMA3_TEMPLATE  # the file's own when it has one
    info = _Info(lib, kt)
    assert info.chat_template_name == b"gemma"
    if not hf.chat_template:
        assert info.chat_template is None  # rendered by architecture, no text to show
    for msgs in CONVS:
        for gen in (True, False):
            want = hf.apply_chat_template(msgs, chat_template=tmpl, tokenize=False,
                                          add_generation_prompt=gen)
            st, got = kt.chat(msgs, gen)
            assert st == 0 and got == want, (msgs, gen, got, want)
            # the prompt as `kiln chat` tokenizes it (no added BOS: the text holds <bos>)
            ids = hf.apply_chat_template(msgs, chat_template=tmpl, tokenize=True,
                                         add_generation_prompt=gen)
            ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
            assert kt.encode(got, add_special=False, parse_special=True) == list(ids)
    bad = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    with pytest.raises(Exception, match="alternate"):
        hf.apply_chat_template(bad, chat_template=tmpl, tokenize=False)
    st, msg = kt.chat(bad)
    assert st == 1 and "alternate" in msg


# ---------------------------------------------------------------------------------------------
# A small GGUF with Gemma's rules in it (no download)


def _write_tiny_gemma_gguf(path):
    """A vocabulary laid out like Gemma 3's (control tokens, user-defined newline and
    whitespace runs with score -1000, byte tokens, then pieces by decreasing score) but where
    the scores of some normal pieces do not follow their order: 'bc' comes after 'ab' in the
    file yet scores higher, so score order and file order merge 'abc' differently."""
    tokens = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_turn>", "<end_of_turn>"]
    types = [3] * len(tokens)
    tokens += ["\n", "\n\n"] + [" " * n for n in range(2, 6)]
    types += [4] * 6
    tokens += [f"<0x{b:02X}>" for b in range(256)]
    types += [6] * 256
    normal = ["ab", "bc", "▁a", "▁▁a", "hello", "▁world", "wor", "ld", "▁w", "or", "he", "llo",
              "ll", "el", "lo", "▁", "a", "b", "c", "d", "e", "h", "l", "o", "r", "w", "x", "y"]
    tokens += normal
    types += [1] * len(normal)
    scores = [-1000.0] * (len(tokens) - len(normal)) + [-float(i) for i in range(len(normal))]
    scores[tokens.index("bc")] = 5.0  # out of order: a score-ranked merge prefers 'bc'
    w = gguf.GGUFWriter(str(path), "gemma3")
    w.add_context_length(128)
    w.add_embedding_length(8)
    w.add_block_count(1)
    w.add_feed_forward_length(16)
    w.add_head_count(1)
    w.add_head_count_kv(1)
    w.add_key_length(8)
    w.add_value_length(8)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(10000.0)
    w.add_sliding_window(4)
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(2)
    w.add_eos_token_id(1)
    w.add_unk_token_id(3)
    w.add_pad_token_id(0)
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)
    w.add_add_space_prefix(False)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def tiny_gemma(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_gemma") / "tiny-gemma3.gguf"
    _write_tiny_gemma_gguf(path)
    hf = _hf_from_gguf(path)
    lib = _lib()
    kt = KTok(lib, path)
    yield kt, hf, lib
    kt.close()


def test_tiny_gemma_rules(tiny_gemma):
    kt, hf, lib = tiny_gemma
    tk = hf.backend_tokenizer
    # merge order is the file's order: 'ab' before 'bc' although 'bc' scores higher
    assert tk.id_to_token(kt.encode("abc")[0]) == "ab"
    # 7 spaces: pieces of the runs ▁▁..▁▁▁▁▁, merged, not matched longest-first (5 + 2)
    assert [tk.id_to_token(i) for i in kt.encode(" " * 7)] == ["▁▁▁▁", "▁▁▁"]
    texts = ["abc", "abcabc", "cab", "a  a", " " * 7, " " * 12 + "a", "hello world", "  world",
             "he\nllo\n\n\nworld", "<start_of_turn>x<end_of_turn>", "é z 🙂", "xyz  \n  "]
    _check_encode(kt, hf, texts + _random_texts(99, 300))
    _check_corpus(kt, tk, texts, parse_special_modes=(True,))
    # no template in the file: Gemma 3's rules by architecture
    msgs = CONVS[1]
    want = hf.apply_chat_template(msgs, chat_template=GEMMA3_TEMPLATE, tokenize=False,
                                  add_generation_prompt=True)
    assert kt.chat(msgs, True) == (0, want)
