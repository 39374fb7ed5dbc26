#!/usr/bin/env bash
# gpu-bench.sh -- the GPU inference benchmark of issue 4 (bench/bench_gpu.py): kiln
# `generate --device cuda` (auditable) vs transformers generate vs a plain-PyTorch decode step in
# one CUDA graph vs the roofline, on random Qwen2.5-0.5B / 1.5B-shaped models; table printed last.
#
#   scripts/gpu-bench.sh prepare [build-dir] [bin-dir]
#       on a machine with kiln's build dependencies and nvcc: build kiln and libkiln.so
#       (-DKILN_CUDA=ON, Release; default build-gpubench) and copy them, with the shared
#       libraries a bare GPU machine may lack (cJSON, PCRE2, utf8proc, libcrypto, libcudart),
#       into bin-dir (default .gpubin-bench, git-ignored) to carry to the GPU machine.
#   scripts/gpu-bench.sh [bin-dir] [bench_gpu.py options]
#       on the GPU machine (python3 with torch and transformers): run the benchmark; the log
#       and the JSON go to $OUT (or bin-dir). Without bin-dir/kiln it builds first.
set -uo pipefail
cd "$(dirname "$0")/.."

prepare() {
    local B=${1:-build-gpubench} D=${2:-.gpubin-bench}
    cmake -S . -B "$B" -DKILN_CUDA=ON -DCMAKE_BUILD_TYPE=Release >/dev/null &&
        cmake --build "$B" -j"$(nproc)" --target kiln kiln_shared >/dev/null || return 1
    mkdir -p "$D"
    cp "$B/kiln" "$B/libkiln.so" "$D/" || return 1
    local lib
    for lib in libcjson.so.1 libpcre2-8.so.0 libutf8proc.so.2 libcrypto.so.3 libcudart.so.13; do
        local p
        p=$(ldd "$B/kiln" "$B/libkiln.so" | awk -v l="$lib" '$1 == l { print $3; exit }')
        [ -n "$p" ] && cp -L "$p" "$D/"
    done
    git rev-parse --short HEAD >"$D/COMMIT"
    echo "prepared $D from $(cat "$D/COMMIT") ($(du -sh "$D" | cut -f1))"
}

if [ "${1:-}" = prepare ]; then
    shift
    prepare "$@"
    exit $?
fi

D=${1:-.gpubin-bench}
[ $# -gt 0 ] && shift
if [ ! -x "$D/kiln" ]; then
    prepare build-gpubench "$D" || { echo "BUILD FAILED"; exit 1; }
fi
LOG=${OUT:-$D}
mkdir -p "$LOG"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader || true
echo "kiln binaries from commit $(cat "$D/COMMIT" 2>/dev/null || echo '?')"
PYTHONUNBUFFERED=1 python3 bench/bench_gpu.py --bin "$D" --json "$LOG/bench_gpu.json" "$@" \
    2>&1 | tee "$LOG/bench_gpu.log"
exit "${PIPESTATUS[0]}"
