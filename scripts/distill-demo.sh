#!/usr/bin/env bash
# kiln's distillation demo on this machine's CPU (about 35 minutes on 2 cores, the two runs side
# by side on a core each): the default model, SmolLM2-135M-Instruct (pretrained; Q4_1), teaches
# a student of about 12M parameters ("small", trained from scratch with its tokenizer) on the
# first two books of the King James Bible (Genesis and Exodus, Debian package bible-kjv:
# 180 chapters, about 100k tokens; a tenth of the chapters held out). The same student is
# trained twice on the same tokens, in the same order, for 600 steps of 8 x 64 tokens (about
# 3.4 passes over the training chapters: the small-data regime where a teacher's soft targets
# are worth most):
#   ce        kiln train (the cross-entropy on the next token alone)
#   distill   kiln distill --teacher SmolLM2 (0.5 x KL at tau 1 + 0.5 x cross-entropy)
# and their held-out cross-entropy (the evaluation loss of both runs) is printed side by side.
# Measured (bench/RESULTS.md, "Distillation beats the cross-entropy"): the distilled student
# is ahead from step 150 on and ends at 3.981 nats against 4.038.
# Usage: scripts/distill-demo.sh [steps]   (default 600)
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
cd "$here"
steps="${1:-600}"
# shellcheck source=scripts/kjv-corpus.sh
source scripts/kjv-corpus.sh
[ -s "$work/genesis-exodus.txt" ] || bible gen1:1-exo40:38 > "$work/genesis-exodus.txt"
[ -s "$work/genesis-exodus.tok" ] || ./build/kiln data -m "$model" -o "$work/genesis-exodus.tok" "$work/genesis-exodus.txt"
common=(--config small --tokenizer "$model" --data "$work/genesis-exodus.tok" --steps "$steps" --batch 8 --seq 64
        --lr 2e-3 --warmup 20 --eval-every 50 --eval-batches 8 --eval-fraction 0.1 --save-every 0 --seed 7
        --threads 1 --no-export --overwrite)

echo "=== the student on the cross-entropy alone and distilled from SmolLM2-135M-Instruct ($steps steps each, side by side) ==="
./build/kiln train "${common[@]}" --out "$work/student-ce" 2> "$work/student-ce.log" &
ce=$!
./build/kiln distill --teacher "$model" --temperature 1 --alpha 0.5 "${common[@]}" --out "$work/student-distill" \
    2> "$work/student-distill.log" &
kd=$!
wait "$ce" || { tail -5 "$work/student-ce.log"; exit 1; }
wait "$kd" || { tail -5 "$work/student-distill.log"; exit 1; }

echo
echo "held-out cross-entropy of the student (nats per token), by step:"
printf '%-6s %-10s %-10s\n' step ce distill
join -t, <(awk -F, 'NR>1 && $3!="" {print $1","$3}' "$work/student-ce/metrics.csv" | sort -t, -k1,1) \
         <(awk -F, 'NR>1 && $3!="" {print $1","$3}' "$work/student-distill/metrics.csv" | sort -t, -k1,1) |
    sort -t, -k1,1n | awk -F, '{printf "%-6s %-10.4f %-10.4f\n", $1, $2, $3}'
