/* cuda_inflight.h: the CUDA calls' in-flight records (bpf/cuda.bpf.c), pasted before bpf/pystack.h
 * so that the stack walker can leave a known stack's digest in the call's record: the entry
 * program ends with cuda_capture(ctx, ts, api) (bpf/cuda.bpf.c: the native stack walk, which
 * leaves its digest here too, then the Python capture), and when the walk finds a stack user
 * space already holds, cuda_digest_sink() stores its digest in record `key` (made at `ts`) instead
 * of a pystacks record being sent; the return program copies it into the event's py_digest.
 */
struct cuda_inflight {
    u64 ts;
    u64 cgroup_id;
    u64 size;
    u64 stream;
    u64 function;
    u64 pointer;
    u64 handle;
    u64 out_ptr; /* where an allocation writes its result */
    s32 memcpy_kind;
    u32 grid_x, grid_y, grid_z;
    u32 block_x, block_y, block_z;
    u32 shared_mem;
    u64 native_digest;   /* native_walk()'s digest (bpf/cuda.bpf.c), 0 when none */
    u64 py_digest;       /* set by the stack walker: the Python stack was sent before (see below) */
    u64 entry_ip;        /* the probed function's address: a launch's native stack is walked at
                          * its return, where this is the stack's first frame */
    u64 entry_sp;        /* a launch's stack pointer at entry: its own return is the one that
                          * pops the return address there (a driver launch inside it returns first) */
    u32 driver_api;      /* the driver API a runtime call went through (CUDA_NO_API: none seen) */
    u32 api;             /* the API's index (launches share one key per thread: CUDA_LAUNCH_SLOT) */
};

BPF_TABLE("lru_hash", u64, struct cuda_inflight, cuda_inflight, 65536);

/* A call's record: keyed by its thread and API index */
static __always_inline u64 cuda_key(u32 api)
{
    return (bpf_get_current_pid_tgid() << 32) | api;
}

/* Record `key` if it is still the call made at `ts`, else 0 */
static __always_inline struct cuda_inflight *cuda_inflight_at(u64 key, u64 ts)
{
    struct cuda_inflight *in = cuda_inflight.lookup(&key);
    return in && in->ts == ts ? in : 0;
}

static __always_inline int cuda_digest_sink(u64 key, u64 ts, u64 digest)
{
    struct cuda_inflight *in = cuda_inflight_at(key, ts);
    if (!in)
        return 0;
    in->py_digest = digest;
    return 1;
}
#define PYSTACK_DIGEST_SINK cuda_digest_sink

#ifdef CUDA_COUNT_KERNELS
/* Kernel launches counted at their entry, one trap each (bpf/cuda.bpf.c cuda_count_launch): per
 * thread, the launches since the counts were last sent, sent as one cuda_count_event when the
 * thread makes a CUDA call that keeps its return probe (a synchronisation, a copy, an allocation,
 * cuda_tally_flush() in its entry body), an NCCL call, a step marker, when the counts are
 * CUDA_COUNT_FLUSH_NS old at a launch, and by user space at the stop (what is left in the map).
 * Only the thread's own programs write its entry, one at a time, so sending and zeroing need no
 * lock. Here, before the layers, so that the NCCL and marker programs can flush it too. */
struct cuda_tally {
    struct cuda_count_event ev; /* ev.launches 0: none since the last send */
    u64 runtime_sp; /* a runtime launch's entry stack pointer until the driver launch it makes is seen */
    u64 epoch;      /* its process's step epoch (cuda_step_epoch) when these launches were counted */
};
/* Per process: the steps marked so far (recorder.step on any of its threads). A launch of a thread
 * whose counts are of an earlier epoch sends them first, so no interval of any thread of the
 * process spans a step marker: a step's launches are exact on every thread, not only the marker's. */
BPF_TABLE("hash", u32, u64, cuda_step_epoch, 4096);
BPF_TABLE("hash", u32, struct cuda_tally, cuda_tallies, CUDA_TALLY_THREADS);
BPF_PERCPU_ARRAY(cuda_tally_zero, struct cuda_tally, 1);
#define CUDA_COUNT_RING_PAGES 64
BPF_RINGBUF_OUTPUT(cuda_counts, CUDA_COUNT_RING_PAGES);

static __always_inline void cuda_tally_send(struct cuda_tally *t)
{
    if (cuda_counts.ringbuf_output(&t->ev, sizeof(t->ev), 0))
        count_drop(PROBE_CUDA_COUNTS);
    t->ev.launches = 0;
    t->ev.other = 0;
    t->ev.kernels = 0;
}

/* The calling thread's launch counts go to the ring now (it is about to wait or to mark a step). */
static __always_inline void cuda_tally_flush(void)
{
    u32 tid = (u32)bpf_get_current_pid_tgid();
    struct cuda_tally *t = cuda_tallies.lookup(&tid);
    if (t && t->ev.launches)
        cuda_tally_send(t);
}

/* A step marker of the calling thread's process: every thread's counts so far end before it. */
static __always_inline void cuda_step_mark(void)
{
    u32 tgid = bpf_get_current_pid_tgid() >> 32;
    u64 *e = cuda_step_epoch.lookup(&tgid);
    if (e) {
        __sync_fetch_and_add(e, 1);
    } else {
        u64 one = 1;
        cuda_step_epoch.update(&tgid, &one);
    }
}
#else
static __always_inline void cuda_tally_flush(void) {}
static __always_inline void cuda_step_mark(void) {}
#endif
