/*
 * cpu_kernels.h -- the inner loops of the CPU backend, one table per SIMD path.
 *
 * Every path computes the SAME bits (docs/ARITHMETIC.md): the portable table is plain C with
 * fmaf, the AVX2 and AVX-512 tables perform the same IEEE operations in the same order per
 * output element, just many elements at once. tests/c/test_ops.c checks this bit for bit.
 */
#ifndef KILN_CPU_KERNELS_H
#define KILN_CPU_KERNELS_H

#include "../../base/cpu_features.h"
#include "../../base/kmath.h"
#include "../../base/tensor.h"

/* One matmul job: out(N,R) = x(N,C) @ W(R,C)^T (+ bias), with W's rows row_bytes apart. */
typedef struct kiln_mm_args {
    float *out;         /* out[t*ldo + r] */
    int64_t ldo;
    const float *x;     /* x[t*ldx + c] */
    int64_t ldx;
    const uint8_t *w;   /* row r at w + r*row_bytes */
    size_t row_bytes;
    kiln_dtype dtype;
    int64_t C;          /* a multiple of the block size for quantized types */
    const float *bias;  /* (R) or NULL */
    int N;
} kiln_mm_args;

/* The matmul tile drivers' path for fewer than 4 tokens (inside a function of a, r0, r1):
 * per token, 4 rows at a time (independent FMA chains), then the last rows one by one. TILE
 * is the SIMD file's tile(a, r, t, rows, tokens). */
#define KILN_FEW_TOKEN_ROWS(TILE)                                                              \
    for (int t = 0; t < a->N; t++) {                                                           \
        int64_t r = r0;                                                                        \
        for (; r + 4 <= r1; r += 4) TILE(a, r, t, 4, 1);                                       \
        for (; r < r1; r++) TILE(a, r, t, 1, 1);                                               \
    }

/* Weight streams ask for their bytes KILN_ROW_PREFETCH ahead (prefetcht0): a decode
 * product reads each weight once, row after row, and the hardware prefetchers alone leave the
 * loads waiting (SmolLM2 Q4_1 on 2 Xeon cores, --fast decode: 107 -> 170 tok/s at 4 KiB; 512 B
 * was slower than none, 4-8 KiB the plateau). A prefetch changes no result and may point past
 * the weights (it never faults). KILN_PREFETCH_SPAN(p, n): the lines of [p + ahead, + n). */
#define KILN_ROW_PREFETCH 4096
#define KILN_PREFETCH_SPAN(p, n)                                                               \
    for (int pf_ = 0; pf_ < (int)(n); pf_ += 64)                                               \
        __builtin_prefetch((const char *)(p) + KILN_ROW_PREFETCH + pf_, 0, 3)

/* The block formats' rows with 4 tokens or more (for the SIMD files): GROUP rows at a time
 * dequantized once per TILE-token tile into f32 on the stack (STORE(dst, block) writes a
 * block's 32 values, the ones the block tile would multiply), then multiplied by the tile's
 * tokens as f32 rows (F32_ROWS, the plain-type driver). Each output takes the same products in
 * the same order as in the block tile, so the same bits; the dequantization is done once per
 * rows x token tile instead of once per tile of a few tokens, and the f32 tiles reuse each
 * loaded vector more. Rows longer than KILN_DEQ_ROWS_MAX_C (the stack's GROUP x 32 KiB) and
 * fewer than 4 tokens take BLOCK_ROWS, the block tile's driver. */
#define KILN_DEQ_ROWS_MAX_C 8192
#define KILN_DEFINE_DEQ_ROWS(NAME, BLOCK_ROWS, F32_ROWS, STORE, BLOCK_BYTES, GROUP, TILE)         \
    TGT static void NAME(const kiln_mm_args *a, int64_t r0, int64_t r1) {                      \
        if (a->N < 4 || a->C > KILN_DEQ_ROWS_MAX_C) {                                          \
            BLOCK_ROWS(a, r0, r1);                                                             \
            return;                                                                            \
        }                                                                                      \
        _Alignas(64) float w[(GROUP) * KILN_DEQ_ROWS_MAX_C];                                   \
        const int64_t C = a->C, nb = C / 32;                                                   \
        kiln_mm_args f = *a; /* the group's rows as f32 rows 0..rb-1 */                        \
        f.w = (const uint8_t *)w;                                                              \
        f.row_bytes = (size_t)C * sizeof(float);                                               \
        f.dtype = KILN_DTYPE_F32;                                                              \
        for (int t0 = 0; t0 < a->N; t0 += (TILE)) {                                            \
            f.N = a->N - t0 < (TILE) ? a->N - t0 : (TILE);                                     \
            f.x = a->x + (int64_t)t0 * a->ldx;                                                 \
            for (int64_t r = r0; r < r1; r += (GROUP)) {                                       \
                const int64_t rb = r1 - r < (GROUP) ? r1 - r : (GROUP);                        \
                for (int64_t rr = 0; rr < rb; rr++) {                                          \
                    const uint8_t *q = a->w + (size_t)(r + rr) * a->row_bytes;                 \
                    for (int64_t b = 0; b < nb; b++) STORE(w + rr * C + b * 32, q + (size_t)b * (BLOCK_BYTES)); \
                }                                                                              \
                f.out = a->out + (int64_t)t0 * a->ldo + r;                                     \
                f.bias = a->bias ? a->bias + r : NULL;                                         \
                F32_ROWS(&f, 0, rb);                                                           \
            }                                                                                  \
        }                                                                                      \
    }
/* rows_q8_0, rows_q4_1 and rows_q4_0 of a SIMD file from its block_rows_<type> (the block tile's
 * driver), store_<type> (a block's 32 values) and rows_f32, GROUP rows at a time. */
#define KILN_DEFINE_DEQ_ROWS_ALL(GROUP, TILE)                                                       \
    KILN_DEFINE_DEQ_ROWS(rows_q8_0, block_rows_q8_0, rows_f32, store_q8_0, 34, GROUP, TILE)         \
    KILN_DEFINE_DEQ_ROWS(rows_q4_1, block_rows_q4_1, rows_f32, store_q4_1, 20, GROUP, TILE)         \
    KILN_DEFINE_DEQ_ROWS(rows_q4_0, block_rows_q4_0, rows_f32, store_q4_0, 18, GROUP, TILE)

typedef struct kiln_cpu_kernels {
    kiln_cpu_path path;
    /* Continue the 16 lane accumulators over a[0..n) * b[0..n) (kiln_dot_accum_ref). */
    void (*dot_accum)(float acc[KILN_DOT_LANES], const float *a, const float *b, int64_t n);
    /* s[j] = dot(q, k + j*k_stride) over HS elements, j < nk (the defined dot). */
    void (*dots)(float *s, const float *q, const float *k, int64_t k_stride, int nk, int HS);
    /* Rows [r0, r1) of a matmul for all N tokens, fused dequantization. Returns 0 when this
     * path has no fused kernel for a->dtype (the caller then uses the generic block path). */
    int (*matmul_rows)(const kiln_mm_args *a, int64_t r0, int64_t r1);
    /* acc[d] *= alpha (d < HS); then for j < nk in order: acc[d] = fmaf(p[j], v_j[d], acc[d])
     * with v_j = v + j*v_stride. */
    void (*attn_pv)(float *acc, float alpha, const float *p, const float *v, int64_t v_stride,
                    int nk, int HS);
    /* p[j] = kiln_expf(s[j] - m), j < n. */
    void (*exp_sub)(float *p, const float *s, float m, int n);
    /* out[i] = (x[i] * r) * w[i] (w NULL: x[i] * r). */
    void (*scale_mul)(float *out, const float *x, float r, const float *w, int64_t n);
    /* out[i] = kiln_swiglu(g[i], u[i]). */
    void (*swiglu)(float *out, const float *g, const float *u, size_t n);
    /* x[i] += y[i]. */
    void (*add)(float *x, const float *y, size_t n);
} kiln_cpu_kernels;

extern const kiln_cpu_kernels kiln_cpu_kernels_portable;
#if defined(__x86_64__)
#define KILN_CPU_HAVE_X86 1
extern const kiln_cpu_kernels kiln_cpu_kernels_avx2;
extern const kiln_cpu_kernels kiln_cpu_kernels_avx512;
#endif

/* The SIMD path a CPU backend (from kiln_backend_cpu_create) uses: for tests, benchmarks. */
struct kiln_backend;
kiln_cpu_path kiln_backend_cpu_path(const struct kiln_backend *be);
/* The CPU backend's thread pool (for work that runs beside its ops, e.g. the fused loss's row
 * work); be must be a CPU backend. */
struct kiln_pool *kiln_backend_cpu_pool(struct kiln_backend *be);
/* The format the products on a weight whose data is at (or inside) data run in: its entry of
 * the per-weight formats (ops.h kiln_weight_formats) as KILN_MX16 / KILN_MX8 / 0 (f32), else
 * the mode's (KILN_MX16 / KILN_MX8 in an exact format's mode, else 0). The fused losses' head
 * products take the format's path through it. */
int kiln_backend_cpu_weight_format(const struct kiln_backend *be, const void *data);
/* The backend's matmul in f32 whatever the formats (the mode's f32 product, exact or fast):
 * for products on scratch copies of a weight in f32 (the fused loss's transposed chunks), which
 * the per-weight table does not hold. */
struct kiln_tensor;
void kiln_backend_cpu_matmul_f32(struct kiln_backend *be, float *out, const float *x, const struct kiln_tensor *W,
                                 const float *bias, int N);

#endif /* KILN_CPU_KERNELS_H */
