/* lineage: the markers a training script calls (recorder.step, recorder.lineage,
 * recorder.checkpoint), read from the registers of the exported marker functions in
 * recorder/_markers*.so. One marker_event per call; user space turns them into step, lineage and
 * checkpoint intervals per thread, and joins every other event to them by thread and time. Each
 * marker ends by capturing the Python stack (bpf/pystack.h), keyed by the marker's (ts, pid, tid):
 * the script's line is its first frame below recorder/markers.py.
 */
BPF_RINGBUF_OUTPUT(marker_events, 256);

static __always_inline int marker_send(struct pt_regs *ctx, u32 kind, u64 value, u64 tag, u64 text,
                                       u64 len)
{
    u64 id = bpf_get_current_pid_tgid();
    if (!is_target(id >> 32))
        return 0;
    /* the thread's kernel launches so far end before the marker, and a step begins a new epoch for
     * its process's other threads (bpf/cuda_inflight.h): a step's counts are its own */
    cuda_tally_flush();
    if (kind == MARKER_STEP)
        cuda_step_mark();
    struct marker_event *e = marker_events.ringbuf_reserve(sizeof(struct marker_event));
    if (!e) {
        count_drop(PROBE_MARKER);
        return 0;
    }
    u64 ts = bpf_ktime_get_ns();
    e->ts = ts;
    e->value = value;
    e->tag = tag;
    e->text_addr = text; /* the label or path stays alive in the process: read later, in full */
    e->text_len = len;
    e->pid = id >> 32;
    e->tid = (u32)id;
    e->kind = kind;
    e->pad = 0;
    __builtin_memset(e->text, 0, sizeof(e->text));
    if (text)
        bpf_probe_read_user_str(e->text, sizeof(e->text), (void *)text);
    marker_events.ringbuf_submit(e, ring_wake_deferred(0));
    PYSTACK_CAPTURE(ctx, ts);
}

/* stall_recorder_step(u64 step) */
int marker_step(struct pt_regs *ctx)
{
    return marker_send(ctx, MARKER_STEP, PT_REGS_PARM1(ctx), 0, 0, 0);
}

/* stall_recorder_lineage(u64 tag, const char *label, u64 len) */
int marker_lineage(struct pt_regs *ctx)
{
    return marker_send(ctx, MARKER_LINEAGE, 0, PT_REGS_PARM1(ctx), PT_REGS_PARM2(ctx), PT_REGS_PARM3(ctx));
}

/* stall_recorder_checkpoint(const char *path, u64 len, u64 phase, u64 tag) */
int marker_checkpoint(struct pt_regs *ctx)
{
    return marker_send(ctx, MARKER_CHECKPOINT, PT_REGS_PARM3(ctx), PT_REGS_PARM4(ctx), PT_REGS_PARM1(ctx),
                       PT_REGS_PARM2(ctx));
}
