-- Secondary indexes for store/views/0006_inferred_lineage.sql, built at stop. An event's step is
-- the last step mark of its process at or before its ts: found by walking the session's marks
-- back in time from ts (a few rows) instead of sorting every mark of the process.
CREATE INDEX IF NOT EXISTS step_mark_session_ts ON step_mark(session_id, ts);
