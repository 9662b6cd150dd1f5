/* sched: off-CPU intervals of every thread of the targets.
 *
 * sched_switch opens an interval when a traced thread leaves the CPU (remembering its state, the
 * task that took the CPU and the syscall it was in) and closes it when the thread comes back,
 * sending one offcpu_event with the interval's start and duration. sched_waking remembers who woke
 * a sleeping traced thread and when, so user space can split the interval into the time it was
 * blocked and the time it then waited for a CPU. Each CPU keeps its last CPU_SLICES run slices (who
 * ran, from when to when) so that, when a traced thread comes back, the task that ran longest on
 * that CPU while it was runnable is named as the contender: the preemptor, or the task it waited
 * behind after waking up. raw_syscalls keep the syscall in progress per traced thread, so user
 * space can tell a futex wait from a read.
 *
 * When a traced thread switches out blocked (sleeping, D state: not preempted) the switch ends by
 * capturing its Python stack (bpf/pystack.h; it is `current` here, so its user memory is readable):
 * the line it waits at. Preemptions are not captured: under CPU contention they can be far more
 * frequent, and the line a thread was preempted at is where it ran, not what it waited for. Blocking
 * again inside the same syscall reuses that syscall's capture. sched_settings[0] = 0 turns it off.
 */
#define TASK_DEAD_STATES 0x30 /* X (dead) and Z (zombie): the thread never comes back */

struct offcpu_open_t {
    u64 ts;
    u64 cgroup_id;
    s64 state;
    u32 pid;
    u32 cpu;
    u32 next_tid;
    s32 syscall;
    u64 stack_ts; /* key of its Python stack record, 0 when none was captured */
    u64 futex_addr; /* futex word when it blocked in futex(), 0 otherwise */
    char comm[16];
    char next_comm[16];
};

struct waker_t {
    u64 ts;
    u32 tid;
    u32 cpu;
    char comm[16];
};

#define CPU_SLICES 16
struct run_slice_t {
    u64 start;
    u64 end;
    u32 tid;
    u32 pad;
    char comm[16];
};
struct cpu_runs_t {
    u64 since; /* when the current task got this CPU */
    u32 head;
    u32 pad;
    struct run_slice_t slices[CPU_SLICES];
};

BPF_PERCPU_ARRAY(cpu_runs, struct cpu_runs_t, 1);
BPF_TABLE("lru_hash", u32, struct offcpu_open_t, offcpu_open, 65536);
BPF_TABLE("lru_hash", u32, struct waker_t, offcpu_waker, 65536);
#define OFFCPU_RING_PAGES 2048
BPF_RINGBUF_OUTPUT(offcpu_events, OFFCPU_RING_PAGES);
/* futex(): the futex word (args[0]) of a traced thread's futex() in progress, so that user space
 * can tell a wait on the interpreter lock from any other futex wait by its address. Read only when
 * the thread blocks inside futex() (in_syscall says so), so a stale entry is never used. */
#define NR_FUTEX 202
BPF_TABLE("lru_hash", u32, u64, futex_uaddr, 65536);
/* [0]: capture the Python stack when a traced thread blocks (1, set by recorder/layers/sched.py) */
BPF_ARRAY(sched_settings, u32, 1);

/* prev_state as sched_switch reports it: 0 running (yield), 256 (TASK_REPORT_MAX) preempted */
#define SWITCH_BLOCKED(state) ((state) & 0xff)

TRACEPOINT_PROBE(sched, sched_switch)
{
    u64 now = bpf_ktime_get_ns();
    u32 prev = args->prev_pid;
    u32 next = args->next_pid;
    u32 zero = 0;
    struct cpu_runs_t *runs = cpu_runs.lookup(&zero);
    if (runs) {
        /* close prev's run slice on this CPU */
        u32 h = runs->head % CPU_SLICES;
        runs->slices[h].start = runs->since;
        runs->slices[h].end = now;
        runs->slices[h].tid = prev;
        __builtin_memcpy(runs->slices[h].comm, args->prev_comm, 16);
        runs->head = h + 1;
        runs->since = now;
    }

    struct offcpu_open_t *open = offcpu_open.lookup(&next);
    if (open) {
        struct offcpu_event *e = offcpu_events.ringbuf_reserve(sizeof(struct offcpu_event));
        if (e) {
            e->ts = open->ts;
            e->dur = now - open->ts;
            e->cgroup_id = open->cgroup_id;
            e->state = open->state;
            e->pid = open->pid;
            e->tid = next;
            e->cpu = open->cpu;
            e->next_tid = open->next_tid;
            e->syscall = open->syscall;
            e->flags = 0;
            e->stack_ts = open->stack_ts;
            e->futex_addr = open->futex_addr;
            e->in_cpu = bpf_get_smp_processor_id();
            e->contender_tid = 0;
            e->contender_run = 0;
            __builtin_memset(e->contender_comm, 0, 16);
            __builtin_memcpy(e->comm, open->comm, 16);
            __builtin_memcpy(e->next_comm, open->next_comm, 16);
            struct waker_t *w = offcpu_waker.lookup(&next);
            if (w) {
                e->wakeup_ts = w->ts;
                e->waker_tid = w->tid;
                e->waker_cpu = w->cpu;
                __builtin_memcpy(e->waker_comm, w->comm, 16);
            } else {
                e->wakeup_ts = 0;
                e->waker_tid = 0;
                e->waker_cpu = 0;
                __builtin_memset(e->waker_comm, 0, 16);
            }
            /* runnable from the wakeup (or the switch-out, when preempted) until now */
            u64 from = e->wakeup_ts ? e->wakeup_ts : e->ts;
            if (runs) {
                u32 best = CPU_SLICES;
                u64 best_run = 0;
#pragma unroll
                for (u32 i = 0; i < CPU_SLICES; i++) {
                    struct run_slice_t *sl = &runs->slices[i];
                    u64 a = sl->start > from ? sl->start : from;
                    if (sl->tid != 0 && sl->tid != next && sl->end > a && sl->end - a > best_run) {
                        best_run = sl->end - a;
                        best = i;
                    }
                }
                if (best < CPU_SLICES) {
                    e->contender_tid = runs->slices[best].tid;
                    e->contender_run = best_run;
                    __builtin_memcpy(e->contender_comm, runs->slices[best].comm, 16);
                }
            }
            offcpu_events.ringbuf_submit(e, ring_wakeup_flags(RING_SCHED, RING_QUIET(OFFCPU_RING_PAGES, sizeof(*e))));
        } else {
            count_drop(PROBE_SCHED);
        }
        offcpu_open.delete(&next);
        offcpu_waker.delete(&next);
    }

    if (prev == 0 || (args->prev_state & TASK_DEAD_STATES))
        return 0;
    u32 tgid = bpf_get_current_pid_tgid() >> 32;
    if (!is_target(tgid))
        return 0;
    struct offcpu_open_t st = {};
    st.ts = now;
    st.cgroup_id = bpf_get_current_cgroup_id();
    st.state = args->prev_state;
    st.pid = tgid;
    st.cpu = bpf_get_smp_processor_id();
    st.next_tid = next;
    struct syscall_t *sc = in_syscall.lookup(&prev);
    st.syscall = sc ? sc->nr : -1;
    if (sc && sc->nr == NR_FUTEX) {
        u64 *uaddr = futex_uaddr.lookup(&prev);
        st.futex_addr = uaddr ? *uaddr : 0;
    }
    __builtin_memcpy(st.comm, args->prev_comm, 16);
    __builtin_memcpy(st.next_comm, args->next_comm, 16);
    int fresh = 0;
    u32 *stacks_on = sched_settings.lookup(&zero);
    if (stacks_on && *stacks_on && SWITCH_BLOCKED(st.state))
        st.stack_ts = pystack_key(sc ? sc->ts : 0, now, &fresh);
    if (offcpu_open.update(&prev, &st))
        count_drop(PROBE_SCHED_MAP);
    if (fresh) /* even without the interval: later events of this syscall share the capture */
        PYSTACK_CAPTURE_TP(args, now);
    return 0;
}

TRACEPOINT_PROBE(sched, sched_waking)
{
    u32 wakee = args->pid;
    if (!offcpu_open.lookup(&wakee))
        return 0;
    struct waker_t w = {};
    w.ts = bpf_ktime_get_ns();
    w.tid = (u32)bpf_get_current_pid_tgid();
    w.cpu = bpf_get_smp_processor_id();
    bpf_get_current_comm(w.comm, sizeof(w.comm));
    offcpu_waker.update(&wakee, &w);
    return 0;
}

TRACEPOINT_PROBE(raw_syscalls, sys_enter)
{
    u64 id = bpf_get_current_pid_tgid();
    if (!is_target(id >> 32))
        return 0;
    u32 tid = (u32)id;
    struct syscall_t sc = {.ts = bpf_ktime_get_ns(), .nr = (s32)args->id};
    in_syscall.update(&tid, &sc);
    if (args->id == NR_FUTEX) {
        u64 uaddr = args->args[0];
        futex_uaddr.update(&tid, &uaddr);
    }
    return 0;
}

TRACEPOINT_PROBE(raw_syscalls, sys_exit)
{
    /* every syscall on the machine ends here: a lookup (lock-free) finds nothing for the tasks
     * that are not traced, where a delete would take the map's bucket lock each time */
    u32 tid = (u32)bpf_get_current_pid_tgid();
    if (in_syscall.lookup(&tid))
        in_syscall.delete(&tid);
    return 0;
}
