/*
 * test_forward_devsim.c -- the forward's memory contract without a GPU: a simulated device
 * backend ("devsim") wraps the CPU backend's ops but keeps a registry of the buffers its
 * alloc handed out, and counts every float * an op receives that is not inside one (a host
 * norm weight, bias or rope table that never went through kiln_backend_alloc/upload; the
 * case a real GPU would fault on or read garbage from), every upload/download outside them,
 * and allocations left at the end. The forward on devsim takes the device path (forward
 * state in backend memory, weight vectors uploaded, logits in a backend buffer) and its
 * logits must be bit-identical to a CPU context's. Runs in every CUDA-enabled build (no GPU
 * needed); skipped (77) when the vocabulary files are not found.
 */
#include "base/base.h"
#include "base/tensor.h"
#include "generate/generate.h"
#include "models/model.h"

#include <kiln.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- the simulated device backend ---------------------------------------------------------- */

#define MAX_BUFS 64
static struct {
    char *p;
    size_t n;
} g_bufs[MAX_BUFS];
static int g_n_bufs, g_violations;
static kiln_backend *g_cpu;

static int in_dev(const void *p, size_t nbytes) {
    const char *c = p;
    for (int i = 0; i < g_n_bufs; i++)
        if (c >= g_bufs[i].p && c + nbytes <= g_bufs[i].p + g_bufs[i].n) return 1;
    return 0;
}
static void need(const void *p, size_t nbytes, const char *what) {
    if (!p || in_dev(p, nbytes)) return;
    if (g_violations++ < 10) fprintf(stderr, "violation: %s (%zu bytes) is not backend memory\n", what, nbytes);
}
#define F(n) ((size_t)(n) * sizeof(float))

static void ds_embed(kiln_backend *be, float *out, const kiln_tensor *t, const int32_t *ids, int N) {
    (void)be;
    need(out, F((size_t)N * t->shape[1]), "embed out");
    g_cpu->i->embed(g_cpu, out, t, ids, N);
}
static void ds_rmsnorm(kiln_backend *be, float *out, const float *x, const float *w, int N, int C,
                       float eps) {
    (void)be;
    need(out, F((size_t)N * C), "rmsnorm out");
    need(x, F((size_t)N * C), "rmsnorm x");
    need(w, F(C), "rmsnorm weight");
    g_cpu->i->rmsnorm(g_cpu, out, x, w, N, C, eps);
}
static void ds_matmul(kiln_backend *be, float *out, const float *x, const kiln_tensor *W,
                      const float *bias, int N) {
    (void)be;
    need(out, F((size_t)N * W->shape[0]), "matmul out");
    need(x, F((size_t)N * W->shape[1]), "matmul x");
    need(bias, F(W->shape[0]), "matmul bias");
    g_cpu->i->matmul(g_cpu, out, x, W, bias, N);
}
static void ds_rope(kiln_backend *be, float *x, const int32_t *pos, int N, int H, int HS,
                    const float *cs, const float *sn) {
    (void)be;
    need(x, F((size_t)N * H * HS), "rope x");
    int maxp = 0;
    for (int n = 0; n < N; n++) maxp = pos[n] > maxp ? pos[n] : maxp;
    need(cs, F((size_t)(maxp + 1) * HS / 2), "rope cos table");
    need(sn, F((size_t)(maxp + 1) * HS / 2), "rope sin table");
    g_cpu->i->rope(g_cpu, x, pos, N, H, HS, cs, sn);
}
static void ds_attention(kiln_backend *be, float *out, const float *q, const float *k,
                         const float *v, int N, int n_past, int NH, int KVH, int HS, float scale,
                         int window) {
    (void)be;
    need(out, F((size_t)N * NH * HS), "attention out");
    need(q, F((size_t)N * NH * HS), "attention q");
    need(k, F((size_t)(n_past + N) * KVH * HS), "attention k");
    need(v, F((size_t)(n_past + N) * KVH * HS), "attention v");
    g_cpu->i->attention(g_cpu, out, q, k, v, N, n_past, NH, KVH, HS, scale, window);
}
static void ds_kv_store_rows(kiln_backend *be, float *kp, float *vp, const float *kr, const float *vr,
                             const int32_t *slots, int N, size_t row) {
    (void)be;
    need(slots, sizeof(int32_t) * (size_t)N, "kv_store_rows slots");
    need(kr, F((size_t)N * row), "kv_store_rows k rows");
    need(vr, F((size_t)N * row), "kv_store_rows v rows");
    for (int n = 0; n < N; n++) {
        need(kp + (size_t)slots[n] * row, F(row), "kv_store_rows k pool row");
        need(vp + (size_t)slots[n] * row, F(row), "kv_store_rows v pool row");
    }
    g_cpu->i->kv_store_rows(g_cpu, kp, vp, kr, vr, slots, N, row);
}
static void ds_attention_paged(kiln_backend *be, float *out, const float *q, const float *kp,
                               const float *vp, const kiln_kv_pages *pg, const int32_t *seq,
                               const int32_t *pos, const kiln_batch_run *runs, int n_runs, int N,
                               int max_T, int NH, int KVH, int HS, float scale, int window) {
    (void)be;
    need(out, F((size_t)N * NH * HS), "attention_paged out");
    need(q, F((size_t)N * NH * HS), "attention_paged q");
    need(seq, sizeof(int32_t) * (size_t)N, "attention_paged seq");
    need(pos, sizeof(int32_t) * (size_t)N, "attention_paged pos");
    need(pg->block_table, sizeof(int32_t), "attention_paged block table");
    for (int n = 0; n < N; n++) {
        int32_t row = pg->block_table[(size_t)seq[n] * pg->max_blocks] * pg->block_size;
        need(kp + (size_t)row * KVH * HS, F((size_t)KVH * HS), "attention_paged k pool");
        need(vp + (size_t)row * KVH * HS, F((size_t)KVH * HS), "attention_paged v pool");
    }
    g_cpu->i->attention_paged(g_cpu, out, q, kp, vp, pg, seq, pos, runs, n_runs, N, max_T, NH, KVH, HS, scale,
                              window);
}
static void ds_get_rows(kiln_backend *be, float *out, const float *x, const int32_t *idx, int n, int C) {
    (void)be;
    need(out, F((size_t)n * C), "get_rows out");
    g_cpu->i->get_rows(g_cpu, out, x, idx, n, C);
}
static void ds_swiglu(kiln_backend *be, float *out, const float *g, const float *u, size_t n) {
    (void)be;
    need(out, F(n), "swiglu out");
    need(g, F(n), "swiglu gate");
    need(u, F(n), "swiglu up");
    g_cpu->i->swiglu(g_cpu, out, g, u, n);
}
static void ds_geglu(kiln_backend *be, float *out, const float *g, const float *u, size_t n) {
    (void)be;
    need(out, F(n), "geglu out");
    need(g, F(n), "geglu gate");
    need(u, F(n), "geglu up");
    g_cpu->i->geglu(g_cpu, out, g, u, n);
}
static void ds_scale(kiln_backend *be, float *x, float sc, size_t n) {
    (void)be;
    need(x, F(n), "scale x");
    g_cpu->i->scale(g_cpu, x, sc, n);
}
static void ds_add(kiln_backend *be, float *x, const float *y, size_t n) {
    (void)be;
    need(x, F(n), "add x");
    need(y, F(n), "add y");
    g_cpu->i->add(g_cpu, x, y, n);
}
static bool ds_supports(const kiln_backend *be, kiln_op op, kiln_dtype t) {
    (void)be;
    return g_cpu->i->supports_op(g_cpu, op, t);
}
static void *ds_alloc(kiln_backend *be, size_t n) {
    (void)be;
    if (g_n_bufs == MAX_BUFS) return NULL;
    /* filled with a NaN pattern: memory the forward reads before writing shows up in the bits */
    char *p = kiln_malloc(n ? n : 1);
    if (!p) return NULL;
    memset(p, 0xff, n);
    g_bufs[g_n_bufs].p = p;
    g_bufs[g_n_bufs++].n = n;
    return p;
}
static void ds_free_buf(kiln_backend *be, void *p) {
    (void)be;
    if (!p) return;
    for (int i = 0; i < g_n_bufs; i++) {
        if (g_bufs[i].p != p) continue;
        g_bufs[i] = g_bufs[--g_n_bufs];
        kiln_free(p);
        return;
    }
    g_violations++;
    fprintf(stderr, "violation: free_buf of a pointer devsim did not allocate\n");
}
static kiln_status ds_upload(kiln_backend *be, void *dst, const void *src, size_t n) {
    (void)be;
    need(dst, n, "upload destination");
    if (n) memcpy(dst, src, n);
    return KILN_OK;
}
static kiln_status ds_download(kiln_backend *be, void *dst, const void *src, size_t n) {
    (void)be;
    need(src, n, "download source");
    if (n) memcpy(dst, src, n);
    return KILN_OK;
}
static kiln_status ds_status(kiln_backend *be) {
    (void)be;
    return KILN_OK;
}
static void ds_free(kiln_backend *be) { (void)be; }

static const kiln_backend_i ds_iface = {
    .name = "devsim",
    .free = ds_free,
    .supports_op = ds_supports,
    .embed = ds_embed,
    .rmsnorm = ds_rmsnorm,
    .matmul = ds_matmul,
    .rope = ds_rope,
    .attention = ds_attention,
    .swiglu = ds_swiglu,
    .add = ds_add,
    .alloc = ds_alloc,
    .free_buf = ds_free_buf,
    .upload = ds_upload,
    .download = ds_download,
    .status = ds_status,
    .kv_store_rows = ds_kv_store_rows,
    .attention_paged = ds_attention_paged,
    .get_rows = ds_get_rows,
    .geglu = ds_geglu,
    .scale = ds_scale,
};

/* ---- the test ------------------------------------------------------------------------------- */

static uint64_t g_rng = 0x64657673696d3031ull;
static float rnd_unit(void) {
    uint64_t z = (g_rng += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    z ^= z >> 31;
    return (float)((double)(z >> 11) * 0x1p-53 * 2.0 - 1.0);
}

static kiln_status randomise_role(void *ctx, const kiln_param_role *r, int layer) {
    kiln_model *m = ctx;
    kiln_wref *w = kiln_model_ref(m, r, layer);
    if (r->cols != KILN_DIM_ONE || !w->vec) return KILN_OK;
    float *v = (float *)w->vec;
    for (int64_t j = 0; j < kiln_dim_value(&m->cfg, r->rows); j++)
        v[j] = r->init == KILN_INIT_ONES ? 1.0f + 0.2f * rnd_unit() : 0.05f * rnd_unit();
    return KILN_OK;
}

/* A model of architecture arch (config.json model_type) with the tokenizer at tok (n_vocab
 * tokens). */
static int run(const char *tok, int n_vocab, const char *arch, int tied, int n_batch) {
    char cfg[1200];
    snprintf(cfg, sizeof cfg, "%s/devsim-%s.json", getenv("TMPDIR") ? getenv("TMPDIR") : "/tmp", arch);
    FILE *f = fopen(cfg, "w");
    if (!f) return 0;
    fprintf(f, "{\"model_type\": \"%s\", \"hidden_size\": 64, \"num_hidden_layers\": 2,"
               " \"num_attention_heads\": 4, \"num_key_value_heads\": 2, \"head_dim\": 24,"
               " \"intermediate_size\": 96, \"vocab_size\": %d, \"max_position_embeddings\": 256,"
               " \"rms_norm_eps\": 1e-6, \"rope_theta\": 10000.0, \"tie_word_embeddings\": %s%s}\n",
            arch, n_vocab, tied ? "true" : "false",
            strcmp(arch, "gemma3_text") ? "" : ", \"sliding_window\": 8, \"sliding_window_pattern\": 2");
    fclose(f);
    kiln_model *m = NULL;
    if (kiln_model_create(cfg, tok, 7, &m) != KILN_OK) {
        fprintf(stderr, "FAIL %s: %s\n", arch, kiln_last_error());
        remove(cfg);
        return 0;
    }
    remove(cfg);
    /* norms and biases away from 1 and 0 */
    const kiln_model_config *c = &m->cfg;
    (void)kiln_arch_walk(m->arch, c->n_layer, randomise_role, m);

    int V = c->n_vocab, N = 11, ok = 1;
    int32_t ids[16];
    for (int i = 0; i < 16; i++) ids[i] = (int32_t)((i * 7919 + 13) % 32000);
    float *ref = malloc(sizeof(float) * (size_t)(N + 2) * V), *got = malloc(sizeof(float) * (size_t)(N + 2) * V);
    kiln_context_params cp = kiln_context_default_params();
    cp.n_ctx = 32;
    cp.n_batch = n_batch;
    cp.n_threads = 1;
    kiln_context *cc = NULL;
    ok &= kiln_context_create(m, &cp, &cc) == KILN_OK;
    ok &= kiln_decode(cc, ids, N, 1, ref) == KILN_OK;
    ok &= kiln_decode(cc, ids + N, 1, 0, ref + (size_t)N * V) == KILN_OK;
    ok &= kiln_decode(cc, ids + N + 1, 1, 0, ref + (size_t)(N + 1) * V) == KILN_OK;

    kiln_backend ds = {.i = &ds_iface, .n_threads = 1, .ctx = NULL};
    kiln_forward_state fs;
    ok &= kiln_forward_state_init(&fs, m, &ds, 32, n_batch, 1, 0) == KILN_OK && !fs.host_memory;
    float *dl = kiln_backend_alloc(&ds, sizeof(float) * (size_t)N * V);
    ok &= dl != NULL;
    if (ok) {
        /* prefill in n_batch chunks with every row, then two decode steps (last row only) */
        int32_t pos[32], seq[32] = {0};
        for (int i = 0; i < 32; i++) pos[i] = i;
        for (int done = 0; done < N; done += n_batch) {
            int k = N - done < n_batch ? N - done : n_batch;
            kiln_batch b = {k, ids + done, pos + done, seq, NULL, 0};
            ok &= kiln_model_forward(m, &ds, &fs, &b, dl + (size_t)done * V) == KILN_OK;
        }
        ok &= kiln_backend_download(&ds, got, dl, sizeof(float) * (size_t)N * V) == KILN_OK;
        for (int s = 0; s < 2; s++) {
            kiln_batch b = {1, ids + N + s, pos + N + s, seq, NULL, 0};
            ok &= kiln_model_forward(m, &ds, &fs, &b, dl) == KILN_OK;
            ok &= kiln_backend_download(&ds, got + (size_t)(N + s) * V, dl, sizeof(float) * V) == KILN_OK;
        }
        size_t diff = 0;
        for (size_t i = 0; i < (size_t)(N + 2) * V; i++) diff += memcmp(&ref[i], &got[i], 4) != 0;
        if (diff) fprintf(stderr, "FAIL %s: %zu logits differ from the CPU context\n", arch, diff);
        ok &= diff == 0;
    }
    kiln_backend_free_buf(&ds, dl);
    kiln_forward_state_free(&fs);

    /* the same through kiln_decode on a context whose backend is devsim (made by hand, as
     * kiln_context_create would with a device backend): chunked all-row prefill, a step
     * without logits, then decode steps; the logits buffer is grown on demand */
    kiln_context *dc = kiln_calloc(1, sizeof *dc);
    kiln_backend *dsp = kiln_malloc(sizeof *dsp);
    ok &= dc && dsp;
    if (ok) {
        *dsp = ds;
        /* entered as kiln_context_create enters a context: a live handle, a user of m */
        ok &= kiln_handle_acquire(m, KILN_HANDLE_MODEL, "test_forward_devsim") == KILN_OK;
        dc->model = m;
        ok &= kiln_handle_register(&dc->head, KILN_HANDLE_CONTEXT, "test_forward_devsim") == KILN_OK;
        dc->params = cp;
        dc->be = dsp;
        dc->tokens = kiln_calloc(32, sizeof(int32_t));
        dc->b_pos = kiln_calloc(2 * (size_t)n_batch, sizeof(int32_t));
        dc->b_seq = dc->b_pos ? dc->b_pos + n_batch : NULL;
        ok &= dc->tokens && dc->b_pos && kiln_forward_state_init(&dc->fs, m, dsp, 32, n_batch, 1, 0) == KILN_OK;
        for (size_t i = 0; i < (size_t)(N + 2) * V; i++) got[i] = 0.0f;
        ok &= kiln_decode(dc, ids, N, 1, got) == KILN_OK;
        ok &= kiln_decode(dc, ids + N, 1, 0, got + (size_t)N * V) == KILN_OK;
        ok &= kiln_context_truncate(dc, N) == KILN_OK;
        ok &= kiln_decode(dc, ids + N, 1, 0, NULL) == KILN_OK;
        ok &= kiln_decode(dc, ids + N + 1, 1, 0, got + (size_t)(N + 1) * V) == KILN_OK;
        size_t diff = 0;
        for (size_t i = 0; i < (size_t)(N + 2) * V; i++) diff += memcmp(&ref[i], &got[i], 4) != 0;
        if (diff) fprintf(stderr, "FAIL %s: kiln_decode on devsim: %zu logits differ\n", arch, diff);
        ok &= diff == 0 && kiln_context_n_past(dc) == N + 2;
    }
    kiln_context_free(dc); /* frees the state, then "frees" devsim (a no-op) */
    kiln_free(dsp);
    if (g_n_bufs) {
        fprintf(stderr, "FAIL %s: %d backend buffers left after kiln_forward_state_free\n", arch, g_n_bufs);
        ok = 0;
    }
    kiln_context_free(cc);
    kiln_model_close(m);
    free(ref);
    free(got);
    printf("%s %s (tied %d, n_batch %d): violations so far %d\n", ok ? "ok  " : "FAIL", arch, tied,
           n_batch, g_violations);
    return ok;
}

/* The tokenizers: the shared test vocabularies (Llama's SentencePiece, Qwen2's 151,936-token
 * BPE), else the default model's GGUF ($KILN_SMOLLM2_GGUF, which scripts/test.sh fetches) for
 * every model. */
int main(void) {
    const char *env = getenv("KILN_SHARED_DIR"), *gguf = getenv("KILN_SMOLLM2_GGUF");
    char dir[1024], spm[1200], qwen[1200];
    if (env) snprintf(dir, sizeof dir, "%s/testdata/tokenizer-vectors", env);
    else snprintf(dir, sizeof dir, "%s", KILN_SOURCE_DIR "/../shared/testdata/tokenizer-vectors");
    snprintf(spm, sizeof spm, "%s/ggml-vocab-llama-spm.gguf", dir);
    snprintf(qwen, sizeof qwen, "%s/ggml-vocab-qwen2.gguf", dir);
    int v_spm = 32000, v_qwen = 151936;
    if (!kiln_path_is_file(spm) || !kiln_path_is_file(qwen)) {
        if (!gguf || !kiln_path_is_file(gguf)) {
            printf("no tokenizer (vocabularies at %s, or $KILN_SMOLLM2_GGUF): skipped\n", dir);
            return 77;
        }
        snprintf(spm, sizeof spm, "%s", gguf);
        snprintf(qwen, sizeof qwen, "%s", gguf);
        v_spm = v_qwen = 49152;
    }
    if (kiln_backend_cpu_create(1, &g_cpu) != KILN_OK) return 1;
    int ok = 1;
    ok &= run(spm, v_spm, "llama", 1, 32);
    ok &= run(qwen, v_qwen, "qwen2", 1, 4);
    ok &= run(qwen, v_qwen, "qwen3", 0, 32);
    ok &= run(spm, v_spm, "gemma3_text", 1, 4); /* a sliding window of 8 the 13 positions cross */
    kiln_backend_free(g_cpu);
    ok &= g_violations == 0;
    printf("%s: %d memory-contract violations\n", ok ? "PASS" : "FAIL", g_violations);
    return ok ? 0 : 1;
}
