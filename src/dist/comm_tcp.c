/*
 * comm_tcp.c -- rank 0's small blob handed to the other ranks over TCP (the NCCL
 * communicator's unique id when torchrun's variables launched the ranks; docs/DISTRIBUTED.md,
 * "Launching GPU ranks"). No NCCL and no CUDA here, so CI tests it with forked processes.
 *
 * The exchange: rank 0 listens on addr:port; every other rank connects (retrying until the
 * deadline: rank 0 may start later) and sends a hello of 16 bytes, "KILNID01" then its rank and
 * the run's size as little-endian 32-bit integers; rank 0 checks both (a rank of another run,
 * or a second connection of one rank, is refused and dropped) and answers "KILNID01" then the
 * blob. Rank 0 returns once every rank 1 .. size-1 has been served.
 */
#define _DEFAULT_SOURCE /* getaddrinfo, struct addrinfo */
#include "comm_impl.h"

#include <errno.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

static const char k_magic[8] = {'K', 'I', 'L', 'N', 'I', 'D', '0', '1'};

static long long now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (long long)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* Wait until fd is readable (events POLLIN) or writable (POLLOUT) before the deadline. */
static int wait_fd(int fd, short events, long long deadline) {
    for (;;) {
        long long left = deadline - now_ms();
        if (left <= 0) return 0;
        struct pollfd p = {fd, events, 0};
        int r = poll(&p, 1, left > 1000 ? 1000 : (int)left);
        if (r > 0) return 1;
        if (r < 0 && errno != EINTR) return 0;
    }
}

/* All n bytes of buf sent / received before the deadline (1), or not (0). */
static int io_all(int fd, void *buf, size_t n, int send_it, long long deadline) {
    uint8_t *p = buf;
    while (n) {
        if (!wait_fd(fd, send_it ? POLLOUT : POLLIN, deadline)) return 0;
        ssize_t k = send_it ? send(fd, p, n, MSG_NOSIGNAL) : recv(fd, p, n, 0);
        if (k < 0 && (errno == EINTR || errno == EAGAIN)) continue;
        if (k <= 0) return 0;
        p += k;
        n -= (size_t)k;
    }
    return 1;
}

static void put32(uint8_t *p, uint32_t v) {
    for (int i = 0; i < 4; i++) p[i] = (uint8_t)(v >> (8 * i));
}
static uint32_t get32(const uint8_t *p) {
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

static kiln_status serve(int size, const char *addr, const char *port, const void *blob, size_t n,
                         long long deadline) {
    struct addrinfo hints = {0}, *res = NULL;
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    hints.ai_flags = AI_PASSIVE;
    int gai = getaddrinfo(addr, port, &hints, &res);
    if (gai != 0)
        return kiln_error(KILN_ERR_IO, "rank 0 cannot resolve %s:%s to listen on: %s", addr, port, gai_strerror(gai));
    int fd = -1, err = 0;
    for (struct addrinfo *a = res; a && fd < 0; a = a->ai_next) {
        fd = socket(a->ai_family, a->ai_socktype, a->ai_protocol);
        if (fd < 0) continue;
        int one = 1;
        (void)setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
        if (bind(fd, a->ai_addr, a->ai_addrlen) != 0 || listen(fd, size) != 0) {
            err = errno;
            close(fd);
            fd = -1;
        }
    }
    freeaddrinfo(res);
    if (fd < 0)
        return kiln_error(KILN_ERR_IO, "rank 0 cannot listen on %s:%s: %s (another run's port? set KILN_NCCL_PORT)",
                          addr, port, strerror(err ? err : EADDRNOTAVAIL));
    uint8_t *served = kiln_calloc((size_t)size, 1);
    kiln_status st = served ? KILN_OK : kiln_error(KILN_ERR_NOMEM, "out of memory");
    int left = size - 1;
    while (st == KILN_OK && left > 0) {
        if (!wait_fd(fd, POLLIN, deadline)) {
            st = kiln_error(KILN_ERR_IO, "rank 0 waited for the other ranks on %s:%s and %d of %d never came", addr,
                            port, left, size - 1);
            break;
        }
        int cfd = accept(fd, NULL, NULL);
        if (cfd < 0) continue;
        uint8_t hello[16];
        const long long peer_deadline = now_ms() + 10000 < deadline ? now_ms() + 10000 : deadline;
        if (io_all(cfd, hello, sizeof hello, 0, peer_deadline) && !memcmp(hello, k_magic, 8)) {
            const uint32_t r = get32(hello + 8), s = get32(hello + 12);
            if (s == (uint32_t)size && r >= 1 && r < (uint32_t)size && !served[r] &&
                io_all(cfd, (void *)k_magic, 8, 1, peer_deadline) && io_all(cfd, (void *)blob, n, 1, peer_deadline)) {
                served[r] = 1;
                left--;
            }
        }
        close(cfd); /* a stranger, or a rank of another size: dropped */
    }
    kiln_free(served);
    close(fd);
    return st;
}

static kiln_status fetch(int rank, int size, const char *addr, const char *port, void *blob, size_t n,
                         long long deadline) {
    struct addrinfo hints = {0};
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    const char *why = "no answer";
    for (;;) {
        struct addrinfo *res = NULL;
        int gai = getaddrinfo(addr, port, &hints, &res);
        if (gai != 0)
            return kiln_error(KILN_ERR_IO, "rank %d cannot resolve rank 0's address %s:%s: %s", rank, addr, port,
                              gai_strerror(gai));
        for (struct addrinfo *a = res; a; a = a->ai_next) {
            int fd = socket(a->ai_family, a->ai_socktype, a->ai_protocol);
            if (fd < 0) continue;
            if (connect(fd, a->ai_addr, a->ai_addrlen) != 0) {
                why = strerror(errno);
                close(fd);
                continue;
            }
            uint8_t hello[16], magic[8];
            memcpy(hello, k_magic, 8);
            put32(hello + 8, (uint32_t)rank);
            put32(hello + 12, (uint32_t)size);
            const int ok = io_all(fd, hello, sizeof hello, 1, deadline) && io_all(fd, magic, 8, 0, deadline) &&
                           !memcmp(magic, k_magic, 8) && io_all(fd, blob, n, 0, deadline);
            close(fd);
            if (ok) {
                freeaddrinfo(res);
                return KILN_OK;
            }
            why = "rank 0 closed the connection (a run of another size, or this rank served already)";
        }
        freeaddrinfo(res);
        if (now_ms() >= deadline)
            return kiln_error(KILN_ERR_IO, "rank %d could not get the run's id from rank 0 at %s:%s: %s", rank, addr,
                              port, why);
        struct timespec ts = {0, 100 * 1000000L};
        nanosleep(&ts, NULL);
    }
}

kiln_status kiln_comm_tcp_share(int rank, int size, const char *addr, int port, void *blob, size_t n,
                                int timeout_ms) {
    if (!addr || !blob || !n || size < 1 || rank < 0 || rank >= size || port < 1 || port > 65535 || timeout_ms < 0)
        return kiln_error(KILN_ERR_INVALID_ARG, "kiln_comm_tcp_share: rank %d of %d, %s:%d, %zu bytes", rank, size,
                          addr ? addr : "(null)", port, n);
    if (size == 1) return KILN_OK;
    char ps[16];
    snprintf(ps, sizeof ps, "%d", port);
    const long long deadline = now_ms() + timeout_ms;
    return rank == 0 ? serve(size, addr, ps, blob, n, deadline) : fetch(rank, size, addr, ps, blob, n, deadline);
}
