"""kiln_context_params.device and `--device` through the Python binding and the CLI.

Where no usable GPU is present (CI, this workplace's CPU machines) a context on device 0 and
`kiln generate --device cuda` must be refused with KILN_ERR_UNSUPPORTED and a message that
names CUDA, and `--device cpu` must give the default's output. Where a GPU is present the
CUDA context's logits must be bit-identical to the CPU's (tests/gpu/test_cuda_model.c covers
that in depth). The struct layout of _ContextParams is checked against the C defaults.
"""
import subprocess

import numpy as np
import pytest

import kiln
from test_parity import build_model

KILN_ERR_UNSUPPORTED = 4


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, build_dir):
    d, _ = build_model(tmp_path_factory.mktemp("dev"), "qwen2")
    return d


def test_default_params_layout(build_dir):
    lib = kiln.load_library()
    p = lib.kiln_context_default_params()
    # the C defaults, field by field: a layout mismatch would shift them
    assert (p.n_ctx, p.n_batch, p.n_threads, p.fast_q8_activations, p.device, p.fast) == \
        (0, 512, 0, 0, -1, 0)


def test_cuda_context_refused_or_identical(tiny):
    m = kiln.Model(tiny)
    ids = list(range(3, 15))
    cpu = kiln.Context(m, n_ctx=32, n_threads=1)
    ref = cpu.decode(ids, all_logits=True)
    try:
        gpu = kiln.Context(m, n_ctx=32, device=0)
    except kiln.KilnError as e:
        assert e.status == KILN_ERR_UNSUPPORTED
        assert "device 0 (CUDA)" in e.message and "kiln_backend_cuda_create" in e.message
        return
    got = gpu.decode(ids, all_logits=True)
    assert got.tobytes() == ref.tobytes()
    assert np.array_equal(gpu.decode([7]).view(np.uint32), cpu.decode([7]).view(np.uint32))


def test_cuda_fast_context_refused_or_deterministic(tiny):
    """fast=True on CUDA: refused without a GPU; with one, two contexts give the same bits,
    close to the CPU's (bf16 tensor cores: not the same bits)."""
    m = kiln.Model(tiny)
    ids = list(range(3, 40))
    ref = kiln.Context(m, n_ctx=64, n_threads=1).decode(ids, all_logits=True)
    try:
        a = kiln.Context(m, n_ctx=64, device=0, fast=True).decode(ids, all_logits=True)
    except kiln.KilnError as e:
        assert e.status == KILN_ERR_UNSUPPORTED and "device 0 (CUDA)" in e.message
        return
    b = kiln.Context(m, n_ctx=64, device=0, fast=True).decode(ids, all_logits=True)
    assert a.tobytes() == b.tobytes()
    err = float(abs(a - ref).max()) / max(float(abs(ref).max()), 1e-30)
    assert err < 5e-2, err


def test_negative_device_rejected(tiny):
    m = kiln.Model(tiny)
    with pytest.raises(kiln.KilnError, match="device -2"):
        kiln.Context(m, n_ctx=32, device=-2)


def run_cli(build_dir, model, *extra):
    return subprocess.run([str(build_dir / "kiln"), "generate", "-m", str(model), "-p", "hello",
                           "-n", "6", "--temp", "0", "-t", "1", "--ctx", "32", *extra],
                          capture_output=True, text=True, timeout=120)


def test_cli_device(build_dir, tiny):
    base = run_cli(build_dir, tiny)
    assert base.returncode == 0, base.stderr
    cpu = run_cli(build_dir, tiny, "--device", "cpu")
    assert cpu.returncode == 0 and cpu.stdout == base.stdout
    bad = run_cli(build_dir, tiny, "--device", "gpu7")
    assert bad.returncode == 2 and "expected cpu, cuda or cuda:N" in bad.stderr
    cuda = run_cli(build_dir, tiny, "--device", "cuda:0")
    if cuda.returncode != 0:  # no GPU here: a clear refusal
        assert "CUDA" in cuda.stderr, cuda.stderr
    else:
        assert cuda.stdout == base.stdout
