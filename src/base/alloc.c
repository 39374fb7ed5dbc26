/*
 * alloc.c -- every kiln allocation goes through the hook set by kiln_set_allocator().
 *
 * Layout of a block: [raw ... pad][header 64 bytes][user data, 64-byte aligned]. The header
 * keeps the raw pointer and the user size, for accounting and for free.
 */
#define _DEFAULT_SOURCE /* madvise (Linux, the BSDs) */
#include "base.h"
#include "handle.h"

#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#define KILN_ALIGN 64

typedef struct block_header {
    void *raw;
    size_t size;
    uint64_t magic;
} block_header;

#define BLOCK_MAGIC 0x6b696c6e616c6c63ull /* "kilnallc" */

static void *default_alloc(size_t size, void *user) {
    (void)user;
    return malloc(size);
}
static void default_free(void *p, void *user) {
    (void)user;
    free(p);
}

static kiln_allocator g_alloc = {default_alloc, default_free, NULL};
static _Atomic size_t g_live_bytes, g_peak_bytes, g_live_blocks;
static _Atomic uint64_t g_n_allocs;

kiln_status kiln_set_allocator(const kiln_allocator *a) {
    if (a && (!a->alloc || !a->free))
        return kiln_error(KILN_ERR_INVALID_ARG, "kiln_set_allocator: alloc and free must be set");
    const size_t live = kiln_handle_count();
    if (live)
        return kiln_error(KILN_ERR_STATE, "kiln_set_allocator: %zu kiln handle%s still open (their memory goes back "
                                          "to the allocator that gave it: free them first)", live, live == 1 ? " is" : "s are");
    if (a) g_alloc = *a;
    else g_alloc = (kiln_allocator){default_alloc, default_free, NULL};
    return KILN_OK;
}

int kiln_allocator_is_default(void) { return g_alloc.alloc == default_alloc && g_alloc.free == default_free; }

size_t kiln_alloc_page_size(void) {
    if (!kiln_allocator_is_default()) return 0;
    const long pg = sysconf(_SC_PAGESIZE);
    return pg > 0 ? (size_t)pg : 4096;
}

void kiln_pages_inside(const void *p, size_t n, size_t page, uintptr_t *lo, uintptr_t *hi) {
    const uintptr_t s = (uintptr_t)p, e = s + n;
    if (!page) {
        *lo = *hi = s;
        return;
    }
    const uintptr_t pm = ~(uintptr_t)(page - 1), ps = (s + page - 1) & pm, pe = e & pm;
    *lo = ps < pe ? ps : s;
    *hi = ps < pe ? pe : s;
}

void kiln_pages_give_back(void *p, size_t n, size_t page, uintptr_t *lo, uintptr_t *hi) {
    kiln_pages_inside(p, n, page, lo, hi);
    if (*lo < *hi && madvise((void *)*lo, *hi - *lo, MADV_DONTNEED) != 0) *lo = *hi = (uintptr_t)p;
}

void kiln_mem_get_stats(kiln_mem_stats *out) {
    if (!out) return;
    out->live_bytes = atomic_load(&g_live_bytes);
    out->peak_bytes = atomic_load(&g_peak_bytes);
    out->live_blocks = atomic_load(&g_live_blocks);
    out->n_allocs = atomic_load(&g_n_allocs);
}

void kiln_mem_reset_peak(void) { atomic_store(&g_peak_bytes, atomic_load(&g_live_bytes)); }

static void account_add(size_t size) {
    size_t live = atomic_fetch_add(&g_live_bytes, size) + size;
    size_t peak = atomic_load(&g_peak_bytes);
    while (live > peak && !atomic_compare_exchange_weak(&g_peak_bytes, &peak, live)) {
    }
    atomic_fetch_add(&g_live_blocks, 1);
    atomic_fetch_add(&g_n_allocs, 1);
}

void *kiln_malloc(size_t size) {
    size_t total;
    if (kiln_add_overflow(size, sizeof(block_header) + 2 * KILN_ALIGN, &total)) return NULL;
    uint8_t *raw = g_alloc.alloc(total, g_alloc.user);
    if (!raw) return NULL;
    uintptr_t base = (uintptr_t)raw + sizeof(block_header);
    uintptr_t user = (base + KILN_ALIGN - 1) & ~(uintptr_t)(KILN_ALIGN - 1);
    block_header *h = (block_header *)(user - sizeof(block_header));
    h->raw = raw;
    h->size = size;
    h->magic = BLOCK_MAGIC;
    account_add(size);
    return (void *)user;
}

void *kiln_calloc(size_t n, size_t size) {
    size_t total;
    if (kiln_mul_overflow(n, size, &total)) return NULL;
    void *p = kiln_malloc(total);
    if (p) memset(p, 0, total);
    return p;
}

void kiln_free(void *p) {
    if (!p) return;
    block_header *h = (block_header *)((uint8_t *)p - sizeof(block_header));
    atomic_fetch_sub(&g_live_bytes, h->size);
    atomic_fetch_sub(&g_live_blocks, 1);
    h->magic = 0;
    g_alloc.free(h->raw, g_alloc.user);
}

void *kiln_realloc(void *p, size_t size) {
    if (!p) return kiln_malloc(size);
    block_header *h = (block_header *)((uint8_t *)p - sizeof(block_header));
    void *q = kiln_malloc(size);
    if (!q) return NULL;
    memcpy(q, p, h->size < size ? h->size : size);
    kiln_free(p);
    return q;
}

char *kiln_strndup(const char *s, size_t n) {
    size_t total;
    if (kiln_add_overflow(n, 1, &total)) return NULL;
    char *d = kiln_malloc(total);
    if (!d) return NULL;
    memcpy(d, s, n);
    d[n] = '\0';
    return d;
}

char *kiln_strdup(const char *s) { return s ? kiln_strndup(s, strlen(s)) : NULL; }

kiln_status kiln_alloc_or_fail(void **out, size_t size, const char *what) {
    void *p = kiln_malloc(size);
    if (!p) return kiln_error(KILN_ERR_NOMEM, "out of memory allocating %zu bytes for %s", size, what);
    *out = p;
    return KILN_OK;
}
