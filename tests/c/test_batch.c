/*
 * test_batch.c -- the forward over a batch of many sequences (models/model.h kiln_batch) on
 * the CPU backend: a sequence's logits have the same bits whatever else is in the batch
 * (prefill chunks and decode tokens of other sequences, in any mix), and wherever its cache
 * blocks lie in the pool (a shuffled block table). The reference is each sequence run alone,
 * prefilled in one batch and decoded one token at a time. Skipped (77) without a tokenizer
 * to make the model with (test_util.h test_tokenizer_path).
 */
#include "base/base.h"
#include "models/model.h"
#include "test_util.h"

#include <kiln.h>

#include <unistd.h>

static int V = 32000; /* the tokenizer's (test_tokenizer_path) */
#define NSEQ 3
#define MAXT 140

static const int g_len[NSEQ] = {130, 12, 70}; /* tokens of each sequence: across block edges */

static int32_t tok(int s, int i) { return (int32_t)((s * 7919 + i * 104729 + 13) % V); }

/* Logits of every token of sequence s run alone: (len, V). */
static float *alone(kiln_model *m, kiln_backend *be, int s) {
    kiln_forward_state fs;
    if (kiln_forward_state_init(&fs, m, be, MAXT, MAXT, 1, 0) != KILN_OK) return NULL;
    int n = g_len[s], pre = n - 3;
    float *out = malloc(sizeof(float) * (size_t)n * V);
    int32_t ids[MAXT], pos[MAXT], seq[MAXT] = {0};
    for (int i = 0; i < n; i++) ids[i] = tok(s, i), pos[i] = i;
    kiln_batch b = {pre, ids, pos, seq, NULL, 0};
    int ok = out && kiln_model_forward(m, be, &fs, &b, out) == KILN_OK;
    for (int i = pre; ok && i < n; i++) {
        kiln_batch d = {1, ids + i, pos + i, seq, NULL, 0};
        ok = kiln_model_forward(m, be, &fs, &d, out + (size_t)i * V) == KILN_OK;
    }
    kiln_forward_state_free(&fs);
    if (!ok) free(out);
    return ok ? out : NULL;
}

/* The block table of fs, permuted: block b of the pool goes to perm[b]. */
static void shuffle_blocks(kiln_forward_state *fs, uint64_t seed) {
    int n = fs->n_blocks;
    int32_t *perm = malloc(sizeof(int32_t) * (size_t)n);
    for (int i = 0; i < n; i++) perm[i] = i;
    for (int i = n - 1; i > 0; i--) {
        seed = seed * 6364136223846793005ull + 1442695040888963407ull;
        int j = (int)((seed >> 33) % (uint64_t)(i + 1));
        int32_t t = perm[i];
        perm[i] = perm[j];
        perm[j] = t;
    }
    for (int i = 0; i < fs->n_seq * fs->max_blocks; i++) fs->host_table[i] = perm[fs->host_table[i]];
    memcpy((int32_t *)fs->pages.block_table, fs->host_table, sizeof(int32_t) * (size_t)fs->n_seq * fs->max_blocks);
    free(perm);
}

/* One mixed schedule: each step takes from every sequence a chunk of the size the schedule
 * gives (0: none this step; a sequence's last 3 tokens always go one at a time), in an order
 * that rotates, and compares every row with the sequences run alone. */
static void mixed(kiln_model *m, kiln_backend *be, float *const *ref, const int *chunk, int shuffle) {
    kiln_forward_state fs;
    CHECK(kiln_forward_state_init(&fs, m, be, MAXT, 3 * MAXT, NSEQ, 0) == KILN_OK);
    if (shuffle) shuffle_blocks(&fs, (uint64_t)shuffle);
    float *out = malloc(sizeof(float) * (size_t)3 * MAXT * V);
    int done[NSEQ] = {0}, step = 0, differ = 0;
    int32_t ids[3 * MAXT], pos[3 * MAXT], seq[3 * MAXT], from[3 * MAXT];
    for (;;) {
        int n = 0;
        for (int k = 0; k < NSEQ; k++) {
            int s = (k + step) % NSEQ, left = g_len[s] - done[s];
            int take = left <= 3 ? (left > 0) : chunk[(s + step) % NSEQ];
            if (take > left - 3 && left > 3) take = left - 3;
            for (int i = 0; i < take; i++) {
                ids[n] = tok(s, done[s]);
                pos[n] = done[s];
                seq[n] = s;
                from[n++] = s;
                done[s]++;
            }
        }
        if (!n) break;
        kiln_batch b = {n, ids, pos, seq, NULL, 0};
        CHECK(kiln_model_forward(m, be, &fs, &b, out) == KILN_OK);
        for (int i = 0; i < n; i++)
            differ += memcmp(out + (size_t)i * V, ref[from[i]] + (size_t)pos[i] * V, sizeof(float) * V) != 0;
        step++;
    }
    CHECK_MSG(differ == 0, "%d rows of logits differ from the sequences run alone (shuffle %d)", differ, shuffle);
    free(out);
    kiln_forward_state_free(&fs);
}

int main(void) {
    char tokp[1200], cfg[1200];
    if (!test_tokenizer_path(tokp, sizeof tokp, &V)) {
        printf("no tokenizer (the shared test vocabulary or $KILN_SMOLLM2_GGUF): skipped\n");
        return 77;
    }
    snprintf(cfg, sizeof cfg, "%s/kiln-test-batch-%d.json", getenv("TMPDIR") ? getenv("TMPDIR") : "/tmp", (int)getpid());
    FILE *f = fopen(cfg, "w");
    CHECK(f != NULL);
    if (!f) return 1;
    fprintf(f, "{\"model_type\": \"qwen3\", \"hidden_size\": 64, \"num_hidden_layers\": 2,"
               " \"num_attention_heads\": 4, \"num_key_value_heads\": 2, \"head_dim\": 16,"
               " \"intermediate_size\": 96, \"vocab_size\": %d, \"max_position_embeddings\": 256,"
               " \"rms_norm_eps\": 1e-6, \"rope_theta\": 10000.0, \"tie_word_embeddings\": true}\n", V);
    fclose(f);
    kiln_model *m = NULL;
    kiln_status st = kiln_model_create(cfg, tokp, 11, &m);
    remove(cfg);
    CHECK_MSG(st == KILN_OK, "%s", kiln_last_error());
    if (st != KILN_OK) return 1;
    for (int threads = 1; threads <= 3; threads += 2) {
        kiln_backend *be = NULL;
        CHECK(kiln_backend_cpu_create(threads, &be) == KILN_OK);
        float *ref[NSEQ];
        for (int s = 0; s < NSEQ; s++) {
            ref[s] = alone(m, be, s);
            CHECK(ref[s] != NULL);
        }
        if (ref[0] && ref[1] && ref[2]) {
            const int all[NSEQ] = {200, 200, 200}, ragged[NSEQ] = {17, 5, 64}, small[NSEQ] = {1, 3, 2};
            mixed(m, be, ref, all, 0);
            mixed(m, be, ref, ragged, 0);
            mixed(m, be, ref, ragged, 12345);
            mixed(m, be, ref, small, 777);
        }
        for (int s = 0; s < NSEQ; s++) free(ref[s]);
        kiln_backend_free(be);
    }
    kiln_model_close(m);
    return test_finish("test_batch");
}
