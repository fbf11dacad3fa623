/* A multi-threaded GPU-shaped job for the attach-race tests (tests/test_reliability_attach.py).
 *
 *   busy_threads busy DIR NTHREADS
 *       NTHREADS threads call the fake libcudart in a tight loop, each iteration:
 *       cudaLaunchKernel(func = 0x1000 + thread index) and cudaMemcpyAsync (high-rate ops: sampled
 *       by the recorder, so the database stays small), and every 1024th iteration
 *       cudaMallocManaged(flags 0x10, which calls cudaMalloc inside: a nested probed call) and
 *       cudaFree. Prints "thread <tid>" per thread, then "ready"; runs until stdin closes.
 *   busy_threads escape DIR NTHREADS
 *       NTHREADS "jumper" threads that loop: 20 x (cudaMalloc + cudaFree), then a cudaLaunchKernel
 *       that would spin 10 s but is left with siglongjmp from a SIGUSR1 handler (sent every 2 ms by
 *       a signaller thread) — an entry whose return never comes. Plus one "exiter" slot: a thread
 *       that calls cudaMalloc/cudaFree a few times, then is cancelled inside cudaStreamSynchronize
 *       (a 10 s sleep), and is replaced by a new one. Prints "thread <tid>" per jumper, "ready",
 *       runs until stdin closes, then prints "jumps <n>" and "exits <n>".
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <setjmp.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

typedef struct { unsigned x, y, z; } dim3;

static int (*cudaMalloc)(void **, size_t);
static int (*cudaFree)(void *);
static int (*cudaMallocManaged)(void **, size_t, unsigned);
static int (*cudaLaunchKernel)(const void *, dim3, dim3, void **, size_t, void *);
static int (*cudaStreamSynchronize)(void *);
static int (*cudaMemcpyAsync)(void *, const void *, size_t, int, void *);

static atomic_int stop;
static atomic_int started;
static atomic_long jumps;
static atomic_long exits;
static atomic_int finished;
static pthread_mutex_t print_lock = PTHREAD_MUTEX_INITIALIZER;

static void *sym(void *h, const char *name) {
    void *p = dlsym(h, name);
    if (!p) {
        fprintf(stderr, "busy_threads: missing %s\n", name);
        exit(2);
    }
    return p;
}

static void load(const char *dir) {
    char path[4096];
    snprintf(path, sizeof(path), "%s/libcudart.so.12", dir);
    void *rt = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (!rt) {
        fprintf(stderr, "busy_threads: %s\n", dlerror());
        exit(2);
    }
    cudaMalloc = sym(rt, "cudaMalloc");
    cudaFree = sym(rt, "cudaFree");
    cudaMallocManaged = sym(rt, "cudaMallocManaged");
    cudaLaunchKernel = sym(rt, "cudaLaunchKernel");
    cudaStreamSynchronize = sym(rt, "cudaStreamSynchronize");
    cudaMemcpyAsync = sym(rt, "cudaMemcpyAsync");
}

static void announce(void) {
    pthread_mutex_lock(&print_lock);
    printf("thread %ld\n", (long)syscall(SYS_gettid));
    fflush(stdout);
    pthread_mutex_unlock(&print_lock);
    atomic_fetch_add(&started, 1);
}

static void *busy(void *arg) {
    uintptr_t index = (uintptr_t)arg;
    dim3 one = {1, 1, 1};
    void *p;
    char buf[64];
    announce();
    for (unsigned long i = 0; !atomic_load(&stop); i++) {
        cudaLaunchKernel((const void *)(0x1000 + index), one, one, NULL, 0, NULL);
        cudaMemcpyAsync(buf, buf + 32, 32, 1, NULL);
        if (i % 1024 == 0) {
            cudaMallocManaged(&p, 4096, 0x10);
            cudaFree(p);
        }
    }
    return NULL;
}

/* --- escape: calls that never return ------------------------------------------------------------ */

static __thread sigjmp_buf jump_back;
static __thread volatile sig_atomic_t in_call;

static void on_usr1(int sig) {
    (void)sig;
    if (in_call) {
        in_call = 0;
        siglongjmp(jump_back, 1);
    }
}

static void *jumper(void *arg) {
    (void)arg;
    dim3 one = {1, 1, 1};
    void *p;
    announce();
    while (!atomic_load(&stop)) {
        for (int i = 0; i < 20; i++) {
            cudaMalloc(&p, 4096);
            cudaFree(p);
        }
        if (sigsetjmp(jump_back, 1) == 0) {
            in_call = 1;
            cudaLaunchKernel((const void *)0x2000, one, one, NULL, 10 * 1000 * 1000, NULL); /* 10 s spin */
            in_call = 0;
        } else {
            atomic_fetch_add(&jumps, 1);
        }
    }
    atomic_fetch_add(&finished, 1);
    return NULL;
}

static void *exiter(void *arg) {
    (void)arg;
    void *p;
    for (int i = 0; i < 5; i++) {
        cudaMalloc(&p, 4096);
        cudaFree(p);
    }
    cudaStreamSynchronize((void *)(uintptr_t)10000000); /* 10 s: cancelled inside */
    return NULL;
}

static void sleep_ms(int ms) {
    struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000};
    nanosleep(&ts, NULL);
}

struct escape_ctx {
    pthread_t *jumpers;
    int n;
};

static void *signaller(void *arg) {
    struct escape_ctx *ctx = arg;
    int tick = 0;
    pthread_t ex;
    int have_exiter = 0;
    while (!atomic_load(&stop)) {
        sleep_ms(2);
        for (int i = 0; i < ctx->n; i++)
            pthread_kill(ctx->jumpers[i], SIGUSR1);
        if (++tick % 10 == 0) { /* every ~20 ms: cancel the exiter mid-call, start a new one */
            if (have_exiter) {
                pthread_cancel(ex);
                pthread_join(ex, NULL);
                atomic_fetch_add(&exits, 1);
            }
            have_exiter = pthread_create(&ex, NULL, exiter, NULL) == 0;
        }
    }
    if (have_exiter) {
        pthread_cancel(ex);
        pthread_join(ex, NULL);
    }
    return NULL;
}

static void wait_for_stdin_eof(void) {
    char buf[64];
    while (fgets(buf, sizeof(buf), stdin)) {
    }
}

int main(int argc, char **argv) {
    if (argc != 4) {
        fprintf(stderr, "usage: busy_threads busy|escape DIR NTHREADS\n");
        return 2;
    }
    load(argv[2]);
    int n = atoi(argv[3]);
    pthread_t *threads = calloc((size_t)n, sizeof(pthread_t));
    int escape = strcmp(argv[1], "escape") == 0;
    if (escape) {
        struct sigaction sa;
        memset(&sa, 0, sizeof(sa));
        sa.sa_handler = on_usr1;
        sigaction(SIGUSR1, &sa, NULL);
    }
    for (uintptr_t i = 0; i < (uintptr_t)n; i++)
        pthread_create(&threads[i], NULL, escape ? jumper : busy, (void *)i);
    while (atomic_load(&started) < n)
        sleep_ms(1);
    pthread_t sig;
    struct escape_ctx ctx = {threads, n};
    if (escape)
        pthread_create(&sig, NULL, signaller, &ctx);
    printf("ready\n");
    fflush(stdout);
    wait_for_stdin_eof();
    atomic_store(&stop, 1);
    if (escape)
        pthread_join(sig, NULL);
    while (escape && atomic_load(&finished) < n) { /* a jumper may be in its 10 s call: jump it out */
        for (int i = 0; i < n; i++)
            pthread_kill(threads[i], SIGUSR1);
        sleep_ms(1);
    }
    for (int i = 0; i < n; i++)
        pthread_join(threads[i], NULL);
    if (escape)
        printf("jumps %ld\nexits %ld\n", atomic_load(&jumps), atomic_load(&exits));
    return 0;
}
