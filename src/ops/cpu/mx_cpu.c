/*
 * mx_cpu.c -- the exact block formats' product on the CPU: the portable reference (the
 * definition of docs/ARITHMETIC.md, "Exact block formats (mx8, mx16)", written as it reads,
 * mx16 by its four int8 piece products) and the entry kiln_mx_matmul_cpu.
 */
#include "mx_kernels.h"

#include <string.h>

/* ---- the reference ------------------------------------------------------------------------ */

/* P_k of mx8: sum of 32 int8 x int8 products; |P| <= 32 * 127^2 < 2^19. */
static int64_t block_product_mx8(const int8_t *qx, const int8_t *qw) {
    int32_t s = 0;
    for (int i = 0; i < KILN_MX_BLOCK; i++)
        s += (int32_t)qx[i] * qw[i];
    return s;
}

/* P_k of mx16 from the pieces, as a tensor core forms it: four int8 x int8 sums in int32
 * (each |.| <= 32 * 64^2 = 2^17), recombined exactly in int64. Equals sum qx_i qw_i. */
static int64_t block_product_mx16(const int8_t *hx, const int8_t *lx, const int8_t *hw,
                                  const int8_t *lw) {
    int32_t hh = 0, hl = 0, lh = 0, ll = 0;
    for (int i = 0; i < KILN_MX_BLOCK; i++) {
        hh += (int32_t)hx[i] * hw[i];
        hl += (int32_t)hx[i] * lw[i];
        lh += (int32_t)lx[i] * hw[i];
        ll += (int32_t)lx[i] * lw[i];
    }
    return (int64_t)hh * 16384 + ((int64_t)hl + lh) * 128 + ll;
}

/* out[n, r]: the definition, step by step. */
static float mx_dot_ref(const kiln_mx_matrix *x, int64_t n, const kiln_mx_matrix *w, int64_t r) {
    if (x->row_nonfinite[n] || w->row_nonfinite[r]) return kiln_mx_nan();
    const int64_t nb = x->nb;
    const int16_t *ex = x->e + n * nb, *ew = w->e + r * nb;
    const int mx8 = x->kind == KILN_MX8;
    const int F = mx8 ? KILN_MX8_F : KILN_MX16_F, SH = mx8 ? KILN_MX8_SH : KILN_MX16_SH;
    /* emax = max e_k over contributing blocks, e_k = Ex + Ew - 2F; kept as smax = max Ex + Ew */
    int smax = 0, any = 0;
    for (int64_t k = 0; k < nb; k++) {
        if (ex[k] == KILN_MX_EXP_ZERO || ew[k] == KILN_MX_EXP_ZERO) continue;
        int s = ex[k] + ew[k];
        if (!any || s > smax) smax = s;
        any = 1;
    }
    if (!any) return 0.0f;
    int64_t S = 0; /* sum of T_k; |S| < 2^63 for K <= KILN_MX_MAX_K */
    for (int64_t k = 0; k < nb; k++) {
        if (ex[k] == KILN_MX_EXP_ZERO || ew[k] == KILN_MX_EXP_ZERO) continue;
        size_t ox = (size_t)(n * nb + k) * KILN_MX_BLOCK, ow = (size_t)(r * nb + k) * KILN_MX_BLOCK;
        int64_t P = mx8 ? block_product_mx8(x->q + ox, w->q + ow)
                        : block_product_mx16(x->q + ox, x->lo + ox, w->q + ow, w->lo + ow);
        int d = ex[k] + ew[k] - smax + SH; /* e_k - base, <= SH */
        S += d >= 0 ? P * ((int64_t)1 << d) : kiln_mx_floor_shift(P, -d);
    }
    return kiln_mx_round(S, smax - 2 * F - SH); /* 2^base */
}

static void p_rows(const kiln_mx_product *p, int64_t r0, int64_t r1, int thread) {
    (void)thread;
    for (int64_t r = r0; r < r1; r++)
        for (int64_t n = 0; n < p->x->rows; n++)
            kiln_mx_store(p, n, r, mx_dot_ref(p->x, n, p->w, r));
}

const kiln_mx_kernels kiln_mx_kernels_portable = {
    .name = "portable",
    .layout = KILN_MX_LAYOUT_NONE,
    .w_rows = 0,
    .rows = p_rows,
};

/* ---- the entry ----------------------------------------------------------------------------- */

static const kiln_mx_kernels *kernels_for(kiln_cpu_path path) {
#if defined(__x86_64__)
    while (path > KILN_CPU_PATH_PORTABLE && !kiln_cpu_path_supported(path))
        path = (kiln_cpu_path)(path - 1);
    if (path == KILN_CPU_PATH_AVX512 && kiln_cpu_get_features()->avx512vnni &&
        kiln_cpu_get_features()->avx512dq)
        return &kiln_mx_kernels_avx512vnni;
    if (path >= KILN_CPU_PATH_AVX2) return &kiln_mx_kernels_avx2;
#else
    (void)path;
#endif
    return &kiln_mx_kernels_portable;
}

const char *kiln_mx_kernel_name(kiln_cpu_path p) {
    return kernels_for(p)->name;
}

kiln_cpu_path kiln_mx_path_for(kiln_cpu_path p, int64_t N) {
    return p == KILN_CPU_PATH_AVX512 && N < KILN_MX_VNNI_MIN_N ? KILN_CPU_PATH_AVX2 : p;
}

kiln_cpu_path kiln_mx_select_path(int64_t N) {
    return kiln_mx_path_for(kiln_cpu_select_path(), N);
}

/* The SIMD kernels' scratch (kiln_mx_product's comments): x's exponents and prepared
 * mantissas once per call, and a thread's room for rows of W. *mem: the one allocation. */
static kiln_status prepare(kiln_mx_product *p, int layout, int w_rows, int n_threads, void **mem) {
    const kiln_mx_matrix *x = p->x;
    const int64_t N = x->rows, nb = x->nb, L = nb * KILN_MX_BLOCK;
    const int64_t nbp = layout == KILN_MX_LAYOUT_ROWS ? nb : (nb + 15) / 16 * 16;
    const int mx16 = x->kind == KILN_MX16;
    size_t xm_stride = 0;
    if (layout == KILN_MX_LAYOUT_INT16 && mx16) xm_stride = (size_t)L * 2;
    if (layout == KILN_MX_LAYOUT_ROWS) xm_stride = (size_t)L * (mx16 ? 2 : 1);
    const size_t per_thread = layout == KILN_MX_LAYOUT_ROWS ? KILN_MX_TILE_SCRATCH(nb)
                                                            : (size_t)w_rows * KILN_MX_ROW_SCRATCH(nbp);
    size_t xe = 0, xm = 0, sc = 0, t = 0;
    if (kiln_mul_overflow((size_t)N, (size_t)nbp * 2, &xe) ||
        kiln_mul_overflow((size_t)N, xm_stride, &xm) ||
        kiln_mul_overflow((size_t)n_threads, per_thread, &sc) || kiln_add_overflow(xe, xm, &t) ||
        kiln_add_overflow(t, sc, &t))
        return kiln_error(KILN_ERR_INVALID_ARG, "kiln_mx_matmul_cpu: N %lld too large",
                          (long long)N);
    KILN_TRY(kiln_alloc_or_fail(mem, t, "kiln_mx_matmul_cpu scratch"));
    uint8_t *base = *mem;
    int16_t *ep = (int16_t *)base;
    uint8_t *xmp = base + xe;
    for (int64_t n = 0; n < N; n++) {
        for (int64_t b = 0; b < nbp; b++)
            ep[n * nbp + b] = b < nb ? x->e[n * nb + b] : KILN_MX_EXP_ZERO;
        const int8_t *q = x->q + n * L;
        uint8_t *d = xmp + (size_t)n * xm_stride;
        if (mx16 && xm_stride) {
            int16_t *w16 = (int16_t *)d;
            for (int64_t i = 0; i < L; i++)
                w16[i] = (int16_t)(q[i] * 128 + x->lo[n * L + i]);
        } else if (xm_stride) { /* mx8, LAYOUT_ROWS: q + 128 as uint8 */
            for (int64_t i = 0; i < L; i++)
                d[i] = (uint8_t)q[i] ^ 0x80;
        }
    }
    p->nbp = nbp;
    p->xe = ep;
    p->xm = xm ? xmp : NULL;
    p->xm_stride = xm_stride;
    p->scratch = xmp + xm;
    p->scratch_stride = per_thread;
    return KILN_OK;
}

typedef struct mx_job {
    const kiln_mx_kernels *k;
    const kiln_mx_product *p;
    int64_t R, rows_per_task;
} mx_job;

static void mx_task(void *ctx, int task, int thread) {
    const mx_job *j = ctx;
    int64_t r0 = (int64_t)task * j->rows_per_task, r1 = r0 + j->rows_per_task;
    if (r1 > j->R) r1 = j->R;
    j->k->rows(j->p, r0, r1, thread);
}

static kiln_status mx_matmul(const kiln_mx_matrix *x, const kiln_mx_matrix *w, float *out, int64_t ldo,
                             int accumulate, kiln_pool *pool, kiln_cpu_path path) {
    if (!x || !w || (!x->mem && x->rows) || (!w->mem && w->rows))
        return kiln_error(KILN_ERR_INVALID_ARG, "kiln_mx_matmul_cpu: x or w is not an mx matrix");
    if (x->kind != w->kind || x->K != w->K)
        return kiln_error(KILN_ERR_INVALID_ARG,
                          "kiln_mx_matmul_cpu: x is mx%d with K %lld, w is mx%d with K %lld",
                          (int)x->kind, (long long)x->K, (int)w->kind, (long long)w->K);
    const int64_t N = x->rows, R = w->rows;
    if (N == 0 || R == 0) return KILN_OK;
    if (!out || ldo < R)
        return kiln_error(KILN_ERR_INVALID_ARG,
                          "kiln_mx_matmul_cpu: out is NULL or ldo %lld < R %lld", (long long)ldo,
                          (long long)R);
    const kiln_mx_kernels *k = kernels_for(path);
    const int n_threads = kiln_pool_n_threads(pool);
    kiln_mx_product p = {x, w, out, ldo, accumulate, 0, NULL, NULL, 0, NULL, 0};
    void *mem = NULL;
    if (k->layout != KILN_MX_LAYOUT_NONE) {
        KILN_TRY(prepare(&p, k->layout, k->w_rows, n_threads, &mem));
    }
    /* tasks of whole rows of W: about 4 per thread, at least 8 rows each, a multiple of the
     * kernel's rows at once */
    int64_t per = (R + 4 * (int64_t)n_threads - 1) / (4 * (int64_t)n_threads);
    if (per < 8) per = 8;
    if (k->w_rows > 1) per = (per + k->w_rows - 1) / k->w_rows * k->w_rows;
    mx_job j = {k, &p, R, per};
    kiln_pool_run(pool, (int)((R + per - 1) / per), mx_task, &j);
    kiln_free(mem);
    return KILN_OK;
}

kiln_status kiln_mx_matmul_cpu(const kiln_mx_matrix *x, const kiln_mx_matrix *w, float *out,
                               int64_t ldo, kiln_pool *pool, kiln_cpu_path path) {
    return mx_matmul(x, w, out, ldo, 0, pool, path);
}

kiln_status kiln_mx_matmul_add_cpu(const kiln_mx_matrix *x, const kiln_mx_matrix *w, float *out,
                                   int64_t ldo, kiln_pool *pool, kiln_cpu_path path) {
    return mx_matmul(x, w, out, ldo, 1, pool, path);
}

kiln_mx_quantize_block_fn kiln_mx_quantize_block_simd(void) {
#if defined(__x86_64__)
    if (kiln_cpu_select_path() != KILN_CPU_PATH_PORTABLE) return kiln_mx_quantize_block_avx2;
#endif
    return NULL;
}
