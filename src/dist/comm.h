/*
 * comm.h -- collectives over the ranks of a data-parallel run (docs/DISTRIBUTED.md).
 *
 * A communicator joins the N processes ("ranks") of one run. Every collective is called by
 * every rank of the communicator, in the same order, with the same sizes and root; a rank
 * that calls another collective, or the same with another size, leaves the run undefined
 * (MPI may report a truncation, or the ranks may wait on each other for ever). kiln cannot
 * check this without more traffic and does not.
 *
 * Implementations (a table of entries, comm_impl.h):
 *   self  one process, rank 0 of 1, no MPI: every collective is a copy (or nothing), with the
 *         same arithmetic as N ranks, so a one-process run is the N = 1 case of the same code.
 *   mpi   ranks launched by mpirun (Open MPI, or another MPI's launcher), CPU ranks; compiled
 *         only when kiln is built with KILN_MPI (kiln_comm_have_mpi()).
 *   nccl  GPU ranks (comm_nccl.c, kiln_comm_open_nccl): device buffers, NCCL moving the bytes
 *         and a kernel adding them in rank order; host buffers are staged through the device.
 * Buffers are plain pointers "in the memory of the backend the communicator was made for":
 * host memory for self and mpi (kiln_comm_host_memory() says which); device memory (or small
 * host buffers) for nccl.
 *
 * Reductions are defined, not left to the library (docs/ARITHMETIC.md, "Reductions across
 * ranks"): the blocks of all ranks are exchanged (all-to-all or all-gather, plain bytes), and
 * each rank adds them in rank order, starting from +0: (((+0 + x_0) + x_1) + ...) + x_{N-1},
 * one IEEE round-to-nearest addition at a time. So every rank gets the same bits, and an
 * N-rank sum equals one process that accumulates the N contributions into a zeroed buffer in
 * that order. No MPI_SUM (MPI does not fix its order), no FMA, no tree.
 *
 * Large transfers are split into pieces of at most kiln_comm_piece_bytes() bytes (1 GiB by
 * default, below MPI's int counts), so any size that fits in memory can be moved.
 *
 * Errors: a failed MPI call returns KILN_ERR_IO naming the kiln call, the MPI function and
 * MPI's own text (MPI_Error_string); the communicator is then out of step with the other
 * ranks and refuses every later collective with KILN_ERR_STATE (close it); so does a failed
 * allocation of a reduction's scratch (the other ranks went on without this one). Argument errors
 * (NULL, an out-of-range root, overlapping buffers, a size that overflows) are found before
 * any traffic, identically on every rank given the same arguments, and leave it usable.
 *
 * Threads: a communicator is used from one thread at a time, one call after another (MPI is
 * asked for MPI_THREAD_SERIALIZED). Rank-order sums run on that thread.
 */
#ifndef KILN_DIST_COMM_H
#define KILN_DIST_COMM_H

#include "../base/base.h"

typedef struct kiln_comm kiln_comm;

/* Open the communicator the environment describes (docs/DISTRIBUTED.md, "Launching"):
 *   - an MPI launcher's variables (OMPI_COMM_WORLD_SIZE / OMPI_COMM_WORLD_RANK from Open
 *     MPI's mpirun, PMIX_RANK, PMI_RANK / PMI_SIZE from MPICH's or Slurm's): the mpi
 *     implementation over a duplicate of MPI_COMM_WORLD, with MPI_ERRORS_RETURN. MPI is
 *     initialised (MPI_Init_thread, MPI_THREAD_SERIALIZED) unless the program did it; kiln
 *     finalises it when the last communicator kiln initialised it for is closed. A launcher
 *     whose size disagrees with MPI's is refused (the program was launched with another
 *     MPI's mpirun). Without KILN_MPI: KILN_ERR_UNSUPPORTED saying kiln was built without MPI.
 *   - torchrun's variables (RANK, WORLD_SIZE, LOCAL_RANK) with WORLD_SIZE > 1 and no MPI
 *     launcher: KILN_ERR_UNSUPPORTED (CPU ranks are launched with mpirun; torchrun's variables
 *     are GPU ranks', kiln_comm_open_nccl). WORLD_SIZE=1 is one process.
 *   - nothing: the self communicator, rank 0 of 1.
 * A variable that is set but not a decimal integer in range is refused, naming it. MPI cannot
 * be initialised again once finalised: an open after that is KILN_ERR_STATE. *out is set on
 * success; close it with kiln_comm_close. */
kiln_status kiln_comm_open(kiln_comm **out);

/* The self communicator (rank 0 of 1, host memory), whatever the environment says. */
kiln_status kiln_comm_open_self(kiln_comm **out);

/* Open the communicator of GPU ranks (the nccl implementation) that the environment describes,
 * this rank on CUDA device `device` (the caller's choice: kiln_comm_gpu_device() picks the
 * launcher's local rank):
 *   - an MPI launcher's variables: the ranks' NCCL unique id is broadcast over MPI (needs
 *     KILN_MPI; the MPI communicator is kept until close);
 *   - torchrun's variables (WORLD_SIZE > 1): rank 0 hands the id to the others over TCP on
 *     MASTER_ADDR, port KILN_NCCL_PORT or MASTER_PORT + 1 (KILN_NCCL_TIMEOUT seconds, default
 *     300, for every rank to arrive);
 *   - nothing: one rank (the nccl implementation with N = 1: every collective runs on the
 *     device through NCCL, so one GPU tests the path of N).
 * NCCL itself is loaded at run time (dlopen): KILN_NCCL_LIBRARY names the file, else
 * libnccl.so.2 on the loader's path (a CUDA toolkit, or PyTorch's nvidia-nccl wheel: add its
 * lib folder to LD_LIBRARY_PATH). Errors: KILN_ERR_UNSUPPORTED when kiln was built without CUDA
 * or NCCL's header, or the library cannot be loaded, naming what to install; KILN_ERR_IO for a
 * failed rendezvous or NCCL call, with NCCL's text.
 *
 * Buffers of the nccl implementation: device memory of `device` (the collectives are queued on
 * the communicator's stream, see kiln_comm_set_stream, and return without waiting; results
 * are ready in stream order) or host memory (small things: losses, norms' states; staged
 * through a device buffer, and waited for). No piece splitting: NCCL's counts are size_t. */
kiln_status kiln_comm_open_nccl(int device, kiln_comm **out);

/* The CUDA device a GPU rank takes: the launcher's local rank modulo the devices present
 * (0 with no launcher), or -1 when no launcher variables can be read (kiln_last_error says). */
int kiln_comm_gpu_device(int n_devices);

/* 1 when this libkiln can open nccl communicators (built with CUDA and NCCL's header; the
 * library is loaded at open), else 0. */
int kiln_comm_have_nccl(void);

/* A device communicator's collectives queued on this CUDA stream (a cudaStream_t: the backend's,
 * so that they are ordered with its kernels without waiting on the host); NULL: the
 * communicator's own stream. The switch waits for the work queued on the previous stream, so a
 * stream must stay alive until the communicator is given another (a trainer made a rank with c
 * sets NULL when it is freed, before its backend's stream goes). KILN_ERR_UNSUPPORTED for a
 * host-memory communicator. */
kiln_status kiln_comm_set_stream(kiln_comm *c, void *stream);
/* The CUDA device of a device communicator, -1 for a host one. */
int kiln_comm_device(const kiln_comm *c);

/* Close (NULL is a no-op): frees the scratch, frees the duplicate communicator, and
 * finalises MPI if kiln initialised it and no other kiln communicator still uses it. Not a
 * collective in kiln's sense, but MPI_Finalize waits for the other ranks: close on every
 * rank. */
void kiln_comm_close(kiln_comm *c);

/* 1 when this libkiln was built with the mpi implementation (KILN_MPI), else 0. */
int kiln_comm_have_mpi(void);

int kiln_comm_rank(const kiln_comm *c);       /* 0 .. size-1; 0 for NULL */
int kiln_comm_size(const kiln_comm *c);       /* >= 1; 1 for NULL */
/* This rank's index among the ranks on its machine (a GPU run picks its device from it):
 * OMPI_COMM_WORLD_LOCAL_RANK, MPI_LOCALRANKID or LOCAL_RANK from the launcher, else counted
 * with MPI_Comm_split_type(MPI_COMM_TYPE_SHARED); 0 for self and NULL. */
int kiln_comm_local_rank(const kiln_comm *c);
/* "self", "mpi" or "nccl" (for messages), "" for NULL. */
const char *kiln_comm_name(const kiln_comm *c);
/* 1 when the buffers of the collectives are host memory (self, mpi). */
int kiln_comm_host_memory(const kiln_comm *c);

/* Every rank waits until all have called it. */
kiln_status kiln_comm_barrier(kiln_comm *c);

/* buf: (nbytes) on every rank; root's bytes are copied into every other rank's buf.
 * 0 <= root < size. nbytes 0 does nothing. */
kiln_status kiln_comm_broadcast(kiln_comm *c, void *buf, size_t nbytes, int root);

/* recv: (size, nbytes_per_rank) bytes; send: (nbytes_per_rank). After the call every rank's
 * recv holds rank 0's send, then rank 1's, ... In place: send may be exactly this rank's
 * block of recv (recv + rank * nbytes_per_rank); any other overlap is refused. */
kiln_status kiln_comm_allgather(kiln_comm *c, void *recv, const void *send,
                                size_t nbytes_per_rank);

/* send, recv: (size, nbytes_per_rank) bytes each, not overlapping. Block k of this rank's
 * send goes to rank k, which stores it as its block (this rank). */
kiln_status kiln_comm_alltoall(kiln_comm *c, void *recv, const void *send,
                               size_t nbytes_per_rank);

/* send: (size, n_per_rank) floats on every rank; recv: (n_per_rank), not overlapping send.
 * Rank r receives block r of the sum over ranks, in rank order:
 *   recv[i] = (((+0.0f + s_0[i]) + s_1[i]) + ...) + s_{N-1}[i]
 * where s_k is rank k's send block r, each + one binary32 round-to-nearest addition. Starting
 * from +0.0f is deliberate: a sum of -0.0 from every rank is +0.0, as in one process that
 * accumulates into a zeroed buffer (and with N = 1, recv = +0.0f + send). Uses a host scratch
 * of size * n_per_rank floats that the communicator keeps (grown, never shrunk) until close. */
kiln_status kiln_comm_reduce_scatter_f32(kiln_comm *c, float *recv, const float *send,
                                         size_t n_per_rank);

/* send: (n) floats on every rank; recv: (n) floats on root, not overlapping send (ignored, and
 * may be NULL, on the other ranks). Root receives the sum over ranks in rank order, the same
 * sum as kiln_comm_reduce_scatter_f32's:
 *   recv[i] = (((+0.0f + s_0[i]) + s_1[i]) + ...) + s_{N-1}[i]
 * For a block that one rank owns (a data-parallel rank's piece of a layer's gradient): every
 * rank sends its block once, root alone receives. Root uses a host scratch of size * n floats
 * that the communicator keeps until close. 0 <= root < size. */
kiln_status kiln_comm_reduce_f32(kiln_comm *c, float *recv, const float *send, size_t n, int root);

/* x: (n) doubles on every rank, replaced on every rank by the sum over ranks in rank order,
 * (((+0.0 + x_0[i]) + x_1[i]) + ...) + x_{N-1}[i] in binary64: every rank gets the same bits.
 * For small values (losses, norms, counts); uses a host scratch of size * n doubles. */
kiln_status kiln_comm_allreduce_f64(kiln_comm *c, double *x, size_t n);

/* The largest single transfer, in bytes: 1 GiB unless set. Setting it (>= 1; for tests, so
 * that a small buffer crosses piece boundaries) must be done with the same value on every
 * rank. */
size_t kiln_comm_piece_bytes(const kiln_comm *c);
kiln_status kiln_comm_set_piece_bytes(kiln_comm *c, size_t piece_bytes);

/* ---- the launch the environment describes (kiln_comm_open's first step; tests) ----------- */

typedef enum kiln_comm_launch_kind {
    KILN_COMM_LAUNCH_SELF = 0,     /* no launcher: one process */
    KILN_COMM_LAUNCH_MPI = 1,      /* an MPI launcher's variables */
    KILN_COMM_LAUNCH_TORCHRUN = 2, /* torchrun's (WORLD_SIZE > 1, RANK, LOCAL_RANK, MASTER_ADDR,
                                    * MASTER_PORT) and no MPI launcher's: GPU ranks only */
} kiln_comm_launch_kind;

typedef struct kiln_comm_launch {
    kiln_comm_launch_kind kind;
    int size;        /* the launcher's world size; -1 when it gave none (PMIX_RANK alone) */
    int rank;        /* the launcher's rank; -1 when it gave none */
    int local_rank;  /* -1 when no variable gave it */
    const char *var; /* the variable that told of the launcher (the size's when there is one),
                      * for messages; NULL for self */
    /* torchrun: rank 0's address (MASTER_ADDR) and the port of kiln's rendezvous:
     * KILN_NCCL_PORT, else MASTER_PORT + 1 (torchrun's own store holds MASTER_PORT) */
    const char *master_addr;
    int rendezvous_port;
} kiln_comm_launch;

/* Read the launcher's variables (kiln_comm_open's rules above, before any MPI call). Errors:
 * KILN_ERR_INVALID_ARG naming a variable that is not a decimal integer in range (or a rank
 * not below the size), or torchrun's WORLD_SIZE > 1 without RANK, LOCAL_RANK, MASTER_ADDR or
 * MASTER_PORT. Whether kiln has MPI or NCCL is not checked here. */
kiln_status kiln_comm_launch_from_env(kiln_comm_launch *out);

#endif /* KILN_DIST_COMM_H */
