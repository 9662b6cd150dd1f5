-- Views: every block request, CUDA call and NCCL call with the step its process was in and the
-- lineage tag (and label) current on its thread when it happened, from the markers the script
-- called (step_mark, lineage_mark) or the steps inferred without them (step_mark.inferred = 1).
-- No per-event stamping in BPF is needed: an event carries its thread and ts, and a marker holds
-- from its ts until the thread's (lineage) or the process's (step) next marker.
--
-- Each view finds the marker with correlated subqueries on indexes, so filtering on an event (id,
-- thread, time window) costs a few index seeks per row, also on sessions with millions of events:
--   lineage: the thread's last lineage_mark at or before ts      lineage_mark(thread_id, ts)
--   step:    the process's last step_mark at or before ts        step_mark(session_id, ts), walked
--            back to the first mark of the event's process (a few rows: one per other marking
--            process in between), only for processes that have step marks (a list built once
--            per query), so events of processes without steps cost nothing.

-- view: block_request_lineage
-- Each block request with its step and lineage tag. The tag is the request's own io_tag when the
-- patched kernel carried it through (block_ai_rq_complete: also for writeback by kernel threads),
-- else the tag of the submitting thread at submission (for target_deferred requests, throttled and
-- queued later by a kworker, that is the target thread at the time of its I/O intent). Requests a
-- kernel thread submitted (writeback, journal) have no tag without the patch, and no step.
CREATE VIEW block_request_lineage AS
SELECT
    x.id AS block_request_id,
    x.session_id,
    x.ts,                               -- ns: submission
    x.dur,                              -- ns: submission -> completion
    x.thread_id,                        -- submitting thread
    x.process_id,                       -- its process
    x.submitter_kind,                   -- target, target_deferred, kernel_thread
    x.device, x.op, x.size_bytes,       -- disk, read/write/..., bytes
    sm.step,                            -- the process's step at ts; NULL before its first step or without steps
    sm.inferred AS step_inferred,       -- 1 when that step was inferred without markers
    sm.id AS step_mark_id,              -- step_mark row that began that step
    coalesce(nullif(x.io_tag, 0), nullif(lm.tag, 0)) AS tag, -- lineage tag, NULL when none
    CASE WHEN nullif(x.io_tag, 0) IS NOT NULL THEN 'io_tag'
         WHEN nullif(lm.tag, 0) IS NOT NULL THEN 'thread' END AS tag_source, -- io_tag (kernel) or thread (its lineage scope)
    l.label                             -- the tag's label (lineage_label), NULL when not registered
FROM (
    SELECT r.id, r.session_id, r.ts, r.dur, r.thread_id, r.submitter_kind, r.device, r.op, r.size_bytes,
           r.io_tag, t.process_id,
           CASE WHEN t.process_id IN (SELECT st.process_id FROM step_mark m JOIN thread st ON st.id = m.thread_id)
                THEN (SELECT m.id FROM step_mark m JOIN thread mt ON mt.id = m.thread_id
                      WHERE m.session_id = r.session_id AND m.ts <= r.ts AND mt.process_id = t.process_id
                      ORDER BY m.ts DESC LIMIT 1) END AS step_mark_id,
           (SELECT m.id FROM lineage_mark m WHERE m.thread_id = r.thread_id AND m.ts <= r.ts
            ORDER BY m.ts DESC LIMIT 1) AS lineage_mark_id
    FROM block_request r
    LEFT JOIN thread t ON t.id = r.thread_id
) x
LEFT JOIN step_mark sm ON sm.id = x.step_mark_id
LEFT JOIN lineage_mark lm ON lm.id = x.lineage_mark_id
LEFT JOIN lineage_label l ON l.session_id = x.session_id AND l.tag = coalesce(nullif(x.io_tag, 0), nullif(lm.tag, 0));

-- view: cuda_call_lineage
-- Each CUDA call with its step and the lineage tag of its thread at the call.
CREATE VIEW cuda_call_lineage AS
SELECT
    x.id AS cuda_call_id,
    x.session_id,
    x.ts,                               -- ns at entry
    x.dur,                              -- ns entry -> return
    x.thread_id,                        -- calling thread
    x.process_id,                       -- its process
    a.name AS api,                      -- e.g. 'cudaMalloc'
    sm.step,                            -- the process's step at ts; NULL before its first step or without steps
    sm.inferred AS step_inferred,       -- 1 when that step was inferred without markers
    sm.id AS step_mark_id,              -- step_mark row that began that step
    nullif(lm.tag, 0) AS tag,           -- lineage tag of the thread at the call, NULL when none
    l.label                             -- the tag's label, NULL when none
FROM (
    SELECT c.id, c.session_id, c.ts, c.dur, c.thread_id, c.api_id, t.process_id,
           CASE WHEN t.process_id IN (SELECT st.process_id FROM step_mark m JOIN thread st ON st.id = m.thread_id)
                THEN (SELECT m.id FROM step_mark m JOIN thread mt ON mt.id = m.thread_id
                      WHERE m.session_id = c.session_id AND m.ts <= c.ts AND mt.process_id = t.process_id
                      ORDER BY m.ts DESC LIMIT 1) END AS step_mark_id,
           (SELECT m.id FROM lineage_mark m WHERE m.thread_id = c.thread_id AND m.ts <= c.ts
            ORDER BY m.ts DESC LIMIT 1) AS lineage_mark_id
    FROM cuda_call c
    LEFT JOIN thread t ON t.id = c.thread_id
) x
JOIN cuda_api a ON a.id = x.api_id
LEFT JOIN step_mark sm ON sm.id = x.step_mark_id
LEFT JOIN lineage_mark lm ON lm.id = x.lineage_mark_id
LEFT JOIN lineage_label l ON l.session_id = x.session_id AND l.tag = nullif(lm.tag, 0);

-- view: nccl_call_lineage
-- Each NCCL call with its step and the lineage tag of its thread at the call.
CREATE VIEW nccl_call_lineage AS
SELECT
    x.id AS nccl_call_id,
    x.session_id,
    x.ts,                               -- ns at entry
    x.dur,                              -- ns entry -> return
    x.thread_id,                        -- calling thread
    x.process_id,                       -- its process (the rank)
    a.name AS api,                      -- e.g. 'ncclAllReduce'
    sm.step,                            -- the process's step at ts; NULL before its first step or without steps
    sm.inferred AS step_inferred,       -- 1 when that step was inferred without markers
    sm.id AS step_mark_id,              -- step_mark row that began that step
    nullif(lm.tag, 0) AS tag,           -- lineage tag of the thread at the call, NULL when none
    l.label                             -- the tag's label, NULL when none
FROM (
    SELECT n.id, n.session_id, n.ts, n.dur, n.thread_id, n.api_id, t.process_id,
           CASE WHEN t.process_id IN (SELECT st.process_id FROM step_mark m JOIN thread st ON st.id = m.thread_id)
                THEN (SELECT m.id FROM step_mark m JOIN thread mt ON mt.id = m.thread_id
                      WHERE m.session_id = n.session_id AND m.ts <= n.ts AND mt.process_id = t.process_id
                      ORDER BY m.ts DESC LIMIT 1) END AS step_mark_id,
           (SELECT m.id FROM lineage_mark m WHERE m.thread_id = n.thread_id AND m.ts <= n.ts
            ORDER BY m.ts DESC LIMIT 1) AS lineage_mark_id
    FROM nccl_call n
    LEFT JOIN thread t ON t.id = n.thread_id
) x
JOIN nccl_api a ON a.id = x.api_id
LEFT JOIN step_mark sm ON sm.id = x.step_mark_id
LEFT JOIN lineage_mark lm ON lm.id = x.lineage_mark_id
LEFT JOIN lineage_label l ON l.session_id = x.session_id AND l.tag = nullif(lm.tag, 0);
