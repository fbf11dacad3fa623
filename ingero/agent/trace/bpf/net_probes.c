// net_probes.c — socket send/receive of the traced processes. Events (source NET, as Ingero stores them):
//   net_send (send, sendto, sendmsg), net_recv (recv, recvfrom, recvmsg): ts = the call's entry,
//   duration = its latency, arg0 = bytes moved (0 on error), arg1 = the socket's file descriptor (one
//   connection of the process), ret = the error or 0.
// Only processes in `targets` (the traced GPU processes and their children) are recorded, and no other
// process may pay for it (bench/bench_overhead.py measures the mechanisms):
//   * by default, uprobes on libc's socket functions, attached by probes.py to each traced process only
//     (a perf event per process: the kernel plants the breakpoint in that process's memory alone, so
//     every other process runs its socket calls untouched). On error libc returns -1 and leaves errno
//     in the thread's TLS: the return probe reads it there (libc_errno below) and records -errno, as
//     the tracepoints do; -1 stays where it cannot (no BTF for the FS base, a libc not of glibc's
//     x86-64 shape). A target's calls are seen from the agent's next sync (tracer.py).
//     The syscall tracepoints this replaced put every syscall of every process on the kernel's slow
//     path (+40 % on an untraced socket round trip); fentry/BTF programs are refused by kernels in
//     lockdown, like this one.
//   * with INGERO_SOCKET_RW (`ingero trace --socket-rw`, opt-in, its own cost), the syscall tracepoints:
//     sendto/sendmsg/recvfrom/recvmsg, and read(2)/write(2) on a socket (TLS libraries and plain socket
//     streams use them): after the `targets` check, the fd is looked up in the task's file table and
//     kept only when its inode is a socket. Those fire on every read and write of every process on
//     the host. ret = negative errno there.

struct net_start {
    u64 ts;
    u64 fd;
    u32 op;
    u32 _pad;
};

BPF_TABLE("lru_hash", u32, struct net_start, net_inflight, 16384);  // tid -> its socket call in flight

// A socket call of a traced process begins (the caller checked it is one).
static __always_inline void net_enter_traced(u64 fd, u32 op) {
    if (stopping())
        return;
    u32 tid = bpf_get_current_pid_tgid();
    struct net_start st = {.ts = bpf_ktime_get_ns(), .fd = fd, .op = op};
    net_inflight.update(&tid, &st);
}

static __always_inline void net_enter(u64 fd, u32 op) {
    u32 tgid = bpf_get_current_pid_tgid() >> 32;
    if (targets.lookup(&tgid))
        net_enter_traced(fd, op);
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

#if !INGERO_SOCKET_RW
// tgid -> errno's offset from the thread pointer in that process (negative: x86-64 static TLS sits
// below it), from the GOT slot glibc's __errno_location loads (libc_sockets.errno_tp_offset); set
// by probes.py with the process's socket uprobes.
BPF_HASH(errno_tpoff, u32, s64, 65536);

// A failed libc call (-1): -errno, read from the thread's TLS at its FS base (task->thread.fsbase, at
// the running kernel's offsets: INGERO_ERRNO_TLS / KOFF_*). Any other return, or -1 where errno cannot
// be read, is kept as it is.
static __always_inline long libc_errno(long ret) {
#if INGERO_ERRNO_TLS
    if (ret != -1)
        return ret;
    u32 tgid = bpf_get_current_pid_tgid() >> 32;
    s64 *off = errno_tpoff.lookup(&tgid);
    if (!off)
        return ret;
    void *task = (void *)bpf_get_current_task();
    u64 fsbase = 0;
    bpf_probe_read_kernel(&fsbase, sizeof(fsbase), task + KOFF_task_struct_thread + KOFF_thread_struct_fsbase);
    int err = 0;
    if (!fsbase || bpf_probe_read_user(&err, sizeof(err), (void *)(fsbase + *off)) || err <= 0 || err >= 4096)
        return ret;
    return -err;
#else
    return ret;
#endif
}

// libc's send/sendto/sendmsg (net_enter_send), recv/recvfrom/recvmsg (net_enter_recv): the fd is the
// first argument of each; net_return at their return. Attached per traced process (probes.py).
int net_enter_send(struct pt_regs *ctx) {
    net_enter_traced(PT_REGS_PARM1(ctx), OP_net_send);
    return 0;
}
int net_enter_recv(struct pt_regs *ctx) {
    net_enter_traced(PT_REGS_PARM1(ctx), OP_net_recv);
    return 0;
}
int net_return(struct pt_regs *ctx) {
    net_exit(libc_errno(PT_REGS_RC(ctx)));
    return 0;
}
#else
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

// 1 when `fd` of the current task is a socket: task->files->fdt->fd[fd]->f_inode->i_mode, each read
// with bpf_probe_read_kernel at the running kernel's offsets (KOFF_*, from its BTF: ingero/agent/trace/btf.py;
// the installed headers may describe another kernel).
static __always_inline void *kread_ptr(void *base, u64 off) {
    void *p = NULL;
    bpf_probe_read_kernel(&p, sizeof(p), base + off);
    return p;
}

static __always_inline int fd_is_socket(u64 fd) {
    void *task = (void *)bpf_get_current_task();
    void *files = kread_ptr(task, KOFF_task_struct_files);
    if (!files)
        return 0;
    void *fdt = kread_ptr(files, KOFF_files_struct_fdt);
    if (!fdt)
        return 0;
    u32 max_fds = 0;
    bpf_probe_read_kernel(&max_fds, sizeof(max_fds), fdt + KOFF_fdtable_max_fds);
    if (fd >= max_fds)
        return 0;
    void *fds = kread_ptr(fdt, KOFF_fdtable_fd);
    if (!fds)
        return 0;
    void *file = kread_ptr(fds, fd * sizeof(void *));
    if (!file)
        return 0;
    void *inode = kread_ptr(file, KOFF_file_f_inode);
    if (!inode)
        return 0;
    u16 mode = 0;
    bpf_probe_read_kernel(&mode, sizeof(mode), inode + KOFF_inode_i_mode);
    return (mode & 0170000) == 0140000;  // S_ISSOCK
}

static __always_inline void net_enter_rw(u64 fd, u32 op) {
    if (stopping())
        return;
    u32 tgid = bpf_get_current_pid_tgid() >> 32;
    if (!targets.lookup(&tgid) || !fd_is_socket(fd))
        return;
    net_enter_traced(fd, op);
}

TRACEPOINT_PROBE(syscalls, sys_enter_write) {
    net_enter_rw(args->fd, OP_net_send);
    return 0;
}
TRACEPOINT_PROBE(syscalls, sys_exit_write) {
    net_exit(args->ret);
    return 0;
}
TRACEPOINT_PROBE(syscalls, sys_enter_read) {
    net_enter_rw(args->fd, OP_net_recv);
    return 0;
}
TRACEPOINT_PROBE(syscalls, sys_exit_read) {
    net_exit(args->ret);
    return 0;
}
#endif
