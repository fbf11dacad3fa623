/* A CUDA-runtime-shaped libcudart.so.12 for the bpf tests: the real signatures, no GPU.
 * Built by the tests with -O0 -fno-omit-frame-pointer -fcf-protection=none so every function starts
 * with `push %rbp` (the kernel emulates it; see ingero/agent/elfsyms.py).
 *   cudaStreamSynchronize(stream) sleeps `stream` microseconds (the workload encodes known sleeps);
 *   cudaDeviceSynchronize() sleeps 3 ms; cudaLaunchKernel spins on the CPU for `sharedMem` microseconds;
 *   cudaMalloc of more than 1 TiB fails with cudaErrorMemoryAllocation (2);
 *   cudaMallocManaged(..., flags = 0x10) calls cudaMalloc (through the PLT: a nested probed call). */
#include <stddef.h>
#include <stdint.h>
#include <time.h>

typedef struct { unsigned x, y, z; } dim3;
typedef void *cudaStream_t;

static void sleep_us(uint64_t us) {
    struct timespec ts = {(time_t)(us / 1000000), (long)(us % 1000000) * 1000};
    nanosleep(&ts, NULL);
}

static uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static void spin_us(uint64_t us) {
    /* `us` microseconds of this thread's CPU time: preemption makes the call longer, not shorter */
    uint64_t end = now_ns() + us * 1000;
    while (now_ns() < end) {
    }
}

static uintptr_t next_ptr = 0x7000000000ull;

/* Internal helpers are static: no probed function calls another one, so the counts stay exact. */
static int alloc(void **devPtr, size_t size) {
    if (size > (1ull << 40))
        return 2; /* cudaErrorMemoryAllocation */
    *devPtr = (void *)next_ptr;
    next_ptr += 4096;
    return 0;
}
static int copy(int kind) { return kind >= 0 && kind <= 4 ? 0 : 21; }

int cudaMalloc(void **devPtr, size_t size) { return alloc(devPtr, size); }
int cudaFree(void *devPtr) { return devPtr ? 0 : 1; }
int cudaMallocManaged(void **devPtr, size_t size, unsigned int flags) {
    if (flags == 0x10) /* the nesting test: one probed function calling another, like cudart -> libcuda */
        return cudaMalloc(devPtr, size);
    return alloc(devPtr, size);
}
int cudaLaunchKernel(const void *func, dim3 grid, dim3 block, void **args, size_t sharedMem, cudaStream_t stream) {
    if (sharedMem)
        spin_us(sharedMem);
    return func ? 0 : 98;
}
int cudaMemcpy(void *dst, const void *src, size_t count, int kind) { return copy(kind); }
int cudaMemcpyAsync(void *dst, const void *src, size_t count, int kind, cudaStream_t stream) { return copy(kind); }
int cudaStreamSynchronize(cudaStream_t stream) {
    sleep_us((uint64_t)(uintptr_t)stream);
    return 0;
}
int cudaDeviceSynchronize(void) {
    sleep_us(3000);
    return 0;
}
