/*
 * test_backend_shared.c -- ops.h kiln_backend_acquire: one backend per device, mode and
 * thread count per process, shared and reference counted; a CUDA request without a GPU
 * fails cleanly and leaves nothing behind.
 */
#include "ops/ops.h"
#include "test_util.h"

int main(void) {
    kiln_backend *a = NULL, *b = NULL, *c = NULL, *d = NULL;
    CHECK(kiln_backend_acquire(-1, 0, 2, &a) == KILN_OK);
    CHECK(kiln_backend_acquire(-1, 0, 2, &b) == KILN_OK);
    CHECK(a && a == b); /* the same device, mode and threads: one backend */
    CHECK(kiln_backend_acquire(-1, 1, 2, &c) == KILN_OK);
    CHECK(c && c != a); /* another mode: its own */
    CHECK(kiln_backend_acquire(-1, 0, 1, &d) == KILN_OK);
    CHECK(d && d != a); /* another thread count: its own */
    kiln_backend_release(a);
    /* still held by b: usable */
    float x[4] = {1, 2, 3, 4}, y[4] = {1, 1, 1, 1};
    b->i->add(b, x, y, 4);
    CHECK(x[3] == 5.0f);
    kiln_backend_release(b);
    kiln_backend_release(c);
    kiln_backend_release(d);
    kiln_backend_release(NULL);
    /* after the last release a new acquire makes a fresh one */
    CHECK(kiln_backend_acquire(-1, 0, 2, &a) == KILN_OK);
    kiln_backend_release(a);
    CHECK_ERR(kiln_backend_acquire(-2, 0, 0, &a), KILN_ERR_INVALID_ARG, "device -2");
    /* no GPU here (or a CUDA-less build): a clean error, nothing registered */
    kiln_backend *g = NULL;
    kiln_status st = kiln_backend_acquire(0, 0, 0, &g);
    if (st == KILN_OK) kiln_backend_release(g);
    else CHECK(g == NULL && st == KILN_ERR_UNSUPPORTED);
    return test_finish("test_backend_shared");
}
