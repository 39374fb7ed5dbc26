"""kiln_train_params.device, Trainer(device=) and `kiln train --device` without a usable GPU.

Where no usable GPU is present (CI, this workplace's CPU machines) a trainer on device 0 and
`kiln train --device cuda` must be refused with KILN_ERR_UNSUPPORTED and a message that names
CUDA; `--device cpu` must give the default's losses bit for bit. Where a GPU is present the
GPU trainer must give the CPU's losses and weights (tests/gpu/test_cuda_train.c covers every
gradient, the storage variants and checkpoints moving between the two). The struct layouts
of _TrainParams and TrainMemory are checked against the C defaults.
"""
import numpy as np
import pytest

import kiln
from test_parity import build_model
from test_train_cli import TEXT, kiln as run_kiln, losses

KILN_ERR_UNSUPPORTED = 4


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, build_dir):
    base = tmp_path_factory.mktemp("traindev")
    d, _ = build_model(base, "qwen2")
    (base / "corpus.txt").write_text(TEXT)
    run_kiln(build_dir, "data", "-m", d, "-o", base / "corpus.tok", base / "corpus.txt")
    return base, d


def test_default_params_layout(build_dir):
    lib = kiln.load_library()
    p = lib.kiln_train_default_params()
    # the C defaults, field by field: a layout mismatch would shift them
    assert (p.max_seq, p.n_threads, p.ce_chunk, p.lr, p.beta1, p.beta2, p.eps, p.weight_decay,
            p.weight_storage, p.moment_storage, p.seed, p.device, p.fast, p.max_batch,
            p.ce_keep_mib, p.ce_row_block, p.ce_logits_f32) == \
        (256, 0, 0, 1e-3, 0.9, 0.999, 1e-8, 0.01, 0, 0, 0, -1, 0, 1, 64, 2048, 0)


def test_device_argument_parsing():
    assert kiln.Trainer._device_index(-1) == -1
    assert kiln.Trainer._device_index("cpu") == -1
    assert kiln.Trainer._device_index("cuda") == 0
    assert kiln.Trainer._device_index("cuda:3") == 3
    assert kiln.Trainer._device_index(2) == 2
    for bad in ("gpu", "cuda:", "cuda:x", "cuda:-1"):
        with pytest.raises(ValueError, match="device"):
            kiln.Trainer._device_index(bad)


def step_all(tr, ids):
    loss = tr.step(ids)
    tr.clip_grads(1.0)
    tr.optimizer_step(1e-3)
    return loss


def test_cuda_trainer_refused_or_identical(tiny):
    _, d = tiny
    m = kiln.Model(d)
    ids = list(range(3, 19))
    cpu = kiln.Trainer(m, max_seq=32, n_threads=1)
    desc, mem = cpu.describe()
    assert mem["device"] == -1 and "device: cpu" in desc
    for device in (0, "cuda:0"):
        try:
            gpu = kiln.Trainer(m, max_seq=32, device=device)
        except kiln.KilnError as e:
            assert e.status == KILN_ERR_UNSUPPORTED
            assert "device 0 (CUDA)" in e.message and "kiln_backend_cuda_create" in e.message, e.message
            continue
        desc, mem = gpu.describe()
        assert mem["device"] == 0 and "device: cuda:0" in desc
        ref = kiln.Trainer(m, max_seq=32, n_threads=1)
        for _ in range(2):
            assert np.float32(step_all(gpu, ids)).tobytes() == np.float32(step_all(ref, ids)).tobytes()
        for name, n, _ in ref.params():
            assert gpu.get_param(name, n).tobytes() == ref.get_param(name, n).tobytes(), name


def test_negative_device_rejected(tiny):
    _, d = tiny
    m = kiln.Model(d)
    with pytest.raises(kiln.KilnError, match="device -2"):
        kiln.Trainer(m, max_seq=32, device=-2)


def test_row_block_param(tiny, build_dir):
    """ce_row_block and ce_logits_f32 (GPU fast mode's loss walk and its logits): a negative
    row block is refused naming it; on the CPU neither changes anything (the same bits with 0,
    the default and another size, bf16 or f32 logits), and the CLI's --loss-row-block takes
    0.. and refuses a negative value; --loss-logits-f32 is taken."""
    base, d = tiny
    m = kiln.Model(d)
    with pytest.raises(kiln.KilnError, match="ce_row_block"):
        kiln.Trainer(m, max_seq=32, ce_row_block=-1)
    import numpy as np
    ids = np.arange(2 * 16, dtype=np.int32).reshape(2, 16) % 50
    tg = np.roll(ids, -1, axis=1)
    tg[:, -1] = -1
    got = []
    for rb, f32 in ((None, False), (0, False), (8, False), (8, True)):
        tr = kiln.Trainer(m, max_seq=16, max_batch=2, ce_row_block=rb, ce_logits_f32=f32)
        loss = tr.step_batch(ids, tg)
        name, n, _ = tr.params()[0]
        got.append((np.float32(loss).tobytes(), tr.get_grad(name, n).tobytes()))
    assert got[0] == got[1] == got[2] == got[3]
    data = ["-m", d, "--data", base / "corpus.tok", *ARGS]
    r = run_kiln(build_dir, "train", *data, "--out", base / "rb", "--loss-row-block", "-1", check=False)
    assert r.returncode == 2 and "--loss-row-block" in r.stderr
    run_kiln(build_dir, "train", *data, "--out", base / "rb0", "--loss-row-block", "0")
    run_kiln(build_dir, "train", *data, "--out", base / "lf32", "--loss-logits-f32")


ARGS = ["--steps", "3", "--batch", "2", "--seq", "16", "--warmup", "1", "--eval-every", "0",
        "--eval-fraction", "0", "--save-every", "0", "--no-export", "--threads", "1"]


def test_cli_device(tiny, build_dir):
    base, d = tiny
    data = ["-m", d, "--data", base / "corpus.tok", *ARGS]
    r = run_kiln(build_dir, "train", *data, "--out", base / "bad", "--device", "gpu", check=False)
    assert r.returncode == 2 and "--device 'gpu'" in r.stderr
    run_kiln(build_dir, "train", *data, "--out", base / "default")
    run_kiln(build_dir, "train", *data, "--out", base / "cpu", "--device", "cpu")
    assert losses(base / "cpu") == losses(base / "default")
    r = run_kiln(build_dir, "train", *data, "--out", base / "cuda", "--device", "cuda", check=False)
    if r.returncode != 0:  # no usable GPU: refused, naming CUDA
        assert "device 0 (CUDA)" in r.stderr and "unavailable" in r.stderr, r.stderr[-2000:]
    else:
        assert losses(base / "cuda") == losses(base / "default")
