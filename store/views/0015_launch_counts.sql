-- Views v15: kernel launches, counted (cuda_launch_count, cuda_launch_sample, schema v29) or one
-- cuda_call row each (recordings made with --launch-rows, and every recording made before schema
-- v29): the same figures either way, saying which.

-- view: kernel_launch_count
-- Kernel launches per thread and interval and kernel, from either source. `how` is 'counted' (a
-- cuda_launch_count row: its launches between two blocking calls of its thread) or 'row' (one
-- cuda_call row per launch, its duration known).
CREATE VIEW kernel_launch_count AS
SELECT c.session_id, c.ts, c.dur, c.thread_id, c.api_id, a.name AS api, a.family, c.function, c.launches,
       'counted' AS how
FROM cuda_launch_count c
LEFT JOIN cuda_api a ON a.id = c.api_id
UNION ALL
SELECT c.session_id, c.ts, c.dur, c.thread_id, c.api_id, a.name AS api, a.family, c.function, 1 AS launches,
       'row' AS how
FROM cuda_call c
JOIN cuda_api a ON a.id = c.api_id
WHERE a.arguments IN ('launch_rt', 'launch_drv', 'launch_drv_ex', 'launch_rt_ex');

-- view: cuda_launch_sample_python
-- The sampled launches with the Python line that made each (its stack's call site).
CREATE VIEW cuda_launch_sample_python AS
SELECT s.*, a.name AS api,
       ps.status AS python_status,      -- python_stack.status
       p.filename AS python_file,       -- full path of the call site's file
       p.line AS python_lineno,         -- the call site's executing line
       p.qualname AS python_function,   -- the call site's function
       CASE WHEN p.text IS NOT NULL THEN p.text
            WHEN ps.id IS NOT NULL THEN '<' || ps.status || '>' END AS python_line -- 'forward() at train.py:142'
FROM cuda_launch_sample s
JOIN cuda_api a ON a.id = s.api_id
LEFT JOIN python_stack ps ON ps.id = s.python_stack_id
LEFT JOIN python_call_site p ON p.stack_id = s.python_stack_id;

-- view: step_launch
-- Kernel launches per step: those of every thread of the step's process in the step's [ts, end_ts)
-- (a step marker ends every thread's counted interval of that process, so the counts are exact),
-- how many of them were kept as samples with their stacks, and whether they were counted or rows.
CREATE VIEW step_launch AS
SELECT st.step_mark_id, st.session_id, st.step, st.thread_id, st.process_id,
       coalesce((SELECT sum(k.launches) FROM cuda_launch_count k JOIN thread t ON t.id = k.thread_id
                 WHERE t.process_id = st.process_id AND k.session_id = st.session_id
                   AND k.ts >= st.ts AND k.ts < st.end_ts), 0)
       + (SELECT count(*) FROM cuda_call c JOIN thread t ON t.id = c.thread_id JOIN cuda_api a ON a.id = c.api_id
          WHERE t.process_id = st.process_id AND c.session_id = st.session_id AND c.ts >= st.ts AND c.ts < st.end_ts
            AND a.arguments IN ('launch_rt', 'launch_drv', 'launch_drv_ex', 'launch_rt_ex')) AS launches,
       (SELECT count(*) FROM cuda_launch_sample s JOIN thread t ON t.id = s.thread_id
        WHERE t.process_id = st.process_id AND s.session_id = st.session_id
          AND s.ts >= st.ts AND s.ts < st.end_ts) AS sampled, -- launches kept with their stacks (counted recordings)
       CASE WHEN EXISTS (SELECT 1 FROM cuda_launch_count k WHERE k.session_id = st.session_id)
            THEN 'counted' ELSE 'row' END AS how
FROM step st;
