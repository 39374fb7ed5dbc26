/*
 * model_fingerprint.c -- kiln_model_fingerprint: SHA-256 over a model's weights as stored
 * (docs/REPRODUCIBILITY.md, "Fingerprints").
 *
 * The tensors are the roles the model binds (arch.h), named as transformers names them, in
 * the dtype and with the bytes the file holds: a GGUF file's quantized blocks stay blocks, a
 * safetensors file's bf16 stays bf16. Only the row order is made canonical: GGUF "llama" files
 * store Q/K rows permuted for llama.cpp's RoPE, and the fingerprint reads them in Hugging
 * Face's order, so the same weights in an f32 GGUF and an f32 safetensors folder agree.
 * A model made by kiln_model_create has no file: its f32 values are hashed (as an f32 export
 * of it stores them). What the model computes with after load (vectors widened to f32,
 * KILN_WEIGHTS_F32's dequantized matrices) does not enter: the fingerprint names the weights,
 * not how they were opened.
 *
 * Each tensor's bytes are hashed on their own (in parallel, one task per tensor); the
 * fingerprint hashes the sorted list of (name, dtype, shape, tensor hash), so `kiln
 * fingerprint --json` lists everything a third party needs to recompute it.
 */
#include "../base/sha256.h"
#include "../base/threadpool.h"
#include "model.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define FINGERPRINT_MAGIC "kiln-fingerprint-v1\n"

static pthread_mutex_t g_cache_lock = PTHREAD_MUTEX_INITIALIZER;

/* Where one tensor's bytes come from. */
typedef struct fp_source {
    const uint8_t *data; /* the stored bytes (file order) */
    size_t nbytes;
    int permute_heads; /* > 0: rows permuted within this many heads (GGUF llama Q/K) */
    int64_t rows;      /* rows of the stored tensor (elements of a vector) */
    float *owned;      /* values computed for the hash (a created model's plus_one norm) */
} fp_source;

typedef struct fp_walk {
    kiln_model *m;
    kiln_fingerprint_entry *e; /* NULL: count only */
    fp_source *src;
    int n;
    kiln_status task_st; /* the first failure of a hashing task */
    pthread_mutex_t lock;
} fp_walk;

static kiln_status collect_role(void *ctx, const kiln_param_role *r, int layer) {
    fp_walk *w = ctx;
    kiln_model *m = w->m;
    const kiln_wref *ref = kiln_model_ref(m, r, layer);
    if (!ref->mat && !ref->vec) return KILN_OK; /* absent (or the other kind of layer's) */
    int i = w->n++;
    if (!w->e) return KILN_OK;
    kiln_fingerprint_entry *e = &w->e[i];
    fp_source *s = &w->src[i];
    kiln_role_name(r, false, layer, e->name, sizeof e->name);
    e->n_dims = kiln_role_file_shape(r, &m->cfg, e->shape);
    int64_t n = e->shape[0] * e->shape[1] * e->shape[2];
    if (m->gguf || m->st) {
        char fname[128];
        kiln_role_name(r, m->gguf != NULL, layer, fname, sizeof fname);
        const kiln_tensor *t = kiln_model_file_tensor(m, fname);
        if (!t || kiln_tensor_nelements(t) != n)
            return kiln_error(KILN_ERR_INTERNAL,
                              "%s: fingerprint: the tensor of '%s' ('%s') is not the one bound",
                              m->path, e->name, fname);
        e->dtype = t->dtype;
        s->data = t->data;
        s->nbytes = t->nbytes;
        s->rows = e->shape[0];
        if (m->gguf && m->arch->gguf_qk_permuted && r->rope_heads != KILN_DIM_ONE) {
            int64_t heads = kiln_dim_value(&m->cfg, r->rope_heads);
            if (heads <= 0 || s->rows % heads || (s->rows / heads) % 2)
                return kiln_error(
                    KILN_ERR_FORMAT,
                    "%s: fingerprint: '%s' has %lld rows, not %lld heads of even size", m->path,
                    fname, (long long)s->rows, (long long)heads);
            s->permute_heads = (int)heads;
        }
    } else if (ref->mat) { /* kiln_model_create: f32 values */
        e->dtype = ref->mat->dtype;
        s->data = ref->mat->data;
        s->nbytes = ref->mat->nbytes;
    } else {
        e->dtype = KILN_DTYPE_F32;
        s->nbytes = (size_t)n * sizeof(float);
        if (r->plus_one) { /* the parameter w, where the model binds 1 + w */
            KILN_TRY(kiln_alloc_or_fail((void **)&s->owned, s->nbytes, "fingerprint"));
            KILN_TRY(kiln_model_vector_param(m, r, layer, s->owned, n));
            s->data = (const uint8_t *)s->owned;
        } else {
            s->data = (const uint8_t *)ref->vec;
        }
    }
    uint64_t want;
    if (!kiln_dtype_nbytes(e->dtype, (uint64_t)n, &want) || want != s->nbytes)
        return kiln_error(KILN_ERR_INTERNAL,
                          "%s: fingerprint: '%s' holds %zu bytes, not those of %lld %s values",
                          m->path, e->name, s->nbytes, (long long)n, kiln_dtype_name(e->dtype));
    e->nbytes = s->nbytes;
    return KILN_OK;
}

/* SHA-256 of one tensor's bytes (on a pool thread: a failure's message stays there; the
 * caller reports it again), rows in Hugging Face's order: a permuted GGUF tensor's HF row
 * h*HS + half*(HS/2) + i is its stored row h*HS + 2i + half (model_load.c's unpermute_rows). */
static kiln_status hash_source(const fp_source *s, uint8_t out[32]) {
    if (s->permute_heads <= 0) return kiln_sha256(s->data, s->nbytes, out);
    int64_t heads = s->permute_heads, hs = s->rows / heads; /* collect_role checked the split */
    size_t row_bytes = s->nbytes / (size_t)s->rows;
    kiln_sha256_ctx *c = NULL;
    KILN_TRY(kiln_sha256_init(&c));
    kiln_status st = KILN_OK;
    for (int64_t h = 0; h < heads && st == KILN_OK; h++)
        for (int64_t half = 0; half < 2 && st == KILN_OK; half++)
            for (int64_t i = 0; i < hs / 2 && st == KILN_OK; i++)
                st = kiln_sha256_update(c, s->data + (size_t)(h * hs + 2 * i + half) * row_bytes,
                                        row_bytes);
    if (st != KILN_OK) {
        kiln_sha256_free(c);
        return st;
    }
    return kiln_sha256_final(c, out);
}

static void hash_task(void *ctx, int task, int thread) {
    (void)thread;
    fp_walk *w = ctx;
    kiln_status st = hash_source(&w->src[task], w->e[task].sha256);
    if (st != KILN_OK) {
        pthread_mutex_lock(&w->lock);
        if (w->task_st == KILN_OK) w->task_st = st;
        pthread_mutex_unlock(&w->lock);
    }
}

static int entry_cmp(const void *a, const void *b) {
    return strcmp(((const kiln_fingerprint_entry *)a)->name,
                  ((const kiln_fingerprint_entry *)b)->name);
}

static void put_u32(kiln_sha256_ctx *c, uint32_t v, kiln_status *st) {
    uint8_t b[4];
    kiln_put_le32(b, v);
    if (*st == KILN_OK) *st = kiln_sha256_update(c, b, 4);
}

kiln_status kiln_fingerprint_combine(kiln_fingerprint_entry *e, int n, uint8_t fp[32]) {
    if (n < 0 || (n && !e)) return kiln_error(KILN_ERR_INVALID_ARG, "fingerprint: bad tensor list");
    qsort(e, (size_t)n, sizeof *e, entry_cmp);
    for (int i = 1; i < n; i++)
        if (!strcmp(e[i - 1].name, e[i].name))
            return kiln_error(KILN_ERR_INTERNAL, "fingerprint: tensor '%s' listed twice",
                              e[i].name);
    kiln_sha256_ctx *c = NULL;
    KILN_TRY(kiln_sha256_init(&c));
    kiln_status st = kiln_sha256_update(c, FINGERPRINT_MAGIC, strlen(FINGERPRINT_MAGIC));
    put_u32(c, (uint32_t)n, &st);
    for (int i = 0; i < n && st == KILN_OK; i++) {
        const char *dt = kiln_dtype_name(e[i].dtype);
        st = kiln_sha256_update(c, e[i].name, strlen(e[i].name) + 1);
        if (st == KILN_OK) st = kiln_sha256_update(c, dt, strlen(dt) + 1);
        put_u32(c, (uint32_t)e[i].n_dims, &st);
        for (int k = 0; k < e[i].n_dims && st == KILN_OK; k++) {
            uint8_t b[8];
            kiln_put_le64(b, (uint64_t)e[i].shape[k]);
            st = kiln_sha256_update(c, b, 8);
        }
        if (st == KILN_OK) st = kiln_sha256_update(c, e[i].sha256, 32);
    }
    if (st != KILN_OK) {
        kiln_sha256_free(c);
        return st;
    }
    return kiln_sha256_final(c, fp);
}

kiln_status kiln_model_fingerprint_tensors(const kiln_model *cm, uint8_t fp[32],
                                           kiln_fingerprint_entry **entries, int *n_entries) {
    /* the walk reads the model only (kiln_model_vector_param and kiln_model_ref take it
     * non-const for their other callers) */
    kiln_model *m = (kiln_model *)cm;
    fp_walk w;
    memset(&w, 0, sizeof w);
    w.m = m;
    KILN_TRY(kiln_arch_walk(m->arch, m->cfg.n_layer, collect_role, &w));
    int n = w.n;
    w.e = kiln_calloc((size_t)(n ? n : 1), sizeof *w.e);
    w.src = kiln_calloc((size_t)(n ? n : 1), sizeof *w.src);
    kiln_status st =
        w.e && w.src ? KILN_OK
                     : kiln_error(KILN_ERR_NOMEM, "%s: out of memory for the fingerprint", m->path);
    w.n = 0;
    if (st == KILN_OK) st = kiln_arch_walk(m->arch, m->cfg.n_layer, collect_role, &w);
    if (st == KILN_OK && w.n != n)
        st = kiln_error(KILN_ERR_INTERNAL, "fingerprint: the roles changed between walks");
    kiln_pool *pool = NULL;
    if (st == KILN_OK) st = kiln_pool_create(m->params.n_threads, &pool);
    if (st == KILN_OK) {
        pthread_mutex_init(&w.lock, NULL);
        w.task_st = KILN_OK;
        kiln_pool_run(pool, n, hash_task, &w);
        pthread_mutex_destroy(&w.lock);
        st = w.task_st;
        if (st != KILN_OK)
            st = kiln_error(st, "%s: fingerprint: hashing a tensor failed (libcrypto)", m->path);
    }
    kiln_pool_free(pool);
    if (st == KILN_OK) st = kiln_fingerprint_combine(w.e, n, fp);
    for (int i = 0; w.src && i < n; i++)
        kiln_free(w.src[i].owned);
    kiln_free(w.src);
    if (st == KILN_OK && entries) {
        *entries = w.e;
        *n_entries = n;
    } else {
        kiln_free(w.e);
    }
    return st;
}

KILN_API kiln_status kiln_model_fingerprint(const kiln_model *m, uint8_t out[32]) {
    KILN_TRY(kiln_handle_check(m, KILN_HANDLE_MODEL, "kiln_model_fingerprint"));
    KILN_TRY(kiln_model_weights_check(m, "kiln_model_fingerprint"));
    if (!out) return kiln_error(KILN_ERR_INVALID_ARG, "kiln_model_fingerprint: out is NULL");
    kiln_model *mm = (kiln_model *)m; /* the cache: a value of the immutable weights */
    pthread_mutex_lock(&g_cache_lock);
    int done = mm->fingerprint_done;
    if (done) memcpy(out, mm->fingerprint, 32);
    pthread_mutex_unlock(&g_cache_lock);
    if (done) return KILN_OK;
    uint8_t fp[32];
    KILN_TRY(kiln_model_fingerprint_tensors(m, fp, NULL, NULL));
    pthread_mutex_lock(&g_cache_lock);
    memcpy(mm->fingerprint, fp, 32);
    mm->fingerprint_done = 1;
    pthread_mutex_unlock(&g_cache_lock);
    memcpy(out, fp, 32);
    return KILN_OK;
}
