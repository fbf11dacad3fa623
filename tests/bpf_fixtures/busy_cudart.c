/* The few CUDA runtime functions busy_threads.c calls, with the real signatures, in a library of
 * their own (libcudart.so.12 in its own directory): the attach-race tests attach and detach its
 * probes twenty times, and fewer probes keep that quick. Built like the other fixtures (-O0
 * -fno-omit-frame-pointer -fcf-protection=none: every function starts with `push %rbp`).
 *   cudaLaunchKernel spins `sharedMem` microseconds of thread CPU time; cudaStreamSynchronize sleeps
 *   `stream` microseconds; cudaMallocManaged(..., 0x10) calls cudaMalloc (a nested probed call). */
#include <stddef.h>
#include <stdint.h>
#include <time.h>

typedef struct { unsigned x, y, z; } dim3;

static uint64_t cpu_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

int cudaMalloc(void **devPtr, size_t size) {
    *devPtr = (void *)(0x7000000000ull + size);
    return 0;
}
int cudaFree(void *devPtr) { return devPtr ? 0 : 1; }
int cudaMallocManaged(void **devPtr, size_t size, unsigned int flags) {
    if (flags == 0x10)
        return cudaMalloc(devPtr, size);
    *devPtr = (void *)0x7100000000ull;
    return 0;
}
int cudaLaunchKernel(const void *func, dim3 grid, dim3 block, void **args, size_t sharedMem, void *stream) {
    uint64_t end = cpu_ns() + (uint64_t)sharedMem * 1000;
    while (sharedMem && cpu_ns() < end) {
    }
    return func ? 0 : 98;
}
int cudaMemcpyAsync(void *dst, const void *src, size_t count, int kind, void *stream) { return kind >= 0 && kind <= 4 ? 0 : 21; }
int cudaStreamSynchronize(void *stream) {
    uint64_t us = (uint64_t)(uintptr_t)stream;
    struct timespec ts = {(time_t)(us / 1000000), (long)(us % 1000000) * 1000};
    nanosleep(&ts, NULL);
    return 0;
}
