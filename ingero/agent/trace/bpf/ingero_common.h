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
// Every record is one fixed 64-byte struct ingero_event: the userspace reader (ingero/agent/trace/ringbuf.py)
// maps the ring buffer and decodes records in bulk with numpy, so every record must have this size.
// Records are submitted with BPF_RB_NO_WAKEUP: the reader polls on a timer instead of being woken per
// event (a wakeup costs ~16 µs here).

#include <uapi/linux/ptrace.h>

// Source and op ids are never written here: probes.py passes every one of ingero/store/catalog.py as
// -D flags (catalog_defines): SRC_<source> (SRC_CUDA, SRC_HOST, SRC_NCCL, ...), OP_<op name>
// (OP_cudaMalloc, OP_sched_switch, OP_block_read, ...) and the control-record op ids
// OP_NCCL_COMM_INIT / OP_NCCL_CALL_ENTER (>= 100: never stored as events).

// Kernel-side counters (per-CPU array, read by userspace into session_stats).
#define CNT_RING_FULL 0        // event lost: ring buffer full
#define CNT_NEST_OVERFLOW 1    // probed calls nested deeper than MAX_NEST on one thread (oldest dropped)
#define CNT_ORPHAN_RETURN 2    // a return without its entry (probes attached mid-call)
#define CNT_STACK_ERROR 3      // user stack could not be captured (collision, no frames)
#define CNT_FRAME_DISCARDED 4  // an entry whose return never came (attach race, longjmp, cancelled thread)
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
    u64 sp;  // the stack pointer at the probed function's entry: ties the frame to its return
    u64 ts;
    u64 arg0;
    u64 arg1;
    u32 source_op;  // source << 8 | op
    u32 _pad;
};

#define SITE_SLOTS 4  // per-thread call-site cache of stack ids (direct-mapped)

// Per-thread stack of in-flight probed calls (see "Pairing entries with returns" below). `allowed` caches the target check made on the thread's
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
BPF_HASH(target_uids, u32, u8, 64);  // --user: uids whose processes are enrolled (pid filter mode)
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

// --user (pid filter mode): a process of one of `target_uids` becomes a target on its first probed
// call, so jobs the user starts after the tracer are traced too. One lookup per thread, once.
static __always_inline int uid_targeted(u32 tgid) {
    u32 uid = (u32)bpf_get_current_uid_gid();
    if (!target_uids.lookup(&uid))
        return 0;
    u8 one = 1;
    targets.update(&tgid, &one);
    return 1;
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

// --- Pairing entries with returns -----------------------------------------------------------------
//
// Any entry/return probe pair (uprobe + uretprobe on one function) records its call like this:
//
//     int enter_x(struct pt_regs *ctx) {            // uprobe at the function's first instruction
//         struct entry_stack *s = ...;              // thread_entries(tid, 1), target check done
//         struct entry_frame *f = push_frame(s, ENTRY_SP(ctx));
//         if (f) { f->ts = ...; f->arg0 = ...; }    // fill what the return needs
//     }
//     int on_return_x(struct pt_regs *ctx) {        // uretprobe on the same function
//         struct entry_frame *f = pop_frame(s, RETURN_SP(ctx));
//         if (f) emit(...);                         // f stays valid until the thread's next entry
//     }
//
// Each frame is tied to the stack pointer at entry, so an entry whose return never comes cannot
// pair with somebody else's return: the return probe was not attached yet (the attach race), the
// call left by longjmp or an exception, the thread was cancelled inside it. Such a frame is
// discarded (counted in CNT_FRAME_DISCARDED) as soon as the thread's stack shows it is dead:
//   * at an entry, frames whose SP is at or below the new call's SP belong to calls that are over
//     (a live enclosing call's frame always sits higher: the stack grows down);
//   * at a return, frames below the returning call's SP are abandoned callees; a frame above it
//     means this return has no entry (probes attached mid-call): CNT_ORPHAN_RETURN, nothing popped.
// A thread whose MAX_NEST frames are all above its current SP (stale frames from another stack)
// drops its oldest frame on the next entry (CNT_NEST_OVERFLOW): it is never blind for good.
// Attach the return probe of a function before its entry probe: a return without an entry is
// harmless, an entry without a return used to be the problem.

#if defined(__aarch64__) || defined(__TARGET_ARCH_arm64)
// The return address is in x30: the stack pointer is the same at entry and after the return.
#define ENTRY_SP(ctx) ((u64)PT_REGS_SP(ctx))
#define RETURN_SP(ctx) ((u64)PT_REGS_SP(ctx))
#else
// x86-64: at the first instruction [rsp] is the return address, popped by `ret`: rsp + 8 at return.
#define ENTRY_SP(ctx) ((u64)PT_REGS_SP(ctx))
#define RETURN_SP(ctx) ((u64)PT_REGS_SP(ctx) - 8)
#endif

// The frame in slot `i` (< MAX_NEST). The barrier keeps the mask: the compiler would drop it as
// redundant, and the verifier needs it to bound the access.
static __always_inline struct entry_frame *frame_at(struct entry_stack *s, u32 i) {
    asm volatile("" : "+r"(i));
    return &s->f[i & (MAX_NEST - 1)];
}

// One step of push_frame: drop the newest frame when its call is over (its SP at or below `sp`).
static __always_inline u32 drop_if_dead(struct entry_stack *s, u32 d, u64 sp) {
    if (d == 0 || frame_at(s, d - 1)->sp > sp)
        return d;
    count(CNT_FRAME_DISCARDED);  // that call is over, its return was never seen
    return d - 1;
}

// A new frame for a call entering with stack pointer `sp` (ENTRY_SP): dead frames dropped first.
// (Steps are written out, not looped: MAX_NEST is 4 and the verifier then sees no loop at all.)
static __always_inline struct entry_frame *push_frame(struct entry_stack *s, u64 sp) {
    u32 d = s->depth;
    if (d > MAX_NEST)
        d = MAX_NEST;
    _Static_assert(MAX_NEST == 4, "push_frame and pop_frame take MAX_NEST steps, written out");
    d = drop_if_dead(s, d, sp);
    d = drop_if_dead(s, d, sp);
    d = drop_if_dead(s, d, sp);
    d = drop_if_dead(s, d, sp);
    if (d >= MAX_NEST) {
        // Every frame looks live: a deeper nest than we keep, or frames of a stack the thread left.
        // Drop the oldest so the newest calls are recorded.
        s->f[0] = s->f[1];
        s->f[1] = s->f[2];
        s->f[2] = s->f[3];
        d = MAX_NEST - 1;
        count(CNT_NEST_OVERFLOW);
    }
    struct entry_frame *f = frame_at(s, d);
    f->sp = sp;
    s->depth = d + 1;
    return f;
}

#define PAIR_MATCHED 1
#define PAIR_ENCLOSING 2
// One step of pop_frame: is the newest frame the returning call's? Drops it when it is a callee
// that never returned (below `sp`).
static __always_inline int pair_step(struct entry_stack *s, u32 *d, u64 sp) {
    if (*d == 0)
        return PAIR_ENCLOSING;
    u64 top = frame_at(s, *d - 1)->sp;
    if (top == sp)
        return PAIR_MATCHED;
    if (top > sp)
        return PAIR_ENCLOSING;  // an enclosing call: this return's entry was never seen
    *d -= 1;                    // a callee that never returned (longjmp, exception, attach race)
    count(CNT_FRAME_DISCARDED);
    return 0;
}

// The frame of the call returning with its entry stack pointer `sp` (RETURN_SP), or 0 when none.
// The frame stays valid until the thread's next entry.
static __always_inline struct entry_frame *pop_frame(struct entry_stack *s, u64 sp) {
    u32 d = s->depth;
    if (d > MAX_NEST)
        d = MAX_NEST;
    int r = pair_step(s, &d, sp);
    if (!r)
        r = pair_step(s, &d, sp);
    if (!r)
        r = pair_step(s, &d, sp);
    if (!r)
        r = pair_step(s, &d, sp);
    if (r == PAIR_MATCHED) {
        s->depth = d - 1;
        return frame_at(s, d - 1);
    }
    s->depth = d;
    count(CNT_ORPHAN_RETURN);
    return 0;
}
