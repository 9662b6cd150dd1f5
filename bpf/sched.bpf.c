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
 * A blocked interval (sleeping, D state: not preempted) gets the thread's Python stack: the line it
 * waits at (bpf/pystack.h). Preemptions get none: under CPU contention they can be far more frequent,
 * the line a thread was preempted at is where it ran, not what it waited for, and a thread can be
 * preempted inside a uprobe's program (uprobe programs run preemptible) in the middle of its walk,
 * whose per-CPU scratch a capture here would overwrite. A training job's
 * threads block tens of thousands of times a second for microseconds (thread-pool barriers, queue
 * hand-offs), and walking the stack at each of those switches was most of the recorder's cost, so:
 * - Blocked inside a syscall, no Python code runs until the syscall returns: the stack is read at
 *   its exit (raw_syscalls:sys_exit, in the thread's own context), and only when one of its off-CPU
 *   intervals lasted sched_settings[1] microseconds or more. The first such interval, at its
 *   switch-in, promises the capture (syscall_t.stack_key: the key of the record to come, its own
 *   start); it and every later interval of the syscall carry that key and OFFCPU_FLAG_PROMISED, so
 *   user space waits for the record (recorder/core/stacks.py). Shorter intervals before it carry
 *   none. An exec (execve, execveat) returns to another program: its promise is not kept.
 * - A thread whose last capture is PYSTACK_EVERY_NS old or more is captured at the switch itself,
 *   so that a thread that never comes back (a hang) still has its line, and so is a thread blocking
 *   uninterruptibly (D: I/O, mostly rare), whose capture the bios a kworker queues for it later
 *   take (bpf/block.bpf.c). An interval in a syscall that already has a capture shares it.
 *   A process user space has not configured yet (the recorder reads a new interpreter's layout
 *   once it has exec'd) would only get "not configured" at the switch: its stack is decided at
 *   the switch-in and read at the syscall's exit, as above, by when it usually is configured.
 * - Blocked outside a syscall (a page fault), the stack is read at the switch: nothing says when
 *   the thread is next in its own context with the same stack.
 * sched_settings[0] = 0 turns the stacks off.
 */
#define TASK_DEAD_STATES 0x30 /* X (dead) and Z (zombie): the thread never comes back */
#define TASK_D_STATE 0x2      /* uninterruptible sleep */

struct waker_t {
    u64 ts;   /* when it was woken; 0: not woken since it left the CPU (preempted, or not yet) */
    u32 tid;
    u32 cpu;
    char comm[16];
};

/* A traced thread's entry: open (ts != 0) from its switch-out until it runs again, then closed in
 * place (ts = 0) and reused at its next switch-out; removed at its last switch (it died). Writing
 * in place takes no bucket lock and no free-list node at a switch (an insert, two deletes and a
 * second map for the waker did, at every blocking switch). sched_waking fills `waker`. */
struct offcpu_open_t {
    u64 ts;       /* switch-out; 0: closed, the thread is on a CPU */
    u64 cgroup_id;
    s64 state;
    u32 pid;
    u32 cpu;
    u32 next_tid;
    s32 syscall;
    u64 stack_ts; /* key of its Python stack record, 0 when none was captured */
    u64 epoch;    /* entry of the syscall it blocked in, when its stack is decided at the switch-in */
    u32 flags;    /* OFFCPU_FLAG_PROMISED: stack_ts is read at the syscall's exit */
    u32 pad;
    u64 futex_addr; /* futex word when it blocked in futex(), 0 otherwise */
    char comm[16];
    char next_comm[16];
    struct waker_t waker;
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
/* a plain hash: a full map is a counted loss (PROBE_SCHED_MAP), never an eviction of a thread
 * that has been off the CPU the longest, which is what an LRU would drop first: a hang */
BPF_HASH(offcpu_open, u32, struct offcpu_open_t, 65536);
#define OFFCPU_RING_PAGES 2048
BPF_RINGBUF_OUTPUT(offcpu_events, OFFCPU_RING_PAGES);
/* futex(): the futex word (args[0]) of a traced thread's futex() in progress, so that user space
 * can tell a wait on the interpreter lock from any other futex wait by its address. Read only when
 * the thread blocks inside futex() (in_syscall says so), so a stale entry is never used. */
#define NR_FUTEX 202
BPF_TABLE("lru_hash", u32, u64, futex_uaddr, 65536);
/* [0]: capture the Python stack when a traced thread blocks (1, set by recorder/layers/sched.py);
 * [1]: microseconds a blocked interval inside a syscall must last to get one (see above) */
BPF_ARRAY(sched_settings, u32, 2);
/* a thread not captured for this long is captured at its next blocking switch */
#define PYSTACK_EVERY_NS 100000000ull

/* prev_state as sched_switch reports it: 0 running (yield), 256 (TASK_REPORT_MAX) preempted */
#define SWITCH_BLOCKED(state) ((state) & 0xff)

/* Send thread `tid`'s open interval, ending at `end` on CPU `in_cpu`, and close its entry.
 * `runs`: this CPU's run slices, to name the contender (at a switch-in); 0 where the interval
 * ends without one (OFFCPU_FLAG_END_*). */
static __always_inline void close_interval(struct offcpu_open_t *open, u32 tid, u64 end, u32 in_cpu,
                                           struct cpu_runs_t *runs, u32 flags)
{
    struct offcpu_event *e = offcpu_events.ringbuf_reserve(sizeof(struct offcpu_event));
    if (!e) {
        count_drop(PROBE_SCHED);
        open->ts = 0;
        return;
    }
    e->ts = open->ts;
    e->dur = end > open->ts ? end - open->ts : 0;
    e->cgroup_id = open->cgroup_id;
    e->state = open->state;
    e->pid = open->pid;
    e->tid = tid;
    e->cpu = open->cpu;
    e->next_tid = open->next_tid;
    e->syscall = open->syscall;
    e->flags = open->flags | flags;
    e->stack_ts = open->stack_ts;
    if (open->epoch) {
        /* blocked in a syscall without a capture: a long enough interval promises one */
        struct syscall_t *sc = in_syscall.lookup(&tid);
        if (sc && sc->ts == open->epoch) {
            u32 one = 1;
            u32 *min_us = sched_settings.lookup(&one);
            if (!sc->stack_key && min_us && e->dur >= (u64)*min_us * 1000)
                sc->stack_key = open->ts;
            if (sc->stack_key) {
                e->stack_ts = sc->stack_key;
                e->flags |= OFFCPU_FLAG_PROMISED;
            }
        }
    }
    e->futex_addr = open->futex_addr;
    e->in_cpu = in_cpu;
    e->contender_tid = 0;
    e->contender_run = 0;
    __builtin_memset(e->contender_comm, 0, 16);
    __builtin_memcpy(e->comm, open->comm, 16);
    __builtin_memcpy(e->next_comm, open->next_comm, 16);
    /* a waker's ts before the switch-out is a wake-up that raced it (the thread never slept) */
    if (open->waker.ts >= open->ts) {
        e->wakeup_ts = open->waker.ts;
        e->waker_tid = open->waker.tid;
        e->waker_cpu = open->waker.cpu;
        __builtin_memcpy(e->waker_comm, open->waker.comm, 16);
    } else {
        e->wakeup_ts = 0;
        e->waker_tid = 0;
        e->waker_cpu = 0;
        __builtin_memset(e->waker_comm, 0, 16);
    }
    open->ts = 0;
    /* runnable from the wakeup (or the switch-out, when preempted) until now */
    u64 from = e->wakeup_ts ? e->wakeup_ts : e->ts;
    if (runs) {
        u32 best = CPU_SLICES;
        u64 best_run = 0;
#pragma unroll
        for (u32 i = 0; i < CPU_SLICES; i++) {
            struct run_slice_t *sl = &runs->slices[i];
            u64 a = sl->start > from ? sl->start : from;
            if (sl->tid != 0 && sl->tid != tid && sl->end > a && sl->end - a > best_run) {
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
    /* sched_switch runs with interrupts off; the end seen at a syscall's exit does not */
    offcpu_events.ringbuf_submit(e, ring_wakeup_flags_at(RING_SCHED, RING_QUIET(OFFCPU_RING_PAGES, sizeof(*e)),
                                                         !(flags & OFFCPU_FLAG_END_SYSCALL)));
}

/* A wake-up of the reader owed by a program that ran with interrupts on (bpf/common.h): sent from
 * here, sched_switch, with interrupts off, by a discarded record (the reader skips it), at most
 * every RING_WAKE_GAP_NS on this CPU unless urgent (2: a process stopped until user space acts,
 * or a burst of block completions). The reader reads every ring to the end when woken, so every
 * ring's quiet count starts again. */
static __always_inline void ring_wake_owed(u64 now)
{
    u32 owed_key = RING_OWED;
    u64 *owed = ring_quiet.lookup(&owed_key);
    if (!owed || !*owed)
        return;
    u32 woken_key = RING_WOKEN;
    u64 *woken = ring_quiet.lookup(&woken_key);
    if (!woken || (*owed < 2 && now - *woken < RING_WAKE_GAP_NS))
        return;
    *woken = now;
    *owed = 0;
    u32 ring0 = RING_SCHED, ring1 = RING_CUDA, ring2 = RING_NCCL, ring3 = RING_PYSTACK;
    u64 *quiet = ring_quiet.lookup(&ring0);
    if (quiet)
        *quiet = 0;
    quiet = ring_quiet.lookup(&ring1);
    if (quiet)
        *quiet = 0;
    quiet = ring_quiet.lookup(&ring2);
    if (quiet)
        *quiet = 0;
    quiet = ring_quiet.lookup(&ring3);
    if (quiet)
        *quiet = 0;
    struct offcpu_event *e = offcpu_events.ringbuf_reserve(sizeof(struct offcpu_event));
    if (e)
        offcpu_events.ringbuf_discard(e, BPF_RB_FORCE_WAKEUP);
}

/* Switch-ins the kernel does not report. On some kernels (seen on 6.18 guests) a CPU switching
 * from its idle task to a woken thread fires no sched_switch, so the thread runs again with its
 * interval open. Two later points in the thread's own life close it: its return from the syscall
 * it blocked in (raw_syscalls:sys_exit, microseconds after it ran again: the end is that return,
 * OFFCPU_FLAG_END_SYSCALL), or else its next switch-out (the end is then its wake-up, as an idle
 * CPU ran it at once: OFFCPU_FLAG_END_WAKEUP; never woken, the end is not known and the duration
 * 0). Nothing is lost and nothing is merged. */
TRACEPOINT_PROBE(sched, sched_switch)
{
    u64 now = bpf_ktime_get_ns();
    u32 prev = args->prev_pid;
    u32 next = args->next_pid;
    u32 zero = 0;
    u32 cpu = bpf_get_smp_processor_id();
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

    ring_wake_owed(now);

    struct offcpu_open_t *open = offcpu_open.lookup(&next);
    if (open && open->ts)
        close_interval(open, next, now, cpu, runs, 0);

    if (prev == 0)
        return 0;
    if (args->prev_state & TASK_DEAD_STATES) {
        /* its last switch: a traced thread's entry goes (its process may no longer be a target) */
        offcpu_open.delete(&prev);
        return 0;
    }
    u32 tgid = bpf_get_current_pid_tgid() >> 32;
    if (!is_target(tgid))
        return 0;
    struct offcpu_open_t *st = offcpu_open.lookup(&prev);
    if (!st) {
        struct offcpu_open_t fresh_entry = {};
        if (offcpu_open.update(&prev, &fresh_entry)) {
            count_drop(PROBE_SCHED_MAP);
            return 0;
        }
        st = offcpu_open.lookup(&prev);
        if (!st)
            return 0;
    } else if (st->ts) {
        /* it ran since its last switch-out without a switch-in (see above) */
        close_interval(st, prev, st->waker.ts >= st->ts ? st->waker.ts : st->ts, cpu, 0,
                       OFFCPU_FLAG_END_WAKEUP);
    }
    st->cgroup_id = bpf_get_current_cgroup_id();
    st->state = args->prev_state;
    st->pid = tgid;
    st->cpu = cpu;
    st->next_tid = next;
    st->stack_ts = 0;
    st->epoch = 0;
    st->flags = 0;
    st->futex_addr = 0;
    st->waker.ts = 0;
    struct syscall_t *sc = in_syscall.lookup(&prev);
    if (sc && !sc->ts)
        sc = 0; /* between two syscalls */
    st->syscall = sc ? sc->nr : -1;
    if (sc) {
        sc->blocked = 1; /* its exit looks for an interval left open (see above) */
        if (sc->nr == NR_FUTEX) {
            u64 *uaddr = futex_uaddr.lookup(&prev);
            st->futex_addr = uaddr ? *uaddr : 0;
        }
    }
    __builtin_memcpy(st->comm, args->prev_comm, 16);
    __builtin_memcpy(st->next_comm, args->next_comm, 16);
    int fresh = 0;
    u32 *stacks_on = sched_settings.lookup(&zero);
    if (stacks_on && *stacks_on && SWITCH_BLOCKED(st->state)) {
        if (!sc) {
            st->stack_ts = pystack_key(0, now, &fresh);
        } else if (sc->stack_key) {
            st->stack_ts = sc->stack_key; /* promised by an earlier interval of this syscall */
            st->flags = OFFCPU_FLAG_PROMISED;
        } else {
            struct pystack_last *last = pystack_last.lookup(&prev);
            if (last && last->epoch == sc->ts && last->key)
                st->stack_ts = last->key; /* captured earlier in this syscall */
            else if ((!last || now - last->key >= PYSTACK_EVERY_NS || (st->state & TASK_D_STATE)) &&
                     pystack_procs.lookup(&tgid))
                st->stack_ts = pystack_key(sc->ts, now, &fresh);
            else /* (not configured yet: its exit may find it configured) */
                st->epoch = sc->ts; /* decided at the switch-in (above), read at the syscall's exit */
        }
    }
    /* open last: sched_waking fills the waker only of an open entry */
    asm volatile("" ::: "memory");
    st->ts = now;
    if (fresh) /* even without the interval: later events of this syscall share the capture */
        PYSTACK_CAPTURE_TP(args, now);
    return 0;
}

/* Wake-ups from interrupt context. A wake-up from a timer, a device interrupt or a softirq runs on
 * top of whatever task the interrupt hit: that task is not the waker. The task struct's preempt
 * count is a kernel layout, so the context is told apart without it: the kernel hands a tracepoint's
 * BPF program a per-CPU buffer of the perf recursion context it runs in (task, softirq, hardirq,
 * NMI: perf_trace_buf_alloc), so the program's `args` pointer is the same for every tracepoint that
 * fires in one context on one CPU, and differs between contexts. irq_handler_entry and
 * softirq_entry note their CPU's hardirq and softirq buffers; a timer callback notes its buffer
 * while it runs (hrtimer_expire_entry..exit, timer_expire_entry..exit). sched_waking compares its
 * own `args` with them: the waker is then 'timer', 'interrupt' or 'softirq' (tid 0), never the
 * interrupted task. The hardirq buffer is one per CPU for every hardirq, so the vectors that are
 * no device interrupt note it too (x86's irq_vectors: irq_work and the function call IPIs; each
 * fires before its handler runs): a wake-up from an IPI or irq_work (a BPF ring buffer's
 * notification) is 'interrupt' also on a CPU no device interrupt has hit yet. Not the reschedule
 * IPI: it wakes no task itself (a wake-up queued to another CPU's list was traced by its waker, who
 * sent the IPI). Not the local timer's vector: its wake-ups are timer callbacks (above), and it
 * would cost a run per tick. The cost:
 * one per-CPU array store per interrupt and timer callback (docs/benchmarks.md). */
struct irq_ctx_t {
    u64 hardirq;  /* `args` of a program in this CPU's hardirq context, 0: not seen yet */
    u64 softirq;
    u64 timer;    /* `args` of the timer callback running now, 0: none */
    u64 outer;    /* the callback it interrupted (a softirq timer under a hardirq one), 0: none */
};
BPF_PERCPU_ARRAY(irq_ctx, struct irq_ctx_t, 1);
#define WAKER_TIMER 1
#define WAKER_INTERRUPT 2
#define WAKER_SOFTIRQ 3

static __always_inline void irq_note(int which, u64 at)
{
    u32 zero = 0;
    struct irq_ctx_t *c = irq_ctx.lookup(&zero);
    if (!c)
        return;
    if (which == WAKER_INTERRUPT) {
        c->hardirq = at;
    } else if (which == WAKER_SOFTIRQ) {
        c->softirq = at;
    } else if (at) {  /* a timer callback starts */
        c->outer = c->timer;
        c->timer = at;
    } else {  /* it ends: the one it interrupted (in another context), if any, runs again */
        /* an outer of the same context is an end the kernel skipped: dropped, not restored */
        c->timer = c->outer != c->timer ? c->outer : 0;
        c->outer = 0;
    }
}

#ifdef HAVE_TP_irq_irq_handler_entry
TRACEPOINT_PROBE(irq, irq_handler_entry)
{
    irq_note(WAKER_INTERRUPT, (u64)args);
    return 0;
}
#endif

/* the hardirq vectors that are no device interrupt (see above); absent on other architectures */
#ifdef HAVE_TP_irq_vectors_irq_work_entry
TRACEPOINT_PROBE(irq_vectors, irq_work_entry)
{
    irq_note(WAKER_INTERRUPT, (u64)args);
    return 0;
}
#endif

#ifdef HAVE_TP_irq_vectors_call_function_entry
TRACEPOINT_PROBE(irq_vectors, call_function_entry)
{
    irq_note(WAKER_INTERRUPT, (u64)args);
    return 0;
}
#endif

#ifdef HAVE_TP_irq_vectors_call_function_single_entry
TRACEPOINT_PROBE(irq_vectors, call_function_single_entry)
{
    irq_note(WAKER_INTERRUPT, (u64)args);
    return 0;
}
#endif

#ifdef HAVE_TP_irq_softirq_entry
TRACEPOINT_PROBE(irq, softirq_entry)
{
    irq_note(WAKER_SOFTIRQ, (u64)args);
    return 0;
}
#endif

#if defined(HAVE_TP_timer_hrtimer_expire_entry) && defined(HAVE_TP_timer_hrtimer_expire_exit)
TRACEPOINT_PROBE(timer, hrtimer_expire_entry)
{
    irq_note(WAKER_TIMER, (u64)args);
    return 0;
}

TRACEPOINT_PROBE(timer, hrtimer_expire_exit)
{
    irq_note(WAKER_TIMER, 0);
    return 0;
}
#endif

#if defined(HAVE_TP_timer_timer_expire_entry) && defined(HAVE_TP_timer_timer_expire_exit)
TRACEPOINT_PROBE(timer, timer_expire_entry)
{
    irq_note(WAKER_TIMER, (u64)args);
    return 0;
}

TRACEPOINT_PROBE(timer, timer_expire_exit)
{
    irq_note(WAKER_TIMER, 0);
    return 0;
}
#endif

TRACEPOINT_PROBE(sched, sched_waking)
{
    u32 wakee = args->pid;
    struct offcpu_open_t *o = offcpu_open.lookup(&wakee);
    if (!o || !o->ts)
        return 0;
    struct waker_t *w = &o->waker;
    w->cpu = bpf_get_smp_processor_id();
    u32 zero = 0;
    u64 at = (u64)args;
    struct irq_ctx_t *c = irq_ctx.lookup(&zero);
    /* the waker's tid is 0 and its name the context (recorder/layers/sched.py reads it so) */
    if (c && c->timer == at) {
        w->tid = 0;
        __builtin_memcpy(w->comm, "timer\0\0\0\0\0\0\0\0\0\0\0", 16);
    } else if (c && c->hardirq == at) {
        w->tid = 0;
        __builtin_memcpy(w->comm, "interrupt\0\0\0\0\0\0\0", 16);
    } else if (c && c->softirq == at && !is_target(bpf_get_current_pid_tgid() >> 32)) {
        /* a softirq on a traced task's time is most often its own doing (a send on loopback runs
         * the receive in the sender's context at local_bh_enable): that task stays the waker */
        w->tid = 0;
        __builtin_memcpy(w->comm, "softirq\0\0\0\0\0\0\0\0\0", 16);
    } else {
        w->tid = (u32)bpf_get_current_pid_tgid();
        bpf_get_current_comm(w->comm, sizeof(w->comm));
    }
    w->ts = bpf_ktime_get_ns();
    return 0;
}

TRACEPOINT_PROBE(raw_syscalls, sys_enter)
{
    u64 id = bpf_get_current_pid_tgid();
    if (!is_target(id >> 32))
        return 0;
    u32 tid = (u32)id;
    u64 now = bpf_ktime_get_ns();
    if (args->id == NR_FUTEX) {
        u64 uaddr = args->args[0];
        futex_uaddr.update(&tid, &uaddr);
    }
    /* the thread's entry from its last syscall, rewritten in place: no lock, no allocation */
    struct syscall_t *sc = in_syscall.lookup(&tid);
    if (sc) {
        sc->stack_key = 0;
        sc->blocked = 0;
        sc->nr = (s32)args->id;
        sc->ts = now;
        return 0;
    }
    struct syscall_t first = {.ts = now, .nr = (s32)args->id};
    in_syscall.update(&tid, &first);
    return 0;
}

TRACEPOINT_PROBE(raw_syscalls, sys_exit)
{
    /* every syscall on the machine ends here: a lookup (lock-free) finds nothing for the tasks
     * that are not traced */
    u32 tid = (u32)bpf_get_current_pid_tgid();
    struct syscall_t *sc = in_syscall.lookup(&tid);
    if (!sc || !sc->ts)
        return 0;
    if (sc->blocked) {
        /* it blocked in this syscall: an interval the kernel sent no switch-in for ends now */
        sc->blocked = 0;
        struct offcpu_open_t *o = offcpu_open.lookup(&tid);
        if (o && o->ts)
            close_interval(o, tid, bpf_ktime_get_ns(), bpf_get_smp_processor_id(), 0,
                           OFFCPU_FLAG_END_SYSCALL);
    }
    u64 key = sc->stack_key;
    s32 nr = sc->nr;
    sc->ts = 0;
    sc->stack_key = 0;
    /* an interval of this syscall was promised the stack it returns to; an exec returns to
     * another program's (x86-64 execve 59, execveat 322): its intervals keep none */
    if (key && nr != 59 && nr != 322)
        PYSTACK_CAPTURE_TP(args, key);
    return 0;
}
