/*
 * bench_cuda_matmul.cu -- decode (N = 1) matmul of the CUDA backend (auditable mode) on
 * Qwen2.5-like shapes in f32 / bf16 / q8_0 / q4_k, against the device-to-device copy
 * bandwidth measured in the same run (bytes read + bytes written, as the roofline counts).
 *
 * Weights are random, generated on the device (finite values, moderate block scales), in
 * enough copies that the rotation among them does not fit the L2 cache. Times are CUDA
 * events around 200 back-to-back calls, the median of 5 such runs; "op" goes through the
 * backend's table (host-side checks included), "kernel" calls the launcher directly.
 * Usage: bench_cuda_matmul [--quick]
 */
#include "ops/cuda/cuda_matmul.h"

#include <algorithm>
#include <stdio.h>
#include <string.h>
#include <vector>

extern "C" int kiln_cuda_matmul_step;

extern "C" {
#include "base/tensor.h"
}

#include "gpu_test_cuda_check.h"

static __device__ uint32_t hash32(uint64_t x) {
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdull;
    x ^= x >> 33;
    x *= 0xc4ceb9fe1a85ec53ull;
    x ^= x >> 33;
    return (uint32_t)x;
}

/* Random bytes, then valid values where the format needs them: plain types get finite
 * values in [-1, 1], quantized blocks fp16 scales in [2^-10, 2^-5]. */
static __global__ void fill_kernel(uint8_t *w, size_t nbytes, int dt, int type_size,
                                   uint64_t seed) {
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < nbytes / 4;
         i += (size_t)gridDim.x * blockDim.x) {
        uint32_t h = hash32(seed * 0x9e3779b97f4a7c15ull + i);
        if (dt == KILN_DTYPE_F32) {
            ((float *)w)[i] = (float)(int32_t)h * 0x1p-31f;
        } else if (dt == KILN_DTYPE_BF16) { /* two bf16 with exponents <= 127: |v| < 2 */
            h &= 0xbfffbfffu;
            memcpy(w + 4 * i, &h, 4);
        } else {
            memcpy(w + 4 * i, &h, 4);
        }
    }
    if (dt == KILN_DTYPE_F32 || dt == KILN_DTYPE_BF16) return;
    size_t nblk = nbytes / (size_t)type_size;
    for (size_t b = (size_t)blockIdx.x * blockDim.x + threadIdx.x; b < nblk;
         b += (size_t)gridDim.x * blockDim.x) {
        uint8_t *p = w + b * (size_t)type_size;
        uint16_t d = (uint16_t)(0x1400u + (hash32(seed + b) & 0x3ffu)); /* 2^-10 .. 2^-9 */
        int off = dt == KILN_DTYPE_Q6_K ? 208 : 0;
        p[off] = (uint8_t)d;
        p[off + 1] = (uint8_t)(d >> 8);
        if (dt == KILN_DTYPE_Q4_K) {
            p[2] = (uint8_t)d;
            p[3] = (uint8_t)(d >> 8);
        }
    }
}

struct shape { const char *name; int64_t R, C; };

static float median(std::vector<float> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
}

int main(int argc, char **argv) {
    bool quick = argc > 1 && strcmp(argv[1], "--quick") == 0;
    kiln_backend *be = NULL;
    if (kiln_backend_cuda_create(0, &be) != KILN_OK) {
        printf("no CUDA backend: %s\n", kiln_last_error());
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
    size_t cb = (size_t)2 << 30;
    void *a, *b;
    CUDA_OK(cudaMalloc(&a, cb));
    CUDA_OK(cudaMalloc(&b, cb));
    fill_kernel<<<4096, 256, 0, st>>>((uint8_t *)a, cb, KILN_DTYPE_Q8_0, 34, 1);
    CUDA_OK(cudaGetLastError());
    for (int w = 0; w < 3; w++) CUDA_OK(cudaMemcpyAsync(b, a, cb, cudaMemcpyDeviceToDevice, st));
    std::vector<float> ct;
    for (int r = 0; r < 5; r++) {
        CUDA_OK(cudaEventRecord(e0, st));
        for (int k = 0; k < 5; k++) CUDA_OK(cudaMemcpyAsync(b, a, cb, cudaMemcpyDeviceToDevice, st));
        CUDA_OK(cudaEventRecord(e1, st));
        CUDA_OK(cudaEventSynchronize(e1));
        float ms;
        CUDA_OK(cudaEventElapsedTime(&ms, e0, e1));
        ct.push_back(ms / 5);
    }
    double copy_gbs = 2.0 * (double)cb / (median(ct) * 1e-3) / 1e9;
    printf("d2d copy: %.0f GB/s (read + write)\n", copy_gbs);
    CUDA_OK(cudaFree(a));
    CUDA_OK(cudaFree(b));

    const shape shapes[] = {{"q/o 896x896", 896, 896},
                            {"gate/up 4864x896", 4864, 896},
                            {"down 896x4864", 896, 4864},
                            {"lm_head 151936x896", 151936, 896},
                            {"1.5B down 1536x8960", 1536, 8960}};
    const kiln_dtype dts[] = {KILN_DTYPE_F32, KILN_DTYPE_BF16, KILN_DTYPE_Q8_0, KILN_DTYPE_Q4_K};
    float *x, *out;
    CUDA_OK(cudaMalloc(&x, 16384 * 4));
    CUDA_OK(cudaMalloc(&out, 151936 * 4));
    fill_kernel<<<64, 256, 0, st>>>((uint8_t *)x, 16384 * 4, KILN_DTYPE_F32, 4, 7);
    CUDA_OK(cudaStreamSynchronize(st));
    cudaStream_t bst = st; /* the "op" path uses the backend's own stream; timed by events
                              recorded after a full sync, so both see the same device */

    printf("\n%-22s %-5s %9s %9s %8s %9s %8s %9s\n", "shape (R x C)", "dtype", "MB", "op us",
           "op GB/s", "kern us", "kern %copy", "step32 us");
    char rows[64][160];
    int nrows = 0;
    for (const shape &sh : shapes) {
        for (kiln_dtype dt : dts) {
            const kiln_dtype_traits *tr = kiln_dtype_get_traits(dt);
            if (sh.C % tr->block_size) continue;
            size_t rb = (size_t)(sh.C / tr->block_size) * tr->type_size, nb = rb * sh.R;
            int copies = (int)std::min<size_t>(64, std::max<size_t>(2, ((size_t)600 << 20) / nb));
            if (quick) copies = std::min(copies, 4);
            std::vector<uint8_t *> ws(copies);
            std::vector<kiln_tensor> ts(copies);
            for (int k = 0; k < copies; k++) {
                CUDA_OK(cudaMalloc(&ws[k], nb + 16));
                fill_kernel<<<2048, 256, 0, st>>>(ws[k], nb, dt, tr->type_size, 100 + k);
                CUDA_OK(cudaGetLastError());
                ts[k] = kiln_tensor{"w", dt, 2, {sh.R, sh.C, 1, 1}, ws[k], nb};
            }
            CUDA_OK(cudaStreamSynchronize(st));
            const int iters = quick ? 20 : 200;
            std::vector<float> top, tk, tk32;
            for (int rep = 0; rep < 6; rep++) { /* rep 0 is the warm-up */
                /* op path: through the table, on the backend's stream; bracketed by full
                 * syncs, timed with events on the legacy stream around it */
                CUDA_OK(cudaDeviceSynchronize());
                CUDA_OK(cudaEventRecord(e0, 0));
                for (int it = 0; it < iters; it++)
                    be->i->matmul(be, out, x, &ts[it % copies], NULL, 1);
                if (kiln_backend_status(be) != KILN_OK) {
                    printf("FAIL: %s\n", kiln_last_error());
                    return 1;
                }
                CUDA_OK(cudaEventRecord(e1, 0));
                CUDA_OK(cudaEventSynchronize(e1));
                float ms;
                CUDA_OK(cudaEventElapsedTime(&ms, e0, e1));
                if (rep) top.push_back(ms * 1e3f / iters);
                /* kernel path */
                CUDA_OK(cudaEventRecord(e0, bst));
                for (int it = 0; it < iters; it++)
                    CUDA_OK(kiln_cuda_matmul(bst, out, x, ws[it % copies], rb, dt, sh.R, sh.C,
                                             NULL, 1));
                CUDA_OK(cudaEventRecord(e1, bst));
                CUDA_OK(cudaEventSynchronize(e1));
                CUDA_OK(cudaEventElapsedTime(&ms, e0, e1));
                if (rep) tk.push_back(ms * 1e3f / iters);
                /* kernel path, load-ahead depth 32 (the default picks per dtype) */
                kiln_cuda_matmul_step = 32;
                CUDA_OK(cudaEventRecord(e0, bst));
                for (int it = 0; it < iters; it++)
                    CUDA_OK(kiln_cuda_matmul(bst, out, x, ws[it % copies], rb, dt, sh.R, sh.C,
                                             NULL, 1));
                CUDA_OK(cudaEventRecord(e1, bst));
                CUDA_OK(cudaEventSynchronize(e1));
                CUDA_OK(cudaEventElapsedTime(&ms, e0, e1));
                kiln_cuda_matmul_step = 0;
                if (rep) tk32.push_back(ms * 1e3f / iters);
            }
            double us_op = median(top), us_k = median(tk), us_k32 = median(tk32);
            double gbs_op = nb / (us_op * 1e-6) / 1e9, gbs_k = nb / (us_k * 1e-6) / 1e9;
            snprintf(rows[nrows], sizeof rows[0],
                     "%-22s %-5s %9.2f %9.2f %8.0f %9.2f %7.1f%% %9.2f", sh.name,
                     kiln_dtype_name(dt), nb / 1e6, us_op, gbs_op, us_k,
                     100.0 * gbs_k / copy_gbs, us_k32);
            printf("%s\n", rows[nrows]);
            nrows++;
            for (int k = 0; k < copies; k++) CUDA_OK(cudaFree(ws[k]));
        }
    }
    CUDA_OK(cudaFree(x));
    CUDA_OK(cudaFree(out));
    kiln_backend_free(be);
    printf("\nBENCH decode matmul (N=1), auditable mode; d2d copy %.0f GB/s\n", copy_gbs);
    printf("%-22s %-5s %9s %9s %8s %9s %8s %9s\n", "shape (R x C)", "dtype", "MB", "op us",
           "op GB/s", "kern us", "kern %copy", "step32 us");
    for (int i = 0; i < nrows; i++) printf("%s\n", rows[i]);
    return 0;
}
