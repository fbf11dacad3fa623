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
int cudaMallocAsync(void **devPtr, size_t size, cudaStream_t stream) { return alloc(devPtr, size); }
int cudaFreeAsync(void *devPtr, cudaStream_t stream) { return devPtr ? 0 : 1; }
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

/* The calls beyond the core set (tests/test_bpf_breadth_calls.py): real signatures.
 *   cudaEventSynchronize(event) sleeps `event` microseconds; cudaEventQuery(event) returns
 *   cudaErrorNotReady (600) for an odd event; cudaStreamEndCapture / cudaGraphInstantiate write a new
 *   handle (0x6000000000 + n, 0x5000000000 + n) to their out-parameter. */
typedef void *cudaEvent_t;
typedef void *cudaGraph_t;
typedef void *cudaGraphExec_t;
static uintptr_t next_graph = 0x6000000000ull, next_exec = 0x5000000000ull;

int cudaMemcpy2D(void *dst, size_t dpitch, const void *src, size_t spitch, size_t width, size_t height, int kind) {
    return copy(kind);
}
int cudaMemcpy2DAsync(void *dst, size_t dpitch, const void *src, size_t spitch, size_t width, size_t height, int kind,
                      cudaStream_t stream) {
    return copy(kind);
}
int cudaMemcpyPeer(void *dst, int dstDevice, const void *src, int srcDevice, size_t count) { return 0; }
int cudaMemcpyPeerAsync(void *dst, int dstDevice, const void *src, int srcDevice, size_t count, cudaStream_t stream) {
    return 0;
}
int cudaMemset(void *devPtr, int value, size_t count) { return 0; }
int cudaMemsetAsync(void *devPtr, int value, size_t count, cudaStream_t stream) { return 0; }
int cudaMemset2D(void *devPtr, size_t pitch, int value, size_t width, size_t height) { return 0; }
int cudaMemset2DAsync(void *devPtr, size_t pitch, int value, size_t width, size_t height, cudaStream_t stream) {
    return 0;
}
int cudaEventSynchronize(cudaEvent_t event) {
    sleep_us((uint64_t)(uintptr_t)event);
    return 0;
}
int cudaEventQuery(cudaEvent_t event) { return ((uintptr_t)event & 1) ? 600 : 0; }
int cudaHostAlloc(void **pHost, size_t size, unsigned int flags) { return alloc(pHost, size); }
int cudaMallocHost(void **ptr, size_t size) { return alloc(ptr, size); }
int cudaStreamBeginCapture(cudaStream_t stream, int mode) { return 0; }
int cudaStreamEndCapture(cudaStream_t stream, cudaGraph_t *pGraph) {
    *pGraph = (cudaGraph_t)next_graph++;
    return 0;
}
int cudaGraphInstantiate(cudaGraphExec_t *pGraphExec, cudaGraph_t graph, unsigned long long flags) {
    *pGraphExec = (cudaGraphExec_t)next_exec++;
    return 0;
}
int cudaGraphLaunch(cudaGraphExec_t graphExec, cudaStream_t stream) {
    sleep_us(50);
    return graphExec ? 0 : 400;
}
