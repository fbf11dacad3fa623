// gpu_probes.c — uprobes/uretprobes on the CUDA runtime (libcudart), the CUDA driver (libcuda) and
// NCCL (libnccl).
//
// Each probed function has its own small entry program (enter_<name>) that records the entry time
// and the interesting arguments on the calling thread's entry stack; one shared return program
// (on_return) pops that frame and emits the event with duration, return code and user stack.
// Calls nest (libcudart's cudaMalloc calls libcuda's cuMemAlloc_v2): the per-thread stack keeps
// them apart.
//
// Arguments recorded (see ingero/store/catalog.py for the ids):
//   cudaMalloc/cudaMallocManaged/cuMemAlloc_v2/cuMemAllocManaged  arg0 = bytes
//   cudaFree                                 arg0 = device pointer
//   cudaLaunchKernel/cuLaunchKernel          arg0 = kernel function pointer
//   cudaMemcpy[Async]                        arg0 = bytes, arg1 = cudaMemcpyKind (0 H2H, 1 H2D, 2 D2H, 3 D2D, 4 default)
//   cuMemcpy*[Async]                         arg0 = bytes, arg1 = direction as cudaMemcpyKind (cuMemcpy: 4)
//   cudaStreamSynchronize                    arg0 = stream
//   NCCL collectives                         arg0 = bytes (count x datatype size), arg1 = communicator
// The NCCL communicator -> (rank, nranks) mapping comes from ncclCommInitRank[Config] / ncclCommInitAll
// (on_return_comm emits an OP_NCCL_COMM_INIT control record per communicator).

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
        s->allowed = targets.lookup(&tgid) ? 1 : 2;
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

int on_return(struct pt_regs *ctx) {
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
    e->arg1 = f->arg1;
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

#define ENTRY(name, source, op, a0, a1) \
    int enter_##name(struct pt_regs *ctx) { return on_enter(ctx, ((source) << 8) | (op), (u64)(a0), (u64)(a1)); }

// --- CUDA runtime (libcudart) ---
ENTRY(cudaMalloc, SRC_CUDA, 1, PT_REGS_PARM2(ctx), 0)
ENTRY(cudaFree, SRC_CUDA, 2, PT_REGS_PARM1(ctx), 0)
ENTRY(cudaLaunchKernel, SRC_CUDA, 3, PT_REGS_PARM1(ctx), 0)
ENTRY(cudaMemcpy, SRC_CUDA, 4, PT_REGS_PARM3(ctx), PT_REGS_PARM4(ctx))
ENTRY(cudaStreamSynchronize, SRC_CUDA, 5, PT_REGS_PARM1(ctx), 0)
ENTRY(cudaDeviceSynchronize, SRC_CUDA, 6, 0, 0)
ENTRY(cudaMemcpyAsync, SRC_CUDA, 7, PT_REGS_PARM3(ctx), PT_REGS_PARM4(ctx))
ENTRY(cudaMallocManaged, SRC_CUDA, 8, PT_REGS_PARM2(ctx), 0)

// --- CUDA driver (libcuda) ---
ENTRY(cuLaunchKernel, SRC_DRIVER, 1, PT_REGS_PARM1(ctx), 0)
ENTRY(cuMemcpy, SRC_DRIVER, 2, PT_REGS_PARM3(ctx), 4)
ENTRY(cuMemcpyHtoD, SRC_DRIVER, 2, PT_REGS_PARM3(ctx), 1)
ENTRY(cuMemcpyDtoH, SRC_DRIVER, 2, PT_REGS_PARM3(ctx), 2)
ENTRY(cuMemcpyDtoD, SRC_DRIVER, 2, PT_REGS_PARM3(ctx), 3)
ENTRY(cuMemcpyAsync, SRC_DRIVER, 3, PT_REGS_PARM3(ctx), 4)
ENTRY(cuMemcpyHtoDAsync, SRC_DRIVER, 3, PT_REGS_PARM3(ctx), 1)
ENTRY(cuMemcpyDtoHAsync, SRC_DRIVER, 3, PT_REGS_PARM3(ctx), 2)
ENTRY(cuMemcpyDtoDAsync, SRC_DRIVER, 3, PT_REGS_PARM3(ctx), 3)
ENTRY(cuCtxSynchronize, SRC_DRIVER, 4, 0, 0)
ENTRY(cuMemAlloc, SRC_DRIVER, 5, PT_REGS_PARM2(ctx), 0)
ENTRY(cuMemAllocManaged, SRC_DRIVER, 6, PT_REGS_PARM2(ctx), 0)

// --- NCCL ---
static __always_inline u64 nccl_bytes(u64 count, u64 datatype) {
    // ncclInt8, ncclUint8, ncclInt32, ncclUint32, ncclInt64, ncclUint64, ncclFloat16, ncclFloat32,
    // ncclFloat64, ncclBfloat16, ncclFloat8e4m3, ncclFloat8e5m2
    u64 size = 1;
    switch (datatype) {
    case 2: case 3: case 7: size = 4; break;
    case 4: case 5: case 8: size = 8; break;
    case 6: case 9: size = 2; break;
    default: size = 1;
    }
    return count * size;
}

static __always_inline u64 stack_arg(struct pt_regs *ctx, int n) {
    // n-th stack-passed argument (0-based) at function entry: [rsp] is the return address.
    u64 v = 0;
    bpf_probe_read_user(&v, sizeof(v), (void *)(PT_REGS_SP(ctx) + 8 * (n + 1)));
    return v;
}

ENTRY(ncclAllReduce, SRC_NCCL, 1, nccl_bytes(PT_REGS_PARM3(ctx), PT_REGS_PARM4(ctx)), PT_REGS_PARM6(ctx))
ENTRY(ncclBroadcast, SRC_NCCL, 2, nccl_bytes(PT_REGS_PARM3(ctx), PT_REGS_PARM4(ctx)), PT_REGS_PARM6(ctx))
ENTRY(ncclReduce, SRC_NCCL, 3, nccl_bytes(PT_REGS_PARM3(ctx), PT_REGS_PARM4(ctx)), stack_arg(ctx, 0))
ENTRY(ncclAllGather, SRC_NCCL, 4, nccl_bytes(PT_REGS_PARM3(ctx), PT_REGS_PARM4(ctx)), PT_REGS_PARM5(ctx))
ENTRY(ncclReduceScatter, SRC_NCCL, 5, nccl_bytes(PT_REGS_PARM3(ctx), PT_REGS_PARM4(ctx)), PT_REGS_PARM6(ctx))
ENTRY(ncclSend, SRC_NCCL, 6, nccl_bytes(PT_REGS_PARM2(ctx), PT_REGS_PARM3(ctx)), PT_REGS_PARM5(ctx))
ENTRY(ncclRecv, SRC_NCCL, 7, nccl_bytes(PT_REGS_PARM2(ctx), PT_REGS_PARM3(ctx)), PT_REGS_PARM5(ctx))

// ncclCommInitRank[Config](ncclComm_t *comm, int nranks, ncclUniqueId id /* 128 bytes, on the stack */,
// int rank, ...): the by-value id takes no register, so rank is the third integer register.
#define COMM_INIT_ONE (1ULL << 63)
ENTRY(ncclCommInitRank, SRC_NCCL, OP_NCCL_COMM_INIT, PT_REGS_PARM1(ctx),
      COMM_INIT_ONE | ((PT_REGS_PARM2(ctx) & 0xffffffffULL) << 32) | (PT_REGS_PARM3(ctx) & 0xffffffffULL))
// ncclCommInitAll(ncclComm_t *comms, int ndev, const int *devlist): comms[i] has rank i.
ENTRY(ncclCommInitAll, SRC_NCCL, OP_NCCL_COMM_INIT, PT_REGS_PARM1(ctx), PT_REGS_PARM2(ctx) & 0xffffffffULL)

static __always_inline void emit_comm(u32 pid, u32 tid, u64 ts, u64 dur, u64 comm, u64 nranks, u64 rank) {
    struct ingero_event *e = reserve_event();
    if (!e)
        return;
    e->ts = ts;
    e->duration = dur;
    e->arg0 = comm;
    e->arg1 = (nranks << 32) | (rank & 0xffffffffULL);
    e->cgroup_id = 0;
    e->pid = pid;
    e->tid = tid;
    e->ret = 0;
    e->stack_id = -1;
    e->source = SRC_NCCL;
    e->op = OP_NCCL_COMM_INIT;
    e->cpu = 0;
    e->flags = 0;
    submit_event(e);
}

int on_return_comm(struct pt_regs *ctx) {
    u64 id = bpf_get_current_pid_tgid();
    u32 tid = id;
    struct entry_stack *s = thread_entries(tid, 0);
    if (!s)
        return 0;
    struct entry_frame *f = return_frame(ctx, s);
    if (!f || (s32)PT_REGS_RC(ctx) != 0)
        return 0;
    u64 now = bpf_ktime_get_ns();
    u64 addr = f->arg0;
    u64 info = f->arg1;
    u64 ts = f->ts;
    u64 comm = 0;
    if (info & COMM_INIT_ONE) {
        bpf_probe_read_user(&comm, sizeof(comm), (void *)addr);
        emit_comm(id >> 32, tid, ts, now - ts, comm, (info >> 32) & 0x7fffffff, info & 0xffffffff);
        return 0;
    }
    u64 ndev = info & 0xffffffff;
#pragma unroll
    for (int i = 0; i < 8; i++) {
        if (i >= ndev)
            break;
        bpf_probe_read_user(&comm, sizeof(comm), (void *)(addr + 8 * i));
        emit_comm(id >> 32, tid, ts, now - ts, comm, ndev, i);
    }
    return 0;
}
