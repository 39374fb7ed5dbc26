"""kiln_train_params.fast, Trainer(fast=) and `kiln train --fast` (docs/TRAINING.md, "Fast mode").

Fast training is a GPU mode: with device -1 it is refused (KILN_ERR_UNSUPPORTED, "fast is a
GPU mode"), and the CLI refuses --fast without --device cuda (usage error, exit 2). Where no
usable GPU is present a fast trainer on device 0 is refused like an auditable one; where one
is, two fast trainers from the same start give the same losses bit for bit and stay close to
the auditable trainer (tests/gpu/test_cuda_train_fast.c has the stated bounds).
"""
import numpy as np
import pytest

import kiln
from test_parity import build_model
from test_train_cli import TEXT, kiln as run_kiln

KILN_ERR_UNSUPPORTED = 4


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, build_dir):
    base = tmp_path_factory.mktemp("trainfast")
    d, _ = build_model(base, "llama")
    (base / "corpus.txt").write_text(TEXT)
    run_kiln(build_dir, "data", "-m", d, "-o", base / "corpus.tok", base / "corpus.txt")
    return base, d


def test_default_fast_is_zero(build_dir):
    p = kiln.load_library().kiln_train_default_params()
    # the last field: a layout mismatch would read whatever follows device
    assert (p.device, p.fast) == (-1, 0)


def test_fast_on_cpu_refused(tiny):
    _, d = tiny
    m = kiln.Model(d)
    with pytest.raises(kiln.KilnError, match="fast is a GPU mode") as e:
        kiln.Trainer(m, max_seq=32, fast=True)
    assert e.value.status == KILN_ERR_UNSUPPORTED


def test_fast_on_gpu_refused_or_deterministic(tiny):
    _, d = tiny
    m = kiln.Model(d)
    ids = list(range(3, 35))
    try:
        a = kiln.Trainer(m, max_seq=32, device=0, fast=True)
    except kiln.KilnError as e:  # no usable GPU
        assert e.status == KILN_ERR_UNSUPPORTED and "device 0 (CUDA)" in e.message, e.message
        return
    b = kiln.Trainer(m, max_seq=32, device=0, fast=True)
    ref = kiln.Trainer(m, max_seq=32, device=0)
    # "(fast)", or "(fast, step graphs ...)" where the GPU records a step's launches
    assert "(fast" in a.describe()[0] and "(fast" not in ref.describe()[0]
    for _ in range(3):
        la, lb, lr = a.step(ids), b.step(ids), ref.step(ids)
        assert np.float32(la).tobytes() == np.float32(lb).tobytes()
        assert abs(la - lr) <= 2e-2 * abs(lr)
        for t in (a, b, ref):
            t.clip_grads(1.0)
            t.optimizer_step(1e-3)
    for name, n, _ in a.params():
        assert a.get_param(name, n).tobytes() == b.get_param(name, n).tobytes(), name


ARGS = ["--steps", "2", "--batch", "2", "--seq", "16", "--warmup", "1", "--eval-every", "0",
        "--eval-fraction", "0", "--save-every", "0", "--no-export", "--threads", "1"]


def test_cli_fast_needs_cuda(tiny, build_dir):
    base, d = tiny
    data = ["-m", d, "--data", base / "corpus.tok", *ARGS]
    r = run_kiln(build_dir, "train", *data, "--out", base / "cpu-fast", "--fast", check=False)
    assert r.returncode == 2 and "--fast is a GPU mode" in r.stderr, r.stderr[-2000:]
    r = run_kiln(build_dir, "train", *data, "--out", base / "cuda-fast", "--device", "cuda",
                 "--fast", check=False)
    if r.returncode != 0:  # no usable GPU: refused, naming CUDA
        assert "device 0 (CUDA)" in r.stderr and "unavailable" in r.stderr, r.stderr[-2000:]
