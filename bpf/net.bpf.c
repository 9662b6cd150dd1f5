/* net: TCP retransmissions, from tcp:tcp_retransmit_skb.
 *
 * A retransmit usually runs in a timer softirq, so the running task is rarely the socket's owner:
 * every retransmit is recorded (they are rare compared with packets) and user space relates them
 * to targets by address and port. Compiled only when the tracepoint exists.
 */
BPF_RINGBUF_OUTPUT(net_events, 16);

#ifdef HAVE_TP_tcp_tcp_retransmit_skb
TRACEPOINT_PROBE(tcp, tcp_retransmit_skb)
{
    u64 id = bpf_get_current_pid_tgid();
    if (id >> 32 == SELF_TGID)
        return 0;
    struct tcp_event e = {};
    e.ts = bpf_ktime_get_ns();
    e.cgroup_id = bpf_get_current_cgroup_id();
    e.pid = id >> 32;
    e.tid = id;
    e.state = args->state;
    e.err = args->err;
    e.sport = args->sport;
    e.dport = args->dport;
    e.family = args->family;
    bpf_probe_read_kernel(e.saddr, sizeof(e.saddr), args->saddr_v6);
    bpf_probe_read_kernel(e.daddr, sizeof(e.daddr), args->daddr_v6);
    bpf_get_current_comm(e.comm, sizeof(e.comm));
    if (net_events.ringbuf_output(&e, sizeof(e), ring_wake_deferred(0)))
        count_drop(PROBE_NET);
    return 0;
}
#endif
