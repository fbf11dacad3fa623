/* A CUDA-driver-shaped libcuda.so.1 for the bpf tests (see fake_cudart.c). cuCtxSynchronize sleeps 1 ms. */
#include <stddef.h>
#include <stdint.h>
#include <time.h>

typedef unsigned long long CUdeviceptr;
typedef void *CUfunction;
typedef void *CUstream;

static CUdeviceptr next_ptr = 0x9000000000ull;

int cuLaunchKernel(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                   unsigned sharedMem, CUstream stream, void **params, void **extra) {
    return f ? 0 : 400;
}
static int alloc(CUdeviceptr *dptr, size_t bytesize) {
    *dptr = next_ptr;
    next_ptr += bytesize;
    return 0;
}
int cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytesize) { return alloc(dptr, bytesize); }
int cuMemAllocManaged(CUdeviceptr *dptr, size_t bytesize, unsigned int flags) { return alloc(dptr, bytesize); }
int cuMemcpy(CUdeviceptr dst, CUdeviceptr src, size_t n) { return 0; }
int cuMemcpyHtoD_v2(CUdeviceptr dst, const void *src, size_t n) { return 0; }
int cuMemcpyDtoH_v2(void *dst, CUdeviceptr src, size_t n) { return 0; }
int cuMemcpyDtoD_v2(CUdeviceptr dst, CUdeviceptr src, size_t n) { return 0; }
int cuMemcpyAsync(CUdeviceptr dst, CUdeviceptr src, size_t n, CUstream s) { return 0; }
int cuMemcpyHtoDAsync_v2(CUdeviceptr dst, const void *src, size_t n, CUstream s) { return 0; }
int cuMemcpyDtoHAsync_v2(void *dst, CUdeviceptr src, size_t n, CUstream s) { return 0; }
int cuCtxSynchronize(void) {
    struct timespec ts = {0, 1000000};
    nanosleep(&ts, NULL);
    return 0;
}

/* CUDA Graphs through the driver (tests/test_bpf_breadth_calls.py). */
typedef void *CUgraph;
typedef void *CUgraphExec;
static unsigned long long next_cugraph = 0x4000000000ull;
int cuStreamBeginCapture_v2(CUstream s, int mode) { return 0; }
int cuStreamEndCapture(CUstream s, CUgraph *phGraph) {
    *phGraph = (CUgraph)next_cugraph++;
    return 0;
}
int cuGraphInstantiateWithFlags(CUgraphExec *phGraphExec, CUgraph hGraph, unsigned long long flags) {
    *phGraphExec = (CUgraphExec)(next_cugraph++ | 0x100000000000ull);
    return 0;
}
int cuGraphLaunch(CUgraphExec hGraphExec, CUstream hStream) { return hGraphExec ? 0 : 400; }
int cuMemFree_v2(CUdeviceptr dptr) { return dptr ? 0 : 1; }
