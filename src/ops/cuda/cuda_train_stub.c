/*
 * cuda_train_stub.c -- the entry points of cuda_train.h in a build without CUDA: they exist in
 * every build (so adamw.c and fused_ce.c need no #ifdef) and refuse. They are never reached in
 * practice: without CUDA no backend named "cuda" can be created. With CUDA the real ones are
 * in cuda_adamw.cu and cuda_fused_ce.cu.
 */
#include "cuda_train.h"

#ifndef KILN_HAVE_CUDA
static kiln_status no_cuda(const char *what) {
    return kiln_error(KILN_ERR_UNSUPPORTED, "%s: this kiln was built without CUDA", what);
}

bool kiln_cuda_train_is_device(const void *p) {
    (void)p;
    return false;
}
kiln_status kiln_cuda_train_memset(kiln_backend *be, void *p, int byte, size_t nbytes) {
    (void)be; (void)p; (void)byte; (void)nbytes;
    return no_cuda("kiln_cuda_train_memset");
}
kiln_status kiln_cuda_adamw_step(kiln_backend *be, const kiln_cuda_adamw_param *p,
                                 const kiln_adamw_scalars *s) {
    (void)be; (void)p; (void)s;
    return no_cuda("kiln_cuda_adamw_step");
}
kiln_status kiln_cuda_adamw_step_multi(kiln_backend *be, const kiln_cuda_adamw_plan *plan,
                                       const kiln_adamw_scalars *s) {
    (void)be; (void)plan; (void)s;
    return no_cuda("kiln_cuda_adamw_step_multi");
}
kiln_status kiln_cuda_adamw_widen_bf16(kiln_backend *be, float *master, const uint16_t *w,
                                       int64_t n) {
    (void)be; (void)master; (void)w; (void)n;
    return no_cuda("kiln_cuda_adamw_widen_bf16");
}
kiln_status kiln_cuda_adamw_nonfinite(kiln_backend *be, const kiln_cuda_grad_entry *table,
                                      int P, int64_t max_n, uint64_t *bad) {
    (void)be; (void)table; (void)P; (void)max_n; (void)bad;
    return no_cuda("kiln_cuda_adamw_nonfinite");
}
kiln_status kiln_cuda_adamw_norms(kiln_backend *be, const kiln_cuda_grad_entry *table, int P,
                                  const kiln_cuda_norm_plan *plan, float *norms, float *out,
                                  int clip, float max_norm_f) {
    (void)be; (void)table; (void)P; (void)plan; (void)norms; (void)out; (void)clip;
    (void)max_norm_f;
    return no_cuda("kiln_cuda_adamw_norms");
}
kiln_status kiln_cuda_adamw_scale(kiln_backend *be, const kiln_cuda_grad_entry *table, int P,
                                  int64_t max_n, const float *coef) {
    (void)be; (void)table; (void)P; (void)max_n; (void)coef;
    return no_cuda("kiln_cuda_adamw_scale");
}
kiln_status kiln_cuda_ce_gather(kiln_backend *be, float *hs, const float *hidden,
                                const int64_t *idx, int64_t S, int64_t H) {
    (void)be; (void)hs; (void)hidden; (void)idx; (void)S; (void)H;
    return no_cuda("kiln_cuda_ce_gather");
}
kiln_status kiln_cuda_ce_init_rows(kiln_backend *be, float *m, float *l, float *zt,
                                   const float *stats, const int64_t *idx, int64_t S) {
    (void)be; (void)m; (void)l; (void)zt; (void)stats; (void)idx; (void)S;
    return no_cuda("kiln_cuda_ce_init_rows");
}
kiln_status kiln_cuda_ce_pass1(kiln_backend *be, const float *z, int64_t S, int64_t n,
                               int64_t c0, const int32_t *tgt, float *m, float *l, float *zt) {
    (void)be; (void)z; (void)S; (void)n; (void)c0; (void)tgt; (void)m; (void)l; (void)zt;
    return no_cuda("kiln_cuda_ce_pass1");
}
kiln_status kiln_cuda_ce_stats_out(kiln_backend *be, float *stats, const float *m,
                                   const float *l, const float *zt, const int64_t *idx,
                                   int64_t S) {
    (void)be; (void)stats; (void)m; (void)l; (void)zt; (void)idx; (void)S;
    return no_cuda("kiln_cuda_ce_stats_out");
}
kiln_status kiln_cuda_ce_grad(kiln_backend *be, float *z, int64_t S, int64_t n, int64_t c0,
                              const int32_t *tgt, const float *m, const float *l, float gs) {
    (void)be; (void)z; (void)S; (void)n; (void)c0; (void)tgt; (void)m; (void)l; (void)gs;
    return no_cuda("kiln_cuda_ce_grad");
}
kiln_status kiln_cuda_ce_transpose(kiln_backend *be, float *dst, const void *src, int src_bf16,
                                   int64_t R, int64_t C) {
    (void)be; (void)dst; (void)src; (void)src_bf16; (void)R; (void)C;
    return no_cuda("kiln_cuda_ce_transpose");
}
kiln_status kiln_cuda_ce_add(kiln_backend *be, float *x, const float *y, size_t n) {
    (void)be; (void)x; (void)y; (void)n;
    return no_cuda("kiln_cuda_ce_add");
}
kiln_status kiln_cuda_ce_scatter_rows(kiln_backend *be, float *dst, const float *src,
                                      const int64_t *idx, int64_t S, int64_t H, int accumulate) {
    (void)be; (void)dst; (void)src; (void)idx; (void)S; (void)H; (void)accumulate;
    return no_cuda("kiln_cuda_ce_scatter_rows");
}
bool kiln_cuda_ce_is_fast(kiln_backend *be) {
    (void)be;
    return false;
}
kiln_status kiln_cuda_ce_pass1_fast(kiln_backend *be, const float *z, int64_t S, int64_t n,
                                    int64_t c0, const int32_t *tgt, float *m, float *l,
                                    float *zt) {
    (void)be; (void)z; (void)S; (void)n; (void)c0; (void)tgt; (void)m; (void)l; (void)zt;
    return no_cuda("kiln_cuda_ce_pass1_fast");
}
kiln_status kiln_cuda_ce_grad_fast(kiln_backend *be, float *z, int64_t S, int64_t Sp, int64_t n,
                                   int64_t c0, const int32_t *tgt, const float *m,
                                   const float *l, float gs) {
    (void)be; (void)z; (void)S; (void)Sp; (void)n; (void)c0; (void)tgt; (void)m; (void)l;
    (void)gs;
    return no_cuda("kiln_cuda_ce_grad_fast");
}
kiln_status kiln_cuda_ce_gather_bf16(kiln_backend *be, uint16_t *hsb, int64_t ld,
                                     const float *hidden, const int64_t *idx, int64_t S,
                                     int64_t Sp, int64_t H) {
    (void)be; (void)hsb; (void)ld; (void)hidden; (void)idx; (void)S; (void)Sp; (void)H;
    return no_cuda("kiln_cuda_ce_gather_bf16");
}
kiln_status kiln_cuda_ce_grad_bf16(kiln_backend *be, uint16_t *g, int64_t ldg, const float *z,
                                   int64_t S, int64_t Sp, int64_t n, int64_t c0,
                                   const int32_t *tgt, const float *m, const float *l, float gs) {
    (void)be; (void)g; (void)ldg; (void)z; (void)S; (void)Sp; (void)n; (void)c0; (void)tgt;
    (void)m; (void)l; (void)gs;
    return no_cuda("kiln_cuda_ce_grad_bf16");
}
kiln_status kiln_cuda_ce_rows_fast(kiln_backend *be, void *z, int64_t ldz, int64_t R,
                                   int64_t Rs, int64_t V, int z16, const int32_t *tgt, float *m,
                                   float *l, float *zt, float gs) {
    (void)be; (void)z; (void)ldz; (void)R; (void)Rs; (void)V; (void)z16; (void)tgt; (void)m; (void)l;
    (void)zt; (void)gs;
    return no_cuda("kiln_cuda_ce_rows_fast");
}
bool kiln_cuda_ce_weight_in_place(const void *w, size_t row_bytes, kiln_dtype dt) {
    (void)w; (void)row_bytes; (void)dt;
    return false;
}
kiln_status kiln_cuda_ce_weight_bf16(kiln_backend *be, uint16_t *dst, int64_t ld, const void *w,
                                     size_t row_bytes, kiln_dtype dt, int64_t n, int64_t H) {
    (void)be; (void)dst; (void)ld; (void)w; (void)row_bytes; (void)dt; (void)n; (void)H;
    return no_cuda("kiln_cuda_ce_weight_bf16");
}
kiln_status kiln_cuda_ce_linear_bf16(kiln_backend *be, float *z, const uint16_t *hsb,
                                     int64_t ldh, const void *w, size_t row_bytes, kiln_dtype dt,
                                     int64_t n, int64_t H, int64_t S) {
    (void)be; (void)z; (void)hsb; (void)ldh; (void)w; (void)row_bytes; (void)dt; (void)n;
    (void)H; (void)S;
    return no_cuda("kiln_cuda_ce_linear_bf16");
}
kiln_status kiln_cuda_ce_gemm_bf16(kiln_backend *be, int trans_a, int trans_b, int64_t M,
                                   int64_t N, int64_t K, const uint16_t *A, int64_t lda,
                                   const uint16_t *B, int64_t ldb, float *D, int64_t ldd,
                                   int accumulate) {
    (void)be; (void)trans_a; (void)trans_b; (void)M; (void)N; (void)K; (void)A; (void)lda;
    (void)B; (void)ldb; (void)D; (void)ldd; (void)accumulate;
    return no_cuda("kiln_cuda_ce_gemm_bf16");
}
kiln_status kiln_cuda_ce_gemm_bf16_out16(kiln_backend *be, int trans_a, int trans_b, int64_t M,
                                         int64_t N, int64_t K, const uint16_t *A, int64_t lda,
                                         const uint16_t *B, int64_t ldb, uint16_t *D,
                                         int64_t ldd) {
    (void)be; (void)trans_a; (void)trans_b; (void)M; (void)N; (void)K; (void)A; (void)lda;
    (void)B; (void)ldb; (void)D; (void)ldd;
    return no_cuda("kiln_cuda_ce_gemm_bf16_out16");
}
void kiln_cuda_ce_set_legacy(int on) { (void)on; }
int kiln_cuda_ce_legacy(void) { return 0; }
#else
typedef int kiln_cuda_train_stub_unused; /* ISO C wants a non-empty translation unit */
#endif
