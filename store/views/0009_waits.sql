-- Views: waits followed across threads and processes. A thread blocked on a queue, a pipe, a lock or
-- the GIL waits for whoever wakes it; what that waker was itself waiting for (its own off-CPU
-- interval before the wakeup: a block request, TCP retransmissions, the GIL...) is the cause, and so
-- on to the end of the chain. wait_hop (0008_causes.sql) is one hop; the rule is wait_chain_rule.

-- view: offcpu_wait
-- Every blocked off-CPU interval with what it waited for: its thread and process, the Python line it
-- blocked at, the block request of its thread in flight meanwhile (the slowest), the TCP
-- retransmissions on its process's own connections meanwhile, and whether it waited for the GIL
-- (a futex in its process's python_gil range) and who dropped it (the waker).
CREATE VIEW offcpu_wait AS
SELECT
    o.id AS offcpu_id, o.session_id, o.thread_id, o.ts, o.dur,
    coalesce(o.wakeup_ts, o.ts + o.dur) - o.ts AS blocked_dur, -- ns asleep, before it was woken
    o.reason, o.syscall_name, o.state_letter, o.open,
    t.tid, p.pid, t.process_id,
    t.name AS thread_name,              -- the thread's (latest) name
    coalesce(p.name, t.name) AS process_name,
    o.waker_tid, o.waker_pid, o.waker_name, o.wakeup_ts, oi.waker_thread_id,
    oi.python_stack_id,
    (SELECT s.text FROM python_call_site s WHERE s.stack_id = oi.python_stack_id) AS python, -- 'f() at file.py:12'
    oi.futex_addr,
    -- 1 when it waited on the interpreter lock of its own process
    CASE WHEN oi.futex_addr IS NOT NULL AND EXISTS (
        SELECT 1 FROM python_gil g WHERE g.session_id = o.session_id AND g.pid = p.pid
                                     AND oi.futex_addr >= g.lo AND oi.futex_addr < g.hi) THEN 1 ELSE 0 END AS gil,
    r.id AS block_request_id, r.device, r.op, r.size_bytes, r.queued_dur, r.device_dur,
    r.dur AS request_dur, r.submitter_kind,
    (SELECT count(*) FROM tcp_retransmit e
      WHERE e.session_id = o.session_id AND t.process_id IN (e.process_id, e.peer_process_id)
        AND e.ts >= o.ts AND e.ts < o.ts + o.dur) AS retransmits, -- on its process's connections (either end)
    (SELECT e.daddr || ':' || e.dport FROM tcp_retransmit e
      WHERE e.session_id = o.session_id AND t.process_id IN (e.process_id, e.peer_process_id)
        AND e.ts >= o.ts AND e.ts < o.ts + o.dur
      GROUP BY e.daddr, e.dport ORDER BY count(*) DESC LIMIT 1) AS retransmit_peer
FROM offcpu o
JOIN offcpu_interval oi ON oi.id = o.id
JOIN thread t ON t.id = o.thread_id
LEFT JOIN process p ON p.id = t.process_id
LEFT JOIN block_request r ON r.id = (
    SELECT b.id FROM block_request b
    WHERE b.thread_id = o.thread_id AND b.ts < coalesce(o.wakeup_ts, o.ts + o.dur) AND b.ts + b.dur > o.ts
      AND b.ts >= o.ts - (SELECT lookback FROM wait_chain_rule)
    ORDER BY b.dur DESC LIMIT 1)
WHERE o.state NOT IN (0, 256);

-- view: wait_chain
-- Each blocked wait (root_offcpu_id, a wait of at least wait_chain_rule.min_blocked_dur that another
-- thread ended) followed through its wakers: depth 0 is the wait itself, depth n the wait of the
-- thread that woke depth n-1 before it did, up to wait_chain_rule.max_depth. The last row of a root
-- is the end of the chain, the wait that explains the others. A recursive query: ask for one root
-- (`WHERE root_offcpu_id = ?`) on a large session, as a report does (store/waits.py).
CREATE VIEW wait_chain AS
WITH RECURSIVE chain(root_offcpu_id, depth, offcpu_id, woke_offcpu_id) AS (
    SELECT h.offcpu_id, 0, h.offcpu_id, NULL
    FROM wait_hop h JOIN offcpu_interval o ON o.id = h.offcpu_id
    WHERE h.waker_offcpu_id IS NOT NULL
      AND h.wakeup_ts - o.ts >= (SELECT min_blocked_dur FROM wait_chain_rule)
    UNION ALL
    SELECT c.root_offcpu_id, c.depth + 1, h.waker_offcpu_id, c.offcpu_id
    FROM chain c JOIN wait_hop h ON h.offcpu_id = c.offcpu_id
    WHERE h.waker_offcpu_id IS NOT NULL AND c.depth < (SELECT max_depth FROM wait_chain_rule)
)
SELECT c.root_offcpu_id,                -- the wait being explained
       c.depth,                         -- 0: that wait; n: the wait of the thread that woke hop n-1
       c.woke_offcpu_id,                -- the wait this thread ended (hop n-1), NULL at depth 0
       w.*
FROM chain c JOIN offcpu_wait w ON w.offcpu_id = c.offcpu_id;
