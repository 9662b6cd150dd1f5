/* checkpoint: the write extents, syncs, closes and renames of checkpoint files, from syscall
 * tracepoints (no kprobes, no kernel struct layouts: tracepoint fields, helpers and user memory).
 *
 * A file is a checkpoint when the opening thread is inside recorder.checkpoint() (a uprobe on
 * stall_recorder_checkpoint keeps a per-thread scope depth), or when user space says so after the
 * open: the path is a scope's path, carries the user.ai.checkpoint xattr, or is a completed
 * checkpoint being written again. So every open for writing by a target is sent, and the file's
 * descriptor is PENDING until user space writes a verdict (`ckpt_verdict`); a PENDING file's events
 * are sent too and held in user space, so nothing written before the verdict is lost. An IGNORED
 * descriptor is forgotten at its next syscall.
 *
 * write/writev/sendfile/copy_file_range without an offset write at the descriptor's position, which
 * is kept here per (tgid, fd) from the open (0), the writes (+= bytes) and lseek's return. Not
 * followed: dup'd descriptors, descriptors inherited across fork, mmap writes, O_APPEND offsets
 * (sent as -1).
 */
BPF_RINGBUF_OUTPUT(checkpoint_events, 256);

/* types the syscall tracepoints' fields are declared with (tracefs format), not in BCC's headers */
typedef int rwf_t;

#define CKPT_USE_POS (-2)  /* the write is at the descriptor's position */
#define CKPT_O_ACCMODE 3
#define CKPT_O_APPEND 02000
#define CKPT_RWF_APPEND 0x10

struct ckpt_fd_key {
    u32 tgid;
    s32 fd;
};

struct ckpt_fd {
    u64 open_id;
    s64 pos;     /* the descriptor's file position, as far as traced */
    u32 state;   /* CKPT_PENDING / CKPT_OPTED / CKPT_IGNORED */
    u32 append;  /* opened O_APPEND: offsets unknown */
};

struct ckpt_verdict_key {
    u64 open_id;
    u32 tgid;
    s32 fd;
};

/* one syscall in flight per thread, from its entry to its exit */
struct ckpt_call {
    u64 ts;
    u64 open_id;
    s64 offset;
    u64 count;
    u64 ptr1;   /* open: path; rename: old path */
    u64 ptr2;   /* rename: new path */
    u64 flags;  /* open: O_* flags; rename: RENAME_* flags */
    s32 fd;     /* the file's descriptor; open, rename: dirfd */
    s32 fd2;    /* rename: new dirfd */
    u32 op;     /* CKPT_OP_* */
    u32 in_scope;
};

BPF_HASH(ckpt_fds, struct ckpt_fd_key, struct ckpt_fd, 16384);
BPF_TABLE("lru_hash", struct ckpt_verdict_key, u32, ckpt_verdict, 16384);
BPF_HASH(ckpt_calls, u32, struct ckpt_call, 16384);
BPF_HASH(ckpt_scope, u32, u32, 16384);  /* tid -> depth of recorder.checkpoint() scopes */

/* recorder.checkpoint(): stall_recorder_checkpoint(const char *path, u64 len, u64 phase, u64 tag) */
int checkpoint_scope(struct pt_regs *ctx)
{
    u64 id = bpf_get_current_pid_tgid();
    if (!is_target(id >> 32))
        return 0;
    u32 tid = (u32)id;
    u64 phase = PT_REGS_PARM3(ctx);
    u32 *depth = ckpt_scope.lookup(&tid);
    if (phase == 1) {
        u32 one = 1;
        if (depth)
            __sync_fetch_and_add(depth, 1);
        else
            ckpt_scope.update(&tid, &one);
    } else if (phase == 2 && depth) {
        if (*depth <= 1)
            ckpt_scope.delete(&tid);
        else
            __sync_fetch_and_add(depth, -1);
    }
    struct ckpt_scope_event *e = checkpoint_events.ringbuf_reserve(sizeof(struct ckpt_scope_event));
    if (!e) {
        count_drop(PROBE_CKPT);
        return 0;
    }
    e->ts = bpf_ktime_get_ns();
    e->phase = phase;
    e->tag = PT_REGS_PARM4(ctx);
    e->path_addr = PT_REGS_PARM1(ctx);
    e->path_len = PT_REGS_PARM2(ctx);
    e->pid = id >> 32;
    e->tid = tid;
    __builtin_memset(e->path, 0, sizeof(e->path));
    bpf_probe_read_user_str(e->path, sizeof(e->path), (void *)e->path_addr);
    checkpoint_events.ringbuf_submit(e, ring_wake_deferred(0));
    return 0;
}

/* The traced state of a target's descriptor, or 0 when it is not (or no longer) followed. */
static __always_inline struct ckpt_fd *ckpt_lookup(u32 tgid, s32 fd)
{
    struct ckpt_fd_key k = {.tgid = tgid, .fd = fd};
    struct ckpt_fd *f = ckpt_fds.lookup(&k);
    if (!f)
        return 0;
    if (f->state == CKPT_PENDING) {
        struct ckpt_verdict_key vk = {.open_id = f->open_id, .tgid = tgid, .fd = fd};
        u32 *v = ckpt_verdict.lookup(&vk);
        if (v) {
            f->state = *v;
            ckpt_verdict.delete(&vk);
        }
    }
    if (f->state == CKPT_IGNORED) {
        ckpt_fds.delete(&k);
        return 0;
    }
    return f;
}

/* Entry of a syscall on descriptor fd: stash it when the descriptor is followed. */
static __always_inline int ckpt_fd_enter(u32 op, s64 fd, s64 offset, u64 count)
{
    u64 id = bpf_get_current_pid_tgid();
    u32 tgid = id >> 32;
    if (fd < 0 || !is_target(tgid))
        return 0;
    struct ckpt_fd *f = ckpt_lookup(tgid, (s32)fd);
    if (!f)
        return 0;
    struct ckpt_call c = {};
    c.ts = bpf_ktime_get_ns();
    c.open_id = f->open_id;
    c.offset = offset;
    c.count = count;
    c.fd = (s32)fd;
    c.op = op;
    u32 tid = (u32)id;
    if (ckpt_calls.update(&tid, &c))
        count_drop(PROBE_CKPT_MAP);
    if (op == CKPT_OP_CLOSE) {
        /* forget the descriptor now, before close frees its number for reuse */
        struct ckpt_fd_key k = {.tgid = tgid, .fd = (s32)fd};
        ckpt_fds.delete(&k);
    }
    return 0;
}

static __always_inline void ckpt_send_io(struct ckpt_call *c, u64 id, s64 offset, s64 ret)
{
    struct ckpt_io_event *e = checkpoint_events.ringbuf_reserve(sizeof(struct ckpt_io_event));
    if (!e) {
        count_drop(PROBE_CKPT);
        return;
    }
    e->ts = c->ts;
    e->dur = bpf_ktime_get_ns() - c->ts;
    e->open_id = c->open_id;
    e->offset = offset;
    e->count = c->count;
    e->ret = ret;
    e->pid = id >> 32;
    e->tid = (u32)id;
    e->fd = c->fd;
    e->op = c->op;
    checkpoint_events.ringbuf_submit(e, ring_wake_deferred(0));
}

/* Exit of a stashed syscall: writes get their offset (and move the position), others are sent. */
static __always_inline int ckpt_fd_exit(s64 ret)
{
    u64 id = bpf_get_current_pid_tgid();
    u32 tid = (u32)id;
    struct ckpt_call *c = ckpt_calls.lookup(&tid);
    if (!c)
        return 0;
    u32 op = c->op;
    if (op == CKPT_OP_OPEN || op == CKPT_OP_RENAME) {  /* a stale entry: its exit was missed */
        ckpt_calls.delete(&tid);
        return 0;
    }
    struct ckpt_fd_key k = {.tgid = id >> 32, .fd = c->fd};
    struct ckpt_fd *f = ckpt_fds.lookup(&k);
    if (f && f->open_id != c->open_id)
        f = 0;  /* closed and reopened by another thread meanwhile */
    s64 offset = c->offset;
    if (op == CKPT_OP_LSEEK) {
        if (f && ret >= 0)
            f->pos = ret;
        ckpt_calls.delete(&tid);
        return 0;
    }
    if (offset == CKPT_USE_POS) {
        offset = -1;
        if (f && !f->append) {
            offset = f->pos;
            if (ret > 0)
                f->pos += ret;
        }
    }
    ckpt_send_io(c, id, offset, ret);
    ckpt_calls.delete(&tid);
    return 0;
}

/* -- opens ------------------------------------------------------------------------------------- */
static __always_inline int ckpt_open_enter(s64 dirfd, u64 path, u64 flags)
{
    u64 id = bpf_get_current_pid_tgid();
    if ((flags & CKPT_O_ACCMODE) == 0 || !is_target(id >> 32))
        return 0;  /* read-only opens are not writes */
    u32 tid = (u32)id;
    struct ckpt_call c = {};
    c.ts = bpf_ktime_get_ns();
    c.ptr1 = path;
    c.flags = flags;
    c.fd = (s32)dirfd;
    c.op = CKPT_OP_OPEN;
    c.in_scope = ckpt_scope.lookup(&tid) ? 1 : 0;
    if (ckpt_calls.update(&tid, &c))
        count_drop(PROBE_CKPT_MAP);
    return 0;
}

static __always_inline int ckpt_open_exit(s64 ret)
{
    u64 id = bpf_get_current_pid_tgid();
    u32 tid = (u32)id;
    struct ckpt_call *c = ckpt_calls.lookup(&tid);
    if (!c)
        return 0;
    if (c->op != CKPT_OP_OPEN || ret < 0) {
        ckpt_calls.delete(&tid);
        return 0;
    }
    u64 now = bpf_ktime_get_ns();
    struct ckpt_fd_key k = {.tgid = id >> 32, .fd = (s32)ret};
    struct ckpt_fd f = {};
    f.open_id = now;
    f.state = c->in_scope ? CKPT_OPTED : CKPT_PENDING;
    f.append = (c->flags & CKPT_O_APPEND) ? 1 : 0;
    if (ckpt_fds.update(&k, &f) != 0) {
        count_drop(PROBE_CKPT_MAP);
        ckpt_calls.delete(&tid);
        return 0;
    }
    struct ckpt_open_event *e = checkpoint_events.ringbuf_reserve(sizeof(struct ckpt_open_event));
    if (!e) {
        count_drop(PROBE_CKPT);
        ckpt_fds.delete(&k);
        ckpt_calls.delete(&tid);
        return 0;
    }
    e->ts = c->ts;
    e->dur = now - c->ts;
    e->open_id = now;
    e->flags = c->flags;
    e->pid = id >> 32;
    e->tid = tid;
    e->fd = (s32)ret;
    e->dirfd = c->fd;
    e->in_scope = c->in_scope;
    e->pad = 0;
    __builtin_memset(e->path, 0, sizeof(e->path));
    bpf_probe_read_user_str(e->path, sizeof(e->path), (void *)c->ptr1);  /* the kernel just read it */
    checkpoint_events.ringbuf_submit(e, ring_wake_deferred(0));
    ckpt_calls.delete(&tid);
    return 0;
}

TRACEPOINT_PROBE(syscalls, sys_enter_openat)
{
    return ckpt_open_enter((s32)args->dfd, (u64)args->filename, (u64)args->flags);
}

TRACEPOINT_PROBE(syscalls, sys_exit_openat)
{
    return ckpt_open_exit(args->ret);
}

#ifdef HAVE_TP_syscalls_sys_enter_open
TRACEPOINT_PROBE(syscalls, sys_enter_open)
{
    return ckpt_open_enter(-100, (u64)args->filename, (u64)args->flags);
}

TRACEPOINT_PROBE(syscalls, sys_exit_open)
{
    return ckpt_open_exit(args->ret);
}
#endif

#ifdef HAVE_TP_syscalls_sys_enter_creat
TRACEPOINT_PROBE(syscalls, sys_enter_creat)
{
    return ckpt_open_enter(-100, (u64)args->pathname, 01 | 0100 | 01000);  /* O_WRONLY|O_CREAT|O_TRUNC */
}

TRACEPOINT_PROBE(syscalls, sys_exit_creat)
{
    return ckpt_open_exit(args->ret);
}
#endif

#ifdef HAVE_TP_syscalls_sys_enter_openat2
TRACEPOINT_PROBE(syscalls, sys_enter_openat2)
{
    u64 flags = 0;  /* struct open_how (UAPI) starts with its u64 flags */
    bpf_probe_read_user(&flags, sizeof(flags), (void *)args->how);
    return ckpt_open_enter((s32)args->dfd, (u64)args->filename, flags);
}

TRACEPOINT_PROBE(syscalls, sys_exit_openat2)
{
    return ckpt_open_exit(args->ret);
}
#endif

/* -- writes ------------------------------------------------------------------------------------ */
TRACEPOINT_PROBE(syscalls, sys_enter_write)
{
    return ckpt_fd_enter(CKPT_OP_WRITE, (s32)args->fd, CKPT_USE_POS, args->count);
}

TRACEPOINT_PROBE(syscalls, sys_exit_write)
{
    return ckpt_fd_exit(args->ret);
}

#ifdef HAVE_TP_syscalls_sys_enter_pwrite64
TRACEPOINT_PROBE(syscalls, sys_enter_pwrite64)
{
    return ckpt_fd_enter(CKPT_OP_PWRITE64, (s32)args->fd, (s64)args->pos, args->count);
}

TRACEPOINT_PROBE(syscalls, sys_exit_pwrite64)
{
    return ckpt_fd_exit(args->ret);
}
#endif

#ifdef HAVE_TP_syscalls_sys_enter_writev
TRACEPOINT_PROBE(syscalls, sys_enter_writev)
{
    return ckpt_fd_enter(CKPT_OP_WRITEV, (s32)args->fd, CKPT_USE_POS, 0);
}

TRACEPOINT_PROBE(syscalls, sys_exit_writev)
{
    return ckpt_fd_exit(args->ret);
}
#endif

#ifdef HAVE_TP_syscalls_sys_enter_pwritev
TRACEPOINT_PROBE(syscalls, sys_enter_pwritev)
{
    /* on 64-bit kernels pos_l holds the whole offset */
    return ckpt_fd_enter(CKPT_OP_PWRITEV, (s32)args->fd, (s64)args->pos_l, 0);
}

TRACEPOINT_PROBE(syscalls, sys_exit_pwritev)
{
    return ckpt_fd_exit(args->ret);
}
#endif

#ifdef HAVE_TP_syscalls_sys_enter_pwritev2
TRACEPOINT_PROBE(syscalls, sys_enter_pwritev2)
{
    s64 pos = (s64)args->pos_l;
    if (args->flags & CKPT_RWF_APPEND)
        pos = -1;
    else if (pos == -1)
        pos = CKPT_USE_POS;  /* offset -1: the descriptor's position, which moves */
    return ckpt_fd_enter(CKPT_OP_PWRITEV2, (s32)args->fd, pos, 0);
}

TRACEPOINT_PROBE(syscalls, sys_exit_pwritev2)
{
    return ckpt_fd_exit(args->ret);
}
#endif

#ifdef HAVE_TP_syscalls_sys_enter_sendfile64
TRACEPOINT_PROBE(syscalls, sys_enter_sendfile64)
{
    return ckpt_fd_enter(CKPT_OP_SENDFILE, (s32)args->out_fd, CKPT_USE_POS, args->count);
}

TRACEPOINT_PROBE(syscalls, sys_exit_sendfile64)
{
    return ckpt_fd_exit(args->ret);
}
#endif

#ifdef HAVE_TP_syscalls_sys_enter_copy_file_range
TRACEPOINT_PROBE(syscalls, sys_enter_copy_file_range)
{
    s64 pos = CKPT_USE_POS;
    if (args->off_out && bpf_probe_read_user(&pos, sizeof(pos), (void *)args->off_out) != 0)
        pos = -1;
    return ckpt_fd_enter(CKPT_OP_COPY_FILE_RANGE, (s32)args->fd_out, pos, args->len);
}

TRACEPOINT_PROBE(syscalls, sys_exit_copy_file_range)
{
    return ckpt_fd_exit(args->ret);
}
#endif

/* -- position, syncs, truncation, close ---------------------------------------------------------- */
#ifdef HAVE_TP_syscalls_sys_enter_lseek
TRACEPOINT_PROBE(syscalls, sys_enter_lseek)
{
    return ckpt_fd_enter(CKPT_OP_LSEEK, (s32)args->fd, 0, 0);
}

TRACEPOINT_PROBE(syscalls, sys_exit_lseek)
{
    return ckpt_fd_exit(args->ret);
}
#endif

#ifdef HAVE_TP_syscalls_sys_enter_fsync
TRACEPOINT_PROBE(syscalls, sys_enter_fsync)
{
    return ckpt_fd_enter(CKPT_OP_FSYNC, (s32)args->fd, 0, 0);
}

TRACEPOINT_PROBE(syscalls, sys_exit_fsync)
{
    return ckpt_fd_exit(args->ret);
}
#endif

#ifdef HAVE_TP_syscalls_sys_enter_fdatasync
TRACEPOINT_PROBE(syscalls, sys_enter_fdatasync)
{
    return ckpt_fd_enter(CKPT_OP_FDATASYNC, (s32)args->fd, 0, 0);
}

TRACEPOINT_PROBE(syscalls, sys_exit_fdatasync)
{
    return ckpt_fd_exit(args->ret);
}
#endif

#ifdef HAVE_TP_syscalls_sys_enter_ftruncate
TRACEPOINT_PROBE(syscalls, sys_enter_ftruncate)
{
    return ckpt_fd_enter(CKPT_OP_FTRUNCATE, (s32)args->fd, (s64)args->length, 0);
}

TRACEPOINT_PROBE(syscalls, sys_exit_ftruncate)
{
    return ckpt_fd_exit(args->ret);
}
#endif

TRACEPOINT_PROBE(syscalls, sys_enter_close)
{
    return ckpt_fd_enter(CKPT_OP_CLOSE, (s32)args->fd, 0, 0);
}

TRACEPOINT_PROBE(syscalls, sys_exit_close)
{
    return ckpt_fd_exit(args->ret);
}

/* -- renames: every rename by a target (user space matches the paths to checkpoint files) --------- */
static __always_inline int ckpt_rename_enter(s64 olddirfd, u64 oldpath, s64 newdirfd, u64 newpath, u64 flags)
{
    u64 id = bpf_get_current_pid_tgid();
    if (!is_target(id >> 32))
        return 0;
    u32 tid = (u32)id;
    struct ckpt_call c = {};
    c.ts = bpf_ktime_get_ns();
    c.ptr1 = oldpath;
    c.ptr2 = newpath;
    c.flags = flags;
    c.fd = (s32)olddirfd;
    c.fd2 = (s32)newdirfd;
    c.op = CKPT_OP_RENAME;
    if (ckpt_calls.update(&tid, &c))
        count_drop(PROBE_CKPT_MAP);
    return 0;
}

static __always_inline int ckpt_rename_exit(s64 ret)
{
    u64 id = bpf_get_current_pid_tgid();
    u32 tid = (u32)id;
    struct ckpt_call *c = ckpt_calls.lookup(&tid);
    if (!c)
        return 0;
    if (c->op != CKPT_OP_RENAME) {
        ckpt_calls.delete(&tid);
        return 0;
    }
    struct ckpt_rename_event *e = checkpoint_events.ringbuf_reserve(sizeof(struct ckpt_rename_event));
    if (!e) {
        count_drop(PROBE_CKPT);
        ckpt_calls.delete(&tid);
        return 0;
    }
    e->ts = c->ts;
    e->dur = bpf_ktime_get_ns() - c->ts;
    e->ret = ret;
    e->pid = id >> 32;
    e->tid = tid;
    e->olddirfd = c->fd;
    e->newdirfd = c->fd2;
    e->flags = (u32)c->flags;
    e->pad = 0;
    __builtin_memset(e->oldpath, 0, sizeof(e->oldpath));
    __builtin_memset(e->newpath, 0, sizeof(e->newpath));
    bpf_probe_read_user_str(e->oldpath, sizeof(e->oldpath), (void *)c->ptr1);
    bpf_probe_read_user_str(e->newpath, sizeof(e->newpath), (void *)c->ptr2);
    checkpoint_events.ringbuf_submit(e, ring_wake_deferred(0));
    ckpt_calls.delete(&tid);
    return 0;
}

#ifdef HAVE_TP_syscalls_sys_enter_rename
TRACEPOINT_PROBE(syscalls, sys_enter_rename)
{
    return ckpt_rename_enter(-100, (u64)args->oldname, -100, (u64)args->newname, 0);
}

TRACEPOINT_PROBE(syscalls, sys_exit_rename)
{
    return ckpt_rename_exit(args->ret);
}
#endif

#ifdef HAVE_TP_syscalls_sys_enter_renameat
TRACEPOINT_PROBE(syscalls, sys_enter_renameat)
{
    return ckpt_rename_enter((s32)args->olddfd, (u64)args->oldname, (s32)args->newdfd, (u64)args->newname, 0);
}

TRACEPOINT_PROBE(syscalls, sys_exit_renameat)
{
    return ckpt_rename_exit(args->ret);
}
#endif

#ifdef HAVE_TP_syscalls_sys_enter_renameat2
TRACEPOINT_PROBE(syscalls, sys_enter_renameat2)
{
    return ckpt_rename_enter((s32)args->olddfd, (u64)args->oldname, (s32)args->newdfd, (u64)args->newname,
                             args->flags);
}

TRACEPOINT_PROBE(syscalls, sys_exit_renameat2)
{
    return ckpt_rename_exit(args->ret);
}
#endif
