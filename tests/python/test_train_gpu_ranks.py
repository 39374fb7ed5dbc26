"""GPU ranks through the CLI (docs/DISTRIBUTED.md, "GPU ranks"): `kiln train --device cuda` as one
rank over NCCL (KILN_COMM=nccl: the ranks' path on one GPU, the flat vector staged on the device in
chunks of 333 elements, reduce-scattered and all-gathered through NCCL) against the plain GPU run
with the same batches: every step's loss and gradient norm (17 digits) and the final checkpoint's
whole state, the rank's set of one shard against the plain run's state.kiln, bit for bit; f32 and
bf16 + master weights, auditable and fast. Skipped without a GPU or a kiln built without CUDA."""
import os
import subprocess

import pytest

from test_parity import build_model
from test_train_cli import TEXT
from test_train_dp import ENV, MPIRUN, flat_state, mpi_flags, steps


def gpu_env():
    env = dict(os.environ)
    for k in ("OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "PMI_SIZE", "PMI_RANK", "PMIX_RANK", "WORLD_SIZE",
              "RANK", "LOCAL_RANK"):
        env.pop(k, None)
    try:  # PyTorch's nvidia-nccl, when the loader knows no libnccl.so.2
        import nvidia.nccl as n
        lib = os.path.join(list(n.__path__)[0], "lib")
        env["LD_LIBRARY_PATH"] = lib + (":" + env["LD_LIBRARY_PATH"] if env.get("LD_LIBRARY_PATH") else "")
    except ImportError:
        pass
    return env


def one_and_rank(build_dir, args, one, rank, chunk):
    """The plain GPU run into one, then the same as one rank over NCCL into rank (KILN_DP_CHUNK
    chunk); both must succeed, and rank must say it ran as one rank of the nccl communicator."""
    env = gpu_env()
    r = subprocess.run([build_dir / "kiln", *args, "--out", one], capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    r = subprocess.run([build_dir / "kiln", *args, "--out", rank], capture_output=True, text=True, timeout=600,
                       env={**env, "KILN_COMM": "nccl", "KILN_DP_CHUNK": str(chunk)})
    assert r.returncode == 0, r.stderr[-3000:]
    assert "1 ranks (nccl)" in r.stderr and "(ZeRO-2)" in r.stderr, r.stderr[-3000:]


@pytest.fixture(scope="module")
def setup(tmp_path_factory, build_dir):
    base = tmp_path_factory.mktemp("gpu_ranks")
    model = build_model(base, "llama")[0]
    (base / "corpus.txt").write_text(TEXT)
    r = subprocess.run([build_dir / "kiln", "data", "-m", model, "-o", base / "corpus.tok", base / "corpus.txt"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    r = subprocess.run([build_dir / "kiln", "train", "-m", model, "--data", base / "corpus.tok", "--device", "cuda",
                        "--steps", "1", "--batch", "1", "--seq", "8", "--out", base / "probe", "--no-export"],
                       capture_output=True, text=True)
    if r.returncode != 0 and ("CUDA" in r.stderr or "cuda" in r.stderr) and "device" in r.stderr:
        pytest.skip("no usable GPU: " + r.stderr.strip().splitlines()[-1])
    assert r.returncode == 0, r.stderr[-3000:]
    return base, model


@pytest.mark.parametrize("storage,fast", [("f32", False), ("bf16_master", False), ("f32", True),
                                          ("bf16_master", True)])
def test_cuda_one_rank_over_nccl_equals_one_gpu(setup, build_dir, storage, fast):
    base, model = setup
    args = ["train", "-m", model, "--data", base / "corpus.tok", "--device", "cuda", "--batch", "4",
            "--seqs-per-forward", "4", "--seq", "32", "--lr", "3e-3", "--warmup", "2", "--steps", "4", "--clip", "0.5",
            "--save-every", "0", "--no-export", "--eval-fraction", "0", "--storage", storage] + (["--fast"] if fast else [])
    tag = f"{storage}_{'fast' if fast else 'aud'}"
    one, rank = base / f"one_{tag}", base / f"rank_{tag}"
    one_and_rank(build_dir, args, one, rank, 333)
    assert steps(one) == steps(rank)
    assert any(float(g) > 0.5 for _, _, g in steps(rank))  # the clip was active
    a, b = flat_state(one / "checkpoints" / "step-4"), flat_state(rank / "checkpoints" / "step-4")
    assert a.keys() == b.keys() and {"flat/weight", "flat/m", "flat/v"} <= a.keys()
    assert [k for k in a if a[k] != b[k]] == []
    assert (rank / "checkpoints" / "step-4" / "shard-00000-of-00001.kiln").exists()


def test_cuda_rank_set_resumes_on_gpu(setup, build_dir):
    """A GPU rank's set of shards (KILN_COMM=nccl, stopped after step 3) resumes on the plain GPU
    trainer and on the GPU rank: the uninterrupted plain GPU run's every step and final state,
    bit for bit (bf16 + master: weights, moments and master copy uploaded from the shards)."""
    base, model = setup
    args = ["train", "-m", model, "--data", base / "corpus.tok", "--device", "cuda", "--batch", "4",
            "--seqs-per-forward", "4", "--seq", "32", "--lr", "3e-3", "--warmup", "2", "--steps", "6",
            "--save-every", "3", "--no-export", "--eval-fraction", "0", "--storage", "bf16_master"]
    env, rank_env = gpu_env(), {**gpu_env(), "KILN_COMM": "nccl", "KILN_DP_CHUNK": "333"}
    full = base / "gpu_resume_full"
    r = subprocess.run([build_dir / "kiln", *args, "--out", full], capture_output=True, text=True, env=env,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    for how, renv in (("plain", env), ("rank", rank_env)):
        part = base / f"gpu_resume_{how}"
        r = subprocess.run([build_dir / "kiln", *args, "--out", part, "--stop-after", "3"], capture_output=True,
                           text=True, env=rank_env, timeout=600)
        assert r.returncode == 0, r.stderr[-3000:]
        assert (part / "checkpoints" / "step-3" / "shard-00000-of-00001.kiln").exists()
        r = subprocess.run([build_dir / "kiln", *args, "--out", part, "--resume"], capture_output=True, text=True,
                           env=renv, timeout=600)
        assert r.returncode == 0 and "at step 3" in r.stderr, r.stderr[-3000:]
        assert steps(full) == steps(part), how
        a, b = flat_state(full / "checkpoints" / "step-6"), flat_state(part / "checkpoints" / "step-6")
        assert a.keys() == b.keys() and [k for k in a if a[k] != b[k]] == [], how


@pytest.mark.parametrize("storage", ["f32", "bf16_master"])
def test_cuda_cpu_and_gpu_ranks_equal_one_process(setup, build_dir, storage):
    """CPU and GPU ranks together (docs/DISTRIBUTED.md): `mpirun -np 2 kiln train --device cpu,cuda`,
    rank 0 on the CPU and rank 1 on the GPU over MPI (the GPU rank's pieces through host memory,
    chunks of 333 elements), against one CPU process with the same micro-batches: every step's
    loss and norm and the final state, bit for bit (the auditable arithmetic's bits are the
    CPU's on both devices). Needs Open MPI (scripts/gpu-check.sh installs the carried wheel)."""
    base, model = setup
    assert MPIRUN, "mpirun not found: scripts/gpu-deps.sh fetch carries Open MPI's wheel, gpu-check.sh installs it"
    args = ["train", "-m", model, "--data", base / "corpus.tok", "--batch", "4", "--seq", "32", "--lr", "3e-3",
            "--warmup", "2", "--steps", "4", "--clip", "0.5", "--save-every", "0", "--no-export",
            "--eval-fraction", "0", "--storage", storage, "--threads", "2"]
    one, mixed = base / f"cpu_one_{storage}", base / f"cpu_gpu_{storage}"
    r = subprocess.run([build_dir / "kiln", *args, "--seqs-per-forward", "2", "--out", one], capture_output=True,
                       text=True, timeout=600, env=gpu_env())
    assert r.returncode == 0, r.stderr[-3000:]
    flags = mpi_flags()
    cmd = [MPIRUN, *flags, *(["-x", "KILN_DP_CHUNK", "-x", "LD_LIBRARY_PATH"] if flags else []), "-np", "2",
           build_dir / "kiln", *args, "--device", "cpu,cuda", "--out", mixed]
    r = subprocess.run(list(map(str, cmd)), capture_output=True, text=True, timeout=600,
                       env={**gpu_env(), **{k: v for k, v in ENV.items() if k.startswith("OMPI_")},
                            "KILN_DP_CHUNK": "333"})
    assert "built without MPI" not in r.stderr, "kiln was built without MPI: the GPU check builds it with Open MPI"
    assert r.returncode == 0, r.stderr[-3000:]
    assert "2 ranks (mpi)" in r.stderr and r.stderr.count("staged through host memory") == 1, r.stderr[-2000:]
    assert steps(one) == steps(mixed)
    a, b = flat_state(one / "checkpoints" / "step-4"), flat_state(mixed / "checkpoints" / "step-4")
    assert a.keys() == b.keys() and [k for k in a if a[k] != b[k]] == []


def test_cuda_gpu_ranks_refusals(setup, build_dir):
    base, model = setup
    env = {**gpu_env(), "KILN_COMM": "nccl"}
    common = ["train", "-m", model, "--data", base / "corpus.tok", "--device", "cuda", "--batch", "2", "--seq", "8",
              "--steps", "1", "--no-export"]
    r = subprocess.run([build_dir / "kiln", *common, "--zero", "3", "--out", base / "z3"], capture_output=True,
                       text=True, env=env, timeout=300)
    assert r.returncode != 0 and "ZeRO-3 on GPU ranks is not written yet" in r.stderr, r.stderr[-2000:]
    # torchrun's variables without the address: named
    r = subprocess.run([build_dir / "kiln", *common, "--out", base / "tr"], capture_output=True, text=True,
                       timeout=300, env={**gpu_env(), "WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0"})
    assert r.returncode != 0 and "MASTER_ADDR is not set" in r.stderr, r.stderr[-2000:]


def test_cuda_distill_one_rank_over_nccl_equals_one_gpu(setup, build_dir):
    """`kiln distill --device cuda` as one rank over NCCL: the teacher on the rank's device, the
    student's gradients through the ranks' path; the same losses (KL and CE parts in the log) and
    final state as the plain GPU run."""
    base, model = setup
    args = ["distill", "--teacher", model, "--config", "tiny", "--tokenizer", model, "--data", base / "corpus.tok",
            "--device", "cuda", "--batch", "4", "--seqs-per-forward", "4", "--seq", "32", "--lr", "3e-3",
            "--warmup", "2", "--steps", "3", "--temperature", "2", "--alpha", "0.7", "--save-every", "0",
            "--no-export", "--eval-fraction", "0"]
    one, rank = base / "kd_one", base / "kd_rank"
    one_and_rank(build_dir, args, one, rank, 1000)
    assert steps(one) == steps(rank)
    a, b = flat_state(one / "checkpoints" / "step-3"), flat_state(rank / "checkpoints" / "step-3")
    assert [k for k in a if a[k] != b[k]] == []
