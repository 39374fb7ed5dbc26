/*
 * tok_export.c -- a kiln_tokenizer written back as Hugging Face tokenizer.json and
 * tokenizer_config.json, such that HF `tokenizers` (and kiln's own tokenizer.json loader)
 * encode every text to the ids kiln gives.
 *
 * What is written, per part of the pipeline:
 *   model          BPE: vocab (every id with a string; a duplicated string is kept only as an
 *                  added token), merges as [left, right] pairs in rank order. A SentencePiece
 *                  vocabulary (scores, merge by score) gets the merges HF's converters derive:
 *                  every split of a normal piece into two normal pieces, ordered by the merged
 *                  piece's score (highest first), then its id, then the split position
 *                  (merge_by_id, Gemma: by the merged piece's id, then the longer left part).
 *   normalizer     kiln's steps as written (NFC.., Lowercase, Prepend, Replace); the GGUF
 *                  SentencePiece pre-step becomes HF's Llama layout Prepend("▁") + Replace.
 *   pre_tokenizer  regex splits by their known patterns (the compiled regex keeps no text):
 *                  GPT-2's pattern is ByteLevel(use_regex=true), \p{N} is Digits(individual),
 *                  Llama 3 / Qwen2 / GPT-4o patterns are Split(Regex, Isolated); a byte-level
 *                  vocabulary then gets ByteLevel(use_regex=false). Metaspace as loaded. A split
 *                  whose pattern kiln cannot name (a tokenizer.json's own regex) is refused:
 *                  export copies such a tokenizer.json from the source folder instead.
 *   post_processor TemplateProcessing with BOS/EOS when the tokenizer adds them, else null.
 *   decoder        kiln's decoder steps as written.
 *   added_tokens   every added token with its special / lstrip / rstrip flags, normalized
 *                  false (kiln matches added tokens on the raw text).
 */
#include "tok_internal.h"

#include <cjson/cJSON.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define TOK_SPM_MARK "\xe2\x96\x81"

/* A cJSON builder that remembers the first allocation failure. */
typedef struct tx {
    int ok;
} tx;

static cJSON *tx_obj(tx *x) {
    cJSON *o = cJSON_CreateObject();
    if (!o) x->ok = 0;
    return o;
}
static cJSON *tx_arr(tx *x) {
    cJSON *o = cJSON_CreateArray();
    if (!o) x->ok = 0;
    return o;
}
/* Adds item to obj (key) or to an array (key NULL); frees item when it cannot. */
static cJSON *tx_add(tx *x, cJSON *obj, const char *key, cJSON *item) {
    if (!item || !obj) {
        x->ok = 0;
        cJSON_Delete(item);
        return NULL;
    }
    cJSON_bool r = key ? cJSON_AddItemToObject(obj, key, item) : cJSON_AddItemToArray(obj, item);
    if (!r) {
        x->ok = 0;
        cJSON_Delete(item);
        return NULL;
    }
    return item;
}
static void tx_str(tx *x, cJSON *o, const char *k, const char *v) {
    tx_add(x, o, k, v ? cJSON_CreateString(v) : cJSON_CreateNull());
}
static void tx_num(tx *x, cJSON *o, const char *k, double v) { tx_add(x, o, k, cJSON_CreateNumber(v)); }
static void tx_bool(tx *x, cJSON *o, const char *k, int v) { tx_add(x, o, k, cJSON_CreateBool(v)); }
static void tx_null(tx *x, cJSON *o, const char *k) { tx_add(x, o, k, cJSON_CreateNull()); }
static cJSON *tx_typed(tx *x, const char *type) {
    cJSON *o = tx_obj(x);
    if (o) tx_str(x, o, "type", type);
    return o;
}
/* A string pattern {"String": s}. */
static cJSON *tx_pattern(tx *x, const char *kind, const char *s) {
    cJSON *o = tx_obj(x);
    if (o) tx_str(x, o, kind, s);
    return o;
}

/* items[0..n) as one step or a Sequence (list key), NULL-valued when n == 0. */
static cJSON *tx_seq(tx *x, cJSON **items, int n, const char *list_key) {
    if (n == 0) return cJSON_CreateNull();
    if (n == 1) return items[0];
    cJSON *s = tx_typed(x, "Sequence");
    cJSON *a = tx_add(x, s, list_key, tx_arr(x));
    for (int i = 0; i < n; i++) tx_add(x, a, NULL, items[i]);
    if (!a)
        for (int i = 0; i < n; i++) cJSON_Delete(items[i]);
    return s;
}

/* Print a tree into a kiln_malloc'd NUL-terminated string; deletes the tree. */
static kiln_status tx_finish(tx *x, cJSON *root, const char *label, char **out, size_t *len) {
    char *s = x->ok && root ? cJSON_Print(root) : NULL;
    cJSON_Delete(root);
    if (!s) return kiln_error(KILN_ERR_NOMEM, "%s: out of memory (writing JSON)", label);
    size_t n = strlen(s);
    char *k = kiln_strndup(s, n);
    free(s);
    if (!k) return kiln_error(KILN_ERR_NOMEM, "%s: out of memory (writing JSON)", label);
    *out = k;
    if (len) *len = n;
    return KILN_OK;
}

/* ---- model: vocab and merges --------------------------------------------------------------- */

typedef struct tx_merge {
    int32_t left, right;
    double key1;  /* rank (BPE) or -score of the merged piece (SentencePiece) */
    int32_t key2; /* merged id */
    int32_t key3; /* split position */
} tx_merge;

static int tx_merge_cmp(const void *pa, const void *pb) {
    const tx_merge *a = pa, *b = pb;
    if (a->key1 != b->key1) return a->key1 < b->key1 ? -1 : 1;
    if (a->key2 != b->key2) return a->key2 < b->key2 ? -1 : 1;
    return (a->key3 > b->key3) - (a->key3 < b->key3);
}

static int tx_normal(const kiln_tokenizer *t, int32_t id) {
    return id >= 0 && !(t->attr[id] & (TOK_ATTR_SPECIAL | TOK_ATTR_ADDED | TOK_ATTR_BYTE | TOK_ATTR_UNUSED));
}

/* The merges in application order, as (left, right) ids. */
static kiln_status tx_collect_merges(const kiln_tokenizer *t, tx_merge **out, size_t *n_out) {
    size_t n = 0, cap = 0;
    tx_merge *m = NULL;
    if (t->merge_mode == TOK_MERGE_RANK) {
        if (t->mhash)
            for (size_t s = 0; s <= t->mhash_mask; s++)
                if (t->mhash[s].key != UINT64_MAX) cap++;
        m = kiln_malloc((cap ? cap : 1) * sizeof *m);
        if (!m) return kiln_error(KILN_ERR_NOMEM, "%s: out of memory (merges)", t->label);
        if (t->mhash)
            for (size_t s = 0; s <= t->mhash_mask; s++) {
                const struct tok_merge *e = &t->mhash[s];
                if (e->key == UINT64_MAX) continue;
                tx_merge *d = &m[n++];
                d->left = (int32_t)(e->key >> 32);
                d->right = (int32_t)(e->key & 0xffffffffu);
                d->key1 = e->rank;
                d->key2 = d->key3 = 0;
            }
    } else {
        if (!t->score)
            return kiln_error(KILN_ERR_INTERNAL, "%s: SentencePiece vocabulary without scores", t->label);
        for (int pass = 0; pass < 2; pass++) {
            for (int32_t id = 0; id < t->n_vocab; id++) {
                if (!tx_normal(t, id) || !t->piece[id]) continue;
                const char *p = t->piece[id];
                uint32_t len = t->piece_len[id];
                for (uint32_t k = 1; k < len; k++) {
                    if (((uint8_t)p[k] & 0xC0) == 0x80) continue; /* split at characters */
                    int32_t a = tok_find(t, p, k), b = tok_find(t, p + k, len - k);
                    if (!tx_normal(t, a) || !tx_normal(t, b)) continue;
                    if (pass == 0) {
                        cap++;
                        continue;
                    }
                    tx_merge *d = &m[n++];
                    d->left = a;
                    d->right = b;
                    d->key1 = t->merge_by_id ? id : -(double)t->score[id];
                    d->key2 = id;
                    d->key3 = t->merge_by_id ? -(int32_t)k : (int32_t)k;
                }
            }
            if (pass == 0) {
                m = kiln_malloc((cap ? cap : 1) * sizeof *m);
                if (!m) return kiln_error(KILN_ERR_NOMEM, "%s: out of memory (merges)", t->label);
            }
        }
    }
    qsort(m, n, sizeof *m, tx_merge_cmp);
    *out = m;
    *n_out = n;
    return KILN_OK;
}

static kiln_status tx_model(tx *x, const kiln_tokenizer *t, cJSON **out) {
    cJSON *model = tx_typed(x, "BPE");
    tx_null(x, model, "dropout");
    tx_str(x, model, "unk_token", t->model_unk_id >= 0 ? t->piece[t->model_unk_id] : NULL);
    tx_null(x, model, "continuing_subword_prefix");
    tx_null(x, model, "end_of_word_suffix");
    tx_bool(x, model, "fuse_unk", !t->byte_level && t->byte_fallback);
    tx_bool(x, model, "byte_fallback", t->byte_fallback);
    tx_bool(x, model, "ignore_merges", t->ignore_merges);
    cJSON *vocab = tx_add(x, model, "vocab", tx_obj(x));
    kiln_status st = KILN_OK;
    if (t->n_alias > 0)
        st = kiln_error(KILN_ERR_UNSUPPORTED, "%s: %d vocabulary strings share an id with another "
                        "string; kiln does not write such a vocabulary", t->label, t->n_alias);
    for (int32_t id = 0; vocab && id < t->n_vocab && st == KILN_OK; id++) {
        if (!t->piece[id] || (t->attr[id] & TOK_ATTR_UNUSED)) continue;
        if (tok_find(t, t->piece[id], t->piece_len[id]) != id) {
            /* the same string at two ids: HF's vocab is a map, so only an added token can
             * carry the second id */
            if (t->attr[id] & TOK_ATTR_ADDED) continue;
            st = kiln_error(KILN_ERR_UNSUPPORTED, "%s: token %d '%.60s' duplicates another token's "
                            "string; tokenizer.json cannot hold it", t->label, id, t->piece[id]);
            break;
        }
        if (strlen(t->piece[id]) != t->piece_len[id]) {
            st = kiln_error(KILN_ERR_UNSUPPORTED, "%s: token %d holds a NUL byte; tokenizer.json "
                            "cannot hold it", t->label, id);
            break;
        }
        tx_num(x, vocab, t->piece[id], id);
    }
    tx_merge *m = NULL;
    size_t nm = 0;
    if (st == KILN_OK) st = tx_collect_merges(t, &m, &nm);
    cJSON *merges = tx_add(x, model, "merges", tx_arr(x));
    for (size_t i = 0; st == KILN_OK && merges && i < nm; i++) {
        cJSON *pair = tx_add(x, merges, NULL, tx_arr(x));
        tx_add(x, pair, NULL, cJSON_CreateString(t->piece[m[i].left]));
        tx_add(x, pair, NULL, cJSON_CreateString(t->piece[m[i].right]));
    }
    kiln_free(m);
    if (st != KILN_OK) {
        cJSON_Delete(model);
        return st;
    }
    *out = model;
    return KILN_OK;
}

/* ---- pipeline steps ---------------------------------------------------------------------- */

static const char *tx_scheme(int prepend) {
    return prepend == 2 ? "always" : prepend == 1 ? "first" : "never";
}

/* The text of split step k, which kiln only knows through the tokenizer's pre name. */
static const char *tx_split_pattern(const kiln_tokenizer *t, int k) {
    int n_split = 0, idx = -1;
    for (int i = 0; i < t->n_pre; i++)
        if (t->pre_steps[i].kind == TOK_PRE_SPLIT) {
            if (i == k) idx = n_split;
            n_split++;
        }
    if (t->pre_steps[k].pattern) return t->pre_steps[k].pattern; /* its source */
    if (!strcmp(t->pre, "smollm") && n_split == 2) return idx == 0 ? "\\p{N}" : tok_regex_by_name("gpt2");
    if (n_split == 1 && t->pre_steps[k].behavior == TOK_SPLIT_ISOLATED) return tok_regex_by_name(t->pre);
    return NULL;
}

static kiln_status tx_pre(tx *x, const kiln_tokenizer *t, cJSON **norm_extra, int *n_norm_extra,
                          cJSON **out) {
    cJSON *items[TOK_MAX_STEPS + 1];
    int n = 0, prefix_space = 0, bytelevel_done = 0;
    for (int k = 0; k < t->n_pre; k++)
        if (t->pre_steps[k].kind == TOK_PRE_PREFIX_SPACE) prefix_space = 1;
    for (int k = 0; k < t->n_pre; k++) {
        const tok_pre_step *s = &t->pre_steps[k];
        if (s->kind == TOK_PRE_PREFIX_SPACE) continue;
        if (s->kind == TOK_PRE_METASPACE) {
            cJSON *o = tx_typed(x, "Metaspace");
            tx_str(x, o, "replacement", TOK_SPM_MARK);
            tx_str(x, o, "prepend_scheme", tx_scheme(s->prepend));
            tx_bool(x, o, "split", s->split);
            items[n++] = o;
            continue;
        }
        if (s->kind == TOK_PRE_SPM) {
            /* HF's Llama layout: a normalizer, applied to each segment between added tokens */
            if (s->prepend) {
                cJSON *p = tx_typed(x, "Prepend");
                tx_str(x, p, "prepend", TOK_SPM_MARK);
                norm_extra[(*n_norm_extra)++] = p;
            }
            cJSON *r = tx_typed(x, "Replace");
            tx_add(x, r, "pattern", tx_pattern(x, "String", " "));
            tx_str(x, r, "content", TOK_SPM_MARK);
            norm_extra[(*n_norm_extra)++] = r;
            continue;
        }
        const char *re = tx_split_pattern(t, k);
        if (!re) {
            for (int i = 0; i < n; i++) cJSON_Delete(items[i]);
            return kiln_error(KILN_ERR_UNSUPPORTED, "%s: pre-tokenizer '%s': the pattern of split "
                              "step %d is not one kiln can name", t->label, t->pre, k);
        }
        if (t->byte_level && !s->literal && !strcmp(re, tok_regex_by_name("gpt2"))) {
            cJSON *o = tx_typed(x, "ByteLevel");
            tx_bool(x, o, "add_prefix_space", prefix_space);
            tx_bool(x, o, "trim_offsets", 1);
            tx_bool(x, o, "use_regex", 1);
            items[n++] = o;
            bytelevel_done = 1;
        } else if (!s->literal && s->behavior == TOK_SPLIT_ISOLATED &&
                   (!strcmp(re, "\\p{N}") || !strcmp(re, "\\p{N}+"))) { /* as tok_load reads Digits */
            cJSON *o = tx_typed(x, "Digits");
            tx_bool(x, o, "individual_digits", !strcmp(re, "\\p{N}"));
            items[n++] = o;
        } else {
            static const char *const behaviors[] = {[TOK_SPLIT_ISOLATED] = "Isolated",
                                                    [TOK_SPLIT_REMOVED] = "Removed",
                                                    [TOK_SPLIT_MERGED_PREV] = "MergedWithPrevious",
                                                    [TOK_SPLIT_MERGED_NEXT] = "MergedWithNext",
                                                    [TOK_SPLIT_CONTIGUOUS] = "Contiguous"};
            cJSON *o = tx_typed(x, "Split");
            tx_add(x, o, "pattern", tx_pattern(x, s->literal ? "String" : "Regex", re));
            tx_str(x, o, "behavior", behaviors[s->behavior]);
            tx_bool(x, o, "invert", 0);
            items[n++] = o;
        }
    }
    if (t->byte_level && !bytelevel_done) {
        cJSON *o = tx_typed(x, "ByteLevel");
        tx_bool(x, o, "add_prefix_space", prefix_space);
        tx_bool(x, o, "trim_offsets", 1);
        tx_bool(x, o, "use_regex", 0);
        items[n++] = o;
    }
    *out = tx_seq(x, items, n, "pretokenizers");
    return KILN_OK;
}

static cJSON *tx_normalizer(tx *x, const kiln_tokenizer *t, cJSON **extra, int n_extra) {
    cJSON *items[2 * TOK_MAX_STEPS];
    int n = 0;
    for (int k = 0; k < t->n_norm; k++) {
        const tok_norm_step *s = &t->norm[k];
        static const char *const names[] = {"NFC", "NFD", "NFKC", "NFKD", "Lowercase"};
        cJSON *o;
        if (s->kind == TOK_NORM_PREPEND) {
            o = tx_typed(x, "Prepend");
            tx_str(x, o, "prepend", s->a);
        } else if (s->kind == TOK_NORM_REPLACE) {
            o = tx_typed(x, "Replace");
            tx_add(x, o, "pattern", tx_pattern(x, "String", s->a));
            tx_str(x, o, "content", s->b);
        } else {
            o = tx_typed(x, names[s->kind]);
        }
        items[n++] = o;
    }
    for (int k = 0; k < n_extra; k++) items[n++] = extra[k];
    return tx_seq(x, items, n, "normalizers");
}

static cJSON *tx_decoder(tx *x, const kiln_tokenizer *t) {
    if (t->dec_join_space) return cJSON_CreateNull();
    cJSON *items[TOK_MAX_STEPS];
    int n = 0;
    for (int k = 0; k < t->n_dec; k++) {
        const tok_dec_step *d = &t->dec[k];
        cJSON *o = NULL;
        switch (d->kind) {
        case TOK_DEC_BYTELEVEL:
            o = tx_typed(x, "ByteLevel");
            tx_bool(x, o, "add_prefix_space", 1);
            tx_bool(x, o, "trim_offsets", 1);
            tx_bool(x, o, "use_regex", 1);
            break;
        case TOK_DEC_REPLACE:
            o = tx_typed(x, "Replace");
            tx_add(x, o, "pattern", tx_pattern(x, "String", d->a));
            tx_str(x, o, "content", d->b);
            break;
        case TOK_DEC_BYTEFALLBACK: o = tx_typed(x, "ByteFallback"); break;
        case TOK_DEC_FUSE: o = tx_typed(x, "Fuse"); break;
        case TOK_DEC_STRIP:
            o = tx_typed(x, "Strip");
            tx_str(x, o, "content", d->a);
            tx_num(x, o, "start", d->start);
            tx_num(x, o, "stop", d->stop);
            break;
        case TOK_DEC_METASPACE:
            o = tx_typed(x, "Metaspace");
            tx_str(x, o, "replacement", d->a);
            tx_str(x, o, "prepend_scheme", d->start ? "always" : "never");
            tx_bool(x, o, "split", 1);
            break;
        }
        items[n++] = o;
    }
    return tx_seq(x, items, n, "decoders");
}

/* {"SpecialToken": {"id": piece, "type_id": 0}} or {"Sequence": {"id": "A", "type_id": 0}} */
static void tx_template_item(tx *x, cJSON *arr, const char *kind, const char *id) {
    cJSON *o = tx_add(x, arr, NULL, tx_obj(x));
    cJSON *in = tx_add(x, o, kind, tx_obj(x));
    tx_str(x, in, "id", id);
    tx_num(x, in, "type_id", 0);
}

static cJSON *tx_post(tx *x, const kiln_tokenizer *t) {
    const int32_t *pre = NULL, *suf = NULL;
    int np = 0, ns = 0;
    if (t->use_template_processing) {
        pre = t->prefix_ids;
        np = t->n_prefix;
        suf = t->suffix_ids;
        ns = t->n_suffix;
    } else {
        if (t->add_bos && t->bos_id >= 0) { pre = &t->bos_id; np = 1; }
        if (t->add_eos && t->eos_id >= 0) { suf = &t->eos_id; ns = 1; }
    }
    if (np == 0 && ns == 0) return cJSON_CreateNull();
    cJSON *o = tx_typed(x, "TemplateProcessing");
    cJSON *single = tx_add(x, o, "single", tx_arr(x));
    cJSON *pair = tx_add(x, o, "pair", tx_arr(x));
    for (int i = 0; i < np; i++) tx_template_item(x, single, "SpecialToken", t->piece[pre[i]]);
    tx_template_item(x, single, "Sequence", "A");
    for (int i = 0; i < ns; i++) tx_template_item(x, single, "SpecialToken", t->piece[suf[i]]);
    for (int i = 0; i < np; i++) tx_template_item(x, pair, "SpecialToken", t->piece[pre[i]]);
    tx_template_item(x, pair, "Sequence", "A");
    for (int i = 0; i < ns; i++) tx_template_item(x, pair, "SpecialToken", t->piece[suf[i]]);
    for (int i = 0; i < np; i++) tx_template_item(x, pair, "SpecialToken", t->piece[pre[i]]);
    tx_template_item(x, pair, "Sequence", "B");
    for (int i = 0; i < ns; i++) tx_template_item(x, pair, "SpecialToken", t->piece[suf[i]]);
    cJSON *sp = tx_add(x, o, "special_tokens", tx_obj(x));
    for (int k = 0; k < np + ns; k++) {
        int32_t id = k < np ? pre[k] : suf[k - np];
        const char *p = t->piece[id];
        if (!sp || cJSON_GetObjectItemCaseSensitive(sp, p)) continue;
        cJSON *e = tx_add(x, sp, p, tx_obj(x));
        tx_str(x, e, "id", p);
        cJSON *ids = tx_add(x, e, "ids", tx_arr(x));
        tx_add(x, ids, NULL, cJSON_CreateNumber(id));
        cJSON *toks = tx_add(x, e, "tokens", tx_arr(x));
        tx_add(x, toks, NULL, cJSON_CreateString(p));
    }
    return o;
}

/* ---- public (internal) entry points ----------------------------------------------------------- */

kiln_status kiln_tokenizer_write_hf_json(const kiln_tokenizer *t, char **out, size_t *len) {
    if (!t || !out) return kiln_error(KILN_ERR_INVALID_ARG, "kiln_tokenizer_write_hf_json: NULL argument");
    tx x = {1};
    cJSON *root = tx_obj(&x);
    tx_str(&x, root, "version", "1.0");
    tx_null(&x, root, "truncation");
    tx_null(&x, root, "padding");
    cJSON *added = tx_add(&x, root, "added_tokens", tx_arr(&x));
    for (int32_t id = 0; added && id < t->n_vocab; id++) {
        if (!(t->attr[id] & TOK_ATTR_ADDED) || !t->piece[id] || !t->piece_len[id]) continue;
        cJSON *e = tx_add(&x, added, NULL, tx_obj(&x));
        tx_num(&x, e, "id", id);
        tx_str(&x, e, "content", t->piece[id]);
        tx_bool(&x, e, "single_word", 0);
        tx_bool(&x, e, "lstrip", (t->attr[id] & TOK_ATTR_LSTRIP) != 0);
        tx_bool(&x, e, "rstrip", (t->attr[id] & TOK_ATTR_RSTRIP) != 0);
        tx_bool(&x, e, "normalized", 0);
        tx_bool(&x, e, "special", (t->attr[id] & TOK_ATTR_SPECIAL) != 0);
    }
    cJSON *norm_extra[2], *pre = NULL, *model = NULL;
    int n_norm_extra = 0;
    kiln_status st = tx_pre(&x, t, norm_extra, &n_norm_extra, &pre);
    if (st == KILN_OK) {
        tx_add(&x, root, "normalizer", tx_normalizer(&x, t, norm_extra, n_norm_extra));
        tx_add(&x, root, "pre_tokenizer", pre);
        tx_add(&x, root, "post_processor", tx_post(&x, t));
        tx_add(&x, root, "decoder", tx_decoder(&x, t));
        st = tx_model(&x, t, &model);
    } else {
        for (int i = 0; i < n_norm_extra; i++) cJSON_Delete(norm_extra[i]);
    }
    if (st != KILN_OK) {
        cJSON_Delete(root);
        return st;
    }
    tx_add(&x, root, "model", model);
    return tx_finish(&x, root, t->label, out, len);
}

kiln_status kiln_tokenizer_write_hf_config(const kiln_tokenizer *t, int model_max_length, char **out,
                                          size_t *len) {
    if (!t || !out) return kiln_error(KILN_ERR_INVALID_ARG, "kiln_tokenizer_write_hf_config: NULL argument");
    tx x = {1};
    cJSON *root = tx_obj(&x);
    int add_bos = t->use_template_processing ? t->n_prefix > 0 : t->add_bos;
    int add_eos = t->use_template_processing ? t->n_suffix > 0 : t->add_eos;
    tx_bool(&x, root, "add_bos_token", add_bos && t->bos_id >= 0);
    tx_bool(&x, root, "add_eos_token", add_eos && t->eos_id >= 0);
    const char *names[] = {"bos_token", "eos_token", "unk_token", "pad_token"};
    int32_t ids[] = {t->bos_id, t->eos_id, t->unk_id, t->pad_id};
    for (int i = 0; i < 4; i++)
        tx_str(&x, root, names[i], ids[i] >= 0 && ids[i] < t->n_vocab ? t->piece[ids[i]] : NULL);
    if (t->chat_template) tx_str(&x, root, "chat_template", t->chat_template);
    tx_bool(&x, root, "clean_up_tokenization_spaces", 0);
    if (model_max_length > 0) tx_num(&x, root, "model_max_length", model_max_length);
    tx_str(&x, root, "tokenizer_class", "PreTrainedTokenizerFast");
    return tx_finish(&x, root, t->label, out, len);
}
