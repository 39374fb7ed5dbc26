/*
 * test_handles.c -- safe handles (base/handle.h, docs/API.md "Safe handles"): a second free,
 * a use after free, a pointer of another type or one kiln never made are refused with
 * KILN_ERR_BAD_HANDLE naming the function and the type, and never read (the ASan build runs
 * this test: a read of freed memory would be reported); a handle whose header was overwritten
 * gives KILN_ERR_PANIC; a model is not freed under its contexts, trainers or detok streams; a
 * poisoned backend refuses its handles' calls with KILN_ERR_POISONED and is not handed to new
 * ones. The parts with a model are skipped without a tokenizer (test_util.h
 * test_tokenizer_path); the rest always runs.
 */
#include "base/base.h"
#include "base/handle.h"
#include "generate/generate.h"
#include "train/trainer.h"
#include "test_util.h"

#include <kiln.h>

#include <unistd.h>

#define CHECK_LAST(needle)                                                                     \
    CHECK_MSG(strstr(kiln_last_error(), (needle)) != NULL, "last error '%s' lacks '%s'",       \
              kiln_last_error(), (needle))

static void sampler_misuse(void) {
    kiln_sampler_params sp = kiln_sampler_default_params();
    kiln_sampler *s = NULL;
    CHECK(kiln_sampler_create(&sp, &s) == KILN_OK);
    float logits[4] = {0, 3, 1, 2};
    int32_t id = -1;
    CHECK(kiln_sampler_sample(s, logits, 4, NULL, 0, &id) == KILN_OK);

    /* a header overwritten under kiln: the boundary catches it as a broken invariant */
    kiln_handle_head *head = (kiln_handle_head *)s;
    const uint32_t magic = head->magic;
    head->magic = 0x12345678u;
    CHECK_ERR(kiln_sampler_sample(s, logits, 4, NULL, 0, &id), KILN_ERR_PANIC, "damaged header");
    CHECK(kiln_status_string(KILN_ERR_PANIC)[0] != '?');
    head->magic = magic;
    CHECK(kiln_sampler_sample(s, logits, 4, NULL, 0, &id) == KILN_OK);

    kiln_sampler_free(s);
    /* use after free and a second free: refused, the freed memory never read */
    CHECK_ERR(kiln_sampler_sample(s, logits, 4, NULL, 0, &id), KILN_ERR_BAD_HANDLE, "kiln_sampler_sample");
    CHECK_LAST("not a live kiln_sampler");
    kiln_error_clear();
    kiln_sampler_free(s);
    CHECK_LAST("kiln_sampler_free");
    CHECK_LAST("not a live kiln_sampler");

    /* NULL stays an invalid argument; freeing NULL is a silent no-op */
    CHECK_ERR(kiln_sampler_sample(NULL, logits, 4, NULL, 0, &id), KILN_ERR_INVALID_ARG, "is NULL");
    kiln_error_clear();
    kiln_sampler_free(NULL);
    CHECK(kiln_last_error()[0] == '\0');

    /* memory kiln never made, and a handle of another type */
    uint64_t junk[16] = {0};
    CHECK_ERR(kiln_sampler_sample((kiln_sampler *)junk, logits, 4, NULL, 0, &id), KILN_ERR_BAD_HANDLE,
              "not a live kiln_sampler");
    CHECK(kiln_sampler_create(&sp, &s) == KILN_OK);
    CHECK_ERR(kiln_decode((kiln_context *)s, (const int32_t[]){1}, 1, 0, NULL), KILN_ERR_BAD_HANDLE,
              "is a kiln_sampler, not a kiln_context");
    kiln_error_clear();
    kiln_context_free((kiln_context *)s); /* refused: the sampler stays alive */
    CHECK_LAST("kiln_context_free");
    CHECK(kiln_sampler_sample(s, logits, 4, NULL, 0, &id) == KILN_OK);
    kiln_sampler_free(s);
    CHECK(kiln_handle_count() == 0);
}

/* Many handles made and freed in a scrambled order: the table grows, and every deletion keeps
 * the others findable (backward-shift deletion), down to an empty (freed) table. */
static void many_handles(void) {
    enum { N = 300 };
    kiln_sampler *s[N];
    kiln_sampler_params sp = kiln_sampler_default_params();
    for (int i = 0; i < N; i++) CHECK(kiln_sampler_create(&sp, &s[i]) == KILN_OK);
    CHECK(kiln_handle_count() == N);
    float logits[2] = {1, 0};
    int32_t id;
    int alive = N;
    for (int step = 0; step < N; step++) {
        int k = (step * 7919) % N; /* 7919 is prime to N: every index once */
        kiln_sampler_free(s[k]);
        s[k] = NULL;
        alive--;
        if (step % 37 == 0 || alive < 8)
            for (int i = 0; i < N; i++)
                if (s[i]) CHECK(kiln_sampler_sample(s[i], logits, 2, NULL, 0, &id) == KILN_OK);
    }
    CHECK(kiln_handle_count() == 0);
    kiln_mem_stats ms;
    kiln_mem_get_stats(&ms);
    CHECK_MSG(ms.live_blocks == 0, "%zu blocks left", ms.live_blocks);
}

static kiln_model *tiny_model(const char *tokp, int V) {
    char cfg[1024];
    snprintf(cfg, sizeof cfg, "%s/kiln-test-handles-%d.json", getenv("TMPDIR") ? getenv("TMPDIR") : "/tmp",
             (int)getpid());
    FILE *f = fopen(cfg, "w");
    CHECK(f != NULL);
    if (!f) return NULL;
    fprintf(f, "{\"model_type\": \"llama\", \"hidden_size\": 64, \"num_hidden_layers\": 1,"
               " \"num_attention_heads\": 4, \"num_key_value_heads\": 2, \"head_dim\": 16,"
               " \"intermediate_size\": 96, \"vocab_size\": %d, \"max_position_embeddings\": 64,"
               " \"rms_norm_eps\": 1e-6, \"rope_theta\": 10000.0, \"tie_word_embeddings\": true}\n", V);
    fclose(f);
    kiln_model *m = NULL;
    kiln_status st = kiln_model_create(cfg, tokp, 3, &m);
    remove(cfg);
    CHECK_MSG(st == KILN_OK, "%s", kiln_last_error());
    return st == KILN_OK ? m : NULL;
}

static kiln_context *small_context(kiln_model *m, int n_threads) {
    kiln_context_params cp = kiln_context_default_params();
    cp.n_ctx = 32;
    cp.n_threads = n_threads;
    kiln_context *c = NULL;
    kiln_status st = kiln_context_create(m, &cp, &c);
    CHECK_MSG(st == KILN_OK, "%s", kiln_last_error());
    return c;
}

static void model_users(const char *tokp, int V) {
    kiln_model *m = tiny_model(tokp, V);
    if (!m) return;
    kiln_context *c = small_context(m, 1);
    if (!c) return;
    const int32_t ids[3] = {5, 6, 7};
    CHECK(kiln_decode(c, ids, 3, 0, NULL) == KILN_OK);

    /* closing the model under a live context is refused: both stay usable */
    kiln_error_clear();
    kiln_model_close(m);
    CHECK_LAST("kiln_model_close");
    CHECK_LAST("1 user");
    kiln_model_info info;
    CHECK(kiln_model_get_info(m, &info) == KILN_OK);
    CHECK(kiln_decode(c, ids, 1, 0, NULL) == KILN_OK);
    CHECK(kiln_context_n_past(c) == 4);

    /* the model's own tokenizer goes with the model; a detok stream on it is a user too */
    const kiln_tokenizer *tok = kiln_model_get_tokenizer(m);
    CHECK(tok != NULL);
    kiln_error_clear();
    kiln_tokenizer_close((kiln_tokenizer *)tok);
    CHECK_LAST("belongs to a kiln_model");
    kiln_detok_stream *ds = NULL;
    CHECK(kiln_detok_stream_create(tok, 0, &ds) == KILN_OK);
    kiln_train_params tp = kiln_train_default_params();
    tp.max_seq = 8;
    tp.n_threads = 1;
    kiln_trainer *t = NULL;
    CHECK_MSG(kiln_trainer_create(m, &tp, &t) == KILN_OK, "%s", kiln_last_error());

    kiln_context_free(c);
    kiln_error_clear();
    kiln_model_close(m);
    CHECK_LAST("2 users");
    kiln_detok_stream_free(ds);
    kiln_detok_stream_free(ds); /* second free: refused, recorded */
    CHECK_LAST("not a live kiln_detok_stream");
    kiln_model_close(m);
    CHECK_LAST("1 user");
    kiln_trainer_free(t);

    /* a freed context: use after free and a second free are refused */
    CHECK_ERR(kiln_decode(c, ids, 1, 0, NULL), KILN_ERR_BAD_HANDLE, "kiln_decode");
    CHECK_LAST("not a live kiln_context");
    CHECK_ERR(kiln_context_truncate(c, 0), KILN_ERR_BAD_HANDLE, "kiln_context_truncate");
    CHECK(kiln_context_n_past(c) == 0);
    CHECK_LAST("kiln_context_n_past");
    kiln_error_clear();
    kiln_context_free(c);
    CHECK_LAST("kiln_context_free");
    kiln_error_clear();
    kiln_trainer_free(t);
    CHECK_LAST("not a live kiln_trainer");
    CHECK_ERR(kiln_train_discard(t), KILN_ERR_BAD_HANDLE, "kiln_train_discard");
    CHECK_ERR(kiln_train_fingerprint(t, (uint8_t[32]){0}), KILN_ERR_BAD_HANDLE, "kiln_train_fingerprint");

    /* no users left: the model closes; then it is gone for every call */
    kiln_error_clear();
    kiln_model_close(m);
    CHECK(kiln_last_error()[0] == '\0');
    CHECK_ERR(kiln_model_get_info(m, &info), KILN_ERR_BAD_HANDLE, "not a live kiln_model");
    uint8_t fp[32];
    CHECK_ERR(kiln_model_fingerprint(m, fp), KILN_ERR_BAD_HANDLE, "kiln_model_fingerprint");
    CHECK(kiln_model_get_tokenizer(m) == NULL);
    CHECK_ERR(kiln_tokenize(tok, "a", 1, 0, 0, NULL, 0, &(size_t){0}), KILN_ERR_BAD_HANDLE,
              "not a live kiln_tokenizer");
    CHECK_ERR(kiln_tokenizer_fingerprint(tok, fp), KILN_ERR_BAD_HANDLE, "not a live kiln_tokenizer");
    kiln_context *c2 = NULL;
    CHECK_ERR(kiln_context_create(m, NULL, &c2), KILN_ERR_BAD_HANDLE, "kiln_context_create");
    CHECK(c2 == NULL);
    kiln_error_clear();
    kiln_model_close(m); /* double close */
    CHECK_LAST("kiln_model_close");
    CHECK(kiln_handle_count() == 0);
}

static void poisoned(const char *tokp, int V) {
    kiln_model *m = tiny_model(tokp, V);
    if (!m) return;
    CHECK(kiln_backend_poisoned() == 0);
    /* two contexts with the same device, mode and threads share one backend */
    kiln_context *a = small_context(m, 1), *b = small_context(m, 1);
    if (!a || !b) return;
    kiln_linear_ce *ce = NULL;
    CHECK(kiln_linear_ce_create(-1, 0, &ce) == KILN_OK);
    const int32_t ids[2] = {3, 4};
    CHECK(kiln_decode(a, ids, 2, 0, NULL) == KILN_OK);
    CHECK(kiln_context_status(a) == KILN_OK);
    CHECK(kiln_debug_poison_context(a) == KILN_OK);
    CHECK(kiln_backend_poisoned() == 1);
    CHECK_ERR(kiln_context_status(a), KILN_ERR_POISONED, "kiln_context_status");
    CHECK_ERR(kiln_decode(a, ids, 2, 0, NULL), KILN_ERR_POISONED, "poisoned on purpose");
    CHECK_ERR(kiln_context_truncate(a, 0), KILN_ERR_POISONED, "kiln_context_truncate");
    CHECK_ERR(kiln_decode(b, ids, 2, 0, NULL), KILN_ERR_POISONED, "kiln_decode"); /* shared */
    CHECK(kiln_linear_ce_status(ce) == KILN_OK); /* its own backend (n_threads 0: all cores) */
    /* kiln_backend_poisoned keeps the thread's message */
    CHECK_ERR(kiln_context_status(b), KILN_ERR_POISONED, "poisoned");
    CHECK(kiln_backend_poisoned() == 1);
    CHECK_LAST("poisoned");
    /* a new context does not get the poisoned backend */
    kiln_context *c = small_context(m, 1);
    if (c) {
        CHECK(kiln_context_status(c) == KILN_OK);
        CHECK(kiln_decode(c, ids, 2, 0, NULL) == KILN_OK);
        kiln_context_free(c);
    }
    kiln_context_free(a);
    CHECK(kiln_backend_poisoned() == 1);
    kiln_context_free(b); /* the last user of the poisoned backend: it goes */
    CHECK(kiln_backend_poisoned() == 0);
    kiln_linear_ce_free(ce);
    kiln_linear_ce_free(ce);
    CHECK_LAST("not a live kiln_linear_ce");
    kiln_model_close(m);
    CHECK(kiln_handle_count() == 0);
}

static void allocator_refused_while_open(void) {
    kiln_sampler_params sp = kiln_sampler_default_params();
    kiln_sampler *s = NULL;
    CHECK(kiln_sampler_create(&sp, &s) == KILN_OK);
    kiln_allocator a = {NULL, NULL, NULL};
    CHECK_ERR(kiln_set_allocator(&a), KILN_ERR_INVALID_ARG, "must be set");
    CHECK_ERR(kiln_set_allocator(NULL), KILN_ERR_STATE, "1 kiln handle is still open");
    kiln_sampler_free(s);
    CHECK(kiln_set_allocator(NULL) == KILN_OK);
}

/* kiln_train_release_source: refused while the model has another user; after it the trainer
 * trains on its own copy, the model answers for its info and refuses what reads weights. */
static void release_source(const char *tokp, int V) {
    kiln_model *m = tiny_model(tokp, V);
    if (!m) return;
    kiln_context *c = small_context(m, 1);
    kiln_train_params tp = kiln_train_default_params();
    tp.max_seq = 8;
    tp.n_threads = 1;
    kiln_trainer *t = NULL;
    CHECK_MSG(kiln_trainer_create(m, &tp, &t) == KILN_OK, "%s", kiln_last_error());
    if (!c || !t) return;
    const int32_t ids[5] = {5, 6, 7, 8, 9};
    float before = 0, after = 0;
    CHECK(kiln_train_forward(t, ids, 4, ids + 1, KILN_LOSS_MEAN, 1.0f, &before) == KILN_OK);
    CHECK(kiln_train_discard(t) == KILN_OK);
    CHECK_ERR(kiln_train_release_source(t), KILN_ERR_STATE, "2 users"); /* the context reads them */
    CHECK(kiln_decode(c, ids, 3, 0, NULL) == KILN_OK);
    kiln_context_free(c);
    CHECK_MSG(kiln_train_release_source(t) == KILN_OK, "%s", kiln_last_error());
    CHECK(kiln_train_release_source(t) == KILN_OK); /* again: nothing more to give back */
    CHECK(kiln_train_forward(t, ids, 4, ids + 1, KILN_LOSS_MEAN, 1.0f, &after) == KILN_OK);
    CHECK(kiln_train_discard(t) == KILN_OK);
    CHECK_MSG(before == after, "the trainer's loss %g after the release, %g before", after, before);
    kiln_model_info info;
    CHECK(kiln_model_get_info(m, &info) == KILN_OK && info.n_vocab == V);
    kiln_tensor_info ti; /* the names outlive the block they were made in */
    CHECK(kiln_model_get_tensor_info(m, 0, &ti) == KILN_OK && ti.name && !strcmp(ti.name, "model.embed_tokens.weight"));
    kiln_context *c2 = NULL;
    CHECK_ERR(kiln_context_create(m, NULL, &c2), KILN_ERR_STATE, "given back");
    kiln_trainer *t2 = NULL;
    CHECK_ERR(kiln_trainer_create(m, &tp, &t2), KILN_ERR_STATE, "given back");
    uint8_t fp[32];
    CHECK_ERR(kiln_model_fingerprint(m, fp), KILN_ERR_STATE, "given back");
    kiln_trainer_free(t);
    kiln_model_close(m);
}

int main(void) {
    sampler_misuse();
    many_handles();
    allocator_refused_while_open();
    char tokp[4096];
    int V = 0;
    if (!test_tokenizer_path(tokp, sizeof tokp, &V)) {
        printf("no tokenizer (the shared test vocabulary or $KILN_SMOLLM2_GGUF): the model parts skipped\n");
        return test_finish("test_handles");
    }
    model_users(tokp, V);
    release_source(tokp, V);
    poisoned(tokp, V);
    kiln_mem_stats ms;
    kiln_mem_get_stats(&ms);
    CHECK_MSG(ms.live_blocks == 0, "%zu blocks left", ms.live_blocks);
    return test_finish("test_handles");
}
