/* test_shards.c -- KILNTOKS shards: round trip (u16 and u32 tokens), hostile files, the
 * held-out split's fractions, and the sampler: batches are a pure function of (seed, t), a
 * step redone alone equals the same step in sequence, windows are real stream slices. */
#include "test_util.h"
#include "train/checkpoint.h"
#include "train/shards.h"

#include <math.h>
#include <sys/stat.h>
#include <unistd.h>

static char g_root[256];

static uint8_t *read_file(const char *path, size_t *n) {
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    fseek(f, 0, SEEK_END);
    long sz = ftell(f);
    fseek(f, 0, SEEK_SET);
    uint8_t *b = malloc((size_t)sz + 1);
    *n = fread(b, 1, (size_t)sz, f);
    fclose(f);
    return b;
}
static void write_file(const char *path, const uint8_t *b, size_t n) {
    FILE *f = fopen(path, "wb");
    fwrite(b, 1, n, f);
    fclose(f);
}

/* Document d of the test corpus: length 1 + (d*7 % 50), tokens (d*31 + i*17) % (vocab-1) + 1
 * (0 is reserved as EOS). */
static size_t doc_len(size_t d) { return 1 + (d * 7) % 50; }
static int32_t doc_tok(size_t d, size_t i, uint32_t vocab) { return (int32_t)((d * 31 + i * 17) % (vocab - 1) + 1); }

static void make_shard(const char *path, uint32_t vocab, uint32_t eos, size_t n_docs, size_t first_doc) {
    uint8_t fp[32];
    kiln_sha256("test-tokenizer", 14, fp);
    kiln_shard_writer *w = NULL;
    CHECK(kiln_shard_writer_create(path, vocab, eos, fp, &w) == KILN_OK);
    int32_t ids[64];
    for (size_t d = first_doc; d < first_doc + n_docs; d++) {
        for (size_t i = 0; i < doc_len(d); i++) ids[i] = doc_tok(d, i, vocab);
        CHECK(kiln_shard_writer_add_doc(w, ids, doc_len(d)) == KILN_OK);
    }
    CHECK(kiln_shard_writer_commit(w) == KILN_OK);
}

static void test_round_trip(void) {
    uint32_t vocabs[2] = {1000, 100000};
    for (int v = 0; v < 2; v++) {
        char path[512];
        snprintf(path, sizeof path, "%s/rt%d.kilntoks", g_root, v);
        make_shard(path, vocabs[v], 0, 300, 0);
        kiln_shard *s = NULL;
        CHECK(kiln_shard_open(path, KILN_SHARD_VERIFY_CHECKSUM, &s) == KILN_OK);
        if (!s) continue;
        const kiln_shard_info *in = kiln_shard_get_info(s);
        CHECK(in->token_bytes == (v ? 4u : 2u) && in->n_docs == 300 && in->eos_id == 0 && in->vocab_size == vocabs[v]);
        uint64_t total = 0;
        int bad = 0;
        for (size_t d = 0; d < 300; d++) {
            uint64_t a, b;
            CHECK(kiln_shard_doc_range(s, d, &a, &b) == KILN_OK);
            bad += (a != total || b - a != doc_len(d) + 1);
            int32_t buf[64];
            CHECK(kiln_shard_read(s, a, (size_t)(b - a), buf) == KILN_OK);
            for (size_t i = 0; i < doc_len(d); i++) bad += buf[i] != doc_tok(d, i, vocabs[v]);
            bad += buf[doc_len(d)] != 0;
            total = b;
        }
        CHECK(bad == 0 && total == in->n_tokens);
        uint64_t a, b;
        CHECK_ERR(kiln_shard_doc_range(s, 300, &a, &b), KILN_ERR_RANGE, "document 300 of 300");
        int32_t x[2];
        CHECK_ERR(kiln_shard_read(s, in->n_tokens - 1, 2, x), KILN_ERR_RANGE, "past the end");
        kiln_shard_close(s);
        struct stat st;
        char tmp[600];
        snprintf(tmp, sizeof tmp, "%s.tmp-%ld", path, (long)getpid());
        CHECK(stat(tmp, &st) != 0); /* renamed away */
    }
    /* writer errors; an aborted writer leaves nothing */
    char path[512];
    snprintf(path, sizeof path, "%s/bad.kilntoks", g_root);
    kiln_shard_writer *w;
    CHECK_ERR(kiln_shard_writer_create(path, 10, 10, NULL, &w), KILN_ERR_RANGE, "eos_id 10");
    CHECK_ERR(kiln_shard_writer_create(path, 0, KILN_SHARD_NO_EOS, NULL, &w), KILN_ERR_INVALID_ARG, "vocab_size");
    CHECK(kiln_shard_writer_create(path, 10, KILN_SHARD_NO_EOS, NULL, &w) == KILN_OK);
    int32_t ids[3] = {1, 10, 2};
    CHECK_ERR(kiln_shard_writer_add_doc(w, ids, 3), KILN_ERR_RANGE, "token 1 is 10");
    kiln_shard_writer_abort(w);
    CHECK(access(path, F_OK) != 0);
    char tmp[600];
    snprintf(tmp, sizeof tmp, "%s.tmp-%ld", path, (long)getpid());
    CHECK(access(tmp, F_OK) != 0);
    snprintf(path, sizeof path, "/nonexistent-dir/x.kilntoks");
    CHECK_ERR(kiln_shard_writer_create(path, 10, KILN_SHARD_NO_EOS, NULL, &w), KILN_ERR_IO, "/nonexistent-dir/x.kilntoks.tmp-");
}

static void reseal(uint8_t *b, size_t n) {
    kiln_sha256(b + 256, n - 256, b + 104);
    kiln_sha256(b, 224, b + 224);
}

static void test_hostile(void) {
    char path[512], bad[512];
    snprintf(path, sizeof path, "%s/h.kilntoks", g_root);
    snprintf(bad, sizeof bad, "%s/h_bad.kilntoks", g_root);
    make_shard(path, 1000, 0, 20, 0);
    size_t n;
    uint8_t *o = read_file(path, &n);
    uint8_t *b = malloc(n + 64);
    kiln_shard *s;
    uint64_t n_tokens, offs;
    memcpy(&n_tokens, o + 32, 8);
    memcpy(&offs, o + 56, 8);
#define EDIT(off, val, width, needle)                                                              \
    do {                                                                                           \
        memcpy(b, o, n);                                                                           \
        uint64_t v_ = (val);                                                                       \
        memcpy(b + (off), &v_, (width));                                                           \
        reseal(b, n);                                                                              \
        write_file(bad, b, n);                                                                     \
        CHECK_ERR(kiln_shard_open(bad, KILN_SHARD_VERIFY_CHECKSUM, &s), KILN_ERR_FORMAT, needle);  \
    } while (0)
    EDIT(12, 128, 4, "header_size");
    EDIT(16, 0, 4, "vocab_size 0");
    EDIT(16, 70000, 4, "token_bytes 2, expected 4");
    EDIT(24, 5000, 4, "eos_id 5000");
    EDIT(28, 1, 4, "unknown flags");
    EDIT(150, 1, 1, "reserved header byte 150");
    EDIT(32, n_tokens + 40, 8, "offsets_offset");
    EDIT(32, UINT64_MAX / 2, 8, "does not fit");
    EDIT(40, 21, 8, "offsets do not end");
    EDIT(40, UINT64_MAX, 8, "offsets do not end");
    EDIT(48, 320, 8, "tokens_offset 320");
    EDIT(64, n + 1, 8, "truncated or extended");
    EDIT(offs, 1, 8, "offsets[0] is 1");
    EDIT(offs + 8 * 20, n_tokens - 1, 8, "expected n_tokens");
    EDIT(offs + 8 * 5, 0, 8, "document 4: offsets decrease");
    EDIT(offs + 8 * 5, 5000, 8, "decrease");
    EDIT(256 + 2 * 3, 1000, 2, ">= vocab_size 1000");
    EDIT(256 + 2, 7, 2, "document 0 does not end with EOS"); /* first doc is 1 token + EOS */
    if (n_tokens % 32 != 0) EDIT(256 + 2 * n_tokens, 1, 1, "padding byte");
    /* header checksum, content checksum, magic, version, truncation */
    memcpy(b, o, n);
    b[40] ^= 1;
    write_file(bad, b, n);
    CHECK_ERR(kiln_shard_open(bad, 0, &s), KILN_ERR_FORMAT, "header checksum mismatch");
    memcpy(b, o, n);
    b[300] ^= 1; /* token 22: still < vocab, so only the checksum sees it */
    write_file(bad, b, n);
    CHECK_ERR(kiln_shard_open(bad, KILN_SHARD_VERIFY_CHECKSUM, &s), KILN_ERR_FORMAT, "content checksum mismatch");
    s = NULL;
    CHECK(kiln_shard_open(bad, 0, &s) == KILN_OK); /* structurally valid without the hash */
    kiln_shard_close(s);
    memcpy(b, o, n);
    b[0] = 'X';
    write_file(bad, b, n);
    CHECK_ERR(kiln_shard_open(bad, 0, &s), KILN_ERR_FORMAT, "bad magic");
    memcpy(b, o, n);
    b[8] = 9;
    write_file(bad, b, n);
    CHECK_ERR(kiln_shard_open(bad, 0, &s), KILN_ERR_UNSUPPORTED, "version 9");
    int accepted = 0;
    for (size_t len = 0; len < n; len += len < 300 ? 1 : 7) {
        write_file(bad, o, len);
        if (kiln_shard_open(bad, 0, &s) == KILN_OK) {
            accepted++;
            kiln_shard_close(s);
        }
    }
    CHECK(accepted == 0);
    CHECK_ERR(kiln_shard_open("/nonexistent.kilntoks", 0, &s), KILN_ERR_IO, "/nonexistent.kilntoks");
    free(o);
    free(b);
}

static void test_split_and_sampler(void) {
    /* split fractions over 100k documents */
    double fr[4] = {0.0, 0.01, 0.1, 0.5};
    for (int k = 0; k < 4; k++) {
        size_t n_eval = 0, N = 100000;
        for (size_t d = 0; d < N; d++) n_eval += (size_t)kiln_split_is_eval(42, d, fr[k]);
        double got = (double)n_eval / (double)N, sd = sqrt(fr[k] * (1 - fr[k]) / (double)N);
        CHECK_MSG(fabs(got - fr[k]) <= 5 * sd + 1e-12, "fraction %g: got %g", fr[k], got);
    }
    CHECK(kiln_split_is_eval(1, 5, 1.0) == 1 && kiln_split_is_eval(1, 5, NAN) == 0);
    /* the hash is fixed forever: pin a few values (splitmix64 reference) */
    CHECK(kiln_hash_mix64(0) == 0xE220A8397B1DCDAFull);
    CHECK(kiln_hash_mix64(1) == 0x910A2DEC89025CC1ull);

    char p1[512], p2[512];
    snprintf(p1, sizeof p1, "%s/s1.kilntoks", g_root);
    snprintf(p2, sizeof p2, "%s/s2.kilntoks", g_root);
    make_shard(p1, 500, 0, 400, 0);
    make_shard(p2, 500, 0, 300, 400);
    kiln_shard *sh[2] = {NULL, NULL};
    CHECK(kiln_shard_open(p1, 0, &sh[0]) == KILN_OK);
    CHECK(kiln_shard_open(p2, 0, &sh[1]) == KILN_OK);
    if (!sh[0] || !sh[1]) return;
    kiln_batch_sampler_params p = kiln_batch_sampler_default_params();
    p.seed = 7;
    p.split_seed = 3;
    p.eval_fraction = 0.1;
    p.batch = 4;
    p.seq_len = 64;
    kiln_batch_sampler *tr = NULL, *ev = NULL;
    CHECK(kiln_batch_sampler_create(sh, 2, &p, &tr) == KILN_OK);
    p.split = KILN_SPLIT_EVAL;
    CHECK(kiln_batch_sampler_create(sh, 2, &p, &ev) == KILN_OK);
    if (!tr || !ev) return;
    uint64_t total = kiln_shard_get_info(sh[0])->n_tokens + kiln_shard_get_info(sh[1])->n_tokens;
    CHECK(kiln_batch_sampler_n_docs(tr) + kiln_batch_sampler_n_docs(ev) == 700);
    CHECK(kiln_batch_sampler_n_tokens(tr) + kiln_batch_sampler_n_tokens(ev) == total);
    CHECK(kiln_batch_sampler_n_docs(ev) > 30 && kiln_batch_sampler_n_docs(ev) < 120);

    /* reference stream of the train split, built independently from the generator */
    int32_t *stream = malloc(total * sizeof *stream);
    uint64_t ns = 0;
    for (size_t d = 0; d < 700; d++) {
        if (kiln_split_is_eval(3, d, 0.1)) continue;
        for (size_t i = 0; i < doc_len(d); i++) stream[ns++] = doc_tok(d, i, 500);
        stream[ns++] = 0;
    }
    CHECK(ns == kiln_batch_sampler_n_tokens(tr));
    enum { STEPS = 50, B = 4, T1 = 65 };
    static int32_t seq[STEPS][B * T1];
    int not_slice = 0;
    for (int t = 0; t < STEPS; t++) {
        CHECK(kiln_batch_sampler_get(tr, (uint64_t)t, seq[t]) == KILN_OK);
        for (int b = 0; b < B; b++) {
            /* each row is a slice of the stream at the position the documented formula gives */
            uint64_t h = kiln_hash3(kiln_hash2(7, KILN_SPLIT_TRAIN), (uint64_t)t, (uint64_t)b);
            uint64_t pos = (uint64_t)(((unsigned __int128)h * (ns - 64)) >> 64);
            not_slice += memcmp(seq[t] + b * T1, stream + pos, T1 * sizeof(int32_t)) != 0;
        }
    }
    CHECK(not_slice == 0);
    /* redo steps alone, in reverse, from a fresh sampler: same bits */
    kiln_batch_sampler *tr2 = NULL;
    p.split = KILN_SPLIT_TRAIN;
    CHECK(kiln_batch_sampler_create(sh, 2, &p, &tr2) == KILN_OK);
    int differ = 0;
    for (int t = STEPS - 1; t >= 0; t -= 3) {
        int32_t again[B * T1];
        kiln_batch_sampler_get(tr2, (uint64_t)t, again);
        differ += memcmp(again, seq[t], sizeof again) != 0;
    }
    CHECK(differ == 0);
    /* another seed gives other batches; consecutive steps differ */
    int32_t other[B * T1];
    p.seed = 8;
    kiln_batch_sampler *tr3 = NULL;
    CHECK(kiln_batch_sampler_create(sh, 2, &p, &tr3) == KILN_OK);
    if (tr3) kiln_batch_sampler_get(tr3, 0, other);
    CHECK(memcmp(other, seq[0], sizeof other) != 0);
    CHECK(memcmp(seq[1], seq[0], sizeof other) != 0);
    /* eval windows never contain train documents: every eval row is a slice of the eval stream */
    int32_t evb[B * T1];
    CHECK(kiln_batch_sampler_get(ev, 0, evb) == KILN_OK);
    uint64_t ne = 0;
    for (size_t d = 0; d < 700; d++) {
        if (!kiln_split_is_eval(3, d, 0.1)) continue;
        for (size_t i = 0; i < doc_len(d); i++) stream[ne++] = doc_tok(d, i, 500);
        stream[ne++] = 0;
    }
    int found = 0;
    for (int b = 0; b < B; b++)
        for (uint64_t q = 0; q + T1 <= ne; q++)
            if (!memcmp(stream + q, evb + b * T1, T1 * sizeof(int32_t))) {
                found++;
                break;
            }
    CHECK(found == B);
    /* errors */
    kiln_batch_sampler *x = NULL;
    p.seq_len = (int)total;
    CHECK_ERR(kiln_batch_sampler_create(sh, 2, &p, &x), KILN_ERR_RANGE, "fewer than seq_len+1");
    p.seq_len = 8;
    p.eval_fraction = 1.5;
    CHECK_ERR(kiln_batch_sampler_create(sh, 2, &p, &x), KILN_ERR_INVALID_ARG, "eval_fraction");
    p.eval_fraction = 0.0;
    p.split = KILN_SPLIT_EVAL;
    CHECK_ERR(kiln_batch_sampler_create(sh, 2, &p, &x), KILN_ERR_RANGE, "eval split holds 0 tokens");
    /* a shard of another tokenizer cannot join */
    char p3[512];
    snprintf(p3, sizeof p3, "%s/s3.kilntoks", g_root);
    kiln_shard_writer *w;
    CHECK(kiln_shard_writer_create(p3, 500, 0, NULL, &w) == KILN_OK);
    int32_t ids[3] = {1, 2, 3};
    kiln_shard_writer_add_doc(w, ids, 3);
    CHECK(kiln_shard_writer_commit(w) == KILN_OK);
    kiln_shard *mix[2] = {sh[0], NULL};
    CHECK(kiln_shard_open(p3, 0, &mix[1]) == KILN_OK);
    p.split = KILN_SPLIT_TRAIN;
    CHECK_ERR(kiln_batch_sampler_create(mix, 2, &p, &x), KILN_ERR_INVALID_ARG, "different tokenizers");
    kiln_shard_close(mix[1]);
    free(stream);
    kiln_batch_sampler_free(tr);
    kiln_batch_sampler_free(tr2);
    kiln_batch_sampler_free(tr3);
    kiln_batch_sampler_free(ev);
    kiln_shard_close(sh[0]);
    kiln_shard_close(sh[1]);
}

int main(void) {
    snprintf(g_root, sizeof g_root, "/tmp/kiln_test_shards_%ld", (long)getpid());
    mkdir(g_root, 0755);
    kiln_mem_stats m0, m1;
    kiln_mem_get_stats(&m0);
    test_round_trip();
    test_hostile();
    test_split_and_sampler();
    kiln_mem_get_stats(&m1);
    CHECK_MSG(m1.live_blocks == m0.live_blocks, "leaked %zu blocks",
              (size_t)(m1.live_blocks - m0.live_blocks));
    if (!t_failures) {
        char cmd[300];
        snprintf(cmd, sizeof cmd, "rm -rf '%s'", g_root);
        if (system(cmd) != 0) fprintf(stderr, "cleanup failed\n");
    }
    return test_finish("test_shards");
}
