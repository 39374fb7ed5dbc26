/*
 * comm.c -- the communicator's entries: the launch the environment describes, argument
 * checks, the rank-order sums of the host reductions, and the self implementation (one
 * process). The MPI implementation is comm_mpi.c (built with KILN_MPI).
 */
#include "comm_impl.h"

#include <limits.h>
#include <stdint.h>
#include <string.h>

/* ---- the launch ------------------------------------------------------------------------ */

/* getenv(name) as a decimal integer in [lo, INT_MAX]: *present 0 when unset; an empty or
 * malformed value, or one out of range, is an error naming the variable. */
static kiln_status env_int(const char *name, int lo, int *value, int *present) {
    *present = 0;
    const char *v = getenv(name);
    if (!v) return KILN_OK;
    long long x = 0;
    const char *p = v;
    if (*p < '0' || *p > '9') goto bad; /* no sign, no space, not empty */
    for (; *p >= '0' && *p <= '9'; p++) {
        x = x * 10 + (*p - '0');
        if (x > INT_MAX) goto bad;
    }
    if (*p != '\0' || x < lo) goto bad;
    *value = (int)x;
    *present = 1;
    return KILN_OK;
bad:
    return kiln_error(KILN_ERR_INVALID_ARG,
                      "kiln_comm_open: environment variable %s='%s' is not a decimal integer in "
                      "[%d, %d]", name, v, lo, INT_MAX);
}

kiln_status kiln_comm_launch_from_env(kiln_comm_launch *out) {
    if (!out) return kiln_error(KILN_ERR_INVALID_ARG, "kiln_comm_launch_from_env: out is NULL");
    kiln_comm_launch l = {.kind = KILN_COMM_LAUNCH_SELF, .size = 1, .rank = 0, .local_rank = 0, .var = NULL};

    /* MPI launchers: Open MPI's mpirun (OMPI_COMM_WORLD_*, and PMIX_RANK), MPICH's Hydra and
     * Slurm's PMI-1/2 (PMI_RANK, PMI_SIZE), any PMIx server (PMIX_RANK). */
    int ompi_size = -1, ompi_rank = -1, pmi_size = -1, pmi_rank = -1, pmix_rank = -1;
    int has_ompi_size, has_ompi_rank, has_pmi_size, has_pmi_rank, has_pmix_rank;
    KILN_TRY(env_int("OMPI_COMM_WORLD_SIZE", 1, &ompi_size, &has_ompi_size));
    KILN_TRY(env_int("OMPI_COMM_WORLD_RANK", 0, &ompi_rank, &has_ompi_rank));
    KILN_TRY(env_int("PMI_SIZE", 1, &pmi_size, &has_pmi_size));
    KILN_TRY(env_int("PMI_RANK", 0, &pmi_rank, &has_pmi_rank));
    KILN_TRY(env_int("PMIX_RANK", 0, &pmix_rank, &has_pmix_rank));
    if (has_ompi_size || has_ompi_rank || has_pmi_size || has_pmi_rank || has_pmix_rank) {
        l.kind = KILN_COMM_LAUNCH_MPI;
        l.size = has_ompi_size ? ompi_size : has_pmi_size ? pmi_size : -1;
        l.rank = has_ompi_rank ? ompi_rank
               : has_pmi_rank  ? pmi_rank
               : has_pmix_rank ? pmix_rank
                               : -1;
        l.var = has_ompi_size ? "OMPI_COMM_WORLD_SIZE" : has_pmi_size ? "PMI_SIZE"
              : has_ompi_rank ? "OMPI_COMM_WORLD_RANK" : has_pmi_rank ? "PMI_RANK" : "PMIX_RANK";
        if (l.size > 0 && l.rank >= l.size)
            return kiln_error(KILN_ERR_INVALID_ARG,
                              "kiln_comm_open: the launcher's rank %d is not below its size "
                              "%s=%d", l.rank, l.var, l.size);
        int local = -1, has_local = 0;
        static const char *const local_vars[] = {"OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID",
                                                 "LOCAL_RANK"};
        l.local_rank = -1;
        for (size_t i = 0; i < sizeof local_vars / sizeof local_vars[0] && !has_local; i++) {
            KILN_TRY(env_int(local_vars[i], 0, &local, &has_local));
            if (has_local) l.local_rank = local;
        }
        *out = l;
        return KILN_OK;
    }

    /* torchrun's variables: GPU ranks only (the NCCL communicator), since CPU ranks need MPI's
     * transport, which only mpirun sets up. RANK alone is not looked at (the name is too common
     * to mean a launch by itself). */
    int world = 1, rank = 0, has_world, has_rank;
    KILN_TRY(env_int("WORLD_SIZE", 1, &world, &has_world));
    if (has_world) {
        KILN_TRY(env_int("RANK", 0, &rank, &has_rank));
        if (world == 1 && has_rank && rank != 0)
            return kiln_error(KILN_ERR_INVALID_ARG,
                              "kiln_comm_open: RANK=%d with WORLD_SIZE=1 (torchrun's variables): "
                              "the only rank is 0", rank);
    }
    if (has_world && world > 1) {
        int local = 0, has_local = 0, mport = 0, has_mport = 0, kport = 0, has_kport = 0;
        KILN_TRY(env_int("LOCAL_RANK", 0, &local, &has_local));
        KILN_TRY(env_int("MASTER_PORT", 1, &mport, &has_mport));
        KILN_TRY(env_int("KILN_NCCL_PORT", 1, &kport, &has_kport));
        const char *addr = getenv("MASTER_ADDR");
        const char *missing = !has_rank ? "RANK" : !has_local ? "LOCAL_RANK" : !addr || !*addr ? "MASTER_ADDR"
                            : !has_mport && !has_kport ? "MASTER_PORT" : NULL;
        if (missing)
            return kiln_error(KILN_ERR_INVALID_ARG,
                              "kiln_comm_open: WORLD_SIZE=%d (torchrun's variables) but %s is not set: "
                              "launch with torchrun, or set RANK, LOCAL_RANK, MASTER_ADDR and MASTER_PORT",
                              world, missing);
        if (rank >= world)
            return kiln_error(KILN_ERR_INVALID_ARG, "kiln_comm_open: RANK=%d is not below WORLD_SIZE=%d", rank,
                              world);
        const int port = has_kport ? kport : mport + 1;
        if (port > 65535)
            return kiln_error(KILN_ERR_INVALID_ARG, "kiln_comm_open: the rendezvous port %d (%s) is not a TCP port",
                              port, has_kport ? "KILN_NCCL_PORT" : "MASTER_PORT + 1");
        l.kind = KILN_COMM_LAUNCH_TORCHRUN;
        l.size = world;
        l.rank = rank;
        l.local_rank = local;
        l.var = "WORLD_SIZE";
        l.master_addr = addr;
        l.rendezvous_port = port;
    }
    *out = l;
    return KILN_OK;
}

/* ---- the rank-order sums (docs/ARITHMETIC.md, "Reductions across ranks") ------------------ */

/* out: (n); blocks: (n_ranks, n), block k being rank k's contribution.
 *   out[i] = (((+0.0f + blocks[0][i]) + blocks[1][i]) + ...) + blocks[n_ranks-1][i]
 * one binary32 addition at a time (-ffp-contract=off, no fast-math: the compiler may
 * vectorize over i but never reorders the additions of one element). The +0.0f start is
 * deliberate: -0.0 from every rank sums to +0.0, as in one process that accumulates into a
 * zeroed buffer. */
static void sum_in_rank_order_f32(float *out, const float *blocks, int n_ranks, size_t n) {
    for (size_t i = 0; i < n; i++) out[i] = 0.0f + blocks[i];
    for (int k = 1; k < n_ranks; k++) {
        const float *b = blocks + (size_t)k * n;
        for (size_t i = 0; i < n; i++) out[i] = out[i] + b[i];
    }
}

/* The same in binary64, starting from +0.0. */
static void sum_in_rank_order_f64(double *out, const double *blocks, int n_ranks, size_t n) {
    for (size_t i = 0; i < n; i++) out[i] = 0.0 + blocks[i];
    for (int k = 1; k < n_ranks; k++) {
        const double *b = blocks + (size_t)k * n;
        for (size_t i = 0; i < n; i++) out[i] = out[i] + b[i];
    }
}

/* ---- checks shared by the entries ----------------------------------------------------- */

static kiln_status check_comm(const kiln_comm *c, const char *fn) {
    if (!c) return kiln_error(KILN_ERR_INVALID_ARG, "%s: the communicator is NULL", fn);
    if (c->failed)
        return kiln_error(KILN_ERR_STATE,
                          "%s: an earlier collective failed on this rank (%s communicator, rank "
                          "%d of %d), so the ranks are out of step: close the communicator",
                          fn, c->impl->name, c->rank, c->size);
    return KILN_OK;
}

/* [a, a + na) and [b, b + nb) share a byte */
static int overlaps(const void *a, size_t na, const void *b, size_t nb) {
    uintptr_t x = (uintptr_t)a, y = (uintptr_t)b;
    return na && nb && x < y + nb && y < x + na;
}

/* size * per (bytes) into *total, or KILN_ERR_RANGE naming fn */
static kiln_status total_bytes(const kiln_comm *c, size_t per, size_t elem, size_t *total,
                               const char *fn) {
    size_t b;
    if (kiln_mul_overflow(per, elem, &b) || kiln_mul_overflow(b, (size_t)c->size, total))
        return kiln_error(KILN_ERR_RANGE, "%s: %zu elements of %zu bytes per rank times %d ranks "
                                          "overflows size_t", fn, per, elem, c->size);
    return KILN_OK;
}

/* An entry failed: its message gets the kiln call's name, and the communicator is marked
 * failed (the other ranks may have gone on, or be waiting for this one). */
static kiln_status entry_failed(kiln_comm *c, kiln_status st, const char *fn) {
    c->failed = 1;
    return kiln_error_prefix(st, "%s (%s communicator, rank %d of %d)", fn, c->impl->name,
                             c->rank, c->size);
}

/* Grow the host scratch to at least nbytes (its contents are not kept). */
static kiln_status scratch_reserve(kiln_comm *c, size_t nbytes, const char *fn) {
    if (c->scratch_bytes >= nbytes) return KILN_OK;
    kiln_free(c->scratch);
    c->scratch = NULL;
    c->scratch_bytes = 0;
    void *p = kiln_malloc(nbytes);
    if (!p)
        return kiln_error(KILN_ERR_NOMEM, "out of memory allocating %zu bytes of %s's scratch",
                          nbytes, fn);
    c->scratch = p;
    c->scratch_bytes = nbytes;
    return KILN_OK;
}

/* ---- the self implementation ------------------------------------------------------------ */

static kiln_status self_barrier(kiln_comm *c) { return KILN_OK; }
static kiln_status self_broadcast(kiln_comm *c, void *buf, size_t nbytes, int root) {
    return KILN_OK; /* root is 0: the buffer already holds root's bytes */
}
static kiln_status self_allgather(kiln_comm *c, void *recv, const void *send, size_t nbytes) {
    if (recv != send) memcpy(recv, send, nbytes);
    return KILN_OK;
}
static kiln_status self_alltoall(kiln_comm *c, void *recv, const void *send, size_t nbytes) {
    memcpy(recv, send, nbytes);
    return KILN_OK;
}
static kiln_status self_gather(kiln_comm *c, void *recv, const void *send, size_t nbytes, int root) {
    memcpy(recv, send, nbytes);
    return KILN_OK;
}

static const kiln_comm_i self_impl = {
    .name = "self",
    .host_memory = 1,
    .barrier = self_barrier,
    .broadcast = self_broadcast,
    .allgather = self_allgather,
    .alltoall = self_alltoall,
    .gather = self_gather,
    .reduce_scatter_f32 = NULL, /* composed: +0.0f + send, the N = 1 case of the sum */
    .reduce_f32 = NULL,
    .allreduce_f64 = NULL,
    .close = NULL,
};

static kiln_status comm_alloc(kiln_comm **out) {
    kiln_comm *c = kiln_calloc(1, sizeof *c);
    if (!c) return kiln_error(KILN_ERR_NOMEM, "kiln_comm_open: out of memory for the communicator");
    c->impl = &self_impl;
    c->rank = 0;
    c->size = 1;
    c->local_rank = 0;
    c->piece_bytes = KILN_COMM_DEFAULT_PIECE_BYTES;
    *out = c;
    return KILN_OK;
}

/* ---- open and close ----------------------------------------------------------------------- */

kiln_status kiln_comm_open_self(kiln_comm **out) {
    if (!out) return kiln_error(KILN_ERR_INVALID_ARG, "kiln_comm_open_self: out is NULL");
    return comm_alloc(out);
}

kiln_status kiln_comm_open(kiln_comm **out) {
    if (!out) return kiln_error(KILN_ERR_INVALID_ARG, "kiln_comm_open: out is NULL");
    kiln_comm_launch launch;
    KILN_TRY(kiln_comm_launch_from_env(&launch));
    if (launch.kind == KILN_COMM_LAUNCH_SELF) return comm_alloc(out);
    if (launch.kind == KILN_COMM_LAUNCH_TORCHRUN)
        return kiln_error(KILN_ERR_UNSUPPORTED,
                          "kiln_comm_open: WORLD_SIZE=%d (torchrun's variables) but no MPI launcher's: "
                          "kiln's CPU ranks are launched with `mpirun -np %d ...`; torchrun's variables "
                          "are for GPU ranks over NCCL (--device cuda)", launch.size, launch.size);
#ifdef KILN_HAVE_MPI
    kiln_comm *c = NULL;
    KILN_TRY(comm_alloc(&c));
    kiln_status st = kiln_comm_mpi_open(c, &launch);
    if (st != KILN_OK) {
        kiln_free(c);
        return st;
    }
    *out = c;
    return KILN_OK;
#else
    return kiln_error(KILN_ERR_UNSUPPORTED,
                      "kiln_comm_open: %s is set, so this process was started by an MPI "
                      "launcher (mpirun), but this libkiln was built without MPI: configure "
                      "with -DKILN_MPI=ON (Debian: libopenmpi-dev openmpi-bin), or run one "
                      "process without mpirun", launch.var);
#endif
}

void kiln_comm_close(kiln_comm *c) {
    if (!c) return;
    if (c->impl->close) c->impl->close(c);
    kiln_free(c->scratch);
    kiln_free(c);
}

int kiln_comm_gpu_device(int n_devices) {
    kiln_comm_launch launch;
    if (kiln_comm_launch_from_env(&launch) != KILN_OK) return -1;
    const int local = launch.local_rank > 0 ? launch.local_rank : 0;
    return n_devices > 0 ? local % n_devices : local;
}

kiln_status kiln_comm_open_nccl(int device, kiln_comm **out) {
    if (!out) return kiln_error(KILN_ERR_INVALID_ARG, "kiln_comm_open_nccl: out is NULL");
    kiln_comm_launch launch;
    KILN_TRY(kiln_comm_launch_from_env(&launch));
#ifdef KILN_HAVE_NCCL
    kiln_comm *c = NULL, *boot = NULL;
    if (launch.kind == KILN_COMM_LAUNCH_MPI) {
#ifdef KILN_HAVE_MPI
        KILN_TRY(comm_alloc(&boot));
        kiln_status bst = kiln_comm_mpi_open(boot, &launch);
        if (bst != KILN_OK) {
            kiln_free(boot);
            return bst;
        }
#else
        return kiln_error(KILN_ERR_UNSUPPORTED,
                          "kiln_comm_open_nccl: %s is set (an MPI launcher), but this libkiln was built without "
                          "MPI, which GPU ranks launched by mpirun use to share NCCL's id: configure with "
                          "-DKILN_MPI=ON, or launch with torchrun (--no-python)", launch.var);
#endif
    }
    kiln_status st = comm_alloc(&c);
    if (st != KILN_OK) {
        kiln_comm_close(boot);
        return st;
    }
    st = kiln_comm_nccl_open(c, &launch, device, boot);
    if (st != KILN_OK) {
        kiln_free(c); /* the implementation closed boot */
        return st;
    }
    *out = c;
    return KILN_OK;
#else
    (void)device;
    return kiln_error(KILN_ERR_UNSUPPORTED,
                      "kiln_comm_open_nccl: this libkiln was built without NCCL (it needs CUDA and nccl.h at "
                      "build time: configure with -DKILN_CUDA=ON on a machine with the CUDA toolkit)");
#endif
}

int kiln_comm_have_nccl(void) {
#ifdef KILN_HAVE_NCCL
    return 1;
#else
    return 0;
#endif
}

kiln_status kiln_comm_set_stream(kiln_comm *c, void *stream) {
    KILN_TRY(check_comm(c, "kiln_comm_set_stream"));
    if (!c->impl->set_stream)
        return kiln_error(KILN_ERR_UNSUPPORTED, "kiln_comm_set_stream: the %s communicator has no device stream",
                          c->impl->name);
    return c->impl->set_stream(c, stream);
}

int kiln_comm_device(const kiln_comm *c) { return c && c->impl->device ? c->impl->device(c) : -1; }

int kiln_comm_have_mpi(void) {
#ifdef KILN_HAVE_MPI
    return 1;
#else
    return 0;
#endif
}

int kiln_comm_rank(const kiln_comm *c) { return c ? c->rank : 0; }
int kiln_comm_size(const kiln_comm *c) { return c ? c->size : 1; }
int kiln_comm_local_rank(const kiln_comm *c) { return c ? c->local_rank : 0; }
const char *kiln_comm_name(const kiln_comm *c) { return c ? c->impl->name : ""; }
int kiln_comm_host_memory(const kiln_comm *c) { return c ? c->impl->host_memory : 0; }

size_t kiln_comm_piece_bytes(const kiln_comm *c) {
    return c ? c->piece_bytes : KILN_COMM_DEFAULT_PIECE_BYTES;
}

kiln_status kiln_comm_set_piece_bytes(kiln_comm *c, size_t piece_bytes) {
    KILN_TRY(check_comm(c, "kiln_comm_set_piece_bytes"));
    if (piece_bytes < 1 || piece_bytes > (size_t)INT_MAX)
        return kiln_error(KILN_ERR_INVALID_ARG, "kiln_comm_set_piece_bytes: piece_bytes %zu is "
                                                "not in [1, %d]", piece_bytes, INT_MAX);
    c->piece_bytes = piece_bytes;
    return KILN_OK;
}

/* ---- the collectives ---------------------------------------------------------------------- */

kiln_status kiln_comm_barrier(kiln_comm *c) {
    static const char fn[] = "kiln_comm_barrier";
    KILN_TRY(check_comm(c, fn));
    kiln_status st = c->impl->barrier(c);
    return st == KILN_OK ? KILN_OK : entry_failed(c, st, fn);
}

kiln_status kiln_comm_broadcast(kiln_comm *c, void *buf, size_t nbytes, int root) {
    static const char fn[] = "kiln_comm_broadcast";
    KILN_TRY(check_comm(c, fn));
    if (root < 0 || root >= c->size)
        return kiln_error(KILN_ERR_INVALID_ARG, "%s: root %d is not a rank of %d", fn, root,
                          c->size);
    if (nbytes == 0) return KILN_OK;
    if (!buf) return kiln_error(KILN_ERR_INVALID_ARG, "%s: buf is NULL (nbytes %zu)", fn, nbytes);
    kiln_status st = c->impl->broadcast(c, buf, nbytes, root);
    return st == KILN_OK ? KILN_OK : entry_failed(c, st, fn);
}

/* The entry checks of a collective with a send and a recv buffer: a usable communicator, the
 * size (*total = ranks x per_rank elements of elem bytes, overflow checked) and, when there is
 * anything to move, neither buffer NULL. */
static kiln_status two_buffers(kiln_comm *c, const void *recv, const void *send, size_t per_rank,
                               size_t elem, const char *fn, size_t *total) {
    KILN_TRY(check_comm(c, fn));
    KILN_TRY(total_bytes(c, per_rank, elem, total, fn));
    if (*total && (!recv || !send))
        return kiln_error(KILN_ERR_INVALID_ARG, "%s: %s is NULL (%zu %s per rank)", fn,
                          !recv ? "recv" : "send", per_rank, elem == 1 ? "bytes" : "floats");
    return KILN_OK;
}

kiln_status kiln_comm_allgather(kiln_comm *c, void *recv, const void *send,
                                size_t nbytes_per_rank) {
    static const char fn[] = "kiln_comm_allgather";
    size_t total = 0;
    KILN_TRY(two_buffers(c, recv, send, nbytes_per_rank, 1, fn, &total));
    if (total == 0) return KILN_OK;
    const uint8_t *own = (const uint8_t *)recv + (size_t)c->rank * nbytes_per_rank;
    if ((const uint8_t *)send != own && overlaps(recv, total, send, nbytes_per_rank))
        return kiln_error(KILN_ERR_INVALID_ARG, "%s: send overlaps recv but is not this rank's "
                                                "block of it (rank %d: recv + %zu bytes)", fn,
                          c->rank, (size_t)c->rank * nbytes_per_rank);
    kiln_status st = c->impl->allgather(c, recv, send, nbytes_per_rank);
    return st == KILN_OK ? KILN_OK : entry_failed(c, st, fn);
}

kiln_status kiln_comm_alltoall(kiln_comm *c, void *recv, const void *send,
                               size_t nbytes_per_rank) {
    static const char fn[] = "kiln_comm_alltoall";
    size_t total = 0;
    KILN_TRY(two_buffers(c, recv, send, nbytes_per_rank, 1, fn, &total));
    if (total == 0) return KILN_OK;
    if (overlaps(recv, total, send, total))
        return kiln_error(KILN_ERR_INVALID_ARG, "%s: send and recv overlap", fn);
    kiln_status st = c->impl->alltoall(c, recv, send, nbytes_per_rank);
    return st == KILN_OK ? KILN_OK : entry_failed(c, st, fn);
}

kiln_status kiln_comm_reduce_scatter_f32(kiln_comm *c, float *recv, const float *send,
                                         size_t n_per_rank) {
    static const char fn[] = "kiln_comm_reduce_scatter_f32";
    size_t total = 0;
    KILN_TRY(two_buffers(c, recv, send, n_per_rank, sizeof(float), fn, &total));
    if (total == 0) return KILN_OK;
    if (overlaps(recv, n_per_rank * sizeof(float), send, total))
        return kiln_error(KILN_ERR_INVALID_ARG, "%s: recv overlaps send", fn);
    kiln_status st;
    if (c->impl->reduce_scatter_f32) {
        st = c->impl->reduce_scatter_f32(c, recv, send, n_per_rank);
    } else {
        /* scratch block k = rank k's block (this rank), then the sum in rank order */
        st = scratch_reserve(c, total, fn);
        if (st == KILN_OK) st = c->impl->alltoall(c, c->scratch, send, n_per_rank * sizeof(float));
        if (st == KILN_OK) sum_in_rank_order_f32(recv, c->scratch, c->size, n_per_rank);
    }
    return st == KILN_OK ? KILN_OK : entry_failed(c, st, fn);
}

kiln_status kiln_comm_reduce_f32(kiln_comm *c, float *recv, const float *send, size_t n, int root) {
    static const char fn[] = "kiln_comm_reduce_f32";
    KILN_TRY(check_comm(c, fn));
    if (root < 0 || root >= c->size)
        return kiln_error(KILN_ERR_INVALID_ARG, "%s: root %d is not a rank of %d", fn, root,
                          c->size);
    size_t total = 0;
    KILN_TRY(total_bytes(c, n, sizeof(float), &total, fn));
    if (total == 0) return KILN_OK;
    const int is_root = c->rank == root;
    if (!send || (is_root && !recv))
        return kiln_error(KILN_ERR_INVALID_ARG, "%s: %s is NULL (%zu floats)", fn,
                          !send ? "send" : "root's recv", n);
    if (is_root && overlaps(recv, n * sizeof(float), send, n * sizeof(float)))
        return kiln_error(KILN_ERR_INVALID_ARG, "%s: recv overlaps send", fn);
    kiln_status st;
    if (c->impl->reduce_f32) {
        st = c->impl->reduce_f32(c, recv, send, n, root);
    } else {
        /* root's scratch block k = rank k's send, then the sum in rank order */
        st = is_root ? scratch_reserve(c, total, fn) : KILN_OK;
        if (st == KILN_OK)
            st = c->impl->gather(c, is_root ? c->scratch : NULL, send, n * sizeof(float), root);
        if (st == KILN_OK && is_root) sum_in_rank_order_f32(recv, c->scratch, c->size, n);
    }
    return st == KILN_OK ? KILN_OK : entry_failed(c, st, fn);
}

kiln_status kiln_comm_allreduce_f64(kiln_comm *c, double *x, size_t n) {
    static const char fn[] = "kiln_comm_allreduce_f64";
    KILN_TRY(check_comm(c, fn));
    size_t total = 0;
    KILN_TRY(total_bytes(c, n, sizeof(double), &total, fn));
    if (total == 0) return KILN_OK;
    if (!x) return kiln_error(KILN_ERR_INVALID_ARG, "%s: x is NULL (n %zu)", fn, n);
    kiln_status st;
    if (c->impl->allreduce_f64) {
        st = c->impl->allreduce_f64(c, x, n);
    } else {
        /* every rank gathers every rank's x and sums them in the same order: the same bits */
        st = scratch_reserve(c, total, fn);
        if (st == KILN_OK) st = c->impl->allgather(c, c->scratch, x, n * sizeof(double));
        if (st == KILN_OK) sum_in_rank_order_f64(x, c->scratch, c->size, n);
    }
    return st == KILN_OK ? KILN_OK : entry_failed(c, st, fn);
}
