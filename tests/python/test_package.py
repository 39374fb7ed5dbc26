"""The pip package (python/pyproject.toml) and the Pythonic API (Model.generate, stream, chat).

Properties checked:
  * a wheel built by `pip wheel ./python` carries libkiln.so inside the kiln package; installed
    into a fresh venv, `import kiln` from a folder outside the checkout, with no KILN_BUILD_DIR,
    loads that library and generates the same greedy text as the in-tree binding;
  * the README's Python example runs against the installed wheel;
  * Model.generate gives Context.generate's text for the same ids; Model.stream's pieces
    concatenate to Model.generate's text (greedy, sampled with a seed, with stop strings), and
    leaving a stream early leaves the model usable;
  * Model.chat prompts through the chat template (transformers' apply_chat_template string)
    and equals Context.generate on that prompt's ids;
  * info's string fields are str; Model, Context and Trainer are context managers.

The model is the tiny random Qwen3.5 of scripts/make_tiny_qwen35.py (ChatML template). The
wheel tests build libkiln once per module (about half a minute on two cores) and are skipped
when PyPI cannot be reached for the pinned scikit-build-core (or numpy for the venv).
"""
import ctypes
import os
import re
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

import kiln

REPO = Path(__file__).resolve().parents[2]
PROMPT = "The quick brown fox"
N_TOKENS = 24

OFFLINE_HINTS = ("Could not find a version", "No matching distribution", "Failed to establish",
                 "Temporary failure in name resolution", "Network is unreachable",
                 "Max retries exceeded", "ConnectionError", "ReadTimeoutError")


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    pytest.importorskip("transformers")
    d = tmp_path_factory.mktemp("tiny_qwen35")
    subprocess.run([sys.executable, str(REPO / "scripts" / "make_tiny_qwen35.py"), str(d)],
                   check=True, capture_output=True)
    return d


@pytest.fixture(scope="module")
def model(build_dir, tiny_model):
    m = kiln.Model(tiny_model)
    yield m
    m.close()


# ---- the Pythonic API, against the in-tree library (KILN_BUILD_DIR) ---------------------------

def test_str_fields(model):
    assert model.info["architecture"] == "qwen35"
    assert isinstance(model.info["name"], (str, type(None)))
    assert all(not isinstance(v, bytes) for v in model.info.values())


def test_tokenize_detokenize(model):
    ids = model.tokenize(PROMPT)
    assert ids == model.tokenizer.encode(PROMPT)
    assert model.detokenize(ids) == PROMPT
    # special-token strings become their ids (parse_special), and are left out when decoding
    im = model.tokenize("<|im_start|>", add_special=False)
    assert len(im) == 1 and model.detokenize(im) == ""
    assert model.detokenize(im, render_special=True) == "<|im_start|>"


def test_generate_equals_context(model):
    text = model.generate(PROMPT, max_tokens=N_TOKENS)
    with kiln.Context(model) as ctx:
        r = ctx.generate(model.tokenize(PROMPT), max_tokens=N_TOKENS)
    assert text == r["text"] and text
    # the text is the whole detokenized output, NUL bytes included (ctypes' c_char_p would
    # have ended it at the first)
    assert text == model.detokenize(r["ids"])
    # ids in, text out; the same again from the shared context (its cache reused)
    assert model.generate(model.tokenize(PROMPT), max_tokens=N_TOKENS) == text


@pytest.mark.parametrize("kw", [
    dict(),
    dict(temperature=0.8, top_p=0.9, top_k=40, seed=7),
    dict(stop=["a", "\n"]),
    dict(max_tokens=40, ignore_eos=True, stop=["st"]),
], ids=["greedy", "sampled", "stop", "stop_long"])
def test_stream_equals_generate(model, kw):
    kw = {"max_tokens": N_TOKENS, **kw}
    text = model.generate(PROMPT, **kw)
    pieces = list(model.stream(PROMPT, **kw))
    assert all(isinstance(p, str) and p for p in pieces)
    assert "".join(pieces) == text
    with kiln.Context(model) as ctx:
        assert ctx.generate(model.tokenize(PROMPT), **kw)["text"] == text


def test_stream_early_exit(model):
    full = model.generate(PROMPT, max_tokens=N_TOKENS)
    it = model.stream(PROMPT, max_tokens=N_TOKENS)
    first = next(it)
    assert full.startswith(first)
    # a call while the stream holds the shared context gets a context of its own
    assert model.generate(PROMPT, max_tokens=N_TOKENS) == full
    it.close()  # stops the worker at its next token
    assert model.generate(PROMPT, max_tokens=N_TOKENS) == full
    for piece in model.stream(PROMPT, max_tokens=N_TOKENS):
        break
    assert "".join(model.stream(PROMPT, max_tokens=N_TOKENS)) == full


def test_chat(model, tiny_model):
    from transformers import AutoTokenizer
    messages = [{"role": "system", "content": "You are terse."},
                {"role": "user", "content": "Hello there"},
                {"role": "assistant", "content": "Hi."},
                {"role": "user", "content": "Über 東京 🙂"}]
    hf = AutoTokenizer.from_pretrained(str(tiny_model))
    want = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    prompt = model.apply_chat_template(messages)
    assert prompt == want
    assert model.apply_chat_template([(m["role"], m["content"]) for m in messages]) == want
    ids = model.tokenize(prompt, add_special=False)
    assert ids == hf(want, add_special_tokens=False)["input_ids"]
    with kiln.Context(model) as ctx:
        want_text = ctx.generate(ids, max_tokens=N_TOKENS)["text"]
    assert model.chat(messages, max_tokens=N_TOKENS) == want_text
    assert "".join(model.chat_stream(messages, max_tokens=N_TOKENS)) == want_text


def test_context_managers(build_dir, tiny_model):
    with kiln.Model(tiny_model) as m:
        with kiln.Context(m, n_ctx=64) as ctx:
            ctx.decode(m.tokenize(PROMPT))
            assert ctx.n_past == len(m.tokenize(PROMPT))
        assert ctx._h is None
        with kiln.Trainer(m, max_seq=16) as t:
            assert t.params()
        assert t._h is None
        m.generate(PROMPT, max_tokens=2)  # makes the shared context, freed with the model
        assert m._ctx is not None
    assert m._h is None and m._ctx is None
    m.close()  # idempotent


def test_library_lookup_order(tmp_path, monkeypatch):
    """KILN_LIB, then the package's own libkiln.so, then KILN_BUILD_DIR, then <repo>/build."""
    pkg = tmp_path / "site" / "kiln"
    pkg.mkdir(parents=True)
    monkeypatch.setattr(kiln, "__file__", str(pkg / "__init__.py"))
    monkeypatch.delenv("KILN_LIB", raising=False)
    monkeypatch.setenv("KILN_BUILD_DIR", str(tmp_path / "b"))
    assert kiln._find_library() == str(tmp_path / "b" / "libkiln.so")
    (pkg / "libkiln.so").write_bytes(b"")
    assert kiln._find_library() == str((pkg / "libkiln.so").resolve())
    monkeypatch.setenv("KILN_LIB", "/x/libkiln.so")
    assert kiln._find_library() == "/x/libkiln.so"


# ---- the wheel, installed into a fresh venv -------------------------------------------------

def _pinned_build_requirement():
    text = (REPO / "python" / "pyproject.toml").read_text()
    m = re.search(r'requires\s*=\s*\["(scikit-build-core==[^"]+)"\]', text)
    assert m, "python/pyproject.toml: the build requirement pins scikit-build-core"
    return m.group(1)


def _run_or_skip_offline(cmd, what, **kw):
    r = subprocess.run(cmd, capture_output=True, text=True, **kw)
    if r.returncode != 0:
        out = r.stdout + r.stderr
        if any(h in out for h in OFFLINE_HINTS):
            pytest.skip(f"{what}: PyPI not reachable ({out.strip().splitlines()[-1]})")
        pytest.fail(f"{what} failed ({r.returncode}):\n{out[-4000:]}")
    return r


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    """The wheel of `pip wheel ./python` (built once per module)."""
    d = tmp_path_factory.mktemp("wheel")
    pip = [sys.executable, "-m", "pip"]
    # the pinned build backend first: skip, not fail, when PyPI is out of reach
    _run_or_skip_offline(pip + ["download", "--no-deps", "-q", "-d", str(d / "probe"),
                                _pinned_build_requirement()], "fetching scikit-build-core",
                         timeout=120)
    _run_or_skip_offline(pip + ["wheel", str(REPO / "python"), "-w", str(d), "--no-deps"],
                         "pip wheel ./python", timeout=1800)
    wheels = list(d.glob("kiln-*.whl"))
    assert len(wheels) == 1, wheels
    return wheels[0]


@pytest.fixture(scope="module")
def venv_python(wheel, tmp_path_factory):
    """A fresh venv with the wheel installed (numpy from PyPI, as its dependency)."""
    d = tmp_path_factory.mktemp("venv")
    subprocess.run([sys.executable, "-m", "venv", str(d)], check=True)
    py = d / "bin" / "python"
    _run_or_skip_offline([str(py), "-m", "pip", "install", "-q", str(wheel)],
                         "pip install kiln wheel", timeout=600)
    return py


def _clean_env():
    """The environment without anything that would point kiln at the checkout."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("KILN_BUILD_DIR", "KILN_LIB", "PYTHONPATH", "VIRTUAL_ENV")}
    return env


def test_wheel_contents(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    assert "kiln/__init__.py" in names and "kiln/libkiln.so" in names
    meta = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("/METADATA"))).decode()
    assert "Requires-Dist: numpy" in meta


def test_installed_package_generates(venv_python, model, tiny_model, tmp_path):
    want = model.generate(PROMPT, max_tokens=N_TOKENS)
    code = textwrap.dedent(f"""
        import sys, kiln
        from pathlib import Path
        pkg = Path(kiln.__file__).resolve().parent
        assert Path(sys.prefix).resolve() in pkg.parents, (kiln.__file__, sys.prefix)
        assert kiln._find_library() == str(pkg / "libkiln.so")
        with kiln.Model({str(tiny_model)!r}) as m:
            assert m.info["architecture"] == "qwen35"
            text = m.generate({PROMPT!r}, max_tokens={N_TOKENS})
            assert "".join(m.stream({PROMPT!r}, max_tokens={N_TOKENS})) == text
        sys.stdout.write(repr(text))
    """)
    r = subprocess.run([str(venv_python), "-c", code], cwd=tmp_path, env=_clean_env(),
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout == repr(want)


def test_readme_example(venv_python, tiny_model, tmp_path):
    readme = (REPO / "README.md").read_text()
    section = readme.split("\n## Python\n", 1)[1].split("\n## ", 1)[0]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    assert 'kiln.Model("SmolLM2-135M-Instruct.Q4_1.gguf")' in code
    code = code.replace('"SmolLM2-135M-Instruct.Q4_1.gguf"', repr(str(tiny_model)))
    (tmp_path / "example.py").write_text(code)
    r = subprocess.run([str(venv_python), "example.py"], cwd=tmp_path, env=_clean_env(),
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("qwen35 ")


def test_version_agrees(build_dir):
    """kiln.__version__, python/pyproject.toml's version and the library's kiln_version()."""
    import kiln
    lib = kiln.load_library()
    lib.kiln_version.restype = ctypes.c_char_p
    project = re.search(r'^version = "([^"]+)"', (REPO / "python" / "pyproject.toml").read_text(), re.M).group(1)
    assert kiln.__version__ == project == lib.kiln_version().decode()
