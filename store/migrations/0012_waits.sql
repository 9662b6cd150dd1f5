-- Schema v12: waits followed across threads and processes. A stalled thread often waits for another
-- thread or process (a queue fed by a data-loader worker, the GIL held by a sibling thread, a peer
-- behind TCP retransmissions); the recording has the waker of each wait and the waker's own waits,
-- so a report follows them (store/views/0009_waits.sql) to the wait at the end of the chain.

-- table: wait_chain_rule
-- How far a wait is followed into its waker's waits. One row; change it to follow further.
CREATE TABLE wait_chain_rule (
    id INTEGER PRIMARY KEY CHECK (id = 1),
    max_depth INTEGER NOT NULL,         -- hops followed from a wait (wait_chain.depth <= max_depth)
    min_blocked_dur INTEGER NOT NULL,   -- ns: a waker's wait that overlapped ours less than this is not followed
    lookback INTEGER NOT NULL           -- ns: how long before a wait the waker's wait may have started
);
INSERT INTO wait_chain_rule (id, max_depth, min_blocked_dur, lookback) VALUES (1, 4, 1000000, 60000000000);

-- A wait explained by the thread or process it waited for, and a wait for the interpreter lock: more
-- specific than the bare wait (blocked, blocked_io), less than a device event.
INSERT INTO cause_kind (kind, specificity) VALUES ('wait_chain', 6), ('gil_wait', 6);

-- The futex word a thread blocked on (raw_syscalls:sys_enter args[0] of futex()), so a wait on the
-- interpreter lock is told from any other futex wait by its address (python_gil).
ALTER TABLE offcpu_interval ADD COLUMN futex_addr INTEGER; -- user address of the futex the thread waited on, NULL outside futex()

-- table: python_gil
-- Where a traced CPython process keeps its interpreter lock: the address range of its `_PyRuntime`
-- (on 3.10-3.11 the GIL is _PyRuntime.ceval.gil, on 3.12-3.13 the main interpreter's _gil, also
-- inside _PyRuntime). The interpreter's other locks are allocated elsewhere, so a futex in this
-- range is the GIL's mutex or condition variable. An exec replaces its process's row.
CREATE TABLE python_gil (
    session_id INTEGER NOT NULL REFERENCES session(id),
    pid INTEGER NOT NULL,               -- the process (process.pid)
    lo INTEGER NOT NULL,                -- first address of _PyRuntime in the process
    hi INTEGER NOT NULL,                -- one past its last
    version TEXT,                       -- the interpreter's version ('3.12.1')
    PRIMARY KEY (session_id, pid, lo)
) WITHOUT ROWID;

-- The process that owns a retransmitted connection (its socket, found in the targets' /proc fd and
-- net tables when the retransmit is stored). The task running at the retransmit is rarely the owner:
-- retransmits fire from timers in softirq context.
ALTER TABLE tcp_retransmit ADD COLUMN process_id INTEGER REFERENCES process(id); -- owner of the socket, NULL when not a recorded process's
-- The process holding the other end when it is on this host (loopback, another namespace's veth): a
-- retransmitted reply is a wait of the process that asked for it.
ALTER TABLE tcp_retransmit ADD COLUMN peer_process_id INTEGER REFERENCES process(id); -- owner of the other end, NULL when remote or not recorded
