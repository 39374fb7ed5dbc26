/*
 * fused_ce.c -- fused linear cross-entropy: loss, dh and dW without the N x V logits. The op's
 * entry (kiln_fused_ce: it checks the call and counts the supervised rows, then runs the
 * backend's fused_ce, ops.h) and what every backend's body shares: the scratch layout, the
 * per-row loss and its reductions, kiln's log. The bodies: src/ops/cpu/cpu_fused_ce.c (the
 * reference) and src/ops/cuda/cuda_fused_ce_op.c.
 *
 * The math (docs/ARITHMETIC.md, "Fused linear cross-entropy"), for the S supervised rows
 * hs(S,H) gathered in ascending position order and the vocabulary in chunks [c0, c0+n):
 *
 *   pass 1, per chunk:  z(S,n) = hs @ W[c0:c0+n]^T             (backend matmul)
 *                       per row: online log-sum-exp (m, l), and z at the target
 *   per row:            loss_i = (m_i - z_t) + log(l_i)
 *   pass 2, per chunk:  z again;  g = (exp(z - m_i) / l_i - onehot) * gs     (in place)
 *                       dh_acc(S,H) += g @ W[c0:c0+n]        (matmul on W chunk transposed)
 *                       dW[c0:c0+n] += g^T @ hs               (matmul on g and hs transposed)
 *
 * Everything a thread computes is one output element in a fixed order, so the results are the
 * same bits for any thread count; a device backend runs the same steps in the same order, and
 * computes the per-row loss, its check and the two sums (O(S) scalars) on the host from the
 * downloaded row statistics, with the very code the CPU runs (kiln_ce_row_losses, the lane-16
 * sum).
 */
#include "fused_ce.h"

#include "../base/kmath.h"
#include "fused_ce_impl.h"

#include <math.h>
#include <string.h>

kiln_fused_ce_params kiln_fused_ce_default_params(void) {
    kiln_fused_ce_params p;
    memset(&p, 0, sizeof p);
    p.weight_dtype = KILN_DTYPE_F32;
    p.reduction = KILN_CE_REDUCTION_MEAN;
    p.scale = 1.0f;
    return p;
}

/* ---- log ---------------------------------------------------------------------------------- */

/* Constants of kiln_fused_ce_logf: ln2 split so that e * LN2_HI is exact for |e| < 2^8
 * (LN2_HI has 9 significant bits); the polynomial is the classic degree-8 fit of
 * (log(1+f) - f + f^2/2) / f^3 on [sqrt(1/2) - 1, sqrt(2) - 1] (Cephes' logf coefficients). */
#define CE_LN2_HI 0.693359375f
#define CE_LN2_LO -2.12194440e-4f
#define CE_SQRT2 1.41421356237309504880f

float kiln_fused_ce_logf(float x) {
    if (x != x) return x + x;
    if (x < 0.0f) return NAN;
    if (x == 0.0f) return -INFINITY;
    if (x == INFINITY) return x;
    int32_t e = 0;
    uint32_t u = kiln_f32_bits(x);
    if ((u >> 23) == 0) { /* subnormal: scale into the normal range (exact) */
        x = x * 8388608.0f;
        u = kiln_f32_bits(x);
        e = -23;
    }
    e += (int32_t)(u >> 23) - 127;
    float mant = kiln_bits_f32((u & 0x007fffffu) | 0x3f800000u); /* [1, 2) */
    if (mant > CE_SQRT2) {                                        /* -> [sqrt(2)/2, sqrt(2)] */
        mant = mant * 0.5f;
        e += 1;
    }
    float f = mant - 1.0f; /* exact */
    float z = f * f;
    float p = 7.0376836292e-2f;
    p = fmaf(p, f, -1.1514610310e-1f);
    p = fmaf(p, f, 1.1676998740e-1f);
    p = fmaf(p, f, -1.2420140846e-1f);
    p = fmaf(p, f, 1.4249322787e-1f);
    p = fmaf(p, f, -1.6668057665e-1f);
    p = fmaf(p, f, 2.0000714765e-1f);
    p = fmaf(p, f, -2.4999993993e-1f);
    p = fmaf(p, f, 3.3333331174e-1f);
    float ef = (float)e;
    float y = (p * f) * z;
    y = fmaf(ef, CE_LN2_LO, y);
    y = fmaf(z, -0.5f, y);
    float r = f + y;
    return fmaf(ef, CE_LN2_HI, r);
}

/* ---- scratch ------------------------------------------------------------------------------ */

/* Carve the scratch regions from one block; returns the total bytes (0 on overflow). With
 * base NULL only sizes. Every region starts at a multiple of 64 bytes (a 16-byte alignment
 * class for the GEMM module). Sp (>= S): the padded rows of fast mode (S otherwise); w_copy
 * (KILN_CE_BF16): the W chunk is converted into wb. Absent regions have NULL pointers. The
 * CPU and auditable layout is (S, S, ..., KILN_CE_FULL); a KILN_CE_LEAN layout with Sp == S is
 * a subset of it, hence never larger; a KILN_CE_BF16 one is used only where it is not larger
 * either. */
size_t kiln_ce_layout(int64_t S, int64_t Sp, int64_t H, int64_t cn, int with_dh, int with_dw,
                      kiln_ce_kind kind, int w_copy, int64_t rb, uint8_t *base,
                      kiln_ce_scratch *sc) {
    size_t total = 0;
    int ok = 1;
    if (Sp < S || (kind == KILN_CE_ROWS && (rb < 1 || rb > Sp))) return 0;
    const int full = kind == KILN_CE_FULL, bf = kind == KILN_CE_BF16, rows = kind == KILN_CE_ROWS;
    /* z's rows: Sp, S (KILN_CE_BF16) or rb (KILN_CE_ROWS) */
    const uint64_t uz = (uint64_t)(rows ? rb : bf ? S : Sp);
    uint64_t uS = (uint64_t)S, uSp = (uint64_t)Sp, uH = (uint64_t)H, uc = (uint64_t)cn;
    uint64_t uldH = (uint64_t)kiln_ce_bf16_ld(H), uldc = (uint64_t)kiln_ce_bf16_ld(cn);
    uint64_t ones_n = uc > uS ? uc : uS;
#define CE_REGION(field, type, count, want)                                                    \
    do {                                                                                       \
        size_t bytes_ = 0;                                                                     \
        if (want) {                                                                            \
            if (kiln_mul_overflow((size_t)(count), sizeof(type), &bytes_) ||                   \
                kiln_add_overflow(bytes_, 63, &bytes_))                                        \
                ok = 0;                                                                        \
            bytes_ &= ~(size_t)63;                                                             \
        }                                                                                      \
        if (base && sc) sc->field = (want) ? (type *)(void *)(base + total) : NULL;            \
        if (kiln_add_overflow(total, bytes_, &total)) ok = 0;                                  \
    } while (0)
    uint64_t SH, Sc, cH, SpH, SpldH, Spldc, cldH, zc;
    if (kiln_mul_overflow_u64(uS, uH, &SH) || kiln_mul_overflow_u64(uS, uc, &Sc) ||
        kiln_mul_overflow_u64(uz, uc, &zc) || zc > SIZE_MAX ||
        kiln_mul_overflow_u64(uc, uH, &cH) || kiln_mul_overflow_u64(uSp, uH, &SpH) ||
        kiln_mul_overflow_u64(uSp, uldH, &SpldH) ||
        kiln_mul_overflow_u64(uSp, uldc, &Spldc) || kiln_mul_overflow_u64(uc, uldH, &cldH) ||
        SpH > SIZE_MAX || cH > SIZE_MAX || SpldH > SIZE_MAX ||
        Spldc > SIZE_MAX || cldH > SIZE_MAX)
        return 0;
    CE_REGION(idx, int64_t, uS, 1);
    CE_REGION(m, float, uS, 1);
    CE_REGION(l, float, uS, 1);
    CE_REGION(zt, float, uS, 1);
    CE_REGION(loss, float, uS, 1);
    CE_REGION(ones, float, ones_n, 1);
    CE_REGION(hs, float, SpH, !bf && !rows);
    CE_REGION(z, float, zc, 1);
    CE_REGION(hsb, uint16_t, SpldH, bf || rows);
    CE_REGION(gb, uint16_t, Spldc, bf && (with_dh || with_dw));
    CE_REGION(wb, uint16_t, cldH, bf && with_dh && w_copy);
    CE_REGION(hT, float, SH, with_dw && full);
    CE_REGION(gT, float, Sc, with_dw && full);
    CE_REGION(wpart, float, cH, with_dw && full);
    CE_REGION(dh_acc, float, SpH, with_dh);
    CE_REGION(dpart, float, SH, with_dh && full);
    CE_REGION(wT, float, cH, with_dh && full);
#undef CE_REGION
    return ok ? total : 0;
}

size_t kiln_fused_ce_scratch_bytes(int64_t S, int64_t H, int64_t V, int64_t chunk, int with_dh,
                                   int with_dw) {
    if (S <= 0 || H <= 0 || V <= 0 || chunk < 0) return 0;
    int64_t cn = chunk == 0 ? KILN_FUSED_CE_DEFAULT_CHUNK : chunk;
    if (cn > V) cn = V;
    return kiln_ce_layout(S, S, H, cn, with_dh, with_dw, KILN_CE_FULL, 0, 0, NULL, NULL);
}

size_t kiln_fused_ce_row_block_bytes(int64_t S, int64_t H, int64_t V, int64_t row_block,
                                     int with_dh, int with_dw, int logits_f32) {
    if (S <= 0 || H <= 0 || V <= 0 || row_block <= 0 || S > INT32_MAX) return 0;
    const int64_t Sp = (S + 7) & ~(int64_t)7;
    return kiln_ce_layout(S, Sp, H, kiln_ce_rows_zcols(V, kiln_ce_rows_z16(V, logits_f32)),
                          with_dh, with_dw, KILN_CE_ROWS, 0, kiln_ce_rows_of(row_block, Sp), NULL,
                          NULL);
}

/* ---- helpers ------------------------------------------------------------------------------ */

/* The (n, H) tensor view of the weight rows [c0, c0+n). */
kiln_tensor kiln_ce_weight_chunk(const kiln_fused_ce_params *p, int64_t c0, int64_t n,
                                 size_t row_bytes) {
    kiln_tensor wc;
    memset(&wc, 0, sizeof wc);
    wc.name = "fused_ce.weight_chunk";
    wc.dtype = p->weight_dtype;
    wc.n_dims = 2;
    wc.shape[0] = n;
    wc.shape[1] = p->H;
    wc.data = (const uint8_t *)p->weight + (size_t)c0 * row_bytes;
    wc.nbytes = (size_t)n * row_bytes;
    return wc;
}

/* z(S, n) = hs(S, H) @ W[c0 : c0+n]^T with the backend's matmul. */
void kiln_ce_chunk_logits(kiln_backend *be, const kiln_fused_ce_params *p, const float *hs,
                          int64_t S, int64_t c0, int64_t n, size_t row_bytes, float *z) {
    kiln_tensor wc = kiln_ce_weight_chunk(p, c0, n, row_bytes);
    be->i->matmul(be, z, hs, &wc, NULL, (int)S);
}

/* A (R, C) f32 tensor view of caller scratch, for the backend's matmul. */
kiln_tensor kiln_ce_f32_view(const char *name, const float *data, int64_t R, int64_t C) {
    kiln_tensor t;
    memset(&t, 0, sizeof t);
    t.name = name;
    t.dtype = KILN_DTYPE_F32;
    t.n_dims = 2;
    t.shape[0] = R;
    t.shape[1] = C;
    t.data = data;
    t.nbytes = (size_t)R * (size_t)C * sizeof(float);
    return t;
}

/* ---- the op ------------------------------------------------------------------------------- */

/* The checks kiln_fused_ce makes on p's sizes, pointers and scalars, before its rows; op names
 * the call in the messages (the distillation loss checks its view of itself with them). */
kiln_status kiln_ce_check_call(const char *op, const kiln_backend *be,
                               const kiln_fused_ce_params *p) {
    if (p->N <= 0 || p->H <= 0 || p->V <= 0)
        return kiln_error(KILN_ERR_INVALID_ARG, "%s: N %lld, H %lld, V %lld must be > 0", op,
                          (long long)p->N, (long long)p->H, (long long)p->V);
    if (p->N > INT32_MAX || p->V > INT32_MAX || p->H > INT32_MAX)
        return kiln_error(KILN_ERR_INVALID_ARG, "%s: N, H or V above 2^31 - 1", op);
    if (!(p->hidden || p->hidden16) || !p->weight || !p->targets)
        return kiln_error(KILN_ERR_INVALID_ARG, "%s: hidden, weight or targets is NULL", op);
    if (p->hidden && p->hidden16)
        return kiln_error(KILN_ERR_INVALID_ARG, "%s: hidden and hidden16 both set (one of them)",
                          op);
    if (p->hidden_ld != 0 && p->hidden_ld < p->H)
        return kiln_error(KILN_ERR_INVALID_ARG, "%s: hidden_ld %lld < H %lld (rows would overlap)",
                          op, (long long)p->hidden_ld, (long long)p->H);
    if (!be->i->host_memory && (p->hidden16 || (p->hidden_ld != 0 && p->hidden_ld != p->H)))
        return kiln_error(KILN_ERR_UNSUPPORTED, "%s: the %s backend reads f32 hidden states "
                          "with rows back to back (hidden16 and a row stride are the CPU's)",
                          op, be->i->name ? be->i->name : "?");
    if (p->weight_dtype != KILN_DTYPE_F32 && p->weight_dtype != KILN_DTYPE_BF16)
        return kiln_error(KILN_ERR_UNSUPPORTED,
                          "%s: weight dtype %d: only f32 and bf16 are supported", op,
                          (int)p->weight_dtype);
    if (p->reduction != KILN_CE_REDUCTION_MEAN && p->reduction != KILN_CE_REDUCTION_SUM)
        return kiln_error(KILN_ERR_INVALID_ARG, "%s: reduction %d is not MEAN or SUM", op,
                          (int)p->reduction);
    if (!isfinite(p->scale))
        return kiln_error(KILN_ERR_INVALID_ARG, "%s: scale %g is not finite", op,
                          (double)p->scale);
    if (p->chunk < 0)
        return kiln_error(KILN_ERR_INVALID_ARG, "%s: chunk %lld < 0", op, (long long)p->chunk);
    if (p->row_block < 0)
        return kiln_error(KILN_ERR_INVALID_ARG, "%s: row_block %lld < 0", op,
                          (long long)p->row_block);
    size_t tmp;
    if (kiln_mul_overflow((size_t)p->N, (size_t)p->H, &tmp) ||
        kiln_mul_overflow(tmp, sizeof(float), &tmp) ||
        kiln_mul_overflow((size_t)p->V, (size_t)p->H, &tmp) ||
        kiln_mul_overflow(tmp, sizeof(float), &tmp))
        return kiln_error(KILN_ERR_INVALID_ARG, "%s: N x H or V x H overflows", op);
    /* the last row of a strided hidden ends at (N - 1) x ld + H elements */
    if (p->hidden_ld > 0 && (kiln_mul_overflow((size_t)(p->N - 1), (size_t)p->hidden_ld, &tmp) ||
                             kiln_add_overflow(tmp, (size_t)p->H, &tmp) ||
                             kiln_mul_overflow(tmp, sizeof(float), &tmp)))
        return kiln_error(KILN_ERR_INVALID_ARG, "%s: (N - 1) x hidden_ld + H overflows", op);
    return KILN_OK;
}

static kiln_status check_params(const kiln_backend *be, const kiln_fused_ce_params *p) {
    if (!be || !p) return kiln_error(KILN_ERR_INVALID_ARG, "fused_ce: backend or params is NULL");
    if (!be->i || !be->i->fused_ce || !be->i->fused_ce_workspace)
        return kiln_error(KILN_ERR_UNSUPPORTED, "fused_ce: the %s backend has no fused linear "
                          "cross-entropy", be->i && be->i->name ? be->i->name : "?");
    return kiln_ce_check_call("fused_ce", be, p);
}

/* loss_i = (m - zt) + log(l) for the S rows; a non-finite one is an error naming its
 * position (idx: the rows' positions). */
kiln_status kiln_ce_row_losses(const int64_t *idx, const float *m, const float *l,
                               const float *zt, float *loss, int64_t S) {
    for (int64_t i = 0; i < S; i++) {
        float li = kiln_ce_row_loss(m[i], l[i], zt[i]);
        if (!isfinite(li))
            return kiln_error(
                KILN_ERR_RANGE,
                "fused_ce: position %lld (supervised row %lld): loss is not finite (max logit "
                "%g, sum of exponentials %g, target logit %g): non-finite hidden states or "
                "weights, or logits beyond the float range",
                (long long)idx[i], (long long)i, (double)m[i], (double)l[i], (double)zt[i]);
        loss[i] = li;
    }
    return KILN_OK;
}

/* The reduced loss, the gradient factor and the float64 loss from the row losses and their
 * lane-16 sum. */
void kiln_ce_reduce(const kiln_fused_ce_params *p, const float *row_loss, float sum, int64_t S,
                    float *loss, float *gs, double *loss64) {
    const int mean = p->reduction == KILN_CE_REDUCTION_MEAN;
    *gs = mean ? p->scale / (float)S : p->scale;
    if (!row_loss) return; /* gs alone: it does not depend on the losses */
    double sum64 = 0.0;
    for (int64_t i = 0; i < S; i++) sum64 += (double)row_loss[i];
    if (mean) {
        *loss = (sum / (float)S) * p->scale;
        *loss64 = sum64 / (double)S * (double)p->scale;
    } else {
        *loss = sum * p->scale;
        *loss64 = sum64 * (double)p->scale;
    }
}

/* The lane-16 sum of v[0..n) on the host without a ones array: kiln_dot_accum_ref's lanes with
 * b = 1 (fmaf(v, 1, acc)), then the fixed tree -- the bits of the CPU backend's lane_sum on
 * any SIMD path. */
float kiln_ce_host_sum16(const float *v, int64_t n) {
    float acc[KILN_DOT_LANES] = {0};
    for (int64_t i = 0; i < n; i++)
        acc[i % KILN_DOT_LANES] = fmaf(v[i], 1.0f, acc[i % KILN_DOT_LANES]);
    return kiln_lane16_reduce(acc);
}

kiln_status kiln_ce_count_supervised(const char *op, const kiln_fused_ce_params *p,
                                     int64_t *S_out) {
    /* Supervised rows: mask (or all) and target >= 0. Their targets must be < V. */
    int64_t S = 0;
    for (int64_t n = 0; n < p->N; n++) {
        if ((p->mask && !p->mask[n]) || p->targets[n] < 0) continue;
        if (p->targets[n] >= p->V)
            return kiln_error(KILN_ERR_RANGE,
                              "%s: position %lld: target %d >= vocabulary size %lld", op,
                              (long long)n, (int)p->targets[n], (long long)p->V);
        S++;
    }
    if (S == 0)
        return kiln_error(KILN_ERR_INVALID_ARG,
                          "%s: no supervised positions (the mask and targets select none "
                          "of the %lld positions)", op, (long long)p->N);
    *S_out = S;
    return KILN_OK;
}

kiln_status kiln_fused_ce_supervised(const kiln_fused_ce_params *p, int64_t *S_out) {
    return kiln_ce_count_supervised("fused_ce", p, S_out);
}

kiln_status kiln_fused_ce(kiln_backend *be, const kiln_fused_ce_params *p,
                          kiln_fused_ce_result *out) {
    if (out) memset(out, 0, sizeof *out);
    KILN_TRY(check_params(be, p));
    int64_t S = 0;
    KILN_TRY(kiln_fused_ce_supervised(p, &S));
    return be->i->fused_ce(be, p, S, out);
}

kiln_status kiln_fused_ce_workspace(kiln_backend *be, const kiln_fused_ce_params *p,
                                    size_t *bytes) {
    if (!bytes) return kiln_error(KILN_ERR_INVALID_ARG, "fused_ce_workspace: bytes is NULL");
    *bytes = 0;
    KILN_TRY(check_params(be, p));
    int64_t S = 0;
    KILN_TRY(kiln_fused_ce_supervised(p, &S));
    *bytes = be->i->fused_ce_workspace(be, p, S);
    if (*bytes == 0) return kiln_error(KILN_ERR_INVALID_ARG, "fused_ce: scratch size overflows");
    return KILN_OK;
}

kiln_status kiln_fused_ce_loss_from_stats(const kiln_fused_ce_params *p, const float *row_stats,
                                          kiln_fused_ce_result *out) {
    if (out) memset(out, 0, sizeof *out);
    if (!p || !row_stats || !p->targets || p->N < 1)
        return kiln_error(KILN_ERR_INVALID_ARG, "fused_ce_loss_from_stats: NULL parameters or no rows");
    const int64_t N = p->N;
    int64_t S = 0;
    KILN_TRY(kiln_fused_ce_supervised(p, &S));
    /* the device path's arrays: positions, then m, l, zt and the row losses, supervised order */
    int64_t *idx = kiln_malloc((size_t)S * sizeof(int64_t));
    float *f = kiln_malloc(4 * (size_t)S * sizeof(float));
    if (!idx || !f) {
        kiln_free(idx);
        kiln_free(f);
        return kiln_error(KILN_ERR_NOMEM, "fused_ce: out of host memory for %lld rows", (long long)S);
    }
    float *m = f, *l = f + S, *zt = f + 2 * S, *loss_rows = f + 3 * S;
    for (int64_t n = 0, i = 0; n < N; n++) {
        if ((p->mask && !p->mask[n]) || p->targets[n] < 0) continue;
        idx[i] = n;
        m[i] = row_stats[3 * n];
        l[i] = row_stats[3 * n + 1];
        zt[i] = row_stats[3 * n + 2];
        i++;
    }
    kiln_status st = kiln_ce_row_losses(idx, m, l, zt, loss_rows, S);
    if (st == KILN_OK && out) {
        float gs;
        kiln_ce_reduce(p, loss_rows, kiln_ce_host_sum16(loss_rows, S), S, &out->loss, &gs,
                       &out->loss_f64);
        out->n_supervised = S;
    }
    kiln_free(idx);
    kiln_free(f);
    return st;
}

