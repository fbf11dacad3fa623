// cuda_more_probes.c — the CUDA calls beyond the core set of gpu_probes.c (appended after it: uses
// on_enter, the ENTRY macro and the shared return programs), and CUDA Graphs (Ingero's source 8).
//
// Arguments recorded (op ids and descriptions: ingero/store/catalog.py):
//   cudaMemcpy2D[Async]          arg0 = width * height bytes, arg1 = cudaMemcpyKind (7th argument: the first
//                                on the stack, stack_arg)
//   cudaMemcpyPeer[Async]        arg0 = bytes, arg1 = src device << 16 | dst device
//   cudaMemset[Async]            arg0 = bytes; cudaMemset2D[Async] arg0 = width * height
//   cudaEventSynchronize/Query   arg0 = event
//   cuMemFree[_v2] (libcuda)     arg0 = device pointer
//   cudaHostAlloc                arg0 = bytes, arg1 = flags;  cudaMallocHost arg0 = bytes
//   cudaMallocAsync              arg0 = bytes, arg1 = the returned pointer (out-parameter, on_return_out)
//   cudaFreeAsync                arg0 = device pointer
//   cudaStreamBeginCapture       arg0 = stream, arg1 = capture mode (cuStreamBeginCapture[_v2] too)
//   cudaStreamEndCapture         arg0 = stream, arg1 = the captured graph (out-parameter, on_return_out)
//   cudaGraphInstantiate         arg0 = graph, arg1 = the executable graph (out-parameter, on_return_out)
//   cudaGraphLaunch              arg0 = executable graph, arg1 = stream (cuGraphLaunch too)
// Programs paired with on_return_out record the out-parameter's address in arg1 at entry; the return
// replaces it by the value the call wrote there (0 when the call failed). Kernel launches record
// their grid and block in arg1 (catalog.LAUNCH_BLOCK_BITS: block x/y/z in bits 0-28, grid blocks in
// 32-63): enter_cudaLaunchKernel (gpu_probes.c) and enter_cuLaunchKernel (here) use launch_dims().

// The n-th (0-based) stack-passed argument at a function's first instruction (x86-64 SysV: the 7th
// integer argument is n = 0, just above the return address at [rsp]).
static __always_inline u64 stack_arg(struct pt_regs *ctx, int n) {
    u64 v = 0;
    bpf_probe_read_user(&v, sizeof(v), (void *)(PT_REGS_SP(ctx) + 8 * (n + 1)));
    return v;
}

// --- more CUDA runtime calls ---
int enter_cudaMemcpy2D(struct pt_regs *ctx) {
    u64 kind = stack_arg(ctx, 0);
    return on_enter(ctx, SRC_CUDA << 8 | OP_cudaMemcpy2D, PT_REGS_PARM5(ctx) * PT_REGS_PARM6(ctx), kind);
}
int enter_cudaMemcpy2DAsync(struct pt_regs *ctx) {
    u64 kind = stack_arg(ctx, 0);
    return on_enter(ctx, SRC_CUDA << 8 | OP_cudaMemcpy2DAsync, PT_REGS_PARM5(ctx) * PT_REGS_PARM6(ctx), kind);
}
ENTRY(cudaMemcpyPeer, SRC_CUDA, OP_cudaMemcpyPeer, PT_REGS_PARM5(ctx),
      (PT_REGS_PARM4(ctx) & 0xffff) << 16 | (PT_REGS_PARM2(ctx) & 0xffff))
ENTRY(cudaMemcpyPeerAsync, SRC_CUDA, OP_cudaMemcpyPeerAsync, PT_REGS_PARM5(ctx),
      (PT_REGS_PARM4(ctx) & 0xffff) << 16 | (PT_REGS_PARM2(ctx) & 0xffff))
ENTRY(cudaMemset, SRC_CUDA, OP_cudaMemset, PT_REGS_PARM3(ctx), 0)
ENTRY(cudaMemsetAsync, SRC_CUDA, OP_cudaMemsetAsync, PT_REGS_PARM3(ctx), 0)
ENTRY(cudaMemset2D, SRC_CUDA, OP_cudaMemset, PT_REGS_PARM4(ctx) * PT_REGS_PARM5(ctx), 0)
ENTRY(cudaMemset2DAsync, SRC_CUDA, OP_cudaMemsetAsync, PT_REGS_PARM4(ctx) * PT_REGS_PARM5(ctx), 0)
ENTRY(cudaEventSynchronize, SRC_CUDA, OP_cudaEventSynchronize, PT_REGS_PARM1(ctx), 0)
ENTRY(cudaEventQuery, SRC_CUDA, OP_cudaEventQuery, PT_REGS_PARM1(ctx), 0)
ENTRY(cudaHostAlloc, SRC_CUDA, OP_cudaHostAlloc, PT_REGS_PARM2(ctx), PT_REGS_PARM3(ctx))
ENTRY(cudaMallocHost, SRC_CUDA, OP_cudaMallocHost, PT_REGS_PARM2(ctx), 0)
ENTRY(cuMemFree, SRC_DRIVER, OP_cuMemFree, PT_REGS_PARM1(ctx), 0)  // libcuda
ENTRY(cudaMallocAsync, SRC_CUDA, OP_cudaMallocAsync, PT_REGS_PARM2(ctx), PT_REGS_PARM1(ctx))
ENTRY(cudaFreeAsync, SRC_CUDA, OP_cudaFreeAsync, PT_REGS_PARM1(ctx), 0)

// --- driver kernel launches with grid and block (block.z, the 7th argument, is the first on the stack)
int enter_cuLaunchKernel(struct pt_regs *ctx) {
    u64 bz = stack_arg(ctx, 0);
    u64 dims = launch_dims(PT_REGS_PARM2(ctx), PT_REGS_PARM3(ctx), PT_REGS_PARM4(ctx), PT_REGS_PARM5(ctx),
                           PT_REGS_PARM6(ctx), bz);
    return on_enter(ctx, SRC_DRIVER << 8 | OP_cuLaunchKernel, PT_REGS_PARM1(ctx), dims);
}

// --- CUDA Graphs (runtime and driver share the op) ---
ENTRY(cudaStreamBeginCapture, SRC_CUDA_GRAPH, OP_graphBeginCapture, PT_REGS_PARM1(ctx), PT_REGS_PARM2(ctx))
ENTRY(cudaStreamEndCapture, SRC_CUDA_GRAPH, OP_graphEndCapture, PT_REGS_PARM1(ctx), PT_REGS_PARM2(ctx))
ENTRY(cudaGraphInstantiate, SRC_CUDA_GRAPH, OP_graphInstantiate, PT_REGS_PARM2(ctx), PT_REGS_PARM1(ctx))
ENTRY(cudaGraphLaunch, SRC_CUDA_GRAPH, OP_graphLaunch, PT_REGS_PARM1(ctx), PT_REGS_PARM2(ctx))
