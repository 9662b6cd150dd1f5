-- Views: waits followed across threads and processes. A thread blocked on a queue, a pipe, a lock or
-- the GIL waits for whoever wakes it; what that waker was itself waiting for (its own off-CPU
-- interval before the wakeup: a block request, TCP retransmissions, the GIL...) is the cause, and so
-- on to the end of the chain. wait_hop (0008_causes.sql) is one hop; the rule is wait_chain_rule.

-- view: gil_wait_sibling
-- For each wait on the interpreter lock (a futex in its process's python_gil range), every other
-- thread of the same process alive during it, with the ns of the wait it was awake (running or
-- runnable: not blocked in a syscall) and whether it ran Python (a Python stack at one of its own
-- waits) or never did (native: its stacks have no Python thread state). A thread blocked in a
-- syscall has released the GIL (CPython drops it around blocking calls); the one that holds it is
-- awake. gil_holder picks it.
CREATE VIEW gil_wait_sibling AS
SELECT c.offcpu_id, c.session_id, c.thread_id, c.sibling_thread_id,
       c.wait_dur,                      -- ns the waiter was asleep (its wait for the GIL)
       -- ns of the wait the sibling was alive and not blocked: its blocked intervals that started
       -- during the wait and the one last started before it (a thread's intervals never overlap)
       c.hi - c.lo
         - coalesce((SELECT sum(min(coalesce(x.wakeup_ts, x.ts + x.dur), c.hi) - x.ts) FROM offcpu_interval x
                     WHERE x.thread_id = c.sibling_thread_id AND x.ts >= c.lo AND x.ts < c.hi
                       AND x.state NOT IN (0, 256)), 0)
         - coalesce((SELECT max(0, min(coalesce(y.wakeup_ts, y.ts + y.dur), c.hi) - c.lo)
                     FROM (SELECT x.* FROM offcpu_interval x WHERE x.thread_id = c.sibling_thread_id AND x.ts < c.lo
                           ORDER BY x.ts DESC LIMIT 1) y
                     WHERE y.state NOT IN (0, 256)), 0) AS awake_dur,
       EXISTS (SELECT 1 FROM offcpu_interval x JOIN python_stack ps ON ps.id = x.python_stack_id
               WHERE x.thread_id = c.sibling_thread_id AND ps.depth > 0) AS ran_python, -- 1 when it ran Python
       -- 1 for a thread that never ran Python (a native pool's): its stacks say it has no thread state
       EXISTS (SELECT 1 FROM offcpu_interval x JOIN python_stack ps ON ps.id = x.python_stack_id
               WHERE x.thread_id = c.sibling_thread_id AND ps.status = 'no python thread state')
         AND NOT EXISTS (SELECT 1 FROM offcpu_interval x JOIN python_stack ps ON ps.id = x.python_stack_id
                         WHERE x.thread_id = c.sibling_thread_id AND ps.depth > 0) AS native
FROM (
    SELECT o.id AS offcpu_id, o.session_id, o.thread_id, s.id AS sibling_thread_id,
           coalesce(o.wakeup_ts, o.ts + o.dur) - o.ts AS wait_dur,
           max(o.ts, s.first_ts) AS lo,
           min(coalesce(o.wakeup_ts, o.ts + o.dur), coalesce(s.exit_ts, coalesce(o.wakeup_ts, o.ts + o.dur))) AS hi
    FROM offcpu_interval o
    JOIN thread t ON t.id = o.thread_id
    JOIN process p ON p.id = t.process_id
    JOIN python_gil g ON g.session_id = o.session_id AND g.pid = p.pid
                     AND o.futex_addr >= g.lo AND o.futex_addr < g.hi
    JOIN thread s ON s.process_id = t.process_id AND s.id != t.id
    WHERE o.futex_addr IS NOT NULL AND o.state NOT IN (0, 256)
      AND s.first_ts < coalesce(o.wakeup_ts, o.ts + o.dur) AND coalesce(s.exit_ts, o.ts + o.dur) > o.ts
) c;

-- view: gil_holder
-- Each wait on the interpreter lock with the thread that held it. 'handed_over': a thread of the
-- same process woke the waiter (it dropped the lock and signalled). 'awake': the wait timed out (a
-- CPython GIL wait is a timed wait of the switch interval, 5 ms; the timer ends it while the lock is
-- still held) or its waker is unknown, and exactly one other thread of the process (leaving out
-- native threads, which never hold it) was awake for at least half the wait: only one thread holds
-- the GIL, and a blocked one has dropped it. NULL holder when the recording cannot tell (two such
-- threads awake, e.g. one in native code that released the lock).
CREATE VIEW gil_holder AS
SELECT h.*,
       CASE WHEN h.holder_thread_id IS NULL THEN NULL WHEN h.handed_over THEN 'handed_over' ELSE 'awake' END
         AS holder_how,                 -- 'handed_over' or 'awake' (above), NULL without a holder
       (SELECT s.awake_dur FROM gil_wait_sibling s WHERE s.offcpu_id = h.offcpu_id
          AND s.sibling_thread_id = h.holder_thread_id) AS holder_awake_dur -- ns of the wait the holder was awake
FROM (
    SELECT o.id AS offcpu_id, o.session_id, o.thread_id, o.ts,
           coalesce(o.wakeup_ts, o.ts + o.dur) - o.ts AS wait_dur, -- ns the waiter was asleep
           o.waker_thread_id, o.waker_context,
           coalesce(w.process_id = t.process_id AND w.id != t.id, 0) AS handed_over,
           CASE WHEN w.process_id = t.process_id AND w.id != t.id THEN o.waker_thread_id
                ELSE (SELECT CASE WHEN count(*) = 1 THEN max(s.sibling_thread_id) END
                      FROM gil_wait_sibling s WHERE s.offcpu_id = o.id AND 2 * s.awake_dur >= s.wait_dur
                        AND NOT s.native)
           END AS holder_thread_id      -- the thread that held the GIL, NULL when it cannot be told
    FROM offcpu_interval o
    JOIN thread t ON t.id = o.thread_id
    JOIN process p ON p.id = t.process_id
    JOIN python_gil g ON g.session_id = o.session_id AND g.pid = p.pid
                     AND o.futex_addr >= g.lo AND o.futex_addr < g.hi
    LEFT JOIN thread w ON w.id = o.waker_thread_id
    WHERE o.futex_addr IS NOT NULL AND o.state NOT IN (0, 256)
) h;

-- view: offcpu_wait
-- Every blocked off-CPU interval with what it waited for: its thread and process, the Python line it
-- blocked at, the block request of its thread in flight meanwhile (the slowest), the TCP
-- retransmissions on its process's own connections meanwhile, and whether it waited for the GIL
-- (a futex in its process's python_gil range) and the thread that held it (gil_holder).
CREATE VIEW offcpu_wait AS
SELECT
    o.id AS offcpu_id, o.session_id, o.thread_id, o.ts, o.dur,
    coalesce(o.wakeup_ts, o.ts + o.dur) - o.ts AS blocked_dur, -- ns asleep, before it was woken
    o.reason, o.syscall_name, o.state_letter, o.open,
    t.tid, p.pid, t.process_id,
    coalesce(t.name, p.name) AS thread_name, -- the thread's (latest) name, its process's when never read
    coalesce(p.name, t.name) AS process_name,
    o.waker_tid, o.waker_pid, o.waker_name, o.wakeup_ts, oi.waker_thread_id,
    oi.python_stack_id,
    (SELECT s.text FROM python_call_site s WHERE s.stack_id = oi.python_stack_id) AS python, -- 'f() at file.py:12'
    oi.futex_addr,
    -- 1 when it waited on the interpreter lock of its own process
    CASE WHEN oi.futex_addr IS NOT NULL AND EXISTS (
        SELECT 1 FROM python_gil g WHERE g.session_id = o.session_id AND g.pid = p.pid
                                     AND oi.futex_addr >= g.lo AND oi.futex_addr < g.hi) THEN 1 ELSE 0 END AS gil,
    ht.id AS gil_holder_thread_id,      -- the thread that held the GIL (gil_holder), NULL when not told
    ht.tid AS gil_holder_tid, coalesce(ht.name, p.name) AS gil_holder_name, -- a thread of the same process
    CASE WHEN ht.id IS NULL THEN NULL WHEN ht.id = oi.waker_thread_id THEN 'handed_over' ELSE 'awake' END
      AS gil_holder_how,                -- 'handed_over' (it woke the wait) or 'awake' (the wait timed out)
    (SELECT s.awake_dur FROM gil_wait_sibling s WHERE s.offcpu_id = o.id AND s.sibling_thread_id = ht.id)
      AS gil_holder_awake_dur,          -- ns of the wait the holder was awake
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
-- (looked up per row: gil_holder, a join, would be computed whole as the right side of a LEFT JOIN)
LEFT JOIN thread ht ON oi.futex_addr IS NOT NULL
                   AND ht.id = (SELECT h.holder_thread_id FROM gil_holder h WHERE h.offcpu_id = o.id)
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
-- (`WHERE root_offcpu_id = ?`) on a large session, as a report does (store/analysis/waits.py).
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
