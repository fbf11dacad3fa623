/* A libcudart.so.12 with a modelled device behind it, for the catalog's real recordings
 * (tests/test_bpf_catalog.py): the workload calls it the way a training or serving program calls CUDA,
 * and the library — not the caller — produces the GPU's side of each behaviour.
 * Built like fake_cudart.c (every function starts with `push %rbp`). No GPU.
 *
 * The device:
 *   - one queue of work: cudaLaunchKernel(func, ..., sharedMem = N, ...) enqueues a kernel of N us
 *     (x the clock factor) and returns after ~4 us of host time; cudaStreamSynchronize /
 *     cudaDeviceSynchronize sleep until the queue drains (a blocking sync: the thread is asleep);
 *   - FAKE_GPU_SHARED=PATH: processes naming the same file share one device (its queue lives in that
 *     file, mapped shared): their kernels run one after the other, as on a time-sliced GPU, and a sync
 *     waits for the caller's own kernels (which wait behind the others' queued before them);
 *   - FAKE_GPU_THROTTLE=R: the clock drops as the device heats up: a kernel takes 1 + R x (seconds since
 *     the context was created) times its nominal time (thermal or power capping);
 *   - FAKE_GPU_INIT_MS=N: the process's first call creates the context (N ms);
 *     FAKE_GPU_MODULE_MS=N: each kernel's first launch loads its module lazily (N ms);
 *   - memory: FAKE_GPU_MEM_MB of device memory (default 80 GiB) handed out first-fit from one address
 *     range, so fragmentation is real: cudaMalloc fails (cudaErrorMemoryAllocation, 2) when no free
 *     hole is large enough, whatever the total free. cudaMalloc costs 50 us + 8 us per MiB (the
 *     driver maps the pages); cudaFree synchronises the device, then 30 us + 4 us per MiB;
 *   - copies: cudaMemcpy waits for the queue, then moves its bytes over a PCIe Gen3 x16 link: 12 GB/s
 *     from or to pinned host memory (cudaMallocHost / cudaHostAlloc: real, touched host memory),
 *     3 GB/s from pageable memory (the driver stages it through a bounce buffer); device to device
 *     at 400 GB/s.
 */
#define _GNU_SOURCE
#include <fcntl.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

typedef struct { unsigned x, y, z; } dim3;
typedef void *cudaStream_t;

enum { cudaSuccess = 0, cudaErrorInvalidValue = 1, cudaErrorMemoryAllocation = 2 };
#define DEVICE_BASE 0x7f0000000000ull
#define MAX_BLOCKS 65536
#define MAX_PINNED 4096
#define MAX_KERNELS 256

static uint64_t mono_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static void sleep_until(uint64_t t) {
    struct timespec ts = {(time_t)(t / 1000000000ull), (long)(t % 1000000000ull)};
    while (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &ts, NULL))
        ;
}

static void host_work_ns(uint64_t ns) { /* the driver's own CPU time in a call */
    uint64_t end = mono_ns() + ns;
    while (mono_ns() < end) {
    }
}

static double env_num(const char *name, double dflt) {
    const char *v = getenv(name);
    return v && *v ? atof(v) : dflt;
}

/* --- the context ------------------------------------------------------------------------------- */

static int ready;
static uint64_t created_ns, module_ns, capacity;
static double throttle;
static uint64_t local_queue;
static uint64_t *queue_end = &local_queue; /* when the device's queued work is done (monotonic ns) */

static void context(void) {
    if (ready)
        return;
    ready = 1;
    throttle = env_num("FAKE_GPU_THROTTLE", 0.0);
    module_ns = (uint64_t)(env_num("FAKE_GPU_MODULE_MS", 0.0) * 1e6);
    capacity = (uint64_t)(env_num("FAKE_GPU_MEM_MB", 81920.0) * 1048576.0);
    const char *shared = getenv("FAKE_GPU_SHARED");
    if (shared && *shared) {
        int fd = open(shared, O_RDWR | O_CREAT, 0600);
        if (fd >= 0 && ftruncate(fd, 4096) == 0) {
            void *p = mmap(NULL, 4096, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
            if (p != MAP_FAILED)
                queue_end = (uint64_t *)p;
        }
        if (fd >= 0)
            close(fd);
    }
    uint64_t init = (uint64_t)(env_num("FAKE_GPU_INIT_MS", 0.0) * 1e6);
    if (init)
        sleep_until(mono_ns() + init);
    created_ns = mono_ns();
}

static uint64_t mine; /* when this process's last kernel is done */

static void enqueue(uint64_t ns) { /* after whatever the device already has queued, this process's or not */
    uint64_t now = mono_ns(), old = __atomic_load_n(queue_end, __ATOMIC_ACQUIRE), start;
    do {
        start = old > now ? old : now;
    } while (!__atomic_compare_exchange_n(queue_end, &old, start + ns, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE));
    mine = start + ns;
}

static void drain(void) { sleep_until(mine); } /* this process's work done (another's later work is not waited for) */

/* --- device memory: first fit over one range --------------------------------------------------- */

static struct { uint64_t addr, size; } blocks[MAX_BLOCKS]; /* live allocations, sorted by address */
static int nblocks;

static uint64_t first_fit(uint64_t size, int *at) {
    uint64_t prev_end = DEVICE_BASE;
    for (int i = 0; i <= nblocks; i++) {
        uint64_t next = i < nblocks ? blocks[i].addr : DEVICE_BASE + capacity;
        if (next - prev_end >= size) {
            *at = i;
            return prev_end;
        }
        if (i < nblocks)
            prev_end = blocks[i].addr + blocks[i].size;
    }
    return 0;
}

static int device_alloc(void **devPtr, size_t size) {
    context();
    uint64_t rounded = ((uint64_t)size + 0x1fffff) & ~0x1fffffull; /* 2 MiB pages */
    int at = 0;
    uint64_t addr = rounded && nblocks < MAX_BLOCKS ? first_fit(rounded, &at) : 0;
    host_work_ns(50000 + (rounded >> 20) * 8000);
    if (!addr)
        return cudaErrorMemoryAllocation;
    memmove(&blocks[at + 1], &blocks[at], sizeof(blocks[0]) * (size_t)(nblocks - at));
    blocks[at].addr = addr;
    blocks[at].size = rounded;
    nblocks++;
    *devPtr = (void *)addr;
    return cudaSuccess;
}

static int device_free(void *devPtr) {
    context();
    drain(); /* cudaFree synchronises the device */
    for (int i = 0; i < nblocks; i++) {
        if (blocks[i].addr == (uint64_t)devPtr) {
            host_work_ns(30000 + (blocks[i].size >> 20) * 4000);
            memmove(&blocks[i], &blocks[i + 1], sizeof(blocks[0]) * (size_t)(nblocks - i - 1));
            nblocks--;
            return cudaSuccess;
        }
    }
    return devPtr ? cudaErrorInvalidValue : cudaSuccess;
}

/* --- pinned host memory ------------------------------------------------------------------------ */

static struct { char *p; size_t n; } pinned[MAX_PINNED];

static int host_alloc(void **ptr, size_t size) {
    context();
    int slot = 0;
    while (slot < MAX_PINNED && pinned[slot].p)
        slot++;
    void *p = NULL;
    if (slot == MAX_PINNED || posix_memalign(&p, 4096, size ? size : 1))
        return cudaErrorMemoryAllocation;
    memset(p, 0, size); /* page-locked: every page resident */
    pinned[slot].p = p;
    pinned[slot].n = size;
    *ptr = p;
    return cudaSuccess;
}

static int is_pinned(const void *p) {
    for (int i = 0; i < MAX_PINNED; i++)
        if (pinned[i].p && (const char *)p >= pinned[i].p && (const char *)p < pinned[i].p + pinned[i].n)
            return 1;
    return 0;
}

/* --- the API ----------------------------------------------------------------------------------- */

int cudaMalloc(void **devPtr, size_t size) { return device_alloc(devPtr, size); }
int cudaFree(void *devPtr) { return device_free(devPtr); }
int cudaMallocHost(void **ptr, size_t size) { return host_alloc(ptr, size); }
int cudaHostAlloc(void **pHost, size_t size, unsigned int flags) { return host_alloc(pHost, size); }
int cudaFreeHost(void *ptr) {
    for (int i = 0; i < MAX_PINNED; i++)
        if (pinned[i].p == ptr) {
            free(pinned[i].p);
            pinned[i].p = NULL;
            return cudaSuccess;
        }
    return cudaErrorInvalidValue;
}

static const void *loaded[MAX_KERNELS];
static int nloaded;

int cudaLaunchKernel(const void *func, dim3 grid, dim3 block, void **args, size_t sharedMem, cudaStream_t stream) {
    context();
    if (!func)
        return 98; /* cudaErrorInvalidDeviceFunction */
    int known = 0;
    for (int i = 0; i < nloaded && !known; i++)
        known = loaded[i] == func;
    if (!known && nloaded < MAX_KERNELS) {
        loaded[nloaded++] = func;
        if (module_ns)
            sleep_until(mono_ns() + module_ns); /* lazy loading: the module on the kernel's first launch */
    }
    double factor = 1.0 + throttle * (double)(mono_ns() - created_ns) / 1e9;
    enqueue((uint64_t)((double)sharedMem * 1000.0 * factor));
    host_work_ns(4000);
    return cudaSuccess;
}

int cudaStreamSynchronize(cudaStream_t stream) {
    context();
    drain();
    return cudaSuccess;
}

int cudaDeviceSynchronize(void) {
    context();
    drain();
    return cudaSuccess;
}

int cudaMemcpy(void *dst, const void *src, size_t count, int kind) {
    context();
    if (kind < 0 || kind > 4)
        return 21; /* cudaErrorInvalidMemcpyDirection */
    drain();
    double bytes_per_ns = 12.0;
    if (kind == 1 && !is_pinned(src))
        bytes_per_ns = 3.0;
    else if (kind == 2 && !is_pinned(dst))
        bytes_per_ns = 3.0;
    else if (kind == 3)
        bytes_per_ns = 400.0;
    sleep_until(mono_ns() + 10000 + (uint64_t)((double)count / bytes_per_ns));
    return cudaSuccess;
}
