-- Schema v5: NCCL calls and communicators, and the markers training scripts call (steps, lineage
-- labels, checkpoint writes). ts and dur are ns of CLOCK_MONOTONIC.

-- table: nccl_api
-- The NCCL symbols the recorder traces; nccl_call.api_id refers to it (filled at session start).
CREATE TABLE nccl_api (
    id INTEGER PRIMARY KEY,             -- index in recorder/layers/workload/nccl.py APIS
    name TEXT NOT NULL UNIQUE,          -- exported symbol, e.g. 'ncclAllReduce'
    kind TEXT NOT NULL                  -- 'collective', 'p2p', 'group', 'init', 'destroy'
);

-- table: nccl_comm
-- A communicator as one rank (process) sees it, from its ncclCommInitRank* call. comm_hash is the
-- same on every rank of the communicator: it joins recordings of several ranks merged in one DB.
CREATE TABLE nccl_comm (
    id INTEGER PRIMARY KEY,
    session_id INTEGER NOT NULL REFERENCES session(id),
    process_id INTEGER NOT NULL REFERENCES process(id), -- the rank's process
    handle INTEGER NOT NULL,            -- ncclComm_t pointer in that process
    comm_hash INTEGER NOT NULL,         -- hash of the ncclUniqueId (64-bit FNV-1a), equal across ranks
    rank INTEGER NOT NULL,              -- this process's rank in the communicator
    nranks INTEGER NOT NULL,            -- world size of the communicator
    init_ts INTEGER NOT NULL            -- ns when ncclCommInitRank was entered
);

-- table: nccl_call
-- One NCCL call, recorded at its entry with its duration.
CREATE TABLE nccl_call (
    id INTEGER PRIMARY KEY,
    session_id INTEGER NOT NULL REFERENCES session(id),
    ts INTEGER NOT NULL,                -- ns at entry
    dur INTEGER NOT NULL,               -- ns entry -> return
    thread_id INTEGER NOT NULL REFERENCES thread(id),
    api_id INTEGER NOT NULL REFERENCES nccl_api(id),
    ret INTEGER NOT NULL,               -- ncclResult_t (0 = success)
    count INTEGER,                      -- elements sent/reduced; NULL for calls without data
    datatype INTEGER,                   -- ncclDataType_t (7 = float32, 9 = bfloat16, ...)
    op INTEGER,                         -- ncclRedOp_t (0 = sum, ...), NULL when none
    peer INTEGER,                       -- root (broadcast/reduce) or peer (send/recv) rank, NULL when none
    handle INTEGER,                     -- ncclComm_t pointer: with the process, finds nccl_comm
    stream INTEGER,                     -- cudaStream_t the collective was enqueued on
    cgroup_id INTEGER NOT NULL
);

-- table: step_mark
-- recorder.step(n) calls: the thread starts working on step n at ts.
CREATE TABLE step_mark (
    id INTEGER PRIMARY KEY,
    session_id INTEGER NOT NULL REFERENCES session(id),
    ts INTEGER NOT NULL,                -- ns of the call
    thread_id INTEGER NOT NULL REFERENCES thread(id),
    step INTEGER NOT NULL,              -- the step number the script passed
    inferred INTEGER NOT NULL DEFAULT 0 -- 1 when recovered from the trace's periodic structure, not a marker
);

-- table: lineage_label
-- The label registry: every lineage tag seen, with its label (read in full from the process).
CREATE TABLE lineage_label (
    session_id INTEGER NOT NULL REFERENCES session(id),
    tag INTEGER NOT NULL,               -- 64-bit tag (first 8 bytes of BLAKE2b of the label)
    label TEXT NOT NULL,                -- the label; bytes that are not UTF-8 appear as \xNN
    PRIMARY KEY (session_id, tag)
);

-- table: lineage_mark
-- recorder.lineage() scope changes: from ts on, the thread's lineage tag is `tag` (0 = none).
CREATE TABLE lineage_mark (
    id INTEGER PRIMARY KEY,
    session_id INTEGER NOT NULL REFERENCES session(id),
    ts INTEGER NOT NULL,                -- ns of the change
    thread_id INTEGER NOT NULL REFERENCES thread(id),
    tag INTEGER NOT NULL                -- the tag now current on the thread, 0 = none
);

-- table: checkpoint_mark
-- recorder.checkpoint(path) scopes: phase 1 begins writing the file, phase 2 ends it.
CREATE TABLE checkpoint_mark (
    id INTEGER PRIMARY KEY,
    session_id INTEGER NOT NULL REFERENCES session(id),
    ts INTEGER NOT NULL,                -- ns of the call
    thread_id INTEGER NOT NULL REFERENCES thread(id),
    phase INTEGER NOT NULL,             -- 1 begin, 2 end
    tag INTEGER NOT NULL,               -- lineage tag current on the thread, 0 = none
    path TEXT NOT NULL                  -- absolute path of the checkpoint file
);
