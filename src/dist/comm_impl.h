/*
 * comm_impl.h -- what an implementation of the communicator provides (src/dist/ only).
 *
 * comm.c checks every argument (NULLs, root, overlap, overflow, a failed communicator) and
 * returns early for 0 bytes before it calls an entry, so an entry gets valid arguments and
 * at least one byte. An entry that fails leaves the message (naming the MPI function and
 * MPI's text); comm.c prefixes the kiln call's name and marks the communicator failed.
 *
 * The three reductions are NULL in a host-memory implementation: comm.c composes them from
 * alltoall / allgather / gather into the host scratch and the rank-order sums below. A device
 * implementation (NCCL) will fill them, exchanging with its own all-to-all and summing in a
 * kernel in the same order.
 */
#ifndef KILN_DIST_COMM_IMPL_H
#define KILN_DIST_COMM_IMPL_H

#include "comm.h"

typedef struct kiln_comm_i {
    const char *name;  /* "self", "mpi", "nccl": for messages */
    int host_memory;   /* 1: buffers are plain host memory */
    kiln_status (*barrier)(kiln_comm *c);
    kiln_status (*broadcast)(kiln_comm *c, void *buf, size_t nbytes, int root);
    /* send is recv's own block (in place) or does not overlap recv */
    kiln_status (*allgather)(kiln_comm *c, void *recv, const void *send, size_t nbytes);
    kiln_status (*alltoall)(kiln_comm *c, void *recv, const void *send, size_t nbytes);
    /* root's recv (size, nbytes) gets block k from rank k (its own copied); recv is read on
     * root alone, and send does not overlap it */
    kiln_status (*gather)(kiln_comm *c, void *recv, const void *send, size_t nbytes, int root);
    /* NULL: comm.c's host composition */
    kiln_status (*reduce_scatter_f32)(kiln_comm *c, float *recv, const float *send, size_t n);
    kiln_status (*reduce_f32)(kiln_comm *c, float *recv, const float *send, size_t n, int root);
    kiln_status (*allreduce_f64)(kiln_comm *c, double *x, size_t n);
    /* frees the implementation's state (impl_state); comm.c frees the rest */
    void (*close)(kiln_comm *c);
    /* device implementations (NULL for host ones): the stream to queue on, the device */
    kiln_status (*set_stream)(kiln_comm *c, void *stream);
    int (*device)(const kiln_comm *c);
} kiln_comm_i;

struct kiln_comm {
    const kiln_comm_i *impl;
    int rank, size, local_rank;
    size_t piece_bytes;   /* largest single transfer, >= 1 */
    void *scratch;        /* host scratch of the composed reductions; kiln_malloc'd */
    size_t scratch_bytes;
    int failed;           /* an entry failed: the ranks are out of step, every call refused */
    void *impl_state;     /* the implementation's own (mpi: its MPI_Comm) */
};

#define KILN_COMM_DEFAULT_PIECE_BYTES ((size_t)1 << 30)

/* comm_tcp.c: rank 0's n bytes at blob copied into every other rank's blob over TCP (rank 0
 * listens on addr:port, the others connect, retrying until timeout_ms); size 1 does nothing. */
kiln_status kiln_comm_tcp_share(int rank, int size, const char *addr, int port, void *blob, size_t n,
                                int timeout_ms);

#ifdef KILN_HAVE_NCCL
/* comm_nccl.c: fill c for GPU ranks on CUDA device `device`, the unique id shared as the launch
 * says (boot: an open MPI communicator of the same ranks to broadcast it, kept and closed with
 * c; NULL: torchrun's rendezvous over TCP, or one rank) */
kiln_status kiln_comm_nccl_open(kiln_comm *c, const kiln_comm_launch *launch, int device, kiln_comm *boot);
#endif

#ifdef KILN_HAVE_MPI
/* comm_mpi.c: fill c (impl, rank, size, local_rank, impl_state) for the launch the
 * environment described; on failure c is left for comm.c to free (impl_state NULL). */
kiln_status kiln_comm_mpi_open(kiln_comm *c, const kiln_comm_launch *launch);
#endif

#endif /* KILN_DIST_COMM_IMPL_H */
