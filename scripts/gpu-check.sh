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
#   KILN_GPU_PARTS="ops sanitizer bench model"   (the parts to run; default all)
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

PARTS=${KILN_GPU_PARTS:-ops sanitizer bench model}
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
[ $status -eq 0 ] && echo "GPU CHECK PASSED" || echo "GPU CHECK FAILED"
exit $status
