/* cmd_data.c -- `kiln data`: text files -> a token shard file (docs/TRAINING_FORMATS.md). */
#include "cli.h"

#include "train/checkpoint.h"
#include "train/shards.h"

#include <stdlib.h>
#include <string.h>

static const char *data_help =
    "usage: kiln data -m TOKENIZER -o OUT.tok [--split-on blank|file|line] [--no-eos] FILE...\n\n"
    "Tokenizes text files into one token shard file for `kiln train`. TOKENIZER is a .gguf,\n"
    "a Hugging Face folder or a tokenizer.json. Documents are separated by blank lines\n"
    "(default), one per file, or one per line; the tokenizer's end-of-text token follows\n"
    "each document unless --no-eos. The held-out split is chosen at training time, by\n"
    "document, so it never mixes a document into both splits.\n";

/* SHA-256 over every token piece, NUL-separated: two shards are compatible iff equal. */
static kiln_status tokenizer_fingerprint(const kiln_tokenizer *tok, int n_vocab, uint8_t out[32]) {
    size_t cap = 1 << 20, n = 0;
    char *buf = malloc(cap);
    if (!buf) return KILN_ERR_NOMEM;
    for (int i = 0; i < n_vocab; i++) {
        const char *p = kiln_token_piece(tok, i);
        size_t l = p ? strlen(p) + 1 : 1;
        if (n + l > cap) {
            char *nb = realloc(buf, cap *= 2);
            if (!nb) {
                free(buf);
                return KILN_ERR_NOMEM;
            }
            buf = nb;
        }
        memcpy(buf + n, p ? p : "", l);
        n += l;
    }
    kiln_status st = kiln_ckpt_sha256(buf, n, out);
    free(buf);
    return st;
}

static kiln_status add_text(kiln_shard_writer *w, const kiln_tokenizer *tok, const char *text, size_t len,
                            uint64_t *n_docs, uint64_t *n_tokens) {
    /* skip documents that are only whitespace */
    size_t k = 0;
    while (k < len && (text[k] == ' ' || text[k] == '\n' || text[k] == '\r' || text[k] == '\t')) k++;
    if (k == len) return KILN_OK;
    size_t need = 0;
    kiln_status st = kiln_tokenize(tok, text, len, 0, 0, NULL, 0, &need);
    if (st != KILN_OK && st != KILN_ERR_BUFFER_TOO_SMALL) return st;
    int32_t *ids = malloc((need ? need : 1) * sizeof *ids);
    if (!ids) return KILN_ERR_NOMEM;
    st = kiln_tokenize(tok, text, len, 0, 0, ids, need, &need);
    if (st == KILN_OK) st = kiln_shard_writer_add_doc(w, ids, need);
    free(ids);
    if (st == KILN_OK) {
        (*n_docs)++;
        *n_tokens += need;
    }
    return st;
}

int cmd_data(int argc, char **argv) {
    const char *model = NULL, *out = NULL, *split_on = "blank";
    int eos = 1, n_files = 0;
    const char **files = calloc((size_t)argc, sizeof *files);
    if (!files) return 1;
    for (int i = 1; i < argc; i++) {
        const char *v = NULL;
        int err = 0;
        if (!strcmp(argv[i], "-h") || !strcmp(argv[i], "--help")) {
            fputs(data_help, stdout);
            free(files);
            return 0;
        } else if (cli_opt(argc, argv, &i, "-m", &v, &err, "data") || cli_opt(argc, argv, &i, "--model", &v, &err, "data")) {
            model = v;
        } else if (cli_opt(argc, argv, &i, "-o", &v, &err, "data") || cli_opt(argc, argv, &i, "--output", &v, &err, "data")) {
            out = v;
        } else if (cli_opt(argc, argv, &i, "--split-on", &v, &err, "data")) {
            split_on = v;
            if (!err && strcmp(v, "blank") && strcmp(v, "file") && strcmp(v, "line"))
                err = cli_usage_error("data", "--split-on takes blank, file or line, not '%s'", v);
        } else if (!strcmp(argv[i], "--no-eos")) {
            eos = 0;
        } else if (argv[i][0] == '-' && argv[i][1]) {
            err = cli_usage_error("data", "unknown option '%s'", argv[i]);
        } else {
            files[n_files++] = argv[i];
        }
        if (err) {
            free(files);
            return 2;
        }
    }
    if (!model || !out || n_files == 0) {
        free(files);
        return cli_usage_error("data", "need -m TOKENIZER, -o OUT and at least one input file");
    }
    kiln_tokenizer *tok = NULL;
    kiln_status st = kiln_tokenizer_open(model, &tok);
    if (st != KILN_OK) {
        free(files);
        return cli_fail("data", model, st);
    }
    kiln_tokenizer_info ti;
    kiln_tokenizer_get_info(tok, &ti);
    int32_t eos_id = ti.eos_id >= 0 ? ti.eos_id : ti.eot_id;
    if (eos && eos_id < 0) {
        kiln_tokenizer_close(tok);
        free(files);
        return cli_usage_error("data", "the tokenizer has no end-of-text token: use --no-eos");
    }
    uint8_t fp[32];
    kiln_shard_writer *w = NULL;
    st = tokenizer_fingerprint(tok, ti.n_vocab, fp);
    if (st == KILN_OK) st = kiln_shard_writer_create(out, (uint32_t)ti.n_vocab, eos ? (uint32_t)eos_id : KILN_SHARD_NO_EOS, fp, &w);
    uint64_t n_docs = 0, n_tokens = 0;
    int rc = 0;
    for (int f = 0; st == KILN_OK && f < n_files; f++) {
        size_t len = 0;
        char *text = cli_read_file(files[f], &len);
        if (!text) {
            fprintf(stderr, "kiln data: cannot read '%s'\n", files[f]);
            rc = 1;
            break;
        }
        if (!strcmp(split_on, "file")) {
            st = add_text(w, tok, text, len, &n_docs, &n_tokens);
        } else {
            const char *sep = !strcmp(split_on, "line") ? "\n" : "\n\n";
            size_t sl = strlen(sep), start = 0;
            while (st == KILN_OK && start < len) {
                const char *hit = strstr(text + start, sep);
                size_t end = hit ? (size_t)(hit - text) : len;
                st = add_text(w, tok, text + start, end - start, &n_docs, &n_tokens);
                start = end + sl;
                while (hit && start < len && text[start] == '\n') start++;
            }
        }
        free(text);
    }
    if (st != KILN_OK || rc) {
        if (!rc) rc = cli_fail("data", out, st);
        kiln_shard_writer_abort(w);
    } else {
        st = kiln_shard_writer_commit(w);
        if (st != KILN_OK) rc = cli_fail("data", out, st);
        else
            printf("kiln data: %s: %llu documents, %llu tokens (+%s EOS), vocabulary %d\n", out,
                   (unsigned long long)n_docs, (unsigned long long)n_tokens, eos ? "1" : "no", ti.n_vocab);
    }
    kiln_tokenizer_close(tok);
    free(files);
    return rc;
}
