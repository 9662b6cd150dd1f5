/* nccl: NCCL calls, one event per call with its communicator, count, type, op, peer/root, stream
 * and duration.
 *
 * The entry program (generated per API by recorder/layers/workload/nccl.py) reads the arguments into an in-flight
 * record keyed by thread and API; the return program adds the return code and, for
 * ncclCommInitRank, the communicator handle the call wrote, and sends one nccl_event stamped with
 * the entry time. The communicator's identity across ranks is a hash of its ncclUniqueId, read at
 * init: every rank of one communicator gets the same comm_hash. The entry ends by capturing the
 * Python stack (bpf/pystack.h), one pystacks record keyed by the same (entry ts, pid, tid).
 */
struct nccl_inflight {
    u64 ts;
    u64 cgroup_id;
    u64 count;
    u64 comm;
    u64 stream;
    u64 comm_hash;
    u64 out_comm;
    s32 datatype;
    s32 op;
    s32 peer;
    s32 nranks;
    s32 rank;
};

BPF_TABLE("lru_hash", u64, struct nccl_inflight, nccl_inflight, 16384);
#define NCCL_RING_PAGES 256
BPF_RINGBUF_OUTPUT(nccl_events, NCCL_RING_PAGES);

static __always_inline int nccl_begin(struct nccl_inflight *e)
{
    u64 id = bpf_get_current_pid_tgid();
    if (!is_target(id >> 32))
        return 0;
    e->ts = bpf_ktime_get_ns();
    e->cgroup_id = bpf_get_current_cgroup_id();
    e->peer = -1;
    return 1;
}

/* FNV-1a over the 128-byte ncclUniqueId passed by value on the stack */
static __always_inline void nccl_hash_id(struct pt_regs *ctx, struct nccl_inflight *e)
{
    u64 words[16] = {};
    bpf_probe_read_user(words, sizeof(words), (void *)(PT_REGS_SP(ctx) + 8));
    u64 h = 1469598103934665603ull;
#pragma unroll
    for (int i = 0; i < 16; i++)
        h = (h ^ words[i]) * 1099511628211ull;
    e->comm_hash = h;
}

/* Not the last statement of an entry: the generated entry ends with PYSTACK_CAPTURE(ctx, e.ts). */
static __always_inline void nccl_save(struct nccl_inflight *e, u32 api)
{
    u64 key = (bpf_get_current_pid_tgid() << 32) | api;
    if (nccl_inflight.update(&key, e))
        count_drop(PROBE_NCCL_MAP);
}

static __always_inline int nccl_end(struct pt_regs *ctx, u32 api)
{
    u64 id = bpf_get_current_pid_tgid();
    u64 key = (id << 32) | api;
    struct nccl_inflight *in = nccl_inflight.lookup(&key);
    if (!in)
        return 0;
    struct nccl_event *e = nccl_events.ringbuf_reserve(sizeof(struct nccl_event));
    if (!e) {
        count_drop(PROBE_NCCL);
        nccl_inflight.delete(&key);
        return 0;
    }
    e->ts = in->ts;
    e->dur = bpf_ktime_get_ns() - in->ts;
    e->cgroup_id = in->cgroup_id;
    e->ret = (s64)(s32)PT_REGS_RC(ctx);
    e->count = in->count;
    e->comm = in->comm;
    e->stream = in->stream;
    e->comm_hash = in->comm_hash;
    e->pid = id >> 32;
    e->tid = (u32)id;
    e->api = api;
    e->datatype = in->datatype;
    e->op = in->op;
    e->peer = in->peer;
    e->nranks = in->nranks;
    e->rank = in->rank;
    if (in->out_comm) {
        u64 c = 0;
        bpf_probe_read_user(&c, sizeof(c), (void *)in->out_comm);
        e->comm = c;
    }
    nccl_events.ringbuf_submit(e, ring_wakeup_flags(RING_NCCL, RING_QUIET(NCCL_RING_PAGES, sizeof(*e))));
    nccl_inflight.delete(&key);
    return 0;
}
