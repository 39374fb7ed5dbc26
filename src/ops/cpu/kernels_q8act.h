/*
 * kernels_q8act.h -- the fast (approximate) matmul for quantized weights at small N: the
 * activations are quantized to 8-bit blocks of 32, then each block's dot product is an exact
 * integer sum. Defined in docs/ARITHMETIC.md, "Fast mode: 8-bit activations"; the portable
 * kernels (kernels_q8act.c) are that definition in code, the AVX2 ones
 * (kernels_q8act_avx2.c) give the same bits (tests/c/test_ops_fast.c).
 *
 * It is NOT the exact path: the result differs from dot(x, dequantized w) by the rounding of
 * x to 8 bits. The CPU backend uses it only when created in fast mode
 * (kiln_backend_cpu_create_mode), for weights of a supported type, at every N.
 */
#ifndef KILN_KERNELS_Q8ACT_H
#define KILN_KERNELS_Q8ACT_H

#include "../../base/tensor.h"

#define KILN_Q8ACT_LANES 8 /* float accumulators per output: block b goes to lane b % 8 */

/* N tokens of C activations quantized to blocks of 32 (one carved buffer, see
 * kiln_q8act_bytes). Blocks nb..nbp-1 of each token are padding: q = 0, d = s = 0, sum = 0. */
typedef struct kiln_q8act {
    int N;
    int64_t nb;   /* blocks of 32 per token: C / 32 */
    int64_t nbp;  /* nb rounded up to a multiple of KILN_Q8ACT_LANES */
    int8_t *q;    /* (N, nbp*32) the int8 values */
    float *d;     /* (N, nbp) block scale dx = absmax / 127 (NaN: a non-finite activation) */
    float *s;     /* (N, nbp) dx * (float)sum (Q4_1's m term) */
    int32_t *sum; /* (N, nbp) sum of the block's int8 values (Q4_0's -8 term) */
} kiln_q8act;

/* Bytes of the buffer for N tokens of C (a multiple of 32); 0 on overflow. */
size_t kiln_q8act_bytes(int N, int64_t C);
/* Carve qa's arrays from buf (kiln_q8act_bytes(N, C) bytes, 32-byte aligned is best). */
void kiln_q8act_init(kiln_q8act *qa, void *buf, int N, int64_t C);

/* Whether weights of type t have an int8 kernel. */
bool kiln_q8act_supports(kiln_dtype t);

/* One int8 matmul: out[t*ldo + r] = the fast dot of token t with row r (+ bias[r]). */
typedef struct kiln_q8act_mm {
    const kiln_q8act *xa;
    const uint8_t *w; /* row r at w + r*row_bytes, blocks of 32 of type dtype */
    size_t row_bytes;
    kiln_dtype dtype; /* kiln_q8act_supports(dtype) */
    const float *bias; /* (R) or NULL */
    float *out;
    int64_t ldo;
} kiln_q8act_mm;

typedef struct kiln_q8act_kernels {
    const char *name;
    /* Quantize x(N, C) (row t at x + t*ldx) into qa (set up by kiln_q8act_init). */
    void (*quantize)(kiln_q8act *qa, const float *x, int64_t ldx);
    /* Rows [r0, r1) of the matmul for all qa->N tokens. */
    void (*rows)(const kiln_q8act_mm *m, int64_t r0, int64_t r1);
} kiln_q8act_kernels;

extern const kiln_q8act_kernels kiln_q8act_kernels_portable;
#if defined(__x86_64__)
extern const kiln_q8act_kernels kiln_q8act_kernels_avx2;
/* the same bits with VNNI's vpdpbusd (AVX512_VNNI with AVX512VL: kiln_cpu_features.avx512vnni) */
extern const kiln_q8act_kernels kiln_q8act_kernels_vnni;
#endif

#endif /* KILN_KERNELS_Q8ACT_H */
