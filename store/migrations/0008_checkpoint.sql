-- Schema v8: checkpoint integrity on stock kernels. Files opted in through recorder.checkpoint(path)
-- or the xattr user.ai.checkpoint are followed from their open to their close (syscall tracepoints:
-- bpf/checkpoint.bpf.c), hashed (sha256) by the recorder after they are complete, and checked again
-- at the session stop. Written by recorder/layers/checkpoint.py; judged by the checkpoint_integrity view
-- (store/views/0007_checkpoint.sql). ts and dur are ns of CLOCK_MONOTONIC, sizes and offsets bytes.

-- table: checkpoint_file
-- One checkpoint file as one process wrote it: from its first open for writing in the session until
-- it is complete (every descriptor closed and, for a file opened inside recorder.checkpoint(), the
-- scope left). Reopening it before it is complete adds an `open` to the same row; opening it again
-- afterwards starts a new row (a new checkpoint at that path, or, for opted_by 'rewrite', a
-- modification of the completed one).
CREATE TABLE checkpoint_file (
    id INTEGER PRIMARY KEY,
    session_id INTEGER NOT NULL REFERENCES session(id),
    ts INTEGER NOT NULL,                -- ns: the first open was entered
    dur INTEGER NOT NULL,               -- ns: that open's entry -> return
    thread_id INTEGER NOT NULL REFERENCES thread(id), -- the thread that opened it first
    path TEXT NOT NULL,                 -- absolute path it was opened at (relative paths resolved against the process's cwd or dirfd)
    opted_by TEXT NOT NULL,             -- marker_scope (opened inside recorder.checkpoint()), marker_path (opened at a scope's path by another thread), xattr (user.ai.checkpoint), rewrite (a completed checkpoint opened for writing again outside any scope)
    scope_path TEXT,                    -- the path given to recorder.checkpoint() whose scope it was opened in, NULL when none
    scope_ts INTEGER,                   -- ns: that scope began, NULL when none
    scope_thread_id INTEGER REFERENCES thread(id), -- the thread in that scope, NULL when none
    scope_end_ts INTEGER,               -- ns: that scope ended, NULL if it did not end during the session (or no scope)
    tag INTEGER,                        -- lineage tag current in the scope (recorder.lineage), NULL when none
    dev_major INTEGER,                  -- major number of the file system's device (stat st_dev), NULL if the file was gone when looked at
    dev_minor INTEGER,                  -- minor number of that device
    ino INTEGER,                        -- inode number, NULL if the file was gone when looked at
    modifies_file_id INTEGER REFERENCES checkpoint_file(id) -- opted_by 'rewrite': the completed checkpoint file this open modifies
);

-- table: checkpoint_extent
-- One write syscall on a checkpoint file (write, pwrite64, writev, pwritev, pwritev2, sendfile,
-- copy_file_range): the bytes it wrote at which offset. Offsets of write/writev/sendfile come from
-- the descriptor's position as traced (open, writes, lseek).
CREATE TABLE checkpoint_extent (
    id INTEGER PRIMARY KEY,
    session_id INTEGER NOT NULL REFERENCES session(id),
    file_id INTEGER NOT NULL REFERENCES checkpoint_file(id),
    ts INTEGER NOT NULL,                -- ns: the syscall was entered
    dur INTEGER NOT NULL,               -- ns: entry -> return
    thread_id INTEGER NOT NULL REFERENCES thread(id), -- writing thread
    syscall TEXT NOT NULL,              -- write, pwrite64, writev, pwritev, pwritev2, sendfile, copy_file_range
    file_offset INTEGER,                -- bytes: where the write began in the file, NULL when unknown (O_APPEND, RWF_APPEND)
    size_bytes INTEGER NOT NULL,        -- bytes written (the return value), 0 on error
    requested_bytes INTEGER,            -- bytes asked for (write, pwrite64, sendfile, copy_file_range), NULL for vectored writes
    error INTEGER NOT NULL              -- 0, or the negative errno the syscall returned
);

-- table: checkpoint_op
-- Everything else done to a checkpoint file: each open (also the first), fsync, fdatasync,
-- ftruncate, close, and each rename that moved it (of the file or of a folder above it).
CREATE TABLE checkpoint_op (
    id INTEGER PRIMARY KEY,
    session_id INTEGER NOT NULL REFERENCES session(id),
    file_id INTEGER NOT NULL REFERENCES checkpoint_file(id),
    ts INTEGER NOT NULL,                -- ns: the syscall was entered
    dur INTEGER NOT NULL,               -- ns: entry -> return
    thread_id INTEGER NOT NULL REFERENCES thread(id), -- calling thread
    op TEXT NOT NULL,                   -- open, fsync, fdatasync, ftruncate, close, rename
    fd INTEGER,                         -- descriptor (open, fsync, fdatasync, ftruncate, close), NULL for rename
    open_flags INTEGER,                 -- open: the O_* flags (O_TRUNC = 512, O_APPEND = 1024), else NULL
    size_bytes INTEGER,                 -- ftruncate: the new length in bytes, else NULL
    path TEXT,                          -- open: the absolute path opened; rename: the file's absolute path after it; else NULL
    error INTEGER NOT NULL              -- 0, or the negative errno the syscall returned
);

-- table: checkpoint_verify
-- One look at a checkpoint file's content after it was complete: the sha256 the recorder computed
-- in a low-priority thread of its own (trigger completed / writer_exited), the stat at the session
-- stop (method stat), and later re-hashes (`verify_checkpoints`, trigger recheck).
CREATE TABLE checkpoint_verify (
    id INTEGER PRIMARY KEY,
    session_id INTEGER NOT NULL REFERENCES session(id),
    file_id INTEGER NOT NULL REFERENCES checkpoint_file(id),
    ts INTEGER NOT NULL,                -- ns: the look began (a recheck after a reboot counts on that boot's clock)
    dur INTEGER NOT NULL,               -- ns: it took
    trigger TEXT NOT NULL,              -- completed (closed and scope left), writer_exited (its process ended first), session_stop, recheck
    method TEXT NOT NULL,               -- sha256 (content read), stat (size, mtime and inode only)
    path TEXT,                          -- the absolute path looked at, NULL when the file had no path left (renamed over)
    state TEXT NOT NULL,                -- sha256: hashed, missing, replaced (a different file is at the path), not_regular, unreadable, not_hashed (the session stopped first); stat: unchanged, changed, missing, replaced
    ino INTEGER,                        -- inode number found at the path, NULL when none
    size_bytes INTEGER,                 -- bytes: hashed (sha256) or st_size (stat), NULL when not read
    mtime_ns INTEGER,                   -- st_mtime in ns since the Unix epoch (wall clock), NULL when not read
    mtime_ts INTEGER,                   -- the same instant in ns of CLOCK_MONOTONIC (converted when read), NULL when not read
    sha256 TEXT,                        -- lowercase hex digest of the content, NULL unless method sha256 and state hashed
    detail TEXT                         -- why a state is not 'hashed' / 'unchanged', or what changed
);
