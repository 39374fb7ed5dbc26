/*
 * cuda_backward_fast.cu -- the fast mode's matmul backward (contract and arithmetic:
 * cuda_backward_fast.h): dy, x and W rounded to bf16 once each into a stream-ordered buffer,
 * then dx = dy @ W and dW += dy^T @ x as two bf16 tensor-core products of the GEMM module;
 * dbias by the auditable fixed-order column sum.
 */
#include "cuda_backward_fast.h"

#include "cuda_backward.h"

/* Leading dimension of a bf16 copy: cols rounded up to 8 elements (16 bytes), so every row
 * starts 16-byte aligned (what the tensor-core kernels' vector loads want; the padding is
 * never read: k stops at cols). The GEMM module pads its own copies the same way. */
static int64_t padded_ld(int64_t cols) { return (cols + 7) & ~(int64_t)7; }

/* Bytes of a (rows x ld) bf16 matrix rounded up to 256 (the next region's alignment); false
 * past 2^46 elements (no buffer anyone allocates; keeps every later sum far from overflow). */
static bool region_bytes(int64_t rows, int64_t ld, size_t *out) {
    const int64_t limit = (int64_t)1 << 46;
    if (rows < 0 || ld < 0 || (rows > 0 && ld > limit / rows)) return false;
    *out = ((size_t)(rows * ld) * 2u + 255u) & ~(size_t)255u;
    return true;
}

/* Whether a bf16 W is read in place: its rows start 16-byte aligned (the GEMM module's rule
 * for the forward, bf16_in_place in cuda_gemm_fast.cu). Otherwise it is copied, exactly
 * (bf16 -> f32 -> bf16 is the identity), into the buffer with padded rows. */
static bool bf16_in_place(kiln_dtype dt, const uint8_t *w, size_t row_bytes) {
    return dt == KILN_DTYPE_BF16 && ((uintptr_t)w & 15u) == 0 && row_bytes % 16 == 0;
}

/* The bf16 operands in buf (256-byte aligned): dyb(N, ldR) at 0, xb(N, ldC) at x_off (when dW),
 * W's copy (R, ldC) at w_off (when dx and W is not read in place); then the two products.
 * Arguments already checked; N, R, C >= 1. */
static cudaError_t run_products(kiln_cuda_gemm *g, cudaStream_t s, uint8_t *buf, size_t x_off,
                                size_t w_off, float *dx, float *dW, const float *dy,
                                const float *x, const uint8_t *w, size_t row_bytes, kiln_dtype dt,
                                int64_t R, int64_t C, int N, bool accumulate_dx) {
    const int64_t ldR = padded_ld(R), ldC = padded_ld(C);
    uint16_t *dyb = (uint16_t *)buf;
    cudaError_t e = kiln_cuda_f32_to_bf16(s, dyb, ldR, dy, R, N, R);
    if (e != cudaSuccess) return e;
    if (dx) { /* dx(N,C) (+)= dy(N,R) @ W(R,C): M = N, N = C, K = R */
        const uint16_t *wb;
        int64_t ldw;
        if (bf16_in_place(dt, w, row_bytes)) {
            wb = (const uint16_t *)w;
            ldw = (int64_t)(row_bytes / 2);
        } else {
            uint16_t *dst = (uint16_t *)(buf + w_off);
            e = kiln_cuda_weights_to_bf16(s, dst, ldC, w, row_bytes, dt, R, C);
            if (e != cudaSuccess) return e;
            wb = dst;
            ldw = ldC;
        }
        e = kiln_cuda_gemm_bf16(g, s, 0, 0, N, C, R, dyb, ldR, wb, ldw, dx, C,
                                accumulate_dx ? 1 : 0);
        if (e != cudaSuccess) return e;
    }
    if (dW) { /* dW(R,C) += dy^T(R,N) @ x(N,C): A = dy stored (N,R), trans_a; K = N */
        uint16_t *xb = (uint16_t *)(buf + x_off);
        e = kiln_cuda_f32_to_bf16(s, xb, ldC, x, C, N, C);
        if (e != cudaSuccess) return e;
        e = kiln_cuda_gemm_bf16(g, s, 1, 0, R, C, N, dyb, ldR, xb, ldC, dW, C, 1);
        if (e != cudaSuccess) return e;
    }
    return cudaSuccess;
}

cudaError_t kiln_cuda_matmul_backward_fast(kiln_cuda_gemm *g, cudaStream_t s, float *dx,
                                           float *dW, float *dbias, const float *dy,
                                           const float *x, const uint8_t *w, size_t row_bytes,
                                           kiln_dtype dt, int64_t R, int64_t C, int N,
                                           bool accumulate_dx) {
    if (!g) return cudaErrorInvalidValue;
    if (N <= 0 || R <= 0 || C <= 0) return cudaSuccess;
    if (!kiln_cuda_backward_dtype_supported(dt)) return cudaErrorInvalidValue;
    if (!dx && !dW && !dbias) return cudaSuccess;
    if (!dy || (dx && !w) || (dW && !x)) return cudaErrorInvalidValue;
    const size_t es = dt == KILN_DTYPE_F32 ? 4u : 2u;
    if (dx && (row_bytes % es != 0 || row_bytes / es < (size_t)C || ((uintptr_t)w % es) != 0))
        return cudaErrorInvalidValue;

    /* dbias first: it reads only dy, and its bits are the CPU's (the auditable sum) */
    cudaError_t e;
    if (dbias) {
        e = kiln_cuda_matmul_backward(s, NULL, NULL, dbias, dy, NULL, w, row_bytes, dt, R, C, N,
                                      false);
        if (e != cudaSuccess) return e;
    }
    if (!dx && !dW) return cudaSuccess;

    /* the buffer: dyb, then xb (dW), then W's copy (dx, unless read in place) */
    size_t dy_bytes = 0, x_bytes = 0, w_bytes = 0;
    if (!region_bytes(N, padded_ld(R), &dy_bytes) ||
        (dW && !region_bytes(N, padded_ld(C), &x_bytes)) ||
        (dx && !bf16_in_place(dt, w, row_bytes) && !region_bytes(R, padded_ld(C), &w_bytes)))
        return cudaErrorInvalidValue;
    const size_t total = dy_bytes + x_bytes + w_bytes + 256; /* + room to align the start */
    void *base = NULL;
    bool pooled = true;
    e = cudaMallocAsync(&base, total, s);
    if (e == cudaErrorNotSupported) { /* no memory pools on this device: a plain allocation */
        (void)cudaGetLastError();
        pooled = false;
        e = cudaMalloc(&base, total);
    }
    if (e != cudaSuccess) return e;
    uint8_t *buf = (uint8_t *)(((uintptr_t)base + 255u) & ~(uintptr_t)255u);
    e = run_products(g, s, buf, dy_bytes, dy_bytes + x_bytes, dx, dW, dy, x, w, row_bytes, dt,
                     R, C, N, accumulate_dx);
    /* released after everything enqueued above has read it (stream order; the plain
     * allocation waits for the stream first) */
    cudaError_t ef;
    if (pooled) {
        ef = cudaFreeAsync(base, s);
    } else {
        ef = cudaStreamSynchronize(s);
        cudaError_t e2 = cudaFree(base);
        if (ef == cudaSuccess) ef = e2;
    }
    return e != cudaSuccess ? e : ef;
}
