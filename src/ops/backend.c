/*
 * backend.c -- what every backend shares: freeing through the table.
 */
#include "ops.h"

void kiln_backend_free(kiln_backend *be) {
    if (!be) return;
    be->i->free(be);
}
