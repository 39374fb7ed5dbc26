/*
 * comm_mpi.c -- the communicator over MPI (built with KILN_MPI): CPU ranks, host memory.
 *
 * kiln talks on its own duplicate of MPI_COMM_WORLD (its messages never meet the program's)
 * with MPI_ERRORS_RETURN, so a failure comes back as a status with MPI's text rather than
 * aborting the job. MPI moves bytes only (MPI_BYTE): kiln never asks MPI to add (MPI_SUM's
 * order is unspecified); comm.c sums the exchanged blocks in rank order.
 *
 * Every transfer is cut into pieces of at most c->piece_bytes (<= INT_MAX) bytes, so MPI's
 * int counts never overflow. The algorithms, chosen so that each message is one contiguous
 * piece of one block:
 *   allgather  a ring: step s = 0 .. N-2, rank r sends block (r - s) to r + 1 and receives
 *              block (r - s - 1) from r - 1 (mod N); each rank sends and receives N-1 blocks.
 *   alltoall   pairwise: step d = 1 .. N-1, rank r sends its block r + d to rank r + d and
 *              receives rank r - d's block r (mod N); its own block is a copy.
 *   broadcast  MPI_Bcast per piece.
 *
 * Initialisation: MPI_Init_thread(MPI_THREAD_SERIALIZED) when MPI is not initialised yet;
 * then kiln owns it and finalises it when the last communicator opened under that ownership
 * closes (a count guarded by a mutex). MPI cannot be initialised again after MPI_Finalize,
 * so a later kiln_comm_open in the same process is refused. When the program initialised
 * MPI itself, kiln never finalises it, and a thread level below MPI_THREAD_SERIALIZED is the
 * program's contract: it must then call kiln's collectives from the thread MPI allows.
 */
#include "comm_impl.h"

#include <mpi.h>

#include <limits.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>

#define KILN_MPI_TAG 0x6b6c /* "kl": kiln's point-to-point messages on its own communicator */

typedef struct mpi_state {
    MPI_Comm comm;   /* kiln's duplicate of MPI_COMM_WORLD, MPI_ERRORS_RETURN; MPI_COMM_NULL */
    int owns_init;   /* counted in g_owned_users: kiln initialised MPI for it */
} mpi_state;

static pthread_mutex_t g_init_lock = PTHREAD_MUTEX_INITIALIZER;
static int g_owned_users; /* open communicators under kiln's own MPI_Init_thread */

/* KILN_ERR_IO naming what failed and MPI's text for rc. */
static kiln_status mpi_fail(int rc, const char *what) {
    char text[MPI_MAX_ERROR_STRING];
    int len = 0;
    if (MPI_Error_string(rc, text, &len) != MPI_SUCCESS || len <= 0) {
        snprintf(text, sizeof text, "unknown MPI error");
        len = (int)strlen(text);
    }
    return kiln_error(KILN_ERR_IO, "%s failed: %.*s (MPI error code %d)", what, len, text, rc);
}

static MPI_Comm comm_of(const kiln_comm *c) { return ((const mpi_state *)c->impl_state)->comm; }

static size_t min_size(size_t a, size_t b) { return a < b ? a : b; }

/* Send (nbytes) at send to rank `to` while receiving (nbytes) at recv from rank `from`, in
 * pieces. Both sides cut the same length the same way, so piece j meets piece j (MPI keeps
 * the order of messages between two ranks with one tag). */
static kiln_status sendrecv_pieces(kiln_comm *c, const void *send, int to, void *recv, int from,
                                   size_t nbytes, const char *step) {
    for (size_t off = 0; off < nbytes;) {
        size_t len = min_size(c->piece_bytes, nbytes - off);
        int rc = MPI_Sendrecv((const uint8_t *)send + off, (int)len, MPI_BYTE, to, KILN_MPI_TAG,
                              (uint8_t *)recv + off, (int)len, MPI_BYTE, from, KILN_MPI_TAG,
                              comm_of(c), MPI_STATUS_IGNORE);
        if (rc != MPI_SUCCESS) {
            char what[160];
            snprintf(what, sizeof what, "MPI_Sendrecv (%s, to rank %d, from rank %d, %zu bytes "
                     "at byte %zu of %zu)", step, to, from, len, off, nbytes);
            return mpi_fail(rc, what);
        }
        off += len;
    }
    return KILN_OK;
}

static kiln_status mpi_barrier(kiln_comm *c) {
    int rc = MPI_Barrier(comm_of(c));
    return rc == MPI_SUCCESS ? KILN_OK : mpi_fail(rc, "MPI_Barrier");
}

static kiln_status mpi_broadcast(kiln_comm *c, void *buf, size_t nbytes, int root) {
    for (size_t off = 0; off < nbytes;) {
        size_t len = min_size(c->piece_bytes, nbytes - off);
        int rc = MPI_Bcast((uint8_t *)buf + off, (int)len, MPI_BYTE, root, comm_of(c));
        if (rc != MPI_SUCCESS) {
            char what[128];
            snprintf(what, sizeof what, "MPI_Bcast (root %d, %zu bytes at byte %zu of %zu)", root,
                     len, off, nbytes);
            return mpi_fail(rc, what);
        }
        off += len;
    }
    return KILN_OK;
}

static kiln_status mpi_allgather(kiln_comm *c, void *recv, const void *send, size_t nbytes) {
    const int n = c->size, r = c->rank;
    uint8_t *blocks = recv; /* (n, nbytes); size * nbytes checked by comm.c */
    if ((const uint8_t *)send != blocks + (size_t)r * nbytes)
        memcpy(blocks + (size_t)r * nbytes, send, nbytes);
    const int right = (r + 1) % n, left = (r + n - 1) % n;
    for (int s = 0; s < n - 1; s++) {
        const int send_block = (r - s + n) % n, recv_block = (r - s - 1 + 2 * n) % n;
        char step[64];
        snprintf(step, sizeof step, "allgather ring step %d of %d", s + 1, n - 1);
        KILN_TRY(sendrecv_pieces(c, blocks + (size_t)send_block * nbytes, right,
                                 blocks + (size_t)recv_block * nbytes, left, nbytes, step));
    }
    return KILN_OK;
}

static kiln_status mpi_alltoall(kiln_comm *c, void *recv, const void *send, size_t nbytes) {
    const int n = c->size, r = c->rank;
    const uint8_t *out = send; /* (n, nbytes): block k goes to rank k */
    uint8_t *in = recv;        /* (n, nbytes): block k comes from rank k */
    memcpy(in + (size_t)r * nbytes, out + (size_t)r * nbytes, nbytes);
    for (int d = 1; d < n; d++) {
        const int to = (r + d) % n, from = (r - d + n) % n;
        char step[64];
        snprintf(step, sizeof step, "alltoall pairwise step %d of %d", d, n - 1);
        KILN_TRY(sendrecv_pieces(c, out + (size_t)to * nbytes, to, in + (size_t)from * nbytes,
                                 from, nbytes, step));
    }
    return KILN_OK;
}

/* nbytes of buf sent to (send) or received from peer, one message a piece, so that none is
 * larger than a piece (the gather to root's two sides). */
static kiln_status gather_pieces(kiln_comm *c, void *buf, size_t nbytes, int peer, int send) {
    for (size_t off = 0; off < nbytes;) {
        size_t len = min_size(c->piece_bytes, nbytes - off);
        int rc = send ? MPI_Send((const uint8_t *)buf + off, (int)len, MPI_BYTE, peer, KILN_MPI_TAG, comm_of(c))
                      : MPI_Recv((uint8_t *)buf + off, (int)len, MPI_BYTE, peer, KILN_MPI_TAG, comm_of(c),
                                 MPI_STATUS_IGNORE);
        if (rc != MPI_SUCCESS) {
            char what[128];
            snprintf(what, sizeof what, "%s (gather %s rank %d, %zu bytes at byte %zu of %zu)",
                     send ? "MPI_Send" : "MPI_Recv", send ? "to" : "from", peer, len, off, nbytes);
            return mpi_fail(rc, what);
        }
        off += len;
    }
    return KILN_OK;
}

/* Root receives every rank's block in rank order; the others send theirs. */
static kiln_status mpi_gather(kiln_comm *c, void *recv, const void *send, size_t nbytes, int root) {
    if (c->rank != root) return gather_pieces(c, (void *)send, nbytes, root, 1);
    uint8_t *blocks = recv; /* (n, nbytes) */
    memcpy(blocks + (size_t)root * nbytes, send, nbytes);
    for (int r = 0; r < c->size; r++)
        if (r != root) KILN_TRY(gather_pieces(c, blocks + (size_t)r * nbytes, nbytes, r, 0));
    return KILN_OK;
}

/* Free the duplicate and, when kiln owns MPI and this was its last user, finalise. */
static void mpi_release(mpi_state *st) {
    if (st->comm != MPI_COMM_NULL) MPI_Comm_free(&st->comm);
    if (st->owns_init) {
        pthread_mutex_lock(&g_init_lock);
        if (--g_owned_users == 0) MPI_Finalize();
        pthread_mutex_unlock(&g_init_lock);
        st->owns_init = 0;
    }
}

static void mpi_close(kiln_comm *c) {
    mpi_state *st = c->impl_state;
    if (!st) return;
    mpi_release(st);
    kiln_free(st);
    c->impl_state = NULL;
}

static const kiln_comm_i mpi_impl = {
    .name = "mpi",
    .host_memory = 1,
    .barrier = mpi_barrier,
    .broadcast = mpi_broadcast,
    .allgather = mpi_allgather,
    .alltoall = mpi_alltoall,
    .gather = mpi_gather,
    .reduce_scatter_f32 = NULL, /* comm.c: alltoall, then the rank-order sum */
    .reduce_f32 = NULL,         /* comm.c: gather to root, then the rank-order sum */
    .allreduce_f64 = NULL,      /* comm.c: allgather, then the rank-order sum */
    .close = mpi_close,
};

/* MPI initialised (by kiln if not yet), and st counted as kiln's user when kiln owns it. */
static kiln_status mpi_acquire_init(mpi_state *st) {
    kiln_status ret = KILN_OK;
    pthread_mutex_lock(&g_init_lock);
    int initialised = 0, finalised = 0;
    MPI_Initialized(&initialised);
    MPI_Finalized(&finalised);
    if (finalised) {
        ret = kiln_error(KILN_ERR_STATE, "kiln_comm_open: MPI was finalised in this process "
                                         "already (by the close of kiln's last communicator, or "
                                         "by the program), and MPI cannot be initialised twice");
    } else if (!initialised || g_owned_users > 0) {
        if (!initialised) {
            /* errors of MPI_Init_thread itself go to MPI's default handler (no communicator
             * exists yet to set MPI_ERRORS_RETURN on): Open MPI aborts the process there */
            int provided = 0;
            int rc = MPI_Init_thread(NULL, NULL, MPI_THREAD_SERIALIZED, &provided);
            if (rc != MPI_SUCCESS) {
                ret = mpi_fail(rc, "kiln_comm_open: MPI_Init_thread");
                goto out;
            }
            /* kiln owns this initialisation, so the world's handler is kiln's to choose */
            MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
        }
        g_owned_users++;
        st->owns_init = 1;
    }
out:
    pthread_mutex_unlock(&g_init_lock);
    return ret;
}

kiln_status kiln_comm_mpi_open(kiln_comm *c, const kiln_comm_launch *launch) {
    mpi_state *st = kiln_calloc(1, sizeof *st);
    if (!st) return kiln_error(KILN_ERR_NOMEM, "kiln_comm_open: out of memory for MPI's state");
    st->comm = MPI_COMM_NULL;
    kiln_status ret = mpi_acquire_init(st);
    if (ret != KILN_OK) goto fail;

    int rc = MPI_Comm_dup(MPI_COMM_WORLD, &st->comm);
    if (rc != MPI_SUCCESS) {
        st->comm = MPI_COMM_NULL;
        ret = mpi_fail(rc, "kiln_comm_open: MPI_Comm_dup(MPI_COMM_WORLD)");
        goto fail;
    }
    rc = MPI_Comm_set_errhandler(st->comm, MPI_ERRORS_RETURN);
    if (rc != MPI_SUCCESS) {
        ret = mpi_fail(rc, "kiln_comm_open: MPI_Comm_set_errhandler");
        goto fail;
    }
    int rank = 0, size = 1;
    if ((rc = MPI_Comm_rank(st->comm, &rank)) != MPI_SUCCESS ||
        (rc = MPI_Comm_size(st->comm, &size)) != MPI_SUCCESS) {
        ret = mpi_fail(rc, "kiln_comm_open: MPI_Comm_rank/MPI_Comm_size");
        goto fail;
    }
    /* A launcher of another MPI (MPICH's mpiexec for an Open MPI build, say) starts N
     * processes that each become a singleton "rank 0 of 1": N independent runs, not one. */
    if ((launch->size > 0 && launch->size != size) || (launch->rank >= 0 && launch->rank != rank)) {
        ret = kiln_error(KILN_ERR_STATE,
                         "kiln_comm_open: the launcher says rank %d of %d (%s) but MPI says rank "
                         "%d of %d: was the program started by another MPI's launcher than the "
                         "one this libkiln was built with?", launch->rank, launch->size,
                         launch->var, rank, size);
        goto fail;
    }
    int local_rank = launch->local_rank;
    if (local_rank < 0) {
        /* no launcher variable: count the ranks that share this machine's memory */
        MPI_Comm node = MPI_COMM_NULL;
        rc = MPI_Comm_split_type(st->comm, MPI_COMM_TYPE_SHARED, rank, MPI_INFO_NULL, &node);
        if (rc == MPI_SUCCESS) rc = MPI_Comm_rank(node, &local_rank);
        if (node != MPI_COMM_NULL) MPI_Comm_free(&node);
        if (rc != MPI_SUCCESS) {
            ret = mpi_fail(rc, "kiln_comm_open: MPI_Comm_split_type(MPI_COMM_TYPE_SHARED)");
            goto fail;
        }
    }
    c->impl = &mpi_impl;
    c->rank = rank;
    c->size = size;
    c->local_rank = local_rank;
    c->impl_state = st;
    return KILN_OK;
fail:
    mpi_release(st);
    kiln_free(st);
    return ret;
}
