-- Schema v13: CUDA and NCCL calls still in flight. A call is written when it returns; one that never
-- returns (a hung collective, a kernel launch stuck behind a dead GPU) is taken from the in-flight
-- maps when the session stops (or the flight recorder is dumped) and written with open = 1: ts is
-- its entry, dur runs to the moment it was drained (a lower bound), ret is NULL (it has not
-- returned). Both tables are rebuilt because ret loses its NOT NULL (SQLite cannot alter a column);
-- legacy_alter_table keeps the rename from checking views, which are recreated after every migration.
PRAGMA legacy_alter_table = ON;

-- table: cuda_call
-- One CUDA runtime or driver API call, recorded at its entry with its duration; a call still in
-- flight when the session stopped has open = 1.
CREATE TABLE cuda_call_v13 (
    id INTEGER PRIMARY KEY,
    session_id INTEGER NOT NULL REFERENCES session(id),
    ts INTEGER NOT NULL,                -- ns at entry
    dur INTEGER NOT NULL,               -- ns entry -> return (open calls: entry -> when drained)
    thread_id INTEGER NOT NULL REFERENCES thread(id),
    api_id INTEGER NOT NULL REFERENCES cuda_api(id), -- the symbol called (name, family, library in cuda_api)
    ret INTEGER,                        -- cudaError_t / CUresult returned (0 = success); NULL while open
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
    cgroup_id INTEGER NOT NULL,         -- cgroup v2 id of the calling thread
    python_stack_id INTEGER REFERENCES python_stack(id), -- Python stack at the call's entry
    native_stack_id INTEGER REFERENCES native_stack(id), -- native stack at the call's entry
    open INTEGER NOT NULL DEFAULT 0     -- 1: had not returned when drained (stop or dump): a hang's call
);
INSERT INTO cuda_call_v13 SELECT *, 0 FROM cuda_call;
DROP TABLE cuda_call;
ALTER TABLE cuda_call_v13 RENAME TO cuda_call;

-- table: nccl_call
-- One NCCL call, recorded at its entry with its duration; a call still in flight when the session
-- stopped has open = 1.
CREATE TABLE nccl_call_v13 (
    id INTEGER PRIMARY KEY,
    session_id INTEGER NOT NULL REFERENCES session(id),
    ts INTEGER NOT NULL,                -- ns at entry
    dur INTEGER NOT NULL,               -- ns entry -> return (open calls: entry -> when drained)
    thread_id INTEGER NOT NULL REFERENCES thread(id),
    api_id INTEGER NOT NULL REFERENCES nccl_api(id),
    ret INTEGER,                        -- ncclResult_t (0 = success); NULL while open
    count INTEGER,                      -- elements sent/reduced; NULL for calls without data
    datatype INTEGER,                   -- ncclDataType_t (7 = float32, 9 = bfloat16, ...)
    op INTEGER,                         -- ncclRedOp_t (0 = sum, ...), NULL when none
    peer INTEGER,                       -- root (broadcast/reduce) or peer (send/recv) rank, NULL when none
    handle INTEGER,                     -- ncclComm_t pointer: with the process, finds nccl_comm
    stream INTEGER,                     -- cudaStream_t the collective was enqueued on
    cgroup_id INTEGER NOT NULL,         -- cgroup v2 id of the calling thread
    python_stack_id INTEGER REFERENCES python_stack(id), -- Python stack at the NCCL call's entry
    open INTEGER NOT NULL DEFAULT 0     -- 1: had not returned when drained (stop or dump): a hang's call
);
INSERT INTO nccl_call_v13 SELECT *, 0 FROM nccl_call;
DROP TABLE nccl_call;
ALTER TABLE nccl_call_v13 RENAME TO nccl_call;

PRAGMA legacy_alter_table = OFF;
