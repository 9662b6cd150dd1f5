/* Shared by every layer: target filtering and drop accounting.
 *
 * TARGET_MODE, TARGET_CGROUP_ID, TARGET_CGROUP_LEVEL and SELF_TGID are defined by the loader
 * (recorder/core/loader.py) for the session, so the filter costs no map lookup in pid-less modes.
 * Event layouts and constants come from recorder/core/events.py, prepended before this file.
 */
#include <uapi/linux/ptrace.h>

/* bpf_probe_read_user(_str) under names BCC's front end does not look at. At every call of the
 * helpers by their own names it searches the kernel's symbol table for bpf_probe_read_user (to fall
 * back to bpf_probe_read on kernels without it, which the ring buffers rule out here): ~0.06 CPU-s
 * a call, ~1.7 CPU-s of every start. The declarations are BCC's own (helpers.h), `int` return
 * included: declared `long`, LLVM dropped the sign extension the verifier's bounds of a string
 * read's length go through, and the verifier rejected task_openat (the dlopen hold), so launches
 * made right after a dlopen went unrecorded. tests/test_startup_bpf.py checks that every program
 * compiles to the same instructions as under the helpers' own names. */
static int (*recorder_read_user)(void *dst, __u32 size, const void *unsafe_ptr) =
    (void *)BPF_FUNC_probe_read_user;
static int (*recorder_read_user_str)(void *dst, __u32 size, const void *unsafe_ptr) =
    (void *)BPF_FUNC_probe_read_user_str;
#define bpf_probe_read_user recorder_read_user
#define bpf_probe_read_user_str recorder_read_user_str

/* The session's maps a later BPF object of the same session uses (the on-CPU profile's, compiled
 * after the start: recorder/core/secondary.py): shared here, where they are made, and "extern" in
 * that object's compile (BPF_SECONDARY defined), which then refers to these very maps. */
#ifdef BPF_SECONDARY
#define SESSION_TABLE(_type, _key, _leaf, _name, _size) BPF_TABLE("extern", _key, _leaf, _name, _size)
#else
#define SESSION_TABLE(_type, _key, _leaf, _name, _size) BPF_TABLE_SHARED(_type, _key, _leaf, _name, _size)
#endif

/* tgids being recorded (MODE_PIDS); forks of a traced process are added by task.bpf.c */
SESSION_TABLE("hash", u32, u8, targets, 16384);
/* events lost per probe (index PROBE_*), read by user space every second into the loss table */
SESSION_TABLE("percpu_array", int, u64, drops, PROBE_COUNT);

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
SESSION_TABLE("lru_hash", u32, struct syscall_t, in_syscall, 65536);

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
/* Where the wake-up fires. Its irq_work is taken as soon as interrupts are on: from a program that
 * runs with them on (a uprobe, a syscall tracepoint) that is at once, inside the program, and the
 * reader's wake-up then runs sched_waking nested in a BPF program, which the kernel skips (a waker
 * lost, counted). With the scheduler layer loaded (RING_WAKE_AT_SWITCH) such programs leave the
 * wake-up owed on their CPU (slot RING_OWED) and the next sched_switch there, which runs with
 * interrupts off, sends it (ring_wake_owed): its irq_work runs after the switch, in no program.
 * It sends one at most every RING_WAKE_GAP_NS per CPU (an irq_work is a self-interrupt, costly in
 * a virtual machine; the reader reads every ring when woken, and at least every 50 ms anyway). A
 * CPU that does not send it before a quiet count doubles wakes the reader itself, so a high-rate
 * ring cannot fill for want of a switch. */
#define RING_WAKE_GAP_NS 20000000ull
#define RING_OWED RING_COUNT
#define RING_WOKEN (RING_COUNT + 1) /* when this CPU's sched_switch last sent an owed wake-up */
SESSION_TABLE("percpu_array", int, u64, ring_quiet, RING_COUNT + 2);

static __always_inline u64 ring_wakeup_flags_at(u32 ring, u64 quiet_max, int irqs_off)
{
    u64 *quiet = ring_quiet.lookup(&ring);
    if (!quiet)
        return 0;
    u64 n = ++*quiet;
    if (n < quiet_max)
        return BPF_RB_NO_WAKEUP;
#ifdef RING_WAKE_AT_SWITCH
    if (!irqs_off && n < 2 * quiet_max) {
        u32 owed_key = RING_OWED;
        u64 *owed = ring_quiet.lookup(&owed_key);
        if (owed) {
            *owed = 1;
            return BPF_RB_NO_WAKEUP;
        }
    }
#endif
    *quiet = 0;
    return BPF_RB_FORCE_WAKEUP;
}
/* from a program that runs with interrupts on (every caller but sched_switch) */
#define ring_wakeup_flags(ring, quiet_max) ring_wakeup_flags_at(ring, quiet_max, 0)

/* The flags of a record of a low-rate ring (processes, checkpoints, memory, TCP, DMA, markers,
 * block): `flags` as the ring would wake its reader (0: when the reader has caught up), turned into
 * a wake-up owed to the next sched_switch on this CPU where the scheduler layer sends those. */
static __always_inline u64 ring_wake_deferred_as(u64 flags, u64 urgency)
{
#ifdef RING_WAKE_AT_SWITCH
    if (flags & BPF_RB_NO_WAKEUP)
        return flags;
    u32 owed_key = RING_OWED;
    u64 *owed = ring_quiet.lookup(&owed_key);
    if (owed) {
        if (*owed < urgency)
            *owed = urgency;
        return BPF_RB_NO_WAKEUP;
    }
#endif
    return flags;
}
#define ring_wake_deferred(flags) ring_wake_deferred_as(flags, 1)
/* a record user space must act on at once (a process stopped until it has): the next switch on
 * the CPU wakes the reader, however soon after the last wake-up */
#define ring_wake_urgent() ring_wake_deferred_as(0, 2)
/* the stack walker (bpf/pystack.h) submits with these flags (a later object's walker has a ring of
 * its own, read at the session's polls without a wake-up) */
#ifdef BPF_SECONDARY
#define PYSTACK_RB_FLAGS BPF_RB_NO_WAKEUP
#else
#define PYSTACK_RB_FLAGS ring_wakeup_flags(RING_PYSTACK, RING_QUIET(PYSTACK_RINGBUF_PAGES, sizeof(struct pystack_event)))
#endif

/* 1 once the session stopped: its probes stay attached for seconds while they are detached in the
 * background (recorder/core/loader.py, detach_all), and must cost the host nothing meanwhile (a
 * program still walking stacks then makes the next session's nested programs skip). */
BPF_ARRAY(session_stopped, u32, 1);

static __always_inline int is_target(u32 tgid)
{
    if (tgid == SELF_TGID || tgid == 0)
        return 0;
    int stopped_key = 0;
    u32 *stopped = session_stopped.lookup(&stopped_key);
    if (stopped && *stopped)
        return 0;
#if TARGET_MODE == MODE_ALL
    return 1;
#elif TARGET_MODE == MODE_CGROUP
    return bpf_get_current_ancestor_cgroup_id(TARGET_CGROUP_LEVEL) == TARGET_CGROUP_ID;
#else
    return targets.lookup(&tgid) != 0;
#endif
}
