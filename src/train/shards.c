/*
 * shards.c -- KILNTOKS token shards (writer, validating mmap reader), the held-out split and
 * the counter-based batch sampler. Layout (little-endian; docs/TRAINING_FORMATS.md):
 *
 *   [0, 256)                 header
 *   [256, 256 + n_tokens*tb) tokens, tb = 2 (vocab_size <= 65536) or 4
 *   zero padding to a multiple of 64
 *   [offsets_offset, end)    n_docs + 1 u64 document offsets, 0 .. n_tokens, non-decreasing
 *
 * Tokens come first so the writer streams them while it counts documents; the offsets (kept
 * in memory, 8 bytes per document) and the header follow at commit.
 */
#include "shards.h"

#include "../base/sha256.h"

#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

enum {
    SH_HDR = 256,
    SH_HASHED = 224, /* header_sha256 covers [0, 224) */
    SH_ALIGN = 64,
    SH_BUF = 1 << 16,
};

uint64_t kiln_hash_mix64(uint64_t x) {
    uint64_t z = x + 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

int kiln_split_is_eval(uint64_t split_seed, uint64_t doc, double eval_fraction) {
    if (!(eval_fraction > 0.0)) return 0; /* also NaN */
    if (eval_fraction >= 1.0) return 1;
    /* eval_fraction * 2^64 < 2^64 is exact in double and converts exactly after floor */
    uint64_t threshold = (uint64_t)floor(ldexp(eval_fraction, 64));
    return kiln_hash3(split_seed, 0x73706c6974ull, doc) < threshold;
}

static uint64_t mulhi64(uint64_t a, uint64_t b) {
    return (uint64_t)(((unsigned __int128)a * b) >> 64);
}

static uint32_t token_bytes_for(uint32_t vocab) { return vocab <= 65536u ? 2u : 4u; }

/* ---- writer ---------------------------------------------------------------------------------- */

struct kiln_shard_writer {
    char *path, *tmp;
    int fd;
    uint32_t vocab, eos, tb;
    uint8_t fingerprint[32];
    uint64_t n_tokens;
    uint64_t *offsets; /* n_docs + 1 entries */
    size_t n_docs, cap;
    uint8_t *buf;      /* SH_BUF bytes of pending tokens */
    size_t buf_len;
    uint64_t file_pos;
    kiln_sha256_ctx *sha; /* of [256, end) */
    int failed;
};

static void swriter_free(kiln_shard_writer *w) {
    if (!w) return;
    if (w->fd >= 0) close(w->fd);
    if (w->tmp) unlink(w->tmp);
    kiln_sha256_free(w->sha);
    kiln_free(w->path);
    kiln_free(w->tmp);
    kiln_free(w->offsets);
    kiln_free(w->buf);
    kiln_free(w);
}

static kiln_status swrite(kiln_shard_writer *w, const void *data, size_t n, int hashed) {
    const uint8_t *p = data;
    size_t done = 0;
    while (done < n) {
        ssize_t r = write(w->fd, p + done, n - done);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) {
            w->failed = 1;
            return kiln_error(KILN_ERR_IO, "%s: write at offset %llu failed: %s", w->tmp,
                              (unsigned long long)(w->file_pos + done), r < 0 ? strerror(errno) : "no progress");
        }
        done += (size_t)r;
    }
    w->file_pos += n;
    if (hashed) KILN_TRY(kiln_sha256_update(w->sha, data, n));
    return KILN_OK;
}

static kiln_status flush_buf(kiln_shard_writer *w) {
    kiln_status st = swrite(w, w->buf, w->buf_len, 1);
    w->buf_len = 0;
    return st;
}

kiln_status kiln_shard_writer_create(const char *path, uint32_t vocab_size, uint32_t eos_id,
                                     const uint8_t fingerprint[32], kiln_shard_writer **out) {
    if (!path || !out) return kiln_error(KILN_ERR_INVALID_ARG, "kiln_shard_writer_create: NULL argument");
    *out = NULL;
    if (vocab_size == 0 || vocab_size > (1u << 31))
        return kiln_error(KILN_ERR_INVALID_ARG, "%s: vocab_size %u not in 1..2^31", path, vocab_size);
    if (eos_id != KILN_SHARD_NO_EOS && eos_id >= vocab_size)
        return kiln_error(KILN_ERR_RANGE, "%s: eos_id %u >= vocab_size %u", path, eos_id, vocab_size);
    kiln_shard_writer *w = kiln_calloc(1, sizeof *w);
    if (!w) return kiln_error(KILN_ERR_NOMEM, "%s: out of memory", path);
    w->fd = -1;
    w->vocab = vocab_size;
    w->eos = eos_id;
    w->tb = token_bytes_for(vocab_size);
    if (fingerprint) memcpy(w->fingerprint, fingerprint, 32);
    w->path = kiln_strdup(path);
    size_t tl = strlen(path) + 32;
    w->tmp = kiln_malloc(tl);
    w->buf = kiln_malloc(SH_BUF);
    w->cap = 1024;
    w->offsets = kiln_malloc(w->cap * sizeof *w->offsets);
    if (!w->path || !w->tmp || !w->buf || !w->offsets) {
        kiln_free(w->tmp);
        w->tmp = NULL;
        swriter_free(w);
        return kiln_error(KILN_ERR_NOMEM, "%s: out of memory", path);
    }
    w->offsets[0] = 0;
    snprintf(w->tmp, tl, "%s.tmp-%ld", path, (long)getpid());
    kiln_status st = kiln_sha256_init(&w->sha);
    if (st != KILN_OK) {
        kiln_free(w->tmp);
        w->tmp = NULL;
        swriter_free(w);
        return st;
    }
    w->fd = open(w->tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (w->fd < 0) {
        st = kiln_error(KILN_ERR_IO, "%s: cannot create: %s", w->tmp, strerror(errno));
        kiln_free(w->tmp);
        w->tmp = NULL;
        swriter_free(w);
        return st;
    }
    static const uint8_t zeros[SH_HDR];
    if ((st = swrite(w, zeros, SH_HDR, 0)) != KILN_OK) {
        swriter_free(w);
        return st;
    }
    *out = w;
    return KILN_OK;
}

static kiln_status push_token(kiln_shard_writer *w, uint32_t id) {
    if (w->buf_len + w->tb > SH_BUF) KILN_TRY(flush_buf(w));
    if (w->tb == 2) {
        uint16_t v = (uint16_t)id;
        memcpy(w->buf + w->buf_len, &v, 2);
    } else {
        memcpy(w->buf + w->buf_len, &id, 4);
    }
    w->buf_len += w->tb;
    return KILN_OK;
}

kiln_status kiln_shard_writer_add_doc(kiln_shard_writer *w, const int32_t *ids, size_t n) {
    if (!w || (n && !ids)) return kiln_error(KILN_ERR_INVALID_ARG, "kiln_shard_writer_add_doc: NULL argument");
    if (w->failed) return kiln_error(KILN_ERR_STATE, "%s: an earlier write failed", w->tmp);
    for (size_t i = 0; i < n; i++)
        if (ids[i] < 0 || (uint32_t)ids[i] >= w->vocab)
            return kiln_error(KILN_ERR_RANGE, "%s: document %zu: token %zu is %d, outside [0, %u)", w->path,
                              w->n_docs, i, (int)ids[i], w->vocab);
    if (w->n_docs + 2 > w->cap) {
        size_t ncap = 2 * w->cap;
        uint64_t *no = kiln_realloc(w->offsets, ncap * sizeof *no);
        if (!no) return kiln_error(KILN_ERR_NOMEM, "%s: out of memory for document offsets", w->path);
        w->offsets = no;
        w->cap = ncap;
    }
    for (size_t i = 0; i < n; i++) KILN_TRY(push_token(w, (uint32_t)ids[i]));
    uint64_t add = n + (w->eos != KILN_SHARD_NO_EOS);
    if (w->eos != KILN_SHARD_NO_EOS) KILN_TRY(push_token(w, w->eos));
    w->n_tokens += add;
    w->offsets[++w->n_docs] = w->n_tokens;
    return KILN_OK;
}

void kiln_shard_writer_abort(kiln_shard_writer *w) { swriter_free(w); }

kiln_status kiln_shard_writer_commit(kiln_shard_writer *w) {
    if (!w) return kiln_error(KILN_ERR_INVALID_ARG, "kiln_shard_writer_commit: NULL writer");
    kiln_status st = KILN_OK;
    if (w->failed) st = kiln_error(KILN_ERR_STATE, "%s: an earlier write failed", w->tmp);
    if (st == KILN_OK) st = flush_buf(w);
    uint64_t pad = (SH_ALIGN - w->file_pos % SH_ALIGN) % SH_ALIGN;
    static const uint8_t zeros[SH_ALIGN];
    if (st == KILN_OK) st = swrite(w, zeros, (size_t)pad, 1);
    uint64_t offsets_offset = w->file_pos;
    if (st == KILN_OK) st = swrite(w, w->offsets, (w->n_docs + 1) * sizeof(uint64_t), 1);
    uint8_t hdr[SH_HDR] = {0};
    if (st == KILN_OK) {
        memcpy(hdr, KILN_SHARD_MAGIC, 8);
        kiln_put_le32(hdr + 8, KILN_SHARD_VERSION);
        kiln_put_le32(hdr + 12, SH_HDR);
        kiln_put_le32(hdr + 16, w->vocab);
        kiln_put_le32(hdr + 20, w->tb);
        kiln_put_le32(hdr + 24, w->eos);
        kiln_put_le32(hdr + 28, 0);
        kiln_put_le64(hdr + 32, w->n_tokens);
        kiln_put_le64(hdr + 40, w->n_docs);
        kiln_put_le64(hdr + 48, SH_HDR);
        kiln_put_le64(hdr + 56, offsets_offset);
        kiln_put_le64(hdr + 64, w->file_pos);
        memcpy(hdr + 72, w->fingerprint, 32);
        kiln_sha256_ctx *c = w->sha;
        w->sha = NULL;
        st = kiln_sha256_final(c, hdr + 104);
    }
    if (st == KILN_OK) st = kiln_sha256(hdr, SH_HASHED, hdr + SH_HASHED);
    if (st == KILN_OK && lseek(w->fd, 0, SEEK_SET) != 0)
        st = kiln_error(KILN_ERR_IO, "%s: seek failed: %s", w->tmp, strerror(errno));
    if (st == KILN_OK) st = swrite(w, hdr, SH_HDR, 0);
    if (st == KILN_OK && fsync(w->fd) != 0) st = kiln_error(KILN_ERR_IO, "%s: fsync failed: %s", w->tmp, strerror(errno));
    if (st == KILN_OK) {
        int r = close(w->fd);
        w->fd = -1;
        if (r != 0) st = kiln_error(KILN_ERR_IO, "%s: close failed: %s", w->tmp, strerror(errno));
    }
    if (st == KILN_OK && rename(w->tmp, w->path) != 0)
        st = kiln_error(KILN_ERR_IO, "%s: cannot rename to %s: %s", w->tmp, w->path, strerror(errno));
    if (st == KILN_OK) {
        kiln_free(w->tmp); /* renamed: nothing to unlink */
        w->tmp = NULL;
        st = kiln_fsync_parent_dir(w->path);
    }
    swriter_free(w);
    return st;
}

/* ---- reader ---------------------------------------------------------------------------------- */

struct kiln_shard {
    kiln_file_map map;
    char *path;
    kiln_shard_info info;
    const uint8_t *tokens;   /* n_tokens * token_bytes */
    const uint8_t *offsets;  /* (n_docs + 1) u64, possibly unaligned for a read copy */
};

void kiln_shard_close(kiln_shard *s) {
    if (!s) return;
    kiln_file_map_close(&s->map);
    kiln_free(s->path);
    kiln_free(s);
}

const kiln_shard_info *kiln_shard_get_info(const kiln_shard *s) { return s ? &s->info : NULL; }

static inline uint32_t tok_at(const kiln_shard *s, uint64_t i) {
    if (s->info.token_bytes == 2) {
        uint16_t v;
        memcpy(&v, s->tokens + 2 * i, 2);
        return v;
    }
    return kiln_le32(s->tokens + 4 * i);
}

static inline uint64_t off_at(const kiln_shard *s, uint64_t d) { return kiln_le64(s->offsets + 8 * d); }

#define SFMT(...) kiln_error(KILN_ERR_FORMAT, __VA_ARGS__)

static kiln_status shard_validate(kiln_shard *s, int flags) {
    const uint8_t *d = s->map.data;
    const char *path = s->path;
    uint64_t fsize = s->map.size;
    if (fsize < SH_HDR)
        return SFMT("%s: %llu bytes, shorter than the 256-byte header (truncated?)", path, (unsigned long long)fsize);
    if (memcmp(d, KILN_SHARD_MAGIC, 8) != 0) return SFMT("%s: bad magic (not a kiln token shard)", path);
    uint32_t version = kiln_le32(d + 8);
    if (version != KILN_SHARD_VERSION)
        return kiln_error(KILN_ERR_UNSUPPORTED, "%s: shard version %u (this kiln reads version %u)", path,
                          version, KILN_SHARD_VERSION);
    uint8_t sha[32];
    KILN_TRY(kiln_sha256(d, SH_HASHED, sha));
    if (memcmp(sha, d + SH_HASHED, 32) != 0) return SFMT("%s: header checksum mismatch (corrupt header)", path);
    kiln_shard_info *in = &s->info;
    in->vocab_size = kiln_le32(d + 16);
    in->token_bytes = kiln_le32(d + 20);
    in->eos_id = kiln_le32(d + 24);
    in->n_tokens = kiln_le64(d + 32);
    in->n_docs = kiln_le64(d + 40);
    memcpy(in->fingerprint, d + 72, 32);
    uint64_t tokens_offset = kiln_le64(d + 48), offsets_offset = kiln_le64(d + 56), file_size = kiln_le64(d + 64);
    if (kiln_le32(d + 12) != SH_HDR) return SFMT("%s: header_size %u, expected 256", path, kiln_le32(d + 12));
    if (in->vocab_size == 0 || in->vocab_size > (1u << 31))
        return SFMT("%s: vocab_size %u not in 1..2^31", path, in->vocab_size);
    if (in->token_bytes != token_bytes_for(in->vocab_size))
        return SFMT("%s: token_bytes %u, expected %u for vocab_size %u", path, in->token_bytes,
                    token_bytes_for(in->vocab_size), in->vocab_size);
    if (in->eos_id != KILN_SHARD_NO_EOS && in->eos_id >= in->vocab_size)
        return SFMT("%s: eos_id %u >= vocab_size %u", path, in->eos_id, in->vocab_size);
    if (kiln_le32(d + 28) != 0) return SFMT("%s: unknown flags 0x%x", path, kiln_le32(d + 28));
    for (int i = 136; i < SH_HASHED; i++)
        if (d[i]) return SFMT("%s: reserved header byte %d is not zero", path, i);
    if (file_size != fsize)
        return SFMT("%s: header says %llu bytes, file has %llu (truncated or extended)", path,
                    (unsigned long long)file_size, (unsigned long long)fsize);
    uint64_t tok_bytes, tok_end, want_off, n_off, off_bytes, end;
    if (tokens_offset != SH_HDR) return SFMT("%s: tokens_offset %llu, expected 256", path, (unsigned long long)tokens_offset);
    if (kiln_mul_overflow_u64(in->n_tokens, in->token_bytes, &tok_bytes) ||
        kiln_add_overflow_u64(tokens_offset, tok_bytes, &tok_end) || tok_end > fsize)
        return SFMT("%s: n_tokens %llu does not fit in the file", path, (unsigned long long)in->n_tokens);
    want_off = tok_end + (SH_ALIGN - tok_end % SH_ALIGN) % SH_ALIGN;
    if (offsets_offset != want_off)
        return SFMT("%s: offsets_offset %llu, expected %llu", path, (unsigned long long)offsets_offset,
                    (unsigned long long)want_off);
    if (kiln_add_overflow_u64(in->n_docs, 1, &n_off) || kiln_mul_overflow_u64(n_off, 8, &off_bytes) ||
        kiln_add_overflow_u64(offsets_offset, off_bytes, &end) || end != fsize)
        return SFMT("%s: n_docs %llu: offsets do not end at the file size", path, (unsigned long long)in->n_docs);
    for (uint64_t i = tok_end; i < offsets_offset; i++)
        if (d[i]) return SFMT("%s: padding byte at offset %llu is not zero", path, (unsigned long long)i);
    s->tokens = d + tokens_offset;
    s->offsets = d + offsets_offset;
    if (off_at(s, 0) != 0) return SFMT("%s: offsets[0] is %llu, expected 0", path, (unsigned long long)off_at(s, 0));
    if (off_at(s, in->n_docs) != in->n_tokens)
        return SFMT("%s: offsets[%llu] is %llu, expected n_tokens %llu", path, (unsigned long long)in->n_docs,
                    (unsigned long long)off_at(s, in->n_docs), (unsigned long long)in->n_tokens);
    for (uint64_t i = 0; i < in->n_docs; i++) {
        uint64_t a = off_at(s, i), b = off_at(s, i + 1);
        if (b < a || b > in->n_tokens)
            return SFMT("%s: document %llu: offsets decrease or pass n_tokens (%llu then %llu) "
                        "at file offset %llu",
                        path,
                        (unsigned long long)i, (unsigned long long)a, (unsigned long long)b,
                        (unsigned long long)(offsets_offset + 8 * (i + 1)));
        if (in->eos_id != KILN_SHARD_NO_EOS && (b == a || tok_at(s, b - 1) != in->eos_id))
            return SFMT("%s: document %llu does not end with EOS %u", path, (unsigned long long)i, in->eos_id);
    }
    uint32_t maxtok = 0;
    uint64_t at = 0;
    for (uint64_t i = 0; i < in->n_tokens; i++) {
        uint32_t t = tok_at(s, i);
        if (t > maxtok) {
            maxtok = t;
            at = i;
        }
    }
    if (in->n_tokens && maxtok >= in->vocab_size)
        return kiln_error(KILN_ERR_FORMAT, "%s: token %llu (file offset %llu) is %u, >= vocab_size %u", path,
                          (unsigned long long)at, (unsigned long long)(tokens_offset + at * in->token_bytes),
                          maxtok, in->vocab_size);
    if (flags & KILN_SHARD_VERIFY_CHECKSUM) {
        KILN_TRY(kiln_sha256(d + SH_HDR, (size_t)(fsize - SH_HDR), sha));
        if (memcmp(sha, d + 104, 32) != 0) return SFMT("%s: content checksum mismatch (corrupt tokens or offsets)", path);
    }
    return KILN_OK;
}

kiln_status kiln_shard_open(const char *path, int flags, kiln_shard **out) {
    if (!path || !out) return kiln_error(KILN_ERR_INVALID_ARG, "kiln_shard_open: NULL argument");
    *out = NULL;
    kiln_shard *s = kiln_calloc(1, sizeof *s);
    if (!s || !(s->path = kiln_strdup(path))) {
        kiln_free(s);
        return kiln_error(KILN_ERR_NOMEM, "%s: out of memory", path);
    }
    kiln_status st = kiln_file_map_open(path, 1, &s->map);
    if (st == KILN_OK) st = shard_validate(s, flags);
    if (st != KILN_OK) {
        kiln_shard_close(s);
        return st;
    }
    *out = s;
    return KILN_OK;
}

kiln_status kiln_shard_doc_range(const kiln_shard *s, uint64_t d, uint64_t *start, uint64_t *end) {
    if (!s || !start || !end) return kiln_error(KILN_ERR_INVALID_ARG, "kiln_shard_doc_range: NULL argument");
    if (d >= s->info.n_docs)
        return kiln_error(KILN_ERR_RANGE, "%s: document %llu of %llu", s->path, (unsigned long long)d,
                          (unsigned long long)s->info.n_docs);
    *start = off_at(s, d);
    *end = off_at(s, d + 1);
    return KILN_OK;
}

kiln_status kiln_shard_read(const kiln_shard *s, uint64_t start, size_t n, int32_t *out) {
    if (!s || (n && !out)) return kiln_error(KILN_ERR_INVALID_ARG, "kiln_shard_read: NULL argument");
    uint64_t end;
    if (kiln_add_overflow_u64(start, n, &end) || end > s->info.n_tokens)
        return kiln_error(KILN_ERR_RANGE, "%s: tokens [%llu, +%zu) past the end (%llu tokens)", s->path,
                          (unsigned long long)start, n, (unsigned long long)s->info.n_tokens);
    for (size_t i = 0; i < n; i++) out[i] = (int32_t)tok_at(s, start + i);
    return KILN_OK;
}

/* ---- sampler --------------------------------------------------------------------------------- */

typedef struct span {
    uint64_t stream_start; /* position of the document's first token in the split's stream */
    uint64_t shard_start;  /* its position in its shard */
    uint64_t len;
    uint32_t shard;
} span;

struct kiln_batch_sampler {
    kiln_batch_sampler_params p;
    const kiln_shard **shards;
    int n_shards;
    span *spans; /* non-empty documents of the split, in global order */
    uint64_t n_spans, n_docs, n_tokens;
};

kiln_batch_sampler_params kiln_batch_sampler_default_params(void) {
    kiln_batch_sampler_params p = {0};
    p.split = KILN_SPLIT_TRAIN;
    p.batch = 1;
    p.seq_len = 1;
    return p;
}

void kiln_batch_sampler_free(kiln_batch_sampler *s) {
    if (!s) return;
    kiln_free(s->spans);
    kiln_free((void *)s->shards);
    kiln_free(s);
}

uint64_t kiln_batch_sampler_n_tokens(const kiln_batch_sampler *s) { return s ? s->n_tokens : 0; }
uint64_t kiln_batch_sampler_n_docs(const kiln_batch_sampler *s) { return s ? s->n_docs : 0; }

kiln_status kiln_batch_sampler_create(kiln_shard *const *shards, int n_shards, const kiln_batch_sampler_params *p,
                                kiln_batch_sampler **out) {
    if (!shards || !p || !out || n_shards < 1)
        return kiln_error(KILN_ERR_INVALID_ARG, "kiln_batch_sampler_create: NULL argument or no shards");
    *out = NULL;
    if (p->batch < 1 || p->seq_len < 1)
        return kiln_error(KILN_ERR_INVALID_ARG, "sampler: batch %d and seq_len %d must be >= 1", p->batch, p->seq_len);
    if (p->split != KILN_SPLIT_TRAIN && p->split != KILN_SPLIT_EVAL)
        return kiln_error(KILN_ERR_INVALID_ARG, "sampler: unknown split %d", (int)p->split);
    if (!(p->eval_fraction >= 0.0 && p->eval_fraction <= 1.0))
        return kiln_error(KILN_ERR_INVALID_ARG, "sampler: eval_fraction %g not in [0, 1]", p->eval_fraction);
    for (int i = 0; i < n_shards; i++) {
        if (!shards[i]) return kiln_error(KILN_ERR_INVALID_ARG, "sampler: shard %d is NULL", i);
        const kiln_shard_info *a = &shards[0]->info, *b = &shards[i]->info;
        if (a->vocab_size != b->vocab_size || memcmp(a->fingerprint, b->fingerprint, 32) != 0)
            return kiln_error(KILN_ERR_INVALID_ARG,
                              "sampler: %s and %s were made with different tokenizers (vocab_size or "
                              "fingerprint differ)",
                              shards[0]->path, shards[i]->path);
    }
    kiln_batch_sampler *s = kiln_calloc(1, sizeof *s);
    if (!s) return kiln_error(KILN_ERR_NOMEM, "sampler: out of memory");
    s->p = *p;
    s->n_shards = n_shards;
    s->shards = kiln_malloc((size_t)n_shards * sizeof *s->shards);
    if (!s->shards) {
        kiln_batch_sampler_free(s);
        return kiln_error(KILN_ERR_NOMEM, "sampler: out of memory");
    }
    for (int i = 0; i < n_shards; i++) s->shards[i] = shards[i];
    /* pass 1 counts, pass 2 fills */
    for (int pass = 0; pass < 2; pass++) {
        uint64_t g = 0, ns = 0, nt = 0, nd = 0;
        for (int i = 0; i < n_shards; i++) {
            const kiln_shard *sh = shards[i];
            for (uint64_t d = 0; d < sh->info.n_docs; d++, g++) {
                int is_eval = kiln_split_is_eval(p->split_seed, g, p->eval_fraction);
                if (is_eval != (p->split == KILN_SPLIT_EVAL)) continue;
                nd++;
                uint64_t a = off_at(sh, d), b = off_at(sh, d + 1);
                if (b == a) continue;
                if (pass == 1) s->spans[ns] = (span){nt, a, b - a, (uint32_t)i};
                ns++;
                nt += b - a;
            }
        }
        if (pass == 0) {
            s->n_spans = ns;
            s->n_docs = nd;
            s->n_tokens = nt;
            size_t bytes;
            if (kiln_mul_overflow((size_t)(ns ? ns : 1), sizeof(span), &bytes) || !(s->spans = kiln_malloc(bytes))) {
                kiln_batch_sampler_free(s);
                return kiln_error(KILN_ERR_NOMEM, "sampler: out of memory for %llu documents", (unsigned long long)ns);
            }
        }
    }
    if (s->n_tokens < (uint64_t)p->seq_len + 1) {
        kiln_status st = kiln_error(KILN_ERR_RANGE, "sampler: the %s split holds %llu tokens, fewer than seq_len+1 = %d",
                                    p->split == KILN_SPLIT_EVAL ? "eval" : "train",
                                    (unsigned long long)s->n_tokens, p->seq_len + 1);
        kiln_batch_sampler_free(s);
        return st;
    }
    *out = s;
    return KILN_OK;
}

/* Copy n tokens of the split's stream starting at stream position pos. */
static void stream_copy(const kiln_batch_sampler *s, uint64_t pos, size_t n, int32_t *out) {
    /* the last span whose stream_start <= pos */
    uint64_t lo = 0, hi = s->n_spans;
    while (hi - lo > 1) {
        uint64_t mid = lo + (hi - lo) / 2;
        if (s->spans[mid].stream_start <= pos) lo = mid;
        else hi = mid;
    }
    uint64_t k = lo, within = pos - s->spans[k].stream_start;
    while (n > 0) {
        const span *sp = &s->spans[k];
        const kiln_shard *sh = s->shards[sp->shard];
        uint64_t take = sp->len - within;
        if (take > n) take = n;
        for (uint64_t i = 0; i < take; i++) *out++ = (int32_t)tok_at(sh, sp->shard_start + within + i);
        n -= (size_t)take;
        within = 0;
        k++;
    }
}

kiln_status kiln_batch_sampler_get(const kiln_batch_sampler *s, uint64_t step, int32_t *out) {
    if (!s || !out) return kiln_error(KILN_ERR_INVALID_ARG, "kiln_batch_sampler_get: NULL argument");
    const uint64_t T = (uint64_t)s->p.seq_len;
    const uint64_t n_starts = s->n_tokens - T; /* windows [p, p+T] inside the stream */
    const uint64_t base = kiln_hash2(s->p.seed, (uint64_t)s->p.split);
    for (int b = 0; b < s->p.batch; b++) {
        uint64_t h = kiln_hash3(base, step, (uint64_t)b);
        uint64_t pos = mulhi64(h, n_starts);
        stream_copy(s, pos, (size_t)(T + 1), out + (size_t)b * (size_t)(T + 1));
    }
    return KILN_OK;
}
