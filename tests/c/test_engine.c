/*
 * test_engine.c -- the serving engine (kiln.h "Serving engine") on the CPU with tiny random
 * models: every request produces the tokens kiln_generate produces for it alone (same prompt,
 * settings and seed), whatever else runs beside it -- with chunked prefill mixing requests,
 * a queue longer than the running slots, shared prompt prefixes, a pool so small that
 * requests are preempted and recomputed, stop strings and penalties -- and for a recurrent
 * architecture (Qwen3.5). Also: cancellation frees the blocks, the queue bound gives
 * KILN_ERR_BUSY, logprobs agree with the sampled token, max_tokens 0, drain on shutdown.
 * Skipped (77) without a tokenizer to make the models with (test_util.h). KILN_TEST_DEVICE=N runs
 * the engine and the references on CUDA device N (scripts/gpu-check.sh), auditable arithmetic,
 * and then CUDA's batch-invariant fast mode on bf16 weights (its tensor-core products).
 */
#include "test_util.h"

#include <kiln.h>

#include <dirent.h>
#include <math.h>
#include <pthread.h>
#include <unistd.h>

static int V;
static int g_fast; /* the arithmetic of the engine and the reference: 0, or fast and batch-invariant */
static int g_device = -1; /* KILN_TEST_DEVICE: the engine's and the references' device */
#define MAXR 24
#define NCTX 256

typedef struct got {
    int32_t ids[NCTX];
    int n_ids;
    char text[4096];
    size_t len;
    int done, n_cached, n_tokens_events;
    char finish[32], stop[32];
    kiln_status status;
    float logprob_ok; /* 1 while every token's logprob matched its top list */
} got;

static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER;
/* a request cancelled from its own callback after cancel_after tokens (on the engine's thread) */
static kiln_engine *g_cancel_engine;
static uint64_t g_cancel_id;
static int g_cancel_after;
/* a callback that holds the engine's worker on its request's first token until released */
static got *g_hold;
static int g_held, g_release;
static pthread_cond_t g_cv = PTHREAD_COND_INITIALIZER;

static void on_event(const kiln_request_event *ev, void *user) {
    got *g = user;
    pthread_mutex_lock(&g_mu);
    if (ev->kind == KILN_EVENT_TOKEN) {
        g->ids[g->n_ids++] = ev->id;
        g->n_tokens_events++;
        if (g == g_hold && g->n_ids == 1) {
            g_held = 1;
            pthread_cond_broadcast(&g_cv);
            while (!g_release) pthread_cond_wait(&g_cv, &g_mu);
        }
        if (g_cancel_engine && ev->request == g_cancel_id && g->n_ids == g_cancel_after) kiln_engine_cancel(g_cancel_engine, ev->request);
        if (g->len + ev->len < sizeof g->text) memcpy(g->text + g->len, ev->text, ev->len), g->len += ev->len;
        if (ev->n_top > 0) {
            int in_top = 0;
            for (int i = 0; i < ev->n_top; i++)
                if (ev->top_ids[i] == ev->id) in_top = ev->top_logprobs[i] == ev->logprob;
            if (ev->n_top && ev->top_ids[0] == ev->id && ev->top_logprobs[0] != ev->logprob) g->logprob_ok = 0;
            if (!in_top && ev->logprob > ev->top_logprobs[ev->n_top - 1]) g->logprob_ok = 0;
            for (int i = 1; i < ev->n_top; i++)
                if (ev->top_logprobs[i] > ev->top_logprobs[i - 1]) g->logprob_ok = 0;
            if (!(ev->logprob <= 0.0f)) g->logprob_ok = 0;
        }
    } else {
        if (g->len + ev->tail_len < sizeof g->text) memcpy(g->text + g->len, ev->tail, ev->tail_len), g->len += ev->tail_len;
        snprintf(g->finish, sizeof g->finish, "%s", ev->finish_reason);
        snprintf(g->stop, sizeof g->stop, "%s", ev->stop_reason ? ev->stop_reason : "");
        g->status = ev->status;
        g->n_cached = ev->n_prompt_cached;
        g->done = 1;
        pthread_cond_broadcast(&g_cv);
    }
    pthread_mutex_unlock(&g_mu);
}

static void wait_done(got *g, int n) {
    pthread_mutex_lock(&g_mu);
    for (int i = 0; i < n; i++)
        while (!g[i].done) pthread_cond_wait(&g_cv, &g_mu);
    pthread_mutex_unlock(&g_mu);
}

typedef struct spec {
    int32_t prompt[200];
    int n_prompt, max_tokens;
    kiln_sampler_params sp;
    const char *stops[2];
} spec;

static void make_spec(spec *s, int i, int n_prompt, int shared_prefix) {
    memset(s, 0, sizeof *s);
    s->n_prompt = n_prompt;
    for (int k = 0; k < n_prompt; k++)
        s->prompt[k] = (int32_t)((k < shared_prefix ? 7 + k * 104729 : i * 7919 + k * 104729 + 13) % (V - 100) + 100);
    s->max_tokens = 12 + (i * 5) % 25;
    s->sp = kiln_sampler_default_params();
    s->sp.temperature = i % 3 == 0 ? 0.0f : 0.9f;
    s->sp.top_k = i % 2 ? 0 : 40;
    s->sp.seed = 1000 + (uint64_t)i;
}

/* kiln_generate on a fresh context: the reference */
static int reference(kiln_model *m, const spec *s, got *out) {
    kiln_context_params cp = kiln_context_default_params();
    cp.n_ctx = NCTX;
    cp.n_threads = 2;
    cp.fast = cp.batch_invariant = g_fast;
    cp.device = g_device;
    kiln_context *c = NULL;
    if (kiln_context_create(m, &cp, &c) != KILN_OK) return 0;
    kiln_generate_params gp = kiln_generate_default_params();
    gp.max_tokens = s->max_tokens;
    gp.sampler = s->sp;
    gp.stop_strings = s->stops[0] ? s->stops : NULL;
    kiln_generate_result r;
    int ok = kiln_generate(c, s->prompt, (size_t)s->n_prompt, &gp, &r) == KILN_OK;
    if (ok) {
        memset(out, 0, sizeof *out);
        out->n_ids = (int)r.n_ids;
        memcpy(out->ids, r.ids, r.n_ids * sizeof(int32_t));
        out->len = r.text_len < sizeof out->text ? r.text_len : 0;
        memcpy(out->text, r.text, out->len);
        snprintf(out->stop, sizeof out->stop, "%s", r.stop_reason);
        kiln_generate_result_free(&r);
    }
    kiln_context_free(c);
    return ok;
}

static uint64_t submit(kiln_engine *e, const spec *s, got *g, int logprobs) {
    memset(g, 0, sizeof *g);
    g->logprob_ok = 1;
    kiln_request_params rp = kiln_request_default_params();
    rp.prompt = s->prompt;
    rp.n_prompt = (size_t)s->n_prompt;
    rp.max_tokens = s->max_tokens;
    rp.sampler = s->sp;
    rp.stop_strings = s->stops[0] ? s->stops : NULL;
    rp.logprobs = logprobs;
    rp.on_event = on_event;
    rp.user = g;
    uint64_t id = 0;
    kiln_status st = kiln_engine_submit(e, &rp, &id);
    CHECK_MSG(st == KILN_OK, "submit: %s", kiln_last_error());
    return id;
}

/* Each of n requests (specs s) equals its reference (ids, text); the engine's blocks all free
 * or cached afterwards. */
static void check_same(kiln_model *m, kiln_engine *e, spec *s, got *g, int n, const char *what) {
    wait_done(g, n);
    int differ = 0;
    for (int i = 0; i < n; i++) {
        got ref;
        CHECK(reference(m, &s[i], &ref));
        int same = g[i].status == KILN_OK && g[i].n_ids == ref.n_ids &&
                   !memcmp(g[i].ids, ref.ids, (size_t)ref.n_ids * sizeof(int32_t)) && g[i].len == ref.len &&
                   !memcmp(g[i].text, ref.text, ref.len) && !strcmp(g[i].stop, ref.stop);
        if (!same)
            fprintf(stderr, "  %s: request %d: %d ids (%s) vs %d alone (%s); status %d\n", what, i, g[i].n_ids, g[i].stop,
                    ref.n_ids, ref.stop, (int)g[i].status);
        differ += !same;
    }
    CHECK_MSG(differ == 0, "%s: %d of %d requests differ from kiln_generate alone", what, differ, n);
    kiln_engine_stats st;
    kiln_engine_get_stats(e, &st);
    CHECK_MSG(st.kv_blocks_used == 0 && st.running == 0 && st.queued == 0,
              "%s: after the load %d blocks used, %d running, %d queued", what, st.kv_blocks_used, st.running, st.queued);
}

static kiln_engine *engine(kiln_model *m, int max_seqs, int batch, int kv_blocks, int max_queue) {
    kiln_engine_params p = kiln_engine_default_params();
    p.n_ctx = NCTX;
    p.n_threads = 2;
    p.max_seqs = max_seqs;
    p.max_batch_tokens = batch;
    p.kv_blocks = kv_blocks;
    p.max_queue = max_queue;
    p.fast = p.batch_invariant = g_fast;
    p.device = g_device;
    kiln_engine *e = NULL;
    kiln_status st = kiln_engine_create(m, &p, &e);
    CHECK_MSG(st == KILN_OK, "kiln_engine_create: %s", kiln_last_error());
    return e;
}

static void run_model(kiln_model *m, int recurrent) {
    static spec s[MAXR];
    static got g[MAXR];
    const char *name = recurrent ? "qwen3_5_text" : "qwen3";

    /* 1. a crowd: more requests than slots, chunked prefill mixing, greedy and sampled */
    kiln_engine *e = engine(m, 6, 48, 0, 64);
    if (!e) return;
    int n = 16;
    for (int i = 0; i < n; i++) make_spec(&s[i], i, 3 + (i * 37) % 150, 0);
    for (int i = 0; i < n; i++) submit(e, &s[i], &g[i], -1);
    char what[64];
    snprintf(what, sizeof what, "%s crowd", name);
    check_same(m, e, s, g, n, what);

    /* 2. shared prefixes: one request first, then four sharing its 140-token prefix */
    make_spec(&s[0], 100, 150, 140);
    submit(e, &s[0], &g[0], -1);
    wait_done(g, 1);
    for (int i = 1; i < 5; i++) make_spec(&s[i], 100 + i, 145 + i, 140);
    for (int i = 1; i < 5; i++) submit(e, &s[i], &g[i], -1);
    snprintf(what, sizeof what, "%s shared prefix", name);
    check_same(m, e, s, g, 5, what);
    if (!recurrent) {
        CHECK_MSG(g[1].n_cached == 128 && g[4].n_cached == 128, "shared prefix: %d and %d prompt tokens came from the cache, not 128",
                  g[1].n_cached, g[4].n_cached);
        kiln_engine_stats st;
        kiln_engine_get_stats(e, &st);
        CHECK_MSG(st.prompt_tokens_cached >= 4 * 128, "prefix hits: %llu cached prompt tokens", (unsigned long long)st.prompt_tokens_cached);
        CHECK(st.kv_blocks_cached > 0);
    } else {
        CHECK_MSG(g[1].n_cached == 0, "a recurrent model shared %d prompt tokens", g[1].n_cached);
    }

    /* 3. stop strings, penalties-free: a stop string taken from the request's own output */
    make_spec(&s[0], 7, 20, 0);
    s[0].sp.temperature = 0.0f;
    s[0].max_tokens = 30;
    got ref;
    CHECK(reference(m, &s[0], &ref));
    static char stop[16];
    if (ref.len > 12) {
        memcpy(stop, ref.text + ref.len / 2, 3);
        stop[3] = '\0';
        s[0].stops[0] = stop;
        for (int i = 1; i < 4; i++) make_spec(&s[i], 7 + i, 30 + i, 0);
        for (int i = 0; i < 4; i++) submit(e, &s[i], &g[i], -1);
        snprintf(what, sizeof what, "%s stop strings", name);
        check_same(m, e, s, g, 4, what);
        CHECK_MSG(!strcmp(g[0].stop, "stop_string") && !strcmp(g[0].finish, "stop"), "stop string: ended by %s (%s)", g[0].stop,
                  g[0].finish);
    }

    /* 4. logprobs: the sampled token's log-probability and the top list agree (greedy: it heads the list) */
    make_spec(&s[0], 3, 40, 0);
    s[0].sp.temperature = 0.0f;
    submit(e, &s[0], &g[0], 5);
    wait_done(g, 1);
    CHECK_MSG(g[0].logprob_ok && g[0].n_ids > 0, "logprobs disagree with the sampled tokens");

    /* 5. max_tokens 0: done at once */
    make_spec(&s[0], 5, 10, 0);
    s[0].max_tokens = 0;
    submit(e, &s[0], &g[0], -1);
    wait_done(g, 1);
    CHECK_MSG(!strcmp(g[0].finish, "length") && g[0].n_ids == 0, "max_tokens 0: %s, %d ids", g[0].finish, g[0].n_ids);

    /* 6. cancellation: a long request cancelled after its first tokens; the pool is free after */
    make_spec(&s[0], 9, 30, 0);
    s[0].max_tokens = 200;
    pthread_mutex_lock(&g_mu); /* the callback sees g_cancel_id set */
    uint64_t id = submit(e, &s[0], &g[0], -1);
    g_cancel_engine = e;
    g_cancel_id = id;
    g_cancel_after = 2;
    pthread_mutex_unlock(&g_mu);
    wait_done(g, 1);
    g_cancel_engine = NULL;
    CHECK_MSG(!strcmp(g[0].finish, "cancelled") && g[0].n_ids == 2, "cancel: finished %s after %d tokens", g[0].finish, g[0].n_ids);
    kiln_engine_stats st;
    kiln_engine_get_stats(e, &st);
    CHECK_MSG(st.kv_blocks_used == 0 && st.requests_cancelled == 1, "cancel: %d blocks used, %llu cancelled", st.kv_blocks_used,
              (unsigned long long)st.requests_cancelled);
    /* a token id out of range, an over-long prompt */
    make_spec(&s[0], 1, 10, 0);
    s[0].prompt[3] = V;
    kiln_request_params rp = kiln_request_default_params();
    rp.prompt = s[0].prompt;
    rp.n_prompt = 10;
    rp.on_event = on_event;
    rp.user = &g[0];
    CHECK_ERR(kiln_engine_submit(e, &rp, &id), KILN_ERR_RANGE, "out of range");
    rp.n_prompt = NCTX;
    CHECK_ERR(kiln_engine_submit(e, &rp, &id), KILN_ERR_RANGE, "no room");
    kiln_engine_free(e);

    /* 7. preemption: a pool of 7 blocks (448 positions) for six requests of up to 3 blocks each */
    e = engine(m, 6, 64, 7, 64);
    if (!e) return;
    n = 6;
    for (int i = 0; i < n; i++) {
        make_spec(&s[i], 50 + i, 90 + 7 * i, 0);
        s[i].max_tokens = 60;
    }
    for (int i = 0; i < n; i++) submit(e, &s[i], &g[i], -1);
    snprintf(what, sizeof what, "%s preemption", name);
    check_same(m, e, s, g, n, what);
    kiln_engine_get_stats(e, &st);
    CHECK_MSG(st.preemptions > 0, "%s: a 7-block pool preempted nothing", what);
    kiln_engine_free(e);

    /* 8. back-pressure: one slot, a queue of one; drain on shutdown */
    e = engine(m, 1, 64, 0, 1);
    if (!e) return;
    make_spec(&s[0], 60, 20, 0);
    s[0].max_tokens = 60;
    make_spec(&s[1], 61, 20, 0);
    make_spec(&s[2], 62, 20, 0);
    pthread_mutex_lock(&g_mu);
    g_hold = &g[0];
    g_held = g_release = 0;
    pthread_mutex_unlock(&g_mu);
    submit(e, &s[0], &g[0], -1);
    pthread_mutex_lock(&g_mu); /* the worker waits in request 0's callback: nothing is admitted */
    while (!g_held) pthread_cond_wait(&g_cv, &g_mu);
    pthread_mutex_unlock(&g_mu);
    submit(e, &s[1], &g[1], -1);
    memset(&g[2], 0, sizeof g[2]);
    rp = kiln_request_default_params();
    rp.prompt = s[2].prompt;
    rp.n_prompt = (size_t)s[2].n_prompt;
    rp.on_event = on_event;
    rp.user = &g[2];
    CHECK_ERR(kiln_engine_submit(e, &rp, &id), KILN_ERR_BUSY, "max_queue");
    pthread_mutex_lock(&g_mu);
    g_release = 1;
    g_hold = NULL;
    pthread_cond_broadcast(&g_cv);
    pthread_mutex_unlock(&g_mu);
    kiln_engine_shutdown(e, 1);
    CHECK_MSG(g[0].done && g[1].done && !strcmp(g[1].finish, "length"), "drain: %d %d %s", g[0].done, g[1].done, g[1].finish);
    CHECK_ERR(kiln_engine_submit(e, &rp, &id), KILN_ERR_STATE, "shutting down");
    kiln_engine_get_stats(e, &st);
    CHECK(st.requests_rejected == 1);
    kiln_engine_free(e);
}

/* A random model of the config.json text json (kiln_model_create, weights from seed), the file
 * written to $TMPDIR and removed; NULL (a failed check) when it cannot be made. */
static kiln_model *model_of_json(const char *json, const char *tokp, uint64_t seed) {
    char cfg[1200];
    snprintf(cfg, sizeof cfg, "%s/kiln-test-engine-%d.json", getenv("TMPDIR") ? getenv("TMPDIR") : "/tmp", (int)getpid());
    FILE *f = fopen(cfg, "w");
    CHECK(f != NULL);
    if (!f) return NULL;
    fputs(json, f);
    fclose(f);
    kiln_model *m = NULL;
    kiln_status st = kiln_model_create(cfg, tokp, seed, &m);
    remove(cfg);
    CHECK_MSG(st == KILN_OK, "%s", kiln_last_error());
    return st == KILN_OK ? m : NULL;
}

/* Removes the files of folder dir (no subfolders), then dir. */
static void remove_folder(const char *dir) {
    DIR *d = opendir(dir);
    if (!d) return;
    struct dirent *de;
    char path[1600];
    while ((de = readdir(d)))
        if (strcmp(de->d_name, ".") && strcmp(de->d_name, "..")) {
            snprintf(path, sizeof path, "%s/%s", dir, de->d_name);
            remove(path);
        }
    closedir(d);
    rmdir(dir);
}

/* CUDA's batch-invariant fast mode on bf16 weights: a tiny qwen3 (widths of 128 and 256, so
 * that its products take the tensor-core kernel) exported in bf16 and opened again; requests
 * mixed with others in the engine's batches -- chunked prefill beside decodes, shared
 * prefixes -- get the tokens kiln_generate gives each alone, in that arithmetic. */
static void cuda_bf16_invariant(const char *tokp) {
    const char *tmp = getenv("TMPDIR") ? getenv("TMPDIR") : "/tmp";
    char json[1024], dir[1200];
    snprintf(dir, sizeof dir, "%s/kiln-test-engine-bf16-%d", tmp, (int)getpid());
    snprintf(json, sizeof json, "{\"model_type\": \"qwen3\", \"hidden_size\": 128, \"num_hidden_layers\": 2,"
             " \"num_attention_heads\": 4, \"num_key_value_heads\": 2, \"head_dim\": 32,"
             " \"intermediate_size\": 256, \"vocab_size\": %d, \"max_position_embeddings\": 512,"
             " \"rms_norm_eps\": 1e-6, \"rope_theta\": 10000.0, \"tie_word_embeddings\": true}\n", V);
    kiln_model *m = model_of_json(json, tokp, 12), *mb = NULL;
    kiln_trainer *t = NULL;
    if (!m) return;
    kiln_train_params tp = kiln_train_default_params();
    kiln_status st = kiln_trainer_create(m, &tp, &t);
    CHECK_MSG(st == KILN_OK, "kiln_trainer_create: %s", kiln_last_error());
    if (st == KILN_OK) {
        st = kiln_train_export_hf(t, dir, 1, 1);
        CHECK_MSG(st == KILN_OK, "kiln_train_export_hf: %s", kiln_last_error());
        kiln_trainer_free(t);
    }
    kiln_model_close(m);
    if (st == KILN_OK) {
        st = kiln_model_open(dir, NULL, &mb);
        CHECK_MSG(st == KILN_OK, "kiln_model_open %s: %s", dir, kiln_last_error());
    }
    if (st == KILN_OK) {
        static spec s[12];
        static got g[12];
        g_fast = 1;
        kiln_engine *e = engine(mb, 4, 32, 0, 16);
        for (int i = 0; e && i < 12; i++) make_spec(&s[i], 300 + i, 5 + i * 13, i % 2 ? 24 : 0);
        for (int i = 0; e && i < 12; i++) submit(e, &s[i], &g[i], -1);
        if (e) check_same(mb, e, s, g, 12, "CUDA fast batch-invariant, bf16");
        kiln_engine_free(e);
        g_fast = 0;
        kiln_model_close(mb);
        printf("CUDA fast batch-invariant (bf16 weights): %s\n", t_failures ? "FAIL" : "OK");
    }
    remove_folder(dir);
}

int main(void) {
    char tokp[1200], json[1024];
    if (!test_tokenizer_path(tokp, sizeof tokp, &V)) {
        printf("no tokenizer (the shared test vocabulary or $KILN_SMOLLM2_GGUF): skipped\n");
        return 77;
    }
    if (getenv("KILN_TEST_DEVICE")) g_device = atoi(getenv("KILN_TEST_DEVICE"));
    for (int recurrent = 0; recurrent < 2; recurrent++) {
        if (recurrent)
            snprintf(json, sizeof json, "{\"model_type\": \"qwen3_5_text\", \"hidden_size\": 64, \"num_hidden_layers\": 2,"
                       " \"num_attention_heads\": 4, \"num_key_value_heads\": 2, \"head_dim\": 16,"
                       " \"intermediate_size\": 96, \"vocab_size\": %d, \"max_position_embeddings\": 512,"
                       " \"rms_norm_eps\": 1e-6, \"full_attention_interval\": 2, \"linear_num_key_heads\": 2,"
                       " \"linear_num_value_heads\": 4, \"linear_key_head_dim\": 16, \"linear_value_head_dim\": 16,"
                       " \"linear_conv_kernel_dim\": 4, \"rope_parameters\": {\"rope_type\": \"default\","
                       " \"rope_theta\": 10000.0, \"partial_rotary_factor\": 0.25}, \"tie_word_embeddings\": true}\n", V);
        else
            snprintf(json, sizeof json, "{\"model_type\": \"qwen3\", \"hidden_size\": 64, \"num_hidden_layers\": 2,"
                       " \"num_attention_heads\": 4, \"num_key_value_heads\": 2, \"head_dim\": 16,"
                       " \"intermediate_size\": 96, \"vocab_size\": %d, \"max_position_embeddings\": 512,"
                       " \"rms_norm_eps\": 1e-6, \"rope_theta\": 10000.0, \"tie_word_embeddings\": true}\n", V);
        kiln_model *m = model_of_json(json, tokp, 11);
        if (!m) return 1;
        run_model(m, recurrent);
        kiln_model_close(m);
    }
    /* the default model (Q4_1), fast and batch-invariant: 8-bit activations at every batch size
     * give each request kiln_generate's tokens in that arithmetic too */
    const char *gguf = getenv("KILN_SMOLLM2_GGUF");
    kiln_model *m = NULL;
    if (g_device < 0 && gguf && kiln_model_open(gguf, NULL, &m) == KILN_OK) { /* (CUDA: below, on bf16 weights) */
        static spec s[8];
        static got g[8];
        kiln_model_info info;
        CHECK(kiln_model_get_info(m, &info) == KILN_OK);
        V = info.n_vocab;
        g_fast = 1;
        kiln_engine *e = engine(m, 4, 32, 0, 16);
        for (int i = 0; e && i < 8; i++) {
            make_spec(&s[i], 200 + i, 5 + i * 17, 0);
            s[i].max_tokens = 10;
        }
        for (int i = 0; e && i < 8; i++) submit(e, &s[i], &g[i], -1);
        if (e) check_same(m, e, s, g, 8, "SmolLM2 fast batch-invariant");
        kiln_engine_free(e);
        g_fast = 0;
        kiln_model_close(m);
    } else if (g_device < 0) {
        printf("no $KILN_SMOLLM2_GGUF: the fast batch-invariant case is skipped\n");
    }
    if (g_device >= 0) cuda_bf16_invariant(tokp);
    return test_finish("test_engine");
}
