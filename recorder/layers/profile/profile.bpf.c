/* profile.bpf.c: the on-CPU profile. A software CPU-clock perf event on every CPU (opened by
 * recorder/layers/profile/__init__.py at the rate of --profile-hz) runs profile_sample() in the
 * interrupt that ends each period. A sample of a thread that is no target's (most of them on a
 * busy host, and every idle CPU's) ends at the first check; a target's records when, where and on
 * which CPU it ran: its native user stack (the kernel's walk: the user registers are the
 * interrupted ones, or the thread's saved ones when it was in the kernel) and, through the
 * walker's perf event copy (bpf/pystack.h, PYSTACK_CAPTURE_PE), its Python stack, joined by
 * (ts, pid, tid). CPU time only: a thread off the CPU is never interrupted, so it is never sampled.
 *
 * Compiled after the session's start, as a BPF object of its own (recorder/core/secondary.py,
 * BPF_SECONDARY): the targets, the drop counters and the walker's recipes are the session's maps
 * ("extern"), its rings, stack map, walker scratch and program array its own.
 *
 * Nothing here reads a kernel struct: the interrupted instruction pointer comes from the perf
 * event's own context, the rest from helpers. */
#include <uapi/linux/bpf_perf_event.h>

#define PROFILE_RING_PAGES 64
BPF_RINGBUF_OUTPUT(profile_events, PROFILE_RING_PAGES);
/* stack id -> user frames: user space reads the ids a flush's samples name and deletes them */
BPF_STACK_TRACE(profile_stacks, PROFILE_STACK_ENTRIES);

int profile_sample(struct bpf_perf_event_data *ctx)
{
    u64 id = bpf_get_current_pid_tgid();
    if (!is_target(id >> 32))
        return 0;
    u64 ts = bpf_ktime_get_ns();
    /* no wake-up: the session reads every ring at least every 50 ms, and a sample is never urgent */
    struct profile_event *e = profile_events.ringbuf_reserve(sizeof(*e));
    if (!e) {
        count_drop(PROBE_PROFILE);
        return 0;
    }
    e->ts = ts;
    e->pid = id >> 32;
    e->tid = (u32)id;
    e->cpu = bpf_get_smp_processor_id();
    e->user_stack = profile_stacks.get_stackid(ctx, BPF_F_USER_STACK);
    /* the kernel's addresses are the upper half of the address space (x86-64, arm64) */
    e->flags = PT_REGS_IP(&ctx->regs) >= 0x8000000000000000ull ? PROFILE_FLAG_KERNEL : 0;
    bpf_get_current_comm(e->comm, sizeof(e->comm));
    profile_events.ringbuf_submit(e, BPF_RB_NO_WAKEUP);
    PYSTACK_CAPTURE_PE(ctx, ts);
}

/* The walker's perf event copy (bpf/pystack.h), compiled with this layer only: PyStackProbe
 * .install_perf_events wires it into pystack_pe_progs */
int pystack_pe_find(void *ctx) { return pystack_find_body(ctx, 2); }
int pystack_pe_scan(void *ctx) { return pystack_scan_body(ctx, 2); }
int pystack_pe_walk(void *ctx) { return pystack_walk_body(ctx, 2); }
