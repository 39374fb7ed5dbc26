/* test_comm.c -- the communicator (src/dist/comm.h). ctest runs it once alone (the self
 * communicator, and the launch rules on made-up environments) and, with KILN_MPI, under
 * mpirun with 1, 2 and 4 ranks. Every rank makes every rank's data from a seed, so each
 * computes the expected result of a collective alone and checks it bit for bit: allgather
 * (sizes 0, 1, odd, many pieces; in place), alltoall, broadcast from a non-zero root,
 * reduce_scatter_f32 and allreduce_f64 against the sum in rank order from +0 (with values
 * whose sum depends on the order, checked to depend on it), argument errors, and, with 2
 * ranks, an MPI error (a truncated message) reported with MPI's text. */
#include "base/base.h"
#include "dist/comm.h"
#include "dist/comm_impl.h" /* kiln_comm_tcp_share */
#include "test_util.h"

#include <arpa/inet.h>
#include <math.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>
#include <stdint.h>

#define SEED 0x636f6d6d5eedull

static uint64_t mix(uint64_t x) { /* splitmix64's output function */
    x += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}
static uint64_t hash3(int rank, int tag, size_t i) {
    return mix(SEED ^ ((uint64_t)(unsigned)tag << 48) ^ ((uint64_t)(unsigned)rank << 40) ^
               mix((uint64_t)i));
}
/* rank's byte i of the data of test tag */
static uint8_t data_byte(int rank, int tag, size_t i) {
    return (uint8_t)(hash3(rank, tag, i) >> 56);
}

/* Values whose sums round differently in another order: sign, 24 random mantissa bits and an
 * exponent in [-20, 20]. Elements 0..2 of every block are special, the same at every size:
 *   0: 1e8, 1, -1e8, 1, 1, ...  in rank order: 1 (reversed: 0; pairs (1e8+1)+(-1e8+1): 0)
 *   1: -0.0 on every rank       +0.0 (the sum starts at +0)
 *   2: 1, 1e8, -1e8, 0, ...     in rank order 0 (from the first three ranks) */
static float value_f32(int rank, int tag, int block, size_t i) {
    if (i == 0) return rank == 0 ? 1e8f : rank == 2 ? -1e8f : 1.0f;
    if (i == 1) return -0.0f;
    if (i == 2) return rank == 0 ? 1.0f : rank == 1 ? 1e8f : rank == 2 ? -1e8f : 0.0f;
    uint64_t h = hash3(rank, tag * 64 + block, i);
    float m = 1.0f + (float)(h & 0xffffff) / 16777216.0f;
    float v = ldexpf(m, (int)((h >> 24) % 41) - 20);
    return (h >> 63) ? -v : v;
}
static double value_f64(int rank, int tag, size_t i) {
    if (i == 0) return rank == 0 ? 1e17 : rank == 2 ? -1e17 : 1.0;
    if (i == 1) return -0.0;
    uint64_t h = hash3(rank, tag, i);
    double m = 1.0 + (double)(h & 0xfffffffffffffull) / 4503599627370496.0;
    double v = ldexp(m, (int)((h >> 52) % 81) - 40);
    return (h >> 63) ? -v : v;
}
static uint64_t bits64(double d) {
    uint64_t u;
    memcpy(&u, &d, 8);
    return u;
}

static int g_rank, g_size;

/* every rank's block b element i of reduce_scatter's input: value_f32(rank, tag, b, i) */
static void check_reduce_scatter(kiln_comm *c, size_t n, int tag) {
    float *send = malloc((size_t)g_size * n * sizeof(float) + 1);
    float *recv = malloc(n * sizeof(float) + 1), *want = malloc(n * sizeof(float) + 1);
    float *rev = malloc(n * sizeof(float) + 1), *tree = malloc(n * sizeof(float) + 1);
    for (int b = 0; b < g_size; b++)
        for (size_t i = 0; i < n; i++) send[(size_t)b * n + i] = value_f32(g_rank, tag, b, i);
    poison(recv, n);
    for (size_t i = 0; i < n; i++) {
        float acc = 0.0f;
        for (int k = 0; k < g_size; k++) acc = acc + value_f32(k, tag, g_rank, i);
        want[i] = acc;
        float racc = 0.0f;
        for (int k = g_size - 1; k >= 0; k--) racc = racc + value_f32(k, tag, g_rank, i);
        rev[i] = racc;
        /* a pairwise tree over ranks (what an MPI_SUM might do) */
        float part[64] = {0};
        int m = g_size;
        for (int k = 0; k < m; k++) part[k] = value_f32(k, tag, g_rank, i);
        while (m > 1) {
            for (int k = 0; k < m / 2; k++) part[k] = part[2 * k] + part[2 * k + 1];
            if (m % 2) part[m / 2] = part[m - 1];
            m = (m + 1) / 2;
        }
        tree[i] = 0.0f + part[0];
    }
    CHECK_ERR(kiln_comm_reduce_scatter_f32(c, recv, send, n), KILN_OK, "");
    CHECK_MSG(same_bits(recv, want, n, "reduce_scatter_f32"), "rank %d of %d, n %zu", g_rank,
              g_size, n);
    if (n > 1) CHECK_MSG(bits(recv[1]) == 0, "-0.0 from every rank must sum to +0.0, got 0x%08x",
                         bits(recv[1]));
    /* the data must tell the rank order from the reversed order and from a tree, else the
     * check above could not fail for a wrong order (2 ranks: a + b is commutative) */
    if (g_size >= 3 && n > 0) {
        size_t diff_rev = 0, diff_tree = 0;
        for (size_t i = 0; i < n; i++) {
            diff_rev += bits(rev[i]) != bits(want[i]);
            diff_tree += bits(tree[i]) != bits(want[i]);
        }
        CHECK_MSG(diff_rev > 0 && diff_tree > 0, "order-blind data: %zu, %zu differ", diff_rev,
                  diff_tree);
    }
    free(send);
    free(recv);
    free(want);
    free(rev);
    free(tree);
}

/* reduce_f32 to root: every rank sends value_f32(rank, tag, 0, i); root's recv must be the
 * rank-order sum (the data tells that order from others: check_reduce_scatter); on the other
 * ranks recv is not written (NULL on odd ranks, a poisoned buffer on even ones) */
static void check_reduce(kiln_comm *c, size_t n, int root, int tag) {
    float *send = malloc(n * sizeof(float) + 1), *recv = malloc(n * sizeof(float) + 1);
    float *want = malloc(n * sizeof(float) + 1);
    for (size_t i = 0; i < n; i++) {
        send[i] = value_f32(g_rank, tag, 0, i);
        float acc = 0.0f;
        for (int k = 0; k < g_size; k++) acc = acc + value_f32(k, tag, 0, i);
        want[i] = acc;
    }
    poison(recv, n);
    float *dst = g_rank == root || g_rank % 2 == 0 ? recv : NULL;
    CHECK_ERR(kiln_comm_reduce_f32(c, dst, send, n, root), KILN_OK, "");
    if (g_rank == root) {
        CHECK_MSG(same_bits(recv, want, n, "reduce_f32"), "rank %d of %d, root %d, n %zu", g_rank,
                  g_size, root, n);
        if (n > 1) CHECK(bits(recv[1]) == 0); /* -0.0 everywhere sums to +0.0 */
    } else {
        float *p = malloc(n * sizeof(float) + 1);
        poison(p, n);
        CHECK_MSG(n == 0 || memcmp(p, recv, n * sizeof(float)) == 0, "reduce_f32 wrote rank %d's recv "
                  "(root %d)", g_rank, root);
        free(p);
    }
    free(send);
    free(recv);
    free(want);
}

static void check_allreduce_f64(kiln_comm *c, size_t n) {
    double *x = malloc(n * sizeof(double) + 1);
    for (size_t i = 0; i < n; i++) x[i] = value_f64(g_rank, 9, i);
    CHECK_ERR(kiln_comm_allreduce_f64(c, x, n), KILN_OK, "");
    size_t bad = 0, diff_rev = 0;
    for (size_t i = 0; i < n; i++) {
        double acc = 0.0, racc = 0.0;
        for (int k = 0; k < g_size; k++) acc = acc + value_f64(k, 9, i);
        for (int k = g_size - 1; k >= 0; k--) racc = racc + value_f64(k, 9, i);
        bad += bits64(x[i]) != bits64(acc);
        diff_rev += bits64(racc) != bits64(acc);
    }
    CHECK_MSG(bad == 0, "allreduce_f64: %zu of %zu elements differ from the rank-order sum", bad,
              n);
    if (n > 1) CHECK(bits64(x[1]) == 0); /* -0.0 everywhere sums to +0.0 */
    if (g_size >= 3 && n > 0) CHECK(diff_rev > 0);
    free(x);
}

static void check_allgather(kiln_comm *c, size_t nb, int tag, int in_place) {
    size_t total = (size_t)g_size * nb;
    uint8_t *recv = malloc(total + 1), *send = malloc(nb + 1);
    memset(recv, 0xa5, total + 1);
    uint8_t *src = in_place ? recv + (size_t)g_rank * nb : send;
    for (size_t i = 0; i < nb; i++) src[i] = data_byte(g_rank, tag, i);
    CHECK_ERR(kiln_comm_allgather(c, recv, src, nb), KILN_OK, "");
    size_t bad = 0;
    for (int k = 0; k < g_size; k++)
        for (size_t i = 0; i < nb; i++) bad += recv[(size_t)k * nb + i] != data_byte(k, tag, i);
    CHECK_MSG(bad == 0 && recv[total] == 0xa5, "allgather %zu bytes/rank%s: %zu wrong bytes", nb,
              in_place ? " in place" : "", bad);
    free(recv);
    free(send);
}

static void check_alltoall(kiln_comm *c, size_t nb, int tag) {
    size_t total = (size_t)g_size * nb;
    uint8_t *recv = malloc(total + 1), *send = malloc(total + 1);
    for (size_t i = 0; i < total; i++) send[i] = data_byte(g_rank, tag, i);
    memset(recv, 0xa5, total + 1);
    CHECK_ERR(kiln_comm_alltoall(c, recv, send, nb), KILN_OK, "");
    size_t bad = 0; /* block k: what rank k sent in its block g_rank */
    for (int k = 0; k < g_size; k++)
        for (size_t i = 0; i < nb; i++)
            bad += recv[(size_t)k * nb + i] != data_byte(k, tag, (size_t)g_rank * nb + i);
    CHECK_MSG(bad == 0 && recv[total] == 0xa5, "alltoall %zu bytes/rank: %zu wrong bytes", nb, bad);
    free(recv);
    free(send);
}

static void check_broadcast(kiln_comm *c, size_t nb, int root, int tag) {
    uint8_t *buf = malloc(nb + 1);
    for (size_t i = 0; i < nb; i++) buf[i] = data_byte(g_rank, tag, i);
    buf[nb] = 0xa5;
    CHECK_ERR(kiln_comm_broadcast(c, buf, nb, root), KILN_OK, "");
    size_t bad = 0;
    for (size_t i = 0; i < nb; i++) bad += buf[i] != data_byte(root, tag, i);
    CHECK_MSG(bad == 0 && buf[nb] == 0xa5, "broadcast %zu bytes from %d: %zu wrong", nb, root, bad);
    free(buf);
}

static void check_collectives(kiln_comm *c) {
    CHECK_ERR(kiln_comm_barrier(c), KILN_OK, "");
    static const size_t sizes[] = {0, 1, 13, 4099};
    for (size_t s = 0; s < sizeof sizes / sizeof sizes[0]; s++) {
        check_allgather(c, sizes[s], 1, 0);
        check_allgather(c, sizes[s], 2, 1);
        check_alltoall(c, sizes[s], 3);
        check_broadcast(c, sizes[s], g_size - 1, 4);
        check_broadcast(c, sizes[s], 0, 5);
        check_reduce_scatter(c, sizes[s], 6);
        check_reduce(c, sizes[s], 0, 13);
        check_reduce(c, sizes[s], g_size - 1, 14);
        check_allreduce_f64(c, sizes[s]);
    }
    /* many pieces: 7 bytes (not a multiple of a float) and a piece of one byte */
    static const size_t pieces[] = {7, 1};
    for (size_t p = 0; p < 2; p++) {
        CHECK_ERR(kiln_comm_set_piece_bytes(c, pieces[p]), KILN_OK, "");
        CHECK(kiln_comm_piece_bytes(c) == pieces[p]);
        check_allgather(c, 100, 7, 0);
        check_allgather(c, 61, 8, 1);
        check_alltoall(c, 45, 10);
        check_broadcast(c, 1000, g_size - 1, 11);
        check_reduce_scatter(c, 25, 12);
        check_reduce(c, 25, g_size / 2, 15);
        check_allreduce_f64(c, 9);
    }
    CHECK_ERR(kiln_comm_set_piece_bytes(c, (size_t)1 << 30), KILN_OK, "");
    CHECK_ERR(kiln_comm_barrier(c), KILN_OK, "");
}

/* Refused before any traffic, the same on every rank: the communicator stays usable. */
static void check_argument_errors(kiln_comm *c) {
    float f[8] = {0};
    uint8_t b[64];
    CHECK_ERR(kiln_comm_barrier(NULL), KILN_ERR_INVALID_ARG, "NULL");
    CHECK_ERR(kiln_comm_broadcast(c, b, 4, -1), KILN_ERR_INVALID_ARG, "root -1");
    CHECK_ERR(kiln_comm_broadcast(c, b, 4, g_size), KILN_ERR_INVALID_ARG, "is not a rank");
    CHECK_ERR(kiln_comm_broadcast(c, NULL, 4, 0), KILN_ERR_INVALID_ARG, "buf is NULL");
    CHECK_ERR(kiln_comm_allgather(c, b, b + g_rank * 4 + 1, 4), KILN_ERR_INVALID_ARG, "overlaps");
    CHECK_ERR(kiln_comm_allgather(c, NULL, b, 4), KILN_ERR_INVALID_ARG, "recv is NULL");
    CHECK_ERR(kiln_comm_alltoall(c, b, b + 1, 4), KILN_ERR_INVALID_ARG, "overlap");
    CHECK_ERR(kiln_comm_reduce_scatter_f32(c, f, f, 1), KILN_ERR_INVALID_ARG, "overlaps");
    CHECK_ERR(kiln_comm_reduce_scatter_f32(c, f, f + 4, SIZE_MAX / 2), KILN_ERR_RANGE, "overflows");
    if (g_size == 1) /* root's own refusal (other ranks would go on to the traffic) */
        CHECK_ERR(kiln_comm_reduce_f32(c, f, f, 1, 0), KILN_ERR_INVALID_ARG, "overlaps");
    CHECK_ERR(kiln_comm_reduce_f32(c, f, f, 1, g_size), KILN_ERR_INVALID_ARG, "is not a rank");
    CHECK_ERR(kiln_comm_reduce_f32(c, f, NULL, 1, 0), KILN_ERR_INVALID_ARG, "send is NULL");
    CHECK_ERR(kiln_comm_reduce_f32(c, f, f + 4, SIZE_MAX / 2, 0), KILN_ERR_RANGE, "overflows");
    CHECK_ERR(kiln_comm_allreduce_f64(c, NULL, 3), KILN_ERR_INVALID_ARG, "x is NULL");
    CHECK_ERR(kiln_comm_allreduce_f64(c, (double *)f, SIZE_MAX / 4), KILN_ERR_RANGE, "overflows");
    CHECK_ERR(kiln_comm_set_piece_bytes(c, 0), KILN_ERR_INVALID_ARG, "piece_bytes 0");
    CHECK_ERR(kiln_comm_set_piece_bytes(c, (size_t)INT32_MAX + 1), KILN_ERR_INVALID_ARG, "not in");
    CHECK(kiln_comm_piece_bytes(c) == (size_t)1 << 30);
    CHECK_ERR(kiln_comm_barrier(c), KILN_OK, ""); /* still in step */
}

/* ---- the launch rules, on made-up environments (the plain run only) ---------------------- */

static const char *const LAUNCH_VARS[] = {
    "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "PMI_SIZE",
    "PMI_RANK", "PMIX_RANK", "MPI_LOCALRANKID", "WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR",
    "MASTER_PORT", "KILN_NCCL_PORT"};
#define N_LAUNCH_VARS (sizeof LAUNCH_VARS / sizeof LAUNCH_VARS[0])

static void clear_launch_env(void) {
    for (size_t i = 0; i < N_LAUNCH_VARS; i++) unsetenv(LAUNCH_VARS[i]);
}

static void check_launch_rules(void) {
    kiln_comm_launch l;
    clear_launch_env();
    CHECK_ERR(kiln_comm_launch_from_env(&l), KILN_OK, "");
    CHECK(l.kind == KILN_COMM_LAUNCH_SELF && l.size == 1 && l.rank == 0 && l.local_rank == 0);

    /* torchrun: WORLD_SIZE > 1 is GPU ranks' (NCCL), and needs its other variables; CPU ranks
     * need mpirun; WORLD_SIZE 1 is one process */
    setenv("WORLD_SIZE", "2", 1);
    setenv("RANK", "1", 1);
    setenv("LOCAL_RANK", "1", 1);
    CHECK_ERR(kiln_comm_launch_from_env(&l), KILN_ERR_INVALID_ARG, "MASTER_ADDR is not set");
    setenv("MASTER_ADDR", "127.0.0.1", 1);
    CHECK_ERR(kiln_comm_launch_from_env(&l), KILN_ERR_INVALID_ARG, "MASTER_PORT is not set");
    setenv("MASTER_PORT", "29500", 1);
    CHECK_ERR(kiln_comm_launch_from_env(&l), KILN_OK, "");
    CHECK(l.kind == KILN_COMM_LAUNCH_TORCHRUN && l.size == 2 && l.rank == 1 && l.local_rank == 1);
    CHECK(l.master_addr && !strcmp(l.master_addr, "127.0.0.1") && l.rendezvous_port == 29501);
    setenv("KILN_NCCL_PORT", "40000", 1);
    CHECK_ERR(kiln_comm_launch_from_env(&l), KILN_OK, "");
    CHECK(l.rendezvous_port == 40000);
    setenv("MASTER_PORT", "65535", 1);
    unsetenv("KILN_NCCL_PORT");
    CHECK_ERR(kiln_comm_launch_from_env(&l), KILN_ERR_INVALID_ARG, "not a TCP port");
    setenv("MASTER_PORT", "29500", 1);
    setenv("RANK", "2", 1);
    CHECK_ERR(kiln_comm_launch_from_env(&l), KILN_ERR_INVALID_ARG, "RANK=2 is not below WORLD_SIZE=2");
    setenv("RANK", "1", 1);
    kiln_comm *c = NULL;
    CHECK_ERR(kiln_comm_open(&c), KILN_ERR_UNSUPPORTED, "WORLD_SIZE=2 (torchrun");
    CHECK(c == NULL);
    if (!kiln_comm_have_nccl()) {
        CHECK_ERR(kiln_comm_open_nccl(0, &c), KILN_ERR_UNSUPPORTED, "built without NCCL");
        CHECK(c == NULL);
    }
    unsetenv("MASTER_ADDR");
    unsetenv("MASTER_PORT");
    setenv("WORLD_SIZE", "1", 1);
    CHECK_ERR(kiln_comm_launch_from_env(&l), KILN_ERR_INVALID_ARG, "RANK=1 with WORLD_SIZE=1");
    setenv("RANK", "0", 1);
    CHECK_ERR(kiln_comm_launch_from_env(&l), KILN_OK, "");
    CHECK(l.kind == KILN_COMM_LAUNCH_SELF && l.local_rank == 0);
    setenv("WORLD_SIZE", "two", 1);
    CHECK_ERR(kiln_comm_launch_from_env(&l), KILN_ERR_INVALID_ARG, "WORLD_SIZE='two'");
    setenv("WORLD_SIZE", "99999999999", 1);
    CHECK_ERR(kiln_comm_launch_from_env(&l), KILN_ERR_INVALID_ARG, "not a decimal integer");
    setenv("WORLD_SIZE", "0", 1);
    CHECK_ERR(kiln_comm_launch_from_env(&l), KILN_ERR_INVALID_ARG, "[1, ");
    clear_launch_env();

    /* Open MPI's mpirun */
    setenv("OMPI_COMM_WORLD_SIZE", "4", 1);
    setenv("OMPI_COMM_WORLD_RANK", "2", 1);
    setenv("OMPI_COMM_WORLD_LOCAL_RANK", "1", 1);
    setenv("WORLD_SIZE", "8", 1); /* an MPI launcher's variables win over torchrun's */
    CHECK_ERR(kiln_comm_launch_from_env(&l), KILN_OK, "");
    CHECK(l.kind == KILN_COMM_LAUNCH_MPI && l.size == 4 && l.rank == 2 && l.local_rank == 1);
    CHECK(l.var && strcmp(l.var, "OMPI_COMM_WORLD_SIZE") == 0);
    if (!kiln_comm_have_mpi()) {
        c = NULL;
        CHECK_ERR(kiln_comm_open(&c), KILN_ERR_UNSUPPORTED, "built without MPI");
        CHECK(c == NULL);
    }
    setenv("OMPI_COMM_WORLD_RANK", "4", 1);
    CHECK_ERR(kiln_comm_launch_from_env(&l), KILN_ERR_INVALID_ARG, "rank 4 is not below");
    setenv("OMPI_COMM_WORLD_RANK", "-1", 1);
    CHECK_ERR(kiln_comm_launch_from_env(&l), KILN_ERR_INVALID_ARG, "OMPI_COMM_WORLD_RANK='-1'");
    clear_launch_env();

    /* MPICH's Hydra / Slurm's PMI; a PMIx server that gives only the rank */
    setenv("PMI_SIZE", "3", 1);
    setenv("PMI_RANK", "1", 1);
    setenv("MPI_LOCALRANKID", "0", 1);
    CHECK_ERR(kiln_comm_launch_from_env(&l), KILN_OK, "");
    CHECK(l.kind == KILN_COMM_LAUNCH_MPI && l.size == 3 && l.rank == 1 && l.local_rank == 0);
    clear_launch_env();
    setenv("PMIX_RANK", "5", 1);
    CHECK_ERR(kiln_comm_launch_from_env(&l), KILN_OK, "");
    CHECK(l.kind == KILN_COMM_LAUNCH_MPI && l.size == -1 && l.rank == 5 && l.local_rank == -1);
    CHECK(l.var && strcmp(l.var, "PMIX_RANK") == 0);
    clear_launch_env();
    CHECK_ERR(kiln_comm_launch_from_env(NULL), KILN_ERR_INVALID_ARG, "NULL");
    CHECK_ERR(kiln_comm_open(NULL), KILN_ERR_INVALID_ARG, "NULL");
}

/* With 2 ranks: rank 0 gathers 8 bytes a rank and rank 1 4, so rank 1 receives a message
 * longer than its buffer. MPI reports MPI_ERR_TRUNCATE to rank 1 (rank 0's receive of the
 * shorter message is legal), which must come back as a status with MPI's text, and leave
 * rank 1's communicator refusing further work. */
static void check_mpi_error(void) {
    kiln_comm *c = NULL;
    CHECK_ERR(kiln_comm_open(&c), KILN_OK, "");
    if (!c) return;
    uint8_t recv[16] = {0}, send[8] = {1, 2, 3, 4, 5, 6, 7, 8};
    kiln_status st = kiln_comm_allgather(c, recv, send, g_rank == 0 ? 8 : 4);
    if (g_rank == 0) {
        CHECK(st == KILN_OK);
    } else {
        CHECK_MSG(st == KILN_ERR_IO && strstr(kiln_last_error(), "kiln_comm_allgather") &&
                      strstr(kiln_last_error(), "MPI_Sendrecv") &&
                      strstr(kiln_last_error(), "MPI_ERR_TRUNCATE"),
                  "got %d '%s'", (int)st, kiln_last_error());
        CHECK_ERR(kiln_comm_barrier(c), KILN_ERR_STATE, "out of step");
    }
    kiln_comm_close(c);
}

/* A TCP port free on 127.0.0.1 right now (the system's pick for port 0), or 0. */
static int free_port(void) {
    int fd = socket(AF_INET, SOCK_STREAM, 0), port = 0;
    struct sockaddr_in a;
    memset(&a, 0, sizeof a);
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof a;
    if (fd >= 0 && bind(fd, (struct sockaddr *)&a, sizeof a) == 0 && getsockname(fd, (struct sockaddr *)&a, &len) == 0)
        port = ntohs(a.sin_port);
    if (fd >= 0) close(fd);
    return port;
}

/* comm_tcp.c's hand-over of rank 0's blob, with forked processes as ranks 1..3 (the plain run
 * only): every rank ends with rank 0's bytes; a rank of another run's size is turned away, and a
 * rank with nobody to listen times out with a message naming the address. */
static void check_tcp_share(void) {
    const int size = 4, port = free_port();
    CHECK(port > 0);
    if (port <= 0) return;
    uint8_t blob[128];
    for (int i = 0; i < 128; i++) blob[i] = (uint8_t)(i * 37 + 11);
    pid_t kids[3];
    for (int r = 1; r < size; r++) {
        kids[r - 1] = fork();
        if (kids[r - 1] == 0) {
            uint8_t got[128] = {0};
            if (r == 2) { /* a stranger first: a run of 3 ranks asking the same port */
                uint8_t x[128];
                (void)kiln_comm_tcp_share(1, 3, "127.0.0.1", port, x, sizeof x, 1500);
            }
            kiln_status st = kiln_comm_tcp_share(r, size, "127.0.0.1", port, got, sizeof got, 20000);
            _exit(st == KILN_OK && memcmp(got, blob, sizeof got) == 0 ? 0 : 1);
        }
    }
    uint8_t mine[128];
    memcpy(mine, blob, sizeof mine);
    struct timespec ts = {0, 200 * 1000000L}; /* the others start first and retry */
    nanosleep(&ts, NULL);
    CHECK_ERR(kiln_comm_tcp_share(0, size, "127.0.0.1", port, mine, sizeof mine, 20000), KILN_OK, "");
    for (int r = 1; r < size; r++) {
        int status = -1;
        CHECK(waitpid(kids[r - 1], &status, 0) == kids[r - 1] && WIFEXITED(status) && WEXITSTATUS(status) == 0);
    }
    uint8_t none[16];
    CHECK_ERR(kiln_comm_tcp_share(1, 2, "127.0.0.1", port, none, sizeof none, 300), KILN_ERR_IO, "127.0.0.1:");
    CHECK_ERR(kiln_comm_tcp_share(0, 1, "127.0.0.1", port, none, sizeof none, 0), KILN_OK, ""); /* alone */
    CHECK_ERR(kiln_comm_tcp_share(2, 2, "127.0.0.1", port, none, sizeof none, 0), KILN_ERR_INVALID_ARG, "rank 2 of 2");
}

int main(void) {
    kiln_mem_stats m0, m1;
    kiln_mem_get_stats(&m0);
    kiln_comm_launch launch;
    CHECK_ERR(kiln_comm_launch_from_env(&launch), KILN_OK, "");
    const int launched = launch.kind == KILN_COMM_LAUNCH_MPI;
    if (!launched) check_launch_rules();
    if (!launched) check_tcp_share();

    kiln_comm *c = NULL;
    CHECK_ERR(kiln_comm_open(&c), KILN_OK, "");
    if (!c) return test_finish("test_comm");
    g_rank = kiln_comm_rank(c);
    g_size = kiln_comm_size(c);
    CHECK(g_size >= 1 && g_rank >= 0 && g_rank < g_size && g_size <= 64);
    CHECK(kiln_comm_host_memory(c) == 1);
    if (launched) {
        CHECK(strcmp(kiln_comm_name(c), "mpi") == 0);
        CHECK(launch.size < 0 || launch.size == g_size);
        const char *lr = getenv("OMPI_COMM_WORLD_LOCAL_RANK");
        if (lr) CHECK(kiln_comm_local_rank(c) == atoi(lr));
        CHECK(kiln_comm_local_rank(c) >= 0 && kiln_comm_local_rank(c) < g_size);
    } else {
        CHECK(strcmp(kiln_comm_name(c), "self") == 0 && g_size == 1 && g_rank == 0);
        CHECK(kiln_comm_local_rank(c) == 0);
    }

    check_collectives(c);
    check_argument_errors(c);

    /* a second communicator beside the first (MPI initialised once, finalised after both) */
    kiln_comm *c2 = NULL;
    CHECK_ERR(kiln_comm_open(&c2), KILN_OK, "");
    if (c2) {
        CHECK(kiln_comm_rank(c2) == g_rank && kiln_comm_size(c2) == g_size);
        CHECK_ERR(kiln_comm_barrier(c2), KILN_OK, "");
        check_allgather(c, 5, 20, 0);
        kiln_comm_close(c);
        c = NULL;
        check_allgather(c2, 5, 21, 1);
        check_reduce_scatter(c2, 17, 22);
        if (launched && g_size == 2) check_mpi_error();
        kiln_comm_close(c2);
    }
    kiln_comm_close(c);
    kiln_comm_close(NULL);
    if (launched) {
        /* kiln finalised MPI with its last communicator: MPI cannot start again */
        c = NULL;
        CHECK_ERR(kiln_comm_open(&c), KILN_ERR_STATE, "finalised");
        CHECK(c == NULL);
    }
    /* the self communicator, whatever the environment */
    CHECK_ERR(kiln_comm_open_self(&c), KILN_OK, "");
    CHECK(kiln_comm_size(c) == 1 && strcmp(kiln_comm_name(c), "self") == 0);
    kiln_comm_close(c);

    kiln_mem_get_stats(&m1);
    CHECK_MSG(m1.live_blocks == m0.live_blocks, "%zu kiln blocks leaked",
              (size_t)(m1.live_blocks - m0.live_blocks));
    char name[64];
    snprintf(name, sizeof name, "test_comm (rank %d of %d)", g_rank, g_size);
    return test_finish(name);
}
