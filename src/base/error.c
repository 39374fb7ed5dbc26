/* error.c -- the thread-local error message and status names. */
#include "base.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#define KILN_ERROR_CAP 1024

static _Thread_local char tl_error[KILN_ERROR_CAP];

kiln_status kiln_error(kiln_status st, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(tl_error, sizeof tl_error, fmt, ap);
    va_end(ap);
    return st;
}

kiln_status kiln_error_prefix(kiln_status st, const char *fmt, ...) {
    char old[KILN_ERROR_CAP];
    memcpy(old, tl_error, sizeof old);
    char pre[KILN_ERROR_CAP];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(pre, sizeof pre, fmt, ap);
    va_end(ap);
    /* truncation of an over-long message is intended */
    size_t n = strlen(pre);
    if (n > KILN_ERROR_CAP - 3) n = KILN_ERROR_CAP - 3;
    memcpy(tl_error, pre, n);
    memcpy(tl_error + n, ": ", 2);
    size_t rest = KILN_ERROR_CAP - n - 3;
    size_t ol = strlen(old);
    if (ol > rest) ol = rest;
    memcpy(tl_error + n + 2, old, ol);
    tl_error[n + 2 + ol] = '\0';
    return st;
}

void kiln_error_clear(void) { tl_error[0] = '\0'; }

const char *kiln_last_error(void) { return tl_error; }

const char *kiln_status_string(kiln_status st) {
    switch (st) {
    case KILN_OK: return "ok";
    case KILN_ERR_INVALID_ARG: return "invalid argument";
    case KILN_ERR_IO: return "i/o error";
    case KILN_ERR_FORMAT: return "malformed input";
    case KILN_ERR_UNSUPPORTED: return "unsupported";
    case KILN_ERR_NOMEM: return "out of memory";
    case KILN_ERR_RANGE: return "out of range";
    case KILN_ERR_STATE: return "invalid state";
    case KILN_ERR_INTERNAL: return "internal error";
    case KILN_ERR_BUFFER_TOO_SMALL: return "buffer too small";
    case KILN_ERR_BAD_HANDLE: return "bad handle";
    case KILN_ERR_POISONED: return "backend poisoned";
    case KILN_ERR_PANIC: return "internal invariant violated";
    case KILN_ERR_BUSY: return "busy";
    }
    return "unknown status";
}

const char *kiln_version(void) { return "0.1.0"; }
