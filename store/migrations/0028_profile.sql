-- Schema v28: the on-CPU profile. A software CPU-clock perf event samples every CPU at the session's
-- --profile-hz (recorder/layers/profile); a sample that interrupted a traced thread is a row here,
-- with the thread's native user stack and its Python stack at that instant. A thread off the CPU is
-- never sampled: the rows are where the traced threads' CPU time went, each standing for `dur` of it.

-- table: cpu_sample
-- One on-CPU sample of a traced thread.
CREATE TABLE cpu_sample (
    id INTEGER PRIMARY KEY,
    session_id INTEGER NOT NULL REFERENCES session(id),
    ts INTEGER NOT NULL,                -- ns CLOCK_MONOTONIC of the sample
    thread_id INTEGER NOT NULL REFERENCES thread(id), -- the thread that was running
    cpu INTEGER NOT NULL,               -- the CPU it ran on
    dur INTEGER NOT NULL,               -- ns of CPU time the sample stands for: 1 s / the sampling rate
    in_kernel INTEGER NOT NULL,         -- 1 when it interrupted kernel code of the thread (a syscall, a fault), 0 user code
    native_stack_id INTEGER REFERENCES native_stack(id), -- its native user stack (depth 0: the instruction it was at); NULL when not walked (capability profile/native stacks)
    python_stack_id INTEGER REFERENCES python_stack(id)  -- its Python stack; NULL when its record was lost
);
