#!/usr/bin/env bash
# kiln's embedded training demo on this machine's CPU (a few minutes on 2 cores):
#  1. trains a small Llama-style model (~12M parameters, "small") from scratch on the King
#     James Bible (Debian package bible-kjv, public domain), with SmolLM2's tokenizer;
#  2. generates text from it with `kiln generate`;
#  3. fine-tunes the default model (SmolLM2-135M-Instruct) for a few steps on the same text.
# Usage: scripts/train-demo.sh [steps]   (default 120; KILN_DEMO_FINETUNE=0 skips part 3)
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
cd "$here"
steps="${1:-120}"
# shellcheck source=scripts/kjv-corpus.sh
source scripts/kjv-corpus.sh

echo "=== 1. training 'small' from scratch for $steps steps ==="
rm -rf "$work/small"
./build/kiln train --config small --tokenizer "$model" --data "$work/kjv.tok" --out "$work/small" \
    --steps "$steps" --batch 8 --seq 64 --lr 2e-3 --warmup 20 --eval-every 50 --save-every 100
echo "loss curve: $work/small/loss.png, metrics: $work/small/metrics.csv"

echo "=== 2. generating with the trained model ==="
./build/kiln generate -m "$work/small/model" -p "And God said" -n 48 --temp 0.7 --seed 1

if [ "${KILN_DEMO_FINETUNE:-1}" != 0 ]; then
    echo "=== 3. fine-tuning SmolLM2-135M-Instruct for 10 steps ==="
    rm -rf "$work/finetune"
    ./build/kiln train -m "$model" --data "$work/kjv.tok" --out "$work/finetune" --steps 10 --batch 2 \
        --seq 64 --lr 5e-5 --warmup 2 --eval-every 5 --save-every 0
    ./build/kiln generate -m "$work/finetune/model" -p "And the LORD spake unto Moses, saying," -n 32 --temp 0
fi
