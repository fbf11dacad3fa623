// host_probes.c — scheduler, process lifecycle, page allocation and OOM tracepoints.
//
// Only processes in `targets` are followed (the --pid targets, the processes that called a probed GPU
// function, and their forked children) — except process_exec, recorded for every process: a program
// started next to the GPU job is what explain names as the likely culprit. Tracepoint arguments come
// from tracefs formats, so no kernel struct layout is assumed.
//
// Events (source HOST = 3):
//   sched_switch (op 1)   one per return of a traced thread to a CPU. ts = back on CPU, duration =
//                         off-CPU time, arg0 = the thread's prev_state when it left (0 or 256 = still
//                         runnable, i.e. preempted; 1 = sleeping; 2 = uninterruptible, usually I/O),
//                         arg1 = tid of the task that ran on that CPU just before (the preemptor).
//   sched_wakeup (op 2)   a traced, off-CPU thread is woken. duration = time since it left the CPU,
//                         arg0 = waker tgid, arg1 = waker tid (run-queue wait = switch - wakeup);
//                         both 0 when no task woke it: the wakeup ran in a hard IRQ handler, a softirq
//                         or an hrtimer callback (a sleep's timer, a packet, a disk completion), where
//                         the current task is only the one the interrupt happened to interrupt.
//                         Recorded at the kernel's sched_waking, on the waker's CPU: sched_wakeup
//                         itself often runs on the wakee's CPU (a wakeup onto an idle or far CPU is
//                         queued there), where the current task is that CPU's idle task or any other.
//   process_exec (op 5; every process; arg1 = its previous pid), process_exit (op 6),
//   process_fork (op 7; pid = parent, arg1 = child pid; the child is traced from then on; new threads
//   are not forks)
//   oom_kill (op 4)       always recorded: pid = victim, arg0 = its resident bytes.
// mm_page_alloc (op 3) is aggregated in the kernel: `page_allocs` counts allocations and bytes per
// traced tgid, `page_allocs_rest` those of every other process (the reader's key 0); the reader turns
// the per-second deltas into summary rows.

// Op ids (OP_sched_switch, ...) come from ingero/store/catalog.py (see ingero_common.h).

struct offcpu_val {
    u64 ts;
    u32 tgid;
    u32 state;
};
BPF_HASH(offcpu, u32, struct offcpu_val, 65536);  // tid -> when it left the CPU

struct page_alloc_val {
    u64 count;
    u64 bytes;
};
BPF_PERCPU_HASH(page_allocs, u32, struct page_alloc_val, 16384);
// Every other process: one per-CPU array slot (its lookup inlined by the verifier) instead of a hash entry
// keyed 0: nearly every page allocation on a host is untraced, and every process pays this program. bpf_stats
// of the agent's program beside an empty one on the same tracepoint (2-vCPU VM, ~250 k runs/s): 127-130 ns a run
// with key 0 in the hash, 96-97 ns with this slot, the empty program 59-61 ns.
BPF_PERCPU_ARRAY(page_allocs_rest, struct page_alloc_val, 1);

BPF_HASH(new_tasks, u32, u64, 4096);  // child tid -> clone_flags (task_newtask -> sched_process_fork)

// Interrupt context, per CPU: how many hard IRQ handlers, softirqs and hrtimer callbacks are running
// now (they nest: a hard IRQ interrupts a softirq, an hrtimer runs inside the timer interrupt or the
// HRTIMER softirq). Raw tracepoints: no arguments are read, so none are copied (bpf_stats on a 2-vCPU VM:
// 56-71 ns a run, an empty program 55 ns; a few hundred interrupts a second at rest: < 0.01 % of a core). An
// exit without its entry (attached mid-interrupt) is ignored; an entry whose exit was missed is
// forgotten at the CPU's next context switch, which never happens inside an interrupt (no PREEMPT_RT).
BPF_PERCPU_ARRAY(irq_depth, u32, 1);

static __always_inline int irq_enter_exit(int step) {
    int zero = 0;
    u32 *d = irq_depth.lookup(&zero);
    if (d && (step > 0 || *d > 0))
        *d += step;
    return 0;
}

RAW_TRACEPOINT_PROBE(irq_handler_entry) { return irq_enter_exit(1); }
RAW_TRACEPOINT_PROBE(irq_handler_exit) { return irq_enter_exit(-1); }
RAW_TRACEPOINT_PROBE(softirq_entry) { return irq_enter_exit(1); }
RAW_TRACEPOINT_PROBE(softirq_exit) { return irq_enter_exit(-1); }
RAW_TRACEPOINT_PROBE(hrtimer_expire_entry) { return irq_enter_exit(1); }
RAW_TRACEPOINT_PROBE(hrtimer_expire_exit) { return irq_enter_exit(-1); }

TRACEPOINT_PROBE(sched, sched_switch) {
    u64 now = bpf_ktime_get_ns();
    int zero = 0;
    u32 *depth = irq_depth.lookup(&zero);
    if (depth && *depth)
        *depth = 0;  // a switch runs in task context: an exit was missed
    u32 prev = args->prev_pid;
    u32 next = args->next_pid;
    if (prev != 0) {
        // The tracepoint runs in the context of `prev`: its tgid is the current one.
        u32 tgid = bpf_get_current_pid_tgid() >> 32;
        if (targets.lookup(&tgid)) {
            struct offcpu_val v = {};
            v.ts = now;
            v.tgid = tgid;
            v.state = (u32)args->prev_state;
            offcpu.update(&prev, &v);
        }
    }
    if (next != 0) {
        struct offcpu_val *o = offcpu.lookup(&next);
        if (o) {
            emit_host(SRC_HOST, OP_sched_switch, now, now - o->ts, o->tgid, next, o->state, prev, 0);
            offcpu.delete(&next);
        }
    }
    return 0;
}

TRACEPOINT_PROBE(sched, sched_waking) {
    u32 wakee = args->pid;
    struct offcpu_val *o = offcpu.lookup(&wakee);
    if (!o)
        return 0;
    u64 now = bpf_ktime_get_ns();
    int zero = 0;
    u32 *depth = irq_depth.lookup(&zero);
    u64 id = depth && *depth ? 0 : bpf_get_current_pid_tgid();  // 0: an interrupt woke it, no task
    emit_host(SRC_HOST, OP_sched_wakeup, now, now - o->ts, o->tgid, wakee, id >> 32, (u32)id, 0);
    return 0;
}

TRACEPOINT_PROBE(task, task_newtask) {
    u32 child = args->pid;
    u64 flags = args->clone_flags;
    u32 tgid = bpf_get_current_pid_tgid() >> 32;
    if (targets.lookup(&tgid))
        new_tasks.update(&child, &flags);
    return 0;
}

TRACEPOINT_PROBE(sched, sched_process_fork) {
    u32 child = args->child_pid;
    u64 *flags = new_tasks.lookup(&child);
    if (!flags)
        return 0;
    u64 clone_flags = *flags;
    new_tasks.delete(&child);
    if (clone_flags & 0x00010000)  // CLONE_THREAD: a new thread, not a new process
        return 0;
    u8 one = 1;
    targets.update(&child, &one);
    u64 id = bpf_get_current_pid_tgid();
    emit_host(SRC_HOST, OP_process_fork, bpf_ktime_get_ns(), 0, id >> 32, (u32)id, 0, child, 0);
    return 0;
}

TRACEPOINT_PROBE(sched, sched_process_exec) {
    u64 id = bpf_get_current_pid_tgid();
    u32 tgid = id >> 32;
    emit_host(SRC_HOST, OP_process_exec, bpf_ktime_get_ns(), 0, tgid, (u32)id, 0, args->old_pid, 0);
    return 0;
}

TRACEPOINT_PROBE(sched, sched_process_exit) {
    u64 id = bpf_get_current_pid_tgid();
    u32 tgid = id >> 32;
    u32 tid = id;
    entries.delete(&tid);
    offcpu.delete(&tid);
    if (!args->group_dead)
        return 0;
    if (!targets.lookup(&tgid))
        return 0;
    emit_host(SRC_HOST, OP_process_exit, bpf_ktime_get_ns(), 0, tgid, tid, 0, 0, 0);
    targets.delete(&tgid);
    return 0;
}

TRACEPOINT_PROBE(kmem, mm_page_alloc) {
    if (stopping())
        return 0;
    u32 tgid = bpf_get_current_pid_tgid() >> 32;
    struct page_alloc_val *v;
    if (targets.lookup(&tgid)) {
        v = page_allocs.lookup(&tgid);
        if (!v) {
            struct page_alloc_val z = {};
            page_allocs.update(&tgid, &z);
            v = page_allocs.lookup(&tgid);
        }
    } else {
        u32 zero = 0;
        v = page_allocs_rest.lookup(&zero);
    }
    if (!v)
        return 0;
    v->count += 1;
    v->bytes += 4096ULL << args->order;
    return 0;
}

#if INGERO_HAVE_OOM
TRACEPOINT_PROBE(oom, mark_victim) {
    u32 victim = args->pid;
    u64 rss_kb = args->anon_rss + args->file_rss + args->shmem_rss;
    emit_host(SRC_HOST, OP_oom_kill, bpf_ktime_get_ns(), 0, victim, victim, rss_kb * 1024, args->total_vm * 1024, 0);
    return 0;
}
#endif
