/*
 * adamw.c -- torch.optim.AdamW (single-tensor path) in float32 operation order, with bf16
 * weight storage variants and 8-bit block moments; torch's clip_grad_norm_ arithmetic.
 * The definitions are in docs/ARITHMETIC.md, "AdamW and clipping".
 */
#include "adamw.h"

#include "../base/kmath.h"
#include "../base/tensor.h"

#include <math.h>
#include <stdio.h>
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
    int decay;       /* weight decay applies (before the weight_decay != 0 test) */
    float *m, *v;    /* (n) f32 moments, or NULL */
    int8_t *mq;      /* (n) 8-bit first moment: sign * code, code in [0, 127] */
    uint8_t *vq;     /* (n) 8-bit second moment: code in [0, 255] */
    float *ms, *vs;  /* (n_blocks) absmax of each block of 256 */
    float *master;   /* (n) BF16_MASTER only */
    uint16_t *comp;  /* (n) BF16_KAHAN only: bf16 compensation */
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
    void *state;           /* one allocation holding every state array */
    kiln_adamw_memory mem;
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

typedef struct adamw_scalars {
    float wd_mul;        /* float(1 - lr * weight_decay) */
    int lerp_small;      /* |float(1 - beta1)| < 0.5: torch's lerp branch */
    float lerp_coeff;    /* w or (w - 1) with w = float(1 - beta1) */
    float beta2;         /* float(beta2) */
    float c2;            /* float(1 - beta2) */
    float bc2_sqrt;      /* float(pow(1 - beta2^step, 0.5)) */
    float eps;           /* float(eps) */
    float neg_step_size; /* float(-(lr / (1 - beta1^step))) */
    int use_wd;          /* weight_decay != 0 */
    uint64_t sr_key;     /* mix64(mix64(seed) + step) */
} adamw_scalars;

/* torch's update of one element: param.mul_, exp_avg.lerp_, exp_avg_sq.mul_().addcmul_(),
 * denom = sqrt(v) / bc2_sqrt + eps, param.addcdiv_(m, denom, value=-step_size). */
static inline float adamw_update(const adamw_scalars *s, int decay, float p, float g, float *m,
                                 float *v) {
    if (decay) p = p * s->wd_mul;
    float mm = *m;
    /* lerp(start=mm, end=g, w): w < 0.5 ? fma(w, end - start, start)
     *                                    : fma(w - 1, end - start, end) */
    mm = s->lerp_small ? fmaf(s->lerp_coeff, g - mm, mm) : fmaf(s->lerp_coeff, g - mm, g);
    float vv = *v * s->beta2;
    vv = fmaf(s->c2 * g, g, vv);
    float denom = sqrtf(vv) / s->bc2_sqrt + s->eps;
    p = p + (s->neg_step_size * mm) / denom;
    *m = mm;
    *v = vv;
    return p;
}

static inline uint64_t mix64(uint64_t z) {
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

/* Round x to bf16 stochastically with 16 random bits r: add r to the 16 bits that bf16
 * drops and truncate. |x| rounds away from zero with probability (dropped bits) / 2^16, so
 * the result is one of the two neighbours and its expectation is x. Inf and NaN as RNE. */
static inline uint16_t bf16_stochastic(float x, uint32_t r16) {
    uint32_t u = kiln_f32_bits(x);
    if ((u & 0x7f800000u) == 0x7f800000u) return kiln_fp32_to_bf16(x);
    return (uint16_t)((u + r16) >> 16);
}

/* ---- 8-bit log codes --------------------------------------------------------------------- */

/* 2^(j/8) and the geometric midpoints 2^((j+0.5)/8), j = 0..7, rounded to float. */
static const float q8_level[8] = {1.0f, 1.09050773266525765921f, 1.18920711500272106672f,
                                  1.29683955465100966593f, 1.41421356237309504880f,
                                  1.54221082540794082361f, 1.68179283050742908606f,
                                  1.83400808640934246349f};
static const float q8_mid[8] = {1.04427378242741384032f, 1.13878863475669165370f,
                                1.24185781207348404859f, 1.35425554693689272830f,
                                1.47682614593949931139f, 1.61049033194925430820f,
                                1.75625216037329948312f, 1.91520656139714729387f};

/* Code of r = |x| / absmax in [0, 1] with max_code levels: level L = round(8 log2 r) by
 * exact comparisons with the midpoints, code = max_code + L; below code 1: floor_code (0 for
 * the first moment, where 0 is harmless; 1 for the second moment, so that a nonzero v never
 * becomes 0 and turns the update into m / eps). r == 0 gives 0. */
static inline int q8_code(float r, int max_code, int floor_code) {
    if (!(r > 0.0f)) return 0;
    uint32_t u = kiln_f32_bits(r);
    int e = (int)((u >> 23) & 0xffu);
    if (e == 0) return floor_code; /* subnormal: far below the range */
    float f = kiln_bits_f32((u & 0x7fffffu) | 0x3f800000u); /* [1, 2) */
    int j = 0;
    while (j < 8 && f >= q8_mid[j]) j++;
    int level = 8 * (e - 127) + j;
    int code = max_code + level;
    if (code < 1) return floor_code;
    if (code > max_code) code = max_code; /* r > 1 cannot happen; kept for safety */
    return code;
}

/* absmax * 2^((code - max_code) / 8): the power built exactly, then one multiply. */
static inline float q8_value(int code, int max_code, float absmax) {
    if (code == 0) return 0.0f;
    int level = code - max_code; /* <= 0 */
    int e = -((-level + 7) / 8); /* floor(level / 8) */
    int j = level - 8 * e;       /* 0..7 */
    float pw = kiln_bits_f32((uint32_t)(e + 127) << 23);
    return absmax * (q8_level[j] * pw);
}

static void q8_dequant_block(const int8_t *mq, const uint8_t *vq, float ms, float vs,
                             float *m, float *v, int len) {
    for (int i = 0; i < len; i++) {
        int c = mq[i];
        float a = q8_value(c < 0 ? -c : c, 127, ms);
        m[i] = c < 0 ? -a : a;
        v[i] = q8_value(vq[i], 255, vs);
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
        int c = am > 0.0f ? q8_code(fabsf(m[i]) / am, 127, 0) : 0;
        mq[i] = (int8_t)(m[i] < 0.0f ? -c : c);
        vq[i] = (uint8_t)(av > 0.0f ? q8_code(v[i] / av, 255, 1) : 0);
    }
}

/* ---- create / free ----------------------------------------------------------------------- */

void kiln_adamw_free(kiln_adamw *o) {
    if (!o) return;
    if (o->p)
        for (int i = 0; i < o->n_params; i++) kiln_free(o->p[i].name);
    kiln_free(o->p);
    kiln_free(o->chunks);
    kiln_free(o->bad);
    kiln_free(o->norms);
    kiln_free(o->state);
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

kiln_status kiln_adamw_create(const kiln_adamw_param *params, int n_params,
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
    o->state = kiln_calloc(1, off ? off : 1);
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
            for (int64_t e = 0; e < q->n; e++) s->master[e] = kiln_bf16_to_fp32(w[e]);
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
    *out = o;
    return KILN_OK;
toobig:
    kiln_adamw_free(o);
    return kiln_error(KILN_ERR_INVALID_ARG, "adamw: optimizer state size overflows");
nomem:
    kiln_adamw_free(o);
    return kiln_error(KILN_ERR_NOMEM, "adamw: out of memory for the optimizer state");
}

kiln_status kiln_adamw_create_on(kiln_backend *be, const kiln_adamw_param *params,
                                 int n_params, const kiln_adamw_config *cfg, kiln_adamw **out) {
    if (!be || (be->i && be->i->name && strcmp(be->i->name, "cpu") == 0))
        return kiln_adamw_create(params, n_params, cfg, out);
    if (out) *out = NULL;
    return kiln_error(KILN_ERR_UNSUPPORTED, "adamw: backend '%s' is not supported yet",
                      be->i && be->i->name ? be->i->name : "?");
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
    for (int64_t i = 0; i < ch->len; i++)
        if ((kiln_f32_bits(g[i]) & 0x7f800000u) == 0x7f800000u) {
            bad = ch->start + i;
            break;
        }
    o->bad[task] = bad;
}

kiln_status kiln_adamw_grads_finite(const kiln_adamw *o, kiln_pool *pool) {
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

typedef struct step_ctx {
    kiln_adamw *o;
    adamw_scalars s;
} step_ctx;

/* Update elements [start, start + len) of one parameter whose moments are f32 values m, v
 * (indexed from start). */
static void update_range(const kiln_adamw *o, const adamw_scalars *sc, int pi, int64_t start,
                         int64_t len, float *m, float *v) {
    const adamw_slot *s = &o->p[pi];
    const int decay = s->decay && sc->use_wd;
    const float *g = s->grad + start;
    switch (o->cfg.weights) {
    case KILN_ADAMW_F32: {
        float *w = (float *)s->weights + start;
        for (int64_t i = 0; i < len; i++) w[i] = adamw_update(sc, decay, w[i], g[i], &m[i], &v[i]);
        break;
    }
    case KILN_ADAMW_BF16_MASTER: {
        uint16_t *w = (uint16_t *)s->weights + start;
        float *ma = s->master + start;
        for (int64_t i = 0; i < len; i++) {
            float p = adamw_update(sc, decay, ma[i], g[i], &m[i], &v[i]);
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
            p = adamw_update(sc, decay, p, g[i], &m[i], &v[i]);
            uint16_t nw = kiln_fp32_to_bf16(p);
            w[i] = nw;
            cp[i] = kiln_fp32_to_bf16(p - kiln_bf16_to_fp32(nw));
        }
        break;
    }
    case KILN_ADAMW_BF16_SR: {
        uint16_t *w = (uint16_t *)s->weights + start;
        const uint64_t key = mix64(sc->sr_key + (uint64_t)pi);
        for (int64_t i = 0; i < len; i++) {
            float p = adamw_update(sc, decay, kiln_bf16_to_fp32(w[i]), g[i], &m[i], &v[i]);
            uint64_t e = (uint64_t)(start + i);
            uint32_t r16 = (uint32_t)(mix64(key + e * 0x9E3779B97F4A7C15ull) >> 48);
            w[i] = bf16_stochastic(p, r16);
        }
        break;
    }
    }
}

static void step_task(void *vctx, int task, int thread) {
    (void)thread;
    step_ctx *ctx = vctx;
    kiln_adamw *o = ctx->o;
    const adamw_chunk *ch = &o->chunks[task];
    adamw_slot *s = &o->p[ch->param];
    if (o->cfg.moments == KILN_ADAMW_MOMENTS_F32) {
        update_range(o, &ctx->s, ch->param, ch->start, ch->len, s->m + ch->start,
                     s->v + ch->start);
        return;
    }
    /* 8-bit: dequantize a block, update it in f32, requantize */
    float m[KILN_ADAMW_Q8_BLOCK], v[KILN_ADAMW_Q8_BLOCK];
    for (int64_t b0 = ch->start; b0 < ch->start + ch->len; b0 += KILN_ADAMW_Q8_BLOCK) {
        int len = (int)(s->n - b0 < KILN_ADAMW_Q8_BLOCK ? s->n - b0 : KILN_ADAMW_Q8_BLOCK);
        int64_t b = b0 / KILN_ADAMW_Q8_BLOCK;
        q8_dequant_block(s->mq + b0, s->vq + b0, s->ms[b], s->vs[b], m, v, len);
        update_range(o, &ctx->s, ch->param, b0, len, m, v);
        q8_quant_block(m, v, s->mq + b0, s->vq + b0, &s->ms[b], &s->vs[b], len);
    }
}

kiln_status kiln_adamw_step(kiln_adamw *o, kiln_pool *pool) {
    if (!o) return kiln_error(KILN_ERR_INVALID_ARG, "adamw: optimizer is NULL");
    KILN_TRY(kiln_adamw_grads_finite(o, pool));
    const kiln_adamw_config *c = &o->cfg;
    const int64_t step = o->step + 1;
    /* torch keeps state["step"] as a float32 tensor: exact up to 2^24 */
    const double stepd = (double)step;
    step_ctx ctx;
    memset(&ctx, 0, sizeof ctx);
    ctx.o = o;
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
    s->sr_key = mix64(mix64(c->seed) + (uint64_t)step);
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
    return i >= 0 && i < o->n_params ? o->p[i].master : NULL;
}
const uint16_t *kiln_adamw_compensation(const kiln_adamw *o, int i) {
    return i >= 0 && i < o->n_params ? o->p[i].comp : NULL;
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
        for (int j = 0; j < k; j++) KILN_TRY(write(ctx, ptr[j], (size_t)bytes[j]));
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
        for (int j = 0; j < k; j++) get(&r, ptr[j], (size_t)bytes[j]);
    }
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

/* torch's CPU float32 sum of squares on its AVX2 kernels (8 float lanes):
 *   acc[j] = acc[j] + x*x over full groups of 8, then s = acc[0] + acc[1] + ... + acc[7]
 *   in order, then s = s + x*x for the tail, every product and sum rounded. */
static float torch_sumsq(const float *g, int64_t n) {
    float acc[8] = {0};
    int64_t head = n - n % 8, d = 0;
    for (; d < head; d += 8)
        for (int j = 0; j < 8; j++) acc[j] = acc[j] + g[d + j] * g[d + j];
    float s = acc[0];
    for (int j = 1; j < 8; j++) s = s + acc[j];
    for (; d < n; d++) s = s + g[d] * g[d];
    return s;
}

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
    norm_ctx c = {o, o->norms};
    kiln_pool_run(pool, o->n_params, norm_task, &c);
    float sq = torch_sumsq(o->norms, o->n_params);
    if (norms) memcpy(norms, o->norms, (size_t)o->n_params * sizeof(float));
    if (sq_norm) *sq_norm = sq;
    if (total) *total = sqrtf(sq);
    return KILN_OK;
}

float kiln_clip_coef(float total_norm, double max_norm) {
    float t = total_norm + (float)1e-6;
    float coef = (1.0f / t) * (float)max_norm;
    return coef > 1.0f ? 1.0f : coef; /* NaN stays NaN, as torch.clamp */
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
    float total;
    KILN_TRY(kiln_adamw_grad_norm(o, pool, NULL, &total, NULL));
    scale_ctx c = {o, kiln_clip_coef(total, max_norm)};
    kiln_pool_run(pool, o->n_chunks, scale_task, &c);
    if (total_norm) *total_norm = total;
    if (coef) *coef = c.coef;
    return KILN_OK;
}
