-- Schema v27: what other tools recorded, imported (`recorder import`): the device's own timeline
-- (kernels, copies, memsets) and the host's operators, runtime calls and annotations from PyTorch
-- profiler traces, and the collectives of NCCL Flight Recorder dumps. An imported trace is a session
-- like a recorded one; its ts are ns of the trace's own clock (the profiler's), and
-- session.wall_offset_ns turns them into Unix time as for recordings.

-- table: trace_import
-- One imported file: where it came from and what it says about its process's place in the job.
CREATE TABLE trace_import (
    id INTEGER PRIMARY KEY,
    session_id INTEGER NOT NULL REFERENCES session(id),
    path TEXT NOT NULL,                 -- the file as given to `recorder import` (absolute)
    format TEXT NOT NULL,               -- 'chrome_trace' (torch.profiler / Kineto) or 'flight_recorder' (NCCL dump)
    sha256 TEXT NOT NULL,               -- of the file's bytes: the same bytes for the same rank are not imported twice
    size_bytes INTEGER NOT NULL,        -- of the file as read (compressed when .gz)
    events INTEGER NOT NULL,            -- events (trace) or entries (dump) read
    skipped INTEGER NOT NULL,           -- events read but not stored (flow arrows, counters, unknown kinds)
    rank INTEGER,                       -- the process's global rank (distributedInfo.rank / the dump's rank); NULL unknown
    world_size INTEGER,                 -- ranks in the job; NULL unknown
    backend TEXT,                       -- 'nccl', 'gloo', ...; NULL unknown
    runtime TEXT,                       -- 'cuda', 'rocm' or NULL when the trace has no device activity
    distributed TEXT,                   -- the trace's distributedInfo (or the dump's pg_config) as JSON; NULL when absent
    joined_session_id INTEGER REFERENCES session(id), -- the recording `recorder import --join` lined it up with
                                        -- (or tried to); NULL: imported on its own
    clock_offset_ns INTEGER,            -- ns added to the trace's ts to put them on that recording's CLOCK_MONOTONIC;
                                        -- NULL: not aligned (the trace is then a session of its own)
    clock_matches INTEGER,              -- runtime calls matched to the recording's uprobe rows for that offset
    clock_note TEXT,                    -- how the alignment went, or why none was possible
    imported_ts INTEGER NOT NULL        -- Unix ns when imported
);

-- table: host_op
-- One host-side interval of a profiler trace: an operator ('cpu_op'), a Python function
-- ('python_function'), a CUDA/HIP runtime or driver call ('runtime'), a user annotation
-- ('annotation', ProfilerStep#N included) or anything else the profiler put on a host thread.
CREATE TABLE host_op (
    id INTEGER PRIMARY KEY,
    session_id INTEGER NOT NULL REFERENCES session(id),
    ts INTEGER NOT NULL,                -- ns the op began (trace clock)
    dur INTEGER NOT NULL,               -- ns
    thread_id INTEGER NOT NULL REFERENCES thread(id),
    kind TEXT NOT NULL,                 -- 'cpu_op', 'python_function', 'runtime', 'annotation', 'other'
    name_id INTEGER NOT NULL REFERENCES string(id), -- operator, function ('train.py(42): step'), API or label
    correlation INTEGER,                -- runtime calls: the id the device activity they launched carries
    external_id INTEGER                 -- the profiler's link between an op and the runtime calls it made
);

-- table: device_activity
-- One interval of work on a device: a kernel, a copy or a memset (and the device-side copy of a user
-- annotation, kind 'annotation', which is no work and counts in no busy share).
CREATE TABLE device_activity (
    id INTEGER PRIMARY KEY,
    session_id INTEGER NOT NULL REFERENCES session(id),
    ts INTEGER NOT NULL,                -- ns the activity began on the device (trace clock)
    dur INTEGER NOT NULL,               -- ns
    process_id INTEGER REFERENCES process(id), -- the process whose profiler saw it (the launcher)
    kind TEXT NOT NULL,                 -- 'kernel', 'memcpy', 'memset'; 'annotation' and 'sync' (the device's view of a
                                        -- host wait) are no work and count in no busy share
    name_id INTEGER NOT NULL REFERENCES string(id), -- kernel name, 'Memcpy HtoD (Pinned -> Device)', ...
    device INTEGER NOT NULL,            -- device index as the profiler numbered it
    stream INTEGER,                     -- stream (CUDA) or queue (HIP) id
    correlation INTEGER,                -- the launching runtime call's correlation (host_op.correlation)
    launch_op_id INTEGER REFERENCES host_op(id), -- that runtime call; NULL when the trace lacks it
    size_bytes INTEGER,                 -- bytes copied or set; NULL for kernels
    grid TEXT,                          -- 'x,y,z' grid of a kernel
    block TEXT                          -- 'x,y,z' block of a kernel
);

-- table: collective_record
-- One entry of an NCCL Flight Recorder dump (PyTorch's format): a collective or point-to-point
-- operation of a process group as one rank saw it, and how far it got at the dump.
CREATE TABLE collective_record (
    id INTEGER PRIMARY KEY,
    session_id INTEGER NOT NULL REFERENCES session(id),
    trace_import_id INTEGER NOT NULL REFERENCES trace_import(id),
    rank INTEGER NOT NULL,              -- the dumping rank
    pg_name TEXT NOT NULL,              -- process group name ('0', ...)
    pg_desc TEXT,                       -- its description ('default_pg', ...)
    collective_seq_id INTEGER,          -- n-th collective of the group on this rank (equal across ranks for one op)
    p2p_seq_id INTEGER,                 -- n-th point-to-point op of the group on this rank
    op_id INTEGER,                      -- the record's id in the rank's ring
    profiling_name TEXT NOT NULL,       -- 'nccl:all_reduce', ...
    state TEXT NOT NULL,                -- 'scheduled', 'started' or 'completed' at the dump
    ts INTEGER,                         -- ns the work was created (time_created_ns, Unix clock); NULL unknown
    started_ts INTEGER,                 -- ns discovered started, NULL when not
    completed_ts INTEGER,               -- ns discovered completed, NULL when not
    timeout_ms INTEGER,                 -- the group's watchdog timeout
    input_sizes TEXT,                   -- JSON list of input tensor shapes
    output_sizes TEXT                   -- JSON list of output tensor shapes
);

-- A step may end where its source says, not at the next step: an imported trace's
-- ProfilerStep#N annotation. NULL: the step ends at the next step mark (recorded steps).
ALTER TABLE step_mark ADD COLUMN end_ts INTEGER; -- ns the step ended, when its source says so
