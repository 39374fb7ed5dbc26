/*
 * kernels_portable.c -- the reference inner loops in plain C (fmaf, no SIMD intrinsics).
 * This file IS the definition of docs/ARITHMETIC.md in code; the SIMD paths must equal it.
 * It has no fused matmul kernels: every dtype goes through the generic block path.
 */
#include "cpu_kernels.h"

static void p_dot_accum(float acc[KILN_DOT_LANES], const float *a, const float *b, int64_t n) {
    kiln_dot_accum_ref(acc, a, b, n);
}

static void p_dots(float *s, const float *q, const float *k, int64_t k_stride, int nk, int HS) {
    for (int j = 0; j < nk; j++) s[j] = kiln_dot_ref(q, k + j * k_stride, HS);
}

static int p_matmul_rows(const kiln_mm_args *a, int64_t r0, int64_t r1) {
    (void)a, (void)r0, (void)r1;
    return 0;
}

static void p_attn_pv(float *acc, float alpha, const float *p, const float *v, int64_t v_stride,
                      int nk, int HS) {
    for (int d = 0; d < HS; d++) acc[d] = acc[d] * alpha;
    for (int j = 0; j < nk; j++) {
        const float *vj = v + j * v_stride;
        for (int d = 0; d < HS; d++) acc[d] = fmaf(p[j], vj[d], acc[d]);
    }
}

static void p_exp_sub(float *p, const float *s, float m, int n) {
    for (int j = 0; j < n; j++) p[j] = kiln_expf(s[j] - m);
}

static void p_scale_mul(float *out, const float *x, float r, const float *w, int64_t n) {
    if (w)
        for (int64_t i = 0; i < n; i++) out[i] = (x[i] * r) * w[i];
    else
        for (int64_t i = 0; i < n; i++) out[i] = x[i] * r;
}

static void p_swiglu(float *out, const float *g, const float *u, size_t n) {
    for (size_t i = 0; i < n; i++) out[i] = kiln_swiglu(g[i], u[i]);
}

static void p_add(float *x, const float *y, size_t n) {
    for (size_t i = 0; i < n; i++) x[i] += y[i];
}

const kiln_cpu_kernels kiln_cpu_kernels_portable = {
    .path = KILN_CPU_PATH_PORTABLE,
    .dot_accum = p_dot_accum,
    .dots = p_dots,
    .matmul_rows = p_matmul_rows,
    .attn_pv = p_attn_pv,
    .exp_sub = p_exp_sub,
    .scale_mul = p_scale_mul,
    .swiglu = p_swiglu,
    .add = p_add,
};
