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
    int accumulate;          /* 0: out = the product; 1: out += it (one f32 add, kiln_mx_store) */
    /* SIMD paths (layout != KILN_MX_LAYOUT_NONE), set up by the entry: */
    int64_t nbp;       /* blocks of a prepared row: nb rounded up to a multiple of 16
                        * (KILN_MX_LAYOUT_INT16), nb (KILN_MX_LAYOUT_ROWS) */
    const int16_t *xe; /* (N, nbp) x's block exponents, the padding KILN_MX_EXP_ZERO */
    /* x's mantissas prepared, row n at xm + n * xm_stride bytes:
     *   KILN_MX_LAYOUT_INT16: mx16 only: (nb*32) int16 hi*128 + lo (mx8: NULL, use x->q)
     *   KILN_MX_LAYOUT_ROWS:  mx8: (nb*32) uint8 q + 128 (vpdpbusd's unsigned operand);
     *                         mx16: the int16 of LAYOUT_INT16 */
    const uint8_t *xm;
    size_t xm_stride;
    uint8_t *scratch; /* per thread, scratch_stride bytes (KILN_MX_ROW_SCRATCH(nbp) a row of W
                       * for INT16's w_rows rows, KILN_MX_TILE_SCRATCH(nb) for ROWS) */
    size_t scratch_stride;
} kiln_mx_product;

/* What the entry prepares for a kernel (kiln_mx_product's SIMD fields). */
enum { KILN_MX_LAYOUT_NONE = 0, KILN_MX_LAYOUT_INT16 = 1, KILN_MX_LAYOUT_ROWS = 2 };

/* Bytes of a thread's scratch for a row of W of nbp blocks (LAYOUT_INT16): exponents (int16),
 * block sums (int32), the prepared mantissas (up to 64 bytes a block) and a staging row (as
 * much). */
#define KILN_MX_ROW_SCRATCH(nbp) ((size_t)(nbp) * (2 + 4 + 4 * KILN_MX_BLOCK) + 64)

/* LAYOUT_ROWS: the kernel's tile of W is KILN_MX_TILE_ROWS rows (one a 32-bit lane of a
 * 64-byte vector) and it keeps KILN_MX_TILE_XROWS rows of x's running sums at a time. A
 * thread's scratch for nb blocks: the tile's mantissas (up to 1,024 bytes a block), its
 * exponents and block sums (64 bytes a block each) and 192 bytes for each of the x rows' sums
 * and shifts, with 64 bytes of alignment slack for each of those 5 arrays. */
#define KILN_MX_TILE_ROWS 16
#define KILN_MX_TILE_XROWS 128
#define KILN_MX_TILE_SCRATCH(nb) ((size_t)(nb) * (1024 + 64 + 64) + KILN_MX_TILE_XROWS * 192 + 5 * 64)

/* Output (n, r) of the product: v, or out + v (one f32 add) when accumulating. */
static inline void kiln_mx_store(const kiln_mx_product *p, int64_t n, int64_t r, float v) {
    float *o = p->out + n * p->ldo + r;
    *o = p->accumulate ? *o + v : v;
}

typedef struct kiln_mx_kernels {
    const char *name;
    int layout; /* KILN_MX_LAYOUT_*: what the entry prepares */
    int w_rows; /* rows of W a thread prepares at once: the tasks' rows are a multiple of it
                 * (LAYOUT_INT16: its scratch holds w_rows row scratches) */
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
