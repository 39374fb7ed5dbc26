/*
 * tok_load.c -- building a kiln_tokenizer from GGUF metadata (tokenizer.ggml.*) or from a
 * Hugging Face tokenizer.json (+ tokenizer_config.json), and kiln_tokenizer_open.
 */
#include "tok_internal.h"

#include <cjson/cJSON.h>
#include <stdio.h>
#include <string.h>

/* ---- pre-tokenizer regexes ------------------------------------------------------------------ */

/* HF's ByteLevel regex (tokenizers/src/pre_tokenizers/byte_level.rs). */
static const char RE_GPT2[] =
    "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+";
/* Llama 3's tokenizer.json Split pattern. */
static const char RE_LLAMA3[] =
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+"
    "[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";
/* Qwen2's: as Llama 3 but one digit per pre-token. */
static const char RE_QWEN2[] =
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+"
    "[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";
/* GPT-4o (o200k) / Llama 4. */
static const char RE_GPT4O[] =
    "[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]*[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]+"
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)?|[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]+"
    "[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+"
    "[\\r\\n/]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";

const char *tok_regex_by_name(const char *name) {
    if (!strcmp(name, "gpt2")) return RE_GPT2;
    if (!strcmp(name, "llama3")) return RE_LLAMA3;
    if (!strcmp(name, "qwen2")) return RE_QWEN2;
    if (!strcmp(name, "gpt4o")) return RE_GPT4O;
    return NULL;
}

static kiln_status add_split(kiln_tokenizer *t, const char *re, size_t len, int literal,
                             tok_split_behavior b) {
    if (t->n_pre >= TOK_MAX_STEPS)
        return kiln_error(KILN_ERR_UNSUPPORTED, "%s: more than %d pre-tokenizer steps", t->label,
                          TOK_MAX_STEPS);
    tok_pre_step *st = &t->pre_steps[t->n_pre];
    memset(st, 0, sizeof *st);
    st->kind = TOK_PRE_SPLIT;
    st->behavior = b;
    KILN_TRY(tok_compile_regex(re, len, literal, t->label, &st->re));
    t->n_pre++;
    return KILN_OK;
}

static kiln_status add_dec(kiln_tokenizer *t, tok_dec_kind k, const char *a, const char *b,
                           int start, int stop) {
    if (t->n_dec >= TOK_MAX_STEPS)
        return kiln_error(KILN_ERR_UNSUPPORTED, "%s: more than %d decoder steps", t->label,
                          TOK_MAX_STEPS);
    tok_dec_step *d = &t->dec[t->n_dec];
    memset(d, 0, sizeof *d);
    d->kind = k;
    d->start = start;
    d->stop = stop;
    d->a = kiln_strdup(a ? a : "");
    d->b = kiln_strdup(b ? b : "");
    t->n_dec++;
    if (!d->a || !d->b) return kiln_error(KILN_ERR_NOMEM, "%s: out of memory", t->label);
    return KILN_OK;
}

/* ---- GGUF ------------------------------------------------------------------------------------ */

/* tokenizer.ggml.pre -> (kiln's name, regex list); see llama.cpp's llama-vocab.cpp. */
static kiln_status gguf_setup_pre(kiln_tokenizer *t, const char *pre) {
    static const char *const llama3[] = {"llama3", "llama-v3", "llama-bpe", "falcon3", "pixtral", NULL};
    static const char *const qwen2[] = {"qwen2", "deepseek-r1-qwen", "megrez", NULL};
    static const char *const gpt2[] = {"gpt-2", "gpt2", "default", "phi-2", "mpt", "olmo",
                                       "roberta-bpe", "jina-es", "jina-de", "jina-v1-en",
                                       "jina-v2-es", "jina-v2-de", "jina-v2-code", "gigachat", NULL};
    static const char *const smollm[] = {"smollm", "starcoder", "refact", "command-r", NULL};
    static const char *const gpt4o[] = {"gpt-4o", "llama4", NULL};
    struct { const char *const *names; const char *kname; } groups[] = {
        {llama3, "llama3"}, {qwen2, "qwen2"}, {gpt2, "gpt2"}, {smollm, "smollm"}, {gpt4o, "gpt4o"},
    };
    for (size_t g = 0; g < sizeof groups / sizeof groups[0]; g++) {
        for (const char *const *n = groups[g].names; *n; n++) {
            if (strcmp(pre, *n) != 0) continue;
            const char *k = groups[g].kname;
            snprintf(t->pre, sizeof t->pre, "%s", k);
            if (!strcmp(k, "llama3")) {
                t->ignore_merges = 1;
                return add_split(t, RE_LLAMA3, strlen(RE_LLAMA3), 0, TOK_SPLIT_ISOLATED);
            }
            if (!strcmp(k, "qwen2")) return add_split(t, RE_QWEN2, strlen(RE_QWEN2), 0, TOK_SPLIT_ISOLATED);
            if (!strcmp(k, "gpt4o")) return add_split(t, RE_GPT4O, strlen(RE_GPT4O), 0, TOK_SPLIT_ISOLATED);
            if (!strcmp(k, "smollm")) /* tokenizer.json: Digits(individual) then ByteLevel */
                KILN_TRY(add_split(t, "\\p{N}", 5, 0, TOK_SPLIT_ISOLATED));
            return add_split(t, RE_GPT2, strlen(RE_GPT2), 0, TOK_SPLIT_ISOLATED);
        }
    }
    return kiln_error(KILN_ERR_UNSUPPORTED,
                      "%s: tokenizer.ggml.pre: unknown pre-tokenizer '%s' (known: llama-bpe, "
                      "qwen2, gpt-2, default, smollm, starcoder, gpt-4o, ...)", t->label, pre);
}

static kiln_status gguf_get_id(const kiln_gguf *g, const char *key, int32_t *out) {
    int64_t v;
    int found = 0;
    KILN_TRY(kiln_gguf_get_i64(g, key, &v, &found));
    if (found && v >= 0 && v < INT32_MAX) *out = (int32_t)v;
    return KILN_OK;
}

static kiln_status gguf_fill(kiln_tokenizer *t, const kiln_gguf *g, const kiln_gguf_kv *tokens,
                             int spm) {
    const char *L = t->label;
    int64_t n = (int64_t)tokens->arr_len;
    const char **strs = kiln_calloc((size_t)n, sizeof *strs);
    uint32_t *lens = kiln_calloc((size_t)n, sizeof *lens);
    if (!strs || !lens) {
        kiln_free(strs);
        kiln_free(lens);
        return kiln_error(KILN_ERR_NOMEM, "%s: out of memory (tokens)", L);
    }
    kiln_status st = KILN_OK;
    for (int64_t i = 0; i < n; i++) {
        if (tokens->arr_strs[i].len > 65536) {
            st = kiln_error(KILN_ERR_FORMAT, "%s: tokenizer.ggml.tokens[%lld]: length %llu too long",
                            L, (long long)i, (unsigned long long)tokens->arr_strs[i].len);
            break;
        }
        strs[i] = tokens->arr_strs[i].ptr;
        lens[i] = (uint32_t)tokens->arr_strs[i].len;
    }
    if (st == KILN_OK) st = tok_set_pieces(t, strs, lens);
    kiln_free(strs);
    kiln_free(lens);
    KILN_TRY(st);

    const kiln_gguf_kv *types = kiln_gguf_find(g, "tokenizer.ggml.token_type");
    if (types) {
        if (types->type != KILN_GGUF_ARRAY || types->arr_len != (uint64_t)n ||
            (types->arr_type != KILN_GGUF_INT32 && types->arr_type != KILN_GGUF_UINT32))
            return kiln_error(KILN_ERR_FORMAT, "%s: tokenizer.ggml.token_type: want %lld int32",
                              L, (long long)n);
        for (int64_t i = 0; i < n; i++) {
            int32_t ty = kiln_gguf_arr_i32(types, (uint64_t)i);
            /* 1 normal, 2 unknown, 3 control, 4 user defined, 5 unused, 6 byte */
            if (ty == 2 || ty == 3) t->attr[i] |= TOK_ATTR_SPECIAL | TOK_ATTR_ADDED;
            else if (ty == 4) t->attr[i] |= TOK_ATTR_ADDED;
        }
    }
    if (spm) {
        const kiln_gguf_kv *scores = kiln_gguf_find(g, "tokenizer.ggml.scores");
        if (!scores || scores->type != KILN_GGUF_ARRAY || scores->arr_len != (uint64_t)n ||
            scores->arr_type != KILN_GGUF_FLOAT32)
            return kiln_error(KILN_ERR_FORMAT, "%s: tokenizer.ggml.scores: want %lld float32 "
                              "(SentencePiece model)", L, (long long)n);
        t->score = kiln_malloc((size_t)n * sizeof *t->score);
        if (!t->score) return kiln_error(KILN_ERR_NOMEM, "%s: out of memory (scores)", L);
        for (int64_t i = 0; i < n; i++) t->score[i] = kiln_gguf_arr_f32(scores, (uint64_t)i);
    } else {
        const kiln_gguf_kv *merges = kiln_gguf_find(g, "tokenizer.ggml.merges");
        if (!merges || merges->type != KILN_GGUF_ARRAY || merges->arr_type != KILN_GGUF_STRING)
            return kiln_error(KILN_ERR_FORMAT, "%s: tokenizer.ggml.merges: missing or not a "
                              "string array (BPE model)", L);
        KILN_TRY(tok_merges_reserve(t, (size_t)merges->arr_len));
        for (uint64_t i = 0; i < merges->arr_len; i++) {
            const kiln_gguf_str *m = &merges->arr_strs[i];
            /* "a b": split at the first space after the first byte (a may not be empty) */
            const char *sp = m->len > 1 ? memchr(m->ptr + 1, ' ', (size_t)m->len - 1) : NULL;
            if (!sp)
                return kiln_error(KILN_ERR_FORMAT, "%s: tokenizer.ggml.merges[%llu]: no space "
                                  "separator", L, (unsigned long long)i);
            size_t al = (size_t)(sp - m->ptr);
            tok_merge_add(t, m->ptr, al, sp + 1, (size_t)m->len - al - 1, (int32_t)i);
        }
    }
    return KILN_OK;
}

kiln_status kiln_tokenizer_from_gguf(const kiln_gguf *g, kiln_tokenizer **out) {
    if (!g || !out) return kiln_error(KILN_ERR_INVALID_ARG, "kiln_tokenizer_from_gguf: NULL argument");
    const char *L = "gguf";
    kiln_gguf_str model = {0}, pre = {0};
    int found = 0, found_pre = 0;
    KILN_TRY(kiln_gguf_get_str(g, "tokenizer.ggml.model", &model, &found));
    if (!found) return kiln_error(KILN_ERR_FORMAT, "%s: tokenizer.ggml.model: missing", L);
    KILN_TRY(kiln_gguf_get_str(g, "tokenizer.ggml.pre", &pre, &found_pre));
    int spm;
    if (model.len == 4 && !memcmp(model.ptr, "gpt2", 4)) spm = 0;
    else if (model.len == 5 && !memcmp(model.ptr, "llama", 5)) spm = 1;
    else
        return kiln_error(KILN_ERR_UNSUPPORTED, "%s: tokenizer.ggml.model '%.*s' not supported "
                          "(kiln supports 'gpt2' byte-level BPE and 'llama' SentencePiece BPE)",
                          L, (int)(model.len > 64 ? 64 : model.len), model.ptr);
    const kiln_gguf_kv *tokens = kiln_gguf_find(g, "tokenizer.ggml.tokens");
    if (!tokens || tokens->type != KILN_GGUF_ARRAY || tokens->arr_type != KILN_GGUF_STRING ||
        tokens->arr_len == 0 || tokens->arr_len > (1u << 26))
        return kiln_error(KILN_ERR_FORMAT, "%s: tokenizer.ggml.tokens: missing, empty or not a "
                          "string array", L);
    kiln_tokenizer *t;
    KILN_TRY(tok_alloc(&t, (int32_t)tokens->arr_len, L));
    kiln_status st = gguf_fill(t, g, tokens, spm);
    if (st == KILN_OK) {
        st = gguf_get_id(g, "tokenizer.ggml.bos_token_id", &t->bos_id);
        if (st == KILN_OK) st = gguf_get_id(g, "tokenizer.ggml.eos_token_id", &t->eos_id);
        if (st == KILN_OK) st = gguf_get_id(g, "tokenizer.ggml.eot_token_id", &t->eot_id);
        if (st == KILN_OK) st = gguf_get_id(g, "tokenizer.ggml.eom_token_id", &t->eom_id);
        if (st == KILN_OK) st = gguf_get_id(g, "tokenizer.ggml.unknown_token_id", &t->unk_id);
        if (st == KILN_OK) st = gguf_get_id(g, "tokenizer.ggml.padding_token_id", &t->pad_id);
    }
    int add_space_prefix = spm;
    if (st == KILN_OK) {
        /* llama.cpp's defaults: SPM adds BOS; BPE adds BOS for Llama 3 only */
        t->add_bos = spm;
        t->add_eos = 0;
        int v, f = 0;
        if (!spm && found_pre) {
            char pbuf[64];
            snprintf(pbuf, sizeof pbuf, "%.*s", (int)(pre.len > 60 ? 60 : pre.len), pre.ptr);
            st = gguf_setup_pre(t, pbuf);
            if (st == KILN_OK && !strcmp(t->pre, "llama3")) t->add_bos = 1;
        } else if (!spm) {
            st = gguf_setup_pre(t, "default");
        } else {
            snprintf(t->pre, sizeof t->pre, "spm");
        }
        if (st == KILN_OK) st = kiln_gguf_get_bool(g, "tokenizer.ggml.add_bos_token", &v, &f);
        if (st == KILN_OK && f) t->add_bos = v;
        if (st == KILN_OK) st = kiln_gguf_get_bool(g, "tokenizer.ggml.add_eos_token", &v, &f);
        if (st == KILN_OK && f) t->add_eos = v;
        if (st == KILN_OK) st = kiln_gguf_get_bool(g, "tokenizer.ggml.add_space_prefix", &v, &f);
        if (st == KILN_OK && f) add_space_prefix = v;
    }
    if (st == KILN_OK) {
        kiln_gguf_str ct;
        int f = 0;
        st = kiln_gguf_get_str(g, "tokenizer.chat_template", &ct, &f);
        if (st == KILN_OK && f) {
            t->chat_template = kiln_strndup(ct.ptr, (size_t)ct.len);
            if (!t->chat_template) st = kiln_error(KILN_ERR_NOMEM, "%s: out of memory", L);
        }
    }
    if (st == KILN_OK && spm) {
        t->type = "spm";
        t->model_unk_id = t->unk_id;
        t->merge_mode = TOK_MERGE_SCORE;
        t->byte_fallback = 1;
        tok_pre_step *ps = &t->pre_steps[t->n_pre++];
        memset(ps, 0, sizeof *ps);
        ps->kind = TOK_PRE_SPM;
        ps->prepend = add_space_prefix;
        /* HF's Llama decoder: Replace(▁, ' '), ByteFallback, Fuse, Strip(' ', 1, 0) */
        st = add_dec(t, TOK_DEC_REPLACE, "\xe2\x96\x81", " ", 0, 0);
        if (st == KILN_OK) st = add_dec(t, TOK_DEC_BYTEFALLBACK, NULL, NULL, 0, 0);
        if (st == KILN_OK) st = add_dec(t, TOK_DEC_FUSE, NULL, NULL, 0, 0);
        if (st == KILN_OK && add_space_prefix) st = add_dec(t, TOK_DEC_STRIP, " ", NULL, 1, 0);
    } else if (st == KILN_OK) {
        t->type = "bpe";
        t->merge_mode = TOK_MERGE_RANK;
        t->byte_level = 1;
        st = add_dec(t, TOK_DEC_BYTELEVEL, NULL, NULL, 0, 0);
    }
    if (st == KILN_OK) st = tok_finish(t);
    if (st != KILN_OK) {
        kiln_tokenizer_free(t);
        return st;
    }
    *out = t;
    return KILN_OK;
}

/* ---- tokenizer.json ------------------------------------------------------------------------ */

static int jbool(const cJSON *o, const char *k, int def) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, k);
    if (cJSON_IsBool(v)) return cJSON_IsTrue(v);
    return def;
}

static const char *jstr(const cJSON *o, const char *k) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, k);
    return cJSON_IsString(v) ? v->valuestring : NULL;
}

/* A special token given as a string or as {"content": ...} in tokenizer_config.json. */
static const char *jtoken(const cJSON *o, const char *k) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, k);
    if (cJSON_IsString(v)) return v->valuestring;
    if (cJSON_IsObject(v)) return jstr(v, "content");
    return NULL;
}

static kiln_status hf_normalizer(kiln_tokenizer *t, const cJSON *n) {
    if (!n || cJSON_IsNull(n)) return KILN_OK;
    const char *type = jstr(n, "type");
    if (!type) return kiln_error(KILN_ERR_FORMAT, "%s: normalizer: no type", t->label);
    if (!strcmp(type, "Sequence")) {
        const cJSON *e;
        cJSON_ArrayForEach(e, cJSON_GetObjectItemCaseSensitive(n, "normalizers"))
            KILN_TRY(hf_normalizer(t, e));
        return KILN_OK;
    }
    if (t->n_norm >= TOK_MAX_STEPS)
        return kiln_error(KILN_ERR_UNSUPPORTED, "%s: normalizer: too many steps", t->label);
    tok_norm_step *s = &t->norm[t->n_norm];
    memset(s, 0, sizeof *s);
    if (!strcmp(type, "NFC")) s->kind = TOK_NORM_NFC;
    else if (!strcmp(type, "NFD")) s->kind = TOK_NORM_NFD;
    else if (!strcmp(type, "NFKC")) s->kind = TOK_NORM_NFKC;
    else if (!strcmp(type, "NFKD")) s->kind = TOK_NORM_NFKD;
    else if (!strcmp(type, "Lowercase")) s->kind = TOK_NORM_LOWERCASE;
    else if (!strcmp(type, "Prepend")) {
        const char *p = jstr(n, "prepend");
        if (!p) return kiln_error(KILN_ERR_FORMAT, "%s: normalizer Prepend: no 'prepend'", t->label);
        s->kind = TOK_NORM_PREPEND;
        s->a = kiln_strdup(p);
    } else if (!strcmp(type, "Replace")) {
        const char *pat = jstr(cJSON_GetObjectItemCaseSensitive(n, "pattern"), "String");
        const char *c = jstr(n, "content");
        if (!pat || !c)
            return kiln_error(KILN_ERR_UNSUPPORTED, "%s: normalizer Replace: only String patterns "
                              "are supported", t->label);
        s->kind = TOK_NORM_REPLACE;
        s->a = kiln_strdup(pat);
        s->b = kiln_strdup(c);
        if (!s->b) return kiln_error(KILN_ERR_NOMEM, "%s: out of memory", t->label);
    } else {
        return kiln_error(KILN_ERR_UNSUPPORTED, "%s: normalizer type '%s' not supported", t->label, type);
    }
    t->n_norm++;
    if ((s->kind == TOK_NORM_PREPEND || s->kind == TOK_NORM_REPLACE) && !s->a)
        return kiln_error(KILN_ERR_NOMEM, "%s: out of memory", t->label);
    return KILN_OK;
}

static int metaspace_scheme(const cJSON *n) {
    const char *ps = jstr(n, "prepend_scheme");
    if (ps) return !strcmp(ps, "always") ? 2 : !strcmp(ps, "first") ? 1 : 0;
    return jbool(n, "add_prefix_space", 1) ? 2 : 0;
}

static kiln_status hf_pre(kiln_tokenizer *t, const cJSON *n) {
    if (!n || cJSON_IsNull(n)) return KILN_OK;
    const char *type = jstr(n, "type");
    if (!type) return kiln_error(KILN_ERR_FORMAT, "%s: pre_tokenizer: no type", t->label);
    if (!strcmp(type, "Sequence")) {
        const cJSON *e;
        cJSON_ArrayForEach(e, cJSON_GetObjectItemCaseSensitive(n, "pretokenizers"))
            KILN_TRY(hf_pre(t, e));
        return KILN_OK;
    }
    if (!strcmp(type, "ByteLevel")) {
        t->byte_level = 1;
        if (jbool(n, "add_prefix_space", 0)) {
            if (t->n_pre >= TOK_MAX_STEPS)
                return kiln_error(KILN_ERR_UNSUPPORTED, "%s: too many pre-tokenizer steps", t->label);
            memset(&t->pre_steps[t->n_pre], 0, sizeof t->pre_steps[0]);
            t->pre_steps[t->n_pre++].kind = TOK_PRE_PREFIX_SPACE;
        }
        if (jbool(n, "use_regex", 1)) {
            if (!t->pre[0]) snprintf(t->pre, sizeof t->pre, "gpt2");
            return add_split(t, RE_GPT2, strlen(RE_GPT2), 0, TOK_SPLIT_ISOLATED);
        }
        return KILN_OK;
    }
    if (!strcmp(type, "Digits")) {
        if (!t->pre[0]) snprintf(t->pre, sizeof t->pre, "digits");
        if (jbool(n, "individual_digits", 0)) return add_split(t, "\\p{N}", 5, 0, TOK_SPLIT_ISOLATED);
        return add_split(t, "\\p{N}+", 6, 0, TOK_SPLIT_ISOLATED);
    }
    if (!strcmp(type, "Split")) {
        const cJSON *pat = cJSON_GetObjectItemCaseSensitive(n, "pattern");
        const char *re = jstr(pat, "Regex"), *lit = jstr(pat, "String");
        const char *beh = jstr(n, "behavior");
        if ((!re && !lit) || !beh)
            return kiln_error(KILN_ERR_FORMAT, "%s: pre_tokenizer Split: pattern/behavior missing", t->label);
        if (jbool(n, "invert", 0))
            return kiln_error(KILN_ERR_UNSUPPORTED, "%s: pre_tokenizer Split: invert not supported", t->label);
        tok_split_behavior b;
        if (!strcmp(beh, "Isolated")) b = TOK_SPLIT_ISOLATED;
        else if (!strcmp(beh, "Removed")) b = TOK_SPLIT_REMOVED;
        else if (!strcmp(beh, "MergedWithPrevious")) b = TOK_SPLIT_MERGED_PREV;
        else if (!strcmp(beh, "MergedWithNext")) b = TOK_SPLIT_MERGED_NEXT;
        else return kiln_error(KILN_ERR_UNSUPPORTED, "%s: pre_tokenizer Split: behavior '%s' not "
                               "supported", t->label, beh);
        if (re && !t->pre[0]) {
            if (!strcmp(re, RE_LLAMA3)) snprintf(t->pre, sizeof t->pre, "llama3");
            else if (!strcmp(re, RE_QWEN2)) snprintf(t->pre, sizeof t->pre, "qwen2");
            else snprintf(t->pre, sizeof t->pre, "split");
        }
        return add_split(t, re ? re : lit, strlen(re ? re : lit), re == NULL, b);
    }
    if (!strcmp(type, "Metaspace")) {
        const char *rep = jstr(n, "replacement");
        if (rep && strcmp(rep, "\xe2\x96\x81") != 0)
            return kiln_error(KILN_ERR_UNSUPPORTED, "%s: Metaspace replacement other than U+2581",
                              t->label);
        if (t->n_pre >= TOK_MAX_STEPS)
            return kiln_error(KILN_ERR_UNSUPPORTED, "%s: too many pre-tokenizer steps", t->label);
        tok_pre_step *s = &t->pre_steps[t->n_pre++];
        memset(s, 0, sizeof *s);
        s->kind = TOK_PRE_METASPACE;
        s->prepend = metaspace_scheme(n);
        s->split = jbool(n, "split", 1);
        if (!t->pre[0]) snprintf(t->pre, sizeof t->pre, "metaspace");
        return KILN_OK;
    }
    return kiln_error(KILN_ERR_UNSUPPORTED, "%s: pre_tokenizer type '%s' not supported", t->label, type);
}

static kiln_status hf_decoder(kiln_tokenizer *t, const cJSON *n) {
    const char *type = jstr(n, "type");
    if (!type) return kiln_error(KILN_ERR_FORMAT, "%s: decoder: no type", t->label);
    if (!strcmp(type, "Sequence")) {
        const cJSON *e;
        cJSON_ArrayForEach(e, cJSON_GetObjectItemCaseSensitive(n, "decoders"))
            KILN_TRY(hf_decoder(t, e));
        return KILN_OK;
    }
    if (!strcmp(type, "ByteLevel")) return add_dec(t, TOK_DEC_BYTELEVEL, NULL, NULL, 0, 0);
    if (!strcmp(type, "ByteFallback")) return add_dec(t, TOK_DEC_BYTEFALLBACK, NULL, NULL, 0, 0);
    if (!strcmp(type, "Fuse")) return add_dec(t, TOK_DEC_FUSE, NULL, NULL, 0, 0);
    if (!strcmp(type, "Replace")) {
        const char *pat = jstr(cJSON_GetObjectItemCaseSensitive(n, "pattern"), "String");
        const char *c = jstr(n, "content");
        if (!pat || !c)
            return kiln_error(KILN_ERR_UNSUPPORTED, "%s: decoder Replace: only String patterns", t->label);
        return add_dec(t, TOK_DEC_REPLACE, pat, c, 0, 0);
    }
    if (!strcmp(type, "Strip")) {
        const char *c = jstr(n, "content");
        const cJSON *a = cJSON_GetObjectItemCaseSensitive(n, "start");
        const cJSON *b = cJSON_GetObjectItemCaseSensitive(n, "stop");
        return add_dec(t, TOK_DEC_STRIP, c ? c : " ", NULL, cJSON_IsNumber(a) ? a->valueint : 0,
                       cJSON_IsNumber(b) ? b->valueint : 0);
    }
    if (!strcmp(type, "Metaspace")) {
        const char *rep = jstr(n, "replacement");
        return add_dec(t, TOK_DEC_METASPACE, rep ? rep : "\xe2\x96\x81", NULL,
                       metaspace_scheme(n) != 0, 0);
    }
    return kiln_error(KILN_ERR_UNSUPPORTED, "%s: decoder type '%s' not supported", t->label, type);
}

/* TemplateProcessing "single": the special tokens before and after $A. */
static kiln_status hf_post(kiln_tokenizer *t, const cJSON *n) {
    if (!n || cJSON_IsNull(n)) return KILN_OK;
    const char *type = jstr(n, "type");
    if (!type) return KILN_OK;
    if (!strcmp(type, "Sequence")) {
        const cJSON *e;
        cJSON_ArrayForEach(e, cJSON_GetObjectItemCaseSensitive(n, "processors")) KILN_TRY(hf_post(t, e));
        return KILN_OK;
    }
    if (strcmp(type, "TemplateProcessing") != 0) return KILN_OK; /* ByteLevel: offsets only */
    const cJSON *single = cJSON_GetObjectItemCaseSensitive(n, "single");
    const cJSON *sp = cJSON_GetObjectItemCaseSensitive(n, "special_tokens");
    int n_items = cJSON_GetArraySize(single);
    kiln_free(t->prefix_ids);
    kiln_free(t->suffix_ids);
    t->prefix_ids = kiln_calloc((size_t)n_items + 1, sizeof *t->prefix_ids);
    t->suffix_ids = kiln_calloc((size_t)n_items + 1, sizeof *t->suffix_ids);
    if (!t->prefix_ids || !t->suffix_ids) return kiln_error(KILN_ERR_NOMEM, "%s: out of memory", t->label);
    t->n_prefix = t->n_suffix = 0;
    int seen_a = 0;
    const cJSON *item;
    cJSON_ArrayForEach(item, single) {
        if (cJSON_GetObjectItemCaseSensitive(item, "Sequence")) {
            seen_a = 1;
            continue;
        }
        const char *name = jstr(cJSON_GetObjectItemCaseSensitive(item, "SpecialToken"), "id");
        if (!name) continue;
        const cJSON *ids = cJSON_GetObjectItemCaseSensitive(cJSON_GetObjectItemCaseSensitive(sp, name), "ids");
        const cJSON *idv = cJSON_GetArrayItem(ids, 0);
        if (!cJSON_IsNumber(idv) || idv->valueint < 0 || idv->valueint >= t->n_vocab)
            return kiln_error(KILN_ERR_FORMAT, "%s: post_processor: special token '%s' has no valid id",
                              t->label, name);
        if (seen_a) t->suffix_ids[t->n_suffix++] = idv->valueint;
        else t->prefix_ids[t->n_prefix++] = idv->valueint;
    }
    t->use_template_processing = 1;
    return KILN_OK;
}

static kiln_status hf_build(kiln_tokenizer **out, const cJSON *root, const cJSON *cfg,
                            const char *label) {
    const cJSON *model = cJSON_GetObjectItemCaseSensitive(root, "model");
    const char *mtype = jstr(model, "type");
    const cJSON *vocab = cJSON_GetObjectItemCaseSensitive(model, "vocab");
    if (!model || !cJSON_IsObject(vocab))
        return kiln_error(KILN_ERR_FORMAT, "%s: model.vocab: missing or not an object", label);
    if (mtype && strcmp(mtype, "BPE") != 0)
        return kiln_error(KILN_ERR_UNSUPPORTED, "%s: model.type '%s' not supported (BPE only)", label, mtype);
    const char *cont = jstr(model, "continuing_subword_prefix"), *eow = jstr(model, "end_of_word_suffix");
    if ((cont && cont[0]) || (eow && eow[0]))
        return kiln_error(KILN_ERR_UNSUPPORTED, "%s: model: subword prefix/suffix not supported", label);
    const cJSON *added = cJSON_GetObjectItemCaseSensitive(root, "added_tokens");
    /* id space: the largest id of vocab and added tokens */
    int64_t max_id = -1;
    const cJSON *e;
    cJSON_ArrayForEach(e, vocab) {
        if (!cJSON_IsNumber(e) || e->valuedouble < 0 || e->valuedouble >= (1 << 26))
            return kiln_error(KILN_ERR_FORMAT, "%s: model.vocab['%.64s']: bad id", label, e->string);
        if ((int64_t)e->valuedouble > max_id) max_id = (int64_t)e->valuedouble;
    }
    cJSON_ArrayForEach(e, added) {
        const cJSON *id = cJSON_GetObjectItemCaseSensitive(e, "id");
        if (!cJSON_IsNumber(id) || id->valuedouble < 0 || id->valuedouble >= (1 << 26) ||
            !jstr(e, "content"))
            return kiln_error(KILN_ERR_FORMAT, "%s: added_tokens: entry without a valid id/content", label);
        if ((int64_t)id->valuedouble > max_id) max_id = (int64_t)id->valuedouble;
    }
    if (max_id < 0) return kiln_error(KILN_ERR_FORMAT, "%s: model.vocab: empty", label);
    /* The id space is allocated whole (several tables of max_id + 1 entries), so a sparse one
     * is refused: a few holes are normal, a 60M id in a 10-token file is a hostile input that
     * would cost gigabytes for nothing. */
    int64_t n_entries = (int64_t)cJSON_GetArraySize(vocab) + (int64_t)cJSON_GetArraySize(added);
    if (max_id + 1 > 2 * n_entries + 4096)
        return kiln_error(KILN_ERR_FORMAT,
                          "%s: model.vocab: ids too sparse (largest id %lld for %lld tokens)", label,
                          (long long)max_id, (long long)n_entries);
    kiln_tokenizer *t;
    KILN_TRY(tok_alloc(&t, (int32_t)(max_id + 1), label));
    kiln_status st = KILN_OK;
    const char **strs = kiln_calloc((size_t)t->n_vocab, sizeof *strs);
    uint32_t *lens = kiln_calloc((size_t)t->n_vocab, sizeof *lens);
    if (!strs || !lens) st = kiln_error(KILN_ERR_NOMEM, "%s: out of memory", label);
    if (st == KILN_OK) {
        cJSON_ArrayForEach(e, vocab) {
            int id = (int)e->valuedouble;
            strs[id] = e->string;
            lens[id] = (uint32_t)strlen(e->string);
        }
        cJSON_ArrayForEach(e, added) {
            int id = (int)cJSON_GetObjectItemCaseSensitive(e, "id")->valuedouble;
            strs[id] = jstr(e, "content");
            lens[id] = (uint32_t)strlen(strs[id]);
            t->attr[id] |= TOK_ATTR_ADDED;
            if (jbool(e, "special", 0)) t->attr[id] |= TOK_ATTR_SPECIAL;
            if (jbool(e, "lstrip", 0)) t->attr[id] |= TOK_ATTR_LSTRIP;
            if (jbool(e, "rstrip", 0)) t->attr[id] |= TOK_ATTR_RSTRIP;
        }
        st = tok_set_pieces(t, strs, lens);
    }
    kiln_free(strs);
    kiln_free(lens);
    t->merge_mode = TOK_MERGE_RANK;
    t->byte_fallback = jbool(model, "byte_fallback", 0);
    t->ignore_merges = jbool(model, "ignore_merges", 0);
    const char *unk = jstr(model, "unk_token");
    if (st == KILN_OK && unk) t->unk_id = t->model_unk_id = tok_find(t, unk, strlen(unk));
    const cJSON *merges = cJSON_GetObjectItemCaseSensitive(model, "merges");
    if (st == KILN_OK) st = tok_merges_reserve(t, (size_t)cJSON_GetArraySize(merges));
    int32_t rank = 0;
    if (st == KILN_OK) {
        cJSON_ArrayForEach(e, merges) {
            if (cJSON_IsString(e)) {
                const char *s = e->valuestring;
                const char *sp = s[0] ? strchr(s + 1, ' ') : NULL;
                if (!sp) {
                    st = kiln_error(KILN_ERR_FORMAT, "%s: model.merges[%d]: no space separator", label, rank);
                    break;
                }
                tok_merge_add(t, s, (size_t)(sp - s), sp + 1, strlen(sp + 1), rank);
            } else if (cJSON_IsArray(e) && cJSON_GetArraySize(e) == 2 &&
                       cJSON_IsString(cJSON_GetArrayItem(e, 0)) && cJSON_IsString(cJSON_GetArrayItem(e, 1))) {
                const char *a = cJSON_GetArrayItem(e, 0)->valuestring;
                const char *b = cJSON_GetArrayItem(e, 1)->valuestring;
                tok_merge_add(t, a, strlen(a), b, strlen(b), rank);
            } else {
                st = kiln_error(KILN_ERR_FORMAT, "%s: model.merges[%d]: not a string or pair", label, rank);
                break;
            }
            rank++;
        }
    }
    if (st == KILN_OK) st = hf_normalizer(t, cJSON_GetObjectItemCaseSensitive(root, "normalizer"));
    if (st == KILN_OK) st = hf_pre(t, cJSON_GetObjectItemCaseSensitive(root, "pre_tokenizer"));
    const cJSON *dec = cJSON_GetObjectItemCaseSensitive(root, "decoder");
    if (st == KILN_OK) {
        if (!dec || cJSON_IsNull(dec)) t->dec_join_space = 1;
        else st = hf_decoder(t, dec);
    }
    if (st == KILN_OK) st = hf_post(t, cJSON_GetObjectItemCaseSensitive(root, "post_processor"));
    if (st == KILN_OK) {
        int spm_like = t->n_norm > 0 || (t->n_pre > 0 && t->pre_steps[0].kind == TOK_PRE_METASPACE);
        t->type = t->byte_level ? "bpe" : spm_like || t->byte_fallback ? "spm" : "bpe";
        if (!t->pre[0]) snprintf(t->pre, sizeof t->pre, "%s", t->n_norm ? "spm" : "none");
    }
    /* tokenizer_config.json: special tokens, add_bos/add_eos, chat template */
    if (st == KILN_OK && cfg) {
        const char *names[] = {"bos_token", "eos_token", "unk_token", "pad_token"};
        int32_t *dst[] = {&t->bos_id, &t->eos_id, &t->unk_id, &t->pad_id};
        for (int i = 0; i < 4; i++) {
            const char *s = jtoken(cfg, names[i]);
            if (s) {
                int32_t id = tok_find(t, s, strlen(s));
                if (id >= 0) *dst[i] = id;
            }
        }
        const cJSON *ab = cJSON_GetObjectItemCaseSensitive(cfg, "add_bos_token");
        const cJSON *ae = cJSON_GetObjectItemCaseSensitive(cfg, "add_eos_token");
        if (cJSON_IsBool(ab) || cJSON_IsBool(ae)) {
            /* transformers rebuilds the post-processor from these flags */
            int tb = t->use_template_processing ? t->n_prefix > 0 : 0;
            int te = t->use_template_processing ? t->n_suffix > 0 : 0;
            t->add_bos = cJSON_IsBool(ab) ? cJSON_IsTrue(ab) : tb;
            t->add_eos = cJSON_IsBool(ae) ? cJSON_IsTrue(ae) : te;
            t->use_template_processing = 0;
        }
        const cJSON *ct = cJSON_GetObjectItemCaseSensitive(cfg, "chat_template");
        const char *tmpl = cJSON_IsString(ct) ? ct->valuestring : NULL;
        if (cJSON_IsArray(ct)) {
            cJSON_ArrayForEach(e, ct) {
                const char *nm = jstr(e, "name");
                if (nm && !strcmp(nm, "default")) tmpl = jstr(e, "template");
            }
        }
        if (tmpl) {
            t->chat_template = kiln_strdup(tmpl);
            if (!t->chat_template) st = kiln_error(KILN_ERR_NOMEM, "%s: out of memory", label);
        }
    }
    if (st == KILN_OK && t->use_template_processing) {
        /* derive add_bos/add_eos for get_info from the template */
        t->add_bos = t->n_prefix > 0;
        t->add_eos = t->n_suffix > 0;
        if (t->n_prefix > 0 && t->bos_id < 0) t->bos_id = t->prefix_ids[0];
        if (t->n_suffix > 0 && t->eos_id < 0) t->eos_id = t->suffix_ids[0];
    }
    if (st == KILN_OK) st = tok_finish(t);
    if (st != KILN_OK) {
        kiln_tokenizer_free(t);
        return st;
    }
    *out = t;
    return KILN_OK;
}

kiln_status kiln_tokenizer_from_hf_json(const char *tokenizer_json, size_t len,
                                        const char *config_json, size_t config_len,
                                        const char *label, kiln_tokenizer **out) {
    if (!tokenizer_json || !out)
        return kiln_error(KILN_ERR_INVALID_ARG, "kiln_tokenizer_from_hf_json: NULL argument");
    if (!label) label = "tokenizer.json";
    cJSON *root = cJSON_ParseWithLength(tokenizer_json, len);
    if (!root || !cJSON_IsObject(root)) {
        const char *ep = cJSON_GetErrorPtr();
        long off = (ep && ep >= tokenizer_json && ep <= tokenizer_json + len) ? (long)(ep - tokenizer_json) : -1;
        cJSON_Delete(root);
        return kiln_error(KILN_ERR_FORMAT, "%s: invalid JSON near byte %ld", label, off);
    }
    cJSON *cfg = NULL;
    if (config_json) {
        cfg = cJSON_ParseWithLength(config_json, config_len);
        if (!cfg || !cJSON_IsObject(cfg)) {
            cJSON_Delete(cfg);
            cJSON_Delete(root);
            return kiln_error(KILN_ERR_FORMAT, "%s: tokenizer_config.json: invalid JSON", label);
        }
    }
    kiln_status st = hf_build(out, root, cfg, label);
    cJSON_Delete(cfg);
    cJSON_Delete(root);
    return st;
}

static kiln_status path_join(char *buf, size_t cap, const char *dir, const char *name) {
    int n = snprintf(buf, cap, "%s/%s", dir, name);
    if (n < 0 || (size_t)n >= cap)
        return kiln_error(KILN_ERR_INVALID_ARG, "%s: path too long", dir);
    return KILN_OK;
}

/* tokenizer.json at json_path; config and chat_template.jinja from dir when present. */
static kiln_status load_hf_files(const char *json_path, const char *dir, kiln_tokenizer **out) {
    char cpath[4096];
    char *json = NULL, *cfg = NULL, *jinja = NULL;
    size_t jlen = 0, clen = 0, jjlen = 0;
    KILN_TRY(kiln_read_text_file(json_path, (size_t)1 << 30, &json, &jlen));
    kiln_status st = path_join(cpath, sizeof cpath, dir, "tokenizer_config.json");
    if (st == KILN_OK && kiln_path_is_file(cpath))
        st = kiln_read_text_file(cpath, (size_t)64 << 20, &cfg, &clen);
    if (st == KILN_OK) st = kiln_tokenizer_from_hf_json(json, jlen, cfg, clen, json_path, out);
    if (st == KILN_OK && !(*out)->chat_template &&
        path_join(cpath, sizeof cpath, dir, "chat_template.jinja") == KILN_OK && kiln_path_is_file(cpath)) {
        st = kiln_read_text_file(cpath, (size_t)16 << 20, &jinja, &jjlen);
        if (st == KILN_OK) {
            (*out)->chat_template = jinja;
            jinja = NULL;
            (*out)->chat_template_name = tok_detect_chat_template((*out)->chat_template);
        } else {
            kiln_tokenizer_free(*out);
            *out = NULL;
        }
    }
    kiln_free(json);
    kiln_free(cfg);
    kiln_free(jinja);
    return st;
}

kiln_status kiln_tokenizer_from_hf_dir(const char *dir, kiln_tokenizer **out) {
    if (!dir || !out) return kiln_error(KILN_ERR_INVALID_ARG, "kiln_tokenizer_from_hf_dir: NULL argument");
    char path[4096];
    KILN_TRY(path_join(path, sizeof path, dir, "tokenizer.json"));
    if (!kiln_path_is_file(path))
        return kiln_error(KILN_ERR_IO, "%s: no tokenizer.json (kiln reads HF fast-tokenizer files)", dir);
    return load_hf_files(path, dir, out);
}

/* ---- public open/close/info ----------------------------------------------------------------- */

KILN_API kiln_status kiln_tokenizer_open(const char *path, kiln_tokenizer **out) {
    if (!path || !out) return kiln_error(KILN_ERR_INVALID_ARG, "kiln_tokenizer_open: NULL argument");
    if (kiln_path_is_dir(path)) return kiln_tokenizer_from_hf_dir(path, out);
    if (!kiln_path_is_file(path)) return kiln_error(KILN_ERR_IO, "%s: no such file or folder", path);
    size_t n = strlen(path);
    int is_gguf = n >= 5 && !strcmp(path + n - 5, ".gguf");
    if (!is_gguf) {
        kiln_file_map m;
        KILN_TRY(kiln_file_map_open(path, 1, &m));
        is_gguf = m.size >= 4 && !memcmp(m.data, "GGUF", 4);
        kiln_file_map_close(&m);
    }
    if (is_gguf) {
        kiln_gguf *g;
        KILN_TRY(kiln_gguf_open(path, 1, &g));
        kiln_status st = kiln_tokenizer_from_gguf(g, out);
        if (st == KILN_OK) {
            kiln_free((*out)->label);
            (*out)->label = kiln_strdup(path);
        } else {
            kiln_error_prefix(st, "%s", path);
        }
        kiln_gguf_close(g);
        return st;
    }
    /* a tokenizer.json path: its folder may hold tokenizer_config.json */
    char dir[4096];
    const char *slash = strrchr(path, '/');
    if (slash) snprintf(dir, sizeof dir, "%.*s", (int)(slash - path), path);
    else snprintf(dir, sizeof dir, ".");
    return load_hf_files(path, dir, out);
}

KILN_API void kiln_tokenizer_close(kiln_tokenizer *t) { kiln_tokenizer_free(t); }

KILN_API kiln_status kiln_tokenizer_get_info(const kiln_tokenizer *t, kiln_tokenizer_info *out) {
    if (!t || !out) return kiln_error(KILN_ERR_INVALID_ARG, "kiln_tokenizer_get_info: NULL argument");
    memset(out, 0, sizeof *out);
    out->type = t->type;
    out->pre = t->pre;
    out->n_vocab = t->n_vocab;
    out->bos_id = t->bos_id;
    out->eos_id = t->eos_id;
    out->eot_id = t->eot_id;
    out->pad_id = t->pad_id;
    out->unk_id = t->unk_id;
    out->add_bos = t->add_bos;
    out->add_eos = t->add_eos;
    out->chat_template_name = t->chat_template_name;
    out->chat_template = t->chat_template;
    return KILN_OK;
}
