/*
 * bench_cuda_fast_matvec.cu -- the fast-mode decode matvec (kiln_cuda_matvec_fast) on the
 * matrices of Qwen2.5-0.5B / -1.5B and Llama-3.2-3B, against the device-to-device copy
 * bandwidth measured in the same run (bytes read + bytes written, as the roofline counts).
 *
 * Weights are random (finite values, valid moderate block scales), generated on the device
 * in enough copies that the calls rotate over >= 256 MB of weights, more than the 50 MB L2.
 * Time per call: CUDA events around 200 back-to-back calls (50 with --quick), the median of
 * 5 such runs after a warm-up run. GB/s counts the weight bytes read once per call.
 * Q8_0 / Q4_0 / Q4_1 are timed twice: the f32 kernel (kiln_cuda_matvec_fast, "f32": fast
 * decode's default) and the int8-activation product (kiln_cuda_q8act_multi_norm, "i8": the
 * CPU fast mode's bits, fast decode's with KILN_CUDA_Q8ACT=1); Q4_K / Q5_K / Q6_K / Q5_0 the f32
 * kernel (fast decode's with KILN_CUDA_KQ=0) and the K-quant int8-activation product
 * (kiln_cuda_kq_multi_norm, "i8": fast decode's default).
 * Usage: bench_cuda_fast_matvec [--quick] [DTYPE ...]   (dtype names: only those, e.g. q4_k)
 */
#include "ops/cuda/cuda_matmul.h"

extern "C" {
#include "base/base.h"
#include "base/tensor.h"
}

#include <algorithm>
#include <stdio.h>
#include <string.h>
#include <string>
#include <vector>

#include "gpu_test_cuda_check.h"

static __device__ uint32_t hash32(uint64_t x) {
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdull;
    x ^= x >> 33;
    x *= 0xc4ceb9fe1a85ec53ull;
    x ^= x >> 33;
    return (uint32_t)x;
}

/* Random words, then valid values where the format needs them: f32 in [-1, 1), bf16 / f16
 * with small exponents (finite), quantized blocks fp16 scales (and mins) in [2^-10, 2^-9). */
static __global__ void fill_kernel(uint8_t *w, size_t nbytes, int dt, int type_size,
                                   uint64_t seed) {
    const size_t stride = (size_t)gridDim.x * blockDim.x;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < nbytes / 4; i += stride) {
        uint32_t h = hash32(seed * 0x9e3779b97f4a7c15ull + i);
        if (dt == KILN_DTYPE_F32) h = __float_as_uint((float)(int32_t)h * 0x1p-31f);
        else if (dt == KILN_DTYPE_BF16) h &= 0xbfffbfffu; /* |v| < 2 */
        else if (dt == KILN_DTYPE_F16) h &= 0xbbffbbffu;  /* exponent field < 31: finite */
        memcpy(w + 4 * i, &h, 4);
    }
    if (type_size <= 4) return;
    for (size_t b = (size_t)blockIdx.x * blockDim.x + threadIdx.x; b < nbytes / type_size;
         b += stride) {
        uint8_t *p = w + b * (size_t)type_size;
        const uint16_t d = (uint16_t)(0x1400u + (hash32(seed + b) & 0x3ffu));
        const int off = dt == KILN_DTYPE_Q6_K ? 208 : 0;
        p[off] = (uint8_t)d, p[off + 1] = (uint8_t)(d >> 8);
        if (dt == KILN_DTYPE_Q4_1 || dt == KILN_DTYPE_Q5_1 || dt == KILN_DTYPE_Q4_K ||
            dt == KILN_DTYPE_Q5_K)
            p[2] = (uint8_t)d, p[3] = (uint8_t)(d >> 8);
    }
}

struct shape {
    const char *name;
    int64_t R, C;
};

static float median(std::vector<float> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
}

int main(int argc, char **argv) {
    bool quick = false;
    const char *only[16];
    int n_only = 0;
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--quick") == 0) quick = true;
        else if (n_only < 16) only[n_only++] = argv[i];
    }
    int ndev = 0;
    if (cudaGetDeviceCount(&ndev) != cudaSuccess || ndev == 0) {
        printf("no CUDA device: skipped\n");
        return 77;
    }
    cudaDeviceProp prop;
    CUDA_OK(cudaGetDeviceProperties(&prop, 0));
    printf("device: %s, %d SMs, L2 %d MB\n", prop.name, prop.multiProcessorCount,
           prop.l2CacheSize >> 20);
    cudaStream_t st;
    CUDA_OK(cudaStreamCreate(&st));
    cudaEvent_t e0, e1;
    CUDA_OK(cudaEventCreate(&e0));
    CUDA_OK(cudaEventCreate(&e1));

    /* device-to-device copy bandwidth: 2 GiB copied, bytes read + written */
    const size_t cb = (size_t)2 << 30;
    uint8_t *ca, *cbuf;
    CUDA_OK(cudaMalloc(&ca, cb));
    CUDA_OK(cudaMalloc(&cbuf, cb));
    fill_kernel<<<4096, 256, 0, st>>>(ca, cb, KILN_DTYPE_Q8_0, 34, 1);
    CUDA_OK(cudaGetLastError());
    for (int k = 0; k < 3; k++) CUDA_OK(cudaMemcpyAsync(cbuf, ca, cb, cudaMemcpyDeviceToDevice, st));
    std::vector<float> ct;
    for (int rep = 0; rep < 5; rep++) {
        CUDA_OK(cudaEventRecord(e0, st));
        for (int k = 0; k < 5; k++)
            CUDA_OK(cudaMemcpyAsync(cbuf, ca, cb, cudaMemcpyDeviceToDevice, st));
        CUDA_OK(cudaEventRecord(e1, st));
        CUDA_OK(cudaEventSynchronize(e1));
        float ms;
        CUDA_OK(cudaEventElapsedTime(&ms, e0, e1));
        ct.push_back(ms / 5);
    }
    const double copy_gbs = 2.0 * (double)cb / (median(ct) * 1e-3) / 1e9;
    printf("d2d copy: %.0f GB/s (read + write, 2 GiB)\n", copy_gbs);
    CUDA_OK(cudaFree(ca));
    CUDA_OK(cudaFree(cbuf));

    const shape full[] = {{"0.5B q 896x896", 896, 896},
                          {"0.5B gate/up 4864x896", 4864, 896},
                          {"0.5B down 896x4864", 896, 4864},
                          {"0.5B lm_head 151936x896", 151936, 896},
                          {"1.5B down 1536x8960", 1536, 8960},
                          {"3B q 3072x3072", 3072, 3072},
                          {"3B gate 8192x3072", 8192, 3072},
                          {"3B down 3072x8192", 3072, 8192},
                          {"3B lm_head 128256x3072", 128256, 3072}};
    const shape quick_shapes[] = {{"0.5B q 896x896", 896, 896},
                                  {"0.5B down 896x4864", 896, 4864},
                                  {"3B gate 8192x3072", 8192, 3072}};
    const kiln_dtype full_dts[] = {KILN_DTYPE_BF16, KILN_DTYPE_F16,  KILN_DTYPE_Q8_0, KILN_DTYPE_Q5_0,
                                   KILN_DTYPE_Q4_0, KILN_DTYPE_Q4_1, KILN_DTYPE_Q4_K,
                                   KILN_DTYPE_Q5_K, KILN_DTYPE_Q6_K};
    const kiln_dtype quick_dts[] = {KILN_DTYPE_BF16, KILN_DTYPE_Q8_0, KILN_DTYPE_Q4_0,
                                    KILN_DTYPE_Q4_K};
    const shape *shapes = quick ? quick_shapes : full;
    const int n_shapes = quick ? 3 : 9;
    const kiln_dtype *dts = quick ? quick_dts : full_dts;
    const int n_dts = quick ? 4 : 9;
    const int iters = quick ? 50 : 200;

    const int64_t maxC = 8960, maxR = 151936;
    float *x, *out;
    CUDA_OK(cudaMalloc(&x, (size_t)8 * maxC * 4));
    CUDA_OK(cudaMalloc(&out, (size_t)8 * maxR * 4));
    fill_kernel<<<64, 256, 0, st>>>((uint8_t *)x, (size_t)8 * maxC * 4, KILN_DTYPE_F32, 4, 7);
    CUDA_OK(cudaGetLastError());
    CUDA_OK(cudaMemset(out, 0, (size_t)8 * maxR * 4));

    const char *hdr = "%-24s %-5s %-4s %2s %2s %9s %9s %8s %8s\n";
    printf("\n");
    printf(hdr, "shape (R x C)", "dtype", "kern", "N", "S", "MB", "us", "GB/s", "% copy");
    std::vector<std::string> rows;
    for (int si = 0; si < n_shapes; si++) {
        const shape &sh = shapes[si];
        for (int di = 0; di < n_dts; di++) {
            const kiln_dtype dt = dts[di];
            const kiln_dtype_traits *tr = kiln_dtype_get_traits(dt);
            if (sh.C % tr->block_size) continue;
            const size_t rb = (size_t)(sh.C / tr->block_size) * (size_t)tr->type_size;
            const size_t nb = rb * (size_t)sh.R, pitch = (nb + 255) / 256 * 256;
            const size_t pool_min = (size_t)256 << 20;
            const int copies = (int)std::max<size_t>(2, (pool_min + nb - 1) / nb);
            uint8_t *pool;
            CUDA_OK(cudaMalloc(&pool, pitch * (size_t)copies));
            fill_kernel<<<4096, 256, 0, st>>>(pool, pitch * (size_t)copies, dt, tr->type_size, 100);
            CUDA_OK(cudaGetLastError());
            CUDA_OK(cudaStreamSynchronize(st));
            const bool kq = kiln_cuda_kq_supported(dt);
            if (n_only) {
                bool want = false;
                for (int i = 0; i < n_only; i++) want = want || strcmp(only[i], kiln_dtype_name(dt)) == 0;
                if (!want) continue;
            }
            for (int kern = 0; kern < (kiln_cuda_q8act_supported(dt) || kq ? 2 : 1); kern++)
            for (int N = 1; N <= 8; N += 7) {
                if (N == 8 && dt != KILN_DTYPE_BF16 && kern == 0) continue;
                std::vector<float> t;
                for (int rep = 0; rep < 6; rep++) { /* rep 0 is the warm-up */
                    CUDA_OK(cudaEventRecord(e0, st));
                    for (int it = 0; it < iters; it++) {
                        const uint8_t *w = pool + (size_t)(it % copies) * pitch;
                        const kiln_cuda_product_job job = {out, NULL, w, NULL, NULL, NULL, rb, sh.R};
                        CUDA_OK(kern && kq ? kiln_cuda_kq_multi_norm(st, 1, &job, dt, x, NULL, 0.0f, sh.C, N)
                                : kern ? kiln_cuda_q8act_multi_norm(st, 1, &job, dt, x, NULL, 0.0f, sh.C, N)
                                     : kiln_cuda_matvec_fast(st, out, x, w, rb, dt, sh.R, sh.C, NULL, N, 0));
                    }
                    CUDA_OK(cudaEventRecord(e1, st));
                    CUDA_OK(cudaEventSynchronize(e1));
                    float ms;
                    CUDA_OK(cudaEventElapsedTime(&ms, e0, e1));
                    if (rep) t.push_back(ms * 1e3f / iters);
                }
                const double us = median(t), gbs = (double)nb / (us * 1e-6) / 1e9;
                char line[200];
                snprintf(line, sizeof line, "%-24s %-5s %-4s %2d %2d %9.2f %9.2f %8.0f %7.1f%%",
                         sh.name, kiln_dtype_name(dt), kern ? "i8" : "f32", N,
                         kern ? 1 : kiln_cuda_matvec_fast_split(dt, sh.R, sh.C, N), nb / 1e6, us, gbs,
                         100.0 * gbs / copy_gbs);
                printf("%s\n", line);
                fflush(stdout);
                rows.push_back(line);
            }
            CUDA_OK(cudaFree(pool));
        }
    }
    CUDA_OK(cudaFree(x));
    CUDA_OK(cudaFree(out));
    printf("\nBENCH fast decode matvec, d2d copy %.0f GB/s; %d calls per run, median of 5 runs,\n"
           ">= 256 MB of weights in rotation\n", copy_gbs, iters);
    printf(hdr, "shape (R x C)", "dtype", "kern", "N", "S", "MB", "us", "GB/s", "% copy");
    for (const std::string &r : rows) printf("%s\n", r.c_str());
    return 0;
}
