/* cuda: CUDA runtime and driver calls, one event per call with its duration and arguments.
 *
 * The entry program (generated per API by recorder/layers/cuda/apis.py) reads the arguments into an
 * in-flight record keyed by thread and API; the return program adds the return code and, for
 * allocations, the pointer the call wrote, and sends one cuda_event stamped with the entry time.
 * The entry ends with cuda_capture(): a tail call to cuda_native, which walks the native user stack
 * (native_walk below) into the in-flight record's native_digest and goes on to capture the Python
 * stack (bpf/pystack.h): one pystacks record keyed by the same (entry ts, pid, tid), or for a stack
 * user space already holds no record but its digest, which the return program puts in the event
 * (py_digest).
 *
 * One call, one event: the runtime calls the driver's exported API (cudaLaunchKernel calls
 * cuLaunchKernel, cudaStreamSynchronize cuStreamSynchronize, ...). A runtime call marks its thread
 * in cuda_outer; a driver call made inside it sends nothing of its own and leaves its API index in
 * the runtime call's record (driver_api). Driver calls made directly (cuBLAS, cuDNN, Triton) are
 * events of their own.
 *
 * Kernel launches (and graph launches) are a job's most frequent calls and a fast one is never a
 * stall, so their stacks are taken at the return, and only for a launch that took
 * CUDA_LATE_STACK_NS or more or that is drawn as a sample (one in CUDA_STACK_SAMPLE_MASK + 1): a
 * thread is still inside the call at its return, so its Python stack is the entry's, and its native
 * stack is the entry's from the caller up. Every launch is an event; the others carry
 * CUDA_FLAG_NO_STACK. All launch APIs share one record slot per thread (CUDA_LAUNCH_SLOT: the API
 * is in the record) and one return program, cuda_launch_return.
 *
 * That is with STALL_RECORDER_LAUNCH_ROWS=1 (--launch-rows). By default a launch has an entry probe
 * only, one trap: its entry counts it in its thread's tally (bpf/cuda_inflight.h, cuda_count_launch
 * below) and draws one in CUDA_STACK_SAMPLE_MASK + 1 as a sample, an event of its own (dur 0,
 * CUDA_FLAG_SAMPLE) with its native and Python stacks taken at the entry (cuda_launch_sample).
 * A driver launch inside a runtime launch is counted as that runtime launch: its stack pointer is
 * below the runtime launch's entry's, and it is the first driver launch since.
 *
 * Every runtime launch calls a driver launch, and each probe pair costs two traps on the launching
 * thread: once the first runtime launches all went through the driver's probes, user space detaches
 * the runtime's launch probes (recorder/layers/cuda/layer.py) and the driver's events are the
 * launches' rows.
 */
/* struct cuda_inflight and its map: bpf/cuda_inflight.h (pasted before bpf/pystack.h) */
#define CUDA_RING_PAGES 2048
BPF_RINGBUF_OUTPUT(cuda_events, CUDA_RING_PAGES);

/* Native user stacks at a call's entry, walked here by frame pointers rather than by
 * bpf_get_stackid(): the kernel's walk and stack-map insert cost ~0.65 us even for a two-frame
 * stack (most of it in faulting on the garbage a frame-pointer-less caller leaves in %rbp), this
 * walk ~0.12 us, and ~0.5 us for 24 small frames (the kernel's: 1.4-1.8 us; docs/benchmarks.md,
 * (a)).
 *
 * The frames are the kernel's walk's: the probed address, the return address at the stack pointer
 * (a probe at a function's entry runs before its prologue, so the caller has no frame record yet;
 * the kernel adds it only at a `push %rbp` or `endbr64` entry), then the return address of each
 * (saved frame pointer, return address) pair along the chain from %rbp. Unlike the kernel's, the
 * walk stops at a frame pointer that is not above the previous one, not within NATIVE_STACK_SPAN
 * above the stack pointer or not 8-aligned, and at a return address inside that span: code built
 * without frame pointers leaves other values in %rbp, and reading one would fault (slow) or walk
 * into garbage.
 * The frames are hashed with the pid into a digest (never 0) under which native_stacks holds
 * them; a stack already there costs one lookup. recorder/core/stacks.py reads a digest's frames once
 * per process and symbolises them. */
#define NATIVE_MAX_FRAMES 127             /* the kernel's perf_event_max_stack default */
#define NATIVE_STACK_SPAN (8ull << 20)    /* a thread stack's default size */
#define NATIVE_WINDOW 2048                /* stack copied at once: a power of two, <= a page */
struct native_stack {
    u32 frames;
    u32 pad;
    u64 ip[NATIVE_MAX_FRAMES];
};
struct native_scratch_t {
    struct native_stack stack;
    u32 owner; /* the thread walking into it */
    u32 pad;
    u8 window[NATIVE_WINDOW]; /* a copy of one NATIVE_WINDOW-aligned block of the stack */
};
BPF_PERCPU_ARRAY(native_scratch, struct native_scratch_t, 1);
BPF_TABLE("lru_hash", u64, struct native_stack, native_stacks, 16384);

static __always_inline u64 native_mix(u64 d, u64 v)
{
    d = (d ^ v) * 0x9E3779B97F4A7C15ull;
    return d ^ (d >> 29);
}

/* Digest of the calling thread's native stack, 0 when not even the return address is readable.
 * A frame record is read from the scratch window, a copy of the NATIVE_WINDOW-aligned block of
 * stack that holds it (refilled when the walk leaves the block; an aligned block lies within one
 * page, so its read cannot fault where a 16-byte read at the frame pointer would not): frames lie
 * one above the other, so one read holds several (24 small frames: ~0.5 us instead of 1.1-1.4 us
 * one by one). A record across a block's end is read alone. A stack that ends at the caller (%rbp no
 * frame pointer) costs one 8-byte read. */
static __always_inline u64 native_walk(struct pt_regs *ctx, u64 ip, u64 ret)
{
    int zero = 0;
    struct native_scratch_t *sc = native_scratch.lookup(&zero);
    if (!sc)
        return 0;
    struct native_stack *s = &sc->stack;
    u64 id = bpf_get_current_pid_tgid();
    u64 sp = PT_REGS_SP(ctx), fp = PT_REGS_FP(ctx), floor = sp;
    sc->owner = (u32)id;
    s->ip[0] = ip;
    s->ip[1] = ret;
    u64 d = native_mix(native_mix(id >> 32, s->ip[0]), ret);
    u64 block = 0; /* the window holds the block at this address (0: none yet) */
    u32 n = 2;
    for (int i = 2; i < NATIVE_MAX_FRAMES; i++) {
        if (fp <= floor || fp - sp >= NATIVE_STACK_SPAN || (fp & 7))
            break;
        u64 frame[2]; /* saved frame pointer, return address */
        u64 off = fp & (NATIVE_WINDOW - 1);
        if (off > NATIVE_WINDOW - sizeof(frame)) {
            if (bpf_probe_read_user(frame, sizeof(frame), (void *)fp))
                break;
        } else {
            if (fp - off != block) {
                if (bpf_probe_read_user(sc->window, NATIVE_WINDOW, (void *)(fp - off)))
                    break;
                block = fp - off;
            }
            frame[0] = *(u64 *)(sc->window + off);
            frame[1] = *(u64 *)(sc->window + off + 8);
        }
        /* no return address is below a page or inside the stack: code that keeps %rbp for
         * something else (libffi's ffi_call_unix64 points it at its own frame record, whose second
         * word is a stack address) ends the walk there instead of adding a frame of garbage */
        if (frame[1] < 4096 || frame[1] - sp < NATIVE_STACK_SPAN)
            break;
        s->ip[i] = frame[1];
        d = native_mix(d, frame[1]);
        n = i + 1;
        floor = fp;
        fp = frame[0];
    }
    s->frames = n;
    d = native_mix(d, n) & 0x7FFFFFFFFFFFFFFFull; /* 63 bits (a SQLite integer), never 0 */
    d = d ? d : 1;
    if (native_stacks.lookup(&d))
        return d;
    /* a thread preempted inside this program and another that used this CPU's scratch meanwhile:
     * the frames are not this walk's, so they are not stored under its digest */
    if (sc->owner != (u32)id)
        return 0;
    s->pad = 0;
    native_stacks.update(&d, s); /* if it fails, user space counts a call without its stack */
    return d;
}

/* The walk is a program of its own, tail-called by every entry (cuda_capture): the verifier then
 * checks its loop once per session, not once per API (inlined, it added ~12 ms to each, and a
 * runtime and a driver library export ~100 traced APIs between them). Installed by
 * recorder/core/loader.py. */
BPF_PROG_ARRAY(cuda_progs, 2);
#define CUDA_PROG_NATIVE 0
#define CUDA_PROG_SAMPLE 1 /* cuda_launch_sample, below */

int cuda_native(struct pt_regs *ctx)
{
    struct pystack_scratch *st = pystack_own_scratch();
    if (!st)
        return 0;
    /* at a function's entry the return address is the word at the stack pointer */
    u64 ret = 0, digest = 0;
    if (bpf_probe_read_user(&ret, sizeof(ret), (void *)PT_REGS_SP(ctx)) == 0)
        digest = native_walk(ctx, PT_REGS_IP(ctx), ret);
    struct cuda_inflight *in = cuda_inflight_at(st->sink_key, st->ev.ts);
    if (in)
        in->native_digest = digest;
    return pystack_continue(ctx, st, 0);
}

/* Ends an entry, after cuda_save(): the native stack walk, then the Python stack capture (whose
 * digest, for a stack user space holds, goes to the same in-flight record, made at `ts`). */
static __always_inline int cuda_capture(struct pt_regs *ctx, u64 ts, u32 api)
{
    struct pystack_scratch *st = pystack_begin(ts, 1, cuda_key(api));
    if (!st)
        return 0;
    cuda_progs.call(ctx, CUDA_PROG_NATIVE);
    /* reached only when the walk is not installed: the call keeps no native stack */
    return pystack_continue(ctx, st, 0);
}

/* One program per API only notes which API it is and its argument layout, and tail-calls the body
 * of its kind of API (launch or not, runtime or driver; recorder/layers/cuda/apis.py generates
 * both), which reads the arguments by the layout: LLVM compiles 6 bodies instead of ~340 inlined
 * copies (most of a session's start-up CPU) and the verifier checks each body once. The note is per
 * CPU, with its thread: a body whose note another thread overwrote in between records nothing and
 * counts it. */
struct cuda_note {
    u64 owner;  /* pid_tgid of the thread the note is for */
    u32 api;
    u32 layout; /* apis.py LAYOUT_INDEX */
};
BPF_PERCPU_ARRAY(cuda_notes, struct cuda_note, 1);
#define CUDA_BODY_SLOTS 64 /* apis.py CUDA_BODY_SLOTS */
BPF_PROG_ARRAY(cuda_bodies, CUDA_BODY_SLOTS);

static __always_inline int cuda_dispatch(struct pt_regs *ctx, u32 api, u32 body, u32 layout)
{
    u32 zero = 0;
    struct cuda_note *n = cuda_notes.lookup(&zero);
    if (!n)
        return 0;
    n->owner = bpf_get_current_pid_tgid();
    n->api = api;
    n->layout = layout;
    cuda_bodies.call(ctx, body);
    return 0; /* the body is not installed: the capability table says why */
}

/* The API the program that tail-called this body noted (and its layout, in *layout), or -1 when the
 * note is another thread's. */
static __always_inline s64 cuda_noted_api(u32 *layout)
{
    u32 zero = 0;
    struct cuda_note *n = cuda_notes.lookup(&zero);
    if (!n)
        return -1;
    if (n->owner != bpf_get_current_pid_tgid()) {
        count_drop(PROBE_CUDA_DISPATCH);
        return -1;
    }
    *layout = n->layout;
    return n->api;
}

/* tid -> key of the runtime call the thread is in (a driver call inside it is part of it) */
BPF_TABLE("lru_hash", u32, u64, cuda_outer, 65536);
#define CUDA_LAUNCH_SLOT 0xFFFFu /* the in-flight key's API part for launches: the API is in the record */

static __always_inline int cuda_begin(struct cuda_inflight *e, u32 api)
{
    u64 id = bpf_get_current_pid_tgid();
    if (!is_target(id >> 32))
        return 0;
    e->ts = bpf_ktime_get_ns();
    e->cgroup_id = bpf_get_current_cgroup_id();
    e->driver_api = CUDA_NO_API;
    return 1;
}

/* A driver call inside a runtime call of the same thread: noted in the runtime call's record (the
 * first one it made), nothing of its own. A driver launch is inside a runtime launch when the
 * thread's launch record is a runtime API's (index below `first_driver`) and the stack pointer is
 * below that launch's entry; any driver call is inside the runtime call cuda_outer names. */
static __always_inline int cuda_nested(struct pt_regs *ctx, u32 api, int launch, u32 first_driver)
{
    u64 id = bpf_get_current_pid_tgid();
    if (launch) {
        u64 slot = (id << 32) | CUDA_LAUNCH_SLOT;
        struct cuda_inflight *in = cuda_inflight.lookup(&slot);
        if (in && in->ts && in->api < first_driver && PT_REGS_SP(ctx) < in->entry_sp &&
            in->entry_sp - PT_REGS_SP(ctx) < NATIVE_STACK_SPAN) {
            if (in->driver_api == CUDA_NO_API)
                in->driver_api = api;
            return 1;
        }
    }
    u32 tid = (u32)id;
    u64 *outer = cuda_outer.lookup(&tid);
    if (!outer)
        return 0;
    struct cuda_inflight *in = cuda_inflight.lookup(outer);
    if (!in) { /* its return was not seen (the thread left it another way): no longer inside */
        cuda_outer.delete(&tid);
        return 0;
    }
    if (in->driver_api == CUDA_NO_API)
        in->driver_api = api;
    return 1;
}

/* Not the last statement of an entry: the generated entry ends with cuda_capture(), or for a launch
 * returns (its stacks are taken at its return). `runtime`: a driver call inside is part of this one
 * (a runtime launch is found by its launch record, see cuda_nested(); other calls by cuda_outer). */
static __always_inline void cuda_save(struct cuda_inflight *e, u32 api, int launch, int runtime)
{
    u64 key = launch ? cuda_key(CUDA_LAUNCH_SLOT) : cuda_key(api);
    e->api = api;
    if (launch) {
        /* a thread's launch record stays in the map between launches (ts 0: none in flight) and
         * is written in place: a hash map's update and delete cost more than the launch's probe */
        struct cuda_inflight *in = cuda_inflight.lookup(&key);
        if (in) {
            __builtin_memcpy(in, e, sizeof(*e));
            return;
        }
    }
    if (cuda_inflight.update(&key, e)) {
        count_drop(PROBE_CUDA_MAP);
        return;
    }
    if (runtime && !launch) {
        u32 tid = (u32)bpf_get_current_pid_tgid();
        cuda_outer.update(&tid, &key);
    }
}

/* The runtime call with record `key` ended: its thread is no longer inside it. */
static __always_inline void cuda_leave(u64 key)
{
    u32 tid = (u32)bpf_get_current_pid_tgid();
    u64 *outer = cuda_outer.lookup(&tid);
    if (outer && *outer == key)
        cuda_outer.delete(&tid);
}

static __always_inline void cuda_emit(struct pt_regs *ctx, struct cuda_inflight *in, u32 api, s64 ret,
                                      u64 dur, u32 flags)
{
    u64 id = bpf_get_current_pid_tgid();
    struct cuda_event *e = cuda_events.ringbuf_reserve(sizeof(struct cuda_event));
    if (!e) {
        count_drop(PROBE_CUDA);
        return;
    }
    e->ts = in->ts;
    e->dur = dur;
    e->cgroup_id = in->cgroup_id;
    e->ret = ret;
    e->size = in->size;
    e->stream = in->stream;
    e->function = in->function;
    e->pointer = in->pointer;
    e->handle = in->handle;
    e->pid = id >> 32;
    e->tid = (u32)id;
    e->api = api;
    e->memcpy_kind = in->memcpy_kind;
    e->grid_x = in->grid_x;
    e->grid_y = in->grid_y;
    e->grid_z = in->grid_z;
    e->block_x = in->block_x;
    e->block_y = in->block_y;
    e->block_z = in->block_z;
    e->shared_mem = in->shared_mem;
    e->flags = flags;
    e->driver_api = in->driver_api;
    e->reserved = 0;
    e->native_digest = in->native_digest;
    e->py_digest = in->py_digest;
    if (in->out_ptr) {
        u64 p = 0;
        if (bpf_probe_read_user(&p, sizeof(p), (void *)in->out_ptr) == 0)
            e->pointer = p;
        else
            e->flags |= CUDA_FLAG_POINTER_UNREAD;
    }
    cuda_events.ringbuf_submit(e, ring_wakeup_flags(RING_CUDA, RING_QUIET(CUDA_RING_PAGES, sizeof(*e))));
}

static __always_inline int cuda_end(struct pt_regs *ctx, u32 api, int runtime)
{
    u64 key = cuda_key(api);
    struct cuda_inflight *in = cuda_inflight.lookup(&key);
    if (!in)
        return 0;
    cuda_emit(ctx, in, api, (s64)(s32)PT_REGS_RC(ctx), bpf_ktime_get_ns() - in->ts, 0);
    cuda_inflight.delete(&key);
    if (runtime)
        cuda_leave(key);
    return 0;
}

/* Per process: runtime launches returned and, of those, the ones seen going through a driver launch
 * probe. User space stops probing a runtime library's launches once those of the processes that
 * map it all do (recorder/layers/cuda/layer.py LaunchRoute); counted only while a runtime library's
 * launch probes are attached. */
struct cuda_route_count {
    u64 launches;
    u64 through;
};
BPF_TABLE("lru_hash", u32, struct cuda_route_count, cuda_launch_route, 4096);

/* Per process, a runtime launch in cuda_launch_route: through a driver launch probe (through) or
 * not. At its return with per-launch rows; with counts (no return probe), once the thread's driver
 * launch or next runtime launch says which. */
static __always_inline void cuda_route_count(u32 tgid, int through)
{
    struct cuda_route_count *n = cuda_launch_route.lookup(&tgid);
    if (!n) {
        struct cuda_route_count zero = {};
        cuda_launch_route.update(&tgid, &zero);
        n = cuda_launch_route.lookup(&tgid);
    }
    if (n) {
        __sync_fetch_and_add(&n->launches, 1);
        if (through)
            __sync_fetch_and_add(&n->through, 1);
    }
}

/* The return of every launch API (cuda_launch_return, generated with `first_driver`): one event;
 * the stacks of a slow or sampled launch, walked here (the native one inline, then the Python one
 * keyed by the call's entry ts, as an entry's). */
static __always_inline int cuda_launch_end(struct pt_regs *ctx, u32 first_driver)
{
    u64 key = cuda_key(CUDA_LAUNCH_SLOT);
    struct cuda_inflight *in = cuda_inflight.lookup(&key);
    if (!in || !in->ts)
        return 0;
    u64 sp = PT_REGS_SP(ctx);
    if (sp != in->entry_sp + 8) {
        /* not the recorded launch's own return: the return of a driver launch made inside it (a
         * runtime launch, cuda_nested noted it) is part of it; any other is a launch one of the two
         * lost (the recorded one's return was never seen, or this one's entry made no record) */
        if (!(in->api < first_driver && in->driver_api != CUDA_NO_API && sp <= in->entry_sp &&
              in->entry_sp - sp < NATIVE_STACK_SPAN))
            count_drop(PROBE_CUDA_LAUNCH_RETURN);
        return 0;
    }
    u64 ts = in->ts, dur = bpf_ktime_get_ns() - ts;
    u32 api = in->api;
    s64 ret = (s64)(s32)PT_REGS_RC(ctx);
    if (api < first_driver)
        cuda_route_count(bpf_get_current_pid_tgid() >> 32, in->driver_api != CUDA_NO_API);
    if (dur < CUDA_LATE_STACK_NS && (bpf_get_prandom_u32() & CUDA_STACK_SAMPLE_MASK)) {
        cuda_emit(ctx, in, api, ret, dur, CUDA_FLAG_NO_STACK);
        in->ts = 0;
        return 0;
    }
    /* at the return the instruction pointer is the return address and the frame pointer the
     * caller's: the entry's stack from the caller up, after the function's own address */
    in->native_digest = native_walk(ctx, in->entry_ip, PT_REGS_IP(ctx));
    cuda_emit(ctx, in, api, ret, dur, CUDA_FLAG_LATE_STACK);
    in->ts = 0;
    PYSTACK_CAPTURE(ctx, ts);
}

/* A launch's entry without a return probe (the default): counted in its thread's tally, and one in
 * CUDA_STACK_SAMPLE_MASK + 1 kept as a sample with its stacks (cuda_launch_sample). `e` holds its
 * arguments. */
static __always_inline int cuda_count_launch(struct pt_regs *ctx, struct cuda_inflight *e, u32 api, int runtime)
{
    u64 id = bpf_get_current_pid_tgid();
    u32 tid = (u32)id;
    struct cuda_tally *t = cuda_tallies.lookup(&tid);
    if (!t) {
        u32 zero = 0;
        struct cuda_tally *z = cuda_tally_zero.lookup(&zero);
        if (!z)
            return 0;
        cuda_tallies.update(&tid, z);
        t = cuda_tallies.lookup(&tid);
        if (!t) {
            count_drop(PROBE_CUDA_TALLY);
            return 0;
        }
    }
    u64 sp = PT_REGS_SP(ctx);
    if (!runtime) {
        if (t->runtime_sp && sp < t->runtime_sp && t->runtime_sp - sp < NATIVE_STACK_SPAN) {
            t->runtime_sp = 0; /* the driver launch the runtime launch makes: that one is counted */
            cuda_route_count(id >> 32, 1);
            return 0;
        }
    } else {
        if (t->runtime_sp) /* the thread's last runtime launch went through no driver launch probe */
            cuda_route_count(id >> 32, 0);
        t->runtime_sp = sp;
    }
    u64 ts = e->ts;
    u32 tgid = id >> 32;
    u64 *epoch = cuda_step_epoch.lookup(&tgid);
    u64 now_epoch = epoch ? *epoch : 0;
    if (t->ev.launches && (ts - t->ev.ts >= CUDA_COUNT_FLUSH_NS || t->epoch != now_epoch))
        cuda_tally_send(t);
    t->epoch = now_epoch;
    if (!t->ev.launches) {
        t->ev.ts = ts;
        t->ev.pid = id >> 32;
        t->ev.tid = tid;
        t->ev.cgroup_id = e->cgroup_id;
    }
    t->ev.last_ts = ts;
    t->ev.launches++;
    u32 n = t->ev.kernels;
    u64 *fn = &t->ev.function_0;
    u32 *apis = &t->ev.api_0, *counts = &t->ev.count_0;
    int found = 0;
#pragma unroll
    for (int i = 0; i < CUDA_COUNT_KERNELS; i++) {
        if (i < n && fn[i] == e->function && apis[i] == api) {
            counts[i]++;
            found = 1;
            break;
        }
    }
    if (!found) {
        if (n < CUDA_COUNT_KERNELS) {
            n &= CUDA_COUNT_KERNELS - 1;
            fn[n] = e->function;
            apis[n] = api;
            counts[n] = 1;
            t->ev.kernels = n + 1;
        } else {
            t->ev.other++;
        }
    }
    if (bpf_get_prandom_u32() & CUDA_STACK_SAMPLE_MASK)
        return 0;
    e->api = api;
    e->entry_ip = PT_REGS_IP(ctx);
    e->entry_sp = sp;
    cuda_save(e, api, 1, 0);
    cuda_progs.call(ctx, CUDA_PROG_SAMPLE);
    /* the sample program is not installed: no sample */
    u64 key = cuda_key(CUDA_LAUNCH_SLOT);
    struct cuda_inflight *in = cuda_inflight.lookup(&key);
    if (in)
        in->ts = 0;
    return 0;
}

/* A sampled launch (tail-called by its entry, cuda_count_launch): its native stack, one event
 * (dur 0, CUDA_FLAG_SAMPLE), then its Python stack keyed by its (ts, pid, tid). */
int cuda_launch_sample(struct pt_regs *ctx)
{
    u64 key = cuda_key(CUDA_LAUNCH_SLOT);
    struct cuda_inflight *in = cuda_inflight.lookup(&key);
    if (!in || !in->ts)
        return 0;
    u64 ret = 0;
    in->native_digest = 0;
    if (bpf_probe_read_user(&ret, sizeof(ret), (void *)PT_REGS_SP(ctx)) == 0)
        in->native_digest = native_walk(ctx, PT_REGS_IP(ctx), ret);
    u64 ts = in->ts;
    cuda_emit(ctx, in, in->api, 0, 0, CUDA_FLAG_SAMPLE);
    in->ts = 0;
    PYSTACK_CAPTURE(ctx, ts);
}
