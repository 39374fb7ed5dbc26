#!/usr/bin/env bash
# gpu-train-bench.sh -- the GPU training benchmark of issue 5 (bench/bench_train_gpu.py): kiln
# training (auditable and fast) vs PyTorch (f32 master weights, bf16 autocast, fused AdamW;
# eager and torch.compile) on random SmolLM2-135M (batch 16) and Qwen2.5-0.5B (batch 8) shaped
# models at sequence 2048 and 1024 (tokens/s, MFU, peak memory), the fused loss at V 151936,
# H 896, N 8192 against materialised cross-entropy, and the peak memory of each AdamW storage
# variant; tables printed last, a JSON beside them. About 7-8 minutes on an H200.
#
#   scripts/gpu-train-bench.sh [DIR] [bench_train_gpu.py options]
#       on the GPU machine (python3 with torch and transformers; $PYTHON overrides python3):
#       DIR (default build-gpu, as scripts/gpu-check.sh leaves it) is a CMake build folder
#       configured with -DKILN_CUDA=ON; libkiln.so and bench_cuda_fused_ce are brought up to
#       date there first (an incremental `cmake --build DIR --target kiln_shared
#       bench_cuda_fused_ce`; KILN_TBENCH_NO_BUILD=1 skips it, e.g. for a folder made by
#       `scripts/gpu-bench.sh prepare`). DIR's unpacked .deb dependencies
#       (DIR/deps/usr/lib/x86_64-linux-gnu) go on LD_LIBRARY_PATH when present. The log and
#       the JSON go to $OUT (or DIR). Options, e.g.: --parts train,ce,memory --models 135m,0.5b
#       --seqs 2048,1024 --budget 450 --no-compile (python3 bench/bench_train_gpu.py --help).
# Smoke test without a GPU (a CPU-only or CUDA-without-GPU build of libkiln.so in build-tbench):
#   PYTHON=~/.cache/kiln-venv/bin/python scripts/gpu-train-bench.sh build-tbench --device cpu --quick
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1

if [ $# -gt 0 ] && [ "${1#-}" = "$1" ]; then
    D=$1
    shift
else
    D=build-gpu
fi
if [ -z "${KILN_TBENCH_NO_BUILD:-}" ] && [ -f "$D/CMakeCache.txt" ]; then
    t0=$(date +%s)
    targets=(kiln_shared)
    # re-run the configure step (cached settings kept) so that the glob of tests/gpu sees
    # bench_cuda_fused_ce.cu; it is a target only in a CUDA build
    cmake -S . -B "$D" >"$D/train-bench-build.log" 2>&1 &&
        cmake --build "$D" --target help 2>/dev/null | grep -q bench_cuda_fused_ce &&
        targets+=(bench_cuda_fused_ce)
    if ! cmake --build "$D" -j"$(nproc)" --target "${targets[@]}" >>"$D/train-bench-build.log" 2>&1; then
        tail -30 "$D/train-bench-build.log"
        echo "BUILD FAILED ($D/train-bench-build.log)"
        exit 1
    fi
    echo "build ($(printf '%s ' "${targets[@]}")): $(( $(date +%s) - t0 )) s"
fi
if [ ! -f "$D/libkiln.so" ]; then
    echo "$D has no libkiln.so (build it: cmake -S . -B $D -DKILN_CUDA=ON && cmake --build $D --target kiln_shared bench_cuda_fused_ce)"
    exit 1
fi
deps=$D/deps/usr/lib/x86_64-linux-gnu
LD_LIBRARY_PATH=$(cd "$D" && pwd)${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
[ -d "$deps" ] && LD_LIBRARY_PATH=$(cd "$deps" && pwd):$LD_LIBRARY_PATH
export LD_LIBRARY_PATH
LOG=${OUT:-$D}
mkdir -p "$LOG"
command -v nvidia-smi >/dev/null &&
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader
echo "kiln in $D from commit $(cat "$D/COMMIT" 2>/dev/null || git rev-parse --short HEAD)"
t0=$(date +%s)
PYTHONUNBUFFERED=1 "${PYTHON:-python3}" bench/bench_train_gpu.py --bin "$D" \
    --json "$LOG/bench_train_gpu.json" "$@" 2>&1 | tee "$LOG/bench_train_gpu.log"
rc=${PIPESTATUS[0]}
echo "gpu-train-bench: rc=$rc, $(( $(date +%s) - t0 )) s; log $LOG/bench_train_gpu.log, JSON $LOG/bench_train_gpu.json"
exit "$rc"
