/*
 * distill.c -- knowledge distillation (issue 30, docs/TRAINING.md "Distillation"): a teacher
 * model's inference forward on the student trainer's backend, and the student's training step
 * on the fused distillation loss (src/ops/fused_kd.h) of its hidden states against the
 * teacher's logits.
 *
 * One step over n_seq x seq tokens (T rows):
 *   1. the student's forward (the trainer's), up to its final-norm hidden states xn (T, C);
 *   2. the teacher's forward over the same tokens (kiln_model_forward on a forward state of
 *      its own: no activations kept, the KV cache only), its residual stream left in fs->x;
 *   3. the rows in blocks of R: the teacher's logits of the block (final norm and head,
 *      kiln_forward_logits: R x V floats, the only logits that ever exist, R chosen so that
 *      they stay under KILN_DISTILL_BLOCK_FLOATS), then kiln_fused_kd over the block's
 *      student rows: the loss, d loss / d xn of the block's rows and d loss / d head added;
 *   4. the student's backward from d loss / d xn.
 * The loss is summed block by block in row order (each block's sum has the op's defined
 * order), with MEAN's 1/S over the supervised rows of the whole step, so the result does
 * not depend on the thread count; it does depend on R (a function of V alone, and of fast mode).
 */
#include "../ops/fused_kd.h"
#include "trainer.h"

#include "../base/handle.h"
#include "../tokenizer/tokenizer.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

/* The teacher's logits of one block of rows: at most this many floats (64 MiB), or in fast
 * mode KILN_DISTILL_FAST_BLOCK_FLOATS (1 GiB). The block's rows fix the order in which d loss / d
 * head is summed, so the auditable modes share one size on every device (the CPU's bits); fast
 * mode, which gives other bits anyway, takes fewer, larger blocks: each block is one product
 * for the teacher's head and S rows in every product of the fused loss, and the GPU wants
 * many rows (at 151,936 columns the small block has 110). */
#define KILN_DISTILL_BLOCK_FLOATS ((size_t)1 << 24)
#define KILN_DISTILL_FAST_BLOCK_FLOATS ((size_t)1 << 28)

/* Hidden-state matching, pair k: the student's layer s (0-based here) tapped into hs, the
 * teacher's layer t into ht; P (NULL: equal widths) the trainer's projection. */
typedef struct hidden_pair {
    int s, t;
    const kiln_tensor *P; /* (Ct, Cs) */
    float *dP;            /* its gradient */
    float *hs, *ht, *ghs; /* (T, Cs), (T, Ct), (T, Cs): d loss / d hs for the student's backward */
} hidden_pair;

struct kiln_teacher {
    kiln_handle_head head; /* first: the registry's magic (base/handle.h) */
    kiln_model *model;     /* a user of the model from create to free */
    kiln_trainer *student; /* a user of the trainer from create to free */
    kiln_backend *be;      /* the student's */
    kiln_forward_state fs;
    int max_seq, max_batch, block_rows;
    int32_t *ids, *pos, *seq; /* host (max_batch x max_seq): the teacher's batch */
    int32_t *rows;            /* host (block_rows): a block's row indices */
    float *logits;            /* backend memory (block_rows x V) */
    /* hidden-state matching (none: n_hidden 0) */
    int n_hidden, Cs, Ct;
    kiln_hidden_loss hidden_loss;
    hidden_pair *hp;
    float *y, *dy, *yt;              /* (T, Ct) host: P hs, d loss / d (P hs), and (a device
                                      * backend's) the teacher's taps, downloaded */
    float *d_y, *d_dy;               /* (T, Ct) a device backend's: P hs and d loss / d (P hs) */
    float **s_out, **t_out;          /* (student's L), (teacher's L): the taps' arrays */
    const float **s_grad;            /* (student's L) */
    kiln_taps s_taps, t_taps;
};

kiln_distill_params kiln_distill_default_params(void) {
    kiln_distill_params p = {1.0f, 0.5f, 0.5f, 1.0f};
    return p;
}

kiln_teacher_params kiln_teacher_default_params(void) {
    kiln_teacher_params p = {0, NULL, KILN_HIDDEN_MSE};
    return p;
}

static void hidden_free(kiln_teacher *t) {
    for (int k = 0; t->hp && k < t->n_hidden; k++) {
        kiln_backend_free_buf(t->be, t->hp[k].hs);
        kiln_backend_free_buf(t->be, t->hp[k].ht);
        kiln_backend_free_buf(t->be, t->hp[k].ghs);
    }
    kiln_free(t->hp);
    kiln_free(t->y);
    if (t->d_y) kiln_backend_free_buf(t->be, t->d_y);
    if (t->d_dy) kiln_backend_free_buf(t->be, t->d_dy);
    kiln_free(t->s_out);
    kiln_free(t->t_out);
    kiln_free(t->s_grad);
}

/* The pairs of p checked against the two models and bound: the projections found in the
 * trainer, the tap buffers made. */
static kiln_status hidden_init(kiln_teacher *t, const kiln_teacher_params *p, kiln_trainer *student,
                               const kiln_model *tm, const char *call) {
    const kiln_model *sm = kiln_trainer_model(student);
    const int Ls = sm->cfg.n_layer, Lt = tm->cfg.n_layer, T = t->max_seq * t->max_batch;
    t->Cs = sm->cfg.n_embd;
    t->Ct = tm->cfg.n_embd;
    if (p->n_hidden < 0 || p->n_hidden > Ls || (p->n_hidden && !p->hidden))
        return kiln_error(KILN_ERR_INVALID_ARG, "%s: %d hidden-state pairs (0..%d, the student's layers, with the "
                          "pairs set)", call, p->n_hidden, Ls);
    if ((unsigned)p->hidden_loss > KILN_HIDDEN_COSINE)
        return kiln_error(KILN_ERR_INVALID_ARG, "%s: unknown hidden-state loss %d", call, (int)p->hidden_loss);
    for (int k = 0; k < p->n_hidden; k++) {
        const kiln_hidden_pair *q = &p->hidden[k];
        if (q->student_layer < 1 || q->student_layer > Ls || q->teacher_layer < 1 || q->teacher_layer > Lt)
            return kiln_error(KILN_ERR_INVALID_ARG, "%s: hidden pair %d:%d: the student's layers are 1..%d, the "
                              "teacher's 1..%d", call, q->student_layer, q->teacher_layer, Ls, Lt);
        for (int j = 0; j < k; j++)
            if (p->hidden[j].student_layer == q->student_layer || p->hidden[j].teacher_layer == q->teacher_layer)
                return kiln_error(KILN_ERR_INVALID_ARG, "%s: hidden pairs %d:%d and %d:%d share a layer (each "
                                  "layer of either model is matched once)", call, p->hidden[j].student_layer,
                                  p->hidden[j].teacher_layer, q->student_layer, q->teacher_layer);
    }
    t->n_hidden = p->n_hidden;
    t->hidden_loss = p->hidden_loss;
    if (!t->n_hidden) return KILN_OK;
    t->hp = kiln_calloc((size_t)t->n_hidden, sizeof *t->hp);
    const int host = t->fs.host_memory;
    t->y = kiln_malloc((size_t)(host ? 2 : 3) * T * (size_t)t->Ct * sizeof(float));
    t->s_out = kiln_calloc((size_t)Ls, sizeof *t->s_out);
    t->s_grad = kiln_calloc((size_t)Ls, sizeof *t->s_grad);
    t->t_out = kiln_calloc((size_t)Lt, sizeof *t->t_out);
    if (!t->hp || !t->y || !t->s_out || !t->s_grad || !t->t_out)
        return kiln_error(KILN_ERR_NOMEM, "%s: out of memory for the hidden-state matching", call);
    t->dy = t->y + (size_t)T * t->Ct;
    if (!host) {
        t->yt = t->dy + (size_t)T * t->Ct;
        t->d_y = kiln_backend_alloc_zeroed(t->be, (size_t)T * t->Ct * sizeof(float), "teacher", "hidden states");
        t->d_dy = kiln_backend_alloc_zeroed(t->be, (size_t)T * t->Ct * sizeof(float), "teacher", "hidden states");
        if (!t->d_y || !t->d_dy) return KILN_ERR_NOMEM;
    }
    for (int k = 0; k < t->n_hidden; k++) {
        hidden_pair *h = &t->hp[k];
        h->s = p->hidden[k].student_layer - 1;
        h->t = p->hidden[k].teacher_layer - 1;
        if (t->Cs != t->Ct) {
            char name[64];
            snprintf(name, sizeof name, KILN_HIDDEN_PROJ_NAME, k);
            if (kiln_trainer_param_view(student, name, &h->P, &h->dP) != KILN_OK ||
                h->P->n_dims != 2 || h->P->shape[0] != t->Ct || h->P->shape[1] != t->Cs)
                return kiln_error(KILN_ERR_INVALID_ARG, "%s: hidden pair %d (%d:%d) needs the projection '%s', a %d x "
                                  "%d matrix, among the trainer's extras (kiln_train_params.extra): the teacher is %d "
                                  "wide, the student %d", call, k, h->s + 1, h->t + 1, name, t->Ct, t->Cs, t->Ct,
                                  t->Cs);
        }
        h->hs = kiln_backend_alloc_zeroed(t->be, (size_t)T * t->Cs * sizeof(float), "teacher", "hidden states");
        h->ht = kiln_backend_alloc_zeroed(t->be, (size_t)T * t->Ct * sizeof(float), "teacher", "hidden states");
        h->ghs = kiln_backend_alloc_zeroed(t->be, (size_t)T * t->Cs * sizeof(float), "teacher", "hidden states");
        if (!h->hs || !h->ht || !h->ghs) return KILN_ERR_NOMEM;
        t->s_out[h->s] = h->hs;
        t->s_grad[h->s] = h->ghs;
        t->t_out[h->t] = h->ht;
    }
    t->s_taps.out = t->s_out;
    t->s_taps.grad = t->s_grad;
    t->t_taps.out = t->t_out;
    return KILN_OK;
}

kiln_status kiln_teacher_create(kiln_model *teacher, kiln_trainer *student, kiln_teacher **out) {
    return kiln_teacher_create_ex(teacher, student, NULL, out);
}

kiln_status kiln_teacher_create_ex(kiln_model *teacher, kiln_trainer *student, const kiln_teacher_params *tp,
                                   kiln_teacher **out) {
    const char *call = "kiln_teacher_create";
    const kiln_teacher_params none = kiln_teacher_default_params();
    if (!tp) tp = &none;
    if (!out) return kiln_error(KILN_ERR_INVALID_ARG, "%s: out is NULL", call);
    *out = NULL;
    KILN_TRY(kiln_handle_check(teacher, KILN_HANDLE_MODEL, call));
    KILN_TRY(kiln_model_weights_check(teacher, call));
    KILN_TRY(kiln_trainer_enter(student, call));
    const kiln_model *sm = kiln_trainer_model(student);
    /* A head padded past the tokenizer (Qwen2.5's 151,936 rows for 151,665 tokens) is read on
     * the student's rows: the teacher's padding columns, which no text produces, are left out of
     * its distribution. A student padded past the teacher has rows the teacher cannot score. */
    if (teacher->cfg.n_vocab < sm->cfg.n_vocab)
        return kiln_error(KILN_ERR_INVALID_ARG, "%s: the teacher's head has %d rows, fewer than the student's %d: "
                          "distillation needs one vocabulary", call, teacher->cfg.n_vocab, sm->cfg.n_vocab);
    const kiln_tokenizer *tt = kiln_model_get_tokenizer(teacher), *st_tok = kiln_model_get_tokenizer(sm);
    if (!tt || !st_tok)
        return kiln_error(KILN_ERR_INVALID_ARG, "%s: the %s has no tokenizer: distillation needs one tokenizer for both",
                          call, tt ? "student" : "teacher");
    if (teacher->cfg.n_vocab != sm->cfg.n_vocab && kiln_tokenizer_n_vocab(tt) > sm->cfg.n_vocab)
        return kiln_error(KILN_ERR_INVALID_ARG, "%s: the tokenizer has %d tokens, more than the student's %d rows",
                          call, kiln_tokenizer_n_vocab(tt), sm->cfg.n_vocab);
    {
        uint8_t a[32], b[32];
        KILN_TRY(kiln_tokenizer_fingerprint(tt, a));
        KILN_TRY(kiln_tokenizer_fingerprint(st_tok, b));
        if (memcmp(a, b, 32) != 0)
            return kiln_error(KILN_ERR_INVALID_ARG, "%s: the teacher's tokenizer differs from the student's (same "
                              "size, other tokens or rules): distillation needs one tokenizer", call);
    }
    kiln_backend *be = kiln_trainer_backend(student);
    if (!be->i->fused_kd)
        return kiln_error(KILN_ERR_UNSUPPORTED, "%s: the %s backend has no fused distillation loss", call,
                          be->i->name);
    kiln_teacher *t = kiln_calloc(1, sizeof *t);
    if (!t) return kiln_error(KILN_ERR_NOMEM, "%s: out of memory", call);
    t->be = be;
    kiln_trainer_limits(student, &t->max_seq, &t->max_batch);
    const int V = teacher->cfg.n_vocab, T = t->max_seq * t->max_batch; /* the teacher's rows */
    size_t rows = (kiln_trainer_fast(student) ? KILN_DISTILL_FAST_BLOCK_FLOATS : KILN_DISTILL_BLOCK_FLOATS) /
                  (size_t)V;
    t->block_rows = rows < 1 ? 1 : rows > (size_t)T ? T : (int)rows;
    kiln_status st = kiln_forward_state_init(&t->fs, teacher, t->be, t->max_seq, T, t->max_batch, 0);
    if (st != KILN_OK) {
        kiln_free(t);
        return kiln_error_prefix(st, "%s: the teacher's forward state", call);
    }
    t->ids = kiln_malloc(((size_t)3 * T + (size_t)t->block_rows) * sizeof(int32_t));
    t->logits = kiln_backend_alloc_zeroed(t->be, (size_t)t->block_rows * V * sizeof(float), "teacher", "logits");
    if (!t->ids || !t->logits) {
        st = t->ids ? KILN_ERR_NOMEM : kiln_error(KILN_ERR_NOMEM, "%s: out of memory", call);
        goto fail;
    }
    t->pos = t->ids + T;
    t->seq = t->pos + T;
    t->rows = t->seq + T;
    if ((st = hidden_init(t, tp, student, teacher, call)) != KILN_OK) goto fail;
    if ((st = kiln_handle_acquire(teacher, KILN_HANDLE_MODEL, call)) != KILN_OK) goto fail;
    t->model = teacher;
    if ((st = kiln_handle_acquire(student, KILN_HANDLE_TRAINER, call)) != KILN_OK) goto fail;
    t->student = student;
    if ((st = kiln_handle_register(&t->head, KILN_HANDLE_TEACHER, call)) != KILN_OK) goto fail;
    *out = t;
    return KILN_OK;
fail:
    if (t->student) kiln_handle_release(t->student, call);
    if (t->model) kiln_handle_release(t->model, call);
    if (t->logits) kiln_backend_free_buf(t->be, t->logits);
    hidden_free(t);
    kiln_free(t->ids);
    kiln_forward_state_free(&t->fs);
    kiln_free(t);
    return st;
}

void kiln_teacher_free(kiln_teacher *t) {
    if (!t || kiln_handle_unregister(&t->head, KILN_HANDLE_TEACHER, "kiln_teacher_free") != KILN_OK) return;
    kiln_backend_free_buf(t->be, t->logits);
    hidden_free(t);
    kiln_free(t->ids);
    kiln_forward_state_free(&t->fs);
    kiln_handle_release(t->student, "kiln_teacher_free");
    kiln_handle_release(t->model, "kiln_teacher_free");
    kiln_free(t);
}

typedef struct distill_step {
    kiln_teacher *teacher;
    const int32_t *targets;
    const kiln_distill_params *dp;
    kiln_loss_reduction red;
    float scale;
    kiln_distill_loss parts;
} distill_step;

/* Whether row n of a step is supervised (fused_ce's rule: a target >= 0; no mask here). */
static int supervised(const int32_t *targets, int n) { return targets[n] >= 0; }

/* The hidden-state part of a step (the teacher's taps filled by its forward, the student's by
 * its own): each pair's loss over the supervised rows, unweighted, times coef (the step's
 * scale, / S for MEAN), to *out; d (hidden_weight x that) / d hs into the pair's ghs (for the
 * student's backward) and d / d P added to P's gradient. The projection and its gradient are
 * the backend's products; the loss and d loss / d (P hs) are computed on the host (on a device
 * backend, from downloaded copies of P hs and the teacher's tap, the result uploaded): rows in
 * order, each row's sums in double, so the bits are the same on any thread count and device. */
static kiln_status hidden_loss(kiln_teacher *t, const kiln_train_head *h, const int32_t *targets, double coef,
                               float weight, double *out) {
    const int T = h->T, Cs = t->Cs, Ct = t->Ct;
    const kiln_backend_i *op = h->be->i;
    const int host = t->fs.host_memory;
    const size_t tap_bytes = (size_t)T * Ct * sizeof(float);
    double total = 0;
    for (int k = 0; k < t->n_hidden; k++) {
        hidden_pair *hp = &t->hp[k];
        const float *y = hp->hs, *yt = hp->ht;
        if (hp->P) {
            op->matmul(h->be, host ? t->y : t->d_y, hp->hs, hp->P, NULL, T);
            y = host ? t->y : t->d_y;
        }
        if (!host) {
            KILN_TRY(kiln_backend_download(h->be, t->y, y, tap_bytes));
            KILN_TRY(kiln_backend_download(h->be, t->yt, hp->ht, tap_bytes));
            y = t->y;
            yt = t->yt;
        }
        double sum = 0;
        for (int n = 0; n < T; n++) {
            const float *a = y + (size_t)n * Ct, *b = yt + (size_t)n * Ct;
            float *g = t->dy + (size_t)n * Ct;
            if (!supervised(targets, n)) {
                memset(g, 0, (size_t)Ct * sizeof(float));
                continue;
            }
            if (t->hidden_loss == KILN_HIDDEN_MSE) {
                double l = 0;
                for (int i = 0; i < Ct; i++) {
                    const double r = (double)a[i] - (double)b[i];
                    l += r * r;
                    g[i] = (float)(coef * weight * 2.0 * r / Ct);
                }
                sum += l / Ct;
            } else {
                double ab = 0, aa = 0, bb = 0;
                for (int i = 0; i < Ct; i++) {
                    ab += (double)a[i] * b[i];
                    aa += (double)a[i] * a[i];
                    bb += (double)b[i] * b[i];
                }
                const double na = sqrt(aa), nb = sqrt(bb), den = na * nb > 1e-8 ? na * nb : 1e-8;
                const double cs = ab / den;
                /* d (1 - ab / (na nb)) / d a = -(b / (na nb) - ab a / (na^3 nb)); floored: -b / den */
                for (int i = 0; i < Ct; i++) {
                    const double d = na * nb > 1e-8 ? -((double)b[i] / den - cs * (double)a[i] / aa) : -(double)b[i] / den;
                    g[i] = (float)(coef * weight * d);
                }
                sum += 1.0 - cs;
            }
        }
        total += coef * sum;
        /* d / d hs = dy P (and dP += dy^T hs), or dy itself with no projection */
        if (hp->P) {
            if (!host) KILN_TRY(kiln_backend_upload(h->be, t->d_dy, t->dy, tap_bytes));
            op->matmul_backward(h->be, hp->ghs, hp->dP, NULL, host ? t->dy : t->d_dy, hp->hs, hp->P, T, false);
        } else if (host) {
            memcpy(hp->ghs, t->dy, (size_t)T * Cs * sizeof(float));
        } else {
            KILN_TRY(kiln_backend_upload(h->be, hp->ghs, t->dy, (size_t)T * Cs * sizeof(float)));
        }
    }
    *out = total;
    return kiln_backend_status(h->be);
}

/* The kiln_train_loss_fn of a distillation step (the header's steps 2 and 3). */
static kiln_status distill_loss(void *ctx, const kiln_train_head *h, float *loss) {
    distill_step *d = ctx;
    kiln_teacher *t = d->teacher;
    const int T = h->T, C = h->C, V = h->V;
    for (int b = 0; b < h->n_seq; b++)
        for (int i = 0; i < h->seq; i++) {
            int n = b * h->seq + i;
            t->ids[n] = h->ids[n];
            t->pos[n] = i;
            t->seq[n] = b;
        }
    kiln_batch batch = {T, t->ids, t->pos, t->seq, NULL, 0};
    t->fs.taps = t->n_hidden ? &t->t_taps : NULL; /* the teacher's hidden states of the pairs */
    kiln_status fst = kiln_model_forward(t->model, t->be, &t->fs, &batch, NULL);
    t->fs.taps = NULL;
    KILN_TRY(fst);
    KILN_TRY(kiln_backend_status(t->be));
    int64_t S = 0;
    for (int n = 0; n < T; n++) S += supervised(d->targets, n);
    if (S == 0) return kiln_error(KILN_ERR_INVALID_ARG, "no supervised positions");
    /* MEAN: every block's rows summed with the step's 1/S */
    const float block_scale = d->red == KILN_LOSS_MEAN ? (float)((double)d->scale / (double)S) : d->scale;
    float sum = 0, kl = 0, ce = 0;
    const int logit_loss = d->dp->kd_weight != 0 || d->dp->ce_weight != 0;
    for (int r0 = 0; r0 < T; r0 += t->block_rows) {
        const int n = T - r0 < t->block_rows ? T - r0 : t->block_rows;
        int any = 0;
        for (int r = r0; r < r0 + n && !any && logit_loss; r++) any = supervised(d->targets, r);
        if (!any) { /* no supervised row (or the hidden-state loss alone): d loss / d hidden is 0 there */
            float *dh = h->dhidden + (size_t)r0 * C;
            if (t->fs.host_memory) memset(dh, 0, (size_t)n * C * sizeof(float));
            else h->be->i->zero(h->be, dh, (size_t)n * C);
            continue;
        }
        for (int r = 0; r < n; r++) t->rows[r] = r0 + r;
        kiln_forward_logits(t->model, t->be, &t->fs, T, t->rows, n, t->logits);
        kiln_fused_kd_params p = kiln_fused_kd_default_params();
        p.N = n;
        p.H = C;
        p.V = V;
        p.hidden = h->hidden + (size_t)r0 * C;
        p.weight = h->weight->data;
        p.weight_dtype = h->weight->dtype;
        p.teacher_logits = t->logits;
        p.teacher_ld = t->model->cfg.n_vocab; /* >= V: a padded head's extra columns unread */
        p.targets = d->targets + r0;
        p.tau = d->dp->temperature;
        p.kd_weight = d->dp->kd_weight;
        p.ce_weight = d->dp->ce_weight;
        p.reduction = KILN_CE_REDUCTION_SUM;
        p.scale = block_scale;
        p.dhidden = h->dhidden + (size_t)r0 * C;
        p.dweight = h->dweight;
        kiln_fused_kd_result res;
        kiln_status st = kiln_fused_kd(h->be, &p, &res);
        if (st != KILN_OK) return kiln_error_prefix(st, "rows %d..%d", r0, r0 + n - 1);
        sum += res.loss;
        kl += res.kl;
        ce += res.ce;
    }
    double hid = 0;
    if (t->n_hidden) {
        const double coef = d->red == KILN_LOSS_MEAN ? (double)d->scale / (double)S : (double)d->scale;
        KILN_TRY(hidden_loss(t, h, d->targets, coef, d->dp->hidden_weight, &hid));
    }
    d->parts.loss = sum + d->dp->hidden_weight * (float)hid;
    d->parts.kl = kl;
    d->parts.ce = ce;
    d->parts.hidden = (float)hid;
    d->parts.n_supervised = S;
    *loss = d->parts.loss;
    return KILN_OK;
}

kiln_status kiln_train_distill_step(kiln_trainer *t, kiln_teacher *teacher, const int32_t *ids, int n_seq, int seq,
                                    const int32_t *targets, const kiln_distill_params *dp, kiln_loss_reduction red,
                                    float scale, int accumulate, kiln_distill_loss *out) {
    const char *call = "kiln_train_distill_step";
    KILN_TRY(kiln_handle_check(teacher, KILN_HANDLE_TEACHER, call));
    if (teacher->student != t)
        return kiln_error(KILN_ERR_INVALID_ARG, "%s: the teacher was made for another trainer", call);
    if (!targets || !dp || !out) return kiln_error(KILN_ERR_INVALID_ARG, "%s: NULL targets, params or out", call);
    if (!(dp->temperature > 0) || !isfinite(dp->temperature))
        return kiln_error(KILN_ERR_INVALID_ARG, "%s: temperature %g is not a finite number > 0", call, dp->temperature);
    const float hw = teacher->n_hidden ? dp->hidden_weight : 0.0f;
    if (!(dp->kd_weight >= 0) || !(dp->ce_weight >= 0) || !isfinite(dp->kd_weight) || !isfinite(dp->ce_weight) ||
        !(hw >= 0) || !isfinite(hw) || dp->kd_weight + dp->ce_weight + hw == 0)
        return kiln_error(KILN_ERR_INVALID_ARG, "%s: kd_weight %g, ce_weight %g and hidden_weight %g: finite, >= 0, "
                          "not all 0", call, dp->kd_weight, dp->ce_weight, hw);
    if (red != KILN_LOSS_MEAN && red != KILN_LOSS_SUM)
        return kiln_error(KILN_ERR_INVALID_ARG, "%s: unknown reduction %d", call, (int)red);
    if (!isfinite(scale)) return kiln_error(KILN_ERR_INVALID_ARG, "%s: scale is not finite", call);
    if (n_seq > teacher->max_batch || seq > teacher->max_seq)
        return kiln_error(KILN_ERR_RANGE, "%s: %d x %d tokens, the teacher was made for %d x %d", call, n_seq, seq,
                          teacher->max_batch, teacher->max_seq);
    const int V = kiln_trainer_model(t)->cfg.n_vocab;
    for (int n = 0; n < n_seq * seq; n++)
        if (targets[n] >= V)
            return kiln_error(KILN_ERR_RANGE, "%s: target %d at row %d is out of range [0, %d)", call, targets[n], n, V);
    distill_step d = {teacher, targets, dp, red, scale, {0, 0, 0, 0, 0}};
    float loss;
    /* the student's taps: its pairs' layers out in the forward, their gradients in the backward */
    kiln_trainer_set_taps(t, teacher->n_hidden ? &teacher->s_taps : NULL);
    kiln_status st = kiln_train_custom_step(t, call, ids, n_seq, seq, distill_loss, &d, accumulate, &loss);
    kiln_trainer_set_taps(t, NULL);
    KILN_TRY(st);
    *out = d.parts;
    return KILN_OK;
}
