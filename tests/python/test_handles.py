"""The Python handles' safety (issue 32, item 4, the binding's part): handles refuse to be
copied or pickled, integers headed for C are range- and type-checked naming the argument
(ctypes would wrap 2**32 + 5 to 5), a closed handle refuses use, and closing a Model under
open Contexts or Trainers frees it only when the last of them closes."""
import copy
import pickle
import subprocess
import sys
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
