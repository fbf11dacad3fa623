// nccl_probes.c — uprobes/uretprobes on NCCL (libnccl): collectives, point-to-point calls and the
// communicator's identity. Appended after gpu_probes.c (it uses on_enter, on_return and the frame
// helpers of ingero_common.h). Ids come from ingero/store/catalog.py through -D flags (probes.py):
//   SRC_NCCL                 the NCCL source id (9: Ingero's 8 is CUDA Graph events)
//   OP_NCCL_COMM_INIT        control record: one communicator (NCCL_COMM_INIT_OP)
//   OP_NCCL_CALL_ENTER       control record: one call's entry (NCCL_CALL_ENTER_OP)
//
// Each collective / send / recv records, as any GPU call, an event at its return (arg0 = bytes =
// count × datatype size, arg1 = the local communicator pointer) and, at its entry, an
// OP_NCCL_CALL_ENTER record that carries what the cross-node join needs:
//   ts      the entry time (the same value as the call's event: the frame's)
//   arg0    count (elements)            arg1   communicator pointer
//   flags   seq: the k-th collective on this communicator in this process (per (tgid, comm), from 0);
//           send/recv are numbered apart (each rank issues its own), so collectives align across ranks
//   ret     peer (send/recv) or root (broadcast/reduce); -1 when the call has none
//   cpu     op | datatype << 4 | redop << 8  (4 bits each; redop 15 = none)
// so that a call that never returns (a rank waiting for a hung peer) is still seen entering.
//
// ncclCommInitRank[Config](ncclComm_t *comm, int nranks, ncclUniqueId id /* 128 bytes, by value, on
// the stack */, int rank, ...): at entry the 16 words of the id are folded with splitmix64 (the
// cluster-wide communicator id, catalog.nccl_comm_id) and kept per thread until the return, whose
// OP_NCCL_COMM_INIT record carries arg0 = communicator, arg1 = nranks << 32 | rank, cgroup_id = the id.
// ncclCommInitAll(ncclComm_t *comms, int ndev, const int *devlist): comms[i] has rank i, id 0 (the
// communicators of one process: nothing to match across nodes).

#define NCCL_NO_REDOP 15

struct nccl_seq_key {
    u64 comm;
    u32 pid;
    u32 p2p;  // 1: the send/recv counter, 0: the collectives' (ranks issue different p2p calls)
};
BPF_HASH(nccl_seq, struct nccl_seq_key, u32, 16384);  // (tgid, comm) -> next seq
BPF_HASH(nccl_init_id, u32, u64, 4096);                // tid -> comm id of its ncclCommInitRank in flight

static __always_inline u64 nccl_bytes(u64 count, u64 datatype) {
    // ncclInt8, ncclUint8, ncclInt32, ncclUint32, ncclInt64, ncclUint64, ncclFloat16, ncclFloat32,
    // ncclFloat64, ncclBfloat16, ncclFloat8e4m3, ncclFloat8e5m2 (catalog.NCCL_DATATYPES)
    u64 size = 1;
    switch (datatype) {
    case 2: case 3: case 7: size = 4; break;
    case 4: case 5: case 8: size = 8; break;
    case 6: case 9: size = 2; break;
    default: size = 1;
    }
    return count * size;
}

static __always_inline u64 nccl_stack_arg(struct pt_regs *ctx, int n) {
    // n-th stack-passed argument (0-based) at function entry: [rsp] is the return address.
    u64 v = 0;
    bpf_probe_read_user(&v, sizeof(v), (void *)(PT_REGS_SP(ctx) + 8 * (n + 1)));
    return v;
}

static __always_inline u64 splitmix64(u64 x) {
    u64 z = x + 0x9E3779B97F4A7C15ULL;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
}

// One NCCL call's entry: the usual frame (via on_enter), then the entry record with its seq.
static __always_inline int nccl_enter(struct pt_regs *ctx, u32 op, u64 count, u64 datatype, u64 redop, s64 peer,
                                      u64 comm) {
    on_enter(ctx, (SRC_NCCL << 8) | op, nccl_bytes(count, datatype), comm);
    u64 id = bpf_get_current_pid_tgid();
    struct entry_stack *s = thread_entries((u32)id, 0);
    if (!s || s->allowed != 1 || s->depth == 0 || s->depth > MAX_NEST)
        return 0;
    struct entry_frame *f = frame_at(s, s->depth - 1);
    if (f->sp != ENTRY_SP(ctx) || f->source_op != ((SRC_NCCL << 8) | op))
        return 0;  // no frame was pushed for this call
    struct nccl_seq_key key = {.comm = comm, .pid = id >> 32, .p2p = op == OP_ncclSend || op == OP_ncclRecv};
    u32 zero = 0;
    u32 *next = nccl_seq.lookup_or_try_init(&key, &zero);
    if (!next)
        return 0;
    // NCCL requires the calls on one communicator to be issued in order (one thread at a time): a
    // plain read-increment is enough (an atomic fetch-and-add's result is not usable on every kernel).
    u32 seq = *next;
    *next = seq + 1;
    struct ingero_event *e = reserve_event();
    if (!e)
        return 0;
    e->ts = f->ts;
    e->duration = 0;
    e->arg0 = count;
    e->arg1 = comm;
    e->cgroup_id = 0;
    e->pid = id >> 32;
    e->tid = (u32)id;
    e->ret = (s32)peer;
    e->stack_id = -1;
    e->source = SRC_NCCL;
    e->op = OP_NCCL_CALL_ENTER;
    e->cpu = (u16)((op & 0xf) | ((datatype & 0xf) << 4) | ((redop > NCCL_NO_REDOP ? NCCL_NO_REDOP : redop) << 8));
    e->flags = seq;
    submit_event(e);
    return 0;
}

#define P(n) PT_REGS_PARM##n(ctx)
// ncclAllReduce(sendbuff, recvbuff, count, datatype, op, comm, stream)
int enter_ncclAllReduce(struct pt_regs *ctx) { return nccl_enter(ctx, OP_ncclAllReduce, P(3), P(4), P(5), -1, P(6)); }
// ncclBroadcast(sendbuff, recvbuff, count, datatype, root, comm, stream)
int enter_ncclBroadcast(struct pt_regs *ctx) {
    return nccl_enter(ctx, OP_ncclBroadcast, P(3), P(4), NCCL_NO_REDOP, (s32)P(5), P(6));
}
// ncclReduce(sendbuff, recvbuff, count, datatype, op, root, comm /* stack */, stream)
int enter_ncclReduce(struct pt_regs *ctx) { return nccl_enter(ctx, OP_ncclReduce, P(3), P(4), P(5), (s32)P(6), nccl_stack_arg(ctx, 0)); }
// ncclAllGather(sendbuff, recvbuff, sendcount, datatype, comm, stream)
int enter_ncclAllGather(struct pt_regs *ctx) { return nccl_enter(ctx, OP_ncclAllGather, P(3), P(4), NCCL_NO_REDOP, -1, P(5)); }
// ncclReduceScatter(sendbuff, recvbuff, recvcount, datatype, op, comm, stream)
int enter_ncclReduceScatter(struct pt_regs *ctx) { return nccl_enter(ctx, OP_ncclReduceScatter, P(3), P(4), P(5), -1, P(6)); }
// ncclSend(sendbuff, count, datatype, peer, comm, stream) / ncclRecv(recvbuff, count, datatype, peer, comm, stream)
int enter_ncclSend(struct pt_regs *ctx) { return nccl_enter(ctx, OP_ncclSend, P(2), P(3), NCCL_NO_REDOP, (s32)P(4), P(5)); }
int enter_ncclRecv(struct pt_regs *ctx) { return nccl_enter(ctx, OP_ncclRecv, P(2), P(3), NCCL_NO_REDOP, (s32)P(4), P(5)); }

// --- communicators ---
#define COMM_INIT_ONE (1ULL << 63)

// rank is the third integer register: the by-value id takes none. The id sits above the return address.
int enter_ncclCommInitRank(struct pt_regs *ctx) {
    u64 words[16] = {};
    bpf_probe_read_user(words, sizeof(words), (void *)(PT_REGS_SP(ctx) + 8));
    u64 h = 0;
#pragma unroll
    for (int i = 0; i < 16; i++)
        h = splitmix64(h ^ words[i]);
    u32 tid = (u32)bpf_get_current_pid_tgid();
    nccl_init_id.update(&tid, &h);
    return on_enter(ctx, (SRC_NCCL << 8) | OP_NCCL_COMM_INIT, P(1),
                    COMM_INIT_ONE | ((P(2) & 0xffffffffULL) << 32) | (P(3) & 0xffffffffULL));
}
int enter_ncclCommInitAll(struct pt_regs *ctx) {
    return on_enter(ctx, (SRC_NCCL << 8) | OP_NCCL_COMM_INIT, P(1), P(2) & 0xffffffffULL);
}

static __always_inline void emit_comm(u32 pid, u32 tid, u64 ts, u64 dur, u64 comm, u64 nranks, u64 rank, u64 comm_id) {
    struct ingero_event *e = reserve_event();
    if (!e)
        return;
    e->ts = ts;
    e->duration = dur;
    e->arg0 = comm;
    e->arg1 = (nranks << 32) | (rank & 0xffffffffULL);
    e->cgroup_id = comm_id;
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
    u64 comm_id = 0;
    u64 *hashed = nccl_init_id.lookup(&tid);
    if (hashed) {
        comm_id = *hashed;
        nccl_init_id.delete(&tid);
    }
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
        emit_comm(id >> 32, tid, ts, now - ts, comm, (info >> 32) & 0x7fffffff, info & 0xffffffff, comm_id);
        return 0;
    }
    u64 ndev = info & 0xffffffff;
#pragma unroll
    for (int i = 0; i < 8; i++) {
        if (i >= ndev)
            break;
        bpf_probe_read_user(&comm, sizeof(comm), (void *)(addr + 8 * i));
        emit_comm(id >> 32, tid, ts, now - ts, comm, ndev, i, 0);
    }
    return 0;
}
#undef P
