-- Schema v24: causal links and step causes stored when a session stops. The causal_link and
-- step_cause views join every layer's rows per step and per call; over an hour of a job that is
-- seconds to minutes of work per whole-session query. A complete session's rows are written once,
-- at the stop (Store.store_baselines), into causal_link_stored and step_cause_stored, and the views
-- read them; a session without a causal_link_session row (still recording, killed, made by an
-- older recorder) is computed on the fly (views causal_link_live, step_cause_live).
-- Changing a rule the links apply (slow_call_rule, wait_chain_rule) in the sqlite3 shell drops the
-- stored links (the triggers below), so the views compute them again under the new rule.

-- table: causal_link_stored
-- The rows of view causal_link_live for the sessions listed in causal_link_session.
CREATE TABLE causal_link_stored (
    session_id INTEGER NOT NULL,        -- recording session
    from_table TEXT NOT NULL,           -- table of the row explained ('step_mark', 'offcpu_interval', ...)
    from_id INTEGER NOT NULL,           -- its id
    relation TEXT NOT NULL,             -- how: 'off_cpu', 'slow_call', 'woken_after', 'io', 'hit_by', ...
    to_table TEXT NOT NULL,             -- table of the row that explains it
    to_id INTEGER,                      -- its id
    dur INTEGER                         -- ns it accounts for, NULL for an event without a duration
);
CREATE INDEX causal_link_stored_from ON causal_link_stored(from_table, from_id);

-- table: step_cause_stored
-- The rows of view step_cause_live for the sessions listed in causal_link_session.
CREATE TABLE step_cause_stored (
    session_id INTEGER NOT NULL,        -- recording session
    step_mark_id INTEGER NOT NULL,      -- the step (step_mark.id)
    cause TEXT NOT NULL,                -- cpu_wait, blocked, reclaim, dirty_throttle, cuda_call, nccl_wait
    detail TEXT,                        -- who or what (the process, the reason, the API)
    dur INTEGER,                        -- ns of the step's thread
    events INTEGER NOT NULL             -- rows behind it
);
CREATE INDEX step_cause_stored_step ON step_cause_stored(step_mark_id);

-- table: causal_link_session
-- The sessions whose links and step causes are in causal_link_stored and step_cause_stored.
CREATE TABLE causal_link_session (
    session_id INTEGER PRIMARY KEY,     -- recording session
    links INTEGER NOT NULL,             -- rows stored
    stored_ts INTEGER NOT NULL          -- ns CLOCK_MONOTONIC of the session's end when they were stored
);

CREATE TRIGGER causal_link_slow_call_rule AFTER UPDATE ON slow_call_rule
BEGIN
    DELETE FROM causal_link_session;
    DELETE FROM causal_link_stored;
    DELETE FROM step_cause_stored;
END;

CREATE TRIGGER causal_link_wait_chain_rule AFTER UPDATE ON wait_chain_rule
BEGIN
    DELETE FROM causal_link_session;
    DELETE FROM causal_link_stored;
    DELETE FROM step_cause_stored;
END;
