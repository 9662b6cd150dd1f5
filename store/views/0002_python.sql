-- Views v2: the Python line of every CUDA call. A call's Python stack is captured in BPF at its
-- entry; its innermost frame of the user's own code that is not glue (below) is the call site, the
-- line in the user's program that made the call (user_code_rule, schema v13).

-- view: python_frame
-- Every stored Python frame with its code object and a one-line text. Glue frames (`noise`) are
-- code that forwards a call without being its cause, the same for every program: ctypes' own Python
-- wrappers, functools/contextlib wrappers, importlib's frozen bootstrap, and the recorder's marker API.
CREATE VIEW python_frame AS
SELECT
    f.stack_id,                         -- python_stack.id
    f.depth,                            -- 0 = innermost
    f.code_id,                          -- python_code.id, NULL when unresolved
    f.line,                             -- executing line
    c.filename,                         -- full co_filename
    substr(c.filename, length(rtrim(c.filename, replace(c.filename, '/', ''))) + 1) AS file, -- base name of filename
    c.qualname,                         -- qualified function name
    c.first_line,                       -- line of the def
    CASE WHEN c.id IS NULL THEN '<unresolved frame>'
         ELSE c.qualname || '() at ' || substr(c.filename, length(rtrim(c.filename, replace(c.filename, '/', ''))) + 1)
              || ':' || coalesce(f.line, '?')
    END AS text,                        -- 'forward() at train.py:142'
    coalesce(c.filename LIKE '<frozen %'
             OR c.filename LIKE '%/ctypes/__init__.py'
             OR c.filename LIKE '%/functools.py'
             OR c.filename LIKE '%/contextlib.py'
             OR c.filename LIKE '%/recorder/markers.py', 0) AS noise, -- 1 for glue frames (above)
    CASE WHEN c.id IS NULL THEN 0
         WHEN EXISTS (SELECT 1 FROM user_code_rule r WHERE r.user = 1 AND c.filename LIKE r.pattern) THEN 1
         WHEN EXISTS (SELECT 1 FROM user_code_rule r WHERE r.user = 0 AND c.filename LIKE r.pattern) THEN 0
         ELSE 1
    END AS user_code                    -- 1 for the user's own code: no user_code_rule pattern with user = 0 matches, or one with user = 1 does
FROM python_stack_frame f
LEFT JOIN python_code c ON c.id = f.code_id;

-- view: python_call_site
-- Per stack, the line the report names: the innermost frame of the user's own code that is not glue
-- (user_code_rule: not the standard library or an installed package); when the stack has none,
-- the innermost frame that is not glue; the innermost frame when all are glue.
CREATE VIEW python_call_site AS
SELECT f.*
FROM python_frame f
WHERE f.depth = (SELECT coalesce(min(CASE WHEN g.noise = 0 AND g.user_code = 1 THEN g.depth END),
                                 min(CASE WHEN g.noise = 0 THEN g.depth END), 0)
                 FROM python_frame g WHERE g.stack_id = f.stack_id);

-- view: python_stack_text
-- Every Python stack as text: its call site and all its frames, innermost first, one per line.
CREATE VIEW python_stack_text AS
SELECT
    s.id AS stack_id,                   -- python_stack.id
    s.session_id,
    s.status,                           -- 'ok', or why the stack is partial or missing
    s.depth,                            -- frames stored
    p.text AS call_site,                -- 'qualname() at file:line' of the call site; NULL without frames
    (SELECT text FROM python_frame WHERE stack_id = s.id AND depth = 0) AS innermost, -- the innermost frame's text
    (SELECT group_concat(text, char(10))
     FROM (SELECT text FROM python_frame WHERE stack_id = s.id ORDER BY depth)) AS stack_text -- all frames, innermost first
FROM python_stack s
LEFT JOIN python_call_site p ON p.stack_id = s.id;

-- view: cuda_call_python
-- Every CUDA call with its Python call site. python_line is '<status>' (e.g. '<no python thread
-- state>') when the call has no Python stack, and NULL when its stack record was lost.
CREATE VIEW cuda_call_python AS
SELECT
    c.id AS cuda_call_id,               -- cuda_call.id
    c.session_id, c.ts, c.dur, c.thread_id, c.api_id,
    c.python_stack_id,                  -- python_stack.id
    c.native_stack_id,                  -- native_stack.id
    s.status AS python_status,          -- python_stack.status
    p.filename AS python_file,          -- full path of the call site's file
    p.line AS python_lineno,            -- the call site's executing line
    p.qualname AS python_function,      -- the call site's function
    CASE WHEN p.text IS NOT NULL THEN p.text
         WHEN s.id IS NOT NULL THEN '<' || s.status || '>' END AS python_line -- 'forward() at train.py:142'
FROM cuda_call c
LEFT JOIN python_stack s ON s.id = c.python_stack_id
LEFT JOIN python_call_site p ON p.stack_id = c.python_stack_id;

-- view: python_lines
-- Time inside CUDA calls per Python call site (file and line), the heaviest first.
CREATE VIEW python_lines AS
SELECT
    x.session_id,
    p.filename AS python_file,          -- full path of the call site's file
    p.line AS python_lineno,            -- executing line
    p.qualname AS python_function,      -- function containing it
    p.text AS python_line,              -- 'forward() at train.py:142'
    sum(x.calls) AS calls,              -- CUDA calls made from this line
    sum(x.dur) AS dur,                  -- ns inside those calls
    max(x.max_dur) AS max_dur           -- ns, the longest of them
FROM (
    SELECT session_id, python_stack_id, count(*) AS calls, sum(dur) AS dur, max(dur) AS max_dur
    FROM cuda_call WHERE python_stack_id IS NOT NULL
    GROUP BY session_id, python_stack_id
) x
JOIN python_call_site p ON p.stack_id = x.python_stack_id
GROUP BY x.session_id, p.filename, p.line, p.qualname
ORDER BY dur DESC;
