/* Training-loop-shaped programs for explain's bpf tests (tests/test_bpf_explain.py), calling the fake
 * CUDA runtime (tests/bpf_fixtures/fake_cudart.c) through dlopen:
 *   cudaLaunchKernel(func, ..., sharedMem = N) spins N us of this thread's CPU time;
 *   cudaStreamSynchronize(stream = N) sleeps N us (a blocking sync: the thread is asleep inside it).
 *
 *   trainer_explain starved DIR STEPS WORKERS WORK_US
 *       forks WORKERS "DataLoader workers" that each spin WORK_US of CPU per batch and write it to a
 *       pipe; each step the trainer reads the next batch (blocking until a worker wakes it), copies it,
 *       launches 4 kernels and syncs 2 ms. The workers are the bottleneck: input starvation.
 *   trainer_explain healthy DIR STEPS SLEEP_US
 *       launches 4 kernels, syncs 2 ms, then usleep(SLEEP_US): voluntary sleeps only.
 *   trainer_explain contended DIR BASE MORE SPIN_US
 *       BASE steps of (2 launches spinning SPIN_US each + a 1 ms sync), prints "ready", waits for a
 *       line on stdin (the test starts a CPU hog on the same core), MORE steps, prints "done".
 * Every mode prints "pid <pid>" first and "end" last.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

typedef struct { unsigned x, y, z; } dim3;
typedef int (*launch_fn)(const void *, dim3, dim3, void **, size_t, void *);
typedef int (*sync_fn)(void *);
typedef int (*copy_fn)(void *, const void *, size_t, int);

static launch_fn launch;
static sync_fn sync_stream;
static copy_fn memcpy_h2d;
static const dim3 G = {1, 1, 1};
static const void *KERNELS[4] = {(void *)0x5a000, (void *)0x5a1c0, (void *)0x5a380, (void *)0x5a540};

static void load(const char *dir) {
    char path[4096];
    snprintf(path, sizeof(path), "%s/libcudart.so.12", dir);
    void *h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (!h) {
        fprintf(stderr, "trainer: %s\n", dlerror());
        exit(2);
    }
    launch = (launch_fn)dlsym(h, "cudaLaunchKernel");
    sync_stream = (sync_fn)dlsym(h, "cudaStreamSynchronize");
    memcpy_h2d = (copy_fn)dlsym(h, "cudaMemcpy");
    if (!launch || !sync_stream || !memcpy_h2d) {
        fprintf(stderr, "trainer: missing symbols\n");
        exit(2);
    }
}

static uint64_t cpu_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static void spin_us(long us) {
    uint64_t end = cpu_ns() + (uint64_t)us * 1000;
    while (cpu_ns() < end) {
    }
}

static void step(long spin, long sync_us) {
    for (int k = 0; k < 4; k++) launch(KERNELS[k], G, G, NULL, (size_t)spin, NULL);
    sync_stream((void *)(uintptr_t)sync_us);
}

static int starved(int steps, int workers, long work_us) {
    static char batch[1 << 16];
    int fds[64][2];
    pid_t kids[64];
    if (workers < 1 || workers > 64)
        return 2;
    step(0, 100); /* the first GPU call makes this process traced: its forks are followed from here */
    for (int w = 0; w < workers; w++) {
        if (pipe(fds[w]))
            return 2;
        kids[w] = fork();
        if (kids[w] == 0) {
            close(fds[w][0]);
            char one = 'b';
            for (;;) { /* decode + augment one batch, hand it over */
                spin_us(work_us);
                if (write(fds[w][1], &one, 1) != 1)
                    _exit(0);
            }
        }
        close(fds[w][1]);
    }
    for (int i = 0; i < steps; i++) {
        char b;
        if (read(fds[i % workers][0], &b, 1) != 1) /* blocks until that worker's batch is ready */
            return 3;
        memcpy_h2d((void *)0x7000000000ull, batch, sizeof(batch), 1);
        step(0, 2000);
    }
    for (int w = 0; w < workers; w++) {
        kill(kids[w], SIGKILL);
        waitpid(kids[w], NULL, 0);
    }
    return 0;
}

static int healthy(int steps, long sleep_us) {
    for (int i = 0; i < steps; i++) {
        step(0, 2000);
        usleep((useconds_t)sleep_us);
    }
    return 0;
}

static int contended(int base, int more, long spin) {
    for (int i = 0; i < base; i++) {
        for (int k = 0; k < 2; k++) launch(KERNELS[k], G, G, NULL, (size_t)spin, NULL);
        sync_stream((void *)(uintptr_t)1000);
    }
    printf("ready\n");
    fflush(stdout);
    char line[16];
    if (!fgets(line, sizeof(line), stdin))
        return 2;
    for (int i = 0; i < more; i++) {
        for (int k = 0; k < 2; k++) launch(KERNELS[k], G, G, NULL, (size_t)spin, NULL);
        sync_stream((void *)(uintptr_t)1000);
    }
    printf("done\n");
    fflush(stdout);
    return 0;
}

int main(int argc, char **argv) {
    if (argc < 3) {
        fprintf(stderr, "usage: trainer_explain starved|healthy|contended DIR ...\n");
        return 2;
    }
    load(argv[2]);
    printf("pid %d\n", (int)getpid());
    fflush(stdout);
    int rc = 2;
    if (!strcmp(argv[1], "starved") && argc == 6)
        rc = starved(atoi(argv[3]), atoi(argv[4]), atol(argv[5]));
    else if (!strcmp(argv[1], "healthy") && argc == 5)
        rc = healthy(atoi(argv[3]), atol(argv[4]));
    else if (!strcmp(argv[1], "contended") && argc == 6)
        rc = contended(atoi(argv[3]), atoi(argv[4]), atol(argv[5]));
    printf("end\n");
    fflush(stdout);
    return rc;
}
