/* cuda: CUDA runtime and driver calls, one event per call with its duration and arguments.
 *
 * The entry program (generated per API by recorder/cuda.py) reads the arguments into an in-flight
 * record keyed by thread and API; the return program adds the return code and, for allocations,
 * the pointer the call wrote, and sends one cuda_event stamped with the entry time. The entry also
 * takes the native user stack id and ends by capturing the Python stack (bpf/pystack.h): one
 * pystacks record keyed by the same (entry ts, pid, tid), or for a stack user space already holds
 * no record but its digest, which the return program puts in the event (py_digest).
 */
/* struct cuda_inflight and its map: bpf/cuda_inflight.h (pasted before bpf/pystack.h) */
BPF_RINGBUF_OUTPUT(cuda_events, 2048);
/* native user stacks at entry (frame-pointer walk by the kernel), resolved by recorder/stacks.py */
BPF_STACK_TRACE(user_stacks, 16384);

static __always_inline int cuda_begin(struct cuda_inflight *e, u32 api)
{
    u64 id = bpf_get_current_pid_tgid();
    if (!is_target(id >> 32))
        return 0;
    e->ts = bpf_ktime_get_ns();
    e->cgroup_id = bpf_get_current_cgroup_id();
    return 1;
}

/* Not the last statement of an entry: the generated entry ends with PYSTACK_CAPTURE(ctx, e.ts). */
static __always_inline void cuda_save(struct cuda_inflight *e, u32 api)
{
    u64 key = (bpf_get_current_pid_tgid() << 32) | api;
    if (cuda_inflight.update(&key, e))
        count_drop(PROBE_CUDA_MAP);
}

static __always_inline int cuda_end(struct pt_regs *ctx, u32 api)
{
    u64 id = bpf_get_current_pid_tgid();
    u64 key = (id << 32) | api;
    struct cuda_inflight *in = cuda_inflight.lookup(&key);
    if (!in)
        return 0;
    struct cuda_event *e = cuda_events.ringbuf_reserve(sizeof(struct cuda_event));
    if (!e) {
        count_drop(PROBE_CUDA);
        cuda_inflight.delete(&key);
        return 0;
    }
    e->ts = in->ts;
    e->dur = bpf_ktime_get_ns() - in->ts;
    e->cgroup_id = in->cgroup_id;
    e->ret = (s64)(s32)PT_REGS_RC(ctx);
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
    e->flags = 0;
    e->native_stack_id = in->native_stack_id;
    e->pad = 0;
    e->py_digest = in->py_digest;
    if (in->out_ptr) {
        u64 p = 0;
        if (bpf_probe_read_user(&p, sizeof(p), (void *)in->out_ptr) == 0)
            e->pointer = p;
        else
            e->flags |= CUDA_FLAG_POINTER_UNREAD;
    }
    cuda_events.ringbuf_submit(e, 0);
    cuda_inflight.delete(&key);
    return 0;
}
