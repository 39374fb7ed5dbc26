/*
 * adamw.c -- torch.optim.AdamW (single-tensor path) in float32 operation order, with bf16
 * weight storage variants and 8-bit block moments; torch's clip_grad_norm_ arithmetic.
 * The definitions are in docs/ARITHMETIC.md, "AdamW and clipping".
 *
 * The optimizer owns what is about parameters: their names and decay flags, the layout of the
 * state (one allocation: moments, master copy or compensation), its save and load, the
 * per-step scalars. The arithmetic on the arrays is the backend's, through AdamW's ops
 * (src/ops/adamw_op.h): an optimizer made by kiln_adamw_create runs the CPU reference on the
 * pool each call is given; one made by kiln_adamw_create_on runs the backend's ops, and when
 * the backend's memory is not host memory (a "device optimizer") weights, grads and every
 * state array are device memory, which the read-back and save / load move with the backend's
 * download and upload.
 */
#include "adamw.h"

#include "../base/kmath.h"
#include "../base/tensor.h"
#include "../ops/adamw_math.h"
#include "../ops/adamw_op.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define ADAMW_MAGIC "KILNADMW"
#define ADAMW_END "ADMWEND"  /* 8 bytes with its NUL */
#define ADAMW_VERSION 1u

typedef struct adamw_slot {
    char *name;
    int64_t n;
    void *weights;   /* (n) f32 or bf16: the caller's */
    float *grad;     /* (n) the caller's */
    uint16_t *w16;   /* (n) the caller's bf16 copy the device step writes, or NULL */
    int decay;       /* weight decay applies (before the weight_decay != 0 test) */
    float *m, *v;    /* (n) f32 moments, or NULL */
    int8_t *mq;      /* (n) 8-bit first moment: sign * code, code in [0, 127] */
    uint8_t *vq;     /* (n) 8-bit second moment: code in [0, 255] */
    float *ms, *vs;  /* (n_blocks) absmax of each block of 256 */
    float *master;   /* (n) BF16_MASTER only */
    uint16_t *comp;  /* (n) BF16_KAHAN only: bf16 compensation */
    void *mirror;    /* device optimizer: host copy of master or comp for the getters */
} adamw_slot;

struct kiln_adamw {
    kiln_adamw_config cfg; /* decay_map cleared: flags live in the slots */
    int n_params;
    adamw_slot *p;         /* (n_params) */
    kiln_adamw_tensor *t;  /* (n_params) the slots as the ops take them (sync_table) */
    int64_t *bad;          /* (n_params) scratch of grads_finite */
    int64_t step;
    float grad_scale;      /* kiln_adamw_set_grad_scale's coefficient; 1: none */
    void *state;           /* one allocation holding every state array (the backend's memory
                            * for a device optimizer) */
    void *ws;              /* the ops' workspace (adamw_op.h), in the same memory */
    kiln_adamw_memory mem;
    kiln_backend *be;      /* whose ops run the arithmetic; NULL: the CPU reference on the
                            * pool of each call */
    int host;              /* the arrays are host memory (no backend, or a backend whose memory
                            * is host memory: the CPU's) */
};

/* ---- names and configuration ------------------------------------------------------------- */

static const char *weights_name(kiln_adamw_weights w) {
    switch (w) {
    case KILN_ADAMW_F32: return "f32 weights";
    case KILN_ADAMW_BF16_MASTER: return "bf16 weights + f32 master";
    case KILN_ADAMW_BF16_KAHAN: return "bf16 weights + bf16 Kahan compensation";
    case KILN_ADAMW_BF16_SR: return "bf16 weights, stochastic rounding";
    }
    return "?";
}

static const char *moments_name(kiln_adamw_moments m) {
    return m == KILN_ADAMW_MOMENTS_Q8 ? "8-bit moments (blocks of 256, log codes)"
                                      : "f32 moments";
}

kiln_adamw_config kiln_adamw_default_config(void) {
    kiln_adamw_config c;
    memset(&c, 0, sizeof c);
    c.lr = 1e-3;
    c.beta1 = 0.9;
    c.beta2 = 0.999;
    c.eps = 1e-8;
    c.weight_decay = 0.01;
    c.weights = KILN_ADAMW_F32;
    c.moments = KILN_ADAMW_MOMENTS_F32;
    return c;
}

/* Does s (lowercased on the fly) contain pat? */
static int contains_lower(const char *s, const char *pat) {
    size_t lp = strlen(pat);
    for (const char *q = s; *q; q++) {
        size_t k = 0;
        while (k < lp && q[k]) {
            char c = q[k];
            if (c >= 'A' && c <= 'Z') c = (char)(c - 'A' + 'a');
            if (c != pat[k]) break;
            k++;
        }
        if (k == lp) return 1;
    }
    return 0;
}

int kiln_adamw_default_decay(const char *name) {
    if (contains_lower(name, "bias") || contains_lower(name, "layernorm") ||
        contains_lower(name, "rmsnorm"))
        return 0;
    /* "(^|\.)norm($|\.)" and "_norm($|\.)" on the lowercased name */
    size_t len = strlen(name);
    for (size_t i = 0; i + 4 <= len; i++) {
        int is_norm = 1;
        for (int k = 0; k < 4 && is_norm; k++) {
            char c = name[i + (size_t)k];
            if (c >= 'A' && c <= 'Z') c = (char)(c - 'A' + 'a');
            is_norm = c == "norm"[k];
        }
        if (!is_norm) continue;
        int end_ok = (i + 4 == len) || name[i + 4] == '.';
        int start_ok = (i == 0) || name[i - 1] == '.' || name[i - 1] == '_';
        if (end_ok && start_ok) return 0;
    }
    return 1;
}

/* ---- create / free ----------------------------------------------------------------------- */

void kiln_adamw_free(kiln_adamw *o) {
    if (!o) return;
    if (o->p)
        for (int i = 0; i < o->n_params; i++) {
            kiln_free(o->p[i].name);
            kiln_free(o->p[i].mirror);
        }
    kiln_free(o->p);
    kiln_free(o->t);
    kiln_free(o->bad);
    if (o->host) {
        kiln_free(o->state);
        kiln_free(o->ws);
    } else {
        kiln_backend_free_buf(o->be, o->state);
        kiln_backend_free_buf(o->be, o->ws);
    }
    kiln_free(o);
}

static int64_t n_blocks_of(int64_t n) { return (n + KILN_ADAMW_Q8_BLOCK - 1) / KILN_ADAMW_Q8_BLOCK; }

/* Bytes of one state array, 64-aligned inside the one allocation. */
static bool add_array(size_t *off, uint64_t bytes) {
    size_t a;
    if (bytes > SIZE_MAX || kiln_add_overflow(*off, (size_t)bytes, &a) ||
        kiln_add_overflow(a, 63, &a))
        return false;
    *off = a & ~(size_t)63;
    return true;
}

static kiln_status check_config(const kiln_adamw_config *c) {
    if (!(c->lr >= 0.0 && isfinite(c->lr)))
        return kiln_error(KILN_ERR_INVALID_ARG, "adamw: lr %g must be finite and >= 0", c->lr);
    if (!(c->beta1 >= 0.0 && c->beta1 < 1.0) || !(c->beta2 >= 0.0 && c->beta2 < 1.0))
        return kiln_error(KILN_ERR_INVALID_ARG, "adamw: betas (%g, %g) must be in [0, 1)",
                          c->beta1, c->beta2);
    if (!(c->eps >= 0.0 && isfinite(c->eps)))
        return kiln_error(KILN_ERR_INVALID_ARG, "adamw: eps %g must be finite and >= 0", c->eps);
    if (!(c->weight_decay >= 0.0 && isfinite(c->weight_decay)))
        return kiln_error(KILN_ERR_INVALID_ARG, "adamw: weight_decay %g must be finite and >= 0",
                          c->weight_decay);
    if ((unsigned)c->weights > KILN_ADAMW_BF16_SR)
        return kiln_error(KILN_ERR_INVALID_ARG, "adamw: unknown weight storage %d", (int)c->weights);
    if ((unsigned)c->moments > KILN_ADAMW_MOMENTS_Q8)
        return kiln_error(KILN_ERR_INVALID_ARG, "adamw: unknown moment storage %d", (int)c->moments);
    return KILN_OK;
}

/* o->t[i] = slot i's arrays and decay flag (at create, and at load: restored flags). */
static void sync_table(kiln_adamw *o) {
    for (int i = 0; i < o->n_params; i++) {
        const adamw_slot *s = &o->p[i];
        kiln_adamw_tensor *t = &o->t[i];
        memset(t, 0, sizeof *t);
        t->n = s->n;
        t->weights = s->weights;
        t->grad = s->grad;
        t->w16 = s->w16;
        t->decay = s->decay;
        t->m = s->m;
        t->v = s->v;
        t->mq = s->mq;
        t->vq = s->vq;
        t->ms = s->ms;
        t->vs = s->vs;
        t->master = s->master;
        t->comp = s->comp;
    }
}

/* The ops' view of the optimizer's tensors. */
static kiln_adamw_table table_of(const kiln_adamw *o) {
    kiln_adamw_table tab = {o->t, o->n_params, o->cfg.weights, o->cfg.moments};
    return tab;
}

/* An optimizer with no parameters yet: its backend and configuration, no gradient scale. */
static kiln_adamw *adamw_new(kiln_backend *be, int dev, const kiln_adamw_config *cfg) {
    kiln_adamw *o = kiln_calloc(1, sizeof *o);
    if (!o) return NULL;
    o->be = be;
    o->host = !dev;
    o->cfg = *cfg;
    o->grad_scale = 1.0f;
    return o;
}

/* kiln_adamw_create (be NULL), or an optimizer on be's ops (adamw_op.h): a device optimizer
 * when be's memory is not host memory. */
static kiln_status create_impl(kiln_backend *be, const kiln_adamw_param *params, int n_params,
                               const kiln_adamw_config *cfg, int allow_empty, kiln_adamw **out) {
    const int dev = be && !be->i->host_memory;
    if (!out) return kiln_error(KILN_ERR_INVALID_ARG, "adamw: out is NULL");
    *out = NULL;
    if (allow_empty && n_params == 0 && cfg) { /* kiln_adamw_create_empty: no state, no ops */
        KILN_TRY(check_config(cfg));
        if (cfg->n_decay_map)
            return kiln_error(KILN_ERR_INVALID_ARG, "adamw: a decay map names parameters an empty optimizer lacks");
        kiln_adamw *o = adamw_new(be, dev, cfg);
        if (!o) return kiln_error(KILN_ERR_NOMEM, "adamw: out of memory");
        *out = o;
        return KILN_OK;
    }
    if (!params || n_params <= 0 || !cfg)
        return kiln_error(KILN_ERR_INVALID_ARG, "adamw: need at least one parameter and a config");
    KILN_TRY(check_config(cfg));
    for (int i = 0; i < n_params; i++) {
        const kiln_adamw_param *q = &params[i];
        if (!q->name || !q->weights || !q->grad || q->n <= 0)
            return kiln_error(KILN_ERR_INVALID_ARG,
                              "adamw: parameter %d ('%s'): needs a name, n >= 1, weights and grad",
                              i, q->name ? q->name : "(null)");
        if (dev && (!kiln_backend_holds(be, q->weights) || !kiln_backend_holds(be, q->grad) ||
                    (q->w16 && !kiln_backend_holds(be, q->w16))))
            return kiln_error(KILN_ERR_INVALID_ARG,
                              "adamw: parameter %d ('%s'): weights, grad and w16 must be device "
                              "memory of the %s backend", i, q->name, be->i->name);
        if (q->w16 && (!dev || cfg->weights != KILN_ADAMW_F32))
            return kiln_error(KILN_ERR_UNSUPPORTED,
                              "adamw: parameter %d ('%s'): w16 (a bf16 copy written by the step) "
                              "needs a device optimizer with f32 weights", i, q->name);
        for (int j = 0; j < i; j++)
            if (strcmp(params[j].name, q->name) == 0)
                return kiln_error(KILN_ERR_INVALID_ARG, "adamw: parameter '%s' listed twice",
                                  q->name);
    }
    for (int k = 0; k < cfg->n_decay_map; k++) {
        const char *nm = cfg->decay_map[k].name;
        int found = 0;
        for (int i = 0; nm && i < n_params && !found; i++) found = strcmp(params[i].name, nm) == 0;
        if (!found)
            return kiln_error(KILN_ERR_INVALID_ARG,
                              "adamw: decay map entry %d names '%s', which is not a parameter", k,
                              nm ? nm : "(null)");
    }

    kiln_adamw *o = adamw_new(be, dev, cfg);
    if (!o) return kiln_error(KILN_ERR_NOMEM, "adamw: out of memory");
    o->cfg.decay_map = NULL;
    o->cfg.n_decay_map = 0;
    o->n_params = n_params;
    o->p = kiln_calloc((size_t)n_params, sizeof *o->p);
    o->t = kiln_calloc((size_t)n_params, sizeof *o->t);
    o->bad = kiln_calloc((size_t)n_params, sizeof *o->bad);
    if (!o->p || !o->t || !o->bad) goto nomem;

    /* layout of the state allocation */
    size_t off = 0;
    const int bf16 = cfg->weights != KILN_ADAMW_F32;
    const int q8 = cfg->moments == KILN_ADAMW_MOMENTS_Q8;
    kiln_adamw_memory mem = {0};
    for (int i = 0; i < n_params; i++) {
        uint64_t n = (uint64_t)params[i].n, nb = (uint64_t)n_blocks_of(params[i].n);
        mem.params += n * (bf16 ? 2u : 4u);
        if (q8) {
            mem.moments += 2 * n + 8 * nb;
            if (!add_array(&off, n) || !add_array(&off, n) || !add_array(&off, 4 * nb) ||
                !add_array(&off, 4 * nb))
                goto toobig;
        } else {
            mem.moments += 8 * n;
            if (!add_array(&off, 4 * n) || !add_array(&off, 4 * n)) goto toobig;
        }
        if (cfg->weights == KILN_ADAMW_BF16_MASTER) {
            mem.master += 4 * n;
            if (!add_array(&off, 4 * n)) goto toobig;
        } else if (cfg->weights == KILN_ADAMW_BF16_KAHAN) {
            mem.compensation += 2 * n;
            if (!add_array(&off, 2 * n)) goto toobig;
        }
    }
    mem.owned = mem.master + mem.moments + mem.compensation;
    o->mem = mem;
    if (dev) {
        o->state = kiln_backend_alloc(be, off ? off : 1);
        if (!o->state) {
            kiln_adamw_free(o);
            return kiln_error_prefix(KILN_ERR_NOMEM, "adamw: device state");
        }
    } else {
        o->state = kiln_calloc(1, off ? off : 1);
    }
    if (!o->state) goto nomem;

    off = 0;
    uint8_t *base = o->state;
#define TAKE(ptr, type, bytes)                                                                 \
    do {                                                                                       \
        (ptr) = (type *)(void *)(base + off);                                                  \
        add_array(&off, (bytes));                                                              \
    } while (0)
    for (int i = 0; i < n_params; i++) {
        adamw_slot *s = &o->p[i];
        const kiln_adamw_param *q = &params[i];
        uint64_t n = (uint64_t)q->n, nb = (uint64_t)n_blocks_of(q->n);
        s->name = kiln_strdup(q->name);
        if (!s->name) goto nomem;
        s->n = q->n;
        s->weights = q->weights;
        s->grad = q->grad;
        s->w16 = q->w16;
        s->decay = kiln_adamw_default_decay(q->name);
        for (int k = 0; k < cfg->n_decay_map; k++)
            if (strcmp(cfg->decay_map[k].name, q->name) == 0) s->decay = cfg->decay_map[k].decay != 0;
        if (q8) {
            TAKE(s->mq, int8_t, n);
            TAKE(s->vq, uint8_t, n);
            TAKE(s->ms, float, 4 * nb);
            TAKE(s->vs, float, 4 * nb);
        } else {
            TAKE(s->m, float, 4 * n);
            TAKE(s->v, float, 4 * n);
        }
        if (cfg->weights == KILN_ADAMW_BF16_MASTER) {
            TAKE(s->master, float, 4 * n);
        } else if (cfg->weights == KILN_ADAMW_BF16_KAHAN) {
            TAKE(s->comp, uint16_t, 2 * n);
        }
    }
#undef TAKE
    /* the ops' workspace, then the new state (zero moments and compensation, the master copy
     * widened from the bf16 weights) */
    sync_table(o);
    const kiln_adamw_table tab = table_of(o);
    const size_t ws_bytes = kiln_adamw_op_workspace(be, &tab);
    if (ws_bytes == 0) goto toobig;
    if (dev) {
        o->ws = kiln_backend_alloc(be, ws_bytes);
        if (!o->ws) {
            kiln_adamw_free(o);
            return kiln_error_prefix(KILN_ERR_NOMEM, "adamw: device scratch");
        }
    } else {
        o->ws = kiln_malloc(ws_bytes);
        if (!o->ws) goto nomem;
    }
    kiln_status st = kiln_adamw_op_prepare(be, NULL, &tab, o->ws, 1);
    if (st != KILN_OK) {
        kiln_adamw_free(o);
        return st;
    }
    *out = o;
    return KILN_OK;
toobig:
    kiln_adamw_free(o);
    return kiln_error(KILN_ERR_INVALID_ARG, "adamw: optimizer state size overflows");
nomem:
    kiln_adamw_free(o);
    return kiln_error(KILN_ERR_NOMEM, "adamw: out of memory for the optimizer state");
}

kiln_status kiln_adamw_create(const kiln_adamw_param *params, int n_params,
                              const kiln_adamw_config *cfg, kiln_adamw **out) {
    return create_impl(NULL, params, n_params, cfg, 0, out);
}

kiln_status kiln_adamw_create_empty(kiln_backend *be, const kiln_adamw_config *cfg, kiln_adamw **out) {
    if (be && !kiln_adamw_op_supported(be)) {
        if (out) *out = NULL;
        return kiln_error(KILN_ERR_UNSUPPORTED, "adamw: backend '%s' has no AdamW ops",
                          be->i->name ? be->i->name : "?");
    }
    return create_impl(be, NULL, 0, cfg, 1, out);
}

kiln_status kiln_adamw_create_on(kiln_backend *be, const kiln_adamw_param *params,
                                 int n_params, const kiln_adamw_config *cfg, kiln_adamw **out) {
    if (!be) return create_impl(NULL, params, n_params, cfg, 0, out);
    if (out) *out = NULL;
    if (!kiln_adamw_op_supported(be))
        return kiln_error(KILN_ERR_UNSUPPORTED, "adamw: backend '%s' has no AdamW ops",
                          be->i->name ? be->i->name : "?");
    return create_impl(be, params, n_params, cfg, 0, out);
}

/* ---- a device optimizer's state: the backend's download and upload ----------------------- */

static kiln_status dev_get_moments(const kiln_adamw *o, int i, float *m, float *v) {
    kiln_backend *be = o->be;
    const adamw_slot *s = &o->p[i];
    if (o->cfg.moments == KILN_ADAMW_MOMENTS_F32) {
        if (m) KILN_TRY(kiln_backend_download(be, m, s->m, (size_t)s->n * sizeof(float)));
        if (v) KILN_TRY(kiln_backend_download(be, v, s->v, (size_t)s->n * sizeof(float)));
        return KILN_OK;
    }
    const int64_t nb = n_blocks_of(s->n);
    uint8_t *h = kiln_malloc(2 * (size_t)s->n);
    if (!h) return kiln_error(KILN_ERR_NOMEM, "adamw: out of memory reading the moments");
    int8_t *mq = (int8_t *)h;
    uint8_t *vq = h + s->n;
    float *ms = (float *)(void *)kiln_malloc(8 * (size_t)nb);
    kiln_status st = ms ? KILN_OK : kiln_error(KILN_ERR_NOMEM, "adamw: out of memory");
    float *vs = ms ? ms + nb : NULL;
    if (st == KILN_OK) st = kiln_backend_download(be, mq, s->mq, (size_t)s->n);
    if (st == KILN_OK) st = kiln_backend_download(be, vq, s->vq, (size_t)s->n);
    if (st == KILN_OK) st = kiln_backend_download(be, ms, s->ms, 4 * (size_t)nb);
    if (st == KILN_OK) st = kiln_backend_download(be, vs, s->vs, 4 * (size_t)nb);
    if (st == KILN_OK) {
        float bm[KILN_ADAMW_Q8_BLOCK], bv[KILN_ADAMW_Q8_BLOCK];
        for (int64_t b0 = 0; b0 < s->n; b0 += KILN_ADAMW_Q8_BLOCK) {
            int len = (int)(s->n - b0 < KILN_ADAMW_Q8_BLOCK ? s->n - b0 : KILN_ADAMW_Q8_BLOCK);
            int64_t b = b0 / KILN_ADAMW_Q8_BLOCK;
            kiln_adamw_q8_dequant_block(mq + b0, vq + b0, ms[b], vs[b], bm, bv, len);
            if (m) memcpy(m + b0, bm, (size_t)len * sizeof(float));
            if (v) memcpy(v + b0, bv, (size_t)len * sizeof(float));
        }
    }
    kiln_free(ms);
    kiln_free(h);
    return st;
}

/* The host mirror of parameter i's master (bytes 4n) or compensation (2n), downloaded now. */
static const void *dev_mirror(const kiln_adamw *o, int i, const void *dev_ptr, size_t bytes) {
    adamw_slot *s = (adamw_slot *)&o->p[i]; /* the mirror is a cache: logically const */
    if (!s->mirror) s->mirror = kiln_malloc(bytes);
    if (!s->mirror) {
        kiln_error(KILN_ERR_NOMEM, "adamw: out of memory for the host copy of '%s'", s->name);
        return NULL;
    }
    if (kiln_backend_download(o->be, s->mirror, dev_ptr, bytes) != KILN_OK) return NULL;
    return s->mirror;
}

/* Write `bytes` of device memory through the writer, staged in pieces of at most 16 MiB. */
static kiln_status dev_write_array(kiln_backend *be, const void *dev, uint64_t bytes,
                                   kiln_adamw_write_fn write, void *ctx) {
    const size_t piece = (size_t)1 << 24;
    size_t cap = bytes < piece ? (size_t)bytes : piece;
    uint8_t *h = kiln_malloc(cap ? cap : 1);
    if (!h) return kiln_error(KILN_ERR_NOMEM, "adamw: out of memory staging the state");
    kiln_status st = KILN_OK;
    for (uint64_t off = 0; st == KILN_OK && off < bytes; off += cap) {
        size_t n = bytes - off < cap ? (size_t)(bytes - off) : cap;
        st = kiln_backend_download(be, h, (const uint8_t *)dev + off, n);
        if (st == KILN_OK) st = write(ctx, h, n);
    }
    kiln_free(h);
    return st;
}

void kiln_adamw_set_lr(kiln_adamw *o, double lr) { o->cfg.lr = lr; }
double kiln_adamw_get_lr(const kiln_adamw *o) { return o->cfg.lr; }
int64_t kiln_adamw_get_step(const kiln_adamw *o) { return o->step; }
int kiln_adamw_param_decays(const kiln_adamw *o, int i) {
    return i >= 0 && i < o->n_params ? o->p[i].decay : 0;
}

/* ---- finite check ------------------------------------------------------------------------ */

kiln_status kiln_adamw_grads_finite(const kiln_adamw *o, kiln_pool *pool) {
    if (!o) return kiln_error(KILN_ERR_INVALID_ARG, "adamw: optimizer is NULL");
    if (o->n_params == 0) return KILN_OK;
    const kiln_adamw_table tab = table_of(o);
    KILN_TRY(kiln_adamw_op_nonfinite(o->be, pool, &tab, o->ws, o->bad));
    for (int i = 0; i < o->n_params; i++) {
        const int64_t e = o->bad[i];
        if (e < 0) continue;
        const adamw_slot *s = &o->p[i];
        float g = 0.0f;
        if (o->host)
            g = s->grad[e];
        else
            KILN_TRY(kiln_backend_download(o->be, &g, s->grad + e, sizeof g));
        return kiln_error(KILN_ERR_RANGE,
                          "adamw: gradient of '%s' is not finite at element %lld (%g): step "
                          "refused, no weight changed",
                          s->name, (long long)e, (double)g);
    }
    return KILN_OK;
}

/* ---- step -------------------------------------------------------------------------------- */

kiln_status kiln_adamw_step(kiln_adamw *o, kiln_pool *pool) {
    if (!o) return kiln_error(KILN_ERR_INVALID_ARG, "adamw: optimizer is NULL");
    KILN_TRY(kiln_adamw_grads_finite(o, pool));
    return kiln_adamw_step_checked(o, pool);
}

kiln_status kiln_adamw_set_grad_scale(kiln_adamw *o, float coef) {
    if (!o) return kiln_error(KILN_ERR_INVALID_ARG, "adamw: optimizer is NULL");
    if (!(coef >= 0.0f && coef <= 1.0f))
        return kiln_error(KILN_ERR_INVALID_ARG, "adamw: gradient scale %g is not in [0, 1]",
                          (double)coef);
    o->grad_scale = coef;
    return KILN_OK;
}

kiln_status kiln_adamw_step_checked(kiln_adamw *o, kiln_pool *pool) {
    if (!o) return kiln_error(KILN_ERR_INVALID_ARG, "adamw: optimizer is NULL");
    const kiln_adamw_config *c = &o->cfg;
    const int64_t step = o->step + 1;
    /* torch keeps state["step"] as a float32 tensor: exact up to 2^24 */
    const double stepd = (double)step;
    kiln_adamw_scalars sc;
    memset(&sc, 0, sizeof sc);
    kiln_adamw_scalars *s = &sc;
    s->use_wd = c->weight_decay != 0.0;
    s->wd_mul = (float)(1.0 - c->lr * c->weight_decay);
    float w1 = (float)(1.0 - c->beta1);
    s->lerp_small = fabsf(w1) < 0.5f;
    s->lerp_coeff = s->lerp_small ? w1 : w1 - 1.0f;
    s->beta2 = (float)c->beta2;
    s->c2 = (float)(1.0 - c->beta2);
    double bc1 = 1.0 - pow(c->beta1, stepd);
    double bc2 = 1.0 - pow(c->beta2, stepd);
    double step_size = c->lr / bc1;
    s->bc2_sqrt = (float)pow(bc2, 0.5);
    s->eps = (float)c->eps;
    s->neg_step_size = (float)(-step_size);
    s->sr_key = kiln_adamw_mix64(kiln_adamw_mix64(c->seed) + (uint64_t)step);
    s->scale_grad = o->grad_scale != 1.0f;
    s->grad_scale = o->grad_scale;
    const kiln_adamw_table tab = table_of(o);
    if (o->n_params > 0) KILN_TRY(kiln_adamw_op_step(o->be, pool, &tab, o->ws, s));
    o->step = step;
    return KILN_OK;
}

/* ---- per-parameter weight decay ---------------------------------------------------------- */

/* Parameter i's weight decay under the optimizer's own rule. */
static double own_decay(const kiln_adamw *o, int i) {
    return o->p[i].decay ? o->cfg.weight_decay : 0.0;
}

/* Parameter i's weight decay as wd asks for it (a negative entry: its own). */
static double wanted_decay(const kiln_adamw *o, const double *wd, int i) {
    return wd[i] < 0.0 ? own_decay(o, i) : wd[i];
}

kiln_status kiln_adamw_check_decay(const kiln_adamw *o, const double *wd) {
    if (!o || !wd) return kiln_error(KILN_ERR_INVALID_ARG, "adamw: optimizer or weight decays NULL");
    for (int i = 0; i < o->n_params; i++) {
        if (!isfinite(wd[i]))
            return kiln_error(KILN_ERR_INVALID_ARG, "adamw: weight decay of '%s' is %g (must be finite)",
                              o->p[i].name, wd[i]);
        if (wanted_decay(o, wd, i) != own_decay(o, i) && o->cfg.weights != KILN_ADAMW_F32 &&
            o->cfg.weights != KILN_ADAMW_BF16_MASTER)
            return kiln_error(KILN_ERR_UNSUPPORTED,
                              "adamw: weight decay %g for '%s' (its own is %g): with %s the decay "
                              "is part of the update's rounding, so only the optimizer's own "
                              "decay can be applied", wd[i], o->p[i].name, own_decay(o, i),
                              weights_name(o->cfg.weights));
    }
    return KILN_OK;
}

kiln_status kiln_adamw_step_decay(kiln_adamw *o, kiln_pool *pool, const double *wd) {
    KILN_TRY(kiln_adamw_check_decay(o, wd));
    int own = 1;
    for (int i = 0; i < o->n_params; i++) own &= wanted_decay(o, wd, i) == own_decay(o, i);
    if (own) return kiln_adamw_step_checked(o, pool);
    for (int i = 0; i < o->n_params; i++) {
        const double w = wanted_decay(o, wd, i);
        if (w == 0.0) continue;
        const adamw_slot *s = &o->p[i];
        /* the f32 array the update reads: the weights, or the master copy */
        float *x = o->cfg.weights == KILN_ADAMW_F32 ? (float *)s->weights : s->master;
        const float mul = (float)(1.0 - o->cfg.lr * w); /* adamw_math.h's wd_mul */
        if (o->host)
            for (int64_t e = 0; e < s->n; e++) x[e] = x[e] * mul;
        else
            o->be->i->scale(o->be, x, mul, (size_t)s->n);
    }
    const double saved = o->cfg.weight_decay;
    o->cfg.weight_decay = 0.0; /* the step's use_wd off: every decay was the pass above */
    kiln_status st = kiln_adamw_step_checked(o, pool);
    o->cfg.weight_decay = saved;
    return st;
}

/* ---- describe / read back ---------------------------------------------------------------- */

void kiln_adamw_describe(const kiln_adamw *o, char *buf, size_t cap, kiln_adamw_memory *mem) {
    if (mem) *mem = o->mem;
    if (!buf || cap == 0) return;
    uint64_t n = 0;
    for (int i = 0; i < o->n_params; i++) n += (uint64_t)o->p[i].n;
    const kiln_adamw_memory *m = &o->mem;
    snprintf(buf, cap,
             "adamw: %s, %s; %d tensors, %llu parameters; memory: params %llu B, master %llu B, "
             "moments %llu B, compensation %llu B; optimizer-owned %llu B (%.3f B/parameter)",
             weights_name(o->cfg.weights), moments_name(o->cfg.moments), o->n_params,
             (unsigned long long)n, (unsigned long long)m->params, (unsigned long long)m->master,
             (unsigned long long)m->moments, (unsigned long long)m->compensation,
             (unsigned long long)m->owned, n ? (double)m->owned / (double)n : 0.0);
}

kiln_status kiln_adamw_get_moments(const kiln_adamw *o, int i, float *m, float *v) {
    if (!o || i < 0 || i >= o->n_params)
        return kiln_error(KILN_ERR_INVALID_ARG, "adamw: parameter index %d out of range", i);
    if (!o->host) return dev_get_moments(o, i, m, v);
    const adamw_slot *s = &o->p[i];
    if (o->cfg.moments == KILN_ADAMW_MOMENTS_F32) {
        if (m) memcpy(m, s->m, (size_t)s->n * sizeof(float));
        if (v) memcpy(v, s->v, (size_t)s->n * sizeof(float));
        return KILN_OK;
    }
    float bm[KILN_ADAMW_Q8_BLOCK], bv[KILN_ADAMW_Q8_BLOCK];
    for (int64_t b0 = 0; b0 < s->n; b0 += KILN_ADAMW_Q8_BLOCK) {
        int len = (int)(s->n - b0 < KILN_ADAMW_Q8_BLOCK ? s->n - b0 : KILN_ADAMW_Q8_BLOCK);
        int64_t b = b0 / KILN_ADAMW_Q8_BLOCK;
        kiln_adamw_q8_dequant_block(s->mq + b0, s->vq + b0, s->ms[b], s->vs[b], bm, bv, len);
        if (m) memcpy(m + b0, bm, (size_t)len * sizeof(float));
        if (v) memcpy(v + b0, bv, (size_t)len * sizeof(float));
    }
    return KILN_OK;
}

const float *kiln_adamw_master(const kiln_adamw *o, int i) {
    if (i < 0 || i >= o->n_params || !o->p[i].master) return NULL;
    if (!o->host)
        return dev_mirror(o, i, o->p[i].master, (size_t)o->p[i].n * sizeof(float));
    return o->p[i].master;
}
const uint16_t *kiln_adamw_compensation(const kiln_adamw *o, int i) {
    if (i < 0 || i >= o->n_params || !o->p[i].comp) return NULL;
    if (!o->host)
        return dev_mirror(o, i, o->p[i].comp, (size_t)o->p[i].n * sizeof(uint16_t));
    return o->p[i].comp;
}

/* set_master / set_compensation: n elements of size es into slot i's array dst. */
static kiln_status set_state(kiln_adamw *o, int i, void *dst, const void *src, size_t es, const char *what) {
    if (!o || i < 0 || i >= o->n_params)
        return kiln_error(KILN_ERR_INVALID_ARG, "adamw: parameter index %d out of range", i);
    if (!dst) return kiln_error(KILN_ERR_STATE, "adamw: '%s' keeps no %s", o->p[i].name, what);
    if (!src) return kiln_error(KILN_ERR_INVALID_ARG, "adamw: no %s given for '%s'", what, o->p[i].name);
    const size_t bytes = (size_t)o->p[i].n * es;
    if (o->host) {
        memcpy(dst, src, bytes);
        return KILN_OK;
    }
    return kiln_backend_upload(o->be, dst, src, bytes);
}

kiln_status kiln_adamw_set_master(kiln_adamw *o, int i, const float *master) {
    return set_state(o, i, o && i >= 0 && i < o->n_params ? o->p[i].master : NULL, master, sizeof(float),
                     "master copy");
}

kiln_status kiln_adamw_set_compensation(kiln_adamw *o, int i, const uint16_t *comp) {
    return set_state(o, i, o && i >= 0 && i < o->n_params ? o->p[i].comp : NULL, comp, sizeof(uint16_t),
                     "compensation");
}

kiln_status kiln_adamw_set_moments(kiln_adamw *o, int i, const float *m, const float *v) {
    if (!o || i < 0 || i >= o->n_params)
        return kiln_error(KILN_ERR_INVALID_ARG, "adamw: parameter index %d out of range", i);
    if (!m || !v) return kiln_error(KILN_ERR_INVALID_ARG, "adamw: set_moments needs both moments");
    const adamw_slot *s = &o->p[i];
    for (int64_t e = 0; e < s->n; e++) {
        if (!isfinite(m[e]))
            return kiln_error(KILN_ERR_INVALID_ARG, "adamw: exp_avg of '%s'[%lld] is not finite (%g)",
                              s->name, (long long)e, (double)m[e]);
        if (!(v[e] >= 0.0f) || !isfinite(v[e]))
            return kiln_error(KILN_ERR_INVALID_ARG, "adamw: exp_avg_sq of '%s'[%lld] is %g (finite, >= 0)",
                              s->name, (long long)e, (double)v[e]);
    }
    const size_t n = (size_t)s->n;
    if (o->cfg.moments == KILN_ADAMW_MOMENTS_F32) {
        if (o->host) {
            memcpy(s->m, m, n * sizeof(float));
            memcpy(s->v, v, n * sizeof(float));
            return KILN_OK;
        }
        KILN_TRY(kiln_backend_upload(o->be, s->m, m, n * sizeof(float)));
        return kiln_backend_upload(o->be, s->v, v, n * sizeof(float));
    }
    /* 8-bit: codes and block scales made on the host, as the CPU step makes them */
    const int64_t nb = n_blocks_of(s->n);
    int8_t *mq = s->mq;
    uint8_t *vq = s->vq;
    float *ms = s->ms, *vs = s->vs;
    uint8_t *stage = NULL; /* a device optimizer's host staging: codes (2n), then scales */
    float *scales = NULL;
    if (!o->host) {
        stage = kiln_malloc(2 * n);
        scales = kiln_malloc(8 * (size_t)nb);
        if (!stage || !scales) {
            kiln_free(stage);
            kiln_free(scales);
            return kiln_error(KILN_ERR_NOMEM, "adamw: out of memory staging the moments");
        }
        mq = (int8_t *)stage;
        vq = stage + n;
        ms = scales;
        vs = scales + nb;
    }
    for (int64_t b0 = 0; b0 < s->n; b0 += KILN_ADAMW_Q8_BLOCK) {
        int len = (int)(s->n - b0 < KILN_ADAMW_Q8_BLOCK ? s->n - b0 : KILN_ADAMW_Q8_BLOCK);
        int64_t b = b0 / KILN_ADAMW_Q8_BLOCK;
        kiln_adamw_q8_quant_block(m + b0, v + b0, mq + b0, vq + b0, &ms[b], &vs[b], len);
    }
    kiln_status st = KILN_OK;
    if (!o->host) {
        st = kiln_backend_upload(o->be, s->mq, mq, n);
        if (st == KILN_OK) st = kiln_backend_upload(o->be, s->vq, vq, n);
        if (st == KILN_OK) st = kiln_backend_upload(o->be, s->ms, ms, 4 * (size_t)nb);
        if (st == KILN_OK) st = kiln_backend_upload(o->be, s->vs, vs, 4 * (size_t)nb);
    }
    kiln_free(scales);
    kiln_free(stage);
    return st;
}

kiln_status kiln_adamw_set_step(kiln_adamw *o, int64_t step) {
    if (!o) return kiln_error(KILN_ERR_INVALID_ARG, "adamw: optimizer is NULL");
    if (step < 0 || step > ((int64_t)1 << 24))
        return kiln_error(KILN_ERR_RANGE, "adamw: step %lld not in [0, 2^24]", (long long)step);
    o->step = step;
    return KILN_OK;
}

/* ---- save / load ------------------------------------------------------------------------- */

/* Bytes of parameter i's state arrays, in file order. */
static int slot_arrays(const kiln_adamw *o, int i, void *ptr[5], uint64_t bytes[5]) {
    const adamw_slot *s = &o->p[i];
    uint64_t n = (uint64_t)s->n, nb = (uint64_t)n_blocks_of(s->n);
    int k = 0;
    if (o->cfg.moments == KILN_ADAMW_MOMENTS_F32) {
        ptr[k] = s->m; bytes[k++] = 4 * n;
        ptr[k] = s->v; bytes[k++] = 4 * n;
    } else {
        ptr[k] = s->mq; bytes[k++] = n;
        ptr[k] = s->ms; bytes[k++] = 4 * nb;
        ptr[k] = s->vq; bytes[k++] = n;
        ptr[k] = s->vs; bytes[k++] = 4 * nb;
    }
    if (s->master) { ptr[k] = s->master; bytes[k++] = 4 * n; }
    if (s->comp) { ptr[k] = s->comp; bytes[k++] = 2 * n; }
    return k;
}

#define HEADER_BYTES (8 + 4 * 4 + 8 + 8 + 5 * 8)

uint64_t kiln_adamw_state_size(const kiln_adamw *o) {
    uint64_t t = HEADER_BYTES;
    for (int i = 0; i < o->n_params; i++) {
        t += 4 + strlen(o->p[i].name) + 8 + 4;
        void *ptr[5];
        uint64_t bytes[5];
        int k = slot_arrays(o, i, ptr, bytes);
        for (int j = 0; j < k; j++) t += bytes[j];
    }
    return t + 8;
}

typedef struct wbuf {
    uint8_t b[128];
    size_t n;
} wbuf;

static void put(wbuf *w, const void *p, size_t n) {
    memcpy(w->b + w->n, p, n);
    w->n += n;
}

kiln_status kiln_adamw_save(const kiln_adamw *o, kiln_adamw_write_fn write, void *ctx) {
    if (!o || !write) return kiln_error(KILN_ERR_INVALID_ARG, "adamw: save needs a writer");
    wbuf h = {{0}, 0};
    uint32_t u32;
    put(&h, ADAMW_MAGIC, 8);
    u32 = ADAMW_VERSION; put(&h, &u32, 4);
    u32 = (uint32_t)o->cfg.weights; put(&h, &u32, 4);
    u32 = (uint32_t)o->cfg.moments; put(&h, &u32, 4);
    u32 = (uint32_t)o->n_params; put(&h, &u32, 4);
    put(&h, &o->cfg.seed, 8);
    put(&h, &o->step, 8);
    put(&h, &o->cfg.lr, 8);
    put(&h, &o->cfg.beta1, 8);
    put(&h, &o->cfg.beta2, 8);
    put(&h, &o->cfg.eps, 8);
    put(&h, &o->cfg.weight_decay, 8);
    KILN_TRY(write(ctx, h.b, h.n));
    for (int i = 0; i < o->n_params; i++) {
        const adamw_slot *s = &o->p[i];
        uint32_t len = (uint32_t)strlen(s->name);
        KILN_TRY(write(ctx, &len, 4));
        KILN_TRY(write(ctx, s->name, len));
        KILN_TRY(write(ctx, &s->n, 8));
        u32 = (uint32_t)s->decay;
        KILN_TRY(write(ctx, &u32, 4));
    }
    for (int i = 0; i < o->n_params; i++) {
        void *ptr[5];
        uint64_t bytes[5];
        int k = slot_arrays(o, i, ptr, bytes);
        for (int j = 0; j < k; j++) {
            if (!o->host)
                KILN_TRY(dev_write_array(o->be, ptr[j], bytes[j], write, ctx));
            else
                KILN_TRY(write(ctx, ptr[j], (size_t)bytes[j]));
        }
    }
    return write(ctx, ADAMW_END, 8);
}

typedef struct rcur {
    const uint8_t *p;
    size_t left, off;
} rcur;

static bool get(rcur *r, void *dst, size_t n) {
    if (r->left < n) return false;
    if (dst) memcpy(dst, r->p + r->off, n);
    r->off += n;
    r->left -= n;
    return true;
}

kiln_status kiln_adamw_load(kiln_adamw *o, const void *data, size_t size) {
    if (!o || !data) return kiln_error(KILN_ERR_INVALID_ARG, "adamw: load needs a state");
    rcur r = {data, size, 0};
    char magic[8];
    uint32_t version, weights, moments, n_params;
    uint64_t seed;
    int64_t step;
    double hp[5];
    if (!get(&r, magic, 8) || memcmp(magic, ADAMW_MAGIC, 8) != 0)
        return kiln_error(KILN_ERR_FORMAT, "adamw state: bad magic (not a kiln AdamW state)");
    if (!get(&r, &version, 4) || !get(&r, &weights, 4) || !get(&r, &moments, 4) ||
        !get(&r, &n_params, 4) || !get(&r, &seed, 8) || !get(&r, &step, 8) || !get(&r, hp, 40))
        return kiln_error(KILN_ERR_FORMAT, "adamw state: truncated header (%zu bytes)", size);
    if (version != ADAMW_VERSION)
        return kiln_error(KILN_ERR_UNSUPPORTED, "adamw state: version %u, this kiln reads %u",
                          version, ADAMW_VERSION);
    if (weights != (uint32_t)o->cfg.weights || moments != (uint32_t)o->cfg.moments)
        return kiln_error(KILN_ERR_STATE,
                          "adamw state: saved with storage '%s, %s', this optimizer uses '%s, %s'",
                          weights <= 3 ? weights_name((kiln_adamw_weights)weights) : "unknown",
                          moments <= 1 ? moments_name((kiln_adamw_moments)moments) : "unknown",
                          weights_name(o->cfg.weights), moments_name(o->cfg.moments));
    if (n_params != (uint32_t)o->n_params)
        return kiln_error(KILN_ERR_STATE,
                          "adamw state: saved with %u parameters, this optimizer has %d", n_params,
                          o->n_params);
    if (step < 0 || step > (1 << 24))
        return kiln_error(KILN_ERR_FORMAT, "adamw state: step %lld out of range", (long long)step);
    kiln_adamw_config hc = o->cfg;
    hc.lr = hp[0]; hc.beta1 = hp[1]; hc.beta2 = hp[2]; hc.eps = hp[3]; hc.weight_decay = hp[4];
    if (check_config(&hc) != KILN_OK)
        return kiln_error_prefix(KILN_ERR_FORMAT, "adamw state: hyperparameters");
    /* pass 1: the parameter list must match; collect decay flags */
    for (int i = 0; i < o->n_params; i++) {
        const adamw_slot *s = &o->p[i];
        uint32_t len;
        int64_t n;
        uint32_t decay;
        if (!get(&r, &len, 4) || len > r.left)
            return kiln_error(KILN_ERR_FORMAT, "adamw state: parameter %d: truncated name", i);
        const char *nm = (const char *)r.p + r.off;
        get(&r, NULL, len);
        if (!get(&r, &n, 8) || !get(&r, &decay, 4) || decay > 1)
            return kiln_error(KILN_ERR_FORMAT, "adamw state: parameter %d: truncated or bad entry",
                              i);
        if (len != strlen(s->name) || memcmp(nm, s->name, len) != 0)
            return kiln_error(KILN_ERR_STATE,
                              "adamw state: parameter %d is '%.*s', this optimizer's is '%s'", i,
                              (int)(len > 200 ? 200 : len), nm, s->name);
        if (n != s->n)
            return kiln_error(KILN_ERR_STATE,
                              "adamw state: parameter '%s' has %lld elements, this optimizer's %lld",
                              s->name, (long long)n, (long long)s->n);
    }
    size_t arrays_off = r.off;
    uint64_t need = 0;
    for (int i = 0; i < o->n_params; i++) {
        void *ptr[5];
        uint64_t bytes[5];
        int k = slot_arrays(o, i, ptr, bytes);
        for (int j = 0; j < k; j++) need += bytes[j];
    }
    if (need + 8 != r.left)
        return kiln_error(KILN_ERR_FORMAT,
                          "adamw state: %zu bytes of arrays and end marker, expected %llu",
                          r.left, (unsigned long long)(need + 8));
    if (memcmp(r.p + r.off + need, ADAMW_END, 8) != 0)
        return kiln_error(KILN_ERR_FORMAT, "adamw state: missing end marker");
    /* pass 2: everything checked; write */
    r.off = HEADER_BYTES;
    r.left = size - r.off;
    for (int i = 0; i < o->n_params; i++) {
        uint32_t len = 0, decay = 0;
        get(&r, &len, 4);
        get(&r, NULL, len + 8);
        get(&r, &decay, 4);
        o->p[i].decay = (int)decay;
    }
    r.off = arrays_off;
    for (int i = 0; i < o->n_params; i++) {
        void *ptr[5];
        uint64_t bytes[5];
        int k = slot_arrays(o, i, ptr, bytes);
        for (int j = 0; j < k; j++) {
            if (!o->host) /* a device failure here leaves the state partly written */
                KILN_TRY(kiln_backend_upload(o->be, ptr[j], r.p + r.off, (size_t)bytes[j]));
            get(&r, o->host ? ptr[j] : NULL, (size_t)bytes[j]);
        }
    }
    /* the restored decay flags, in the ops' table */
    sync_table(o);
    const kiln_adamw_table tab = table_of(o);
    KILN_TRY(kiln_adamw_op_prepare(o->be, NULL, &tab, o->ws, 0));
    o->cfg.lr = hc.lr;
    o->cfg.beta1 = hc.beta1;
    o->cfg.beta2 = hc.beta2;
    o->cfg.eps = hc.eps;
    o->cfg.weight_decay = hc.weight_decay;
    o->cfg.seed = seed;
    o->step = step;
    return KILN_OK;
}

/* ---- gradient norm and clipping ---------------------------------------------------------- */

float kiln_grad_norm_torch(const float *g, int64_t n) { return sqrtf(kiln_adamw_sumsq8(g, n)); }

void kiln_sumsq8_begin(kiln_sumsq8_state *st) { memset(st, 0, sizeof *st); }

/* kiln_adamw_sumsq8's steps for elements e0 .. e0 + len - 1 of a tensor of n elements: the
 * full groups of 8 go to their lanes, the lanes are combined once the first tail element
 * (or the end) is reached, the tail is added in order. Fed the whole tensor in pieces in
 * increasing order, st->sum ends as kiln_adamw_sumsq8(g, n) bit for bit. */
void kiln_sumsq8_feed(kiln_sumsq8_state *st, const float *g, int64_t e0, int64_t len, int64_t n) {
    const int64_t head = n - n % 8;
    for (int64_t k = 0; k < len; k++) {
        const int64_t e = e0 + k;
        const float q = g[k] * g[k];
        if (e < head) {
            st->acc[e % 8] = st->acc[e % 8] + q;
            continue;
        }
        if (!st->combined) {
            float s = st->acc[0];
            for (int j = 1; j < 8; j++) s = s + st->acc[j];
            st->sum = s;
            st->combined = 1;
        }
        st->sum = st->sum + q;
    }
    if (e0 + len == n && !st->combined) {
        float s = st->acc[0];
        for (int j = 1; j < 8; j++) s = s + st->acc[j];
        st->sum = s;
        st->combined = 1;
    }
}

float *kiln_adamw_state_f32(kiln_adamw *o, int i, int which) {
    if (!o || !o->host || i < 0 || i >= o->n_params || o->cfg.moments != KILN_ADAMW_MOMENTS_F32) return NULL;
    adamw_slot *s = &o->p[i];
    return which == 0 ? s->m : which == 1 ? s->v : which == 2 ? s->master : NULL;
}

uint16_t *kiln_adamw_state_comp(kiln_adamw *o, int i) {
    if (!o || !o->host || i < 0 || i >= o->n_params) return NULL;
    return o->p[i].comp;
}

kiln_status kiln_adamw_grad_norm(const kiln_adamw *o, kiln_pool *pool, float *norms,
                                 float *total, float *sq_norm) {
    if (!o) return kiln_error(KILN_ERR_INVALID_ARG, "adamw: optimizer is NULL");
    if (o->n_params == 0) {
        if (total) *total = 0.0f;
        if (sq_norm) *sq_norm = 0.0f;
        return KILN_OK;
    }
    const kiln_adamw_table tab = table_of(o);
    return kiln_adamw_op_grad_norm(o->be, pool, &tab, o->ws, norms, sq_norm, total);
}

float kiln_clip_coef(float total_norm, double max_norm) {
    return kiln_adamw_clip_coef(total_norm, (float)max_norm); /* NaN stays NaN */
}

kiln_status kiln_adamw_clip_grads(kiln_adamw *o, kiln_pool *pool, double max_norm,
                                  float *total_norm, float *coef) {
    if (!o) return kiln_error(KILN_ERR_INVALID_ARG, "adamw: optimizer is NULL");
    if (!(max_norm > 0.0) || !isfinite(max_norm))
        return kiln_error(KILN_ERR_INVALID_ARG, "adamw: max_norm %g must be finite and > 0",
                          max_norm);
    if (o->n_params == 0) {
        if (total_norm) *total_norm = 0.0f;
        if (coef) *coef = kiln_adamw_clip_coef(0.0f, (float)max_norm);
        return KILN_OK;
    }
    const kiln_adamw_table tab = table_of(o);
    return kiln_adamw_op_clip(o->be, pool, &tab, o->ws, (float)max_norm, total_norm, coef);
}
