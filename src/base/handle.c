/*
 * handle.c -- the registry of live public handles (handle.h): an open-addressing hash table
 * of addresses, linear probing, backward-shift deletion (no tombstones), under one mutex.
 */
#include "handle.h"

#include <pthread.h>

typedef struct handle_entry {
    uintptr_t addr; /* 0: empty slot */
    uint32_t kind;
    uint32_t users;
} handle_entry;

static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;
static handle_entry *g_table; /* g_cap slots (a power of two), NULL while g_count is 0 */
static size_t g_cap, g_count;

static const struct {
    uint32_t magic;
    const char *name;
} kinds[KILN_HANDLE_KIND_COUNT] = {
    [KILN_HANDLE_MODEL] = {0x4b4d444cu, "kiln_model"},            /* "KMDL" */
    [KILN_HANDLE_TOKENIZER] = {0x4b544f4bu, "kiln_tokenizer"},    /* "KTOK" */
    [KILN_HANDLE_CONTEXT] = {0x4b435458u, "kiln_context"},        /* "KCTX" */
    [KILN_HANDLE_SAMPLER] = {0x4b534d50u, "kiln_sampler"},        /* "KSMP" */
    [KILN_HANDLE_DETOK_STREAM] = {0x4b445453u, "kiln_detok_stream"}, /* "KDTS" */
    [KILN_HANDLE_TRAINER] = {0x4b54524eu, "kiln_trainer"},        /* "KTRN" */
    [KILN_HANDLE_LINEAR_CE] = {0x4b4c4345u, "kiln_linear_ce"},    /* "KLCE" */
    [KILN_HANDLE_ENGINE] = {0x4b454e47u, "kiln_engine"},          /* "KENG" */
    [KILN_HANDLE_TEACHER] = {0x4b544348u, "kiln_teacher"},        /* "KTCH" */
};

const char *kiln_handle_kind_name(kiln_handle_kind kind) {
    return kind > 0 && kind < KILN_HANDLE_KIND_COUNT ? kinds[kind].name : "kiln handle";
}

/* Handles are 64-byte aligned (kiln_malloc): drop the low bits, then Fibonacci hashing. */
static size_t slot_of(uintptr_t a, size_t cap) {
    return (size_t)(((uint64_t)(a >> 6) * 0x9e3779b97f4a7c15ull) >> 20) & (cap - 1);
}

/* The entry of address a, or NULL. Lock held. */
static handle_entry *find(uintptr_t a) {
    if (!g_table) return NULL;
    for (size_t i = slot_of(a, g_cap);; i = (i + 1) & (g_cap - 1)) {
        if (g_table[i].addr == a) return &g_table[i];
        if (g_table[i].addr == 0) return NULL;
    }
}

/* Put e into a table known to have room. Lock held. */
static void place(handle_entry *table, size_t cap, handle_entry e) {
    size_t i = slot_of(e.addr, cap);
    while (table[i].addr) i = (i + 1) & (cap - 1);
    table[i] = e;
}

/* Room for one more entry at a load of at most 1/2. Lock held. */
static kiln_status reserve_one(const char *fn) {
    if (g_table && 2 * (g_count + 1) <= g_cap) return KILN_OK;
    size_t cap = g_cap ? 2 * g_cap : 64;
    handle_entry *t = kiln_calloc(cap, sizeof *t);
    if (!t) return kiln_error(KILN_ERR_NOMEM, "%s: out of memory (handle table of %zu entries)", fn, cap);
    for (size_t i = 0; i < g_cap; i++)
        if (g_table[i].addr) place(t, cap, g_table[i]);
    kiln_free(g_table);
    g_table = t;
    g_cap = cap;
    return KILN_OK;
}

/* Remove entry e, shifting later entries of its probe run back (so lookups need no
 * tombstones); the table goes with the last entry. Lock held. */
static void erase(handle_entry *e) {
    size_t i = (size_t)(e - g_table);
    for (size_t j = (i + 1) & (g_cap - 1); g_table[j].addr; j = (j + 1) & (g_cap - 1)) {
        size_t home = slot_of(g_table[j].addr, g_cap);
        /* j's entry may move to i when its home is not in the cyclic range (i, j] */
        if (((j - home) & (g_cap - 1)) >= ((j - i) & (g_cap - 1))) {
            g_table[i] = g_table[j];
            i = j;
        }
    }
    g_table[i] = (handle_entry){0};
    if (--g_count == 0) {
        kiln_free(g_table);
        g_table = NULL;
        g_cap = 0;
    }
}

kiln_status kiln_handle_register(kiln_handle_head *h, kiln_handle_kind kind, const char *fn) {
    if (!h || kind <= 0 || kind >= KILN_HANDLE_KIND_COUNT)
        return kiln_error(KILN_ERR_PANIC, "%s: registering an invalid handle (kind %d)", fn, (int)kind);
    pthread_mutex_lock(&g_lock);
    kiln_status st = KILN_OK;
    if (find((uintptr_t)h))
        st = kiln_error(KILN_ERR_PANIC, "%s: %s %p is registered already", fn, kinds[kind].name, (void *)h);
    if (st == KILN_OK) st = reserve_one(fn);
    if (st == KILN_OK) {
        h->magic = kinds[kind].magic;
        h->kind = (uint32_t)kind;
        place(g_table, g_cap, (handle_entry){(uintptr_t)h, (uint32_t)kind, 0});
        g_count++;
    }
    pthread_mutex_unlock(&g_lock);
    return st;
}

/* The live entry of h as kind, or NULL with the error set. Lock held. */
static handle_entry *lookup(const void *h, kiln_handle_kind kind, const char *fn, kiln_status *st) {
    const char *name = kiln_handle_kind_name(kind);
    if (!h) {
        *st = kiln_error(KILN_ERR_INVALID_ARG, "%s: the %s is NULL", fn, name);
        return NULL;
    }
    handle_entry *e = find((uintptr_t)h);
    if (!e) {
        *st = kiln_error(KILN_ERR_BAD_HANDLE,
                         "%s: %p is not a live %s (freed already, or never made by kiln)", fn, h, name);
        return NULL;
    }
    if (e->kind != (uint32_t)kind) {
        *st = kiln_error(KILN_ERR_BAD_HANDLE, "%s: %p is a %s, not a %s", fn, h,
                         kiln_handle_kind_name((kiln_handle_kind)e->kind), name);
        return NULL;
    }
    /* registered, so live memory: the head may be read */
    const kiln_handle_head *head = h;
    if (head->magic != kinds[kind].magic || head->kind != (uint32_t)kind) {
        *st = kiln_error(KILN_ERR_PANIC,
                         "%s: the %s at %p has a damaged header (magic 0x%08x, want 0x%08x): its memory "
                         "was overwritten", fn, name, h, (unsigned)head->magic, (unsigned)kinds[kind].magic);
        return NULL;
    }
    *st = KILN_OK;
    return e;
}

kiln_status kiln_handle_check(const void *h, kiln_handle_kind kind, const char *fn) {
    kiln_status st;
    pthread_mutex_lock(&g_lock);
    (void)lookup(h, kind, fn, &st);
    pthread_mutex_unlock(&g_lock);
    return st;
}

kiln_status kiln_handle_acquire(const void *h, kiln_handle_kind kind, const char *fn) {
    kiln_status st;
    pthread_mutex_lock(&g_lock);
    handle_entry *e = lookup(h, kind, fn, &st);
    if (e && e->users == UINT32_MAX) {
        st = kiln_error(KILN_ERR_RANGE, "%s: the %s has %u users already", fn, kiln_handle_kind_name(kind),
                        (unsigned)e->users);
    } else if (e) {
        e->users++;
    }
    pthread_mutex_unlock(&g_lock);
    return st;
}

void kiln_handle_release(const void *h, const char *fn) {
    if (!h) return;
    pthread_mutex_lock(&g_lock);
    handle_entry *e = find((uintptr_t)h);
    if (!e || e->users == 0)
        kiln_error(KILN_ERR_PANIC, "%s: releasing a user of %p, which has none", fn, h);
    else
        e->users--;
    pthread_mutex_unlock(&g_lock);
}

kiln_status kiln_handle_sole_user(const void *h, kiln_handle_kind kind, const char *fn) {
    kiln_status st;
    pthread_mutex_lock(&g_lock);
    handle_entry *e = lookup(h, kind, fn, &st);
    if (e && e->users != 1)
        st = kiln_error(KILN_ERR_STATE, "%s: the %s has %u users, not one", fn, kiln_handle_kind_name(kind),
                        (unsigned)e->users);
    pthread_mutex_unlock(&g_lock);
    return st;
}

kiln_status kiln_handle_unregister(kiln_handle_head *h, kiln_handle_kind kind, const char *fn) {
    kiln_status st;
    pthread_mutex_lock(&g_lock);
    handle_entry *e = lookup(h, kind, fn, &st);
    if (e && e->users > 0) {
        st = kiln_error(KILN_ERR_STATE, "%s: the %s still has %u user%s (free them first)", fn,
                        kiln_handle_kind_name(kind), (unsigned)e->users, e->users == 1 ? "" : "s");
    } else if (e) {
        erase(e);
        h->magic = KILN_HANDLE_DEAD;
    }
    pthread_mutex_unlock(&g_lock);
    return st;
}

size_t kiln_handle_count(void) {
    pthread_mutex_lock(&g_lock);
    size_t n = g_count;
    pthread_mutex_unlock(&g_lock);
    return n;
}
