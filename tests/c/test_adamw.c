/* test_adamw.c -- kiln's AdamW: storage variants, describe() memory, save/restore (resume
 * equals not stopping, bit for bit), refused restores, thread-count invariance, non-finite
 * gradients refused before anything changes, weight-decay exclusions, the stochastic rounding
 * rule. Parity with torch is tests/python/test_adamw.py. */
#include "base/base.h"
#include "base/kmath.h"
#include "base/tensor.h"
#include "base/threadpool.h"
#include "test_util.h"
#include "train/adamw.h"

#include <math.h>

#define NP 4
static const char *NAMES[NP] = {"model.layers.0.mlp.up_proj.weight", "model.layers.0.mlp.up_proj.bias",
                                "model.layers.0.post_attention_layernorm.weight", "lm_head.weight"};
static const int64_t SIZES[NP] = {40000, 300, 257, 16385}; /* > one chunk; odd block tails */

typedef struct model {
    void *w[NP];
    float *g[NP];
    kiln_adamw_param p[NP];
    int bf16;
} model;

static uint64_t rng_next(uint64_t *s) {
    *s = *s * 6364136223846793005ull + 1442695040888963407ull;
    return *s >> 11;
}
static float rng_normalish(uint64_t *s) { /* sum of uniforms, mean 0 */
    float a = 0;
    for (int k = 0; k < 4; k++) a += (float)((double)rng_next(s) / 9007199254740992.0) - 0.5f;
    return a;
}

static void model_init(model *m, int bf16, uint64_t seed) {
    m->bf16 = bf16;
    uint64_t s = seed;
    for (int i = 0; i < NP; i++) {
        size_t n = (size_t)SIZES[i];
        m->w[i] = calloc(n, bf16 ? 2 : 4);
        m->g[i] = calloc(n, 4);
        for (size_t e = 0; e < n; e++) {
            float x = rng_normalish(&s);
            if (bf16) ((uint16_t *)m->w[i])[e] = kiln_fp32_to_bf16(x);
            else ((float *)m->w[i])[e] = x;
        }
        m->p[i].name = NAMES[i];
        m->p[i].n = SIZES[i];
        m->p[i].weights = m->w[i];
        m->p[i].grad = m->g[i];
        m->p[i].w16 = NULL;
    }
}

static void model_copy_weights(model *dst, const model *src) {
    for (int i = 0; i < NP; i++)
        memcpy(dst->w[i], src->w[i], (size_t)SIZES[i] * (src->bf16 ? 2 : 4));
}

static int model_same(const model *a, const model *b) {
    for (int i = 0; i < NP; i++)
        if (memcmp(a->w[i], b->w[i], (size_t)SIZES[i] * (a->bf16 ? 2 : 4)) != 0) return 0;
    return 1;
}

static void model_free(model *m) {
    for (int i = 0; i < NP; i++) {
        free(m->w[i]);
        free(m->g[i]);
    }
}

/* gradients of step t: a pure function of t */
static void set_grads(model *m, int t) {
    uint64_t s = 1000 + (uint64_t)t;
    for (int i = 0; i < NP; i++)
        for (int64_t e = 0; e < SIZES[i]; e++) m->g[i][e] = rng_normalish(&s) * (0.1f + 0.2f * (float)i);
}

typedef struct membuf {
    uint8_t *p;
    size_t n, cap;
} membuf;

static kiln_status mem_write(void *ctx, const void *data, size_t n) {
    membuf *b = ctx;
    if (b->n + n > b->cap) {
        size_t cap = (b->n + n) * 2;
        uint8_t *q = realloc(b->p, cap);
        if (!q) return KILN_ERR_NOMEM;
        b->p = q;
        b->cap = cap;
    }
    memcpy(b->p + b->n, data, n);
    b->n += n;
    return KILN_OK;
}

static membuf save(const kiln_adamw *o) {
    membuf b = {0};
    CHECK(kiln_adamw_save(o, mem_write, &b) == KILN_OK);
    CHECK(b.n == kiln_adamw_state_size(o));
    return b;
}

static kiln_adamw_config cfg_of(kiln_adamw_weights w, kiln_adamw_moments mo) {
    kiln_adamw_config c = kiln_adamw_default_config();
    c.weights = w;
    c.moments = mo;
    c.lr = 3e-3;
    c.weight_decay = 0.1;
    c.seed = 77;
    return c;
}

static void test_default_decay(void) {
    CHECK(kiln_adamw_default_decay("model.layers.0.self_attn.q_proj.weight") == 1);
    CHECK(kiln_adamw_default_decay("model.layers.0.self_attn.q_proj.bias") == 0);
    CHECK(kiln_adamw_default_decay("model.layers.0.input_layernorm.weight") == 0);
    CHECK(kiln_adamw_default_decay("model.layers.0.post_attention_layernorm.weight") == 0);
    CHECK(kiln_adamw_default_decay("model.norm.weight") == 0);
    CHECK(kiln_adamw_default_decay("model.layers.0.self_attn.q_norm.weight") == 0);
    CHECK(kiln_adamw_default_decay("model.layers.0.self_attn.k_norm.weight") == 0);
    CHECK(kiln_adamw_default_decay("transformer.ln_f.RMSNorm.weight") == 0);
    CHECK(kiln_adamw_default_decay("model.embed_tokens.weight") == 1);
    CHECK(kiln_adamw_default_decay("model.normalizer.weight") == 1); /* not "(^|.)norm($|.)" */
    CHECK(kiln_adamw_default_decay("lm_head.weight") == 1);
}

static void test_describe_memory(void) {
    model m;
    model_init(&m, 1, 5);
    uint64_t n = 0, nb = 0;
    for (int i = 0; i < NP; i++) {
        n += (uint64_t)SIZES[i];
        nb += (uint64_t)((SIZES[i] + 255) / 256);
    }
    for (int w = 0; w < 4; w++)
        for (int mo = 0; mo < 2; mo++) {
            if (w == 0) continue; /* m holds bf16 weights */
            kiln_adamw_config c = cfg_of((kiln_adamw_weights)w, (kiln_adamw_moments)mo);
            kiln_mem_stats before, after;
            kiln_mem_get_stats(&before);
            kiln_adamw *o = NULL;
            CHECK(kiln_adamw_create(m.p, NP, &c, &o) == KILN_OK);
            kiln_mem_get_stats(&after);
            kiln_adamw_memory mem;
            char buf[512];
            kiln_adamw_describe(o, buf, sizeof buf, &mem);
            printf("%s\n", buf);
            CHECK(mem.params == 2 * n);
            CHECK(mem.moments == (mo ? 2 * n + 8 * nb : 8 * n));
            CHECK(mem.master == (w == KILN_ADAMW_BF16_MASTER ? 4 * n : 0));
            CHECK(mem.compensation == (w == KILN_ADAMW_BF16_KAHAN ? 2 * n : 0));
            CHECK(mem.owned == mem.master + mem.moments + mem.compensation);
            /* kiln's own accounting: the state plus small bookkeeping (names, chunk table,
             * alignment) */
            size_t grown = after.live_bytes - before.live_bytes;
            CHECK_MSG(grown >= mem.owned && grown <= mem.owned + 8192, "grown %zu owned %llu",
                      grown, (unsigned long long)mem.owned);
            kiln_adamw_free(o);
        }
    model_free(&m);
}

/* Run 3 steps, save, 3 more; a second optimizer restores the state (and the weights of
 * step 3) and runs the same 3: identical weights and state bytes. */
static void test_resume(kiln_adamw_weights w, kiln_adamw_moments mo, kiln_pool *pool) {
    model a, b;
    int bf16 = w != KILN_ADAMW_F32;
    model_init(&a, bf16, 11);
    model_init(&b, bf16, 12); /* different weights: the restore must not depend on them */
    kiln_adamw_config c = cfg_of(w, mo);
    kiln_adamw *oa = NULL, *ob = NULL;
    CHECK(kiln_adamw_create(a.p, NP, &c, &oa) == KILN_OK);
    for (int t = 0; t < 3; t++) {
        set_grads(&a, t);
        kiln_adamw_set_lr(oa, 3e-3 * (1 + t));
        CHECK(kiln_adamw_step(oa, pool) == KILN_OK);
    }
    membuf st = save(oa);
    model_copy_weights(&b, &a);
    for (int t = 3; t < 6; t++) {
        set_grads(&a, t);
        kiln_adamw_set_lr(oa, 3e-3 * (1 + t));
        CHECK(kiln_adamw_step(oa, pool) == KILN_OK);
    }
    CHECK(kiln_adamw_create(b.p, NP, &c, &ob) == KILN_OK);
    CHECK(kiln_adamw_load(ob, st.p, st.n) == KILN_OK);
    CHECK(kiln_adamw_get_step(ob) == 3);
    for (int t = 3; t < 6; t++) {
        set_grads(&b, t);
        kiln_adamw_set_lr(ob, 3e-3 * (1 + t));
        CHECK(kiln_adamw_step(ob, pool) == KILN_OK);
    }
    CHECK_MSG(model_same(&a, &b), "resume differs: weights %d moments %d", (int)w, (int)mo);
    membuf sa = save(oa), sb = save(ob);
    CHECK(sa.n == sb.n && memcmp(sa.p, sb.p, sa.n) == 0);
    free(sa.p);
    free(sb.p);

    /* refused restores leave everything as it was */
    membuf before = save(ob);
    kiln_adamw_config other = cfg_of(w, mo == KILN_ADAMW_MOMENTS_F32 ? KILN_ADAMW_MOMENTS_Q8
                                                                       : KILN_ADAMW_MOMENTS_F32);
    kiln_adamw *oc = NULL;
    CHECK(kiln_adamw_create(b.p, NP, &other, &oc) == KILN_OK);
    CHECK_ERR(kiln_adamw_load(oc, st.p, st.n), KILN_ERR_STATE, "saved with storage");
    kiln_adamw_free(oc);
    uint8_t *bad = malloc(st.n);
    memcpy(bad, st.p, st.n);
    CHECK_ERR(kiln_adamw_load(ob, bad, st.n - 1), KILN_ERR_FORMAT, "adamw state");
    bad[0] = 'X';
    CHECK_ERR(kiln_adamw_load(ob, bad, st.n), KILN_ERR_FORMAT, "bad magic");
    bad[0] = st.p[0];
    bad[80 + 4 + 6] ^= 1; /* first parameter's name */
    CHECK_ERR(kiln_adamw_load(ob, bad, st.n), KILN_ERR_STATE, "parameter 0 is");
    bad[80 + 4 + 6] ^= 1;
    memcpy(bad + st.n - 8, "ADMWENX", 8);
    CHECK_ERR(kiln_adamw_load(ob, bad, st.n), KILN_ERR_FORMAT, "end marker");
    free(bad);
    membuf after = save(ob);
    CHECK(before.n == after.n && memcmp(before.p, after.p, before.n) == 0);
    free(before.p);
    free(after.p);
    free(st.p);
    kiln_adamw_free(oa);
    kiln_adamw_free(ob);
    model_free(&a);
    model_free(&b);
}

static void test_mismatched_params(void) {
    model a;
    model_init(&a, 0, 3);
    kiln_adamw_config c = cfg_of(KILN_ADAMW_F32, KILN_ADAMW_MOMENTS_F32);
    kiln_adamw *o = NULL, *o2 = NULL;
    CHECK(kiln_adamw_create(a.p, NP, &c, &o) == KILN_OK);
    membuf st = save(o);
    kiln_adamw_param p2[NP];
    memcpy(p2, a.p, sizeof p2);
    p2[3].n = SIZES[3] - 1;
    CHECK(kiln_adamw_create(p2, NP, &c, &o2) == KILN_OK);
    CHECK_ERR(kiln_adamw_load(o2, st.p, st.n), KILN_ERR_STATE, "'lm_head.weight' has 16385");
    kiln_adamw_free(o2);
    CHECK(kiln_adamw_create(a.p, NP - 1, &c, &o2) == KILN_OK);
    CHECK_ERR(kiln_adamw_load(o2, st.p, st.n), KILN_ERR_STATE, "4 parameters");
    kiln_adamw_free(o2);
    p2[3].n = SIZES[3];
    p2[1].name = p2[0].name;
    CHECK_ERR(kiln_adamw_create(p2, NP, &c, &o2), KILN_ERR_INVALID_ARG, "listed twice");
    free(st.p);
    kiln_adamw_free(o);
    model_free(&a);
}

/* Two optimizers on the same model and gradients for 4 clipped steps, A on the calling thread
 * and the CPU's best SIMD path, B on pool_b and, with b_portable, KILN_CPU_PATH=portable (the
 * plain element loop: fmaf through libm, no vectors), or with be_b on that backend's AdamW
 * ops (kiln_adamw_create_on): the same clip, weights and state bytes. */
static void same_as_other_run(kiln_adamw_weights w, kiln_adamw_moments mo, kiln_pool *pool_b,
                              int b_portable, kiln_backend *be_b, const char *what) {
    model a, b;
    int bf16 = w != KILN_ADAMW_F32;
    model_init(&a, bf16, 21);
    model_init(&b, bf16, 21);
    kiln_adamw_config c = cfg_of(w, mo);
    kiln_adamw *oa = NULL, *ob = NULL;
    CHECK(kiln_adamw_create(a.p, NP, &c, &oa) == KILN_OK);
    if (be_b)
        CHECK(kiln_adamw_create_on(be_b, b.p, NP, &c, &ob) == KILN_OK);
    else
        CHECK(kiln_adamw_create(b.p, NP, &c, &ob) == KILN_OK);
    const char *env = getenv("KILN_CPU_PATH");
    char saved[32] = "";
    if (env) snprintf(saved, sizeof saved, "%s", env);
    for (int t = 0; t < 4; t++) {
        float ta, tb, ca, cb;
        set_grads(&a, t);
        set_grads(&b, t);
        CHECK(kiln_adamw_clip_grads(oa, NULL, 5.0, &ta, &ca) == KILN_OK);
        CHECK(kiln_adamw_clip_grads(ob, pool_b, 5.0, &tb, &cb) == KILN_OK);
        CHECK(kiln_f32_bits(ta) == kiln_f32_bits(tb) && kiln_f32_bits(ca) == kiln_f32_bits(cb));
        CHECK(ca < 1.0f);
        unsetenv("KILN_CPU_PATH");
        CHECK(kiln_adamw_step(oa, NULL) == KILN_OK);
        if (b_portable) setenv("KILN_CPU_PATH", "portable", 1);
        CHECK(kiln_adamw_step(ob, pool_b) == KILN_OK);
    }
    if (env) setenv("KILN_CPU_PATH", saved, 1);
    else unsetenv("KILN_CPU_PATH");
    CHECK_MSG(model_same(&a, &b), "%s changed weights %d moments %d", what, (int)w, (int)mo);
    membuf sa = save(oa), sb = save(ob);
    CHECK(sa.n == sb.n && memcmp(sa.p, sb.p, sa.n) == 0);
    free(sa.p);
    free(sb.p);
    kiln_adamw_free(oa);
    kiln_adamw_free(ob);
    model_free(&a);
    model_free(&b);
}

static void test_nonfinite(void) {
    model a;
    model_init(&a, 1, 31);
    kiln_adamw_config c = cfg_of(KILN_ADAMW_BF16_MASTER, KILN_ADAMW_MOMENTS_Q8);
    kiln_adamw *o = NULL;
    CHECK(kiln_adamw_create(a.p, NP, &c, &o) == KILN_OK);
    set_grads(&a, 0);
    CHECK(kiln_adamw_step(o, NULL) == KILN_OK);
    membuf before = save(o);
    model snap;
    model_init(&snap, 1, 0);
    model_copy_weights(&snap, &a);
    set_grads(&a, 1);
    a.g[2][5] = NAN;
    a.g[3][9] = INFINITY;
    CHECK_ERR(kiln_adamw_grads_finite(o, NULL), KILN_ERR_RANGE,
              "'model.layers.0.post_attention_layernorm.weight' is not finite at element 5");
    CHECK_ERR(kiln_adamw_step(o, NULL), KILN_ERR_RANGE, "post_attention_layernorm.weight");
    a.g[2][5] = 0.0f;
    CHECK_ERR(kiln_adamw_step(o, NULL), KILN_ERR_RANGE, "'lm_head.weight' is not finite at element 9");
    CHECK(model_same(&a, &snap));
    CHECK(kiln_adamw_get_step(o) == 1);
    membuf after = save(o);
    CHECK(before.n == after.n && memcmp(before.p, after.p, before.n) == 0);
    a.g[3][9] = 1.0f;
    CHECK(kiln_adamw_grads_finite(o, NULL) == KILN_OK);
    free(before.p);
    free(after.p);
    kiln_adamw_free(o);
    model_free(&a);
    model_free(&snap);
}

static void test_decay_map(void) {
    /* one element per parameter, grad 0: the step changes a weight only through decay */
    float w[3] = {1.0f, 1.0f, 1.0f}, g[3] = {0, 0, 0};
    kiln_adamw_param p[3] = {{"a.weight", 1, &w[0], &g[0], NULL},
                             {"a.bias", 1, &w[1], &g[1], NULL},
                             {"b.weight", 1, &w[2], &g[2], NULL}};
    kiln_adamw_decay_rule map[2] = {{"a.bias", 1}, {"b.weight", 0}};
    kiln_adamw_config c = cfg_of(KILN_ADAMW_F32, KILN_ADAMW_MOMENTS_F32);
    c.decay_map = map;
    c.n_decay_map = 2;
    kiln_adamw *o = NULL;
    CHECK(kiln_adamw_create(p, 3, &c, &o) == KILN_OK);
    CHECK(kiln_adamw_param_decays(o, 0) == 1 && kiln_adamw_param_decays(o, 1) == 1 &&
          kiln_adamw_param_decays(o, 2) == 0);
    CHECK(kiln_adamw_step(o, NULL) == KILN_OK);
    float decayed = 1.0f * (float)(1.0 - 3e-3 * 0.1);
    CHECK(w[0] == decayed && w[1] == decayed && w[2] == 1.0f);
    kiln_adamw_free(o);
    map[1].name = "c.weight";
    CHECK_ERR(kiln_adamw_create(p, 3, &c, &o), KILN_ERR_INVALID_ARG, "'c.weight'");
    c.decay_map = NULL;
    c.n_decay_map = 0;
    CHECK(kiln_adamw_create(p, 3, &c, &o) == KILN_OK);
    CHECK(kiln_adamw_param_decays(o, 1) == 0); /* Trainer default: biases excluded */
    kiln_adamw_free(o);
    c.beta1 = 1.0;
    CHECK_ERR(kiln_adamw_create(p, 3, &c, &o), KILN_ERR_INVALID_ARG, "betas");
}

/* Stochastic rounding: every element has the same weight and gradient, so every element's
 * f32 update p is the same; each bf16 result is one of p's two neighbours, and the share
 * rounded up matches (p - lo) / (hi - lo). */
static void test_sr_rule(kiln_pool *pool) {
    enum { N = 200000 };
    uint16_t *w = malloc(N * 2);
    float *g = malloc(N * 4);
    float wf = 0.7f, gf = 0.3f;
    for (int i = 0; i < N; i++) {
        w[i] = kiln_fp32_to_bf16(0.71875f);
        g[i] = gf;
    }
    wf = 0.71875f;
    kiln_adamw_param p = {"x.weight", N, w, g, NULL};
    kiln_adamw_param pf = {"x.weight", 1, &wf, &gf, NULL};
    kiln_adamw_config c = cfg_of(KILN_ADAMW_BF16_SR, KILN_ADAMW_MOMENTS_F32);
    c.lr = 1e-3; /* far below the bf16 spacing 2^-8 at 0.72 */
    kiln_adamw_config cf = cfg_of(KILN_ADAMW_F32, KILN_ADAMW_MOMENTS_F32);
    cf.lr = 1e-3;
    kiln_adamw *o = NULL, *of = NULL;
    CHECK(kiln_adamw_create(&p, 1, &c, &o) == KILN_OK);
    CHECK(kiln_adamw_create(&pf, 1, &cf, &of) == KILN_OK);
    CHECK(kiln_adamw_step(o, pool) == KILN_OK);
    CHECK(kiln_adamw_step(of, NULL) == KILN_OK);
    float lo = kiln_bf16_to_fp32((uint16_t)(kiln_f32_bits(wf) >> 16));
    float hi = kiln_bf16_to_fp32((uint16_t)((kiln_f32_bits(wf) >> 16) + 1));
    int n_hi = 0, n_other = 0;
    for (int i = 0; i < N; i++) {
        float x = kiln_bf16_to_fp32(w[i]);
        if (x == hi) n_hi++;
        else if (x != lo) n_other++;
    }
    double frac = (double)(wf - lo) / (double)(hi - lo);
    double share = (double)n_hi / N, sigma = sqrt(frac * (1 - frac) / N);
    printf("SR rule: f32 update %.9g between %.9g and %.9g: expected share up %.5f, got %.5f "
           "(sigma %.5f)\n", wf, lo, hi, frac, share, sigma);
    CHECK(n_other == 0);
    CHECK(frac > 0.01 && frac < 0.99);
    CHECK(fabs(share - frac) < 5 * sigma + 1.0 / 65536);
    kiln_adamw_free(o);
    kiln_adamw_free(of);
    free(w);
    free(g);
}

static void test_clip_coef(void) {
    CHECK(kiln_clip_coef(0.0f, 1.0) == 1.0f);
    CHECK(kiln_clip_coef(4.0f, 1.0) == (1.0f / (4.0f + (float)1e-6)) * 1.0f);
    CHECK(isnan(kiln_clip_coef(NAN, 1.0)));
    float g[20];
    for (int i = 0; i < 20; i++) g[i] = (float)i * 0.25f - 2.0f;
    double exact = 0;
    for (int i = 0; i < 20; i++) exact += (double)g[i] * g[i];
    CHECK(fabs(kiln_grad_norm_torch(g, 20) - sqrt(exact)) < 1e-5);
}

/* A backend whose table has no AdamW ops: refused. */
static void test_no_ops(kiln_backend *cpu) {
    model a;
    model_init(&a, 0, 5);
    kiln_adamw_config c = cfg_of(KILN_ADAMW_F32, KILN_ADAMW_MOMENTS_F32);
    kiln_backend_i no_ops = *cpu->i;
    no_ops.adamw_step = NULL;
    kiln_backend without = *cpu;
    without.i = &no_ops;
    kiln_adamw *o = NULL;
    CHECK_ERR(kiln_adamw_create_on(&without, a.p, NP, &c, &o), KILN_ERR_UNSUPPORTED,
              "no AdamW ops");
    CHECK(o == NULL);
    model_free(&a);
}

/* The 8-lane sum of squares fed in pieces (data-parallel ranks cut a tensor anywhere) has the
 * bits of the whole tensor at once, for every length around the groups of 8 and random cuts;
 * and an empty optimizer does nothing and says so. */
static void test_sumsq8_pieces(void) {
    uint64_t rs = 77;
    float g[300];
    for (int i = 0; i < 300; i++) g[i] = rng_normalish(&rs) * (i % 7 == 0 ? 1e3f : 1.0f);
    int bad = 0;
    for (int64_t n = 1; n <= 300; n += (n < 40 ? 1 : 13)) {
        const float want = kiln_adamw_sumsq8(g, n);
        for (int trial = 0; trial < 20; trial++) {
            kiln_sumsq8_state st;
            kiln_sumsq8_begin(&st);
            for (int64_t e = 0; e < n;) {
                int64_t len = 1 + (int64_t)(rng_next(&rs) % (uint64_t)(trial < 10 ? 9 : n));
                if (len > n - e) len = n - e;
                kiln_sumsq8_feed(&st, g + e, e, len, n);
                e += len;
            }
            bad += memcmp(&st.sum, &want, sizeof want) != 0;
        }
    }
    CHECK_MSG(bad == 0, "%d split sums differ from kiln_adamw_sumsq8", bad);
    kiln_adamw_config c = cfg_of(KILN_ADAMW_BF16_MASTER, KILN_ADAMW_MOMENTS_F32);
    kiln_adamw *o = NULL;
    CHECK(kiln_adamw_create_empty(NULL, &c, &o) == KILN_OK);
    float total = -1.0f, coef = -1.0f;
    kiln_adamw_memory mem;
    kiln_adamw_describe(o, NULL, 0, &mem);
    CHECK(mem.owned == 0 && mem.params == 0);
    CHECK(kiln_adamw_grads_finite(o, NULL) == KILN_OK);
    CHECK(kiln_adamw_grad_norm(o, NULL, NULL, &total, NULL) == KILN_OK && total == 0.0f);
    CHECK(kiln_adamw_clip_grads(o, NULL, 1.0, &total, &coef) == KILN_OK && total == 0.0f && coef == 1.0f);
    CHECK(kiln_adamw_step(o, NULL) == KILN_OK && kiln_adamw_get_step(o) == 1);
    CHECK(kiln_adamw_state_f32(o, 0, 0) == NULL);
    kiln_adamw_free(o);
}

int main(void) {
    kiln_pool *pool3 = NULL;
    CHECK(kiln_pool_create(3, &pool3) == KILN_OK);
    kiln_backend *cpu = NULL;
    CHECK(kiln_backend_cpu_create(2, &cpu) == KILN_OK);
    test_default_decay();
    test_describe_memory();
    for (int w = 0; w < 4; w++)
        for (int mo = 0; mo < 2; mo++) {
            test_resume((kiln_adamw_weights)w, (kiln_adamw_moments)mo, pool3);
            same_as_other_run((kiln_adamw_weights)w, (kiln_adamw_moments)mo, pool3, 0, NULL,
                              "the thread count");
            same_as_other_run((kiln_adamw_weights)w, (kiln_adamw_moments)mo, NULL, 1, NULL,
                              "the portable element loop");
            same_as_other_run((kiln_adamw_weights)w, (kiln_adamw_moments)mo, NULL, 0, cpu,
                              "the CPU backend's ops");
        }
    test_no_ops(cpu);
    test_mismatched_params();
    test_nonfinite();
    test_decay_map();
    test_sr_rule(pool3);
    test_clip_coef();
    test_sumsq8_pieces();
    kiln_pool_free(pool3);
    kiln_backend_free(cpu);
    return test_finish("test_adamw");
}
