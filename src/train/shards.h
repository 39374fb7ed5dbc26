/*
 * shards.h -- token shard files (KILNTOKS), the held-out split and the deterministic batch
 * sampler. Format and hash definitions: docs/TRAINING_FORMATS.md.
 *
 * A shard holds documents of token ids, concatenated, with u64 document offsets:
 *   header (256 bytes) | tokens (u16 if vocab_size <= 65536, else u32) | pad | offsets
 * Document d is tokens [offsets[d], offsets[d+1]); when the shard has an EOS id, the writer
 * appends it to every document, so each document ends with EOS and the concatenation is
 * "doc0 EOS doc1 EOS ...".
 *
 * The split: document g (its global index: documents of shards[0] first, then shards[1],
 * ...) is held out for evaluation iff kiln_split_is_eval(split_seed, g, eval_fraction).
 *
 * The sampler: the batch of step t is a pure function of (seed, t, split, shards, B, T):
 * sequence b starts at position p = mulhi64(h, N - T) of the split's token stream (the
 * concatenation of that split's documents in global order, N tokens) with
 * h = kiln_hash3(kiln_hash2(seed, split tag), t, b), and holds the T+1 tokens
 * stream[p .. p+T] (inputs are the first T, targets the last T). Windows cross document
 * boundaries (through the EOS). Any step can be recomputed alone, in any order, from any
 * thread; "data position" in a checkpoint is simply the next step.
 */
#ifndef KILN_TRAIN_SHARDS_H
#define KILN_TRAIN_SHARDS_H

#include "../base/base.h"
#include "../tokenizer/tokenizer.h"

#include <stdint.h>

#define KILN_SHARD_MAGIC "KILNTOKS"
#define KILN_SHARD_VERSION 1u
#define KILN_SHARD_NO_EOS UINT32_MAX

/* ---- counter-based hashes (splitmix64's finaliser; exact integer arithmetic) -------------- */

/* mix(x): z = x + 0x9E3779B97F4A7C15; z = (z ^ z>>30) * 0xBF58476D1CE4E5B9;
 * z = (z ^ z>>27) * 0x94D049BB133111EB; return z ^ z>>31  (all mod 2^64). */
uint64_t kiln_hash_mix64(uint64_t x);
static inline uint64_t kiln_hash2(uint64_t a, uint64_t b) { return kiln_hash_mix64(kiln_hash_mix64(a) ^ b); }
static inline uint64_t kiln_hash3(uint64_t a, uint64_t b, uint64_t c) {
    return kiln_hash_mix64(kiln_hash2(a, b) ^ c);
}

/* 1 iff document `doc` (global index) belongs to the evaluation split:
 * kiln_hash3(split_seed, 0x73706c6974 ("split"), doc) < floor(eval_fraction * 2^64).
 * eval_fraction <= 0: never; >= 1: always. */
int kiln_split_is_eval(uint64_t split_seed, uint64_t doc, double eval_fraction);

/* ---- writer --------------------------------------------------------------------------------- */

typedef struct kiln_shard_writer kiln_shard_writer;

/* Start writing a shard to `path` (atomically: <path>.tmp-<pid>, renamed on commit).
 * vocab_size in 1..2^31; eos_id < vocab_size, or KILN_SHARD_NO_EOS for none; fingerprint:
 * 32 bytes identifying the tokenizer (`kiln data` writes kiln_tokenizer_fingerprint, which
 * `kiln train` compares with the model's), or NULL for zeros. */
kiln_status kiln_shard_writer_create(const char *path, uint32_t vocab_size, uint32_t eos_id,
                                     const uint8_t fingerprint[32], kiln_shard_writer **out);
/* Append one document of n token ids (each in [0, vocab_size); n may be 0) plus the EOS.
 * ids are copied. KILN_ERR_RANGE names the offending id and its index. */
kiln_status kiln_shard_writer_add_doc(kiln_shard_writer *w, const int32_t *ids, size_t n);
/* Write offsets and header, fsync, rename to path, fsync the parent directory. Always consumes
 * w; on failure the tmp file is removed and nothing exists at path that was not there. */
kiln_status kiln_shard_writer_commit(kiln_shard_writer *w);
void kiln_shard_writer_abort(kiln_shard_writer *w); /* removes the tmp file; NULL is a no-op */

/* ---- reader --------------------------------------------------------------------------------- */

typedef struct kiln_shard kiln_shard;

typedef struct kiln_shard_info {
    uint32_t vocab_size;
    uint32_t token_bytes; /* 2 or 4 */
    uint32_t eos_id;      /* KILN_SHARD_NO_EOS if none */
    uint64_t n_tokens;    /* including the EOS tokens */
    uint64_t n_docs;
    uint8_t fingerprint[32];
} kiln_shard_info;

enum { KILN_SHARD_VERIFY_CHECKSUM = 1 }; /* kiln_shard_open flags */

/* mmap a shard and validate every header field, every document offset and every token id
 * (< vocab_size; documents end with EOS when the shard has one); with
 * KILN_SHARD_VERIFY_CHECKSUM also the SHA-256 of the content. Errors name path, field and
 * offset. */
kiln_status kiln_shard_open(const char *path, int flags, kiln_shard **out);
void kiln_shard_close(kiln_shard *s); /* NULL is a no-op */
const kiln_shard_info *kiln_shard_get_info(const kiln_shard *s);
/* Document d's token range [*start, *end) in the shard's token stream. */
kiln_status kiln_shard_doc_range(const kiln_shard *s, uint64_t d, uint64_t *start, uint64_t *end);
/* Copy n tokens starting at `start` into out (widened to int32). KILN_ERR_RANGE past the end. */
kiln_status kiln_shard_read(const kiln_shard *s, uint64_t start, size_t n, int32_t *out);

/* ---- sampler -------------------------------------------------------------------------------- */

typedef enum kiln_split { KILN_SPLIT_TRAIN = 1, KILN_SPLIT_EVAL = 2 } kiln_split;

typedef struct kiln_batch_sampler_params {
    uint64_t seed;        /* batch positions */
    uint64_t split_seed;  /* document assignment (keep it fixed across runs of a dataset) */
    double eval_fraction; /* in [0, 1]; 0: no eval split */
    kiln_split split;     /* which split this sampler draws from */
    int batch;            /* B >= 1 */
    int seq_len;          /* T >= 1; each sequence holds T+1 tokens */
} kiln_batch_sampler_params;

kiln_batch_sampler_params kiln_batch_sampler_default_params(void); /* seed 0, split_seed 0, eval 0, TRAIN,
                                                           B 1, T 1 */

typedef struct kiln_batch_sampler kiln_batch_sampler;

/* Index the chosen split of shards[0..n_shards) (borrowed: they must outlive the sampler and
 * share vocab_size and fingerprint). KILN_ERR_RANGE when the split holds fewer than T+1
 * tokens. Memory: 24 bytes per document of the split. */
kiln_status kiln_batch_sampler_create(kiln_shard *const *shards, int n_shards, const kiln_batch_sampler_params *p,
                                kiln_batch_sampler **out);
void kiln_batch_sampler_free(kiln_batch_sampler *s); /* NULL is a no-op */
/* The batch of step t: out[b*(T+1) + i] = stream[p_b + i], b < B, i <= T. out holds
 * B*(T+1) int32. Pure: the same (params, shards, t) always give the same tokens. */
kiln_status kiln_batch_sampler_get(const kiln_batch_sampler *s, uint64_t step, int32_t *out);
uint64_t kiln_batch_sampler_n_tokens(const kiln_batch_sampler *s); /* N: tokens in the split */
uint64_t kiln_batch_sampler_n_docs(const kiln_batch_sampler *s);   /* documents in the split */

#endif /* KILN_TRAIN_SHARDS_H */
