/*
 * mx.h -- kiln's exact block formats mx8 and mx16: both operands of a product are quantized
 * along the reduction axis K to blocks of 32 integer mantissas with one power-of-two scale
 * per block; a product of two blocks is an exact integer, the blocks of a row are combined
 * exactly in a 64-bit fixed-point integer, and the result is rounded once to f32. Nothing in
 * it depends on an order of operations, so every device gives the same bits.
 *
 * The definition (every rule, with its bounds) is docs/ARITHMETIC.md, "Exact block formats
 * (mx8, mx16)". In short, for one block a[0..31] of a row (elements past K are +0):
 *
 *   E    = max ilogb|a_i| over the nonzero a_i   (subnormals by their true exponent)
 *   mx8  : q_i = clamp(round_half_even(a_i 2^(6 - E)),  -127,  127)   a_i ~ q_i 2^(E - 6)
 *   mx16 : q_i = clamp(round_half_even(a_i 2^(12 - E)), -8191, 8191)  a_i ~ q_i 2^(E - 12)
 *          stored as int8 pieces q = hi * 128 + lo, lo in [-64, 63], hi in [-64, 64]
 *   all a_i = 0     : q = 0, e = KILN_MX_EXP_ZERO   (the block contributes nothing)
 *   a NaN or an Inf : q = 0, e = KILN_MX_EXP_NONFINITE, and the row is marked non-finite
 *
 * and out[n, r] = round_f32(2^base * sum over blocks k of floor(P_k 2^(e_k - base))), with
 * P_k = sum_i qx_i qw_i exactly, e_k = Ex_k + Ew_k - 2F (F = 6 or 12) and base = emax - SH,
 * emax the largest e_k over the blocks where neither side is a zero block (none: +0), and
 * NaN (0x7FC00000) for an output that reads a non-finite row. round_f32 is one rounding to
 * nearest even, subnormals included (kiln_mx_round).
 *
 * This is the format and the CPU implementation (src/ops/mx.c: quantization; src/ops/cpu/mx_*.c:
 * the product). It is not wired into the op table or the model yet: a caller quantizes a
 * weight once (kiln_mx_quantize) and keeps it, quantizes the activations per call, and calls
 * kiln_mx_matmul_cpu.
 */
#ifndef KILN_OPS_MX_H
#define KILN_OPS_MX_H

#include "../base/base.h"
#include "../base/cpu_features.h"
#include "../base/threadpool.h"

#define KILN_MX_BLOCK 32                /* elements per block along K */
#define KILN_MX_MAX_K 262144            /* 2^18: the largest K (8192 blocks) whose sum fits int64 */
#define KILN_MX_EXP_ZERO INT16_MIN      /* e of a block whose elements are all +-0 (or padding) */
#define KILN_MX_EXP_NONFINITE INT16_MAX /* e of a block holding a NaN or an Inf */

typedef enum kiln_mx_kind {
    KILN_MX8 = 8,   /* 8-bit mantissas in [-127, 127] */
    KILN_MX16 = 16, /* 14-bit mantissas in [-8191, 8191], as two int8 pieces */
} kiln_mx_kind;

/* Fraction bits F of a mantissa (q = a 2^(F - E)) and the shift SH of the combination
 * (base = emax - SH), by kind. See docs/ARITHMETIC.md for why SH keeps int64 exact. */
#define KILN_MX8_F 6
#define KILN_MX16_F 12
#define KILN_MX8_SH 31
#define KILN_MX16_SH 19

/* A (rows, K) matrix quantized along K. One allocation (mem) owns every array. Rows are
 * padded to nb blocks; the padding elements are 0 (they are +0 in the definition).
 * Element i of block b of row j is at [(j * nb + b) * 32 + i]. */
typedef struct kiln_mx_matrix {
    kiln_mx_kind kind;
    int64_t rows, K;
    int64_t nb;             /* blocks per row: ceil(K / 32) */
    int8_t *q;              /* (rows, nb*32) mx8: the mantissas q; mx16: the high pieces hi */
    int8_t *lo;             /* (rows, nb*32) mx16: the low pieces lo; NULL for mx8 */
    int16_t *e;             /* (rows, nb) block exponent E in [-149, 127], or KILN_MX_EXP_* */
    uint8_t *row_nonfinite; /* (rows) 1 when a block of the row holds a NaN or an Inf */
    void *mem;
} kiln_mx_matrix;

/* floor(P / 2^s) for s >= 0 and |P| < 2^62: an arithmetic right shift, written without one
 * (a signed right shift is implementation-defined in C). */
static inline int64_t kiln_mx_floor_shift(int64_t P, int s) {
    if (s >= 63) return P < 0 ? -1 : 0;
    return P >= 0 ? P >> s : -((-P - 1) >> s) - 1;
}

/* Allocate m for (rows, K) of kind (through kiln's allocator; the arrays are zeroed).
 * KILN_ERR_INVALID_ARG for a bad kind, rows < 0, K < 0 or K > KILN_MX_MAX_K; KILN_ERR_NOMEM.
 * On failure *m is zeroed. */
kiln_status kiln_mx_matrix_alloc(kiln_mx_matrix *m, kiln_mx_kind kind, int64_t rows, int64_t K);
/* Free m's arrays and zero it. NULL, or a zeroed m, is a no-op. */
void kiln_mx_matrix_free(kiln_mx_matrix *m);

/* Quantize a (m->rows, m->K) f32 matrix, row j at a + j * lda (lda >= K), into m (allocated
 * by kiln_mx_matrix_alloc). Rows are split over pool (NULL: inline); the result does not
 * depend on the thread count. KILN_ERR_INVALID_ARG when lda < K or a is NULL with rows*K > 0. */
kiln_status kiln_mx_quantize(kiln_mx_matrix *m, const float *a, int64_t lda, kiln_pool *pool);
/* One block of n <= 32 elements by the portable quantization to nearest even (F fraction bits:
 * KILN_MX8_F or KILN_MX16_F): its e field, its mantissas in mant (the rest 0). The reference
 * the SIMD quantizers are checked against. */
int16_t kiln_mx_quantize_block_ref(const float *a, int n, int F, int32_t mant[KILN_MX_BLOCK]);

/* kiln_mx_quantize with stochastic rounding (for training): each mantissa is
 *   q_i = clamp(floor(a_i 2^(F - E) + u_i 2^-24), -qmax, qmax),
 * the sum exact, with u_i = kiln_mx_random24(seed, tensor_id, j * K + k) for the element at
 * row j, column k. E, zero and non-finite blocks as kiln_mx_quantize. The same bits on every
 * device and thread count; E[q_i] = a_i 2^(F - E) rounded down to a multiple of 2^-24 (unless
 * clamped). */
kiln_status kiln_mx_quantize_stochastic(kiln_mx_matrix *m, const float *a, int64_t lda,
                                        uint64_t seed, uint64_t tensor_id, kiln_pool *pool);

/* The stochastic rounding's random number in [0, 2^24) of element index (its row-major index
 * in the (rows, K) matrix) of tensor tensor_id under seed: with mix(z) splitmix64's
 * finalizer (z ^= z >> 30; z *= 0xbf58476d1ce4e5b9; z ^= z >> 27; z *= 0x94d049bb133111eb;
 * z ^= z >> 31, all mod 2^64),
 *   h = mix(mix(mix(seed + 0x9e3779b97f4a7c15) ^ tensor_id) ^ index),  u = h >> 40. */
uint32_t kiln_mx_random24(uint64_t seed, uint64_t tensor_id, uint64_t index);

/* The stochastic rounding's seed of a training backward (kiln_backend_cpu_stochastic_grads'
 * key): of the run's seed, the optimizer steps done before it and the micro-batch's index in
 * its step (0, 1, ... in the order one process runs them: a data-parallel rank's is its place
 * in that order), with mix as above:
 *   key = mix(mix(mix(seed + 0x6a09e667f3bcc908) ^ step) ^ micro). */
uint64_t kiln_mx_backward_key(uint64_t seed, uint64_t step, uint64_t micro);

/* The exact decoded value of element i of block b of row j, as a (mantissa, exponent) pair:
 * value = *mant * 2^*exp2 (mant = q or hi*128+lo; for a zero or non-finite block mant = 0).
 * For tests and tools. */
void kiln_mx_element(const kiln_mx_matrix *m, int64_t j, int64_t b, int i, int32_t *mant,
                     int *exp2);

/* round_f32(S 2^p): the f32 nearest to the exact S * 2^p, ties to even, in IEEE binary32 with
 * gradual underflow (subnormal results are rounded once, at their own precision), +-inf when
 * the rounded magnitude reaches 2^128; S == 0 gives +0, a negative S that rounds to zero -0.
 * |S| < 2^63. The one rounding of an mx product. */
float kiln_mx_round_general(int64_t S, int p);
static inline float kiln_mx_round(int64_t S, int p) {
    if (S != 0 && p >= -126 && p <= 63) {
        /* (float)S (one RNE rounding) is in [1, 2^63], so (float)S 2^p is normal and finite:
         * the multiply is exact (inline: one per output of a product) */
        union {
            uint32_t u;
            float f;
        } two_p = {(uint32_t)(p + 127) << 23};
        return (float)S * two_p.f;
    }
    return kiln_mx_round_general(S, p);
}

/* out(N, R) = x W^T in the exact block format: out[n * ldo + r] for x (N, K) and w (R, K) of
 * the same kind and K (ldo >= R). The SIMD path is path (KILN_CPU_PATH_* as
 * kiln_cpu_select_path() gives; a path the CPU lacks falls back to the next one below); every
 * path gives the portable reference's bits. Rows of W are split over pool (NULL: inline);
 * the bits do not depend on the thread count. KILN_ERR_INVALID_ARG (naming the argument) on a
 * kind or K mismatch, a NULL operand or ldo < R. No bias, no residual: a caller adds them as
 * f32 adds afterwards (docs/ARITHMETIC.md, "add"). */
kiln_status kiln_mx_matmul_cpu(const kiln_mx_matrix *x, const kiln_mx_matrix *w, float *out,
                               int64_t ldo, kiln_pool *pool, kiln_cpu_path path);
/* kiln_mx_matmul_cpu's out += x W^T: each output is the product's one rounding, then one f32
 * add to what out holds (the bits of a product into a scratch and a separate f32 add). */
kiln_status kiln_mx_matmul_add_cpu(const kiln_mx_matrix *x, const kiln_mx_matrix *w, float *out,
                                   int64_t ldo, kiln_pool *pool, kiln_cpu_path path);

/* The path to pass to kiln_mx_matmul_cpu for N rows of x: kiln_cpu_select_path(), except
 * that below KILN_MX_VNNI_MIN_N rows the AVX2 kernel replaces the AVX-512 VNNI one (which
 * regroups W into tiles of 16 rows per call: at 1 or 2 rows of x and a W beyond the caches
 * the AVX2 kernel, reading W in place, is as fast or faster; from 4 rows the VNNI kernel is
 * faster, bench/RESULTS.md 2026-12-07). The same bits either way. */
#define KILN_MX_VNNI_MIN_N 4
kiln_cpu_path kiln_mx_select_path(int64_t N);
/* The same advice for a given path p (a backend's own, which may be forced): p, or AVX2 for
 * AVX512 below KILN_MX_VNNI_MIN_N rows. kiln_mx_select_path(N) is this of kiln_cpu_select_path(). */
kiln_cpu_path kiln_mx_path_for(kiln_cpu_path p, int64_t N);

/* The name of the kernel that path p would run for the product ("portable", "avx2",
 * "avx512vnni"). */
const char *kiln_mx_kernel_name(kiln_cpu_path p);

#endif /* KILN_OPS_MX_H */
