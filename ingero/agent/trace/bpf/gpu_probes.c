// gpu_probes.c — uprobes/uretprobes on the CUDA runtime (libcudart) and the CUDA driver (libcuda); NCCL's
// are in nccl_probes.c, appended after this file (it reuses on_enter / on_return / return_frame).
//
// Each probed function has its own small entry program (enter_<name>) that records the entry time
// and the interesting arguments on the calling thread's entry stack; one shared return program
// (on_return) pops that frame and emits the event with duration, return code and user stack.
// Calls nest (libcudart's cudaMalloc calls libcuda's cuMemAlloc_v2): the per-thread stack keeps
// them apart.
//
// Arguments recorded (see ingero/store/catalog.py for the ids):
//   cudaMalloc/cudaMallocManaged/cuMemAlloc_v2/cuMemAllocManaged  arg0 = bytes, arg1 = the returned pointer
//                                            (out-parameter read at return by on_return_out; 0 on failure)
//   cudaFree                                 arg0 = device pointer
//   cudaLaunchKernel/cuLaunchKernel          arg0 = kernel function pointer, arg1 = grid and block (launch_dims)
//   cudaMemcpy[Async]                        arg0 = bytes, arg1 = cudaMemcpyKind (0 H2H, 1 H2D, 2 D2H, 3 D2D, 4 default)
//   cuMemcpy*[Async]                         arg0 = bytes, arg1 = direction as cudaMemcpyKind (cuMemcpy: 4)
//   cudaStreamSynchronize                    arg0 = stream

static __always_inline int on_enter(struct pt_regs *ctx, u32 source_op, u64 arg0, u64 arg1) {
    if (stopping())
        return 0;
    u64 id = bpf_get_current_pid_tgid();
    struct entry_stack *s = thread_entries((u32)id, 1);
    if (!s)
        return 0;
    if (s->allowed == 0) {  // first call of this thread: decide once
        u32 tgid = id >> 32;
#if INGERO_PID_FILTER
        s->allowed = (targets.lookup(&tgid) || uid_targeted(tgid)) ? 1 : 2;
#else
        u8 one = 1;
        s->allowed = 1;
        targets.update(&tgid, &one);  // host tracepoints now follow this process
#endif
    }
    if (s->allowed != 1)
        return 0;
    struct entry_frame *f = push_frame(s, ENTRY_SP(ctx));
    f->ts = bpf_ktime_get_ns();
    f->arg0 = arg0;
    f->arg1 = arg1;
    f->source_op = source_op;
    return 0;
}

// The returning call's frame (see pop_frame in ingero_common.h), or 0 when there is nothing to report.
static __always_inline struct entry_frame *return_frame(struct pt_regs *ctx, struct entry_stack *s) {
    if (s->allowed != 1 || stopping())
        return 0;
    return pop_frame(s, RETURN_SP(ctx));
}

// The value a call wrote to its out-parameter `addr` (cudaMalloc's pointer, a graph handle), 0 when the
// call failed (rc != 0) or there is none.
static __always_inline u64 out_value(u64 addr, s32 rc) {
    u64 v = 0;
    if (addr && rc == 0)
        bpf_probe_read_user(&v, sizeof(v), (void *)addr);
    return v;
}

// The return of any entry program: one event. arg1_out: arg1 holds an out-parameter's address, read
// its value now (on_return_out).
static __always_inline int finish_return(struct pt_regs *ctx, int arg1_out) {
    u64 id = bpf_get_current_pid_tgid();
    u32 tid = id;
    struct entry_stack *s = thread_entries(tid, 0);
    if (!s)
        return 0;
    struct entry_frame *f = return_frame(ctx, s);
    if (!f)
        return 0;
    u64 now = bpf_ktime_get_ns();
    struct ingero_event *e = reserve_event();
    if (!e)
        return 0;
    e->ts = f->ts;
    e->duration = now - f->ts;
    e->arg0 = f->arg0;
    e->arg1 = arg1_out ? out_value(f->arg1, (s32)PT_REGS_RC(ctx)) : f->arg1;
    e->cgroup_id = bpf_get_current_cgroup_id();
    e->pid = id >> 32;
    e->tid = tid;
    e->ret = (s32)PT_REGS_RC(ctx);
    e->stack_id = capture_stack(ctx, s);
    e->source = f->source_op >> 8;
    e->op = f->source_op & 0xff;
    e->cpu = bpf_get_smp_processor_id();
    e->flags = 0;
    submit_event(e);
    return 0;
}

int on_return(struct pt_regs *ctx) { return finish_return(ctx, 0); }
int on_return_out(struct pt_regs *ctx) { return finish_return(ctx, 1); }

// A launch's grid and block packed in one u64 (catalog.LAUNCH_BLOCK_BITS and launch_dims()).
static __always_inline u64 launch_dims(u64 gx, u64 gy, u64 gz, u64 bx, u64 by, u64 bz) {
    u64 g = (gx & 0xffffffff) * (gy & 0xffff) * (gz & 0xffff);
    if (g > 0xffffffff)
        g = 0xffffffff;
    return g << 32 | (bx & 0x7ff) | (by & 0x7ff) << 11 | (bz & 0x7f) << 22;
}

#define ENTRY(name, source, op, a0, a1) \
    int enter_##name(struct pt_regs *ctx) { return on_enter(ctx, ((source) << 8) | (op), (u64)(a0), (u64)(a1)); }

// --- CUDA runtime (libcudart) ---
ENTRY(cudaMalloc, SRC_CUDA, OP_cudaMalloc, PT_REGS_PARM2(ctx), PT_REGS_PARM1(ctx))  // on_return_out: the pointer
ENTRY(cudaFree, SRC_CUDA, OP_cudaFree, PT_REGS_PARM1(ctx), 0)
// dim3 grid and block by value: (x | y << 32, z) in two registers each
ENTRY(cudaLaunchKernel, SRC_CUDA, OP_cudaLaunchKernel, PT_REGS_PARM1(ctx),
      launch_dims(PT_REGS_PARM2(ctx), PT_REGS_PARM2(ctx) >> 32, PT_REGS_PARM3(ctx), PT_REGS_PARM4(ctx),
                  PT_REGS_PARM4(ctx) >> 32, PT_REGS_PARM5(ctx)))
ENTRY(cudaMemcpy, SRC_CUDA, OP_cudaMemcpy, PT_REGS_PARM3(ctx), PT_REGS_PARM4(ctx))
ENTRY(cudaStreamSynchronize, SRC_CUDA, OP_cudaStreamSync, PT_REGS_PARM1(ctx), 0)
ENTRY(cudaDeviceSynchronize, SRC_CUDA, OP_cudaDeviceSync, 0, 0)
ENTRY(cudaMemcpyAsync, SRC_CUDA, OP_cudaMemcpyAsync, PT_REGS_PARM3(ctx), PT_REGS_PARM4(ctx))
ENTRY(cudaMallocManaged, SRC_CUDA, OP_cudaMallocManaged, PT_REGS_PARM2(ctx), PT_REGS_PARM1(ctx))

// --- CUDA driver (libcuda) ---
// enter_cuLaunchKernel is in cuda_more_probes.c (block.z is on the stack: stack_arg)
ENTRY(cuMemcpy, SRC_DRIVER, OP_cuMemcpy, PT_REGS_PARM3(ctx), 4)
ENTRY(cuMemcpyHtoD, SRC_DRIVER, OP_cuMemcpy, PT_REGS_PARM3(ctx), 1)
ENTRY(cuMemcpyDtoH, SRC_DRIVER, OP_cuMemcpy, PT_REGS_PARM3(ctx), 2)
ENTRY(cuMemcpyDtoD, SRC_DRIVER, OP_cuMemcpy, PT_REGS_PARM3(ctx), 3)
ENTRY(cuMemcpyAsync, SRC_DRIVER, OP_cuMemcpyAsync, PT_REGS_PARM3(ctx), 4)
ENTRY(cuMemcpyHtoDAsync, SRC_DRIVER, OP_cuMemcpyAsync, PT_REGS_PARM3(ctx), 1)
ENTRY(cuMemcpyDtoHAsync, SRC_DRIVER, OP_cuMemcpyAsync, PT_REGS_PARM3(ctx), 2)
ENTRY(cuMemcpyDtoDAsync, SRC_DRIVER, OP_cuMemcpyAsync, PT_REGS_PARM3(ctx), 3)
ENTRY(cuCtxSynchronize, SRC_DRIVER, OP_cuCtxSynchronize, 0, 0)
ENTRY(cuMemAlloc, SRC_DRIVER, OP_cuMemAlloc, PT_REGS_PARM2(ctx), PT_REGS_PARM1(ctx))
ENTRY(cuMemAllocManaged, SRC_DRIVER, OP_cuMemAllocManaged, PT_REGS_PARM2(ctx), PT_REGS_PARM1(ctx))
