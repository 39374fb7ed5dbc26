/* cmd_tokenize.c -- `kiln tokenize` and `kiln detokenize`. */
#include "cli.h"

#include <errno.h>

#include <cjson/cJSON.h>
#include <stdlib.h>
#include <string.h>

static const char *tokenize_help =
    "usage: kiln tokenize -m MODEL (-p TEXT | -f FILE) [--json] [--no-special] [--no-parse-special]\n\n"
    "Prints each token as 'id<TAB>piece' (or JSON with ids and pieces). MODEL is a .gguf file,\n"
    "a Hugging Face folder or a tokenizer.json; no weights are loaded.\n"
    "  --no-special        do not add BOS/EOS\n"
    "  --no-parse-special  treat special-token text in the input as plain text\n";

static const char *detokenize_help =
    "usage: kiln detokenize -m MODEL [--special] ID [ID ...]   (or ids on stdin)\n\n"
    "Prints the text of the ids. --special renders special tokens.\n";

int cmd_tokenize(int argc, char **argv) {
    const char *model = NULL, *text = NULL, *file = NULL;
    int json = 0, add_special = 1, parse_special = 1;
    for (int i = 1; i < argc; i++) {
        const char *v = NULL;
        int err = 0;
        if (!strcmp(argv[i], "-h") || !strcmp(argv[i], "--help")) {
            fputs(tokenize_help, stdout);
            return 0;
        } else if (cli_opt(argc, argv, &i, "-m", &v, &err, "tokenize") || cli_opt(argc, argv, &i, "--model", &v, &err, "tokenize")) {
            model = v;
        } else if (cli_opt(argc, argv, &i, "-p", &v, &err, "tokenize") || cli_opt(argc, argv, &i, "--prompt", &v, &err, "tokenize")) {
            text = v;
        } else if (cli_opt(argc, argv, &i, "-f", &v, &err, "tokenize") || cli_opt(argc, argv, &i, "--file", &v, &err, "tokenize")) {
            file = v;
        } else if (!strcmp(argv[i], "--json")) {
            json = 1;
        } else if (!strcmp(argv[i], "--no-special")) {
            add_special = 0;
        } else if (!strcmp(argv[i], "--no-parse-special")) {
            parse_special = 0;
        } else {
            return cli_usage_error("tokenize", "unknown option '%s'", argv[i]);
        }
        if (err) return 2;
    }
    if (!model) return cli_usage_error("tokenize", "a model is required (-m MODEL)");
    if (!!text == !!file) return cli_usage_error("tokenize", "give exactly one of -p TEXT or -f FILE");
    size_t len = text ? strlen(text) : 0;
    char *buf = NULL;
    if (file) {
        buf = cli_read_file("tokenize", file, CLI_READ_MAX, &len);
        if (!buf) return 1;
        text = buf;
    }
    kiln_tokenizer *tok = NULL;
    kiln_status st = kiln_tokenizer_open(model, &tok);
    if (st != KILN_OK) {
        free(buf);
        return cli_fail("tokenize", model, st);
    }
    size_t n = 0;
    int32_t *ids = NULL;
    st = kiln_tokenize(tok, text, len, add_special, parse_special, NULL, 0, &n);
    if (st == KILN_OK || st == KILN_ERR_BUFFER_TOO_SMALL) {
        ids = malloc((n ? n : 1) * sizeof *ids);
        st = ids ? kiln_tokenize(tok, text, len, add_special, parse_special, ids, n, &n) : KILN_ERR_NOMEM;
    }
    int rc = 0;
    if (st != KILN_OK) {
        rc = cli_fail("tokenize", "tokenize", st);
    } else if (json) {
        cJSON *obj = cJSON_CreateObject();
        cJSON *a = cJSON_AddArrayToObject(obj, "ids");
        cJSON *p = cJSON_AddArrayToObject(obj, "pieces");
        for (size_t i = 0; i < n; i++) {
            cJSON_AddItemToArray(a, cJSON_CreateNumber(ids[i]));
            const char *piece = kiln_token_piece(tok, ids[i]);
            cJSON_AddItemToArray(p, cJSON_CreateString(piece ? piece : ""));
        }
        char *s = cJSON_PrintUnformatted(obj);
        if (s) puts(s);
        free(s);
        cJSON_Delete(obj);
    } else {
        for (size_t i = 0; i < n; i++) {
            const char *piece = kiln_token_piece(tok, ids[i]);
            printf("%d\t%s\n", ids[i], piece ? piece : "");
        }
    }
    free(ids);
    free(buf);
    kiln_tokenizer_close(tok);
    return rc;
}

int cmd_detokenize(int argc, char **argv) {
    const char *model = NULL;
    int special = 0;
    size_t n = 0, cap = 64;
    int32_t *ids = malloc(cap * sizeof *ids);
    char *stdin_text = NULL;
    if (!ids) return 1;
    int rc = 0;
    for (int i = 1; i < argc && !rc; i++) {
        const char *v = NULL;
        int err = 0;
        long id;
        if (!strcmp(argv[i], "-h") || !strcmp(argv[i], "--help")) {
            fputs(detokenize_help, stdout);
            free(ids);
            return 0;
        } else if (cli_opt(argc, argv, &i, "-m", &v, &err, "detokenize") || cli_opt(argc, argv, &i, "--model", &v, &err, "detokenize")) {
            model = v;
        } else if (!strcmp(argv[i], "--special")) {
            special = 1;
        } else if (argv[i][0] == '-' && argv[i][1] && (argv[i][1] < '0' || argv[i][1] > '9')) {
            rc = cli_usage_error("detokenize", "unknown option '%s'", argv[i]);
        } else if (cli_parse_int("detokenize", "ID", argv[i], -2147483647L, 2147483647L, &id)) {
            rc = 2;
        } else {
            if (n == cap) {
                int32_t *m = realloc(ids, 2 * cap * sizeof *ids);
                if (!m) rc = 1;
                else {
                    ids = m;
                    cap *= 2;
                }
            }
            if (!rc) ids[n++] = (int32_t)id;
        }
        if (err) rc = 2;
    }
    if (!rc && !model) rc = cli_usage_error("detokenize", "a model is required (-m MODEL)");
    if (!rc && n == 0) { /* ids from stdin, separated by spaces, commas or brackets */
        stdin_text = cli_read_file("detokenize", "-", CLI_READ_MAX, NULL);
        if (!stdin_text) rc = 1;
        for (char *p = stdin_text; p && *p && !rc;) {
            if ((*p >= '0' && *p <= '9') || *p == '-') {
                char *end;
                errno = 0;
                long id = strtol(p, &end, 10);
                if (errno || end == p || id < -2147483647L || id > 2147483647L) {
                    rc = cli_usage_error("detokenize", "'%.*s' on standard input is not a token id",
                                         (int)(end > p && end - p < 40 ? end - p : 1), p);
                    break;
                }
                if (n == cap) {
                    int32_t *m = realloc(ids, 2 * cap * sizeof *ids);
                    if (!m) rc = 1;
                    else {
                        ids = m;
                        cap *= 2;
                    }
                }
                if (!rc) ids[n++] = (int32_t)id;
                p = end;
            } else {
                p++;
            }
        }
    }
    kiln_tokenizer *tok = NULL;
    if (!rc) {
        kiln_status st = kiln_tokenizer_open(model, &tok);
        if (st != KILN_OK) rc = cli_fail("detokenize", model, st);
    }
    if (!rc) {
        size_t need = 0;
        kiln_status st = kiln_detokenize(tok, ids, n, special, NULL, 0, &need);
        char *out = NULL;
        if (st == KILN_OK || st == KILN_ERR_BUFFER_TOO_SMALL) {
            out = malloc(need + 1);
            st = out ? kiln_detokenize(tok, ids, n, special, out, need + 1, &need) : KILN_ERR_NOMEM;
        }
        if (st != KILN_OK) rc = cli_fail("detokenize", "detokenize", st);
        else {
            fwrite(out, 1, need, stdout);
            fputc('\n', stdout);
        }
        free(out);
    }
    kiln_tokenizer_close(tok);
    free(stdin_text);
    free(ids);
    return rc;
}
