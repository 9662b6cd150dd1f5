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
    task_events.ringbuf_submit(e, 0);
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

/* uretprobe on dlopen/dlmopen in libc: a library may have been mapped */
int task_dlopen_return(struct pt_regs *ctx)
{
    u64 id = bpf_get_current_pid_tgid();
    if (!is_target(id >> 32) || PT_REGS_RC(ctx) == 0)
        return 0;
    task_send(TASK_DLOPEN, id >> 32, (u32)id, 0);
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
    task_events.ringbuf_submit(e, 0);
    return 0;
}
#endif
