/*
 * gpu_test_models.h -- setup shared by the whole-model GPU tests (test_cuda_model.c,
 * test_cuda_train.c, test_cuda_train_fast.c): a seeded splitmix64 stream (the including file
 * defines GPU_TEST_SEED first, so each test keeps its own numbers), a monotonic clock, the
 * config.json of a small Llama-family model for kiln_model_create, randomised norms and
 * biases, the vocabulary folder and a temporary folder. Everything is static inline: one copy
 * per test, no unused-function warnings.
 */
#ifndef KILN_GPU_TEST_MODELS_H
#define KILN_GPU_TEST_MODELS_H

#include "models/model.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#ifndef GPU_TEST_SEED
#error "define GPU_TEST_SEED before including gpu_test_models.h"
#endif

static uint64_t g_rng = GPU_TEST_SEED;
static char g_tmpdir[256];

static inline uint64_t rnd_u64(void) {
    uint64_t z = (g_rng += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

/* Uniform in [-1, 1). */
static inline float rnd_unit(void) {
    return (float)((double)(rnd_u64() >> 11) * 0x1p-53 * 2.0 - 1.0);
}

static inline double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* g_tmpdir/<name>.json: the config of a model of architecture arch (llama, qwen2, qwen3,
 * gemma3_text, qwen3_5_text);
 * its path to path. 1 on success. */
static inline int gpu_write_config(const char *name, const char *arch, int C, int L, int NH,
                                   int KVH, int HS, int FF, int V, int tied, double rope_theta,
                                   char *path, size_t cap) {
    snprintf(path, cap, "%s/%s.json", g_tmpdir, name);
    FILE *f = fopen(path, "w");
    if (!f) return 0;
    if (!strcmp(arch, "gemma3_text")) { /* a window of 8 (prompts cross it), one full layer in three */
        fprintf(f,
                "{\"architectures\": [\"Gemma3ForCausalLM\"], \"model_type\": \"gemma3_text\","
                " \"hidden_size\": %d, \"num_hidden_layers\": %d, \"num_attention_heads\": %d,"
                " \"num_key_value_heads\": %d, \"head_dim\": %d, \"intermediate_size\": %d,"
                " \"vocab_size\": %d, \"max_position_embeddings\": 4096, \"rms_norm_eps\": 1e-6,"
                " \"sliding_window\": 8, \"sliding_window_pattern\": 3, \"query_pre_attn_scalar\": 24,"
                " \"rope_theta\": %.1f, \"rope_local_base_freq\": 10000.0,"
                " \"tie_word_embeddings\": %s}\n",
                C, L, NH, KVH, HS, FF, V, rope_theta, tied ? "true" : "false");
        return fclose(f) == 0;
    }
    if (!strcmp(arch, "qwen3_5_text")) { /* Gated DeltaNet layers (2 key, 4 value heads of 16)
                                          * around every second layer's gated attention */
        fprintf(f,
                "{\"architectures\": [\"Qwen3_5ForCausalLM\"], \"model_type\": \"qwen3_5_text\","
                " \"hidden_size\": %d, \"num_hidden_layers\": %d, \"num_attention_heads\": %d,"
                " \"num_key_value_heads\": %d, \"head_dim\": %d, \"intermediate_size\": %d,"
                " \"vocab_size\": %d, \"max_position_embeddings\": 4096, \"rms_norm_eps\": 1e-6,"
                " \"full_attention_interval\": 2, \"linear_num_key_heads\": 2, \"linear_num_value_heads\": 4,"
                " \"linear_key_head_dim\": 16, \"linear_value_head_dim\": 16, \"linear_conv_kernel_dim\": 4,"
                " \"rope_parameters\": {\"rope_type\": \"default\", \"rope_theta\": %.1f,"
                " \"partial_rotary_factor\": 0.25}, \"tie_word_embeddings\": %s}\n",
                C, L, NH, KVH, HS, FF, V, rope_theta, tied ? "true" : "false");
        return fclose(f) == 0;
    }
    fprintf(f,
            "{\"architectures\": [\"%s\"], \"model_type\": \"%s\", \"hidden_size\": %d,"
            " \"num_hidden_layers\": %d, \"num_attention_heads\": %d, \"num_key_value_heads\": %d,"
            " \"head_dim\": %d, \"intermediate_size\": %d, \"vocab_size\": %d,"
            " \"max_position_embeddings\": 4096, \"rms_norm_eps\": 1e-6, \"rope_theta\": %.1f,"
            " \"tie_word_embeddings\": %s, \"hidden_act\": \"silu\"}\n",
            !strcmp(arch, "llama") ? "LlamaForCausalLM"
            : !strcmp(arch, "qwen2") ? "Qwen2ForCausalLM" : "Qwen3ForCausalLM",
            arch, C, L, NH, KVH, HS, FF, V, rope_theta, tied ? "true" : "false");
    return fclose(f) == 0;
}

/* Norms 1 + 0.2 u, biases 0.05 u (every vector role, in the roles table's walk order, the
 * final norm included): kiln_model_create makes them 1 and 0, which would hide a vector that
 * never reached the device. */
static inline kiln_status gpu_randomise_role(void *ctx, const kiln_param_role *r, int layer) {
    kiln_model *m = ctx;
    kiln_wref *w = kiln_model_ref(m, r, layer);
    if (!kiln_role_is_vector(r) || !w->vec) return KILN_OK;
    float *v = (float *)w->vec;
    int64_t n = kiln_role_floats(r, &m->cfg);
    for (int64_t j = 0; j < n; j++) v[j] = r->init == KILN_INIT_ONES ? 1.0f + 0.2f * rnd_unit() : 0.05f * rnd_unit();
    return KILN_OK;
}
static inline void gpu_randomise_vectors(kiln_model *m) {
    (void)kiln_arch_walk(m->arch, m->cfg.n_layer, gpu_randomise_role, m);
}

/* The vocabulary folder: $KILN_VOCAB_DIR, $KILN_SHARED_DIR/testdata/tokenizer-vectors, or the
 * source tree's ../shared/testdata/tokenizer-vectors (buf holds the built path). */
static inline const char *gpu_vocab_dir(char *buf, size_t cap) {
    const char *dir = getenv("KILN_VOCAB_DIR");
    if (dir) return dir;
    const char *env = getenv("KILN_SHARED_DIR");
    if (env) snprintf(buf, cap, "%s/testdata/tokenizer-vectors", env);
    else snprintf(buf, cap, "%s", KILN_SOURCE_DIR "/../shared/testdata/tokenizer-vectors");
    return buf;
}

/* The exit status of a test whose vocabulary file tok is missing: 77 (skipped) on a machine
 * without a usable GPU, where the GPU part could not run anyway (a clone without the shared
 * test data, in CI), else 1: on a GPU machine a missing vocabulary is a broken setup, never a
 * skip. Says which. */
static inline int gpu_missing_vocab_status(const char *tok) {
    kiln_backend *be = NULL;
    if (kiln_backend_cuda_create(0, &be) != KILN_OK) {
        fprintf(stderr, "no vocabulary at %s and no GPU (%s): skipped\n", tok, kiln_last_error());
        return 77;
    }
    kiln_backend_free(be);
    fprintf(stderr, "FAIL: no vocabulary at %s (pass the folder as the argument)\n", tok);
    return 1;
}

/* g_tmpdir = a new $TMPDIR/kiln-<tag>-XXXXXX. 1 on success (else says why). */
static inline int gpu_make_tmpdir(const char *tag) {
    const char *tmp = getenv("TMPDIR");
    snprintf(g_tmpdir, sizeof g_tmpdir, "%s/kiln-%s-XXXXXX", tmp ? tmp : "/tmp", tag);
    if (mkdtemp(g_tmpdir)) return 1;
    fprintf(stderr, "FAIL: mkdtemp %s\n", g_tmpdir);
    return 0;
}

#endif /* KILN_GPU_TEST_MODELS_H */
