"""The Python handles' safety (issue 32, item 4, the binding's part): handles refuse to be
copied or pickled, integers headed for C are range- and type-checked naming the argument
(ctypes would wrap 2**32 + 5 to 5), a closed handle refuses use, and closing a Model under
open Contexts or Trainers frees it only when the last of them closes. The C side's statuses
for a poisoned backend and a broken invariant raise KilnPoisoned (the handle closed first) and
KilnPanic; Contexts and Trainers refuse use from another thread (KilnThreadError)."""
import copy
import ctypes as C
import pickle
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

import kiln

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    pytest.importorskip("transformers")
    d = tmp_path_factory.mktemp("handles") / "tiny"
    subprocess.run([sys.executable, str(REPO / "scripts" / "make_tiny_qwen35.py"), str(d), "--seed", "1"],
                   check=True, capture_output=True)
    return d


def test_no_copies(tiny, build_dir):
    with kiln.Model(tiny) as m:
        with kiln.Context(m, n_ctx=64, n_threads=1) as ctx:
            for h in (m, ctx, m.tokenizer):
                with pytest.raises(TypeError, match="cannot be copied"):
                    copy.copy(h)
                with pytest.raises(TypeError, match="cannot be copied"):
                    copy.deepcopy(h)
                with pytest.raises(TypeError, match="cannot be pickled"):
                    pickle.dumps(h)


@pytest.mark.parametrize("kw,err,msg", [
    ({"n_ctx": 2**32 + 5}, ValueError, "n_ctx"),
    ({"n_ctx": 64.0}, TypeError, "n_ctx"),
    ({"n_batch": True}, TypeError, "n_batch"),
    ({"n_threads": -1}, ValueError, "n_threads"),
    ({"n_seq": 2**31}, ValueError, "n_seq"),
    ({"device": "gpu"}, None, None),
])
def test_context_ints(tiny, build_dir, kw, err, msg):
    with kiln.Model(tiny) as m:
        if err is None:  # device takes ints; a string is a type error naming it
            with pytest.raises(TypeError, match="device"):
                kiln.Context(m, **kw)
            return
        with pytest.raises(err, match=msg):
            kiln.Context(m, **kw)


def test_generate_and_trainer_ints(tiny, build_dir):
    with kiln.Model(tiny) as m:
        with kiln.Context(m, n_ctx=64, n_threads=1) as ctx:
            with pytest.raises(ValueError, match="max_tokens"):
                ctx.generate([1, 2, 3], max_tokens=2**33)
            with pytest.raises(ValueError, match="seed"):
                ctx.generate([1, 2, 3], seed=-1)
            with pytest.raises(TypeError, match="top_k"):
                ctx.generate([1, 2, 3], top_k=1.5)
            assert ctx.generate([1, 2, 3], max_tokens=np.int64(2), seed=np.uint64(2**63))["ids"]
        with pytest.raises(ValueError, match="max_seq"):
            kiln.Trainer(m, max_seq=2**32 + 16)
        with pytest.raises(TypeError, match="max_batch"):
            kiln.Trainer(m, max_batch=2.0)


def test_use_after_close(tiny, build_dir):
    m = kiln.Model(tiny)
    ctx = kiln.Context(m, n_ctx=64, n_threads=1)
    ctx.close()
    ctx.close()  # idempotent
    with pytest.raises(kiln.KilnError, match="after close"):
        ctx.truncate(0)
    with pytest.raises(kiln.KilnError, match="after close"):
        ctx.generate([1, 2], max_tokens=1)
    m.close()
    with pytest.raises(kiln.KilnError, match="after close"):
        kiln.Context(m, n_ctx=64)


def test_model_outlives_its_users(tiny, build_dir):
    """Closing the model under an open Context and Trainer defers the free: both keep working,
    and the model goes with the last of them."""
    m = kiln.Model(tiny)
    ctx = kiln.Context(m, n_ctx=64, n_threads=1)
    tr = kiln.Trainer(m, max_seq=16, n_threads=1)
    want = ctx.decode([5, 6, 7], all_logits=True)
    m.close()
    assert m._h  # still held for its users
    ctx.truncate(0)
    assert np.array_equal(ctx.decode([5, 6, 7], all_logits=True), want)
    ctx.close()
    assert m._h
    assert tr.step(list(range(10, 20))) > 0
    tr.close()
    assert not m._h  # freed with the last user


# ---- safe handles: the C side's statuses as exceptions, and thread affinity ---------------------

def test_status_exceptions():
    """KILN_ERR_POISONED and KILN_ERR_PANIC raise KilnErrors of their own; others KilnError."""
    kiln.load_library()
    for st, cls in ((kiln.KILN_ERR_POISONED, kiln.KilnPoisoned), (kiln.KILN_ERR_PANIC, kiln.KilnPanic),
                    (kiln.KILN_ERR_BAD_HANDLE, kiln.KilnError), (1, kiln.KilnError)):
        with pytest.raises(cls) as e:
            kiln._check(st)
        assert isinstance(e.value, kiln.KilnError) and e.value.status == st
        if cls is kiln.KilnError:
            assert type(e.value) is kiln.KilnError
    assert kiln.load_library().kiln_status_string(kiln.KILN_ERR_POISONED) == b"backend poisoned"


def test_poisoned_backend_closes_its_handles(tiny, build_dir):
    """A poisoned backend (kiln_debug_poison_context: the CPU's stand-in for a GPU fault) is
    queryable, and a call on a handle that uses it raises KilnPoisoned after closing that
    handle; the model then closes, and new contexts get a fresh backend."""
    lib = kiln.load_library()
    m = kiln.Model(tiny)
    a = kiln.Context(m, n_ctx=64, n_threads=1)
    b = kiln.Context(m, n_ctx=64, n_threads=1)  # the same device, mode, threads: one backend
    want = a.decode([5, 6, 7])
    assert kiln.backend_poisoned() == 0 and not a.poisoned()
    assert lib.kiln_debug_poison_context(a._h) == 0
    assert kiln.backend_poisoned() == 1 and a.poisoned() and b.poisoned()
    with pytest.raises(kiln.KilnPoisoned, match="poisoned on purpose"):
        a.decode([5, 6, 7])
    assert not a._raw  # closed before the raise
    with pytest.raises(kiln.KilnError, match="after close"):
        a.truncate(0)
    with pytest.raises(kiln.KilnPoisoned):
        b.generate([1, 2, 3], max_tokens=2)
    assert not b._raw
    assert kiln.backend_poisoned() == 0  # freed with its last user
    with kiln.Context(m, n_ctx=64, n_threads=1) as c:
        assert np.array_equal(c.decode([5, 6, 7]), want)
    # the model's shared context of generate(): replaced after it is poisoned
    text = m.generate([5, 6, 7], max_tokens=3)
    lib.kiln_debug_poison_context(m._ctx._h)
    with pytest.raises(kiln.KilnPoisoned):
        m.generate([5, 6, 7], max_tokens=3)
    assert m.generate([5, 6, 7], max_tokens=3) == text
    m.close()
    assert not m._raw


def test_panic_drops_the_handle(tiny, build_dir):
    """A handle whose memory was overwritten: KilnPanic, and the binding drops (never frees) it."""
    lib = kiln.load_library()
    m = kiln.Model(tiny)
    ctx = kiln.Context(m, n_ctx=64, n_threads=1)
    ptr = ctx._raw.value
    magic = C.c_uint32.from_address(ptr).value
    C.c_uint32.from_address(ptr).value = 0x12345678  # the header kiln checks at every entry
    with pytest.raises(kiln.KilnPanic, match="damaged header"):
        ctx.decode([1, 2])
    assert not ctx._raw
    C.c_uint32.from_address(ptr).value = magic  # mend it, so the test frees what it made
    lib.kiln_context_free(C.c_void_p(ptr))
    # a second free in C: refused and recorded, the freed memory never read
    lib.kiln_context_free(C.c_void_p(ptr))
    assert b"kiln_context_free" in lib.kiln_last_error() and b"not a live kiln_context" in lib.kiln_last_error()
    model_ptr = m._raw.value
    m.close()
    assert not m._raw
    assert lib.kiln_model_get_info(C.c_void_p(model_ptr), None) == kiln.KILN_ERR_BAD_HANDLE  # freed


def test_thread_affinity(tiny, build_dir):
    """Contexts and Trainers belong to the thread that made them: another thread's use is
    refused (KilnThreadError), closing is not. Models and tokenizers are not affine, and
    Model.stream lends its context to its worker thread."""
    m = kiln.Model(tiny)
    ctx = kiln.Context(m, n_ctx=64, n_threads=1)
    tr = kiln.Trainer(m, max_seq=16, n_threads=1)
    errors, results = [], {}

    def other():
        for name, call in (("decode", lambda: ctx.decode([1, 2])), ("truncate", lambda: ctx.truncate(0)),
                           ("n_past", lambda: ctx.n_past), ("step", lambda: tr.step(list(range(10, 20))))):
            try:
                call()
                errors.append(f"{name}: not refused")
            except kiln.KilnThreadError as e:
                assert "belongs to the thread" in str(e)
        results["tokens"] = m.tokenize("hello")  # a Model is not affine
        results["text"] = "".join(m.stream([5, 6, 7], max_tokens=3))  # its own shared context

    t = threading.Thread(target=other)
    t.start()
    t.join()
    assert not errors, errors
    assert results["tokens"] == m.tokenize("hello")
    assert ctx.decode([1, 2]).shape == (m.n_vocab,)  # the owner still may
    assert tr.step(list(range(10, 20))) > 0
    assert "".join(m.stream([5, 6, 7], max_tokens=3)) == m.generate([5, 6, 7], max_tokens=3)

    closer = threading.Thread(target=lambda: (ctx.close(), tr.close()))
    closer.start()
    closer.join()
    assert not ctx._raw and not tr._raw
    m.close()
    assert not m._raw
