-- Schema v29: kernel launches counted, not one row each. By default a kernel launch (every runtime
-- and driver launch API; not graph launches, copies, allocations, synchronisations or NCCL calls,
-- which keep their cuda_call rows) has an entry probe only: it is counted in BPF per thread, and one
-- in STALL_RECORDER_LAUNCH_STACK_SAMPLE (64) is kept as a sample with its Python and native stacks.
-- `record`/`start --launch-rows` (STALL_RECORDER_LAUNCH_ROWS=1) keeps one cuda_call row per launch
-- with its duration instead, as recordings made before this version have.

-- table: cuda_launch_count
-- A thread's kernel launches of one kernel in one interval: the launches it made between two of its
-- blocking CUDA calls (synchronisation, copy, allocation), NCCL calls or step markers, at most 1 s
-- apart; one row per kernel launched in the interval (the first 8 distinct ones of the interval, the
-- others together in a row with api_id and function NULL). Every launch is counted once: a driver
-- launch the runtime's launch makes inside it is that runtime launch's. The interval lies inside one
-- step of its thread (a step marker ends it).
CREATE TABLE cuda_launch_count (
    id INTEGER PRIMARY KEY,             -- (the rowid: the flight recorder keeps and cuts its window by it)
    session_id INTEGER NOT NULL REFERENCES session(id),
    ts INTEGER NOT NULL,                -- ns CLOCK_MONOTONIC of the interval's first launch
    dur INTEGER NOT NULL,               -- ns from the interval's first launch to its last (not time inside launches)
    thread_id INTEGER NOT NULL REFERENCES thread(id), -- the launching thread
    api_id INTEGER REFERENCES cuda_api(id), -- the launch API (cudaLaunchKernel, cuLaunchKernel, ...); NULL: the kernels beyond the first 8
    function INTEGER,                   -- the kernel: its function pointer (runtime) or CUfunction (driver); NULL with api_id NULL
    launches INTEGER NOT NULL,          -- launches of this kernel by this thread in the interval
    cgroup_id INTEGER                   -- the thread's cgroup id at the interval's first launch
);

-- table: cuda_launch_sample
-- One kernel launch in STALL_RECORDER_LAUNCH_STACK_SAMPLE (at random), with its stacks at its entry
-- (no duration: a counted launch has no return probe). Each is also in cuda_launch_count.
CREATE TABLE cuda_launch_sample (
    id INTEGER PRIMARY KEY,
    session_id INTEGER NOT NULL REFERENCES session(id),
    ts INTEGER NOT NULL,                -- ns CLOCK_MONOTONIC of the launch's entry
    thread_id INTEGER NOT NULL REFERENCES thread(id),
    api_id INTEGER NOT NULL REFERENCES cuda_api(id),
    function INTEGER,                   -- kernel function pointer / CUfunction
    stream INTEGER,                     -- the stream it launched on
    grid TEXT,                          -- 'x,y,z'
    block TEXT,                         -- 'x,y,z'
    python_stack_id INTEGER REFERENCES python_stack(id), -- NULL when its record was lost
    native_stack_id INTEGER REFERENCES native_stack(id)  -- NULL when not walked
);
