// io_probes.c — block I/O latency (block_rq_issue -> block_rq_complete) and TCP retransmissions.
//
// Block I/O is recorded for the whole host (as Ingero does): a slow disk hurts a GPU job even when
// another process issued the I/O. Events (source IO = 5):
//   block_read (op 1), block_write (op 2), block_discard (op 3): ts = completion, duration = device
//   latency (issue -> complete), pid/tid = the task that issued the request, arg0 = size in 512-byte
//   sectors (Ingero's convention), arg1 = start sector, ret = the completion error (0 = ok).
//   Flush-only requests are skipped.
// TCP (source TCP = 6):
//   tcp_retransmit (op 1): pid/tid = current task (often a softirq: 0), arg0 = sport | dport << 16 |
//   family << 32 | TCP state << 48, arg1 = IPv4 destination address (network byte order; 0 for IPv6).

// Op ids (OP_block_read, ...) come from ingero/store/catalog.py (see ingero_common.h).

struct io_key {
    u32 dev;
    u32 _pad;
    u64 sector;
};

struct io_val {
    u64 ts;
    u32 pid;
    u32 tid;
    u32 sectors;
    u32 op;
};

BPF_HASH(io_inflight, struct io_key, struct io_val, 16384);

static __always_inline u32 classify_rwbs(const char *rwbs) {
    // rwbs: optional 'F' (flush), then 'R' / 'W' / 'D' / 'N', then modifiers.
    u32 op = 0;
#pragma unroll
    for (int i = 0; i < 3; i++) {
        char c = rwbs[i];
        if (c == 'D')
            return OP_block_discard;
        if (c == 'W')
            return OP_block_write;
        if (c == 'R')
            return OP_block_read;
        if (c != 'F')
            break;
    }
    return op;
}

TRACEPOINT_PROBE(block, block_rq_issue) {
    char rwbs[8] = {};
    bpf_probe_read_kernel(rwbs, sizeof(rwbs), args->rwbs);
    u32 op = classify_rwbs(rwbs);
    if (op == 0)
        return 0;
    struct io_key k = {};
    k.dev = args->dev;
    k.sector = args->sector;
    u64 id = bpf_get_current_pid_tgid();
    struct io_val v = {};
    v.ts = bpf_ktime_get_ns();
    v.pid = id >> 32;
    v.tid = id;
    v.sectors = args->nr_sector;
    v.op = op;
    io_inflight.update(&k, &v);
    return 0;
}

TRACEPOINT_PROBE(block, block_rq_complete) {
    struct io_key k = {};
    k.dev = args->dev;
    k.sector = args->sector;
    struct io_val *v = io_inflight.lookup(&k);
    if (!v)
        return 0;
    u64 now = bpf_ktime_get_ns();
    struct ingero_event *e = stopping() ? 0 : reserve_event();
    if (e) {
        e->ts = now;
        e->duration = now - v->ts;
        e->arg0 = v->sectors;
        e->arg1 = k.sector;
        e->cgroup_id = 0;  // completion runs in interrupt context
        e->pid = v->pid;
        e->tid = v->tid;
        e->ret = args->error;
        e->stack_id = -1;
        e->source = SRC_IO;
        e->op = v->op;
        e->cpu = bpf_get_smp_processor_id();
        e->flags = 0;
        submit_event(e);
    }
    io_inflight.delete(&k);
    return 0;
}

TRACEPOINT_PROBE(tcp, tcp_retransmit_skb) {
    u64 id = bpf_get_current_pid_tgid();
    u32 daddr = 0;
    if (args->family == 2)  // AF_INET
        bpf_probe_read_kernel(&daddr, sizeof(daddr), args->daddr);
    u64 info = (u64)args->sport | ((u64)args->dport << 16) | ((u64)args->family << 32) | ((u64)(args->state & 0xff) << 48);
    emit_host(SRC_TCP, OP_tcp_retransmit, bpf_ktime_get_ns(), 0, id >> 32, (u32)id, info, daddr, 0);
    return 0;
}
