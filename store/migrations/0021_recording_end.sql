-- Schema v21: a recording that can be left on says how it ended and what it kept. A recorder that
-- stopped writing by itself (the disk was full) says why and when; one that died (kill -9, a
-- crash) is found dead by the next reader, which marks its session with the last second written.
-- A flight recording says when the window it kept was shorter than --keep because of --max-size.

ALTER TABLE session ADD COLUMN stop_reason TEXT;  -- why the recording ended without a stop asked for ('disk full: ...', 'recorder died: ...'); NULL: stopped on request, or still recording
ALTER TABLE session ADD COLUMN written_ts INTEGER;  -- ns CLOCK_MONOTONIC: the last second the recorder committed (updated once a second); where a recording whose recorder died ends

-- table: flight_window
-- The window a flight recording (recorder start --keep) kept: one row per session, updated while
-- recording. The window is shorter than --keep while the database would not fit in --max-size.
CREATE TABLE flight_window (
    session_id INTEGER PRIMARY KEY REFERENCES session(id),
    keep_ns INTEGER NOT NULL,           -- ns: --keep, the window asked for
    max_bytes INTEGER,                  -- bytes: --max-size (database and its write-ahead log); NULL: none
    shortest_ns INTEGER,                -- ns: the shortest window kept because of --max-size; NULL: --keep always held
    first_short_ts INTEGER,             -- ns CLOCK_MONOTONIC: the window was first shorter than --keep
    last_short_ts INTEGER               -- ns CLOCK_MONOTONIC: and last (the latest second it was)
);
