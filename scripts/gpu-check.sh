#!/usr/bin/env bash
# gpu-check.sh -- the GPU check of issues 4 and 5, on a machine with an NVIDIA GPU (H100/H200),
# from a fresh clone: make the build dependencies available (scripts/gpu-deps.sh: installed,
# apt-get, or carried .deb files), build kiln with CUDA (Release, -Werror), run every GPU test
# (tests/gpu/test_cuda_*: auditable ops and backward ops bit for bit against the CPU, the fast
# kernels within their stated error, sampling, the optimizer and fused loss, whole models,
# training; with pytest, the binding's CUDA cases of tests/python/test_linear_ce_api.py and
# generation receipts verified across devices, tests/python/test_receipts.py),
# compute-sanitizer memcheck and racecheck on small runs, the kernel benchmarks
# (tests/gpu/bench_cuda_*), `kiln generate --device cuda` against `--device cpu`, and print a
# short table last.
#   scripts/gpu-check.sh [build-dir]      (default build-gpu; logs under $OUT or build-dir)
#   KILN_GPU_PARTS="tests sanitizer bench cli"   (the parts to run; default all)
#   KILN_BENCH_QUICK=1: the fast-kernel benchmarks with --quick
#   KILN_GPU_TESTS="test_cuda_ops ...": only these tests (default every tests/gpu/test_cuda_*)
#   KILN_GPU_TARGETS="kiln kiln_shared test_cuda_mx ...": build only these CMake targets (default
#       all; a full build takes over 4 minutes on 16 cores, a few targets about one)
#   KILN_SANITIZER_TIMEOUT: seconds per compute-sanitizer run (default 300)
#   KILN_SANITIZER_ONLY="memcheck:test_cuda_train_fast ...": only these sanitizer runs
#   KILN_VOCAB_DIR: the vocabulary GGUFs of the whole-model tests (default
#       ../shared/testdata/tokenizer-vectors, else build-dir/vocab)
#   KILN_DEFAULT_GGUF: kiln's default model (SmolLM2-135M-Instruct Q4_1) for the cli part
#       (default ~/.cache/kiln/models/SmolLM2-135M-Instruct.Q4_1.gguf; scripts/fetch-model.sh)
#   cli also writes a random Qwen2.5-0.5B-shaped Hugging Face folder (bf16, python3 with torch
#   and transformers; KILN_CLI_SHAPE=C,L,NH,KVH,FF) with the tokenizer.json of
#   $KILN_CLI_TOKENIZER (default build-dir/tok; where it has none, a synthetic 151,936-token
#   byte-level BPE written with `tokenizers`) and compares cpu and cuda greedy ids.
# Skips: a GPU is visible when `nvidia-smi -L` lists one (without nvidia-smi, when
# /proc/driver/nvidia/gpus has an entry). Where one is, every test and sanitizer run must run:
# one that exits 77 (skipped), or a pytest run that reports a skipped test, fails the check,
# named in the summary (CUDA_VISIBLE_DEVICES hiding the GPUs from the tests fails it too). Where
# none is, exit 77 stays a skip, listed as such, and does not fail the check.
set -uo pipefail
cd "$(dirname "$0")/.."
B=${1:-build-gpu}
LOG=${OUT:-$B}
mkdir -p "$B" "$LOG"
J=$(nproc)
gen=()
command -v ninja >/dev/null && gen=(-G Ninja)

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ') || gpus=0
if [ "$gpus" -eq 0 ] && [ -d /proc/driver/nvidia/gpus ]; then
    gpus=$(find /proc/driver/nvidia/gpus -mindepth 1 -maxdepth 1 | wc -l)
fi
if [ "$gpus" -gt 0 ]; then
    echo "GPUs visible: $gpus (a skipped test, exit 77 or a pytest skip, fails the check)"
else
    echo "no GPU visible: a test that exits 77 is skipped, not failed"
fi
echo "kiln $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
t0=$(date +%s)
# shellcheck source=scripts/gpu-deps.sh
source scripts/gpu-deps.sh
kiln_gpu_deps "$B" || { echo "BUILD FAILED (dependencies)"; exit 1; }
kiln_gpu_mpi "$B" || echo "mpi: none: the CPU and GPU ranks' test (test_train_gpu_ranks.py) will fail"
if ! { cmake -S . -B "$B" "${gen[@]}" "${KILN_DEPS_CMAKE[@]}" -DKILN_CUDA=ON \
         -DCMAKE_BUILD_TYPE=Release -DKILN_WERROR=ON && cmake --build "$B" -j"$J" \
           ${KILN_GPU_TARGETS:+--target $KILN_GPU_TARGETS}; } \
       >"$LOG/build.log" 2>&1; then
    grep -E "error|Error" "$LOG/build.log" | head -30
    tail -20 "$LOG/build.log"
    echo "BUILD FAILED"
    exit 1
fi
echo "build: $(( $(date +%s) - t0 )) s"

PARTS=${KILN_GPU_PARTS:-tests sanitizer bench cli}
has() { case " $PARTS " in *" $1 "*) return 0 ;; esac; return 1; }
status=0
seed2=$(( $(date +%s) % 100000 + 7 ))
vocab=${KILN_VOCAB_DIR:-../shared/testdata/tokenizer-vectors}
[ -d "$vocab" ] || vocab=$B/vocab
export KILN_VOCAB_DIR=$vocab
summary=()
skipped=() # runs that exited 77 (or a pytest run with a skipped test)

# The folder of NCCL's library for GPU ranks (src/dist/comm_nccl.c dlopens libnccl.so.2): the
# loader's own when it has one, else PyTorch's nvidia-nccl wheel.
nccl_lib_dir() {
    if ldconfig -p 2>/dev/null | grep -q 'libnccl\.so\.2'; then return; fi
    python3 -c 'import os, nvidia.nccl as n; print(os.path.join(list(n.__path__)[0], "lib"))' 2>/dev/null
}

# skip NAME LOG: a run exited 77; with a GPU visible that fails the check, saying which
skip() {
    skipped+=("$1")
    if [ "$gpus" -gt 0 ]; then
        status=1
        echo "---- $1 skipped (rc=77) with $gpus GPU(s) visible: a failure here"
        grep -m 5 -i "skip" "$2"
    fi
}

# run NAME LOGFILE CMD...: run a test, keep its rc and last line for the table
run_test() {
    local name=$1 log=$2
    shift 2
    local ts rc
    ts=$(date +%s)
    "$@" >"$log" 2>&1
    rc=$?
    local last
    last=$(grep -v '^\s*$' "$log" | tail -1 | cut -c1-110)
    summary+=("$(printf '%-34s rc=%-3s %4ss  %s' "$name" "$rc" "$(( $(date +%s) - ts ))" "$last")")
    echo "${summary[${#summary[@]}-1]}"
    if [ $rc -eq 77 ]; then
        skip "$name" "$log"
    elif [ $rc -ne 0 ]; then
        status=1
        echo "---- $name failed (rc=$rc): first failures"
        grep -m 15 -i "fail\|mismatch\|error" "$log"
    fi
}

# pytest_run CMD...: run pytest; exit 77 where it passed but skipped a test (pytest exits 0
# then), so that run_test counts the skip; -rs puts the skip reasons in the log
# shellcheck disable=SC2317  # called through run_test
pytest_run() {
    local out rc
    out=$("$@" 2>&1)
    rc=$?
    printf '%s\n' "$out"
    if [ "$rc" -eq 0 ] && printf '%s\n' "$out" | grep -v '^\s*$' | tail -1 |
        grep -qE '(^|[ ,=])[0-9]+ skipped'; then
        return 77
    fi
    return "$rc"
}

# pytest_cuda NAME MODULES: tests/python/NAME.py -k cuda (its GPU cases) when KILN_GPU_TESTS
# names it or is unset and python3 imports MODULES; else a summary line saying why not
pytest_cuda() {
    case " ${KILN_GPU_TESTS:-$1} " in *" $1 "*) ;; *) return 0 ;; esac
    if python3 -c "import $2" 2>/dev/null; then
        run_test "$1 (pytest -k cuda)" "$LOG/$1.log" pytest_run env KILN_BUILD_DIR="$B" python3 -m pytest -q -rs \
            -p no:cacheprovider -k cuda "tests/python/$1.py"
    else
        summary+=("$1: not run (python3 lacks one of $2)")
        echo "${summary[${#summary[@]}-1]}"
    fi
}

if has tests; then
    for t in "$B"/test_cuda_*; do
        [ -x "$t" ] || continue
        n=$(basename "$t")
        if [ -n "${KILN_GPU_TESTS:-}" ]; then
            case " $KILN_GPU_TESTS " in *" $n "*) ;; *) continue ;; esac
        fi
        case $n in
        test_cuda_ops|test_cuda_backward)
            run_test "$n" "$LOG/$n.log" "$t"
            run_test "$n (seed $seed2)" "$LOG/$n-2.log" "$t" "$seed2" ;;
        test_cuda_model|test_cuda_train|test_cuda_train_fast)
            run_test "$n" "$LOG/$n.log" "$t" "$vocab" ;;
        test_cuda_dp) # GPU ranks over NCCL: PyTorch's nvidia-nccl when the loader finds none
            run_test "$n" "$LOG/$n.log" env LD_LIBRARY_PATH="$(nccl_lib_dir)${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" \
                "$t" "$vocab" ;;
        *)
            run_test "$n" "$LOG/$n.log" "$t" ;;
        esac
    done
    # the serving engine on the GPU: every request against kiln_generate alone, auditable and
    # the batch-invariant fast mode
    case " ${KILN_GPU_TESTS:-test_engine} " in
    *" test_engine "*)
        # its tokenizer: the shared test vocabulary, found as KILN_SHARED_DIR/testdata/tokenizer-vectors
        sh_dir=$(cd "$B" && pwd)/shared-vocab
        mkdir -p "$sh_dir/testdata"
        [ -d "$vocab" ] && ln -sfn "$(cd "$vocab" && pwd)" "$sh_dir/testdata/tokenizer-vectors"
        run_test "test_engine (device 0)" "$LOG/test_engine_cuda.log" env KILN_TEST_DEVICE=0 KILN_SHARED_DIR="$sh_dir" \
            "$B/test_engine" ;;
    esac
    # kiln.torch's cross entropy and the Trainer's torch calls on CUDA tensors
    # the binding's GPU cases, where python3 has what each file imports:
    #   test_torch_interop   kiln.torch on CUDA tensors
    #   test_linear_ce_api   the public fused loss on torch CUDA tensors
    #   test_receipts        receipts made on the CPU and verified on the GPU, and the other way
    #   test_distill         distillation on the GPU: the CPU's bits, fast mode
    #   test_train_gpu_ranks one rank over NCCL (train and distill) equal to the plain GPU run
    #   test_format_rules    formats per weight on CUDA: inference and training, the CPU's bits
    pytest_cuda test_torch_interop "pytest, numpy, torch"
    pytest_cuda test_linear_ce_api "pytest, numpy, torch"
    pytest_cuda test_receipts "pytest, numpy, torch, transformers"
    pytest_cuda test_distill "pytest, numpy, torch, transformers"
    pytest_cuda test_format_rules "pytest, numpy, torch, transformers"
    pytest_cuda test_train_gpu_ranks "pytest, numpy, torch, transformers"
fi

# compare_runs LABEL JSON_A JSON_B...: greedy ids of the first equal to each other's? one line
compare_runs() {
    python3 - "$@" <<'PY'
import json, sys
label, paths = sys.argv[1], sys.argv[2:]
runs = []
for p in paths:
    try:
        runs.append((p.rsplit("/", 1)[-1][:-5], json.load(open(p))))
    except (OSError, ValueError) as e:
        print(f"{label}: {p}: no JSON ({e})")
        sys.exit(1)
ref = runs[0][1]
parts = []
ok = True
for name, r in runs:
    same = r["ids"] == ref["ids"]
    if name.endswith("fast"):
        n = next((i for i, (a, b) in enumerate(zip(r["ids"], ref["ids"])) if a != b), len(r["ids"]))
        parts.append(f"{name}: {r.get('decode_tokens_per_s', 0):.1f} tok/s, first {n} ids = cpu's")
    else:
        ok &= same
        parts.append(f"{name}: {r.get('decode_tokens_per_s', 0):.1f} tok/s, ids {'==' if same else '!='} cpu")
print(f"{label}: {len(ref['ids'])} greedy ids; " + "; ".join(parts))
sys.exit(0 if ok else 1)
PY
}

cli_lines=()
if has cli; then
    prompt="The quick brown fox jumps over the lazy dog."
    gguf=${KILN_DEFAULT_GGUF:-$HOME/.cache/kiln/models/SmolLM2-135M-Instruct.Q4_1.gguf}
    if [ -f "$gguf" ]; then
        runs=()
        for dev in cpu cuda cuda-fast; do
            args=(--device "${dev%-fast}")
            [ "$dev" = cuda-fast ] && args+=(--fast)
            "$B/kiln" generate -m "$gguf" -p "$prompt" -n 128 --temp 0 --ignore-eos --json \
                "${args[@]}" >"$LOG/default-$dev.json" 2>"$LOG/default-$dev.err"
            echo "kiln generate default model --device $dev: rc=$?"
            runs+=("$LOG/default-$dev.json")
        done
        cli_lines+=("$(compare_runs "SmolLM2-135M Q4_1 (default model)" "${runs[@]}")") || status=1
    else
        cli_lines+=("default model: $gguf not found (scripts/fetch-model.sh)")
    fi
    M=${TMPDIR:-/tmp}/kiln-cli-model
    rm -rf "$M"
    if python3 - "$M" "${KILN_CLI_TOKENIZER:-$B/tok}" "${KILN_CLI_SHAPE:-896,24,14,2,4864}" \
        >"$LOG/cli-make.log" 2>&1 <<'PY'
import json, os, shutil, sys
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
if os.path.isfile(f"{tok}/tokenizer.json"):
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(f"{tok}/{f}", out)
else:  # a synthetic byte-level BPE of exactly 151,936 tokens: the 256 byte symbols, every
    # pair of them, then pairs followed by a byte, each merge ranked in that order
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders
    alpha = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab, merges = {c: i for i, c in enumerate(alpha)}, []
    lefts = iter(alpha + [a + b for a in alpha for b in alpha])
    while len(vocab) < 151936:
        a = next(lefts)
        for b in alpha:
            if len(vocab) == 151936:
                break
            vocab[a + b] = len(vocab)
            merges.append((a, b))
    t = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = decoders.ByteLevel()
    t.save(f"{out}/tokenizer.json")
    json.dump({"tokenizer_class": "PreTrainedTokenizerFast"}, open(f"{out}/tokenizer_config.json", "w"))
PY
    then
        runs=()
        for dev in cpu cuda cuda-fast; do
            args=(--device "${dev%-fast}")
            [ "$dev" = cuda-fast ] && args+=(--fast)
            "$B/kiln" generate -m "$M" -p "$prompt" -n 64 --temp 0 --ignore-eos --json \
                "${args[@]}" >"$LOG/qwen-$dev.json" 2>"$LOG/qwen-$dev.err"
            echo "kiln generate qwen-shaped --device $dev: rc=$?"
            runs+=("$LOG/qwen-$dev.json")
        done
        cli_lines+=("$(compare_runs "random Qwen2.5-0.5B-shaped bf16" "${runs[@]}")") || status=1
    else
        tail -5 "$LOG/cli-make.log"
        cli_lines+=("random Qwen2.5-0.5B-shaped model not made (python3 with torch and transformers needed)")
    fi
fi

san=()
if has sanitizer && command -v compute-sanitizer >/dev/null; then
    specs=("memcheck test_cuda_ops 5" "racecheck test_cuda_ops 6"
           "memcheck test_cuda_backward 5" "racecheck test_cuda_backward 6"
           "memcheck test_cuda_fast_matvec" "memcheck test_cuda_model $vocab --no-big"
           "memcheck test_cuda_attention_bwd_fast --no-time"
           "racecheck test_cuda_attention_bwd_fast --no-time"
           "memcheck test_cuda_train_fast $vocab" "memcheck test_cuda_fused_ce_fast --quick"
           "memcheck test_cuda_backward_fast" "memcheck test_cuda_train_ops --no-big"
           "memcheck test_cuda_linear_attn --quick" "racecheck test_cuda_linear_attn --quick")
    for spec in "${specs[@]}"; do
        set -- $spec
        # KILN_SANITIZER_ONLY="tool:binary ...": only these runs
        if [ -n "${KILN_SANITIZER_ONLY:-}" ]; then
            case " $KILN_SANITIZER_ONLY " in *" $1:$2 "*) ;; *) continue ;; esac
        fi
        tool=$1 bin=$2
        shift 2
        [ -x "$B/$bin" ] || continue
        timeout "${KILN_SANITIZER_TIMEOUT:-300}" compute-sanitizer --tool "$tool" --error-exitcode 3 "$B/$bin" "$@" \
            >"$LOG/san-$tool-$bin.log" 2>&1
        rc=$?
        san+=("$(printf '%-10s %-22s rc=%-3s %s' "$tool" "$bin" "$rc" \
            "$(grep -o 'ERROR SUMMARY.*\|RACECHECK SUMMARY.*' "$LOG/san-$tool-$bin.log" | head -1)")")
        if [ $rc -eq 77 ]; then
            skip "$tool $bin" "$LOG/san-$tool-$bin.log"
        elif [ $rc -ne 0 ]; then
            status=1
        fi
    done
fi

if has bench; then
    for b in "$B"/bench_cuda_*; do
        [ -x "$b" ] || continue
        bargs=()
        case $(basename "$b") in bench_cuda_fast_*) [ -n "${KILN_BENCH_QUICK:-}" ] && bargs=(--quick) ;; esac
        timeout 300 "$b" "${bargs[@]}" >"$LOG/$(basename "$b").log" 2>&1 || { status=1; echo "$(basename "$b") failed"; }
    done
fi

echo
echo "==== GPU check summary ===="
for b in "$B"/bench_cuda_*; do
    [ -f "$LOG/$(basename "$b").log" ] || continue
    echo "-- $(basename "$b") (tail)"
    tail -25 "$LOG/$(basename "$b").log"
done
[ ${#san[@]} -gt 0 ] && { echo "-- compute-sanitizer"; printf '%s\n' "${san[@]}"; }
has cli && { echo "-- kiln generate"; printf '%s\n' "${cli_lines[@]}"; }
echo "-- tests (rc 77 = skipped)"
printf '%s\n' "${summary[@]}"
if [ ${#skipped[@]} -gt 0 ]; then
    if [ "$gpus" -gt 0 ]; then
        echo "-- skipped with $gpus GPU(s) visible, each a failure: ${skipped[*]}"
    else
        echo "-- skipped (no GPU visible): ${skipped[*]}"
    fi
fi
[ $status -eq 0 ] && echo "GPU CHECK PASSED" || echo "GPU CHECK FAILED"
exit $status
