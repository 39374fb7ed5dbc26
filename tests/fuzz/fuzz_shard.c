/* fuzz_shard.c -- libFuzzer target for the KILNTOKS shard reader and the batch sampler
 * (src/train/shards.h): arbitrary bytes are written to a file and opened with
 * kiln_shard_open; when accepted, every document's range and tokens are read, checked against
 * the format's rules, and a sampler over the shard draws batches, so an offset or id the
 * reader lets through that points outside the file shows up under ASan.
 *
 * The first input byte picks a mode: bit 0 set reseals the rest before opening (the content
 * SHA-256 at 104 and the header SHA-256 at 224 recomputed), so mutations reach the field
 * and offset checks behind the checksums; bit 1 asks the reader to verify the content
 * checksum too. Seeds: tests/fuzz/corpus_shard/ (tests/fuzz/make_corpus_shard.py). */
#include "fuzz_file.h"
#include "train/shards.h"
#include "base/sha256.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static volatile uint64_t g_sink; /* keeps the reads from being optimized away */

static void reseal(uint8_t *b, size_t n) {
    if (n < 256) return;
    kiln_sha256(b + 256, n - 256, b + 104);
    kiln_sha256(b, 224, b + 224);
}

static void walk(kiln_shard *s) {
    const kiln_shard_info *in = kiln_shard_get_info(s);
    if (in->token_bytes != 2 && in->token_bytes != 4) abort();
    uint64_t prev_end = 0, h = 0;
    int32_t buf[64];
    for (uint64_t d = 0; d < in->n_docs; d++) {
        uint64_t a, e;
        if (kiln_shard_doc_range(s, d, &a, &e) != KILN_OK) abort();
        if (a != prev_end || e < a || e > in->n_tokens) abort(); /* contiguous, inside */
        if (in->eos_id != KILN_SHARD_NO_EOS) {
            if (e == a) abort(); /* every document ends with EOS */
            int32_t last;
            if (kiln_shard_read(s, e - 1, 1, &last) != KILN_OK || (uint32_t)last != in->eos_id) abort();
        }
        prev_end = e;
    }
    if (prev_end != in->n_tokens) abort();
    uint64_t dummy_a, dummy_e;
    if (kiln_shard_doc_range(s, in->n_docs, &dummy_a, &dummy_e) == KILN_OK) abort(); /* past the end */
    for (uint64_t t = 0; t < in->n_tokens; t += 64) {
        size_t n = in->n_tokens - t < 64 ? (size_t)(in->n_tokens - t) : 64;
        if (kiln_shard_read(s, t, n, buf) != KILN_OK) abort();
        for (size_t i = 0; i < n; i++) {
            if (buf[i] < 0 || (uint32_t)buf[i] >= in->vocab_size) abort(); /* ids checked on open */
            h += (uint32_t)buf[i];
        }
    }
    if (kiln_shard_read(s, in->n_tokens, 1, buf) == KILN_OK) abort();
    /* a sampler over both splits: any window it draws lies inside the file */
    kiln_batch_sampler_params p = kiln_batch_sampler_default_params();
    p.batch = 2;
    p.seq_len = 3;
    p.eval_fraction = 0.5;
    for (int split = KILN_SPLIT_TRAIN; split <= KILN_SPLIT_EVAL; split++) {
        p.split = (kiln_split)split;
        kiln_batch_sampler *bs = NULL;
        if (kiln_batch_sampler_create(&s, 1, &p, &bs) != KILN_OK) continue;
        int32_t out[2 * 4];
        for (uint64_t step = 0; step < 4; step++) {
            if (kiln_batch_sampler_get(bs, step, out) != KILN_OK) abort();
            for (int i = 0; i < 8; i++) h += (uint32_t)out[i];
        }
        kiln_batch_sampler_free(bs);
    }
    g_sink += h;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    int mode = 0;
    const char *path = fuzz_file_with_mode("kiln_fuzz_shard", data, size, &mode, reseal);
    if (!path) return 0;
    kiln_shard *s = NULL;
    kiln_status st = kiln_shard_open(path, (mode & 2) ? KILN_SHARD_VERIFY_CHECKSUM : 0, &s);
    if (getenv("KILN_FUZZ_VERBOSE")) fprintf(stderr, "fuzz_shard: %s\n", st == KILN_OK ? "accepted" : kiln_last_error());
    if (st != KILN_OK) {
        if (s) abort(); /* output untouched on failure */
        return 0;
    }
    walk(s);
    kiln_shard_close(s);
    return 0;
}
