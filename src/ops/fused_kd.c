/*
 * fused_kd.c -- the fused distillation loss (fused_kd.h): the op's entry (kiln_fused_kd: it
 * checks the call and counts the supervised rows, then runs the backend's fused_kd, ops.h) and
 * what a backend's body needs beyond the cross-entropy's shared pieces (fused_ce_impl.h): the
 * call's view of itself as a cross-entropy call, its scratch, and the per-row losses from
 * pass 1's statistics. The body: src/ops/cpu/cpu_fused_kd.c.
 *
 * The student side of the call -- hidden states, head, targets, mask, chunks, reduction and
 * the two gradient products -- is kiln_fused_ce's, so the entry checks it with the same code
 * (kiln_ce_check_call on kiln_kd_ce_view) and the body gathers rows and multiplies gradients
 * with the cross-entropy's helpers; what is the distillation's own is the teacher, the
 * temperature and the weights.
 */
#include "fused_kd.h"

#include "fused_ce_impl.h"

#include <math.h>
#include <string.h>

kiln_fused_kd_params kiln_fused_kd_default_params(void) {
    /* every field not named: zero / NULL */
    return (kiln_fused_kd_params){.weight_dtype = KILN_DTYPE_F32, .tau = 1.0f, .kd_weight = 1.0f,
                                  .ce_weight = 0.0f, .reduction = KILN_CE_REDUCTION_MEAN,
                                  .scale = 1.0f};
}

kiln_fused_ce_params kiln_kd_ce_view(const kiln_fused_kd_params *p) {
    /* every field not named: zero / NULL, as kiln_fused_ce_default_params leaves them */
    return (kiln_fused_ce_params){
        .N = p->N, .H = p->H, .V = p->V, .hidden = p->hidden, .hidden_ld = p->hidden_ld,
        .weight = p->weight, .weight_dtype = p->weight_dtype, .targets = p->targets,
        .mask = p->mask, .reduction = p->reduction, .scale = p->scale, .chunk = p->chunk,
        .dhidden = p->dhidden, .dhidden_accumulate = p->dhidden_accumulate,
        .dweight = p->dweight};
}

/* ---- scratch ------------------------------------------------------------------------------ */

size_t kiln_kd_layout(int64_t S, int64_t H, int64_t cn, int with_dh, int with_dw, uint8_t *base,
                      kiln_ce_scratch *sc, kiln_kd_rows *rows) {
    size_t total = kiln_ce_layout(S, S, H, cn, with_dh, with_dw, KILN_CE_FULL, 0, 0, base, sc);
    if (total == 0) return 0;
    /* the rows' regions: 7 float arrays and one int64 array of S, each from a multiple of 64
     * bytes (kiln_ce_layout's total is one) */
    size_t f_bytes, i_bytes, tail;
    if (kiln_mul_overflow((size_t)S, sizeof(float), &f_bytes) ||
        kiln_add_overflow(f_bytes, 63, &f_bytes) ||
        kiln_mul_overflow((size_t)S, sizeof(int64_t), &i_bytes) ||
        kiln_add_overflow(i_bytes, 63, &i_bytes))
        return 0;
    f_bytes &= ~(size_t)63;
    i_bytes &= ~(size_t)63;
    if (kiln_mul_overflow(f_bytes, 7, &tail) || kiln_add_overflow(tail, i_bytes, &tail) ||
        kiln_add_overflow(total, tail, &tail))
        return 0;
    if (base && rows) {
        float **fields[7] = {&rows->ms, &rows->ls, &rows->mt, &rows->lt,
                             &rows->a,  &rows->kl, &rows->ce};
        uint8_t *at = base + total;
        for (int f = 0; f < 7; f++, at += f_bytes) *fields[f] = (float *)(void *)at;
        rows->bad = (int64_t *)(void *)at;
    }
    return tail;
}

size_t kiln_fused_kd_scratch_bytes(int64_t S, int64_t H, int64_t V, int64_t chunk, int with_dh,
                                   int with_dw) {
    if (S <= 0 || H <= 0 || V <= 0 || chunk < 0) return 0;
    int64_t cn = chunk == 0 ? KILN_FUSED_CE_DEFAULT_CHUNK : chunk;
    if (cn > V) cn = V;
    return kiln_kd_layout(S, H, cn, with_dh, with_dw, NULL, NULL, NULL);
}

/* ---- the row losses ------------------------------------------------------------------------ */

kiln_status kiln_kd_row_losses(const kiln_fused_kd_params *p, kiln_ce_scratch *sc,
                               kiln_kd_rows *rows, int64_t S) {
    const float kd_coef = (p->kd_weight * p->tau) * p->tau; /* kd_weight * tau^2 */
    for (int64_t i = 0; i < S; i++) {
        if (rows->bad[i] >= 0)
            return kiln_error(KILN_ERR_RANGE,
                              "fused_kd: position %lld (supervised row %lld): the teacher's "
                              "logit of column %lld is not finite", (long long)sc->idx[i],
                              (long long)i, (long long)rows->bad[i]);
        const float ce = kiln_ce_row_loss(sc->m[i], sc->l[i], sc->zt[i]);
        const float kl = ((rows->a[i] / rows->lt[i]) - (rows->mt[i] - rows->ms[i])) +
                         kiln_fused_ce_logf(rows->ls[i] / rows->lt[i]);
        const float loss = (kd_coef * kl) + (p->ce_weight * ce);
        if (!isfinite(kl) || !isfinite(ce) || !isfinite(loss))
            return kiln_error(
                KILN_ERR_RANGE,
                "fused_kd: position %lld (supervised row %lld): loss is not finite (kl %g, "
                "ce %g; student max logit %g, target logit %g; teacher max logit / tau %g): "
                "non-finite hidden states or weights, or logits beyond the float range",
                (long long)sc->idx[i], (long long)i, (double)kl, (double)ce, (double)sc->m[i],
                (double)sc->zt[i], (double)rows->mt[i]);
        rows->kl[i] = kl;
        rows->ce[i] = ce;
        sc->loss[i] = loss;
    }
    return KILN_OK;
}

/* ---- the op ------------------------------------------------------------------------------- */

/* The distillation's own parameters: the teacher, the temperature and the weights. */
static kiln_status check_teacher(const kiln_fused_kd_params *p) {
    if (!p->teacher_logits)
        return kiln_error(KILN_ERR_INVALID_ARG, "fused_kd: teacher_logits is NULL");
    if (p->teacher_ld != 0 && p->teacher_ld < p->V)
        return kiln_error(KILN_ERR_INVALID_ARG,
                          "fused_kd: teacher_ld %lld < V %lld (rows would overlap)",
                          (long long)p->teacher_ld, (long long)p->V);
    /* the last teacher row ends at (N - 1) x ld + V elements */
    size_t tmp;
    const int64_t ld = p->teacher_ld > 0 ? p->teacher_ld : p->V;
    if (kiln_mul_overflow((size_t)(p->N - 1), (size_t)ld, &tmp) ||
        kiln_add_overflow(tmp, (size_t)p->V, &tmp) || kiln_mul_overflow(tmp, sizeof(float), &tmp))
        return kiln_error(KILN_ERR_INVALID_ARG, "fused_kd: (N - 1) x teacher_ld + V overflows");
    if (!(isfinite(p->tau) && p->tau > 0.0f))
        return kiln_error(KILN_ERR_INVALID_ARG, "fused_kd: temperature tau %g must be finite "
                          "and > 0", (double)p->tau);
    if (!(isfinite(p->kd_weight) && p->kd_weight >= 0.0f) ||
        !(isfinite(p->ce_weight) && p->ce_weight >= 0.0f))
        return kiln_error(KILN_ERR_INVALID_ARG, "fused_kd: kd_weight %g and ce_weight %g must "
                          "be finite and >= 0", (double)p->kd_weight, (double)p->ce_weight);
    if (p->kd_weight == 0.0f && p->ce_weight == 0.0f)
        return kiln_error(KILN_ERR_INVALID_ARG,
                          "fused_kd: kd_weight and ce_weight are both 0 (no loss)");
    return KILN_OK;
}

kiln_status kiln_fused_kd(kiln_backend *be, const kiln_fused_kd_params *p,
                          kiln_fused_kd_result *out) {
    if (out) memset(out, 0, sizeof *out);
    if (!be || !p) return kiln_error(KILN_ERR_INVALID_ARG, "fused_kd: backend or params is NULL");
    if (!be->i || !be->i->fused_kd)
        return kiln_error(KILN_ERR_UNSUPPORTED, "fused_kd: not on this backend (the %s backend "
                          "has no fused distillation loss)", be->i && be->i->name ? be->i->name
                                                                                  : "?");
    const kiln_fused_ce_params ce = kiln_kd_ce_view(p);
    KILN_TRY(kiln_ce_check_call("fused_kd", be, &ce));
    KILN_TRY(check_teacher(p));
    int64_t S = 0;
    KILN_TRY(kiln_ce_count_supervised("fused_kd", &ce, &S));
    return be->i->fused_kd(be, p, S, out);
}
