/*
 * comm_nccl.c -- the communicator of GPU ranks (built with CUDA and NCCL's header): NCCL moves
 * the bytes, kiln adds them (docs/DISTRIBUTED.md, "GPU ranks").
 *
 * NCCL is loaded at run time (dlopen of KILN_NCCL_LIBRARY, else libnccl.so.2), so libkiln
 * starts on a machine without it and a GPU run names what is missing. NCCL moves bytes only
 * (ncclUint8): like the MPI implementation, kiln never asks it to add (its ring and tree orders
 * depend on the topology); the reductions exchange the blocks and a kernel adds them in rank
 * order from +0 (comm_nccl_sum.cu), the bits of comm.c's host sum.
 *
 * Streams: every collective is queued on the communicator's stream (kiln_comm_set_stream: the
 * trainer gives its backend's, so the collectives are ordered with its kernels and nothing waits
 * on the host); with device buffers an entry returns once queued. Host buffers (the small
 * things: a loss, a norm's lane state, a checkpoint's hashes) are copied to a device bounce
 * buffer, moved, copied back and waited for.
 *
 * The algorithms: allgather and broadcast are NCCL's (in place allowed); alltoall and gather are
 * grouped ncclSend/ncclRecv pairs (a rank's own block copied on the stream); reduce_scatter_f32
 * = alltoall into the device scratch + the sum; reduce_f32 = gather to root + the sum;
 * allreduce_f64 (host doubles) is comm.c's composition over the allgather.
 *
 * Errors: an NCCL call's failure is KILN_ERR_IO with ncclGetErrorString and ncclGetLastError's
 * text; its asynchronous errors (a peer gone) are read before every collective
 * (ncclCommGetAsyncError). comm.c then marks the communicator failed; close aborts the NCCL
 * communicator (ncclCommAbort) instead of waiting for peers that may never come.
 */
#define _DEFAULT_SOURCE
#include "comm_impl.h"

#include <cuda_runtime_api.h>
#include <dlfcn.h>
#include <nccl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int kiln_nccl_rank_order_sum_f32(void *stream, float *out, const float *blocks, int n_ranks, size_t n);

/* ---- the library, loaded once ---------------------------------------------------------------- */

typedef struct nccl_api {
    void *handle;
    ncclResult_t (*GetVersion)(int *);
    ncclResult_t (*GetUniqueId)(ncclUniqueId *);
    ncclResult_t (*CommInitRank)(ncclComm_t *, int, ncclUniqueId, int);
    ncclResult_t (*CommDestroy)(ncclComm_t);
    ncclResult_t (*CommAbort)(ncclComm_t);
    ncclResult_t (*CommGetAsyncError)(ncclComm_t, ncclResult_t *);
    const char *(*GetErrorString)(ncclResult_t);
    const char *(*GetLastError)(ncclComm_t);
    ncclResult_t (*Broadcast)(const void *, void *, size_t, ncclDataType_t, int, ncclComm_t, cudaStream_t);
    ncclResult_t (*AllGather)(const void *, void *, size_t, ncclDataType_t, ncclComm_t, cudaStream_t);
    ncclResult_t (*Send)(const void *, size_t, ncclDataType_t, int, ncclComm_t, cudaStream_t);
    ncclResult_t (*Recv)(void *, size_t, ncclDataType_t, int, ncclComm_t, cudaStream_t);
    ncclResult_t (*GroupStart)(void);
    ncclResult_t (*GroupEnd)(void);
    char path[256];
    int version;
} nccl_api;

static nccl_api g_nccl;
static pthread_mutex_t g_nccl_lock = PTHREAD_MUTEX_INITIALIZER;

static kiln_status load_nccl(void) {
    kiln_status st = KILN_OK;
    pthread_mutex_lock(&g_nccl_lock);
    if (g_nccl.handle) goto out;
    const char *env = getenv("KILN_NCCL_LIBRARY");
    const char *tries[3] = {env && *env ? env : NULL, "libnccl.so.2", "libnccl.so"};
    void *h = NULL;
    const char *used = NULL, *why = "not found";
    for (int i = 0; i < 3 && !h; i++) {
        if (!tries[i]) continue;
        h = dlopen(tries[i], RTLD_NOW | RTLD_LOCAL);
        if (h) used = tries[i];
        else if (dlerror()) why = env && *env ? "KILN_NCCL_LIBRARY could not be loaded" : "not found";
    }
    if (!h) {
        st = kiln_error(KILN_ERR_UNSUPPORTED,
                        "kiln_comm_open_nccl: NCCL's library (libnccl.so.2) %s: install NCCL (the CUDA "
                        "toolkit's, libnccl2, or PyTorch's nvidia-nccl wheel) and put its folder on "
                        "LD_LIBRARY_PATH, or name the file in KILN_NCCL_LIBRARY", why);
        goto out;
    }
    nccl_api a = {0};
    a.handle = h;
#define SYM(field, name)                                                                             \
    do {                                                                                             \
        *(void **)(&a.field) = dlsym(h, name);                                                       \
        if (!a.field && st == KILN_OK)                                                               \
            st = kiln_error(KILN_ERR_UNSUPPORTED, "kiln_comm_open_nccl: %s has no %s (NCCL 2.7 or "    \
                            "later is needed)", used, name);                                         \
    } while (0)
    SYM(GetVersion, "ncclGetVersion");
    SYM(GetUniqueId, "ncclGetUniqueId");
    SYM(CommInitRank, "ncclCommInitRank");
    SYM(CommDestroy, "ncclCommDestroy");
    SYM(CommAbort, "ncclCommAbort");
    SYM(CommGetAsyncError, "ncclCommGetAsyncError");
    SYM(GetErrorString, "ncclGetErrorString");
    SYM(Broadcast, "ncclBroadcast");
    SYM(AllGather, "ncclAllGather");
    SYM(Send, "ncclSend");
    SYM(Recv, "ncclRecv");
    SYM(GroupStart, "ncclGroupStart");
    SYM(GroupEnd, "ncclGroupEnd");
#undef SYM
    *(void **)(&a.GetLastError) = dlsym(h, "ncclGetLastError"); /* NCCL 2.13+; optional */
    if (st != KILN_OK) {
        dlclose(h);
        goto out;
    }
    snprintf(a.path, sizeof a.path, "%s", used);
    a.GetVersion(&a.version);
    g_nccl = a; /* never unloaded: NCCL keeps threads and state past its last communicator */
out:
    pthread_mutex_unlock(&g_nccl_lock);
    return st;
}

/* ---- the state ------------------------------------------------------------------------------- */

typedef struct nccl_state {
    ncclComm_t comm;
    int device;
    cudaStream_t stream;     /* the stream collectives are queued on */
    cudaStream_t own_stream; /* the communicator's own (used when none is set) */
    void *scratch;           /* device scratch of the reductions: (size, n) floats */
    size_t scratch_bytes;
    void *bounce;            /* device copy of host buffers */
    size_t bounce_bytes;
    kiln_comm *boot;         /* the MPI communicator that shared the id (mpirun), or NULL */
    int failed;              /* an NCCL call failed: close aborts instead of destroying */
} nccl_state;

static nccl_state *state_of(kiln_comm *c) { return c->impl_state; }

static kiln_status nccl_fail(nccl_state *s, ncclResult_t rc, const char *what) {
    s->failed = 1;
    const char *last = g_nccl.GetLastError && s->comm ? g_nccl.GetLastError(s->comm) : NULL;
    return kiln_error(KILN_ERR_IO, "%s failed: %s%s%s (NCCL error %d)", what, g_nccl.GetErrorString(rc),
                      last && *last ? ": " : "", last && *last ? last : "", (int)rc);
}

static kiln_status cuda_fail(nccl_state *s, cudaError_t e, const char *what) {
    s->failed = 1;
    (void)cudaGetLastError();
    return kiln_error(KILN_ERR_IO, "%s failed on CUDA device %d: %s", what, s->device, cudaGetErrorString(e));
}

#define NCCL_TRY(s, call, what)                                                                      \
    do {                                                                                             \
        ncclResult_t rc_ = (call);                                                                   \
        if (rc_ != ncclSuccess) return nccl_fail((s), rc_, (what));                                  \
    } while (0)
#define CUDA_TRY(s, call, what)                                                                      \
    do {                                                                                             \
        cudaError_t e_ = (call);                                                                     \
        if (e_ != cudaSuccess) return cuda_fail((s), e_, (what));                                    \
    } while (0)

/* The device current and no asynchronous NCCL error pending (a peer failed or vanished). */
static kiln_status enter(nccl_state *s) {
    CUDA_TRY(s, cudaSetDevice(s->device), "cudaSetDevice");
    ncclResult_t ae = ncclSuccess;
    NCCL_TRY(s, g_nccl.CommGetAsyncError(s->comm, &ae), "ncclCommGetAsyncError");
    if (ae != ncclSuccess && ae != ncclInProgress) return nccl_fail(s, ae, "an earlier NCCL collective");
    return KILN_OK;
}

/* 1: p is host memory (pageable or pinned) that the collectives must stage. */
static int is_host(const void *p) {
    struct cudaPointerAttributes a;
    if (cudaPointerGetAttributes(&a, p) != cudaSuccess) {
        (void)cudaGetLastError();
        return 1;
    }
    return a.type != cudaMemoryTypeDevice && a.type != cudaMemoryTypeManaged;
}

static kiln_status reserve(nccl_state *s, void **buf, size_t *cap, size_t need, const char *what) {
    if (*cap >= need) return KILN_OK;
    if (*buf) {
        CUDA_TRY(s, cudaStreamSynchronize(s->stream), "cudaStreamSynchronize");
        cudaFree(*buf);
    }
    *buf = NULL;
    *cap = 0;
    cudaError_t e = cudaMalloc(buf, need);
    if (e != cudaSuccess) {
        (void)cudaGetLastError();
        *buf = NULL;
        return kiln_error(KILN_ERR_NOMEM, "out of device memory for the nccl communicator's %s (%zu bytes on device "
                                          "%d): %s", what, need, s->device, cudaGetErrorString(e));
    }
    *cap = need;
    return KILN_OK;
}

/* ---- the entries -------------------------------------------------------------------------------- */

static kiln_status nc_allgather_dev(nccl_state *s, void *recv, const void *send, size_t nbytes) {
    NCCL_TRY(s, g_nccl.AllGather(send, recv, nbytes, ncclUint8, s->comm, s->stream), "ncclAllGather");
    return KILN_OK;
}

/* Block k of send (nbytes each) to rank k, into block (this rank) of k's recv; with gather_root
 * >= 0 only rank gather_root receives (and each rank sends its single block). */
static kiln_status nc_exchange_dev(kiln_comm *c, void *recv, const void *send, size_t nbytes, int gather_root) {
    nccl_state *s = state_of(c);
    const uint8_t *sp = send;
    uint8_t *rp = recv;
    NCCL_TRY(s, g_nccl.GroupStart(), "ncclGroupStart");
    ncclResult_t rc = ncclSuccess;
    const char *what = "ncclSend";
    for (int k = 0; k < c->size && rc == ncclSuccess; k++) {
        if (gather_root >= 0) {
            if (k != c->rank && c->rank != gather_root) continue;
            if (k == c->rank && c->rank != gather_root) {
                rc = g_nccl.Send(sp, nbytes, ncclUint8, gather_root, s->comm, s->stream);
                continue;
            }
            if (k == c->rank) continue; /* root's own block: a copy below */
            what = "ncclRecv";
            rc = g_nccl.Recv(rp + (size_t)k * nbytes, nbytes, ncclUint8, k, s->comm, s->stream);
            continue;
        }
        if (k == c->rank) continue;
        what = "ncclSend";
        rc = g_nccl.Send(sp + (size_t)k * nbytes, nbytes, ncclUint8, k, s->comm, s->stream);
        if (rc == ncclSuccess) {
            what = "ncclRecv";
            rc = g_nccl.Recv(rp + (size_t)k * nbytes, nbytes, ncclUint8, k, s->comm, s->stream);
        }
    }
    ncclResult_t rc2 = g_nccl.GroupEnd();
    if (rc != ncclSuccess) return nccl_fail(s, rc, what);
    if (rc2 != ncclSuccess) return nccl_fail(s, rc2, "ncclGroupEnd");
    if (gather_root < 0)
        CUDA_TRY(s, cudaMemcpyAsync(rp + (size_t)c->rank * nbytes, sp + (size_t)c->rank * nbytes, nbytes,
                                    cudaMemcpyDeviceToDevice, s->stream), "cudaMemcpyAsync (own block)");
    else if (c->rank == gather_root)
        CUDA_TRY(s, cudaMemcpyAsync(rp + (size_t)c->rank * nbytes, sp, nbytes, cudaMemcpyDeviceToDevice, s->stream),
                 "cudaMemcpyAsync (own block)");
    return KILN_OK;
}

/* Host buffers through the bounce: [0, in) <- in_src, run, out_dst <- [out_off, out_off + out). */
static kiln_status bounce_in(nccl_state *s, size_t at, const void *src, size_t n) {
    if (n) CUDA_TRY(s, cudaMemcpyAsync((uint8_t *)s->bounce + at, src, n, cudaMemcpyHostToDevice, s->stream),
                    "cudaMemcpyAsync (host buffer to the device)");
    return KILN_OK;
}
static kiln_status bounce_out(nccl_state *s, void *dst, size_t at, size_t n) {
    if (n) CUDA_TRY(s, cudaMemcpyAsync(dst, (uint8_t *)s->bounce + at, n, cudaMemcpyDeviceToHost, s->stream),
                    "cudaMemcpyAsync (device to the host buffer)");
    CUDA_TRY(s, cudaStreamSynchronize(s->stream), "cudaStreamSynchronize");
    return KILN_OK;
}

static kiln_status nc_barrier(kiln_comm *c) {
    nccl_state *s = state_of(c);
    KILN_TRY(enter(s));
    KILN_TRY(reserve(s, &s->bounce, &s->bounce_bytes, (size_t)c->size, "bounce buffer"));
    KILN_TRY(nc_allgather_dev(s, s->bounce, (uint8_t *)s->bounce + c->rank, 1));
    CUDA_TRY(s, cudaStreamSynchronize(s->stream), "cudaStreamSynchronize (barrier)");
    return KILN_OK;
}

static kiln_status nc_broadcast(kiln_comm *c, void *buf, size_t nbytes, int root) {
    nccl_state *s = state_of(c);
    KILN_TRY(enter(s));
    if (!is_host(buf)) {
        NCCL_TRY(s, g_nccl.Broadcast(buf, buf, nbytes, ncclUint8, root, s->comm, s->stream), "ncclBroadcast");
        return KILN_OK;
    }
    KILN_TRY(reserve(s, &s->bounce, &s->bounce_bytes, nbytes, "bounce buffer"));
    KILN_TRY(bounce_in(s, 0, buf, c->rank == root ? nbytes : 0));
    NCCL_TRY(s, g_nccl.Broadcast(s->bounce, s->bounce, nbytes, ncclUint8, root, s->comm, s->stream), "ncclBroadcast");
    return bounce_out(s, buf, 0, nbytes);
}

static kiln_status nc_allgather(kiln_comm *c, void *recv, const void *send, size_t nbytes) {
    nccl_state *s = state_of(c);
    KILN_TRY(enter(s));
    const size_t total = nbytes * (size_t)c->size;
    const int host_recv = is_host(recv), host_send = is_host(send); /* each asked once */
    if (!host_recv && !host_send) return nc_allgather_dev(s, recv, send, nbytes);
    KILN_TRY(reserve(s, &s->bounce, &s->bounce_bytes, total, "bounce buffer"));
    const size_t own = (size_t)c->rank * nbytes;
    if (host_send) {
        KILN_TRY(bounce_in(s, own, send, nbytes));
    } else {
        CUDA_TRY(s, cudaMemcpyAsync((uint8_t *)s->bounce + own, send, nbytes, cudaMemcpyDeviceToDevice, s->stream),
                 "cudaMemcpyAsync");
    }
    KILN_TRY(nc_allgather_dev(s, s->bounce, (uint8_t *)s->bounce + own, nbytes));
    if (host_recv) return bounce_out(s, recv, 0, total);
    CUDA_TRY(s, cudaMemcpyAsync(recv, s->bounce, total, cudaMemcpyDeviceToDevice, s->stream), "cudaMemcpyAsync");
    return KILN_OK;
}

/* Host send/recv through the bounce (send at 0, recv after it): the device exchange between them. */
static kiln_status nc_exchange(kiln_comm *c, void *recv, const void *send, size_t nbytes, int gather_root) {
    nccl_state *s = state_of(c);
    KILN_TRY(enter(s));
    const size_t all = nbytes * (size_t)c->size, send_bytes = gather_root >= 0 ? nbytes : all;
    const int recv_here = gather_root < 0 || c->rank == gather_root;
    const int host_send = is_host(send), host_recv = recv_here && is_host(recv); /* each asked once */
    if (!host_send && !host_recv) return nc_exchange_dev(c, recv, send, nbytes, gather_root);
    KILN_TRY(reserve(s, &s->bounce, &s->bounce_bytes, send_bytes + all, "bounce buffer"));
    uint8_t *dsend = s->bounce, *drecv = (uint8_t *)s->bounce + send_bytes;
    if (host_send) {
        KILN_TRY(bounce_in(s, 0, send, send_bytes));
    } else {
        CUDA_TRY(s, cudaMemcpyAsync(dsend, send, send_bytes, cudaMemcpyDeviceToDevice, s->stream), "cudaMemcpyAsync");
    }
    KILN_TRY(nc_exchange_dev(c, drecv, dsend, nbytes, gather_root));
    if (!recv_here) {
        CUDA_TRY(s, cudaStreamSynchronize(s->stream), "cudaStreamSynchronize");
        return KILN_OK;
    }
    if (host_recv) return bounce_out(s, recv, send_bytes, all);
    CUDA_TRY(s, cudaMemcpyAsync(recv, drecv, all, cudaMemcpyDeviceToDevice, s->stream), "cudaMemcpyAsync");
    return KILN_OK;
}

static kiln_status nc_alltoall(kiln_comm *c, void *recv, const void *send, size_t nbytes) {
    return nc_exchange(c, recv, send, nbytes, -1);
}

static kiln_status nc_gather(kiln_comm *c, void *recv, const void *send, size_t nbytes, int root) {
    return nc_exchange(c, recv, send, nbytes, root);
}

/* The blocks in the scratch summed in rank order into out (device, or host: copied back). */
static kiln_status sum_into(kiln_comm *c, float *out, size_t n) {
    nccl_state *s = state_of(c);
    const int host = is_host(out);
    float *dst = out;
    if (host) {
        KILN_TRY(reserve(s, &s->bounce, &s->bounce_bytes, n * sizeof(float), "bounce buffer"));
        dst = s->bounce;
    }
    int e = kiln_nccl_rank_order_sum_f32(s->stream, dst, s->scratch, c->size, n);
    if (e) return cuda_fail(s, (cudaError_t)e, "the rank-order sum kernel");
    return host ? bounce_out(s, out, 0, n * sizeof(float)) : KILN_OK;
}

static kiln_status nc_reduce_scatter_f32(kiln_comm *c, float *recv, const float *send, size_t n) {
    nccl_state *s = state_of(c);
    KILN_TRY(enter(s));
    const size_t all = n * sizeof(float) * (size_t)c->size;
    KILN_TRY(reserve(s, &s->scratch, &s->scratch_bytes, all, "reduction scratch"));
    KILN_TRY(nc_exchange(c, s->scratch, send, n * sizeof(float), -1));
    return sum_into(c, recv, n);
}

static kiln_status nc_reduce_f32(kiln_comm *c, float *recv, const float *send, size_t n, int root) {
    nccl_state *s = state_of(c);
    KILN_TRY(enter(s));
    const size_t all = n * sizeof(float) * (size_t)c->size;
    KILN_TRY(reserve(s, &s->scratch, &s->scratch_bytes, all, "reduction scratch"));
    KILN_TRY(nc_exchange(c, s->scratch, send, n * sizeof(float), root));
    return c->rank == root ? sum_into(c, recv, n) : KILN_OK;
}

static kiln_status nc_set_stream(kiln_comm *c, void *stream) {
    nccl_state *s = state_of(c);
    cudaStream_t next = stream ? (cudaStream_t)stream : s->own_stream;
    if (next != s->stream) {
        /* what was queued on the old stream finishes before the new one's work begins */
        CUDA_TRY(s, cudaSetDevice(s->device), "cudaSetDevice");
        CUDA_TRY(s, cudaStreamSynchronize(s->stream), "cudaStreamSynchronize");
        s->stream = next;
    }
    return KILN_OK;
}

static int nc_device(const kiln_comm *c) { return ((const nccl_state *)c->impl_state)->device; }

static void nc_close(kiln_comm *c) {
    nccl_state *s = state_of(c);
    if (!s) return;
    cudaSetDevice(s->device);
    if (s->comm) {
        if (s->failed || c->failed)
            g_nccl.CommAbort(s->comm); /* peers may be gone: do not wait for them */
        else {
            cudaStreamSynchronize(s->stream);
            g_nccl.CommDestroy(s->comm);
        }
    }
    if (s->scratch) cudaFree(s->scratch);
    if (s->bounce) cudaFree(s->bounce);
    if (s->own_stream) cudaStreamDestroy(s->own_stream);
    (void)cudaGetLastError();
    kiln_comm_close(s->boot);
    kiln_free(s);
    c->impl_state = NULL;
}

static const kiln_comm_i nccl_impl = {
    .name = "nccl",
    .host_memory = 0,
    .barrier = nc_barrier,
    .broadcast = nc_broadcast,
    .allgather = nc_allgather,
    .alltoall = nc_alltoall,
    .gather = nc_gather,
    .reduce_scatter_f32 = nc_reduce_scatter_f32,
    .reduce_f32 = nc_reduce_f32,
    .allreduce_f64 = NULL, /* host doubles: comm.c's composition over the allgather */
    .close = nc_close,
    .set_stream = nc_set_stream,
    .device = nc_device,
};

/* ---- open ----------------------------------------------------------------------------------- */

kiln_status kiln_comm_nccl_open(kiln_comm *c, const kiln_comm_launch *launch, int device, kiln_comm *boot) {
    kiln_status st = load_nccl();
    nccl_state *s = NULL;
    if (st != KILN_OK) goto fail;
    int n_dev = 0;
    cudaError_t e = cudaGetDeviceCount(&n_dev);
    if (e != cudaSuccess || device < 0 || device >= n_dev) {
        (void)cudaGetLastError();
        st = kiln_error(KILN_ERR_UNSUPPORTED, "kiln_comm_open_nccl: no CUDA device %d (%d present%s%s)", device,
                        e == cudaSuccess ? n_dev : 0, e == cudaSuccess ? "" : ": ",
                        e == cudaSuccess ? "" : cudaGetErrorString(e));
        goto fail;
    }
    s = kiln_calloc(1, sizeof *s);
    if (!s) {
        st = kiln_error(KILN_ERR_NOMEM, "kiln_comm_open_nccl: out of memory");
        goto fail;
    }
    s->device = device;
    s->boot = boot;
    boot = NULL;
    int rank = 0, size = 1, local = 0;
    if (s->boot) {
        rank = kiln_comm_rank(s->boot);
        size = kiln_comm_size(s->boot);
        local = kiln_comm_local_rank(s->boot);
    } else if (launch->kind == KILN_COMM_LAUNCH_TORCHRUN) {
        rank = launch->rank;
        size = launch->size;
        local = launch->local_rank;
    }
    e = cudaSetDevice(device);
    if (e == cudaSuccess) e = cudaStreamCreateWithFlags(&s->own_stream, cudaStreamNonBlocking);
    if (e != cudaSuccess) {
        st = cuda_fail(s, e, "kiln_comm_open_nccl: the communicator's stream");
        goto fail;
    }
    s->stream = s->own_stream;
    ncclUniqueId id;
    memset(&id, 0, sizeof id);
    ncclResult_t rc = rank == 0 ? g_nccl.GetUniqueId(&id) : ncclSuccess;
    if (rc != ncclSuccess) {
        st = nccl_fail(s, rc, "kiln_comm_open_nccl: ncclGetUniqueId");
        goto fail;
    }
    if (size > 1 && s->boot) {
        st = kiln_comm_broadcast(s->boot, &id, sizeof id, 0);
    } else if (size > 1) {
        int timeout_s = 300;
        const char *t = getenv("KILN_NCCL_TIMEOUT");
        if (t && atoi(t) > 0) timeout_s = atoi(t);
        st = kiln_comm_tcp_share(rank, size, launch->master_addr, launch->rendezvous_port, &id, sizeof id,
                                 timeout_s * 1000);
    }
    if (st != KILN_OK) {
        st = kiln_error_prefix(st, "kiln_comm_open_nccl: sharing NCCL's id (rank %d of %d)", rank, size);
        goto fail;
    }
    rc = g_nccl.CommInitRank(&s->comm, size, id, rank);
    if (rc != ncclSuccess) {
        s->comm = NULL;
        st = nccl_fail(s, rc, "kiln_comm_open_nccl: ncclCommInitRank");
        st = kiln_error_prefix(st, "rank %d of %d on CUDA device %d (%s, NCCL %d)", rank, size, device, g_nccl.path,
                               g_nccl.version);
        goto fail;
    }
    c->impl = &nccl_impl;
    c->rank = rank;
    c->size = size;
    c->local_rank = local;
    c->impl_state = s;
    return KILN_OK;
fail:
    if (s) {
        c->impl_state = s;
        s->failed = 1;
        nc_close(c); /* closes s->boot too */
    }
    kiln_comm_close(boot);
    return st;
}
