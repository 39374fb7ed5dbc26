/* json_text.c -- checks on JSON text before cJSON sees it (json_text.h). */
#include "json_text.h"

#include <stdio.h>

/* 1-based line and column of byte `at`. */
static void line_col(const char *text, size_t at, size_t *line, size_t *col) {
    *line = 1;
    size_t start = 0;
    for (size_t i = 0; i < at; i++)
        if (text[i] == '\n') {
            (*line)++;
            start = i + 1;
        }
    *col = at - start + 1;
}

kiln_status kiln_json_check_no_nul(const char *text, size_t len, const char *label) {
    if (!label) label = "JSON";
    if (!text) return len ? kiln_error(KILN_ERR_INVALID_ARG, "kiln_json_check_no_nul: NULL text") : KILN_OK;
    int in_string = 0;
    size_t string_start = 0, line, col;
    for (size_t i = 0; i < len; i++) {
        char ch = text[i];
        if (ch == '\0') {
            line_col(text, i, &line, &col);
            return kiln_error(KILN_ERR_FORMAT, "%s: line %zu, column %zu: a NUL byte in the JSON text", label, line,
                              col);
        }
        if (!in_string) {
            if (ch == '"') {
                in_string = 1;
                string_start = i + 1;
            }
            continue;
        }
        if (ch == '"') {
            in_string = 0;
        } else if (ch == '\\' && i + 1 < len) {
            if (text[i + 1] == 'u' && i + 5 < len && text[i + 2] == '0' && text[i + 3] == '0' && text[i + 4] == '0' &&
                text[i + 5] == '0') {
                line_col(text, string_start, &line, &col);
                int shown = (int)(i - string_start < 40 ? i - string_start : 40);
                return kiln_error(KILN_ERR_FORMAT,
                                  "%s: line %zu, column %zu: a JSON string holds an escaped NUL (\\u0000) after "
                                  "\"%.*s\"; names and values cannot contain NUL",
                                  label, line, col, shown, text + string_start);
            }
            i++; /* the escaped character: \" and \\ do not end or start anything */
        }
    }
    return KILN_OK;
}
