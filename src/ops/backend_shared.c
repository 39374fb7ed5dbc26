/*
 * backend_shared.c -- one backend per device and arithmetic per process, shared by every
 * engine that uses it (contexts, trainers, losses; a teacher and a student), reference
 * counted (ops.h kiln_backend_acquire).
 *
 * Sharing a device backend shares its weight cache, stream and workspaces: a teacher's and a
 * student's forwards on one GPU hold one copy of each weight and run in order on one stream.
 * A backend that a GPU failure has poisoned is not handed to new engines (they get a fresh
 * one); its current users keep seeing the error, as the poisoning contract says.
 */
#include "ops.h"
#include "mx.h"

#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

typedef struct shared_backend {
    struct shared_backend *next;
    kiln_backend *be;
    int device, mode, n_threads;
    kiln_weight_format *formats; /* the per-weight formats it was made with (n_formats; a copy) */
    int n_formats;
    int refs;
} shared_backend;

static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;
static shared_backend *g_shared;

kiln_status kiln_backend_mode_of(int device, int fast, int batch_invariant, int format, const char *who,
                                 int *mode) {
    if (format < KILN_FORMAT_F32 || format > KILN_FORMAT_MX8)
        return kiln_error(KILN_ERR_INVALID_ARG, "%s: format %d is not f32 (0), mx16 (1) or mx8 (2)", who, format);
    if (format != KILN_FORMAT_F32) {
        if (fast)
            return kiln_error(KILN_ERR_INVALID_ARG, "%s: the exact formats (mx16, mx8) are an auditable arithmetic: "
                              "not with fast", who);
        *mode = format == KILN_FORMAT_MX16 ? KILN_MODE_MX16 : KILN_MODE_MX8;
        return KILN_OK;
    }
    *mode = fast ? (batch_invariant ? KILN_MODE_FAST_INVARIANT : KILN_MODE_FAST) : KILN_MODE_AUDITABLE;
    return KILN_OK;
}

static int by_data(const void *a, const void *b) {
    const uintptr_t x = (uintptr_t)((const kiln_weight_format *)a)->data, y = (uintptr_t)((const kiln_weight_format *)b)->data;
    return x < y ? -1 : x > y;
}

kiln_status kiln_weight_formats_sort(kiln_weight_formats *t, const char *who) {
    if (!t || t->n <= 1) return KILN_OK;
    qsort(t->e, (size_t)t->n, sizeof *t->e, by_data);
    int n = 1;
    for (int i = 1; i < t->n; i++) {
        kiln_weight_format *p = &t->e[n - 1], *q = &t->e[i];
        if ((uintptr_t)q->data < (uintptr_t)p->data + p->nbytes) {
            if (q->data == p->data && q->nbytes == p->nbytes && q->format == p->format) continue;
            return kiln_error(KILN_ERR_INVALID_ARG, "%s: two weights share memory but were given different formats", who);
        }
        t->e[n++] = *q;
    }
    t->n = n;
    return KILN_OK;
}

int kiln_weight_formats_find(const kiln_weight_formats *t, const void *data, int dflt) {
    if (!t || !t->n) return dflt;
    const uintptr_t a = (uintptr_t)data;
    int lo = 0, hi = t->n; /* the last entry whose start is <= a */
    while (hi - lo > 1) {
        int mid = (lo + hi) / 2;
        if ((uintptr_t)t->e[mid].data <= a) lo = mid;
        else hi = mid;
    }
    const kiln_weight_format *e = &t->e[lo];
    return (uintptr_t)e->data <= a && a < (uintptr_t)e->data + e->nbytes ? e->format : dflt;
}

int kiln_weight_formats_kind(const kiln_weight_formats *t, const void *data, int mode_kind) {
    const int f = kiln_weight_formats_find(t, data, -1);
    return f < 0 ? mode_kind : f == KILN_FORMAT_MX16 ? KILN_MX16 : f == KILN_FORMAT_MX8 ? KILN_MX8 : 0;
}

static int same_formats(const shared_backend *s, const kiln_weight_formats *t) {
    const int n = t ? t->n : 0;
    return s->n_formats == n && (!n || !memcmp(s->formats, t->e, (size_t)n * sizeof *t->e));
}

kiln_status kiln_backend_acquire(int device, int mode, int n_threads, kiln_backend **out) {
    return kiln_backend_acquire_formats(device, mode, n_threads, NULL, out);
}

kiln_status kiln_backend_acquire_formats(int device, int mode, int n_threads, const kiln_weight_formats *t,
                                         kiln_backend **out) {
    if (!out) return kiln_error(KILN_ERR_INVALID_ARG, "kiln_backend_acquire: out is NULL");
    if (t && !t->n) t = NULL;
    *out = NULL;
    if (device < -1)
        return kiln_error(KILN_ERR_INVALID_ARG, "kiln_backend_acquire: device %d: use -1 (CPU) or a CUDA device index >= 0",
                          device);
    if (device >= 0) n_threads = 0; /* a GPU's backend has no thread pool of its own */
    else if (n_threads <= 0) n_threads = kiln_cpu_count();
    if (mode < 0 || mode > KILN_MODE_MX8)
        return kiln_error(KILN_ERR_INVALID_ARG, "kiln_backend_acquire: mode %d not in [0, %d]", mode, KILN_MODE_MX8);
    if (t && (mode == KILN_MODE_FAST || mode == KILN_MODE_FAST_INVARIANT))
        return kiln_error(KILN_ERR_INVALID_ARG, "kiln_backend_acquire: formats per weight are an auditable arithmetic: not with fast");
    pthread_mutex_lock(&g_lock);
    for (shared_backend *s = g_shared; s; s = s->next) {
        if (s->device != device || s->mode != mode || s->n_threads != n_threads || !same_formats(s, t)) continue;
        if (kiln_backend_poll(s->be) != KILN_OK) continue; /* poisoned: its users keep it */
        s->refs++;
        *out = s->be;
        pthread_mutex_unlock(&g_lock);
        return KILN_OK;
    }
    shared_backend *s = kiln_calloc(1, sizeof *s);
    kiln_status st = s ? KILN_OK : kiln_error(KILN_ERR_NOMEM, "kiln_backend_acquire: out of memory");
    if (st == KILN_OK && t) {
        s->formats = kiln_malloc((size_t)t->n * sizeof *t->e);
        if (s->formats) {
            memcpy(s->formats, t->e, (size_t)t->n * sizeof *t->e);
            s->n_formats = t->n;
        } else {
            st = kiln_error(KILN_ERR_NOMEM, "kiln_backend_acquire: out of memory");
        }
    }
    if (st == KILN_OK)
        st = device >= 0 ? kiln_backend_cuda_create_formats(device, mode, t, &s->be)
                         : kiln_backend_cpu_create_formats(n_threads, mode, t, &s->be);
    if (st == KILN_OK) {
        s->device = device;
        s->mode = mode;
        s->n_threads = n_threads;
        s->refs = 1;
        s->next = g_shared;
        g_shared = s;
        *out = s->be;
    } else if (s) {
        kiln_free(s->formats);
        kiln_free(s);
    }
    pthread_mutex_unlock(&g_lock);
    return st;
}

void kiln_backend_release(kiln_backend *be) {
    if (!be) return;
    pthread_mutex_lock(&g_lock);
    for (shared_backend **p = &g_shared; *p; p = &(*p)->next) {
        shared_backend *s = *p;
        if (s->be != be) continue;
        if (--s->refs == 0) {
            *p = s->next;
            kiln_backend_free(s->be);
            kiln_free(s->formats);
            kiln_free(s);
        }
        pthread_mutex_unlock(&g_lock);
        return;
    }
    pthread_mutex_unlock(&g_lock);
    kiln_backend_free(be); /* not shared: its own */
}

kiln_status kiln_device_memory(int device, uint64_t *free_bytes, uint64_t *total_bytes) {
    if (!free_bytes || !total_bytes) return kiln_error(KILN_ERR_INVALID_ARG, "kiln_device_memory: NULL argument");
    if (device < -1) return kiln_error(KILN_ERR_INVALID_ARG, "kiln_device_memory: device %d", device);
    if (device >= 0) return kiln_cuda_device_memory(device, free_bytes, total_bytes);
    long page = sysconf(_SC_PAGESIZE), avail = sysconf(_SC_AVPHYS_PAGES), phys = sysconf(_SC_PHYS_PAGES);
    if (page <= 0 || avail < 0 || phys <= 0) return kiln_error(KILN_ERR_UNSUPPORTED, "kiln_device_memory: host memory unknown");
    *free_bytes = (uint64_t)avail * (uint64_t)page;
    *total_bytes = (uint64_t)phys * (uint64_t)page;
    return KILN_OK;
}

void kiln_backends_forget(const void *host, size_t nbytes) {
    pthread_mutex_lock(&g_lock);
    for (shared_backend *s = g_shared; s; s = s->next)
        if (s->be->i->forget) s->be->i->forget(s->be, host, nbytes);
    pthread_mutex_unlock(&g_lock);
}

int kiln_backend_poisoned(void) {
    char keep[1024]; /* a query: the thread's last error message stays as it was */
    snprintf(keep, sizeof keep, "%s", kiln_last_error());
    int n = 0;
    pthread_mutex_lock(&g_lock);
    for (shared_backend *s = g_shared; s; s = s->next)
        if (kiln_backend_poll(s->be) != KILN_OK) n++;
    pthread_mutex_unlock(&g_lock);
    kiln_error(KILN_OK, "%s", keep);
    return n;
}
