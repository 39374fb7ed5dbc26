/*
 * test_forward_train.c -- one forward for generation and training (models/llama.c, gemma3.c):
 * the trainer's final hidden states have the bits of the generation path's, on the CPU, for
 * Llama-family layouts (q/k/v biases, q/k norms, tied and untied heads) and Gemma 3. The generation side's
 * logits are the head's product of its final hidden states; the training side's hidden states
 * go through the same product (the backend's matmul) and must give the same bits. Skipped (77)
 * without a tokenizer to make the models with (test_util.h test_tokenizer_path).
 */
#include "base/base.h"
#include "models/model.h"
#include "test_util.h"

#include <kiln.h>

#include <unistd.h>

static int V = 32000; /* the tokenizer's (test_tokenizer_path) */
#define N 70 /* across a KV block edge */

/* extra: more config.json keys (with a leading comma), or "" */
static void one(const char *tokp, const char *type, int tied, int bias, const char *extra) {
    char cfg[1024];
    snprintf(cfg, sizeof cfg, "%s/kiln-test-fwd-%d.json", getenv("TMPDIR") ? getenv("TMPDIR") : "/tmp", (int)getpid());
    FILE *f = fopen(cfg, "w");
    CHECK(f != NULL);
    if (!f) return;
    fprintf(f, "{\"model_type\": \"%s\", \"hidden_size\": 64, \"num_hidden_layers\": 2,"
               " \"num_attention_heads\": 4, \"num_key_value_heads\": 2, \"head_dim\": 16,"
               " \"intermediate_size\": 96, \"vocab_size\": %d, \"max_position_embeddings\": 256,"
               " \"rms_norm_eps\": 1e-6, \"rope_theta\": 10000.0, \"tie_word_embeddings\": %s,"
               " \"attention_bias\": %s%s}\n", type, V, tied ? "true" : "false", bias ? "true" : "false", extra);
    fclose(f);
    kiln_model *m = NULL;
    kiln_status st = kiln_model_create(cfg, tokp, 5, &m);
    remove(cfg);
    CHECK_MSG(st == KILN_OK, "%s", kiln_last_error());
    if (st != KILN_OK) return;
    /* norms and biases away from 1 and 0 */
    uint64_t rng = 99;
    for (int l = -1; l < m->cfg.n_layer; l++)
        for (int i = 0; i < m->arch->n_roles; i++) {
            const kiln_param_role *r = &m->arch->roles[i];
            if (r->per_layer != (l >= 0) || r->cols != KILN_DIM_ONE) continue;
            kiln_wref *w = kiln_model_ref(m, r, l);
            if (!w->vec) continue;
            for (int64_t j = 0; j < kiln_dim_value(&m->cfg, r->rows); j++) {
                rng = rng * 6364136223846793005ull + 1442695040888963407ull;
                float u = (float)((rng >> 40) & 0xffff) / 65536.0f - 0.5f;
                ((float *)w->vec)[j] = r->init == KILN_INIT_ONES ? 1.0f + 0.4f * u : 0.1f * u;
            }
        }
    int32_t ids[N], pos[N];
    for (int i = 0; i < N; i++) ids[i] = (int32_t)((i * 104729 + 7) % V), pos[i] = i;

    /* generation: every token's logits */
    kiln_context_params cp = kiln_context_default_params();
    cp.n_ctx = 128;
    cp.n_batch = 32; /* prefill in chunks: the forward over a cache of earlier chunks */
    cp.n_threads = 2;
    kiln_context *ctx = NULL;
    float *ref = malloc(sizeof(float) * (size_t)N * V), *got = malloc(sizeof(float) * (size_t)N * V);
    float *hid = malloc(sizeof(float) * (size_t)N * 64);
    CHECK(kiln_context_create(m, &cp, &ctx) == KILN_OK);
    CHECK(kiln_decode(ctx, ids, N, 1, ref) == KILN_OK);

    /* training: the final hidden states of every position, through the same head product */
    kiln_train_params tp = kiln_train_default_params();
    tp.max_seq = N;
    tp.n_threads = 2;
    kiln_trainer *t = NULL;
    CHECK_MSG(kiln_trainer_create(m, &tp, &t) == KILN_OK, "%s", kiln_last_error());
    CHECK(kiln_train_forward_hidden(t, ids, N, pos, N, hid) == KILN_OK);
    CHECK(kiln_train_discard(t) == KILN_OK);
    kiln_backend *be = NULL;
    CHECK(kiln_backend_acquire(-1, 0, 2, &be) == KILN_OK);
    be->i->matmul(be, got, hid, m->lm_head, NULL, N);
    size_t differ = 0;
    for (size_t i = 0; i < (size_t)N * V; i++) differ += memcmp(&ref[i], &got[i], 4) != 0;
    CHECK_MSG(differ == 0, "%s tied %d bias %d: %zu of %d logits differ between generation and training", type, tied,
              bias, differ, N * V);
    kiln_backend_release(be);
    kiln_trainer_free(t);
    kiln_context_free(ctx);
    kiln_model_close(m);
    free(ref);
    free(got);
    free(hid);
}

int main(void) {
    char tokp[1200];
    if (!test_tokenizer_path(tokp, sizeof tokp, &V)) {
        printf("no tokenizer (the shared test vocabulary or $KILN_SMOLLM2_GGUF): skipped\n");
        return 77;
    }
    one(tokp, "llama", 1, 0, "");
    one(tokp, "llama", 0, 1, "");
    one(tokp, "qwen2", 1, 1, "");
    one(tokp, "qwen3", 0, 0, "");
    /* Gemma 3 (models/gemma3.c): a sliding window of 8 on layer 0 (the prefill chunks and
     * the 70 rows cross it), full attention on layer 1, the query scale from the config; its
     * norms' multipliers 1 + w, which training recomputes from w, drawn in [0.8, 1.2) */
    one(tokp, "gemma3_text", 1, 0,
        ", \"sliding_window\": 8, \"layer_types\": [\"sliding_attention\", \"full_attention\"],"
        " \"query_pre_attn_scalar\": 24, \"rope_local_base_freq\": 10000.0,"
        " \"hidden_activation\": \"gelu_pytorch_tanh\"");
    return test_finish("test_forward_train");
}
