/*
 * tokenizer.c -- the vocabulary tables and encoding: added-token split, normalizer,
 * pre-tokenizer, BPE merge loop (by merge rank or by SentencePiece score).
 */
#include "tok_internal.h"

#include <string.h>
#include <utf8proc.h>

/* ---- building ----------------------------------------------------------------------------- */

static void tok_destroy(kiln_tokenizer *t);

kiln_status tok_alloc(kiln_tokenizer **out, int32_t n_vocab, const char *label) {
    /* 0 is allowed: tokenizers loads an empty model.vocab (every text encodes to no ids) */
    if (n_vocab < 0 || n_vocab > (1 << 26))
        return kiln_error(KILN_ERR_FORMAT, "%s: vocabulary size %d out of range", label, n_vocab);
    kiln_tokenizer *t = kiln_calloc(1, sizeof *t);
    if (!t) return kiln_error(KILN_ERR_NOMEM, "%s: out of memory (tokenizer)", label);
    t->n_vocab = n_vocab;
    t->label = kiln_strdup(label ? label : "tokenizer");
    size_t n_alloc = n_vocab ? (size_t)n_vocab : 1;
    t->piece = kiln_calloc(n_alloc, sizeof *t->piece);
    t->piece_len = kiln_calloc(n_alloc, sizeof *t->piece_len);
    t->attr = kiln_calloc(n_alloc, sizeof *t->attr);
    t->type = "bpe";
    t->bos_id = t->eos_id = t->eot_id = t->eom_id = t->pad_id = t->unk_id = t->model_unk_id = -1;
    for (int i = 0; i < 256; i++) t->byte_id[i] = -1;
    kiln_status st = KILN_OK;
    if (!t->label || !t->piece || !t->piece_len || !t->attr)
        st = kiln_error(KILN_ERR_NOMEM, "%s: out of memory (vocabulary of %d)", label, n_vocab);
    if (st == KILN_OK) st = kiln_handle_register(&t->head, KILN_HANDLE_TOKENIZER, label ? label : "tokenizer");
    if (st != KILN_OK) {
        tok_destroy(t);
        return st;
    }
    *out = t;
    return KILN_OK;
}

static uint64_t tok_hash(const char *s, size_t n) {
    uint64_t h = 1469598103934665603ull;
    for (size_t i = 0; i < n; i++) {
        h ^= (uint8_t)s[i];
        h *= 1099511628211ull;
    }
    return h;
}

/* The string, length and id of vhash entry v: a piece (v < n_vocab) or an alias. */
static void tok_entry(const kiln_tokenizer *t, int32_t v, const char **s, uint32_t *len,
                      int32_t *id) {
    if (v < t->n_vocab) {
        *s = t->piece[v];
        *len = t->piece_len[v];
        *id = v;
    } else {
        *s = t->alias[v - t->n_vocab];
        *len = t->alias_len[v - t->n_vocab];
        *id = t->alias_id[v - t->n_vocab];
    }
}

/* The vhash entry holding s[0..len), or -1. */
static int32_t tok_find_entry(const kiln_tokenizer *t, const char *s, size_t len) {
    if (!t->vhash) return -1;
    size_t i = (size_t)tok_hash(s, len) & t->vhash_mask;
    for (;;) {
        int32_t v = t->vhash[i];
        if (v < 0) return -1;
        const char *es;
        uint32_t el;
        int32_t id;
        tok_entry(t, v, &es, &el, &id);
        if (el == len && memcmp(es, s, len) == 0) return v;
        i = (i + 1) & t->vhash_mask;
    }
}

int32_t tok_find(const kiln_tokenizer *t, const char *s, size_t len) {
    int32_t v = tok_find_entry(t, s, len);
    if (v < 0) return -1;
    return v < t->n_vocab ? v : t->alias_id[v - t->n_vocab];
}

int32_t tok_find_model(const kiln_tokenizer *t, const char *s, size_t len) {
    int32_t v = tok_find_entry(t, s, len);
    if (v < 0) return -1;
    if (v >= t->n_vocab) return t->alias_id[v - t->n_vocab];
    return (t->attr[v] & TOK_ATTR_NOT_MODEL) ? -1 : v;
}

/* Insert entry v unless its string is already there (the first entry wins for duplicate
 * strings, as HF's and llama.cpp's maps keep one). */
static void tok_hash_insert(kiln_tokenizer *t, int32_t v) {
    const char *s;
    uint32_t len;
    int32_t id;
    tok_entry(t, v, &s, &len, &id);
    size_t h = (size_t)tok_hash(s, len) & t->vhash_mask;
    while (t->vhash[h] >= 0) {
        const char *os;
        uint32_t ol;
        int32_t oid;
        tok_entry(t, t->vhash[h], &os, &ol, &oid);
        if (ol == len && memcmp(os, s, len) == 0) return;
        h = (h + 1) & t->vhash_mask;
    }
    t->vhash[h] = v;
}

kiln_status tok_set_pieces(kiln_tokenizer *t, const char *const *strs, const uint32_t *lens,
                           const char *const *alias_strs, const uint32_t *alias_lens,
                           const int32_t *alias_ids, int32_t n_alias) {
    size_t total = 0;
    for (int32_t i = 0; i < t->n_vocab; i++) {
        if (!strs[i]) continue;
        if (kiln_add_overflow(total, (size_t)lens[i] + 1, &total))
            return kiln_error(KILN_ERR_FORMAT, "%s: vocabulary strings too large", t->label);
    }
    for (int32_t i = 0; i < n_alias; i++)
        if (kiln_add_overflow(total, (size_t)alias_lens[i] + 1, &total))
            return kiln_error(KILN_ERR_FORMAT, "%s: vocabulary strings too large", t->label);
    t->strings = kiln_malloc(total ? total : 1);
    size_t cap = 16;
    while (cap < ((size_t)t->n_vocab + (size_t)n_alias) * 2) cap <<= 1;
    t->vhash = kiln_malloc(cap * sizeof *t->vhash);
    if (n_alias > 0) {
        t->alias = kiln_calloc((size_t)n_alias, sizeof *t->alias);
        t->alias_len = kiln_calloc((size_t)n_alias, sizeof *t->alias_len);
        t->alias_id = kiln_calloc((size_t)n_alias, sizeof *t->alias_id);
    }
    if (!t->strings || !t->vhash || (n_alias > 0 && (!t->alias || !t->alias_len || !t->alias_id)))
        return kiln_error(KILN_ERR_NOMEM, "%s: out of memory (vocabulary strings)", t->label);
    t->vhash_mask = cap - 1;
    memset(t->vhash, 0xff, cap * sizeof *t->vhash);
    size_t off = 0;
    for (int32_t i = 0; i < t->n_vocab; i++) {
        if (!strs[i]) {
            t->piece[i] = NULL;
            t->piece_len[i] = 0;
            t->attr[i] |= TOK_ATTR_UNUSED;
            continue;
        }
        char *p = t->strings + off;
        memcpy(p, strs[i], lens[i]);
        p[lens[i]] = 0;
        t->piece[i] = p;
        t->piece_len[i] = lens[i];
        off += (size_t)lens[i] + 1;
        tok_hash_insert(t, i);
    }
    for (int32_t i = 0; i < n_alias; i++) {
        char *p = t->strings + off;
        memcpy(p, alias_strs[i], alias_lens[i]);
        p[alias_lens[i]] = 0;
        t->alias[i] = p;
        t->alias_len[i] = alias_lens[i];
        t->alias_id[i] = alias_ids[i];
        off += (size_t)alias_lens[i] + 1;
        t->n_alias = i + 1;
        tok_hash_insert(t, t->n_vocab + i);
    }
    return KILN_OK;
}

kiln_status tok_merges_reserve(kiln_tokenizer *t, size_t n) {
    size_t cap = 16;
    while (cap < n * 2 + 16) cap <<= 1;
    t->mhash = kiln_malloc(cap * sizeof *t->mhash);
    if (!t->mhash) return kiln_error(KILN_ERR_NOMEM, "%s: out of memory (%zu merges)", t->label, n);
    memset(t->mhash, 0xff, cap * sizeof *t->mhash);
    t->mhash_mask = cap - 1;
    return KILN_OK;
}

static size_t tok_merge_slot(const kiln_tokenizer *t, uint64_t key) {
    uint64_t h = key * 0x9E3779B97F4A7C15ull;
    size_t i = (size_t)(h >> 20) & t->mhash_mask;
    while (t->mhash[i].key != UINT64_MAX && t->mhash[i].key != key) i = (i + 1) & t->mhash_mask;
    return i;
}

int tok_merge_add(kiln_tokenizer *t, const char *a, size_t alen, const char *b, size_t blen,
                  int32_t rank, int model_only) {
    int32_t (*find)(const kiln_tokenizer *, const char *, size_t) = model_only ? tok_find_model : tok_find;
    int32_t ia = find(t, a, alen), ib = find(t, b, blen);
    if (ia < 0) return 1;
    if (ib < 0) return 2;
    char small[512];
    char *buf = alen + blen <= sizeof small ? small : kiln_malloc(alen + blen);
    if (!buf) return -1;
    memcpy(buf, a, alen);
    memcpy(buf + alen, b, blen);
    int32_t m = find(t, buf, alen + blen);
    if (buf != small) kiln_free(buf);
    if (m < 0) return 3;
    uint64_t key = ((uint64_t)(uint32_t)ia << 32) | (uint32_t)ib;
    size_t s = tok_merge_slot(t, key);
    if (t->mhash[s].key == key) return 0; /* the first (best) rank of a duplicate pair wins */
    t->mhash[s].key = key;
    t->mhash[s].rank = rank;
    t->mhash[s].id = m;
    return 0;
}

static const struct tok_merge *tok_merge_find(const kiln_tokenizer *t, int32_t a, int32_t b) {
    if (!t->mhash || a < 0 || b < 0) return NULL;
    uint64_t key = ((uint64_t)(uint32_t)a << 32) | (uint32_t)b;
    size_t s = tok_merge_slot(t, key);
    return t->mhash[s].key == key ? &t->mhash[s] : NULL;
}

static int tok_cmp_added(const void *pa, const void *pb, void *tv) {
    const kiln_tokenizer *t = tv;
    int32_t a = *(const int32_t *)pa, b = *(const int32_t *)pb;
    if (t->piece_len[a] != t->piece_len[b]) return t->piece_len[a] > t->piece_len[b] ? -1 : 1;
    return a < b ? -1 : a > b;
}

/* insertion-free sort helper: qsort has no context argument in C11, so a small merge sort */
static void tok_sort_added(kiln_tokenizer *t, int32_t *v, int32_t *tmp, int n) {
    if (n < 2) return;
    int h = n / 2;
    tok_sort_added(t, v, tmp, h);
    tok_sort_added(t, v + h, tmp, n - h);
    int i = 0, j = h, k = 0;
    while (i < h && j < n) tmp[k++] = tok_cmp_added(&v[j], &v[i], t) < 0 ? v[j++] : v[i++];
    while (i < h) tmp[k++] = v[i++];
    while (j < n) tmp[k++] = v[j++];
    memcpy(v, tmp, (size_t)n * sizeof *v);
}

kiln_status tok_finish(kiln_tokenizer *t) {
    /* byte tables */
    for (int b = 0; b < 256; b++) {
        char s[8];
        int n;
        if (t->byte_level) {
            n = tok_utf8_encode(tok_byte_to_cp((uint8_t)b), s);
        } else {
            static const char hex[] = "0123456789ABCDEF";
            memcpy(s, "<0x", 3);
            s[3] = hex[b >> 4];
            s[4] = hex[b & 15];
            s[5] = '>';
            n = 6;
        }
        t->byte_id[b] = tok_find(t, s, (size_t)n);
        if (!t->byte_level && t->byte_id[b] >= 0) t->attr[t->byte_id[b]] |= TOK_ATTR_BYTE;
    }
    /* added tokens, longest first so the first match at a position is the longest */
    int n = 0;
    for (int32_t i = 0; i < t->n_vocab; i++)
        if ((t->attr[i] & TOK_ATTR_ADDED) && t->piece_len[i] > 0) n++;
    kiln_free(t->added);
    t->added = kiln_malloc((size_t)(n ? n : 1) * sizeof *t->added);
    int32_t *tmp = kiln_malloc((size_t)(n ? n : 1) * sizeof *tmp);
    if (!t->added || !tmp) {
        kiln_free(tmp);
        return kiln_error(KILN_ERR_NOMEM, "%s: out of memory (added tokens)", t->label);
    }
    n = 0;
    for (int32_t i = 0; i < t->n_vocab; i++)
        if ((t->attr[i] & TOK_ATTR_ADDED) && t->piece_len[i] > 0) t->added[n++] = i;
    tok_sort_added(t, t->added, tmp, n);
    kiln_free(tmp);
    t->n_added = n;

    /* end-of-generation: the declared ids plus the well-known end-of-turn strings */
    static const char *const eog_names[] = {
        "<|eot_id|>", "<|im_end|>", "<end_of_turn>", "<|endoftext|>", "<|end|>", "<|eom_id|>",
        "<|end_of_text|>", "<|END_OF_TURN_TOKEN|>", "<EOT>", "<|return|>", "<|call|>",
    };
    int32_t ids[] = {t->eos_id, t->eot_id, t->eom_id};
    for (size_t i = 0; i < sizeof ids / sizeof ids[0]; i++)
        if (ids[i] >= 0 && ids[i] < t->n_vocab) t->attr[ids[i]] |= TOK_ATTR_EOG;
    for (size_t i = 0; i < sizeof eog_names / sizeof eog_names[0]; i++) {
        int32_t id = tok_find(t, eog_names[i], strlen(eog_names[i]));
        if (id >= 0 && (t->attr[id] & (TOK_ATTR_SPECIAL | TOK_ATTR_ADDED))) {
            t->attr[id] |= TOK_ATTR_EOG;
            if (t->eot_id < 0 && (!strcmp(eog_names[i], "<|eot_id|>") ||
                                  !strcmp(eog_names[i], "<|im_end|>") ||
                                  !strcmp(eog_names[i], "<end_of_turn>")))
                t->eot_id = id;
        }
    }
    t->chat_template_name = tok_detect_chat_template(t->chat_template);
    return KILN_OK;
}

void kiln_tokenizer_set_owner(kiln_tokenizer *t, const void *model) {
    if (t) t->owner = model;
}

const void *kiln_tokenizer_owner(const kiln_tokenizer *t) { return t->owner; }

void kiln_tokenizer_free(kiln_tokenizer *t) {
    if (!t) return;
    if (kiln_handle_unregister(&t->head, KILN_HANDLE_TOKENIZER, "kiln_tokenizer_close") != KILN_OK) return;
    tok_destroy(t);
}

static void tok_destroy(kiln_tokenizer *t) {
    kiln_free(t->label);
    kiln_free(t->piece);
    kiln_free(t->piece_len);
    kiln_free(t->score);
    kiln_free(t->attr);
    kiln_free(t->strings);
    kiln_free(t->vhash);
    kiln_free(t->alias);
    kiln_free(t->alias_len);
    kiln_free(t->alias_id);
    kiln_free(t->mhash);
    for (int i = 0; i < t->n_norm; i++) {
        kiln_free(t->norm[i].a);
        kiln_free(t->norm[i].b);
    }
    for (int i = 0; i < t->n_pre; i++) {
        pcre2_code_free(t->pre_steps[i].re);
        kiln_free(t->pre_steps[i].pattern);
    }
    for (int i = 0; i < t->n_dec; i++) {
        kiln_free(t->dec[i].a);
        kiln_free(t->dec[i].b);
    }
    kiln_free(t->added);
    kiln_free(t->prefix_ids);
    kiln_free(t->suffix_ids);
    kiln_free(t->chat_template);
    kiln_free(t);
}

bool kiln_tokenizer_is_eog(const kiln_tokenizer *t, int32_t id) {
    return t && id >= 0 && id < t->n_vocab && (t->attr[id] & TOK_ATTR_EOG);
}

int kiln_tokenizer_n_vocab(const kiln_tokenizer *t) { return t ? t->n_vocab : 0; }

/* ---- encoding workspace ------------------------------------------------------------------- */

typedef struct tok_span {
    size_t off, len;
} tok_span;

typedef struct tok_sym {
    int32_t id;
    int32_t prev, next;
    uint32_t start, len; /* bytes in the piece buffer; len 0 = merged away */
} tok_sym;

typedef struct tok_pair {
    double prio;   /* lower first */
    uint32_t tie;  /* then lower first (merge_by_id: 2^32-1 - bytes of the left part) */
    int32_t left, right, id; /* then the leftmost */
    uint32_t size;
} tok_pair;

typedef struct tok_ws {
    char *sb; size_t sb_n, sb_cap;          /* text of segments and pieces */
    tok_span *pa, *pb; size_t pa_n, pb_n, pa_cap, pb_cap; /* piece lists */
    char *map; size_t map_cap;              /* byte-level mapped piece */
    tok_sym *sym; size_t sym_cap;
    tok_pair *heap; size_t heap_n, heap_cap;
    int32_t *ids; size_t ids_n, ids_cap;
    pcre2_match_data *md;
} tok_ws;

static kiln_status tok_grow(void **p, size_t *cap, size_t need, size_t elem) {
    if (need <= *cap) return KILN_OK;
    size_t c = *cap ? *cap : 64;
    while (c < need) {
        if (kiln_mul_overflow(c, 2, &c)) return kiln_error(KILN_ERR_NOMEM, "tokenize: too large");
    }
    size_t bytes;
    if (kiln_mul_overflow(c, elem, &bytes)) return kiln_error(KILN_ERR_NOMEM, "tokenize: too large");
    void *q = kiln_realloc(*p, bytes);
    if (!q) return kiln_error(KILN_ERR_NOMEM, "tokenize: out of memory (%zu bytes)", bytes);
    *p = q;
    *cap = c;
    return KILN_OK;
}

static kiln_status ws_push_id(tok_ws *w, int32_t id) {
    KILN_TRY(tok_grow((void **)&w->ids, &w->ids_cap, w->ids_n + 1, sizeof *w->ids));
    w->ids[w->ids_n++] = id;
    return KILN_OK;
}

/* Append bytes to sb; returns the offset. */
static kiln_status ws_append(tok_ws *w, const char *s, size_t n, size_t *off) {
    KILN_TRY(tok_grow((void **)&w->sb, &w->sb_cap, w->sb_n + n + 1, 1));
    if (n) memcpy(w->sb + w->sb_n, s, n);
    *off = w->sb_n;
    w->sb_n += n;
    return KILN_OK;
}

static kiln_status ws_out_piece(tok_ws *w, size_t off, size_t len) {
    if (len == 0) return KILN_OK;
    KILN_TRY(tok_grow((void **)&w->pb, &w->pb_cap, w->pb_n + 1, sizeof *w->pb));
    w->pb[w->pb_n].off = off;
    w->pb[w->pb_n].len = len;
    w->pb_n++;
    return KILN_OK;
}

static void ws_free(tok_ws *w) {
    kiln_free(w->sb);
    kiln_free(w->pa);
    kiln_free(w->pb);
    kiln_free(w->map);
    kiln_free(w->sym);
    kiln_free(w->heap);
    kiln_free(w->ids);
    if (w->md) pcre2_match_data_free(w->md);
}

/* ---- heap of candidate merges ------------------------------------------------------------ */

static int pair_less(const tok_pair *a, const tok_pair *b) {
    if (a->prio != b->prio) return a->prio < b->prio;
    if (a->tie != b->tie) return a->tie < b->tie;
    return a->left < b->left;
}

static kiln_status heap_push(tok_ws *w, tok_pair p) {
    KILN_TRY(tok_grow((void **)&w->heap, &w->heap_cap, w->heap_n + 1, sizeof *w->heap));
    size_t i = w->heap_n++;
    while (i > 0) {
        size_t par = (i - 1) / 2;
        if (!pair_less(&p, &w->heap[par])) break;
        w->heap[i] = w->heap[par];
        i = par;
    }
    w->heap[i] = p;
    return KILN_OK;
}

static tok_pair heap_pop(tok_ws *w) {
    tok_pair top = w->heap[0];
    tok_pair last = w->heap[--w->heap_n];
    size_t i = 0, n = w->heap_n;
    for (;;) {
        size_t c = 2 * i + 1;
        if (c >= n) break;
        if (c + 1 < n && pair_less(&w->heap[c + 1], &w->heap[c])) c++;
        if (!pair_less(&w->heap[c], &last)) break;
        w->heap[i] = w->heap[c];
        i = c;
    }
    if (n) w->heap[i] = last;
    return top;
}

/* Queue the merge of symbols l and r if the vocabulary has one. */
static kiln_status try_pair(const kiln_tokenizer *t, tok_ws *w, const char *text, int32_t l,
                            int32_t r) {
    if (l < 0 || r < 0) return KILN_OK;
    const tok_sym *a = &w->sym[l], *b = &w->sym[r];
    tok_pair p = {0};
    p.left = l;
    p.right = r;
    p.size = a->len + b->len;
    if (t->merge_mode == TOK_MERGE_RANK) {
        const struct tok_merge *m = tok_merge_find(t, a->id, b->id);
        if (!m) return KILN_OK;
        p.prio = m->rank;
        p.id = m->id;
    } else {
        int32_t id = tok_find(t, text + a->start, p.size);
        if (id < 0 || (t->attr[id] & (TOK_ATTR_SPECIAL | TOK_ATTR_ADDED | TOK_ATTR_BYTE |
                                      TOK_ATTR_UNUSED)))
            return KILN_OK;
        if (t->merge_by_id) {
            /* transformers' merges pair two vocabulary pieces; a character outside the
             * vocabulary is already byte-fallback tokens there */
            if (a->id < 0 || b->id < 0) return KILN_OK;
            p.prio = id;
            p.tie = UINT32_MAX - a->len;
        } else {
            p.prio = -(double)t->score[id];
        }
        p.id = id;
    }
    return heap_push(w, p);
}

static kiln_status emit_unknown(const kiln_tokenizer *t, tok_ws *w, const char *s, size_t n) {
    if (t->byte_fallback) {
        int ok = 1;
        for (size_t i = 0; i < n; i++) ok &= t->byte_id[(uint8_t)s[i]] >= 0;
        if (ok) {
            for (size_t i = 0; i < n; i++) KILN_TRY(ws_push_id(w, t->byte_id[(uint8_t)s[i]]));
            return KILN_OK;
        }
    }
    if (t->model_unk_id >= 0) return ws_push_id(w, t->model_unk_id);
    return KILN_OK; /* no unknown token: the character is dropped, as HF's BPE does */
}

/* BPE over one pre-token s[0..n) (valid UTF-8). */
static kiln_status bpe_piece(const kiln_tokenizer *t, tok_ws *w, const char *s, size_t n) {
    const char *text = s;
    size_t tn = n;
    size_t nsym = 0;
    if (t->byte_level) {
        KILN_TRY(tok_grow((void **)&w->map, &w->map_cap, n * 2 + 1, 1));
        KILN_TRY(tok_grow((void **)&w->sym, &w->sym_cap, n, sizeof *w->sym));
        tn = 0;
        for (size_t i = 0; i < n; i++) {
            int k = tok_utf8_encode(tok_byte_to_cp((uint8_t)s[i]), w->map + tn);
            tok_sym *y = &w->sym[nsym++];
            y->id = t->byte_id[(uint8_t)s[i]];
            y->start = (uint32_t)tn;
            y->len = (uint32_t)k;
            tn += (size_t)k;
        }
        text = w->map;
    } else {
        KILN_TRY(tok_grow((void **)&w->sym, &w->sym_cap, n, sizeof *w->sym));
        for (size_t i = 0; i < n;) {
            int k = tok_utf8_valid_len((const uint8_t *)s + i, n - i);
            if (k <= 0) k = 1; /* cannot happen: input was sanitized */
            tok_sym *y = &w->sym[nsym++];
            y->id = tok_find(t, s + i, (size_t)k);
            y->start = (uint32_t)i;
            y->len = (uint32_t)k;
            i += (size_t)k;
        }
    }
    if (t->ignore_merges) {
        int32_t id = tok_find(t, text, tn);
        if (id >= 0) return ws_push_id(w, id);
    }
    for (size_t i = 0; i < nsym; i++) {
        w->sym[i].prev = (int32_t)i - 1;
        w->sym[i].next = i + 1 < nsym ? (int32_t)i + 1 : -1;
    }
    w->heap_n = 0;
    for (size_t i = 0; i + 1 < nsym; i++) KILN_TRY(try_pair(t, w, text, (int32_t)i, (int32_t)i + 1));
    while (w->heap_n > 0) {
        tok_pair p = heap_pop(w);
        tok_sym *a = &w->sym[p.left], *b = &w->sym[p.right];
        if (a->len == 0 || b->len == 0 || a->len + b->len != p.size || a->next != p.right)
            continue; /* stale: one side changed since it was queued */
        a->len += b->len;
        a->id = p.id;
        b->len = 0;
        a->next = b->next;
        if (b->next >= 0) w->sym[b->next].prev = p.left;
        KILN_TRY(try_pair(t, w, text, a->prev, p.left));
        KILN_TRY(try_pair(t, w, text, p.left, a->next));
    }
    for (int32_t i = nsym ? 0 : -1; i >= 0; i = w->sym[i].next) {
        tok_sym *y = &w->sym[i];
        if (y->id >= 0) {
            KILN_TRY(ws_push_id(w, y->id));
        } else if (t->byte_level) {
            /* a mapped char missing from a byte-level vocabulary */
            if (t->model_unk_id >= 0) KILN_TRY(ws_push_id(w, t->model_unk_id));
        } else {
            KILN_TRY(emit_unknown(t, w, text + y->start, y->len));
        }
    }
    return KILN_OK;
}

/* ---- normalizer and pre-tokenizer ----------------------------------------------------------- */

/* Replace every occurrence of pat with rep in sb[off..off+len), appending the result. */
static kiln_status replace_all(tok_ws *w, size_t off, size_t len, const char *pat, const char *rep,
                               size_t *noff, size_t *nlen) {
    size_t pl = strlen(pat), rl = strlen(rep);
    size_t start = w->sb_n, o;
    for (size_t i = 0; i < len;) {
        if (pl && i + pl <= len && memcmp(w->sb + off + i, pat, pl) == 0) {
            KILN_TRY(ws_append(w, rep, rl, &o));
            i += pl;
        } else {
            size_t j = i + 1;
            while (j < len && !(pl && w->sb[off + j] == pat[0])) j++;
            /* sb may move in ws_append: copy through a bounded loop of appends */
            KILN_TRY(tok_grow((void **)&w->sb, &w->sb_cap, w->sb_n + (j - i) + 1, 1));
            memcpy(w->sb + w->sb_n, w->sb + off + i, j - i);
            w->sb_n += j - i;
            i = j;
        }
    }
    *noff = start;
    *nlen = w->sb_n - start;
    return KILN_OK;
}

static kiln_status normalize(const kiln_tokenizer *t, tok_ws *w, size_t *off, size_t *len) {
    for (int k = 0; k < t->n_norm; k++) {
        const tok_norm_step *st = &t->norm[k];
        size_t o;
        if (st->kind == TOK_NORM_PREPEND) {
            if (*len == 0) continue;
            size_t pl = strlen(st->a);
            size_t start = w->sb_n;
            KILN_TRY(ws_append(w, st->a, pl, &o));
            KILN_TRY(tok_grow((void **)&w->sb, &w->sb_cap, w->sb_n + *len + 1, 1));
            memcpy(w->sb + w->sb_n, w->sb + *off, *len);
            w->sb_n += *len;
            *off = start;
            *len += pl;
        } else if (st->kind == TOK_NORM_REPLACE) {
            KILN_TRY(replace_all(w, *off, *len, st->a, st->b, off, len));
        } else {
            int opt = UTF8PROC_STABLE;
            if (st->kind == TOK_NORM_NFC) opt |= UTF8PROC_COMPOSE;
            else if (st->kind == TOK_NORM_NFD) opt |= UTF8PROC_DECOMPOSE;
            else if (st->kind == TOK_NORM_NFKC) opt |= UTF8PROC_COMPOSE | UTF8PROC_COMPAT;
            else if (st->kind == TOK_NORM_NFKD) opt |= UTF8PROC_DECOMPOSE | UTF8PROC_COMPAT;
            else opt |= UTF8PROC_CASEFOLD; /* LOWERCASE: close to Rust's to_lowercase */
            utf8proc_uint8_t *res = NULL;
            utf8proc_ssize_t r = utf8proc_map((const utf8proc_uint8_t *)w->sb + *off,
                                              (utf8proc_ssize_t)*len, &res, opt);
            if (r < 0) return kiln_error(KILN_ERR_INTERNAL, "tokenize: normalizer: %s",
                                         utf8proc_errmsg(r));
            kiln_status st2 = ws_append(w, (const char *)res, (size_t)r, &o);
            free(res); /* utf8proc allocates with malloc */
            KILN_TRY(st2);
            *off = o;
            *len = (size_t)r;
        }
    }
    return KILN_OK;
}

static const char SPM_MARK[] = "\xe2\x96\x81"; /* U+2581 ▁ */

/* Split piece (off, len) by the regex, by HF's SplitDelimiterBehavior. */
static kiln_status split_regex(tok_ws *w, const tok_pre_step *st, size_t off, size_t len) {
    size_t pos = 0, last = 0; /* last: end of the previous piece emitted */
    while (pos <= len) {
        int rc = pcre2_match(st->re, (PCRE2_SPTR)(w->sb + off), len, pos, PCRE2_NO_UTF_CHECK,
                             w->md, NULL);
        if (rc < 0) break;
        PCRE2_SIZE *ov = pcre2_get_ovector_pointer(w->md);
        size_t ms = ov[0], me = ov[1];
        if (me == ms) { /* empty match: step one character */
            if (ms >= len) break;
            int k = tok_utf8_valid_len((const uint8_t *)w->sb + off + ms, len - ms);
            pos = ms + (size_t)(k > 0 ? k : 1);
            continue;
        }
        switch (st->behavior) {
        case TOK_SPLIT_ISOLATED:
            KILN_TRY(ws_out_piece(w, off + last, ms - last));
            KILN_TRY(ws_out_piece(w, off + ms, me - ms));
            break;
        case TOK_SPLIT_REMOVED:
            KILN_TRY(ws_out_piece(w, off + last, ms - last));
            break;
        case TOK_SPLIT_MERGED_PREV:
            KILN_TRY(ws_out_piece(w, off + last, me - last));
            break;
        case TOK_SPLIT_MERGED_NEXT:
            KILN_TRY(ws_out_piece(w, off + last, ms - last));
            break;
        case TOK_SPLIT_CONTIGUOUS:
            KILN_TRY(ws_out_piece(w, off + last, ms - last));
            KILN_TRY(ws_out_piece(w, off + ms, me - ms));
            break;
        }
        last = st->behavior == TOK_SPLIT_MERGED_NEXT ? ms : me;
        pos = me;
    }
    KILN_TRY(ws_out_piece(w, off + last, len - last));
    return KILN_OK;
}

/* Pre-tokenize one (normalized) segment into w->pa. first: the segment starts the text;
 * after_token: it follows an added token (or starts the text), for SentencePiece's prefix. */
static kiln_status pretokenize(const kiln_tokenizer *t, tok_ws *w, size_t off, size_t len,
                               int first, int after_token) {
    w->pa_n = 0;
    KILN_TRY(tok_grow((void **)&w->pa, &w->pa_cap, 1, sizeof *w->pa));
    w->pa[0].off = off;
    w->pa[0].len = len;
    w->pa_n = 1;
    for (int k = 0; k < t->n_pre; k++) {
        const tok_pre_step *st = &t->pre_steps[k];
        w->pb_n = 0;
        for (size_t i = 0; i < w->pa_n; i++) {
            size_t po = w->pa[i].off, pl = w->pa[i].len, o, no, nl;
            switch (st->kind) {
            case TOK_PRE_SPLIT:
                KILN_TRY(split_regex(w, st, po, pl));
                break;
            case TOK_PRE_PREFIX_SPACE:
                if (pl > 0 && w->sb[po] != ' ') {
                    size_t start = w->sb_n;
                    KILN_TRY(ws_append(w, " ", 1, &o));
                    KILN_TRY(tok_grow((void **)&w->sb, &w->sb_cap, w->sb_n + pl + 1, 1));
                    memcpy(w->sb + w->sb_n, w->sb + po, pl);
                    w->sb_n += pl;
                    po = start;
                    pl += 1;
                }
                KILN_TRY(ws_out_piece(w, po, pl));
                break;
            case TOK_PRE_METASPACE:
            case TOK_PRE_SPM: {
                KILN_TRY(replace_all(w, po, pl, " ", SPM_MARK, &no, &nl));
                int prepend;
                if (st->kind == TOK_PRE_SPM) prepend = st->prepend && after_token && i == 0;
                else prepend = st->prepend == 2 || (st->prepend == 1 && first && i == 0);
                if (st->kind == TOK_PRE_METASPACE && nl >= 3 && memcmp(w->sb + no, SPM_MARK, 3) == 0)
                    prepend = 0;
                if (prepend) {
                    size_t start = w->sb_n;
                    KILN_TRY(ws_append(w, SPM_MARK, 3, &o));
                    KILN_TRY(tok_grow((void **)&w->sb, &w->sb_cap, w->sb_n + nl + 1, 1));
                    memcpy(w->sb + w->sb_n, w->sb + no, nl);
                    w->sb_n += nl;
                    no = start;
                    nl += 3;
                }
                if (st->kind == TOK_PRE_METASPACE && st->split) {
                    /* split before every marker (MergedWithNext) */
                    size_t last = 0;
                    for (size_t j = 1; j + 3 <= nl; j++) {
                        if (memcmp(w->sb + no + j, SPM_MARK, 3) == 0) {
                            KILN_TRY(ws_out_piece(w, no + last, j - last));
                            last = j;
                        }
                    }
                    KILN_TRY(ws_out_piece(w, no + last, nl - last));
                } else {
                    KILN_TRY(ws_out_piece(w, no, nl));
                }
                break;
            }
            }
        }
        /* swap lists */
        tok_span *tp = w->pa;
        size_t tc = w->pa_cap;
        w->pa = w->pb;
        w->pa_cap = w->pb_cap;
        w->pa_n = w->pb_n;
        w->pb = tp;
        w->pb_cap = tc;
        w->pb_n = 0;
    }
    return KILN_OK;
}

/* ---- the whole encode --------------------------------------------------------------------- */

static int is_ws_byte(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v'; }

/* Replace invalid UTF-8 (each maximal invalid subpart -> U+FFFD). NULL copy when valid. */
static kiln_status sanitize_utf8(const char *s, size_t n, char **out, size_t *out_n) {
    size_t i = 0;
    while (i < n) {
        int k = tok_utf8_valid_len((const uint8_t *)s + i, n - i);
        if (k == 0) break;
        i += (size_t)k;
    }
    *out = NULL;
    if (i == n) return KILN_OK;
    size_t cap;
    if (kiln_mul_overflow(n, 3, &cap)) return kiln_error(KILN_ERR_NOMEM, "tokenize: too large");
    char *b = kiln_malloc(cap + 1);
    if (!b) return kiln_error(KILN_ERR_NOMEM, "tokenize: out of memory (%zu bytes)", cap);
    size_t o = 0;
    for (i = 0; i < n;) {
        int k = tok_utf8_valid_len((const uint8_t *)s + i, n - i);
        if (k > 0) {
            memcpy(b + o, s + i, (size_t)k);
            o += (size_t)k;
            i += (size_t)k;
        } else {
            memcpy(b + o, "\xef\xbf\xbd", 3);
            o += 3;
            i += (size_t)tok_utf8_invalid_len((const uint8_t *)s + i, n - i);
        }
    }
    *out = b;
    *out_n = o;
    return KILN_OK;
}

static kiln_status encode_text(const kiln_tokenizer *t, tok_ws *w, const char *s, size_t n,
                               int first, int after_token) {
    if (n == 0) return KILN_OK;
    w->sb_n = 0;
    size_t off, len = n;
    KILN_TRY(ws_append(w, s, n, &off));
    KILN_TRY(normalize(t, w, &off, &len));
    KILN_TRY(pretokenize(t, w, off, len, first, after_token));
    for (size_t i = 0; i < w->pa_n; i++) {
        /* sb does not move during BPE, but copy the span bounds first */
        size_t po = w->pa[i].off, pl = w->pa[i].len;
        KILN_TRY(bpe_piece(t, w, w->sb + po, pl));
    }
    return KILN_OK;
}

/* The added token matching at s[i..n), longest first, or -1. */
static int32_t match_added(const kiln_tokenizer *t, const char *s, size_t n, size_t i,
                           int parse_special) {
    for (int k = 0; k < t->n_added; k++) {
        int32_t id = t->added[k];
        uint32_t L = t->piece_len[id];
        if (L > n - i) continue;
        if (!parse_special && (t->attr[id] & TOK_ATTR_SPECIAL)) continue;
        if (t->piece[id][0] == s[i] && memcmp(t->piece[id], s + i, L) == 0) return id;
    }
    return -1;
}

static kiln_status encode_all(const kiln_tokenizer *t, tok_ws *w, const char *s, size_t n,
                              int add_special, int parse_special) {
    if (add_special) {
        if (t->use_template_processing) {
            for (int i = 0; i < t->n_prefix; i++) KILN_TRY(ws_push_id(w, t->prefix_ids[i]));
        } else if (t->add_bos && t->bos_id >= 0) {
            KILN_TRY(ws_push_id(w, t->bos_id));
        }
    }
    /* first-byte filter for the added-token scan */
    uint8_t first_bytes[256] = {0};
    for (int k = 0; k < t->n_added; k++) first_bytes[(uint8_t)t->piece[t->added[k]][0]] = 1;
    size_t seg = 0; /* start of the pending text segment */
    int after_token = 1;
    for (size_t i = 0; i < n;) {
        int32_t id = first_bytes[(uint8_t)s[i]] ? match_added(t, s, n, i, parse_special) : -1;
        if (id < 0) {
            i++;
            continue;
        }
        size_t end = i + t->piece_len[id], seg_end = i;
        if (t->attr[id] & TOK_ATTR_LSTRIP)
            while (seg_end > seg && is_ws_byte(s[seg_end - 1])) seg_end--;
        if (t->attr[id] & TOK_ATTR_RSTRIP)
            while (end < n && is_ws_byte(s[end])) end++;
        KILN_TRY(encode_text(t, w, s + seg, seg_end - seg, seg == 0, after_token));
        KILN_TRY(ws_push_id(w, id));
        after_token = 1;
        seg = i = end;
    }
    if (seg < n) KILN_TRY(encode_text(t, w, s + seg, n - seg, seg == 0, after_token));
    if (add_special) {
        if (t->use_template_processing) {
            for (int i = 0; i < t->n_suffix; i++) KILN_TRY(ws_push_id(w, t->suffix_ids[i]));
        } else if (t->add_eos && t->eos_id >= 0) {
            KILN_TRY(ws_push_id(w, t->eos_id));
        }
    }
    return KILN_OK;
}

KILN_API kiln_status kiln_tokenize(const kiln_tokenizer *t, const char *text, size_t len,
                                   int add_special, int parse_special, int32_t *ids,
                                   size_t cap, size_t *n_out) {
    KILN_TRY(kiln_handle_check(t, KILN_HANDLE_TOKENIZER, "kiln_tokenize"));
    if ((!text && len) || !n_out || (!ids && cap))
        return kiln_error(KILN_ERR_INVALID_ARG, "kiln_tokenize: NULL argument");
    char *clean = NULL;
    size_t clean_n = 0;
    KILN_TRY(sanitize_utf8(text, len, &clean, &clean_n));
    if (clean) {
        text = clean;
        len = clean_n;
    }
    tok_ws w = {0};
    kiln_status st = KILN_OK;
    if (t->n_pre > 0) {
        w.md = pcre2_match_data_create(4, NULL);
        if (!w.md) st = kiln_error(KILN_ERR_NOMEM, "kiln_tokenize: out of memory");
    }
    if (st == KILN_OK) st = encode_all(t, &w, text ? text : "", len, add_special, parse_special);
    if (st == KILN_OK) {
        *n_out = w.ids_n;
        if (w.ids_n > cap) {
            st = kiln_error(KILN_ERR_BUFFER_TOO_SMALL,
                            "kiln_tokenize: %zu ids do not fit in cap %zu", w.ids_n, cap);
        } else if (w.ids_n) {
            memcpy(ids, w.ids, w.ids_n * sizeof *ids);
        }
    }
    ws_free(&w);
    kiln_free(clean);
    return st;
}
