/*
 * mx_kernels.h -- the CPU kernels of the exact block formats' product (src/ops/mx.h,
 * docs/ARITHMETIC.md "Exact block formats (mx8, mx16)"). mx_cpu.c holds the portable
 * reference and the entry kiln_mx_matmul_cpu (checks, scratch, threads, dispatch);
 * mx_avx2.c and mx_avx512.c give the same bits.
 */
#ifndef KILN_MX_KERNELS_H
#define KILN_MX_KERNELS_H

#include "../mx.h"

/* One product, as the entry set it up. Every output element is computed by one call of
 * rows(), alone: the bits cannot depend on how rows are split over threads. */
typedef struct kiln_mx_product {
    const kiln_mx_matrix *x; /* (N, K) */
    const kiln_mx_matrix *w; /* (R, K), same kind and K */
    float *out;              /* out[n * ldo + r] */
    int64_t ldo;
    /* SIMD paths (kernels with wants_scratch), set up by the entry: */
    int64_t nbp;        /* nb rounded up to a multiple of 16 */
    const int16_t *xe;  /* (N, nbp) x's block exponents, the padding KILN_MX_EXP_ZERO */
    const int16_t *x16; /* mx16: (N, nb*32) the mantissas hi*128 + lo as int16; NULL for mx8 */
    uint8_t *scratch;   /* per thread, scratch_stride bytes: room for (nbp) int16 and
                         * (nbp*32) int16, one row of W prepared */
    size_t scratch_stride;
} kiln_mx_product;

typedef struct kiln_mx_kernels {
    const char *name;
    int wants_scratch; /* the entry fills nbp, xd, x16 and the scratch */
    /* Output columns [r0, r1) for every row of x; thread indexes the scratch. */
    void (*rows)(const kiln_mx_product *p, int64_t r0, int64_t r1, int thread);
} kiln_mx_kernels;

extern const kiln_mx_kernels kiln_mx_kernels_portable;
#if defined(__x86_64__)
extern const kiln_mx_kernels kiln_mx_kernels_avx2;
#endif

/* The NaN of a row holding a non-finite element: the f32 0x7FC00000 (positive quiet NaN). */
static inline float kiln_mx_nan(void) {
    union { uint32_t u; float f; } v = {0x7fc00000u};
    return v.f;
}

#endif /* KILN_MX_KERNELS_H */
