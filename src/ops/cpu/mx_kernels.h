/*
 * mx_kernels.h -- the CPU kernels of the exact block formats' product (src/ops/mx.h,
 * docs/ARITHMETIC.md "Exact block formats (mx8, mx16)"). mx_cpu.c holds the portable
 * reference and the entry kiln_mx_matmul_cpu (checks, scratch, threads, dispatch);
 * mx_avx2.c and mx_avx512.c give the same bits.
 */
#ifndef KILN_MX_KERNELS_H
#define KILN_MX_KERNELS_H

#include "../mx.h"

#include <string.h>

/* One product, as the entry set it up. Every output element is computed by one call of
 * rows(), alone: the bits cannot depend on how rows are split over threads. */
typedef struct kiln_mx_product {
    const kiln_mx_matrix *x; /* (N, K) */
    const kiln_mx_matrix *w; /* (R, K), same kind and K */
    float *out;              /* out[n * ldo + r] */
    int64_t ldo;
    /* SIMD paths (layout != KILN_MX_LAYOUT_NONE), set up by the entry: */
    int64_t nbp;       /* nb rounded up to a multiple of 16 */
    const int16_t *xe; /* (N, nbp) x's block exponents, the padding KILN_MX_EXP_ZERO */
    /* x's mantissas prepared, row n at xm + n * xm_stride bytes:
     *   KILN_MX_LAYOUT_INT16:        mx16 only: (nb*32) int16 hi*128 + lo (mx8: NULL, use x->q)
     *   KILN_MX_LAYOUT_INTERLEAVED:  kiln_mx_interleave16 of the row's mantissas (mx8: as
     *                                uint8 q + 128; mx16: the int16 of LAYOUT_INT16) */
    const uint8_t *xm;
    size_t xm_stride;
    uint8_t *scratch; /* per thread, scratch_stride bytes: w_rows KILN_MX_ROW_SCRATCH(nbp),
                       * rows of W prepared */
    size_t scratch_stride;
} kiln_mx_product;

/* What the entry prepares for a kernel (kiln_mx_product's SIMD fields). */
enum { KILN_MX_LAYOUT_NONE = 0, KILN_MX_LAYOUT_INT16 = 1, KILN_MX_LAYOUT_INTERLEAVED = 2 };

/* Bytes of a thread's scratch for a row of W of nbp blocks: exponents (int16), block sums
 * (int32), the prepared mantissas (up to 64 bytes a block) and a staging row (as much). */
#define KILN_MX_ROW_SCRATCH(nbp) ((size_t)(nbp) * (2 + 4 + 4 * KILN_MX_BLOCK) + 64)

/* A row's blocks regrouped for 16-lane dot-product instructions: with U 4-byte units a block
 * (mx8: 8, mx16 as int16: 16), unit s of block g*16 + b goes to
 * dst[((g * U + s) * 16 + b) * 4 ..+3], so lane b of a 64-byte vector always holds block
 * g*16 + b and one vpdpbusd / vpdpwssd per unit sums each block in its own lane. Blocks
 * nb..nbp-1 (nbp a multiple of 16) are zero bytes. */
static inline void kiln_mx_interleave16(uint8_t *dst, const uint8_t *src, int64_t nb, int64_t nbp,
                                        int U) {
    for (int64_t g = 0; g < nbp / 16; g++)
        for (int s = 0; s < U; s++)
            for (int b = 0; b < 16; b++) {
                int64_t blk = g * 16 + b;
                uint8_t *d = dst + ((g * U + s) * 16 + b) * 4;
                if (blk < nb)
                    memcpy(d, src + (blk * U + s) * 4, 4);
                else
                    memset(d, 0, 4);
            }
}

typedef struct kiln_mx_kernels {
    const char *name;
    int layout; /* KILN_MX_LAYOUT_*: what the entry prepares */
    int w_rows; /* rows of W a thread prepares at once (its scratch: w_rows row scratches) */
    /* Output columns [r0, r1) for every row of x; thread indexes the scratch. */
    void (*rows)(const kiln_mx_product *p, int64_t r0, int64_t r1, int thread);
} kiln_mx_kernels;

extern const kiln_mx_kernels kiln_mx_kernels_portable;
#if defined(__x86_64__)
extern const kiln_mx_kernels kiln_mx_kernels_avx2;
extern const kiln_mx_kernels kiln_mx_kernels_avx512vnni;
#endif

/* One full block of 32 f32 quantized to nearest even with F fraction bits (mx.h): the block's
 * e field returned, its mantissas in mant (all 0 for a zero or non-finite block). The bits of
 * mx.c's portable quantize_block (kiln_mx_quantize_block_ref), by the same integer arithmetic
 * on the bit patterns (variable shifts, no floating-point mode involved); checked against it by
 * tests/c/test_mx.c. NULL where the CPU lacks AVX2 (kiln_mx_quantize_block_simd). */
typedef int16_t (*kiln_mx_quantize_block_fn)(const float *a, int F, int32_t mant[KILN_MX_BLOCK]);
#if defined(__x86_64__)
int16_t kiln_mx_quantize_block_avx2(const float *a, int F, int32_t mant[KILN_MX_BLOCK]);
#endif
/* The SIMD block quantizer of this CPU (KILN_CPU_PATH=portable: none), or NULL. */
kiln_mx_quantize_block_fn kiln_mx_quantize_block_simd(void);

/* The NaN of a row holding a non-finite element: the f32 0x7FC00000 (positive quiet NaN). */
static inline float kiln_mx_nan(void) {
    union {
        uint32_t u;
        float f;
    } v = {0x7fc00000u};
    return v.f;
}

#endif /* KILN_MX_KERNELS_H */
