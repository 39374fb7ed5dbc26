#!/usr/bin/env bash
# Builds llama.cpp's CUDA peer for the GPU benchmarks: llama-bench (bench_gpu.py --llama-bench)
# and, with --server, llama-server (bench_serve.py's KILN_LLAMA_SERVER), from the llama.cpp
# vendored in the pinned llama-cpp-python sdist (bench/requirements-bench.txt), for sm_90
# (H100 / H200), statically linked to ggml, so the binaries can be carried to the GPU machine.
#
#   bench/build-llama-cuda.sh [--server] [OUT_DIR]     # default OUT_DIR: build-llama-cuda
#
# Needs nvcc (the CUDA toolkit) and CMake, not a GPU: on a 2-core machine without one it takes
# about an hour (the ggml-cuda template instances), on the 16-core GPU machine minutes.
# CPU flags are the portable AVX2 set (no -march=native): the binary runs on either machine.
# The binaries need libcudart, libcublas and libcuda of a CUDA 13 runtime at run time (and
# libnccl where the toolkit has NCCL: ggml links it when found; torch's wheels carry one).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
targets=(llama-bench)
out=""
for a in "$@"; do
    case "$a" in
        --server) targets+=(llama-server) ;;
        -*) echo "build-llama-cuda: unknown option $a" >&2; exit 2 ;;
        *) out="$a" ;;
    esac
done
out="$(realpath -m "${out:-build-llama-cuda}")"
pin="$(grep -E '^llama-cpp-python==' "$here/requirements-bench.txt")"
src="$out/src"
mkdir -p "$src"
if [ ! -d "$src/llama_cpp_python-${pin#*==}" ]; then
    python3 -m pip download --no-deps --no-binary :all: "$pin" -d "$src"
    tar xzf "$src/llama_cpp_python-${pin#*==}.tar.gz" -C "$src"
fi
lcpp="$src/llama_cpp_python-${pin#*==}/vendor/llama.cpp"
cmake -S "$lcpp" -B "$out/build" -DCMAKE_BUILD_TYPE=Release \
    -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DBUILD_SHARED_LIBS=OFF \
    -DGGML_NATIVE=OFF -DGGML_CPU_ALL_VARIANTS=OFF -DGGML_BACKEND_DL=OFF \
    -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=OFF \
    -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF -DLLAMA_CURL=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=ON \
    -DLLAMA_BUILD_APP=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF \
    -DLLAMA_BUILD_SERVER="$([ ${#targets[@]} -gt 1 ] && echo ON || echo OFF)"
cmake --build "$out/build" --target "${targets[@]}" -j"$(nproc)"
mkdir -p "$out/bin"
for t in "${targets[@]}"; do
    cp "$out/build/bin/$t" "$out/bin/" && strip "$out/bin/$t"
done
echo "build-llama-cuda: $(ls "$out/bin") in $out/bin (${pin}, sm_90)"
