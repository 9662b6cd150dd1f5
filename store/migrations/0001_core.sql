-- Schema v1: sessions, identity, capability and loss accounting, off-CPU intervals, CUDA calls.
-- Conventions: ts and dur are nanoseconds of CLOCK_MONOTONIC (what bpf_ktime_get_ns() returns);
-- sizes are bytes and named *_bytes; every event row belongs to a session and a thread.

-- table: session
-- One recording. wall_offset_ns turns any ts into wall-clock time: unix_ns = ts + wall_offset_ns.
CREATE TABLE session (
    id INTEGER PRIMARY KEY,
    started_ts INTEGER NOT NULL,        -- ns CLOCK_MONOTONIC when probes were attached
    stopped_ts INTEGER,                 -- ns CLOCK_MONOTONIC when the recorder stopped; NULL while recording or after a crash
    wall_offset_ns INTEGER NOT NULL,    -- ns to add to a ts to get Unix time (CLOCK_REALTIME)
    status TEXT NOT NULL,               -- 'recording' or 'complete'; 'recording' with no live recorder reads as incomplete
    recorder_pid INTEGER NOT NULL,      -- pid of the recording process
    hostname TEXT NOT NULL,             -- host the session was recorded on
    kernel_release TEXT NOT NULL,       -- uname -r
    boot_id TEXT NOT NULL,              -- /proc/sys/kernel/random/boot_id: ts values compare only within one boot
    cpu_count INTEGER NOT NULL,         -- online CPUs
    target TEXT NOT NULL,               -- what was recorded: 'pids 123,456', 'cgroup /sys/fs/cgroup/...', 'all', 'command ...'
    command TEXT NOT NULL,              -- the recorder's own command line
    tool_version TEXT NOT NULL          -- stall-recorder version that wrote the session
);

-- table: string
-- Interned text repeated across many rows (task names, library paths).
CREATE TABLE string (
    id INTEGER PRIMARY KEY,
    value TEXT NOT NULL UNIQUE          -- the text
);

-- table: process
-- A process seen during a session. (pid, start_ticks) identify it: a reused pid gets a new row.
CREATE TABLE process (
    id INTEGER PRIMARY KEY,
    session_id INTEGER NOT NULL REFERENCES session(id),
    pid INTEGER NOT NULL,               -- tgid
    start_ticks INTEGER,                -- /proc/PID/stat starttime (clock ticks after boot); NULL if it exited before it was read
    parent_pid INTEGER,                 -- ppid when first seen
    name TEXT,                          -- comm of the main thread
    cmdline TEXT,                       -- argv joined by spaces; NULL when unreadable
    first_ts INTEGER NOT NULL,          -- ns of the first event or scan that saw it
    exec_ts INTEGER,                    -- ns of the last exec seen during the session
    exit_ts INTEGER                     -- ns the main thread exited, NULL if alive at stop
);

-- table: thread
-- A thread seen during a session, the key every event row refers to.
CREATE TABLE thread (
    id INTEGER PRIMARY KEY,
    session_id INTEGER NOT NULL REFERENCES session(id),
    tid INTEGER NOT NULL,               -- kernel task id
    process_id INTEGER REFERENCES process(id), -- owning process; NULL for tasks outside the targets whose process could not be read
    name TEXT,                          -- comm (16 bytes at most)
    first_ts INTEGER NOT NULL,          -- ns of the first event that named it
    exit_ts INTEGER,                    -- ns it exited, NULL if alive at stop
    traced INTEGER NOT NULL DEFAULT 1   -- 1 for threads of the targets, 0 for others seen only as preemptors or wakers
);

-- table: capability
-- Every probe and data source the session tried: attached or not, and why. A report uses it to say
-- which layers were observed and which were not.
CREATE TABLE capability (
    id INTEGER PRIMARY KEY,
    session_id INTEGER NOT NULL REFERENCES session(id),
    layer TEXT NOT NULL,                -- 'sched', 'cuda', 'nccl', 'block', 'python', 'kmsg', ...
    probe TEXT NOT NULL,                -- tracepoint 'sched:sched_switch', symbol 'cudaMalloc', ...
    target TEXT NOT NULL DEFAULT '',    -- library path or pid the probe applies to, '' for global probes
    status TEXT NOT NULL,               -- 'attached', 'absent' (not in this kernel or library), 'failed'
    detail TEXT NOT NULL DEFAULT '',    -- why, for anything but attached
    ts INTEGER NOT NULL                 -- ns when decided
);

-- table: loss
-- Events the recorder knows it lost, per probe and per second. An empty table for a session means
-- nothing was dropped.
CREATE TABLE loss (
    id INTEGER PRIMARY KEY,
    session_id INTEGER NOT NULL REFERENCES session(id),
    ts INTEGER NOT NULL,                -- ns start of the one-second window
    probe TEXT NOT NULL,                -- which buffer or map overflowed
    dropped INTEGER NOT NULL            -- events lost in that second
);

-- table: library
-- A CUDA/NCCL library mapped by a target, with the probes attached to it.
CREATE TABLE library (
    id INTEGER PRIMARY KEY,
    session_id INTEGER NOT NULL REFERENCES session(id),
    path TEXT NOT NULL,                 -- file as seen in /proc/PID/maps
    kind TEXT NOT NULL,                 -- 'runtime' (libcudart), 'driver' (libcuda), 'nccl'
    first_ts INTEGER NOT NULL,          -- ns when found
    found_by TEXT NOT NULL              -- 'maps' (scan at start), 'dlopen', 'exec', 'rescan', 'option'
);

-- table: task_state
-- Decoding of offcpu_interval.state (the kernel's sched_switch prev_state).
CREATE TABLE task_state (
    state INTEGER PRIMARY KEY,          -- value of prev_state
    letter TEXT NOT NULL,               -- as ps and sched_switch print it
    reason TEXT NOT NULL                -- 'preempted', 'yield', 'sleep', 'uninterruptible', ...
);
INSERT INTO task_state VALUES
    (0, 'R', 'preempted'),
    (1, 'S', 'sleep'),
    (2, 'D', 'uninterruptible'),
    (4, 'T', 'stopped'),
    (8, 't', 'traced'),
    (64, 'P', 'parked'),
    (128, 'I', 'idle'),
    (256, 'R+', 'preempted');

-- table: offcpu_interval
-- One interval a traced thread spent off the CPU, recorded at its start with its duration.
CREATE TABLE offcpu_interval (
    id INTEGER PRIMARY KEY,
    session_id INTEGER NOT NULL REFERENCES session(id),
    ts INTEGER NOT NULL,                -- ns the thread left the CPU
    dur INTEGER NOT NULL,               -- ns until it ran again (to the session stop if flag open)
    thread_id INTEGER NOT NULL REFERENCES thread(id),
    cpu INTEGER NOT NULL,               -- cpu it left
    state INTEGER NOT NULL,             -- prev_state at switch-out, see task_state (256 = preempted while runnable)
    syscall INTEGER,                    -- syscall number in progress at switch-out, NULL if none (e.g. preempted in user space)
    next_thread_id INTEGER REFERENCES thread(id), -- task that took the CPU at switch-out (the preemptor when preempted)
    waker_thread_id INTEGER REFERENCES thread(id), -- task that woke it, NULL when it was never asleep
    waker_cpu INTEGER,                  -- cpu the waker ran on
    wakeup_ts INTEGER,                  -- ns it was woken (runnable again); NULL when never asleep (preempted)
    in_cpu INTEGER,                     -- cpu it came back on
    contender_thread_id INTEGER REFERENCES thread(id), -- task that ran longest on in_cpu while this thread was runnable (the preemptor, or the task it waited behind after waking)
    contender_run_dur INTEGER,          -- ns that task ran while this thread was runnable
    cgroup_id INTEGER NOT NULL,         -- cgroup v2 id of the thread
    open INTEGER NOT NULL DEFAULT 0     -- 1 when the thread was still off-CPU at stop
);

-- table: cuda_api
-- The CUDA runtime and driver symbols the recorder traces; cuda_call.api_id refers to it. Filled by
-- the recorder from recorder/layers/cuda.py when a session starts (ids are stable for a tool version).
CREATE TABLE cuda_api (
    id INTEGER PRIMARY KEY,             -- index in the recorder's API table
    name TEXT NOT NULL UNIQUE,          -- exported symbol, e.g. 'cudaMalloc', 'cuMemAlloc_v2', 'cudaMemcpy_ptds'
    family TEXT NOT NULL,               -- API without variant suffix, e.g. 'cuMemAlloc'; baselines group by it
    library TEXT NOT NULL,              -- 'runtime' (libcudart) or 'driver' (libcuda)
    arguments TEXT NOT NULL             -- argument layout the entry probe reads: 'malloc', 'launch_rt', ...
);

-- table: cuda_call
-- One CUDA runtime or driver API call, recorded at its entry with its duration.
CREATE TABLE cuda_call (
    id INTEGER PRIMARY KEY,
    session_id INTEGER NOT NULL REFERENCES session(id),
    ts INTEGER NOT NULL,                -- ns at entry
    dur INTEGER NOT NULL,               -- ns entry -> return
    thread_id INTEGER NOT NULL REFERENCES thread(id),
    api_id INTEGER NOT NULL REFERENCES cuda_api(id), -- the symbol called (name, family, library in cuda_api)
    ret INTEGER NOT NULL,               -- cudaError_t / CUresult returned (0 = success)
    size_bytes INTEGER,                 -- bytes allocated or copied; NULL when not meaningful
    size_class INTEGER,                 -- bit length of size_bytes (a power-of-two bucket) for baselines
    stream INTEGER,                     -- cudaStream_t / CUstream handle; NULL when the API takes none
    function INTEGER,                   -- kernel function pointer (launches)
    pointer INTEGER,                    -- pointer allocated (read at return) or freed
    event_handle INTEGER,               -- cudaEvent_t / CUevent for event synchronisation
    memcpy_kind INTEGER,                -- cudaMemcpyKind for runtime copies
    grid TEXT,                          -- 'x,y,z' grid dimensions of a launch
    block TEXT,                         -- 'x,y,z' block dimensions of a launch
    shared_mem_bytes INTEGER,           -- dynamic shared memory of a launch
    cgroup_id INTEGER NOT NULL          -- cgroup v2 id of the calling thread
);

-- table: syscall_name
-- x86-64 syscall numbers the reports name, with the class used to explain a blocked interval.
CREATE TABLE syscall_name (
    nr INTEGER PRIMARY KEY,             -- syscall number (x86-64)
    name TEXT NOT NULL,                 -- syscall name
    class TEXT NOT NULL                 -- 'futex', 'sleep', 'poll', 'io', 'net', 'memory', 'other'
);
INSERT INTO syscall_name VALUES
    (0, 'read', 'io'),
    (1, 'write', 'io'),
    (2, 'open', 'io'),
    (3, 'close', 'io'),
    (4, 'stat', 'io'),
    (5, 'fstat', 'io'),
    (7, 'poll', 'poll'),
    (9, 'mmap', 'memory'),
    (10, 'mprotect', 'memory'),
    (11, 'munmap', 'memory'),
    (12, 'brk', 'memory'),
    (16, 'ioctl', 'other'),
    (17, 'pread64', 'io'),
    (18, 'pwrite64', 'io'),
    (19, 'readv', 'io'),
    (20, 'writev', 'io'),
    (23, 'select', 'poll'),
    (24, 'sched_yield', 'sleep'),
    (25, 'mremap', 'memory'),
    (26, 'msync', 'io'),
    (28, 'madvise', 'memory'),
    (34, 'pause', 'sleep'),
    (35, 'nanosleep', 'sleep'),
    (40, 'sendfile', 'io'),
    (42, 'connect', 'net'),
    (43, 'accept', 'net'),
    (44, 'sendto', 'net'),
    (45, 'recvfrom', 'net'),
    (46, 'sendmsg', 'net'),
    (47, 'recvmsg', 'net'),
    (56, 'clone', 'other'),
    (59, 'execve', 'other'),
    (60, 'exit', 'other'),
    (61, 'wait4', 'poll'),
    (74, 'fsync', 'io'),
    (75, 'fdatasync', 'io'),
    (76, 'truncate', 'io'),
    (77, 'ftruncate', 'io'),
    (82, 'rename', 'io'),
    (162, 'sync', 'io'),
    (202, 'futex', 'futex'),
    (230, 'clock_nanosleep', 'sleep'),
    (231, 'exit_group', 'other'),
    (232, 'epoll_wait', 'poll'),
    (247, 'waitid', 'poll'),
    (257, 'openat', 'io'),
    (262, 'newfstatat', 'io'),
    (264, 'renameat', 'io'),
    (270, 'pselect6', 'poll'),
    (271, 'ppoll', 'poll'),
    (275, 'splice', 'io'),
    (277, 'sync_file_range', 'io'),
    (281, 'epoll_pwait', 'poll'),
    (285, 'fallocate', 'io'),
    (288, 'accept4', 'net'),
    (295, 'preadv', 'io'),
    (296, 'pwritev', 'io'),
    (299, 'recvmmsg', 'net'),
    (306, 'syncfs', 'io'),
    (307, 'sendmmsg', 'net'),
    (316, 'renameat2', 'io'),
    (332, 'statx', 'io'),
    (426, 'io_uring_enter', 'poll'),
    (435, 'clone3', 'other'),
    (441, 'epoll_pwait2', 'poll'),
    (449, 'futex_waitv', 'futex');
