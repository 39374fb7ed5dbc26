#!/usr/bin/env bash
# gpu-check.sh -- on a machine with an NVIDIA GPU: build kiln with CUDA (Release), run the GPU
# op tests (every op vs the CPU backend, bit for bit, two seeds), compute-sanitizer memcheck
# and racecheck on the op test when the tool works here, the decode matmul benchmark, and
# whole models on the GPU vs the CPU (test_cuda_model: logits bit for bit, decode timing);
# print a short table last.
#   scripts/gpu-check.sh [build-dir]      (default build-gpu; logs under $OUT or build-dir)
#   KILN_PREBUILT=dir scripts/gpu-check.sh   (skip the build; run dir/test_cuda_ops etc.;
#       LD_LIBRARY_PATH=dir for the libraries carried beside them; dir/vocab holds the
#       vocabulary GGUFs test_cuda_model needs, else $KILN_VOCAB_DIR)
#   KILN_GPU_PARTS="ops sanitizer bench model cli"   (the parts to run; default all)
#   cli: writes a random Qwen2.5-0.5B-shaped Hugging Face folder (bf16, python3 with torch
#   and transformers; KILN_CLI_SHAPE=C,L,NH,KVH,FF to change the shape) with the tokenizer
#   files of $KILN_CLI_TOKENIZER (default dir/tok: a 151,936-token tokenizer.json), runs
#   `kiln generate --device cpu` and `--device cuda` greedy on it, compares the ids and prints
#   both runs' timings.
set -uo pipefail
cd "$(dirname "$0")/.."
B=${1:-build-gpu}
LOG=${OUT:-$B}
mkdir -p "$B" "$LOG"
J=$(nproc)
gen=()
command -v ninja >/dev/null && gen=(-G Ninja)

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
t0=$(date +%s)
if [ -n "${KILN_PREBUILT:-}" ]; then
    # binaries built elsewhere (test_cuda_ops, bench_cuda_matmul need only libcudart and
    # libstdc++): for a GPU machine without kiln's build dependencies (cJSON, PCRE2, ...)
    B=$KILN_PREBUILT
    echo "prebuilt binaries from $B"
elif ! { cmake -S . -B "$B" "${gen[@]}" -DKILN_CUDA=ON -DCMAKE_BUILD_TYPE=Release \
         -DKILN_WERROR=ON && cmake --build "$B" -j"$J" --target test_cuda_ops bench_cuda_matmul test_cuda_model; } \
       >"$LOG/build.log" 2>&1; then
    tail -40 "$LOG/build.log"
    echo "BUILD FAILED"
    exit 1
else
    echo "build: $(( $(date +%s) - t0 )) s"
fi

PARTS=${KILN_GPU_PARTS:-ops sanitizer bench model cli}
has() { case " $PARTS " in *" $1 "*) return 0 ;; esac; return 1; }
status=0
seed2=$(( $(date +%s) ))
r1=-; r2=-; rm_=-
if has ops; then
    "$B/test_cuda_ops" >"$LOG/test1.log" 2>&1; r1=$?
    "$B/test_cuda_ops" "$seed2" >"$LOG/test2.log" 2>&1; r2=$?
    [ $r1 -eq 0 ] && [ $r2 -eq 0 ] || status=1
    grep FAIL "$LOG/test1.log" "$LOG/test2.log" | head -20
fi

if has model; then
    vocab=${KILN_VOCAB_DIR:-$B/vocab}
    [ -d "$vocab" ] || vocab=/work/shared/testdata/tokenizer-vectors
    tm0=$(date +%s)
    "$B/test_cuda_model" "$vocab" >"$LOG/model.log" 2>"$LOG/model.err"; rm_=$?
    echo "test_cuda_model: rc=$rm_, $(( $(date +%s) - tm0 )) s"
    [ $rm_ -eq 0 ] || { status=1; tail -20 "$LOG/model.err"; }
fi

cli_summary="not run"
if has cli; then
    M=${TMPDIR:-/tmp}/kiln-cli-model
    rm -rf "$M"
    if python3 - "$M" "${KILN_CLI_TOKENIZER:-$B/tok}" "${KILN_CLI_SHAPE:-896,24,14,2,4864}" \
        >"$LOG/cli-make.log" 2>&1 <<'PY'
import shutil, sys
import torch, transformers as tf
out, tok = sys.argv[1], sys.argv[2]
C, L, NH, KVH, FF = (int(x) for x in sys.argv[3].split(","))
cfg = tf.Qwen2Config(hidden_size=C, num_hidden_layers=L, num_attention_heads=NH,
                     num_key_value_heads=KVH, intermediate_size=FF, vocab_size=151936,
                     max_position_embeddings=32768, rms_norm_eps=1e-6, rope_theta=1e6,
                     tie_word_embeddings=True, bos_token_id=None, eos_token_id=151643)
torch.manual_seed(0)
m = tf.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
with torch.no_grad():  # norms and biases away from 1 and 0 so that they matter
    for n, p in m.named_parameters():
        if "norm" in n or n.endswith(".bias"):
            p.add_(torch.randn_like(p) * 0.1)
m.save_pretrained(out)
for f in ("tokenizer.json", "tokenizer_config.json"):
    shutil.copy(f"{tok}/{f}", out)
PY
    then
        for dev in cpu cuda; do
            "$B/kiln" generate -m "$M" -p "The quick brown fox jumps over the lazy dog." -n 64 \
                --temp 0 --ignore-eos --json --device "$dev" >"$LOG/cli-$dev.json" 2>"$LOG/cli-$dev.err"
            echo "kiln generate --device $dev: rc=$?"
        done
        cli_summary=$(python3 - "$LOG/cli-cpu.json" "$LOG/cli-cuda.json" <<'PY'
import json, sys
try:
    a, b = (json.load(open(p)) for p in sys.argv[1:3])
except ValueError as e:
    print(f"a run gave no JSON ({e}); see cli-cpu.err, cli-cuda.err")
    sys.exit(1)
same = a["ids"] == b["ids"] and a["text"] == b["text"]
print(f"{len(a['ids'])} greedy ids, cpu == cuda: {same}")
for name, r in (("cpu", a), ("cuda", b)):
    t = {k: round(v, 4) for k, v in r.items() if k.endswith(("_seconds", "_per_s"))}
    print(f"  {name}: {json.dumps(t)}")
sys.exit(0 if same else 1)
PY
) || status=1
    else
        tail -5 "$LOG/cli-make.log"
        cli_summary="model not made (python3 with torch and transformers needed)"
    fi
fi

san="not run"
if has sanitizer && command -v compute-sanitizer >/dev/null; then
    timeout 120 compute-sanitizer --tool memcheck --error-exitcode 3 "$B/test_cuda_ops" 5 \
        >"$LOG/memcheck.log" 2>&1
    m=$?
    timeout 120 compute-sanitizer --tool racecheck --error-exitcode 3 "$B/test_cuda_ops" 6 \
        >"$LOG/racecheck.log" 2>&1
    rc=$?
    if has model; then
        timeout 300 compute-sanitizer --tool memcheck --error-exitcode 3 "$B/test_cuda_model" \
            "$vocab" --no-big >"$LOG/model-memcheck.log" 2>&1
        echo "memcheck test_cuda_model --no-big: rc=$? $(grep -o 'ERROR SUMMARY.*' "$LOG/model-memcheck.log" | head -1)"
    fi
    san="memcheck rc=$m ($(grep -c 'Invalid\|ERROR SUMMARY: [1-9]' "$LOG/memcheck.log") findings), racecheck rc=$rc ($(grep -o 'RACECHECK SUMMARY.*' "$LOG/racecheck.log" | head -1))"
    tail -3 "$LOG/memcheck.log"
    tail -3 "$LOG/racecheck.log"
fi

if has bench; then "$B/bench_cuda_matmul" >"$LOG/bench.log" 2>&1 || status=1; fi

echo
echo "==== GPU check summary ===="
if has ops; then
    echo "op tests, seed default (rc=$r1):"
    sed -n '/^op /,$p' "$LOG/test1.log"
    echo "op tests, seed $seed2 (rc=$r2): $(tail -1 "$LOG/test2.log")"
fi
echo "compute-sanitizer: $san"
has bench && sed -n '/^BENCH/,$p' "$LOG/bench.log"
if has model; then
    echo "whole models, CUDA context vs CPU context (rc=$rm_):"
    cat "$LOG/model.log"
fi
has cli && echo "kiln generate, random Qwen2.5-0.5B-shaped bf16 model: $cli_summary"
[ $status -eq 0 ] && echo "GPU CHECK PASSED" || echo "GPU CHECK FAILED"
exit $status
