-- Schema v11: thread renames. A thread's name (comm) is what it was called when first seen; thread
-- pools and data loaders name their threads and processes after they start, so every rename is kept
-- with its time, and thread.name (and process.name, for a main thread) is the latest name.

-- table: thread_name
-- A name a traced thread took during the session (task:task_rename), in time order.
CREATE TABLE thread_name (
    id INTEGER PRIMARY KEY,
    session_id INTEGER NOT NULL REFERENCES session(id),
    thread_id INTEGER NOT NULL REFERENCES thread(id), -- the thread renamed
    ts INTEGER NOT NULL,                -- ns when it took the name
    name TEXT NOT NULL                  -- the new name (16 bytes at most)
);
CREATE INDEX thread_name_thread ON thread_name(thread_id, ts);
