-- Schema v13: CUDA and NCCL calls still in flight, and the rule for the user's line (below).
-- A call is written when it returns; one that never returns (a hung collective, a kernel launch
-- stuck behind a dead GPU) is taken from the in-flight maps when the session stops (or the flight
-- recorder is dumped) and written with open = 1: ts is its entry, dur runs to the moment it was
-- drained (a lower bound), ret is NULL (it has not returned). ret loses its NOT NULL, which SQLite
-- cannot alter: both tables are rebuilt with the same columns (their documentation stays that of
-- the migrations that made them), then gain `open`. legacy_alter_table keeps the rename from
-- checking the views, which are recreated after every migration.
PRAGMA legacy_alter_table = ON;

CREATE TABLE cuda_call_v13 (
    id INTEGER PRIMARY KEY,
    session_id INTEGER NOT NULL REFERENCES session(id),
    ts INTEGER NOT NULL,
    dur INTEGER NOT NULL,
    thread_id INTEGER NOT NULL REFERENCES thread(id),
    api_id INTEGER NOT NULL REFERENCES cuda_api(id),
    ret INTEGER,
    size_bytes INTEGER,
    size_class INTEGER,
    stream INTEGER,
    function INTEGER,
    pointer INTEGER,
    event_handle INTEGER,
    memcpy_kind INTEGER,
    grid TEXT,
    block TEXT,
    shared_mem_bytes INTEGER,
    cgroup_id INTEGER NOT NULL,
    python_stack_id INTEGER REFERENCES python_stack(id),
    native_stack_id INTEGER REFERENCES native_stack(id)
);
INSERT INTO cuda_call_v13 (id, session_id, ts, dur, thread_id, api_id, ret, size_bytes, size_class, stream,
                           function, pointer, event_handle, memcpy_kind, grid, block, shared_mem_bytes, cgroup_id,
                           python_stack_id, native_stack_id)
SELECT id, session_id, ts, dur, thread_id, api_id, ret, size_bytes, size_class, stream, function, pointer,
       event_handle, memcpy_kind, grid, block, shared_mem_bytes, cgroup_id, python_stack_id, native_stack_id
FROM cuda_call;
DROP TABLE cuda_call;
ALTER TABLE cuda_call_v13 RENAME TO cuda_call;

CREATE TABLE nccl_call_v13 (
    id INTEGER PRIMARY KEY,
    session_id INTEGER NOT NULL REFERENCES session(id),
    ts INTEGER NOT NULL,
    dur INTEGER NOT NULL,
    thread_id INTEGER NOT NULL REFERENCES thread(id),
    api_id INTEGER NOT NULL REFERENCES nccl_api(id),
    ret INTEGER,
    count INTEGER,
    datatype INTEGER,
    op INTEGER,
    peer INTEGER,
    handle INTEGER,
    stream INTEGER,
    cgroup_id INTEGER NOT NULL,
    python_stack_id INTEGER REFERENCES python_stack(id)
);
INSERT INTO nccl_call_v13 (id, session_id, ts, dur, thread_id, api_id, ret, count, datatype, op, peer, handle,
                           stream, cgroup_id, python_stack_id)
SELECT id, session_id, ts, dur, thread_id, api_id, ret, count, datatype, op, peer, handle, stream, cgroup_id,
       python_stack_id
FROM nccl_call;
DROP TABLE nccl_call;
ALTER TABLE nccl_call_v13 RENAME TO nccl_call;

PRAGMA legacy_alter_table = OFF;

ALTER TABLE cuda_call ADD COLUMN open INTEGER NOT NULL DEFAULT 0; -- 1: had not returned when the session stopped (or the recording was dumped): a hang's call; ret is NULL and dur runs to that moment
ALTER TABLE nccl_call ADD COLUMN open INTEGER NOT NULL DEFAULT 0; -- 1: had not returned when the session stopped (or the recording was dumped): a hang's call; ret is NULL and dur runs to that moment

-- The user's line. A report's "Python:" line is the innermost frame of the user's own code: not the
-- standard library, not an installed package (site-packages, dist-packages), not glue (ctypes,
-- functools, contextlib, importlib, the recorder's marker API: python_frame.noise). A frame whose
-- file matches a pattern below with user = 0 is not the user's, unless a pattern with user = 1 also
-- matches (a training package installed into site-packages, a project kept under a python3 lib
-- folder). The python_frame and python_call_site views read this table: change its rows in the
-- sqlite3 shell and every report and MCP tool follows.

-- table: user_code_rule
-- LIKE patterns on a Python frame's file (python_code.filename) that say whose code it is.
CREATE TABLE user_code_rule (
    pattern TEXT PRIMARY KEY,           -- LIKE pattern on co_filename ('%/site-packages/%')
    user INTEGER NOT NULL,              -- 0: not the user's code; 1: the user's code, over any 0 pattern
    why TEXT                            -- what the pattern stands for
);
INSERT INTO user_code_rule (pattern, user, why) VALUES
    ('%/lib/python3%/%', 0, 'the standard library (and the packages installed under it)'),
    ('%/lib/pypy3%/%', 0, 'the standard library of PyPy'),
    ('%/site-packages/%', 0, 'installed packages'),
    ('%/dist-packages/%', 0, 'installed packages (Debian)'),
    ('<frozen %', 0, 'frozen modules (importlib, runpy)');
