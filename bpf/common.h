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
 * name it, and its entry time tells the stack captures of one syscall apart (bpf/pystack.h) */
struct syscall_t {
    u64 ts;  /* entry */
    s32 nr;
    u32 pad;
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
