CREATE INDEX IF NOT EXISTS nccl_call_thread_ts ON nccl_call(thread_id, ts);
CREATE INDEX IF NOT EXISTS step_mark_thread_ts ON step_mark(thread_id, ts);
CREATE INDEX IF NOT EXISTS lineage_mark_thread_ts ON lineage_mark(thread_id, ts);
CREATE INDEX IF NOT EXISTS step_mark_session_step ON step_mark(session_id, step);
