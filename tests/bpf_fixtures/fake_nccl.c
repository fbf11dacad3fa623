/* An NCCL-shaped libnccl.so.2 for the bpf and netns tests: real signatures (the 128-byte ncclUniqueId
 * passed by value, ncclReduce's communicator on the stack).
 *
 * Two modes, chosen by the environment of the process:
 *
 * - FAKE_NCCL_ROOT unset (the bpf "counts" workload): no network. ncclGetUniqueId fills byte i with i,
 *   communicators are 0x5000 + rank * 0x100 (ncclCommInitAll: 0x9000 + i * 0x100), calls return at once.
 *
 * - FAKE_NCCL_ROOT=ip:port (a job of several processes, e.g. one per network namespace): ranks really
 *   synchronise. ncclGetUniqueId builds the id every rank of the job derives alike: bytes 0-7 "fakenccl"
 *   (the same for every job, as NCCL's leading bootstrap-address bytes are), 8-11 the root's IPv4, 12-13
 *   its port, 14-127 a stream seeded by FAKE_NCCL_JOB. ncclCommInitRank connects to a rendezvous server
 *   at that address (rank 0 hosts it in a thread) and every collective (all-reduce, broadcast, reduce,
 *   all-gather, reduce-scatter) is a barrier over it: a call returns only when every rank has entered
 *   it. Point-to-point send/recv return at once. Communicators are heap pointers (one per process).
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

typedef struct { char internal[128]; } ncclUniqueId;
typedef struct ncclComm *ncclComm_t;
typedef int ncclResult_t;
typedef int ncclDataType_t;
typedef int ncclRedOp_t;
typedef void *cudaStream_t;

struct ncclComm {
    int fd;  /* connection to the rendezvous server; -1: no network (counts mode) */
    int rank;
    int nranks;
};

enum { ncclSuccess = 0, ncclSystemError = 2, ncclInvalidArgument = 4 };

static int parse_root(const char *text, uint32_t *ip, uint16_t *port) {
    char host[64];
    const char *colon = strrchr(text, ':');
    if (!colon || (size_t)(colon - text) >= sizeof host)
        return -1;
    memcpy(host, text, (size_t)(colon - text));
    host[colon - text] = 0;
    struct in_addr a;
    if (inet_pton(AF_INET, host, &a) != 1)
        return -1;
    *ip = a.s_addr;
    *port = htons((uint16_t)atoi(colon + 1));
    return 0;
}

ncclResult_t ncclGetUniqueId(ncclUniqueId *id) {
    const char *root = getenv("FAKE_NCCL_ROOT");
    if (!root) {
        for (int i = 0; i < 128; i++)
            id->internal[i] = (char)i;
        return ncclSuccess;
    }
    uint32_t ip;
    uint16_t port;
    if (parse_root(root, &ip, &port))
        return ncclInvalidArgument;
    memcpy(id->internal, "fakenccl", 8);
    memcpy(id->internal + 8, &ip, 4);
    memcpy(id->internal + 12, &port, 2);
    const char *job = getenv("FAKE_NCCL_JOB");
    uint64_t x = 0x243F6A8885A308D3ULL;
    for (const char *p = job ? job : ""; *p; p++)
        x = (x ^ (uint8_t)*p) * 0x100000001B3ULL;
    for (int i = 14; i < 128; i++) {
        x ^= x << 13, x ^= x >> 7, x ^= x << 17;
        id->internal[i] = (char)(x >> 24);
    }
    return ncclSuccess;
}

static int full_io(int fd, void *buf, size_t n, int writing) {
    char *p = buf;
    while (n) {
        ssize_t k = writing ? write(fd, p, n) : read(fd, p, n);
        if (k <= 0)
            return -1;
        p += k;
        n -= (size_t)k;
    }
    return 0;
}

struct server {
    int listen_fd;
    int nranks;
};

/* The rendezvous: accept every rank, then forever: one byte in from each rank, one byte out to each. */
static void *serve(void *arg) {
    struct server *sv = arg;
    int *fds = calloc((size_t)sv->nranks, sizeof(int));
    for (int i = 0; i < sv->nranks; i++) {
        int fd = accept(sv->listen_fd, NULL, NULL);
        int r = -1, one = 1;
        if (fd < 0 || full_io(fd, &r, sizeof r, 0) || r < 0 || r >= sv->nranks)
            return NULL;
        setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
        fds[r] = fd;
    }
    close(sv->listen_fd);
    for (;;) {
        char c;
        for (int i = 0; i < sv->nranks; i++)
            if (full_io(fds[i], &c, 1, 0))
                return NULL; /* a rank left: the job is over */
        /* rank 0 (this process) last: once it has its byte it may return, finish and exit */
        for (int i = sv->nranks - 1; i >= 0; i--)
            full_io(fds[i], &c, 1, 1);
    }
}

static int start_server(uint32_t ip, uint16_t port, int nranks) {
    struct server *sv = malloc(sizeof *sv);
    int one = 1;
    sv->nranks = nranks;
    sv->listen_fd = socket(AF_INET, SOCK_STREAM, 0);
    setsockopt(sv->listen_fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = port, .sin_addr.s_addr = ip};
    if (bind(sv->listen_fd, (struct sockaddr *)&a, sizeof a) || listen(sv->listen_fd, nranks))
        return -1;
    pthread_t t;
    pthread_create(&t, NULL, serve, sv);
    pthread_detach(t);
    return 0;
}

static int connect_root(uint32_t ip, uint16_t port, int rank) {
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = port, .sin_addr.s_addr = ip};
    for (int tries = 0; tries < 3000; tries++) { /* the root may not listen yet: up to ~30 s */
        int fd = socket(AF_INET, SOCK_STREAM, 0), one = 1;
        if (connect(fd, (struct sockaddr *)&a, sizeof a) == 0) {
            setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
            if (full_io(fd, &rank, sizeof rank, 1) == 0)
                return fd;
        }
        close(fd);
        struct timespec ts = {0, 10 * 1000 * 1000};
        nanosleep(&ts, NULL);
    }
    return -1;
}

ncclResult_t ncclCommInitRank(ncclComm_t *comm, int nranks, ncclUniqueId commId, int rank) {
    if (rank < 0 || rank >= nranks)
        return ncclInvalidArgument;
    if (!getenv("FAKE_NCCL_ROOT")) {
        if (commId.internal[5] != 5)
            return ncclInvalidArgument;
        *comm = (ncclComm_t)(uintptr_t)(0x5000 + rank * 0x100);
        return ncclSuccess;
    }
    if (memcmp(commId.internal, "fakenccl", 8))
        return ncclInvalidArgument;
    uint32_t ip;
    uint16_t port;
    memcpy(&ip, commId.internal + 8, 4);
    memcpy(&port, commId.internal + 12, 2);
    if (rank == 0 && start_server(INADDR_ANY, port, nranks))
        return ncclSystemError;
    int fd = connect_root(ip, port, rank);
    if (fd < 0)
        return ncclSystemError;
    struct ncclComm *c = malloc(sizeof *c);
    c->fd = fd;
    c->rank = rank;
    c->nranks = nranks;
    *comm = c;
    return ncclSuccess;
}

ncclResult_t ncclCommInitRankConfig(ncclComm_t *comm, int nranks, ncclUniqueId commId, int rank, void *config) {
    (void)config;
    return ncclCommInitRank(comm, nranks, commId, rank);
}

ncclResult_t ncclCommInitAll(ncclComm_t *comms, int ndev, const int *devlist) {
    for (int i = 0; i < ndev; i++)
        comms[i] = (ncclComm_t)(uintptr_t)(0x9000 + i * 0x100);
    return ncclSuccess;
}

/* Every rank enters; the call returns when all have. */
static ncclResult_t barrier(ncclComm_t comm) {
    if (!comm)
        return ncclInvalidArgument;
    if (!getenv("FAKE_NCCL_ROOT"))
        return ncclSuccess;
    char c = 1;
    if (full_io(comm->fd, &c, 1, 1) || full_io(comm->fd, &c, 1, 0))
        return ncclSystemError;
    return ncclSuccess;
}

ncclResult_t ncclAllReduce(const void *s, void *r, size_t count, ncclDataType_t t, ncclRedOp_t op, ncclComm_t comm,
                           cudaStream_t stream) { return barrier(comm); }
ncclResult_t ncclBroadcast(const void *s, void *r, size_t count, ncclDataType_t t, int root, ncclComm_t comm,
                           cudaStream_t stream) { return barrier(comm); }
ncclResult_t ncclReduce(const void *s, void *r, size_t count, ncclDataType_t t, ncclRedOp_t op, int root,
                        ncclComm_t comm, cudaStream_t stream) { return barrier(comm); }
ncclResult_t ncclAllGather(const void *s, void *r, size_t sendcount, ncclDataType_t t, ncclComm_t comm,
                           cudaStream_t stream) { return barrier(comm); }
ncclResult_t ncclReduceScatter(const void *s, void *r, size_t recvcount, ncclDataType_t t, ncclRedOp_t op,
                               ncclComm_t comm, cudaStream_t stream) { return barrier(comm); }
ncclResult_t ncclSend(const void *s, size_t count, ncclDataType_t t, int peer, ncclComm_t comm, cudaStream_t stream) {
    return comm ? ncclSuccess : ncclInvalidArgument;
}
ncclResult_t ncclRecv(void *r, size_t count, ncclDataType_t t, int peer, ncclComm_t comm, cudaStream_t stream) {
    return comm ? ncclSuccess : ncclInvalidArgument;
}
