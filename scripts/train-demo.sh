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
bash scripts/setup-deps.sh
dpkg-query -W -f='${Status}' bible-kjv 2>/dev/null | grep -q "install ok installed" || {
    SUDO=""; [ "$(id -u)" = 0 ] || SUDO=sudo
    $SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq bible-kjv >/dev/null
}
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build build -j"$(nproc)" --target kiln >/dev/null
model="$(bash scripts/fetch-model.sh)"
work="${KILN_DEMO_DIR:-$HOME/.cache/kiln/demo}"
mkdir -p "$work"
[ -s "$work/kjv.txt" ] || bible gen1:1-rev22:21 > "$work/kjv.txt"
[ -s "$work/kjv.tok" ] || ./build/kiln data -m "$model" -o "$work/kjv.tok" "$work/kjv.txt"

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
