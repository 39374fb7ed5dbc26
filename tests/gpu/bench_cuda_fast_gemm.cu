/*
 * bench_cuda_fast_gemm.cu -- the fast mode's prefill GEMMs (src/ops/cuda/cuda_matmul.h)
 * against the bf16 matrix rate measured in the same run.
 *
 * First the rate: a square bf16 x bf16 -> f32 product (8192^3) through kiln_cuda_gemm_bf16,
 * i.e. cuBLASLt with the algorithm the handle picks (the same path every linear ends in), in
 * TFLOP/s (2 * M * N * K per call). Then kiln_cuda_gemm_linear on prefill shapes of
 * Qwen2.5-0.5B, Qwen2.5-1.5B and Llama-3.2-3B at N = 512 and 4096 tokens, bf16 weights (q4_k
 * for a few): "us" is the whole call (x rounded to bf16, q4_k weights dequantized, the
 * product), "us bf16-x" the same with x already bf16 (kiln_cuda_gemm_linear_bf16: the
 * product, plus the weight conversion for q4_k). TFLOP/s and "% rate" are for "us".
 *
 * Data are random, generated on the device. Times: CUDA events around `reps` back-to-back
 * calls on one stream, median of 5 such runs, after 2 warm-up calls.
 * Usage: bench_cuda_fast_gemm [--quick]   (quick: N = 512 only, fewer repetitions)
 */
#include "ops/cuda/cuda_matmul.h"

#include <algorithm>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <vector>

#include "gpu_test_cuda_check.h"

static kiln_cuda_gemm *g_gemm;
static cudaStream_t g_s;

#define GEMM_OK(call)                                                                          \
    do {                                                                                       \
        cudaError_t e_ = (call);                                                               \
        if (e_ != cudaSuccess) {                                                               \
            fprintf(stderr, "%s:%d: %s: %s: %s\n", __FILE__, __LINE__, #call,                  \
                    cudaGetErrorString(e_), kiln_cuda_gemm_error(g_gemm));                     \
            exit(1);                                                                           \
        }                                                                                      \
    } while (0)

static __device__ uint32_t hash32(uint64_t x) {
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdull;
    x ^= x >> 33;
    x *= 0xc4ceb9fe1a85ec53ull;
    x ^= x >> 33;
    return (uint32_t)x;
}

/* kind 0: f32 in [-1, 1); 1: bf16 in [-1, 1) (truncated); 2: q4_k blocks (random bytes, the
 * two fp16 scales d, dmin in [2^-8, 2^-7) and [2^-9, 2^-8)). n: floats, bf16s, or blocks. */
static __global__ void fill_kernel(void *p, size_t n, int kind, uint64_t seed) {
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
        const uint32_t h = hash32(seed * 0x9e3779b97f4a7c15ull + i);
        const float f = (float)(int32_t)h * 0x1p-31f;
        if (kind == 0) {
            ((float *)p)[i] = f;
        } else if (kind == 1) {
            ((uint16_t *)p)[i] = (uint16_t)(__float_as_uint(f) >> 16);
        } else {
            uint8_t *b = (uint8_t *)p + i * 144;
            for (int j = 0; j < 144; j += 4) {
                const uint32_t r = hash32(seed ^ (i * 144 + (size_t)j) * 0x2545f4914f6cdd1dull);
                memcpy(b + j, &r, 4);
            }
            const uint16_t d = (uint16_t)(0x1c00u | (h & 0x3ffu));
            const uint16_t dmin = (uint16_t)(0x1800u | ((h >> 10) & 0x3ffu));
            memcpy(b, &d, 2);
            memcpy(b + 2, &dmin, 2);
        }
    }
}

static void fill(void *p, size_t n, int kind, uint64_t seed) {
    fill_kernel<<<1024, 256, 0, g_s>>>(p, n, kind, seed);
    CUDA_OK(cudaGetLastError());
    CUDA_OK(cudaStreamSynchronize(g_s));
}

static void *dev_alloc(size_t nbytes) {
    void *p = NULL;
    CUDA_OK(cudaMalloc(&p, nbytes));
    return p;
}

/* Median over 5 runs of the time per call of `reps` back-to-back calls, in microseconds. */
template <typename F> static double time_us(F call, int reps) {
    cudaEvent_t a, b;
    CUDA_OK(cudaEventCreate(&a));
    CUDA_OK(cudaEventCreate(&b));
    call();
    call();
    std::vector<double> t;
    for (int run = 0; run < 5; run++) {
        CUDA_OK(cudaEventRecord(a, g_s));
        for (int i = 0; i < reps; i++) call();
        CUDA_OK(cudaEventRecord(b, g_s));
        CUDA_OK(cudaEventSynchronize(b));
        float ms = 0.0f;
        CUDA_OK(cudaEventElapsedTime(&ms, a, b));
        t.push_back((double)ms * 1000.0 / reps);
    }
    CUDA_OK(cudaEventDestroy(a));
    CUDA_OK(cudaEventDestroy(b));
    std::sort(t.begin(), t.end());
    return t[2];
}

struct shape {
    const char *name;
    int64_t R, C;
    bool q4k; /* also timed with q4_k weights */
};

int main(int argc, char **argv) {
    const bool quick = argc > 1 && strcmp(argv[1], "--quick") == 0;
    int n_dev = 0;
    if (cudaGetDeviceCount(&n_dev) != cudaSuccess || n_dev == 0) {
        printf("no GPU; nothing to measure\n");
        return 0;
    }
    CUDA_OK(cudaSetDevice(0));
    cudaDeviceProp prop;
    CUDA_OK(cudaGetDeviceProperties(&prop, 0));
    if (kiln_cuda_gemm_create(0, &g_gemm) != cudaSuccess) {
        fprintf(stderr, "kiln_cuda_gemm_create: %s\n", kiln_last_error());
        return 1;
    }
    CUDA_OK(cudaStreamCreateWithFlags(&g_s, cudaStreamNonBlocking));
    printf("device: %s, %d SMs%s\n", prop.name, prop.multiProcessorCount, quick ? " (quick)" : "");

    /* the bf16 matrix rate: D(M,N) = A(M,K) B(N,K)^T, the linear's layout */
    const int64_t S = 8192;
    uint16_t *A = (uint16_t *)dev_alloc((size_t)(S * S) * 2), *B = (uint16_t *)dev_alloc((size_t)(S * S) * 2);
    float *D = (float *)dev_alloc((size_t)(S * S) * 4);
    fill(A, (size_t)(S * S), 1, 1);
    fill(B, (size_t)(S * S), 1, 2);
    const double us_sq = time_us([&] {
        GEMM_OK(kiln_cuda_gemm_bf16(g_gemm, g_s, 0, 1, S, S, S, A, S, B, S, D, S, 0));
    }, quick ? 5 : 20);
    const double rate = 2.0 * (double)S * S * S / (us_sq * 1e-6) / 1e12;
    printf("bf16 matrix rate: %lld^3 bf16 x bf16 -> f32: %.1f us, %.1f TFLOP/s\n\n", (long long)S,
           us_sq, rate);
    CUDA_OK(cudaFree(A));
    CUDA_OK(cudaFree(B));
    CUDA_OK(cudaFree(D));

    static const shape shapes[] = {
        {"0.5B q/o 896x896", 896, 896, false},       {"0.5B k/v 128x896", 128, 896, false},
        {"0.5B gate/up 4864x896", 4864, 896, false},  {"0.5B down 896x4864", 896, 4864, false},
        {"1.5B q/o 1536x1536", 1536, 1536, false},   {"1.5B gate/up 8960x1536", 8960, 1536, false},
        {"1.5B down 1536x8960", 1536, 8960, true},   {"3B q/o 3072x3072", 3072, 3072, false},
        {"3B k/v 1024x3072", 1024, 3072, false},     {"3B gate/up 8192x3072", 8192, 3072, true},
        {"3B down 3072x8192", 3072, 8192, false},
    };
    static const int Ns_full[] = {512, 4096}, Ns_quick[] = {512};
    const int *Ns = quick ? Ns_quick : Ns_full;
    const int n_Ns = quick ? 1 : 2;

    printf("%-24s %-5s %5s %10s %12s %9s %7s\n", "shape (R x C)", "dtype", "N", "us", "us bf16-x",
           "TFLOP/s", "% rate");
    for (const shape &sh : shapes) {
        for (int ni = 0; ni < n_Ns; ni++) {
            const int N = Ns[ni];
            const int64_t R = sh.R, C = sh.C;
            float *x = (float *)dev_alloc((size_t)N * (size_t)C * 4);
            uint16_t *xb = (uint16_t *)dev_alloc((size_t)N * (size_t)C * 2);
            float *out = (float *)dev_alloc((size_t)N * (size_t)R * 4);
            fill(x, (size_t)N * (size_t)C, 0, 3);
            GEMM_OK(kiln_cuda_f32_to_bf16(g_s, xb, C, x, C, N, C));
            for (int q = 0; q < (sh.q4k ? 2 : 1); q++) {
                const kiln_dtype dt = q ? KILN_DTYPE_Q4_K : KILN_DTYPE_BF16;
                const size_t rb = q ? (size_t)(C / 256) * 144 : (size_t)C * 2;
                uint8_t *w = (uint8_t *)dev_alloc(rb * (size_t)R);
                if (q)
                    fill(w, (size_t)R * (size_t)(C / 256), 2, 4);
                else
                    fill(w, (size_t)R * (size_t)C, 1, 4);
                const int reps = quick ? 5 : (N >= 4096 ? 10 : 30);
                const double us = time_us([&] {
                    GEMM_OK(kiln_cuda_gemm_linear(g_gemm, g_s, out, x, w, rb, dt, R, C, NULL, N, 0));
                }, reps);
                const double us_b = time_us([&] {
                    GEMM_OK(kiln_cuda_gemm_linear_bf16(g_gemm, g_s, out, xb, C, w, rb, dt, R, C,
                                                       NULL, N, 0));
                }, reps);
                const double tf = 2.0 * (double)N * (double)R * (double)C / (us * 1e-6) / 1e12;
                printf("%-24s %-5s %5d %10.1f %12.1f %9.1f %6.1f%%\n", sh.name, q ? "q4_k" : "bf16",
                       N, us, us_b, tf, 100.0 * tf / rate);
                CUDA_OK(cudaFree(w));
            }
            CUDA_OK(cudaFree(x));
            CUDA_OK(cudaFree(xb));
            CUDA_OK(cudaFree(out));
        }
    }
    printf("\ncached algorithms: %d\n", kiln_cuda_gemm_cached(g_gemm));
    CUDA_OK(cudaStreamDestroy(g_s));
    kiln_cuda_gemm_free(g_gemm);
    return 0;
}
