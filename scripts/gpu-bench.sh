#!/usr/bin/env bash
# gpu-bench.sh -- the GPU inference benchmark of issue 4 (bench/bench_gpu.py): kiln
# `generate --device cuda` (auditable and --fast) vs transformers generate vs a plain-PyTorch
# decode step in one CUDA graph (eager and torch.compile'd) vs the roofline, decode at batch 1
# and 8, prefill of 512 and 4096 tokens, quantized (Q8_0, Q4_K) decode, on random
# Qwen2.5-0.5B / 1.5B and Llama-3.2-3B-shaped models; one table printed last, a JSON beside it.
#
#   scripts/gpu-bench.sh [DIR] [bench_gpu.py options]
#       on the GPU machine (python3 with torch and transformers; $PYTHON overrides python3):
#       run the benchmark with the kiln and libkiln.so of DIR: a build folder (default
#       build-gpu, as scripts/gpu-check.sh leaves it; its unpacked .deb dependencies in
#       DIR/deps/usr/lib/x86_64-linux-gnu are put on LD_LIBRARY_PATH when present) or a folder
#       made by `prepare` (default .gpubin-bench when build-gpu has no kiln). Without DIR/kiln
#       it runs `prepare build-gpubench DIR` first. The log and the JSON go to $OUT (or DIR).
#       Options, e.g.: --models 0.5b,1.5b,3b --parts decode,prefill,quant,batch8 --quick
#       --budget 500 (python3 bench/bench_gpu.py --help lists them all).
#   scripts/gpu-bench.sh prepare [build-dir] [bin-dir]
#       on a machine with kiln's build dependencies and nvcc: build kiln and libkiln.so
#       (-DKILN_CUDA=ON, Release; default build-gpubench) and copy them, with the shared
#       libraries a bare GPU machine may lack (cJSON, PCRE2, utf8proc, libcrypto, libcudart),
#       into bin-dir (default .gpubin-bench, git-ignored) to carry to the GPU machine.
# Smoke test without a GPU (a CPU build of kiln in build-bench):
#   PYTHON=~/.cache/kiln-venv/bin/python scripts/gpu-bench.sh build-bench --device cpu --quick --models tiny
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1

prepare() {
    local B=${1:-build-gpubench} D=${2:-.gpubin-bench}
    cmake -S . -B "$B" -DKILN_CUDA=ON -DCMAKE_BUILD_TYPE=Release >/dev/null &&
        cmake --build "$B" -j"$(nproc)" --target kiln kiln_shared >/dev/null || return 1
    mkdir -p "$D"
    if [ "$(cd "$B" && pwd)" != "$(cd "$D" && pwd)" ]; then
        cp "$B/kiln" "$B/libkiln.so" "$D/" || return 1
    fi
    local lib
    for lib in libcjson.so.1 libpcre2-8.so.0 libutf8proc.so.2 libcrypto.so.3 libcudart.so.13; do
        local p
        p=$(ldd "$B/kiln" "$B/libkiln.so" | awk -v l="$lib" '$1 == l { print $3; exit }')
        [ -n "$p" ] && [ ! -e "$D/$lib" ] && cp -L "$p" "$D/"
    done
    git rev-parse --short HEAD >"$D/COMMIT"
    echo "prepared $D from $(cat "$D/COMMIT") ($(du -sh "$D" | cut -f1))"
}

if [ "${1:-}" = prepare ]; then
    shift
    prepare "$@"
    exit $?
fi

if [ $# -gt 0 ] && [ "${1#-}" = "$1" ]; then
    D=$1
    shift
elif [ -x build-gpu/kiln ]; then
    D=build-gpu
else
    D=.gpubin-bench
fi
if [ ! -x "$D/kiln" ] || [ ! -f "$D/libkiln.so" ]; then
    echo "$D has no kiln + libkiln.so: building them (prepare build-gpubench $D)"
    prepare build-gpubench "$D" || { echo "BUILD FAILED"; exit 1; }
fi
deps=$D/deps/usr/lib/x86_64-linux-gnu
LD_LIBRARY_PATH=$(cd "$D" && pwd)${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
[ -d "$deps" ] && LD_LIBRARY_PATH=$(cd "$deps" && pwd):$LD_LIBRARY_PATH
export LD_LIBRARY_PATH
LOG=${OUT:-$D}
mkdir -p "$LOG"
command -v nvidia-smi >/dev/null &&
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader
echo "kiln binaries in $D from commit $(cat "$D/COMMIT" 2>/dev/null || git rev-parse --short HEAD)"
t0=$(date +%s)
PYTHONUNBUFFERED=1 "${PYTHON:-python3}" bench/bench_gpu.py --bin "$D" --json "$LOG/bench_gpu.json" "$@" \
    2>&1 | tee "$LOG/bench_gpu.log"
rc=${PIPESTATUS[0]}
echo "gpu-bench: rc=$rc, $(( $(date +%s) - t0 )) s; log $LOG/bench_gpu.log, JSON $LOG/bench_gpu.json"
exit "$rc"
