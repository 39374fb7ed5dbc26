/* cmd_data.c -- `kiln data`: text files -> a token shard file (docs/TRAINING_FORMATS.md). */
#define _GNU_SOURCE /* memmem */
#include "cli.h"

#include "train/checkpoint.h"
#include "train/shards.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

static const char *data_help =
    "usage: kiln data -m TOKENIZER -o OUT.tok [--split-on blank|file|line] [--no-eos] FILE...\n\n"
    "Tokenizes text files into one token shard file for `kiln train`. TOKENIZER is a .gguf,\n"
    "a Hugging Face folder or a tokenizer.json. Documents are separated by blank lines\n"
    "(default), one per file, or one per line; the tokenizer's end-of-text token follows\n"
    "each document unless --no-eos. The held-out split is chosen at training time, by\n"
    "document, so it never mixes a document into both splits.\n";

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

#define DATA_MAX_DOC ((size_t)64 << 20) /* one document's text; a corpus has no limit */
#define DATA_CHUNK ((size_t)1 << 20)

/* Split one file (or "-", stdin) into documents at sep ("\n\n" or "\n"; the newlines that
 * follow a separator belong to neither document) and add each, reading DATA_CHUNK bytes at a
 * time: memory holds one document, never the corpus. Returns 1 after printing an I/O or
 * size error, 0 otherwise (*st carries a kiln error). */
static int stream_docs(const char *path, const char *sep, kiln_shard_writer *w, const kiln_tokenizer *tok,
                       uint64_t *n_docs, uint64_t *n_tokens, kiln_status *st) {
    int is_stdin = !strcmp(path, "-");
    FILE *f = is_stdin ? stdin : fopen(path, "rb");
    if (!f) {
        fprintf(stderr, "kiln data: cannot read '%s': %s\n", path, strerror(errno));
        return 1;
    }
    size_t sl = strlen(sep), cap = 2 * DATA_CHUNK, len = 0, start = 0, scanned = 0;
    char *buf = malloc(cap);
    int rc = 0, eof = 0, skip_nl = 0;
    if (!buf) {
        fprintf(stderr, "kiln data: out of memory\n");
        rc = 1;
    }
    while (!rc && *st == KILN_OK) {
        if (skip_nl) { /* the newlines after a separator, possibly across reads */
            while (start < len && buf[start] == '\n') start++;
            if (start < len) skip_nl = 0;
        }
        if (scanned < start) scanned = start;
        /* a separator that starts before `scanned` was looked for already (it may straddle) */
        const char *hit = len - scanned >= sl ? memmem(buf + scanned, len - scanned, sep, sl) : NULL;
        if (hit || (eof && start < len)) {
            size_t end = hit ? (size_t)(hit - buf) : len;
            *st = add_text(w, tok, buf + start, end - start, n_docs, n_tokens);
            start = hit ? end + sl : len;
            scanned = start;
            skip_nl = hit != NULL;
            continue;
        }
        if (eof) break;
        scanned = len >= sl ? len - sl + 1 : 0;
        if (scanned < start) scanned = start;
        if (start > 0) { /* drop what is done */
            memmove(buf, buf + start, len - start);
            len -= start;
            scanned -= start;
            start = 0;
        }
        if (len >= DATA_MAX_DOC) {
            fprintf(stderr,
                    "kiln data: '%s': a document runs past %zu bytes without a separator (--split-on %s);"
                    " split the file or use --split-on line\n",
                    path, DATA_MAX_DOC, sl == 1 ? "line" : "blank");
            rc = 1;
            break;
        }
        if (cap - len < DATA_CHUNK) {
            char *nb = realloc(buf, cap * 2);
            if (!nb) {
                fprintf(stderr, "kiln data: out of memory\n");
                rc = 1;
                break;
            }
            buf = nb;
            cap *= 2;
        }
        size_t r = fread(buf + len, 1, DATA_CHUNK, f);
        len += r;
        if (r < DATA_CHUNK) {
            if (ferror(f)) {
                fprintf(stderr, "kiln data: cannot read '%s': %s\n", path, strerror(errno));
                rc = 1;
            }
            eof = 1;
        }
    }
    free(buf);
    if (!is_stdin) fclose(f);
    return rc;
}

/* 1 when a and b name the same existing file (after links). */
static int same_file(const char *a, const char *b) {
    struct stat sa, sb;
    return stat(a, &sa) == 0 && stat(b, &sb) == 0 && sa.st_dev == sb.st_dev && sa.st_ino == sb.st_ino;
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
    for (int f = 0; f < n_files; f++) {
        if (same_file(files[f], out) || (!strcmp(files[f], "-") && same_file("/dev/stdin", out))) {
            int rc = cli_usage_error("data", "-o %s is the input file '%s': the shard would replace it", out, files[f]);
            free(files);
            return rc;
        }
    }
    if (same_file(model, out)) {
        free(files);
        return cli_usage_error("data", "-o %s is the tokenizer file: the shard would replace it", out);
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
    st = kiln_tokenizer_fingerprint(tok, fp);
    if (st == KILN_OK) st = kiln_shard_writer_create(out, (uint32_t)ti.n_vocab, eos ? (uint32_t)eos_id : KILN_SHARD_NO_EOS, fp, &w);
    uint64_t n_docs = 0, n_tokens = 0;
    int rc = 0;
    for (int f = 0; st == KILN_OK && !rc && f < n_files; f++) {
        if (!strcmp(split_on, "file")) {
            size_t len = 0;
            char *text = cli_read_file("data", files[f], DATA_MAX_DOC, &len);
            if (!text) rc = 1;
            else st = add_text(w, tok, text, len, &n_docs, &n_tokens);
            free(text);
        } else {
            rc = stream_docs(files[f], !strcmp(split_on, "line") ? "\n" : "\n\n", w, tok, &n_docs, &n_tokens, &st);
        }
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
