/* pystack.h: capture the current thread's CPython stack at a uprobe or a tracepoint.
 *
 * Pasted as text (recorder.core.pyframes.bpf_source()) in front of the probes that use it: BCC rewrites
 * map syntax (map.lookup(), prog_array.call()) only in the main text, not in #included files. A
 * probe finishes its own work and ends with PYSTACK_CAPTURE(ctx, ts) (uprobes) or
 * PYSTACK_CAPTURE_TP(args, ts) (tracepoints that run in the thread's own context, where its user
 * memory is readable: sched_switch for the task switching out, block_bio_queue in the submitter's).
 * That stashes (ts, pid, tid) in per-CPU scratch and tail-calls the walker, which never returns to
 * the probe. A program array holds programs of one type only, so the walker is loaded once per
 * program type that captures: as kprobe programs (pystack_progs, for uprobes), as tracepoint
 * programs (pystack_tp_progs) and, for the on-CPU profile's samples, as perf event programs
 * (pystack_pe_progs, PYSTACK_CAPTURE_PE): the same inline bodies. The perf event copy is in the
 * profile's own BPF object (BPF_SECONDARY, compiled after the start), with a ring, a scratch and
 * counts of its own and every other map the session's (see the maps below).
 *
 * The walker finds the thread's PyThreadState by matching tstate->thread_id (pthread_self(), the fs
 * base on x86-64) against the current task's fs base, without looking at the GIL (ctypes and
 * PyTorch release it before calling into CUDA), walks up to PYSTACK_MAX_FRAMES frames and submits
 * one pystack_event to the `pystacks` ring buffer, always: status says why a record has no (or only
 * part of a) stack. User space (recorder/core/pyframes.py) fills pystack_procs per process, wires the
 * walker into the program arrays and resolves each frame's (code, instr, checksum) to file,
 * function and executing line.
 *
 * Everything version-specific is data in pystack_procs; nothing here depends on kernel headers
 * (the task's fs base offset comes from the running kernel's BTF, in the same map value).
 * Keep struct layouts in sync with recorder/core/pyframes.py (tests/test_pyframes_layout.py checks).
 */
#ifndef PYSTACK_H
#define PYSTACK_H

#ifndef PYSTACK_LAYOUT_ONLY /* defined by the layout test, which compiles the structs with gcc */
#include <uapi/linux/ptrace.h>
#endif

#ifndef PYSTACK_MAX_FRAMES
#define PYSTACK_MAX_FRAMES 64
#endif
/* frames walked per program; the walker tail-calls itself for the rest (verifier size limits) */
#if PYSTACK_MAX_FRAMES & (PYSTACK_MAX_FRAMES - 1)
#error "PYSTACK_MAX_FRAMES must be a power of two (frames[] is indexed with a mask)"
#endif
#define PYSTACK_FRAMES_PER_PROG 32
#define PYSTACK_SEEN_SLOTS 8   /* power of two: code objects remembered per walk */
#define PYSTACK_WINDOW 2048    /* power of two: bytes of a 3.11+ data stack read at once */
#define PYSTACK_NEAR 65536     /* a frame this far below the window is in the same data stack */
#define PYSTACK_FRAME_HEAD 104 /* every frame field used is in the first 104 bytes */
#define PYSTACK_MAX_INTERPRETERS 8
#define PYSTACK_MAX_THREADS 256
#ifndef PYSTACK_RB_FLAGS /* the recorder wakes its consumer in batches (bpf/common.h) */
#define PYSTACK_RB_FLAGS 0
#endif
#ifndef PYSTACK_RINGBUF_PAGES
#define PYSTACK_RINGBUF_PAGES 256
#endif

/* pystack_progs slots */
#define PYSTACK_PROG_FIND 0
#define PYSTACK_PROG_WALK 1
#define PYSTACK_PROG_SCAN 2

/* pystack_event.status: why the stack is missing or partial */
#define PYSTACK_OK 0
#define PYSTACK_TRUNCATED 1       /* deeper than PYSTACK_MAX_FRAMES: the innermost frames are kept */
#define PYSTACK_NOT_CONFIGURED 2  /* user space has not (yet) configured this process */
#define PYSTACK_UNSUPPORTED 3     /* configured, but the interpreter cannot be walked */
#define PYSTACK_NO_THREAD_STATE 4 /* this thread has no PyThreadState (never ran Python) */
#define PYSTACK_READ_ERROR 5      /* target memory unreadable: frames up to the failure are kept */
#define PYSTACK_NOT_INSTALLED 6   /* walker not wired into pystack_progs (tail call failed) */
#define PYSTACK_STATUS_COUNT 7

/* pystack_counts slots after the statuses */
#define PYSTACK_COUNT_RINGBUF_FULL PYSTACK_STATUS_COUNT
#define PYSTACK_COUNT_CLOBBERED (PYSTACK_STATUS_COUNT + 1)
#define PYSTACK_COUNT_BY_DIGEST (PYSTACK_STATUS_COUNT + 2) /* captures sent as a digest only */
#define PYSTACK_COUNT_SLOTS (PYSTACK_STATUS_COUNT + 3)

/* pystack_frame.pad: a frame entry that is not a plain frame. A code object whose head could not be
 * read (its page not resident: swapped out, or reclaimed) does not end the walk: its frame is kept
 * with checksum 0 and PYSTACK_FRAME_CODE_UNREAD, and user space reads the code object back through
 * /proc/PID/mem, which can fault the page in (recorder/core/stacks.py). A read that ends the walk
 * (PYSTACK_READ_ERROR) appends one entry PYSTACK_FRAME_FAILED | what << 8, whose `code` is the
 * address that could not be read, so user space can say why (the page's state) per process. */
#define PYSTACK_FRAME_CODE_UNREAD 1
#define PYSTACK_FRAME_FAILED 2
#define PYSTACK_FAILED_TASK 1      /* the task's fs base (kernel memory) */
#define PYSTACK_FAILED_STATE 2     /* the interpreter's state: _PyRuntime, thread states */
#define PYSTACK_FAILED_FRAME 3     /* a frame's head */
#define PYSTACK_FAILED_CODE 4      /* a frame whose code pointer is NULL */

/* pystack_proc.flags */
#define PYSTACK_F_CFRAME 1    /* top frame is tstate->cframe->current_frame (3.11, 3.12) */
#define PYSTACK_F_LASTI_INT 2 /* frame instr is an int f_lasti (3.10), else a pointer */
#define PYSTACK_F_NAME_HASH 4 /* mix co_name's cached str hash into the checksum (no co_version) */
#define PYSTACK_F_DATASTACK 8 /* frames are allocated in a per-thread data stack (3.11+) */
#define PYSTACK_F_CODE_CACHE 16 /* code objects' deallocation is probed: checksums outlive a walk */

/* Code objects whose checksum is known, across walks (pystack_code_cache): direct-mapped by
 * (pid, address). An entry is made while a walked frame holds the code object, and the uprobe on
 * the interpreter's code deallocator (pystack_code_freed) clears it before the address can be
 * reused, so a hit is the same live code object and its head is not read again: a deep stack of
 * distinct functions otherwise costs one read per frame at every call (two before 3.12: the
 * name's hash). `tag` checks that an entry was not torn by two CPUs writing the slot at once. */
#ifndef PYSTACK_CODE_SLOTS
#define PYSTACK_CODE_SLOTS 16384 /* power of two */
#endif

struct pystack_frame {
    u64 code;      /* PyCodeObject address */
    u64 instr;     /* 3.10: f_lasti (code units); 3.11+: prev_instr / instr_ptr address */
    u32 checksum;  /* pystack_checksum() of the code object, to spot a reused address */
    u32 pad;
};

struct pystack_event {
    u64 ts;        /* the probe's timestamp: (ts, pid, tid) joins this stack to its event */
    u32 pid;       /* tgid */
    u32 tid;
    u32 nframes;   /* frames[0] is the innermost (the call site) */
    u32 status;    /* PYSTACK_* */
    u64 digest;    /* the stack's identity in its process image, 0 when it has none (see below) */
    struct pystack_frame frames[PYSTACK_MAX_FRAMES];
};

/* Stack digests. A walk that used a process's recipe hashes its frames, status, pid and the
 * recipe's generation into a digest (63 bits, never 0). A capture made with
 * PYSTACK_CAPTURE_BY_DIGEST(ctx, ts, key) whose digest user space has confirmed (pystack_known: it
 * holds the stack under that digest, recorder/core/stacks.py) sends no record: the digest goes to
 * PYSTACK_DIGEST_SINK(key, ts, digest), which the caller defines before this text to store it in
 * its own in-flight record `key` (nonzero when stored; bpf/cuda_inflight.h), for its return
 * program to put in its event. A call repeating a known stack then costs no ring record and no
 * join in user space; any other capture sends its record as before, joined by (ts, pid, tid). */

/* Per-process walking recipe, filled by PyStackProbe.configure(). Offsets are bytes. */
struct pystack_proc {
    u64 runtime;            /* address of _PyRuntime in the target */
    u64 code_type;          /* address of PyCode_Type: frames whose code is not a code are skipped */
    u32 status;             /* PYSTACK_OK, or PYSTACK_UNSUPPORTED to emit status records only */
    u32 flags;              /* PYSTACK_F_* */
    u32 fsbase;             /* task_struct.thread.fsbase, from the running kernel's BTF */
    u32 version;            /* PY_VERSION_HEX >> 16, e.g. 0x030c */
    u16 runtime_interpreters_head;
    u16 interp_next;
    u16 interp_threads_head;
    u16 tstate_next;
    u16 tstate_thread_id;
    u16 tstate_frame;       /* frame, cframe or current_frame */
    u16 cframe_current_frame;
    u16 frame_code;
    u16 frame_back;
    u16 frame_instr;
    u16 frame_owner;        /* 0: no owner field (3.10) */
    u16 code_firstlineno;
    u16 code_version;       /* 0: no co_version (before 3.12) */
    u16 code_name;
    u16 str_hash;
    u16 code_filename;      /* co_filename: its address is mixed into the checksum */
    u32 generation;         /* per configuration: a new process image's cached code never matches */
    u32 pad2;
};

struct pystack_code_slot {
    u64 code;
    u32 pid;
    u32 generation;
    u32 checksum;
    u32 tag;
};

/* One per CPU: the record being built, and the recipe copied once so walker steps need no hash
 * lookup. Tail calls stay on the CPU; `owner` catches another task reusing it after preemption. */
struct pystack_scratch {
    struct pystack_event ev;
    struct pystack_proc cfg;
    u64 frame;              /* next frame to read */
    u64 fsbase;             /* this thread's fs base: tstate->thread_id to look for */
    u64 interp;             /* interpreter whose thread list is scanned next */
    u32 interps;            /* interpreters scanned so far */
    u32 unbound;            /* the scan met a thread state without its thread yet */
    u64 owner;              /* pid_tgid that filled this scratch */
    u64 digest;             /* hash of the frames walked so far */
    u64 sink_key;           /* PYSTACK_CAPTURE_BY_DIGEST: the caller's in-flight record */
    u32 by_digest;          /* ... to which a known stack sends its digest instead of a record */
    u32 hashing;            /* the walk uses a recipe: its result gets a digest */
    /* Frame heads are read through a window of user memory: 3.11+ allocates a thread's frames one
     * above the other in its data stack, so the callers of the top frame are the bytes below it
     * and one read of PYSTACK_WINDOW bytes holds several frames (each frame head alone is one
     * read of 104 bytes otherwise, as for 3.10's heap frames and generators' frames). Valid:
     * [win_lo, win_hi), at win[address - win_base]. */
    u64 win_base;
    u64 win_lo;
    u64 win_hi;
    u8 win[PYSTACK_WINDOW + 128];
    u8 cbuf[136];           /* head of its code object */
    /* Code objects already read in this walk (direct-mapped by address) and their checksums: a
     * frame holds a strong reference to its code object, so while the thread is stopped in the
     * probe an address seen earlier in the same stack is the same code object. Recursion and the
     * wrappers every nesting level repeats (a framework's __call__) cost one read, not two or three. */
    u64 seen_code[PYSTACK_SEEN_SLOTS];
    u32 seen_sum[PYSTACK_SEEN_SLOTS];
};

#ifndef PYSTACK_LAYOUT_ONLY
#ifndef SESSION_TABLE /* compiled without bpf/common.h (tests, benchmarks): every map the object's own */
#define SESSION_TABLE(_type, _key, _leaf, _name, _size) BPF_TABLE(_type, _key, _leaf, _name, _size)
#endif
/* The records, the per-CPU scratch and the counts are each BPF object's own: a later object of the
 * session (the on-CPU profile's, BPF_SECONDARY: bpf/common.h) interrupts this one's walks on the
 * same CPU (a perf event's interrupt in the middle of a uprobe's walk, which only disables
 * migration), so it must not build its records in the scratch a walk of the session's is using,
 * and the records it sends are read from a ring of its own (a sample's loss is no event's, and
 * PYSTACK_RING_FULL() counts it as the object's). Everything it reads (the recipes, the thread
 * states, the code objects' checksums) is the session's, shared. */
BPF_RINGBUF_OUTPUT(pystacks, PYSTACK_RINGBUF_PAGES);
SESSION_TABLE("hash", u32, struct pystack_proc, pystack_procs, 4096);
/* tid -> PyThreadState, re-validated on use */
SESSION_TABLE("lru_hash", u32, u64, pystack_tstates, 16384);
/* Threads found to have no PyThreadState (a native library's workers: OpenMP, BLAS, a CUDA
 * runtime's): their walk ends after two reads, instead of scanning every thread state of the
 * process at each capture, while the interpreter's list of thread states has the same head (a new
 * thread state, e.g. a native thread's PyGILState_Ensure, is put at the head) and for at most
 * PYSTACK_NO_TSTATE_NS. Not remembered when the scan met a thread state not yet bound to its
 * thread (a Python thread starting: thread_id 0 on 3.12+, its creator's id on 3.10 and 3.11) or
 * more than one interpreter. */
struct pystack_no_tstate {
    u64 ts;         /* when the scan found none */
    u64 head;       /* the main interpreter's first thread state then */
    u32 pid;
    u32 generation; /* the process's recipe then: an exec starts over */
};
#define PYSTACK_NO_TSTATE_NS 1000000000ull
SESSION_TABLE("lru_hash", u32, struct pystack_no_tstate, pystack_no_tstates, 16384);
BPF_PERCPU_ARRAY(pystack_scratch, struct pystack_scratch, 1);
BPF_PERCPU_ARRAY(pystack_counts, u64, PYSTACK_COUNT_SLOTS);
SESSION_TABLE("array", int, struct pystack_code_slot, pystack_code_cache, PYSTACK_CODE_SLOTS);
SESSION_TABLE("lru_hash", u64, u32, pystack_known, 65536);  /* digests user space has confirmed */
SESSION_TABLE("prog", u32, u32, pystack_progs, 3);    /* the walker as kprobe programs: uprobes tail-call these */
SESSION_TABLE("prog", u32, u32, pystack_tp_progs, 3); /* the same walker as tracepoint programs */
#ifdef BPF_SECONDARY
BPF_PROG_ARRAY(pystack_pe_progs, 3); /* ... and as perf event programs (the on-CPU profile's object) */
#endif

/* Per thread: the key (capture ts) of its latest tracepoint capture and the syscall it was made in.
 * Inside one syscall no Python code runs, so the stack cannot change: the events of a syscall (its
 * I/O intent, the bios it queues, each time it blocks) share one capture. */
struct pystack_last {
    u64 epoch;  /* entry time of the syscall the capture was made in */
    u64 key;    /* the capture's ts: pystack_event.ts of its record */
};
SESSION_TABLE("lru_hash", u32, struct pystack_last, pystack_last, 16384);

static __always_inline void pystack_count(u32 slot)
{
    u64 *v = pystack_counts.lookup(&slot);
    if (v)
        (*v)++;
}

static __always_inline void pystack_submit(struct pystack_scratch *st, u32 status)
{
    /* a preemptible kernel can run another capture on this CPU in the middle of a walker program
     * (BPF programs only disable migration there): then the record is not this thread's any more */
    if (st->owner != bpf_get_current_pid_tgid()) {
        pystack_count(PYSTACK_COUNT_CLOBBERED);
        return;
    }
    u32 n = st->ev.nframes;
    if (n > PYSTACK_MAX_FRAMES)
        n = PYSTACK_MAX_FRAMES;
    st->ev.status = status;
    if (status < PYSTACK_STATUS_COUNT)
        pystack_count(status);
    u64 d = 0;
    if (st->hashing) {
        d = st->digest ^ ((u64)status << 56) ^ ((u64)n << 48);
        d ^= ((u64)st->ev.pid << 32 | st->cfg.generation) * 0x9E3779B97F4A7C15ull;
        d ^= d >> 33; /* murmur3's finaliser */
        d *= 0xFF51AFD7ED558CCDull;
        d ^= d >> 33;
        d *= 0xC4CEB9FE1A85EC53ull;
        d ^= d >> 33;
        d = (d & 0x7FFFFFFFFFFFFFFFull) | 1; /* never 0, and a signed 64-bit integer */
    }
    st->ev.digest = d;
#ifdef PYSTACK_DIGEST_SINK
    if (d && st->by_digest && pystack_known.lookup(&d) &&
        PYSTACK_DIGEST_SINK(st->sink_key, st->ev.ts, d)) {
        pystack_count(PYSTACK_COUNT_BY_DIGEST);
        return;
    }
#endif
    /* only the frames filled in: a 5-frame stack costs 144 bytes, not the whole array */
    u64 size = sizeof(struct pystack_event) - sizeof(st->ev.frames) + n * sizeof(struct pystack_frame);
    if (pystacks.ringbuf_output(&st->ev, size, PYSTACK_RB_FLAGS) != 0) {
#ifdef PYSTACK_RING_FULL
        PYSTACK_RING_FULL();
#else
        pystack_count(PYSTACK_COUNT_RINGBUF_FULL);
#endif
    }
}

/* End the walk on a failed read of `addr` while reading `what` (PYSTACK_FAILED_*): the entry that
 * says where goes after the frames read so far (always room: a walk stops at PYSTACK_MAX_FRAMES
 * frames before reading another). */
static __always_inline void pystack_fail(struct pystack_scratch *st, u32 what, u64 addr)
{
    u32 n = st->ev.nframes;
    if (n < PYSTACK_MAX_FRAMES) {
        struct pystack_frame *f = &st->ev.frames[n & (PYSTACK_MAX_FRAMES - 1)];
        f->code = addr;
        f->instr = 0;
        f->checksum = 0;
        f->pad = PYSTACK_FRAME_FAILED | what << 8;
        st->ev.nframes = n + 1;
    }
    pystack_submit(st, PYSTACK_READ_ERROR);
}

static __always_inline struct pystack_scratch *pystack_own_scratch(void)
{
    u32 zero = 0;
    struct pystack_scratch *st = pystack_scratch.lookup(&zero);
    if (!st)
        return 0;
    if (st->owner != bpf_get_current_pid_tgid()) {
        pystack_count(PYSTACK_COUNT_CLOBBERED);
        return 0;
    }
    return st;
}

/* Continue in walker program `slot` of the caller's flavour (tp: 1 tracepoint, 2 perf event, 0
 * kprobe); returns only when the tail call failed. `tp` is a constant after inlining, so each
 * flavour references only its own program array (the kernel refuses a program array shared by two
 * program types). */
static __always_inline void pystack_next(void *ctx, int tp, u32 slot)
{
#ifdef BPF_SECONDARY
    if (tp == 2)
        pystack_pe_progs.call(ctx, slot);
    else
#endif
    if (tp)
        pystack_tp_progs.call(ctx, slot);
    else
        pystack_progs.call(ctx, slot);
}

/* The capture's start: this CPU's scratch, owned by the current thread, set for a capture at `ts`
 * (0 when there is no scratch). A caller that runs programs of its own before the walker's (the
 * CUDA entries' native stack walk, bpf/cuda.bpf.c) starts with this and ends with
 * pystack_continue(). */
static __always_inline struct pystack_scratch *pystack_begin(u64 ts, int by_digest, u64 sink_key)
{
    u32 zero = 0;
    struct pystack_scratch *st = pystack_scratch.lookup(&zero);
    if (!st)
        return 0;
    u64 id = bpf_get_current_pid_tgid();
    st->owner = id;
    st->ev.ts = ts;
    st->ev.pid = id >> 32;
    st->ev.tid = (u32)id;
    st->ev.nframes = 0;
    st->ev.status = PYSTACK_OK;
    st->digest = 0;
    st->hashing = 0;
    st->by_digest = by_digest;
    st->sink_key = sink_key;
    return st;
}

/* Walk the Python stack of the capture `st` begun (ends the calling program when installed). */
static __always_inline int pystack_continue(void *ctx, struct pystack_scratch *st, int tp)
{
    pystack_next(ctx, tp, PYSTACK_PROG_FIND);
    /* reached only when the tail call failed */
    pystack_submit(st, PYSTACK_NOT_INSTALLED);
    return 0;
}

static __always_inline int pystack_capture(void *ctx, u64 ts, int tp, int by_digest, u64 sink_key)
{
    struct pystack_scratch *st = pystack_begin(ts, by_digest, sink_key);
    return st ? pystack_continue(ctx, st, tp) : 0;
}

/* End the calling probe: nothing after them runs when the walker is installed. */
#define PYSTACK_CAPTURE(ctx, ts) return pystack_capture((ctx), (ts), 0, 0, 0)
#define PYSTACK_CAPTURE_TP(ctx, ts) return pystack_capture((ctx), (ts), 1, 0, 0)
/* perf event programs (a sample of the on-CPU profile: the interrupted thread is the current one) */
#define PYSTACK_CAPTURE_PE(ctx, ts) return pystack_capture((ctx), (ts), 2, 0, 0)
#ifdef PYSTACK_DIGEST_SINK
/* A known stack's digest goes to the caller's in-flight record `key` (see pystack_event). */
#define PYSTACK_CAPTURE_BY_DIGEST(ctx, ts, key) return pystack_capture((ctx), (ts), 0, 1, (key))
#endif

/* For a tracepoint event of the current thread at `now`: the key of the Python stack it gets. That
 * is the capture already made in the same syscall (`epoch`: the syscall's entry time, 0 outside a
 * syscall, e.g. in a page fault), or a new one at `now`: then *fresh is set and the caller must end
 * with PYSTACK_CAPTURE_TP(ctx, now). */
static __always_inline u64 pystack_key(u64 epoch, u64 now, int *fresh)
{
    u32 tid = (u32)bpf_get_current_pid_tgid();
    struct pystack_last *last = pystack_last.lookup(&tid);
    if (epoch && last && last->epoch == epoch && last->key) {
        *fresh = 0;
        return last->key;
    }
    struct pystack_last now_last = {.epoch = epoch, .key = now};
    pystack_last.update(&tid, &now_last);
    *fresh = 1;
    return now;
}

static __always_inline u32 pystack_code_slot_of(u64 code, u32 pid)
{
    return (u32)((code >> 4) ^ (code >> 18) ^ pid) & (PYSTACK_CODE_SLOTS - 1);
}

static __always_inline u32 pystack_code_tag(u64 code, u32 pid, u32 generation, u32 checksum)
{
    u64 h = (code ^ ((u64)pid << 32 | generation)) * 0x9E3779B97F4A7C15ull;
    h ^= (u64)checksum * 0xC2B2AE3D27D4EB4Full;
    return (u32)(h >> 32) | 1; /* never 0: a cleared slot has tag 0 */
}

/* The code deallocator (PyCode_Type.tp_dealloc, attached by PyStackProbe.configure): the code
 * object in its first argument is being freed, so its address may be reused from now on. */
int pystack_code_freed(struct pt_regs *ctx)
{
    u64 code = PT_REGS_PARM1(ctx);
    u32 pid = bpf_get_current_pid_tgid() >> 32;
    u32 slot = pystack_code_slot_of(code, pid);
    struct pystack_code_slot *e = pystack_code_cache.lookup(&slot);
    if (e && e->code == code && e->pid == pid) {
        e->tag = 0;
        e->code = 0;
    }
    return 0;
}

static __always_inline u64 pystack_read_ptr(u64 addr, int *err)
{
    u64 v = 0;
    if (bpf_probe_read_user(&v, sizeof(v), (void *)addr) != 0)
        *err = 1;
    return v;
}

/* Read the thread's top frame into st->frame and continue with the walk. */
static __always_inline int pystack_start_walk(void *ctx, struct pystack_scratch *st, u64 tstate,
                                              int tp)
{
    struct pystack_proc *c = &st->cfg;
    int err = 0;
    u64 frame = pystack_read_ptr(tstate + c->tstate_frame, &err);
    if (err) {
        pystack_fail(st, PYSTACK_FAILED_STATE, tstate + c->tstate_frame);
        return 0;
    }
    if (frame && (c->flags & PYSTACK_F_CFRAME)) {
        u64 cframe = frame;
        frame = pystack_read_ptr(cframe + c->cframe_current_frame, &err);
        if (err) {
            pystack_fail(st, PYSTACK_FAILED_STATE, cframe + c->cframe_current_frame);
            return 0;
        }
    }
    st->frame = frame;
#pragma unroll
    for (int i = 0; i < PYSTACK_SEEN_SLOTS; i++)
        st->seen_code[i] = 0;
    st->win_lo = st->win_hi = 0;
    pystack_next(ctx, tp, PYSTACK_PROG_WALK);
    pystack_submit(st, PYSTACK_NOT_INSTALLED);
    return 0;
}

/* Slot PYSTACK_PROG_FIND: look up the recipe and the thread's cached PyThreadState. */
static __always_inline int pystack_find_body(void *ctx, int tp)
{
    struct pystack_scratch *st = pystack_own_scratch();
    if (!st)
        return 0;
    u32 pid = st->ev.pid, tid = st->ev.tid;
    struct pystack_proc *cfg = pystack_procs.lookup(&pid);
    if (!cfg) {
        pystack_submit(st, PYSTACK_NOT_CONFIGURED);
        return 0;
    }
    if (cfg->status != PYSTACK_OK) {
        st->cfg.generation = cfg->generation; /* the answer is the same at every call: a digest */
        st->hashing = 1;
        pystack_submit(st, PYSTACK_UNSUPPORTED);
        return 0;
    }
    __builtin_memcpy(&st->cfg, cfg, sizeof(st->cfg));
    struct pystack_proc *c = &st->cfg;
    st->hashing = 1;

    u64 fsbase = 0;
    /* a plain integer, not a struct pointer: no layout from the compile-time headers is used */
    u64 task = bpf_get_current_task();
    if (bpf_probe_read_kernel(&fsbase, sizeof(fsbase), (void *)(task + c->fsbase)) != 0) {
        pystack_fail(st, PYSTACK_FAILED_TASK, 0);
        return 0;
    }
    st->fsbase = fsbase;

    /* A cached tstate is trusted only while its thread_id still is this thread's. One that fails
     * (the thread exec'd: the state was the old image's, or it was freed) is forgotten, and its
     * failure is not the scan's: a walk that failed once must not fail at every capture after. */
    int err = 0;
    u64 *cached = pystack_tstates.lookup(&tid);
    if (cached && *cached) {
        if (pystack_read_ptr(*cached + c->tstate_thread_id, &err) == fsbase && !err)
            return pystack_start_walk(ctx, st, *cached, tp);
        pystack_tstates.delete(&tid);
        err = 0;
    }

    st->interp = pystack_read_ptr(c->runtime + c->runtime_interpreters_head, &err);
    st->interps = 0;
    st->unbound = 0;
    if (err || !st->interp) {
        pystack_fail(st, PYSTACK_FAILED_STATE, c->runtime + c->runtime_interpreters_head);
        return 0;
    }
    struct pystack_no_tstate *none = pystack_no_tstates.lookup(&tid);
    if (none && none->pid == pid && none->generation == c->generation &&
        bpf_ktime_get_ns() - none->ts < PYSTACK_NO_TSTATE_NS &&
        pystack_read_ptr(st->interp + c->interp_threads_head, &err) == none->head && !err) {
        pystack_submit(st, PYSTACK_NO_THREAD_STATE);
        return 0;
    }
    pystack_next(ctx, tp, PYSTACK_PROG_SCAN);
    pystack_submit(st, PYSTACK_NOT_INSTALLED);
    return 0;
}

/* Slot PYSTACK_PROG_SCAN: one interpreter's thread list per program (3.12+ can have several).
 * One loop per program keeps the verifier linear: a flat loop over (interpreter, thread) made it
 * explore every interleaving and give up at 1M instructions. */
static __always_inline int pystack_scan_body(void *ctx, int tp)
{
    struct pystack_scratch *st = pystack_own_scratch();
    if (!st)
        return 0;
    struct pystack_proc *c = &st->cfg;
    u64 fsbase = st->fsbase, interp = st->interp, found = 0;
    int err = 0;
    u64 at = interp + c->interp_threads_head; /* the address read last: where a failure was */
    u64 t = pystack_read_ptr(at, &err);
    u64 head = t, head_id = 0;
#pragma clang loop unroll(disable)
    for (int i = 0; i < PYSTACK_MAX_THREADS; i++) {
        if (!t || err)
            break;
        at = t + c->tstate_thread_id;
        u64 thread_id = pystack_read_ptr(at, &err);
        if (err)
            break;
        /* Not yet bound: 3.12+ leaves thread_id 0 until the new thread binds its state; 3.10 and
         * 3.11 give it the creating thread's id, so the new state (put at the head) has the id
         * of an older one further on. Until the new thread sets its own, a scan made in it
         * finds nothing, and one made in its creator would meet the new state first. */
        if (!thread_id || (i && thread_id == head_id))
            st->unbound = 1;
        if (!i)
            head_id = thread_id;
        if (thread_id == fsbase) {
            found = t;
            if (i) /* the head may be a state this thread made and has not handed over yet */
                break;
        }
        at = t + c->tstate_next;
        t = pystack_read_ptr(at, &err);
    }
    if (found) {
        u32 tid = st->ev.tid;
        pystack_tstates.update(&tid, &found);
        return pystack_start_walk(ctx, st, found, tp);
    }
    if (err) {
        pystack_fail(st, PYSTACK_FAILED_STATE, at);
        return 0;
    }
    st->interp = pystack_read_ptr(interp + c->interp_next, &err);
    if (!st->interp || err || ++st->interps >= PYSTACK_MAX_INTERPRETERS) {
        if (!err && !st->interp && st->interps == 0 && !st->unbound) { /* one interpreter */
            struct pystack_no_tstate none = {.ts = bpf_ktime_get_ns(), .head = head,
                                             .pid = st->ev.pid, .generation = c->generation};
            u32 tid = st->ev.tid;
            pystack_no_tstates.update(&tid, &none);
        }
        if (err)
            pystack_fail(st, PYSTACK_FAILED_STATE, interp + c->interp_next);
        else
            pystack_submit(st, PYSTACK_NO_THREAD_STATE);
        return 0;
    }
    pystack_next(ctx, tp, PYSTACK_PROG_SCAN);
    pystack_submit(st, PYSTACK_NOT_INSTALLED);
    return 0;
}

/* Slot PYSTACK_PROG_WALK: up to PYSTACK_FRAMES_PER_PROG frames, then itself again or submit. */
static __always_inline int pystack_walk_body(void *ctx, int tp)
{
    struct pystack_scratch *st = pystack_own_scratch();
    if (!st)
        return 0;
    struct pystack_proc *c = &st->cfg;
    u64 frame = st->frame;
#pragma clang loop unroll(disable)
    for (int i = 0; i < PYSTACK_FRAMES_PER_PROG; i++) {
        if (!frame) {
            pystack_submit(st, PYSTACK_OK);
            return 0;
        }
        u32 n = st->ev.nframes;
        if (n >= PYSTACK_MAX_FRAMES) {
            pystack_submit(st, PYSTACK_TRUNCATED);
            return 0;
        }
        /* the frame head: from the window when it is there, else one read (a window's worth
         * below it when the frame is in the data stack, near or below the last window) ... */
        if (frame < st->win_lo || frame + PYSTACK_FRAME_HEAD > st->win_hi) {
            u64 lo = frame, size = PYSTACK_FRAME_HEAD;
            if ((c->flags & PYSTACK_F_DATASTACK) && frame + PYSTACK_FRAME_HEAD > PYSTACK_WINDOW &&
                (!st->win_hi || (frame < st->win_lo && st->win_lo - frame < PYSTACK_NEAR))) {
                lo = frame + PYSTACK_FRAME_HEAD - PYSTACK_WINDOW;
                size = PYSTACK_WINDOW;
                if (bpf_probe_read_user(st->win, PYSTACK_WINDOW, (void *)lo) != 0) {
                    /* the data stack's first page: the page below may not be mapped */
                    lo = frame & ~4095ull;
                    if (lo + PYSTACK_WINDOW < frame + PYSTACK_FRAME_HEAD)
                        lo = frame + PYSTACK_FRAME_HEAD - PYSTACK_WINDOW;
                    size = frame + PYSTACK_FRAME_HEAD - lo;
                    if (size > PYSTACK_WINDOW)
                        size = PYSTACK_WINDOW;
                    if (bpf_probe_read_user(st->win, size, (void *)lo) != 0) {
                        pystack_fail(st, PYSTACK_FAILED_FRAME, frame);
                        return 0;
                    }
                }
            } else if (bpf_probe_read_user(st->win, PYSTACK_FRAME_HEAD, (void *)frame) != 0) {
                pystack_fail(st, PYSTACK_FAILED_FRAME, frame);
                return 0;
            }
            st->win_base = st->win_lo = lo;
            st->win_hi = lo + size;
        }
        u8 *fb = &st->win[(frame - st->win_base) & (PYSTACK_WINDOW - 1)];
        u64 back = *(u64 *)&fb[c->frame_back & 0x78];
        u64 code = *(u64 *)&fb[c->frame_code & 0x78];
        /* 3.12+: frames owned by the C stack (entry shims) are not Python frames */
        if (c->frame_owner && fb[c->frame_owner & 0x7f] == 3) {
            frame = back;
            continue;
        }
        u64 instr;
        if (c->flags & PYSTACK_F_LASTI_INT)
            instr = *(u32 *)&fb[c->frame_instr & 0x7c];
        else
            instr = *(u64 *)&fb[c->frame_instr & 0x78];
        if (!code) {
            pystack_fail(st, PYSTACK_FAILED_CODE, frame);
            return 0;
        }
        u32 slot = ((code >> 4) ^ (code >> 10)) & (PYSTACK_SEEN_SLOTS - 1);
        u32 sum = 0, unread = 0;
        int cached = 0;
        struct pystack_code_slot *known = 0;
        if (st->seen_code[slot] == code) {
            sum = st->seen_sum[slot];
            cached = 1;
        } else if (c->flags & PYSTACK_F_CODE_CACHE) {
            u32 k = pystack_code_slot_of(code, st->ev.pid);
            known = pystack_code_cache.lookup(&k);
            if (known && known->code == code && known->pid == st->ev.pid &&
                known->generation == c->generation) {
                u32 ks = known->checksum;
                if (known->tag == pystack_code_tag(code, st->ev.pid, c->generation, ks)) {
                    sum = ks;
                    cached = 1;
                    st->seen_code[slot] = code;
                    st->seen_sum[slot] = sum;
                }
            }
        }
        if (!cached) {
            /* ... and one for the code object head (type, firstlineno, co_version, co_name); a
             * head whose page is not resident is read back by user space (see above) */
            if (bpf_probe_read_user(st->cbuf, 128, (void *)code) != 0)
                unread = 1;
            else if (*(u64 *)&st->cbuf[8] != c->code_type) {
                frame = back;    /* e.g. 3.13's None executable in shim frames */
                continue;
            }
        }
        if (!cached && !unread) {
            u32 firstlineno = *(u32 *)&st->cbuf[c->code_firstlineno & 0x7c];
            sum = firstlineno * 0x9E3779B1u;
            if (c->code_version)
                sum ^= *(u32 *)&st->cbuf[c->code_version & 0x7c];
            if (c->flags & PYSTACK_F_NAME_HASH) {
                /* no co_version before 3.12: the interned name's cached hash tells code apart */
                u64 name = *(u64 *)&st->cbuf[c->code_name & 0x78];
                u64 hash = 0;
                bpf_probe_read_user(&hash, sizeof(hash), (void *)(name + c->str_hash));
                sum ^= (u32)hash ^ (u32)(hash >> 32);
            }
            /* the file's str: two module bodies (first line 1, name '<module>', same name hash on
             * 3.10/3.11) differ by it, e.g. a .pth line site exec'd and freed at start-up and the
             * script's own module code the allocator then puts at the same address */
            u64 filename = *(u64 *)&st->cbuf[c->code_filename & 0x78];
            sum ^= (u32)(filename >> 3) ^ (u32)(filename >> 35);
            st->seen_code[slot] = code;
            st->seen_sum[slot] = sum;
            if (known) {
                known->tag = 0;
                known->code = code;
                known->pid = st->ev.pid;
                known->generation = c->generation;
                known->checksum = sum;
                known->tag = pystack_code_tag(code, st->ev.pid, c->generation, sum);
            }
        }
        struct pystack_frame *f = &st->ev.frames[n & (PYSTACK_MAX_FRAMES - 1)];
        f->code = code;
        f->instr = instr;
        f->checksum = sum;
        f->pad = unread ? PYSTACK_FRAME_CODE_UNREAD : 0;
        u64 d = (st->digest ^ code) * 0x100000001B3ull;
        d = (d ^ instr) * 0x100000001B3ull;
        st->digest = (d ^ sum) * 0x9E3779B97F4A7C15ull;
        st->ev.nframes = n + 1;
        frame = back;
    }
    st->frame = frame;  /* the next program goes on with the same window and code objects */
    pystack_next(ctx, tp, PYSTACK_PROG_WALK);
    /* out of tail calls (never at 64 frames) */
    pystack_submit(st, PYSTACK_TRUNCATED);
    return 0;
}

/* The walker programs, per flavour (recorder/core/pyframes.py PyStackProbe.install loads and wires them) */
int pystack_find(struct pt_regs *ctx) { return pystack_find_body(ctx, 0); }
int pystack_scan(struct pt_regs *ctx) { return pystack_scan_body(ctx, 0); }
int pystack_walk(struct pt_regs *ctx) { return pystack_walk_body(ctx, 0); }
int pystack_tp_find(void *ctx) { return pystack_find_body(ctx, 1); }
int pystack_tp_scan(void *ctx) { return pystack_scan_body(ctx, 1); }
int pystack_tp_walk(void *ctx) { return pystack_walk_body(ctx, 1); }
/* the perf event copy (pystack_pe_*) is defined by its one user, the on-CPU profile
 * (recorder/layers/profile/profile.bpf.c): a session without the profile compiles no copy of it */

#endif /* PYSTACK_LAYOUT_ONLY */
#endif /* PYSTACK_H */
