-- Schema v15: the flight recorder. A recording made with `recorder start --keep DURATION` keeps only
-- its last DURATION of events; the incidents it saved (by a trigger, by `recorder dump` or SIGUSR1)
-- are listed in the recording they were cut from, and each incident recording lists itself.

-- table: incident
-- An incident recording: the rows of a time window copied from a flight recording into a database
-- of their own (<db>.incidents/<UTC time>-<trigger>.db, or the file `recorder dump -o` named).
CREATE TABLE incident (
    id INTEGER PRIMARY KEY,
    session_id INTEGER NOT NULL REFERENCES session(id), -- the session the window was cut from
    ts INTEGER NOT NULL,                -- ns CLOCK_MONOTONIC: when the trigger fired (or the dump was asked for)
    trigger TEXT NOT NULL,              -- 'stall', 'hung-call', 'nvme', 'io-error', 'xid', 'aer', 'oom', 'dump', 'signal'
    detail TEXT NOT NULL,               -- what fired it, in words (the kernel log line, the call and how long it was in flight)
    start_ts INTEGER NOT NULL,          -- ns: the window saved begins
    end_ts INTEGER NOT NULL,            -- ns: and ends
    file TEXT NOT NULL,                 -- the incident recording's path when it was saved
    own INTEGER NOT NULL DEFAULT 0      -- 1 in the incident recording itself (what cut it), 0 in the recording it was cut from
);
