/* One rank of a data-parallel "training job" on the fake NCCL (fake_nccl.c, FAKE_NCCL_ROOT set): each
 * step computes (sleeps) for COMPUTE_US + EXTRA_US, then all-reduces 1 Mi float32 (sum) with the other
 * ranks; the all-reduce returns when every rank has entered it.
 *
 * usage: nccl_job LIBDIR RANK NRANKS STEPS COMPUTE_US EXTRA_US GO_FILE
 * Waits for GO_FILE to exist before anything else (so tracers attach first), prints "done <steps>" at
 * the end; exit status 0 on success.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>

typedef struct { char internal[128]; } ncclUniqueId;

static void sleep_us(long us) {
    struct timespec ts = {us / 1000000, (us % 1000000) * 1000};
    while (nanosleep(&ts, &ts))
        ;
}

int main(int argc, char **argv) {
    if (argc != 8) {
        fprintf(stderr, "usage: %s LIBDIR RANK NRANKS STEPS COMPUTE_US EXTRA_US GO_FILE\n", argv[0]);
        return 2;
    }
    int rank = atoi(argv[2]), nranks = atoi(argv[3]), steps = atoi(argv[4]);
    long compute = atol(argv[5]), extra = atol(argv[6]);
    while (access(argv[7], F_OK))
        sleep_us(2000);
    char path[4096];
    snprintf(path, sizeof path, "%s/libnccl.so.2", argv[1]);
    void *nc = dlopen(path, RTLD_NOW);
    if (!nc) {
        fprintf(stderr, "%s\n", dlerror());
        return 3;
    }
    int (*getid)(ncclUniqueId *) = (int (*)(ncclUniqueId *))dlsym(nc, "ncclGetUniqueId");
    int (*init)(void **, int, ncclUniqueId, int) = (int (*)(void **, int, ncclUniqueId, int))dlsym(nc, "ncclCommInitRank");
    int (*allreduce)(const void *, void *, size_t, int, int, void *, void *) =
        (int (*)(const void *, void *, size_t, int, int, void *, void *))dlsym(nc, "ncclAllReduce");
    ncclUniqueId id;
    void *comm = NULL;
    if (getid(&id) || init(&comm, nranks, id, rank)) {
        fprintf(stderr, "rank %d: communicator setup failed\n", rank);
        return 4;
    }
    for (int s = 0; s < steps; s++) {
        sleep_us(compute + extra);
        if (allreduce(NULL, NULL, 1 << 20, 7 /* float32 */, 0 /* sum */, comm, NULL)) {
            fprintf(stderr, "rank %d: all-reduce %d failed\n", rank, s);
            return 5;
        }
    }
    printf("done %d\n", steps);
    return 0;
}
