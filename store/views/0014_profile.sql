-- Views v14: the on-CPU profile (cpu_sample, schema v28) by step: where a step's thread spent its
-- CPU time, as a library and function and a Python line.

-- view: native_frame_outside
-- The frames of native stacks that are neither the interpreter's nor the C library's (python*,
-- libpython*, libc, libm, libpthread, the dynamic loader), with their object's base name: where a
-- sample's CPU time is put when it has one.
CREATE VIEW native_frame_outside AS
SELECT f.stack_id, f.depth, f.object, f.symbol,
       substr(f.object, length(rtrim(f.object, replace(f.object, '/', ''))) + 1) AS library -- base name of the object
FROM native_stack_frame f
WHERE f.object IS NOT NULL
  AND substr(f.object, length(rtrim(f.object, replace(f.object, '/', ''))) + 1) NOT GLOB 'python*'
  AND substr(f.object, length(rtrim(f.object, replace(f.object, '/', ''))) + 1) NOT GLOB 'libpython*'
  AND substr(f.object, length(rtrim(f.object, replace(f.object, '/', ''))) + 1) NOT GLOB 'libc.so*'
  AND substr(f.object, length(rtrim(f.object, replace(f.object, '/', ''))) + 1) NOT GLOB 'libc-*'
  AND substr(f.object, length(rtrim(f.object, replace(f.object, '/', ''))) + 1) NOT GLOB 'libm.so*'
  AND substr(f.object, length(rtrim(f.object, replace(f.object, '/', ''))) + 1) NOT GLOB 'libpthread*'
  AND substr(f.object, length(rtrim(f.object, replace(f.object, '/', ''))) + 1) NOT GLOB 'ld-linux*';

-- view: cpu_sample_site
-- Every on-CPU sample with what it is put on. Its library is the object of the innermost frame of
-- its native stack outside the interpreter and the C library (native_frame_outside: a driver, not
-- the memset it called, nor the interpreter's eval loop); its function is where the thread entered
-- that library: the outermost of the frames in it from there (cuLaunchKernel, not the driver's
-- internal function that spun), and inner_function the innermost. `library` NULL: the thread ran
-- the interpreter or the C library it calls (Python code), or its stack was not walked. Its Python
-- line is its stack's call site (python_call_site: the innermost line of the user's own code).
CREATE VIEW cpu_sample_site AS
SELECT
    x.cpu_sample_id, x.session_id, x.thread_id, x.ts, x.dur, x.in_kernel, x.native_stack_id,
    x.python_stack_id,
    n.library,                          -- base name of the library ('libcuda.so.1'), NULL: Python code
    (SELECT e.symbol FROM native_stack_frame e WHERE e.stack_id = x.native_stack_id AND e.depth = coalesce(
         (SELECT min(o.depth) FROM native_stack_frame o WHERE o.stack_id = x.native_stack_id
            AND o.depth > x.inner_depth AND o.object IS NOT n.object) - 1,
         (SELECT max(o.depth) FROM native_stack_frame o WHERE o.stack_id = x.native_stack_id))
    ) AS function,                      -- the library's function it was entered by, NULL where no symbol covers it
    n.symbol AS inner_function,         -- the innermost function of the library it was in
    p.file || ':' || coalesce(p.line, '?') AS python, -- 'model.py:88', NULL without a Python stack
    p.text AS python_text               -- 'forward() at model.py:88'
FROM (
    SELECT c.id AS cpu_sample_id, c.session_id, c.thread_id, c.ts, c.dur, c.in_kernel, c.native_stack_id,
           c.python_stack_id,
           (SELECT min(o.depth) FROM native_frame_outside o WHERE o.stack_id = c.native_stack_id) AS inner_depth
    FROM cpu_sample c
) x
LEFT JOIN native_frame_outside n ON n.stack_id = x.native_stack_id AND n.depth = x.inner_depth
LEFT JOIN python_call_site p ON p.stack_id = x.python_stack_id;

-- view: step_cpu_profile
-- Causal link: a step -> the CPU time its thread spent in it, by library and function and Python
-- line (cpu_sample_site), largest first per step. `library` NULL: in Python (the interpreter).
-- Query it by step_mark_id: the samples are found through the (thread_id, ts) index.
CREATE VIEW step_cpu_profile AS
SELECT
    st.step_mark_id, st.session_id, st.step,
    s.library,                          -- 'libcuda.so.1'; NULL: Python code (or no native stack)
    s.function,                         -- 'cuLaunchKernel' (where the thread entered the library)
    s.python,                           -- 'train.py:142'
    min(s.python_stack_id) AS python_stack_id, -- one of its Python stacks
    count(*) AS samples,                -- samples in the step
    sum(s.dur) AS dur,                  -- ns of CPU time they stand for
    sum(s.in_kernel) AS in_kernel       -- of the samples, those in kernel code (syscalls, faults)
FROM step st
JOIN cpu_sample_site s ON s.thread_id = st.thread_id AND s.ts >= st.ts AND s.ts < st.end_ts
GROUP BY st.step_mark_id, s.library, s.function, s.python;
