/* task: follow the targets' children and tell user space when to rescan mapped libraries.
 *
 * A fork of a traced process adds the child to `targets` in the kernel, before the child runs, so
 * nothing it does is missed; a forked Python also gets its parent's stack-walking recipe there.
 * exec, exit and every return from dlopen() are sent to user space, which reads /proc for names
 * and rescans /proc/PID/maps for CUDA and NCCL libraries. A rename (prctl(PR_SET_NAME),
 * pthread_setname_np, a write to /proc/.../comm from the same process) is sent with the new name, so
 * a thread pool's workers and a data loader's processes are named as they name themselves.
 */
BPF_RINGBUF_OUTPUT(task_events, 256);

static __always_inline struct task_event *task_reserve(u32 kind, u32 tgid, u32 tid, u32 child)
{
    struct task_event *e = task_events.ringbuf_reserve(sizeof(struct task_event));
    if (!e) {
        count_drop(PROBE_TASK);
        return 0;
    }
    e->ts = bpf_ktime_get_ns();
    e->kind = kind;
    e->pid = tgid;
    e->tid = tid;
    e->child_tid = child;
    return e;
}

static __always_inline void task_send(u32 kind, u32 tgid, u32 tid, u32 child)
{
    struct task_event *e = task_reserve(kind, tgid, tid, child);
    if (!e)
        return;
    bpf_get_current_comm(e->comm, sizeof(e->comm));
    task_events.ringbuf_submit(e, ring_wake_deferred(0));
}

TRACEPOINT_PROBE(sched, sched_process_fork)
{
    u64 id = bpf_get_current_pid_tgid();
    u32 tgid = id >> 32;
    if (!is_target(tgid))
        return 0;
    u32 child = args->child_pid;
#if TARGET_MODE == MODE_PIDS
    /* a new thread's tid is harmless in the map; a new process's tid is its tgid */
    u8 one = 1;
    targets.update(&child, &one);
#endif
    task_send(TASK_FORK, tgid, (u32)id, child);
    return 0;
}

#if defined(PYSTACK_H) && defined(HAVE_TP_task_task_newtask)
/* A new process of a traced Python (a fork, not a thread: no CLONE_THREAD) runs the parent's image
 * in a copy of its memory, so the parent's walking recipe is valid for it as is: copied here, in
 * the parent's context before the child first runs, its first calls have their Python stack
 * instead of "not configured" until user space has read the fork (a DataLoader worker starts
 * reading at once). An exec drops the copy like any recipe (below). */
TRACEPOINT_PROBE(task, task_newtask)
{
    u32 tgid = bpf_get_current_pid_tgid() >> 32;
    if ((args->clone_flags & 0x00010000 /* CLONE_THREAD */) || !is_target(tgid))
        return 0;
    struct pystack_proc *cfg = pystack_procs.lookup(&tgid);
    if (!cfg)
        return 0;
    struct pystack_proc copy = *cfg;
    u32 child = args->pid;
    pystack_procs.update(&child, &copy);
    return 0;
}
#endif

TRACEPOINT_PROBE(sched, sched_process_exec)
{
    u64 id = bpf_get_current_pid_tgid();
    if (!is_target(id >> 32))
        return 0;
#ifdef PYSTACK_H
    /* the old image's CPython recipe must not walk the new one: "not configured" until user space
     * has looked at the new image (recorder/core/stacks.py) */
    u32 tgid = id >> 32;
    pystack_procs.delete(&tgid);
#endif
    task_send(TASK_EXEC, id >> 32, (u32)id, 0);
    return 0;
}

TRACEPOINT_PROBE(sched, sched_process_exit)
{
    u64 id = bpf_get_current_pid_tgid();
    if (!is_target(id >> 32))
        return 0;
    task_send(TASK_EXIT, id >> 32, (u32)id, 0);
    return 0;
}

/* Threads of targets that opened a library the recorder attaches to (a CUDA runtime or driver,
 * NCCL, the marker extension) since their last return from dlopen: set at the open, taken at the
 * return. A library's first calls come right after its dlopen returns, before user space could
 * read the event and attach its uprobes (0 of 500 calls were recorded); so that dlopen return
 * stops the process (SIGSTOP) and sends the event marked held (child_tid = 1): user space attaches
 * and lets it go on (SIGCONT, recorder/layers/task.py). STALL_RECORDER_DLOPEN_HOLD=0 turns it off. */
BPF_HASH(dlopen_traced, u32, u8, 4096);
/* When user space last said it reads the task events (CLOCK_MONOTONIC ns, bpf_ktime_get_ns's
 * clock; 0: it stopped reading). A dlopen is held only while that is recent: a stop nobody would
 * end (a recorder stopping, its probes still attached while they are detached, or one killed)
 * must never be sent. recorder/layers/task.py writes it at every flush and 0 at the stop. */
BPF_ARRAY(task_reader_alive, u64, 1);
#define TASK_READER_ALIVE_NS 3000000000ULL

#if DLOPEN_HOLD
static __always_inline int name_at(const char *name, u32 at, const char *prefix, u32 len)
{
#pragma unroll
    for (u32 j = 0; j < 12; j++) {
        if (j >= len)
            break;
        if (name[(at + j) & 255] != prefix[j])
            return 0;
    }
    return 1;
}

/* An openat by a target, from task_openat: a program on syscalls:sys_enter_openat generated and
 * attached by recorder/layers/task.py next to the checkpoint layer's (BCC defines one
 * TRACEPOINT_PROBE per tracepoint), which reads the file name pointer at the offset the
 * tracepoint's format gives. */
struct task_name {
    char b[512]; /* 256 read; twice as large so that any index the compiler forms stays inside */
};
BPF_PERCPU_ARRAY(task_name_buf, struct task_name, 1);

static __always_inline int task_open(u64 id, const char *filename)
{
    int zero = 0;
    struct task_name *buf = task_name_buf.lookup(&zero);
    if (!buf)
        return 0;
    char *name = buf->b;
    int n = bpf_probe_read_user_str(name, 256, filename);
    if (n <= 1)
        return 0;
    /* the file name after the last '/', searched from the end (a forward search keeping the last
     * '/' seen is too many states for the verifier); the names looked for are short */
    u32 last = (u32)n - 1, base = 0;
    int found = 0;
#pragma unroll
    for (u32 k = 1; k <= 40; k++) {
        if (k > last) {
            found = 1; /* no '/': the whole string is the file name */
            break;
        }
        if (name[(last - k) & 255] == '/') {
            base = last - k + 1;
            found = 1;
            break;
        }
    }
    if (!found || base > 256 - 12)
        return 0;
    if (name_at(name, base, "libcudart", 9) || name_at(name, base, "libcuda.so", 10) ||
        name_at(name, base, "libcuda-", 8) || name_at(name, base, "libnccl", 7) ||
        name_at(name, base, "_markers", 8)) {
        u32 tid = (u32)id;
        u8 one = 1;
        dlopen_traced.update(&tid, &one);
    }
    return 0;
}
#endif

/* uretprobe on dlopen/dlmopen in libc: a library may have been mapped */
int task_dlopen_return(struct pt_regs *ctx)
{
    u64 id = bpf_get_current_pid_tgid();
    if (!is_target(id >> 32))
        return 0;
    u32 tid = (u32)id;
    u32 hold = dlopen_traced.lookup(&tid) != 0;
    if (hold) {
        dlopen_traced.delete(&tid);
        int zero = 0;
        u64 *alive = task_reader_alive.lookup(&zero);
        if (!alive || *alive == 0 || bpf_ktime_get_ns() - *alive > TASK_READER_ALIVE_NS)
            hold = 0; /* nobody reads: the event goes out, the process runs on */
    }
    if (PT_REGS_RC(ctx) == 0)
        return 0;
    struct task_event *e = task_reserve(TASK_DLOPEN, id >> 32, tid, hold);
    if (!e)
        return 0; /* counted; and no stop that nobody would end */
    bpf_get_current_comm(e->comm, sizeof(e->comm));
    /* a held process waits for user space: its stop is the switch that wakes the reader */
    task_events.ringbuf_submit(e, hold ? ring_wake_urgent() : ring_wake_deferred(0));
    if (hold)
        bpf_send_signal(19 /* SIGSTOP: the whole process, until user space has attached */);
    return 0;
}

#ifdef HAVE_TP_task_task_rename
/* a task of a target renamed (the renamed task is args->pid: the current task, or a thread of the
 * same process writing its /proc comm) */
TRACEPOINT_PROBE(task, task_rename)
{
    u64 id = bpf_get_current_pid_tgid();
    if (!is_target(id >> 32))
        return 0;
    u64 was[2], now[2]; /* the 16-byte names as two words each */
    bpf_probe_read_kernel(was, sizeof(was), args->oldcomm);
    bpf_probe_read_kernel(now, sizeof(now), args->newcomm);
    if (was[0] == now[0] && was[1] == now[1]) /* an exec of a program of the same name */
        return 0;
    struct task_event *e = task_reserve(TASK_RENAME, id >> 32, (u32)args->pid, 0);
    if (!e)
        return 0;
    __builtin_memcpy(e->comm, now, sizeof(now));
    task_events.ringbuf_submit(e, ring_wake_deferred(0));
    return 0;
}
#endif
