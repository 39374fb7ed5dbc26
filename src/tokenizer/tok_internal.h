/*
 * tok_internal.h -- the layout of kiln_tokenizer, shared by the tokenizer's source files.
 *
 * One engine serves every supported vocabulary. A tokenizer is a pipeline:
 *   added-token split -> normalizer steps -> pre-tokenizer steps -> BPE model -> ids
 * and decoding is a list of decoder steps over the token strings. The GGUF loader and the
 * tokenizer.json loader both fill this description; the GGUF loader synthesizes the steps
 * llama.cpp uses for each tokenizer.ggml.pre, the JSON loader reads them from the document.
 */
#ifndef KILN_TOK_INTERNAL_H
#define KILN_TOK_INTERNAL_H

#include "tokenizer.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

/* token attributes (bit flags) */
enum {
    TOK_ATTR_SPECIAL = 1,  /* control token: matched only with parse_special, skipped on decode */
    TOK_ATTR_ADDED = 2,    /* added token (special or not): matched verbatim before the model */
    TOK_ATTR_BYTE = 4,     /* byte-fallback token <0xXX> */
    TOK_ATTR_EOG = 8,      /* ends generation */
    TOK_ATTR_LSTRIP = 16,  /* added token absorbs whitespace on its left */
    TOK_ATTR_RSTRIP = 32,  /* added token absorbs whitespace on its right */
    TOK_ATTR_UNUSED = 64,  /* a hole in the id space (no string) */
    TOK_ATTR_NOT_MODEL = 128, /* tokenizer.json: an added token absent from model.vocab (merges
                               * may not name it) */
};

typedef enum tok_merge_mode {
    TOK_MERGE_RANK = 0,  /* merges list: lower rank first (HF BPE, GGUF gpt2) */
    TOK_MERGE_SCORE = 1, /* SentencePiece: the pair whose concatenation has the highest score */
} tok_merge_mode;

typedef enum tok_norm_kind {
    TOK_NORM_NFC, TOK_NORM_NFD, TOK_NORM_NFKC, TOK_NORM_NFKD, TOK_NORM_LOWERCASE,
    TOK_NORM_PREPEND, TOK_NORM_REPLACE,
} tok_norm_kind;

typedef struct tok_norm_step {
    tok_norm_kind kind;
    char *a; /* PREPEND: the prefix; REPLACE: the pattern (a literal string) */
    char *b; /* REPLACE: the replacement */
} tok_norm_step;

typedef enum tok_split_behavior {
    TOK_SPLIT_ISOLATED, TOK_SPLIT_REMOVED, TOK_SPLIT_MERGED_PREV, TOK_SPLIT_MERGED_NEXT,
    TOK_SPLIT_CONTIGUOUS,
} tok_split_behavior;

typedef enum tok_pre_kind {
    TOK_PRE_SPLIT,      /* regex split (re, behavior) */
    TOK_PRE_PREFIX_SPACE, /* ByteLevel add_prefix_space: prepend ' ' unless it starts with one */
    TOK_PRE_METASPACE,  /* replace ' ' by the marker, prepend per scheme, optionally split */
    TOK_PRE_SPM,        /* GGUF SentencePiece: ' ' -> ▁, prepend ▁ (add_space_prefix) */
} tok_pre_kind;

typedef struct tok_pre_step {
    tok_pre_kind kind;
    pcre2_code *re;               /* SPLIT */
    char *pattern;                /* SPLIT: its source text (a regex, or a literal when literal) */
    int literal;
    tok_split_behavior behavior;  /* SPLIT */
    int prepend;                  /* METASPACE: 0 never, 1 first, 2 always; SPM: add_space_prefix */
    int split;                    /* METASPACE: split on the marker */
} tok_pre_step;

typedef enum tok_dec_kind {
    TOK_DEC_BYTELEVEL, TOK_DEC_REPLACE, TOK_DEC_BYTEFALLBACK, TOK_DEC_FUSE, TOK_DEC_STRIP,
    TOK_DEC_METASPACE,
} tok_dec_kind;

typedef struct tok_dec_step {
    tok_dec_kind kind;
    char *a, *b;     /* REPLACE: pattern, content; METASPACE: marker; STRIP: content char */
    int start, stop; /* STRIP counts; METASPACE: start = prepend scheme != never */
} tok_dec_step;

#define TOK_MAX_STEPS 8

struct kiln_tokenizer {
    kiln_handle_head head;    /* first: the registry's magic (base/handle.h) */
    const void *owner;        /* the kiln_model this tokenizer belongs to, or NULL (its own) */
    const char *type;         /* "bpe" or "spm" */
    char pre[32];             /* pre-tokenizer name */
    char *label;              /* file or folder it came from, for messages */

    int32_t n_vocab;          /* ids are 0..n_vocab-1 */
    char **piece;             /* [n_vocab] NUL-terminated strings (NULL for unused ids) */
    uint32_t *piece_len;      /* [n_vocab] */
    float *score;             /* [n_vocab] SentencePiece scores, or NULL */
    uint8_t *attr;            /* [n_vocab] TOK_ATTR_* */
    char *strings;            /* one buffer holding every piece */

    /* tokenizer.json: model.vocab strings that share their id with another string (HF's vocab
     * maps strings to ids, so two strings may name one id; an added token given an id that
     * model.vocab also uses takes piece[id]). They encode to alias_id; piece[] decodes it. */
    char **alias;             /* [n_alias] pointers into strings */
    uint32_t *alias_len;      /* [n_alias] */
    int32_t *alias_id;        /* [n_alias] */
    int32_t n_alias;

    /* vocab hash: open addressing over piece strings, value = id, or n_vocab + alias index;
     * -1 empty */
    int32_t *vhash;
    size_t vhash_mask;

    /* merge hash: (left id, right id) -> (rank, merged id) */
    struct tok_merge *mhash;
    size_t mhash_mask;
    tok_merge_mode merge_mode;
    int merge_by_id;          /* TOK_MERGE_SCORE: the merged piece's id replaces its score (lower
                               * id first) and of two splits of one piece the one with the longer
                               * left part goes first: the merge order transformers derives for a
                               * Gemma GGUF (generate_merges with the file position as score) */

    int byte_level;           /* pieces are GPT-2 byte-to-unicode encoded */
    int byte_fallback;        /* unknown characters become <0xXX> tokens */
    int ignore_merges;        /* a pre-token that is a vocab entry is emitted whole */
    int32_t byte_id[256];     /* byte_level: id of each byte's char; else id of <0xXX>; -1 */

    tok_norm_step norm[TOK_MAX_STEPS];
    int n_norm;
    tok_pre_step pre_steps[TOK_MAX_STEPS];
    int n_pre;
    tok_dec_step dec[TOK_MAX_STEPS];
    int n_dec;
    int dec_join_space;       /* no decoder at all: HF joins tokens with ' ' */

    /* added tokens, sorted by length descending within each first byte bucket */
    int32_t *added;           /* ids */
    int n_added;

    int32_t bos_id, eos_id, eot_id, eom_id, pad_id, unk_id;
    int32_t model_unk_id;     /* HF model.unk_token: byte-level BPE emits it for a byte missing
                               * from the vocabulary; without one the byte is dropped (HF and
                               * llama.cpp both drop it) */
    int add_bos, add_eos;
    int32_t *prefix_ids, *suffix_ids; /* HF TemplateProcessing single; NULL -> bos/eos */
    int n_prefix, n_suffix;
    int use_template_processing;

    char *chat_template;
    const char *chat_template_name;
    /* A Gemma GGUF without tokenizer.chat_template (general.architecture gemma, gemma2,
     * gemma3) renders with the "gemma" template; gemma3 also folds a system message into the
     * first user turn, as Gemma 3's own template does (Gemma 1 and 2 refuse one). */
    int chat_gemma_system;
};

struct tok_merge {
    uint64_t key;   /* (left << 32) | right, UINT64_MAX = empty */
    int32_t rank;
    int32_t id;
};

/* ---- tokenizer.c: building --------------------------------------------------------------- */

kiln_status tok_alloc(kiln_tokenizer **out, int32_t n_vocab, const char *label);
/* Copy all piece strings (lens[i]; strs[i] may be NULL) and the n_alias aliases (strings
 * naming alias_ids[i]; NULL, NULL, NULL, 0 for none) into one buffer and build the hash. */
kiln_status tok_set_pieces(kiln_tokenizer *t, const char *const *strs, const uint32_t *lens,
                           const char *const *alias_strs, const uint32_t *alias_lens,
                           const int32_t *alias_ids, int32_t n_alias);
/* The id of a string (a piece or an alias), or -1. */
int32_t tok_find(const kiln_tokenizer *t, const char *s, size_t len);
/* As tok_find, but only strings of the model's vocabulary (not TOK_ATTR_NOT_MODEL tokens). */
int32_t tok_find_model(const kiln_tokenizer *t, const char *s, size_t len);
kiln_status tok_merges_reserve(kiln_tokenizer *t, size_t n);
/* Add merge "a b" (piece strings) with the given rank. Returns 0 when added (or a duplicate
 * pair), 1 when a is absent, 2 when b is absent, 3 when a+b is absent (the merge is not
 * added), -1 out of memory. model_only: look the strings up with tok_find_model. */
int tok_merge_add(kiln_tokenizer *t, const char *a, size_t alen, const char *b, size_t blen,
                  int32_t rank, int model_only);
/* After pieces, attributes and byte_level / byte_fallback are set. */
kiln_status tok_finish(kiln_tokenizer *t);
/* Compile a pre-tokenizer regex (PCRE2_UTF | PCRE2_UCP; literal: the pattern is a string). */
kiln_status tok_compile_regex(const char *pattern, size_t len, int literal, const char *label,
                              pcre2_code **out);
/* The pre-tokenizer regexes kiln knows by name ("gpt2", "llama3", "qwen2", "gpt4o"). */
const char *tok_regex_by_name(const char *name);
const char *tok_detect_chat_template(const char *tmpl);

/* GPT-2's byte -> code point map and back (-1 for code points that are not images). */
uint32_t tok_byte_to_cp(uint8_t b);
int tok_cp_to_byte(uint32_t cp);

/* UTF-8 helpers */
/* Length of the valid UTF-8 sequence at s[0..n) (1..4), or 0 if invalid. */
int tok_utf8_valid_len(const uint8_t *s, size_t n);
/* Length of the maximal prefix of a valid sequence at s (1..3) when s is invalid; used to
 * decide how many bytes one U+FFFD replaces (Unicode's "maximal subpart" practice). */
int tok_utf8_invalid_len(const uint8_t *s, size_t n);
int tok_utf8_encode(uint32_t cp, char *out);
/* 1 when s[0..n) is an incomplete but so far valid sequence. */
int tok_utf8_incomplete(const uint8_t *s, size_t n);

/* ---- tok_json.c: tokenizer.json text checks ---------------------------------------------- */
/* Check a JSON text for what serde_json refuses and cJSON accepts (invalid UTF-8, raw control
 * characters in strings; with check_ids, a non-u32 literal at model.vocab[*] or
 * added_tokens[*].id) and copy it into *out (kiln_malloc'd, NUL-terminated) with each
 * "\u0000" escape rewritten to the bytes C0 80, which cJSON carries through. */
kiln_status tok_json_prepare(const char *text, size_t len, const char *label, int check_ids,
                             char **out, size_t *out_len);
/* 1 when a string parsed from tok_json_prepare's output holds an escaped NUL. */
int tok_json_has_nul(const char *s);
/* Turn each C0 80 in s back into a NUL, in place; returns the new length. Call it once per
 * string: afterwards s holds NULs and strlen no longer gives its length. */
size_t tok_json_nul_decode(char *s);

/* ---- loaders (tok_load.c) ---------------------------------------------------------------- */
kiln_status tok_load_hf_json(const char *json, size_t len, const char *config, size_t config_len,
                             const char *label, kiln_tokenizer **out);

/* ---- chat.c ------------------------------------------------------------------------------ */
/* (kiln_chat_apply is public) */

#endif /* KILN_TOK_INTERNAL_H */
