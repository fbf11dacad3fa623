// net_probes.c — socket send/receive of the traced processes, from the syscall tracepoints (no
// kprobes needed). Events (source NET, as Ingero stores them):
//   net_send (sendto, sendmsg), net_recv (recvfrom, recvmsg): ts = syscall entry, duration = the
//   syscall's latency, arg0 = bytes moved (0 on error), arg1 = the socket's file descriptor (one
//   connection of the process), ret = the error (negative errno) or 0.
// Only processes in `targets` (the traced GPU processes and their children) are recorded. Plain
// read/write on sockets are not: telling a socket from a file needs a kprobe or a per-fd lookup on
// the hottest syscalls of every process.

struct net_start {
    u64 ts;
    u64 fd;
    u32 op;
    u32 _pad;
};

BPF_HASH(net_inflight, u32, struct net_start, 16384);  // tid -> its socket syscall in flight

static __always_inline void net_enter(u64 fd, u32 op) {
    if (stopping())
        return;
    u64 id = bpf_get_current_pid_tgid();
    u32 tgid = id >> 32;
    if (!targets.lookup(&tgid))
        return;
    u32 tid = id;
    struct net_start st = {.ts = bpf_ktime_get_ns(), .fd = fd, .op = op};
    net_inflight.update(&tid, &st);
}

static __always_inline void net_exit(long ret) {
    u64 id = bpf_get_current_pid_tgid();
    u32 tid = id;
    struct net_start *st = net_inflight.lookup(&tid);
    if (!st)
        return;
    struct net_start s = *st;
    net_inflight.delete(&tid);
    u64 now = bpf_ktime_get_ns();
    emit_host(SRC_NET, s.op, s.ts, now - s.ts, id >> 32, tid, ret > 0 ? (u64)ret : 0, s.fd, ret < 0 ? (s32)ret : 0);
}

TRACEPOINT_PROBE(syscalls, sys_enter_sendto) {
    net_enter(args->fd, OP_net_send);
    return 0;
}
TRACEPOINT_PROBE(syscalls, sys_exit_sendto) {
    net_exit(args->ret);
    return 0;
}
TRACEPOINT_PROBE(syscalls, sys_enter_sendmsg) {
    net_enter(args->fd, OP_net_send);
    return 0;
}
TRACEPOINT_PROBE(syscalls, sys_exit_sendmsg) {
    net_exit(args->ret);
    return 0;
}
TRACEPOINT_PROBE(syscalls, sys_enter_recvfrom) {
    net_enter(args->fd, OP_net_recv);
    return 0;
}
TRACEPOINT_PROBE(syscalls, sys_exit_recvfrom) {
    net_exit(args->ret);
    return 0;
}
TRACEPOINT_PROBE(syscalls, sys_enter_recvmsg) {
    net_enter(args->fd, OP_net_recv);
    return 0;
}
TRACEPOINT_PROBE(syscalls, sys_exit_recvmsg) {
    net_exit(args->ret);
    return 0;
}
