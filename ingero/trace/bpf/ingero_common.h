// ingero_common.h — shared event record, maps and helpers of every ingero BPF program.
//
// probes.py prepends this file to the .c files (bcc rewrites map calls such as `events.ringbuf_reserve`
// only in its main file, so these helpers cannot live behind an #include) and compiles the result
// with these -D settings:
//   INGERO_PID_FILTER   1: only processes in `targets` are traced (--pid); 0: every process that calls a
//                       probed GPU function is traced and enrolled in `targets` for the host tracepoints
//   INGERO_STACK_MODE   0: no stacks; 1: one full user-stack walk per call site and thread, reused
//                       afterwards (see capture_stack); 2: walk every call
//   INGERO_RING_PAGES   ring buffer size in pages (power of two)
//
// Every record is one fixed 64-byte struct ingero_event: the userspace reader (ingero/agent/ringbuf.py)
// maps the ring buffer and decodes records in bulk with numpy, so every record must have this size.
// Records are submitted with BPF_RB_NO_WAKEUP: the reader polls on a timer instead of being woken per
// event (a wakeup costs ~16 µs here).

#include <uapi/linux/ptrace.h>

#define SRC_CUDA 1
#define SRC_HOST 3
#define SRC_DRIVER 4
#define SRC_IO 5
#define SRC_TCP 6
#define SRC_NCCL 8

// Private op ids (>= 100) are control records for the reader, never stored as events.
#define OP_NCCL_COMM_INIT 100

// Kernel-side counters (per-CPU array, read by userspace into session_stats).
#define CNT_RING_FULL 0      // event lost: ring buffer full
#define CNT_NEST_OVERFLOW 1  // probed calls nested deeper than MAX_NEST on one thread
#define CNT_ORPHAN_RETURN 2  // a return without its entry (attached mid-call)
#define CNT_STACK_ERROR 3    // user stack could not be captured (collision, no frames)
#define CNT_SLOTS 8

#define MAX_NEST 4  // nested probed calls per thread (cudaMalloc -> cuMemAlloc_v2 -> ...)

struct ingero_event {
    u64 ts;         // bpf_ktime_get_ns(): entry of an API call; emission time of host events
    u64 duration;   // ns
    u64 arg0;
    u64 arg1;
    u64 cgroup_id;
    u32 pid;        // tgid
    u32 tid;
    s32 ret;        // return code (API calls), error (block I/O), TCP state
    s32 stack_id;   // id in `stacks`, < 0: none
    u8 source;
    u8 op;
    u16 cpu;
    u32 flags;
};

struct entry_frame {
    u64 ts;
    u64 arg0;
    u64 arg1;
    u32 source_op;  // source << 8 | op
    u32 _pad;
};

#define SITE_SLOTS 4  // per-thread call-site cache of stack ids (direct-mapped)

// Per-thread stack of in-flight probed calls. `allowed` caches the target check made on the thread's
// first probed call (0 = not decided yet, 1 = traced, 2 = not a target), so the steady state costs
// one map lookup per entry and one per return.
struct entry_stack {
    u32 depth;
    u32 allowed;
    struct entry_frame f[MAX_NEST];
    u64 site_ip[SITE_SLOTS];  // return address of a recent call site
    u64 site_fp[SITE_SLOTS];  // and the caller's frame pointer at that return
    s32 site_id[SITE_SLOTS];  // the stack id walked for it
};

BPF_RINGBUF_OUTPUT(events, INGERO_RING_PAGES);
BPF_TABLE("lru_hash", u32, struct entry_stack, entries, 65536);  // tid -> its entry stack
BPF_HASH(targets, u32, u8, 65536);  // tgids whose host events are recorded
BPF_PERCPU_ARRAY(counters, u64, CNT_SLOTS);
BPF_ARRAY(control, u32, 1);  // [0] = 1: stopping, emit nothing (set before the last drain)

#if INGERO_STACK_MODE > 0
struct stack_ips {
    u64 ip[32];
};
BPF_TABLE("stacktrace", int, struct stack_ips, stacks, 16384);
#endif

// The calling thread's entry stack (created zeroed on its first probed call when `create`).
// Measured here: task-local storage instead of this LRU hash made no measurable difference.
static __always_inline struct entry_stack *thread_entries(u32 tid, int create) {
    struct entry_stack *s = entries.lookup(&tid);
    if (s || !create)
        return s;
    struct entry_stack z = {};
    entries.update(&tid, &z);
    return entries.lookup(&tid);
}

// Array lookups are inlined by the verifier: this costs a few nanoseconds per probe hit. Closing the
// probes' perf events takes the kernel ~0.1 s each (an RCU grace period per uprobe), so shutdown
// flips this flag first, drains and closes the database, and detaches afterwards.
static __always_inline int stopping(void) {
    u32 k = 0;
    u32 *v = control.lookup(&k);
    return v && *v;
}

static __always_inline void count(u32 slot) {
    u64 *c = counters.lookup(&slot);
    if (c)
        (*c)++;
}

static __always_inline struct ingero_event *reserve_event(void) {
    struct ingero_event *e = events.ringbuf_reserve(sizeof(struct ingero_event));
    if (!e)
        count(CNT_RING_FULL);
    return e;
}

static __always_inline void submit_event(struct ingero_event *e) {
    events.ringbuf_submit(e, BPF_RB_NO_WAKEUP);
}

// Host-event helper: one record with the common fields filled.
static __always_inline void emit_host(u8 source, u8 op, u64 ts, u64 duration, u32 pid, u32 tid, u64 arg0,
                                      u64 arg1, s32 ret) {
    if (stopping())
        return;
    struct ingero_event *e = reserve_event();
    if (!e)
        return;
    e->ts = ts;
    e->duration = duration;
    e->arg0 = arg0;
    e->arg1 = arg1;
    e->cgroup_id = bpf_get_current_cgroup_id();
    e->pid = pid;
    e->tid = tid;
    e->ret = ret;
    e->stack_id = -1;
    e->source = source;
    e->op = op;
    e->cpu = bpf_get_smp_processor_id();
    e->flags = 0;
    submit_event(e);
}

// Stack id of the caller, at a uretprobe (the user registers are the caller's after the return).
// Walking a user stack costs ~0.5-1 us, as much as the uprobe itself, so mode 1 walks once per call
// site per thread: the return address plus the caller's frame pointer identify the call path (same
// code, same stack depth) and a 4-slot cache in the thread's entry_stack — already in hand, no
// extra map lookup — keeps its stack id. A tight loop pays for one walk.
static __always_inline int capture_stack(struct pt_regs *ctx, struct entry_stack *s) {
#if INGERO_STACK_MODE == 0
    return -1;
#elif INGERO_STACK_MODE == 2
    int id = stacks.get_stackid(ctx, BPF_F_USER_STACK);
    if (id < 0)
        count(CNT_STACK_ERROR);
    return id;
#else
    u64 ip = PT_REGS_IP(ctx);
    u64 fp = PT_REGS_FP(ctx);
    u32 slot = (u32)((ip ^ (fp >> 4)) & (SITE_SLOTS - 1));
    if (s->site_ip[slot] == ip && s->site_fp[slot] == fp)
        return s->site_id[slot];
    int id = stacks.get_stackid(ctx, BPF_F_USER_STACK);
    if (id < 0) {
        count(CNT_STACK_ERROR);
        return id;
    }
    s->site_ip[slot] = ip;
    s->site_fp[slot] = fp;
    s->site_id[slot] = id;
    return id;
#endif
}
