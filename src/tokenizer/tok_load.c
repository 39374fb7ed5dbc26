/*
 * tok_load.c -- building a kiln_tokenizer from GGUF metadata (tokenizer.ggml.*) or from a
 * Hugging Face tokenizer.json (+ tokenizer_config.json), and kiln_tokenizer_open.
 */
#include "tok_internal.h"

#include <cjson/cJSON.h>
#include <math.h>
#include <stdio.h>
#include <string.h>
#include <utf8proc.h>

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
    st->literal = literal;
    st->pattern = kiln_strndup(re, len);
    if (!st->pattern) return kiln_error(KILN_ERR_NOMEM, "%s: out of memory", t->label);
    kiln_status cst = tok_compile_regex(re, len, literal, t->label, &st->re);
    if (cst != KILN_OK) {
        kiln_free(st->pattern);
        st->pattern = NULL;
        return cst;
    }
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

/* Python's str.isspace() code points (bidi class WS, B or S, or category Zs). */
static int py_isspace(utf8proc_int32_t c) {
    return (c >= 0x09 && c <= 0x0d) || (c >= 0x1c && c <= 0x20) || c == 0x85 || c == 0xa0 ||
           c == 0x1680 || (c >= 0x2000 && c <= 0x200a) || c == 0x2028 || c == 0x2029 ||
           c == 0x202f || c == 0x205f || c == 0x3000;
}

/* Gemma's GGUF files store the whitespace-run tokens ("  ", "   ", ...) with real spaces, as
 * user-defined tokens, where Gemma's tokenizer.json has them as ordinary pieces spelled with ▁.
 * transformers (integrations/gguf/gguf_tokenizer_mapping.py, gemma_tokenizer) respells every
 * token that holds a ' ' and nothing but whitespace as one ▁ per code point and merges them like
 * any other piece; so does kiln. Returns the number of code points when s[0..n) is such a token
 * (valid UTF-8, all Python whitespace, at least one ' '), else 0. */
static size_t gemma_space_run(const char *s, size_t n) {
    size_t i = 0, cps = 0;
    int space = 0;
    while (i < n) {
        utf8proc_int32_t c;
        utf8proc_ssize_t k = utf8proc_iterate((const utf8proc_uint8_t *)s + i,
                                              (utf8proc_ssize_t)(n - i), &c);
        if (k <= 0 || !py_isspace(c)) return 0;
        space |= c == ' ';
        i += (size_t)k;
        cps++;
    }
    return space ? cps : 0;
}

/* gemma: the vocabulary of a Gemma GGUF (general.architecture gemma, gemma2, gemma3), built as
 * transformers builds it from the file: whitespace runs respelled (gemma_space_run) and merge
 * priority by position in the file (see kiln_tokenizer_from_gguf). */
static kiln_status gguf_fill(kiln_tokenizer *t, const kiln_gguf *g, const kiln_gguf_kv *tokens,
                             int spm, int gemma) {
    const char *L = t->label;
    int64_t n = (int64_t)tokens->arr_len;
    const char **strs = kiln_calloc((size_t)n, sizeof *strs);
    uint32_t *lens = kiln_calloc((size_t)n, sizeof *lens);
    char *spelled = NULL; /* the respelled strings, back to back */
    if (!strs || !lens) {
        kiln_free(strs);
        kiln_free(lens);
        return kiln_error(KILN_ERR_NOMEM, "%s: out of memory (tokens)", L);
    }
    kiln_status st = KILN_OK;
    size_t spelled_len = 0;
    for (int64_t i = 0; i < n; i++) {
        if (tokens->arr_strs[i].len > 65536) {
            st = kiln_error(KILN_ERR_FORMAT, "%s: tokenizer.ggml.tokens[%lld]: length %llu too long",
                            L, (long long)i, (unsigned long long)tokens->arr_strs[i].len);
            break;
        }
        strs[i] = tokens->arr_strs[i].ptr;
        lens[i] = (uint32_t)tokens->arr_strs[i].len;
        /* 3 bytes per code point of a token of at most 65536 bytes: no overflow */
        if (gemma) spelled_len += 3 * gemma_space_run(strs[i], lens[i]);
    }
    if (st == KILN_OK && spelled_len) {
        spelled = kiln_malloc(spelled_len);
        if (!spelled) st = kiln_error(KILN_ERR_NOMEM, "%s: out of memory (tokens)", L);
        size_t off = 0;
        for (int64_t i = 0; st == KILN_OK && i < n; i++) {
            size_t cps = gemma_space_run(strs[i], lens[i]);
            if (!cps) continue;
            for (size_t k = 0; k < cps; k++) memcpy(spelled + off + 3 * k, "\xe2\x96\x81", 3);
            strs[i] = spelled + off;
            lens[i] = (uint32_t)(3 * cps);
            off += 3 * cps;
        }
    }
    if (st == KILN_OK) st = tok_set_pieces(t, strs, lens, NULL, NULL, NULL, 0);
    kiln_free(strs);
    kiln_free(lens);
    kiln_free(spelled);
    KILN_TRY(st);

    const kiln_gguf_kv *types = kiln_gguf_find(g, "tokenizer.ggml.token_type");
    if (types) {
        if (types->type != KILN_GGUF_ARRAY || types->arr_len != (uint64_t)n ||
            (types->arr_type != KILN_GGUF_INT32 && types->arr_type != KILN_GGUF_UINT32))
            return kiln_error(KILN_ERR_FORMAT, "%s: tokenizer.ggml.token_type: want %lld int32",
                              L, (long long)n);
        for (int64_t i = 0; i < n; i++) {
            int32_t ty = kiln_gguf_arr_i32(types, (uint64_t)i);
            /* 1 normal, 2 unknown, 3 control, 4 user defined, 5 unused, 6 byte; a respelled
             * Gemma whitespace run is an ordinary piece whatever its type says */
            if (gemma && gemma_space_run(tokens->arr_strs[i].ptr, (size_t)tokens->arr_strs[i].len))
                continue;
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
        /* Gemma's file gives its whitespace runs (and every user-defined piece) the score
         * -1000, out of line with the order the pieces were learned in; transformers orders
         * the merges by the merged piece's position in the file instead */
        t->merge_by_id = gemma;
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
            /* a merge naming absent tokens is skipped (kept as before; llama.cpp keeps it) */
            if (tok_merge_add(t, m->ptr, al, sp + 1, (size_t)m->len - al - 1, (int32_t)i, 0) < 0)
                return kiln_error(KILN_ERR_NOMEM, "%s: out of memory (merges)", L);
        }
    }
    return KILN_OK;
}

/* general.architecture of the Gemma text models whose vocabulary transformers builds with
 * its Gemma rules (gemma, gemma2, gemma3). */
static int gguf_str_is_gemma(kiln_gguf_str a) {
    static const char *const names[] = {"gemma", "gemma2", "gemma3"};
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++)
        if (a.len == strlen(names[i]) && !memcmp(a.ptr, names[i], a.len)) return 1;
    return 0;
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
    /* Gemma's SentencePiece vocabularies are read as transformers reads them (gguf_fill) */
    kiln_gguf_str arch = {0};
    int found_arch = 0;
    KILN_TRY(kiln_gguf_get_str(g, "general.architecture", &arch, &found_arch));
    int gemma = spm && found_arch && gguf_str_is_gemma(arch);
    kiln_tokenizer *t;
    KILN_TRY(tok_alloc(&t, (int32_t)tokens->arr_len, L));
    kiln_status st = gguf_fill(t, g, tokens, spm, gemma);
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
    if (st == KILN_OK && gemma && !t->chat_template) {
        /* this file carries no template (e.g. Gemma 3 270M's GGUF): the family's */
        t->chat_template_name = "gemma";
        t->chat_gemma_system = arch.len == 6 && !memcmp(arch.ptr, "gemma3", 6);
    }
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

/* ---- tokenizer.json: what `tokenizers` refuses ------------------------------------------- */

/* Boolean fields of the pipeline's steps: serde_json refuses any other type (null included). */
static const char *const HF_STEP_BOOLS[] = {
    "add_prefix_space", "trim_offsets", "use_regex", "individual_digits", "invert", "split", NULL,
};

/* Walk a normalizer / pre_tokenizer / decoder subtree: a known boolean field that is not a
 * boolean is refused (as `tokenizers` does), and so is a string holding an escaped NUL: kiln
 * keeps these strings as C strings (`tokenizers` accepts the NUL; kiln says so rather than
 * cut the string). path: the subtree's JSON path, for the message. */
static kiln_status hf_check_steps(const char *label, const cJSON *n, const char *path, int depth) {
    if (!n || depth > 32) return KILN_OK;
    if (cJSON_IsString(n) && tok_json_has_nul(n->valuestring))
        return kiln_error(KILN_ERR_UNSUPPORTED, "%s: %s: string holds a NUL byte (\\u0000); kiln "
                          "keeps pipeline strings as C strings and does not support it", label, path);
    if (!cJSON_IsObject(n) && !cJSON_IsArray(n)) return KILN_OK;
    const cJSON *e;
    int i = 0;
    cJSON_ArrayForEach(e, n) {
        char sub[256];
        if (cJSON_IsObject(n)) {
            snprintf(sub, sizeof sub, "%.200s.%.40s", path, e->string);
            for (const char *const *k = HF_STEP_BOOLS; *k; k++)
                if (!strcmp(e->string, *k) && !cJSON_IsBool(e))
                    return kiln_error(KILN_ERR_FORMAT, "%s: %s: not a boolean", label, sub);
        } else {
            snprintf(sub, sizeof sub, "%.200s[%d]", path, i);
        }
        KILN_TRY(hf_check_steps(label, e, sub, depth + 1));
        i++;
    }
    return KILN_OK;
}

/* obj[k] must be a boolean when present (null too, with null_ok). */
static kiln_status hf_check_bool(const char *label, const cJSON *obj, const char *k, int null_ok,
                                 const char *fmt_path, int index) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(obj, k);
    if (!v || cJSON_IsBool(v) || (null_ok && cJSON_IsNull(v))) return KILN_OK;
    char path[64];
    snprintf(path, sizeof path, fmt_path, index);
    return kiln_error(KILN_ERR_FORMAT, "%s: %s.%s: not a boolean", label, path, k);
}

/* A small string -> id map for the added tokens' contents (tokenizers gives a repeated
 * content the first one's id). Open addressing, FNV-1a. */
typedef struct hf_strmap {
    const char **s;
    size_t *len;
    int32_t *id;
    size_t mask;
} hf_strmap;

static size_t hf_strmap_slot(const hf_strmap *m, const char *s, size_t len) {
    uint64_t h = 1469598103934665603ull;
    for (size_t i = 0; i < len; i++) h = (h ^ (uint8_t)s[i]) * 1099511628211ull;
    size_t i = (size_t)h & m->mask;
    while (m->s[i] && !(m->len[i] == len && !memcmp(m->s[i], s, len))) i = (i + 1) & m->mask;
    return i;
}

/* What one tokenizer.json string becomes: bytes and length (escaped NULs decoded). */
typedef struct hf_piece {
    const char *s;
    uint32_t len;
} hf_piece;

static kiln_status hf_piece_of(const char *label, char *s, const char *what, hf_piece *out) {
    size_t n = tok_json_nul_decode(s);
    out->s = s; /* set on every path: callers read it only after KILN_OK */
    out->len = 0;
    if (n > 65536)
        return kiln_error(KILN_ERR_FORMAT, "%s: %s: token of %zu bytes too long", label, what, n);
    out->s = s;
    out->len = (uint32_t)n;
    return KILN_OK;
}

/* model.vocab and added_tokens -> the id table, as `tokenizers` builds it:
 *   - a vocab id must be an integer in 0..2^32-1 (tok_json_prepare checked the literal);
 *   - two vocab strings may share an id: both encode to it (the later one in the file is the
 *     piece that decodes, the others are aliases);
 *   - an added token's id in the file is not used: `tokenizers` gives it the id of the same
 *     content among earlier added tokens, else its model.vocab id, else the next free one
 *     (AddedVocabulary::add_tokens: the vocab size when no added token lies at or past it,
 *     else the largest added id + 1). For a file `tokenizers` wrote, that is the file's id.
 *     An added token landing on an id model.vocab also uses takes the piece; the vocab
 *     string stays an alias. */
/* tok_set_pieces with the aliases (strings sharing an id with another) given as hf_pieces. */
static kiln_status hf_set_pieces(kiln_tokenizer *t, const char *const *strs, const uint32_t *lens,
                                 const hf_piece *alias, const int32_t *alias_id, int32_t n_alias,
                                 const char *label) {
    const char **as = kiln_calloc((size_t)n_alias + 1, sizeof *as);
    uint32_t *al = kiln_calloc((size_t)n_alias + 1, sizeof *al);
    kiln_status st = (!as || !al) ? kiln_error(KILN_ERR_NOMEM, "%s: out of memory (vocabulary)", label) : KILN_OK;
    for (int32_t k = 0; st == KILN_OK && k < n_alias; k++) {
        as[k] = alias[k].s;
        al[k] = alias[k].len;
    }
    if (st == KILN_OK) st = tok_set_pieces(t, strs, lens, as, al, alias_id, n_alias);
    kiln_free(as);
    kiln_free(al);
    return st;
}

static kiln_status hf_vocab(const char *label, const cJSON *vocab, const cJSON *added,
                            kiln_tokenizer **out) {
    const cJSON *e;
    int64_t n_keys = cJSON_GetArraySize(vocab), n_added = cJSON_GetArraySize(added);
    int64_t max_id = -1;
    cJSON_ArrayForEach(e, vocab) {
        double v = cJSON_IsNumber(e) ? e->valuedouble : -1;
        if (v < 0 || v != floor(v) || v > 4294967295.0)
            return kiln_error(KILN_ERR_FORMAT, "%s: model.vocab[\"%.64s\"]: id is not an integer "
                              "in 0..4294967295", label, e->string);
        if (v >= (1 << 26))
            return kiln_error(KILN_ERR_FORMAT, "%s: model.vocab[\"%.64s\"]: id %.0f past kiln's "
                              "limit of 2^26 tokens", label, e->string, v);
        if ((int64_t)v > max_id) max_id = (int64_t)v;
    }
    int i = 0;
    cJSON_ArrayForEach(e, added) {
        const cJSON *id = cJSON_GetObjectItemCaseSensitive(e, "id");
        double v = cJSON_IsNumber(id) ? id->valuedouble : -1;
        if (v < 0 || v != floor(v) || v > 4294967295.0)
            return kiln_error(KILN_ERR_FORMAT, "%s: added_tokens[%d].id: not an integer in "
                              "0..4294967295", label, i);
        if (!cJSON_IsString(cJSON_GetObjectItemCaseSensitive(e, "content")))
            return kiln_error(KILN_ERR_FORMAT, "%s: added_tokens[%d].content: not a string", label, i);
        static const char *const bools[] = {"special", "lstrip", "rstrip", "single_word", "normalized"};
        for (size_t k = 0; k < sizeof bools / sizeof bools[0]; k++)
            KILN_TRY(hf_check_bool(label, e, bools[k], 0, "added_tokens[%d]", i));
        i++;
    }
    /* The id space is allocated whole (several tables of max_id + 1 entries), so a sparse one
     * is refused: a few holes are normal, a 60M id in a 10-token file is a hostile input that
     * would cost gigabytes for nothing. Added tokens land at most n_added past the vocab. */
    if (max_id + 1 > 2 * (n_keys + n_added) + 4096)
        return kiln_error(KILN_ERR_FORMAT,
                          "%s: model.vocab: ids too sparse (largest id %lld for %lld tokens)", label,
                          (long long)max_id, (long long)(n_keys + n_added));

    /* model.vocab alone first, to look the added tokens' contents up in it */
    kiln_status st = KILN_OK;
    size_t n_ids = (size_t)(max_id + 1) + (size_t)n_added + 1;
    hf_piece *piece = kiln_calloc(n_ids, sizeof *piece);
    hf_piece *alias = kiln_calloc((size_t)n_keys + (size_t)n_added + 1, sizeof *alias);
    int32_t *alias_id = kiln_calloc((size_t)n_keys + (size_t)n_added + 1, sizeof *alias_id);
    int32_t *added_id = kiln_calloc((size_t)n_added + 1, sizeof *added_id);
    uint32_t *added_len = kiln_calloc((size_t)n_added + 1, sizeof *added_len);
    uint8_t *added_new = kiln_calloc((size_t)n_added + 1, 1);
    hf_strmap am = {0};
    size_t cap = 16;
    while (cap < (size_t)n_added * 2 + 16) cap <<= 1;
    am.s = kiln_calloc(cap, sizeof *am.s);
    am.len = kiln_calloc(cap, sizeof *am.len);
    am.id = kiln_calloc(cap, sizeof *am.id);
    am.mask = cap - 1;
    kiln_tokenizer *v0 = NULL, *t = NULL;
    int32_t n_alias = 0;
    if (!piece || !alias || !alias_id || !added_id || !added_len || !added_new || !am.s || !am.len || !am.id)
        st = kiln_error(KILN_ERR_NOMEM, "%s: out of memory (vocabulary)", label);
    if (st == KILN_OK) {
        cJSON_ArrayForEach(e, vocab) {
            int32_t id = (int32_t)e->valuedouble;
            if (piece[id].s) {
                alias[n_alias] = piece[id];
                alias_id[n_alias++] = id;
            }
            st = hf_piece_of(label, e->string, "model.vocab", &piece[id]);
            if (st != KILN_OK) break;
        }
    }
    const char **strs = NULL;
    uint32_t *lens = NULL;
    if (st == KILN_OK) {
        strs = kiln_calloc(n_ids, sizeof *strs);
        lens = kiln_calloc(n_ids, sizeof *lens);
        if (!strs || !lens) st = kiln_error(KILN_ERR_NOMEM, "%s: out of memory (vocabulary)", label);
    }
    for (size_t k = 0; st == KILN_OK && k < (size_t)(max_id + 1); k++) {
        strs[k] = piece[k].s;
        lens[k] = piece[k].len;
    }
    if (st == KILN_OK) st = tok_alloc(&v0, (int32_t)(max_id + 1), label);
    if (st == KILN_OK) {
        st = hf_set_pieces(v0, strs, lens, alias, alias_id, n_alias, label);
    }
    /* added tokens: tokenizers' id assignment */
    int64_t n_model = n_keys, max_added = -1, n_total = max_id + 1;
    i = 0;
    if (st == KILN_OK) {
        cJSON_ArrayForEach(e, added) {
            hf_piece c;
            st = hf_piece_of(label, cJSON_GetObjectItemCaseSensitive(e, "content")->valuestring,
                             "added_tokens.content", &c);
            if (st != KILN_OK) break;
            size_t slot = hf_strmap_slot(&am, c.s, c.len);
            int32_t id;
            if (am.s[slot]) {
                id = am.id[slot];
                added_new[i] = 2; /* a repeat: the first one's attributes stand */
            } else if ((id = tok_find(v0, c.s, c.len)) >= 0) {
                added_new[i] = 0;
            } else {
                id = (int32_t)(max_added < 0 ? n_model
                               : (max_added >= n_model || n_model == 0) ? max_added + 1 : n_model);
                added_new[i] = 1;
            }
            if (!am.s[slot]) {
                am.s[slot] = c.s;
                am.len[slot] = c.len;
                am.id[slot] = id;
            }
            if (id > max_added) max_added = id;
            if (id + 1 > n_total) n_total = id + 1;
            added_len[i] = c.len;
            added_id[i++] = id;
        }
    }
    /* new ids start at the count of vocab strings, which shared ids can put past max_id */
    if (st == KILN_OK && (size_t)n_total > n_ids) {
        const char **s2 = kiln_calloc((size_t)n_total, sizeof *s2);
        uint32_t *l2 = kiln_calloc((size_t)n_total, sizeof *l2);
        if (!s2 || !l2) {
            kiln_free(s2);
            kiln_free(l2);
            st = kiln_error(KILN_ERR_NOMEM, "%s: out of memory (vocabulary)", label);
        } else {
            memcpy(s2, strs, n_ids * sizeof *s2);
            memcpy(l2, lens, n_ids * sizeof *l2);
            kiln_free(strs);
            kiln_free(lens);
            strs = s2;
            lens = l2;
        }
    }
    if (st == KILN_OK) st = tok_alloc(&t, (int32_t)n_total, label);
    i = 0;
    if (st == KILN_OK) {
        cJSON_ArrayForEach(e, added) {
            int32_t id = added_id[i];
            if (added_new[i] == 1) {
                const char *c = cJSON_GetObjectItemCaseSensitive(e, "content")->valuestring;
                if ((size_t)id <= (size_t)max_id && strs[id]) { /* the vocab string stays an alias */
                    alias[n_alias].s = strs[id];
                    alias[n_alias].len = lens[id];
                    alias_id[n_alias++] = id;
                }
                strs[id] = c;
                lens[id] = added_len[i]; /* the content was decoded in place above */
                t->attr[id] |= TOK_ATTR_NOT_MODEL;
            }
            if (added_new[i] != 2) {
                t->attr[id] |= TOK_ATTR_ADDED;
                if (jbool(e, "special", 0)) t->attr[id] |= TOK_ATTR_SPECIAL;
                if (jbool(e, "lstrip", 0)) t->attr[id] |= TOK_ATTR_LSTRIP;
                if (jbool(e, "rstrip", 0)) t->attr[id] |= TOK_ATTR_RSTRIP;
            }
            i++;
        }
        st = hf_set_pieces(t, strs, lens, alias, alias_id, n_alias, label);
    }
    kiln_tokenizer_free(v0);
    kiln_free(piece);
    kiln_free(alias);
    kiln_free(alias_id);
    kiln_free(added_id);
    kiln_free(added_len);
    kiln_free(added_new);
    kiln_free(am.s);
    kiln_free(am.len);
    kiln_free(am.id);
    kiln_free(strs);
    kiln_free(lens);
    if (st != KILN_OK) {
        kiln_tokenizer_free(t);
        return st;
    }
    *out = t;
    return KILN_OK;
}

/* model.merges: "a b" strings (exactly one space: `tokenizers` splits on ' ' and wants two
 * parts) or [a, b] pairs, not both in one list; a, b and a+b must all be model.vocab strings. */
static kiln_status hf_merges(kiln_tokenizer *t, const cJSON *merges, const char *label) {
    if (!cJSON_IsArray(merges))
        return kiln_error(KILN_ERR_FORMAT, "%s: model.merges: missing or not a list", label);
    KILN_TRY(tok_merges_reserve(t, (size_t)cJSON_GetArraySize(merges)));
    int32_t rank = 0;
    const cJSON *e;
    int strings = cJSON_IsString(cJSON_GetArrayItem(merges, 0));
    cJSON_ArrayForEach(e, merges) {
        hf_piece a, b;
        if (cJSON_IsString(e) != strings)
            return kiln_error(KILN_ERR_FORMAT, "%s: model.merges[%d]: \"a b\" strings and [a, b] "
                              "lists mixed in one list", label, rank);
        if (cJSON_IsString(e)) {
            hf_piece m;
            KILN_TRY(hf_piece_of(label, e->valuestring, "model.merges", &m));
            const char *sp = memchr(m.s, ' ', m.len);
            if (!sp || memchr(sp + 1, ' ', m.len - (size_t)(sp - m.s) - 1))
                return kiln_error(KILN_ERR_FORMAT, "%s: model.merges[%d]: \"%.64s\" is not two tokens "
                                  "separated by one space", label, rank, m.s);
            a.s = m.s;
            a.len = (uint32_t)(sp - m.s);
            b.s = sp + 1;
            b.len = m.len - a.len - 1;
        } else if (cJSON_IsArray(e) && cJSON_GetArraySize(e) == 2 &&
                   cJSON_IsString(cJSON_GetArrayItem(e, 0)) && cJSON_IsString(cJSON_GetArrayItem(e, 1))) {
            KILN_TRY(hf_piece_of(label, cJSON_GetArrayItem(e, 0)->valuestring, "model.merges", &a));
            KILN_TRY(hf_piece_of(label, cJSON_GetArrayItem(e, 1)->valuestring, "model.merges", &b));
        } else {
            return kiln_error(KILN_ERR_FORMAT, "%s: model.merges[%d]: not a \"a b\" string or a "
                              "list of two strings", label, rank);
        }
        int r = tok_merge_add(t, a.s, a.len, b.s, b.len, rank, 1);
        if (r < 0) return kiln_error(KILN_ERR_NOMEM, "%s: out of memory (merges)", label);
        if (r > 0) {
            char ab[160];
            snprintf(ab, sizeof ab, "%.*s%.*s", (int)(a.len > 64 ? 64 : a.len), a.s,
                     (int)(b.len > 64 ? 64 : b.len), b.s);
            const hf_piece *p = r == 1 ? &a : &b;
            return kiln_error(KILN_ERR_FORMAT, "%s: model.merges[%d]: token \"%.*s\" is not in "
                              "model.vocab", label, rank, r == 3 ? (int)strlen(ab)
                              : (int)(p->len > 64 ? 64 : p->len), r == 3 ? ab : p->s);
        }
        rank++;
    }
    return KILN_OK;
}

/* tokenizer_config.json: the special tokens (string or {content}), add_bos_token /
 * add_eos_token (booleans; true needs the token in the vocabulary: transformers refuses
 * add_bos_token without a bos_token), the chat template. */
static kiln_status hf_config(kiln_tokenizer *t, const cJSON *cfg, const char *label) {
    const char *names[] = {"bos_token", "eos_token", "unk_token", "pad_token"};
    int32_t *dst[] = {&t->bos_id, &t->eos_id, &t->unk_id, &t->pad_id};
    const char *given[4] = {NULL, NULL, NULL, NULL};
    for (int i = 0; i < 4; i++) {
        char *s = (char *)jtoken(cfg, names[i]);
        if (!s) continue;
        given[i] = s;
        hf_piece p;
        KILN_TRY(hf_piece_of(label, s, names[i], &p));
        int32_t id = tok_find(t, p.s, p.len);
        if (id >= 0) *dst[i] = id;
    }
    const char *flags[] = {"add_bos_token", "add_eos_token"};
    const cJSON *fv[2];
    for (int i = 0; i < 2; i++) {
        fv[i] = cJSON_GetObjectItemCaseSensitive(cfg, flags[i]);
        if (fv[i] && !cJSON_IsBool(fv[i]) && !cJSON_IsNull(fv[i]))
            return kiln_error(KILN_ERR_FORMAT, "%s: tokenizer_config.json: %s: not a boolean", label,
                              flags[i]);
        if (cJSON_IsTrue(fv[i]) && *dst[i] < 0) {
            if (given[i])
                return kiln_error(KILN_ERR_FORMAT, "%s: tokenizer_config.json: %s is true but "
                                  "%s \"%.64s\" is not in the vocabulary", label, flags[i],
                                  names[i], given[i]);
            return kiln_error(KILN_ERR_FORMAT, "%s: tokenizer_config.json: %s is true but there is "
                              "no %s", label, flags[i], names[i]);
        }
    }
    const cJSON *ab = fv[0], *ae = fv[1];
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
        const cJSON *e;
        cJSON_ArrayForEach(e, ct) {
            const char *nm = jstr(e, "name");
            if (nm && !strcmp(nm, "default")) tmpl = jstr(e, "template");
        }
    }
    if (tmpl && tok_json_has_nul(tmpl))
        return kiln_error(KILN_ERR_UNSUPPORTED, "%s: tokenizer_config.json: chat_template: holds a "
                          "NUL byte (\\u0000)", label);
    if (tmpl) {
        t->chat_template = kiln_strdup(tmpl);
        if (!t->chat_template) return kiln_error(KILN_ERR_NOMEM, "%s: out of memory", label);
    }
    return KILN_OK;
}

static kiln_status hf_build(kiln_tokenizer **out, const cJSON *root, const cJSON *cfg,
                            const char *label) {
    const cJSON *model = cJSON_GetObjectItemCaseSensitive(root, "model");
    const cJSON *mtype_v = cJSON_GetObjectItemCaseSensitive(model, "type");
    const cJSON *vocab = cJSON_GetObjectItemCaseSensitive(model, "vocab");
    if (!cJSON_IsObject(model) || !cJSON_IsObject(vocab))
        return kiln_error(KILN_ERR_FORMAT, "%s: model.vocab: missing or not an object", label);
    if (mtype_v && !cJSON_IsString(mtype_v))
        return kiln_error(KILN_ERR_FORMAT, "%s: model.type: not a string", label);
    const char *mtype = jstr(model, "type");
    if (mtype && strcmp(mtype, "BPE") != 0)
        return kiln_error(KILN_ERR_UNSUPPORTED, "%s: model.type '%.64s' not supported (BPE only)",
                          label, mtype);
    const char *cont = jstr(model, "continuing_subword_prefix"), *eow = jstr(model, "end_of_word_suffix");
    if ((cont && cont[0]) || (eow && eow[0]))
        return kiln_error(KILN_ERR_UNSUPPORTED, "%s: model: subword prefix/suffix not supported", label);
    static const char *const model_bools[] = {"byte_fallback", "ignore_merges", "fuse_unk"};
    for (size_t k = 0; k < sizeof model_bools / sizeof model_bools[0]; k++)
        KILN_TRY(hf_check_bool(label, model, model_bools[k], 1, "model", 0));
    const cJSON *added = cJSON_GetObjectItemCaseSensitive(root, "added_tokens");
    if (added && !cJSON_IsNull(added) && !cJSON_IsArray(added))
        return kiln_error(KILN_ERR_FORMAT, "%s: added_tokens: not a list", label);
    const char *parts[] = {"normalizer", "pre_tokenizer", "decoder"};
    for (int k = 0; k < 3; k++)
        KILN_TRY(hf_check_steps(label, cJSON_GetObjectItemCaseSensitive(root, parts[k]), parts[k], 0));
    kiln_tokenizer *t = NULL;
    KILN_TRY(hf_vocab(label, vocab, added, &t));
    kiln_status st = KILN_OK;
    t->merge_mode = TOK_MERGE_RANK;
    t->byte_fallback = jbool(model, "byte_fallback", 0);
    t->ignore_merges = jbool(model, "ignore_merges", 0);
    const cJSON *unk_v = cJSON_GetObjectItemCaseSensitive(model, "unk_token");
    if (cJSON_IsString(unk_v)) {
        hf_piece u;
        st = hf_piece_of(label, unk_v->valuestring, "model.unk_token", &u);
        if (st == KILN_OK) t->unk_id = t->model_unk_id = tok_find(t, u.s, u.len);
    }
    if (st == KILN_OK) st = hf_merges(t, cJSON_GetObjectItemCaseSensitive(model, "merges"), label);
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
    if (st == KILN_OK && cfg) st = hf_config(t, cfg, label);
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
    /* serde_json's refusals that cJSON does not make, and NULs kept through cJSON */
    char *text = NULL, *ctext = NULL;
    size_t tlen = 0, clen = 0;
    KILN_TRY(tok_json_prepare(tokenizer_json, len, label, 1, &text, &tlen));
    if (config_json) {
        char clabel[600];
        snprintf(clabel, sizeof clabel, "%s: tokenizer_config.json", label);
        kiln_status cst = tok_json_prepare(config_json, config_len, clabel, 0, &ctext, &clen);
        if (cst != KILN_OK) {
            kiln_free(text);
            return cst;
        }
    }
    cJSON *root = cJSON_ParseWithLength(text, tlen);
    if (!root || !cJSON_IsObject(root)) {
        const char *ep = cJSON_GetErrorPtr();
        long off = (ep && ep >= text && ep <= text + tlen) ? (long)(ep - text) : -1;
        cJSON_Delete(root);
        kiln_free(text);
        kiln_free(ctext);
        return kiln_error(KILN_ERR_FORMAT, "%s: invalid JSON near byte %ld", label, off);
    }
    cJSON *cfg = NULL;
    if (ctext) {
        cfg = cJSON_ParseWithLength(ctext, clen);
        if (!cfg || !cJSON_IsObject(cfg)) {
            cJSON_Delete(cfg);
            cJSON_Delete(root);
            kiln_free(text);
            kiln_free(ctext);
            return kiln_error(KILN_ERR_FORMAT, "%s: tokenizer_config.json: invalid JSON", label);
        }
    }
    kiln_status st = hf_build(out, root, cfg, label);
    cJSON_Delete(cfg);
    cJSON_Delete(root);
    kiln_free(text);
    kiln_free(ctext);
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
    int present = 0;
    kiln_status st = path_join(cpath, sizeof cpath, dir, "tokenizer_config.json");
    if (st == KILN_OK) st = kiln_path_optional_file(cpath, &present);
    if (st == KILN_OK && present) st = kiln_read_text_file(cpath, (size_t)64 << 20, &cfg, &clen);
    if (st == KILN_OK) st = kiln_tokenizer_from_hf_json(json, jlen, cfg, clen, json_path, out);
    if (st == KILN_OK && !(*out)->chat_template &&
        path_join(cpath, sizeof cpath, dir, "chat_template.jinja") == KILN_OK &&
        ((st = kiln_path_optional_file(cpath, &present)) != KILN_OK || present)) {
        if (st == KILN_OK) st = kiln_read_text_file(cpath, (size_t)16 << 20, &jinja, &jjlen);
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
    int present = 0;
    KILN_TRY(kiln_path_optional_file(path, &present));
    if (!present) return kiln_error(KILN_ERR_IO, "%s: no tokenizer.json (kiln reads HF fast-tokenizer files)", dir);
    return load_hf_files(path, dir, out);
}

/* ---- public open/close/info ----------------------------------------------------------------- */

KILN_API kiln_status kiln_tokenizer_open(const char *path, kiln_tokenizer **out) {
    if (!path || !out) return kiln_error(KILN_ERR_INVALID_ARG, "kiln_tokenizer_open: NULL argument");
    if (kiln_path_is_dir(path)) return kiln_tokenizer_from_hf_dir(path, out);
    KILN_TRY(kiln_path_check_file(path)); /* says what is there instead, or that nothing is */
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

KILN_API void kiln_tokenizer_close(kiln_tokenizer *t) {
    if (!t) return;
    if (kiln_handle_check(t, KILN_HANDLE_TOKENIZER, "kiln_tokenizer_close") != KILN_OK) return;
    if (t->owner) {
        kiln_error(KILN_ERR_STATE, "kiln_tokenizer_close: this kiln_tokenizer belongs to a kiln_model "
                                   "(kiln_model_get_tokenizer) and is freed with it");
        return;
    }
    kiln_tokenizer_free(t); /* refused while detok streams on it are open */
}

KILN_API kiln_status kiln_tokenizer_get_info(const kiln_tokenizer *t, kiln_tokenizer_info *out) {
    KILN_TRY(kiln_handle_check(t, KILN_HANDLE_TOKENIZER, "kiln_tokenizer_get_info"));
    if (!out) return kiln_error(KILN_ERR_INVALID_ARG, "kiln_tokenizer_get_info: out is NULL");
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
