/*
 * comm_nccl_sum.cu -- the rank-order sums of the nccl communicator (docs/ARITHMETIC.md,
 * "Reductions across ranks"), on the device:
 *   out[i] = (((+0.0f + b_0[i]) + b_1[i]) + ...) + b_{N-1}[i]
 * each + one binary32 round-to-nearest addition (__fadd_rn: never contracted or folded, so
 * +0.0f + -0.0f stays +0.0f), the bits of comm.c's host sum. blocks: (n_ranks, n) floats.
 */
#include <cuda_runtime.h>
#include <stddef.h>

__global__ void rank_order_sum_kernel(float *out, const float *blocks, int n_ranks, size_t n) {
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        float acc = __fadd_rn(0.0f, blocks[i]);
        for (int k = 1; k < n_ranks; k++) acc = __fadd_rn(acc, blocks[(size_t)k * n + i]);
        out[i] = acc;
    }
}

/* Queued on stream; returns the launch's error code (cudaSuccess 0). */
extern "C" int kiln_nccl_rank_order_sum_f32(void *stream, float *out, const float *blocks, int n_ranks, size_t n) {
    if (n == 0) return 0;
    size_t blocks_needed = (n + 255) / 256;
    unsigned grid = blocks_needed > 65535u * 16u ? 65535u * 16u : (unsigned)blocks_needed;
    rank_order_sum_kernel<<<grid, 256, 0, (cudaStream_t)stream>>>(out, blocks, n_ranks, n);
    return (int)cudaGetLastError();
}
