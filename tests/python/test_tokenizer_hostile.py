"""Hostile tokenizer.json / tokenizer_config.json files (issue 34): kiln refuses what Hugging
Face `tokenizers` refuses, with the field named, and where `tokenizers` accepts a strange file
kiln encodes it the same way.

Each case starts from one small valid byte-level BPE tokenizer.json (BASE), changes one thing,
asks `tokenizers` (Tokenizer.from_str / from_file) and then kiln (the CLI, `kiln tokenize`).
"""
import copy
import json
import subprocess

import pytest

tokenizers = pytest.importorskip("tokenizers")
from tokenizers import Tokenizer  # noqa: E402


def _added(i, content, special=True):
    return {"id": i, "content": content, "single_word": False, "lstrip": False, "rstrip": False,
            "normalized": False, "special": special}


BASE = {
    "version": "1.0", "truncation": None, "padding": None,
    "added_tokens": [_added(7, "<s>")],
    "normalizer": None,
    "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                      "use_regex": True},
    "post_processor": None,
    "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True,
                "use_regex": True},
    "model": {"type": "BPE", "dropout": None, "unk_token": None,
              "continuing_subword_prefix": None, "end_of_word_suffix": None, "fuse_unk": False,
              "byte_fallback": False, "ignore_merges": False,
              "vocab": {"H": 0, "e": 1, "l": 2, "o": 3, "He": 4, "ll": 5, "Hell": 6},
              "merges": ["H e", "l l", "He ll"]},
}

TEXT = "Hello world"


def doc(change=None):
    d = copy.deepcopy(BASE)
    if change:
        change(d)
    return d


def write(tmp_path, text, config=None):
    folder = tmp_path / "tok"
    folder.mkdir(exist_ok=True)
    data = text if isinstance(text, bytes) else text.encode()
    (folder / "tokenizer.json").write_bytes(data)
    if config is not None:
        (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def kiln(build_dir, folder, prompt=TEXT):
    return subprocess.run([str(build_dir / "kiln"), "tokenize", "-m", str(folder), "-p", prompt,
                           "--json"], capture_output=True, text=True, timeout=60)


def hf_refuses(text):
    with pytest.raises(Exception):
        if isinstance(text, bytes):
            Tokenizer.from_str(text.decode("utf-8"))  # bytes that are not UTF-8 raise here too
        else:
            Tokenizer.from_str(text)


def kiln_refuses(build_dir, tmp_path, text, *needles, config=None):
    r = kiln(build_dir, write(tmp_path, text, config))
    assert r.returncode != 0, r.stdout
    for n in needles:
        assert n in r.stderr, r.stderr
    return r.stderr


def kiln_ids(build_dir, tmp_path, text, prompt=TEXT, config=None):
    r = kiln(build_dir, write(tmp_path, text, config), prompt)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)["ids"]


def test_base_loads_and_matches(build_dir, tmp_path):
    text = json.dumps(BASE)
    hf = Tokenizer.from_str(text)
    for s in (TEXT, "Hello<s>Hell", "oHello"):
        assert kiln_ids(build_dir, tmp_path, text, s) == hf.encode(s).ids


# ---- refused by tokenizers, refused by kiln --------------------------------------------------

def test_fractional_and_negative_vocab_id(build_dir, tmp_path):
    # serde_json wants a u32: 3.5, 3.0, 3e0 and -3 are all refused
    for lit in ("3.5", "3.0", "3e0", "-3"):
        text = json.dumps(BASE).replace('"o": 3', '"o": ' + lit)
        hf_refuses(text)
        kiln_refuses(build_dir, tmp_path, text, 'model.vocab["o"]', "integer")


def test_fractional_added_token_id(build_dir, tmp_path):
    text = json.dumps(BASE).replace('"id": 7', '"id": 7.5')
    hf_refuses(text)
    kiln_refuses(build_dir, tmp_path, text, "added_tokens[0].id", "integer")


@pytest.mark.parametrize("merge,absent", [("x y", "x"), ("H x", "x"), ("e l", "el")])
def test_merge_naming_absent_token(build_dir, tmp_path, merge, absent):
    text = json.dumps(doc(lambda d: d["model"]["merges"].append(merge)))
    hf_refuses(text)
    kiln_refuses(build_dir, tmp_path, text, "model.merges[3]", f'"{absent}"', "not in model.vocab")


def test_merge_naming_added_token(build_dir, tmp_path):
    # an added token is not in the model's vocabulary: tokenizers refuses a merge naming it
    text = json.dumps(doc(lambda d: d["model"]["merges"].append("<s> H")))
    hf_refuses(text)
    kiln_refuses(build_dir, tmp_path, text, "model.merges[3]", "<s>")


@pytest.mark.parametrize("merge", ["H e l", "He", "H  e", " H e", "H e "])
def test_merge_string_not_two_parts(build_dir, tmp_path, merge):
    text = json.dumps(doc(lambda d: d["model"]["merges"].__setitem__(0, merge)))
    hf_refuses(text)
    kiln_refuses(build_dir, tmp_path, text, "model.merges[0]", "one space")


@pytest.mark.parametrize("pair", [["H", "e", "l"], ["H"], [], ["H", 5]])
def test_merge_list_wrong_count(build_dir, tmp_path, pair):
    text = json.dumps(doc(lambda d: d["model"].__setitem__("merges", [pair, ["l", "l"]])))
    hf_refuses(text)
    kiln_refuses(build_dir, tmp_path, text, "model.merges[0]")


def test_merges_strings_and_lists_mixed(build_dir, tmp_path):
    text = json.dumps(doc(lambda d: d["model"]["merges"].append(["H", "o"])))
    hf_refuses(text)
    kiln_refuses(build_dir, tmp_path, text, "model.merges[3]", "mixed")


def test_merges_missing(build_dir, tmp_path):
    text = json.dumps(doc(lambda d: d["model"].pop("merges")))
    hf_refuses(text)
    kiln_refuses(build_dir, tmp_path, text, "model.merges")


@pytest.mark.parametrize("value", [5, None, True, ["BPE"]])
def test_model_type_not_a_string(build_dir, tmp_path, value):
    text = json.dumps(doc(lambda d: d["model"].__setitem__("type", value)))
    hf_refuses(text)
    kiln_refuses(build_dir, tmp_path, text, "model.type", "not a string")


def test_raw_invalid_utf8(build_dir, tmp_path):
    # a raw 0xff byte inside a vocabulary key: the file is not UTF-8
    data = json.dumps(BASE).replace('"e": 1', '"e": 1, "qX": 8').encode().replace(b"qX", b"q\xff")
    with pytest.raises(Exception):
        Tokenizer.from_file(str(write(tmp_path, data) / "tokenizer.json"))
    kiln_refuses(build_dir, tmp_path, data, "invalid UTF-8", "model.vocab")


def test_raw_control_character_in_string(build_dir, tmp_path):
    data = json.dumps(BASE).replace('"e": 1', '"e": 1, "qX": 8').encode().replace(b"qX", b"q\t")
    with pytest.raises(Exception):
        Tokenizer.from_file(str(write(tmp_path, data) / "tokenizer.json"))
    kiln_refuses(build_dir, tmp_path, data, "control character", "model.vocab")


@pytest.mark.parametrize("field", ["special", "lstrip", "rstrip", "single_word", "normalized"])
@pytest.mark.parametrize("value", ["yes", None, 1])
def test_added_token_flag_not_boolean(build_dir, tmp_path, field, value):
    text = json.dumps(doc(lambda d: d["added_tokens"][0].__setitem__(field, value)))
    hf_refuses(text)
    kiln_refuses(build_dir, tmp_path, text, f"added_tokens[0].{field}", "not a boolean")


def test_added_token_content_not_string(build_dir, tmp_path):
    text = json.dumps(doc(lambda d: d["added_tokens"][0].__setitem__("content", 5)))
    hf_refuses(text)
    kiln_refuses(build_dir, tmp_path, text, "added_tokens[0].content")


@pytest.mark.parametrize("part,field", [("model", "byte_fallback"), ("pre_tokenizer", "add_prefix_space"),
                                        ("pre_tokenizer", "use_regex"), ("decoder", "trim_offsets")])
def test_other_flags_not_boolean(build_dir, tmp_path, part, field):
    text = json.dumps(doc(lambda d: d[part].__setitem__(field, "yes")))
    hf_refuses(text)
    kiln_refuses(build_dir, tmp_path, text, f"{part}.{field}", "not a boolean")


# ---- accepted by tokenizers: kiln encodes the same ids ---------------------------------------

def test_empty_vocabulary(build_dir, tmp_path):
    """tokenizers loads an empty model.vocab (with or without added tokens) and encodes every
    text to []: kiln does the same (it refused the first and kept the second)."""
    for keep_added in (False, True):
        d = doc(lambda d: (d["model"].__setitem__("vocab", {}), d["model"].__setitem__("merges", [])))
        if not keep_added:
            d["added_tokens"] = []
        text = json.dumps(d)
        hf = Tokenizer.from_str(text)
        for s in (TEXT, "<s>x"):
            assert kiln_ids(build_dir, tmp_path, text, s) == hf.encode(s).ids


def _same(build_dir, tmp_path, d, texts):
    text = json.dumps(d)
    hf = Tokenizer.from_str(text)
    for s in texts:
        assert kiln_ids(build_dir, tmp_path, text, s) == hf.encode(s).ids, s


def test_two_vocab_strings_share_an_id(build_dir, tmp_path):
    """tokenizers accepts it: both strings encode to the id (kiln dropped one of them)."""
    d = doc(lambda d: d["model"]["vocab"].__setitem__("x", 3))
    _same(build_dir, tmp_path, d, ["o", "x", "ox", TEXT, "<s>", "Hellx"])


def test_many_vocab_strings_share_one_id(build_dir, tmp_path):
    """Shared ids put the added tokens' ids (counted from the number of vocab strings) past
    the largest vocab id."""
    d = doc(lambda d: d["model"].update(vocab={c: 0 for c in "abcdefghijklmnop"}, merges=[]))
    _same(build_dir, tmp_path, d, ["abc", "<s>", "a<s>p"])


@pytest.mark.parametrize("added", [
    [_added(3, "<s>")],                                   # collides with vocab "o"
    [_added(6, "<a>"), _added(9, "<b>"), _added(2, "<c>")],  # ids out of order, one collides
    [_added(3, "o", False), _added(8, "<b>")],            # content in vocab
    [_added(7, "<s>"), _added(7, "<t>")],                 # two added tokens, one id
    [_added(7, "<s>"), _added(8, "<s>")],                 # one content twice
])
def test_added_token_ids_as_tokenizers_assigns_them(build_dir, tmp_path, added):
    """tokenizers does not use the ids written in added_tokens: a token gets its id in
    model.vocab, else the next free id (AddedVocabulary::add_tokens). kiln does the same."""
    d = doc(lambda d: d.__setitem__("added_tokens", added))
    _same(build_dir, tmp_path, d, ["o", "<s>", "<a><b><c>", "<t><s>", "Hello<b>o", TEXT])


def test_nul_in_vocabulary_token(build_dir, tmp_path):
    """tokenizers accepts "\\u0000" inside a token (a Rust String may hold NUL) and encodes
    it; kiln keeps the NUL too (cJSON would have cut the string at it)."""
    def change(d):
        d["pre_tokenizer"] = None
        d["decoder"] = None
        d["model"]["vocab"].update({"\u0000": 7, "o\u0000": 8, "a\u0000b": 9, "a": 10, "b": 11})
        d["model"]["merges"] = [m.split(" ") for m in d["model"]["merges"]] + [
            ["o", "\u0000"], ["a", "\u0000"], ["a\u0000", "b"]]
        d["model"]["vocab"]["a\u0000"] = 12
        d["added_tokens"] = [_added(13, "<\u0000>")]
    import kiln as kiln_py  # the CLI's argv cannot carry a NUL: the ctypes binding can
    d = doc(change)
    text = json.dumps(d)
    hf = Tokenizer.from_str(text)
    kt = kiln_py.Tokenizer(write(tmp_path, text))
    for s in ["Hello\u0000", "a\u0000b", "o\u0000o", "x<\u0000>y", "a\u0000"]:
        assert kt.encode(s, add_special=False) == hf.encode(s).ids, s
    assert kt.encode("<\u0000>", add_special=False) == [13]


@pytest.mark.parametrize("part,value", [
    ("normalizer", {"type": "Prepend", "prepend": "\u0000x"}),
    ("normalizer", {"type": "Replace", "pattern": {"String": "a\u0000"}, "content": "b"}),
    ("pre_tokenizer", {"type": "Split", "pattern": {"Regex": "a\u0000b"}, "behavior": "Isolated",
                       "invert": False}),
    ("decoder", {"type": "Replace", "pattern": {"String": "a\u0000"}, "content": "b"}),
])
def test_nul_in_pipeline_string(build_dir, tmp_path, part, value):
    """tokenizers accepts a NUL in a normalizer / pre-tokenizer / decoder string; kiln keeps
    those as C strings and refuses them by name rather than cut them at the NUL (a deviation
    from tokenizers, on purpose: never a silently different tokenization)."""
    text = json.dumps(doc(lambda d: d.__setitem__(part, value)))
    Tokenizer.from_str(text)  # accepted there
    kiln_refuses(build_dir, tmp_path, text, part, "NUL")


# ---- tokenizer_config.json ---------------------------------------------------------------------

def test_config_add_bos_token_not_boolean(build_dir, tmp_path):
    kiln_refuses(build_dir, tmp_path, json.dumps(BASE), "tokenizer_config.json", "add_bos_token",
                 "not a boolean", config={"bos_token": "<s>", "add_bos_token": "yes"})


def test_config_add_bos_token_without_bos(build_dir, tmp_path):
    kiln_refuses(build_dir, tmp_path, json.dumps(BASE), "tokenizer_config.json", "add_bos_token",
                 "<t>", config={"bos_token": "<t>", "add_bos_token": True})
    kiln_refuses(build_dir, tmp_path, json.dumps(BASE), "add_bos_token", "no bos_token",
                 config={"add_bos_token": True})
    kiln_refuses(build_dir, tmp_path, json.dumps(BASE), "add_eos_token", "eos_token",
                 config={"add_eos_token": True})


def test_config_add_bos_token_valid(build_dir, tmp_path):
    ids = kiln_ids(build_dir, tmp_path, json.dumps(BASE), config={"bos_token": "<s>",
                                                                  "add_bos_token": True})
    hf = Tokenizer.from_str(json.dumps(BASE))
    r = kiln(build_dir, tmp_path / "tok")
    assert r.returncode == 0
    assert ids[-len(hf.encode(TEXT).ids):] == hf.encode(TEXT).ids


def test_config_invalid_utf8(build_dir, tmp_path):
    folder = write(tmp_path, json.dumps(BASE))
    (folder / "tokenizer_config.json").write_bytes(b'{"bos_token": "<\xff>"}')
    r = kiln(build_dir, folder)
    assert r.returncode != 0 and "tokenizer_config.json" in r.stderr and "UTF-8" in r.stderr
