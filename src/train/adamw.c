/*
 * adamw.c -- torch.optim.AdamW (single-tensor path) in float32 operation order, with bf16
 * weight storage variants and 8-bit block moments; torch's clip_grad_norm_ arithmetic.
 * The definitions are in docs/ARITHMETIC.md, "AdamW and clipping"; the per-element
 * arithmetic is src/ops/adamw_math.h, shared with the CUDA kernels (src/ops/cuda/cuda_adamw.cu).
 *
 * An optimizer made by kiln_adamw_create_on with the CUDA backend ("device optimizer") keeps
 * the same slots, but weights, grads and every state array are device memory: each entry point
 * below starts with `if (o->be)` and runs the device twin (the dev_* functions), which
 * enqueues the same element-wise arithmetic on the backend's stream. A device step is one launch
 * over every parameter (kiln_cuda_adamw_step_multi, with the tensor table uploaded at create and
 * at load), or, with the environment variable KILN_ADAMW_MULTI=0 (read at every step, for A/B
 * checks), one launch per parameter (kiln_cuda_adamw_step); the two give the same bits.
 */
#include "adamw.h"

#include "../base/cpu_features.h"
#include "../base/kmath.h"
#include "../base/tensor.h"
#include "../ops/cuda/cuda_train.h"
#include "../ops/adamw_math.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Elements per task of a step (a multiple of KILN_ADAMW_Q8_BLOCK so that every 8-bit block
 * belongs to one task). Each element is updated alone, so the split changes no bit. */
#define ADAMW_CHUNK 16384

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

typedef struct adamw_chunk {
    int param;
    int64_t start, len; /* start a multiple of ADAMW_CHUNK */
} adamw_chunk;

struct kiln_adamw {
    kiln_adamw_config cfg; /* decay_map cleared: flags live in the slots */
    int n_params;
    adamw_slot *p;         /* (n_params) */
    adamw_chunk *chunks;   /* (n_chunks) in parameter order, then element order */
    int n_chunks;
    int64_t *bad;          /* (n_chunks) scratch of grads_finite */
    float *norms;          /* (n_params) scratch of grad_norm */
    int64_t step;
    float grad_scale;      /* kiln_adamw_set_grad_scale's coefficient; 1: none */
    void *state;           /* one allocation holding every state array (device memory for a
                            * device optimizer) */
    kiln_adamw_memory mem;
    /* device optimizer only (be != NULL): */
    kiln_backend *be;
    void *dev_scratch;             /* one device block holding the four below and the plan's
                                    * arrays */
    kiln_cuda_grad_entry *d_table; /* (n_params) {grad, n} */
    uint64_t *d_bad;               /* (n_params) lowest non-finite element */
    float *d_norms;                /* (n_params) per-tensor norms */
    float *d_out;                  /* (4) sq, total, coef */
    kiln_cuda_norm_plan norm_plan; /* fast mode's chunked norm (cuda_train.h): chunk, first and
                                    * partial in dev_scratch */
    kiln_cuda_adamw_plan step_plan; /* the multi-tensor step (cuda_train.h): its table and
                                     * chunks in dev_scratch */
    kiln_cuda_adamw_param *d_step_table; /* (n_params) step_plan.table, for the uploads */
    int64_t max_n;                 /* largest parameter */
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

/* ---- the per-element arithmetic (docs/ARITHMETIC.md) ------------------------------------- */

typedef kiln_adamw_scalars adamw_scalars;

/* ---- 8-bit log codes --------------------------------------------------------------------- */

static void q8_dequant_block(const int8_t *mq, const uint8_t *vq, float ms, float vs,
                             float *m, float *v, int len) {
    for (int i = 0; i < len; i++) {
        m[i] = kiln_adamw_q8_m(mq[i], ms);
        v[i] = kiln_adamw_q8_v(vq[i], vs);
    }
}

static float block_absmax(const float *x, int len) {
    float a = 0.0f;
    for (int i = 0; i < len; i++) {
        float b = fabsf(x[i]);
        if (b > a) a = b;
    }
    return a;
}

static void q8_quant_block(const float *m, const float *v, int8_t *mq, uint8_t *vq, float *ms,
                           float *vs, int len) {
    float am = block_absmax(m, len), av = block_absmax(v, len);
    *ms = am;
    *vs = av;
    for (int i = 0; i < len; i++) {
        mq[i] = kiln_adamw_q8_mcode(m[i], am);
        vq[i] = kiln_adamw_q8_vcode(v[i], av);
    }
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
    kiln_free(o->chunks);
    kiln_free(o->bad);
    kiln_free(o->norms);
    if (o->be) {
        kiln_backend_free_buf(o->be, o->state);
        kiln_backend_free_buf(o->be, o->dev_scratch);
    } else {
        kiln_free(o->state);
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

/* Device optimizer: the gradient table and scratch, the zeroed state, the master copy. */
static kiln_status dev_init(kiln_adamw *o, size_t state_bytes);

/* kiln_adamw_create, or with dev (the CUDA backend) a device optimizer. */
static kiln_status create_impl(kiln_backend *dev, const kiln_adamw_param *params, int n_params,
                               const kiln_adamw_config *cfg, kiln_adamw **out) {
    if (!out) return kiln_error(KILN_ERR_INVALID_ARG, "adamw: out is NULL");
    *out = NULL;
    if (!params || n_params <= 0 || !cfg)
        return kiln_error(KILN_ERR_INVALID_ARG, "adamw: need at least one parameter and a config");
    KILN_TRY(check_config(cfg));
    for (int i = 0; i < n_params; i++) {
        const kiln_adamw_param *q = &params[i];
        if (!q->name || !q->weights || !q->grad || q->n <= 0)
            return kiln_error(KILN_ERR_INVALID_ARG,
                              "adamw: parameter %d ('%s'): needs a name, n >= 1, weights and grad",
                              i, q->name ? q->name : "(null)");
        if (dev && (!kiln_cuda_train_is_device(q->weights) || !kiln_cuda_train_is_device(q->grad) ||
                    (q->w16 && !kiln_cuda_train_is_device(q->w16))))
            return kiln_error(KILN_ERR_INVALID_ARG,
                              "adamw: parameter %d ('%s'): weights, grad and w16 must be device "
                              "memory of the CUDA backend", i, q->name);
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

    kiln_adamw *o = kiln_calloc(1, sizeof *o);
    if (!o) return kiln_error(KILN_ERR_NOMEM, "adamw: out of memory");
    o->cfg = *cfg;
    o->grad_scale = 1.0f;
    o->cfg.decay_map = NULL;
    o->cfg.n_decay_map = 0;
    o->n_params = n_params;
    o->p = kiln_calloc((size_t)n_params, sizeof *o->p);
    o->norms = kiln_calloc((size_t)n_params, sizeof(float));
    if (!o->p || !o->norms) goto nomem;

    /* layout of the state allocation, and the chunk count */
    size_t off = 0;
    int64_t n_chunks = 0;
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
        n_chunks += (params[i].n + ADAMW_CHUNK - 1) / ADAMW_CHUNK;
        if (n_chunks > INT32_MAX) goto toobig;
    }
    mem.owned = mem.master + mem.moments + mem.compensation;
    o->mem = mem;
    if (dev) {
        o->be = dev;
        o->state = kiln_backend_alloc(dev, off ? off : 1);
        if (!o->state) {
            kiln_adamw_free(o);
            return kiln_error_prefix(KILN_ERR_NOMEM, "adamw: device state");
        }
    } else {
        o->state = kiln_calloc(1, off ? off : 1);
    }
    o->chunks = kiln_calloc((size_t)n_chunks, sizeof *o->chunks);
    o->bad = kiln_calloc((size_t)n_chunks, sizeof *o->bad);
    if (!o->state || !o->chunks || !o->bad) goto nomem;
    o->n_chunks = (int)n_chunks;

    off = 0;
    uint8_t *base = o->state;
    int c = 0;
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
            const uint16_t *w = q->weights;
            for (int64_t e = 0; !dev && e < q->n; e++) s->master[e] = kiln_bf16_to_fp32(w[e]);
        } else if (cfg->weights == KILN_ADAMW_BF16_KAHAN) {
            TAKE(s->comp, uint16_t, 2 * n);
        }
        for (int64_t st = 0; st < q->n; st += ADAMW_CHUNK) {
            o->chunks[c].param = i;
            o->chunks[c].start = st;
            o->chunks[c].len = q->n - st < ADAMW_CHUNK ? q->n - st : ADAMW_CHUNK;
            c++;
        }
    }
#undef TAKE
    if (dev) {
        kiln_status st = dev_init(o, off ? off : 1);
        if (st != KILN_OK) {
            kiln_adamw_free(o);
            return st;
        }
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
    return create_impl(NULL, params, n_params, cfg, out);
}

kiln_status kiln_adamw_create_on(kiln_backend *be, const kiln_adamw_param *params,
                                 int n_params, const kiln_adamw_config *cfg, kiln_adamw **out) {
    if (!be || (be->i && be->i->name && strcmp(be->i->name, "cpu") == 0))
        return create_impl(NULL, params, n_params, cfg, out);
    if (out) *out = NULL;
    if (!be->i || !be->i->name || strcmp(be->i->name, "cuda") != 0)
        return kiln_error(KILN_ERR_UNSUPPORTED, "adamw: backend '%s' is not supported",
                          be->i && be->i->name ? be->i->name : "?");
    if (n_params > 65535)
        return kiln_error(KILN_ERR_UNSUPPORTED,
                          "adamw: %d parameters on the CUDA backend (at most 65535)", n_params);
    return create_impl(be, params, n_params, cfg, out);
}

/* ---- the device optimizer (CUDA backend): the host side of cuda_adamw.cu ---------------- */

/* Upload fast mode's norm plan (cuda_train.h): chunk (n_chunks entries) followed, at byte
 * first_off of the same device block, by first (P + 1 entries). */
static kiln_status dev_upload_norm_plan(kiln_adamw *o, uint8_t *dev, size_t first_off,
                                        size_t bytes) {
    const int P = o->n_params;
    uint8_t *h = kiln_calloc(1, bytes);
    if (!h) return kiln_error(KILN_ERR_NOMEM, "adamw: out of memory");
    kiln_cuda_norm_chunk *chunk = (kiln_cuda_norm_chunk *)(void *)h;
    int32_t *first = (int32_t *)(void *)(h + first_off);
    int32_t c = 0;
    for (int i = 0; i < P; i++) {
        first[i] = c;
        const int64_t k = (o->p[i].n + KILN_CUDA_NORM_CHUNK - 1) / KILN_CUDA_NORM_CHUNK;
        for (int64_t j = 0; j < k; j++, c++) {
            chunk[c].param = i;
            chunk[c].index = (int32_t)j;
        }
    }
    first[P] = c;
    kiln_status st = kiln_backend_upload(o->be, dev, h, bytes);
    kiln_free(h);
    return st;
}

/* Parameter i as the CUDA step takes it, with decay as given. */
static kiln_cuda_adamw_param dev_param(const kiln_adamw *o, int i, int decay) {
    const adamw_slot *s = &o->p[i];
    kiln_cuda_adamw_param q;
    memset(&q, 0, sizeof q);
    q.n = s->n;
    q.param_index = i;
    q.weights_kind = (int)o->cfg.weights;
    q.q8 = o->cfg.moments == KILN_ADAMW_MOMENTS_Q8;
    q.decay = decay;
    q.weights = s->weights;
    q.grad = s->grad;
    q.w16 = s->w16;
    q.m = s->m;
    q.v = s->v;
    q.mq = s->mq;
    q.vq = s->vq;
    q.ms = s->ms;
    q.vs = s->vs;
    q.master = s->master;
    q.comp = s->comp;
    return q;
}

/* Upload the multi-tensor step's table (step_plan.table): every parameter with its own decay
 * flag (the kernel ands it with use_wd); and, when chunk_dev is not NULL, its step_plan.n_chunks
 * chunks there. At create (both), and at load, which restores the flags (the table only). */
static kiln_status dev_upload_step_plan(kiln_adamw *o, kiln_cuda_adamw_chunk *chunk_dev) {
    const int P = o->n_params;
    kiln_cuda_adamw_param *t = kiln_calloc((size_t)P, sizeof *t);
    if (!t) return kiln_error(KILN_ERR_NOMEM, "adamw: out of memory");
    for (int i = 0; i < P; i++) t[i] = dev_param(o, i, o->p[i].decay);
    kiln_status st = kiln_backend_upload(o->be, o->d_step_table, t, (size_t)P * sizeof *t);
    if (st == KILN_OK && chunk_dev) {
        const size_t cb = (size_t)o->step_plan.n_chunks * sizeof(kiln_cuda_adamw_chunk);
        kiln_cuda_adamw_chunk *c = kiln_malloc(cb ? cb : 1);
        if (!c) {
            st = kiln_error(KILN_ERR_NOMEM, "adamw: out of memory");
        } else {
            kiln_cuda_adamw_chunks(t, P, c);
            st = kiln_backend_upload(o->be, chunk_dev, c, cb);
        }
        kiln_free(c);
    }
    kiln_free(t);
    return st;
}

static kiln_status dev_init(kiln_adamw *o, size_t state_bytes) {
    kiln_backend *be = o->be;
    const int P = o->n_params;
    int64_t n_chunks = 0, n_step_chunks = 0;
    for (int i = 0; i < P; i++) {
        n_chunks += (o->p[i].n + KILN_CUDA_NORM_CHUNK - 1) / KILN_CUDA_NORM_CHUNK;
        n_step_chunks += (o->p[i].n + KILN_CUDA_ADAMW_CHUNK - 1) / KILN_CUDA_ADAMW_CHUNK;
    }
    if (n_chunks > INT32_MAX || n_step_chunks > INT32_MAX)
        return kiln_error(KILN_ERR_UNSUPPORTED, "adamw: %lld norm chunks, %lld step chunks on the device",
                          (long long)n_chunks, (long long)n_step_chunks);
    /* scratch: table, bad, norms, out, then the norm plan's partial, chunk and first, then the
     * step plan's table and chunks, each 64-aligned (the norm plan: 16 bytes per
     * KILN_CUDA_NORM_CHUNK elements, 4 per parameter; the step plan: 8 bytes per
     * KILN_CUDA_ADAMW_CHUNK elements, one kiln_cuda_adamw_param per parameter) */
    size_t tb = ((size_t)P * sizeof(kiln_cuda_grad_entry) + 63) & ~(size_t)63;
    size_t bb = ((size_t)P * sizeof(uint64_t) + 63) & ~(size_t)63;
    size_t nb = ((size_t)P * sizeof(float) + 63) & ~(size_t)63;
    size_t pb = ((size_t)n_chunks * sizeof(double) + 63) & ~(size_t)63;
    size_t cb = ((size_t)n_chunks * sizeof(kiln_cuda_norm_chunk) + 63) & ~(size_t)63;
    size_t fb = ((size_t)(P + 1) * sizeof(int32_t) + 63) & ~(size_t)63;
    size_t sb = ((size_t)P * sizeof(kiln_cuda_adamw_param) + 63) & ~(size_t)63;
    size_t kb = ((size_t)n_step_chunks * sizeof(kiln_cuda_adamw_chunk) + 63) & ~(size_t)63;
    o->dev_scratch = kiln_backend_alloc(be, tb + bb + nb + 64 + pb + cb + fb + sb + kb);
    if (!o->dev_scratch) return kiln_error_prefix(KILN_ERR_NOMEM, "adamw: device scratch");
    uint8_t *base = o->dev_scratch;
    o->d_table = (kiln_cuda_grad_entry *)(void *)base;
    o->d_bad = (uint64_t *)(void *)(base + tb);
    o->d_norms = (float *)(void *)(base + tb + bb);
    o->d_out = (float *)(void *)(base + tb + bb + nb);
    uint8_t *plan = base + tb + bb + nb + 64;
    o->norm_plan.partial = (double *)(void *)plan;
    o->norm_plan.chunk = (const kiln_cuda_norm_chunk *)(void *)(plan + pb);
    o->norm_plan.first = (const int32_t *)(void *)(plan + pb + cb);
    o->norm_plan.n_chunks = n_chunks;
    KILN_TRY(dev_upload_norm_plan(o, plan + pb, cb, cb + fb));
    uint8_t *step = plan + pb + cb + fb;
    o->d_step_table = (kiln_cuda_adamw_param *)(void *)step;
    o->step_plan.table = o->d_step_table;
    o->step_plan.chunk = (const kiln_cuda_adamw_chunk *)(void *)(step + sb);
    o->step_plan.n_chunks = n_step_chunks;
    o->step_plan.weights_kind = (int)o->cfg.weights;
    o->step_plan.q8 = o->cfg.moments == KILN_ADAMW_MOMENTS_Q8;
    KILN_TRY(dev_upload_step_plan(o, (kiln_cuda_adamw_chunk *)(void *)(step + sb)));
    kiln_cuda_grad_entry *t = kiln_calloc((size_t)P, sizeof *t);
    if (!t) return kiln_error(KILN_ERR_NOMEM, "adamw: out of memory");
    o->max_n = 0;
    for (int i = 0; i < P; i++) {
        t[i].grad = o->p[i].grad;
        t[i].n = o->p[i].n;
        if (o->p[i].n > o->max_n) o->max_n = o->p[i].n;
    }
    kiln_status st = kiln_backend_upload(be, o->d_table, t, (size_t)P * sizeof *t);
    kiln_free(t);
    KILN_TRY(st);
    KILN_TRY(kiln_cuda_train_memset(be, o->state, 0, state_bytes));
    for (int i = 0; i < P; i++)
        if (o->p[i].master)
            KILN_TRY(kiln_cuda_adamw_widen_bf16(be, o->p[i].master, o->p[i].weights, o->p[i].n));
    return kiln_backend_status(be);
}

static kiln_status dev_grads_finite(const kiln_adamw *o) {
    kiln_backend *be = o->be;
    const int P = o->n_params;
    KILN_TRY(kiln_cuda_adamw_nonfinite(be, o->d_table, P, o->max_n, o->d_bad));
    /* o->bad has n_chunks >= n_params entries: the host copy */
    KILN_TRY(kiln_backend_download(be, o->bad, o->d_bad, (size_t)P * sizeof(uint64_t)));
    for (int i = 0; i < P; i++) {
        uint64_t e = (uint64_t)o->bad[i];
        if (e == UINT64_MAX) continue;
        const adamw_slot *s = &o->p[i];
        float g = 0.0f;
        KILN_TRY(kiln_backend_download(be, &g, s->grad + e, sizeof g));
        return kiln_error(KILN_ERR_RANGE,
                          "adamw: gradient of '%s' is not finite at element %lld (%g): step "
                          "refused, no weight changed",
                          s->name, (long long)e, (double)g);
    }
    return KILN_OK;
}

/* One launch over the table, or with KILN_ADAMW_MULTI=0 one per parameter: the same bits. */
static kiln_status dev_step(kiln_adamw *o, const adamw_scalars *sc) {
    if (!kiln_env_off("KILN_ADAMW_MULTI")) return kiln_cuda_adamw_step_multi(o->be, &o->step_plan, sc);
    for (int i = 0; i < o->n_params; i++) {
        const kiln_cuda_adamw_param q = dev_param(o, i, o->p[i].decay && sc->use_wd);
        KILN_TRY(kiln_cuda_adamw_step(o->be, &q, sc));
    }
    return KILN_OK;
}

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
            q8_dequant_block(mq + b0, vq + b0, ms[b], vs[b], bm, bv, len);
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

typedef struct finite_ctx {
    const kiln_adamw *o;
} finite_ctx;

static void finite_task(void *vctx, int task, int thread) {
    (void)thread;
    const kiln_adamw *o = ((finite_ctx *)vctx)->o;
    const adamw_chunk *ch = &o->chunks[task];
    const float *g = o->p[ch->param].grad + ch->start;
    int64_t bad = -1;
    /* blocks of 256 with a branch-free test (vectorized), the element found only in a block
     * that has one */
    for (int64_t b0 = 0; b0 < ch->len && bad < 0; b0 += 256) {
        const int64_t n = ch->len - b0 < 256 ? ch->len - b0 : 256;
        uint32_t any = 0;
        for (int64_t i = 0; i < n; i++)
            any |= (uint32_t)((kiln_f32_bits(g[b0 + i]) & 0x7f800000u) == 0x7f800000u);
        for (int64_t i = 0; any && i < n; i++)
            if ((kiln_f32_bits(g[b0 + i]) & 0x7f800000u) == 0x7f800000u) {
                bad = ch->start + b0 + i;
                break;
            }
    }
    o->bad[task] = bad;
}

kiln_status kiln_adamw_grads_finite(const kiln_adamw *o, kiln_pool *pool) {
    if (!o) return kiln_error(KILN_ERR_INVALID_ARG, "adamw: optimizer is NULL");
    if (o->be) return dev_grads_finite(o);
    finite_ctx ctx = {o};
    kiln_pool_run(pool, o->n_chunks, finite_task, &ctx);
    for (int c = 0; c < o->n_chunks; c++)
        if (o->bad[c] >= 0) {
            const adamw_slot *s = &o->p[o->chunks[c].param];
            return kiln_error(KILN_ERR_RANGE,
                              "adamw: gradient of '%s' is not finite at element %lld (%g): step "
                              "refused, no weight changed",
                              s->name, (long long)o->bad[c], (double)s->grad[o->bad[c]]);
        }
    return KILN_OK;
}

/* ---- step -------------------------------------------------------------------------------- */

/* Update elements [start, start + len) of one parameter whose moments are f32 values m, v
 * (indexed from start). The body is compiled twice: plain (the portable path, where fmaf is
 * a libm call) and, on x86-64, for AVX2 + FMA, where fmaf is one vfmadd and the loops
 * vectorize. Every operation is an IEEE one, correctly rounded (fmaf, sqrtf, +, *, /; no
 * contraction: -ffp-contract=off), so both give the same bits (tests/c/test_adamw.c checks
 * it); the AVX2 one is chosen by kiln_cpu_select_path, as the backend's kernels are. */
#if defined(__x86_64__) && defined(__GNUC__)
#define ADAMW_HAVE_AVX2 1
#endif
static inline __attribute__((always_inline)) void update_range_body(
    const kiln_adamw *o, const adamw_scalars *sc, int pi, int64_t start, int64_t len, float *m,
    float *v) {
    const adamw_slot *s = &o->p[pi];
    const int decay = s->decay && sc->use_wd;
    const float *g = s->grad + start;
    switch (o->cfg.weights) {
    case KILN_ADAMW_F32: {
        float *w = (float *)s->weights + start;
        for (int64_t i = 0; i < len; i++) w[i] = kiln_adamw_update(sc, decay, w[i], g[i], &m[i], &v[i]);
        break;
    }
    case KILN_ADAMW_BF16_MASTER: {
        uint16_t *w = (uint16_t *)s->weights + start;
        float *ma = s->master + start;
        for (int64_t i = 0; i < len; i++) {
            float p = kiln_adamw_update(sc, decay, ma[i], g[i], &m[i], &v[i]);
            ma[i] = p;
            w[i] = kiln_fp32_to_bf16(p);
        }
        break;
    }
    case KILN_ADAMW_BF16_KAHAN: {
        uint16_t *w = (uint16_t *)s->weights + start;
        uint16_t *cp = s->comp + start;
        for (int64_t i = 0; i < len; i++) {
            float p = kiln_bf16_to_fp32(w[i]) + kiln_bf16_to_fp32(cp[i]);
            p = kiln_adamw_update(sc, decay, p, g[i], &m[i], &v[i]);
            uint16_t nw = kiln_fp32_to_bf16(p);
            w[i] = nw;
            cp[i] = kiln_fp32_to_bf16(p - kiln_bf16_to_fp32(nw));
        }
        break;
    }
    case KILN_ADAMW_BF16_SR: {
        uint16_t *w = (uint16_t *)s->weights + start;
        const uint64_t key = kiln_adamw_mix64(sc->sr_key + (uint64_t)pi);
        for (int64_t i = 0; i < len; i++) {
            float p = kiln_adamw_update(sc, decay, kiln_bf16_to_fp32(w[i]), g[i], &m[i], &v[i]);
            w[i] = kiln_adamw_bf16_stochastic(p, kiln_adamw_sr_bits(key, (uint64_t)(start + i)));
        }
        break;
    }
    }
}

static void update_range_plain(const kiln_adamw *o, const adamw_scalars *sc, int pi,
                               int64_t start, int64_t len, float *m, float *v) {
    update_range_body(o, sc, pi, start, len, m, v);
}

#ifdef ADAMW_HAVE_AVX2
__attribute__((target("avx2,fma"))) static void update_range_avx2(
    const kiln_adamw *o, const adamw_scalars *sc, int pi, int64_t start, int64_t len, float *m,
    float *v) {
    update_range_body(o, sc, pi, start, len, m, v);
}
#endif

typedef void (*update_range_fn)(const kiln_adamw *o, const adamw_scalars *sc, int pi,
                                int64_t start, int64_t len, float *m, float *v);

/* The body for this CPU (and KILN_CPU_PATH). */
static update_range_fn update_range_for_cpu(void) {
#ifdef ADAMW_HAVE_AVX2
    if (kiln_cpu_select_path() >= KILN_CPU_PATH_AVX2) return update_range_avx2;
#endif
    return update_range_plain;
}

typedef struct step_ctx {
    kiln_adamw *o;
    adamw_scalars s;
    update_range_fn update_range;
} step_ctx;

static void step_task(void *vctx, int task, int thread) {
    (void)thread;
    step_ctx *ctx = vctx;
    kiln_adamw *o = ctx->o;
    const adamw_chunk *ch = &o->chunks[task];
    adamw_slot *s = &o->p[ch->param];
    if (o->cfg.moments == KILN_ADAMW_MOMENTS_F32) {
        ctx->update_range(o, &ctx->s, ch->param, ch->start, ch->len, s->m + ch->start,
                     s->v + ch->start);
        return;
    }
    /* 8-bit: dequantize a block, update it in f32, requantize */
    float m[KILN_ADAMW_Q8_BLOCK], v[KILN_ADAMW_Q8_BLOCK];
    for (int64_t b0 = ch->start; b0 < ch->start + ch->len; b0 += KILN_ADAMW_Q8_BLOCK) {
        int len = (int)(s->n - b0 < KILN_ADAMW_Q8_BLOCK ? s->n - b0 : KILN_ADAMW_Q8_BLOCK);
        int64_t b = b0 / KILN_ADAMW_Q8_BLOCK;
        q8_dequant_block(s->mq + b0, s->vq + b0, s->ms[b], s->vs[b], m, v, len);
        ctx->update_range(o, &ctx->s, ch->param, b0, len, m, v);
        q8_quant_block(m, v, s->mq + b0, s->vq + b0, &s->ms[b], &s->vs[b], len);
    }
}

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
    step_ctx ctx;
    memset(&ctx, 0, sizeof ctx);
    ctx.o = o;
    ctx.update_range = update_range_for_cpu();
    adamw_scalars *s = &ctx.s;
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
    if (o->be)
        KILN_TRY(dev_step(o, s));
    else
        kiln_pool_run(pool, o->n_chunks, step_task, &ctx);
    o->step = step;
    return KILN_OK;
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
    if (o->be) return dev_get_moments(o, i, m, v);
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
        q8_dequant_block(s->mq + b0, s->vq + b0, s->ms[b], s->vs[b], bm, bv, len);
        if (m) memcpy(m + b0, bm, (size_t)len * sizeof(float));
        if (v) memcpy(v + b0, bv, (size_t)len * sizeof(float));
    }
    return KILN_OK;
}

const float *kiln_adamw_master(const kiln_adamw *o, int i) {
    if (i < 0 || i >= o->n_params || !o->p[i].master) return NULL;
    if (o->be)
        return dev_mirror(o, i, o->p[i].master, (size_t)o->p[i].n * sizeof(float));
    return o->p[i].master;
}
const uint16_t *kiln_adamw_compensation(const kiln_adamw *o, int i) {
    if (i < 0 || i >= o->n_params || !o->p[i].comp) return NULL;
    if (o->be)
        return dev_mirror(o, i, o->p[i].comp, (size_t)o->p[i].n * sizeof(uint16_t));
    return o->p[i].comp;
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
            if (o->be)
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
            if (o->be) /* a device failure here leaves the state partly written */
                KILN_TRY(kiln_backend_upload(o->be, ptr[j], r.p + r.off, (size_t)bytes[j]));
            get(&r, o->be ? NULL : ptr[j], (size_t)bytes[j]);
        }
    }
    if (o->be) KILN_TRY(dev_upload_step_plan(o, NULL)); /* the restored decay flags */
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

/* torch's CPU float32 sum of squares (8 lanes): adamw_math.h. */
static float torch_sumsq(const float *g, int64_t n) { return kiln_adamw_sumsq8(g, n); }

float kiln_grad_norm_torch(const float *g, int64_t n) { return sqrtf(torch_sumsq(g, n)); }

typedef struct norm_ctx {
    const kiln_adamw *o;
    float *norms;
} norm_ctx;

static void norm_task(void *vctx, int task, int thread) {
    (void)thread;
    norm_ctx *c = vctx;
    c->norms[task] = kiln_grad_norm_torch(c->o->p[task].grad, c->o->p[task].n);
}

kiln_status kiln_adamw_grad_norm(const kiln_adamw *o, kiln_pool *pool, float *norms,
                                 float *total, float *sq_norm) {
    if (!o) return kiln_error(KILN_ERR_INVALID_ARG, "adamw: optimizer is NULL");
    if (o->be) {
        float h[2];
        KILN_TRY(kiln_cuda_adamw_norms(o->be, o->d_table, o->n_params, &o->norm_plan,
                                       o->d_norms, o->d_out, 0, 0.0f));
        if (norms)
            KILN_TRY(kiln_backend_download(o->be, norms, o->d_norms,
                                           (size_t)o->n_params * sizeof(float)));
        if (sq_norm || total || !norms) { /* one download (a wait) fewer when unasked */
            KILN_TRY(kiln_backend_download(o->be, h, o->d_out, sizeof h));
            if (sq_norm) *sq_norm = h[0];
            if (total) *total = h[1];
        }
        return KILN_OK;
    }
    norm_ctx c = {o, o->norms};
    kiln_pool_run(pool, o->n_params, norm_task, &c);
    float sq = torch_sumsq(o->norms, o->n_params);
    if (norms) memcpy(norms, o->norms, (size_t)o->n_params * sizeof(float));
    if (sq_norm) *sq_norm = sq;
    if (total) *total = sqrtf(sq);
    return KILN_OK;
}

float kiln_clip_coef(float total_norm, double max_norm) {
    return kiln_adamw_clip_coef(total_norm, (float)max_norm); /* NaN stays NaN */
}

typedef struct scale_ctx {
    kiln_adamw *o;
    float coef;
} scale_ctx;

static void scale_task(void *vctx, int task, int thread) {
    (void)thread;
    scale_ctx *c = vctx;
    const adamw_chunk *ch = &c->o->chunks[task];
    float *g = c->o->p[ch->param].grad + ch->start;
    for (int64_t i = 0; i < ch->len; i++) g[i] = g[i] * c->coef;
}

kiln_status kiln_adamw_clip_grads(kiln_adamw *o, kiln_pool *pool, double max_norm,
                                  float *total_norm, float *coef) {
    if (!o) return kiln_error(KILN_ERR_INVALID_ARG, "adamw: optimizer is NULL");
    if (!(max_norm > 0.0) || !isfinite(max_norm))
        return kiln_error(KILN_ERR_INVALID_ARG, "adamw: max_norm %g must be finite and > 0",
                          max_norm);
    if (o->be) { /* the coefficient stays on the device between the norm and the scaling */
        KILN_TRY(kiln_cuda_adamw_norms(o->be, o->d_table, o->n_params, &o->norm_plan,
                                       o->d_norms, o->d_out, 1, (float)max_norm));
        KILN_TRY(kiln_cuda_adamw_scale(o->be, o->d_table, o->n_params, o->max_n, o->d_out + 2));
        if (total_norm || coef) {
            float h[3];
            KILN_TRY(kiln_backend_download(o->be, h, o->d_out, sizeof h));
            if (total_norm) *total_norm = h[1];
            if (coef) *coef = h[2];
        }
        return KILN_OK;
    }
    float total;
    KILN_TRY(kiln_adamw_grad_norm(o, pool, NULL, &total, NULL));
    scale_ctx c = {o, kiln_clip_coef(total, max_norm)};
    kiln_pool_run(pool, o->n_chunks, scale_task, &c);
    if (total_norm) *total_norm = total;
    if (coef) *coef = c.coef;
    return KILN_OK;
}
