/* The bpf tests' GPU-shaped workload: calls the fake (or real) CUDA/NCCL libraries through dlopen.
 *
 *   workload counts DIR            the distinctive call counts of COUNTS below, with known sleeps;
 *                                  prints one line per op: "<op> <calls> <return code>"
 *   workload nested DIR N          N cudaMallocManaged calls that each call cudaMalloc inside
 *   workload io FILE N BYTES       N writes of BYTES, each followed by fsync
 *   workload contention DIR BASE MORE SPIN_US
 *                                  BASE cudaLaunchKernel calls spinning SPIN_US of CPU each, then
 *                                  prints "ready", waits for a line on stdin, MORE calls, "done"
 *   workload loop DIR N            N cuLaunchKernel calls as fast as possible; prints ns per call of
 *                                  wall time and of the thread's CPU time (uprobe handling included)
 *   workload paced DIR RATE SECONDS
 *                                  RATE cuLaunchKernel calls per second (in 1 ms steps) for SECONDS;
 *                                  prints the number of calls made
 *   workload stress DIR SECONDS    cuLaunchKernel + cudaMalloc/cudaFree flat out for SECONDS; prints
 *                                  "progress <calls>" every 100,000 calls
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

typedef struct { unsigned x, y, z; } dim3;
typedef struct { char internal[128]; } ncclUniqueId;

static void *lib(const char *dir, const char *name) {
    char path[4096];
    snprintf(path, sizeof(path), "%s/%s", dir, name);
    void *h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (!h) {
        fprintf(stderr, "workload: %s\n", dlerror());
        exit(2);
    }
    return h;
}

static void *sym(void *h, const char *name) {
    void *p = dlsym(h, name);
    if (!p) {
        fprintf(stderr, "workload: missing %s\n", name);
        exit(2);
    }
    return p;
}

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec / 1e9;
}

#define REPORT(op, n, rc) printf("%s %d %d\n", op, (int)(n), (int)(rc))

static int counts(const char *dir) {
    void *rt = lib(dir, "libcudart.so.12"), *drv = lib(dir, "libcuda.so.1"), *nc = lib(dir, "libnccl.so.2");
    int (*cudaMalloc)(void **, size_t) = sym(rt, "cudaMalloc");
    int (*cudaFree)(void *) = sym(rt, "cudaFree");
    int (*cudaMallocManaged)(void **, size_t, unsigned) = sym(rt, "cudaMallocManaged");
    int (*cudaLaunchKernel)(const void *, dim3, dim3, void **, size_t, void *) = sym(rt, "cudaLaunchKernel");
    int (*cudaMemcpy)(void *, const void *, size_t, int) = sym(rt, "cudaMemcpy");
    int (*cudaMemcpyAsync)(void *, const void *, size_t, int, void *) = sym(rt, "cudaMemcpyAsync");
    int (*cudaStreamSynchronize)(void *) = sym(rt, "cudaStreamSynchronize");
    int (*cudaDeviceSynchronize)(void) = sym(rt, "cudaDeviceSynchronize");
    int (*cuLaunchKernel)(void *, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, void *, void **,
                          void **) = sym(drv, "cuLaunchKernel");
    int (*cuMemAlloc_v2)(unsigned long long *, size_t) = sym(drv, "cuMemAlloc_v2");
    int (*cuMemcpyHtoD_v2)(unsigned long long, const void *, size_t) = sym(drv, "cuMemcpyHtoD_v2");
    int (*cuMemcpyDtoH_v2)(void *, unsigned long long, size_t) = sym(drv, "cuMemcpyDtoH_v2");
    int (*cuMemcpyAsync)(unsigned long long, unsigned long long, size_t, void *) = sym(drv, "cuMemcpyAsync");
    int (*cuCtxSynchronize)(void) = sym(drv, "cuCtxSynchronize");
    int (*ncclGetUniqueId)(ncclUniqueId *) = sym(nc, "ncclGetUniqueId");
    int (*ncclCommInitRank)(void **, int, ncclUniqueId, int) = sym(nc, "ncclCommInitRank");
    int (*ncclCommInitAll)(void **, int, const int *) = sym(nc, "ncclCommInitAll");
    int (*ncclAllReduce)(const void *, void *, size_t, int, int, void *, void *) = sym(nc, "ncclAllReduce");
    int (*ncclBroadcast)(const void *, void *, size_t, int, int, void *, void *) = sym(nc, "ncclBroadcast");
    int (*ncclReduce)(const void *, void *, size_t, int, int, int, void *, void *) = sym(nc, "ncclReduce");
    int (*ncclAllGather)(const void *, void *, size_t, int, void *, void *) = sym(nc, "ncclAllGather");
    int (*ncclReduceScatter)(const void *, void *, size_t, int, int, void *, void *) = sym(nc, "ncclReduceScatter");
    int (*ncclSend)(const void *, size_t, int, int, void *, void *) = sym(nc, "ncclSend");
    int (*ncclRecv)(void *, size_t, int, int, void *, void *) = sym(nc, "ncclRecv");

    void *p = NULL;
    int rc = 0, i;
    dim3 g = {1, 1, 1};
    static char host[1 << 20];
    for (i = 0; i < 1237; i++) rc |= cudaMalloc(&p, 4096);
    REPORT("cudaMalloc", 1237, rc);
    for (i = 0, rc = 0; i < 7; i++) rc = cudaMalloc(&p, (size_t)1 << 41);
    REPORT("cudaMalloc_error", 7, rc);
    for (i = 0, rc = 0; i < 1237; i++) rc |= cudaFree((void *)0x7000001000ull);
    REPORT("cudaFree", 1237, rc);
    for (i = 0, rc = 0; i < 9; i++) rc |= cudaMallocManaged(&p, 1 << 20, 1);
    REPORT("cudaMallocManaged", 9, rc);
    for (i = 0, rc = 0; i < 29; i++) rc |= cudaLaunchKernel((void *)0x4242, g, g, NULL, 0, NULL);
    REPORT("cudaLaunchKernel", 29, rc);
    for (i = 0, rc = 0; i < 333; i++) rc |= cudaMemcpy(host, host, sizeof(host), 1);
    REPORT("cudaMemcpy", 333, rc);
    for (i = 0, rc = 0; i < 17; i++) rc |= cudaMemcpyAsync(host, host, 65536, 2, NULL);
    REPORT("cudaMemcpyAsync", 17, rc);
    for (i = 0, rc = 0; i < 50; i++) rc |= cudaStreamSynchronize((void *)(uintptr_t)2000); /* 2 ms each */
    REPORT("cudaStreamSync", 50, rc);
    for (i = 0, rc = 0; i < 25; i++) rc |= cudaDeviceSynchronize(); /* 3 ms each */
    REPORT("cudaDeviceSync", 25, rc);
    for (i = 0, rc = 0; i < 4111; i++) rc |= cuLaunchKernel((void *)0x4343, 1, 1, 1, 32, 1, 1, 0, NULL, NULL, NULL);
    REPORT("cuLaunchKernel", 4111, rc);
    unsigned long long dp;
    for (i = 0, rc = 0; i < 77; i++) rc |= cuMemAlloc_v2(&dp, 8192);
    REPORT("cuMemAlloc", 77, rc);
    for (i = 0, rc = 0; i < 21; i++) rc |= cuMemcpyHtoD_v2(dp, host, 1000);
    for (i = 0; i < 22; i++) rc |= cuMemcpyDtoH_v2(host, dp, 2000);
    REPORT("cuMemcpy", 43, rc);
    for (i = 0, rc = 0; i < 6; i++) rc |= cuMemcpyAsync(dp, dp, 3000, NULL);
    REPORT("cuMemcpyAsync", 6, rc);
    for (i = 0, rc = 0; i < 8; i++) rc |= cuCtxSynchronize(); /* 1 ms each */
    REPORT("cuCtxSynchronize", 8, rc);

    ncclUniqueId id;
    void *comm = NULL, *comms[2] = {NULL, NULL};
    int devs[2] = {0, 1};
    ncclGetUniqueId(&id);
    rc = ncclCommInitRank(&comm, 8, id, 3);
    REPORT("ncclCommInitRank", 1, rc);
    rc = ncclCommInitAll(comms, 2, devs);
    REPORT("ncclCommInitAll", 1, rc);
    for (i = 0, rc = 0; i < 19; i++) rc |= ncclAllReduce(host, host, 1024, 7, 0, comm, NULL); /* float32 */
    REPORT("ncclAllReduce", 19, rc);
    for (i = 0, rc = 0; i < 11; i++) rc |= ncclBroadcast(host, host, 1000, 0, 0, comm, NULL); /* int8 */
    REPORT("ncclBroadcast", 11, rc);
    for (i = 0, rc = 0; i < 5; i++) rc |= ncclReduce(host, host, 100, 8, 0, 0, comms[1], NULL); /* float64 */
    REPORT("ncclReduce", 5, rc);
    for (i = 0, rc = 0; i < 13; i++) rc |= ncclAllGather(host, host, 256, 6, comm, NULL); /* float16 */
    REPORT("ncclAllGather", 13, rc);
    for (i = 0, rc = 0; i < 3; i++) rc |= ncclReduceScatter(host, host, 64, 4, 0, comm, NULL); /* int64 */
    REPORT("ncclReduceScatter", 3, rc);
    for (i = 0, rc = 0; i < 2; i++) rc |= ncclSend(host, 10, 2, 1, comm, NULL); /* int32 */
    REPORT("ncclSend", 2, rc);
    for (i = 0, rc = 0; i < 2; i++) rc |= ncclRecv(host, 10, 2, 1, comm, NULL);
    REPORT("ncclRecv", 2, rc);
    printf("comm %p %p %p\n", comm, comms[0], comms[1]);
    return 0;
}

static int nested(const char *dir, int n) {
    void *rt = lib(dir, "libcudart.so.12");
    int (*managed)(void **, size_t, unsigned) = sym(rt, "cudaMallocManaged");
    void *p;
    int rc = 0;
    for (int i = 0; i < n; i++) rc |= managed(&p, 12345, 0x10);
    REPORT("nested", n, rc);
    return 0;
}

static int io(const char *file, int n, int bytes) {
    char *buf = malloc(bytes);
    memset(buf, 'x', bytes);
    int fd = open(file, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (fd < 0) {
        perror("workload: open");
        return 2;
    }
    for (int i = 0; i < n; i++) {
        if (write(fd, buf, bytes) != bytes || fsync(fd) != 0) {
            perror("workload: write");
            return 2;
        }
    }
    close(fd);
    printf("io %d %d\n", n, bytes);
    return 0;
}

static int contention(const char *dir, int base, int more, int spin_us) {
    void *rt = lib(dir, "libcudart.so.12");
    int (*launch)(const void *, dim3, dim3, void **, size_t, void *) = sym(rt, "cudaLaunchKernel");
    dim3 g = {1, 1, 1};
    for (int i = 0; i < base; i++) launch((void *)0x4444, g, g, NULL, spin_us, NULL);
    printf("ready\n");
    fflush(stdout);
    char line[16];
    if (!fgets(line, sizeof(line), stdin))
        return 2;
    for (int i = 0; i < more; i++) launch((void *)0x4444, g, g, NULL, spin_us, NULL);
    printf("done\n");
    return 0;
}

static int loop(const char *dir, long n) {
    void *drv = lib(dir, "libcuda.so.1");
    int (*launch)(void *, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, void *, void **,
                  void **) = sym(drv, "cuLaunchKernel");
    struct timespec c0, c1;
    double t = now_s();
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &c0);
    for (long i = 0; i < n; i++) launch((void *)0x4545, 1, 1, 1, 1, 1, 1, 0, NULL, NULL, NULL);
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &c1);
    double wall = (now_s() - t) * 1e9 / n;
    double cpu = ((c1.tv_sec - c0.tv_sec) * 1e9 + (c1.tv_nsec - c0.tv_nsec)) / n;
    printf("%.1f %.1f\n", wall, cpu);
    return 0;
}

static int paced(const char *dir, long rate, double seconds) {
    void *drv = lib(dir, "libcuda.so.1");
    int (*launch)(void *, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, void *, void **,
                  void **) = sym(drv, "cuLaunchKernel");
    long calls = 0;
    double start = now_s(), step = 0.001;
    long steps = (long)(seconds / step);
    for (long k = 1; k <= steps; k++) {
        long due = (long)(rate * step * k);
        for (; calls < due; calls++) launch((void *)0x4747, 1, 1, 1, 1, 1, 1, 0, NULL, NULL, NULL);
        double wait = start + step * k - now_s();
        if (wait > 0) {
            struct timespec ts = {0, (long)(wait * 1e9)};
            nanosleep(&ts, NULL);
        }
    }
    printf("%ld %.3f\n", calls, now_s() - start);
    return 0;
}

static int stress(const char *dir, double seconds) {
    void *rt = lib(dir, "libcudart.so.12"), *drv = lib(dir, "libcuda.so.1");
    int (*cudaMalloc)(void **, size_t) = sym(rt, "cudaMalloc");
    int (*cudaFree)(void *) = sym(rt, "cudaFree");
    int (*launch)(void *, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, void *, void **,
                  void **) = sym(drv, "cuLaunchKernel");
    long calls = 0;
    void *p;
    double end = now_s() + seconds;
    while (now_s() < end) {
        for (int i = 0; i < 1000; i++) launch((void *)0x4646, 1, 1, 1, 1, 1, 1, 0, NULL, NULL, NULL);
        cudaMalloc(&p, 4096);
        cudaFree(p);
        calls += 1002;
        if (calls % 100200 == 0)
            printf("progress %ld\n", calls);
    }
    printf("stress %ld\n", calls);
    return 0;
}

int main(int argc, char **argv) {
    setvbuf(stdout, NULL, _IOLBF, 0);
    if (argc >= 3 && !strcmp(argv[1], "counts")) return counts(argv[2]);
    if (argc >= 4 && !strcmp(argv[1], "nested")) return nested(argv[2], atoi(argv[3]));
    if (argc >= 5 && !strcmp(argv[1], "io")) return io(argv[2], atoi(argv[3]), atoi(argv[4]));
    if (argc >= 6 && !strcmp(argv[1], "contention")) return contention(argv[2], atoi(argv[3]), atoi(argv[4]), atoi(argv[5]));
    if (argc >= 4 && !strcmp(argv[1], "loop")) return loop(argv[2], atol(argv[3]));
    if (argc >= 4 && !strcmp(argv[1], "stress")) return stress(argv[2], atof(argv[3]));
    if (argc >= 5 && !strcmp(argv[1], "paced")) return paced(argv[2], atol(argv[3]), atof(argv[4]));
    fprintf(stderr, "usage: see the comment at the top of workload.c\n");
    return 2;
}
