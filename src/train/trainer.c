/*
 * trainer.c -- training a model on a backend (the CPU, or a CUDA GPU): its parameters are the
 * architecture's roles (models/arch.h) by transformers' names; the layers' forward and
 * backward are the architecture's train hooks (models/llama.c: the generation forward's layer
 * function keeping each layer's activations), so a trained model's logits in kiln_generate
 * are the bits training saw; this file adds the fused cross-entropy (never T x V logits),
 * gradient clipping, AdamW, checkpoints and CUDA graphs of the steps. Matrices are stored f32, or bf16 for
 * the bf16 storage variants; vectors (norms, biases) always f32 with an f32 AdamW.
 *
 * Memory (docs/CUDA.md, "Memory contract"): weights, gradients, activations, the loss's
 * statistics and the optimizer state are backend memory; the ops see the weights as
 * kiln_tensor views whose data is backend memory (used in place on a GPU). Token ids,
 * positions and targets stay host arrays (the ops copy them). On the cpu backend backend
 * memory is host memory: the blocks are kiln_calloc'd and read and written directly, as
 * before; on a device they are read and written by download / upload, and the per-step
 * zeroing and clip scaling run as backend ops (zero_floats, scale_grads), so a step makes
 * no host round trip of a large buffer.
 */
#include "../models/format_rules.h"
#include "../models/model.h"
#include "../ops/fused_ce.h"
#include "../tokenizer/tokenizer.h"
#include "adamw.h"
#include "checkpoint.h"
#include "trainer.h"

#include <limits.h>
#include <stddef.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "trainer_impl.h"

/* ---- backend memory ---------------------------------------------------------------------- */

/* nbytes of zeroed backend memory (ops.h kiln_backend_alloc_zeroed). NULL with the error set. */
static kiln_status apply_format_rules(kiln_trainer *t, int mode);

static void *bmem_alloc(kiln_trainer *t, size_t nbytes, const char *what) {
    return kiln_backend_alloc_zeroed(t->be, nbytes, "trainer", what);
}

static void bmem_free(kiln_trainer *t, void *p) {
    if (p) kiln_backend_free_buf(t->be, p);
}

/* p[0..n) = +0.0f in backend memory (memset on the cpu backend, the backend's zero op). */
static void zero_floats(kiln_trainer *t, float *p, size_t n) {
    if (t->host) memset(p, 0, n * sizeof(float));
    else t->be->i->zero(t->be, p, n);
}

/* Every gradient g = g * coef (torch's clip_grad_norm_ scaling), over the whole gradient block
 * (the padding between gradients is zero and stays zero). */
static kiln_status scale_grads(kiln_trainer *t, float coef) {
    if (kiln_trainer_dp_sharded(t)) { /* ZeRO-3: the rest of the buffers is released */
        kiln_trainer_dp_scale_own_grads(t, coef);
        return KILN_OK;
    }
    if (t->host) {
        for (int i = 0; i < t->n_params; i++) {
            float *g = t->params[i].g;
            for (int64_t j = 0; j < t->params[i].n; j++) g[j] = g[j] * coef;
        }
        return KILN_OK;
    }
    t->be->i->scale(t->be, t->grad_block, coef, t->n_grad);
    return KILN_OK;
}

static int all_finite(const float *x, int n) {
    for (int i = 0; i < n; i++)
        if (!isfinite(x[i])) return 0;
    return 1;
}

/* Multiply the stored gradients by a pending clip coefficient (see grad_coef). */
static kiln_status apply_grad_coef(kiln_trainer *t) {
    if (t->grad_coef == 1.0f) return KILN_OK;
    const float coef = t->grad_coef;
    t->grad_coef = 1.0f;
    return scale_grads(t, coef);
}

/* st with the message prefixed by the call and the backend's name (KILN_OK stays KILN_OK). */
static kiln_status backend_error(kiln_trainer *t, kiln_status st, const char *call) {
    if (st == KILN_OK) return KILN_OK;
    /* KILN_ERR_POISONED when the failure left the backend poisoned (kiln.h) */
    return kiln_backend_leave(t->be, kiln_error_prefix(st, "%s: %s backend", call, t->be->i->name), call);
}

/* KILN_OK, or the error that poisoned a device backend during the work of `call`. */
static kiln_status backend_check(kiln_trainer *t, const char *call) {
    return backend_error(t, kiln_backend_status(t->be), call);
}

/* backend_check without waiting for the submitted work (ops.h poll): for the calls that
 * leave the device busy on purpose, so that the host queues the next step behind them (+0.6%
 * tokens/s at the 0.5B shape, T 2048, against a waiting check: bench/RESULTS.md, 2026-12-02,
 * 26b4ff9). A fault in that work shows in the next call that waits. */
static kiln_status backend_poll(kiln_trainer *t, const char *call) {
    return backend_error(t, kiln_backend_poll(t->be), call);
}

/* A device backend must run every op of a training step for the weights' dtype (wt); the
 * f32 ops zero_floats and the tied/untied heads use are EMBED / MATMUL with F32. */
static kiln_status check_backend_ops(kiln_trainer *t, kiln_dtype wt) {
    static const struct {
        kiln_op op;
        const char *name;
    } need[] = {{KILN_OP_EMBED, "embed"},
                {KILN_OP_RMSNORM, "rmsnorm"},
                {KILN_OP_MATMUL, "matmul"},
                {KILN_OP_ROPE, "rope"},
                {KILN_OP_ATTENTION, "attention"},
                {KILN_OP_SWIGLU, "swiglu"},
                {KILN_OP_ADD, "add"},
                {KILN_OP_MATMUL_BACKWARD, "matmul_backward"},
                {KILN_OP_RMSNORM_BACKWARD, "rmsnorm_backward"},
                {KILN_OP_ROPE_BACKWARD, "rope_backward"},
                {KILN_OP_ATTENTION_BACKWARD, "attention_backward"},
                {KILN_OP_SWIGLU_BACKWARD, "swiglu_backward"},
                {KILN_OP_EMBED_BACKWARD, "embed_backward"}};
    const kiln_backend_i *op = t->be->i;
    bool have = op->embed && op->rmsnorm && op->matmul && op->rope && op->attention && op->swiglu && op->add &&
                op->matmul_backward && op->rmsnorm_backward && op->rope_backward && op->attention_backward &&
                op->swiglu_backward && op->embed_backward && op->zero && op->scale;
    if (!have)
        return kiln_error(KILN_ERR_UNSUPPORTED, "kiln_trainer_create: the %s backend lacks a training op", op->name);
    for (size_t i = 0; i < sizeof need / sizeof need[0]; i++) {
        kiln_dtype dts[2] = {wt, KILN_DTYPE_F32};
        for (int k = 0; k < 2; k++)
            if (!op->supports_op(t->be, need[i].op, dts[k]))
                return kiln_error(KILN_ERR_UNSUPPORTED, "kiln_trainer_create: the %s backend does not run %s for %s weights",
                                  op->name, need[i].name, kiln_dtype_name(dts[k]));
    }
    return KILN_OK;
}

/* ---- parameters ------------------------------------------------------------------------ */

static train_param *add_param(kiln_trainer *t, const char *name, int64_t rows, int64_t cols,
                              int matrix) {
    train_param *p = &t->params[t->n_params++];
    snprintf(p->name, sizeof p->name, "%s", name);
    p->n_dims = matrix ? 2 : 1;
    p->shape[0] = rows;
    p->shape[1] = matrix ? cols : 1;
    p->n = rows * (matrix ? cols : 1);
    p->layer = -1;
    p->dtype = (matrix && t->p.weight_storage != KILN_STORAGE_F32) ? KILN_DTYPE_BF16 : KILN_DTYPE_F32;
    return p;
}

/* The trainer's parameters are the model's roles (models/arch.h) that it binds, in the walk's
 * order (transformers' named_parameters()); a tied output head is the embedding's parameter.
 * count: only count them (t->params not yet allocated). */
typedef struct declare_ctx {
    kiln_trainer *t;
    int count;
    int n;
} declare_ctx;

/* What role r of layer `layer` is to the trainer: absent from the model, a tied output head
 * (the embedding's parameter serves it), or one of its parameters. */
enum { ROLE_ABSENT, ROLE_TIED_HEAD, ROLE_PARAM };
static int role_kind(const kiln_trainer *t, const kiln_param_role *r, int layer) {
    const kiln_arch_desc *a = t->model->arch;
    const kiln_wref *src = kiln_model_ref(t->model, r, layer);
    if (!src->mat && !src->vec) return ROLE_ABSENT;
    if ((int)(r - a->roles) == a->role_head && t->cfg.tie_embeddings) return ROLE_TIED_HEAD;
    return ROLE_PARAM;
}

static kiln_status declare_role(void *ctx, const kiln_param_role *r, int layer) {
    declare_ctx *d = ctx;
    kiln_trainer *t = d->t;
    const kiln_arch_desc *a = t->model->arch;
    if (role_kind(t, r, layer) != ROLE_PARAM) return KILN_OK;
    const int role = (int)(r - a->roles);
    if (!r->trainable)
        return kiln_error(KILN_ERR_UNSUPPORTED, "kiln_trainer_create: '%s' is not a trainable role", r->hf);
    d->n++;
    if (d->count) return KILN_OK;
    char nm[96];
    kiln_role_name(r, false, layer, nm, sizeof nm);
    const int matrix = !kiln_role_is_vector(r);
    train_param *p = add_param(t, nm, matrix ? kiln_dim_value(&t->cfg, r->rows) : kiln_role_floats(r, &t->cfg),
                               kiln_dim_value(&t->cfg, r->cols), matrix);
    p->file_dims = kiln_role_file_shape(r, &t->cfg, p->file_shape);
    if (r->per_layer) p->layer = layer;
    if (role == a->role_embed) t->tok_embd = p;
    else if (role == a->role_final_norm) t->final_norm = p;
    else if (role == a->role_head) t->lm_head = p;
    return KILN_OK;
}

static kiln_status declare_params(kiln_trainer *t, int count, int *n) {
    declare_ctx d = {t, count, 0};
    if (!count) t->n_params = 0;
    KILN_TRY(kiln_arch_walk(t->model->arch, t->cfg.n_layer, declare_role, &d));
    if (!count && t->cfg.tie_embeddings) t->lm_head = t->tok_embd;
    if (!count) t->n_model_params = t->n_params;
    for (int k = 0; !count && k < t->p.n_extra; k++) { /* the extras, checked by check_extras */
        const kiln_train_extra *e = &t->p.extra[k];
        train_param *p = add_param(t, e->name ? e->name : "", e->rows, e->cols, 1);
        p->file_dims = 2;
        p->file_shape[0] = e->rows;
        p->file_shape[1] = e->cols;
        p->file_shape[2] = 1;
    }
    if (n) *n = d.n + t->p.n_extra;
    return KILN_OK;
}

static int name_char_ok(char ch) {
    return (ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z') || (ch >= '0' && ch <= '9') || ch == '_' ||
           ch == '.' || ch == '-';
}

/* kiln_train_params' extras: names, shapes, no clash with the model's parameters or each other. */
static kiln_status check_extras(kiln_trainer *t) {
    const kiln_train_params *p = &t->p;
    if (p->n_extra < 0 || p->n_extra > 1024 || (p->n_extra && !p->extra))
        return kiln_error(KILN_ERR_INVALID_ARG, "kiln_trainer_create: n_extra %d (0..1024, with extra set)", p->n_extra);
    for (int k = 0; k < p->n_extra; k++) {
        const kiln_train_extra *e = &p->extra[k];
        size_t len = e->name ? strlen(e->name) : 0;
        int ok = len >= 1 && len <= 95;
        for (size_t i = 0; ok && i < len; i++) ok = name_char_ok(e->name[i]);
        if (!ok)
            return kiln_error(KILN_ERR_INVALID_ARG, "kiln_trainer_create: extra %d's name '%s': 1..95 bytes of "
                              "[A-Za-z0-9_.-]", k, e->name ? e->name : "(NULL)");
        if (e->rows < 1 || e->cols < 1 || e->rows > ((int64_t)1 << 31) / e->cols)
            return kiln_error(KILN_ERR_INVALID_ARG, "kiln_trainer_create: extra '%s' is %lld x %lld", e->name,
                              (long long)e->rows, (long long)e->cols);
        for (int i = 0; i < t->n_model_params + k; i++)
            if (!strcmp(t->params[i].name, e->name))
                return kiln_error(KILN_ERR_INVALID_ARG, "kiln_trainer_create: extra '%s' has the name of %s", e->name,
                                  i < t->n_model_params ? "a parameter of the model" : "another extra");
    }
    return KILN_OK;
}

/* The extras' initial weights: normal(0, 1 / cols), extra k from splitmix64 at seed ^ k's own
 * stream. tmp: max_n floats of host memory. */
static kiln_status init_extras(kiln_trainer *t, float *tmp) {
    for (int k = 0; k < t->p.n_extra; k++) {
        train_param *q = &t->params[t->n_model_params + k];
        uint64_t rng = t->p.seed ^ (0x6b696c6e65787472ull + (uint64_t)k * 0x9e3779b97f4a7c15ull);
        float *dst = t->host && q->dtype == KILN_DTYPE_F32 ? (float *)q->w : tmp;
        kiln_fill_normal(dst, q->n, (float)(1.0 / sqrt((double)q->shape[1])), &rng);
        if (q->dtype == KILN_DTYPE_BF16) {
            uint16_t *h = (uint16_t *)(void *)tmp; /* in place, front to back: h[i] is written after tmp[i] is read */
            for (int64_t i = 0; i < q->n; i++) h[i] = kiln_fp32_to_bf16(tmp[i]);
            KILN_TRY(t->host ? (memcpy(q->w, h, (size_t)q->n * 2), KILN_OK)
                             : kiln_backend_upload(t->be, q->w, h, (size_t)q->n * 2));
        } else if (!t->host) {
            KILN_TRY(kiln_backend_upload(t->be, q->w, tmp, (size_t)q->n * sizeof(float)));
        }
    }
    return KILN_OK;
}

kiln_status kiln_trainer_param_view(kiln_trainer *t, const char *name, const kiln_tensor **w, float **grad) {
    for (int i = 0; i < t->n_params; i++)
        if (!strcmp(t->params[i].name, name)) {
            *w = &t->params[i].view;
            *grad = t->params[i].g;
            return KILN_OK;
        }
    return kiln_error(KILN_ERR_INVALID_ARG, "the trainer has no parameter '%s'", name);
}

void kiln_trainer_set_taps(kiln_trainer *t, const kiln_taps *taps) { t->io.taps = taps; }

/* Copy the model's matrix src_t (any dtype, dequantized) into parameter p. tmp: max_n floats
 * of host memory; tmp16: max_n bf16 of host memory (device backends: staging before the
 * upload). On the cpu backend the weights are written in place, tmp only for bf16. */
static kiln_status load_from_model(kiln_trainer *t, train_param *p, const kiln_tensor *src_t, float *tmp,
                                   uint16_t *tmp16) {
    if (t->lean) { /* a ZeRO-3 rank's: the whole tensor in tmp, its own elements copied (rounded) */
        kiln_dequantize(src_t->dtype, src_t->data, tmp, p->n);
        int64_t a, b;
        kiln_param_part(p, t->lean_lo, t->lean_hi, &a, &b);
        for (int64_t i = a; i < b; i++) {
            if (p->dtype == KILN_DTYPE_F32)
                ((float *)p->w)[i] = tmp[i];
            else
                ((uint16_t *)p->w)[i] = kiln_fp32_to_bf16(tmp[i]);
        }
        if (t->consume) kiln_model_give_back_tensor(t->model, src_t);
        return KILN_OK;
    }
    float *dst = (t->host && p->dtype == KILN_DTYPE_F32) ? (float *)p->w : tmp;
    kiln_dequantize(src_t->dtype, src_t->data, dst, p->n);
    if (p->dtype == KILN_DTYPE_BF16) {
        uint16_t *w = t->host ? (uint16_t *)p->w : tmp16;
        for (int64_t i = 0; i < p->n; i++) w[i] = kiln_fp32_to_bf16(tmp[i]);
    }
    if (t->host) return KILN_OK;
    if (p->dtype == KILN_DTYPE_BF16) return kiln_backend_upload(t->be, p->w, tmp16, (size_t)p->n * sizeof(uint16_t));
    return kiln_backend_upload(t->be, p->w, tmp, (size_t)p->n * sizeof(float));
}

typedef struct load_ctx {
    kiln_trainer *t;
    float *tmp;
    uint16_t *tmp16;
    int next; /* the next parameter (declare_role's order) */
} load_ctx;

/* Each parameter, in the order declare_role made them: its weights from the model, and its
 * kiln_wref for the architecture's forward and backward (t->refs, t->layer_refs). */
static kiln_status load_role(void *ctx, const kiln_param_role *r, int layer) {
    load_ctx *c = ctx;
    kiln_trainer *t = c->t;
    const kiln_arch_desc *a = t->model->arch;
    const int kind = role_kind(t, r, layer);
    if (kind == ROLE_ABSENT) return KILN_OK;
    kiln_wref *dst = kiln_wref_of(a, t->refs, t->layer_refs, r, layer);
    if (kind == ROLE_TIED_HEAD) { /* the embedding's parameter (declared, so bound, before it) */
        *dst = t->refs[a->role_embed];
        return KILN_OK;
    }
    if (c->next >= t->n_params) return kiln_error(KILN_ERR_INTERNAL, "trainer: more roles than parameters");
    train_param *p = &t->params[c->next++];
    if (kiln_role_is_vector(r)) {
        dst->vec = (const float *)p->w;
    } else {
        /* the embedding is a table lookup (its f32 or bf16 storage); products take the bf16
         * copy where there is one */
        dst->mat = t->shadow && (int)(r - a->roles) != a->role_embed ? &p->view16 : &p->view;
    }
    dst->grad = p->g;
    const kiln_wref *src = kiln_model_ref(t->model, r, layer);
    if (src->mat) return load_from_model(t, p, src->mat, c->tmp, c->tmp16);
    /* a vector (f32): the parameter as transformers names it (a plus_one norm's w, arch.h) */
    float *v = t->host ? (float *)p->w : c->tmp;
    KILN_TRY(kiln_model_vector_param(t->model, r, layer, v, p->n));
    return t->host ? KILN_OK : kiln_backend_upload(t->be, p->w, v, (size_t)p->n * sizeof(float));
}

static void bind_views(train_param *p) {
    p->view.name = p->name;
    p->view.dtype = p->dtype;
    p->view.n_dims = p->n_dims;
    p->view.shape[0] = p->shape[0];
    p->view.shape[1] = p->shape[1];
    p->view.shape[2] = p->view.shape[3] = 1;
    p->view.data = p->w;
    p->view.nbytes = (size_t)p->n * (p->dtype == KILN_DTYPE_F32 ? 4 : 2);
}

kiln_status kiln_trainer_make_optimizers(kiln_trainer *t, int64_t lo, int64_t hi, kiln_adamw **mat,
                                         kiln_adamw **vec, int set_slots) {
    *mat = *vec = NULL;
    kiln_adamw_param *mp = kiln_calloc((size_t)t->n_params, sizeof *mp);
    kiln_adamw_param *vp = kiln_calloc((size_t)t->n_params, sizeof *vp);
    kiln_status st = (mp && vp) ? KILN_OK : kiln_error(KILN_ERR_NOMEM, "trainer: out of memory");
    int n_mat = 0, n_vec = 0;
    if (set_slots) t->step_writes_shadow = t->shadow != NULL;
    int64_t flat = 0; /* parameter i's first element in the flat vector */
    for (int i = 0; st == KILN_OK && i < t->n_params; flat += t->params[i].n, i++) {
        train_param *p = &t->params[i];
        /* the part of parameter i inside [lo, hi): elements a .. b - 1 of p */
        const int64_t a = lo > flat ? lo - flat : 0, b = hi - flat < p->n ? hi - flat : p->n;
        if (a >= b) continue;
        const size_t esize = p->dtype == KILN_DTYPE_F32 ? 4 : 2;
        kiln_adamw_param q = {p->name, b - a, (uint8_t *)p->w + (size_t)a * esize, p->g + a, NULL};
        if (t->shadow && p->dtype == KILN_DTYPE_F32) /* the step writes the bf16 copy too */
            q.w16 = (uint16_t *)(void *)p->view16.data + a;
        else if (set_slots)
            t->step_writes_shadow = 0;
        if (p->n_dims == 2) {
            if (set_slots) {
                t->mat_index[n_mat] = i;
                t->mat_off[n_mat] = a;
            }
            mp[n_mat++] = q;
        } else {
            if (set_slots) {
                t->vec_index[n_vec] = i;
                t->vec_off[n_vec] = a;
            }
            vp[n_vec++] = q;
        }
    }
    if (set_slots) {
        t->n_mat = n_mat;
        t->n_vec = n_vec;
    }
    kiln_adamw_config cfg = kiln_adamw_default_config();
    cfg.lr = t->p.lr;
    cfg.beta1 = t->p.beta1;
    cfg.beta2 = t->p.beta2;
    cfg.eps = t->p.eps;
    cfg.weight_decay = t->p.weight_decay;
    cfg.seed = t->p.seed;
    cfg.moments = t->p.moment_storage == KILN_MOMENTS_Q8 ? KILN_ADAMW_MOMENTS_Q8 : KILN_ADAMW_MOMENTS_F32;
    kiln_adamw_config vcfg = cfg;
    vcfg.weights = KILN_ADAMW_F32;
    static const kiln_adamw_weights wmap[] = {KILN_ADAMW_F32, KILN_ADAMW_BF16_MASTER,
                                              KILN_ADAMW_BF16_KAHAN, KILN_ADAMW_BF16_SR};
    cfg.weights = wmap[t->p.weight_storage];
    /* a rank's range may hold no matrix or no vector: an empty optimizer (whole parameters
     * always hold both kinds) */
    if (st == KILN_OK)
        st = n_mat ? kiln_adamw_create_on(t->be, mp, n_mat, &cfg, mat) : kiln_adamw_create_empty(t->be, &cfg, mat);
    if (st == KILN_OK)
        st = n_vec ? kiln_adamw_create_on(t->be, vp, n_vec, &vcfg, vec) : kiln_adamw_create_empty(t->be, &vcfg, vec);
    kiln_free(mp);
    kiln_free(vp);
    if (st != KILN_OK) {
        kiln_adamw_free(*mat);
        kiln_adamw_free(*vec);
        *mat = *vec = NULL;
    }
    return st;
}

static kiln_status create_optimizers(kiln_trainer *t) {
    kiln_adamw_free(t->opt_mat);
    kiln_adamw_free(t->opt_vec);
    t->opt_mat = t->opt_vec = NULL;
    int64_t total = 0;
    for (int i = 0; i < t->n_params; i++) total += t->params[i].n;
    return kiln_trainer_make_optimizers(t, 0, total, &t->opt_mat, &t->opt_vec, 1);
}

/* ---- arenas ------------------------------------------------------------------------------ */

/* The architecture's activations (models/arch.h train_init) and the trainer's own step
 * arrays: targets and positions, the loss's statistics, the CPU's kept logits. */
static kiln_status alloc_activations(kiln_trainer *t) {
    const kiln_model_config *c = &t->cfg;
    size_t T = (size_t)t->p.max_seq * (size_t)t->p.max_batch;
    t->io.be = t->be;
    t->io.model = t->model;
    t->io.refs = t->refs;
    t->io.layer_refs = t->layer_refs;
    t->io.max_seq = t->p.max_seq;
    t->io.max_batch = t->p.max_batch;
    t->io.fast = t->p.fast;
    KILN_TRY(t->model->arch->train_init(&t->io));
    if (!t->host) {
        t->pos_host = kiln_calloc(T, sizeof(int32_t));
        t->ids_host = kiln_calloc(T, sizeof(int32_t));
        if (!t->pos_host || !t->ids_host) return kiln_error(KILN_ERR_NOMEM, "trainer: out of memory");
    }
    t->targets = kiln_calloc(2 * T, sizeof(int32_t));
    if (!t->targets) return kiln_error(KILN_ERR_NOMEM, "trainer: out of memory");
    t->ce_stats = bmem_alloc(t, 3 * T * sizeof(float), "the loss statistics");
    if (!t->ce_stats) return KILN_ERR_NOMEM;
    if (t->host && t->p.ce_keep_mib > 0) {
        /* no more than the loss's whole logits (every row, every column) */
        size_t want = (size_t)t->p.ce_keep_mib << 18, all = T * (size_t)c->n_vocab;
        t->ce_keep_floats = want < all ? want : all;
        t->ce_keep = kiln_malloc(t->ce_keep_floats * sizeof(float));
        if (!t->ce_keep) return kiln_error(KILN_ERR_NOMEM, "trainer: out of memory for %d MiB of kept logits",
                                           t->p.ce_keep_mib);
    }
    t->positions = t->targets + T;
    return KILN_OK;
}

kiln_train_params kiln_train_default_params(void) {
    kiln_train_params p;
    memset(&p, 0, sizeof p);
    p.max_seq = 256;
    p.max_batch = 1;
    p.lr = 1e-3;
    p.beta1 = 0.9;
    p.beta2 = 0.999;
    p.eps = 1e-8;
    p.weight_decay = 0.01;
    p.device = -1;
    p.ce_keep_mib = 64;
    p.ce_row_block = 2048;
    return p;
}

static void trainer_destroy(kiln_trainer *t);

kiln_status kiln_trainer_enter(const kiln_trainer *t, const char *call) {
    KILN_TRY(kiln_handle_check(t, KILN_HANDLE_TRAINER, call));
    return kiln_backend_enter(t->be, call);
}

kiln_status kiln_trainer_status(const kiln_trainer *t) { return kiln_trainer_enter(t, "kiln_trainer_status"); }

/* kiln_trainer_create; with ranks > 1, a host trainer made lean for rank `rank` of a ZeRO-3 run
 * (t->lean: only its range written, its optimizers over it; kiln_train_dp_attach follows). */
static kiln_status trainer_create(kiln_model *m, const kiln_train_params *params, int rank, int ranks,
                                  int consume, kiln_trainer **out) {
    KILN_TRY(kiln_handle_check(m, KILN_HANDLE_MODEL, "kiln_trainer_create"));
    KILN_TRY(kiln_model_weights_check(m, "kiln_trainer_create"));
    if (!out) return kiln_error(KILN_ERR_INVALID_ARG, "kiln_trainer_create: out must be set");
    kiln_train_params p = params ? *params : kiln_train_default_params();
    if (p.max_seq < 2 || p.max_seq > m->cfg.n_ctx_train)
        return kiln_error(KILN_ERR_RANGE, "kiln_trainer_create: max_seq %d not in [2, %d] (the model's context)",
                          p.max_seq, m->cfg.n_ctx_train);
    if (p.max_batch == 0) p.max_batch = 1; /* params zeroed by hand: one sequence */
    if (p.max_batch < 1 || (int64_t)p.max_batch * p.max_seq > INT_MAX / 4)
        return kiln_error(KILN_ERR_RANGE, "kiln_trainer_create: max_batch %d: need 1 <= max_batch and max_batch x "
                          "max_seq (%d) tokens to fit an int", p.max_batch, p.max_seq);
    if ((unsigned)p.weight_storage > KILN_STORAGE_BF16_SR || (unsigned)p.moment_storage > KILN_MOMENTS_Q8)
        return kiln_error(KILN_ERR_INVALID_ARG, "kiln_trainer_create: unknown storage variant");
    if (p.ce_chunk < 0 || p.n_threads < 0 || p.ce_row_block < 0)
        return kiln_error(KILN_ERR_INVALID_ARG,
                          "kiln_trainer_create: ce_chunk, n_threads and ce_row_block must be >= 0");
    if (p.device < -1)
        return kiln_error(KILN_ERR_INVALID_ARG, "kiln_trainer_create: device %d: use -1 (CPU) or a CUDA device index >= 0",
                          p.device);
    if ((unsigned)p.format_rounding > KILN_ROUND_STOCHASTIC)
        return kiln_error(KILN_ERR_INVALID_ARG, "kiln_trainer_create: format_rounding %d: use KILN_ROUND_NEAREST (0) "
                          "or KILN_ROUND_STOCHASTIC (1)", p.format_rounding);
    if (p.format != KILN_FORMAT_F32 && p.fast)
        return kiln_error(KILN_ERR_INVALID_ARG, "kiln_trainer_create: the exact formats (mx16, mx8) are an auditable "
                          "arithmetic: not with fast");
    if (p.fast && p.device < 0)
        return kiln_error(KILN_ERR_UNSUPPORTED, "kiln_trainer_create: fast is a GPU mode (the CPU has no fast training): "
                                                "set device to a CUDA device index >= 0, or fast to 0");
    if (!m->arch->train_init)
        return kiln_error(KILN_ERR_UNSUPPORTED, "kiln_trainer_create: training %s models is not implemented yet",
                          m->arch->name);
    if (m->cfg.mlp_bias)
        return kiln_error(KILN_ERR_UNSUPPORTED, "kiln_trainer_create: MLP biases (mlp_bias) are not trainable yet");
    kiln_trainer *t = kiln_calloc(1, sizeof *t);
    if (!t) return kiln_error(KILN_ERR_NOMEM, "trainer: out of memory");
    /* m counts t as a user from here (kiln_model_close refuses while it does) */
    kiln_status ast = kiln_handle_acquire(m, KILN_HANDLE_MODEL, "kiln_trainer_create");
    if (ast != KILN_OK) {
        kiln_free(t);
        return ast;
    }
    t->model = m;
    t->cfg = m->cfg;
    t->p = p;
    t->grad_coef = 1.0f;
    kiln_status st;
    /* fast: bf16 tensor-core products forward and backward (docs/TRAINING.md, "Fast mode");
     * an exact format: the auditable arithmetic with every product in it, on either device */
    int mode = 0;
    st = kiln_backend_mode_of(p.device, p.fast, 0, p.format, "kiln_trainer_create", &mode);
    t->mx = p.format != KILN_FORMAT_F32;
    t->mx_stale = 1;
    if (p.device >= 0) {
        if (st == KILN_OK) st = kiln_backend_acquire(p.device, mode, 0, &t->be);
        if (st != KILN_OK) { /* say which setting asked for CUDA, keep the backend's reason */
            char why[512];
            snprintf(why, sizeof why, "%s", kiln_last_error());
            trainer_destroy(t);
            return kiln_error(st, "kiln_trainer_create: device %d (CUDA) unavailable: %s", p.device, why);
        }
    } else if (st == KILN_OK) {
        st = kiln_backend_acquire(-1, mode, p.n_threads, &t->be);
    }
    if (st == KILN_OK) t->host = t->be->i->host_memory;
    if (st == KILN_OK && !t->host && p.fast && t->be->i->graph_begin) {
        t->graphs = !kiln_env_off("KILN_CUDA_GRAPHS");
    }
    if (st == KILN_OK && !t->host)
        st = check_backend_ops(t, p.weight_storage != KILN_STORAGE_F32 ? KILN_DTYPE_BF16 : KILN_DTYPE_F32);
    int max_params = 0;
    if (st == KILN_OK) st = declare_params(t, 1, &max_params);
    if (st == KILN_OK) {
        t->params = kiln_calloc((size_t)max_params, sizeof *t->params);
        t->mat_index = kiln_calloc((size_t)max_params, sizeof(int));
        t->vec_index = kiln_calloc((size_t)max_params, sizeof(int));
        t->mat_off = kiln_calloc((size_t)max_params, sizeof(int64_t));
        t->vec_off = kiln_calloc((size_t)max_params, sizeof(int64_t));
        if (!t->params || !t->mat_index || !t->vec_index || !t->mat_off || !t->vec_off)
            st = kiln_error(KILN_ERR_NOMEM, "trainer: out of memory");
    }
    if (st == KILN_OK) st = declare_params(t, 0, NULL);
    if (st == KILN_OK) st = check_extras(t);
    int64_t total = 0;
    for (int i = 0; st == KILN_OK && i < t->n_params; i++) {
        t->params[i].flat = total;
        total += t->params[i].n;
    }
    if (st == KILN_OK && ranks > 1 && t->host) { /* the rank's range, as kiln_train_dp_attach makes it */
        const int64_t S = (total + ranks - 1) / ranks;
        t->lean = 1;
        /* consuming the model: only as its one user (checked here, where t has become one) */
        t->consume = consume && kiln_handle_sole_user(m, KILN_HANDLE_MODEL, "kiln_train_create_rank") == KILN_OK;
        t->lean_lo = (int64_t)rank * S < total ? (int64_t)rank * S : total;
        t->lean_hi = t->lean_lo + S < total ? t->lean_lo + S : total;
    }
    if (st == KILN_OK) {
        size_t wbytes = 0, n_all = 0;
        for (int i = 0; i < t->n_params; i++) {
            train_param *q = &t->params[i];
            wbytes += (((size_t)q->n * (q->dtype == KILN_DTYPE_F32 ? 4 : 2)) + 63) & ~(size_t)63;
            n_all += ((size_t)q->n + 15) & ~(size_t)15;
        }
        t->n_grad = n_all;
        if (t->lean) { /* pages touched only where the rank's elements are written (below) */
            t->param_block = kiln_malloc(wbytes);
            t->grad_block = t->param_block ? kiln_malloc(n_all * sizeof(float)) : NULL;
            if (!t->param_block || !t->grad_block)
                st = kiln_error(KILN_ERR_NOMEM, "trainer: out of memory for the weights and gradients (%zu bytes)",
                                wbytes + n_all * sizeof(float));
        } else {
            t->param_block = bmem_alloc(t, wbytes, "parameters");
            t->grad_block = t->param_block ? bmem_alloc(t, n_all * sizeof(float), "gradients") : NULL;
            if (!t->param_block || !t->grad_block) st = KILN_ERR_NOMEM;
        }
        size_t woff = 0, goff = 0;
        float *tmp = NULL;
        uint16_t *tmp16 = NULL;
        int64_t max_n = 0;
        for (int i = 0; st == KILN_OK && i < t->n_params; i++)
            if (t->params[i].n > max_n) max_n = t->params[i].n;
        if (st == KILN_OK && (p.weight_storage != KILN_STORAGE_F32 || !t->host || p.n_extra || t->lean)) {
            tmp = kiln_malloc((size_t)max_n * sizeof(float));
            tmp16 = t->host ? NULL : kiln_malloc((size_t)max_n * sizeof(uint16_t));
            if (!tmp || (!t->host && !tmp16)) st = kiln_error(KILN_ERR_NOMEM, "trainer: out of memory");
        }
        /* The matrices first (in parameter order), then the vectors: a layer's q, k, v
         * weights (and gate, up) lie back to back, with their gradients, even where biases
         * come between them in the parameter list, so the backward can run each group as one
         * stacked product (stacked_view). */
        for (int pass = 0; pass < 2; pass++)
            for (int i = 0; st == KILN_OK && i < t->n_params; i++) {
                train_param *q = &t->params[i];
                if ((q->n_dims == 2) != (pass == 0)) continue;
                q->w = (uint8_t *)t->param_block + woff;
                q->g = t->grad_block + goff;
                woff += (((size_t)q->n * (q->dtype == KILN_DTYPE_F32 ? 4 : 2)) + 63) & ~(size_t)63;
                goff += ((size_t)q->n + 15) & ~(size_t)15;
                bind_views(q);
                if (t->lean) { /* the rank's gradients zeroed (the rest: at attach, given back) */
                    int64_t a = 0, b = q->n; /* a vector: whole */
                    if (q->n_dims == 2) kiln_param_part(q, t->lean_lo, t->lean_hi, &a, &b);
                    memset(q->g + a, 0, (size_t)(b - a) * sizeof(float));
                }
            }
        t->param_bytes = wbytes;
        if (st == KILN_OK && p.fast && !t->host && p.weight_storage == KILN_STORAGE_F32 && t->be->i->to_bf16) {
            t->shadow = bmem_alloc(t, wbytes / 2, "the bf16 copies of the weights");
            if (!t->shadow) st = KILN_ERR_NOMEM;
            for (int i = 0; st == KILN_OK && i < t->n_params; i++) {
                train_param *q = &t->params[i];
                q->view16 = q->view;
                q->view16.dtype = KILN_DTYPE_BF16;
                q->view16.data = (uint8_t *)t->shadow + ((uint8_t *)q->w - (uint8_t *)t->param_block) / 2;
                q->view16.nbytes = (size_t)q->n * 2;
            }
            t->shadow_stale = 1; t->mx_stale = 1;
        }
        /* weights from the model, role by role in the order they were declared */
        load_ctx lc = {t, tmp, tmp16, 0};
        if (st == KILN_OK) {
            t->refs = kiln_calloc((size_t)m->arch->n_roles, sizeof *t->refs);
            t->layer_refs = kiln_calloc((size_t)t->cfg.n_layer * (size_t)m->arch->n_layer_roles + 1, sizeof *t->layer_refs);
            if (!t->refs || !t->layer_refs) st = kiln_error(KILN_ERR_NOMEM, "trainer: out of memory");
        }
        if (st == KILN_OK) st = kiln_arch_walk(m->arch, t->cfg.n_layer, load_role, &lc);
        if (st == KILN_OK) st = init_extras(t, tmp);
        kiln_free(tmp);
        kiln_free(tmp16);
    }
    if (st == KILN_OK) st = apply_format_rules(t, mode);
    t->p.format_rules = NULL; /* the caller's string: resolved by now */
    if (st == KILN_OK) st = alloc_activations(t);
    if (st == KILN_OK && t->lean) st = kiln_trainer_make_optimizers(t, t->lean_lo, t->lean_hi, &t->opt_mat, &t->opt_vec, 1);
    else if (st == KILN_OK) st = create_optimizers(t);
    t->p.extra = NULL; /* the caller's array: read by now (the names are copied) */
    if (st == KILN_OK) st = kiln_handle_register(&t->head, KILN_HANDLE_TRAINER, "kiln_trainer_create");
    if (st != KILN_OK) {
        trainer_destroy(t);
        return st;
    }
    *out = t;
    return KILN_OK;
}

/* Formats per weight (p.format_rules): resolved against the trainer's own weights, whose
 * addresses exist only once they are allocated, then the backend taken again with the table,
 * on the same device (what the first one allocated is kiln_malloc's on the CPU, cudaMalloc's
 * on a GPU: freed alike by any backend of that device; the first one's work is waited for,
 * as the second runs on a stream of its own). t->mx: whether any product runs in an exact
 * format. */
static kiln_status apply_format_rules(kiln_trainer *t, int mode) {
    const char *rules = t->p.format_rules;
    if (!rules || !*rules) return KILN_OK;
    const kiln_arch_desc *a = t->model->arch;
    kiln_weight_formats wf;
    int any_exact = 0;
    KILN_TRY(kiln_format_rules_resolve(rules, t->p.format, t->p.fast, a, &t->cfg, t->refs, t->layer_refs,
                                       t->refs[a->role_head].mat, "kiln_trainer_create", &wf, &any_exact));
    kiln_status st = KILN_OK;
    if (wf.n) {
        kiln_backend *be = NULL;
        st = kiln_backend_status(t->be);
        if (st == KILN_OK)
            st = kiln_backend_acquire_formats(t->p.device, mode, t->p.device >= 0 ? 0 : t->p.n_threads, &wf, &be);
        if (st == KILN_OK) {
            kiln_backend_release(t->be);
            t->be = be;
        }
    }
    kiln_free(wf.e);
    if (st == KILN_OK) t->mx = any_exact;
    return st;
}

kiln_status kiln_trainer_create(kiln_model *m, const kiln_train_params *params, kiln_trainer **out) {
    return trainer_create(m, params, 0, 1, 0, out);
}

kiln_status kiln_train_create_rank(kiln_model *m, const kiln_train_params *params, kiln_comm *c, int zero_stage,
                                   int consume, kiln_trainer **out) {
    if (!out) return kiln_error(KILN_ERR_INVALID_ARG, "kiln_train_create_rank: out must be set");
    *out = NULL;
    const int ranks = kiln_comm_size(c), lean = ranks > 1 && zero_stage == 3 && (!params || params->device < 0);
    kiln_trainer *t = NULL;
    KILN_TRY(trainer_create(m, params, lean ? kiln_comm_rank(c) : 0, lean ? ranks : 1, consume, &t));
    /* a device communicator (nccl) is a rank even alone: one GPU runs the path of N */
    kiln_status st = ranks > 1 || (c && !kiln_comm_host_memory(c)) ? kiln_train_dp_attach(t, c, zero_stage) : KILN_OK;
    if (st != KILN_OK) {
        kiln_trainer_free(t);
        return st;
    }
    *out = t;
    return KILN_OK;
}

void kiln_trainer_free(kiln_trainer *t) {
    if (!t || kiln_handle_unregister(&t->head, KILN_HANDLE_TRAINER, "kiln_trainer_free") != KILN_OK) return;
    trainer_destroy(t);
}

static void trainer_destroy(kiln_trainer *t) {
    kiln_trainer_dp_free(t);
    kiln_adamw_free(t->opt_mat);
    kiln_adamw_free(t->opt_vec);
    kiln_free(t->targets);
    kiln_free(t->pos_host);
    kiln_free(t->ids_host);
    if (t->ce_buf) bmem_free(t, t->ce_buf);
    if (t->g_fwd) t->be->i->graph_free(t->be, t->g_fwd);
    if (t->g_bwd) t->be->i->graph_free(t->be, t->g_bwd);
    bmem_free(t, t->ce_stats);
    kiln_free(t->ce_stats_host);
    kiln_free(t->ce_keep);
    if (t->model && t->model->arch->train_free) t->model->arch->train_free(&t->io);
    kiln_free(t->refs);
    kiln_free(t->layer_refs);
    /* the shared backend's quantized copies of these weights go with them (a later block at
     * the same address must not find them) */
    if (t->mx && t->param_block && t->be && t->be->i->forget) t->be->i->forget(t->be, t->param_block, t->param_bytes);
    bmem_free(t, t->param_block);
    bmem_free(t, t->shadow);
    bmem_free(t, t->grad_block);
    bmem_free(t, t->emb_acc);
    kiln_free(t->mat_index);
    kiln_free(t->vec_index);
    kiln_free(t->mat_off);
    kiln_free(t->vec_off);
    kiln_free(t->params);
    kiln_backend_release(t->be);
    kiln_handle_release(t->model, "kiln_trainer_free");
    kiln_free(t);
}

/* ---- forward ------------------------------------------------------------------------------- */

/* The weight view a matrix product takes: the bf16 copy where the trainer keeps one. */
static const kiln_tensor *mat_view(const kiln_trainer *t, const train_param *p) {
    return t->shadow ? &p->view16 : &p->view;
}

static void drop_graphs(kiln_trainer *t) {
    if (t->g_fwd) t->be->i->graph_free(t->be, t->g_fwd);
    if (t->g_bwd) t->be->i->graph_free(t->be, t->g_bwd);
    t->g_fwd = t->g_bwd = NULL;
    t->g_fwd_runs = t->g_bwd_runs = 0;
    t->g_nseq = t->g_seq = 0;
}

/* work(t, n_seq, seq): plainly, or (t->graphs) through the graph *graph of this shape, which
 * is recorded on the second call at the shape (*runs counts the plain ones) and replayed from
 * then on; recorded again when the backend says a workspace it used was reallocated. */
/* The architecture's layer work of a forward and a backward (models/arch.h). */
static void forward_layers(kiln_trainer *t, int n_seq, int seq) { t->model->arch->train_forward(&t->io, n_seq, seq); }
static void backward_layers(kiln_trainer *t, int n_seq, int seq) { t->model->arch->train_backward(&t->io, n_seq, seq); }

static kiln_status run_layers(kiln_trainer *t, void **graph, int *runs, void (*work)(kiln_trainer *, int, int),
                              int n_seq, int seq) {
    kiln_backend *be = t->be;
    if (!t->graphs) {
        work(t, n_seq, seq);
        return KILN_OK;
    }
    if (t->g_nseq != n_seq || t->g_seq != seq) { /* a new shape: start over */
        drop_graphs(t);
        t->g_nseq = n_seq;
        t->g_seq = seq;
    }
    if (!*graph && (*runs)++ == 0) { /* the first run at a shape grows the workspaces */
        work(t, n_seq, seq);
        return KILN_OK;
    }
    kiln_status st = KILN_OK;
    for (int attempt = 0; attempt < 2; attempt++) {
        if (!*graph) {
            KILN_TRY(be->i->graph_begin(be, 0, 0, 0, 0));
            work(t, n_seq, seq);
            KILN_TRY(be->i->graph_end(be, graph));
        }
        st = be->i->graph_launch(be, *graph);
        if (st != KILN_ERR_STATE) break;
        be->i->graph_free(be, *graph); /* stale: a larger call in between grew a workspace */
        *graph = NULL;
    }
    return st;
}

/* A forward of n_seq sequences of seq tokens, ids (n_seq x seq) back to back: the bf16 weight
 * copy refreshed when stale, ids and positions put in place, then the layer work. */
static kiln_status forward(kiln_trainer *t, const int32_t *ids, int n_seq, int seq) {
    kiln_backend *be = t->be;
    const kiln_backend_i *op = be->i;
    if (t->shadow && t->shadow_stale) { /* one conversion of every weight (f32 block -> bf16) */
        op->to_bf16(be, t->shadow, (const float *)t->param_block, t->param_bytes / sizeof(float));
        t->shadow_stale = 0;
    }
    if (t->mx && t->mx_stale) { /* the weights changed: their quantized copies are made again */
        if (op->forget) op->forget(be, t->param_block, t->param_bytes);
        t->mx_stale = 0;
    }
    int T = n_seq * seq;
    if (t->host) {
        for (int n = 0; n < T; n++) t->io.pos[n] = n % seq;
        memcpy(t->io.ids, ids, (size_t)T * sizeof(int32_t));
    } else {
        if (t->pos_seq != seq || t->pos_rows < T) { /* positions depend on seq alone */
            for (int n = 0; n < T; n++) t->pos_host[n] = n % seq;
            t->pos_seq = 0;
            KILN_TRY(kiln_backend_upload(be, t->io.pos, t->pos_host, (size_t)T * sizeof(int32_t)));
            t->pos_seq = seq;
            t->pos_rows = T;
        }
        KILN_TRY(kiln_backend_upload(be, t->io.ids, ids, (size_t)T * sizeof(int32_t)));
        memcpy(t->ids_host, ids, (size_t)T * sizeof(int32_t));
    }
    if (t->dp) KILN_TRY(kiln_trainer_dp_forward_begin(t)); /* ZeRO-3: the rest's weights */
    KILN_TRY(run_layers(t, &t->g_fwd, &t->g_fwd_runs, forward_layers, n_seq, seq));
    return t->dp ? kiln_trainer_dp_layers_status(t) : KILN_OK; /* ZeRO-3: the layers' gathers */
}

static kiln_status check_ready(kiln_trainer *t, const char *call) {
    KILN_TRY(kiln_trainer_enter(t, call));
    if (t->pending)
        return kiln_error(KILN_ERR_STATE, "%s: a step is pending (call kiln_train_backward or kiln_train_discard first)", call);
    return KILN_OK;
}

static kiln_status check_ids(kiln_trainer *t, const int32_t *ids, int n, const char *call) {
    if (!ids) return kiln_error(KILN_ERR_INVALID_ARG, "%s: ids is NULL", call);
    if (n < 1 || n > t->p.max_seq)
        return kiln_error(KILN_ERR_RANGE, "%s: sequence of %d tokens not in [1, %d] (max_seq)", call, n, t->p.max_seq);
    for (int i = 0; i < n; i++)
        if (ids[i] < 0 || ids[i] >= t->cfg.n_vocab)
            return kiln_error(KILN_ERR_RANGE, "%s: token id %d at position %d is out of range [0, %d)", call, ids[i], i,
                              t->cfg.n_vocab);
    return KILN_OK;
}

/* kiln_fused_ce with the trainer's kept scratch (devices): a call that needed more than it
 * holds allocated its own; the kept one then grows to that size for the next calls. */
static kiln_status fused_ce_call(kiln_trainer *t, kiln_fused_ce_params *cp, kiln_fused_ce_result *r) {
    if (!t->host) {
        cp->scratch = t->ce_buf;
        cp->scratch_cap = t->ce_buf_cap;
    }
    kiln_status st = kiln_fused_ce(t->be, cp, r);
    if (st == KILN_OK && !t->host && r->scratch_bytes > t->ce_buf_cap) {
        if (t->ce_buf) bmem_free(t, t->ce_buf);
        t->ce_buf_cap = 0;
        t->ce_buf = bmem_alloc(t, r->scratch_bytes, "the fused loss's scratch");
        if (!t->ce_buf) return KILN_ERR_NOMEM;
        t->ce_buf_cap = r->scratch_bytes;
    }
    return st;
}

/* A step's peak starts here: kiln's host allocations, and on a device the backend's
 * short-lived allocations (own_memory), counted from what they hold now. */
static void step_peak_reset(kiln_trainer *t) {
    kiln_mem_reset_peak();
    t->peak_step = 0;
    if (!t->host && t->be->i->own_memory) t->be->i->own_memory(t->be, NULL, NULL, true);
}

static void track_peak(kiln_trainer *t) {
    kiln_mem_stats s;
    kiln_mem_get_stats(&s);
    if (s.peak_bytes > t->peak_step) t->peak_step = s.peak_bytes;
}

kiln_status kiln_train_forward(kiln_trainer *t, const int32_t *ids, int n, const int32_t *targets,
                               kiln_loss_reduction red, float scale, float *loss) {
    return kiln_train_forward_batch(t, ids, 1, n, targets, red, scale, loss);
}

/* The checks of a step's n_seq x seq ids (every step call): KILN_OK or the error naming what
 * is wrong, before anything is touched. */
static kiln_status check_batch(kiln_trainer *t, const char *call, const int32_t *ids, int n_seq, int seq) {
    KILN_TRY(check_ready(t, call));
    if (n_seq < 1 || n_seq > t->p.max_batch)
        return kiln_error(KILN_ERR_RANGE, "%s: %d sequences not in [1, %d] (max_batch)", call, n_seq, t->p.max_batch);
    KILN_TRY(check_ids(t, ids, seq, call));
    for (int b = 1; b < n_seq; b++) KILN_TRY(check_ids(t, ids + (size_t)b * seq, seq, call));
    return KILN_OK;
}

/* check_batch, and those of a loss step's targets (forward_batch, step_batch). */
static kiln_status check_loss_step(kiln_trainer *t, const char *call, const int32_t *ids, int n_seq, int seq,
                                   const int32_t *targets, kiln_loss_reduction red, float scale, const float *loss) {
    KILN_TRY(check_batch(t, call, ids, n_seq, seq));
    if (!targets || !loss) return kiln_error(KILN_ERR_INVALID_ARG, "%s: targets and loss must be set", call);
    if (red != KILN_LOSS_MEAN && red != KILN_LOSS_SUM)
        return kiln_error(KILN_ERR_INVALID_ARG, "%s: unknown reduction %d", call, (int)red);
    if (!isfinite(scale)) return kiln_error(KILN_ERR_INVALID_ARG, "%s: scale is not finite", call);
    return KILN_OK;
}

/* What the backward of a loss step over n_seq x seq rows needs to know of it. */
static void keep_step(kiln_trainer *t, const int32_t *targets, int n_seq, int seq, kiln_loss_reduction red,
                      float scale) {
    const int n = n_seq * seq;
    memcpy(t->targets, targets, (size_t)n * sizeof(int32_t));
    t->T = n;
    t->n_seq = n_seq;
    t->seq = seq;
    t->red = red;
    t->scale = scale;
}

/* The fused loss's parameters for the T rows of the current forward (t->io.xn) and targets. */
static kiln_fused_ce_params loss_params(kiln_trainer *t, int T, const int32_t *targets, kiln_loss_reduction red,
                                        float scale) {
    kiln_fused_ce_params cp = kiln_fused_ce_default_params();
    cp.N = T;
    cp.H = t->cfg.n_embd;
    cp.V = t->cfg.n_vocab;
    cp.hidden = t->io.xn;
    cp.weight = mat_view(t, t->lm_head)->data;
    cp.weight_dtype = mat_view(t, t->lm_head)->dtype;
    cp.targets = targets;
    cp.reduction = red == KILN_LOSS_SUM ? KILN_CE_REDUCTION_SUM : KILN_CE_REDUCTION_MEAN;
    cp.scale = scale;
    cp.chunk = t->p.ce_chunk;
    return cp;
}

/* ZeRO-3 ranks (kiln_train_dp_attach): st made every rank's at one of a step's fixed points, so
 * that a failure on one rank stops every rank at the same collective; elsewhere st as it is. */
static kiln_status step_agree(kiln_trainer *t, kiln_status st, const char *call, const char *where) {
    if (kiln_handle_check(t, KILN_HANDLE_TRAINER, call) != KILN_OK || !kiln_trainer_dp_sharded(t)) return st;
    char what[128];
    snprintf(what, sizeof what, "%s (%s)", call, where);
    return kiln_trainer_dp_agree(t, st, what);
}

kiln_status kiln_train_forward_batch(kiln_trainer *t, const int32_t *ids, int n_seq, int seq, const int32_t *targets,
                                     kiln_loss_reduction red, float scale, float *loss) {
    const char *call = n_seq == 1 ? "kiln_train_forward" : "kiln_train_forward_batch";
    KILN_TRY(step_agree(t, check_loss_step(t, call, ids, n_seq, seq, targets, red, scale, loss), call,
                        "before its forward"));
    int n = n_seq * seq;
    step_peak_reset(t);
    kiln_status fst = forward(t, ids, n_seq, seq);
    if (fst != KILN_OK) return kiln_error_prefix(fst, "%s", call);
    /* the loss alone (pass 1): errors (no supervised position, target out of range,
     * non-finite loss) leave nothing pending */
    kiln_fused_ce_params cp = loss_params(t, n, targets, red, scale);
    cp.row_stats_out = t->ce_stats; /* backward's loss call skips its pass 1 */
    cp.keep = t->ce_keep;            /* ... and its first logits products (CPU) */
    cp.keep_floats = t->ce_keep_floats;
    kiln_fused_ce_result r;
    kiln_status st = fused_ce_call(t, &cp, &r);
    if (st != KILN_OK) return kiln_error_prefix(st, "%s", call);
    KILN_TRY(backend_check(t, call));
    t->ce_scratch = r.scratch_bytes;
    keep_step(t, targets, n_seq, seq, red, scale);
    t->pending = 1;
    *loss = r.loss;
    track_peak(t);
    return KILN_OK;
}

kiln_status kiln_train_forward_hidden(kiln_trainer *t, const int32_t *ids, int n,
                                      const int32_t *positions, int n_pos, float *hidden) {
    KILN_TRY(check_ready(t, "kiln_train_forward_hidden"));
    KILN_TRY(check_ids(t, ids, n, "kiln_train_forward_hidden"));
    if (!positions || !hidden || n_pos < 1 || n_pos > n)
        return kiln_error(KILN_ERR_INVALID_ARG, "kiln_train_forward_hidden: need 1..%d positions and a hidden buffer", n);
    for (int i = 0; i < n_pos; i++) {
        if (positions[i] < 0 || positions[i] >= n)
            return kiln_error(KILN_ERR_RANGE, "kiln_train_forward_hidden: position %d (index %d) not in [0, %d)",
                              positions[i], i, n);
        for (int j = 0; j < i; j++)
            if (positions[j] == positions[i])
                return kiln_error(KILN_ERR_INVALID_ARG, "kiln_train_forward_hidden: position %d given twice", positions[i]);
    }
    step_peak_reset(t);
    kiln_status fst = forward(t, ids, 1, n);
    if (fst != KILN_OK) return kiln_error_prefix(fst, "kiln_train_forward_hidden");
    int C = t->cfg.n_embd;
    for (int i = 0; i < n_pos; i++)
        KILN_TRY(kiln_backend_download(t->be, hidden + (size_t)i * C, t->io.xn + (size_t)positions[i] * C,
                                       (size_t)C * sizeof(float)));
    KILN_TRY(backend_check(t, "kiln_train_forward_hidden"));
    t->ce_scratch = 0;
    memcpy(t->positions, positions, (size_t)n_pos * sizeof(int32_t));
    t->n_pos = n_pos;
    t->T = n;
    t->n_seq = 1;
    t->seq = n;
    t->pending = 2;
    track_peak(t);
    return KILN_OK;
}

kiln_status kiln_train_discard(kiln_trainer *t) {
    KILN_TRY(kiln_trainer_enter(t, "kiln_train_discard"));
    t->pending = 0;
    return KILN_OK;
}

static void zero_grads(kiln_trainer *t) {
    t->grads_unusable = 0;
    if (kiln_trainer_dp_sharded(t))
        kiln_trainer_dp_zero_own_grads(t);
    else if (t->host)
        for (int i = 0; i < t->n_params; i++) memset(t->params[i].g, 0, (size_t)t->params[i].n * sizeof(float));
    else
        zero_floats(t, t->grad_block, t->n_grad); /* the padding too: it stays 0 */
}

/* A backward's start: the gradients zeroed (not accumulate: the pending clip coefficient
 * dropped with them) or brought to their logical values (a pending coefficient applied). */
static kiln_status begin_grads(kiln_trainer *t, int accumulate) {
    t->grads_finite = 0;
    t->emb_acc_live = 0;
    t->micro = accumulate ? t->micro + 1 : 0;
    if (t->mx && t->p.format_rounding == KILN_ROUND_STOCHASTIC) {
        /* the micro-batch's place in the step as one process orders them: a rank's gradient
         * is one micro-batch (accumulation is refused with ranks), its place the rank's */
        const uint64_t micro = (uint64_t)t->micro + (uint64_t)kiln_train_dp_rank(t);
        if (t->be->i->grad_rounding)
            t->be->i->grad_rounding(t->be, 1, t->p.seed, (uint64_t)kiln_adamw_get_step(t->opt_mat), micro);
    }
    if (accumulate) {
        KILN_TRY(apply_grad_coef(t));
        /* the embedding's rows (and a tied head's dW) of this micro-step go to a zeroed
         * scratch, added to the gradient once (emb_grad_end) */
        const size_t n = (size_t)t->tok_embd->n;
        if (!t->emb_acc) {
            t->emb_acc = bmem_alloc(t, n * sizeof(float), "the embedding's micro-step gradient");
            if (!t->emb_acc) return KILN_ERR_NOMEM;
        } else {
            zero_floats(t, t->emb_acc, n);
        }
        t->emb_acc_live = 1;
        return KILN_OK;
    }
    zero_grads(t);
    t->grad_coef = 1.0f;
    if (t->dp) kiln_trainer_dp_grads_begin(t);
    return KILN_OK;
}

/* Where this micro-step's output-head gradient goes: the head's gradient, or for a tied head
 * of an accumulating step the embedding's scratch (begin_grads). */
static float *head_grad(kiln_trainer *t) {
    return t->emb_acc_live && t->lm_head == t->tok_embd ? t->emb_acc : t->lm_head->g;
}

/* The embedding's backward of n rows of ids, then, in an accumulating step, its scratch added to
 * the gradient: g = g + (((0 + r_1) + r_2) + ...), the micro-step's rows summed alone
 * (docs/ARITHMETIC.md, "Accumulated micro-steps"), so that an accumulated gradient is
 * ((0 + g_0) + g_1) + ... of whole micro-step gradients, what data-parallel ranks sum. */
static void emb_grad(kiln_trainer *t, const float *dx, const int32_t *ids, int n) {
    const kiln_backend_i *op = t->be->i;
    op->embed_backward(t->be, t->emb_acc_live ? t->emb_acc : t->tok_embd->g, dx, ids, n, t->cfg.n_vocab,
                       t->cfg.n_embd);
    if (t->emb_acc_live) op->add(t->be, t->tok_embd->g, t->emb_acc, (size_t)t->tok_embd->n);
    t->emb_acc_live = 0;
}

/* The backward of the layers from d loss / d xn (t->io.dxn) of n_seq x seq rows, then the
 * embedding's: outside the graph, from host ids (a device backend groups the tokens by id on
 * the host, an O(T) plan it uploads each call, instead of searching the ids on the device). */
static kiln_status layers_backward(kiln_trainer *t, int n_seq, int seq) {
    kiln_status st = run_layers(t, &t->g_bwd, &t->g_bwd_runs, backward_layers, n_seq, seq);
    if (st == KILN_OK && t->dp) st = kiln_trainer_dp_layers_status(t); /* ZeRO-3: the layers' collectives */
    if (st == KILN_OK)
        emb_grad(t, t->io.dx, t->host ? t->io.ids : t->ids_host, n_seq * seq);
    if (st == KILN_OK && t->dp) st = kiln_trainer_dp_backward_end(t); /* ZeRO-3: the rest's gradients */
    return st;
}

kiln_status kiln_train_backward(kiln_trainer *t, const float *dhidden, int accumulate) {
    KILN_TRY(kiln_trainer_enter(t, "kiln_train_backward"));
    if (!t->pending) return kiln_error(KILN_ERR_STATE, "kiln_train_backward: no pending step (call a forward first)");
    if (t->pending == 2 && !dhidden)
        return kiln_error(KILN_ERR_INVALID_ARG, "kiln_train_backward: the step handed out hidden states: pass their gradient");
    if (t->pending == 1 && dhidden)
        return kiln_error(KILN_ERR_INVALID_ARG, "kiln_train_backward: the step computed its own loss: dhidden must be NULL");
    int C = t->cfg.n_embd, T = t->T;
    kiln_status ast = begin_grads(t, accumulate);
    if (ast != KILN_OK) {
        t->pending = 0;
        return kiln_error_prefix(ast, "kiln_train_backward");
    }
    if (t->pending == 1) {
        kiln_fused_ce_params cp = loss_params(t, T, t->targets, t->red, t->scale);
        cp.dhidden = t->io.dxn;
        cp.dweight = head_grad(t);
        cp.row_stats_in = t->ce_stats; /* from the forward: same inputs, same bits */
        cp.keep = t->ce_keep;          /* the forward's kept logits (CPU) */
        cp.keep_floats = t->ce_keep_floats;
        cp.no_wait = 1; /* the loss is the forward's; errors: backend_check at the end */
        kiln_fused_ce_result r;
        kiln_status st = fused_ce_call(t, &cp, &r);
        if (st != KILN_OK) {
            t->pending = 0;
            return kiln_error_prefix(st, "kiln_train_backward");
        }
        if (r.scratch_bytes > t->ce_scratch) t->ce_scratch = r.scratch_bytes;
    } else {
        for (int i = 0; i < t->n_pos; i++) {
            const float *src = dhidden + (size_t)i * C;
            for (int j = 0; j < C; j++)
                if (!isfinite(src[j]))
                    return kiln_error(KILN_ERR_RANGE, "kiln_train_backward: dhidden[%d][%d] is not finite", i, j);
        }
        zero_floats(t, t->io.dxn, (size_t)T * C);
        for (int i = 0; i < t->n_pos; i++) {
            kiln_status st = kiln_backend_upload(t->be, t->io.dxn + (size_t)t->positions[i] * C, dhidden + (size_t)i * C,
                                                 (size_t)C * sizeof(float));
            if (st != KILN_OK) {
                t->pending = 0;
                return kiln_error_prefix(st, "kiln_train_backward");
            }
        }
    }
    kiln_status bst = layers_backward(t, t->n_seq, t->seq);
    t->pending = 0;
    if (bst != KILN_OK) return kiln_error_prefix(bst, "kiln_train_backward");
    track_peak(t);
    return backend_check(t, "kiln_train_backward");
}

/* A loss step in one call. On a device in fast mode with a detached download, nothing waits
 * between the forward and the backward: the loss's gradient is enqueued right behind its
 * pass 1 (fused_ce's no_wait with row_stats_out), the statistics' download is begun behind
 * them, the layers' backward and the embedding's are enqueued, and only then does the host
 * wait -- for the download alone, so the device is still busy with the backward when this
 * returns the loss. With ce_row_block 0 these are the products of forward_batch + backward on
 * the same operands, so the same bits; with ce_row_block > 0 (the default) the loss walks the
 * rows in blocks (fused_ce's row_block: one logits product fewer; the loss's statistics and
 * the head's gradients differ in the last bits, deterministic run to run). Elsewhere it is
 * forward_batch + backward. */
kiln_status kiln_train_step_batch(kiln_trainer *t, const int32_t *ids, int n_seq, int seq, const int32_t *targets,
                                  kiln_loss_reduction red, float scale, int accumulate, float *loss) {
    const char *call = "kiln_train_step_batch";
    if (kiln_handle_check(t, KILN_HANDLE_TRAINER, call) == KILN_OK && kiln_trainer_dp_sharded(t)) {
        /* ZeRO-3: forward_batch (agreeing before its forward), the agreement after the loss,
         * the backward: the same collectives on every rank whatever fails where */
        kiln_status st = step_agree(t, kiln_train_forward_batch(t, ids, n_seq, seq, targets, red, scale, loss), call,
                                    "after its loss");
        if (st != KILN_OK) {
            t->pending = 0;
            return st;
        }
        return kiln_train_backward(t, NULL, accumulate);
    }
    KILN_TRY(check_loss_step(t, call, ids, n_seq, seq, targets, red, scale, loss));
    const kiln_backend_i *op = t->be->i;
    if (t->host || !t->p.fast || !op->download_begin || !op->download_end) {
        KILN_TRY(kiln_train_forward_batch(t, ids, n_seq, seq, targets, red, scale, loss));
        return kiln_train_backward(t, NULL, accumulate);
    }
    const int n = n_seq * seq;
    { /* the loss's own row checks first, so that an error leaves the gradients as they were */
        kiln_fused_ce_params chk = loss_params(t, n, targets, red, scale);
        int64_t supervised;
        kiln_status cst = kiln_fused_ce_supervised(&chk, &supervised);
        if (cst != KILN_OK) return kiln_error_prefix(cst, "%s", call);
    }
    if (!t->ce_stats_host) {
        t->ce_stats_host = kiln_malloc((size_t)3 * (size_t)t->p.max_seq * (size_t)t->p.max_batch * sizeof(float));
        if (!t->ce_stats_host) return kiln_error(KILN_ERR_NOMEM, "%s: out of host memory", call);
    }
    step_peak_reset(t);
    kiln_status st = forward(t, ids, n_seq, seq);
    if (st != KILN_OK) return kiln_error_prefix(st, "%s", call);
    st = begin_grads(t, accumulate);
    if (st != KILN_OK) return kiln_error_prefix(st, "%s", call);
    /* from here on a failure leaves the gradients partly updated: they are marked unusable */
    keep_step(t, targets, n_seq, seq, red, scale);
    kiln_fused_ce_params cp = loss_params(t, n, t->targets, red, scale);
    cp.dhidden = t->io.dxn;
    cp.dweight = head_grad(t);
    cp.row_stats_out = t->ce_stats;
    cp.no_wait = 1; /* pass 2 behind pass 1; the loss from the statistics below */
    cp.row_block = t->p.ce_row_block; /* or the row-block walk, in one pass */
    cp.row_logits_f32 = t->p.ce_logits_f32;
    kiln_fused_ce_result r, lr;
    const size_t stats_bytes = (size_t)3 * (size_t)n * sizeof(float);
    st = fused_ce_call(t, &cp, &r); /* a call that waited checked its loss: a non-finite one fails here */
    if (st != KILN_OK) goto unusable;
    if (r.scratch_bytes > t->ce_scratch) t->ce_scratch = r.scratch_bytes;
    if (r.loss_pending && (st = op->download_begin(t->be, t->ce_stats, stats_bytes)) != KILN_OK) goto unusable;
    st = run_layers(t, &t->g_bwd, &t->g_bwd_runs, backward_layers, n_seq, seq);
    if (st == KILN_OK) emb_grad(t, t->io.dx, t->ids_host, n);
    if (r.loss_pending) {
        kiln_status dst = op->download_end(t->be, t->ce_stats_host, st == KILN_OK ? stats_bytes : 0);
        if (st == KILN_OK) st = dst;
        if (st != KILN_OK) goto unusable;
        st = kiln_fused_ce_loss_from_stats(&cp, t->ce_stats_host, &lr); /* a non-finite loss fails here */
        if (st != KILN_OK) goto unusable;
        *loss = lr.loss;
    } else {
        if (st != KILN_OK) goto unusable;
        *loss = r.loss;
    }
    track_peak(t);
    st = backend_poll(t, call); /* the backward still runs: the next step is queued behind it */
    if (st == KILN_OK) return KILN_OK;
unusable:
    t->grads_unusable = 1;
    return kiln_error_prefix(st, "%s (the step's gradients are discarded: the next step must not accumulate)", call);
}

kiln_status kiln_train_custom_step(kiln_trainer *t, const char *call, const int32_t *ids, int n_seq, int seq,
                                   kiln_train_loss_fn fn, void *ctx, int accumulate, float *loss) {
    kiln_status st = check_batch(t, call, ids, n_seq, seq);
    if (st == KILN_OK && (!fn || !loss)) st = kiln_error(KILN_ERR_INVALID_ARG, "%s: NULL loss function or loss", call);
    /* ZeRO-3 ranks agree before the forward and after the loss (kiln_train_dp_idle_step's order) */
    st = step_agree(t, st, call, "before its forward");
    if (st == KILN_OK) {
        step_peak_reset(t);
        st = forward(t, ids, n_seq, seq);
        if (st == KILN_OK) st = begin_grads(t, accumulate);
        if (st != KILN_OK) st = kiln_error_prefix(st, "%s", call);
    }
    /* from here on a failure leaves the gradients partly updated: they are marked unusable */
    const int began = st == KILN_OK;
    if (began) {
        kiln_train_head h = {t->be, n_seq, seq, n_seq * seq, t->cfg.n_embd, t->cfg.n_vocab, ids, t->io.xn,
                             mat_view(t, t->lm_head), t->io.dxn, head_grad(t)};
        st = fn(ctx, &h, loss);
    }
    st = step_agree(t, st, call, "after its loss");
    if (!began) return st;
    if (st == KILN_OK) st = layers_backward(t, n_seq, seq);
    if (st == KILN_OK) st = backend_check(t, call);
    if (st == KILN_OK) {
        track_peak(t);
        return KILN_OK;
    }
    t->grads_unusable = 1;
    return kiln_error_prefix(st, "%s (the step's gradients are discarded: the next step must not accumulate)", call);
}

kiln_backend *kiln_trainer_backend(const kiln_trainer *t) { return t ? t->be : NULL; }

void kiln_trainer_limits(const kiln_trainer *t, int *max_seq, int *max_batch) {
    *max_seq = t->p.max_seq;
    *max_batch = t->p.max_batch;
}

int kiln_trainer_fast(const kiln_trainer *t) { return t->p.fast != 0; }

kiln_status kiln_train_step(kiln_trainer *t, const int32_t *ids, int n, float *loss) {
    KILN_TRY(check_ready(t, "kiln_train_step"));
    if (!ids || !loss) return kiln_error(KILN_ERR_INVALID_ARG, "kiln_train_step: ids and loss must be set");
    if (n < 2) return kiln_error(KILN_ERR_RANGE, "kiln_train_step: a sequence needs at least 2 tokens (got %d)", n);
    if (n > t->p.max_seq)
        return kiln_error(KILN_ERR_RANGE, "kiln_train_step: sequence of %d tokens exceeds max_seq %d", n, t->p.max_seq);
    int32_t *tg = t->positions; /* free during a loss step */
    for (int i = 0; i + 1 < n; i++) tg[i] = ids[i + 1];
    tg[n - 1] = -1;
    KILN_TRY(kiln_train_forward(t, ids, n, tg, KILN_LOSS_MEAN, 1.0f, loss));
    return kiln_train_backward(t, NULL, 0);
}

/* ---- gradients, optimizer ---------------------------------------------------------------- */

/* norms[i] = torch's f32 2-norm of parameter i's gradient (n_params floats), by the two
 * optimizers on the backend's AdamW ops (their per-tensor norms have the CPU's bits; on a
 * device, downloaded). The optimizers' calls take no pool: the backend runs them on its own
 * threads, and every one is elementwise or per tensor, so no bit depends on the thread count. */
static kiln_status param_norms(kiln_trainer *t, float *norms) {
    if (t->dp) return kiln_trainer_dp_norms(t, norms); /* the ranks' pieces: the same bits */
    float *part = kiln_malloc((size_t)t->n_params * sizeof(float));
    if (!part) return kiln_error(KILN_ERR_NOMEM, "trainer: out of memory");
    kiln_status st = kiln_adamw_grad_norm(t->opt_mat, NULL, part, NULL, NULL);
    for (int j = 0; st == KILN_OK && j < t->n_mat; j++) norms[t->mat_index[j]] = part[j];
    if (st == KILN_OK) st = kiln_adamw_grad_norm(t->opt_vec, NULL, part, NULL, NULL);
    for (int j = 0; st == KILN_OK && j < t->n_vec; j++) norms[t->vec_index[j]] = part[j];
    kiln_free(part);
    return st;
}

kiln_status kiln_train_grad_sq_norm(kiln_trainer *t, double *out) {
    KILN_TRY(check_ready(t, "kiln_train_grad_sq_norm"));
    if (!out) return kiln_error(KILN_ERR_INVALID_ARG, "kiln_train_grad_sq_norm: out is NULL");
    /* torch's order: per-tensor norms in named_parameters() order, then their norm */
    KILN_TRY(apply_grad_coef(t));
    float *norms = kiln_malloc((size_t)t->n_params * sizeof(float));
    if (!norms) return kiln_error(KILN_ERR_NOMEM, "trainer: out of memory");
    kiln_status st = param_norms(t, norms);
    if (st == KILN_OK) t->grads_finite = all_finite(norms, t->n_params);
    double sum = 0.0;
    for (int i = 0; st == KILN_OK && i < t->n_params; i++) sum += (double)norms[i] * (double)norms[i];
    kiln_free(norms);
    if (st != KILN_OK) return kiln_error_prefix(st, "kiln_train_grad_sq_norm");
    *out = sum;
    return KILN_OK;
}

/* The total gradient norm as torch's clip_grad_norm_ computes it: the norm of the stack of
 * per-tensor norms, over every parameter in order, of the logical gradients (a pending
 * coefficient applied first); it records whether every gradient is finite. */
static kiln_status grad_total_norm(kiln_trainer *t, const char *call, float *total) {
    KILN_TRY(apply_grad_coef(t));
    float *norms = kiln_malloc((size_t)t->n_params * sizeof(float));
    if (!norms) return kiln_error(KILN_ERR_NOMEM, "%s: out of memory", call);
    kiln_status st = param_norms(t, norms);
    if (st == KILN_OK) t->grads_finite = all_finite(norms, t->n_params);
    *total = st == KILN_OK ? kiln_grad_norm_torch(norms, t->n_params) : 0.0f;
    kiln_free(norms);
    return st == KILN_OK ? KILN_OK : kiln_error_prefix(st, "%s", call);
}

kiln_status kiln_train_clip_grads(kiln_trainer *t, double max_norm, float *total_norm, float *coef) {
    KILN_TRY(check_ready(t, "kiln_train_clip_grads"));
    if (t->grads_unusable)
        return kiln_error(KILN_ERR_STATE, "kiln_train_clip_grads: the gradients are unusable (a step_batch failed "
                                          "after its gradient work began, e.g. on a non-finite loss): run a step "
                                          "that does not accumulate first");
    if (!(max_norm > 0)) return kiln_error(KILN_ERR_INVALID_ARG, "kiln_train_clip_grads: max_norm must be > 0");
    float total;
    KILN_TRY(grad_total_norm(t, "kiln_train_clip_grads", &total));
    float cc = kiln_clip_coef(total, max_norm);
    /* A finite g times cc in [0, 1] stays finite, a non-finite one stays non-finite, so
     * grads_finite holds for the products too. The product is left to the optimizer's
     * read (grad_coef); a NaN cc (a non-finite gradient) is applied now. */
    if (cc >= 0.0f && cc <= 1.0f)
        t->grad_coef = cc;
    else
        KILN_TRY(scale_grads(t, cc));
    KILN_TRY(backend_check(t, "kiln_train_clip_grads"));
    if (total_norm) *total_norm = total;
    if (coef) *coef = cc;
    return KILN_OK;
}

kiln_status kiln_train_clip_coef(kiln_trainer *t, double max_norm, float *total_norm, float *coef) {
    KILN_TRY(check_ready(t, "kiln_train_clip_coef"));
    if (t->grads_unusable)
        return kiln_error(KILN_ERR_STATE, "kiln_train_clip_coef: the gradients are unusable (a step_batch failed "
                                          "after its gradient work began): run a step that does not accumulate first");
    if (!(max_norm > 0) || !isfinite(max_norm))
        return kiln_error(KILN_ERR_INVALID_ARG, "kiln_train_clip_coef: max_norm %g must be finite and > 0", max_norm);
    float total;
    KILN_TRY(grad_total_norm(t, "kiln_train_clip_coef", &total));
    KILN_TRY(backend_check(t, "kiln_train_clip_coef"));
    if (total_norm) *total_norm = total;
    if (coef) *coef = kiln_clip_coef(total, max_norm);
    return KILN_OK;
}

/* The two optimizers' halves of a per-parameter array (n_params, in parameter order). */
static kiln_status split_decay(const kiln_trainer *t, const double *wd, double **mat, double **vec) {
    *mat = kiln_malloc((size_t)(t->n_mat + t->n_vec) * sizeof(double));
    if (!*mat) return kiln_error(KILN_ERR_NOMEM, "trainer: out of memory");
    *vec = *mat + t->n_mat;
    for (int j = 0; j < t->n_mat; j++) (*mat)[j] = wd[t->mat_index[j]];
    for (int j = 0; j < t->n_vec; j++) (*vec)[j] = wd[t->vec_index[j]];
    return KILN_OK;
}

/* kiln_train_adamw_step, its errors naming call. */
static kiln_status adamw_step(kiln_trainer *t, const char *call, double lr, const double *weight_decay,
                              double grad_scale) {
    KILN_TRY(check_ready(t, call));
    if (t->grads_unusable)
        return kiln_error(KILN_ERR_STATE, "%s: refused, weights untouched: the gradients are unusable (a step_batch "
                                          "failed after its gradient work began, e.g. on a non-finite loss): run a "
                                          "step that does not accumulate first", call);
    if (!(lr >= 0) || !isfinite(lr)) return kiln_error(KILN_ERR_INVALID_ARG, "%s: lr %g must be finite and >= 0", call, lr);
    if (!(grad_scale >= 0) || !isfinite(grad_scale))
        return kiln_error(KILN_ERR_INVALID_ARG, "%s: grad_scale %g must be finite and >= 0", call, grad_scale);
    double *wd_mat = NULL, *wd_vec = NULL;
    if (weight_decay) { /* every check before anything changes */
        KILN_TRY(split_decay(t, weight_decay, &wd_mat, &wd_vec));
        kiln_status cst = kiln_adamw_check_decay(t->opt_mat, wd_mat);
        if (cst == KILN_OK) cst = kiln_adamw_check_decay(t->opt_vec, wd_vec);
        if (cst != KILN_OK) {
            kiln_free(wd_mat);
            return kiln_error_prefix(cst, "%s: refused, nothing changed", call);
        }
    }
    kiln_status st = KILN_OK;
    /* grad_scale as p.grad.mul_(grad_scale): one f32 product per gradient, after a pending
     * clip coefficient; within [0, 1] deferred to the optimizers' read (see grad_coef) */
    const float gs = (float)grad_scale;
    if (gs != 1.0f) {
        st = apply_grad_coef(t);
        if (st == KILN_OK && gs <= 1.0f) {
            t->grad_coef = gs;
        } else if (st == KILN_OK) {
            st = scale_grads(t, gs); /* may overflow: checked below */
            t->grads_finite = 0;
        }
    }
    kiln_pool *pool = NULL; /* the optimizers run on the backend's threads (param_norms) */
    if (st == KILN_OK && !t->grads_finite && t->dp) { /* the ranks must agree: the global norms */
        float total;
        st = grad_total_norm(t, call, &total);
        if (st == KILN_OK && !t->grads_finite)
            st = kiln_error(KILN_ERR_RANGE, "%s: a gradient is not finite (total norm %g): refused, weights untouched",
                            call, (double)total);
        if (st != KILN_OK) {
            kiln_free(wd_mat);
            return st;
        }
    }
    if (st == KILN_OK && !t->grads_finite) { /* else known from the last norm pass */
        st = kiln_adamw_grads_finite(t->opt_mat, pool);
        if (st == KILN_OK) st = kiln_adamw_grads_finite(t->opt_vec, pool);
        if (st != KILN_OK) {
            kiln_free(wd_mat);
            return kiln_error_prefix(st, "%s: refused, weights untouched", call);
        }
        t->grads_finite = 1;
    }
    if (st == KILN_OK) st = kiln_adamw_set_grad_scale(t->opt_mat, t->grad_coef);
    if (st == KILN_OK) st = kiln_adamw_set_grad_scale(t->opt_vec, t->grad_coef);
    if (st != KILN_OK) {
        kiln_free(wd_mat);
        return kiln_error_prefix(st, "%s", call);
    }
    kiln_adamw_set_lr(t->opt_mat, lr);
    kiln_adamw_set_lr(t->opt_vec, lr);
    t->shadow_stale = 1; t->mx_stale = 1;
    if (weight_decay) { /* both checked above */
        st = kiln_adamw_step_decay(t->opt_mat, pool, wd_mat);
        if (st == KILN_OK) st = kiln_adamw_step_decay(t->opt_vec, pool, wd_vec);
    } else {
        st = kiln_adamw_step_checked(t->opt_mat, pool);
        if (st == KILN_OK) st = kiln_adamw_step_checked(t->opt_vec, pool);
    }
    kiln_free(wd_mat);
    KILN_TRY(st);
    if (t->dp) KILN_TRY(kiln_trainer_dp_after_update(t)); /* ZeRO-2: ranges to every rank; 3: stale */
    KILN_TRY(backend_poll(t, call)); /* the next step queues behind it */
    /* the steps wrote the bf16 copy of every weight as they updated it (create_optimizers
     * gave them their w16): the bits to_bf16 would make, so no conversion pass */
    if (t->step_writes_shadow && kiln_train_dp_size(t) == 1) t->shadow_stale = 0;
    /* (with several ranks the gathered ranges of the others changed too: the copy is remade) */
    return KILN_OK;
}

kiln_status kiln_train_adamw_step(kiln_trainer *t, double lr, const double *weight_decay, double grad_scale) {
    return adamw_step(t, "kiln_train_adamw_step", lr, weight_decay, grad_scale);
}

kiln_status kiln_train_optimizer_step(kiln_trainer *t, double lr) {
    return adamw_step(t, "kiln_train_optimizer_step", lr, NULL, 1.0);
}

/* The optimizer holding parameter i and its slot there. */
static void opt_slot(const kiln_trainer *t, int i, kiln_adamw **o, int *slot) {
    for (int j = 0; j < t->n_mat; j++)
        if (t->mat_index[j] == i) {
            *o = t->opt_mat;
            *slot = j;
            return;
        }
    for (int j = 0; j < t->n_vec; j++)
        if (t->vec_index[j] == i) {
            *o = t->opt_vec;
            *slot = j;
            return;
        }
    *o = NULL;
    *slot = -1;
}

/* ---- parameters by name ------------------------------------------------------------------ */

int kiln_train_n_params(const kiln_trainer *t) {
    return kiln_handle_check(t, KILN_HANDLE_TRAINER, "kiln_train_n_params") == KILN_OK ? t->n_params : 0;
}

int kiln_train_n_model_params(const kiln_trainer *t) {
    return kiln_handle_check(t, KILN_HANDLE_TRAINER, "kiln_train_n_model_params") == KILN_OK ? t->n_model_params : 0;
}

kiln_status kiln_train_param_info(const kiln_trainer *t, int i, const char **name, int64_t *n_elements,
                                  int64_t shape[2]) {
    KILN_TRY(kiln_trainer_enter(t, "kiln_train_param_info"));
    if (i < 0 || i >= t->n_params)
        return kiln_error(KILN_ERR_RANGE, "kiln_train_param_info: index %d not in [0, %d)", i, t->n_params);
    if (name) *name = t->params[i].name;
    if (n_elements) *n_elements = t->params[i].n;
    if (shape) {
        shape[0] = t->params[i].shape[0];
        shape[1] = t->params[i].shape[1];
    }
    return KILN_OK;
}

kiln_status kiln_train_param_file_shape(const kiln_trainer *t, int i, int *n_dims, int64_t shape[3]) {
    KILN_TRY(kiln_trainer_enter(t, "kiln_train_param_file_shape"));
    if (i < 0 || i >= t->n_params)
        return kiln_error(KILN_ERR_RANGE, "kiln_train_param_file_shape: index %d not in [0, %d)", i, t->n_params);
    if (!n_dims || !shape) return kiln_error(KILN_ERR_INVALID_ARG, "kiln_train_param_file_shape: n_dims and shape must be set");
    *n_dims = t->params[i].file_dims;
    for (int k = 0; k < 3; k++) shape[k] = t->params[i].file_shape[k];
    return KILN_OK;
}

static const train_param *find_param(const kiln_trainer *t, const char *name, int64_t n, const char *call) {
    for (int i = 0; i < t->n_params; i++)
        if (!strcmp(t->params[i].name, name)) {
            if (t->params[i].n != n) {
                kiln_error(KILN_ERR_INVALID_ARG, "%s: parameter '%s' has %lld elements, not %lld", call, name,
                           (long long)t->params[i].n, (long long)n);
                return NULL;
            }
            return &t->params[i];
        }
    kiln_error(KILN_ERR_INVALID_ARG, "%s: no parameter named '%s'", call, name);
    return NULL;
}

kiln_status kiln_train_get_param(const kiln_trainer *t, const char *name, float *out, int64_t n) {
    KILN_TRY(kiln_trainer_enter(t, "kiln_train_get_param"));
    if (!name || !out) return kiln_error(KILN_ERR_INVALID_ARG, "kiln_train_get_param: NULL argument");
    const train_param *p = find_param(t, name, n, "kiln_train_get_param");
    if (!p) return KILN_ERR_INVALID_ARG;
    if (!kiln_trainer_dp_param_whole(t, (int)(p - t->params)))
        return kiln_error(KILN_ERR_STATE, "kiln_train_get_param: '%s' is sharded across the ranks (ZeRO-3): call "
                          "kiln_train_dp_gather_params first (every rank), or read a checkpoint", name);
    if (t->host) {
        kiln_dequantize(p->dtype, p->w, out, p->n);
        return KILN_OK;
    }
    if (p->dtype == KILN_DTYPE_F32) return kiln_backend_download(t->be, out, p->w, (size_t)n * sizeof(float));
    uint16_t *tmp = kiln_malloc((size_t)n * sizeof(uint16_t));
    if (!tmp) return kiln_error(KILN_ERR_NOMEM, "kiln_train_get_param: out of memory");
    kiln_status st = kiln_backend_download(t->be, tmp, p->w, (size_t)n * sizeof(uint16_t));
    if (st == KILN_OK) kiln_dequantize(p->dtype, tmp, out, p->n);
    kiln_free(tmp);
    return st;
}

/* Write f32 values into a parameter (already validated): bf16 storage rounds them (RNE). */
static kiln_status write_param(kiln_trainer *t, const train_param *p, const float *in) {
    size_t n = (size_t)p->n;
    t->shadow_stale = 1; t->mx_stale = 1;
    if (p->dtype == KILN_DTYPE_F32) return kiln_backend_upload(t->be, p->w, in, n * sizeof(float));
    if (t->host) {
        for (size_t i = 0; i < n; i++) ((uint16_t *)p->w)[i] = kiln_fp32_to_bf16(in[i]);
        return KILN_OK;
    }
    uint16_t *tmp = kiln_malloc(n * sizeof(uint16_t));
    if (!tmp) return kiln_error(KILN_ERR_NOMEM, "trainer: out of memory");
    for (size_t i = 0; i < n; i++) tmp[i] = kiln_fp32_to_bf16(in[i]);
    kiln_status st = kiln_backend_upload(t->be, p->w, tmp, n * sizeof(uint16_t));
    kiln_free(tmp);
    return st;
}

kiln_status kiln_train_get_grad(const kiln_trainer *t, const char *name, float *out, int64_t n) {
    KILN_TRY(kiln_trainer_enter(t, "kiln_train_get_grad"));
    if (!name || !out) return kiln_error(KILN_ERR_INVALID_ARG, "kiln_train_get_grad: NULL argument");
    const train_param *p = find_param(t, name, n, "kiln_train_get_grad");
    if (!p) return KILN_ERR_INVALID_ARG;
    KILN_TRY(kiln_backend_download(t->be, out, p->g, (size_t)n * sizeof(float)));
    if (t->grad_coef != 1.0f) /* the product the optimizer would read (see grad_coef) */
        for (int64_t i = 0; i < n; i++) out[i] = out[i] * t->grad_coef;
    return KILN_OK;
}

kiln_status kiln_train_get_moments(const kiln_trainer *t, const char *name, float *exp_avg, float *exp_avg_sq,
                                   int64_t n, int64_t *step) {
    if (!t || !name) return kiln_error(KILN_ERR_INVALID_ARG, "kiln_train_get_moments: NULL trainer or name");
    const train_param *p = find_param(t, name, n, "kiln_train_get_moments");
    if (!p) return KILN_ERR_INVALID_ARG;
    if (t->dp)
        return kiln_error(KILN_ERR_UNSUPPORTED, "kiln_train_get_moments: a data-parallel rank holds only its range of "
                                                "the moments: read them from a checkpoint (a set of shards loads "
                                                "whole into one process)");
    kiln_adamw *o;
    int slot;
    opt_slot(t, (int)(p - t->params), &o, &slot);
    if (!o) return kiln_error(KILN_ERR_INTERNAL, "kiln_train_get_moments: '%s' has no optimizer slot", name);
    KILN_TRY(kiln_adamw_get_moments(o, slot, exp_avg, exp_avg_sq));
    if (step) *step = kiln_adamw_get_step(o);
    return KILN_OK;
}

kiln_status kiln_train_set_moments(kiln_trainer *t, const char *name, const float *exp_avg, const float *exp_avg_sq,
                                   int64_t n) {
    KILN_TRY(check_ready(t, "kiln_train_set_moments"));
    if (!name || !exp_avg || !exp_avg_sq)
        return kiln_error(KILN_ERR_INVALID_ARG, "kiln_train_set_moments: name, exp_avg and exp_avg_sq must be set");
    const train_param *p = find_param(t, name, n, "kiln_train_set_moments");
    if (!p) return KILN_ERR_INVALID_ARG;
    if (t->dp)
        return kiln_error(KILN_ERR_UNSUPPORTED, "kiln_train_set_moments: a data-parallel rank holds only its range of "
                                                "the moments: load them from a checkpoint");
    kiln_adamw *o;
    int slot;
    opt_slot(t, (int)(p - t->params), &o, &slot);
    if (!o) return kiln_error(KILN_ERR_INTERNAL, "kiln_train_set_moments: '%s' has no optimizer slot", name);
    kiln_status st = kiln_adamw_set_moments(o, slot, exp_avg, exp_avg_sq);
    return st == KILN_OK ? KILN_OK : kiln_error_prefix(st, "kiln_train_set_moments");
}

kiln_status kiln_train_set_optimizer_step_count(kiln_trainer *t, int64_t step) {
    KILN_TRY(check_ready(t, "kiln_train_set_optimizer_step_count"));
    if (step < 0 || step > ((int64_t)1 << 24))
        return kiln_error(KILN_ERR_RANGE, "kiln_train_set_optimizer_step_count: step %lld not in [0, 2^24]",
                          (long long)step);
    KILN_TRY(kiln_adamw_set_step(t->opt_mat, step));
    return kiln_adamw_set_step(t->opt_vec, step);
}

kiln_status kiln_train_set_param(kiln_trainer *t, const char *name, const float *in, int64_t n) {
    KILN_TRY(check_ready(t, "kiln_train_set_param"));
    if (t->dp)
        return kiln_error(KILN_ERR_STATE, "kiln_train_set_param: a data-parallel rank's weights are set before "
                          "kiln_train_dp_attach (its optimizer holds a range of them)");
    if (!name || !in) return kiln_error(KILN_ERR_INVALID_ARG, "kiln_train_set_param: NULL argument");
    const train_param *p = find_param(t, name, n, "kiln_train_set_param");
    if (!p) return KILN_ERR_INVALID_ARG;
    if (p->dtype != KILN_DTYPE_F32 && kiln_adamw_get_step(t->opt_mat) > 0)
        return kiln_error(KILN_ERR_STATE, "kiln_train_set_param: bf16 storage: weights can only be set before the first step");
    for (int64_t i = 0; i < n; i++)
        if (!isfinite(in[i]))
            return kiln_error(KILN_ERR_INVALID_ARG, "kiln_train_set_param: '%s'[%lld] is not finite", name, (long long)i);
    KILN_TRY(write_param(t, p, in));
    /* a fresh optimizer (still at step 0) picks the new weights up as its master copy */
    if (p->dtype != KILN_DTYPE_F32) return create_optimizers(t);
    return KILN_OK;
}

kiln_status kiln_train_set_params(kiln_trainer *t, int count, const char *const *names, const float *const *data,
                                  const int64_t *n) {
    KILN_TRY(check_ready(t, "kiln_train_set_params"));
    if (t->dp)
        return kiln_error(KILN_ERR_STATE, "kiln_train_set_params: a data-parallel rank's weights are set before "
                          "kiln_train_dp_attach (its optimizer holds a range of them)");
    if (count < 0 || (count && (!names || !data || !n)))
        return kiln_error(KILN_ERR_INVALID_ARG, "kiln_train_set_params: NULL argument");
    int any_bf16 = 0;
    for (int i = 0; i < count; i++) { /* check everything first */
        if (!names[i] || !data[i]) return kiln_error(KILN_ERR_INVALID_ARG, "kiln_train_set_params: entry %d is NULL", i);
        const train_param *p = find_param(t, names[i], n[i], "kiln_train_set_params");
        if (!p) return KILN_ERR_INVALID_ARG;
        for (int j = 0; j < i; j++)
            if (!strcmp(names[j], names[i]))
                return kiln_error(KILN_ERR_INVALID_ARG, "kiln_train_set_params: '%s' given twice", names[i]);
        for (int64_t k = 0; k < n[i]; k++)
            if (!isfinite(data[i][k]))
                return kiln_error(KILN_ERR_INVALID_ARG, "kiln_train_set_params: '%s'[%lld] is not finite", names[i],
                                  (long long)k);
        any_bf16 |= p->dtype != KILN_DTYPE_F32;
    }
    if (any_bf16 && kiln_adamw_get_step(t->opt_mat) > 0)
        return kiln_error(KILN_ERR_STATE, "kiln_train_set_params: bf16 storage: weights can only be set before the first step");
    for (int i = 0; i < count; i++) {
        const train_param *p = find_param(t, names[i], n[i], "kiln_train_set_params");
        KILN_TRY(write_param(t, p, data[i]));
    }
    return any_bf16 ? create_optimizers(t) : KILN_OK;
}

kiln_status kiln_train_describe(const kiln_trainer *t, char *buf, size_t cap, kiln_train_memory *mem) {
    KILN_TRY(kiln_trainer_enter(t, "kiln_train_describe"));
    kiln_train_memory m;
    memset(&m, 0, sizeof m);
    for (int i = 0; i < t->n_params; i++) {
        m.params += (uint64_t)t->params[i].n * (t->params[i].dtype == KILN_DTYPE_F32 ? 4 : 2);
        m.grads += (uint64_t)t->params[i].n * 4;
    }
    if (t->shadow) m.params += t->param_bytes / 2; /* fast mode's bf16 copies of the weights */
    kiln_adamw_memory a, b;
    char da[256] = "", db[256] = "";
    kiln_adamw_describe(t->opt_mat, da, sizeof da, &a);
    kiln_adamw_describe(t->opt_vec, db, sizeof db, &b);
    m.optimizer = a.owned + b.owned;
    m.activations = t->io.bytes;
    const int64_t rows = (int64_t)t->p.max_seq * t->p.max_batch;
    uint64_t loss_scratch = kiln_fused_ce_scratch_bytes(
        rows, t->cfg.n_embd, t->cfg.n_vocab, t->p.ce_chunk ? t->p.ce_chunk : KILN_FUSED_CE_DEFAULT_CHUNK, 1, 1);
    if (!t->host && t->p.fast && t->p.ce_row_block > 0) { /* step_batch's row-block walk */
        const uint64_t rb = kiln_fused_ce_row_block_bytes(rows, t->cfg.n_embd, t->cfg.n_vocab, t->p.ce_row_block, 1, 1,
                                                          t->p.ce_logits_f32);
        if (rb > loss_scratch) loss_scratch = rb;
    }
    m.scratch = loss_scratch;
    if (t->ce_keep) m.scratch += (uint64_t)t->ce_keep_floats * sizeof(float); /* kept logits */
    if (t->emb_acc) m.scratch += (uint64_t)t->tok_embd->n * sizeof(float); /* an accumulating step's */
    m.peak_step = t->peak_step;
    char dp[320] = "";
    if (t->dp) {
        int64_t lo, hi, total, staging;
        kiln_trainer_dp_range(t, &lo, &hi, &total, &staging);
        m.scratch += (uint64_t)staging;
        char held[160] = "";
        if (kiln_trainer_dp_sharded(t)) {
            /* ZeRO-3: what the rank holds at its peak (its range, every vector, the units a step
             * gathers at once), of the whole */
            uint64_t w, g, pw, pg;
            kiln_trainer_dp_held(t, &w, &g, &pw, &pg);
            snprintf(held, sizeof held, "; ZeRO-3: weights held %.1f MiB (peak) of %.1f, gradients %.1f of %.1f",
                     pw / 1048576.0, m.params / 1048576.0, pg / 1048576.0, m.grads / 1048576.0);
            m.params = pw;
            m.grads = pg;
        }
        snprintf(dp, sizeof dp, "; data-parallel rank %d of %d: optimizer state for elements [%lld, %lld) of %lld, "
                 "staging %.1f MiB%s", kiln_train_dp_rank(t), kiln_train_dp_size(t), (long long)lo, (long long)hi,
                 (long long)total, staging / 1048576.0, held);
    }
    char dev[64] = "cpu", own[96] = "";
    if (!t->host) {
        snprintf(dev, sizeof dev, "%s:%d%s%s", t->be->i->name, t->p.device,
                 !t->p.fast ? "" : !t->graphs ? " (fast)" : " (fast, step graphs",
                 !t->graphs ? "" : t->g_fwd && t->g_bwd ? " recorded)" : ")");
        /* every trainer buffer is allocated at create except the fused loss's scratch; the
         * backend holds workspaces and scratch of its own (GEMM workspace and bf16 operand
         * copies, column-sum partials, staging) and makes short-lived stream-ordered copies
         * (the fast backward's operands, graph memory): the peak of a step is the sum of the
         * trainer's buffers, the largest loss scratch of the last step, what the backend
         * holds and the most its short-lived allocations have held at once */
        uint64_t held = 0, transient = 0;
        if (t->be->i->own_memory) t->be->i->own_memory(t->be, &held, &transient, false);
        m.scratch += held;
        m.peak_step = m.params + m.grads + m.optimizer + m.activations + t->ce_scratch + held + transient;
        snprintf(own, sizeof own, ", backend scratch %.1f MiB (short-lived peak %.1f MiB)", held / 1048576.0,
                 transient / 1048576.0);
    } else if (t->ce_keep) {
        snprintf(own, sizeof own, ", kept logits %.1f MiB", t->ce_keep_floats * 4 / 1048576.0);
    }
    m.device = t->host ? -1 : t->p.device;
    if (buf && cap)
        snprintf(buf, cap,
                 "params %.1f MiB, grads %.1f MiB, optimizer %.1f MiB, activations %.1f MiB (max_seq %d x max_batch %d), "
                 "loss scratch %.1f MiB%s; matrices: %s; vectors: %s; device: %s%s",
                 m.params / 1048576.0, m.grads / 1048576.0, m.optimizer / 1048576.0, m.activations / 1048576.0,
                 t->p.max_seq, t->p.max_batch, loss_scratch / 1048576.0, own, da, db, dev, dp);
    if (mem) *mem = m;
    return KILN_OK;
}

const kiln_model *kiln_trainer_model(const kiln_trainer *t) { return t ? t->model : NULL; }

kiln_status kiln_train_release_source(kiln_trainer *t) {
    KILN_TRY(kiln_trainer_enter(t, "kiln_train_release_source"));
    KILN_TRY(kiln_handle_sole_user(t->model, KILN_HANDLE_MODEL, "kiln_train_release_source"));
    kiln_model_release_weights(t->model);
    return KILN_OK;
}

/* ---- checkpoints ------------------------------------------------------------------------ */

/* The configuration a checkpoint must match to be restored: architecture and shapes, the
 * storage variants and the parameter list (names in order). */
char *kiln_trainer_config_json(const kiln_trainer *t) {
    const kiln_model_config *c = &t->cfg;
    size_t cap = 512 + (size_t)t->n_params * 128;
    char *s = kiln_malloc(cap);
    if (!s) return NULL;
    size_t n = (size_t)snprintf(s, cap,
                                "{\"format\":\"kiln-train\",\"version\":1,\"arch\":%d,\"n_layer\":%d,\"n_embd\":%d,"
                                "\"n_head\":%d,\"n_head_kv\":%d,\"head_dim\":%d,\"n_ff\":%d,\"n_vocab\":%d,"
                                "\"weight_storage\":%d,\"moment_storage\":%d,\"params\":[",
                                (int)c->arch, c->n_layer, c->n_embd, c->n_head, c->n_head_kv, c->head_dim, c->n_ff,
                                c->n_vocab, (int)t->p.weight_storage, (int)t->p.moment_storage);
    for (int i = 0; i < t->n_params && n < cap; i++)
        n += (size_t)snprintf(s + n, cap - n, "%s[\"%s\",%lld]", i ? "," : "", t->params[i].name,
                              (long long)t->params[i].n);
    /* the extras' shapes (kiln_train_params.extra), so that a reader of the checkpoint (kiln
     * export) can make a trainer that loads it; absent without extras */
    for (int i = t->n_model_params; i < t->n_params && n < cap; i++)
        n += (size_t)snprintf(s + n, cap - n, "%s[\"%s\",%lld,%lld]", i == t->n_model_params ? "],\"extras\":[" : ",",
                              t->params[i].name, (long long)t->params[i].shape[0], (long long)t->params[i].shape[1]);
    if (n < cap) n += (size_t)snprintf(s + n, cap - n, "]}");
    if (n >= cap) {
        kiln_free(s);
        return NULL;
    }
    return s;
}

typedef struct section_sink {
    kiln_ckpt_writer *w;
} section_sink;

static kiln_status sink_write(void *ctx, const void *data, size_t n) {
    return kiln_ckpt_section_write(((section_sink *)ctx)->w, data, n);
}

typedef struct mem_sink {
    uint8_t *p;
    size_t n, cap;
} mem_sink;

static kiln_status mem_write(void *ctx, const void *data, size_t n) {
    mem_sink *m = ctx;
    if (n > m->cap - m->n) return kiln_error(KILN_ERR_INTERNAL, "optimizer state larger than its reported size");
    memcpy(m->p + m->n, data, n);
    m->n += n;
    return KILN_OK;
}

void kiln_string_free(char *s) { kiln_free(s); }

kiln_status kiln_train_save(kiln_trainer *t, const char *dir, uint64_t step, const char *run_json, int keep_last) {
    KILN_TRY(check_ready(t, "kiln_train_save"));
    if (!dir) return kiln_error(KILN_ERR_INVALID_ARG, "kiln_train_save: dir is NULL");
    if (t->dp) return kiln_trainer_dp_save(t, dir, step, run_json, keep_last);
    return kiln_trainer_save_local(t, dir, step, run_json, keep_last);
}

kiln_status kiln_trainer_save_local(kiln_trainer *t, const char *dir, uint64_t step, const char *run_json,
                                    int keep_last) {
    char *cfg = kiln_trainer_config_json(t);
    if (!cfg) return kiln_error(KILN_ERR_NOMEM, "kiln_train_save: out of memory");
    kiln_ckpt_save_params sp = {0};
    sp.keep_last = keep_last;
    kiln_ckpt_writer *w = NULL;
    kiln_status st = kiln_ckpt_begin(dir, step, &sp, &w);
    if (st == KILN_OK) st = kiln_ckpt_add_json(w, "config", cfg);
    if (st == KILN_OK && run_json) st = kiln_ckpt_add_json(w, "run", run_json);
    if (st == KILN_OK) st = kiln_ckpt_add_u64(w, "step", step);
    if (st == KILN_OK) st = kiln_ckpt_add_u64(w, "seed", t->p.seed);
    /* the file holds host bytes whatever the device: a device's weights are downloaded */
    void *stage = NULL;
    if (st == KILN_OK && !t->host) {
        int64_t max_n = 0;
        for (int i = 0; i < t->n_params; i++)
            if (t->params[i].n > max_n) max_n = t->params[i].n;
        stage = kiln_malloc((size_t)max_n * sizeof(float));
        if (!stage) st = kiln_error(KILN_ERR_NOMEM, "out of memory");
    }
    for (int i = 0; st == KILN_OK && i < t->n_params; i++) {
        const train_param *p = &t->params[i];
        char name[128];
        snprintf(name, sizeof name, "param/%s", p->name);
        const void *data = p->w;
        if (!t->host) {
            st = kiln_backend_download(t->be, stage, p->w, (size_t)p->n * (p->dtype == KILN_DTYPE_F32 ? 4 : 2));
            data = stage;
        }
        if (st == KILN_OK) st = kiln_ckpt_add_tensor(w, name, p->dtype, p->n_dims, p->shape, data);
    }
    kiln_free(stage);
    section_sink sink = {w};
    if (st == KILN_OK) st = kiln_ckpt_section_begin(w, "optimizer/matrices", KILN_CKPT_RAW);
    if (st == KILN_OK) st = kiln_adamw_save(t->opt_mat, sink_write, &sink);
    if (st == KILN_OK) st = kiln_ckpt_section_end(w);
    if (st == KILN_OK) st = kiln_ckpt_section_begin(w, "optimizer/vectors", KILN_CKPT_RAW);
    if (st == KILN_OK) st = kiln_adamw_save(t->opt_vec, sink_write, &sink);
    if (st == KILN_OK) st = kiln_ckpt_section_end(w);
    kiln_free(cfg);
    if (st != KILN_OK) {
        kiln_ckpt_abort(w);
        return kiln_error_prefix(st, "kiln_train_save: %s", dir);
    }
    char *warning = NULL;
    st = kiln_ckpt_commit(w, &warning);
    kiln_free(warning);
    return st;
}

/* "(a, b)" of a shape, for messages. */
static void shape_text(char *buf, size_t cap, int n_dims, const int64_t *shape) {
    size_t n = (size_t)snprintf(buf, cap, "(");
    for (int i = 0; i < n_dims && n < cap; i++)
        n += (size_t)snprintf(buf + n, cap - n, "%s%lld", i ? ", " : "", (long long)shape[i]);
    if (n < cap) snprintf(buf + n, cap - n, ")");
}

/* A checkpoint's parameter section against the trainer's parameter: dtype, shape, size. */
static kiln_status check_param_section(const char *name, const kiln_ckpt_section *s,
                                       const train_param *p) {
    uint64_t want = (uint64_t)p->n * (p->dtype == KILN_DTYPE_F32 ? 4 : 2);
    if (s->dtype != p->dtype || s->size != want)
        return kiln_error(KILN_ERR_FORMAT, "section '%s' is %s, %llu bytes; the model's is %s, %llu bytes", name, kiln_dtype_name(s->dtype), (unsigned long long)s->size,
                          kiln_dtype_name(p->dtype), (unsigned long long)want);
    int same = s->n_dims == p->n_dims;
    for (int k = 0; same && k < p->n_dims; k++) same = s->shape[k] == p->shape[k];
    if (!same) {
        char got[128], exp[128];
        shape_text(got, sizeof got, s->n_dims, s->shape);
        shape_text(exp, sizeof exp, p->n_dims, p->shape);
        return kiln_error(KILN_ERR_FORMAT, "section '%s' has shape %s; the model's is %s", name, got, exp);
    }
    return KILN_OK;
}

kiln_status kiln_train_load(kiln_trainer *t, const char *dir, uint64_t *step, char **run_json) {
    return kiln_train_load_ex(t, dir, step, run_json, NULL);
}


kiln_status kiln_train_load_ex(kiln_trainer *t, const char *dir, uint64_t *step, char **run_json, char **notes) {
    if (notes) *notes = NULL;
    if (run_json) *run_json = NULL;
    KILN_TRY(check_ready(t, "kiln_train_load"));
    if (!dir || !step) return kiln_error(KILN_ERR_INVALID_ARG, "kiln_train_load: dir and step must be set");
    if (t->dp) return kiln_trainer_dp_load(t, dir, -1, step, run_json, notes);
    return kiln_trainer_load_local(t, dir, -1, step, run_json, notes);
}

kiln_status kiln_train_load_step(kiln_trainer *t, const char *dir, uint64_t at, char **run_json) {
    KILN_TRY(check_ready(t, "kiln_train_load"));
    if (!dir) return kiln_error(KILN_ERR_INVALID_ARG, "kiln_train_load: dir must be set");
    if (run_json) *run_json = NULL;
    uint64_t step;
    if (at > (uint64_t)INT64_MAX) return kiln_error(KILN_ERR_RANGE, "kiln_train_load: step %llu out of range", (unsigned long long)at);
    if (t->dp) return kiln_trainer_dp_load(t, dir, (int64_t)at, &step, run_json, NULL);
    return kiln_trainer_load_local(t, dir, (int64_t)at, &step, run_json, NULL);
}

kiln_status kiln_trainer_load_local(kiln_trainer *t, const char *dir, int64_t at, uint64_t *step, char **run_json,
                                    char **notes) {
    kiln_ckpt *c = NULL;
    /* a resume: a damaged newer checkpoint is set aside, else saving its step would fail */
    if (at < 0)
        KILN_TRY(kiln_ckpt_open_for_resume(dir, &c));
    else
        KILN_TRY(kiln_ckpt_open_step(dir, (uint64_t)at, &c));
    return kiln_trainer_load_opened(t, c, step, run_json, notes);
}

/* The state of the opened checkpoint c into t (every check before anything changes); closes c. */
kiln_status kiln_trainer_load_opened(kiln_trainer *t, kiln_ckpt *c, uint64_t *step, char **run_json, char **notes) {
    if (kiln_ckpt_shard_count(c) > 0) return kiln_trainer_load_set(t, c, step, run_json, notes);
    const kiln_ckpt_section *sec = NULL;
    char *cfg = kiln_trainer_config_json(t);
    kiln_status st = cfg ? KILN_OK : kiln_error(KILN_ERR_NOMEM, "kiln_train_load: out of memory");
    if (st == KILN_OK) st = kiln_ckpt_find(c, "config", KILN_CKPT_JSON, &sec);
    if (st == KILN_OK && (sec->size != strlen(cfg) || memcmp(sec->data, cfg, sec->size) != 0))
        st = kiln_error(KILN_ERR_STATE,
                        "kiln_train_load: %s was saved under another configuration (architecture, shapes, "
                        "parameters or storage variant differ): refused",
                        kiln_ckpt_path(c));
    /* check everything before writing anything */
    const kiln_ckpt_section **ps = NULL;
    if (st == KILN_OK) {
        ps = kiln_calloc((size_t)t->n_params, sizeof *ps);
        if (!ps) st = kiln_error(KILN_ERR_NOMEM, "kiln_train_load: out of memory");
    }
    for (int i = 0; st == KILN_OK && i < t->n_params; i++) {
        char name[128];
        snprintf(name, sizeof name, "param/%s", t->params[i].name);
        st = kiln_ckpt_find(c, name, KILN_CKPT_TENSOR, &ps[i]);
        if (st == KILN_OK) st = check_param_section(name, ps[i], &t->params[i]);
    }
    const kiln_ckpt_section *om = NULL, *ov = NULL;
    uint64_t k = 0;
    if (st == KILN_OK) st = kiln_ckpt_find(c, "optimizer/matrices", KILN_CKPT_RAW, &om);
    if (st == KILN_OK) st = kiln_ckpt_find(c, "optimizer/vectors", KILN_CKPT_RAW, &ov);
    if (st == KILN_OK) st = kiln_ckpt_get_u64(c, "step", &k);
    /* the container checks the header's step; the section must say the same */
    if (st == KILN_OK && k > KILN_CKPT_MAX_STEP)
        st = kiln_error(KILN_ERR_FORMAT, "section 'step' holds %llu, out of range (largest %lld)",
                        (unsigned long long)k, (long long)KILN_CKPT_MAX_STEP);
    if (st == KILN_OK && k != kiln_ckpt_step(c))
        st = kiln_error(KILN_ERR_FORMAT, "section 'step' holds %llu but the header's step is %llu",
                        (unsigned long long)k, (unsigned long long)kiln_ckpt_step(c));
    char *run = NULL;
    if (st == KILN_OK && run_json && kiln_ckpt_find(c, "run", KILN_CKPT_JSON, &sec) == KILN_OK) {
        run = kiln_strndup(sec->data, (size_t)sec->size);
        if (!run) st = kiln_error(KILN_ERR_NOMEM, "kiln_train_load: out of memory");
    }
    /* The optimizer loads validate their blobs fully before changing state; the first one's
     * current state is kept so that a failure of the second can be rolled back. */
    mem_sink backup = {0};
    if (st == KILN_OK) {
        backup.cap = kiln_adamw_state_size(t->opt_mat);
        backup.p = kiln_malloc(backup.cap ? backup.cap : 1);
        st = backup.p ? kiln_adamw_save(t->opt_mat, mem_write, &backup)
                      : kiln_error(KILN_ERR_NOMEM, "kiln_train_load: out of memory");
    }
    if (st == KILN_OK) st = kiln_adamw_load(t->opt_mat, om->data, (size_t)om->size);
    if (st == KILN_OK) {
        st = kiln_adamw_load(t->opt_vec, ov->data, (size_t)ov->size);
        if (st != KILN_OK) {
            kiln_status keep = st;
            kiln_adamw_load(t->opt_mat, backup.p, backup.n); /* roll back */
            st = keep;
        }
    }
    if (st == KILN_OK) {
        t->shadow_stale = 1; t->mx_stale = 1;
        for (int i = 0; st == KILN_OK && i < t->n_params; i++)
            st = kiln_backend_upload(t->be, t->params[i].w, ps[i]->data, (size_t)ps[i]->size);
    }
    if (st == KILN_OK) {
        *step = k;
        if (run_json) {
            *run_json = run;
            run = NULL;
        }
        if (notes && kiln_ckpt_rejected(c)[0]) *notes = kiln_strdup(kiln_ckpt_rejected(c));
    } else {
        kiln_error_prefix(st, "kiln_train_load: %s", kiln_ckpt_path(c));
    }
    kiln_free(backup.p);
    kiln_free(cfg);
    kiln_free(ps);
    kiln_free(run);
    kiln_ckpt_close(c);
    return st;
}
