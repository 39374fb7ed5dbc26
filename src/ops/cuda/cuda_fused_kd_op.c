/*
 * cuda_fused_kd_op.c -- the fused distillation loss (src/ops/fused_kd.h) on the CUDA backend:
 * the op's body, the CPU's steps (src/ops/cpu/cpu_fused_kd.c) on the device in the same
 * order. kiln_fused_kd has checked the call and counted its S supervised rows.
 *
 *   - the rows are gathered as the cross-entropy's (kiln_cuda_ce_gather), its scratch layout
 *     is the CPU's (kiln_kd_layout: kiln_fused_kd_scratch_bytes bounds it);
 *   - pass 1, per chunk: the student's logits by the backend's matmul, then the row statistics
 *     (kiln_cuda_kd_pass1, cuda_fused_ce.cu: kd_pass1_rows's operations in its order);
 *   - the statistics come to the host, where the row losses, their checks and the three sums
 *     are the CPU's own code (kiln_kd_row_losses, the lane-16 sum), before anything the caller
 *     passed is written;
 *   - pass 2 is the cross-entropy's (kiln_cuda_ce_pass2) with the distillation's gradient
 *     (kiln_cuda_kd_grad) in place of the cross-entropy's.
 * In auditable mode the products are the CPU matmul's bits, so every output is the CPU's bits
 * (tests/gpu/test_cuda_train_ops.cu checks it); in an exact format's mode the head's products
 * run in the format, as the CPU's; in fast mode they are bf16 tensor-core products (the
 * backend's matmul and matmul_backward) and the row kernels take the cross-entropy's fast
 * arithmetic (cuda_fused_ce.cu): pass 1's maxima a tree over the half-warp, every exponential
 * the MUFU's 2^x of one FMA, 1 / tau and each row sum's reciprocal taken once; so the results
 * are the same run to run and within bf16 rounding of auditable mode's.
 */
#include "../fused_kd.h"

#ifdef KILN_HAVE_CUDA
#include "../fused_ce_impl.h"
#include "cuda_train.h"

#include <math.h>
#include <string.h>

/* The distillation's gradient of one chunk, for kiln_cuda_ce_pass2. */
typedef struct kd_grad_ctx {
    const kiln_fused_kd_params *p;
    const kiln_ce_scratch *sc;
    const kiln_cuda_kd_stats *r;
    const int32_t *d_tgt;
    int64_t S, teacher_ld;
    float gs;
} kd_grad_ctx;

static kiln_status kd_grad_chunk(kiln_backend *be, const void *ctx, float *z, int64_t c0,
                                 int64_t n) {
    const kd_grad_ctx *c = ctx;
    const kiln_fused_kd_params *p = c->p;
    return kiln_cuda_kd_grad(be, z, p->teacher_logits, c->teacher_ld, c->sc->idx, c->S, n, c0,
                             c->d_tgt, p->tau, p->kd_weight, p->ce_weight, c->gs, c->r);
}

/* Bytes from a to b (b >= a), in elements of size elem. */
static size_t kd_span(const void *a, const void *b, size_t elem) {
    return (size_t)((const char *)b - (const char *)a) / elem;
}

kiln_status kiln_cuda_fused_kd(kiln_backend *be, const kiln_fused_kd_params *p, int64_t S,
                               kiln_fused_kd_result *out) {
    const kiln_fused_ce_params ce = kiln_kd_ce_view(p);
    const int64_t N = p->N, H = p->H, V = p->V, cn = kiln_ce_chunk(&ce);
    const int64_t tld = p->teacher_ld > 0 ? p->teacher_ld : V;
    const int with_dh = p->dhidden != NULL, with_dw = p->dweight != NULL;
    if (!kiln_cuda_train_is_device(p->hidden) || !kiln_cuda_train_is_device(p->weight) ||
        !kiln_cuda_train_is_device(p->teacher_logits) ||
        (p->dhidden && !kiln_cuda_train_is_device(p->dhidden)) ||
        (p->dweight && !kiln_cuda_train_is_device(p->dweight)) ||
        (p->row_kl && !kiln_cuda_train_is_device(p->row_kl)) ||
        (p->row_ce && !kiln_cuda_train_is_device(p->row_ce)))
        return kiln_error(KILN_ERR_INVALID_ARG,
                          "fused_kd: on the CUDA backend hidden, weight, teacher_logits, dhidden, "
                          "dweight, row_kl and row_ce must be device memory (targets and mask stay "
                          "host memory)");
    const size_t row_bytes = (size_t)H * (p->weight_dtype == KILN_DTYPE_BF16 ? 2 : 4);
    const size_t bytes = kiln_kd_layout(S, H, cn, with_dh, with_dw, NULL, NULL, NULL);
    if (bytes == 0) return kiln_error(KILN_ERR_INVALID_ARG, "fused_kd: scratch size overflows");

    kiln_ce_scratch sc;
    kiln_kd_rows rows;
    uint8_t *block = kiln_backend_alloc(be, bytes);
    if (!block)
        return kiln_error(KILN_ERR_NOMEM, "fused_kd: out of device memory for %zu bytes of "
                          "scratch (%lld supervised rows x chunk %lld)", bytes, (long long)S,
                          (long long)cn);
    kiln_kd_layout(S, H, cn, with_dh, with_dw, block, &sc, &rows);
    /* The host's copies: positions and targets; the statistics m .. zt and ms .. bad as they
     * lie in the scratch (each run of regions consecutive); the row losses. */
    const size_t n_ce = kd_span(sc.m, sc.zt, sizeof(float)) + (size_t)S;
    const size_t n_kd = kd_span(rows.ms, rows.bad, 1) + (size_t)S * sizeof(int64_t);
    int64_t *hidx = kiln_malloc((size_t)S * sizeof(int64_t));
    int32_t *htgt = kiln_malloc((size_t)S * sizeof(int32_t));
    float *hce = kiln_malloc(n_ce * sizeof(float) + (size_t)S * sizeof(float));
    uint8_t *hkd = kiln_malloc(n_kd);
    kiln_status st = KILN_OK;
#define KD_DEV(call)                                                                           \
    do {                                                                                       \
        st = (call);                                                                           \
        if (st != KILN_OK) goto done;                                                          \
    } while (0)
    if (!hidx || !htgt || !hce || !hkd) {
        st = kiln_error(KILN_ERR_NOMEM, "fused_kd: out of host memory for %lld rows",
                        (long long)S);
        goto done;
    }
    int32_t *d_tgt = (int32_t *)(void *)sc.ones; /* `ones` is unused on the device */
    for (int64_t n = 0, i = 0; n < N; n++) {
        if ((p->mask && !p->mask[n]) || p->targets[n] < 0) continue;
        hidx[i] = n;
        htgt[i] = p->targets[n];
        i++;
    }
    KD_DEV(kiln_backend_upload(be, sc.idx, hidx, (size_t)S * sizeof(int64_t)));
    KD_DEV(kiln_backend_upload(be, d_tgt, htgt, (size_t)S * sizeof(int32_t)));
    KD_DEV(kiln_cuda_ce_gather(be, sc.hs, p->hidden, sc.idx, S, H));
    const kiln_cuda_kd_stats r = {sc.m, sc.l, sc.zt, rows.ms, rows.ls, rows.mt, rows.lt,
                                  rows.a, rows.bad};
    KD_DEV(kiln_cuda_kd_stats_init(be, &r, S));

    /* Pass 1: the online statistics, chunks ascending. */
    for (int64_t c0 = 0; c0 < V; c0 += cn) {
        const int64_t n = V - c0 < cn ? V - c0 : cn;
        kiln_ce_chunk_logits(be, &ce, sc.hs, S, c0, n, row_bytes, sc.z);
        KD_DEV(kiln_cuda_kd_pass1(be, sc.z, p->teacher_logits, tld, sc.idx, S, n, c0, d_tgt,
                                  p->tau, &r));
    }

    /* The row losses on the host, with the CPU's code, on host views of the statistics. */
    KD_DEV(kiln_backend_download(be, hce, sc.m, n_ce * sizeof(float)));
    KD_DEV(kiln_backend_download(be, hkd, rows.ms, n_kd));
    kiln_ce_scratch hsc = {0};
    kiln_kd_rows hrows;
    hsc.idx = hidx;
    hsc.m = hce;
    hsc.l = hce + kd_span(sc.m, sc.l, sizeof(float));
    hsc.zt = hce + kd_span(sc.m, sc.zt, sizeof(float));
    hsc.loss = hce + n_ce;
    {
        float **dev[7] = {&rows.ms, &rows.ls, &rows.mt, &rows.lt, &rows.a, &rows.kl, &rows.ce};
        float **host[7] = {&hrows.ms, &hrows.ls, &hrows.mt, &hrows.lt, &hrows.a, &hrows.kl,
                           &hrows.ce};
        for (int f = 0; f < 7; f++) *host[f] = (float *)(void *)(hkd + kd_span(rows.ms, *dev[f], 1));
        hrows.bad = (int64_t *)(void *)(hkd + kd_span(rows.ms, rows.bad, 1));
    }
    KD_DEV(kiln_kd_row_losses(p, &hsc, &hrows, S));
    float loss = 0.0f, kl = 0.0f, ce_part = 0.0f, gs = 0.0f;
    double loss64 = 0.0, part64 = 0.0;
    kiln_ce_reduce(&ce, hsc.loss, kiln_ce_host_sum16(hsc.loss, S), S, &loss, &gs, &loss64);
    kiln_ce_reduce(&ce, hrows.kl, kiln_ce_host_sum16(hrows.kl, S), S, &kl, &gs, &part64);
    kiln_ce_reduce(&ce, hrows.ce, kiln_ce_host_sum16(hrows.ce, S), S, &ce_part, &gs, &part64);

    /* Pass 2: the gradient per chunk, into dh and dW. */
    if (with_dh || with_dw) {
        const kd_grad_ctx g = {p, &sc, &r, d_tgt, S, tld, gs};
        KD_DEV(kiln_cuda_ce_pass2(be, &ce, &sc, S, S, cn, row_bytes, kd_grad_chunk, &g));
    }

    /* Outputs. */
    if (p->row_kl) {
        KD_DEV(kiln_backend_upload(be, rows.kl, hrows.kl, (size_t)S * sizeof(float)));
        KD_DEV(kiln_cuda_train_memset(be, p->row_kl, 0, (size_t)N * sizeof(float)));
        KD_DEV(kiln_cuda_ce_scatter_rows(be, p->row_kl, rows.kl, sc.idx, S, 1, 0));
    }
    if (p->row_ce) {
        KD_DEV(kiln_backend_upload(be, rows.ce, hrows.ce, (size_t)S * sizeof(float)));
        KD_DEV(kiln_cuda_train_memset(be, p->row_ce, 0, (size_t)N * sizeof(float)));
        KD_DEV(kiln_cuda_ce_scatter_rows(be, p->row_ce, rows.ce, sc.idx, S, 1, 0));
    }
    if (with_dh) {
        if (!p->dhidden_accumulate)
            KD_DEV(kiln_cuda_train_memset(be, p->dhidden, 0, (size_t)N * (size_t)H * sizeof(float)));
        KD_DEV(kiln_cuda_ce_scatter_rows(be, p->dhidden, sc.dh_acc, sc.idx, S, H,
                                         p->dhidden_accumulate));
    }
    KD_DEV(kiln_backend_status(be));
    if (out) *out = (kiln_fused_kd_result){loss, kl, ce_part, loss64, S, bytes};
done:
#undef KD_DEV
    /* the scratch may still be in use by enqueued work after an error: wait first */
    (void)kiln_backend_status(be);
    kiln_backend_free_buf(be, block);
    kiln_free(hidx);
    kiln_free(htgt);
    kiln_free(hce);
    kiln_free(hkd);
    return st;
}
#else
typedef int kiln_cuda_fused_kd_op_unused; /* ISO C wants a non-empty translation unit */
#endif /* KILN_HAVE_CUDA */
