-- Views: the Python line where a step's time was lost. A cause whose evidence is the thread's own
-- time (waiting for a CPU, blocked, reclaiming memory) is reported at the line where most of that
-- time went, with the other lines and their time: a hog that starts while the thread is at one
-- line and then preempts it for 400 ms inside a long kernel launch is reported at the launch.

-- view: step_lost_time
-- The time a step's thread lost, interval by interval, each put on the Python stack the thread was
-- at: the waits for a CPU (cause 'cpu_wait') and the blocked time (cause 'blocked', detail: the
-- reason) of its off-CPU intervals (step_offcpu), and its direct reclaim (cause 'reclaim', detail:
-- direct or memcg; step_reclaim). A preemption is recorded without a stack (bpf/sched.bpf.c), so
-- an interval takes, in this order (`how`):
--   'own':     its own stack (a blocked interval: where it blocked; a reclaim: where it began, the
--              allocating line, bpf/mm.bpf.c);
--   'in_wait': a reclaim without a stack of its own (recorded before it had one, or its capture
--              lost): the stack of a wait of the thread inside the reclaim;
--   'in_call': the stack of the thread's CUDA or NCCL call in progress when it began;
--   'before':  the stack of the thread's latest event in the step before it (a CUDA or NCCL
--              call, a wait, a block request, the step's own mark): the line last known to run;
--   NULL:      none known (python_stack_id NULL).
-- Query it by step_mark_id: every lookup goes through the (thread_id, ts) indexes.
CREATE VIEW step_lost_time AS
SELECT l.step_mark_id, l.session_id, l.thread_id, l.cause, l.detail,
       l.ts,                                                  -- ns the interval began (in the step)
       l.dur,                                                 -- ns of the step lost in it
       l.offcpu_id, l.reclaim_id,                             -- the interval: offcpu_interval / reclaim_interval id
       coalesce(l.own_stack, l.call_stack, l.before_stack) AS python_stack_id, -- the stack it is put on
       CASE WHEN l.own_stack IS NOT NULL THEN l.own_how WHEN l.call_stack IS NOT NULL THEN 'in_call'
            WHEN l.before_stack IS NOT NULL THEN 'before' END AS how -- how that stack was found (above)
FROM (
    SELECT i.*,
           CASE WHEN i.own_stack IS NULL THEN coalesce(
               (SELECT c.python_stack_id FROM cuda_call c
                 WHERE c.thread_id = i.thread_id AND c.ts >= i.step_ts AND c.ts <= i.ts AND c.ts + c.dur > i.ts
                   AND c.python_stack_id IS NOT NULL ORDER BY c.ts DESC LIMIT 1),
               (SELECT n.python_stack_id FROM nccl_call n
                 WHERE n.thread_id = i.thread_id AND n.ts >= i.step_ts AND n.ts <= i.ts AND n.ts + n.dur > i.ts
                   AND n.python_stack_id IS NOT NULL ORDER BY n.ts DESC LIMIT 1)) END AS call_stack,
           CASE WHEN i.own_stack IS NULL THEN (
               SELECT python_stack_id FROM (
                   SELECT * FROM (SELECT ts, python_stack_id FROM cuda_call WHERE thread_id = i.thread_id
                                    AND ts >= i.step_ts AND ts < i.ts AND python_stack_id IS NOT NULL
                                  ORDER BY ts DESC LIMIT 1)
                   UNION ALL
                   SELECT * FROM (SELECT ts, python_stack_id FROM nccl_call WHERE thread_id = i.thread_id
                                    AND ts >= i.step_ts AND ts < i.ts AND python_stack_id IS NOT NULL
                                  ORDER BY ts DESC LIMIT 1)
                   UNION ALL
                   SELECT * FROM (SELECT ts, python_stack_id FROM offcpu_interval WHERE thread_id = i.thread_id
                                    AND ts >= i.step_ts AND ts < i.ts AND python_stack_id IS NOT NULL
                                  ORDER BY ts DESC LIMIT 1)
                   UNION ALL
                   SELECT * FROM (SELECT ts, python_stack_id FROM block_request WHERE thread_id = i.thread_id
                                    AND ts >= i.step_ts AND ts < i.ts AND python_stack_id IS NOT NULL
                                  ORDER BY ts DESC LIMIT 1)
                   UNION ALL
                   SELECT ts, python_stack_id FROM step_mark WHERE id = i.step_mark_id AND python_stack_id IS NOT NULL)
               ORDER BY ts DESC LIMIT 1) END AS before_stack
    FROM (
        SELECT o.step_mark_id, o.session_id, m.thread_id, m.ts AS step_ts, 'cpu_wait' AS cause, NULL AS detail,
               -- the CPU wait ends the interval: it is spent where the thread blocked, if it did
               o.ts + o.overlap_dur - o.runq_dur AS ts, o.runq_dur AS dur, o.offcpu_id, NULL AS reclaim_id,
               o.python_stack_id AS own_stack, 'own' AS own_how
        FROM step_offcpu o JOIN step_mark m ON m.id = o.step_mark_id
        WHERE o.runq_dur > 0
        UNION ALL
        SELECT o.step_mark_id, o.session_id, m.thread_id, m.ts, 'blocked', o.reason, o.ts, o.blocked_dur,
               o.offcpu_id, NULL, o.python_stack_id, 'own'
        FROM step_offcpu o JOIN step_mark m ON m.id = o.step_mark_id
        WHERE o.blocked_dur > 0
        UNION ALL
        SELECT r.step_mark_id, r.session_id, m.thread_id, m.ts, 'reclaim', r.kind, max(r.ts, m.ts), r.overlap_dur,
               NULL, r.reclaim_id,
               coalesce(x.python_stack_id,
                        (SELECT w.python_stack_id FROM offcpu_interval w
                          WHERE w.thread_id = m.thread_id AND w.ts >= x.ts AND w.ts < x.ts + x.dur
                            AND w.python_stack_id IS NOT NULL ORDER BY w.ts LIMIT 1)),
               CASE WHEN x.python_stack_id IS NOT NULL THEN 'own' ELSE 'in_wait' END
        FROM step_reclaim r JOIN step_mark m ON m.id = r.step_mark_id JOIN reclaim_interval x ON x.id = r.reclaim_id
        WHERE r.overlap_dur > 0
    ) i
) l;

-- view: step_lost_line
-- step_lost_time summed per step, cause and Python line (python_call_site): where the step's time
-- of each cause went, the line with the most time first when ordered by dur DESC. Intervals put on
-- no stack are one row with python_line NULL.
CREATE VIEW step_lost_line AS
SELECT t.step_mark_id, t.session_id, t.cause, t.detail,
       s.text AS python_line,                                 -- 'qualname() at file:line', NULL: not known
       sum(t.dur) AS dur,                                     -- ns of the cause's time at that line
       count(*) AS intervals,                                 -- intervals summed
       max(t.python_stack_id) AS python_stack_id,             -- one of the stacks with that line
       group_concat(DISTINCT t.how) AS how                    -- how the intervals' stacks were found
FROM step_lost_time t
LEFT JOIN python_call_site s ON s.stack_id = t.python_stack_id
GROUP BY t.step_mark_id, t.session_id, t.cause, t.detail, s.text;
