/* Shared by every layer: target filtering and drop accounting.
 *
 * TARGET_MODE, TARGET_CGROUP_ID, TARGET_CGROUP_LEVEL and SELF_TGID are defined by the loader
 * (recorder/core/loader.py) for the session, so the filter costs no map lookup in pid-less modes.
 * Event layouts and constants come from recorder/core/events.py, prepended before this file.
 */
#include <uapi/linux/ptrace.h>

/* tgids being recorded (MODE_PIDS); forks of a traced process are added by task.bpf.c */
BPF_HASH(targets, u32, u8, 16384);
/* events lost per probe (index PROBE_*), read by user space every second into the loss table */
BPF_PERCPU_ARRAY(drops, u64, PROBE_COUNT);

/* the syscall each traced thread is in, filled by raw_syscalls in sched.bpf.c: off-CPU intervals
 * name it, and its entry time tells the stack captures of one syscall apart (bpf/pystack.h). A
 * thread's entry stays between its syscalls with ts 0 and is rewritten in place at the next entry:
 * an insert (and a delete at every exit) took the map's locks twice per syscall. */
struct syscall_t {
    u64 ts;        /* entry; 0: not in a syscall */
    u64 stack_key; /* Python stack promised to this syscall's off-CPU intervals, read at its exit */
    s32 nr;
    u32 blocked; /* one of its off-CPU intervals opened in this syscall (bpf/sched.bpf.c) */
};
BPF_TABLE("lru_hash", u32, struct syscall_t, in_syscall, 65536);

/* entry time of the current thread's syscall, 0 outside one (or without the sched layer) */
static __always_inline u64 syscall_epoch(u32 tid)
{
    struct syscall_t *sc = in_syscall.lookup(&tid);
    return sc ? sc->ts : 0;
}

static __always_inline void count_drop(u32 probe)
{
    u64 *v = drops.lookup(&probe);
    if (v)
        (*v)++;
}

/* Ring wake-ups. A record submitted while the consumer waits wakes it by default (an irq_work,
 * then the recorder's thread made runnable on some CPU). At a training job's thousands of context
 * switches a second that made the recorder a contender of the very threads it traced, and every
 * preemption it caused was one more record. The high-rate rings (off-CPU intervals, CUDA and NCCL
 * calls, Python stacks) therefore wake the consumer only once this CPU has sent RING_QUIET records
 * without a wakeup; the rest is read at the session's next poll, which reads every ring to the end
 * at least every 50 ms (Probes.poll). RING_QUIET keeps the records sent quietly on all CPUs together
 * under a quarter of the ring, so the ring cannot fill between two reads for want of a wakeup. */
#ifndef RING_CPUS
#define RING_CPUS 64 /* the loader defines the machine's possible CPUs */
#endif
#define RING_QUIET(pages, record_bytes) \
    ((pages) * 4096ull / (4ull * RING_CPUS * ((record_bytes) + 8)) ?: 1ull)
#define RING_SCHED 0
#define RING_CUDA 1
#define RING_NCCL 2
#define RING_PYSTACK 3
#define RING_COUNT 4
BPF_PERCPU_ARRAY(ring_quiet, u64, RING_COUNT);

static __always_inline u64 ring_wakeup_flags(u32 ring, u64 quiet_max)
{
    u64 *quiet = ring_quiet.lookup(&ring);
    if (!quiet)
        return 0;
    if (++*quiet < quiet_max)
        return BPF_RB_NO_WAKEUP;
    *quiet = 0;
    return BPF_RB_FORCE_WAKEUP;
}
/* the stack walker (bpf/pystack.h) submits with these flags */
#define PYSTACK_RB_FLAGS ring_wakeup_flags(RING_PYSTACK, RING_QUIET(PYSTACK_RINGBUF_PAGES, sizeof(struct pystack_event)))

static __always_inline int is_target(u32 tgid)
{
    if (tgid == SELF_TGID || tgid == 0)
        return 0;
#if TARGET_MODE == MODE_ALL
    return 1;
#elif TARGET_MODE == MODE_CGROUP
    return bpf_get_current_ancestor_cgroup_id(TARGET_CGROUP_LEVEL) == TARGET_CGROUP_ID;
#else
    return targets.lookup(&tgid) != 0;
#endif
}
