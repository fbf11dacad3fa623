/* The tracer-breadth workload (tests/test_bpf_breadth_calls.py): the fake libcudart/libcuda from DIR,
 * called through dlopen like a real application.
 *   breadth calls DIR        each of the calls beyond the core set a distinctive number of times with
 *                            known arguments; prints "<name> <calls> <arg>" lines
 *   breadth leak DIR N       N cudaMalloc of 1 MiB, every 4th freed: live memory grows steadily
 *   breadth healthy DIR N    N cudaMalloc of 1 MiB, each freed at once
 *   breadth asyncleak DIR N  the leak with the stream-ordered cudaMallocAsync / cudaFreeAsync
 *   breadth net DIR N        one cudaMalloc (the process becomes a traced target), prints the fds and
 *                            waits for a line on stdin (the agent probes a new target's socket calls
 *                            from its next sync), then N sendto/recvfrom of 1000 bytes and N
 *                            sendmsg/recvmsg of 300 bytes on a socketpair
 *   breadth netrw DIR N      one cudaMalloc, then N write/read of 700 bytes on a socketpair, and the same
 *                            on a pipe and a regular file (not sockets); prints the fds */
#include <dlfcn.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

typedef struct { unsigned x, y, z; } dim3;
typedef int (*fn_t)();

static void *cudart, *cuda;

static void *sym(void *lib, const char *name) {
    void *f = dlsym(lib, name);
    if (!f) {
        fprintf(stderr, "missing %s\n", name);
        exit(3);
    }
    return f;
}

static void open_libs(const char *dir) {
    char path[4096];
    snprintf(path, sizeof path, "%s/libcudart.so.12", dir);
    cudart = dlopen(path, RTLD_NOW);
    snprintf(path, sizeof path, "%s/libcuda.so.1", dir);
    cuda = dlopen(path, RTLD_NOW);
    if (!cudart || !cuda) {
        fprintf(stderr, "dlopen: %s\n", dlerror());
        exit(2);
    }
}

static int calls(void) {
    int (*memcpy2d)(void *, size_t, const void *, size_t, size_t, size_t, int) = sym(cudart, "cudaMemcpy2D");
    int (*memcpy2da)(void *, size_t, const void *, size_t, size_t, size_t, int, void *) =
        sym(cudart, "cudaMemcpy2DAsync");
    int (*peer)(void *, int, const void *, int, size_t) = sym(cudart, "cudaMemcpyPeer");
    int (*peera)(void *, int, const void *, int, size_t, void *) = sym(cudart, "cudaMemcpyPeerAsync");
    int (*memset_)(void *, int, size_t) = sym(cudart, "cudaMemset");
    int (*memseta)(void *, int, size_t, void *) = sym(cudart, "cudaMemsetAsync");
    int (*memset2d)(void *, size_t, int, size_t, size_t) = sym(cudart, "cudaMemset2D");
    int (*evsync)(void *) = sym(cudart, "cudaEventSynchronize");
    int (*evquery)(void *) = sym(cudart, "cudaEventQuery");
    int (*hostalloc)(void **, size_t, unsigned) = sym(cudart, "cudaHostAlloc");
    int (*mallochost)(void **, size_t) = sym(cudart, "cudaMallocHost");
    int (*launch)(const void *, dim3, dim3, void **, size_t, void *) = sym(cudart, "cudaLaunchKernel");
    int (*culaunch)(void *, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, void *, void **,
                    void **) = sym(cuda, "cuLaunchKernel");
    int (*begin)(void *, int) = sym(cudart, "cudaStreamBeginCapture");
    int (*end)(void *, void **) = sym(cudart, "cudaStreamEndCapture");
    int (*inst)(void **, void *, unsigned long long) = sym(cudart, "cudaGraphInstantiate");
    int (*glaunch)(void *, void *) = sym(cudart, "cudaGraphLaunch");
    int (*cubegin)(void *, int) = sym(cuda, "cuStreamBeginCapture_v2");
    int (*cuend)(void *, void **) = sym(cuda, "cuStreamEndCapture");
    int (*cuinst)(void **, void *, unsigned long long) = sym(cuda, "cuGraphInstantiateWithFlags");
    int (*culaunchg)(void *, void *) = sym(cuda, "cuGraphLaunch");
    int rc = 0, i;
    void *p;
    for (i = 0; i < 11; i++) rc |= memcpy2d(0, 512, 0, 512, 300, 20, 1);         /* 6000 bytes H2D */
    for (i = 0; i < 12; i++) rc |= memcpy2da(0, 512, 0, 512, 100, 7, 2, 0);      /* 700 bytes D2H */
    for (i = 0; i < 13; i++) rc |= peer(0, 1, 0, 3, 4096);                       /* 3 -> 1 */
    for (i = 0; i < 14; i++) rc |= peera(0, 2, 0, 0, 8192, 0);                   /* 0 -> 2 */
    for (i = 0; i < 15; i++) rc |= memset_(0, 0, 1111);
    for (i = 0; i < 16; i++) rc |= memseta(0, 0, 2222, 0);
    for (i = 0; i < 17; i++) rc |= memset2d(0, 512, 0, 30, 10);                  /* 300 bytes */
    for (i = 0; i < 18; i++) rc |= evsync((void *)2000);                          /* sleeps 2 ms */
    int notready = 0;
    for (i = 0; i < 19; i++) notready += evquery((void *)(uintptr_t)(i & 1)) == 600;
    for (i = 0; i < 20; i++) rc |= hostalloc(&p, 65536, 2);
    for (i = 0; i < 21; i++) rc |= mallochost(&p, 32768);
    dim3 grid = {3, 2, 1}, block = {128, 2, 1};
    for (i = 0; i < 22; i++) rc |= launch((void *)0x1234, grid, block, 0, 0, 0);
    for (i = 0; i < 23; i++) rc |= culaunch((void *)0x5678, 5, 1, 1, 32, 4, 2, 0, 0, 0, 0);
    /* Graphs: 3 captures + instantiations, each launched 8 times; one driver-API capture launched twice. */
    void *graph, *exec;
    for (i = 0; i < 3; i++) {
        rc |= begin((void *)0x77, 0);
        rc |= end((void *)0x77, &graph);
        rc |= inst(&exec, graph, 0);
        for (int j = 0; j < 8; j++) rc |= glaunch(exec, (void *)0x77);
        printf("graph %lx %lx\n", (unsigned long)(uintptr_t)graph, (unsigned long)(uintptr_t)exec);
    }
    rc |= cubegin((void *)0x88, 1);
    rc |= cuend((void *)0x88, &graph);
    rc |= cuinst(&exec, graph, 0);
    for (i = 0; i < 2; i++) rc |= culaunchg(exec, (void *)0x88);
    printf("cugraph %lx %lx\n", (unsigned long)(uintptr_t)graph, (unsigned long)(uintptr_t)exec);
    printf("notready %d\n", notready);
    return rc;
}

static int allocs(int n, int free_every, int async) {
    int (*malloc_)(void **, size_t) = sym(cudart, "cudaMalloc");
    int (*free_)(void *) = sym(cudart, "cudaFree");
    int (*malloc_async)(void **, size_t, void *) = sym(cudart, "cudaMallocAsync");
    int (*free_async)(void *, void *) = sym(cudart, "cudaFreeAsync");
    int rc = 0;
    for (int i = 0; i < n; i++) {
        void *p = 0;
        rc |= async ? malloc_async(&p, 1 << 20, (void *)0x77) : malloc_(&p, 1 << 20);
        if (i == 0)
            printf("first %lx\n", (unsigned long)(uintptr_t)p);
        if (free_every && i % free_every == 0)
            rc |= async ? free_async(p, (void *)0x77) : free_(p);
        usleep(1000);
    }
    return rc;
}

static int net(int n) {
    int (*malloc_)(void **, size_t) = sym(cudart, "cudaMalloc");
    void *p;
    int sv[2];
    char buf[1000];
    memset(buf, 7, sizeof buf);
    if (malloc_(&p, 4096) || socketpair(AF_UNIX, SOCK_STREAM, 0, sv))
        return 1;
    printf("fds %d %d\n", sv[0], sv[1]);
    fflush(stdout);
    char line[16];
    if (!fgets(line, sizeof line, stdin))
        return 1;
    for (int i = 0; i < n; i++) {
        if (sendto(sv[0], buf, 1000, 0, NULL, 0) != 1000 || recvfrom(sv[1], buf, 1000, MSG_WAITALL, NULL, NULL) != 1000)
            return 1;
        struct iovec iov = {buf, 300};
        struct msghdr m = {0};
        m.msg_iov = &iov;
        m.msg_iovlen = 1;
        if (sendmsg(sv[1], &m, 0) != 300 || recvmsg(sv[0], &m, MSG_WAITALL) != 300)
            return 1;
    }
    return 0;
}

static int netrw(int n) {
    int (*malloc_)(void **, size_t) = sym(cudart, "cudaMalloc");
    void *p;
    int sv[2], pv[2];
    char buf[700], tmpl[] = "/tmp/ingero-netrw-XXXXXX";
    memset(buf, 9, sizeof buf);
    int file = mkstemp(tmpl);
    if (malloc_(&p, 4096) || socketpair(AF_UNIX, SOCK_STREAM, 0, sv) || pipe(pv) || file < 0)
        return 1;
    unlink(tmpl);
    printf("fds %d %d pipe %d %d file %d\n", sv[0], sv[1], pv[0], pv[1], file);
    for (int i = 0; i < n; i++) {
        if (write(sv[0], buf, 700) != 700 || read(sv[1], buf, 700) != 700)
            return 1;
        if (write(pv[1], buf, 700) != 700 || read(pv[0], buf, 700) != 700)
            return 1;
        if (pwrite(file, buf, 700, 0) != 700 || lseek(file, 0, SEEK_SET) != 0 || write(file, buf, 700) != 700 ||
            lseek(file, 0, SEEK_SET) != 0 || read(file, buf, 700) != 700)
            return 1;
    }
    return 0;
}

int main(int argc, char **argv) {
    if (argc < 3)
        return 64;
    open_libs(argv[2]);
    int n = argc >= 4 ? atoi(argv[3]) : 0;
    int rc = 64;
    if (!strcmp(argv[1], "calls")) rc = calls();
    else if (!strcmp(argv[1], "leak")) rc = allocs(n, 4, 0);
    else if (!strcmp(argv[1], "healthy")) rc = allocs(n, 1, 0);
    else if (!strcmp(argv[1], "asyncleak")) rc = allocs(n, 4, 1);
    else if (!strcmp(argv[1], "net")) rc = net(n);
    else if (!strcmp(argv[1], "netrw")) rc = netrw(n);
    printf("done %d\n", rc);
    return rc != 0;
}
