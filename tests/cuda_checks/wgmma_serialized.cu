/*
 * wgmma_serialized.cu -- a kernel ptxas must serialize, for scripts/check_wgmma_pipelines.py:
 * in a loop, two products in flight, a partial wait (wgmma_wait<1>) that leaves the second
 * one pending, then a read of its accumulators, which ptxas reports as C7514 and answers by
 * making every product wait for itself. (Simpler mistakes it mends with an injected wait or
 * arrive, C7517 / C7519, and does not serialize.)
 * The check compiles this file with the build's flags and fails unless ptxas reports this
 * kernel, so that a change in ptxas's wording cannot make the check pass without checking.
 * Compiled by the check only, never linked into kiln.
 */
#include "../../src/ops/cuda/cuda_wgmma.cuh"

__global__ void __launch_bounds__(128) wgmma_serialized_kernel(float *out, int n) {
#if KILN_WGMMA_DEVICE
    extern __shared__ unsigned char sm[];
    __nv_bfloat16 *tile = sw128_tiles(sm);
    const uint64_t d = sw128_desc(tile);
    float a[32], b[32];
    for (int i = 0; i < 32; i++) a[i] = b[i] = 0.0f;
    float sum = 0.0f;
    for (int j = 0; j < n; j++) {
        wgmma_fence();
        wgmma_ss<0, 0>(a, d, d, 1);
        wgmma_commit();
        wgmma_ss<0, 0>(b, d + 2, d + 2, 1);
        wgmma_commit();
        wgmma_wait<1>(); /* a's product done, b's maybe not */
        for (int i = 0; i < 32; i++) sum += a[i] + b[i]; /* b read in flight */
    }
    wgmma_wait<0>();
    out[threadIdx.x] = sum;
#else
    (void)out;
    (void)n;
#endif
}
